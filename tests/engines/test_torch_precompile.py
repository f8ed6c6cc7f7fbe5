"""``precompile``: the compile jobs of several builds gathered into one batch, each distinct branch compiled once,
the later ``build_all`` calls cache hits; a branch Inductor could not compile is not tried again.  Inductor itself
is replaced by a counting stand-in (the real compile is tested in test_torch_inductor.py)."""

from __future__ import annotations

import hashlib
import threading
import time

import onnx

import pytest

pytest.importorskip("torch")

from parastream.launcher.engines import BuildOptions  # noqa: E402
from parastream.launcher.engines import torch as tb  # noqa: E402
from test_torch_aoti import IN, LAYOUT, OUT, branch  # noqa: E402

@pytest.fixture
def compiles(monkeypatch):
    """Inductor replaced by a stand-in that records what it compiles; branch(3) fails to compile."""
    calls = []

    def fake(br, inputs, outputs, device, dtype, nhwc, views, options):
        digest = hashlib.sha256(br.SerializeToString()).hexdigest()[:12]
        calls.append((digest, tuple(sorted(nhwc))))
        if br.graph.node[0].name == "bad":
            raise RuntimeError("Inductor cannot")
        return f"artifact {digest} {sorted(nhwc)}".encode(), {"params": [], "param_specs": []}

    monkeypatch.setattr(tb, "compile_inductor", fake)
    monkeypatch.setenv("PARASTREAM_COMPILE_WORKERS", "1")
    tb.clear_memory_cache()
    yield calls
    tb.clear_memory_cache()


def _bad():
    b = branch(3)
    b.graph.node[0].name = "bad"
    return b


def test_one_batch_compiles_each_distinct_branch_once_and_later_builds_hit(compiles):
    o3, o5 = BuildOptions(device="cpu"), BuildOptions(device="cpu", optimization_level=5)
    a = [(branch(1), "a0", LAYOUT), (branch(2), "a1", LAYOUT)]
    b = [(branch(1), "b0", LAYOUT), (branch(2), "b1", LAYOUT)]  # another plan sharing both branches
    c = [(branch(2), "c0", LAYOUT)]  # branch 2 again, with other options: another engine
    batches = [(o3, a), (o3, b), (o5, c)]
    got = tb.precompile([(tb.Builder(o), items) for o, items in batches])
    assert got["jobs"] == 3 and got["failed"] == 0 and len(compiles) == 3
    keys = set()
    for o, items in batches:
        builder = tb.Builder(o)
        datas = builder.build_all(items)
        assert len(compiles) == 3  # nothing compiled again
        assert all(r["cache"] == "memory" for r in builder.report().values())
        assert all(tb.unpack(d)[0]["compiled"] == "inductor" for d in datas)
        keys |= {tb.unpack(d)[0]["key"] for d in datas}
    assert len(keys) == 3


def test_a_branch_that_failed_in_the_batch_is_not_compiled_again_and_ships_its_onnx(compiles):
    got = tb.precompile([(tb.Builder(BuildOptions(device="cpu")), [(_bad(), "x0", LAYOUT), (branch(1), "x1", LAYOUT)])])
    assert got == {"jobs": 2, "failed": 1, "s": got["s"]}
    builder = tb.Builder(BuildOptions(device="cpu"))
    bad, good = builder.build_all([(_bad(), "x0", LAYOUT), (branch(1), "x1", LAYOUT)])
    assert len(compiles) == 2
    meta, _, package = tb.unpack(bad)
    assert package is None and meta["aot_error"].startswith("RuntimeError: Inductor cannot")
    assert builder.report()["x0"]["aot_error"] and tb.unpack(good)[2] is not None


def test_jit_builds_and_uncompiled_options_add_no_jobs(compiles, monkeypatch):
    items = [(branch(1), "a0", LAYOUT)]
    assert tb.precompile([(tb.Builder(BuildOptions(device="cpu", compile=False)), items)])["jobs"] == 0
    assert tb.precompile([(tb.Builder(BuildOptions(device="cpu", torch_artifact="jit")), items)])["jobs"] == 0
    assert compiles == []


def test_a_branch_converted_once_is_not_converted_again(compiles, monkeypatch):
    """``build_all`` converts each branch to check it; the same branch in a later build of this process is not."""
    from parastream.launcher.engines import onnx_torch

    real, n = onnx_torch.convert, []
    monkeypatch.setattr(onnx_torch, "convert", lambda *a, **k: n.append(1) or real(*a, **k))
    tb._CONVERTED.clear()
    for _ in range(2):
        tb.Builder(BuildOptions(device="cpu")).build_all([(branch(1), "a0", None), (branch(2), "a1", None)])
    assert len(n) == 2


