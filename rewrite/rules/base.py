"""The rule interface and the small graphsurgeon helpers that every rule family shares.

A rule has three parts (onnxscript's rewriter is the model):

* ``match(graph) -> list[Site]``  the *pattern*: every place it could apply, cheap and syntactic;
* ``check(graph, site) -> str | None``  ``None`` when the site is provably safe, else the *reason*
  (it goes into the search report, so a user sees why a rule did not fire);
* ``apply(graph, site) -> gs.Graph``  the *rewrite*, on a copy: the argument is never changed.

A :class:`Site` names its nodes, so the same site found again in another candidate has the same key.
Rules only ever see shape-inferred graphs whose nodes have unique names; they keep the names of
every tensor that leaves the nodes they replace, so downstream consumers and graph outputs are untouched.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from parastream.core.graph import conv_attrs, static_shape, unused_name  # noqa: F401 - the rules import them from here

from ..ir import cleanup, copy_graph, toposort


@dataclass(frozen=True)
class Site:
    """One place a rule could apply: the rule's name, the names of the nodes it rewrites, and rule-specific detail."""

    rule: str
    nodes: tuple[str, ...]
    detail: tuple = ()

    @property
    def key(self) -> str:
        extra = f"[{','.join(map(str, self.detail))}]" if self.detail else ""
        return f"{self.rule}:{'+'.join(self.nodes)}{extra}"


class Rule:
    """Base class: subclasses set ``name`` and implement ``match``, ``check`` and ``rewrite``.

    ``enabling`` marks rules that make a graph no faster by themselves but unlock another rule
    (kernel enlargement before a merge); the search looks past β for them.
    ``simplifying`` marks rules that only ever remove work (folding, cancelling): the search applies
    them greedily, wherever the cost model does not object, before it starts branching.
    ``backends`` names the engine backends whose engines run what the rule leaves (a fused node of parastream's
    own domain, which only they know); None: every backend (``rules_for`` picks a build's rules by it).
    """

    name: str = "rule"
    enabling: bool = False
    simplifying: bool = False
    backends: frozenset[str] | None = None

    def match(self, graph: gs.Graph) -> list[Site]:
        raise NotImplementedError

    def check(self, graph: gs.Graph, site: Site) -> str | None:
        raise NotImplementedError

    def rewrite(self, graph: gs.Graph, site: Site) -> None:
        """Edit ``graph`` (already a private copy) in place."""
        raise NotImplementedError

    def apply(self, graph: gs.Graph, site: Site) -> gs.Graph:
        """A rewritten copy of ``graph``; raises ``ValueError`` with the reason when the site is not safe."""
        reason = self.check(graph, site)
        if reason is not None:
            raise ValueError(f"{site.key}: {reason}")
        out = copy_graph(graph)
        self.rewrite(out, site)
        return toposort(cleanup(out))

    def sites(self, graph: gs.Graph) -> list[tuple[Site, str | None]]:
        """Every matched site with its check result (``None`` = safe)."""
        return [(s, self.check(graph, s)) for s in self.match(graph)]

    def __repr__(self) -> str:
        return f"<rule {self.name}>"


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def nodes_by_name(graph: gs.Graph) -> dict[str, gs.Node]:
    return {n.name: n for n in graph.nodes}


def anchored_sites(rule: str, graph: gs.Graph, ops: tuple[str, ...], find) -> list[Site]:
    """One site per node of an op in ``ops``: the nodes of the chain ``find(graph, node)`` recognised from it (an
    object with ``nodes``), or the anchor alone where ``find`` returned why not (a string), for ``check`` to say."""
    sites = []
    for node in graph.nodes:
        if node.op not in ops:
            continue
        got = find(graph, node)
        sites.append(Site(rule, (node.name,) if isinstance(got, str) else tuple(n.name for n in got.nodes)))
    return sites


def site_nodes(graph: gs.Graph, site: Site) -> list[gs.Node] | None:
    by = nodes_by_name(graph)
    try:
        return [by[n] for n in site.nodes]
    except KeyError:
        return None


