"""What a GPU build timed, recorded under --cache-dir for the builds after it (pipeline/timings.py)."""

from __future__ import annotations

import importlib
import json
import types

import numpy as np
import onnx
import pytest
from graphs import residual_stack_model

from parastream.pipeline import build
from parastream.pipeline.timings import (RecordedMeasurer, model_digest, read_timings, timings_path,
                                          write_timings)
from parastream.rewrite import optimize_graph
from parastream.rewrite.search import MeasureBudgetSpent


def test_the_digest_keeps_the_structure_and_leaves_the_weights_out():
    a, b = residual_stack_model(layers=3, seed=0), residual_stack_model(layers=3, seed=1)
    assert any(not np.array_equal(onnx.numpy_helper.to_array(x), onnx.numpy_helper.to_array(y))
               for x, y in zip(a.graph.initializer, b.graph.initializer))
    assert model_digest(a) == model_digest(b)  # other weights: the same timings
    assert model_digest(a) != model_digest(residual_stack_model(layers=4))  # another node count
    assert model_digest(a) != model_digest(residual_stack_model(layers=3, tokens=8))  # other shapes
    c = residual_stack_model(layers=3)
    c.graph.node[3].op_type = "Sigmoid"  # l0/relu
    assert model_digest(a) != model_digest(c)
    d = residual_stack_model(layers=3)  # a scalar-sized float is a constant a rule may match: keyed by value
    d.graph.initializer.append(onnx.numpy_helper.from_array(np.array([0.5], np.float32), "half"))
    e = residual_stack_model(layers=3)
    e.graph.initializer.append(onnx.numpy_helper.from_array(np.array([0.25], np.float32), "half"))
    assert model_digest(d) != model_digest(e)


def test_the_recorded_measurer_gives_the_recorded_times_in_order_and_stops_at_other_rewrites():
    rec = RecordedMeasurer([{"trace": [], "seconds": 2e-3}, {"trace": ["fuse_attention:a"], "seconds": 1e-3}],
                           one_engine={"plan": 1.2, "one engine": 1.0}, source="t.json")
    assert rec.by_trace
    assert rec.measure_trace(()) == 2e-3 and rec.measure_trace(("fuse_attention:a",)) == 1e-3
    with pytest.raises(MeasureBudgetSpent, match="t.json"):
        rec.measure_trace(("fuse_attention:b",))  # past the record
    other = RecordedMeasurer([{"trace": [], "seconds": 2e-3}])
    with pytest.raises(MeasureBudgetSpent):
        other.measure_trace(("merge:x",))  # not the candidate recorded at that place
    assert rec.calls == 2 and other.calls == 0
    assert rec.one_engine_timed(None) == {"plan": 1.2, "one engine": 1.0}


def test_a_record_of_another_format_or_a_broken_file_is_not_read(tmp_path):
    path = timings_path(tmp_path, "k")
    assert read_timings(path) is None
    write_timings(path, {"search": {"measures": []}})
    assert read_timings(path)["search"] == {"measures": []}
    path.write_text("{not json")
    assert read_timings(path) is None
    path.write_text(json.dumps({"format": 999}))
    assert read_timings(path) is None


def _gpu_like_onnxruntime(monkeypatch, time_alternatives):
    """The GPU stage driven on the CPU: onnxruntime's engines under a backend that says it is a GPU backend (and
    compiles repeats once, so that a stack of layers is cut into blocks), with ``time_alternatives`` faked."""
    from parastream.launcher.engines import require_backend

    build_module = importlib.import_module("parastream.pipeline.build")
    real = require_backend("onnxruntime")
    gpu_like = types.SimpleNamespace(**{k: getattr(real, k) for k in dir(real) if not k.startswith("__")})
    gpu_like.gpu, gpu_like.compiles_repeats_once = True, True
    gpu_like.describe_device = lambda: "cuda: a GPU of the test"
    monkeypatch.setattr(build_module, "resolve_backend", lambda name: gpu_like)
    monkeypatch.setattr(build_module, "gpu_present", lambda backend: True)
    monkeypatch.setattr(build_module, "time_alternatives", time_alternatives)


