"""``parastream bench``'s TensorRT baseline: the whole model as one engine with TensorRT's own aux streams.

CPU tests (everywhere): the TensorRT test double (tests/trt_double) stands in for TensorRT, and
the GPU launcher, the device and the timing loop are replaced by stand-ins, so what is checked is
bench_bundle's side: when the baseline is attempted, with which builder options and
``max_aux_streams``, the output check, and what lands in the result and the printed table.
``gpu``: the double with real cuda-python memory and streams and direct launches (the double
cannot be captured into a CUDA Graph).  ``trt``: real TensorRT, CUDA Graphs (not run here).
"""

from __future__ import annotations

import io
import sys

import types

import numpy as np
import onnx
import pytest
import trt_double
from graphs import ort_reference
from graphs import three_branch_model as _three_branch_model

import parastream.launcher as launcher_api
from parastream.launcher import cuda
from parastream.launcher import gpu as gpu_module
from parastream.launcher.engines import tensorrt as backend
from parastream.launcher.errors import ParastreamError
from parastream.pipeline import bench


def three_branch_model(**kw) -> onnx.ModelProto:
    model = _three_branch_model(**kw)
    model.ir_version = 8  # an IR version every onnxruntime reads
    return model


def make_trt_bundle(tmp_path, streams=3, **kw):
    from handmade_bundles import make_bundle

    path = tmp_path / "three_branch.onnx"
    onnx.save(three_branch_model(**kw), path)
    return make_bundle(path, tmp_path / "bundle", backend="tensorrt", streams=streams)


# -- CPU: the double on host memory, stand-ins for the GPU side -----------------------------------------------------

@pytest.fixture
def trt(monkeypatch, tmp_path):
    fake = trt_double.install(monkeypatch)
    monkeypatch.setattr(launcher_api, "cuda_device_count", lambda: 0)  # a pipeline build verifies on the CPU launcher
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return fake


class FakeLauncher:
    """A GpuLauncher stand-in: ONNX Runtime on the bundle's model.onnx."""

    made: list = []

    def __init__(self, bundle, *, graph=True, single_stream=False, engines=None, **kw):
        self.plan = bundle.plan
        self.device = 0
        self.use_graph = graph
        self.single_stream = single_stream
        self.engines = engines if engines is not None else ["engine"]
        self.model = onnx.load(str(bundle.model_path))
        self.closed = False
        FakeLauncher.made.append(self)

    def __call__(self, feeds):
        return ort_reference(self.model, feeds)

    def run_timed(self, *, replays: int = 5):
        """The engines one after another in launch order, engine ``i`` taking ``alone_ms(i)`` ms."""
        spans, at = [], 0.0
        for i in self.plan.launch_order:
            b = self.plan.branches[i]
            spans.append({"branch": b.id, "name": b.name, "stream": 0, "start_ms": at, "end_ms": at + self.alone_ms(b.id)})
            at += self.alone_ms(b.id)
        return spans

    @staticmethod
    def alone_ms(i: int) -> float:
        return 0.1 * (i + 1)

    #: what one timing event costs inside ``run_timed``'s intervals, which ``time_chain`` (no events) does not pay
    EVENT_MS = 0.01
    chains: list = []

    def time_chain(self, branches, *, replays: int = 50):
        """The chain's engines back to back without events: each one's time alone less the event's gap."""
        FakeLauncher.chains.append(list(branches))
        return sum(self.alone_ms(i) - self.EVENT_MS for i in branches)

    def close(self):
        self.closed = True


class FakeWholeModelLauncher:
    """A WholeModelLauncher stand-in: the engine's host path (the double on host memory)."""

    made: list = []
    scale = 1.0

    def __init__(self, engine, plan, *, graph=True, device=0):
        self.engine, self.plan, self.use_graph, self.device = engine, plan, graph, device
        self.closed = False
        FakeWholeModelLauncher.made.append(self)

    def __call__(self, feeds):
        return {k: v * self.scale for k, v in self.engine.run(feeds).items()}

    def close(self):
        self.closed = True
        self.engine.close()


