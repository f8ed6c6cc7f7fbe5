"""fuse_attention: the fused node computes what ONNX Runtime computes on the unfused graph.

ONNX Runtime cannot run parastream's own node, so the fused graph runs in the torch backend's converter on the
CPU (as SDPA and, with ``fuse_attention`` off, as its decomposition) against ONNX Runtime on the original; an
opset-23 graph gets ONNX's ``Attention``, which ONNX Runtime runs too.  The graphs: hand-built ones for each form
the rule knows, and transformers' BERT, GPT-2 and ViT (eager attention, random weights) as the TorchScript and the
dynamo exporter write them, T5's encoder (no scale; position bias and mask added one after the other) and
Swin's window attention (as the build loads it).
"""

from __future__ import annotations

import io
import math
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from parastream.core import fused_ops
from parastream.rewrite.ir import infer
from parastream.rewrite.rules import ALL_RULES, rules_for
from parastream.rewrite.rules.fuse_attention import FuseAttention

from rule_testing import apply_everywhere, assert_equivalent, model, ops, reasons, run, vi

torch = pytest.importorskip("torch")
from parastream.launcher.engines.onnx_torch import convert  # noqa: E402 - needs torch

RULE = FuseAttention()
B, H, S, D = 2, 2, 5, 4
FUSED = ("ScaledDotProductAttention", "Attention")


