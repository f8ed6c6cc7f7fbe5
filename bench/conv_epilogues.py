#!/usr/bin/env python3
"""Per convolution shape of a model: cuDNN's fused epilogue against a convolution and a separate epilogue kernel,
timed on the device.

Why: a GPU build decides its conv+ReLU round for the whole engine at once (every Conv -> Relu, and Conv -> Add ->
Relu, as one cuDNN call, or none), and that round went for Inductor's kernels on SqueezeNet, Res2Net-50,
Inception-ResNet-v2, MixNet-S and ShuffleNet-v2 and for cuDNN's on the others (bench/corpus/NOTES.md).  Whether a
choice per convolution shape could beat both depends on whether the shapes of one model disagree, which this
measures.

For each model (bench/gpu.py's ``make_model``: random weights, BatchNorm calibrated; exported as a build receives
it, opset 17, BatchNorm folded into the convolutions), every 2-d Conv that is not depthwise and whose output only a
Relu reads (``relu``), or only an Add whose other input has its shape and whose output only a Relu reads
(``add_relu``), grouped by (kind, input shape, weight shape, strides, pads, dilations, group): the shapes a GPU build
times itself (``cudnn_fused.fused_conv_keys``; ``pipeline.measure.time_conv_shapes``, whose unfused form is eager
ops rather than Inductor's kernel, so that it favours the fused call):

  count        convolutions of that shape in the model
  fused_us     the converter's fused step (``torch.cudnn_convolution_relu`` / ``cudnn_convolution_add_relu``),
               channels-last fp16, per call in a CUDA Graph of ``--chain`` calls (median of ``--replays``)
  unfused_us   torch's convolution without its bias (cuDNN) and one elementwise kernel for bias (+ residual) +
               ReLU compiled by Inductor (one dynamic-shape compile per kind), the same way: what Inductor's form
               runs for most convolutions (it may also fold that kernel into a neighbour's, which this does not
               credit it with)
  ratio        unfused_us / fused_us (> 1: the fused call is faster)

and per model the sums over its convolutions (each shape times its count): all fused, all unfused, and each shape's
faster form.

Run on the device after ``source bench/device_env.sh``:
    python3 bench/conv_epilogues.py --models resnet50,squeezenet1_1 --out $OUT
Prints one JSON line per model and a summary; writes conv_epilogues.json under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from depthwise_kernels import _graph_us  # noqa: E402 - the same timing: fn captured `reps` times, replays' median


_EPILOGUES: dict = {}


def _epilogue(kind: str):
    """Inductor's kernel for bias (+ residual) + ReLU, compiled once per kind with dynamic shapes."""
    import torch

    if kind not in _EPILOGUES:
        if kind == "relu":
            def f(y, b):
                return torch.relu(y + b.view(1, -1, 1, 1))
        else:
            def f(y, b, z):
                return torch.relu(y + z + b.view(1, -1, 1, 1))
        _EPILOGUES[kind] = torch.compile(f, dynamic=True)
    return _EPILOGUES[kind]


