#!/usr/bin/env python3
"""How much of a measured search candidate a GPU build must compile anew: per candidate of the rewrite search's
top ``--top-k`` (the cost model of ``--device``, as a GPU build ranks them), planned as the build plans it
(``pipeline.build.Engines.plan``), the branches whose code no earlier plan had (the input's and the candidates'
before it, in the order the build measures them: by ``branch_digest``, the engine cache's key for the branch's
graph; the tensor layout, dtype and options are the same for every candidate of one build).  Each such branch is a
compile job before the candidate can be timed, so this is the search's compile cost in jobs, independent of the
machine.  CPU only (no GPU, no compiles):

    python3 bench/candidate_reuse.py [MODEL.onnx ...] [--zoo small_net,nasnet_cell] [--top-k 20] [--json OUT.json]

Prints per model: the input's branches, then per candidate its branches, how many are new (not in any plan
planned before it) and the cumulative new branches against what compiling every candidate's plan whole would be.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def candidates(model_path: Path, device: str, top_k: int):
    """(loaded model, [candidate models in the order the build measures them, the input first])."""
    from parastream.pipeline.model_io import load_model
    from parastream.rewrite import optimize_graph
    from parastream.rewrite.cost import RooflineCostModel
    from parastream.rewrite.rules import rules_for

    loaded = load_model(str(model_path))
    seen: list = []

    def measure(m):  # records what the build would time; every candidate "as fast" as the input
        seen.append(m)
        return 1.0

    optimize_graph(loaded.model, loaded.graph, cost_model=RooflineCostModel(device=device, precision="fp16"),
                   streams=4, rules=rules_for("torch"), top_k=top_k, measure=measure)
    return loaded, seen


def reuse(model_path: Path, device: str, top_k: int) -> dict:
    from parastream.launcher.engines import get_backend
    from parastream.launcher.engines.torch import branch_digest
    from parastream.pipeline.build import BuildConfig, Engines, branches_of, engine_blocks
    from parastream.pipeline.model_io import graph_of
    from parastream.rewrite.cost import RooflineCostModel

    t0 = time.perf_counter()
    loaded, models = candidates(model_path, device, top_k)
    search_s = time.perf_counter() - t0
    backend = get_backend("torch")
    # a one-stream plan cut into repeated blocks, as a default torch build cuts it (``engine_blocks``)
    engines = Engines(backend, RooflineCostModel(device=device, precision="fp16"), loaded, "fp16",
                      blocks=engine_blocks(BuildConfig(), backend))
    known: set[str] = set()
    rows = []
    for i, m in enumerate(models):
        graph = loaded.graph if m is loaded.model else graph_of(m)
        plan = engines.plan(graph, None, 4)
        digests = [branch_digest(b) for b in branches_of(m, graph, plan)]
        new = [d for d in digests if d not in known]
        known.update(digests)
        rows.append({"candidate": i, "input": m is loaded.model, "streams": plan.num_streams,
                     "branches": len(digests), "new": len(set(new))})
    later = rows[1:]
    return {"model": model_path.stem, "search_s": round(search_s, 2), "input_branches": rows[0]["branches"] if rows else 0,
            "candidates": len(later), "new_jobs": sum(r["new"] for r in later),
            "whole_jobs": sum(r["branches"] for r in later), "rows": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="*", type=Path)
    ap.add_argument("--zoo", default="small_net,nasnet_cell", help="example models (pipeline/zoo.py) to add")
    ap.add_argument("--device", default="H100-SXM")
    ap.add_argument("--top-k", type=int, default=20)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    paths = list(args.models)
    if args.zoo:
        import tempfile

        from parastream.pipeline import zoo

        tmp = Path(tempfile.mkdtemp(prefix="candidate-reuse-"))
        import onnx

        for name in [z for z in args.zoo.split(",") if z]:
            paths.append(tmp / f"{name}.onnx")
            onnx.save(getattr(zoo, name)(), paths[-1])
    results = []
    for p in paths:
        r = reuse(Path(p), args.device, args.top_k)
        results.append(r)
        print(f"{r['model']}: input {r['input_branches']} branches; {r['candidates']} candidates: "
              f"{r['new_jobs']} new compile jobs against {r['whole_jobs']} branches planned "
              f"({r['new_jobs'] / max(1, r['whole_jobs']):.0%}); per candidate (branches/new): "
              + " ".join(f"{x['branches']}/{x['new']}" for x in r["rows"][1:]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