def feeds_for(m: onnx.ModelProto, seed: int) -> dict:
    """Random inputs: floats normal, int64 token ids and 0/1 masks, bool masks keeping the first key."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for i in m.graph.input:
        shape = [d.dim_value for d in i.type.tensor_type.shape.dim]
        kind = i.type.tensor_type.elem_type
        if kind == TensorProto.BOOL:
            keep = rng.random(shape) > 0.4
            keep[..., 0] = True
            feeds[i.name] = keep
        elif kind == TensorProto.INT64:
            value = rng.integers(0, 50, shape)
            if "mask" in i.name:
                value = np.ones(shape, dtype=np.int64)
                value[0, -2:] = 0  # padding in the first sequence
            feeds[i.name] = value.astype(np.int64)
        else:
            feeds[i.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


def assert_torch_matches_ort(original: onnx.ModelProto, fused: onnx.ModelProto, trials: int = 2, rtol: float = 1e-5):
    """The fused graph in the torch converter (SDPA, and its decomposition) = ONNX Runtime on the original."""
    for fuse in (True, False):
        module = convert(fused, "float32", fuse_attention=fuse)
        for trial in range(trials):
            feeds = feeds_for(original, 100 + trial)
            ref = run(original, feeds)
            with torch.no_grad():
                got = module(*[torch.from_numpy(feeds[n]) for n in module.input_names])
            for (name, want), have in zip(ref.items(), got):
                have = have.numpy()
                assert have.shape == want.shape, name
                err = float(np.max(np.abs(have - want))) / max(float(np.max(np.abs(want))), 1e-6)
                assert err <= rtol, f"{name} (fuse_attention={fuse}): relative error {err:.3g} > {rtol}"


def fused_nodes(m: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in m.graph.node if n.op_type in FUSED]


# -- hand-built graphs ------------------------------------------------------------------------------------------

def attention(scale: str | None = "div", mask: str | None = None, *, k_transposed: bool = False, opset: int = 17,
              softmax_axis: int = -1, fill: float = float("-inf"), scores_out: bool = False,
              q_shape=(B, H, S, D), guard: str | None = None, kv_lead=(B, H)) -> onnx.ModelProto:
    """Q, K, V inputs [B, H, S, D] -> softmax(scale·Q·Kᵀ + mask)·V in the form ``scale`` and ``mask`` name
    (``kv_lead``: K's and V's leading dimensions, (B, 1) for one K/V head that every query head reads)."""
    nodes, inits = [], []
    inputs = [vi("q", list(q_shape)), vi("k", [*kv_lead, D, S] if k_transposed else [*kv_lead, S, D]),
              vi("v", [*kv_lead, S, D])]
    q, kt = "q", "k"
    if not k_transposed:
        nodes.append(helper.make_node("Transpose", ["k"], ["kt"], name="k_t", perm=[0, 1, 3, 2]))
        kt = "kt"
    if scale == "sqrt":  # torch's decomposition: Q and Kᵀ each scaled by √s
        inits.append(numpy_helper.from_array(np.asarray(D ** -0.25, dtype=np.float32), "root"))
        nodes += [helper.make_node("Mul", ["q", "root"], ["qs"], name="q_scale"),
                  helper.make_node("Mul", [kt, "root"], ["kts"], name="k_scale")]
        q, kt = "qs", "kts"
    nodes.append(helper.make_node("MatMul", [q, kt], ["scores"], name="qk"))
    x = "scores"
    if scale in ("div", "mul", "variable"):
        name = {"div": "Div", "mul": "Mul", "variable": "Mul"}[scale]
        if scale == "variable":
            inputs.append(vi("s", []))
        else:
            value = math.sqrt(D) if scale == "div" else 1 / math.sqrt(D)
            inits.append(numpy_helper.from_array(np.asarray(value, dtype=np.float32), "s"))
        nodes.append(helper.make_node(name, [x, "s"], ["scaled"], name="scale"))
        x = "scaled"
    if mask == "add":  # BERT's extended mask [B, 1, 1, S]
        inputs.append(vi("m", [B, 1, 1, S]))
        nodes.append(helper.make_node("Add", [x, "m"], ["masked"], name="mask"))
        x = "masked"
    elif mask == "bias":  # T5's position bias [1, H, S, S], added before the softmax, no scale
        inputs.append(vi("bias", [1, H, S, S]))
        nodes.append(helper.make_node("Add", ["bias", x], ["masked"], name="mask"))
        x = "masked"
    elif mask in ("where", "bias_where"):  # a boolean mask (True: the key takes part), after a position bias
        if mask == "bias_where":
            inputs.append(vi("bias", [1, H, S, S]))
            nodes.append(helper.make_node("Add", [x, "bias"], ["biased"], name="bias"))
            x = "biased"
        inputs.append(vi("keep", [B, 1, 1, S], TensorProto.BOOL))
        inits.append(numpy_helper.from_array(np.asarray(fill, dtype=np.float32), "fill"))
        nodes.append(helper.make_node("Where", ["keep", x, "fill"], ["masked"], name="mask"))
        x = "masked"
    elif mask in ("causal_where", "causal_add"):
        tril = np.tril(np.ones((S, S), dtype=bool))[None, None]
        if mask == "causal_where":  # GPT-2's older form: Where(bias, scores, finfo.min)
            inits += [numpy_helper.from_array(tril, "tril"),
                      numpy_helper.from_array(np.asarray(np.finfo(np.float32).min, dtype=np.float32), "fill")]
            nodes.append(helper.make_node("Where", ["tril", x, "fill"], ["masked"], name="mask"))
        else:
            inits.append(numpy_helper.from_array(np.where(tril, 0, -np.inf).astype(np.float32), "causal"))
            nodes.append(helper.make_node("Add", [x, "causal"], ["masked"], name="mask"))
        x = "masked"
    nodes.append(helper.make_node("Softmax", [x], ["p"], name="softmax", axis=softmax_axis))
    p = "p"
    if guard:  # torch's exporters after SDPA's softmax with a boolean mask: Where(IsNaN(P), 0, P)
        inits.append(numpy_helper.from_array(np.asarray(0.5 if guard == "half" else 0.0, dtype=np.float32), "zero"))
        nodes += [helper.make_node("IsNaN", ["p"], ["p_nan"], name="p_isnan"),
                  helper.make_node("Where", ["p_nan", "zero", "p"], ["p_safe"], name="p_guard")]
        p = "p_safe"
    nodes.append(helper.make_node("MatMul", [p, "v"], ["y"], name="pv"))
    outputs = [vi("y", None)] + ([vi("scores", None)] if scores_out else []) + \
        ([vi("p_nan", None, TensorProto.BOOL)] if guard == "exposed" else [])
    return model(nodes, inputs, outputs, inits, opset=opset)


@pytest.mark.parametrize("scale, mask", [("div", None), ("mul", None), ("sqrt", None), (None, "bias"),
                                         ("div", "add"), ("mul", "where"), (None, "bias_where")])
def test_fuses_and_matches_onnxruntime(scale, mask):
    m = attention(scale, mask)
    out, fired = apply_everywhere(RULE, m)
    assert len(fired) == 1
    (node,) = fused_nodes(out)
    assert (node.domain, node.op_type) == (fused_ops.DOMAIN, fused_ops.SDPA)
    assert "Softmax" not in ops(out) and "MatMul" not in ops(out)
    assert ("Transpose" in ops(out)) is False  # Kᵀ's Transpose is absorbed
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    want = 1.0 if scale is None else 1 / math.sqrt(D)
    assert attrs["scale"] == pytest.approx(want, rel=1e-6) and attrs["is_causal"] == 0
    assert len(node.input) == (4 if mask else 3)
    assert any(o.domain == fused_ops.DOMAIN for o in out.opset_import)
    assert_torch_matches_ort(m, out)


@pytest.mark.parametrize("mask", ["causal_where", "causal_add"])
def test_a_constant_causal_mask_becomes_is_causal(mask):
    m = attention("div", mask)
    out, fired = apply_everywhere(RULE, m)
    (node,) = fused_nodes(out)
    assert {a.name: helper.get_attribute_value(a) for a in node.attribute}["is_causal"] == 1
    assert len(node.input) == 3  # no mask input: SDPA's causal kernels
    assert_torch_matches_ort(m, out)


def test_k_transposed_already_gets_a_transpose_back():
    m = attention("div", None, k_transposed=True)
    out, fired = apply_everywhere(RULE, m)
    assert fired and ops(out).count("Transpose") == 1
    assert_torch_matches_ort(m, out)


def test_opset_23_gets_onnx_attention_which_onnxruntime_runs():
    m = attention("div", "causal_where", opset=23)
    out, fired = apply_everywhere(RULE, m)
    (node,) = fused_nodes(out)
    assert (node.domain, node.op_type) == ("", "Attention")
    assert not any(o.domain == fused_ops.DOMAIN for o in out.opset_import)
    assert_equivalent(m, out)  # ONNX Runtime on both
    assert_torch_matches_ort(m, out)
    # a mask broadcast over the queries ([B, 1, 1, S]): ONNX Runtime's Attention would refuse it
    m = attention("div", "add", opset=23)
    out, _ = apply_everywhere(RULE, m)
    assert [(n.domain, n.op_type) for n in fused_nodes(out)] == [(fused_ops.DOMAIN, fused_ops.SDPA)]
    assert_torch_matches_ort(m, out)


@pytest.mark.parametrize("mask, guard", [(None, None), ("where", "zero"), ("causal_where", None)])
def test_one_kv_head_read_by_every_query_head_is_fused(mask, guard):
    """Multi-query attention as MatMul broadcasts it (Falcon, GPT-BigCode): K and V [B, 1, S, D] against Q
    [B, H, S, D]; the converter runs it as SDPA with grouped-query attention, and its decomposition repeats them."""
    m = attention("div", mask, guard=guard, kv_lead=(B, 1))
    out, fired = apply_everywhere(RULE, m)
    assert len(fired) == 1 and "MatMul" not in ops(out)
    assert_torch_matches_ort(m, out)
    # at opset 23: ONNX's Attention, whose 4-d form takes fewer K/V heads than Q's, as ONNX Runtime runs it
    if guard is None:
        m = attention("div", mask, kv_lead=(B, 1), opset=23)
        out, fired = apply_everywhere(RULE, m)
        assert [n.op_type for n in fused_nodes(out)] == ["Attention"]
        assert_equivalent(m, out)  # ONNX Runtime on both
        assert_torch_matches_ort(m, out)


@pytest.mark.gpu
@pytest.mark.parametrize("mask, guard", [(None, None), ("where", "zero")])
def test_one_kv_head_on_the_gpu_matches_onnxruntime(mask, guard):
    """The multi-query node on the device in fp16: SDPA's kernels with grouped-query attention, and the
    decomposition, against ONNX Runtime on the original."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    m = attention("div", mask, guard=guard, kv_lead=(B, 1))
    out, _ = apply_everywhere(RULE, m)
    feeds = feeds_for(m, 7)
    (want,) = run(m, feeds).values()
    for fuse in (True, False):
        module = convert(out, "float16", fuse_attention=fuse).cuda()
        args = [torch.from_numpy(feeds[n]).cuda() for n in module.input_names]
        with torch.no_grad():
            (got,) = module(*[a.half() if a.is_floating_point() else a for a in args])
        err = float(np.max(np.abs(got.float().cpu().numpy() - want))) / float(np.max(np.abs(want)))
        assert err < 1e-2, f"fuse_attention={fuse}: {err:.3g}"


