#!/usr/bin/env python3
"""Whole models compiled by Inductor with options of one form against another: fp16, each in a CUDA Graph, side by
side in one process.

Each form is a set of Inductor options (``FORMS``); the model (bench/gpu.py's, as its users run it) is compiled
once per form, each compile's calls captured into a CUDA Graph of its own (``torch.cuda.CUDAGraph``, as a bundle's
launcher captures its engines), and all run the same weights and inputs, timed by ``pipeline.bench`` in alternating
blocks of CUDA-event timed replays on fresh random inputs (medians of ``--runs``); each form's outputs are compared
with the first's.  Not torch.compile's own ``mode="reduce-overhead"``: two models' CUDA Graph trees replayed in turns
in one process ran 1.3-1.6x slower than torch.compile ran them in the corpus table
(bench/figures/pdl_h200_cudagraph_trees_not_comparable.json).

The forms, and why each is asked:

  default       Inductor's defaults, as the bundles' engines are compiled (the first form: the ratios' base)
  with PDL      ``triton.enable_pdl``: Inductor's Triton kernels launched with programmatic dependent launch.  A
                one-engine bundle's replay is its kernels' time plus a gap between each two (BERT-base on the H200:
                ~405 µs of kernels in 112 launches, 0.478 ms a replay); on Hopper such a kernel may start while the
                one before it finishes and waits (``griddepcontrol.wait``) only before it reads what that one wrote.
                Off by default upstream (regressions on its dashboard, pytorch#167687); the bundles' own launcher,
                ``torch._C._StaticCudaLauncher``, cannot set the attribute.  Its runs so far faulted (an illegal address;
                bench/figures/pdl_h200_graph_runner_illegal_address.json), as did DenseNet-121's of the forms
                below: this script's runner let the first form's weights go while the second form was captured
                (``GraphRunner.fn`` keeps them since), so no PDL figure exists yet.
  pointwise cat ``max_pointwise_cat_inputs`` 64: a Concat of up to 64 inputs read by pointwise ops is fused into
                their kernel, where Inductor's default (8) writes a Concat of more inputs into a buffer of its own,
                a copy kernel per input that a convolution wrote.  DenseNet-121's engine ran 145 such copy kernels a
                replay (~0.9 µs each and a gap; H200, bench/NOTES.md, fifty-first session): each dense layer
                concatenates all the block's earlier outputs (up to 25) and normalises them.  The engines compile
                with it since (``torch.POINTWISE_CAT_INPUTS``: the bundle 1.19x faster); here it is asked of the
                user's model under Inductor, torch.compile's side.
  forced cat    ``force_pointwise_cat``: every Concat fused into its readers, whatever its inputs.

Run on the device after ``source bench/device_env.sh``:
    python3 bench/inductor_forms.py --models densenet121 --forms "default,pointwise cat,forced cat" [--out $OUT]
    python3 bench/inductor_forms.py --models efficientnet_b0,bert --forms "default,with PDL"
Each model runs in a process of its own (a CUDA fault ends that process only: PDL's second run's first model
faulted with an illegal address and took the three after it along); a failed row names its stage and keeps the
traceback.  Prints one JSON line per model as it is timed (inductor_forms.json under --out is rewritten after
each) and a table.
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

#: the forms' Inductor options (the module's docstring says why each; the CUDA Graph is this script's own:
#: ``GraphRunner``)
FORMS = {"default": {}, "with PDL": {"triton.enable_pdl": True},
         "pointwise cat": {"max_pointwise_cat_inputs": 64}, "forced cat": {"force_pointwise_cat": True}}


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
        # the compiled module holds the weights the graph reads: kept as long as the graph is.  Without it, the
        # next form's capture (``torch.cuda.graph`` collects garbage and empties torch's cache before it captures)
        # handed this form's weights back to the driver, and this graph's first timed replay faulted with an
        # illegal address (every run of two forms or more until then, PDL's too: its faults were this script's)
        self.fn = fn
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
            # (BERT's export has two outputs: the last hidden state, compared, and the pooler's)
            first = runner.out[0] if isinstance(runner.out, (tuple, list)) else runner.out
            outs[form] = first.float().cpu().numpy()
            runners[form] = runner
        base = forms[0]
        for form in forms[1:]:
            row[f"max_err {form}"] = max_err(outs[form], outs[base])
        stage = "timing"
        times = _measure(runners, runs=runs, warmup=50, seed=7, hold=hold)
        for form, t in times.items():
            row[f"{form} ms"] = float(np.median(t))
            row[f"{form} p10_p90"] = [float(np.percentile(t, 10)), float(np.percentile(t, 90))]
        for form in forms[1:]:
            row[f"{base} / {form}"] = row[f"{base} ms"] / row[f"{form} ms"]
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
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/inductor_forms_out"))
    ap.add_argument("--forms", default="default,with PDL",
                    help="of: " + ", ".join(FORMS) + " (the first is the base of the ratios; one alone: whether it faults)")
    ap.add_argument("--no-hold", action="store_true",
                    help="time each replay as it is queued, without holding a block behind pipeline.bench's gate")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    forms = [f.strip() for f in args.forms.split(",") if f.strip()]
    if not forms or any(f not in FORMS for f in forms):
        ap.error(f"--forms {args.forms!r}: of {', '.join(FORMS)}")
    import torch._inductor.config as cfg

    known = cfg.get_config_copy()  # (its options by dotted name: "triton.enable_pdl")
    missing = [k for f in forms for k in FORMS[f] if k not in known]
    if missing:
        print(json.dumps({"error": f"this torch's Inductor has no {', '.join(missing)}"}))
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
        (out / "inductor_forms.json").write_text(json.dumps(rows, indent=1))
    print(f"{'model':20} " + " ".join(f"{f + ' ms':>18}" for f in forms) + "  " +
          " ".join(f"{forms[0] + ' / ' + f:>24}" for f in forms[1:]))
    for r in rows:
        if r.get("error") or r.get("skipped"):
            print(f"{r['model']:20} {r.get('error') or r.get('skipped')}")
            continue
        cells = [f"{r[f + ' ms']:.4f}" if f + " ms" in r else "-" for f in forms]
        ratios = [f"{r[k]:.3f}" if (k := f"{forms[0]} / {f}") in r else "-" for f in forms[1:]]
        print(f"{r['model']:20} " + " ".join(f"{c:>18}" for c in cells) + "  " + " ".join(f"{x:>24}" for x in ratios))
    return 0


if __name__ == "__main__":
    sys.exit(main())
