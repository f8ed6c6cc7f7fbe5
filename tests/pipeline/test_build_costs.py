"""What a build pays for: the search measures only when a measurement can decide something, a candidate that
differs from the input in a few branches compiles only those, and ``--cache-dir`` makes a second build compile
nothing whose code did not change.  On the CPU: the device is a stand-in, compiles are counted."""

from __future__ import annotations

import numpy as np
import pytest

from parastream.pipeline import zoo
from parastream.rewrite import RooflineCostModel, optimize
from parastream.rewrite.ir import import_graph


class _EveryRewriteCostlier(RooflineCostModel):
    """The roofline model, but any graph whose nodes are not the input's is estimated twice as costly: the search
    finds candidates (its rules fire) and ranks none of them below the input."""

    def __init__(self, names: set[str]):
        super().__init__()
        self.names = names

    def graph_cost(self, graph, streams):
        cp, work = super().graph_cost(graph, streams)
        return (cp, work) if {n.name for n in graph.nodes} >= self.names else (2 * cp, 2 * work)


def test_a_search_with_only_the_input_to_rank_measures_nothing():
    """The input alone decides nothing: neither prepared nor measured (the build times the input's plan once,
    against its alternatives, after the search)."""
    m = zoo.MODELS["inception_block"]()
    calls = []

    class Recording:
        lookahead = 2

        def adopt(self, model, graph):
            pass

        def prepare(self, models):
            calls.append("prepare")

        def measure(self, model):
            calls.append("measure")
            return 1e-3

    names = {n.name for n in import_graph(m).nodes}
    out, report = optimize(m, measure=Recording(), top_k=5, cost_model=_EveryRewriteCostlier(names))
    assert report["pieces"] and sum(p["candidates_tried"] for p in report["pieces"]) > 0  # the rules fired
    assert calls == []
    assert out is m and report["decided_by"] == "cost_model" and "nothing was measured" in report["decision"]
    assert [c["input"] for c in report["candidates"] if c["chosen"]] == [True]

    # with the roofline model a rewrite ranks below the input: the input and the rewrites are measured
    out, report = optimize(m, measure=Recording(), top_k=5)
    assert calls.count("measure") >= 2 and report["decided_by"] == "measured"


def _loaded(tmp_path, name="inception_block"):
    import onnx

    from parastream.pipeline.model_io import load_model

    path = tmp_path / f"{name}.onnx"
    onnx.save(zoo.MODELS[name](), path)
    return load_model(path)


def test_a_one_stream_plan_queues_no_boundary_layout_alternative(tmp_path):
    """A one-engine plan has no internal boundary: channels-last or contiguous boundaries are the same engines, so
    the alternatives a GPU build compiles and times for it leave that round out (``time_alternatives`` does)."""
    from parastream.launcher.engines import BuildOptions
    from parastream.launcher.engines import torch as torch_backend
    from parastream.pipeline.build import Engines
    from parastream.pipeline.measure import Variant, alternative_variants

    loaded = _loaded(tmp_path)
    engines = Engines(torch_backend, RooflineCostModel(), loaded, "fp16")
    options = BuildOptions(precision="fp16", device="cuda")
    several = engines.plan(loaded.graph, None, 4)
    assert several.num_streams > 1
    one = engines.one_stream_plan(loaded.graph, several)
    rounds = [what for what, _ in alternative_variants(engines, Variant(loaded.model, loaded.graph, several, options))]
    assert "boundary layout" in rounds and "streams" in rounds
    assert [what for what, _ in alternative_variants(engines, Variant(loaded.model, loaded.graph, one, options))] == [
        r for r in rounds if r not in ("boundary layout", "streams")]


@pytest.fixture
def fake_compiles(monkeypatch):
    """Inductor replaced by a stand-in that records each branch it compiles (the real compile: below and in
    tests/engines/); one compile worker, this process."""
    pytest.importorskip("torch")
    from parastream.launcher.engines import torch as torch_backend

    calls = []

    def fake(branch, inputs, outputs, device, dtype, nhwc, views, options):
        calls.append(len(branch.graph.node))
        return b"code", {"params": [], "param_specs": []}

    monkeypatch.setattr(torch_backend, "compile_inductor", fake)
    torch_backend.clear_memory_cache()
    yield calls
    torch_backend.clear_memory_cache()


def _content(branch, layout) -> tuple:
    """A branch as it compiles: its ONNX without the graph's name (which carries the branch's index), and its
    boundary tensors with their channels-last flags and channel views."""
    import copy

    b = copy.deepcopy(branch)
    b.graph.name = ""
    specs = list(layout["inputs"]) + list(layout["outputs"])
    nhwc, views = set(layout.get("internal_nhwc") or ()), dict(layout.get("channel_views") or {})
    return b.SerializeToString(deterministic=True), repr([(t, t.name in nhwc, views.get(t.name)) for t in specs])


def test_a_candidate_compiles_only_the_branches_it_changed(tmp_path, fake_compiles):
    """The search's candidate of small_net keeps some of the input's branches as they were, most under another
    branch name (the plan numbers its branches anew): the engines of the candidate compile exactly the branches
    whose content or layout is not one of the input's (the compiled-branch cache is keyed by content, not name)."""
    from parastream.launcher.engines import BuildOptions
    from parastream.launcher.engines import torch as torch_backend
    from parastream.pipeline.build import Engines, _engine_layouts, branches_of
    from parastream.pipeline.measure import Variant
    from parastream.rewrite import optimize_graph

    loaded = _loaded(tmp_path, "small_net")
    engines = Engines(torch_backend, RooflineCostModel(), loaded, "fp16")
    options = BuildOptions(precision="fp16", device="cuda", compile_workers=1, torch_artifact="inductor")
    before = Variant(loaded.model, loaded.graph, engines.plan(loaded.graph, None, 4), options)
    model, graph, report = optimize_graph(loaded.model, loaded.graph, cost_model=RooflineCostModel(), top_k=5)
    assert report["rules_chosen"]
    after = Variant(model, graph, engines.plan(graph, None, 4), options)

    def contents(v):
        lay = _engine_layouts(v.plan, torch_backend, options)
        return {b.name: _content(br, lay(b)["layout"])  # an in-place Concat compiles nothing
                for br, b in zip(branches_of(v.model, v.graph, v.plan, engines.branches), v.plan.branches) if lay(b)}

    old, new = contents(before), contents(after)
    engines.write(tmp_path / "input", before, "input", sink={})
    assert len(fake_compiles) == len(set(old.values()))
    fake_compiles.clear()
    engines.write(tmp_path / "candidate", after, "candidate", sink={})
    kept = {name for name, c in new.items() if c in set(old.values())}
    renamed = {name for name in kept if old.get(name) != new[name]}
    assert 0 < len(kept) < len(new) and renamed  # some kept, most of those under another branch name
    assert len(fake_compiles) == len({c for name, c in new.items() if name not in kept})


@pytest.fixture
def torch_build_on_cpu(monkeypatch):
    """``build`` with the torch backend compiling its engines for this CPU (as CI runs Inductor): the backend's GPU
    check, the engine device and the engines' layouts (which a build computes for CUDA only) patched; counts the
    Inductor compiles (``standalone_compile`` calls)."""
    import dataclasses
    import importlib

    torch = pytest.importorskip("torch")
    import torch._inductor

    from parastream.launcher.engines import torch as torch_backend
    from parastream.launcher.gpu import engine_layouts

    build_module = importlib.import_module("parastream.pipeline.build")
    real_options = build_module.engine_options

    def layouts(plan, backend, options, internal_nhwc=True):
        lay = engine_layouts(plan, backend, internal_nhwc=internal_nhwc)
        return lambda b: {} if b.id in lay.elided else {"layout": lay.branch(b)}

    monkeypatch.setattr(build_module, "resolve_backend", lambda name: torch_backend)
    monkeypatch.setattr(build_module, "engine_options",
                        lambda cfg, backend: dataclasses.replace(real_options(cfg, backend), device="cpu"))
    monkeypatch.setattr(build_module, "_engine_layouts", layouts)
    calls = []
    real = torch._inductor.standalone_compile
    monkeypatch.setattr(torch._inductor, "standalone_compile", lambda *a, **k: calls.append(1) or real(*a, **k))
    torch_backend.clear_memory_cache()
    yield build_module, calls
    torch_backend.clear_memory_cache()


@pytest.mark.slow
def test_with_a_cache_dir_a_second_build_compiles_nothing_whose_code_did_not_change(tmp_path, torch_build_on_cpu):
    """Built again with ``--cache-dir`` in a process with an empty memory (each build below clears it): the same
    model compiles nothing (every engine a disk hit); the model with one changed weight misses the cache for that
    weight's branch only, whose code is the same, so Inductor compiles nothing there either."""
    import json
    import sys
    from pathlib import Path

    import onnx
    from onnx import numpy_helper

    from parastream.launcher.engines import torch as torch_backend

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from graphs import three_branch_model

    build_module, compiles = torch_build_on_cpu
    cache = tmp_path / "cache"

    def build(model, name):
        path = tmp_path / f"{name}.onnx"
        onnx.save(model, path)
        torch_backend.clear_memory_cache()  # another process
        compiles.clear()
        build_module.build(path, tmp_path / name, backend="torch", precision="fp32", verify=False, streams=3,
                           cache_dir=str(cache), compile_workers=1)
        return json.loads((tmp_path / name / "report.json").read_text())["engines"]

    model = three_branch_model()
    first = build(model, "first")
    # each engine compiled (before it is written, with the alternatives a GPU build would time: memory hits)
    assert len(compiles) >= len(first) > 1 and {r["compiled"] for r in first.values()} == {"inductor"}
    again = build(model, "again")
    # (read from the disk by the batch compiled before the engines are written, which then find them in memory)
    assert compiles == [] and "miss" not in {r["cache"] for r in again.values()}
    assert not any(r.get("code_reused") for r in again.values())
    w = model.graph.initializer[2]  # the 3x3 convolution's weight
    changed = numpy_helper.to_array(w).copy()
    changed[0, 0, 0, 0] += 1.0
    w.CopyFrom(numpy_helper.from_array(changed, w.name))
    rebuilt = build(model, "changed")
    assert compiles == []
    assert len([name for name, r in rebuilt.items() if r.get("code_reused")]) == 1  # the changed weight's branch


def test_the_measurer_plans_an_adopted_candidate_from_its_graph_without_importing_it(monkeypatch):
    """A candidate the search hands over with its graph (``Measurer.adopt``) is planned from that graph; one
    handed over without is imported (``graph_of``), as before."""
    import types

    import onnx_graphsurgeon as gs

    from parastream.launcher.engines import BuildOptions
    from parastream.pipeline.measure import GpuMeasurer

    imports = []
    real = gs.import_onnx
    monkeypatch.setattr(gs, "import_onnx", lambda *a, **k: imports.append(1) or real(*a, **k))
    planned = []
    engines = types.SimpleNamespace(backend=types.SimpleNamespace(background_compiles=False),
                                    plan=lambda graph, streams, max_streams: planned.append(graph) or "plan")
    loaded = types.SimpleNamespace(model=object(), graph=None)
    measurer = GpuMeasurer(engines, BuildOptions(), loaded, streams=None, max_streams=4, budget_s=1.0)
    m = zoo.MODELS["inception_block"]()
    g = import_graph(m)
    imports.clear()
    measurer.adopt(m, g)
    assert measurer.variant_of(m).graph is g and planned == [g] and imports == []
    other = zoo.MODELS["small_net"]()
    measurer.variant_of(other)
    assert len(imports) == 1 and planned[-1] is not g
    measurer.close()
    assert measurer.adopted == []


def _fused_model(attention: bool, gemm: bool):
    """A stand-in model holding the fused nodes asked for (only their op types and domain are read)."""
    import onnx
    from onnx import helper

    from parastream.core import fused_ops

    nodes = [helper.make_node("Relu", ["x"], ["y"])]
    if attention:
        nodes.append(helper.make_node(fused_ops.SDPA, ["q", "k", "v"], ["a"], domain=fused_ops.DOMAIN))
    if gemm:
        nodes.append(helper.make_node(fused_ops.GEMM_ACTIVATION, ["x", "w", "b"], ["g"], domain=fused_ops.DOMAIN))
    return helper.make_model(helper.make_graph(nodes, "m", [], []), opset_imports=[helper.make_opsetid("", 17)])



class _Launcher:
    def __init__(self, v):
        self.model, self.options, self.plan, self.t_built, self.closed = v.model, v.options, v.plan, 0.0, False
        self.internal_nhwc = v.internal_nhwc

    def close(self):
        self.closed = True