def test_the_nan_guard_after_the_softmax_is_fused_and_hidden_rows_give_zero():
    """transformers' default attention (sdpa) as torch's exporters write it: the boolean mask as an additive
    Where(keep, 0, -inf), and Where(IsNaN(P), 0, P) after the softmax, so that a query whose every key is hidden
    gets 0, not NaN.  The fused node carries ``zero_hidden_rows``; in the converter (SDPA and its decomposition)
    and in its plain ONNX form the hidden rows are 0 as in ONNX Runtime on the original, even at opset 23
    (ONNX's Attention has no such attribute, so parastream's node is kept)."""
    for opset in (17, 23):
        m = attention("div", "where", guard="zero", opset=opset)
        out, fired = apply_everywhere(RULE, m)
        (node,) = fused_nodes(out)
        assert (node.domain, node.op_type) == (fused_ops.DOMAIN, fused_ops.SDPA)
        assert {a.name: helper.get_attribute_value(a) for a in node.attribute}["zero_hidden_rows"] == 1
        assert not {"IsNaN", "Where", "Softmax"} & set(ops(out)) - {"Where"} and ops(out).count("Where") == 1
        feeds = feeds_for(m, 3)
        feeds["keep"][0] = False  # the first sequence's keys all hidden: its rows are NaN after the softmax
        ref = run(m, feeds)["y"]
        assert np.all(ref[0] == 0) and np.isfinite(ref).all()
        np.testing.assert_allclose(run(fused_ops.plain_onnx(out), feeds)["y"], ref, rtol=1e-5, atol=1e-6)
        for fuse in (True, False):
            module = convert(out, "float32", fuse_attention=fuse)
            with torch.no_grad():
                got = module(*[torch.from_numpy(feeds[n]) for n in module.input_names])[0].numpy()
            np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6, err_msg=f"fuse_attention={fuse}")
        assert_torch_matches_ort(m, out)


