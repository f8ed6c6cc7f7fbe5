"""The TensorRT backend against the real TensorRT on a GPU (marked ``trt`` and ``gpu``: skipped elsewhere).

TensorRT is not installable in the project's CI, so these skip there; they run wherever
``import tensorrt`` works and a GPU is present (an NGC TensorRT container built from the Dockerfile).
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from graphs import ort_reference
from graphs import three_branch_model as _three_branch_model
from graphs import two_output_model as _two_output_model
from onnx import TensorProto, helper

from parastream.launcher.engines import BuildOptions
from parastream.launcher.engines import tensorrt as backend
from parastream.launcher.errors import ParastreamError

pytestmark = [pytest.mark.trt, pytest.mark.gpu]


def three_branch_model(**kw) -> onnx.ModelProto:
    model = _three_branch_model(**kw)
    model.ir_version = 8  # an IR version every onnxruntime reads
    return model


def two_output_model(**kw) -> onnx.ModelProto:
    model = _two_output_model(**kw)
    model.ir_version = 8
    return model


@pytest.fixture(autouse=True)
def real_tensorrt():
    trt = pytest.importorskip("tensorrt")
    if getattr(trt, "IS_TEST_DOUBLE", False):
        pytest.skip("the TensorRT test double is installed as tensorrt")
    if backend.available() is not None:
        pytest.skip(backend.available())
    return trt


def options(tmp_path, **kw):
    return BuildOptions(device="cuda", cache_dir=str(tmp_path / "cache"), **kw)


def build(tmp_path, model, **kw):
    builder = backend.Builder(options(tmp_path, **kw))
    try:
        return builder, builder.build(model, "branch_000")
    finally:
        builder.close()


@pytest.mark.parametrize("precision, rtol", [("fp32", 1e-4), ("tf32", 5e-3), ("fp16", 2e-2)])
def test_engine_matches_onnxruntime(tmp_path, precision, rtol):
    model = two_output_model()
    builder, data = build(tmp_path, model, precision=precision)
    engine = backend.TrtEngine(data)
    x = np.random.default_rng(0).standard_normal((2, 16)).astype(np.float32)
    got, ref = engine.run({"x": x}), ort_reference(model, {"x": x})
    for name in ref:
        np.testing.assert_allclose(got[name], ref[name], rtol=rtol, atol=rtol)
    assert engine.scratch_bytes == backend._device_memory_size(engine.engine)
    report = builder.report()["branch_000"]
    assert report["layers"] and report["num_layers"] >= 1
    json.dumps(report)  # report.json material
    engine.close()


def test_timing_cache_is_reloaded(tmp_path):
    first, _ = build(tmp_path, three_branch_model())
    assert first.cache_path.is_file()
    second, _ = build(tmp_path, three_branch_model())
    assert second.report()["branch_000"]["timing_cache"]["state"] == "loaded"


def test_unsupported_op_names_the_node(tmp_path):
    node = helper.make_node("FancyOp", ["x"], ["y"], name="fancy", domain="com.example")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1)])
    with pytest.raises(ParastreamError, match="node 'fancy'"):
        build(tmp_path, model)


def test_dynamic_batch_profile(tmp_path):
    model = three_branch_model(batch="N")
    _, data = build(tmp_path, model, profiles={"input": ([1, 4, 8, 8], [2, 4, 8, 8], [4, 4, 8, 8])})
    from parastream.launcher.plan import TensorSpec

    engine = backend.TrtEngine(data, [TensorSpec("input", "float32", [3, 4, 8, 8])], [TensorSpec("output", "float32", [3, 12, 8, 8])])
    x = np.random.default_rng(1).standard_normal((3, 4, 8, 8)).astype(np.float32)
    np.testing.assert_allclose(engine.run({"input": x})["output"], ort_reference(model, {"input": x})["output"], rtol=1e-4, atol=1e-4)


def test_whole_model_runner(tmp_path):
    model = three_branch_model()
    runner = backend.TrtWholeModelRunner.from_model(model, options(tmp_path), max_aux_streams=2)
    x = np.random.default_rng(2).standard_normal((1, 4, 8, 8)).astype(np.float32)
    np.testing.assert_allclose(runner.run({"input": x})["output"], ort_reference(model, {"input": x})["output"], rtol=1e-4, atol=1e-4)
    assert 0 <= runner.aux_streams <= 2


def test_bundle_on_the_gpu_launcher_in_one_cuda_graph(tmp_path):
    pytest.importorskip("parastream.pipeline.analysis", reason="the pipeline's graph analysis has not landed")
    from parastream.launcher.gpu import GpuLauncher
    from parastream.pipeline import build as pipeline_build

    path = tmp_path / "m.onnx"
    onnx.save(three_branch_model(), path)
    bundle = pipeline_build(path, tmp_path / "out", backend="tensorrt", search=False, streams=3, cache_dir=str(tmp_path / "cache"))
    assert all(b.engine.endswith(".plan") for b in bundle.plan.branches)
    with GpuLauncher(bundle) as run:
        x = np.random.default_rng(3).standard_normal((1, 4, 8, 8)).astype(np.float32)
        for _ in range(3):  # graph replays
            np.testing.assert_allclose(run({"input": x})["output"], ort_reference(three_branch_model(), {"input": x})["output"],
                                       rtol=1e-4, atol=1e-4)
        scratch = [e._scratch for e in run.engines]
        assert len(set(scratch)) == len(scratch)  # every branch its own scratch memory