def _timing_measurer(monkeypatch, ms_of):
    """A GpuMeasurer over stand-in engines, every fusion on: ``ms_of(model, options)`` is the replay time of a
    launcher of that model built with those options; also the launchers it loaded, in order."""
    import types

    import numpy as np

    from parastream.launcher.engines import BuildOptions
    from parastream.pipeline import bench, measure
    from parastream.pipeline.measure import GpuMeasurer, Variant

    loaded = []

    def launcher(v):
        loaded.append(_Launcher(v))
        return loaded[-1]

    monkeypatch.setattr(bench, "measure", lambda launchers, **kw: {k: np.full(10, ms_of(la.model, la.options))
                                                                   for k, la in launchers.items()})
    monkeypatch.setattr(measure, "runs_fused_attention", lambda backend: True)
    monkeypatch.setattr(measure, "runs_gemm_epilogue", lambda backend: True)
    engines = types.SimpleNamespace(backend=types.SimpleNamespace(background_compiles=False), launcher=launcher)
    input_model = _fused_model(False, False)
    m = GpuMeasurer(engines, BuildOptions(fuse_attention=True, fuse_gemm_epilogue=True),
                    types.SimpleNamespace(model=input_model, graph=None), streams=None, max_streams=4, budget_s=60.0)
    m.variant_of = lambda model: Variant(model, None, types.SimpleNamespace(num_streams=1, branches=[0]), m.options)
    return m, input_model, loaded


def test_the_best_candidate_is_timed_with_a_slow_fusion_off(monkeypatch):
    """The cost model's best candidate, slower than the input with its fused nodes on, is timed again with each
    kind off (the build times that choice for the graph it keeps): its fastest form decides, and the log says
    what was timed."""
    cand = _fused_model(True, True)

    def ms_of(model, o):  # the input 1.0 ms; the candidate 1.3 ms with its GEMM epilogue fused, 0.8 ms without
        return 1.0 if model is not cand else (1.3 if o.fuse_gemm_epilogue else 0.8)

    m, input_model, launchers = _timing_measurer(monkeypatch, ms_of)
    assert m.measure(input_model) == pytest.approx(1e-3)
    assert m.measure(cand) == pytest.approx(0.8e-3)
    assert [(la.options.fuse_attention, la.options.fuse_gemm_epilogue) for la in launchers[1:]] == \
        [(True, True), (False, True), (True, False)]  # as built, then each kind off
    assert m.log[-1]["fusions_off_ms"] == {"attention as plain ops": 1.3, "GEMM epilogue as plain ops": 0.8}
    # the reference's first median, and both medians of each timing in blocks as timed, before scaling
    assert m.log[0]["median_ms"] == 1.0
    assert m.log[-1]["blocks_ms"] == [{"reference": 1.0, "candidate": c} for c in (1.3, 1.3, 0.8)]
    assert all(la.closed for la in launchers[1:])
    m.close()


def test_the_host_lock_is_let_go_only_while_the_gpu_times(monkeypatch):
    """``measure`` holds ``host`` through the load, the plan and the rounds' bookkeeping, and lets it go only
    while the GPU times (the search prepares its next candidate then, rewrite/search.py); a thread that holds
    it when the timing ends makes the measurement wait, and the log says how long (``host_wait_s``).  Outside
    ``measure`` (``confirm``), the lock is neither taken nor let go."""
    import threading
    import time

    from parastream.pipeline import bench

    cand = _fused_model(True, True)
    m, input_model, launchers = _timing_measurer(monkeypatch, lambda model, o: 1.0 if model is not cand else 0.9)
    seen = []
    timed, loading = bench.measure, m.engines.launcher

    def other_thread_takes_the_lock():
        taken = threading.Event()

        def hold():
            with m.host:
                taken.set()
                time.sleep(0.3)  # past the timing's end with room: a loaded machine's timing may take 0.1 s

        threading.Thread(target=hold).start()
        assert taken.wait(2.0)

    def timing(launchers, **kw):
        seen.append(("time", m.host.locked()))
        if len(seen) == 4:  # the candidate's timing: another thread prepares meanwhile, past its end
            other_thread_takes_the_lock()
        return timed(launchers, **kw)

    def load(v):
        seen.append(("load", m.host.locked()))
        return loading(v)

    monkeypatch.setattr(bench, "measure", timing)
    m.engines.launcher = load
    m.measure(input_model)
    m.measure(cand)
    assert [kind for kind, _ in seen] == ["load", "time", "load", "time"]
    assert all(locked == (kind == "load") for kind, locked in seen)
    assert not m.host.locked() and m.log[-1]["host_wait_s"] >= 0.04 and "host_wait_s" not in m.log[0]
    seen.clear()
    m.confirm(cand)
    assert seen == [("load", False), ("time", False)] and not m.host.locked()
    m.close()


def test_a_candidate_is_timed_again_in_the_form_its_time_was_taken_in(monkeypatch):
    """``confirm`` (the search's fastest timed again) loads the form the candidate's time came from, here its
    GEMM epilogue as plain ops, times it against the reference and logs the timing as an entry of its own; a
    model never measured cannot be confirmed."""
    cand = _fused_model(True, True)

    def ms_of(model, o):
        return 1.0 if model is not cand else (1.3 if o.fuse_gemm_epilogue else 0.8)

    m, input_model, launchers = _timing_measurer(monkeypatch, ms_of)
    with pytest.raises(ValueError):
        m.confirm(cand)
    m.measure(input_model)
    assert m.measure(cand) == pytest.approx(0.8e-3)
    n = len(launchers)
    assert m.confirm(cand) == pytest.approx(0.8e-3)
    assert len(launchers) == n + 1 and not launchers[-1].options.fuse_gemm_epilogue and launchers[-1].closed
    assert m.log[-1]["again"] and m.log[-1]["blocks_ms"] == [{"reference": 1.0, "candidate": 0.8}]
    with pytest.raises(ValueError):
        m.confirm(_fused_model(True, True))
    m.close()


@pytest.mark.parametrize("reference_ms, expected", [([1.0, 1.2, 1.0], 0.9), ([1.0, 1.2, 1.3, 1.2], 0.75),
                                                     ([1.0, 1.04], 0.9 / 1.04), ([2.0, 1.0], 1.8),
                                                     ([1.0, 0.9], 1.0)])
def test_a_timing_whose_reference_drifted_is_taken_again(monkeypatch, reference_ms, expected):
    """A candidate's time is scaled by the reference's first median, which holds only if the reference ran as
    fast in the candidate's blocks: one that ran more than 5% slower than its usual median is timed again (at most
    twice), and the candidate's time is then its own (the reference back at 1.0 ms: 0.9, not 0.75).  A
    reference that stays slow is taken as it is, after the retries; within 5% is not timed again; and one
    faster than its first median is taken at once (the first was the disturbed timing: 2.0 then 1.0 ms gives
    the candidate 0.9 / 1.0 of the input's 2.0 ms, in one timing)."""
    cand = _fused_model(True, True)
    times = iter(reference_ms)

    def ms_of(model, o):  # the reference: the next of ``reference_ms`` at each timing; the candidate 0.9 ms
        return 0.9 if model is cand else next(times)

    m, input_model, _ = _timing_measurer(monkeypatch, ms_of)
    assert m.measure(input_model) == pytest.approx(reference_ms[0] * 1e-3)
    assert m.measure(cand) == pytest.approx(expected * 1e-3)
    assert [b["reference"] for b in m.log[-1]["blocks_ms"]] == reference_ms[1:]
    assert all(b["candidate"] == 0.9 for b in m.log[-1]["blocks_ms"])
    m.close()


@pytest.mark.parametrize("current_ms, won, tries", [
    ([1.25, 1.0], False, 2),  # slow in the first try (25% over its usual 1.0): taken again, the plan's form kept
    ([1.25, 1.3, 1.26], True, 3),  # slow in every try: after the retries the round goes by what was timed
    ([1.04], False, 1),  # within the drift: timed once
])
def test_a_round_raced_while_its_reference_ran_slow_is_taken_again(monkeypatch, current_ms, won, tries):
    """An input's round raced against the search's reference is timed again, as a candidate's timing is, when the
    reference ran more than 5% slower than its usual median: otherwise a slow state of the reference's launcher
    hands the round to its alternative (the alternative runs 1.1 ms here, 10% slower than the plan at rest)."""
    import itertools
    import types

    from parastream.pipeline import bench, measure

    cur_iter = itertools.chain(current_ms, itertools.repeat(current_ms[-1]))  # a confirmation runs as the last try

    def timed(launchers, **kw):
        (current, _), (alt, _) = launchers.items()
        return {current: np.full(9, next(cur_iter)), alt: np.full(9, 1.1)}

    monkeypatch.setattr(bench, "measure", timed)
    rounds: list = []
    seen = [1.0, 1.01, 0.99]  # the reference's medians in the search so far
    got = measure.race(rounds, "conv+ReLU", object(), object(), types.SimpleNamespace(num_streams=1), runs=9,
                       since=0.0, lock=False, seen=seen)
    assert got is won
    assert len(rounds) == 1 and len(rounds[0].get("tries_ms", [None])) == tries
    assert seen[3:] == current_ms  # each try's median joins the reference's record
    assert rounds[0]["timed_ms"]["cuDNN fused conv+bias+ReLU"] == pytest.approx(current_ms[-1])


def test_a_reference_whose_first_median_was_its_fastest_is_not_retried_for_ever(monkeypatch):
    """The drift is measured from the reference's usual median, not its fastest: a reference first timed 1.0 ms
    that then runs 1.2 ms in every timing has the first candidate's timing taken again, but the later
    candidates' once each."""
    cands = [_fused_model(True, True) for _ in range(3)]
    times = iter([1.0] + [1.2] * 10)

    def ms_of(model, o):  # the reference: 1.0 ms alone, 1.2 ms from then on; each candidate 0.9 ms
        return 0.9 if any(model is c for c in cands) else next(times)

    m, input_model, _ = _timing_measurer(monkeypatch, ms_of)
    m.measure(input_model)
    for c in cands:
        assert m.measure(c) == pytest.approx(0.9 / 1.2 * 1e-3)
    # the first: 1.2 against a usual 1.0, then against 1.1 (the median of 1.0 and 1.2), then taken (1.2); the rest
    # once: 1.2 is the usual median by then (measured from the fastest, 1.0, each would have been timed three times)
    assert [len(e["blocks_ms"]) for e in m.log[1:]] == [3, 1, 1]
    m.close()


def test_the_search_log_adds_up_each_measurements_wait_for_the_gpus_turn(monkeypatch):
    """Each measurement's log entry says how long its timings waited for the GPU's turn (other builds' timings,
    compile workers' runs) and how many blocks a gate's timer had to open, summed over its retried timings."""
    from parastream.pipeline import bench

    cand = _fused_model(True, True)
    times = iter([1.0, 1.2, 1.0])  # the reference: alone, then slow in the candidate's first timing
    m, input_model, _ = _timing_measurer(monkeypatch, lambda model, o: 0.9 if model is cand else next(times))
    timed = bench.measure

    def with_info(launchers, **kw):
        kw["info"].update(lock_wait_s=0.25, blocks=16, held=16, opened_by_timer=1)
        return timed(launchers, **kw)

    monkeypatch.setattr(bench, "measure", with_info)
    m.measure(input_model)
    assert m.log[0]["lock_wait_s"] == 0.25 and m.log[0]["gates_opened_by_timer"] == 1
    m.measure(cand)
    assert len(m.log[-1]["blocks_ms"]) == 2  # timed again once
    assert m.log[-1]["lock_wait_s"] == 0.5 and m.log[-1]["gates_opened_by_timer"] == 2
    m.close()


@pytest.mark.parametrize("case", ["faster", "no fused nodes", "a later candidate"])
def test_a_candidate_is_timed_once_where_fusions_off_could_not_change_the_decision(monkeypatch, case):
    """Not when the candidate wins as built, not when it has no fused node, and not for the search's later
    candidates (a compile per kind each)."""
    cand = _fused_model(case != "no fused nodes", case != "no fused nodes")
    slow = 0.9 if case == "faster" else 1.3

    def ms_of(model, o):
        return 1.0 if model is not cand else (slow if o.fuse_gemm_epilogue else 0.8)

    m, input_model, launchers = _timing_measurer(monkeypatch, ms_of)
    m.measure(input_model)
    if case == "a later candidate":
        m.measure(_fused_model(False, False))  # the best candidate: the input's time, nothing to turn off
    n = len(launchers)
    assert m.measure(cand) == pytest.approx(slow * 1e-3)
    assert len(launchers) == n + 1 and "fusions_off_ms" not in m.log[-1]
    m.close()


@pytest.mark.parametrize("one_engine_ms", [0.7, 1.6])
def test_the_best_candidate_is_timed_as_one_engine_where_its_plan_has_streams(monkeypatch, one_engine_ms):
    """The cost model's best candidate, slower than the input as its stream plan, is timed again as one engine
    for the whole model (the build's "streams" round would make it that): the faster form is its time and the
    one its fused nodes are then timed off in; the log says what was timed."""
    import types

    from parastream.pipeline.measure import Variant

    cand = _fused_model(False, True)
    streams, one = types.SimpleNamespace(num_streams=2), types.SimpleNamespace(num_streams=1, branches=[0])

    def ms_of(model, o, plan):  # the input 1.0 ms; the candidate 1.3 ms on streams, one_engine_ms as one engine,
        if model is not cand:   # and 0.1 ms faster with its GEMM epilogue off
            return 1.0
        return (1.3 if plan is streams else one_engine_ms) - (0.0 if o.fuse_gemm_epilogue else 0.1)

    import numpy as np

    m, input_model, launchers = _timing_measurer(monkeypatch, None)
    from parastream.pipeline import bench

    monkeypatch.setattr(bench, "measure", lambda ls, **kw: {k: np.full(10, ms_of(la.model, la.options, la.plan))
                                                            for k, la in ls.items()})
    m.variant_of = lambda model: Variant(model, None, streams if model is cand else one, m.options)
    m.engines.one_stream_plan = lambda graph, plan: one
    m.measure(input_model)
    best = min(1.3, one_engine_ms)
    assert m.measure(cand) == pytest.approx((best - 0.1) * 1e-3)
    assert [la.plan is one for la in launchers[1:]] == [False, True, best < 1.3]  # as planned, one engine, epilogue off
    assert m.log[-1]["streams_ms"] == {"plan": 1.3, "one engine": one_engine_ms}
    assert all(la.closed for la in launchers[1:])
    m.close()


