from __future__ import annotations

from onnx import helper

from parastream.rewrite.rules.merge_parallel_conv import MergeParallelConv
from parastream.rewrite.rules.split_concat import (ConcatSplit, HoistPointwiseConcat, HoistPointwiseSplit,
                                                   SinkPointwiseConcat, SplitConcat)

from rule_testing import apply_everywhere, assert_equivalent, ints, model, ops, reasons, vi, weight


def split_then_concat(concat_axis=1, order=("p", "q", "r")):
    nodes = [helper.make_node("Relu", ["x"], ["rx"], name="relu"),
             helper.make_node("Split", ["rx", "sizes"], ["p", "q", "r"], axis=1, name="split"),
             helper.make_node("Concat", ["x", *order], ["y"], axis=concat_axis, name="cat")]
    return model(nodes, [vi("x", [1, 6, 3, 3])], [vi("y", None)], [ints("sizes", [1, 2, 3])])


def test_split_concat_is_identity():
    m = split_then_concat()
    out, fired = apply_everywhere(SplitConcat(), m)
    assert fired == ["split_concat:split+cat"] and "Split" not in ops(out)
    assert_equivalent(m, out)


def test_split_concat_does_not_fire_out_of_order():
    m = split_then_concat(order=("q", "p", "r"))
    _, fired = apply_everywhere(SplitConcat(), m)
    assert fired == []
    assert any("in order" in r for r in reasons(SplitConcat(), m))


def test_concat_split_is_identity_and_checks_sizes():
    def build(sizes, reader):
        nodes = [helper.make_node("Concat", ["a", "b"], ["c"], axis=2, name="cat"),
                 helper.make_node("Split", ["c", "s"], ["p", "q"], axis=2, name="split"),
                 helper.make_node(reader, ["p", "q"], ["y"], name="reader", **({"axis": 2} if reader == "Concat" else {}))]
        return model(nodes, [vi("a", [2, 3, 4]), vi("b", [2, 3, 4])], [vi("y", None)], [ints("s", sizes)])

    m = build([4, 4], "Sub")
    out, fired = apply_everywhere(ConcatSplit(), m)
    assert fired and ops(out) == ["Sub"]
    assert_equivalent(m, out)
    bad = build([3, 5], "Concat")
    assert apply_everywhere(ConcatSplit(), bad)[1] == []
    assert any("cuts [3, 5]" in r for r in reasons(ConcatSplit(), bad))


def pointwise_branches(ops_=("Relu", "Relu"), scalar=None):
    nodes = [helper.make_node("Conv", ["x", f"w{i}"], [f"c{i}"], name=f"conv{i}") for i in range(2)]
    for i, op in enumerate(ops_):
        if scalar is None:
            nodes.append(helper.make_node(op, [f"c{i}"], [f"a{i}"], name=f"act{i}"))
        else:
            nodes.append(helper.make_node(op, [f"c{i}", f"s{i}"], [f"a{i}"], name=f"act{i}"))
    nodes.append(helper.make_node("Concat", ["a0", "a1"], ["y"], axis=1, name="cat"))
    inits = [weight("w0", (2, 3, 1, 1), 0), weight("w1", (3, 3, 1, 1), 1)]
    if scalar is not None:
        import numpy as np
        from onnx import numpy_helper

        inits += [numpy_helper.from_array(np.array([v], np.float32), f"s{i}") for i, v in enumerate(scalar)]
    return model(nodes, [vi("x", [1, 3, 4, 4])], [vi("y", None)], inits)


def test_hoist_and_sink_pointwise_over_concat():
    m = pointwise_branches()
    hoisted, fired = apply_everywhere(HoistPointwiseConcat(), m)
    assert fired == ["hoist_pointwise_concat:cat"] and ops(hoisted).count("Relu") == 1
    assert_equivalent(m, hoisted)
    sunk, fired = apply_everywhere(SinkPointwiseConcat(), hoisted, limit=1)
    assert fired and ops(sunk).count("Relu") == 2
    assert_equivalent(m, sunk)


def test_hoist_with_scalar_constant():
    m = pointwise_branches(("Mul", "Mul"), scalar=(0.5, 0.5))
    out, fired = apply_everywhere(HoistPointwiseConcat(), m)
    assert fired and ops(out).count("Mul") == 1
    assert_equivalent(m, out)


def test_hoist_does_not_fire_on_different_functions():
    assert apply_everywhere(HoistPointwiseConcat(), pointwise_branches(("Relu", "Sigmoid")))[1] == []
    m = pointwise_branches(("Mul", "Mul"), scalar=(0.5, 2.0))
    assert apply_everywhere(HoistPointwiseConcat(), m)[1] == []
    assert any("same elementwise function" in r for r in reasons(HoistPointwiseConcat(), m))


def test_hoist_pointwise_over_split_after_a_merge():
    nodes = [helper.make_node("Conv", ["x", f"w{i}"], [f"c{i}"], name=f"conv{i}") for i in range(2)]
    nodes += [helper.make_node("Relu", [f"c{i}"], [f"y{i}"], name=f"relu{i}") for i in range(2)]
    m = model(nodes, [vi("x", [1, 3, 4, 4])], [vi("y0", None), vi("y1", None)],
              [weight("w0", (2, 3, 1, 1), 0), weight("w1", (3, 3, 1, 1), 1)])
    merged, _ = apply_everywhere(MergeParallelConv(), m)
    out, fired = apply_everywhere(HoistPointwiseSplit(), merged)
    assert fired and ops(out) == ["Conv", "Relu", "Split"]
    assert_equivalent(m, out)


def test_hoist_over_split_refuses_a_piece_that_is_a_graph_output():
    nodes = [helper.make_node("Split", ["x", "s"], ["p", "q"], axis=1, name="split"),
             helper.make_node("Relu", ["p"], ["a"], name="r0"), helper.make_node("Relu", ["q"], ["b"], name="r1")]
    m = model(nodes, [vi("x", [1, 4])], [vi("a", None), vi("b", None), vi("p", [1, 2])], [ints("s", [2, 2])])
    assert apply_everywhere(HoistPointwiseSplit(), m)[1] == []
    assert any("graph output" in r for r in reasons(HoistPointwiseSplit(), m))


def test_on_example_model(zoo_model):
    m = zoo_model("nasnet_cell")
    total = []
    for rule in (ConcatSplit(), SplitConcat(), HoistPointwiseConcat(), SinkPointwiseConcat()):
        m2, fired = apply_everywhere(rule, m, limit=3)
        total += fired
        assert_equivalent(m, m2)
    assert total
