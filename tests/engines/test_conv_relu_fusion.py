"""Conv + ReLU fused into cuDNN's conv + bias + ReLU kernel by the torch converter (GPU engines).

On the CPU the pass is checked with ``torch.cudnn_convolution_relu`` replaced by its definition
(relu(conv2d)): which pairs fuse, which must not, and that strides, pads, dilations, groups and a
missing bias reach the fused call.  On the GPU (marked) the real cuDNN kernel is compared with ONNX Runtime.
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


def conv_relu_model(seed: int = 0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    N = helper.make_node
    inits = [_w(rng, "wa", (8, 2, 3, 3)), _w(rng, "ba", (8,)), _w(rng, "wb", (8, 8, 3, 3)),
             _w(rng, "wc", (6, 8, 1, 1)), _w(rng, "bc", (6,)), _w(rng, "wd", (6, 8, 3, 3)), _w(rng, "we", (6, 8, 2, 2)),
             _w(rng, "wf", (6, 8, 1, 1)), _w(rng, "w1d", (4, 4, 3))]
    nodes = [
        # fused: stride 2, symmetric pads, groups 2 (4 -> 8 channels), bias
        N("Conv", ["x", "wa", "ba"], ["a"], name="conv_a", pads=[1, 1, 1, 1], strides=[2, 2], group=2),
        N("Relu", ["a"], ["ra"], name="relu_a"),
        # fused: dilation 2, no bias
        N("Conv", ["ra", "wb"], ["b"], name="conv_b", pads=[2, 2, 2, 2], dilations=[2, 2]),
        N("Relu", ["b"], ["rb"], name="relu_b"),
        # not fused: conv output also read by a Sigmoid
        N("Conv", ["rb", "wc", "bc"], ["c"], name="conv_c"),
        N("Relu", ["c"], ["rc"], name="relu_c"),
        N("Sigmoid", ["c"], ["sc"], name="sig_c"),
        # not fused: asymmetric pads
        N("Conv", ["rb", "wd"], ["d"], name="conv_d", pads=[0, 1, 2, 1]),
        N("Relu", ["d"], ["rd"], name="relu_d"),
        # not fused: the conv output is a graph output
        N("Conv", ["rb", "we"], ["e"], name="conv_e", pads=[1, 1, 1, 1], strides=[2, 2]),
        N("Relu", ["e"], ["re"], name="relu_e"),
        # not fused: Conv -> Tanh
        N("Conv", ["rb", "wf"], ["f"], name="conv_f"),
        N("Tanh", ["f"], ["tf"], name="tanh_f"),
        # not fused: 1-d convolution
        N("Conv", ["x1d", "w1d"], ["g"], name="conv_1d", pads=[1, 1]),
        N("Relu", ["g"], ["rg"], name="relu_1d"),
    ]
    outs = ["rc", "sc", "rd", "e", "re", "tf", "rg"]
    graph = helper.make_graph(nodes, "conv_relu",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 12, 12]),
                               helper.make_tensor_value_info("x1d", TensorProto.FLOAT, [1, 4, 10])],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outs], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return onnx.shape_inference.infer_shapes(model)


def _feeds(seed):
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((1, 4, 12, 12)).astype(np.float32), "x1d": rng.standard_normal((1, 4, 10)).astype(np.float32)}


def _ort(model, feeds):
    import onnxruntime as ort

    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds)))


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _fused_equals_onnxruntime(model, feeds, traced: bool) -> None:
    """``model`` converted with the fusions on (traced to FX or not) gives ONNX Runtime's outputs."""
    module = convert(model, fuse_conv_relu=True)
    fn = to_fx(module) if traced else module
    ref = _ort(model, feeds)
    with torch.no_grad():
        outs = fn(*[torch.from_numpy(feeds[n]) for n in module.input_names])
    for (name, _, _), out in zip(module.output_specs, outs):
        assert _rel(out.numpy(), ref[name]) <= 1e-5, name


@pytest.fixture
def reference_kernel(monkeypatch):
    """torch.cudnn_convolution_relu by its definition, so that the CPU runs the fused steps; records the calls."""
    calls = []

    def fake(x, w, b, stride, padding, dilation, groups):
        traced = isinstance(w, torch.fx.Proxy)  # while to_fx traces: the weight is a get_attr node
        calls.append({"stride": list(stride), "padding": list(padding), "dilation": list(dilation), "groups": groups,
                      "bias": b is not None,
                      "channels_last_weight": True if traced else w.is_contiguous(memory_format=torch.channels_last)})
        return torch.relu(torch.nn.functional.conv2d(x, w, b, stride, padding, dilation, groups))

    monkeypatch.setattr(torch, "cudnn_convolution_relu", fake)
    return calls


def test_fuses_only_a_conv_read_by_one_relu(reference_kernel):
    model = conv_relu_model()
    module = convert(model, fuse_conv_relu=True)
    assert module.fused_conv_relu == 2
    names = [s.node for s in module._steps]
    assert "conv_a+relu_a" in names and "conv_b+relu_b" in names
    for kept in ("conv_c", "relu_c", "conv_d", "relu_d", "conv_e", "relu_e", "conv_f", "conv_1d", "relu_1d"):
        assert kept in names, kept
    assert convert(model).fused_conv_relu == 0  # off by default (the CPU engines)


