"""The GPU launcher's warm-up threads (``launcher.gpu._Warmer``), on the CPU with stand-in engines and a stand-in
CUDA runtime: each stream's engines are warmed, and for the warm-up launch and the capture launched, by one and
the same thread of the process, because torch keeps cuDNN's convolution plans per thread (a plan built in another
thread is built again by the launching one); the streams' threads keep the plan's cross-stream order."""

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


def test_each_stream_s_engines_are_warmed_in_load_order_by_a_thread_of_their_own():
    log: list = []
    w = gpu._Warmer(_launcher())
    engines = [_Engine(log, sleep=0.01) for _ in range(4)]
    for i, e in enumerate(engines):
        w.submit(SimpleNamespace(stream=i % 2), e)
    assert w.wait() >= 0.02
    got = w.run(lambda: threading.get_ident())
    w.close()
    assert sorted(entry[1] for entry in log) == sorted(id(e) for e in engines)  # each once
    by_stream = {h: [entry for entry in log if entry[2] == h] for h in ("handle:s0", "handle:s1")}
    assert [entry[1] for entry in by_stream["handle:s0"]] == [id(engines[0]), id(engines[2])]  # in load order
    assert [entry[1] for entry in by_stream["handle:s1"]] == [id(engines[1]), id(engines[3])]
    threads = {h: {entry[3] for entry in entries} for h, entries in by_stream.items()}
    assert threads["handle:s0"] == {got} and len(threads["handle:s1"]) == 1  # stream 0's thread also captures
    assert threads["handle:s0"] != threads["handle:s1"] and threading.get_ident() not in threads["handle:s1"] | {got}


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
    w.submit(SimpleNamespace(stream=0), _Engine(log, sleep=0.5))
    last = _Engine(log)
    w.submit(SimpleNamespace(stream=0), last)
    gate.set()
    with pytest.raises(RuntimeError, match="cuDNN said no"):
        w.wait()
    assert len(log) <= 2 and id(last) not in [e[1] for e in log]  # the last one never ran (the second may have begun)
    assert w.run(lambda: "still there") == "still there"  # the thread is the process's: it stays


def test_every_launcher_of_a_process_warms_each_stream_in_the_same_thread():
    """torch keeps cuDNN's plans per thread: a build's launchers (candidates, alternatives, verification) find
    the plans the earlier ones built for the same stream number (a one-stream plan's: stream 0's)."""
    idents: dict = {0: set(), 1: set()}
    for single in (False, True, False):
        log: list = []
        w = gpu._Warmer(_launcher(single_stream=single))
        for k in (0, 1):
            w.submit(SimpleNamespace(stream=k), _Engine(log))
        w.wait()
        for entry in log:
            idents[0 if single else int(entry[2][-1])].add(entry[3])
        idents[0].add(w.run(threading.get_ident))
        w.close()
    assert len(idents[0]) == 1 and len(idents[1]) == 1 and idents[0] != idents[1]
    assert threading.get_ident() not in idents[0] | idents[1]


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


# -- the warm-up launch and the capture, each stream's branches queued by its thread ---------------------------------
class _Runtime:
    """Stand-in for the CUDA calls ``GpuLauncher._launch_threaded`` makes: one log, in the order the calls are made,
    of (what, stream, event or branch, thread)."""

    def __init__(self):
        self.log: list = []
        self.lock = threading.Lock()

    def add(self, *entry):
        with self.lock:
            self.log.append((*entry, threading.get_ident()))

    def event_record(self, event, stream):
        self.add("record", stream, event)

    def stream_wait_event(self, stream, event):
        self.add("wait", stream, event)


class _Launched:
    def __init__(self, rt: _Runtime, bid: int, sleep: float = 0.0, fail: bool = False):
        self.rt, self.bid, self.sleep, self.fail = rt, bid, sleep, fail

    def enqueue(self, handle, addresses):
        time.sleep(self.sleep)
        if self.fail:
            raise RuntimeError(f"branch {self.bid} failed")
        self.rt.add("enqueue", handle, self.bid)


def _threaded_launcher(rt, branches, launch_order, *, sleeps=None, fail=None, elided=()):
    """What ``_launch_threaded`` reads of a GpuLauncher: ``branches`` as (stream, waits)."""
    plan = SimpleNamespace(branches=[SimpleNamespace(id=i, stream=s, waits=list(w)) for i, (s, w) in enumerate(branches)],
                           launch_order=list(launch_order))
    n_streams = 1 + max(s for s, _ in branches)
    recorders = sorted({w for _, ws in branches for w in ws})
    scopes: list = []

    import contextlib

    @contextlib.contextmanager
    def memory():
        rt.add("scope-in", None, None)
        scopes.append(threading.get_ident())
        yield
        rt.add("scope-out", None, None)

    la = SimpleNamespace(plan=plan, streams=[f"s{k}" for k in range(n_streams)], origin="origin", single_stream=False,
                         device=0, _fork="fork", _joins=[f"join{k}" for k in range(n_streams)],
                         _events={b: f"ev{b}" for b in recorders}, elided=set(elided), _branch_addrs=[{} for _ in branches],
                         _h=lambda s: s, _memory=memory,
                         engines=[_Launched(rt, i, (sleeps or {}).get(i, 0.0), i == fail) for i in range(len(branches))])
    return la, scopes


