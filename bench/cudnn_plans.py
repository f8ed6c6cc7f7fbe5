#!/usr/bin/env python3
"""cuDNN plans shipped against cuDNN plans built at every start: per distinct depthwise convolution of a model
(``--dense``: per distinct other 2-d convolution), what a fresh process pays before its first call, and what each
runs at.

Why: a fresh load of a depthwise-separable network spends most of its time in cuDNN building its depthwise
plans (runtime-compiled kernels; NASNet-A Large, H200: 3.8 of a 5.5 s load).  ``launcher/engines/cudnn_plans.py``
builds them once through cuDNN's frontend and serializes them; this measures, for each timm model's distinct
depthwise shapes (fp16, batch 1, channels-last, as ``bench/depthwise_kernels.py`` finds them):

  torch_first_ms    torch's convolution's first call in a fresh process (cuDNN builds its plan)
  built_ms          the frontend's plan built (``PlanCache.get``) in this process
  loaded_ms         the same plan deserialized in a fresh process (``PlanCache.load``), and its first call
  bytes             the serialized plan's size
  torch_us, plan_us per call in a CUDA Graph of 20 calls (median of 30 replays), this process
  serializable      whether cuDNN serializes the plan (its runtime-compiled engines' plans only: the others are
                    built again at a load, through the frontend, in ``built_ms``)
  max_err           the plan's output against torch's (scaled by its largest magnitude)

and the totals per model.  Run on the device after ``source bench/device_env.sh`` (the frontend's wheel is
carried in ``.whl/``):
    python3 bench/cudnn_plans.py --models nasnetalarge,mixnet_s --out $OUT
    python3 bench/cudnn_plans.py --dense --models efficientnet_b0,resnet50,nasnetalarge --out $OUT
    python3 bench/cudnn_plans.py --candidates 12 --models convnext_tiny,efficientnet_b0 --out $OUT
``--candidates N`` instead builds and times every candidate plan cuDNN lists for each shape (at most N) against
the plan its heuristics choose, which a bundle ships (``measure_candidates``).
Writes cudnn_plans.json (``--dense``: cudnn_plans_dense.json) under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def _groups(key) -> int:
    """A key's groups: its sixth item (``--dense``'s keys), else the input's channels (a depthwise key)."""
    return int(key[5]) if len(key) > 5 else int(key[0][1])


def _tensors(key):
    import torch

    x_shape, w_shape, *_ = key
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(x_shape, device="cuda", generator=g).half().to(memory_format=torch.channels_last)
    w = (torch.randn(w_shape, device="cuda", generator=g) * 0.1).half().to(memory_format=torch.channels_last)
    return x, w


def child_torch(keys: list) -> dict:
    """A fresh process: torch's first call of each key (its plan built), in milliseconds."""
    import torch
    import torch.nn.functional as F

    from depthwise_kernels import _first_ms

    torch.backends.cudnn.benchmark = False
    warm = torch.randn(1, 8, 16, 16, device="cuda").half().to(memory_format=torch.channels_last)
    F.conv2d(warm, torch.randn(8, 8, 3, 3, device="cuda").half(), None, 1, 1)  # cuDNN's own start
    out = []
    for key in keys:
        x, w = _tensors(key)
        stride, padding, dilation = key[2:5]
        out.append(_first_ms(lambda: F.conv2d(x, w, None, stride, padding, dilation, _groups(key))))
    return {"torch_first_ms": out}


def child_loaded(keys: list, plans: str) -> dict:
    """A fresh process: the serialized plans deserialized, then each key's first call, in milliseconds."""
    import torch

    from depthwise_kernels import _first_ms
    from parastream.launcher.engines import cudnn_plans as cp

    torch.zeros(1, device="cuda")
    t0 = time.perf_counter()
    got = cp.CACHE.load(Path(plans).read_bytes(), 0, now=True)
    load_s = time.perf_counter() - t0
    first = []
    for key in keys:
        x, w = _tensors(key)
        stride, padding, dilation = key[2:5]
        first.append(_first_ms(lambda: cp.conv2d(x, w, None, list(stride), list(padding), list(dilation),
                                                 _groups(key))))
    per = {k: round(p.built_s * 1e3, 3) for (_, k), p in cp.CACHE.plans.items()}
    return {"load": got, "load_s": round(load_s, 4), "first_call_ms": first, "deserialize_ms": per,
            "built_here": sum(1 for p in cp.CACHE.plans.values() if p.source == "built")}


