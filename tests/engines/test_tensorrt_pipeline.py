"""``--backend tensorrt`` through the whole pipeline and the CLI, with the TensorRT test double in place.

The double (tests/trt_double) stands in for TensorRT and the GPU check is faked; the bundle's
verification then runs the engines' host path (``run``) under the CPU launcher.
"""

from __future__ import annotations

import json
import re
import sys

import numpy as np
import onnx
from onnx import numpy_helper
import pytest
import trt_double
from graphs import ort_reference
from graphs import three_branch_model as _three_branch_model

import parastream.launcher as launcher_api
from parastream.launcher import load
from parastream.launcher.errors import ParastreamError
from parastream.pipeline.cli import main


def three_branch_model(**kw) -> onnx.ModelProto:
    model = _three_branch_model(**kw)
    model.ir_version = 8  # an IR version every onnxruntime reads
    return model


@pytest.fixture
def trt(monkeypatch):
    fake = trt_double.install(monkeypatch)
    # the double runs on host memory: keep the verification on the CPU launcher even where a GPU exists
    monkeypatch.setattr(launcher_api, "cuda_device_count", lambda: 0)
    return fake


@pytest.fixture
def pipeline_build():
    pytest.importorskip("parastream.pipeline.analysis", reason="the pipeline's graph analysis (pipeline/analysis.py) has not landed")
    from parastream.pipeline import build

    return build


@pytest.fixture
def model_path(tmp_path):
    p = tmp_path / "three_branch.onnx"
    onnx.save(three_branch_model(), p)
    return p


def test_build_writes_plan_engines_and_inspector_report(trt, pipeline_build, model_path, tmp_path):
    out = tmp_path / "out"
    bundle = pipeline_build(model_path, out, backend="tensorrt", search=False, streams=3, cache_dir=str(tmp_path / "cache"))
    plan = bundle.plan
    assert plan.backend == "tensorrt" and len(plan.branches) >= 2
    engines = sorted(p.name for p in (out / "engines").iterdir())
    assert engines == [f"branch_{b.id:03d}.plan" for b in plan.branches]
    report = json.loads((out / "report.json").read_text())
    for b in plan.branches:
        entry = report["engines"][b.name]
        assert [layer["Name"] for layer in entry["layers"]] == b.nodes  # the engine inspector's layers
        assert entry["timing_cache"]["path"].startswith(str(tmp_path / "cache"))
    assert report["verification"]["passed"] is True
    assert json.loads((out / "manifest.json").read_text())["backend"] == "tensorrt"
    assert list((tmp_path / "cache").glob("timing-*.cache"))
    # every branch of the build used the same timing cache
    assert len({c[2]["cache"] for c in trt.calls("IBuilderConfig", "set_timing_cache")}) == 1

    run = load(out)
    x = np.random.default_rng(5).standard_normal((1, 4, 8, 8)).astype(np.float32)
    got = run({"input": x})["output"]
    np.testing.assert_allclose(got, ort_reference(three_branch_model(), {"input": x})["output"], rtol=1e-5, atol=1e-6)


def test_a_branch_tensorrt_cannot_parse_names_branch_and_node_and_writes_nothing(trt, pipeline_build, model_path, tmp_path):
    trt.UNSUPPORTED_OPS.add("Sigmoid")
    out = tmp_path / "out"
    with pytest.raises(ParastreamError) as e:
        pipeline_build(model_path, out, backend="tensorrt", search=False, streams=3, cache_dir=str(tmp_path / "cache"))
    msg = str(e.value)
    assert "branch_" in msg and "node 'sigmoid' (Sigmoid)" in msg and "Plugin not found" in msg
    branch = re.search(r"branch_\d+", msg).group()
    assert msg.count(branch) == 1, msg  # named once, not "branch_003 failed to build: ... of branch_003"
    assert msg.startswith(f"{model_path}: {branch}: ") and msg.count("\n") == 0
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "three_branch.onnx"]  # no half-written bundle


def test_a_branch_tensorrt_cannot_build_is_named_once(trt, pipeline_build, model_path, tmp_path, monkeypatch):
    def refuse(self, network, config):
        self.logger.log(trt.ILogger.Severity.ERROR, "[graphOptimizer.cpp] Error Code 2: Internal Error (no implementation)")
        return None

    monkeypatch.setattr(trt.Builder, "build_serialized_network", refuse)
    with pytest.raises(ParastreamError) as e:
        pipeline_build(model_path, tmp_path / "out", backend="tensorrt", search=False, streams=3, cache_dir=str(tmp_path / "cache"))
    msg = str(e.value)
    branch = re.search(r"branch_\d+", msg).group()
    assert msg == f"{model_path}: {branch}: TensorRT could not build the engine: [graphOptimizer.cpp] Error Code 2: Internal Error (no implementation)"
    assert not (tmp_path / "out").exists()