def _gated_pool(compiles: list, monkeypatch):
    """(gate, pool): a one-thread pool standing in for the worker processes (so that the stand-in compiler works
    across it), whose first compile waits until ``gate`` is set."""
    from concurrent.futures import ThreadPoolExecutor

    gate, pool = threading.Event(), ThreadPoolExecutor(1)
    fake = tb.compile_inductor

    def gated(br, *a, **k):
        if not compiles:
            gate.wait(30)
        return fake(br, *a, **k)

    monkeypatch.setattr(tb, "compile_inductor", gated)
    monkeypatch.setattr(tb, "_pool", lambda n: pool)
    return gate, pool


def test_background_compiles_are_waited_for_and_the_cancelled_ones_compiled_when_needed(compiles, monkeypatch):
    """``background=True`` queues the jobs and returns; a ``build_all`` that needs a branch still compiling waits
    for it (no second compile); ``cancel_precompile()`` drops the queued cancellable jobs, which a later
    ``build_all`` then compiles itself; the non-cancellable ones stay.  (A one-thread pool stands in for the
    worker processes, so that the stand-in compiler and a gate on its first job work across it.)"""
    gate, pool = _gated_pool(compiles, monkeypatch)
    monkeypatch.setenv("PARASTREAM_COMPILE_WORKERS", "2")
    o3, o5 = BuildOptions(device="cpu"), BuildOptions(device="cpu", optimization_level=5)
    first = tb.precompile([(tb.Builder(o3), [(branch(1), "a", LAYOUT)])], background=True)
    queued = tb.precompile([(tb.Builder(o5), [(branch(2), "b", LAYOUT)])], background=True)
    kept = tb.precompile([(tb.Builder(o5), [(branch(4), "c", LAYOUT)])], background=True, cancellable=False)
    again = tb.precompile([(tb.Builder(o3), [(branch(1), "a", LAYOUT)])], background=True)
    assert first["jobs"] == queued["jobs"] == kept["jobs"] == 1 and again["jobs"] == 0  # in flight: not queued twice
    assert tb.cancel_precompile() == 1  # the queued cancellable one; the running and the kept ones stay
    gate.set()
    builder = tb.Builder(o3)
    builder.build_all([(branch(1), "a", LAYOUT)])
    assert builder.report()["a"]["cache"].startswith("memory")
    tb.Builder(o5).build_all([(branch(4), "c", LAYOUT)])
    assert len(compiles) == 2  # branch 1 once (waited for), branch 4 once (kept)
    monkeypatch.setenv("PARASTREAM_COMPILE_WORKERS", "1")
    builder = tb.Builder(o5)
    builder.build_all([(branch(2), "b", LAYOUT)])  # cancelled: compiled now
    assert len(compiles) == 3 and builder.report()["b"]["cache"] == "miss"
    assert not tb._INFLIGHT
    pool.shutdown()


def test_background_precompile_with_one_worker_compiles_nothing_ahead(compiles):
    got = tb.precompile([(tb.Builder(BuildOptions(device="cpu")), [(branch(1), "a", LAYOUT)])], background=True)
    assert got["jobs"] == 0 and compiles == []


@pytest.mark.parametrize("value", ["many", "0", "-2", "1.5"])
def test_a_bad_compile_worker_count_is_one_error_naming_the_variable(monkeypatch, value):
    from parastream.launcher.errors import ParastreamError

    monkeypatch.setenv("PARASTREAM_COMPILE_WORKERS", value)
    with pytest.raises(ParastreamError, match=r"PARASTREAM_COMPILE_WORKERS=.*whole number"):
        tb.compile_workers()
    monkeypatch.setenv("PARASTREAM_COMPILE_WORKERS", "3")
    assert tb.compile_workers() == 3


def test_the_compile_workers_are_a_build_option_the_variable_overrides(monkeypatch):
    """``BuildOptions.compile_workers`` (``--compile-workers``) sets the count, 0 the default; the variable overrides it."""
    monkeypatch.delenv("PARASTREAM_COMPILE_WORKERS", raising=False)
    assert tb.compile_workers(BuildOptions(compile_workers=5)) == 5
    assert tb.compile_workers(BuildOptions()) == tb.compile_workers() >= 1
    monkeypatch.setenv("PARASTREAM_COMPILE_WORKERS", "2")
    assert tb.compile_workers(BuildOptions(compile_workers=5)) == 2


def test_the_artifact_and_its_format_are_build_options_refused_by_name():
    """What a torch engine ships is ``BuildOptions.torch_artifact``/``inductor_format``; a bad one names the option."""
    from parastream.launcher.errors import ParastreamError

    with pytest.raises(ParastreamError, match="--torch-artifact tensorrt: the torch backend ships inductor, aoti, jit"):
        tb.Builder(BuildOptions(device="cpu", torch_artifact="tensorrt"))
    with pytest.raises(ParastreamError, match="--inductor-format zip: give one of kernels, bundled, cache"):
        tb.Builder(BuildOptions(device="cpu", inductor_format="zip"))
    assert tb.Builder(BuildOptions(device="cpu", torch_artifact="aoti")).artifact == "aoti"