def measure_shape(key: str, batch: int, chain: int, replays: int) -> dict:
    """``key`` (``cudnn_fused.conv_key``) at ``batch``: both forms timed, and their outputs compared."""
    import torch

    from parastream.launcher.engines.cudnn_fused import parse_key

    kind, xs, ws, strides, pads, dil, group = parse_key(key)
    xs = [batch, *xs]
    cl = torch.channels_last
    x = torch.randn(xs, device="cuda", dtype=torch.float16).contiguous(memory_format=cl)
    w = (torch.randn(ws, device="cuda", dtype=torch.float16) / (ws[1] * ws[2] * ws[3]) ** 0.5).contiguous(memory_format=cl)
    b = torch.randn(ws[0], device="cuda", dtype=torch.float16)
    y0 = torch.convolution(x, w, None, strides, pads, dil, False, [0, 0], group)
    z = torch.randn_like(y0).contiguous(memory_format=cl)
    epi = _epilogue(kind)
    if kind == "relu":
        def fused():
            return torch.cudnn_convolution_relu(x, w, b, strides, pads, dil, group)

        def unfused():
            return epi(torch.convolution(x, w, None, strides, pads, dil, False, [0, 0], group), b)
    else:
        def fused():
            return torch.cudnn_convolution_add_relu(x, w, z, 1.0, b, strides, pads, dil, group)

        def unfused():
            return epi(torch.convolution(x, w, None, strides, pads, dil, False, [0, 0], group), b, z)
    with torch.no_grad():
        a, c = fused().float(), unfused().float()
        err = float((a - c).abs().max() / max(c.abs().max(), 1e-6))
        f_us = _graph_us(fused, chain, replays)  # (depthwise_kernels.py's: captured, replayed, medians)
        u_us = _graph_us(unfused, chain, replays)
    return {"kind": kind, "x": list(xs), "w": list(ws), "strides": list(strides), "pads": list(pads),
            "dilations": list(dil), "group": group, "fused_us": round(f_us, 3), "unfused_us": round(u_us, 3),
            "ratio": round(u_us / f_us, 3), "max_err": round(err, 5)}


def summary(rows: list[dict]) -> dict:
    fused = sum(r["count"] * r["fused_us"] for r in rows)
    unfused = sum(r["count"] * r["unfused_us"] for r in rows)
    best = sum(r["count"] * min(r["fused_us"], r["unfused_us"]) for r in rows)
    return {"shapes": len(rows), "convs": sum(r["count"] for r in rows),
            "fused_wins": sum(r["count"] for r in rows if r["fused_us"] < r["unfused_us"]),
            "all_fused_us": round(fused, 1), "all_unfused_us": round(unfused, 1), "each_faster_us": round(best, 1),
            "gain_over_better_whole_us": round(min(fused, unfused) - best, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="resnet50,squeezenet1_1")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--chain", type=int, default=20)
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument("--shapes-only", action="store_true", help="list the shapes without timing (no GPU needed)")
    ap.add_argument("--seconds", type=float, default=400.0, help="start no new model after this")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/conv_epilogues_out"))
    args = ap.parse_args(argv)
    import onnx
    import torch
    from gpu import export, make_model

    from parastream.launcher.engines.cudnn_fused import fused_conv_keys, parse_key

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    results = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
               "torch": torch.__version__, "models": {}}
    if torch.cuda.is_available():
        results["cudnn"] = torch.backends.cudnn.version()
    for name in filter(None, args.models.split(",")):
        if time.perf_counter() - t_start > args.seconds:
            results["models"][name] = {"skipped": "time"}
            continue
        model, inputs = make_model(name, args.batch)
        path = out / f"{name}.onnx"
        export(model, inputs, path)
        found = fused_conv_keys(onnx.load(str(path)))  # the shapes a build times (pipeline.measure.time_conv_shapes)
        rows = []
        for key, count in sorted(found.items(), key=lambda kv: (-kv[1], kv[0])):
            kind, x, w = parse_key(key)[:3]
            row = {"count": count, "key": key, "kind": kind, "x": [args.batch, *x], "w": w}
            if not args.shapes_only:
                row.update(measure_shape(key, args.batch, args.chain, args.replays))
            rows.append(row)
        res = {"rows": rows}
        if not args.shapes_only:
            res["summary"] = summary(rows)
        results["models"][name] = res
        print(json.dumps({"model": name, **({"summary": res["summary"]} if "summary" in res else
                                            {"shapes": len(rows), "convs": sum(found.values())})}), flush=True)
    (out / "conv_epilogues.json").write_text(json.dumps(results, indent=1))
    for name, res in results["models"].items():
        for r in res.get("rows", []):
            if "ratio" in r:
                print(f"{name:22s} {r['kind']:8s} x{r['count']:<3d} {str(r['x']):22s} {str(r['w']):20s} "
                      f"fused {r['fused_us']:7.2f}  unfused {r['unfused_us']:7.2f}  ratio {r['ratio']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
