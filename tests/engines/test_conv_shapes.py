"""The conv+ReLU fusion chosen per convolution shape: a GPU build times each shape the fusion takes alone
(``pipeline.measure.time_conv_shapes``), and the shapes cuDNN's fused call runs slower are left to Inductor's form
(``BuildOptions.conv_relu_unfused``), in the converter, the engines' cache keys and what a load asks of them.

On the CPU the fused kernels are replaced by their definitions (test_conv_relu_fusion.py's fixtures) and the
timing by a table; on the GPU (marked) the timing itself runs."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from parastream.launcher.engines.base import BuildOptions  # noqa: E402
from parastream.launcher.engines.cudnn_fused import conv_key, fused_conv_keys, parse_key  # noqa: E402
from parastream.launcher.engines.onnx_torch import convert  # noqa: E402

from test_conv_relu_fusion import (_feeds, _ort, _rel, _residual_feeds, conv_relu_model, reference_add_relu,  # noqa: E402,F401
                                   reference_kernel, residual_model)


def test_fused_conv_keys_are_the_convolutions_the_converter_fuses():
    keys = fused_conv_keys(conv_relu_model())
    # conv_a (groups 2, stride 2) and conv_b (dilation 2); not conv_c (read twice), conv_d (asymmetric pads),
    # conv_e (a graph output), conv_f (Tanh) or the 1-d one
    assert keys == {conv_key("relu", [1, 4, 12, 12], [8, 2, 3, 3], [2, 2], [1, 1], [1, 1], 2): 1,
                    conv_key("relu", [1, 8, 6, 6], [8, 8, 3, 3], [1, 1], [2, 2], [2, 2], 1): 1}
    residual = fused_conv_keys(residual_model())
    # conv_a, conv_b, and both convs of the projection shortcut (either may be the one fused) with their ReLU;
    # conv_d (its sum read twice) and conv_e (a Tanh after the sum) as conv + add plans, the ReLU or Tanh apart
    kinds = {kind: sum(n for k, n in residual.items() if k.startswith(kind + "|")) for kind in ("add_relu", "add")}
    assert kinds == {"add_relu": 4, "add": 2} and sum(residual.values()) == 6
    kind, x, w, s, p, d, g = parse_key(next(iter(keys)))
    assert kind == "relu" and x == [4, 12, 12] and w == [8, 2, 3, 3] and (s, p, d, g) == ([2, 2], [1, 1], [1, 1], 2)


def _depthwise_model(residual: bool = False):
    """x -> depthwise 3x3 Conv (with a bias) -> ReLU; with ``residual``, the conv's output plus x, then the ReLU."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(3)
    w = numpy_helper.from_array(rng.standard_normal((4, 1, 3, 3)).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.standard_normal(4).astype(np.float32), "b")
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["y"], group=4, pads=[1, 1, 1, 1])]
    if residual:
        nodes.append(helper.make_node("Add", ["y", "x"], ["s"]))
    nodes.append(helper.make_node("Relu", ["s" if residual else "y"], ["r"]))
    g = helper.make_graph(nodes, "dw", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8, 8])],
                          [helper.make_tensor_value_info("r", TensorProto.FLOAT, [1, 4, 8, 8])], [w, b])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_a_depthwise_convolution_and_its_relu_are_a_shape_to_time_and_its_residual_form_is_not():
    from parastream.launcher.engines.cudnn_fused import is_depthwise_key

    keys = fused_conv_keys(_depthwise_model())
    assert keys == {conv_key("relu", [1, 4, 8, 8], [4, 1, 3, 3], [1, 1], [1, 1], [1, 1], 4): 1}
    assert is_depthwise_key(next(iter(keys)))
    assert not any(is_depthwise_key(k) for k in fused_conv_keys(conv_relu_model()))  # (groups 2 of 4: grouped)
    assert fused_conv_keys(_depthwise_model(residual=True)) == {}


def test_depthwise_shapes_are_timed_unless_the_build_asks_for_another_form_than_cudnn(monkeypatch):
    from parastream.pipeline import measure

    asked = []
    monkeypatch.setattr(measure, "time_conv_shape", lambda key, batch, dtype, planned=True: asked.append(key) or (1.0, 2.0))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    key = next(iter(fused_conv_keys(_depthwise_model())))
    for kernels, timed in (("auto", [key]), ("cudnn", [key]), ("inductor", []), ("native", [])):
        asked.clear()
        res = measure.time_conv_shapes(_depthwise_model(), BuildOptions(precision="fp16", conv_kernels=kernels), lock=False)
        assert asked == timed and (res is None) == (not timed), kernels


