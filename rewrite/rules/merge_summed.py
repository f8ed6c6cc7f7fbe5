"""Sum of two linear ops of one input → one op with summed weights.

Conv and MatMul are linear in their weights, so for the same input x and identical attributes

    Conv(x, W₁, B₁) + Conv(x, W₂, B₂) = Conv(x, W₁ + W₂, B₁ + B₂)
    x·W₁ + x·W₂                       = x·(W₁ + W₂)
    Gemm(x, W₁, C₁) + Gemm(x, W₂, C₂) = Gemm(x, α₁·op(W₁) + α₂·op(W₂), β₁·C₁ + β₂·C₂)     (α = β = 1, transB = 0 after)

(kernels of different size are first made equal by ``enlarge_kernel``).
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from .base import Namer, Rule, Site, attr_difference, const_value, detach, private_output, site_nodes, static_shape
from .merge_parallel_conv import conv_reason, conv_bias, conv_signature
from .merge_parallel_matmul import gemm_weight_bias, matmul_operand_reason


class MergeSummed(Rule):
    name = "merge_summed"
    simplifying = True

    def match(self, graph: gs.Graph) -> list[Site]:
        sites = []
        for add in graph.nodes:
            if add.op != "Add" or len(add.inputs) != 2:
                continue
            ps = [t.inputs[0] if isinstance(t, gs.Variable) and len(t.inputs) == 1 else None for t in add.inputs]
            if all(p is not None and p.op in ("Conv", "MatMul", "Gemm") for p in ps) and ps[0] is not ps[1] \
                    and ps[0].op == ps[1].op:
                sites.append(Site(self.name, (ps[0].name, ps[1].name, add.name)))
        return sites

    def check(self, graph: gs.Graph, site: Site) -> str | None:
        nodes = site_nodes(graph, site)
        if nodes is None:
            return "the nodes are gone"
        p1, p2, add = nodes
        if p1.inputs[0] is not p2.inputs[0]:
            return f"{p1.name} and {p2.name} do not read the same tensor"
        for p in (p1, p2):
            reason = private_output(graph, p, add)
            if reason:
                return reason
            reason = conv_reason(p) if p.op == "Conv" else matmul_operand_reason(p)
            if reason:
                return reason
        if p1.op == "Conv":
            diff = attr_difference(conv_signature(p1), conv_signature(p2), p1.name, p2.name)
            if diff:
                return diff
        if p1.op == "Gemm" and int(p1.attrs.get("transA", 0)) != int(p2.attrs.get("transA", 0)):
            return f"{p1.name} and {p2.name} differ in transA"
        w1, w2 = self._weights(p1), self._weights(p2)
        if w1[0].shape != w2[0].shape:
            return f"the weights of {p1.name} and {p2.name} differ in shape ({list(w1[0].shape)} vs {list(w2[0].shape)})"
        if static_shape(p1.outputs[0]) != static_shape(p2.outputs[0]) or static_shape(add.outputs[0]) != static_shape(p1.outputs[0]):
            return f"the outputs of {p1.name}, {p2.name} and {add.name} differ in shape"
        return None

    @staticmethod
    def _weights(p: gs.Node) -> tuple[np.ndarray, np.ndarray | None]:
        if p.op == "Conv":
            return const_value(p.inputs[1]), conv_bias(p)
        if p.op == "Gemm":
            return gemm_weight_bias(p)
        return const_value(p.inputs[1]), None

    def rewrite(self, graph: gs.Graph, site: Site) -> None:
        p1, p2, add = site_nodes(graph, site)
        namer = Namer(graph)
        (w1, b1), (w2, b2) = self._weights(p1), self._weights(p2)
        w = gs.Constant(namer(f"{p1.name}_W_summed"), (w1 + w2).astype(w1.dtype))
        inputs = [p1.inputs[0], w]
        attrs: dict = {}
        if p1.op == "Conv":
            attrs = {k: v for k, v in conv_signature(p1).items() if v is not None}
            inputs.append(gs.Constant(namer(f"{p1.name}_B_summed"), (b1 + b2).astype(w1.dtype)))
        elif p1.op == "Gemm":
            attrs = {"transA": int(p1.attrs.get("transA", 0))}
            rows = max(b1.shape[0], b2.shape[0])
            n = b1.shape[1]
            c = np.broadcast_to(b1, (rows, n)) + np.broadcast_to(b2, (rows, n))
            inputs.append(gs.Constant(namer(f"{p1.name}_C_summed"), (c.reshape(-1) if rows == 1 else c).astype(w1.dtype)))
        out = add.outputs[0]
        detach(add, p2)
        p1.inputs.clear()
        p1.inputs.extend(inputs)
        p1.outputs.clear()
        p1.outputs.append(out)
        p1.attrs = attrs
