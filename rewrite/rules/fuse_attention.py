"""Fuse scaled-dot-product attention, as exporters write it, into one attention node.

    Y = softmax(s · Q·Kᵀ + M) · V

with ``s`` the product of every constant scalar scale on the way (a Div by c is a factor 1/c; a Mul of Q and a
Mul of Kᵀ by √s each, as torch's own decomposition exports it, give their product, since
(a·Q)·(b·Kᵀ) = a·b·(Q·Kᵀ)), and ``M`` the sum of the masks (T5 adds its position bias, then its mask):

* ``Add(scores, M)``: an additive mask, broadcast to the scores (BERT's extended mask, GPT-2's causal mask, T5's
  position bias);
* ``Where(C, scores, f)`` (or ``Where(C, f, scores)``): a boolean mask with a fill ``f`` so large and negative that
  ``x + f == f`` for every score x (-inf, or at most -1e30: ``torch.finfo(float32).min`` as transformers fills).
  Then Where(C, x, f) = x + Where(C, 0, f) exactly, so the node gets the additive mask Where(C, 0, f);
* a constant mask that hides exactly the keys after each query (Sq = Sk), the only mask, is the causal mask:
  ``is_causal = 1`` and no mask input.

The chain it replaces: MatMul(Q, Kᵀ) -> Mul/Div by constant scalars -> the masks -> Softmax on the last
axis -> MatMul(·, V), Casts to the type they read and Identities anywhere between, and after the Softmax at most
one ``Where(IsNaN(P), 0, P)``: torch's exporters write it after the softmax of
``scaled_dot_product_attention`` with a boolean mask (transformers' default attention, ``sdpa``), so that a query
whose every key is hidden (a row of -inf scores, NaN after the softmax) gets 0; the node then carries
``zero_hidden_rows = 1``; and Reshapes that only regroup the scores' leading dimensions (up to three before the
Softmax, one after it: DeBERTa's [B·H, S, S] scores masked as [B, H, S, S] and back, Swin's windows split out
for the shifted-window mask and merged back), where the node runs in the softmax's layout, its operands and
output regrouped by Reshapes; a mask applied in another layout is regrouped too: a constant at build time, another
(BLOOM's ALiBi bias, one row per head) by a Reshape where it has the scores' rows or one row for all of them.
The Transpose that makes Kᵀ from K (last two axes swapped) and the scale Muls of Q and Kᵀ are absorbed when
nothing else reads them, and a Kᵀ that arrives transposed already gets a Transpose back.  The head reshapes and
transposes around it stay.  Every tensor inside the chain must be read by the next node only and be no graph output; Q·Kᵀ must be
[..., Sq, D] x [..., D, Sk] and V [..., Sk, Dv] with the same leading dimensions, or K and V with one head that
every query head reads (multi-query attention: 1 on the heads' axis, -3, where Q has H; no other broadcasting).

The node: ONNX's ``Attention`` where the model's opset is at least 23, Q is 4-d (its layout), a mask is
[..., Sq, Sk] (ONNX Runtime broadcasts neither of the two) and no NaN guard was found (ONNX's has no
``zero_hidden_rows``), else
``parastream::ScaledDotProductAttention`` (``core/fused_ops.py``).  Only the torch backend runs either as one
kernel (``torch.nn.functional.scaled_dot_product_attention``): ONNX Runtime and TensorRT fuse the plain form
themselves, so the rule is for the torch backend alone (``backends``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx_graphsurgeon as gs
from onnx import helper

from parastream.core import fused_ops

from .base import Namer, Rule, Site, anchored_sites, const_value, detach, is_graph_output, site_nodes, static_shape

HIDING_FILL = -1e30  # a Where fill at or below this hides a key exactly: x + fill == fill for any score x
_PASS = ("Cast", "Identity")
_FLOAT_TYPES = (np.float16, np.float32, np.float64)


@dataclass
class Mask:
    """One masking node's mask: Add's other operand, or Where's condition with its fill and which value keeps."""

    tensor: gs.Tensor
    where_fill: float | None = None
    keep_if_true: bool = True
    scores_shape: tuple | None = None  # the masked scores' shape where it is applied (before a regrouping, its own)


