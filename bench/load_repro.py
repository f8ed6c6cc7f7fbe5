"""The same build on a loaded and an idle machine: does it give the same bundle?

For each model, `parastream build --backend onnxruntime` runs twice with the same command: once as the machine
is, once with N busy-loop processes (N = the core count by default) running beside it.  The bundles are compared
by the sha256 of what they are (manifest.json's hashes of model.onnx, plan.json and every engine; report.json
holds timings and is left out), and the CPU choice of each (what was timed, medians, spreads, margins, what won)
is kept.

    python bench/load_repro.py OUT.json MODEL.onnx ... [--busy N] [--order idle-first|loaded-first]
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

BUSY = "import time\nt = time.time() + {s}\nwhile time.time() < t:\n    pass\n"


def _build(model: Path, dest: Path) -> dict:
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "parastream.pipeline.cli", "build", str(model), "-o", str(dest),
                        "--backend", "onnxruntime", "--json"], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if p.returncode:
        return {"error": (p.stderr.strip().splitlines() or ["?"])[-1]}
    manifest = json.loads((dest / "manifest.json").read_text())
    report = json.loads((dest / "report.json").read_text())
    return {"wall_s": wall, "load": os.getloadavg(),
            "files": {k: v for k, v in manifest["files"].items() if k != "report.json"},
            "rewrites": (report.get("search") or {}).get("rules_chosen", []), "cpu_choice": report.get("cpu_choice")}


def run(model: Path, busy: int, loaded_first: bool) -> dict:
    row: dict = {"model": model.stem, "busy_processes": busy}
    with tempfile.TemporaryDirectory(prefix="parastream-load-repro-") as tmp:
        for state in (("loaded", "idle") if loaded_first else ("idle", "loaded")):
            procs = []
            if state == "loaded":
                procs = [subprocess.Popen([sys.executable, "-c", BUSY.format(s=3600)]) for _ in range(busy)]
                time.sleep(1.0)
            try:
                row[state] = _build(model, Path(tmp) / state)
            finally:
                for p in procs:
                    p.kill()
                    p.wait()
    a, b = row["idle"], row["loaded"]
    row["same_bundle"] = "files" in a and "files" in b and a["files"] == b["files"]
    row["same_rewrites"] = a.get("rewrites") == b.get("rewrites")
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("models", nargs="+")
    ap.add_argument("--busy", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--order", choices=("idle-first", "loaded-first"), default="idle-first")
    args = ap.parse_args()
    rows = []
    for m in args.models:
        rows.append(run(Path(m), args.busy, args.order == "loaded-first"))
        r = rows[-1]
        kept = {s: (r[s].get("cpu_choice") or {}).get("chosen") for s in ("idle", "loaded")}
        print(json.dumps({"model": r["model"], "same_bundle": r["same_bundle"], "same_rewrites": r["same_rewrites"],
                          "kept": kept, "wall_s": {s: round(r[s].get("wall_s", 0), 1) for s in ("idle", "loaded")}}), flush=True)
        Path(args.out).write_text(json.dumps({"cores": os.cpu_count(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