def test_the_kept_candidate_that_ran_faster_as_one_engine_is_planned_as_one(monkeypatch, tmp_path):
    """The measurer remembers the candidate whose one-engine form won (``one_engine_timed``, by identity of the
    model the search passed), and the build's schedule then plans it as one engine, marked measured."""
    import types

    import numpy as np

    from parastream.pipeline import bench
    from parastream.pipeline.measure import Variant

    cand = _fused_model(False, False)
    streams, one = types.SimpleNamespace(num_streams=2), types.SimpleNamespace(num_streams=1, branches=[0])
    m, input_model, launchers = _timing_measurer(monkeypatch, None)
    monkeypatch.setattr(bench, "measure", lambda ls, **kw: {
        k: np.full(10, 1.0 if la.model is not cand else (1.3 if la.plan is streams else 0.7)) for k, la in ls.items()})
    m.variant_of = lambda model: Variant(model, None, streams if model is cand else one, m.options)
    m.engines.one_stream_plan = lambda graph, plan: one
    m.measure(input_model)
    m.measure(cand)
    assert m.one_engine_timed(cand) == {"plan": 1.3, "one engine": 0.7}
    assert m.one_engine_timed(input_model) is None and m.one_engine_timed(_fused_model(False, False)) is None
    m.close()

    import onnx

    from parastream.pipeline.build import Engines, _Build, schedule_streams
    from parastream.pipeline.model_io import load_model

    path = tmp_path / "inception_block.onnx"
    onnx.save(zoo.MODELS["inception_block"](), path)  # four streams by the cost model
    b = _Build.__new__(_Build)
    b.graph, b.planned, b.timings = load_model(path).graph, (None, None), {}
    b.cost_model = RooflineCostModel("H100-SXM", precision="fp16")
    b.engines = Engines(None, b.cost_model, None, "fp16")
    b.cfg = types.SimpleNamespace(streams=None, max_streams=4)
    b.one_engine_timed = None
    schedule_streams(b)
    assert b.sched.num_streams > 1  # without the search's timing: the cost model's plan
    b.one_engine_timed = {"plan": 1.3, "one engine": 0.7}
    schedule_streams(b)
    assert b.sched.num_streams == 1 and b.streams_tried[-1]["measured"] and b.streams_tried[-1]["chosen"]
    assert b.streams_tried[-1]["timed_in_search"] == {"plan": 1.3, "one engine": 0.7}


@pytest.mark.parametrize("input_streams,candidate_streams,queued", [(1, 2, True), (4, 4, False), (1, 1, False)])
def test_the_best_candidate_s_one_stream_form_compiles_beside_its_stream_plan(monkeypatch, input_streams,
                                                                               candidate_streams, queued):
    """Where the input is one engine and the cost model's best candidate is planned on streams, preparing that
    candidate also queues its one-engine form and that form with each of its fusions off (``_as_one_engine``
    and ``_with_fusions_off``, or the build's rounds, time them); not where the input has streams too, nor for
    a one-stream candidate, nor for later candidates."""
    import types

    from parastream.pipeline.measure import Variant

    cand, later = _fused_model(False, True), _fused_model(True, False)
    one = types.SimpleNamespace(num_streams=1, branches=[0])
    m, input_model, _ = _timing_measurer(monkeypatch, lambda model, o: 1.0)
    plans = {id(input_model): types.SimpleNamespace(num_streams=input_streams, branches=[0]),
             id(cand): types.SimpleNamespace(num_streams=candidate_streams, branches=[0]),
             id(later): types.SimpleNamespace(num_streams=2)}
    m.variant_of = lambda model: Variant(model, None, plans[id(model)], m.options)
    compiled = []
    m.engines.precompile = lambda variants, **kw: compiled.append(
        [(v.plan, v.options.fuse_gemm_epilogue) for v in variants]) or {"background": False}
    m.engines.one_stream_plan = lambda graph, plan: one
    m.prepare([input_model])
    m.prepare([cand])
    m.prepare([later])
    # the candidate holds a GEMM epilogue node (and no attention node): one engine, with it on and off
    expected = [[(plans[id(input_model)], True)], [(plans[id(cand)], True)]] + (
        [[(one, True), (one, False)]] if queued else []) + [[(plans[id(later)], True)]]
    assert compiled == expected
    m.close()


def test_a_lead_in_one_timing_is_timed_again_before_its_rounds_are_compiled(monkeypatch):
    """A candidate ahead of the input by the search's margin is timed again against the reference before the
    build queues its rounds' compiles: a lead that holds in both timings queues them, one that the second timing
    does not bear out queues nothing.  Either way its time is the mean of the two, and the log keeps both."""
    from parastream.pipeline import measure

    noise, real = _fused_model(True, False), _fused_model(False, True)
    timings = {id(noise): iter([0.965, 0.995]), id(real): iter([0.95, 0.96])}  # the input 1.0 ms, margin 2%
    m, input_model, launchers = _timing_measurer(
        monkeypatch, lambda model, o: next(timings[id(model)]) if id(model) in timings else 1.0)
    queued = []
    m.backend.background_compiles, m.backend.cancel_precompile = True, lambda: 0
    m.engines.precompile = lambda variants, background, cancellable, label="": queued.append(
        [v.model for v in variants]) or {"jobs": len(variants)}
    monkeypatch.setattr(measure, "alternative_variants", lambda engines, v: [("attention", v)])
    monkeypatch.setattr(measure, "speculative_by_round", lambda engines, v, decided=(): [])
    m.measure(input_model)
    assert m.measure(noise) == pytest.approx(0.98e-3)  # 3.5% ahead, then 0.5%: the mean
    assert m.log[-1]["lead_timed_again_ms"] == [0.965, 0.995] and "rounds_queued" not in m.log[-1]
    assert len(m.log[-1]["blocks_ms"]) == 2 and launchers[-1].closed
    assert m.measure(real) == pytest.approx(0.955e-3)  # ahead in both timings: its rounds queued
    assert m.log[-1]["lead_timed_again_ms"] == [0.95, 0.96] and m.log[-1]["rounds_queued"] == 1
    assert queued == [[real]]
    m.close()


def test_the_fastest_candidate_so_far_has_its_rounds_compiled_while_the_search_goes_on(monkeypatch):
    """A candidate faster than the input (by the search's margin) and than every candidate before it is the one the
    build ships if nothing beats it: its rounds' alternatives are queued for the background compiles then, not
    after the search.  One within the margin is never kept: nothing is queued for it."""
    from parastream.pipeline import measure

    first, second, slower = _fused_model(True, False), _fused_model(False, True), _fused_model(True, True)
    close = _fused_model(False, False)
    times = {id(first): 0.9, id(second): 0.8, id(slower): 0.95, id(close): 0.99}
    m, input_model, _ = _timing_measurer(monkeypatch, lambda model, o: times.get(id(model), 1.0))
    queued = []
    m.backend.background_compiles, m.backend.cancel_precompile = True, lambda: 0
    m.engines.precompile = lambda variants, background, cancellable, label="": queued.append(
        ([v.model for v in variants], background, cancellable)) or {"jobs": len(variants)}
    monkeypatch.setattr(measure, "alternative_variants", lambda engines, v: [("attention", v)])
    monkeypatch.setattr(measure, "speculative_by_round", lambda engines, v, decided=(): [])
    m.measure(input_model)
    m.measure(close)  # the fastest so far, but 1% faster than the input: the search keeps the input, nothing queued
    m.measure(first)  # faster than the input: queued
    m.measure(slower)  # slower than the best so far: not
    m.measure(second)  # the new best: queued
    assert queued == [([first], True, True), ([second], True, True)]
    assert "rounds_queued" not in m.log[1] and m.log[2]["rounds_queued"] == 1 and "rounds_queued" not in m.log[3]
    m.close()


def _nasnet_engines(tmp_path):
    from parastream.launcher.engines import BuildOptions
    from parastream.launcher.engines import torch as torch_backend
    from parastream.pipeline.build import Engines
    from parastream.pipeline.measure import Variant

    loaded = _loaded(tmp_path, "nasnet_cell")
    engines = Engines(torch_backend, RooflineCostModel(), loaded, "fp16")
    options = BuildOptions(precision="fp16", device="cuda", conv_kernels="auto")
    v = Variant(loaded.model, loaded.graph, engines.plan(loaded.graph, None, 4), options)
    alt = Variant(v.model, v.graph, v.plan, BuildOptions(precision="fp16", device="cuda", conv_kernels="inductor"))
    return engines, v, alt


def _depthwise_alternatives(v, alt):
    """The input's two depthwise rounds' alternatives, as ``alternative_variants`` names them."""
    from dataclasses import replace

    return {"depthwise convolutions": alt,
            "depthwise kernel": replace(v, options=replace(v.options, conv_kernels="native"))}


@pytest.mark.parametrize("cap", [12, 1])
def test_a_depthwise_round_s_sample_holds_the_plan_s_distinct_depthwise_convolutions(monkeypatch, tmp_path, cap):
    """The sample is engines of the plan side by side as one plan of their own (one engine per branch, one
    stream, the plan's launch order), as the plan compiles them and with each depthwise round's kernels; chosen
    to hold every distinct depthwise convolution of the plan (weight, strides, pads, input shape), at most
    ``SAMPLE_ENGINES``; a plan with fewer engines holding one than ``SAMPLE_DEPTHWISE_ENGINES`` is not sampled."""
    from parastream.pipeline import measure

    engines, v, alt = _nasnet_engines(tmp_path)
    alternatives = _depthwise_alternatives(v, alt)
    branches = engines.branch_models(v)
    held = {i: measure.depthwise_keys(b) for i, b in enumerate(branches) if measure.depthwise_keys(b)}
    every = set().union(*held.values())
    assert len(held) >= 2 and len(every) >= 2  # the cell's separable convolutions, on several engines
    monkeypatch.setattr(measure, "SAMPLE_DEPTHWISE_ENGINES", len(held) + 1)
    assert measure.depthwise_sample(engines, v, alternatives) is None
    monkeypatch.setattr(measure, "SAMPLE_DEPTHWISE_ENGINES", len(held))
    monkeypatch.setattr(measure, "SAMPLE_ENGINES", cap)
    s = measure.depthwise_sample(engines, v, alternatives)
    assert s.fulls == alternatives and s.of == len(held) and s.convolutions == len(every)
    chosen = [next(i for i, b in enumerate(v.plan.branches) if b.name == name) for name in s.names]
    assert 1 <= len(chosen) <= cap and len(set(chosen)) == len(chosen)
    launched = [i for i in v.plan.launch_order if i in chosen]
    assert chosen == launched  # run in the plan's launch order
    assert s.covered == len(set().union(*(held[i] for i in chosen)))
    if cap > len(held):
        assert s.covered == len(every)
    plan = s.current.plan
    assert plan.num_streams == 1 and [b.nodes for b in plan.branches] == [v.plan.branches[i].nodes for i in chosen]
    assert s.current.options is v.options and s.variants() == [s.current, *s.kinds.values()]
    assert {w: k.options.conv_kernels for w, k in s.kinds.items()} == {"depthwise convolutions": "inductor",
                                                                      "depthwise kernel": "native"}
    assert all(k.plan is plan and k.model is s.current.model for k in s.kinds.values())


