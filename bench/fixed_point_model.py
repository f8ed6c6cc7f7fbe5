#!/usr/bin/env python3
"""Writes a model whose load runs the loader's fixed-point folding with large weights: a chain of convolutions
(default 30 of 512 channels: 283 MB of fp32 weights), each padded by pads computed from its input's shape at run
time (as timm's "same" padding exports: Shape -> Gather -> arithmetic -> Concat -> Pad; the Mod keeps ONNX's data
propagation from resolving it), so that each folding pass resolves one layer.  bench/CPU_NOTES.md's "The front
end of a large model" times ``load_model`` on it.

    python3 bench/fixed_point_model.py OUT.onnx [--layers 30] [--channels 512] [--size 28]
"""

from __future__ import annotations

import argparse

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def fixed_point_model(layers: int = 30, channels: int = 512, size: int = 28, seed: int = 0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    inits = [numpy_helper.from_array(np.array([v], np.int64), name)
             for name, v in (("two", 2), ("three", 3), ("zero", 0), ("k", 3), ("one", 1))]
    nodes, x = [], "x"
    for i in range(layers):
        w = (rng.standard_normal((channels, channels, 3, 3)) * 0.02).astype(np.float32)
        inits.append(numpy_helper.from_array(w, f"w{i}_"))
        nodes += [helper.make_node("Shape", [x], [f"s{i}"]),
                  helper.make_node("Gather", [f"s{i}", "two"], [f"h{i}"], axis=0),
                  helper.make_node("Gather", [f"s{i}", "three"], [f"w{i}"], axis=0),
                  helper.make_node("Sub", ["k", "one"], [f"km{i}"]),
                  helper.make_node("Mod", [f"h{i}", "one"], [f"hm{i}"]),
                  helper.make_node("Add", [f"km{i}", f"hm{i}"], [f"tot{i}"]),
                  helper.make_node("Div", [f"tot{i}", "two"], [f"lo{i}"]),
                  helper.make_node("Sub", [f"tot{i}", f"lo{i}"], [f"hi{i}"]),
                  helper.make_node("Concat", ["zero", "zero", f"lo{i}", f"lo{i}", "zero", "zero", f"hi{i}", f"hi{i}"],
                                   [f"pads{i}"], axis=0),
                  helper.make_node("Pad", [x, f"pads{i}"], [f"p{i}"]),
                  helper.make_node("Conv", [f"p{i}", f"w{i}_"], [f"y{i}"]),
                  helper.make_node("Relu", [f"y{i}"], [f"r{i}"])]
        x = f"r{i}"
    shape = [1, channels, size, size]
    graph = helper.make_graph(nodes, "same_pad_chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, shape)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--channels", type=int, default=512)
    ap.add_argument("--size", type=int, default=28)
    a = ap.parse_args()
    m = fixed_point_model(a.layers, a.channels, a.size)
    onnx.save(m, a.out)
    print(f"{a.out}: {len(m.graph.node)} nodes, {sum(t.ByteSize() for t in m.graph.initializer) / 1e6:.0f} MB of weights")


if __name__ == "__main__":
    main()
