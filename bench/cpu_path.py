"""CPU path figures: for each model, `parastream build --backend onnxruntime` (wall time, search time, rewrites,
peak memory, what the CPU build kept) and `parastream bench` (the bundle against plain onnxruntime with default
session options on the same model, medians of 50 runs each).

    python bench/cpu_path.py MODELS_DIR OUT.json [name ...]     # models from bench/cpu_models.py
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    models, out = Path(sys.argv[1]), Path(sys.argv[2])
    names = sys.argv[3:] or sorted(p.stem for p in models.glob("*.onnx"))
    rows = []
    for name in names:
        with tempfile.TemporaryDirectory(prefix="parastream-cpu-path-") as tmp:
            bundle = Path(tmp) / "b"
            t0 = time.perf_counter()
            proc = subprocess.run([sys.executable, "-m", "parastream.pipeline.cli", "build", str(models / f"{name}.onnx"),
                                   "-o", str(bundle), "--backend", "onnxruntime", "--json"], capture_output=True, text=True)
            wall = time.perf_counter() - t0
            if proc.returncode != 0:
                rows.append({"model": name, "error": proc.stderr.strip().splitlines()[-1]})
                continue
            summary = json.loads(proc.stdout)
            report = json.loads((bundle / "report.json").read_text())
            bench = subprocess.run([sys.executable, "-m", "parastream.pipeline.cli", "bench", str(bundle), "--runs", "50",
                                    "--json"], capture_output=True, text=True, check=True)
            b = json.loads(bench.stdout)
            rows.append({"model": name, "build_wall_s": wall, "search_s": report["timings"].get("search"),
                         "cpu_choice_s": report["timings"].get("cpu_choice"), "peak_rss_mb": summary["peak_rss_mb"],
                         "nodes": [summary["nodes_in"], summary["nodes_out"]], "rewrites": summary["rewrites"],
                         "search": summary["search"], "kept": summary["cpu_choice"],
                         "timed": report["cpu_choice"]["timed"] if report.get("cpu_choice") else None,
                         "parastream_ms": b["parastream_ms"], "onnxruntime_ms": b["onnxruntime_ms"],
                         "speedup_vs_onnxruntime": b["speedup_vs_onnxruntime"]})
        print(json.dumps(rows[-1]), flush=True)
    out.write_text(json.dumps({"machine": f"{__import__('os').cpu_count()} cores, shared", "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
