"""Split/Concat algebra.

Along one axis, with x cut into pieces x₁ … xₙ and f an elementwise function (an activation, or a binary
op with a scalar constant, which is the same function at every element):

    Concat(Split(x))          = x                              (``split_concat``)
    Split(Concat(x₁ … xₙ))   = (x₁ … xₙ)     when the sizes agree (``concat_split``)
    Concat(f(x₁) … f(xₙ))    = f(Concat(x₁ … xₙ))              (``hoist_pointwise_concat``: n kernels → 1)
    f(Concat(x₁ … xₙ))       = Concat(f(x₁) … f(xₙ))           (``sink_pointwise_concat``: f can fuse into the producers)
    (f(Split(x)₁) … f(Split(x)ₙ)) = Split(f(x))                (``hoist_pointwise_split``)
"""

from __future__ import annotations

import onnx_graphsurgeon as gs

from .base import (Namer, Rule, Site, const_value, detach, is_graph_output, make_split, private_output, replace_tensor,
                   site_nodes, split_sizes, static_shape)

UNARY = frozenset({"Relu", "Sigmoid", "Tanh", "LeakyRelu", "Elu", "Selu", "Celu", "HardSigmoid", "HardSwish", "Softplus",
                   "Softsign", "Exp", "Log", "Abs", "Neg", "Sqrt", "Reciprocal", "Erf", "Gelu", "Clip", "Sin", "Cos",
                   "Floor", "Ceil", "Round", "Sign", "Mish", "ThresholdedRelu", "Not", "Cast"})
BINARY = frozenset({"Add", "Sub", "Mul", "Div", "Pow", "Max", "Min"})


def pointwise_signature(node: gs.Node) -> tuple | None:
    """What makes two elementwise nodes the same function: op, attributes, the position of the one variable
    operand and the values of the constant ones (scalars only); None when ``node`` is not such a node."""
    if node.op not in UNARY and node.op not in BINARY:
        return None
    if len(node.outputs) != 1:
        return None
    variables = [i for i, t in enumerate(node.inputs) if t is not None and t.name and const_value(t) is None]
    if len(variables) != 1:
        return None
    consts = []
    for i, t in enumerate(node.inputs):
        if i == variables[0] or t is None or not t.name:
            consts.append(None)
            continue
        v = const_value(t)
        if v.size != 1 or v.ndim > 1:
            return None  # a constant that broadcasts along an axis is not the same function everywhere
        consts.append((str(v.dtype), tuple(v.reshape(-1).tolist())))
    if node.op in BINARY and all(c is None for c in consts):
        return None
    return node.op, repr(sorted(node.attrs.items())), variables[0], tuple(consts)


def _data_input(node: gs.Node) -> gs.Tensor:
    return node.inputs[pointwise_signature(node)[2]]


def _axis(node: gs.Node, rank: int) -> int:
    return int(node.attrs.get("axis", 0)) % rank


def _clone_pointwise(graph: gs.Graph, like: gs.Node, data: gs.Tensor, out: gs.Tensor, name: str, k: int) -> None:
    """A copy of the elementwise node ``like`` (variable operand at position ``k``) computing ``out`` from ``data``."""
    inputs = [data if i == k else t for i, t in enumerate(like.inputs)]
    graph.nodes.append(gs.Node(like.op, name=name, attrs=dict(like.attrs), inputs=inputs, outputs=[out], domain=like.domain))


class SplitConcat(Rule):
    """Concat(Split(x)) = x: a Split whose every piece goes, in order and only, into one Concat on the same axis."""

    name = "split_concat"
    simplifying = True

    def match(self, graph: gs.Graph) -> list[Site]:
        sites = []
        for split in graph.nodes:
            if split.op != "Split" or not split.outputs:
                continue
            readers = {id(r): r for o in split.outputs for r in o.outputs}
            for r in readers.values():
                if r.op == "Concat":
                    sites.append(Site(self.name, (split.name, r.name)))
        return sites

    def _run_start(self, split: gs.Node, concat: gs.Node) -> int | None:
        ins, outs = list(concat.inputs), list(split.outputs)
        for k in range(len(ins) - len(outs) + 1):
            if all(ins[k + i] is o for i, o in enumerate(outs)):
                return k
        return None

    def check(self, graph: gs.Graph, site: Site) -> str | None:
        nodes = site_nodes(graph, site)
        if nodes is None:
            return "the nodes are gone"
        split, concat = nodes
        shape = static_shape(split.inputs[0])
        if shape is None:
            return f"the input shape of {split.name} is not known"
        if _axis(split, len(shape)) != _axis(concat, len(shape)):
            return f"{split.name} and {concat.name} work on different axes"
        for o in split.outputs:
            if is_graph_output(graph, o):
                return f"{o.name} is a graph output"
            if len(o.outputs) != 1 or o.outputs[0] is not concat:
                return f"{o.name} is also read by another node"
        if self._run_start(split, concat) is None:
            return f"{concat.name} does not take the pieces of {split.name} in order"
        return None

    def rewrite(self, graph: gs.Graph, site: Site) -> None:
        split, concat = site_nodes(graph, site)
        x = split.inputs[0]
        k = self._run_start(split, concat)
        ins = list(concat.inputs)
        ins[k:k + len(split.outputs)] = [x]
        detach(split)
        if len(ins) == 1 and not is_graph_output(graph, concat.outputs[0]):
            out = concat.outputs[0]
            detach(concat)
            replace_tensor(graph, out, x)
        else:
            concat.inputs.clear()
            concat.inputs.extend(ins)