def _dynamic_batch_model(path):
    """x: N x 16 -> MatMul -> Relu -> z: N x 8 (the model of tests/pipeline/test_batch.py)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((16, 8)).astype(np.float32), "w")
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm"), helper.make_node("Relu", ["y"], ["z"], name="relu")],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["N", 8])], [w])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


# --batch MIN:OPT:MAX builds one engine per branch per batch bucket (pipeline/buckets.py): each engine is static at
# its bucket's batch, which TensorRT 10 builds without an optimization profile (profiles are for dynamic dimensions);
# the launcher runs any n in [MIN, MAX] on the smallest bucket >= n.

def test_batch_builds_every_bucket_s_engines_at_its_batch(trt, pipeline_build, tmp_path):
    path = _dynamic_batch_model(tmp_path / "dyn.onnx")
    bundle = pipeline_build(path, tmp_path / "out", backend="tensorrt", batch=(1, 4, 16), search=False,
                            cache_dir=str(tmp_path / "cache"))
    subs = bundle.bucket_bundles()
    assert sorted(subs) == [1, 2, 4, 8, 16]
    built = 0
    for size, sub in subs.items():
        assert [t.shape for t in sub.plan.inputs] == [[size, 16]]
        for b in sub.plan.branches:
            entry = sub.report["engines"][b.name]
            assert entry["profiles"] == {} and entry["inputs"]["x"] == [size, 16]  # static: no profile needed
            built += 1
    assert len(trt.calls("Builder", "build_serialized_network")) == built
    assert not trt.calls("IBuilderConfig", "add_optimization_profile")
    run = load(bundle.path)
    w = numpy_helper.to_array(onnx.load(str(path)).graph.initializer[0])
    for n in (1, 3, 16):
        x = np.random.default_rng(n).standard_normal((n, 16)).astype(np.float32)
        np.testing.assert_allclose(run({"x": x})["z"], np.maximum(x @ w, 0), rtol=1e-5, atol=1e-5)


def test_batch_reaches_every_branch_input_of_every_bucket(trt, pipeline_build, tmp_path):
    """Branches that read other branches' outputs take the bucket's batch too (every network input of every engine)."""
    path = tmp_path / "three_dyn.onnx"
    onnx.save(three_branch_model(batch="N"), path)
    bundle = pipeline_build(path, tmp_path / "out", backend="tensorrt", batch=(1, 4, 8), search=False, streams=3,
                            cache_dir=str(tmp_path / "cache"))
    for size, sub in bundle.bucket_bundles().items():
        assert len(sub.plan.branches) >= 2
        for b in sub.plan.branches:
            inputs = sub.report["engines"][b.name]["inputs"]
            assert set(inputs) == set(b.inputs)
            for name in b.inputs:
                assert inputs[name] == sub.plan.tensors[name].shape and inputs[name][0] == size, (size, b.name, name)
    x = np.random.default_rng(2).standard_normal((3, 4, 8, 8)).astype(np.float32)
    got = load(bundle.path)({"input": x})["output"]
    np.testing.assert_allclose(got, ort_reference(three_branch_model(batch="N"), {"input": x})["output"], rtol=1e-5, atol=1e-6)


def test_cli_backend_tensorrt_without_tensorrt_fails_at_once_with_the_install_hint(monkeypatch, model_path, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    out = tmp_path / "out"
    assert main(["build", str(model_path), "-o", str(out), "--backend", "tensorrt", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "--backend tensorrt: TensorRT is not installed: pip install tensorrt" in err and "NGC" in err
    assert not out.exists()


# --min-shapes/--max-shapes (dynamic shapes on a named axis) builds each bucket of the grid as static engines the
# same way; a length between buckets runs padded on the next bucket, cut back, equal to ONNX Runtime unpadded.
def test_a_sequence_grid_builds_static_engines_per_bucket_and_serves_lengths_between(trt, pipeline_build, tmp_path):
    pytest.importorskip("transformers")
    from dynamic_models import bert_feeds, tiny_bert

    path = tiny_bert(tmp_path / "bert.onnx")
    bundle = pipeline_build(path, tmp_path / "out", backend="tensorrt", search=False, min_shapes={"input_ids": [1, 8]},
                            max_shapes={"input_ids": [1, 16]}, shape_buckets={("input_ids", 1): [8, 16]})
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["buckets"]["between"]["passed"] and report["buckets"]["between"]["bucket"] == [16]
    for key, sub in bundle.bucket_bundles().items():
        for entry in sub.report["engines"].values():
            assert all(shape[1] == key[0] for shape in entry["inputs"].values() if len(shape) == 2)
            assert entry["profiles"] == {}  # static at the bucket: TensorRT's default profile
    run = load(tmp_path / "out")
    try:
        feeds = bert_feeds(1, 11, seed=4)
        got = run(feeds)["hidden"]
    finally:
        run.close()
    want = ort_reference(onnx.load(str(path)), feeds)["hidden"]
    assert got.shape == (1, 11, 32)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
