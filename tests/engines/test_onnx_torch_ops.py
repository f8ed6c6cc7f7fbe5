"""Ops the public-model corpus needed in the torch converter: each against ONNX Runtime on the
CPU, and each with a case it must refuse (naming the node) rather than convert wrongly."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

torch = pytest.importorskip("torch")

from parastream.launcher.engines.onnx_torch import UnsupportedOp, convert  # noqa: E402

from test_onnx_torch_attributes import check  # noqa: E402  (shapes, dtypes and values against ONNX Runtime)

F, I64 = TensorProto.FLOAT, TensorProto.INT64


def one_node(op, inputs, outputs, consts=None, opset=17, **attrs):
    """A model of one node; ``inputs``/``outputs``: [(name, elem_type, shape)], ``consts``: {name: array}."""
    consts = consts or {}
    node = helper.make_node(op, [n for n, *_ in inputs] + list(consts), [n for n, *_ in outputs], name=f"the_{op}", **attrs)
    g = helper.make_graph([node], op, [helper.make_tensor_value_info(*i) for i in inputs],
                          [helper.make_tensor_value_info(*o) for o in outputs],
                          [numpy_helper.from_array(v, k) for k, v in consts.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    return onnx.shape_inference.infer_shapes(m, strict_mode=True, data_prop=True)


def reorder(model, order):
    """Put the node's inputs in ``order`` (names), for ops whose constant input is not the last."""
    node = model.graph.node[0]
    del node.input[:]
    node.input.extend(order)
    return model


rng = np.random.default_rng(0)


@pytest.mark.parametrize("batch_dims", [0, 1])
@pytest.mark.parametrize("k", [1, 2])
def test_gathernd(batch_dims, k):
    data = rng.standard_normal((3, 4, 5, 2)).astype(np.float32)
    lead = [3] if batch_dims else []
    dims = data.shape[batch_dims:batch_dims + k]
    idx = np.stack([rng.integers(-d, d, size=(*lead, 6)) for d in dims], axis=-1).astype(np.int64)
    out_shape = [*lead, 6, *data.shape[batch_dims + k:]]
    m = one_node("GatherND", [("x", F, list(data.shape)), ("i", I64, list(idx.shape))], [("y", F, out_shape)],
                 batch_dims=batch_dims)
    check(m, {"x": data, "i": idx})


def test_gathernd_bert_dynamo_pattern():
    """What torch's dynamo exporter writes for ``hidden[arange(B), positions]`` (BERT-like pooling)."""
    data = rng.standard_normal((2, 7, 8)).astype(np.float32)
    idx = np.array([[0, 3], [1, -1]], dtype=np.int64)
    check(one_node("GatherND", [("x", F, [2, 7, 8]), ("i", I64, [2, 2])], [("y", F, [2, 8])]), {"x": data, "i": idx})


@pytest.mark.parametrize("reduction", ["none", "add", "mul"])
def test_scatternd(reduction):
    data = rng.standard_normal((5, 4, 3)).astype(np.float32)
    idx = np.array([[0], [2], [4]], dtype=np.int64) if reduction == "none" else np.array([[0], [2], [0]], dtype=np.int64)
    upd = rng.standard_normal((3, 4, 3)).astype(np.float32)
    m = one_node("ScatterND", [("x", F, [5, 4, 3]), ("i", I64, [3, 1]), ("u", F, [3, 4, 3])], [("y", F, [5, 4, 3])],
                 opset=18, reduction=reduction)
    check(m, {"x": data, "i": idx, "u": upd}, rtol=1e-5)


def test_scatternd_two_index_axes_negative():
    data = rng.standard_normal((4, 6)).astype(np.float32)
    idx = np.array([[0, -1], [3, 2]], dtype=np.int64)
    upd = np.array([10.0, 20.0], dtype=np.float32)
    check(one_node("ScatterND", [("x", F, [4, 6]), ("i", I64, [2, 2]), ("u", F, [2])], [("y", F, [4, 6])]),
          {"x": data, "i": idx, "u": upd})


def test_scatternd_max_reduction_is_refused():
    m = one_node("ScatterND", [("x", F, [5, 3]), ("i", I64, [2, 1]), ("u", F, [2, 3])], [("y", F, [5, 3])],
                 opset=18, reduction="max")
    with pytest.raises(UnsupportedOp, match="the_ScatterND.*reduction 'max'"):
        convert(m)


