"""The CPU path: a CPU device profile, the CPU build times its alternatives (one full-threaded onnxruntime session
of the original or rewritten model, the multi-stream plan at two thread counts) and keeps the fastest, and
`parastream bench` compares a CPU bundle with plain onnxruntime on the same model."""

from __future__ import annotations

import json
import os

import numpy as np
import onnx
import pytest
from graphs import ort_reference, three_branch_model

from parastream.launcher import load
from parastream.launcher.bundle import Bundle
from parastream.pipeline import build
from parastream.pipeline.cli import main


from parastream.pipeline.bench import OthersLoad as REAL_OTHERS_LOAD  # noqa: E402


@pytest.fixture(autouse=True)
def quiet_machine(monkeypatch):
    """The tests see a machine no other process loads (a shared machine's load must not decide them);
    the tests of a loaded machine say so with _quiet."""
    _quiet(monkeypatch)


@pytest.fixture
def model_path(tmp_path):
    p = tmp_path / "m.onnx"
    onnx.save(three_branch_model(channels=8, size=16), p)
    return p


def _check_outputs(bundle_path, model_path):
    x = np.random.default_rng(1).random((1, 8, 16, 16), dtype=np.float32)
    got = load(bundle_path)({"input": x})["output"]
    np.testing.assert_allclose(got, ort_reference(onnx.load(model_path), {"input": x})["output"], rtol=1e-5, atol=1e-6)


def test_cpu_build_times_the_alternatives_and_keeps_the_default_unless_beaten(model_path, tmp_path, monkeypatch):
    import parastream.pipeline.bench as bench

    looks = []

    class QuietLook(REAL_OTHERS_LOAD):  # the look before building reports a quiet machine (the timing measures for real)
        def __exit__(self, *exc):
            super().__exit__(*exc)
            if not looks:
                self.share = 0.0
            looks.append(self.share)
            return False

    monkeypatch.setattr(bench, "OthersLoad", QuietLook)
    bundle = build(model_path, tmp_path / "b", backend="onnxruntime", streams=None, cpu_runs=5)
    choice = bundle.report["cpu_choice"]
    names = [t["alternative"] for t in choice["timed"]]
    # plain onnxruntime (the original, one session) is the default, the cost model's plan is timed against it
    assert names[0] == choice["default"] == "original model, one session" and any(n.startswith("plan: ") for n in names)
    assert choice["others_cpu_share"] is None or 0.0 <= choice["others_cpu_share"] <= 1.0
    rows = {t["alternative"]: t for t in choice["timed"]}
    chosen = [t for t in choice["timed"] if t["chosen"]]
    assert len(chosen) == 1 and chosen[0]["alternative"] == choice["chosen"]
    for t in choice["timed"]:
        assert t["p25_ms"] <= t["median_ms"] <= t["p75_ms"] and 1 <= t["calls"] <= 5
    if choice["chosen"] != choice["default"]:  # it won by the margin against the one it replaced
        c = chosen[0]
        assert c["median_ms"] < rows[c["against"]]["median_ms"] * (1 - c["margin_needed"]) and c["margin_needed"] >= 0.05
    # the bundle is the alternative kept
    assert bundle.plan.num_streams == chosen[0]["streams"] and len(bundle.plan.branches) == chosen[0]["sessions"]
    assert bundle.plan.cpu_threads is not None
    assert (bundle.plan.cpu_threads or os.cpu_count()) == chosen[0]["threads"]
    assert bundle.report["schedule"]["cost_model"].startswith("roofline CPU")
    _check_outputs(bundle.path, model_path)


def _quiet(monkeypatch, share: float = 0.0, *then: float):
    """The machine as if other processes used ``share`` of its cores (the build's look before it builds the
    alternatives, then ``then`` for each timing after it)."""
    import parastream.pipeline.bench as bench

    shares = iter((share, *then))

    class Others:
        def __init__(self):
            self.share = next(shares, then[-1] if then else share)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(bench, "OthersLoad", Others)


