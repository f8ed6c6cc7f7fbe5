"""The GPU launcher's warm-up thread (``launcher.gpu._Warmer``), on the CPU with stand-in engines: the engines'
first calls and the launcher's own warm-up launch and capture run in one and the same thread, because torch keeps
cuDNN's convolution plans per thread (a plan built in another thread is built again by the capturing one)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from parastream.launcher import gpu


class _Engine:
    def __init__(self, log: list, fail: bool = False, sleep: float = 0.0):
        self.log, self.fail, self.sleep = log, fail, sleep

    def warm(self, stream_handle=None):
        time.sleep(self.sleep)
        self.log.append(("warm", id(self), stream_handle, threading.get_ident()))
        if self.fail:
            raise RuntimeError("cuDNN said no")


def _launcher(single_stream: bool = False):
    return SimpleNamespace(origin="origin", streams=["s0", "s1"], single_stream=single_stream, device=0,
                           _h=lambda s: f"handle:{s}")


@pytest.fixture(autouse=True)
def _no_cuda(monkeypatch):
    monkeypatch.setattr(gpu.cuda, "set_device", lambda device: None)


def test_engines_are_warmed_on_their_streams_in_load_order_and_captured_by_the_same_thread():
    log: list = []
    w = gpu._Warmer(_launcher())
    engines = [_Engine(log, sleep=0.01) for _ in range(4)]
    for i, e in enumerate(engines):
        w.submit(SimpleNamespace(stream=i % 2), e)
    assert w.wait() >= 0.04
    got = w.run(lambda: threading.get_ident())
    w.close()
    assert [entry[1] for entry in log] == [id(e) for e in engines]  # each once, in load order
    assert [entry[2] for entry in log] == ["handle:s0", "handle:s1", "handle:s0", "handle:s1"]
    assert {entry[3] for entry in log} == {got} and got != threading.get_ident()


def test_a_single_stream_plan_warms_on_the_origin():
    log: list = []
    w = gpu._Warmer(_launcher(single_stream=True))
    w.submit(SimpleNamespace(stream=1), _Engine(log))
    w.wait()
    w.close()
    assert log[0][2] == "handle:origin"


def test_a_warm_up_error_is_raised_by_wait_and_the_warm_ups_not_begun_are_dropped():
    log: list = []
    w = gpu._Warmer(_launcher())
    gate = threading.Event()
    w.futures.append(w.pool.submit(gate.wait))  # holds the thread until the failing warm-up is queued
    w.submit(SimpleNamespace(stream=0), _Engine(log, fail=True))
    w.submit(SimpleNamespace(stream=1), _Engine(log, sleep=0.5))
    w.submit(SimpleNamespace(stream=0), _Engine(log))
    gate.set()
    with pytest.raises(RuntimeError, match="cuDNN said no"):
        w.wait()
    assert len(log) <= 2  # the last one never ran (the second may have begun)
    assert w.run(lambda: "still there") == "still there"  # the thread is the process's: it stays


def test_every_launcher_of_a_process_warms_and_captures_in_the_same_thread():
    """torch keeps cuDNN's plans per thread: a build's launchers (candidates, alternatives, verification) find
    the plans the earlier ones built."""
    idents = set()
    for single in (False, True):
        log: list = []
        w = gpu._Warmer(_launcher(single_stream=single))
        w.submit(SimpleNamespace(stream=0), _Engine(log))
        w.wait()
        idents |= {entry[3] for entry in log} | {w.run(threading.get_ident)}
        w.close()
    assert len(idents) == 1 and threading.get_ident() not in idents


def test_a_launcher_made_inside_the_warm_up_thread_warms_there_instead_of_waiting_for_itself():
    log: list = []

    def inner():
        w = gpu._Warmer(_launcher())
        w.submit(SimpleNamespace(stream=0), _Engine(log))
        w.wait()
        return w.run(threading.get_ident)

    outer = gpu._Warmer(_launcher())
    got = outer.run(inner)
    assert got == log[0][3] != threading.get_ident()


def test_an_error_of_the_capture_is_the_caller_s():
    w = gpu._Warmer(_launcher())

    def capture():
        raise ValueError("capture failed")

    with pytest.raises(ValueError, match="capture failed"):
        w.run(capture)
    w.close()
