"""The search's own graph primitives (copy, toposort, node costs, constant hashes) give exactly what
onnx-graphsurgeon's and the uncached ones give: they exist only to make the search cheaper."""

from __future__ import annotations

import gc
import random
import sys
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from parastream.rewrite import RooflineCostModel
from parastream.rewrite.cost import _flops_bytes_tiles, is_fused_epilogue
from onnx_graphsurgeon.util.misc import SynchronizedList

from parastream.rewrite.ir import GraphHasher, _copy_slow, cleanup, copy_graph, import_graph, toposort

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from graphs import nested_concat_model, three_branch_model  # noqa: E402
from onnx_cases import attention_layer, inception_block, misc_ops  # noqa: E402

MODELS = [three_branch_model(), nested_concat_model(), inception_block(), attention_layer(), misc_ops()]


def _describe(graph: gs.Graph):
    return ([(n.name, n.op, [t.name for t in n.inputs], [t.name for t in n.outputs], dict(n.attrs)) for n in graph.nodes],
            [(t.name, type(t).__name__, t.dtype if isinstance(t, gs.Variable) else None,
              t.shape if isinstance(t, gs.Variable) else t.values.shape) for t in graph.tensors().values()],
            [t.name for t in graph.inputs], [t.name for t in graph.outputs])


def test_copy_graph_is_graphsurgeons_copy():
    for model in MODELS:
        g = import_graph(model)
        ours, theirs = copy_graph(g), g.copy()
        assert _describe(ours) == _describe(theirs) == _describe(g)
        # a detached copy: nodes and tensors are new objects, the weights are shared (as Graph.copy shares them)
        assert not {id(n) for n in ours.nodes} & {id(n) for n in g.nodes}
        assert all(a is not b for a, b in zip(ours.tensors().values(), g.tensors().values()))
        ours.nodes[0].name = "renamed"
        assert g.nodes[0].name != "renamed"


def _objects(graph: gs.Graph) -> list:
    """Every attribute of the graph, its nodes and tensors (tensors and nodes by their position), with the
    consumer and producer lists and their kinds, and which objects are shared with another graph."""
    order: dict[int, str] = {}
    for i, n in enumerate(graph.nodes):
        order[id(n)] = f"node{i}"
    tensors = []
    for n in graph.nodes:
        for t in (*n.inputs, *n.outputs):
            if id(t) not in order:
                order[id(t)] = f"tensor{len(tensors)}"
                tensors.append(t)
    for t in (*graph.inputs, *graph.outputs):
        if id(t) not in order:
            order[id(t)] = f"tensor{len(tensors)}"
            tensors.append(t)

    def value(v):
        if id(v) in order:
            return order[id(v)]
        if isinstance(v, list):
            # the fast copy's lists are SynchronizedList with their two fields in slots: the same list to its users
            kind = ("SynchronizedList" if isinstance(v, SynchronizedList) else type(v).__name__,
                    order.get(id(getattr(v, "parent_obj", None))), getattr(v, "field_name", None))
            return (kind, [value(x) for x in v])
        if isinstance(v, np.ndarray):
            return ("array", id(v))  # weights are shared, never copied
        return (type(v).__name__, repr(v))

    out = []
    for obj in (graph, *graph.nodes, *tensors):
        out.append((type(obj).__name__, [(k, value(v)) for k, v in vars(obj).items()]))
    return out


def test_copy_graph_builds_what_graphsurgeons_constructors_build():
    """The fast copy sets, attribute by attribute and in the same order, what the constructors set: the same
    synchronised lists (their owner and field), consumers and producers in the same order, shared weights."""
    for model in MODELS:
        g = import_graph(model)
        g.nodes[0].inputs.append(gs.Variable.empty())  # an omitted optional input: a fresh unnamed Variable
        fast, slow = copy_graph(g), _copy_slow(g)
        assert _objects(fast) == _objects(slow)
        assert all(isinstance(n.inputs, SynchronizedList) and n.inputs.parent_obj is n for n in fast.nodes)
        # no instance dict behind any of the copy's lists (their fields are in slots): a third fewer objects
        lists = [lst for n in fast.nodes for lst in (n.inputs, n.outputs, *[x for t in n.outputs for x in (t.inputs, t.outputs)])]
        assert not any(type(r) is dict for lst in lists for r in gc.get_referents(lst))
        # the lists stay synchronised: editing the copy edits its tensors' lists, never the original's
        node = fast.nodes[0]
        t = node.inputs[0]
        node.inputs.remove(t)
        assert node not in t.outputs and g.nodes[0] in g.nodes[0].inputs[0].outputs
        assert _describe(copy_graph(g)) == _describe(g.copy())


