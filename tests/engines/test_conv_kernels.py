"""Depthwise convolutions written as ops Inductor compiles (``BuildOptions.conv_kernels="inductor"``).

Both lowered forms (up to 5x5 one reduction over the taps of the input's windows, which Inductor writes out as a
sum in the engines' configuration and runs as a loop otherwise; beyond, one over ``F.unfold``'s columns) against
ONNX Runtime (eager, and compiled by Inductor on the CPU both ways), and the convolutions that must stay torch's convolution (cuDNN on a
GPU): 1x1, dilated, channel-multiplier depthwise, grouped k x k, dense, 1-d.  Which one a convolution became is read from the converted module's steps.  On the GPU (marked) a
converted module is compiled and compared in fp16.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

torch = pytest.importorskip("torch")

from parastream.launcher.engines.onnx_torch import convert, has_depthwise_conv  # noqa: E402


def _w(rng, name, shape):
    return numpy_helper.from_array((rng.standard_normal(shape) * 0.3).astype(np.float32), name)


def conv_model(seed: int = 0) -> tuple[onnx.ModelProto, dict[str, bool]]:
    """Convolutions of every kind the lowering looks at, and for each whether it must be lowered."""
    rng = np.random.default_rng(seed)
    N = helper.make_node
    c = 8
    inits = [_w(rng, "dw3", (c, 1, 3, 3)), _w(rng, "b8", (c,)), _w(rng, "dw5", (c, 1, 5, 5)),
             _w(rng, "dw7", (c, 1, 7, 7)), _w(rng, "pw", (12, c, 1, 1)), _w(rng, "b12", (12,)),
             _w(rng, "gpw", (12, 4, 1, 1)), _w(rng, "dil", (c, 1, 3, 3)), _w(rng, "mult", (16, 1, 3, 3)),
             _w(rng, "gk", (c, 4, 3, 3)), _w(rng, "pwpad", (c, c, 1, 1)), _w(rng, "dense", (c, c, 3, 3)),
             _w(rng, "w1d", (c, 1, 3))]
    nodes = [
        N("Conv", ["x", "dw3", "b8"], ["dw3_o"], name="dw3_same", pads=[1, 1, 1, 1], group=c),
        N("Conv", ["x", "dw5"], ["dw5_o"], name="dw5_stride2_nobias", pads=[2, 2, 2, 2], strides=[2, 2], group=c),
        N("Conv", ["x", "dw7", "b8"], ["dw7_o"], name="dw7_asym", pads=[3, 2, 3, 4], group=c),
        N("Conv", ["x", "dw3"], ["dwsu_o"], name="dw3_same_upper_s2", auto_pad="SAME_UPPER", strides=[2, 2], group=c),
        N("Conv", ["x", "pw", "b12"], ["pw_o"], name="pw", group=1),
        N("Conv", ["x", "pw"], ["pws_o"], name="pw_stride2", strides=[2, 2]),
        N("Conv", ["x", "gpw", "b12"], ["gpw_o"], name="pw_groups2", group=2),
        # must stay torch's convolution
        N("Conv", ["x", "dil"], ["dil_o"], name="dw_dilated", pads=[2, 2, 2, 2], dilations=[2, 2], group=c),
        N("Conv", ["x", "mult"], ["mult_o"], name="dw_multiplier2", pads=[1, 1, 1, 1], group=c),
        N("Conv", ["x", "gk"], ["gk_o"], name="grouped_3x3", pads=[1, 1, 1, 1], group=2),
        N("Conv", ["x", "pwpad"], ["pwpad_o"], name="pw_padded", pads=[1, 1, 1, 1]),
        N("Conv", ["x", "dense"], ["dense_o"], name="dense_3x3", pads=[1, 1, 1, 1]),
        N("Conv", ["x1d", "w1d"], ["c1d_o"], name="dw_1d", pads=[1, 1], group=c),
    ]
    lowered = {"dw3_same": True, "dw5_stride2_nobias": True, "dw7_asym": True, "dw3_same_upper_s2": True,
               "pw": False, "pw_stride2": False, "pw_groups2": False, "dw_dilated": False, "dw_multiplier2": False,
               "grouped_3x3": False, "pw_padded": False, "dense_3x3": False, "dw_1d": False}
    outs = [n.output[0] for n in nodes]
    graph = helper.make_graph(nodes, "conv_kernels",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, c, 15, 13]),
                               helper.make_tensor_value_info("x1d", TensorProto.FLOAT, [2, c, 11])],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outs], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return onnx.shape_inference.infer_shapes(model), lowered


def dense_only(model: onnx.ModelProto) -> onnx.ModelProto:
    """``conv_model``'s dense 3x3 convolution alone: a branch without a depthwise convolution."""
    dense = onnx.ModelProto()
    dense.CopyFrom(model)
    nodes = [n for n in dense.graph.node if n.name == "dense_3x3"]
    del dense.graph.node[:]
    dense.graph.node.extend(nodes)
    del dense.graph.output[:]
    dense.graph.output.extend([helper.make_tensor_value_info("dense_o", TensorProto.FLOAT, [2, 8, 15, 13])])
    return dense


