"""--force replaces only what parastream wrote: a bundle (its manifest), an output folder of `run`, a model
folder of `export-triton` (its marker).  Anything else, the current directory and any folder holding an
input are refused with one line, exit 2, and nothing is touched."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from graphs import ort_reference, three_branch_model
from onnx import TensorProto, helper

from parastream.launcher.bundle import Bundle
from parastream.pipeline.cli import main, output_file_names


def cli(capsys, *argv):
    code = main([str(a) for a in argv])
    return code, capsys.readouterr().err.strip()


def build_cli(capsys, model, out, *extra):
    return cli(capsys, "build", model, "-o", out, "--backend", "onnxruntime", "--no-search", "--quiet", *extra)


def tree(folder):
    """Every file under ``folder`` with its bytes (what must stay untouched)."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def assert_refused(code, err, *needles):
    assert code == 2, err
    assert len(err.splitlines()) == 1, err
    for n in needles:
        assert n in err, err


@pytest.fixture
def model(tmp_path):
    p = tmp_path / "models" / "m.onnx"
    p.parent.mkdir()
    onnx.save(three_branch_model(), p)
    (p.parent / "sibling.txt").write_text("another file beside the model")
    return p


def test_build_force_refuses_a_users_folder(model, tmp_path, capsys):
    out = tmp_path / "mine"
    (out / "sub").mkdir(parents=True)
    (out / "precious.txt").write_text("keep me")
    (out / "sub" / "notes.md").write_text("and me")
    before = tree(out)
    code, err = build_cli(capsys, model, out, "--force")
    assert_refused(code, err, str(out), "not a parastream bundle")
    assert tree(out) == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_build_force_refuses_the_models_folder_and_its_ancestors(model, tmp_path, capsys):
    before = tree(tmp_path)
    for out in (model.parent, tmp_path, model.parent / ".." / "models"):
        code, err = build_cli(capsys, model, out, "--force")
        assert_refused(code, err, "m.onnx")
    assert tree(tmp_path) == before


def test_build_force_refuses_the_current_directory(model, tmp_path, capsys, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    (work / "precious.txt").write_text("keep me")
    monkeypatch.chdir(work)
    for out in (".", work, tmp_path):
        code, err = build_cli(capsys, model, out, "--force")
        assert_refused(code, err, "current directory")
    assert (work / "precious.txt").read_text() == "keep me" and model.is_file()


def test_build_force_refuses_a_plain_file_and_a_symlink(model, tmp_path, capsys):
    f = tmp_path / "out.txt"
    f.write_text("not a folder")
    code, err = build_cli(capsys, model, f, "--force")
    assert_refused(code, err, "not a folder")
    assert f.read_text() == "not a folder"
    bundle = tmp_path / "real"
    assert build_cli(capsys, model, bundle)[0] == 0
    link = tmp_path / "link"
    link.symlink_to(bundle)
    code, err = build_cli(capsys, model, link, "--force")
    assert_refused(code, err, "symbolic link")
    assert link.is_symlink()


def test_build_force_replaces_a_bundle_but_not_one_holding_a_users_file(model, tmp_path, capsys):
    out = tmp_path / "out"
    assert build_cli(capsys, model, out, "--streams", "1")[0] == 0
    assert build_cli(capsys, model, out, "--streams", "3", "--force")[0] == 0
    assert Bundle.open(out).plan.num_streams == 3
    (out / "engines" / "my_notes.txt").write_text("mine")
    before = tree(out)
    code, err = build_cli(capsys, model, out, "--force")
    assert_refused(code, err, "engines/my_notes.txt", "parastream did not write")
    assert tree(out) == before
    # a manifest.json that is not parastream's does not make a folder a bundle
    other = tmp_path / "other"
    other.mkdir()
    (other / "manifest.json").write_text('{"name": "my web app"}')
    code, err = build_cli(capsys, model, other, "--force")
    assert_refused(code, err, "not a parastream bundle")
    assert (other / "manifest.json").read_text() == '{"name": "my web app"}'


def test_run_output_dir_force(model, tmp_path, capsys):
    bundle = tmp_path / "b"
    assert build_cli(capsys, model, bundle)[0] == 0
    x = tmp_path / "x.npy"
    np.save(x, np.random.default_rng(0).standard_normal((1, 4, 8, 8)).astype(np.float32))
    res = tmp_path / "res"
    code, err = cli(capsys, "run", bundle, "--input", f"input={x}", "--output-dir", res)
    assert code == 0, err
    assert cli(capsys, "run", bundle, "--input", f"input={x}", "--output-dir", res, "--force")[0] == 0
    ref = ort_reference(onnx.load(model), {"input": np.load(x)})
    for name, value in ref.items():
        np.testing.assert_allclose(np.load(res / f"{name}.npy"), value, rtol=1e-4, atol=1e-5)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "precious.txt").write_text("keep me")
    for target, needle in ((mine, "not an output folder"), (bundle, "an input of this command"), (tmp_path, "would replace")):
        before = tree(target)
        code, err = cli(capsys, "run", bundle, "--input", f"input={x}", "--output-dir", target, "--force")
        assert_refused(code, err, needle)
        assert tree(target) == before
    (res / "extra.npy").write_bytes(b"mine")
    code, err = cli(capsys, "run", bundle, "--input", f"input={x}", "--output-dir", res, "--force")
    assert_refused(code, err, "extra.npy")