def test_toposort_is_graphsurgeons_order():
    rng = random.Random(0)
    for model in MODELS:
        g = import_graph(model)
        for _ in range(5):
            a = copy_graph(g)
            rng.shuffle(a.nodes)
            b = copy_graph(a)
            assert [n.name for n in toposort(a).nodes] == [n.name for n in b.toposort().nodes]


def test_cleanup_is_graphsurgeons_cleanup():
    """Graphs whose outputs are cut back to a few of their tensors (so that nodes are dropped, some of them
    dangling off the kept ones) clean up to the same nodes, tensors, inputs and outputs as graphsurgeon's."""
    rng = random.Random(0)
    dropped = 0
    for model in MODELS:
        g = import_graph(model)
        variables = [t for n in g.nodes for t in n.outputs]
        for _ in range(5):
            a = copy_graph(g)
            kept = rng.sample(variables, k=min(len(variables), rng.randint(1, 3)))
            a.outputs = [a.tensors()[t.name] for t in kept]
            b = copy_graph(a)
            ours, theirs = cleanup(a), b.cleanup(remove_unused_graph_inputs=False)
            assert _describe(ours) == _describe(theirs)
            dropped += len(ours.nodes) < len(g.nodes)
    assert dropped  # the cases dropped nodes


def test_toposort_refuses_a_cycle():
    x = gs.Variable("x", np.float32, [1])
    y = gs.Variable("y", np.float32, [1])
    g = gs.Graph(nodes=[gs.Node("Relu", "a", inputs=[y], outputs=[x]), gs.Node("Relu", "b", inputs=[x], outputs=[y])])
    try:
        toposort(g)
    except ValueError as e:
        assert "cycle" in str(e)
    else:
        raise AssertionError("a cycle was sorted")


def test_cached_node_costs_are_the_uncached_ones():
    cm = RooflineCostModel("CPU")
    for model in MODELS:
        g = import_graph(model)
        for n in g.nodes:
            fresh = RooflineCostModel("CPU")
            assert cm.node_cost(n) == fresh._node_cost(n) == cm.node_cost(n)
            assert cm.is_memory_bound(n) == fresh._is_memory_bound(n)
    # two nodes alike but for one input's shape do not share a cost
    a = gs.Variable("a", np.float32, [1, 64])
    b = gs.Variable("b", np.float32, [1, 128])
    na = gs.Node("Relu", "ra", inputs=[a], outputs=[gs.Variable("oa", np.float32, [1, 64])])
    nb = gs.Node("Relu", "rb", inputs=[b], outputs=[gs.Variable("ob", np.float32, [1, 128])])
    assert cm.node_cost(na) < cm.node_cost(nb)
    assert _flops_bytes_tiles(na)[1] < _flops_bytes_tiles(nb)[1] and not is_fused_epilogue(na)


def test_hashes_of_weight_slices_follow_their_bytes():
    w = np.arange(24, dtype=np.float32).reshape(6, 4)
    h = GraphHasher()
    first, second = gs.Constant("p0", np.ascontiguousarray(w[:3])), gs.Constant("p1", np.ascontiguousarray(w[3:]))
    again = gs.Constant("q0", np.ascontiguousarray(w[:3]))  # a new view object of the same bytes
    assert h._constant(first) == h._constant(again) == GraphHasher()._constant(gs.Constant("c", w[:3].copy()))
    assert h._constant(first) != h._constant(second)


def _matmul_relu(w_rows: int = 128):
    """x @ W -> Relu, W large enough (128 KB) that shape inference and the checker see it set aside."""
    from onnx import TensorProto, helper, numpy_helper

    w = np.random.default_rng(0).random((w_rows, 256), dtype=np.float32)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, w_rows])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 256])
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Relu", ["h"], ["y"])],
                              "g", [x], [y], [numpy_helper.from_array(w, "W")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), w


