"""``parastream inspect --picture``: the node DAG drawn top to bottom, each node coloured by its stream.

Layers are the DAG's topological generations (every node sits one layer below its deepest producer, graph
inputs on top, outputs below their producers); inside a layer, nodes are ordered by the mean position of their
neighbours (barycentre sweeps down and up), which keeps parallel branches side by side. Edges inside one branch are
thin and grey; edges that cross from one branch to another (an event the launcher waits on) are dashed and dark.
Each box carries its op type and, where branches are given, ``bN`` for branch N. The figure grows with the graph's
width and depth at a fixed scale, so labels stay legible at a few hundred nodes. Drawn on a bare matplotlib
Figure (Agg for PNG), so pyplot's global state and the user's backend are left alone.
"""

from __future__ import annotations

from pathlib import Path

import networkx as nx
import onnx

from parastream.core.dataflow import consumers, producers
from parastream.core.errors import ParastreamError

from .analysis import node_graph

FORMATS = (".svg", ".png")
X_INCHES = 1.25  # horizontal room per node
Y_INCHES = 0.62  # vertical room per layer
MAX_PIXELS = 30000  # longest side of a PNG
INNER, CROSSING, DASHES = "#9a9a9a", "#222222", (0, (3, 2))


def _stream_colours(k: int) -> list:
    from matplotlib import colormaps

    cmap = colormaps["tab10" if k <= 10 else "tab20"]
    return [cmap(i % cmap.N) for i in range(k)]


class _Layout:
    """A layered drawing (Sugiyama style): layer = topological generation; an edge that spans several layers
    runs through one dummy point per layer, so it is routed around boxes instead of through them; the order
    inside a layer comes from barycentre sweeps; x positions follow the neighbours' mean, one unit apart."""

    def __init__(self, dag: nx.DiGraph, inputs: list[tuple[str, list[str]]], outputs: list[tuple[str, str]]):
        """``inputs``: (graph input, the nodes that read it); ``outputs``: (graph output, the node that writes it)."""
        g = nx.DiGraph()
        g.add_nodes_from(dag.nodes)
        g.add_edges_from(dag.edges)
        key = {v: (dag.nodes[v]["index"], 0) for v in dag}
        for i, (name, readers) in enumerate(inputs):
            g.add_edges_from((("input", name), r) for r in readers)
            key[("input", name)] = (-1, i)
        for i, (name, producer) in enumerate(outputs):
            g.add_edge(producer, ("output", name))
            key[("output", name)] = (len(dag), i)
        self.layer = {v: depth for depth, gen in enumerate(nx.topological_generations(g)) for v in gen}
        self.paths: list[tuple[object, object, list]] = []
        adjacency = nx.DiGraph()
        adjacency.add_nodes_from(g)
        for u, v in g.edges:
            chain = [u] + [("dummy", u, v, j) for j in range(self.layer[u] + 1, self.layer[v])] + [v]
            for a, b in zip(chain, chain[1:]):
                adjacency.add_edge(a, b)
            for j, d in enumerate(chain[1:-1], start=self.layer[u] + 1):
                self.layer[d] = j
                key[d] = key[u]
            self.paths.append((u, v, chain))
        depth = max(self.layer.values(), default=0) + 1
        layers = [[] for _ in range(depth)]
        for v, d in self.layer.items():
            layers[d].append(v)
        for layer in layers:
            layer.sort(key=lambda v: key[v])
        self.layers = layers
        self.x = self._place(adjacency)
        self.depth = depth
        self.width = max(self.x.values()) - min(self.x.values()) + 1 if self.x else 1
        self.left = min(self.x.values(), default=0)

    def _place(self, g: nx.DiGraph) -> dict:
        layers = self.layers
        rank = {v: float(i) for layer in layers for i, v in enumerate(layer)}

        def order_by(sequence, neighbours):
            for layer in sequence:
                def barycentre(v):
                    ns = list(neighbours(v))
                    return sum(rank[u] for u in ns) / len(ns) if ns else rank[v]
                layer.sort(key=barycentre)
                for i, v in enumerate(layer):
                    rank[v] = float(i)

        for _ in range(4):
            order_by(layers[1:], g.predecessors)
            order_by(reversed(layers[:-1]), g.successors)
        order_by(layers[1:], g.predecessors)

        x = {v: i - (len(layer) - 1) / 2 for layer in layers for i, v in enumerate(layer)}

        def align(sequence, neighbours):
            for layer in sequence:
                want = []
                for v in layer:
                    ns = list(neighbours(v))
                    want.append(sum(x[u] for u in ns) / len(ns) if ns else x[v])
                # Keep the order and a gap of one: push right, then shift back by the mean displacement.
                placed = []
                for w in want:
                    placed.append(max(w, placed[-1] + 1) if placed else w)
                shift = sum(w - p for w, p in zip(want, placed)) / len(placed)
                for v, p in zip(layer, placed):
                    x[v] = p + shift

        for _ in range(3):
            align(layers[1:], g.predecessors)
            align(reversed(layers[:-1]), g.successors)
        align(layers[1:], g.predecessors)
        return x

    def point(self, v) -> tuple[float, float]:
        return self.x[v], -float(self.layer[v])


