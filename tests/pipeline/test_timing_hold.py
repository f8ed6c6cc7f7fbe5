"""Timed blocks queued whole behind a closed gate (pipeline.bench.measure's ``hold``), with the CUDA calls recorded
by stand-ins: what is held, in which order, and what happens where the driver has no stream memory operations.
The gate itself (``cuda.StreamGate``) is tested on the GPU in tests/launcher/test_gpu_launcher.py."""

from types import SimpleNamespace

import pytest

from parastream.launcher import cuda
from parastream.pipeline import bench


class _Calls:
    def __init__(self):
        self.log = []


@pytest.fixture
def calls(monkeypatch):
    c = _Calls()
    ids = iter(range(1, 10**6))
    monkeypatch.setattr(cuda, "device_copy", lambda arr, stream, dtype=None: next(ids))
    monkeypatch.setattr(cuda, "free", lambda ptr: None)
    monkeypatch.setattr(cuda, "memcpy_dtod_async", lambda dst, src, n, stream: c.log.append(("copy", stream)))
    monkeypatch.setattr(cuda, "event_create", lambda timing=False: next(ids))
    monkeypatch.setattr(cuda, "event_destroy", lambda e: None)
    monkeypatch.setattr(cuda, "event_record", lambda e, stream: None)
    monkeypatch.setattr(cuda, "event_elapsed_ms", lambda s, e: 1.0)

    class Gate:
        fail = False
        opened_by_timer = 0

        def close(self, stream):
            if Gate.fail:
                raise cuda.CudaError("cuStreamWaitValue32 failed: CUDA_ERROR_NOT_SUPPORTED")
            c.log.append(("close", stream))

        def open(self):
            c.log.append(("open",))

        def free(self):
            c.log.append(("free",))

    c.Gate = Gate
    monkeypatch.setattr(cuda, "StreamGate", Gate)
    return c


class _Launcher:
    def __init__(self, calls, name, captured=True):
        self.calls, self.origin, self.captured = calls, name, captured
        self.plan = SimpleNamespace(inputs=[SimpleNamespace(name="x", shape=(1, 4), dtype="float32")])
        self.addr = {"x": 99}

    def launch(self):
        self.calls.log.append(("launch", self.origin))

    def synchronize(self):
        self.calls.log.append(("sync", self.origin))


def _blocks(log, launchers: int):
    """The timed blocks of the log, each ending at its sync (the warm-up ends with one sync per launcher)."""
    syncs = [i for i, e in enumerate(log) if e[0] == "sync"]
    out, cur = [], []
    for e in log[syncs[launchers - 1] + 1:]:
        cur.append(e)
        if e[0] == "sync":
            out.append(cur)
            cur = []
    return out


def test_each_block_of_a_captured_launcher_is_queued_whole_before_the_gate_opens(calls):
    la, lb = _Launcher(calls, "a"), _Launcher(calls, "b")
    info = {}
    times = bench._measure({"a": la, "b": lb}, runs=30, warmup=2, seed=0, info=info)
    assert set(times) == {"a", "b"} and len(times["a"]) == 30
    blocks = _blocks(calls.log, 2)
    assert len(blocks) == 4  # 30 runs in blocks of 25 and 5, for each launcher in turn
    for block, (stream, n) in zip(blocks, [("a", 25), ("b", 25), ("a", 5), ("b", 5)]):
        assert block[0] == ("close", stream)
        assert block[-2:] == [("open",), ("sync", stream)]
        assert [e for e in block if e[0] == "launch"] == [("launch", stream)] * n
    assert info == {"blocks": 4, "held": 4, "opened_by_timer": 0}
    assert calls.log[-1] == ("free",)