def _feeds(seed: int = 1):
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((2, 8, 15, 13)).astype(np.float32),
            "x1d": rng.standard_normal((2, 8, 11)).astype(np.float32)}


def _ort(model, feeds):
    import onnxruntime as ort

    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds)))


def _run(module, model, feeds):
    ins = [torch.from_numpy(feeds[i.name]) for i in model.graph.input]
    with torch.no_grad():
        outs = module(*ins)
    return {o.name: t.numpy() for o, t in zip(model.graph.output, outs)}


def _kinds(module) -> dict[str, bool]:
    """node name -> whether the converter lowered it (its step is not torch's convolution)."""
    return {st.node: "_conv_as_kernels" in getattr(st.fn, "__qualname__", "") for st in module._steps}


def test_only_depthwise_and_1x1_convolutions_are_lowered():
    model, lowered = conv_model()
    assert _kinds(convert(model, conv_kernels="inductor")) == lowered
    assert not any(_kinds(convert(model, conv_kernels="cudnn")).values())


def test_lowered_convolutions_equal_onnxruntime():
    model, _ = conv_model()
    feeds = _feeds()
    ref = _ort(model, feeds)
    got = _run(convert(model, conv_kernels="inductor"), model, feeds)
    for name, r in ref.items():
        assert got[name].shape == r.shape, name
        np.testing.assert_allclose(got[name], r, rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("written_out", [True, False])
def test_lowered_convolutions_compiled_by_inductor_equal_onnxruntime(written_out):
    """Compiled as an engine is (``_inductor_options``: reductions over up to 25 taps written out as sums), and
    with Inductor's defaults (every reduction over 8 or more taps a loop)."""
    from parastream.launcher.engines.base import BuildOptions
    from parastream.launcher.engines.onnx_torch import UNROLLED_TAPS, to_fx
    from parastream.launcher.engines.torch import _inductor_options

    options = _inductor_options(BuildOptions(precision="fp32", device="cpu", conv_kernels="inductor"))
    assert options["unroll_reductions_threshold"] == UNROLLED_TAPS + 1
    model, _ = conv_model()
    feeds = _feeds(2)
    ref = _ort(model, feeds)
    torch._dynamo.reset()
    compiled = torch.compile(to_fx(convert(model, conv_kernels="inductor")), options=options if written_out else {})
    got = _run(compiled, model, feeds)
    for name, r in ref.items():
        np.testing.assert_allclose(got[name], r, rtol=1e-4, atol=1e-5, err_msg=name)


def test_a_depthwise_weight_computed_in_the_graph_is_not_lowered():
    """Only initializer weights are lowered (what ``has_depthwise_conv`` reads from the ONNX, and so the cache key
    sees): a depthwise convolution whose weight a Constant node makes stays torch's convolution, and the
    converted model still equals ONNX Runtime."""
    rng = np.random.default_rng(4)
    w = numpy_helper.from_array((rng.standard_normal((8, 1, 3, 3)) * 0.3).astype(np.float32), "wc")
    nodes = [helper.make_node("Constant", [], ["w"], name="weight", value=w),
             helper.make_node("Conv", ["x", "w"], ["y"], name="dw_const_weight", pads=[1, 1, 1, 1], group=8)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 9, 9])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    assert not has_depthwise_conv(model)
    module = convert(model, conv_kernels="inductor")
    assert not any(_kinds(module).values())
    feeds = {"x": rng.standard_normal((1, 8, 9, 9)).astype(np.float32)}
    np.testing.assert_allclose(_run(module, model, feeds)["y"], _ort(model, feeds)["y"], rtol=1e-4, atol=1e-5)


