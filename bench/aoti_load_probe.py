#!/usr/bin/env python3
"""Does an AOTInductor package load on this GPU, through torch's public loader and through ours
(``launcher.engines.torch._load_package``)?  Compiles one small_net branch with ``compile_package`` and loads it
in fresh processes, each way; prints the exit status of each (a segmentation fault is -11) and the signature
torch documents for ``AOTIModelPackageLoader``.  On the device after ``source bench/device_env.sh``:

    python3 bench/aoti_load_probe.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/aoti_load_probe"))
    args = ap.parse_args()
    import onnx
    import torch

    from parastream.launcher.engines import torch as tb
    from parastream.launcher.engines.base import BuildOptions
    from parastream.pipeline import build
    from parastream.pipeline.zoo import small_net

    work = Path(tempfile.mkdtemp(prefix="aoti-load-"))
    onnx.save(small_net(), work / "m.onnx")
    bundle = build(work / "m.onnx", work / "b", backend="onnxruntime", search=False, measure=False, verify=False)
    b = bundle.plan.branches[0]
    branch = onnx.load_from_string(bundle.engine_bytes(b))
    ins = [bundle.plan.tensors[t] for t in b.inputs]
    outs = [bundle.plan.tensors[t] for t in b.outputs]
    package, _, _ = tb.compile_package(branch, ins, outs, "cuda", "float16", set(), {}, BuildOptions(device="cuda"))
    (work / "p.pt2").write_bytes(package)
    loader = getattr(getattr(torch._C, "_aoti", None), "AOTIModelPackageLoader", None)
    res = {"torch": torch.__version__, "package_bytes": len(package),
           "loader_doc": (getattr(loader.__init__, "__doc__", None) or "")[:1500] if loader else None}
    ways = {
        "public": "from torch._inductor import aoti_load_package as f; r = f(P, device_index=0); print('loaded')",
        "ours": "from parastream.launcher.engines import torch as tb; r = tb._load_package(open(P,'rb').read(), 0); "
                "print('loaded')",
    }
    for name, code in ways.items():
        script = f"P = {str(work / 'p.pt2')!r}\n" + textwrap.dedent(code)
        p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
        res[name] = {"rc": p.returncode, "stdout": p.stdout[-300:], "stderr": p.stderr[-1500:]}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "aoti_load_probe.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
