#!/usr/bin/env python3
"""Detection models on the GPU: a bundle whose data-dependent tail (the post-processing: score threshold, top-k,
NMS) runs after each replay, in onnxruntime on the host or as torch ops on the GPU, whichever its build timed
faster (pipeline/host_tail.py), against what a user would run instead.  On the device machine, from the repository root, after ``source bench/device_env.sh``:

    python3 bench/detector_gpu.py --models fcos_resnet50_fpn,retinanet_resnet50_fpn --out $OUT

Per model (torchvision detectors of bench/corpus.py: random weights, backbone BatchNorm calibrated, 320x320,
TorchScript export at opset 17, as the CPU corpus exports them) and per ``--heads``:

  prior    the classification head as torchvision initialises it (bias -log(99): scores 0.01, below every
           threshold): the tail sorts and thresholds, and finds nothing, as on an image without objects
  busy     that bias set to 0 (scores ~0.5, above the thresholds): every level's top-k candidates reach NMS,
           the tail's most work, as on a crowded image

it builds ``parastream build --backend torch --precision fp16`` (the build's defaults, its stages' seconds), then
times side by side in one process, in alternating blocks on fresh random inputs, each call's wall time with the
GPU synchronised (the bundle's outputs arrive on the host; the others' are copied there, as a caller reads them):

  parastream    the bundle as it loads: its static part replayed as one CUDA Graph, then its tail where the build
                placed it (the row's ``placement``: report.json's, what the build timed and chose)
  host tail     the same bundle with its tail in onnxruntime on the host
  gpu tail      the same bundle with its tail as torch ops on the GPU (launcher/engines/onnx_eager.py)
  static part   the bundle's static part alone (``load(host_tail=False)``): what the tail adds is the difference
  eager         the torchvision model in fp16 on the GPU, as its users run it
  gpu tail, one NMS call / gpu tail, NMS in groups   with ``--nms-forms``: the GPU tail with its
                NonMaxSuppression in each form whatever the candidates' count (as it runs, ``gpu tail`` takes the
                groups from ``onnx_eager.GROUPED_NMS_FROM`` candidates): one torchvision call over every candidate,
                or the groups form (``nms_in_groups``, where it does not decline; bench/nms_groups.py)
  compile       ``torch.compile`` of the same (mode ``reduce-overhead``; where it fails, the default mode, and
                where that fails too, the error), for the heads of ``--compile-heads`` (default busy)

and prints one row per model and head: the build's seconds, the medians in ms, the ratios, how many detections
each call gave (the tail's outputs' rows) and whether the outputs' shapes agreed with eager's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def _busy(model) -> None:
    """The classification head's bias at 0: scores ~0.5, every anchor above the score threshold."""
    import torch

    head = getattr(getattr(model, "head", None), "classification_head", None)
    if not hasattr(head, "cls_logits"):
        raise ValueError("the busy head is FCOS's and RetinaNet's (a classification head with cls_logits); "
                         "time other detectors with --heads prior")
    with torch.no_grad():
        head.cls_logits.bias.zero_()


def export(name: str, head: str, path: Path) -> tuple:
    """(the torchvision model in eval mode, its example input) after exporting it to ``path`` as the corpus does."""
    import torch

    import corpus

    model, inputs = corpus.make_model(name)
    if head == "busy":
        _busy(model)
    w = corpus.wrap(model, corpus.spec_of(name), list(inputs))
    with torch.no_grad():
        n_out = len(w(*inputs.values()))
        torch.onnx.export(w, tuple(inputs.values()), str(path), input_names=list(inputs),
                          output_names=[f"output_{i}" for i in range(n_out)], opset_version=17, dynamo=False)
    return w, inputs["x"]


def build(path: Path, out: Path, keep_fp32: str | None = None) -> dict:
    t0 = time.perf_counter()
    got = subprocess.run([sys.executable, "-m", "parastream.pipeline.cli", "build", str(path), "-o", str(out),
                          "--backend", "torch", "--precision", "fp16", "--force", "--json",
                          *(["--keep-fp32", keep_fp32] if keep_fp32 else [])],
                         capture_output=True, text=True)
    if got.returncode != 0:
        raise RuntimeError(f"build failed ({got.returncode}): {got.stderr.strip().splitlines()[-1:]}")
    summary = json.loads(got.stdout.strip().splitlines()[-1])
    return dict(summary, wall_s=round(time.perf_counter() - t0, 1))


def time_side_by_side(calls: dict, make_input, *, blocks: int, per_block: int, warmup: int) -> dict:
    """Per variant: the median and p10/p90 of its calls' wall ms, the variants taking turns block by block, each
    call on a fresh input."""
    import torch

    for f in calls.values():
        for _ in range(warmup):
            f(make_input())
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {k: [] for k in calls}
    for b in range(blocks):
        order = list(calls) if b % 2 == 0 else list(calls)[::-1]
        for k in order:
            for _ in range(per_block):
                x = make_input()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                calls[k](x)
                torch.cuda.synchronize()
                times[k].append((time.perf_counter() - t0) * 1e3)
    return {k: {"median_ms": float(np.median(v)), "p10_p90_ms": [float(np.percentile(v, 10)), float(np.percentile(v, 90))]}
            for k, v in times.items()}


