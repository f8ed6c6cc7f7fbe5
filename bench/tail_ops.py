#!/usr/bin/env python3
"""A bundle's data-dependent tail (pipeline/host_tail.py) on its own: onnxruntime's session on the host against
the torch ops the GPU tail runs (launcher/engines/onnx_eager.py), on the same boundary tensors, the ones the
bundle's static part computed for a seeded input.  From the repository root:

    python3 bench/tail_ops.py BUNDLE [BUNDLE ...] [--device cuda] [--calls 50]

Per bundle: whether the two give the same outputs (shapes, dtypes, max abs difference), each one's median ms
per call (alternating blocks, after warm-up; on a GPU each call ends synchronised, its outputs on the host), and
the torch tail's host ms per ONNX op type (each node timed around its call, no synchronisation: what the host
spends issuing it).  The static part runs once, by the bundle's own launcher where it loads (``load``'s device
"auto"), for the boundary tensors.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

import numpy as np


def host_ms_per_op_type(graph, call, calls: int) -> dict[str, float]:
    """The host's ms per call spent in each ONNX op type of ``graph`` (an ``onnx_eager.EagerGraph``) while
    ``call()`` runs it ``calls`` times, the most first: each node timed around its closure, with no
    synchronisation (what the host spends issuing it; a GPU's wait shows up at the next op that reads a count)."""
    per_type: collections.Counter = collections.Counter()
    steps = graph.steps

    def timed(fn, op):
        def step(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                per_type[op] += time.perf_counter() - t0
        step.reads_scope = getattr(fn, "reads_scope", False)
        return step

    graph.steps = [(timed(fn, op), ins, outs, scoped) for (fn, ins, outs, scoped), op in zip(steps, graph.ops)]
    try:
        for _ in range(calls):
            call()
    finally:
        graph.steps = steps
    return {k: round(v * 1e3 / calls, 3) for k, v in per_type.most_common()}


def boundary_values(bundle: Path, seed: int) -> dict:
    """The tensors the tail reads, for a seeded input: the bundle's static part run by its launcher (numpy in,
    numpy out)."""
    from parastream.core.tensors import random_feeds
    from parastream.launcher import load

    runner = load(bundle, host_tail=False)
    rec = json.loads((bundle / "manifest.json").read_text()).get("host_tail")
    if rec is None:
        raise SystemExit(f"{bundle}: the bundle has no data-dependent tail (manifest.json host_tail)")
    feeds = random_feeds(runner.plan.inputs, seed=seed)
    got = runner(feeds)
    return {n: np.ascontiguousarray(got[n] if n in got else feeds[n]) for n in [*rec["boundary"], *rec["feeds"]]}


def run_one(bundle: Path, device: str, calls: int, seed: int) -> dict:
    import onnx
    import onnxruntime as ort
    import torch

    from parastream.launcher.engines import onnx_eager

    values = boundary_values(bundle, seed)
    model = onnx.load(str(bundle / "tail.onnx"))
    outputs = [o.name for o in model.graph.output]
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    graph = onnx_eager.load(model, device=None if device == "cpu" else device)
    on_device = {k: torch.from_numpy(v).to(device) for k, v in values.items()}
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def eager():
        outs = graph.run(on_device)
        return [o.cpu().numpy() for o in outs]

    def host():
        return sess.run(outputs, values)

    row: dict = {"bundle": str(bundle), "device": device, "nodes": len(model.graph.node)}
    want, got = host(), eager()
    row["same"] = {name: {"shapes": [list(a.shape), list(b.shape)], "dtypes": [str(a.dtype), str(b.dtype)],
                          "max_abs": (float(np.abs(a.astype(np.float64) - b).max()) if a.shape == b.shape and a.size
                                      else 0.0 if a.shape == b.shape else None)}
                   for name, a, b in zip(outputs, want, got)}
    for f in (host, eager):
        for _ in range(3):
            f()
    times: dict[str, list[float]] = {"onnxruntime": [], "torch ops": []}
    for block in range(10):
        order = [("onnxruntime", host), ("torch ops", eager)]
        for name, f in (order if block % 2 == 0 else order[::-1]):
            for _ in range(max(1, calls // 10)):
                sync()
                t0 = time.perf_counter()
                f()
                sync()
                times[name].append(time.perf_counter() - t0)
    row["median_ms"] = {k: round(float(np.median(v)) * 1e3, 3) for k, v in times.items()}
    row["torch_ops_host_ms_per_type"] = dict(list(host_ms_per_op_type(graph, eager, 5).items())[:12])
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundles", nargs="+")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N]: where the torch ops run")
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    for b in args.bundles:
        row = run_one(Path(b), args.device, args.calls, args.seed)
        print(json.dumps(row), flush=True)
        same = all(s["shapes"][0] == s["shapes"][1] and s["max_abs"] is not None for s in row["same"].values())
        print(f"{Path(b).name}: {row['nodes']} nodes, the same outputs: {same}; onnxruntime "
              f"{row['median_ms']['onnxruntime']} ms, torch ops on {args.device} {row['median_ms']['torch ops']} ms",
              file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
