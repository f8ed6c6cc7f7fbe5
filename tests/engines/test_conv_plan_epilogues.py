"""The convolution epilogues only a cuDNN plan runs fused, by the torch converter (``fuse_conv_plans``): Conv + SiLU
(Sigmoid and Mul, as exporters write it) and Conv + bias + residual Add that no Relu follows (an inverted
residual's projection), each one plan (``cudnn_plans.conv2d``).

On the CPU the plans' op is torch's convolution and its epilogue after it (``cudnn_plans.conv2d``), so the passes
are checked there: which convolutions fuse (dense and depthwise, operands in either order) and which must not (an
output read elsewhere or a graph output, a gate of another tensor, a broadcast operand, a sum a Relu alone reads, a
weight computed at run time, a shape listed unfused, the option off), that the fused module equals ONNX Runtime
eager and compiled by Inductor, in both exporters' graphs, that the build lists those convolutions' shapes and
counts them without timing them alone, so that the conv+ReLU round races the whole plan.  On the GPU (marked) the
real plans are compared with ONNX Runtime.
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
from test_conv_relu_fusion import reference_add_relu  # noqa: E402,F401 - a fixture: the CPU runs the fused ReLU steps


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
    module = convert(model, fuse_conv_relu=True, fuse_conv_plans=True)
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
    for kwargs in ({}, {"fuse_conv_relu": True}, {"fuse_conv_plans": True}):
        module = convert(model, **kwargs)
        assert not FUSED & _names(module), kwargs
        assert getattr(module, "fused_conv_silu", 0) == 0


@pytest.mark.parametrize("traced", [False, True])
def test_fused_steps_equal_onnxruntime(traced):
    model, feeds = silu_model(), _feeds()
    ref = _ort(model, feeds)
    module = convert(model, fuse_conv_relu=True, fuse_conv_plans=True)
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
    module = convert(model, fuse_conv_relu=True, fuse_conv_plans=True, conv_relu_unfused=(dw,))
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
    assert converter_options("cuda", "float16", on)["fuse_conv_plans"]
    # the depthwise lowering leaves the dense convolutions' plans alone
    assert converter_options("cuda", "float16", BuildOptions(precision="fp16", conv_kernels="inductor"))["fuse_conv_plans"]
    for device, dtype, opts in (("cpu", "float32", on), ("cuda", "bfloat16", on),
                                ("cuda", "float16", BuildOptions(precision="fp16", fuse_conv_relu=False)),
                                ("cuda", "float16", BuildOptions(precision="fp16", cudnn_plans=False)),
                                ("cuda", "float16", BuildOptions(precision="fp16", torch_artifact="aoti"))):
        assert not converter_options(device, dtype, opts)["fuse_conv_plans"], (device, dtype, opts)


def _exported(exporter: str, opset: int, net=None) -> onnx.ModelProto:
    """``net`` (by default a dense and a depthwise convolution with SiLU (nn.SiLU) and a 1x1 after them) on a
    [1, 4, 10, 10] input, as the exporter writes it."""
    import io
    import warnings

    torch.manual_seed(0)
    net = (net or torch.nn.Sequential(torch.nn.Conv2d(4, 8, 3, padding=1), torch.nn.SiLU(),
                                      torch.nn.Conv2d(8, 8, 5, padding=2, groups=8), torch.nn.SiLU(),
                                      torch.nn.Conv2d(8, 4, 1))).eval()
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


def residual_model() -> onnx.ModelProto:
    """Inverted residuals (a projection Conv + Add of the block's input) and the Adds that must stay apart."""
    rng = np.random.default_rng(8)
    N = helper.make_node
    c = 8
    inits = [_w(rng, k, (c, c, 1, 1)) for k in ("wa", "wb", "wc", "wd", "we")] + [
        _w(rng, "ba", (c,)), _w(rng, "dw", (c, 1, 3, 3)), _w(rng, "offset", (1, c, 1, 1))]
    nodes = [
        # fused: Add(conv, x), bias
        N("Conv", ["x", "wa", "ba"], ["a"], name="conv_a"),
        N("Add", ["a", "x"], ["sa"], name="add_a"),
        # fused: Add(skip, conv) of a depthwise convolution without bias
        N("Conv", ["sa", "dw"], ["b"], name="conv_dw", pads=[1, 1, 1, 1], group=c),
        N("Add", ["x", "b"], ["sb"], name="add_dw"),
        # not here: the sum a Relu alone reads (conv + add + ReLU's, torch's fused call)
        N("Conv", ["sb", "wb"], ["r"], name="conv_relu"),
        N("Add", ["r", "sb"], ["sr"], name="add_relu"),
        N("Relu", ["sr"], ["rr"], name="relu"),
        # not fused: a broadcast operand (a per-channel offset, not a residual)
        N("Conv", ["rr", "wc"], ["o"], name="conv_offset"),
        N("Add", ["o", "offset"], ["so"], name="add_offset"),
        # not fused: the conv's output read by a second node
        N("Conv", ["so", "wd"], ["d"], name="conv_twice"),
        N("Add", ["d", "so"], ["sd"], name="add_twice"),
        N("Neg", ["d"], ["nd"], name="neg_twice"),
        # not fused: the conv's output is a graph output
        N("Conv", ["sd", "we"], ["e"], name="conv_out"),
        N("Add", ["e", "sd"], ["se"], name="add_out"),
    ]
    graph = helper.make_graph(nodes, "residual", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c, 9, 9])],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("nd", "e", "se")],
                              inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return onnx.shape_inference.infer_shapes(model)


