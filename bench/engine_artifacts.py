"""What a torch bundle's engines/ should hold: measured on the GPU, each load in a fresh process with an empty
Inductor cache (what a Triton instance start on a fresh machine is).

Four ways to load the same plan of Inception-v3 (fp16, batch 1, no search):

* ``jit``       engines/ hold each branch's ONNX, converted and compiled by Inductor at every load;
* ``inductor``  engines/ hold Inductor precompiled artifacts (``standalone_compile`` at build,
                ``CompiledArtifact.load`` at load; --torch-artifact inductor);
* ``inductor-kernels``, ``inductor-bundled``, ``inductor-cache``  the same saved as Inductor's wrapper and
                cubins loaded without Inductor (the default), as the compiled function
                (``standalone_compile(aot=True)``, the previous default) or as Inductor's cache entries
                (--inductor-format);
* ``aoti``      engines/ hold AOTInductor packages compiled at build for the launcher's layouts;
* ``mega``      the jit engines after ``torch.compiler.load_cache_artifacts`` of the artifacts ``save_cache_artifacts``
                collected in the ``jit`` process (Inductor's own cache shipped in the bundle: dynamo still
                traces every branch at load).

Further steps: ``loadbase:<artifact>`` (the load without ``prepare_load`` and with AOTAutograd's aliasing check
on, to measure what those two save), ``importtime:<artifact>`` and ``importtimebase:<artifact>`` (a load under
``-X importtime``: the modules imported after it started, the slowest first), ``profile:<artifact>`` (under cProfile).  A load records when the
threads ``prepare_load`` starts began and ended (``runtime_threads_s``, from the open).

For each: the build's engine time, the load (``GpuLauncher``: engines, warm-up, capture of the whole plan into one
CUDA Graph on its external streams) in a fresh process with empty Inductor and Triton caches, what that load
wrote into the empty Inductor cache (C++ sources: the CPU vector-ISA probe, ``cpu_isa_probe``), the replay latency
(d: multi-stream, b: the same engines on one stream) and the error against onnxruntime.  Then, while time is
left, whole builds with the default search, the measurement budget ``--measure-seconds`` (top 20 candidates) and
verification, per artifact (``search-inductor``, ``search-jit``, ``search-aoti``).  Every step runs in its own
process, stops after ``--step-seconds``, and the results file is rewritten after it:

    python bench/engine_artifacts.py --out $OUT --seconds 520     # results: $OUT/engine_artifacts.json

Without a GPU, ``--cpu`` compares the same three per branch on the CPU (Inductor and AOTInductor compile for the
CPU too): the first ``--branches`` branches of a zoo model's plan, compiled (jit: torch.compile of the module the
engine runs; aoti: the package the build writes) and loaded in fresh processes with empty caches.  A proxy for
the GPU's figures (no Triton, no CUDA Graph), not a replacement:

    python bench/engine_artifacts.py --cpu --model small_net --branches 4 --out /tmp/ea
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

T_START = time.perf_counter()
ROOT = Path(__file__).resolve().parents[1]
#: the GPU steps, most wanted first (a step starts only while time is left)
GPU_STEPS = ("build:jit", "build:inductor", "load:inductor", "load:jit", "search:inductor", "search:jit", "build:aoti",
             "load:aoti", "load:mega", "search:aoti")


def _fresh_env(extra: dict | None = None) -> dict:
    """An environment whose Inductor and Triton caches are new, empty folders."""
    env = dict(os.environ)
    d = tempfile.mkdtemp(prefix="inductor-empty-")
    env.update(TORCHINDUCTOR_CACHE_DIR=f"{d}/inductor", TRITON_CACHE_DIR=f"{d}/triton", **(extra or {}))
    return env


def child(args) -> dict:
    """One fresh process: load a bundle (timed), check it against onnxruntime, time its replays."""
    t_import = time.perf_counter()
    import numpy as np
    import torch

    from parastream.pipeline.bench import bench_bundle
    from parastream.launcher.bundle import Bundle
    from parastream.launcher.gpu import GpuLauncher, load_phases

    res: dict = {"mode": args.child, "import_s": time.perf_counter() - t_import}
    if args.child == "build":
        return child_build(args, res)
    if args.child == "cpu-build":
        return cpu_build_child(args, res)
    if args.child.startswith("cpu-"):
        return cpu_child(args, res)
    if args.baseline:  # the load without prepare_load and with the aliasing check on: a before/after in one call
        import contextlib

        from parastream.launcher.engines import torch as tb

        tb._first_call_unchecked = lambda loaded: contextlib.nullcontext()
    print(IMPORTTIME_MARK, file=sys.stderr, flush=True)  # (under -X importtime: the imports after it are the load's)
    t_open = time.perf_counter()
    bundle = Bundle.open(args.bundle, loading=not args.baseline)  # what parastream.launcher.load does
    res["open_s"] = time.perf_counter() - t_open
    if args.child == "mega-load":
        t0 = time.perf_counter()
        torch.compiler.load_cache_artifacts(Path(args.artifacts).read_bytes())
        res["load_cache_artifacts_s"] = time.perf_counter() - t0
    prof = None
    if args.profile:  # where a load's time goes (cProfile: Python-heavy parts look slower than they run)
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    t0 = time.perf_counter()
    la = GpuLauncher(bundle)
    res["launcher_s"] = time.perf_counter() - t0
    if prof is not None:
        import io
        import pstats

        prof.disable()
        for order in ("cumulative", "tottime"):
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats(order).print_stats(45)
            res[f"profile_{order}"] = buf.getvalue().splitlines()[-60:]
    res["engines_load_s"] = la.load_s
    from parastream.launcher.engines import torch as torch_engines

    # the background threads of prepare_load (imports, Triton's hash): when each started and ended, from the open
    res["runtime_threads_s"] = {k: [round(a - t_open, 3), round(b - t_open, 3)]
                                for k, (a, b) in getattr(torch_engines, "RUNTIME_IMPORT_TIMES", {}).items()}
    res["load_s"] = res["open_s"] + res["launcher_s"]  # parastream.launcher.load(path): open, load, warm, capture
    res["process_to_ready_s"] = time.perf_counter() - T_START
    engines = [e for e in la.engines if e is not None]
    res["engines"] = len(engines)
    res["load_phases_s"] = load_phases(la)
    res["distinct_artifacts"] = len({id(getattr(e._runner, "artifact", e)) for e in engines if getattr(e, "_runner", None) is not None})
    res["compiled_at_load"] = sum(bool(getattr(e, "compiled_at_load", True)) for e in engines)
    if args.child == "mega-save":
        t0 = time.perf_counter()
        art = torch.compiler.save_cache_artifacts()
        if art is not None:
            Path(args.artifacts).write_bytes(art[0])
            res["cache_artifacts_bytes"] = len(art[0])
        res["save_cache_artifacts_s"] = time.perf_counter() - t0
    feeds = {t.name: np.random.default_rng(3).standard_normal(t.shape).astype(t.dtype) for t in la.plan.inputs}
    got = la(feeds)
    import onnxruntime as ort

    sess = ort.InferenceSession(args.onnx, providers=["CPUExecutionProvider"])
    ref = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
    res["max_scaled"] = {k: float(np.abs(got[k].astype(np.float64) - ref[k]).max() / np.abs(ref[k]).max()) for k in ref}
    res["inductor_cache_after_load"] = _cache_contents()
    # what the load (and one run) imported: a "kernels" bundle needs neither Inductor nor Triton
    res["imported"] = {p: sum(m == p or m.startswith(p + ".") for m in sys.modules) for p in ("torch._inductor", "triton")}
    from torch._dynamo.utils import counters

    res["counters"] = {k: dict(counters[k]) for k in ("inductor", "aot_autograd", "stats")}  # fxgraph_cache_hit/miss, ...
    b = bench_bundle(bundle, runs=args.runs, warmup=20, launcher=la, whole_model=False)
    res.update(d_ms=b["parastream_ms"], b_ms=b["single_stream_ms"], branches=b["branches"], streams=b["streams"])
    la.close()
    return res


def _cache_contents() -> dict:
    """What this process wrote into its (at start empty) Inductor and Triton caches: C++ sources compiled, whether
    one of them is the CPU vector-ISA probe (``_chk_kernel``), and Triton's files."""
    root = Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR", "/nonexistent"))
    cpp = list(root.rglob("*.cpp")) if root.is_dir() else []
    triton = Path(os.environ.get("TRITON_CACHE_DIR", "/nonexistent"))
    return {"files": sum(1 for f in root.rglob("*") if f.is_file()) if root.is_dir() else 0, "cpp": len(cpp),
            "cpu_isa_probe": any("_chk_kernel" in f.read_text(errors="replace") for f in cpp),
            # Triton's cache: kernels (.cubin) and the C helpers it builds with gcc (.so)
            "triton_files": sorted({f.suffix for f in triton.rglob("*") if f.is_file()}) if triton.is_dir() else [],
            "triton_so": sum(1 for _ in triton.rglob("*.so")) if triton.is_dir() else 0}


