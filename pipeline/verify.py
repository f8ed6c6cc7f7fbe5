"""Verification: polygraphy's Comparator, ONNX Runtime on the ORIGINAL model against the launcher.

The launcher is wrapped in a polygraphy runner of our own, so polygraphy's data
loader (seeded random inputs), comparison and statistics apply unchanged.

One criterion for every precision, the same at build and at ``parastream verify``
(which reads the tolerances the bundle was built with):

* scaled (the default): scaled error = max|out − ref| / max|ref| ≤ scale_tol on every
  input, i.e. every element is within scale_tol of the output's own scale. An
  elementwise rtol/atol is unsound both ways: one near-zero element of a correct fp32
  build misses rtol 1e-4 (onnxruntime against itself misses it on Inception-v3), while
  an atol that ignores the output's scale lets a differently-weighted model through.
  Defaults: fp32 1e-3, tf32 1e-2, fp16 0.1, bf16 0.15 (random-weight nets in fp16 differ
  by 2–5% of the output scale even in eager PyTorch; a wrong build is off by the order
  of the output itself);
* elementwise (only when --rtol/--atol are given): |out − ref| ≤ atol + rtol·|ref|
  (polygraphy's SimpleCompareFunc). Its figures are recorded under either criterion.

A comparison is *meaningful* only if the reference output carries information: an
output whose reference is NaN/inf everywhere, near zero (max|ref| ≤ 1e-6) or the same
on every input drawn is compared but flagged, and a verification in which no output
is meaningful is ``inconclusive`` (build and verify refuse to call it passed).

Inputs are drawn the way the model reads them: floats uniform in [-1, 1) (zero-mean, like the normalized
inputs networks are trained on: polygraphy's default [0, 1) left timm's DPN-68 with random weights giving
the same logits on every input, so its verification could judge nothing), integer
indices into an embedding table (a Gather on an initializer) over the table's rows
(token ids over the vocabulary), other integers in {0, 1} (masks).
"""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import onnx
from polygraphy.backend.base import BaseRunner
from polygraphy.common import TensorMetadata

from parastream.core.accuracy import DEFAULT_SCALE_TOLERANCES, reference_scale, scale_tolerance, scaled_error  # noqa: F401
from parastream.core.errors import ParastreamError
from parastream.core.tensors import TensorSpec

DEFAULT_TOLERANCES = {  # (rtol, atol) per precision: the elementwise criterion (--rtol/--atol) and its recorded figures
    "fp32": (1e-4, 1e-5),
    "tf32": (5e-3, 5e-3),
    "fp16": (2e-2, 2e-2),
    "bf16": (5e-2, 5e-2),
}

NEAR_ZERO = 1e-6  # a reference output with max|ref| at or below this on every input has no scale to compare against


def resolve_tolerances(precision: str, rtol: float | None = None, atol: float | None = None,
                       scale_tol: float | None = None) -> tuple[float, float, float | None]:
    """(rtol, atol, scale_tol) for ``verify`` from the user's options (None = not given).

    An explicit rtol or atol asks for the elementwise criterion (scale_tol None); otherwise the
    scaled criterion decides, with ``scale_tol`` or the precision's default.
    """
    if scale_tol is not None and (rtol is not None or atol is not None):
        raise ParastreamError("--scale-tol and --rtol/--atol choose different criteria (scaled vs elementwise); give one or the other")
    if scale_tol is not None and not scale_tol > 0:
        raise ParastreamError(f"--scale-tol {scale_tol} must be a positive number")
    for flag, value in (("--rtol", rtol), ("--atol", atol)):
        if value is not None and not value >= 0:
            raise ParastreamError(f"{flag} {value} must be a number >= 0")
    d_rtol, d_atol = DEFAULT_TOLERANCES.get(precision, DEFAULT_TOLERANCES["fp32"])
    if scale_tol is None and rtol is None and atol is None:
        scale_tol = scale_tolerance(precision)
    return (d_rtol if rtol is None else rtol, d_atol if atol is None else atol, scale_tol)


