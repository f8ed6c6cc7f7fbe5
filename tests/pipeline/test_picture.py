"""The graph picture: valid SVG and PNG files, a legend per stream, branch ids, a clear error for other formats."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

import networkx as nx
import pytest

from parastream.launcher.errors import ParastreamError
from parastream.pipeline import zoo
from parastream.pipeline.analysis import node_graph
from parastream.pipeline.picture import _Layout, draw_graph

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SVG = "{http://www.w3.org/2000/svg}"


def fake_assignment(model, k=3):
    """Branch = the block a node belongs to (second part of its name), stream = branch mod k."""
    parts = [n.name.split("/")[1] for n in model.graph.node]
    ids = {p: i for i, p in enumerate(dict.fromkeys(parts))}
    branches = {n.name: ids[p] for n, p in zip(model.graph.node, parts)}
    return {name: b % k for name, b in branches.items()}, branches


def svg_texts(path) -> list[str]:
    root = ET.parse(path).getroot()
    assert root.tag == f"{SVG}svg"
    return ["".join(t.itertext()) for t in root.iter(f"{SVG}text")]


def test_png_is_written_and_is_a_png(tmp_path):
    m = zoo.inception_block()
    streams, branches = fake_assignment(m)
    out = draw_graph(m, tmp_path / "g.png", streams=streams, branches=branches, title="inception")
    assert out == tmp_path / "g.png"
    data = out.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 10_000


def test_svg_is_valid_xml_with_op_labels_streams_and_branches(tmp_path):
    m = zoo.inception_block()
    streams, branches = fake_assignment(m)
    texts = svg_texts(draw_graph(m, tmp_path / "g.svg", streams=streams, branches=branches, title="my title"))
    joined = "\n".join(texts)
    for label in ("stream 0", "stream 1", "stream 2", "my title", "Concat", "AveragePool", "BatchNormalization",
                  "edge between branches (event)", "input", "output"):
        assert label in joined
    assert "stream 3" not in joined
    # Every box names its branch on its second line (one SVG text element per line).
    assert sum(a == "Conv" and re.fullmatch(r"b\d+", b) is not None for a, b in zip(texts, texts[1:])) == 7


def test_without_streams_or_branches(tmp_path):
    m = zoo.resnet_bottleneck()
    texts = svg_texts(draw_graph(m, tmp_path / "plain.svg"))
    assert not any(t.startswith("stream") for t in texts)
    assert "resnet_bottleneck" in texts  # the graph's name stands in for a title
    assert draw_graph(m, tmp_path / "upper.PNG").read_bytes().startswith(PNG_MAGIC)


def test_nodes_missing_from_the_assignment_are_marked(tmp_path):
    m = zoo.resnet_bottleneck()
    streams = {n.name: 0 for n in m.graph.node[:5]}
    assert "no stream" in svg_texts(draw_graph(m, tmp_path / "partial.svg", streams=streams))


@pytest.mark.parametrize("name", ["notes.pdf", "graph", "graph.jpg"])
def test_other_formats_raise_naming_the_option(tmp_path, name):
    with pytest.raises(ParastreamError, match=r"--picture .*\.svg or \.png"):
        draw_graph(zoo.resnet_bottleneck(), tmp_path / name)
    assert not (tmp_path / name).exists()


def test_a_few_hundred_nodes_stay_legible(tmp_path):
    m = zoo.small_net()
    streams, branches = fake_assignment(m, k=4)
    out = draw_graph(m, tmp_path / "big.png", streams=streams, branches=branches)
    from PIL import Image

    with Image.open(out) as im:
        w, h = im.size
    # The figure grows with the graph at a fixed scale instead of shrinking the boxes.
    assert h > 3000 and w >= 900


@pytest.mark.parametrize("name", sorted(zoo.MODELS))
def test_layout_flows_downwards_and_keeps_boxes_apart(name):
    m = zoo.MODELS[name]()
    dag = node_graph(m)
    layout = _Layout(dag, [("input", [n.name for n in m.graph.node if "input" in n.input])],
                     [("output", m.graph.node[-1].name)])
    for u, v in dag.edges:
        assert layout.point(u)[1] > layout.point(v)[1]
    for u, v, chain in layout.paths:
        assert [layout.layer[p] for p in chain] == list(range(layout.layer[u], layout.layer[v] + 1))
    rows: dict[int, list[float]] = {}
    for v, layer in layout.layer.items():
        rows.setdefault(layer, []).append(layout.x[v])
    for xs in rows.values():
        xs.sort()
        assert all(b - a >= 1 - 1e-9 for a, b in zip(xs, xs[1:]))
    assert layout.depth == len(list(nx.topological_generations(dag))) + 2
