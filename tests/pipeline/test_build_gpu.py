"""The whole build on the GPU (torch backend): stream choice in report.json, onboard measurement of the
search's candidates, verification in fp16 against onnxruntime, and the bundle replayed by the launcher."""

from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort
import pytest
from gpu_build_fakes import fake_gpu, gpu_backend, plan_of

from parastream.launcher.engines import get_backend
from parastream.pipeline import build
from parastream.pipeline.build import BuildConfig, Engines
from parastream.pipeline.measure import GpuMeasurer, Variant
from parastream.pipeline.measure import DEPTHWISE_ROUNDS, has_conv_relu, time_alternatives
from parastream.pipeline.zoo import write_all
from parastream.rewrite.search import MEASURE_MARGIN


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("zoo")
    write_all(folder)
    return folder


def test_no_measurement_without_gpu_engines(models):
    from parastream.pipeline.model_io import load_model
    from parastream.rewrite.cost import RooflineCostModel

    loaded = load_model(models / "inception_block.onnx")
    engines = Engines(get_backend("onnxruntime"), RooflineCostModel(), loaded, "fp32")
    assert GpuMeasurer.for_build(engines, None, loaded, streams=None, max_streams=4, budget_s=10) is None


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
    import parastream.pipeline.bench as bench_mod
    import parastream.launcher.gpu as gpu_mod
    from parastream.pipeline.build import MeasureBudgetSpent
    from parastream.pipeline.model_io import load_model
    from parastream.rewrite.cost import RooflineCostModel

    build_mod = importlib.import_module("parastream.pipeline.build")
    loaded = load_model(models / "inception_block.onnx")
    closed = []
    monkeypatch.setattr(launcher_pkg, "cuda_device_count", lambda: 1)
    monkeypatch.setattr(build_mod, "_write_engines", lambda *a, **k: None)
    monkeypatch.setattr(gpu_mod, "GpuLauncher", lambda bundle: types.SimpleNamespace(close=lambda: closed.append(1)))
    monkeypatch.setattr(gpu_mod, "load_phases", lambda la: {})
    monkeypatch.setattr(bench_mod, "measure", lambda launchers, runs, warmup, lock=True, **kw: {
        k: np.array([2.0 if k == "candidate" else 1.0]) for k in launchers})
    backend = gpu_backend()
    from parastream.launcher.engines import BuildOptions

    m = GpuMeasurer.for_build(Engines(backend, RooflineCostModel(), loaded, "fp16"), BuildOptions(precision="fp16"),
                              loaded, streams=1, max_streams=1, budget_s=0)
    assert m.measure(loaded.model) == pytest.approx(2e-3)  # the input: its own median
    assert m.measure(loaded.model) == pytest.approx(4e-3)  # the first rival, measured although the budget is spent
    with pytest.raises(MeasureBudgetSpent):
        m.measure(loaded.model)
    assert closed == [1]  # the rival's launcher is closed; the reference stays until close()
    m.close()
    assert closed == [1, 1]


def test_the_measurement_budget_runs_from_the_moment_the_input_is_timed(models, monkeypatch):
    """The input's compile and load (which the build pays anyway: it ships the input when no candidate wins) do not
    spend the candidates' budget: a slow input still leaves the budget's seconds for candidates after it."""
    import importlib
    import time
    import types

    import parastream.launcher as launcher_pkg
    import parastream.pipeline.bench as bench_mod
    import parastream.launcher.gpu as gpu_mod
    from parastream.launcher.engines import BuildOptions
    from parastream.pipeline.build import MeasureBudgetSpent
    from parastream.pipeline.model_io import load_model
    from parastream.rewrite.cost import RooflineCostModel

    build_mod = importlib.import_module("parastream.pipeline.build")
    loaded = load_model(models / "inception_block.onnx")
    loads = []

    def launcher(bundle):
        time.sleep(0.6 if not loads else 0.0)  # the input: a slow compile and load
        loads.append(1)
        return types.SimpleNamespace(close=lambda: None)

    monkeypatch.setattr(launcher_pkg, "cuda_device_count", lambda: 1)
    monkeypatch.setattr(build_mod, "_write_engines", lambda *a, **k: None)
    monkeypatch.setattr(gpu_mod, "GpuLauncher", launcher)
    monkeypatch.setattr(gpu_mod, "load_phases", lambda la: {})
    monkeypatch.setattr(bench_mod, "measure", lambda launchers, runs, warmup, lock=True, **kw: {
        k: np.array([1.0]) for k in launchers})
    m = GpuMeasurer.for_build(Engines(gpu_backend(), RooflineCostModel(), loaded, "fp16"), BuildOptions(precision="fp16"),
                              loaded, streams=1, max_streams=1, budget_s=0.4)
    for _ in range(4):  # the input (0.6 s), then three candidates inside the 0.4 s that start once it is timed
        m.measure(loaded.model)
    time.sleep(0.45)
    with pytest.raises(MeasureBudgetSpent):
        m.measure(loaded.model)
    assert len(loads) == 4
    m.close()