def test_export_triton_force(model, tmp_path, capsys):
    pytest.importorskip("tritonclient.grpc")
    bundle = tmp_path / "b"
    assert build_cli(capsys, model, bundle)[0] == 0
    repo = tmp_path / "repo"
    assert cli(capsys, "export-triton", bundle, repo, "--name", "m")[0] == 0
    assert cli(capsys, "export-triton", bundle, repo, "--name", "m", "--force")[0] == 0
    # a served folder: the server's Python left the bytecode of model.py beside it; --force still replaces it
    import py_compile
    import sys

    pyc = repo / "m" / "1" / "__pycache__" / f"model.{sys.implementation.cache_tag}.pyc"
    py_compile.compile(str(repo / "m" / "1" / "model.py"), cfile=str(pyc), doraise=True)
    assert cli(capsys, "export-triton", bundle, repo, "--name", "m", "--force")[0] == 0
    # bytecode of a file parastream did not write is the user's
    (repo / "m" / "1" / "__pycache__").mkdir()
    (repo / "m" / "1" / "__pycache__" / "helper.cpython-312.pyc").write_bytes(b"users")
    code, err = cli(capsys, "export-triton", bundle, repo, "--name", "m", "--force")
    assert_refused(code, err, "helper.cpython-312.pyc")
    (repo / "users").mkdir()
    (repo / "users" / "precious.txt").write_text("keep me")
    code, err = cli(capsys, "export-triton", bundle, repo, "--name", "users", "--force")
    assert_refused(code, err, "not a model folder of `parastream export-triton`")
    assert (repo / "users" / "precious.txt").read_text() == "keep me"
    # REPO/NAME being the bundle itself
    before = tree(bundle)
    code, err = cli(capsys, "export-triton", bundle, tmp_path, "--name", "b", "--force")
    assert_refused(code, err, "would replace")
    assert tree(bundle) == before
    # build --triton-repo refuses the export target before building anything
    out = tmp_path / "out2"
    code, err = build_cli(capsys, model, out, "--triton-repo", repo, "--triton-name", "users", "--force")
    assert_refused(code, err, "users")
    assert not out.exists()


def test_output_file_names_are_distinct():
    files = output_file_names(["out/a", "out_a", "OUT_A", "a b", "..", "", "ü"])
    assert len(set(f.lower() for f in files.values())) == 7
    assert files["out/a"] == "out_a.npy" and all(f.endswith(".npy") and "/" not in f for f in files.values())
    assert not any(f.startswith(".") for f in files.values())


def test_run_keeps_outputs_whose_names_collide(tmp_path, capsys):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3]) for n in ("out/a", "out_a")]
    m = helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["out/a"], name="r"),
                                             helper.make_node("Neg", ["x"], ["out_a"], name="n")], "g", [x], outs),
                          opset_imports=[helper.make_opsetid("", 17)])
    p = tmp_path / "m.onnx"
    onnx.save(m, p)
    assert build_cli(capsys, p, tmp_path / "b")[0] == 0
    xv = np.random.default_rng(1).standard_normal((2, 3)).astype(np.float32)
    np.save(tmp_path / "x.npy", xv)
    assert cli(capsys, "run", tmp_path / "b", "--input", f"x={tmp_path / 'x.npy'}", "--output-dir", tmp_path / "res")[0] == 0
    files = output_file_names(["out/a", "out_a"])
    np.testing.assert_array_equal(np.load(tmp_path / "res" / files["out/a"]), np.maximum(xv, 0))
    np.testing.assert_array_equal(np.load(tmp_path / "res" / files["out_a"]), -xv)


def test_without_force_a_foreign_folder_is_refused_in_one_message(model, tmp_path, capsys):
    """Not first "pass --force" and then, with it, a refusal: the first message says that --force would not do."""
    out = tmp_path / "mine"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    code, err = build_cli(capsys, model, out)
    assert_refused(code, err, str(out), "not a parastream bundle", "--force replaces only")
    assert "pass --force" not in err
    bundle = tmp_path / "b"
    assert build_cli(capsys, model, bundle)[0] == 0
    code, err = build_cli(capsys, model, bundle)
    assert code == 2 and "already exists; pass --force to replace it" in err
