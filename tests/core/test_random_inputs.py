"""The one random-input generator (core/tensors.py): verification's probe, the CPU timing and the GPU
launcher's warm-up all draw from it."""

from __future__ import annotations

import numpy as np
import pytest

from parastream.core.errors import ParastreamError
from parastream.core.tensors import TensorSpec, random_array, random_feeds


def test_seeded_and_typed():
    specs = [TensorSpec("x", "float32", [2, 3]), TensorSpec("ids", "int64", [5]), TensorSpec("mask", "bool", [4]),
             TensorSpec("h", "float16", [3])]
    a, b, c = random_feeds(specs, seed=3), random_feeds(specs, seed=3), random_feeds(specs, seed=4)
    assert all(np.array_equal(a[k], b[k]) for k in a) and not np.array_equal(a["x"], c["x"])
    assert {k: v.dtype.name for k, v in a.items()} == {"x": "float32", "ids": "int64", "mask": "bool", "h": "float16"}
    assert a["x"].shape == (2, 3) and set(np.unique(a["ids"])) <= {0, 1}


def test_floats_are_standard_normal_never_all_zero():
    x = random_feeds([TensorSpec("x", "float32", [20000])], seed=0)["x"]
    assert abs(float(x.mean())) < 0.05 and abs(float(x.std()) - 1.0) < 0.05 and (x < 0).any()


def test_a_scalar_integer_is_one_and_draws_nothing():
    """A 0-d integer (a count or a length) is 1, and the inputs after it are drawn as if it were not there."""
    rng = np.random.default_rng(0)
    assert random_array(TensorSpec("k", "int64", []), rng) == 1
    with_scalar = random_feeds([TensorSpec("k", "int32", []), TensorSpec("x", "float32", [3])], seed=0)
    without = random_feeds([TensorSpec("x", "float32", [3])], seed=0)
    assert np.array_equal(with_scalar["x"], without["x"])


def test_bfloat16_is_drawn_as_float32():
    assert random_array(TensorSpec("b", "bfloat16", [2]), np.random.default_rng(0)).dtype == np.float32


def test_an_ungeneratable_dtype_is_a_one_line_error():
    with pytest.raises(ParastreamError, match="'s'.*str"):
        random_feeds([TensorSpec("s", "str", [1])])