@pytest.mark.parametrize("largest,axis", [(1, -1), (0, 0)])
def test_topk(largest, axis):
    x = rng.permutation(24).reshape(4, 6).astype(np.float32)  # distinct values: one right order
    shape = [4, 3] if axis == -1 else [3, 6]
    m = reorder(one_node("TopK", [("x", F, [4, 6])], [("v", F, shape), ("i", I64, shape)], consts={"k": np.array([3], np.int64)},
                         axis=axis, largest=largest), ["x", "k"])
    check(m, {"x": x})


def test_topk_with_a_runtime_k_is_refused():
    m = one_node("TopK", [("x", F, [4, 6]), ("k", I64, [1])], [("v", F, [4, "k"]), ("i", I64, [4, "k"])])
    with pytest.raises(UnsupportedOp, match="the_TopK.*input 1 must be a constant"):
        convert(m)


@pytest.mark.parametrize("upper,k", [(1, 0), (0, 0), (1, 1), (0, -1)])
def test_trilu(upper, k):
    x = rng.standard_normal((2, 5, 5)).astype(np.float32)
    m = one_node("Trilu", [("x", F, [2, 5, 5])], [("y", F, [2, 5, 5])], consts={"k": np.array(k, np.int64)}, upper=upper)
    check(m, {"x": x})


def test_cumsum():
    x = rng.standard_normal((3, 5)).astype(np.float32)
    check(one_node("CumSum", [("x", F, [3, 5])], [("y", F, [3, 5])], consts={"a": np.array(1, np.int64)}), {"x": x}, rtol=1e-5)


def test_cumsum_int64_keeps_its_dtype():
    x = rng.integers(0, 3, (2, 6)).astype(np.int64)
    check(one_node("CumSum", [("x", I64, [2, 6])], [("y", I64, [2, 6])], consts={"a": np.array(1, np.int64)}), {"x": x})


@pytest.mark.parametrize("pos,neg", [(1, 1), (1, 0), (0, 1)])
def test_isinf(pos, neg):
    x = np.array([[1.0, np.inf, -np.inf, np.nan, 0.0]], dtype=np.float32)
    m = one_node("IsInf", [("x", F, [1, 5])], [("y", TensorProto.BOOL, [1, 5])], detect_positive=pos, detect_negative=neg)
    check(m, {"x": x})


def test_scatter_elements():
    x = rng.standard_normal((3, 4)).astype(np.float32)
    i = np.array([[0, -1], [2, 1], [3, 0]], dtype=np.int64)
    u = rng.standard_normal((3, 2)).astype(np.float32)
    check(one_node("ScatterElements", [("x", F, [3, 4]), ("i", I64, [3, 2]), ("u", F, [3, 2])], [("y", F, [3, 4])], axis=1),
          {"x": x, "i": i, "u": u})


def test_scatter_elements_with_a_reduction_is_refused():
    m = one_node("ScatterElements", [("x", F, [3, 4]), ("i", I64, [3, 2]), ("u", F, [3, 2])], [("y", F, [3, 4])],
                 opset=18, axis=1, reduction="add")
    with pytest.raises(UnsupportedOp, match="the_ScatterElements.*reduction 'add'"):
        convert(m)


# -- attention: ONNX's opset-23 Attention and parastream's own ScaledDotProductAttention (core/fused_ops.py) -------
def attention_model(op, q, k, v, mask=None, **attrs):
    """One attention node of ``op`` ("Attention" at opset 23, or parastream's node) over inputs of these shapes."""
    from parastream.core import fused_ops

    inputs = [("q", F, q), ("k", F, k), ("v", F, v)] + ([("m", *mask)] if mask else [])
    out = [*q[:-1], v[-1]] if op == "Attention" else None
    m = one_node(op, inputs, [("y", F, out)], opset=23, **attrs) if op == "Attention" else None
    if m is None:
        node = helper.make_node(fused_ops.SDPA, [n for n, *_ in inputs], ["y"], name="the_sdpa", domain=fused_ops.DOMAIN,
                                **attrs)
        g = helper.make_graph([node], "sdpa", [helper.make_tensor_value_info(*i) for i in inputs],
                              [helper.make_tensor_value_info("y", F, None)])
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), fused_ops.opset_id()])
        m.ir_version = 8
        m = onnx.shape_inference.infer_shapes(m, strict_mode=True)
    return m


