"""Thin helpers over cuda-python's runtime bindings (``cuda.bindings.runtime``).

Every call goes through ``check``, which turns a non-success ``cudaError_t`` into
a ``CudaError`` naming the call, so a failure reads "cudaStreamBeginCapture failed:
cudaErrorStreamCaptureInvalidated (...)" instead of a silent wrong result.  cuda-python
is imported lazily: this module imports on a machine without it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import threading
import time
from typing import Any

import numpy as np

from .errors import BackendUnavailable, ParastreamError


class CudaError(ParastreamError):
    """A CUDA runtime call failed; the message names the call and the error."""


def cuda_device_count() -> int:
    """Number of CUDA devices cuda-python sees (0 where cuda-python or a driver is missing)."""
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        try:
            from cuda import cudart  # cuda-python < 12.6
        except ImportError:
            return 0
    try:
        err, n = cudart.cudaGetDeviceCount()
    except Exception:  # noqa: BLE001 - no driver
        return 0
    return int(n) if int(err) == 0 else 0


_rt = None


def runtime():
    """The ``cudart`` module of cuda-python (``cuda.bindings.runtime``, or ``cuda.cudart`` before 12.6)."""
    global _rt
    if _rt is None:
        try:
            from cuda.bindings import runtime as rt
        except ImportError:
            try:
                from cuda import cudart as rt  # cuda-python < 12.6
            except ImportError:
                raise BackendUnavailable("the GPU launcher needs cuda-python: pip install cuda-python") from None
        _rt = rt
    return _rt


_drv = None


def driver():
    """The driver API module of cuda-python (``cuda.bindings.driver``, or ``cuda.cuda`` before 12.6): only the
    device queries below need it (a stream's or a graph node's context has no runtime call)."""
    global _drv
    if _drv is None:
        try:
            from cuda.bindings import driver as drv
        except ImportError:
            try:
                from cuda import cuda as drv  # cuda-python < 12.6
            except ImportError:
                raise BackendUnavailable("the GPU launcher needs cuda-python: pip install cuda-python") from None
        _drv = drv
    return _drv


def check_driver(result: Any, call: str):
    """``check`` for a driver API call: a ``CUresult`` other than success is a ``CudaError`` naming ``call``."""
    drv = driver()
    err, values = (result[0], result[1:]) if isinstance(result, tuple) else (result, ())
    if err != drv.CUresult.CUDA_SUCCESS:
        raise CudaError(f"{call} failed: {getattr(err, 'name', str(err))}")
    if not values:
        return None
    return values[0] if len(values) == 1 else values


def check(result: Any, call: str):
    """Unpack a cuda-python result tuple ``(err, *values)``; raise ``CudaError`` naming ``call`` unless success.

    Returns ``None`` for no values, the value for one, a tuple for several.
    """
    rt = runtime()
    if isinstance(result, tuple):
        err, values = result[0], result[1:]
    else:
        err, values = result, ()
    if err != rt.cudaError_t.cudaSuccess:
        name = getattr(err, "name", str(err))
        try:
            _, desc = rt.cudaGetErrorString(err)
            desc = desc.decode() if isinstance(desc, bytes) else str(desc)
        except Exception:  # noqa: BLE001 - the description is a nicety
            desc = ""
        raise CudaError(f"{call} failed: {name}" + (f" ({desc})" if desc else ""))
    if not values:
        return None
    return values[0] if len(values) == 1 else values


def handle(obj) -> int:
    """The integer value of a cuda-python handle (stream, event, pointer) or a plain int."""
    if obj is None:
        return 0
    if isinstance(obj, int):
        return obj
    return int(obj)


# -- device ------------------------------------------------------------------

def device_count() -> int:
    try:
        rt = runtime()
        err, n = rt.cudaGetDeviceCount()
    except Exception:  # noqa: BLE001 - no cuda-python or no driver
        return 0
    return int(n) if err == rt.cudaError_t.cudaSuccess else 0


_BUS_IDS: dict[int, str] = {}


def pci_bus_id(device: int) -> str:
    """GPU ``device``'s PCI bus id as the driver gives it ("0000:19:00.0"): the physical GPU, whatever
    CUDA_VISIBLE_DEVICES numbers it (NVML looks GPUs up by it).  Raises where there is no driver or device."""
    bus = check(runtime().cudaDeviceGetPCIBusId(32, device), "cudaDeviceGetPCIBusId")
    return (bus.decode() if isinstance(bus, bytes) else str(bus)).strip("\x00").strip()


def gpu_lock_path(device: int):
    """The file whose lock is a turn on GPU ``device`` (``gpu_turn``), named by the GPU's PCI bus id where the
    driver gives it: processes that number their GPUs differently (each its own CUDA_VISIBLE_DEVICES) then share
    one lock per physical GPU, and processes on two GPUs never share one.  By the ordinal elsewhere."""
    import tempfile
    from pathlib import Path

    if device not in _BUS_IDS:
        try:
            _BUS_IDS[device] = re.sub(r"[^0-9A-Za-z]", "_", pci_bus_id(device)) or str(device)
        except Exception:  # noqa: BLE001 - no cuda-python, no driver or no such device: the ordinal
            _BUS_IDS[device] = str(device)
    return Path(tempfile.gettempdir()) / f"parastream-gpu{_BUS_IDS[device]}-timing.lock"


@contextlib.contextmanager
def gpu_turn(device: int = 0, enabled: bool = True, shared: bool = False):
    """Hold a machine-wide turn on GPU ``device`` while the block runs: file locks beside ``gpu_lock_path``.

    What times the GPU (pipeline.bench's ``gpu_timing_lock``: a build's measurements, another build's on the
    same GPU) takes an exclusive turn; what would run on the GPU meanwhile from another process (a build's compile
    workers, which run each engine they compiled, its Triton autotuning included) takes a ``shared`` turn, which
    other shared turns run beside.  An exclusive turn waits for the shared turns in progress and holds off new
    ones (a turnstile file, which every turn passes first, is held by the exclusive turn throughout), so that a
    timing is not kept waiting by workers whose turns overlap without end.  ``enabled`` False or
    ``PARASTREAM_GPU_TIMING_LOCK=0`` (every process of a machine that runs one build at a time) runs the block
    without it.  flock and two files rather than a library's lock: the turns are taken by separate processes
    (the compile workers) that share nothing but the machine, and the kernel drops a lock with its process."""
    if not enabled or os.environ.get("PARASTREAM_GPU_TIMING_LOCK", "1") == "0":
        yield
        return
    import fcntl

    path = gpu_lock_path(device)
    gate = os.open(path.with_name(path.name + ".gate"), os.O_RDWR | os.O_CREAT, 0o666)
    try:
        lock = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(gate, fcntl.LOCK_EX)
            if shared:
                fcntl.flock(lock, fcntl.LOCK_SH)
                fcntl.flock(gate, fcntl.LOCK_UN)  # through the turnstile: the next turn may come
            else:
                fcntl.flock(lock, fcntl.LOCK_EX)
            yield
        finally:
            os.close(lock)  # closing a descriptor releases its lock
    finally:
        os.close(gate)


def set_device(device: int) -> None:
    check(runtime().cudaSetDevice(device), f"cudaSetDevice({device})")


class on_device:
    """``with on_device(n):`` the calling thread's current device is ``n`` inside the block and what it was
    before after it.  The current device is per thread, and CUDA launches kernels, and torch allocates, on
    it: a launcher on GPU n called from a thread last used for another GPU sets it first.  A class rather
    than a generator: it wraps every call of a launcher, and one cudaGetDevice is all it costs when the
    device is already current."""

    __slots__ = ("device", "previous")

    def __init__(self, device: int):
        self.device = int(device)
        self.previous = None

    def __enter__(self):
        current = get_device()
        if current != self.device:
            set_device(self.device)
            self.previous = current
        return self

    def __exit__(self, *exc):
        if self.previous is not None:
            set_device(self.previous)
            self.previous = None


def gpus_present() -> str:
    """The GPUs cuda-python sees, for an error message: "2 GPUs: cuda:0 (NVIDIA H100), cuda:1 (NVIDIA H100)"."""
    n = device_count()
    if n < 1:
        return "no GPU (cuda-python and a driver see none)"
    names = []
    for i in range(n):
        try:
            names.append(f"cuda:{i} ({device_name(i)})")
        except Exception:  # noqa: BLE001 - the name is a nicety
            names.append(f"cuda:{i}")
    return f"{n} GPU{'s' if n > 1 else ''}: {', '.join(names)}"


_DEVICE_RE = re.compile(r"(?:cuda:)?([0-9]{1,4})")


def parse_device(value, *, option: str | None = "device") -> tuple[str, int | None]:
    """``(kind, ordinal)`` of a device as ``load`` and the command line take it: "auto", "cpu", "cuda" (which
    ``load`` runs on GPU 0), "cuda:N" or the integer N (GPU N).  ``kind`` is "auto", "cpu" or "cuda"; ``ordinal``
    is None except for an explicit GPU.  A value that is none of these, or a
    GPU this machine does not have, is a one-line ``ParastreamError`` naming ``option`` (``device='gpu1' is not
    a device ...``; None: the value alone, for argparse to prefix with its option) and the GPUs present."""
    prefix = f"{option}=" if option else ""
    if isinstance(value, bool):  # (a bool is an int to Python, never a device)
        value = str(value)
    if isinstance(value, int):
        text, ordinal = value, value if value >= 0 else None
    else:
        text = str(value).strip()
        low = text.lower()
        if low in ("auto", "cpu", "cuda"):
            return low, None
        m = _DEVICE_RE.fullmatch(low)
        ordinal = int(m.group(1)) if m else None
    if ordinal is None:
        raise ParastreamError(f"{prefix}{text!r} is not a device: give auto, cpu, cuda or cuda:N; this machine has {gpus_present()}")
    if ordinal >= device_count():
        raise ParastreamError(f"{prefix}{text!r}: no GPU cuda:{ordinal}; this machine has {gpus_present()}")
    return "cuda", ordinal


#: device -> the thread creating its context (``initialize_in_background``), and when it started and ended
CONTEXT_THREADS: dict[int, threading.Thread] = {}
CONTEXT_TIMES: dict[int, tuple[float, float]] = {}


def initialize_in_background(device: int) -> None:
    """Create ``device``'s primary context in a thread (cudaSetDevice and a cudaFree(0), with cuda-python, which lets
    go of the interpreter lock in every CUDA call): a load that imports torch meanwhile finds the context made
    when its first CUDA call comes, rather than making it then (0.2-0.4 s on an H100).  torch, cuda-python and the
    launcher all use the device's one primary context.  Errors are left for the load's own first call to report."""
    if device in CONTEXT_THREADS:
        return

    def run():
        t0 = time.perf_counter()
        try:
            rt = runtime()
            if rt.cudaSetDevice(device)[0] == rt.cudaError_t.cudaSuccess:
                rt.cudaFree(0)
        except Exception:  # noqa: BLE001 - no cuda-python or no driver: the load says so itself
            pass
        finally:
            CONTEXT_TIMES[device] = (t0, time.perf_counter())

    t = threading.Thread(target=run, name=f"parastream-cuda-context-{device}", daemon=True)
    CONTEXT_THREADS[device] = t
    t.start()


def get_device() -> int:
    """The calling thread's current device (where cudaMalloc allocates)."""
    return int(check(runtime().cudaGetDevice(), "cudaGetDevice"))


