"""Repeated blocks of a one-stream plan (core/blocks.py) and the build's one engine per block (--engine-blocks)."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs
import pytest
from graphs import ort_reference, residual_stack_model, three_branch_model
from onnx import shape_inference

from parastream.core.blocks import node_tokens, repeated_blocks, split_schedule
from parastream.core.schedule import schedule_graph


def gs_graph(model):
    g = gs.import_onnx(shape_inference.infer_shapes(model))
    g.toposort()
    return g


def _ops(nodes, run):
    return [nodes[i].op for i in range(*run)]


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
    multi = schedule_graph(gs_graph(three_branch_model()), 3, lambda n: 1e-6, lambda n: False)
    assert split_schedule(multi, gs_graph(three_branch_model()).nodes) is multi  # only one-stream plans are cut


@pytest.mark.parametrize("engine_blocks, engines", [("blocks", 5), ("whole", 1)])
def test_a_build_with_one_engine_per_block_runs_and_verifies(tmp_path, engine_blocks, engines):
    from parastream.launcher import load
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
    la = load(tmp_path / "out")
    try:
        got = la({"x": x})["y"]
    finally:
        la.close()
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
