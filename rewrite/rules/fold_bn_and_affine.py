"""Fold BatchNormalization, and constant per-channel Mul/Div/Add/Sub, into the preceding Conv, Gemm or MatMul.

With s = γ/√(σ²+ε) per output channel (BatchNormalization), or s the constant of a Mul (1/c of a Div):

    W' = W·s,   B' = (B − μ)·s + β          (BatchNormalization)
    W' = W·s,   B' = B·s                    (Mul, Div)
    W' = W,     B' = B + a                  (Add; a = −c for Sub)

since every output channel (Conv: axis 1; Gemm/MatMul: the last axis) is an affine function of its own
weights and bias.  Gemm is first normalised to α = β = 1, transB = 0.  MatMul has no bias: only Mul/Div fold.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from .base import Namer, Rule, Site, channel_vector, const_value, detach, private_output, site_nodes, static_shape
from .merge_parallel_conv import conv_bias
from .merge_parallel_matmul import gemm_weight_bias

FOLLOWERS = ("BatchNormalization", "Mul", "Div", "Add", "Sub")
PRODUCERS = ("Conv", "Gemm", "MatMul")


def _data_and_constant(node: gs.Node) -> tuple[gs.Tensor, np.ndarray] | None:
    """(the variable operand, the constant one) of a binary follower; Sub and Div only with the constant second."""
    if len(node.inputs) != 2:
        return None
    a, b = node.inputs
    if const_value(b) is not None and const_value(a) is None:
        return a, const_value(b)
    if node.op in ("Mul", "Add") and const_value(a) is not None and const_value(b) is None:
        return b, const_value(a)
    return None


def _channel_axis(producer: gs.Node) -> int:
    return 1 if producer.op == "Conv" else -1


def _scale_shift(producer: gs.Node, follower: gs.Node) -> tuple[np.ndarray, np.ndarray] | str:
    """(s, t) such that follower(y) = y·s + t per output channel, or the reason there is none."""
    shape = static_shape(producer.outputs[0])
    channels = shape[_channel_axis(producer)]
    dtype = const_value(producer.inputs[1]).dtype
    if follower.op == "BatchNormalization":
        if int(follower.attrs.get("training_mode", 0)) or len(follower.outputs) != 1:
            return f"{follower.name} runs in training mode"
        if producer.op != "Conv" and len(shape) != 2:
            return f"{follower.name} normalises axis 1, not the output columns of {producer.name}"
        values = [const_value(t) for t in follower.inputs[1:5]]
        if any(v is None for v in values):
            return f"the statistics of {follower.name} are not constant initializers"
        gamma, beta, mean, var = (v.astype(np.float64).reshape(-1) for v in values)
        s = gamma / np.sqrt(var + float(follower.attrs.get("epsilon", 1e-5)))
        return s.astype(dtype), (beta - mean * s).astype(dtype)
    operands = _data_and_constant(follower)
    if operands is None:
        return f"{follower.name} has no constant operand on the right side"
    vec = channel_vector(operands[1], len(shape), channels, _channel_axis(producer) % len(shape))
    if vec is None:
        return f"the constant of {follower.name} (shape {list(operands[1].shape)}) is not per output channel of {producer.name}"
    if static_shape(follower.outputs[0]) != shape:
        return f"{follower.name} broadcasts its output beyond {producer.name}'s"
    vec = vec.astype(np.float64)
    ones, zeros = np.ones(channels), np.zeros(channels)
    if follower.op == "Mul":
        s, t = vec, zeros
    elif follower.op == "Div":
        if np.any(vec == 0):
            return f"{follower.name} divides by zero"
        s, t = 1.0 / vec, zeros
    elif follower.op == "Add":
        s, t = ones, vec
    else:
        s, t = ones, -vec
    if producer.op == "MatMul" and np.any(t):
        return f"{producer.name} is a MatMul: it has no bias to fold {follower.name} into"
    return s.astype(dtype), t.astype(dtype)


class FoldBatchNormAndAffine(Rule):
    name = "fold_bn_and_affine"
    simplifying = True

    def match(self, graph: gs.Graph) -> list[Site]:
        sites = []
        for f in graph.nodes:
            if f.op not in FOLLOWERS or not f.inputs:
                continue
            data = f.inputs[0]
            if f.op in ("Mul", "Add") and len(f.inputs) == 2 and const_value(data) is not None:
                data = f.inputs[1]
            if isinstance(data, gs.Variable) and len(data.inputs) == 1 and data.inputs[0].op in PRODUCERS:
                sites.append(Site(self.name, (data.inputs[0].name, f.name)))
        return sites

    def check(self, graph: gs.Graph, site: Site) -> str | None:
        nodes = site_nodes(graph, site)
        if nodes is None:
            return "the nodes are gone"
        producer, follower = nodes
        reason = private_output(graph, producer, follower)
        if reason:
            return reason
        if len(producer.inputs) < 2 or const_value(producer.inputs[1]) is None:
            return f"the weights of {producer.name} are not a constant initializer"
        if len(producer.inputs) > 2 and producer.inputs[2] is not None and producer.inputs[2].name \
                and const_value(producer.inputs[2]) is None:
            return f"the bias of {producer.name} is not a constant initializer"
        if producer.op != "Conv" and const_value(producer.inputs[1]).ndim != 2:
            return f"the weights of {producer.name} are not a matrix"
        if static_shape(producer.outputs[0]) is None:
            return f"the output shape of {producer.name} is not known"
        got = _scale_shift(producer, follower)
        return got if isinstance(got, str) else None

    def rewrite(self, graph: gs.Graph, site: Site) -> None:
        producer, follower = site_nodes(graph, site)
        namer = Namer(graph)
        s, t = _scale_shift(producer, follower)
        if producer.op == "Conv":
            w = const_value(producer.inputs[1])
            w2 = w * s.reshape((-1,) + (1,) * (w.ndim - 1))
            b2 = conv_bias(producer) * s + t
            inputs = [producer.inputs[0], gs.Constant(namer(f"{producer.name}_W_folded"), w2.astype(w.dtype)),
                      gs.Constant(namer(f"{producer.name}_B_folded"), b2.astype(w.dtype))]
            attrs = dict(producer.attrs)
        elif producer.op == "Gemm":
            w, c = gemm_weight_bias(producer)
            inputs = [producer.inputs[0], gs.Constant(namer(f"{producer.name}_W_folded"), (w * s).astype(w.dtype)),
                      gs.Constant(namer(f"{producer.name}_C_folded"), (c * s + t).astype(w.dtype).reshape(-1)
                                  if c.shape[0] == 1 else (c * s + t).astype(w.dtype))]
            attrs = {"transA": int(producer.attrs.get("transA", 0))}
        else:
            w = const_value(producer.inputs[1])
            inputs = [producer.inputs[0], gs.Constant(namer(f"{producer.name}_W_folded"), (w * s).astype(w.dtype))]
            attrs = {}
        out = follower.outputs[0]
        detach(follower)
        producer.inputs.clear()
        producer.inputs.extend(inputs)
        producer.outputs.clear()
        producer.outputs.append(out)
        producer.attrs = attrs
