"""Merge parallel Convs that read the same tensor into one Conv followed by a Split (TASO's conv merging).

For Convs with one input x and identical kernel size, strides, pads, dilations and group = 1:

    Conv(x, W_i, B_i) = Split_i( Conv(x, [W_1; …; W_n], [B_1; …; B_n]) )      (concatenation along output channels)

because each output channel of a Conv depends only on its own filter and bias.  A missing bias is a zero bias.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from .base import (Namer, Rule, Site, attr_difference, shared_array, const_value, conv_attrs, detach, make_split, same_dtype,
                   site_nodes, static_shape)


def conv_reason(node: gs.Node) -> str | None:
    """None when ``node`` is a Conv this family can merge: constant weights (and bias), static shapes, group 1."""
    if len(node.inputs) < 2 or const_value(node.inputs[1]) is None:
        return f"the weights of {node.name} are not a constant initializer"
    if len(node.inputs) > 2 and node.inputs[2] is not None and node.inputs[2].name and const_value(node.inputs[2]) is None:
        return f"the bias of {node.name} is not a constant initializer"
    if static_shape(node.outputs[0]) is None or static_shape(node.inputs[0]) is None:
        return f"the shapes around {node.name} are not known"
    if int(node.attrs.get("group", 1)) != 1:
        return f"{node.name} is a grouped Conv (group {node.attrs.get('group')})"
    if node.attrs.get("auto_pad", "NOTSET") not in ("NOTSET", "VALID"):
        return f"{node.name} uses auto_pad={node.attrs.get('auto_pad')}"
    return None


def conv_bias(node: gs.Node) -> np.ndarray:
    w = const_value(node.inputs[1])
    if len(node.inputs) > 2 and node.inputs[2] is not None and node.inputs[2].name:
        return const_value(node.inputs[2])
    return np.zeros(w.shape[0], dtype=w.dtype)


def conv_signature(node: gs.Node) -> dict:
    rank = len(static_shape(node.inputs[1]) or (0, 0, 1, 1)) - 2
    return conv_attrs(node, rank)


class MergeParallelConv(Rule):
    name = "merge_parallel_conv"
    enabling = True  # the Split it leaves pays once the activations move before it

    def match(self, graph: gs.Graph) -> list[Site]:
        sites = []
        for t in graph.tensors().values():
            convs = sorted((n for n in t.outputs if n.op == "Conv" and n.inputs and n.inputs[0] is t), key=lambda n: n.name)
            if len(convs) < 2:
                continue
            # one site per class of identical attributes; Convs alone in their class form one site with the first
            # Conv of another class, so that the report says which attribute kept them apart
            classes: dict[str, list[gs.Node]] = {}
            for n in convs:
                key = repr(conv_signature(n)) + repr((static_shape(n.inputs[1]) or ())[1:])
                classes.setdefault(key, []).append(n)
            lonely = []
            for members in classes.values():
                if len(members) >= 2:
                    sites.append(Site(self.name, tuple(m.name for m in members)))
                else:
                    lonely.append(members[0])
            if len(lonely) >= 2 and len(classes) == len(lonely):
                sites.append(Site(self.name, (lonely[0].name, lonely[1].name)))
        return sites

    def check(self, graph: gs.Graph, site: Site) -> str | None:
        nodes = site_nodes(graph, site)
        if nodes is None or len(nodes) < 2:
            return "the nodes are gone"
        x = nodes[0].inputs[0]
        for n in nodes:
            if n.op != "Conv" or n.inputs[0] is not x:
                return f"{n.name} does not read {x.name}"
            reason = conv_reason(n)
            if reason:
                return reason
        first = nodes[0]
        for n in nodes[1:]:
            diff = attr_difference(conv_signature(first), conv_signature(n), first.name, n.name)
            if diff:
                return diff
            if static_shape(n.inputs[1])[1:] != static_shape(first.inputs[1])[1:]:
                return f"{first.name} and {n.name} have weights of different shapes"
            if static_shape(n.outputs[0])[2:] != static_shape(first.outputs[0])[2:]:
                return f"{first.name} and {n.name} have outputs of different spatial size"
        if not same_dtype(*(n.inputs[1] for n in nodes), *(n.outputs[0] for n in nodes)):
            return "the Convs have different dtypes"
        return None

    def rewrite(self, graph: gs.Graph, site: Site) -> None:
        nodes = site_nodes(graph, site)
        namer = Namer(graph)
        x = nodes[0].inputs[0]
        weights = [const_value(n.inputs[1]) for n in nodes]
        biases = [conv_bias(n).astype(weights[0].dtype) for n in nodes]
        base = f"{nodes[0].name}_merged"
        w = gs.Constant(namer(f"{base}_W"), shared_array(("concat", 0), weights, lambda: np.concatenate(weights, axis=0)))
        b = gs.Constant(namer(f"{base}_B"), np.concatenate(biases, axis=0))
        oshape = list(static_shape(nodes[0].outputs[0]))
        oshape[1] = int(sum(wi.shape[0] for wi in weights))
        y = gs.Variable(namer(f"{base}_out"), dtype=nodes[0].outputs[0].dtype, shape=oshape)
        attrs = {k: v for k, v in conv_signature(nodes[0]).items() if v is not None}
        graph.nodes.append(gs.Node("Conv", name=namer(base), attrs=attrs, inputs=[x, w, b], outputs=[y]))
        outputs = [n.outputs[0] for n in nodes]
        for n in nodes:
            detach(n)
        make_split(graph, namer(f"{base}_split"), y, 1, [wi.shape[0] for wi in weights], outputs, namer)
