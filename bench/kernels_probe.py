"""Why a branch's "kernels" artifact could not be extracted (GPU; debugging aid for launcher/engines/inductor_kernels.py).

Builds a zoo model (or an ONNX file) for the torch backend, fp16, no search, with compiles in this process, and for
every extraction that fails writes its traceback and the Inductor wrapper it was taken from into ``--out``:

    python bench/kernels_probe.py --model small_net --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import traceback
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="small_net")
    ap.add_argument("--onnx", default=None)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/kernels_probe"))
    args = ap.parse_args()
    os.environ["PARASTREAM_COMPILE_WORKERS"] = "1"  # compiled here: the wrapper below sees every extraction
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import onnx

    from parastream.launcher.engines import inductor_kernels as ik
    from parastream.pipeline import build
    from parastream.pipeline.zoo import MODELS

    failures = []
    extract = ik.extract

    def probing(art, a, n):
        try:
            return extract(art, a, n)
        except Exception as e:
            i = len(failures)
            failures.append(f"{type(e).__name__}: {e}")
            if i >= 3:  # the first three are written
                raise
            (out / f"failure_{i}.txt").write_text(traceback.format_exc())
            try:
                scope = ik._wrapper_module(art)
                (out / f"wrapper_{i}.py").write_text(Path(scope["__file__"]).read_text())
            except Exception as e2:  # noqa: BLE001
                (out / f"wrapper_{i}.txt").write_text(f"no wrapper: {e2}\n{traceback.format_exc()}")
            raise

    ik.extract = probing
    work = Path(tempfile.mkdtemp(prefix="kernels-probe-"))
    path = args.onnx
    if path is None:
        path = work / f"{args.model}.onnx"
        onnx.save(MODELS[args.model](), path)
    bundle = build(path, work / "b", backend="torch", precision="fp16", search=False, measure=False, verify=True)
    eng = bundle.report["engines"]
    summary = {"failures": failures, "kinds": sorted({str(e.get("compiled")) for e in eng.values()}),
               "kernels_errors": sorted({e.get("kernels_error") for e in eng.values() if e.get("kernels_error")}),
               "verification": (bundle.report.get("verification") or {}).get("passed")}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