def test_export_checks_the_model_without_its_large_weights(monkeypatch):
    """export_model's onnx.checker runs on the model with its large initializers set aside (a small file, not the
    whole model serialized), still rejects what the checker rejects, and the model returned has every weight."""
    import onnx
    import pytest
    from onnx import numpy_helper

    from parastream.rewrite.ir import WEIGHTS_ASIDE_BYTES, export_model

    model, w = _matmul_relu()
    assert w.nbytes > WEIGHTS_ASIDE_BYTES
    checked = []
    real = onnx.checker.check_model
    monkeypatch.setattr(onnx.checker, "check_model",
                        lambda m, *a, **k: checked.append(Path(m).stat().st_size if isinstance(m, str) else m) or real(m, *a, **k))
    out = export_model(import_graph(model), model)
    # a file without the weights' bytes: the proto was not handed over (and serialized) whole
    assert len(checked) == 1 and isinstance(checked[0], int) and checked[0] < w.nbytes // 10
    assert np.array_equal(numpy_helper.to_array(out.graph.initializer[0]), w)
    assert not out.graph.initializer[0].HasField("data_location") and not out.graph.initializer[0].external_data

    bad = import_graph(model)
    next(n for n in bad.nodes if n.op == "Relu").attrs["bogus"] = 1.0
    export_model(bad.copy(), model, check=False)  # shape inference alone lets it through ...
    with pytest.raises(onnx.checker.ValidationError, match="Unrecognized attribute: bogus"):
        export_model(bad, model)  # ... the checker does not


def test_export_checks_small_models_in_memory(monkeypatch):
    """Nothing set aside (every initializer small): the checker gets the model itself, as before."""
    import onnx

    from parastream.rewrite.ir import export_model

    model, _ = _matmul_relu(w_rows=8)
    checked = []
    real = onnx.checker.check_model
    monkeypatch.setattr(onnx.checker, "check_model", lambda m, *a, **k: checked.append(m) or real(m, *a, **k))
    export_model(import_graph(model), model)
    assert len(checked) == 1 and isinstance(checked[0], onnx.ModelProto)


def test_export_holds_large_weights_aside_and_writes_the_same_model(monkeypatch):
    """export_model with the large weights held aside through gs's export writes byte for byte the model of the
    plain export (every weight, in place, no external data), and leaves the graph it was given as it was."""
    from parastream.rewrite import ir

    model, w = _matmul_relu()
    graph = import_graph(model)
    held = ir.hold_large_weights(ir.copy_graph(graph))
    assert list(held) == ["W"] and np.array_equal(held["W"], w)
    fast = ir.export_model(graph, model)
    assert all(isinstance(t._values, np.ndarray) for t in graph.tensors().values() if isinstance(t, gs.Constant))
    monkeypatch.setattr(ir, "hold_large_weights", lambda g: {})
    assert fast.SerializeToString() == ir.export_model(graph, model).SerializeToString()


def test_an_imported_weight_not_loaded_yet_is_held_as_its_proto(monkeypatch):
    """A weight graphsurgeon imported lazily (``LazyValues``: the loader's import) is held as its imported proto
    (put back with one copy of its bytes), not exported through it; the export is byte for byte the plain one,
    and the graph it was given keeps its weight."""
    from onnx_graphsurgeon.ir.tensor import LazyValues

    from parastream.rewrite import ir

    model, w = _matmul_relu()
    graph = gs.import_onnx(model)
    lazy = [t for t in graph.tensors().values() if isinstance(t, gs.Constant) and isinstance(t._values, LazyValues)]
    assert [t.name for t in lazy] == ["W"]
    held = ir.hold_large_weights(ir.copy_graph(graph))
    assert list(held) == ["W"] and isinstance(held["W"], onnx.TensorProto) and held["W"].raw_data == w.tobytes()
    fast = ir.export_model(graph, model)
    assert np.array_equal(graph.tensors()["W"].values, w)
    monkeypatch.setattr(ir, "hold_large_weights", lambda g: {})
    assert fast.SerializeToString() == ir.export_model(graph, model).SerializeToString()


def test_a_branch_extracted_with_its_weights_held_is_the_plain_export(monkeypatch):
    """``extract_branch`` holds the branch's large weights out of graphsurgeon's export and writes each once
    into the result (an imported one from its proto, a rule-made one from its array): the branch is byte for
    byte the plain export, and the loader's graph keeps its weights."""
    from onnx import TensorProto, helper, numpy_helper

    from parastream.launcher.plan import Branch
    from parastream.pipeline import partition

    rng = np.random.default_rng(1)
    w1 = rng.random((128, 256), dtype=np.float32)
    w2 = rng.random((256, 128), dtype=np.float32)
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h"], name="mm1"), helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("MatMul", ["r", "W2"], ["y"], name="mm2")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 128])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 128])],
                              [numpy_helper.from_array(w1, "W1"), numpy_helper.from_array(w2, "W2")])
    model = onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    g = gs.import_onnx(model)
    g.tensors()["W2"].values = w2.copy()  # one weight as an array (a rule's), one still lazily imported
    branch = Branch(id=0, name="branch_000", stream=0, nodes=["mm1", "relu"], inputs=["x"], outputs=["r"])
    fast = partition.extract_branch(model, g, branch)
    assert [t.name for t in fast.graph.initializer] == ["W1"]
    assert np.array_equal(numpy_helper.to_array(fast.graph.initializer[0]), w1)
    other = Branch(id=1, name="branch_001", stream=0, nodes=["mm2"], inputs=["r"], outputs=["y"])
    fast_other = partition.extract_branch(model, g, other)
    assert np.array_equal(g.tensors()["W1"].values, w1) and np.array_equal(g.tensors()["W2"].values, w2)
    monkeypatch.setattr(partition, "hold_large_weights", lambda graph: {})
    assert fast.SerializeToString() == partition.extract_branch(model, g, branch).SerializeToString()
    assert fast_other.SerializeToString() == partition.extract_branch(model, g, other).SerializeToString()


