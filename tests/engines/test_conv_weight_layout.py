"""A convolution's weight stored in the layout Inductor runs it (``onnx_torch._channels_last_conv_weights``).

A dense 2-d convolution the converter leaves to torch (not fused with a ReLU, not a cuDNN plan) is run channels-last by
Inductor, which transposed an NCHW weight in a Triton kernel of its own before every call (DenseNet-121: 58 a
replay).  CUDA engines store such weights channels-last.  On the CPU: which weights change, which must not, and that
the converted graph still computes ONNX Runtime's outputs; on the GPU (marked): Inductor's code passes the weight
to the convolution as it is, with no kernel of its own for it.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

torch = pytest.importorskip("torch")

from parastream.launcher.engines.onnx_torch import convert, to_fx  # noqa: E402


def _w(rng, name, shape):
    return numpy_helper.from_array((rng.standard_normal(shape) * 0.3).astype(np.float32), name)


def dense_layers(seed: int = 0, weight_output: bool = True) -> onnx.ModelProto:
    """DenseNet's layer and its neighbours: a 3x3 conv + ReLU (fused), a plain 3x3 conv without bias (changed), its
    output concatenated with the input, a 1x1 conv (both layouts at once: left), a depthwise 3x3 (one channel per
    group: left), a grouped 3x3 of 4 channels a group (left), a 2x2 stride-2 conv with bias (changed), a conv whose weight is a graph input (not a constant:
    left), a 1-d conv (left) and a 3x3 conv whose weight the graph also outputs (left; ``weight_output=False`` for a
    build, whose loader refuses an output that depends on no input)."""
    rng = np.random.default_rng(seed)
    N = helper.make_node
    inits = [_w(rng, "w_relu", (16, 8, 3, 3)), _w(rng, "b_relu", (16,)), _w(rng, "w_plain", (8, 16, 3, 3)),
             _w(rng, "w_1x1", (12, 16, 1, 1)), _w(rng, "b_1x1", (12,)), _w(rng, "w_dw", (12, 1, 3, 3)),
             _w(rng, "w_down", (8, 12, 2, 2)), _w(rng, "b_down", (8,)), _w(rng, "w_1d", (4, 8, 3)),
             _w(rng, "w_out", (8, 8, 3, 3)), _w(rng, "w_grouped", (12, 4, 3, 3))]
    nodes = [
        N("Conv", ["x", "w_relu", "b_relu"], ["a"], name="conv_relu", pads=[1, 1, 1, 1]),
        N("Relu", ["a"], ["ra"], name="relu"),
        N("Conv", ["ra", "w_plain"], ["p"], name="conv_plain", pads=[1, 1, 1, 1]),
        N("Concat", ["x", "p"], ["cat"], name="cat", axis=1),
        N("Conv", ["cat", "w_1x1", "b_1x1"], ["o"], name="conv_1x1"),
        N("Conv", ["o", "w_dw"], ["dd"], name="conv_dw", pads=[1, 1, 1, 1], group=12),
        N("Conv", ["dd", "w_grouped"], ["d"], name="conv_grouped", pads=[1, 1, 1, 1], group=3),
        N("Conv", ["d", "w_down", "b_down"], ["s"], name="conv_down", strides=[2, 2]),
        N("Conv", ["s", "w_in"], ["t"], name="conv_weight_input", pads=[1, 1, 1, 1]),
        N("Conv", ["t", "w_out"], ["u"], name="conv_weight_output", pads=[1, 1, 1, 1]),
        N("Conv", ["x1d", "w_1d"], ["g"], name="conv_1d", pads=[1, 1]),
    ]
    inputs = {"x": [1, 8, 12, 12], "w_in": [8, 8, 3, 3], "x1d": [1, 8, 10]}
    graph = helper.make_graph(nodes, "dense", [helper.make_tensor_value_info(n, TensorProto.FLOAT, d)
                                               for n, d in inputs.items()],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, d) for o, d in
                               (("u", [1, 8, 6, 6]), ("g", [1, 4, 10]), ("w_out", [8, 8, 3, 3]))[:3 if weight_output else 2]],
                              inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return onnx.shape_inference.infer_shapes(model)


def _feeds(seed: int = 1) -> dict:
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((1, 8, 12, 12)).astype(np.float32),
            "w_in": (rng.standard_normal((8, 8, 3, 3)) * 0.3).astype(np.float32),
            "x1d": rng.standard_normal((1, 8, 10)).astype(np.float32)}


def _weights(module) -> dict[str, object]:
    """{ONNX node name: the weight tensor its step reads} of each convolution step with a constant weight."""
    out = {}
    for st in module._steps:
        w = st.args[1] if len(st.args) > 1 else None
        if w is not None and w[0] == "c" and "conv" in st.node:
            out[st.node.split("+")[0]] = getattr(module, w[1])
    return out


def _channels_last(t) -> bool:
    return t.stride() != t.contiguous().stride() and t.is_contiguous(memory_format=torch.channels_last)


@pytest.fixture
def reference_kernel(monkeypatch):
    """torch.cudnn_convolution_relu by its definition, so that the CPU runs the fused step."""
    monkeypatch.setattr(torch, "cudnn_convolution_relu",
                        lambda x, w, b, s, p, d, g: torch.relu(torch.nn.functional.conv2d(x, w, b, s, p, d, g)))


def test_only_plain_wide_convolution_weights_are_stored_channels_last(reference_kernel):
    """The dense layers' graph runs channels-last in Inductor (its convolutions are small-channel ones), so its
    grouped 3x3's weight is stored so too."""
    module = convert(dense_layers(), fuse_conv_relu=True, conv_weights_channels_last=True)
    layouts = {name: _channels_last(t) for name, t in _weights(module).items()}
    assert module.inductor_channels_last is True
    assert module.channels_last_conv_weights == 3
    assert layouts == {"conv_relu": True,  # (the fused step's, as before)
                       "conv_plain": True, "conv_down": True, "conv_grouped": True,
                       "conv_1x1": False, "conv_dw": False, "conv_weight_output": False,
                       "conv_1d": False}


