"""Dynamic-batch bundles: one static plan, engines and CUDA Graph per batch bucket.

A bundle built with ``--batch MIN:OPT:MAX`` (MIN < MAX) holds one complete static bundle per bucket
(manifest.json ``buckets``): the largest bucket, MAX, is the bundle's own top-level files (so anything
that reads a plain bundle reads it as a batch-MAX bundle), every other bucket is a bundle in
``buckets/b<N>/``.  The top-level manifest lists and hashes every file, the buckets' included.

``BucketedLauncher`` takes any batch n in [MIN, MAX]: it runs the smallest bucket >= n with the n rows
and the rest of that bucket filled by repeating them (so padding rows hold valid values: token ids,
masks), and returns the outputs' first n rows.  On a GPU the buckets share one arena for their boundary
tensors (sized for the largest) and one origin stream (``SharedArena``): only one bucket runs at a time.

A bundle built with ``--min-shapes/--max-shapes`` holds one static bundle per bucket of a grid over its dynamic
axes (manifest.json ``buckets.axes`` and ``buckets.grid``, folders ``buckets/b<1x16>``): the same launcher takes
any shape in range, runs each axis's smallest bucket that holds it with the inputs padded as the build proved
harmless (``pad_axis``), and cuts the outputs back along the dimensions that carry each axis (``cut_axis``).
"""

from __future__ import annotations

import numpy as np

from .bundle import Bundle, grid_key
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


def key_text(key) -> str:
    return "x".join(str(v) for v in key)


def _batch_like(axis: dict) -> bool:
    return all(int(i) == 0 for i in axis["inputs"].values())


def _bucket_on(axis: dict, size: int) -> int:
    """The bucket of ``axis`` that serves ``size``: the size itself on an exact axis, else the smallest >= it."""
    return size if axis.get("exact") else smallest_bucket(sorted(axis["sizes"]), size)


def _xp(x):
    """numpy for host arrays, torch for device ones (a DeviceArray or anything with a CUDA array interface)."""
    if isinstance(x, np.ndarray) or not (hasattr(x, "__cuda_array_interface__") or hasattr(x, "__dlpack__")):
        return np, np.asarray(x)
    import torch

    if isinstance(x, torch.Tensor):
        return torch, x
    if hasattr(x, "__cuda_array_interface__"):  # a DeviceArray names its GPU; torch reads the interface there
        device = getattr(x, "device", None)
        return torch, torch.as_tensor(x, device=f"cuda:{device}" if isinstance(device, int) else "cuda")
    return torch, torch.from_dlpack(x)


def pad_axis(x, dim: int, size: int, how):
    """``x`` grown along ``dim`` to ``size``: ``"repeat"`` repeats its slices in order (the batch axis: padding
    rows hold valid values), ``"continue"`` counts on from the last slice (position ids), a number fills."""
    xp, x = _xp(x)
    n = int(x.shape[dim])
    if n == size:
        return x
    if how == "repeat":
        idx = np.arange(size) % n
        return np.take(x, idx, axis=dim) if xp is np else x.index_select(dim, xp.as_tensor(idx, device=x.device))
    shape = list(x.shape)
    shape[dim] = size - n
    if how == "continue":
        last = np.take(x, [n - 1], axis=dim) if xp is np else x.narrow(dim, n - 1, 1)
        steps = np.arange(1, size - n + 1).reshape([-1 if i == dim else 1 for i in range(len(shape))])
        fill = last + (steps.astype(x.dtype) if xp is np else xp.as_tensor(steps, device=x.device, dtype=x.dtype))
    elif xp is np:
        fill = np.full(shape, how, dtype=x.dtype)
    else:
        fill = xp.full(shape, how, dtype=x.dtype, device=x.device)
    return np.concatenate([x, fill], axis=dim) if xp is np else xp.cat([x, fill], dim=dim)


def cut_axis(x, dim: int, size: int):
    """The first ``size`` entries of ``x`` along ``dim`` (a padded run's real positions).  A DeviceArray cut along
    a dimension with only 1s before it (the first; a sequence at batch 1) stays a view of its buffer's start;
    otherwise it is copied (torch)."""
    if int(x.shape[dim]) == size:
        return x
    from .cuda import DeviceArray

    if isinstance(x, DeviceArray) and all(int(s) == 1 for s in x.shape[:dim]):
        # the dimensions before ``dim`` are 1: the first ``size`` entries along it are the buffer's first bytes
        return DeviceArray(x.ptr, (*x.shape[:dim], size, *x.shape[dim + 1:]), x.dtype, x.name, x._owner, device=x.device)
    xp, x = _xp(x)
    index = (slice(None),) * dim + (slice(0, size),)
    return x[index] if xp is np else x[index].contiguous()


