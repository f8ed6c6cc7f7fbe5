"""Timing of launchers: what the build times to decide, and ``parastream bench``.

The launcher (launcher/) is the runtime: it loads and runs a bundle.  Everything that times one lives here:
the GPU timing lock (``gpu_timing_lock``) and CUDA-event timed replays of launchers in alternating blocks
(``measure``), which pipeline/measure.py uses for the search's candidates and the timed alternatives; calls
timed in alternating blocks on the CPU (``time_calls``, ``race_calls``, ``time_alternating``) and the load other
processes put on the machine meanwhile (``OthersLoad``), which the CPU build's choice uses; and the ``parastream
bench`` command: ``bench_bundle`` (GPU, or ``bench_cpu`` for a CPU bundle), ``bench_buckets`` (a dynamic-batch
bundle) and their printing.

``parastream bench OUT`` on a GPU bundle: its latency against the same engines on one stream.

Both variants are one CUDA Graph each, built from the *same* loaded engines: the
bundle's multi-stream plan, and every branch on a single stream in launch order.
Each is timed with CUDA events around every graph replay, after a warm-up, over
``runs`` replays (median), rotating several random input sets (never zeros) that
are copied in outside the timed region.  The variants are timed in alternating blocks
so that clock drift hits them alike, and each block is queued whole before the GPU starts
on it (``measure``'s ``hold``), so that the events time the GPU's work, not the queuing.

A TensorRT bundle gets a third variant (``whole_model=True``, the default): the bundle's
model.onnx built as ONE TensorRT engine with the bundle's precision and builder options and
``max_aux_streams`` = the plan's streams - 1, i.e. TensorRT's own inter-layer parallelism in place
of parastream's branches (``WholeModelLauncher``: its enqueue captured into one CUDA Graph).  Its
outputs are checked against the multi-stream launcher's before it is timed.

``timeline=FILE.png`` adds a separate instrumented replay (timing events around
every engine) and draws when each branch ran on each stream.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path

import numpy as np

from parastream.core.accuracy import max_scaled_error, scale_tolerance
from parastream.core.errors import ParastreamError
from parastream.core.tensors import random_array, random_feeds
from parastream.launcher import cuda
from parastream.launcher.bundle import Bundle
from parastream.launcher.cuda import nbytes_of
from parastream.launcher.engines.base import BuildOptions

INPUT_SETS = 4
BLOCK = 25
#: a replay whose queuing took this long waited in the driver (its queue full behind a closed gate)
STALLED_S = 0.25


def _time_replays(launcher, input_sets, runs: int, starts, ends, offset: int) -> int | None:
    """Queue ``runs`` timed replays (inputs copied device-to-device before each, outside the events); returns
    how many were queued before one waited in the driver (``STALLED_S``), or None when none did."""
    plan = launcher.plan
    stalled = None
    for i in range(runs):
        t0 = time.perf_counter()
        src = input_sets[(offset + i) % len(input_sets)]
        for spec in plan.inputs:
            cuda.memcpy_dtod_async(launcher.addr[spec.name], src[spec.name], cuda.nbytes_of(spec.shape, spec.dtype), launcher.origin)
        cuda.event_record(starts[offset + i], launcher.origin)
        launcher.launch()
        cuda.event_record(ends[offset + i], launcher.origin)
        if stalled is None and time.perf_counter() - t0 > STALLED_S:
            stalled = i
    return stalled


#: per GPU, how many replays a held block queues: ``BLOCK`` until a block's gate had to be opened by its timer
#: (the driver's queue filled before the block was all queued), then fewer, learned by the process.  BERT-base at
#: batch 32 (H200) filled it: 28 of one candidate's 32 blocks and every block of two rounds waited the timer's
#: 2 s, and those blocks were timed while still being queued; made to fit (6 replays), that build took 59.8 s
#: against 149.8 (search 40.5 against 99.0 s, the rounds after it 1.3 against 33.2)
_HELD_BLOCK: dict[int, int] = {}


def captured_us(fn, reps: int = 20, replays: int = 30) -> float:
    """Microseconds per call of ``fn()`` captured ``reps`` times in one CUDA Graph on the current stream's device,
    the median of ``replays`` replays timed with CUDA events (three warm-up calls on a side stream first, outside
    the capture: cuDNN's plans and cuBLAS's handles are made there).  One op's or one small block's time, for the
    build's per-shape choices (``measure.time_conv_shapes``) and the benchmarks' per-shape tables."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    for _ in range(5):
        g.replay()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / reps)
    return float(np.median(times))


@contextlib.contextmanager
def gpu_timing_lock(device: int = 0, enabled: bool = True):
    """Hold the machine-wide lock for timing on GPU ``device`` (``cuda.gpu_turn``: a flock on a file in the
    temporary folder, one per physical GPU).

    Builds that run side by side on one GPU (a build machine building several models at once) compile in
    parallel but take turns while they time, and a build's compile workers run their engines on the GPU only
    in turns with it: a measurement that shares the GPU with another process's work would decide a build's
    choices on noise.  ``enabled`` False (a build's ``--no-gpu-timing-lock``, recorded in manifest.json) or
    ``PARASTREAM_GPU_TIMING_LOCK=0`` (an override for every process of a machine that runs one build at a time)
    turns it off."""
    with cuda.gpu_turn(device, enabled=enabled):
        yield


def measure(launchers: dict, *, runs: int = 200, warmup: int = 20, seed: int = 0, lock: bool = True,
            hold: bool = True, info: dict | None = None) -> dict[str, np.ndarray]:
    """Per-replay milliseconds of each launcher (all of one bundle), timed in alternating blocks while this
    process holds the GPU's timing lock (``gpu_timing_lock``; ``lock`` False: without it).

    ``hold`` (default): each block of a launcher that replays a captured graph is queued whole behind a closed
    ``cuda.StreamGate`` and then let go, so that the events time the GPU's work and not how fast this thread
    queued it (a build times while its compile workers fill the machine's cores and other threads of its
    process take the interpreter lock).  ``info``, when given, gets ``lock_wait_s``, ``blocks``, ``held`` and
    ``opened_by_timer``, and ``held_block`` where a block the driver could not hold whole made the blocks
    smaller (``_HELD_BLOCK``)."""
    first = next(iter(launchers.values()))
    device = getattr(first, "device", 0) or 0
    t0 = time.perf_counter()
    with gpu_timing_lock(device, enabled=lock), cuda.on_device(device), _gil_handed_back_promptly():
        if info is not None:  # how long the turn took to come (other builds' timings, compile workers' runs)
            info["lock_wait_s"] = round(time.perf_counter() - t0, 3)
        return _measure(launchers, runs=runs, warmup=warmup, seed=seed, hold=hold, info=info)