def pointer_device(ptr: int) -> int:
    """The ordinal of the device whose memory ``ptr`` points into (cudaPointerGetAttributes).

    Raises ``CudaError`` for host or unregistered memory, which has no device.
    """
    rt = runtime()
    attrs = check(rt.cudaPointerGetAttributes(ptr), f"cudaPointerGetAttributes(0x{int(ptr):x})")
    on_device = (rt.cudaMemoryType.cudaMemoryTypeDevice, rt.cudaMemoryType.cudaMemoryTypeManaged)
    if attrs.type not in on_device:
        kind = getattr(attrs.type, "name", str(attrs.type))
        raise CudaError(f"0x{int(ptr):x} is not CUDA device memory ({kind})")
    return int(attrs.device)


def context_device(ctx) -> int:
    """The ordinal of the device of CUDA context ``ctx`` (made current for the query, then popped)."""
    drv = driver()
    check_driver(drv.cuCtxPushCurrent(ctx), "cuCtxPushCurrent")
    try:
        return int(check_driver(drv.cuCtxGetDevice(), "cuCtxGetDevice"))  # a CUdevice is the device's ordinal
    finally:
        check_driver(drv.cuCtxPopCurrent(), "cuCtxPopCurrent")


def stream_device(stream) -> int:
    """The ordinal of the device ``stream`` was created on (the device of its context: cuStreamGetCtx)."""
    return context_device(check_driver(driver().cuStreamGetCtx(handle(stream)), "cuStreamGetCtx"))


