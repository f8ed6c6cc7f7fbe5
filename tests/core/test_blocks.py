"""Repeated blocks of a one-stream plan (core/blocks.py) and the build's one engine per block (--engine-blocks)."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs
import pytest
from graphs import classifier_cnn_model, ort_reference, residual_stack_model, three_branch_model
from onnx import shape_inference

from parastream.core.blocks import node_tokens, repeated_blocks, split_schedule
from parastream.core.schedule import schedule_graph


def gs_graph(model):
    g = gs.import_onnx(shape_inference.infer_shapes(model))
    g.toposort()
    return g


def _run_bundle(path, feeds: dict) -> dict:
    """The bundle at ``path`` loaded by ``parastream.launcher.load`` and run once on ``feeds``."""
    from parastream.launcher import load

    la = load(path)
    try:
        return la(feeds)
    finally:
        la.close()


def test_a_stack_of_equal_blocks_is_cut_once_per_block_where_no_fusion_is_lost():
    nodes = list(gs_graph(residual_stack_model(layers=6)).nodes)
    found = repeated_blocks(nodes)
    assert found.repeated >= 4
    # consecutive and complete: the runs partition the order
    assert found.runs[0][0] == 0 and found.runs[-1][1] == len(nodes)
    assert all(a[1] == b[0] for a, b in zip(found.runs, found.runs[1:]))
    blocks = [r for r, rep in zip(found.runs, found.repeat_of) if rep >= 0]
    tok = node_tokens(nodes)
    assert len({tuple(tok[s:e]) for s, e in blocks}) == 1  # every block the same code
    for s, _ in blocks:
        # never between the residual Add and the next LayerNorm (one kernel in a whole-model compile)
        assert not (nodes[s - 1].op == "Add" and nodes[s].op == "LayerNormalization")
        assert nodes[s].op == "MatMul"  # the lossless cut of this block: after the LayerNorm, before the product


def test_blocks_of_unequal_code_are_not_cut():
    nodes = list(gs_graph(residual_stack_model(layers=4, widths=[16, 24, 40, 56])).nodes)
    found = repeated_blocks(nodes)
    assert found.repeated == 0 and found.runs == [(0, len(nodes))]


def test_a_model_without_repeats_is_one_run():
    nodes = list(gs_graph(three_branch_model()).nodes)
    assert repeated_blocks(nodes).runs == [(0, len(nodes))]


def test_weights_do_not_make_blocks_differ_but_small_integer_constants_do():
    a = list(gs_graph(residual_stack_model(layers=2, seed=0)).nodes)
    b = list(gs_graph(residual_stack_model(layers=2, seed=1)).nodes)
    assert (node_tokens(a) == node_tokens(b)).all()  # other weights, the same code


def test_split_schedule_chains_the_blocks_on_one_stream():
    g = gs_graph(residual_stack_model(layers=5))
    sched = schedule_graph(g, 1, lambda n: 1e-6, lambda n: False)
    assert len(sched.branches) == 1
    split = split_schedule(sched, g.nodes)
    assert len(split.branches) > 1 and split.num_streams == 1
    assert [n for b in split.branches for n in b] == sched.branches[0]
    assert split.launch_order == list(range(len(split.branches)))
    assert all(p < b for b, ps in enumerate(split.branch_preds) for p in ps)
    assert split.branch_preds[1] == [0]
    assert sum(split.branch_time) == pytest.approx(sched.makespan)
    # blocks that would save little of the compile (three layers: a head, one block, a tail) are not cut
    few = gs_graph(residual_stack_model(layers=3))
    one = schedule_graph(few, 1, lambda n: 1e-6, lambda n: False)
    assert repeated_blocks(list(few.nodes)).compiled_nodes > 0.5 * len(few.nodes)
    assert split_schedule(one, few.nodes) is one
    multi = schedule_graph(gs_graph(three_branch_model()), 3, lambda n: 1e-6, lambda n: False)
    assert split_schedule(multi, gs_graph(three_branch_model()).nodes) is multi  # only one-stream plans are cut


@pytest.mark.parametrize("engine_blocks, engines", [("blocks", 5), ("whole", 1)])
def test_a_build_with_one_engine_per_block_runs_and_verifies(tmp_path, engine_blocks, engines):
    from parastream.pipeline import build

    model = residual_stack_model(layers=5)
    path = tmp_path / "stack.onnx"
    import onnx

    onnx.save(model, path)
    bundle = build(path, tmp_path / "out", backend="onnxruntime", engine_blocks=engine_blocks, search=False,
                   measure=False)
    assert len(bundle.plan.branches) >= engines if engine_blocks == "blocks" else len(bundle.plan.branches) == 1
    assert bundle.plan.num_streams == 1
    assert bundle.report["verification"]["passed"]
    assert bundle.manifest["options"]["engine_blocks"] == engine_blocks
    x = np.random.default_rng(3).standard_normal((1, 16, 32)).astype(np.float32)
    got = _run_bundle(tmp_path / "out", {"x": x})["y"]
    np.testing.assert_allclose(got, ort_reference(model, {"x": x})["y"], rtol=1e-5, atol=1e-5)


def test_an_unknown_engine_blocks_value_is_a_one_line_error(tmp_path):
    import onnx

    from parastream.launcher.errors import ParastreamError
    from parastream.pipeline import build

    path = tmp_path / "stack.onnx"
    onnx.save(residual_stack_model(layers=3), path)
    with pytest.raises(ParastreamError, match="engine_blocks='layers'"):
        build(path, tmp_path / "out", backend="onnxruntime", engine_blocks="layers", search=False, measure=False)
    assert not (tmp_path / "out").exists()


# -- the "engine blocks" round: the blocks against one engine for the whole model, timed on the GPU (stand-ins) --
def _blocks_plan(layers: int):
    """(graph, a plan-like object of its one-stream schedule cut into blocks) of a residual stack."""
    import types

    g = gs_graph(residual_stack_model(layers=layers))
    split = split_schedule(schedule_graph(g, 1, lambda n: 1e-6, lambda n: False), g.nodes)
    assert len(split.branches) > 1
    return g, types.SimpleNamespace(num_streams=1, branches=[types.SimpleNamespace(nodes=r) for r in split.branches])


def test_the_whole_engine_is_raced_only_where_the_blocks_compile_over_a_quarter_of_the_nodes():
    """Its rival is a whole-model compile: where the blocks' distinct code is a small share of the model (a deep
    stack), the blocks ship untimed; where it is larger, the round races them."""
    from parastream.launcher.engines import BuildOptions
    from parastream.pipeline.measure import WHOLE_ENGINE_RACED_ABOVE, Variant, races_whole_engine

    assert WHOLE_ENGINE_RACED_ABOVE == 0.25
    for layers, raced in ((5, True), (10, False)):
        graph, plan = _blocks_plan(layers)
        assert races_whole_engine(Variant(residual_stack_model(layers), graph, plan, BuildOptions())) is raced

@pytest.mark.parametrize("blocks_ms, whole_ms, whole_kept", [(1.0, 0.9, True), (1.0, 0.99, False), (0.9, 1.0, False)])
def test_the_round_keeps_the_blocks_unless_the_whole_engine_is_over_2_percent_faster(monkeypatch, blocks_ms, whole_ms,
                                                                                      whole_kept):
    import types

    from gpu_build_fakes import fake_gpu, gpu_backend

    from parastream.launcher.engines import BuildOptions
    from parastream.pipeline import measure
    from parastream.pipeline.measure import Variant, time_alternatives

    monkeypatch.setattr(measure, "_internal_nhwc", lambda backend, plan: False)
    _, made = fake_gpu(monkeypatch, {("bundle", False, None): blocks_ms, ("whole", None, None): whole_ms})
    graph, blocked = _blocks_plan(5)  # 42% of the nodes compiled: raced
    whole = types.SimpleNamespace(num_streams=1, branches=[0])

    def launcher(v):
        la = types.SimpleNamespace(kind=("whole", None, None) if v.plan is whole else ("blocks", None, None), closed=False)
        la.close = lambda: setattr(la, "closed", True)
        made.append(la)
        return la

    engines = types.SimpleNamespace(backend=gpu_backend(fuses_conv_relu=False), launcher=launcher,
                                    whole_engine_plan=lambda graph, p: whole)
    got = time_alternatives(engines, "bundle", Variant(residual_stack_model(5), graph, blocked, BuildOptions(precision="fp16")),
                            runs=5)
    assert [r["choice"] for r in got["rounds"]] == ["engine blocks"]
    assert got["whole_engine"] is whole_kept
    assert got["rounds"][0]["current_kept_within"] == 0.02
    assert all(la.closed for la in made)
    # a one-engine plan, or a plan on several streams, has no such round
    for plan in (whole, types.SimpleNamespace(num_streams=2, branches=[0, 1])):
        assert "engine blocks" not in [w for w, _ in measure.alternative_variants(
            types.SimpleNamespace(backend=gpu_backend(fuses_conv_relu=False), one_stream_plan=lambda g, p: whole),
            Variant(residual_stack_model(3), None, plan, BuildOptions(precision="fp16")))]


def test_the_input_s_engine_blocks_round_holds_for_a_rewritten_plan_whatever_its_margin():
    from parastream.pipeline.measure import carried_rounds

    rounds = [{"choice": "engine blocks", "timed_ms": {"one engine per repeated block": 1.0,
                                                       "one engine for the whole model": 0.99}, "won": "x"},
              {"choice": "conv+ReLU", "timed_ms": {"a": 1.0, "b": 0.99}, "won": "a"}]
    assert [r["choice"] for r in carried_rounds(rounds)] == ["engine blocks"]


def test_a_build_whose_whole_engine_won_ships_one_engine(tmp_path, monkeypatch):
    """The GPU stage driven on the CPU (onnxruntime's engines under a backend that says it is a GPU backend and
    compiles repeats once): the plan is cut into blocks, the timing picks the whole-model engine, and the build
    writes and verifies one engine."""
    import importlib
    import json
    import types

    import onnx

    from parastream.launcher.engines import require_backend
    from parastream.pipeline import build

    build_module = importlib.import_module("parastream.pipeline.build")
    real = require_backend("onnxruntime")
    gpu_like = types.SimpleNamespace(**{k: getattr(real, k) for k in dir(real) if not k.startswith("__")})
    gpu_like.gpu, gpu_like.compiles_repeats_once = True, True
    monkeypatch.setattr(build_module, "resolve_backend", lambda name: gpu_like)
    timed = []

    def whole_wins(engines, bundle, variant, runs, **rounds_timed):
        timed.append(len(variant.plan.branches))
        return {"one_engine": False, "whole_engine": True, "internal_nhwc": True, "fuse_conv_relu": False, "rounds": []}

    monkeypatch.setattr(build_module, "time_alternatives", whole_wins)
    path = tmp_path / "stack.onnx"
    onnx.save(residual_stack_model(layers=5), path)
    bundle = build(path, tmp_path / "b", backend="onnxruntime", search=False)
    assert timed and timed[0] > 1  # the blocks were timed
    assert len(bundle.plan.branches) == 1 and len(list((tmp_path / "b" / "engines").iterdir())) == 1
    report = json.loads((tmp_path / "b" / "report.json").read_text())
    assert report["measured_choices"]["whole_engine"] and report["verification"]["passed"]
    assert report["schedule"]["streams_tried"][-1] == {"streams": 1, "engines": 1, "chosen": True, "measured": True}


def test_an_exported_transformer_is_cut_into_its_layers(tmp_path):
    """A real export (transformers' BERT, 10 layers, TorchScript exporter, random weights) as the loader carries
    it: its layers are found as blocks of one code, and an ONNX Runtime build of the blocks verifies."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from dynamic_models import tiny_bert

    from parastream.pipeline import build
    from parastream.pipeline.model_io import load_model

    path = tiny_bert(tmp_path / "bert10.onnx", layers=10)
    shapes = {name: [1, 16] for name in ("input_ids", "attention_mask", "token_type_ids")}
    nodes = list(load_model(path, shapes).graph.nodes)
    found = repeated_blocks(nodes)
    tok = node_tokens(nodes)
    blocks = {tuple(tok[s:e]) for (s, e), rep in zip(found.runs, found.repeat_of) if rep >= 0}
    assert found.repeated >= 8 and len(blocks) == 1  # the layers (less the first and last, cut at another phase)
    assert found.compiled_nodes < 0.4 * len(nodes)
    bundle = build(path, tmp_path / "out", backend="onnxruntime", engine_blocks="blocks", search=False, measure=False,
                   shapes=shapes)
    assert len(bundle.plan.branches) == len(found.runs) and bundle.report["verification"]["passed"]


def test_a_library_call_and_its_epilogue_are_never_cut_apart():
    """Conv -> Relu is one cuDNN call in a torch engine, MatMul -> bias Add one cuBLAS call: no cut between them."""
    from parastream.core.blocks import _cut_quality

    nodes = list(gs_graph(residual_stack_model(layers=3)).nodes)
    _, fused = _cut_quality(nodes)
    for i, n in enumerate(nodes):
        if n.op == "MatMul" and nodes[i + 1].op == "Add" and nodes[i + 1].name.endswith("/bias"):
            assert fused[i + 1] > 0  # the cut right after the product
    found = repeated_blocks(nodes)
    for s, _ in found.runs[1:]:
        assert not (nodes[s - 1].op == "MatMul" and nodes[s].name.endswith("/bias"))


def test_a_model_with_control_flow_is_not_cut():
    """An If's branches read tensors of the enclosing graph without listing them: no cut may separate them."""
    from onnx import TensorProto, helper

    base = residual_stack_model(layers=6)
    then_g = helper.make_graph([helper.make_node("Identity", ["l5.out"], ["t"])], "then", [],
                               [helper.make_tensor_value_info("t", TensorProto.FLOAT, [1, 16, 32])])
    else_g = helper.make_graph([helper.make_node("Neg", ["l0.out"], ["e"])], "else", [],
                               [helper.make_tensor_value_info("e", TensorProto.FLOAT, [1, 16, 32])])
    g = base.graph
    g.initializer.append(helper.make_tensor("cond", TensorProto.BOOL, [], [True]))
    g.node.insert(len(g.node) - 1, helper.make_node("If", ["cond"], ["chosen"], then_branch=then_g, else_branch=else_g,
                                                    name="if"))
    g.node[-1].input[0] = "chosen"
    nodes = list(gs_graph(base).nodes)
    assert repeated_blocks(nodes).runs == [(0, len(nodes))]


def test_inspect_reports_the_engines_the_default_build_would_make(tmp_path, monkeypatch):
    """Where the default backend compiles equal code once, inspect shows the one-stream plan cut into blocks, as the
    build makes it; where it does not (onnxruntime here), one engine."""
    import os
    import types

    import onnx
    from rich.console import Console

    import parastream.launcher.engines as engines
    from parastream.pipeline.report import inspect_model

    path = tmp_path / "stack.onnx"
    onnx.save(residual_stack_model(layers=6), path)
    quiet = Console(file=open(os.devnull, "w"))
    assert inspect_model(path, console=quiet)["branches"] == 1
    real = engines.resolve_backend("auto")
    like_torch = types.SimpleNamespace(**{k: getattr(real, k) for k in dir(real) if not k.startswith("__")})
    like_torch.compiles_repeats_once = True
    monkeypatch.setattr(engines, "resolve_backend", lambda name: like_torch)
    seen = inspect_model(path, console=quiet)
    assert seen["streams"] == 1 and seen["branches"] > 1
    assert seen["streams_tried"][0]["engines_are"] == "repeated blocks"


@pytest.mark.gpu
@pytest.mark.parametrize("engine_blocks", ["blocks", "whole"])
def test_torch_engines_per_block_compile_once_and_verify_on_the_gpu(tmp_path, engine_blocks):
    """On the GPU (torch engines, fp16, the kernels the bundle ships): the stack's blocks compile once, the others
    reuse that code with their own weights, the bundle verifies against ONNX Runtime and its outputs match the
    one-engine bundle's."""
    import onnx

    from parastream.pipeline import build

    onnx.save(residual_stack_model(layers=8, width=64, tokens=32), tmp_path / "stack.onnx")
    bundle = build(tmp_path / "stack.onnx", tmp_path / "b", backend="torch", precision="fp16", search=False,
                   measure=False, engine_blocks=engine_blocks)
    engines = [e for e in bundle.report["engines"].values() if isinstance(e, dict)]
    assert bundle.report["verification"]["passed"]
    assert bundle.report["verification"]["engines_compiled_at_load"] == 0
    if engine_blocks == "blocks":
        assert len(bundle.plan.branches) > 4 and bundle.plan.num_streams == 1
        assert sum(bool(e.get("code_reused")) for e in engines) >= 4
    else:
        assert len(bundle.plan.branches) == 1
    x = np.random.default_rng(5).standard_normal((1, 32, 64)).astype(np.float32)
    got = _run_bundle(tmp_path / "b", {"x": x})["y"]
    ref = ort_reference(residual_stack_model(layers=8, width=64, tokens=32), {"x": x})["y"]
    assert np.abs(got - ref).max() / np.abs(ref).max() < 2e-2


def test_the_last_block_reaches_as_far_as_the_repeat_does():
    """The repeat's extent is every position that matches one period back: a block that ends inside it is kept,
    though the repeat's length is not a whole number of periods."""
    nodes = list(gs_graph(residual_stack_model(layers=8, final_norm=True)).nodes)
    found = repeated_blocks(nodes)
    # the final LayerNorm matches a layer's first node: the repeat reaches one node past the eighth layer's start
    # one period back, and the blocks cut after each LayerNorm end with it: eight blocks, the last ending the model
    assert found.repeated == 8 and found.runs[-1][1] == len(nodes)


def test_a_kept_candidate_waits_for_the_input_s_engine_blocks_round_only(monkeypatch):
    """When the search keeps a candidate, the input's rounds still compiling are left to the build, but for the
    engine blocks round, which the candidate takes from the input whatever its margin: it is timed then (its
    whole-model compile waited for), and carried."""
    import types

    from parastream.launcher.engines import BuildOptions
    from parastream.pipeline import measure
    from parastream.pipeline.measure import GpuMeasurer, carried_rounds

    raced = []

    def fake_race(rounds, what, current, other, plan, **kw):
        raced.append((what, other.variant))
        rounds.append({"choice": what, "timed_ms": {"one engine per repeated block": 1.0,
                                                    "one engine for the whole model": 1.01},
                       "won": "one engine per repeated block"})
        return False

    monkeypatch.setattr(measure, "race", fake_race)
    opened = []

    def launcher(v):
        la = types.SimpleNamespace(variant=v, close=lambda: opened.remove(la))
        opened.append(la)
        return la

    engines = types.SimpleNamespace(backend=types.SimpleNamespace(background_compiles=False, compiling=lambda keys: 1),
                                    launcher=launcher)
    m = GpuMeasurer(engines, BuildOptions(), types.SimpleNamespace(model=None, graph=None), streams=None, max_streams=4,
                    budget_s=1.0)
    m.reference = (object(), 1.0)
    m.early.update(plan="input plan", rounds=[], todo=[("attention", "attention off", ["a"]),
                                                       ("engine blocks", "whole engine", ["w"])])
    got = m.rounds_timed()
    assert raced == [("engine blocks", "whole engine")] and not opened  # loaded, timed, closed
    assert [t[0] for t in m.early["todo"]] == ["attention"]  # not waited for
    assert [r["choice"] for r in carried_rounds(got["rounds"])] == ["engine blocks"]


def test_an_input_cut_without_a_race_holds_for_a_candidate_whose_share_crossed_the_threshold(monkeypatch):
    """The input's plan cut into blocks and not raced (a deep stack: the blocks compile a small share) is a
    decision a rewritten plan takes as it is, though its own share is over the threshold: the candidate's round
    is neither queued during the search nor raced after it, and report.json says why."""
    import types

    from gpu_build_fakes import gpu_backend

    from parastream.launcher.engines import BuildOptions
    from parastream.pipeline import measure
    from parastream.pipeline.measure import (GpuMeasurer, Variant, blocks_not_raced, carried_rounds, races_whole_engine,
                                             time_alternatives)

    deep_graph, deep_plan = _blocks_plan(10)
    shallow_graph, shallow_plan = _blocks_plan(5)
    deep = Variant(residual_stack_model(10), deep_graph, deep_plan, BuildOptions(precision="fp16"))
    shallow = Variant(residual_stack_model(5), shallow_graph, shallow_plan, BuildOptions(precision="fp16"))
    cut = blocks_not_raced(deep)
    assert not races_whole_engine(deep) and races_whole_engine(shallow)
    assert cut["choice"] == "engine blocks" and cut["won"] == "one engine per repeated block"
    assert "raced above 25%" in cut["not_raced"]
    assert blocks_not_raced(shallow) is None  # raced: the round decides it
    one = types.SimpleNamespace(num_streams=1, branches=[0])
    assert blocks_not_raced(Variant(None, deep_graph, one, BuildOptions())) is None  # one engine: no cut to carry
    (carried,) = carried_rounds([cut])
    assert carried["timed"].startswith("not raced on the input's plan")

    # the build's rounds for the kept candidate: taken, nothing loaded for the whole model
    monkeypatch.setattr(measure, "_internal_nhwc", lambda backend, plan: False)
    made = []
    engines = types.SimpleNamespace(backend=gpu_backend(fuses_conv_relu=False), whole_engine_plan=lambda g, p: one,
                                    launcher=lambda v: made.append(v))
    monkeypatch.setattr(measure, "gpu_present", lambda backend: True)
    got = time_alternatives(engines, "bundle", shallow, runs=5, timed=[carried])
    assert [r["choice"] for r in got["rounds"]] == ["engine blocks"] and got["whole_engine"] is False
    assert got["rounds"][0]["not_raced"] == cut["not_raced"] and made == []

    # during the search: the candidate's rounds queued without the whole-model compile
    queued = []
    backend = types.SimpleNamespace(background_compiles=True, compiling=lambda keys: 0)
    engines = types.SimpleNamespace(backend=backend, precompile=lambda variants, **kw: queued.extend(variants) or {"jobs": len(variants)})
    loaded = types.SimpleNamespace(model=object(), graph=None)
    m = GpuMeasurer(engines, BuildOptions(), loaded, streams=None, max_streams=4, budget_s=1.0)
    m.variant_of = lambda model: deep
    m.prepare([loaded.model])  # the input prepared: its cut noted
    assert m.input_cut == cut and m.input_plan is deep_plan
    queued.clear()
    m.log.append({})
    monkeypatch.setattr(measure, "alternative_variants", lambda e, v: [("engine blocks", "whole model")])
    m._queue_rounds_of(shallow)
    assert queued == []
    timed = m.rounds_timed()
    assert timed["plan"] is deep_plan and [r["choice"] for r in carried_rounds(timed["rounds"])] == ["engine blocks"]
    assert timed["timed"] == "the input's engine cut, not raced"  # no round of the input timed in this test
    m.input_cut = None  # an input whose cut was raced (or not cut): the candidate's round is queued as before
    m._queue_rounds_of(shallow)
    assert queued == ["whole model"]


@pytest.mark.parametrize("input_layers", [10, 4])
def test_a_rewritten_graph_is_cut_into_blocks_where_its_input_is(tmp_path, input_layers):
    """A rewrite can shrink a model's blocks more than what does not repeat, so that the blocks' distinct code
    crosses ``MAX_COMPILED_SHARE`` of the nodes where the input's did not (ConvNeXt-T: 49% against 52-53%).  A
    build plans such a graph (a search's candidate: any graph but its input's) cut into blocks wherever its input's
    one-stream plan is cut, so that its measurement compiles blocks rather than the whole model; where the input
    is not cut, by its own share, as before."""
    import onnx

    from parastream.launcher.engines import torch as torch_backend
    from parastream.pipeline.build import Engines, plan_streams
    from parastream.pipeline.model_io import graph_of, load_model
    from parastream.rewrite import RooflineCostModel

    onnx.save(residual_stack_model(input_layers), tmp_path / "input.onnx")
    loaded = load_model(tmp_path / "input.onnx")
    engines = Engines(torch_backend, RooflineCostModel(), loaded, "fp16", blocks=True)
    candidate = graph_of(shape_inference.infer_shapes(residual_stack_model(4, seed=3)))  # 52% distinct code
    alone, _ = plan_streams(candidate, engines.cost_model, 1, 1, blocks=True)
    assert len(alone.branches) == 1  # by its own share: one engine
    input_plan = engines.plan(loaded.graph, 1, 1)
    assert engines.input_cut_in_blocks() is (input_layers == 10)
    assert (len(input_plan.branches) > 1) is (input_layers == 10)
    got = engines.plan(candidate, 1, 1)
    if input_layers == 10:
        assert got.num_streams == 1 and len(got.branches) > 1
        assert len(engines.whole_engine_plan(candidate, got).branches) == 1  # the "engine blocks" round's rival
    else:
        assert len(got.branches) == 1
    assert len(Engines(torch_backend, RooflineCostModel(), loaded, "fp16", blocks=False).plan(candidate, 1, 1).branches) == 1


# -- the classifier head as an engine of its own (--head-engine) ------------------------------------------------
def test_a_cnn_s_head_begins_at_its_only_matrix_product():
    from parastream.core.blocks import head_start

    nodes = list(gs_graph(classifier_cnn_model()).nodes)
    c = head_start(nodes)
    assert c is not None and nodes[c].op == "Gemm" and [n.op for n in nodes[c - 2:c]] == ["GlobalAveragePool", "Flatten"]


@pytest.mark.parametrize("kwargs, why", [
    ({"matmul_in_body": True}, "a matrix product outside the head"),
    ({"tail": 9}, "a head longer than HEAD_NODES"),
])
def test_no_head_is_cut_where_it_is_not_a_classifier_s(kwargs, why):
    from parastream.core.blocks import HEAD_NODES, head_start

    assert HEAD_NODES == 8
    assert head_start(list(gs_graph(classifier_cnn_model(**kwargs)).nodes)) is None, why
    assert head_start(list(gs_graph(classifier_cnn_model(tail=HEAD_NODES - 2)).nodes)) is not None  # (within)
    assert head_start(list(gs_graph(three_branch_model()).nodes)) is None  # no matrix product
    # a transformer's products are in every layer
    assert head_start(list(gs_graph(residual_stack_model(layers=3)).nodes)) is None


def test_a_head_that_reads_two_of_the_body_s_activations_is_not_cut():
    """The head's product and, after it, an add of another activation of the body (the pooled features flattened
    again): two activations cross the cut, not a classifier's head.  One activation read twice is (the add of the
    product's own input)."""
    import onnx

    from parastream.core.blocks import head_start

    def with_skip(source: str) -> onnx.ModelProto:
        m = classifier_cnn_model(classes=8)
        g = m.graph
        if source == "flat2":
            g.node.append(onnx.helper.make_node("Flatten", ["pool"], ["flat2"], name="flatten2"))
        g.node.append(onnx.helper.make_node("Add", ["logits", source], ["both"], name="skip"))
        g.output[0].name = "both"
        return m

    assert head_start(list(gs_graph(with_skip("flat2")).nodes)) is None
    assert head_start(list(gs_graph(with_skip("flat")).nodes)) is not None


def test_split_schedule_cuts_the_head_only_when_asked():
    g = gs_graph(classifier_cnn_model())
    sched = schedule_graph(g, 1, lambda n: 1e-6, lambda n: False)
    assert split_schedule(sched, g.nodes) is sched  # nothing repeats: one engine
    split = split_schedule(sched, g.nodes, head=True)
    assert len(split.branches) == 2 and split.branch_preds == [[], [0]]
    assert split.branches[1] == ["fc"] and [n for b in split.branches for n in b] == sched.branches[0]
    assert sum(split.branch_time) == pytest.approx(sched.makespan)
    # cut into repeated blocks too: the head after the last of them
    stack = gs_graph(residual_stack_model(layers=5))
    one = schedule_graph(stack, 1, lambda n: 1e-6, lambda n: False)
    assert split_schedule(one, stack.nodes, head=True).branches == split_schedule(one, stack.nodes).branches


def test_a_build_with_the_head_an_engine_of_its_own_runs_and_verifies(tmp_path):
    """The body and the head, two engines on one stream, match ONNX Runtime on the original model; the plan's row
    says so, the option is recorded, and the "engine blocks" round would not race one engine for the whole
    model (the cut is for the rounds' compiles)."""
    import onnx

    from parastream.launcher.engines import BuildOptions
    from parastream.pipeline import build
    from parastream.pipeline.measure import Variant, blocks_not_raced, cut_at_head_only, races_whole_engine

    model = classifier_cnn_model()
    onnx.save(model, tmp_path / "cnn.onnx")
    bundle = build(tmp_path / "cnn.onnx", tmp_path / "out", backend="onnxruntime", engine_blocks="blocks",
                   head_engine=True, search=False, measure=False)
    assert len(bundle.plan.branches) == 2 and bundle.plan.num_streams == 1
    assert bundle.report["verification"]["passed"] and bundle.manifest["options"]["head_engine"] is True
    chosen = next(r for r in bundle.report["schedule"]["streams_tried"] if r.get("chosen"))
    assert chosen["engines_are"] == "the body and the head"
    x = np.random.default_rng(4).standard_normal((1, 3, 8, 8)).astype(np.float32)
    got = _run_bundle(tmp_path / "out", {"input": x})["logits"]
    np.testing.assert_allclose(got, ort_reference(model, {"input": x})["logits"], rtol=1e-5, atol=1e-5)
    g = gs_graph(model)
    import types

    plan = types.SimpleNamespace(num_streams=1, branches=[types.SimpleNamespace(nodes=b.nodes) for b in bundle.plan.branches])
    v = Variant(model, g, plan, BuildOptions())
    assert cut_at_head_only(v) and not races_whole_engine(v)
    assert blocks_not_raced(v)["not_raced"] == "cut before its head only (--head-engine)"
    # without the option: one engine
    plain = build(tmp_path / "cnn.onnx", tmp_path / "plain", backend="onnxruntime", engine_blocks="blocks",
                  search=False, measure=False)
    assert len(plain.plan.branches) == 1


@pytest.mark.gpu
def test_torch_engines_with_the_head_of_its_own_verify_on_the_gpu(tmp_path):
    """On the GPU (torch engines, fp16, the build's rounds timed): with ``--head-engine`` the classifier is two
    engines, compiled as built, that verify against ONNX Runtime and match it."""
    import onnx

    from parastream.pipeline import build

    model = classifier_cnn_model(channels=32, size=16, classes=64)
    onnx.save(model, tmp_path / "cnn.onnx")
    bundle = build(tmp_path / "cnn.onnx", tmp_path / "b", backend="torch", precision="fp16", search=False,
                   head_engine=True)
    assert bundle.report["verification"]["passed"] and len(bundle.plan.branches) == 2
    assert bundle.report["verification"]["engines_compiled_at_load"] == 0
    x = np.random.default_rng(6).standard_normal((1, 3, 16, 16)).astype(np.float32)
    got = _run_bundle(tmp_path / "b", {"input": x})["logits"]
    ref = ort_reference(model, {"input": x})["logits"]
    assert np.abs(got - ref).max() / np.abs(ref).max() < 2e-2


@pytest.mark.parametrize("option, value", [("fuse_gemm_epilogue", False), ("conv_kernels", "inductor"),
                                           ("fuse_conv_relu", False)])
def test_with_the_head_of_its_own_each_round_s_rival_changes_one_engine_s_cache_key(tmp_path, option, value):
    """Why the cut saves compiles: a compiled engine's cache key holds a fusion option only where the branch has
    nodes it converts.  With the head apart, the GEMM-epilogue round's rival changes the head's key alone and the
    conv rounds' rivals the body's alone (the other engine is found compiled); as one engine, every rival is a
    new key for the whole model."""
    import dataclasses

    import onnx

    pytest.importorskip("torch")
    from parastream.launcher.engines import BuildOptions
    from parastream.launcher.engines import torch as tb
    from parastream.pipeline import build
    from parastream.pipeline.build import branches_of

    model = classifier_cnn_model(channels=16, size=8, depthwise=True)
    onnx.save(model, tmp_path / "cnn.onnx")
    keys = {}
    for head in (True, False):
        b = build(tmp_path / "cnn.onnx", tmp_path / f"out{head}", backend="onnxruntime", engine_blocks="blocks",
                  head_engine=head, search=False, measure=False, verify=False)
        inferred = shape_inference.infer_shapes(model)  # (a build's branches carry their inferred shapes)
        branches = branches_of(inferred, gs_graph(model), b.plan)
        assert len(branches) == (2 if head else 1)
        base = BuildOptions(device="cuda", precision="fp16", conv_kernels="cudnn")
        for name, opts in (("input", base), ("rival", dataclasses.replace(base, **{option: value}))):
            keys[head, name] = [tb.cache_key(br, [], "float16", opts, opts.fuse_conv_relu, {"device": "cuda"},
                                             artifact="inductor") for br in branches]
    changed = [a != b for a, b in zip(keys[True, "input"], keys[True, "rival"])]
    assert changed == ([False, True] if option == "fuse_gemm_epilogue" else [True, False])  # one engine of two
    assert keys[False, "input"] != keys[False, "rival"]  # as one engine: the whole model compiled again
