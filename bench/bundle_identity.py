#!/usr/bin/env python3
"""Whether two parastream trees write the same bundle for the same model, with the CPU build's timing off.

``build(model, out, backend="onnxruntime", measure=False)`` in one process per tree and model (PYTHONPATH picks the
tree: DIR holds a ``parastream`` package, as for bench/build_ab.py); compared: the sha256 of every bundle file but
report.json, the rules chosen, the estimated cost after the search and every whole candidate's estimated cost.
Without timing nothing in a build depends on the machine's load, so any difference is the code's.

    python bench/bundle_identity.py OUT.jsonl --a start=/tmp/ab/055fc71 --b after=/tmp/ab/after MODEL.onnx ...
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CODE = ("import sys; from parastream.pipeline import build; "
        "build(sys.argv[1], sys.argv[2], backend='onnxruntime', measure=False)")


def bundle_of(model: str, folder: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="parastream-identity-") as tmp:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (folder, os.environ.get("PYTHONPATH", "")) if p))
        subprocess.run([sys.executable, "-c", CODE, model, f"{tmp}/b"], env=env, check=True, capture_output=True)
        manifest = json.loads(Path(tmp, "b", "manifest.json").read_text())
        report = json.loads(Path(tmp, "b", "report.json").read_text())
    search = report["search"]
    return {"files": {k: v for k, v in manifest["files"].items() if k != "report.json"},
            "rules": search.get("rules_chosen", []), "cost_after": search.get("cost_after"),
            "candidates": [c["estimated_s"] for c in search.get("candidates", [])]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("models", nargs="+")
    ap.add_argument("--a", required=True, help="NAME=DIR")
    ap.add_argument("--b", required=True, help="NAME=DIR")
    args = ap.parse_args()
    (na, da), (nb, db) = args.a.split("=", 1), args.b.split("=", 1)
    differ = 0
    with open(args.out, "w") as out:
        for model in args.models:
            a, b = bundle_of(model, da), bundle_of(model, db)
            same = {k: a[k] == b[k] for k in a}
            differ += not all(same.values())
            row = {"model": Path(model).stem, na: da, nb: db, "same": same, "files": len(b["files"])}
            out.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