def event_on_stream_device(event, stream) -> bool:
    """Whether ``event`` belongs to ``stream``'s device: recording an event into a stream of another device's
    context fails (cudaEventRecord: "event and stream must be on the same CUDA context"), and no call reads an
    event's device directly.  Records ``event`` on ``stream``: only for an idle launcher."""
    rt = runtime()
    return rt.cudaEventRecord(event, stream)[0] == rt.cudaError_t.cudaSuccess


def graph_devices(graph) -> dict[str, list[int]]:
    """The devices a captured graph's work runs on: ``kernels``, the device of each kernel node's context (its
    launch parameters name the context it runs in; nodes that leave it unset are not counted), ``memsets``, the
    device of each memset node's destination, ``copies``, each memcpy node's (source, destination) devices, -1 for
    host memory: a replay that copies nothing between GPUs has only (n, n) pairs."""
    rt, drv = runtime(), driver()
    n = graph_num_nodes(graph)
    nodes = check(rt.cudaGraphGetNodes(graph, n), "cudaGraphGetNodes")[0] if n else []
    kinds = rt.cudaGraphNodeType
    out: dict[str, list] = {"kernels": [], "memsets": [], "copies": []}
    for node in nodes:
        kind = check(rt.cudaGraphNodeGetType(node), "cudaGraphNodeGetType")
        if kind == kinds.cudaGraphNodeTypeKernel:
            params = check_driver(drv.cuGraphKernelNodeGetParams(int(node)), "cuGraphKernelNodeGetParams")
            ctx = getattr(params, "ctx", None)
            if ctx is not None and int(ctx) != 0:
                out["kernels"].append(context_device(ctx))
        elif kind == kinds.cudaGraphNodeTypeMemset:
            params = check(rt.cudaGraphMemsetNodeGetParams(node), "cudaGraphMemsetNodeGetParams")
            out["memsets"].append(pointer_device(handle(params.dst)))
        elif kind == kinds.cudaGraphNodeTypeMemcpy:
            params = check(rt.cudaGraphMemcpyNodeGetParams(node), "cudaGraphMemcpyNodeGetParams")
            out["copies"].append((_device_or_host(handle(params.srcPtr.ptr)), _device_or_host(handle(params.dstPtr.ptr))))
    return out


