#!/usr/bin/env python3
"""Whether a bundle's launcher runs slower when it is loaded into a process that has already done other GPU work
than when it is loaded first: two launchers of one bundle, timed side by side in one process.

Why: in the corpus table's process the bundles ran 8-9% slower than the same bundles in a fresh process, and in
some whole timings a launcher ran 7-12% faster than its usual (bench/NOTES.md, "Open questions": "Two timing
states of one launcher").  One candidate is where the launcher's memory lands: its arena (cudaMalloc) and its
engines' buffers and weights (torch's allocator), allocated first in a fresh process, or among the buffers of
what the process ran before (the corpus table loads each bundle after torch.compile's models and the other
bundles).  If the table's process slows the bundles, the table understates them against torch.compile, and a
Triton server that loads several models gets the slower state too.

Per model, in a fresh process (``--child``): ``first`` and ``first_again`` are loaded right after torch's import
(two loads of the bundle, which should time alike); then the process does what the corpus table's process does
before it loads a bundle: torch.compile(mode="reduce-overhead") of the PyTorch model as its users run it (its CUDA
Graph trees and memory pool) and ``--churn`` GiB of tensors of random sizes allocated, every other one freed; then
``after`` is loaded.  The three are timed in alternating blocks of CUDA-event timed replays on fresh random inputs
(``pipeline.bench.measure``), ``--repeats`` times, and each back to back (200 replays, the GPU's rate).

Run on the device after ``source bench/device_env.sh``:
    python3 bench/launcher_placement.py --models bert,resnet50 [--bundles DIR] --out $OUT
A model's bundle is built (``--no-search``, fp16) unless ``--bundles DIR`` holds ``DIR/MODEL_bundle``.  Prints a JSON
line per model and writes launcher_placement.json under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def back_to_back_ms(la, n: int = 200) -> float:
    la.launch()
    la.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        la.launch()
    la.synchronize()
    return (time.perf_counter() - t0) / n * 1e3


def child(name: str, bundle: str, repeats: int, churn_gib: float) -> dict:
    import torch
    from corpus_gpu import users_compiled
    from gpu import make_model

    from parastream.launcher.bundle import Bundle
    from parastream.launcher.gpu import GpuLauncher
    from parastream.pipeline.bench import measure

    b = Bundle.open(bundle)
    launchers = {"first": GpuLauncher(b), "first_again": GpuLauncher(b)}
    model, inputs = make_model(name, 1)
    compiled, dev = users_compiled(name, model, inputs)  # what the corpus table's process holds
    rng = np.random.default_rng(0)
    held, total = [], 0
    while total < churn_gib * (1 << 30):
        n = int(rng.integers(1 << 10, 8 << 20))
        held.append(torch.empty(n, dtype=torch.uint8, device="cuda"))
        total += n
    del held[::2]  # every other block freed: the allocator's segments full of holes
    launchers["after"] = GpuLauncher(b)
    row = {"model": name, "churn_gib": churn_gib, "timings": []}
    for _ in range(repeats):
        times = measure(launchers, runs=200, warmup=20, seed=int(rng.integers(1 << 30)))
        row["timings"].append({k: round(float(np.median(t)), 4) for k, t in times.items()})
    for k in ("first", "after"):
        row[f"{k}_medians_ms"] = [t[k] for t in row["timings"]]
    row["after_over_first"] = [round(t["after"] / t["first"], 4) for t in row["timings"]]
    row["first_again_over_first"] = [round(t["first_again"] / t["first"], 4) for t in row["timings"]]
    row["back_to_back_ms"] = {k: round(back_to_back_ms(la), 4) for k, la in launchers.items()}
    for la in launchers.values():
        la.close()
    del compiled, dev
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="bert,resnet50")
    ap.add_argument("--bundles", default=None, help="a folder holding MODEL_bundle for each model (else built here)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--churn", type=float, default=4.0, help="GiB of tensors allocated before the last load")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/launcher_placement_out"))
    ap.add_argument("--child", nargs=2, metavar=("MODEL", "BUNDLE"), default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(child(args.child[0], args.child[1], args.repeats, args.churn)), flush=True)
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in filter(None, args.models.split(",")):
        bundle = Path(args.bundles) / f"{name}_bundle" if args.bundles else out / f"{name}_bundle"
        try:
            if not (bundle / "manifest.json").is_file():
                from gpu import export, make_model

                model, inputs = make_model(name, 1)
                onnx_path = out / f"{name}.onnx"
                export(model, inputs, onnx_path)
                subprocess.run([sys.executable, "-m", "parastream.pipeline.cli", "build", str(onnx_path), "-o",
                                str(bundle), "--backend", "torch", "--precision", "fp16", "--no-search", "--force"],
                               check=True, capture_output=True, text=True)
            p = subprocess.run([sys.executable, __file__, "--child", name, str(bundle), "--repeats",
                                str(args.repeats), "--churn", str(args.churn)], capture_output=True, text=True,
                               timeout=600)
            got = next((json.loads(line[7:]) for line in p.stdout.splitlines() if line.startswith("RESULT ")), None)
            row = got or {"model": name, "error": (p.stderr.strip().splitlines() or ["no result"])[-1][:400]}
        except subprocess.CalledProcessError as e:
            row = {"model": name, "error": f"build: {(e.stderr or '').strip().splitlines()[-1:]}"}
        except Exception as e:  # noqa: BLE001 - one model's failure is its row
            row = {"model": name, "error": f"{type(e).__name__}: {e}"}
        rows.append(row)
        print(json.dumps(row), flush=True)
        (out / "launcher_placement.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
