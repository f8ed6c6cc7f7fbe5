#!/usr/bin/env python3
"""Inductor's Triton kernels launched with programmatic dependent launch (PDL) against without, on whole models
compiled by Inductor: fp16, each in a CUDA Graph, side by side in one process.

Why: a one-engine bundle's replay is its kernels' time plus a gap between each two kernels (BERT-base on the H200:
~405 µs of kernels in 112 launches, 0.478 ms a replay; bench/NOTES.md).  On Hopper a kernel launched with the
programmatic-stream-serialization attribute may start while the kernel before it finishes, and waits
(``griddepcontrol.wait``) only before it reads what that kernel wrote.  Inductor generates such kernels where
``triton.enable_pdl`` is set (off by default: upstream found regressions on its dashboard, pytorch#167687).
Whether that shortens the gaps of the models issue 30 counts, and by how much, decides whether the torch engines
should race it in a build round (the bundles' own launcher, ``torch._C._StaticCudaLauncher``, cannot set the
attribute: Inductor refuses to launch such a kernel statically).  The model is compiled here twice by Inductor, once
with each setting, and each compile's calls are captured into a CUDA Graph of its own (``torch.cuda.CUDAGraph``, as a
bundle's launcher captures its engines); both run the same weights and inputs, timed by ``pipeline.bench`` in
alternating blocks of CUDA-event timed replays on fresh random inputs (medians of ``--runs``).  Not torch.compile's
own ``mode="reduce-overhead"``: the first run did that (bench/figures/pdl_h200_cudagraph_trees_not_comparable.json),
and both forms of EfficientNet-B0 and RegNetY-400MF ran 1.3-1.6x slower than torch.compile ran them in the corpus
table (EfficientNet-B0 0.75 against 0.455 ms, its 10th-90th percentiles 0.63-0.90; BERT-base 1.05x): two models' CUDA
Graph trees replayed in turns, the likely cause (not checked), say nothing of PDL.

Run on the device after ``source bench/device_env.sh``:
    python3 bench/pdl.py [--models efficientnet_b0,bert] [--batch 1] [--seconds 240] [--out $OUT]
Each model runs in a process of its own (a CUDA fault ends that process only: the second run's first model faulted
with an illegal address and took the three after it along); a failed row names its stage and keeps the traceback.
The third run's fault came in the timing stage, after both forms had compiled, captured and synchronized:
``--forms "with PDL"`` (or "without PDL") times one form alone, and ``--no-hold`` without ``pipeline.bench``'s
gate, which hold a block of replays queued behind a closed gate, to find which form, and which way of timing, faults.
Prints one JSON line per model as it is timed (pdl.json under --out is rewritten after each) and a table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

#: Inductor's default options, and with PDL on (the CUDA Graph is this script's own: ``GraphRunner``)
FORMS = {"without PDL": {}, "with PDL": {"triton.enable_pdl": True}}


class _Plan:
    """The model's inputs as a bundle's plan names them, which ``pipeline.bench`` draws fresh inputs for."""

    def __init__(self, inputs: dict):
        from parastream.core.tensors import TensorSpec

        self.inputs = [TensorSpec(k, str(v.dtype).removeprefix("torch."), list(v.shape)) for k, v in inputs.items()]


class GraphRunner:
    """A compiled model's call captured into one CUDA Graph, with the launcher interface ``pipeline.bench`` times:
    static inputs at ``addr`` (the graph reads them), an ``origin`` stream, ``launch`` and ``synchronize``."""

    captured = True  # timed like a bundle's launcher: each block queued whole, then let go

    def __init__(self, fn, plan, feeds: dict, warm: int = 3):
        import torch

        self.plan, self.device = plan, 0
        self.stream = torch.cuda.Stream()
        self.origin = self.stream.cuda_stream
        self.inputs = [torch.from_numpy(np.ascontiguousarray(feeds[s.name])).cuda() for s in plan.inputs]
        self.addr = {s.name: t.data_ptr() for s, t in zip(plan.inputs, self.inputs)}
        self.graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.stream(self.stream):
            for _ in range(warm):  # the compile, and each kernel's first launch (its autotuning) outside the capture
                fn(*self.inputs)
            self.stream.synchronize()
            with torch.cuda.graph(self.graph, stream=self.stream):
                self.out = fn(*self.inputs)
        self.launch()
        self.synchronize()

    def launch(self) -> None:
        import torch

        with torch.cuda.stream(self.stream):
            self.graph.replay()

    def synchronize(self) -> None:
        self.stream.synchronize()


def time_model(name: str, batch: int, runs: int, forms: list[str] = tuple(FORMS), hold: bool = True) -> dict:
    import copy

    import torch
    from corpus_gpu import HalfInput, free_gpu
    from gpu import make_model, max_err, users_model

    from parastream.pipeline.bench import _measure

    model, inputs = make_model(name, batch)
    user = users_model(name, model)
    plan = _Plan(inputs)
    feeds = {k: v.numpy() for k, v in inputs.items()}
    row = {"model": name, "batch": batch, "torch": torch.__version__, "forms": list(forms), "held_blocks": hold}
    runners, outs = {}, {}
    stage = "start"
    try:
        for form in forms:
            options = FORMS[form]
            stage = f"compile and capture {form}"
            t0 = time.perf_counter()
            # a copy per form: dynamo keeps one compiled graph per module and backend
            compiled = torch.compile(HalfInput(copy.deepcopy(user).half().cuda()).eval(), options=options,
                                     dynamic=False)
            runner = GraphRunner(compiled, plan, feeds)
            torch.cuda.synchronize()  # (a fault of this form's kernels is this form's, not the next stage's)
            row[f"compile_s {form}"] = round(time.perf_counter() - t0, 1)
            outs[form] = runner.out.float().cpu().numpy()
            runners[form] = runner
        if len(outs) == 2:
            row["max_err"] = max_err(outs["with PDL"], outs["without PDL"])
        stage = "timing"
        times = _measure(runners, runs=runs, warmup=50, seed=7, hold=hold)
        for form, t in times.items():
            row[f"{form} ms"] = float(np.median(t))
            row[f"{form} p10_p90"] = [float(np.percentile(t, 10)), float(np.percentile(t, 90))]
        if len(times) == 2:
            row["without / with"] = row["without PDL ms"] / row["with PDL ms"]
        return row
    except Exception as e:
        e.add_note(f"stage: {stage}")
        raise
    finally:
        runners = compiled = runner = None
        free_gpu()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="efficientnet_b0,bert")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--seconds", type=float, default=240, help="start no model after this")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/pdl_out"))
    ap.add_argument("--forms", default=",".join(FORMS), help="of: " + ", ".join(FORMS) + " (one alone: which faults)")
    ap.add_argument("--no-hold", action="store_true",
                    help="time each replay as it is queued, without holding a block behind pipeline.bench's gate")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    forms = [f.strip() for f in args.forms.split(",") if f.strip()]
    if not forms or any(f not in FORMS for f in forms):
        ap.error(f"--forms {args.forms!r}: of {', '.join(FORMS)}")
    import torch._inductor.config as cfg

    if not hasattr(cfg.triton, "enable_pdl"):
        print(json.dumps({"error": "this torch's Inductor has no triton.enable_pdl"}))
        return 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start, rows = time.perf_counter(), []
    if args.child:  # one model in this process: a CUDA fault ends its process, not the later models'
        try:
            row = time_model(args.child, args.batch, args.runs, forms, not args.no_hold)
        except Exception as e:  # noqa: BLE001 - one model's failure is its row
            import traceback

            row = {"model": args.child, "error": f"{type(e).__name__}: {str(e)[:300]}",
                   "stage": next((n for n in getattr(e, "__notes__", []) if n.startswith("stage")), None),
                   "traceback": traceback.format_exc()[-3000:]}
        print("ROW " + json.dumps(row), flush=True)
        return 0
    for name in [m for m in args.models.split(",") if m]:
        if time.perf_counter() - t_start > args.seconds:
            rows.append({"model": name, "skipped": "--seconds"})
            continue
        p = subprocess.run([sys.executable, __file__, "--child", name, "--batch", str(args.batch), "--runs",
                            str(args.runs), "--out", str(out), "--forms", ",".join(forms),
                            *(["--no-hold"] if args.no_hold else [])], capture_output=True, text=True)
        found = [ln[4:] for ln in p.stdout.splitlines() if ln.startswith("ROW ")]
        row = json.loads(found[-1]) if found else {"model": name, "error": f"child exited {p.returncode}",
                                                   "stderr": p.stderr[-3000:]}
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("traceback", "stderr")}), flush=True)
        (out / "pdl.json").write_text(json.dumps(rows, indent=1))
    print(f"{'model':20} {'without PDL ms':>15} {'with PDL ms':>12} {'without/with':>13}")
    for r in rows:
        if r.get("error") or r.get("skipped"):
            print(f"{r['model']:20} {r.get('error') or r.get('skipped')}")
            continue
        cells = [f"{r[k]:.4f}" if k in r else "-" for k in ("without PDL ms", "with PDL ms")]
        ratio = f"{r['without / with']:.3f}" if "without / with" in r else "-"
        print(f"{r['model']:20} {cells[0]:>15} {cells[1]:>12} {ratio:>13}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
