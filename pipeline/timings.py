"""What a build timed, recorded for the builds after it: TensorRT's timing cache, one level up.

A GPU build decides by measurement which of the search's candidates ships (``measure.GpuMeasurer``) and each
round of ``measure.time_alternatives`` (fusions, kernels, layouts, streams, engine blocks). Each of those
compiles, loads and times another form of the model, and together they are most of a build's seconds. With
``--cache-dir DIR`` the build records what it timed and what won in ``DIR/timings/KEY.json``; KEY is what the
timings depend on (``timings_key``): the model's structure (its nodes, shapes and types, the values of integer
and scalar-sized initializers, but not its weights), the build options that
change what is built or timed, the device, and the versions of parastream's code, torch and the backend.

A later build with the same KEY (the same model rebuilt, or rebuilt with other weights) takes the recorded
decisions instead of timing again: its search replays the rewrites of the candidate the recorded build kept,
piece by piece, instead of searching (``RecordedMeasurer.replay_pieces``, ``rewrite.search.replay_piece``; where a
rewrite does not replay, it searches and is handed the recorded times in the order it asks for them, by each
candidate's rewrites: a candidate whose rewrites are not those recorded at that place ends the measurements, as
a spent budget does), and its rounds the recorded result when its plan is the one they were timed on. The
engines it ships are compiled (or found in ``DIR``'s compiled-branch cache) and verified as in any build;
report.json says what was taken from which file. ``--remeasure`` times everything again and records anew.

A CPU build (onnxruntime's engines) times one thing: which of plain onnxruntime, the rewritten model and the
plan ships (``measure.choose_cpu_alternative``; NASNet-A Large: 33 s of a 53 s build on a 2-core machine, four
alternatives of 340 MB each built and timed). Its record holds that choice, made on a machine other processes
left to it (``measure.cpu_choice_recordable``), and whether its search (the cost model's, which the KEY
determines) kept the input; the device in its KEY is the host's CPU model and core count with onnxruntime's
version (``engines.onnxruntime.describe_device``). A rebuild builds the recorded alternative alone, and does not
search where the search kept the input or the choice ships the loaded model as it is.

Why a file of our own rather than a library's: the decisions are parastream's (which rewrite, which fusion), and
TensorRT's timing cache, the model for this, holds per-layer kernel timings that only its builder reads.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import onnx

from parastream.core.files import write_atomic
from parastream.rewrite.search import MeasureBudgetSpent

TIMINGS_VERSION = 3
#: floating-point initializers of at most this many elements are keyed by value (scales, clip bounds and the
#: constants a rewrite rule matches, such as GELU's); larger ones are weights, keyed by name, type and shape only.
#: Integer initializers (shapes, axes, indices) are always keyed by value.
SMALL_FLOAT_VALUES = 4
#: build options that change neither what is built nor what is timed (where, how many processes, how checked)
NOT_IN_KEY = frozenset({"force", "cache_dir", "remeasure", "compile_workers", "gpu_timing_lock", "verify", "rtol",
                        "atol", "scale_tol"})
_FLOATS = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16,
                     onnx.TensorProto.DOUBLE})


def model_digest(model: onnx.ModelProto) -> str:
    """sha256 of ``model``'s structure: opsets, graph inputs and outputs, every node, and each initializer's name,
    type and shape (its values only where it is a scalar-sized float or not floating-point). Two exports of one
    architecture with different weights have the same digest; any change of a node, shape or small constant
    changes it."""
    h = hashlib.sha256()
    g = model.graph
    for o in model.opset_import:
        h.update(f"opset {o.domain}:{o.version};".encode())
    for v in list(g.input) + list(g.output):
        h.update(v.SerializeToString(deterministic=True))
    for t in g.initializer:
        h.update(f"init {t.name} {t.data_type} {list(t.dims)};".encode())
        count = 1
        for d in t.dims:
            count *= int(d)
        if count <= SMALL_FLOAT_VALUES or t.data_type not in _FLOATS:
            h.update(t.SerializeToString(deterministic=True))
    for n in g.node:
        h.update(n.SerializeToString(deterministic=True))
    return h.hexdigest()


@functools.lru_cache(maxsize=1)
def code_digest() -> str:
    """sha256 of parastream's own sources: a change of the search, the converter or the planner may change what a
    build makes and times, so recorded timings hold for the code that recorded them only."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for sub in ("core", "launcher", "pipeline", "rewrite"):
        for p in sorted((root / sub).rglob("*.py")):
            h.update(str(p.relative_to(root)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def plan_digest(plan) -> str:
    """sha256 of ``measure.plan_signature(plan)``: which engines, on which streams, with which boundaries."""
    from .measure import plan_signature

    return hashlib.sha256(json.dumps(plan_signature(plan), default=str).encode()).hexdigest()


def timings_key(model: onnx.ModelProto, cfg, backend, versions: dict) -> str:
    """KEY for ``model`` as loaded (its shapes set), built with ``cfg`` by ``backend``: a digest of what the
    timings depend on."""
    parts = {"model": model_digest(model),
             "options": {k: v for k, v in sorted(asdict(cfg).items()) if k not in NOT_IN_KEY},
             "device": backend.describe_device(), "versions": versions, "code": code_digest(),
             "format": TIMINGS_VERSION}
    named = json.dumps(parts, sort_keys=True, default=lambda o: getattr(o, "name", None) or type(o).__name__)
    return hashlib.sha256(named.encode()).hexdigest()[:32]


def timings_path(cache_dir: str | os.PathLike, key: str) -> Path:
    return Path(cache_dir) / "timings" / f"{key}.json"


def read_timings(path: Path) -> dict | None:
    """The record at ``path``, or None where there is none or it is not one this code wrote (it is then timed
    again and written over)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("format") != TIMINGS_VERSION:
        return None
    return record


def write_timings(path: Path, record: dict) -> None:
    """``record`` at ``path``, written atomically (another build reading the cache sees the old file or the new)."""
    write_atomic(path, json.dumps(dict(record, format=TIMINGS_VERSION), indent=1, default=str).encode())


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


@dataclass
class RecordedMeasurer:
    """The search's ``Measurer`` from a record (``by_trace``): the i-th candidate the search asks for, by its
    rewrites, is given the i-th recorded time when its rewrites are the ones recorded there; any other ends the
    measurements (``MeasureBudgetSpent``), so that the search decides among those that matched, as among those
    a budget left.  The search exports none of them (the record's KEY holds the model's structure and the code,
    so equal rewrites make equal candidates), and nothing is compiled, loaded or timed."""

    measured: list[dict]  # [{"trace": the candidate's rule applications, "seconds"}], in the order measured
    one_engine: dict | None = None  # the kept candidate ran faster as one engine: its times (``one_engine_timed``)
    replay_pieces: list | None = None  # each piece's rewrites of the candidate kept: the search replays them
    decision: str = ""  # the recorded search's decision, as its report said it
    source: str = ""  # the record's file, for the log
    lookahead: int = 1
    by_trace: bool = True
    log: list = field(default_factory=list)
    matched: list = field(default_factory=list)  # the recorded measurements given, in order

    def adopt(self, model: onnx.ModelProto, graph) -> None:
        pass

    def prepare(self, models: list[onnx.ModelProto]) -> dict | None:
        return None

    def measure(self, model: onnx.ModelProto) -> float:
        raise MeasureBudgetSpent(f"the recorded search ({self.source}) gives times by rewrites, not by model")

    def measure_trace(self, trace: tuple) -> float:
        i = len(self.matched)
        if i >= len(self.measured) or tuple(self.measured[i].get("trace") or ()) != tuple(trace):
            raise MeasureBudgetSpent(f"not timed by the recorded build ({self.source})")
        rec = self.measured[i]
        self.matched.append(rec)
        self.log.append({"recorded_s": rec["seconds"], "rewrites": len(trace), "from": self.source})
        return float(rec["seconds"])

    def one_engine_timed(self, model: onnx.ModelProto) -> dict | None:
        """The recorded build's: it kept the same candidate, from the same times."""
        return self.one_engine

    @property
    def calls(self) -> int:
        return len(self.matched)

    def close(self) -> None:
        pass