@pytest.fixture
def rt(monkeypatch):
    r = _Runtime()
    monkeypatch.setattr(gpu.cuda, "event_record", r.event_record)
    monkeypatch.setattr(gpu.cuda, "stream_wait_event", r.stream_wait_event)
    return r


# a two-cell, three-stream plan: 0 -> (1 on s1, 2 on s2) -> 3 (s0) waits on both; 4 (s1) waits on 3
_BRANCHES = [(0, []), (1, [0]), (2, [0]), (0, [1, 2]), (1, [3]), (2, [])]
_ORDER = [0, 1, 2, 5, 3, 4]


def test_each_stream_s_branches_are_queued_by_the_thread_that_warmed_them_in_the_plan_s_order(rt):
    # stream 0's thread is slow, so a thread that did not wait would queue its waits before the records they need
    la, scopes = _threaded_launcher(rt, _BRANCHES, _ORDER, sleeps={0: 0.05, 3: 0.05})
    w = gpu._Warmer(la)
    warmed = {}
    for b in la.plan.branches:
        w.submit(b, SimpleNamespace(warm=lambda h, b=b: warmed.setdefault(b.stream, set()).add(threading.get_ident())))
    w.wait()
    w.run(lambda: gpu.GpuLauncher._launch_threaded(la, la.origin, w))
    w.close()
    log = rt.log
    enq = {e[2]: e for e in log if e[0] == "enqueue"}
    assert sorted(enq) == list(range(len(_BRANCHES)))
    for bid, (stream, waits) in enumerate(_BRANCHES):
        assert enq[bid][1] == f"s{stream}" and {enq[bid][3]} == warmed[stream]  # its stream, by its stream's thread
        at = log.index(enq[bid])
        for wt in waits:  # every wait queued before the branch, after the record it waits for
            rec = log.index(("record", f"s{_BRANCHES[wt][0]}", f"ev{wt}", enq[wt][3]))
            wait = next(i for i, e in enumerate(log) if e[:3] == ("wait", f"s{stream}", f"ev{wt}"))
            assert rec < wait < at
    for k in range(3):  # within a stream, the plan's order
        mine = [e[2] for e in log if e[0] == "enqueue" and e[1] == f"s{k}"]
        assert mine == [b for b in _ORDER if _BRANCHES[b][0] == k]
    # the fork before everything, the joins after; every thread in the memory scope, none out before all are done
    assert log[0][:3] == ("record", "origin", "fork")
    assert [e[:3] for e in log[-6:]] == [x for k in range(3) for x in (("record", f"s{k}", f"join{k}"), ("wait", "origin", f"join{k}"))]
    assert len(set(scopes)) == 3
    outs = [i for i, e in enumerate(log) if e[0] == "scope-out"]
    last_work = max(i for i, e in enumerate(log) if e[0] in ("enqueue", "wait", "record") and not str(e[2]).startswith("join"))
    assert len(outs) == 3 and min(outs) > last_work


def test_a_branch_that_fails_in_one_stream_s_thread_is_raised_and_the_other_threads_stop(rt):
    la, _ = _threaded_launcher(rt, _BRANCHES, _ORDER, fail=1)  # stream 1's first branch: 3 and 4 wait on it
    w = gpu._Warmer(la)
    with pytest.raises(RuntimeError, match="branch 1 failed"):
        w.run(lambda: gpu.GpuLauncher._launch_threaded(la, la.origin, w))
    w.close()
    assert not any(e[0] == "enqueue" and e[2] in (3, 4) for e in rt.log)  # nothing queued after a lost record
    # the threads are free again: the next launch of a good plan goes through
    la2, _ = _threaded_launcher(rt, _BRANCHES, _ORDER)
    w2 = gpu._Warmer(la2)
    w2.run(lambda: gpu.GpuLauncher._launch_threaded(la2, la2.origin, w2))
    w2.close()


def test_a_nested_launcher_s_warmer_does_not_launch_in_threads():
    """A launcher made inside a warm-up thread warms and launches there (``parallel`` false: the launcher queues
    its plan from one thread), never waiting for a thread that may be waiting for it."""
    outer = gpu._Warmer(_launcher())
    assert outer.parallel
    assert outer.run(lambda: gpu._Warmer(_launcher()).parallel) is False
    assert gpu._Warmer(_launcher(single_stream=True)).parallel is False