def test_the_hidden_rows_are_zero_whatever_the_kernel_gives_there(monkeypatch):
    """The fused form decides the hidden rows on the mask: a kernel that leaves NaN in a row of -inf scores (as
    some of SDPA's CUDA kernels may) still gives 0 there."""
    m = attention("div", "where", guard="zero")
    out, _ = apply_everywhere(RULE, m)
    feeds = feeds_for(m, 4)
    feeds["keep"][1] = False
    real = torch.nn.functional.scaled_dot_product_attention

    def nan_rows(q, k, v, attn_mask=None, **kw):
        y = real(q, k, v, attn_mask=attn_mask, **kw)
        hidden = (attn_mask == float("-inf")).all(dim=-1, keepdim=True)
        return y.masked_fill(hidden, float("nan"))

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", nan_rows)
    module = convert(out, "float32", fuse_attention=True)
    with torch.no_grad():
        got = module(*[torch.from_numpy(feeds[n]) for n in module.input_names])[0].numpy()
    np.testing.assert_allclose(got, run(m, feeds)["y"], rtol=1e-5, atol=1e-6)
    assert np.all(got[1] == 0)


def regrouped_attention(mask_at: str = "after", back: list[int] | None = None, keep_shape=None) -> onnx.ModelProto:
    """DeBERTa's form: Q [B·H, S, D] · Kᵀ [B·H, D, S] scaled, Reshape to [B, H, S, S], a boolean mask there
    (``mask_at="after"``) or on the [B·H, S, S] scores before the Reshape (``"before"``, of ``keep_shape``:
    [B·H, 1, S] unless told), Softmax, Reshape to ``back`` ([B·H, S, S] unless told), MatMul with V [B·H, S, D]."""
    back = back or [B * H, S, S]
    inits = [numpy_helper.from_array(np.asarray(math.sqrt(D), dtype=np.float32), "s"),
             numpy_helper.from_array(np.asarray([B, H, S, S], dtype=np.int64), "four"),
             numpy_helper.from_array(np.asarray(back, dtype=np.int64), "three"),
             numpy_helper.from_array(np.asarray(np.finfo(np.float32).min, dtype=np.float32), "fill")]
    before = mask_at == "before"
    keep_shape = keep_shape or ([B * H, 1, S] if before else [B, 1, 1, S])
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], name="k_t", perm=[0, 2, 1]),
             helper.make_node("MatMul", ["q", "kt"], ["scores"], name="qk"),
             helper.make_node("Div", ["scores", "s"], ["scaled"], name="scale")]
    x = "scaled"
    if before:
        nodes.append(helper.make_node("Where", ["keep", x, "fill"], ["masked3"], name="mask3"))
        x = "masked3"
    nodes.append(helper.make_node("Reshape", [x, "four"], ["scores4"], name="to_heads"))
    x = "scores4"
    if not before:
        nodes.append(helper.make_node("Where", ["keep", x, "fill"], ["masked"], name="mask"))
        x = "masked"
    nodes += [helper.make_node("Softmax", [x], ["p"], name="softmax", axis=-1),
              helper.make_node("Reshape", ["p", "three"], ["p3"], name="to_rows"),
              helper.make_node("MatMul", ["p3", "v"], ["y"], name="pv")]
    inputs = [vi("q", [B * H, S, D]), vi("k", [B * H, S, D]), vi("v", [back[0] if len(back) == 3 else B * H, S, D]),
              vi("keep", keep_shape, TensorProto.BOOL)]
    return model(nodes, inputs, [vi("y", None)], inits)