class ConcatSplit(Rule):
    """Split(Concat(x₁ … xₙ)) = (x₁ … xₙ) when the Split cuts exactly where the Concat joined."""

    name = "concat_split"
    simplifying = True

    def match(self, graph: gs.Graph) -> list[Site]:
        sites = []
        for split in graph.nodes:
            if split.op != "Split" or not split.inputs:
                continue
            src = split.inputs[0]
            if isinstance(src, gs.Variable) and len(src.inputs) == 1 and src.inputs[0].op == "Concat":
                sites.append(Site(self.name, (src.inputs[0].name, split.name)))
        return sites

    def check(self, graph: gs.Graph, site: Site) -> str | None:
        nodes = site_nodes(graph, site)
        if nodes is None:
            return "the nodes are gone"
        concat, split = nodes
        reason = private_output(graph, concat, split)
        if reason:
            return reason
        shape = static_shape(concat.outputs[0])
        if shape is None or any(static_shape(t) is None for t in concat.inputs):
            return f"the shapes around {concat.name} are not known"
        axis = _axis(concat, len(shape))
        if _axis(split, len(shape)) != axis:
            return f"{concat.name} and {split.name} work on different axes"
        sizes = split_sizes(split)
        joined = [static_shape(t)[axis] for t in concat.inputs]
        if sizes != joined:
            return f"{split.name} cuts {sizes}, {concat.name} joined {joined}"
        for o, t in zip(split.outputs, concat.inputs):
            if is_graph_output(graph, o):
                return f"{o.name} is a graph output"
        return None

    def rewrite(self, graph: gs.Graph, site: Site) -> None:
        concat, split = site_nodes(graph, site)
        pairs = list(zip(split.outputs, concat.inputs))
        detach(concat, split)
        for piece, source in pairs:
            replace_tensor(graph, piece, source)


class HoistPointwiseConcat(Rule):
    """Concat(f(x₁) … f(xₙ)) → f(Concat(x₁ … xₙ))."""

    name = "hoist_pointwise_concat"

    def match(self, graph: gs.Graph) -> list[Site]:
        sites = []
        for concat in graph.nodes:
            if concat.op != "Concat" or len(concat.inputs) < 2:
                continue
            producers = [t.inputs[0] if isinstance(t, gs.Variable) and len(t.inputs) == 1 else None for t in concat.inputs]
            if all(p is not None and pointwise_signature(p) is not None for p in producers):
                sites.append(Site(self.name, (concat.name,)))
        return sites

    def check(self, graph: gs.Graph, site: Site) -> str | None:
        nodes = site_nodes(graph, site)
        if nodes is None:
            return "the nodes are gone"
        (concat,) = nodes
        producers = [t.inputs[0] if isinstance(t, gs.Variable) and len(t.inputs) == 1 else None for t in concat.inputs]
        if any(p is None for p in producers):
            return f"an input of {concat.name} has no producer"
        if len({id(p) for p in producers}) != len(producers):
            return f"{concat.name} reads one tensor twice"
        sigs = {pointwise_signature(p) for p in producers}
        if None in sigs or len(sigs) != 1:
            return f"the inputs of {concat.name} are not all the same elementwise function"
        for p in producers:
            reason = private_output(graph, p, concat)
            if reason:
                return reason
            if static_shape(_data_input(p)) != static_shape(p.outputs[0]):
                return f"{p.name} broadcasts its input"
        if static_shape(concat.outputs[0]) is None:
            return f"the output shape of {concat.name} is not known"
        return None

    def rewrite(self, graph: gs.Graph, site: Site) -> None:
        (concat,) = site_nodes(graph, site)
        namer = Namer(graph)
        producers = [t.inputs[0] for t in concat.inputs]
        like = producers[0]
        k = pointwise_signature(like)[2]
        data = [p.inputs[k] for p in producers]
        out = concat.outputs[0]
        joined = gs.Variable(namer(f"{concat.name}_pre"), dtype=data[0].dtype, shape=list(static_shape(out)))
        for p in producers:
            p.outputs.clear()
        concat.inputs.clear()
        concat.inputs.extend(data)
        concat.outputs.clear()
        concat.outputs.append(joined)
        _clone_pointwise(graph, like, joined, out, namer(f"{like.name}_hoisted"), k)
        for p in producers:
            p.inputs.clear()


