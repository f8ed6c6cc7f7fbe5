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


def load(path: str | Path | Bundle, *, device: str = "auto", graph: bool = True, check_hashes: bool = True):
    """Load a bundle written by ``parastream build`` (a path, or a Bundle already opened); return a callable runner.

    ``device``: "auto" (the GPU launcher when the bundle's engines are GPU engines and
    a GPU is present), "cuda" or "cpu".
    """
    # (the GPU launcher runs on device 0: its context is made while the bundle is checked)
    bundle = path if isinstance(path, Bundle) else Bundle.open(path, check_hashes=check_hashes, loading=True,
                                                               device=None if device == "cpu" else 0)
    backend = bundle.backend()
    if device == "auto":
        device = "cuda" if backend.gpu and cuda_device_count() > 0 else "cpu"
    if bundle.manifest.get("buckets"):  # a dynamic-batch bundle: one launcher per batch bucket
        if device not in ("cuda", "cpu"):
            raise ParastreamError(f"--device {device!r} is not one of: auto, cuda, cpu")
        from .buckets import BucketedLauncher

        return BucketedLauncher(bundle, device=device, graph=graph)
    if device == "cuda":
        from .gpu import GpuLauncher

        return GpuLauncher(bundle, graph=graph)
    if device != "cpu":
        raise ParastreamError(f"--device {device!r} is not one of: auto, cuda, cpu")
    from .cpu import CpuLauncher

    return CpuLauncher(bundle)
