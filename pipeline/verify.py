"""Verification: polygraphy's Comparator, ONNX Runtime on the ORIGINAL model against the launcher.

The launcher is wrapped in a polygraphy runner of our own, so polygraphy's data
loader (seeded random inputs), comparison (rtol/atol per element) and statistics
apply unchanged.

Two criteria decide whether an output matches:

* elementwise (fp32, tf32, or any precision given --rtol/--atol): every element
  satisfies |out − ref| ≤ atol + rtol·|ref| (polygraphy's SimpleCompareFunc);
* scaled (fp16, bf16 by default): scaled error = max|out − ref| / max|ref| ≤ scale_tol,
  the largest error measured against the output's own scale. Reduced-precision
  networks with random weights miss an elementwise 2e-2 on small elements even when
  built correctly (eager PyTorch in fp16 shows 2–5e-2 on vision nets), while a
  wrong build moves the error to the order of the output itself. An output that is
  zero everywhere has no scale; atol judges it.

The elementwise figures are recorded under either criterion.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import onnx
from polygraphy.backend.base import BaseRunner
from polygraphy.common import TensorMetadata

from parastream.launcher.errors import ParastreamError
from parastream.launcher.plan import TensorSpec

DEFAULT_TOLERANCES = {  # (rtol, atol) per precision
    "fp32": (1e-4, 1e-5),
    "tf32": (5e-3, 5e-3),
    "fp16": (2e-2, 2e-2),
    "bf16": (5e-2, 5e-2),
}

# scaled-error bound per precision; precisions not listed (fp32, tf32) are judged elementwise
DEFAULT_SCALE_TOLERANCES = {"fp16": 0.1, "bf16": 0.15}


def resolve_tolerances(precision: str, rtol: float | None = None, atol: float | None = None,
                       scale_tol: float | None = None) -> tuple[float, float, float | None]:
    """(rtol, atol, scale_tol) for ``verify`` from the user's options (None = not given).

    An explicit rtol or atol asks for the elementwise criterion; an explicit scale_tol for the
    scaled one; with neither, the precision's defaults decide (scaled for fp16/bf16).
    """
    if scale_tol is not None and (rtol is not None or atol is not None):
        raise ParastreamError("--scale-tol and --rtol/--atol choose different criteria (scaled vs elementwise); give one or the other")
    if scale_tol is not None and not scale_tol > 0:
        raise ParastreamError(f"--scale-tol {scale_tol} must be a positive number")
    d_rtol, d_atol = DEFAULT_TOLERANCES.get(precision, DEFAULT_TOLERANCES["fp32"])
    if scale_tol is None and rtol is None and atol is None:
        scale_tol = DEFAULT_SCALE_TOLERANCES.get(precision)
    return (d_rtol if rtol is None else rtol, d_atol if atol is None else atol, scale_tol)


class LauncherRunner(BaseRunner):
    """A polygraphy runner around a parastream launcher (anything callable feeds -> outputs)."""

    def __init__(self, launcher, inputs: list[TensorSpec], name: str = "parastream"):
        super().__init__(name=name)
        self._launcher = launcher
        self._inputs = inputs

    def activate_impl(self):
        pass

    def get_input_metadata_impl(self):
        meta = TensorMetadata()
        for s in self._inputs:
            meta.add(s.name, np.dtype(s.dtype), tuple(s.shape))
        return meta

    def infer_impl(self, feed_dict):
        t0 = time.perf_counter()
        outs = self._launcher({k: np.asarray(v) for k, v in feed_dict.items()})
        self.inference_time = time.perf_counter() - t0  # polygraphy reads it back
        return OrderedDict((k, np.asarray(v)) for k, v in outs.items())

    def deactivate_impl(self):
        pass


@dataclass
class Verification:
    passed: bool
    rtol: float
    atol: float
    iterations: int
    seed: int
    # name -> {max_abs, max_rel, max_scaled, max_ref, elementwise_passed, passed}; ``passed`` is by the criterion
    outputs: dict = field(default_factory=dict)
    scale_tol: float | None = None  # None: the elementwise criterion decides

    @property
    def criterion(self) -> str:
        return "elementwise" if self.scale_tol is None else "scaled"

    def describe_criterion(self) -> str:
        if self.scale_tol is None:
            return f"elementwise: rtol {self.rtol}, atol {self.atol}"
        return f"scaled error max|out-ref|/max|ref| <= {self.scale_tol}"

    def to_dict(self) -> dict:
        return {"passed": self.passed, "criterion": self.criterion, "scale_tol": self.scale_tol,
                "rtol": self.rtol, "atol": self.atol, "iterations": self.iterations,
                "seed": self.seed, "outputs": self.outputs, "reference": "onnxruntime (CPU) on the original model"}


def _reference_scale(ref) -> float:
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
    scale = _reference_scale(r)
    return err / scale if scale > 0 else float("inf")


def _simple_compare_func(rtol: float, atol: float):
    from polygraphy import comparator

    if hasattr(comparator, "SimpleCompareFunc"):  # polygraphy >= 0.50; CompareFunc.simple is deprecated there
        return comparator.SimpleCompareFunc(rtol=rtol, atol=atol, check_shapes=True)
    return comparator.CompareFunc.simple(rtol=rtol, atol=atol, check_shapes=True)


def verify(original: onnx.ModelProto, launcher, inputs: list[TensorSpec], *, rtol: float, atol: float,
           scale_tol: float | None = None, seed: int = 1, iterations: int = 2) -> Verification:
    """Compare ``launcher`` with ONNX Runtime on ``original`` over ``iterations`` seeded random inputs.

    ``scale_tol`` None judges each output elementwise by rtol/atol; a number judges it by its
    scaled error (see the module docstring), rtol/atol then only feed the recorded statistics.
    """
    from polygraphy import config as pg_config
    from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx
    from polygraphy.comparator import Comparator, DataLoader
    from polygraphy.logger import G_LOGGER

    G_LOGGER.module_severity = G_LOGGER.ERROR
    pg_config.INTERNAL_CORRECTNESS_CHECKS = False
    meta = TensorMetadata()
    for s in inputs:
        meta.add(s.name, np.dtype(s.dtype), tuple(s.shape))
    loader = DataLoader(seed=seed, iterations=iterations, input_metadata=meta)
    reference = OnnxrtRunner(SessionFromOnnx(original.SerializeToString(), providers=["cpu"]), name="onnxruntime")
    ours = LauncherRunner(launcher, inputs)
    results = Comparator.run([reference, ours], data_loader=loader)
    if scale_tol is None:
        accuracies = Comparator.compare_accuracy(results, compare_func=_simple_compare_func(rtol, atol))
    else:
        # the elementwise figures are only recorded here: polygraphy's own "FAILED" lines would contradict
        # the verdict (the scaled criterion), so it compares silently
        with G_LOGGER.verbosity(G_LOGGER.CRITICAL):
            accuracies = Comparator.compare_accuracy(results, compare_func=_simple_compare_func(rtol, atol))
    # polygraphy >= 0.50 returns AccuracyResults (one AccuracyResult per compare_func); older ones the result itself
    accuracy = accuracies if hasattr(accuracies, "items") else accuracies[0]

    (_, ref_iters), (_, our_iters) = list(results.items())
    per_output: dict[str, dict] = {}
    for ref_it, our_it in zip(ref_iters, our_iters):
        for out_name, ref in ref_it.items():
            d = per_output.setdefault(out_name, {"max_abs": 0.0, "max_rel": 0.0, "max_scaled": 0.0, "max_ref": 0.0,
                                                 "elementwise_passed": True, "passed": True})
            d["max_ref"] = max(d["max_ref"], _reference_scale(ref))
            if out_name not in our_it:  # polygraphy skips a missing output with a warning; we do not
                d.update(max_abs=float("inf"), max_rel=float("inf"), max_scaled=float("inf"), elementwise_passed=False)
                continue
            d["max_scaled"] = max(d["max_scaled"], scaled_error(our_it[out_name], ref))
    for _pair, iterations_results in accuracy.items():
        for it in iterations_results:
            for out_name, res in it.items():
                d = per_output[out_name]
                if isinstance(res, bool):  # polygraphy answers a bare False for a shape mismatch
                    d.update(max_abs=float("inf"), max_rel=float("inf"))
                else:
                    d["max_abs"] = max(d["max_abs"], float(res.max_absdiff))
                    d["max_rel"] = max(d["max_rel"], float(res.max_reldiff))
                d["elementwise_passed"] = d["elementwise_passed"] and bool(res)
    for d in per_output.values():
        if scale_tol is None:
            d["passed"] = d["elementwise_passed"]
        else:
            # an output that is zero everywhere has no scale to measure against: atol decides there
            d["passed"] = d["max_scaled"] <= scale_tol or (d["max_ref"] == 0.0 and d["elementwise_passed"])
    passed = len(per_output) > 0 and all(d["passed"] for d in per_output.values())
    return Verification(passed=passed, rtol=rtol, atol=atol, iterations=iterations, seed=seed, outputs=per_output,
                        scale_tol=scale_tol)
