"""The tail's torch ops (launcher/engines/onnx_eager.py), each against ONNX Runtime on the CPU: every op of its
table on run-time inputs (shapes, axes and counts read from tensors, as a detection model's tail computes them),
values, shapes and dtypes equal; and the nodes it must refuse, naming the node, so that the tail stays on the
host.  Every case runs on the CPU and, marked gpu, on the GPU (its inputs there, the graph's constants placed as
a tail's are); tests/pipeline/test_host_tail.py runs whole tails on the GPU."""

from __future__ import annotations

import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

torch = pytest.importorskip("torch")

from parastream.launcher.engines.onnx_eager import OPS, UnsupportedOp, load  # noqa: E402

rng = np.random.default_rng(0)
_TYPES = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.int64): TensorProto.INT64,
          np.dtype(np.int32): TensorProto.INT32, np.dtype(np.bool_): TensorProto.BOOL}


def model(nodes, feeds: dict, outputs: list[str], consts: dict | None = None, opset: int = 17) -> onnx.ModelProto:
    """A graph of ``nodes`` whose inputs are ``feeds`` (run-time tensors), ``consts`` initializers; the outputs'
    types from ONNX's inference."""
    consts = consts or {}
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(k, _TYPES[v.dtype], v.shape) for k, v in feeds.items()],
                          [helper.make_tensor_value_info(o, TensorProto.UNDEFINED, None) for o in outputs],
                          [numpy_helper.from_array(v, k) for k, v in consts.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    inferred = onnx.shape_inference.infer_shapes(m)
    types = {vi.name: vi.type.tensor_type.elem_type for vi in [*inferred.graph.value_info, *inferred.graph.output]}
    for o in m.graph.output:
        o.type.tensor_type.elem_type = types.get(o.name) or TensorProto.FLOAT
    return m


_ON = {"device": None}


@pytest.fixture(autouse=True, params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def on_device(request):
    """Each case on the CPU, and on the GPU where there is one (the gpu tier)."""
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    _ON["device"] = None if request.param == "cpu" else "cuda"
    yield
    _ON["device"] = None


def check(m: onnx.ModelProto, feeds: dict, rtol=1e-6, atol=1e-6):
    """The eager graph against ONNX Runtime: every output's shape, dtype and values."""
    import onnxruntime as ort

    ref = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    dev = _ON["device"]
    graph = load(m, device=dev)
    for _ in range(2):  # twice: the second call reads what the first one cached (a known index on its device)
        got = graph.run({k: torch.from_numpy(v).to(dev or "cpu") for k, v in feeds.items()})
        assert len(got) == len(ref)
        for g, r in zip(got, ref):
            g = g.cpu().numpy()
            assert g.shape == r.shape and g.dtype == r.dtype, (g.shape, g.dtype, r.shape, r.dtype)
            np.testing.assert_allclose(g, r, rtol=rtol, atol=atol)


def one(op, feeds: dict, n_out: int = 1, consts=None, opset=17, inputs=None, **attrs):
    """``op`` as the one node of a model over ``feeds`` (then ``consts``), checked."""
    names = inputs or [*feeds, *(consts or {})]
    outs = [f"y{i}" for i in range(n_out)]
    check(model([helper.make_node(op, names, outs, **attrs)], feeds, outs, consts, opset), feeds)


def f32(*shape, lo=-2.0, hi=2.0):
    return rng.uniform(lo, hi, shape).astype(np.float32)


def i64(*values):
    return np.array(values, dtype=np.int64)


# -- elementwise ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div", "Pow", "Equal", "Greater", "Less", "GreaterOrEqual",
                                "LessOrEqual"])
def test_binary_broadcast(op):
    a, b = f32(2, 3, 4, lo=0.5), f32(3, 1, lo=0.5)
    if op == "Equal":
        b = a[0, :, :1].copy()
    one(op, {"a": a, "b": b})


def test_integer_division_truncates_as_onnx_runtime():
    one("Div", {"a": i64(-7, 7, -8, 9), "b": i64(2, -2, 3, 4)})


@pytest.mark.parametrize("op", ["And", "Or", "Xor"])
def test_logical(op):
    one(op, {"a": rng.random((3, 4)) > 0.5, "b": rng.random((4,)) > 0.5})


@pytest.mark.parametrize("op", ["Neg", "Abs", "Exp", "Log", "Sqrt", "Sigmoid", "Relu", "Tanh", "Floor", "Ceil",
                                "Round", "Reciprocal", "Sign", "Erf", "Sin", "Cos", "Identity"])
def test_unary(op):
    x = f32(3, 5, lo=0.1, hi=3.0) if op in ("Log", "Sqrt") else f32(3, 5)
    if op == "Round":
        x = np.array([0.5, 1.5, 2.5, -0.5, -1.5, 0.4, 2.6], np.float32)  # halves to even, as ONNX rounds
    one(op, {"x": x})


