#!/usr/bin/env python3
"""Seconds ``parastream verify --localize`` takes on a NASNet-A Large-sized CPU bundle (some 300 branches).

The model is the example zoo's NASNet-A normal cell stacked as in NASNet-A Large: three stages of CELLS cells
(168, 336 and 672 channels at 42x42, 21x21 and 11x11, a stride-2 MaxPool between stages), random weights.
It is built once for the CPU (``--backend onnxruntime --no-search --streams 4 --no-verify``) into OUT/bundle,
then localized twice, each by one call of ``localize``:

  correct   the bundle as built (the answer must be "no divergence")
  engine    a copy with one engine's weights perturbed (the answer must name that branch and node)

Prints one line per case: branches, status, where, seconds.  The target is under a minute each on a CPU.

    python3 bench/localize.py --out /tmp/nasnet-localize            # NASNet-A Large: 3 stages of 6 cells
    python3 bench/localize.py --out /tmp/nasnet-small --cells 2      # a quick look
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import onnx
from onnx import numpy_helper


def nasnet_large(cells: int, seed: int = 0) -> onnx.ModelProto:
    from parastream.pipeline.zoo import _Builder, _nasnet

    b = _Builder(seed)
    x, cin = "input", 96
    for stage, (c, size) in enumerate([(168, 42), (336, 21), (672, 11)]):
        if stage:
            x = b.op("MaxPool", [x], f"stage{stage}/reduce", kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
        for i in range(cells):
            x, cin = _nasnet(b, x, cin, c, f"stage{stage}/cell_{i}")
    return b.model("nasnet_a_large_cells", [1, 96, 42, 42], x, "NASNet-A Large-sized stack of normal cells")


def perturb_one_engine(bundle: Path, dest: Path) -> tuple[str, str]:
    """A copy of ``bundle`` with the first weight of the middle branch that has one scaled by 1.5 (re-hashed)."""
    from parastream.launcher.bundle import write_manifest

    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(bundle, dest)
    plan = json.loads((dest / "plan.json").read_text())
    branches = plan["branches"]
    for b in branches[len(branches) // 2:] + branches:
        engine = onnx.load(dest / b["engine"])
        users = {i: n for n in engine.graph.node for i in n.input}
        w = next((t for t in engine.graph.initializer if len(t.dims) == 4 and t.name in users), None)
        if w is not None:
            w.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(w) * 1.5, w.name))
            onnx.save(engine, dest / b["engine"])
            write_manifest(dest, json.loads((dest / "manifest.json").read_text()))
            return b["name"], users[w.name].name
    raise SystemExit("no branch has a 4-d weight to perturb")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--cells", type=int, default=6, help="normal cells per stage (NASNet-A Large: 6)")
    p.add_argument("--iterations", type=int, default=3, help="the seeded inputs verification draws")
    args = p.parse_args()

    from parastream.pipeline.cli import main as cli
    from parastream.pipeline.localize import localize

    args.out.mkdir(parents=True, exist_ok=True)
    model, bundle = args.out / "model.onnx", args.out / "bundle"
    if not (bundle / "manifest.json").is_file():
        onnx.save(nasnet_large(args.cells), model)
        t0 = time.perf_counter()
        code = cli(["build", str(model), "-o", str(bundle), "--backend", "onnxruntime", "--no-search", "--streams", "4",
                    "--no-verify", "--force", "--quiet"])
        print(f"built {bundle} in {time.perf_counter() - t0:.0f} s (exit {code})")
    branch, node = perturb_one_engine(bundle, args.out / "perturbed")
    branches = len(json.loads((bundle / "plan.json").read_text())["branches"])
    for case, path, expect in (("correct", bundle, "no divergence"), ("engine", args.out / "perturbed", f"{branch} {node}")):
        t0 = time.perf_counter()
        found = localize(path, model, iterations=args.iterations, device="cpu")
        seconds = time.perf_counter() - t0
        where = f"{found.engine.get('branch')} {found.engine.get('node')}" if found.engine else "-"
        print(f"{case:8s} {branches} branches  expected {expect!r}: {found.status}, {where}  {seconds:.1f} s")


if __name__ == "__main__":
    main()
