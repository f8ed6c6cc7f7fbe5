"""Stream assignment, branches and launch order (core/schedule.py), with cost functions given by the test."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from graphs import ort_reference, three_branch_model
from onnx import TensorProto, helper, numpy_helper, shape_inference

from parastream.core.graph import node_edges
from parastream.core.schedule import (choose_streams, estimate_latency, launch_order, place, schedule_graph,
                                      schedule_latency)
from parastream.launcher.plan import TensorSpec
from parastream.pipeline.partition import extract_branch, make_plan


def gs_graph(model):
    g = gs.import_onnx(shape_inference.infer_shapes(model))
    g.toposort()
    return g


def unit_cost(node):
    return 10e-6 if node.op == "Conv" else 1e-6


def conv_compute(node):
    return node.op != "Conv"


def chain_model(n=5):
    nodes = [helper.make_node("Relu" if i % 2 else "Sigmoid", [f"t{i}"], [f"t{i + 1}"], name=f"n{i}") for i in range(n)]
    g = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("t0", TensorProto.FLOAT, [4])],
                          [helper.make_tensor_value_info(f"t{n}", TensorProto.FLOAT, [4])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def random_dag_model(seed: int, n: int = 14):
    """A random DAG of MatMul/Add/Tanh nodes over [1, 8] tensors; every tensor eventually reaches the output."""
    rng = np.random.default_rng(seed)
    nodes, inits, avail = [], [], ["x"]
    for i in range(n):
        kind = rng.choice(["mm", "add", "tanh"])
        a = str(rng.choice(avail))
        if kind == "mm":
            w = numpy_helper.from_array((rng.standard_normal((8, 8)) * 0.3).astype(np.float32), f"w{i}")
            inits.append(w)
            nodes.append(helper.make_node("MatMul", [a, f"w{i}"], [f"v{i}"], name=f"mm{i}"))
        elif kind == "add":
            b = str(rng.choice(avail))
            nodes.append(helper.make_node("Add", [a, b], [f"v{i}"], name=f"add{i}"))
        else:
            nodes.append(helper.make_node("Tanh", [a], [f"v{i}"], name=f"tanh{i}"))
        avail.append(f"v{i}")
    used = {t for nd in nodes for t in nd.input}
    leaves = [t for t in avail[1:] if t not in used]
    acc = leaves[0]
    for j, t in enumerate(leaves[1:]):
        nodes.append(helper.make_node("Add", [acc, t], [f"s{j}"], name=f"sum{j}"))
        acc = f"s{j}"
    nodes.append(helper.make_node("Identity", [acc], ["y"], name="out"))
    g = helper.make_graph(nodes, f"dag{seed}", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_chain_is_one_branch_on_one_stream():
    g = gs_graph(chain_model())
    s = schedule_graph(g, 4, unit_cost, conv_compute)
    assert s.num_streams == 1
    assert len(s.branches) == 1 and len(s.branches[0]) == 5
    assert s.makespan == pytest.approx(s.total_work)


def test_independent_branches_spread_over_streams():
    g = gs_graph(three_branch_model())
    s3 = schedule_graph(g, 3, unit_cost, conv_compute)
    s1 = schedule_graph(g, 1, unit_cost, conv_compute)
    assert s3.num_streams == 3
    assert {s3.node_stream[f"conv{i}"] for i in range(3)} == {0, 1, 2}
    assert s1.num_streams == 1 and len(s1.branches) == 1
    assert s1.makespan == pytest.approx(s1.total_work)
    # three 11 µs branches side by side, then concat+sigmoid: about a third of the conv work on the critical path
    assert s3.makespan < 0.5 * s1.makespan


def test_two_streams_for_three_branches_keep_every_node():
    g = gs_graph(three_branch_model())
    s = schedule_graph(g, 2, unit_cost, conv_compute)
    assert s.num_streams == 2
    assert sorted(n for b in s.branches for n in b) == sorted(n.name for n in g.nodes)


def test_launch_order_alternates_compute_and_memory_bound():
    """Two ready branches at the same time: after a compute-bound one, the memory-bound one goes next."""
    g = gs_graph(three_branch_model())
    # conv1 (3x3) memory-bound, the others compute-bound: order must not put two compute-bound first
    s = schedule_graph(g, 3, unit_cost, lambda n: n.name in ("conv1", "relu1"))
    first_two = [s.branch_bound[b] for b in s.launch_order[:2]]
    assert sorted(first_two) == ["compute", "memory"]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("streams", [2, 3])
def test_random_dags_give_valid_plans_that_compute_the_model(seed, streams, tmp_path):
    from parastream.pipeline import build
    from parastream.launcher import load

    model = random_dag_model(seed)
    g = gs_graph(model)
    s = schedule_graph(g, streams, unit_cost, conv_compute)
    plan = make_plan(g, s, backend="onnxruntime", precision="fp32", suffix=".onnx",
                     inputs=[TensorSpec("x", "float32", [1, 8])], outputs=[TensorSpec("y", "float32", [1, 8])])
    plan.validate()
    # every branch extracts into a valid standalone model with exactly its nodes
    for b in plan.branches:
        sub = extract_branch(model, g, b)
        onnx.checker.check_model(sub)
        assert [n.name for n in sub.graph.node] == b.nodes
    p = tmp_path / "m.onnx"
    onnx.save(model, p)
    bundle = build(p, tmp_path / "out", backend="onnxruntime", search=False, streams=streams, verify=False)
    x = np.random.default_rng(seed).standard_normal((1, 8)).astype(np.float32)
    got = load(bundle.path)({"x": x})["y"]
    ref = ort_reference(model, {"x": x})["y"]
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


# -- chains, engine-level estimate, number of streams ------------------------------------------------
def test_chains_stay_whole():
    """Conv -> Relu is one chain: each branch of the three-branch model runs whole on one stream, however cheap Relu is."""
    g = gs_graph(three_branch_model())
    s = schedule_graph(g, 3, lambda n: 10e-6 if n.op == "Conv" else 0.0, conv_compute)
    for i in range(3):
        assert s.node_stream[f"conv{i}"] == s.node_stream[f"relu{i}"]
    assert not any(b == ["relu0"] or b == ["relu1"] or b == ["relu2"] for b in s.branches)


def test_estimate_latency_by_hand():
    """Three 10 µs convs on three streams, then concat+sigmoid (2 µs) on one: engines 3 µs, events 2 µs."""
    g = gs_graph(three_branch_model())
    s = schedule_graph(g, 3, unit_cost, conv_compute, sync_cost=0.0)
    assert s.num_streams == 3 and len(s.branches) == 4
    # each conv+relu engine: 11 µs + 3 µs; the tail waits for the two other streams (+2 µs) and costs 2 + 3 µs
    assert estimate_latency(s, engine_cost=3e-6, event_cost=2e-6) == pytest.approx(14e-6 + 2e-6 + 5e-6)
    one = schedule_graph(g, 1, unit_cost, conv_compute)
    assert estimate_latency(one, engine_cost=3e-6) == pytest.approx(3 * 11e-6 + 2e-6 + 3e-6)


def test_choose_streams_takes_parallel_branches_that_pay():
    g = gs_graph(three_branch_model())
    sched, tried = choose_streams(g, 4, unit_cost, conv_compute)
    assert sched.num_streams == 3
    assert [t["streams"] for t in tried] == [1, 2, 3]
    assert [t["chosen"] for t in tried] == [False, False, True]
    assert tried[2]["estimated_s"] < 0.9 * tried[0]["estimated_s"]


def test_choose_streams_keeps_one_stream_when_branches_are_too_small():
    """Branches of 1 µs each cannot pay 3 µs per engine and 2 µs per event: one engine for the whole model."""
    g = gs_graph(three_branch_model())
    sched, tried = choose_streams(g, 4, lambda n: 1e-6, conv_compute)
    assert sched.num_streams == 1 and len(sched.branches) == 1
    assert tried[0]["chosen"] and all(not t["chosen"] for t in tried[1:])


def test_choose_streams_needs_the_minimum_gain():
    g = gs_graph(three_branch_model())
    _, tried = choose_streams(g, 4, unit_cost, conv_compute)
    gain = 1 - tried[2]["estimated_s"] / tried[0]["estimated_s"]
    sched, _ = choose_streams(g, 4, unit_cost, conv_compute, min_gain=gain + 0.01)
    assert sched.num_streams == 1
    sched, _ = choose_streams(g, 4, unit_cost, conv_compute, min_gain=gain - 0.01)
    assert sched.num_streams == 3


def _reference_place(preds, succs, c, k, sync_cost=2e-6):
    """The placement written with dicts, sets and key functions, as the build's scheduler first read (before
    it was flattened for the search, which schedules every candidate): (stream, start) per node."""
    import heapq

    n = len(c)
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
    rank: dict[int, float] = {}
    for u in reversed(units):
        rank[u] = uc[u] + max((rank[v] for v in usuccs[u]), default=0.0)
    free, start, where = [0.0] * k, [0.0] * n, [-1] * n
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
            t0 = free[s_]
            for p in upreds[u]:
                t0 = max(t0, ufinish[p] + (sync_cost if ustream[p] != s_ else 0.0))
            key = (t0 + uc[u], 0 if (heavy is not None and ustream[heavy] == s_) else 1, s_)
            if best is None or key < best[0]:
                best = (key, s_, t0)
        _, s_, t = best
        for i in members[u]:
            where[i], start[i] = s_, t
            t += c[i]
        ustream[u], ufinish[u] = s_, t
        free[s_] = t
        for v in usuccs[u]:
            remaining[v] -= 1
            if remaining[v] == 0:
                heapq.heappush(ready, (-rank[v], v))
    return where, start


@pytest.mark.parametrize("seed", range(6))
def test_placement_is_the_reference_formulation_with_ties(seed):
    """Random DAGs, costs with many ties: the flattened placement puts every node on the same stream at the same
    start as the formulation with dicts and key functions (ties between streams and units broken alike)."""
    import random

    rng = random.Random(seed)
    edges = node_edges(gs_graph(random_dag_model(seed, n=24)))
    for _ in range(10):
        c = [rng.choice([1e-9, 1e-6, 2e-6, 2e-6, 5e-6, rng.random() * 1e-5]) for _ in edges[0]]
        for k in (1, 2, 3, 4):
            where, start, _finish = place(*edges, c, k)
            assert (where, start) == _reference_place(*edges, c, k)


def _reference_launch_order(branch_preds, branch_bound, branch_start):
    """The launch order written with a ready set and one key function: among the ready branches that could start
    at the earliest simulated time, the other bound than the last one's, then the earliest start, then the id."""
    nb = len(branch_preds)
    indeg = [len(p) for p in branch_preds]
    ready, launch, last = {b for b in range(nb) if indeg[b] == 0}, [], None
    while ready:
        earliest = min(branch_start[b] for b in ready)
        pick = min((b for b in ready if branch_start[b] <= earliest + 1e-12),
                   key=lambda b: (0 if last is None or branch_bound[b] != last else 1, branch_start[b], b))
        ready.remove(pick)
        launch.append(pick)
        last = branch_bound[pick]
        for v in range(nb):
            if pick in branch_preds[v]:
                indeg[v] -= 1
                if indeg[v] == 0:
                    ready.add(v)
    return launch


