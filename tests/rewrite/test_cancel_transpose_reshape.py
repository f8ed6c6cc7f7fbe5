from __future__ import annotations

from onnx import helper

from parastream.rewrite.rules.cancel_transpose_reshape import CancelReshapePair, CancelTransposePair, DropNoOpView

from rule_testing import apply_everywhere, assert_equivalent, ints, model, ops, reasons, vi


def transposes(p1, p2, extra_reader=False):
    nodes = [helper.make_node("Transpose", ["x"], ["t"], perm=p1, name="t1"),
             helper.make_node("Transpose", ["t"], ["u"], perm=p2, name="t2"),
             helper.make_node("Relu", ["u"], ["y"], name="relu")]
    outs = [vi("y", None)]
    if extra_reader:
        nodes.append(helper.make_node("Sigmoid", ["t"], ["z"], name="sig"))
        outs.append(vi("z", None))
    return model(nodes, [vi("x", [2, 3, 4, 5])], outs)


def test_inverse_transposes_cancel():
    m = transposes([0, 2, 3, 1], [0, 3, 1, 2])
    out, fired = apply_everywhere(CancelTransposePair(), m)
    assert fired == ["cancel_transpose:t1+t2"] and ops(out) == ["Relu"]
    assert_equivalent(m, out)


def test_other_transposes_compose_into_one():
    m = transposes([0, 2, 3, 1], [1, 0, 3, 2])
    out, fired = apply_everywhere(CancelTransposePair(), m)
    assert fired and ops(out) == ["Transpose", "Relu"]
    assert_equivalent(m, out)


def test_transpose_read_elsewhere_is_kept():
    m = transposes([0, 2, 3, 1], [0, 3, 1, 2], extra_reader=True)
    assert apply_everywhere(CancelTransposePair(), m)[1] == []
    assert any("also read by sig" in r for r in reasons(CancelTransposePair(), m))


def test_reshape_chain_cancels_and_collapses():
    nodes = [helper.make_node("Reshape", ["x", "s1"], ["a"], name="r1"),
             helper.make_node("Unsqueeze", ["a", "ax"], ["b"], name="u"),
             helper.make_node("Flatten", ["b"], ["c"], name="f", axis=2),
             helper.make_node("Reshape", ["c", "s2"], ["d"], name="r2"),
             helper.make_node("Relu", ["d"], ["y"], name="relu")]
    m = model(nodes, [vi("x", [2, 3, 4])], [vi("y", None)], [ints("s1", [6, 4]), ints("ax", [0]), ints("s2", [2, 3, 4])])
    out, fired = apply_everywhere(CancelReshapePair(), m)
    assert len(fired) == 3 and ops(out) == ["Relu"]
    assert_equivalent(m, out)


def test_reshape_pair_with_a_graph_output_in_between_stays():
    nodes = [helper.make_node("Reshape", ["x", "s1"], ["a"], name="r1"),
             helper.make_node("Reshape", ["a", "s2"], ["y"], name="r2")]
    m = model(nodes, [vi("x", [2, 3, 4])], [vi("y", None), vi("a", [6, 4])], [ints("s1", [6, 4]), ints("s2", [2, 3, 4])])
    assert apply_everywhere(CancelReshapePair(), m)[1] == []
    assert any("graph output" in r for r in reasons(CancelReshapePair(), m))


def test_noop_views_are_dropped():
    nodes = [helper.make_node("Reshape", ["x", "s"], ["a"], name="r"),
             helper.make_node("Transpose", ["a"], ["b"], perm=[0, 1, 2], name="t"),
             helper.make_node("Transpose", ["b"], ["c"], perm=[0, 2, 1], name="swap"),  # 3x3: same shape, not a no-op
             helper.make_node("Relu", ["c"], ["y"], name="relu")]
    m = model(nodes, [vi("x", [2, 3, 3])], [vi("y", None)], [ints("s", [2, 3, 3])])
    out, fired = apply_everywhere(DropNoOpView(), m)
    assert sorted(fired) == ["drop_noop_view:r", "drop_noop_view:t"] and ops(out) == ["Transpose", "Relu"]
    assert any("permutes" in r for r in reasons(DropNoOpView(), m))
    assert_equivalent(m, out)


def test_on_example_model(zoo_model):
    m = zoo_model("transformer_layer")
    fired = []
    for rule in (CancelTransposePair(), CancelReshapePair(), DropNoOpView()):
        m2, f = apply_everywhere(rule, m)
        fired += f
        assert_equivalent(m, m2)
    assert fired, "the attention's K transpose follows the head transpose"
