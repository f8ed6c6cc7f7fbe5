"""The GPU launcher: branches side by side on CUDA streams, the whole plan replayed as one CUDA Graph.

Set-up (``GpuLauncher(bundle)``):
  * every branch engine is loaded for the GPU (a torch engine compiles here);
  * one device arena holds every tensor that crosses a branch boundary and the
    model's inputs and outputs (``plan.tensors``), each at a 256-byte aligned offset;
  * one non-blocking stream per plan stream plus an *origin* stream, a fork event,
    one join event per stream, one event per branch that another stream waits on
    (``plan.recorders()``);
  * one warm-up run, then capture: the origin records *fork*, every stream waits on
    it, branches are enqueued in ``plan.launch_order`` on their streams (each first
    waits on the events of its ``Branch.waits``), every stream records its *join*
    and the origin waits on all of them; ``cudaStreamEndCapture`` closes the graph
    and ``cudaGraphInstantiate`` makes it launchable.
Each call then is one ``cudaGraphLaunch`` on the origin stream.

A Concat branch along channels whose inputs are channels-last boundary tensors is
done in place where the backend's engines can write channel slices (torch): its
producers write straight into their slices of its output and the branch keeps its
waits and its event but runs no kernel (``concat_in_place=False`` turns that off).

Memory a captured graph touches is never freed or handed to anyone else while
the launcher lives: the arena is ours (cudaMalloc, freed in ``close``), and what
the engines allocate during warm-up and capture (intermediates, library
workspaces) comes from a pool private to this launcher (``backend.memory_scope``).

Inputs and outputs: numpy arrays are copied in and out on the origin stream via
pinned staging buffers; objects with ``__cuda_array_interface__`` or DLPack (torch
tensors, cupy arrays) are copied device-to-device, after the origin stream waits
for the producer's stream.  Without any copy, write into ``inputs()`` and read
``outputs()``: views of the captured graph's own buffers (``DeviceArray``, usable
through ``torch.as_tensor``/``cupy.asarray``/DLPack), then call ``launch()``.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import numpy as np

from parastream.core.tensors import random_array

from . import cuda
from .bundle import Bundle
from .cuda import DeviceArray, nbytes_of
from .errors import ParastreamError
from .plan import TensorSpec

ALIGN = 256


def _compute_dtype(precision: str) -> str | None:
    return {"fp16": "float16", "bf16": "bfloat16"}.get(precision)


@dataclass
class EngineLayouts:
    """How a launcher lays out a plan's boundary tensors for its engines (``engine_layouts``)."""

    specs: dict[str, TensorSpec]  # device dtype and shape of every boundary tensor
    nhwc: set[str]  # 4-d tensors stored channels-last
    views: dict[str, tuple[str, int]]  # tensor -> (the Concat output buffer it lives in, its first channel)
    elided: set[int]  # Concat branches done in place (no engine runs)

    @property
    def channel_views(self) -> dict[str, tuple[int, int]]:
        """tensor -> (channels of its buffer, first channel): what an engine needs to address the slice."""
        return {t: (self.specs[root].shape[1], c0) for t, (root, c0) in self.views.items()}

    def branch_views(self, branch) -> dict[str, tuple[int, int]]:
        return {t: v for t, v in self.channel_views.items() if t in branch.inputs or t in branch.outputs}

    def branch(self, branch) -> dict:
        """What ``backend.load`` is given for ``branch``: input and output specs, channels-last set, channel views."""
        return {"inputs": [self.specs[t] for t in branch.inputs], "outputs": [self.specs[t] for t in branch.outputs],
                "internal_nhwc": self.nhwc, "channel_views": self.branch_views(branch)}


def engine_layouts(plan, backend, *, internal_nhwc: bool = True, concat_in_place: bool = True) -> EngineLayouts:
    """The boundary tensors' device dtypes and layouts that a ``GpuLauncher`` gives ``backend``'s engines.

    Model inputs/outputs keep the caller's dtype and NCHW layout; internal boundaries of a
    reduced-precision torch bundle stay in the compute dtype (no cast kernels at branch edges)
    and, for 4-d tensors, channels-last (no transposes around cuDNN convolutions).  Concat
    branches are done in place where the backend's engines write channel slices: each producer
    writes its slice of the Concat's output, the branch keeps its events but runs no kernel.
    The build calls this too, so that compiled engines are compiled for exactly these layouts.
    """
    model_io = {t.name for t in plan.inputs} | {t.name for t in plan.outputs}
    native = bool(backend.supports_internal_nhwc)
    low = _compute_dtype(plan.precision) if native else None
    specs: dict[str, TensorSpec] = {}
    for name, spec in plan.tensors.items():
        dt = spec.dtype
        if low and name not in model_io and dt == "float32":
            dt = low
        specs[name] = TensorSpec(name, dt, list(spec.shape))
    nhwc = {n for n, s in specs.items()
            if native and internal_nhwc and n not in model_io and len(s.shape) == 4 and s.dtype.startswith(("float", "bfloat"))}
    views: dict[str, tuple[str, int]] = {}
    elided: set[int] = set()
    if concat_in_place and backend.supports_channel_views:
        views, elided = plan.in_place_concats(specs, nhwc)
    return EngineLayouts(specs, nhwc, views, elided)