@pytest.mark.parametrize("traced", [False, True])
def test_fused_steps_compute_the_same_function(reference_kernel, traced):
    _fused_equals_onnxruntime(conv_relu_model(), _feeds(3), traced)
    assert reference_kernel[0] == {"stride": [2, 2], "padding": [1, 1], "dilation": [1, 1], "groups": 2, "bias": True,
                                   "channels_last_weight": True}
    assert reference_kernel[1] == {"stride": [1, 1], "padding": [2, 2], "dilation": [2, 2], "groups": 1, "bias": False,
                                   "channels_last_weight": True}
    assert len(reference_kernel) == 2


@pytest.mark.gpu
@pytest.mark.parametrize("precision,tol", [("float32", 1e-3), ("float16", 1e-2)])
def test_cudnn_fused_kernel_matches_onnxruntime(precision, tol):
    model = conv_relu_model(seed=1)
    dtype = getattr(torch, precision)
    fused = convert(model, precision, fuse_conv_relu=True).cuda()
    plain = convert(model, precision).cuda()
    assert fused.fused_conv_relu == 2
    feeds = _feeds(5)
    ref = _ort(model, feeds)
    xs = [torch.from_numpy(feeds[n]).cuda().to(dtype) for n in fused.input_names]
    xs = [x.contiguous(memory_format=torch.channels_last) if x.dim() == 4 else x for x in xs]
    compiled = torch.compile(to_fx(fused), fullgraph=True, dynamic=False)
    with torch.no_grad():
        for outs in (fused(*xs), compiled(*xs)):
            for (name, _, _), out in zip(fused.output_specs, outs):
                assert _rel(out.float().cpu().numpy(), ref[name]) <= tol, name
        for a, b in zip(fused(*xs), plain(*xs)):
            assert _rel(a.float().cpu().numpy(), b.float().cpu().numpy()) <= tol


# -- conv + bias + residual Add + ReLU: torch.cudnn_convolution_add_relu ------------------------------------------

def residual_model(seed: int = 0) -> onnx.ModelProto:
    """Residual blocks as ResNets write them (Conv, Add of the skip tensor, Relu) and the chains that must not fuse."""
    rng = np.random.default_rng(seed)
    N = helper.make_node
    inits = [_w(rng, f"w{k}", (8, 8, 3, 3)) for k in "abcdefgh"] + [_w(rng, "ba", (8,)), _w(rng, "bias_c", (1, 8, 1, 1))]
    nodes = [
        # fused: Add(conv, skip) with a bias, stride 1
        N("Conv", ["x", "wa", "ba"], ["a"], name="conv_a", pads=[1, 1, 1, 1]),
        N("Add", ["a", "x"], ["sa"], name="add_a"),
        N("Relu", ["sa"], ["ra"], name="relu_a"),
        # fused: Add(skip, conv), no bias, dilation 2
        N("Conv", ["ra", "wb"], ["b"], name="conv_b", pads=[2, 2, 2, 2], dilations=[2, 2]),
        N("Add", ["x", "b"], ["sb"], name="add_b"),
        N("Relu", ["sb"], ["rb"], name="relu_b"),
        # not fused: the other operand broadcast ([1, 8, 1, 1]: a per-channel offset, not a residual)
        N("Conv", ["rb", "wc"], ["c"], name="conv_c", pads=[1, 1, 1, 1]),
        N("Add", ["c", "offset"], ["sc"], name="add_c"),
        N("Relu", ["sc"], ["rc"], name="relu_c"),
        # not fused: the sum is read by a second node
        N("Conv", ["rb", "wd"], ["d"], name="conv_d", pads=[1, 1, 1, 1]),
        N("Add", ["d", "rb"], ["sd"], name="add_d"),
        N("Relu", ["sd"], ["rd"], name="relu_d"),
        N("Sigmoid", ["sd"], ["gd"], name="sig_d"),
        # not fused: no Relu after the Add
        N("Conv", ["rb", "we"], ["e"], name="conv_e", pads=[1, 1, 1, 1]),
        N("Add", ["e", "rb"], ["se"], name="add_e"),
        N("Tanh", ["se"], ["te"], name="tanh_e"),
        # not fused: the conv output is read by a second node
        N("Conv", ["rb", "wf"], ["f"], name="conv_f", pads=[1, 1, 1, 1]),
        N("Add", ["f", "rb"], ["sf"], name="add_f"),
        N("Relu", ["sf"], ["rf"], name="relu_f"),
        N("Neg", ["f"], ["nf"], name="neg_f"),
        # one fused: two convs summed (a projection shortcut), the other conv stays a conv
        N("Conv", ["rb", "wg"], ["g"], name="conv_g", pads=[1, 1, 1, 1]),
        N("Conv", ["rb", "wh"], ["h"], name="conv_h", pads=[1, 1, 1, 1]),
        N("Add", ["g", "h"], ["sg"], name="add_g"),
        N("Relu", ["sg"], ["rg"], name="relu_g"),
    ]
    outs = ["rc", "rd", "gd", "te", "rf", "nf", "rg"]
    graph = helper.make_graph(nodes, "residual",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 10, 10]),
                               helper.make_tensor_value_info("offset", TensorProto.FLOAT, [1, 8, 1, 1])],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outs], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return onnx.shape_inference.infer_shapes(model)