def test_the_same_branch_under_another_name_gives_the_same_engine_packed_once(compiles, monkeypatch):
    """The search's candidates renumber their branches: an engine's branch.onnx holds the branch without its graph
    name, so the same branch gives the same engine file, which a process packs once (``_PACKED``)."""
    packs = []
    real = tb.pack
    monkeypatch.setattr(tb, "pack", lambda *a, **k: packs.append(1) or real(*a, **k))
    renamed = branch(1)
    renamed.graph.name = "net_branch_042"
    first, = tb.Builder(BuildOptions(device="cpu")).build_all([(branch(1), "a0", LAYOUT)])
    again, = tb.Builder(BuildOptions(device="cpu")).build_all([(renamed, "b7", LAYOUT)])
    assert first == again and len(packs) == 1 and len(compiles) == 1
    assert onnx.load_from_string(tb.unpack(first)[1]).graph.name == ""
    other, = tb.Builder(BuildOptions(device="cpu")).build_all([(branch(2), "a1", LAYOUT)])
    assert other != first and len(packs) == 2
    tb.clear_memory_cache()  # a packed engine goes with the compiled-branch cache
    tb.Builder(BuildOptions(device="cpu")).build_all([(branch(1), "a0", LAYOUT)])
    assert len(packs) == 3


def test_a_branch_object_is_serialized_and_hashed_once(compiles, monkeypatch):
    """The build hands the same extracted branches to its compile batch and to its engine writes: one serialization
    of each; an equal branch in another object is serialized again (and gives the same engine)."""
    n = []
    real = tb._anonymous_bytes
    monkeypatch.setattr(tb, "_anonymous_bytes", lambda b: n.append(1) or real(b))
    b1 = branch(1)
    tb.precompile([(tb.Builder(BuildOptions(device="cpu")), [(b1, "a0", LAYOUT)])])
    first, = tb.Builder(BuildOptions(device="cpu")).build_all([(b1, "a0", LAYOUT)])
    assert len(n) == 1
    again, = tb.Builder(BuildOptions(device="cpu")).build_all([(branch(1), "a0", LAYOUT)])
    assert len(n) == 2 and again == first


def test_background_compiles_run_the_search_s_candidates_before_what_is_needed_later(compiles, monkeypatch):
    """Queued groups go to the workers the most urgent first: the search's candidates (cancellable) before the
    build's alternatives (kept, needed only after the search), and a group somebody waits for before both."""
    gate, pool = _gated_pool(compiles, monkeypatch)
    monkeypatch.setenv("PARASTREAM_COMPILE_WORKERS", "2")  # two groups in the pool at a time, the rest queued
    o = BuildOptions(device="cpu")

    def queue(seed: int, cancellable: bool):
        tb.precompile([(tb.Builder(o), [(branch(seed), f"s{seed}", LAYOUT)])], background=True, cancellable=cancellable)

    queue(1, True)  # running (held at the gate)
    queue(2, False)  # in the pool, behind it
    queue(4, False)  # queued: an alternative
    queue(5, True)  # queued: a candidate, goes before it
    queue(6, False)  # queued: waited for below, goes before both
    digest = {s: hashlib.sha256(tb._anonymous_bytes(branch(s))).hexdigest()[:12] for s in (1, 2, 4, 5, 6)}
    waiter = threading.Thread(target=lambda: tb.Builder(o).build_all([(branch(6), "w", LAYOUT)]))
    waiter.start()
    deadline = time.monotonic() + 30
    while not any(j.priority == -1 for j in list(tb._QUEUED)) and time.monotonic() < deadline:
        time.sleep(0.01)  # until the waiter has asked for branch 6
    gate.set()
    waiter.join(30)
    while tb._INFLIGHT and time.monotonic() < deadline:
        time.sleep(0.01)
    order = [d for d, _ in compiles]
    assert order == [digest[s] for s in (1, 2, 6, 5, 4)], order
    pool.shutdown()