ADDED = {"conv_a+add_a", "conv_dw+add_dw"}


def test_fuses_only_a_convolution_whose_residual_add_no_relu_follows():
    model = residual_model()
    module = convert(model, fuse_conv_relu=True, fuse_conv_plans=True)
    assert module.fused_conv_add == 2 and module.fused_conv_add_relu == 1
    names = _names(module)
    assert ADDED <= names and "conv_relu+add_relu+relu" in names
    for conv, add in (("conv_offset", "add_offset"), ("conv_twice", "add_twice"), ("conv_out", "add_out")):
        assert {conv, add} <= names, conv
    assert all(getattr(st.fn, "planned", False) for st in module._steps if st.node in ADDED)
    assert getattr(convert(model, fuse_conv_relu=True), "fused_conv_add", 0) == 0
    keys = fused_conv_keys(model)
    assert {k.split("|")[0] for k in keys} == {"add", "add_relu"}
    assert sum(n for k, n in keys.items() if k.startswith("add|")) == 2
    # the round's pattern leaves out a constant added (a bias, not a residual: nothing a plan would fuse)
    sites = {n.name: kind for n, kind, _ in conv_relu_sites(model)}
    assert sites["conv_a"] == sites["conv_dw"] == "add" and "conv_twice" not in sites
    assert "conv_offset" not in sites


def test_a_convolution_and_a_residual_add_alone_make_the_conv_round_apply():
    """A Conv + residual Add without Relu or Sigmoid is a fusion of its own, so the option applies to it; a Conv
    whose output a constant is added to (a bias, nothing a plan fuses) does not make it apply."""
    from parastream.launcher.engines.torch import choices_that_apply

    def graph(residual: bool) -> onnx.ModelProto:
        nodes = [helper.make_node("Conv", ["x", "w"], ["c"]), helper.make_node("Add", ["c", "x" if residual else "b"], ["y"])]
        rng = np.random.default_rng(0)
        inits = [_w(rng, "w", (4, 4, 1, 1))] + ([] if residual else [_w(rng, "b", (1, 4, 1, 1))])
        g = helper.make_graph(nodes, "conv_add", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 6, 6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])

    assert choices_that_apply(graph(residual=True))["fuse_conv_relu"]
    assert [kind for _, kind, _ in conv_relu_sites(graph(residual=True))] == ["add"]
    assert conv_relu_sites(graph(residual=False)) == []


@pytest.mark.parametrize("traced", [False, True])
def test_fused_residual_steps_equal_onnxruntime(traced, reference_add_relu):
    model = residual_model()
    feeds = {"x": np.random.default_rng(9).standard_normal((1, 8, 9, 9)).astype(np.float32)}
    ref = _ort(model, feeds)
    module = convert(model, fuse_conv_relu=True, fuse_conv_plans=True)
    got = _run(torch.compile(to_fx(module)) if traced else module, model, feeds)
    for name, r in ref.items():
        np.testing.assert_allclose(got[name], r, rtol=1e-4, atol=1e-5, err_msg=name)


def test_a_residual_shape_listed_unfused_stays_apart():
    model = residual_model()
    a = conv_key("add", [1, 8, 9, 9], [8, 8, 1, 1], [1, 1], [0, 0], [1, 1], 1)
    assert a in fused_conv_keys(model)
    module = convert(model, fuse_conv_relu=True, fuse_conv_plans=True, conv_relu_unfused=(a,))
    # conv_a and conv_twice... share the shape: only the depthwise one fuses
    assert module.fused_conv_add == 1 and "conv_dw+add_dw" in _names(module) and {"conv_a", "add_a"} <= _names(module)