def _device_or_host(ptr: int) -> int:
    """``pointer_device``, or -1 for host memory."""
    try:
        return pointer_device(ptr)
    except CudaError:
        return -1


def synchronize() -> None:
    check(runtime().cudaDeviceSynchronize(), "cudaDeviceSynchronize")


def device_name(device: int = 0) -> str:
    props = check(runtime().cudaGetDeviceProperties(device), "cudaGetDeviceProperties")
    name = props.name
    if isinstance(name, bytes):
        name = name.split(b"\0", 1)[0].decode()
    return str(name)


# -- streams and events ------------------------------------------------------

def stream_create():
    """A non-blocking stream (no implicit synchronisation with the legacy default stream)."""
    rt = runtime()
    return check(rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking), "cudaStreamCreateWithFlags(cudaStreamNonBlocking)")


def stream_destroy(stream) -> None:
    check(runtime().cudaStreamDestroy(stream), "cudaStreamDestroy")


def stream_synchronize(stream) -> None:
    check(runtime().cudaStreamSynchronize(stream), "cudaStreamSynchronize")


def event_create(timing: bool = False):
    """An event; fork/join events disable timing (cheaper), timeline events keep it."""
    rt = runtime()
    flags = rt.cudaEventDefault if timing else rt.cudaEventDisableTiming
    return check(rt.cudaEventCreateWithFlags(flags), "cudaEventCreateWithFlags")