def test_the_longest_group_needed_after_the_search_starts_at_once(monkeypatch):
    """Of a batch needed only after the search (kept), the longest group goes before everything queued; the rest of
    it after the search's candidates.  (Nothing is handed to workers here: ``_pump`` is held.)"""
    monkeypatch.setattr(tb, "_pump", lambda: None)
    monkeypatch.setattr(tb, "_QUEUED", [])
    monkeypatch.setattr(tb, "_INFLIGHT", {})
    small, big = branch(1), branch(2)
    big.graph.node.extend([onnx.helper.make_node("Identity", ["y"], [f"y{i}"]) for i in range(5)])
    todo = {"s": ("inductor", small.SerializeToString()), "b": ("inductor", big.SerializeToString()),
            "c": ("inductor", small.SerializeToString())}
    tb._submit({"c": todo["c"]}, {"gc": ["c"]}, None, cancellable=True)
    tb._submit(todo, {"gs": ["s"], "gb": ["b"]}, None, cancellable=False)
    tb._QUEUED.sort(key=lambda j: (j.priority, j.seq))
    assert [j.keys for j in tb._QUEUED] == [["b"], ["c"], ["s"]]
    # one group alone, kept, goes behind the candidates; order "now", before everything queued but an earlier such
    # group; order "search", with the candidates in the order queued
    tb._submit({"l": todo["s"]}, {"gl": ["l"]}, None, cancellable=False)
    tb._submit({"u": todo["s"]}, {"gu": ["u"]}, None, cancellable=False, order="now")
    tb._submit({"w": todo["s"]}, {"gw": ["w"]}, None, cancellable=False, order="search")
    tb._QUEUED.sort(key=lambda j: (j.priority, j.seq))
    assert [j.keys for j in tb._QUEUED] == [["b"], ["u"], ["c"], ["w"], ["s"], ["l"]]
    assert tb.cancel_precompile() == 1 and ["w"] in [j.keys for j in tb._QUEUED]  # "search" is kept: not cancelled


def test_background_precompile_hands_on_each_batch_s_keys_and_what_is_still_compiling(compiles, monkeypatch):
    """``precompile(background=True)`` returns each batch's cache keys (the build times the input's alternatives
    once ``compiling(keys)`` is 0); ``background_summary`` then reports the groups compiled, the longest first."""
    gate, pool = _gated_pool(compiles, monkeypatch)
    monkeypatch.setenv("PARASTREAM_COMPILE_WORKERS", "2")
    o = BuildOptions(device="cpu")
    since = time.perf_counter()
    got = tb.precompile([(tb.Builder(o), [(branch(1), "a", LAYOUT)]),
                         (tb.Builder(o), [(branch(2), "b", LAYOUT), (branch(1), "c", LAYOUT)])], background=True,
                        label="the input")
    first, second = got["keys"]
    assert len(first) == 1 and len(second) == 2 and second[1] == first[0]  # the same branch: the same key
    assert tb.compiling(first) == 1 and tb.compiling(second) == 2
    again = tb.precompile([(tb.Builder(o), [(branch(2), "b", LAYOUT)])], background=True)
    assert again["jobs"] == 0 and again["keys"] == [[second[0]]]  # in flight: not queued again, its key handed on
    gate.set()
    deadline = time.monotonic() + 30
    while tb.compiling(second) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert tb.compiling(first + second) == 0 and len(compiles) == 2
    summary = tb.background_summary(since)
    groups = len({tb.structure_key(b, []) for b in (branch(1), branch(2))})  # one group per structure
    assert summary["groups"] == groups and summary["branches"] == 2 and summary["longest"]["s"] >= 0
    assert summary["last_done_s"] >= summary["longest"]["started_s"] >= 0
    by = summary["by_label"]["the input"]  # what they were queued for, with the workers' seconds
    assert by["groups"] == groups and by["branches"] == 2 and by["worker_s"] >= 0
    assert by["last_done_s"] == summary["last_done_s"] and by["first_started_s"] >= 0
    # few groups: each one's times, in the order they started (what a one-engine build's rounds waited for)
    timeline = summary["timeline"]
    assert len(timeline) == groups and all(g["label"] == "the input" and not g["spare"] for g in timeline)
    assert all(g["queued_s"] <= g["started_s"] <= g["done_s"] <= summary["last_done_s"] for g in timeline)
    assert [g["started_s"] for g in timeline] == sorted(g["started_s"] for g in timeline)
    monkeypatch.setattr(tb, "TIMELINE_GROUPS", groups - 1)
    assert "timeline" not in tb.background_summary(since)  # many groups: by label only
    assert tb.background_summary(time.perf_counter() + 1) == {"groups": 0}
    pool.shutdown()


def test_a_large_branch_compiles_its_kernels_in_inductor_s_own_pool(monkeypatch):
    """In a worker, a branch of ``LARGE_BRANCH_NODES`` nodes or more (a whole model as one engine) compiles with
    Inductor's compile threads; a small one, and any on the CPU, with one."""
    import torch._inductor.config as cfg

    seen = []
    monkeypatch.setattr(tb.os, "cpu_count", lambda: 16)
    monkeypatch.setattr(tb, "compile_inductor",
                        lambda br, *a: seen.append((len(br.graph.node), cfg.compile_threads)) or (b"x", {"params": []}))
    big = branch(2)
    big.graph.node.extend([onnx.helper.make_node("Identity", ["y"], [f"y{i}"]) for i in range(tb.LARGE_BRANCH_NODES)])

    def job(b, device):
        return ("inductor", b.SerializeToString(), [], [], device, "float16", set(), {}, BuildOptions(device=device))

    # Inductor's own patching, which restores the setting: pytest 9.2's monkeypatch deleted it from the config
    # module on undo (its value is not in the module's __dict__), and every later compile in the process failed
    with cfg.patch(compile_threads=1):
        tb._compile_job(job(branch(1), "cuda"))
        tb._compile_job(job(big, "cpu"))
        assert seen == [(len(branch(1).graph.node), 1), (len(big.graph.node), 1)]
        tb._compile_job(job(big, "cuda"))
    assert seen[-1] == (len(big.graph.node), 8) and tb.large_compile_threads() == 8
    assert hasattr(cfg, "compile_threads")
    monkeypatch.setattr(tb.os, "cpu_count", lambda: 2)
    assert tb.large_compile_threads() == 1


