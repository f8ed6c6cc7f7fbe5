"""Partition a graph into branches, assign them to streams and fix a launch order (Opara-style).

Stream assignment is a list schedule of the node DAG onto K streams:

* nodes are taken in order of their *upward rank* (own cost plus the longest cost
  path to a sink), so the critical path is placed first;
* a node goes to the stream where it finishes earliest, counting ``sync_cost`` for
  every input that comes from another stream, and preferring the stream of its
  heaviest producer on ties: a branch continues on its producer's stream unless
  running elsewhere is strictly faster, which keeps synchronisations few.

A *branch* (one engine) is a maximal run of consecutive nodes of one stream with
no event between them: a new branch starts before a node that waits on another
stream, and ends after a node whose output another stream reads.  Every edge
between branches then points forward in simulated time, so the branch graph is a
DAG.

Launch order (Opara): a topological order of the branches in which, among the
ready ones, a compute-bound branch follows a memory-bound one and vice versa, so
that kernels that contend for different resources are issued side by side; ties go
to the earliest simulated start.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Callable

import onnx_graphsurgeon as gs


@dataclass
class Schedule:
    num_streams: int
    node_stream: dict[str, int]
    branches: list[list[str]]  # node names of each branch, topological inside
    branch_stream: list[int]
    launch_order: list[int]
    branch_bound: list[str]
    branch_time: list[float]
    makespan: float  # simulated critical path under K streams, seconds
    total_work: float
    node_start: dict[str, float] = field(default_factory=dict)


def _node_graph(graph: gs.Graph):
    """Producers and consumers of every node, by node index, over tensors (not constants)."""
    nodes = list(graph.nodes)
    index = {id(n): i for i, n in enumerate(nodes)}
    preds: list[set[int]] = [set() for _ in nodes]
    succs: list[set[int]] = [set() for _ in nodes]
    for i, n in enumerate(nodes):
        for t in n.inputs:
            if isinstance(t, gs.Variable):
                for p in t.inputs:
                    j = index[id(p)]
                    preds[i].add(j)
                    succs[j].add(i)
    return nodes, preds, succs


def schedule_graph(
    graph: gs.Graph,
    num_streams: int,
    cost: Callable[[gs.Node], float],
    memory_bound: Callable[[gs.Node], bool],
    sync_cost: float = 2e-6,
) -> Schedule:
    """List-schedule ``graph`` (toposorted, shapes inferred) onto ``num_streams`` streams."""
    nodes, preds, succs = _node_graph(graph)
    n = len(nodes)
    c = [max(float(cost(nd)), 1e-9) for nd in nodes]

    # upward rank: longest cost path from the node to any sink, itself included
    rank = [0.0] * n
    for i in reversed(range(n)):
        rank[i] = c[i] + max((rank[s] for s in succs[i]), default=0.0)

    k = max(1, int(num_streams))
    stream_free = [0.0] * k
    finish = [0.0] * n
    start = [0.0] * n
    where = [-1] * n
    remaining = [len(p) for p in preds]
    ready = [(-rank[i], i) for i in range(n) if remaining[i] == 0]
    heapq.heapify(ready)
    while ready:
        _, i = heapq.heappop(ready)
        heavy = max(preds[i], key=lambda p: (c[p], -p), default=None)
        best = None
        for s in range(k):
            t0 = stream_free[s]
            for p in preds[i]:
                t0 = max(t0, finish[p] + (sync_cost if where[p] != s else 0.0))
            prefer = 0 if (heavy is not None and where[heavy] == s) else 1
            key = (t0 + c[i], prefer, s)
            if best is None or key < best[0]:
                best = (key, s, t0)
        _, s, t0 = best
        where[i], start[i], finish[i] = s, t0, t0 + c[i]
        stream_free[s] = finish[i]
        for v in succs[i]:
            remaining[v] -= 1
            if remaining[v] == 0:
                heapq.heappush(ready, (-rank[v], v))

    # drop unused streams, renumber in order of first use
    used = sorted({where[i] for i in range(n)}, key=lambda s: min(start[i] for i in range(n) if where[i] == s))
    renum = {s: r for r, s in enumerate(used)}
    where = [renum[s] for s in where]
    k = len(used) or 1

    # branches: cut each stream's sequence at cross-stream edges
    branch_of = [-1] * n
    branches: list[list[int]] = []
    branch_stream: list[int] = []
    for s in range(k):
        seq = sorted((i for i in range(n) if where[i] == s), key=lambda i: (start[i], i))
        current: list[int] = []
        for i in seq:
            waits = any(where[p] != s for p in preds[i])
            if current and waits:
                branches.append(current)
                branch_stream.append(s)
                current = []
            current.append(i)
            if any(where[v] != s for v in succs[i]):
                branches.append(current)
                branch_stream.append(s)
                current = []
        if current:
            branches.append(current)
            branch_stream.append(s)
    # number branches by simulated start so that ids read in time order
    order = sorted(range(len(branches)), key=lambda b: (start[branches[b][0]], branch_stream[b]))
    branches = [branches[b] for b in order]
    branch_stream = [branch_stream[b] for b in order]
    for b, members in enumerate(branches):
        for i in members:
            branch_of[i] = b

    nb = len(branches)
    bpreds: list[set[int]] = [set() for _ in range(nb)]
    for i in range(n):
        for p in preds[i]:
            if branch_of[p] != branch_of[i]:
                bpreds[branch_of[i]].add(branch_of[p])
    btime = [sum(c[i] for i in members) for members in branches]
    bound = []
    for members in branches:
        mem = sum(c[i] for i in members if memory_bound(nodes[i]))
        bound.append("memory" if mem * 2 > sum(c[i] for i in members) else "compute")
    bstart = [start[members[0]] for members in branches]

    # launch order: topological, alternating compute/memory-bound among ready branches
    indeg = [len(p) for p in bpreds]
    bsuccs: list[set[int]] = [set() for _ in range(nb)]
    for b, ps in enumerate(bpreds):
        for p in ps:
            bsuccs[p].add(b)
    ready_b = {b for b in range(nb) if indeg[b] == 0}
    launch: list[int] = []
    last = None
    while ready_b:
        # among branches that could start at the earliest simulated time, alternate the bound
        earliest = min(bstart[b] for b in ready_b)
        window = [b for b in ready_b if bstart[b] <= earliest + 1e-12] or list(ready_b)
        pick = min(window, key=lambda b: (0 if (last is None or bound[b] != last) else 1, bstart[b], b))
        ready_b.remove(pick)
        launch.append(pick)
        last = bound[pick]
        for v in bsuccs[pick]:
            indeg[v] -= 1
            if indeg[v] == 0:
                ready_b.add(v)
    assert len(launch) == nb, "branch graph has a cycle"

    return Schedule(
        num_streams=k,
        node_stream={nodes[i].name: where[i] for i in range(n)},
        branches=[[nodes[i].name for i in sorted(members)] for members in branches],
        branch_stream=branch_stream,
        launch_order=launch,
        branch_bound=bound,
        branch_time=btime,
        makespan=max(finish, default=0.0),
        total_work=sum(c),
        node_start={nodes[i].name: start[i] for i in range(n)},
    )