def test_scores_regrouped_between_the_matmuls_are_fused_in_the_softmax_layout():
    """The node runs in the softmax's [B, H, S, S] layout: Q, K and V regrouped to [B, H, S, D] and the output
    back to [B·H, S, D] (each a Reshape), equal to ONNX Runtime on the original."""
    m = regrouped_attention()
    out, fired = apply_everywhere(RULE, m)
    assert len(fired) == 1, reasons(RULE, m)
    (node,) = fused_nodes(out)
    assert "Softmax" not in ops(out) and "MatMul" not in ops(out)
    assert ops(out).count("Reshape") == 4  # Q, K, V to the heads' layout, the output back
    assert_torch_matches_ort(m, out)
    np.testing.assert_allclose(run(fused_ops.plain_onnx(out), feeds_for(m, 9))["y"], run(m, feeds_for(m, 9))["y"],
                               rtol=1e-5, atol=1e-6)


def test_a_constant_mask_applied_in_another_layout_is_regrouped_to_the_softmax_layout():
    """Swin's shifted windows (timm): scores [B·W, H, S, S] regrouped to [B, W, H, S, S], a constant mask [1, W,
    1, S, S] added there (it differs per window), regrouped back for the softmax.  The node runs in the softmax's
    layout with the mask regrouped to it at build time, [B·W, 1, S, S]: not broadcast over the heads, along which
    it does not vary."""
    w = 3
    rng = np.random.default_rng(1)
    hide = rng.random((1, w, 1, S, S)) < 0.3
    hide[..., 0] = False  # every query keeps a key
    inits = [numpy_helper.from_array(np.asarray([B, w, H, S, S], dtype=np.int64), "five"),
             numpy_helper.from_array(np.asarray([B * w, H, S, S], dtype=np.int64), "four"),
             numpy_helper.from_array(np.where(hide, -100.0, 0.0).astype(np.float32), "shift_mask"),
             numpy_helper.from_array(np.asarray(D ** -0.5, dtype=np.float32), "s")]
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], name="k_t", perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["q", "kt"], ["scores"], name="qk"),
             helper.make_node("Mul", ["scores", "s"], ["scaled"], name="scale"),
             helper.make_node("Reshape", ["scaled", "five"], ["s5"], name="to_windows"),
             helper.make_node("Add", ["s5", "shift_mask"], ["m5"], name="shift"),
             helper.make_node("Reshape", ["m5", "four"], ["m4"], name="back"),
             helper.make_node("Softmax", ["m4"], ["p"], name="softmax", axis=-1),
             helper.make_node("MatMul", ["p", "v"], ["y"], name="pv")]
    m = model(nodes, [vi(n, [B * w, H, S, D]) for n in "qkv"], [vi("y", None)], inits)
    out, fired = apply_everywhere(RULE, m)
    assert len(fired) == 1, reasons(RULE, m)
    (node,) = fused_nodes(out)
    masks = [i for i in out.graph.initializer if i.name == node.input[3]]
    assert [list(i.dims) for i in masks] == [[B * w, 1, S, S]]
    assert "Reshape" not in ops(out)  # Q, K, V and the output already in the softmax's layout
    assert_torch_matches_ort(m, out)


@pytest.mark.parametrize("keep_shape, rows", [([B * H, 1, S], [B, H, 1, S]), ([1, 1, S], [1, 1, 1, S])])
def test_a_mask_input_applied_before_the_scores_are_regrouped_is_regrouped_by_a_reshape(keep_shape, rows):
    """BLOOM's ALiBi bias: a mask computed in the model (not a constant), one row per row of the [B·H, S, S] scores
    (or one row for all of them), applied before they are regrouped to [B, H, S, S] for the softmax: a Reshape
    regroups it to the node's layout."""
    m = regrouped_attention(mask_at="before", keep_shape=keep_shape)
    out, fired = apply_everywhere(RULE, m)
    assert len(fired) == 1, reasons(RULE, m)
    (node,) = fused_nodes(out)
    (reshape,) = [n for n in out.graph.node if n.op_type == "Reshape" and "mask" in n.name]
    assert numpy_helper.to_array(next(i for i in out.graph.initializer if i.name == reshape.input[1])).tolist() == rows
    assert_torch_matches_ort(m, out)
    np.testing.assert_allclose(run(fused_ops.plain_onnx(out), feeds_for(m, 9))["y"], run(m, feeds_for(m, 9))["y"],
                               rtol=1e-5, atol=1e-6)


# -- must not fire ------------------------------------------------------------------------------------------------