def test_a_depthwise_shape_listed_unfused_keeps_its_relu_apart_and_the_function_is_the_same(reference_kernel):
    model = _depthwise_model()
    key = next(iter(fused_conv_keys(model)))
    feeds = {"x": np.random.default_rng(4).standard_normal((1, 4, 8, 8)).astype(np.float32)}
    ref = _ort(model, feeds)["r"]
    for unfused, fused in (([], 1), ([key], 0)):
        module = convert(model, fuse_conv_relu=True, conv_relu_unfused=unfused)
        assert module.fused_conv_relu == fused
        with torch.no_grad():
            (out,) = module(torch.from_numpy(feeds["x"]))
        assert _rel(out.numpy(), ref) <= 1e-5


@pytest.mark.parametrize("model_of,feeds_of", [(conv_relu_model, _feeds), (residual_model, _residual_feeds)])
def test_a_shape_listed_unfused_stays_two_steps_and_the_function_is_the_same(reference_add_relu, model_of, feeds_of):
    model = model_of()
    keys = sorted(fused_conv_keys(model))
    every = convert(model, fuse_conv_relu=True)
    total = every.fused_conv_relu + every.fused_conv_add_relu
    one = convert(model, fuse_conv_relu=True, conv_relu_unfused=[keys[0]])
    left = one.fused_conv_relu + one.fused_conv_add_relu
    # conv_relu_model's shapes are one convolution each; residual_model's first key is three convolutions
    # (conv_a and the projection shortcut's two, of which one fuses), its other conv_b
    assert left == (total - 1 if model_of is conv_relu_model else total - 2)
    none = convert(model, fuse_conv_relu=True, conv_relu_unfused=keys)
    assert none.fused_conv_relu + none.fused_conv_add_relu == 0
    feeds = feeds_of(4)
    ref = _ort(model, feeds)
    for module in (one, none):
        with torch.no_grad():
            outs = module(*[torch.from_numpy(feeds[n]) for n in module.input_names])
        for (name, _, _), out in zip(module.output_specs, outs):
            assert _rel(out.numpy(), ref[name]) <= 1e-5, name


def test_the_list_changes_the_cache_key_of_a_branch_that_has_the_shape_only():
    from parastream.launcher.engines.torch import code_choices

    model, other = conv_relu_model(), residual_model()
    listed = sorted(fused_conv_keys(model))[:1]
    plain, with_list = BuildOptions(), BuildOptions(conv_relu_unfused=listed)
    built = {"device": "cuda"}
    for branch, changes in ((model, True), (other, False)):
        a = code_choices(branch, [], "float16", plain, True, built, "inductor")
        b = code_choices(branch, [], "float16", with_list, True, built, "inductor")
        assert (a != b) == changes
        if changes:
            assert json.loads(b)["conv_relu_unfused"] == listed
    # with the fusion off the list changes nothing
    assert (code_choices(model, [], "float16", plain, False, built, "inductor")
            == code_choices(model, [], "float16", with_list, False, built, "inductor"))


def test_a_load_refuses_an_artifact_compiled_with_a_shape_unfused_that_it_does_not_list():
    from parastream.launcher.engines.torch import _compile_at_load_reason

    key = sorted(fused_conv_keys(conv_relu_model()))[0]
    meta = {"signature": [], "dtype": "float16", "fuse_conv_relu": True, "conv_relu_unfused": [key]}
    kw = dict(elsewhere=False, signature=[], dtype="float16", fuse_conv_relu=True)
    assert _compile_at_load_reason(b"x", meta, options=BuildOptions(conv_relu_unfused=[key]), **kw) == ""
    assert "unfused" in _compile_at_load_reason(b"x", meta, options=BuildOptions(), **kw)
    # an artifact compiled before the list existed loads with an empty one
    old = {k: v for k, v in meta.items() if k != "conv_relu_unfused"}
    assert _compile_at_load_reason(b"x", old, options=BuildOptions(), **kw) == ""


