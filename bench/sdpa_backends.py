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
as such.

Run on the device after ``source bench/device_env.sh``:
    python3 bench/sdpa_backends.py [--batches 1,8,32] [--out $OUT]
Prints one JSON line per case and a table; writes sdpa_backends.json under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

#: (model, heads, sequence, head size, mask): BERT-base at seq 128 with its additive padding mask [B, 1, 1, S],
#: ViT-B/16 (197 tokens, no mask), GPT-2 small at 128 (causal)
CASES = (("bert", 12, 128, 64, "additive"), ("vit_b_16", 12, 197, 64, None), ("gpt2", 12, 128, 64, "causal"))
#: "DEFAULT" is torch's own pick (no ``sdpa_kernel`` context), what a bundle runs today
BACKENDS = ("DEFAULT", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH")


def time_case(torch, backend, q, k, v, mask, causal, layers: int, runs: int) -> tuple[float, object]:
    """(median ms of one replay of ``layers`` calls in a CUDA Graph, the first call's output)."""
    import contextlib

    from depthwise_kernels import _graph_us
    from torch.nn.attention import SDPBackend, sdpa_kernel

    f = torch.nn.functional.scaled_dot_product_attention
    outs: list = []

    def body():  # the captured call's outputs are the graph's: a replay writes them
        outs[:] = [f(q[i], k[i], v[i], attn_mask=mask, is_causal=causal) for i in range(layers)]

    with contextlib.nullcontext() if backend == "DEFAULT" else sdpa_kernel([getattr(SDPBackend, backend)]):
        us = _graph_us(body, reps=1, replays=runs)
    return us / 1e3, outs[0]


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
    args = layer_args(__doc__, "sdpa_backends", argv)
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
            ref = torch.nn.functional.scaled_dot_product_attention(
                q[0].float(), k[0].float(), v[0].float(), attn_mask=None if mask is None else mask.float(),
                is_causal=causal)
            row = {"model": model, "batch": batch, "heads": heads, "seq": seq, "head_size": d, "mask": mask_kind,
                   "ms": {}, "max_err": {}, "unsupported": {}}
            for backend in BACKENDS:
                try:
                    ms, out = time_case(torch, backend, q, k, v, mask, causal, args.layers, args.runs)
                except RuntimeError as e:
                    row["unsupported"][backend] = str(e).splitlines()[0][:200]
                    continue
                row["ms"][backend] = round(ms, 4)
                row["max_err"][backend] = float((out.float() - ref).abs().max())
            kernels = {b: ms for b, ms in row["ms"].items() if b != "DEFAULT"}
            row["fastest"] = min(kernels, key=kernels.get) if kernels else None
            if row["fastest"] and "DEFAULT" in row["ms"]:
                row["default_over_fastest"] = round(row["ms"]["DEFAULT"] / kernels[row["fastest"]], 3)
            rows.append(row)
            print(json.dumps(row), flush=True)
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
