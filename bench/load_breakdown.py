#!/usr/bin/env python3
"""Where a fresh process's ``parastream.launcher.load(bundle)`` spends its time, stage by stage, per model.

For each timm model (random weights, BatchNorm calibrated, TorchScript export at opset 17, fp16, batch 1) it builds
a torch bundle (``search=False, measure=False``: the engines, in the format a default build ships, and the
verification; no rewrite search, no timed alternatives) with each code tree given, then loads every bundle in
fresh processes, ``--reps`` times, interleaved (rep by rep, model by model, tree by tree), each process with new
empty Inductor and Triton caches (TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR).  A load process records:

  import_torch_s, import_parastream_s   the imports, timed in the process before the load
  open_s                                 ``Bundle.open`` (hashes, the context made beside them)
  load_s                                 ``parastream.launcher.load(bundle)``: open, engines, warm-up, capture
  total_s                                import torch + load: the figure the 3 s target is about
  process_to_ready_s                     from the process's start (the interpreter's own start included)
  phases                                 the launcher's (``launcher.gpu.load_phases``): unpack, weights, artifact,
                                         warm (summed over engines), engines (the loading loop), warm_wall, ready
  probes                                 kernels artifacts: cubin module loads (s, count), the artifact's whole
                                         load (cubins + wrapper executed); Inductor's own artifacts' loads;
                                         torch's CUDA start (``torch.cuda._lazy_init``'s ``_cuda_init`` and
                                         ``_register_triton_kernels``)
  engines                                per format shipped (``compiled``: kernels / inductor / none) and each
                                         ``kernels_error`` with its count; engines compiled at load; Triton
                                         kernels; imports the wrappers made at run
  imported                               torch._inductor / triton modules imported by the end of the load
  cache_files                            files the load wrote into the empty Inductor / Triton caches (a compile
                                         or an autotune at load writes some)
  cuda_module_loading, cudnn             the CUDA module loading mode torch runs under, cuDNN's version

With ``--profile`` one more load per (model, tree) runs under cProfile, every engine warmed in the loading thread
(a launcher's warm-up threads would be invisible to cProfile), and keeps the top functions by cumulative and own
time; that load also records every convolution call (``conv_calls``): torch's cuDNN plans are cached per key
(shapes, strides, groups, dtype, layout and each pointer's alignment), so it counts the distinct keys, the seconds
of each key's first call (synchronized: the plan's build) against the repeats', the pointer alignments seen, and
the keys that cost most.  Each load also times 200 graph replays back to back (``replay_ms``): a load-side change must not cost latency.

Builds record their wall time, report.json's per-stage ``timings`` and the shipped formats.

Run on the device after ``source bench/device_env.sh``:
    python3 bench/load_breakdown.py --models mixnet_s,ghostnet_100,mobilevit_xs,nasnetalarge,inception_v4 \\
        --trees now=. [--trees before=/path/to/other/checkout] --reps 3 [--profile] --out $OUT
``--env NAME:KEY=VALUE`` runs the tree NAME's loads with an environment variable set; ``--build-option
NAME:KEY=VALUE`` builds the tree NAME's bundles with a build option (``--trees`` may name a path twice); ``--bundles-of NAME=OTHER`` has
NAME load OTHER's bundles instead of building its own (for load-side changes; ``--trees`` may name a path twice).
Prints one JSON line per build and load and a table (median of the reps per model and tree: total, load, the
largest stages); writes load_breakdown.json to --out (rewritten after every step, so a run cut short keeps what
it did).
"""

from __future__ import annotations

import time

T_START = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402
from pathlib import Path  # noqa: E402

HERE = Path(__file__).resolve().parent
MODELS = ("mixnet_s", "ghostnet_100", "mobilevit_xs", "nasnetalarge", "inception_v4")


# -- children ---------------------------------------------------------------------------------------------
def export_child(name: str, path: str) -> dict:
    """The timm model ``name`` with random weights, exported to ONNX at ``path``."""
    sys.path.insert(0, str(HERE))
    import timm
    import torch

    import corpus
    from gpu import export

    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False)
    size = model.default_cfg.get("input_size", (3, 224, 224))
    x = torch.randn(1, *size)
    corpus.init_zero_linears(model)
    corpus.calibrate_batchnorm(model.eval(), x)
    t0 = time.perf_counter()
    export(model.eval(), {"x": x}, Path(path))
    import onnx

    return {"export_s": time.perf_counter() - t0, "nodes": len(onnx.load(path, load_external_data=False).graph.node),
            "input": list(x.shape)}