def test_a_rebuild_takes_the_recorded_rounds_and_times_nothing(tmp_path, monkeypatch):
    """The first build times its rounds and records them; a rebuild of the model with other weights takes them (the
    whole-model engine they chose) without timing, and verifies what it ships; --remeasure times them again."""
    timed = []

    def whole_wins(engines, bundle, variant, runs, **rounds_timed):
        timed.append(len(variant.plan.branches))
        return {"one_engine": False, "whole_engine": True, "internal_nhwc": True, "fuse_conv_relu": False,
                "rounds": [{"choice": "engine blocks", "won": "one engine for the whole model"}]}

    _gpu_like_onnxruntime(monkeypatch, whole_wins)
    build_module = importlib.import_module("parastream.pipeline.build")
    checked = []
    real_check = build_module.check_runnable
    monkeypatch.setattr(build_module, "check_runnable",
                        lambda loaded, backend, reference, *a, **kw: checked.append(reference)
                        or real_check(loaded, backend, reference, *a, **kw))
    cache = tmp_path / "cache"
    for i, seed in enumerate((0, 1)):
        onnx.save(residual_stack_model(layers=5, seed=seed), tmp_path / f"m{i}.onnx")
    first = build(tmp_path / "m0.onnx", tmp_path / "b0", backend="onnxruntime", search=False, cache_dir=str(cache))
    assert len(timed) == 1 and timed[0] > 1  # the blocks were timed against the whole engine
    rec = first.report["recorded_timings"]
    assert rec["written"] == rec["file"] and (cache / "timings").is_dir()
    assert read_timings(type(cache)(rec["file"]))["measured_choices"]["whole_engine"]

    again = build(tmp_path / "m1.onnx", tmp_path / "b1", backend="onnxruntime", search=False, cache_dir=str(cache))
    assert len(timed) == 1  # nothing timed
    assert checked == [True, False]  # ONNX Runtime's up-front load of the original: the first build's only
    assert len(again.plan.branches) == 1 and again.report["verification"]["passed"]
    assert again.report["recorded_timings"]["rounds"] == "1 round" and "written" not in again.report["recorded_timings"]
    assert again.report["measured_choices"]["timed"].startswith("recorded by the build of")
    assert again.manifest["options"]["remeasure"] is False

    from rich.console import Console

    from parastream.pipeline.report import print_build_summary

    console = Console(record=True, width=400)
    print_build_summary(again, console)
    assert "timings: took the results of 1 round from " in console.export_text()
    console = Console(record=True, width=400)
    print_build_summary(first, console)
    assert "timings: recorded in " in console.export_text()
    from parastream.pipeline.report import _timings_line

    replayed = {"search": "replayed the recorded build's choice (51 rewrites)", "rounds": "2 rounds", "file": "K.json"}
    assert _timings_line(replayed) == ("timings: replayed the recorded build's choice (51 rewrites) and took the "
                                       "results of 2 rounds from K.json (--remeasure times them again)")

    build(tmp_path / "m1.onnx", tmp_path / "b2", backend="onnxruntime", search=False, cache_dir=str(cache),
          remeasure=True)
    assert len(timed) == 2


def test_recorded_rounds_of_another_plan_are_timed_again(tmp_path, monkeypatch):
    """A record whose rounds were timed on another plan (here: another engine cut) is not taken for this one."""
    timed = []

    def blocks_stay(engines, bundle, variant, runs, **rounds_timed):
        timed.append(1)
        return {"one_engine": False, "whole_engine": False, "internal_nhwc": True, "fuse_conv_relu": False,
                "rounds": [{"choice": "engine blocks", "won": "one engine per repeated block"}]}

    _gpu_like_onnxruntime(monkeypatch, blocks_stay)
    cache = tmp_path / "cache"
    onnx.save(residual_stack_model(layers=5), tmp_path / "m.onnx")
    first = build(tmp_path / "m.onnx", tmp_path / "b0", backend="onnxruntime", search=False, cache_dir=str(cache))
    path = type(cache)(first.report["recorded_timings"]["file"])
    record = read_timings(path)
    write_timings(path, dict(record, plan="another plan's digest"))
    again = build(tmp_path / "m.onnx", tmp_path / "b1", backend="onnxruntime", search=False, cache_dir=str(cache))
    assert timed == [1, 1]
    assert again.report["recorded_timings"]["rounds"].startswith("timed again")
    assert read_timings(path)["plan"] == record["plan"]  # recorded anew, for this plan


