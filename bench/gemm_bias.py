#!/usr/bin/env python3
"""A product's bias in cuBLASLt's epilogue (``torch.addmm``) against the product and a separate add, as Inductor
compiles each, on the transformer layers' products of the corpus, in a CUDA Graph.

Why: a torch engine runs a MatMul followed by the Add of its bias (no activation: the rule fuse_gemm_epilogue
makes one node only with a ReLU or GELU) as a product over X's rows and an add that Inductor fuses into what
follows (the residual add and LayerNorm).  ViT-B/16's MLP output product (3072 -> 768) then ran cuBLAS's split-K
kernel with a reduction and a memset, 9.1 µs a layer (H200, fp16, batch 1, bench/kernel_profile.py), where
torch.compile's Linear, ``addmm`` with the bias in the epilogue, ran no split-K.  Whether the bias in the epilogue
is faster as an engine runs it (the residual add and LayerNorm after it) decides whether a GEMM-epilogue node
without activation is worth building and timing in the build's round (it was: rule fuse_gemm_bias).  The two
forms without bias (a Linear whose zero bias the build folds away, as transformers initialise them) ask the same
of a product alone against ``addmm`` with a zero bias.  The fifth form is ``addmm`` compiled with Inductor's GEMM
autotuning (``AUTOTUNED``), which times cuBLAS against Inductor's Triton templates at compile time.  The
"split-K S" forms ask whether cuBLAS's split-K kernel, its reduction and its memset (BERT-base's MLP output product:
5.5 + 2.4 + 0.8 µs a layer, H200, in torch.compile's engines as in ours) are worth doing by hand: the product as a
batched product over S parts of K ([S, m, n] partial products, each part a whole GEMM, so no split-K), their sum
left to Inductor, which fuses it with the bias, the residual add and the LayerNorm into the one kernel it runs
anyway (``split_k_speedup``: ``addmm`` over each).  It would be a converter form for a product whose rows are few
and whose K is long, timed in the build's GEMM-epilogue round; nothing is built on it until this has run.

Each case is ``--layers`` products of one form on fresh weights (as the layers of a model read different ones),
each followed by the residual add and LayerNorm an encoder layer has, compiled by Inductor (default mode), captured
into one CUDA Graph and replayed (CUDA events, warm-up, median of ``--runs``); both forms' outputs are compared.

Run on the device after ``source bench/device_env.sh``:
    python3 bench/gemm_bias.py [--batches 1,8,32] [--forms addmm "split-K 2" "split-K 4"] [--products "mlp output"] [--out $OUT]
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
FORMS = ("product + add", "addmm", "product alone", "addmm, zero bias", "addmm, GEMM autotuned", "split-K 2", "split-K 4")
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
            elif form.startswith("split-K"):  # S whole products over K's parts, their sum in the epilogue
                s = int(form.split()[1])
                m, k = x.shape
                parts = torch.bmm(x.view(m, s, k // s).transpose(0, 1), w.t().reshape(s, k // s, -1))  # views
                y = parts.sum(0) + b
            else:  # the same with a zero bias in the epilogue
                y = torch.addmm(torch.zeros_like(b), x, w.t())
            outs.append(F.layer_norm(y + r, (y.shape[-1],)))
        return outs

    return f


def main(argv=None) -> int:
    from sdpa_backends import layer_args

    def extra(ap):
        ap.add_argument("--forms", nargs="+", default=list(FORMS), help="the forms timed (addmm always: the ratios' base)")
        ap.add_argument("--products", nargs="+", default=list(dict.fromkeys(c[2] for c in CASES)), help="the products timed")

    args = layer_args(__doc__, "gemm_bias", argv, extra)
    forms = [f for f in FORMS if f in args.forms or f == "addmm"]
    unknown = set(args.forms) - set(FORMS)
    if unknown:
        raise SystemExit(f"gemm_bias.py: --forms {','.join(sorted(unknown))}: not a form ({', '.join(FORMS)})")
    import torch
    from depthwise_kernels import _graph_us

    torch.manual_seed(0)
    rows = []
    for model, tokens, name, k, n in CASES:
        if name not in args.products:
            continue
        for batch in (int(b) for b in args.batches.split(",")):
            m = batch * tokens
            x = torch.randn(m, k, device="cuda", dtype=torch.float16)
            r = torch.randn(m, n, device="cuda", dtype=torch.float16)
            # weights stored [out, in] and multiplied transposed, as the converter stores a MatMul's weight
            ws = [torch.randn(n, k, device="cuda", dtype=torch.float16) * k ** -0.5 for _ in range(args.layers)]
            bs = [torch.randn(n, device="cuda", dtype=torch.float16) for _ in range(args.layers)]
            row = {"model": model, "batch": batch, "product": name, "m": m, "k": k, "n": n, "us": {}}
            outs = {}
            for form in forms:
                compiled = torch.compile(layer_fn(torch, form, args.layers),
                                         options=AUTOTUNED if form == "addmm, GEMM autotuned" else None)
                got: list = []

                def body(compiled=compiled, got=got):  # the captured call's outputs are the graph's
                    got[:] = compiled(x, r, ws, bs)

                row["us"][form] = round(_graph_us(body, reps=1, replays=args.runs), 2)
                outs[form] = got[0].float()
            us = row["us"]
            if "product + add" in us:
                row["addmm_speedup"] = round(us["product + add"] / us["addmm"], 3)
            if "product alone" in us and "addmm, zero bias" in us:
                row["zero_bias_addmm_speedup"] = round(us["product alone"] / us["addmm, zero bias"], 3)
            if "addmm, GEMM autotuned" in us:
                row["autotuned_speedup"] = round(us["addmm"] / us["addmm, GEMM autotuned"], 3)
            row["split_k_speedup"] = {f: round(us["addmm"] / us[f], 3) for f in us if f.startswith("split-K")}
            pairs = [("addmm", f) for f in outs if f not in ("addmm", "product alone", "addmm, zero bias")]
            if "product alone" in outs and "addmm, zero bias" in outs:
                pairs.append(("addmm, zero bias", "product alone"))
            row["max_diff"] = float(max(((outs[a] - outs[b]).abs().max() for a, b in pairs), default=0.0))
            rows.append(row)
            print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gemm_bias.json").write_text(json.dumps(rows, indent=1))
    print("| model | batch | product | m x k x n | " + " | ".join(f"{f} µs" for f in forms) + " | each's speed-up over addmm (addmm µs over its µs) |")
    for r in rows:
        us = r["us"]
        print(f"| {r['model']} | {r['batch']} | {r['product']} | {r['m']}x{r['k']}x{r['n']} | "
              + " | ".join(f"{us[f]:.1f}" for f in forms) + " | "
              + ", ".join(f"{f} {us['addmm'] / us[f]:.3f}x" for f in forms if f != "addmm") + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
