#!/usr/bin/env python3
"""A product's bias in cuBLASLt's epilogue (``torch.addmm``) against the product and a separate add, as Inductor
compiles each, on the transformer layers' products of the corpus, in a CUDA Graph.

Why: a torch engine runs a MatMul followed by the Add of its bias (no activation: the rule fuse_gemm_epilogue
makes one node only with a ReLU or GELU) as a product over X's rows and an add that Inductor fuses into what
follows (the residual add and LayerNorm).  ViT-B/16's MLP output product (3072 -> 768) then ran cuBLAS's split-K
kernel with a reduction and a memset, 9.1 µs a layer (H200, fp16, batch 1, bench/kernels.py), where
torch.compile's Linear, ``addmm`` with the bias in the epilogue, ran no split-K.  Whether the bias in the epilogue
is faster as an engine runs it (the residual add and LayerNorm after it) decides whether a GEMM-epilogue node
without activation is worth building and timing in the build's round (it was: rule fuse_gemm_bias).  The two
forms without bias (a Linear whose zero bias the build folds away, as transformers initialise them) ask the same
of a product alone against ``addmm`` with a zero bias.  The fifth form is ``addmm`` compiled with Inductor's GEMM
autotuning (``AUTOTUNED``), which times cuBLAS against Inductor's Triton templates at compile time.

Each case is ``--layers`` products of one form on fresh weights (as the layers of a model read different ones),
each followed by the residual add and LayerNorm an encoder layer has, compiled by Inductor (default mode), captured
into one CUDA Graph and replayed (CUDA events, warm-up, median of ``--runs``); both forms' outputs are compared.

Run on the device after ``source bench/device_env.sh``:
    python3 bench/gemm_bias.py [--batches 1,8,32] [--out $OUT]
Prints one JSON line per case and a table; writes gemm_bias.json under --out.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

#: (model, tokens per item, product): ViT-B/16 (197 tokens) and BERT-base (128), each encoder layer's products
#: without activation (the attention's input and output projections, the MLP's output)
CASES = tuple((model, tokens, name, k, n) for model, tokens in (("vit_b_16", 197), ("bert", 128))
              for name, k, n in (("qkv", 768, 2304), ("attention output", 768, 768), ("mlp output", 3072, 768)))
FORMS = ("product + add", "addmm", "product alone", "addmm, zero bias", "addmm, GEMM autotuned")
#: Inductor's own choice by timing at compile time between cuBLAS and its Triton GEMM templates (with the bias in
#: the template's epilogue), for products only (``max_autotune_gemm``; convolutions keep cuDNN): the form of
#: TensorRT's per-layer tactic timing that Inductor has.  BERT-base's and ViT-B/16's MLP output product runs
#: cuBLAS's split-K kernel, a reduction and a memset (8.7 µs a layer, H200), in torch.compile's engines as in ours
AUTOTUNED = {"max_autotune_gemm": True, "max_autotune_gemm_backends": "ATEN,TRITON"}


def layer_fn(torch, form: str, layers: int):
    """``f(x, r, ws, bs)``: per layer (its own weight and bias, the same input), x·W + b in ``form``, then the
    residual add and LayerNorm of its output width (an encoder layer's epilogue)."""
    F = torch.nn.functional

    def f(x, r, ws, bs):
        outs = []
        for w, b in zip(ws, bs):
            if form == "product + add":
                y = x @ w.t() + b
            elif form in ("addmm", "addmm, GEMM autotuned"):
                y = torch.addmm(b, x, w.t())
            elif form == "product alone":  # a Linear whose zero bias the build folded away
                y = x @ w.t()
            else:  # the same with a zero bias in the epilogue
                y = torch.addmm(torch.zeros_like(b), x, w.t())
            outs.append(F.layer_norm(y + r, (y.shape[-1],)))
        return outs

    return f


def main(argv=None) -> int:
    from sdpa_backends import layer_args

    args = layer_args(__doc__, "gemm_bias", argv)
    import torch
    from depthwise_kernels import _graph_us

    torch.manual_seed(0)
    rows = []
    for model, tokens, name, k, n in CASES:
        for batch in (int(b) for b in args.batches.split(",")):
            m = batch * tokens
            x = torch.randn(m, k, device="cuda", dtype=torch.float16)
            r = torch.randn(m, n, device="cuda", dtype=torch.float16)
            # weights stored [out, in] and multiplied transposed, as the converter stores a MatMul's weight
            ws = [torch.randn(n, k, device="cuda", dtype=torch.float16) * k ** -0.5 for _ in range(args.layers)]
            bs = [torch.randn(n, device="cuda", dtype=torch.float16) for _ in range(args.layers)]
            row = {"model": model, "batch": batch, "product": name, "m": m, "k": k, "n": n, "us": {}}
            outs = {}
            for form in FORMS:
                compiled = torch.compile(layer_fn(torch, form, args.layers),
                                         options=AUTOTUNED if form == "addmm, GEMM autotuned" else None)
                got: list = []

                def body(compiled=compiled, got=got):  # the captured call's outputs are the graph's
                    got[:] = compiled(x, r, ws, bs)

                row["us"][form] = round(_graph_us(body, reps=1, replays=args.runs), 2)
                outs[form] = got[0].float()
            row["addmm_speedup"] = round(row["us"]["product + add"] / row["us"]["addmm"], 3)
            row["zero_bias_addmm_speedup"] = round(row["us"]["product alone"] / row["us"]["addmm, zero bias"], 3)
            row["autotuned_speedup"] = round(row["us"]["addmm"] / row["us"]["addmm, GEMM autotuned"], 3)
            row["max_diff"] = float(max((outs["addmm"] - outs["product + add"]).abs().max(),
                                        (outs["addmm, zero bias"] - outs["product alone"]).abs().max(),
                                        (outs["addmm, GEMM autotuned"] - outs["addmm"]).abs().max()))
            rows.append(row)
            print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gemm_bias.json").write_text(json.dumps(rows, indent=1))
    print("| model | batch | product | m x k x n | product + add µs | addmm µs | addmm speed-up | product alone µs "
          "| addmm, zero bias µs | speed-up | addmm, GEMM autotuned µs | speed-up |")
    for r in rows:
        us = r["us"]
        print(f"| {r['model']} | {r['batch']} | {r['product']} | {r['m']}x{r['k']}x{r['n']} | "
              f"{us['product + add']:.1f} | {us['addmm']:.1f} | {r['addmm_speedup']:.3f}x | {us['product alone']:.1f} | "
              f"{us['addmm, zero bias']:.1f} | {r['zero_bias_addmm_speedup']:.3f}x | "
              f"{us['addmm, GEMM autotuned']:.1f} | {r['autotuned_speedup']:.3f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