def test_candidates_are_measured_past_the_budget_while_an_input_round_still_compiles(models, monkeypatch):
    """The search's end waits for the compile of an input's round (``alternatives_timed``): while one is in
    flight a spent budget does not end the measurements, which cost the build no time then; each such
    measurement is logged with how far past the budget it started.  Once the round's compile is done, the next
    candidate raises MeasureBudgetSpent."""
    import importlib
    import types

    import parastream.launcher as launcher_pkg
    import parastream.pipeline.bench as bench_mod
    import parastream.launcher.gpu as gpu_mod
    from parastream.launcher.engines import BuildOptions
    from parastream.pipeline.build import MeasureBudgetSpent
    from parastream.pipeline.model_io import load_model
    from parastream.rewrite.cost import RooflineCostModel

    build_mod = importlib.import_module("parastream.pipeline.build")
    loaded = load_model(models / "inception_block.onnx")
    monkeypatch.setattr(launcher_pkg, "cuda_device_count", lambda: 1)
    monkeypatch.setattr(build_mod, "_write_engines", lambda *a, **k: None)
    monkeypatch.setattr(gpu_mod, "GpuLauncher", lambda bundle: types.SimpleNamespace(close=lambda: None))
    monkeypatch.setattr(gpu_mod, "load_phases", lambda la: {})
    monkeypatch.setattr(bench_mod, "measure", lambda launchers, runs, warmup, lock=True, **kw: {
        k: np.array([1.0]) for k in launchers})
    backend = gpu_backend()
    in_flight = {"layout-key"}
    backend.background_compiles = True
    backend.compiling = lambda keys: sum(k in in_flight for k in keys)
    backend.cancel_precompile = lambda: 0
    m = GpuMeasurer.for_build(Engines(backend, RooflineCostModel(), loaded, "fp16"), BuildOptions(precision="fp16"),
                              loaded, streams=1, max_streams=1, budget_s=0)
    m.measure(loaded.model)  # the input, then the first rival: both measured whatever the budget
    m.measure(loaded.model)
    m.early.update(todo=[("boundary layout", None, ["layout-key"])], rounds=[])
    monkeypatch.setattr(m, "time_ready", lambda wait=False: None)  # the round's rival is not timed here
    m.measure(loaded.model)  # the budget is spent, the round's rival still compiles: measured
    assert m.log[-1]["past_budget_s"] >= 0
    in_flight.clear()
    with pytest.raises(MeasureBudgetSpent):
        m.measure(loaded.model)
    assert "past_budget_s" not in m.log[1] and len(m.log) == 3
    m.close()


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
    said = json.dumps({k: search.get(k) for k in ("decision", "candidates")})[:2000]  # what a failure reports
    fastest = min(c["measured_s"] for c in measured)
    (original,) = [c for c in measured if c["input"]]
    assert len(chosen) == 1, said
    # the fastest measured, or the input where no rewrite beat it by the search's margin (a rewrite a little faster
    # than the input is not kept: ``optimize_graph``'s ``measure_margin``)
    if chosen[0]["input"]:
        assert fastest > original["measured_s"] * (1 - MEASURE_MARGIN), said
    else:
        assert chosen[0]["measured_s"] == fastest, said
    assert bundle.report["verification"]["passed"], bundle.report["verification"]

    from parastream.launcher import load

    x = np.random.default_rng(5).standard_normal(bundle.plan.inputs[0].shape).astype(np.float32)
    ref = ort.InferenceSession(str(models / "inception_block.onnx"), providers=["CPUExecutionProvider"]).run(None, {bundle.plan.inputs[0].name: x})[0]
    with load(bundle.path, device="cuda") as run:
        got = run({bundle.plan.inputs[0].name: x})[bundle.plan.outputs[0].name]
    assert np.max(np.abs(got - ref)) / np.max(np.abs(ref)) < 2e-2
    json.dumps(bundle.report)  # the report stays JSON


#: small_net's head is a Linear of one row, which the "GEMM epilogue" round races (cuBLAS against one reduction,
#: tests/engines/test_torch_aoti.py); the tests below race the other rounds, so they build without it
NO_GEMM_ROUND = {"fuse_gemm_epilogue": False}


def test_alternatives_are_timed_and_the_fastest_kept(models, monkeypatch, tmp_path):
    """Each round keeps the faster; a later round starts from the earlier winners (small_net: Conv->Relu, 2 streams)."""

    from parastream.launcher.engines import BuildOptions

    times = {("bundle", True, None): 1.0, ("bundle", False, None): 0.8,  # unfused wins round 1
             ("bundle", False, False): 0.9,                             # contiguous loses round 2
             ("serial", None, None): 0.9,                               # its engines on one stream: close
             ("scratch", None, None): 0.7}                              # one engine wins round 3
    build_mod, made = fake_gpu(monkeypatch, times)
    model, graph, plan, cm = plan_of(models / "small_net.onnx", 2)
    assert plan.num_streams == 2 and has_conv_relu(model)
    got = time_alternatives(Engines(gpu_backend(), cm, None, "fp16"), "bundle",
                            Variant(model, graph, plan, BuildOptions(precision="fp16", **NO_GEMM_ROUND, conv_kernels="cudnn")), runs=5)
    assert (got["fuse_conv_relu"], got["internal_nhwc"], got["one_engine"]) == (False, True, True)
    assert [r["choice"] for r in got["rounds"]] == ["conv+ReLU", "boundary layout", "streams"]
    assert got["rounds"][0]["timed_ms"] == {"cuDNN fused conv+bias+ReLU": 1.0, "Inductor's conv and epilogue": 0.8}
    assert got["rounds"][2]["serial"]["timed_ms"] == {"2-stream plan": 0.8, "the same engines on one stream": 0.9}
    assert all(la.closed for la in made)


def _by_depthwise_kernels(made: list):
    """``Engines.launcher`` for ``fake_gpu``: an alternative compiled for itself, timed by the depthwise kernels it
    runs (``made`` gets each launcher)."""
    import types

    def compiled(self, v):
        la = types.SimpleNamespace(kind=(v.options.conv_kernels if v.options.conv_kernels in ("inductor", "native",
                                                                                              "triton")
                                         else "scratch", None, None), nhwc={"t"}, closed=False)
        la.close = lambda: setattr(la, "closed", True)
        made.append(la)
        return la

    return compiled


@pytest.mark.parametrize("inductor, native, triton, kept", [
    (1.015, 1.5, 1.5, "inductor"), (1.03, 1.5, 1.5, "cudnn"), (0.9, 1.5, 1.5, "inductor"),  # Inductor's kept within 2%
    (1.5, 1.015, 1.5, "native"), (1.5, 1.03, 1.5, "cudnn"),                                # torch's own against cuDNN's
    (0.9, 0.915, 1.5, "inductor"), (0.9, 0.89, 1.5, "native"),                            # ... against Inductor's
    (1.5, 1.5, 1.015, "triton"), (1.5, 1.5, 1.03, "cudnn"),                              # parastream's against cuDNN's
    (0.9, 1.5, 0.91, "inductor"), (0.9, 1.5, 0.7, "triton")])                            # ... against Inductor's
