#!/usr/bin/env python3
"""The rewrite search on every example model: nodes and estimated cost before and after, search time.

Costs are the search's own objective, α·critical_path + (1 − α)·total_work on K streams, under the roofline
cost model of an H100 SXM (no GPU needed); critical path and total work are printed too.

Usage: python3 bench/search.py [--device H100-SXM] [--precision fp32|fp16] [--streams 4] [--seed 0] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import time

from rich.console import Console
from rich.table import Table

from parastream.pipeline import zoo
from parastream.rewrite import RooflineCostModel, optimize


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="H100-SXM")
    ap.add_argument("--precision", default="fp32", choices=["fp32", "tf32", "fp16"])
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--models", default=",".join(zoo.MODELS), help="comma-separated zoo model names")
    ap.add_argument("--json", default=None, help="also write the figures and the search reports here")
    args = ap.parse_args(argv)

    cost_model = RooflineCostModel(args.device, precision=args.precision)
    table = Table(title=f"rewrite search, roofline {args.device} {args.precision}, {args.streams} streams, "
                        f"cost = 0.25·critical path + 0.75·total work")
    for col in ("model", "nodes before", "nodes after", "est. before µs", "est. after µs", "gain",
                "crit. path µs", "total work µs", "pieces", "candidates", "search s", "rules chosen"):
        table.add_column(col, justify="right" if col not in ("model", "rules chosen") else "left", overflow="fold")
    rows = {}
    for name in args.models.split(","):
        model = zoo.MODELS[name]()
        t0 = time.perf_counter()
        _, report = optimize(model, cost_model=cost_model, streams=args.streams, seed=args.seed)
        seconds = time.perf_counter() - t0
        before, after = report["cost_before"], report["cost_after"]
        gain = 1 - after["mixed_s"] / before["mixed_s"]
        tried = sum(p["candidates_tried"] for p in report["pieces"])
        table.add_row(name, str(report["nodes_before"]), str(report["nodes_after"]), f"{before['mixed_s'] * 1e6:.1f}",
                      f"{after['mixed_s'] * 1e6:.1f}", f"{gain:.1%}",
                      f"{before['critical_path_s'] * 1e6:.1f} → {after['critical_path_s'] * 1e6:.1f}",
                      f"{before['total_work_s'] * 1e6:.1f} → {after['total_work_s'] * 1e6:.1f}",
                      str(len(report["pieces"])), str(tried), f"{seconds:.2f}",
                      ", ".join(f"{k}×{v}" for k, v in sorted(report["rules_chosen_count"].items())) or "-")
        rows[name] = {"seconds": seconds, "report": report}
    Console().print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