def test_not_isnan_where():
    x = np.array([1.0, np.nan, -2.0], np.float32)
    nodes = [helper.make_node("IsNaN", ["x"], ["nan"]), helper.make_node("Not", ["nan"], ["ok"]),
             helper.make_node("Where", ["ok", "x", "zero"], ["y"])]
    check(model(nodes, {"x": x}, ["nan", "ok", "y"], {"zero": np.array(0.0, np.float32)}), {"x": x})


@pytest.mark.parametrize("fmod,kind", [(0, "int"), (1, "int"), (1, "float")])
def test_mod_follows_the_sign_onnx_says(fmod, kind):
    a, b = (i64(-7, 7, -8, 9), i64(3, -3, 3, -4)) if kind == "int" else (f32(6), f32(6, lo=0.5))
    one("Mod", {"a": a, "b": b}, fmod=fmod)


@pytest.mark.parametrize("op", ["Min", "Max", "Sum", "Mean"])
def test_variadic(op):
    one(op, {"a": f32(2, 3), "b": f32(3), "c": f32(1, 3)})


def test_clip_before_and_after_opset_11():
    one("Clip", {"x": f32(4, 4)}, opset=6, min=-0.5, max=0.5)
    one("Clip", {"x": f32(4, 4), "lo": np.array(-0.5, np.float32)}, opset=13)
    one("Clip", {"x": i64(-5, 0, 5, 9)}, consts={"lo": np.array(-1, np.int64), "hi": np.array(4, np.int64)})
    one("Clip", {"x": f32(3)}, inputs=["x", "", "hi"], consts={"hi": np.array(0.0, np.float32)})


def test_cast_truncates_and_castlike():
    x = np.array([-1.7, -0.2, 0.6, 2.9], np.float32)
    one("Cast", {"x": x}, to=TensorProto.INT32)
    one("CastLike", {"x": x, "like": i64(1)})


# -- constants and shapes ------------------------------------------------------------------------------------

def test_constants_shape_size():
    x = f32(2, 3, 4)
    nodes = [helper.make_node("Constant", [], ["c1"], value=numpy_helper.from_array(f32(2, 2), "v")),
             helper.make_node("Constant", [], ["c2"], value_ints=[3, 1]),
             helper.make_node("Constant", [], ["c3"], value_float=0.25),
             helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Shape", ["x"], ["s1"], start=1, end=-1),
             helper.make_node("Size", ["x"], ["n"])]
    check(model(nodes, {"x": x}, ["c1", "c2", "c3", "s", "s1", "n"]), {"x": x})


def test_shapes_of_two_sizes_through_one_shape_node():
    """One Shape node over tensors of two sizes (its output kept per distinct shape): each call its own shape."""
    node = helper.make_node("Shape", ["x"], ["s"])
    graph = load(model([node], {"x": f32(2, 3)}, ["s"]), device=_ON["device"])
    for dims in [(2, 3), (4, 5), (2, 3)]:
        (got,) = graph.run({"x": torch.zeros(dims, device=_ON["device"] or "cpu")})
        assert got.tolist() == list(dims) and got.device.type == "cpu"


def test_what_a_caller_writes_into_an_output_does_not_reach_the_next_call():
    """A Shape node's tensor serves every call of that shape, a constant every call: the graph's outputs are
    copies of them, so that a caller writing into what it got (a numpy view of it) changes no later result."""
    x = f32(2, 3)
    nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Identity", ["k"], ["kept"])]
    graph = load(model(nodes, {"x": x}, ["s", "kept"], {"k": i64(7, 8)}), device=_ON["device"])
    feeds = {"x": torch.from_numpy(x).to(_ON["device"] or "cpu")}
    for got in graph.run(feeds):
        got.fill_(0)
    s, kept = graph.run(feeds)
    assert s.tolist() == [2, 3] and kept.tolist() == [7, 8]


def test_shape_arithmetic_is_computed_once_per_shape_and_data_never_kept():
    """The steps whose inputs are all small host tensors (a shape, an index) keep their results by those inputs'
    values: a second call of the same shape reads them (``memo_hits``), a call of another shape computes its own;
    a step that reads data (a tensor on the device, or of more than ``_HOST_MAX`` elements) keeps nothing."""
    from parastream.launcher.engines import onnx_eager

    nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Gather", ["s", "zero"], ["rows"], axis=0),
             helper.make_node("Unsqueeze", ["rows", "axes"], ["r1"]),
             helper.make_node("Concat", ["r1", "minus_one"], ["shape"], axis=0),
             helper.make_node("Reshape", ["x", "shape"], ["y"])]
    consts = {"zero": np.array(0, np.int64), "axes": i64(0), "minus_one": i64(-1)}
    graph = load(model(nodes, {"x": f32(4, 25)}, ["y", "shape"], consts), device=_ON["device"])
    for dims, hits in [((4, 25), 0), ((4, 25), 3), ((5, 20), 3), ((5, 20), 6)]:
        x = torch.randn(dims, device=_ON["device"] or "cpu")
        y, shape = graph.run({"x": x})
        assert shape.tolist() == [dims[0], -1] and torch.equal(y.cpu(), x.cpu().reshape(dims[0], -1))
        assert graph.memo_hits == hits  # Gather, Unsqueeze and Concat read once per shape
    reshape = graph.ops.index("Reshape")
    assert graph._memo[reshape] == {}  # its data input (100 elements, or on the device) is never a key
    assert onnx_eager._host_key([torch.zeros(onnx_eager._HOST_MAX + 1, dtype=torch.int64)]) is None


