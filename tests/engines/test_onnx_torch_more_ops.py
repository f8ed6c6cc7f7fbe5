"""Ops and attribute forms that real exports use (PyTorch's TorchScript and dynamo exporters, tf2onnx) which the
torch converter once refused: each against ONNX Runtime on the CPU (values, shapes and dtypes), and each form it
still refuses with the node and what it refuses named."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto

torch = pytest.importorskip("torch")

from test_onnx_torch_attributes import check, one_node  # noqa: E402 - ONNX Runtime as the reference

from parastream.launcher.engines.onnx_torch import UnsupportedOp, convert, to_fx  # noqa: E402

F, U8, I64, I32 = TensorProto.FLOAT, TensorProto.UINT8, TensorProto.INT64, TensorProto.INT32

rng = np.random.default_rng(0)


def refused(model, match):
    with pytest.raises(UnsupportedOp, match=match):
        convert(model)


# -- DepthToSpace, SpaceToDepth ------------------------------------------------------

@pytest.mark.parametrize("opset,mode", [(1, None), (11, None), (11, "DCR"), (11, "CRD"), (13, "DCR"), (13, "CRD")])
@pytest.mark.parametrize("b", [2, 3])
def test_depth_to_space(opset, mode, b):
    shp = [2, 2 * b * b, 3, 4]
    x = rng.standard_normal(shp).astype(np.float32)
    attrs = {} if mode is None else {"mode": mode}
    check(one_node("DepthToSpace", [("x", F, shp)], [("y", F)], opset=opset, blocksize=b, **attrs), {"x": x})


@pytest.mark.parametrize("op,mode", [("DepthToSpace", "DCR"), ("DepthToSpace", "CRD"), ("SpaceToDepth", None)])
def test_depth_space_of_uint8(op, mode):
    x = np.arange(2 * 8 * 2 * 4, dtype=np.uint8).reshape(2, 8, 2, 4)
    attrs = {} if mode is None else {"mode": mode}
    check(one_node(op, [("x", U8, [2, 8, 2, 4])], [("y", U8)], opset=13, blocksize=2, **attrs), {"x": x})


def test_depth_to_space_of_an_unknown_mode_is_refused():
    m = one_node("DepthToSpace", [("x", F, [1, 4, 2, 2])], [("y", F)], opset=13, blocksize=2, mode="XYZ")
    refused(m, "the_DepthToSpace.*mode 'XYZ'")


@pytest.mark.parametrize("opset", [1, 13])
@pytest.mark.parametrize("b,shp", [(2, [2, 3, 4, 6]), (3, [1, 2, 6, 3])])
def test_space_to_depth(opset, b, shp):
    x = rng.standard_normal(shp).astype(np.float32)
    check(one_node("SpaceToDepth", [("x", F, shp)], [("y", F)], opset=opset, blocksize=b), {"x": x})


def test_space_to_depth_inverts_depth_to_space_dcr():
    """SpaceToDepth's channel order is DepthToSpace's DCR (block offsets outermost; not pixel_unshuffle's)."""
    x = rng.standard_normal((1, 3, 4, 4)).astype(np.float32)
    m = convert(one_node("SpaceToDepth", [("x", F, [1, 3, 4, 4])], [("y", F)], opset=13, blocksize=2))
    back = convert(one_node("DepthToSpace", [("x", F, [1, 12, 2, 2])], [("y", F)], opset=13, blocksize=2, mode="DCR"))
    with torch.no_grad():
        np.testing.assert_array_equal(back(m(torch.from_numpy(x))[0])[0].numpy(), x)


# -- GroupNormalization ------------------------------------------------------------

@pytest.mark.parametrize("opset,groups,extra", [
    (18, 1, {}), (18, 2, {}), (18, 4, {}),  # scale and bias per group
    (21, 1, {}), (21, 2, {}), (21, 4, {"stash_type": 1}), (21, 2, {"stash_type": 11}),  # per channel
])
@pytest.mark.parametrize("shp", [[2, 4, 3, 5], [2, 4, 7]])
def test_group_normalization(opset, groups, extra, shp):
    """ONNX Runtime runs both forms (the function bodies of opsets 18 and 21)."""
    c = shp[1]
    per = groups if opset < 21 else c
    consts = {"s": rng.standard_normal(per).astype(np.float32), "b": rng.standard_normal(per).astype(np.float32)}
    x = (rng.standard_normal(shp) * 3 + 1).astype(np.float32)
    m = one_node("GroupNormalization", [("x", F, shp)], [("y", F)], consts=consts, opset=opset, num_groups=groups,
                 epsilon=1e-3, **extra)
    check(m, {"x": x}, rtol=1e-5, atol=1e-5)


def test_group_normalization_of_scale_and_bias_computed_at_run_time():
    """Opset 18's per-group scale and bias as graph inputs: repeated per channel in the step."""
    x = rng.standard_normal((2, 6, 4)).astype(np.float32)
    s, b = rng.standard_normal(3).astype(np.float32), rng.standard_normal(3).astype(np.float32)
    m = one_node("GroupNormalization", [("x", F, [2, 6, 4]), ("s", F, [3]), ("b", F, [3])], [("y", F)], opset=18,
                 num_groups=3)
    check(m, {"x": x, "s": s, "b": b}, rtol=1e-5, atol=1e-5)


def test_group_normalization_with_half_precision_stash_is_refused():
    """stash_type 10: statistics rounded to float16 at every step (ONNX Runtime and the reference differ there)."""
    consts = {"s": np.ones(4, np.float32), "b": np.zeros(4, np.float32)}
    m = one_node("GroupNormalization", [("x", F, [1, 4, 3])], [("y", F)], consts=consts, opset=21, num_groups=2,
                 stash_type=10)
    refused(m, "the_GroupNormalization.*stash_type 10")


# -- activations ------------------------------------------------------------------

_X = np.concatenate([np.linspace(-30, 30, 61), [-2.5, -1.0, -0.5, -0.25, 0.0, 0.25, 0.5, 1.0, 1.5, 2.5]])


@pytest.mark.parametrize("op,opset,attrs", [
    ("Selu", 6, {}), ("Selu", 6, {"alpha": 2.0, "gamma": 0.5}), ("Selu", 22, {"alpha": 1.5}),
    ("Shrink", 9, {}), ("Shrink", 9, {"lambd": 1.0, "bias": 0.5}), ("Shrink", 9, {"lambd": 0.0, "bias": -1.0}),
    ("ThresholdedRelu", 10, {}), ("ThresholdedRelu", 10, {"alpha": 0.5}), ("ThresholdedRelu", 22, {"alpha": -1.0}),
    ("Celu", 12, {}), ("Celu", 12, {"alpha": 2.0}), ("Celu", 12, {"alpha": 0.5}),
    ("Mish", 18, {}), ("Softsign", 1, {}), ("Softsign", 22, {}), ("Softplus", 17, {}),
])
def test_activation(op, opset, attrs):
    x = np.concatenate([_X, rng.standard_normal(29) * 3]).astype(np.float32).reshape(2, 5, 10)
    check(one_node(op, [("x", F, [2, 5, 10])], [("y", F)], opset=opset, **attrs), {"x": x}, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dt,nt", [(I32, np.int32), (I64, np.int64)])
def test_shrink_of_integers_keeps_their_dtype(dt, nt):
    x = np.arange(-6, 6, dtype=nt).reshape(3, 4)
    check(one_node("Shrink", [("x", dt, [3, 4])], [("y", dt)], opset=9, lambd=1.5, bias=1.0), {"x": x})


@pytest.mark.parametrize("opset,axis", [(11, None), (11, 0), (11, 2), (11, -1), (11, 3), (13, None), (13, 1), (13, -2)])
def test_hardmax(opset, axis):
    """Before opset 13 the input is seen as 2-d at ``axis`` (default 1); from 13 one axis (default -1).  Of
    equal values the first is the max (ties on purpose: few distinct values)."""
    x = rng.integers(0, 3, (2, 3, 4, 2)).astype(np.float32)
    attrs = {} if axis is None else {"axis": axis}
    check(one_node("Hardmax", [("x", F, [2, 3, 4, 2])], [("y", F)], opset=opset, **attrs), {"x": x})


# -- AveragePool: asymmetric pads that count only the input (tf2onnx's "SAME") ----------------------------

@pytest.mark.parametrize("shp,attrs", [
    ([1, 2, 5, 6], {"kernel_shape": [3, 3], "pads": [0, 0, 1, 2]}),
    ([1, 2, 5, 6], {"kernel_shape": [3, 3], "pads": [1, 0, 2, 1], "strides": [2, 2]}),
    ([2, 3, 6, 7], {"kernel_shape": [3, 3], "strides": [2, 2], "auto_pad": "SAME_UPPER"}),
    ([2, 3, 6, 6], {"kernel_shape": [2, 2], "strides": [1, 1], "auto_pad": "SAME_UPPER"}),
    ([2, 3, 6, 6], {"kernel_shape": [4, 2], "strides": [1, 1], "auto_pad": "SAME_LOWER"}),
    ([1, 2, 3, 4], {"kernel_shape": [3, 3], "pads": [2, 2, 2, 2]}),  # symmetric but more than half the kernel
    ([1, 2, 6, 5], {"kernel_shape": [2, 2], "strides": [2, 2], "pads": [0, 0, 1, 1], "ceil_mode": 1}),
    ([1, 2, 5, 5], {"kernel_shape": [3, 3], "strides": [3, 3], "pads": [1, 0, 2, 1], "ceil_mode": 1}),
    ([1, 2, 7], {"kernel_shape": [3], "pads": [0, 2], "strides": [2]}),
    ([1, 2, 4, 5, 3], {"kernel_shape": [2, 3, 2], "pads": [0, 1, 1, 1, 1, 0]}),
])
def test_avgpool_asymmetric_pads_excluding_pad(shp, attrs):
    x = rng.standard_normal(shp).astype(np.float32)
    check(one_node("AveragePool", [("x", F, shp)], [("y", F)], opset=19, count_include_pad=0, **attrs), {"x": x},
          rtol=1e-5, atol=1e-6)


def test_avgpool_with_dilations_is_refused():
    m = one_node("AveragePool", [("x", F, [1, 1, 6, 6])], [("y", F)], opset=19, kernel_shape=[2, 2], dilations=[2, 2])
    refused(m, "the_AveragePool.*dilations")


# -- CumSum exclusive and reverse ---------------------------------------------------

@pytest.mark.parametrize("exclusive", [0, 1])
@pytest.mark.parametrize("reverse", [0, 1])
@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("dt,nt", [(F, np.float32), (I64, np.int64), (I32, np.int32)])
def test_cumsum_exclusive_and_reverse(exclusive, reverse, axis, dt, nt):
    x = (rng.standard_normal((3, 5)) * 4).astype(nt)
    m = one_node("CumSum", [("x", dt, [3, 5])], [("y", dt)], consts={"a": np.array(axis, np.int64)}, opset=14,
                 exclusive=exclusive, reverse=reverse)
    check(m, {"x": x}, rtol=1e-5, atol=1e-5)


def test_cumsum_over_an_axis_computed_at_run_time_is_refused():
    m = one_node("CumSum", [("x", F, [3, 5]), ("a", I64, [])], [("y", F)], opset=14, exclusive=1)
    refused(m, "the_CumSum.*constant")


# -- MaxPool's Indices ------------------------------------------------------------------

@pytest.mark.parametrize("shp,attrs", [
    ([2, 3, 5, 6], {"kernel_shape": [2, 2]}),
    ([2, 3, 7, 6], {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}),
    ([2, 3, 7, 8], {"kernel_shape": [3, 2], "strides": [2, 3], "dilations": [2, 1], "pads": [1, 0, 1, 0]}),
    ([1, 2, 6, 5], {"kernel_shape": [2, 2], "strides": [2, 2], "ceil_mode": 1}),
    ([2, 3, 7, 7], {"kernel_shape": [3, 3], "strides": [2, 2], "auto_pad": "SAME_UPPER"}),
    ([2, 3, 9], {"kernel_shape": [3], "strides": [2], "pads": [1, 1]}),
    ([2, 2, 4, 5, 3], {"kernel_shape": [2, 2, 2], "strides": [1, 2, 1]}),
])
@pytest.mark.parametrize("ties", [False, True])
def test_maxpool_indices(shp, attrs, ties):
    """The index into the whole input seen as one flat array (N and C offsets included), padding not counted;
    of equal values the first in the window."""
    x = (rng.integers(0, 2, shp) if ties else rng.standard_normal(shp)).astype(np.float32)
    m = one_node("MaxPool", [("x", F, shp)], [("y", F), ("i", I64)], opset=12, **attrs)
    check(m, {"x": x})


@pytest.mark.parametrize("attrs,why", [
    ({"kernel_shape": [2, 2], "storage_order": 1}, "storage_order=1"),
    ({"kernel_shape": [2, 2], "pads": [0, 0, 1, 1]}, "pads"),
    ({"kernel_shape": [2, 2], "pads": [2, 2, 2, 2]}, "pads"),
])
def test_maxpool_indices_refused_where_not_mapped(attrs, why):
    m = one_node("MaxPool", [("x", F, [1, 1, 5, 5])], [("y", F), ("i", I64)], opset=12, **attrs)
    refused(m, f"the_MaxPool.*Indices.*{why}")


# -- the steps trace -------------------------------------------------------------------

_TRACED = {
    "DepthToSpace": lambda: one_node("DepthToSpace", [("x", F, [1, 8, 2, 3])], [("y", F)], opset=13, blocksize=2,
                                     mode="CRD"),
    "SpaceToDepth": lambda: one_node("SpaceToDepth", [("x", F, [1, 2, 4, 6])], [("y", F)], opset=13, blocksize=2),
    "GroupNormalization-18": lambda: one_node("GroupNormalization", [("x", F, [2, 4, 3]), ("s", F, [2]), ("b", F, [2])],
                                              [("y", F)], opset=18, num_groups=2),
    "GroupNormalization-21": lambda: one_node("GroupNormalization", [("x", F, [2, 4, 3]), ("s", F, [4]), ("b", F, [4])],
                                              [("y", F)], opset=21, num_groups=2, stash_type=11),
    "Hardmax": lambda: one_node("Hardmax", [("x", F, [2, 3, 4])], [("y", F)], opset=11, axis=1),
    "Shrink": lambda: one_node("Shrink", [("x", F, [2, 3])], [("y", F)], opset=9),
    "AveragePool": lambda: one_node("AveragePool", [("x", F, [1, 2, 5, 5])], [("y", F)], opset=19, kernel_shape=[3, 3],
                                    pads=[0, 0, 2, 2], strides=[2, 2], ceil_mode=1),
    "CumSum": lambda: one_node("CumSum", [("x", F, [3, 5])], [("y", F)], consts={"a": np.array(1, np.int64)}, opset=14,
                               exclusive=1, reverse=1),
    "MaxPool": lambda: one_node("MaxPool", [("x", F, [2, 3, 5, 6])], [("y", F), ("i", I64)], opset=12,
                                kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
}


@pytest.mark.parametrize("case", list(_TRACED))
def test_new_steps_trace_to_fx(case):
    """No shape arithmetic on run-time tensors: ``to_fx`` traces each and computes what the module does."""
    m = _TRACED[case]()
    module = convert(m)
    gm = to_fx(module)
    x = [torch.randn([d.dim_value for d in i.type.tensor_type.shape.dim]) for i in m.graph.input]
    with torch.no_grad():
        for a, b in zip(gm(*x), module(*x)):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


# -- a scalar weight keeps its 0 dimensions ------------------------------------------------------------

@pytest.mark.parametrize("op,dtype,np_dtype", [("Less", I64, np.int64), ("Add", F, np.float32), ("Mul", I64, np.int64)])
def test_a_scalar_weight_with_a_scalar_input_gives_a_scalar(op, dtype, np_dtype):
    """A 0-d weight is a 0-d tensor, not [1]: with a 0-d input its result is 0-d, as ONNX Runtime's (a
    detector's count compared with a constant, read by its data-dependent tail; an engine's 0-d output)."""
    m = one_node(op, [("x", dtype, [])], [("y", TensorProto.BOOL if op == "Less" else dtype)],
                 consts={"c": np.array(7, np_dtype)})
    check(m, {"x": np.array(5, np_dtype)})
    assert tuple(dict(convert(m).named_buffers())["c0"].shape) == ()


def test_a_one_element_weight_keeps_its_dimension():
    """Must not change: a [1] weight stays [1], and broadcasts a 0-d input to [1] as ONNX Runtime does."""
    m = one_node("Add", [("x", F, [])], [("y", F)], consts={"c": np.array([2.0], np.float32)})
    check(m, {"x": np.array(5.0, np.float32)})
