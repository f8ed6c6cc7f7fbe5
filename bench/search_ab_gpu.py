#!/usr/bin/env python3
"""Whether a change to the rewrite search ships something slower on the GPU: two checkouts' searched models for
the same inputs, built alike and timed side by side on the device.

For each model (a zoo name or an ONNX path) each checkout runs the search as a GPU build's cost model does (roofline
of ``--device``, ``--precision``, ``--streams``; no measurement), in a child process importing that checkout, and
writes the searched model.  Where the two chose the same rules in the same graph (sha256 of the searched model)
nothing is timed.  Otherwise, on a GPU, both searched models are built by THIS checkout's torch backend (fp16, no
search, no timed alternatives: the rewrite is the only difference) and their launchers timed in alternating blocks
of CUDA-event timed replays (``pipeline.bench.measure``), median per model; a ratio B/A > 1 means B's choice is
slower.  Without a GPU it stops after the comparison of choices.

Run:  python3 bench/search_ab_gpu.py --a before=/tmp/ab/before --b now=. --models small_net,nasnet_cell --out $OUT
(a checkout to compare with: ``mkdir -p DIR/parastream && git archive COMMIT pipeline rewrite launcher core |
tar -x -C DIR/parastream``; on the device carry it in an ignored folder).  Prints one JSON line per model and
writes OUT/search_ab_gpu.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path


def search_child(model: str, out: str, device: str, precision: str, streams: int) -> dict:
    """The search of ``model`` with the checkout this process imports; the searched model saved to ``out``."""
    import onnx

    from parastream.rewrite import RooflineCostModel, optimize

    if Path(model).is_file():
        m = onnx.load(model)
    else:
        from parastream.pipeline import zoo

        m = zoo.MODELS[model]()
    searched, report = optimize(m, cost_model=RooflineCostModel(device, precision=precision), streams=streams, seed=0)
    onnx.save(searched, out)
    return {"rules": report["rules_chosen_count"], "nodes": [report["nodes_before"], report["nodes_after"]],
            "estimated_us": round(report["cost_after"]["mixed_s"] * 1e6, 3),
            "sha256": hashlib.sha256(Path(out).read_bytes()).hexdigest()}


def _search(tree: str, model: str, out: Path, args) -> dict:
    env = dict(os.environ)
    if tree != ".":  # "." is this checkout as installed; another is a folder holding parastream/ (as build_ab.py takes)
        env["PYTHONPATH"] = os.pathsep.join([str(Path(tree).resolve())]
                                            + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    p = subprocess.run([sys.executable, __file__, "--child", model, str(out), args.device, args.precision, str(args.streams)],
                       capture_output=True, text=True, env=env, cwd="/")
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
    return json.loads(line[7:]) if line else {"error": (p.stderr or p.stdout)[-1500:]}


def time_pair(paths: dict[str, Path], work: Path, runs: int) -> dict:
    """Both searched models built alike (torch, fp16, no search, no timed alternatives) and timed side by side."""
    import numpy as np

    from parastream.launcher.bundle import Bundle
    from parastream.launcher.gpu import GpuLauncher
    from parastream.pipeline import build
    from parastream.pipeline.bench import measure

    launchers = {}
    try:
        for name, path in paths.items():
            bundle = build(path, work / f"{name}_bundle", backend="torch", precision="fp16", search=False,
                           measure=False, force=True)
            launchers[name] = GpuLauncher(Bundle.open(bundle.path))
        times = measure(launchers, runs=runs, warmup=20)
        med = {k: float(np.median(v)) for k, v in times.items()}
        a, b = list(med)
        return {"median_ms": med, "b_over_a": med[b] / med[a],
                "streams": {k: la.plan.num_streams for k, la in launchers.items()}}
    finally:
        for la in launchers.values():
            la.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", required=False, help="NAME=DIR of the checkout to compare against (a folder holding parastream/)")
    ap.add_argument("--b", required=False, help="NAME=DIR of the checkout under test (. : this one, as installed)")
    ap.add_argument("--models", default="small_net,nasnet_cell,inception_block,transformer_layer,resnet_bottleneck")
    ap.add_argument("--device", default="H100-SXM", help="the cost model's device profile (a GPU build's default)")
    ap.add_argument("--precision", default="fp16")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--runs", type=int, default=300)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/search_ab_gpu"))
    ap.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        model, out, device, precision, streams = args.child
        print("RESULT " + json.dumps(search_child(model, out, device, precision, int(streams))), flush=True)
        return 0
    if not (args.a and args.b):
        ap.error("--a and --b are required")
    trees = dict(t.split("=", 1) for t in (args.a, args.b))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        from parastream.launcher import cuda_device_count

        gpu = cuda_device_count() > 0
    except Exception:  # noqa: BLE001 - no CUDA bindings: the comparison of choices only
        gpu = False
    rows = []
    for model in args.models.split(","):
        stem = Path(model).stem
        row: dict = {"model": stem, "searched": {}}
        paths = {}
        for name, tree in trees.items():
            paths[name] = out / f"{stem}_{name}.onnx"
            row["searched"][name] = _search(tree, model, paths[name], args)
        got = list(row["searched"].values())
        if any("error" in g for g in got):
            row["status"] = "search failed"
        elif got[0]["sha256"] == got[1]["sha256"]:
            row["status"] = "same searched model: nothing to time"
        elif not gpu:
            row["status"] = "different choices; no GPU here to time them"
        else:
            try:
                row.update(time_pair(paths, out, args.runs))
                row["status"] = "timed"
            except Exception as e:  # noqa: BLE001 - the row says what failed; the next models go on
                row["status"] = f"timing failed: {type(e).__name__}: {e}"[:500]
        rows.append(row)
        print(json.dumps(row), flush=True)
        (out / "search_ab_gpu.json").write_text(json.dumps({"trees": trees, "device_profile": args.device,
                                                            "precision": args.precision, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