def draw_graph(model: onnx.ModelProto, path: str | Path, streams: dict[str, int] | None = None,
               branches: dict[str, int] | None = None, title: str = "") -> Path:
    """Draw ``model``'s node DAG to ``path`` (.svg or .png): boxes labelled by op type and coloured by stream
    (``streams``: node name → stream), branch boundaries marked (``branches``: node name → branch id)."""
    path = Path(path)
    if path.suffix.lower() not in FORMATS:
        raise ParastreamError(f"--picture {path}: the file name must end in .svg or .png")

    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.collections import LineCollection
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    dag = node_graph(model)
    initializers = {t.name for t in model.graph.initializer}
    vertices = list(dag)  # node names, in graph order
    writer = producers(node.output for node in model.graph.node)
    reader = consumers(node.input for node in model.graph.node)
    inputs = [i.name for i in model.graph.input if i.name not in initializers]
    outputs = [(o.name, vertices[writer[o.name]]) for o in model.graph.output if o.name in writer]
    readers = {name: [vertices[i] for i in reader.get(name, [])] for name in inputs}
    layout = _Layout(dag, [(name, readers[name]) for name in inputs if readers[name]], outputs)
    streams = streams or {}
    branches = branches or {}
    k = max(streams.values(), default=-1) + 1
    colours = _stream_colours(max(k, 1))
    unassigned = (0.85, 0.85, 0.85, 1.0)

    handles = [Patch(facecolor=colours[i], edgecolor="black", label=f"stream {i}") for i in range(k)]
    if streams and any(v not in streams for v in dag):
        handles.append(Patch(facecolor=unassigned, edgecolor="black", label="no stream"))
    if branches:
        handles.append(Line2D([], [], color=INNER, linewidth=0.9, label="edge inside a branch"))
        handles.append(Line2D([], [], color=CROSSING, linewidth=1.2, linestyle=DASHES,
                              label="edge between branches (event)"))
    header = max(0.9, 0.3 + 0.19 * len(handles))  # inches above the drawing: title, note, legend
    fig_w = max(6.5, (layout.width + 1) * X_INCHES)
    fig_h = (layout.depth + 0.4) * Y_INCHES + header
    fig = Figure(figsize=(fig_w, fig_h))
    ax = fig.add_axes((0.0, 0.0, 1.0, 1.0 - header / fig_h))
    ax.set_axis_off()
    centre, half = layout.left + (layout.width - 1) / 2, fig_w / X_INCHES / 2
    ax.set_xlim(centre - half, centre + half)
    ax.set_ylim(-layout.depth + 0.5, 0.5)

    inner, crossing = [], []
    for u, v, chain in layout.paths:
        line = [layout.point(p) for p in chain]
        between = branches and u in branches and v in branches and branches[u] != branches[v]
        (crossing if between else inner).append(line)
    ax.add_collection(LineCollection(inner, colors=INNER, linewidths=0.9, zorder=1))
    ax.add_collection(LineCollection(crossing, colors=CROSSING, linewidths=1.2, linestyles=DASHES, zorder=1))

    box = dict(boxstyle="round,pad=0.25", edgecolor="black", linewidth=0.6)
    for v in dag:
        x, y = layout.point(v)
        s = streams.get(v)
        face = colours[s] if s is not None else unassigned
        lum = 0.299 * face[0] + 0.587 * face[1] + 0.114 * face[2]
        label = dag.nodes[v]["op"] + (f"\nb{branches[v]}" if v in branches else "")
        ax.text(x, y, label, ha="center", va="center", fontsize=6.5, linespacing=0.95, zorder=2, clip_on=False,
                color="black" if lum > 0.5 else "white", bbox=dict(box, facecolor=face))
    for v in layout.layer:
        if isinstance(v, tuple) and v[0] in ("input", "output"):
            x, y = layout.point(v)
            ax.text(x, y, v[1], ha="center", va="center", fontsize=6.5, style="italic", zorder=2, clip_on=False,
                    bbox=dict(boxstyle="round4,pad=0.3", facecolor="white", edgecolor="#555555", linewidth=0.6))

    if handles:
        fig.legend(handles=handles, loc="upper right", fontsize=7, frameon=True)
    note = f"{dag.number_of_nodes()} nodes, {len(dag.edges)} edges, flowing top to bottom"
    if streams:
        note += "; box colour: stream"
    if branches:
        note += "; bN: branch N"
    fig.text(0.01, 1.0 - 0.15 / fig_h, title or model.graph.name or "model", ha="left", va="top", fontsize=10,
             weight="bold")
    fig.text(0.01, 1.0 - 0.45 / fig_h, note, ha="left", va="top", fontsize=7)

    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix.lower() == ".png":
        FigureCanvasAgg(fig)
        fig.savefig(path, format="png", dpi=min(150.0, MAX_PIXELS / max(fig_w, fig_h)))
    else:
        with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "parastream"}):
            fig.savefig(path, format="svg")
    return path