def test_compile_workers_start_before_the_first_batch_only_for_gpu_builds(monkeypatch):
    """``start_workers``: a GPU build's compile workers are spawned (one task each) while it loads the model; a CPU
    build, a jit build or one worker start nothing."""
    handed = []

    class Pool:
        def submit(self, fn):
            handed.append(fn)

    pool = Pool()
    monkeypatch.setattr(tb, "_pool", lambda n: pool)
    monkeypatch.setattr(tb, "_READY", [])
    monkeypatch.setenv("PARASTREAM_COMPILE_WORKERS", "3")
    tb.start_workers(BuildOptions(device="cpu"))
    tb.start_workers(BuildOptions(device="cuda", compile=False))
    assert handed == []
    tb.start_workers(BuildOptions(device="cuda"))
    tb.start_workers(BuildOptions(device="cuda"))  # started once
    assert handed == [tb._ready] * 3 and abs(tb._ready() - time.time()) < 1
    pool._parastream_started = False
    tb.start_workers(BuildOptions(device="cuda", torch_artifact="jit"))
    assert len(handed) == 3


def test_a_builder_waits_for_background_compiles_one_branch_at_a_time(compiles, monkeypatch):
    """``waits_for_background``: False with nothing compiling in the background or a branch left to compile, True
    while the items' branches compile in the background; ``build_all`` of one item then waits for that branch
    alone (what ``pipeline.build.Engines.launcher`` builds each engine with, as its launcher loads them), and no
    branch compiles twice."""
    gate, pool = _gated_pool(compiles, monkeypatch)
    monkeypatch.setenv("PARASTREAM_COMPILE_WORKERS", "2")
    o = BuildOptions(device="cpu")
    items = [(branch(1), "a", LAYOUT), (branch(2), "b", LAYOUT)]
    assert not tb.Builder(o).waits_for_background(items)  # nothing in the background
    tb.precompile([(tb.Builder(o), items[:1])], background=True, cancellable=False)
    assert not tb.Builder(o).waits_for_background(items)  # branch 2 is nobody's: build_all would compile it
    tb.precompile([(tb.Builder(o), items[1:])], background=True, cancellable=False)
    builder = tb.Builder(o)
    assert builder.waits_for_background(items)
    got = {}
    waiter = threading.Thread(target=lambda: got.update(a=builder.build_all(items[:1])[0]))
    waiter.start()
    time.sleep(0.2)
    assert not got and waiter.is_alive()  # branch 1's compile is held at the gate: its build waits for it
    gate.set()
    waiter.join(30)
    assert tb.unpack(got["a"])[0]["compiled"] == "inductor"
    assert tb.unpack(builder.build_all(items[1:])[0])[0]["compiled"] == "inductor"
    assert len(compiles) == 2  # each once, in the background
    assert not tb.Builder(o).waits_for_background(items)  # all compiled: nothing to wait for
    pool.shutdown()


def test_the_summary_says_when_the_started_workers_were_ready(monkeypatch):
    """``start_workers`` hands each worker a ``_ready`` task; ``background_summary`` gives when the first and the
    last were ready, in the build's seconds (threads stand in for the worker processes)."""
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(3)
    monkeypatch.setattr(tb, "_pool", lambda n: pool)
    monkeypatch.setattr(tb, "_READY", [])
    since = time.perf_counter()
    tb.start_workers(BuildOptions(device="cuda", compile_workers=3))
    for f in tb._READY:
        f.result(10)
    got = tb.background_summary(since)["workers_ready"]
    assert got["workers"] == 3 and 0 <= got["first_s"] <= got["last_s"] < 5
    tb.start_workers(BuildOptions(device="cpu", compile_workers=3))  # a CPU build starts none
    assert len(tb._READY) == 3
    pool.shutdown()


def _sleep(s):
    time.sleep(s)