def test_does_not_fire_where_the_regrouping_is_not_one():
    """A mask that is an input, applied before the scores are regrouped, along some of their rows but not all
    (Swin's windows, not its heads) would need more than a Reshape; a Reshape that changes the last two dimensions
    moves (query, key) pairs: neither is fused."""
    w = 3
    inits = [numpy_helper.from_array(np.asarray([B, w, H, S, S], dtype=np.int64), "five"),
             numpy_helper.from_array(np.asarray([B * w, H, S, S], dtype=np.int64), "four")]
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], name="k_t", perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["q", "kt"], ["scores"], name="qk"),
             helper.make_node("Reshape", ["scores", "five"], ["s5"], name="to_windows"),
             helper.make_node("Add", ["s5", "shift_mask"], ["m5"], name="shift"),
             helper.make_node("Reshape", ["m5", "four"], ["m4"], name="back"),
             helper.make_node("Softmax", ["m4"], ["p"], name="softmax", axis=-1),
             helper.make_node("MatMul", ["p", "v"], ["y"], name="pv")]
    m = model(nodes, [*(vi(n, [B * w, H, S, D]) for n in "qkv"), vi("shift_mask", [1, w, 1, S, S])],
              [vi("y", None)], inits)
    _, fired = apply_everywhere(RULE, m)
    assert fired == [] and any("is not a constant and has neither their rows nor one row for all" in r
                               for r in reasons(RULE, m)), reasons(RULE, m)
    m = regrouped_attention(back=[B * H * S, 1, S])
    _, fired = apply_everywhere(RULE, m)
    assert fired == [] and any("not as the left operand of a MatMul" in r for r in reasons(RULE, m)), reasons(RULE, m)


@pytest.mark.parametrize("kwargs, why", [
    (dict(softmax_axis=2), "is not over the last axis"),
    (dict(scores_out=True), "is read by another node too or is a graph output"),
    (dict(scale="variable"), "is not a constant scalar"),
    (dict(mask="where", fill=-1e4), "does not hide a key exactly"),
    (dict(q_shape=(H, S, D)), "with the same batch dimensions"),  # Q broadcast over the batch
    (dict(kv_lead=(1, H)), "with the same batch dimensions"),  # K and V broadcast over the batch, not the heads
    # a guard that does not give 0 (0.5: not what a hidden row is), and one whose IsNaN is read elsewhere too
    (dict(mask="where", guard="half"), "is read by 2 nodes"),
    (dict(mask="where", guard="exposed"), "is read by 2 nodes"),
])
def test_does_not_fire(kwargs, why):
    m = attention(**{"scale": "div", "mask": None, **kwargs})
    _, fired = apply_everywhere(RULE, m)
    assert fired == []
    assert any(why in r for r in reasons(RULE, m)), reasons(RULE, m)


def test_does_not_fire_on_soft_capped_scores_and_names_the_op():
    """Gemma-2's logit soft-capping, tanh(scores / c) · c before the mask: SDPA does not compute it, and the reason
    names the node in the way."""
    inits = [numpy_helper.from_array(np.asarray(50.0, dtype=np.float32), "cap")]
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], name="k_t", perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["q", "kt"], ["s"], name="qk"),
             helper.make_node("Div", ["s", "cap"], ["s1"], name="uncap"),
             helper.make_node("Tanh", ["s1"], ["s2"], name="softcap"),
             helper.make_node("Mul", ["s2", "cap"], ["s3"], name="recap"),
             helper.make_node("Add", ["s3", "m"], ["s4"], name="mask"),
             helper.make_node("Softmax", ["s4"], ["p"], name="softmax", axis=-1),
             helper.make_node("MatMul", ["p", "v"], ["y"], name="pv")]
    m = model(nodes, [*(vi(n, [B, H, S, D]) for n in "qkv"), vi("m", [B, 1, 1, S])], [vi("y", None)], inits)
    _, fired = apply_everywhere(RULE, m)
    assert fired == []
    assert any("through softcap (Tanh), which is not a scale, a mask or a regrouping" in r for r in reasons(RULE, m)), \
        reasons(RULE, m)


def test_does_not_fire_on_a_broadcast_matmul():
    """Q·Kᵀ with a Kᵀ of lower rank ([D, S], broadcast over the heads) is not per-head attention."""
    nodes = [helper.make_node("MatMul", ["q", "kt"], ["s"], name="qk"),
             helper.make_node("Softmax", ["s"], ["p"], name="softmax", axis=-1),
             helper.make_node("MatMul", ["p", "v"], ["y"], name="pv")]
    m = model(nodes, [vi("q", [B, H, S, D]), vi("kt", [D, S]), vi("v", [B, H, S, D])], [vi("y", None)])
    _, fired = apply_everywhere(RULE, m)
    assert fired == []
    assert any("same batch dimensions" in r for r in reasons(RULE, m))