@pytest.fixture
def gpu_stand_ins(monkeypatch, trt):
    FakeLauncher.made, FakeWholeModelLauncher.made, FakeWholeModelLauncher.scale = [], [], 1.0
    monkeypatch.setattr(cuda, "device_count", lambda: 1)
    monkeypatch.setattr(cuda, "device_name", lambda device=0: "stand-in GPU")
    monkeypatch.setattr(gpu_module, "GpuLauncher", FakeLauncher)
    monkeypatch.setattr(bench, "WholeModelLauncher", FakeWholeModelLauncher)
    timed = []
    ms = {"parastream": 1.0, "single_stream": 2.0, "tensorrt_whole_model": 1.5}

    def measure(launchers, *, runs=200, warmup=20, seed=0):
        timed.append(dict(launchers))
        return {k: np.full(runs, ms[k]) + np.linspace(0, 0.01, runs) for k in launchers}

    monkeypatch.setattr(bench, "measure", measure)
    return timed


def console():
    from rich.console import Console

    return Console(file=io.StringIO(), width=200)


def test_bench_times_the_whole_model_engine_of_a_tensorrt_bundle(trt, gpu_stand_ins, tmp_path):
    bundle = make_trt_bundle(tmp_path, streams=3)
    trt.CALLS.clear()
    con = console()
    res = bench.bench_bundle(bundle, runs=10, warmup=2, console=con)
    # built once, from the whole model.onnx, with TensorRT's aux streams = the plan's streams - 1
    builds = trt.calls("Builder", "build_serialized_network")
    assert len(builds) == 1
    assert [c[2]["value"] for c in trt.calls("IBuilderConfig", "max_aux_streams")] == [bundle.plan.num_streams - 1] == [2]
    assert "TF32" in [c[2]["flag"] for c in trt.calls("IBuilderConfig", "clear_flag")]  # the bundle's fp32
    # timed in the same measure() call as the other two variants
    (variants,) = gpu_stand_ins
    assert list(variants) == ["parastream", "single_stream", "tensorrt_whole_model"]
    whole = variants["tensorrt_whole_model"]
    assert whole is FakeWholeModelLauncher.made[0] and whole.use_graph is True and whole.closed
    assert [t.name for t in whole.engine.inputs] == [t.name for t in bundle.plan.inputs]
    assert [t.name for t in whole.engine.outputs] == [t.name for t in bundle.plan.outputs]
    assert res["tensorrt_whole_model_ms"] == pytest.approx(1.505)
    assert res["speedup_vs_whole_model"] == pytest.approx(res["tensorrt_whole_model_ms"] / res["parastream_ms"])
    assert res["tensorrt_whole_model_max_aux_streams"] == 2 and res["tensorrt_whole_model_aux_streams"] == 2
    assert res["tensorrt_whole_model_build_s"] >= 0 and res["tensorrt_whole_model_engine_bytes"] > 0
    assert res["tensorrt_whole_model_precision"] == "fp32"
    assert res["whole_model_scaled_error"] < 1e-5 and set(res["max_abs_diff_whole_model_vs_multi"]) == {"output"}
    assert "tensorrt_whole_model_error" not in res
    assert all(la.closed for la in FakeLauncher.made)
    text = con.file.getvalue()
    assert "TensorRT, whole model as one engine, max_aux_streams=2 (uses 2)" in text
    assert "against TensorRT's own multi-stream" in text and "1.50x" in text


def test_bench_passes_the_bundles_builder_options_to_the_whole_model_build(trt, gpu_stand_ins, tmp_path, monkeypatch):
    pytest.importorskip("parastream.pipeline.analysis", reason="the pipeline's graph analysis has not landed")
    from parastream.pipeline import build as pipeline_build

    path = tmp_path / "m.onnx"
    onnx.save(three_branch_model(), path)
    bundle = pipeline_build(path, tmp_path / "out", backend="tensorrt", search=False, streams=2, precision="fp16",
                            workspace_mb=512, optimization_level=2, cache_dir=str(tmp_path / "cache"))
    seen = []
    real = backend.build_whole_model_engine

    def spy(model, options, max_aux_streams):
        seen.append((model, options, max_aux_streams))
        return real(model, options, max_aux_streams)

    monkeypatch.setattr(backend, "build_whole_model_engine", spy)
    res = bench.bench_bundle(bundle, runs=5, warmup=1)
    (model, options, aux), = seen
    assert aux == bundle.plan.num_streams - 1 == 1
    assert (options.precision, options.workspace_mb, options.optimization_level) == ("fp16", 512, 2)
    assert options.cache_dir == str(tmp_path / "cache") and options.device == "cuda" and not options.strongly_typed
    assert options.profiles == {}  # model.onnx of a bundle is static
    assert len(model.graph.node) == len(onnx.load(str(bundle.model_path)).graph.node)  # the whole model, not a branch
    assert "tensorrt_whole_model_ms" in res and res["tensorrt_whole_model_precision"] == "fp16"