@dataclass
class Attention:
    """What one matched chain computes: the node's inputs and attributes and the nodes it replaces."""

    q: gs.Tensor
    k: gs.Tensor  # [..., Sk, D]; when ``k_transposed``: Kᵀ [..., D, Sk] as the graph has it
    v: gs.Tensor
    out: gs.Tensor
    scale: float = 1.0
    k_transposed: bool = False
    masks: list[Mask] = field(default_factory=list)
    nodes: list[gs.Node] = field(default_factory=list)  # every node replaced, the first MatMul first
    zero_hidden_rows: bool = False  # a Where(IsNaN(P), 0, P) after the Softmax: a row of hidden keys gives 0
    lead: list[int] | None = None  # with a regrouping Reshape in the chain: the softmax's leading dimensions,
    # in which the node runs (Q, K, V and the output reshaped to them and back)
    scores_shape: tuple | None = None  # the scores' shape as the softmax reads them


def _passes(node: gs.Node) -> bool:
    """An Identity, or a Cast to the type it reads."""
    if node.op == "Identity":
        return True
    if node.op != "Cast" or not node.inputs or node.inputs[0].dtype is None:
        return False
    try:
        return np.dtype(helper.tensor_dtype_to_np_dtype(int(node.attrs.get("to", 0)))) == np.dtype(node.inputs[0].dtype)
    except (TypeError, KeyError, ValueError):
        return False


def _scalar(t: gs.Tensor) -> float | None:
    v = const_value(t)
    return float(v.reshape(-1)[0]) if v is not None and v.size == 1 else None


def _shared_kv_head(qs, ks, vs) -> bool:
    """K and V of one head that every query head reads, as MatMul broadcasts it (multi-query attention: Falcon,
    GPT-BigCode): their leading dimensions Q's but for the heads' axis (-3), 1 in K and V and more in Q."""
    return (len(qs) >= 3 and list(ks[:-2]) == list(vs[:-2]) and ks[-3] == 1 and qs[-3] > 1
            and list(ks[:-3]) == list(qs[:-3]))


def _producer(t: gs.Tensor) -> gs.Node | None:
    return t.inputs[0] if len(t.inputs) == 1 else None


def _scale_of(node: gs.Node, chain: gs.Tensor | None = None) -> tuple[gs.Tensor, float] | str:
    """(the tensor scaled, the factor) of a Mul or Div by a constant scalar; else the reason."""
    a, b = node.inputs[0], node.inputs[1]
    if node.op == "Div":
        if chain is not None and b is chain:
            return f"{node.name} divides by the scores"
        c = _scalar(b)
        if c is None:
            return f"the scale {b.name} of {node.name} is not a constant scalar"
        return (a, 1.0 / c) if c != 0 else f"{node.name} divides by zero"
    if chain is not None:
        other = b if a is chain else a
        c = _scalar(other)
        return (chain, c) if c is not None else f"the scale {other.name} of {node.name} is not a constant scalar"
    for x, y in ((a, b), (b, a)):
        c = _scalar(y)
        if c is not None and const_value(x) is None:
            return x, c
    return f"{node.name} is not a product with a constant scalar"


def _private(graph: gs.Graph, node: gs.Node, reader: gs.Node) -> bool:
    out = node.outputs[0] if len(node.outputs) == 1 else None
    return out is not None and not is_graph_output(graph, out) and len(out.outputs) == 1 and out.outputs[0] is reader


def _scores_operand(node: gs.Node) -> int | None:
    """Which operand of an Add or Where carries the scores (the other is the mask or the fill)."""
    if node.op == "Where":
        fills = [i for i in (1, 2) if _scalar(node.inputs[i]) is not None]
        return (3 - fills[0]) if len(fills) == 1 else None
    shape = static_shape(node.outputs[0])
    found = [i for i in (0, 1) if static_shape(node.inputs[i]) == shape and _reaches_matmul(node.inputs[i])]
    return found[0] if len(found) == 1 else None


