"""Partition a graph into branches, assign them to streams and fix a launch order (Opara-style).

Stream assignment is a list schedule of the node DAG onto K streams:

* maximal chains of nodes (each node the only consumer of its only producer) are
  placed as units, since they run in sequence whatever the streams;
* units are taken in order of their *upward rank* (own cost plus the longest cost
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

Number of streams: ``choose_streams`` schedules the graph on 1 … ``max_streams``
streams and re-simulates each schedule at the level of engines, charging every
engine a fixed cost (one more kernel boundary; no fusion across engines) and every
cross-stream edge an event cost.  More streams are taken only when they are
estimated at least ``min_gain`` faster than one engine for the whole model:
parallel branches that are too small to pay for the fusion they lose (BERT's Q/K/V
projections at batch 1, ResNet's downsample branch) stay on one stream.

Launch order (Opara): a topological order of the branches in which, among the
ready ones, a compute-bound branch follows a memory-bound one and vice versa, so
that kernels that contend for different resources are issued side by side; ties go
to the earliest simulated start.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Callable

import networkx as nx
import onnx_graphsurgeon as gs

from .analysis import node_dag


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
    branch_preds: list[list[int]] = field(default_factory=list)  # branches each branch reads from


def _preds_succs(graph: gs.Graph, dag: nx.DiGraph | None = None):
    """Producers and consumers of every node, by node index, from the node DAG (analysis.node_dag: the graph
    ``inspect`` and the width see, If/Loop bodies' reads of the outer scope included)."""
    nodes = list(graph.nodes)
    dag = node_dag(graph) if dag is None else dag
    preds = [set(dag.predecessors(i)) for i in range(len(nodes))]
    succs = [set(dag.successors(i)) for i in range(len(nodes))]
    return nodes, preds, succs


def schedule_graph(
    graph: gs.Graph,
    num_streams: int,
    cost: Callable[[gs.Node], float],
    memory_bound: Callable[[gs.Node], bool],
    sync_cost: float = 2e-6,
    dag: nx.DiGraph | None = None,
) -> Schedule:
    """List-schedule ``graph`` (toposorted, shapes inferred) onto ``num_streams`` streams; ``dag``: its
    ``node_dag``, when the caller schedules the same graph several times (built here when not given)."""
    nodes, preds, succs = _preds_succs(graph, dag)
    n = len(nodes)
    c = [max(float(cost(nd)), 1e-9) for nd in nodes]

    # Scheduling units: maximal chains (a node whose only producer has no other consumer joins that
    # producer's chain).  A chain is sequential whatever the streams, so it is placed as a whole: no
    # stream switch inside it, and no free-floating epilogue (fused BN/ReLU costs nothing) between streams.
    unit_of = list(range(n))
    for i in range(n):
        if len(preds[i]) == 1:
            (p,) = preds[i]
            if len(succs[p]) == 1:
                unit_of[i] = unit_of[p]
    members: dict[int, list[int]] = {}
    for i in range(n):
        members.setdefault(unit_of[i], []).append(i)
    units = list(members)
    upreds = {u: {unit_of[p] for i in members[u] for p in preds[i]} - {u} for u in units}
    usuccs: dict[int, set[int]] = {u: set() for u in units}
    for u, ps in upreds.items():
        for p in ps:
            usuccs[p].add(u)
    uc = {u: sum(c[i] for i in members[u]) for u in units}

    # upward rank: longest cost path from the unit to any sink, itself included
    rank: dict[int, float] = {}
    for u in reversed(units):  # units are keyed by their first node, so this is a reverse topological order
        rank[u] = uc[u] + max((rank[v] for v in usuccs[u]), default=0.0)

    k = max(1, int(num_streams))
    stream_free = [0.0] * k
    finish = [0.0] * n
    start = [0.0] * n
    where = [-1] * n
    ufinish: dict[int, float] = {}
    ustream: dict[int, int] = {}
    remaining = {u: len(upreds[u]) for u in units}
    ready = [(-rank[u], u) for u in units if remaining[u] == 0]
    heapq.heapify(ready)
    while ready:
        _, u = heapq.heappop(ready)
        heavy = max(upreds[u], key=lambda p: (uc[p], -p), default=None)
        best = None
        for s_ in range(k):
            t0 = stream_free[s_]
            for p in upreds[u]:
                t0 = max(t0, ufinish[p] + (sync_cost if ustream[p] != s_ else 0.0))
            prefer = 0 if (heavy is not None and ustream[heavy] == s_) else 1
            key = (t0 + uc[u], prefer, s_)
            if best is None or key < best[0]:
                best = (key, s_, t0)
        _, s_, t = best
        for i in members[u]:
            where[i], start[i], finish[i] = s_, t, t + c[i]
            t = finish[i]
        ustream[u], ufinish[u] = s_, t
        stream_free[s_] = t
        for v in usuccs[u]:
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
        branch_preds=[sorted(p) for p in bpreds],
    )