def test_only_engines_that_lower_depthwise_convolutions_write_out_their_reductions():
    """Inductor's threshold for writing reductions out is raised for the engines whose depthwise convolutions
    are its kernels, and left at its default for every other engine (cuDNN's, torch's own depthwise kernel, and
    "auto" until a GPU build's timing chose)."""
    from parastream.launcher.engines.base import BuildOptions
    from parastream.launcher.engines.torch import _inductor_options

    assert "unroll_reductions_threshold" in _inductor_options(BuildOptions(conv_kernels="inductor"))
    for kernels in ("cudnn", "native", "auto"):
        assert "unroll_reductions_threshold" not in _inductor_options(BuildOptions(conv_kernels=kernels)), kernels


def test_which_models_the_option_changes():
    model, _ = conv_model()
    assert has_depthwise_conv(model)
    kept = onnx.ModelProto()
    kept.CopyFrom(model)
    keep = {"pw", "dw_dilated", "dw_multiplier2", "grouped_3x3", "pw_padded", "dense_3x3", "dw_1d"}
    nodes = [n for n in kept.graph.node if n.name in keep]
    del kept.graph.node[:]
    kept.graph.node.extend(nodes)
    assert not has_depthwise_conv(kept)


@pytest.mark.gpu
@pytest.mark.parametrize("conv_kernels, channels_last", [("inductor", False), ("native", True)])
def test_lowered_convolutions_in_fp16_on_the_gpu_equal_onnxruntime(conv_kernels, channels_last):
    """Every convolution of the model converted with ``conv_kernels`` (Inductor's lowering, or torch's own
    depthwise kernel fed a channels-last input as the launcher feeds an engine), compiled by Inductor, in fp16,
    against ONNX Runtime on the fp32 model."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from parastream.launcher.engines.onnx_torch import to_fx

    model, _ = conv_model()
    feeds = _feeds(3)
    ref = _ort(model, feeds)
    module = to_fx(convert(model, "float16", conv_kernels=conv_kernels)).cuda()
    from parastream.launcher.engines.base import BuildOptions
    from parastream.launcher.engines.torch import _inductor_options

    compiled = torch.compile(module, options=_inductor_options(BuildOptions(precision="fp16", conv_kernels=conv_kernels)))
    ins = [torch.from_numpy(feeds[i.name]).cuda().half() for i in model.graph.input]
    if channels_last:
        ins[0] = ins[0].to(memory_format=torch.channels_last)
    with torch.no_grad():
        outs = compiled(*ins)
    for o, t in zip(model.graph.output, outs):
        r = ref[o.name]
        err = float(np.abs(t.float().cpu().numpy() - r).max() / max(np.abs(r).max(), 1e-6))
        assert err < 5e-3, (o.name, err)


def _jobs_meta(model, conv_kernels: str) -> dict:
    """The engine.json fields and cache key the torch builder gives ``model``'s one branch (nothing compiled)."""
    from parastream.core.tensors import TensorSpec
    from parastream.launcher.engines import torch as torch_backend
    from parastream.launcher.engines.base import BuildOptions

    def specs(values):
        return [TensorSpec(v.name, "float32", [d.dim_value for d in v.type.tensor_type.shape.dim]) for v in values]

    builder = torch_backend.Builder(BuildOptions(precision="fp32", device="cpu", conv_kernels=conv_kernels))
    layout = {"inputs": specs(model.graph.input), "outputs": specs(onnx.shape_inference.infer_shapes(model).graph.output)}
    out, _, _ = builder._jobs([(model, "branch_000", layout)], wait=False)
    return out[0][2]


def test_only_a_branch_with_a_depthwise_convolution_is_compiled_apart():
    """A branch the option changes gets its own cache key and says in engine.json how its convolutions were compiled
    (a load with the other choice compiles it again); a branch without one is one engine for both choices: one
    key, nothing recorded, so either choice loads it as compiled."""
    model, _ = conv_model()
    dense = dense_only(model)
    lowered, kept = _jobs_meta(model, "inductor"), _jobs_meta(model, "cudnn")
    assert lowered["key"] != kept["key"] and (lowered["conv_kernels"], kept["conv_kernels"]) == ("inductor", "cudnn")
    assert _jobs_meta(model, "auto")["key"] == kept["key"]  # "auto" compiles cuDNN's until timing says
    plain = [_jobs_meta(dense, k) for k in ("inductor", "cudnn", "auto")]
    assert len({m["key"] for m in plain}) == 1 and not any("conv_kernels" in m for m in plain)