def _first_stop(node: gs.Node) -> gs.Node | None:
    """The node that keeps an Add's operand of the scores' shape from reaching a MatMul (``_reaches_matmul``): the
    first one, walking back along the scores' shape, one of whose inputs reaches a MatMul; None where none does."""
    shape = static_shape(node.outputs[0])
    for t in node.inputs:
        for _ in range(9):
            p = _producer(t) if static_shape(t) == shape else None
            if p is None:
                break
            if any(_reaches_matmul(x) for x in p.inputs):
                return p
            t = next((x for x in p.inputs if static_shape(x) == shape), None)
            if t is None:
                break
    return None


def _reaches_matmul(t: gs.Tensor, depth: int = 0) -> bool:
    """Whether ``t`` is a MatMul's output, through Casts, Identities, Mul/Div by constant scalars and masks."""
    p = _producer(t)
    if p is None or depth > 8:
        return False
    if p.op == "MatMul":
        return True
    if _passes(p):
        return _reaches_matmul(p.inputs[0], depth + 1)
    if p.op in ("Mul", "Div"):
        got = _scale_of(p)
        return not isinstance(got, str) and _reaches_matmul(got[0], depth + 1)
    if p.op == "Where":  # the operand that is not the constant fill
        i = _scores_operand(p)
        return i is not None and _reaches_matmul(p.inputs[i], depth + 1)
    if p.op == "Add":
        return any(_reaches_matmul(x, depth + 1) for x in p.inputs)
    if _regroups(p):
        return _reaches_matmul(p.inputs[0], depth + 1)
    return False


def _regroups(node: gs.Node) -> bool:
    """A Reshape that only regroups the leading dimensions of [..., Sq, Sk] (DeBERTa's [B·H, S, S] <-> [B, H,
    S, S]): the last two dimensions and the number of rows unchanged, so each (row, query, key) keeps its place."""
    if node.op != "Reshape":
        return False
    a, b = static_shape(node.inputs[0]), static_shape(node.outputs[0])
    return a is not None and b is not None and len(a) >= 3 and len(b) >= 3 and a[-2:] == b[-2:] \
        and int(np.prod(a[:-2])) == int(np.prod(b[:-2]))


def _nan_guard(graph: gs.Graph, p: gs.Tensor) -> list[gs.Node] | None:
    """[IsNaN, Where] when ``p`` is read by exactly ``Where(IsNaN(p), 0, p)`` (the IsNaN read by that Where only,
    no graph output among them), else None."""
    if is_graph_output(graph, p) or len(p.outputs) != 2:
        return None
    isnan = next((n for n in p.outputs if n.op == "IsNaN"), None)
    where = next((n for n in p.outputs if n.op == "Where"), None)
    if isnan is None or where is None or not _private(graph, isnan, where) or len(where.inputs) != 3:
        return None
    cond, fill, keep = where.inputs
    if cond is not isnan.outputs[0] or keep is not p or _scalar(fill) != 0.0 or len(where.outputs) != 1:
        return None
    return [isnan, where]


