"""Graph analysis for ``inspect`` and for choosing the number of streams: op histogram, node DAG, width.

The width of a DAG is the size of its largest antichain, the most nodes no two of which are connected by a path,
so the most that could ever run at the same time. By Dilworth's theorem it equals the fewest chains (paths of
the transitive closure) that cover every node, and that minimum is n − |M| for a maximum matching M of the
bipartite graph with an edge uₒᵤₜ → vᵢₙ for every pair u <  v (u reaches v). König's theorem turns M into a
minimum vertex cover C of that bipartite graph, and the nodes with neither side in C form a maximum antichain.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import onnx
import onnx_graphsurgeon as gs

from parastream.core.graph import node_edges

from .model_io import name_nodes

if TYPE_CHECKING:
    import networkx as nx


def op_histogram(model: onnx.ModelProto) -> Counter:
    """How many nodes of each op type the main graph has (``domain::Op`` for ops outside the default domain)."""
    return Counter(n.op_type if n.domain in ("", "ai.onnx") else f"{n.domain}::{n.op_type}" for n in model.graph.node)


def node_dag(graph: gs.Graph) -> nx.DiGraph:
    """The node DAG of ``graph`` as a networkx graph, for ``inspect`` and the picture: vertex ``i`` is
    ``graph.nodes[i]`` (attributes ``name``, ``op``), an edge producer -> consumer for every tensor that passes
    between two nodes, including the tensors an If/Loop/Scan body reads from the enclosing scope.  The edges are
    ``core.graph.node_edges``, the ones the scheduler uses.  Vertices are indices, not names, so that a graph whose
    names are not unique (yet) still gets one vertex per node."""
    import networkx as nx  # here, not at the top: a build imports this module for the width, which needs none of it

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
    import networkx as nx  # as in node_dag

    graph, names = _graph_and_names(model)
    dag = node_dag(graph)
    g = nx.DiGraph()
    g.add_nodes_from((names[i], {"op": dag.nodes[i]["op"], "index": i}) for i in dag)
    g.add_edges_from((names[u], names[v]) for u, v in dag.edges)
    return g


def graph_width(model: onnx.ModelProto | gs.Graph) -> tuple[int, list[str]]:
    """(size of a maximum antichain of the node DAG, the names of its nodes in graph order).

    Plain Python over ``core.graph.node_edges`` and bitsets rather than networkx (``transitive_closure_dag``,
    ``bipartite.hopcroft_karp_matching``): every build reports the width of its model, and importing networkx
    alone took longer than loading a small example.  Any maximum matching gives the same antichain (the vertices
    that alternating paths reach from the unmatched ones do not depend on which maximum matching it is), so the
    answer is networkx's."""
    graph, names = _graph_and_names(model)
    preds, succs = node_edges(graph)
    n = len(preds)
    if n == 0:
        return 0, []
    # u reaches v, as bit v of reach[u], from the successors' sets in reverse topological order (Kahn's)
    indeg = [len(p) for p in preds]
    order = [i for i in range(n) if not indeg[i]]
    for i in order:  # grows while it is walked
        for s in succs[i]:
            indeg[s] -= 1
            if not indeg[s]:
                order.append(s)
    if len(order) != n:
        raise ValueError("the node graph has a cycle")
    reach = [0] * n
    for u in reversed(order):
        bits = 0
        for v in succs[u]:
            bits |= reach[v] | (1 << v)
        reach[u] = bits
    # Bipartite graph: u's "out" side has an edge to v's "in" side for every v that u reaches.
    mate_out, mate_in = _maximum_matching(reach, n)
    # König: cover = (out sides not reached) ∪ (in sides reached); the antichain is every node with neither side in it.
    reached_out, reached_in = _alternating_reach(reach, mate_out, mate_in)
    antichain = [v for v in range(n) if reached_out >> v & 1 and not reached_in >> v & 1]
    # Dilworth: |antichain| = n − |M|.
    assert len(antichain) == n - sum(m >= 0 for m in mate_out)
    return len(antichain), [names[v] for v in antichain]  # vertex v is graph.nodes[v]: graph order


def _maximum_matching(adjacent: list[int], n: int) -> tuple[list[int], list[int]]:
    """A maximum matching of the bipartite graph in which out-vertex u is adjacent to the in-vertices of the set
    bits of ``adjacent[u]``: (mate of each out-vertex, mate of each in-vertex), -1 where unmatched.  Augmenting
    paths (Kuhn's algorithm) from a greedy start, found by depth-first searches that share one visited set per
    pass until a pass finds none; the searches walk bitsets, so a pass costs O(n²/64) word operations."""
    mate_out, mate_in = [-1] * n, [-1] * n
    for u in range(n):  # greedy: the first free in-vertex
        free = adjacent[u]
        while free:
            low = free & -free
            v = low.bit_length() - 1
            if mate_in[v] < 0:
                mate_out[u], mate_in[v] = v, u
                break
            free ^= low
    improved = True
    while improved:
        improved = False
        seen = 0  # in-vertices visited in this pass
        for root in range(n):
            if mate_out[root] >= 0:
                continue
            # iterative depth-first search for an augmenting path: (out-vertex, in-vertices left to try)
            stack, path = [(root, adjacent[root] & ~seen)], []
            while stack:
                u, todo = stack[-1]
                if not todo:
                    stack.pop()
                    if path:
                        path.pop()
                    continue
                low = todo & -todo
                stack[-1] = (u, todo ^ low)
                if seen & low:
                    continue
                seen |= low
                v = low.bit_length() - 1
                if mate_in[v] < 0:  # an augmenting path: flip it
                    path.append(v)
                    for (w, _), x in zip(stack, path):
                        mate_out[w], mate_in[x] = x, w
                    improved = True
                    break
                path.append(v)
                stack.append((mate_in[v], adjacent[mate_in[v]] & ~seen))
    return mate_out, mate_in


def _alternating_reach(adjacent: list[int], mate_out: list[int], mate_in: list[int]) -> tuple[int, int]:
    """Out- and in-vertices (as bitsets) reachable from the unmatched out-vertices along alternating paths
    (non-matching edges out → in, matching edges in → out): one breadth-first search."""
    frontier = [u for u, m in enumerate(mate_out) if m < 0]
    reached_out, reached_in = sum(1 << u for u in frontier), 0
    while frontier:
        nxt = []
        for u in frontier:
            new = adjacent[u] & ~reached_in
            if mate_out[u] >= 0:
                new &= ~(1 << mate_out[u])
            reached_in |= new
            while new:
                low = new & -new
                new ^= low
                mate = mate_in[low.bit_length() - 1]
                if mate >= 0 and not reached_out >> mate & 1:
                    reached_out |= 1 << mate
                    nxt.append(mate)
        frontier = nxt
    return reached_out, reached_in