"""Concat branches done in place by the GPU launcher: producers write their channel slice of the Concat's
output and the branch runs no kernel.  Which Concats qualify is decided on the plan (CPU tests); that
the outputs stay right with real engines is checked on the GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from parastream.launcher.plan import Branch, Plan, TensorSpec
from parastream.pipeline import build
from parastream.pipeline.zoo import write_all

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from graphs import nested_concat_model, ort_reference  # noqa: E402


def _four_d(plan: Plan) -> set[str]:
    return {n for n, s in plan.tensors.items() if len(s.shape) == 4}


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    folder = tmp_path_factory.mktemp("zoo")
    write_all(folder)
    return folder


@pytest.fixture(scope="module")
def nested(tmp_path_factory):
    p = tmp_path_factory.mktemp("nested") / "nested.onnx"
    m = nested_concat_model()
    m.ir_version = 8
    onnx.save(m, p)
    return p


def test_plan_marks_single_concat_branches(zoo, tmp_path):
    bundle = build(zoo / "small_net.onnx", tmp_path / "out", backend="onnxruntime", streams=4, search=False)
    plan = bundle.plan
    marked = {tuple(b.nodes) for b in plan.branches if b.concat_axis is not None}
    assert ("mixed_0/concat",) in marked and ("mixed_1/concat",) in marked
    for b in plan.branches:  # only a branch that is exactly one Concat is marked
        assert (b.concat_axis is not None) == (len(b.nodes) == 1 and b.nodes[0].endswith("concat"))
    alias, elided = plan.in_place_concats(plan.tensors, _four_d(plan))
    names = {plan.branches[i].nodes[0] for i in elided}
    assert {"mixed_0/concat", "mixed_1/concat"} <= names
    for i in elided:
        b = plan.branches[i]
        out = b.outputs[0]
        offsets = [alias[t] for t in b.inputs]
        assert all(root == out for root, _ in offsets)
        starts = [c0 for _, c0 in offsets]
        widths = [plan.tensors[t].shape[1] for t in b.inputs]
        assert starts == list(np.cumsum([0] + widths[:-1])) and sum(widths) == plan.tensors[out].shape[1]
    # the round trip through plan.json keeps the mark
    assert [b.concat_axis for b in Plan.from_json(plan.to_json()).branches] == [b.concat_axis for b in plan.branches]


def test_nested_concats_resolve_to_the_outer_buffer(nested, tmp_path):
    bundle = build(nested, tmp_path / "out", backend="onnxruntime", streams=3, search=False)
    plan = bundle.plan
    by_node = {b.nodes[0]: b for b in plan.branches if len(b.nodes) == 1}
    assert by_node["outer_concat"].concat_axis == 1  # axis -3 normalised
    alias, elided = plan.in_place_concats(plan.tensors, _four_d(plan))
    assert {by_node["inner_concat"].id, by_node["outer_concat"].id} == elided
    # outer = [r0 (4 ch) | inner = [r1 (6 ch) | r2 (2 ch)]]
    assert alias == {"r0": ("outer", 0), "inner": ("outer", 4), "r1": ("outer", 4), "r2": ("outer", 10)}


def _plan(concat_inputs, *, out_is_model_output=False, extra_reader=False, axis=1, shapes=None):
    shapes = shapes or {"a": [1, 2, 4, 4], "b": [1, 3, 4, 4]}
    specs = {n: TensorSpec(n, "float32", s) for n, s in shapes.items()}
    cat_c = sum(specs[t].shape[1] for t in concat_inputs)
    specs["x"] = TensorSpec("x", "float32", [1, 2, 4, 4])
    specs["cat"] = TensorSpec("cat", "float32", [1, cat_c, 4, 4])
    specs["y"] = TensorSpec("y", "float32", [1, cat_c, 4, 4])
    branches = [Branch(0, "branch_000", 0, ["pa"], ["x"], ["a"]),
                Branch(1, "branch_001", 1, ["pb"], ["x"], ["b"]),
                Branch(2, "branch_002", 0, ["concat"], list(concat_inputs), ["cat"], waits=[1], concat_axis=axis)]
    outputs = [specs["cat"]] if out_is_model_output else [specs["y"]]
    if not out_is_model_output:
        branches.append(Branch(3, "branch_003", 0, ["tail"], ["cat"], ["y"]))
    if extra_reader:
        specs["z"] = TensorSpec("z", "float32", [1, 2, 4, 4])
        branches.append(Branch(len(branches), f"branch_{len(branches):03d}", 1, ["other"], ["a"], ["z"], waits=[0]))
        outputs.append(specs["z"])
    plan = Plan("torch", "fp32", 2, [specs["x"]], outputs, specs, branches, list(range(len(branches))))
    plan.validate()
    return plan


def test_in_place_concat_fires_on_a_plain_join():
    plan = _plan(["a", "b"])
    alias, elided = plan.in_place_concats(plan.tensors, _four_d(plan))
    assert elided == {2} and alias == {"a": ("cat", 0), "b": ("cat", 2)}


@pytest.mark.parametrize("case", ["model_output", "other_reader", "axis", "not_channels_last", "spatial_mismatch", "dtype"])
def test_in_place_concat_does_not_fire(case):
    if case == "model_output":
        plan = _plan(["a", "b"], out_is_model_output=True)
    elif case == "other_reader":
        plan = _plan(["a", "b"], extra_reader=True)
    elif case == "axis":
        plan = _plan(["a", "b"], axis=2)
    elif case == "spatial_mismatch":
        plan = _plan(["a", "b"], shapes={"a": [1, 2, 4, 4], "b": [1, 3, 4, 5]})
    else:
        plan = _plan(["a", "b"])
    layout = dict(plan.tensors)
    nhwc = _four_d(plan)
    if case == "not_channels_last":
        nhwc.discard("b")
    if case == "dtype":
        layout["b"] = TensorSpec("b", "float16", layout["b"].shape)
    assert plan.in_place_concats(layout, nhwc) == ({}, set())


# -- GPU: real engines write their slices --------------------------------------------------------------
def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.mark.gpu
@pytest.mark.parametrize("model,precision,tol", [("small_net", "fp32", 1e-3), ("small_net", "fp16", 1e-2), ("nested", "fp32", 1e-3)])
def test_gpu_outputs_with_concats_in_place(zoo, nested, tmp_path, model, precision, tol):
    from parastream.launcher.gpu import GpuLauncher

    path = nested if model == "nested" else zoo / f"{model}.onnx"
    bundle = build(path, tmp_path / "out", backend="torch", precision=precision, streams=3 if model == "nested" else 4,
                   search=False, measure=False)
    onnx_model = onnx.load(path)
    rng = np.random.default_rng(7)
    with GpuLauncher(bundle) as la, GpuLauncher(bundle, concat_in_place=False) as plain:
        assert la.elided and not plain.elided
        if model == "nested":
            assert len(la.elided) == 2
        single = GpuLauncher(bundle, single_stream=True, engines=la.engines)
        for _ in range(2):
            feeds = {s.name: rng.standard_normal(s.shape).astype(s.dtype) for s in bundle.plan.inputs}
            ref = ort_reference(onnx_model, feeds)
            got, base, one = la(feeds), plain(feeds), single(feeds)
            for name in ref:
                assert _rel(got[name], ref[name]) <= tol, (name, _rel(got[name], ref[name]))
                assert _rel(got[name], base[name]) <= tol and _rel(one[name], got[name]) <= tol
        spans = la.run_timed(replays=2)
        assert len(spans) == len(bundle.plan.branches)
        single.close()
        with pytest.raises(Exception, match="memory layout"):
            GpuLauncher(bundle, concat_in_place=False, engines=la.engines)
