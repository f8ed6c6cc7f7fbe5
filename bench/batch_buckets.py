#!/usr/bin/env python3
"""Dynamic batch on the GPU: CUDA Graphs per batch bucket against one graph padded to MAX.

Run on the device machine from the repository root, after ``source bench/device_env.sh``, one model per call
(each fits in a 10-minute call; the builds dominate):

    python3 bench/batch_buckets.py --models inception_v3 --out bench_results/buckets
    python3 bench/batch_buckets.py --models bert --out bench_results/buckets

For each model (torchvision Inception-v3 299x299; transformers BERT-base, sequence 128; random weights,
BatchNorm calibrated as bench/gpu.py does), exported to ONNX with a dynamic batch dimension, one bundle is
built with ``--batch 1:16:32`` (torch engines, fp16; buckets 1, 2, 4, 8, 16, 32 by default; search and the
timed alternatives off unless asked, to keep the call short) and loaded three ways in one process:
  * ``buckets``: the BucketedLauncher (one CUDA Graph per bucket over one shared arena);
  * ``batch32``: the MAX bucket loaded alone as a plain bundle (GpuLauncher): one graph at 32, which is
    also "one graph padded to 32" for smaller n;
  * ``batch1``: the batch-1 bucket loaded alone as a plain bundle (what a batch-1 build ships).
At n = 1, 3, 8, 32: (i) CUDA-event timed graph replays (fresh random inputs copied into the graph's input
buffers before each replay, outside the timed region) of the bucket serving n, of the graph at 32, and at
n = 1 of the batch-1 bundle; (ii) host wall-clock latency of a whole call with n rows on the device
(``launcher(feeds)``: padding to the bucket, copy in, replay, synchronise).  Medians after warm-up, variants
alternating in blocks.  Device memory: cudaMemGetInfo before and after each load (torch's pools included).
Each result is checked against onnxruntime (CPU, fp32) on the original model at n.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))  # first: bench/gpu.py is the module ``gpu`` below

from gpu import export, make_model, max_err, ort_reference  # noqa: E402 - bench/gpu.py's models (BatchNorm calibrated)

BATCHES = (1, 3, 8, 32)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def random_feeds(specs, n: int, rng) -> dict:
    """Inputs of n rows: floats N(0, 1); token ids over BERT's vocabulary; masks ones with the tail zero."""
    feeds = {}
    for s in specs:
        shape = [n, *s.shape[1:]]
        if s.name == "input_ids":
            feeds[s.name] = rng.integers(0, 30522, shape).astype(s.dtype)
        elif s.name == "attention_mask":
            m = np.ones(shape, s.dtype)
            m[:, -16:] = 0
            feeds[s.name] = m
        else:
            feeds[s.name] = rng.standard_normal(shape).astype(s.dtype)
    return feeds


def device_used() -> int:
    import torch

    torch.cuda.synchronize()
    free, _total = torch.cuda.mem_get_info()
    return _total - free


def replay_ms(variants: dict, sets: dict, runs: int, warmup: int, block: int = 20) -> dict:
    """CUDA-event timed replays: ``variants`` name -> GpuLauncher, ``sets`` name -> list of device input dicts
    (copied into the launcher's input buffers before each replay, untimed); alternating blocks; medians."""
    import torch

    stream = torch.cuda.current_stream()
    times = {k: [] for k in variants}

    def one(name, i, timed):
        la = variants[name]
        views = la.inputs()
        for k, src in sets[name][i % len(sets[name])].items():
            views[k].torch().copy_(src)
        if timed:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            la.launch(stream=stream.cuda_stream)
            end.record(stream)
            return start, end
        la.launch(stream=stream.cuda_stream)
        return None

    for name in variants:
        for i in range(warmup):
            one(name, i, False)
    torch.cuda.synchronize()
    pending = {k: [] for k in variants}
    while any(len(pending[k]) < runs for k in variants):
        for name in variants:
            for _ in range(min(block, runs - len(pending[name]))):
                pending[name].append(one(name, len(pending[name]), True))
            torch.cuda.synchronize()
    for name, evs in pending.items():
        times[name] = [s.elapsed_time(e) for s, e in evs]
    return {k: float(np.median(v)) for k, v in times.items()}


