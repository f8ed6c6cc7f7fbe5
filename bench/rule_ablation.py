#!/usr/bin/env python3
"""Which rewrite rule gains or costs what on the GPU, for one model at one batch: the searched model built with
every rule the search chose, then once without each of them, and the input, all timed side by side.

A GPU build measures the search's candidates as wholes: when the best candidate is slower than the input (ViT-B/16
at batch 8 and 32, BERT-base at batch 32 on the H100), the input ships and so does none of the fusions the
candidate held, though one rule among them may be the one that costs.  This finds it.

For the model (bench/gpu.py's models, exported at ``--batch``) it builds, with the torch backend (fp16, the rewrite
chosen by the cost model: ``measure=False``, so the fusions run as a default build's, without the GPU-timed
rounds):
  input          no rewrite
  searched       every rule the backend's search takes (the candidate a measured build would time first)
  without R      the same search without rule R, for each rule R the searched model applied
and, with ``--only``, ``only R``: the search with R alone.  Every bundle passes its own verification.  Their
launchers (one process, one GPU) are timed in alternating blocks (``pipeline.bench.measure``: CUDA events, warm-up,
fresh random inputs, medians); with ``--against-compile`` torch.compile(mode="reduce-overhead") of the PyTorch
model at the same batch too.  A "without R" faster than "searched" names a rule that costs at this batch, unless
the two differ in their stream plans (the cost model's, as no round is timed: the streams column): ViT-B/16 at
batch 8 (H100) ran 2.40 ms searched, on 2 streams, and 1.11 ms without a reshape merge, on one, which is what
led the measured search to time its best candidate as one engine too (``GpuMeasurer._as_one_engine``).

Run on the device after ``source bench/device_env.sh``:
    python3 bench/rule_ablation.py --model vit_b_16 --batch 8 [--only] [--against-compile] --out $OUT
Prints one line per build and the table; writes OUT/rule_ablation_<model>_b<batch>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu import export, make_model  # noqa: E402


def _build(onnx_path: Path, out: Path, *, rules: list | None) -> tuple:
    from parastream.pipeline import build

    t0 = time.perf_counter()
    kw = {} if rules is None else {"search_options": {"rules": [r.name for r in rules]}}
    bundle = build(onnx_path, out, backend="torch", precision="fp16", search=rules is not None, measure=False,
                   force=True, **kw)
    rep = bundle.report
    s = rep.get("search") or {}
    v = rep.get("verification") or {}
    return bundle, {"build_s": round(time.perf_counter() - t0, 1), "rules_chosen": s.get("rules_chosen_count") or {},
                    "nodes": [s.get("nodes_before"), s.get("nodes_after")], "streams": rep["schedule"].get("streams"),
                    "verified": v.get("passed")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="vit_b_16")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--only", action="store_true", help="also build the search with each chosen rule alone")
    ap.add_argument("--against-compile", action="store_true", help="also time torch.compile of the PyTorch model")
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--work", default="/tmp/rule_ablation")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/bench_out"))
    args = ap.parse_args(argv)
    # parastream first: a BERT run that made the model (imported transformers) first found no parastream package
    from parastream.launcher import load
    from parastream.pipeline import build  # noqa: F401
    from parastream.pipeline.bench import measure
    from parastream.rewrite.rules import rules_for

    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    name = f"{args.model}_b{args.batch}"
    model, inputs = make_model(args.model, args.batch)
    onnx_path = work / f"{name}.onnx"
    export(model, inputs, onnx_path)
    every = rules_for("torch")
    doc: dict = {"model": args.model, "batch": args.batch, "builds": {}, "median_ms": {}}
    result = out / f"rule_ablation_{name}.json"
    bundles = {}

    def one(variant: str, rules):
        try:
            bundles[variant], info = _build(onnx_path, work / f"{name}_{variant.replace(' ', '_')}", rules=rules)
        except Exception as e:  # noqa: BLE001 - recorded; the other variants go on
            info = {"error": f"{type(e).__name__}: {e}"[:500]}
        doc["builds"][variant] = info
        print(json.dumps({"variant": variant, **info}), flush=True)
        result.write_text(json.dumps(doc, indent=1))
        return info

    searched = one("searched", every)
    one("input", None)
    chosen = sorted(searched.get("rules_chosen") or {})
    for r in chosen:
        one(f"without {r}", [x for x in every if x.name != r])
    if args.only:
        for r in chosen:
            one(f"only {r}", [x for x in every if x.name == r])
    launchers = {v: load(b) for v, b in bundles.items()}
    times = measure(launchers, runs=args.runs, warmup=20)
    doc["median_ms"] = {v: float(np.median(t)) for v, t in times.items()}
    if args.against_compile:
        import torch

        from corpus_gpu import users_compiled
        from gpu import cuda_median_ms

        compiled, dev = users_compiled(args.model, model, inputs)
        with torch.no_grad():
            doc["median_ms"]["torch.compile"] = cuda_median_ms(lambda: compiled(*dev), args.runs, 20)
    for la in launchers.values():
        la.close()
    result.write_text(json.dumps(doc, indent=1))
    base = doc["median_ms"].get("searched")
    print(f"{'variant':<40} {'ms':>8} {'vs searched':>12} {'streams':>8}  rules chosen")
    for v, ms in sorted(doc["median_ms"].items(), key=lambda kv: kv[1]):
        info = doc["builds"].get(v, {})
        rules = ",".join(f"{k}x{n}" for k, n in sorted((info.get("rules_chosen") or {}).items()))
        print(f"{v:<40} {ms:8.3f} {base / ms if base else float('nan'):12.3f} {info.get('streams', '-')!s:>8}  {rules}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
