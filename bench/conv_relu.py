"""Conv + bias + ReLU: Inductor's (cuDNN/cuBLAS convolution, then a Triton bias+ReLU kernel) against cuDNN's fused
``torch.cudnn_convolution_relu`` (one kernel), fp16 channels-last, batch 1, on convolution shapes of Inception-v3.

Each variant is compiled (``torch.compile``, no Inductor CUDA graphs), then a chain of 20 calls on fresh inputs is
captured into one CUDA Graph and replayed; CUDA events, 20 warm-up replays, median of 200, microseconds per
convolution.  Run on the device after ``source bench/device_env.sh``:

    python3 bench/conv_relu.py
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

# (name, C_in, C_out, H, W, kernel (kh, kw), stride, padding)
SHAPES = [
    ("stem 3x3 32->64 @147", 32, 64, 147, 147, (3, 3), 1, (1, 1)),
    ("3x3 80->192 @73", 80, 192, 73, 73, (3, 3), 1, (0, 0)),
    ("1x1 288->64 @35", 288, 64, 35, 35, (1, 1), 1, (0, 0)),
    ("3x3 64->96 @35", 64, 96, 35, 35, (3, 3), 1, (1, 1)),
    ("1x1 768->192 @17", 768, 192, 17, 17, (1, 1), 1, (0, 0)),
    ("1x7 160->160 @17", 160, 160, 17, 17, (1, 7), 1, (0, 3)),
    ("7x1 160->192 @17", 160, 192, 17, 17, (7, 1), 1, (3, 0)),
    ("3x3 448->384 @8", 448, 384, 8, 8, (3, 3), 1, (1, 1)),
]
CHAIN = 20


def main() -> int:
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    results = []
    for name, ci, co, h, w, k, s, p in SHAPES:
        x = [torch.randn(1, ci, h, w, device="cuda").half().contiguous(memory_format=torch.channels_last) for _ in range(4)]
        wt = (torch.randn(co, ci, *k, device="cuda") * 0.05).half().contiguous(memory_format=torch.channels_last)
        b = torch.randn(co, device="cuda").half()

        def inductor(x):
            return F.relu(F.conv2d(x, wt, b, stride=s, padding=p))

        def fused(x):
            return torch.cudnn_convolution_relu(x, wt, b, (s, s), p, (1, 1), 1)

        row = {"shape": name}
        outs = {}
        probe = x[0].clone()
        for tag, fn in (("inductor", inductor), ("cudnn_fused", fused)):
            try:
                cfn = torch.compile(fn, fullgraph=True, dynamic=False)
                for xi in x:
                    cfn(xi)
                torch.cuda.synchronize()
                outs[tag] = cfn(probe).float()  # the same input for both variants
                g = torch.cuda.CUDAGraph()
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    cfn(x[0])
                torch.cuda.current_stream().wait_stream(stream)
                with torch.cuda.graph(g):
                    for i in range(CHAIN):
                        cfn(x[i % len(x)])
                for _ in range(20):
                    g.replay()
                times = []
                for i in range(200):
                    for xi in x:  # fresh inputs between replays (outside the timed region)
                        xi.normal_()
                    a, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    g.replay()
                    e.record()
                    e.synchronize()
                    times.append(a.elapsed_time(e) * 1e3 / CHAIN)
                row[f"{tag}_us"] = float(np.median(times))
            except Exception as exc:  # noqa: BLE001 - report and go on
                row[f"{tag}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        if len(outs) == 2:
            row["max_abs_diff"] = float((outs["inductor"] - outs["cudnn_fused"]).abs().max())
        if "inductor_us" in row and "cudnn_fused_us" in row:
            row["inductor_over_fused"] = row["inductor_us"] / row["cudnn_fused_us"]
        print(json.dumps(row), flush=True)
        results.append(row)
    out = Path(os.environ.get("OUT", "/tmp"))
    (out / "conv_relu.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