def call_ms(calls: dict, runs: int, warmup: int, block: int = 20) -> dict:
    """Host wall-clock milliseconds of whole calls (each synchronises), alternating blocks; medians."""
    times = {k: [] for k in calls}
    for fn in calls.values():
        for _ in range(warmup):
            fn()
    while any(len(times[k]) < runs for k in calls):
        for name, fn in calls.items():
            for _ in range(min(block, runs - len(times[name]))):
                t0 = time.perf_counter()
                fn()
                times[name].append((time.perf_counter() - t0) * 1e3)
    return {k: float(np.median(v)) for k, v in times.items()}


def run_model(name: str, args, outdir: Path) -> dict:
    import torch

    from parastream.launcher.buckets import BucketedLauncher, pad_rows
    from parastream.launcher.gpu import GpuLauncher
    from parastream.pipeline import build

    res: dict = {"model": name, "batch": args.batch}
    model, inputs = make_model(name)
    onnx_path = outdir / f"{name}_dyn.onnx"
    t0 = time.perf_counter()
    outs = export(model, inputs, onnx_path, dynamic_batch=True)
    res["export_s"] = time.perf_counter() - t0
    del model
    log(f"{name}: exported ({res['export_s']:.1f} s); building --batch {args.batch}")

    lo, opt, hi = (int(v) for v in args.batch.split(":"))
    shapes = {"input_ids": [opt, 128], "attention_mask": [opt, 128]} if name == "bert" else {}
    t0 = time.perf_counter()
    bundle = build(onnx_path, outdir / f"{name}_buckets", backend="torch", precision="fp16", batch=(lo, opt, hi),
                   batch_buckets=[int(b) for b in args.buckets.split(",")] if args.buckets else None, shapes=shapes,
                   search=args.search, measure=args.measure, measure_seconds=args.measure_seconds,
                   search_options={"top_k": args.top_k}, verify=not args.no_verify, force=True, cache_dir=args.cache_dir)
    res["build_s"] = time.perf_counter() - t0
    rb = bundle.report["buckets"]
    res["buckets"] = {s: {k: r.get(k) for k in ("streams", "branches", "verified", "engine_bytes", "buffer_bytes")}
                      | {"build_s": (r.get("timings") or {}).get("total")} for s, r in rb["per_bucket"].items()}
    res["between_verified"] = (rb.get("between") or {}).get("passed")
    res["memory_report"] = rb["memory"]
    log(f"{name}: built in {res['build_s']:.0f} s: " + ", ".join(f"b{s}: {r['streams']} streams {r['branches']} engines"
                                                                   for s, r in res["buckets"].items()))
    subs = bundle.bucket_bundles()
    sizes = sorted(subs)

    # loads, with the device memory each one takes (torch's pools are never freed, so each delta is its own)
    mem = {}
    t0 = time.perf_counter()
    used = device_used()
    batch_max = GpuLauncher(subs[hi])
    mem["one_graph_at_max"] = device_used() - used
    used = device_used()
    buckets = BucketedLauncher(bundle, device="cuda")
    mem["buckets"] = device_used() - used
    used = device_used()
    batch1 = GpuLauncher(subs[sizes[0]]) if sizes[0] == 1 else None
    mem["batch1_bundle"] = device_used() - used if batch1 is not None else None
    res["device_memory_bytes"] = mem
    res["load_s"] = time.perf_counter() - t0
    log(f"{name}: loaded in {res['load_s']:.0f} s; device memory {mem}")

    rng = np.random.default_rng(7)
    specs = buckets.input_specs
    batched = set(buckets.batched_inputs)
    rows = []
    try:
        for n in BATCHES:
            if not lo <= n <= hi:
                continue
            b = buckets.bucket_for(n)
            sets_np = [random_feeds(specs, n, rng) for _ in range(4)]
            ref = ort_reference(onnx_path, sets_np[0])
            got = buckets(sets_np[0])
            err = {k: max_err(got[k], ref[k]) for k in outs}

            def on_device(feeds, rows_to):
                return {k: torch.from_numpy(pad_rows(v, rows_to) if k in batched else v).cuda() for k, v in feeds.items()}

            sets = {"buckets": [on_device(f, b) for f in sets_np], "padded_to_max": [on_device(f, hi) for f in sets_np]}
            variants = {"buckets": buckets.launchers[b], "padded_to_max": batch_max}
            if n == 1 and batch1 is not None:
                sets["batch1_bundle"] = sets["buckets"]
                variants["batch1_bundle"] = batch1
            replay = replay_ms(variants, sets, args.runs, args.warmup)
            dev_n = {k: torch.from_numpy(v).cuda() for k, v in sets_np[1].items()}
            dev_max = sets["padded_to_max"][1]
            calls = {"buckets": lambda: buckets(dev_n), "padded_to_max": lambda: batch_max(dev_max)}
            if n == 1 and batch1 is not None:
                calls["batch1_bundle"] = lambda: batch1(dev_n)
            call = call_ms(calls, args.runs, args.warmup)
            row = {"n": n, "bucket": b, "replay_ms": replay, "call_ms": call, "max_err_vs_ort": err}
            rows.append(row)
            log(f"{name} n={n} (bucket {b}): replay {json.dumps({k: round(v, 4) for k, v in replay.items()})} "
                f"call {json.dumps({k: round(v, 4) for k, v in call.items()})} err {json.dumps(err)}")
            res["latency"] = rows
            (outdir / f"{name}_buckets.json").write_text(json.dumps(res, indent=2, default=str))
    finally:
        for la in (buckets, batch_max, batch1):
            if la is not None:
                la.close()
    by_n = {r["n"]: r for r in rows}
    if 1 in by_n and "batch1_bundle" in by_n[1]["replay_ms"]:
        r = by_n[1]["replay_ms"]
        res["n1_vs_batch1_bundle"] = r["buckets"] / r["batch1_bundle"]  # target <= 1.10
    if hi in by_n:
        r = by_n[hi]["replay_ms"]
        res["max_vs_batch_max_bundle"] = r["buckets"] / r["padded_to_max"]  # target <= 1.05 (throughput within 5%)
    return res