def grouped_layers(seed: int = 0) -> onnx.ModelProto:
    """A ResNeXt-like pair where the grouped 3x3 (64 channels, 2 groups, 56x56) holds most of the flops beside a
    1x1: Inductor's layout optimisation keeps such a graph NCHW."""
    rng = np.random.default_rng(seed)
    N = helper.make_node
    inits = [_w(rng, "w_g", (128, 64, 3, 3)), _w(rng, "w_d", (128, 128, 3, 3)), _w(rng, "w_p", (16, 128, 1, 1))]
    nodes = [N("Conv", ["x", "w_g"], ["g"], name="conv_grouped", pads=[1, 1, 1, 1], group=2),
             N("Conv", ["g", "w_d"], ["d"], name="conv_dense", pads=[1, 1, 1, 1], strides=[8, 8]),
             N("Conv", ["d", "w_p"], ["y"], name="conv_1x1")]
    graph = helper.make_graph(nodes, "grouped", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 128, 56, 56])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16, 7, 7])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return onnx.shape_inference.infer_shapes(model)


def test_a_grouped_weight_stays_nchw_where_inductor_runs_the_graph_so():
    """Must not fire: in a graph whose grouped convolution dominates, Inductor runs NCHW, and a channels-last
    grouped weight would make cuDNN run it channels-last; the dense 3x3 beside it is stored channels-last still."""
    module = convert(grouped_layers(), conv_weights_channels_last=True)
    layouts = {name: _channels_last(t) for name, t in _weights(module).items()}
    assert module.inductor_channels_last is False
    assert layouts == {"conv_grouped": False, "conv_dense": True, "conv_1x1": False}


