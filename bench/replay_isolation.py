#!/usr/bin/env python3
"""Whether a bundle's CUDA Graph keeps replaying correctly beside what else a user's process runs: its own
engines shared by a one-stream launcher, ``torch.compile(mode="reduce-overhead")`` of the PyTorch model (its own
CUDA Graphs and memory pool), garbage collection and torch's cache emptied.  Each step runs in a fresh process
on one bundle, so that a step that breaks the CUDA context (an illegal address or instruction) names itself
and leaves the next steps theirs.  Run on the device machine from the repository root after
``source bench/device_env.sh``:

    python3 bench/replay_isolation.py --models nasnetalarge --out $OUT

Steps (``--steps``; each checks the bundle's outputs against onnxruntime's after every part):

  alone          the bundle's launcher: call, 200 timed replays (pipeline.bench.measure), gc + empty_cache, again
  one_stream     and a one-stream launcher over the same engines (what ``parastream bench`` and the corpus time)
  compile_after  the launcher, then torch.compile of the model run beside it, then both timed
  compile_first  torch.compile first, then the launcher, then both timed
  corpus         bench/corpus_gpu.py's timing order: launcher, one-stream launcher, torch.compile, all three timed

A step may take variants after a colon (``compile_after:nograph+nopool``), which say what of the launcher's
process state to leave out, so that a step that fails can be narrowed down to its cause:

  nograph   the launcher replays without a CUDA Graph (direct launches)
  closed    the launcher is closed before torch.compile runs (its engines, streams and graph released)
  default   torch.compile without CUDA Graphs (``mode="default"``)
  nowarmer  the engines warmed and the plan captured in the loading thread (no warm-up thread)
  nopool    the launcher's allocations in torch's default pool (no private MemPool)
  v7        cuDNN's legacy API (``TORCH_CUDNN_V8_API_DISABLED=1``: no per-thread execution plans)
  snapshot  torch's allocator state after the load and after torch.compile (``torch.cuda.memory._snapshot``,
            allocation history with Python stacks): per pool, segments and live bytes on the launcher's streams,
            and what allocated each live block on them outside the launcher's own pool

``--parallel N`` runs N steps at once (a correctness probe, not a timing: the times it prints are then shared).

The bundle is built without the measured search (``--search`` adds it), as a default build's engines.  Writes
OUT/replay_isolation.json: per model and step, ``ok`` or the error and the part that raised it.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

STEPS = ("alone", "one_stream", "compile_after", "compile_first", "corpus")


def prepare(name: str, work: Path, search: bool) -> dict:
    from gpu import build_bundle, export_with_reference

    _, _, onnx_path, feeds, ref, export_s = export_with_reference(name, work, 1)
    np.savez(work / f"{name}.ref.npz", **{f"in.{k}": v for k, v in feeds.items()}, **{f"out.{k}": v for k, v in ref.items()})
    log: dict = {"handmade": False, "top_k": 20}
    build_bundle(onnx_path, work / f"{name}_bundle", search=search, streams=None, log=log, measure_seconds=20)
    return {"export_s": export_s, "build_s": log["build_s"], "schedule": log.get("schedule"),
            "verification": log.get("verification")}


def step(name: str, what: str, work: Path) -> dict:
    """One step in this (fresh) process; ``part`` names what it was doing when it raised."""
    import contextlib
    import gc

    what, _, extra = what.partition(":")
    variants = set(filter(None, extra.split("+")))
    import torch

    import parastream.launcher.engines.torch as torch_backend

    if "nowarmer" in variants:
        torch_backend.warms_after_load = False
    if "nopool" in variants:
        def null_scope():
            return contextlib.nullcontext()

        torch_backend.memory_scope = lambda: null_scope
    from corpus_gpu import CompiledRunner, HalfInput
    from gpu import make_model, max_err, users_model

    from parastream.launcher.bundle import Bundle
    from parastream.launcher.gpu import GpuLauncher
    from parastream.pipeline.bench import measure

    data = np.load(work / f"{name}.ref.npz")
    feeds = {k[3:]: data[k] for k in data.files if k.startswith("in.")}
    ref = {k[4:]: data[k] for k in data.files if k.startswith("out.")}
    bundle = Bundle.open(work / f"{name}_bundle")
    res: dict = {"model": name, "step": what, "variants": sorted(variants), "errors": {}, "times_ms": {}}
    part = "start"
    la = single = runner = None

    def snapshot(label: str) -> None:
        ours = {la._h(s) for s in [la.origin, *la.streams]}
        pool = tuple(la._scope.pool.id) if hasattr(la._scope, "pool") else None
        by_pool: dict = {}
        outside = []
        for seg in torch.cuda.memory._snapshot()["segments"]:
            if seg["stream"] not in ours:
                continue
            key = "launcher" if tuple(seg["segment_pool_id"]) == pool else str(tuple(seg["segment_pool_id"]))
            agg = by_pool.setdefault(key, {"segments": 0, "bytes": 0, "active_bytes": 0})
            agg["segments"] += 1
            agg["bytes"] += seg["total_size"]
            agg["active_bytes"] += seg["active_size"]
            if key != "launcher":
                for b in seg["blocks"]:
                    if b["state"] == "active_allocated":
                        frames = [f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']} {f['name']}" for f in b.get("frames", [])][:8]
                        outside.append({"address": b["address"], "size": b["size"], "frames": frames})
        res.setdefault("snapshots", {})[label] = {"on_launcher_streams": by_pool, "live_outside_its_pool": outside[:20]}

    def check(label: str) -> None:
        got = la(feeds)
        res["errors"][label] = {k: max_err(got[k], ref[k]) for k in ref}

    def compile_model():
        model = users_model(name, make_model(name)[0])
        mode = "default" if "default" in variants else "reduce-overhead"
        compiled = torch.compile(HalfInput(model.half().cuda()).eval(), mode=mode, dynamic=False)
        r = CompiledRunner(compiled, bundle.plan)
        r.set(feeds)
        for _ in range(3):
            r.launch()
        r.synchronize()
        res["errors"]["torch.compile"] = max_err(r.out.float().cpu().numpy(), next(iter(ref.values())))
        return r

    def timed(label: str, launchers: dict) -> None:
        times = measure(launchers, runs=200, warmup=20, seed=7)
        res["times_ms"][label] = {k: float(np.median(t)) for k, t in times.items()}

    try:
        if what == "compile_first":
            part = "torch.compile"
            runner = compile_model()
        part = "load"
        if "snapshot" in variants:
            torch.cuda.memory._record_memory_history(max_entries=200000, stacks="python")
        la = GpuLauncher(bundle, graph="nograph" not in variants)
        check("load")
        if "snapshot" in variants:
            snapshot("load")
        if "closed" in variants:
            part = "close"
            la.close()
            la = None
            part = "torch.compile"
            runner = compile_model()
            part = "timing"
            timed("compile_alone", {"compile": runner})
            res["ok"] = True
            return res
        if what in ("one_stream", "corpus"):
            part = "one-stream launcher"
            single = GpuLauncher(bundle, single_stream=True, engines=la.engines)
            check("one_stream_loaded")
        if what in ("compile_after", "corpus"):
            part = "torch.compile"
            runner = compile_model()
            if "snapshot" in variants:
                snapshot("compiled")
            check("compiled")
        part = "timing"
        timed("first", {"parastream": la, **({"one_stream": single} if single else {}),
                        **({"compile": runner} if runner else {})})
        check("timed")
        part = "gc and empty_cache"
        gc.collect()
        torch.cuda.empty_cache()
        check("gc")
        part = "timing again"
        timed("again", {"parastream": la, **({"one_stream": single} if single else {}),
                        **({"compile": runner} if runner else {})})
        check("timed_again")
        res["ok"] = True
    except BaseException as e:  # noqa: BLE001 - the step's result says what raised, in which part
        res["ok"] = False
        res["part"] = part
        res["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:400]
        res["traceback"] = traceback.format_exc()[-3000:]
    return res


def run_step(name: str, what: str, work: Path, out: Path, args) -> dict:
    """``step`` in a fresh process: its result, or how the process ended."""
    env = dict(os.environ)
    if "v7" in what.partition(":")[2].split("+"):
        env["TORCH_CUDNN_V8_API_DISABLED"] = "1"
    t0 = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, __file__, "--work", str(work), "--out", str(out), "--child", name, what],
                           capture_output=True, text=True, timeout=args.step_timeout, env=env)
        line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
        r = json.loads(line[-1][7:]) if line else {"model": name, "step": what, "ok": False,
                                                   "error": f"exit {p.returncode}", "stderr": p.stderr[-2000:]}
        if p.returncode != 0:  # a fault after the step's result (at exit: torch's pools freed)
            r["exit"] = p.returncode
            r["stderr_tail"] = p.stderr[-1500:]
    except subprocess.TimeoutExpired:
        r = {"model": name, "step": what, "ok": False, "error": f"timeout {args.step_timeout} s"}
    r["step"] = what
    r["seconds"] = round(time.perf_counter() - t0, 1)
    return r


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="nasnetalarge")
    ap.add_argument("--steps", default=",".join(STEPS))
    ap.add_argument("--search", action="store_true", help="build with the measured search")
    ap.add_argument("--work", default="/tmp/replay_isolation")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/replay_isolation_out"))
    ap.add_argument("--step-timeout", type=float, default=240)
    ap.add_argument("--parallel", type=int, default=1, help="steps run at once")
    ap.add_argument("--no-prepare", action="store_true", help="the bundle is already under --work")
    ap.add_argument("--child", nargs=2, default=None, help=argparse.SUPPRESS)  # MODEL STEP: one step, this process
    args = ap.parse_args(argv)
    work, out = Path(args.work), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    if args.child:
        print("RESULT " + json.dumps(step(args.child[0], args.child[1], work)), flush=True)
        return 0
    results = []
    for name in [m for m in args.models.split(",") if m]:
        if not args.no_prepare:
            t0 = time.perf_counter()
            prep = prepare(name, work, args.search)
            print(json.dumps({"model": name, "prepared_s": round(time.perf_counter() - t0, 1), **prep}), flush=True)
            results.append({"model": name, "prepare": prep})
        steps = [s for s in args.steps.split(",") if s]
        with concurrent.futures.ThreadPoolExecutor(max(1, args.parallel)) as pool:
            for r in pool.map(lambda what: run_step(name, what, work, out, args), steps):
                print(json.dumps({k: v for k, v in r.items() if k not in ("traceback", "stderr_tail", "stderr")}), flush=True)
                results.append(r)
                (out / "replay_isolation.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
