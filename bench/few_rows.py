#!/usr/bin/env python3
"""A product of few rows by a large weight (a classifier head, BERT's pooler) as cuBLAS runs it against the
same product split along its inner dimension (a batched product and a sum) and as one Inductor reduction.

Why: at batch 1 a classifier head is a matrix-vector product, [1, 2048] x [2048, 1000] for ResNet-50: 4 MB of
weights, under a microsecond of the H200's bandwidth, yet cuBLAS's ``addmm`` ran it in 12.8 µs (H200, fp16,
bench/kernel_profile.py on ResNet-50's searched bundle, torch.compile's the same): its kernel tiles the 1000 outputs
into 16 blocks of 64 and walks the 2048 inner terms in each, so 16 of the chip's 132 multiprocessors read the
weight.  Split into S slices of the inner dimension, the product runs S x 16 blocks and a sum adds the S partial
rows (Inductor fuses it with the bias and what follows); as one Inductor reduction, a block per output row.
Whether either is faster, and up to which batch, decides whether the torch converter should run such products
that way (and the build time it against cuBLAS's form).

Each case is ``--layers`` products of one shape on fresh weights (so that the weights come from memory, not from
the L2 cache, as a head's do after the network before it), compiled by Inductor (default mode), captured into
one CUDA Graph and replayed (CUDA events, warm-up, median of ``--runs``); every form's outputs are compared
with ``addmm``'s.

Run on the device after ``source bench/device_env.sh``:
    python3 bench/few_rows.py [--batches 1,8,32] [--out $OUT]
Prints one JSON line per case and a table; writes few_rows.json under --out.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

#: (model, product, inner, outputs): classifier heads of the GPU corpus's models and BERT-base's pooler, one per
#: distinct shape (Inception-v3's and Res2Net's heads are ResNet-50's, ConvNeXt-T's is ViT-B/16's)
CASES = (("resnet50", "head", 2048, 1000), ("vit_b_16", "head", 768, 1000), ("bert", "pooler", 768, 768),
         ("nasnetalarge", "head", 4032, 1000), ("efficientnet_b0", "head", 1280, 1000),
         ("densenet121", "head", 1024, 1000), ("regnet_y_400mf", "head", 440, 1000))
SPLITS = (4, 8, 16)
FORMS = ("addmm", *(f"split {s}" for s in SPLITS), "reduction")


def head_fn(torch, form: str):
    """``f(x, ws, bs)``: per weight (stored [out, in], as the converter stores a Linear's), x·Wᵀ + b in
    ``form``."""

    def f(x, ws, bs):
        outs = []
        m, k = x.shape
        for w, b in zip(ws, bs):
            if form == "addmm":
                y = torch.addmm(b, x, w.t())
            elif form == "reduction":
                y = (x[:, None, :] * w[None, :, :]).sum(-1, dtype=torch.float32).to(x.dtype) + b
            else:
                s = int(form.split()[1])
                parts = torch.bmm(x.view(m, s, k // s).transpose(0, 1), w.t().view(s, k // s, w.shape[0]))
                y = parts.sum(0, dtype=torch.float32).to(x.dtype) + b
            outs.append(y)
        return outs

    return f


def main(argv=None) -> int:
    from sdpa_backends import layer_args

    args = layer_args(__doc__, "few_rows", argv)
    import torch
    from depthwise_kernels import _graph_us

    torch.manual_seed(0)
    rows = []
    for model, name, k, n in CASES:
        for batch in (int(b) for b in args.batches.split(",")):
            x = torch.randn(batch, k, device="cuda", dtype=torch.float16)
            ws = [torch.randn(n, k, device="cuda", dtype=torch.float16) * k ** -0.5 for _ in range(args.layers)]
            bs = [torch.randn(n, device="cuda", dtype=torch.float16) for _ in range(args.layers)]
            row = {"model": model, "batch": batch, "product": name, "k": k, "n": n, "us": {}, "max_diff": {}}
            outs = {}
            # a split along K needs K to divide into its parts (RegNetY-400MF's 440 does not into 16)
            forms = [f for f in FORMS if not f.startswith("split") or k % int(f.split()[1]) == 0]
            for form in forms:
                compiled = torch.compile(head_fn(torch, form))
                got: list = []

                def body(compiled=compiled, got=got):  # the captured call's outputs are the graph's
                    got[:] = compiled(x, ws, bs)

                row["us"][form] = round(_graph_us(body, reps=1, replays=args.runs) / args.layers, 2)
                outs[form] = torch.stack(got).float()
            for form in forms[1:]:
                row["max_diff"][form] = float((outs[form] - outs["addmm"]).abs().max())
            best = min(forms, key=row["us"].get)
            row["fastest"], row["speedup"] = best, round(row["us"]["addmm"] / row["us"][best], 3)
            rows.append(row)
            print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "few_rows.json").write_text(json.dumps(rows, indent=1))
    print("| model | product | batch | k x n | " + " | ".join(f"{f} µs" for f in FORMS) + " | fastest |")
    for r in rows:
        print(f"| {r['model']} | {r['product']} | {r['batch']} | {r['k']}x{r['n']} | "
              + " | ".join(f"{r['us'][f]:.2f}" if f in r["us"] else "-" for f in FORMS) + f" | {r['fastest']} ({r['speedup']:.2f}x) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
