"""One graph carried from load to plan: a build imports the model into onnx-graphsurgeon a bounded number of times
(the loader twice: to fold, then once its shapes are known; the rewrite search once for its own graph; the build
once more only when the search rewrote the model), and no stage changes the graph it is handed."""

from __future__ import annotations

import importlib
from pathlib import Path

import onnx_graphsurgeon as gs
import pytest
from test_batch_buckets import _reshaping_model

from parastream.pipeline import build
from parastream.pipeline.model_io import load_model

build_module = importlib.import_module("parastream.pipeline.build")  # the module (the package exports the function)

SMALL_NET = Path(__file__).resolve().parents[1] / "examples" / "models" / "small_net.onnx"


@pytest.fixture
def imports(monkeypatch):
    """gs.import_onnx with a counter; the LoadedModels the build loads, to check their graphs afterwards."""
    calls = []
    real = gs.import_onnx
    monkeypatch.setattr(gs, "import_onnx", lambda *a, **k: calls.append(1) or real(*a, **k))
    loaded = []
    real_load = build_module.load_model
    monkeypatch.setattr(build_module, "load_model", lambda *a, **k: loaded.append(real_load(*a, **k)) or loaded[-1])
    return calls, loaded


def _unchanged(lm) -> None:
    """The graph carried from the loader is still the graph of the loaded model (no stage changed it)."""
    exported = gs.export_onnx(lm.graph, do_type_check=False)
    assert [(n.name, n.op_type, list(n.input), list(n.output)) for n in exported.graph.node] == \
           [(n.name, n.op_type, list(n.input), list(n.output)) for n in lm.model.graph.node]


def test_a_searched_cpu_build_imports_the_model_at_most_four_times(imports, tmp_path):
    calls, loaded = imports
    bundle = build(SMALL_NET, tmp_path / "out", backend="onnxruntime", cpu_runs=2)
    report = bundle.report
    changed = bool(report["search"].get("rules_chosen"))
    # loader 2 (fold, then the graph carried), search 1, after the search 1 only when it rewrote the model
    assert len(calls) <= 3 + changed, f"{len(calls)} imports into graphsurgeon (was 7 before the graph was carried)"
    assert report["verification"]["passed"]  # a build that imports less still matches onnxruntime
    (lm,) = loaded
    _unchanged(lm)


def test_a_bucketed_build_imports_the_model_twice_per_bucket(imports, tmp_path):
    calls, loaded = imports
    path = _reshaping_model(tmp_path / "m.onnx")
    build(path, tmp_path / "out", backend="onnxruntime", batch=(1, 2, 8), search=False, cpu_runs=2)
    assert len(loaded) == 4  # buckets 1, 2, 4, 8
    assert len(calls) <= 2 * len(loaded), f"{len(calls)} imports for {len(loaded)} buckets (was 4 per bucket)"
    for lm in loaded:
        _unchanged(lm)


def test_the_loaded_graph_is_the_loaded_model():
    lm = load_model(SMALL_NET)
    _unchanged(lm)
    shapes = {t.name: t.shape for t in lm.graph.tensors().values() if isinstance(t, gs.Variable)}
    assert all(s is not None and all(isinstance(d, int) for d in s) for s in shapes.values())  # shapes known
    assert [n.name for n in lm.graph.nodes] == [n.name for n in lm.model.graph.node]  # toposorted as the model
