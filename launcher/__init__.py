"""parastream.launcher: load a bundle and run it.

``load(path)`` returns a callable ``runner(feeds) -> outputs``: on a GPU, the
multi-stream plan replayed as one CUDA Graph; on the CPU, the same plan on a
thread pool with one worker per stream.
"""

from __future__ import annotations

from pathlib import Path

from .bundle import Bundle
from .cuda import cuda_device_count  # noqa: F401 - part of the launcher's API (the build asks it too)
from .errors import BackendUnavailable, ParastreamError, VerificationError  # noqa: F401
from .plan import Branch, Plan, TensorSpec  # noqa: F401


def load(path: str | Path | Bundle, *, device: str | int = "auto", graph: bool = True, check_hashes: bool = True):
    """Load a bundle written by ``parastream build`` (a path, or a Bundle already opened); return a callable runner.

    ``device``: "auto" (the GPU launcher on GPU 0 when the bundle's engines are GPU engines and a GPU is
    present, else the CPU launcher), "cpu", "cuda" (GPU 0), "cuda:N" or the integer N (GPU N: the launcher's
    memory, streams, events, engines and captured graph all on that GPU).  A value that is none of these, or a
    GPU this machine lacks, is a ``ParastreamError`` naming the GPUs present.
    """
    from .cuda import parse_device

    kind, gpu = parse_device(device, option="device")
    gpu = gpu or 0
    # (the GPU launcher's device has its context made in a thread while the bundle is checked)
    bundle = path if isinstance(path, Bundle) else Bundle.open(path, check_hashes=check_hashes, loading=True,
                                                               device=None if kind == "cpu" else gpu)
    backend = bundle.backend()
    if kind == "auto":
        kind = "cuda" if backend.gpu and cuda_device_count() > 0 else "cpu"
    if bundle.manifest.get("buckets"):  # a dynamic-batch bundle: one launcher per batch bucket
        from .buckets import BucketedLauncher

        return BucketedLauncher(bundle, device=kind, graph=graph, gpu=gpu)
    if kind == "cuda":
        from .gpu import GpuLauncher

        return GpuLauncher(bundle, graph=graph, device=gpu)
    from .cpu import CpuLauncher

    return CpuLauncher(bundle)
