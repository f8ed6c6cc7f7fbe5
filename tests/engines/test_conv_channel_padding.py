"""A dense Conv -> Relu whose channels are not a multiple of 8 run on its channels padded (``cudnn_fused.
padded_channels``): the build times the padded call per shape (``pipeline.measure.time_conv_shapes``) and lists the
shapes it runs faster for ``BuildOptions.conv_channels_padded``; the converter then pads the weights and the input
with zeros and takes the output's first channels, in the engines' cache keys and what a load asks of them.

On the CPU the fused kernel is replaced by its definition (test_conv_relu_fusion.py's fixture) and the timing by a
table; on the GPU (marked) the real cuDNN call is compared with ONNX Runtime and the timing runs."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

torch = pytest.importorskip("torch")

from parastream.launcher.engines.base import BuildOptions  # noqa: E402
from parastream.launcher.engines.cudnn_fused import conv_key, fused_conv_keys, padded_channels  # noqa: E402
from parastream.launcher.engines.onnx_torch import convert, to_fx  # noqa: E402

from test_conv_relu_fusion import _ort, _rel, reference_kernel  # noqa: E402,F401
from test_conv_shapes import fake_conv_build  # noqa: E402


def res2net_like(seed: int = 0) -> onnx.ModelProto:
    """x [1, 26, 10, 10]: two 3x3 convolutions of 26 channels each read by a Relu, the second on the first's ReLU
    plus x (Res2Net's hierarchical split; the second without a bias), then a 1x1 convolution to 48 channels and
    its ReLU, and a 3x3 one from 48 to 32 channels (aligned: never padded)."""
    rng = np.random.default_rng(seed)

    def w(name, shape):
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.2).astype(np.float32), name)

    inits = [w("w1", (26, 26, 3, 3)), w("b1", (26,)), w("w2", (26, 26, 3, 3)), w("w3", (48, 26, 1, 1)),
             w("b3", (48,)), w("w4", (32, 48, 3, 3)), w("b4", (32,))]
    n = helper.make_node
    nodes = [n("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
             n("Relu", ["c1"], ["r1"], name="relu1"),
             n("Add", ["r1", "x"], ["s1"], name="add1"),
             n("Conv", ["s1", "w2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),  # no bias
             n("Relu", ["c2"], ["r2"], name="relu2"),
             n("Conv", ["r2", "w3", "b3"], ["c3"], name="conv3"),
             n("Relu", ["c3"], ["r3"], name="relu3"),
             n("Conv", ["r3", "w4", "b4"], ["c4"], name="conv4", pads=[1, 1, 1, 1], strides=[2, 2]),
             n("Relu", ["c4"], ["r4"], name="relu4")]
    g = helper.make_graph(nodes, "res2net_like", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 26, 10, 10])],
                          [helper.make_tensor_value_info("r4", TensorProto.FLOAT, [1, 32, 5, 5]),
                           helper.make_tensor_value_info("r1", TensorProto.FLOAT, [1, 26, 10, 10])], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8  # (what every onnxruntime here reads: the device's refuses a newer onnx's default)
    return model


def _keys(model) -> dict[str, str]:
    """Each Conv's ``relu`` key, by the Conv's name."""
    keys = fused_conv_keys(model)
    return {"conv1": next(k for k in keys if "|26,10,10|26,26,3,3|" in k),
            "conv3": next(k for k in keys if "|26,10,10|48,26,1,1|" in k),
            "conv4": next(k for k in keys if "|48,10,10|32,48,3,3|" in k)}


def test_padded_channels_are_dense_relu_shapes_rounded_up_to_a_multiple_of_8():
    dense = conv_key("relu", [1, 26, 56, 56], [26, 26, 3, 3], [1, 1], [1, 1], [1, 1], 1)
    assert padded_channels(dense) == (32, 32)
    assert padded_channels(conv_key("relu", [1, 52, 28, 28], [52, 52, 3, 3], [1, 1], [1, 1], [1, 1], 1)) == (56, 56)
    assert padded_channels(conv_key("relu", [1, 24, 28, 28], [58, 24, 1, 1], [1, 1], [0, 0], [1, 1], 1)) == (24, 64)
    assert padded_channels(conv_key("relu", [1, 3, 224, 224], [64, 3, 7, 7], [2, 2], [3, 3], [1, 1], 1)) == (8, 64)
    # aligned, grouped or depthwise, or a residual fusion: not padded
    for key in (conv_key("relu", [1, 64, 56, 56], [104, 64, 1, 1], [1, 1], [0, 0], [1, 1], 1),
                conv_key("relu", [1, 26, 56, 56], [26, 1, 3, 3], [1, 1], [1, 1], [1, 1], 26),
                conv_key("relu", [1, 52, 56, 56], [52, 26, 3, 3], [1, 1], [1, 1], [1, 1], 2),
                conv_key("add_relu", [1, 26, 56, 56], [26, 26, 3, 3], [1, 1], [1, 1], [1, 1], 1)):
        assert padded_channels(key) is None, key


def _run(module, x, traced=False):
    fn = to_fx(module) if traced else module
    with torch.no_grad():
        return [o.numpy() for o in fn(torch.from_numpy(x))]


@pytest.mark.parametrize("traced", [False, True])
def test_listed_convolutions_run_padded_and_compute_what_onnxruntime_does(reference_kernel, traced):
    model = res2net_like()
    keys = _keys(model)
    x = np.random.default_rng(1).standard_normal((1, 26, 10, 10)).astype(np.float32)
    ref = _ort(model, {"x": x})
    listed = [keys["conv1"], keys["conv3"]]  # conv1's key is conv2's too: both 26 -> 26 at 10x10
    module = convert(model, fuse_conv_relu=True, conv_channels_padded=listed)
    assert module.fused_conv_relu == 4 and module.padded_conv_relu == 3
    got = _run(module, x, traced)
    for (name, _, _), out in zip(module.output_specs, got):
        assert out.shape == ref[name].shape and _rel(out, ref[name]) <= 1e-5, name
    # the weights are stored padded: conv1's and conv2's [32, 32], conv3's [48, 32]; conv4's as it was; the
    # biases of conv1 [32] and conv3 [48] (conv2 has none)
    assert sorted(tuple(t.shape) for t in module.buffers() if t.dim() == 4) == [
        (32, 32, 3, 3), (32, 32, 3, 3), (32, 48, 3, 3), (48, 32, 1, 1)]
    assert sorted(tuple(t.shape) for t in module.buffers() if t.dim() == 1) == [(32,), (32,), (48,)]
    assert len(reference_kernel) >= 4 and all(c["channels_last_weight"] for c in reference_kernel)


def test_a_convolution_not_listed_or_aligned_is_not_padded(reference_kernel):
    model = res2net_like()
    keys = _keys(model)
    x = np.random.default_rng(2).standard_normal((1, 26, 10, 10)).astype(np.float32)
    ref = _ort(model, {"x": x})
    plain = convert(model, fuse_conv_relu=True)
    assert plain.fused_conv_relu == 4 and plain.padded_conv_relu == 0
    # an aligned shape listed (no build lists one: padded_channels says None) changes nothing
    aligned = convert(model, fuse_conv_relu=True, conv_channels_padded=[keys["conv4"]])
    assert aligned.padded_conv_relu == 0
    # with the fusion off the list does nothing either
    off = convert(model, conv_channels_padded=[keys["conv1"]])
    assert off.fused_conv_relu == 0 and off.padded_conv_relu == 0
    # a shape both left unfused and listed padded stays unfused (the build never lists both)
    both = convert(model, fuse_conv_relu=True, conv_relu_unfused=[keys["conv1"]], conv_channels_padded=[keys["conv1"]])
    assert both.padded_conv_relu == 0 and both.fused_conv_relu == 2
    for module in (plain, aligned, off, both):
        for (name, _, _), out in zip(module.output_specs, _run(module, x)):
            assert _rel(out, ref[name]) <= 1e-5, name
    weights = {tuple(t.shape) for t in plain.buffers()}
    assert (26, 26, 3, 3) in weights and (32, 32, 3, 3) not in weights


def test_a_weight_another_convolution_reads_is_padded_into_a_copy(reference_kernel):
    """conv1's weight also feeds conv2 (a shared initializer) at another input size: conv1's key listed, conv2's
    not; conv2 keeps the weight as it was."""
    model = res2net_like()
    conv2 = next(n for n in model.graph.node if n.name == "conv2")
    conv2.input[1] = "w1"
    # conv2 reads the ReLU at 10x10 as conv1 does: same key; make it another by a stride
    conv2.attribute.append(helper.make_attribute("strides", [2, 2]))
    model.graph.ClearField("value_info")
    del model.graph.node[5:]  # up to relu2 only
    model.graph.ClearField("output")
    model.graph.output.extend([helper.make_tensor_value_info("r2", TensorProto.FLOAT, [1, 26, 5, 5])])
    keys = fused_conv_keys(model)
    key1 = next(k for k in keys if "|26,10,10|26,26,3,3|1,1|" in k)
    assert len(keys) == 2
    x = np.random.default_rng(3).standard_normal((1, 26, 10, 10)).astype(np.float32)
    ref = _ort(model, {"x": x})
    module = convert(model, fuse_conv_relu=True, conv_channels_padded=[key1])
    assert module.padded_conv_relu == 1
    weights = sorted(tuple(t.shape) for t in module.buffers() if t.dim() == 4)
    assert weights == [(26, 26, 3, 3), (32, 32, 3, 3)]
    (out,) = _run(module, x)
    assert _rel(out, ref["r2"]) <= 1e-5


def test_shapes_faster_padded_by_the_margin_are_listed_padded_and_not_unfused(monkeypatch):
    from parastream.pipeline import measure

    model = res2net_like()
    keys = _keys(model)
    table = {keys["conv1"]: (15.5, 14.6, 4.7),  # slower fused, far faster padded: padded, not unfused
             keys["conv3"]: (3.0, 4.5, 2.9),  # padded within the margin of fused: fused as it is
             keys["conv4"]: (6.0, 8.0)}  # aligned: two forms only
    asked = []

    def timed(key, batch, dtype, reps=10, replays=20, planned=True):
        asked.append(key)
        return table[key]

    monkeypatch.setattr(measure, "time_conv_shape", timed)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    res = measure.time_conv_shapes(model, BuildOptions(precision="fp16"), lock=False)
    assert sorted(asked) == sorted(table)
    assert res["padded"] == [keys["conv1"]] and res["unfused"] == []
    assert res["us"][keys["conv1"]] == [15.5, 14.6, 4.7] and res["us"][keys["conv4"]] == [6.0, 8.0]
    # without the padded form it would have been left unfused
    table[keys["conv1"]] = (15.5, 14.6, 14.0)
    res = measure.time_conv_shapes(model, BuildOptions(precision="fp16"), lock=False)
    assert res["unfused"] == [keys["conv1"]] and "padded" not in res


def test_the_round_decided_on_shapes_counts_a_padded_shape_at_its_padded_time():
    from parastream.pipeline import measure

    shapes = {"shapes": 2, "timed": 2, "unfused": [], "padded": ["a"], "s": 0.1,
              "us": {"a": [15.0, 14.0, 5.0], "b": [6.0, 8.0]}, "counts": {"a": 2, "b": 1}}
    got = measure.conv_relu_decided_on_shapes(shapes)
    # fused: 2 x 5 + 6 = 16 against 2 x 14 + 8 = 36
    assert got["decided_on_shapes"]["fused_us"] == 16.0 and got["decided_on_shapes"]["unfused_us"] == 36.0
    assert measure.conv_relu_decided_on_shapes(dict(shapes, padded="a")) is None  # a malformed record


def test_a_build_lists_the_padded_shapes_and_a_rebuild_takes_them_from_its_record(monkeypatch):
    import importlib

    from parastream.pipeline import measure

    build_mod = importlib.import_module("parastream.pipeline.build")
    key = _keys(res2net_like())["conv1"]
    calls = []

    def timed(model, options, lock=True):
        calls.append(1)
        return {"shapes": 3, "timed": 3, "unfused": [], "padded": [key], "us": {key: [15.0, 14.0, 5.0]}, "s": 0.1}

    monkeypatch.setattr(measure, "time_conv_shapes", timed)
    monkeypatch.setattr(build_mod, "gpu_present", lambda backend: True)

    def fake_build(recorded=None):
        return fake_conv_build(res2net_like(), BuildOptions(precision="fp16"), recorded)

    b = fake_build()
    build_mod.time_fused_conv_shapes(b)
    assert b.options.conv_channels_padded == [key] and b.options.conv_relu_unfused == [] and calls == [1]
    again = fake_build(recorded={"conv_shapes": b.conv_shapes})
    build_mod.time_fused_conv_shapes(again)
    assert again.options.conv_channels_padded == [key] and calls == [1]  # taken, not timed
    broken = fake_build(recorded={"conv_shapes": {"unfused": [], "padded": "not a list"}})
    build_mod.time_fused_conv_shapes(broken)
    assert broken.options.conv_channels_padded == [key] and calls == [1, 1]  # a bad record: timed again
    # what the manifest records, and the launcher reads back
    assert build_mod._launcher_options(b.options)["conv_channels_padded"] == [key]


def test_the_list_changes_the_cache_key_of_a_branch_that_has_the_shape_and_a_load_asks_for_it():
    from parastream.launcher.engines.torch import _compile_at_load_reason, code_choices, converter_options

    model = res2net_like()
    key = _keys(model)["conv1"]
    from test_conv_relu_fusion import conv_relu_model

    plain, listed = BuildOptions(), BuildOptions(conv_channels_padded=[key])
    built = {"device": "cuda"}
    for branch, changes in ((model, True), (conv_relu_model(), False)):
        a = code_choices(branch, [], "float16", plain, True, built, "inductor")
        b = code_choices(branch, [], "float16", listed, True, built, "inductor")
        assert (a != b) == changes
        if changes:
            assert json.loads(b)["conv_channels_padded"] == [key]
    assert converter_options("cuda", "float16", listed)["conv_channels_padded"] == (key,)
    meta = {"signature": [], "dtype": "float16", "fuse_conv_relu": True, "conv_channels_padded": [key]}
    kw = dict(elsewhere=False, signature=[], dtype="float16", fuse_conv_relu=True)
    assert _compile_at_load_reason(b"x", meta, options=listed, **kw) == ""
    assert "padded" in _compile_at_load_reason(b"x", meta, options=plain, **kw)


def test_a_manifest_whose_padded_list_is_not_one_is_refused_in_one_line(tmp_path):
    from parastream.launcher.bundle import Bundle
    from parastream.launcher.errors import ParastreamError

    bundle = Bundle.__new__(Bundle)
    bundle.path, bundle.plan = tmp_path, type("P", (), {"precision": "fp16"})()
    for bad in (5, "relu|1", [1]):
        bundle.manifest = {"options": {"conv_channels_padded": bad}}
        with pytest.raises(ParastreamError, match=r"manifest\.json: options\.conv_channels_padded is not a list"):
            bundle.engine_options("cuda")
    key = "relu|26,56,56|26,26,3,3|1,1|1,1|1,1|1"
    bundle.manifest = {"options": {"conv_channels_padded": [key]}}
    assert bundle.engine_options("cuda").conv_channels_padded == [key]
    bundle.manifest = {"options": {}}  # a bundle built before the option: none padded
    assert bundle.engine_options("cuda").conv_channels_padded == []


@pytest.mark.gpu
def test_padded_convolutions_on_the_gpu_match_onnxruntime_and_are_timed():
    """The real cuDNN call on padded channels (fp16, channels-last) gives ONNX Runtime's outputs, and the build's
    timing times the padded form of a 26-channel shape (three positive times) and not of an aligned one."""
    from parastream.pipeline.measure import time_conv_shape

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model = res2net_like()
    keys = _keys(model)
    x = np.random.default_rng(5).standard_normal((1, 26, 10, 10)).astype(np.float32)
    ref = _ort(model, {"x": x})
    module = convert(model, "float16", fuse_conv_relu=True, conv_channels_padded=[keys["conv1"], keys["conv3"]])
    assert module.padded_conv_relu == 3
    module = module.to("cuda")
    with torch.no_grad():
        outs = module(torch.from_numpy(x).cuda().half())
    for (name, _, _), out in zip(module.output_specs, outs):
        assert _rel(out.float().cpu().numpy(), ref[name]) <= 2e-3, name
    three = time_conv_shape(keys["conv1"], 1, torch.float16)
    two = time_conv_shape(keys["conv4"], 1, torch.float16)
    assert len(three) == 3 and all(t > 0 for t in three) and len(two) == 2


def test_a_weight_the_graph_also_outputs_stays_as_it_is(reference_kernel):
    model = res2net_like()
    model.graph.output.extend([helper.make_tensor_value_info("w1", TensorProto.FLOAT, [26, 26, 3, 3])])
    key = _keys(model)["conv1"]
    x = np.random.default_rng(6).standard_normal((1, 26, 10, 10)).astype(np.float32)
    ref = _ort(model, {"x": x})
    module = convert(model, fuse_conv_relu=True, conv_channels_padded=[key])
    assert module.padded_conv_relu == 2
    for (name, _, _), out in zip(module.output_specs, _run(module, x)):
        assert out.shape == ref[name].shape and _rel(out, ref[name]) <= 1e-5, name
