#!/usr/bin/env python3
"""Bundles of the same model timed side by side in one process: their replays in alternating blocks
(``pipeline.bench.measure``: CUDA events around each replay, warm-up, fresh random inputs), medians and the
ratio of each to the first.

Why: two builds of one model (two code trees, two build options) differ in how they run; timed in separate
processes their medians move with each process's timing state (bench/NOTES.md, the second timing state), timed
together the drift falls on both.  Each bundle is loaded by this checkout's parastream, so a bundle that an
earlier tree built is timed as it runs here.

``--loads N`` loads every bundle N times, each load's launchers made while the previous load's are still held
(so that their buffers lie elsewhere) and timed ``--reps`` times: a plan loaded twice ran up to ~5% apart in a
build (``pipeline.measure.REFERENCE_DRIFT``), so a difference under that between two bundles each loaded once
is not the bundles'.  The summary's medians are then the median of each load's median, and ``loads`` gives them.

Run on the device after ``source bench/device_env.sh``:
    python3 bench/bundles_side_by_side.py NAME=BUNDLE NAME=BUNDLE [...] [--runs 300] [--reps 3] [--loads 1] [--out $OUT]
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
    ap.add_argument("--loads", type=int, default=1, help="times each bundle is loaded afresh, each load timed "
                                                          "--reps times (see above)")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/bundles_side_by_side"))
    args = ap.parse_args(argv)
    named = dict(b.split("=", 1) for b in args.bundles)
    if len(named) < 2 or any(not Path(p, "manifest.json").is_file() for p in named.values()):
        print("bundles_side_by_side: give two or more NAME=PATH of bundles (each a folder with manifest.json)",
              file=sys.stderr)
        return 2
    from parastream.launcher import load
    from parastream.pipeline.bench import measure

    first = next(iter(named))
    reps, loads, held = [], [], {}
    for at in range(max(1, args.loads)):
        launchers = {name: load(path) for name, path in named.items()}  # (while the previous load's are held)
        for la in held.values():
            la.close()
        held = launchers
        mine = []
        for rep in range(args.reps):
            times = measure(launchers, runs=args.runs, seed=at * args.reps + rep)
            ms = {name: round(float(np.median(t)), 4) for name, t in times.items()}
            mine.append(ms)
            print(json.dumps({"load": at, "rep": rep, "median_ms": ms}), flush=True)
        reps += mine
        loads.append({name: round(float(np.median([r[name] for r in mine])), 4) for name in named})
    for la in held.values():
        la.close()
    median = {name: round(float(np.median([x[name] for x in loads])), 4) for name in named}
    summary = {"bundles": named, "median_ms": median, "reps": reps,
               "vs_first": {name: round(median[name] / median[first], 4) for name in named},
               **({"loads": loads} if len(loads) > 1 else {})}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bundles_side_by_side.json").write_text(json.dumps(summary, indent=1))
    print("SUMMARY " + json.dumps({k: summary[k] for k in ("median_ms", "vs_first")}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
