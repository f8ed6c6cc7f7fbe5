#!/usr/bin/env python3
"""Why a one-stream parastream bundle can lose to torch.compile (issue 11, "never slower"): run on the device
after ``source bench/device_env.sh``.

For each model (torchvision or timm, random weights, BatchNorm calibrated on random images, TorchScript export,
fp16, batch 1) it builds the one-engine bundle (``streams=1``, no search) and times, side by side in one process
with CUDA events (medians of ``--runs`` timings after warm-up, rotating fresh random inputs):

  compile   torch.compile(mode="reduce-overhead") on the PyTorch module
  fused     the bundle with cuDNN conv + bias + ReLU where a Conv feeds only a Relu
  unfused   the same bundle loaded with fuse_conv_relu=False (Inductor's convolution + Triton epilogue)
  bench     fused, with torch.backends.cudnn.benchmark on while the engine is compiled and captured

(the build itself times fused against unfused and records the faster: ``measured_choices``, printed too)
and, for the first ``--profile`` models, the CUDA kernels of one replay of ``compile`` and ``fused`` (name,
count, total microseconds), so that the cause of a gap can be read off.

    python3 bench/one_engine.py --models squeezenet1_1,timm:mixnet_s,mobilenet_v3_large --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from corpus import calibrate_batchnorm  # noqa: E402
from gpu import cuda_median_ms, export, max_err, ort_reference  # noqa: E402


def make_vision_model(spec: str, size: int):
    import torch

    torch.manual_seed(0)
    if spec.startswith("timm:"):
        import timm

        model = timm.create_model(spec[5:], pretrained=False)
    else:
        import torchvision

        kw = {"aux_logits": False, "init_weights": True} if spec in ("inception_v3", "googlenet") else {}
        model = getattr(torchvision.models, spec)(weights=None, **kw)
    x = torch.randn(1, 3, size, size)
    calibrate_batchnorm(model, x, batches=2, batch_size=8)
    return model, {"x": x}


def kernels(fn, replays: int = 10) -> list[tuple[str, int, float]]:
    """(kernel name, launches per replay, microseconds per replay), slowest first."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            fn()
        torch.cuda.synchronize()
    agg: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset")):
            agg[e.name][0] += 1
            agg[e.name][1] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    rows = [(n[:110], c // replays, t / replays) for n, (c, t) in agg.items()]
    return sorted(rows, key=lambda r: -r[2])


def run_model(spec: str, args, work: Path) -> dict:
    import torch

    from parastream.launcher.gpu import GpuLauncher
    from parastream.pipeline import build

    res: dict = {"model": spec}
    model, inputs = make_vision_model(spec, args.size)
    path = work / f"{spec.replace(':', '_')}.onnx"
    export(model, inputs, path)
    feeds = {k: v.numpy() for k, v in inputs.items()}
    ref = list(ort_reference(path, feeds).values())[0]
    rng = np.random.default_rng(1)
    sets = [rng.standard_normal(inputs["x"].shape).astype(np.float32) for _ in range(4)]
    cur = {"i": 0}

    def pick(i):
        cur["i"] = i % len(sets)

    # torch.compile on the module
    model_h = model.half().cuda()
    dev_sets = [torch.from_numpy(s).half().cuda() for s in sets]
    compiled = torch.compile(model_h, mode="reduce-overhead")
    t0 = time.perf_counter()
    with torch.no_grad():
        for _ in range(3):
            compiled(dev_sets[0])
        torch.cuda.synchronize()
        res["compile_s"] = time.perf_counter() - t0
        res["compile_ms"] = cuda_median_ms(lambda: compiled(dev_sets[cur["i"]]), args.runs, 100, pick)
        prof_compile = kernels(lambda: compiled(dev_sets[0])) if args.profile_left > 0 else None

    t0 = time.perf_counter()
    bundle = build(path, work / f"{path.stem}_b", backend="torch", precision="fp16", search=False, streams=1,
                   verify=False, force=True)
    res["build_s"] = time.perf_counter() - t0
    res["branches"] = len(bundle.plan.branches)

    res["measured_choices"] = {k: v for k, v in (bundle.report.get("measured_choices") or {}).items() if k != "runs"}
    launchers = {}
    for variant in ("fused", "unfused", "bench"):
        torch.backends.cudnn.benchmark = variant == "bench"
        t0 = time.perf_counter()
        la = GpuLauncher(bundle, fuse_conv_relu=variant != "unfused")
        res[f"{variant}_load_s"] = time.perf_counter() - t0
        res[f"{variant}_maxerr"] = max_err(la(feeds)[bundle.plan.outputs[0].name], ref)
        launchers[variant] = la
    torch.backends.cudnn.benchmark = False
    from parastream.launcher.bench import measure

    times = measure(launchers, runs=args.runs, warmup=20)
    for variant, t in times.items():
        res[f"{variant}_ms"] = float(np.median(t))
    if prof_compile is not None:
        res["kernels_compile"] = prof_compile
        for variant in ("fused", "unfused"):
            la = launchers[variant]
            res[f"kernels_{variant}"] = kernels(lambda la=la: (la.launch(), la.synchronize()))
        args.profile_left -= 1
    for la in launchers.values():
        la.close()
    del compiled, model_h
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="squeezenet1_1,timm:mixnet_s,mobilenet_v3_large")
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--profile", type=int, default=2, help="how many models get kernel lists")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/one_engine"))
    args = ap.parse_args(argv)
    args.profile_left = args.profile
    import torch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path("/tmp/one_engine_work")
    work.mkdir(exist_ok=True)
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    results = []
    for spec in args.models.split(","):
        try:
            r = run_model(spec, args, work)
        except Exception as e:  # noqa: BLE001 - report and go on
            traceback.print_exc()
            r = {"model": spec, "error": f"{type(e).__name__}: {e}"}
        results.append(r)
        print(json.dumps({k: v for k, v in r.items() if not k.startswith("kernels")}), flush=True)
        for key in ("kernels_compile", "kernels_fused", "kernels_unfused"):
            if key in r:
                tot = sum(t for _, _, t in r[key])
                print(f"  {key}: {sum(c for _, c, _ in r[key])} kernels, {tot:.1f} us per replay")
                for n, c, t in r[key][:12]:
                    print(f"    {t:8.1f} us {c:4d}x  {n}")
        (out / "one_engine.json").write_text(json.dumps(results, indent=1))
    print("model  compile  fused  unfused  bench(ms)  compile/fused")
    for r in results:
        if "error" not in r:
            print(f"{r['model']}  {r['compile_ms']:.3f}  {r['fused_ms']:.3f}  {r['unfused_ms']:.3f}  {r['bench_ms']:.3f}  "
                  f"{r['compile_ms'] / r['fused_ms']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
