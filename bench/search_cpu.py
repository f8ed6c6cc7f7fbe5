#!/usr/bin/env python3
"""The rewrite search as a CPU build runs it: search seconds and CPU seconds per model, and what it found.

Each model is loaded as ``parastream build --backend onnxruntime`` loads it, the search runs with the "CPU" roofline
profile on the stream count the build would give it (``plan_streams``), seed 0, default budget.  One JSON row per
model: wall and CPU seconds of ``optimize``, its own stage timings, the rules chosen, nodes before/after, the
estimated cost after (``repr``: to the last bit) and a sha256 of the searched model's bytes.  ``--compare FILE``
checks rules, cost and model hash against an earlier run's rows (exit 1 on any difference).

Usage: python bench/search_cpu.py OUT.jsonl MODEL.onnx ... [--compare REF.jsonl] [--prof N]
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import json
import pstats
import sys
import time

from parastream.pipeline.build import plan_streams
from parastream.pipeline.model_io import load_model
from parastream.rewrite import optimize
from parastream.rewrite.cost import RooflineCostModel


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("models", nargs="+")
    ap.add_argument("--compare", default=None)
    ap.add_argument("--prof", type=int, default=0, help="print the top N functions of a cProfile of each search")
    args = ap.parse_args()
    ref = {}
    if args.compare:
        with open(args.compare) as f:
            ref = {r["model"]: r for r in map(json.loads, f)}
    bad = 0
    with open(args.out, "w") as out:
        for path in args.models:
            loaded = load_model(path)
            cm = RooflineCostModel("CPU")
            streams = plan_streams(loaded.graph, cm, None, 4)[0].num_streams
            pr = cProfile.Profile() if args.prof else None
            t, c = time.perf_counter(), time.process_time()
            if pr:
                pr.enable()
            model, rep = optimize(loaded.model, cost_model=cm, streams=streams, seed=0)
            if pr:
                pr.disable()
            wall, cpu = time.perf_counter() - t, time.process_time() - c
            row = {"model": path.split("/")[-1], "search_s": round(wall, 2), "cpu_s": round(cpu, 2),
                   "t": {k: round(v, 2) for k, v in rep["timings"].items()}, "rules": rep["rules_chosen"],
                   "nodes": [rep["nodes_before"], rep["nodes_after"]], "cost_after": rep["cost_after"]["mixed_s"],
                   "cost_repr": repr(rep["cost_after"]["mixed_s"]),
                   "model_sha256": hashlib.sha256(model.SerializeToString(deterministic=True)).hexdigest()}
            out.write(json.dumps(row) + "\n")
            out.flush()
            same = ""
            if row["model"] in ref:
                r = ref[row["model"]]
                diff = [k for k in ("rules", "nodes", "cost_after", "model_sha256") if k in r and r[k] != row[k]]
                same = "  same" if not diff else f"  DIFFERENT: {diff}"
                bad += bool(diff)
            print(f"{row['model']:40s} wall {wall:6.2f} s  cpu {cpu:6.2f} s  search {rep['timings'].get('search_s', 0):5.2f} s"
                  f"  rules {len(row['rules'])}{same}", flush=True)
            if pr:
                pstats.Stats(pr).sort_stats("tottime").print_stats(args.prof)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
