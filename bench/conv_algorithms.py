#!/usr/bin/env python3
"""cuDNN's convolution algorithms chosen by timing against its heuristics: the same bundle loaded several times in
one process, each load's plans built in a mode of its own, all replays timed side by side.

Why: torch asks cuDNN's heuristics for each convolution's plan (its first choice that builds) unless
``torch.backends.cudnn.benchmark`` is on, in which case it times up to ``benchmark_limit`` candidate plans at the
first call and keeps the fastest; TensorRT's tactic selection is the same idea.  A launcher captures its CUDA
Graph after the warm-up, so plans chosen during the warm-up are the ones every replay runs, and the cost is paid
once per load.  This measures whether it is worth it on dense-convolution models (ResNet-50's one engine is most
of its time in cuDNN) and what it costs a load.

How: each model is exported (fp16 build, static batch) and built once (``search=False``: the one-engine bundle a
default build ships for these models, its conv+ReLU form timed as usual).  Then, in one process, a throwaway
load (Inductor's kernels and cuBLAS loaded, so that the loads compared below differ only in cuDNN's plans), and
one load per mode, each in a thread of its own named ``parastream-warm-<mode>``: a launcher made in such a thread
warms and captures in it, and torch's cuDNN plan cache is per thread and keyed without the benchmark flag, so
every mode builds its own plans.  Modes: ``heuristics`` (torch's default), ``timed`` (benchmark on, torch's
default limit of 10 candidates), ``timed_all`` (benchmark on, every candidate).  The replays are timed in
alternating blocks (``pipeline.bench.measure``), ``--reps`` times; a mode's load seconds are its plans' cost.

Run on the device after ``source bench/device_env.sh``:
    python3 bench/conv_algorithms.py --models resnet50 --batches 1,8,32 --out $OUT
Prints one JSON line per model and batch and a table; writes conv_algorithms.json under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

#: mode -> (torch.backends.cudnn.benchmark, benchmark_limit; 0 is every candidate)
MODES = {"heuristics": (False, 10), "timed": (True, 10), "timed_all": (True, 0)}


def load_in_mode(path: str, mode: str):
    """(launcher, load seconds) of ``path``, loaded in a new thread named for ``mode`` with cuDNN's benchmark
    flag and limit set as the mode says (process-wide flags, restored after the load)."""
    import torch

    from parastream.launcher import load

    flag, limit = MODES[mode]
    out: dict = {}

    def body():
        before = torch.backends.cudnn.benchmark, torch.backends.cudnn.benchmark_limit
        torch.backends.cudnn.benchmark, torch.backends.cudnn.benchmark_limit = flag, limit
        t0 = time.perf_counter()
        try:
            out["launcher"] = load(path)
        except BaseException as e:  # noqa: BLE001 - reported in the row
            out["error"] = f"{type(e).__name__}: {e}"
        finally:
            torch.backends.cudnn.benchmark, torch.backends.cudnn.benchmark_limit = before
        out["load_s"] = round(time.perf_counter() - t0, 3)

    t = threading.Thread(target=body, name=f"parastream-warm-{mode}")
    t.start()
    t.join()
    if "error" in out:
        raise RuntimeError(f"{mode}: {out['error']}")
    return out["launcher"], out["load_s"]


def run(name: str, batch: int, args, work: Path) -> dict:
    from gpu import export, make_model

    from parastream.launcher import load
    from parastream.pipeline import build
    from parastream.pipeline.bench import measure

    model, inputs = make_model(name, batch)
    onnx_path = work / f"{name}_b{batch}.onnx"
    export(model, inputs, onnx_path)
    t0 = time.perf_counter()
    bundle = build(onnx_path, work / f"{name}_b{batch}", backend="torch", precision="fp16", search=False, force=True)
    row: dict = {"model": name, "batch": batch, "build_s": round(time.perf_counter() - t0, 1),
                 "measured_choices": bundle.report.get("measured_choices")}
    path = str(work / f"{name}_b{batch}")
    load(path).close()  # kernels and libraries loaded once before the compared loads
    launchers, load_s = {}, {}
    for mode in args.modes.split(","):
        launchers[mode], load_s[mode] = load_in_mode(path, mode)
    reps = []
    for rep in range(args.reps):
        times = measure(launchers, runs=args.runs, seed=rep)
        reps.append({m: round(float(np.median(t)), 4) for m, t in times.items()})
    first = next(iter(launchers))
    median = {m: round(float(np.median([r[m] for r in reps])), 4) for m in launchers}
    row.update(load_s=load_s, median_ms=median, reps=reps,
               vs_heuristics={m: round(median[first] / median[m], 4) for m in launchers})
    # the modes' outputs on one input: the plans differ, the arithmetic must not (fp16 accumulation order aside)
    feeds = {s.name: np.random.default_rng(7).standard_normal(s.shape).astype(s.dtype)
             for s in launchers[first].input_specs}
    outs = {m: la(feeds) for m, la in launchers.items()}
    row["max_diff_vs_first"] = {m: float(max(np.max(np.abs(outs[m][k].astype(np.float32) -
                                                            outs[first][k].astype(np.float32))) for k in outs[m]))
                                for m in launchers}
    for la in launchers.values():
        la.close()
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="resnet50")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated of {', '.join(MODES)} (the first "
                                                              "is the one the others are compared with)")
    ap.add_argument("--runs", type=int, default=300)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--work", default="/tmp/conv_algorithms")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/conv_algorithms_out"))
    args = ap.parse_args(argv)
    if any(m not in MODES for m in args.modes.split(",")):
        ap.error(f"--modes: each of {', '.join(MODES)}")
    work, out = Path(args.work), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.models.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            try:
                row = run(name, batch, args, work)
            except Exception as e:  # noqa: BLE001 - one row's error, the others still run
                row = {"model": name, "batch": batch, "error": f"{type(e).__name__}: {e}"}
            rows.append(row)
            print(json.dumps(row, default=str), flush=True)
            (out / "conv_algorithms.json").write_text(json.dumps(rows, indent=1, default=str))
    modes = args.modes.split(",")
    print("| model | batch | " + " | ".join(f"{m} ms (load s)" for m in modes) + " | " +
          " | ".join(f"{m} speed-up" for m in modes[1:]) + " |")
    for r in rows:
        if "error" in r:
            print(f"| {r['model']} | {r['batch']} | error: {r['error'][:120]} |")
            continue
        print(f"| {r['model']} | {r['batch']} | " +
              " | ".join(f"{r['median_ms'][m]:.4f} ({r['load_s'][m]:.2f})" for m in modes) + " | " +
              " | ".join(f"{r['vs_heuristics'][m]:.3f}x" for m in modes[1:]) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
