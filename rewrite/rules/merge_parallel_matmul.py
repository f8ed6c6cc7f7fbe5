"""Merge parallel MatMul/Gemm that share their left input (the Q/K/V projections of attention) into one, then Split.

    x·W_i + b_i = Split_i( x·[W_1 | … | W_n] + [b_1 | … | b_n] )          (concatenation along the last axis)

because each output column depends only on its own weight column and bias.  A bias is the constant
operand of an ``Add`` that is the MatMul's only reader; Gemm's α and β are folded into W and C
(α·op(W), β·C), and op(W) = Wᵀ when transB = 1.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from .base import (Namer, Rule, Site, const_value, shared_array, detach, is_graph_output, make_split, same_dtype, site_nodes,
                   static_shape)


def matmul_bias(graph: gs.Graph, node: gs.Node) -> tuple[gs.Node, np.ndarray] | None:
    """(the Add, the bias as a vector of length N) when ``node``'s only reader adds a per-column constant."""
    out = node.outputs[0]
    shape = static_shape(out)
    if shape is None or is_graph_output(graph, out) or len(out.outputs) != 1:
        return None
    add = out.outputs[0]
    if add.op != "Add" or len(add.inputs) != 2:
        return None
    other = add.inputs[1] if add.inputs[0] is out else add.inputs[0]
    value = const_value(other)
    if value is None or value.ndim > len(shape) or any(d != 1 for d in value.shape[:-1]):
        return None
    if value.ndim == 0 or value.shape[-1] not in (1, shape[-1]) or static_shape(add.outputs[0]) != shape:
        return None
    return add, np.broadcast_to(value.reshape(-1), (shape[-1],)).astype(value.dtype)


def matmul_operand_reason(node: gs.Node) -> str | None:
    if len(node.inputs) < 2 or const_value(node.inputs[1]) is None:
        return f"the weights of {node.name} are not a constant initializer"
    if const_value(node.inputs[1]).ndim != 2:
        return f"the weights of {node.name} are not a matrix"
    if node.op == "Gemm" and len(node.inputs) > 2 and node.inputs[2] is not None and node.inputs[2].name \
            and const_value(node.inputs[2]) is None:
        return f"the bias of {node.name} is not a constant initializer"
    shape = static_shape(node.inputs[0])
    if shape is None or static_shape(node.outputs[0]) is None:
        return f"the shapes around {node.name} are not known"
    if len(shape) < 2:
        return f"the input of {node.name} is a vector"
    return None


def gemm_weight_bias(node: gs.Node) -> tuple[np.ndarray, np.ndarray]:
    """(α·op(B) as [K, N], β·C broadcast to [rows, N]) of a Gemm."""
    b = const_value(node.inputs[1])
    if int(node.attrs.get("transB", 0)):
        b = b.T
    w = (b * np.asarray(node.attrs.get("alpha", 1.0), dtype=b.dtype)).astype(b.dtype)
    m, n = static_shape(node.outputs[0])
    if len(node.inputs) > 2 and node.inputs[2] is not None and node.inputs[2].name:
        c = const_value(node.inputs[2]) * np.asarray(node.attrs.get("beta", 1.0), dtype=b.dtype)
        rows = 1 if c.ndim < 2 or c.shape[0] == 1 else m
        c = np.broadcast_to(c, (rows, n)).astype(b.dtype)
    else:
        c = np.zeros((1, n), dtype=b.dtype)
    return np.ascontiguousarray(w), c


def _kind(node: gs.Node) -> str:
    return "MatMul" if node.op == "MatMul" else f"Gemm(transA={int(node.attrs.get('transA', 0))})"