@pytest.mark.parametrize("seed", range(6))
def test_launch_order_is_the_reference_formulation_with_ties(seed):
    """Random branch DAGs with many equal starts and both bounds: the sorted-ready-list launch order is the
    reference's, branch for branch."""
    import random

    rng = random.Random(seed)
    for _ in range(40):
        nb = rng.randint(1, 30)
        preds = [{p for p in range(b) if rng.random() < 0.15} for b in range(nb)]
        start = [rng.choice([0.0, 1e-6, 2e-6, 2e-6 + 1e-13, rng.random() * 1e-5]) for _ in range(nb)]
        bound = [rng.choice(["compute", "memory"]) for _ in range(nb)]
        assert launch_order(preds, bound, start) == _reference_launch_order(preds, bound, start)


def test_place_needs_no_topological_node_order():
    """Nodes listed consumers first: with costs that tie nowhere, the same placement as in topological order,
    node for node, and every node starts after its producers."""
    g = gs_graph(three_branch_model())
    preds, succs = node_edges(g)
    n = len(preds)
    c = [unit_cost(node) + i * 1e-8 for i, node in enumerate(g.nodes)]
    rev = list(reversed(range(n)))  # node i is listed at n - 1 - i
    rpreds = [[n - 1 - p for p in preds[i]] for i in rev]
    rsuccs = [[n - 1 - s for s in succs[i]] for i in rev]
    where, start, finish = place(preds, succs, c, 2)
    rwhere, rstart, _ = place(rpreds, rsuccs, [c[i] for i in rev], 2)
    assert [rstart[n - 1 - i] for i in range(n)] == start
    assert [rwhere[n - 1 - i] for i in range(n)] == where
    assert all(start[i] >= finish[p] for i in range(n) for p in preds[i])


def test_schedule_latency_is_estimate_latency_of_the_schedule():
    """What the search charges a graph is estimate_latency of the schedule the build ships for it."""
    g = gs_graph(three_branch_model())
    for k in (1, 2, 3):
        sched = schedule_graph(g, k, unit_cost, conv_compute)
        assert schedule_latency(node_edges(g), [unit_cost(n) for n in g.nodes], [conv_compute(n) for n in g.nodes], k) \
            == estimate_latency(sched)
