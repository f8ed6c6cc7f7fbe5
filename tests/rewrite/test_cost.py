"""Cost models: device table, FLOPs/bytes, roofline, list-scheduled graph cost, profiled cache."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto, helper, numpy_helper, shape_inference

from parastream.core.errors import ParastreamError
from parastream.core.schedule import ENGINE_COST, EVENT_COST, estimate_latency, schedule_graph
from parastream.rewrite.cost import (
    DEVICES,
    CostModel,
    ProfiledCostModel,
    RooflineCostModel,
    _GraphCostMixin,
    get_device,
    mixed_cost,
    node_flops_bytes,
    ort_measure,
)


def _graph(nodes, inputs, outputs, inits=()):
    g = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    return gs.import_onnx(shape_inference.infer_shapes(m))


def _vi(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def _w(name, shape, seed=0):
    return numpy_helper.from_array(np.random.default_rng(seed).standard_normal(shape).astype(np.float32), name)


def parallel_branches(n: int = 3, c: int = 16, size: int = 14):
    nodes, inits = [], []
    for i in range(n):
        inits.append(_w(f"w{i}", (c, c, 3, 3), i))
        nodes.append(helper.make_node("Conv", ["x", f"w{i}"], [f"c{i}"], name=f"conv{i}", pads=[1, 1, 1, 1]))
    nodes.append(helper.make_node("Concat", [f"c{i}" for i in range(n)], ["y"], axis=1, name="cat"))
    return _graph(nodes, [_vi("x", [1, c, size, size])], [_vi("y", [1, n * c, size, size])], inits)


def test_device_table_has_the_issue_devices():
    for name in ("H100-SXM", "H100-PCIe", "H200", "A100-SXM", "L40S", "L4", "T4", "RTX-4090"):
        d = DEVICES[name]
        assert d.fp16_flops > d.fp32_flops > 0 and d.bandwidth > 1e11 and d.sms > 0
    assert get_device("h100 sxm") is DEVICES["H100-SXM"]
    assert get_device("a100") is DEVICES["A100-SXM"]
    with pytest.raises(ParastreamError, match="device table"):
        get_device("Voodoo3")


def test_flops_of_conv_matmul_gemm():
    g = _graph(
        [helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
         helper.make_node("Reshape", ["c", "shape"], ["r"], name="reshape"),
         helper.make_node("MatMul", ["r", "m"], ["mm"], name="matmul"),
         helper.make_node("Gemm", ["mm", "g"], ["y"], name="gemm", transB=1),
         helper.make_node("Relu", ["y"], ["out"], name="relu")],
        [_vi("x", [1, 3, 8, 8])], [_vi("out", [1, 5])],
        [_w("w", (4, 3, 3, 3)), _w("b", (4,)), numpy_helper.from_array(np.array([1, 256], np.int64), "shape"),
         _w("m", (256, 10)), _w("g", (5, 10))],
    )
    by = {n.name: n for n in g.nodes}
    f, b = node_flops_bytes(by["conv"])
    assert f == 2 * (4 * 8 * 8) * (3 * 3 * 3)  # the bias rides in the epilogue
    assert b == 4 * (3 * 64 + 4 * 27 + 4 + 4 * 64)
    assert node_flops_bytes(by["reshape"]) == (0.0, 0.0)
    assert node_flops_bytes(by["matmul"])[0] == 2 * 10 * 256
    assert node_flops_bytes(by["gemm"])[0] == 2 * 5 * 10
    assert node_flops_bytes(by["relu"]) == (5.0, 40.0)
    # an fp16 engine moves half the bytes
    assert node_flops_bytes(by["relu"], float_bytes=2)[1] == 20.0


def test_roofline_floor_memory_bound_and_no_gpu():
    g = parallel_branches()
    cm = RooflineCostModel("H100-SXM", kernel_floor=3e-6)
    assert isinstance(cm, CostModel)
    conv = next(n for n in g.nodes if n.op == "Conv")
    cat = next(n for n in g.nodes if n.op == "Concat")
    assert cm.node_cost(conv) > 3e-6 and cm.node_cost(cat) > 3e-6
    assert cm.is_memory_bound(cat) and not cm.is_memory_bound(conv)
    # fp16 is never slower than fp32 on the same device
    assert RooflineCostModel("H100-SXM", "fp16").node_cost(conv) <= cm.node_cost(conv)


def test_graph_cost_streams_shorten_the_critical_path_not_the_work():
    """The critical path is the shipped schedule's latency: one engine on one stream; on three, the Convs side by
    side, the Concat after them in a fourth engine that waits on one event (its heaviest producer's stream
    needs none)."""
    g = parallel_branches(3)
    cm = RooflineCostModel()
    cp1, work1 = cm.graph_cost(g, 1)
    cp3, work3 = cm.graph_cost(g, 3)
    assert cp1 == pytest.approx(work1 + ENGINE_COST) and work3 == pytest.approx(work1)
    conv = cm.node_cost(next(n for n in g.nodes if n.op == "Conv"))
    cat = cm.node_cost(next(n for n in g.nodes if n.op == "Concat"))
    assert cp3 == pytest.approx(conv + cat + 2 * ENGINE_COST + EVENT_COST)
    assert cp3 < cp1
    assert mixed_cost(cp3, work3) == pytest.approx(0.25 * cp3 + 0.75 * work3)


@pytest.mark.parametrize("name", ["inception_block", "nasnet_cell", "transformer_layer"])
def test_graph_cost_is_the_shipped_schedules_estimate(name):
    """The search's critical path on K streams is, to the bit, ``estimate_latency`` of the schedule the build
    ships on K streams (one scheduler for both), for the roofline and for a cost model without per-graph figures."""
    from parastream.pipeline import zoo
    from parastream.rewrite.ir import import_graph

    g = import_graph(zoo.MODELS[name]())

    class Plain:  # node_cost and is_memory_bound only: graph_cost's generic path
        def __init__(self):
            self.roofline = RooflineCostModel("A100-SXM", precision="fp16")

        def node_cost(self, node):
            return self.roofline.node_cost(node)

        def is_memory_bound(self, node):
            return self.roofline.is_memory_bound(node)

    for cm in (RooflineCostModel("CPU"), RooflineCostModel("A100-SXM", precision="fp16")):
        for k in (1, 2, 4):
            sched = schedule_graph(g, k, cm.node_cost, cm.is_memory_bound)
            cp, work = cm.graph_cost(g, k)
            assert cp == estimate_latency(sched)
            assert work == pytest.approx(sum(cm.node_cost(n) for n in g.nodes), rel=1e-12)
    plain = Plain()
    assert _GraphCostMixin.graph_cost(plain, g, 2) == plain.roofline.graph_cost(g, 2)


def test_profiled_cost_model_measures_each_signature_once_and_uses_the_cache(tmp_path):
    g = parallel_branches(3)  # three Convs of one signature, one Concat
    cache = tmp_path / "cost.json"
    calls = []
    inner = ort_measure(repeats=3)

    def measure(model: onnx.ModelProto) -> float:
        onnx.checker.check_model(model)
        calls.append(model.graph.node[0].op_type)
        return inner(model)

    first = ProfiledCostModel(measure, cache, device="cpu-test", backend="onnxruntime", precision="fp32")
    cp, work = first.graph_cost(g, 2)
    assert sorted(calls) == ["Concat", "Conv"] and first.measured == 2
    assert 0 < cp <= work
    data = json.loads(cache.read_text())
    assert data["version"] == 1 and len(data["entries"]) == 2
    assert all(k.startswith("cpu-test|onnxruntime|fp32|") for k in data["entries"])

    calls.clear()
    second = ProfiledCostModel(measure, cache, device="cpu-test", backend="onnxruntime", precision="fp32")
    assert second.graph_cost(g, 2) == (cp, work)
    assert calls == [] and second.measured == 0

    # another precision is another key: measured again
    third = ProfiledCostModel(measure, cache, device="cpu-test", backend="onnxruntime", precision="fp16")
    third.graph_cost(g, 2)
    assert third.measured == 2


def test_profiled_falls_back_when_measurement_fails(tmp_path):
    g = parallel_branches(2)

    def broken(model):
        raise RuntimeError("no kernel")

    cm = ProfiledCostModel(broken, tmp_path / "c.json", device="H100-SXM")
    conv = next(n for n in g.nodes if n.op == "Conv")
    assert cm.node_cost(conv) == RooflineCostModel("H100-SXM").node_cost(conv)
    assert "conv0" in cm.failures or "conv1" in cm.failures


def test_elementwise_epilogues_of_a_conv_are_free():
    g = _graph(
        [helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
         helper.make_node("Mul", ["c", "s"], ["m"], name="scale"),
         helper.make_node("Relu", ["m"], ["r"], name="relu"),
         helper.make_node("Sigmoid", ["x"], ["y"], name="sig"),
         helper.make_node("Relu", ["c2"], ["z"], name="relu_shared"),
         helper.make_node("Conv", ["x", "w"], ["c2"], name="conv2"),
         helper.make_node("Tanh", ["c2"], ["t"], name="tanh_shared")],
        [_vi("x", [1, 4, 8, 8])], [_vi("r", None), _vi("y", None), _vi("z", None), _vi("t", None)],
        [_w("w", (4, 4, 1, 1)), _w("s", (4, 1, 1))],
    )
    by = {n.name: n for n in g.nodes}
    cm = RooflineCostModel()
    assert cm.node_cost(by["relu"]) == 0.0
    assert cm.node_cost(by["scale"]) == 4 * 4 / cm.device.bandwidth  # reads its 4 constants, nothing else
    assert cm.node_cost(by["sig"]) > 0.0  # reads a graph input: a kernel of its own
    assert cm.node_cost(by["relu_shared"]) > 0.0  # the Conv output has two readers: it is written out
    assert RooflineCostModel(fuse_epilogues=False).node_cost(by["relu"]) > 0.0
