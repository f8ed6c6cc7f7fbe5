#!/usr/bin/env python3
"""What a GPU build's measured search spends in the build's own thread preparing candidates, on any machine.

Before a GPU build times a candidate it plans it, extracts its branches and computes their engine cache keys
(``GpuMeasurer.prepare``: report.json's ``search.timings.prepare_s``), and the queued compiles of the best
candidate's rounds do the same for their variants.  That work runs between two timed candidates, so it sets
how many of them a ``--measure-seconds`` budget measures.  This runs a torch build's search as a GPU build
runs it (fp16, the build's measurer, its candidates and their rounds' variants prepared) with the GPU's parts
taken out: nothing is compiled (the cache keys are computed, the jobs not submitted) and every candidate is
"measured" at once, the cost model's best faster than the input (so its rounds' variants are queued, as when
the first candidate wins) and each later one slower than it.
The seconds are this machine's; compare checkouts on the same machine (``PYTHONPATH``, as bench/README.md says).

    python3 bench/search_prepare.py MODEL.onnx [MODEL.onnx ...] [--profile 30] [--json OUT.json]

Prints per model the search's timings (prepare_s, export_s, candidates exported) and, with ``--profile N``, the N
functions of most cumulative time under cProfile.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import json
import pstats
import sys
import time


def prepare_cost(path: str, profile: int = 0) -> dict:
    build = importlib.import_module("parastream.pipeline.build")  # the module (the package exports a function of that name)
    measure = importlib.import_module("parastream.pipeline.measure")
    from parastream.launcher.engines import get_backend
    from parastream.launcher.engines import torch as torch_backend

    # keys computed, nothing compiled: the compile queue and the worker pool are left out
    torch_backend._submit = lambda *a, **k: None
    torch_backend.compile_workers = lambda options=None: 4
    torch_backend._import_runtime_in_background = lambda: None

    class Prepared(measure.GpuMeasurer):
        """The build's measurer with the GPU's timing taken out: each candidate planned as ``measure`` plans it;
        the cost model's best (the second call) wins, and its rounds' variants are queued."""

        def measure(self, model):
            self.calls += 1
            self.log.append({})
            v = self.variant_of(model)
            self.planned = [(m, x) for m, x in self.planned if m is not model]
            if self.calls == 2:
                self._queue_rounds_of(v)
            return 1e-3 if self.calls != 2 else 0.5e-3

    measure.GpuMeasurer.for_build = classmethod(lambda cls, engines, options, loaded, **kw:
                                                Prepared(engines, options, loaded, **kw))
    backend = get_backend("torch")
    backend.background_compiles, backend.gpu = True, True
    backend.start_workers = lambda options: None
    cfg = build.BuildConfig(backend="torch", precision="fp16", measure=True, verify=False, measure_seconds=1e9)

    class Quiet:
        def step(self, *a, **k):
            return build._NullTask()

    t0 = time.perf_counter()
    b = build.load_and_check(path, cfg, backend, Quiet(), {})
    b.options.device = "cuda"  # the engines' options as a GPU build's (the keys are computed for them)
    load_s = time.perf_counter() - t0
    prof = cProfile.Profile() if profile else None
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    build.rewrite_search(b, measure=True)
    if prof:
        prof.disable()
        pstats.Stats(prof, stream=sys.stdout).sort_stats("cumulative").print_stats(profile)
    timings = b.search_report.get("timings") or {}
    return {"model": path, "load_s": round(load_s, 2), "search_wall_s": round(time.perf_counter() - t0, 2),
            **{k: (round(v, 2) if isinstance(v, float) else v) for k, v in timings.items()
               if k in ("prepare_s", "export_s", "exported", "search_s", "measure_s", "total_s")}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--profile", type=int, default=0, help="print this many functions of most cumulative time")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    rows = []
    for path in args.models:
        rows.append(prepare_cost(path, args.profile))
        print(json.dumps(rows[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
