#!/usr/bin/env python3
"""One engine for the whole model against one engine per repeated block (``--engine-blocks``), on the device.

Run from the repository root after ``source bench/device_env.sh``:

    python3 bench/engine_blocks.py --models vit_b_16,bert,resnet50 --batches 1,8 --out $OUT [--search]

Per model and batch (bench/gpu.py's models and export, fp16, static shapes) it builds the bundle twice with the
torch backend, ``engine_blocks="whole"`` and ``"blocks"`` and otherwise the same options (default: no search and
no timed alternatives, so that the two differ only in where the engines are cut; ``--search``: the default build,
search and timed rounds included), each build in a fresh process with empty Inductor and Triton caches (a build
would otherwise find the other's kernels). It records each build's seconds in all and per stage, its engines, the
compiles it ran and the engines whose compiled code it reused from an equal block. Then it loads both bundles in
this process and times them with ``torch.compile(mode="reduce-overhead")`` of the PyTorch model as its users run
it (bench/corpus_gpu.py's baseline) in alternating blocks of CUDA-event timed calls (``pipeline.bench``), and loads
each bundle once more in a fresh process with empty caches (bench/load_breakdown.py's loader).

Writes engine_blocks.json under --out and prints one line per row.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

VARIANTS = ("whole", "blocks")


def build_child(onnx_path: str, out: str, variant: str, search: bool, result: str) -> None:
    """One build (this process is fresh: its caches are the ones the parent made empty)."""
    from parastream.pipeline import build

    t0 = time.perf_counter()
    bundle = build(onnx_path, out, backend="torch", precision="fp16", search=search, measure=search, force=True,
                   engine_blocks=variant)
    rep = bundle.report
    engines = [e for e in (rep.get("engines") or {}).values() if isinstance(e, dict)]
    Path(result).write_text(json.dumps({
        "build_s": time.perf_counter() - t0, "stage_seconds": rep.get("stage_seconds"),
        "engines": len(bundle.plan.branches), "streams": bundle.plan.num_streams,
        "compiled": sum(e.get("cache") == "miss" and not e.get("code_reused") for e in engines),
        "code_reused": sum(bool(e.get("code_reused")) for e in engines),
        "streams_tried": (rep.get("schedule") or {}).get("streams_tried"),
        "verification": {k: (rep.get("verification") or {}).get(k) for k in ("passed", "criterion")},
        "measured_choices": rep.get("measured_choices"),
        # where the measured search's seconds went: its stages, and per model measured its build, load and timing
        "search": {k: (rep.get("search") or {}).get(k) for k in ("timings", "measure_log", "rules_chosen")},
    }))


def build_fresh(onnx_path: Path, out: Path, variant: str, search: bool, timeout: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="engine-blocks-caches-") as d:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=f"{d}/inductor", TRITON_CACHE_DIR=f"{d}/triton")
        result = Path(d) / "result.json"
        p = subprocess.run([sys.executable, __file__, "--child", str(onnx_path), str(out), variant, str(int(search)),
                            str(result)], env=env, timeout=timeout, capture_output=True, text=True)
        if p.returncode != 0 or not result.exists():
            return {"error": (p.stderr.strip().splitlines() or ["exit %d" % p.returncode])[-1]}
        return json.loads(result.read_text())


def time_row(name: str, batch: int, bundles: dict, feeds: dict, ref: dict, runs: int) -> dict:
    import torch
    from corpus_gpu import CompiledRunner, HalfInput, free_gpu
    from gpu import make_model, max_err, users_model

    from parastream.launcher.bundle import Bundle
    from parastream.launcher.gpu import GpuLauncher
    from parastream.pipeline.bench import _measure

    row: dict = {}
    launchers: dict = {}
    try:
        for v, path in bundles.items():
            la = launchers[v] = GpuLauncher(Bundle.open(path))
            got = la(feeds)
            row[f"{v}_maxerr"] = max(max_err(got[k], ref[k]) for k in ref)
        plan = next(iter(launchers.values())).plan
        model = users_model(name, make_model(name, batch)[0])
        compiled = torch.compile(HalfInput(model.half().cuda()).eval(), mode="reduce-overhead", dynamic=False)
        runner = CompiledRunner(compiled, plan)
        runner.set(feeds)
        for _ in range(3):
            runner.launch()
        runner.synchronize()
        times = _measure(dict(launchers, compile=runner), runs=runs, warmup=50, seed=7)
        for k, t in times.items():
            row[f"{k}_ms"] = float(np.median(t))
        return row
    finally:
        for la in launchers.values():
            with contextlib.suppress(Exception):
                la.close()
        launchers.clear()
        compiled = runner = model = None
        with contextlib.suppress(Exception):
            free_gpu()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="vit_b_16,bert,resnet50")
    ap.add_argument("--batches", default="1")
    ap.add_argument("--search", action="store_true", help="the default build (measured search, timed rounds)")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help="which builds: whole, blocks or both (one alone: its build, measure log and timing)")
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--fresh-loads", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=540.0, help="start no new model after this")
    ap.add_argument("--build-timeout", type=float, default=900.0, help="seconds one build may take")
    ap.add_argument("--work", default="/tmp/engine_blocks")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/engine_blocks_out"))
    ap.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if set(args.variants.split(",")) - set(VARIANTS):
        ap.error(f"--variants: each of {VARIANTS}")
    if args.child:
        onnx_path, out, variant, search, result = args.child
        build_child(onnx_path, out, variant, bool(int(search)), result)
        return 0
    from corpus_gpu import fresh_loads
    from gpu import export_with_reference

    t_start = time.perf_counter()
    work, out = Path(args.work), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    for name in args.models.split(","):
        for batch in [int(b) for b in args.batches.split(",")]:
            if time.perf_counter() - t_start > args.seconds:
                rows.append({"model": name, "batch": batch, "error": "not started: --seconds spent"})
                continue
            row: dict = {"model": name, "batch": batch, "search": args.search}
            rows.append(row)
            try:
                _, _, onnx_path, feeds, ref, row["export_s"] = export_with_reference(name, work, batch)
                bundles = {}
                for v in args.variants.split(","):
                    path = work / f"{name}_b{batch}_{v}"
                    row[v] = build_fresh(onnx_path, path, v, args.search, timeout=args.build_timeout)
                    if "error" not in row[v]:
                        bundles[v] = path
                if bundles:
                    row.update(time_row(name, batch, bundles, feeds, ref, args.runs))
                    for v, path in bundles.items():
                        row[v]["fresh_load"] = fresh_loads(path, args.fresh_loads, [])
            except Exception as e:  # noqa: BLE001 - one row's error; the others go on
                row["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            (out / "engine_blocks.json").write_text(json.dumps(rows, indent=1))
            w, b = row.get("whole", {}), row.get("blocks", {})
            print(json.dumps({"model": name, "batch": batch, "ms": {k: round(row.get(f"{k}_ms", 0), 4) for k in
                                                                    ("whole", "blocks", "compile")},
                              "build_s": [round(w.get("build_s", 0), 1), round(b.get("build_s", 0), 1)],
                              "engines": [w.get("engines"), b.get("engines")],
                              "compiled": [w.get("compiled"), b.get("compiled")],
                              "code_reused": [w.get("code_reused"), b.get("code_reused")],
                              "load_s": [(w.get("fresh_load") or {}).get("median_s"),
                                         (b.get("fresh_load") or {}).get("median_s")],
                              "error": row.get("error") or w.get("error") or b.get("error")}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
