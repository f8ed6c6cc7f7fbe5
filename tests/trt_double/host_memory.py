"""Host memory in place of device memory, for running the TensorRT backend against the double on a CPU.

``HostMemory`` has the interface of ``launcher.engines.tensorrt.CudaMemory`` (alloc, free,
stream_create, stream_destroy, copy_in, copy_out, synchronize) over 256-byte aligned host
buffers addressed by plain integers, the way cudaMalloc'd pointers are.  The double's
``execute_async_v3`` reads and writes tensors at those integers through ``read``/``write``,
which refuse any address range that no live allocation holds: a wrong pointer fails the
test instead of corrupting the interpreter.  On a GPU test, ``DEVICE`` sends every other address to
device memory (synchronous copies), so the engines' real cuda-python path runs against the double.
"""

from __future__ import annotations

import ctypes
import itertools

import numpy as np

ALIGN = 256

#: live allocations: aligned address -> (owning buffer, size in bytes)
ALLOCATIONS: dict[int, tuple[object, int]] = {}
#: on a GPU test: an object with read(ptr, n), write(ptr, data) and synchronize(stream) over device
#: memory, used for every address that no host allocation holds; None everywhere else
DEVICE = None
_streams = itertools.count(0x5000)


def reset() -> None:
    global DEVICE
    ALLOCATIONS.clear()
    DEVICE = None


def _owned(ptr: int, nbytes: int) -> bool:
    return any(base <= ptr and ptr + nbytes <= base + size for base, (_, size) in ALLOCATIONS.items())


def _check(ptr: int, nbytes: int) -> None:
    if not _owned(ptr, nbytes):
        raise ValueError(f"address range 0x{ptr:x}+{nbytes} lies in no live allocation (a wrong or freed pointer)")


def read(ptr: int, nbytes: int) -> bytes:
    if DEVICE is not None and not _owned(ptr, nbytes):
        return DEVICE.read(ptr, nbytes)
    _check(ptr, nbytes)
    return ctypes.string_at(ptr, nbytes)


def write(ptr: int, data: bytes) -> None:
    if DEVICE is not None and not _owned(ptr, len(data)):
        DEVICE.write(ptr, data)
        return
    _check(ptr, len(data))
    ctypes.memmove(ptr, data, len(data))


def stream_synchronize(stream: int) -> None:
    """Before the double reads its inputs: on a GPU, let the work queued on ``stream`` finish."""
    if DEVICE is not None:
        DEVICE.synchronize(stream)


class HostMemory:
    def alloc(self, nbytes: int) -> int:
        nbytes = max(1, int(nbytes))
        buf = ctypes.create_string_buffer(nbytes + ALIGN)
        ptr = -(-ctypes.addressof(buf) // ALIGN) * ALIGN
        ALLOCATIONS[ptr] = (buf, nbytes)
        return ptr

    def free(self, ptr: int) -> None:
        if ALLOCATIONS.pop(ptr, None) is None:
            raise ValueError(f"free(0x{ptr:x}): not allocated (double free?)")

    def stream_create(self) -> int:
        return next(_streams)

    def stream_destroy(self, stream) -> None:
        pass

    def copy_in(self, dst: int, array: np.ndarray, stream) -> None:
        write(dst, np.ascontiguousarray(array).tobytes())

    def copy_out(self, array: np.ndarray, src: int, stream) -> None:
        array[...] = np.frombuffer(read(src, array.nbytes), dtype=array.dtype).reshape(array.shape)

    def synchronize(self, stream) -> None:
        pass  # the double executes at enqueue time