class MergeParallelMatMul(Rule):
    name = "merge_parallel_matmul"
    enabling = True  # the Split it leaves pays once the activations move before it

    def match(self, graph: gs.Graph) -> list[Site]:
        sites = []
        for t in graph.tensors().values():
            kinds: dict[str, list[gs.Node]] = {}
            for n in t.outputs:
                if n.op in ("MatMul", "Gemm") and n.inputs and n.inputs[0] is t:
                    kinds.setdefault(_kind(n), []).append(n)
            for members in kinds.values():
                if len(members) >= 2:
                    sites.append(Site(self.name, tuple(sorted(m.name for m in members))))
        return sites

    def check(self, graph: gs.Graph, site: Site) -> str | None:
        nodes = site_nodes(graph, site)
        if nodes is None or len(nodes) < 2:
            return "the nodes are gone"
        x = nodes[0].inputs[0]
        kind = _kind(nodes[0])
        for n in nodes:
            if n.inputs[0] is not x or _kind(n) != kind:
                return f"{n.name} is not a {kind} of {x.name}"
            reason = matmul_operand_reason(n)
            if reason:
                return reason
        if kind == "MatMul":
            ks = {const_value(n.inputs[1]).shape[0] for n in nodes}
        else:
            ks = {gemm_weight_bias(n)[0].shape[0] for n in nodes}
        if len(ks) != 1:
            return f"the weights of {', '.join(site.nodes)} have different inner sizes {sorted(ks)}"
        if len({static_shape(n.outputs[0])[:-1] for n in nodes}) != 1:
            return f"the outputs of {', '.join(site.nodes)} differ in their leading dimensions"
        if not same_dtype(x, *(n.inputs[1] for n in nodes)):
            return "the inputs and weights differ in dtype"
        return None

    def rewrite(self, graph: gs.Graph, site: Site) -> None:
        nodes = site_nodes(graph, site)
        namer = Namer(graph)
        x = nodes[0].inputs[0]
        base = f"{nodes[0].name}_merged"
        oshape = list(static_shape(nodes[0].outputs[0]))
        widths = [static_shape(n.outputs[0])[-1] for n in nodes]
        oshape[-1] = sum(widths)
        dtype = nodes[0].outputs[0].dtype
        if nodes[0].op == "MatMul":
            mats = [const_value(n.inputs[1]) for n in nodes]
            w = gs.Constant(namer(f"{base}_W"), shared_array(("concat", 1), mats, lambda: np.concatenate(mats, axis=1)))
            y = gs.Variable(namer(f"{base}_out"), dtype=dtype, shape=oshape)
            graph.nodes.append(gs.Node("MatMul", name=namer(base), inputs=[x, w], outputs=[y]))
            biases = [matmul_bias(graph, n) for n in nodes]
            outputs = []
            for n, bias in zip(nodes, biases):
                if bias is not None:
                    outputs.append(bias[0].outputs[0])
                    detach(bias[0])
                else:
                    outputs.append(n.outputs[0])
            if any(b is not None for b in biases):
                vec = np.concatenate([b[1] if b is not None else np.zeros(wd, dtype=w.values.dtype)
                                      for b, wd in zip(biases, widths)]).astype(w.values.dtype)
                biased = gs.Variable(namer(f"{base}_biased"), dtype=dtype, shape=oshape)
                graph.nodes.append(gs.Node("Add", name=namer(f"{base}_bias"),
                                           inputs=[y, gs.Constant(namer(f"{base}_B"), vec)], outputs=[biased]))
                y = biased
        else:
            parts = [gemm_weight_bias(n) for n in nodes]
            rows = max(c.shape[0] for _, c in parts)
            w = np.concatenate([p[0] for p in parts], axis=1)
            c = np.concatenate([np.broadcast_to(p[1], (rows, p[1].shape[1])) for p in parts], axis=1)
            if rows == 1:
                c = c.reshape(-1)
            y = gs.Variable(namer(f"{base}_out"), dtype=dtype, shape=oshape)
            attrs = {"transA": int(nodes[0].attrs.get("transA", 0))}
            graph.nodes.append(gs.Node("Gemm", name=namer(base), attrs=attrs,
                                       inputs=[x, gs.Constant(namer(f"{base}_W"), w), gs.Constant(namer(f"{base}_C"), c)],
                                       outputs=[y]))
            outputs = [n.outputs[0] for n in nodes]
        for n in nodes:
            detach(n)
        make_split(graph, namer(f"{base}_split"), y, len(oshape) - 1, widths, outputs, namer)