def _child(mode: str, keys: list, plans: str | None = None) -> dict:
    env = dict(os.environ)
    cmd = [sys.executable, __file__, "--child", mode, "--keys", json.dumps(keys)] + (["--plans", plans] if plans else [])
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if done.returncode != 0:
        return {"error": (done.stderr or done.stdout)[-2000:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure_model(name: str, out: Path, dense: bool = False) -> dict:
    import torch.nn.functional as F

    from depthwise_kernels import _graph_us, depthwise_calls
    from parastream.launcher.engines import cudnn_plans as cp

    counts = depthwise_calls(name, dense=dense)
    keys = [[list(k[0]), list(k[1]), list(k[2]), list(k[3]), list(k[4]), *k[5:]] for k in counts]
    rows = []
    for key, n in zip(keys, counts.values()):
        x, w = _tensors(key)
        stride, padding, dilation = key[2:5]
        groups = _groups(key)
        pk = cp.plan_key("float16", x.shape, w.shape, stride, padding, dilation)
        row = {"x": key[0], "w": key[1], "kernel": key[1][2:], "stride": stride, "padding": padding, "groups": groups,
               "count": n}
        t0 = time.perf_counter()
        plan = cp.CACHE.get(0, pk)
        row["built_ms"] = round((time.perf_counter() - t0) * 1e3, 3)
        if plan is None:
            row["error"] = cp.CACHE.failed.get((0, pk))
            rows.append(row)
            continue
        row["workspace"], row["serializable"] = plan.workspace, plan.serializable
        ref = F.conv2d(x, w, None, stride, padding, dilation, groups).float()
        got = cp.conv2d(x, w, None, stride, padding, dilation, groups).float()
        row["max_err"] = float((got - ref).abs().max()) / (float(ref.abs().max()) or 1.0)
        row["torch_us"] = round(_graph_us(lambda: F.conv2d(x, w, None, stride, padding, dilation, groups)), 3)
        row["plan_us"] = round(_graph_us(lambda: cp.conv2d(x, w, None, stride, padding, dilation, groups)), 3)
        rows.append(row)
        print(json.dumps({"model": name, **row}), flush=True)
    blob = cp.CACHE.serialize(0)
    path = out / f"{name}{'_dense' if dense else ''}_plans.npz"
    path.write_bytes(blob)
    fresh_torch = _child("torch", keys)
    fresh_loaded = _child("loaded", keys, str(path))
    for i, row in enumerate(rows):
        if "torch_first_ms" in fresh_torch:
            row["torch_first_ms"] = round(fresh_torch["torch_first_ms"][i], 3)
        if "first_call_ms" in fresh_loaded:
            row["loaded_first_call_ms"] = round(fresh_loaded["first_call_ms"][i], 3)
    total = {
        "shapes": len(rows), "calls": sum(r["count"] for r in rows), "plans_bytes": len(blob),
        "built_s": round(sum(r["built_ms"] for r in rows) / 1e3, 3),
        "serializable": sum(1 for r in rows if r.get("serializable")),
        "torch_first_s": round(sum(r.get("torch_first_ms", 0.0) for r in rows) / 1e3, 3),
        "loaded_s": fresh_loaded.get("load_s"), "loaded_first_calls_s":
            round(sum(r.get("loaded_first_call_ms", 0.0) for r in rows) / 1e3, 3),
        "built_in_loaded_process": fresh_loaded.get("built_here"),
        "torch_us_per_pass": round(sum(r.get("torch_us", 0.0) * r["count"] for r in rows), 1),
        "plan_us_per_pass": round(sum(r.get("plan_us", 0.0) * r["count"] for r in rows), 1),
        "max_err": max((r.get("max_err", 0.0) for r in rows), default=0.0),
    }
    return {"rows": rows, "total": total, "fresh_torch": {k: v for k, v in fresh_torch.items() if k == "error"},
            "fresh_loaded": {k: v for k, v in fresh_loaded.items() if k != "first_call_ms"}}


def measure_candidates(name: str, limit: int, dense: bool = False) -> dict:
    """Per distinct depthwise shape of ``name`` (``--dense``: per other 2-d convolution): every candidate plan cuDNN
    lists for it (``cudnn_plans.plan_graph``: heuristics mode A, then the fallback list; at most ``limit``), each
    built (``build_plan_at_index``) and timed like the others, 20 calls in a CUDA Graph, against the heuristics'
    choice (the plan a bundle ships, ``PlanCache``) and torch's convolution, each checked against torch's output.

    Why: ConvNeXt-T's bundle ran its 18 depthwise 7x7 convolutions in cuDNN's ``conv2d_c1_k1_nhwc`` at 11.2 µs each
    whatever their size (56x56x96 down to 7x7x768; H200, bench/NOTES.md, fifty-first session), 202 of its 470 µs of
    kernels, as torch.compile does; EfficientNet-B0's runtime-compiled depthwise kernels (its plans with a SiLU in
    them) ran 2.7-3.7 µs.  Whether another of cuDNN's candidates for the same convolution is faster, and by how much,
    decides whether a build should time them (as it does not: the first candidate that builds is kept)."""
    import torch
    import torch.nn.functional as F

    from depthwise_kernels import _graph_us, depthwise_calls
    from parastream.launcher.engines import cudnn_plans as cp

    cudnn = cp.frontend()
    counts = depthwise_calls(name, dense=dense)
    rows = []
    for k, n in counts.items():
        key = [list(k[0]), list(k[1]), list(k[2]), list(k[3]), list(k[4]), *k[5:]]
        x, w = _tensors(key)
        stride, padding, dilation = key[2:5]
        groups = _groups(key)
        pk = cp.plan_key("float16", x.shape, w.shape, stride, padding, dilation)
        row = {"x": key[0], "w": key[1], "stride": stride, "padding": padding, "groups": groups, "count": n}
        ref = F.conv2d(x, w, None, stride, padding, dilation, groups).float()
        scale = float(ref.abs().max()) or 1.0
        row["torch_us"] = round(_graph_us(lambda: F.conv2d(x, w, None, stride, padding, dilation, groups)), 3)
        if cp.CACHE.get(0, pk) is not None:
            row["shipped_us"] = round(_graph_us(lambda: cp.conv2d(x, w, None, stride, padding, dilation, groups)), 3)
        h = cp.CACHE.handle(0)
        try:
            g = cp.plan_graph(h, pk, 0)
            row["candidates"] = int(g.get_execution_plan_count())
        except Exception as e:  # noqa: BLE001 - the row says why
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            rows.append(row)
            continue
        out = cp.conv_out_shape(x.shape, w.shape, stride, padding, dilation)
        y = torch.empty_strided(out, cp._channels_last_strides(out), dtype=x.dtype, device=x.device)
        plans = []
        for i in range(min(row["candidates"], limit)):
            c = {"index": i}
            try:
                t0 = time.perf_counter()
                g.build_plan_at_index(i)
                c["build_ms"] = round((time.perf_counter() - t0) * 1e3, 1)
                c["name"] = g.get_plan_name_at_index(i)
                ws = torch.empty(max(int(g.get_workspace_size_plan_at_index(i)), 1), dtype=torch.uint8, device="cuda")

                def run(i=i, ws=ws):
                    cudnn.set_stream(h, torch.cuda.current_stream().cuda_stream)
                    g.execute_plan_at_index({cp._X: x, cp._W: w, cp._Y: y}, ws, i, handle=h)

                run()
                torch.cuda.synchronize()
                c["max_err"] = round(float((y.float() - ref).abs().max()) / scale, 6)
                c["us"] = round(_graph_us(run), 3)
            except Exception as e:  # noqa: BLE001 - the candidate's entry says why
                c["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            finally:
                cudnn.set_stream(h, 0)
            plans.append(c)
        row["plans"] = plans
        timed = [c for c in plans if "us" in c and c.get("max_err", 1.0) < 1e-2]
        if timed:
            best = min(timed, key=lambda c: c["us"])
            row["best"] = {"index": best["index"], "name": best.get("name"), "us": best["us"]}
            if "shipped_us" in row:
                row["shipped_over_best"] = round(row["shipped_us"] / best["us"], 3)
        rows.append(row)
        print(json.dumps({"model": name, **{k: v for k, v in row.items() if k != "plans"}}), flush=True)
    per_pass = {f: round(sum(r.get(f, 0.0) * r["count"] for r in rows), 1) for f in ("torch_us", "shipped_us")}
    per_pass["best_us"] = round(sum(r["best"]["us"] * r["count"] for r in rows if "best" in r), 1)
    return {"rows": rows, "total": {"shapes": len(rows), "calls": sum(r["count"] for r in rows), **per_pass}}


def separable_block(c: int, size: int, kernel: int, seed: int = 0):
    """ONNX of a NASNet-style separable block: ReLU, depthwise k x k, pointwise with bias, ReLU, depthwise k x k,
    pointwise with bias (BatchNorm folded into the biases), at batch 1."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)

    def w(name, shape):
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.2).astype(np.float32), name)

    N = helper.make_node
    p = kernel // 2
    inits = [w("dw1", (c, 1, kernel, kernel)), w("pw1", (c, c, 1, 1)), w("b1", (c,)),
             w("dw2", (c, 1, kernel, kernel)), w("pw2", (c, c, 1, 1)), w("b2", (c,))]
    nodes = [N("Relu", ["x"], ["r0"]), N("Conv", ["r0", "dw1"], ["d1"], pads=[p] * 4, group=c),
             N("Conv", ["d1", "pw1", "b1"], ["p1"]), N("Relu", ["p1"], ["r1"]),
             N("Conv", ["r1", "dw2"], ["d2"], pads=[p] * 4, group=c), N("Conv", ["d2", "pw2", "b2"], ["y"])]
    graph = helper.make_graph(nodes, "separable", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c, size, size])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return onnx.shape_inference.infer_shapes(model)


def measure_blocks(shapes: list) -> list:
    """Each separable block converted with and without the plans' op (``convert(cudnn_plans=...)``), compiled by
    Inductor, timed in a CUDA Graph, with what Inductor wrote around the op (its output code's lines that name it
    and the copies and alignment notes beside them)."""
    import torch
    from torch._inductor.utils import run_and_get_code

    from depthwise_kernels import _graph_us
    from parastream.launcher.engines.onnx_torch import convert, to_fx

    rows = []
    for c, size, k in shapes:
        model = separable_block(c, size, k)
        x = torch.randn(1, c, size, size, device="cuda").half().to(memory_format=torch.channels_last)
        row = {"c": c, "size": size, "kernel": k}
        outs = {}
        for name, planned in (("torch", False), ("plans", True)):
            torch._dynamo.reset()
            module = to_fx(convert(model, "float16", cudnn_plans=planned)).cuda()
            compiled = torch.compile(module)
            with torch.no_grad():
                out, code = run_and_get_code(compiled, x)
                outs[name] = out[0].float()
                row[f"{name}_us"] = round(_graph_us(lambda: compiled(x), reps=10), 3)
            if planned:
                lines = code[0].splitlines()
                row["plans_code"] = [ln.strip() for ln in lines if "cudnn_conv2d" in ln or "not aligned" in ln
                                     or "empty_strided" in ln][:24]
        row["max_err"] = float((outs["plans"] - outs["torch"]).abs().max() / outs["torch"].abs().max())
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "plans_code"}), flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="nasnetalarge")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/cudnn_plans_out"))
    ap.add_argument("--blocks", action="store_true",
                    help="instead: NASNet-style separable blocks compiled with and without the plans' op, timed")
    ap.add_argument("--dense", action="store_true",
                    help="the models' other 2-d convolutions (dense and grouped) instead of their depthwise ones")
    ap.add_argument("--candidates", type=int, default=0, metavar="N",
                    help="instead: every candidate plan cuDNN lists per shape (at most N), each built and timed, "
                         "against the heuristics' choice and torch's convolution (cudnn_plans_candidates.json)")
    ap.add_argument("--child", choices=("torch", "loaded"))
    ap.add_argument("--keys")
    ap.add_argument("--plans")
    args = ap.parse_args(argv)
    if args.child:
        keys = json.loads(args.keys)
        got = child_torch(keys) if args.child == "torch" else child_loaded(keys, args.plans)
        print(json.dumps(got))
        return 0
    import torch

    from parastream.launcher.engines import cudnn_plans as cp

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if cp.frontend() is None:
        print("cudnn_plans: the cuDNN frontend (nvidia-cudnn-frontend) cannot be imported", file=sys.stderr)
        return 2
    torch.backends.cudnn.benchmark = False
    if args.blocks:
        rows = measure_blocks([(168, 42, 3), (168, 42, 5), (336, 21, 5), (672, 11, 3), (42, 83, 7)])
        (out / "cudnn_plans_blocks.json").write_text(json.dumps({"device": torch.cuda.get_device_name(0),
                                                                  "rows": rows}, indent=1))
        return 0
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "cudnn": torch.backends.cudnn.version(), "frontend_cudnn": cp.frontend().backend_version(),
              "models": {}}
    if args.candidates:
        for name in args.models.split(","):
            result["models"][name] = measure_candidates(name, args.candidates, dense=args.dense)
            (out / "cudnn_plans_candidates.json").write_text(json.dumps(result, indent=1))
            print(json.dumps({"model": name, **result["models"][name]["total"]}), flush=True)
        return 0
    for name in args.models.split(","):
        result["models"][name] = measure_model(name, out, dense=args.dense)
        (out / ("cudnn_plans_dense.json" if args.dense else "cudnn_plans.json")).write_text(json.dumps(result, indent=1))
        print(json.dumps({"model": name, **result["models"][name]["total"]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
