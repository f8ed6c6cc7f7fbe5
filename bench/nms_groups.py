#!/usr/bin/env python3
"""A detector's NonMaxSuppression on the GPU in the tail's two forms (launcher/engines/onnx_eager.py), timed side
by side in one process: ``one call`` (torchvision's ``batched_nms`` over every candidate, as the tail ran it
before) against ``groups`` (``nms_in_groups``: the candidates split where no box can overlap the next, each
group's pairs compared in one padded batch).  Both are exact (ONNX Runtime's selection); each case checks they
select the same boxes.  On the device machine, after ``source bench/device_env.sh``:

    python3 bench/nms_groups.py --out $OUT

Cases (random boxes, fresh inputs each call from ``--inputs`` sets drawn up front; scores uniform):

  offset C x K   C classes of K candidates each, boxes 0-300 px with sides up to 100 px, moved apart per class as
                 torchvision's traced export does (one ONNX class: SSDlite's 90 x 300 is 27,000 candidates)
  classes C x K  the same as C real classes (the ONNX node's class axis)
  one image N    N boxes of one class over a 640 px image (groups chain into one: the groups form declines, the
                 row shows what that costs)

Per case: the candidates, the groups and the largest, the median wall ms of each form (each call synchronised:
both forms wait for the device inside), their ratio.  Writes nms_groups.json under --out.  It sets the tail's
``GROUPED_NMS_FROM`` (the candidates below which the one call is kept).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np


def make_case(kind: str, classes: int, per: int, gen, device: str):
    import torch

    n = classes * per
    xy = torch.rand(n, 2, generator=gen) * (640 if kind == "one image" else 300)
    wh = torch.rand(n, 2, generator=gen) * 100 + 1
    corners = torch.cat([xy, xy + wh], 1)
    cls = torch.arange(classes).repeat_interleave(per)
    if kind == "offset":
        corners = corners + (cls * 401.0)[:, None]
        cls = torch.zeros_like(cls)
    score = torch.rand(n, generator=gen)
    return corners.to(device), score.to(device), cls.to(device)


def forms():
    import torch
    from torchvision.ops import batched_nms

    from parastream.launcher.engines.onnx_eager import nms_in_groups

    def ranked(score):
        order = torch.sort(score, descending=True, stable=True).indices
        ranks = torch.empty(order.numel(), dtype=torch.float32, device=order.device)
        ranks[order] = torch.arange(order.numel(), 0, -1, dtype=torch.float32, device=order.device)
        return order, ranks

    def one_call(c, s, cls, t):
        _, ranks = ranked(s)
        return batched_nms(c, ranks, cls, t)

    def groups(c, s, cls, t):
        order, ranks = ranked(s)
        kept = nms_in_groups(c, order, cls, t)
        return batched_nms(c, ranks, cls, t) if kept is None else order[kept[order]]

    return {"one call": one_call, "groups": groups}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="offset:90x300,classes:90x300,offset:20x100,offset:10x50,offset:4x64,"
                    "classes:80x100,one image:1x3000,one image:1x27000")
    ap.add_argument("--iou", type=float, default=0.5)
    ap.add_argument("--inputs", type=int, default=5)
    ap.add_argument("--calls", type=int, default=60)
    ap.add_argument("--device", default="cuda", help="cuda, or cpu to check the script")
    ap.add_argument("--out", default="/tmp/nms_groups")
    args = ap.parse_args()
    import torch

    import parastream.launcher.engines.onnx_eager as oe

    oe.GROUPED_NMS_FROM = 0  # every case through the form it names
    gen = torch.Generator().manual_seed(0)
    fs, rows = forms(), []
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    for spec in args.cases.split(","):
        kind, shape = spec.split(":")
        classes, per = (int(v) for v in shape.split("x"))
        inputs = [make_case(kind, classes, per, gen, args.device) for _ in range(args.inputs)]
        same = all(torch.equal(fs["one call"](*x, args.iou), fs["groups"](*x, args.iou)) for x in inputs)
        c, s, cls = inputs[0]
        order = torch.sort(s, descending=True, stable=True).indices
        kept = oe.nms_in_groups(c, order, cls, args.iou)
        times = {k: [] for k in fs}
        for i in range(args.calls + 5):  # alternating, the first 5 of each a warm-up
            for name, f in fs.items():
                x = inputs[i % len(inputs)]
                sync()
                t0 = time.perf_counter()
                f(*x, args.iou)
                sync()
                if i >= 5:
                    times[name].append((time.perf_counter() - t0) * 1e3)
        med = {k: float(np.median(v)) for k, v in times.items()}
        row = {"case": spec, "candidates": classes * per, "same_selection": same,
               "groups_form_taken": kept is not None, "ms": med, "one_call_over_groups": med["one call"] / med["groups"]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n| case | candidates | groups form | one call ms | groups ms | ratio | same |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['candidates']} | {r['groups_form_taken']} | {r['ms']['one call']:.3f} | "
              f"{r['ms']['groups']:.3f} | {r['one_call_over_groups']:.2f}x | {r['same_selection']} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "nms_groups.json").write_text(json.dumps({"iou": args.iou, "rows": rows}, indent=1))
    return 0 if all(r["same_selection"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