def test_depthwise_kernels_are_raced_and_the_faster_start_kept_within_2_percent(models, monkeypatch, inductor, native,
                                                                                triton, kept):
    """small_net has a depthwise convolution: with conv_kernels "auto" its first round races cuDNN's depthwise
    convolutions against Inductor's kernels, the second the winner against torch's own depthwise kernel, the third
    the winner against parastream's Triton kernel (each an alternative compiled for itself); against cuDNN's each
    keeps its alternative unless it is more than 2% slower (it starts faster: no cuDNN plan per shape); against
    Inductor's, which load as fast, only where it is faster.  A kernel choice given: no round."""
    from parastream.launcher.engines import BuildOptions

    class Times(dict):
        def __missing__(self, key):
            return 1.0

    build_mod, made = fake_gpu(monkeypatch, Times({("bundle", True, None): 1.0, ("inductor", None, None): inductor,
                                                   ("native", None, None): native, ("triton", None, None): triton}))

    monkeypatch.setattr(build_mod.Engines, "launcher", _by_depthwise_kernels(made))
    model, graph, plan, cm = plan_of(models / "small_net.onnx", 1)
    got = time_alternatives(Engines(gpu_backend(), cm, None, "fp16"), "bundle",
                            Variant(model, graph, plan, BuildOptions(precision="fp16", **NO_GEMM_ROUND)), runs=5)
    first, second = got["rounds"][:2]
    assert first["choice"] == "depthwise convolutions" and first["alternative_kept_within"] == 0.02
    assert first["timed_ms"] == {"depthwise convolutions as cuDNN calls": 1.0,
                                 "depthwise convolutions as Inductor kernels": inductor}
    winner = inductor if first["won"].endswith("Inductor kernels") else 1.0
    assert second["choice"] == "depthwise kernel"
    assert second.get("alternative_kept_within") == (None if first["won"].endswith("Inductor kernels") else 0.02)
    assert second["timed_ms"] == {"depthwise convolutions as the round before chose": winner,
                                  "depthwise convolutions as torch's own kernel": native}
    third = got["rounds"][2]
    assert third["choice"] == "Triton convolution kernel"
    before = native if second["won"].endswith("own kernel") else winner
    assert third["timed_ms"] == {"depthwise and narrow-group convolutions as the rounds before chose": before,
                                 "depthwise and narrow-group convolutions as parastream's Triton kernel": triton}
    assert got["conv_kernels"] == kept
    assert all(la.closed for la in made)
    for given in ("cudnn", "inductor", "native", "triton"):
        got = time_alternatives(Engines(gpu_backend(), cm, None, "fp16"), "bundle",
                                Variant(model, graph, plan, BuildOptions(precision="fp16", conv_kernels=given)), runs=5)
        assert not {"depthwise convolutions", "depthwise kernel", "Triton convolution kernel"} & {
            r["choice"] for r in got["rounds"]}
        assert got["conv_kernels"] == given


