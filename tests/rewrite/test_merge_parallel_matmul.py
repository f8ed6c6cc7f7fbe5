from __future__ import annotations

from onnx import helper

from parastream.rewrite.rules.merge_parallel_matmul import MergeParallelMatMul

from rule_testing import apply_everywhere, assert_equivalent, model, ops, reasons, vi, weight

RULE = MergeParallelMatMul()


def qkv(bias=(True, True, False), inner=(16, 16, 16)):
    nodes, inits, outs = [], [], []
    for i, name in enumerate("qkv"):
        inits.append(weight(f"W{name}", (inner[i], 8 + 4 * i), i))
        nodes.append(helper.make_node("MatMul", ["x", f"W{name}"], [f"{name}0"], name=f"mm_{name}"))
        if bias[i]:
            inits.append(weight(f"b{name}", (8 + 4 * i,), i))
            nodes.append(helper.make_node("Add", [f"b{name}", f"{name}0"], [name], name=f"add_{name}"))  # bias on the left
            outs.append(name)
        else:
            outs.append(f"{name}0")
    return model(nodes, [vi("x", [2, 5, 16])], [vi(o, None) for o in outs], inits)


def test_qkv_with_bias_merges_and_is_equivalent():
    m = qkv()
    out, fired = apply_everywhere(RULE, m)
    assert fired == ["merge_parallel_matmul:mm_k+mm_q+mm_v"]
    assert ops(out).count("MatMul") == 1 and ops(out).count("Add") == 1 and "Split" in ops(out)
    assert_equivalent(m, out)


def test_gemm_with_alpha_beta_and_transposed_weights():
    nodes = [
        helper.make_node("Gemm", ["x", "w0", "c0"], ["a"], name="g0", alpha=0.5, beta=2.0),
        helper.make_node("Gemm", ["x", "w1", "c1"], ["b"], name="g1", transB=1),
        helper.make_node("Gemm", ["x", "w2"], ["c"], name="g2"),
    ]
    m = model(nodes, [vi("x", [3, 8])], [vi("a", None), vi("b", None), vi("c", None)],
              [weight("w0", (8, 4), 0), weight("c0", (4,), 0), weight("w1", (6, 8), 1), weight("c1", (3, 6), 1),
               weight("w2", (8, 5), 2)])
    out, fired = apply_everywhere(RULE, m)
    assert fired and ops(out).count("Gemm") == 1
    assert_equivalent(m, out)


def test_does_not_fire_when_weights_are_not_constant():
    nodes = [helper.make_node("MatMul", ["x", "w0"], ["a"], name="m0"),
             helper.make_node("MatMul", ["x", "wdyn"], ["b"], name="m1")]
    m = model(nodes, [vi("x", [2, 8]), vi("wdyn", [8, 4])], [vi("a", None), vi("b", None)], [weight("w0", (8, 4), 0)])
    _, fired = apply_everywhere(RULE, m)
    assert fired == []
    assert any("not a constant initializer" in r for r in reasons(RULE, m))


def test_does_not_fire_on_gemms_of_different_transA():
    nodes = [helper.make_node("Gemm", ["x", "w0"], ["a"], name="g0"),
             helper.make_node("Gemm", ["x", "w1"], ["b"], name="g1", transA=1)]
    m = model(nodes, [vi("x", [4, 4])], [vi("a", None), vi("b", None)], [weight("w0", (4, 3), 0), weight("w1", (4, 3), 1)])
    _, fired = apply_everywhere(RULE, m)
    assert fired == []


def test_bias_add_read_elsewhere_stays_outside():
    m = qkv(bias=(True, True, True))
    # make q0 (the MatMul output before its bias) a graph output too: its Add must stay as it is
    m.graph.output.append(vi("q0", [2, 5, 8]))
    out, fired = apply_everywhere(RULE, m)
    assert fired
    assert ops(out).count("Add") == 2  # merged bias of k and v, and q's own Add
    assert_equivalent(m, out)


def test_on_example_model(zoo_model):
    m = zoo_model("transformer_layer")
    out, fired = apply_everywhere(RULE, m)
    assert fired, "the Q/K/V projections share their input"
    assert ops(out).count("MatMul") + ops(out).count("Gemm") < ops(m).count("MatMul") + ops(m).count("Gemm")
    assert_equivalent(m, out)
