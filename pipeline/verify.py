"""Verification: polygraphy's Comparator, ONNX Runtime on the ORIGINAL model against the launcher.

The launcher is wrapped in a polygraphy runner of our own, so polygraphy's data
loader (seeded random inputs), comparison (rtol/atol per element) and statistics
apply unchanged.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import onnx
from polygraphy.backend.base import BaseRunner
from polygraphy.common import TensorMetadata

from parastream.launcher.plan import TensorSpec

DEFAULT_TOLERANCES = {  # (rtol, atol) per precision
    "fp32": (1e-4, 1e-5),
    "tf32": (5e-3, 5e-3),
    "fp16": (2e-2, 2e-2),
    "bf16": (5e-2, 5e-2),
}


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
    outputs: dict = field(default_factory=dict)  # name -> {max_abs, max_rel, passed}

    def to_dict(self) -> dict:
        return {"passed": self.passed, "rtol": self.rtol, "atol": self.atol, "iterations": self.iterations,
                "seed": self.seed, "outputs": self.outputs, "reference": "onnxruntime (CPU) on the original model"}


def verify(original: onnx.ModelProto, launcher, inputs: list[TensorSpec], *, rtol: float, atol: float,
           seed: int = 1, iterations: int = 2) -> Verification:
    from polygraphy import config as pg_config
    from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx
    from polygraphy.comparator import CompareFunc, Comparator, DataLoader
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
    accuracies = Comparator.compare_accuracy(results, compare_func=CompareFunc.simple(rtol=rtol, atol=atol, check_shapes=True))
    # polygraphy >= 0.50 returns AccuracyResults (one AccuracyResult per compare_func); older ones the result itself
    accuracy = accuracies if hasattr(accuracies, "items") else accuracies[0]
    per_output: dict[str, dict] = {}
    for _pair, iterations_results in accuracy.items():
        for it in iterations_results:
            for out_name, res in it.items():
                d = per_output.setdefault(out_name, {"max_abs": 0.0, "max_rel": 0.0, "passed": True})
                d["max_abs"] = max(d["max_abs"], float(res.max_absdiff))
                d["max_rel"] = max(d["max_rel"], float(res.max_reldiff))
                d["passed"] = d["passed"] and bool(res)
    passed = bool(accuracy) and all(d["passed"] for d in per_output.values()) and len(per_output) > 0
    return Verification(passed=passed, rtol=rtol, atol=atol, iterations=iterations, seed=seed, outputs=per_output)
