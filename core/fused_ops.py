"""parastream's own ONNX domain: the fused ops a rewrite rule leaves for a backend that knows them.

``parastream::ScaledDotProductAttention`` (version 1), what ``rewrite/rules/fuse_attention.py`` leaves where the
model's opset has no ``Attention`` (opset < 23) and the torch backend runs as
``torch.nn.functional.scaled_dot_product_attention``:

    Y = softmax(scale · Q·Kᵀ + M) · V

* inputs ``Q`` [..., Sq, D], ``K`` [..., Sk, D] (not transposed), ``V`` [..., Sk, Dv] (K's and V's leading
  dimensions Q's, or 1 on the heads' axis -3 where Q has several: one K/V head every query head reads, as
  MatMul broadcasts it), optional ``mask`` M:
  a float tensor added to the scores (-inf or a huge negative hides a key), or a bool tensor (True: the key
  takes part), broadcastable to [..., Sq, Sk];
* attributes ``scale`` (float, default 1), ``is_causal`` (int, default 0: 1 hides key j from query i for j > i)
  and ``zero_hidden_rows`` (int, default 0: 1 gives 0 for a query whose every key the mask hides, as
  ``torch.nn.functional.scaled_dot_product_attention`` does with a boolean mask and torch's exporters write it,
  ``Where(IsNaN(P), 0, P)`` after the softmax; 0 leaves softmax's NaN there);
* output ``Y`` [..., Sq, Dv], Q's type.

``parastream::MatMulBiasActivation`` (version 1), what ``rewrite/rules/fuse_gemm_epilogue.py`` leaves and the torch
backend runs as ``torch._addmm_activation`` (cuBLASLt's fused bias + ReLU/GELU epilogue):

    Y = act(X·W + B)

* inputs ``X`` [..., K], ``W`` [K, N], ``B`` [N] (or [1, ..., 1, N]); output ``Y`` [..., N], X's type;
* attributes ``activation`` ("Relu", "Gelu", or "Identity": none, Y = X·W + B, what ``fuse_gemm_bias`` leaves)
  and, for "Gelu", ``approximate`` ("none": x·Φ(x) with erf, or "tanh": 0.5·x·(1 + tanh(√(2/π)·(x +
  0.044715·x³))), as ONNX's Gelu names them).

:func:`plain_onnx` writes a model's nodes of this domain back as the plain ops they stand for, for ONNX Runtime.

Importing this module registers the ops' schemas with onnx (checker and shape inference then know it); a model
that uses it imports the domain at :data:`VERSION` (:func:`opset_id`).
"""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import defs, helper, numpy_helper

from .graph import unused_name

DOMAIN = "parastream"
VERSION = 1
SDPA = "ScaledDotProductAttention"
GEMM_ACTIVATION = "MatMulBiasActivation"
ACTIVATIONS = ("Relu", "Gelu", "Identity")

_FLOATS = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)", "tensor(double)"]


def opset_id() -> onnx.OperatorSetIdProto:
    return helper.make_opsetid(DOMAIN, VERSION)


def _like_with_last_dim(ctx, like: int, last: int) -> None:
    """Y has input ``like``'s type and shape with input ``last``'s last dimension."""
    a, b = ctx.get_input_type(like), ctx.get_input_type(last)
    out = onnx.TypeProto()
    out.CopyFrom(a)
    if a.tensor_type.HasField("shape") and b.tensor_type.HasField("shape") and b.tensor_type.shape.dim \
            and a.tensor_type.shape.dim:
        out.tensor_type.shape.dim[-1].CopyFrom(b.tensor_type.shape.dim[-1])
    ctx.set_output_type(0, out)


def _sdpa_shapes(ctx) -> None:
    """Y has Q's type and shape with V's last dimension."""
    _like_with_last_dim(ctx, 0, 2)


def _gemm_activation_shapes(ctx) -> None:
    """Y has X's type and shape with W's last dimension."""
    _like_with_last_dim(ctx, 0, 1)


