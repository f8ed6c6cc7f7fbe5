"""Graph analysis for ``inspect`` and for choosing the number of streams: op histogram, node DAG, width.

The width of a DAG is the size of its largest antichain, the most nodes no two of which are connected by a path,
so the most that could ever run at the same time. By Dilworth's theorem it equals the fewest chains (paths of
the transitive closure) that cover every node, and that minimum is n − |M| for a maximum matching M of the
bipartite graph with an edge uₒᵤₜ → vᵢₙ for every pair u <  v (u reaches v). König's theorem turns M into a
minimum vertex cover C of that bipartite graph, and the nodes with neither side in C form a maximum antichain.
"""

from __future__ import annotations

from collections import Counter

import networkx as nx
import onnx
import onnx_graphsurgeon as gs

from parastream.core.graph import node_edges

from .model_io import name_nodes


def op_histogram(model: onnx.ModelProto) -> Counter:
    """How many nodes of each op type the main graph has (``domain::Op`` for ops outside the default domain)."""
    return Counter(n.op_type if n.domain in ("", "ai.onnx") else f"{n.domain}::{n.op_type}" for n in model.graph.node)


def node_dag(graph: gs.Graph) -> nx.DiGraph:
    """The node DAG of ``graph`` as a networkx graph, for ``inspect``, the width and the picture: vertex ``i`` is
    ``graph.nodes[i]`` (attributes ``name``, ``op``), an edge producer -> consumer for every tensor that passes
    between two nodes, including the tensors an If/Loop/Scan body reads from the enclosing scope.  The edges are
    ``core.graph.node_edges``, the ones the scheduler uses.  Vertices are indices, not names, so that a graph whose
    names are not unique (yet) still gets one vertex per node."""
    dag = nx.DiGraph()
    dag.add_nodes_from((i, {"name": node.name, "op": node.op}) for i, node in enumerate(graph.nodes))
    preds, _ = node_edges(graph)
    dag.add_edges_from((j, i) for i, mine in enumerate(preds) for j in mine)
    return dag


def _graph_and_names(model: onnx.ModelProto | gs.Graph) -> tuple[gs.Graph, list[str]]:
    """``model``'s graphsurgeon graph and its node names in graph order: a ModelProto is imported for this and named
    as the loader names it (``name_nodes`` with ``assign=False``: the model is left as it is); a graph is taken as
    it is (the loader's names are unique)."""
    if isinstance(model, gs.Graph):
        graph, names = model, [n.name for n in model.nodes]
    else:
        graph, names = gs.import_onnx(model), name_nodes(model, assign=False)  # import keeps the node order
    if len(set(names)) != len(names):
        raise ValueError("node names are not unique; name the nodes first (model_io.name_nodes)")
    return graph, names


def node_graph(model: onnx.ModelProto | gs.Graph) -> nx.DiGraph:
    """``node_dag`` with vertices named: one vertex per node (by name, with ``op`` and ``index`` attributes), in graph
    order.  A ModelProto is imported into graphsurgeon for this and named as the loader names it (``name_nodes``
    with ``assign=False``: the model is left as it is); a graph is taken as it is (the loader's names are unique)."""
    graph, names = _graph_and_names(model)
    dag = node_dag(graph)
    g = nx.DiGraph()
    g.add_nodes_from((names[i], {"op": dag.nodes[i]["op"], "index": i}) for i in dag)
    g.add_edges_from((names[u], names[v]) for u, v in dag.edges)
    return g


def graph_width(model: onnx.ModelProto | gs.Graph, dag: nx.DiGraph | None = None) -> tuple[int, list[str]]:
    """(size of a maximum antichain of the node DAG, the names of its nodes in graph order).  ``dag``: the
    graph's ``node_dag`` when the caller has it (a build builds it once per graph), else it is built here."""
    graph, names = _graph_and_names(model)
    dag = node_dag(graph) if dag is None else dag
    n = dag.number_of_nodes()
    if n == 0:
        return 0, []
    if not nx.is_directed_acyclic_graph(dag):
        raise ValueError("the node graph has a cycle")
    # u reaches v, as bit v of reach[u], from the successors' sets in reverse topological order (what
    # nx.transitive_closure_dag computes, without building a second DiGraph with every pair as an edge)
    reach = [0] * n
    for u in reversed(list(nx.topological_sort(dag))):
        bits = 0
        for v in dag.successors(u):
            bits |= reach[v] | (1 << v)
        reach[u] = bits
    # Bipartite graph on integers: u (0 … n−1) is u's "out" side, n + v is v's "in" side.
    bipartite = nx.Graph()
    bipartite.add_nodes_from(range(2 * n))
    bipartite.add_edges_from((u, n + v) for u in range(n) for v in _bits(reach[u]))
    top = range(n)
    matching = nx.bipartite.hopcroft_karp_matching(bipartite, top_nodes=top)
    reached = _alternating_reach(bipartite, matching, [u for u in top if u not in matching])
    # König: cover = (out sides not reached) ∪ (in sides reached); the antichain is every node with neither side in it.
    antichain = [v for v in range(n) if v in reached and n + v not in reached]
    # Dilworth: |antichain| = n − |M| (the matching dict holds each matched pair twice).
    assert len(antichain) == n - len(matching) // 2
    return len(antichain), [names[v] for v in antichain]  # vertex v is graph.nodes[v]: graph order


def _bits(x: int) -> list[int]:
    """The positions of the set bits of ``x``, ascending."""
    out = []
    while x:
        low = x & -x
        out.append(low.bit_length() - 1)
        x ^= low
    return out


def _alternating_reach(bipartite: nx.Graph, matching: dict, free_top: list) -> set:
    """Vertices reachable from the unmatched top vertices along alternating paths (non-matching edges top → bottom,
    matching edges bottom → top): one breadth-first search, O(E)."""
    reached = set(free_top)
    frontier = list(free_top)
    while frontier:
        nxt = []
        for u in frontier:
            for w in bipartite[u]:
                if w in reached or matching.get(u) == w:
                    continue
                reached.add(w)
                mate = matching.get(w)
                if mate is not None and mate not in reached:
                    reached.add(mate)
                    nxt.append(mate)
        frontier = nxt
    return reached
