"""The scaled error and its bound per precision (core/accuracy.py), shared by verification and bench."""

from __future__ import annotations

import numpy as np
import pytest

from parastream.core.accuracy import DEFAULT_SCALE_TOLERANCES, max_scaled_error, scale_tolerance, scaled_error


def test_one_table_for_verification_and_bench():
    from parastream.pipeline import bench
    from parastream.pipeline import verify

    assert verify.DEFAULT_SCALE_TOLERANCES is DEFAULT_SCALE_TOLERANCES
    assert verify.scaled_error is scaled_error and bench.max_scaled_error is max_scaled_error
    assert scale_tolerance("fp16") == 0.1 and scale_tolerance("int8") == DEFAULT_SCALE_TOLERANCES["fp32"]


def test_max_scaled_error_over_outputs():
    ref = {"y": np.array([1.0, -4.0], np.float32), "z": np.array([2.0], np.float32)}
    assert max_scaled_error({"y": np.array([1.0, -3.6], np.float32), "z": ref["z"]}, ref) == pytest.approx(0.1)
    assert max_scaled_error({"y": np.array([np.nan, -4.0], np.float32), "z": ref["z"]}, ref) == float("inf")
    assert max_scaled_error({"y": ref["y"]}, ref) == float("inf")  # an output missing


def test_bench_differences_use_the_scaled_error():
    """pipeline/bench.py's comparison: matching infinities are no error there either (as in verification)."""
    from parastream.pipeline import bench

    ref = {"y": np.array([np.inf, -4.0], np.float32)}
    absdiff, scaled = bench._differences({"y": np.array([np.inf, -3.6], np.float32)}, ref)
    assert scaled == pytest.approx(0.1)