def _injected(medians: dict, spread: float = 0.01, runs: int = 10):
    """race_calls's result with these medians (ms) for the alternatives whose names start with a key; calls spread
    evenly over median * (1 ± spread)."""
    def fake(runners, feeds, *, runs=runs, **kw):
        out = {}
        for name, run in runners.items():
            run(feeds)  # each alternative runs
            ms = next(v for k, v in medians.items() if name.startswith(k))
            out[name] = np.linspace(1 - spread, 1 + spread, runs) * ms / 1e3
        return out
    return fake


@pytest.mark.parametrize("winner", ["original model, one session", "plan"])
def test_the_timed_winner_decides_the_bundle(model_path, tmp_path, monkeypatch, winner):
    """Timings injected: an alternative 5x faster than the others replaces the default, and the bundle follows."""
    import parastream.pipeline.bench as bench

    every_core = f" {os.cpu_count()} threads each"

    def fake(runners, feeds, *, runs, **kw):
        out = {}
        for name, run in runners.items():
            run(feeds)
            fast = name == winner or (winner == "plan" and name.startswith("plan: ") and name.endswith(every_core))
            out[name] = np.full(runs, 0.001 if fast else 0.005)
        return out

    monkeypatch.setattr(bench, "race_calls", fake)
    _quiet(monkeypatch)
    bundle = build(model_path, tmp_path / "b", backend="onnxruntime", cpu_runs=3, search=False)
    choice = bundle.report["cpu_choice"]
    if winner == "plan":
        assert choice["chosen"].startswith("plan: ") and bundle.plan.num_streams > 1
        assert bundle.plan.cpu_threads == 0  # every core per session won
    else:
        assert choice["chosen"] == winner
        assert bundle.plan.num_streams == 1 and len(bundle.plan.branches) == 1 and bundle.plan.cpu_threads == 0
    _check_outputs(bundle.path, model_path)


def test_a_loaded_machines_noise_does_not_flip_the_choice(model_path, tmp_path, monkeypatch):
    """A loaded run: the alternatives' medians 4% apart with calls spread +-15% (the noise on a busy machine).
    The default is kept, whichever alternative the noise favours; the report says what was timed and why."""
    import parastream.pipeline.bench as bench

    _quiet(monkeypatch)
    for faster in ("original", "plan"):
        medians = {"plan": 10.0, "original": 10.0}
        medians[faster] = 9.6
        monkeypatch.setattr(bench, "race_calls", _injected(medians, spread=0.15))
        bundle = build(model_path, tmp_path / faster, backend="onnxruntime", cpu_runs=10, search=False)
        choice = bundle.report["cpu_choice"]
        assert choice["chosen"] == choice["default"] == "original model, one session"
        assert "no alternative was timed faster beyond the noise" in choice["decision"]
        plan = next(t for t in choice["timed"] if t["alternative"].startswith("plan"))
        assert plan["margin_needed"] >= plan["spread"] > 0.1 and not plan["chosen"]
    # the same medians, quiet calls (spread 1%): 4% is still within the 5% floor, the default stays
    monkeypatch.setattr(bench, "race_calls", _injected({"plan": 9.6, "original": 10.0}, spread=0.01))
    assert build(model_path, tmp_path / "quiet", backend="onnxruntime", cpu_runs=10, search=False).report["cpu_choice"]["chosen"] == "original model, one session"
    # a clear win (20% with 1% spread) replaces it
    monkeypatch.setattr(bench, "race_calls", _injected({"plan": 8.0, "original": 10.0}, spread=0.01))
    assert build(model_path, tmp_path / "clear", backend="onnxruntime", cpu_runs=10, search=False).report["cpu_choice"]["chosen"].startswith("plan: ")


