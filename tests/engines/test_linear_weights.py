"""A MatMul's constant 2-d weight stored transposed by the torch converter (``onnx_torch._linear_weights``): the
product runs as torch's Linear does (weight [out, in], cuBLAS's "TN" GEMM), where exporters leave X·W with W
[in, out].  Checked against ONNX Runtime on the CPU (plain MatMul, 2-d and 3-d inputs, parastream's fused GEMM
epilogue node); and where it must not fire: a weight another step also reads, a constant left operand, a 3-d
weight, a weight that is a graph output, an integer weight.  And an X of rank 3 or more times a 2-d W runs as
one product over X's rows even where its leading dimensions are not contiguous (a transposed X), where a
batched product stays batched."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")

from parastream.core import fused_ops  # noqa: E402
from parastream.launcher.engines.onnx_torch import convert  # noqa: E402


def _model(nodes, inputs, outputs, inits, extra_opsets=()) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "m", [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
                          [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 20), *extra_opsets])
    m.ir_version = 9
    return onnx.shape_inference.infer_shapes(m)


def _w(rng, name, shape):
    return numpy_helper.from_array((rng.standard_normal(shape) * 0.3).astype(np.float32), name)


def _run(model, feeds):
    mod = convert(model)
    with torch.no_grad():
        got = mod(*[torch.from_numpy(feeds[n]) for n in mod.input_names])
    return mod, [g.numpy() for g in got]


def _ort(model, feeds):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def _buffers(mod) -> dict[tuple, int]:
    out: dict[tuple, int] = {}
    for b in mod.buffers():
        out[tuple(b.shape)] = out.get(tuple(b.shape), 0) + 1
    return out


@pytest.mark.parametrize("x_shape", [(5, 24), (2, 7, 24)], ids=["2d", "3d"])
def test_matmul_weights_are_stored_transposed_and_match_onnxruntime(x_shape):
    rng = np.random.default_rng(0)
    N = helper.make_node
    model = _model([N("MatMul", ["x", "w1"], ["h"]), N("Relu", ["h"], ["r"]), N("MatMul", ["r", "w2"], ["y"])],
                   [("x", list(x_shape))], ["y"], [_w(rng, "w1", (24, 40)), _w(rng, "w2", (40, 8))])
    feeds = {"x": rng.standard_normal(x_shape).astype(np.float32)}
    mod, got = _run(model, feeds)
    assert mod.linear_weights == 2
    assert _buffers(mod) == {(40, 24): 1, (8, 40): 1}  # [out, in], as torch's Linear keeps them
    np.testing.assert_allclose(got[0], _ort(model, feeds)[0], rtol=1e-5, atol=1e-5)


def test_the_fused_gemm_epilogue_node_takes_its_weight_transposed_too():
    rng = np.random.default_rng(1)
    node = helper.make_node(fused_ops.GEMM_ACTIVATION, ["x", "w", "b"], ["y"], domain=fused_ops.DOMAIN, activation="Relu")
    inits = [_w(rng, "w", (16, 12)), _w(rng, "b", (12,))]
    model = _model([node], [("x", [3, 6, 16])], ["y"], inits, extra_opsets=[fused_ops.opset_id()])
    plain = _model([helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Add", ["m", "b"], ["a"]),
                    helper.make_node("Relu", ["a"], ["y"])], [("x", [3, 6, 16])], ["y"], inits)
    feeds = {"x": rng.standard_normal((3, 6, 16)).astype(np.float32)}
    mod, got = _run(model, feeds)
    assert mod.linear_weights == 1 and (12, 16) in _buffers(mod)
    np.testing.assert_allclose(got[0], _ort(plain, feeds)[0], rtol=1e-5, atol=1e-5)


def test_weights_that_must_stay_as_they_are():
    rng = np.random.default_rng(2)
    N = helper.make_node
    nodes = [
        N("MatMul", ["x", "shared"], ["a"]), N("Add", ["x", "shared"], ["b"]),  # the weight is also an Add's operand
        N("MatMul", ["lhs", "x"], ["c"]),  # a constant left operand
        N("MatMul", ["x3", "w3"], ["d"]),  # a 3-d weight (a batched product)
        N("MatMul", ["x", "out_w"], ["e"]), N("Identity", ["out_w"], ["w_out"]),
    ]
    inits = [_w(rng, "shared", (6, 6)), _w(rng, "lhs", (6, 6)), _w(rng, "w3", (2, 6, 4)), _w(rng, "out_w", (6, 5))]
    model = _model(nodes, [("x", [6, 6]), ("x3", [2, 3, 6])], ["a", "b", "c", "d", "e", "w_out"], inits)
    feeds = {"x": rng.standard_normal((6, 6)).astype(np.float32), "x3": rng.standard_normal((2, 3, 6)).astype(np.float32)}
    mod, got = _run(model, feeds)
    # none is transposed: "shared" is also an Add's, "lhs" a left operand, "w3" 3-d, and "out_w" is also the
    # graph output "w_out" (its Identity folds to the constant itself)
    shapes = _buffers(mod)
    assert mod.linear_weights == 0
    assert (2, 6, 4) in shapes and shapes.get((6, 6)) == 2 and (6, 5) in shapes
    for g, r in zip(got, _ort(model, feeds)):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)


def test_a_weight_that_is_a_graph_output_stays_as_it_is():
    rng = np.random.default_rng(3)
    model = _model([helper.make_node("MatMul", ["x", "w"], ["y"])], [("x", [4, 6])], ["y", "w"], [_w(rng, "w", (6, 5))])
    feeds = {"x": rng.standard_normal((4, 6)).astype(np.float32)}
    mod, got = _run(model, feeds)
    assert mod.linear_weights == 0 and (6, 5) in _buffers(mod)
    for g, r in zip(got, _ort(model, feeds)):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)


def test_the_converter_version_is_in_the_engine_cache_key():
    """A cache entry compiled for the old weight layout is not taken for the new conversion."""
    from parastream.launcher.engines import BuildOptions
    from parastream.launcher.engines import onnx_torch
    from parastream.launcher.engines import torch as torch_backend

    rng = np.random.default_rng(4)
    model = _model([helper.make_node("MatMul", ["x", "w"], ["y"])], [("x", [4, 6])], ["y"], [_w(rng, "w", (6, 5))])
    key = torch_backend.cache_key(model, [], "float16", BuildOptions(), True, {})
    import unittest.mock as mock

    with mock.patch.object(onnx_torch, "CONVERTER_VERSION", onnx_torch.CONVERTER_VERSION + 1):
        assert torch_backend.cache_key(model, [], "float16", BuildOptions(), True, {}) != key


class _Products(torch.overrides.TorchFunctionMode):
    """The operand ranks of every ``torch.matmul`` the module calls."""

    def __init__(self):
        super().__init__()
        self.ranks: list[tuple[int, int]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.matmul:
            self.ranks.append((args[0].dim(), args[1].dim()))
        return func(*args, **(kwargs or {}))


def test_a_transposed_input_runs_as_one_matrix_product():
    """nn.MultiheadAttention(batch_first=True) exports its input projection as X [L, 1, E] (a Transpose of
    [1, L, E]) times W [E, 3E]: its leading dimensions are not contiguous, so ``torch.matmul`` would broadcast W
    into L matrix-vector products; the converter multiplies X's rows as one [L, E] matrix instead."""
    rng = np.random.default_rng(5)
    N = helper.make_node
    nodes = [N("Transpose", ["x"], ["xt"], perm=[1, 0, 2]), N("MatMul", ["xt", "w"], ["p"]),
             N("Add", ["p", "b"], ["y"])]
    model = _model(nodes, [("x", [1, 9, 8])], ["y"], [_w(rng, "w", (8, 24)), _w(rng, "b", (24,))])
    feeds = {"x": rng.standard_normal((1, 9, 8)).astype(np.float32)}
    mod = convert(model)
    with torch.no_grad(), _Products() as seen:
        got = mod(torch.from_numpy(feeds["x"]))
    assert seen.ranks == [(2, 2)]
    assert got[0].shape == (9, 1, 24)
    np.testing.assert_allclose(got[0].numpy(), _ort(model, feeds)[0], rtol=1e-5, atol=1e-5)


