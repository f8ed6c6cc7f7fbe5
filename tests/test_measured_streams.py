"""GPU builds time the chosen stream plan against one whole-model engine and keep the faster (issue 11).

The timing itself needs a GPU (gpu_measure; tests/test_build_gpu.py); here a stand-in ``measure`` checks
the decision, what report.json records, and that nothing is timed where it must not be.
"""

from __future__ import annotations

from pathlib import Path

import importlib

import pytest

from parastream.pipeline.build import measured_stream_choice

build_mod = importlib.import_module("parastream.pipeline.build")  # the package exports build() under the same name

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "models" / "small_net.onnx"


class FakeMeasure:
    """Seconds per model: ``plan_s`` for the chosen plan, ``single_s`` for one stream."""

    def __init__(self, plan_s, single_s, fail=False):
        self.plan_s, self.single_s, self.fail = plan_s, single_s, fail
        self.calls, self.closed = [], False

    def __call__(self, model, streams_override=None):
        self.calls.append(streams_override)
        if self.fail:
            raise RuntimeError("cudaErrorLaunchFailure\nmore")
        return self.single_s if streams_override == 1 else self.plan_s

    def close(self):
        self.closed = True


class _Sched:
    def __init__(self, k):
        self.num_streams = k


@pytest.mark.parametrize("plan_s,single_s,chosen", [(1.0, 0.5, "single_engine"), (0.5, 1.0, "plan"),
                                                    (1.0, 0.99, "plan")])  # within the 2% margin: the plan stays
def test_decision(plan_s, single_s, chosen):
    m = FakeMeasure(plan_s, single_s)
    res = measured_stream_choice(m, None, _Sched(3))
    assert res["chosen"] == chosen and res["plan_s"] == plan_s and res["single_engine_s"] == single_s
    assert res["chosen_streams"] == (1 if chosen == "single_engine" else 3)
    assert m.calls == [None, 1]  # the plan first (the reference), then one stream


def test_nothing_timed_without_a_gpu_or_with_one_stream():
    assert measured_stream_choice(None, None, _Sched(3)) is None
    m = FakeMeasure(1.0, 0.5)
    assert measured_stream_choice(m, None, _Sched(1)) is None and m.calls == []


def test_a_failed_measurement_keeps_the_plan_and_says_why():
    res = measured_stream_choice(FakeMeasure(1, 1, fail=True), None, _Sched(2))
    assert res["chosen_streams"] == 2 and res["error"] == "cudaErrorLaunchFailure"


@pytest.mark.parametrize("single_faster", [True, False])
def test_build_keeps_the_faster_and_records_it(tmp_path, monkeypatch, single_faster):
    fakes = []

    def fake_gpu_measure(*a, **k):
        fakes.append(FakeMeasure(1.0, 0.5 if single_faster else 2.0))
        return fakes[-1]

    monkeypatch.setattr(build_mod, "gpu_measure", fake_gpu_measure)
    bundle = build_mod.build(EXAMPLE, tmp_path / "out", backend="onnxruntime", search=False)
    m = bundle.report["schedule"]["measured"]
    assert m["chosen"] == ("single_engine" if single_faster else "plan")
    assert bundle.report["schedule"]["streams"] == (1 if single_faster else m["chosen_streams"])
    assert m["chosen_streams"] == bundle.report["schedule"]["streams"]
    assert fakes and all(f.closed for f in fakes)
    assert bundle.report["verification"]["passed"]


def test_build_with_streams_given_times_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(build_mod, "gpu_measure", lambda *a, **k: pytest.fail("timed although --streams was given"))
    bundle = build_mod.build(EXAMPLE, tmp_path / "out", backend="onnxruntime", search=False, streams=2)
    assert bundle.report["schedule"]["measured"] is None
