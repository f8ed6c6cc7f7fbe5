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
    return _model("conv_relu", nodes, {"x": [1, 4, 12, 12], "x1d": [1, 4, 10]}, ["rc", "sc", "rd", "e", "re", "tf", "rg"],
                  inits)


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
        # not fused with its ReLU: the sum is read by a second node (with the plans: conv + add as one plan)
        N("Conv", ["rb", "wd"], ["d"], name="conv_d", pads=[1, 1, 1, 1]),
        N("Add", ["d", "rb"], ["sd"], name="add_d"),
        N("Relu", ["sd"], ["rd"], name="relu_d"),
        N("Sigmoid", ["sd"], ["gd"], name="sig_d"),
        # not fused with a ReLU: no Relu after the Add (with the plans: conv + add as one plan)
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
    return _model("residual", nodes, {"x": [1, 8, 10, 10], "offset": [1, 8, 1, 1]},
                  ["rc", "rd", "gd", "te", "rf", "nf", "rg"], inits)


def _model(name: str, nodes, inputs: dict[str, list[int]], outs: list[str], inits) -> onnx.ModelProto:
    """An opset-17 float model of ``nodes``, its shapes inferred."""
    graph = helper.make_graph(nodes, name, [helper.make_tensor_value_info(n, TensorProto.FLOAT, d) for n, d in inputs.items()],
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
@pytest.mark.parametrize("shortcuts", [False, True])
def test_cudnn_fused_residual_kernel_matches_onnxruntime(precision, tol, shortcuts):
    """Real cuDNN (x an NCHW input: the fused steps ask for it channels-last), with the shortcuts' biases folded
    where ``shortcuts``."""
    model = shortcut_model(seed=1) if shortcuts else residual_model(seed=1)
    dtype = getattr(torch, precision)
    fused = convert(model, precision, fuse_conv_relu=True).cuda()
    assert fused.fused_conv_add_relu == (4 if shortcuts else 3)
    feeds = (_shortcut_feeds if shortcuts else _residual_feeds)(5)
    ref = _ort(model, feeds)
    xs = [torch.from_numpy(feeds[n]).cuda().to(dtype) for n in fused.input_names]
    compiled = torch.compile(to_fx(fused), fullgraph=True, dynamic=False)
    with torch.no_grad():
        for outs in (fused(*xs), compiled(*xs)):
            for (name, _, _), out in zip(fused.output_specs, outs):
                assert _rel(out.float().cpu().numpy(), ref[name]) <= tol, name


def test_the_conv_relu_round_is_planned_for_residual_blocks_too():
    """A model whose only Conv->Relu is a residual block's Conv->Add->Relu still gets the timed conv+ReLU round, and
    one whose sum a second node reads gets it for the conv + add plan (the ReLU apart); a Conv->Tanh does not."""
    from parastream.launcher.engines.cudnn_fused import conv_relu_sites
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

    assert has_conv_relu(block(False)) and has_conv_relu(block(True))
    assert [kind for _, kind, _ in conv_relu_sites(block(False))] == ["add_relu"]
    assert [kind for _, kind, _ in conv_relu_sites(block(True))] == ["add"]
    assert has_conv_relu(conv_relu_model()) and has_conv_relu(residual_model())
    tanh = helper.make_graph([N("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]), N("Tanh", ["c"], ["y"])], "tanh",
                             [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 6, 6])],
                             [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [_w(rng, "w", (4, 4, 3, 3))])
    assert not has_conv_relu(helper.make_model(tanh, opset_imports=[helper.make_opsetid("", 17)]))


# -- a projection shortcut's bias folded into the fused residual step ---------------------------------------------

def shortcut_model(seed: int = 0) -> onnx.ModelProto:
    """Residual blocks whose skip tensor is a convolution of its own (ResNet's downsampling shortcut), and those
    whose shortcut bias must stay where it is."""
    rng = np.random.default_rng(seed)
    N = helper.make_node
    inits = ([_w(rng, f"w{k}", (8, 8, 3, 3)) for k in "abcdefgh"]
             + [_w(rng, f"b{k}", (8,)) for k in "abdfg"])
    nodes = [
        # folded: both convolutions biased; one is fused, the other's bias joins the fused step's
        N("Conv", ["x", "wa", "ba"], ["a"], name="conv_a", pads=[1, 1, 1, 1]),
        N("Conv", ["x", "wb", "bb"], ["b"], name="conv_b", pads=[1, 1, 1, 1]),
        N("Add", ["a", "b"], ["s1"], name="add_1"),
        N("Relu", ["s1"], ["r1"], name="relu_1"),
        # folded: the fused convolution has no bias; the shortcut's becomes the fused step's
        N("Conv", ["r1", "wc"], ["c"], name="conv_c", pads=[1, 1, 1, 1]),
        N("Conv", ["x", "wd", "bd"], ["d"], name="conv_d", pads=[1, 1, 1, 1]),
        N("Add", ["c", "d"], ["s2"], name="add_2"),
        N("Relu", ["s2"], ["r2"], name="relu_2"),
        # not folded: the shortcut convolution's output is read by a second node
        N("Conv", ["r2", "we"], ["e"], name="conv_e", pads=[1, 1, 1, 1]),
        N("Conv", ["r2", "wf", "bf"], ["f"], name="conv_f", pads=[1, 1, 1, 1]),
        N("Add", ["e", "f"], ["s3"], name="add_3"),
        N("Relu", ["s3"], ["r3"], name="relu_3"),
        N("Neg", ["f"], ["nf"], name="neg_f"),
        # not folded: the shortcut's bias is a run-time input
        N("Conv", ["r3", "wg", "bg"], ["g"], name="conv_g", pads=[1, 1, 1, 1]),
        N("Conv", ["r3", "wh", "bias_in"], ["h"], name="conv_h", pads=[1, 1, 1, 1]),
        N("Add", ["g", "h"], ["s4"], name="add_4"),
        N("Relu", ["s4"], ["r4"], name="relu_4"),
    ]
    return _model("shortcuts", nodes, {"x": [1, 8, 10, 10], "bias_in": [8]}, ["r4", "nf"], inits)


def _shortcut_feeds(seed):
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((1, 8, 10, 10)).astype(np.float32),
            "bias_in": rng.standard_normal(8).astype(np.float32)}


def test_a_shortcut_convolutions_bias_is_folded_only_where_the_fused_add_alone_reads_it(reference_add_relu):
    model = shortcut_model()
    module = convert(model, fuse_conv_relu=True)
    assert module.fused_conv_add_relu == 4
    steps = {s.node: s for s in module._steps}
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}

    def bias_of(fused_step):  # its args: x, w, z, bias
        return getattr(module, fused_step.args[3][1]).numpy()

    fused = {n.rsplit("+", 2)[1]: s for n, s in steps.items() if n.count("+") == 2}
    # add_1: conv_a + conv_b, both biased: the one left a conv runs without its bias, the fused step adds both
    left = "conv_b" if "conv_b" in steps else "conv_a"
    assert len(steps[left].args) == 2
    np.testing.assert_allclose(bias_of(fused["add_1"]), inits["ba"] + inits["bb"], rtol=1e-6)
    # add_2: conv_c (no bias) fused, conv_d's bias moved into the fused step
    assert "conv_d" in steps and len(steps["conv_d"].args) == 2
    np.testing.assert_allclose(bias_of(fused["add_2"]), inits["bd"], rtol=0)
    # add_3: conv_f is also read by neg_f: it keeps its bias, and the fused conv_e has none to add
    assert steps["conv_f"].args[2] is not None and fused["add_3"].args[3] is None
    # add_4: conv_h's bias is a graph input, not a constant: it stays on conv_h
    assert steps["conv_h"].args[2] == ("v", "bias_in")
    np.testing.assert_allclose(bias_of(fused["add_4"]), inits["bg"], rtol=0)
    assert convert(model).fused_conv_add_relu == 0  # off by default (the CPU engines): nothing folded either
    onnx_args = {n.name: len(n.input) for n in model.graph.node}
    assert all(len(s.args) == onnx_args[s.node] for s in convert(model)._steps)


