#!/usr/bin/env python3
"""CPU build time of several parastream trees on the same models, alternating: is a change faster?

Each VARIANT is NAME=DIR, DIR holding a ``parastream`` package (``git archive COMMIT pipeline rewrite launcher``
unpacked under DIR/parastream); NAME=. is the installed (editable) tree.  For every round and model the variants
build one after another, the order rotated from model to model and round to round, each build one process
(``bench/cpu_path.py build_row``: `parastream build --backend onnxruntime --json`, wall and CPU seconds of the
process, stage timings, rules chosen, the sha256 of every file the bundle holds but report.json).  One JSON row
per build; at the end, per variant, the median build wall and CPU seconds and whether every model's rules and
bundle files were the same as the first variant's.

    python bench/build_ab.py OUT.jsonl --variant before=/tmp/ab/0113430 --variant after=. MODEL.onnx ... [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_path import _models, build_row  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("models", nargs="+")
    ap.add_argument("--variant", action="append", required=True, help="NAME=DIR (DIR/parastream), or NAME=. (installed)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--reference", default=None, help="the variant whose rules and bundle files the others are compared "
                                                       "with (default: the first)")
    args = ap.parse_args()
    variants = [tuple(v.split("=", 1)) for v in args.variant]
    models = _models(args.models)
    base_env = os.environ.get("PYTHONPATH", "")
    rows = []
    with open(args.out, "w") as out:
        k = 0
        for rnd in range(args.rounds):
            for model in models:
                order = variants[k % len(variants):] + variants[:k % len(variants)]
                k += 1
                for name, folder in order:
                    os.environ["PYTHONPATH"] = base_env if folder == "." else os.pathsep.join(p for p in (folder, base_env) if p)
                    row = dict(build_row(model, False, 0, []), variant=name, round=rnd)
                    rows.append(row)
                    out.write(json.dumps(row) + "\n")
                    out.flush()
                    print(f"{rnd} {model.stem:32s} {name:10s} wall {row.get('build_wall_s', 0):6.2f} s  "
                          f"cpu {row.get('build_cpu_s', 0):6.2f} s  load {row.get('load_before')}", flush=True)
    os.environ["PYTHONPATH"] = base_env
    first = args.reference or variants[0][0]
    ref = {(r["model"], r["round"]): r for r in rows if r["variant"] == first}
    for name, _ in variants:
        mine = [r for r in rows if r["variant"] == name and "error" not in r]
        same = all(r.get("rules_chosen") == ref[(r["model"], r["round"])].get("rules_chosen")
                   and r.get("files") == ref[(r["model"], r["round"])].get("files") for r in mine)
        print(f"{name:10s} median wall {statistics.median(r['build_wall_s'] for r in mine):6.2f} s  "
              f"median cpu {statistics.median(r['build_cpu_s'] for r in mine):6.2f} s  builds {len(mine)}  "
              f"same rules and bundle files as {first}: {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