def test_branches_side_by_side_compute_what_each_branch_computes(tmp_path):
    """``partition.side_by_side`` of a plan's branches (here every branch of NASNet's cell, some reading others'
    outputs): ONNX Runtime runs the merged model and each branch alone to the same outputs, the branches' shared
    inputs and weights held once, and the plan made of it has one engine per branch with the branches' nodes."""
    import numpy as np
    import onnxruntime as ort

    from parastream.pipeline.partition import side_by_side

    engines, v, _ = _nasnet_engines(tmp_path)
    branches = engines.branch_models(v)
    order = list(v.plan.launch_order)
    merged = side_by_side([branches[i] for i in order])
    names = [i.name for i in merged.graph.input]
    assert len(names) == len(set(names)) and len({t.name for t in merged.graph.initializer}) == len(merged.graph.initializer)
    rng = np.random.default_rng(0)

    def random_feeds(model, have):
        from onnx import helper

        feeds = {}
        for i in model.graph.input:
            if i.name in have:
                feeds[i.name] = have[i.name]
                continue
            t = i.type.tensor_type
            shape = [d.dim_value for d in t.shape.dim]
            feeds[i.name] = rng.standard_normal(shape).astype(helper.tensor_dtype_to_np_dtype(t.elem_type))
        return feeds

    feeds = random_feeds(merged, {})
    sess = ort.InferenceSession(merged.SerializeToString(), providers=["CPUExecutionProvider"])
    got = dict(zip([o.name for o in merged.graph.output], sess.run(None, feeds)))
    internal = {o for b in branches for n in b.graph.node for o in n.output}
    assert any(i.name in internal for b in branches for i in b.graph.input)  # some branch reads another's output
    for i in order:
        b = branches[i]
        alone = ort.InferenceSession(b.SerializeToString(), providers=["CPUExecutionProvider"])
        outs = alone.run(None, random_feeds(b, {**feeds, **got}))
        for o, want in zip(b.graph.output, outs):
            np.testing.assert_allclose(got[o.name], want, rtol=1e-5, atol=1e-5)
    model, graph, plan = engines.side_by_side([branches[i] for i in order])
    assert [b.nodes for b in plan.branches] == [v.plan.branches[i].nodes for i in order]
    assert plan.num_streams == 1 and list(plan.launch_order) == list(range(len(order)))
    with pytest.raises(ValueError, match="before a branch whose output it reads"):
        engines.side_by_side([branches[i] for i in reversed(order)])


def _every_value(model, feeds):
    """Every tensor of ``model`` that its nodes write, as ONNX Runtime computes it from ``feeds``."""
    import onnx
    import onnxruntime as ort

    m = onnx.ModelProto()
    m.CopyFrom(model)
    have = {o.name for o in m.graph.output}
    m.graph.output.extend(v for v in m.graph.value_info if v.name not in have)
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in m.graph.output], sess.run(None, feeds)))


def test_a_window_of_a_plan_computes_what_its_branches_compute_with_its_boundaries_inside(tmp_path):
    """``Engines.window``: branches consecutive in a plan's launch order as a plan of their own.  ONNX Runtime runs
    the window's model to the values the whole model gives those tensors; a tensor that only the window's branches
    read is a boundary inside it (neither input nor output), what it reads from before it its inputs, what later
    branches or the model read its outputs; its engines keep the plan's nodes, launch order and streams (the
    same branches share one), the streams numbered in order of first use."""
    import numpy as np
    import onnxruntime as ort

    from parastream.pipeline import measure

    engines, v, _ = _nasnet_engines(tmp_path)
    plan = v.plan
    ids = list(plan.launch_order[5:25])
    model, graph, wp = engines.window(v, ids)
    assert [b.nodes for b in wp.branches] == [plan.branches[i].nodes for i in ids]
    assert list(wp.launch_order) == list(range(len(ids)))
    same = [[plan.branches[i].stream == plan.branches[j].stream for j in ids] for i in ids]
    assert [[a.stream == b.stream for b in wp.branches] for a in wp.branches] == same
    assert wp.num_streams == len({plan.branches[i].stream for i in ids}) > 1
    assert [b.stream for b in wp.branches][0] == 0 and max(b.stream for b in wp.branches) == wp.num_streams - 1
    inside = set(ids)
    written = {t for i in ids for t in plan.branches[i].outputs}
    read_later = {t for b in plan.branches if b.id not in inside for t in b.inputs} | {t.name for t in plan.outputs}
    assert {o.name for o in model.graph.output} == written & read_later
    assert {i.name for i in model.graph.input} == {t for i in ids for t in plan.branches[i].inputs} - written
    assert measure._nhwc_boundaries(engines.backend, wp) > 0  # boundaries between its engines, laid out as the plan's

    rng = np.random.default_rng(0)
    feeds = {i.name: rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim]).astype(np.float32)
             for i in v.model.graph.input}
    values = _every_value(v.model, feeds)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    got = sess.run(None, {i.name: values[i.name] for i in model.graph.input})
    for o, x in zip(model.graph.output, got):
        np.testing.assert_allclose(x, values[o.name], rtol=1e-4, atol=1e-4)


def test_a_boundary_layout_round_s_sample_is_a_window_from_the_middle_of_the_launch_order(monkeypatch, tmp_path):
    """``layout_sample``: ``LAYOUT_WINDOW`` engines consecutive in the plan's launch order, from its middle, with
    channels-last internal boundaries and with contiguous ones; none for a plan of fewer engines than
    ``SAMPLE_LAYOUT_ENGINES``, nor for a window with no boundary inside it that the layout changes."""
    from dataclasses import replace

    from parastream.pipeline import measure

    engines, v, _ = _nasnet_engines(tmp_path)
    full = replace(v, internal_nhwc=False)
    n = len(v.plan.branches)
    monkeypatch.setattr(measure, "SAMPLE_LAYOUT_ENGINES", n + 1)
    assert measure.layout_sample(engines, v, full) is None
    monkeypatch.setattr(measure, "SAMPLE_LAYOUT_ENGINES", n)
    monkeypatch.setattr(measure, "LAYOUT_WINDOW", 20)
    s = measure.layout_sample(engines, v, full)
    start = (n - 20) // 2
    assert s.names == [v.plan.branches[i].name for i in v.plan.launch_order[start:start + 20]] and s.of == n
    assert s.boundaries == measure._nhwc_boundaries(engines.backend, s.current.plan) > 0
    assert s.full is full and s.variants() == [s.current, s.alternative]
    assert s.current.internal_nhwc and not s.alternative.internal_nhwc
    assert s.alternative.plan is s.current.plan and s.current.options is v.options
    monkeypatch.setattr(measure, "LAYOUT_WINDOW", 1)  # one engine: no boundary inside
    assert measure.layout_sample(engines, v, full) is None


@pytest.mark.parametrize("contiguous", [1.10, 1.02])
def test_a_boundary_layout_round_lost_widely_on_its_window_compiles_no_whole_plan(monkeypatch, tmp_path, contiguous):
    """The input's "boundary layout" round on a plan of many engines is queued as its window: the window's two
    layouts are compiled with the input and timed together, and the whole plan with contiguous boundaries is
    queued as spare work only.  Contiguous boundaries slower on the window by more than
    ``LAYOUT_SAMPLE_DECIDES_BEYOND`` decide the round for channels-last (carried to a rewritten plan), and the
    whole plan's rival is dropped; closer, that rival is hastened and raced on the whole plan, the window's times
    kept beside."""
    from dataclasses import replace

    from parastream.pipeline import measure

    engines, v, _ = _nasnet_engines(tmp_path)
    full = replace(v, internal_nhwc=False)
    monkeypatch.setattr(measure, "SAMPLE_LAYOUT_ENGINES", 2)
    monkeypatch.setattr(measure, "LAYOUT_WINDOW", 20)

    def ms(la):  # the window 0.5 ms with channels-last boundaries, the whole plan 1 ms; contiguous that much slower
        return (1.0 if la.plan is v.plan else 0.5) * (1.0 if la.internal_nhwc else contiguous)

    m, compiled, _, orders, timings = _prepared_measurer(monkeypatch, engines, v, [("boundary layout", full)], ms)
    ((_, sample, _),) = m.early["todo"]
    assert isinstance(sample, measure.LayoutSample)
    assert compiled[1] == sample.variants() and orders[:2] == ["search", "search"]  # the input, then the window
    at = next(i for i, batch in enumerate(compiled) if full in batch)
    assert compiled[at] == [full] and orders[at] == "spare" and sample.full_keys  # the whole plan's, as spare work
    m.measure(engines.loaded.model)
    m.time_ready(wait=True)
    # the window: a timing of both, and, within 15%, one confirmation that agrees (``measure.confirmed_round``)
    assert timings[1] == timings[2] == ["channels-last boundaries", "contiguous boundaries"]
    ((r),) = m.early["rounds"]
    assert r["choice"] == "boundary layout" and r["won"] == "channels-last boundaries"
    assert r["sample"]["engines"] == sample.names
    assert r["sample"]["timed_ms"]["contiguous boundaries"] == pytest.approx(0.5 * contiguous)
    assert r["sample"]["confirmed_ms"] == [{k: pytest.approx(t) for k, t in r["sample"]["timed_ms"].items()}]
    if contiguous > 1 + measure.LAYOUT_SAMPLE_DECIDES_BEYOND:
        assert r["decided_on_sample"] and "window" in r["timed"]
        assert m.backend.dropped == [sample.full_keys] and not m.backend.hastened
        assert len(timings) == 3  # the whole plan's rival never loaded
        assert measure.carried_rounds([r])  # taken for a rewritten plan, whatever the window's margin
    else:
        assert not r.get("decided_on_sample") and m.backend.hastened == [sample.full_keys] and not m.backend.dropped
        assert r["timed_ms"]["contiguous boundaries"] == pytest.approx(contiguous)  # raced on the whole plan
        assert not measure.carried_rounds([r])
    m.close()


def test_a_window_that_cannot_be_timed_leaves_its_round_to_the_engines_stage_and_says_why(monkeypatch, tmp_path):
    """A layout window whose timing fails stops the input's rounds in the search: what the search hands the build
    is partial (the build times the round after the search, on the whole plan) and says why."""
    from dataclasses import replace

    from parastream.pipeline import measure

    engines, v, _ = _nasnet_engines(tmp_path)
    full = replace(v, internal_nhwc=False)
    monkeypatch.setattr(measure, "SAMPLE_LAYOUT_ENGINES", 2)
    monkeypatch.setattr(measure, "LAYOUT_WINDOW", 20)

    def ms(la):
        if la.plan is not v.plan:
            raise RuntimeError("the window's graph would not capture")
        return 1.0

    m, *_ = _prepared_measurer(monkeypatch, engines, v, [("boundary layout", full)], ms)
    m.measure(engines.loaded.model)
    got = m.alternatives_timed()
    assert got is None or got["partial"]  # (None: no round timed; the build times them all after the search)
    assert "boundary layout (sampled): RuntimeError: the window's graph would not capture" in m.early["stopped"]
    m.early["rounds"].append({"choice": "streams"})  # a round timed before it: the search hands on the reason
    got = m.alternatives_timed()
    assert got["partial"] and got["stopped"] == m.early["stopped"]
    m.close()


@pytest.mark.parametrize("contiguous", [1.10, 1.02])
def test_the_engines_stage_times_the_boundary_layout_round_on_the_window_its_rivals_queued(monkeypatch, tmp_path,
                                                                                         contiguous):
    """Where the search timed none of the rounds, the engines stage queues the "boundary layout" round's window
    with the rivals (the whole plan's rival as spare work) and times the round on it first: decided there, the
    whole plan's rival is dropped and never loaded; left open, it is hastened and raced, the window's times kept."""
    from dataclasses import replace

    import numpy as np

    import parastream.launcher as launcher_pkg
    import parastream.launcher.gpu as gpu_mod
    from parastream.pipeline import bench, measure

    engines, v, _ = _nasnet_engines(tmp_path)
    v = replace(v, options=replace(v.options, conv_kernels="cudnn", fuse_conv_relu=False))
    full = replace(v, internal_nhwc=False)
    monkeypatch.setattr(measure, "SAMPLE_LAYOUT_ENGINES", 2)
    monkeypatch.setattr(measure, "LAYOUT_WINDOW", 20)
    queued, loaded, hastened, dropped = [], [], [], []
    monkeypatch.setattr(engines, "precompile", lambda variants, background, cancellable, order="auto", label="":
                        queued.append((order, list(variants)))
                        or {"jobs": len(variants), "background": True,
                            "keys": [[f"k{len(queued)}.{i}"] for i, _ in enumerate(variants)]})
    monkeypatch.setattr(engines, "launcher", lambda var: loaded.append(_Launcher(var)) or loaded[-1])
    monkeypatch.setattr(launcher_pkg, "cuda_device_count", lambda: 1)
    monkeypatch.setattr(gpu_mod, "GpuLauncher", lambda bundle, **kw: _Launcher(v))  # the bundle as written
    monkeypatch.setattr(measure, "streams_against_own_engines",
                        lambda la, plan, **kw: {"decided": True, "plan_ms": 1.0, "serial_ms": 2.0})
    monkeypatch.setattr(measure, "streams_round_decided", lambda serial, plan: {"choice": "streams", "won": "plan"})
    monkeypatch.setattr(bench, "measure", lambda launchers, **kw: {
        k: np.full(10, (1.0 if la.plan is v.plan else 0.5) * (1.0 if la.internal_nhwc else contiguous))
        for k, la in launchers.items()})
    monkeypatch.setattr(engines.backend, "hasten", lambda keys: hastened.append(list(keys)) or 0)
    monkeypatch.setattr(engines.backend, "drop", lambda keys: dropped.append(list(keys)) or 0)
    rivals = measure.QueuedRivals(engines)
    rivals.queue(v, set(), [("boundary layout", full)], [])
    window = rivals.window
    assert isinstance(window, measure.LayoutSample) and window.full is full
    assert queued[0] == ("auto", window.variants()) and queued[1] == ("spare", [full])
    got = measure.time_alternatives(engines, "bundle", v, runs=5, rivals=rivals)
    r = next(x for x in got["rounds"] if x["choice"] == "boundary layout")
    assert r["sample"]["timed_ms"]["contiguous boundaries"] == pytest.approx(0.5 * contiguous)
    whole_rival_loaded = any(la.plan is v.plan and not la.internal_nhwc for la in loaded)
    if contiguous > 1 + measure.LAYOUT_SAMPLE_DECIDES_BEYOND:
        assert r["decided_on_sample"] and got["internal_nhwc"] and not whole_rival_loaded
        assert window.full_keys in dropped and window.full_keys not in hastened
    else:
        assert not r.get("decided_on_sample") and whole_rival_loaded and window.full_keys in hastened
        assert r["timed_ms"]["contiguous boundaries"] == pytest.approx(contiguous)


