"""Where the measured search's time goes between two candidates, without a GPU: the search of a GPU build runs
with a ``measure`` that does the CPU side of ``pipeline.measure.GpuMeasurer`` (each model planned as the measurer
plans it: shapes, graph, streams, plan; prepared ``lookahead`` ahead), under cProfile.  The device's figures
(``report.json`` ``search.measure_log``) give the GPU side.

    python bench/search_overhead.py model.onnx [--candidates 8] [--top 40]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("onnx")
    ap.add_argument("--candidates", type=int, default=8)
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args()

    import importlib

    pb = importlib.import_module("parastream.pipeline.build")  # the module: parastream.pipeline.build is the function
    from parastream.pipeline import measure as pm
    from parastream.rewrite import optimize
    from parastream.rewrite.cost import RooflineCostModel

    t0 = time.perf_counter()
    loaded = pb.load_model(args.onnx)
    print(f"load {time.perf_counter() - t0:.2f} s")
    cost_model = RooflineCostModel("H100-SXM", precision="fp16")  # what a GPU build costs with
    times: dict[str, list[float]] = {}

    def timed(key, fn, *a):
        t = time.perf_counter()
        out = fn(*a)
        times.setdefault(key, []).append(time.perf_counter() - t)
        return out

    def plan_of(model):
        m = model if model is loaded.model else (model if pm._shapes_known(model) else timed("infer", pm._infer, model))
        graph = loaded.graph if model is loaded.model else timed("graph_of", pb.graph_of, m)
        sched, _ = timed("plan_streams", pb.plan_streams, graph, cost_model, None, 8)
        return timed("make_plan", lambda: pb.make_plan(graph, sched, backend="torch", precision="fp16", suffix=".zip",
                                                        inputs=loaded.inputs, outputs=loaded.outputs))

    calls = [0]

    class PlanningMeasurer:  # the CPU side of GpuMeasurer: each model planned when prepared, nothing built
        lookahead = 4

        def prepare(self, models):
            return [plan_of(m) for m in models] and {}

        def measure(self, model):
            calls[0] += 1
            if calls[0] > args.candidates:
                raise pb.MeasureBudgetSpent("enough")
            return 1e-3

    measure = PlanningMeasurer()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    _, report = optimize(loaded.model, cost_model=cost_model, streams=4, measure=measure)
    prof.disable()
    print(f"search with {calls[0]} measured: {time.perf_counter() - t0:.2f} s; timings {report.get('timings')}")
    for k, v in times.items():
        print(f"  {k}: {len(v)} x, {sum(v) / len(v):.3f} s each")
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(args.top)
    print(buf.getvalue()[-9000:])


if __name__ == "__main__":
    main()