def test_unheld_when_asked_and_for_a_launcher_that_enqueues_engine_by_engine(calls):
    la, lb = _Launcher(calls, "a"), _Launcher(calls, "b", captured=False)
    info = {}
    bench._measure({"a": la, "b": lb}, runs=25, warmup=1, seed=0, info=info)
    blocks = _blocks(calls.log, 2)
    assert blocks[0][0] == ("close", "a") and all(e[0] != "close" for e in blocks[1])
    assert info["held"] == 1 and info["blocks"] == 2

    calls.log.clear()
    info = {}
    bench._measure({"a": _Launcher(calls, "a")}, runs=25, warmup=1, seed=0, hold=False, info=info)
    assert not any(e[0] in ("close", "open", "free") for e in calls.log)
    assert info == {"blocks": 1, "held": 0}


def test_a_driver_without_stream_memory_operations_times_the_blocks_as_queued(calls):
    calls.Gate.fail = True
    info = {}
    times = bench._measure({"a": _Launcher(calls, "a")}, runs=50, warmup=1, seed=0, info=info)
    assert len(times["a"]) == 50
    assert info["held"] == 0 and "CUDA_ERROR_NOT_SUPPORTED" in info["hold_error"]
    assert sum(e[0] == "launch" for e in calls.log) == 51  # every replay still ran


def test_the_switch_interval_is_restored_after_overlapping_timings():
    import sys
    import threading

    before = sys.getswitchinterval()
    inside, go = threading.Event(), threading.Event()

    def other():
        with bench._gil_handed_back_promptly():
            inside.set()
            go.wait(10)

    t = threading.Thread(target=other)
    with bench._gil_handed_back_promptly():
        assert sys.getswitchinterval() == pytest.approx(1e-4)
        t.start()
        inside.wait(10)
    assert sys.getswitchinterval() == pytest.approx(1e-4)  # the other timing still runs
    go.set()
    t.join(10)
    assert sys.getswitchinterval() == pytest.approx(before)


def test_a_block_the_driver_could_not_hold_whole_makes_the_next_blocks_fit(calls, monkeypatch):
    """A replay that waits in the driver behind the closed gate (its queue full: the gate's timer opened it) makes
    the next rounds' blocks half as long as what was queued before it, for every launcher and for later timings
    on that GPU; the round it happened in keeps its length, so each launcher is timed as many times."""
    import time

    monkeypatch.setattr(bench, "_HELD_BLOCK", {})
    monkeypatch.setattr(bench, "STALLED_S", 0.06)  # a launch preempted on a loaded machine is not a stall

    class Stalling(_Launcher):
        stall_at = 10  # the 11th launch of a block waits in the driver until the gate's timer opens the gate

        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.in_block = 0

        def launch(self):
            if self.in_block == self.stall_at:
                time.sleep(0.2)
                calls.Gate.opened_by_timer += 1
            self.in_block += 1
            super().launch()

        def synchronize(self):
            self.in_block = 0
            super().synchronize()

    la, lb = Stalling(calls, "a"), _Launcher(calls, "b")
    info = {}
    times = bench._measure({"a": la, "b": lb}, runs=40, warmup=0, seed=0, info=info)
    assert len(times["a"]) == len(times["b"]) == 40
    blocks = _blocks(calls.log, 2)
    sizes = [sum(e[0] == "launch" for e in b) for b in blocks]
    assert sizes == [25, 25, 5, 5, 5, 5, 5, 5]  # 10 queued before the stall: blocks of 5 from the next round
    assert info["held_block"] == 5 and bench._HELD_BLOCK == {0: 5}

    calls.log.clear()
    bench._measure({"b": _Launcher(calls, "b")}, runs=10, warmup=0, seed=0)  # a later timing on that GPU
    assert [sum(e[0] == "launch" for e in b) for b in _blocks(calls.log, 1)] == [5, 5]


def test_blocks_that_fit_keep_their_length(calls, monkeypatch):
    monkeypatch.setattr(bench, "_HELD_BLOCK", {})
    info = {}
    bench._measure({"a": _Launcher(calls, "a")}, runs=50, warmup=0, seed=0, info=info)
    assert [sum(e[0] == "launch" for e in b) for b in _blocks(calls.log, 1)] == [25, 25]
    assert "held_block" not in info and bench._HELD_BLOCK == {}