def build_child(onnx_path: str, out: str, options: str = "{}") -> dict:
    """A torch bundle of ``onnx_path`` (fp16, no search, no timed alternatives, ``options``: more build options as
    JSON): wall time, report.json's stages, the formats its engines ship in."""
    from parastream.pipeline import build

    t0 = time.perf_counter()
    bundle = build(onnx_path, out, backend="torch", precision="fp16", search=False, measure=False, force=True,
                   **json.loads(options))
    res = {"build_s": time.perf_counter() - t0, "timings": bundle.report.get("timings"),
           "streams": bundle.plan.num_streams, "branches": len(bundle.plan.branches)}
    engines = bundle.report.get("engines") or {}
    formats: dict = {}
    errors: dict = {}
    for e in engines.values():
        if not isinstance(e, dict):
            continue
        formats[str(e.get("compiled"))] = formats.get(str(e.get("compiled")), 0) + 1
        for key in ("kernels_error", "aot_error"):
            if e.get(key):
                errors[f"{key}: {e[key]}"] = errors.get(f"{key}: {e[key]}", 0) + 1
    res["formats"], res["errors"] = formats, errors
    v = bundle.report.get("verification") or {}
    res["verification"] = {"passed": v.get("passed"), "engines_compiled_at_load": v.get("engines_compiled_at_load")}
    res["engine_bytes"] = sum(p.stat().st_size for p in Path(out, "engines").glob("*") if p.is_file())
    return res


def _age_at_start() -> float:
    """Seconds from this process's start (/proc) to T_START: the interpreter's own start."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK") - (time.perf_counter() - T_START))
    except (OSError, ValueError, IndexError):
        return 0.0


def _timed(owner, attr: str, acc: dict, key: str, count: str | None = None, when=None):
    """Wrap ``owner.attr`` so that its calls add their seconds to ``acc[key]`` (those ``when(args)`` accepts)."""
    fn = getattr(owner, attr, None)
    if fn is None:
        return

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            if when is None or when(args):
                acc[key] = acc.get(key, 0.0) + time.perf_counter() - t0
                if count:
                    acc[count] = acc.get(count, 0) + 1

    setattr(owner, attr, wrapper)


def _alignment(t) -> int:
    """The largest power of two up to 16 dividing the tensor's address: the alignment torch's cuDNN key holds."""
    a = t.data_ptr()
    return next(n for n in (16, 8, 4, 2, 1) if a % n == 0)


def _conv_recorder(torch, acc: dict):
    """Wrap ``torch.convolution`` (what the engines' wrappers call for cuDNN's convolutions) so that every call is
    timed (synchronized) under an approximation of torch's cuDNN cache key."""
    fn = torch.convolution
    seen: dict = {}

    names = ("input", "weight", "bias", "stride", "padding", "dilation", "transposed", "output_padding", "groups")

    def convolution(*args, **kwargs):  # the wrappers pass some arguments by keyword
        a = dict(zip(names, args), **kwargs)
        x, w, b, groups = a["input"], a["weight"], a.get("bias"), a["groups"]
        key = (tuple(x.shape), tuple(x.stride()), tuple(w.shape), tuple(w.stride()), tuple(a["stride"]),
               tuple(a["padding"]), tuple(a["dilation"]), bool(a["transposed"]), int(groups), str(x.dtype),
               b is not None, _alignment(x), _alignment(w))
        if x.is_cuda and torch.cuda.is_current_stream_capturing():  # the capture's calls: no sync may run there
            return fn(*args, **kwargs)
        sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
        sync()
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            sync()
            dt = time.perf_counter() - t0
            first = key not in seen
            seen[key] = seen.get(key, 0.0) + dt
            acc["calls"] = acc.get("calls", 0) + 1
            acc["first_s" if first else "repeat_s"] = acc.get("first_s" if first else "repeat_s", 0.0) + dt
            if first:
                for side, t in (("x", x), ("w", w)):
                    h = acc.setdefault(f"{side}_alignment", {})
                    h[str(_alignment(t))] = h.get(str(_alignment(t)), 0) + 1
                shape_only = key[:11]
                acc.setdefault("_shapes", set()).add(shape_only)
                dw = acc.setdefault("_depthwise", {})
                if int(groups) > 1 and int(groups) == x.shape[1]:
                    dw["keys"] = dw.get("keys", 0) + 1
                    dw["s"] = dw.get("s", 0.0) + dt

    torch.convolution = convolution

    def summary() -> dict:
        out = {k: v for k, v in acc.items() if not k.startswith("_")}
        out["keys"] = len(seen)
        out["keys_without_alignment"] = len(acc.get("_shapes", ()))
        out["depthwise_keys"] = acc.get("_depthwise", {})
        out["top_keys"] = [[repr(k), round(v, 4)] for k, v in sorted(seen.items(), key=lambda kv: -kv[1])[:12]]
        return out

    return summary


