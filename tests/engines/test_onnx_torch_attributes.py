"""Attributes and input forms the torch converter once ignored, computing something other than ONNX Runtime:
each against ONNX Runtime on the CPU (values, shapes and dtypes), and each with a case it must refuse (naming
the node and what it refuses) where the converter cannot compute the same."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

torch = pytest.importorskip("torch")

from parastream.launcher.engines.onnx_torch import UnsupportedOp, convert  # noqa: E402

F, I64, I32, U8, B = TensorProto.FLOAT, TensorProto.INT64, TensorProto.INT32, TensorProto.UINT8, TensorProto.BOOL


def one_node(op, inputs, outputs, consts=None, opset=17, order=None, **attrs):
    """A model of one node; ``inputs``/``outputs``: [(name, elem_type, shape)], ``consts``: {name: array} (inputs
    after ``inputs`` unless ``order`` names the node's inputs in order).  Output shapes are left to inference."""
    consts = consts or {}
    names = order or [n for n, *_ in inputs] + list(consts)
    node = helper.make_node(op, names, [n for n, *_ in outputs], name=f"the_{op}", **attrs)
    g = helper.make_graph([node], op, [helper.make_tensor_value_info(*i) for i in inputs],
                          [helper.make_tensor_value_info(name, t, None) for name, t, *_ in outputs],
                          [numpy_helper.from_array(v, k) for k, v in consts.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    return m


def check(model, feeds, rtol=1e-6, atol=1e-6):
    """The converted module against ONNX Runtime: every output's shape, dtype and values."""
    import onnxruntime as ort

    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    ref = sess.run(None, feeds)
    module = convert(model)
    with torch.no_grad():
        outs = module(*[torch.from_numpy(feeds[n]) for n in module.input_names])
    assert len(outs) == len(ref)
    for o, r in zip(outs, ref):
        assert tuple(o.shape) == r.shape
        assert o.numpy().dtype == r.dtype
        np.testing.assert_allclose(o.numpy(), r, rtol=rtol, atol=atol)


rng = np.random.default_rng(0)


# -- pooling: ceil_mode with pads torch cannot take as its own (asymmetric, or more than half the kernel) ------

_CEIL_CASES = [(6, 2, 2, (0, 1)), (5, 3, 3, (1, 2)), (7, 3, 2, (1, 2)), (6, 3, 3, (0, 2))]


@pytest.mark.parametrize("op,extra,size,k,s,pads", [
    *[("MaxPool", {}, *c) for c in _CEIL_CASES],
    *[("AveragePool", {"count_include_pad": 1}, *c) for c in _CEIL_CASES],
    ("MaxPool", {"dilations": [2, 1]}, 6, 2, 3, (0, 1)),
])
def test_pool_ceil_mode_drops_a_window_that_starts_in_the_end_pad(op, extra, size, k, s, pads):
    """With ceil_mode, ONNX drops a last window that would start in the end padding; padded by ``F.pad``, torch
    saw that padding as input and kept the window (-inf for MaxPool, 0 for AveragePool)."""
    x = rng.standard_normal((1, 2, size, 5)).astype(np.float32)
    m = one_node(op, [("x", F, [1, 2, size, 5])], [("y", F)], opset=19, kernel_shape=[k, 2], strides=[s, 1],
                 pads=[pads[0], 0, pads[1], 1], ceil_mode=1, **extra)
    check(m, {"x": x}, rtol=1e-5, atol=1e-6)


def test_maxpool_of_integers_with_asymmetric_pads():
    """The pads F.pad adds are the integer type's least value (-inf is no uint8)."""
    x = rng.integers(0, 256, (1, 2, 5, 6)).astype(np.uint8)
    m = one_node("MaxPool", [("x", U8, [1, 2, 5, 6])], [("y", U8)], kernel_shape=[2, 2], pads=[0, 0, 1, 1])
    check(m, {"x": x})


# -- shape ---------------------------------------------------------------------

@pytest.mark.parametrize("axis", [-1, -3, -4, 2])
def test_flatten_negative_axis(axis):
    """ONNX's axis is in [-r, r]: -1 flattens all but the last axis (it was taken modulo r + 1: -1 became r)."""
    x = rng.standard_normal((2, 3, 4, 5)).astype(np.float32)
    check(one_node("Flatten", [("x", F, [2, 3, 4, 5])], [("y", F)], axis=axis), {"x": x})


@pytest.mark.parametrize("starts,ends,steps", [([-100], [-200], [-1]), ([-8], [-9], [-2]), ([10], [-10], [-1])])
def test_slice_negative_step_clamps_start_to_the_axis(starts, ends, steps):
    """With a negative step ONNX clamps the start into [0, d - 1]: a start before the axis is its first element."""
    x = rng.standard_normal((2, 5)).astype(np.float32)
    consts = {"s": np.array(starts, np.int64), "e": np.array(ends, np.int64), "a": np.array([1], np.int64),
              "t": np.array(steps, np.int64)}
    check(one_node("Slice", [("x", F, [2, 5])], [("y", F)], consts=consts), {"x": x})


# -- index ops -------------------------------------------------------------------

@pytest.mark.parametrize("op", ["ArgMax", "ArgMin"])
@pytest.mark.parametrize("last", [0, 1])
@pytest.mark.parametrize("axis,keepdims", [(1, 1), (-1, 0), (0, 1)])
def test_argmax_select_last_index(op, last, axis, keepdims):
    x = np.array([[1, 3, 3, 0, 0], [2, 2, 1, 1, 2], [3, 0, 1, 1, 2]], np.float32)  # ties for both
    m = one_node(op, [("x", F, [3, 5])], [("y", I64)], axis=axis, keepdims=keepdims, select_last_index=last)
    check(m, {"x": x})


@pytest.mark.parametrize("axis", [0, -1])
def test_gather_elements_negative_indices(axis):
    x = rng.standard_normal((3, 4)).astype(np.float32)
    i = np.array([[0, -1, 2, -3], [-3, 1, 0, 2]], np.int64) if axis == 0 else np.array([[-4, 3], [-1, 0], [2, -2]], np.int64)
    check(one_node("GatherElements", [("x", F, [3, 4]), ("i", I64, list(i.shape))], [("y", F)], axis=axis),
          {"x": x, "i": i})


@pytest.mark.parametrize("largest", [1, 0])
def test_topk_orders_equal_values_by_index(largest):
    """ONNX: of equal values the lower index comes first (torch.topk's CPU kernel gave the higher)."""
    x = np.array([[1, 3, 3, 0, 3, 0], [2, 2, 2, 2, 2, 2]], np.float32)
    m = one_node("TopK", [("x", F, [2, 6])], [("v", F), ("i", I64)], consts={"k": np.array([3], np.int64)},
                 largest=largest)
    check(m, {"x": x})


def test_topk_k_as_attribute_before_opset_10():
    x = rng.permutation(12).reshape(2, 6).astype(np.float32)
    check(one_node("TopK", [("x", F, [2, 6])], [("v", F), ("i", I64)], opset=9, k=2), {"x": x})


# -- elementwise on integers: the input's dtype kept -----------------------------

@pytest.mark.parametrize("dt,nt", [(I64, np.int64), (I32, np.int32)])
def test_clip_of_integers_keeps_their_dtype(dt, nt):
    x = np.array([-7, -3, 0, 3, 7, 10], nt)
    m = one_node("Clip", [("x", dt, [6])], [("y", dt)], consts={"lo": np.array(-2, nt), "hi": np.array(5, nt)},
                 opset=13)
    check(m, {"x": x})


@pytest.mark.parametrize("e", [np.array(3, np.int64), np.array(3.0, np.float32), np.array(2, np.int64)])
def test_pow_of_integers_keeps_their_dtype(e):
    x = np.array([-7, -3, 0, 3, 7, 300], np.int64)
    check(one_node("Pow", [("x", I64, [6])], [("y", I64)], consts={"e": e}), {"x": x})


# -- reductions -------------------------------------------------------------------

@pytest.mark.parametrize("op", ["ReduceSumSquare", "ReduceL2"])
def test_reduce_noop_with_empty_axes_still_squares(op):
    """No axes and noop_with_empty_axes: nothing is reduced, but ONNX Runtime still squares (ReduceSumSquare) or
    takes |x| (ReduceL2); the converter returned x."""
    x = rng.standard_normal((2, 3, 4)).astype(np.float32)
    m = one_node(op, [("x", F, [2, 3, 4])], [("y", F)], opset=18, noop_with_empty_axes=1)
    check(m, {"x": x}, rtol=1e-6)


# -- Dropout -----------------------------------------------------------------------

def test_dropout_mask_at_inference():
    x = rng.standard_normal((2, 3)).astype(np.float32)
    check(one_node("Dropout", [("x", F, [2, 3])], [("y", F), ("mask", B)], opset=13), {"x": x})
    m = one_node("Dropout", [("x", F, [2, 3])], [("y", F)], opset=13, order=["x", "r", "t"],
                 consts={"r": np.array(0.5, np.float32), "t": np.array(False)})
    check(m, {"x": x})


@pytest.mark.parametrize("training", ["const", "input"])
def test_dropout_in_training_mode_is_refused(training):
    """training_mode true drops at random in ONNX Runtime: not the identity the converter ran."""
    if training == "const":
        m = one_node("Dropout", [("x", F, [2, 3])], [("y", F)], opset=13,
                     consts={"r": np.array(0.5, np.float32), "t": np.array(True)})
    else:
        m = one_node("Dropout", [("x", F, [2, 3]), ("t", B, [])], [("y", F)], opset=13, order=["x", "", "t"])
    with pytest.raises(UnsupportedOp, match="the_Dropout.*training_mode"):
        convert(m)


def test_dropout_mask_before_opset_12_is_refused():
    m = one_node("Dropout", [("x", F, [2, 3])], [("y", F), ("mask", B)], opset=10)
    with pytest.raises(UnsupportedOp, match="the_Dropout.*mask output"):
        convert(m)


# -- Cast, LayerNormalization --------------------------------------------------------

def test_cast_to_float8_is_refused():
    """float8 (and its saturate attribute) has no mapping: a refusal naming the node, not a KeyError."""
    m = one_node("Cast", [("x", F, [2, 3])], [("y", TensorProto.FLOAT8E4M3FN)], opset=19,
                 to=TensorProto.FLOAT8E4M3FN, saturate=0)
    with pytest.raises(UnsupportedOp, match="the_Cast.*FLOAT8E4M3FN"):
        convert(m)


@pytest.mark.parametrize("axis", [-1, 1])
def test_layer_norm_mean_and_inv_std_dev_outputs(axis):
    x = rng.standard_normal((2, 3, 4)).astype(np.float32)
    shp = [2, 3, 4][axis:]
    consts = {"s": rng.standard_normal(shp).astype(np.float32), "b": rng.standard_normal(shp).astype(np.float32)}
    m = one_node("LayerNormalization", [("x", F, [2, 3, 4])], [("y", F), ("mean", F), ("isd", F)], consts=consts,
                 axis=axis, epsilon=1e-3)
    check(m, {"x": x}, rtol=1e-5, atol=1e-5)


def test_layer_norm_stats_of_another_stash_type_are_refused():
    m = one_node("LayerNormalization", [("x", F, [2, 4])], [("y", F), ("mean", F)],
                 consts={"s": np.ones(4, np.float32)}, stash_type=0)
    with pytest.raises(UnsupportedOp, match="the_LayerNormalization.*stash_type"):
        convert(m)
