"""The example model zoo: small networks with the structure of real ones, random weights from a fixed seed.

Every model is opset 17, fp32, IR version 8, has static shapes, one input named ``input`` and one output named
``output``, a unique name on every node, passes ``onnx.checker`` with ``full_check`` and stays under 5 MB.
Generation is deterministic: the same seed gives the same bytes.

Weights are He-initialised (standard deviation √(2/fan_in)) ahead of a ReLU and √(1/fan_in) elsewhere, and the
BatchNormalization statistics sit near (0, 1), so activations stay of order one through the whole network.
BatchNormalization is kept as its own node after each Conv (folding it is a rewrite rule's job), and the
transformer's Q/K/V projections are three MatMuls of one input (merging them is another's).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
IR_VERSION = 8


class _Builder:
    """Accumulates nodes and initializers; node names are paths such as ``mixed_5b/branch3x3/conv``."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self._names: set[str] = set()

    def _unique(self, name: str) -> str:
        base, i = name, 1
        while name in self._names:
            i += 1
            name = f"{base}_{i}"
        self._names.add(name)
        return name

    def const(self, name: str, array) -> str:
        name = self._unique(name)
        self.inits.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def op(self, op: str, inputs: list[str], name: str, **attrs) -> str:
        name = self._unique(name)
        out = f"{name}:0"
        self.nodes.append(helper.make_node(op, inputs, [out], name=name, **attrs))
        return out

    def weight(self, name: str, shape: tuple, fan_in: int, gain: float = 2.0) -> str:
        std = np.sqrt(gain / fan_in)
        return self.const(name, (self.rng.standard_normal(shape) * std).astype(np.float32))

    def conv(self, x: str, cin: int, cout: int, k: int, name: str, stride: int = 1, group: int = 1,
             gain: float = 2.0, bias: bool = False) -> str:
        w = self.weight(f"{name}.weight", (cout, cin // group, k, k), fan_in=cin // group * k * k, gain=gain)
        inputs = [x, w]
        if bias:
            inputs.append(self.const(f"{name}.bias", (self.rng.standard_normal(cout) * 0.05).astype(np.float32)))
        return self.op("Conv", inputs, name, kernel_shape=[k, k], pads=[k // 2] * 4, strides=[stride, stride],
                       group=group)

    def bn(self, x: str, c: int, name: str) -> str:
        r = self.rng
        params = [
            self.const(f"{name}.scale", r.uniform(0.8, 1.2, c).astype(np.float32)),
            self.const(f"{name}.bias", (r.standard_normal(c) * 0.1).astype(np.float32)),
            self.const(f"{name}.mean", (r.standard_normal(c) * 0.1).astype(np.float32)),
            self.const(f"{name}.var", r.uniform(0.8, 1.2, c).astype(np.float32)),
        ]
        return self.op("BatchNormalization", [x, *params], name, epsilon=1e-3)

    def conv_bn_relu(self, x: str, cin: int, cout: int, k: int, prefix: str, stride: int = 1, relu: bool = True) -> str:
        y = self.bn(self.conv(x, cin, cout, k, f"{prefix}/conv", stride=stride), cout, f"{prefix}/bn")
        return self.op("Relu", [y], f"{prefix}/relu") if relu else y

    def linear(self, x: str, din: int, dout: int, name: str, gain: float = 1.0) -> str:
        """x·W + b as MatMul then Add (the form exporters emit for a 3-D input)."""
        y = self.op("MatMul", [x, self.weight(f"{name}.weight", (din, dout), fan_in=din, gain=gain)], f"{name}/matmul")
        b = self.const(f"{name}.bias", (self.rng.standard_normal(dout) * 0.02).astype(np.float32))
        return self.op("Add", [y, b], f"{name}/add")

    def model(self, graph_name: str, input_shape: list[int], output: str, doc: str) -> onnx.ModelProto:
        # Rename the last tensor to "output" so every zoo model has the same interface.
        for node in self.nodes:
            node.output[:] = ["output" if o == output else o for o in node.output]
            node.input[:] = ["output" if i == output else i for i in node.input]
        graph = helper.make_graph(self.nodes, graph_name,
                                  [helper.make_tensor_value_info("input", TensorProto.FLOAT, input_shape)],
                                  [helper.make_tensor_value_info("output", TensorProto.FLOAT, None)], self.inits)
        graph.doc_string = doc
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                                  producer_name="parastream.zoo", producer_version="1")
        model.ir_version = IR_VERSION
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
        model.graph.output[0].CopyFrom(inferred.graph.output[0])
        onnx.checker.check_model(model, full_check=True)
        return model


# ---------------------------------------------------------------------------------------------------------------
# Blocks: each takes the builder, the input tensor and its channels, and returns (output tensor, output channels).

def _inception(b: _Builder, x: str, cin: int, prefix: str,
               widths: tuple[int, int, int, int, int, int, int] = (64, 48, 64, 64, 96, 96, 32)) -> tuple[str, int]:
    """Inception-v3 block A (Mixed_5b, with its 5×5 branch as a 3×3): four branches joined by a Concat.

    widths = (1×1, 3×3 reduce, 3×3, double-3×3 reduce, double-3×3 first, double-3×3 second, pool projection).
    """
    w1, w3r, w3, wdr, wd1, wd2, wp = widths
    a = b.conv_bn_relu(x, cin, w1, 1, f"{prefix}/branch1x1")
    c = b.conv_bn_relu(x, cin, w3r, 1, f"{prefix}/branch3x3_1")
    c = b.conv_bn_relu(c, w3r, w3, 3, f"{prefix}/branch3x3_2")
    d = b.conv_bn_relu(x, cin, wdr, 1, f"{prefix}/branch3x3dbl_1")
    d = b.conv_bn_relu(d, wdr, wd1, 3, f"{prefix}/branch3x3dbl_2")
    d = b.conv_bn_relu(d, wd1, wd2, 3, f"{prefix}/branch3x3dbl_3")
    p = b.op("AveragePool", [x], f"{prefix}/branch_pool/avgpool", kernel_shape=[3, 3], strides=[1, 1],
             pads=[1, 1, 1, 1], count_include_pad=0)
    p = b.conv_bn_relu(p, cin, wp, 1, f"{prefix}/branch_pool")
    return b.op("Concat", [a, c, d, p], f"{prefix}/concat", axis=1), w1 + w3 + wd2 + wp


def _bottleneck(b: _Builder, x: str, cin: int, mid: int, cout: int, prefix: str, stride: int = 1) -> tuple[str, int]:
    """ResNet bottleneck: 1×1 → 3×3 (stride) → 1×1 with BN/ReLU, a 1×1 projection shortcut, Add, ReLU."""
    y = b.conv_bn_relu(x, cin, mid, 1, f"{prefix}/conv1")
    y = b.conv_bn_relu(y, mid, mid, 3, f"{prefix}/conv2", stride=stride)
    y = b.conv_bn_relu(y, mid, cout, 1, f"{prefix}/conv3", relu=False)
    s = b.conv_bn_relu(x, cin, cout, 1, f"{prefix}/downsample", stride=stride, relu=False)
    return b.op("Relu", [b.op("Add", [y, s], f"{prefix}/add")], f"{prefix}/relu"), cout


def _separable(b: _Builder, x: str, c: int, k: int, prefix: str) -> str:
    """Separable k×k conv: depthwise Conv (group = channels), pointwise 1×1 Conv, BN (input already ReLU'd)."""
    y = b.conv(x, c, c, k, f"{prefix}/depthwise", group=c)
    y = b.conv(y, c, c, 1, f"{prefix}/pointwise", gain=1.0)
    return b.bn(y, c, f"{prefix}/bn")


def _nasnet(b: _Builder, x: str, cin: int, c: int, prefix: str) -> tuple[str, int]:
    """NASNet-A normal cell, with the cell's two inputs (h, h_prev) both adjusted from one tensor.

    Five blocks, each the Add of two ops on h or h_prev, and a Concat of h_prev with the five block outputs:
      1. 3×3 conv(h) + 1×1 conv(h)         2. sep 3×3(h_prev) + sep 5×5(h)      3. avg 3×3(h) + h_prev
      4. avg 3×3(h_prev) + max 3×3(h_prev)  5. sep 5×5(h_prev) + sep 3×3(h_prev)
    """
    r = b.op("Relu", [x], f"{prefix}/relu")
    h = b.bn(b.conv(r, cin, c, 1, f"{prefix}/h/conv"), c, f"{prefix}/h/bn")
    hp = b.bn(b.conv(r, cin, c, 1, f"{prefix}/h_prev/conv"), c, f"{prefix}/h_prev/bn")
    rh = b.op("Relu", [h], f"{prefix}/h/relu")
    rp = b.op("Relu", [hp], f"{prefix}/h_prev/relu")
    pool = dict(kernel_shape=[3, 3], strides=[1, 1], pads=[1, 1, 1, 1])

    b1 = b.op("Add", [b.conv(rh, c, c, 3, f"{prefix}/block1/conv3x3", gain=1.0, bias=True),
                      b.conv(rh, c, c, 1, f"{prefix}/block1/conv1x1", gain=1.0, bias=True)], f"{prefix}/block1/add")
    b2 = b.op("Add", [_separable(b, rp, c, 3, f"{prefix}/block2/sep3x3"),
                      _separable(b, rh, c, 5, f"{prefix}/block2/sep5x5")], f"{prefix}/block2/add")
    b3 = b.op("Add", [b.op("AveragePool", [h], f"{prefix}/block3/avgpool", count_include_pad=0, **pool), hp],
              f"{prefix}/block3/add")
    b4 = b.op("Add", [b.op("AveragePool", [hp], f"{prefix}/block4/avgpool", count_include_pad=0, **pool),
                      b.op("MaxPool", [hp], f"{prefix}/block4/maxpool", **pool)], f"{prefix}/block4/add")
    b5 = b.op("Add", [_separable(b, rp, c, 5, f"{prefix}/block5/sep5x5"),
                      _separable(b, rp, c, 3, f"{prefix}/block5/sep3x3")], f"{prefix}/block5/add")
    return b.op("Concat", [hp, b1, b2, b3, b4, b5], f"{prefix}/concat", axis=1), 6 * c


def _encoder_layer(b: _Builder, x: str, seq: int, d: int, heads: int, ff: int, prefix: str) -> str:
    """Pre-norm transformer encoder layer: x + Attn(LN(x)), then r + MLP(LN(r)) with the Erf form of GELU.

    Attn: softmax(Q·Kᵀ / √d_head)·V per head, Q/K/V = LN(x)·W + b as three MatMuls of the same tensor.
    GELU(z) = 0.5·z·(1 + erf(z / √2)).
    """
    dh = d // heads

    def layer_norm(t: str, name: str) -> str:
        return b.op("LayerNormalization", [t, b.const(f"{name}.scale", np.ones(d, np.float32)),
                                           b.const(f"{name}.bias", np.zeros(d, np.float32))], name, axis=-1, epsilon=1e-5)

    def split_heads(t: str, name: str) -> str:
        shape = b.const(f"{name}.shape", np.array([1, seq, heads, dh], np.int64))
        return b.op("Transpose", [b.op("Reshape", [t, shape], f"{name}/reshape")], f"{name}/transpose", perm=[0, 2, 1, 3])

    ln1 = layer_norm(x, f"{prefix}/ln1")
    q = split_heads(b.linear(ln1, d, d, f"{prefix}/attn/q"), f"{prefix}/attn/q_heads")
    k = split_heads(b.linear(ln1, d, d, f"{prefix}/attn/k"), f"{prefix}/attn/k_heads")
    v = split_heads(b.linear(ln1, d, d, f"{prefix}/attn/v"), f"{prefix}/attn/v_heads")
    # Kᵀ as its own Transpose after the head split, the way exporters write k.transpose(-2, -1).
    kt = b.op("Transpose", [k], f"{prefix}/attn/k_transpose", perm=[0, 1, 3, 2])
    s = b.op("MatMul", [q, kt], f"{prefix}/attn/scores")
    s = b.op("Mul", [s, b.const(f"{prefix}/attn/scale.value", np.array(1.0 / np.sqrt(dh), np.float32))],
             f"{prefix}/attn/scale")
    a = b.op("MatMul", [b.op("Softmax", [s], f"{prefix}/attn/softmax", axis=-1), v], f"{prefix}/attn/context")
    a = b.op("Transpose", [a], f"{prefix}/attn/merge_heads/transpose", perm=[0, 2, 1, 3])
    a = b.op("Reshape", [a, b.const(f"{prefix}/attn/merge_heads.shape", np.array([1, seq, d], np.int64))],
             f"{prefix}/attn/merge_heads/reshape")
    r = b.op("Add", [x, b.linear(a, d, d, f"{prefix}/attn/out")], f"{prefix}/residual1")

    h = b.linear(layer_norm(r, f"{prefix}/ln2"), d, ff, f"{prefix}/mlp/fc1", gain=2.0)
    e = b.op("Erf", [b.op("Div", [h, b.const(f"{prefix}/mlp/gelu/sqrt2", np.array(np.sqrt(2.0), np.float32))],
                          f"{prefix}/mlp/gelu/div")], f"{prefix}/mlp/gelu/erf")
    e = b.op("Add", [e, b.const(f"{prefix}/mlp/gelu/one", np.array(1.0, np.float32))], f"{prefix}/mlp/gelu/add")
    g = b.op("Mul", [b.op("Mul", [h, e], f"{prefix}/mlp/gelu/mul"),
                     b.const(f"{prefix}/mlp/gelu/half", np.array(0.5, np.float32))], f"{prefix}/mlp/gelu/mul_half")
    return b.op("Add", [r, b.linear(g, ff, d, f"{prefix}/mlp/fc2")], f"{prefix}/residual2")


# ---------------------------------------------------------------------------------------------------------------
# Models

def inception_block(seed: int = 0) -> onnx.ModelProto:
    """Inception-v3 block A at its real size: [1,192,35,35] → [1,256,35,35]; 23 nodes, four branches."""
    b = _Builder(seed)
    out, _ = _inception(b, "input", 192, "mixed_5b")
    return b.model("inception_block", [1, 192, 35, 35], out, inception_block.__doc__)


def nasnet_cell(seed: int = 0) -> onnx.ModelProto:
    """NASNet-A normal cells, two in a row as in a NASNet stage: [1,64,28,28] → [1,192,28,28].

    Each cell's output is a Concat of six 32-channel pieces; the second cell starts with a ReLU of it.
    """
    b = _Builder(seed)
    x, c = _nasnet(b, "input", 64, 32, "cell_0")
    out, _ = _nasnet(b, x, c, 32, "cell_1")
    return b.model("nasnet_cell", [1, 64, 28, 28], out, nasnet_cell.__doc__)


def transformer_layer(seed: int = 0) -> onnx.ModelProto:
    """A BERT-sized-head transformer encoder layer: [1,128,256] → [1,128,256], 4 heads, MLP width 1024."""
    b = _Builder(seed)
    out = _encoder_layer(b, "input", seq=128, d=256, heads=4, ff=1024, prefix="encoder_0")
    return b.model("transformer_layer", [1, 128, 256], out, transformer_layer.__doc__)


def resnet_bottleneck(seed: int = 0) -> onnx.ModelProto:
    """A ResNet-50 stage-2-style bottleneck with projection shortcut: [1,128,28,28] → [1,256,28,28]."""
    b = _Builder(seed)
    out, _ = _bottleneck(b, "input", 128, 64, 256, "layer2_0")
    return b.model("resnet_bottleneck", [1, 128, 28, 28], out, resnet_bottleneck.__doc__)


def small_net(seed: int = 0) -> onnx.ModelProto:
    """A whole small classifier: [1,3,64,64] → [1,10].

    stem 3×3/2 conv → two Inception-v3 A blocks → ResNet bottleneck /2 → two NASNet-A normal cells →
    global average pool → Flatten → Gemm.
    """
    b = _Builder(seed)
    x = b.conv_bn_relu("input", 3, 32, 3, "stem", stride=2)                               # 32 × 32×32
    x, c = _inception(b, x, 32, "mixed_0", widths=(16, 12, 16, 16, 24, 24, 8))           # 64
    x, c = _inception(b, x, c, "mixed_1", widths=(16, 12, 16, 16, 24, 24, 8))            # 64
    x, c = _bottleneck(b, x, c, 32, 128, "layer_0", stride=2)                            # 128 × 16×16
    x, c = _nasnet(b, x, c, 32, "cell_0")                                                 # 192
    x, c = _nasnet(b, x, c, 32, "cell_1")                                                 # 192
    x = b.op("Flatten", [b.op("GlobalAveragePool", [x], "head/avgpool")], "head/flatten", axis=1)
    w = b.weight("head/fc.weight", (10, c), fan_in=c, gain=1.0)
    out = b.op("Gemm", [x, w, b.const("head/fc.bias", np.zeros(10, np.float32))], "head/fc", transB=1)
    return b.model("small_net", [1, 3, 64, 64], out, small_net.__doc__)


MODELS: dict[str, Callable[[], onnx.ModelProto]] = {
    "inception_block": inception_block,
    "nasnet_cell": nasnet_cell,
    "transformer_layer": transformer_layer,
    "resnet_bottleneck": resnet_bottleneck,
    "small_net": small_net,
}
DEMO_MODEL = "small_net"


def write_all(folder: str | Path) -> list[Path]:
    """Write every zoo model to ``folder/<name>.onnx``; returns the paths in MODELS order."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, make in MODELS.items():
        path = folder / f"{name}.onnx"
        path.write_bytes(make().SerializeToString())
        paths.append(path)
    return paths
