"""Op histogram and graph width (maximum antichain of the node DAG) on graphs whose answer is known."""

from __future__ import annotations

import itertools

import networkx as nx
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from parastream.pipeline import zoo
from parastream.pipeline.analysis import graph_width, node_graph, op_histogram


def dag_model(edges: list[tuple[str, str]], nodes: list[str] | None = None, op: str = "Sum") -> onnx.ModelProto:
    """One node per vertex (output tensor = its name); sources read "input", sinks are graph outputs."""
    order = list(nx.topological_sort(nx.DiGraph(edges))) if edges else []
    for v in nodes or []:
        if v not in order:
            order.append(v)
    preds = {v: [u for u, w in edges if w == v] for v in order}
    succs = {u for u, _ in edges}
    onnx_nodes = [helper.make_node(op, preds[v] or ["input"], [v], name=v) for v in order]
    vi = lambda n: helper.make_tensor_value_info(n, TensorProto.FLOAT, [4])  # noqa: E731
    graph = helper.make_graph(onnx_nodes, "dag", [vi("input")], [vi(v) for v in order if v not in succs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model, full_check=True)
    return model


def is_antichain(model: onnx.ModelProto, names: list[str]) -> bool:
    closure = nx.transitive_closure_dag(node_graph(model))
    return not any(closure.has_edge(a, b) or closure.has_edge(b, a) for a, b in itertools.combinations(names, 2))


def brute_force_width(model: onnx.ModelProto) -> int:
    dag = node_graph(model)
    closure = nx.transitive_closure_dag(dag)
    comparable = nx.Graph(closure.edges)
    comparable.add_nodes_from(dag)
    # The largest antichain is the largest independent set of the comparability graph.
    return max(len(c) for c in nx.find_cliques(nx.complement(comparable)))


def test_chain_has_width_one():
    m = dag_model([("a", "b"), ("b", "c"), ("c", "d")])
    width, names = graph_width(m)
    assert width == 1 and len(names) == 1 and names[0] in "abcd"


def test_single_node_and_empty_graph():
    assert graph_width(dag_model([], nodes=["only"])) == (1, ["only"])
    empty = helper.make_model(helper.make_graph([], "empty", [], []), opset_imports=[helper.make_opsetid("", 17)])
    assert graph_width(empty) == (0, [])


def test_diamond_has_width_two():
    m = dag_model([("s", "l"), ("s", "r"), ("l", "t"), ("r", "t")])
    assert graph_width(m) == (2, ["l", "r"])


def test_independent_nodes_all_count():
    m = dag_model([], nodes=["a", "b", "c", "d", "e"])
    assert graph_width(m) == (5, ["a", "b", "c", "d", "e"])


def test_width_is_not_the_largest_topological_layer():
    # Layers {s} {p1,q1} {p2,r1} {t} hold at most 2 nodes, but q1, p2 and r1 are mutually independent.
    m = dag_model([("s", "p1"), ("p1", "p2"), ("p2", "t"), ("s", "q1"), ("q1", "t"), ("p1", "r1"), ("r1", "t")])
    assert max(len(g) for g in nx.topological_generations(node_graph(m))) == 2
    width, names = graph_width(m)
    assert width == 3 and sorted(names) == ["p2", "q1", "r1"]


def test_two_consumers_and_multi_output_nodes():
    nodes = [
        helper.make_node("Split", ["input", "sizes"], ["a", "b"], name="split", axis=0),
        helper.make_node("Relu", ["a"], ["ra"], name="relu_a"),
        helper.make_node("Sigmoid", ["a"], ["sa"], name="sigmoid_a"),
        helper.make_node("Tanh", ["b"], ["tb"], name="tanh_b"),
        helper.make_node("Concat", ["ra", "sa", "tb"], ["output"], name="concat", axis=0),
    ]
    vi = lambda n, s: helper.make_tensor_value_info(n, TensorProto.FLOAT, s)  # noqa: E731
    g = helper.make_graph(nodes, "g", [vi("input", [4])], [vi("output", [4])],
                          [onnx.numpy_helper.from_array(np.array([2, 2], np.int64), "sizes")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    assert graph_width(m) == (3, ["relu_a", "sigmoid_a", "tanh_b"])


def test_unnamed_nodes_get_the_loaders_names():
    m = dag_model([("s", "l"), ("s", "r"), ("l", "t"), ("r", "t")])
    for n in m.graph.node:
        n.name = ""
    width, names = graph_width(m)
    assert width == 2 and names == ["Sum_1", "Sum_2"]


@pytest.mark.parametrize("seed", range(25))
def test_random_dags_match_brute_force(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 12))
    p = float(rng.uniform(0.1, 0.6))
    edges = [(f"v{i}", f"v{j}") for i in range(n) for j in range(i + 1, n) if rng.random() < p]
    m = dag_model(edges, nodes=[f"v{i}" for i in range(n)])
    width, names = graph_width(m)
    assert width == len(names) == brute_force_width(m)
    assert is_antichain(m, names)


def networkx_antichain(model: onnx.ModelProto) -> list[str]:
    """The maximum antichain by networkx: Hopcroft-Karp on the transitive closure, then König's cover."""
    dag = node_graph(model)
    names = list(dag)
    n, index = len(names), {v: i for i, v in enumerate(names)}
    bipartite = nx.Graph()
    bipartite.add_nodes_from(range(2 * n))
    bipartite.add_edges_from((index[u], n + index[v]) for u, v in nx.transitive_closure_dag(dag).edges)
    matching = nx.bipartite.hopcroft_karp_matching(bipartite, top_nodes=range(n))
    free = [u for u in range(n) if u not in matching]
    reached, frontier = set(free), list(free)
    while frontier:  # alternating paths: a non-matching edge out -> in, then the matching edge in -> out
        nxt = []
        for u in frontier:
            for w in bipartite[u]:
                if w not in reached and matching.get(u) != w:
                    reached.add(w)
                    if w in matching and matching[w] not in reached:
                        reached.add(matching[w])
                        nxt.append(matching[w])
        frontier = nxt
    return [v for v in names if index[v] in reached and n + index[v] not in reached]


@pytest.mark.parametrize("seed", range(12))
def test_random_larger_dags_match_networkx(seed):
    # the width's own matching: the same antichain as networkx's Hopcroft-Karp (any maximum matching gives it)
    rng = np.random.default_rng(100 + seed)
    n = int(rng.integers(20, 70))
    p = float(rng.uniform(0.02, 0.3))
    edges = [(f"v{i}", f"v{j}") for i in range(n) for j in range(i + 1, n) if rng.random() < p]
    m = dag_model(edges, nodes=[f"v{i}" for i in range(n)])
    width, names = graph_width(m)
    assert names == networkx_antichain(m) and width == len(names)
    assert is_antichain(m, names)


def test_a_cycle_is_refused():
    m = dag_model([("a", "b")])
    m.graph.node[0].input[0] = "b"  # a reads b, b reads a
    with pytest.raises(ValueError, match="cycle"):
        graph_width(m)


@pytest.mark.parametrize("name, width", [("inception_block", 4), ("resnet_bottleneck", 2), ("transformer_layer", 3)])
def test_zoo_widths(name, width):
    m = zoo.MODELS[name]()
    w, names = graph_width(m)
    assert w == width and is_antichain(m, names)


def test_inception_block_antichain_is_one_node_per_branch():
    _, names = graph_width(zoo.inception_block())
    assert sorted(n.split("/")[1] for n in names) == ["branch1x1", "branch3x3_2", "branch3x3dbl_3", "branch_pool"]


def test_op_histogram_counts_ops_and_marks_other_domains():
    m = zoo.resnet_bottleneck()
    assert op_histogram(m) == {"Conv": 4, "BatchNormalization": 4, "Relu": 3, "Add": 1}
    m.graph.node[0].domain = "com.microsoft"
    assert op_histogram(m)["com.microsoft::Conv"] == 1


def _badly_named_model() -> onnx.ModelProto:
    """A chain whose node names are missing, repeated, or collide with the names the loader makes up."""
    names = ["", "x", "x", "Relu_0", "x_1", ""]
    nodes = [helper.make_node("Relu", ["input" if i == 0 else f"t{i - 1}"], [f"t{i}" if i < len(names) - 1 else "output"], name=n)
             for i, n in enumerate(names)]
    vi = lambda n: helper.make_tensor_value_info(n, TensorProto.FLOAT, [4])  # noqa: E731
    g = helper.make_graph(nodes, "g", [vi("input")], [vi("output")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_name_nodes_makes_names_unique_and_only_writes_when_asked():
    from parastream.pipeline.model_io import name_nodes

    m = _badly_named_model()
    expected = ["Relu_0", "x", "x_1", "Relu_0_1", "x_1_1", "Relu_5"]
    assert name_nodes(m, assign=False) == expected
    assert [n.name for n in m.graph.node] == ["", "x", "x", "Relu_0", "x_1", ""]  # untouched
    assert name_nodes(m) == expected
    assert [n.name for n in m.graph.node] == expected
    assert name_nodes(m) == expected  # named models keep their names


def test_node_graph_uses_the_loaders_names(tmp_path):
    """The analysis and the loader share one naming: node_graph's vertices are the names load_model assigns."""
    from parastream.pipeline.model_io import load_model

    m = _badly_named_model()
    onnx.save(m, tmp_path / "m.onnx")
    loaded = load_model(tmp_path / "m.onnx")
    g = node_graph(m)
    assert [n.name for n in loaded.model.graph.node] == list(g.nodes)
    assert list(g.edges) == list(zip(list(g.nodes)[:-1], list(g.nodes)[1:]))
    assert [n.name for n in m.graph.node] == ["", "x", "x", "Relu_0", "x_1", ""]  # the analysis renames nothing


def _if_reading_outer_scope():
    """relu: x -> a; an If on the graph input ``cond`` whose two bodies read ``a`` from the enclosing scope (the
    If lists only ``cond`` as its input)."""
    def body(op, out):
        return helper.make_graph([helper.make_node(op, ["a"], [out], name=f"{op.lower()}_in_body")], f"{op}_body", [],
                                 [helper.make_tensor_value_info(out, TensorProto.FLOAT, [4])])

    nodes = [
        helper.make_node("Relu", ["x"], ["a"], name="relu"),
        helper.make_node("If", ["cond"], ["y"], name="if", then_branch=body("Identity", "t"), else_branch=body("Neg", "e")),
    ]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4]),
                                       helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(m)
    return m


def test_if_bodies_reading_the_outer_scope_are_edges_for_inspect_and_the_schedule():
    """One DAG builder: the If depends on relu only through its bodies' reads; the width (inspect) and the
    schedule both see that edge, so the schedule never starts the If before relu has finished."""
    import onnx_graphsurgeon as gs

    from parastream.core.graph import node_edges
    from parastream.core.schedule import ENGINE_COST, schedule_graph
    from parastream.pipeline.analysis import node_dag
    from parastream.rewrite.cost import _GraphCostMixin

    class _Unit(_GraphCostMixin):  # every node 1 µs, compute-bound
        def node_cost(self, node):
            return 1e-6

        def is_memory_bound(self, node):
            return False

    m = _if_reading_outer_scope()
    assert list(node_graph(m).edges) == [("relu", "if")]
    assert graph_width(m)[0] == 1
    graph = gs.import_onnx(m)
    graph.toposort()
    assert list(node_dag(graph).edges) == [(0, 1)]
    assert node_edges(graph) == ([[], [0]], [[1], []])
    sched = schedule_graph(graph, 2, lambda n: 1e-6, lambda n: False)
    assert sched.node_start["if"] >= sched.node_start["relu"] + 1e-6
    # the search's cost schedules the same DAG: the If after relu, one engine on one stream
    cp, work = _Unit().graph_cost(graph, 2)
    assert work == 2e-6 and cp == pytest.approx(2e-6 + ENGINE_COST)


def test_schedule_and_inspect_see_the_same_edges():
    """The schedule's producers and consumers (core.graph.node_edges) are node_graph's edges."""
    import onnx_graphsurgeon as gs

    from parastream.core.graph import node_edges

    m = dag_model([("s", "p1"), ("p1", "p2"), ("p2", "t"), ("s", "q1"), ("q1", "t"), ("p1", "r1"), ("r1", "t")])
    graph = gs.import_onnx(m)
    nodes = graph.nodes
    preds, succs = node_edges(graph)
    assert {(p, i) for i in range(len(nodes)) for p in preds[i]} == {(i, s) for i in range(len(nodes)) for s in succs[i]}
    assert {(nodes[p].name, nodes[i].name) for i in range(len(nodes)) for p in preds[i]} == set(node_graph(m).edges)
