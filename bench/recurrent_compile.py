#!/usr/bin/env python3
"""What a recurrent layer costs a build: the torch converter's two forms of an ONNX LSTM (or GRU), compiled by
Inductor and timed, side by side in one process.

  torch layer   one ``torch.ops.parastream.rnn`` call (torch's own layer: cuDNN's kernel on the GPU), which
                Inductor leaves an extern call (what the converter builds wherever torch's layer computes what
                ONNX's node does)
  written out   the layer's equations one time step after another (the converter's form for what torch's layer
                cannot say: peepholes, clip, other activations), forced here by a clip no value reaches (1e30:
                the same values)

Per sequence length of ``--seqs``: ``torch.compile`` (Inductor, ``fullgraph``) seconds to the first result, then
both compiled modules' median milliseconds per call over ``--runs`` calls each, timed side by side in alternating
blocks after warm-up (``pipeline.bench.time_calls``; on the GPU each call waited for), and the two forms' largest
difference.  Each form and length compiles in a fresh Inductor cache.

    python3 bench/recurrent_compile.py [--device cuda] [--op LSTM] [--seqs 16,64] [--hidden 192] [--out DIR]
    python3 bench/recurrent_compile.py --onnx sequencer2d_s.onnx [--device cuda] [--runs 10]   (a whole model)

Writes recurrent_compile.json under --out.  Sequencer2D-S (timm) holds 36 bidirectional LSTMs of 16 and 32 steps
(hidden 48-96): ~1400 written-out steps, whose ``torch.compile`` took 294 s on the 2-core CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "engines"))
sys.path.insert(0, str(HERE.parent / "tests"))


def layer(op: str, seq: int, hidden: int, batch: int):
    """({form: ONNX model}, feeds): one bidirectional ``op`` node with its states as inputs (tests' ``recurrent``,
    random weights), as it is ("torch layer") and with a clip no value reaches ("written out"): the same weights
    and inputs for both."""
    import onnx
    from onnx import helper
    from test_onnx_torch_ops import recurrent

    kw = {"linear_before_reset": 1} if op == "GRU" else {}
    m, feeds = recurrent(op, seq=seq, batch=batch, inp=hidden, hidden=hidden, direction="bidirectional",
                         states=True, **kw)
    clipped = onnx.ModelProto()
    clipped.CopyFrom(m)
    clipped.graph.node[0].attribute.append(helper.make_attribute("clip", 1e30))
    return {"torch layer": m, "written out": clipped}, feeds


def model_forms(path: str) -> tuple[dict, dict]:
    """({form: ONNX model}, feeds) of a whole exported model (``--onnx``), loaded as a build loads it
    (``load_model``): as it is, and with every LSTM, GRU and RNN node given a clip no value reaches ("written
    out"); the inputs parastream's own generator draws (``random_feeds``).  ValueError where it has no such node."""
    import onnx
    from onnx import helper
    from parastream.core.tensors import random_feeds
    from parastream.pipeline.model_io import load_model

    loaded = load_model(path)
    clipped = onnx.ModelProto()
    clipped.CopyFrom(loaded.model)
    nodes = [n for n in clipped.graph.node if n.op_type in ("LSTM", "GRU", "RNN")]
    if not nodes:
        raise ValueError(f"--onnx {path}: no LSTM, GRU or RNN node")
    for n in nodes:
        n.attribute.append(helper.make_attribute("clip", 1e30))
    return {"torch layer": loaded.model, "written out": clipped}, random_feeds(loaded.inputs)


def called(compiled, xs: list, device: str):
    """A runner for ``time_calls``: one call of ``compiled`` on ``xs``, waited for on the GPU."""
    import torch

    def run(_feeds):
        compiled(*xs)
        if device == "cuda":
            torch.cuda.synchronize()

    return run


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--op", default="LSTM", choices=("LSTM", "GRU"))
    ap.add_argument("--seqs", default="16,32")
    ap.add_argument("--hidden", type=int, default=96)
    ap.add_argument("--batch", type=int, default=14)
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--onnx", default=None, help="a whole exported model instead of one layer (its every recurrent node)")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/recurrent_compile"))
    args = ap.parse_args(argv)
    import torch
    from parastream.core.errors import ParastreamError
    from parastream.launcher.engines.onnx_torch import convert
    from parastream.pipeline.bench import time_calls

    # the process's first compile pays for importing and setting up dynamo and Inductor: paid here, untimed, so that
    # neither form's seconds hold it
    with torch.no_grad():
        torch.compile(lambda x: (x * 2).sum(), fullgraph=True)(torch.ones(4, device=args.device))
    rows = []
    for seq in ([None] if args.onnx else [int(s) for s in args.seqs.split(",")]):
        if args.onnx:
            row: dict = {"model": args.onnx, "device": args.device}
            try:
                models, feeds = model_forms(args.onnx)
            except (ValueError, ParastreamError) as e:
                ap.error(str(e))
        else:
            row = {"op": args.op, "seq": seq, "hidden": args.hidden, "batch": args.batch, "device": args.device}
            models, feeds = layer(args.op, seq, args.hidden, args.batch)
        outs, calls = {}, {}
        for form, m in models.items():
            module = convert(m).to(args.device)
            xs = [torch.from_numpy(feeds[n]).to(args.device) for n in module.input_names]
            with tempfile.TemporaryDirectory(prefix="recurrent-compile-") as d, torch.no_grad():
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = d
                t = time.perf_counter()
                compiled = torch.compile(module, fullgraph=True)
                got = compiled(*xs)
                outs[form] = [o.float().cpu().numpy() for o in (got if isinstance(got, (tuple, list)) else [got])]
                row[f"{form} compile s"] = round(time.perf_counter() - t, 2)
            calls[form] = called(compiled, xs, args.device)
        # both forms side by side in alternating blocks (pipeline.bench's timer), each call waited for on the GPU
        with torch.no_grad():
            times = time_calls(calls, {}, runs=args.runs, warmup=5)
        for form, t in times.items():
            row[f"{form} ms per call"] = round(float(np.median(t)) * 1e3, 4)
        row["max diff"] = max(float(np.max(np.abs(a - b))) for a, b in zip(outs["torch layer"], outs["written out"]))
        row["compile speed-up"] = round(row["written out compile s"] / row["torch layer compile s"], 2)
        print(json.dumps(row), flush=True)
        rows.append(row)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "recurrent_compile.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