def test_a_model_of_narrow_groups_and_no_depthwise_convolution_races_the_triton_kernel_alone(monkeypatch, tmp_path):
    """A grouped 3x3 of 8 channels a group (RegNet's) and no depthwise convolution: the two depthwise rounds do not
    apply (their alternatives would compile the same engines), the Triton kernel's round does, and keeps it where
    it is faster; with the same convolution of one group (dense), no kernel round at all."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from parastream.launcher.engines import BuildOptions

    rng = np.random.default_rng(0)

    def model_file(name, width):
        w = lambda n, shape: numpy_helper.from_array((rng.standard_normal(shape) * 0.1).astype(np.float32), n)  # noqa: E731
        nodes = [helper.make_node("Conv", ["x", "w0"], ["a"], pads=[1, 1, 1, 1]),
                 helper.make_node("Relu", ["a"], ["b"]),
                 helper.make_node("Conv", ["b", "w1"], ["c"], pads=[1, 1, 1, 1], group=32 // width),
                 helper.make_node("Relu", ["c"], ["y"])]
        graph = helper.make_graph(nodes, name, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 16, 16])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 32, 16, 16])],
                                  [w("w0", (32, 8, 3, 3)), w("w1", (32, width, 3, 3))])
        m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        m.ir_version = 8
        onnx.save(m, tmp_path / f"{name}.onnx")
        return tmp_path / f"{name}.onnx"

    class Times(dict):
        def __missing__(self, key):
            return 1.0

    build_mod, made = fake_gpu(monkeypatch, Times({("triton", None, None): 0.8}))
    monkeypatch.setattr(build_mod.Engines, "launcher", _by_depthwise_kernels(made))
    model, graph, plan, cm = plan_of(model_file("narrow", 8), 1)
    got = time_alternatives(Engines(gpu_backend(), cm, None, "fp16"), "bundle",
                            Variant(model, graph, plan, BuildOptions(precision="fp16", **NO_GEMM_ROUND)), runs=5)
    kernel_rounds = [r for r in got["rounds"] if r["choice"] in dict(DEPTHWISE_ROUNDS)]
    assert [r["choice"] for r in kernel_rounds] == ["Triton convolution kernel"]
    assert got["conv_kernels"] == "triton"
    model, graph, plan, cm = plan_of(model_file("wide", 32), 1)  # one group: a dense convolution
    got = time_alternatives(Engines(gpu_backend(), cm, None, "fp16"), "bundle",
                            Variant(model, graph, plan, BuildOptions(precision="fp16", **NO_GEMM_ROUND)), runs=5)
    assert not [r for r in got["rounds"] if r["choice"] in dict(DEPTHWISE_ROUNDS)]


@pytest.mark.parametrize("saved", [0.004, 0.03, "broken"])
def test_the_gemm_round_over_a_one_row_head_is_decided_on_its_sample_after_the_search(models, monkeypatch, saved):
    """``time_alternatives`` of a plan whose GEMM-epilogue round changes only a Linear of one row (small_net's
    head): the round is decided on the head alone (``gemm_sample``: two one-node engines timed together) against
    the plan's own median, its whole-plan alternative never loaded; the alternative is kept only where it saves
    more than the round's 1% of the plan's time, and the later rounds then race the alternative's plan.  The
    queued rivals hear the decision.  A sample that cannot be timed leaves the round to the whole plan's race,
    which says why."""
    import types

    from parastream.launcher.engines import BuildOptions
    from parastream.pipeline import measure

    class Times(dict):
        def __missing__(self, key):
            return 1.05

    broken = saved == "broken"
    if broken:  # (the whole plan's alternative, "scratch", is then raced: 1.05 against the plan's 1.0)
        def fails(*a, **k):
            raise RuntimeError("no sample here")

        monkeypatch.setattr(measure, "gemm_sample_round", fails)
        saved = 0.0
    build_mod, made = fake_gpu(monkeypatch, Times({("bundle", True, None): 1.0, ("sample", True): 0.013,
                                                   ("sample", False): 0.013 - saved}))
    loaded = []

    def launcher(self, v):  # the sample's engines by their GEMM form, a whole plan compiled for itself as "scratch"
        one_node = [b.nodes for b in v.plan.branches] == [[v.model.graph.node[0].name]]
        la = types.SimpleNamespace(kind=("sample", v.options.fuse_gemm_epilogue) if one_node else ("scratch", None, None),
                                   options=v.options, one_node=one_node, closed=False)
        la.close = lambda: setattr(la, "closed", True)
        made.append(la), loaded.append(la)
        return la

    monkeypatch.setattr(build_mod.Engines, "launcher", launcher)
    told = []
    rivals = types.SimpleNamespace(decided=lambda what, won, v, decided: told.append((what, won)),
                                   close=lambda: told.append("closed"))
    model, graph, plan, cm = plan_of(models / "small_net.onnx", 1)
    got = time_alternatives(Engines(gpu_backend(), cm, None, "fp16"), "bundle",
                            Variant(model, graph, plan, BuildOptions(precision="fp16", conv_kernels="cudnn")), runs=5,
                            rivals=rivals)
    r = got["rounds"][0]
    labels = measure.round_labels("GEMM epilogue", plan)
    if broken:
        assert r["choice"] == "GEMM epilogue" and "sample" not in r and "no sample here" in r["sample_error"]
        assert r["timed_ms"] == {labels[0]: 1.0, labels[1]: 1.05} and got["fuse_gemm_epilogue"] is True
        assert all(la.closed for la in made)
        return
    assert r["choice"] == "GEMM epilogue" and r["sample"]["timed_ms"] == {labels[0]: 0.013, labels[1]: round(0.013 - saved, 4)}
    assert r["timed_ms"] == {labels[0]: 1.0, labels[1]: pytest.approx(1.0 - saved)}
    flipped = saved > measure.PREFER_CURRENT_WITHIN["GEMM epilogue"] * 1.0
    assert r["won"] == labels[1 if flipped else 0] and got["fuse_gemm_epilogue"] is (not flipped)
    assert told[0] == ("GEMM epilogue", flipped) and told[-1] == "closed"
    whole_off = [la for la in loaded if not la.one_node and not la.options.fuse_gemm_epilogue]
    assert bool(whole_off) == flipped  # the alternative's whole plan loaded only for the later rounds after a flip
    assert [x["choice"] for x in got["rounds"][1:]] == ["conv+ReLU"]
    assert all(la.closed for la in made)


def test_each_round_s_decision_is_told_to_the_queued_rivals_with_the_form_the_later_rounds_race(models, monkeypatch):
    """``time_alternatives(..., rivals=...)``: after each round, the rivals queued in the background hear whether its
    alternative won and which form the rounds after it race (the winner's depthwise kernels for the conv+ReLU
    round's rival), and are closed at the end."""
    import types

    from parastream.launcher.engines import BuildOptions

    class Times(dict):
        def __missing__(self, key):
            return 1.0

    build_mod, made = fake_gpu(monkeypatch, Times({("bundle", True, None): 1.0, ("inductor", None, None): 0.9,
                                                   ("native", None, None): 1.5}))

    monkeypatch.setattr(build_mod.Engines, "launcher", _by_depthwise_kernels(made))
    told = []
    rivals = types.SimpleNamespace(
        decided=lambda what, won, v, decided: told.append((what, won, v.options.conv_kernels, v.options.fuse_conv_relu,
                                                           sorted(decided))),
        close=lambda: told.append("closed"))
    model, graph, plan, cm = plan_of(models / "small_net.onnx", 1)
    got = time_alternatives(Engines(gpu_backend(), cm, None, "fp16"), "bundle",
                            Variant(model, graph, plan, BuildOptions(precision="fp16", **NO_GEMM_ROUND)), runs=5,
                            rivals=rivals)
    assert got["conv_kernels"] == "inductor"
    assert told[:2] == [("depthwise convolutions", True, "inductor", True, ["depthwise convolutions"]),
                        ("depthwise kernel", False, "inductor", True, ["depthwise convolutions", "depthwise kernel"])]
    assert [t[0] for t in told[2:-1]] == [r["choice"] for r in got["rounds"][2:]] and told[-1] == "closed"
    # a round taken as the search timed it is never raced here: no decision queues a rival for it
    told.clear()
    carried = {"choice": "boundary layout", "won": "channels-last boundaries", "load_s": 0.0, "timed_s": 0.0,
               "timed_ms": {"channels-last boundaries": 1.0, "contiguous boundaries": 1.2}}
    plan2 = plan_of(models / "small_net.onnx", 2)[2]
    time_alternatives(Engines(gpu_backend(), cm, None, "fp16"), "bundle",
                      Variant(model, graph, plan2, BuildOptions(precision="fp16", **NO_GEMM_ROUND)), runs=5,
                      timed=[carried], rivals=rivals)
    assert told[0][0] == "depthwise convolutions" and "boundary layout" in told[0][4]


def test_rounds_the_search_timed_are_not_timed_again(models, monkeypatch, tmp_path):
    """The search timed the first round against the input's plan (the alternative won, so it stopped there): that
    round is taken as it is, the bundle as built (fused) is never loaded, and the later rounds race the winner."""
    from parastream.launcher.engines import BuildOptions

    times = {("bundle", False, None): 0.8, ("bundle", False, False): 0.9, ("serial", None, None): 0.9,
             ("scratch", None, None): 0.7}
    build_mod, made = fake_gpu(monkeypatch, times)
    model, graph, plan, cm = plan_of(models / "small_net.onnx", 2)
    searched = {"choice": "conv+ReLU", "won": "Inductor's conv and epilogue", "load_s": 0.1, "timed_s": 0.1,
                "timed_ms": {"cuDNN fused conv+bias+ReLU": 1.0, "Inductor's conv and epilogue": 0.8}}
    got = time_alternatives(Engines(gpu_backend(), cm, None, "fp16"), "bundle",
                            Variant(model, graph, plan, BuildOptions(precision="fp16", **NO_GEMM_ROUND, conv_kernels="cudnn")), runs=5,
                            timed=[searched])
    assert (got["fuse_conv_relu"], got["internal_nhwc"], got["one_engine"]) == (False, True, True)
    assert [r["choice"] for r in got["rounds"]] == ["conv+ReLU", "boundary layout", "streams"]
    assert got["rounds"][0] == dict(searched, timed="during the search") and "timed" not in got["rounds"][1]
    assert [la.kind for la in made] == [("bundle", False, None), ("bundle", False, False), ("serial", None, None),
                                        ("scratch", None, None)]
    assert all(la.closed for la in made)


@pytest.mark.parametrize("serial", [1.5, 1.2])  # (either side of ``STREAMS_DECIDED_BEYOND``, 25%)
def test_a_plan_far_ahead_of_its_own_engines_on_one_stream_compiles_no_one_stream_rival(models, monkeypatch, serial):
    """The "streams" round first times the plan against its own engines on one stream (the same engines shared:
    nothing compiled).  A lead over ``STREAMS_DECIDED_BEYOND`` decides the round for the plan, and the graph on
    one stream is neither compiled nor loaded; closer, that rival is compiled and raced as before, and the round
    keeps the first timing beside its own."""
    from parastream.launcher.engines import BuildOptions
    from parastream.pipeline import measure

    times = {("bundle", True, None): 1.0, ("bundle", False, None): 1.2, ("bundle", True, False): 1.2,
             ("serial", None, None): serial, ("scratch", None, None): 1.1}
    build_mod, made = fake_gpu(monkeypatch, times)
    model, graph, plan, cm = plan_of(models / "small_net.onnx", 2)
    got = time_alternatives(Engines(gpu_backend(), cm, None, "fp16"), "bundle",
                            Variant(model, graph, plan, BuildOptions(precision="fp16", **NO_GEMM_ROUND, conv_kernels="cudnn")), runs=5)
    (r,) = [r for r in got["rounds"] if r["choice"] == "streams"]
    assert not got["one_engine"] and r["won"] == "2-stream plan"
    kinds = [la.kind for la in made]
    assert ("serial", None, None) in kinds
    assert 1.2 < 1 + measure.STREAMS_DECIDED_BEYOND < 1.5  # the two cases take the two ways
    if serial > 1 + measure.STREAMS_DECIDED_BEYOND:
        assert ("scratch", None, None) not in kinds and r["rival"] == measure.SERIAL_LABEL
        assert r["timed_ms"] == {"2-stream plan": 1.0, "one stream": serial} and "nothing compiled" in r["timed"]
        assert measure.carried_rounds([r])  # decided widely: a candidate that replaces the input takes it
    else:
        assert ("scratch", None, None) in kinds and r["timed_ms"] == {"2-stream plan": 1.0, "one stream": 1.1}
        assert r["serial"]["timed_ms"]["the same engines on one stream"] == serial
    assert all(la.closed for la in made)


def test_alternatives_not_timed_without_a_rival(models, monkeypatch, tmp_path):
    """No GPU: nothing timed.  No Conv->Relu, one stream, no 4-d boundary: no round at all."""
    import types

    from parastream.launcher.engines import BuildOptions

    build_mod, made = fake_gpu(monkeypatch, {})
    model, graph, plan, cm = plan_of(models / "transformer_layer.onnx", 1)
    assert not has_conv_relu(model) and plan.num_streams == 1
    made_nhwc = []
    monkeypatch.setattr("parastream.launcher.gpu.GpuLauncher",
                        lambda bundle, **kw: made_nhwc.append(kw) or types.SimpleNamespace(nhwc=set(), close=lambda: None))
    v = Variant(model, graph, plan, BuildOptions())
    assert time_alternatives(Engines(gpu_backend(), cm, None, "fp32"), "bundle", v, runs=5) is None
    assert made_nhwc == []  # nothing to race: not even the bundle as built was loaded
    cpu = gpu_backend(gpu=False, name="onnxruntime")
    assert time_alternatives(Engines(cpu, cm, None, "fp32"), "bundle", v, runs=5) is None


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_build_times_its_alternatives(models, tmp_path):
    """On the GPU the fusion, layout and stream choices are timed, recorded, and the bundle ships the winners."""
    import onnx

    model, _, _, _ = plan_of(models / "small_net.onnx", 2)  # BatchNorms folded: Conv -> Relu pairs to fuse
    onnx.save(model, tmp_path / "folded.onnx")
    cfg = BuildConfig(backend="torch", precision="fp16", search=False, measure_runs=30, streams=2)
    bundle = build(tmp_path / "folded.onnx", tmp_path / "out", config=cfg)
    m = bundle.report["measured_choices"]
    # small_net's classifier head is a Linear of one row: the GEMM-epilogue round times it first
    assert [r["choice"] for r in m["rounds"]][:4] == ["GEMM epilogue", "depthwise convolutions", "depthwise kernel",
                                                      "conv+ReLU"]
    for r in m["rounds"]:
        if "decided_on_shapes" in r:  # the conv+ReLU round taken on its shapes timed alone: no rival compiled
            from parastream.pipeline.measure import CONV_SHAPES_DECIDE_BEYOND, round_labels

            assert r["choice"] == "conv+ReLU" and r["won"] == round_labels("conv+ReLU", None)[0]
            assert r["decided_on_shapes"]["saves"] >= CONV_SHAPES_DECIDE_BEYOND and not bundle.report["conv_shapes"]["unfused"]
            continue
        current, other = r["timed_ms"].values()
        within = r.get("alternative_kept_within", 0.0)  # the depthwise rounds keep their alternative within 2%
        keep = r.get("current_kept_within", 0.0)  # the fusion and layout rounds keep the plan's form within 1%
        kept_other = (other < current or (within and other <= current * (1 + within))) and not (
            keep and current <= other * (1 + keep))
        assert r["won"] == list(r["timed_ms"])[1 if kept_other else 0]
    opts = bundle.manifest["options"]
    assert opts["fuse_conv_relu"] == m["fuse_conv_relu"] and opts["internal_nhwc"] == m["internal_nhwc"]
    assert opts["conv_kernels"] == m["conv_kernels"]
    assert (bundle.plan.num_streams == 1) == m["one_engine"]
    v = bundle.report["verification"]
    assert v["passed"] and v["engines_compiled_at_load"] == 0, v.get("compiled_at_load_because")  # what ships is what was compiled for the choices


@pytest.mark.gpu
@pytest.mark.slow
def test_a_one_engine_gpu_build_decides_its_gemm_round_first_on_its_head(models, tmp_path):
    """small_net on one stream is one engine whose head is a Linear of one row: its GEMM-epilogue round is decided
    on the head alone before any other round's rival is compiled (``GpuMeasurer._gemm_sample_first``), the later
    rounds race the form it kept, and the bundle ships it, verified."""
    import onnx

    model, _, _, _ = plan_of(models / "small_net.onnx", 1)
    onnx.save(model, tmp_path / "folded.onnx")
    cfg = BuildConfig(backend="torch", precision="fp16", measure_runs=30, streams=1)
    bundle = build(tmp_path / "folded.onnx", tmp_path / "out", config=cfg)
    assert len(bundle.plan.branches) == 1
    m = bundle.report["measured_choices"]
    r = m["rounds"][0]
    assert r["choice"] == "GEMM epilogue" and r["decided_first"] and r["sample"]["nodes"]
    current, other = r["timed_ms"].values()
    assert {k: round(t, 4) for k, t in r["timed_ms"].items()} == r["sample"]["timed_ms"]  # the sample's times
    assert r["won"] == list(r["timed_ms"])[1 if current > other * (1 + r["current_kept_within"]) else 0]
    assert m["fuse_gemm_epilogue"] is (r["won"] == list(r["timed_ms"])[0])
    assert bundle.manifest["options"]["fuse_gemm_epilogue"] == m["fuse_gemm_epilogue"]
    assert [x["choice"] for x in m["rounds"]].count("GEMM epilogue") == 1
    v = bundle.report["verification"]
    assert v["passed"] and v["engines_compiled_at_load"] == 0, v.get("compiled_at_load_because")


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_build_decides_its_depthwise_rounds_on_a_sample(models, tmp_path, monkeypatch):
    """A plan with enough engines holding a depthwise convolution (nasnet_cell's, the threshold lowered) has both
    depthwise rounds timed during the search on a sample of those engines side by side, loaded on the GPU as the
    plan has them, with Inductor's kernels and with torch's own, and timed together; each round is decided by
    the sample only where its kernels lost there by more than ``SAMPLE_DECIDES_BEYOND``, else raced on the whole
    plan, and the bundle ships and verifies the kernels decided."""
    from parastream.pipeline import measure

    monkeypatch.setattr(measure, "SAMPLE_DEPTHWISE_ENGINES", 2)
    # no candidate may replace the input (a margin none reaches): the build then ships the input's rounds as timed
    cfg = BuildConfig(backend="torch", precision="fp16", measure_runs=30, streams=2, measure_seconds=5,
                      search_options={"measure_margin": 0.99})
    bundle = build(models / "nasnet_cell.onnx", tmp_path / "out", config=cfg)
    assert bundle.report["search"]["decided_by"] == "measured"  # the input measured: its rounds timed in the search
    m = bundle.report["measured_choices"]
    rounds = {r["choice"]: r for r in m["rounds"]}
    sample = rounds["depthwise convolutions"]["sample"]
    assert list(sample["timed_ms"]) == ["depthwise convolutions as cuDNN calls", "depthwise convolutions as Inductor kernels",
                                        "depthwise convolutions as torch's own kernel"]
    assert all(t > 0 for t in sample["timed_ms"].values()) and sample["engines"] and sample["covered"] == sample["convolutions"]
    for what in ("depthwise convolutions", "depthwise kernel"):
        r = rounds[what]
        current, other = r["timed_ms"].values()
        if "one after another" in r.get("timed", ""):  # decided on the sample
            assert r["sample"] is not None and other > current * (1 + measure.SAMPLE_DECIDES_BEYOND)
            assert r["won"] == list(r["timed_ms"])[0]
    assert bundle.manifest["options"]["conv_kernels"] == m["conv_kernels"]
    v = bundle.report["verification"]
    assert v["passed"] and v["engines_compiled_at_load"] == 0, v.get("compiled_at_load_because")


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_build_times_its_boundary_layout_round_on_a_window(models, tmp_path, monkeypatch):
    """A plan of many engines (nasnet_cell's, the threshold lowered) has its "boundary layout" round timed during
    the search on a window of its engines, consecutive in its launch order on its streams, loaded on the GPU with
    channels-last internal boundaries and with contiguous ones and timed together; the round is decided by the
    window only where contiguous boundaries lost there by more than ``LAYOUT_SAMPLE_DECIDES_BEYOND``, else raced
    on the whole plan, and the bundle ships and verifies the layout decided."""
    from parastream.pipeline import measure

    monkeypatch.setattr(measure, "SAMPLE_LAYOUT_ENGINES", 2)
    monkeypatch.setattr(measure, "LAYOUT_WINDOW", 20)
    # the fusion rounds before it keep the plan's form (a round won by its alternative leaves the rest, the layout
    # round too, to be timed after the search on the whole plan), and the depthwise convolutions are cuDNN's
    monkeypatch.setitem(measure.PREFER_CURRENT_WITHIN, "GEMM epilogue", 0.99)
    monkeypatch.setitem(measure.PREFER_CURRENT_WITHIN, "conv+ReLU", 0.99)
    cfg = BuildConfig(backend="torch", precision="fp16", measure_runs=30, streams=2, measure_seconds=5,
                      conv_kernels="cudnn",
                      search_options={"measure_margin": 0.99})  # the input ships: its rounds as timed in the search
    bundle = build(models / "nasnet_cell.onnx", tmp_path / "out", config=cfg)
    m = bundle.report["measured_choices"]
    said = {"decided_by": bundle.report["search"]["decided_by"], "rounds": m and m["rounds"],
            "stopped_in_search": m and m.get("stopped_in_search"),
            "prepare_errors": [p["error"] for p in bundle.report["search"].get("prepared") or [] if "error" in p],
            "manifest": bundle.manifest["options"], "verification": bundle.report["verification"]}
    assert bundle.report["search"]["decided_by"] == "measured", said
    r = next(x for x in m["rounds"] if x["choice"] == "boundary layout")
    assert "sample" in r, said
    sample = r["sample"]
    assert list(sample["timed_ms"]) == ["channels-last boundaries", "contiguous boundaries"]
    assert all(t > 0 for t in sample["timed_ms"].values()) and len(sample["engines"]) == 20 and sample["boundaries"] > 0, said
    current, other = r["timed_ms"].values()
    if r.get("decided_on_sample"):
        assert other > current * (1 + measure.LAYOUT_SAMPLE_DECIDES_BEYOND) and r["won"] == "channels-last boundaries", said
    else:
        here, there = sample["timed_ms"].values()
        assert there <= here * (1 + measure.LAYOUT_SAMPLE_DECIDES_BEYOND) + 1e-4, said  # left open: raced on the plan
    assert bundle.manifest["options"]["internal_nhwc"] == m["internal_nhwc"] == (r["won"] == "channels-last boundaries"), said
    v = bundle.report["verification"]
    assert v["passed"] and v["engines_compiled_at_load"] == 0, v.get("compiled_at_load_because")


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_build_at_opt_level_4_races_the_tuned_kernels_last(models, tmp_path):
    """A torch build at --opt-level 4 compiles its search and rounds at level 3 and races its engines tuned by
    Inductor's coordinate descent last (the "kernel tuning" round), on the plan the rounds chose; the level that
    won ships (manifest.json), its engines compiled at that level and verified as loaded."""
    cfg = BuildConfig(backend="torch", precision="fp16", measure_runs=30, optimization_level=4, search=False)
    bundle = build(models / "small_net.onnx", tmp_path / "out", config=cfg)
    m = bundle.report["measured_choices"]
    r = m["rounds"][-1]
    assert r["choice"] == "kernel tuning" and r["level"] == 4 and "error" not in r, m["rounds"]
    assert list(r["timed_ms"]) == ["kernels as compiled at the rounds' level", "kernels tuned on the device"]
    shipped = 4 if r["won"] == "kernels tuned on the device" else 3
    assert m["optimization_level"] == bundle.manifest["options"]["optimization_level"] == shipped
    import zipfile

    metas = [json.loads(zipfile.ZipFile(bundle.path / b.engine).read("engine.json")) for b in bundle.plan.branches]
    # (an engine left uncompiled, run as converted, has no level: only compiled code is tuned)
    assert metas and {m["optimization_level"] for m in metas if m["compiled"]} == {shipped}
    v = bundle.report["verification"]
    assert v["passed"] and v["engines_compiled_at_load"] == 0, v.get("compiled_at_load_because")


def test_a_timed_choice_is_the_one_row_chosen():
    """The stream table keeps one chosen row: the schedule timing picked (added, marked measured) or the planned one."""
    import types

    from parastream.pipeline.build import _record_measured_streams

    tried = [{"streams": 1, "engines": 1, "chosen": False}, {"streams": 2, "engines": 8, "chosen": True}]
    _record_measured_streams(tried, types.SimpleNamespace(num_streams=2, branches=[0] * 8))
    assert [t["chosen"] for t in tried] == [False, True] and len(tried) == 2  # must not fire: the plan was kept
    _record_measured_streams(tried, types.SimpleNamespace(num_streams=1, branches=[0]))
    assert [t for t in tried if t["chosen"]] == [{"streams": 1, "engines": 1, "chosen": True, "measured": True}]


@pytest.mark.parametrize("shape,raced", [([1, 1, 128, 128], False), ([1, 64, 1, 1], False), ([1, 8, 4, 4], True)])
def test_the_boundary_layout_round_races_only_boundaries_whose_bytes_differ_between_layouts(shape, raced):
    """A 4-d internal boundary of one channel (BERT-base's attention mask) or of 1x1 pixels holds the same bytes
    channels-last as contiguous: the round would race the same engines, so it is not raced."""
    import types

    from parastream.launcher.plan import TensorSpec
    from parastream.pipeline.measure import _internal_nhwc

    backend = types.SimpleNamespace(supports_internal_nhwc=True, supports_channel_views=False)
    plan = types.SimpleNamespace(precision="fp16", inputs=[TensorSpec("x", "float32", [1, 8, 4, 4])],
                                 outputs=[TensorSpec("y", "float32", [1, 8])],
                                 tensors={"x": TensorSpec("x", "float32", [1, 8, 4, 4]), "t": TensorSpec("t", "float32", shape),
                                          "y": TensorSpec("y", "float32", [1, 8])})
    assert _internal_nhwc(backend, plan) is raced


def test_a_streams_round_whose_first_timing_fails_races_the_compiled_rival(models, monkeypatch):
    """The plan's own engines on one stream could not be timed (a backend whose engines cannot be shared): the
    round races the graph on one stream, compiled, as before, and says why the first timing is missing."""
    from parastream.launcher.engines import BuildOptions
    from parastream.pipeline import measure

    times = {("bundle", True, None): 1.0, ("bundle", False, None): 1.2, ("bundle", True, False): 1.2,
             ("scratch", None, None): 1.1}
    build_mod, made = fake_gpu(monkeypatch, times)

    def cannot_share(la):
        raise RuntimeError("engines not shareable")

    monkeypatch.setattr(measure, "same_engines_on_one_stream", cannot_share)
    model, graph, plan, cm = plan_of(models / "small_net.onnx", 2)
    got = time_alternatives(Engines(gpu_backend(), cm, None, "fp16"), "bundle",
                            Variant(model, graph, plan, BuildOptions(precision="fp16", conv_kernels="cudnn")), runs=5)
    (r,) = [r for r in got["rounds"] if r["choice"] == "streams"]
    assert r["timed_ms"] == {"2-stream plan": 1.0, "one stream": 1.1} and not got["one_engine"]
    assert "engines not shareable" in r["serial"]["error"] and ("scratch", None, None) in [la.kind for la in made]
    assert all(la.closed for la in made)


@pytest.mark.parametrize("current_kernels, alternative_ms, kept", [
    ("auto", 1.015, True), ("cudnn", 1.015, True), ("cudnn", 1.03, False),  # torch's kernel against cuDNN's plans
    ("inductor", 1.015, False), ("inductor", 0.99, True)])  # against Inductor's compiled kernels: the faster
def test_torch_s_depthwise_kernel_is_preferred_within_2_percent_over_cudnn_s_plans_only(monkeypatch, current_kernels,
                                                                                       alternative_ms, kept):
    """The "depthwise kernel" round keeps torch's own kernel within 2% where the form it races runs cuDNN's depthwise
    calls (whose plans a fresh process builds or deserializes); where it runs Inductor's compiled kernels, which
    load as fast, the faster median wins."""
    import types

    from parastream.pipeline import bench, measure

    monkeypatch.setattr(bench, "measure", lambda launchers, **kw: dict(zip(launchers, (np.full(9, 1.0),
                                                                                       np.full(9, alternative_ms)))))
    rounds: list = []
    plan = types.SimpleNamespace(num_streams=1)
    won = measure.race(rounds, "depthwise kernel", object(), object(), plan, runs=9, since=0.0, lock=False,
                       current_kernels=current_kernels)
    assert won is kept and rounds[0].get("alternative_kept_within") == (0.02 if current_kernels != "inductor" else None)


@pytest.mark.parametrize("what, alternative_ms, kept", [
    ("conv+ReLU", 0.991, False), ("conv+ReLU", 0.98, True), ("conv+ReLU", 1.2, False),
    ("boundary layout", 0.995, False), ("boundary layout", 0.97, True),
    ("attention", 0.995, False), ("attention", 0.98, True), ("GEMM epilogue", 0.995, False),
    ("GEMM epilogue", 0.985, True), ("streams", 0.995, True),  # (no preference: the faster median)
    ("engine blocks", 0.985, False), ("engine blocks", 0.97, True)])
def test_a_round_keeps_the_plans_form_on_a_tie_where_its_alternative_would_cost_the_build(monkeypatch, what,
                                                                                          alternative_ms, kept):
    """The attention, GEMM-epilogue, conv+ReLU and boundary-layout rounds take their alternative only when it is
    faster by more than 1% (two loaded plans' medians differ by that much at rest; a flip on a tie times the later
    rounds again on it), the engine-blocks round by more than 2%; a round without a preference keeps the faster
    median."""
    import types

    from parastream.pipeline import bench, measure

    def timed(launchers, **kw):
        (current, cur), (alt, _) = launchers.items()
        return {current: np.full(9, 1.0), alt: np.full(9, alternative_ms)}

    monkeypatch.setattr(bench, "measure", timed)
    rounds: list = []
    won = measure.race(rounds, what, object(), object(), types.SimpleNamespace(num_streams=1), runs=9, since=0.0,
                       lock=False)
    assert won is kept
    assert rounds[0]["won"] == measure.round_labels(what, types.SimpleNamespace(num_streams=1))[1 if kept else 0]


@pytest.mark.parametrize("alternative_ms, current_ms, kept, timings", [
    # the alternative's launcher in its faster state for its first timing only (BERT-base's attention round, H200:
    # the decomposed form 0.4468 against the SDPA kernels' 0.4707 ms, its bundle 0.493): its timings disagree, a
    # third is taken, and the median of three decides
    ([0.4468, 0.493, 0.493], [0.4707, 0.4707, 0.4707], False, 3),
    # faster in every timing: the alternative kept after its timings agree
    ([0.44, 0.445, 0.44], [0.47, 0.47, 0.47], True, 2),
    # the second timing the odd one: the median of three keeps the alternative
    ([0.4468, 0.493, 0.449], [0.4707, 0.4707, 0.4707], True, 3),
    # a lead beyond 15%: one timing decides
    ([0.30, 0.47, 0.47], [0.47, 0.47, 0.47], True, 1),
])
def test_a_close_round_is_timed_again_before_it_decides(monkeypatch, alternative_ms, current_ms, kept, timings):
    """A round whose forms ran within 15% of each other is timed again (``measure.confirmed_round``), as the
    search's fastest candidate is: a launcher runs a whole timing now and then 7-12% faster than its usual, and
    one such timing handed BERT-base's attention round to the decomposed form, whose bundle ran 5% slower."""
    import types

    from parastream.pipeline import bench, measure

    calls = iter(range(10))

    def timed(launchers, **kw):
        i = next(calls)
        (current, _), (alt, _) = launchers.items()
        return {current: np.full(9, current_ms[i]), alt: np.full(9, alternative_ms[i])}

    monkeypatch.setattr(bench, "measure", timed)
    rounds: list = []
    plan = types.SimpleNamespace(num_streams=1)
    won = measure.race(rounds, "attention", object(), object(), plan, runs=9, since=0.0, lock=False)
    assert won is kept
    assert next(calls) == timings  # the timings taken: the first and its confirmations
    assert len(rounds[0].get("confirmed_ms", [])) == timings - 1
    labels = measure.round_labels("attention", plan)
    assert rounds[0]["timed_ms"][labels[1]] == pytest.approx(sorted(alternative_ms[:timings])[timings // 2])