def run_model(name: str, head: str, work: Path, args) -> dict:
    import torch

    from parastream.launcher import load
    from parastream.launcher.bundle import Bundle
    from parastream.launcher.tail import TailRunner

    row: dict = {"model": name, "head": head}
    folder = work / f"{name}_{head}"
    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    wrapped, example = export(name, head, folder / "model.onnx")
    row["export_s"] = round(time.perf_counter() - t0, 1)
    row["build"] = build(folder / "model.onnx", folder / "bundle", args.keep_fp32)
    if args.keep_fp32:
        row["keep_fp32"] = args.keep_fp32
    rep = json.loads((folder / "bundle" / "report.json").read_text())
    row["stage_seconds"] = rep.get("stage_seconds")
    row["host_tail"] = {k: rep["host_tail"].get(k) for k in ("nodes", "seeds", "end_to_end")}
    row["placement"] = rep["host_tail"].get("placement")
    runner = load(folder / "bundle")
    static = load(folder / "bundle", host_tail=False)
    bundle = Bundle.open(folder / "bundle")
    placed = {on: TailRunner(load(folder / "bundle", host_tail=False), bundle, bundle.manifest["host_tail"], on=on)
              for on in ("host", "gpu")}
    name_in = runner.plan.inputs[0].name
    shape = list(example.shape)

    # fp16 as the bundle runs; where torchvision's post-processing refuses half precision, fp32 (recorded)
    eager, cast = wrapped.cuda().half().eval(), torch.float16

    def to_host(outs):
        return [o.float().cpu().numpy() for o in outs]

    def eager_call(x):
        with torch.no_grad():
            return to_host(eager(x.to(cast)))

    try:
        eager_call(torch.randn(shape, device="cuda"))
    except Exception as e:  # noqa: BLE001
        row["eager_fp16_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        eager, cast = wrapped.float(), torch.float32
    row["eager_dtype"] = str(cast).removeprefix("torch.")

    calls = {"parastream": lambda x: runner({name_in: x.cpu().numpy()}),
             "host tail": lambda x: placed["host"]({name_in: x.cpu().numpy()}),
             "static part": lambda x: static({name_in: x.cpu().numpy()}),
             "eager": eager_call}
    if placed["gpu"].on_gpu:
        calls["gpu tail"] = lambda x: placed["gpu"]({name_in: x.cpu().numpy()})
        if args.nms_forms:
            from parastream.launcher.engines import onnx_eager

            def nms_form(grouped_from: int):  # the same tail, its NonMaxSuppression's form set by the count
                def call(x):
                    before, onnx_eager.GROUPED_NMS_FROM = onnx_eager.GROUPED_NMS_FROM, grouped_from
                    try:
                        return placed["gpu"]({name_in: x.cpu().numpy()})
                    finally:
                        onnx_eager.GROUPED_NMS_FROM = before
                return call
            calls["gpu tail, one NMS call"] = nms_form(1 << 62)
            calls["gpu tail, NMS in groups"] = nms_form(0)
    else:
        row["gpu_tail_refused"] = placed["gpu"].why_host
    compiled = None
    for mode in (("reduce-overhead", None) if head in args.compile_heads.split(",") else ()):
        try:
            fn = torch.compile(eager, mode=mode) if mode else torch.compile(eager)
            with torch.no_grad():
                for _ in range(3):
                    fn(torch.randn(shape, device="cuda").to(cast))
            compiled, row["compile_mode"] = fn, mode or "default"
            break
        except Exception as e:  # noqa: BLE001 - recorded: what a user of torch.compile would meet
            row.setdefault("compile_errors", []).append(f"{mode or 'default'}: {type(e).__name__}: {str(e)[:200]}")
    if compiled is not None:
        def compiled_call(x):
            with torch.no_grad():
                return to_host(compiled(x.to(cast)))
        calls["compile"] = compiled_call

    def make_input():
        # the bundle takes the exported input as it was declared (fp32); the others cast it as their forward does
        return torch.randn(shape, device="cuda")

    # how many detections, and whether the bundle's outputs have eager's shapes, on a few inputs
    agree, counts = [], []
    for _ in range(5):
        x = make_input()
        ours = runner({name_in: x.cpu().numpy()})
        theirs = eager_call(x)
        counts.append(int(next(iter(ours.values())).shape[0]))
        agree.append([tuple(v.shape) for v in ours.values()] == [t.shape for t in theirs])
    row["detections_per_call"] = counts
    row["shapes_agree_with_eager"] = agree
    row["timed"] = time_side_by_side(calls, make_input, blocks=args.blocks, per_block=args.per_block, warmup=args.warmup)
    t = row["timed"]
    row["vs_eager"] = t["eager"]["median_ms"] / t["parastream"]["median_ms"]
    if "compile" in t:
        row["vs_compile"] = t["compile"]["median_ms"] / t["parastream"]["median_ms"]
    row["tail_ms"] = t["parastream"]["median_ms"] - t["static part"]["median_ms"]
    if "gpu tail" in t:
        row["gpu_tail_vs_host_tail"] = t["host tail"]["median_ms"] / t["gpu tail"]["median_ms"]
        if "gpu tail, one NMS call" in t:
            row["one_nms_call_vs_groups"] = (t["gpu tail, one NMS call"]["median_ms"]
                                             / t["gpu tail, NMS in groups"]["median_ms"])
        row["gpu_tail_fallbacks"] = placed["gpu"].fallbacks
        if args.profile:
            row["gpu_tail_profile"] = profile_tail(placed["gpu"], name_in, make_input)
    for r in (runner, static, *placed.values()):
        r.close()
    return row


def profile_tail(runner, name_in: str, make_input, calls: int = 5) -> dict:
    """Where the GPU tail's time goes: torch's profiler over ``calls`` calls (host time per aten op, the most
    first, and how many of each), and the tail's host seconds per ONNX op type, timed around each node with no
    synchronisation (what the host spends issuing it; the GPU's wait shows up at the next op that reads a count)."""
    from torch.profiler import ProfilerActivity, profile

    from tail_ops import host_ms_per_op_type

    feeds = [{name_in: make_input().cpu().numpy()} for _ in range(calls)]
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for f in feeds:
            runner(f)
    top = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:25]
    aten = [{"op": e.key, "count": e.count // calls, "self_cpu_us": round(e.self_cpu_time_total / calls, 1),
             "device_us": round(getattr(e, "self_device_time_total", 0.0) / calls, 1)} for e in top]
    calls_left = iter(feeds)
    per_type = host_ms_per_op_type(runner._graph, lambda: runner(next(calls_left)), calls)
    return {"aten_per_call": aten, "onnx_op_ms_per_call": per_type}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="fcos_resnet50_fpn,retinanet_resnet50_fpn")
    ap.add_argument("--heads", default="prior,busy", help="comma-separated: prior, busy (see the module docstring)")
    ap.add_argument("--compile-heads", default="busy", help="the heads whose rows also time torch.compile "
                    "(each compile of a detector takes minutes)")
    ap.add_argument("--blocks", type=int, default=10)
    ap.add_argument("--per-block", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--nms-forms", action="store_true", help="also time the GPU tail with its NonMaxSuppression in "
                    "each form whatever the count: one torchvision call over every candidate, and the groups form "
                    "that it takes from GROUPED_NMS_FROM candidates (launcher/engines/onnx_eager.py)")
    ap.add_argument("--profile", action="store_true", help="also profile the GPU tail (each row's gpu_tail_profile)")
    ap.add_argument("--keep-fp32", default=None, metavar="NODE_OR_PATTERN,...",
                    help="the build's --keep-fp32 (what a build refused for an fp16 overflow names)")
    ap.add_argument("--work", default="/tmp/detector_gpu")
    ap.add_argument("--out", default="/tmp/detector_gpu_out")
    args = ap.parse_args()
    import torch

    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for head in args.heads.split(","):  # every model's first head before any model's second
        for name in args.models.split(","):
            try:
                row = run_model(name, head, Path(args.work), args)
            except Exception as e:  # noqa: BLE001 - one model's failure is its row
                row = {"model": name, "head": head, "error": f"{type(e).__name__}: {e}"}
            rows.append(row)
            print(json.dumps(row, default=str), flush=True)
            (out / "detector_gpu.json").write_text(json.dumps(rows, indent=1, default=str))
    print(f"{'model':<26} {'head':<6} {'build s':>7} {'tail on':>7} {'ours ms':>8} {'host t.':>8} {'gpu t.':>8} "
          f"{'static':>7} {'eager':>7} {'compile':>8} {'vs eager':>8} {'vs compile':>10} detections")
    for r in rows:
        if "error" in r:
            print(f"{r['model']:<26} {r['head']:<6} error: {r['error'][:150]}")
            continue
        t = r["timed"]
        comp = t.get("compile", {}).get("median_ms")
        gpu_t = t.get("gpu tail", {}).get("median_ms", float("nan"))
        print(f"{r['model']:<26} {r['head']:<6} {r['build']['wall_s']:7.1f} {(r['placement'] or {}).get('runs_on', '?'):>7} "
              f"{t['parastream']['median_ms']:8.3f} {t['host tail']['median_ms']:8.3f} {gpu_t:8.3f} "
              f"{t['static part']['median_ms']:7.3f} {t['eager']['median_ms']:7.3f} "
              f"{(comp or float('nan')):8.3f} {r['vs_eager']:7.2f}x {r.get('vs_compile', float('nan')):9.2f}x "
              f"{r['detections_per_call']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
