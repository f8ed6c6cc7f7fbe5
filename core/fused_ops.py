"""parastream's own ONNX domain: the fused ops a rewrite rule leaves for a backend that knows them.

``parastream::ScaledDotProductAttention`` (version 1), what ``rewrite/rules/fuse_attention.py`` leaves where the
model's opset has no ``Attention`` (opset < 23) and the torch backend runs as
``torch.nn.functional.scaled_dot_product_attention``:

    Y = softmax(scale · Q·Kᵀ + M) · V

* inputs ``Q`` [..., Sq, D], ``K`` [..., Sk, D] (not transposed), ``V`` [..., Sk, Dv], optional ``mask`` M:
  a float tensor added to the scores (-inf or a huge negative hides a key), or a bool tensor (True: the key
  takes part), broadcastable to [..., Sq, Sk];
* attributes ``scale`` (float, default 1) and ``is_causal`` (int, default 0: 1 hides key j from query i for j > i);
* output ``Y`` [..., Sq, Dv], Q's type.

``parastream::MatMulBiasActivation`` (version 1), what ``rewrite/rules/fuse_gemm_epilogue.py`` leaves and the torch
backend runs as ``torch._addmm_activation`` (cuBLASLt's fused bias + ReLU/GELU epilogue):

    Y = act(X·W + B)

* inputs ``X`` [..., K], ``W`` [K, N], ``B`` [N] (or [1, ..., 1, N]); output ``Y`` [..., N], X's type;
* attributes ``activation`` ("Relu" or "Gelu") and, for "Gelu", ``approximate`` ("none": x·Φ(x) with erf, or
  "tanh": 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))), as ONNX's Gelu names them).

Importing this module registers the ops' schemas with onnx (checker and shape inference then know it); a model
that uses it imports the domain at :data:`VERSION` (:func:`opset_id`).
"""

from __future__ import annotations

import onnx
from onnx import defs, helper

DOMAIN = "parastream"
VERSION = 1
SDPA = "ScaledDotProductAttention"
GEMM_ACTIVATION = "MatMulBiasActivation"
ACTIVATIONS = ("Relu", "Gelu")

_FLOATS = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)", "tensor(double)"]


def opset_id() -> onnx.OperatorSetIdProto:
    return helper.make_opsetid(DOMAIN, VERSION)


def _sdpa_shapes(ctx) -> None:
    """Y has Q's type and shape with V's last dimension."""
    q, v = ctx.get_input_type(0), ctx.get_input_type(2)
    out = onnx.TypeProto()
    out.CopyFrom(q)
    if q.tensor_type.HasField("shape") and v.tensor_type.HasField("shape") and v.tensor_type.shape.dim \
            and q.tensor_type.shape.dim:
        out.tensor_type.shape.dim[-1].CopyFrom(v.tensor_type.shape.dim[-1])
    ctx.set_output_type(0, out)


def _gemm_activation_shapes(ctx) -> None:
    """Y has X's type and shape with W's last dimension."""
    x, w = ctx.get_input_type(0), ctx.get_input_type(1)
    out = onnx.TypeProto()
    out.CopyFrom(x)
    if x.tensor_type.HasField("shape") and w.tensor_type.HasField("shape") and w.tensor_type.shape.dim \
            and x.tensor_type.shape.dim:
        out.tensor_type.shape.dim[-1].CopyFrom(w.tensor_type.shape.dim[-1])
    ctx.set_output_type(0, out)


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
                    attr("is_causal", helper.make_attribute("is_causal", 0), "1: key j is hidden from query i when j > i")])
    schema.set_type_and_shape_inference_function(_sdpa_shapes)
    defs.register_schema(schema)
    schema = defs.OpSchema(
        GEMM_ACTIVATION, DOMAIN, VERSION, __doc__ or "",
        inputs=[param("X", "T"), param("W", "T"), param("B", "T")],
        outputs=[param("Y", "T")],
        type_constraints=[("T", _FLOATS, "floating-point tensors")],
        attributes=[attr("activation", helper.make_attribute("activation", "Relu"), "Relu or Gelu"),
                    attr("approximate", helper.make_attribute("approximate", "none"), "Gelu: none (erf) or tanh")])
    schema.set_type_and_shape_inference_function(_gemm_activation_shapes)
    defs.register_schema(schema)


_register()
