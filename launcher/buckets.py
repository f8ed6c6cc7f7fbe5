"""Dynamic-batch bundles: one static plan, engines and CUDA Graph per batch bucket.

A bundle built with ``--batch MIN:OPT:MAX`` (MIN < MAX) holds one complete static bundle per bucket
(manifest.json ``buckets``): the largest bucket, MAX, is the bundle's own top-level files (so anything
that reads a plain bundle reads it as a batch-MAX bundle), every other bucket is a bundle in
``buckets/b<N>/``.  The top-level manifest lists and hashes every file, the buckets' included.

``BucketedLauncher`` takes any batch n in [MIN, MAX]: it runs the smallest bucket >= n with the n rows
and the rest of that bucket filled by repeating them (so padding rows hold valid values: token ids,
masks), and returns the outputs' first n rows.  On a GPU the buckets share one arena for their boundary
tensors (sized for the largest) and one origin stream (``SharedArena``): only one bucket runs at a time.
"""

from __future__ import annotations

import numpy as np

from .bundle import Bundle
from .errors import ParastreamError


def bucket_record(bundle: Bundle) -> dict | None:
    """The manifest's ``buckets`` entry (None for a bundle of one static batch)."""
    rec = bundle.manifest.get("buckets")
    return rec if rec else None


def smallest_bucket(sizes: list[int], n: int) -> int:
    """The smallest bucket that holds ``n`` rows (``sizes`` ascending; n within range)."""
    return next(b for b in sizes if b >= n)


def pad_rows(x: np.ndarray, rows: int) -> np.ndarray:
    """``x`` with its first dimension grown to ``rows`` by repeating its rows in order (np.resize's way)."""
    n = x.shape[0]
    if n == rows:
        return x
    return x[np.arange(rows) % n]


class BucketedLauncher:
    """Runs a dynamic-batch bundle: any batch n in [MIN, MAX] on the smallest bucket >= n, n rows out.

    ``device``: "cuda" (GpuLauncher per bucket over one shared arena, on GPU ``gpu``) or "cpu" (CpuLauncher per
    bucket).
    ``launchers`` maps each bucket to its launcher; ``bucket_for(n)`` says which one runs n rows.
    """

    def __init__(self, bundle: Bundle, *, device: str = "cpu", graph: bool = True, gpu: int = 0):
        rec = bucket_record(bundle)
        if rec is None:
            raise ParastreamError(f"{bundle.path}: not a dynamic-batch bundle (manifest.json lists no buckets)")
        self.bundle = bundle
        self.sizes = sorted(int(b) for b in rec["sizes"])
        self.min, self.max = int(rec["min"]), int(rec["max"])
        self.batched_inputs = list(rec["inputs"])
        self.batched_outputs = set(rec["outputs"])
        self.device = device
        self.shared = None
        self.launchers: dict[int, object] = {}
        subs = bundle.bucket_bundles()
        try:
            if device == "cuda":
                from . import cuda
                from .gpu import GpuLauncher, SharedArena, arena_bytes

                cuda.set_device(gpu)  # the shared arena and origin on the launchers' GPU
                self.shared = SharedArena(max(arena_bytes(sub) for sub in subs.values()))
                for b in self.sizes:
                    self.launchers[b] = GpuLauncher(subs[b], graph=graph, device=gpu, shared=self.shared)
            else:
                from .cpu import CpuLauncher

                for b in self.sizes:
                    self.launchers[b] = CpuLauncher(subs[b])
        except BaseException:
            self.close()
            raise
        top = self.launchers[self.max]
        self.plan = top.plan  # the MAX bucket's plan (specs at MAX)

    @property
    def input_specs(self):
        return self.launchers[self.max].input_specs

    @property
    def output_specs(self):
        return self.launchers[self.max].output_specs

    def bucket_for(self, n: int) -> int:
        """The bucket that runs a batch of ``n``; a batch outside [MIN, MAX] is refused, naming the range."""
        if not self.min <= n <= self.max:
            raise ParastreamError(f"a batch of {n} is outside this bundle's range {self.min}..{self.max} "
                                  f"(--batch {self.min}:..:{self.max}); buckets {self.sizes}")
        return smallest_bucket(self.sizes, n)

    def batch_of(self, feeds: dict) -> int:
        """The batch n of ``feeds``: the first dimension of every batched input, which must agree."""
        sizes = {}
        for name in self.batched_inputs:
            if name in feeds:
                shape = getattr(feeds[name], "shape", None)
                if shape is None:
                    shape = np.asarray(feeds[name]).shape
                if len(shape) == 0:
                    raise ParastreamError(f"input {name!r} is a scalar; it takes a batch {self.min}..{self.max} as its first dimension")
                sizes[name] = int(shape[0])
        if not sizes:
            raise ParastreamError(f"missing input(s) {self.batched_inputs}; the model takes {[t.name for t in self.input_specs]}")
        if len(set(sizes.values())) > 1:
            raise ParastreamError(f"inputs disagree on the batch: {sizes}")
        name, n = next(iter(sizes.items()))
        if not self.min <= n <= self.max:
            raise ParastreamError(f"input {name!r} has batch {n}, outside this bundle's range {self.min}..{self.max} "
                                  f"(buckets {self.sizes})")
        return n

    def __call__(self, feeds: dict) -> dict:
        """Run ``feeds`` of batch n on the smallest bucket >= n; outputs with a batch dimension have n rows."""
        n = self.batch_of(feeds)
        b = self.bucket_for(n)
        padded = {k: (self._pad(v, b) if k in self.batched_inputs else v) for k, v in feeds.items()}
        outs = self.launchers[b](padded)
        return {k: (self._rows(v, n) if k in self.batched_outputs else v) for k, v in outs.items()}

    @staticmethod
    def _pad(x, rows: int):
        if isinstance(x, np.ndarray) or not (hasattr(x, "__cuda_array_interface__") or hasattr(x, "__dlpack__")):
            return pad_rows(np.asarray(x), rows)
        import torch  # a device array: padded on its device (torch reads CUDA array interface and DLPack)

        t = torch.as_tensor(x) if hasattr(x, "__cuda_array_interface__") else torch.from_dlpack(x)
        n = t.shape[0]
        return t if n == rows else t[torch.arange(rows, device=t.device) % n].contiguous()

    @staticmethod
    def _rows(v, n: int):
        if isinstance(v, np.ndarray):
            return v[:n]
        from .cuda import DeviceArray

        if isinstance(v, DeviceArray):  # the first n rows of a contiguous buffer: a view of its start
            return DeviceArray(v.ptr, (n, *v.shape[1:]), v.dtype, v.name, v._owner, device=v.device)
        return v[:n]

    def close(self) -> None:
        for la in self.launchers.values():
            close = getattr(la, "close", None)
            if close:
                close()
        self.launchers = {}
        if self.shared is not None:
            self.shared.close()
            self.shared = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()  # the buckets' launchers first, then the arena and origin they share
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
