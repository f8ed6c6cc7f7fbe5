"""A bundle is confined to its folder: every path it names resolves inside it, its manifest lists every file,
and no entry point (run, verify, export-triton, validate-triton, launcher.load, Triton's model.py) reads a
file outside it -- even when the attacker re-hashed manifest.json."""

from __future__ import annotations

import itertools
import json
import os
import shutil

import numpy as np
import onnx
import pytest
from graphs import three_branch_model
from onnx import TensorProto, helper, numpy_helper

from parastream.launcher import load
from parastream.launcher.bundle import Bundle, write_manifest
from parastream.launcher.engines.onnxruntime import branch_model
from parastream.launcher.errors import ParastreamError
from parastream.pipeline import build
from parastream.pipeline.cli import main


@pytest.fixture
def bundle(tmp_path):
    model = tmp_path / "m.onnx"
    onnx.save(three_branch_model(), model)
    return build(model, tmp_path / "b", backend="onnxruntime", search=False, streams=3).path


def rehash(path):
    """What an attacker does after editing a bundle: recompute every sha256 in manifest.json."""
    manifest = json.loads((path / "manifest.json").read_text())
    write_manifest(path, {k: v for k, v in manifest.items() if k not in ("files", "version")})


def set_engine(path, engine):
    plan = json.loads((path / "plan.json").read_text())
    plan["branches"][0]["engine"] = engine
    (path / "plan.json").write_text(json.dumps(plan))