def test_a_filled_tensor_of_data_s_size_is_made_on_the_graph_s_device():
    """ConstantOfShape of more than a shape's worth of elements (a label per candidate) on the device, a few on
    the host, where the shape arithmetic reads them; the values ONNX Runtime's."""
    x = f32(5, 20)
    nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("ConstantOfShape", ["s"], ["labels"],
                                                                       value=numpy_helper.from_array(i64(3), "v")),
             helper.make_node("Shape", ["s"], ["r"]), helper.make_node("ConstantOfShape", ["r"], ["few"])]
    m = model(nodes, {"x": x}, ["labels", "few"])
    check(m, {"x": x})
    labels, few = load(m, device=_ON["device"]).run({"x": torch.from_numpy(x).to(_ON["device"] or "cpu")})
    assert labels.device.type == ("cuda" if _ON["device"] else "cpu") and few.device.type == "cpu"


def test_constant_of_shape_and_range():
    x = f32(2, 3)
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("ConstantOfShape", ["s"], ["zeros"]),
             helper.make_node("ConstantOfShape", ["s"], ["sevens"], value=numpy_helper.from_array(i64(7), "v")),
             helper.make_node("Range", ["start", "limit", "delta"], ["r"]),
             helper.make_node("Range", ["fs", "fl", "fd"], ["fr"])]
    feeds = {"x": x, "start": np.array(10, np.int64), "limit": np.array(-3, np.int64), "delta": np.array(-4, np.int64),
             "fs": np.array(0.5, np.float32), "fl": np.array(2.0, np.float32), "fd": np.array(0.4, np.float32)}
    check(model(nodes, feeds, ["zeros", "sevens", "r", "fr"]), feeds)


# -- indexing ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("axis,idx", [(0, i64(0, -1, 2)), (1, np.array([[1, -4], [0, 3]], np.int64)),
                                      (-1, np.array(-2, np.int64))])
def test_gather_negative_and_scalar_indices(axis, idx):
    one("Gather", {"x": f32(3, 4, 5), "i": idx}, axis=axis)


def test_gather_elements():
    one("GatherElements", {"x": f32(3, 4), "i": np.array([[0, -1, 2, 1], [3, 0, -4, 2]], np.int64)}, axis=1)


@pytest.mark.parametrize("batch_dims,idx", [(0, np.array([[0, 1], [1, -1], [-2, 0]], np.int64)),
                                            (0, np.array([[1], [0]], np.int64)),
                                            (1, np.array([[[1], [0]], [[2], [2]]], np.int64))])
def test_gather_nd(batch_dims, idx):
    one("GatherND", {"x": f32(2, 3, 4), "i": idx}, batch_dims=batch_dims)


def test_gather_nd_of_no_rows():
    one("GatherND", {"x": f32(5, 4), "i": np.zeros((0, 1), np.int64)})


@pytest.mark.parametrize("starts,ends,axes,steps", [
    ([1], [100], [0], [1]), ([-1], [-100], [1], [-1]), ([0, 3], [5, -1], [1, 0], [2, 1]),
    ([10], [0], [1], [-3]), ([2], [1], [0], [1])])
def test_slice_with_run_time_arguments(starts, ends, axes, steps):
    one("Slice", {"x": f32(6, 7), "s": i64(*starts), "e": i64(*ends), "a": i64(*axes), "st": i64(*steps)})


def test_slice_without_axes_or_steps_and_before_opset_10():
    one("Slice", {"x": f32(6, 7), "s": i64(1, -3), "e": i64(4, 100)})
    one("Slice", {"x": f32(6, 7)}, opset=9, starts=[1], ends=[-1], axes=[1])


def test_scatter_nd():
    one("ScatterND", {"x": f32(4, 3), "i": np.array([[1], [3]], np.int64), "u": f32(2, 3)})


def test_nonzero_topk_argmax():
    x = np.array([[0.0, 1.0, 0.0], [2.0, 0.0, 3.0]], np.float32)
    one("NonZero", {"x": x})
    ties = np.array([3.0, 1.0, 3.0, 2.0, 1.0, 3.0], np.float32)  # equal values: the lowest index first
    for largest in (1, 0):
        one("TopK", {"x": ties, "k": i64(4)}, n_out=2, largest=largest)
    one("TopK", {"x": f32(3, 8)}, n_out=2, opset=9, k=3, axis=1)
    for last in (0, 1):
        one("ArgMax", {"x": np.array([[1.0, 3.0, 3.0], [2.0, 2.0, 0.0]], np.float32)}, axis=1, select_last_index=last)
        one("ArgMin", {"x": np.array([[1.0, 1.0, 3.0], [0.0, 2.0, 0.0]], np.float32)}, axis=0, keepdims=0,
            select_last_index=last)


