"""Tiny hand-built ONNX models for the pipeline tests (the example zoo has the realistic ones)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper



def _model(graph: onnx.GraphProto) -> onnx.ModelProto:
    """``graph`` at opset 17 and IR version 8, which every onnxruntime here reads (onnx's default IR version is
    newer than the device's onnxruntime reads: "Unsupported model IR version")."""
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model

def three_branch_model(seed: int = 0, channels: int = 4, size: int = 8, batch: int | str = 1) -> onnx.ModelProto:
    """input -> {Conv1x1, Conv3x3, Conv5x5} -> Relu each -> Concat: three independent branches."""
    rng = np.random.default_rng(seed)
    nodes, inits = [], []
    for i, k in enumerate([1, 3, 5]):
        w = numpy_helper.from_array((rng.standard_normal((channels, channels, k, k)) * 0.3).astype(np.float32), f"w{i}")
        b = numpy_helper.from_array(rng.standard_normal(channels).astype(np.float32), f"b{i}")
        inits += [w, b]
        nodes.append(helper.make_node("Conv", ["input", f"w{i}", f"b{i}"], [f"c{i}"], name=f"conv{i}", pads=[k // 2] * 4))
        nodes.append(helper.make_node("Relu", [f"c{i}"], [f"r{i}"], name=f"relu{i}"))
    nodes.append(helper.make_node("Concat", ["r0", "r1", "r2"], ["cat"], axis=1, name="concat"))
    nodes.append(helper.make_node("Sigmoid", ["cat"], ["output"], name="sigmoid"))
    graph = helper.make_graph(
        nodes, "three_branch",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [batch, channels, size, size])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, [batch, 3 * channels, size, size])],
        inits,
    )
    return _model(graph)


def two_output_model(seed: int = 0) -> onnx.ModelProto:
    """Two outputs, one of them also consumed downstream, and a chain feeding two consumers."""
    rng = np.random.default_rng(seed)
    w1 = numpy_helper.from_array(rng.standard_normal((16, 16)).astype(np.float32) * 0.2, "w1")
    w2 = numpy_helper.from_array(rng.standard_normal((16, 16)).astype(np.float32) * 0.2, "w2")
    w3 = numpy_helper.from_array(rng.standard_normal((16, 16)).astype(np.float32) * 0.2, "w3")
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
        helper.make_node("Tanh", ["h"], ["aux"], name="tanh"),
        helper.make_node("MatMul", ["aux", "w2"], ["a"], name="mm2"),
        helper.make_node("MatMul", ["aux", "w3"], ["b"], name="mm3"),
        helper.make_node("Add", ["a", "b"], ["y"], name="add"),
    ]
    graph = helper.make_graph(
        nodes, "two_output",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 16]), helper.make_tensor_value_info("aux", TensorProto.FLOAT, [2, 16])],
        [w1, w2, w3],
    )
    return _model(graph)


def nested_concat_model(seed: int = 0, c: int = 8, size: int = 12) -> onnx.ModelProto:
    """x -> three Conv+Relu; Concat(r1, r2) nested in Concat(r0, inner) (axis -3); the outer read by two Convs."""
    rng = np.random.default_rng(seed)
    nodes, inits = [], []
    for i, (k, co) in enumerate([(1, 4), (3, 6), (5, 2)]):
        inits += [numpy_helper.from_array((rng.standard_normal((co, c, k, k)) * 0.3).astype(np.float32), f"w{i}"),
                  numpy_helper.from_array(rng.standard_normal(co).astype(np.float32), f"b{i}")]
        nodes += [helper.make_node("Conv", ["x", f"w{i}", f"b{i}"], [f"c{i}"], name=f"conv{i}", pads=[k // 2] * 4),
                  helper.make_node("Relu", [f"c{i}"], [f"r{i}"], name=f"relu{i}")]
    nodes.append(helper.make_node("Concat", ["r1", "r2"], ["inner"], axis=1, name="inner_concat"))
    nodes.append(helper.make_node("Concat", ["r0", "inner"], ["outer"], axis=-3, name="outer_concat"))
    inits += [numpy_helper.from_array((rng.standard_normal((c, 12, 1, 1)) * 0.3).astype(np.float32), "wo"),
              numpy_helper.from_array((rng.standard_normal((c, 12, 3, 3)) * 0.3).astype(np.float32), "wp")]
    nodes += [helper.make_node("Conv", ["outer", "wo"], ["o1"], name="conv_out1"),
              helper.make_node("Conv", ["outer", "wp"], ["o2"], name="conv_out3", pads=[1] * 4),
              helper.make_node("Add", ["o1", "o2"], ["y"], name="add_out")]
    graph = helper.make_graph(nodes, "nested_concat", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c, size, size])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, c, size, size])], inits)
    return _model(graph)


def ort_reference(model: onnx.ModelProto, feeds: dict) -> dict:
    import onnxruntime as ort

    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds)))