@pytest.mark.parametrize("traced", [False, True])
def test_folded_shortcut_biases_compute_the_same_function(reference_add_relu, traced):
    _fused_equals_onnxruntime(shortcut_model(), _shortcut_feeds(3), traced)
    assert [c["bias"] for c in reference_add_relu] == [True, True, False, True]


def test_fused_steps_ask_for_channels_last_inputs(monkeypatch):
    """The fused kernels read channels-last: an NCHW input is made so inside the converted graph (where Inductor
    writes it from its producer), and one already channels-last is passed as it is."""
    seen = []

    def relu_kernel(x, w, b, s, p, d, g):
        seen.append(("relu", x.is_contiguous(memory_format=torch.channels_last)))
        return torch.relu(torch.nn.functional.conv2d(x, w, b, s, p, d, g))

    def add_relu_kernel(x, w, z, alpha, b, s, p, d, g):
        seen.append(("add_relu", x.is_contiguous(memory_format=torch.channels_last),
                     z.is_contiguous(memory_format=torch.channels_last)))
        return torch.relu(torch.nn.functional.conv2d(x, w, b, s, p, d, g) + alpha * z)

    monkeypatch.setattr(torch, "cudnn_convolution_relu", relu_kernel)
    monkeypatch.setattr(torch, "cudnn_convolution_add_relu", add_relu_kernel)
    for model, feeds in ((conv_relu_model(), _feeds(0)), (residual_model(), _residual_feeds(0))):
        module = convert(model, fuse_conv_relu=True)
        xs = [torch.from_numpy(feeds[n]) for n in module.input_names]  # NCHW, as graph inputs arrive
        assert not xs[0].is_contiguous(memory_format=torch.channels_last)
        with torch.no_grad():
            module(*xs)
    assert {f[0] for f in seen} == {"relu", "add_relu"}
    assert all(all(flags[1:]) for flags in seen), seen


