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


def load(path: str | Path | Bundle, *, device: str | int = "auto", graph: bool = True, check_hashes: bool = True,
         host_tail: bool = True):
    """Load a bundle written by ``parastream build`` (a path, or a Bundle already opened); return a callable runner.

    ``device``: "auto" (the GPU launcher on GPU 0 when the bundle's engines are GPU engines and a GPU is
    present, else the CPU launcher), "cpu", "cuda" (GPU 0), "cuda:N" or the integer N (GPU N: the launcher's
    memory, streams, events, engines and captured graph all on that GPU).  A value that is none of these, or a
    GPU this machine lacks, is a ``ParastreamError`` naming the GPUs present.

    A bundle with a data-dependent tail (launcher/tail.py) answers the model's outputs, the tail run after each
    replay (on the host, or on the GPU where the build timed it faster); ``host_tail`` False gives its static part's runner alone, whose outputs are the tensors
    the tail reads (what a build verifies).
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
    from .tail import TailRunner, tail_record

    tail = tail_record(bundle) if host_tail else None  # run after each replay (launcher/tail.py)
    if kind == "cuda":
        from .gpu import GpuLauncher

        runner = GpuLauncher(bundle, graph=graph, device=gpu)
    else:
        from .cpu import CpuLauncher

        runner = CpuLauncher(bundle)
    if tail is None:
        return runner
    try:
        return TailRunner(runner, bundle, tail)
    except BaseException:
        close = getattr(runner, "close", None)
        if close is not None:
            close()
        raise