def test_stop_workers_ends_the_worker_processes_without_waiting_for_their_task(monkeypatch):
    """A build whose model does not load ends the workers it started: a process pool ends its processes only when
    their task is done, and the process's exit would wait for that."""
    import multiprocessing
    import multiprocessing.connection
    from concurrent.futures import ProcessPoolExecutor

    pool = ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn"))
    monkeypatch.setattr(tb, "_POOL", {2: pool})
    # no compile of an earlier test's left in flight (a pool with work is left alone, as below); one of those
    # that ends meanwhile still counts itself off the running count patched here (to -1: not running)
    monkeypatch.setattr(tb, "_INFLIGHT", {})
    monkeypatch.setattr(tb, "_QUEUED", [])
    monkeypatch.setattr(tb, "_RUNNING", [0])
    tb._RUNNING[0] -= 1  # as such a late callback leaves it
    for _ in range(2):
        pool.submit(_sleep, 60)
    deadline = time.monotonic() + 60
    while len(pool._processes) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    processes = list(pool._processes.values())
    t0 = time.monotonic()
    tb.stop_workers()
    # ended: each process's sentinel ready (``is_alive`` may still say True where the pool's own thread reaped
    # the process first: its ``waitpid`` then fails with ECHILD and ``poll`` reads that as "not ended yet")
    sentinels = {p.sentinel for p in processes}
    while sentinels and time.monotonic() - t0 < 10:
        sentinels -= set(multiprocessing.connection.wait(list(sentinels), timeout=10 - (time.monotonic() - t0)))
    assert not sentinels and time.monotonic() - t0 < 10
    assert tb._POOL == {}
    busy = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    monkeypatch.setattr(tb, "_POOL", {1: busy})
    monkeypatch.setattr(tb, "_RUNNING", [1])  # a group of an earlier build still compiling: its pool stays
    tb.stop_workers()
    assert tb._POOL == {1: busy}
    busy.shutdown()


def test_a_build_whose_model_does_not_load_stops_the_workers_it_started(tmp_path, monkeypatch):
    import importlib

    from parastream.launcher.errors import ParastreamError
    from parastream.pipeline import BuildConfig

    b = importlib.import_module("parastream.pipeline.build")  # (the package's ``build`` is the function)
    started, stopped = [], []
    monkeypatch.setattr(tb, "start_workers", lambda options: started.append(options.device))
    monkeypatch.setattr(tb, "stop_workers", lambda: stopped.append(True))
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a model")
    with pytest.raises(ParastreamError, match="not an ONNX model"):
        b.load_and_check(bad, BuildConfig(backend="torch"), tb, b._Progress(False), {})
    assert started and stopped == [True]


def test_a_background_batch_is_queued_before_its_branches_are_converted_and_a_branch_that_fails_is_named(
        compiles, monkeypatch):
    """``precompile(background=True)`` hands the jobs to the workers first and converts each branch (the check that
    the converter runs it) after: the workers do not wait for the checks.  A branch the converter cannot run
    still fails the call, by its name."""
    from parastream.launcher.engines import onnx_torch
    from parastream.launcher.errors import ParastreamError

    events = []
    monkeypatch.setenv("PARASTREAM_COMPILE_WORKERS", "2")
    monkeypatch.setattr(tb, "_submit", lambda todo, *a, **k: events.append(("queued", len(todo))))
    real = onnx_torch.convert

    def convert(branch, *a, **k):
        events.append(("converted", branch.graph.name))
        if branch.graph.node[-1].op_type == "Mul" and branch.graph.node[-1].name == "unsupported":
            raise onnx_torch.UnsupportedOp("Mul 'unsupported': not here")
        return real(branch, *a, **k)

    monkeypatch.setattr(onnx_torch, "convert", convert)
    tb._CONVERTED.clear()
    got = tb.precompile([(tb.Builder(BuildOptions(device="cpu")), [(branch(5), "a", LAYOUT), (branch(6), "b", LAYOUT)])],
                        background=True)
    assert got["jobs"] == 2
    assert events[0] == ("queued", 2) and [e[0] for e in events[1:]] == ["converted", "converted"]
    events.clear()
    bad = branch(7)
    bad.graph.node[-1].name = "unsupported"
    with pytest.raises(ParastreamError, match="^c: .*unsupported"):
        tb.precompile([(tb.Builder(BuildOptions(device="cpu")), [(bad, "c", LAYOUT)])], background=True)
    assert events[0] == ("queued", 1)
    # without background, each branch is converted before it compiles
    events.clear()
    builder = tb.Builder(BuildOptions(device="cpu"))
    builder._jobs([(branch(8), "d", LAYOUT)])
    assert events == [("converted", branch(8).graph.name)] and builder.deferred_checks == []
    tb._INFLIGHT.clear()
    tb._QUEUED.clear()


