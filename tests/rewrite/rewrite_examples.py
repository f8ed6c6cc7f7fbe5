"""Small stand-ins of the example zoo's shapes of network, built with onnx.helper.

The rule tests run on ``parastream.pipeline.zoo`` (see conftest.py); these models add the patterns the zoo
may not have (BatchNormalization after a Conv, Q/K/V with bias, Transpose pairs) and keep the tests
independent of how the zoo evolves.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


class _Builder:
    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.nodes, self.inits, self.n = [], [], 0

    def name(self, base):
        self.n += 1
        return f"{base}{self.n}"

    def const(self, array, base="c"):
        name = self.name(base)
        self.inits.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def w(self, shape, scale=None):
        fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else shape[0]
        scale = scale or 1.0 / np.sqrt(fan_in)
        return self.const((self.rng.standard_normal(shape) * scale).astype(np.float32), "w")

    def op(self, op, inputs, n_out=1, **attrs):
        name = self.name(op.lower())
        outs = [f"{name}_out{i}" if n_out > 1 else f"{name}_out" for i in range(n_out)]
        self.nodes.append(helper.make_node(op, inputs, outs, name=name, **attrs))
        return outs if n_out > 1 else outs[0]

    def conv_bn_relu(self, x, cin, cout, k, stride=1, bn=True):
        y = self.op("Conv", [x, self.w((cout, cin, k, k)), self.const(np.zeros(cout, np.float32), "b")],
                    pads=[k // 2] * 4, strides=[stride, stride])
        if bn:
            c = cout
            y = self.op("BatchNormalization", [y, self.const(self.rng.uniform(0.5, 1.5, c).astype(np.float32), "g"),
                                               self.const(self.rng.standard_normal(c).astype(np.float32) * 0.1, "beta"),
                                               self.const(self.rng.standard_normal(c).astype(np.float32) * 0.1, "mu"),
                                               self.const(self.rng.uniform(0.5, 1.5, c).astype(np.float32), "var")])
        return self.op("Relu", [y])

    def model(self, name, inputs, outputs):
        g = helper.make_graph(self.nodes, name, [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs], self.inits)
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
        m.ir_version = 8
        inferred = onnx.shape_inference.infer_shapes(m, strict_mode=True)
        known = {v.name: v for v in inferred.graph.output}
        for o in m.graph.output:
            o.CopyFrom(known[o.name])
        onnx.checker.check_model(m, full_check=True)
        return m


def inception_block(seed: int = 0, c: int = 32, size: int = 14) -> onnx.ModelProto:
    b = _Builder(seed)
    x = "input"
    a = b.conv_bn_relu(x, c, 16, 1)
    r3 = b.conv_bn_relu(x, c, 12, 1)
    a3 = b.conv_bn_relu(r3, 12, 16, 3)
    r5 = b.conv_bn_relu(x, c, 8, 1)
    a5 = b.conv_bn_relu(r5, 8, 8, 5)
    p = b.op("MaxPool", [x], kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    ap = b.conv_bn_relu(p, c, 8, 1)
    out = b.op("Concat", [a, a3, a5, ap], axis=1)
    return b.model("inception_block", [("input", [1, c, size, size])], [out])


def transformer_layer(seed: int = 0, seq: int = 16, d: int = 32, heads: int = 4) -> onnx.ModelProto:
    b = _Builder(seed)
    x = "input"
    dh = d // heads

    def proj(t, dout):
        y = b.op("MatMul", [t, b.w((d if dout != d * 4 or True else d, dout))])
        return b.op("Add", [y, b.const((b.rng.standard_normal(dout) * 0.1).astype(np.float32), "bias")])

    def heads_of(t):
        r = b.op("Reshape", [t, b.const(np.array([1, seq, heads, dh], np.int64), "shape")])
        return b.op("Transpose", [r], perm=[0, 2, 1, 3])

    q, k, v = heads_of(proj(x, d)), heads_of(proj(x, d)), heads_of(proj(x, d))
    kt = b.op("Transpose", [k], perm=[0, 1, 3, 2])
    s = b.op("Mul", [b.op("MatMul", [q, kt]), b.const(np.array(1.0 / np.sqrt(dh), np.float32), "scale")])
    a = b.op("MatMul", [b.op("Softmax", [s], axis=-1), v])
    a = b.op("Reshape", [b.op("Transpose", [a], perm=[0, 2, 1, 3]), b.const(np.array([1, seq, d], np.int64), "shape")])
    o = b.op("Add", [proj(a, d), x])
    ln = b.op("LayerNormalization", [o, b.const(np.ones(d, np.float32), "g"), b.const(np.zeros(d, np.float32), "beta")], axis=-1)
    h = b.op("Relu", [b.op("Add", [b.op("MatMul", [ln, b.w((d, 4 * d))]), b.const(np.zeros(4 * d, np.float32), "bias")])])
    f = b.op("Add", [b.op("MatMul", [h, b.w((4 * d, d))]), ln])
    return b.model("transformer_layer", [("input", [1, seq, d])], [f])


def resnet_bottleneck(seed: int = 0, c: int = 64, size: int = 14) -> onnx.ModelProto:
    b = _Builder(seed)
    x = "input"
    y = b.conv_bn_relu(x, c, c // 4, 1)
    y = b.conv_bn_relu(y, c // 4, c // 4, 3)
    y = b.op("Conv", [y, b.w((c, c // 4, 1, 1))])
    y = b.op("Mul", [y, b.const(b.rng.uniform(0.5, 1.5, (1, c, 1, 1)).astype(np.float32), "scale")])
    y = b.op("Add", [y, b.const(b.rng.standard_normal((c, 1, 1)).astype(np.float32) * 0.1, "shift")])
    out = b.op("Relu", [b.op("Add", [y, x])])
    return b.model("resnet_bottleneck", [("input", [1, c, size, size])], [out])


def nasnet_cell(seed: int = 0, c: int = 16, size: int = 12) -> onnx.ModelProto:
    b = _Builder(seed)
    x, h = "input", "prev"
    xs = [b.op("Relu", [x]), b.op("Relu", [h])]
    outs = []
    for i, (k1, k2) in enumerate([(3, 5), (1, 3), (3, 3)]):
        src = xs[i % 2]
        a = b.op("Conv", [src, b.w((c, c, k1, k1))], pads=[k1 // 2] * 4)
        bb = b.op("Conv", [src, b.w((c, c, k2, k2))], pads=[k2 // 2] * 4)
        outs.append(b.op("Add", [a, bb]))
    sp = b.op("Split", [b.op("Concat", outs, axis=1), b.const(np.array([c, 2 * c], np.int64), "sizes")], n_out=2, axis=1)
    out = b.op("Concat", [sp[0], sp[1], b.op("AveragePool", [xs[0]], kernel_shape=[3, 3], pads=[1, 1, 1, 1])], axis=1)
    return b.model("nasnet_cell", [("input", [1, c, size, size]), ("prev", [1, c, size, size])], [out])


def small_net(seed: int = 0) -> onnx.ModelProto:
    b = _Builder(seed)
    x = b.conv_bn_relu("input", 3, 32, 3, stride=2)
    for _ in range(2):
        br = [b.conv_bn_relu(x, 32, 8, 1), b.conv_bn_relu(b.conv_bn_relu(x, 32, 8, 1), 8, 8, 3),
              b.conv_bn_relu(b.conv_bn_relu(x, 32, 8, 1), 8, 8, 5), b.conv_bn_relu(b.op("MaxPool", [x], kernel_shape=[3, 3], pads=[1, 1, 1, 1]), 32, 8, 1)]
        x = b.op("Concat", br, axis=1)
    g = b.op("Flatten", [b.op("GlobalAveragePool", [x])])
    out = b.op("Gemm", [g, b.w((10, 32)), b.const(np.zeros(10, np.float32), "fcb")], transB=1)
    return b.model("small_net", [("input", [1, 3, 32, 32])], [out])


MODELS = {f.__name__: f for f in (inception_block, nasnet_cell, transformer_layer, resnet_bottleneck, small_net)}