def _register() -> None:
    if defs.has(SDPA, DOMAIN):
        return
    param = defs.OpSchema.FormalParameter
    optional = defs.OpSchema.FormalParameterOption.Optional
    attr = defs.OpSchema.Attribute
    schema = defs.OpSchema(
        SDPA, DOMAIN, VERSION, __doc__ or "",
        inputs=[param("Q", "T"), param("K", "T"), param("V", "T"), param("mask", "M", param_option=optional)],
        outputs=[param("Y", "T")],
        type_constraints=[("T", _FLOATS, "floating-point tensors"), ("M", _FLOATS + ["tensor(bool)"], "the mask")],
        attributes=[attr("scale", helper.make_attribute("scale", 1.0), "the factor of Q·Kᵀ"),
                    attr("is_causal", helper.make_attribute("is_causal", 0), "1: key j is hidden from query i when j > i"),
                    attr("zero_hidden_rows", helper.make_attribute("zero_hidden_rows", 0),
                         "1: a query whose every key is hidden gets 0 (else softmax's NaN)")])
    schema.set_type_and_shape_inference_function(_sdpa_shapes)
    defs.register_schema(schema)
    schema = defs.OpSchema(
        GEMM_ACTIVATION, DOMAIN, VERSION, __doc__ or "",
        inputs=[param("X", "T"), param("W", "T"), param("B", "T")],
        outputs=[param("Y", "T")],
        type_constraints=[("T", _FLOATS, "floating-point tensors")],
        attributes=[attr("activation", helper.make_attribute("activation", "Relu"), "Relu, Gelu or Identity"),
                    attr("approximate", helper.make_attribute("approximate", "none"), "Gelu: none (erf) or tanh")])
    schema.set_type_and_shape_inference_function(_gemm_activation_shapes)
    defs.register_schema(schema)


_register()


def _elem_type(graph: onnx.GraphProto, name: str) -> int:
    for v in (*graph.input, *graph.value_info, *graph.output):
        if v.name == name and v.type.tensor_type.elem_type:
            return v.type.tensor_type.elem_type
    for t in graph.initializer:
        if t.name == name:
            return t.data_type
    return onnx.TensorProto.FLOAT


def _rank_and_dims(graph: onnx.GraphProto, name: str) -> list | None:
    """The dimensions (ints, or None where unknown) of ``name`` as the graph records them; None if unrecorded."""
    for v in (*graph.input, *graph.value_info, *graph.output):
        if v.name == name and v.type.tensor_type.HasField("shape"):
            return [d.dim_value if d.HasField("dim_value") else None for d in v.type.tensor_type.shape.dim]
    for t in graph.initializer:
        if t.name == name:
            return list(t.dims)
    return None


