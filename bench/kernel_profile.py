"""Where a bundle's replay spends its time, kernel by kernel (run on the device after `source bench/device_env.sh`).

Exports a model as bench/gpu.py does, builds it with ``parastream.pipeline.build`` (torch backend, fp16, no
search), then runs the engines in launch order on one stream with direct launches under ``torch.profiler``
(one ``record_function`` per engine) and prints, for the engines on the critical stream (stream 0) and for
the slowest engines, every CUDA kernel with its median duration.  Also prints the per-engine medians of
the instrumented graph replay (``GpuLauncher.run_timed``) for comparison.

    python3 bench/kernel_profile.py --model inception_v3 [--top 4] [--variants unfused,fused] [--out $OUT]
    python3 bench/kernel_profile.py --model vit_b_16 --against-compile [--search]   # beside torch.compile's kernels
    python3 bench/kernel_profile.py --model mobilenet_v3_small --batch 32 --against-compile --conv-kernels cudnn
    python3 bench/kernel_profile.py --model efficientnet_b0 --against-compile --search --timeline  # gaps in the replays

``--against-compile`` also profiles ``torch.compile(mode="reduce-overhead")`` of the PyTorch model as its users run
it (bench/corpus_gpu.py's baseline) and prints both kernel lists, merged by kernel name (us per call, count), with
their totals: where a bundle's time goes that torch.compile's does not.  ``--search`` builds with the rewrite
search and the GPU timing of its choices, as a default build does.

``--timeline`` also profiles the bundle's CUDA Graph replay itself (the kernel list above is of direct launches)
and, with ``--against-compile``, torch.compile's replay, as timelines: per call the span from the first kernel's
start to the last one's end, the time some kernel ran (busy) and the rest (idle, the gaps between kernels), the
idle time summed by the kinds of the kernels on each side of a gap (``timeline_MODEL_VARIANT.json``).

With several ``--variants`` it also times every build's multi-stream graph and its one-stream graph in the
same alternating blocks (``pipeline.bench.measure``) and prints b/d for each; ``unfused`` turns off the torch
backend's cuDNN conv + bias + ReLU fusion (``FUSE_CONV_RELU``) for that build and load.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu import export, make_model  # noqa: E402


def profile(bundle, replays: int = 20) -> tuple[dict, object]:
    from torch.profiler import ProfilerActivity, profile as tprofile, record_function

    from parastream.launcher.gpu import GpuLauncher

    multi = GpuLauncher(bundle)
    la = GpuLauncher(bundle, graph=False, single_stream=True, engines=multi.engines)
    stream = la._h(la.origin)
    plan = bundle.plan
    for _ in range(3):
        la.launch()
    la.synchronize()
    with tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            for bid in plan.launch_order:
                if bid in la.elided:
                    continue
                with record_function(f"engine:{plan.branches[bid].name}"):
                    la.engines[bid].enqueue(stream, la._branch_addrs[bid])
            la.synchronize()
    # kernels by the GPU-side range of the engine's record_function (a gpu_user_annotation) that contains them
    from torch.autograd import DeviceType

    dev = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    ranges = sorted((e.time_range.start, e.time_range.end, e.name[len("engine:"):]) for e in dev if e.name.startswith("engine:"))
    if not ranges:
        print("warning: no GPU-side engine ranges in the profile; kernels cannot be attributed to engines")
    starts = np.array([r[0] for r in ranges])
    per_engine: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for e in dev:
        if e.name.startswith("engine:") or getattr(e, "is_user_annotation", False) or not len(starts):
            continue
        i = int(np.searchsorted(starts, e.time_range.start, side="right")) - 1
        if i >= 0 and e.time_range.start <= ranges[i][1]:
            per_engine[ranges[i][2]][e.name].append(float(e.time_range.elapsed_us()))
    spans = multi.run_timed(replays=20)
    la.close()
    out = {}
    for b in plan.branches:
        ks = per_engine.get(b.name, {})
        out[b.name] = {"stream": b.stream, "nodes": b.nodes, "in_place": b.id in la.elided,
                       "kernels": {n: {"count_per_replay": len(v) / replays, "median_us": float(np.median(v))}
                                   for n, v in ks.items()},
                       "graph_span_us": next(((s["end_ms"] - s["start_ms"]) * 1e3 for s in spans if s["branch"] == b.id), None)}
    return out, multi


def _by_name(kernels: dict[str, list[float]], calls: int) -> dict[str, dict]:
    return {n: {"us_per_call": float(np.sum(v)) / calls, "per_call": len(v) / calls} for n, v in kernels.items()}


def profile_compile(name: str, model, inputs: dict, calls: int = 20) -> dict[str, dict]:
    """Kernels of ``torch.compile(mode="reduce-overhead")`` on the model as its users run it, per call."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile as tprofile

    from corpus_gpu import users_compiled

    compiled, dev = users_compiled(name, model, inputs, warm=5)
    with torch.no_grad():
        with tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                compiled(*dev)
            torch.cuda.synchronize()
    ks: dict[str, list[float]] = defaultdict(list)
    for e in prof.events():
        if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False) and not e.name.startswith("engine:"):
            ks[e.name].append(float(e.time_range.elapsed_us()))
    return _by_name(ks, calls)