def bundle_tolerances(bundle, rtol: float | None = None, atol: float | None = None,
                      scale_tol: float | None = None) -> tuple[float, float, float | None]:
    """The tolerances ``parastream verify`` applies to ``bundle``: the ones given, else those it was built with."""
    if rtol is None and atol is None and scale_tol is None:
        opts = (bundle.manifest.get("options") or {})
        rtol, atol, scale_tol = opts.get("rtol"), opts.get("atol"), opts.get("scale_tol")
    return resolve_tolerances(bundle.plan.precision, rtol, atol, scale_tol)


# ops an integer index passes through unchanged on its way to a Gather
_INDEX_PASSTHROUGH = {"Cast", "Unsqueeze", "Squeeze", "Reshape", "Flatten", "Identity", "Expand"}


def input_value_ranges(model: onnx.ModelProto, inputs: list[TensorSpec]) -> dict[str, tuple]:
    """The range polygraphy draws each input from: integers that index an embedding table (Gather on an
    initializer or Constant, directly or through casts and reshapes) over [0, rows - 1] of the smallest such
    table (token ids over the vocabulary, token types over their 2 rows); other integers and bools {0, 1};
    floats [-1, 1)."""
    rows: dict[str, int] = {}
    for t in model.graph.initializer:
        if t.dims:
            rows[t.name] = int(t.dims[0])
    consumers: dict[str, list] = {}
    for node in model.graph.node:
        if node.op_type == "Constant":
            for a in node.attribute:
                if a.name == "value" and a.t.dims:
                    rows[node.output[0]] = int(a.t.dims[0])
        for i, name in enumerate(node.input):
            consumers.setdefault(name, []).append((node, i))

    def table_rows(tensor: str, depth: int = 0) -> int | None:
        found = None
        for node, i in consumers.get(tensor, []):
            n = None
            if node.op_type == "Gather" and i == 1 and node.input[0] in rows:
                axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
                n = rows[node.input[0]] if axis == 0 else None
            elif node.op_type in _INDEX_PASSTHROUGH and i == 0 and depth < 8:
                n = table_rows(node.output[0], depth + 1)
            if n is not None:
                found = n if found is None else min(found, n)
        return found

    ranges: dict[str, tuple] = {}
    for spec in inputs:
        kind = np.dtype(spec.dtype).kind
        if kind in "iu":
            n = table_rows(spec.name)
            ranges[spec.name] = (0, max(0, n - 1)) if n else (0, 1)
        elif kind == "b":
            ranges[spec.name] = (False, True)
        else:
            ranges[spec.name] = (-1.0, 1.0)
    return ranges


class LauncherRunner(BaseRunner):
    """A polygraphy runner around a parastream launcher (anything callable feeds -> outputs)."""

    def __init__(self, launcher, inputs: list[TensorSpec], name: str = "parastream", *, load=None):
        super().__init__(name=name)
        self._launcher = launcher
        self._inputs = inputs
        self._load = load  # load() -> launcher: loaded when the comparison runs it, closed after

    def activate_impl(self):
        if self._load is not None:
            # polygraphy runs the runners one after the other: the reference's session is gone by now, so the
            # build never holds both (with a large model, the peak of its memory)
            self._launcher = self._load()

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
        if self._load is not None:
            close = getattr(self._launcher, "close", None)
            if close:
                close()
            self._launcher = None