def find_attention(graph: gs.Graph, softmax: gs.Node) -> Attention | str:
    """The attention chain around ``softmax``, or the reason it is not one this rule fuses."""
    x = softmax.inputs[0]
    shape = static_shape(x)
    if shape is None or len(shape) < 2:
        return f"the input of {softmax.name} has no static shape of rank >= 2"
    default_axis = -1 if (graph.opset or 13) >= 13 else 1
    if int(softmax.attrs.get("axis", default_axis)) % len(shape) != len(shape) - 1:
        return f"{softmax.name} is not over the last axis"
    after: list[gs.Node] = [softmax]
    y = softmax.outputs[0]
    zero_hidden_rows = False
    regroup_after = None
    regroups_before: list[gs.Node] = []  # walking back from the softmax
    while True:
        guard = None if zero_hidden_rows else _nan_guard(graph, y)
        if guard is not None:
            after += guard
            y, zero_hidden_rows = guard[-1].outputs[0], True
            continue
        if is_graph_output(graph, y) or len(y.outputs) != 1:
            return f"{y.name} is read by {len(y.outputs)} nodes or is a graph output"
        reader = y.outputs[0]
        if regroup_after is None and _regroups(reader):
            regroup_after = reader
        elif not _passes(reader):
            break
        after.append(reader)
        y = reader.outputs[0]
    if reader.op != "MatMul" or reader.inputs[0] is not y:
        return f"{softmax.name}'s probabilities are read by {reader.name} ({reader.op}), not as the left operand of a MatMul"
    mm2 = reader

    before: list[gs.Node] = []
    scale, mask_nodes = 1.0, []
    t = x
    while True:
        p = _producer(t)
        if p is None:
            return f"no MatMul produces the scores of {softmax.name}"
        if not _private(graph, p, (before[-1] if before else softmax)):
            return f"{p.outputs[0].name} is read by another node too or is a graph output"
        before.append(p)
        if p.op == "MatMul":
            mm1 = p
            break
        if _passes(p):
            t = p.inputs[0]
        elif len(regroups_before) < 3 and _regroups(p):
            regroups_before.append(p)
            t = p.inputs[0]
        elif p.op in ("Mul", "Div"):
            chain = next((i for i in p.inputs if _reaches_matmul(i)), None)
            got = _scale_of(p, chain)
            if isinstance(got, str):
                return got
            t, c = got
            scale *= c
        elif p.op in ("Add", "Where"):
            if scale != 1.0:  # walking back from the Softmax: a scale met before the mask is applied after it
                return f"the scores are scaled after the mask {p.name}"
            i = _scores_operand(p)
            if i is None:
                blocker = _first_stop(p)
                if blocker is not None:  # Gemma-2's logit soft-capping: tanh(scores / c) · c before the mask
                    return (f"the scores reach {p.name} through {blocker.name} ({blocker.op}), which is not a scale, "
                            "a mask or a regrouping")
                return f"{p.name} does not read the scores and a mask"
            # the node runs in the softmax's layout: a mask applied in another is regrouped to it, a constant at
            # build time, another by a Reshape where its rows are the scores' rows or one row for all of them
            operand = p.inputs[0 if p.op == "Where" else 1 - i]
            if regroups_before and const_value(operand) is None \
                    and _mask_rows(static_shape(operand), static_shape(p.outputs[0])) is None:
                return (f"the mask {p.name} is applied before {regroups_before[-1].name} regroups the scores, "
                        "is not a constant and has neither their rows nor one row for all")
            mask_nodes.append(p)
            t = p.inputs[i]
        else:
            return f"{p.name} ({p.op}) stands between the scores and {softmax.name}"

    # Q: a private Mul/Div by a constant scalar is part of the scale
    q = mm1.inputs[0]
    extra: list[gs.Node] = []
    p = _producer(q)
    if p is not None and p.op in ("Mul", "Div") and _private(graph, p, mm1):
        got = _scale_of(p)
        if not isinstance(got, str) and got[0] is not None:
            q, c = got
            scale *= c
            extra.append(p)
    # Kᵀ: a private scale and a private Transpose of the last two axes, in either order
    kt, k_transposed, reader = mm1.inputs[1], True, mm1
    for _ in range(2):
        p = _producer(kt)
        if p is None or not _private(graph, p, reader):
            break
        if p.op in ("Mul", "Div"):
            got = _scale_of(p)
            if isinstance(got, str):
                break
            kt, c = got
            scale *= c
        elif p.op == "Transpose" and k_transposed and _swaps_last_two(p):
            kt, k_transposed = p.inputs[0], False
        else:
            break
        extra.append(p)
        reader = p

    v = mm2.inputs[1]
    qs, ks, vs = static_shape(q), static_shape(kt), static_shape(v)
    if qs is None or ks is None or vs is None:
        return f"the shapes around {mm1.name} and {mm2.name} are not known"
    if k_transposed:
        kd, sk = ks[-2], ks[-1]
    else:
        sk, kd = ks[-2], ks[-1]
    lead = list(shape[:-2])  # the softmax's leading dimensions
    if not regroups_before and regroup_after is None:
        if len(qs) < 2 or len({len(qs), len(ks), len(vs)}) != 1 or not (qs[:-2] == ks[:-2] == vs[:-2]
                                                                          or _shared_kv_head(qs, ks, vs)):
            return f"{mm1.name} and {mm2.name} are not [..., S, D] x [..., D, S] x [..., S, D] with the same batch dimensions"
    else:  # Q and Kᵀ in one layout, V in one, each the softmax's rows regrouped (the node runs in the softmax's)
        rows = int(np.prod(lead))
        if len(qs) != len(ks) or list(qs[:-2]) != list(ks[:-2]) or min(len(qs), len(vs)) < 3 \
                or int(np.prod(qs[:-2])) != rows or int(np.prod(vs[:-2])) != rows \
                or not regroups_before and list(qs[:-2]) != lead or regroup_after is None and list(vs[:-2]) != lead:
            return f"{mm1.name} and {mm2.name} are not [..., S, D] x [..., D, S] x [..., S, D] over the softmax's rows"
    if qs[-1] != kd or vs[-2] != sk:
        return f"{mm1.name} and {mm2.name} are not [..., S, D] x [..., D, S] x [..., S, D]"
    dtype = q.dtype
    try:
        if np.dtype(dtype).type not in _FLOAT_TYPES or any(np.dtype(t.dtype) != np.dtype(dtype) for t in (kt, v)):
            return f"the inputs of {mm1.name} and {mm2.name} are not floating point of one type"
    except TypeError:
        return f"the inputs of {mm1.name} and {mm2.name} are not floating point of one type"

    att = Attention(q=q, k=kt, v=v, out=mm2.outputs[0], scale=scale, k_transposed=k_transposed,
                    nodes=[mm1, *reversed(before[:-1]), *after, mm2, *extra], zero_hidden_rows=zero_hidden_rows,
                    lead=lead if regroups_before or regroup_after is not None else None, scores_shape=tuple(shape))
    for node in mask_nodes:
        i = _scores_operand(node)
        if node.op == "Add":
            mask = Mask(node.inputs[1 - i])
        else:
            mask = Mask(node.inputs[0], _scalar(node.inputs[3 - i]), i == 1)
            if not mask.where_fill <= HIDING_FILL:
                return (f"the fill {mask.where_fill:g} of {node.name} does not hide a key exactly "
                        f"(-inf or at most {HIDING_FILL:g})")
        # the mask broadcasts to the scores without enlarging them: the masked scores have the scores' shape
        if static_shape(node.outputs[0]) is None or static_shape(node.inputs[i]) != static_shape(node.outputs[0]):
            return f"the mask {mask.tensor.name} of {node.name} does not broadcast to the scores' shape"
        mask.scores_shape = tuple(static_shape(node.outputs[0]))
        att.masks.append(mask)
    return att


