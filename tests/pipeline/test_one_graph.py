"""One graph carried from load to plan: a static build imports the model into onnx-graphsurgeon once (the loader;
the rewrite search copies that graph and hands back the graph of what it chose), infers its shapes once (plus
once for the rewritten model the search exports, whose inferred value_info model.onnx keeps), builds at most
two node DAGs (the loaded graph's, the rewritten graph's), and no stage changes the graph it is handed."""

from __future__ import annotations

import importlib
from pathlib import Path

import networkx as nx
import onnx
import onnx_graphsurgeon as gs
import pytest
from test_batch_buckets import _reshaping_model
from test_static_shapes import _save, same_pad_model

from parastream.pipeline import build
from parastream.pipeline.model_io import graph_of, load_model, unknown_tensors
from parastream.rewrite import RooflineCostModel
from parastream.rewrite.search import optimize_graph

build_module = importlib.import_module("parastream.pipeline.build")  # the module (the package exports the function)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "models"
SMALL_NET = EXAMPLES / "small_net.onnx"


@pytest.fixture
def counted(monkeypatch):
    """Counters of gs.import_onnx, onnx shape inference and networkx DiGraphs made; the LoadedModels the build
    loads, to check their graphs afterwards."""
    calls = {"import": 0, "infer": 0, "dag": 0}

    def counting(key, real):
        def call(*a, **k):
            calls[key] += 1
            return real(*a, **k)
        return call

    monkeypatch.setattr(gs, "import_onnx", counting("import", gs.import_onnx))
    monkeypatch.setattr(onnx.shape_inference, "infer_shapes", counting("infer", onnx.shape_inference.infer_shapes))
    monkeypatch.setattr(nx.DiGraph, "__init__", counting("dag", nx.DiGraph.__init__))
    loaded = []
    real_load = build_module.load_model
    monkeypatch.setattr(build_module, "load_model", lambda *a, **k: loaded.append(real_load(*a, **k)) or loaded[-1])
    return calls, loaded


def _unchanged(lm) -> None:
    """The graph carried from the loader is still the graph of the loaded model (no stage changed it)."""
    exported = gs.export_onnx(lm.graph, do_type_check=False)
    assert [(n.name, n.op_type, list(n.input), list(n.output)) for n in exported.graph.node] == \
           [(n.name, n.op_type, list(n.input), list(n.output)) for n in lm.model.graph.node]


def _described(graph: gs.Graph):
    """Everything of ``graph`` a later stage reads or exports: the exported bytes, every tensor's kind, type and
    shape, the node names in order and the graph's own fields."""
    tensors = [(name, type(t).__name__, getattr(t, "dtype", None), getattr(t, "shape", None), getattr(t, "type", None))
               for name, t in graph.tensors().items()]
    fields = [getattr(graph, k)
              for k in ("name", "doc_string", "opset", "producer_name", "producer_version", "ir_version")]
    return (gs.export_onnx(graph, do_type_check=False).SerializeToString(), tensors, [n.name for n in graph.nodes],
            fields)


@pytest.mark.parametrize("name", ["inception_block", "small_net"])
def test_a_searched_cpu_build_imports_and_infers_once(counted, tmp_path, name):
    calls, loaded = counted
    bundle = build(EXAMPLES / f"{name}.onnx", tmp_path / "out", backend="onnxruntime", cpu_runs=2)
    report = bundle.report
    rewritten = bool(report["search"].get("rules_chosen"))
    assert rewritten  # both examples are rewritten: the search's export is counted below
    assert calls["import"] == 1, f"{calls['import']} imports into graphsurgeon (was 4 before the graph was carried)"
    # the loader's inference, and the rewritten model's (its export is checked and keeps its value_info)
    assert calls["infer"] == 1 + rewritten, f"{calls['infer']} shape inferences (was 3)"
    assert calls["dag"] <= 2, f"{calls['dag']} networkx DiGraphs (was 7)"
    assert report["verification"]["passed"]  # a build that imports less still matches onnxruntime
    (lm,) = loaded
    _unchanged(lm)


def test_a_bucketed_build_imports_and_infers_once_per_bucket(counted, tmp_path):
    calls, loaded = counted
    path = _reshaping_model(tmp_path / "m.onnx")
    build(path, tmp_path / "out", backend="onnxruntime", batch=(1, 2, 8), search=False, cpu_runs=2)
    assert len(loaded) == 4  # buckets 1, 2, 4, 8
    assert calls["import"] == len(loaded), f"{calls['import']} imports for {len(loaded)} buckets (was 2 per bucket)"
    assert calls["infer"] == len(loaded), f"{calls['infer']} shape inferences for {len(loaded)} buckets"
    for lm in loaded:
        _unchanged(lm)


@pytest.mark.parametrize("name", sorted(p.stem for p in EXAMPLES.glob("*.onnx")))
def test_the_carried_graph_is_the_import_of_the_loaded_model(name):
    """The loader's folded graph with the inferred shapes adopted is what importing its model gives."""
    lm = load_model(EXAMPLES / f"{name}.onnx")
    assert _described(lm.graph) == _described(graph_of(lm.model))
    _unchanged(lm)


def test_a_model_whose_shapes_need_the_fixed_point_is_imported_again(tmp_path, monkeypatch):
    """Where plain inference stops, the fallbacks change the model: its graph is imported from their result."""
    calls = []
    real = gs.import_onnx
    monkeypatch.setattr(gs, "import_onnx", lambda *a, **k: calls.append(1) or real(*a, **k))
    lm = load_model(_save(same_pad_model(), tmp_path / "same_pad.onnx"))
    assert len(calls) > 1
    assert _described(lm.graph) == _described(graph_of(lm.model))