def table(results: list[dict]) -> str:
    lines = ["| model | n | bucket | buckets replay ms | padded to MAX ms | batch-1 bundle ms | buckets call ms | padded call ms | max err |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for res in results:
        for r in res.get("latency", []):
            rp, c = r["replay_ms"], r["call_ms"]
            b1 = f"{rp['batch1_bundle']:.3f}" if "batch1_bundle" in rp else "-"
            lines.append(f"| {res['model']} | {r['n']} | {r['bucket']} | {rp['buckets']:.3f} | {rp['padded_to_max']:.3f} | {b1} | "
                         f"{c['buckets']:.3f} | {c['padded_to_max']:.3f} | {max(r['max_err_vs_ort'].values()):.2e} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="inception_v3,bert")
    p.add_argument("--batch", default="1:16:32")
    p.add_argument("--buckets", default=None, help="--batch-buckets (default: powers of two)")
    p.add_argument("--runs", type=int, default=100)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--search", action="store_true", help="run the rewrite search per bucket (longer builds)")
    p.add_argument("--measure", action="store_true", help="time the GPU alternatives per bucket (longer builds)")
    p.add_argument("--measure-seconds", type=float, default=60.0)
    p.add_argument("--top-k", type=int, default=3)
    p.add_argument("--no-verify", action="store_true", help="skip the build's verification (it loads every bucket)")
    p.add_argument("--cache-dir", default="/tmp/parastream-bucket-cache")
    p.add_argument("--out", default="bench_results/buckets")
    args = p.parse_args(argv)
    outdir = Path(args.out)
    outdir.mkdir(parents=True, exist_ok=True)
    import torch

    log(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    results = []
    for name in args.models.split(","):
        try:
            results.append(run_model(name, args, outdir))
        except Exception as e:  # noqa: BLE001 - report and go on with the next model
            traceback.print_exc()
            results.append({"model": name, "error": f"{type(e).__name__}: {e}"})
        (outdir / "results.json").write_text(json.dumps(results, indent=2, default=str))
    print(table(results))
    for res in results:
        print(json.dumps({k: res.get(k) for k in ("model", "build_s", "device_memory_bytes", "n1_vs_batch1_bundle",
                                                  "max_vs_batch_max_bundle", "between_verified", "error")}, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