def _prepared_measurer(monkeypatch, engines, v, alternatives: list, ms):
    """A GpuMeasurer of ``v`` over stand-in engines whose compiles are done at once: the input's rounds race
    ``alternatives`` ((round, variant) as ``alternative_variants`` gives them), a launcher replays in ``ms(it)``
    ms.  Returns it prepared, and the batches compiled, the launchers loaded, the compiles' orders and the
    launchers of each timing."""
    import numpy as np

    from parastream.pipeline import bench, measure
    from parastream.pipeline.measure import GpuMeasurer

    compiled, loaded, orders, timings = [], [], [], []
    monkeypatch.setattr(engines, "precompile", lambda variants, background, cancellable, order="auto", label="": orders.append(order)
                        or compiled.append(list(variants))
                        or {"jobs": len(variants), "background": True, "keys": [[f"k{len(compiled)}.{i}"] for i, _ in enumerate(variants)]})
    monkeypatch.setattr(engines, "launcher", lambda var: loaded.append(_Launcher(var)) or loaded[-1])
    monkeypatch.setattr(measure, "alternative_variants", lambda e, var: list(alternatives))
    monkeypatch.setattr(measure, "speculative_by_round", lambda e, var, decided=(): [])
    monkeypatch.setattr(bench, "measure", lambda launchers, **kw: timings.append(list(launchers))
                        or {k: np.full(10, ms(la)) for k, la in launchers.items()})
    hastened, dropped = [], []
    engines.backend = type("B", (), {"background_compiles": True,
                                     "hasten": staticmethod(lambda keys: hastened.append(list(keys)) or 0),
                                     "drop": staticmethod(lambda keys: dropped.append(list(keys)) or 0),
                                     "hastened": hastened, "dropped": dropped,
                                     "compiling": staticmethod(lambda keys: 0),
                                     "cancel_precompile": staticmethod(lambda: 0), "name": "torch",
                                     "suffix": engines.backend.suffix,
                                     "supports_internal_nhwc": engines.backend.supports_internal_nhwc,
                                     "supports_channel_views": engines.backend.supports_channel_views})()
    m = GpuMeasurer(engines, v.options, engines.loaded, streams=None, max_streams=4, budget_s=60.0)
    m.variant_of = lambda model: v
    m.prepare([engines.loaded.model])
    return m, compiled, loaded, orders, timings


@pytest.mark.parametrize("inductor,native", [(1.3, 1.3), (1.3, 1.05), (1.05, 1.3)])
def test_depthwise_rounds_lost_widely_on_their_sample_compile_no_whole_plan(monkeypatch, tmp_path, inductor, native):
    """The input's depthwise rounds on a plan of many such engines are queued as one sample: the sample's engines
    (as the plan has them, with Inductor's kernels, with torch's own), not the plan's alternatives, are compiled
    with the input, and timed together in one timing.  A round whose kernels are slower on the sample by more
    than ``SAMPLE_DECIDES_BEYOND`` is decided for the plan as it is, its whole plan's alternative never
    compiled; the first round left open compiles that alternative then and races it, the sample's times kept
    beside, and a later round left open races its own whole plan's alternative in its turn."""
    from parastream.pipeline import measure

    engines, v, alt = _nasnet_engines(tmp_path)
    alternatives = _depthwise_alternatives(v, alt)
    monkeypatch.setattr(measure, "SAMPLE_DEPTHWISE_ENGINES", 2)
    slower = {"inductor": inductor, "native": native}

    def ms(la):  # the sample 0.5 ms as the plan has it, the whole plan 1 ms; each round's kernels that much slower
        whole = la.plan is v.plan
        return (1.0 if whole else 0.5) * slower.get(la.options.conv_kernels, 1.0)

    m, compiled, _, orders, timings = _prepared_measurer(monkeypatch, engines, v, list(alternatives.items()), ms)
    (_, sample, _), (_, second, _) = m.early["todo"]
    assert isinstance(sample, measure.DepthwiseSample) and isinstance(second, measure.SampledRound)
    assert compiled[1] == sample.variants() and not any(a in batch for batch in compiled for a in alternatives.values())
    assert orders[:2] == ["search", "search"]  # the input, then its sample, ahead of the search's candidates
    m.measure(engines.loaded.model)  # the reference, then the rounds whose engines are in
    m.time_ready(wait=True)
    assert timings[1] == ["depthwise convolutions as cuDNN calls", "depthwise convolutions as Inductor kernels",
                          "depthwise convolutions as torch's own kernel"]  # the sample: one timing of three
    rounds = {r["choice"]: r for r in m.early["rounds"]}
    assert set(rounds) == {"depthwise convolutions", "depthwise kernel"}
    r = rounds["depthwise convolutions"]
    assert r["sample"]["engines"] == sample.names
    assert r["sample"]["timed_ms"]["depthwise convolutions as Inductor kernels"] == pytest.approx(0.5 * inductor)
    whole = {what: any(a in batch for batch in compiled) for what, a in alternatives.items()}
    wide = 1 + measure.SAMPLE_DECIDES_BEYOND
    if inductor > wide:
        assert not whole["depthwise convolutions"] and "one after another" in r["timed"]
        assert r["won"] == "depthwise convolutions as cuDNN calls" and measure.carried_rounds([r])
    else:
        assert whole["depthwise convolutions"] and r["timed_ms"]["depthwise convolutions as Inductor kernels"] == pytest.approx(inductor)
    k = rounds["depthwise kernel"]
    if inductor > wide and native > wide:
        assert not whole["depthwise kernel"] and k["sample"] is r["sample"]
        assert k["timed_ms"] == {"depthwise convolutions as the round before chose": pytest.approx(0.5),
                                 "depthwise convolutions as torch's own kernel": pytest.approx(0.5 * native)}
    else:
        assert whole["depthwise kernel"] and k["timed_ms"]["depthwise convolutions as torch's own kernel"] == pytest.approx(native)
        assert (k.get("sample") is not None) == (inductor > wide)  # the sample that left it open, beside
    m.close()


def _classifier_engines(tmp_path, model=None):
    """Engines and the plan of a small CNN with a classifier head (its Gemm a Linear of one row), fp16 on a GPU,
    and the "GEMM epilogue" round's alternative (the whole plan with the epilogue off)."""
    from dataclasses import replace

    import onnx
    from graphs import classifier_cnn_model

    from parastream.launcher.engines import BuildOptions
    from parastream.launcher.engines import torch as torch_backend
    from parastream.pipeline.build import Engines
    from parastream.pipeline.measure import Variant
    from parastream.pipeline.model_io import load_model

    path = tmp_path / "classifier.onnx"
    onnx.save(model if model is not None else classifier_cnn_model(channels=16, classes=24), path)
    loaded = load_model(path)
    engines = Engines(torch_backend, RooflineCostModel(), loaded, "fp16")
    v = Variant(loaded.model, loaded.graph, engines.plan(loaded.graph, None, 4),
                BuildOptions(precision="fp16", device="cuda", conv_kernels="auto"))
    return engines, v, replace(v, options=replace(v.options, fuse_gemm_epilogue=False))


def test_a_gemm_round_on_linears_of_one_row_is_sampled_on_those_nodes_alone(tmp_path):
    """``gemm_sample``: where the round's only nodes are Linears of one row, the sample is those nodes extracted
    as engines of their own, side by side, as the plan compiles them and with the epilogue off; ONNX Runtime runs
    it to the Gemm's own result.  Not sampled: a model whose matmul-bias-activation nodes the round changes too
    (a rewrite's), or one with no Linear of one row."""
    import onnx
    from graphs import ort_reference

    from parastream.launcher.engines.onnx_torch import one_row_linears
    from parastream.pipeline import measure
    from parastream.core import fused_ops

    engines, v, full = _classifier_engines(tmp_path)
    s = measure.gemm_sample(engines, v, full)
    assert s is not None and s.names == ["fc"] and s.full is full
    assert [b.nodes for b in s.current.plan.branches] == [["fc"]] and s.current.plan.num_streams == 1
    assert s.current.options is v.options and s.alternative.options is full.options
    assert s.alternative.plan is s.current.plan and s.variants() == [s.current, s.alternative]
    assert one_row_linears(s.current.model) == {0}  # compiled as a Linear of one row, both ways
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 3, 8, 8)).astype(np.float32)
    probe = onnx.ModelProto()  # the model with the Gemm's input an output too
    probe.CopyFrom(v.model)
    probe.graph.output.extend(vi for vi in v.model.graph.value_info if vi.name == "flat")
    got = ort_reference(probe, {"input": x})
    alone = ort_reference(s.current.model, {"flat": got["flat"]})
    np.testing.assert_allclose(alone["logits"], got["logits"], rtol=1e-6, atol=1e-6)

    # must not sample: a fused matmul-bias-activation node besides (the round changes it too)
    fused = onnx.ModelProto()
    fused.CopyFrom(v.model)
    fused.graph.node.append(onnx.helper.make_node(fused_ops.GEMM_ACTIVATION, ["flat", "fc_w", "fc_b"], ["unused"],
                                                  domain=fused_ops.DOMAIN, name="fused"))
    assert measure.gemm_sample(engines, measure.Variant(fused, v.graph, v.plan, v.options), full) is None
    # nor a model without a Linear of one row
    engines2, v2, _ = _nasnet_engines(tmp_path)
    assert not one_row_linears(v2.model) and measure.gemm_sample(engines2, v2, v2) is None


