"""The CPU launcher: the same plan on a thread pool, one worker per stream.

Each worker runs its stream's branches in launch order; before a branch starts it
waits on the events of the other-stream branches it consumes (``Branch.waits``),
and after it finishes it sets its own event.  That is the GPU launcher's
fork/join with ``threading.Event`` in place of CUDA events.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .bundle import Bundle
from .engines.base import BuildOptions
from .errors import ParastreamError
from .plan import Plan


def coerce_feeds(plan: Plan, feeds: dict, _specs: list | None = None) -> dict[str, np.ndarray]:
    """Check the caller's inputs against the plan: every input present, shape and dtype right.  ``_specs``:
    [(name, shape tuple, numpy dtype)] of the plan's inputs, made once by the launcher (on a model of half a
    millisecond, making them on every call was a measurable part of the call)."""
    specs = _specs if _specs is not None else _input_specs(plan)
    out = {}
    for name, shape, dtype in specs:
        arr = feeds.get(name)
        if arr is None:
            raise ParastreamError(f"missing input {name!r}; the model takes {[t.name for t in plan.inputs]}")
        if not (type(arr) is np.ndarray and arr.dtype == dtype and arr.flags.c_contiguous):
            arr = np.asarray(arr)
        if arr.shape != shape:
            raise ParastreamError(f"input {name!r} has shape {list(arr.shape)}, the bundle was built for {list(shape)}")
        out[name] = arr if arr.dtype == dtype and arr.flags.c_contiguous else np.ascontiguousarray(arr, dtype=dtype)
    if len(feeds) != len(specs) or len(out) != len(feeds):
        unknown = set(feeds) - {t.name for t in plan.inputs}
        if unknown:
            raise ParastreamError(f"unknown input(s) {sorted(unknown)}; the model takes {[t.name for t in plan.inputs]}")
    return out


def _input_specs(plan: Plan) -> list[tuple[str, tuple, np.dtype]]:
    return [(s.name, tuple(s.shape), np.dtype(s.dtype)) for s in plan.inputs]


def default_threads(plan: Plan) -> int:
    """Intra-op threads per engine: what the build measured best (plan.cpu_threads), else every core for one
    stream and the cores shared out among several (0 = onnxruntime's default, every core)."""
    if plan.cpu_threads is not None:
        return plan.cpu_threads
    return 0 if plan.num_streams <= 1 else max(1, (os.cpu_count() or 1) // plan.num_streams)


def _return_freed_memory() -> None:
    """Hand the heap memory that loading freed back to the system (glibc's ``malloc_trim``; elsewhere nothing).
    A load parses model.onnx and copies its weights into the sessions, then frees what it parsed, but glibc keeps
    freed heap pages for reuse: a serving process stayed at its load's peak (NASNet-A Large's CPU bundle 1640 MiB
    resident; 430 MiB once trimmed).  No library does this for a Python process; ctypes reaches libc itself."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: its allocator returns memory its own way
        pass


class CpuLauncher:
    """Runs a bundle's plan on the CPU, one thread per stream."""

    def __init__(self, bundle: Bundle, *, threads_per_engine: int | None = None):
        self.bundle = bundle
        self.plan = plan = bundle.plan
        backend = bundle.backend()
        self.threads = default_threads(plan) if threads_per_engine is None else threads_per_engine
        opts = BuildOptions(precision=plan.precision, threads=self.threads, spin=len(plan.branches) == 1)
        self.engines = []
        try:
            for b in plan.branches:
                specs_in = [plan.tensors[t] for t in b.inputs]
                specs_out = [plan.tensors[t] for t in b.outputs]
                data = bundle.engine_bytes(b)  # (its errors name the file)
                try:
                    self.engines.append(backend.load(data, specs_in, specs_out, device="cpu",
                                                     options=opts, model_weights=bundle.initializer))
                except ParastreamError as e:  # name the engine's file, as the GPU launcher does
                    raise ParastreamError(f"{bundle.engine_path(b)}: {e}") from None
        finally:
            bundle.drop_weights()  # the sessions hold the weights they took
            _return_freed_memory()
        self._sequences = plan.stream_sequences()
        self._input_specs = _input_specs(plan)
        self._pool = ThreadPoolExecutor(max_workers=max(1, plan.num_streams), thread_name_prefix="parastream-stream")

    @property
    def input_specs(self):
        return self.plan.inputs

    @property
    def output_specs(self):
        return self.plan.outputs

    def __call__(self, feeds: dict, *, boundaries: dict | None = None) -> dict[str, np.ndarray]:
        """Run once.  ``boundaries``: a dict that also gets every tensor that crosses a branch boundary."""
        plan = self.plan
        values: dict[str, np.ndarray] = coerce_feeds(plan, feeds, self._input_specs)
        if plan.num_streams == 1:  # one stream: in the caller's thread, in launch order (no pool, no events)
            for bid in plan.launch_order:
                values.update(self.engines[bid].run({t: values[t] for t in plan.branches[bid].inputs}))
            if boundaries is not None:
                boundaries.update(values)
            return {t.name: values[t.name] for t in plan.outputs}
        done = [threading.Event() for _ in plan.branches]
        failed: list[BaseException] = []

        def worker(seq: list[int]) -> None:
            for bid in seq:
                b = plan.branches[bid]
                for w in b.waits:
                    done[w].wait()
                if failed:
                    # another stream failed: unblock everyone waiting on us and stop
                    done[bid].set()
                    continue
                try:
                    res = self.engines[bid].run({t: values[t] for t in b.inputs})
                    values.update(res)
                except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                    failed.append(e)
                finally:
                    done[bid].set()

        futures = [self._pool.submit(worker, seq) for seq in self._sequences if seq]
        for f in futures:
            f.result()
        if failed:
            raise failed[0]
        if boundaries is not None:
            boundaries.update(values)
        return {t.name: values[t.name] for t in plan.outputs}

    def close(self) -> None:
        self._pool.shutdown(wait=False)
