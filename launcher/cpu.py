"""The CPU launcher: the same plan on a thread pool, one worker per stream.

Each worker runs its stream's branches in launch order; before a branch starts it
waits on the events of the other-stream branches it consumes (``Branch.waits``),
and after it finishes it sets its own event.  That is the GPU launcher's
fork/join with ``threading.Event`` in place of CUDA events.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from parastream.core.tensors import random_feeds  # noqa: F401 - the CPU build times its alternatives on these

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


def time_calls(runners: dict, feeds: dict, *, runs: int, warmup: int = 3, block: int = 10) -> dict[str, np.ndarray]:
    """Seconds per call of each runner on ``feeds``: ``runs`` calls each after ``warmup``, in alternating blocks
    of ``block`` calls, so that a change in the machine's load falls on all of them alike while one runner's
    spinning threads seldom run into another's calls."""
    for _ in range(warmup):
        for run in runners.values():
            run(feeds)
    times = {name: [] for name in runners}
    while any(len(t) < runs for t in times.values()):
        for name, run in runners.items():
            for _ in range(min(block, runs - len(times[name]))):
                t0 = time.perf_counter()
                run(feeds)
                times[name].append(time.perf_counter() - t0)
    return {name: np.asarray(t) for name, t in times.items()}


def race_calls(runners: dict, feeds: dict, *, runs: int, warmup: int = 1, block: int = 5,
               behind: float = 0.10) -> dict[str, np.ndarray]:
    """Seconds per call of each runner, timed in alternating blocks of ``block`` calls (as :func:`time_calls`),
    with a sequential stop: after each round, a runner whose FASTEST call so far is slower than the current
    leader's median by more than ``behind`` is clearly behind and is not called again (its calls so far are
    returned).  At most ``runs`` calls each; at least one block each."""
    for _ in range(warmup):
        for run in runners.values():
            run(feeds)
    times: dict[str, list[float]] = {name: [] for name in runners}
    active = list(runners)
    while active and any(len(times[n]) < runs for n in active):
        for name in active:
            for _ in range(min(block, runs - len(times[name]))):
                t0 = time.perf_counter()
                runners[name](feeds)
                times[name].append(time.perf_counter() - t0)
        medians = {n: float(np.median(times[n])) for n in active}
        lead = min(medians.values())
        active = [n for n in active if min(times[n]) <= lead * (1.0 + behind)]
    return {name: np.asarray(t) for name, t in times.items()}


class OthersLoad:
    """The share of this machine's CPU time that OTHER processes used while the block ran (0..1), from the
    kernel's counters (/proc/stat: every core's busy time, less this process's own); ``share`` is None where
    they cannot be read (not Linux).  A timing taken while others use the cores says how the machine is
    loaded, not how the alternatives compare: the CPU build does not let it replace its default."""

    def __init__(self):
        self.share: float | None = None

    @staticmethod
    def _machine_busy_s() -> float | None:
        try:
            with open("/proc/stat") as f:
                fields = f.readline().split()[1:]
            ticks = [int(x) for x in fields]
        except (OSError, ValueError, IndexError):
            return None
        idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
        return (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")

    def __enter__(self):
        self._busy0, self._own0, self._t0 = self._machine_busy_s(), time.process_time(), time.perf_counter()
        return self

    def __exit__(self, *exc):
        busy1 = self._machine_busy_s()
        wall = time.perf_counter() - self._t0
        if self._busy0 is not None and busy1 is not None and wall > 0:
            others = (busy1 - self._busy0) - (time.process_time() - self._own0)
            self.share = min(1.0, max(0.0, others / (wall * (os.cpu_count() or 1))))
        return False


class CpuLauncher:
    """Runs a bundle's plan on the CPU, one thread per stream."""

    def __init__(self, bundle: Bundle, *, threads_per_engine: int | None = None):
        self.bundle = bundle
        self.plan = plan = bundle.plan
        backend = bundle.backend()
        self.threads = default_threads(plan) if threads_per_engine is None else threads_per_engine
        opts = BuildOptions(precision=plan.precision, threads=self.threads, spin=len(plan.branches) == 1)
        self.engines = []
        for b in plan.branches:
            specs_in = [plan.tensors[t] for t in b.inputs]
            specs_out = [plan.tensors[t] for t in b.outputs]
            self.engines.append(backend.load(bundle.engine_bytes(b), specs_in, specs_out, device="cpu", options=opts))
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
