"""``--backend tensorrt`` through the whole pipeline and the CLI, with the TensorRT test double in place.

The double (tests/trt_double) stands in for TensorRT and the GPU check is faked; the bundle's
verification then runs the engines' host path (``run``) under the CPU launcher.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import onnx
import pytest
import trt_double
from graphs import ort_reference
from graphs import three_branch_model as _three_branch_model

import parastream.launcher as launcher_api
from parastream.launcher import load
from parastream.launcher.errors import ParastreamError
from parastream.pipeline.cli import main


def three_branch_model(**kw) -> onnx.ModelProto:
    model = _three_branch_model(**kw)
    model.ir_version = 8  # an IR version every onnxruntime reads
    return model


@pytest.fixture
def trt(monkeypatch):
    fake = trt_double.install(monkeypatch)
    # the double runs on host memory: keep the verification on the CPU launcher even where a GPU exists
    monkeypatch.setattr(launcher_api, "cuda_device_count", lambda: 0)
    return fake


@pytest.fixture
def pipeline_build():
    pytest.importorskip("parastream.pipeline.analysis", reason="the pipeline's graph analysis (pipeline/analysis.py) has not landed")
    from parastream.pipeline import build

    return build


@pytest.fixture
def model_path(tmp_path):
    p = tmp_path / "three_branch.onnx"
    onnx.save(three_branch_model(), p)
    return p


def test_build_writes_plan_engines_and_inspector_report(trt, pipeline_build, model_path, tmp_path):
    out = tmp_path / "out"
    bundle = pipeline_build(model_path, out, backend="tensorrt", search=False, streams=3, cache_dir=str(tmp_path / "cache"))
    plan = bundle.plan
    assert plan.backend == "tensorrt" and len(plan.branches) >= 2
    engines = sorted(p.name for p in (out / "engines").iterdir())
    assert engines == [f"branch_{b.id:03d}.plan" for b in plan.branches]
    report = json.loads((out / "report.json").read_text())
    for b in plan.branches:
        entry = report["engines"][b.name]
        assert [layer["Name"] for layer in entry["layers"]] == b.nodes  # the engine inspector's layers
        assert entry["timing_cache"]["path"].startswith(str(tmp_path / "cache"))
    assert report["verification"]["passed"] is True
    assert json.loads((out / "manifest.json").read_text())["backend"] == "tensorrt"
    assert list((tmp_path / "cache").glob("timing-*.cache"))
    # every branch of the build used the same timing cache
    assert len({c[2]["cache"] for c in trt.calls("IBuilderConfig", "set_timing_cache")}) == 1

    run = load(out)
    x = np.random.default_rng(5).standard_normal((1, 4, 8, 8)).astype(np.float32)
    got = run({"input": x})["output"]
    np.testing.assert_allclose(got, ort_reference(three_branch_model(), {"input": x})["output"], rtol=1e-5, atol=1e-6)


def test_a_branch_tensorrt_cannot_parse_names_branch_and_node_and_writes_nothing(trt, pipeline_build, model_path, tmp_path):
    trt.UNSUPPORTED_OPS.add("Sigmoid")
    out = tmp_path / "out"
    with pytest.raises(ParastreamError) as e:
        pipeline_build(model_path, out, backend="tensorrt", search=False, streams=3, cache_dir=str(tmp_path / "cache"))
    msg = str(e.value)
    assert "branch_" in msg and "node 'sigmoid' (Sigmoid)" in msg and "Plugin not found" in msg
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "three_branch.onnx"]  # no half-written bundle


def test_cli_backend_tensorrt_without_tensorrt_fails_at_once_with_the_install_hint(monkeypatch, model_path, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    out = tmp_path / "out"
    assert main(["build", str(model_path), "-o", str(out), "--backend", "tensorrt", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "--backend tensorrt: TensorRT is not installed: pip install tensorrt" in err and "NGC" in err
    assert not out.exists()