# -- torch's own depthwise kernel (``conv_kernels="native"``; CUDA only) -----------------------------------------
def _native_kinds(module) -> dict[str, bool]:
    """node name -> whether the converter wrote it as torch's own depthwise kernel."""
    return {st.node: "_conv_native_depthwise" in getattr(st.fn, "__qualname__", "") for st in module._steps}


def test_only_depthwise_convolutions_run_as_torchs_own_kernel():
    """The depthwise k x k convolutions (stride, padding, "same" padding and bias included) and no other: 1x1,
    grouped 1x1, dilated, channel-multiplier, grouped k x k, dense and 1-d convolutions stay torch's convolution."""
    model, lowered = conv_model()
    native = {name: low and name not in ("pw", "pw_stride2", "pw_groups2") for name, low in lowered.items()}
    assert _native_kinds(convert(model, conv_kernels="native")) == native
    assert sum(native.values()) == 4
    assert not any(_native_kinds(convert(model, conv_kernels="cudnn")).values())


def test_a_branch_with_a_depthwise_convolution_has_a_key_of_its_own_for_torchs_kernel():
    model, _ = conv_model()
    native, lowered, kept = (_jobs_meta(model, k) for k in ("native", "inductor", "cudnn"))
    assert len({native["key"], lowered["key"], kept["key"]}) == 3 and native["conv_kernels"] == "native"


@pytest.mark.gpu
def test_a_bundle_with_torchs_own_depthwise_kernel_builds_ships_compiled_and_verifies(tmp_path):
    """The whole build (torch engines, fp16, the kernels artifact a default build ships) of separable convolutions
    with ``--conv-kernels native``: Inductor compiles around the op, the engines load without compiling and the
    bundle matches ONNX Runtime."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import json

    from parastream.pipeline import build

    rng = np.random.default_rng(6)
    N = helper.make_node
    c = 16
    inits = [_w(rng, "dw", (c, 1, 5, 5)), _w(rng, "b", (c,)), _w(rng, "pw", (c, c, 1, 1))]
    nodes = [N("Relu", ["x"], ["r"], name="relu"),
             N("Conv", ["r", "dw", "b"], ["d"], name="depthwise", pads=[2, 2, 2, 2], group=c),
             N("Conv", ["d", "pw"], ["p"], name="pointwise"),
             N("Relu", ["p"], ["y"], name="relu2")]
    graph = helper.make_graph(nodes, "separable", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c, 28, 28])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, c, 28, 28])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, tmp_path / "sep.onnx")
    bundle = build(tmp_path / "sep.onnx", tmp_path / "b", backend="torch", precision="fp16", search=False,
                   measure=False, conv_kernels="native")
    assert bundle.report["verification"]["passed"]
    assert bundle.report["verification"]["engines_compiled_at_load"] == 0
    assert bundle.manifest["options"]["conv_kernels"] == "native"
    engines = [e for e in bundle.report["engines"].values() if isinstance(e, dict)]
    assert all(e.get("compiled") for e in engines), json.dumps(engines)[:400]


def test_the_depthwise_forms_benchmark_races_forms_that_equal_torchs_convolution():
    """bench/depthwise_forms.py times the converter's form against others on the device: each of them (the
    converter's, its windows and ``F.unfold``'s loop for every kernel, the shifted slices before them, an
    ``as_strided`` buffer) must compute the convolution, strided and asymmetrically padded, 3x3 to 9x9; and
    which form is the converter's must follow ``onnx_torch.UNROLLED_TAPS`` while the others stay themselves."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "depthwise_forms.py"
    spec = importlib.util.spec_from_file_location("depthwise_forms", path)
    forms = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(forms)
    rows = forms.check()
    # (the "triton" form is a kernel, not a lowering: tests/engines/test_conv_triton.py checks it)
    assert {r["form"] for r in rows} == set(forms.FORMS) - {"triton"}
    assert {r["k"] for r in rows} >= {3, 5, 7, 9}
    bad = [r for r in rows if not r["shape_ok"] or r["max_err"] > 1e-5]
    assert not bad, bad[:3]
    from parastream.launcher.engines import onnx_torch

    args = ((1, 4, 12, 12), (4, 1, 7, 7), (7, 7), (1, 1), (1, 1), 4, [3, 3], [3, 3])
    assert onnx_torch._conv_as_kernels(*args).__name__ == "depthwise_columns"  # 49 taps: F.unfold's loop
    assert forms.windows_form(*args).__name__ == "depthwise_windows"
    assert onnx_torch._conv_as_kernels(*args).__name__ == "depthwise_columns"  # the converter's own, restored