_SWITCH = {"holders": 0, "before": None}
_SWITCH_LOCK = threading.Lock()


@contextlib.contextmanager
def _gil_handed_back_promptly(interval_s: float = 1e-4):
    """The interpreter's switch interval shortened while this thread times.  Each CUDA call releases the
    interpreter lock, and a thread that comes back from one waits for it up to the switch interval (5 ms by
    default) while another thread runs Python: a block's queuing then took seconds where the build's other
    threads were busy (bench/timing_hold.py's "gil" condition: 16 blocks, 4 of them still unqueued after 2 s).
    Process-wide: the first of overlapping timings (a build run with ``--no-gpu-timing-lock`` may time in two
    threads) shortens it and the last restores it."""
    import sys

    with _SWITCH_LOCK:
        if _SWITCH["holders"] == 0:
            _SWITCH["before"] = sys.getswitchinterval()
            sys.setswitchinterval(min(_SWITCH["before"], interval_s))
        _SWITCH["holders"] += 1
    try:
        yield
    finally:
        with _SWITCH_LOCK:
            _SWITCH["holders"] -= 1
            if _SWITCH["holders"] == 0:
                sys.setswitchinterval(_SWITCH["before"])


def _measure(launchers: dict, *, runs: int, warmup: int, seed: int, hold: bool = True,
             info: dict | None = None) -> dict[str, np.ndarray]:
    first = next(iter(launchers.values()))
    plan = first.plan
    device = getattr(first, "device", 0) or 0
    rng = np.random.default_rng(seed)
    # device copies of several input sets
    sets, owned = [], []
    for _ in range(INPUT_SETS):
        d = {}
        for spec in plan.inputs:
            d[spec.name] = cuda.device_copy(random_array(spec, rng), first.origin, spec.dtype)
            owned.append(d[spec.name])
        sets.append(d)
    gate, counts = None, {"blocks": 0, "held": 0}
    try:
        if hold and any(getattr(la, "captured", False) for la in launchers.values()):
            gate = _gate(counts)
        times = {}
        events = {}
        for name, la in launchers.items():
            events[name] = ([cuda.event_create(timing=True) for _ in range(runs)], [cuda.event_create(timing=True) for _ in range(runs)])
            for i in range(warmup):
                src = sets[i % len(sets)]
                for spec in plan.inputs:
                    cuda.memcpy_dtod_async(la.addr[spec.name], src[spec.name], cuda.nbytes_of(spec.shape, spec.dtype), la.origin)
                la.launch()
            la.synchronize()
        done = 0
        while done < runs:
            # each launcher queues the same number in a round; a block the driver could not hold whole makes the
            # next rounds' blocks fit (``_HELD_BLOCK``)
            n = min(_HELD_BLOCK.get(device, BLOCK) if gate is not None else BLOCK, runs - done)
            for name, la in launchers.items():
                starts, ends = events[name]
                held = gate is not None and getattr(la, "captured", False)
                if held:
                    try:
                        gate.close(la.origin)
                    except cuda.CudaError as e:  # a driver without stream memory operations: timed as queued
                        counts["hold_error"] = str(e)
                        gate.free()
                        gate, held = None, False
                    by_timer = gate.opened_by_timer if held else 0
                stalled = None
                try:
                    stalled = _time_replays(la, sets, n, starts, ends, done)
                finally:
                    if held:
                        gate.open()
                la.synchronize()
                if held and gate.opened_by_timer > by_timer:
                    fits = max(1, (stalled if stalled is not None else n) // 2)
                    _HELD_BLOCK[device] = min(_HELD_BLOCK.get(device, BLOCK), fits)
                    counts["held_block"] = _HELD_BLOCK[device]
                counts["blocks"] += 1
                counts["held"] += held
            done += n
        for name in launchers:
            starts, ends = events[name]
            times[name] = np.array([cuda.event_elapsed_ms(s, e) for s, e in zip(starts, ends)])
            for e in starts + ends:
                cuda.event_destroy(e)
        return times
    finally:
        if gate is not None:
            counts["opened_by_timer"] = gate.opened_by_timer
            gate.free()
        if info is not None:
            info.update(counts)
        for ptr in owned:
            cuda.free(ptr)


def _gate(counts: dict):
    try:
        return cuda.StreamGate()
    except cuda.CudaError as e:
        counts["hold_error"] = str(e)
        return None


def whole_model_options(bundle: Bundle) -> BuildOptions:
    """The builder options of the bundle's own build (precision, workspace, level, typing, timing cache)."""
    opts = bundle.manifest.get("options", {}) or {}
    kw = {k: opts[k] for k in ("workspace_mb", "optimization_level", "strongly_typed", "cache_dir") if opts.get(k) is not None}
    return BuildOptions(precision=bundle.plan.precision, device="cuda", **kw)


def _static_profiles(model, plan) -> dict:
    """min = opt = max = the plan's shape for every model input with a dynamic dimension.

    The plan, and so every branch engine, is static (at OPT of ``--batch``); the baseline is built at the same shapes.
    """
    shapes = {t.name: list(t.shape) for t in plan.inputs}
    out = {}
    for vi in model.graph.input:
        dims = vi.type.tensor_type.shape.dim
        if vi.name in shapes and any(not d.HasField("dim_value") for d in dims):
            s = shapes[vi.name]
            out[vi.name] = (s, s, s)
    return out


def build_whole_model(bundle: Bundle, *, memory=None):
    """The bundle's model.onnx as one TensorRT engine with ``max_aux_streams`` = streams - 1, loaded.

    Returns ``(runner, info)``: a ``TrtWholeModelRunner`` over the plan's inputs and outputs, and the
    figures for the bench result (build seconds, aux streams asked for and used, builder options).
    """
    import onnx

    from parastream.launcher.engines import tensorrt as trt_backend

    model = onnx.load(str(bundle.model_path))
    options = whole_model_options(bundle)
    options.profiles = _static_profiles(model, bundle.plan)
    aux = max(0, bundle.plan.num_streams - 1)
    t0 = time.perf_counter()
    data = trt_backend.build_whole_model_engine(model, options, aux)
    build_s = time.perf_counter() - t0
    runner = trt_backend.TrtWholeModelRunner(data, list(bundle.plan.inputs), list(bundle.plan.outputs), options, memory)
    info = {"build_s": build_s, "max_aux_streams": aux, "aux_streams": runner.aux_streams, "engine_bytes": len(data),
            "precision": options.precision, "workspace_mb": options.workspace_mb,
            "optimization_level": options.optimization_level, "strongly_typed": options.strongly_typed}
    return runner, info


class WholeModelLauncher:
    """One engine (``enqueue(stream, addresses)``) as something ``measure`` can time next to a ``GpuLauncher``.

    Device buffers for the plan's inputs and outputs, an origin stream of its own, one enqueue
    before capture (initialisation stays out of the graph, as in the GPU launcher), then the
    enqueue captured into one CUDA Graph: ``launch()`` is one graph launch.  ``graph=False``:
    ``launch()`` enqueues directly.  TensorRT forks its auxiliary streams from the origin stream
    and joins them back, so the capture holds them too.
    """

    def __init__(self, engine, plan, *, graph: bool = True, device: int = 0):
        self.engine = engine
        self.plan = plan
        self.device = device
        self.use_graph = graph
        self._graph = self._exec = None
        self._closed = True
        cuda.set_device(device)
        specs = {}
        for spec in list(plan.inputs) + list(plan.outputs):
            specs.setdefault(spec.name, spec)
        self.specs = specs
        self.addr = {name: cuda.malloc(nbytes_of(spec.shape, spec.dtype)) for name, spec in specs.items()}
        self._host = {}
        for name, spec in specs.items():
            ptr = cuda.malloc_host(nbytes_of(spec.shape, spec.dtype))
            self._host[name] = (ptr, cuda.host_array(ptr, spec.shape, spec.dtype))
        self.origin = cuda.stream_create()
        self._closed = False
        try:
            self._start(graph)
        except BaseException:
            self.close()  # frees what was allocated above (and the engine), then re-raise
            raise

    def _start(self, graph: bool) -> None:
        rng = np.random.default_rng(0)
        for spec in self.plan.inputs:
            self._copy_in(spec, random_array(spec, rng))
        self.engine.enqueue(cuda.handle(self.origin), self.addr)  # warm-up, never captured
        cuda.stream_synchronize(self.origin)
        if graph:
            cuda.begin_capture(self.origin, "relaxed")
            try:
                self.engine.enqueue(cuda.handle(self.origin), self.addr)
            except BaseException:
                try:
                    cuda.graph_destroy(cuda.end_capture(self.origin))
                except Exception:  # noqa: BLE001 - end the capture, then re-raise the engine's error
                    pass
                raise
            self._graph = cuda.end_capture(self.origin)
            self._exec = cuda.graph_instantiate(self._graph)

    def _copy_in(self, spec, arr) -> None:
        ptr, host = self._host[spec.name]
        np.copyto(host, np.asarray(arr), casting="same_kind")
        cuda.memcpy_htod_async(self.addr[spec.name], ptr, host.nbytes, self.origin)

    @property
    def captured(self) -> bool:
        return self._exec is not None

    def launch(self) -> None:
        if self._exec is not None:
            cuda.graph_launch(self._exec, self.origin)
        else:
            self.engine.enqueue(cuda.handle(self.origin), self.addr)

    def synchronize(self) -> None:
        cuda.stream_synchronize(self.origin)

    def __call__(self, feeds: dict) -> dict:
        """numpy in, numpy out, through the same ``launch()`` that is timed."""
        for spec in self.plan.inputs:
            self._copy_in(spec, np.asarray(feeds[spec.name]).astype(np.dtype(spec.dtype), copy=False))
        self.launch()
        for spec in self.plan.outputs:
            ptr, host = self._host[spec.name]
            cuda.memcpy_dtoh_async(ptr, self.addr[spec.name], host.nbytes, self.origin)
        self.synchronize()
        return {spec.name: self._host[spec.name][1].copy() for spec in self.plan.outputs}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        cuda.stream_synchronize(self.origin)
        if self._exec is not None:
            cuda.graph_exec_destroy(self._exec)
        if self._graph is not None:
            cuda.graph_destroy(self._graph)
        cuda.stream_destroy(self.origin)
        for ptr, _ in self._host.values():
            cuda.free_host(ptr)
        for ptr in self.addr.values():
            cuda.free(ptr)
        self._host, self.addr = {}, {}
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _differences(a: dict, b: dict) -> tuple[dict, float]:
    """max|a-b| per output, and the largest scaled error of ``a`` against ``b`` (``core.accuracy``, verification's
    measure) over the outputs."""
    absdiff = {k: float(np.max(np.abs(a[k].astype(np.float64) - b[k].astype(np.float64)))) if b[k].size else 0.0
               for k in b}
    return absdiff, max_scaled_error(a, b)


def _whole_model_reason(bundle: Bundle) -> str | None:
    """Why no whole-model baseline is attempted for this bundle, or None."""
    if bundle.plan.backend != "tensorrt":
        return f"a TensorRT-only baseline; this bundle's backend is {bundle.plan.backend}"
    try:
        import tensorrt  # noqa: F401
    except Exception as e:  # noqa: BLE001 - ImportError, or a wheel without its libraries
        return f"TensorRT does not import ({type(e).__name__}: {e})"
    return None


def engines_alone_ms(single, *, replays: int = 50) -> dict[int, float]:
    """Each engine's milliseconds with nothing beside it, by branch id: ``single`` (a launcher of the plan's engines
    on one stream, in launch order) replayed with timing events around every engine (``GpuLauncher.run_timed``),
    each engine's median over ``replays`` replays."""
    return {s["branch"]: max(0.0, float(s["end_ms"]) - float(s["start_ms"])) for s in single.run_timed(replays=replays)}


def critical_path_bound(plan, alone_ms: dict[int, float]) -> dict:
    """``plan``'s critical-path bound: its engines' times alone (``engines_alone_ms``) summed along the longest
    chain of engines each reading an output of the one before (the DAG of the plan's data dependencies; its stream
    order is the plan's choice, not a dependency).  No schedule of these engines on any number of streams ends
    sooner, as long as an engine runs no faster beside others than alone; a plan's time over it is what its
    launches, event waits and the engines sharing the GPU cost.  networkx finds the path (``dag_longest_path``).
    Returns {"bound_ms", "chain": the engines along it (names), "chain_ids": their branch ids, "alone_sum_ms":
    every engine's time alone, summed}."""
    import networkx as nx

    producer = {t: b.id for b in plan.branches for t in b.outputs}
    by_id = {b.id: b for b in plan.branches}
    g = nx.DiGraph()
    for b in plan.branches:
        g.add_edge("start", b.id, ms=alone_ms[b.id])  # (a chain may start at any engine)
        for t in b.inputs:
            p = producer.get(t)
            if p is not None and p != b.id:
                g.add_edge(p, b.id, ms=alone_ms[b.id])
    chain = nx.dag_longest_path(g, weight="ms")[1:]
    return {"bound_ms": float(sum(alone_ms[i] for i in chain)), "chain": [by_id[i].name for i in chain],
            "chain_ids": list(chain), "alone_sum_ms": float(sum(alone_ms.values()))}


def measured_bound(plan, single) -> dict | None:
    """A plan with streams: its critical-path bound, or {"error": why} where it could not be timed; None for a plan
    of one stream (no bound to give).  The longest dependent chain is found from the engines timed alone on
    ``single`` (``engines_alone_ms``, ``critical_path_bound``), and the bound is that chain's engines run back to
    back alone (``single.time_chain``): no plan of these engines ends sooner, since the chain's engines run one
    after another in any plan.  The sum of their times alone (``chain_events_ms``) holds the gap that the events
    around each engine add, and over a chain of many small engines it exceeded what the plan itself ran (a
    decoder's 188 engines: a "bound" of 0.819 against 0.693 ms).  A launcher without ``time_chain`` gives the sum,
    and so does one whose chain could not be run alone (``chain_error`` says why)."""
    if plan.num_streams < 2:
        return None
    try:
        cp = critical_path_bound(plan, engines_alone_ms(single))
    except Exception as e:  # noqa: BLE001 - the bound is beside the timings, which stand without it
        return {"error": f"{type(e).__name__}: {e}"}
    timer = getattr(single, "time_chain", None)
    if timer is not None:
        try:
            alone = float(timer(cp["chain_ids"]))
        except Exception as e:  # noqa: BLE001 - the events' sum stands, said to be that
            cp["chain_error"] = f"{type(e).__name__}: {e}"
        else:
            cp["chain_events_ms"], cp["bound_ms"] = cp["bound_ms"], alone
    return cp


def bench_bundle(path, *, runs: int | None = None, warmup: int | None = None, timeline: str | Path | None = None, console=None,
                 launcher=None, whole_model: bool = True, graph: bool | None = None, concat_ablation: bool = False,
                 gpu: int = 0, original: str | Path | None = None) -> dict:
    """Median latency (ms) of the bundle's multi-stream graph and of the same engines on one stream, and their ratio.

    ``whole_model``: on a TensorRT bundle, also time the whole model as one TensorRT engine with
    ``max_aux_streams`` = streams - 1 (``tensorrt_whole_model_ms``, ``speedup_vs_whole_model``).
    ``graph``: CUDA Graphs for the variants bench makes (default: the given launcher's mode, else True);
    False enqueues directly (engines that cannot be captured; the TensorRT test double).
    ``concat_ablation``: where the launcher does Concats in place, also time the same bundle with
    every Concat as its own engine (loaded a second time), ``concat_copies_ms``.
    ``gpu``: the GPU every variant runs on (a given ``launcher``'s own device instead, where it has one).
    ``original``: a CPU bundle's baseline model (default: the one report.json records; see ``bench_cpu``).
    """
    bundle = path if isinstance(path, Bundle) else Bundle.open(path, loading=True)
    gpu = int(getattr(launcher, "device", gpu) if launcher is not None else gpu)
    cpu = not bundle.backend().gpu
    runs = (50 if cpu else 200) if runs is None else runs
    warmup = (5 if cpu else 20) if warmup is None else warmup
    if runs < 1:
        raise ParastreamError(f"--runs {runs}: must be at least 1")
    if cpu:
        result = bench_cpu(bundle, runs=runs, warmup=warmup, original=original)
        if console is not None:
            print_bench_cpu(result, console)
        return result
    from parastream.launcher.gpu import GpuLauncher

    if cuda.device_count() < 1:
        raise ParastreamError("parastream bench needs a CUDA GPU, and cuda-python sees none")
    if graph is None:
        graph = bool(getattr(launcher, "use_graph", True)) if launcher is not None else True
    multi = launcher or GpuLauncher(bundle, graph=graph, device=gpu)
    single = GpuLauncher(bundle, single_stream=True, engines=multi.engines, graph=graph, device=gpu)
    whole = copies = None
    try:
        # same engines, same inputs: the two graphs must agree before their times mean anything
        rng = np.random.default_rng(123)

        feeds = {s.name: random_array(s, rng) for s in bundle.plan.inputs}
        a, b = multi(feeds), single(feeds)
        mismatch = {k: float(np.max(np.abs(a[k].astype(np.float64) - b[k].astype(np.float64)))) for k in a}
        variants = {"parastream": multi, "single_stream": single}
        baseline: dict = {}
        if whole_model and bundle.plan.backend == "tensorrt":
            skip = _whole_model_reason(bundle)
            if skip is None:
                baseline, whole = _whole_model_baseline(bundle, multi, feeds, a, graph)
                if whole is not None:
                    variants["tensorrt_whole_model"] = whole
            else:
                baseline = {"tensorrt_whole_model_error": skip}
        if concat_ablation and getattr(multi, "elided", ()):
            copies = GpuLauncher(bundle, graph=graph, concat_in_place=False, device=gpu)
            variants["concat_copies"] = copies
        times = measure(variants, runs=runs, warmup=warmup)
        result = {
            "bundle": str(bundle.path),
            "device": cuda.device_name(multi.device),
            "streams": bundle.plan.num_streams,
            "branches": len(bundle.plan.branches),
            "concats_in_place": len(getattr(multi, "elided", ())),
            "precision": bundle.plan.precision,
            "runs": runs,
            "graph": graph,
            "parastream_ms": float(np.median(times["parastream"])),
            "single_stream_ms": float(np.median(times["single_stream"])),
            "parastream_p10_p90_ms": [float(np.percentile(times["parastream"], 10)), float(np.percentile(times["parastream"], 90))],
            "single_stream_p10_p90_ms": [float(np.percentile(times["single_stream"], 10)), float(np.percentile(times["single_stream"], 90))],
            "max_abs_diff_single_vs_multi": mismatch,
        }
        result["speedup"] = result["single_stream_ms"] / result["parastream_ms"]
        if "host_tail" in bundle.manifest:  # (its replay on the GPU is what the streams change; the tail is host work)
            result["host_tail"] = ("not in these times: they time the plan's replay; its data-dependent tail runs in "
                                   "onnxruntime after it (bench/detector_gpu.py times the whole)")
        result.update(baseline)
        if "concat_copies" in times:
            result["concat_copies_ms"] = float(np.median(times["concat_copies"]))
        if "tensorrt_whole_model" in times:
            t = times["tensorrt_whole_model"]
            result["tensorrt_whole_model_ms"] = float(np.median(t))
            result["tensorrt_whole_model_p10_p90_ms"] = [float(np.percentile(t, 10)), float(np.percentile(t, 90))]
            result["speedup_vs_whole_model"] = result["tensorrt_whole_model_ms"] / result["parastream_ms"]
        cp = measured_bound(bundle.plan, single)  # the distance to the limit
        if cp is not None and "error" in cp:
            result["critical_path_bound_error"] = cp["error"]
        elif cp is not None:
            result.update(critical_path_bound_ms=cp["bound_ms"], critical_path_engines=len(cp["chain"]),
                          engines_alone_sum_ms=cp["alone_sum_ms"], critical_path_events_ms=cp.get("chain_events_ms"),
                          **({"critical_path_chain_error": cp["chain_error"]} if "chain_error" in cp else {}),
                          over_bound=result["parastream_ms"] / cp["bound_ms"] if cp["bound_ms"] > 0 else None)
        if timeline is not None:
            spans = multi.run_timed()
            result["timeline"] = str(timeline)
            result["timeline_mode"] = spans[0]["mode"] if spans else "none"
            result["busy_fraction"] = draw_timeline(spans, timeline, title=f"{bundle.path.name}: {bundle.plan.num_streams} streams, "
                                                    f"{len(spans)} branches, {result['parastream_ms']:.3f} ms per replay")
        if console is not None:
            print_bench(result, console)
        return result
    finally:
        if whole is not None:
            whole.close()
        if copies is not None:
            copies.close()
        single.close()
        if launcher is None:
            multi.close()


def _whole_model_baseline(bundle: Bundle, multi, feeds: dict, reference: dict, graph: bool):
    """Build, load and check the whole-model engine: ``(result entries, WholeModelLauncher or None)``.

    A build or load that TensorRT refuses, or outputs that disagree with the multi-stream launcher's,
    leave the baseline out of the timing and say why under ``tensorrt_whole_model_error``.
    """
    entries: dict = {}
    runner = whole = None
    try:
        runner, info = build_whole_model(bundle)
        entries.update({f"tensorrt_whole_model_{k}": v for k, v in info.items()})
        whole = WholeModelLauncher(runner, bundle.plan, graph=graph, device=multi.device)
        absdiff, scaled = _differences(whole(feeds), reference)
    except ParastreamError as e:
        if whole is not None:
            whole.close()
        elif runner is not None:
            runner.close()
        entries["tensorrt_whole_model_error"] = str(e)
        return entries, None
    # the whole-model engine agrees with the multi-stream launcher within verification's bound for the precision
    # (different engines pick different tactics and fusions)
    tol = scale_tolerance(bundle.plan.precision)
    entries["max_abs_diff_whole_model_vs_multi"] = absdiff
    entries["whole_model_scaled_error"] = scaled
    if not scaled <= tol:
        whole.close()
        entries["tensorrt_whole_model_error"] = (f"its outputs differ from parastream's: max|whole - multi| / max|multi| = {scaled:.3g} "
                                                 f"> {tol:g} ({bundle.plan.precision}); not timed")
        return entries, None
    return entries, whole


CPU_BLOCK = 5  # calls per block of the CPU comparison (runs 50: ten blocks of each, five pairs in each order)
CPU_QUIET_PROBE_S = 0.005  # a sleep over which this process's other threads must use (almost) no CPU
CPU_SETTLE_LIMIT_S = 0.5  # at most this long waiting for them


def settle_own_threads(limit_s: float = CPU_SETTLE_LIMIT_S) -> float:
    """Sleep until this process's other threads use no CPU any more, at most ``limit_s``; returns the seconds waited.

    onnxruntime's intra-op pool threads spin for tens of milliseconds after each call (session option
    ``session.intra_op.allow_spinning``, on by default), on a core that the next runner's own threads need: a block
    begun right after the other runner's block ran beside that spinning and was timed slower than one begun after
    its own runner's block.  Waiting here before every block makes each start alike."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < limit_s:
        c0 = time.process_time()  # CPU time of every thread of this process
        time.sleep(CPU_QUIET_PROBE_S)
        if time.process_time() - c0 < 0.2 * CPU_QUIET_PROBE_S:
            break
    return time.perf_counter() - t0


def _warm_each(runners: dict, feeds: dict, warmup: int) -> None:
    """``warmup`` untimed calls of each runner in turn."""
    for _ in range(warmup):
        for run in runners.values():
            run(feeds)


def _timed_calls(run, feeds: dict, n: int) -> list[float]:
    """Seconds of each of ``n`` calls of ``run`` on ``feeds``: the one timed block of every CPU timer here."""
    calls = []
    for _ in range(n):
        t0 = time.perf_counter()
        run(feeds)
        calls.append(time.perf_counter() - t0)
    return calls


def time_alternating(runners: dict, feeds: dict, *, runs: int, warmup: int, block: int = CPU_BLOCK,
                     settle=settle_own_threads) -> tuple[dict, list]:
    """Seconds per call of two runners on ``feeds``, without a bias between equal ones: ``warmup`` untimed calls
    of each in turn, then blocks of ``block`` calls, the two in turn and the order alternating (AB, BA, AB, ...),
    each block after ``settle()`` (:func:`settle_own_threads`: the other runner's spinning threads have stopped)
    and one untimed call of its own runner (so each starts on its own warm state).  A drift of the machine's speed
    falls on both alike, and on the first and second of a pair alike.  Returns ({name: seconds per call}, one ratio
    per pair of blocks: the second runner's block median / the first's)."""
    first, second = list(runners)
    _warm_each(runners, feeds, warmup)
    times: dict[str, list[float]] = {first: [], second: []}
    ratios = []
    while len(times[first]) < runs:
        n = min(block, runs - len(times[first]))
        medians = {}
        for name in ((first, second) if len(ratios) % 2 == 0 else (second, first)):
            run = runners[name]
            settle()
            run(feeds)
            calls = _timed_calls(run, feeds, n)
            times[name] += calls
            medians[name] = float(np.median(calls))
        ratios.append(medians[second] / medians[first] if medians[first] > 0 else float("nan"))
    return {name: np.asarray(t) for name, t in times.items()}, ratios


def time_calls(runners: dict, feeds: dict, *, runs: int, warmup: int = 3, block: int = 10) -> dict[str, np.ndarray]:
    """Seconds per call of each runner on ``feeds``: ``runs`` calls each after ``warmup``, in alternating blocks
    of ``block`` calls, so that a change in the machine's load falls on all of them alike while one runner's
    spinning threads seldom run into another's calls."""
    _warm_each(runners, feeds, warmup)
    times = {name: [] for name in runners}
    while any(len(t) < runs for t in times.values()):
        for name, run in runners.items():
            times[name] += _timed_calls(run, feeds, min(block, runs - len(times[name])))
    return {name: np.asarray(t) for name, t in times.items()}


def race_calls(runners: dict, feeds: dict, *, runs: int, warmup: int = 1, block: int = 5,
               behind: float = 0.10, lead_s: float | None = None) -> dict[str, np.ndarray]:
    """Seconds per call of each runner, timed in alternating blocks of ``block`` calls (as :func:`time_calls`),
    with a sequential stop: after each round, a runner whose FASTEST call so far is slower than the current
    leader's median by more than ``behind`` is clearly behind and is not called again (its calls so far are
    returned).  ``lead_s``: the median of a runner timed before these (runners too large to load together are
    raced one at a time), which leads where it is faster.  At most ``runs`` calls each; at least one block each."""
    _warm_each(runners, feeds, warmup)
    times: dict[str, list[float]] = {name: [] for name in runners}
    active = list(runners)
    while active and any(len(times[n]) < runs for n in active):
        for name in active:
            times[name] += _timed_calls(runners[name], feeds, min(block, runs - len(times[name])))
        medians = {n: float(np.median(times[n])) for n in active}
        lead = min([*medians.values(), *([lead_s] if lead_s else [])])
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


def bench_cpu(bundle: Bundle, *, runs: int = 50, warmup: int = 5, original: str | Path | None = None) -> dict:
    """A CPU bundle against plain onnxruntime (default session options) on the original model: ``original``, else
    the path report.json records (an error when it is not there: never another model in its place).  The outputs
    must agree first (scaled error <= 1e-3, as verification's fp32 bound); then ``runs`` calls each on the same
    random input in alternating blocks (:func:`time_alternating`).

    ``speedup_vs_onnxruntime`` is the median over pairs of blocks of (onnxruntime's block median / the bundle's),
    with its spread (interquartile range and min..max over the pairs); ``others_cpu_share``: the share of the
    cores other processes used meanwhile (``OthersLoad``, as the CPU build measures it): a comparison on a loaded
    machine says how it is loaded."""
    import onnxruntime as ort

    from parastream.launcher.cpu import CpuLauncher
    from parastream.launcher.tail import TailRunner, tail_record

    if original is None:
        recorded = bundle.report.get("model", {}).get("path")
        if not recorded or not Path(recorded).is_file():
            raise ParastreamError(f"{bundle.path}: the original model {recorded or '(none recorded)'} is not there; "
                                  f"name it with --model ORIGINAL.onnx (or --model {bundle.path / 'model.onnx'} to "
                                  "compare with the bundle's own model)")
        original = recorded
    elif not Path(original).is_file():
        raise ParastreamError(f"--model {original}: no such file")
    model = Path(original)
    ours = CpuLauncher(bundle)
    tail = tail_record(bundle)
    if tail is not None:  # the whole model against the whole model: the plan, then its tail (launcher/tail.py)
        ours = TailRunner(ours, bundle, tail)
    try:
        plain = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
        names = [o.name for o in plain.get_outputs()]

        def run_plain(feeds):
            return dict(zip(names, plain.run(names, feeds)))

        feeds = random_feeds(bundle.plan.inputs)
        _, worst = _differences(ours(feeds), run_plain(feeds))
        if not worst <= scale_tolerance(bundle.plan.precision):
            raise ParastreamError(f"{bundle.path}: the bundle's outputs differ from onnxruntime on {model} "
                                  f"(scaled error {worst:.3g}); run `parastream verify` first")
        with OthersLoad() as others:
            times, ratios = time_alternating({"parastream": ours, "onnxruntime": run_plain}, feeds, runs=runs,
                                             warmup=warmup)
    finally:
        ours.close()
    ms = {k: v * 1e3 for k, v in times.items()}
    r = np.asarray(ratios, dtype=float)
    result = {"bundle": str(bundle.path), "device": f"cpu ({os.cpu_count()} cores)", "runs": runs, "model": str(model),
              "model_is_original": model.resolve() != (bundle.path / "model.onnx").resolve(),
              "streams": bundle.plan.num_streams, "branches": len(bundle.plan.branches), "threads": ours.threads or os.cpu_count(),
              "parastream_ms": float(np.median(ms["parastream"])), "onnxruntime_ms": float(np.median(ms["onnxruntime"])),
              "parastream_p10_p90_ms": [float(x) for x in np.percentile(ms["parastream"], [10, 90])],
              "onnxruntime_p10_p90_ms": [float(x) for x in np.percentile(ms["onnxruntime"], [10, 90])],
              "speedup_vs_onnxruntime": float(np.median(r)),
              "speedup_iqr": [float(x) for x in np.percentile(r, [25, 75])],
              "speedup_min_max": [float(r.min()), float(r.max())],
              "block_pairs": len(ratios), "block": CPU_BLOCK, "order": "alternating blocks, AB then BA",
              "others_cpu_share": others.share,
              "max_scaled_error": worst}
    return result


def print_bench_cpu(result: dict, console) -> None:
    from rich.markup import escape
    from rich.table import Table

    from parastream.launcher.words import plural

    t = Table(title=escape(f"parastream bench — {result['bundle']} on {result['device']}"))
    t.add_column("variant")
    t.add_column("median ms", justify="right")
    t.add_column("p10–p90 ms", justify="right")
    t.add_row(f"parastream ({plural(result['streams'], 'stream')}, {plural(result['branches'], 'session')}, "
              f"{plural(result['threads'], 'thread')} each)",
              f"{result['parastream_ms']:.3f}", "–".join(f"{x:.3f}" for x in result["parastream_p10_p90_ms"]))
    t.add_row(escape(f"plain onnxruntime, default session options, on {result['model']}"
                     + ("" if result["model_is_original"] else " (the bundle's own model, as --model named it)")),
              f"{result['onnxruntime_ms']:.3f}", "–".join(f"{x:.3f}" for x in result["onnxruntime_p10_p90_ms"]))
    console.print(t)
    lo, hi = result["speedup_iqr"]
    mn, mx = result["speedup_min_max"]
    share = result.get("others_cpu_share")
    load = "" if share is None else f"; other processes used {share:.0%} of the cores meanwhile"
    console.print(f"parastream vs plain onnxruntime: {result['speedup_vs_onnxruntime']:.2f}x (median of "
                  f"{result['block_pairs']} pairs of {result['block']}-call blocks in alternating order; interquartile "
                  f"{lo:.2f}–{hi:.2f}x, min–max {mn:.2f}–{mx:.2f}x{load})")


def print_bench(result: dict, console) -> None:
    from rich.table import Table

    t = Table(title=f"parastream bench — {result['bundle']} on {result['device']}")
    t.add_column("variant")
    t.add_column("median ms", justify="right")
    t.add_column("p10–p90 ms", justify="right")
    how = "one CUDA Graph" if result.get("graph", True) else "direct launches"
    in_place = f", {result['concats_in_place']} Concats in place" if result.get("concats_in_place") else ""
    t.add_row(f"parastream ({result['streams']} streams, {result['branches'] - result.get('concats_in_place', 0)} engines{in_place}, {how})",
              f"{result['parastream_ms']:.3f}", "–".join(f"{x:.3f}" for x in result["parastream_p10_p90_ms"]))
    t.add_row(f"same engines, one stream, {how}", f"{result['single_stream_ms']:.3f}",
              "–".join(f"{x:.3f}" for x in result["single_stream_p10_p90_ms"]))
    if "concat_copies_ms" in result:
        t.add_row(f"parastream, every Concat its own engine, {how}", f"{result['concat_copies_ms']:.3f}", "")
    if "tensorrt_whole_model_ms" in result:
        t.add_row(f"TensorRT, whole model as one engine, max_aux_streams={result['tensorrt_whole_model_max_aux_streams']} "
                  f"(uses {result['tensorrt_whole_model_aux_streams']}), {how}",
                  f"{result['tensorrt_whole_model_ms']:.3f}", "–".join(f"{x:.3f}" for x in result["tensorrt_whole_model_p10_p90_ms"]))
    console.print(t)
    if not result.get("graph", True):
        console.print("graph=False: every time includes the host-side enqueue of its engines")
    console.print(f"speedup from streams: {result['speedup']:.2f}x over {result['runs']} replays each")
    if result.get("over_bound"):
        how = ("run back to back alone" if result.get("critical_path_events_ms") is not None
               else "each engine timed alone, summed")
        console.print(f"critical-path bound: {result['critical_path_bound_ms']:.3f} ms (the longest chain of "
                      f"{result['critical_path_engines']} dependent engines, {how}; every engine timed alone, summed: "
                      f"{result['engines_alone_sum_ms']:.3f} ms): parastream at {result['over_bound']:.2f}x of it")
    elif "critical_path_bound_error" in result:
        from rich.markup import escape

        console.print(f"critical-path bound: none ({escape(result['critical_path_bound_error'])})")
    if "speedup_vs_whole_model" in result:
        console.print(f"against TensorRT's own multi-stream (whole-model engine, built in {result['tensorrt_whole_model_build_s']:.1f} s): "
                      f"{result['speedup_vs_whole_model']:.2f}x")
    elif "tensorrt_whole_model_error" in result:
        from rich.markup import escape

        console.print(f"TensorRT whole-model baseline: none ({escape(result['tensorrt_whole_model_error'])})")
    if "timeline" in result:
        console.print(f"timeline: {result['timeline']} (GPU busy on some stream {100 * result['busy_fraction']:.0f}% of the replay)")


def bench_buckets(bundle: Bundle, *, runs: int | None = None, warmup: int | None = None, console=None, gpu: int = 0) -> dict:
    """``parastream bench`` on a dynamic-batch bundle: at every bucket and at a batch between buckets, the median
    latency with buckets against the same rows padded to MAX and run on the MAX bucket (one graph at MAX).

    CPU: seconds per call (time_calls, interleaved blocks).  GPU: CUDA-event timed graph replays of the bucket
    that serves n against the MAX bucket's (``measure``; copies in and out are not timed)."""

    from parastream.launcher.buckets import BucketedLauncher, pad_rows

    on_gpu = bundle.backend().gpu
    if on_gpu:
        from parastream.launcher.cuda import cuda_device_count

        if cuda_device_count() < 1:
            raise ParastreamError("parastream bench on a GPU bundle needs a CUDA GPU, and cuda-python sees none")
    runs = (50 if not on_gpu else 200) if runs is None else runs
    warmup = (5 if not on_gpu else 20) if warmup is None else warmup
    if runs < 1:
        raise ParastreamError(f"--runs {runs}: must be at least 1")
    la = BucketedLauncher(bundle, device="cuda" if on_gpu else "cpu", gpu=gpu)
    if la.grid:
        return _bench_grid(bundle, la, runs=runs, warmup=warmup, console=console, on_gpu=on_gpu)
    try:
        between = next((a + 1 for a, b in zip(la.sizes, la.sizes[1:]) if b - a > 1), None)
        batches = sorted(set(la.sizes) | ({between} if between else set()))
        top = la.launchers[la.max]
        rows = []
        for n in batches:
            b = la.bucket_for(n)
            if on_gpu:
                # the bucket first: measure() copies the first launcher's inputs into each (the MAX bucket gets
                # the same first rows; what it computes on the rest does not change its time)
                times = measure({"buckets": la.launchers[b], "padded_to_max": top}, runs=runs, warmup=warmup)
                ms = {k: float(np.median(v)) for k, v in times.items()}
            else:
                specs = [type(t)(t.name, t.dtype, [n, *t.shape[1:]] if t.name in la.batched_inputs else t.shape)
                         for t in la.input_specs]
                feeds = random_feeds(specs, seed=n)
                times = time_calls({"buckets": la, "padded_to_max": lambda f: top({k: pad_rows(v, la.max) if k in la.batched_inputs else v
                                                                                   for k, v in f.items()})},
                                   feeds, runs=runs, warmup=warmup)
                ms = {k: float(np.median(v)) * 1e3 for k, v in times.items()}
            rows.append({"batch": n, "bucket": b, "buckets_ms": ms["buckets"], "padded_to_max_ms": ms["padded_to_max"],
                         "speedup": ms["padded_to_max"] / ms["buckets"] if ms["buckets"] > 0 else None})
    finally:
        la.close()
    result = {"bundle": str(bundle.path), "device": "cuda" if on_gpu else "cpu", "sizes": la.sizes, "runs": runs,
              "timed": "CUDA-event timed graph replays" if on_gpu else "seconds per call", "batches": rows}
    if console is not None:
        from rich.table import Table

        t = Table(title=f"{bundle.path}: buckets {la.sizes} against one graph at MAX = {la.max} (median of {runs})")
        for c in ("batch", "bucket", "buckets ms", f"padded to {la.max} ms", "speedup"):
            t.add_column(c, justify="right")
        for r in rows:
            t.add_row(str(r["batch"]), str(r["bucket"]), f"{r['buckets_ms']:.3f}", f"{r['padded_to_max_ms']:.3f}",
                      f"{r['speedup']:.2f}x" if r["speedup"] else "-")
        console.print(t)
    return result


def _feeds_at_point(la, point: tuple[int, ...], seed: int) -> dict:
    """Random inputs of a grid bundle at ``point`` (mask-like inputs all ones: a row masked everywhere is no request)."""
    shapes = {t.name: list(t.shape) for t in la.input_specs}
    for a, size in zip(la.axes, point):
        for name, dim in a["inputs"].items():
            shapes[name][dim] = size
    specs = [type(t)(t.name, t.dtype, shapes[t.name]) for t in la.input_specs]
    feeds = random_feeds(specs, seed=seed)
    for name in feeds:
        if "mask" in name.lower():
            feeds[name] = np.ones_like(feeds[name])
    return feeds


def _bench_grid(bundle: Bundle, la, *, runs: int, warmup: int, console, on_gpu: bool) -> dict:
    """``parastream bench`` on a grid bundle: at every bucket and at a point between buckets, the median latency of
    the bucket that serves it (padded) against the same inputs padded to every axis's MAX on the MAX bucket (where
    no axis is exact).  Times calls with host inputs on the CPU and the GPU alike (padding and copies included)."""
    from parastream.launcher.buckets import grid_between, key_text, pad_axis

    top_key = la.max
    between = grid_between(la)
    points = sorted(set(la.sizes) | ({between} if between else set()))
    can_pad = not any(a.get("exact") for a in la.axes)
    rows = []
    try:
        for point in points:
            feeds = _feeds_at_point(la, point, seed=sum(point))
            calls = {"buckets": la}
            if can_pad:
                top = la.launchers[top_key]

                def padded(f, top=top):
                    out = dict(f)
                    for a, size in zip(la.axes, top_key):
                        for name, dim in a["inputs"].items():
                            if name in out:
                                out[name] = pad_axis(out[name], dim, size, a["pad"][name])
                    return top(out)

                calls["padded_to_max"] = padded
            times = time_calls(calls, feeds, runs=runs, warmup=warmup)
            ms = {k: float(np.median(v)) * 1e3 for k, v in times.items()}
            rows.append({"point": list(point), "bucket": list(la.bucket_for(point)), "buckets_ms": ms["buckets"],
                         "padded_to_max_ms": ms.get("padded_to_max"),
                         "speedup": ms["padded_to_max"] / ms["buckets"] if ms.get("padded_to_max") and ms["buckets"] > 0 else None})
    finally:
        la.close()
    axes = "x".join(a["name"] for a in la.axes)
    memory = (bundle.report.get("buckets") or {}).get("memory")
    result = {"bundle": str(bundle.path), "device": "cuda" if on_gpu else "cpu", "axes": axes,
              "sizes": [key_text(k) for k in la.sizes], "runs": runs, "timed": "seconds per call", "points": rows,
              "memory": memory}
    if console is not None:
        from rich.table import Table

        t = Table(title=f"{bundle.path}: buckets over {axes} against one bucket at MAX = {key_text(top_key)} "
                        f"(median of {runs})")
        for c in (axes, "bucket", "buckets ms", "padded to MAX ms", "speedup"):
            t.add_column(c, justify="right")
        for r in rows:
            t.add_row(key_text(r["point"]), key_text(r["bucket"]), f"{r['buckets_ms']:.3f}",
                      f"{r['padded_to_max_ms']:.3f}" if r["padded_to_max_ms"] else "-",
                      f"{r['speedup']:.2f}x" if r["speedup"] else "-")
        console.print(t)
        if memory:
            console.print(f"engines {memory['engine_bytes']:,} bytes in all buckets against {memory['engine_bytes_at_max']:,} "
                          f"at MAX alone; boundary buffers {memory['shared_buffer_bytes']:,} bytes shared")
    return result


def draw_timeline(spans: list[dict], path, *, title: str = "") -> float:
    """Draw branch spans per stream into ``path`` (PNG); return the fraction of the replay with some stream busy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    streams = sorted({s["stream"] for s in spans})
    end = max((s["end_ms"] for s in spans), default=1.0)
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.6 * len(streams)))
    colors = plt.get_cmap("tab20")
    for s in spans:
        if s.get("in_place"):
            continue  # a Concat done in place runs no kernel: nothing to draw
        y = streams.index(s["stream"])
        width = max(s["end_ms"] - s["start_ms"], end * 1e-4)
        ax.broken_barh([(s["start_ms"], width)], (y - 0.4, 0.8), facecolors=colors(s["branch"] % 20), edgecolor="black", linewidth=0.3)
        if width > end * 0.04:
            ax.text(s["start_ms"] + width / 2, y, s["name"].replace("branch_", "b"), ha="center", va="center", fontsize=6)
    ax.set_yticks(range(len(streams)))
    ax.set_yticklabels([f"stream {s}" for s in streams])
    ax.set_xlabel("ms since the replay started")
    ax.set_xlim(0, end * 1.01)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    # union of busy intervals
    iv = sorted((s["start_ms"], s["end_ms"]) for s in spans)
    busy, cur_s, cur_e = 0.0, None, None
    for a, b in iv:
        if cur_e is None or a > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = a, b
        else:
            cur_e = max(cur_e, b)
    if cur_e is not None:
        busy += cur_e - cur_s
    return busy / end if end > 0 else 0.0