def cpu_branches(args) -> list:
    """(branch ONNX, input specs, output specs) of the first ``--branches`` branches (fp32) of a zoo model's plan."""
    import onnx

    from parastream.launcher.bundle import Bundle

    bundle = Bundle.open(args.bundle)
    plan = bundle.plan
    out = []
    for b in plan.branches[: args.branches]:
        out.append((onnx.load_from_string(bundle.engine_bytes(b)), [plan.tensors[t] for t in b.inputs],
                    [plan.tensors[t] for t in b.outputs]))
    return out


def cpu_child(args, res: dict) -> dict:
    """CPU: load (aoti, inductor) or compile (jit, mega) every branch and run it once, in this fresh process."""
    import numpy as np
    import torch

    from parastream.launcher.engines import torch as tb
    from parastream.launcher.engines.onnx_torch import convert, to_fx

    branches = cpu_branches(args)
    if args.child == "cpu-mega-load":
        t0 = time.perf_counter()
        torch.compiler.load_cache_artifacts(Path(args.artifacts).read_bytes())
        res["load_cache_artifacts_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    per = []
    for i, (model, ins, outs) in enumerate(branches):
        t1 = time.perf_counter()
        if args.child in ("cpu-aoti", "cpu-inductor"):
            e = tb.load(Path(args.artifacts, f"{i}.zip").read_bytes(), ins, outs, device="cpu")
            assert not e.compiled_at_load and e.meta["compiled"] == {"cpu-aoti": "aotinductor", "cpu-inductor": "inductor"}[args.child]
            e.run({t.name: np.zeros(t.shape, t.dtype) for t in ins})
        else:  # what a GPU engine does at load, on the CPU: convert, trace to FX, torch.compile, run once
            wrapper = tb._into_outputs(to_fx(convert(model, "float32")), [t.name for t in ins], [t.name for t in outs], torch.float32)
            fn = torch.compile(wrapper, fullgraph=True, dynamic=False)
            with torch.no_grad():
                fn(*[tb._tensor(t, False, None, "cpu") for t in ins + outs])
        per.append(time.perf_counter() - t1)
    res.update(load_s=time.perf_counter() - t0, per_branch_s=per, process_to_ready_s=time.perf_counter() - T_START,
               inductor_cache_after_load=_cache_contents())
    if args.child == "cpu-jit":
        art = torch.compiler.save_cache_artifacts()
        if art is not None:
            Path(args.artifacts).write_bytes(art[0])
            res["cache_artifacts_bytes"] = len(art[0])
    return res


def cpu_main(args, res: dict, work: Path, save) -> None:
    """The CPU proxy: jit vs Inductor cache artifacts vs Inductor precompiled artifacts vs AOTInductor packages."""
    from parastream.pipeline import build
    from parastream.pipeline.zoo import MODELS

    onnx_path = work / f"{args.model}.onnx"
    import onnx

    onnx.save(MODELS[args.model](), onnx_path)
    bundle = build(onnx_path, work / "plan", backend="onnxruntime", streams=4, search=False, verify=False)
    args.bundle = str(bundle.path)
    branches = cpu_branches(args)
    res["branches"] = [{"nodes": len(m.graph.node), "ops": sorted({n.op_type for n in m.graph.node})} for m, _, _ in branches]
    common = ["--bundle", args.bundle, "--branches", str(args.branches)]
    steps = args.steps.split(",") if args.steps else ["inductor", "aoti", "jit", "mega"]
    for kind in ("inductor", "aoti"):  # each step in a fresh process with empty Inductor caches: the build too
        if kind not in steps:
            continue
        pk = work / kind
        pk.mkdir()
        run_child(res, f"cpu_build_{kind}", ["--child", "cpu-build", "--artifact", kind, "--artifacts", str(pk), *common],
                  _fresh_env({"PARASTREAM_COMPILE_WORKERS": "1"}), 3600)
        save()
        run_child(res, f"cpu_load_{kind}", ["--child", f"cpu-{kind}", "--artifacts", str(pk), *common], _fresh_env(), 3600)
        save()
    art = work / "cache_artifacts.bin"
    if "jit" in steps:
        run_child(res, "cpu_jit", ["--child", "cpu-jit", "--artifacts", str(art), *common], _fresh_env(), 3600)
        save()
    if "mega" in steps and art.is_file():
        run_child(res, "cpu_mega", ["--child", "cpu-mega-load", "--artifacts", str(art), *common], _fresh_env(), 3600)
        save()


def cpu_build_child(args, res: dict) -> dict:
    from parastream.launcher.engines import BuildOptions
    from parastream.launcher.engines import torch as tb

    branches = cpu_branches(args)
    builder = tb.Builder(BuildOptions(device="cpu", torch_artifact=args.artifact))
    t0 = time.perf_counter()
    per = []
    for i, (model, ins, outs) in enumerate(branches):
        t1 = time.perf_counter()
        Path(args.artifacts, f"{i}.zip").write_bytes(builder.build(model, f"b{i}", layout={"inputs": ins, "outputs": outs}))
        per.append(time.perf_counter() - t1)
    res.update(build_s=time.perf_counter() - t0, per_branch_s=per,
               engine_bytes=[Path(args.artifacts, f"{i}.zip").stat().st_size for i in range(len(branches))])
    return res


def child_build(args, res: dict) -> dict:
    from parastream.pipeline import build

    # inductor-bundled, inductor-cache: how Inductor's artifact is saved (build options, carried to the compile workers)
    artifact, _, fmt = args.artifact.partition("-")
    t0 = time.perf_counter()
    bundle = build(args.onnx, args.bundle, backend="torch", precision="fp16", force=True, search=args.search == "on",
                   torch_artifact=artifact, inductor_format=fmt or "kernels",
                   measure=args.search == "on", verify=args.verify == "on",
                   **({"measure_seconds": args.measure_seconds} if args.measure_seconds is not None else {}),
                   search_options={"top_k": 20} if args.search == "on" else {})
    res["build_s"] = time.perf_counter() - t0
    rep = bundle.report
    res["timings"] = rep.get("timings")
    s = rep.get("search") or {}
    cands = s.get("candidates", [])
    res["search"] = {"candidates": len(cands), "measured": sum(c.get("measured_s") is not None for c in cands),
                     # rewrites measured among the 20 best-ranked (ranks from 0; the input is listed too, not counted)
                     "measured_top20": sum(c.get("measured_s") is not None and not c.get("input")
                                           for c in sorted((c for c in cands if not c.get("input")),
                                                           key=lambda c: c["rank"])[:20]) if cands else 0,
                     "decided_by": s.get("decided_by"), "nodes_before": s.get("nodes_before"), "nodes_after": s.get("nodes_after"),
                     "prepared": s.get("prepared"),
                     "prepared_before_search": s.get("prepared_before_search"), "search_timings": s.get("timings"), "measure_log": s.get("measure_log")}
    res["precompiled"] = rep.get("precompiled")
    res["background_compiles"] = rep.get("background_compiles")
    res["measured_choices"] = [(r["choice"], r["won"], r.get("load_s"), r.get("timed_s"))
                               for r in (rep.get("measured_choices") or {}).get("rounds", [])]
    eng = rep.get("engines", {})
    res["engines"] = {"branches": len(eng),
                      "compiled": sum(e.get("compiled") in ("aotinductor", "inductor", "kernels") for e in eng.values()),
                      "kernels": sum(e.get("compiled") == "kernels" for e in eng.values()),
                      "kernels_errors": sorted({e["kernels_error"] for e in eng.values() if e.get("kernels_error")})[:3],
                      "compile_failed": sum(bool(e.get("aot_error")) for e in eng.values()),
                      "aot_errors": sorted({e["aot_error"] for e in eng.values() if e.get("aot_error")})[:3],
                      "compile_batch_s": max([e.get("compile_batch_s", 0) for e in eng.values()], default=0),
                      "cache_miss": sum(e.get("cache") == "miss" for e in eng.values()),
                      "package_mb": sum(e.get("package_bytes", 0) for e in eng.values()) / 2**20}
    v = rep.get("verification") or {}
    res["verification"] = {"passed": v.get("passed"), "max_scaled": {k: o.get("max_scaled") for k, o in v.get("outputs", {}).items()},
                           "engines_compiled_at_load": v.get("engines_compiled_at_load")}
    res["bundle_mb"] = sum(f.stat().st_size for f in Path(args.bundle).rglob("*") if f.is_file()) / 2**20
    return res


IMPORTTIME_MARK = "parastream-bench: load starts"


def _load_imports(stderr: str, top: int = 25) -> dict:
    """From ``-X importtime`` output: the modules first imported after the load started (any thread), their self
    time summed, and the slowest top-level imports by cumulative time (what a load waits on)."""
    lines = stderr.splitlines()
    if IMPORTTIME_MARK not in lines:
        return {"error": "no load marker in stderr"}
    rows = []
    for ln in lines[lines.index(IMPORTTIME_MARK) + 1:]:
        if not ln.startswith("import time:") or "|" not in ln or "self [us]" in ln:
            continue
        self_us, cum_us, name = (x.rstrip() for x in ln[len("import time:"):].split("|", 2))
        depth = (len(name) - len(name.lstrip())) // 2
        rows.append((int(self_us), int(cum_us), depth, name.strip()))
    if not rows:
        return {"modules": 0}
    base = min(r[2] for r in rows)
    tops = sorted((r for r in rows if r[2] == base), key=lambda r: -r[1])[:top]
    return {"modules": len(rows), "self_s": round(sum(r[0] for r in rows) / 1e6, 3),
            "slowest": [(name, round(cum / 1e6, 3)) for _, cum, _, name in tops],
            "slowest_self": [(r[3], round(r[0] / 1e6, 3)) for r in sorted(rows, key=lambda r: -r[0])[:top]]}


def run_child(out: dict, key: str, argv: list[str], env: dict, timeout: float, flags: tuple = ()) -> None:
    t0 = time.perf_counter()
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        result = f.name
    try:
        p = subprocess.run([sys.executable, *flags, __file__, "--result", result, *argv], env=env, capture_output=True,
                           text=True, timeout=max(10.0, timeout))
        out[key] = json.loads(Path(result).read_text()) if p.returncode == 0 else {"error": p.stderr[-3000:]}
        if "-X" in flags and p.returncode == 0:
            out[key]["load_imports"] = _load_imports(p.stderr)
    except subprocess.TimeoutExpired:
        out[key] = {"error": f"timed out after {timeout:.0f} s"}
    out[key]["wall_s"] = time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/engine_artifacts"))
    ap.add_argument("--model", default="inception_v3")
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--seconds", type=float, default=520, help="stop starting steps after this long; no step outlives it")
    ap.add_argument("--step-seconds", type=float, default=200, help="the most one step may take")
    ap.add_argument("--measure-seconds", type=float, default=None,
                    help="the search builds' measurement budget (default: the build's own default)")
    ap.add_argument("--steps", default=None, help="GPU default: " + ",".join(GPU_STEPS) + "; --cpu: inductor,aoti,jit,mega")
    # child mode
    ap.add_argument("--cpu", action="store_true", help="the CPU proxy (no GPU): per branch of --model (a zoo model)")
    ap.add_argument("--branches", type=int, default=4)
    ap.add_argument("--child", choices=["load", "mega-save", "mega-load", "build", "cpu-build", "cpu-aoti", "cpu-inductor",
                                        "cpu-jit", "cpu-mega-load"])
    ap.add_argument("--result")
    ap.add_argument("--bundle")
    ap.add_argument("--onnx")
    ap.add_argument("--artifacts")
    ap.add_argument("--artifact", default="inductor", choices=["inductor", "inductor-kernels", "inductor-bundled",
                                                                 "inductor-cache", "aoti", "jit"])
    ap.add_argument("--search", default="off")
    ap.add_argument("--verify", default="off")
    ap.add_argument("--profile", action="store_true", help="child: the load under cProfile")
    ap.add_argument("--baseline", action="store_true", help="child: the load without prepare_load, the aliasing check on")
    args = ap.parse_args(argv)
    if args.child:
        res = child(args)
        Path(args.result).write_text(json.dumps(res, indent=1, default=str))
        return 0

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="engine-artifacts-"))
    deadline = T_START + args.seconds
    res: dict = {"model": args.model}
    steps = (args.steps or ",".join(GPU_STEPS)).split(",")

    def save():
        (out_dir / "engine_artifacts.json").write_text(json.dumps(res, indent=1, default=str))

    import torch

    res["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    res["torch"] = torch.__version__
    if args.cpu:
        res["device"] = f"cpu ({os.cpu_count()} cores)"
        cpu_main(args, res, work, save)
        res["total_s"] = time.perf_counter() - T_START
        save()
        print(json.dumps(res, indent=1, default=str))
        return 0
    sys.path.insert(0, str(ROOT / "bench"))
    from parastream.pipeline.zoo import MODELS

    t0 = time.perf_counter()
    onnx_path = work / f"{args.model}.onnx"
    if args.model in MODELS:  # a zoo model (small, no torchvision): a quick run
        import onnx

        onnx.save(MODELS[args.model](), onnx_path)
    else:
        from gpu import export, make_model  # bench/gpu.py: the models of the H100 table

        model, inputs = make_model(args.model)
        export(model, inputs, onnx_path)
    res["export_s"] = time.perf_counter() - t0
    save()
    common = ["--onnx", str(onnx_path), "--runs", str(args.runs)]

    def step(key: str, argv: list[str], need: float, flags: tuple = ()) -> bool:
        """Run one step in a fresh process with empty caches unless fewer than ``need`` seconds are left."""
        left = deadline - time.perf_counter()
        if left < need:
            res[key] = {"skipped": f"{left:.0f} s left"}
            save()
            return False
        run_child(res, key, argv, _fresh_env(), min(left, args.step_seconds), flags)
        save()
        return "error" not in res[key]

    # the engines of one plan (no search), built per artifact, then loaded, each in a fresh process
    art = work / "cache_artifacts.bin"
    for s in steps:
        kind, _, what = s.partition(":")
        if kind == "search":  # search:<artifact>: the whole build with the default search, then its load
            out = work / f"search_{what}"
            budget = ["--measure-seconds", str(args.measure_seconds)] if args.measure_seconds is not None else []
            if step(f"search_build_{what}", ["--child", "build", "--artifact", what, "--search", "on", "--verify", "on",
                                             *budget, "--bundle", str(out), *common], 60):
                step(f"search_load_{what}", ["--child", "load", "--bundle", str(out), *common], 20)
        elif kind == "build":
            step(f"build_{what}", ["--child", "build", "--artifact", what, "--bundle", str(work / what), *common], 20)
        elif kind == "profile":  # profile:<artifact>: its load again, under cProfile
            if (work / what).is_dir():
                step(f"profile_{what}", ["--child", "load", "--profile", "--bundle", str(work / what), *common], 20)
        elif kind == "load" and what == "jit":  # also collects Inductor's cache artifacts for "mega"
            step("load_jit", ["--child", "mega-save", "--bundle", str(work / "jit"), "--artifacts", str(art), *common], 30)
        elif kind == "load" and what == "mega":
            if art.is_file():
                step("load_mega", ["--child", "mega-load", "--bundle", str(work / "jit"), "--artifacts", str(art), *common], 20)
        elif kind in ("importtime", "importtimebase"):  # its load (or the baseline load) again under -X importtime
            if (work / what).is_dir():
                base = ["--baseline"] if kind == "importtimebase" else []
                step(f"{kind}_{what}", ["--child", "load", *base, "--bundle", str(work / what), *common], 20,
                     ("-X", "importtime"))
        elif kind == "loadbase":  # loadbase:<artifact>: the baseline load (no prepare_load, aliasing check on)
            if (work / what).is_dir():
                step(f"loadbase_{what}", ["--child", "load", "--baseline", "--bundle", str(work / what), *common], 20)
        elif kind == "load":
            if (work / what).is_dir():
                step(f"load_{what}", ["--child", "load", "--bundle", str(work / what), *common], 20)
        else:
            raise SystemExit(f"--steps: unknown step {s!r}")
    res["total_s"] = time.perf_counter() - T_START
    save()
    print(json.dumps(res, indent=1, default=str)[-6000:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
