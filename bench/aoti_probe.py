#!/usr/bin/env python3
"""Why a torch branch did not compile to an AOTInductor package on this GPU: build a zoo model (torch backend,
fp16, no search, no verification) and print each distinct ``aot_error`` the builder recorded, then compile one
branch in this process to show the whole traceback.  Run on the device after ``source bench/device_env.sh``:

    python3 bench/aoti_probe.py [--model inception_block]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import traceback
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="inception_block")
    args = ap.parse_args()
    from parastream.pipeline import build
    from parastream.pipeline.zoo import write_all

    work = Path(tempfile.mkdtemp())
    write_all(work)
    bundle = build(work / f"{args.model}.onnx", work / "out", backend="torch", precision="fp16", search=False,
                   verify=False, measure=False, force=True)
    errors = {}
    for name, rep in (bundle.report.get("engines") or {}).items():
        if isinstance(rep, dict) and rep.get("aot_error"):
            errors.setdefault(rep["aot_error"], []).append(name)
    print(f"{len(bundle.plan.branches)} branches, {sum(len(v) for v in errors.values())} not compiled")
    for err, names in errors.items():
        print(f"--- {len(names)} branches ({names[0]}...):\n{err[:3000]}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:  # noqa: BLE001 - the probe prints what failed
        traceback.print_exc()
        sys.exit(1)