def plain_onnx(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` with each node of this domain replaced by the plain ops it stands for, so that ONNX
    Runtime runs it.  ``MatMulBiasActivation``: MatMul, Add and Relu (no Relu for Identity); for a GELU, ONNX's Gelu where the model's
    opset is at least 20, else its erf form 0.5·x·(1 + erf(x/√2)) or its tanh form
    0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))).  ``ScaledDotProductAttention``: Transpose of K's last two axes,
    MatMul, Mul by the scale, the mask added (a float mask) or applied with Where (a bool mask, the type's lowest
    elsewhere, or -inf with ``zero_hidden_rows``), the causal mask as a constant (its two sizes must be known),
    Softmax (then ``Where(IsNaN(P), 0, P)`` with ``zero_hidden_rows``), MatMul.
    The domain's import is dropped when no node of it is left.  A model without such a node is returned as it is
    (not copied)."""
    if not any(n.domain == DOMAIN and n.op_type in (GEMM_ACTIVATION, SDPA) for n in model.graph.node):
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    if any((n.domain, n.op_type) == (DOMAIN, SDPA) for n in out.graph.node) and not out.graph.value_info:
        out = onnx.shape_inference.infer_shapes(out)  # the attention's decomposition needs its inputs' ranks
    g = out.graph
    opset = next((o.version for o in out.opset_import if o.domain in ("", "ai.onnx")), 1)
    taken = {n.name for n in g.node} | {t for n in g.node for t in (*n.input, *n.output)} | \
        {t.name for t in (*g.input, *g.output, *g.initializer)}
    nodes: list[onnx.NodeProto] = []
    for node in g.node:
        if node.domain == DOMAIN and node.op_type in (GEMM_ACTIVATION, SDPA):
            writer = _Writer(g, node, taken, nodes)
            (_plain_attention if node.op_type == SDPA else _plain_gemm_activation)(writer, node, opset)
        else:
            nodes.append(node)
    del g.node[:]
    g.node.extend(nodes)
    if not any(n.domain == DOMAIN for n in g.node):
        kept = [o for o in out.opset_import if o.domain != DOMAIN]
        del out.opset_import[:]
        out.opset_import.extend(kept)
    return out


class _Writer:
    """Plain nodes written for one fused node, named after it (``unused_name`` over the model's names), and
    their constants appended to the graph's initializers, in the fused node's input type unless told."""

    def __init__(self, g: onnx.GraphProto, node: onnx.NodeProto, taken: set[str], nodes: list):
        self.g, self.taken, self.nodes = g, taken, nodes
        self.base = node.name or node.output[0]
        self.dtype = helper.tensor_dtype_to_np_dtype(_elem_type(g, node.input[0]))

    def op(self, kind: str, inputs: list[str], output: str | None = None, **attrs) -> str:
        output = output or unused_name(self.taken, f"{self.base}_{kind.lower()}")
        self.nodes.append(helper.make_node(kind, inputs, [output], name=unused_name(self.taken, f"{self.base}_{kind.lower()}"),
                                           **attrs))
        return output

    def const(self, tag: str, value, dtype=None) -> str:
        name = unused_name(self.taken, f"{self.base}_{tag}")
        self.g.initializer.append(numpy_helper.from_array(np.asarray(value, dtype=dtype or self.dtype), name))
        return name


def _plain_gemm_activation(w: _Writer, node: onnx.NodeProto, opset: int) -> None:
    """``MatMulBiasActivation`` ``node`` as plain ONNX nodes."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    activation = attrs.get("activation", b"Relu")
    approximate = attrs.get("approximate", b"none")
    activation = activation.decode() if isinstance(activation, bytes) else activation
    approximate = approximate.decode() if isinstance(approximate, bytes) else approximate
    x, weight, b = node.input
    y = node.output[0]
    if activation == "Identity":
        w.op("Add", [w.op("MatMul", [x, weight]), b], y)
        return
    h = w.op("Add", [w.op("MatMul", [x, weight]), b])
    if activation == "Relu":
        w.op("Relu", [h], y)
    elif opset >= 20:
        w.op("Gelu", [h], y, approximate=approximate)
    else:
        if approximate == "tanh":
            cube = w.op("Mul", [h, w.op("Mul", [h, h])])
            inner = w.op("Add", [h, w.op("Mul", [cube, w.const("k", 0.044715)])])
            t = w.op("Tanh", [w.op("Mul", [inner, w.const("root", math.sqrt(2 / math.pi))])])
        else:
            t = w.op("Erf", [w.op("Div", [h, w.const("sqrt2", math.sqrt(2.0))])])
        w.op("Mul", [w.op("Mul", [h, w.op("Add", [t, w.const("one", 1.0)])]), w.const("half", 0.5)], y)


def _plain_attention(w: _Writer, node: onnx.NodeProto, _opset: int) -> None:
    """``ScaledDotProductAttention`` ``node`` as plain ONNX nodes."""
    g = w.g
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    q, k, v = node.input[:3]
    mask = node.input[3] if len(node.input) > 3 and node.input[3] else None
    qdims, kdims = _rank_and_dims(g, q), _rank_and_dims(g, k)
    if kdims is None or qdims is None:
        raise ValueError(f"{w.base}: the attention's decomposition needs the ranks of {q!r} and {k!r}")
    r = len(kdims)
    scores = w.op("Mul", [w.op("MatMul", [q, w.op("Transpose", [k], perm=[*range(r - 2), r - 1, r - 2])]),
                          w.const("scale", attrs.get("scale", 1.0))])
    zero_rows = bool(attrs.get("zero_hidden_rows", 0))
    lowest = -np.inf if zero_rows else np.finfo(w.dtype).min  # -inf: a row of hidden keys is NaN, then 0
    if mask is not None:
        if _elem_type(g, mask) == onnx.TensorProto.BOOL:
            scores = w.op("Where", [mask, scores, w.const("lowest", lowest)])
        else:
            scores = w.op("Add", [scores, mask])
    if attrs.get("is_causal", 0):
        sq, sk = qdims[-2], kdims[-2]
        if sq is None or sk is None:
            raise ValueError(f"{w.base}: a causal attention's decomposition needs its sequence lengths")
        keep = np.tril(np.ones((sq, sk), dtype=bool))  # query i sees keys j <= i (torch's is_causal)
        scores = w.op("Where", [w.const("causal", keep, bool), scores, w.const("lowest", lowest)])
    p = w.op("Softmax", [scores], axis=-1)
    if zero_rows:
        p = w.op("Where", [w.op("IsNaN", [p]), w.const("zero", 0.0), p])
    w.op("MatMul", [p, v], node.output[0])