def _residual_feeds(seed):
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((1, 8, 10, 10)).astype(np.float32),
            "offset": rng.standard_normal((1, 8, 1, 1)).astype(np.float32)}


@pytest.fixture
def reference_add_relu(monkeypatch):
    """torch.cudnn_convolution_add_relu by its definition, relu(conv2d(x, w, b) + alpha·z), so that the CPU runs
    the fused steps; records the calls."""
    calls = []

    def fake(x, w, z, alpha, b, stride, padding, dilation, groups):
        traced = isinstance(w, torch.fx.Proxy)
        calls.append({"alpha": alpha, "bias": b is not None, "padding": list(padding), "dilation": list(dilation),
                      "channels_last_weight": True if traced else w.is_contiguous(memory_format=torch.channels_last)})
        return torch.relu(torch.nn.functional.conv2d(x, w, b, stride, padding, dilation, groups) + alpha * z)

    monkeypatch.setattr(torch, "cudnn_convolution_add_relu", fake)
    monkeypatch.setattr(torch, "cudnn_convolution_relu", lambda x, w, b, s, p, d, g: torch.relu(
        torch.nn.functional.conv2d(x, w, b, s, p, d, g)))
    return calls


def test_fuses_only_a_conv_plus_residual_read_by_one_relu(reference_add_relu):
    model = residual_model()
    module = convert(model, fuse_conv_relu=True)
    names = [s.node for s in module._steps]
    assert module.fused_conv_add_relu == 3
    assert {"conv_a+add_a+relu_a", "conv_b+add_b+relu_b"} <= set(names)
    assert [n for n in names if n.endswith("+add_g+relu_g")] in (["conv_g+add_g+relu_g"], ["conv_h+add_g+relu_g"])
    assert ("conv_h" in names) != ("conv_g" in names)  # the other conv of the projection shortcut stays
    for kept in ("conv_c", "add_c", "relu_c", "conv_d", "add_d", "relu_d", "conv_e", "add_e", "conv_f", "add_f", "relu_f"):
        assert kept in names, kept
    assert convert(model).fused_conv_add_relu == 0  # off by default (the CPU engines)


@pytest.mark.parametrize("traced", [False, True])
def test_fused_residual_steps_compute_the_same_function(reference_add_relu, traced):
    _fused_equals_onnxruntime(residual_model(), _residual_feeds(3), traced)
    assert len(reference_add_relu) == 3
    assert reference_add_relu[0] == {"alpha": 1.0, "bias": True, "padding": [1, 1], "dilation": [1, 1],
                                     "channels_last_weight": True}
    assert reference_add_relu[1] == {"alpha": 1.0, "bias": False, "padding": [2, 2], "dilation": [2, 2],
                                     "channels_last_weight": True}


@pytest.mark.gpu
@pytest.mark.parametrize("precision,tol", [("float32", 1e-3), ("float16", 1e-2)])
def test_cudnn_fused_residual_kernel_matches_onnxruntime(precision, tol):
    model = residual_model(seed=1)
    dtype = getattr(torch, precision)
    fused = convert(model, precision, fuse_conv_relu=True).cuda()
    assert fused.fused_conv_add_relu == 3
    feeds = _residual_feeds(5)
    ref = _ort(model, feeds)
    xs = [torch.from_numpy(feeds[n]).cuda().to(dtype).contiguous(memory_format=torch.channels_last)
          for n in fused.input_names]
    compiled = torch.compile(to_fx(fused), fullgraph=True, dynamic=False)
    with torch.no_grad():
        for outs in (fused(*xs), compiled(*xs)):
            for (name, _, _), out in zip(fused.output_specs, outs):
                assert _rel(out.float().cpu().numpy(), ref[name]) <= tol, name


def test_the_conv_relu_round_is_planned_for_residual_blocks_too():
    """A model whose only Conv->Relu is a residual block's Conv->Add->Relu still gets the timed conv+ReLU round."""
    from parastream.pipeline.measure import has_conv_relu

    N = helper.make_node
    rng = np.random.default_rng(0)

    def block(read_twice: bool):
        nodes = [N("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]), N("Add", ["c", "x"], ["s"], name="add"),
                 N("Relu", ["s"], ["y"], name="relu")] + ([N("Neg", ["s"], ["n"], name="neg")] if read_twice else [])
        outs = ["y"] + (["n"] if read_twice else [])
        g = helper.make_graph(nodes, "block", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 6, 6])],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outs],
                              [_w(rng, "w", (4, 4, 3, 3))])
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])

    assert has_conv_relu(block(False))
    assert not has_conv_relu(block(True))
    assert has_conv_relu(conv_relu_model()) and has_conv_relu(residual_model())