def test_batched_products_stay_batched():
    """Must not fire: both operands 3-d (attention's products), and a 2-d X (already one product)."""
    rng = np.random.default_rng(6)
    N = helper.make_node
    model = _model([N("MatMul", ["q", "k"], ["s"]), N("MatMul", ["x", "w"], ["y"])],
                   [("q", [2, 5, 4]), ("k", [2, 4, 5]), ("x", [5, 4])], ["s", "y"], [_w(rng, "w", (4, 3))])
    feeds = {n: rng.standard_normal(s).astype(np.float32) for n, s in (("q", (2, 5, 4)), ("k", (2, 4, 5)), ("x", (5, 4)))}
    mod = convert(model)
    with torch.no_grad(), _Products() as seen:
        got = mod(*[torch.from_numpy(feeds[n]) for n in mod.input_names])
    assert sorted(seen.ranks) == [(2, 2), (3, 3)]
    for g, r in zip(got, _ort(model, feeds)):
        np.testing.assert_allclose(g.numpy(), r, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_a_transposed_input_product_builds_and_verifies_on_the_gpu(tmp_path):
    """The same product as an engine compiled by Inductor on the GPU (fp16, the kernels the bundle ships), at the
    sizes of one ViT-B/16 input projection at batch 2 (X [197, 2, 768] a Transpose of [2, 197, 768], W [768, 2304]):
    the build's own verification against ONNX Runtime passes."""
    from parastream.pipeline import build

    rng = np.random.default_rng(7)
    N = helper.make_node
    nodes = [N("Transpose", ["x"], ["xt"], perm=[1, 0, 2]), N("MatMul", ["xt", "w"], ["p"]), N("Add", ["p", "b"], ["y"])]
    model = _model(nodes, [("x", [2, 197, 768])], ["y"], [_w(rng, "w", (768, 2304)), _w(rng, "b", (2304,))])
    onnx.save(model, tmp_path / "proj.onnx")
    bundle = build(tmp_path / "proj.onnx", tmp_path / "b", backend="torch", precision="fp16", search=False,
                   measure=False)
    assert bundle.report["verification"]["passed"]
    assert bundle.report["verification"]["engines_compiled_at_load"] == 0
