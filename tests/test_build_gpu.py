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