def event_destroy(event) -> None:
    check(runtime().cudaEventDestroy(event), "cudaEventDestroy")


def event_record(event, stream) -> None:
    check(runtime().cudaEventRecord(event, stream), "cudaEventRecord")


def event_record_external(event, stream) -> None:
    """Record ``event`` as a real event node when ``stream`` is capturing (timeline inside a graph)."""
    rt = runtime()
    check(rt.cudaEventRecordWithFlags(event, stream, rt.cudaEventRecordExternal), "cudaEventRecordWithFlags(cudaEventRecordExternal)")


def stream_wait_event(stream, event) -> None:
    check(runtime().cudaStreamWaitEvent(stream, event, 0), "cudaStreamWaitEvent")


def event_synchronize(event) -> None:
    check(runtime().cudaEventSynchronize(event), "cudaEventSynchronize")


def event_elapsed_ms(start, end) -> float:
    return float(check(runtime().cudaEventElapsedTime(start, end), "cudaEventElapsedTime"))


# -- memory ------------------------------------------------------------------

def malloc(nbytes: int) -> int:
    return handle(check(runtime().cudaMalloc(max(1, int(nbytes))), f"cudaMalloc({nbytes})"))


def free(ptr: int) -> None:
    check(runtime().cudaFree(ptr), "cudaFree")


def malloc_host(nbytes: int) -> int:
    """Pinned host memory (asynchronous copies from pageable memory are staged and synchronous)."""
    return handle(check(runtime().cudaMallocHost(max(1, int(nbytes))), f"cudaMallocHost({nbytes})"))


def free_host(ptr: int) -> None:
    check(runtime().cudaFreeHost(ptr), "cudaFreeHost")


def memcpy_htod_async(dst: int, src: int, nbytes: int, stream) -> None:
    rt = runtime()
    check(rt.cudaMemcpyAsync(dst, src, nbytes, rt.cudaMemcpyKind.cudaMemcpyHostToDevice, stream), "cudaMemcpyAsync(HostToDevice)")


def memcpy_dtoh_async(dst: int, src: int, nbytes: int, stream) -> None:
    rt = runtime()
    check(rt.cudaMemcpyAsync(dst, src, nbytes, rt.cudaMemcpyKind.cudaMemcpyDeviceToHost, stream), "cudaMemcpyAsync(DeviceToHost)")


def memcpy_dtod_async(dst: int, src: int, nbytes: int, stream) -> None:
    rt = runtime()
    check(rt.cudaMemcpyAsync(dst, src, nbytes, rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice, stream), "cudaMemcpyAsync(DeviceToDevice)")


def memcpy2d_dtod_async(dst: int, dpitch: int, src: int, spitch: int, width: int, height: int, stream) -> None:
    """``height`` rows of ``width`` bytes, each row ``spitch`` bytes after the last at ``src`` and ``dpitch`` at
    ``dst`` (one copy of a block of rows, e.g. a batch of sequences into a longer bucket's buffer)."""
    rt = runtime()
    check(rt.cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice, stream),
          "cudaMemcpy2DAsync(DeviceToDevice)")


def device_copy(arr: np.ndarray, stream, dtype: str | None = None) -> int:
    """A new device buffer (cudaMalloc, the caller frees it) of ``arr.nbytes`` holding ``arr`` (as ``dtype`` where
    given, else its own), copied through pinned host memory on ``stream`` and synchronised."""
    arr = np.ascontiguousarray(arr)
    ptr = malloc(arr.nbytes)
    try:
        host = malloc_host(arr.nbytes)
        try:
            host_array(host, arr.shape, dtype or arr.dtype)[...] = arr
            memcpy_htod_async(ptr, host, arr.nbytes, stream)
            stream_synchronize(stream)
        finally:
            free_host(host)
    except BaseException:
        free(ptr)
        raise
    return ptr


