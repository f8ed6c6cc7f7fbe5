"""CPU path figures: for each model, `parastream build --backend onnxruntime` (wall time, time per stage, the
rewrites found, peak memory, what the CPU build kept, the hashes of what it wrote) and, unless --no-bench,
`parastream bench` (the bundle against plain onnxruntime with default session options on the same model,
medians of --runs runs each).

    python bench/cpu_path.py OUT.json MODEL.onnx|DIR ... [--no-bench] [--runs 50] [--repeat N]

A DIR stands for every .onnx in it (bench/cpu_models.py writes the stand-ins; the corpus keeps real exports).
The build runs as `python -m parastream.pipeline.cli` of the interpreter running this script, so
PYTHONPATH picks the parastream under test (a before/after comparison runs the same script twice).
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


def _models(args: list[str]) -> list[Path]:
    out: list[Path] = []
    for a in args:
        p = Path(a)
        out += sorted(p.glob("*.onnx")) if p.is_dir() else [p]
    return out


def _load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


def _children_cpu() -> float:
    """CPU seconds (user + system) of the finished child processes: a build's work, less sensitive to load than its wall time."""
    import resource

    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def build_row(model: Path, bench: bool, runs: int, extra: list[str]) -> dict:
    name = model.stem
    with tempfile.TemporaryDirectory(prefix="parastream-cpu-path-") as tmp:
        bundle = Path(tmp) / "b"
        load_before = _load()
        t0, cpu0 = time.perf_counter(), _children_cpu()
        proc = subprocess.run([sys.executable, "-m", "parastream.pipeline.cli", "build", str(model), "-o", str(bundle),
                               "--backend", "onnxruntime", "--json", *extra], capture_output=True, text=True)
        wall, cpu = time.perf_counter() - t0, _children_cpu() - cpu0
        if proc.returncode != 0:
            return {"model": name, "error": (proc.stderr.strip().splitlines() or ["?"])[-1], "exit": proc.returncode}
        summary = json.loads(proc.stdout)
        report = json.loads((bundle / "report.json").read_text())
        manifest = json.loads((bundle / "manifest.json").read_text())
        search = report.get("search") or {}
        row = {"model": name, "load_before": load_before, "build_wall_s": wall, "build_cpu_s": cpu, "timings": report["timings"],
               "peak_rss_mb": summary["peak_rss_mb"], "nodes": [summary["nodes_in"], summary["nodes_out"]],
               "rewrites": summary["rewrites"], "rules_chosen": search.get("rules_chosen", []),
               "kept": summary["cpu_choice"], "cpu_choice": report.get("cpu_choice"),
               # what the bundle IS (report.json holds timings, so it is left out)
               "files": {k: v for k, v in manifest["files"].items() if k != "report.json"}}
        if bench:
            b = subprocess.run([sys.executable, "-m", "parastream.pipeline.cli", "bench", str(bundle), "--runs", str(runs),
                                "--json"], capture_output=True, text=True, check=True)
            b = json.loads(b.stdout)
            row.update(parastream_ms=b["parastream_ms"], onnxruntime_ms=b["onnxruntime_ms"],
                       speedup_vs_onnxruntime=b["speedup_vs_onnxruntime"], bench=b)
        row["load_after"] = _load()
        return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("models", nargs="+")
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--build-args", default="", help="extra arguments for parastream build (one string)")
    args = ap.parse_args()
    out = Path(args.out)
    rows = []
    for model in _models(args.models):
        rows.append(build_row(model, not args.no_bench, args.runs, args.build_args.split()))
        print(json.dumps({k: v for k, v in rows[-1].items() if k not in ("files", "cpu_choice", "bench")}), flush=True)
        out.write_text(json.dumps({"machine": f"{os.cpu_count()} cores, shared", "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