class _InvertedResidual(torch.nn.Module):
    """1x1 expand + SiLU, depthwise 3x3 + SiLU, 1x1 projection, + the input."""

    def __init__(self):
        super().__init__()
        self.expand, self.dw = torch.nn.Conv2d(4, 16, 1), torch.nn.Conv2d(16, 16, 3, padding=1, groups=16)
        self.project = torch.nn.Conv2d(16, 4, 1)

    def forward(self, x):
        return x + self.project(torch.nn.functional.silu(self.dw(torch.nn.functional.silu(self.expand(x)))))


@pytest.mark.parametrize("exporter, opset", [("torchscript", 17), ("dynamo", 18)])
@pytest.mark.parametrize("block, fused", [("silu", (2, 0)), ("inverted_residual", (2, 1))])
def test_both_exporters_graphs_fuse_and_equal_onnxruntime(exporter, opset, block, fused):
    """nn.SiLU after a dense and a depthwise convolution, and an inverted residual, as each exporter writes them:
    the SiLU plans and the residual plan fuse, and the module equals ONNX Runtime."""
    model = _exported(exporter, opset, _InvertedResidual() if block == "inverted_residual" else None)
    module = convert(model, fuse_conv_relu=True, fuse_conv_plans=True)
    assert (module.fused_conv_silu, module.fused_conv_add) == fused, [n.op_type for n in model.graph.node]
    assert len(fused_conv_keys(model)) == sum(fused)
    feeds = {model.graph.input[0].name: np.random.default_rng(6).standard_normal((1, 4, 10, 10)).astype(np.float32)}
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


def test_plan_shapes_are_counted_not_timed_and_keep_the_round_for_the_whole_plan(monkeypatch):
    """The per-shape step times the ReLU shapes and only counts the SiLU ones; with SiLU shapes in the model, shapes
    that all ran faster fused no longer decide the round."""
    import contextlib

    from parastream.launcher.engines.base import BuildOptions
    from parastream.pipeline import bench, measure

    timed = []
    monkeypatch.setattr(measure, "time_conv_shape", lambda key, batch, dtype, planned=True: timed.append(key) or (1.0, 2.0))
    monkeypatch.setattr(bench, "gpu_timing_lock", lambda device, enabled=True: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    fp16 = BuildOptions(precision="fp16")
    assert measure.time_conv_shapes(silu_model(), fp16, lock=False) is None and timed == []
    res = measure.time_conv_shapes(_relu_and_silu_model(), fp16, lock=False)
    assert [k.split("|")[0] for k in timed] == ["relu"] and res["plan_shapes"] == 1
    assert res["timed"] == res["shapes"] == 1 and res["unfused"] == []
    assert measure.conv_relu_decided_on_shapes(res) is None
    assert measure.conv_relu_decided_on_shapes({k: v for k, v in res.items() if k != "plan_shapes"}) is not None


@pytest.mark.gpu
@pytest.mark.parametrize("precision,tol", [("float32", 2e-3), ("float16", 2e-2)])
@pytest.mark.parametrize("case", ["silu", "residual"])
def test_the_cudnn_plans_match_onnxruntime_on_the_gpu(case, precision, tol, monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from parastream.launcher.engines import cudnn_plans as cp

    if cp.frontend() is None:
        pytest.skip("needs cuDNN's frontend (nvidia-cudnn-frontend)")
    if case == "silu":
        model, feeds, tail = silu_model(), _feeds(3), '"swish"]'
    else:
        model, tail = residual_model(), '"residual"]'
        feeds = {"x": np.random.default_rng(3).standard_normal((1, 8, 9, 9)).astype(np.float32)}
    ref = _ort(model, feeds)
    module = convert(model, precision, fuse_conv_relu=True, fuse_conv_plans=True).cuda()
    assert (module.fused_conv_silu if case == "silu" else module.fused_conv_add) == 2
    # (inputs in the compute dtype, as ``TorchEngine`` hands them over)
    ins = [torch.from_numpy(feeds[i.name]).cuda().to(getattr(torch, precision)) for i in model.graph.input]
    with torch.no_grad():
        outs = module(*ins)
    for o, t in zip(model.graph.output, outs):
        r = ref[o.name]
        rel = float(np.linalg.norm(t.float().cpu().numpy() - r) / max(np.linalg.norm(r), 1e-30))
        assert rel < tol, (o.name, rel)
    # the fused steps ran through the plans cuDNN built (or had), not through torch's fallback
    dtype = '"float16"' if precision == "float16" else '"float32"'
    planned = {k for (_, k) in cp.CACHE.plans if k.endswith(tail) and k.startswith(f"[{dtype}")}
    assert len(planned) == 2, cp.CACHE.failed
    assert not {k for (_, k) in cp.CACHE.failed if k.endswith(tail)}
