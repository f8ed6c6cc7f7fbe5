"""--batch MIN:OPT:MAX: parsed, checked against the model and --shapes; a build makes one bucket per batch size
(tests/pipeline/test_batch_buckets.py has the buckets end to end); bad values are refused."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from parastream.launcher.errors import ParastreamError
from parastream.pipeline.model_io import batch_profiles, parse_batch


def _dynamic_model(path, batch_dim="N"):
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((16, 8)).astype(np.float32), "w")
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm"), helper.make_node("Relu", ["y"], ["z"], name="relu")],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch_dim, 16])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [batch_dim, 8])], [w])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_parse_batch():
    assert parse_batch("1:8:32") == (1, 8, 32)
    assert parse_batch("4") == (4, 4, 4)
    assert parse_batch(None) is None
    for bad in ("8:1:32", "a:b:c", "1:2", "0:1:2"):
        with pytest.raises(ParastreamError, match="--batch"):
            parse_batch(bad)


def test_profiles_for_dynamic_batch(tmp_path):
    path = _dynamic_model(tmp_path / "m.onnx")
    shapes, profiles = batch_profiles(path, {}, (1, 8, 32))
    assert shapes == {"x": [8, 16]}
    assert profiles == {"x": ([1, 16], [8, 16], [32, 16])}


def test_fixed_batch_is_refused(tmp_path):
    path = _dynamic_model(tmp_path / "m.onnx", batch_dim=2)
    with pytest.raises(ParastreamError, match="no input of the model has a dynamic first dimension"):
        batch_profiles(path, {}, (1, 2, 4))


def test_batch_gives_the_batch_axis_whatever_shapes_gives_it(tmp_path):
    """--batch owns the first dimension of a dynamic-batch input; --shapes may write any value there."""
    path = _dynamic_model(tmp_path / "m.onnx")
    for first in (1, 4, 8):
        shapes, profiles = batch_profiles(path, {"x": [first, 16]}, (1, 8, 32))
        assert shapes == {"x": [8, 16]} and profiles == {"x": ([1, 16], [8, 16], [32, 16])}
    with pytest.raises(ParastreamError, match="dimension 1 is fixed to 16"):
        batch_profiles(path, {"x": [8, 15]}, (1, 8, 32))  # the other axes are still checked


def test_build_with_batch_serves_min_to_max(tmp_path):
    from parastream.launcher import load
    from parastream.pipeline import build

    path = _dynamic_model(tmp_path / "m.onnx")
    bundle = build(path, tmp_path / "out", backend="onnxruntime", batch=(1, 4, 16), search=False)
    plan = json.loads((bundle.path / "plan.json").read_text())
    assert [t["shape"] for t in plan["inputs"]] == [[16, 16]]  # the top level is the MAX bucket
    manifest = json.loads((bundle.path / "manifest.json").read_text())
    assert manifest["buckets"]["sizes"] == [1, 2, 4, 8, 16] and manifest["buckets"]["opt"] == 4
    run = load(bundle.path, device="cpu")
    w = numpy_helper.to_array(onnx.load(str(path)).graph.initializer[0])
    for n in (1, 4, 11, 16):
        x = np.random.default_rng(n).standard_normal((n, 16)).astype(np.float32)
        np.testing.assert_allclose(run({"x": x})["z"], np.maximum(x @ w, 0), rtol=1e-5, atol=1e-5)


def test_batch_with_min_equal_max_is_one_static_bundle(tmp_path):
    from parastream.pipeline import build

    path = _dynamic_model(tmp_path / "m.onnx")
    bundle = build(path, tmp_path / "out", backend="onnxruntime", batch=(4, 4, 4), search=False)
    assert [t.shape for t in bundle.plan.inputs] == [[4, 16]] and "buckets" not in bundle.manifest