@pytest.mark.parametrize("tuned_won", [True, False])
def test_a_tuning_level_is_raced_last_and_a_rebuild_takes_its_round(tmp_path, monkeypatch, tuned_won):
    """At an --opt-level where the backend tunes its kernels, the engines and the rounds are compiled at the level
    below, and the level asked for is raced last on the plan they chose (``race_kernel_tuning``): the tuned
    engines are written and shipped where they won (manifest.json's options say which level shipped); a rebuild
    takes the recorded round and writes its engines once, at that level, racing nothing."""
    from parastream.pipeline import measure

    rounds_at = []

    def blocks_stay(engines, bundle, variant, runs, **rounds_timed):
        rounds_at.append(variant.options.optimization_level)
        return {"one_engine": False, "whole_engine": False, "internal_nhwc": True, "fuse_conv_relu": False,
                "rounds": [{"choice": "engine blocks", "won": "one engine per repeated block"}]}

    _gpu_like_onnxruntime(monkeypatch, blocks_stay)
    build_module = importlib.import_module("parastream.pipeline.build")
    build_module.resolve_backend("onnxruntime").tunes_kernels_from = 4  # (the stand-in; torch's is 4)
    raced, written = [], []

    def race(engines, v, level, *, runs, lock=True):
        raced.append((v.options.optimization_level, level, v.plan))
        labels = measure.round_labels(measure.TUNING_ROUND, v.plan)
        return {"choice": measure.TUNING_ROUND, "level": level, "won": labels[int(tuned_won)]}, tuned_won

    monkeypatch.setattr(build_module, "kernel_tuning_round", race)
    real_write = build_module.Engines.write
    monkeypatch.setattr(build_module.Engines, "write", lambda self, dest, v, label, **kw:
                        written.append(v.options.optimization_level) or real_write(self, dest, v, label, **kw))
    cache = tmp_path / "cache"
    for i in (0, 1):
        onnx.save(residual_stack_model(layers=5, seed=i), tmp_path / f"m{i}.onnx")
    first = build(tmp_path / "m0.onnx", tmp_path / "b0", backend="onnxruntime", search=False, cache_dir=str(cache),
                  optimization_level=4)
    shipped = 4 if tuned_won else 3
    assert rounds_at == [3] and [r[:2] for r in raced] == [(3, 4)] and raced[0][2] == first.plan
    assert written == ([3, 4] if tuned_won else [3])  # the tuned engines written only where they won
    chosen = first.report["measured_choices"]
    assert chosen["optimization_level"] == shipped and chosen["rounds"][-1]["choice"] == "kernel tuning"
    assert first.manifest["options"]["optimization_level"] == shipped and first.report["verification"]["passed"]

    raced.clear(), written.clear(), rounds_at.clear()
    again = build(tmp_path / "m1.onnx", tmp_path / "b1", backend="onnxruntime", search=False, cache_dir=str(cache),
                  optimization_level=4)
    assert raced == [] and rounds_at == [] and written == [shipped]
    assert again.manifest["options"]["optimization_level"] == shipped and again.report["verification"]["passed"]


def test_a_tuned_form_that_fails_to_build_is_not_shipped(tmp_path, monkeypatch):
    _gpu_like_onnxruntime(monkeypatch, lambda *a, **k: None)
    build_module = importlib.import_module("parastream.pipeline.build")
    build_module.resolve_backend("onnxruntime").tunes_kernels_from = 4

    def fails(engines, v, level, *, runs, lock=True):
        raise RuntimeError("autotuning ran out of shared memory")

    monkeypatch.setattr(build_module, "kernel_tuning_round", fails)
    onnx.save(residual_stack_model(layers=3), tmp_path / "m.onnx")
    b = build(tmp_path / "m.onnx", tmp_path / "b", backend="onnxruntime", search=False, optimization_level=5)
    r = b.report["measured_choices"]["rounds"][-1]
    assert r == {"choice": "kernel tuning", "level": 5, "error": "RuntimeError: autotuning ran out of shared memory"}
    assert b.manifest["options"]["optimization_level"] == 3 and b.report["verification"]["passed"]


def test_without_a_cache_dir_nothing_is_recorded(tmp_path, monkeypatch):
    _gpu_like_onnxruntime(monkeypatch, lambda *a, **k: None)
    onnx.save(residual_stack_model(layers=3), tmp_path / "m.onnx")
    bundle = build(tmp_path / "m.onnx", tmp_path / "b", backend="onnxruntime", search=False)
    assert bundle.report["recorded_timings"] is None


