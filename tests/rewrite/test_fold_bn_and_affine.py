from __future__ import annotations

import numpy as np
from onnx import helper, numpy_helper

from parastream.rewrite.rules.fold_bn_and_affine import FoldBatchNormAndAffine

from rule_testing import apply_everywhere, assert_equivalent, model, ops, reasons, vi, weight

RULE = FoldBatchNormAndAffine()


def bn_inits(c, seed=0):
    rng = np.random.default_rng(seed)
    return [numpy_helper.from_array(rng.uniform(0.5, 1.5, c).astype(np.float32), "gamma"),
            numpy_helper.from_array(rng.standard_normal(c).astype(np.float32), "beta"),
            numpy_helper.from_array(rng.standard_normal(c).astype(np.float32), "mean"),
            numpy_helper.from_array(rng.uniform(0.5, 1.5, c).astype(np.float32), "var")]


def test_conv_bn_mul_add_chain_folds_to_one_conv():
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1], group=2),
             helper.make_node("BatchNormalization", ["c", "gamma", "beta", "mean", "var"], ["n"], name="bn", epsilon=1e-3),
             helper.make_node("Mul", ["s", "n"], ["m"], name="mul"),
             helper.make_node("Sub", ["m", "a"], ["y"], name="sub"),
             helper.make_node("Div", ["y", "d"], ["z"], name="div")]
    m = model(nodes, [vi("x", [1, 4, 6, 6])], [vi("z", None)],
              [weight("w", (6, 2, 3, 3), 0), *bn_inits(6), weight("s", (6, 1, 1), 1), weight("a", (1, 6, 1, 1), 2),
               numpy_helper.from_array(np.float32(2.0), "d")])
    out, fired = apply_everywhere(RULE, m)
    assert fired == ["fold_bn_and_affine:conv+bn", "fold_bn_and_affine:conv+mul", "fold_bn_and_affine:conv+sub",
                     "fold_bn_and_affine:conv+div"]
    assert ops(out) == ["Conv"]
    assert_equivalent(m, out)


def test_gemm_bn_and_matmul_mul():
    nodes = [helper.make_node("Gemm", ["x", "w", "c"], ["g"], name="gemm", transB=1, alpha=0.5, beta=3.0),
             helper.make_node("BatchNormalization", ["g", "gamma", "beta", "mean", "var"], ["n"], name="bn"),
             helper.make_node("MatMul", ["n", "w2"], ["mm"], name="mm"),
             helper.make_node("Mul", ["mm", "s"], ["y"], name="scale")]
    m = model(nodes, [vi("x", [3, 5])], [vi("y", None)],
              [weight("w", (4, 5), 0), weight("c", (4,), 0), *bn_inits(4), weight("w2", (4, 7), 2), weight("s", (7,), 3)])
    out, fired = apply_everywhere(RULE, m)
    assert len(fired) == 2 and ops(out) == ["Gemm", "MatMul"]
    assert_equivalent(m, out)


def test_does_not_fire_when_the_conv_output_is_read_elsewhere():
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
             helper.make_node("Mul", ["c", "s"], ["y"], name="mul"),
             helper.make_node("Relu", ["c"], ["r"], name="relu")]
    m = model(nodes, [vi("x", [1, 2, 4, 4])], [vi("y", None), vi("r", None)], [weight("w", (3, 2, 1, 1), 0), weight("s", (3, 1, 1), 1)])
    _, fired = apply_everywhere(RULE, m)
    assert fired == []
    assert any("also read by relu" in r for r in reasons(RULE, m))


def test_does_not_fire_on_a_spatial_constant_or_a_matmul_bias():
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
             helper.make_node("Mul", ["c", "s"], ["y"], name="mul"),
             helper.make_node("MatMul", ["v", "w2"], ["mm"], name="mm"),
             helper.make_node("Add", ["mm", "b"], ["z"], name="add")]
    m = model(nodes, [vi("x", [1, 2, 4, 4]), vi("v", [2, 3])], [vi("y", None), vi("z", None)],
              [weight("w", (3, 2, 1, 1), 0), weight("s", (1, 1, 4, 4), 1), weight("w2", (3, 5), 2), weight("b", (5,), 3)])
    _, fired = apply_everywhere(RULE, m)
    assert fired == []
    rs = reasons(RULE, m)
    assert any("not per output channel" in r for r in rs) and any("no bias" in r for r in rs)


def test_on_example_model(zoo_model):
    m = zoo_model("resnet_bottleneck")
    out, fired = apply_everywhere(RULE, m)
    assert fired
    assert "BatchNormalization" not in ops(out)
    assert len(ops(out)) < len(ops(m))
    assert_equivalent(m, out)