def test_bench_tries_no_baseline_for_other_backends_or_when_told_not_to(trt, gpu_stand_ins, tmp_path, monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("build_whole_model_engine must not be called")

    monkeypatch.setattr(backend, "build_whole_model_engine", refuse)
    bundle = make_trt_bundle(tmp_path)
    res = bench.bench_bundle(bundle, runs=5, warmup=1, whole_model=False)
    assert not any(k.startswith(("tensorrt_whole_model", "speedup_vs_whole")) for k in res)
    assert list(gpu_stand_ins[-1]) == ["parastream", "single_stream"]
    # a bundle of another GPU backend: the baseline is TensorRT's, so nothing is attempted
    bundle.plan.backend = "torch"
    monkeypatch.setattr(type(bundle), "backend", lambda self: backend)  # still a GPU backend to bench_bundle
    res = bench.bench_bundle(bundle, runs=5, warmup=1)
    assert not any(k.startswith(("tensorrt_whole_model", "speedup_vs_whole")) for k in res)
    assert list(gpu_stand_ins[-1]) == ["parastream", "single_stream"]
    assert res["speedup"] == pytest.approx(2.0, rel=0.01)


def test_bench_without_an_importable_tensorrt_says_so(trt, gpu_stand_ins, tmp_path, monkeypatch):
    bundle = make_trt_bundle(tmp_path)
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    monkeypatch.setattr(type(bundle), "backend", lambda self: backend)  # the launcher stand-ins load nothing
    res = bench.bench_bundle(bundle, runs=5, warmup=1)
    assert "TensorRT does not import" in res["tensorrt_whole_model_error"]
    assert "tensorrt_whole_model_ms" not in res and list(gpu_stand_ins[-1]) == ["parastream", "single_stream"]


def test_a_whole_model_engine_that_disagrees_is_not_timed(trt, gpu_stand_ins, tmp_path):
    bundle = make_trt_bundle(tmp_path)
    FakeWholeModelLauncher.scale = 1.5
    con = console()
    res = bench.bench_bundle(bundle, runs=5, warmup=1, console=con)
    assert "differ from parastream's" in res["tensorrt_whole_model_error"] and "not timed" in res["tensorrt_whole_model_error"]
    assert res["whole_model_scaled_error"] > 0.1
    assert "tensorrt_whole_model_ms" not in res and "speedup_vs_whole_model" not in res
    assert list(gpu_stand_ins[-1]) == ["parastream", "single_stream"]
    assert FakeWholeModelLauncher.made[0].closed
    assert "TensorRT whole-model baseline: none" in con.file.getvalue()


def test_a_whole_model_build_that_tensorrt_refuses_leaves_the_rest_of_the_bench(trt, gpu_stand_ins, tmp_path, monkeypatch):
    def fail(model, options, max_aux_streams):
        raise ParastreamError("whole_model: TensorRT could not build the engine: out of memory")

    monkeypatch.setattr(backend, "build_whole_model_engine", fail)
    bundle = make_trt_bundle(tmp_path)
    res = bench.bench_bundle(bundle, runs=5, warmup=1)
    assert res["tensorrt_whole_model_error"].endswith("out of memory")
    assert res["parastream_ms"] > 0 and "tensorrt_whole_model_ms" not in res


def test_graph_false_reaches_every_variant(trt, gpu_stand_ins, tmp_path):
    bundle = make_trt_bundle(tmp_path)
    multi = FakeLauncher(bundle, graph=False)
    con = console()
    res = bench.bench_bundle(bundle, runs=5, warmup=1, launcher=multi, console=con)
    assert res["graph"] is False and not multi.closed  # a launcher handed in stays open
    variants = gpu_stand_ins[-1]
    assert [v.use_graph for v in variants.values()] == [False, False, False]
    text = con.file.getvalue()
    assert "one CUDA Graph" not in text and "direct launches" in text


def test_dynamic_inputs_get_the_plans_static_shape_as_profile(trt, tmp_path):
    bundle = make_trt_bundle(tmp_path)
    model = three_branch_model(batch="N")
    assert bench._static_profiles(model, bundle.plan) == {"input": ([1, 4, 8, 8],) * 3}
    assert bench._static_profiles(three_branch_model(), bundle.plan) == {}


def test_differences_scale_by_the_reference_and_catch_non_finite_outputs():
    ref = {"y": np.array([1.0, -4.0], np.float32)}
    absdiff, scaled = bench._differences({"y": np.array([1.0, -3.6], np.float32)}, ref)
    assert absdiff["y"] == pytest.approx(0.4) and scaled == pytest.approx(0.1)
    assert bench._differences({"y": np.array([np.nan, -4.0], np.float32)}, ref)[1] == float("inf")


# -- GPU: the double on real cuda-python memory and streams, direct launches -----------------------------------------

class DeviceCopies:
    """Synchronous copies between host bytes and device memory at an integer address."""

    def __init__(self):
        self.rt = cuda.runtime()

    def read(self, ptr: int, nbytes: int) -> bytes:
        buf = np.empty(nbytes, np.uint8)
        cuda.check(self.rt.cudaMemcpy(buf.ctypes.data, ptr, nbytes, self.rt.cudaMemcpyKind.cudaMemcpyDeviceToHost), "cudaMemcpy(D2H)")
        return buf.tobytes()

    def write(self, ptr: int, data: bytes) -> None:
        buf = np.frombuffer(data, np.uint8).copy()
        cuda.check(self.rt.cudaMemcpy(ptr, buf.ctypes.data, len(data), self.rt.cudaMemcpyKind.cudaMemcpyHostToDevice), "cudaMemcpy(H2D)")
        cuda.synchronize()  # a pageable copy may return before the DMA lands

    def synchronize(self, stream: int) -> None:
        cuda.stream_synchronize(stream)


@pytest.fixture
def trt_on_gpu(monkeypatch, tmp_path):
    from trt_double import host_memory

    fake = trt_double.install(monkeypatch)
    monkeypatch.setattr(backend, "Memory", backend.CudaMemory)  # real device memory
    monkeypatch.setattr(host_memory, "DEVICE", DeviceCopies())
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return fake


@pytest.mark.gpu
def test_bench_reports_the_whole_model_baseline_on_the_gpu(trt_on_gpu, tmp_path):
    trt = trt_on_gpu
    bundle = make_trt_bundle(tmp_path, streams=3, seed=2, channels=8, size=12)
    multi = gpu_module.GpuLauncher(bundle, graph=False)  # the double cannot be captured
    try:
        trt.CALLS.clear()
        res = bench.bench_bundle(bundle, runs=4, warmup=1, launcher=multi)
    finally:
        multi.close()
    assert res["graph"] is False
    assert res["tensorrt_whole_model_max_aux_streams"] == bundle.plan.num_streams - 1 == 2
    assert res["tensorrt_whole_model_aux_streams"] == 2
    assert res["tensorrt_whole_model_ms"] > 0 and res["tensorrt_whole_model_build_s"] > 0
    assert res["speedup_vs_whole_model"] == pytest.approx(res["tensorrt_whole_model_ms"] / res["parastream_ms"])
    assert res["whole_model_scaled_error"] < 1e-5 and "tensorrt_whole_model_error" not in res
    assert len(res["tensorrt_whole_model_p10_p90_ms"]) == 2
    # the whole-model engine ran on a stream of its own, never on the launcher's
    builds = trt.calls("Builder", "build_serialized_network")
    assert len(builds) == 1
    contexts = trt.calls("ICudaEngine", "create_execution_context")
    whole_ctx = contexts[-1][2]["context"]
    runs = [c for c in trt.calls("IExecutionContext", "execute_async_v3") if c[2]["context"] == whole_ctx]
    assert len(runs) >= 1 + 1 + 1 + 4  # warm-up, output check, measure's warm-up and timed replays
    assert len({c[2]["stream"] for c in runs}) == 1
    assert runs[0][2]["stream"] not in {int(s) for s in multi.streams} | {int(multi.origin)}


@pytest.mark.gpu
def test_whole_model_launcher_direct_launches_match_onnx_runtime(trt_on_gpu, tmp_path):
    bundle = make_trt_bundle(tmp_path, streams=3, seed=4)
    runner, info = bench.build_whole_model(bundle)
    assert info["max_aux_streams"] == 2
    x = np.random.default_rng(5).standard_normal((1, 4, 8, 8)).astype(np.float32)
    with bench.WholeModelLauncher(runner, bundle.plan, graph=False) as whole:
        for _ in range(2):
            np.testing.assert_allclose(whole({"input": x})["output"], ort_reference(three_branch_model(seed=4), {"input": x})["output"],
                                       rtol=1e-5, atol=1e-6)
    assert runner.context is None  # closed with the launcher


class CopyEngine:
    """A capturable stand-in engine: ``enqueue`` queues y = x (a device-to-device copy) on the stream."""

    def __init__(self, nbytes):
        self.nbytes, self.enqueued, self.closed = nbytes, 0, False

    def enqueue(self, stream, addresses):
        self.enqueued += 1
        cuda.memcpy_dtod_async(addresses["y"], addresses["x"], self.nbytes, stream)

    def close(self):
        self.closed = True


@pytest.mark.gpu
def test_whole_model_launcher_captures_the_enqueue_into_one_cuda_graph():
    from types import SimpleNamespace

    from parastream.launcher.plan import TensorSpec

    plan = SimpleNamespace(inputs=[TensorSpec("x", "float32", [64, 33])], outputs=[TensorSpec("y", "float32", [64, 33])])
    engine = CopyEngine(64 * 33 * 4)
    whole = bench.WholeModelLauncher(engine, plan)
    assert whole._exec is not None and engine.enqueued == 2  # warm-up, then the captured enqueue
    x = np.random.default_rng(7).standard_normal((64, 33)).astype(np.float32)
    for _ in range(3):
        np.testing.assert_array_equal(whole({"x": x})["y"], x)
    assert engine.enqueued == 2  # replays are graph launches, no further enqueue
    times = bench.measure({"whole": whole}, runs=5, warmup=2)
    assert times["whole"].shape == (5,) and np.all(times["whole"] > 0) and engine.enqueued == 2
    whole.close()
    assert engine.closed and whole.addr == {}


# -- real TensorRT (marked trt: skipped where TensorRT does not import) ------------------------------------------------------------

@pytest.mark.trt
@pytest.mark.gpu
def test_bench_against_the_real_whole_model_engine_in_a_cuda_graph(tmp_path):
    pytest.importorskip("tensorrt")
    pytest.importorskip("parastream.pipeline.analysis", reason="the pipeline's graph analysis has not landed")
    from parastream.pipeline import build as pipeline_build

    path = tmp_path / "m.onnx"
    onnx.save(three_branch_model(channels=32, size=56), path)
    bundle = pipeline_build(path, tmp_path / "out", backend="tensorrt", search=False, streams=3, cache_dir=str(tmp_path / "cache"))
    con = console()
    res = bench.bench_bundle(bundle, runs=50, warmup=10, console=con)
    assert res["graph"] is True and "tensorrt_whole_model_error" not in res, res.get("tensorrt_whole_model_error")
    assert res["tensorrt_whole_model_max_aux_streams"] == bundle.plan.num_streams - 1
    assert 0 <= res["tensorrt_whole_model_aux_streams"] <= res["tensorrt_whole_model_max_aux_streams"]
    assert res["tensorrt_whole_model_ms"] > 0 and res["whole_model_scaled_error"] <= 1e-3
    assert res["speedup_vs_whole_model"] == pytest.approx(res["tensorrt_whole_model_ms"] / res["parastream_ms"])
    assert "TensorRT, whole model as one engine" in con.file.getvalue()
    # and the captured whole-model graph replays correctly on its own
    runner, _ = bench.build_whole_model(bundle)
    x = np.random.default_rng(6).standard_normal((1, 32, 56, 56)).astype(np.float32)
    with bench.WholeModelLauncher(runner, bundle.plan) as whole:
        assert whole._exec is not None
        for _ in range(3):
            np.testing.assert_allclose(whole({"input": x})["output"], ort_reference(three_branch_model(channels=32, size=56), {"input": x})["output"],
                                       rtol=1e-3, atol=1e-3)


def _chains(plan):
    """Every chain of engines each reading an output of the one before, enumerated (no library)."""
    producer = {t: b.id for b in plan.branches for t in b.outputs}
    preds = {b.id: {producer[t] for t in b.inputs if t in producer and producer[t] != b.id} for b in plan.branches}
    succs = {b.id: [c.id for c in plan.branches if b.id in preds[c.id]] for b in plan.branches}

    def walk(path):
        yield path
        for n in succs[path[-1]]:
            yield from walk(path + [n])

    for b in plan.branches:
        yield from walk([b.id])


def test_the_critical_path_bound_is_the_longest_dependent_chain_of_engines_timed_alone(trt, tmp_path):
    """``critical_path_bound``: the engines' times alone summed along the longest chain of data dependencies,
    every chain enumerated here; the plan's stream order adds no edge (engines on one stream that do not read each
    other are not a chain)."""
    bundle = make_trt_bundle(tmp_path, streams=3)
    plan = bundle.plan
    for alone in ({b.id: 0.1 * (b.id + 1) for b in plan.branches}, {b.id: 1.0 / (b.id + 1) for b in plan.branches}):
        got = bench.critical_path_bound(plan, alone)
        best = max(_chains(plan), key=lambda c: sum(alone[i] for i in c))
        assert got["bound_ms"] == pytest.approx(sum(alone[i] for i in best))
        ids = [next(b.id for b in plan.branches if b.name == n) for n in got["chain"]]
        assert ids in list(_chains(plan))  # a chain of dependencies, not of launch order
        assert got["alone_sum_ms"] == pytest.approx(sum(alone.values()))
        assert got["alone_sum_ms"] > got["bound_ms"]
    # three independent branches side by side: the longest one alone is not a chain through the others
    assert len(plan.branches) > len(max(_chains(plan), key=len))


def test_a_launcher_without_chain_timing_gives_the_events_sum_as_the_bound(trt, tmp_path):
    """``measured_bound`` with a launcher that cannot run a chain alone (no ``time_chain``): the chain's engines
    timed alone and summed, as before; where running the chain alone fails, the same sum and why."""
    bundle = make_trt_bundle(tmp_path, streams=3)
    plan = bundle.plan

    class EventsOnly:
        def run_timed(self, *, replays=5):
            return FakeLauncher.run_timed(types.SimpleNamespace(plan=plan, alone_ms=FakeLauncher.alone_ms))

    got = bench.measured_bound(plan, EventsOnly())
    want = bench.critical_path_bound(plan, {b.id: FakeLauncher.alone_ms(b.id) for b in plan.branches})
    assert got["bound_ms"] == pytest.approx(want["bound_ms"]) and "chain_events_ms" not in got

    class Refuses(EventsOnly):
        def time_chain(self, branches, *, replays=50):
            raise RuntimeError("capture refused")

    refused = bench.measured_bound(plan, Refuses())
    assert refused["bound_ms"] == pytest.approx(want["bound_ms"]) and "chain_events_ms" not in refused
    assert refused["chain_error"] == "RuntimeError: capture refused"


def test_bench_gives_a_multi_stream_plan_s_distance_to_its_critical_path_bound(trt, gpu_stand_ins, tmp_path):
    """``parastream bench`` of a plan with streams times its engines alone on one stream (events around each) to find
    the longest dependent chain, then gives as the bound that chain run back to back alone (``time_chain``: no
    event gaps), the events' sum beside it, and the plan's time over the bound; a one-stream plan has no bound."""
    bundle = make_trt_bundle(tmp_path, streams=3)
    con = console()
    FakeLauncher.chains = []
    res = bench.bench_bundle(bundle, runs=5, warmup=1, whole_model=False, console=con)
    want = bench.critical_path_bound(bundle.plan, {b.id: FakeLauncher.alone_ms(b.id) for b in bundle.plan.branches})
    assert FakeLauncher.chains == [want["chain_ids"]]  # the chain the events found, and only it, run alone
    back_to_back = want["bound_ms"] - FakeLauncher.EVENT_MS * len(want["chain"])
    assert res["critical_path_bound_ms"] == pytest.approx(back_to_back)
    assert res["critical_path_events_ms"] == pytest.approx(want["bound_ms"])
    assert res["over_bound"] == pytest.approx(res["parastream_ms"] / back_to_back)
    assert res["critical_path_engines"] == len(want["chain"])
    assert f"parastream at {res['over_bound']:.2f}x of it" in con.file.getvalue()
    assert "run back to back alone" in con.file.getvalue()
    (tmp_path / "one").mkdir()
    one = make_trt_bundle(tmp_path / "one", streams=1)
    res = bench.bench_bundle(one, runs=5, warmup=1, whole_model=False)
    assert "critical_path_bound_ms" not in res and "critical_path_bound_error" not in res
