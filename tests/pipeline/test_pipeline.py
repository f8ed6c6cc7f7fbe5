"""The CPU pipeline end to end: build a bundle, run it with the CPU launcher, compare with ONNX Runtime."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from graphs import ort_reference, three_branch_model, two_output_model

from parastream.launcher import load
from parastream.launcher.bundle import Bundle, sha256_file
from parastream.launcher.plan import Plan
from parastream.pipeline import build


@pytest.fixture
def model_path(tmp_path):
    p = tmp_path / "three_branch.onnx"
    onnx.save(three_branch_model(), p)
    return p


def _max_rel(a, b):
    return float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-6)))


def test_bundle_layout_and_manifest(model_path, tmp_path):
    out = tmp_path / "out"
    bundle = build(model_path, out, backend="onnxruntime", search=False, streams=3)
    names = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    assert {"manifest.json", "model.onnx", "plan.json", "report.json"} <= names
    engines = sorted(n for n in names if n.startswith("engines/"))
    assert engines == sorted(b.engine for b in bundle.plan.branches)
    manifest = json.loads((out / "manifest.json").read_text())
    assert set(manifest["files"]) == names - {"manifest.json"}
    for rel, digest in manifest["files"].items():
        assert sha256_file(out / rel) == digest
    assert manifest["backend"] == "onnxruntime" and manifest["precision"] == "fp32"
    assert "onnx" in manifest["parastream"]
    # nothing temporary left beside OUT
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_a_written_bundle_s_engines_are_slimmed_against_its_model_onnx(model_path, tmp_path, monkeypatch):
    """Each engine a build writes into the bundle goes through the backend's ``slim_engine`` with model.onnx's
    initializers (what the bundle keeps once for its engines: the torch backend's compiled engines drop their ONNX
    weights, tests/engines/test_torch_inductor.py); the file written is what it returns, and the bundle verifies."""
    from parastream.launcher.engines import onnxruntime as ort_backend

    seen = []

    def slim(data, held):
        seen.append(data)
        return data + b""  # (the same bytes: an ONNX Runtime engine is its branch's ONNX)

    monkeypatch.setattr(ort_backend, "slim_engine", slim)
    bundle = build(model_path, tmp_path / "out", backend="onnxruntime", search=False, streams=3)
    written = {bundle.engine_bytes(b) for b in bundle.plan.branches}
    assert bundle.plan.branches and written <= set(seen)
    model = onnx.load(str(tmp_path / "out" / "model.onnx"))
    assert bundle.report["verification"]["passed"] and model.graph.initializer


def test_three_branches_run_on_three_streams(model_path, tmp_path):
    bundle = build(model_path, tmp_path / "out", backend="onnxruntime", search=False, streams=3)
    plan = bundle.plan
    assert plan.num_streams == 3
    streams_of_convs = {plan.branches[bid].stream for bid in range(len(plan.branches))
                        for n in plan.branches[bid].nodes if n.startswith("conv")}
    assert streams_of_convs == {0, 1, 2}
    # the concat waits on the two branches that are not on its own stream
    concat = next(b for b in plan.branches if "concat" in b.nodes)
    assert len(concat.waits) == 2
    # consecutive nodes of one stream with no event between them form one engine: conv+relu together
    for i in range(3):
        owner = next(b for b in plan.branches if f"conv{i}" in b.nodes)
        assert f"relu{i}" in owner.nodes


@pytest.mark.parametrize("streams", [1, 2, 3])
def test_cpu_launcher_matches_onnxruntime(model_path, tmp_path, streams):
    out = tmp_path / f"out{streams}"
    build(model_path, out, backend="onnxruntime", search=False, streams=streams)
    runner = load(out)
    rng = np.random.default_rng(123)
    for _ in range(3):
        x = rng.standard_normal((1, 4, 8, 8)).astype(np.float32)
        ref = ort_reference(onnx.load(model_path), {"input": x})["output"]
        got = runner({"input": x})["output"]
        assert got.shape == ref.shape
        assert _max_rel(got, ref) <= 1e-5


def test_output_that_is_also_consumed(tmp_path):
    p = tmp_path / "two.onnx"
    onnx.save(two_output_model(), p)
    bundle = build(p, tmp_path / "out", backend="onnxruntime", search=False, streams=2)
    runner = load(bundle.path)
    x = np.random.default_rng(5).standard_normal((2, 16)).astype(np.float32)
    ref = ort_reference(onnx.load(p), {"x": x})
    got = runner({"x": x})
    assert set(got) == {"y", "aux"}
    for k in ref:
        assert _max_rel(got[k], ref[k]) <= 1e-5


def test_plan_round_trips_through_json(model_path, tmp_path):
    bundle = build(model_path, tmp_path / "out", backend="onnxruntime", search=False, streams=2)
    again = Plan.from_json(bundle.plan.to_json())
    assert again == bundle.plan
    again.validate()


def test_report_records_verification(model_path, tmp_path):
    bundle = build(model_path, tmp_path / "out", backend="onnxruntime", search=False)
    ver = bundle.report["verification"]
    assert ver["passed"] is True
    assert ver["outputs"]["output"]["max_abs"] < 1e-5
    assert bundle.report["schedule"]["graph_width"] == 3


def test_a_build_that_runs_its_reference_ahead_verifies_as_one_that_does_not(model_path, tmp_path, monkeypatch):
    """Where the reference runs during the build (a GPU build: ``runs_reference_ahead``), the verification's
    figures are those of a build that runs it at the end, and a wrong launcher still fails it."""
    from parastream.launcher import cpu
    from parastream.launcher.errors import VerificationError
    import importlib

    build_module = importlib.import_module("parastream.pipeline.build")  # (the package's ``build`` is the function)

    plain = build(model_path, tmp_path / "plain", backend="onnxruntime", search=False).report["verification"]
    monkeypatch.setattr(build_module, "runs_reference_ahead", lambda b: True)
    ahead = build(model_path, tmp_path / "ahead", backend="onnxruntime", search=False).report["verification"]
    assert plain["passed"] and ahead["passed"] and "reference_ahead_s" not in plain and ahead["reference_ahead_s"] > 0
    assert ahead["outputs"] == plain["outputs"]

    real_call = cpu.CpuLauncher.__call__
    monkeypatch.setattr(cpu.CpuLauncher, "__call__", lambda self, feeds: {k: v + 1e-2 for k, v in real_call(self, feeds).items()})
    with pytest.raises(VerificationError):
        build(model_path, tmp_path / "wrong", backend="onnxruntime", search=False)
    assert not (tmp_path / "wrong").exists()


def test_verification_failure_writes_no_bundle(model_path, tmp_path, monkeypatch):
    """A launcher that computes something else must fail verification, exit 1, and leave no OUT."""
    from parastream.launcher import cpu
    from parastream.launcher.errors import VerificationError

    real_call = cpu.CpuLauncher.__call__

    def wrong(self, feeds):
        return {k: v + 1e-2 for k, v in real_call(self, feeds).items()}

    monkeypatch.setattr(cpu.CpuLauncher, "__call__", wrong)
    with pytest.raises(VerificationError) as info:
        build(model_path, tmp_path / "out", backend="onnxruntime", search=False)
    assert info.value.exit_code == 1
    assert "output" in str(info.value)
    assert not (tmp_path / "out").exists()
    assert list(tmp_path.glob(".out*")) == []


def test_force_replaces_existing_bundle(model_path, tmp_path):
    out = tmp_path / "out"
    build(model_path, out, backend="onnxruntime", search=False, streams=1)
    assert Bundle.open(out).plan.num_streams == 1
    build(model_path, out, backend="onnxruntime", search=False, streams=3, force=True)
    assert Bundle.open(out).plan.num_streams == 3


def test_tampered_bundle_is_refused(model_path, tmp_path):
    from parastream.launcher.errors import ParastreamError

    out = tmp_path / "out"
    bundle = build(model_path, out, backend="onnxruntime", search=False)
    eng = out / bundle.plan.branches[0].engine
    eng.write_bytes(eng.read_bytes() + b"x")
    with pytest.raises(ParastreamError, match="sha256"):
        load(out)


def test_python_api_mirrors_cli(model_path, tmp_path):
    """build() returns the bundle; launcher.load returns a callable; shapes can be given for symbolic inputs."""
    p = tmp_path / "dyn.onnx"
    onnx.save(three_branch_model(batch="N"), p)
    bundle = build(p, tmp_path / "out", backend="onnxruntime", search=False, shapes={"input": [2, 4, 8, 8]})
    assert bundle.plan.inputs[0].shape == [2, 4, 8, 8]
    out = load(bundle.path)({"input": np.ones((2, 4, 8, 8), np.float32) * 0.5})
    assert out["output"].shape == (2, 12, 8, 8)


def test_the_build_schedules_a_graph_once_per_stream_request(model_path, monkeypatch):
    """``Engines.schedule`` of the graph it scheduled last, with the same arguments, is the schedule it made (the
    search's stream count and the measurement's plan of the input); each caller gets its own rows tried."""
    import importlib

    from parastream.launcher.engines import onnxruntime as ort_backend
    from parastream.pipeline import BuildConfig

    b = importlib.import_module("parastream.pipeline.build")  # (the package's ``build`` is the function)
    state = b.load_and_check(model_path, BuildConfig(backend="onnxruntime"), ort_backend, b._Progress(False), {})
    calls = []
    real = b.plan_streams
    monkeypatch.setattr(b, "plan_streams", lambda *a, **k: calls.append(a[2:4]) or real(*a, **k))
    first, tried = state.engines.schedule(state.graph, None, 4)
    plan = state.engines.plan(state.graph, None, 4)
    again, tried_again = state.engines.schedule(state.graph, None, 4)
    assert calls == [(None, 4)] and again is first and tried_again == tried and tried_again is not tried
    assert len(plan.branches) == len(first.branches)
    tried_again[0]["note"] = "changed by a caller"
    assert "note" not in state.engines.schedule(state.graph, None, 4)[1][0]
    state.engines.schedule(state.graph, 1, 1)
    other = state.graph.copy()
    state.engines.schedule(other, None, 4)
    assert calls == [(None, 4), (1, 1), (None, 4)]