ATTENTION_CASES = {  # name: (shapes of q, k, v, the mask as (elem type, shape) or None, attributes)
    "plain": ([2, 3, 5, 4], [2, 3, 7, 4], [2, 3, 7, 6], None, {}),
    "scale, additive mask": ([2, 3, 5, 4], [2, 3, 7, 4], [2, 3, 7, 4], (F, [2, 1, 5, 7]), {"scale": 0.3}),
    "boolean mask": ([1, 2, 6, 4], [1, 2, 6, 4], [1, 2, 6, 4], (TensorProto.BOOL, [1, 2, 6, 6]), {"scale": 0.5}),
    "causal": ([2, 2, 6, 8], [2, 2, 6, 8], [2, 2, 6, 8], None, {"is_causal": 1, "scale": 0.25}),
}


def attention_feeds(m):
    feeds = {}
    for i in m.graph.input:
        shape = [d.dim_value for d in i.type.tensor_type.shape.dim]
        if i.type.tensor_type.elem_type == TensorProto.BOOL:
            keep = rng.random(shape) > 0.3
            keep[..., 0] = True  # every query sees a key
            feeds[i.name] = keep
        else:
            feeds[i.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


@pytest.mark.parametrize("fuse", [True, False])
@pytest.mark.parametrize("case", sorted(ATTENTION_CASES))
def test_attention_as_sdpa_and_decomposed(case, fuse):
    """Both nodes, as SDPA and as its decomposition, against ONNX Runtime's opset-23 Attention (which runs
    parastream's node's semantics: softmax(scale·Q·Kᵀ + mask)·V)."""
    import onnxruntime as ort

    q, k, v, mask, attrs = ATTENTION_CASES[case]
    attrs = dict(attrs)
    reference = attention_model("Attention", q, k, v, mask, **attrs)
    feeds = attention_feeds(reference)
    want = ort.InferenceSession(reference.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    attrs.setdefault("scale", 1.0 / np.sqrt(q[-1]))  # ONNX's default; parastream's node says it
    for m in (reference, attention_model("sdpa", q, k, v, mask, **attrs)):
        module = convert(m, fuse_attention=fuse)
        with torch.no_grad():
            got = module(*[torch.from_numpy(feeds[n]) for n in module.input_names])[0]
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5)


def test_attention_grouped_query_heads():
    import onnxruntime as ort

    m = attention_model("Attention", [1, 4, 5, 8], [1, 2, 5, 8], [1, 2, 5, 8])
    feeds = attention_feeds(m)
    want = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    for fuse in (True, False):
        with torch.no_grad():
            got = convert(m, fuse_attention=fuse)(*[torch.from_numpy(feeds[n]) for n in ("q", "k", "v")])[0]
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5)


def test_attention_off_runs_the_decomposition(monkeypatch):
    """``fuse_attention=False``: the module never calls SDPA (the GPU build times the two against each other)."""
    q, k, v, mask, attrs = ATTENTION_CASES["scale, additive mask"]
    m = attention_model("sdpa", q, k, v, mask, **attrs)
    feeds = [torch.from_numpy(x) for x in attention_feeds(m).values()]
    fused, unfused = convert(m, fuse_attention=True), convert(m, fuse_attention=False)

    def refuse(*a, **kw):
        raise AssertionError("SDPA called")

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", refuse)
    with torch.no_grad():
        unfused(*feeds)
        with pytest.raises(AssertionError, match="SDPA called"):
            fused(*feeds)


def test_attention_with_a_kv_cache_is_refused():
    m = one_node("Attention", [("q", F, [1, 2, 3, 4]), ("k", F, [1, 2, 3, 4]), ("v", F, [1, 2, 3, 4]),
                               ("mask", F, [1, 2, 3, 3]), ("past_key", F, [1, 2, 2, 4]), ("past_value", F, [1, 2, 2, 4])],
                 [("y", F, [1, 2, 3, 4]), ("present_key", F, None), ("present_value", F, None)], opset=23)
    with pytest.raises(UnsupportedOp, match="the_Attention.*KV cache"):
        convert(m)


