"""--batch MIN:OPT:MAX: one static sub-bundle (plan, engines, graph) per batch bucket; any n in range runs on the
smallest bucket >= n and gets n rows back; out of range is refused; every bucket and a batch between buckets are
verified; a tampered bucket refuses to load."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from parastream.launcher import load
from parastream.launcher.buckets import BucketedLauncher, pad_rows, smallest_bucket
from parastream.launcher.bundle import Bundle
from parastream.launcher.errors import ParastreamError
from parastream.pipeline.buckets import between_buckets
from parastream.pipeline.cli import main
from parastream.pipeline.model_io import batch_buckets, parse_buckets


def _reshaping_model(path):
    """x: N x 16 -> MatMul (16x8) -> Reshape to N x 2 x 4 (the batch read by Shape: folded per bucket) -> Softmax
    over the last axis -> Reshape back to N x 8, and a second output y2 = Relu(x) (two outputs carry the batch)."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((16, 8)).astype(np.float32), "w")
    tail = numpy_helper.from_array(np.array([2, 4], np.int64), "tail")
    flat = numpy_helper.from_array(np.array([-1, 8], np.int64), "flat")
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["mm"], name="mm"),
        helper.make_node("Shape", ["x"], ["xs"], name="shape", end=1),
        helper.make_node("Concat", ["xs", "tail"], ["shape3"], name="cat", axis=0),
        helper.make_node("Reshape", ["mm", "shape3"], ["r3"], name="reshape"),
        helper.make_node("Softmax", ["r3"], ["sm"], name="softmax", axis=-1),
        helper.make_node("Reshape", ["sm", "flat"], ["z"], name="back"),
        helper.make_node("Relu", ["x"], ["y2"], name="relu"),
    ]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16])],
                          [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["N", 8]),
                           helper.make_tensor_value_info("y2", TensorProto.FLOAT, ["N", 16])], [w, tail, flat])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def _reference(path, x):
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {"x": x})))


@pytest.fixture(scope="module")
def bucketed(tmp_path_factory):
    from parastream.pipeline import build

    tmp = tmp_path_factory.mktemp("buckets")
    path = _reshaping_model(tmp / "m.onnx")
    bundle = build(path, tmp / "out", backend="onnxruntime", batch=(1, 2, 8), search=False)
    return path, bundle


# -- the buckets ------------------------------------------------------------------------------------------

def test_default_buckets_are_powers_of_two_with_min_and_max():
    assert batch_buckets((1, 16, 32)) == [1, 2, 4, 8, 16, 32]
    assert batch_buckets((3, 4, 20)) == [3, 4, 8, 16, 20]
    assert batch_buckets((1, 2, 8), [8, 1, 4]) == [1, 4, 8]
    assert parse_buckets("1,2,4, 8") == [1, 2, 4, 8] and parse_buckets(None) is None
    with pytest.raises(ParastreamError, match="must include MAX = 8"):
        batch_buckets((1, 2, 8), [1, 4])
    with pytest.raises(ParastreamError, match="--batch-buckets 16 is outside"):
        batch_buckets((1, 2, 8), [1, 8, 16])
    for bad in ("1,x", "0,2", ""):
        if bad:
            with pytest.raises(ParastreamError, match="--batch-buckets"):
                parse_buckets(bad)


