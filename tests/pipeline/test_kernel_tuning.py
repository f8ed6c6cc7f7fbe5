"""The "kernel tuning" round (pipeline.measure.kernel_tuning_round): where the --opt-level asked for tunes a
backend's kernels on the device (torch: 4 and 5), a GPU build compiles its search and rounds at the level below and
races the level asked for last, on the plan the rounds chose; the tuned engines ship only where they ran faster."""

from __future__ import annotations

import types

import numpy as np
import pytest

from parastream.launcher.engines import BuildOptions, get_backend
from parastream.pipeline import bench, measure
from parastream.pipeline.build import BuildConfig, engine_options


def test_the_torch_backend_tunes_from_level_4_and_the_others_never():
    torch_backend, trt, ort = (get_backend(n) for n in ("torch", "tensorrt", "onnxruntime"))
    assert [measure.tuned_level(torch_backend, lvl) for lvl in range(6)] == [None, None, None, None, 4, 5]
    assert [measure.rounds_level(torch_backend, lvl) for lvl in range(6)] == [0, 1, 2, 3, 3, 3]
    for other in (trt, ort):  # TensorRT's level is its builder's own (its tactics timed within each build)
        assert measure.tuned_level(other, 5) is None and measure.rounds_level(other, 5) == 5


@pytest.mark.parametrize("measure_on, compile_on, want", [(True, True, 3), (False, True, 4), (True, False, 4)])
def test_a_measuring_gpu_build_compiles_at_the_rounds_level(measure_on, compile_on, want):
    """The level asked for is raced last only where the build measures and compiles: with the measurement off
    (nothing to race it against) or eager engines, the engines are built at the level asked for."""
    cfg = BuildConfig(optimization_level=4, measure=measure_on, compile=compile_on)
    assert engine_options(cfg, get_backend("torch")).optimization_level == want
    assert engine_options(cfg, get_backend("onnxruntime")).optimization_level == 4  # no GPU, nothing tuned


class _Launcher:
    def __init__(self, v):
        self.v, self.closed = v, False

    def close(self):
        self.closed = True


@pytest.mark.parametrize("tuned_ms, won", [(0.9, True), (1.1, False)])
def test_the_round_races_the_same_plan_at_the_level_asked_for(monkeypatch, tuned_ms, won):
    plan = types.SimpleNamespace(num_streams=1)
    v = measure.Variant(model=None, graph=None, plan=plan, options=BuildOptions(optimization_level=3))
    loaded: list[_Launcher] = []
    engines = types.SimpleNamespace(launcher=lambda var: loaded.append(_Launcher(var)) or loaded[-1])
    monkeypatch.setattr(bench, "measure", lambda launchers, **kw: {
        k: np.full(10, tuned_ms if la.v.options.optimization_level == 4 else 1.0) for k, la in launchers.items()})
    r, got = measure.kernel_tuning_round(engines, v, 4, runs=10)
    assert got is won
    assert [la.v.options.optimization_level for la in loaded] == [3, 4]  # the plan as compiled, then tuned
    assert all(la.v.plan is plan for la in loaded) and all(la.closed for la in loaded)
    assert v.options.optimization_level == 3  # the variant given is left as it was
    labels = measure.round_labels(measure.TUNING_ROUND, plan)
    assert r["choice"] == measure.TUNING_ROUND and r["level"] == 4 and r["won"] == labels[int(won)]
    assert r["timed_ms"] == {labels[0]: 1.0, labels[1]: tuned_ms}


def test_a_round_whose_tuned_engines_do_not_load_closes_what_it_loaded(monkeypatch):
    v = measure.Variant(model=None, graph=None, plan=types.SimpleNamespace(num_streams=1),
                        options=BuildOptions(optimization_level=3))
    loaded: list[_Launcher] = []

    def launcher(var):
        if var.options.optimization_level == 5:
            raise RuntimeError("the tuned compile failed")
        loaded.append(_Launcher(var))
        return loaded[-1]

    with pytest.raises(RuntimeError, match="tuned compile"):
        measure.kernel_tuning_round(types.SimpleNamespace(launcher=launcher), v, 5, runs=10)
    assert len(loaded) == 1 and loaded[0].closed
