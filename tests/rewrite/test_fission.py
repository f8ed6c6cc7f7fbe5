from __future__ import annotations

from onnx import helper

from parastream.rewrite.rules.fission import Fission
from parastream.rewrite.rules.merge_parallel_conv import MergeParallelConv
from parastream.rewrite.rules.merge_parallel_matmul import MergeParallelMatMul

from rule_testing import apply_everywhere, assert_equivalent, ints, model, ops, reasons, vi, weight

RULE = Fission(min_channels=2)


def conv_then(reader: str):
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1])]
    inits = [weight("w", (7, 3, 3, 3), 0), weight("b", (7,), 0)]
    if reader == "concat":
        nodes.append(helper.make_node("Concat", ["x", "c"], ["y"], axis=1, name="cat"))
    else:
        nodes.append(helper.make_node("Relu", ["c"], ["y"], name="relu"))
    return model(nodes, [vi("x", [1, 3, 6, 6])], [vi("y", None)], inits)


def test_halves_a_conv_with_a_concat_joining_them():
    m = conv_then("relu")
    out, fired = apply_everywhere(RULE, m, limit=1)
    assert fired == ["fission:conv[halves]"]
    assert ops(out).count("Conv") == 2 and "Concat" in ops(out)
    assert_equivalent(m, out)


def test_halves_go_straight_into_a_channel_concat():
    m = conv_then("concat")
    out, fired = apply_everywhere(RULE, m, limit=1)
    assert fired and ops(out).count("Concat") == 1 and ops(out).count("Conv") == 2
    assert_equivalent(m, out)


def test_fission_undoes_a_merge():
    nodes = [helper.make_node("Conv", ["x", "w0"], ["a"], name="c0"), helper.make_node("Conv", ["x", "w1"], ["b"], name="c1")]
    m = model(nodes, [vi("x", [1, 3, 5, 5])], [vi("a", None), vi("b", None)], [weight("w0", (2, 3, 1, 1), 0), weight("w1", (5, 3, 1, 1), 1)])
    merged, _ = apply_everywhere(MergeParallelConv(), m)
    back, fired = apply_everywhere(RULE, merged, limit=1)
    assert fired[0].endswith("[split]")
    assert ops(back) == ["Conv", "Conv"]
    assert_equivalent(m, back)


def test_matmul_and_gemm():
    nodes = [helper.make_node("MatMul", ["x", "w"], ["a"], name="mm"),
             helper.make_node("Gemm", ["a", "g", "c"], ["y"], name="gemm", transB=1, alpha=0.7)]
    m = model(nodes, [vi("x", [4, 6])], [vi("y", None)], [weight("w", (6, 10), 0), weight("g", (9, 10), 1), weight("c", (9,), 2)])
    out, fired = apply_everywhere(RULE, m, limit=2)
    assert len(fired) == 2
    assert_equivalent(m, out)


def test_qkv_merge_then_fission_round_trip(zoo_model):
    m = zoo_model("transformer_layer")
    merged, fired = apply_everywhere(MergeParallelMatMul(), m)
    assert fired
    back, fired = apply_everywhere(RULE, merged, limit=1)
    assert fired
    assert_equivalent(m, back)


def test_does_not_fire_on_dynamic_weights_or_grouped_conv():
    nodes = [helper.make_node("MatMul", ["x", "wdyn"], ["a"], name="mm"),
             helper.make_node("Conv", ["img", "gw"], ["b"], name="dw", group=4)]
    m = model(nodes, [vi("x", [2, 4]), vi("wdyn", [4, 4]), vi("img", [1, 4, 5, 5])], [vi("a", None), vi("b", None)],
              [weight("gw", (4, 1, 3, 3), 0)])
    _, fired = apply_everywhere(RULE, m)
    assert fired == []
    assert any("grouped" in r for r in reasons(RULE, m))


def test_split_read_elsewhere_is_halved_not_inverted():
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
             helper.make_node("Split", ["c", "s"], ["p", "q"], axis=1, name="split")]
    m = model(nodes, [vi("x", [1, 3, 4, 4])], [vi("p", None), vi("q", None), vi("c", [1, 4, 4, 4])],
              [weight("w", (4, 3, 1, 1), 0), ints("s", [1, 3])])
    out, fired = apply_everywhere(RULE, m, limit=1)
    assert fired == ["fission:conv[halves]"]  # c is a graph output: the Split stays
    assert_equivalent(m, out)


def test_on_example_model(zoo_model):
    m = zoo_model("resnet_bottleneck")
    out, fired = apply_everywhere(Fission(min_channels=16), m, limit=2)
    assert fired
    assert_equivalent(m, out)
