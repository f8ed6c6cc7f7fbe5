"""Build time: the search's cheaper primitives give exactly what they replace, on every candidate that
real searches make: our cleanup is graphsurgeon's ``cleanup(remove_unused_graph_inputs=False)``, the hasher's
remembered node texts and zero-bias answers are the ones computed afresh, node keys computed with a per-graph
tensor-key dict are the plain ones, and a graph's cost through them is the same float."""

from __future__ import annotations

import hashlib
import random
import sys
from pathlib import Path

import numpy as np
import onnx_graphsurgeon as gs
import pytest

from parastream.pipeline import zoo
from parastream.rewrite import ALL_RULES, RooflineCostModel
from parastream.core.schedule import estimate_latency, schedule_graph
from parastream.rewrite.cost import node_key
from parastream.rewrite.ir import (GraphHasher, _attr_text, _canonical_attrs, _canonical_inputs, cleanup, constant_digest,
                                   copy_graph, import_graph)
from parastream.rewrite.rules.base import taken_names

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import test_ir_speed  # noqa: E402
from test_ir_speed import MODELS  # noqa: E402


def _objects(graph: gs.Graph) -> list:
    """test_ir_speed's attribute-by-attribute description, with weights by their bytes (two rewrites of the same
    site make equal new arrays, not the same one)."""
    arrays = {}
    for t in graph.tensors().values():
        if isinstance(t, gs.Constant):
            arrays[id(t._values)] = (t._values.dtype.str, t._values.shape,
                                     hashlib.sha256(np.ascontiguousarray(t._values).tobytes()).hexdigest())
    desc = test_ir_speed._objects(graph)

    def swap(v):
        if isinstance(v, tuple) and len(v) == 2 and v[0] == "array":
            return ("array", arrays.get(v[1], v[1]))
        if isinstance(v, (list, tuple)):
            return type(v)(swap(x) for x in v)
        return v

    return swap(desc)


def _graphs():
    return [import_graph(m) for m in MODELS] + [import_graph(zoo.MODELS[name]()) for name in sorted(zoo.MODELS)]


def _candidates(limit_per_graph: int = 40):
    """Graphs as the search makes them: each rule applied at each site, and again on the results (seeded)."""
    rng = random.Random(0)
    out = []
    for g in _graphs():
        frontier, made = [g], [g]
        while frontier and len(made) < limit_per_graph:
            cur = frontier.pop(0)
            for rule in ALL_RULES:
                for site in rule.match(cur):
                    if rule.check(cur, site) is not None:
                        continue
                    try:
                        child = rule.apply(cur, site)
                    except Exception:  # noqa: BLE001 - the search skips a failing site the same way
                        continue
                    made.append(child)
                    frontier.append(child)
        rng.shuffle(made)
        out.extend(made[:limit_per_graph])
    return out


CANDIDATES = None


def candidates():
    global CANDIDATES
    if CANDIDATES is None:
        CANDIDATES = _candidates()
    return CANDIDATES


def _reference_hash(graph: gs.Graph) -> str:
    """GraphHasher's hash as it was before its memos (constants hashed afresh, every text rebuilt)."""
    tensor_hash: dict[int, str] = {}
    for t in graph.inputs:
        tensor_hash[id(t)] = "in:" + t.name
    node_hashes = []
    for node in graph.nodes:
        parts = [node.op, node.domain or ""]
        attrs = _canonical_attrs(node)
        for k in sorted(attrs):
            parts.append(f"{k}={_attr_text(attrs[k])}")
        for t in _canonical_inputs(node):
            if t is None or not getattr(t, "name", ""):
                parts.append("-" if not isinstance(t, str) else t)
            elif isinstance(t, gs.Constant):
                parts.append(constant_digest(t.values))
            else:
                parts.append(tensor_hash.get(id(t), "ext:" + t.name))
        digest = hashlib.blake2b("|".join(parts).encode(), digest_size=12).hexdigest()
        node_hashes.append(digest)
        for i, t in enumerate(node.outputs):
            tensor_hash[id(t)] = f"{digest}#{i}"
    outs = [tensor_hash.get(id(t), "ext:" + t.name) for t in graph.outputs]
    body = "|".join(sorted(node_hashes)) + "||" + "|".join(outs)
    return hashlib.blake2b(body.encode(), digest_size=16).hexdigest()


def test_there_are_candidates_of_every_kind():
    cands = candidates()
    assert len(cands) > 100
    assert len({_reference_hash(c) for c in cands}) > 50  # distinct graphs, not one graph many times


def test_cleanup_is_graphsurgeons_on_search_candidates():
    """Each rule's rewrite on a copy, then our cleanup on one copy and graphsurgeon's on another: the same graph,
    attribute by attribute (nodes, tensors, producer and consumer lists, in order)."""
    checked = 0
    for g in candidates()[::7]:
        for rule in ALL_RULES:
            for site in rule.match(g)[:2]:
                if rule.check(g, site) is not None:
                    continue
                a, b = copy_graph(g), copy_graph(g)
                rule.rewrite(a, site)
                rule.rewrite(b, site)
                assert _objects(cleanup(a)) == _objects(b.cleanup(remove_unused_graph_inputs=False))
                checked += 1
    assert checked > 50


