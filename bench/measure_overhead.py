"""Where a measured search candidate's CPU time goes before the GPU sees it (issue 12): export, plan, extract the
branches and the compile jobs' keys, then build every engine (the compiled artifacts replaced by stand-ins of their
size), for the search's top candidates of a model, under cProfile.  No GPU needed (nothing is compiled):

    python bench/measure_overhead.py model.onnx [--candidates 5]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import time

import onnx


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("onnx")
    ap.add_argument("--candidates", type=int, default=5)
    args = ap.parse_args(argv)
    from parastream.launcher.engines import BuildOptions
    from parastream.launcher.engines import torch as tb
    import importlib

    B = importlib.import_module("parastream.pipeline.build")  # the module (the package exports its build function)
    from parastream.pipeline import measure as M
    from parastream.pipeline.model_io import graph_of, load_model
    from parastream.pipeline.partition import make_plan
    from parastream.rewrite.cost import RooflineCostModel
    from parastream.rewrite import search as S

    loaded = load_model(args.onnx)
    backend = tb  # the module itself: resolve_backend refuses torch where no GPU is seen
    options = BuildOptions(precision="fp16", device="cuda")
    cm = RooflineCostModel()
    got = []
    S_measure = lambda m: (got.append(m), 1e-3)[1]  # noqa: E731 - collects the models the search would measure
    t0 = time.perf_counter()
    S.optimize(loaded.model, cost_model=cm, measure=S_measure, top_k=args.candidates)
    print(f"search + exports of {len(got)} models: {time.perf_counter() - t0:.2f} s")
    prof = cProfile.Profile()
    prof.enable()
    t = {"infer+graph": 0.0, "plan": 0.0, "extract": 0.0, "jobs": 0.0, "engines": 0.0}
    for m in got:
        t1 = time.perf_counter()
        mi = m if M._shapes_known(m) else M._infer(m)
        g = graph_of(mi)
        t2 = time.perf_counter()
        sched, _ = B.plan_streams(g, cm, None, 8)
        plan = make_plan(g, sched, backend="torch", precision="fp16", suffix=backend.suffix, inputs=loaded.inputs,
                         outputs=loaded.outputs)
        t3 = time.perf_counter()
        builder = backend.Builder(options)
        layouts = B._engine_layouts(plan, backend, options, True)
        items = [(br, b.name, layouts(b).get("layout")) for br, b in zip(B.branches_of(mi, g, plan), plan.branches)]
        t4 = time.perf_counter()
        _, todo, _ = builder._jobs(items, wait=False)
        t5 = time.perf_counter()
        for key, job in todo.items():  # stand-ins for the compiled artifacts: ~400 kB and the fp16 weights
            weights = sum(len(i.raw_data) for i in onnx.load_from_string(job[1]).graph.initializer) // 2
            tb._cache_put(key, tb._entry(os.urandom(400_000), {"params": []}, bytes(weights)), None)
        t6 = time.perf_counter()
        builder.build_all(items)  # serialize, hash, look up and pack every engine, as a scratch bundle does
        t7 = time.perf_counter()
        for k, v in zip(t, (t2 - t1, t3 - t2, t4 - t3, t5 - t4, t7 - t6)):
            t[k] += v
        print({k: round(v, 3) for k, v in zip(t, (t2 - t1, t3 - t2, t4 - t3, t5 - t4, t7 - t6))}, "s, this model")
    prof.disable()
    print({k: round(v / len(got), 3) for k, v in t.items()}, "s per model")
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
    print(buf.getvalue()[-6000:])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