def _mask_rows(mask_shape, scores_shape) -> str | None:
    """How a mask of ``mask_shape`` spans the leading dimensions (the rows) of the scores it is applied to:
    "each" (one per row: BLOOM's ALiBi bias [B·H, 1, Sk] on [B·H, Sq, Sk]), "all" (one for every row), or None
    (broadcast along some of them only, or shapes unknown)."""
    if mask_shape is None or scores_shape is None or len(mask_shape) > len(scores_shape):
        return None
    lead = [1] * (len(scores_shape) - len(mask_shape)) + list(mask_shape[:-2])
    if lead == list(scores_shape[:-2]):
        return "each"
    return "all" if all(d == 1 for d in lead) else None


def _regrouped_constant(value: np.ndarray, src: tuple, dst: tuple) -> np.ndarray:
    """A constant mask applied to scores of shape ``src``, as one that applies to the same scores regrouped to
    ``dst`` (a Reshape of the leading dimensions): broadcast to ``src``, reshaped to ``dst``, then every axis along
    which it does not vary kept at size 1 (Swin's shifted-window mask varies over the windows, not the heads)."""
    full = np.broadcast_to(value, src).reshape(dst)
    for axis in range(full.ndim):
        first = full.take([0], axis=axis)
        if full.shape[axis] > 1 and np.array_equal(full, np.broadcast_to(first, full.shape)):
            full = first
    return np.ascontiguousarray(full)


def _swaps_last_two(node: gs.Node) -> bool:
    perm = node.attrs.get("perm")
    if perm is None:
        return len(node.inputs[0].shape or ()) == 2
    r = len(perm)
    return r >= 2 and list(perm) == list(range(r - 2)) + [r - 1, r - 2]


