"""The rewrite search (AutoGraph, AAAI 2023): rules chosen by a piecewise dynamic program over a cost model.

1. Cut the graph, in topological order, at *narrow points* (positions where few tensors are live) into
   pieces of ``min_piece`` … ``max_piece`` nodes.  Pieces run one after another, so their costs add and
   the best whole is assembled from the best of each piece.
2. Inside a piece, the *simplifying* rules (folds, cancellations) are first applied greedily wherever the
   cost model does not object; then a backtracking (depth-first, cheapest child first) search over rule applications keeps
   every candidate whose cost is within ``beta`` of the best found so far, skips candidates already seen
   (a canonical, name-independent graph hash) and stops at its share of ``max_candidates_total`` (split
   over the pieces by their node counts, at most ``max_candidates`` each): the search is bounded by work,
   never by the clock, so the same command gives the same result on a loaded and on an idle machine.  Rules marked ``enabling`` (merges, kernel enlargement: a step that pays only with the next
   one) may go past β, up to two such steps in a row.
3. The ``top_k`` cheapest combinations of piece candidates are assembled into whole models and costed as
   wholes; with a ``Measurer`` (or a plain ``model -> seconds`` function) they are measured on the device (onboard
   verification) and the fastest wins if it beats the input by ``measure_margin``; otherwise the cost
   model decides.  The input is always a candidate,
   so the result is never rated worse than it.

The cost of a graph is ``alpha·critical_path + (1 − alpha)·total_work`` under the cost model on ``streams``
streams.  The same seed gives the same result.

Before any of that, a pre-check (:func:`precheck`) skips the search when no rule has a site it can apply,
or when the nodes of every matched site together cost less than ``min_gain`` of the graph (a rewrite can at
best remove the work of the nodes it rewrites).  Without a measurement, a rewrite estimated less than
``min_gain`` cheaper than the input is not taken: the cost model is not that precise.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import gc
import heapq
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol, runtime_checkable

import onnx
import onnx_graphsurgeon as gs

from .cost import DEFAULT_ALPHA, CostModel, RooflineCostModel, mixed_cost
from .ir import (GraphHasher, adopt_model, cleanup, copy_graph, export_model, export_model_aside, import_graph,
                 put_back, toposort, working_copy)
from .rules import ALL_RULES, Rule
from .rules.base import shared_copies

REPORT_VERSION = 1
_MAX_REFUSALS = 200


# ---------------------------------------------------------------------------------------------
# Pieces
# ---------------------------------------------------------------------------------------------


def live_counts(graph: gs.Graph) -> list[int]:
    """live[i] = tensors produced before node i (in the graph's order) that node i or a later one reads
    (or that are graph outputs): the number of tensors a cut before node i has to carry."""
    nodes = list(graph.nodes)
    n = len(nodes)
    position = {id(node): i for i, node in enumerate(nodes)}
    outputs = {id(t) for t in graph.outputs}
    diff = [0] * (n + 2)
    for i, node in enumerate(nodes):
        for t in node.outputs:
            last = max((position.get(id(c), i) for c in t.outputs), default=i)
            if id(t) in outputs:
                last = n
            if last > i:
                diff[i + 1] += 1
                diff[last + 1] -= 1
    live, running = [], 0
    for i in range(n + 1):
        running += diff[i]
        live.append(running)
    return live


def cut_pieces(graph: gs.Graph, min_piece: int, max_piece: int) -> list[list[str]]:
    """Node names of each piece, in order: each cut at the narrowest position in its window of sizes."""
    nodes = [n.name for n in graph.nodes]
    n = len(nodes)
    min_piece = max(1, min(min_piece, max_piece))
    live = live_counts(graph)
    cuts, start = [], 0
    while n - start > max_piece:
        lo = start + min_piece
        hi = min(start + max_piece, n - min_piece)
        if hi < lo:
            hi = lo
        best = min(range(lo, hi + 1), key=lambda i: (live[i], -i))
        cuts.append((start, best))
        start = best
    cuts.append((start, n))
    return [nodes[a:b] for a, b in cuts if b > a]


def extract_piece(graph: gs.Graph, names: list[str]) -> gs.Graph:
    """A detached copy of the nodes ``names``: inputs are the tensors they read from outside, outputs the tensors
    that are read outside or are graph outputs."""
    chosen = set(names)
    by_name = {n.name: n for n in graph.nodes}
    nodes = [by_name[name] for name in names]
    produced = {id(t) for node in nodes for t in node.outputs}
    graph_outputs = {id(t) for t in graph.outputs}
    inputs, seen = [], set()
    for node in nodes:
        for t in node.inputs:
            if isinstance(t, gs.Variable) and t.name and id(t) not in produced and id(t) not in seen:
                seen.add(id(t))
                inputs.append(t)
    outputs = []
    for node in nodes:
        for t in node.outputs:
            if id(t) in graph_outputs or any(c.name not in chosen for c in t.outputs):
                outputs.append(t)
    return copy_graph(gs.Graph(nodes=nodes, inputs=inputs, outputs=outputs, opset=graph.opset))


def assemble(pieces: list[gs.Graph], original: gs.Graph) -> gs.Graph:
    """One graph from pieces that share their boundary tensors by name; names new in a piece that clash with
    another piece's are renamed, identical constants are shared."""
    shared: dict[str, gs.Tensor] = {}
    for t in original.inputs:
        shared[t.name] = gs.Variable(t.name, dtype=t.dtype, shape=t.shape)
    boundary = {t.name for p in pieces for t in (*p.inputs, *p.outputs)}
    taken = set(boundary) | set(shared)
    node_names: set[str] = set()
    nodes = []
    for piece in pieces:
        piece = copy_graph(piece)
        local_boundary = {t.name for t in (*piece.inputs, *piece.outputs)}
        for t in piece.tensors().values():
            if t.name in local_boundary:
                continue
            if isinstance(t, gs.Constant) and t.name in shared and isinstance(shared[t.name], gs.Constant) \
                    and shared[t.name].values is t.values:
                continue
            if t.name in taken:
                base, k = t.name, 1
                while f"{base}_{k}" in taken:
                    k += 1
                t.name = f"{base}_{k}"
            taken.add(t.name)
            if isinstance(t, gs.Constant):
                shared[t.name] = t
        for node in piece.nodes:
            for i, t in enumerate(node.inputs):
                if t is not None and t.name:
                    keep = shared.setdefault(t.name, t)
                    if keep is not t:
                        node.inputs[i] = keep
            for i, t in enumerate(node.outputs):
                keep = shared.setdefault(t.name, t)
                if keep is not t:
                    node.outputs[i] = keep
            if node.name in node_names:
                base, k = node.name, 1
                while f"{base}_{k}" in node_names:
                    k += 1
                node.name = f"{base}_{k}"
            node_names.add(node.name)
            nodes.append(node)
    inputs = [shared[t.name] for t in original.inputs]
    outputs = []
    for t in original.outputs:
        out = shared.get(t.name)
        if out is None:
            out = gs.Variable(t.name, dtype=t.dtype, shape=t.shape)
        outputs.append(out)
    whole = gs.Graph(nodes=nodes, inputs=inputs, outputs=outputs, opset=original.opset, name=original.name,
                     import_domains=original.import_domains)
    for o, t in zip(whole.outputs, original.outputs):
        if o.dtype is None:
            o.dtype = t.dtype
        if t.shape is not None:
            o.shape = t.shape  # keep the declared (possibly symbolic) output shape
    toposort(cleanup(whole))
    return whole


# ---------------------------------------------------------------------------------------------
# The search inside one piece
# ---------------------------------------------------------------------------------------------


@dataclass
class Candidate:
    cost: float
    graph: gs.Graph
    trace: tuple[str, ...]  # keys of the sites applied, in order
    nodes: int = 0


@dataclass
class PieceResult:
    base_cost: float
    candidates: list[Candidate]  # cheapest first; [0] is the best, the original is among them
    tried: int
    stopped: str
    seconds: float
    refusals: dict[tuple[str, str], str] = field(default_factory=dict)


class _Scorer:
    def __init__(self, cost_model: CostModel, streams: int, alpha: float):
        self.cost_model, self.streams, self.alpha = cost_model, streams, alpha

    def __call__(self, graph: gs.Graph) -> float:
        return mixed_cost(*self.cost_model.graph_cost(graph, self.streams), alpha=self.alpha)


def _apply(rule: Rule, graph: gs.Graph, site) -> tuple[gs.Graph | None, str | None]:
    """``rule`` at ``site`` of ``graph``: (the rewritten graph, None), or (None, why not): the rule's check
    refused it, or the rewrite failed (a rule that fails on a site must not end the build)."""
    try:
        reason = rule.check(graph, site)
        if reason is not None:
            return None, reason
        return rule.apply(graph, site), None
    except Exception as e:  # noqa: BLE001
        return None, f"the rewrite failed: {type(e).__name__}: {e}"


def simplify(cand: Candidate, rules: list[Rule], score: Callable[[gs.Graph], float],
             refusals: dict[tuple[str, str], str]) -> Candidate:
    """Apply the simplifying rules greedily, site after site, keeping each step the cost model does not rate worse
    (at most as many steps as the piece has nodes, plus a few: each step removes work)."""
    changed, steps = True, 0
    while changed and steps <= len(cand.graph.nodes) + 8:
        changed, steps = False, steps + 1
        for rule in rules:
            for site in sorted(rule.match(cand.graph), key=lambda s: s.key):
                graph, reason = _apply(rule, cand.graph, site)
                if graph is None:
                    refusals.setdefault((rule.name, site.key), reason)
                    continue
                cost = score(graph)
                if cost <= cand.cost * (1 + 1e-12):
                    cand = Candidate(cost, graph, cand.trace + (site.key,), len(graph.nodes))
                    changed = True
                    break  # sites of the old graph may be gone: match again
                refusals.setdefault((rule.name, site.key), "the cost model rates the result slower")
    return cand


def replay_piece(piece: gs.Graph, trace: list[str], rules: list[Rule], score: Callable[[gs.Graph], float],
                 ) -> tuple[Candidate | None, str | None]:
    """``piece`` with the rewrites of ``trace`` applied in order, each found by its site's key among its rule's
    matches: (the candidate, None), or (None, why) where a site is not there or its rule refuses it.  A rebuild
    from recorded timings replays the candidate the recorded build kept instead of searching again (the record's
    KEY holds the model's structure, its small constants and the code, so the search would find it again)."""
    by_name = {r.name: r for r in rules}
    graph = piece
    for key in trace:
        rule = by_name.get(key.split(":", 1)[0])
        site = next((x for x in rule.match(graph) if x.key == key), None) if rule is not None else None
        if site is None:
            return None, f"{key}: no such site"
        graph, reason = _apply(rule, graph, site)
        if graph is None:
            return None, f"{key}: {reason}"
    return Candidate(score(graph), graph, tuple(trace), len(graph.nodes)), None


def _rank(c: Candidate) -> tuple:
    return (c.cost, c.nodes, len(c.trace), c.trace)


def search_piece(piece: gs.Graph, rules: list[Rule], score: Callable[[gs.Graph], float], *, beta: float,
                 max_candidates: int, rng: random.Random, hasher: GraphHasher,
                 keep: int, lookahead: int = 2) -> PieceResult:
    t0 = time.perf_counter()
    original = Candidate(score(piece), piece, (), len(piece.nodes))
    refusals: dict[tuple[str, str], str] = {}
    base = simplify(original, [r for r in rules if r.simplifying], score, refusals)
    seen = {hasher(piece), hasher(base.graph)}
    found = [original] + ([base] if base is not original else [])
    best = base.cost
    # stack entries: (candidate, steps of lookahead past beta that led to it)
    stack: list[tuple[Candidate, int]] = [(base, 0)]
    tried, stopped = 0, "exhausted"
    while stack:
        if tried >= max_candidates:
            stopped = "candidates"
            break
        cand, ahead = stack.pop()
        if cand.cost > beta * best and not ahead:
            continue  # a better graph was found since it was pushed
        options = []
        for rule in rules:
            for site in sorted(rule.match(cand.graph), key=lambda s: s.key):
                options.append((rule, site))
        rng.shuffle(options)  # the seed picks the order among equals
        children = []
        for rule, site in options:
            if tried >= max_candidates:
                break
            graph, reason = _apply(rule, cand.graph, site)
            if graph is None:
                refusals.setdefault((rule.name, site.key), reason)
                continue
            h = hasher(graph)
            if h in seen:
                continue
            seen.add(h)
            tried += 1
            child = Candidate(score(graph), graph, cand.trace + (site.key,), len(graph.nodes))
            found.append(child)
            children.append((child, rule))
            if len(found) >= 2 * keep + 2:
                # only the ``keep`` cheapest are returned: the others need not stay alive (their graphs and the
                # weights their rewrites made); the order is total, so the result is the same
                found.sort(key=_rank)
                del found[keep + 1:]
        if children:
            best = min(best, min(c.cost for c, _ in children))
        push = []
        for child, rule in children:
            if child.cost <= beta * best:
                push.append((child, 0))
            elif rule.enabling and ahead < lookahead:
                push.append((child, ahead + 1))
        push.sort(key=lambda e: (-e[1], -e[0].cost, -e[0].nodes))  # the cheapest within beta is popped first
        stack.extend(push)
    found.sort(key=_rank)
    return PieceResult(original.cost, found[:keep], tried, stopped, time.perf_counter() - t0, refusals)


# ---------------------------------------------------------------------------------------------
# The whole
# ---------------------------------------------------------------------------------------------


def k_best_combinations(costs: list[list[float]], k: int) -> list[tuple[int, ...]]:
    """The ``k`` index vectors with the smallest sums Σ costs[i][idx[i]] (each list sorted ascending)."""
    if not costs:
        return [()]
    start = tuple(0 for _ in costs)
    heap = [(sum(c[0] for c in costs), start)]
    seen = {start}
    out = []
    while heap and len(out) < k:
        total, idx = heapq.heappop(heap)
        out.append(idx)
        for i in range(len(idx)):
            if idx[i] + 1 < len(costs[i]):
                nxt = idx[:i] + (idx[i] + 1,) + idx[i + 1:]
                if nxt not in seen:
                    seen.add(nxt)
                    heapq.heappush(heap, (total - costs[i][idx[i]] + costs[i][idx[i] + 1], nxt))
    return out


@contextlib.contextmanager
def _collector_paused():
    """Python's cyclic garbage collector off while one piece is searched (or the wholes are assembled and
    costed), and one collection after it.

    Every candidate is a graph of a few thousand objects in reference cycles (nodes and tensors list each
    other); while the collector runs on its own, the search's allocations set off a full collection every
    50-60 candidates, each walking every object of the process (the loaded model's graph included): a third
    of the search's time on ResNet-50.  The candidates a piece drops are freed by one collection of the young
    generations at its end instead (everything the piece made is there: nothing was collected, so nothing
    was moved to the oldest), so memory still goes back after every piece.  Nothing the search computes depends on when
    objects are freed (the hasher's caches check their weak references)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.collect(1)  # the piece's objects are all still in the youngest generation: no walk of the old ones


def _has_subgraphs(graph: gs.Graph) -> bool:
    return any(isinstance(v, gs.Graph) for n in graph.nodes for v in n.attrs.values())


def _cost_dict(cost_model: CostModel, graph: gs.Graph, streams: int, alpha: float) -> dict:
    cp, work = cost_model.graph_cost(graph, streams)
    return {"critical_path_s": cp, "total_work_s": work, "mixed_s": mixed_cost(cp, work, alpha)}


def precheck(graph: gs.Graph, rules: list[Rule], cost_model: CostModel, min_gain: float) -> tuple[str | None, dict]:
    """(why the search cannot gain, figures) -- None when it may: no rule has a site that its check accepts,
    or the nodes of all matched sites cost less than ``min_gain`` of the graph's total work (a rewrite can at
    best remove the work of the nodes it rewrites).  Matching and checking only: nothing is applied."""
    safe, touched = 0, set()
    for rule in rules:
        for site, reason in rule.sites(graph):
            touched.update(site.nodes)
            safe += reason is None
    by_name = {n.name: n for n in graph.nodes}
    total = sum(cost_model.node_cost(n) for n in graph.nodes)
    bound = sum(cost_model.node_cost(by_name[name]) for name in touched if name in by_name)
    figures = {"safe_sites": safe, "matched_nodes": len(touched), "gain_bound": bound / total if total else 0.0}
    if not safe:
        return "no rule has a site it can apply", figures
    if total and bound < min_gain * total:
        return (f"the matched sites' nodes are {figures['gain_bound']:.2%} of the estimated work, "
                f"less than the {min_gain:.0%} a rewrite must gain"), figures
    return None, figures


#: the fastest candidate measured is timed again while it leads the next fastest (the input included) by less
#: than this: one timing of a launcher can catch a whole timing 7-12% faster than its usual (BERT-base, H200:
#: a candidate timed once at 0.4212 against a reference at 0.6416 ms read as 0.373 ms, the others 0.397-0.419,
#: and was kept; its bundle ran like theirs: bench/timing_hold.py --states), which a lead that large outruns
CONFIRM_WITHIN = 0.15
#: two timings of one candidate this close agree (the slower is its time); apart, the slower counts until a third is
#: taken, and the median of the three is its time
CONFIRM_AGREE = 0.03
#: at most this many timings taken again after the candidates' measurements, in all (BERT-base, H200: the faster
#: state came in 5 of 13 timings of one search, and the third of three confirmations met it again)
CONFIRMATIONS = 4


def timings_stand(times: list[float]) -> bool:
    """Whether one thing's timings settle its time: two or more within ``CONFIRM_AGREE`` of each other, or
    three (its time is then their ``statistics.median_high``: the slower of two, the median of three)."""
    return len(times) >= 3 or (len(times) >= 2 and max(times) <= min(times) * (1.0 + CONFIRM_AGREE))


def confirm_fastest(measured: list[dict], original: dict, again: Callable[[dict], float],
                    margin: float = 0.0) -> list[dict]:
    """Time the fastest of ``measured`` again (``again(entry)``: seconds) until its time stands: its timings
    agree within ``CONFIRM_AGREE`` or number three, or it leads the next fastest by ``CONFIRM_WITHIN``, or it is
    the input (the reference every candidate is scaled by), or it is not ``margin`` faster than the input: the
    search keeps the input then, and a confirmation would change that only by timing the candidate faster than
    its first timing, which two agreeing timings never do (the slower counts; NASNet-A Large, H200: the input kept
    after three and four confirmations of ~1 s each, the last of which timed a candidate then 0.9% and 1.4%
    faster than the input).  Its time becomes the median of its timings (``timings_s``), the slower of two that
    disagree (the faster state is the exception, and it only ever makes a timing faster); when that is no longer
    the fastest, the new fastest is confirmed in turn, up to ``CONFIRMATIONS`` timings in all.  Returns what was
    timed again, in order, for the report."""
    import statistics

    out: list[dict] = []
    while len(out) < CONFIRMATIONS and len(measured) > 1:
        ranked = sorted(measured, key=lambda w: (w["measured_s"], w["cost"]["mixed_s"]))
        best, runner_up = ranked[0], ranked[1]
        times = best.setdefault("timings_s", [best["measured_s"]])
        base = original.get("measured_s")
        if (best is original or timings_stand(times)
                or runner_up["measured_s"] > best["measured_s"] * (1.0 + CONFIRM_WITHIN)
                or (base is not None and best["measured_s"] > base * (1.0 - margin))):
            break
        try:
            t = float(again(best))
        except Exception as e:  # noqa: BLE001 - its first time stands; the search decides on what it has
            out.append({"trace": list(best["trace"]), "error": f"{type(e).__name__}: {e}"})
            break
        times.append(t)
        best["measured_s"] = float(statistics.median_high(times))
        out.append({"trace": list(best["trace"]), "seconds": t, "median_s": best["measured_s"]})
    for w in measured:  # a single timing is not worth a list in the report
        if len(w.get("timings_s", ())) < 2:
            w.pop("timings_s", None)
    return out


class MeasureBudgetSpent(RuntimeError):
    """Raised by a measurer whose budget is spent: the search measures no further candidate."""


@runtime_checkable
class Measurer(Protocol):
    """What the search measures its candidates with (a GPU build: ``pipeline.measure.GpuMeasurer``).

    ``measure(model)`` returns the model's latency in seconds (or raises: MeasureBudgetSpent ends the
    measurements); ``prepare(models)`` is told, ``lookahead`` models ahead and in the order they will be
    measured, which models come next (a GPU build compiles their engines meanwhile) and returns what it
    started, for the report (or None); ``adopt(model, graph)`` is given, before ``prepare``, the graph of a
    candidate the search exported (the candidate's own graph with the export's names, types and shapes:
    ``ir.adopt_model``), so that the measurer plans it without importing ``model`` again.  A model so adopted
    holds placeholders for the weights its graph holds as arrays (``ir.export_model_aside``: their bytes are
    in the graph, not in ``model``; ``ir.weights_aside`` names them); the model the search returns has them.

    A measurer that knows the times already, by each candidate's rewrites (a search recorded by an earlier
    build of the same model: ``pipeline.timings.RecordedMeasurer``), says so with ``by_trace = True``: the
    search then calls ``measure_trace(trace)`` (the candidate's rule applications, in order; the input's is
    empty) and exports no candidate but the one it keeps.

    A measurer may also ``confirm(model)``: time a model it measured again, as it measured it, and return the
    seconds of that timing (``confirm_fastest``: the search's fastest is timed again before it decides)."""

    lookahead: int

    def adopt(self, model: onnx.ModelProto, graph: gs.Graph) -> None: ...

    def prepare(self, models: list[onnx.ModelProto]) -> dict | None: ...

    def measure(self, model: onnx.ModelProto) -> float: ...


@dataclass
class TimedBy:
    """A plain ``model -> seconds`` function as a Measurer that prepares nothing."""

    fn: Callable[[onnx.ModelProto], float]
    lookahead: int = 1

    def adopt(self, model: onnx.ModelProto, graph: gs.Graph) -> None:
        return None

    def prepare(self, models: list[onnx.ModelProto]) -> dict | None:
        return None

    def measure(self, model: onnx.ModelProto) -> float:
        return self.fn(model)


#: candidates measured with the next one prepared before the measurement, then as many with it prepared beside
#: it, before the faster way is kept for the rest of the search (``_Preparation``)
PREPARATION_TRIAL = 2


class _Preparation:
    """Whether the search prepares its next candidate beside a measurement (in a thread, while the GPU times) or
    before it, decided by timing both ways: the first ``PREPARATION_TRIAL`` candidates after the input are
    measured with it prepared before, the next as many beside, and the way whose fastest candidate, from the
    start of its measurement to the start of the next, took less is kept.  Neither wins everywhere (H200, the
    search's budget of 25 s): beside, NASNet-A Large measured 11-13 candidates against 7, its timings (1.5 ms
    replays, often timed again) long enough to hide a preparation; ViT-B/16 measured 8 against 20, its timings
    (0.5 ms replays) short, and slowed by the preparation's native calls, which hold the interpreter while the
    timing queues its replays."""

    def __init__(self, enabled: bool, clock=time.perf_counter):
        self.enabled, self.clock = enabled, clock
        self.marks: list[tuple[int, bool, float]] = []  # (candidate, beside, when its measurement started)
        self.won: str | None = None

    def beside(self, i: int) -> bool:
        """Whether candidate ``i`` (0: the input) is measured with the next one prepared beside it; called once
        per candidate, when its measurement is about to start."""
        if not self.enabled or i == 0:
            return False
        now = self.clock()
        if self.won is None and i > 2 * PREPARATION_TRIAL:
            # this candidate's start ends the last trial candidate's time: decided on every trial candidate
            took = self._took([(i, False, now)])
            if took["before"] and took["beside"]:
                self.won = "beside" if min(took["beside"]) < min(took["before"]) else "before"
        on = self.won == "beside" if self.won is not None else i > PREPARATION_TRIAL
        self.marks.append((i, on, now))
        return on

    def _took(self, more: list[tuple[int, bool, float]] = ()) -> dict[str, list[float]]:
        """Per way, the seconds from each trial candidate's start to the next one's (``more``: marks not made
        yet)."""
        took: dict[str, list[float]] = {"before": [], "beside": []}
        marks = [*self.marks, *more]
        for (i, on, t), (j, _, u) in zip(marks, marks[1:]):
            if j == i + 1 and i <= 2 * PREPARATION_TRIAL:
                took["beside" if on else "before"].append(u - t)
        return took

    def report(self) -> dict:
        took = self._took()
        return {"timed_s": {k: [round(x, 3) for x in v] for k, v in took.items()},
                "won": self.won or "not decided: the budget ended during the trial"}


def optimize(model: onnx.ModelProto, **options) -> tuple[onnx.ModelProto, dict]:
    """Rewrite ``model`` with the rules the search finds cheapest; return (model, JSON-able report).
    ``options``: those of :func:`optimize_graph`, which this is without a graph (``model`` is imported)."""
    result, _graph, report = optimize_graph(model, None, **options)
    return result, report


#: a measured rewrite replaces the input only when it is at least this much faster on the device
MEASURE_MARGIN = 0.02


@shared_copies()  # one copy of a weight's slice for every candidate that cuts it, per call (rules/base.py)
def optimize_graph(model: onnx.ModelProto, graph: gs.Graph | None = None, *, cost_model: CostModel | None = None,
                   streams: int = 4, alpha: float = DEFAULT_ALPHA, beta: float = 1.1, min_piece: int = 40,
                   max_piece: int = 120, top_k: int = 20, max_candidates: int = 200, max_candidates_total: int = 300,
                   seed: int = 0, measure: Measurer | Callable[[onnx.ModelProto], float] | None = None,
                   measure_margin: float = MEASURE_MARGIN, min_gain: float = 0.01, rules: list[Rule] | None = None
                   ) -> tuple[onnx.ModelProto, gs.Graph, dict]:
    """Rewrite ``model`` with the rules the search finds cheapest; return (model, its graph, JSON-able report).

    ``graph``: ``model`` in graphsurgeon with its shapes inferred (the loader's graph), which the search copies
    instead of importing ``model`` again and leaves as it is; None: ``model`` is imported.  The graph returned
    is ``graph`` when the result is the input, else the chosen candidate's own graph made the graph of the
    exported result (``ir.adopt_model``), so that nothing imports the result again.

    The search is bounded by work: ``max_candidates_total`` candidates in all, split over the pieces by their
    node counts, at most ``max_candidates`` per piece; no clock decides anything (measurements aside).
    A measured rewrite replaces the input only when it is at least ``measure_margin`` faster than the
    input measured the same way (the rest is noise); an estimated one when it is ``min_gain`` cheaper.
    ``measure`` is not called when no rewrite is estimated no costlier than the input: the input alone decides
    nothing (a build times the input's plan against its alternatives after the search, once).
    The returned model passes onnx.checker and strict shape inference and keeps the input's graph
    inputs and outputs; where nothing pays, it is the input itself.
    """
    t_start = time.perf_counter()
    cost_model = cost_model or RooflineCostModel()
    rules = list(ALL_RULES if rules is None else rules)
    streams = max(1, int(streams))
    timings: dict[str, float] = {}
    report: dict = {
        "version": REPORT_VERSION,
        "cost_model": getattr(cost_model, "describe", lambda: type(cost_model).__name__)(),
        "streams": streams, "alpha": alpha, "beta": beta, "seed": seed, "top_k": top_k,
        "budget": {"max_candidates_per_piece": max_candidates, "max_candidates_total": max_candidates_total,
                   "min_piece": min_piece, "max_piece": max_piece, "min_gain": min_gain},
        "rules": [r.name for r in rules],
    }

    original = import_graph(model) if graph is None else working_copy(graph)
    score = _Scorer(cost_model, streams, alpha)
    report["nodes_before"] = len(original.nodes)
    report["cost_before"] = _cost_dict(cost_model, original, streams, alpha)

    def unchanged(reason: str) -> tuple[onnx.ModelProto, gs.Graph, dict]:
        report.update(nodes_after=len(original.nodes), cost_after=report["cost_before"], pieces=report.get("pieces", []),
                      candidates=report.get("candidates", []), rules_chosen=[], rules_chosen_count={},
                      decided_by="unchanged", decision=reason)
        timings["total_s"] = time.perf_counter() - t_start
        report["timings"] = timings
        report["summary"] = f"unchanged ({reason})"
        return model, graph if graph is not None else original, report

    if _has_subgraphs(original):
        return unchanged("the model has control flow (If/Loop/Scan): not searched")
    t0 = time.perf_counter()
    why_not, report["precheck"] = precheck(original, rules, cost_model, min_gain)
    timings["precheck_s"] = time.perf_counter() - t0
    if why_not is not None:
        return unchanged(f"search skipped: {why_not}")

    # 1. pieces
    t0 = time.perf_counter()
    names = cut_pieces(original, min_piece, max_piece)
    pieces = [extract_piece(original, piece) for piece in names]
    timings["cut_s"] = time.perf_counter() - t0

    # 2. search inside each piece (or replay the recorded choice: ``Measurer.replay_pieces``)
    t0 = time.perf_counter()
    results: list[PieceResult] = []
    replay = getattr(measure, "replay_pieces", None)
    replayed = False
    if replay is not None:
        results, report["replay"] = _replay(pieces, replay, rules, score)
        replayed = report["replay"].startswith("replayed")
    rng = random.Random(seed)
    hasher = GraphHasher()
    total_nodes = max(1, sum(len(p) for p in names))
    for piece_names, piece in zip(names, pieces) if not replayed else ():
        share = max(1, min(max_candidates, round(max_candidates_total * len(piece_names) / total_nodes)))
        with _collector_paused():
            results.append(search_piece(piece, rules, score, beta=beta, max_candidates=share,
                                        rng=random.Random(rng.random()), hasher=hasher, keep=max(1, top_k)))
    timings["search_s"] = time.perf_counter() - t0

    refusals: dict[tuple[str, str], str] = {}
    for r in results:
        for key, reason in r.refusals.items():
            refusals.setdefault(key, reason)
    report["pieces"] = [
        {"index": i, "nodes": len(piece_names), "first": piece_names[0], "last": piece_names[-1],
         "inputs": len(p.inputs), "outputs": len(p.outputs), "cost_before_s": r.base_cost, "cost_after_s": r.candidates[0].cost,
         "candidates_tried": r.tried, "kept": len(r.candidates), "stopped_by": r.stopped, "seconds": r.seconds,
         "rules": list(r.candidates[0].trace)}
        for i, (piece_names, p, r) in enumerate(zip(names, pieces, results))
    ]

    # 3. the k best wholes
    t0 = time.perf_counter()
    with _collector_paused():  # 20 whole graphs built and costed: the same reason as a piece's candidates
        combos = k_best_combinations([[c.cost for c in r.candidates] for r in results], max(1, top_k))
        wholes = []
        for combo in combos:
            trace = [key for r, i in zip(results, combo) for key in r.candidates[i].trace]
            if not trace:
                continue  # the input itself, added below
            try:
                whole = assemble([r.candidates[i].graph for r, i in zip(results, combo)], original)
            except Exception as e:  # noqa: BLE001
                refusals.setdefault(("assemble", ",".join(map(str, combo))), f"{type(e).__name__}: {e}")
                continue
            wholes.append({"combo": combo, "graph": whole, "trace": trace, "cost": _cost_dict(cost_model, whole, streams, alpha)})
    original_entry = {"combo": None, "graph": original, "trace": [], "cost": report["cost_before"]}
    wholes.append(original_entry)
    wholes.sort(key=lambda w: (w["cost"]["mixed_s"], len(w["graph"].nodes), len(w["trace"])))
    timings["assemble_s"] = time.perf_counter() - t0

    # 4. decide: measured on the device, or by the cost model; never worse than the input by the cost model
    t0 = time.perf_counter()
    admissible = [w for w in wholes if w["cost"]["mixed_s"] <= report["cost_before"]["mixed_s"]]
    chosen, exported = None, {}
    if replayed:  # the recorded build measured its candidates and kept this one
        chosen = next((w for w in wholes if w["combo"] is not None), original_entry)
        report["decided_by"] = "measured"
        report["decision"] = f"{report['replay']}; {measure.decision or 'measured by the recorded build'}"
        report["measured_in_order"] = list(measure.measured)
    elif measure is not None and len(admissible) == 1:
        # the input alone: a measurement would decide nothing, and the build times the input's plan anyway
        # (against its alternatives); measuring it here compiled and loaded it once more for no decision
        chosen = original_entry
        report["decided_by"] = "cost_model"
        report["decision"] = "the input: no rewrite is estimated no costlier than the input, so nothing was measured"
    elif measure is not None:
        measurer = measure if isinstance(measure, Measurer) else TimedBy(measure)
        by_trace = bool(getattr(measurer, "by_trace", False))
        # the input first: a budget that runs out must never leave only rewrites measured
        order = [original_entry] + [w for w in admissible if w is not original_entry]
        ahead = max(1, int(measurer.lookahead))
        prepared: list[dict] = []
        prepared_ids: set[int] = set()
        # A measurer with a ``host`` lock (GpuMeasurer) holds it while it measures, except while the GPU times:
        # the next candidate can then be exported and prepared in a thread of this search's under that lock,
        # beside the timing, instead of between two measurements; which of the two is faster is timed
        # (``_Preparation``).  The input's preparation and that of the candidates right behind it are done before
        # it is measured either way: its measurement waits for the input's compile under the lock, and the
        # candidates' compiles must be queued meanwhile.
        host = None if isinstance(measurer, TimedBy) or by_trace else getattr(measurer, "host", None)
        held = host if host is not None else contextlib.nullcontext()
        ahead_pool = None
        pending = None
        stopping = threading.Event()
        mode = _Preparation(host is not None)

        def export(w) -> bool:
            if id(w) not in exported and "error" not in w:
                t = time.perf_counter()
                adopts = w is not original_entry and not isinstance(measurer, TimedBy)
                try:
                    if w is original_entry:
                        exported[id(w)] = model
                    elif adopts:  # its weights' bytes written only if it is the one kept (``export_model_aside``)
                        exported[id(w)], w["aside"] = export_model_aside(w["graph"], model)
                    else:
                        exported[id(w)] = export_model(w["graph"], model)
                except Exception as e:  # noqa: BLE001 - a candidate that cannot be exported is not chosen
                    w["error"] = f"{type(e).__name__}: {e}"
                else:
                    if adopts:
                        # the measurer plans the candidate from its own graph, as export_model exported it, rather
                        # than importing the export (a second import of every node and weight)
                        # (its unchanged weights the search's arrays, shared with the other candidates: the
                        # build knows their unchanged branches by them, and extracts them from these arrays)
                        mine = adopt_model(toposort(cleanup(copy_graph(w["graph"]))), exported[id(w)], keep_arrays=True)
                        if mine is not None:
                            with held:
                                measurer.adopt(exported[id(w)], mine)
                        else:  # the measurer imports it: with its weights
                            put_back(exported[id(w)], w.pop("aside"))
                timings["export_s"] = timings.get("export_s", 0.0) + time.perf_counter() - t
                timings["exported"] = timings.get("exported", 0) + 1
            return id(w) in exported

        def prepare_ahead(ws: list) -> None:
            """``measurer.prepare(models)`` for those of ``ws`` not prepared yet, in the order they will be
            measured (a GPU build compiles their engines in the background meanwhile), one model per call: the
            first one's compiles start before the next are exported."""
            for x in ws:
                if stopping.is_set():
                    return
                if id(x) in prepared_ids or not export(x) or stopping.is_set():
                    continue
                prepared_ids.add(id(x))
                with held:
                    t = time.perf_counter()
                    try:
                        prepared.append(measurer.prepare([exported[id(x)]]) or {})
                    except Exception as e:  # noqa: BLE001 - measuring compiles what preparing could not
                        prepared.append({"error": f"{type(e).__name__}: {e}"})
                    timings["prepare_s"] = timings.get("prepare_s", 0.0) + time.perf_counter() - t

        spent = None
        try:
            for i, w in enumerate(order):
                if spent is not None:  # the budget is spent: the rest are neither exported nor prepared
                    w["error"] = spent
                    continue
                if by_trace:  # times known by the rewrites: nothing exported, prepared or loaded
                    def timed(w=w):
                        return measurer.measure_trace(tuple(w["trace"]))
                else:
                    if not isinstance(measurer, TimedBy):
                        if pending is not None:  # the models ahead, prepared during the last measurement
                            pending.result()
                            pending = None
                        if not mode.beside(i):
                            prepare_ahead(order[i:i + ahead + 1])
                        else:
                            prepare_ahead(order[i:i + 1])  # prepared already, unless its export failed
                            if ahead_pool is None:
                                ahead_pool = concurrent.futures.ThreadPoolExecutor(
                                    1, thread_name_prefix="parastream-search-ahead")
                            pending = ahead_pool.submit(prepare_ahead, order[i + 1:i + ahead + 1])
                    if not export(w):
                        continue

                    def timed(w=w):
                        return measurer.measure(exported[id(w)])
                try:
                    w["measured_s"] = float(timed())
                except Exception as e:  # noqa: BLE001 - a candidate that cannot be built or run is not chosen
                    w["error"] = f"{type(e).__name__}: {e}"
                    if isinstance(e, MeasureBudgetSpent):
                        spent = w["error"]
                        stopping.set()
        finally:
            stopping.set()
            if pending is not None:
                pending.result()
            if ahead_pool is not None:
                ahead_pool.shutdown(wait=True)
        if mode.enabled:
            report["preparation"] = mode.report()
        if not isinstance(measurer, TimedBy) and not by_trace:
            report["prepared"] = prepared
        measured = [w for w in admissible if "measured_s" in w]
        again = getattr(measurer, "confirm", None)
        if again is not None and not by_trace:
            confirmed = confirm_fastest(measured, original_entry, lambda w: again(exported[id(w)]), measure_margin)
            if confirmed:
                report["confirmed"] = confirmed
        # what was measured, in the order it was, each time as ``confirm_fastest`` left it (a later build of the same
        # model may take these times: pipeline/timings.py)
        report["measured_in_order"] = [{"trace": list(w["trace"]), "seconds": w["measured_s"]}
                                       for w in order if "measured_s" in w]
        if measured:
            chosen = min(measured, key=lambda w: (w["measured_s"], w["cost"]["mixed_s"]))
            report["decided_by"] = "measured"
            report["decision"] = f"fastest of {len(measured)} candidates measured on the device"
            base = original_entry.get("measured_s")
            if chosen is not original_entry and base is not None and chosen["measured_s"] > base * (1.0 - measure_margin):
                report["decision"] = (f"the input: no rewrite of the {len(measured) - 1} measured was at least "
                                      f"{measure_margin:.0%} faster on the device")
                chosen = original_entry
    if chosen is None:
        chosen = admissible[0]
        report["decided_by"] = "cost_model"
        report["decision"] = ("the cost model decided: no measure callback (no GPU backend)" if measure is None
                              else "the cost model decided: no candidate could be measured")
        before_s = report["cost_before"]["mixed_s"]
        if chosen is not original_entry and chosen["cost"]["mixed_s"] > before_s * (1.0 - min_gain):
            report["decision"] = (f"the input: no rewrite is estimated at least {min_gain:.0%} cheaper "
                                  "(within the cost model's precision)")
            chosen = original_entry
    timings["measure_s"] = time.perf_counter() - t0
    # each piece's rewrites of the candidate kept, for a rebuild to replay (pipeline/timings.py)
    report["chosen_pieces"] = ([list(r.candidates[i].trace) for r, i in zip(results, chosen["combo"])]
                               if chosen.get("combo") is not None else [[] for _ in results])

    result = model
    if chosen is not original_entry:
        try:
            result = exported.get(id(chosen))
            result = put_back(result, chosen.pop("aside", {})) if result is not None else export_model(chosen["graph"], model)
            _check_interface(model, result)
        except Exception as e:  # noqa: BLE001 - an export failure is a bug in a rule; the input is still valid
            report["export_error"] = f"{type(e).__name__}: {e}"
            chosen, result = original_entry, model
    report["candidates"] = [
        {"rank": i, "estimated_s": w["cost"]["mixed_s"], "critical_path_s": w["cost"]["critical_path_s"],
         "total_work_s": w["cost"]["total_work_s"], "measured_s": w.get("measured_s"), "error": w.get("error"),
         **({"timings_s": w["timings_s"]} if "timings_s" in w else {}),
         "rewrites": len(w["trace"]), "input": w is original_entry, "chosen": w is chosen}
        for i, w in enumerate(wholes)
    ]
    chosen_graph = chosen["graph"]
    report["nodes_after"] = len(chosen_graph.nodes)
    report["cost_after"] = chosen["cost"]
    report["rules_chosen"] = list(chosen["trace"])
    counts: dict[str, int] = {}
    for key in chosen["trace"]:
        counts[key.split(":", 1)[0]] = counts.get(key.split(":", 1)[0], 0) + 1
    report["rules_chosen_count"] = counts
    not_fired: dict[str, list[str]] = {}
    for rule in rules:
        if rule.name in counts:
            continue
        reasons = sorted({f"{site}: {reason}" for (name, site), reason in refusals.items() if name == rule.name})
        not_fired[rule.name] = reasons[:5] if reasons else ["no site matched, or no site paid"]
    report["rules_not_fired"] = not_fired
    report["refusals"] = [{"rule": name, "site": site, "reason": reason}
                          for (name, site), reason in sorted(refusals.items())[:_MAX_REFUSALS]]
    report["refusals_total"] = len(refusals)
    timings["total_s"] = time.perf_counter() - t_start
    report["timings"] = timings
    before, after = report["cost_before"]["mixed_s"], report["cost_after"]["mixed_s"]
    gain = (1 - after / before) * 100 if before else 0.0
    report["summary"] = (f"{report['nodes_before']} → {report['nodes_after']} nodes, estimated "
                         f"{before * 1e6:.1f} → {after * 1e6:.1f} µs ({gain:.0f}% less), "
                         f"{len(chosen['trace'])} rewrites in {len(pieces)} pieces, "
                         f"{'measured on the device' if report['decided_by'] == 'measured' else 'decided by the cost model'}")
    if result is model:
        return model, graph if graph is not None else original, report
    chosen_graph = toposort(cleanup(chosen_graph))  # as export_model exported it (its order, its tensors)
    # (imported only if the export's node list were not the graph's: the graph the loader's graph_of would give)
    return result, adopt_model(chosen_graph, result) or toposort(gs.import_onnx(result)), report


def _replay(pieces: list[gs.Graph], replay: list[list[str]], rules: list[Rule], score) -> tuple[list, str]:
    """Each piece's recorded rewrites replayed (``replay_piece``), one candidate per piece: (the pieces' results,
    what was replayed), or ([], why not) at the first piece that does not replay.  ``replay`` comes from a file
    in the cache folder: anything but one list of rewrite keys per piece is not replayed."""
    if not isinstance(replay, list) or not all(isinstance(t, list) and all(isinstance(k, str) for k in t) for t in replay):
        return [], "not replayed: the record's choice is not one list of rewrites per piece"
    if len(replay) != len(pieces):
        return [], f"not replayed: {len(replay)} recorded pieces for {len(pieces)}"
    results = []
    for i, (piece, trace) in enumerate(zip(pieces, replay)):
        t = time.perf_counter()
        cand, why = replay_piece(piece, list(trace), rules, score)
        if cand is None:
            return [], f"not replayed: piece {i}: {why}"
        results.append(PieceResult(base_cost=score(piece), candidates=[cand], tried=len(trace), stopped="replayed",
                                   seconds=time.perf_counter() - t))
    return results, f"replayed the recorded build's choice ({sum(len(t) for t in replay)} rewrites)"


def _check_interface(before: onnx.ModelProto, after: onnx.ModelProto) -> None:
    """Same graph inputs and outputs: names, element types and shapes."""
    inits = {t.name for t in before.graph.initializer}

    def sig(values, skip=()):
        return [(v.name, v.type.tensor_type.elem_type,
                 [d.dim_value if d.HasField("dim_value") else d.dim_param for d in v.type.tensor_type.shape.dim])
                for v in values if v.name not in skip]

    after_inits = {t.name for t in after.graph.initializer}
    if sig(before.graph.input, inits) != sig(after.graph.input, after_inits):
        raise ValueError("the rewritten model's inputs differ from the input model's")
    if sig(before.graph.output) != sig(after.graph.output):
        raise ValueError("the rewritten model's outputs differ from the input model's")


# ---------------------------------------------------------------------------------------------
# Report as a table
# ---------------------------------------------------------------------------------------------


def _rule_counts(keys) -> str:
    counts: dict[str, int] = {}
    for key in keys:
        rule = key.split(":", 1)[0]
        counts[rule] = counts.get(rule, 0) + 1
    return ", ".join(f"{rule}×{n}" for rule, n in counts.items()) or "-"


def format_report(report: dict):
    """The search report as a rich Table: one row per piece, the whole, measured candidates, rules that did not fire.

    Site-by-site detail (``rules_chosen``, ``refusals``) stays in the report itself.
    """
    from rich.markup import escape
    from rich.table import Table

    def us(s):
        return "-" if s is None else f"{s * 1e6:.1f} µs"

    t = Table(title=f"rewrite search: {escape(report.get('summary', ''))}")
    for col in ("piece", "nodes", "first … last", "est. before", "est. after", "tried", "stopped by", "rewrites chosen"):
        t.add_column(col, overflow="fold")
    for p in report.get("pieces", []):
        t.add_row(str(p["index"]), str(p["nodes"]), escape(f"{p['first']} … {p['last']}"), us(p["cost_before_s"]),
                  us(p["cost_after_s"]), str(p["candidates_tried"]), p["stopped_by"], escape(_rule_counts(p["rules"])))
    cb, ca = report.get("cost_before", {}), report.get("cost_after", {})
    t.add_section()
    t.add_row("whole", f"{report.get('nodes_before')} → {report.get('nodes_after')}", "",
              us(cb.get("mixed_s")), us(ca.get("mixed_s")), str(len(report.get("candidates", []))),
              report.get("decided_by", ""), escape(_rule_counts(report.get("rules_chosen", []))))
    measured = [c for c in report.get("candidates", []) if c.get("measured_s") is not None]
    if measured:
        t.add_section()
        for c in measured:
            t.add_row(f"cand {c['rank']}", "", "input" if c["input"] else f"{c['rewrites']} rewrites", us(c["estimated_s"]),
                      f"measured {us(c['measured_s'])}", "", "chosen" if c["chosen"] else "", "")
    not_fired = report.get("rules_not_fired", {})
    if not_fired:
        t.add_section()
        for rule, reasons in not_fired.items():
            t.add_row("not fired", "", rule, "", "", "", "", escape("; ".join(reasons[:2])))
    t.caption = escape(report.get("decision", ""))
    return t