def _kind(name: str) -> str:
    """A kernel's kind by its name: Inductor's Triton, cuBLAS's GEMMs, cuDNN's convolutions, a copy or set, other."""
    if name.startswith("triton"):
        return "triton"
    if name.startswith(("Memcpy", "Memset")):
        return "memcpy/set"
    if name.startswith(("nvjet", "sm90_xmma_gemm", "cutlass_80_tensorop", "ampere")) and "fprop" not in name:
        return "gemm"
    if any(t in name for t in ("fprop", "cudnn", "conv", "Conv")):
        return "conv"
    return "other"


def replay_timeline(run, calls: int = 40) -> dict:
    """Where one call's GPU time goes between its kernels: ``run()`` (one replay of a captured CUDA Graph) ``calls``
    times under the profiler, each synchronised, and per call its span (first kernel's start to last kernel's end),
    the union of its kernels' intervals (busy) and the rest (idle), with the idle time before each kernel summed by
    the kinds of the kernel before and the kernel after (medians over the calls).  A call of torch.compile's holds
    its CUDA Graph tree's copy of the inputs and the host's time between that copy and the graph's launch.

    Why: ``profile`` launches a bundle's kernels directly (not in its graph), and its sum of kernel times left a
    one-engine bundle's replay 0.06-0.10 ms over it (EfficientNet-B0 0.390 ms a replay, 0.335 ms of kernels), where
    torch.compile's CUDA Graph replay sat 0.02-0.08 ms over its kernels: whether the graph's gaps or the kernels'
    time in the graph differ is what this says, for both, measured the same way.  (On the H200 the bundles' graphs
    idled 0.12-0.44 µs a gap: EfficientNet-B0's kernels ran 364 of a 381 µs span, their time in the graph above
    their time launched directly; bench/NOTES.md, fifty-first session.)"""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile as tprofile

    for _ in range(5):
        run()
    torch.cuda.synchronize()
    with torch.no_grad(), tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            # a marker kernel before each call (torch's spin_kernel, a kernel no model runs) tells the calls apart:
            # a 30 µs gap threshold did not: each torch.compile call came out as one 10-15 µs event (likely its
            # input's copy, the graph's kernels split off by the host's time between the two)
            torch.cuda._sleep(1000)
            run()
            torch.cuda.synchronize()
    ev = sorted(((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                 if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
                 and not e.name.startswith("engine:")), key=lambda t: t[0])
    groups, cur = [], None
    for e in ev:
        if "spin_kernel" in e[2]:
            if cur:
                groups.append(cur)
            cur = []
        elif cur is not None:
            cur.append(e)
    if cur:
        groups.append(cur)
    sizes = [len(g) for g in groups]
    mode = max(set(sizes), key=sizes.count) if sizes else 0
    groups = [g for g in groups if len(g) == mode]
    spans, busy, idle, per_call, names = [], [], [], [], defaultdict(list)
    for g in groups:
        spans.append(g[-1][1] - g[0][0])
        union, end, last = 0.0, g[0][0], "-"  # (last: the kernel that ended at ``end``, before any gap)
        t_call, n_call = defaultdict(float), defaultdict(float)
        for s, e, n in g:
            if s > end:
                gap = s - end
                key = f"{_kind(last) if last != '-' else '-'} -> {_kind(n)}"
                t_call[key] += gap
                n_call[key] += 1
                names[f"{last[:60]} -> {n[:60]}"].append(gap)
            union += max(0.0, e - max(s, end))
            if e >= end:
                end, last = e, n
        busy.append(union)
        idle.append(spans[-1] - union)
        per_call.append((t_call, n_call))
    trans = {k: [(t.get(k, 0.0), c.get(k, 0.0)) for t, c in per_call] for k in set().union(*(t for t, _ in per_call))}
    med = lambda v: round(float(np.median(v)), 2) if v else None  # noqa: E731
    top = sorted(names.items(), key=lambda kv: -sum(kv[1]) / max(len(groups), 1))[:12]
    return {"calls": len(groups), "kernels_per_call": mode, "span_us": med(spans), "busy_us": med(busy),
            "idle_us": med(idle),
            "idle_by_transition": {k: {"us": med([a for a, _ in v]), "gaps": med([b for _, b in v])}
                                   for k, v in sorted(trans.items(), key=lambda kv: -np.median([a for a, _ in kv[1]]))},
            "largest_gaps": [{"between": k, "us_per_call": round(sum(v) / len(groups), 2), "median_us": med(v)}
                             for k, v in top]}


def print_timeline(label: str, t: dict) -> None:
    print(f"{label}: {t['kernels_per_call']} kernels a call, span {t['span_us']} us = busy {t['busy_us']} + idle "
          f"{t['idle_us']} (medians of {t['calls']} calls)")
    for k, v in t["idle_by_transition"].items():
        print(f"    idle {v['us']:7.2f} us in {v['gaps']:4.0f} gaps  {k}")
    for r in t["largest_gaps"][:6]:
        print(f"    {r['us_per_call']:7.2f} us a call (median {r['median_us']})  {r['between']}")


def bundle_kernels(res: dict) -> dict[str, dict]:
    """``profile``'s per-engine kernels merged by name over the bundle: us and count per replay."""
    out: dict[str, dict] = defaultdict(lambda: {"us_per_call": 0.0, "per_call": 0.0})
    for e in res.values():
        for n, k in e["kernels"].items():
            out[n]["us_per_call"] += k["median_us"] * k["count_per_replay"]
            out[n]["per_call"] += k["count_per_replay"]
    return dict(out)


def side_by_side(ours: dict, theirs: dict, top: int = 30) -> str:
    """Both kernel lists by name, the costliest of either first, with their totals."""
    names = sorted(set(ours) | set(theirs), key=lambda n: -max(ours.get(n, {}).get("us_per_call", 0),
                                                               theirs.get(n, {}).get("us_per_call", 0)))
    lines = [f"{'parastream us':>13} {'#':>5} {'compile us':>10} {'#':>5}  kernel"]
    for n in names[:top]:
        a, b = ours.get(n, {}), theirs.get(n, {})
        lines.append(f"{a.get('us_per_call', 0):13.1f} {a.get('per_call', 0):5.0f} {b.get('us_per_call', 0):10.1f} "
                     f"{b.get('per_call', 0):5.0f}  {n[:120]}")
    tot = [sum(d["us_per_call"] for d in x.values()) for x in (ours, theirs)]
    cnt = [sum(d["per_call"] for d in x.values()) for x in (ours, theirs)]
    lines.append(f"{tot[0]:13.1f} {cnt[0]:5.0f} {tot[1]:10.1f} {cnt[1]:5.0f}  total kernel time and kernels per call")
    return "\n".join(lines)


def report(res: dict, top: int) -> None:
    """The ``top`` slowest engines, each with its kernels (median us per replay)."""
    def total(e):
        return sum(k["median_us"] * k["count_per_replay"] for k in e["kernels"].values())

    print(f"{'engine':>11} {'s':>2} {'graph us':>8} {'kern us':>8} {'#k':>3}  first node")
    chosen = sorted(res, key=lambda n: -total(res[n]))[:top]
    seen = set()
    for name in chosen:
        if name in seen:
            continue
        seen.add(name)
        e = res[name]
        nk = sum(k["count_per_replay"] for k in e["kernels"].values())
        g = e["graph_span_us"]
        print(f"{name:>11} {e['stream']:>2} {g if g is not None else float('nan'):8.1f} {total(e):8.1f} {nk:3.0f}  "
              f"{e['nodes'][0]}{' (in place)' if e['in_place'] else ''}")
        for kname, k in sorted(e["kernels"].items(), key=lambda kv: -kv[1]["median_us"]):
            print(f"{'':>16} {k['median_us']:7.1f} us x{k['count_per_replay']:.0f}  {kname[:110]}")


def _summary(res: dict) -> dict:
    sums: dict[str, float] = defaultdict(float)
    count: dict[str, float] = defaultdict(float)
    for e in res.values():
        for kname, k in e["kernels"].items():
            kind = _kind(kname)
            key = {"gemm": "gemm (cuBLAS)", "conv": "conv (cuDNN)", "triton": "triton"}.get(kind, kname[:40])
            sums[key] += k["median_us"] * k["count_per_replay"]
            count[key] += k["count_per_replay"]
    return {k: {"us": round(v, 1), "kernels": round(count[k])} for k, v in sorted(sums.items(), key=lambda kv: -kv[1])}


def write_wrappers(bundle, folder: Path) -> None:
    """Each engine's Inductor output code (a kernels artifact's wrapper.py) as ``folder/BRANCH.py``: the extern
    calls (cuDNN, cuBLAS), the strides of the tensors they get and the Triton kernels between them."""
    import io
    import zipfile

    from parastream.launcher.engines.torch import EngineFile

    folder.mkdir(parents=True, exist_ok=True)
    for b in bundle.plan.branches:
        engine = EngineFile(bundle.engine_bytes(b))
        package = engine.compiled()
        if package is None:
            continue
        try:
            source = zipfile.ZipFile(io.BytesIO(package)).read("wrapper.py")
        except (zipfile.BadZipFile, KeyError):  # not a kernels artifact
            continue
        (folder / f"{b.name}.py").write_bytes(source)
        # what the build found in this code (``inductor_kernels.weight_only_kernels``, engine.json)
        found = (engine.meta.get("kernels") or {}).get("weight_only_kernels") or {}
        reads = (engine.meta.get("kernels") or {}).get("weight_only_reads") or []
        print(f"{b.name}: {sum(found.values())} kernel calls a replay read only the engine's weights"
              + (f": {found}, reading {reads}" if found else ""), flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="inception_v3")
    ap.add_argument("--batch", type=int, default=1, help="the batch exported, built and profiled (torch.compile's too)")
    ap.add_argument("--top", type=int, default=4, help="engines listed kernel by kernel (the slowest; all go to the JSON)")
    ap.add_argument("--streams", type=int, default=None)
    ap.add_argument("--variants", default="fused", help="comma list of fused (cuDNN conv+bias+ReLU, the default engines) "
                    "and unfused (convolution, then Inductor's Triton bias+ReLU kernel)")
    ap.add_argument("--opt-level", type=int, default=3, help="5 compiles engines with torch max-autotune")
    ap.add_argument("--conv-kernels", default="auto", choices=("auto", "cudnn", "inductor", "native", "triton"),
                    help="the builds' --conv-kernels (depthwise convolutions' form; auto: as the build times it)")
    ap.add_argument("--runs", type=int, default=300)
    ap.add_argument("--against-compile", action="store_true",
                    help="also profile torch.compile(reduce-overhead) of the PyTorch model and print both kernel lists")
    ap.add_argument("--search", action="store_true", help="build with the rewrite search and GPU-timed choices")
    ap.add_argument("--wrappers", action="store_true",
                    help="also write each compiled engine's Inductor output code (wrapper.py) under OUT/wrappers/VARIANT "
                         "and print the kernels in it that read only the engine's weights (work repeated at every call)")
    ap.add_argument("--timeline", action="store_true",
                    help="also profile the bundle's CUDA Graph replay (and with --against-compile torch.compile's) "
                         "as a timeline: each call's span, busy and idle time, idle by the kinds of kernel around it")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/kernels_out"))
    args = ap.parse_args(argv)
    from parastream.pipeline import build

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path("/tmp/kernels_work")
    work.mkdir(exist_ok=True)
    model, inputs = make_model(args.model, args.batch)
    name = args.model if args.batch == 1 else f"{args.model}_b{args.batch}"
    onnx_path = work / f"{name}.onnx"
    export(model, inputs, onnx_path)
    from parastream.pipeline.bench import measure
    from parastream.launcher.gpu import GpuLauncher

    from parastream.launcher.engines import torch as torch_backend

    launchers, summary, outputs = {}, {}, {}
    rng = np.random.default_rng(0)
    for variant in args.variants.split(","):
        torch_backend.FUSE_CONV_RELU = variant == "fused"
        t0 = time.perf_counter()
        bundle = build(onnx_path, work / f"{name}_{variant}", backend="torch", precision="fp16", search=args.search,
                       measure=args.search, force=True, streams=args.streams, optimization_level=args.opt_level,
                       conv_kernels=args.conv_kernels)
        build_s = time.perf_counter() - t0
        if args.wrappers:
            write_wrappers(bundle, out / "wrappers" / variant)
        res, multi = profile(bundle)
        (out / f"kernels_{name}_{variant}.json").write_text(json.dumps(res, indent=1))
        report(res, args.top)
        if args.timeline:
            timelines = {"parastream": replay_timeline(multi.launch)}
            print_timeline(f"{variant} (graph replay)", timelines["parastream"])
            if args.against_compile:
                from corpus_gpu import users_compiled

                compiled, dev = users_compiled(args.model, model, inputs, warm=5)
                timelines["torch_compile"] = replay_timeline(lambda: compiled(*dev))
                print_timeline("torch.compile (its CUDA Graph tree's replay)", timelines["torch_compile"])
                del compiled
            (out / f"timeline_{name}_{variant}.json").write_text(json.dumps(timelines, indent=1))
        if args.against_compile:
            theirs = profile_compile(args.model, model, inputs)
            ours = bundle_kernels(res)
            print(side_by_side(ours, theirs), flush=True)
            (out / f"kernels_{name}_{variant}_vs_compile.json").write_text(
                json.dumps({"parastream": ours, "torch_compile": theirs,
                            "kept": (bundle.report.get("search") or {}).get("rules_chosen_count"),
                            "measured_choices": bundle.report.get("measured_choices")}, indent=1))
        v = bundle.report.get("verification") or {}
        summary[variant] = {"build_s": round(build_s, 1), "kernels": _summary(res), "verified": v.get("passed"),
                            "max_scaled": {k: o.get("max_scaled") for k, o in v.get("outputs", {}).items()}}
        print(f"{variant}: build {build_s:.0f} s, verification passed {v.get('passed')}, "
              f"kernel time by kind (us per replay, one stream): {summary[variant]['kernels']}", flush=True)
        launchers[f"{variant} streams"] = multi
        launchers[f"{variant} one stream"] = GpuLauncher(bundle, single_stream=True, engines=multi.engines)
        if not outputs:
            outputs["feeds"] = {s.name: rng.standard_normal(s.shape).astype(s.dtype) for s in bundle.plan.inputs}
        outputs[variant] = multi(outputs["feeds"])
    torch_backend.FUSE_CONV_RELU = True
    names = [k for k in outputs if k != "feeds"]
    for other in names[1:]:
        for k, ref in outputs[names[0]].items():
            a, b = outputs[other][k].astype(np.float64), ref.astype(np.float64)
            print(f"max |{other} - {names[0]}| / max |{names[0]}| on {k}: {np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30):.2e}")
    times = measure(launchers, runs=args.runs, warmup=20)
    med = {k: float(np.median(v)) for k, v in times.items()}
    for k, v in med.items():
        print(f"{k:>20}: {v:.4f} ms")
    for variant in summary:
        b, d = med[f"{variant} one stream"], med[f"{variant} streams"]
        summary[variant].update(d_ms=d, b_ms=b, b_over_d=b / d)
        print(f"{variant}: b/d = {b / d:.3f}")
    (out / f"kernels_{name}_summary.json").write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