def arena_offsets(specs: dict[str, TensorSpec], views: dict) -> tuple[dict[str, int], int]:
    """Each boundary tensor's 256-byte aligned offset in the launcher's arena (a channel view at its Concat's), and
    the arena's size."""
    offsets: dict[str, int] = {}
    total = 0
    for name, spec in specs.items():
        if name in views:
            continue  # lives inside its Concat's buffer
        offsets[name] = total
        total += -(-nbytes_of(spec.shape, spec.dtype) // ALIGN) * ALIGN
    for name, (root, _) in views.items():
        offsets[name] = offsets[root]  # the engine takes its channel slice from there
    return offsets, total


def arena_bytes(bundle: Bundle, *, internal_nhwc: bool | None = None, concat_in_place: bool = True) -> int:
    """The arena a GpuLauncher of ``bundle`` allocates (its boundary tensors in the layout the build chose)."""
    built = bundle.manifest.get("options", {}) or {}
    nhwc = bool(built.get("internal_nhwc", True)) if internal_nhwc is None else internal_nhwc
    lay = engine_layouts(bundle.plan, bundle.backend(), internal_nhwc=nhwc, concat_in_place=concat_in_place)
    return arena_offsets(lay.specs, lay.views)[1]


class SharedArena:
    """One device arena and one origin stream for several launchers of which only one runs at a time (the
    buckets of a dynamic-batch bundle): every launcher's boundary tensors start at the arena's base, and all
    replays queue on the one origin stream, so one bucket's graph never runs while another's writes the arena."""

    def __init__(self, nbytes: int):
        self.nbytes = int(nbytes)
        self.device = cuda.get_device()  # both made on the calling thread's current device
        self.arena = cuda.malloc(self.nbytes)
        self.origin = cuda.stream_create()
        self._closed = False

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with cuda.on_device(self.device):
            cuda.stream_synchronize(self.origin)
            cuda.stream_destroy(self.origin)
            cuda.free(self.arena)


def load_phases(launcher) -> dict[str, float]:
    """Seconds of the launcher's engine loads by phase, summed over its engines (those that record ``phases``:
    torch engines' unpack, weights, artifact, warm), and the launcher's ``engines`` total (loads),
    ``warm_wall`` (from the first load to the last warm-up's end, in the thread that captures) and ``ready``
    (engines loaded to graph captured)."""
    out: dict[str, float] = {}
    for e in getattr(launcher, "engines", None) or []:
        for k, v in (getattr(e, "phases", None) or {}).items():
            out[k] = round(out.get(k, 0.0) + v, 4)
    out["engines"] = round(getattr(launcher, "load_s", 0.0), 4)
    out["warm_wall"] = round(getattr(launcher, "warm_s", 0.0), 4)  # the launcher's warm-up of them
    out["ready"] = round(getattr(launcher, "ready_s", 0.0), 4)
    return out


#: the thread in which launchers warm their engines and capture (``_Warmer``), one per process, made when first used
_WARM_THREAD: list = []
_WARM_LOCK = threading.Lock()


def _warm_thread():
    """The process's warm-up thread: the same one for every launcher, so that what torch keeps per thread (cuDNN's
    convolution plans, cuBLAS handles) is built once per process, not once per launcher (a build loads one
    launcher per measured candidate, per timed alternative and for its verification)."""
    with _WARM_LOCK:
        if not _WARM_THREAD:
            from concurrent.futures import ThreadPoolExecutor

            _WARM_THREAD.append(ThreadPoolExecutor(1, thread_name_prefix="parastream-warm"))
        return _WARM_THREAD[0]


class _Warmer:
    """Warms the engines loaded unwarmed (``warm(stream)``: a torch engine's first call, where cuDNN plans each
    convolution and kernels load), each on its branch's stream, in load order, in the process's warm-up thread
    while the launcher loads the next ones; that thread then runs the launcher's own warm-up launch and capture
    (``run``).

    The same thread for both because torch keeps cuDNN's convolution plans per thread (its cuDNN v8 plan cache is
    thread-local): engines warmed in threads of their own had every plan built there and again by the launching
    thread (H100, fresh processes, bench/load_breakdown.py: MixNet-S's one engine 6.0 s of warm-up in a thread,
    then 5.3 s more before its capture; NASNet-A Large 9.1 s and 5.6 s).  A plan costs 15-45 ms for a grouped or
    depthwise convolution, 1-2 ms for a dense one.  Building them in several threads does not help: each
    stream's engines warmed and launched by a thread of its own (the same thread for its warm-up and its part
    of the capture, each in a private pool) loaded NASNet-A Large's 4-stream bundle in 13.0 s against 7.6 s,
    its warm-ups summing 23.7 s in four threads against 5.2 s in one (H100, fresh processes, the same bundle,
    bench/load_breakdown.py): cuDNN's plans are not built side by side.  The warm-ups allocate outside the
    launcher's memory pool (torch lets one thread at a time record into a pool, and the loads do); the capture's
    allocations still come from the pool."""

    def __init__(self, launcher: "GpuLauncher"):
        self.launcher = launcher
        self.pool = _warm_thread()
        self.futures: list = []
        self.t0 = time.perf_counter()

    def _submit(self, fn, *args):
        if threading.current_thread().name.startswith("parastream-warm"):  # a launcher made in that thread: here
            from concurrent.futures import Future

            f: Future = Future()
            try:
                f.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - raised where the result is asked for, as from the thread
                f.set_exception(e)
            return f
        return self.pool.submit(fn, *args)

    def submit(self, branch, engine) -> None:
        la = self.launcher
        s = la.origin if la.single_stream else la.streams[branch.stream]
        self.futures.append(self._submit(self._on_device, engine.warm, la._h(s)))

    def _on_device(self, fn, *args):
        """``fn(*args)`` on the launcher's device: the warm-up thread is the process's, shared by launchers on
        any GPU, and a thread's current device is its own."""
        cuda.set_device(self.launcher.device)
        return fn(*args)

    def wait(self) -> float:
        """Seconds from the first load to the last warm-up's end; raises the first warm-up error (the warm-ups
        not begun are dropped)."""
        try:
            for f in self.futures:
                f.result()
        except BaseException:
            self.close()
            raise
        return time.perf_counter() - self.t0

    def run(self, fn):
        """``fn()`` in the warm-up thread, on the launcher's device; its result or its error."""
        return self._submit(self._on_device, fn).result()

    def close(self) -> None:
        """This launcher's warm-ups not begun are dropped and a running one ends (the thread stays: it is the
        process's)."""
        for f in self.futures:
            f.cancel()
        for f in self.futures:
            if not f.cancelled():
                try:
                    f.result()
                except BaseException:  # noqa: BLE001 - the first error was raised already, or a load's is
                    pass


class GpuLauncher:
    """Runs a bundle's plan on one GPU: multi-stream, captured as one CUDA Graph (``graph=False``: direct launches).

    ``device``: the GPU's ordinal.  Everything the launcher makes is made on it (``devices()`` reads each object's
    device back), and every call sets it as the calling thread's current device for its duration, so launchers on
    several GPUs may be called from one thread, or from several at once.

    ``single_stream=True`` puts every branch on the origin stream in launch order
    (no events): the same engines without inter-branch parallelism, which is what
    ``bench`` compares against.  ``engines=`` shares loaded engines with another
    launcher of the same bundle (no second load or compile).  A plan of one stream always runs this way: its
    branches on the origin stream itself, no fork and join (on the H100 the same engines forked onto a side
    stream ran 3-5% slower on DenseNet-121 and SK-ResNet-18, and never faster on 13 other one-stream bundles).
    """

    def __init__(self, bundle: Bundle | str, *, graph: bool = True, device: int = 0, single_stream: bool = False,
                 engines: list | None = None, internal_nhwc: bool | None = None, concat_in_place: bool = True,
                 fuse_conv_relu: bool | None = None, _share=None, shared: "SharedArena | None" = None):
        if not isinstance(bundle, Bundle):
            bundle = Bundle.open(bundle, loading=True, device=device)
        self.bundle = bundle
        self.plan = plan = bundle.plan
        self.device = device = int(device)
        self.single_stream = single_stream or plan.num_streams == 1
        self.use_graph = graph
        self._closed = True
        self._shared = None
        # everything below is made on ``device``: streams, events, the arena, the engines (torch places tensors on
        # the current device, TensorRT and the kernels artifacts load into its context), the captured graph
        if shared is not None and shared.device != device:
            raise ParastreamError(f"{bundle.path}: the shared arena is on cuda:{shared.device}, this launcher on cuda:{device}")
        cuda.set_device(device)
        backend = bundle.backend()
        self.backend = backend

        # the layout and fusion choices the build measured (manifest options); arguments override them
        built = bundle.manifest.get("options", {}) or {}
        if internal_nhwc is None:
            internal_nhwc = bool(built.get("internal_nhwc", True))
        if fuse_conv_relu is None:
            fuse_conv_relu = bool(built.get("fuse_conv_relu", True))
        lay = engine_layouts(plan, backend, internal_nhwc=internal_nhwc, concat_in_place=concat_in_place)
        self.specs, self.nhwc, self.views, self.elided = lay.specs, lay.nhwc, lay.views, lay.elided
        channel_views = lay.channel_views
        branch_views = [lay.branch_views(b) for b in plan.branches]

        # engines and a private memory pool for what they allocate
        self._scope = _share._scope if _share is not None else backend.memory_scope()
        opts = bundle.engine_options("cuda", fuse_conv_relu=fuse_conv_relu)  # optimization_level 5: torch max-autotune
        # streams and events (buckets sharing an arena share the origin: their replays never overlap)
        t0 = time.perf_counter()
        self._shared = shared
        self.origin = shared.origin if shared is not None else cuda.stream_create()
        n_streams = 0 if self.single_stream else plan.num_streams
        self.streams = [cuda.stream_create() for _ in range(n_streams)]
        self._fork = cuda.event_create()
        self._joins = [cuda.event_create() for _ in self.streams]
        self._recorders = sorted(plan.recorders()) if not self.single_stream else []
        self._events = {b: cuda.event_create() for b in self._recorders}
        self._producer_event = cuda.event_create()
        self.warm_s = 0.0
        if engines is None:
            engines = []
            takes_layout = backend.supports_internal_nhwc
            # an engine that can be loaded unwarmed (a torch "kernels" engine) is warmed by the thread that will
            # launch and capture the plan (``_Warmer``), while the next ones load
            warmer = _Warmer(self) if backend.warms_after_load else None
            try:
                with self._memory():
                    for b in plan.branches:
                        if b.id in self.elided:
                            engines.append(None)
                            continue
                        ins = [self.specs[t] for t in b.inputs]
                        outs = [self.specs[t] for t in b.outputs]
                        kw = {"internal_nhwc": self.nhwc} if takes_layout else {}
                        kw["model_weights"] = bundle.initializer  # (an engine compiled again here: its weights)
                        if warmer is not None:
                            kw["warm"] = False
                        if channel_views:
                            kw["channel_views"] = branch_views[b.id]
                        data = bundle.engine_bytes(b)  # (its errors name the file)
                        try:
                            engines.append(backend.load(data, ins, outs, device="cuda", options=opts, **kw))
                        except ParastreamError as e:  # e.g. an engine compiled for another GPU: name the file
                            raise ParastreamError(f"{bundle.engine_path(b)}: {e}") from None
                        if warmer is not None:
                            warmer.submit(b, engines[-1])
            except BaseException:
                if warmer is not None:
                    warmer.close()
                self._destroy_streams()  # (close() has nothing to release until the launcher is open)
                raise
            self.load_s = time.perf_counter() - t0
            bundle.drop_kept_engines()  # the engine files' bytes the open kept that no engine took (an elided branch's)
            if warmer is not None:
                try:
                    self.warm_s = warmer.wait()  # the first engine's error, if any, is raised here
                except BaseException:
                    self._destroy_streams()
                    raise
        else:
            # engines another launcher loaded (and warmed in the warm-up thread): captured there too, where their
            # cuDNN plans are
            warmer = _Warmer(self) if backend.warms_after_load else None
            for b, e in zip(plan.branches, engines):
                if (e is None) != (b.id in self.elided) or (e is not None and getattr(e, "channel_views", {}) != branch_views[b.id]):
                    raise ParastreamError(f"{b.name}: the shared engines were loaded for another memory layout "
                                          "(share engines only between launchers with the same concat_in_place)")
            self.load_s = 0.0
        self.engines = engines

        # one arena for all boundary tensors (or, for a bucket of a dynamic-batch bundle, the buckets' shared one)
        self.offsets, total = arena_offsets(self.specs, self.views)
        if shared is not None and total > shared.nbytes:
            if warmer is not None:
                warmer.close()
            raise ParastreamError(f"{bundle.path}: needs an arena of {total} bytes, the shared one has {shared.nbytes}")
        self._arena = shared.arena if shared is not None else cuda.malloc(total)
        self.arena_device = cuda.get_device()  # where cudaMalloc put it: the current device, not necessarily 0
        self.arena_bytes = total
        self.addr = {n: self._arena + off for n, off in self.offsets.items()}
        self._branch_addrs = [{t: self.addr[t] for t in b.inputs + b.outputs} for b in plan.branches]

        self._closed = False

        # pinned staging for numpy inputs and outputs
        self._host: dict[str, tuple[int, np.ndarray]] = {}
        for spec in list(plan.inputs) + list(plan.outputs):
            if spec.name in self._host:
                continue
            nb = nbytes_of(spec.shape, spec.dtype)
            ptr = cuda.malloc_host(nb)
            self._host[spec.name] = (ptr, cuda.host_array(ptr, spec.shape, spec.dtype))

        self._graph = self._exec = None
        self._timed_exec = self._timed_graph = None
        # warm-up on defined inputs (never captured), then capture: in the thread that warmed the engines
        self._fill_random_inputs(seed=0)

        def warm_up_and_capture():
            with self._memory():
                backend.own_workspaces()  # the graph's cuBLAS workspaces from this launcher's pool
                self._launch_all(self.origin)
                cuda.stream_synchronize(self.origin)
                if graph:
                    self._graph, self._exec = self._capture(self._launch_all)

        if warmer is None:
            warm_up_and_capture()
        else:
            try:
                warmer.run(warm_up_and_capture)
            finally:
                warmer.close()
        cuda.stream_synchronize(self.origin)
        self.ready_s = time.perf_counter() - t0  # engines loaded, warmed up and captured

    # -- internals ----------------------------------------------------------------
    def _memory(self):
        return self._scope()

    def _h(self, s) -> int:
        return cuda.handle(s)

    def _launch_all(self, origin, timing: dict | None = None) -> None:
        """Queue the whole plan, forked from and joined back into ``origin``."""
        plan = self.plan
        record = cuda.event_record_external if timing is not None and timing.get("external") else cuda.event_record
        if self.single_stream:
            for bid in plan.launch_order:
                if timing is not None:
                    record(timing["start"][bid], origin)
                if bid not in self.elided:
                    self.engines[bid].enqueue(self._h(origin), self._branch_addrs[bid])
                if timing is not None:
                    record(timing["end"][bid], origin)
            return
        cuda.event_record(self._fork, origin)
        for s in self.streams:
            cuda.stream_wait_event(s, self._fork)
        for bid in plan.launch_order:
            b = plan.branches[bid]
            s = self.streams[b.stream]
            for w in b.waits:
                cuda.stream_wait_event(s, self._events[w])
            if timing is not None:
                record(timing["start"][bid], s)
            if bid not in self.elided:  # an in-place Concat keeps its waits and its event: a join without a kernel
                self.engines[bid].enqueue(self._h(s), self._branch_addrs[bid])
            if timing is not None:
                record(timing["end"][bid], s)
            if bid in self._events:
                cuda.event_record(self._events[bid], s)
        for s, j in zip(self.streams, self._joins):
            cuda.event_record(j, s)
            cuda.stream_wait_event(origin, j)

    def _capture(self, body, *args):
        cuda.begin_capture(self.origin, "relaxed")
        try:
            body(self.origin, *args)
        except BaseException:
            # end the capture so the stream is usable again, then re-raise the engine's error
            try:
                g = cuda.end_capture(self.origin)
                cuda.graph_destroy(g)
            except Exception:  # noqa: BLE001
                pass
            raise
        graph = cuda.end_capture(self.origin)
        return graph, cuda.graph_instantiate(graph)

    def _fill_random_inputs(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        for spec in self.plan.inputs:
            self._copy_in(spec, random_array(spec, rng))
        cuda.stream_synchronize(self.origin)

    def _copy_in(self, spec: TensorSpec, arr: np.ndarray) -> None:
        ptr, host = self._host[spec.name]
        np.copyto(host, arr, casting="same_kind")
        cuda.memcpy_htod_async(self.addr[spec.name], ptr, host.nbytes, self.origin)

    def _device_pointer(self, spec: TensorSpec, x, shape: tuple | None = None) -> int:
        """The device pointer of a CUDA array-like input, after making the origin stream wait for its producer.
        ``shape``: the shape it must have (else the spec's)."""
        cai = getattr(x, "__cuda_array_interface__", None)
        torch_stream = None
        if cai is None and hasattr(x, "__dlpack__"):
            import torch

            x = torch.from_dlpack(x)
            cai = x.__cuda_array_interface__
        if type(x).__module__.startswith("torch"):
            import torch

            where = x.device.index if x.device.type == "cuda" else None
            if where == self.device:
                torch_stream = torch.cuda.current_stream(x.device).cuda_stream
        else:  # (a DeviceArray knows its device; anything else is asked of its pointer)
            where = x.device if isinstance(x, DeviceArray) else cuda.pointer_device(int(cai["data"][0]))
        if where != self.device:
            raise ParastreamError(f"input {spec.name!r} is on cuda:{where}, this launcher runs on cuda:{self.device}; move it "
                                  f"there first (x.to('cuda:{self.device}')): a replay copies nothing between GPUs")
        got, want = [int(s) for s in cai["shape"]], list(spec.shape if shape is None else shape)
        if got != want:
            raise ParastreamError(f"input {spec.name!r} has shape {got}, the bundle was built for {want}")
        typestr = np.dtype(spec.dtype).str if spec.dtype != "bfloat16" else "<V2"
        if np.dtype(cai["typestr"]).str != typestr:
            raise ParastreamError(f"input {spec.name!r} has dtype {cai['typestr']}, the bundle takes {spec.dtype}")
        if not cuda.c_contiguous(cai):
            raise ParastreamError(f"input {spec.name!r} is not contiguous; pass a contiguous array")
        producer = torch_stream if torch_stream is not None else cai.get("stream")
        if producer:
            cuda.event_record(self._producer_event, int(producer))
            cuda.stream_wait_event(self.origin, self._producer_event)
        return int(cai["data"][0])

    # -- public API -------------------------------------------------------------------
    @property
    def input_specs(self):
        return self.plan.inputs

    @property
    def output_specs(self):
        return self.plan.outputs

    def inputs(self) -> dict[str, DeviceArray]:
        """Zero-copy views of the graph's input buffers: write into them, then ``launch()``."""
        return {t.name: DeviceArray(self.addr[t.name], t.shape, t.dtype, t.name, self, device=self.arena_device)
                for t in self.plan.inputs}

    def outputs(self) -> dict[str, DeviceArray]:
        """Zero-copy views of the graph's output buffers, valid until the next launch overwrites them."""
        return {t.name: DeviceArray(self.addr[t.name], t.shape, t.dtype, t.name, self, device=self.arena_device)
                for t in self.plan.outputs}

    @property
    def origin_stream(self) -> int:
        """The stream every launch is queued on (``launch()`` work is ordered after work queued here)."""
        return self._h(self.origin)

    @property
    def captured(self) -> bool:
        """Whether ``launch`` replays one captured CUDA Graph (else it enqueues every engine in turn)."""
        return self._exec is not None

    def launch(self, stream=None) -> None:
        """Replay the plan once on the origin stream, asynchronously (no copies, no synchronisation).

        With ``stream`` (a handle), the origin first waits for the work queued so far on it,
        and it waits for the launch in turn.
        """
        self._check_open()
        with cuda.on_device(self.device):
            if stream is not None:
                cuda.event_record(self._producer_event, stream)
                cuda.stream_wait_event(self.origin, self._producer_event)
            if self._exec is not None:
                cuda.graph_launch(self._exec, self.origin)
            else:
                with self._memory():
                    self._launch_all(self.origin)
            if stream is not None:
                cuda.event_record(self._producer_event, self.origin)
                cuda.stream_wait_event(stream, self._producer_event)

    def synchronize(self) -> None:
        cuda.stream_synchronize(self.origin)

    def __call__(self, feeds: dict) -> dict:
        """Run once.  numpy feeds give numpy outputs; device feeds give ``DeviceArray`` views of the outputs.

        Device feeds must be on the launcher's GPU (``device``): one on another GPU is refused, naming it, so that
        no replay ever waits on a copy between GPUs."""
        self._check_open()
        with cuda.on_device(self.device):
            return self._call(feeds)

    def _check_names(self, feeds: dict) -> None:
        """An input ``feeds`` names that the plan lacks, or one it lacks, is refused naming the plan's inputs."""
        names = [t.name for t in self.plan.inputs]
        unknown = set(feeds) - set(names)
        if unknown:
            raise ParastreamError(f"unknown input(s) {sorted(unknown)}; the model takes {names}")
        missing = [n for n in names if n not in feeds]
        if missing:
            raise ParastreamError(f"missing input {missing[0]!r}; the model takes {names}")

    def _call(self, feeds: dict) -> dict:
        plan = self.plan
        self._check_names(feeds)
        on_device = False
        for spec in plan.inputs:
            x = feeds[spec.name]
            if hasattr(x, "__cuda_array_interface__") or (hasattr(x, "__dlpack__") and not isinstance(x, np.ndarray)):
                on_device = True
                ptr = self._device_pointer(spec, x)
                cuda.memcpy_dtod_async(self.addr[spec.name], ptr, nbytes_of(spec.shape, spec.dtype), self.origin)
            else:
                arr = np.asarray(x)
                if list(arr.shape) != list(spec.shape):
                    raise ParastreamError(f"input {spec.name!r} has shape {list(arr.shape)}, the bundle was built for {spec.shape}")
                self._copy_in(spec, arr.astype(np.dtype(spec.dtype), copy=False))
        self.launch()
        if on_device:
            self.synchronize()
            return self.outputs()
        for spec in plan.outputs:
            ptr, host = self._host[spec.name]
            cuda.memcpy_dtoh_async(ptr, self.addr[spec.name], host.nbytes, self.origin)
        self.synchronize()
        return {spec.name: self._host[spec.name][1].copy() for spec in plan.outputs}

    def run_padded(self, feeds: dict, shapes: dict[str, tuple], fills: dict[str, int]) -> dict:
        """Run once on device feeds smaller than the plan's inputs along one dimension each (a grid bundle's
        request between buckets): each feed's rows (the dimensions before the padded one) are copied to the start
        of their rows in the input's buffer, and the rest of each row from the same place of ``fills[name]`` (a
        device buffer of the whole input holding the pad value): two 2-D copies per input (one row: a sequence at
        batch 1; several: a batch of sequences), no padded tensor made.  ``shapes``: each
        feed's shape.  Returns ``DeviceArray`` views of the outputs."""
        self._check_open()
        with cuda.on_device(self.device):
            self._check_names(feeds)
            for spec in self.plan.inputs:
                shape = tuple(shapes.get(spec.name, spec.shape))
                ptr = self._device_pointer(spec, feeds[spec.name], shape)
                dst, total = self.addr[spec.name], nbytes_of(spec.shape, spec.dtype)
                dim = next((i for i, (a, b) in enumerate(zip(shape, spec.shape)) if int(a) != int(b)), None)
                if dim is None:
                    cuda.memcpy_dtod_async(dst, ptr, total, self.origin)
                    continue
                # rows of ``row`` bytes (the feed's) in rows of ``pitch`` bytes (the buffer's), the pad after each
                rows = int(np.prod(shape[:dim], dtype=np.int64))
                row, pitch = nbytes_of(shape[dim:], spec.dtype), nbytes_of(spec.shape[dim:], spec.dtype)
                cuda.memcpy2d_dtod_async(dst, pitch, ptr, row, row, rows, self.origin)
                cuda.memcpy2d_dtod_async(dst + row, pitch, fills[spec.name] + row, pitch, pitch - row, rows, self.origin)
            self.launch()
            self.synchronize()
            return self.outputs()

    def boundaries(self) -> dict[str, np.ndarray]:
        """Every tensor in the arena after the last replay, in the plan's dtype and NCHW layout (localization:
        the engines' values at each branch boundary).  Channels-last tensors are transposed back, and a tensor
        living in its Concat's buffer is cut out of it."""
        self._check_open()
        self.synchronize()
        out = {}
        for name, spec in self.plan.tensors.items():
            root, c0 = self.views.get(name, (name, 0))
            rspec = self.specs[root]
            shape = list(rspec.shape)
            if root in self.nhwc:
                shape = [shape[0], *shape[2:], shape[1]]
            host_dtype = "uint16" if rspec.dtype == "bfloat16" else rspec.dtype
            arr = np.empty(shape, dtype=host_dtype)
            cuda.memcpy_dtoh_async(arr.ctypes.data, self.addr[root], arr.nbytes, self.origin)  # pageable: synchronous
            self.synchronize()
            if rspec.dtype == "bfloat16":
                arr = (arr.astype(np.uint32) << 16).view(np.float32)
            if root in self.nhwc:
                arr = arr.transpose(0, 3, 1, 2)
            if name != root:
                arr = arr[:, c0:c0 + spec.shape[1]]
            out[name] = np.ascontiguousarray(arr).astype(spec.dtype, copy=False)
        return out

    def run_timed(self, *, replays: int = 5) -> list[dict]:
        """When each branch ran on each stream: timing events around every engine, in a separately captured graph.

        Returns one dict per branch (``branch``, ``name``, ``stream``, ``start_ms``, ``end_ms``, relative to the
        start of the replay), the median over ``replays`` replays.  Falls back to direct launches where
        the driver refuses event-record nodes.
        """
        self._check_open()
        with cuda.on_device(self.device):
            return self._run_timed(replays)

    def _run_timed(self, replays: int) -> list[dict]:
        nb = len(self.plan.branches)
        timing = {"start": [cuda.event_create(timing=True) for _ in range(nb)],
                  "end": [cuda.event_create(timing=True) for _ in range(nb)], "external": True}
        t0 = cuda.event_create(timing=True)
        mode = "graph"
        try:
            if self._timed_exec is None:
                with self._memory():
                    self._timed_graph, self._timed_exec = self._capture(self._launch_all, timing)
                self._timing_events = timing
            else:
                timing = self._timing_events
        except cuda.CudaError:
            mode = "direct"
            timing["external"] = False
        runs = []
        for _ in range(max(1, replays)):
            cuda.event_record(t0, self.origin)
            if mode == "graph":
                cuda.graph_launch(self._timed_exec, self.origin)
            else:
                with self._memory():
                    self._launch_all(self.origin, timing)
            cuda.stream_synchronize(self.origin)
            runs.append([(cuda.event_elapsed_ms(t0, timing["start"][b]), cuda.event_elapsed_ms(t0, timing["end"][b])) for b in range(nb)])
        cuda.event_destroy(t0)
        med = np.median(np.array(runs), axis=0)
        out = []
        for b in self.plan.branches:
            s = 0 if self.single_stream else b.stream
            out.append({"branch": b.id, "name": b.name, "stream": s, "start_ms": float(med[b.id][0]),
                        "end_ms": float(med[b.id][1]), "mode": mode, "nodes": len(b.nodes), "in_place": b.id in self.elided})
        return out

    def time_chain(self, branches, *, replays: int = 50, warmup: int = 5) -> float:
        """Milliseconds of ``branches`` run alone, back to back on the origin stream in launch order, nothing
        between them (no timing event, no other engine): captured into a graph of their own, replayed ``warmup`` +
        ``replays`` times with events around each replay, the median.  Direct launches where the launcher runs
        without a graph (``graph=False``) or the driver refuses the capture (the host's enqueue then counts).  The
        engines read whatever the arena holds from the last whole replay.  What ``pipeline.bench.measured_bound``
        gives as a critical path's time: events around every engine (``run_timed``) add a gap per engine, and over
        a chain of many small engines their sum exceeded what a multi-stream plan of the same engines ran (a
        decoder's 188 engines: 0.819 against 0.693 ms)."""
        self._check_open()
        chosen = set(branches)
        order = [b for b in self.plan.launch_order if b in chosen and b not in self.elided]

        def body(origin):
            for bid in order:
                self.engines[bid].enqueue(self._h(origin), self._branch_addrs[bid])

        with cuda.on_device(self.device):
            start, end = cuda.event_create(timing=True), cuda.event_create(timing=True)
            graph = ex = None
            try:
                try:
                    if self._exec is not None:
                        with self._memory():
                            graph, ex = self._capture(body)
                except cuda.CudaError:  # timed as direct launches
                    graph = ex = None
                times = []
                for _ in range(max(0, warmup) + max(1, replays)):
                    cuda.event_record(start, self.origin)
                    if ex is not None:
                        cuda.graph_launch(ex, self.origin)
                    else:
                        with self._memory():
                            body(self.origin)
                    cuda.event_record(end, self.origin)
                    cuda.stream_synchronize(self.origin)
                    times.append(cuda.event_elapsed_ms(start, end))
                return float(np.median(times[max(0, warmup):]))
            finally:
                if ex is not None:
                    cuda.graph_exec_destroy(ex)
                if graph is not None:
                    cuda.graph_destroy(graph)
                cuda.event_destroy(start)
                cuda.event_destroy(end)

    def devices(self) -> dict:
        """The device ordinal of each object this launcher made, read back from CUDA rather than from ``device``:
        ``arena`` (cudaPointerGetAttributes), ``origin`` and ``streams`` (each stream's context), ``events`` (each
        recorded on the origin stream, which only an event of the origin's device allows; -1 for one of another
        device), ``engines`` (per branch, the devices of what the engine holds: weights, views of the arena, torch
        streams, loaded kernels, TensorRT scratch; None for an in-place Concat), ``graph`` (``cuda.graph_devices``
        of the captured graph: each kernel node's context, each memset's destination; None without a graph).
        Every one of them is ``device`` for a correctly placed launcher.  Synchronizes the origin first."""
        self._check_open()
        with cuda.on_device(self.device):
            cuda.stream_synchronize(self.origin)
            events = [self._fork, self._producer_event, *self._joins, *self._events.values()]
            out = {
                "arena": cuda.pointer_device(self._arena),
                "origin": cuda.stream_device(self.origin),
                "streams": [cuda.stream_device(st) for st in self.streams],
                "events": [self.device if cuda.event_on_stream_device(e, self.origin) else -1 for e in events],
                "engines": [None if e is None else sorted(e.devices()) if hasattr(e, "devices") else [] for e in self.engines],
                "graph": cuda.graph_devices(self._graph) if self._graph is not None else None,
            }
            cuda.stream_synchronize(self.origin)
        return out

    def _check_open(self) -> None:
        if self._closed:
            raise ParastreamError("this launcher is closed")

    def close(self) -> None:
        if self._closed:
            return
        with cuda.on_device(self.device):
            self._close()

    def _close(self) -> None:
        self._closed = True
        cuda.stream_synchronize(self.origin)
        for ex in (self._exec, self._timed_exec):
            if ex is not None:
                cuda.graph_exec_destroy(ex)
        for g in (self._graph, self._timed_graph):
            if g is not None:
                cuda.graph_destroy(g)
        self._destroy_streams()
        for ptr, _ in self._host.values():
            cuda.free_host(ptr)
        self._host.clear()
        if self._shared is None:  # a shared arena belongs to its SharedArena
            cuda.free(self._arena)

    def _destroy_streams(self) -> None:
        for e in [self._fork, self._producer_event, *self._joins, *self._events.values()]:
            cuda.event_destroy(e)
        for s in self.streams:
            cuda.stream_destroy(s)
        if self._shared is None:  # a shared origin belongs to its SharedArena
            cuda.stream_destroy(self.origin)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