def test_a_busy_machine_keeps_the_default(model_path, tmp_path, monkeypatch):
    """Under load the alternatives compare otherwise (spinning threads suffer most), so a loaded machine's timings
    never replace plain onnxruntime: busy when the build looks, nothing else is built or timed; busy while timing,
    a clear win (2x) is recorded but not kept."""
    import parastream.pipeline.bench as bench

    calls = []
    fake = _injected({"plan": 5.0, "original": 10.0}, spread=0.01)
    monkeypatch.setattr(bench, "race_calls", lambda *a, **kw: calls.append(1) or fake(*a, **kw))
    _quiet(monkeypatch, 0.9)
    bundle = build(model_path, tmp_path / "busy", backend="onnxruntime", cpu_runs=10, search=False)
    choice = bundle.report["cpu_choice"]
    assert choice["chosen"] == "original model, one session" and choice["others_cpu_share"] == 0.9
    assert "not timed: other processes used 90% of the cores" in choice["decision"] and choice["timed"] == [] and not calls
    assert bundle.plan.num_streams == 1 and len(bundle.plan.branches) == 1
    _check_outputs(bundle.path, model_path)

    _quiet(monkeypatch, 0.0, 0.9)  # quiet when it looked, busy while timing
    bundle = build(model_path, tmp_path / "busy-later", backend="onnxruntime", cpu_runs=10, search=False)
    choice = bundle.report["cpu_choice"]
    assert calls and choice["chosen"] == "original model, one session" and choice["others_cpu_share"] == 0.9
    assert "other processes used 90% of the cores meanwhile" in choice["decision"]
    assert [t["alternative"] for t in choice["timed"] if t["chosen"]] == ["original model, one session"]
    plan = next(t for t in choice["timed"] if t["alternative"].startswith("plan"))
    assert plan["median_ms"] < 0.6 * choice["timed"][0]["median_ms"]  # the win, recorded


def test_decide_by_timing_takes_alternatives_in_order():
    from parastream.pipeline.measure import decide_by_timing

    t = {"a": np.full(9, 1.0), "b": np.full(9, 0.9), "c": np.full(9, 0.88)}
    chosen, rows = decide_by_timing(t, ["a", "b", "c"])
    assert chosen == "b"  # b beats a by 10%; c is within 5% of b
    assert [r["chosen"] for r in rows] == [False, True, False] and rows[2]["against"] == "b"
    assert decide_by_timing(t, ["a", "c", "b"])[0] == "c"
    assert decide_by_timing({"a": np.full(3, 1.0), "b": np.array([0.5, 0.9, 1.5])}, ["a", "b"])[0] == "a"  # spread 50%


def test_race_calls_stops_a_clearly_slower_runner_early():
    import time

    from parastream.pipeline.bench import race_calls

    calls = {"fast": 0, "slow": 0}

    def runner(name, s):
        def run(feeds):
            calls[name] += 1
            time.sleep(s)
        return run

    times = race_calls({"fast": runner("fast", 0.0005), "slow": runner("slow", 0.01)}, {}, runs=20, warmup=1, block=5)
    assert len(times["fast"]) == 20 and len(times["slow"]) == 5  # one block, then clearly behind
    assert calls == {"fast": 21, "slow": 6}
    # raced alone after a faster one (alternatives too large to load together): its median leads
    assert len(race_calls({"slow": runner("slow", 0.01)}, {}, runs=20, warmup=0, block=5, lead_s=0.0005)["slow"]) == 5
    assert len(race_calls({"fast": runner("fast", 0.0005)}, {}, runs=20, warmup=0, block=5, lead_s=0.01)["fast"]) == 20


def test_explicit_streams_only_compare_thread_counts(model_path, tmp_path):
    bundle = build(model_path, tmp_path / "b", backend="onnxruntime", streams=3, cpu_runs=3, search=False)
    names = [t["alternative"] for t in bundle.report["cpu_choice"]["timed"]]
    assert names and all(n.startswith("plan: 3 streams") for n in names)
    assert bundle.plan.num_streams == 3


def test_no_measure_keeps_the_cost_models_plan(model_path, tmp_path):
    bundle = build(model_path, tmp_path / "b", backend="onnxruntime", measure=False, search=False)
    assert bundle.report["cpu_choice"] is None and bundle.plan.cpu_threads is None


