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

from .model_io import name_nodes


def op_histogram(model: onnx.ModelProto) -> Counter:
    """How many nodes of each op type the main graph has (``domain::Op`` for ops outside the default domain)."""
    return Counter(n.op_type if n.domain in ("", "ai.onnx") else f"{n.domain}::{n.op_type}" for n in model.graph.node)


def _subgraph_reads(node: onnx.NodeProto) -> set[str]:
    """Tensors that an If/Loop/Scan body reads from the enclosing scope (they are inputs of the node too)."""
    reads: set[str] = set()
    for attr in node.attribute:
        for g in [attr.g] if attr.HasField("g") else list(attr.graphs):
            local = {i.name for i in g.input} | {t.name for t in g.initializer}
            for inner in g.node:
                local.update(inner.output)
            for inner in g.node:
                reads.update(i for i in inner.input if i and i not in local)
                reads.update(_subgraph_reads(inner) - local)
    return reads


def node_graph(model: onnx.ModelProto) -> nx.DiGraph:
    """The node DAG: one vertex per node (by name, with ``op`` and ``index`` attributes), an edge producer → consumer
    for every tensor that passes between them."""
    g = nx.DiGraph()
    producer: dict[str, str] = {}
    names = name_nodes(model, assign=False)
    for i, (name, node) in enumerate(zip(names, model.graph.node)):
        g.add_node(name, op=node.op_type, index=i)
        for out in node.output:
            if out:
                producer[out] = name
    for name, node in zip(names, model.graph.node):
        for t in set(node.input) | _subgraph_reads(node):
            src = producer.get(t)
            if src is not None and src != name:
                g.add_edge(src, name)
    return g


def graph_width(model: onnx.ModelProto) -> tuple[int, list[str]]:
    """(size of a maximum antichain of the node DAG, the names of its nodes in graph order)."""
    dag = node_graph(model)
    n = dag.number_of_nodes()
    if n == 0:
        return 0, []
    if not nx.is_directed_acyclic_graph(dag):
        raise ValueError("the node graph has a cycle")
    names = list(dag)
    index = {v: i for i, v in enumerate(names)}
    closure = nx.transitive_closure_dag(dag)
    # Bipartite graph on integers: u (0 … n−1) is u's "out" side, n + v is v's "in" side.
    bipartite = nx.Graph()
    bipartite.add_nodes_from(range(2 * n))
    bipartite.add_edges_from((index[u], n + index[v]) for u, v in closure.edges)
    top = range(n)
    matching = nx.bipartite.hopcroft_karp_matching(bipartite, top_nodes=top)
    reached = _alternating_reach(bipartite, matching, [u for u in top if u not in matching])
    # König: cover = (out sides not reached) ∪ (in sides reached); the antichain is every node with neither side in it.
    antichain = [v for v in names if index[v] in reached and n + index[v] not in reached]
    # Dilworth: |antichain| = n − |M| (the matching dict holds each matched pair twice).
    assert len(antichain) == n - len(matching) // 2
    antichain.sort(key=lambda v: dag.nodes[v]["index"])
    return len(antichain), antichain


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