# -- layout --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape,allowzero", [((0, -1), 0), ((-1, 4), 0), ((2, 0, 2), 1), ((0, 0, -1), 0)])
def test_reshape(shape, allowzero):
    x = f32(2, 3, 4) if allowzero == 0 else f32(2, 0, 2)
    one("Reshape", {"x": x, "s": i64(*shape)}, allowzero=allowzero)


def test_reshape_of_no_elements_infers_zero():
    one("Reshape", {"x": np.zeros((0,), np.float32), "s": i64(-1, 4)})


@pytest.mark.parametrize("axis", [0, 2, -1])
def test_flatten(axis):
    one("Flatten", {"x": f32(2, 3, 4)}, axis=axis)


def test_transpose_squeeze_unsqueeze():
    x = f32(2, 1, 3, 1)
    one("Transpose", {"x": x})
    one("Transpose", {"x": x}, perm=[2, 0, 3, 1])
    one("Squeeze", {"x": x})
    one("Squeeze", {"x": x, "a": i64(-1)})
    one("Unsqueeze", {"x": f32(2, 3), "a": i64(-1, 0)})
    one("Unsqueeze", {"x": f32(2, 3)}, opset=11, axes=[1, 3])


def test_concat_split_expand_tile():
    one("Concat", {"a": f32(2, 3), "b": f32(2, 0), "c": f32(2, 1)}, axis=-1)
    one("Split", {"x": f32(7, 2), "s": i64(2, 5)}, n_out=2)
    one("Split", {"x": f32(7, 2)}, n_out=3, opset=18, num_outputs=3)
    one("Split", {"x": f32(6, 2)}, n_out=3, opset=13)
    one("Expand", {"x": f32(3, 1), "s": i64(2, 1, 4)})
    one("Tile", {"x": f32(2, 3), "r": i64(2, 1)})


@pytest.mark.parametrize("mode,pads,axes", [("constant", [1, 0, -1, 2], None), ("constant", [2, 1], [-1]),
                                            ("edge", [0, 0, 1, 2, 0, 0, 2, 1], None),
                                            ("reflect", [0, 0, 1, 1, 0, 0, 1, 2], None)])
def test_pad(mode, pads, axes):
    x = f32(4, 5) if len(pads) == 4 else f32(2, 3, 4, 5)
    feeds = {"x": x, "p": i64(*pads), "v": np.array(1.5, np.float32)}
    if axes:
        feeds["a"] = i64(*axes)
    one("Pad", feeds, opset=18, mode=mode)
    one("Pad", {"x": i64(1, 2, 3)[None]}, opset=11, consts={"p": i64(0, 1, 0, 2)})  # integers, pads known at load
    one("Pad", {"x": f32(3, 4)}, opset=10, pads=[1, 0, 0, 1], value=2.0)


# -- reductions ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("op", ["ReduceMin", "ReduceMax", "ReduceSum", "ReduceMean", "ReduceProd"])
@pytest.mark.parametrize("axes,keepdims", [((1,), 1), ((-1, 0), 0), (None, 1)])
def test_reductions_with_axes_as_input(op, axes, keepdims):
    x = f32(3, 4, lo=0.5, hi=1.5)
    one(op, {"x": x, **({"a": i64(*axes)} if axes else {})}, opset=18, keepdims=keepdims)


def test_reductions_with_axes_as_attribute_empty_and_noop():
    one("ReduceMax", {"x": f32(3, 4)}, opset=13, axes=[1], keepdims=0)
    one("ReduceSum", {"x": f32(3, 4), "a": np.zeros((0,), np.int64)}, opset=13, noop_with_empty_axes=1)
    one("ReduceProd", {"x": i64(3, 4, -2)}, opset=13, keepdims=0)


def test_softmax_cumsum_matmul():
    one("Softmax", {"x": f32(2, 3, 4)}, axis=1)
    one("Softmax", {"x": f32(2, 3, 4)}, opset=11, axis=1)  # over everything from the axis on, as one row
    one("LogSoftmax", {"x": f32(2, 5)})
    for exclusive in (0, 1):
        for reverse in (0, 1):
            one("CumSum", {"x": f32(3, 4), "a": np.array(1, np.int64)}, exclusive=exclusive, reverse=reverse)
    one("MatMul", {"a": f32(2, 3, 4), "b": f32(4, 5)})


# -- parameters known at load (initializers, Constant outputs): read once, the same results ----------------