def tree(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def entry_points(capsys, path, tmp_path, x):
    """(name, exit code, stderr) of every CLI command that reads the bundle."""
    res = []
    for name, argv in (("run", ["run", path, "--input", f"input={x}", "--output-dir", tmp_path / "res"]),
                       ("verify", ["verify", path, "--model", tmp_path / "m.onnx"]),
                       ("export-triton", ["export-triton", path, tmp_path / "repo", "--name", "m"]),
                       ("bench", ["bench", path, "--runs", "1", "--warmup", "0"])):
        code = main([str(a) for a in argv])
        res.append((name, code, capsys.readouterr().err.strip()))
    return res


def assert_all_refused(capsys, path, tmp_path, *needles):
    x = tmp_path / "x.npy"
    np.save(x, np.zeros((1, 4, 8, 8), np.float32))
    before = tree(path)
    for name, code, err in entry_points(capsys, path, tmp_path, x):
        assert code == 2 and len(err.splitlines()) == 1, (name, err)
        assert all(n in err for n in needles), (name, err)
    assert tree(path) == before  # verify rewrote nothing
    assert not (tmp_path / "res").exists() and not (tmp_path / "repo" / "m").exists()
    with pytest.raises(ParastreamError):
        load(path)


def test_an_untouched_bundle_opens(bundle):
    assert len(Bundle.open(bundle).plan.branches) >= 2


@pytest.mark.parametrize("where", ["parent", "absolute"])
def test_engine_path_outside_the_bundle(bundle, tmp_path, capsys, where):
    outside = tmp_path / "outside.onnx"
    plan = Bundle.open(bundle).plan
    shutil.copyfile(bundle / plan.branches[0].engine, outside)  # a valid engine, so only the path is wrong
    set_engine(bundle, "../outside.onnx" if where == "parent" else str(outside))
    rehash(bundle)
    assert_all_refused(capsys, bundle, tmp_path, "outside the bundle")


def test_engine_symlink_leaving_the_bundle(bundle, tmp_path, capsys):
    engine = bundle / Bundle.open(bundle).plan.branches[0].engine
    outside = tmp_path / "outside.onnx"
    shutil.copyfile(engine, outside)
    engine.unlink()
    engine.symlink_to(outside)
    rehash(bundle)
    assert_all_refused(capsys, bundle, tmp_path, "resolves outside the bundle")


def test_an_engine_replaced_by_a_link_after_the_open_is_refused_at_its_read(bundle, tmp_path):
    """A load reads each engine from the path the open resolved inside the bundle, without resolving it again: a
    file swapped for a link since the open (to a copy outside, its bytes the same) is refused, not followed; the
    engines left as opened read as their files."""
    opened = Bundle.open(bundle)  # (a loading open keeps the bytes it hashed: below)
    first, second = opened.plan.branches[:2]
    assert opened.engine_bytes(second) == (bundle / second.engine).read_bytes()  # must not fire
    engine = bundle / first.engine
    outside = tmp_path / "outside.onnx"
    shutil.copyfile(engine, outside)
    engine.unlink()
    engine.symlink_to(outside)
    with pytest.raises(ParastreamError, match="became a symbolic link after the bundle was opened"):
        opened.engine_bytes(first)
    with pytest.raises(ParastreamError, match="became a symbolic link") as e:  # the launcher names the file once
        load(opened, device="cpu")
    assert str(e.value).count(str(engine.name)) == 1, e.value
    engine.unlink()
    with pytest.raises(ParastreamError, match="unreadable engine file"):
        opened.engine_bytes(first)


def test_a_loading_open_hands_the_load_the_engine_bytes_it_hashed(bundle, monkeypatch):
    """The artifact that runs is the one verified: a loading open keeps each engine file's bytes as it hashed them,
    and the load takes those, once (a file changed after the open changes nothing; a second read is the file's).
    Must not fire: an open that is not a load's keeps none, nor beyond KEEP_HASHED_BYTES."""
    from parastream.launcher import bundle as bundle_module

    opened = Bundle.open(bundle, loading=True)
    first = opened.plan.branches[0]
    hashed = (bundle / first.engine).read_bytes()
    (bundle / first.engine).write_bytes(b"changed after the open")
    assert opened.engine_bytes(first) == hashed
    assert opened.engine_bytes(first) == b"changed after the open"  # taken once: then read
    (bundle / first.engine).write_bytes(hashed)
    assert not Bundle.open(bundle)._hashed
    monkeypatch.setattr(bundle_module, "KEEP_HASHED_BYTES", len(hashed))  # room for one engine file at most
    assert len(Bundle.open(bundle, loading=True)._hashed) <= 1
    kept = Bundle.open(bundle, loading=True)
    assert kept._hashed
    kept.drop_kept_engines()  # a launcher's, after its load: what no engine took goes
    assert not kept._hashed
    kept = Bundle.open(bundle, loading=True)
    load(kept, device="cpu")  # the CPU launcher takes them all, then drops model.onnx's weights and what is left
    assert not kept._hashed


def test_manifest_without_files_is_not_a_bundle(bundle, tmp_path, capsys):
    manifest = json.loads((bundle / "manifest.json").read_text())
    del manifest["files"]
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    assert_all_refused(capsys, bundle, tmp_path, "lists no files")
    (bundle / "manifest.json").write_text(json.dumps(dict(manifest, files={})))
    assert_all_refused(capsys, bundle, tmp_path, "lists no files")


def test_unlisted_file_is_noticed(bundle, tmp_path, capsys):
    (bundle / "engines" / "extra.onnx").write_bytes(b"not listed")
    assert_all_refused(capsys, bundle, tmp_path, "extra.onnx", "not listed")


def test_manifest_naming_a_file_outside(bundle, tmp_path, capsys):
    (tmp_path / "secret.txt").write_text("secret")
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["files"]["../secret.txt"] = "0" * 64
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    assert_all_refused(capsys, bundle, tmp_path, "outside the bundle")


def test_engine_with_external_data(bundle, tmp_path, capsys):
    """An engine whose weights live 'in an external file' could read any file: refused."""
    opened = Bundle.open(bundle)
    engine = bundle / opened.plan.branches[0].engine
    # the engine whole (a written one leaves its weights to model.onnx: onnxruntime.slim_engine)
    m = branch_model(engine.read_bytes(), opened.initializer)
    (tmp_path / "w.bin").write_bytes(os.urandom(4096))
    for t in m.graph.initializer:
        onnx.external_data_helper.set_external_data(t, location="../../w.bin")
        t.ClearField("raw_data")
        t.ClearField("float_data")
        t.data_location = TensorProto.EXTERNAL
        break
    engine.write_bytes(m.SerializeToString())
    rehash(bundle)
    assert_all_refused(capsys, bundle, tmp_path, "external file")


def test_model_onnx_with_external_data_is_refused_by_its_readers_not_by_a_load(bundle, tmp_path, capsys):
    """model.onnx naming an external file, or changed: a plain open and ``model_path`` (what its readers take)
    refuse it; a load (``Bundle.open(loading=True)``) leaves model.onnx's checks to its readers, here the
    onnxruntime engines, which take their weights from it (``slim_engine``): ``run`` refuses it, naming
    model.onnx, and reads nothing outside the bundle."""
    m = onnx.load(str(bundle / "model.onnx"))
    (tmp_path / "w.bin").write_bytes(os.urandom(4096))
    t = m.graph.initializer[0]
    onnx.external_data_helper.set_external_data(t, location="../../w.bin")
    t.ClearField("raw_data")
    t.ClearField("float_data")
    t.data_location = TensorProto.EXTERNAL
    (bundle / "model.onnx").write_bytes(m.SerializeToString())
    rehash(bundle)
    with pytest.raises(ParastreamError, match="external file"):
        Bundle.open(bundle)
    opened = Bundle.open(bundle, loading=True)
    with pytest.raises(ParastreamError, match="model.onnx: tensor .* external file"):
        opened.model_path
    with open(bundle / "model.onnx", "ab") as f:  # tampered after the open: its reader hashes it
        f.write(b"\0")
    with pytest.raises(ParastreamError, match="model.onnx: sha256 differs"):
        Bundle.open(bundle, loading=True).model_path
    x = tmp_path / "x.npy"
    np.save(x, np.zeros((1, 4, 8, 8), np.float32))
    assert main(["run", str(bundle), "--input", f"input={x}", "--output-dir", str(tmp_path / "res")]) == 2
    assert "model.onnx" in capsys.readouterr().err and not (tmp_path / "res").exists()


def test_validate_triton_and_model_py_refuse_an_escaping_bundle(bundle, tmp_path, capsys):
    pytest.importorskip("tritonclient.grpc")
    from parastream.pipeline.triton import export_triton, validate_repository

    repo = tmp_path / "repo"
    model_dir = export_triton(bundle, repo, name="m")
    assert validate_repository(repo) == []
    copied = model_dir / "1" / "bundle"
    engine = copied / Bundle.open(copied).plan.branches[0].engine
    outside = tmp_path / "outside.onnx"
    shutil.copyfile(engine, outside)
    engine.unlink()
    engine.symlink_to(outside)
    rehash(copied)
    problems = validate_repository(repo)
    assert len(problems) == 1 and "resolves outside the bundle" in problems[0]
    assert main(["validate-triton", str(repo)]) == 1
    # a config whose bundle parameter leaves the version folder
    config = (model_dir / "config.pbtxt").read_text()
    (model_dir / "config.pbtxt").write_text(config.replace('string_value: "bundle"', 'string_value: "../../../b"'))
    problems = validate_repository(repo)
    assert any("outside the bundle" in p or "outside" in p for p in problems), problems


# -- the input model's external data -----------------------------------------------------------------
def _external_model(folder, location_target=None):
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((64, 64)).astype(np.float32), "w")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])
    m = helper.make_model(helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g", [x], [y], [w]),
                          opset_imports=[helper.make_opsetid("", 17)])
    p = folder / "ext.onnx"
    onnx.save(m, p, save_as_external_data=True, all_tensors_to_one_file=True, location="weights.data", size_threshold=0)
    return p


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_input_external_data_must_be_a_plain_file_inside(tmp_path, capsys, kind):
    folder = tmp_path / "models"
    folder.mkdir()
    p = _external_model(folder)
    data = folder / "weights.data"
    if kind == "symlink":
        (tmp_path / "other.bin").write_bytes(data.read_bytes())  # right size, someone else's bytes
        data.unlink()
        data.symlink_to(tmp_path / "other.bin")
        needle = "outside the model's folder"
    else:
        data.unlink()
        os.mkfifo(data)
        needle = "not a plain file"
    out = tmp_path / "out"
    code = main(["build", str(p), "-o", str(out), "--backend", "onnxruntime", "--no-search", "--quiet"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and needle in err, err
    assert not out.exists()


def test_hashes_checked_in_parallel_name_the_first_modified_file(bundle, monkeypatch):
    """Opening a bundle hashes its files on several threads; a tampered bundle names the first file (in the
    manifest's order) that differs, whichever thread hashed it, and an intact one opens."""
    import threading

    from parastream.launcher import bundle as bundle_mod

    threads = set()
    real = bundle_mod.sha256_file
    # the first two hashes wait for each other: they must run on two threads at once (a busy machine could
    # otherwise let one thread take every file before the second starts)
    meet = threading.Barrier(2, timeout=60)
    order = itertools.count()

    def hashed(f):
        threads.add(threading.current_thread().name)
        if next(order) < 2:  # (next() on a count is atomic)
            meet.wait()
        return real(f)

    monkeypatch.setattr(bundle_mod, "sha256_file", hashed)
    Bundle.open(bundle)
    files = list(json.loads((bundle / "manifest.json").read_text())["files"])
    assert len(files) >= 4 and all(t.startswith("parastream-hash") for t in threads) and len(threads) >= 2
    engines = [f for f in files if f.startswith("engines/")]
    for rel in (engines[-1], "model.onnx"):  # the later one first: the message must still name the earlier
        with open(bundle / rel, "ab") as f:
            f.write(b"\0")
    first = min((engines[-1], "model.onnx"), key=files.index)
    with pytest.raises(ParastreamError, match=rf"{first}: sha256 differs from manifest.json"):
        Bundle.open(bundle)
    monkeypatch.setattr(bundle_mod, "HASH_THREADS", 1)
    with pytest.raises(ParastreamError, match=rf"{first}: sha256 differs from manifest.json"):
        Bundle.open(bundle)
