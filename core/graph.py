"""Utilities over an onnx-graphsurgeon graph, shared by the search and the pipeline.

* :func:`node_edges`: the node DAG of an onnx-graphsurgeon graph as predecessor and successor lists by node
  index, the tensors an If/Loop/Scan body reads from the enclosing scope included (the scheduler's input).
* :func:`static_shape` and :func:`conv_attrs`: a tensor's shape when every dimension is known, a Conv's
  attributes with ONNX's defaults filled in.
* :func:`unused_name`: a node or tensor name not taken yet (the rules' namer, the fused ops' plain form).
"""

from __future__ import annotations

from operator import attrgetter

import numpy as np
import onnx_graphsurgeon as gs

from .dataflow import producers

_name = attrgetter("name")


def unused_name(taken: set[str], base: str) -> str:
    """``base``, or ``base_1``, ``base_2`` … whichever is not in ``taken``; added to it."""
    name, i = base, 0
    while name in taken:
        i += 1
        name = f"{base}_{i}"
    taken.add(name)
    return name


def subgraph_reads(node: gs.Node) -> set[str]:
    """Names of the tensors that an If/Loop/Scan body of ``node`` reads from the enclosing scope (at any depth of
    nesting): they are inputs of the node too, though ONNX does not list them.  (graphsurgeon's own
    ``Graph._foreign_tensors`` does this but is private.)"""
    reads: set[str] = set()
    for body in node.subgraphs():
        local = {t.name for t in body.inputs} | {t.name for inner in body.nodes for t in inner.outputs}
        for inner in body.nodes:
            reads.update(t.name for t in inner.inputs if isinstance(t, gs.Variable) and t.name and t.name not in local)
            reads.update(subgraph_reads(inner) - local)
    return reads


def node_edges(graph: gs.Graph) -> tuple[list[list[int]], list[list[int]]]:
    """(predecessors, successors) of every node of ``graph`` by index into ``graph.nodes``: an edge producer ->
    consumer for every tensor that passes between two nodes (a node's inputs, then, sorted, what its bodies
    read from the enclosing scope), each edge once, in the order of the consumer's reads.

    Plain lists rather than a networkx graph: the rewrite search schedules every candidate it costs, and
    building a DiGraph took longer than the schedule itself."""
    nodes = graph.nodes
    writer = producers(map(_name, node.outputs) for node in nodes)
    preds: list[list[int]] = [[] for _ in nodes]
    succs: list[list[int]] = [[] for _ in nodes]
    get, variable, graph_type = writer.get, gs.Variable, gs.Graph
    for i, node in enumerate(nodes):
        mine = preds[i]
        reads = [t.name for t in node.inputs if t.__class__ is variable or isinstance(t, variable)]
        attrs = node.attrs
        if attrs:
            for value in attrs.values():
                if isinstance(value, graph_type):
                    reads += sorted(subgraph_reads(node))
                    break
        for name in reads:
            j = get(name)
            if j is not None and j != i and j not in mine:
                mine.append(j)
                succs[j].append(i)
    return preds, succs


def static_shape(t: gs.Tensor | None) -> tuple[int, ...] | None:
    """The shape of ``t`` when every dimension is a known non-negative integer (a constant's always is), else None."""
    if t is None:
        return None
    if isinstance(t, gs.Constant):
        return tuple([int(d) for d in t.values.shape])
    shape = t.shape
    if shape is None:
        return None
    # plain loops: the rules and the search's hasher ask for tens of thousands of shapes per build
    for d in shape:
        if not isinstance(d, _INTEGERS) or d < 0:
            return None
    return tuple([int(d) for d in shape])


_INTEGERS = (int, np.integer)


def conv_attrs(node: gs.Node, rank: int) -> dict:
    """Conv attributes with ONNX defaults filled in (spatial rank ``rank``)."""
    w = node.inputs[1]
    ks = node.attrs.get("kernel_shape")
    if ks is None and static_shape(w) is not None:
        ks = list(static_shape(w)[2:])
    auto_pad = node.attrs.get("auto_pad", "NOTSET")
    if isinstance(auto_pad, bytes):
        auto_pad = auto_pad.decode()
    return {
        # VALID is NOTSET with zero pads; SAME_* stays as it is (callers refuse it)
        "auto_pad": "NOTSET" if auto_pad == "VALID" else auto_pad,
        "dilations": list(node.attrs.get("dilations", [1] * rank)),
        "group": int(node.attrs.get("group", 1)),
        "kernel_shape": list(ks) if ks is not None else None,
        "pads": [0] * (2 * rank) if auto_pad == "VALID" else list(node.attrs.get("pads", [0] * (2 * rank))),
        "strides": list(node.attrs.get("strides", [1] * rank)),
    }