@pytest.mark.parametrize("op,feeds,consts,attrs", [
    ("Gather", {"x": f32(3, 4)}, {"i": np.array(-1, np.int64)}, {"axis": 1}),
    ("Gather", {"x": f32(3, 4)}, {"i": i64(2, -3, 0)}, {}),
    ("Unsqueeze", {"x": f32(2, 3)}, {"a": i64(-1)}, {}),
    ("Unsqueeze", {"x": f32(2, 3)}, {"a": i64(0, -1)}, {}),
    ("Squeeze", {"x": f32(2, 1, 3, 1)}, {"a": i64(1)}, {}),
    ("Slice", {"x": f32(6, 7)}, {"s": i64(-1), "e": i64(-100), "a": i64(1), "st": i64(-2)}, {}),
    ("Reshape", {"x": f32(2, 3, 4)}, {"s": i64(0, -1)}, {}),
    ("Split", {"x": f32(7, 2)}, {"s": i64(3, 4)}, {}),
    ("ReduceMax", {"x": f32(3, 4)}, {"a": i64(-1)}, {"keepdims": 0}),
])
def test_parameters_known_at_load(op, feeds, consts, attrs):
    n_out = 2 if op == "Split" else 1
    one(op, feeds, n_out=n_out, consts=consts, opset=18, **attrs)


def test_topk_k_from_a_constant_node():
    x = f32(2, 9)
    nodes = [helper.make_node("Constant", [], ["k"], value=numpy_helper.from_array(i64(3), "k")),
             helper.make_node("TopK", ["x", "k"], ["v", "i"], axis=1)]
    check(model(nodes, {"x": x}, ["v", "i"]), {"x": x})


# -- detection and control flow ------------------------------------------------------------------------------

def _boxes(batches: int, n: int, center: bool) -> np.ndarray:
    xy = rng.uniform(0, 50, (batches, n, 2)).astype(np.float32)
    wh = rng.uniform(5, 30, (batches, n, 2)).astype(np.float32)
    if center:
        return np.concatenate([xy, wh], -1)
    # any diagonal pair, in either order, as ONNX allows
    flip = rng.random((batches, n, 1)) > 0.5
    return np.where(flip, np.concatenate([xy + wh, xy], -1), np.concatenate([xy, xy + wh], -1)).astype(np.float32)


@pytest.mark.parametrize("center", [0, 1])
@pytest.mark.parametrize("limit", [0, 3, 1000])
def test_non_max_suppression(center, limit):
    pytest.importorskip("torchvision")
    boxes = _boxes(2, 60, bool(center))
    scores = rng.random((2, 3, 60)).astype(np.float32)
    scores[:, :, 10:20] = 0.5  # ties: the lowest box first, as ONNX Runtime takes them
    one("NonMaxSuppression", {"b": boxes, "s": scores, "m": i64(limit), "iou": np.array([0.3], np.float32),
                              "thr": np.array([0.2], np.float32)}, center_point_box=center)


def test_non_max_suppression_without_thresholds():
    pytest.importorskip("torchvision")
    one("NonMaxSuppression", {"b": _boxes(1, 30, False), "s": rng.random((1, 2, 30)).astype(np.float32), "m": i64(5)})


def _ort_nms(boxes, scores, iou: float, thr: float = 0.0) -> np.ndarray:
    """ONNX Runtime's NonMaxSuppression of one batch: its [batch, class, box] rows, no limit."""
    import onnxruntime as ort

    feeds = {"b": boxes[None], "s": scores[None], "m": i64(10**6), "iou": np.array([iou], np.float32),
             "thr": np.array([thr], np.float32)}
    m = model([helper.make_node("NonMaxSuppression", list(feeds), ["y"])], feeds, ["y"])
    return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def _grouped(boxes, scores, iou: float, thr: float = 0.0):
    """``nms_in_groups`` on the candidates as the tail's node makes them: ([batch, class, box] rows as ONNX
    Runtime orders them, or None where it declined)."""
    from parastream.launcher.engines.onnx_eager import nms_in_groups

    dev = _ON["device"] or "cpu"
    b, sc = torch.from_numpy(boxes).to(dev), torch.from_numpy(scores).to(dev)
    corners = torch.cat([torch.minimum(b[:, :2], b[:, 2:]), torch.maximum(b[:, :2], b[:, 2:])], 1)
    cls, box = (sc > thr).nonzero(as_tuple=True)
    order = torch.sort(sc[cls, box], descending=True, stable=True).indices
    kept = nms_in_groups(corners[box], order, cls, iou)
    if kept is None:
        return None
    chosen = order[kept[order]]
    rows = torch.stack([torch.zeros_like(cls[chosen]), cls[chosen], box[chosen]], 1)
    return rows[torch.sort(rows[:, 1], stable=True).indices].cpu().numpy()


