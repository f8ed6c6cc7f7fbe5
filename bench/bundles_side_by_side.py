#!/usr/bin/env python3
"""Bundles of the same model timed side by side in one process: their replays in alternating blocks
(``pipeline.bench.measure``: CUDA events around each replay, warm-up, fresh random inputs), medians and the
ratio of each to the first.

Why: two builds of one model (two code trees, two build options) differ in how they run; timed in separate
processes their medians move with each process's timing state (bench/NOTES.md, the second timing state), timed
together the drift falls on both.  Each bundle is loaded by this checkout's parastream, so a bundle that an
earlier tree built is timed as it runs here.

Run on the device after ``source bench/device_env.sh``:
    python3 bench/bundles_side_by_side.py NAME=BUNDLE NAME=BUNDLE [...] [--runs 300] [--reps 3] [--out $OUT]
Prints one JSON line per repetition and a summary; writes bundles_side_by_side.json under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundles", nargs="+", help="NAME=PATH of a GPU bundle (the first is the one the others are "
                                               "compared with)")
    ap.add_argument("--runs", type=int, default=300)
    ap.add_argument("--reps", type=int, default=3, help="timings, each of every bundle in alternating blocks")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/bundles_side_by_side"))
    args = ap.parse_args(argv)
    named = dict(b.split("=", 1) for b in args.bundles)
    if len(named) < 2 or any(not Path(p, "manifest.json").is_file() for p in named.values()):
        print("bundles_side_by_side: give two or more NAME=PATH of bundles (each a folder with manifest.json)",
              file=sys.stderr)
        return 2
    from parastream.launcher import load
    from parastream.pipeline.bench import measure

    launchers = {name: load(path) for name, path in named.items()}
    first = next(iter(named))
    reps = []
    for rep in range(args.reps):
        times = measure(launchers, runs=args.runs, seed=rep)
        ms = {name: round(float(np.median(t)), 4) for name, t in times.items()}
        reps.append(ms)
        print(json.dumps({"rep": rep, "median_ms": ms}), flush=True)
    median = {name: round(float(np.median([r[name] for r in reps])), 4) for name in named}
    summary = {"bundles": named, "median_ms": median, "reps": reps,
               "vs_first": {name: round(median[name] / median[first], 4) for name in named}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bundles_side_by_side.json").write_text(json.dumps(summary, indent=1))
    print("SUMMARY " + json.dumps({k: summary[k] for k in ("median_ms", "vs_first")}), flush=True)
    for la in launchers.values():
        la.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
