"""The one producer/consumer map: which item writes each tensor and which items read it.

An item is anything that reads and writes named tensors: a node of an ONNX or onnx-graphsurgeon graph, a plan's
branch, a converter's step.  Plain Python over names, so that the launcher (the runtime, which loads neither
onnx nor onnx-graphsurgeon) shares it with the build."""

from __future__ import annotations

from typing import Iterable


def producers(writes: Iterable[Iterable[str]]) -> dict[str, int]:
    """Tensor name -> index of the item that writes it (``writes``: each item's output names, in order; an empty
    name, an omitted optional output, is skipped; a name written twice maps to its last writer)."""
    out: dict[str, int] = {}
    for i, names in enumerate(writes):
        for name in names:
            if name:
                out[name] = i
    return out


def consumers(reads: Iterable[Iterable[str]]) -> dict[str, list[int]]:
    """Tensor name -> indices of the items that read it, in item order, each once (``reads``: each item's input
    names; empty names skipped)."""
    out: dict[str, list[int]] = {}
    for i, names in enumerate(reads):
        for name in names:
            if name:
                users = out.setdefault(name, [])
                if not users or users[-1] != i:
                    users.append(i)
    return out


def downstream(reads: list[list[str]], writes: list[list[str]], start: Iterable[int]) -> set[int]:
    """Indices of the items that read, directly or through other items, a tensor that the items ``start`` write:
    what depends on them (``start`` itself only where one of its items reads another's tensors).  ``reads`` and
    ``writes``: each item's input and output names, as :func:`consumers` and :func:`producers` take them."""
    users = consumers(reads)
    todo = [t for i in start for t in writes[i] if t]
    seen = set(todo)
    found: set[int] = set()
    while todo:
        for i in users.get(todo.pop(), []):
            if i not in found:
                found.add(i)
                new = [t for t in writes[i] if t and t not in seen]
                seen.update(new)
                todo.extend(new)
    return found


def node_reads(node) -> list[str]:
    """An ONNX node's reads (a ``NodeProto``): its inputs, then the names its If/Loop/Scan bodies read from the
    enclosing scope at any depth of nesting, which ONNX does not list as inputs (torchvision's detectors branch on
    an empty box set with bodies that read the outer graph's tensors).  ``core.graph.subgraph_reads`` is the same
    for an onnx-graphsurgeon node."""
    reads = list(node.input)
    for attr in node.attribute:
        for body in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
            local = {v.name for v in body.input} | {t.name for t in body.initializer}
            local |= {o for inner in body.node for o in inner.output}
            outer = [x for inner in body.node for x in node_reads(inner)] + [v.name for v in body.output]
            reads += [x for x in dict.fromkeys(outer) if x and x not in local and x not in reads]
    return reads
