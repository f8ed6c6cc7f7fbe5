"""The scaled error, the one measure by which parastream calls two runs of a model the same, and its bound per
precision: verification judges a build by it, and ``parastream bench`` checks that what it times agrees.

scaled error = max|out − ref| / max|ref|: every element within that fraction of the output's own scale.  An
elementwise rtol/atol is unsound both ways (one near-zero element of a correct fp32 build misses rtol 1e-4,
while an atol that ignores the scale lets a differently weighted model through)."""

from __future__ import annotations

import numpy as np

#: the scaled-error bound per precision (random-weight nets in fp16 differ by 2–5% of the output scale even in
#: eager PyTorch; a wrong build is off by the order of the output itself)
DEFAULT_SCALE_TOLERANCES = {"fp32": 1e-3, "tf32": 1e-2, "fp16": 0.1, "bf16": 0.15}


def scale_tolerance(precision: str) -> float:
    """The bound for ``precision`` (fp32's for a precision the table does not name)."""
    return DEFAULT_SCALE_TOLERANCES.get(precision, DEFAULT_SCALE_TOLERANCES["fp32"])


def reference_scale(ref) -> float:
    """max|ref| over the finite elements (0 for an empty or all-zero tensor)."""
    r = np.abs(np.asarray(ref, dtype=np.float64))
    r = r[np.isfinite(r)]
    return float(r.max()) if r.size else 0.0


def scaled_error(out, ref) -> float:
    """max|out − ref| / max|ref| over the whole tensor.

    Equal elements count as zero error (matching infinities or NaNs do not poison the maximum);
    a shape mismatch, a NaN or infinity on one side only, or any error against an all-zero
    reference gives inf.
    """
    out, ref = np.asarray(out), np.asarray(ref)
    if out.shape != ref.shape:
        return float("inf")
    if out.size == 0:
        return 0.0
    o, r = out.astype(np.float64), ref.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.where((o == r) | (np.isnan(o) & np.isnan(r)), 0.0, np.abs(o - r))
    if not np.all(np.isfinite(diff)):
        return float("inf")
    err = float(diff.max())
    if err == 0.0:
        return 0.0
    scale = reference_scale(r)
    return err / scale if scale > 0 else float("inf")


def max_scaled_error(outputs: dict, references: dict) -> float:
    """The largest :func:`scaled_error` over the outputs ``references`` names (inf where ``outputs`` lacks one)."""
    worst = 0.0
    for name, ref in references.items():
        worst = max(worst, scaled_error(outputs[name], ref) if name in outputs else float("inf"))
    return worst