def test_smallest_bucket_and_padding_rows():
    assert [smallest_bucket([1, 2, 4, 8], n) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    x = np.arange(6).reshape(3, 2)
    np.testing.assert_array_equal(pad_rows(x, 5), np.array([[0, 1], [2, 3], [4, 5], [0, 1], [2, 3]]))
    assert pad_rows(x, 3) is x
    assert between_buckets([1, 2, 4, 8]) == 3 and between_buckets([1, 2, 3]) is None


def test_every_bucket_is_a_static_bundle_at_its_batch(bucketed):
    path, bundle = bucketed
    rec = bundle.manifest["buckets"]
    assert rec["sizes"] == [1, 2, 4, 8] and rec["inputs"] == ["x"] and sorted(rec["outputs"]) == ["y2", "z"]
    subs = bundle.bucket_bundles()
    assert subs[8] is bundle and (bundle.path / "buckets" / "b4" / "plan.json").is_file()
    for size, sub in subs.items():
        assert [t.shape for t in sub.plan.inputs] == [[size, 16]]
        for t in sub.plan.tensors.values():  # every tensor, the Reshape's included, is static at the bucket's batch
            assert t.shape[0] == size, (size, t)
    report = bundle.report["buckets"]
    assert set(report["per_bucket"]) == {"1", "2", "4", "8"}
    assert all(row["verified"] is True for row in report["per_bucket"].values())
    assert report["between"]["batch"] == 3 and report["between"]["passed"] is True
    mem = report["memory"]
    assert mem["shared_buffer_bytes"] == mem["buffer_bytes_at_max"] < mem["buffer_bytes_if_not_shared"]


@pytest.mark.parametrize("n", [1, 3, 5, 8])
def test_any_batch_in_range_gets_its_own_rows(bucketed, n):
    path, bundle = bucketed
    run = load(bundle.path)
    assert isinstance(run, BucketedLauncher)
    x = np.random.default_rng(n).standard_normal((n, 16)).astype(np.float32)
    out = run({"x": x})
    ref = _reference(path, x)
    assert out["z"].shape == (n, 8) and out["y2"].shape == (n, 16)
    np.testing.assert_allclose(out["z"], ref["z"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out["y2"], ref["y2"], rtol=1e-6, atol=0)
    assert run.bucket_for(n) == smallest_bucket([1, 2, 4, 8], n)


def test_a_batch_outside_the_range_is_refused_naming_input_and_range(bucketed):
    _path, bundle = bucketed
    run = load(bundle.path)
    with pytest.raises(ParastreamError, match=r"input 'x' has batch 9, outside this bundle's range 1\.\.8"):
        run({"x": np.zeros((9, 16), np.float32)})
    with pytest.raises(ParastreamError, match="range 1..8"):
        run.bucket_for(0)


def test_a_tampered_bucket_refuses_to_load(bucketed, tmp_path):
    import shutil

    _path, bundle = bucketed
    copy = tmp_path / "copy"
    shutil.copytree(bundle.path, copy)
    Bundle.open(copy)  # intact
    engine = next((copy / "buckets" / "b2" / "engines").iterdir())
    engine.write_bytes(engine.read_bytes() + b"\0")
    with pytest.raises(ParastreamError, match=r"b2/engines/.*sha256 differs"):
        load(copy)


def test_a_bucket_folder_outside_the_bundle_is_refused(bucketed, tmp_path):
    import shutil

    from parastream.launcher.bundle import write_manifest

    _path, bundle = bucketed
    copy = tmp_path / "copy"
    shutil.copytree(bundle.path, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["buckets"]["folders"]["2"] = "../elsewhere"
    write_manifest(copy, {k: v for k, v in manifest.items() if k not in ("files", "version")})
    with pytest.raises(ParastreamError, match="outside the bundle"):
        Bundle.open(copy)


@pytest.mark.parametrize("change", [
    {"sizes": "abc"}, {"sizes": [1, 2, 4]}, {"max": 4}, {"min": 0}, {"inputs": "x"}, {"folders": {"8": "buckets/b4", "1": "."}},
    {"folders": []},
])
def test_an_inconsistent_bucket_record_is_refused_in_one_line(bucketed, tmp_path, change):
    import shutil

    from parastream.launcher.bundle import write_manifest

    _path, bundle = bucketed
    copy = tmp_path / "copy"
    shutil.copytree(bundle.path, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["buckets"].update(change)
    write_manifest(copy, {k: v for k, v in manifest.items() if k not in ("files", "version")})
    with pytest.raises(ParastreamError, match="manifest.json: .*bucket|buckets"):
        load(copy)


def test_verification_between_buckets_catches_wrong_rows(bucketed, monkeypatch, tmp_path):
    """The between-buckets check is real: a launcher that hands back the padded bucket's rows in another order
    (here: reversed) fails it, and the build writes nothing."""
    from parastream.pipeline import build

    path, _bundle = bucketed
    original = BucketedLauncher.__call__

    def reversed_rows(self, feeds):
        out = original(self, feeds)
        return {k: v[::-1] for k, v in out.items()}

    monkeypatch.setattr(BucketedLauncher, "__call__", reversed_rows)
    with pytest.raises(ParastreamError, match="served at batch 3"):
        build(path, tmp_path / "bad", backend="onnxruntime", batch=(1, 2, 8), search=False, measure=False)
    assert not (tmp_path / "bad").exists()


def test_cli_build_run_verify_bench_a_bucketed_bundle(tmp_path, capsys):
    path = _reshaping_model(tmp_path / "m.onnx")
    out = tmp_path / "out"
    assert main(["build", str(path), "-o", str(out), "--backend", "onnxruntime", "--batch", "1:2:8",
                 "--batch-buckets", "1,4,8", "--no-search", "--quiet"]) == 0
    assert json.loads((out / "manifest.json").read_text())["buckets"]["sizes"] == [1, 4, 8]
    x = np.random.default_rng(0).standard_normal((3, 16)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    assert main(["run", str(out), "--input", f"x={tmp_path / 'x.npy'}", "--output-dir", str(tmp_path / "r")]) == 0
    np.testing.assert_allclose(np.load(tmp_path / "r" / "z.npy"), _reference(path, x)["z"], rtol=1e-5, atol=1e-6)
    capsys.readouterr()
    assert main(["verify", str(out), "--json"]) == 0
    ver = json.loads(capsys.readouterr().out)
    assert ver["passed"] is True and sorted(ver["batches"], key=int) == ["1", "2", "4", "8"]
    assert main(["bench", str(out), "--json", "--runs", "3", "--warmup", "1"]) == 0
    rows = json.loads(capsys.readouterr().out)["batches"]
    assert [(r["batch"], r["bucket"]) for r in rows] == [(1, 1), (2, 4), (4, 4), (8, 8)]
    assert all(r["buckets_ms"] > 0 and r["padded_to_max_ms"] > 0 for r in rows)
    assert main(["inspect", str(out)]) == 0
    assert "batch 1..8 in buckets [1, 4, 8]" in capsys.readouterr().out.replace("\n", " ")


@pytest.mark.parametrize("argv, message", [
    (["--batch-buckets", "1,2"], "--batch-buckets needs --batch"),
    (["--batch", "1:2:8", "--batch-buckets", "1,2"], "must include MAX = 8"),
    (["--batch", "1:2:8", "--batch-buckets", "1,16"], "outside --batch 1:2:8"),
])
def test_cli_bad_buckets_are_refused_with_exit_2_and_nothing_written(tmp_path, capsys, argv, message):
    path = _reshaping_model(tmp_path / "m.onnx")
    out = tmp_path / "out"
    assert main(["build", str(path), "-o", str(out), "--backend", "onnxruntime", "--no-search", "--quiet", *argv]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("attrs, expect", [({"end": 1}, [5]), ({"start": 1}, [16]), ({"start": -1}, [16]),
                                           ({"start": 0, "end": 9}, [5, 16]), ({}, [5, 16])])
def test_shape_with_start_and_end_folds_to_its_slice(tmp_path, attrs, expect):
    """graphsurgeon folds Shape to the whole shape whatever its start/end; the loader folds the slice."""
    from parastream.pipeline.model_io import load_model

    g = helper.make_graph([helper.make_node("Shape", ["x"], ["s"], name="shape", **attrs),
                           helper.make_node("Cast", ["s"], ["sf"], name="cast", to=TensorProto.FLOAT),
                           helper.make_node("ReduceSum", ["x"], ["r"], name="sum", keepdims=0),
                           helper.make_node("Add", ["r", "sf"], ["y"], name="add")],
                          "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [5, 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [len(expect)])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, tmp_path / "s.onnx")
    loaded = load_model(tmp_path / "s.onnx")
    x = np.random.default_rng(0).standard_normal((5, 16)).astype(np.float32)
    sess = ort.InferenceSession(loaded.model.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], x.sum() + np.array(expect, np.float32), rtol=1e-5)


def test_the_top_level_manifest_is_hashed_once_and_the_report_carries_every_bucket_s_stage_seconds(tmp_path, monkeypatch):
    """A dynamic-batch build hashes the top-level manifest once, at the end (the staging ones only list files), and
    writes report.json's bucket record once; ``stage_seconds`` adds up the buckets' stages and the between-buckets
    verification, and is what ``parastream build --json`` prints."""
    from pathlib import Path

    import parastream.pipeline.buckets as buckets_module
    from parastream.pipeline import build
    from parastream.pipeline.report import build_summary

    _reshaping_model(tmp_path / "m.onnx")
    writes = []
    real = buckets_module.write_manifest

    def spy(out, manifest, **kw):
        writes.append((Path(out), kw.get("hashed", True)))
        real(out, manifest, **kw)

    monkeypatch.setattr(buckets_module, "write_manifest", spy)
    bundle = build(tmp_path / "m.onnx", tmp_path / "out", backend="onnxruntime", batch=(1, 2, 8), search=False)
    assert [hashed for _, hashed in writes] == [False, False, True]  # listed twice, hashed once: last
    stages = bundle.report["buckets"]["stage_seconds"]
    assert {"load", "engines", "verify", "verify_between"} <= set(stages) and all(v >= 0 for v in stages.values())
    assert build_summary(bundle)["stage_seconds"] == stages
    assert json.loads((tmp_path / "out" / "report.json").read_text())["buckets"]["stage_seconds"] == stages
    Bundle.open(tmp_path / "out", check_hashes=True)