#: what one more engine costs (a kernel boundary that no fusion crosses; launch and tail), seconds
ENGINE_COST = 3e-6
#: what one cross-stream event costs (record + wait), seconds
EVENT_COST = 2e-6


def estimate_latency(sched: Schedule, *, engine_cost: float = ENGINE_COST, event_cost: float = EVENT_COST,
                     branch_preds: list[set[int]] | None = None) -> float:
    """Latency of ``sched`` simulated at the level of engines, in launch order.

    Each stream runs its branches in launch order; a branch starts when its stream is
    free and every branch it reads has finished (plus ``event_cost`` when that branch ran
    on another stream), and takes its nodes' cost plus ``engine_cost``.
    """
    preds = branch_preds if branch_preds is not None else _branch_preds(sched)
    finish = [0.0] * len(sched.branches)
    free = [0.0] * max(1, sched.num_streams)
    for b in sched.launch_order:
        s = sched.branch_stream[b]
        t0 = free[s]
        for p in preds[b]:
            t0 = max(t0, finish[p] + (event_cost if sched.branch_stream[p] != s else 0.0))
        finish[b] = t0 + sched.branch_time[b] + engine_cost
        free[s] = finish[b]
    return max(finish, default=0.0)


def _branch_preds(sched: Schedule) -> list[set[int]]:
    return [set(p) for p in sched.branch_preds]


def choose_streams(graph: gs.Graph, max_streams: int, cost: Callable[[gs.Node], float],
                   memory_bound: Callable[[gs.Node], bool], *, sync_cost: float = 2e-6, min_gain: float = 0.10,
                   engine_cost: float = ENGINE_COST, event_cost: float = EVENT_COST,
                   dag: nx.DiGraph | None = None) -> tuple[Schedule, list[dict]]:
    """The schedule to use, and the estimate for every number of streams tried.

    Every K from 1 to ``max_streams`` is scheduled and re-simulated with engine and event
    costs (``estimate_latency``); K > 1 is taken only when its estimate is at least
    ``min_gain`` below that of one stream, and then the K with the lowest estimate wins.  ``dag``: the graph's
    ``node_dag`` when the caller has it (built here when not given).
    """
    tried: list[dict] = []
    schedules: list[Schedule] = []
    dag = node_dag(graph) if dag is None else dag  # one DAG for every K
    for k in range(1, max(1, int(max_streams)) + 1):
        sched = schedule_graph(graph, k, cost, memory_bound, sync_cost=sync_cost, dag=dag)
        if any(s.num_streams == sched.num_streams for s in schedules):
            continue  # fewer streams were used than offered: a schedule already tried
        events = sum(1 for b, ps in enumerate(sched.branch_preds) for p in ps
                     if sched.branch_stream[p] != sched.branch_stream[b])
        est = estimate_latency(sched, engine_cost=engine_cost, event_cost=event_cost)
        schedules.append(sched)
        tried.append({"streams": sched.num_streams, "engines": len(sched.branches), "events": events,
                      "critical_path_s": sched.makespan, "estimated_s": est, "chosen": False})
    pick = 0
    for i, t in enumerate(tried[1:], start=1):
        if t["estimated_s"] <= (1.0 - min_gain) * tried[0]["estimated_s"] and t["estimated_s"] < tried[pick]["estimated_s"]:
            pick = i
    tried[pick]["chosen"] = True
    return schedules[pick], tried
