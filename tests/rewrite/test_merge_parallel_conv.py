from __future__ import annotations

from onnx import helper

from parastream.rewrite.ir import import_graph
from parastream.rewrite.rules.merge_parallel_conv import MergeParallelConv

from rule_testing import apply_everywhere, assert_equivalent, model, ops, reasons, vi, weight

RULE = MergeParallelConv()


def three_convs(strides_of_last=(1, 1), bias=True, opset=17):
    nodes, inits = [], []
    for i, m in enumerate((4, 6, 8)):
        inits.append(weight(f"w{i}", (m, 5, 3, 3), i))
        ins = ["x", f"w{i}"]
        if bias and i != 1:  # one Conv without bias: merged with a zero bias
            inits.append(weight(f"b{i}", (m,), i))
            ins.append(f"b{i}")
        strides = list(strides_of_last) if i == 2 else [1, 1]
        nodes.append(helper.make_node("Conv", ins, [f"c{i}"], name=f"conv{i}", pads=[1, 1, 1, 1], strides=strides))
        nodes.append(helper.make_node("Relu", [f"c{i}"], [f"y{i}"], name=f"relu{i}"))
    outs = [vi(f"y{i}", None) for i in range(3)]
    return model(nodes, [vi("x", [2, 5, 9, 9])], outs, inits, opset=opset)


def test_merges_and_is_equivalent():
    m = three_convs()
    out, fired = apply_everywhere(RULE, m)
    assert fired == ["merge_parallel_conv:conv0+conv1+conv2"]
    assert ops(out).count("Conv") == 1 and ops(out).count("Split") == 1
    assert_equivalent(m, out)


def test_older_opset_split_attribute():
    m = three_convs(opset=11)
    out, fired = apply_everywhere(RULE, m)
    assert fired and "Split" in ops(out)
    assert_equivalent(m, out)


def test_one_attribute_differs_only_the_matching_ones_merge():
    m = three_convs(strides_of_last=(2, 2))
    out, fired = apply_everywhere(RULE, m)
    assert fired == ["merge_parallel_conv:conv0+conv1"]
    assert ops(out).count("Conv") == 2
    assert_equivalent(m, out)


def test_does_not_fire_when_attributes_differ_and_says_why():
    nodes = [
        helper.make_node("Conv", ["x", "w0"], ["a"], name="conv_a", pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["x", "w1"], ["b"], name="conv_b", pads=[1, 1, 1, 1], dilations=[2, 2]),
    ]
    m = model(nodes, [vi("x", [1, 3, 16, 16])], [vi("a", None), vi("b", None)],
              [weight("w0", (4, 3, 3, 3), 0), weight("w1", (4, 3, 3, 3), 1)])
    out, fired = apply_everywhere(RULE, m)
    assert fired == []
    assert any("dilations" in r for r in reasons(RULE, m))


def test_does_not_fire_on_non_constant_weights():
    nodes = [
        helper.make_node("Conv", ["x", "w0"], ["a"], name="conv_a"),
        helper.make_node("Conv", ["x", "wdyn"], ["b"], name="conv_b"),
    ]
    m = model(nodes, [vi("x", [1, 3, 8, 8]), vi("wdyn", [4, 3, 1, 1])], [vi("a", None), vi("b", None)],
              [weight("w0", (4, 3, 1, 1), 0)])
    _, fired = apply_everywhere(RULE, m)
    assert fired == []
    assert any("not a constant initializer" in r for r in reasons(RULE, m))


def test_apply_is_pure():
    m = three_convs()
    g = import_graph(m)
    before = [n.name for n in g.nodes]
    site = RULE.match(g)[0]
    RULE.apply(g, site)
    assert [n.name for n in g.nodes] == before


def test_on_example_model(zoo_model):
    m = zoo_model("inception_block")
    out, fired = apply_everywhere(RULE, m)
    assert fired, "the inception block has parallel 1x1 Convs on its input"
    assert ops(out).count("Conv") < ops(m).count("Conv")
    assert_equivalent(m, out)
