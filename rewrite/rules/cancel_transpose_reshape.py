"""Cancel Transpose and Reshape pairs that undo each other (and fuse those that do not).

Transposes compose by their permutations, and views (Reshape, Flatten, Squeeze, Unsqueeze) by their
final shape, since neither moves an element relative to the row-major order of its input:

    Transpose(Transpose(x, p₁), p₂) = Transpose(x, p)   with p[i] = p₁[p₂[i]];   = x when p is the identity
    View(View(x, s₁), s₂)           = Reshape(x, s₂);                           = x when s₂ = shape(x)
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from .base import Namer, Rule, Site, detach, is_graph_output, private_output, replace_tensor, site_nodes, static_shape

VIEWS = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze"})


def _perm(node: gs.Node) -> list[int] | None:
    rank = len(static_shape(node.inputs[0]) or ())
    perm = node.attrs.get("perm")
    if perm is None:
        return list(reversed(range(rank))) if rank else None
    return [int(p) for p in perm]


def _collapse(graph: gs.Graph, first: gs.Node, second: gs.Node, replacement) -> None:
    """``first``→``second`` becomes ``replacement(x, out)`` (a node), or nothing when it returns None: x then
    stands for the result."""
    x, out = first.inputs[0], second.outputs[0]
    detach(first, second)
    node = replacement(x, out)
    if node is None:
        replace_tensor(graph, out, x)
    else:
        graph.nodes.append(node)


def _pair_reason(graph: gs.Graph, site: Site, ops: frozenset) -> tuple[gs.Node, gs.Node] | str:
    nodes = site_nodes(graph, site)
    if nodes is None:
        return "the nodes are gone"
    first, second = nodes
    if first.op not in ops or second.op not in ops or second.inputs[0] is not first.outputs[0]:
        return f"{second.name} does not read {first.name}"
    reason = private_output(graph, first, second)
    if reason:
        return reason
    if static_shape(first.inputs[0]) is None or static_shape(second.outputs[0]) is None:
        return f"the shapes around {first.name} and {second.name} are not known"
    return first, second


def _pairs(graph: gs.Graph, name: str, ops: frozenset) -> list[Site]:
    sites = []
    for second in graph.nodes:
        if second.op in ops and second.inputs:
            src = second.inputs[0]
            if isinstance(src, gs.Variable) and len(src.inputs) == 1 and src.inputs[0].op in ops:
                sites.append(Site(name, (src.inputs[0].name, second.name)))
    return sites


class CancelTransposePair(Rule):
    name = "cancel_transpose"
    simplifying = True

    def match(self, graph: gs.Graph) -> list[Site]:
        return _pairs(graph, self.name, frozenset({"Transpose"}))

    def check(self, graph: gs.Graph, site: Site) -> str | None:
        got = _pair_reason(graph, site, frozenset({"Transpose"}))
        if isinstance(got, str):
            return got
        first, second = got
        p1, p2 = _perm(first), _perm(second)
        if p1 is None or p2 is None or len(p1) != len(p2):
            return f"the permutations of {first.name} and {second.name} are not known"
        composed = [p1[i] for i in p2]
        if composed == list(range(len(composed))) and is_graph_output(graph, second.outputs[0]):
            return f"{second.outputs[0].name} is a graph output"
        return None

    def rewrite(self, graph: gs.Graph, site: Site) -> None:
        first, second = site_nodes(graph, site)
        composed = [_perm(first)[i] for i in _perm(second)]
        name = Namer(graph)(f"{first.name}_{second.name}")
        if composed == list(range(len(composed))):
            _collapse(graph, first, second, lambda x, out: None)
        else:
            _collapse(graph, first, second,
                      lambda x, out: gs.Node("Transpose", name=name, attrs={"perm": composed}, inputs=[x], outputs=[out]))


class CancelReshapePair(Rule):
    name = "cancel_reshape"
    simplifying = True

    def match(self, graph: gs.Graph) -> list[Site]:
        return _pairs(graph, self.name, VIEWS)

    def check(self, graph: gs.Graph, site: Site) -> str | None:
        got = _pair_reason(graph, site, VIEWS)
        if isinstance(got, str):
            return got
        first, second = got
        if static_shape(first.inputs[0]) == static_shape(second.outputs[0]) and is_graph_output(graph, second.outputs[0]):
            return f"{second.outputs[0].name} is a graph output"
        return None

    def rewrite(self, graph: gs.Graph, site: Site) -> None:
        first, second = site_nodes(graph, site)
        namer = Namer(graph)
        target = static_shape(second.outputs[0])
        if static_shape(first.inputs[0]) == target:
            _collapse(graph, first, second, lambda x, out: None)
            return
        shape = gs.Constant(namer(f"{second.name}_shape"), np.asarray(target, dtype=np.int64))
        name = namer(f"{first.name}_{second.name}")
        _collapse(graph, first, second, lambda x, out: gs.Node("Reshape", name=name, inputs=[x, shape], outputs=[out]))


class DropNoOpView(Rule):
    """A Reshape/Flatten/Squeeze/Unsqueeze whose output has its input's shape, or a Transpose by the identity."""

    name = "drop_noop_view"
    simplifying = True

    def match(self, graph: gs.Graph) -> list[Site]:
        sites = []
        for n in graph.nodes:
            if n.op in VIEWS or n.op == "Transpose":
                shape_in, shape_out = static_shape(n.inputs[0]), static_shape(n.outputs[0])
                if shape_in is not None and shape_in == shape_out:
                    sites.append(Site(self.name, (n.name,)))
        return sites

    def check(self, graph: gs.Graph, site: Site) -> str | None:
        nodes = site_nodes(graph, site)
        if nodes is None:
            return "the nodes are gone"
        (n,) = nodes
        if static_shape(n.inputs[0]) is None or static_shape(n.inputs[0]) != static_shape(n.outputs[0]):
            return f"{n.name} changes the shape"
        if n.op == "Transpose" and _perm(n) != list(range(len(static_shape(n.inputs[0])))):
            return f"{n.name} permutes axes of equal size"
        if is_graph_output(graph, n.outputs[0]):
            return f"{n.outputs[0].name} is a graph output"
        return None

    def rewrite(self, graph: gs.Graph, site: Site) -> None:
        (n,) = site_nodes(graph, site)
        x, out = n.inputs[0], n.outputs[0]
        detach(n)
        replace_tensor(graph, out, x)
