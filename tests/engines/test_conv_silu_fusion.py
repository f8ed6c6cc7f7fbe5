"""Conv + SiLU (Sigmoid and Mul, as exporters write it) fused into one cuDNN plan by the torch converter.

On the CPU the plans' op is torch's convolution and SiLU after it (``cudnn_plans.conv2d``), so the pass is checked
there: which convolutions fuse (dense and depthwise, the Mul's operands in either order) and which must not (the
Sigmoid's or the Conv's output read elsewhere or a graph output, a gate of another tensor, a weight computed at run
time, a shape listed unfused, the option off), that the fused module equals ONNX Runtime eager and compiled by
Inductor, that the build lists those convolutions' shapes and counts them without timing them alone, so that the
conv+ReLU round races the whole plan.  On the GPU (marked) the real plan is compared with ONNX Runtime.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

torch = pytest.importorskip("torch")

from parastream.launcher.engines.cudnn_fused import conv_key, conv_relu_sites, fused_conv_keys  # noqa: E402
from parastream.launcher.engines.onnx_torch import convert, may_fuse_conv_relu, to_fx  # noqa: E402

from test_conv_kernels import _ort, _run, _w  # noqa: E402


def silu_model(seed: int = 0) -> onnx.ModelProto:
    """An EfficientNet-like run of convolutions with SiLU, and the cases next to it that must stay apart."""
    rng = np.random.default_rng(seed)
    N = helper.make_node
    c = 8
    inits = [_w(rng, "wa", (c, 4, 3, 3)), _w(rng, "ba", (c,)), _w(rng, "dw", (c, 1, 5, 5)), _w(rng, "bd", (c,)),
             _w(rng, "wc", (c, c, 1, 1)), _w(rng, "wd", (c, c, 1, 1)), _w(rng, "we", (c, c, 1, 1)),
             _w(rng, "wf", (c, c, 1, 1)), _w(rng, "wg", (c, c, 3, 3))]
    nodes = [
        # fused: dense 3x3, stride 2, bias; Mul(conv, sigmoid)
        N("Conv", ["x", "wa", "ba"], ["a"], name="conv_a", pads=[1, 1, 1, 1], strides=[2, 2]),
        N("Sigmoid", ["a"], ["sa"], name="sig_a"),
        N("Mul", ["a", "sa"], ["ya"], name="mul_a"),
        # fused: depthwise 5x5 with bias; Mul(sigmoid, conv)
        N("Conv", ["ya", "dw", "bd"], ["d"], name="conv_dw", pads=[2, 2, 2, 2], group=c),
        N("Sigmoid", ["d"], ["sd"], name="sig_dw"),
        N("Mul", ["sd", "d"], ["yd"], name="mul_dw"),
        # not fused: the Sigmoid's output is read by another node too
        N("Conv", ["yd", "wc"], ["c"], name="conv_c"),
        N("Sigmoid", ["c"], ["sc"], name="sig_c"),
        N("Mul", ["c", "sc"], ["yc"], name="mul_c"),
        N("Neg", ["sc"], ["nc"], name="neg_c"),
        # not fused: a gate (x * sigmoid(conv)), not the conv's own SiLU
        N("Conv", ["yd", "wd"], ["dd"], name="conv_gate"),
        N("Sigmoid", ["dd"], ["sdd"], name="sig_gate"),
        N("Mul", ["yd", "sdd"], ["ydd"], name="mul_gate"),
        # not fused: the Sigmoid's output is a graph output
        N("Conv", ["yd", "we"], ["e"], name="conv_e"),
        N("Sigmoid", ["e"], ["se"], name="sig_e"),
        N("Mul", ["e", "se"], ["ye"], name="mul_e"),
        # not fused: the weight is computed at run time
        N("Mul", ["wf", "k"], ["wfk"], name="scale_w"),
        N("Conv", ["yd", "wfk"], ["f"], name="conv_runtime_w"),
        N("Sigmoid", ["f"], ["sf"], name="sig_f"),
        N("Mul", ["f", "sf"], ["yf"], name="mul_f"),
        # not fused: the conv's output is a graph output
        N("Conv", ["yd", "wg"], ["g"], name="conv_g", pads=[1, 1, 1, 1]),
        N("Sigmoid", ["g"], ["sg"], name="sig_g"),
        N("Mul", ["g", "sg"], ["yg"], name="mul_g"),
    ]
    graph = helper.make_graph(
        nodes, "silu", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 14, 14]),
                        helper.make_tensor_value_info("k", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("yc", "nc", "ydd", "se", "ye", "yf", "g", "yg")],
        inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return onnx.shape_inference.infer_shapes(model)


FUSED = {"conv_a+sig_a+mul_a", "conv_dw+sig_dw+mul_dw"}


def _feeds(seed: int = 1):
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((1, 4, 14, 14)).astype(np.float32), "k": np.array([0.7], np.float32)}


def _names(module) -> set[str]:
    return {st.node for st in module._steps}


def test_fuses_only_a_convolution_read_by_its_own_silu():
    model = silu_model()
    module = convert(model, fuse_conv_relu=True, fuse_conv_silu=True)
    assert module.fused_conv_silu == 2
    names = _names(module)
    assert FUSED <= names
    # every case that must not fire keeps its three steps
    for conv, sig, mul in (("conv_c", "sig_c", "mul_c"), ("conv_gate", "sig_gate", "mul_gate"),
                           ("conv_e", "sig_e", "mul_e"), ("conv_runtime_w", "sig_f", "mul_f"),
                           ("conv_g", "sig_g", "mul_g")):
        assert {conv, sig, mul} <= names, conv
    fused = {st.node: st for st in module._steps if st.node in FUSED}
    assert all(getattr(st.fn, "planned", False) for st in fused.values())
    # the fused steps' weights are stored channels-last (the layout the plan reads, no copy per call)
    for st in fused.values():
        assert getattr(module, st.args[1][1]).is_contiguous(memory_format=torch.channels_last)


def test_off_unless_asked_and_the_relu_fusions_alone_leave_silu_apart():
    model = silu_model()
    for kwargs in ({}, {"fuse_conv_relu": True}, {"fuse_conv_silu": True}):
        module = convert(model, **kwargs)
        assert not FUSED & _names(module), kwargs
        assert getattr(module, "fused_conv_silu", 0) == 0


@pytest.mark.parametrize("traced", [False, True])
def test_fused_steps_equal_onnxruntime(traced):
    model, feeds = silu_model(), _feeds()
    ref = _ort(model, feeds)
    module = convert(model, fuse_conv_relu=True, fuse_conv_silu=True)
    fn = torch.compile(to_fx(module)) if traced else module
    got = _run(fn, model, feeds)
    for name, r in ref.items():
        assert got[name].shape == r.shape, name
        np.testing.assert_allclose(got[name], r, rtol=1e-4, atol=1e-5, err_msg=name)


def test_the_build_lists_the_fused_convolutions_and_a_shape_listed_unfused_stays_apart():
    model = silu_model()
    keys = fused_conv_keys(model)
    a = conv_key("silu", [1, 4, 14, 14], [8, 4, 3, 3], [2, 2], [1, 1], [1, 1], 1)
    dw = conv_key("silu", [1, 8, 7, 7], [8, 1, 5, 5], [1, 1], [2, 2], [1, 1], 8)
    assert keys == {a: 1, dw: 1}
    sites = {n.name: kind for n, kind, _ in conv_relu_sites(model)}
    assert sites["conv_a"] == sites["conv_dw"] == "silu" and "conv_c" not in sites and "conv_gate" not in sites
    module = convert(model, fuse_conv_relu=True, fuse_conv_silu=True, conv_relu_unfused=(dw,))
    assert module.fused_conv_silu == 1 and "conv_a+sig_a+mul_a" in _names(module)
    assert {"conv_dw", "sig_dw", "mul_dw"} <= _names(module)
    ref, feeds = _ort(model, _feeds(2)), _feeds(2)
    got = _run(module, model, feeds)
    for name, r in ref.items():
        np.testing.assert_allclose(got[name], r, rtol=1e-4, atol=1e-5, err_msg=name)


def test_the_option_applies_to_a_model_with_silu_and_the_engine_asks_for_it_where_the_plans_op_may_run():
    from parastream.launcher.engines.base import BuildOptions
    from parastream.launcher.engines.torch import choices_that_apply, converter_options

    model = silu_model()
    assert may_fuse_conv_relu(model) and choices_that_apply(model)["fuse_conv_relu"]
    on = BuildOptions(precision="fp16")
    assert converter_options("cuda", "float16", on)["fuse_conv_silu"]
    # the depthwise lowering leaves the dense convolutions' plans alone
    assert converter_options("cuda", "float16", BuildOptions(precision="fp16", conv_kernels="inductor"))["fuse_conv_silu"]
    for device, dtype, opts in (("cpu", "float32", on), ("cuda", "bfloat16", on),
                                ("cuda", "float16", BuildOptions(precision="fp16", fuse_conv_relu=False)),
                                ("cuda", "float16", BuildOptions(precision="fp16", cudnn_plans=False)),
                                ("cuda", "float16", BuildOptions(precision="fp16", torch_artifact="aoti"))):
        assert not converter_options(device, dtype, opts)["fuse_conv_silu"], (device, dtype, opts)


def _exported(exporter: str, opset: int) -> onnx.ModelProto:
    """A dense and a depthwise convolution with SiLU (nn.SiLU), and a 1x1 after them, as the exporter writes it."""
    import io
    import warnings

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(4, 8, 3, padding=1), torch.nn.SiLU(),
                              torch.nn.Conv2d(8, 8, 5, padding=2, groups=8), torch.nn.SiLU(),
                              torch.nn.Conv2d(8, 4, 1)).eval()
    args = (torch.randn(1, 4, 10, 10),)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "dynamo":
            try:
                m = torch.onnx.export(net, args, dynamo=True, opset_version=opset, input_names=["x"]).model_proto
            except Exception as e:  # noqa: BLE001 - the dynamo exporter needs onnxscript
                pytest.skip(f"the dynamo exporter does not run here: {type(e).__name__}: {e}")
        else:
            f = io.BytesIO()
            torch.onnx.export(net, args, f, dynamo=False, opset_version=opset, input_names=["x"])
            m = onnx.load_from_string(f.getvalue())
    return onnx.shape_inference.infer_shapes(m)


@pytest.mark.parametrize("exporter, opset", [("torchscript", 17), ("dynamo", 18)])
def test_both_exporters_silu_fuses_and_equals_onnxruntime(exporter, opset):
    model = _exported(exporter, opset)
    module = convert(model, fuse_conv_relu=True, fuse_conv_silu=True)
    assert module.fused_conv_silu == 2, [n.op_type for n in model.graph.node]
    assert len(fused_conv_keys(model)) == 2
    feeds = {model.graph.input[0].name: np.random.default_rng(5).standard_normal((1, 4, 10, 10)).astype(np.float32)}
    ref = _ort(model, feeds)
    got = _run(module, model, feeds)
    for name, r in ref.items():
        np.testing.assert_allclose(got[name], r, rtol=1e-4, atol=1e-5, err_msg=name)


def _relu_and_silu_model() -> onnx.ModelProto:
    """One Conv -> Relu and one Conv -> SiLU."""
    rng = np.random.default_rng(4)
    N = helper.make_node
    nodes = [N("Conv", ["x", "w1", "b1"], ["a"], name="conv_relu", pads=[1, 1, 1, 1]), N("Relu", ["a"], ["r"]),
             N("Conv", ["r", "w2", "b2"], ["c"], name="conv_silu"), N("Sigmoid", ["c"], ["s"]),
             N("Mul", ["c", "s"], ["y"])]
    graph = helper.make_graph(nodes, "relu_silu", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [_w(rng, "w1", (8, 4, 3, 3)), _w(rng, "b1", (8,)), _w(rng, "w2", (8, 8, 1, 1)),
                               _w(rng, "b2", (8,))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return onnx.shape_inference.infer_shapes(model)


def test_silu_shapes_are_counted_not_timed_and_keep_the_round_for_the_whole_plan(monkeypatch):
    """The per-shape step times the ReLU shapes and only counts the SiLU ones; with SiLU shapes in the model, shapes
    that all ran faster fused no longer decide the round."""
    import contextlib

    from parastream.launcher.engines.base import BuildOptions
    from parastream.pipeline import bench, measure

    timed = []
    monkeypatch.setattr(measure, "time_conv_shape", lambda key, batch, dtype: timed.append(key) or (1.0, 2.0))
    monkeypatch.setattr(bench, "gpu_timing_lock", lambda device, enabled=True: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    fp16 = BuildOptions(precision="fp16")
    assert measure.time_conv_shapes(silu_model(), fp16, lock=False) is None and timed == []
    res = measure.time_conv_shapes(_relu_and_silu_model(), fp16, lock=False)
    assert [k.split("|")[0] for k in timed] == ["relu"] and res["silu_shapes"] == 1
    assert res["timed"] == res["shapes"] == 1 and res["unfused"] == []
    assert measure.conv_relu_decided_on_shapes(res) is None
    assert measure.conv_relu_decided_on_shapes({k: v for k, v in res.items() if k != "silu_shapes"}) is not None


@pytest.mark.gpu
@pytest.mark.parametrize("precision,tol", [("float32", 2e-3), ("float16", 2e-2)])
def test_the_cudnn_plan_matches_onnxruntime_on_the_gpu(precision, tol):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from parastream.launcher.engines import cudnn_plans as cp

    if cp.frontend() is None:
        pytest.skip("needs cuDNN's frontend (nvidia-cudnn-frontend)")
    model, feeds = silu_model(), _feeds(3)
    ref = _ort(model, feeds)
    module = convert(model, precision, fuse_conv_relu=True, fuse_conv_silu=True).cuda()
    assert module.fused_conv_silu == 2
    # (inputs in the compute dtype, as ``TorchEngine`` hands them over)
    ins = [torch.from_numpy(feeds[i.name]).cuda().to(getattr(torch, precision)) for i in model.graph.input]
    with torch.no_grad():
        outs = module(*ins)
    for o, t in zip(model.graph.output, outs):
        r = ref[o.name]
        rel = float(np.linalg.norm(t.float().cpu().numpy() - r) / max(np.linalg.norm(r), 1e-30))
        assert rel < tol, (o.name, rel)
    # the fused steps ran through swish plans cuDNN built (or had), not through torch's fallback
    dtype = '"float16"' if precision == "float16" else '"float32"'
    swish = {k for (_, k) in cp.CACHE.plans if k.endswith('"swish"]') and k.startswith(f"[{dtype}")}
    assert len(swish) == 2, cp.CACHE.failed
    assert not {k for (_, k) in cp.CACHE.failed if k.endswith('"swish"]')}