@dataclass
class Verification:
    passed: bool
    rtol: float
    atol: float
    iterations: int
    seed: int
    # name -> {max_abs, max_rel, max_scaled, max_ref, elementwise_passed, passed, meaningful, not_meaningful}
    # ``passed`` is by the criterion; ``not_meaningful`` says why the reference cannot judge this output (or None)
    outputs: dict = field(default_factory=dict)
    scale_tol: float | None = None  # None: the elementwise criterion decides
    input_ranges: dict = field(default_factory=dict)
    padding_masks: list = field(default_factory=list)  # inputs drawn as a tokenizer pads (TokenizerMasks)
    reference_ahead_s: float | None = None  # the reference's seconds where it ran during the build (ReferenceRun)

    @property
    def criterion(self) -> str:
        return "elementwise" if self.scale_tol is None else "scaled"

    @property
    def status(self) -> str:
        """passed, failed, or inconclusive (every output matched, but no output's reference carries information)."""
        if self.passed:
            return "passed"
        if self.outputs and all(d["passed"] for d in self.outputs.values()):
            return "inconclusive"
        return "failed"

    def describe_criterion(self) -> str:
        if self.scale_tol is None:
            return f"elementwise: rtol {self.rtol}, atol {self.atol}"
        return f"scaled error max|out-ref|/max|ref| <= {self.scale_tol}"

    def failure(self) -> str:
        """One phrase naming the worst output and why it fails (or why the comparison is inconclusive)."""
        if self.status == "inconclusive":
            reasons = "; ".join(f"{name!r}: {d['not_meaningful']}" for name, d in self.outputs.items())
            return f"inconclusive: no output's reference carries information ({reasons})"
        failed = [kv for kv in self.outputs.items() if not kv[1].get("passed", False)]
        if not failed:
            return "no outputs compared" if not self.outputs else ""
        name, o = max(failed, key=lambda kv: kv[1].get("max_scaled", 0.0))
        if self.scale_tol is not None:
            return f"output {name!r}: max|out-ref|/max|ref| = {o.get('max_scaled', float('nan')):.3g} > {self.scale_tol}"
        return (f"output {name!r}: max abs error {o.get('max_abs', float('nan')):.3g}, max rel error "
                f"{o.get('max_rel', float('nan')):.3g} (rtol {self.rtol}, atol {self.atol})")

    def to_dict(self) -> dict:
        return {"passed": self.passed, "status": self.status, "criterion": self.criterion, "scale_tol": self.scale_tol,
                "rtol": self.rtol, "atol": self.atol, "iterations": self.iterations, "seed": self.seed,
                "input_ranges": {k: [v[0], v[1]] for k, v in self.input_ranges.items()},
                **({"padding_masks": "ones then zeros along the last axis: " + ", ".join(self.padding_masks)}
                   if self.padding_masks else {}),
                "outputs": self.outputs, "reference": "onnxruntime (CPU) on the original model",
                **({"reference_ahead_s": round(self.reference_ahead_s, 3)} if self.reference_ahead_s is not None else {})}


def not_meaningful(refs: list) -> str | None:
    """Why the reference values of one output (one array per input drawn) cannot judge a build, or None."""
    arrays = [np.asarray(r) for r in refs]
    if not arrays:
        return "no reference"
    if all(a.size == 0 for a in arrays):
        return "empty on every input"
    finite = [np.isfinite(a.astype(np.float64)) for a in arrays]
    if not any(f.any() for f in finite):
        return "NaN or infinite everywhere on every input"
    if all(reference_scale(a) <= NEAR_ZERO for a in arrays):
        return f"near zero on every input (max|ref| <= {NEAR_ZERO:g})"
    if len(arrays) > 1 and all(a.shape == arrays[0].shape and np.array_equal(a, arrays[0], equal_nan=True)
                               for a in arrays[1:]):
        return f"the same on all {len(arrays)} inputs drawn (constant)"
    return None


def _simple_compare_func(rtol: float, atol: float):
    from polygraphy import comparator

    if hasattr(comparator, "SimpleCompareFunc"):  # polygraphy >= 0.50; CompareFunc.simple is deprecated there
        return comparator.SimpleCompareFunc(rtol=rtol, atol=atol, check_shapes=True)
    return comparator.CompareFunc.simple(rtol=rtol, atol=atol, check_shapes=True)


