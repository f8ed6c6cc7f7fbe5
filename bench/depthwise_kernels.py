#!/usr/bin/env python3
"""Per distinct depthwise convolution of a model: what each kernel a bundle could run costs at a fresh process's
first call and at every replay, on the device.

Why: a fresh load of a depthwise-separable network spends most of its time in cuDNN building an execution plan
for each distinct channels-last fp16 depthwise shape (NASNet-A Large: 23 keys, 4.07 of 4.26 s;
docs/torch-engines.md, "Engines per repeated block"), and lowering every depthwise convolution to Inductor's
kernels made its replay 35% slower.  Whether a per-shape choice can keep most of the speed and drop most of
the plans depends on how the costs spread over the shapes, which this measures.

For each timm model or corpus classifier (random weights, fp16, batch 1 or ``--batch``, channels-last, as bench/load_breakdown.py builds it) it
records every ``F.conv2d`` call of a forward pass whose groups equal its channels (the depthwise ones, after
any "same" padding), and for each distinct (input shape, kernel, stride, padding, dilation):

  count            calls of that shape in one forward pass
  cudnn_first_ms   torch's convolution (cuDNN), channels-last: the first call in this process, synchronized
                   (the plan's build; each shape is a new cuDNN key)
  cudnn_us         its time per call in a CUDA Graph of 20 calls (median of 30 replays, CUDA events)
  inductor_us      the converter's lowering (``onnx_torch._conv_as_kernels``: the form ``--conv-kernels
                   inductor`` compiles) under torch.compile, the same way; compile seconds beside it
  written_out_us   beyond ``onnx_torch.UNROLLED_TAPS`` taps (which the converter loops over), the windows' sum
                   written out whatever its taps (Inductor's ``unroll_reductions_threshold`` above them); its
                   compile seconds beside it
  native_first_ms, native_us
                   torch's own depthwise kernel (``aten._conv_depthwise2d``, NCHW; no plan to build)
  plan_us          the same convolution through the cuDNN plan a bundle ships (``cudnn_plans.conv2d``, the form
                   ``conv_kernels`` "cudnn" compiles), the same way (bench/cudnn_plans.py: the plans' build and
                   load costs)
  triton_us        parastream's own Triton kernel (``conv_triton``), its blocks by its heuristic; the best of
                   a sweep of blocks beside it (``triton_best_us``, ``triton_best_block``)
  max_err          of each against cuDNN's output (scaled by its largest magnitude)

and prints, per model, the plan seconds in all and what lowering the shapes in order of plan seconds saved per
microsecond lost would keep and lose.

Run on the device after ``source bench/device_env.sh``:
    python3 bench/depthwise_kernels.py --models nasnetalarge,mixnet_s --out $OUT
    python3 bench/depthwise_kernels.py --models mobilenet_v3_small,mixnet_s --batch 32 --out $OUT
    python3 bench/depthwise_kernels.py --models convnext_tiny,efficientnet_b0 --forms triton --out $OUT
    python3 bench/depthwise_kernels.py --models regnet_y_400mf --grouped --forms triton --out $OUT
Writes depthwise_kernels.json under --out.
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


def depthwise_calls(name: str, dense: bool = False, batch: int = 1, grouped: bool = False) -> dict:
    """{(input shape, weight shape, stride, padding, dilation): calls} of ``name``'s depthwise ``F.conv2d`` calls
    in one forward pass at ``batch``; with ``dense``, of its other 2-d convolutions instead, each key with its
    groups last; with ``grouped``, of those of more than one group that are not depthwise and that parastream's
    Triton kernel takes (``conv_triton.takes``), each key with its groups last.  ``name``: a timm model, or a
    classifier of the corpus (bench/gpu.py's ``make_model``)."""
    import timm
    import torch
    import torch.nn.functional as F

    if timm.is_model(name):
        model = timm.create_model(name, pretrained=False).eval()
        size = model.default_cfg.get("input_size", (3, 224, 224))
    else:  # (a torchvision classifier of the corpus, e.g. mobilenet_v3_small)
        from gpu import make_model

        model, inputs = make_model(name)
        size = tuple(inputs["x"].shape[1:])
    x = torch.randn(batch, *size)
    seen: dict = {}
    real = F.conv2d

    def record(inp, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
        c = inp.shape[1]
        depthwise = groups == c == weight.shape[0] and weight.shape[1] == 1 and weight.shape[2] * weight.shape[3] > 1
        if grouped:
            from parastream.launcher.engines.conv_triton import takes

            wanted = not depthwise and weight.dim() == 4 and takes(c, tuple(weight.shape), int(groups))
        else:
            wanted = depthwise != dense
        if wanted and not isinstance(padding, str) and inp.dim() == 4:
            pair = lambda v: tuple(int(a) for a in v) if isinstance(v, (tuple, list)) else (int(v), int(v))  # noqa: E731
            key = (tuple(inp.shape), tuple(weight.shape), pair(stride), pair(padding), pair(dilation))
            key = key + (int(groups),) if dense or grouped else key
            seen[key] = seen.get(key, 0) + 1
        return real(inp, weight, bias, stride, padding, dilation, groups)

    F.conv2d = record
    try:
        with torch.no_grad():
            model(x)
    finally:
        F.conv2d = real
    return seen


def _graph_us(fn, reps: int = 20, replays: int = 30) -> float:
    """Microseconds per call of ``fn()`` captured ``reps`` times in one CUDA Graph (median of ``replays``): the
    build's own per-shape timing (``pipeline.bench.captured_us``), which the other per-shape benchmarks import
    from here."""
    from parastream.pipeline.bench import captured_us

    return captured_us(fn, reps, replays)


def _first_ms(fn) -> float:
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


#: the forms ``--forms`` may name (cuDNN's ``cudnn_us`` is always measured: the others' base)
FORMS = ("plan", "inductor", "written_out", "native", "triton")
#: the Triton kernel's blocks swept per shape: (BLOCK_W, BLOCK_C, warps)
TRITON_BLOCKS = tuple((bw, bc, nw) for bw in (4, 8, 16, 32) for bc in (32, 64, 128) for nw in (2, 4))


def triton_row(row: dict, x, w, ref, scale, stride, padding, dilation, groups: int) -> None:
    """parastream's own Triton kernel (``conv_triton``) with its heuristic blocks (``triton_us``) and the best
    of ``TRITON_BLOCKS`` (``triton_best_us``, ``triton_best_block``), into ``row``."""
    from parastream.launcher.engines import conv_triton as dt

    wt = dt.taps_major(w)
    pads = [padding[0], padding[1], padding[0], padding[1]]
    kernel = list(w.shape[2:])

    def run(block=None):
        return dt.launch(x, wt, None, kernel, list(stride), pads, list(dilation), groups, block=block)

    try:
        row["triton_max_err"] = float((run().float() - ref).abs().max()) / scale
        row["triton_us"] = _graph_us(run)
        row["triton_block"] = list(dt.blocks(int(w.shape[0]), int(ref.shape[3]), kernel[0] * kernel[1] * int(w.shape[1])))
        best = None
        for block in TRITON_BLOCKS:
            us = _graph_us(lambda b=block: run(b))
            if best is None or us < best[0]:
                best = (us, block)
        row["triton_best_us"], row["triton_best_block"] = best[0], list(best[1])
    except Exception as e:  # noqa: BLE001 - one shape's failure is recorded
        row["triton_error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def measure_shape(key, forms=FORMS) -> dict:
    import torch
    import torch.nn.functional as F

    from parastream.launcher.engines import cudnn_plans as cp
    from parastream.launcher.engines.onnx_torch import UNROLLED_TAPS, _conv_as_kernels

    x_shape, w_shape, stride, padding, dilation = key[:5]
    c = key[5] if len(key) > 5 else x_shape[1]  # the groups (a depthwise key's are its channels)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(x_shape, device="cuda", generator=g).half().to(memory_format=torch.channels_last)
    w = (torch.randn(w_shape, device="cuda", generator=g) * 0.1).half().to(memory_format=torch.channels_last)
    row: dict = {"x": list(x_shape), "kernel": list(w_shape[2:]), "stride": list(stride), "padding": list(padding)}
    row["cudnn_first_ms"] = _first_ms(lambda: F.conv2d(x, w, None, stride, padding, dilation, c))
    ref = F.conv2d(x, w, None, stride, padding, dilation, c).float()
    scale = float(ref.abs().max()) or 1.0
    row["cudnn_us"] = _graph_us(lambda: F.conv2d(x, w, None, stride, padding, dilation, c))
    if "triton" in forms:
        triton_row(row, x, w, ref, scale, stride, padding, dilation, c)
    if len(key) > 5:  # a grouped convolution: the other forms are depthwise ones'
        row["groups"] = c
        return row
    if "plan" in forms and cp.frontend() is not None:  # the form a bundle ships for "cudnn" (``BuildOptions.cudnn_plans``)
        try:
            out = cp.conv2d(x, w, None, list(stride), list(padding), list(dilation), c)
            row["plan_max_err"] = float((out.float() - ref).abs().max()) / scale
            row["plan_us"] = _graph_us(lambda: cp.conv2d(x, w, None, list(stride), list(padding), list(dilation), c))
        except Exception as e:  # noqa: BLE001 - one shape's failure is recorded
            row["plan_error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"

    from parastream.launcher.engines import onnx_torch
    from parastream.launcher.engines.base import BuildOptions
    from parastream.launcher.engines.torch import _inductor_options

    # in the configuration an engine that lowers depthwise convolutions is compiled with
    engines_options = _inductor_options(BuildOptions(precision="fp16", conv_kernels="inductor"))

    def compiled_row(prefix: str, form, options: dict) -> None:
        """``form`` compiled by Inductor with ``options``: its compile seconds, error and time per call in ``row``."""
        if form is None:
            row[f"{prefix}_error"] = "not lowered"
            return
        try:
            t0 = time.perf_counter()
            # every shape's lowering is the same Python function: without a reset Dynamo stops recompiling it
            # after its recompile limit (8) and runs the later shapes uncompiled (the first run's 9 last shapes)
            torch._dynamo.reset()
            compiled = torch.compile(form, dynamic=False, options=options)
            out = compiled(x, w)
            torch.cuda.synchronize()
            row[f"{prefix}_compile_s"] = round(time.perf_counter() - t0, 2)
            row[f"{prefix}_max_err"] = float((out.float() - ref).abs().max()) / scale
            row[f"{prefix}_us"] = _graph_us(lambda: compiled(x, w))
        except Exception as e:  # noqa: BLE001 - one shape's failure is recorded
            row[f"{prefix}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"

    geometry = (x_shape, w_shape, list(w_shape[2:]), list(stride), list(dilation), c, list(padding), list(padding))
    if "inductor" in forms:
        compiled_row("inductor", _conv_as_kernels(*geometry), engines_options)
    taps = int(w_shape[2]) * int(w_shape[3])
    if taps > UNROLLED_TAPS and "written_out" in forms:  # the windows' sum written out whatever its taps, which the converter stops at
        keep, onnx_torch.UNROLLED_TAPS = onnx_torch.UNROLLED_TAPS, taps
        try:
            windows = onnx_torch._conv_as_kernels(*geometry)
        finally:
            onnx_torch.UNROLLED_TAPS = keep
        compiled_row("written_out", windows, dict(engines_options, unroll_reductions_threshold=taps + 1))

    if "native" not in forms:
        return row
    xn, wn = x.contiguous(), w.contiguous()
    native = torch.ops.aten._conv_depthwise2d
    args = (list(w_shape[2:]), None, list(stride), list(padding), list(dilation))
    try:
        row["native_first_ms"] = _first_ms(lambda: native(xn, wn, *args))
        out = native(xn, wn, *args)
        row["native_max_err"] = float((out.float() - ref).abs().max()) / scale
        row["native_us"] = _graph_us(lambda: native(xn, wn, *args))
    except Exception as e:  # noqa: BLE001
        row["native_error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return row


def summary(rows: list[dict]) -> dict:
    """The plan seconds in all, and lowering the shapes in order of plan seconds saved per microsecond lost:
    after each, the plan seconds left and the microseconds per forward pass added."""
    plans = sum(r["cudnn_first_ms"] for r in rows) / 1e3
    ok = [r for r in rows if "inductor_us" in r]

    def lost(r):
        return max(0.0, (r["inductor_us"] - r["cudnn_us"]) * r["count"])

    order = sorted(ok, key=lambda r: lost(r) / max(r["cudnn_first_ms"], 1e-3))
    steps, saved, added = [], 0.0, 0.0
    for r in order:
        saved += r["cudnn_first_ms"] / 1e3
        added += (r["inductor_us"] - r["cudnn_us"]) * r["count"]
        steps.append({"x": r["x"], "kernel": r["kernel"], "stride": r["stride"], "plan_s_left": round(plans - saved, 3),
                      "us_added": round(added, 1)})
    cudnn_us = sum(r["cudnn_us"] * r["count"] for r in rows)
    return {"shapes": len(rows), "calls": sum(r["count"] for r in rows), "plan_s": round(plans, 3),
            "cudnn_us_per_pass": round(cudnn_us, 1),
            "inductor_us_per_pass": round(sum(r.get("inductor_us", r["cudnn_us"]) * r["count"] for r in rows), 1),
            "native_us_per_pass": round(sum(r.get("native_us", r["cudnn_us"]) * r["count"] for r in rows), 1),
            "plan_us_per_pass": round(sum(r.get("plan_us", r["cudnn_us"]) * r["count"] for r in rows), 1),
            "triton_us_per_pass": round(sum(r.get("triton_us", r["cudnn_us"]) * r["count"] for r in rows), 1),
            "triton_best_us_per_pass": round(sum(r.get("triton_best_us", r["cudnn_us"]) * r["count"] for r in rows), 1),
            "lowering_order": steps}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="nasnetalarge")
    ap.add_argument("--seconds", type=float, default=500.0, help="measure no new shape after this")
    ap.add_argument("--batch", type=int, default=1, help="the batch the shapes are found and timed at")
    ap.add_argument("--forms", default=",".join(FORMS), help="of " + ", ".join(FORMS) + " (cuDNN's always)")
    ap.add_argument("--grouped", action="store_true",
                    help="the model's convolutions of narrow groups (not depthwise) instead: cuDNN's and triton only")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/depthwise_kernels_out"))
    args = ap.parse_args(argv)
    forms = tuple(f for f in args.forms.split(",") if f)
    if any(f not in FORMS for f in forms):
        ap.error(f"--forms {args.forms!r}: of {', '.join(FORMS)}")
    import torch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    torch.backends.cudnn.benchmark = False  # as the launcher runs: cuDNN's heuristics, one plan per key
    warm = torch.randn(1, 8, 16, 16, device="cuda").half().to(memory_format=torch.channels_last)
    torch.nn.functional.conv2d(warm, torch.randn(8, 8, 3, 3, device="cuda").half(), None, 1, 1)  # cuDNN's own start
    result: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                    "cudnn": torch.backends.cudnn.version(), "batch": args.batch, "models": {}}
    for name in args.models.split(","):
        counts = depthwise_calls(name, batch=args.batch, grouped=args.grouped)
        rows = []
        for key, n in sorted(counts.items(), key=lambda kv: -kv[1]):
            if time.perf_counter() - t_start > args.seconds:
                break
            row = measure_shape(key, forms)
            row["count"] = n
            rows.append(row)
            result["models"][name] = {"rows": rows, "distinct": len(counts)}  # saved as it goes: a call may end
            (out / "depthwise_kernels.json").write_text(json.dumps(result, indent=1))
            print(json.dumps({"model": name, **{k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}}),
                  flush=True)
        result["models"][name] = {"rows": rows, "summary": summary(rows), "distinct": len(counts)}
        (out / "depthwise_kernels.json").write_text(json.dumps(result, indent=1))
        s = result["models"][name]["summary"]
        print(json.dumps({"model": name, **{k: v for k, v in s.items() if k != "lowering_order"}}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
