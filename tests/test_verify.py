"""Verification criteria: elementwise rtol/atol for fp32, scaled error max|out-ref|/max|ref| for fp16/bf16."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from graphs import ort_reference, three_branch_model, two_output_model

from parastream.launcher.errors import ParastreamError
from parastream.launcher.plan import TensorSpec
from parastream.pipeline.verify import (DEFAULT_SCALE_TOLERANCES, DEFAULT_TOLERANCES, resolve_tolerances, scaled_error,
                                        verify)

INPUTS = [TensorSpec("input", "float32", [1, 4, 8, 8])]


class NoisyLauncher:
    """ONNX Runtime on the model itself, plus ±``fraction`` of each output's scale on every element.

    Every element moves by exactly fraction·max|ref|, so the scaled error is ``fraction`` and small
    elements miss an elementwise 2e-2 tolerance by a wide margin.
    """

    def __init__(self, model: onnx.ModelProto, fraction: float, seed: int = 0):
        self.model, self.fraction = model, fraction
        self.rng = np.random.default_rng(seed)

    def __call__(self, feeds):
        outs = ort_reference(self.model, feeds)
        noisy = {}
        for name, ref in outs.items():
            sign = self.rng.choice([-1.0, 1.0], size=ref.shape)
            noisy[name] = (ref + sign * self.fraction * np.abs(ref).max()).astype(ref.dtype)
        return noisy


def _verify(model, launcher, precision, inputs=INPUTS, **given):
    rtol, atol, scale_tol = resolve_tolerances(precision, given.get("rtol"), given.get("atol"), given.get("scale_tol"))
    return verify(model, launcher, inputs, rtol=rtol, atol=atol, scale_tol=scale_tol, seed=3, iterations=2)


def test_three_percent_noise_passes_fp16_by_scaled_error():
    model = three_branch_model()
    result = _verify(model, NoisyLauncher(model, 0.03), "fp16")
    out = result.outputs["output"]
    assert result.passed and result.criterion == "scaled" and result.scale_tol == DEFAULT_SCALE_TOLERANCES["fp16"]
    assert out["max_scaled"] == pytest.approx(0.03, rel=1e-3)
    # the same outputs miss the elementwise fp16 tolerance: the scaled criterion is what lets them through
    assert out["elementwise_passed"] is False and out["max_abs"] > DEFAULT_TOLERANCES["fp16"][1]


def test_scaled_pass_prints_no_elementwise_failure(capfd):
    """polygraphy must not print "FAILED" for a build that the scaled criterion passes; fp32 still reports failures."""
    model = three_branch_model()
    assert _verify(model, NoisyLauncher(model, 0.03), "fp16").passed
    fd = capfd.readouterr()
    assert "FAILED" not in fd.out + fd.err
    assert not _verify(model, NoisyLauncher(model, 0.03), "fp32").passed
    fd = capfd.readouterr()
    assert "FAILED" in fd.out + fd.err


def test_three_percent_noise_fails_fp32():
    model = three_branch_model()
    result = _verify(model, NoisyLauncher(model, 0.03), "fp32")
    assert result.criterion == "elementwise" and result.scale_tol is None
    assert not result.passed and not result.outputs["output"]["passed"]
    assert result.outputs["output"]["max_scaled"] == pytest.approx(0.03, rel=1e-3)  # recorded under either criterion


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_fifty_percent_noise_fails_reduced_precision(precision):
    model = three_branch_model()
    result = _verify(model, NoisyLauncher(model, 0.5), precision)
    assert result.criterion == "scaled"
    assert not result.passed
    assert result.outputs["output"]["max_scaled"] == pytest.approx(0.5, rel=1e-3)


def test_explicit_rtol_atol_judges_fp16_elementwise():
    model = three_branch_model()
    result = _verify(model, NoisyLauncher(model, 0.03), "fp16", rtol=2e-2, atol=2e-2)
    assert result.criterion == "elementwise" and not result.passed


def test_exact_launcher_passes_every_criterion():
    model = three_branch_model()
    for precision in ("fp32", "fp16", "bf16"):
        result = _verify(model, NoisyLauncher(model, 0.0), precision)
        assert result.passed, precision
        assert result.outputs["output"]["max_scaled"] == 0.0


def test_to_dict_records_criterion_and_scaled_error_per_output():
    model = two_output_model()
    launcher = NoisyLauncher(model, 0.05)
    d = _verify(model, launcher, "fp16", inputs=[TensorSpec("x", "float32", [2, 16])]).to_dict()
    json.dumps(d)
    assert d["criterion"] == "scaled" and d["scale_tol"] == 0.1 and d["passed"] is True
    assert set(d["outputs"]) == {"y", "aux"}
    for out in d["outputs"].values():
        assert out["max_scaled"] == pytest.approx(0.05, rel=1e-3)
        assert {"max_abs", "max_rel", "max_ref", "elementwise_passed", "passed"} <= set(out)


def test_missing_output_fails_under_both_criteria():
    model = two_output_model()
    inputs = [TensorSpec("x", "float32", [2, 16])]

    def drops_aux(feeds):
        return {"y": ort_reference(model, feeds)["y"]}

    for precision in ("fp32", "fp16"):
        result = _verify(model, drops_aux, precision, inputs=inputs)
        assert not result.passed and not result.outputs["aux"]["passed"] and result.outputs["y"]["passed"]


def test_wrong_shape_fails_instead_of_crashing():
    model = three_branch_model()

    def flat(feeds):
        return {k: v.reshape(-1) for k, v in ort_reference(model, feeds).items()}

    for precision in ("fp32", "fp16"):
        result = _verify(model, flat, precision)
        assert not result.passed and result.outputs["output"]["max_scaled"] == float("inf")


def test_scaled_error_definition():
    ref = np.array([0.0, -4.0, 2.0, np.inf], np.float32)
    assert scaled_error(ref + np.array([0, 0.4, 0, 0], np.float32), ref) == pytest.approx(0.1)  # 0.4 / max finite |ref| 4
    assert scaled_error(ref, ref) == 0.0  # matching infinities are no error
    assert scaled_error(np.array([0, -4, 2, 1], np.float32), ref) == float("inf")
    assert scaled_error(np.array([np.nan, -4, 2, np.inf], np.float32), ref) == float("inf")
    assert scaled_error(np.ones(3, np.float16), np.zeros(3, np.float32)) == float("inf")
    assert scaled_error(np.zeros(3), np.zeros(3)) == 0.0
    assert scaled_error(np.zeros((2, 3)), np.zeros(6)) == float("inf")


def test_all_zero_output_is_judged_by_atol():
    """A Relu output that is zero everywhere has no scale: fp16 noise within atol passes, beyond it fails."""
    from onnx import TensorProto, helper

    # polygraphy's DataLoader draws inputs in [0, 1): Neg then Relu gives zeros everywhere
    graph = helper.make_graph([helper.make_node("Neg", ["x"], ["n"], name="neg"), helper.make_node("Relu", ["n"], ["y"], name="relu")],
                              "zero", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8])])
    zero_model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    inputs = [TensorSpec("x", "float32", [8])]

    def offset(by):
        return lambda feeds: {"y": np.full(8, by, np.float32)}

    assert _verify(zero_model, offset(1e-3), "fp16", inputs=inputs).passed
    assert not _verify(zero_model, offset(0.5), "fp16", inputs=inputs).passed


def test_resolve_tolerances():
    assert resolve_tolerances("fp32") == (*DEFAULT_TOLERANCES["fp32"], None)
    assert resolve_tolerances("tf32") == (*DEFAULT_TOLERANCES["tf32"], None)
    assert resolve_tolerances("fp16") == (*DEFAULT_TOLERANCES["fp16"], 0.1)
    assert resolve_tolerances("bf16") == (*DEFAULT_TOLERANCES["bf16"], 0.15)
    assert resolve_tolerances("fp16", rtol=1e-3) == (1e-3, DEFAULT_TOLERANCES["fp16"][1], None)
    assert resolve_tolerances("fp32", scale_tol=0.2) == (*DEFAULT_TOLERANCES["fp32"], 0.2)
    with pytest.raises(ParastreamError, match="--scale-tol"):
        resolve_tolerances("fp16", atol=1e-2, scale_tol=0.2)
    with pytest.raises(ParastreamError, match="positive"):
        resolve_tolerances("fp16", scale_tol=0.0)


def test_uses_simple_compare_func_not_the_deprecated_factory():
    from polygraphy import comparator

    from parastream.pipeline.verify import _simple_compare_func

    func = _simple_compare_func(1e-3, 1e-4)
    if hasattr(comparator, "SimpleCompareFunc"):
        assert isinstance(func, comparator.SimpleCompareFunc)