def _inductors_decision(model: onnx.ModelProto, feeds: dict) -> bool:
    """Inductor's own ``GraphLowering.decide_layout_opt`` on the converted graph as Inductor receives it (an aten
    graph whose values carry fake tensors), with CPU's always-channels-last (oneDNN) branch off."""
    from torch._inductor.graph import GraphLowering
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    module = convert(model)
    xs = [torch.from_numpy(feeds[n]) for n in module.input_names]
    gm = make_fx(to_fx(module), tracing_mode="real")(*xs)
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    FakeTensorProp(gm, fake).propagate(*[fake.from_tensor(x) for x in xs])
    with torch.backends.mkldnn.flags(enabled=False):
        return GraphLowering.decide_layout_opt(gm, is_inference=True)


@pytest.mark.parametrize("which", ["dense", "grouped", "few convolutions"])
def test_the_restated_layout_decision_is_inductors(which):
    """``inductor_runs_channels_last`` gives what Inductor's own function decides on the same graph: channels-last
    for the dense layers, NCHW for the grouped pair, NCHW for one convolution among hundreds of nodes."""
    rng = np.random.default_rng(2)
    if which == "dense":
        model, feeds = dense_layers(), _feeds()
    elif which == "grouped":
        model, feeds = grouped_layers(), {"x": rng.standard_normal((1, 128, 56, 56)).astype(np.float32)}
    else:  # a convolution and a chain of 320 Relu/Neg nodes after it
        N = helper.make_node
        nodes = [N("Conv", ["x", "w"], ["v0"], name="conv", pads=[1, 1, 1, 1])]
        nodes += [N("Relu" if i % 2 else "Neg", [f"v{i}"], [f"v{i + 1}"], name=f"n{i}") for i in range(320)]
        graph = helper.make_graph(nodes, "few", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 8, 8])],
                                  [helper.make_tensor_value_info("v320", TensorProto.FLOAT, [1, 8, 8, 8])],
                                  [_w(rng, "w", (8, 8, 3, 3))])
        model = onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                                                                    ir_version=8))
        feeds = {"x": rng.standard_normal((1, 8, 8, 8)).astype(np.float32)}
    restated = convert(model, conv_weights_channels_last=True).inductor_channels_last
    assert restated is _inductors_decision(model, feeds)
    assert restated is (which == "dense")


def test_the_converted_module_names_each_weight_buffer_by_its_onnx_value(reference_kernel):
    """What a build records of the weights its engine's code reads (``weight_only_reads``) is in ONNX's names: the
    converter keeps each buffer's value name, its fused and transposed forms included."""
    model = dense_layers()
    module = convert(model, fuse_conv_relu=True, conv_weights_channels_last=True)
    buffers = dict(module.named_buffers())
    assert set(module.const_names) <= set(buffers)
    initializers = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    assert {"w_plain", "w_down", "w_grouped", "b_down"} <= set(module.const_names.values())
    for key, name in module.const_names.items():
        assert tuple(buffers[key].shape) == initializers[name].shape, (key, name)


def test_without_the_option_no_plain_weight_changes(reference_kernel):
    module = convert(dense_layers(), fuse_conv_relu=True)
    assert module.channels_last_conv_weights == 0
    layouts = {name: _channels_last(t) for name, t in _weights(module).items()}
    assert layouts.pop("conv_relu") and not any(layouts.values()), layouts


@pytest.mark.parametrize("traced", [False, True])
@pytest.mark.parametrize("fuse", [False, True])
def test_channels_last_weights_compute_onnxruntimes_outputs(reference_kernel, traced, fuse):
    import onnxruntime as ort

    model, feeds = dense_layers(), _feeds()
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    ref = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
    module = convert(model, fuse_conv_relu=fuse, conv_weights_channels_last=True)
    assert module.channels_last_conv_weights == (3 if fuse else 4)  # (unfused, conv_relu's is a plain one too)
    fn = to_fx(module) if traced else module
    with torch.no_grad():
        outs = fn(*[torch.from_numpy(feeds[n]) for n in module.input_names])
    for (name, _, _), out in zip(module.output_specs, outs):
        np.testing.assert_allclose(out.numpy(), ref[name], rtol=1e-4, atol=1e-4, err_msg=name)


