from __future__ import annotations

from onnx import helper

from parastream.rewrite.ir import export_model, import_graph
from parastream.rewrite.rules.enlarge_kernel import EnlargeKernel
from parastream.rewrite.rules.merge_summed import MergeSummed

from rule_testing import apply_everywhere, assert_equivalent, model, ops, reasons, vi, weight

RULE = MergeSummed()


def summed_convs(k2=3, pads2=1, bias=True):
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"] if bias else ["x", "w1"], ["a"], name="c1", pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["x", "w2"], ["b"], name="c2", pads=[pads2] * 4),
             helper.make_node("Add", ["a", "b"], ["y"], name="add")]
    inits = [weight("w1", (4, 3, 3, 3), 0), weight("w2", (4, 3, k2, k2), 1)] + ([weight("b1", (4,), 2)] if bias else [])
    return model(nodes, [vi("x", [1, 3, 7, 7])], [vi("y", None)], inits)


def test_summed_convs_become_one():
    m = summed_convs()
    out, fired = apply_everywhere(RULE, m)
    assert fired == ["merge_summed:c1+c2+add"] and ops(out) == ["Conv"]
    assert_equivalent(m, out)


def test_summed_matmuls_and_gemms():
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["a"], name="m1"), helper.make_node("MatMul", ["x", "w2"], ["b"], name="m2"),
             helper.make_node("Add", ["b", "a"], ["y"], name="add"),
             helper.make_node("Gemm", ["y", "g1", "c1"], ["p"], name="g1", transB=1, alpha=2.0),
             helper.make_node("Gemm", ["y", "g2"], ["q"], name="g2", beta=0.5),
             helper.make_node("Add", ["p", "q"], ["z"], name="add2")]
    m = model(nodes, [vi("x", [3, 4])], [vi("z", None)],
              [weight("w1", (4, 6), 0), weight("w2", (4, 6), 1), weight("g1", (5, 6), 2), weight("c1", (5,), 3), weight("g2", (6, 5), 4)])
    out, fired = apply_everywhere(RULE, m)
    assert len(fired) == 2 and ops(out) == ["MatMul", "Gemm"]
    assert_equivalent(m, out)


def test_different_kernels_need_enlargement_first():
    m = summed_convs(k2=1, pads2=0)
    _, fired = apply_everywhere(RULE, m)
    assert fired == []
    assert any("differ in" in r for r in reasons(RULE, m))
    g = import_graph(m)
    (site,) = [s for s, r in EnlargeKernel().sites(g) if r is None]
    g = EnlargeKernel().apply(g, site)
    (site,) = [s for s, r in RULE.sites(g) if r is None]
    out = export_model(RULE.apply(g, site), m)
    assert ops(out) == ["Conv"]
    assert_equivalent(m, out)


def test_does_not_fire_when_a_term_is_read_elsewhere():
    m = summed_convs()
    m.graph.output.append(vi("a", [1, 4, 7, 7]))
    _, fired = apply_everywhere(RULE, m)
    assert fired == []
    assert any("graph output" in r for r in reasons(RULE, m))


def test_on_example_model(zoo_model):
    m = zoo_model("nasnet_cell")
    g = import_graph(m)
    rules = [EnlargeKernel(), RULE]
    applied = 0
    for _ in range(10):
        safe = [(r, s) for r in rules for s, reason in r.sites(g) if reason is None]
        summed = [(r, s) for r, s in safe if r is RULE]
        if summed:
            g = RULE.apply(g, summed[0][1])
            applied += 1
        elif safe:
            g = safe[0][0].apply(g, safe[0][1])
        else:
            break
    assert applied, "a NASNet cell adds two Convs of one input"
    assert_equivalent(m, export_model(g, m))