def test_the_fixed_point_infers_once_per_pass(tmp_path, monkeypatch):
    """A model that needs one folding pass after plain inference: the inference that found the unknown shapes is
    the first pass's (it was repeated), one after the pass, one of the final model: 3 in all."""
    calls = []
    real = onnx.shape_inference.infer_shapes
    monkeypatch.setattr(onnx.shape_inference, "infer_shapes", lambda *a, **k: calls.append(1) or real(*a, **k))
    lm = load_model(_save(same_pad_model(), tmp_path / "same_pad.onnx"))
    assert not unknown_tensors(lm.model)
    assert len(calls) == 3  # the first, the pass's, the final model's (its Constants made initializers)


def test_the_loaded_graph_is_the_loaded_model():
    lm = load_model(SMALL_NET)
    _unchanged(lm)
    shapes = {t.name: t.shape for t in lm.graph.tensors().values() if isinstance(t, gs.Variable)}
    assert all(s is not None and all(isinstance(d, int) for d in s) for s in shapes.values())  # shapes known
    assert [n.name for n in lm.graph.nodes] == [n.name for n in lm.model.graph.node]  # toposorted as the model


def test_the_search_leaves_its_input_graph_and_returns_the_graph_of_its_result(monkeypatch):
    lm = load_model(EXAMPLES / "inception_block.onnx")
    before = _described(lm.graph)
    imports = []
    real = gs.import_onnx
    monkeypatch.setattr(gs, "import_onnx", lambda *a, **k: imports.append(1) or real(*a, **k))
    result, graph, report = optimize_graph(lm.model, lm.graph, cost_model=RooflineCostModel("CPU"), streams=2)
    assert report["rules_chosen"] and result is not lm.model
    assert not imports  # neither the input nor the result was imported
    assert _described(lm.graph) == before  # the input graph is as the loader left it
    monkeypatch.undo()
    assert _described(graph) == _described(graph_of(result))


def test_a_search_that_keeps_the_input_returns_its_graph():
    lm = load_model(SMALL_NET)
    result, graph, report = optimize_graph(lm.model, lm.graph, rules=[])
    assert result is lm.model and graph is lm.graph and report["rules_chosen"] == []


def test_a_graph_is_not_adopted_by_a_model_with_other_nodes(monkeypatch):
    """adopt_model refuses a model that is not the graph's export (and leaves the graph as it was); the search
    then imports its result: the graph it returns is still the result's."""
    from parastream.rewrite import ir, search

    small, inception = load_model(SMALL_NET), load_model(EXAMPLES / "inception_block.onnx")
    before = _described(small.graph)
    assert ir.adopt_model(small.graph, inception.model) is None
    assert _described(small.graph) == before
    monkeypatch.setattr(search, "adopt_model", lambda graph, model: None)
    result, graph, report = optimize_graph(inception.model, inception.graph, cost_model=RooflineCostModel("CPU"),
                                           streams=2)
    assert report["rules_chosen"] and _described(graph) == _described(graph_of(result))


def test_the_original_is_the_file_s_bytes_where_it_is_the_file_as_read(tmp_path):
    """ONNX Runtime's early check and the verification's reference load ``LoadedModel.original_bytes``: the
    file's own bytes for a model read as it is, a serialization (made once) where the loader named nodes or
    fixed input shapes, or inlined external data; either way the model ``original`` holds."""
    from onnx.external_data_helper import convert_model_to_external_data

    data = SMALL_NET.read_bytes()
    plain = load_model(SMALL_NET)
    assert plain.original_bytes() is plain.original_data and plain.original_bytes() == data

    unnamed = onnx.load(SMALL_NET)
    for n in unnamed.graph.node:
        n.name = ""
    onnx.save(unnamed, tmp_path / "unnamed.onnx")
    named = load_model(tmp_path / "unnamed.onnx")
    assert named.original_data is None
    got = named.original_bytes()
    assert got is named.original_bytes() and onnx.load_from_string(got) == named.original
    assert all(n.name for n in onnx.load_from_string(got).graph.node)

    first = plain.model.graph.input[0]
    shaped = load_model(SMALL_NET, {first.name: [d.dim_value or 1 for d in first.type.tensor_type.shape.dim]})
    assert shaped.original_data is None and onnx.load_from_string(shaped.original_bytes()) == shaped.original

    external = onnx.load(SMALL_NET)
    convert_model_to_external_data(external, all_tensors_to_one_file=True, location="w.data", size_threshold=0)
    onnx.save(external, tmp_path / "external.onnx")
    inlined = load_model(tmp_path / "external.onnx")
    assert inlined.original_data is None
    assert onnx.load_from_string(inlined.original_bytes()).graph.initializer[0].raw_data


def test_a_build_serializes_the_original_at_most_once(tmp_path, monkeypatch):
    """A model read as it is is never serialized for ONNX Runtime: the check and the verification load its file's
    bytes (a 340 MB ViT-B/16's serialization took 1.7-2.9 s on a 2-core machine, twice per build before)."""
    loads = []
    real = build_module.load_model

    def spy(*a, **k):
        loads.append(real(*a, **k))
        return loads[-1]

    monkeypatch.setattr(build_module, "load_model", spy)
    serialized = []
    real_ser = onnx.ModelProto.SerializeToString

    def counting(self, *a, **k):
        if any(self is lm.original for lm in loads):
            serialized.append(self)
        return real_ser(self, *a, **k)

    monkeypatch.setattr(onnx.ModelProto, "SerializeToString", counting)
    build(SMALL_NET, tmp_path / "b", backend="onnxruntime", streams=2)
    assert loads and serialized == []