def test_only_the_torch_backend_gets_it():
    """ONNX Runtime and TensorRT fuse the plain form themselves, and cannot run parastream's node."""
    assert RULE.backends == frozenset({"torch"})
    assert "fuse_attention" in [r.name for r in rules_for("torch")]
    for backend in ("onnxruntime", "tensorrt", None):
        assert "fuse_attention" not in [r.name for r in rules_for(backend)]
    assert "fuse_attention" not in [r.name for r in ALL_RULES]  # optimize()'s default leaves plain ONNX


# -- transformers' models as both exporters write them -------------------------------------------------------------

def _transformers_model(kind: str):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    attn = "eager"  # plain ONNX ops for the export
    if kind in ("bert_sdpa", "llama"):  # transformers' default attention, as a user exports it
        attn = "sdpa"
    if kind == "llama":  # grouped-query attention, rotary embeddings, a causal and a padding mask
        cfg = transformers.LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                       use_cache=False)
        cls, names = transformers.LlamaModel, ("input_ids", "attention_mask")
        args = (torch.randint(0, 50, (2, 8)), torch.ones(2, 8, dtype=torch.int64))
    elif kind == "deberta":  # scores in [B·H, S, S], regrouped to [B, H, S, S] for the mask and back
        cfg = transformers.DebertaV2Config(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                           intermediate_size=64, max_position_embeddings=32)
        cls, names = transformers.DebertaV2Model, ("input_ids", "attention_mask")
        args = (torch.randint(0, 50, (2, 8)), torch.ones(2, 8, dtype=torch.int64))
    elif kind in ("bert", "bert_sdpa"):
        cfg = transformers.BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                      intermediate_size=64, max_position_embeddings=32)
        cls, names = transformers.BertModel, ("input_ids", "attention_mask")
        args = (torch.randint(0, 50, (2, 8)), torch.ones(2, 8, dtype=torch.int64))
    elif kind == "t5":
        cfg = transformers.T5Config(vocab_size=50, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
                                    use_cache=False)
        cls, names = transformers.T5EncoderModel, ("input_ids", "attention_mask")
        args = (torch.randint(0, 50, (2, 8)), torch.ones(2, 8, dtype=torch.int64))
    elif kind == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=50, n_embd=32, n_layer=1, n_head=4, n_positions=32)
        cls, names = transformers.GPT2Model, ("input_ids", "attention_mask")
        args = (torch.randint(0, 50, (2, 8)), torch.ones(2, 8, dtype=torch.int64))
    elif kind == "swin":
        cfg = transformers.SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[2], num_heads=[2], window_size=4)
        cls, names = transformers.SwinModel, ("pixel_values",)
        args = (torch.randn(1, 3, 32, 32),)
    else:
        cfg = transformers.ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
                                     image_size=32, patch_size=8)
        cls, names = transformers.ViTModel, ("pixel_values",)
        args = (torch.randn(2, 3, 32, 32),)
    net = cls._from_config(cfg, attn_implementation=attn).eval()

    class LastHidden(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = net

        def forward(self, *xs):
            return self.net(**dict(zip(names, xs)), use_cache=False).last_hidden_state if kind == "gpt2" else \
                self.net(**dict(zip(names, xs))).last_hidden_state

    return LastHidden().eval(), args, names


def export(kind: str, exporter: str, opset: int) -> onnx.ModelProto:
    net, args, names = _transformers_model(kind)
    f = io.BytesIO()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        if exporter == "dynamo":
            try:
                program = torch.onnx.export(net, args, dynamo=True, opset_version=opset, input_names=list(names))
            except Exception as e:  # noqa: BLE001 - the dynamo exporter needs onnxscript
                pytest.skip(f"the dynamo exporter does not run here: {type(e).__name__}: {e}")
            return infer(program.model_proto, strict=True)
        torch.onnx.export(net, args, f, dynamo=False, opset_version=opset, input_names=list(names))
    return infer(onnx.load_from_string(f.getvalue()), strict=True)


@pytest.mark.parametrize("kind, exporter, opset", [
    ("bert", "torchscript", 17), ("bert", "dynamo", 18),
    ("gpt2", "torchscript", 17), ("gpt2", "dynamo", 18),
    ("vit", "torchscript", 17), ("vit", "dynamo", 18),
    ("t5", "torchscript", 17), ("t5", "dynamo", 18),
    ("deberta", "torchscript", 17), ("deberta", "dynamo", 18),
])
def test_exported_transformers(kind, exporter, opset):
    m = export(kind, exporter, opset)
    assert ops(m).count("Softmax") == 1
    out, fired = apply_everywhere(RULE, m)
    assert len(fired) == 1, reasons(RULE, m)
    assert len(fused_nodes(out)) == 1 and "Softmax" not in ops(out)
    assert_torch_matches_ort(m, out, rtol=1e-4)


@pytest.mark.parametrize("kind, exporter, opset", [
    ("llama", "torchscript", 17), ("llama", "dynamo", 18), ("bert_sdpa", "torchscript", 17), ("bert_sdpa", "dynamo", 18),
])
def test_exported_default_attention_with_hidden_rows(kind, exporter, opset):
    """transformers' default attention (sdpa) as both exporters write it (its NaN guard after the softmax):
    fused, and equal to ONNX Runtime where the padding hides every key of some queries (left padding: with
    Llama's causal mask the first queries of the padded sequence see no key)."""
    m = export(kind, exporter, opset)
    assert "IsNaN" in ops(m)
    out, fired = apply_everywhere(RULE, m)
    assert len(fired) == 1 and "Softmax" not in ops(out), reasons(RULE, m)
    (node,) = fused_nodes(out)
    assert {a.name: helper.get_attribute_value(a) for a in node.attribute}["zero_hidden_rows"] == 1
    feeds = feeds_for(m, 5)
    feeds["attention_mask"][1, :3] = 0  # the second sequence padded on the left
    ref = run(m, feeds)
    for fuse in (True, False):
        module = convert(out, "float32", fuse_attention=fuse)
        with torch.no_grad():
            got = module(*[torch.from_numpy(feeds[n]) for n in module.input_names])
        for (name, want), have in zip(ref.items(), got):
            assert np.isfinite(want).all()
            np.testing.assert_allclose(have.numpy(), want, rtol=1e-4, atol=1e-4, err_msg=f"{name} fuse={fuse}")
    assert_torch_matches_ort(m, out, rtol=1e-4)


def test_exported_bert_at_opset_23_gets_onnx_attention():
    m = export("bert", "dynamo", 23)
    out, fired = apply_everywhere(RULE, m)
    assert [n.op_type for n in fused_nodes(out)] == ["Attention"]
    feeds = feeds_for(m, 7)  # ONNX Runtime on both (token ids and a padding mask: feeds_for)
    a, b = run(m, feeds), run(out, feeds)
    for name in a:
        np.testing.assert_allclose(b[name], a[name], rtol=1e-4, atol=1e-4)
    assert_torch_matches_ort(m, out, rtol=1e-4)


def test_the_search_for_the_torch_backend_fuses_bert():
    """optimize() with the torch backend's rules fuses BERT's attention (a simplifying rule: applied wherever the
    cost model agrees); the Transpose it puts back on TorchScript's Kᵀ cancels against the head transpose."""
    from parastream.rewrite import optimize

    m = export("bert", "torchscript", 17)
    out, report = optimize(m, rules=rules_for("torch"))
    assert any(key.startswith("fuse_attention:") for key in report["rules_chosen"])
    assert len(fused_nodes(out)) == 1
    assert_torch_matches_ort(m, out, rtol=1e-4)
    _, report = optimize(m)
    assert not any(key.startswith("fuse_attention:") for key in report["rules_chosen"])


def test_the_cost_model_counts_the_fused_attention_work():
    """The roofline prices the fused node by its two GEMMs and softmax (FLOPs), without the scores' bytes: the
    unfused chain costs more, the fused node is not free."""
    from parastream.rewrite.cost import RooflineCostModel, node_flops_bytes
    from parastream.rewrite.ir import import_graph

    m = attention("div", "add")
    out, _ = apply_everywhere(RULE, m)
    (node,) = [n for n in import_graph(out).nodes if n.op == fused_ops.SDPA]
    flops, _ = node_flops_bytes(node)
    assert flops == 2.0 * B * H * S * S * (D + D) + 5.0 * B * H * S * S
    cm = RooflineCostModel()
    assert 0 < cm.graph_cost(import_graph(out), 1)[1] < cm.graph_cost(import_graph(m), 1)[1]


@pytest.mark.parametrize("exporter, opset", [("torchscript", 17), ("dynamo", 18)])
def test_swin_windows_after_the_build_loads_them(exporter, opset, tmp_path):
    """Swin's window attention (relative position bias; the shifted windows' mask) has shapes that only the
    build's load makes static (shapes fixed, constants folded); then both blocks fuse."""
    from parastream.pipeline.model_io import load_model

    path = tmp_path / "swin.onnx"
    onnx.save(export("swin", exporter, opset), path)
    m = load_model(path).model
    out, fired = apply_everywhere(RULE, m)
    assert len(fired) == 2 and len(fused_nodes(out)) == 2, reasons(RULE, m)
    assert_torch_matches_ort(m, out, rtol=1e-4)