# -- the fused steps as parastream's operators, whose layout Inductor keeps (cudnn_fused) ----------------------------
def test_fused_steps_are_parastream_operators_with_a_layout_constraint():
    """Inductor lays out the inputs of torch's own cudnn_convolution_relu as it likes (no lowering, no constraint),
    which made SqueezeNet's fire modules run NCHW through cuDNN's transposes; the converter's steps call
    parastream's operators, which carry a stride constraint Inductor keeps."""
    from parastream.launcher.engines.cudnn_fused import register_ops

    register_ops()
    constraints = {"needs_exact_strides", "needs_fixed_stride_order"}
    for op in (torch.ops.parastream.conv2d_relu.default, torch.ops.parastream.conv2d_add_relu.default):
        assert {str(t).split(".")[-1] for t in op.tags} & constraints, op
    targets = {str(n.target) for m in (conv_relu_model(), residual_model())
               for n in to_fx(convert(m, fuse_conv_relu=True)).graph.nodes if n.op == "call_function"}
    assert {"parastream.conv2d_relu", "parastream.conv2d_add_relu"} <= {t.removesuffix(".default") for t in targets}
    assert not {t for t in targets if "cudnn_convolution" in t}


@pytest.mark.parametrize("shape,weight", [((1, 8, 10, 10), (6, 8, 3, 3)), ((1, 8, 1, 1), (6, 8, 1, 1)),
                                          ((2, 16, 7, 5), (4, 16, 1, 1))])