def test_cleanup_drops_what_no_output_reads_and_keeps_the_rest():
    x = gs.Variable("x", np.float32, [1, 4])
    y, dead, z = (gs.Variable(n, np.float32, [1, 4]) for n in ("y", "dead", "z"))
    used = gs.Node("Relu", "used", inputs=[x], outputs=[y])
    unused = gs.Node("Sigmoid", "unused", inputs=[x], outputs=[dead])
    tail = gs.Node("Neg", "tail", inputs=[y], outputs=[z])
    ours = gs.Graph(nodes=[used, unused, tail], inputs=[x], outputs=[z])
    theirs = copy_graph(ours)
    cleanup(ours)
    theirs.cleanup(remove_unused_graph_inputs=False)
    assert [n.name for n in ours.nodes] == [n.name for n in theirs.nodes] == ["used", "tail"]
    assert not unused.inputs and not unused.outputs and unused not in x.outputs  # disconnected as graphsurgeon does
    assert _objects(ours) == _objects(theirs)


def test_hasher_memos_give_the_fresh_hash():
    cands = candidates()
    shared = GraphHasher()
    for g in cands + cands[::-1]:  # twice: the second pass answers from the memos
        assert shared(g) == _reference_hash(g) == GraphHasher()(g)


def test_hasher_tells_a_changed_attribute_from_the_original():
    """The memo is keyed by the attribute values' identity: a rule's new value (a new object) is a new text."""
    g = import_graph(zoo.MODELS["inception_block"]())
    h = GraphHasher()
    before = h(g)
    c = copy_graph(g)
    conv = next(n for n in c.nodes if n.op == "Conv")
    conv.attrs["strides"] = [2, 2] if list(conv.attrs.get("strides", [1, 1])) != [2, 2] else [1, 1]
    assert h(c) == _reference_hash(c) != before == h(g)


@pytest.mark.parametrize("fused", [True, False])
def test_node_keys_with_a_tensor_key_dict_are_the_plain_ones(fused):
    for g in candidates():
        keys: dict = {}
        for n in g.nodes:
            assert node_key(n, fused, keys) == node_key(n, fused)


def test_graph_cost_is_the_shipped_schedules_estimate_on_every_candidate():
    """graph_cost's per-graph figures (node keys computed once per graph, one dict for cost and bound) give, to
    the bit, what the build's scheduler gives from node_cost and is_memory_bound one node at a time."""
    cm = RooflineCostModel("CPU")
    for g in candidates():
        plain = RooflineCostModel("CPU")
        for streams in (1, 2, 3, 4):
            sched = schedule_graph(g, streams, plain.node_cost, plain.is_memory_bound)
            assert cm.graph_cost(g, streams) == (estimate_latency(sched), float(sum(plain.node_cost(n) for n in g.nodes)))


def test_taken_names_are_graphsurgeons_tensor_names_and_node_names():
    for g in candidates():
        assert taken_names(g) == {n.name for n in g.nodes} | set(g.tensors().keys())


def test_shared_copies_hand_out_one_copy_per_view():
    from parastream.rewrite.rules.base import contiguous, shared_copies

    w = np.arange(48, dtype=np.float32).reshape(6, 8)
    outside = contiguous(w[:, 2:5])
    assert outside.flags.c_contiguous and np.array_equal(outside, w[:, 2:5]) and contiguous(w[:, 2:5]) is not outside
    with shared_copies():
        a, b, c = contiguous(w[:, 2:5]), contiguous(w[:, 2:5]), contiguous(w[:, 3:6])
        assert a is b and a is not c
        assert np.array_equal(a, w[:, 2:5]) and np.array_equal(c, w[:, 3:6]) and a.flags.c_contiguous
        rows = w[1:3]  # already contiguous: the view itself, as np.ascontiguousarray gives it, and after it that view
        assert contiguous(rows) is rows and contiguous(w[1:3]) is rows and not rows.flags.owndata
    assert contiguous(w[:, 2:5]) is not a  # the scope is gone


def test_the_search_finds_the_same_with_and_without_shared_copies(monkeypatch):
    """optimize shares fission's weight slices between candidates; with a scope that shares nothing, the same
    rules, cost and model bytes (transformer_layer: MatMul weights cut along columns, strided views)."""
    import contextlib

    import parastream.rewrite.search as search_module
    from parastream.rewrite import optimize

    for name in ("transformer_layer", "inception_block"):
        model = zoo.MODELS[name]()
        cm = RooflineCostModel("CPU")
        shared, rep = optimize(model, cost_model=cm, streams=2, seed=0, max_candidates_total=120)
        with monkeypatch.context() as m:
            m.setattr(search_module, "shared_copies", contextlib.nullcontext)
            fresh, rep2 = optimize(model, cost_model=RooflineCostModel("CPU"), streams=2, seed=0, max_candidates_total=120)
        assert rep["rules_chosen"] == rep2["rules_chosen"]
        assert rep["cost_after"] == rep2["cost_after"]
        assert [c["estimated_s"] for c in rep["candidates"]] == [c["estimated_s"] for c in rep2["candidates"]]
        assert shared.SerializeToString(deterministic=True) == fresh.SerializeToString(deterministic=True)
