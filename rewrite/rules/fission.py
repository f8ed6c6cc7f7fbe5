"""Fission: split one Conv, MatMul or Gemm along its output channels into independent ones (for two streams).

The reverse of the merges: output channel j depends only on filter (or weight column) j and bias j, so

    Conv(x, W, B) = Concat( Conv(x, W[:m], B[:m]), Conv(x, W[m:], B[m:]) )        along the channel axis
    x·W + b       = Concat( x·W[:, :m] + b[:m], x·W[:, m:] + b[m:] )             along the last axis

Where the output's only reader is a Split along that axis, the pieces are the Split's pieces and the Split
goes away (the exact inverse of a merge); where it is a Concat along that axis, the pieces go straight into
it; otherwise a Concat joins them.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from .base import Namer, Rule, Site, const_value, contiguous, detach, is_graph_output, site_nodes, split_sizes, static_shape
from .merge_parallel_conv import conv_reason, conv_bias, conv_signature


def _out_axis(node: gs.Node) -> int:
    return 1 if node.op == "Conv" else len(static_shape(node.outputs[0])) - 1


def _reader(graph: gs.Graph, node: gs.Node, op: str) -> gs.Node | None:
    """The only reader of ``node``'s output when it is an ``op`` along the output-channel axis."""
    out = node.outputs[0]
    if is_graph_output(graph, out) or len(out.outputs) != 1:
        return None
    reader = out.outputs[0]
    if reader.op != op or static_shape(out) is None:
        return None
    rank = len(static_shape(out))
    if int(reader.attrs.get("axis", 0)) % rank != _out_axis(node):
        return None
    if op == "Split" and (reader.inputs[0] is not out or split_sizes(reader) is None):
        return None
    if op == "Concat" and sum(t is out for t in reader.inputs) != 1:
        return None
    return reader


def _slice(node: gs.Node, lo: int, hi: int) -> list[np.ndarray | None]:
    """The constant operands (weights, bias) of the part of ``node`` that computes output channels lo:hi."""
    w = const_value(node.inputs[1])
    if node.op == "Conv":
        return [w[lo:hi], conv_bias(node)[lo:hi]]
    if node.op == "MatMul":
        return [w[:, lo:hi]]
    w_part = w[lo:hi] if int(node.attrs.get("transB", 0)) else w[:, lo:hi]
    if len(node.inputs) > 2 and node.inputs[2] is not None and node.inputs[2].name:
        c = const_value(node.inputs[2])
        n = static_shape(node.outputs[0])[1]
        c_part = c[..., lo:hi] if c.ndim >= 1 and c.shape[-1] == n else c
        return [w_part, c_part]
    return [w_part]


class Fission(Rule):
    name = "fission"

    def __init__(self, min_channels: int = 64):
        # halving small ops only adds kernels; Split-inverse sites are always offered
        self.min_channels = min_channels

    def _reason(self, node: gs.Node) -> str | None:
        if node.op == "Conv":
            return conv_reason(node)
        if len(node.inputs) < 2 or const_value(node.inputs[1]) is None or const_value(node.inputs[1]).ndim != 2:
            return f"the weights of {node.name} are not a constant matrix"
        if node.op == "Gemm" and len(node.inputs) > 2 and node.inputs[2] is not None and node.inputs[2].name \
                and const_value(node.inputs[2]) is None:
            return f"the bias of {node.name} is not a constant initializer"
        if static_shape(node.outputs[0]) is None or static_shape(node.inputs[0]) is None:
            return f"the shapes around {node.name} are not known"
        return None

    def match(self, graph: gs.Graph) -> list[Site]:
        sites = []
        for n in graph.nodes:
            if n.op not in ("Conv", "MatMul", "Gemm") or len(n.inputs) < 2 or not isinstance(n.inputs[1], gs.Constant):
                continue
            shape = static_shape(n.outputs[0])
            if shape is None:
                continue
            if _reader(graph, n, "Split") is not None:
                sites.append(Site(self.name, (n.name,), ("split",)))
            elif shape[_out_axis(n)] >= max(self.min_channels, 2):
                sites.append(Site(self.name, (n.name,), ("halves",)))
        return sites

    def check(self, graph: gs.Graph, site: Site) -> str | None:
        nodes = site_nodes(graph, site)
        if nodes is None:
            return "the nodes are gone"
        (node,) = nodes
        reason = self._reason(node)
        if reason:
            return reason
        if site.detail == ("split",):
            reader = _reader(graph, node, "Split")
            if reader is None:
                return f"{node.name} is no longer read by a Split alone"
            if sum(split_sizes(reader)) != static_shape(node.outputs[0])[_out_axis(node)]:
                return f"the Split after {node.name} does not cover its channels"
        elif static_shape(node.outputs[0])[_out_axis(node)] < 2:
            return f"{node.name} has a single output channel"
        return None

    def rewrite(self, graph: gs.Graph, site: Site) -> None:
        (node,) = site_nodes(graph, site)
        namer = Namer(graph)
        out = node.outputs[0]
        shape = list(static_shape(out))
        axis = _out_axis(node)
        if site.detail == ("split",):
            split = _reader(graph, node, "Split")
            sizes, outputs = split_sizes(split), list(split.outputs)
            detach(split)
        else:
            half = shape[axis] // 2
            sizes = [half, shape[axis] - half]
            outputs = []
            for i, size in enumerate(sizes):
                part_shape = list(shape)
                part_shape[axis] = size
                outputs.append(gs.Variable(namer(f"{out.name}_part{i}"), dtype=out.dtype, shape=part_shape))
        lo = 0
        for i, (size, part_out) in enumerate(zip(sizes, outputs)):
            consts = [gs.Constant(namer(f"{node.name}_part{i}_{k}"), contiguous(v))
                      for k, v in enumerate(_slice(node, lo, lo + size))]
            attrs = dict(node.attrs)
            if node.op == "Conv":
                attrs = {k: v for k, v in conv_signature(node).items() if v is not None}
            graph.nodes.append(gs.Node(node.op, name=namer(f"{node.name}_part{i}"), attrs=attrs,
                                       inputs=[node.inputs[0], *consts], outputs=[part_out]))
            lo += size
        if site.detail != ("split",):
            concat = _reader(graph, node, "Concat")
            if concat is not None:
                k = next(i for i, t in enumerate(concat.inputs) if t is out)
                ins = list(concat.inputs)
                concat.inputs.clear()
                concat.inputs.extend(ins[:k] + outputs + ins[k + 1:])
            else:
                node.outputs.clear()
                graph.nodes.append(gs.Node("Concat", name=namer(f"{node.name}_join"), attrs={"axis": axis},
                                           inputs=outputs, outputs=[out]))
        detach(node)