def _searched_with_times(tmp_path):
    """The zoo's inception block searched with measured times (any time that differs between candidates and
    favours a rewrite): (loaded model, the search's options, the model kept, the search's report)."""
    from parastream.pipeline.model_io import load_model
    from parastream.pipeline.zoo import write_all
    from parastream.rewrite.cost import RooflineCostModel
    from parastream.rewrite.search import TimedBy

    write_all(tmp_path)
    loaded = load_model(tmp_path / "inception_block.onnx")
    kw = dict(cost_model=RooflineCostModel(), streams=2, top_k=5)
    timed, _, report = optimize_graph(loaded.model, loaded.graph, **kw, measure=TimedBy(
        lambda model: 1e-3 * (1 + len(model.graph.node) % 7) / 7))
    return loaded, kw, timed, report


def test_the_search_replayed_from_a_record_keeps_what_it_kept_when_it_timed(tmp_path):
    """The search asks a recorded measurer for the same candidates (by their rewrites) in the same order, and so
    decides as the timed search did, exporting only the candidate it keeps."""
    loaded, kw, timed, timed_report = _searched_with_times(tmp_path)
    recorded = timed_report["measured_in_order"]
    assert len(recorded) >= 2 and recorded[0]["trace"] == [], timed_report.get("decision")
    replay = RecordedMeasurer(recorded)
    again, _, report = optimize_graph(loaded.model, loaded.graph, measure=replay, **kw)
    assert replay.calls == len(recorded) and report["measured_in_order"] == recorded
    assert [c.get("measured_s") for c in report["candidates"]] == [c.get("measured_s") for c in timed_report["candidates"]]
    assert report["rules_chosen"] == timed_report["rules_chosen"] and model_digest(again) == model_digest(timed)
    assert report["timings"].get("exported", 0) <= 1  # the kept candidate only
    # a record of other rewrites at the second place: the search decides among the input alone
    other = RecordedMeasurer([recorded[0], {"trace": ["no_such_rule:x"], "seconds": 1e-9}])
    kept, _, report = optimize_graph(loaded.model, loaded.graph, measure=other, **kw)
    assert kept is loaded.model and other.calls == 1


def test_a_rebuild_replays_the_kept_candidates_rewrites_instead_of_searching(tmp_path, monkeypatch):
    """With the record's choice (each piece's rewrites of the candidate kept) the search replays those rewrites
    instead of searching: the same model, weights included, nothing measured.  A recorded rewrite that is not
    there falls back to the search, by the recorded times."""
    loaded, kw, timed, timed_report = _searched_with_times(tmp_path)
    pieces = timed_report["chosen_pieces"]
    assert timed is not loaded.model and sum(map(len, pieces)) == len(timed_report["rules_chosen"]) > 0
    recorded = timed_report["measured_in_order"]
    replay = RecordedMeasurer(recorded, replay_pieces=pieces, decision=timed_report["decision"])
    again, _, report = optimize_graph(loaded.model, loaded.graph, measure=replay, **kw)
    assert report["replay"].startswith("replayed") and replay.calls == 0 and report["decided_by"] == "measured"
    assert report["rules_chosen"] == timed_report["rules_chosen"] and report["chosen_pieces"] == pieces
    assert again.SerializeToString(deterministic=True) == timed.SerializeToString(deterministic=True)
    assert report["measured_in_order"] == recorded  # a record written from this report says the same
    # a recorded choice of the input: nothing replayed, the input kept
    kept, _, report = optimize_graph(loaded.model, loaded.graph, **kw,
                                     measure=RecordedMeasurer(recorded, replay_pieces=[[] for _ in pieces]))
    assert kept is loaded.model and report["replay"].startswith("replayed")
    # a rewrite that does not replay: searched, by the recorded times, to the same choice
    broken = [list(t) for t in pieces]
    broken[next(i for i, t in enumerate(broken) if t)].append("no_such_rule:x")
    fallback = RecordedMeasurer(recorded, replay_pieces=broken)
    again, _, report = optimize_graph(loaded.model, loaded.graph, measure=fallback, **kw)
    assert report["replay"].startswith("not replayed") and "no_such_rule:x: no such site" in report["replay"]
    assert fallback.calls == len(recorded) and report["rules_chosen"] == timed_report["rules_chosen"]
    assert model_digest(again) == model_digest(timed)
    # a recorded rewrite whose rule now fails on the new weights: searched, not a failed build
    from parastream.rewrite.rules import ALL_RULES

    first = next(k for t in pieces for k in t)
    rule = next(r for r in ALL_RULES if r.name == first.split(":", 1)[0])
    monkeypatch.setattr(type(rule), "apply", lambda self, graph, site: (_ for _ in ()).throw(ValueError("bad weight")))
    again, _, report = optimize_graph(loaded.model, loaded.graph, measure=RecordedMeasurer(recorded, replay_pieces=pieces), **kw)
    assert "the rewrite failed: ValueError: bad weight" in report["replay"]
    monkeypatch.undo()
    # a record damaged in the cache folder: searched, as without a choice to replay
    for junk in ("pieces", [[1, 2]] * len(pieces), {"a": 1}):
        damaged = RecordedMeasurer(recorded, replay_pieces=junk)
        again, _, report = optimize_graph(loaded.model, loaded.graph, measure=damaged, **kw)
        assert report["replay"].startswith("not replayed") and report["rules_chosen"] == timed_report["rules_chosen"]