class SinkPointwiseConcat(Rule):
    """f(Concat(x₁ … xₙ)) → Concat(f(x₁) … f(xₙ)): f can then fuse into each xᵢ's producer."""

    name = "sink_pointwise_concat"

    def match(self, graph: gs.Graph) -> list[Site]:
        sites = []
        for f in graph.nodes:
            if pointwise_signature(f) is None:
                continue
            src = _data_input(f)
            if isinstance(src, gs.Variable) and len(src.inputs) == 1 and src.inputs[0].op == "Concat":
                sites.append(Site(self.name, (src.inputs[0].name, f.name)))
        return sites

    def check(self, graph: gs.Graph, site: Site) -> str | None:
        nodes = site_nodes(graph, site)
        if nodes is None:
            return "the nodes are gone"
        concat, f = nodes
        reason = private_output(graph, concat, f)
        if reason:
            return reason
        if any(static_shape(t) is None for t in concat.inputs) or static_shape(f.outputs[0]) != static_shape(concat.outputs[0]):
            return f"the shapes around {concat.name} are not known or {f.name} broadcasts"
        return None

    def rewrite(self, graph: gs.Graph, site: Site) -> None:
        concat, f = site_nodes(graph, site)
        namer = Namer(graph)
        out = f.outputs[0]
        pieces = []
        k = pointwise_signature(f)[2]
        for i, t in enumerate(list(concat.inputs)):
            piece = gs.Variable(namer(f"{f.name}_{i}_out"), dtype=out.dtype, shape=list(static_shape(t)))
            _clone_pointwise(graph, f, t, piece, namer(f"{f.name}_{i}"), k)
            pieces.append(piece)
        detach(f)
        concat.inputs.clear()
        concat.inputs.extend(pieces)
        concat.outputs.clear()
        concat.outputs.append(out)


class HoistPointwiseSplit(Rule):
    """(f(Split(x)₁) … f(Split(x)ₙ)) → Split(f(x)): one kernel instead of n, and f can fuse into x's producer."""

    name = "hoist_pointwise_split"

    def match(self, graph: gs.Graph) -> list[Site]:
        sites = []
        for split in graph.nodes:
            if split.op != "Split" or not split.outputs:
                continue
            readers = [o.outputs[0] if len(o.outputs) == 1 else None for o in split.outputs]
            if all(r is not None and pointwise_signature(r) is not None for r in readers):
                sites.append(Site(self.name, (split.name,)))
        return sites

    def check(self, graph: gs.Graph, site: Site) -> str | None:
        nodes = site_nodes(graph, site)
        if nodes is None:
            return "the nodes are gone"
        (split,) = nodes
        if static_shape(split.inputs[0]) is None or split_sizes(split) is None:
            return f"the shapes around {split.name} are not known"
        readers = []
        for o in split.outputs:
            if is_graph_output(graph, o):
                return f"{o.name} is a graph output"
            if len(o.outputs) != 1:
                return f"{o.name} is read by {len(o.outputs)} nodes"
            r = o.outputs[0]
            if pointwise_signature(r) is None or _data_input(r) is not o:
                return f"{r.name} is not an elementwise function of {o.name}"
            if static_shape(r.outputs[0]) != static_shape(o):
                return f"{r.name} broadcasts its input"
            readers.append(r)
        if len({pointwise_signature(r) for r in readers}) != 1:
            return f"the readers of {split.name} are not all the same elementwise function"
        return None

    def rewrite(self, graph: gs.Graph, site: Site) -> None:
        (split,) = site_nodes(graph, site)
        namer = Namer(graph)
        x = split.inputs[0]
        readers = [o.outputs[0] for o in split.outputs]
        like = readers[0]
        outs = [r.outputs[0] for r in readers]
        fx = gs.Variable(namer(f"{split.name}_pre"), dtype=outs[0].dtype, shape=list(static_shape(x)))
        _clone_pointwise(graph, like, x, fx, namer(f"{like.name}_hoisted"), pointwise_signature(like)[2])
        sizes = split_sizes(split)
        axis = int(split.attrs.get("axis", 0))
        detach(split, *readers)
        make_split(graph, namer(f"{split.name}_after"), fx, axis, sizes, outs, namer)

