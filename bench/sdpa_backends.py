#!/usr/bin/env python3
"""torch's scaled-dot-product attention kernels timed against each other on the attention shapes of the
transformer models of the corpus, as a bundle runs them: fp16, chains of layers in one CUDA Graph.

Why: the torch backend runs a fused attention node (rewrite rule fuse_attention) as
``torch.nn.functional.scaled_dot_product_attention``, and torch picks the kernel by a fixed priority (flash
attention, then memory-efficient attention, ...) and by what each supports (an additive mask rules flash
attention out).  cuDNN's attention is another kernel torch ships.  Whether a timed choice between them is worth a
build round depends on how far apart they are on these shapes; this measures it.

Each case is ``--layers`` calls of one backend on fresh Q, K, V (as the layers of a model read different
tensors), captured into one CUDA Graph and replayed (CUDA events, warm-up, median of ``--runs``); every
backend's output is checked against the math kernel in fp32.  A backend that does not support a case is reported
as such.  ``--between gemm`` runs a product of the layer's QKV shape before each call, as a model's layer does:
back to back, one attention kernel follows another, which hides what a kernel costs after another kind.

``CUDNN_FRONTEND`` is cuDNN's attention graph built with cuDNN's frontend (the ``cudnn`` package the cuDNN plans
use) and executed directly: the same fused kernel as torch's ``CUDNN_ATTENTION`` without torch's wrapper.  Why:
in BERT-base's replay (H200, bench/kernel_profile.py --timeline) each of the 12 attention kernels came after a
device memset, and the gaps around it summed to ~59 µs a call (median 3.8 µs memset -> attention, 1.2 µs
product -> memset) where other gaps are ~0.45 µs; torch.compile's replay has the same.

Run on the device after ``source bench/device_env.sh``:
    python3 bench/sdpa_backends.py [--batches 1,8,32] [--between gemm] [--out $OUT]
Prints one JSON line per case and a table; writes sdpa_backends.json under --out.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path

#: (model, heads, sequence, head size, mask): BERT-base at seq 128 with its additive padding mask [B, 1, 1, S],
#: ViT-B/16 (197 tokens, no mask), GPT-2 small at 128 (causal)
CASES = (("bert", 12, 128, 64, "additive"), ("vit_b_16", 12, 197, 64, None), ("gpt2", 12, 128, 64, "causal"))
#: "DEFAULT" is torch's own pick (no ``sdpa_kernel`` context), what a bundle runs today
BACKENDS = ("DEFAULT", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "CUDNN_FRONTEND", "MATH")


def frontend_sdpa(torch, q, k, v, mask, causal):
    """``f(q, k, v)``: cuDNN's fused attention for tensors of ``q``'s shape and strides, through a graph of cuDNN's
    frontend built once (its heuristics' first plan) and executed on torch's current stream; RuntimeError where
    the frontend is missing or cuDNN has no plan for the case."""
    from parastream.launcher.engines import cudnn_plans as cp

    cudnn = cp.frontend()
    if cudnn is None:
        raise RuntimeError("no cuDNN frontend (the cudnn package)")
    handle = cudnn.create_handle()
    g = cudnn.pygraph(io_data_type=cudnn.data_type.HALF, intermediate_data_type=cudnn.data_type.FLOAT,
                      compute_data_type=cudnn.data_type.FLOAT, handle=handle)
    tq, tk, tv = (g.tensor_like(t) for t in (q, k, v))
    tb = g.tensor_like(mask) if mask is not None else None
    scale = q.shape[-1] ** -0.5
    try:  # (newer frontends name the inference switch generate_stats)
        o, _ = g.sdpa(q=tq, k=tk, v=tv, attn_scale=scale, bias=tb, use_causal_mask=causal, generate_stats=False,
                      name="sdpa")
    except TypeError:
        o, _ = g.sdpa(q=tq, k=tk, v=tv, attn_scale=scale, bias=tb, use_causal_mask=causal, is_inference=True,
                      name="sdpa")
    o.set_output(True).set_dim(list(q.shape)).set_stride(list(q.stride()))
    try:
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
    except Exception as e:  # noqa: BLE001 - cuDNN's refusal of the case is this backend's "unsupported"
        raise RuntimeError(f"cuDNN frontend: {e}") from e
    ws = torch.empty(max(int(g.get_workspace_size()), 1), dtype=torch.uint8, device=q.device)

    def f(qi, ki, vi):
        out = torch.empty_like(qi)
        pack = {tq: qi, tk: ki, tv: vi, o: out}
        if tb is not None:
            pack[tb] = mask
        cudnn.set_stream(handle, torch.cuda.current_stream().cuda_stream)
        g.execute(pack, ws, handle=handle)
        return out

    return f


def time_case(torch, backend, q, k, v, mask, causal, layers: int, runs: int, between=None) -> tuple[float, object]:
    """(median ms of one replay of ``layers`` calls in a CUDA Graph, the first call's output).  ``between``:
    (x, weights) of a product run before each call, as the layer's QKV product is."""
    import contextlib

    from depthwise_kernels import _graph_us
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if backend == "CUDNN_FRONTEND":
        f, backend = frontend_sdpa(torch, q[0], k[0], v[0], mask, causal), "DEFAULT"
    else:
        f = functools.partial(torch.nn.functional.scaled_dot_product_attention, attn_mask=mask, is_causal=causal)
    outs: list = []

    def body():  # the captured call's outputs are the graph's: a replay writes them
        outs[:] = []
        for i in range(layers):
            if between is not None:
                outs.append(between[0] @ between[1][i])
            outs.append(f(q[i], k[i], v[i]))

    with contextlib.nullcontext() if backend == "DEFAULT" else sdpa_kernel([getattr(SDPBackend, backend)]):
        us = _graph_us(body, reps=1, replays=runs)
        kernels = _kernels(torch, lambda: f(q[0], k[0], v[0]))
    return us / 1e3, outs[1 if between is not None else 0], kernels


def _kernels(torch, call) -> list[str]:
    """The device activities (kernels, memsets, copies) of one call, in order, as the profiler names them."""
    from torch.profiler import ProfilerActivity, profile

    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    return [e.name[:80] for e in events]


def layer_args(doc: str, name: str, argv=None, extra=None) -> argparse.Namespace:
    """The options of a benchmark of a transformer layer's kernels (this one, bench/gemm_bias.py): the batches,
    the layers captured in one graph, the replays timed, where the results go (``extra(parser)`` adds its own)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    if extra is not None:
        extra(ap)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--runs", type=int, default=300)
    ap.add_argument("--out", default=os.environ.get("OUT", f"/tmp/{name}"))
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = layer_args(__doc__, "sdpa_backends", argv, extra=lambda ap: ap.add_argument(
        "--between", default="none", choices=("none", "gemm"), help="a QKV-shaped product before each call"))
    import torch

    torch.manual_seed(0)
    rows = []
    for model, heads, seq, d, mask_kind in CASES:
        for batch in (int(b) for b in args.batches.split(",")):
            shape = (args.layers, batch, heads, seq, d)
            q, k, v = (torch.randn(shape, device="cuda", dtype=torch.float16) for _ in range(3))
            mask = None
            if mask_kind == "additive":  # the last 16 positions padded, as bench/gpu.py's BERT input
                mask = torch.zeros(batch, 1, 1, seq, device="cuda", dtype=torch.float16)
                mask[..., -16:] = torch.finfo(torch.float16).min
            causal = mask_kind == "causal"
            between = None
            if args.between == "gemm":  # [tokens, hidden] x [hidden, 3 hidden], a weight per layer
                between = (torch.randn(batch * seq, heads * d, device="cuda", dtype=torch.float16),
                           torch.randn(args.layers, heads * d, 3 * heads * d, device="cuda", dtype=torch.float16))
            ref = torch.nn.functional.scaled_dot_product_attention(
                q[0].float(), k[0].float(), v[0].float(), attn_mask=None if mask is None else mask.float(),
                is_causal=causal)
            row = {"model": model, "batch": batch, "heads": heads, "seq": seq, "head_size": d, "mask": mask_kind,
                   "between": args.between, "ms": {}, "max_err": {}, "unsupported": {}}
            for backend in BACKENDS:
                try:
                    ms, out, kernels = time_case(torch, backend, q, k, v, mask, causal, args.layers, args.runs,
                                                 between)
                except RuntimeError as e:
                    row["unsupported"][backend] = str(e).splitlines()[0][:200]
                    continue
                row["ms"][backend] = round(ms, 4)
                row.setdefault("kernels", {})[backend] = kernels
                row["max_err"][backend] = float((out.float() - ref).abs().max())
            kernels = {b: ms for b, ms in row["ms"].items() if b != "DEFAULT"}
            row["fastest"] = min(kernels, key=kernels.get) if kernels else None
            if row["fastest"] and "DEFAULT" in row["ms"]:
                row["default_over_fastest"] = round(row["ms"]["DEFAULT"] / kernels[row["fastest"]], 3)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "kernels"}), flush=True)
            if batch == 1:
                print("  kernels of one call: " + json.dumps(row.get("kernels")), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sdpa_backends.json").write_text(json.dumps(rows, indent=1))
    print("| model | batch | mask | " + " | ".join(b.lower() for b in BACKENDS) + " | fastest | default / fastest |")
    for r in rows:
        cells = [f"{r['ms'][b]:.4f}" if b in r["ms"] else "n/a" for b in BACKENDS]
        print(f"| {r['model']} | {r['batch']} | {r['mask']} | " + " | ".join(cells) + f" | {r['fastest']} | {r.get('default_over_fastest')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