class _TorchIfImported:
    """polygraphy's lazy ``torch`` module for ``polygraphy.util.array``, answering "not installed" while torch is
    not imported.  polygraphy asks ``is_torch(x)`` of every array it handles and imports torch to answer (2-3 s
    and some 300 MB of a CPU build, where nothing else imports it); no array can be a torch tensor before torch
    is imported, so the answer is the same."""

    def __init__(self, lazy):
        self._lazy = lazy

    def is_installed(self):
        import sys

        return "torch" in sys.modules and self._lazy.is_installed()

    def __getattr__(self, name):
        return getattr(self._lazy, name)


def _polygraphy_without_torch_import() -> None:
    from polygraphy.util import array as pg_array

    if not isinstance(pg_array.torch, _TorchIfImported):
        pg_array.torch = _TorchIfImported(pg_array.torch)


def is_padding_mask(name: str, dtype) -> bool:
    """An integer or bool input named like a tokenizer's attention mask (``attention_mask``, ``input_mask``...):
    1 (True) where a token is real, 0 where it is padding."""
    return "mask" in name.lower() and np.dtype(dtype).kind in "iub"


def padding_masks(inputs: list[TensorSpec], ranges: dict[str, tuple]) -> list[str]:
    """The inputs verification draws as a tokenizer pads them (:class:`TokenizerMasks`): padding masks of rank
    >= 1 drawn from {0, 1}."""
    return [s.name for s in inputs if is_padding_mask(s.name, s.dtype) and len(s.shape) >= 1
            and tuple(int(v) for v in ranges.get(s.name, (0, 1))) == (0, 1)]


class TokenizerMasks:
    """polygraphy's DataLoader with each padding mask redrawn as a tokenizer writes one: along its last axis ones
    then zeros, at least one one, the count of ones the loader drew in that row.

    Drawn 0/1 at random, a mask leaves some queries with no key to attend to (in a causal model every query
    whose earlier tokens are all padding): such a row has no defined output.  The original in fp32 averages the
    padding there (its mask is a large finite negative); an fp16 engine's mask is -inf and the row becomes NaN or
    zeros.  A request never has such a row (its padding follows its tokens), so a difference there is no error
    a user could see; the masking itself is still checked on every row that has real tokens."""

    def __init__(self, loader, names: list[str]):
        self.loader, self.names = loader, names

    def _padded(self, feeds: dict) -> dict:
        out = dict(feeds)
        for name in self.names:
            m = np.asarray(feeds[name])
            kept = np.maximum(1, (m != 0).sum(axis=-1, keepdims=True))
            out[name] = (np.arange(m.shape[-1]) < kept).astype(m.dtype)
        return out

    def __iter__(self):
        return (self._padded(f) for f in self.loader)

    def __getitem__(self, iteration):
        return self._padded(self.loader[iteration])

    @property
    def input_metadata(self):
        return self.loader.input_metadata

    @input_metadata.setter
    def input_metadata(self, value):
        self.loader.input_metadata = value


def seeded_inputs(original: onnx.ModelProto, inputs: list[TensorSpec], *, seed: int, iterations: int,
                  input_ranges: dict[str, tuple] | None = None):
    """(the inputs :func:`verify` draws, the value ranges): polygraphy's DataLoader over the ranges, padding
    masks redrawn as a tokenizer writes them (:class:`TokenizerMasks`); iterating it gives the same feeds, in the
    same order, as a verification with this seed (localization re-runs them)."""
    from polygraphy.comparator import DataLoader

    meta = TensorMetadata()
    for s in inputs:
        meta.add(s.name, np.dtype(s.dtype), tuple(s.shape))
    ranges = dict(input_value_ranges(original, inputs) if input_ranges is None else input_ranges)
    loader = DataLoader(seed=seed, iterations=iterations, input_metadata=meta, val_range=ranges)
    masks = padding_masks(inputs, ranges)
    return (TokenizerMasks(loader, masks) if masks else loader), ranges


