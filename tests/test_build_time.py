"""Issue 16 (build time): the work a CPU build no longer does twice leaves the same bundle.

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

SMALL_NET = Path(__file__).resolve().parents[1] / "examples" / "models" / "small_net.onnx"


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
    monkeypatch.setattr(build_module, "choose_cpu_alternative", lambda *a, **k: handed.append(a[3]) or real_choice(*a, **k))
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

    def one_engine_wins(tmp, model, graph, plan, backend, options, cost_model, cfg, loaded):
        timed.append((plan.num_streams, len(list((Path(tmp) / "engines").iterdir()))))
        return {"one_engine": True, "internal_nhwc": True, "fuse_conv_relu": False, "rounds": []}

    monkeypatch.setattr(build_module, "_measure_alternatives", one_engine_wins)
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
    batches = []
    gpu_like.precompile = lambda b: batches.append([(builder.options, len(items)) for builder, items in b]) or {"jobs": 0}
    monkeypatch.setattr(build_module, "resolve_backend", lambda name: gpu_like)
    monkeypatch.setattr(build_module, "_measure_alternatives", lambda *a: None)
    bundle = build(SMALL_NET, tmp_path / "b", backend="onnxruntime", streams=2, search=False)
    assert len(batches) == 1
    (plan_opts, n_plan), (contiguous_opts, n_contiguous), (_, n_one) = batches[0]
    assert n_plan == n_contiguous == len(bundle.plan.branches) > 1 and n_one == 1
    assert json.loads((tmp_path / "b" / "report.json").read_text())["precompiled"] == {"jobs": 0}
    # without measurement nothing is timed, so only the plan's own engines are built (no batch)
    build(SMALL_NET, tmp_path / "c", backend="onnxruntime", streams=2, search=False, measure=False)
    assert len(batches) == 1


def test_a_plans_branches_are_extracted_once_while_it_lives(monkeypatch):
    """``branches_of``: the build's precompile and its engine writes (and the search's prepare and load of a
    candidate) extract a plan's branches once; another plan object is extracted anew, and what is kept is bounded."""
    import gc

    build_module._EXTRACTED.clear()
    loaded = load_model(SMALL_NET)
    sched, _ = build_module.plan_streams(loaded.graph, RooflineCostModel(), 2, 8)

    def plan():
        return build_module.make_plan(loaded.graph, sched, backend="onnxruntime", precision="fp32", suffix=".onnx",
                                      inputs=loaded.inputs, outputs=loaded.outputs)

    calls = []
    real = build_module.extract_branch
    monkeypatch.setattr(build_module, "extract_branch", lambda *a: calls.append(1) or real(*a))
    p = plan()
    first = build_module.branches_of(loaded.model, loaded.graph, p)
    assert build_module.branches_of(loaded.model, loaded.graph, p) is first and len(calls) == len(p.branches) > 1
    q = plan()
    assert build_module.branches_of(loaded.model, loaded.graph, q) is not first and len(calls) == 2 * len(p.branches)
    del p, first
    gc.collect()
    assert len(build_module._EXTRACTED) == 1  # the dead plan's branches went with it
    monkeypatch.setattr(build_module, "EXTRACTED_BYTES", 0)
    build_module.branches_of(loaded.model, loaded.graph, plan())
    assert len(build_module._EXTRACTED) == 1  # over the bound: not kept