def const_value(t: gs.Tensor | None) -> np.ndarray | None:
    """The value of a constant input (an initializer), else None."""
    if isinstance(t, gs.Constant):
        return np.asarray(t.values)
    return None


def is_graph_output(graph: gs.Graph, t: gs.Tensor) -> bool:
    return any(o is t for o in graph.outputs)




def private_output(graph: gs.Graph, node: gs.Node, consumer: gs.Node | None = None) -> str | None:
    """None when ``node`` has one output, read only by ``consumer`` (or by nothing else when None) and not a graph output."""
    if len(node.outputs) != 1:
        return f"{node.name} has {len(node.outputs)} outputs"
    out = node.outputs[0]
    if is_graph_output(graph, out):
        return f"{out.name} is a graph output"
    users = list(out.outputs)
    if consumer is not None and (len(users) != 1 or users[0] is not consumer):
        return f"{out.name} is also read by {', '.join(sorted(u.name for u in users if u is not consumer)) or 'nothing'}"
    return None


def same_dtype(*tensors: gs.Tensor) -> bool:
    dts = set()
    for t in tensors:
        dt = t.values.dtype if isinstance(t, gs.Constant) else t.dtype
        try:
            dts.add(np.dtype(dt))
        except TypeError:
            return False
    return len(dts) == 1


def taken_names(graph: gs.Graph) -> set[str]:
    """The names of ``graph``'s nodes and of its tensors (``graph.tensors()``'s keys: graph inputs and outputs and
    every node's named inputs and outputs), without building graphsurgeon's ordered tensor map: each rewrite of
    the search asks for them once."""
    taken = {n.name for n in graph.nodes}
    taken.update(t.name for t in graph.inputs if t.name)
    taken.update(t.name for t in graph.outputs if t.name)
    for n in graph.nodes:
        taken.update(t.name for t in n.inputs if t.name)
        taken.update(t.name for t in n.outputs if t.name)
    return taken


def fresh_name(graph: gs.Graph, base: str, taken: set[str] | None = None) -> str:
    """``base``, or ``base_1``, ``base_2`` … whichever no node or tensor of ``graph`` uses yet."""
    return unused_name(taken_names(graph) if taken is None else taken, base)


class Namer:
    """Fresh node and tensor names for one rewrite (one scan of the graph, then a set)."""

    def __init__(self, graph: gs.Graph):
        self.taken = taken_names(graph)
        self.graph = graph

    def __call__(self, base: str) -> str:
        return fresh_name(self.graph, base, self.taken)




def attr_difference(a: dict, b: dict, names_a: str, names_b: str) -> str | None:
    for k in sorted(set(a) | set(b)):
        if a.get(k) != b.get(k):
            return f"{names_a} and {names_b} differ in {k} ({a.get(k)} vs {b.get(k)})"
    return None


def make_split(graph: gs.Graph, name: str, x: gs.Tensor, axis: int, sizes: list[int], outputs: list[gs.Tensor],
               namer: Namer) -> gs.Node:
    """A Split node of ``x`` into ``sizes`` along ``axis``, in the form the graph's opset expects."""
    if (graph.opset or 13) >= 13:
        sizes_t = gs.Constant(namer(f"{name}_sizes"), np.asarray(sizes, dtype=np.int64))
        node = gs.Node("Split", name=name, attrs={"axis": axis}, inputs=[x, sizes_t], outputs=outputs)
    else:
        node = gs.Node("Split", name=name, attrs={"axis": axis, "split": list(sizes)}, inputs=[x], outputs=outputs)
    graph.nodes.append(node)
    return node