def test_fused_operators_fake_strides_are_the_real_ones(reference_add_relu, shape, weight):
    """The shape function Inductor traces gives the strides the operator returns (a 1x1 output, whose layout the
    kernel leaves ambiguous, included): checked by torch.library.opcheck on the CPU definitions."""
    from parastream.launcher.engines.cudnn_fused import register_ops

    register_ops()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g).contiguous(memory_format=torch.channels_last)
    w = torch.randn(weight, generator=g).contiguous(memory_format=torch.channels_last)
    b = torch.randn(weight[0], generator=g)
    pad = [weight[2] // 2, weight[3] // 2]
    y = torch.ops.parastream.conv2d_relu(x, w, b, [1, 1], pad, [1, 1], 1)
    z = torch.randn(y.shape, generator=g).contiguous(memory_format=torch.channels_last)
    for op, args in ((torch.ops.parastream.conv2d_relu.default, (x, w, b, [1, 1], pad, [1, 1], 1)),
                     (torch.ops.parastream.conv2d_add_relu.default, (x, w, z, b, [1, 1], pad, [1, 1], 1)),
                     (torch.ops.parastream.conv2d_relu.default, (x.contiguous(), w, None, [1, 1], pad, [1, 1], 1))):
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
        out = op(*args)
        n, c, h, wd = out.shape
        assert out.stride() == (h * wd * c, 1, wd * c, c)
    ref = torch.relu(torch.nn.functional.conv2d(x, w, b, 1, pad) + z)
    torch.testing.assert_close(torch.ops.parastream.conv2d_add_relu(x, w, z, b, [1, 1], pad, [1, 1], 1), ref)


def fire_model(seed: int = 0, fires: int = 3) -> onnx.ModelProto:
    """SqueezeNet's fire modules: a 1x1 squeeze conv + ReLU read by a 1x1 and a 3x3 expand conv + ReLU, their
    outputs concatenated, ``fires`` times; a max pool after the first."""
    rng = np.random.default_rng(seed)
    N = helper.make_node
    nodes, inits, x, c = [], [], "x", 16
    for i in range(fires):
        s, e = 8 + 4 * i, 16 + 8 * i
        inits += [_w(rng, f"ws{i}", (s, c, 1, 1)), _w(rng, f"bs{i}", (s,)), _w(rng, f"we{i}", (e, s, 1, 1)),
                  _w(rng, f"be{i}", (e,)), _w(rng, f"wt{i}", (e, s, 3, 3)), _w(rng, f"bt{i}", (e,))]
        nodes += [N("Conv", [x, f"ws{i}", f"bs{i}"], [f"s{i}"], name=f"squeeze_{i}"),
                  N("Relu", [f"s{i}"], [f"sr{i}"], name=f"squeeze_relu_{i}"),
                  N("Conv", [f"sr{i}", f"we{i}", f"be{i}"], [f"e{i}"], name=f"expand1_{i}"),
                  N("Relu", [f"e{i}"], [f"er{i}"], name=f"expand1_relu_{i}"),
                  N("Conv", [f"sr{i}", f"wt{i}", f"bt{i}"], [f"t{i}"], name=f"expand3_{i}", pads=[1, 1, 1, 1]),
                  N("Relu", [f"t{i}"], [f"tr{i}"], name=f"expand3_relu_{i}"),
                  N("Concat", [f"er{i}", f"tr{i}"], [f"c{i}"], name=f"cat_{i}", axis=1)]
        x, c = f"c{i}", 2 * e
        if i == 0:
            nodes.append(N("MaxPool", [x], ["p0"], name="pool_0", kernel_shape=[3, 3], strides=[2, 2]))
            x = "p0"
    g = helper.make_graph(nodes, "fire", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 27, 27])],
                          [helper.make_tensor_value_info(x, TensorProto.FLOAT, [1, c, 13, 13])], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8  # (what an onnxruntime older than this onnx reads)
    return model


@pytest.mark.gpu
def test_fire_modules_run_channels_last_without_cudnn_transposes():
    """SqueezeNet's pattern compiled by Inductor: every fused convolution reads and writes channels-last, so cuDNN
    runs no NCHW<->NHWC transpose (27 of them in SqueezeNet's engine when its Concats were written NCHW), and the
    result matches ONNX Runtime."""
    from torch.profiler import ProfilerActivity, profile

    model = fire_model()
    module = convert(model, "float16", fuse_conv_relu=True).cuda()
    assert module.fused_conv_relu == 9
    feeds = {"x": np.random.default_rng(1).standard_normal((1, 16, 27, 27)).astype(np.float32)}
    ref = _ort(model, feeds)
    x = torch.from_numpy(feeds["x"]).cuda().half()
    compiled = torch.compile(to_fx(module), fullgraph=True, dynamic=False)
    with torch.no_grad():
        for _ in range(2):
            out = compiled(x)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            out = compiled(x)
            torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
    assert names, "no kernel profiled"
    transposes = [n for n in names if "nchwToNhwc" in n or "nhwcToNchw" in n]
    assert not transposes, transposes
    assert _rel(out[0].float().cpu().numpy(), next(iter(ref.values()))) <= 1e-2
