"""A grid bundle's call between buckets with device feeds: the feeds written into the bucket's input buffers and
the pad after them (``BucketedLauncher.leading_parts``, ``GpuLauncher.run_padded``), outputs cut as views.

On the CPU: the CUDA runtime calls these paths make (malloc, the copies, the pinned staging) act on a simulated
device memory, a numpy byte array, and the bucket's "graph" is a function of its input buffers; so the bytes a
bucket reads are checked against the input padded as ``pad_to_bucket`` pads it, and the cut output against the
padded run's real positions."""

from __future__ import annotations

import contextlib
import types

import numpy as np
import pytest

from parastream.launcher import buckets, cuda
from parastream.launcher.buckets import BucketedLauncher, cut_axis
from parastream.launcher.cuda import DeviceArray
from parastream.launcher.gpu import GpuLauncher
from parastream.launcher.plan import TensorSpec

BASE = 1 << 20  # simulated device addresses start here


class FakeDevice:
    """Device and pinned host memory as one byte array; pointers are BASE + offset."""

    def __init__(self, nbytes: int = 1 << 16):
        self.mem = np.zeros(nbytes, np.uint8)
        self.top = 0
        self.freed: list[int] = []
        self.copies = 0

    def malloc(self, n: int) -> int:
        ptr = BASE + self.top
        self.top += (n + 255) // 256 * 256
        assert self.top <= len(self.mem), "simulated device memory exhausted"
        return ptr

    def view(self, ptr: int, shape, dtype) -> np.ndarray:
        n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        return self.mem[ptr - BASE:ptr - BASE + n].view(np.dtype(dtype)).reshape(shape)

    def copy(self, dst: int, src: int, n: int, stream=None) -> None:
        self.copies += 1
        self.mem[dst - BASE:dst - BASE + n] = self.mem[src - BASE:src - BASE + n]

    def copy2d(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int, stream=None) -> None:
        assert width <= dpitch and width <= spitch, "cudaMemcpy2D: a row wider than its pitch"
        self.copies += 1
        for r in range(height):
            self.mem[dst - BASE + r * dpitch:dst - BASE + r * dpitch + width] = \
                self.mem[src - BASE + r * spitch:src - BASE + r * spitch + width]

    def array(self, values: np.ndarray):
        """A device array (CUDA array interface) holding ``values``."""
        ptr = self.malloc(values.nbytes)
        self.view(ptr, values.shape, values.dtype)[...] = values
        return types.SimpleNamespace(shape=values.shape, dtype=values.dtype,
                                     __cuda_array_interface__={"shape": values.shape, "typestr": values.dtype.str,
                                                               "data": (ptr, False), "version": 3, "strides": None})


@pytest.fixture
def dev(monkeypatch):
    d = FakeDevice()
    for name, fn in {"malloc": d.malloc, "malloc_host": d.malloc, "free": d.freed.append, "free_host": lambda p: None,
                     "host_array": d.view, "memcpy_htod_async": d.copy, "memcpy_dtod_async": d.copy, "memcpy2d_dtod_async": d.copy2d,
                     "stream_synchronize": lambda s: None, "event_record": lambda e, s: None,
                     "stream_wait_event": lambda s, e: None, "pointer_device": lambda p: 0,
                     "on_device": lambda n: contextlib.nullcontext()}.items():
        monkeypatch.setattr(cuda, name, fn)
    return d


def _bucket(d: FakeDevice, seq: int, batch: int = 1) -> GpuLauncher:
    """A GpuLauncher of one bucket (inputs ids and mask [batch, seq], int64), its replay: out[b, t] = 10 * ids +
    mask at every position, so that what the graph read at the pad positions shows in the output."""
    la = object.__new__(GpuLauncher)
    ins = [TensorSpec("ids", "int64", [batch, seq]), TensorSpec("mask", "int64", [batch, seq])]
    out = TensorSpec("out", "int64", [batch, seq])
    la.plan = types.SimpleNamespace(inputs=ins, outputs=[out])
    la.addr = {t.name: d.malloc(8 * batch * seq) for t in [*ins, out]}
    la.device = la.arena_device = 0
    la.origin, la._producer_event, la._closed = "origin", "event", False
    la.launches = 0

    def launch(stream=None):
        la.launches += 1
        ids, mask = (d.view(la.addr[n], (batch, seq), np.int64) for n in ("ids", "mask"))
        d.view(la.addr["out"], (batch, seq), np.int64)[...] = 10 * ids + mask

    la.launch, la.synchronize, la.close = launch, (lambda: None), (lambda: None)
    return la


def _grid(d: FakeDevice, pads: dict, batch: int = 1) -> BucketedLauncher:
    bl = object.__new__(BucketedLauncher)
    bl.grid, bl.device, bl._fill_buffers, bl.shared = True, "cuda", {}, None
    bl.axes = [{"name": "seq", "min": 1, "max": 8, "sizes": [4, 8], "inputs": {"ids": 1, "mask": 1},
                "outputs": {"out": [1]}, "pad": pads}]
    bl.launchers = {(4,): _bucket(d, 4, batch), (8,): _bucket(d, 8, batch)}
    return bl


