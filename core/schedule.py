"""The one list scheduler: the streams, branches and launch order a plan ships, and the latency the rewrite
search charges each candidate, are the same computation (Opara-style, HEFT-like).

Stream assignment (:func:`place`, the dynamic program) is a list schedule of the node DAG onto K streams:

* maximal chains of nodes (each node the only consumer of its only producer) are
  placed as units, since they run in sequence whatever the streams;
* units are taken in order of their *upward rank* (own cost plus the longest cost
  path to a sink), so the critical path is placed first;
* a unit goes to the stream where it finishes earliest, counting ``sync_cost`` for
  every input that comes from another stream, and preferring the stream of its
  heaviest producer on ties: a branch continues on its producer's stream unless
  running elsewhere is strictly faster, which keeps synchronisations few.

A *branch* (one engine, :func:`cut_branches`) is a maximal run of consecutive nodes of one stream with no event
between them: a new branch starts before a node that waits on another stream, and ends after a node whose
output another stream reads.  Every edge between branches then points forward in simulated time, so the
branch graph is a DAG.

Launch order (Opara, :func:`launch_order`): a topological order of the branches in which, among the ready ones,
a compute-bound branch follows a memory-bound one and vice versa, so that kernels that contend for different
resources are issued side by side; ties go to the earliest simulated start.

Latency (:func:`estimate_latency`): the schedule re-simulated at the level of engines, in launch order, each
engine charged ``ENGINE_COST`` (one more kernel boundary; no fusion across engines) and each cross-stream edge
``EVENT_COST``.  ``choose_streams`` takes more streams only when this estimate is at least ``min_gain`` below one
engine for the whole model; the search's ``critical_path`` is this estimate on its stream count
(:func:`schedule_latency`).

The cost of a node is a callable (``cost(node) -> seconds``): the roofline, measured figures or a test's table
(IOS keeps its scheduler apart from the profiler the same way).
"""

from __future__ import annotations

import heapq
from bisect import insort
from dataclasses import dataclass, field
from typing import Callable, Sequence

import onnx_graphsurgeon as gs

from .graph import node_edges

#: what one more engine costs (a kernel boundary that no fusion crosses; launch and tail), seconds
ENGINE_COST = 3e-6
#: what one cross-stream event costs (record + wait), seconds
EVENT_COST = 2e-6
#: what the placement charges an input read from another stream, seconds
SYNC_COST = 2e-6
#: the least time a node takes on its stream (a view's zero cost would give it no place in time)
MIN_NODE_COST = 1e-9

Edges = tuple[list[list[int]], list[list[int]]]


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


@dataclass
class Placement:
    """The scheduler's result by node and branch index (what :class:`Schedule` names)."""

    num_streams: int
    stream: list[int]  # per node, streams numbered in order of first use
    start: list[float]
    finish: list[float]
    branches: list[list[int]]  # node indices of each branch, in order of simulated start
    branch_stream: list[int]
    branch_preds: list[set[int]]
    branch_time: list[float]
    branch_bound: list[str]  # "compute" | "memory"
    launch_order: list[int]


