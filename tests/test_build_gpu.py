"""The whole build on the GPU (torch backend): stream choice in report.json, onboard measurement of the
search's candidates, verification in fp16 against onnxruntime, and the bundle replayed by the launcher."""

from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort
import pytest

from parastream.launcher.engines import get_backend
from parastream.pipeline import build
from parastream.pipeline.build import BuildConfig, gpu_measure
from parastream.pipeline.zoo import write_all


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("zoo")
    write_all(folder)
    return folder


def test_no_measurement_without_gpu_engines(models):
    from parastream.pipeline.model_io import load_model
    from parastream.rewrite.cost import RooflineCostModel

    loaded = load_model(models / "inception_block.onnx")
    m = gpu_measure(get_backend("onnxruntime"), None, RooflineCostModel(), loaded, streams=None, max_streams=4,
                    precision="fp32", budget_s=10)
    assert m is None


def test_cpu_build_records_the_stream_choice(models, tmp_path):
    bundle = build(models / "inception_block.onnx", tmp_path / "out", backend="onnxruntime")
    sched = bundle.report["schedule"]
    chosen = [t for t in sched["streams_tried"] if t["chosen"]]
    assert len(chosen) == 1 and chosen[0]["streams"] == bundle.plan.num_streams == sched["streams"]
    assert bundle.report["search"]["decided_by"] in ("cost_model", "unchanged")


def test_measurement_budget_always_leaves_the_input_and_one_rival(models, monkeypatch):
    """A budget spent while loading the input still measures the cost model's best candidate; then it stops."""
    import importlib
    import types

    import parastream.launcher as launcher_pkg
    import parastream.launcher.bench as bench_mod
    import parastream.launcher.gpu as gpu_mod
    from parastream.pipeline.build import MeasureBudgetSpent
    from parastream.pipeline.model_io import load_model
    from parastream.rewrite.cost import RooflineCostModel

    build_mod = importlib.import_module("parastream.pipeline.build")
    loaded = load_model(models / "inception_block.onnx")
    closed = []
    monkeypatch.setattr(launcher_pkg, "cuda_device_count", lambda: 1)
    monkeypatch.setattr(build_mod, "_write_engines", lambda *a, **k: None)
    monkeypatch.setattr(build_mod.Bundle, "open", classmethod(lambda cls, path, check_hashes=True: path))
    monkeypatch.setattr(gpu_mod, "GpuLauncher", lambda bundle: types.SimpleNamespace(close=lambda: closed.append(1)))
    monkeypatch.setattr(bench_mod, "measure", lambda launchers, runs, warmup: {k: np.array([2.0 if k == "candidate" else 1.0])
                                                                               for k in launchers})
    backend = types.SimpleNamespace(gpu=True, name="torch", suffix=".onnx")
    from parastream.launcher.engines import BuildOptions

    m = gpu_measure(backend, BuildOptions(precision="fp16"), RooflineCostModel(), loaded, streams=1, max_streams=1,
                    precision="fp16", budget_s=0)
    assert m(loaded.model) == pytest.approx(2e-3)  # the input: its own median
    assert m(loaded.model) == pytest.approx(4e-3)  # the first rival, measured although the budget is spent
    with pytest.raises(MeasureBudgetSpent):
        m(loaded.model)
    assert closed == [1]  # the rival's launcher is closed; the reference stays until close()
    m.close()
    assert closed == [1, 1]


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_build_measures_candidates(models, tmp_path):
    cfg = BuildConfig(backend="torch", precision="fp16", measure_seconds=600, measure_runs=30,
                      search_options={"top_k": 3})
    bundle = build(models / "inception_block.onnx", tmp_path / "out", config=cfg)
    search = bundle.report["search"]
    assert search["decided_by"] == "measured", search.get("decision")
    measured = [c for c in search["candidates"] if c["measured_s"] is not None]
    assert any(c["input"] for c in measured), "the input itself is always measured"
    chosen = [c for c in search["candidates"] if c["chosen"]]
    assert len(chosen) == 1 and chosen[0]["measured_s"] == min(c["measured_s"] for c in measured)
    assert bundle.report["verification"]["passed"]

    from parastream.launcher import load

    x = np.random.default_rng(5).standard_normal(bundle.plan.inputs[0].shape).astype(np.float32)
    ref = ort.InferenceSession(str(models / "inception_block.onnx"), providers=["CPUExecutionProvider"]).run(None, {bundle.plan.inputs[0].name: x})[0]
    with load(bundle.path, device="cuda") as run:
        got = run({bundle.plan.inputs[0].name: x})[bundle.plan.outputs[0].name]
    assert np.max(np.abs(got - ref)) / np.max(np.abs(ref)) < 2e-2
    json.dumps(bundle.report)  # the report stays JSON


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_build_times_the_plan_against_one_engine(models, tmp_path):
    """Never slower by measurement: a multi-stream plan is kept only if it beats one whole-model engine on the device."""
    cfg = BuildConfig(backend="torch", precision="fp16", search=False, measure_runs=50)
    bundle = build(models / "inception_block.onnx", tmp_path / "out", config=cfg)
    sched = bundle.report["schedule"]
    chosen_by_cost = next(t["streams"] for t in sched["streams_tried"] if t.get("chosen"))
    if chosen_by_cost == 1:
        assert sched["measured"] is None  # nothing to compare
        return
    m = sched["measured"]
    assert m["plan_s"] > 0 and m["single_engine_s"] > 0, m
    faster_single = m["single_engine_s"] < m["plan_s"] * (1 - m["margin"])
    assert m["chosen"] == ("single_engine" if faster_single else "plan")
    assert sched["streams"] == (1 if faster_single else chosen_by_cost)
    assert bundle.report["verification"]["passed"]