def test_one_structure_with_other_code_choices_is_a_compile_group_of_its_own(compiles, monkeypatch):
    """Branches that differ only in their weights, compiled with the same code choices, are one group (one worker
    compiles them in turn, all but the first hits in its caches); the same branches with a choice that changes
    their code (here another optimization level; on a GPU a fusion off, depthwise convolutions as Inductor's
    kernels) are a group of their own, which another worker compiles at the same time.  A choice that cannot
    change a branch's code (a GEMM-epilogue fusion where it has no GEMM) leaves it in its group, one job."""
    seen = []
    real = tb.Builder._compile
    monkeypatch.setattr(tb.Builder, "_compile", lambda self, todo, groups: seen.append(
        {g: list(ks) for g, ks in groups.items()}) or real(self, todo, groups))
    o3, o5 = BuildOptions(device="cpu"), BuildOptions(device="cpu", optimization_level=5)
    no_gemm = BuildOptions(device="cpu", fuse_gemm_epilogue=False)
    got = tb.precompile([(tb.Builder(o3), [(branch(1), "a", LAYOUT), (branch(2), "b", LAYOUT)]),
                         (tb.Builder(o5), [(branch(1), "c", LAYOUT), (branch(2), "d", LAYOUT)]),
                         (tb.Builder(no_gemm), [(branch(1), "e", LAYOUT)])])
    assert got["jobs"] == 4 and len(compiles) == 4
    (groups,) = seen
    assert sorted(len(ks) for ks in groups.values()) == [2, 2]  # per optimization level, both weights
    assert len({g.split(":")[0] for g in groups}) == 1  # one structure: the groups differ in their code choices
    by_level = {}
    for o in (o3, o5):
        builder = tb.Builder(o)
        builder.build_all([(branch(1), "x", LAYOUT), (branch(2), "y", LAYOUT)])
        by_level[o.optimization_level] = {builder.report()[n]["key"] for n in ("x", "y")}
    for ks in groups.values():  # each group holds the keys of one level
        assert any(set(k[:16] for k in ks) == level for level in by_level.values())



def test_branches_of_one_structure_with_other_tensor_names_are_one_group(compiles, monkeypatch):
    """The group is the structure and the code choices, not the tensors' names: two cells of one network, whose
    inputs and outputs are named after their place in it, are compiled in turn by one worker (the second a hit
    in its caches).  Grouped with their names, every branch was a group of its own (H200, NASNet-A Large: its
    input's 332 branches compiled as 332 groups, not 83, 315-364 worker-seconds rather than 235-266)."""
    seen = []
    real = tb.Builder._compile
    monkeypatch.setattr(tb.Builder, "_compile", lambda self, todo, groups: seen.append(
        {g: list(ks) for g, ks in groups.items()}) or real(self, todo, groups))
    renamed = branch(2)
    for v in (*renamed.graph.input, *renamed.graph.output):
        v.name = "cell7_" + v.name
    for node in renamed.graph.node:
        node.input[:] = ["cell7_" + n if n in ("x",) else n for n in node.input]
        node.output[:] = ["cell7_" + n if n == "y" else n for n in node.output]
    layout = {"inputs": [tb.TensorSpec("cell7_x", IN.dtype, IN.shape)],
              "outputs": [tb.TensorSpec("cell7_y", OUT.dtype, OUT.shape)]}
    got = tb.precompile([(tb.Builder(BuildOptions(device="cpu")), [(branch(1), "a", LAYOUT), (renamed, "b", layout)])])
    assert got["jobs"] == 2 and len(compiles) == 2
    (groups,) = seen
    assert len(groups) == 1 and len(next(iter(groups.values()))) == 2


def _stand_in_queue(monkeypatch) -> list:
    """The background queue with empty state and a stand-in pool that records what it is handed (and never runs it)."""
    handed = []

    class Pool:
        def submit(self, fn, jobs):
            handed.append(jobs)
            return type("F", (), {"add_done_callback": lambda self, cb: None, "cancel": lambda self: False})()

    monkeypatch.setattr(tb, "_pool", lambda n: Pool())
    monkeypatch.setattr(tb, "_QUEUED", [])
    monkeypatch.setattr(tb, "_INFLIGHT", {})
    return handed


def test_drop_removes_only_queued_groups_wholly_of_the_keys_given(monkeypatch):
    """``drop`` (a decided round's moot rivals): a queued group every key of which is given is dropped and no longer
    compiling; a group that also holds a key not given, one someone waits for, and one already running stay."""
    handed = _stand_in_queue(monkeypatch)
    monkeypatch.setattr(tb, "_RUNNING", [0])
    monkeypatch.setattr(tb, "_WORKERS", [1])
    job = ("inductor", branch(1).SerializeToString())
    tb._submit({"r": job}, {"gr": ["r"]}, None, cancellable=False, workers=1)  # runs: the one worker
    tb._submit({"a": job}, {"ga": ["a"]}, None, cancellable=False, workers=1)
    tb._submit({"b": job, "c": job}, {"gbc": ["b", "c"]}, None, cancellable=False, workers=1)
    tb._submit({"w": job}, {"gw": ["w"]}, None, cancellable=False, workers=1)
    waited = next(j for j in tb._QUEUED if j.keys == ["w"])
    waited.priority = -1  # (as ``wait`` marks it)
    assert len(handed) == 1 and sorted(j.keys[0] for j in tb._QUEUED) == ["a", "b", "w"]
    assert tb.drop(["r", "a", "b", "w"]) == 1  # "a" only: "r" runs, "b" shares its group with "c", "w" is waited for
    assert tb.compiling(["a"]) == 0 and tb.compiling(["r", "b", "c", "w"]) == 4
    assert sorted(j.keys[0] for j in tb._QUEUED) == ["b", "w"]
    assert tb.drop(["b", "c"]) == 1 and tb.compiling(["b", "c"]) == 0
    assert tb.drop([]) == 0


