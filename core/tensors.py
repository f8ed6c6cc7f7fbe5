"""Tensor specifications and the one generator of seeded random inputs (verification, timing and the
launchers' warm-up all draw from it, so a model sees the same kind of data everywhere)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import ParastreamError


@dataclass
class TensorSpec:
    name: str
    dtype: str  # numpy dtype name: "float32", "float16", "int64", ...
    shape: list[int]

    @classmethod
    def from_dict(cls, d: dict) -> "TensorSpec":
        return cls(name=d["name"], dtype=d["dtype"], shape=[int(s) for s in d["shape"]])


def value_info_spec(vi, unknown: int | None = None) -> TensorSpec:
    """The TensorSpec of an ONNX ValueInfoProto: its name, numpy dtype and shape.  A dimension without a value (a
    name, or nothing) is ``unknown`` (-1: a size that only a run gives), or with None a ValueError, as is a
    ValueInfo without a shape."""
    from onnx import helper

    t = vi.type.tensor_type
    if not t.HasField("shape"):
        raise ValueError(f"{vi.name!r} declares no shape")
    dims = [int(d.dim_value) if d.HasField("dim_value") else unknown for d in t.shape.dim]
    if None in dims:
        raise ValueError(f"{vi.name!r} has a dimension without a value")
    return TensorSpec(name=vi.name, dtype=np.dtype(helper.tensor_dtype_to_np_dtype(t.elem_type)).name, shape=dims)


def random_array(spec: TensorSpec, rng: np.random.Generator) -> np.ndarray:
    """One input drawn from ``rng``, never all zeros: floats N(0, 1) (bfloat16, which numpy cannot name, as
    float32); integers and bools in {0, 1} (ids valid in any table of two rows or more, masks with both values);
    a 0-d integer is 1 (a count or a length, which 0 would make empty) and draws nothing."""
    dt = np.dtype("float32") if spec.dtype == "bfloat16" else np.dtype(spec.dtype)
    if dt.kind == "f":
        return rng.standard_normal(spec.shape).astype(dt)
    if dt.kind in "iu":
        if len(spec.shape) == 0:
            return np.ones((), dtype=dt)
        return rng.integers(0, 2, size=spec.shape).astype(dt)
    if dt.kind == "b":
        return rng.integers(0, 2, size=spec.shape).astype(bool)
    raise ParastreamError(f"input {spec.name!r} has dtype {spec.dtype}, which parastream cannot generate test data for")


def random_feeds(specs, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded random inputs for ``specs`` (anything with ``name``, ``dtype``, ``shape``), drawn in order from one
    generator (:func:`random_array`)."""
    rng = np.random.default_rng(seed)
    return {s.name: random_array(s, rng) for s in specs}