def _topological(preds: list[list[int]], succs: list[list[int]]) -> list[int]:
    """Node indices in a topological order: index order where that is one (a toposorted graph), else Kahn's."""
    for i, ps in enumerate(preds):
        for p in ps:
            if p >= i:
                break
        else:
            continue
        break
    else:
        return list(range(len(preds)))
    indeg = [len(p) for p in preds]
    ready = [i for i, d in enumerate(indeg) if d == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for s in succs[i]:
            indeg[s] -= 1
            if indeg[s] == 0:
                heapq.heappush(ready, s)
    if len(order) != len(preds):
        raise ValueError("the graph has a cycle")
    return order


def place(preds: list[list[int]], succs: list[list[int]], cost: Sequence[float], streams: int,
          sync_cost: float = SYNC_COST) -> tuple[list[int], list[float], list[float]]:
    """The list schedule of the node DAG (``preds``/``succs`` by node index, each edge once; ``cost`` per node,
    positive) onto ``streams`` streams: (stream, start, finish) of every node.  See the module docstring.

    Units are keyed by their first node's index; lists indexed by node stand for maps over units (the search
    schedules every candidate it costs, so this is written for speed: plain loops, no key functions)."""
    n = len(cost)
    # units: maximal chains; a node whose only producer has no other consumer joins that producer's unit.  The
    # per-unit lists exist for units only (most nodes of a chain-heavy graph are not a unit's first node).
    head = list(range(n))
    members: list = [None] * n
    units: list[int] = []  # in topological order of their first nodes
    for i in _topological(preds, succs):
        ps = preds[i]
        if len(ps) == 1 and len(succs[ps[0]]) == 1:
            h = head[i] = head[ps[0]]
            members[h].append(i)
        else:
            units.append(i)
            members[i] = [i]
    upreds: list = [None] * n  # only a chain's first node reads another unit
    usuccs: list = [None] * n
    uc = [0.0] * n
    for u in units:
        usuccs[u] = []
    for u in units:
        mine = upreds[u] = []
        for p in preds[u]:
            h = head[p]
            if h not in mine:
                mine.append(h)
                usuccs[h].append(u)
        uc[u] = sum([cost[i] for i in members[u]])
    rank = [0.0] * n  # upward rank: the longest cost path from the unit to a sink, itself included
    for u in reversed(units):
        longest = 0.0
        for v in usuccs[u]:
            if rank[v] > longest:
                longest = rank[v]
        rank[u] = uc[u] + longest

    k = max(1, int(streams))
    stream_free = [0.0] * k
    streams_k = range(k)
    where, start, finish = [-1] * n, [0.0] * n, [0.0] * n
    ustream = [-1] * n
    ufinish = [0.0] * n
    remaining = [0] * n
    ready = []
    for u in units:
        if upreds[u]:
            remaining[u] = len(upreds[u])
        else:
            ready.append((-rank[u], u))
    heapq.heapify(ready)
    pop, push = heapq.heappop, heapq.heappush
    while ready:
        _, u = pop(ready)
        ps, cu = upreds[u], uc[u]
        heavy = -1  # the producer unit of largest cost (the first on ties): its stream wins ties
        for p in ps:
            if heavy < 0 or uc[p] > uc[heavy] or (uc[p] == uc[heavy] and p < heavy):
                heavy = p
        heavy_stream = ustream[heavy] if heavy >= 0 else -1
        # the stream where the unit finishes first; ties: the heavy producer's stream, then the lowest number
        best, best_end, best_prefer, best_start = -1, 0.0, 0, 0.0
        if ps:
            # each producer's finish as read from its own stream and from any other (one sum per producer, the
            # same sum the stream loop would make)
            reads = [(ustream[p], ufinish[p], ufinish[p] + sync_cost) for p in ps]
            for s in streams_k:
                t0 = stream_free[s]
                for ps_, same, other in reads:
                    ready_at = same if ps_ == s else other
                    if ready_at > t0:
                        t0 = ready_at
                end, prefer = t0 + cu, 0 if s == heavy_stream else 1
                if best < 0 or end < best_end or (end == best_end and prefer < best_prefer):
                    best, best_end, best_prefer, best_start = s, end, prefer, t0
        else:
            for s in streams_k:
                t0 = stream_free[s]
                end = t0 + cu
                if best < 0 or end < best_end:  # no producer: no stream is preferred
                    best, best_end, best_start = s, end, t0
        t = best_start
        for i in members[u]:
            where[i], start[i] = best, t
            t = finish[i] = t + cost[i]
        ustream[u], ufinish[u] = best, t
        stream_free[best] = t
        for v in usuccs[u]:
            remaining[v] -= 1
            if remaining[v] == 0:
                push(ready, (-rank[v], v))
    return where, start, finish


def cut_branches(preds: list[list[int]], succs: list[list[int]], where: list[int], start: list[float]
                 ) -> tuple[list[int], list[list[int]], list[int]]:
    """Streams renumbered in order of first use, and the branches: each stream's nodes in start order, cut
    before a node that waits on another stream and after one that another stream reads.  Returns (stream per
    node, branches in order of simulated start, stream per branch)."""
    first: dict[int, float] = {}
    for i, s in enumerate(where):
        if s not in first or start[i] < first[s]:
            first[s] = start[i]
    renum = {s: r for r, s in enumerate(sorted(first, key=lambda s: (first[s], s)))}
    where = [renum[s] for s in where]
    per_stream: list[list[int]] = [[] for _ in renum]
    for i, s in enumerate(where):
        per_stream[s].append(i)
    branches: list[list[int]] = []
    branch_stream: list[int] = []
    for s, nodes in enumerate(per_stream):
        nodes.sort(key=start.__getitem__)  # stable over ascending indices: ties in index order
        current: list[int] = []
        for i in nodes:
            if current:
                for p in preds[i]:
                    if where[p] != s:  # waits on another stream: a new branch
                        branches.append(current)
                        branch_stream.append(s)
                        current = []
                        break
            current.append(i)
            for v in succs[i]:
                if where[v] != s:  # another stream reads it: the branch ends here
                    branches.append(current)
                    branch_stream.append(s)
                    current = []
                    break
        if current:
            branches.append(current)
            branch_stream.append(s)
    order = sorted(range(len(branches)), key=lambda b: (start[branches[b][0]], branch_stream[b]))
    return where, [branches[b] for b in order], [branch_stream[b] for b in order]


def launch_order(branch_preds: list[set[int]], branch_bound: list[str], branch_start: list[float]) -> list[int]:
    """A topological order of the branches that alternates compute- and memory-bound ones among those that
    could start at the earliest simulated time (ties: earliest start, then id)."""
    nb = len(branch_preds)
    indeg = [len(p) for p in branch_preds]
    bsuccs: list[list[int]] = [[] for _ in range(nb)]
    for b, ps in enumerate(branch_preds):
        for p in ps:
            bsuccs[p].append(b)
    # the ready branches sorted by (start, id): those that could start first are a prefix, and the first of them
    # of the other bound than the last (else the first) is the pick
    ready = sorted([(branch_start[b], b) for b in range(nb) if indeg[b] == 0])
    launch: list[int] = []
    last = None
    while ready:
        pick = 0
        if last is not None:
            limit = ready[0][0] + 1e-12
            for j, (at, b) in enumerate(ready):
                if at > limit:
                    break
                if branch_bound[b] != last:
                    pick = j
                    break
        b = ready.pop(pick)[1]
        launch.append(b)
        last = branch_bound[b]
        for v in bsuccs[b]:
            indeg[v] -= 1
            if indeg[v] == 0:
                insort(ready, (branch_start[v], v))
    assert len(launch) == nb, "branch graph has a cycle"
    return launch


def list_schedule(edges: Edges, cost: Sequence[float], memory_bound: Sequence[bool], streams: int,
                  sync_cost: float = SYNC_COST) -> Placement:
    """:func:`place`, :func:`cut_branches` and :func:`launch_order` over the node DAG ``edges`` with each node's
    ``cost`` (floored at ``MIN_NODE_COST``) and whether it is ``memory_bound``."""
    preds, succs = edges
    c = [MIN_NODE_COST if MIN_NODE_COST > x else x for x in map(float, cost)]  # max(x, MIN_NODE_COST)
    where, start, finish = place(preds, succs, c, streams, sync_cost)
    where, branches, branch_stream = cut_branches(preds, succs, where, start)
    branch_of = [-1] * len(c)
    for b, nodes in enumerate(branches):
        for i in nodes:
            branch_of[i] = b
    bpreds: list[set[int]] = [set() for _ in branches]
    for i, ps in enumerate(preds):
        bi = branch_of[i]
        for p in ps:
            if branch_of[p] != bi:
                bpreds[bi].add(branch_of[p])
    btime, bound = [], []
    for nodes in branches:
        total = sum([c[i] for i in nodes])
        btime.append(total)
        bound.append("memory" if sum([c[i] for i in nodes if memory_bound[i]]) * 2 > total else "compute")
    order = launch_order(bpreds, bound, [start[nodes[0]] for nodes in branches])
    return Placement(len(set(where)) or 1, where, start, finish, branches, branch_stream, bpreds, btime, bound, order)


def schedule_graph(graph: gs.Graph, num_streams: int, cost: Callable[[gs.Node], float],
                   memory_bound: Callable[[gs.Node], bool], sync_cost: float = SYNC_COST,
                   edges: Edges | None = None) -> Schedule:
    """List-schedule ``graph`` (shapes inferred) onto ``num_streams`` streams; ``edges``: its ``node_edges``, when
    the caller schedules the same graph several times (built here when not given)."""
    nodes = list(graph.nodes)
    edges = node_edges(graph) if edges is None else edges
    c = [max(float(cost(nd)), MIN_NODE_COST) for nd in nodes]
    p = list_schedule(edges, c, [memory_bound(nd) for nd in nodes], num_streams, sync_cost)
    return Schedule(
        num_streams=p.num_streams,
        node_stream={nodes[i].name: p.stream[i] for i in range(len(nodes))},
        branches=[[nodes[i].name for i in sorted(b)] for b in p.branches],
        branch_stream=p.branch_stream,
        launch_order=p.launch_order,
        branch_bound=p.branch_bound,
        branch_time=p.branch_time,
        makespan=max(p.finish, default=0.0),
        total_work=sum(c),
        node_start={nodes[i].name: p.start[i] for i in range(len(nodes))},
        branch_preds=[sorted(b) for b in p.branch_preds],
    )


def simulate(launch: Sequence[int], branch_stream: Sequence[int], branch_time: Sequence[float],
             branch_preds: Sequence[set[int] | list[int]], num_streams: int, *, engine_cost: float = ENGINE_COST,
             event_cost: float = EVENT_COST) -> float:
    """Latency of branches run in ``launch`` order, each stream in that order: a branch starts when its stream is
    free and every branch it reads has finished (plus ``event_cost`` when that branch ran on another stream),
    and takes its ``branch_time`` plus ``engine_cost``."""
    finish = [0.0] * len(branch_time)
    free = [0.0] * max(1, num_streams)
    for b in launch:
        s = branch_stream[b]
        t0 = free[s]
        for p in branch_preds[b]:
            t0 = max(t0, finish[p] + (event_cost if branch_stream[p] != s else 0.0))
        finish[b] = t0 + branch_time[b] + engine_cost
        free[s] = finish[b]
    return max(finish, default=0.0)


def estimate_latency(sched: Schedule, *, engine_cost: float = ENGINE_COST, event_cost: float = EVENT_COST,
                     branch_preds: list[set[int]] | None = None) -> float:
    """Latency of ``sched`` simulated at the level of engines, in launch order (:func:`simulate`)."""
    preds = branch_preds if branch_preds is not None else sched.branch_preds
    return simulate(sched.launch_order, sched.branch_stream, sched.branch_time, preds, sched.num_streams,
                    engine_cost=engine_cost, event_cost=event_cost)


def schedule_latency(edges: Edges, cost: Sequence[float], memory_bound: Sequence[bool], streams: int) -> float:
    """What the shipped schedule of a graph on ``streams`` streams is estimated to take (``estimate_latency`` of
    ``schedule_graph``), from its ``node_edges`` and per-node figures: the rewrite search's critical path."""
    if not cost:
        return 0.0
    p = list_schedule(edges, cost, memory_bound, streams)
    return simulate(p.launch_order, p.branch_stream, p.branch_time, p.branch_preds, p.num_streams)


def choose_streams(graph: gs.Graph, max_streams: int, cost: Callable[[gs.Node], float],
                   memory_bound: Callable[[gs.Node], bool], *, sync_cost: float = SYNC_COST, min_gain: float = 0.10,
                   engine_cost: float = ENGINE_COST, event_cost: float = EVENT_COST) -> tuple[Schedule, list[dict]]:
    """The schedule to use, and the estimate for every number of streams tried.

    Every K from 1 to ``max_streams`` is scheduled and re-simulated with engine and event
    costs (``estimate_latency``); K > 1 is taken only when its estimate is at least
    ``min_gain`` below that of one stream, and then the K with the lowest estimate wins.
    """
    tried: list[dict] = []
    schedules: list[Schedule] = []
    edges = node_edges(graph)  # one DAG for every K
    for k in range(1, max(1, int(max_streams)) + 1):
        sched = schedule_graph(graph, k, cost, memory_bound, sync_cost=sync_cost, edges=edges)
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