def test_shapes_slower_fused_by_more_than_the_margin_are_listed(monkeypatch):
    from parastream.pipeline import measure

    model = conv_relu_model()
    keys = sorted(fused_conv_keys(model))
    table = {keys[0]: (10.0, 8.0), keys[1]: (10.0, 9.7)}  # slower by 25%; slower within the 5% margin
    asked = []

    def timed(key, batch, dtype, reps=10, replays=20, planned=True):
        asked.append((key, batch, dtype, planned))
        return table.get(key, (1.0, 2.0))

    monkeypatch.setattr(measure, "time_conv_shape", timed)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    res = measure.time_conv_shapes(model, BuildOptions(precision="fp16"), lock=False)
    assert res["unfused"] == [keys[0]]
    assert res["shapes"] == len(keys) == res["timed"]
    assert res["us"][keys[0]] == [10.0, 8.0]
    assert {a[1] for a in asked} == {1} and {a[2] for a in asked} == {torch.float16} and {a[3] for a in asked} == {True}
    asked.clear()  # the plans' option reaches the timing (without it a depthwise shape is torch's fused call)
    measure.time_conv_shapes(model, BuildOptions(precision="fp16", cudnn_plans=False), lock=False)
    assert {a[3] for a in asked} == {False}
    assert measure.time_conv_shapes(model, BuildOptions(precision="bf16"), lock=False) is None  # not fused in bf16
    faster = measure.time_conv_shapes(residual_model(), BuildOptions(precision="fp32"), lock=False)  # (1 < 2 µs)
    assert faster["unfused"] == [] and faster["timed"] == 2
    monkeypatch.setattr(measure, "CONV_SHAPES_SECONDS", 0.0)  # the budget spent: no shape started after it
    assert measure.time_conv_shapes(model, BuildOptions(precision="fp16"), lock=False)["timed"] == 0


def test_a_build_times_the_shapes_first_and_compiles_with_the_list(monkeypatch):
    """The build step sets the option before the search (so every engine is compiled with it), records what it
    timed in report.json, and a rebuild from the record takes the list without timing."""
    import importlib

    from parastream.pipeline import measure

    build_mod = importlib.import_module("parastream.pipeline.build")  # (the package's ``build`` is the function)
    key = sorted(fused_conv_keys(conv_relu_model()))[0]
    calls = []

    def timed(model, options, lock=True):
        calls.append(options.precision)
        return {"shapes": 2, "timed": 2, "unfused": [key], "us": {key: [3.0, 2.0]}, "s": 0.1}

    monkeypatch.setattr(measure, "time_conv_shapes", timed)
    monkeypatch.setattr(build_mod, "gpu_present", lambda backend: True)

    def fake_build(recorded=None, measure_on=True, fuse=True):
        return fake_conv_build(conv_relu_model(), BuildOptions(precision="fp16", fuse_conv_relu=fuse), recorded,
                               measure_on)

    b = fake_build()
    build_mod.time_fused_conv_shapes(b)
    assert b.options.conv_relu_unfused == [key] and b.conv_shapes["unfused"] == [key] and b.timed_here
    assert "conv_shapes" in b.timings and calls == ["fp16"]
    again = fake_build(recorded={"conv_shapes": b.conv_shapes})
    build_mod.time_fused_conv_shapes(again)
    assert again.options.conv_relu_unfused == [key] and calls == ["fp16"]  # taken, not timed
    assert not again.engines.decided_first  # a shape listed: the round is the whole plan's
    broken = fake_build(recorded={"conv_shapes": {"unfused": "not a list"}})
    build_mod.time_fused_conv_shapes(broken)
    assert broken.options.conv_relu_unfused == [key] and calls == ["fp16", "fp16"]  # a bad record: timed again
    for off in (fake_build(measure_on=False), fake_build(fuse=False)):
        build_mod.time_fused_conv_shapes(off)
        assert off.options.conv_relu_unfused == [] and off.conv_shapes is None


def _shapes(us: dict, counts: dict, **extra) -> dict:
    """A ``time_conv_shapes`` result: every shape timed, none listed unless ``extra`` says so."""
    return {"shapes": len(us), "timed": len(us), "unfused": [], "us": us, "counts": counts, "s": 0.1, **extra}