def test_export_holds_nothing_where_a_node_holds_a_subgraph():
    """A graph with an If (its branches' initializers are not the top-level list): nothing is held, the export
    is the plain one."""
    from onnx import TensorProto, helper, numpy_helper

    from parastream.rewrite import ir

    w = np.ones((128, 256), np.float32)
    out_t = helper.make_tensor_value_info("o", TensorProto.FLOAT, [128, 256])
    then = helper.make_graph([helper.make_node("Identity", ["W"], ["o"])], "then", [], [out_t])
    other = helper.make_graph([helper.make_node("Neg", ["W"], ["o"])], "else", [], [out_t])
    g = helper.make_graph([helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)], "g",
                          [helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [128, 256])],
                          [numpy_helper.from_array(w, "W")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    graph = import_graph(model)
    assert ir.hold_large_weights(ir.copy_graph(graph)) == {}
    out = ir.export_model(graph, model)
    found = [numpy_helper.to_array(t) for t in [*out.graph.initializer, *(i for b in out.graph.node[0].attribute
                                                                         for i in b.g.initializer)] if t.name == "W"]
    assert found and all(np.array_equal(a, w) for a in found)


def test_a_measured_candidate_is_exported_without_its_weights_bytes_and_kept_with_them(monkeypatch, tmp_path):
    """A measured search exports its candidates with the weights their graphs hold as arrays left out (the
    measurer plans each from its graph and extracts its branches from those arrays): the candidate the measurer
    is handed has placeholders for them, its branches (on streams, and the whole model as one) are byte for byte
    those of the plain export, and the model the search returns is byte for byte the plain export of the kept
    graph."""
    pytest = __import__("pytest")
    pytest.importorskip("torch")
    from parastream.launcher.engines import torch as torch_backend
    from parastream.pipeline import partition
    from parastream.pipeline.build import Engines
    from parastream.pipeline.model_io import load_model
    from parastream.pipeline.zoo import MODELS
    from parastream.rewrite import RooflineCostModel, ir, optimize_graph

    monkeypatch.setattr(ir, "WEIGHTS_ASIDE_BYTES", 1024)  # small_net's weights: a few KB each
    model = MODELS["small_net"]()
    onnx.save(model, tmp_path / "m.onnx")
    engines = Engines(torch_backend, RooflineCostModel(), load_model(tmp_path / "m.onnx"), "fp16")
    seen = []

    class Measurer:
        lookahead = 2

        def adopt(self, m, graph):
            seen.append((m, graph))

        def prepare(self, models):
            return None

        def measure(self, m):  # the input slowest, then each candidate faster than the one before
            return 1.0 if m is model else 0.5 - 0.01 * len(seen)

    out, graph, report = optimize_graph(model, measure=Measurer(), top_k=4)
    assert report["decided_by"] == "measured" and seen
    assert any(m is out for m, _ in seen)  # the kept candidate's own export, its weights written into it
    for m, g in seen:
        assert bool(ir.weights_aside(m)) == (m is not out)
        plain = ir.export_model(g, model)
        assert not ir.weights_aside(plain)
        plans = [engines.plan(g, None, 4)]
        plans.append(engines.one_stream_plan(g, plans[0], whole=True))
        assert plans[0].num_streams > 1 and len(plans[1].branches) == 1
        for plan in plans:
            for b in plan.branches:
                assert (partition.extract_branch(m, g, b).SerializeToString()
                        == partition.extract_branch(plain, g, b).SerializeToString())
    assert not ir.weights_aside(out)
    assert out.SerializeToString() == ir.export_model(graph, model).SerializeToString()