def _quiet_polygraphy() -> None:
    from polygraphy import config as pg_config
    from polygraphy.logger import G_LOGGER

    G_LOGGER.module_severity = G_LOGGER.ERROR
    pg_config.INTERNAL_CORRECTNESS_CHECKS = False
    _polygraphy_without_torch_import()


def _reference_key(seed: int, iterations: int, ranges: dict) -> tuple:
    """What a reference's outputs depend on besides the model: the seeded inputs' seed, count and value ranges."""
    return seed, iterations, tuple(sorted(ranges.items()))


class ReferenceRun:
    """ONNX Runtime's outputs on the original model for a verification's seeded inputs, computed in a thread of
    its own while a build goes on, so that the verification at its end runs only the bundle.

    A GPU build's search and engine compiles keep its main thread on the GPU and the cores on compile workers;
    the reference (NASNet-A Large: a 355 MB session and two runs, ~1.5 s) was the larger part of its 2 s
    verification, at the end of the build, where nothing else runs.  The thread runs below the build's own
    priority, as the compile workers do, on a few ONNX Runtime threads that do not spin while they wait, so
    that it does not disturb what the build times.  ``verify(reference=...)`` takes its results when its
    inputs are the verification's (seed, iterations, ranges), else runs the reference itself.

    The thread is not a daemon: a build that stops before its verification (an error) leaves it to finish on
    its own, and the process's exit waits for it rather than tearing ONNX Runtime down under it (an interrupted
    command leaves with ``os._exit`` after ``interrupts.exit_when_threads_linger``)."""

    THREADS = 4

    def __init__(self, original: onnx.ModelProto, inputs: list[TensorSpec], *, seed: int, iterations: int = 2,
                 input_ranges: dict[str, tuple] | None = None, original_bytes: bytes | None = None):
        import threading

        _quiet_polygraphy()
        loader, self.ranges = seeded_inputs(original, inputs, seed=seed, iterations=iterations,
                                            input_ranges=input_ranges)
        self.key = _reference_key(seed, iterations, self.ranges)
        self.feeds = [OrderedDict(f) for f in loader]  # both runs see these very arrays
        self._data = original_bytes if original_bytes is not None else original.SerializeToString()
        self._results = self._error = None
        self.seconds: float | None = None
        self._thread = threading.Thread(target=self._run, name="parastream-reference")
        self._thread.start()

    def _session(self):
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.intra_op_num_threads = self.THREADS
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        return ort.InferenceSession(self._data, sess_options=so, providers=["CPUExecutionProvider"])

    def _run(self) -> None:
        import os
        import threading

        from polygraphy.backend.onnxrt import OnnxrtRunner
        from polygraphy.comparator import Comparator

        t0 = time.perf_counter()
        try:
            try:  # this thread's priority (Linux: per thread), inherited by the session's pool threads it starts
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
            except (AttributeError, OSError):
                pass
            # the session is made when the runner activates and released when it deactivates
            self._results = Comparator.run([OnnxrtRunner(self._session, name="onnxruntime")], data_loader=self.feeds)
        except BaseException as e:  # noqa: BLE001 - raised where the verification takes the results
            self._error = e
        finally:
            self._data = None
            self.seconds = time.perf_counter() - t0

    def results(self, key: tuple):
        """The reference's polygraphy RunResults, once the thread has run; None when ``key`` (seed, iterations,
        ranges) is not the one it ran."""
        if key != self.key:
            return None
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._results

    def __enter__(self) -> "ReferenceRun":
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self._thread.join()


