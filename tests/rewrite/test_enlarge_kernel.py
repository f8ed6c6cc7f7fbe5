from __future__ import annotations

from onnx import helper

from parastream.rewrite.ir import export_model, import_graph
from parastream.rewrite.rules.enlarge_kernel import EnlargeKernel, ShrinkKernel
from parastream.rewrite.rules.merge_parallel_conv import MergeParallelConv

from rule_testing import apply_everywhere, assert_equivalent, model, ops, reasons, vi, weight

RULE = EnlargeKernel()


def siblings(small_pads=(0, 0, 0, 0), big_pads=(1, 1, 1, 1), small_strides=(1, 1), dilations=(1, 1)):
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["a"], name="conv1x1", pads=list(small_pads), strides=list(small_strides),
                         dilations=list(dilations)),
        helper.make_node("Conv", ["x", "w3"], ["b"], name="conv3x3", pads=list(big_pads), dilations=list(dilations)),
    ]
    return model(nodes, [vi("x", [1, 6, 10, 10])], [vi("a", None), vi("b", None)],
                 [weight("w1", (5, 6, 1, 1), 0), weight("b1", (5,), 0), weight("w3", (5, 6, 3, 3), 1)])


def test_enlarged_kernel_is_equivalent_and_merges():
    m = siblings()
    out, fired = apply_everywhere(RULE, m, limit=1)
    assert fired == ["enlarge_kernel:conv1x1+conv3x3"]
    assert_equivalent(m, out)
    merged, fired = apply_everywhere(MergeParallelConv(), out)
    assert fired and ops(merged).count("Conv") == 1
    assert_equivalent(m, merged)


def test_enlarge_with_dilation():
    m = siblings(small_pads=(0, 0, 0, 0), big_pads=(2, 2, 2, 2), dilations=(2, 2))
    out, fired = apply_everywhere(RULE, m, limit=1)
    assert fired
    assert_equivalent(m, out)


def test_shrink_undoes_enlarge():
    m = siblings()
    enlarged, _ = apply_everywhere(RULE, m, limit=1)
    back, fired = apply_everywhere(ShrinkKernel(), enlarged)
    assert fired == ["shrink_kernel:conv1x1"]
    assert_equivalent(m, back)
    w = {i.name: i for i in back.graph.initializer}
    conv = next(n for n in back.graph.node if n.name == "conv1x1")
    assert list(w[conv.input[1]].dims) == [5, 6, 1, 1]


def test_does_not_fire_when_pads_would_not_match():
    m = siblings(big_pads=(0, 0, 0, 0))  # a VALID 3x3 next to a 1x1: outputs differ in size anyway
    _, fired = apply_everywhere(RULE, m, limit=1)
    assert fired == []
    assert any("pads" in r for r in reasons(RULE, m))


def test_does_not_fire_when_strides_differ():
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["a"], name="c1", strides=[2, 2]),
        helper.make_node("Conv", ["x", "w3"], ["b"], name="c3", pads=[1, 1, 1, 1], strides=[1, 1]),
    ]
    m = model(nodes, [vi("x", [1, 4, 8, 8])], [vi("a", None), vi("b", None)],
              [weight("w1", (4, 4, 1, 1), 0), weight("w3", (4, 4, 3, 3), 1)])
    _, fired = apply_everywhere(RULE, m, limit=1)
    assert fired == []
    assert any("strides" in r for r in reasons(RULE, m))


def test_shrink_needs_the_pads():
    nodes = [helper.make_node("Conv", ["x", "w"], ["y"], name="c", pads=[0, 0, 0, 0])]
    import numpy as np
    from onnx import numpy_helper

    w = np.zeros((2, 2, 3, 3), np.float32)
    w[:, :, 1, 1] = 1.0
    m = model(nodes, [vi("x", [1, 2, 5, 5])], [vi("y", None)], [numpy_helper.from_array(w, "w")])
    _, fired = apply_everywhere(ShrinkKernel(), m)
    assert fired == []
    assert any("too small" in r for r in reasons(ShrinkKernel(), m))


def test_on_example_model(zoo_model):
    m = zoo_model("nasnet_cell")
    g = import_graph(m)
    safe = [s for s, r in RULE.sites(g) if r is None]
    assert safe, "a NASNet cell has Convs of different kernel sizes on one input"
    out = export_model(RULE.apply(g, safe[0]), m)
    assert_equivalent(m, out)