def _files(d: str | None) -> int:
    return sum(len(f) for _, _, f in os.walk(d)) if d and os.path.isdir(d) else 0


def load_child(bundle_path: str, profile: bool) -> dict:
    """One fresh process's load of the bundle, stage by stage (module docstring)."""
    t0 = time.perf_counter()
    import torch

    t_torch = time.perf_counter()
    import parastream.launcher as L
    from parastream.launcher import gpu as G
    from parastream.launcher.bundle import Bundle
    from parastream.launcher.engines import torch as tb

    t_ps = time.perf_counter()
    acc: dict = {}
    try:
        from parastream.launcher.engines import inductor_kernels as ik

        _timed(ik._Kernel, "__init__", acc, "cubin_load_s", "cubins")
        _timed(ik.KernelsArtifact, "_load", acc, "kernels_artifact_load_s", "kernels_artifacts")
    except ImportError:
        pass
    _timed(tb, "_load_artifact", acc, "inductor_artifact_load_s", "inductor_artifacts",
           when=lambda a: (a[1] or {}).get("compiled") != "kernels")
    _timed(Bundle, "open", acc, "open_s")  # (a classmethod: the wrapper calls it bound, as ``Bundle.open`` is called)
    # torch's own CUDA start, where the load's first CUDA call makes it (``torch.cuda._lazy_init``, called at every
    # CUDA call and so not wrapped: its context start and, in torch 2.x, its registration of torch.sparse's Triton
    # kernels, which it runs in the calling thread)
    _timed(torch.cuda, "_register_triton_kernels", acc, "torch_register_triton_kernels_s")
    _timed(torch._C, "_cuda_init", acc, "torch_cuda_init_s")
    prof = None
    conv_acc: dict = {}
    if profile:
        import cProfile

        def submit(self, branch, engine):  # every engine warmed here, where cProfile sees it
            la = self.launcher
            s = 0 if la.single_stream else branch.stream
            engine.warm(la._h(la.streams[s] if la.streams else la.origin))

        if hasattr(G, "_Warming"):  # a launcher that warms engines in threads of their own
            G._Warming.submit = submit
        conv_summary = _conv_recorder(torch, conv_acc)
        prof = cProfile.Profile()
        prof.enable()
    t1 = time.perf_counter()
    la = L.load(bundle_path)
    t2 = time.perf_counter()
    if prof is not None:
        prof.disable()
    cpu = os.times()  # the process's CPU seconds by then, every thread: against total_s, what ran and what waited
    res = {"cpu_s": cpu.user + cpu.system, "import_torch_s": t_torch - t0, "import_parastream_s": t_ps - t_torch, "load_s": t2 - t1,
           "total_s": t2 - t0, "process_to_ready_s": _age_at_start() + t2 - T_START,
           "probes": {k: round(v, 4) if isinstance(v, float) else v for k, v in acc.items()},
           "phases": G.load_phases(la)}
    plans = sys.modules.get("parastream.launcher.engines.cudnn_plans")
    if plans is not None:  # the engines' cuDNN plans: shipped and deserialized, or built in this process
        res["cudnn_plans"] = plans.plan_sources()
        res["cudnn_plans_refused"] = plans.plans_refused()
    res["open_s"] = acc.get("open_s")
    formats: dict = {}
    errors: dict = {}
    kernels = 0
    imports_at_run: set = set()
    at_load = 0
    for e in la.engines:
        if e is None:
            continue
        meta = getattr(e, "meta", {}) or {}
        formats[str(meta.get("compiled"))] = formats.get(str(meta.get("compiled")), 0) + 1
        if meta.get("kernels_error"):
            errors[meta["kernels_error"]] = errors.get(meta["kernels_error"], 0) + 1
        info = meta.get("kernels") or {}
        kernels += int(info.get("kernels", 0)) if isinstance(info, dict) else 0
        imports_at_run.update(info.get("imports_at_run", []) if isinstance(info, dict) else [])
        at_load += bool(getattr(e, "compiled_at_load", False))
    res["engines"] = {"count": sum(formats.values()), "formats": formats, "kernels_errors": errors,
                      "compiled_at_load": at_load, "triton_kernels": kernels, "imports_at_run": sorted(imports_at_run)}
    res["imported"] = {p: sum(1 for m in list(sys.modules) if m == p or m.startswith(p + "."))
                       for p in ("torch._inductor", "triton", "torch._dynamo")}
    res["cache_files"] = {"inductor": _files(os.environ.get("TORCHINDUCTOR_CACHE_DIR")),
                          "triton": _files(os.environ.get("TRITON_CACHE_DIR"))}
    res["cuda_module_loading"] = os.environ.get("CUDA_MODULE_LOADING")
    res["cudnn"] = torch.backends.cudnn.version()
    res["cudnn_benchmark"] = bool(torch.backends.cudnn.benchmark)
    import numpy as np

    x = {s.name: np.random.default_rng(0).standard_normal(s.shape).astype(s.dtype) for s in la.plan.inputs}
    t3 = time.perf_counter()
    out = la(x)
    res["first_call_s"] = time.perf_counter() - t3
    res["finite"] = all(bool(np.isfinite(np.asarray(v, dtype=np.float64)).all()) for v in out.values())
    for _ in range(20):
        la.launch()
    la.synchronize()
    t4 = time.perf_counter()
    for _ in range(200):  # graph replays back to back: the GPU's time per replay
        la.launch()
    la.synchronize()
    res["replay_ms"] = (time.perf_counter() - t4) / 200 * 1e3
    if prof is not None:
        import io
        import pstats

        res["conv_calls"] = conv_summary()
        for key, n in (("cumulative", 45), ("tottime", 30)):
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats(key).print_stats(n)
            res[f"profile_{key}"] = [ln for ln in s.getvalue().splitlines() if ln.strip()][:n + 12]
    la.close()
    return res