def _keep_pattern(mask: Mask) -> np.ndarray | None:
    """The constant mask as booleans (True: the key takes part), or None when it is not constant or is not
    only 0 and hiding values."""
    value = const_value(mask.tensor)
    if value is None:
        return None
    if mask.where_fill is not None:
        return value.astype(bool) if mask.keep_if_true else ~value.astype(bool)
    if not np.all((value == 0) | (value <= HIDING_FILL)):
        return None
    return value == 0


def is_causal_mask(keep: np.ndarray | None, sq: int, sk: int) -> bool:
    """Whether ``keep`` hides exactly the keys after each query (torch's is_causal: keep j <= i)."""
    if keep is None or sq != sk or keep.ndim < 2 or keep.shape[-2:] != (sq, sk):
        return False
    flat = keep.reshape(-1, sq, sk)
    return bool(np.all(flat == np.tril(np.ones((sq, sk), dtype=bool))))


def _broadcast(a: gs.Tensor, b: gs.Tensor) -> list[int] | None:
    sa, sb = static_shape(a), static_shape(b)
    return list(np.broadcast_shapes(sa, sb)) if sa is not None and sb is not None else None


class FuseAttention(Rule):
    name = "fuse_attention"
    simplifying = True  # it only removes work: the scores are never written (the GPU build times it per engine)
    backends = frozenset({"torch"})

    def match(self, graph: gs.Graph) -> list[Site]:
        return anchored_sites(self.name, graph, ("Softmax",), find_attention)

    def _find(self, graph: gs.Graph, site: Site) -> Attention | str:
        nodes = site_nodes(graph, site)
        if nodes is None:
            return "the nodes are gone"
        softmax = next((n for n in nodes if n.op == "Softmax"), None)
        if softmax is None:
            return "no Softmax"
        att = find_attention(graph, softmax)
        if isinstance(att, Attention) and tuple(n.name for n in att.nodes) != site.nodes:
            return "the chain changed"
        return att

    def check(self, graph: gs.Graph, site: Site) -> str | None:
        att = self._find(graph, site)
        return att if isinstance(att, str) else None

    @staticmethod
    def _regrouped(graph: gs.Graph, namer: Namer, name: str, t: gs.Tensor, lead: list[int]) -> gs.Tensor:
        """``t`` [..., A, B] as [*lead, A, B] (a Reshape; ``t`` itself where it has those dimensions)."""
        shape = list(static_shape(t))
        if shape[:-2] == lead:
            return t
        out = gs.Variable(namer(name), dtype=t.dtype, shape=lead + shape[-2:])
        graph.nodes.append(gs.Node("Reshape", name=namer(name), outputs=[out], inputs=[
            t, gs.Constant(namer(f"{name}_shape"), np.asarray(lead + shape[-2:], dtype=np.int64))]))
        return out

    @staticmethod
    def _additive(graph: gs.Graph, namer: Namer, base: str, mask: Mask, dtype) -> gs.Tensor:
        """``mask`` as a tensor added to the scores: Add's operand as it is, Where(C, 0, f) for a Where."""
        if mask.where_fill is None:
            return mask.tensor
        keep = _keep_pattern(mask)
        if keep is not None:  # a constant condition: the additive mask is a constant too
            return gs.Constant(namer(f"{base}_mask"), np.where(keep, 0, mask.where_fill).astype(dtype))
        # Where(C, x, f) = x + Where(C, 0, f): f hides exactly (HIDING_FILL)
        zero = gs.Constant(namer(f"{base}_zero"), np.zeros((), dtype=dtype))
        fill = gs.Constant(namer(f"{base}_fill"), np.asarray(mask.where_fill, dtype=dtype))
        out = gs.Variable(namer(f"{base}_mask"), dtype=dtype, shape=mask.tensor.shape)
        pair = [zero, fill] if mask.keep_if_true else [fill, zero]
        graph.nodes.append(gs.Node("Where", name=namer(f"{base}_mask"), inputs=[mask.tensor, *pair], outputs=[out]))
        return out

    def rewrite(self, graph: gs.Graph, site: Site) -> None:
        att = self._find(graph, site)
        namer = Namer(graph)
        base = f"{att.nodes[0].name}_attention"
        dtype = np.dtype(att.q.dtype)
        k = att.k
        if att.k_transposed:
            ks = list(static_shape(k))
            k = gs.Variable(namer(f"{base}_K"), dtype=dtype, shape=ks[:-2] + [ks[-1], ks[-2]])
            r = len(ks)
            graph.nodes.append(gs.Node("Transpose", name=namer(f"{base}_K_transpose"),
                                       attrs={"perm": list(range(r - 2)) + [r - 1, r - 2]}, inputs=[att.k], outputs=[k]))
        q, v = att.q, att.v
        if att.lead is not None:  # the node runs in the softmax's layout: its operands' rows regrouped to it
            q, k, v = (self._regrouped(graph, namer, f"{base}_{tag}", t, att.lead) for tag, t in (("Q", q), ("K", k), ("V", v)))
        qs, sk = static_shape(q), static_shape(k)[-2]
        causal, mask = 0, None
        if len(att.masks) == 1 and is_causal_mask(_keep_pattern(att.masks[0]), qs[-2], sk):
            causal = 1
        else:
            for m in att.masks:  # their sum, each as an additive mask
                term = self._additive(graph, namer, base, m, dtype)
                if m.scores_shape != att.scores_shape and const_value(term) is not None:
                    # a constant applied before the scores were regrouped: regrouped now
                    term = gs.Constant(namer(f"{base}_mask"), _regrouped_constant(
                        np.asarray(const_value(term), dtype=dtype), m.scores_shape, att.scores_shape))
                elif m.scores_shape != att.scores_shape:  # another: a Reshape of its rows to the softmax's
                    ts = list(static_shape(term))
                    rows = list(att.scores_shape[:-2]) if _mask_rows(ts, m.scores_shape) == "each" \
                        else [1] * (len(att.scores_shape) - 2)
                    regrouped = gs.Variable(namer(f"{base}_mask"), dtype=dtype, shape=rows + ts[-2:])
                    graph.nodes.append(gs.Node("Reshape", name=namer(f"{base}_mask"), outputs=[regrouped], inputs=[
                        term, gs.Constant(namer(f"{base}_mask_shape"), np.asarray(rows + ts[-2:], dtype=np.int64))]))
                    term = regrouped
                if mask is not None:
                    total = gs.Variable(namer(f"{base}_masks"), dtype=dtype, shape=_broadcast(mask, term))
                    graph.nodes.append(gs.Node("Add", name=namer(f"{base}_masks"), inputs=[mask, term], outputs=[total]))
                    term = total
                mask = term
        out = att.out
        if att.lead is not None and list(static_shape(out)[:-2]) != att.lead:  # the output regrouped back after
            final = list(static_shape(out))
            out = gs.Variable(namer(f"{base}_Y"), dtype=out.dtype, shape=att.lead + final[-2:])
            graph.nodes.append(gs.Node("Reshape", name=namer(f"{base}_Y"), outputs=[att.out], inputs=[
                out, gs.Constant(namer(f"{base}_Y_shape"), np.asarray(final, dtype=np.int64))]))
        detach(*att.nodes)
        inputs = [q, k, v] + ([mask] if mask is not None else [])
        attrs = {"scale": float(att.scale), "is_causal": causal}
        ms = static_shape(mask) if mask is not None else None
        if att.zero_hidden_rows:  # ONNX's Attention has no such attribute: parastream's node carries it
            attrs["zero_hidden_rows"] = 1
        if not att.zero_hidden_rows and (graph.opset or 0) >= 23 and len(qs) == 4 \
                and (mask is None or (ms is not None and ms[-2:] == (qs[-2], sk))):
            graph.nodes.append(gs.Node("Attention", name=namer(base), attrs=attrs, inputs=inputs, outputs=[out]))
        else:
            graph.nodes.append(gs.Node(fused_ops.SDPA, name=namer(base), attrs=attrs, inputs=inputs, outputs=[out],
                                       domain=fused_ops.DOMAIN))
            domains = list(graph.import_domains or [])
            if not any(d.domain == fused_ops.DOMAIN for d in domains):  # a new list: copies share the old one
                graph.import_domains = domains + [fused_ops.opset_id()]