def test_spare_groups_start_only_into_spare_workers_unless_waited_for_or_hastened(monkeypatch):
    """``order="spare"`` (the rounds' second-level alternatives, which the build may never need): queued after every
    other group, and handed to a worker only while at most half the workers are busy; once someone waits for it,
    at once; once hastened (``hasten``: a round they follow flipped), as any group needed after the search.  (The pool is a stand-in that records what it is handed.)"""
    handed = _stand_in_queue(monkeypatch)
    monkeypatch.setattr(tb, "_RUNNING", [2])  # two of four workers busy
    monkeypatch.setattr(tb, "_WORKERS", [1])
    job = ("inductor", branch(1).SerializeToString())
    tb._submit({"s": job}, {"gs": ["s"]}, None, cancellable=False, workers=4, order="spare")
    assert handed == [] and [j.keys for j in tb._QUEUED] == [["s"]]
    tb._submit({"c": job}, {"gc": ["c"]}, None, cancellable=True, workers=4)  # a candidate: goes into a free worker
    assert handed == [[job]] and [j.keys for j in tb._QUEUED] == [["s"]] and tb._RUNNING[0] == 3
    spare = tb._QUEUED[0]
    tb._RUNNING[0] = 1  # workers freed: at most half busy, the spare group starts
    tb._pump()
    assert len(handed) == 2 and tb._QUEUED == [] and spare.t_started is not None
    with pytest.raises(ValueError, match="spare"):
        tb._submit({"x": job}, {"gx": ["x"]}, None, cancellable=False, order="later")
    # waited for: it starts whatever the workers' load
    tb._RUNNING[0] = 3
    tb._submit({"w": job}, {"gw": ["w"]}, None, cancellable=False, workers=4, order="spare")
    waited = tb._QUEUED[0]
    assert len(handed) == 2
    threading.Thread(target=waited.wait, daemon=True).start()
    deadline = time.monotonic() + 10
    while len(handed) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(handed) == 3 and tb._QUEUED == []
    waited.done.set()  # (the stand-in pool never finishes it)
    # hastened (a round it follows flipped): queued as needed after the search, into any free worker
    tb._submit({"h": job}, {"gh": ["h"]}, None, cancellable=False, workers=4, order="spare")
    tb._submit({"o": job}, {"go": ["o"]}, None, cancellable=False, workers=4, order="spare")
    assert len(handed) == 3 and tb.hasten(["z"]) == 0
    tb._RUNNING[0] = 3
    assert tb.hasten(["h"]) == 1 and len(handed) == 4 and [j.keys for j in tb._QUEUED] == [["o"]]
    # the search's end drops the spare groups no one hastened or waited for, and the search's candidates
    tb._submit({"k": job}, {"gk": ["k"]}, None, cancellable=False, workers=4)
    tb._RUNNING[0] = 4
    tb._submit({"c2": job}, {"gc2": ["c2"]}, None, cancellable=True, workers=4)
    assert sorted(j.keys[0] for j in tb._QUEUED) == ["c2", "k", "o"]
    assert tb.cancel_precompile() == 2 and [j.keys for j in tb._QUEUED] == [["k"]]
    assert tb.compiling(["o", "c2"]) == 0 and tb.compiling(["k"]) == 1


def test_each_opt_level_is_its_own_inductor_configuration_and_its_own_engine(compiles):
    """``--opt-level`` 4 tunes Inductor's generated kernels by coordinate descent without max-autotune's templates,
    5 is max-autotune, 3 (the default) neither; each is compiled apart (the engine cache key holds the options)."""
    levels = (3, 4, 5)
    opts = {lv: tb._inductor_options(BuildOptions(device="cpu", optimization_level=lv)) for lv in levels}
    assert not opts[3].get("coordinate_descent_tuning") and not opts[3].get("max_autotune")
    assert opts[4].get("coordinate_descent_tuning") is True and not opts[4].get("max_autotune")
    assert opts[5].get("coordinate_descent_tuning") is True and opts[5].get("max_autotune") is True
    keys = set()
    for lv in levels:
        builder = tb.Builder(BuildOptions(device="cpu", optimization_level=lv))
        (data,) = builder.build_all([(branch(1), f"l{lv}", LAYOUT)])
        keys.add(tb.unpack(data)[0]["key"])
    assert len(compiles) == 3 and len(keys) == 3