def _spread(classes: int, per: int, offset: bool, grid: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """``per`` boxes in each of ``classes`` classes, 0-60 wide in a 0-200 field; ``offset``: moved apart per class
    and given to one class, as torchvision's traced export writes a per-class NMS; ``grid``: on whole numbers,
    so that extents touch exactly and boxes repeat."""
    n = classes * per
    lo = rng.uniform(0, 200, (n, 2)).astype(np.float32)
    side = rng.uniform(0, 60, (n, 2)).astype(np.float32)
    if grid:
        lo, side = np.round(lo / 10) * 10, np.round(side / 10) * 10
    boxes = np.concatenate([lo, lo + side], 1)
    cls = np.repeat(np.arange(classes), per)
    scores = np.full((classes, n), -1.0, np.float32)
    scores[cls, np.arange(n)] = np.round(rng.random(n), 2)  # ties at two decimals: the lowest box first
    if offset:
        boxes = boxes + (cls * 300.0)[:, None].astype(np.float32)
        scores = scores.max(0, keepdims=True)
    return boxes[:, [1, 0, 3, 2]].copy(), scores  # ONNX's [y1, x1, y2, x2]: the groups are cut along y


@pytest.mark.parametrize("offset", [True, False])
@pytest.mark.parametrize("iou", [0.0, 0.45])
@pytest.mark.parametrize("grid", [False, True])
def test_nms_in_groups_selects_what_onnx_runtime_selects(offset, iou, grid):
    """The groups form (no torchvision needed) on class-offset boxes as one class and on real classes, at an IoU
    threshold of 0 (any overlap suppresses: a group cut inside an overlap would show) and on whole-number boxes
    whose extents touch exactly (an empty intersection: cut there, no suppression across)."""
    boxes, scores = _spread(12, 40, offset, grid)
    got = _grouped(boxes, scores, iou)
    assert got is not None, "declined: the groups should hold"
    np.testing.assert_array_equal(got, _ort_nms(boxes, scores, iou))


def test_nms_in_groups_declines_one_chain_of_overlaps():
    """Must not take the groups form: boxes of one class whose extents chain across the field are one group,
    which would compare every pair as the one call does: it declines (None), and the node runs torchvision's one
    call (test_non_max_suppression)."""
    n = 300
    lo = np.stack([np.linspace(0, 600, n), rng.uniform(0, 50, n)], 1).astype(np.float32)
    boxes = np.concatenate([lo, lo + 30], 1)[:, [1, 0, 3, 2]].copy()
    scores = rng.random((1, n)).astype(np.float32)
    assert _grouped(boxes, scores, 0.3) is None


def test_non_max_suppression_through_groups(monkeypatch):
    """The node through the groups form (taken from any count here), batches and a per-class limit included."""
    pytest.importorskip("torchvision")
    import parastream.launcher.engines.onnx_eager as oe

    taken = []
    real = oe.nms_in_groups
    monkeypatch.setattr(oe, "GROUPED_NMS_FROM", 0)
    monkeypatch.setattr(oe, "nms_in_groups", lambda *a: taken.append(1) or real(*a))
    b1, s1 = _spread(6, 30, offset=False)
    b2, s2 = _spread(6, 30, offset=False)
    for limit in (4, 1000):
        one("NonMaxSuppression", {"b": np.stack([b1, b2]), "s": np.stack([s1, s2]), "m": i64(limit),
                                  "iou": np.array([0.3], np.float32), "thr": np.array([0.1], np.float32)})
    assert taken


def test_if_reads_its_outer_scope():
    then_g = helper.make_graph([helper.make_node("Mul", ["x", "two"], ["t"])], "then", [],
                               [helper.make_tensor_value_info("t", TensorProto.FLOAT, None)],
                               [numpy_helper.from_array(np.array(2.0, np.float32), "two")])
    else_g = helper.make_graph([helper.make_node("Neg", ["x"], ["e"])], "else", [],
                               [helper.make_tensor_value_info("e", TensorProto.FLOAT, None)])
    nodes = [helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0),
             helper.make_node("Greater", ["s", "zero"], ["c"]),
             helper.make_node("If", ["c"], ["y"], then_branch=then_g, else_branch=else_g)]
    for sign in (1.0, -1.0):
        x = np.abs(f32(3, 2)) * sign
        check(model(nodes, {"x": x}, ["y"], {"zero": np.array(0.0, np.float32)}, opset=13), {"x": x})


def test_a_repeated_node_runs_once_under_both_names():
    """Two NonZero of one mask, as torchvision's export writes them (each a wait for the GPU), and what follows
    each: computed once, both names answered, what ONNX Runtime answers."""
    from parastream.launcher.engines.onnx_eager import _same

    x = f32(12)
    nodes = [helper.make_node("Greater", ["x", "zero"], ["m"]),
             helper.make_node("NonZero", ["m"], ["nz1"]), helper.make_node("NonZero", ["m"], ["nz2"]),
             helper.make_node("Transpose", ["nz1"], ["t1"], perm=[1, 0]),
             helper.make_node("Transpose", ["nz2"], ["t2"], perm=[1, 0]),
             helper.make_node("Transpose", ["nz2"], ["t3"], perm=[0, 1]),  # other attributes: its own step
             helper.make_node("GatherND", ["x", "t2"], ["kept"])]
    m = model(nodes, {"x": x}, ["t1", "t2", "t3", "kept"], {"zero": np.array(0.0, np.float32)})
    check(m, {"x": x})
    graph = load(m, device=None)
    assert [op for (fn, *_), op in zip(graph.steps, graph.ops) if fn is _same] == ["NonZero", "Transpose"]


