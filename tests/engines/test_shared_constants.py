"""Engines of the same weights share one copy of them (the buckets of a dynamic-batch bundle)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")

from parastream.launcher.engines.onnx_torch import convert, to_device_shared  # noqa: E402


def gemm_model(batch: int, seed: int) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    w = numpy_helper.from_array(rng.standard_normal((8, 4)).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.standard_normal(4).astype(np.float32), "b")
    s = numpy_helper.from_array(np.array(0.5, np.float32), "s")  # a 0-d constant
    g = helper.make_graph(
        [helper.make_node("Gemm", ["x", "w", "b"], ["h"]), helper.make_node("Mul", ["h", "s"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 4])], [w, b, s])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def ptrs(module) -> set[int]:
    return {t.data_ptr() for t in module.buffers()}


def run(module, model, x):
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    with torch.no_grad():
        got = module(torch.from_numpy(x))
    got = got[0] if isinstance(got, (list, tuple)) else got
    np.testing.assert_allclose(got.numpy(), ref, rtol=1e-5, atol=1e-6)


def test_the_same_weights_at_two_batches_are_one_copy():
    m1, m8 = gemm_model(1, seed=0), gemm_model(8, seed=0)
    a = to_device_shared(convert(m1), "cpu")
    b = to_device_shared(convert(m8), "cpu")
    assert ptrs(a) and ptrs(a) == ptrs(b)
    rng = np.random.default_rng(1)
    run(a, m1, rng.standard_normal((1, 8)).astype(np.float32))
    run(b, m8, rng.standard_normal((8, 8)).astype(np.float32))


def test_other_weights_or_dtype_are_not_shared():
    a = to_device_shared(convert(gemm_model(1, seed=0)), "cpu")
    other = gemm_model(1, seed=2)
    b = to_device_shared(convert(other), "cpu")
    shared = ptrs(a) & ptrs(b)
    # only the 0-d scale is equal in both models; w and b differ
    assert len(shared) == 1 and len(ptrs(b)) == 3
    c = to_device_shared(convert(gemm_model(1, seed=0), "float16"), "cpu")
    assert not ptrs(a) & ptrs(c)
    run(b, other, np.random.default_rng(3).standard_normal((1, 8)).astype(np.float32))