# -- parent -----------------------------------------------------------------------------------------------
def _ns(tree: str, name: str, work: Path) -> str:
    """A folder whose parastream/{core,launcher,pipeline,rewrite} are ``tree``'s: the PYTHONPATH entry of its code
    (a tree without core/ has none: its layers held what core holds)."""
    d = work / "ns" / name / "parastream"
    d.mkdir(parents=True, exist_ok=True)
    for sub in ("core", "launcher", "pipeline", "rewrite"):
        link = d / sub
        if link.is_symlink() or link.exists():
            link.unlink()
        if (Path(tree) / sub).is_dir():
            link.symlink_to(Path(tree).resolve() / sub)
    return str(d.parent)


def _child(args: list[str], ns: str | None, env_extra: dict | None = None, timeout: float = 600) -> dict:
    env = dict(os.environ, **(env_extra or {}))
    if ns:
        rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and not p.rstrip("/").endswith("/ns")]
        env["PYTHONPATH"] = os.pathsep.join([ns, *rest])
    try:
        p = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        return {"error": f"timed out after {timeout:.0f} s", "stderr": str(e.stderr or "")[-1500:]}
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
    return json.loads(line[7:]) if line else {"error": f"exit {p.returncode}", "stderr": p.stderr[-3000:]}


def _median(xs):
    xs = sorted(x for x in xs if isinstance(x, (int, float)))
    if not xs:
        return None
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def summarize(loads: list[dict]) -> dict:
    """Per model and tree: medians of the reps' stages."""
    out: dict = {}
    for r in loads:
        if "error" in r or r.get("profiled"):
            continue
        out.setdefault(r["model"], {}).setdefault(r["tree"], []).append(r)
    summary: dict = {}
    for model, trees in out.items():
        for tree, rows in trees.items():
            ph = lambda k: _median([r["phases"].get(k) for r in rows])  # noqa: E731
            pr = lambda k: _median([r["probes"].get(k) for r in rows])  # noqa: E731
            summary.setdefault(model, {})[tree] = {
                "n": len(rows), "total_s": _median([r["total_s"] for r in rows]),
                "replay_ms": _median([r.get("replay_ms") for r in rows]),
                "totals": [round(r["total_s"], 2) for r in rows],
                "import_torch_s": _median([r["import_torch_s"] for r in rows]),
                "load_s": _median([r["load_s"] for r in rows]), "open_s": _median([r.get("open_s") for r in rows]),
                "engines_s": ph("engines"), "artifact_s": ph("artifact"), "weights_s": ph("weights"),
                "warm_s": ph("warm"), "warm_wall_s": ph("warm_wall"), "ready_s": ph("ready"),
                "cubin_load_s": pr("cubin_load_s"), "kernels_artifact_load_s": pr("kernels_artifact_load_s"),
                "inductor_artifact_load_s": pr("inductor_artifact_load_s"),
                "engines": rows[0]["engines"], "imported": rows[0]["imported"], "cache_files": rows[0]["cache_files"]}
    return summary