def test_cuda_engines_ask_for_it_and_cpu_engines_do_not():
    from parastream.launcher.engines.base import BuildOptions
    from parastream.launcher.engines.torch import converter_options

    assert converter_options("cuda", "float16", BuildOptions())["conv_weights_channels_last"] is True
    assert converter_options("cpu", "float32", BuildOptions())["conv_weights_channels_last"] is False


@pytest.mark.gpu
def test_inductor_passes_the_stored_weight_to_the_convolution():
    """Compiled by Inductor on the GPU, each plain 3x3 convolution takes its weight argument as it arrives (no
    buffer written from it first), and the outputs match ONNX Runtime's; with NCHW weights the same graph
    transposes them."""
    import re

    import onnxruntime as ort
    from torch._inductor.utils import run_and_get_code

    model, feeds = dense_layers(), _feeds()
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    ref = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
    weight_args = {}
    for stored in (True, False):
        module = convert(model, "float16", fuse_conv_relu=True, conv_weights_channels_last=stored).cuda()
        xs = [torch.from_numpy(feeds[n]).cuda().half() for n in module.input_names]
        torch._dynamo.reset()
        compiled = torch.compile(to_fx(module), fullgraph=True, dynamic=False)
        with torch.no_grad():
            outs, code = run_and_get_code(compiled, *xs)
        src = "\n".join(code)
        # the weight argument of each aten convolution Inductor calls: a placeholder (argN_1) or a buffer it wrote
        weight_args[stored] = re.findall(r"extern_kernels\.convolution\(\w+, (\w+),", src)
        for (name, _, _), out in zip(module.output_specs, outs):
            r = ref[name]
            assert np.abs(out.float().cpu().numpy() - r).max() <= 2e-2 * max(np.abs(r).max(), 1.0), name
    # conv_plain, conv_down and the two 3x3s whose weights stay (an input, an output) go to torch's convolution
    assert len(weight_args[True]) >= 2
    assert sum(a.startswith("buf") for a in weight_args[False]) > sum(a.startswith("buf") for a in weight_args[True])
    stored_plain = [a for a in weight_args[True] if a.startswith("arg")]
    assert len(stored_plain) >= 2, weight_args


@pytest.mark.gpu
def test_a_gpu_build_records_no_kernel_on_weights_alone_and_records_them_where_they_are(tmp_path, monkeypatch):
    """A torch build for the GPU (fp16, no search) of the dense layers ships kernels engines whose code runs no
    kernel on the weights alone (report.json's engines have no ``weight_only_kernels``); built again with the
    convolutions' weights left NCHW, the report names the transposes the code then runs at every call.  (Its
    runs on the H200 recorded a kernel in the stored build: the grouped 3x3's weight, ``w_grouped``, which the
    converter left NCHW where Inductor runs this graph channels-last; it follows Inductor's decision since.)"""
    from parastream.launcher.engines import torch as tb
    from parastream.pipeline import build

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    path = tmp_path / "dense.onnx"
    onnx.save(dense_layers(weight_output=False), path)

    def engines(out):
        # (compiled in this process, where the patch below reaches: compile_workers=1)
        b = build(path, tmp_path / out, backend="torch", precision="fp16", search=False, measure=False, force=True,
                  compile_workers=1)
        assert b.report["verification"]["passed"]
        return [e for e in b.report["engines"].values() if e.get("compiled") == "kernels"]

    stored = engines("stored")
    assert stored and not any(e.get("weight_only_kernels") for e in stored), [
        (e.get("weight_only_kernels"), e.get("weight_only_reads")) for e in stored]
    options = tb.converter_options
    monkeypatch.setattr(tb, "converter_options",
                        lambda *a, **k: dict(options(*a, **k), conv_weights_channels_last=False))
    tb.clear_memory_cache()  # (the first build's engines are not reused)
    nchw = engines("nchw")
    calls = sum(sum(e.get("weight_only_kernels", {}).values()) for e in nchw)
    assert calls >= 2, nchw  # conv_plain's and conv_down's weights at least
    reads = {w for e in nchw for w in e.get("weight_only_reads", [])}
    assert any("w_plain" in w for w in reads) and any("w_down" in w for w in reads), reads
