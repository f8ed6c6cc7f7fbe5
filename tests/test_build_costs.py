"""What a build pays for: the search measures only when a measurement can decide something, a candidate that
differs from the input in a few branches compiles only those, and ``--cache-dir`` makes a second build compile
nothing whose code did not change.  On the CPU: the device is a stand-in, compiles are counted."""

from __future__ import annotations

import pytest

from parastream.pipeline import zoo
from parastream.rewrite import RooflineCostModel, optimize
from parastream.rewrite.ir import import_graph


class _EveryRewriteCostlier(RooflineCostModel):
    """The roofline model, but any graph whose nodes are not the input's is estimated twice as costly: the search
    finds candidates (its rules fire) and ranks none of them below the input."""

    def __init__(self, names: set[str]):
        super().__init__()
        self.names = names

    def graph_cost(self, graph, streams):
        cp, work = super().graph_cost(graph, streams)
        return (cp, work) if {n.name for n in graph.nodes} >= self.names else (2 * cp, 2 * work)


def test_a_search_with_only_the_input_to_rank_measures_nothing():
    """The input alone decides nothing: neither prepared nor measured (the build times the input's plan once,
    against its alternatives, after the search)."""
    m = zoo.MODELS["inception_block"]()
    calls = []

    class Recording:
        lookahead = 2

        def prepare(self, models):
            calls.append("prepare")

        def measure(self, model):
            calls.append("measure")
            return 1e-3

    names = {n.name for n in import_graph(m).nodes}
    out, report = optimize(m, measure=Recording(), top_k=5, cost_model=_EveryRewriteCostlier(names))
    assert report["pieces"] and sum(p["candidates_tried"] for p in report["pieces"]) > 0  # the rules fired
    assert calls == []
    assert out is m and report["decided_by"] == "cost_model" and "nothing was measured" in report["decision"]
    assert [c["input"] for c in report["candidates"] if c["chosen"]] == [True]

    # with the roofline model a rewrite ranks below the input: the input and the rewrites are measured
    out, report = optimize(m, measure=Recording(), top_k=5)
    assert calls.count("measure") >= 2 and report["decided_by"] == "measured"


def _loaded(tmp_path, name="inception_block"):
    import onnx

    from parastream.pipeline.model_io import load_model

    path = tmp_path / f"{name}.onnx"
    onnx.save(zoo.MODELS[name](), path)
    return load_model(path)


def test_a_one_engine_plan_queues_no_boundary_layout_alternative(tmp_path):
    """A one-engine plan has no internal boundary: channels-last or contiguous boundaries are the same engines, so
    the alternatives a GPU build compiles and times for it leave that round out (``time_alternatives`` does)."""
    from parastream.launcher.engines import BuildOptions
    from parastream.launcher.engines import torch as torch_backend
    from parastream.pipeline.build import Engines
    from parastream.pipeline.measure import Variant, alternative_variants

    loaded = _loaded(tmp_path)
    engines = Engines(torch_backend, RooflineCostModel(), loaded, "fp16")
    options = BuildOptions(precision="fp16", device="cuda")
    several = engines.plan(loaded.graph, None, 4)
    assert several.num_streams > 1
    one = engines.one_engine_plan(loaded.graph, several)
    rounds = [what for what, _ in alternative_variants(engines, Variant(loaded.model, loaded.graph, several, options))]
    assert "boundary layout" in rounds and "streams" in rounds
    assert [what for what, _ in alternative_variants(engines, Variant(loaded.model, loaded.graph, one, options))] == [
        r for r in rounds if r not in ("boundary layout", "streams")]