def test_a_head_of_two_linears_is_sampled_as_two_engines_each_reading_what_it_reads_in_the_model(tmp_path):
    """A head of two Linears of one row with an activation between (MobileNet-V3-Small's: Gemm, HardSwish, Gemm):
    the sample holds both, each an engine of its own in the model's order, the second reading the activation's
    output as an input of the sample; ONNX Runtime runs each to the model's own values."""
    import onnx
    from graphs import classifier_cnn_model, ort_reference
    from onnx import helper, numpy_helper

    from parastream.pipeline import measure

    m = classifier_cnn_model(channels=16, classes=24)
    rng = np.random.default_rng(1)
    m.graph.node.extend([helper.make_node("HardSwish", ["logits"], ["act"], name="act"),
                         helper.make_node("Gemm", ["act", "fc2_w", "fc2_b"], ["out"], name="fc2", transB=1)])
    m.graph.initializer.extend([numpy_helper.from_array(rng.standard_normal((7, 24)).astype(np.float32), "fc2_w"),
                                numpy_helper.from_array(rng.standard_normal(7).astype(np.float32), "fc2_b")])
    m.graph.output[0].CopyFrom(helper.make_tensor_value_info("out", onnx.TensorProto.FLOAT, [1, 7]))
    engines, v, full = _classifier_engines(tmp_path, m)
    s = measure.gemm_sample(engines, v, full)
    assert s.names == ["fc", "fc2"] and [b.nodes for b in s.current.plan.branches] == [["fc"], ["fc2"]]
    assert sorted(i.name for i in s.current.model.graph.input if i.name not in
                  {t.name for t in s.current.model.graph.initializer}) == ["act", "flat"]
    x = np.random.default_rng(0).standard_normal((1, 3, 8, 8)).astype(np.float32)
    probe = onnx.ModelProto()  # the model with the Linears' inputs and the first one's output as outputs too
    probe.CopyFrom(v.model)
    probe.graph.output.extend(vi for vi in v.model.graph.value_info if vi.name in ("flat", "act", "logits"))
    got = ort_reference(probe, {"input": x})
    alone = ort_reference(s.current.model, {"flat": got["flat"], "act": got["act"]})
    for name in ("logits", "out"):
        np.testing.assert_allclose(alone[name], got[name], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("saved", [0.004, -0.002, 0.02])
def test_a_sampled_gemm_round_is_decided_on_its_sample_by_the_round_s_share_of_the_plan(monkeypatch, tmp_path, saved):
    """The input's "GEMM epilogue" round over Linears of one row: their sample compiled with the input (ahead of
    the search's candidates), the whole plan's alternative with the input's alternatives, and the round's
    speculative rivals queued as spare.  Timed as soon as the reference is: the
    alternative is kept only where it saves more than the round's ``PREFER_CURRENT_WITHIN`` share of the plan's
    time; kept, the plan's form drops the whole plan's alternative and those spare rivals where not started, and
    the alternative winning hastens them.  report.json's round gives the plan's time and that time less the
    saving, the sample's times beside."""
    from parastream.pipeline import bench, measure
    from parastream.pipeline.measure import GpuMeasurer

    engines, v, full = _classifier_engines(tmp_path)
    monkeypatch.setattr(measure, "gemm_decided_first", lambda plan: False)  # as in a plan of several engines
    other_round = replace_options(v, fuse_conv_relu=False)
    compiled, orders, labels, timings, dropped, hastened = [], [], [], [], [], []

    def precompile(variants, background, cancellable, order="auto", label=""):
        compiled.append(list(variants)), orders.append(order), labels.append(label)
        return {"jobs": len(variants), "background": True,
                "keys": [[f"k{len(compiled)}.{i}"] for i, _ in enumerate(variants)]}

    monkeypatch.setattr(engines, "precompile", precompile)
    monkeypatch.setattr(engines, "launcher", lambda var: _Launcher(var))
    monkeypatch.setattr(measure, "alternative_variants",
                        lambda e, var: [("GEMM epilogue", full), ("conv+ReLU", other_round)])
    spec_gemm, spec_conv = replace_options(full, fuse_conv_relu=False), replace_options(other_round, conv_kernels="native")
    monkeypatch.setattr(measure, "speculative_by_round",
                        lambda e, var, decided=(): [("GEMM epilogue", [spec_gemm]), ("conv+ReLU", [spec_conv])])

    def ms(la):  # the whole plan 1 ms; the sample 0.013 ms with the epilogue, ``saved`` ms less without it
        if la.plan is v.plan:
            return 1.0
        return 0.013 - (saved if not la.options.fuse_gemm_epilogue else 0.0)

    monkeypatch.setattr(bench, "measure", lambda launchers, **kw: timings.append(list(launchers))
                        or {k: np.full(10, ms(la)) for k, la in launchers.items()})
    engines.backend = type("B", (), {"background_compiles": True, "name": "torch", "suffix": engines.backend.suffix,
                                     "hasten": staticmethod(lambda keys: hastened.append(list(keys)) or 0),
                                     "drop": staticmethod(lambda keys: dropped.append(list(keys)) or 0),
                                     "compiling": staticmethod(lambda keys: 0),
                                     "cancel_precompile": staticmethod(lambda: 0)})()
    m = GpuMeasurer(engines, v.options, engines.loaded, streams=None, max_streams=4, budget_s=60.0)
    m.variant_of = lambda model: v
    m.prepare([engines.loaded.model])
    (what, sample, sample_keys), (_, conv, _) = m.early["todo"]
    assert what == "GEMM epilogue" and isinstance(sample, measure.GemmSample) and conv is other_round
    assert compiled[1] == sample.variants() and orders[1] == "search"  # with the input, ahead of the candidates
    assert compiled[2] == [full, other_round] and sample.full_keys == ["k3.0"]
    assert sample_keys == ["k2.0", "k2.1"]
    assert [c for c, lb in zip(compiled, labels) if lb == "alternatives of alternatives"] == [[spec_gemm], [spec_conv]]
    spare = m.early["spare"]["GEMM epilogue"]
    m.measure(engines.loaded.model)  # the reference, then the rounds whose engines are in
    m.time_ready(wait=True)
    labels_ = measure.round_labels("GEMM epilogue", v.plan)
    assert timings[1] == list(labels_)  # the sample: its two forms in one timing
    r = next(r for r in m.early["rounds"] if r["choice"] == "GEMM epilogue")
    assert r["timed_ms"][labels_[0]] == pytest.approx(1.0) and r["timed_ms"][labels_[1]] == pytest.approx(1.0 - saved)
    assert r["sample"] == {"nodes": ["fc"], "timed_ms": {labels_[0]: 0.013, labels_[1]: round(0.013 - saved, 4)}}
    assert "one row alone" in r["timed"] and not measure.carried_rounds([r])  # a rewritten plan times it again
    wide = dict(r, timed_ms={k: t * (1 + 2 * i) for i, (k, t) in enumerate(r["timed_ms"].items())})
    assert not measure.carried_rounds([wide])  # by any margin: a rewrite's fused nodes are not in its sample
    kept = saved <= measure.PREFER_CURRENT_WITHIN["GEMM epilogue"] * 1.0
    assert r["won"] == labels_[0 if kept else 1]
    if kept:
        assert dropped[0] == ["k3.0", *spare] and not m.early.get("flips")
        assert any(x["choice"] == "conv+ReLU" for x in m.early["rounds"])  # the later rounds race on as before
    else:
        assert not dropped and m.early["flips"] == ["GEMM epilogue"] and spare in hastened
    m.close()


def _prepared_on_quiet_backend(engines, v):
    """A GpuMeasurer of ``v`` prepared over a stand-in backend that compiles in the background, has nothing in
    flight and hastens or drops nothing."""
    from parastream.pipeline.measure import GpuMeasurer

    engines.backend = type("B", (), {"background_compiles": True, "name": "torch", "suffix": engines.backend.suffix,
                                     "hasten": staticmethod(lambda keys: 0), "drop": staticmethod(lambda keys: 0),
                                     "compiling": staticmethod(lambda keys: 0),
                                     "cancel_precompile": staticmethod(lambda: 0)})()
    m = GpuMeasurer(engines, v.options, engines.loaded, streams=None, max_streams=4, budget_s=60.0)
    m.variant_of = lambda model: v
    m.prepare([engines.loaded.model])
    return m


@pytest.mark.parametrize("saved", [0.0005, -0.002, 0.004])
def test_a_one_engine_plan_s_gemm_round_is_decided_on_its_sample_before_any_other_rival_is_queued(
        monkeypatch, tmp_path, saved):
    """A one-engine plan's "GEMM epilogue" round over its Linears of one row is decided as soon as its sample is
    compiled, before the measurer has a reference: the alternative kept only where the sample with the epilogue
    runs slower than it by more than ``GEMM_SAMPLE_DECIDES_BEYOND``.  Kept, the input's other rounds are queued and raced as before, and
    neither the round's whole-plan alternative nor the rivals of that form are compiled; gone to the alternative,
    that form is compiled with its own rounds' rivals, its next level queued as spare, nothing of the input's form,
    and the rounds are left to after the search (raced on that form)."""
    from parastream.pipeline import bench, measure

    engines, v, full = _classifier_engines(tmp_path)
    assert len(v.plan.branches) == 1 and measure.gemm_decided_first(v.plan)
    conv_of = {id(v): replace_options(v, fuse_conv_relu=False), id(full): replace_options(full, fuse_conv_relu=False)}
    spec = {id(v): [replace_options(v, conv_kernels="native")], id(full): [replace_options(full, conv_kernels="native")]}
    compiled, orders, labels, timings, spare_of = [], [], [], [], []

    def precompile(variants, background, cancellable, order="auto", label=""):
        compiled.append(list(variants)), orders.append(order), labels.append(label)
        return {"jobs": len(variants), "background": True,
                "keys": [[f"k{len(compiled)}.{i}"] for i, _ in enumerate(variants)]}

    def alternatives(e, var):
        gemm = [("GEMM epilogue", full)] if var.options.fuse_gemm_epilogue else []
        return gemm + [("conv+ReLU", conv_of[id(var)])]

    def speculative(e, var, decided=()):
        spare_of.append((var, set(decided)))
        gemm = [("GEMM epilogue", [conv_of[id(full)]])] if "GEMM epilogue" not in decided and var is v else []
        return gemm + [("conv+ReLU", spec[id(var)])]

    monkeypatch.setattr(engines, "precompile", precompile)
    monkeypatch.setattr(engines, "launcher", lambda var: _Launcher(var))
    monkeypatch.setattr(measure, "alternative_variants", alternatives)
    monkeypatch.setattr(measure, "speculative_by_round", speculative)
    def ms(la):  # the sample 0.013 ms with the epilogue, ``saved`` ms less without it
        return 1.0 if la.plan is v.plan else 0.013 - (saved if not la.options.fuse_gemm_epilogue else 0.0)

    monkeypatch.setattr(bench, "measure", lambda launchers, **kw: timings.append(list(launchers))
                        or {k: np.full(10, ms(la)) for k, la in launchers.items()})
    m = _prepared_on_quiet_backend(engines, v)
    labels_ = measure.round_labels("GEMM epilogue", v.plan)
    assert m.reference is None and timings[0] == list(labels_)  # timed before the input's plan was
    assert compiled[0] == [v] and labels[1] == "the rounds' samples" and orders[1] == "search"
    (r,) = m.early["rounds"]
    assert r["choice"] == "GEMM epilogue" and r["decided_first"] and r["sample"]["nodes"] == ["fc"]
    assert r["timed_ms"] == {labels_[0]: pytest.approx(0.013), labels_[1]: pytest.approx(0.013 - saved)}
    kept = 0.013 <= (0.013 - saved) * (1 + measure.GEMM_SAMPLE_DECIDES_BEYOND)
    assert r["won"] == labels_[0 if kept else 1]
    flat = [x for batch in compiled for x in batch]
    if kept:
        assert full not in flat and conv_of[id(full)] not in flat  # nothing of the alternative's form
        assert compiled[2] == [conv_of[id(v)]] and spare_of[-1] == (v, {"GEMM epilogue"})
        assert [w for w, _, _ in m.early["todo"]] == ["conv+ReLU"] and not m.early.get("flips")
        m.measure(engines.loaded.model)  # the reference, then the conv+ReLU round against it
        m.time_ready(wait=True)
        assert [x["choice"] for x in m.early["rounds"]] == ["GEMM epilogue", "conv+ReLU"]
    else:
        assert compiled[2] == [full, conv_of[id(full)]] and conv_of[id(v)] not in flat  # the alternative's form only
        assert compiled[3] == spec[id(full)] and spare_of[-1] == (full, {"GEMM epilogue"})
        assert m.early["todo"] == [] and m.early["flips"] == ["GEMM epilogue"]
        assert m.alternatives_timed()["partial"]  # the conv+ReLU round left to after the search, on that form
    assert (measure.decided_form(v, m.early["rounds"]) is v) == kept  # the form the build queues the rivals of
    assert measure.decided_form(v, [r]).options.fuse_gemm_epilogue is kept
    m.close()


def test_a_gemm_sample_that_fails_leaves_a_one_engine_plan_s_round_to_the_whole_plan(monkeypatch, tmp_path):
    """Must not decide first: the sample fails to load; its round is raced on the whole plan's alternative in its
    turn, against the reference, and the round says why its sample was not used."""
    from parastream.pipeline import bench, measure

    engines, v, full = _classifier_engines(tmp_path)
    compiled = []

    def launcher(var):
        if var.plan is not v.plan:
            raise RuntimeError("sample failed to load")
        return _Launcher(var)

    monkeypatch.setattr(engines, "precompile", lambda variants, background, cancellable, order="auto", label="":
                        compiled.append(list(variants)) or {"jobs": len(variants), "background": True,
                                                             "keys": [[f"k{len(compiled)}.{i}"] for i, _ in enumerate(variants)]})
    monkeypatch.setattr(engines, "launcher", launcher)
    monkeypatch.setattr(measure, "alternative_variants", lambda e, var: [("GEMM epilogue", full)])
    monkeypatch.setattr(measure, "speculative_by_round", lambda e, var, decided=(): [])
    monkeypatch.setattr(bench, "measure", lambda launchers, **kw: {
        k: np.full(10, 1.0 if la.options.fuse_gemm_epilogue else 0.95) for k, la in launchers.items()})
    m = _prepared_on_quiet_backend(engines, v)
    assert not m.early["rounds"] and [(w, a) for w, a, _ in m.early["todo"]] == [("GEMM epilogue", full)]
    assert [full] in compiled
    m.measure(engines.loaded.model)
    m.time_ready(wait=True)
    (r,) = m.early["rounds"]
    assert "sample" not in r and "sample failed to load" in r["sample_error"]
    assert r["won"] == measure.round_labels("GEMM epilogue", v.plan)[1]  # 5% faster on the whole plan
    m.close()


@pytest.mark.parametrize("case", ["faster", "close", "several engines", "epilogue off"])
def test_a_build_whose_search_timed_nothing_decides_a_one_engine_gemm_round_first(monkeypatch, tmp_path, case):
    """``gemm_round_first`` (the engines stage, where the search timed none of the input's rounds): a one-engine
    plan's GEMM round over its head decided on the head's sample, compiled first, by the sample's margin.  Must
    not decide: a plan of several engines, or one built with the epilogue off (no round)."""
    import types
    from dataclasses import replace

    from parastream.pipeline import bench, measure

    engines, v, _ = _classifier_engines(tmp_path)
    if case == "several engines":
        v = replace(v, plan=types.SimpleNamespace(branches=[0, 1], num_streams=1))
    if case == "epilogue off":
        v = replace_options(v, fuse_gemm_epilogue=False)
    compiled = []
    monkeypatch.setattr(measure, "runs_gemm_epilogue", lambda backend: True)
    monkeypatch.setattr(engines, "precompile", lambda variants, background, cancellable, order="auto", label="":
                        compiled.append((list(variants), order)) or {"jobs": len(variants), "background": True})
    monkeypatch.setattr(engines, "launcher", lambda var: _Launcher(var))
    off_ms = 0.005 if case == "faster" else 0.0125
    monkeypatch.setattr(bench, "measure", lambda launchers, **kw: {
        k: np.full(10, 0.013 if la.options.fuse_gemm_epilogue else off_ms) for k, la in launchers.items()})
    r = measure.gemm_round_first(engines, v, runs=10)
    if case in ("several engines", "epilogue off"):
        assert r is None and not compiled
        return
    labels = measure.round_labels("GEMM epilogue", v.plan)
    assert compiled[0][1] == "now" and [x.plan for x in compiled[0][0]] == [compiled[0][0][0].plan] * 2
    assert r["decided_first"] and r["sample"]["nodes"] == ["fc"]
    assert r["won"] == labels[1 if case == "faster" else 0]  # 0.013 against 0.0125: within the sample's 10%


@pytest.mark.parametrize("flips", [True, False])
def test_the_engines_stage_queues_the_rivals_of_the_form_the_gemm_round_decided_first_kept(monkeypatch, tmp_path, flips):
    """``build_engines`` of a one-engine plan whose search timed none of its rounds: the GEMM round is decided
    first on its head (``gemm_round_first``) and handed on as a round timed, and the rounds' rivals, with their
    next level as spare, are queued for the form it kept (``decided_form``), the GEMM round not among them; the
    plan compiled is the input's, as written."""
    import contextlib
    import importlib
    import types

    from parastream.pipeline import bench, measure

    build_mod = importlib.import_module("parastream.pipeline.build")

    engines, v, full = _classifier_engines(tmp_path)
    forms, compiled = [], []
    monkeypatch.setattr(measure, "runs_gemm_epilogue", lambda backend: True)
    monkeypatch.setattr(build_mod, "gpu_present", lambda backend: True)
    monkeypatch.setattr(engines, "precompile", lambda variants, background=False, cancellable=True, order="auto",
                        label="": compiled.append((label, list(variants))) or {
                            "jobs": len(variants), "background": True, "keys": [[f"k{len(compiled)}.{i}"] for i, _ in enumerate(variants)]})
    monkeypatch.setattr(engines, "launcher", lambda var: _Launcher(var))
    monkeypatch.setattr(engines, "write", lambda tmp, shipped, path, **kw: {"written": shipped})
    monkeypatch.setattr(bench, "measure", lambda launchers, **kw: {
        k: np.full(10, 0.013 if la.options.fuse_gemm_epilogue else (0.005 if flips else 0.0129))
        for k, la in launchers.items()})

    def alternatives(e, var):
        forms.append(("rivals", var.options.fuse_gemm_epilogue))
        return ([("GEMM epilogue", replace_options(var, fuse_gemm_epilogue=False))] if var.options.fuse_gemm_epilogue
                else []) + [("conv+ReLU", replace_options(var, fuse_conv_relu=False))]

    def speculative(e, var, decided=()):
        forms.append(("spare", var.options.fuse_gemm_epilogue, frozenset(decided)))
        return [("conv+ReLU", [replace_options(var, fuse_conv_relu=False, conv_kernels="native")])]

    monkeypatch.setattr(build_mod, "alternative_variants", alternatives)
    monkeypatch.setattr(build_mod, "speculative_by_round", speculative)
    monkeypatch.setattr(measure, "alternative_variants", alternatives)
    monkeypatch.setattr(measure, "speculative_by_round", speculative)
    engines.backend = type("B", (), {"background_compiles": True, "gpu": True, "name": "torch",
                                     "suffix": engines.backend.suffix, "hasten": staticmethod(lambda keys: 0),
                                     "drop": staticmethod(lambda keys: 0)})()
    b = types.SimpleNamespace(
        timed=lambda stage: contextlib.nullcontext(), bar=types.SimpleNamespace(step=lambda *a, **k: types.SimpleNamespace(advance=None)),
        timed_alternatives=None, model=v.model, graph=v.graph, plan=v.plan, options=v.options, measured=None,
        cfg=types.SimpleNamespace(measure=True, measure_runs=10), backend=engines.backend, prebuilt=None,
        engines=engines, loaded=types.SimpleNamespace(path=tmp_path / "classifier.onnx"), rivals=None, precompiled=None)
    build_mod.build_engines(b, tmp_path)
    (r,) = b.timed_alternatives["rounds"]
    assert b.timed_alternatives["partial"] and r["choice"] == "GEMM epilogue" and r["decided_first"]
    assert compiled[0][0] == "the rounds' samples"
    assert compiled[1] == ("the plan", [measure.Variant(v.model, v.graph, v.plan, v.options)])  # the input, as written
    assert forms == [("rivals", not flips), ("spare", not flips, frozenset({"GEMM epilogue"}))]
    rivals = [x for label, batch in compiled if label == "the plan's alternatives" for x in batch]
    assert [x.options.fuse_gemm_epilogue for x in rivals] == [not flips] and not rivals[0].options.fuse_conv_relu
    assert b.engines_report["written"].options is v.options
    b.rivals.close()


def test_decided_form_applies_the_rounds_that_went_to_their_alternative(tmp_path):
    """``decided_form``: each fusion or kernel round won by its alternative sets that option; a round the plan's
    form won, the boundary layout (the plan rounds after it race channels-last rivals whatever it chose) or a plan
    round (streams, engine blocks) changes nothing."""
    from parastream.pipeline import measure

    _, v, _ = _classifier_engines(tmp_path)
    alt = lambda what: {"choice": what, "won": measure.round_labels(what, v.plan)[1]}  # noqa: E731
    kept = lambda what: {"choice": what, "won": measure.round_labels(what, v.plan)[0]}  # noqa: E731
    assert measure.decided_form(v, [kept("GEMM epilogue"), kept("conv+ReLU"), alt("engine blocks"),
                                    alt("boundary layout"), alt("streams")]) is v
    got = measure.decided_form(v, [alt("GEMM epilogue"), alt("depthwise convolutions"), kept("depthwise kernel"),
                                   alt("conv+ReLU"), alt("boundary layout"), alt("attention")])
    o = got.options
    assert (o.fuse_gemm_epilogue, o.conv_kernels, o.fuse_conv_relu, o.fuse_attention, got.internal_nhwc) == \
        (False, "inductor", False, False, True)
    assert got.model is v.model and got.plan is v.plan and v.options.fuse_gemm_epilogue


def replace_options(v, **kw):
    from dataclasses import replace

    return replace(v, options=replace(v.options, **kw))


def test_a_sampled_round_left_open_compiles_nothing_for_a_kept_candidate(monkeypatch, tmp_path):
    """The search kept a candidate before the input's sample was timed: ``rounds_timed`` times the sample (its
    engines are compiled), which leaves the first round open, and queues no compile of the whole plan's
    alternatives for rounds it will not race (the candidate's own plan is timed after the search)."""
    import numpy as np

    from parastream.pipeline import bench, measure
    from parastream.pipeline.measure import GpuMeasurer

    engines, v, alt = _nasnet_engines(tmp_path)
    alternatives = _depthwise_alternatives(v, alt)
    monkeypatch.setattr(measure, "SAMPLE_DEPTHWISE_ENGINES", 2)
    compiled, busy = [], [1]
    monkeypatch.setattr(engines, "precompile", lambda variants, background, cancellable, order="auto", label="": compiled.append(list(variants))
                        or {"jobs": len(variants), "background": True, "keys": [[f"k{len(compiled)}.{i}"] for i, _ in enumerate(variants)]})
    monkeypatch.setattr(engines, "launcher", lambda var: _Launcher(var))
    monkeypatch.setattr(measure, "alternative_variants", lambda e, var: list(alternatives.items()))
    monkeypatch.setattr(measure, "speculative_by_round", lambda e, var, decided=(): [])
    monkeypatch.setattr(bench, "measure", lambda launchers, **kw: {k: np.full(10, 1.05 if la.options.conv_kernels != "auto" else 1.0)
                                                                   for k, la in launchers.items()})
    engines.backend = type("B", (), {"background_compiles": True, "hasten": staticmethod(lambda keys: 0),
                                     "compiling": staticmethod(lambda keys: busy[0] if keys else 0),
                                     "cancel_precompile": staticmethod(lambda: 0), "name": "torch",
                                     "suffix": engines.backend.suffix})()
    m = GpuMeasurer(engines, v.options, engines.loaded, streams=None, max_streams=4, budget_s=60.0)
    m.variant_of = lambda model: v
    m.prepare([engines.loaded.model])
    m.measure(engines.loaded.model)  # the sample's engines still compiling: not timed yet
    assert not m.early["rounds"]
    busy[0] = 0
    n = len(compiled)
    assert m.rounds_timed() is None  # no round decided: none to carry
    assert len(compiled) == n and "sample" in m.early  # the sample timed, nothing compiled for the open rounds
    assert [type(a).__name__ for _, a, _ in m.early["todo"]] == ["SampledRound", "SampledRound"]
    m.close()


@pytest.mark.parametrize("head_holds_a_conv", [False, True])
def test_a_round_apart_from_the_flipped_one_is_still_raced_against_the_input(monkeypatch, head_holds_a_conv):
    """The input's GEMM-epilogue round goes to its alternative during the search.  The conv+ReLU round changes only
    engines holding a conv+ReLU; where none of them holds a node the GEMM epilogue converts (a classifier head
    apart from the convolutions), its race against the input's plan decides it for the flipped plan too, so it is
    still timed during the search; where one engine holds both, it is left for after the search, as the boundary
    layout (every engine) always is.  Its round says why it was timed against the input."""
    import types

    from parastream.launcher.engines import BuildOptions
    from parastream.pipeline import bench, measure
    from parastream.pipeline.measure import GpuMeasurer

    times = {"gemm off": 0.9, "unfused": 1.2, "contiguous": 1.3, "the input": 1.0}
    monkeypatch.setattr(bench, "measure", lambda launchers, **kw: {
        k: np.full(5, times[la.variant]) for k, la in launchers.items()})
    monkeypatch.setitem(measure.ROUND_APPLIES, "GEMM epilogue", lambda b: "gemm" in b)
    monkeypatch.setitem(measure.ROUND_APPLIES, "conv+ReLU", lambda b: "conv" in b)
    branches = [{"conv"}, {"conv"}, {"gemm", "conv"} if head_holds_a_conv else {"gemm"}]
    loaded = []

    def launcher(v):
        loaded.append(v)
        return types.SimpleNamespace(variant=v, close=lambda: None)

    hastened = []
    engines = types.SimpleNamespace(backend=types.SimpleNamespace(background_compiles=False, compiling=lambda keys: 0,
                                                                  hasten=hastened.append),
                                    launcher=launcher, branch_models=lambda v: branches)
    m = GpuMeasurer(engines, BuildOptions(), types.SimpleNamespace(model=None, graph=None), streams=None,
                    max_streams=4, budget_s=1.0)
    m.reference = (types.SimpleNamespace(variant="the input"), 1.0)
    m.early.update(plan=types.SimpleNamespace(num_streams=1), variant="the input's variant", rounds=[],
                   todo=[("GEMM epilogue", "gemm off", ["a"]), ("conv+ReLU", "unfused", ["b"]),
                         ("boundary layout", "contiguous", ["c"])],
                   spare={"GEMM epilogue": ["gemm off, unfused"], "conv+ReLU": ["unfused, contiguous"]})
    m.time_ready(wait=True)
    assert "GEMM epilogue: the alternative won" in m.early["stopped"] and m.early["flips"] == ["GEMM epilogue"]
    # the later rounds' forms of the flipped round's alternative (queued as spare work) are hastened, no others
    assert hastened == [["gemm off, unfused"]]
    rounds = {r["choice"]: r for r in m.early["rounds"]}
    if head_holds_a_conv:
        assert loaded == ["gemm off"] and set(rounds) == {"GEMM epilogue"}
        assert [t[0] for t in m.early["todo"]] == ["conv+ReLU", "boundary layout"]
    else:
        assert loaded == ["gemm off", "unfused"] and set(rounds) == {"GEMM epilogue", "conv+ReLU"}
        assert rounds["conv+ReLU"]["won"] == "cuDNN fused conv+bias+ReLU"
        assert "after its GEMM epilogue round went to the alternative" in rounds["conv+ReLU"]["timed"]
        assert [t[0] for t in m.early["todo"]] == ["boundary layout"]
    done = m.alternatives_timed()
    assert done["partial"] and [r["choice"] for r in done["rounds"]] == list(rounds)


@pytest.mark.parametrize("serial", [2.0, 1.2])
def test_the_input_s_streams_round_is_timed_against_its_own_engines_before_any_compile(monkeypatch, tmp_path, serial):
    """The input's "streams" round is queued without its rival's compile (the graph on one stream: a whole-model
    compile).  Once the reference is timed, the plan is timed against its own engines on one stream: a lead over
    ``STREAMS_DECIDED_BEYOND`` decides the round and the rival is never compiled; closer, the rival's compile is
    queued then, ahead of what waits (order "now"), and the round races it with the first timing kept beside."""
    import numpy as np

    from parastream.pipeline import bench, measure
    from parastream.pipeline.measure import GpuMeasurer, Variant

    engines, v, _ = _nasnet_engines(tmp_path)
    assert v.plan.num_streams > 1
    one = Variant(v.model, v.graph, engines.one_stream_plan(v.graph, v.plan), v.options)

    def ms(la):  # the plan 1 ms, its own engines on one stream ``serial`` ms, the graph compiled on one stream 1.1
        return serial if getattr(la, "serial", False) else 1.0 if la.plan is v.plan else 1.1

    compiled, urgent = [], []

    def precompile(variants, background, cancellable, **kw):
        compiled.append(list(variants))
        urgent.append(kw.get("order") == "now")
        return {"jobs": len(variants), "background": True, "keys": [[f"k{len(compiled)}.{i}"] for i, _ in enumerate(variants)]}

    def serial_launcher(la):
        s = _Launcher(Variant(la.model, None, la.plan, la.options))
        s.serial = True
        return s

    monkeypatch.setattr(engines, "precompile", precompile)
    monkeypatch.setattr(engines, "launcher", lambda var: _Launcher(var))
    monkeypatch.setattr(measure, "same_engines_on_one_stream", serial_launcher)
    monkeypatch.setattr(measure, "alternative_variants", lambda e, var: [("streams", one)])
    monkeypatch.setattr(measure, "speculative_by_round", lambda e, var, decided=(): [])
    monkeypatch.setattr(bench, "measure", lambda launchers, **kw: {k: np.full(10, ms(la)) for k, la in launchers.items()})
    engines.backend = type("B", (), {"background_compiles": True, "hasten": staticmethod(lambda keys: 0),
                                     "compiling": staticmethod(lambda keys: 0),
                                     "cancel_precompile": staticmethod(lambda: 0), "name": "torch",
                                     "fuses_conv_relu": True, "suffix": engines.backend.suffix})()
    m = GpuMeasurer(engines, v.options, engines.loaded, streams=None, max_streams=4, budget_s=60.0)
    m.variant_of = lambda model: v
    m.prepare([engines.loaded.model])
    assert isinstance(m.early["todo"][0][1], measure.StreamsRival) and not any(one in batch for batch in compiled)
    m.measure(engines.loaded.model)  # the reference, then the plan against its own engines on one stream
    (first,) = m.early["rounds"] or [None]
    m.time_ready(wait=True)
    (r,) = m.early["rounds"]
    assert r["choice"] == "streams" and r["won"] == f"{v.plan.num_streams}-stream plan"
    assert 1.2 < 1 + measure.STREAMS_DECIDED_BEYOND < 2.0  # the two cases take the two ways
    if serial > 1 + measure.STREAMS_DECIDED_BEYOND:
        assert first is r and r["rival"] == measure.SERIAL_LABEL and not any(one in batch for batch in compiled)
        assert m.alternatives_timed()["one_engine"] is False
    else:
        assert compiled[-1] == [one] and urgent[-1] is True  # (compiled at once here: raced with the input)
        assert r["timed_ms"]["one stream"] == pytest.approx(1.1)
        assert r["serial"]["timed_ms"][measure.SERIAL_LABEL] == pytest.approx(serial)
    m.close()


def _lazy_backend(events, waits: bool):
    """A backend stand-in that builds side by side, warms after load and compiles in the background, whose builder
    says whether it would wait for background compiles (``waits``) and records each engine it builds."""
    import types

    from gpu_build_fakes import gpu_backend

    class Builder:
        def __init__(self, options):
            self.options = options

        def waits_for_background(self, items):
            return waits

        def build_all(self, items):
            events.extend(("build", name) for _, name, _ in items)
            return [name.encode() for _, name, _ in items]

        def close(self):
            events.append(("close",))

    return gpu_backend(builds_side_by_side=True, background_compiles=True, warms_after_load=True, Builder=Builder,
                       name="torch", **{"report": lambda: {}})


@pytest.mark.parametrize("waits", [True, False])
def test_a_launcher_loads_each_engine_as_it_is_built_while_the_rest_compile(tmp_path, monkeypatch, waits):
    """Where some engines of a variant are still compiling in the background (the search's input), the launcher is
    made at once and each engine is built (waited for) as the launcher comes to load it, so the engines built so
    far load and warm while the rest compile; else every engine is built before the launcher is made."""
    import types

    import importlib

    import parastream.launcher.gpu as gpu_mod
    from parastream.launcher.engines import BuildOptions
    from parastream.pipeline.build import Engines
    from parastream.pipeline.measure import Variant

    build_mod = importlib.import_module("parastream.pipeline.build")
    events = []
    backend = _lazy_backend(events, waits)
    loaded = _loaded(tmp_path, "small_net")
    engines = Engines(backend, RooflineCostModel(), loaded, "fp16")
    v = Variant(loaded.model, loaded.graph, engines.plan(loaded.graph, None, 4), BuildOptions(precision="fp16", device="cuda"))
    assert len(v.plan.branches) > 2

    def eager(dest, model, graph, plan, backend, options, label, sink=None, **kw):
        b = backend.Builder(options)
        for br in plan.branches:
            sink[br.engine] = b.build_all([(None, br.name, None)])[0]
        b.close()

    def launcher(bundle):
        for br in bundle.plan.branches:
            assert bundle.engine_bytes(br) == br.name.encode()
            events.append(("load", br.name))
        return types.SimpleNamespace(close=lambda: None)

    monkeypatch.setattr(build_mod, "_write_engines", eager)
    monkeypatch.setattr(gpu_mod, "GpuLauncher", launcher)
    la = engines.launcher(v)
    names = [br.name for br in v.plan.branches]
    if waits:  # built one by one as loaded, then the builder closed
        assert events == [e for n in names for e in (("build", n), ("load", n))] + [("close",)]
    else:  # (the builder that asked is closed first)
        assert events == [("close",)] + [("build", n) for n in names] + [("close",)] + [("load", n) for n in names]
    assert la.t_built > 0


def test_the_torch_builder_waits_for_background_compiles_only_where_some_are_in_flight(tmp_path, fake_compiles, monkeypatch):
    """``waits_for_background``: False where a branch is neither compiled nor compiling (``build_all`` compiles it)
    and where every branch is compiled already; True where none needs compiling and some compile in the
    background."""
    from parastream.launcher.engines import BuildOptions
    from parastream.launcher.engines import torch as torch_backend
    from parastream.pipeline.build import Engines, _engine_layouts, branches_of

    loaded = _loaded(tmp_path, "small_net")
    engines = Engines(torch_backend, RooflineCostModel(), loaded, "fp16")
    options = BuildOptions(precision="fp16", device="cuda", compile_workers=1, torch_artifact="inductor")
    plan = engines.plan(loaded.graph, None, 4)
    lay = _engine_layouts(plan, torch_backend, options)
    items = [(br, b.name, lay(b).get("layout")) for br, b in zip(branches_of(loaded.model, loaded.graph, plan, engines.branches), plan.branches)]
    builder = torch_backend.Builder(options)
    assert not builder.waits_for_background(items) and not builder.keys  # nothing in the background: not looked at
    monkeypatch.setitem(torch_backend._INFLIGHT, "another model's branch", object())
    assert not builder.waits_for_background(items) and not fake_compiles  # to compile: build_all compiles them
    keys = [k for k in builder.keys]
    assert keys
    monkeypatch.setitem(torch_backend._INFLIGHT, keys[0], object())  # one compiling in the background, the rest
    monkeypatch.setattr(torch_backend, "cache_get",  # compiled
                        lambda key, cache_dir: (None, "miss") if key == keys[0] else (b"entry", "memory"))
    assert builder.waits_for_background(items)
    monkeypatch.delitem(torch_backend._INFLIGHT, keys[0])
    monkeypatch.setattr(torch_backend, "cache_get", lambda key, cache_dir: (b"entry", "memory"))
    assert not builder.waits_for_background(items)  # all compiled: built at once, nothing to wait for


@pytest.mark.parametrize("decided", [False, True])
def test_the_best_candidate_is_not_timed_as_one_engine_where_the_inputs_streams_won_by_far(monkeypatch, decided):
    """The cost model's best candidate, planned on streams and slower than the input, is timed as one engine for
    the whole model (a compile of it) unless the input's "streams" round was decided against its own engines on one
    stream (its plan faster by more than ``STREAMS_DECIDED_BEYOND``): the log then says why it was not."""
    import types

    from parastream.pipeline.measure import SERIAL_LABEL, Variant

    cand = _fused_model(False, False)
    m, input_model, _ = _timing_measurer(monkeypatch, lambda model, o: 1.0 if model is input_model else 1.02)
    input_model = m.loaded.model
    m.variant_of = lambda model: Variant(model, None, types.SimpleNamespace(num_streams=4, branches=[0]), m.options)
    asked = []
    m._as_one_engine = lambda v, ms: asked.append(ms) or (v, ms)
    m.measure(input_model)
    if decided:
        m.early["rounds"] = [{"choice": "streams", "rival": SERIAL_LABEL, "won": "4-stream plan",
                              "timed": "against the same engines on one stream (nothing compiled): the plan faster by 110%"}]
    assert m.measure(cand) == pytest.approx(1.02e-3)
    assert len(asked) == (0 if decided else 1)
    assert ("one_engine" in m.log[-1]) == decided and "110%" in m.log[-1].get("one_engine", "110%")
    m.close()


@pytest.mark.parametrize("sample_holds_the_fusion", [False, True])
def test_a_fusion_round_won_by_its_alternative_still_lets_the_depthwise_sample_decide(monkeypatch, tmp_path,
                                                                                        sample_holds_the_fusion):
    """The input's GEMM-epilogue round goes to its alternative during the search, which stops the rounds after it
    (they race another form of the plan).  Where the sampled engines hold no node that fusion converts, their code
    is the same either way: the sample is still timed and decides the depthwise rounds, and no whole plan's
    depthwise alternative is compiled.  Where they hold one, the sample is left for after the search."""
    from dataclasses import replace

    from parastream.pipeline import measure

    engines, v, alt = _nasnet_engines(tmp_path)
    alternatives = _depthwise_alternatives(v, alt)
    gemm_off = replace(v, options=replace(v.options, fuse_gemm_epilogue=False))
    monkeypatch.setattr(measure, "SAMPLE_DEPTHWISE_ENGINES", 2)
    if sample_holds_the_fusion:
        monkeypatch.setitem(measure.ROUND_APPLIES, "GEMM epilogue", lambda model: True)

    def ms(la):  # the plan 1 ms, 0.9 with the GEMM epilogue off; the sample 0.5 ms, its other kernels 30% slower
        if la.plan is v.plan:
            return 0.9 if la.options.fuse_gemm_epilogue is False else 1.0
        return 0.5 * (1.3 if la.options.conv_kernels in ("inductor", "native") else 1.0)

    m, compiled, _, _, _ = _prepared_measurer(monkeypatch, engines, v,
                                              [("GEMM epilogue", gemm_off), *alternatives.items()], ms)
    assert [what for what, _, _ in m.early["todo"]][:2] == ["GEMM epilogue", "depthwise convolutions"]
    sample = m.early["todo"][1][1]
    assert isinstance(sample, measure.DepthwiseSample)
    assert not measure.has_gemm_epilogue(sample.current.model)  # (nasnet_cell has no product at all)
    m.measure(engines.loaded.model)
    m.time_ready(wait=True)
    assert "GEMM epilogue: the alternative won" in m.early["stopped"]
    rounds = {r["choice"]: r for r in m.early["rounds"]}
    assert rounds["GEMM epilogue"]["won"] == "GEMM, bias and activation as Inductor's kernels"
    if sample_holds_the_fusion:
        assert set(rounds) == {"GEMM epilogue"}  # the sample's rounds wait for the plan the build goes on with
        assert m.rounds_timed(frozenset())["rounds"] == [rounds["GEMM epilogue"]]  # (nor at the search's end)
    else:
        assert set(rounds) == {"GEMM epilogue", "depthwise convolutions", "depthwise kernel"}
        assert rounds["depthwise convolutions"]["won"] == "depthwise convolutions as cuDNN calls"
        assert rounds["depthwise kernel"]["sample"]["engines"] == sample.names
    assert not any(a in batch for batch in compiled for a in alternatives.values())  # no whole plan's alternative
    done = m.alternatives_timed()
    assert done["partial"] and {r["choice"] for r in done["rounds"]} == set(rounds)
    m.close()


def test_a_cpu_build_with_the_backend_left_to_auto_does_not_import_torch(tmp_path):
    """On a machine where cuda-python sees no GPU, ``--backend auto`` settles on onnxruntime without importing
    torch (~2 s and ~180 MiB of a small model's build), even where torch is installed."""
    import subprocess
    import sys

    from parastream.launcher.cuda import cuda_device_count

    if cuda_device_count() > 0:
        pytest.skip("a GPU is visible: auto takes a GPU backend, which imports torch")
    pytest.importorskip("torch")  # installed, and still not imported
    src = tmp_path / "m.onnx"
    import onnx

    onnx.save(zoo.MODELS["small_net"](), str(src))
    code = ("import sys\nfrom parastream.pipeline.cli import main\n"
            f"sys.argv = ['parastream', 'build', {str(src)!r}, '-o', {str(tmp_path / 'b')!r}]\n"
            "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
            "print('torch' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "False"
    assert (tmp_path / "b" / "manifest.json").is_file()