@pytest.mark.gpu
@pytest.mark.slow
def test_a_torch_rebuild_on_the_gpu_takes_the_recorded_timings(tmp_path):
    """A real GPU build with the search and its rounds, then the same model with other weights rebuilt from the same
    --cache-dir: the rebuild measures nothing, ships the same plan and choices, and its bundle verifies."""
    cache = str(tmp_path / "cache")
    for i, seed in enumerate((0, 1)):
        onnx.save(residual_stack_model(layers=6, width=64, tokens=32, seed=seed), tmp_path / f"m{i}.onnx")
    kw = dict(backend="torch", precision="fp16", cache_dir=cache, measure_runs=20, search_options={"top_k": 3})
    first = build(tmp_path / "m0.onnx", tmp_path / "b0", **kw)
    assert first.report["recorded_timings"]["written"]
    again = build(tmp_path / "m1.onnx", tmp_path / "b1", **kw)
    taken = again.report["recorded_timings"]
    assert "written" not in taken and again.report["verification"]["passed"]
    assert all("recorded_s" in e for e in again.report["search"].get("measure_log") or [])
    assert again.report["search"]["rules_chosen"] == first.report["search"]["rules_chosen"]
    assert taken["search"].startswith("replayed")  # the kept candidate's rewrites replayed: no search
    assert [(b.stream, b.nodes) for b in again.plan.branches] == [(b.stream, b.nodes) for b in first.plan.branches]
    for k in ("fuse_attention", "fuse_gemm_epilogue", "internal_nhwc", "one_engine", "whole_engine"):
        assert (again.report["measured_choices"] or {}).get(k) == (first.report["measured_choices"] or {}).get(k)
    assert "measure_alternatives" not in again.report["stage_seconds"]


def test_the_key_holds_what_the_timings_depend_on_and_nothing_else():
    from parastream.pipeline.build import BuildConfig
    from parastream.pipeline.timings import timings_key

    gpu = types.SimpleNamespace(describe_device=lambda: "cuda: one GPU")
    versions = {"torch": "2.11.0"}
    key = timings_key(residual_stack_model(layers=3), BuildConfig(precision="fp16"), gpu, versions)
    assert key == timings_key(residual_stack_model(layers=3, seed=7), BuildConfig(precision="fp16"), gpu, versions)
    # where the bundle goes, what is cached where, how many processes compile and how it is checked: no matter
    same = BuildConfig(precision="fp16", cache_dir="/elsewhere", remeasure=True, compile_workers=3, force=True,
                       rtol=1e-2)
    assert timings_key(residual_stack_model(layers=3), same, gpu, versions) == key
    for other in (timings_key(residual_stack_model(layers=3), BuildConfig(precision="fp32"), gpu, versions),
                  timings_key(residual_stack_model(layers=3), BuildConfig(precision="fp16", measure_seconds=5), gpu, versions),
                  timings_key(residual_stack_model(layers=3), BuildConfig(precision="fp16"),
                              types.SimpleNamespace(describe_device=lambda: "cuda: another GPU"), versions),
                  timings_key(residual_stack_model(layers=3), BuildConfig(precision="fp16"), gpu, {"torch": "2.12.0"}),
                  timings_key(residual_stack_model(layers=4), BuildConfig(precision="fp16"), gpu, versions)):
        assert other != key