def test_cpu_launcher_threads():
    """Threads per session: the plan's measured choice, else every core for one stream, cores shared for several."""
    from parastream.launcher.cpu import default_threads
    from parastream.launcher.plan import Plan

    def plan(streams, threads):
        return Plan(backend="onnxruntime", precision="fp32", num_streams=streams, inputs=[], outputs=[], tensors={},
                    branches=[], launch_order=[], cpu_threads=threads)

    cores = os.cpu_count() or 1
    assert default_threads(plan(1, None)) == 0
    assert default_threads(plan(2, None)) == max(1, cores // 2)
    assert default_threads(plan(4, 3)) == 3 and default_threads(plan(4, 0)) == 0
    assert Plan.from_json(plan(2, 5).to_json()).cpu_threads == 5
    legacy = json.loads(plan(2, None).to_json())
    legacy.pop("cpu_threads")
    assert Plan.from_json(json.dumps(legacy)).cpu_threads is None  # bundles written before the field


def test_cpu_device_profile():
    from parastream.rewrite.cost import RooflineCostModel, get_device

    d = get_device("cpu")
    assert d.name == "CPU" and d.sms == (os.cpu_count() or 1) and d.fp32_flops > 1e8 and d.bandwidth > 1e8
    assert get_device("CPU") is d  # made once per process
    # nominal, not measured: the search's costs (and so the rewrites it finds) must not move with the machine's load
    import parastream.rewrite.cost as cost

    saved = list(cost._CPU_SPEC)
    try:
        cost._CPU_SPEC.clear()
        assert cost.cpu_device() == d and cost.cpu_device() is not d
    finally:
        cost._CPU_SPEC[:] = saved
    assert RooflineCostModel("CPU").describe() == "roofline CPU fp32"
    from parastream.launcher.engines import require_backend
    from parastream.pipeline.build import default_device_profile

    assert default_device_profile(require_backend("onnxruntime")) == "CPU"


def test_devices_lists_the_cpu_profile(capsys):
    assert main(["devices"]) == 0
    assert "CPU" in capsys.readouterr().out


def test_bench_cpu_bundle_against_plain_onnxruntime(model_path, tmp_path, capsys):
    out = tmp_path / "b"
    build(model_path, out, backend="onnxruntime", cpu_runs=3, search=False)
    assert main(["bench", str(out), "--runs", "6", "--warmup", "1", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["runs"] == 6 and res["model"] == str(model_path) and res["model_is_original"]
    assert res["parastream_ms"] > 0 and res["onnxruntime_ms"] > 0
    lo, hi = res["speedup_min_max"]
    assert lo <= res["speedup_iqr"][0] <= res["speedup_vs_onnxruntime"] <= res["speedup_iqr"][1] <= hi
    assert res["max_scaled_error"] < 1e-5
    assert main(["bench", str(out), "--runs", "4", "--warmup", "1"]) == 0
    printed = capsys.readouterr().out
    assert "plain onnxruntime" in printed and "parastream vs plain onnxruntime" in printed


def test_bench_cpu_refuses_a_bundle_that_computes_something_else(model_path, tmp_path):
    from parastream.pipeline.bench import bench_cpu
    from parastream.launcher.errors import ParastreamError

    out = tmp_path / "b"
    build(model_path, out, backend="onnxruntime", cpu_runs=3, search=False)
    other = tmp_path / "other.onnx"
    onnx.save(three_branch_model(seed=5, channels=8, size=16), other)
    with pytest.raises(ParastreamError, match="differ from onnxruntime"):
        bench_cpu(Bundle.open(out), runs=2, warmup=0, original=other)


def test_inspect_reports_the_streams_a_default_build_plans(model_path, tmp_path):
    """inspect and build plan with the same device profile (CPU here): the same stream count as the schedule."""
    from rich.console import Console

    from parastream.pipeline.report import inspect_model

    seen = inspect_model(model_path, console=Console(file=open(os.devnull, "w")))
    bundle = build(model_path, tmp_path / "b", backend="onnxruntime", measure=False, search=False)
    assert seen["streams"] == bundle.plan.num_streams == bundle.report["schedule"]["streams"]


def test_an_unchanged_model_is_timed_once(model_path, tmp_path, monkeypatch):
    """The search found nothing: the 'rewritten' model is the loaded one and is not timed a second time."""
    from parastream.rewrite import search

    monkeypatch.setattr(search, "precheck", lambda *a, **kw: ("forced for the test", {}))
    bundle = build(model_path, tmp_path / "b", backend="onnxruntime", cpu_runs=3)
    assert bundle.report["search"]["rules_chosen"] == []
    names = [t["alternative"] for t in bundle.report["cpu_choice"]["timed"]]
    assert "original model, one session" in names and "rewritten model, one session" not in names


def test_large_alternatives_are_timed_one_at_a_time(model_path, tmp_path, monkeypatch):
    """Above CPU_INTERLEAVE_BYTES the alternatives are loaded one at a time (each session holds its weights):
    the same choice is made from timings taken apart, and the report says how they were loaded."""
    import sys

    import parastream.pipeline.bench as bench

    measure_module = sys.modules["parastream.pipeline.measure"]
    seen = []
    real = bench.race_calls

    def spy(runners, feeds, **kw):
        seen.append(sorted(runners))
        return real(runners, feeds, **kw)

    monkeypatch.setattr(bench, "race_calls", spy)
    monkeypatch.setattr(measure_module, "CPU_INTERLEAVE_BYTES", 0)
    bundle = build(model_path, tmp_path / "b", backend="onnxruntime", cpu_runs=3, search=False)
    choice = bundle.report["cpu_choice"]
    assert choice["loaded"].startswith("one at a time") and len(seen) == len(choice["timed"]) > 1
    assert all(len(names) == 1 for names in seen)
    _check_outputs(bundle.path, model_path)


def test_alternatives_timed_one_at_a_time_stop_where_clearly_behind_those_before(model_path, tmp_path, monkeypatch):
    """One at a time, an alternative clearly slower than the fastest timed before it stops after its first
    block, as it would beside it; one that is not runs every call."""
    import sys

    import parastream.pipeline.bench as bench

    measure_module = sys.modules["parastream.pipeline.measure"]
    monkeypatch.setattr(measure_module, "CPU_INTERLEAVE_BYTES", 0)
    real = bench.race_calls

    def slowed(runners, feeds, **kw):  # the plans' sessions 3x slower than the default's, whatever the machine
        slow = {n: (lambda f, r=r: [r(f) for _ in range(3)]) if n.startswith("plan") else r for n, r in runners.items()}
        return real(slow, feeds, **kw)

    monkeypatch.setattr(bench, "race_calls", slowed)
    bundle = build(model_path, tmp_path / "b", backend="onnxruntime", cpu_runs=10, search=False)
    calls = {t["alternative"]: t["calls"] for t in bundle.report["cpu_choice"]["timed"]}
    assert calls.pop("original model, one session") == 10
    assert calls and all(n.startswith("plan") and c == 5 for n, c in calls.items())


def test_shape_inference_sets_large_weights_aside():
    """The same inferred model as onnx's, with the weights back in place (in the result and in the input)."""
    from onnx import helper, numpy_helper, shape_inference

    from parastream.rewrite import ir

    w = np.random.default_rng(0).random((64, 512), dtype=np.float32)  # 128 KiB: set aside
    shape = numpy_helper.from_array(np.array([1, 512], np.int64), "shape")  # small: stays (data propagation)
    g = helper.make_graph([helper.make_node("Reshape", ["x", "shape"], ["r"]), helper.make_node("MatMul", ["r", "w"], ["y"]),
                           helper.make_node("Relu", ["y"], ["z"])], "g",
                          [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 256])],
                          [helper.make_tensor_value_info("z", onnx.TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(w.T.copy(), "w"), shape])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    before = m.SerializeToString(deterministic=True)
    ours = ir.infer(m, strict=True)
    assert ours.SerializeToString(deterministic=True) == shape_inference.infer_shapes(m, strict_mode=True, data_prop=True).SerializeToString(deterministic=True)
    assert m.SerializeToString(deterministic=True) == before
    assert [d.dim_value for d in ours.graph.output[0].type.tensor_type.shape.dim] == [1, 64]


def _scratch_builds(monkeypatch) -> list:
    """The alternatives' engines each CPU build builds (``measure._cpu_scratch_bundle``), by name, as it builds them."""
    from parastream.pipeline import measure

    real, built = measure._cpu_scratch_bundle, []
    monkeypatch.setattr(measure, "_cpu_scratch_bundle", lambda engines, dest, alt, *a, **kw: built.append(alt.name)
                        or real(engines, dest, alt, *a, **kw))
    return built


def test_a_cpu_rebuild_with_a_cache_dir_takes_the_recorded_choice(model_path, tmp_path, monkeypatch):
    """With --cache-dir the CPU choice timed on a quiet machine is recorded; a rebuild of the model with other
    weights builds the alternative it chose (the plan, not the default) alone, as its bundle's engines, times
    nothing, and verifies what it ships; --remeasure times the alternatives again and records anew."""
    import parastream.pipeline.bench as bench
    from parastream.pipeline.timings import read_timings

    import importlib

    build_module = importlib.import_module("parastream.pipeline.build")
    calls, built, checked = [], _scratch_builds(monkeypatch), []
    fake = _injected({"plan": 5.0, "original": 10.0}, spread=0.01)
    monkeypatch.setattr(bench, "race_calls", lambda *a, **kw: calls.append(1) or fake(*a, **kw))
    real_child = build_module.in_child
    monkeypatch.setattr(build_module, "in_child", lambda fn, what: checked.append(what) or real_child(fn, what=what))
    cache = tmp_path / "cache"
    first = build(model_path, tmp_path / "first", backend="onnxruntime", cpu_runs=10, search=False, cache_dir=str(cache))
    chosen = first.report["cpu_choice"]["chosen"]
    assert calls and chosen.startswith("plan: ") and len(built) > 1
    assert checked == ["loading the model into onnxruntime"]  # onnxruntime's engines' own check, up front
    record = read_timings(type(cache)(first.report["recorded_timings"]["written"]))
    assert record["cpu_choice"]["chosen"] == chosen and "search" not in record

    other = tmp_path / "other.onnx"
    onnx.save(three_branch_model(seed=5, channels=8, size=16), other)
    calls.clear(), built.clear(), checked.clear()
    again = build(other, tmp_path / "again", backend="onnxruntime", cpu_runs=10, search=False, cache_dir=str(cache))
    choice = again.report["cpu_choice"]
    assert not calls and not built  # nothing timed, and the recorded alternative built once, as the bundle's
    assert not checked  # this structure's engines loaded in the recording build; the verification loads these
    assert choice["chosen"] == chosen and str(cache) in choice["recorded_by"]
    assert choice["timed"] == first.report["cpu_choice"]["timed"]  # what was timed, and when, as recorded
    assert again.report["recorded_timings"]["cpu_choice"] == chosen and "written" not in again.report["recorded_timings"]
    assert (again.plan.num_streams, again.plan.cpu_threads) == (first.plan.num_streams, first.plan.cpu_threads)
    assert again.report["verification"]["passed"]
    _check_outputs(again.path, other)

    calls.clear(), built.clear()
    remeasured = build(other, tmp_path / "remeasured", backend="onnxruntime", cpu_runs=10, search=False,
                       cache_dir=str(cache), remeasure=True)
    assert calls and len(built) > 1 and "recorded_by" not in remeasured.report["cpu_choice"]
    assert remeasured.report["recorded_timings"]["written"] == first.report["recorded_timings"]["written"]


def test_a_cpu_choice_made_on_a_loaded_machine_is_not_recorded(model_path, tmp_path, monkeypatch):
    """The default kept because other processes loaded the machine (untimed, or timed while they did) is no
    choice for later builds: nothing is recorded, and the next build on a quiet machine times the alternatives."""
    import parastream.pipeline.bench as bench

    calls = []
    fake = _injected({"plan": 5.0, "original": 10.0}, spread=0.01)
    monkeypatch.setattr(bench, "race_calls", lambda *a, **kw: calls.append(1) or fake(*a, **kw))
    cache = tmp_path / "cache"
    for share in ((0.9,), (0.0, 0.9)):  # busy when the build looks; quiet then, busy while timing
        _quiet(monkeypatch, *share)
        busy = build(model_path, tmp_path / f"busy{len(share)}", backend="onnxruntime", cpu_runs=10, search=False,
                     cache_dir=str(cache))
        assert busy.report["cpu_choice"]["chosen"] == "original model, one session"
        assert "written" not in busy.report["recorded_timings"]
    assert not (cache / "timings").exists() or not list((cache / "timings").iterdir())
    _quiet(monkeypatch)
    calls.clear()
    quiet = build(model_path, tmp_path / "quiet", backend="onnxruntime", cpu_runs=10, search=False, cache_dir=str(cache))
    assert calls and quiet.report["cpu_choice"]["chosen"].startswith("plan: ") and quiet.report["recorded_timings"]["written"]


def test_a_recorded_cpu_choice_that_is_not_an_alternative_is_timed_again(model_path, tmp_path, monkeypatch):
    """A record whose choice this build does not offer (here, edited to a plan of nine streams) is not taken:
    the alternatives are timed, the report says why, and the record is written anew."""
    import parastream.pipeline.bench as bench
    from parastream.pipeline.timings import read_timings, write_timings

    monkeypatch.setattr(bench, "race_calls", _injected({"plan": 5.0, "original": 10.0}, spread=0.01))
    cache = tmp_path / "cache"
    first = build(model_path, tmp_path / "first", backend="onnxruntime", cpu_runs=10, search=False, cache_dir=str(cache))
    path = type(cache)(first.report["recorded_timings"]["written"])
    record = read_timings(path)
    record["cpu_choice"]["chosen"] = "plan: 9 streams, 9 sessions, 1 thread each"
    write_timings(path, record)
    built = _scratch_builds(monkeypatch)
    again = build(model_path, tmp_path / "again", backend="onnxruntime", cpu_runs=10, search=False, cache_dir=str(cache))
    taken = again.report["recorded_timings"]
    assert len(built) > 1 and "recorded_by" not in again.report["cpu_choice"]
    assert taken["cpu_choice"].startswith("timed again: the recorded choice (plan: 9 streams")
    assert taken["written"] == str(path) and read_timings(path)["cpu_choice"]["chosen"] == first.report["cpu_choice"]["chosen"]


def test_a_cpu_builds_device_is_the_hosts_cpu_and_its_cores():
    """The device a CPU build's record is keyed by (and its manifest names): the CPU's model, not just its
    architecture, and the cores the choice was timed with."""
    from parastream.launcher.engines import onnxruntime as ort_engines
    from parastream.launcher.engines.base import host_cpu

    described = ort_engines.describe_device()
    assert described.startswith(host_cpu()) and f"{os.cpu_count()} cores" in described and "onnxruntime" in described
    if os.path.exists("/proc/cpuinfo"):
        names = [line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")]
        assert not names or names[0] in described


@pytest.mark.parametrize("winner", ["original", "plan"])
def test_a_cpu_rebuild_searches_only_where_its_recorded_choice_ships_a_rewrite(model_path, tmp_path, monkeypatch,
                                                                                winner):
    """Where the recorded CPU choice is plain onnxruntime on the loaded model, what the search would propose is
    neither timed nor shipped: the rebuild does not search, and its report and summary say why; where it is the
    plan (of the searched model), the rebuild searches as the first build did."""
    import parastream.pipeline.bench as bench
    from parastream.pipeline.report import build_summary, print_build_summary

    medians = {"plan": 5.0, "original": 10.0, "rewritten": 10.0}
    medians[winner] = 2.0
    monkeypatch.setattr(bench, "race_calls", _injected(medians, spread=0.01))
    cache = str(tmp_path / "cache")
    first = build(model_path, tmp_path / "first", backend="onnxruntime", cpu_runs=10, cache_dir=cache)
    assert first.report["search"]["enabled"] and first.report["cpu_choice"]["chosen"].startswith(winner)
    again = build(model_path, tmp_path / "again", backend="onnxruntime", cpu_runs=10, cache_dir=cache)
    assert again.report["cpu_choice"]["chosen"] == first.report["cpu_choice"]["chosen"]
    summary = build_summary(again)
    if winner == "original":
        assert not again.report["search"]["enabled"] and "search" not in again.report["stage_seconds"]
        assert again.report["search"]["skipped"].endswith("chose the original model, one session")
        assert summary["search"].startswith("skipped: the build of ") and summary["rewrites_proposed"] is None
    else:
        assert again.report["search"]["enabled"] and "search" in again.report["stage_seconds"]
        assert again.report["search"]["rules_chosen"] == first.report["search"]["rules_chosen"]
    from rich.console import Console

    console = Console(record=True, width=300)
    print_build_summary(again, console)
    text = console.export_text()
    assert f"took the CPU choice ({first.report['cpu_choice']['chosen']})" in text
    assert ("rewrite search: skipped: the build of " in text) == (winner == "original")
    _check_outputs(again.path, model_path)


def test_a_record_that_cannot_be_written_leaves_the_verified_bundle_shipped(model_path, tmp_path, monkeypatch):
    """Writing the record fails (a full disk, a folder made read-only meanwhile): the bundle, verified, ships;
    the report and the summary say the record was not written."""
    import errno

    import parastream.pipeline.bench as bench
    from parastream.pipeline import timings

    monkeypatch.setattr(bench, "race_calls", _injected({"plan": 5.0, "original": 10.0}, spread=0.01))

    def full(path, record):
        raise OSError(errno.ENOSPC, "No space left on device")

    build_module = __import__("importlib").import_module("parastream.pipeline.build")
    monkeypatch.setattr(build_module, "write_timings", full)
    bundle = build(model_path, tmp_path / "b", backend="onnxruntime", cpu_runs=10, search=False,
                   cache_dir=str(tmp_path / "cache"))
    rt = bundle.report["recorded_timings"]
    assert "written" not in rt and rt["not_written"].endswith("No space left on device")
    assert bundle.report["verification"]["passed"] and timings.read_timings(type(tmp_path)(rt["file"])) is None
    from rich.console import Console

    from parastream.pipeline.report import print_build_summary

    console = Console(record=True, width=300)
    print_build_summary(bundle, console)
    assert "timings: not recorded (" in console.export_text()
    _check_outputs(bundle.path, model_path)


def test_a_cpu_rebuild_takes_a_search_that_kept_the_input(tmp_path, monkeypatch):
    """A model the search leaves as it is, on one stream (one alternative: nothing timed): the record says the
    search kept the input, and a rebuild neither searches nor checks the model up front, and verifies what it
    ships; a model the search rewrites records no such thing, and its rebuild searches."""
    import importlib

    from graphs import residual_stack_model, two_output_model

    from parastream.pipeline.timings import read_timings

    build_module = importlib.import_module("parastream.pipeline.build")
    checked = []
    real_child = build_module.in_child
    monkeypatch.setattr(build_module, "in_child", lambda fn, what: checked.append(what) or real_child(fn, what=what))
    cache = str(tmp_path / "cache")
    kept, rewritten = tmp_path / "kept.onnx", tmp_path / "rewritten.onnx"
    onnx.save(residual_stack_model(layers=3), kept)
    onnx.save(two_output_model(), rewritten)

    built = _scratch_builds(monkeypatch)
    first = build(kept, tmp_path / "k1", backend="onnxruntime", cache_dir=cache)
    assert first.report["search"]["enabled"] and not first.report["search"]["rules_chosen"]
    assert first.report["cpu_choice"]["timed"] == [] and not built  # one alternative: nothing timed, built once
    record = read_timings(type(tmp_path)(first.report["recorded_timings"]["written"]))
    assert record["search_kept_input"] is True and record["cpu_choice"] is None
    checked.clear()
    again = build(kept, tmp_path / "k2", backend="onnxruntime", cache_dir=cache)
    assert not again.report["search"]["enabled"] and "kept it as it is" in again.report["search"]["skipped"]
    assert "search" not in again.report["stage_seconds"] and not checked
    assert again.report["recorded_timings"]["search"] == "decision to keep the input"
    assert "written" not in again.report["recorded_timings"] and again.report["verification"]["passed"]

    import parastream.pipeline.bench as bench

    monkeypatch.setattr(bench, "race_calls", _injected({"rewritten": 2.0, "original": 10.0, "plan": 10.0}))
    first = build(rewritten, tmp_path / "r1", backend="onnxruntime", cache_dir=cache)
    assert first.report["search"]["rules_chosen"] and first.report["cpu_choice"]["chosen"].startswith("rewritten")
    assert read_timings(type(tmp_path)(first.report["recorded_timings"]["written"]))["search_kept_input"] is False
    again = build(rewritten, tmp_path / "r2", backend="onnxruntime", cache_dir=cache)
    assert again.report["search"]["enabled"] and again.report["search"]["rules_chosen"] == first.report["search"]["rules_chosen"]
    assert again.report["cpu_choice"]["recorded_by"]