def test_shapes_all_faster_fused_by_the_margin_decide_the_round_and_others_leave_it_to_the_whole_plan():
    from parastream.pipeline import measure

    # weighted by how often the model has each shape: 3 x (6 against 8) + 1 x (10 against 12) = 28 against 36 µs
    got = measure.conv_relu_decided_on_shapes(_shapes({"a": [6.0, 8.0], "b": [10.0, 12.0]}, {"a": 3, "b": 1}))
    assert got["choice"] == "conv+ReLU" and got["won"] == measure.round_labels("conv+ReLU", None)[0]
    assert got["decided_on_shapes"] == {"shapes": 2, "convolutions": 4, "fused_us": 28.0, "unfused_us": 36.0,
                                        "saves": round(1 - 28 / 36, 4)}
    assert "not compiled" in got["timed"]
    # just under the margin, the whole plan's to decide
    near = 1 - measure.CONV_SHAPES_DECIDE_BEYOND + 0.01
    assert measure.conv_relu_decided_on_shapes(_shapes({"a": [near, 1.0]}, {"a": 5})) is None
    for undecided in (
            _shapes({"a": [6.0, 8.0], "b": [9.0, 8.0]}, {"a": 1, "b": 1}, unfused=["b"]),  # the shapes disagree
            dict(_shapes({"a": [6.0, 8.0]}, {"a": 1}), shapes=2),  # not every shape timed (the 5 s budget)
            {k: v for k, v in _shapes({"a": [6.0, 8.0]}, {"a": 1}).items() if k != "counts"},  # an older record
            _shapes({"a": ["x", 8.0]}, {"a": 1}),  # a malformed record
            _shapes({"a": [6.0]}, {"a": 1}),
            {"error": "RuntimeError: no GPU"}, None):
        assert measure.conv_relu_decided_on_shapes(undecided) is None, undecided


def test_the_build_step_decides_the_round_on_shapes_all_faster_fused_and_a_rebuild_does_from_its_record(monkeypatch):
    import importlib

    from parastream.pipeline import measure

    build_mod = importlib.import_module("parastream.pipeline.build")
    keys = sorted(fused_conv_keys(conv_relu_model()))
    result = _shapes({keys[0]: [6.0, 9.0], keys[1]: [4.0, 5.0]}, {keys[0]: 1, keys[1]: 1})
    monkeypatch.setattr(measure, "time_conv_shapes", lambda model, options, lock=True: dict(result))
    monkeypatch.setattr(build_mod, "gpu_present", lambda backend: True)

    def fake_build(recorded=None):
        return fake_conv_build(conv_relu_model(), BuildOptions(precision="fp16"), recorded)

    b = fake_build()
    build_mod.time_fused_conv_shapes(b)
    assert b.engines.decided_first["conv+ReLU"]["decided_on_shapes"]["saves"] == round(1 - 10 / 14, 4)
    assert b.conv_shapes["decides_round"] and b.options.conv_relu_unfused == []
    again = fake_build(recorded={"conv_shapes": b.conv_shapes})  # report.json's record, as a rebuild reads it
    build_mod.time_fused_conv_shapes(again)
    assert again.engines.decided_first == b.engines.decided_first and "conv_shapes" not in again.timings