def split_sizes(node: gs.Node) -> list[int] | None:
    """The sizes a Split node cuts, whichever opset form it uses; None when not static."""
    shape = static_shape(node.inputs[0])
    axis = int(node.attrs.get("axis", 0))
    if len(node.inputs) > 1 and node.inputs[1] is not None and node.inputs[1].name:
        v = const_value(node.inputs[1])
        return [int(s) for s in v.reshape(-1)] if v is not None else None
    if "split" in node.attrs:
        return [int(s) for s in node.attrs["split"]]
    if shape is None:
        return None
    dim = shape[axis % len(shape)]
    n = len(node.outputs)
    if "num_outputs" in node.attrs:
        chunk = -(-dim // n)
        return [min(chunk, dim - i * chunk) for i in range(n)]
    if dim % n:
        return None
    return [dim // n] * n


def replace_tensor(graph: gs.Graph, old: gs.Tensor, new: gs.Tensor) -> None:
    """Every consumer of ``old`` reads ``new`` instead (graph outputs excluded: callers check that first)."""
    for consumer in list(old.outputs):
        for i, t in enumerate(consumer.inputs):
            if t is old:
                consumer.inputs[i] = new




def detach(*nodes: gs.Node) -> None:
    """Disconnect ``nodes`` from their tensors, so that cleanup() removes them."""
    for node in nodes:
        node.inputs.clear()
        node.outputs.clear()


_COPIES: list[dict] = []  # the innermost shared_copies() scope's memo


@contextlib.contextmanager
def shared_copies():
    """Inside it, :func:`contiguous` makes one copy per strided view and hands the same array out again.

    The search applies a rule at the same site in many candidates: fission cut the same weight columns
    (``W[:, lo:hi]`` of a MatMul) into a new array for each, and the hasher hashed every copy's bytes again,
    a third of ConvNeXt-T's search.  The copies are equal, so one serves them all (rules never change an array
    in place; graphsurgeon's Graph.copy shares weights the same way); the memo holds each view's base, so an
    ``id`` is never reused while it is a key, and it is dropped with the scope (the search's)."""
    _COPIES.append({})
    try:
        yield
    finally:
        _COPIES.pop()


def contiguous(v: np.ndarray) -> np.ndarray:
    """``np.ascontiguousarray(v)``; inside :func:`shared_copies`, the same array for the same view of a base
    (a copy of a strided view; a contiguous view itself, the first view object made of those bytes)."""
    if not _COPIES or not isinstance(v, np.ndarray) or not isinstance(v.base, np.ndarray):
        return np.ascontiguousarray(v)
    memo, base = _COPIES[-1], v.base
    key = (id(base), v.__array_interface__["data"][0] - base.__array_interface__["data"][0], v.shape, v.strides, v.dtype.str)
    hit = memo.get(key)
    if hit is not None and hit[0] is base:
        return hit[1]
    copy = np.ascontiguousarray(v)
    memo[key] = (base, copy)
    return copy


def shared_array(tag: tuple, sources: list[np.ndarray], make) -> np.ndarray:
    """``make()``; inside :func:`shared_copies`, the array made before for ``tag`` from the same ``sources``
    (the same objects): a merge's concatenated weights, made once for every candidate that merges those
    weights, so that the hasher hashes them once."""
    if not _COPIES:
        return make()
    memo = _COPIES[-1]
    key = (tag, tuple(id(a) for a in sources))
    hit = memo.get(key)
    if hit is not None and len(hit[0]) == len(sources) and all(a is b for a, b in zip(hit[0], sources)):
        return hit[1]
    out = make()
    memo[key] = (list(sources), out)
    return out


def channel_vector(value: np.ndarray, out_rank: int, channels: int, axis: int = 1) -> np.ndarray | None:
    """``value`` as a per-channel vector of length ``channels`` when it broadcasts against an output of rank
    ``out_rank`` without growing it and varies at most along ``axis``; else None."""
    if value.ndim > out_rank:
        return None
    shape = (1,) * (out_rank - value.ndim) + tuple(value.shape)
    axis %= out_rank
    for i, d in enumerate(shape):
        if i != axis and d != 1:
            return None
    if shape[axis] not in (1, channels):
        return None
    return np.broadcast_to(value.reshape(-1), (channels,)).copy() if value.size in (1, channels) else None