def verify(original: onnx.ModelProto, launcher, inputs: list[TensorSpec], *, rtol: float, atol: float,
           scale_tol: float | None = None, seed: int = 1, iterations: int = 2,
           input_ranges: dict[str, tuple] | None = None, load=None, original_bytes: bytes | None = None,
           reference: ReferenceRun | None = None) -> Verification:
    """Compare ``launcher`` with ONNX Runtime on ``original`` over ``iterations`` seeded random inputs.

    ``scale_tol`` None judges each output elementwise by rtol/atol; a number judges it by its
    scaled error (see the module docstring), rtol/atol then only feed the recorded statistics.
    ``input_ranges`` (name -> (min, max)) defaults to :func:`input_value_ranges` of ``original``.
    ``load`` (launcher None): a function that loads the launcher, called once the reference has run.
    ``original_bytes``: ``original`` serialized, where the caller has it (``LoadedModel.original_bytes``).
    ``reference``: the reference run ahead for these inputs (:class:`ReferenceRun`), taken where it matches.
    """
    from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx
    from polygraphy.comparator import Comparator, RunResults
    from polygraphy.logger import G_LOGGER

    _quiet_polygraphy()
    loader, ranges = seeded_inputs(original, inputs, seed=seed, iterations=iterations, input_ranges=input_ranges)
    ours = LauncherRunner(launcher, inputs, load=load)
    ahead = None if reference is None else reference.results(_reference_key(seed, iterations, ranges))
    if ahead is not None:
        results = RunResults(list(ahead.lst) + list(Comparator.run([ours], data_loader=reference.feeds).lst))
    else:
        data = original_bytes if original_bytes is not None else original.SerializeToString()
        runner = OnnxrtRunner(SessionFromOnnx(data, providers=["cpu"]), name="onnxruntime")
        results = Comparator.run([runner, ours], data_loader=loader)
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
    refs: dict[str, list] = {}
    for ref_it, our_it in zip(ref_iters, our_iters):
        for out_name, ref in ref_it.items():
            d = per_output.setdefault(out_name, {"max_abs": 0.0, "max_rel": 0.0, "max_scaled": 0.0, "max_ref": 0.0,
                                                 "elementwise_passed": True, "passed": True})
            refs.setdefault(out_name, []).append(ref)
            d["max_ref"] = max(d["max_ref"], reference_scale(ref))
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
    for out_name, d in per_output.items():
        reason = not_meaningful(refs.get(out_name, []))
        d["meaningful"], d["not_meaningful"] = reason is None, reason
        if scale_tol is None:
            d["passed"] = d["elementwise_passed"]
        else:
            # an output that is zero everywhere has no scale to measure against: atol decides there
            # (and the output is flagged not meaningful)
            d["passed"] = d["max_scaled"] <= scale_tol or (d["max_ref"] == 0.0 and d["elementwise_passed"])
    passed = (len(per_output) > 0 and all(d["passed"] for d in per_output.values())
              and any(d["meaningful"] for d in per_output.values()))
    return Verification(passed=passed, rtol=rtol, atol=atol, iterations=iterations, seed=seed, outputs=per_output,
                        scale_tol=scale_tol, input_ranges=ranges,
                        padding_masks=list(loader.names) if isinstance(loader, TokenizerMasks) else [],
                        reference_ahead_s=None if ahead is None else reference.seconds)


@contextlib.contextmanager
def running_errors(path, model: onnx.ModelProto, what: str):
    """An error of ONNX Runtime (or of a bundle's engine) while the model runs on random inputs, as one line
    naming the node: a model that loads can still fail to run (a Conv group that does not divide its channels
    or is 0, a Transpose perm of the wrong rank, shapes that contradict the weights)."""
    from parastream.launcher.engines.onnxruntime import describe_error

    try:
        yield
    except ParastreamError:
        raise
    except Exception as e:  # noqa: BLE001 - onnxruntime and polygraphy raise their own types
        raise ParastreamError(f"{path}: running the model on random inputs {what} failed: {describe_error(e, model)}") from None


def run_verification(path, original: onnx.ModelProto, runner, inputs, **kwargs):
    """``verify``, with errors of the model's run as one line (``running_errors``)."""
    with running_errors(path, original, "for verification"):
        return verify(original, runner, inputs, **kwargs)