def _per_class_tail(classes: int, second_level: bool = False, behind_if: bool = False):
    """A detector's per-class selection as torchvision's SSD export writes it: each class's scores taken from one
    [boxes, classes] tensor, thresholded, NonZero, the passing scores gathered and their top k (k from the count);
    ``second_level``: each class's kept scores thresholded again (a NonZero behind a NonZero); ``behind_if``: the
    first class's mask chosen by an If (its NonZero must stay in place)."""
    nodes, outs = [], []
    consts = {"thr": np.array(0.5, np.float32), "thr2": np.array(1.2, np.float32), "cap": i64(4), "zero": i64(0)}
    for c in range(classes):
        consts[f"c{c}"] = np.array(c, np.int64)
        nodes += [helper.make_node("Gather", ["scores", f"c{c}"], [f"s{c}"], axis=1),
                  helper.make_node("Greater", [f"s{c}", "thr"], [f"m{c}"])]
        mask = f"m{c}"
        if behind_if and c == 0:
            then_g = helper.make_graph([helper.make_node("Identity", ["m0"], ["m0t"])], "then", [],
                                       [helper.make_tensor_value_info("m0t", TensorProto.BOOL, None)])
            else_g = helper.make_graph([helper.make_node("Not", ["m0"], ["m0e"])], "else", [],
                                       [helper.make_tensor_value_info("m0e", TensorProto.BOOL, None)])
            nodes += [helper.make_node("ReduceMax", ["flag"], ["any"], keepdims=0),
                      helper.make_node("Cast", ["any"], ["cond"], to=TensorProto.BOOL),
                      helper.make_node("If", ["cond"], ["m0i"], then_branch=then_g, else_branch=else_g)]
            mask = "m0i"
        nodes += [helper.make_node("NonZero", [mask], [f"nz{c}"]),
                  helper.make_node("Transpose", [f"nz{c}"], [f"ix{c}"], perm=[1, 0]),
                  helper.make_node("GatherND", [f"s{c}", f"ix{c}"], [f"v{c}"]),
                  helper.make_node("Shape", [f"v{c}"], [f"n{c}"]),
                  helper.make_node("Min", [f"n{c}", "cap"], [f"k{c}"]),
                  helper.make_node("TopK", [f"v{c}", f"k{c}"], [f"top{c}", f"at{c}"])]
        outs += [f"top{c}", f"at{c}"]
        if second_level:
            nodes += [helper.make_node("Greater", [f"v{c}", "thr2"], [f"h{c}"]),
                      helper.make_node("NonZero", [f"h{c}"], [f"hz{c}"])]
            outs.append(f"hz{c}")
    feeds = {"scores": f32(40, classes, lo=0.0, hi=2.0), **({"flag": f32(3)} if behind_if else {})}
    return model(nodes, feeds, outs, consts), feeds


def _nonzero_groups(graph) -> list[int]:
    from parastream.launcher.engines.onnx_eager import _nonzeros

    return [len(ins) for fn, ins, *_ in graph.steps if fn is _nonzeros]


def test_independent_nonzeros_are_counted_together():
    """Five classes' NonZero, each behind kernels of its own: one step counts them all (one wait for the GPU),
    issued after every class's threshold, and the outputs are ONNX Runtime's."""
    m, feeds = _per_class_tail(5)
    check(m, feeds)
    graph = load(m, device=None)
    assert _nonzero_groups(graph) == [5]
    first = graph.ops.index("NonZero")
    assert graph.ops[:first].count("Greater") == 5 and "TopK" not in graph.ops[:first]


def test_nonzeros_behind_nonzeros_are_a_second_group():
    m, feeds = _per_class_tail(4, second_level=True)
    check(m, feeds)
    assert _nonzero_groups(load(m, device=None)) == [4, 4]


def test_a_nonzero_behind_an_if_stays_in_place():
    """The first class's mask comes out of an If (whose branches read the outer scope by name): its NonZero is
    not moved, the other classes' are counted together."""
    m, feeds = _per_class_tail(3, behind_if=True)
    check(m, feeds)
    graph = load(m, device=None)
    assert _nonzero_groups(graph) == [2]
    assert graph.ops.count("NonZero") == 2  # the group's step and the first class's own


def test_a_lone_nonzero_is_left_alone():
    m, feeds = _per_class_tail(1)
    check(m, feeds)
    assert _nonzero_groups(load(m, device=None)) == []


@pytest.mark.parametrize("trans_a,trans_b,alpha,beta,bias", [(0, 1, 1.0, 1.0, True), (1, 0, 0.5, 2.0, True),
                                                              (0, 0, 1.0, 1.0, False)])
def test_gemm(trans_a, trans_b, alpha, beta, bias):
    a = f32(4, 3) if trans_a else f32(3, 4)
    b = f32(5, 4) if trans_b else f32(4, 5)
    feeds = {"a": a, "b": b, **({"c": f32(5)} if bias else {})}
    one("Gemm", feeds, transA=trans_a, transB=trans_b, alpha=alpha, beta=beta)