def test_device_feeds_between_buckets_run_on_the_bucket_buffers_padded(dev):
    bl = _grid(dev, {"ids": 0, "mask": 0})
    ids, mask = np.array([[7, 3, 9, 4, 5]], np.int64), np.ones((1, 5), np.int64)
    # what the bucket's buffers held before: must not show through at the pad positions
    la8 = bl.launchers[(8,)]
    for name in ("ids", "mask"):
        dev.view(la8.addr[name], (1, 8), np.int64)[...] = 99
    for _ in range(2):  # the second call reuses the pad buffers made by the first
        out = bl({"ids": dev.array(ids), "mask": dev.array(mask)})["out"]
        assert isinstance(out, DeviceArray) and out.shape == (1, 5) and out.ptr == la8.addr["out"]  # a view, no copy
        np.testing.assert_array_equal(dev.view(out.ptr, out.shape, np.int64), 10 * ids + mask)
        padded = {n: np.pad(v, ((0, 0), (0, 3))) for n, v in {"ids": ids, "mask": mask}.items()}
        for name, want in padded.items():  # what the graph read: the feed, then the pad value
            np.testing.assert_array_equal(dev.view(la8.addr[name], (1, 8), np.int64), want)
    assert la8.launches == 2 and len(bl._fill_buffers) == 2
    bl.close()
    assert len(dev.freed) == 2 and bl._fill_buffers == {}


def test_a_pad_value_other_than_zero(dev):
    bl = _grid(dev, {"ids": 5, "mask": 0})
    ids = np.array([[1, 2, 3]], np.int64)
    bl({"ids": dev.array(ids), "mask": dev.array(np.ones((1, 3), np.int64))})
    np.testing.assert_array_equal(dev.view(bl.launchers[(4,)].addr["ids"], (1, 4), np.int64), [[1, 2, 3, 5]])


def test_a_batch_of_sequences_between_buckets_is_copied_row_by_row_into_the_bucket_buffers(dev, monkeypatch):
    """Batch 3 at sequence 5 in the 8 bucket: each sequence goes to the start of its row of the bucket's buffer
    and the pad fills the rest of every row (one 2-D copy for the feed and one for the pad, per input); the
    graph reads exactly what ``pad_to_bucket`` would have made."""
    bl = _grid(dev, {"ids": 0, "mask": 0}, batch=3)
    monkeypatch.setattr(buckets, "cut_axis", lambda x, dim, size: dev.view(x.ptr, x.shape, np.int64)[:, :size])
    ids = np.arange(15, dtype=np.int64).reshape(3, 5) + 1
    mask = np.ones((3, 5), np.int64)
    la8 = bl.launchers[(8,)]
    for name in ("ids", "mask"):
        dev.view(la8.addr[name], (3, 8), np.int64)[...] = 99
    feeds = {"ids": dev.array(ids), "mask": dev.array(mask)}
    assert bl.leading_parts(feeds, (5,), (8,)) == {"ids": ((3, 5), 0), "mask": ((3, 5), 0)}
    before = dev.copies
    out = bl(feeds)["out"]
    assert dev.copies - before == 4 + 2  # two 2-D copies per input (and the two pad buffers made once)
    np.testing.assert_array_equal(out, 10 * ids + mask)
    for name, v in {"ids": ids, "mask": mask}.items():
        np.testing.assert_array_equal(dev.view(la8.addr[name], (3, 8), np.int64), np.pad(v, ((0, 0), (0, 3))))


@pytest.mark.parametrize("case", ["host feeds", "not contiguous", "a pad that counts on", "on a bucket"])
def test_leading_parts_only_where_the_feed_is_the_start_of_the_bucket_input(dev, case):
    """The tensor path stays where the feed's rows are not the first bytes of the bucket input's rows or the pad
    is not one value: host arrays, a strided device array, position ids that count on, an exact bucket."""
    bl = _grid(dev, {"ids": "continue" if case == "a pad that counts on" else 0, "mask": 0})
    n = 4 if case == "on a bucket" else 5
    ids = np.arange(n, dtype=np.int64)[None]
    feeds = {"ids": ids, "mask": np.ones_like(ids)}
    if case != "host feeds":
        feeds = {k: dev.array(v) for k, v in feeds.items()}
    if case == "not contiguous":  # every other element of a longer buffer
        feeds["ids"].__cuda_array_interface__["strides"] = (80, 16)
    point = bl.point_of(feeds)
    key = bl.bucket_for(point)
    parts = bl.leading_parts(feeds, point, key) if point != key else None
    assert parts is None
    if case == "on a bucket":
        assert point == key


def test_a_device_array_cut_along_a_dimension_with_only_ones_before_it_is_a_view():
    x = DeviceArray(BASE, (1, 8, 4), "float16", "h", device=0)
    y = cut_axis(x, 1, 5)
    assert isinstance(y, DeviceArray) and y.ptr == x.ptr and y.shape == (1, 5, 4)
    assert cut_axis(x, 0, 1) is x
    z = DeviceArray(BASE, (2, 8), "float16", "h", device=0)
    assert cut_axis(z, 0, 1).shape == (1, 8) and cut_axis(z, 0, 1).ptr == z.ptr  # the batch axis, as before
    assert buckets.cut_axis.__doc__ and "1s before it" in buckets.cut_axis.__doc__