def table(summary: dict, builds: dict) -> str:
    hdr = ("model", "tree", "engines", "formats", "total s", "import", "load", "open", "artifacts", "cubins",
           "warm(wall)", "capture+", "replay ms", "build s")
    rows = [hdr]
    f = (lambda v: f"{v:.2f}" if isinstance(v, (int, float)) else "-")
    for model, trees in summary.items():
        for tree, s in trees.items():
            e = s["engines"]
            fm = ",".join(f"{k}:{v}" for k, v in sorted(e["formats"].items()))
            # the launcher's own warm-up launch and capture: after the loads and, where threads warmed them, the
            # last of those warm-ups
            capture = (s["ready_s"] - max(s["engines_s"], s["warm_wall_s"] or 0)) \
                if s["ready_s"] is not None and s["engines_s"] is not None else None
            b = builds.get(f"{tree}/{model}", {})
            rows.append((model, tree, str(e["count"]), fm, f(s["total_s"]), f(s["import_torch_s"]), f(s["load_s"]),
                         f(s["open_s"]), f(s["artifact_s"]), f(s["cubin_load_s"]), f(s["warm_wall_s"]), f(capture),
                         f"{s['replay_ms']:.3f}" if s.get("replay_ms") else "-", f(b.get("build_s"))))
    w = [max(len(r[i]) for r in rows) for i in range(len(hdr))]
    return "\n".join("  ".join(c.rjust(x) for c, x in zip(r, w)) for r in rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--trees", action="append", default=None, help="NAME=PATH of a checkout (repeatable; default now=.)")
    ap.add_argument("--env", action="append", default=None, help="NAME:KEY=VALUE: the tree NAME's loads run with it")
    ap.add_argument("--build-option", action="append", default=None,
                    help="NAME:KEY=VALUE: the tree NAME's builds take this build option (a JSON value or a string)")
    ap.add_argument("--bundles-of", action="append", default=None,
                    help="NAME=OTHER: the tree NAME builds nothing and loads OTHER's bundles (a load-side change)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="one more load per (model, tree) under cProfile")
    ap.add_argument("--build-jobs", type=int, default=2, help="builds side by side (compile workers split between them)")
    ap.add_argument("--deadline", type=float, default=560.0, help="seconds after which no new load starts")
    ap.add_argument("--work", default="/tmp/load_breakdown")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/bench_out"))
    ap.add_argument("--child", choices=("export", "build", "load"), help=argparse.SUPPRESS)
    ap.add_argument("--args", nargs="*", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        try:
            if a.child == "export":
                res = export_child(*a.args)
            elif a.child == "build":
                res = build_child(*a.args)
            else:
                res = load_child(a.args[0], a.args[1] == "1")
        except Exception as e:  # noqa: BLE001 - the parent records it and goes on
            import traceback

            traceback.print_exc()
            res = {"error": f"{type(e).__name__}: {e}"[:1500]}
        print("RESULT " + json.dumps(res, default=str), flush=True)
        return 0
    trees = dict(t.split("=", 1) for t in (a.trees or ["now=."]))
    envs: dict = {}
    for item in a.env or []:  # NAME:KEY=VALUE
        name, _, kv = item.partition(":")
        k, _, v = kv.partition("=")
        envs.setdefault(name, {})[k] = v
    build_options: dict = {}
    for item in a.build_option or []:  # NAME:KEY=VALUE
        name, _, kv = item.partition(":")
        k, _, v = kv.partition("=")
        try:
            value = json.loads(v)
        except ValueError:
            value = v
        build_options.setdefault(name, {})[k] = value
    bundles_of = dict(t.split("=", 1) for t in (a.bundles_of or []))  # NAME=OTHER: NAME loads OTHER's bundles
    models = a.models.split(",")
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    ns = {name: _ns(path, name, work) for name, path in trees.items()}
    doc: dict = {"models": models, "trees": trees, "build_options": build_options, "reps": a.reps, "exports": {}, "builds": {}, "loads": []}
    try:
        import torch

        doc["device"] = torch.cuda.get_device_name(0)
        doc["torch"] = torch.__version__
    except Exception as e:  # noqa: BLE001
        doc["device"] = f"? {e}"

    def save():
        doc["summary"] = summarize(doc["loads"])
        (out / "load_breakdown.json").write_text(json.dumps(doc, indent=1, default=str))

    cores = os.cpu_count() or 2
    with ThreadPoolExecutor(min(4, len(models))) as pool:
        paths = {m: str(work / f"{m}.onnx") for m in models}
        for m, r in zip(models, pool.map(lambda m: _child(["--child", "export", "--args", m, paths[m]], ns[next(iter(ns))],
                                                         {"CUDA_VISIBLE_DEVICES": ""}), models)):
            doc["exports"][m] = r
            print(json.dumps({"export": m, **r}), flush=True)
    save()
    jobs = [(t, m) for m in models for t in trees if t not in bundles_of and "error" not in doc["exports"][m]]
    workers = str(max(1, (cores - 1) // max(1, a.build_jobs)))

    def one_build(tm):
        t, m = tm
        return tm, _child(["--child", "build", "--args", paths[m], str(work / t / m), json.dumps(build_options.get(t, {}))],
                          ns[t],
                          {"PARASTREAM_COMPILE_WORKERS": workers})

    with ThreadPoolExecutor(max(1, a.build_jobs)) as pool:
        for (t, m), r in pool.map(one_build, jobs):
            doc["builds"][f"{t}/{m}"] = r
            print(json.dumps({"build": f"{t}/{m}", **r}), flush=True)
            save()
    built = [(t, m) for t, m in jobs if "error" not in doc["builds"][f"{t}/{m}"]]
    built += [(t, m) for t, other in bundles_of.items() for m in models if (other, m) in built]
    rounds = [(rep, False) for rep in range(a.reps)]
    if a.profile:  # after the first round: a run cut short by --deadline keeps the profile rather than a third rep
        rounds.insert(1, (a.reps, True))
    reps = [(rep, m, t, profiled) for rep, profiled in rounds for m in models for t in trees if (t, m) in built]
    for rep, m, t, profiled in reps:
        if time.perf_counter() - T_START > a.deadline:
            doc.setdefault("skipped", []).append([rep, m, t, profiled])
            continue
        d = tempfile.mkdtemp(prefix="lb-caches-")
        r = _child(["--child", "load", "--args", str(work / bundles_of.get(t, t) / m), "1" if profiled else "0"], ns[t],
                   {"TORCHINDUCTOR_CACHE_DIR": f"{d}/inductor", "TRITON_CACHE_DIR": f"{d}/triton", **envs.get(t, {})},
                   timeout=180)
        r.update(model=m, tree=t, rep=rep, profiled=profiled)
        doc["loads"].append(r)
        brief = {k: r.get(k) for k in ("model", "tree", "rep", "profiled", "total_s", "load_s", "import_torch_s",
                                       "open_s", "phases", "cudnn_plans", "cudnn_plans_refused", "probes", "engines",
                                       "imported", "cache_files", "error")}
        print(json.dumps(brief, default=str), flush=True)
        if profiled and "profile_cumulative" in r:
            print("\n".join(r["profile_cumulative"][:40] + r.get("profile_tottime", [])[:30]), flush=True)
            print(json.dumps({"conv_calls": r.get("conv_calls")}), flush=True)
        save()
    save()
    print(table(doc["summary"], doc["builds"]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
