"""Shared pieces of the rule tests: build a tiny model, apply a rule, compare through ONNX Runtime."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from parastream.rewrite.ir import export_model, import_graph

RTOL = 1e-4


def vi(name, shape, dtype=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, dtype, shape)


def weight(name, shape, seed, scale=0.3):
    rng = np.random.default_rng(abs(hash((name, seed))) % 2**32)
    return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)


def ints(name, values):
    return numpy_helper.from_array(np.asarray(values, dtype=np.int64), name)


def model(nodes, inputs, outputs, inits=(), opset=17) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "test", inputs, outputs, list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    return complete_outputs(m)


def complete_outputs(m: onnx.ModelProto) -> onnx.ModelProto:
    """Outputs declared without a shape get the inferred one; then the model must pass the full check."""
    inferred = onnx.shape_inference.infer_shapes(m, strict_mode=True)
    known = {v.name: v for v in inferred.graph.output}
    for o in m.graph.output:
        if not o.type.tensor_type.HasField("shape") and o.name in known:
            o.CopyFrom(known[o.name])
    onnx.checker.check_model(m, full_check=True)
    return m


def run(m: onnx.ModelProto, feeds: dict) -> dict:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # compare our rewrite, not ORT's
    sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds)))


def random_feeds(m: onnx.ModelProto, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    inits = {i.name for i in m.graph.initializer}
    feeds = {}
    for i in m.graph.input:
        if i.name in inits:
            continue
        shape = [d.dim_value if d.HasField("dim_value") else 1 for d in i.type.tensor_type.shape.dim]
        feeds[i.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


def assert_equivalent(original: onnx.ModelProto, rewritten: onnx.ModelProto, trials: int = 3, rtol: float = RTOL):
    """Same outputs (names, shapes, values to ``rtol`` relative to the output's scale) on fresh random inputs."""
    assert [o.name for o in original.graph.output] == [o.name for o in rewritten.graph.output]
    assert [i.name for i in original.graph.input if i.name not in {t.name for t in original.graph.initializer}] == \
        [i.name for i in rewritten.graph.input if i.name not in {t.name for t in rewritten.graph.initializer}]
    for trial in range(trials):
        feeds = random_feeds(original, seed=1000 + trial)
        a, b = run(original, feeds), run(rewritten, feeds)
        for name in a:
            assert a[name].shape == b[name].shape, name
            scale = max(float(np.max(np.abs(a[name]))), 1e-6)
            err = float(np.max(np.abs(a[name] - b[name]))) / scale if a[name].size else 0.0
            assert err <= rtol, f"{name}: relative error {err:.3g} > {rtol}"


def apply_everywhere(rule, m: onnx.ModelProto, limit: int = 50):
    """Apply ``rule`` at its first safe site until none is left; return (model, keys of the sites that fired)."""
    graph = import_graph(m)
    fired = []
    for _ in range(limit):
        safe = [s for s, reason in rule.sites(graph) if reason is None]
        if not safe:
            break
        graph = rule.apply(graph, safe[0])
        fired.append(safe[0].key)
    return export_model(graph, m), fired


def reasons(rule, m: onnx.ModelProto) -> list[str]:
    graph = import_graph(m)
    return [reason for _, reason in rule.sites(graph) if reason is not None]


def ops(m: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in m.graph.node]