def _c_contiguous_on_device(x) -> bool:
    """Whether ``x`` offers the CUDA array interface over C-contiguous memory."""
    from .cuda import c_contiguous

    cai = None if isinstance(x, np.ndarray) else getattr(x, "__cuda_array_interface__", None)
    return cai is not None and c_contiguous(cai)


def _device_full(la, spec, value) -> int:
    """A device buffer (cudaMalloc) of ``spec``'s shape and dtype holding ``value`` everywhere, on launcher
    ``la``'s GPU."""
    from . import cuda

    with cuda.on_device(la.device):
        return cuda.device_copy(np.full(spec.shape, value, dtype=np.dtype(spec.dtype)), la.origin)


def axis_between(sizes: list[int], lo: int) -> int | None:
    """A size of a grid axis that is not a bucket and runs padded: the one past the smallest bucket with a gap
    after it, else MIN where it lies below the first bucket; None when every size in range is a bucket."""
    for a, b in zip(sizes, sizes[1:]):
        if b - a > 1:
            return a + 1
    return lo if lo < sizes[0] else None


def grid_between(la) -> tuple[int, ...] | None:
    """A point between buckets of a grid bundle (``la``: its BucketedLauncher): every padded axis at its size
    between buckets (axis_between), the others at their smallest bucket; None when no axis has one.  What the
    build and ``parastream verify`` check and ``parastream bench`` times besides the buckets."""
    point, any_gap = [], False
    for a in la.axes:
        gap = None if a.get("exact") else axis_between(sorted(a["sizes"]), int(a["min"]))
        any_gap = any_gap or gap is not None
        point.append(gap if gap is not None else min(a["sizes"]))
    return tuple(point) if any_gap else None


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
        self.grid = "axes" in rec  # a grid over named axes (--min/--max-shapes); else the batch axis alone
        if self.grid:
            self.axes = [dict(a) for a in rec["axes"]]
            self.sizes = sorted(grid_key(k) for k in rec["grid"])
            self.min = tuple(int(a["min"]) for a in self.axes)
            self.max = tuple(int(a["max"]) for a in self.axes)
            self.batched_inputs = sorted({n for a in self.axes if _batch_like(a) for n in a["inputs"]})
            self.batched_outputs = {o for a in self.axes if _batch_like(a) for o in a.get("outputs", {})}
        else:
            self.axes = None
            self.sizes = sorted(int(b) for b in rec["sizes"])
            self.min, self.max = int(rec["min"]), int(rec["max"])
            self.batched_inputs = list(rec["inputs"])
            self.batched_outputs = set(rec["outputs"])
        self.device = device
        self.shared = None
        self.launchers: dict[int, object] = {}
        self._fill_buffers: dict[tuple, int] = {}  # (bucket, input) -> a device buffer of its pad value (``_fills``)
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

    def bucket_for(self, n):
        """The bucket that runs a batch of ``n`` (a grid bundle: the point ``n``, one size per axis); a size
        outside its axis's range is refused, naming the range."""
        if self.grid:
            point = tuple(n)
            for a, size in zip(self.axes, point):
                self._check_size(a, size, f"axis {a['name']!r}")
            return tuple(_bucket_on(a, size) for a, size in zip(self.axes, point))
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

    @staticmethod
    def _check_size(a: dict, size: int, what: str) -> None:
        if a.get("exact"):
            if size not in a["sizes"]:
                raise ParastreamError(f"{what} has size {size}; this bundle was built for exactly "
                                      f"{', '.join(map(str, a['sizes']))} on axis {a['name']!r} (no padding there)")
        elif not int(a["min"]) <= size <= int(a["max"]):
            raise ParastreamError(f"{what} has size {size}, outside this bundle's range {a['min']}..{a['max']} on axis "
                                  f"{a['name']!r} (buckets {a['sizes']})")

    def point_of(self, feeds: dict) -> tuple[int, ...]:
        """A grid bundle's point for ``feeds``: per axis, the size every input carrying it gives (they must agree);
        outside an axis's range, an error naming the input, the axis and the range."""
        point = []
        for a in self.axes:
            found: dict[str, int] = {}
            for name, dim in a["inputs"].items():
                if name not in feeds:
                    continue
                shape = getattr(feeds[name], "shape", None)
                if shape is None:
                    shape = np.asarray(feeds[name]).shape
                if len(shape) <= dim:
                    raise ParastreamError(f"input {name!r} has shape {list(shape)}; it carries axis {a['name']!r} as "
                                          f"dimension {dim} ({a['min']}..{a['max']})")
                found[name] = int(shape[dim])
                self._check_size(a, found[name], f"input {name!r} dimension {dim} (axis {a['name']!r})")
            if not found:
                raise ParastreamError(f"missing input(s) {list(a['inputs'])}; the model takes {[t.name for t in self.input_specs]}")
            if len(set(found.values())) > 1:
                raise ParastreamError(f"inputs disagree on axis {a['name']!r}: {found}")
            point.append(next(iter(found.values())))
        return tuple(point)

    def _call_grid(self, feeds: dict) -> dict:
        point = self.point_of(feeds)
        key = self.bucket_for(point)
        la = self.launchers[key]
        parts = self.leading_parts(feeds, point, key) if point != key else None
        if parts is not None:  # device feeds written into the bucket's buffers, the pad after them
            out = la.run_padded(feeds, {n: shape for n, (shape, _) in parts.items()}, self._fills(key, parts))
            return self.cut_to_point(out, point, key)
        return self.cut_to_point(la(self.pad_to_bucket(feeds, point, key)), point, key)

    def leading_parts(self, feeds: dict, point: tuple, key: tuple) -> dict[str, tuple] | None:
        """Per input of ``feeds`` (at ``point``) smaller than bucket ``key``'s, (its shape, its pad value), where a
        GPU bucket can take the feeds as they are (``GpuLauncher.run_padded``): C-contiguous device arrays, each
        smaller along one axis only (its rows are then the first bytes of the bucket input's rows, and the pad
        the rest of each), padded with a number.  None where any is not (host arrays, arrays that are strided or
        offer DLPack alone, two axes padded at once, a pad that repeats or counts on): the call pads them as
        tensors (``pad_to_bucket``)."""
        if self.device != "cuda" or not all(_c_contiguous_on_device(x) for x in feeds.values()):
            return None
        parts: dict[str, tuple] = {}
        for spec in self.launchers[key].plan.inputs:
            shape = list(spec.shape)
            padded = []
            for a, size, bsize in zip(self.axes, point, key):
                dim = a["inputs"].get(spec.name)
                if dim is not None and size != bsize:
                    shape[dim] = size
                    padded.append((dim, a["pad"][spec.name]))
            if not padded:
                continue
            if len(padded) > 1 or spec.dtype == "bfloat16":
                return None
            dim, how = padded[0]
            if isinstance(how, (str, bool)) or not isinstance(how, (int, float)):
                return None
            parts[spec.name] = (tuple(shape), how)
        return parts

    def _fills(self, key: tuple, parts: dict[str, tuple]) -> dict[str, int]:
        """Per input of ``parts``, a device buffer of bucket ``key``'s whole input holding its pad value, made at
        the first call that needs it and kept until ``close``."""
        la = self.launchers[key]
        out = {}
        for spec in la.plan.inputs:
            if spec.name in parts:
                ptr = self._fill_buffers.get((key, spec.name))
                if ptr is None:
                    ptr = self._fill_buffers[(key, spec.name)] = _device_full(la, spec, parts[spec.name][1])
                out[spec.name] = ptr
        return out

    def pad_to_bucket(self, feeds: dict, point: tuple, key: tuple) -> dict:
        """A grid call's first step: ``feeds`` (at ``point``) padded along each axis to bucket ``key``'s size."""
        padded = dict(feeds)
        for a, size, bsize in zip(self.axes, point, key):
            if size != bsize:
                for name, dim in a["inputs"].items():
                    if name in padded:
                        padded[name] = pad_axis(padded[name], dim, bsize, a["pad"][name])
        return padded

    def cut_to_point(self, outs: dict, point: tuple, key: tuple) -> dict:
        """A grid call's last step: bucket ``key``'s outputs cut back to ``point`` on the dimensions carrying each
        axis."""
        for a, size, bsize in zip(self.axes, point, key):
            if size != bsize:
                for name, dims in (a.get("outputs") or {}).items():
                    if name in outs:
                        for dim in dims:
                            outs[name] = cut_axis(outs[name], dim, size)
        return outs

    def __call__(self, feeds: dict) -> dict:
        """Run ``feeds`` of batch n on the smallest bucket >= n; outputs with a batch dimension have n rows.
        A grid bundle: each axis on its smallest bucket that holds the feeds' size, padded as the build proved
        harmless, outputs cut back on the dimensions that carry the axis."""
        if self.grid:
            return self._call_grid(feeds)
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
        if self._fill_buffers:
            from . import cuda

            for ptr in self._fill_buffers.values():
                cuda.free(ptr)
            self._fill_buffers = {}
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