def residual_stack_model(layers: int = 4, width: int = 32, tokens: int = 16, widths: list[int] | None = None,
                         seed: int = 0, final_norm: bool = False) -> onnx.ModelProto:
    """``layers`` pre-norm residual MLP blocks (LayerNorm, MatMul, bias Add, Relu, MatMul, residual Add) and a Relu
    (``final_norm``: a LayerNorm, as a transformer ends): a transformer's repetition in small.  ``widths``: each
    block's own hidden width (blocks of unequal code)."""
    rng = np.random.default_rng(seed)
    nodes, inits, x = [], [], "x"
    for i in range(layers):
        hidden = 2 * width if widths is None else widths[i]
        p = f"l{i}"
        inits += [numpy_helper.from_array(np.ones(width, np.float32), f"{p}.g"),
                  numpy_helper.from_array(np.zeros(width, np.float32), f"{p}.b"),
                  numpy_helper.from_array((rng.standard_normal((width, hidden)) * 0.1).astype(np.float32), f"{p}.w1"),
                  numpy_helper.from_array((rng.standard_normal(hidden) * 0.1).astype(np.float32), f"{p}.b1"),
                  numpy_helper.from_array((rng.standard_normal((hidden, width)) * 0.1).astype(np.float32), f"{p}.w2")]
        nodes += [helper.make_node("LayerNormalization", [x, f"{p}.g", f"{p}.b"], [f"{p}.ln"], axis=-1, name=f"{p}/ln"),
                  helper.make_node("MatMul", [f"{p}.ln", f"{p}.w1"], [f"{p}.m1"], name=f"{p}/mm1"),
                  helper.make_node("Add", [f"{p}.m1", f"{p}.b1"], [f"{p}.a1"], name=f"{p}/bias"),
                  helper.make_node("Relu", [f"{p}.a1"], [f"{p}.r"], name=f"{p}/relu"),
                  helper.make_node("MatMul", [f"{p}.r", f"{p}.w2"], [f"{p}.m2"], name=f"{p}/mm2"),
                  helper.make_node("Add", [f"{p}.m2", x], [f"{p}.out"], name=f"{p}/residual")]
        x = f"{p}.out"
    if final_norm:
        inits += [numpy_helper.from_array(np.ones(width, np.float32), "final.g"),
                  numpy_helper.from_array(np.zeros(width, np.float32), "final.b")]
        nodes.append(helper.make_node("LayerNormalization", [x, "final.g", "final.b"], ["y"], axis=-1, name="head"))
    else:
        nodes.append(helper.make_node("Relu", [x], ["y"], name="head"))
    graph = helper.make_graph(nodes, "residual_stack",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, tokens, width])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, tokens, width])], inits)
    return _model(graph)


def separable_as_nasnet(c: int = 40, size: int = 17, seed: int = 9) -> onnx.ModelProto:
    """NASNet's separable convolution: ReLU, a depthwise 5x5 without bias, a pointwise conv. At 40 channels and
    17x17 in fp16, a shape for which cuDNN (9.19, H200) compiles its kernel at run time: the plans it serializes."""
    rng = np.random.default_rng(seed)
    N = helper.make_node
    nodes = [N("Relu", ["x"], ["r"], name="relu"),
             N("Conv", ["r", "dw"], ["d"], name="depthwise", pads=[2, 2, 2, 2], group=c),
             N("Conv", ["d", "pw"], ["y"], name="pointwise")]
    graph = helper.make_graph(nodes, "separable_as_nasnet",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c, size, size])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array((rng.standard_normal(shape) * 0.3).astype(np.float32), name)
                               for name, shape in (("dw", (c, 1, 5, 5)), ("pw", (c, c, 1, 1)))])
    return onnx.shape_inference.infer_shapes(_model(graph))


def classifier_cnn_model(seed: int = 0, channels: int = 8, size: int = 8, classes: int = 10, *,
                         tail: int = 0, matmul_in_body: bool = False, depthwise: bool = False) -> onnx.ModelProto:
    """A CNN with a classifier head: Conv -> Relu -> Conv -> Relu -> GlobalAveragePool -> Flatten -> Gemm, then
    ``tail`` Sigmoids after the Gemm (a head longer than a classifier's); ``matmul_in_body``: a 1x1 mixing of the
    channels as a MatMul between the convolutions (a matrix product outside the head); ``depthwise``: the second
    convolution depthwise (one group per channel)."""
    rng = np.random.default_rng(seed)
    c = channels
    inits = [numpy_helper.from_array((rng.standard_normal((c, 3, 3, 3)) * 0.3).astype(np.float32), "w0"),
             numpy_helper.from_array(rng.standard_normal(c).astype(np.float32), "b0"),
             numpy_helper.from_array((rng.standard_normal((c, 1 if depthwise else c, 3, 3)) * 0.2).astype(np.float32), "w1"),
             numpy_helper.from_array(rng.standard_normal(c).astype(np.float32), "b1"),
             numpy_helper.from_array((rng.standard_normal((classes, c)) * 0.3).astype(np.float32), "fc_w"),
             numpy_helper.from_array(rng.standard_normal(classes).astype(np.float32), "fc_b")]
    nodes = [helper.make_node("Conv", ["input", "w0", "b0"], ["c0"], name="conv0", pads=[1] * 4),
             helper.make_node("Relu", ["c0"], ["r0"], name="relu0")]
    body = "r0"
    if matmul_in_body:
        inits += [numpy_helper.from_array((rng.standard_normal((size, size)) * 0.3).astype(np.float32), "mix")]
        nodes.append(helper.make_node("MatMul", ["r0", "mix"], ["m0"], name="mix"))
        body = "m0"
    nodes += [helper.make_node("Conv", [body, "w1", "b1"], ["c1"], name="conv1", pads=[1] * 4, group=c if depthwise else 1),
              helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
              helper.make_node("GlobalAveragePool", ["r1"], ["pool"], name="pool"),
              helper.make_node("Flatten", ["pool"], ["flat"], name="flatten"),
              helper.make_node("Gemm", ["flat", "fc_w", "fc_b"], ["logits" if tail == 0 else "t0"], name="fc", transB=1)]
    for i in range(tail):
        nodes.append(helper.make_node("Sigmoid", [f"t{i}"], ["logits" if i == tail - 1 else f"t{i + 1}"], name=f"tail{i}"))
    graph = helper.make_graph(
        nodes, "classifier_cnn",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 3, size, size])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, classes])],
        inits,
    )
    return _model(graph)