@pytest.mark.parametrize("case", ["boolean mask", "causal"])
def test_attention_traces_to_fx(case):
    """The engines compile the FX graph of the module (``to_fx``): both forms trace without falling back."""
    from parastream.launcher.engines.onnx_torch import to_fx

    q, k, v, mask, attrs = ATTENTION_CASES[case]
    m = attention_model("sdpa", q, k, v, mask, **attrs)
    feeds = [torch.from_numpy(x) for x in attention_feeds(m).values()]
    for fuse in (True, False):
        module = convert(m, fuse_attention=fuse)
        with torch.no_grad():
            np.testing.assert_allclose(to_fx(module)(*feeds)[0].numpy(), module(*feeds)[0].numpy(), rtol=1e-6, atol=1e-6)


def resize(in_shape, *, sizes=None, scales=None, opset=17, **attrs):
    """A Resize of ``x`` (no roi) by constant ``sizes`` or ``scales``, with its output shape inferred."""
    ins, inits = ["x", "", ""], []
    if scales is not None:
        ins[2] = "scales"
        inits.append(numpy_helper.from_array(np.asarray(scales, dtype=np.float32), "scales"))
    if sizes is not None:
        ins.append("sizes")
        inits.append(numpy_helper.from_array(np.asarray(sizes, dtype=np.int64), "sizes"))
    node = helper.make_node("Resize", ins, ["y"], name="the_Resize", **attrs)
    g = helper.make_graph([node], "resize", [helper.make_tensor_value_info("x", F, list(in_shape))],
                          [helper.make_tensor_value_info("y", F, None)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    return onnx.shape_inference.infer_shapes(m, strict_mode=True)


RESIZES = [  # (mode, coordinate mode, nearest_mode, input shape, sizes or scales)
    ("nearest", "asymmetric", "floor", (1, 2, 7, 9), {"sizes": [1, 2, 14, 18]}),
    ("nearest", "asymmetric", "floor", (1, 2, 7, 5), {"scales": [1, 1, 1.5, 1.7]}),
    ("nearest", "half_pixel", "round_prefer_ceil", (1, 2, 16, 15), {"sizes": [1, 2, 7, 5]}),
    ("nearest", "half_pixel", "round_prefer_ceil", (1, 2, 7, 5), {"scales": [1, 1, 1.5, 1.7]}),
    ("nearest", "asymmetric", "floor", (2, 3, 5, 4, 6), {"scales": [1, 1, 2, 2, 2]}),
    ("linear", "half_pixel", None, (1, 2, 7, 9), {"sizes": [1, 2, 14, 18]}),
    ("linear", "half_pixel", None, (1, 2, 7, 5), {"scales": [1, 1, 1.5, 1.7]}),
    ("linear", "pytorch_half_pixel", None, (1, 2, 5, 6), {"sizes": [1, 2, 1, 3]}),
    ("linear", "align_corners", None, (1, 2, 16, 15), {"sizes": [1, 2, 7, 5]}),
    ("linear", "half_pixel", None, (1, 3, 10), {"sizes": [1, 3, 17]}),
    ("linear", "half_pixel", None, (1, 2, 3, 4, 5), {"scales": [1, 1, 2, 1.5, 0.6]}),
    ("cubic", "half_pixel", None, (1, 2, 7, 9), {"sizes": [1, 2, 14, 18]}),
    ("cubic", "half_pixel", None, (1, 3, 24, 24), {"sizes": [1, 3, 20, 20]}),
    ("cubic", "half_pixel", None, (1, 2, 7, 5), {"scales": [1, 1, 1.5, 1.7]}),
    ("cubic", "pytorch_half_pixel", None, (1, 2, 5, 6), {"sizes": [1, 2, 1, 3]}),
    ("cubic", "align_corners", None, (1, 2, 5, 5), {"sizes": [1, 2, 11, 3]}),
]


@pytest.mark.parametrize("mode,ctm,nearest,shape,target", RESIZES,
                         ids=[f"{m}-{c}-{'x'.join(map(str, s))}-{next(iter(t))}" for m, c, _, s, t in RESIZES])
def test_resize(mode, ctm, nearest, shape, target):
    """Scales are passed as scales: where in * scale is not whole, ONNX maps coordinates by the scale (sizes
    recomputed from the output gave errors of 0.6-2.2 here); pytorch_half_pixel samples index 0 along an axis
    resized to 1 (torch's half-pixel samples its middle)."""
    attrs = {"mode": mode, "coordinate_transformation_mode": ctm} | ({"nearest_mode": nearest} if nearest else {})
    m = resize(shape, **target, **attrs)
    # cubic's weights come from coordinates that ONNX Runtime computes from the scale output/input and torch
    # from input/output: a few ulps apart, times the image's slope
    check(m, {"x": rng.standard_normal(shape).astype(np.float32)}, rtol=1e-5, atol=5e-5 if mode == "cubic" else 1e-6)


def test_resize_of_the_listed_axes_only():
    """opset 18's ``axes``: sizes for the named axes, the others kept."""
    m = resize((1, 2, 7, 9), sizes=[14, 18], opset=18, axes=[2, 3], mode="linear")
    check(m, {"x": rng.standard_normal((1, 2, 7, 9)).astype(np.float32)})


@pytest.mark.parametrize("opset,shape,target,attrs,why", [
    (17, (1, 2, 7, 9), {"sizes": [1, 2, 14, 18]}, {"mode": "nearest", "coordinate_transformation_mode": "half_pixel"},
     "nearest_mode 'round_prefer_floor'"),
    (17, (1, 2, 7, 9), {"sizes": [1, 2, 14, 18]}, {"mode": "cubic", "cubic_coeff_a": -0.5}, "cubic_coeff_a"),
    (17, (1, 2, 7, 9), {"sizes": [1, 2, 14, 18]}, {"mode": "cubic", "exclude_outside": 1}, "exclude_outside=1"),
    (18, (1, 2, 16, 16), {"sizes": [1, 2, 7, 7]}, {"mode": "linear", "antialias": 1}, "antialias=1"),
    (18, (1, 2, 16, 12), {"sizes": [1, 2, 8, 8]}, {"mode": "linear", "keep_aspect_ratio_policy": "not_larger"},
     "keep_aspect_ratio_policy"),
    (17, (1, 2, 7, 9), {"sizes": [1, 4, 14, 18]}, {"mode": "linear"}, "batch or channel axis"),
    (17, (1, 2, 7, 9), {"scales": [2, 1, 1, 1]}, {"mode": "nearest", "coordinate_transformation_mode": "asymmetric",
                                                   "nearest_mode": "floor"}, "batch or channel axis"),
    (17, (1, 2, 3, 7, 9), {"sizes": [1, 2, 6, 14, 18]}, {"mode": "cubic"}, "over 3 axes"),
    (17, (1, 2, 7, 9), {"sizes": [1, 2, 14, 18]}, {"mode": "linear", "coordinate_transformation_mode": "asymmetric"},
     "'asymmetric'"),
])
def test_resize_refused_where_torch_samples_elsewhere(opset, shape, target, attrs, why):
    """Each of these would convert to an ``F.interpolate`` that samples other points than ONNX's: refused,
    naming the node and the reason."""
    m = resize(shape, opset=opset, **target, **attrs)
    with pytest.raises(UnsupportedOp, match=rf"the_Resize.*{why}"):
        convert(m)


def recurrent(op, *, seq=5, batch=3, inp=4, hidden=6, direction="forward", layout=0, bias=True, states=False,
              peepholes=False, lens=None, **attrs):
    """One LSTM, GRU or RNN node with random constant weights; returns (model, feeds)."""
    gates = {"LSTM": 4, "GRU": 3, "RNN": 1}[op]
    dirs = 2 if direction == "bidirectional" else 1
    x_shape = [batch, seq, inp] if layout else [seq, batch, inp]
    state = [batch, dirs, hidden] if layout else [dirs, batch, hidden]
    consts = {"W": rng.standard_normal((dirs, gates * hidden, inp)).astype(np.float32) * 0.5,
              "R": rng.standard_normal((dirs, gates * hidden, hidden)).astype(np.float32) * 0.5}
    if bias:
        consts["B"] = rng.standard_normal((dirs, 2 * gates * hidden)).astype(np.float32) * 0.5
    if lens is not None:
        consts["lens"] = np.asarray(lens, dtype=np.int32)
    names = ["x", "W", "R", "B" if bias else "", "lens" if lens is not None else ""]
    graph_inputs, feeds = [helper.make_tensor_value_info("x", F, x_shape)], {}
    feeds["x"] = rng.standard_normal(x_shape).astype(np.float32)
    for s in (["h0", "c0"] if op == "LSTM" else ["h0"]):
        if states:
            graph_inputs.append(helper.make_tensor_value_info(s, F, state))
            feeds[s] = rng.standard_normal(state).astype(np.float32)
        names.append(s if states else "")
    if peepholes:
        consts["P"] = rng.standard_normal((dirs, 3 * hidden)).astype(np.float32) * 0.5
        names.append("P")
    while names and not names[-1]:
        names.pop()
    outs = ["Y", "Y_h", "Y_c"][:3 if op == "LSTM" else 2]
    node = helper.make_node(op, names, outs, name=f"the_{op}", hidden_size=hidden, direction=direction,
                            **({"layout": layout} if layout else {}), **attrs)
    g = helper.make_graph([node], op, graph_inputs, [helper.make_tensor_value_info(o, F, None) for o in outs],
                          [numpy_helper.from_array(v, k) for k, v in consts.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 14)])
    m.ir_version = 8
    return onnx.shape_inference.infer_shapes(m, strict_mode=True), feeds


RECURRENT = [
    ("LSTM", {}), ("LSTM", {"direction": "reverse"}), ("LSTM", {"direction": "bidirectional", "states": True}),
    ("LSTM", {"layout": 1, "direction": "bidirectional", "states": True}), ("LSTM", {"bias": False}),
    ("LSTM", {"peepholes": True, "states": True}), ("LSTM", {"clip": 0.7}), ("LSTM", {"lens": [5, 5, 5]}),
    ("LSTM", {"direction": "bidirectional", "activations": ["Sigmoid", "Relu", "Tanh", "Sigmoid", "Tanh", "Relu"]}),
    ("GRU", {}), ("GRU", {"linear_before_reset": 1, "direction": "bidirectional", "states": True}),
    ("GRU", {"layout": 1, "states": True}), ("GRU", {"states": True, "clip": 0.5}),
    ("GRU", {"direction": "reverse", "bias": False}),
    ("RNN", {}), ("RNN", {"direction": "bidirectional", "activations": ["Relu", "Tanh"], "states": True}),
]


@pytest.mark.parametrize("op,kw", RECURRENT, ids=[f"{op}-{'-'.join(f'{k}={v}' for k, v in kw.items()) or 'plain'}"
                                                   for op, kw in RECURRENT])
def test_recurrent(op, kw):
    """Against ONNX Runtime; layout 1 (batch first), which ONNX Runtime's CPU kernels refuse, against the ONNX
    reference evaluator (whose GRU ignores ``clip``: clipped cases run on layout 0)."""
    m, feeds = recurrent(op, **kw)
    if not kw.get("layout"):
        check(m, feeds, rtol=1e-5, atol=1e-5)
        return
    from onnx.reference import ReferenceEvaluator

    module = convert(m)
    with torch.no_grad():
        outs = module(*[torch.from_numpy(feeds[n]) for n in module.input_names])
    for o, r in zip(outs, ReferenceEvaluator(m).run(None, feeds), strict=True):
        np.testing.assert_allclose(o.numpy(), r, rtol=1e-5, atol=1e-5)


def test_lstm_as_torch_exports_it():
    """nn.LSTM (two layers, bidirectional, batch-first; timm's Sequencer uses it so) through torch's exporter, which
    reorders the gates and writes each layer as an ONNX LSTM between Transposes and Reshapes: the converter's
    module against the nn.LSTM itself."""
    import io

    lstm = torch.nn.LSTM(8, 5, num_layers=2, bidirectional=True, batch_first=True).eval()
    x = torch.randn(3, 7, 8)
    buf = io.BytesIO()
    torch.onnx.export(lstm, (x,), buf, input_names=["x"], output_names=["y", "h", "c"], opset_version=17, dynamo=False)
    m = onnx.shape_inference.infer_shapes(onnx.load_from_string(buf.getvalue()), strict_mode=True)
    assert sum(n.op_type == "LSTM" for n in m.graph.node) == 2
    with torch.no_grad():
        want = lstm(x)
        got = convert(m)(x)
    for g, w in zip(got, [want[0], *want[1]]):
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op,kw,why", [
    ("LSTM", {"activations": ["Sigmoid", "LeakyRelu", "Tanh"]}, "activations"),
    ("LSTM", {"activations": ["Sigmoid", "Tanh", "Tanh"], "activation_alpha": [0.1, 0.1, 0.1]}, "activation_alpha"),
    ("LSTM", {"input_forget": 1}, "input_forget=1"),
    ("LSTM", {"lens": [5, 3, 5]}, "sequence_lens"),
    ("GRU", {"lens": [2, 2, 2]}, "sequence_lens"),
])
def test_recurrent_refused_where_it_would_compute_otherwise(op, kw, why):
    """Padded sequences (a sequence_lens short of the length) and activations torch has no function for are
    refused by name, never run as if the sequence were whole."""
    m, _ = recurrent(op, **kw)
    with pytest.raises(UnsupportedOp, match=rf"the_{op}.*{why}"):
        convert(m)


