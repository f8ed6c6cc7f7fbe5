"""Build time: the work a CPU build no longer does twice leaves the same bundle.

- the manifest a build writes before verifying is listed without digests (verification loads the staging folder
  unchecked); the bundle it ends with is hashed, every digest the file's sha256;
- when the search changes nothing, the schedule planned for its stream count is the build's schedule: the same
  as planning the loaded graph afresh, and exactly what the plan and report record."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

from parastream.launcher.bundle import Bundle, sha256_file
from parastream.pipeline import build
from parastream.pipeline.model_io import load_model
from parastream.rewrite.cost import RooflineCostModel

build_module = importlib.import_module("parastream.pipeline.build")  # the module (the package exports the function)

SMALL_NET = Path(__file__).resolve().parents[2] / "examples" / "models" / "small_net.onnx"


def test_the_built_manifest_is_hashed_and_the_staging_one_is_not(tmp_path, monkeypatch):
    staged = []
    real = build_module.write_manifest

    def spy(out, manifest, **kw):
        real(out, manifest, **kw)
        staged.append(json.loads((Path(out) / "manifest.json").read_text())["files"])

    monkeypatch.setattr(build_module, "write_manifest", spy)
    bundle = build(SMALL_NET, tmp_path / "b", backend="onnxruntime", streams=2)
    assert staged[0] and set(staged[0].values()) == {""}  # listed, not hashed: verification loads it unchecked
    files = json.loads((tmp_path / "b" / "manifest.json").read_text())["files"]
    assert files.keys() == staged[0].keys()
    for rel, digest in files.items():
        assert digest == sha256_file(tmp_path / "b" / rel)
    Bundle.open(bundle.path, check_hashes=True)


def test_an_unchanged_search_reuses_the_schedule_it_planned(tmp_path, monkeypatch):
    calls, handed = [], []
    real = build_module.plan_streams
    monkeypatch.setattr(build_module, "plan_streams", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    real_choice = build_module.choose_cpu_alternative
    monkeypatch.setattr(build_module, "choose_cpu_alternative", lambda *a, **k: handed.append(a[4]) or real_choice(*a, **k))
    bundle = build(SMALL_NET, tmp_path / "b", backend="onnxruntime", search_options={"rules": []})
    assert bundle.report["search"]["rules_chosen"] == []
    assert len(calls) == 1  # planned once, for the search's stream count, and kept
    loaded = load_model(SMALL_NET)
    cost_model = RooflineCostModel(build_module.default_device_profile(build_module.resolve_backend("onnxruntime")))
    fresh, tried = real(loaded.graph, cost_model, None, build_module.BuildConfig().max_streams)
    (sched,) = handed
    assert (sched.num_streams, sched.node_stream, sched.makespan, sched.total_work) == \
        (fresh.num_streams, fresh.node_stream, fresh.makespan, fresh.total_work)
    assert [t["estimated_s"] for t in bundle.report["schedule"]["streams_tried"] if "estimated_s" in t] == \
        [t["estimated_s"] for t in tried]


def test_a_search_that_rewrites_plans_the_rewritten_graph(tmp_path, monkeypatch):
    calls = []
    real = build_module.plan_streams
    monkeypatch.setattr(build_module, "plan_streams", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    bundle = build(SMALL_NET, tmp_path / "b", backend="onnxruntime")
    if bundle.report["search"]["rules_chosen"]:
        assert len(calls) == 2 and calls[0] is not calls[1]
    else:
        assert len(calls) == 1


def test_the_gpu_stage_rebuilds_the_engines_for_the_measured_choice(tmp_path, monkeypatch):
    """``time_gpu_alternatives`` (build_static's GPU stage), driven on the CPU: a backend that says it is a GPU
    backend (onnxruntime's engines under it) and a timing that picks one engine for the whole model.  The stage
    must plan one stream, write the engines again for that plan, record the choice, and verify what it ships."""
    import types

    from parastream.launcher.engines import require_backend

    real = require_backend("onnxruntime")
    gpu_like = types.SimpleNamespace(**{k: getattr(real, k) for k in dir(real) if not k.startswith("__")})
    gpu_like.gpu = True
    monkeypatch.setattr(build_module, "resolve_backend", lambda name: gpu_like)
    timed = []

    def one_engine_wins(engines, bundle, variant, runs, **rounds_timed):
        timed.append((variant.plan.num_streams, len(list((Path(bundle.path) / "engines").iterdir()))))
        assert bundle.plan is variant.plan and not (Path(bundle.path) / "report.json").exists()  # no scratch files
        return {"one_engine": True, "internal_nhwc": True, "fuse_conv_relu": False, "rounds": []}

    monkeypatch.setattr(build_module, "time_alternatives", one_engine_wins)
    bundle = build(SMALL_NET, tmp_path / "b", backend="onnxruntime", streams=2, search=False)
    assert timed == [(2, timed[0][1])] and timed[0][1] > 1  # the plan of two streams was timed
    assert bundle.plan.num_streams == 1
    engines = sorted(p.name for p in (tmp_path / "b" / "engines").iterdir())
    assert len(engines) == len(bundle.plan.branches) < timed[0][1]  # written again, for the one-stream plan
    report = json.loads((tmp_path / "b" / "report.json").read_text())
    assert report["measured_choices"]["one_engine"] and report["schedule"]["streams"] == 1
    assert report["verification"]["passed"] and "measure_alternatives" in report["timings"]
    Bundle.open(bundle.path, check_hashes=True)


def test_a_gpu_build_compiles_its_plan_and_the_alternatives_it_will_time_in_one_batch(tmp_path, monkeypatch):
    """A GPU backend whose engines are compiled for the launcher's layout (torch) gets, before the engines are
    written, one ``precompile`` call holding the plan and every alternative ``time_alternatives`` loads (here:
    contiguous boundaries and one engine for the whole model), so that their compiles share the workers."""
    import types

    from parastream.launcher.engines import require_backend

    real = require_backend("onnxruntime")
    gpu_like = types.SimpleNamespace(**{k: getattr(real, k) for k in dir(real) if not k.startswith("__")})
    gpu_like.gpu = True

    class LayoutBuilder(real.Builder):
        def build(self, branch, name, layout=None):  # compiled for a layout, as torch's builder is
            return super().build(branch, name)

    gpu_like.Builder = LayoutBuilder
    gpu_like.compiles_for_layout = True
    gpu_like.supports_internal_nhwc = True  # channels-last internal boundaries, as torch's: a boundary-layout round
    batches = []
    gpu_like.precompile = lambda b, **kw: batches.append([(builder.options, len(items)) for builder, items in b]) or {"jobs": 0}
    monkeypatch.setattr(build_module, "resolve_backend", lambda name: gpu_like)
    monkeypatch.setattr(build_module, "time_alternatives", lambda *a, **k: None)
    bundle = build(SMALL_NET, tmp_path / "b", backend="onnxruntime", streams=2, search=False)
    assert len(batches) == 1
    (plan_opts, n_plan), (contiguous_opts, n_contiguous), (_, n_one) = batches[0]
    assert n_plan == n_contiguous == len(bundle.plan.branches) > 1 and n_one == 1
    assert json.loads((tmp_path / "b" / "report.json").read_text())["precompiled"] == {"jobs": 0}
    # without measurement nothing is timed, so only the plan's own engines are built (no batch)
    build(SMALL_NET, tmp_path / "c", backend="onnxruntime", streams=2, search=False, measure=False)
    assert len(batches) == 1


def test_a_plans_branches_are_extracted_once_per_build(monkeypatch):
    """``branches_of`` with the build's ``BranchCache``: the build's precompile and its engine writes (and the
    search's prepare and load of a candidate) extract a plan's branches once; a plan of other branches is extracted
    anew; what is kept is bounded; without a cache every call extracts."""
    cache = build_module.BranchCache()
    loaded = load_model(SMALL_NET)

    def plan(streams):
        sched, _ = build_module.plan_streams(loaded.graph, RooflineCostModel(), streams, 8)
        return build_module.make_plan(loaded.graph, sched, backend="onnxruntime", precision="fp32", suffix=".onnx",
                                      inputs=loaded.inputs, outputs=loaded.outputs)

    calls = []
    real = build_module.extract_branch
    monkeypatch.setattr(build_module, "extract_branch", lambda *a: calls.append(1) or real(*a))
    p = plan(2)
    first = build_module.branches_of(loaded.model, loaded.graph, p, cache)
    assert build_module.branches_of(loaded.model, loaded.graph, p, cache) is first and len(calls) == len(p.branches) > 1
    assert build_module.branches_of(loaded.model, loaded.graph, plan(2), cache) is first  # the same branches
    q = plan(1)
    assert build_module.branches_of(loaded.model, loaded.graph, q, cache) is not first
    assert len(calls) == len(p.branches) + len(q.branches) and len(cache.entries) == 2
    small = build_module.BranchCache(max_bytes=0)
    build_module.branches_of(loaded.model, loaded.graph, p, small)
    assert small.entries == []  # over the bound: not kept
    n = len(calls)
    build_module.branches_of(loaded.model, loaded.graph, p)
    assert len(calls) == n + len(p.branches)


def test_a_candidates_unchanged_branches_are_the_branches_extracted_before():
    """A candidate's graph is a copy of the input's that shares the weights no rewrite changed: each branch whose
    nodes, tensors and weights are unchanged is the branch extracted before (the same object, so its bytes and
    cache key are not made again), and byte for byte what extracting it would give; a branch with a weight
    replaced (a new array, even of equal values) or an attribute changed is extracted anew."""
    import numpy as np
    import onnx
    import onnx_graphsurgeon as gs

    from parastream.rewrite.ir import copy_graph

    cache = build_module.BranchCache()
    loaded = load_model(SMALL_NET)

    def plan(graph):
        sched, _ = build_module.plan_streams(graph, RooflineCostModel(), 2, 8)
        return build_module.make_plan(graph, sched, backend="onnxruntime", precision="fp32", suffix=".onnx",
                                      inputs=loaded.inputs, outputs=loaded.outputs)

    def model_object():  # each candidate has a model of its own (a plan's branches are also kept by model)
        m = onnx.ModelProto()
        m.CopyFrom(loaded.model)
        return m

    first = build_module.branches_of(loaded.model, loaded.graph, plan(loaded.graph), cache)
    model, graph = model_object(), copy_graph(loaded.graph)
    weighted = [n for n in graph.nodes if any(isinstance(t, gs.Constant) for t in n.inputs)]
    changed_weight, changed_attr = weighted[0], next(n for n in weighted[1:] if n.attrs)
    w = next(t for t in changed_weight.inputs if isinstance(t, gs.Constant))
    w.values = np.array(w.values, copy=True)  # equal values, a new array: what a rewrite makes
    p = plan(graph)
    assert [b.nodes for b in p.branches] == [b.nodes for b in plan(loaded.graph).branches]
    got = build_module.branches_of(model, graph, p, cache)
    fresh = [build_module.extract_branch(model, graph, b) for b in p.branches]
    assert [g.SerializeToString() for g in got] == [f.SerializeToString() for f in fresh]
    touched = {i for i, b in enumerate(p.branches) if changed_weight.name in b.nodes}
    assert touched and all((got[i] is first[i]) == (i not in touched) for i in range(len(got)))
    # an attribute changed in a copy of that graph: that branch alone is extracted anew
    other = copy_graph(graph)
    key = next(iter(changed_attr.attrs))
    node = next(n for n in other.nodes if n.name == changed_attr.name)
    value = node.attrs[key]
    node.attrs[key] = ([v + 1 for v in value] if isinstance(value, list) else value * 2 if isinstance(value, float)
                       else value + 1 if isinstance(value, int) else f"{value}x")
    mine = build_module.branches_of(model_object(), other, p, cache)
    where = {i for i, b in enumerate(p.branches) if changed_attr.name in b.nodes}
    assert where and all((mine[i] is got[i]) == (i not in where) for i in range(len(got)))
    assert all(mine[i].SerializeToString() != got[i].SerializeToString() for i in where)
    # another build's cache shares nothing
    assert all(a is not g for a, g in zip(build_module.branches_of(model, graph, p, build_module.BranchCache()), got))


def test_the_searchs_candidates_keep_the_weight_arrays_they_were_exported_from():
    """``adopt_model(..., keep_arrays=True)`` (the search's candidates): a weight the graph holds as an array keeps
    that array (shared with the graph it was copied from), and the graph exports byte for byte as the model it
    was adopted for; without it, weights are read from the model's initializers (the loader's, the kept graph)."""
    import onnx_graphsurgeon as gs

    from parastream.rewrite.ir import adopt_model, copy_graph, export_model

    loaded = load_model(SMALL_NET)
    work = copy_graph(loaded.graph)
    for t in work.tensors().values():
        if isinstance(t, gs.Constant):
            t.values = t.values  # loaded into an array, as the search's working copy holds them
    model = export_model(work, loaded.model)
    arrays = {t.name: t._values for t in work.tensors().values() if isinstance(t, gs.Constant)}
    kept = adopt_model(copy_graph(work), model, keep_arrays=True)
    read = adopt_model(copy_graph(work), model)
    kept_w = {t.name: t._values for t in kept.tensors().values() if isinstance(t, gs.Constant)}
    assert kept_w and all(kept_w[n] is arrays[n] for n in kept_w)
    assert not any(t._values is arrays[t.name] for t in read.tensors().values() if isinstance(t, gs.Constant))
    assert gs.export_onnx(kept).graph.initializer == gs.export_onnx(read).graph.initializer


def _gpu_like_torch(monkeypatch, pending: set, calls: list):
    """onnxruntime's engines under a backend that says it runs on the GPU and compiles for the launcher's layout in
    the background, as torch's does: ``precompile`` hands back each batch's cache keys, ``compiling`` says how many
    of them are still in ``pending``."""
    import types

    from parastream.launcher.engines import require_backend

    real = require_backend("onnxruntime")
    gpu_like = types.SimpleNamespace(**{k: getattr(real, k) for k in dir(real) if not k.startswith("__")})
    gpu_like.gpu = True

    class LayoutBuilder(real.Builder):
        def build(self, branch, name, layout=None):
            return super().build(branch, name)

    def precompile(batches, background=False, cancellable=True, order="auto", label=""):
        keys = [[f"{len(calls)}/{n}/{i}" for i in range(len(items))] for n, (_, items) in enumerate(batches)]
        calls.append((cancellable, keys))
        return {"jobs": sum(map(len, keys)), "background": True, "keys": keys}

    gpu_like.Builder = LayoutBuilder
    gpu_like.compiles_for_layout = gpu_like.background_compiles = gpu_like.fuses_conv_relu = True
    gpu_like.supports_internal_nhwc = True  # channels-last internal boundaries: a boundary-layout round
    gpu_like.precompile = precompile
    gpu_like.compiling = lambda keys: sum(k in pending for k in keys)
    gpu_like.hasten = lambda keys: 0
    gpu_like.cancel_precompile = lambda: 0
    return gpu_like


def _fake_gpu(monkeypatch, faster: str | None = None):
    """No GPU needed: launchers that record what they were built for, and a timing where the reference (the input's
    launcher) is faster than every alternative but ``faster`` (a round's label)."""
    import types

    import parastream.launcher as launcher_pkg
    import parastream.pipeline.bench as bench_mod
    import numpy as np

    built = []

    def scratch(engines, v):
        built.append((v.plan.num_streams, v.internal_nhwc))
        return types.SimpleNamespace(close=lambda: None, t_built=0.0, plan=v.plan)

    monkeypatch.setattr(launcher_pkg, "cuda_device_count", lambda: 1)
    monkeypatch.setattr(build_module.Engines, "launcher", scratch)
    import parastream.launcher.gpu as gpu_mod

    monkeypatch.setattr(gpu_mod, "load_phases", lambda la: {})
    monkeypatch.setattr(bench_mod, "measure", lambda launchers, runs, warmup, lock=True, **kw: {
        k: np.array([0.5 if k == faster else 1.0 if k in ("reference", "candidate") or i == 0 else 2.0])
        for i, k in enumerate(launchers)})
    return built


def _measurer(backend, loaded):
    from parastream.launcher.engines import BuildOptions

    engines = build_module.Engines(backend, RooflineCostModel(), loaded, "fp32")
    return build_module.GpuMeasurer.for_build(engines, BuildOptions(precision="fp32", device="cuda"), loaded,
                                              streams=None, max_streams=4, budget_s=600)


def test_the_inputs_alternatives_are_timed_during_the_search_as_their_engines_come_in(monkeypatch):
    """``GpuMeasurer`` queues the input's alternatives with the input and times each against the input's launcher
    before the next candidate once its engines are compiled (not before; in ``time_alternatives``' order); the
    search's end waits for the rest.  The result is ``time_alternatives``' for the input's plan.  The streams
    round is timed with the input, against the plan's own engines on one stream (here twice as slow: decided,
    and the whole-model engine is never compiled)."""
    import types

    from parastream.launcher.engines import BuildOptions
    from parastream.pipeline import measure
    from parastream.pipeline.zoo import MODELS

    pending, calls = set(), []
    backend = _gpu_like_torch(monkeypatch, pending, calls)
    built = _fake_gpu(monkeypatch)
    monkeypatch.setattr(measure, "same_engines_on_one_stream", lambda la: types.SimpleNamespace(close=lambda: None))
    path = Path(__import__("tempfile").mkdtemp()) / "inception_block.onnx"
    __import__("onnx").save(MODELS["inception_block"](), path)
    loaded = load_model(path)
    m = _measurer(backend, loaded)
    got = m.prepare([loaded.model])
    assert "keys" not in got and "keys" not in got["alternatives"]  # handed on, not reported
    (input_cancellable, input_keys), (cancellable, (contiguous_keys,)) = calls  # no whole-model engine queued
    assert cancellable is False and len(contiguous_keys) > 1
    assert input_cancellable is False  # needed whether the search measures it (first) or nothing (it is kept)
    pending.update(contiguous_keys)  # the contiguous boundaries' engines still compiling
    m.measure(loaded.model)  # the input: the reference, then its streams round
    assert built == [(built[0][0], True)] and built[0][0] > 1
    assert [r["choice"] for r in m.early["rounds"]] == ["streams"]
    pending.clear()
    m.measure(loaded.model)  # a candidate: first the contiguous boundaries, now ready
    assert built[1] == (built[0][0], False) and len(built) == 3  # then the candidate itself
    timed = m.alternatives_timed()  # nothing left at the search's end
    assert len(built) == 3 and len(calls) == 2
    assert [r["choice"] for r in timed["rounds"]] == ["streams", "boundary layout"]
    assert timed["timed"] == "during the search" and not timed["one_engine"] and timed["internal_nhwc"]
    assert all(r["won"] in ("channels-last boundaries", f"{built[0][0]}-stream plan") for r in timed["rounds"])
    assert timed["rounds"][0]["started_s"] <= timed["rounds"][1]["started_s"]
    assert build_module.plan_signature(timed["plan"]) == build_module.plan_signature(
        build_module.make_plan(loaded.graph, build_module.plan_streams(loaded.graph, RooflineCostModel(), None, 4)[0],
                               backend="onnxruntime", precision="fp32", suffix=backend.suffix, inputs=loaded.inputs,
                               outputs=loaded.outputs))
    m.prepare([__import__("copy").deepcopy(loaded.model)])  # a candidate: cancelled when the budget is spent
    assert calls[-1][0] is True
    m.close()


def test_an_alternative_that_wins_during_the_search_leaves_the_rest_to_the_build(monkeypatch):
    """A round the alternative wins changes what the later rounds race: the search stops timing them and hands the
    build the rounds it timed, marked partial (the build times the rest after the search, from the winner)."""
    from parastream.launcher.engines import BuildOptions
    from parastream.pipeline.zoo import MODELS

    pending, calls = set(), []
    backend = _gpu_like_torch(monkeypatch, pending, calls)
    built = _fake_gpu(monkeypatch, faster="contiguous boundaries")
    path = Path(__import__("tempfile").mkdtemp()) / "inception_block.onnx"
    __import__("onnx").save(MODELS["inception_block"](), path)
    loaded = load_model(path)
    m = _measurer(backend, loaded)
    m.prepare([loaded.model])
    m.measure(loaded.model)
    m.measure(loaded.model)
    got = m.alternatives_timed()
    assert got["partial"] and [(r["choice"], r["won"]) for r in got["rounds"]] == [("boundary layout", "contiguous boundaries")]
    assert [b for b in built if b[0] == 1] == []  # the one-engine round was not timed against the old layout
    m.close()


class _QuietMeasurer:
    """A GPU build's measurer with nothing measured: every candidate 1 ms (the tests give its timed rounds)."""

    lookahead = 4

    def adopt(self, model, graph):
        pass

    def prepare(self, models):
        return {}

    def measure(self, model):
        return 1e-3

    def close(self):
        pass


def test_a_build_uses_the_alternatives_timed_during_the_search_for_the_same_plan(tmp_path, monkeypatch):
    """The search kept the input and timed its alternatives: the build does not load and time them again when its
    plan is the one they were timed against, and says so; for another plan it times them itself."""
    import types

    from parastream.launcher.engines import require_backend

    real = require_backend("onnxruntime")
    gpu_like = types.SimpleNamespace(**{k: getattr(real, k) for k in dir(real) if not k.startswith("__")})
    gpu_like.gpu = True
    monkeypatch.setattr(build_module, "resolve_backend", lambda name: gpu_like)
    timed_after = []
    monkeypatch.setattr(build_module, "time_alternatives", lambda engines, bundle, v, runs, **k: timed_after.append(v.plan) or None)
    reference = build(SMALL_NET, tmp_path / "ref", backend="onnxruntime", streams=2, search=False)
    rounds = [{"choice": "streams", "won": "2-stream plan", "timed_ms": {}, "load_s": 0.0, "timed_s": 0.0}]

    class FakeMeasurer(_QuietMeasurer):
        def __init__(self, plan):
            self.plan, self.log = plan, []

        def alternatives_timed(self):
            return {"fuse_conv_relu": False, "internal_nhwc": True, "one_engine": False, "rounds": rounds, "runs": 5,
                    "timed": "during the search", "plan": self.plan}

    monkeypatch.setattr(build_module.GpuMeasurer, "for_build", classmethod(lambda cls, *a, **k: FakeMeasurer(reference.plan)))
    timed_after.clear()  # the reference build (no search) timed its own
    bundle = build(SMALL_NET, tmp_path / "b", backend="onnxruntime", streams=2, search_options={"rules": []})
    assert timed_after == []
    report = json.loads((tmp_path / "b" / "report.json").read_text())
    assert report["measured_choices"]["timed"] == "during the search" and report["measured_choices"]["rounds"] == rounds
    assert report["search"]["alternatives_timed"] == "during the search" and "plan" not in report["measured_choices"]
    assert report["verification"]["passed"] and bundle.plan.num_streams == 2
    one = build(SMALL_NET, tmp_path / "one", backend="onnxruntime", streams=1, search=False)
    monkeypatch.setattr(build_module.GpuMeasurer, "for_build", classmethod(lambda cls, *a, **k: FakeMeasurer(one.plan)))
    timed_after.clear()
    build(SMALL_NET, tmp_path / "c", backend="onnxruntime", streams=2, search_options={"rules": []})
    assert len(timed_after) == 1 and timed_after[0].num_streams == 2  # another plan: timed after the search


def test_rounds_the_input_decided_by_a_wide_margin_are_taken_for_a_rewritten_plan_and_not_compiled_again(tmp_path, monkeypatch):
    """The search timed the input's rounds and then kept another plan: the rounds decided by 10% or more are taken
    for it as they are (their alternatives neither compiled nor timed again), the narrower ones are timed on it."""
    import types

    from parastream.launcher.engines import require_backend

    real = require_backend("onnxruntime")
    gpu_like = types.SimpleNamespace(**{k: getattr(real, k) for k in dir(real) if not k.startswith("__")})
    gpu_like.gpu = True
    monkeypatch.setattr(build_module, "resolve_backend", lambda name: gpu_like)
    handed, compiled = [], []
    monkeypatch.setattr(build_module, "time_alternatives",
                        lambda engines, bundle, v, runs, timed=(), rivals=None: handed.append(list(timed)) or None)
    monkeypatch.setattr(build_module, "alternative_variants", lambda engines, v: [
        ("depthwise convolutions", "inductor kernels"), ("conv+ReLU", "unfused"), ("boundary layout", "contiguous")])
    monkeypatch.setattr(build_module.Engines, "precompile", lambda self, variants, **k: compiled.append(variants[1:]))
    one = build(SMALL_NET, tmp_path / "one", backend="onnxruntime", streams=1, search=False, measure=False)
    wide = {"choice": "boundary layout", "won": "channels-last boundaries",
            "timed_ms": {"channels-last boundaries": 1.0, "contiguous boundaries": 1.25}, "load_s": 0.0, "timed_s": 0.0}
    narrow = {"choice": "conv+ReLU", "won": "cuDNN fused conv+bias+ReLU",
              "timed_ms": {"cuDNN fused conv+bias+ReLU": 1.0, "Inductor's conv and epilogue": 1.03}, "load_s": 0.0, "timed_s": 0.0}

    class FakeMeasurer(_QuietMeasurer):
        log = []

        def alternatives_timed(self):  # timed against the one-stream plan, not the build's two-stream one
            return {"partial": True, "rounds": [narrow, wide], "plan": one.plan, "timed": "2 rounds during the search"}

    monkeypatch.setattr(build_module.GpuMeasurer, "for_build", classmethod(lambda cls, *a, **k: FakeMeasurer()))
    build(SMALL_NET, tmp_path / "b", backend="onnxruntime", streams=2, search_options={"rules": []})
    assert [[r["choice"] for r in t] for t in handed] == [["boundary layout"]]
    assert handed[0][0]["won"] == "channels-last boundaries" and "input's plan (25% apart)" in handed[0][0]["timed"]
    assert compiled == [["inductor kernels", "unfused"]]  # the carried round's alternative is not compiled
    handed.clear()
    wide["timed_ms"]["contiguous boundaries"] = 1.05  # now narrow too: nothing carried, every round timed again
    build(SMALL_NET, tmp_path / "c", backend="onnxruntime", streams=2, search_options={"rules": []})
    assert handed == [[]]


def test_the_measurer_hands_over_the_input_s_rounds_timed_so_far_without_waiting_for_the_rest():
    import types

    from parastream.launcher.engines import BuildOptions
    from parastream.pipeline.measure import GpuMeasurer, carried_rounds

    engines = types.SimpleNamespace(backend=types.SimpleNamespace(background_compiles=False, compiling=lambda keys: 1 / 0))
    m = GpuMeasurer(engines, BuildOptions(), types.SimpleNamespace(model=None, graph=None), streams=None, max_streams=4,
                    budget_s=1.0)
    assert m.rounds_timed() is None
    r = {"choice": "streams", "won": "4-stream plan", "timed_ms": {"4-stream plan": 1.5, "one stream": 2.6}}
    m.early.update(plan="input plan", rounds=[r], todo=[("boundary layout", None, ["key"])])
    got = m.rounds_timed()  # the todo round is still compiling: not waited for (``compiling`` is never asked)
    assert got["partial"] and got["rounds"] == [r] and got["plan"] == "input plan"
    assert [x["choice"] for x in carried_rounds(got["rounds"])] == ["streams"]
    assert carried_rounds([dict(r, timed_ms={"a": 1.0, "b": 1.09})]) == [] and carried_rounds([dict(r, timed_ms={})]) == []


def test_the_input_s_rounds_whose_alternatives_are_compiled_are_timed_when_a_candidate_replaces_it(monkeypatch):
    """The search kept a candidate while some of the input's rounds were untimed (their alternatives compile
    behind the candidates): those compiled by then are timed against the input as the search ends, so that the
    build can carry the ones decided by a wide margin instead of compiling their alternatives again for the
    candidate; one still compiling is left; after an alternative won, the later ones are left too."""
    import types

    import numpy as np

    from parastream.launcher.engines import BuildOptions
    from parastream.pipeline import bench, measure
    from parastream.pipeline.measure import GpuMeasurer, carried_rounds

    times = {"inductor kernels": 1.8, "unfused": 1.02, "contiguous": 1.3, "the input": 1.0}
    monkeypatch.setattr(bench, "measure", lambda launchers, **kw: {
        k: np.full(5, times[la.variant]) for k, la in launchers.items()})
    loaded = []

    def launcher(v):
        la = types.SimpleNamespace(variant=v, close=lambda: None)
        loaded.append(v)
        return la

    compiling = {"still"}
    engines = types.SimpleNamespace(backend=types.SimpleNamespace(
        background_compiles=False, compiling=lambda keys: sum(k in compiling for k in keys), hasten=lambda keys: 0),
        launcher=launcher)
    m = GpuMeasurer(engines, BuildOptions(), types.SimpleNamespace(model=None, graph=None), streams=None,
                    max_streams=4, budget_s=1.0)
    m.reference = (types.SimpleNamespace(variant="the input"), 1.0)
    plan = types.SimpleNamespace(num_streams=1)
    m.early.update(plan=plan, rounds=[], todo=[("depthwise convolutions", "inductor kernels", ["a"]),
                                               ("conv+ReLU", "unfused", ["still"]),
                                               ("boundary layout", "contiguous", ["b"])])
    got = m.rounds_timed()
    assert loaded == ["inductor kernels", "contiguous"]  # the one still compiling is not waited for
    assert [t[0] for t in m.early["todo"]] == ["conv+ReLU"]
    assert [r["choice"] for r in carried_rounds(got["rounds"])] == ["depthwise convolutions", "boundary layout"]
    # an alternative that wins stops the rest: they would race another plan
    times["inductor kernels"] = 0.5
    loaded.clear()
    m.early.update(rounds=[], todo=[("depthwise convolutions", "inductor kernels", ["a"]),
                                    ("boundary layout", "contiguous", ["b"])])
    m.early.pop("stopped", None)
    m.rounds_timed()
    assert loaded == ["inductor kernels"] and "the alternative won" in m.early["stopped"]


def test_rounds_timed_during_the_search_before_an_alternative_won_are_handed_to_the_build(tmp_path, monkeypatch):
    """The search stopped timing the input's alternatives where one won: the build times the rest from those rounds
    (``time_alternatives(..., timed=rounds)``), and compiles beforehand every alternative it may load."""
    import types

    from parastream.launcher.engines import require_backend

    real = require_backend("onnxruntime")
    gpu_like = types.SimpleNamespace(**{k: getattr(real, k) for k in dir(real) if not k.startswith("__")})
    gpu_like.gpu = True
    monkeypatch.setattr(build_module, "resolve_backend", lambda name: gpu_like)
    reference = build(SMALL_NET, tmp_path / "ref", backend="onnxruntime", streams=2, search=False, measure=False)
    rounds = [{"choice": "boundary layout", "won": "contiguous boundaries", "timed_ms": {}, "load_s": 0.0, "timed_s": 0.0}]
    handed = []
    monkeypatch.setattr(build_module, "time_alternatives",
                        lambda engines, bundle, v, runs, timed=(), rivals=None: handed.append(list(timed)) or None)

    class FakeMeasurer(_QuietMeasurer):
        log = []

        def alternatives_timed(self):
            return {"partial": True, "rounds": rounds, "plan": reference.plan, "timed": "1 round during the search"}

    monkeypatch.setattr(build_module.GpuMeasurer, "for_build", classmethod(lambda cls, *a, **k: FakeMeasurer()))
    build(SMALL_NET, tmp_path / "b", backend="onnxruntime", streams=2, search_options={"rules": []})
    assert handed == [rounds]
    report = json.loads((tmp_path / "b" / "report.json").read_text())
    assert report["search"]["alternatives_timed"] == "1 round during the search"


def test_build_reports_seconds_per_stage_in_report_json_and_on_the_command_line(tmp_path, capsys):
    """report.json and ``parastream build --json`` carry {"stage_seconds": {stage: seconds}}, in the order the stages
    ran; ``--verbose`` prints them on one line."""
    from parastream.pipeline.cli import main

    assert main(["build", str(SMALL_NET), "-o", str(tmp_path / "j"), "--backend", "onnxruntime", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    stages = summary["stage_seconds"]
    assert list(stages)[:3] == ["load", "search", "schedule"] and {"engines", "write", "verify"} <= set(stages)
    assert all(isinstance(v, float) and v >= 0 for v in stages.values())
    report = json.loads((tmp_path / "j" / "report.json").read_text())
    assert report["stage_seconds"] == stages
    assert sum(stages.values()) <= report["timings"]["total"] + 1e-3
    assert main(["build", str(SMALL_NET), "-o", str(tmp_path / "v"), "--backend", "onnxruntime", "--no-search",
                 "--verbose"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.strip().startswith("stages:"))
    assert "load" in line and "engines" in line and "search" not in line


def test_engine_format_flags_are_recorded_build_options(tmp_path, capsys):
    """``--torch-artifact``, ``--inductor-format``, ``--compile-workers``, ``--no-gpu-timing-lock`` and
    ``--conv-kernels`` are build options: manifest.json records them (a launcher reads its options back from there, ``Bundle.engine_options``)."""
    from parastream.pipeline.cli import main

    out = tmp_path / "b"
    assert main(["build", str(SMALL_NET), "-o", str(out), "--backend", "onnxruntime", "--no-search", "--quiet",
                 "--torch-artifact", "aoti", "--inductor-format", "bundled", "--compile-workers", "3",
                 "--no-gpu-timing-lock", "--conv-kernels", "inductor"]) == 0
    options = json.loads((out / "manifest.json").read_text())["options"]
    assert (options["torch_artifact"], options["inductor_format"], options["compile_workers"],
            options["gpu_timing_lock"], options["conv_kernels"]) == ("aoti", "bundled", 3, False, "inductor")
    got = Bundle.open(out).engine_options("cpu")
    assert (got.torch_artifact, got.inductor_format, got.compile, got.device, got.conv_kernels) == (
        "aoti", "bundled", True, "cpu", "inductor")
    default = build(SMALL_NET, tmp_path / "d", backend="onnxruntime", search=False, verify=False)
    assert default.engine_options("cpu").torch_artifact == "inductor"
    assert default.engine_options("cpu").conv_kernels == "auto"  # cuDNN's until a GPU build times the other


def _rounds_of(streams: bool = False, layout: bool = False):
    """A stand-in for ``measure.alternative_variants``: the depthwise round while its kernels are "auto", the
    conv+ReLU round while fused, and (as asked) the streams round of a plan on streams or the boundary-layout
    round while the boundaries are channels-last."""
    import types
    from dataclasses import replace

    def rounds(engines, v):
        out = []
        if v.options.conv_kernels == "auto":
            out.append(("depthwise convolutions", replace(v, options=replace(v.options, conv_kernels="inductor"))))
        if v.options.fuse_conv_relu:
            out.append(("conv+ReLU", replace(v, options=replace(v.options, fuse_conv_relu=False))))
        if streams and v.plan.num_streams > 1:
            out.append(("streams", replace(v, plan=types.SimpleNamespace(branches=[0], num_streams=1))))
        if layout and v.internal_nhwc:
            out.append(("boundary layout", replace(v, internal_nhwc=False)))
        return out

    return rounds


def test_a_one_stream_plan_compiles_the_later_rounds_alternatives_of_an_earlier_winner_up_front(monkeypatch):
    """A one-engine plan's alternatives are one compile job each: the conv+ReLU round's alternative of Inductor's
    depthwise kernels (what that round races if they win the first round) is queued with the others, not after
    the first round; a plan of several engines queues nothing more (its workers are busy with its branches)."""
    import types
    from dataclasses import replace

    from parastream.launcher.engines import BuildOptions
    from parastream.pipeline import measure
    from parastream.pipeline.measure import Variant, speculative_variants

    monkeypatch.setattr(measure, "alternative_variants", _rounds_of(streams=True))
    one = Variant(None, None, types.SimpleNamespace(branches=[0], num_streams=1),
                  BuildOptions(conv_kernels="auto", fuse_conv_relu=True))
    got = speculative_variants(None, one)
    assert [(x.options.conv_kernels, x.options.fuse_conv_relu) for x in got] == [("inductor", False)]
    assert speculative_variants(None, replace(one, options=replace(one.options, conv_kernels="cudnn"))) == []  # one round
    # a round carried from the input (``decided``) is not raced: nothing is compiled for it, at either level
    assert speculative_variants(None, one, {"depthwise convolutions"}) == []
    assert speculative_variants(None, one, {"conv+ReLU"}) == []
    # one stream cut into blocks: the same rounds; several streams: none
    blocks = replace(one, plan=types.SimpleNamespace(branches=[0, 1, 2], num_streams=1))
    assert [(x.options.conv_kernels, x.options.fuse_conv_relu) for x in speculative_variants(None, blocks)] == [("inductor", False)]
    assert speculative_variants(None, replace(one, plan=types.SimpleNamespace(branches=[0, 1], num_streams=2))) == []


def test_queued_rivals_follow_each_round_s_decision(monkeypatch):
    """``QueuedRivals``: a round that keeps its form drops its rival and the rivals queued for its alternative's
    sake; a round
    whose alternative wins hastens the later rounds' rivals of that form, drops those of the form it replaced,
    and queues the level after as spare work; the end drops what is left."""
    import types
    from dataclasses import replace

    from parastream.launcher.engines import BuildOptions
    from parastream.pipeline import measure
    from parastream.pipeline.measure import QueuedRivals, Variant

    rounds = _rounds_of(layout=True)

    def key(v):
        return f"{v.options.conv_kernels}/{'fused' if v.options.fuse_conv_relu else 'unfused'}/{'nhwc' if v.internal_nhwc else 'nchw'}"

    monkeypatch.setattr(measure, "alternative_variants", rounds)
    log = []
    backend = types.SimpleNamespace(hasten=lambda keys: log.append(("hasten", sorted(keys))) or 0,
                                    drop=lambda keys: log.append(("drop", sorted(keys))) or 0)
    engines = types.SimpleNamespace(backend=backend, precompile=lambda variants, order, **k: log.append(
        (order, [key(v) for v in variants])) or {"jobs": len(variants), "keys": [[key(v)] for v in variants]})
    one = Variant(None, None, types.SimpleNamespace(branches=[0], num_streams=1),
                  BuildOptions(conv_kernels="auto", fuse_conv_relu=True))

    q = QueuedRivals(engines)
    q.queue(one)
    assert log[0] == ("auto", ["inductor/fused/nhwc", "auto/unfused/nhwc", "auto/fused/nchw"])
    assert ("spare", ["inductor/unfused/nhwc", "inductor/fused/nchw"]) in log  # should depthwise flip
    assert ("spare", ["auto/unfused/nchw"]) in log  # should conv+ReLU flip
    assert q.queued == {"jobs": 3}
    log.clear()
    # the depthwise round flips: its form's later rivals are needed (hastened), the plain form's are moot
    won = replace(one, options=replace(one.options, conv_kernels="inductor"))
    q.decided("depthwise convolutions", True, won, {"depthwise convolutions"})
    assert log[0] == ("auto", ["inductor/unfused/nhwc", "inductor/fused/nchw"])
    assert ("hasten", ["inductor/fused/nchw", "inductor/unfused/nhwc"]) in log
    assert ("spare", ["inductor/unfused/nchw"]) in log  # one level further, should conv+ReLU flip again
    # (its own rival is the form now kept: never dropped)
    assert log[-1] == ("drop", ["auto/fused/nchw", "auto/unfused/nchw", "auto/unfused/nhwc"])
    log.clear()
    # conv+ReLU keeps its form: what its flip would have needed is dropped, and its own rival where it has not
    # started (a round decided without loading it), nothing queued
    q.decided("conv+ReLU", False, won, {"depthwise convolutions", "conv+ReLU"})
    assert log == [("drop", ["inductor/unfused/nchw", "inductor/unfused/nhwc"])]
    log.clear()
    q.close()
    assert log == [("drop", ["inductor/fused/nchw"])] and q.rivals == {} and q.if_flipped == {}


def test_the_build_compiles_the_speculative_alternatives_with_the_others(tmp_path, monkeypatch):
    import types

    from parastream.launcher.engines import require_backend

    real = require_backend("onnxruntime")
    gpu_like = types.SimpleNamespace(**{k: getattr(real, k) for k in dir(real) if not k.startswith("__")})
    gpu_like.gpu = True
    monkeypatch.setattr(build_module, "resolve_backend", lambda name: gpu_like)
    compiled = []
    monkeypatch.setattr(build_module, "time_alternatives", lambda engines, bundle, v, runs, timed=(), rivals=None: None)
    monkeypatch.setattr(build_module, "alternative_variants", lambda engines, v: [("conv+ReLU", "unfused")])
    monkeypatch.setattr(build_module, "speculative_by_round",
                        lambda engines, v, decided=(): [("conv+ReLU", ["unfused of the winner"])])
    monkeypatch.setattr(build_module.Engines, "precompile", lambda self, variants, **k: compiled.append(variants[1:]))
    build(SMALL_NET, tmp_path / "b", backend="onnxruntime", streams=1, search=False)
    assert compiled == [["unfused", "unfused of the winner"]]


def test_with_background_compiles_the_build_queues_its_rounds_rivals_and_waits_for_none_of_them(tmp_path, monkeypatch):
    """A backend that compiles in the background (torch on a GPU): the plan is queued first, then its rounds'
    rivals and, as spare work, the rivals of an earlier winner; nothing is compiled in a batch the build waits
    for, and the rounds are handed what was queued (``QueuedRivals``), to wait each for its own rival."""
    import types

    from parastream.launcher.engines import require_backend

    real = require_backend("onnxruntime")
    gpu_like = types.SimpleNamespace(**{k: getattr(real, k) for k in dir(real) if not k.startswith("__")})
    gpu_like.gpu = gpu_like.background_compiles = True
    monkeypatch.setattr(build_module, "resolve_backend", lambda name: gpu_like)
    calls, handed = [], []

    def precompile(self, variants, background=False, order="auto", **k):
        calls.append((background, order, [v if isinstance(v, str) else "the plan" for v in variants]))
        return {"jobs": len(variants), "background": True, "keys": [[f"key of {v}"] for v in variants]}

    monkeypatch.setattr(build_module, "time_alternatives",
                        lambda engines, bundle, v, runs, timed=(), rivals=None: handed.append(rivals))
    monkeypatch.setattr(build_module, "alternative_variants", lambda engines, v: [("conv+ReLU", "unfused")])
    monkeypatch.setattr(build_module, "speculative_by_round",
                        lambda engines, v, decided=(): [("conv+ReLU", ["unfused of the winner"])])
    monkeypatch.setattr(build_module.Engines, "precompile", precompile)
    bundle = build(SMALL_NET, tmp_path / "b", backend="onnxruntime", streams=1, search=False)
    assert calls == [(True, "now", ["the plan"]), (True, "auto", ["unfused"]), (True, "spare", ["unfused of the winner"])]
    (rivals,) = handed
    assert rivals.rivals == {"conv+ReLU": ["key of unfused"]}
    assert rivals.if_flipped == {"conv+ReLU": ["key of unfused of the winner"]}
    assert bundle.report["precompiled"]["rivals"] == {"jobs": 1, "background": True}


def test_search_rules_given_by_name_are_the_search_s_rules_and_recorded(tmp_path):
    """``search_options={"rules": [names]}`` (what bench/rule_ablation.py passes): the search takes those rules
    alone, and the report records them as names; a name that is no rule is a one-line error and writes nothing."""
    import pytest

    from parastream.core.errors import ParastreamError

    bundle = build(SMALL_NET, tmp_path / "b", backend="onnxruntime", streams=2,
                   search_options={"rules": ["fold_bn_and_affine", "merge_parallel_conv"]})
    assert bundle.report["search"]["rules"] == ["fold_bn_and_affine", "merge_parallel_conv"]
    assert set(bundle.report["search"].get("rules_chosen_count") or {}) <= {"fold_bn_and_affine", "merge_parallel_conv"}
    json.dumps(bundle.report)
    with pytest.raises(ParastreamError, match="'no_such_rule' is not a rewrite rule"):
        build(SMALL_NET, tmp_path / "c", backend="onnxruntime", search_options={"rules": ["no_such_rule"]})
    assert not (tmp_path / "c").exists()
    with pytest.raises(ParastreamError, match="'fuse_attention' writes nodes the onnxruntime backend does not run"):
        build(SMALL_NET, tmp_path / "d", backend="onnxruntime", search_options={"rules": ["fuse_attention"]})