@pytest.mark.parametrize("reduction", ["none", "add", "mul", "max", "min"])
def test_scatter_elements(reduction):
    # Repeated indices only where a reduction defines their result: ONNX leaves a plain scatter's repeats
    # undefined, and CUDA's scatter writes them in no fixed order.
    last = [3, 3] if reduction != "none" else [3, 0]
    one("ScatterElements", {"x": f32(3, 4), "i": np.array([[0, -1], [2, 1], last], np.int64), "u": f32(3, 2)},
        opset=18, axis=1, reduction=reduction)


@pytest.mark.parametrize("mode,opset", [("output_half_pixel", 16), ("half_pixel", 16), (None, 10)])
@pytest.mark.parametrize("ratio", [0, 2])
def test_roi_align(mode, opset, ratio):
    pytest.importorskip("torchvision")
    rois = np.array([[1.0, 2.0, 10.5, 12.0], [0.0, 0.0, 15.0, 15.0], [3.3, 4.1, 5.2, 9.9]], np.float32)
    attrs = dict(output_height=3, output_width=4, sampling_ratio=ratio, spatial_scale=0.5)
    if mode:
        attrs["coordinate_transformation_mode"] = mode
    one("RoiAlign", {"x": f32(2, 3, 8, 8), "r": rois, "b": i64(0, 1, 1)}, opset=opset, **attrs)


def test_roi_align_of_the_maximum_is_refused():
    pytest.importorskip("torchvision")
    node = helper.make_node("RoiAlign", ["x", "r", "b"], ["y"], name="the_roi", mode="max")
    feeds = {"x": f32(1, 1, 4, 4), "r": np.zeros((1, 4), np.float32), "b": i64(0)}
    with pytest.raises(UnsupportedOp, match="the_roi.*max"):
        load(model([node], feeds, ["y"], opset=16), device=None)


# -- refused: the tail stays on the host ---------------------------------------------------------------------

def test_a_loop_or_another_domain_is_refused_naming_the_node():
    body = helper.make_graph([helper.make_node("Identity", ["cond_in"], ["cond_out"])], "body",
                             [helper.make_tensor_value_info("i", TensorProto.INT64, []),
                              helper.make_tensor_value_info("cond_in", TensorProto.BOOL, [])],
                             [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, [])])
    loop = helper.make_node("Loop", ["n", "c"], [], name="the_loop", body=body)
    feeds = {"n": i64(3), "c": np.array(True)}
    with pytest.raises(UnsupportedOp, match="the_loop.*Loop"):
        load(model([loop], feeds, []), device=None)
    custom = helper.make_node("Add", ["a", "a"], ["y"], name="their_add", domain="com.example")
    m = helper.make_model(helper.make_graph([custom], "g", [helper.make_tensor_value_info("a", TensorProto.FLOAT, [2])],
                                            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])]),
                          opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1)])
    with pytest.raises(UnsupportedOp, match="their_add"):
        load(m, device=None)


@pytest.mark.parametrize("failure", ["RuntimeError('operator torchvision::nms does not exist')",
                                     "ImportError('No module named torchvision._C')"])
def test_a_torchvision_that_does_not_import_refuses_its_nodes_naming_them(failure, tmp_path, monkeypatch):
    """A torchvision built for another torch fails at import with a RuntimeError: its nodes are refused (their tail
    stays on the host) with the reason, as where torchvision is missing, not a traceback out of the build."""
    (tmp_path / "torchvision").mkdir()
    (tmp_path / "torchvision" / "__init__.py").write_text(f"raise {failure}\n")
    for name in [m for m in list(sys.modules) if m == "torchvision" or m.startswith("torchvision.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(tmp_path))
    nms = helper.make_node("NonMaxSuppression", ["b", "s"], ["y"], name="the_nms")
    feeds = {"b": _boxes(1, 4, False), "s": rng.random((1, 1, 4)).astype(np.float32)}
    reason = "does not import: operator torchvision::nms" if failure.startswith("Runtime") else "pip install torchvision"
    with pytest.raises(UnsupportedOp, match=f"the_nms.*NonMaxSuppression.*{reason}"):
        load(model([nms], feeds, ["y"]), device=None)
    roi = helper.make_node("RoiAlign", ["x", "r", "i"], ["y"], name="the_roi")
    feeds = {"x": f32(1, 1, 4, 4), "r": np.zeros((1, 4), np.float32), "i": i64(0)}
    with pytest.raises(UnsupportedOp, match=f"the_roi.*RoiAlign.*{reason}"):
        load(model([roi], feeds, ["y"], opset=16), device=None)


def test_a_scatter_with_a_reduction_is_refused():
    node = helper.make_node("ScatterND", ["x", "i", "u"], ["y"], name="the_scatter", reduction="add")
    feeds = {"x": f32(4, 3), "i": np.array([[1]], np.int64), "u": f32(1, 3)}
    with pytest.raises(UnsupportedOp, match="the_scatter.*reduction"):
        load(model([node], feeds, ["y"], opset=16), device=None)


def test_every_op_of_the_table_is_tested_here():
    """A new op in the table comes with its test above (its name in this file)."""
    from pathlib import Path

    text = Path(__file__).read_text()
    assert [op for op in OPS if f'"{op}"' not in text] == []