def test_lstm_of_one_output():
    """An LSTM whose graph reads its Y alone (the dynamo exporter writes it so): the step's value is Y itself,
    which the next node reads."""
    m, feeds = recurrent("LSTM", direction="bidirectional")
    node = m.graph.node[0]
    del node.output[1:]
    t = helper.make_node("Transpose", ["Y"], ["Z"], perm=[2, 0, 1, 3])
    m.graph.node.append(t)
    del m.graph.output[:]
    m.graph.output.append(helper.make_tensor_value_info("Z", F, None))
    check(onnx.shape_inference.infer_shapes(m, strict_mode=True), feeds, rtol=1e-5, atol=1e-5)


def col2im(image, block, cols, opset=18, **attrs):
    consts = {"image": np.asarray(image, dtype=np.int64), "block": np.asarray(block, dtype=np.int64)}
    n_out = [1, cols[1] // int(np.prod(block)), *image]
    return one_node("Col2Im", [("x", F, list(cols))], [("y", F, n_out)], consts, opset=opset, **attrs)


@pytest.mark.parametrize("attrs", [{}, {"strides": [2, 2]}, {"pads": [1, 1, 1, 1], "strides": [2, 2]},
                                   {"dilations": [2, 1], "pads": [2, 0, 2, 0]}])
def test_col2im(attrs):
    """VOLO's outlook attention folds its patches back with Col2Im (opset 18, the dynamo exporter)."""
    H = W = 8
    k, s = 3, attrs.get("strides", [1, 1])
    d, p = attrs.get("dilations", [1, 1]), attrs.get("pads", [0, 0, 0, 0])
    blocks = [(n + 2 * pp - dd * (k - 1) - 1) // ss + 1 for n, pp, dd, ss in zip((H, W), p[:2], d, s)]
    cols = (1, 2 * k * k, blocks[0] * blocks[1])
    check(col2im([H, W], [k, k], cols, **attrs), {"x": rng.standard_normal(cols).astype(np.float32)}, atol=1e-5)


def test_col2im_with_uneven_pads_is_refused():
    m = col2im([8, 8], [3, 3], (1, 18, 36), pads=[1, 1, 0, 0])
    with pytest.raises(UnsupportedOp, match="the_Col2Im.*pads"):
        convert(m)


def test_a_split_of_one_output_gives_that_output():
    """Any converter that returns a tuple for a node of one output (here Split into one part): the next node reads
    the tensor, not the tuple."""
    m = one_node("Split", [("x", F, [4, 6])], [("y", F, [4, 6])], axis=1, num_outputs=1, opset=18)
    t = helper.make_node("Transpose", ["y"], ["z"], perm=[1, 0])
    m.graph.node.append(t)
    del m.graph.output[:]
    m.graph.output.append(helper.make_tensor_value_info("z", F, [6, 4]))
    check(m, {"x": rng.standard_normal((4, 6)).astype(np.float32)})


TORCH_LAYER = [("LSTM", {}), ("LSTM", {"direction": "reverse"}), ("LSTM", {"layout": 1, "direction": "bidirectional",
               "states": True}), ("LSTM", {"bias": False}), ("GRU", {"linear_before_reset": 1, "direction": "bidirectional",
               "states": True}), ("RNN", {}), ("RNN", {"activations": ["Relu", "Relu"], "direction": "bidirectional"})]
WRITTEN_OUT = [("LSTM", {"peepholes": True}), ("LSTM", {"clip": 0.7}), ("GRU", {}),
               ("LSTM", {"activations": ["Sigmoid", "Relu", "Tanh"]}), ("RNN", {"activations": ["Relu", "Tanh"],
               "direction": "bidirectional"}), ("RNN", {"activations": ["Sigmoid"]})]


@pytest.mark.parametrize("op,kw,as_torch", [(o, k, True) for o, k in TORCH_LAYER] + [(o, k, False) for o, k in WRITTEN_OUT])
def test_recurrent_runs_as_torchs_own_layer_where_that_computes_the_same(monkeypatch, op, kw, as_torch):
    """Where torch's layer computes what ONNX's node does (default activations, no clip, no peepholes, a GRU's
    linear_before_reset), the node is one ``torch.ops.parastream.rnn`` call; otherwise it is written out step by
    step.  Either way against ONNX Runtime (Relu RNNs and unrolled GRUs included)."""
    from parastream.launcher.engines import onnx_torch

    used = []
    real = onnx_torch._torch_rnn
    monkeypatch.setattr(onnx_torch, "_torch_rnn", lambda n, kind, *a: used.append(kind) or real(n, kind, *a))
    m, feeds = recurrent(op, **kw)
    if kw.get("layout"):
        from onnx.reference import ReferenceEvaluator

        module = convert(m)
        with torch.no_grad():
            outs = module(*[torch.from_numpy(feeds[n]) for n in module.input_names])
        for o, r in zip(outs, ReferenceEvaluator(m).run(None, feeds), strict=True):
            np.testing.assert_allclose(o.numpy(), r, rtol=1e-5, atol=1e-5)
    else:
        check(m, feeds, rtol=1e-5, atol=1e-5)
    assert bool(used) is as_torch
    assert convert(m).recurrent_weights == int(as_torch)  # the constant weights stored in torch's gate order
    if as_torch:
        assert used[0] == (op if op != "RNN" else f"RNN_{(kw.get('activations') or ['Tanh'])[0].upper()}")


def test_torchs_recurrent_layer_compiles_as_one_call():
    """torch.compile takes the converted LSTM whole (``fullgraph``: no graph break) with the layer an extern call,
    not one set of kernels per time step, and computes what the module does eagerly."""
    m, feeds = recurrent("LSTM", seq=12, direction="bidirectional", states=True)
    module = convert(m)
    args = [torch.from_numpy(feeds[n]) for n in module.input_names]
    with torch.no_grad():
        want = module(*args)
        got = torch.compile(module, fullgraph=True, backend="aot_eager")(*args)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-6, atol=1e-6)


def test_an_engines_load_defines_the_recurrent_op_before_its_code_runs(monkeypatch):
    """A bundle's engine whose code calls ``torch.ops.parastream.rnn`` loads in a process that never converted a
    model: the artifact's load defines the op first (``recurrent_op``), for every artifact format and device."""
    from parastream.launcher.engines import inductor_kernels, recurrent_op
    from parastream.launcher.engines import torch as tb

    order = []
    monkeypatch.setattr(recurrent_op, "register_rnn_op", lambda: order.append("op defined"))
    monkeypatch.setattr(inductor_kernels, "KernelsArtifact", lambda *a: order.append("code loaded") or "artifact")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert tb._load_artifact(b"wrapper and cubins", {"compiled": "kernels"}, "cpu") == "artifact"
    assert order == ["op defined", "code loaded"]
    monkeypatch.undo()  # the real one, twice: defined once per process
    recurrent_op.register_rnn_op()
    recurrent_op.register_rnn_op()
    assert hasattr(torch.ops.parastream, "rnn") and len(recurrent_op._RNN_OP) == 1


@pytest.mark.parametrize("op", ["LSTM", "GRU"])
def test_recurrent_weights_that_arrive_at_run_time_are_put_in_torchs_order_at_each_call(op):
    """W and R as graph inputs (no constant to store reordered): the layer reorders them at each call, and
    computes what ONNX Runtime does."""
    kw = {"linear_before_reset": 1} if op == "GRU" else {}
    m, feeds = recurrent(op, direction="bidirectional", states=True, **kw)
    for name in ("W", "R"):
        t = next(t for t in m.graph.initializer if t.name == name)
        feeds[name] = numpy_helper.to_array(t)
        m.graph.input.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, list(t.dims)))
        m.graph.initializer.remove(t)
    assert convert(m).recurrent_weights == 0
    check(m, feeds, rtol=1e-5, atol=1e-5)