def memset_async(ptr: int, value: int, nbytes: int, stream) -> None:
    check(runtime().cudaMemsetAsync(ptr, value, nbytes, stream), "cudaMemsetAsync")


def host_array(ptr: int, shape, dtype) -> np.ndarray:
    """A numpy view of pinned host memory at ``ptr``."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64)) if len(shape) else 1
    buf = (ctypes.c_byte * (n * dtype.itemsize)).from_address(ptr)
    return np.frombuffer(buf, dtype=dtype, count=n).reshape(shape)


# -- graphs ------------------------------------------------------------------

def begin_capture(stream, mode: str = "relaxed") -> None:
    """Start capturing ``stream``.  Relaxed mode: other threads' (and the caching allocators')
    unsafe calls such as cudaMalloc stay legal while we capture; memory they take is not captured."""
    rt = runtime()
    modes = {"global": rt.cudaStreamCaptureMode.cudaStreamCaptureModeGlobal,
             "thread_local": rt.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal,
             "relaxed": rt.cudaStreamCaptureMode.cudaStreamCaptureModeRelaxed}
    check(rt.cudaStreamBeginCapture(stream, modes[mode]), "cudaStreamBeginCapture")


def end_capture(stream):
    return check(runtime().cudaStreamEndCapture(stream), "cudaStreamEndCapture")


def is_capturing(stream) -> bool:
    rt = runtime()
    status = check(rt.cudaStreamIsCapturing(stream), "cudaStreamIsCapturing")
    return status != rt.cudaStreamCaptureStatus.cudaStreamCaptureStatusNone


def graph_instantiate(graph):
    return check(runtime().cudaGraphInstantiate(graph, 0), "cudaGraphInstantiate")


def graph_launch(graph_exec, stream) -> None:
    check(runtime().cudaGraphLaunch(graph_exec, stream), "cudaGraphLaunch")


def graph_destroy(graph) -> None:
    check(runtime().cudaGraphDestroy(graph), "cudaGraphDestroy")


def graph_exec_destroy(graph_exec) -> None:
    check(runtime().cudaGraphExecDestroy(graph_exec), "cudaGraphExecDestroy")


class StreamGate:
    """A gate that holds a stream's work until the host opens it: the stream waits on a 32-bit counter in
    pinned host memory mapped into the device (``cuStreamWaitValue32``, cyclic greater-or-equal), which the
    host then raises.

    Timing uses it so that a block of timed replays is all queued before the GPU starts on it (NVBench's
    "blocking kernel", done with a stream memory operation that the driver already has rather than a kernel
    of our own): the CUDA events then time the GPU's work only, not a launching thread that another thread
    held at the interpreter lock or that compile workers kept off a core, which would otherwise stall the GPU
    between a replay's start event and its graph.  A gate left closed for ``limit_s`` (the driver's queue
    filled before the block was all queued) is opened by a timer: the block is then timed as it runs, and
    ``opened_by_timer`` counts it.  Every driver call here releases the interpreter lock, so the timer runs
    while the queuing thread waits in the driver."""

    def __init__(self, limit_s: float = 2.0):
        rt = runtime()
        self.limit_s = float(limit_s)
        self.host = handle(check(rt.cudaHostAlloc(4, rt.cudaHostAllocMapped), "cudaHostAlloc(mapped)"))
        self.device_ptr = handle(check(rt.cudaHostGetDevicePointer(self.host, 0), "cudaHostGetDevicePointer"))
        self._value = ctypes.c_uint32.from_address(self.host)
        self._value.value = 0
        self._count = 0
        self._lock = threading.Lock()
        self.opened_by_timer = 0

    def close(self, stream) -> None:
        """Queue, on ``stream``, a wait for the next ``open``."""
        drv = driver()
        self._count = (self._count + 1) & 0xFFFFFFFF
        check_driver(drv.cuStreamWaitValue32(handle(stream), self.device_ptr, self._count,
                                             int(drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ)),
                     "cuStreamWaitValue32")
        self._timer = threading.Timer(self.limit_s, self._open, args=(self._count, True))
        self._timer.daemon = True
        self._timer.start()

    def open(self) -> None:
        self._timer.cancel()
        self._open(self._count, False)

    def _open(self, count: int, by_timer: bool) -> None:
        with self._lock:
            if (self._value.value - count) & 0x80000000:  # not open yet (cyclic comparison, as the driver's)
                self._value.value = count
                self.opened_by_timer += by_timer

    def free(self) -> None:
        timer = getattr(self, "_timer", None)
        if timer is not None:
            timer.cancel()
            self._open(self._count, False)
        check(runtime().cudaFreeHost(self.host), "cudaFreeHost")


def graph_num_nodes(graph) -> int:
    _, n = check(runtime().cudaGraphGetNodes(graph, 0), "cudaGraphGetNodes") or (None, 0)
    return int(n)


# -- device arrays -----------------------------------------------------------

_TYPESTR = {
    "float32": "<f4", "float16": "<f2", "float64": "<f8", "int64": "<i8", "int32": "<i4", "int16": "<i2",
    "int8": "|i1", "uint8": "|u1", "bool": "|b1", "bfloat16": "<V2",
}


def nbytes_of(shape, dtype: str) -> int:
    n = int(np.prod(shape, dtype=np.int64)) if len(shape) else 1
    return n * (2 if dtype == "bfloat16" else np.dtype(dtype).itemsize)


def c_contiguous(cai: dict) -> bool:
    """Whether a CUDA array interface describes C-contiguous memory: no strides given, or the C strides."""
    strides = cai.get("strides")
    if strides is None:
        return True
    shape, itemsize = [int(d) for d in cai["shape"]], np.dtype(cai["typestr"]).itemsize
    return tuple(int(s) for s in strides) == tuple(int(np.prod(shape[i + 1:], dtype=np.int64)) * itemsize
                                                    for i in range(len(shape)))


class DeviceArray:
    """A view of launcher-owned device memory: ``__cuda_array_interface__`` (v3) and DLPack via torch/cupy.

    ``torch.as_tensor(arr, device=f"cuda:{arr.device}")`` and ``cupy.asarray(arr)`` wrap it without a copy.
    The memory belongs to the launcher: it stays valid until the launcher is closed, and a
    graph replay overwrites it.  ``device`` is the ordinal of the GPU that holds the memory:
    given by whoever allocated it, else read once from the pointer's attributes.
    """

    def __init__(self, ptr: int, shape, dtype: str, name: str = "", owner: Any = None, device: int | None = None):
        self.ptr = int(ptr)
        self.shape = tuple(int(s) for s in shape)
        self.dtype = dtype
        self.name = name
        self._owner = owner
        self._device = None if device is None else int(device)

    @property
    def device(self) -> int:
        if self._device is None:
            self._device = pointer_device(self.ptr)
        return self._device

    @property
    def nbytes(self) -> int:
        return nbytes_of(self.shape, self.dtype)

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"shape": self.shape, "typestr": _TYPESTR[self.dtype], "data": (self.ptr, False),
                "version": 3, "strides": None, "stream": None}

    def torch(self):
        """A torch tensor on the same memory (no copy)."""
        import torch

        # the memory's own device: a bare "cuda" means the current device, and torch would copy there
        device = f"cuda:{self.device}"
        if self.dtype == "bfloat16":
            t = torch.as_tensor(DeviceArray(self.ptr, self.shape, "int16", device=self.device), device=device)
            return t.view(torch.bfloat16)
        return torch.as_tensor(self, device=device)

    def __dlpack__(self, stream=None):
        import torch

        # torch exports only from its current device: the memory's own device for the export (a consumer on
        # another GPU, Triton's model.py for an instance there, reads it where it is)
        with torch.cuda.device(self.device):
            t = self.torch()
            return t.__dlpack__(stream=stream) if stream is not None else t.__dlpack__()

    def __dlpack_device__(self):
        return (2, self.device)  # kDLCUDA (managed memory too: consumers take it as device memory)

    def __repr__(self) -> str:
        return f"DeviceArray({self.name!r}, shape={list(self.shape)}, dtype={self.dtype}, ptr=0x{self.ptr:x})"