def test_a_round_decided_on_its_shapes_compiles_no_rival_and_is_taken_as_timed(tmp_path, monkeypatch):
    """The build's step puts the round in the engines' ``decided_first``: ``alternative_variants`` (what the
    search, the engines stage and the speculative queue compile) leaves its rival out, and ``time_alternatives``
    takes the round as decided without loading any rival; without it, the rival is there and raced."""
    import onnx

    import parastream.launcher as launcher_pkg
    import parastream.launcher.gpu as gpu_mod
    from parastream.launcher.engines import torch as torch_backend
    from parastream.pipeline import measure
    from parastream.pipeline.build import Engines
    from parastream.pipeline.model_io import load_model
    from parastream.rewrite.cost import RooflineCostModel

    path = tmp_path / "conv_relu.onnx"
    onnx.save(conv_relu_model(), path)
    loaded = load_model(path)
    engines = Engines(torch_backend, RooflineCostModel(), loaded, "fp16")
    options = BuildOptions(precision="fp16", device="cuda", conv_kernels="cudnn")
    plan = engines.plan(loaded.graph, 1, 1)
    v = measure.Variant(loaded.model, loaded.graph, plan, options)
    assert "conv+ReLU" in [what for what, _ in measure.alternative_variants(engines, v)]
    r = measure.conv_relu_decided_on_shapes(_shapes({"a": [6.0, 8.0]}, {"a": 2}))
    engines.decided_first["conv+ReLU"] = r
    assert "conv+ReLU" not in [what for what, _ in measure.alternative_variants(engines, v)]
    assert all(what != "conv+ReLU" for what, _ in measure.speculative_by_round(engines, v))

    class _Launcher:
        def close(self):
            pass

    loaded_rivals = []
    monkeypatch.setattr(launcher_pkg, "cuda_device_count", lambda: 1)
    monkeypatch.setattr(gpu_mod, "GpuLauncher", lambda bundle, **kw: _Launcher())
    monkeypatch.setattr(engines, "launcher", lambda var: loaded_rivals.append(var) or _Launcher())
    got = measure.time_alternatives(engines, "bundle", v, runs=5)
    (rnd,) = [x for x in got["rounds"] if x["choice"] == "conv+ReLU"]
    assert rnd["decided_on_shapes"]["saves"] == r["decided_on_shapes"]["saves"] and got["fuse_conv_relu"]
    assert not loaded_rivals  # nothing raced, nothing loaded for the round


def fake_conv_build(model, options: BuildOptions, recorded=None, measure_on: bool = True):
    """What ``pipeline.build.time_fused_conv_shapes`` reads of a build: a GPU backend that fuses conv+ReLU, ``model``,
    ``options``, report.json's ``recorded`` timings, and the stages it times (into ``timings``)."""
    from types import SimpleNamespace

    b = SimpleNamespace(cfg=SimpleNamespace(measure=measure_on), backend=SimpleNamespace(gpu=True, fuses_conv_relu=True),
                        options=options, recorded=recorded, conv_shapes=None, timed_here=False, model=model,
                        timings={}, engines=SimpleNamespace(decided_first={}))
    b.timed = lambda stage: _timed(b, stage)
    return b


class _timed:
    def __init__(self, b, stage):
        self.b, self.stage = b, stage

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.b.timings[self.stage] = 0.0
        return False


@pytest.mark.gpu
def test_the_shapes_are_timed_on_the_gpu():
    """Both forms of each shape run and are timed (positive microseconds), in fp16, for a plain and a residual
    fusion and a depthwise one (its plan with and without the ReLU); the residual model's conv + add shape (two
    convolutions), a cuDNN plan, is counted apart and not timed alone."""
    from parastream.launcher.engines.cudnn_fused import PLANNED_KINDS
    from parastream.pipeline.measure import time_conv_shapes

    for model, plans in ((conv_relu_model(), 0), (residual_model(), 1), (_depthwise_model(), 0)):
        res = time_conv_shapes(model, BuildOptions(precision="fp16"), lock=False)
        keys = fused_conv_keys(model)
        planned = [k for k in keys if parse_key(k)[0] in PLANNED_KINDS]
        assert res["timed"] == res["shapes"] == len(keys) - len(planned)
        assert res.get("plan_shapes", 0) == len(planned) == plans
        assert all(f > 0 and u > 0 for f, u in res["us"].values())
        assert set(res["unfused"]) <= set(res["us"])


def test_a_manifest_whose_unfused_list_is_not_one_is_refused_in_one_line(tmp_path):
    from parastream.launcher.bundle import Bundle
    from parastream.launcher.errors import ParastreamError

    for bad in (5, "relu|1", [1, 2]):
        bundle = Bundle.__new__(Bundle)
        bundle.path, bundle.manifest = tmp_path, {"options": {"conv_relu_unfused": bad}}
        bundle.plan = type("P", (), {"precision": "fp16"})()
        with pytest.raises(ParastreamError, match=r"manifest\.json: options\.conv_relu_unfused is not a list"):
            bundle.engine_options("cuda")
    bundle.manifest = {"options": {"conv_relu_unfused": ["relu|4,12,12|8,2,3,3|2,2|1,1|1,1|2"]}}
    assert bundle.engine_options("cuda").conv_relu_unfused == ["relu|4,12,12|8,2,3,3|2,2|1,1|1,1|2"]
    bundle.manifest = {"options": {}}  # a bundle built before the option: none unfused
    assert bundle.engine_options("cuda").conv_relu_unfused == []
