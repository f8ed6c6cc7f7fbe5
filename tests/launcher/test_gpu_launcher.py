"""The GPU launcher: multi-stream plan captured as one CUDA Graph (marked gpu), plus CPU-side checks of the helpers."""

from __future__ import annotations

import enum
import sys
import types
from pathlib import Path

import numpy as np
import onnx
import pytest

from parastream.launcher import cuda
from parastream.launcher.cuda import DeviceArray

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))


def test_cuda_module_imports_and_device_array_interface():
    a = DeviceArray(0x1000, (2, 3), "float16", "x")
    cai = a.__cuda_array_interface__
    assert cai["shape"] == (2, 3) and cai["typestr"] == "<f2" and cai["data"] == (0x1000, False) and cai["version"] == 3
    assert a.nbytes == 12
    assert cuda.nbytes_of([4, 4], "int64") == 128


class _FakeRuntime:
    """Just enough of cuda-python's runtime for the device queries, with memory on made-up devices."""

    class cudaError_t(enum.Enum):
        cudaSuccess = 0
        cudaErrorInvalidValue = 1

    class cudaMemoryType(enum.Enum):
        cudaMemoryTypeUnregistered = 0
        cudaMemoryTypeHost = 1
        cudaMemoryTypeDevice = 2
        cudaMemoryTypeManaged = 3

    def __init__(self, pointers: dict, current: int = 0):
        self.pointers, self.current, self.queries = pointers, current, 0

    def cudaPointerGetAttributes(self, ptr):
        self.queries += 1
        kind, device = self.pointers[int(ptr)]
        return self.cudaError_t.cudaSuccess, types.SimpleNamespace(type=getattr(self.cudaMemoryType, kind), device=device)

    def cudaGetDevice(self):
        return self.cudaError_t.cudaSuccess, self.current

    def cudaGetErrorString(self, err):
        return self.cudaError_t.cudaSuccess, b"fake"


def test_dlpack_device_is_the_memorys_device(monkeypatch):
    """Without a given device the ordinal comes from the pointer's attributes, once; host memory has none."""
    fake = _FakeRuntime({0x1000: ("cudaMemoryTypeDevice", 3), 0x2000: ("cudaMemoryTypeManaged", 1),
                         0x3000: ("cudaMemoryTypeHost", -1)}, current=0)
    monkeypatch.setattr(cuda, "_rt", fake)
    a = DeviceArray(0x1000, (2, 3), "float32", "x")
    assert a.__dlpack_device__() == (2, 3) and a.device == 3
    assert fake.queries == 1  # read once, then kept
    assert DeviceArray(0x2000, (4,), "float16").__dlpack_device__() == (2, 1)
    with pytest.raises(cuda.CudaError, match="0x3000 is not CUDA device memory"):
        DeviceArray(0x3000, (4,), "float32").__dlpack_device__()
    assert cuda.get_device() == 0 and cuda.pointer_device(0x1000) == 3


def test_dlpack_device_given_at_allocation_needs_no_query(monkeypatch):
    fake = _FakeRuntime({}, current=0)
    monkeypatch.setattr(cuda, "_rt", fake)
    assert DeviceArray(0x1000, (2,), "float32", device=5).__dlpack_device__() == (2, 5)
    assert fake.queries == 0


def _models(tmp_path):
    from graphs import three_branch_model

    from onnx_cases import inception_block

    paths = {}
    for name, m in {"three_branch": three_branch_model(seed=2, channels=8, size=12), "inception_block": inception_block(seed=4, c=16, size=17)}.items():
        m.ir_version = 8  # what every onnxruntime reads
        p = tmp_path / f"{name}.onnx"
        onnx.save(m, p)
        paths[name] = p
    return paths


def _ref(path, feeds):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds)))


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    pytest.importorskip("torch")
    from handmade_bundles import make_bundle

    tmp = tmp_path_factory.mktemp("gpu_bundles")
    paths = _models(tmp)
    out = {}
    for name, p in paths.items():
        for precision in ("fp32", "fp16"):
            out[(name, precision)] = (p, make_bundle(p, tmp / f"{name}_{precision}", backend="torch", streams=3, precision=precision))
    out[("inception_block", "eager")] = (paths["inception_block"], make_bundle(paths["inception_block"], tmp / "eager", backend="torch",
                                                                                 streams=3, precision="fp32", compile=False))
    return out


def _feeds(bundle, seed):
    rng = np.random.default_rng(seed)
    return {s.name: rng.standard_normal(s.shape).astype(s.dtype) for s in bundle.plan.inputs}


@pytest.mark.gpu
@pytest.mark.parametrize("key,tol", [(("three_branch", "fp32"), 1e-3), (("inception_block", "fp32"), 1e-3),
                                     (("three_branch", "fp16"), 1e-2), (("inception_block", "fp16"), 1e-2),
                                     (("inception_block", "eager"), 1e-3)])
@pytest.mark.parametrize("graph", [True, False])
def test_gpu_launcher_matches_onnxruntime(bundles, key, tol, graph):
    from parastream.launcher.gpu import GpuLauncher

    path, bundle = bundles[key]
    assert bundle.plan.num_streams > 1
    with GpuLauncher(bundle, graph=graph) as la:
        for seed in (1, 2):
            feeds = _feeds(bundle, seed)
            ref = _ref(path, feeds)
            got = la(feeds)
            for name in ref:
                assert got[name].dtype == ref[name].dtype
                assert _rel(got[name], ref[name]) <= tol, (name, _rel(got[name], ref[name]))


@pytest.mark.gpu
def test_load_picks_the_gpu_launcher(bundles):
    from parastream.launcher import load
    from parastream.launcher.gpu import GpuLauncher

    _, bundle = bundles[("three_branch", "fp32")]
    runner = load(bundle.path)
    assert isinstance(runner, GpuLauncher) and runner._exec is not None
    runner.close()


@pytest.mark.gpu
def test_captured_graph_survives_other_allocations(bundles):
    """Between replays, torch and raw cudaMalloc allocate, scribble on and free memory; outputs stay right."""
    import torch

    from parastream.launcher.gpu import GpuLauncher

    path, bundle = bundles[("inception_block", "fp16")]
    la = GpuLauncher(bundle)
    feeds = _feeds(bundle, 5)
    ref = _ref(path, feeds)
    first = la(feeds)
    for i in range(4):
        junk = [torch.full((1 << 20,), float("nan"), device="cuda") for _ in range(8)]  # 32 MiB of NaN from torch's pool
        raw = [cuda.malloc(1 << 22) for _ in range(4)]
        for p in raw:
            cuda.memset_async(p, 0xFF, 1 << 22, la.origin)  # 0xFF.. bytes are NaN in fp16 and fp32
        cuda.synchronize()
        for p in raw:
            cuda.free(p)
        del junk
        torch.cuda.empty_cache()
        got = la(feeds)
        for name in ref:
            assert np.array_equal(got[name], first[name])
            assert _rel(got[name], ref[name]) <= 1e-2
    la.close()


def _matmul_branches_model(k: int = 8192, n: int = 64, branches: int = 3, op: str = "MatMul",
                           m: int = 16) -> onnx.ModelProto:
    """x [m, k] through ``branches`` MatMul (or Gemm with a bias and transB, as an exported Linear: torch's
    ``linear``, cuBLASLt's GEMM with its bias epilogue) + Relu branches (a long reduction: cuBLAS splits it and
    uses its workspace), their sum out."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(3)
    nodes, inits, outs = [], [], []
    for i in range(branches):
        w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
        inits.append(numpy_helper.from_array(w.T.copy() if op == "Gemm" else w, f"w{i}"))
        if op == "Gemm":
            inits.append(numpy_helper.from_array(rng.standard_normal(n).astype(np.float32), f"b{i}"))
            nodes.append(helper.make_node("Gemm", ["x", f"w{i}", f"b{i}"], [f"m{i}"], transB=1))
        else:
            nodes.append(helper.make_node("MatMul", ["x", f"w{i}"], [f"m{i}"]))
        nodes.append(helper.make_node("Relu", [f"m{i}"], [f"r{i}"]))
        outs.append(f"r{i}")
    nodes.append(helper.make_node("Sum", outs, ["y"]))
    g = helper.make_graph(nodes, "matmul_branches", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [m, k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [m, n])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(16, 8192, 64), (1, 4032, 1000)], ids=["split_k", "nasnet_classifier"])
def test_captured_graph_survives_torch_freeing_cublas_workspaces(tmp_path, shape):
    """torch.compile(mode="reduce-overhead") frees every cuBLAS and cuBLASLt workspace of the process around each
    graph it records (``torch._C._cuda_clearCublasWorkspaces``).  A launcher's graph must not use a workspace in
    torch's shared pool: NASNet-A Large's did (its warm-up, outside the launcher's pool, made them: 1 MiB and
    32 MiB for its classifier's addmm) and failed with an illegal address beside torch.compile
    (bench/replay_isolation.py).  The workspaces on its streams are in its own pool, and after they are freed,
    the memory released and taken again by other tensors, the replays give the same outputs and leave those
    tensors alone."""
    import torch

    from parastream.launcher.gpu import GpuLauncher
    from parastream.pipeline import build

    path = tmp_path / "mm.onnx"
    m, k, n = shape  # (1, 4032, 1000): NASNet-A Large's classifier, whose addmm made the workspaces that failed
    onnx.save(_matmul_branches_model(op="Gemm", m=m, k=k, n=n), path)
    # built as a user builds: compiled engines, warmed in the launcher's warm-up thread before its capture
    bundle = build(path, tmp_path / "b", backend="torch", streams=3, precision="fp16", search=False, measure=False)
    assert bundle.report["verification"].get("engines_compiled_at_load", 0) == 0
    la = GpuLauncher(bundle)
    feeds = _feeds(bundle, 5)
    ref = _ref(path, feeds)
    first = la(feeds)
    assert _rel(first["y"], ref["y"]) <= 1e-2
    # what stays allocated on the launcher's streams (the workspaces its graph's products use) is in its own pool,
    # not in torch's shared one (pool id (0, 0)), where a free by torch.compile would hand it to other tensors
    streams = {la._h(s) for s in [la.origin, *la.streams]}
    live = [(seg["segment_pool_id"], seg["active_size"]) for seg in torch.cuda.memory._snapshot()["segments"]
            if seg["stream"] in streams and seg["active_size"] > 0]
    assert live, "nothing allocated on the launcher's streams: the model no longer exercises cuBLAS's workspace"
    assert all(tuple(pool) == tuple(la._scope.pool.id) for pool, _ in live), live
    for _ in range(3):
        torch.cuda.synchronize()
        torch._C._cuda_clearCublasWorkspaces()
        torch.cuda.empty_cache()
        # the freed memory taken again by other tensors, filled with NaN
        junk = [torch.full((1 << 22,), float("nan"), device="cuda") for _ in range(16)]  # 16 x 16 MiB
        torch.cuda.synchronize()
        for _ in range(5):
            got = la(feeds)
            assert np.array_equal(got["y"], first["y"])
        assert all(bool(torch.isnan(j).all()) for j in junk), "a replay wrote into memory torch had handed to another tensor"
        del junk
    la.close()


@pytest.mark.gpu
def test_device_feeds_torch_and_cupy_and_zero_copy_views(bundles):
    import torch

    from parastream.launcher.gpu import GpuLauncher

    path, bundle = bundles[("three_branch", "fp32")]
    la = GpuLauncher(bundle)
    feeds = _feeds(bundle, 9)
    ref = _ref(path, feeds)
    tfeeds = {k: torch.from_numpy(v).cuda() for k, v in feeds.items()}
    outs = la(tfeeds)  # torch tensors: device-to-device, returns views of the graph's output buffers
    for name in ref:
        t = torch.as_tensor(outs[name], device="cuda")
        assert _rel(t.cpu().numpy(), ref[name]) <= 1e-3
        assert outs[name].ptr == la.addr[name]
    # zero-copy: write into the captured graph's input buffers, launch, read its output buffers
    views = la.inputs()
    for name, x in feeds.items():
        views[name].torch().copy_(torch.from_numpy(x))
    stream = torch.cuda.current_stream()
    la.launch(stream=stream.cuda_stream)
    stream.synchronize()
    for name, arr in la.outputs().items():
        assert _rel(arr.torch().cpu().numpy(), ref[name]) <= 1e-3
    cupy = pytest.importorskip("cupy")
    cfeeds = {k: cupy.asarray(v) for k, v in feeds.items()}
    outs = la(cfeeds)
    for name in ref:
        assert _rel(cupy.asnumpy(cupy.asarray(outs[name])), ref[name]) <= 1e-3
    with pytest.raises(Exception, match="shape"):
        la({k: torch.zeros(1, 2, device="cuda") for k in feeds})
    la.close()


@pytest.mark.gpu
def test_single_stream_and_timeline(bundles, tmp_path):
    from parastream.pipeline.bench import bench_bundle
    from parastream.launcher.gpu import GpuLauncher

    path, bundle = bundles[("inception_block", "fp16")]
    multi = GpuLauncher(bundle)
    single = GpuLauncher(bundle, single_stream=True, engines=multi.engines)
    feeds = _feeds(bundle, 3)
    a, b = multi(feeds), single(feeds)
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-3, atol=1e-3)
    spans = multi.run_timed(replays=3)
    assert len(spans) == len(bundle.plan.branches)
    assert {s["stream"] for s in spans} == {b.stream for b in bundle.plan.branches}
    for s in spans:
        assert 0 <= s["start_ms"] <= s["end_ms"]
    # a branch never starts before the branches it waits on have ended
    by_id = {s["branch"]: s for s in spans}
    for br in bundle.plan.branches:
        for w in br.waits:
            assert by_id[w]["end_ms"] <= by_id[br.id]["start_ms"] + 1e-3
    single.close()
    png = tmp_path / "timeline.png"
    res = bench_bundle(bundle, runs=30, warmup=5, timeline=png, launcher=multi)
    assert png.stat().st_size > 1000
    assert res["parastream_ms"] > 0 and res["single_stream_ms"] > 0 and res["speedup"] > 0
    assert all(v < 1e-2 for v in res["max_abs_diff_single_vs_multi"].values())
    # the bound: the longest chain run alone, without the events that time each engine, which cost a gap each
    assert 0 < res["critical_path_bound_ms"] <= res["critical_path_events_ms"] * 1.05
    multi.close()


@pytest.mark.gpu
def test_a_chain_run_alone_takes_its_engines_time_and_leaves_the_outputs_alone(bundles):
    """``time_chain``: the chosen engines back to back in a graph of their own.  All of them take about a whole
    one-stream replay, one of them less; and the replay after it still gives the plan's outputs."""
    from parastream.launcher.gpu import GpuLauncher

    path, bundle = bundles[("inception_block", "fp16")]
    single = GpuLauncher(bundle, single_stream=True)
    feeds = _feeds(bundle, 4)
    before = single(feeds)
    ids = list(bundle.plan.launch_order)
    every = single.time_chain(ids, replays=20)
    one = single.time_chain(ids[:1], replays=20)
    spans = single.run_timed(replays=5)
    whole = max(s["end_ms"] for s in spans) - min(s["start_ms"] for s in spans)
    assert 0 < one < every <= whole * 1.1
    after = single(feeds)
    for k in before:
        np.testing.assert_array_equal(after[k], before[k])
    single.close()


@pytest.mark.gpu
def test_cuda_errors_name_the_call():
    ev = cuda.event_create(timing=False)
    cuda.event_record(ev, 0)
    cuda.event_synchronize(ev)
    with pytest.raises(cuda.CudaError, match="cudaEventElapsedTime"):
        cuda.event_elapsed_ms(ev, ev)  # events without timing cannot be timed
    cuda.event_destroy(ev)
    with pytest.raises(cuda.CudaError, match="cudaMalloc"):
        cuda.malloc(1 << 50)


@pytest.mark.gpu
def test_device_array_reports_the_device_of_its_memory():
    """Memory from cudaMalloc on the current device: DLPack, torch and the pointer agree on the ordinal."""
    import torch

    ptr = cuda.malloc(64)
    try:
        arr = DeviceArray(ptr, (16,), "float32")
        assert arr.__dlpack_device__() == (2, cuda.get_device())
        t = torch.from_dlpack(arr)
        assert t.device == torch.device("cuda", cuda.get_device()) and t.data_ptr() == ptr
    finally:
        cuda.free(ptr)


def assert_all_on(devices: dict, n: int) -> None:
    """Every object in a launcher's ``devices()`` is on GPU ``n``: arena, streams, events, engines, and the
    captured graph's kernels (at least one of which names its context), memsets and copies."""
    assert devices["arena"] == n and devices["origin"] == n, devices
    assert all(d == n for d in devices["streams"]), devices["streams"]
    assert devices["events"] and all(d == n for d in devices["events"]), devices["events"]
    engines = [e for e in devices["engines"] if e is not None]
    assert engines and all(e == [n] for e in engines), devices["engines"]
    graph = devices["graph"]
    if graph is not None:
        assert graph["kernels"] and set(graph["kernels"]) == {n}, graph
        assert set(graph["memsets"]) <= {n}, graph
        assert set(graph["copies"]) <= {(n, n)}, graph  # a replay copies nothing between GPUs, nor to the host


@pytest.fixture
def two_gpus():
    """Skip where this machine has fewer than two GPUs (the two-GPU tests need the device tool's two-GPU kind)."""
    n = cuda.device_count()
    if n < 2:
        pytest.skip(f"needs two CUDA GPUs; cuda-python sees {n}")


@pytest.mark.gpu
@pytest.mark.parametrize("key", [("three_branch", "fp32"), ("inception_block", "fp16"), ("inception_block", "eager")])
@pytest.mark.parametrize("graph", [True, False])
def test_every_object_of_a_launcher_on_gpu_0_is_on_gpu_0(bundles, key, graph):
    """load(device=0), GPU 0 asked for explicitly: arena, streams, events, engines and graph all read back as 0."""
    from parastream.launcher import load
    from parastream.launcher.gpu import GpuLauncher

    path, bundle = bundles[key]
    la = load(bundle.path, device=0, graph=graph)
    try:
        assert isinstance(la, GpuLauncher) and la.device == 0
        feeds = _feeds(bundle, 6)
        got, ref = la(feeds), _ref(path, feeds)
        for name in ref:
            assert _rel(got[name], ref[name]) <= 1e-2
        devices = la.devices()
        assert (devices["graph"] is None) == (not graph)
        assert_all_on(devices, 0)
    finally:
        la.close()
    la = load(bundle.path, device="cuda:0", graph=graph)
    assert la.device == 0 and la.arena_device == 0
    la.close()


@pytest.mark.gpu
@pytest.mark.parametrize("key", [("three_branch", "fp32"), ("inception_block", "fp16"), ("inception_block", "eager")])
def test_one_bundle_on_gpu_0_and_gpu_1_in_one_process(bundles, two_gpus, key):
    """The same bundle loaded on GPU 0 and on GPU 1: equal outputs, each launcher's objects on its own GPU, calls in
    any order from a thread whose current device is the other one (restored after each call), both launchers
    serving from two threads at once, and a device input from the other GPU refused rather than copied."""
    import threading

    import torch

    from parastream.launcher import load

    path, bundle = bundles[key]
    tol = 1e-2 if key[1] == "fp16" else 1e-3
    same = 1e-3 if key[1] == "fp16" else 1e-5  # one engine on two GPUs of one model: the same kernels
    la0 = load(bundle.path, device=0)
    la1 = load(bundle.path, device="cuda:1")
    try:
        assert (la0.device, la1.device) == (0, 1)
        assert_all_on(la0.devices(), 0)
        assert_all_on(la1.devices(), 1)
        for seed, current in ((1, 1), (2, 0)):
            cuda.set_device(current)
            feeds = _feeds(bundle, seed)
            ref = _ref(path, feeds)
            a, b = la0(feeds), la1(feeds)
            assert cuda.get_device() == current  # each call restored the caller's device
            for name in ref:
                assert _rel(a[name], b[name]) <= same, name
                assert _rel(b[name], ref[name]) <= tol, name
        # device inputs: on the launcher's own GPU taken as they are, from the other GPU refused with its name
        tfeeds = {k: torch.from_numpy(v).to("cuda:1") for k, v in feeds.items()}
        outs = la1(tfeeds)
        for name in ref:
            assert outs[name].device == 1 and _rel(outs[name].torch().cpu().numpy(), ref[name]) <= tol
        with pytest.raises(Exception, match="is on cuda:0, this launcher runs on cuda:1"):
            la1({k: v.to("cuda:0") for k, v in tfeeds.items()})
        # both GPUs at once, one thread each
        results, errors = {}, []

        def serve(name, la):
            try:
                results[name] = [la(feeds) for _ in range(20)]
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=serve, args=(n, la)) for n, la in (("gpu0", la0), ("gpu1", la1))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        for runs in results.values():
            for got in runs:
                for name in ref:
                    assert _rel(got[name], ref[name]) <= tol
        assert_all_on(la0.devices(), 0)
        assert_all_on(la1.devices(), 1)
    finally:
        la0.close()
        la1.close()
        cuda.set_device(0)


@pytest.fixture(scope="module")
def inductor_bundle(tmp_path_factory):
    """A torch bundle whose engines ship Inductor's own artifact ("bundled"), built only where two GPUs exist."""
    if cuda.device_count() < 2:
        pytest.skip(f"needs two CUDA GPUs; cuda-python sees {cuda.device_count()}")
    pytest.importorskip("torch")
    from parastream.pipeline import build

    tmp = tmp_path_factory.mktemp("inductor_bundle")
    path = _models(tmp)["three_branch"]
    # built as a user builds (the engines compiled for the tensors the GPU launcher hands them), on GPU 0
    return path, build(path, tmp / "bundled", backend="torch", streams=3, precision="fp32", search=False,
                       measure=False, inductor_format="bundled")


@pytest.mark.gpu
def test_inductor_artifacts_on_gpu_1_compile_again_there(inductor_bundle):
    """Inductor's own artifact names the GPU it was compiled on: on GPU 1 its engines compile from branch.onnx at
    load, on GPU 0 they load as built; both give onnxruntime's outputs, each launcher's objects on its GPU."""
    from parastream.launcher import load

    path, bundle = inductor_bundle
    la0, la1 = load(bundle.path, device=0), load(bundle.path, device=1)
    try:
        shipped = [e for e in la0.engines if e is not None and e.meta.get("compiled") == "inductor"]
        assert shipped, "the bundle has no engine with Inductor's own artifact"
        assert not any(e.compiled_at_load for e in shipped), [e.compiled_at_load_because for e in shipped]
        assert all(e.compiled_at_load for e in la1.engines if e is not None and e.meta.get("compiled") == "inductor")
        feeds = _feeds(bundle, 8)
        ref, a, b = _ref(path, feeds), la0(feeds), la1(feeds)
        for name in ref:
            assert _rel(a[name], ref[name]) <= 1e-3 and _rel(b[name], ref[name]) <= 1e-3
        assert_all_on(la0.devices(), 0)
        assert_all_on(la1.devices(), 1)
    finally:
        la0.close()
        la1.close()
        cuda.set_device(0)


@pytest.mark.gpu
def test_launcher_views_on_the_second_gpu_say_so(bundles, two_gpus):
    """A launcher on device 1 hands out views whose DLPack device is 1; torch wraps them there without a copy."""
    import torch

    from parastream.launcher.gpu import GpuLauncher

    path, bundle = bundles[("three_branch", "fp32")]
    raw = None
    try:
        cuda.set_device(1)
        raw = cuda.malloc(64)
        cuda.set_device(0)  # the current device differs from the memory's
        assert DeviceArray(raw, (16,), "float32").__dlpack_device__() == (2, 1)
        assert DeviceArray(raw, (16,), "float32").torch().device == torch.device("cuda", 1)
    finally:
        if raw is not None:
            cuda.set_device(1)
            cuda.free(raw)
        cuda.set_device(0)
    with GpuLauncher(bundle, device=1) as la:
        assert la.arena_device == 1
        feeds = _feeds(bundle, 4)
        ref = _ref(path, feeds)
        la(feeds)
        cuda.set_device(0)
        for name, arr in la.outputs().items():
            assert arr.__dlpack_device__() == (2, 1)
            t = torch.from_dlpack(arr)
            assert t.device == torch.device("cuda", 1) and t.data_ptr() == la.addr[name]
            assert _rel(t.cpu().numpy(), ref[name]) <= 1e-3
        for name, arr in la.inputs().items():
            assert arr.__dlpack_device__() == (2, 1)
        assert_all_on(la.devices(), 1)
        assert cuda.get_device() == 0  # close() below runs on the launcher's device and restores this one
    assert cuda.get_device() == 0


@pytest.mark.gpu
def test_one_stream_plan_runs_on_the_origin_stream(tmp_path):
    """A plan of one stream forks nothing: its branches run on the origin stream (measured faster than a side
    stream on the H100), with the outputs of onnxruntime."""
    pytest.importorskip("torch")
    from handmade_bundles import make_bundle

    from parastream.launcher.gpu import GpuLauncher

    path = _models(tmp_path)["inception_block"]
    bundle = make_bundle(path, tmp_path / "one", backend="torch", streams=1, precision="fp32")
    assert bundle.plan.num_streams == 1
    with GpuLauncher(bundle) as la:
        assert la.single_stream and la.streams == []
        feeds = _feeds(bundle, 5)
        ref, got = _ref(path, feeds), la(feeds)
        for name in ref:
            assert _rel(got[name], ref[name]) <= 1e-3


@pytest.mark.gpu
def test_stream_gate_holds_a_stream_until_opened_and_its_timer_opens_it():
    rt = cuda.runtime()
    stream = cuda.stream_create()
    gate = cuda.StreamGate(limit_s=30.0)
    ev = cuda.event_create()
    try:
        gate.close(stream)
        cuda.event_record(ev, stream)
        import time

        time.sleep(0.2)
        assert rt.cudaEventQuery(ev)[0] == rt.cudaError_t.cudaErrorNotReady  # held
        gate.open()
        cuda.stream_synchronize(stream)
        assert rt.cudaEventQuery(ev)[0] == rt.cudaError_t.cudaSuccess and gate.opened_by_timer == 0
        gate.close(stream)  # closes again for the next block
        cuda.event_record(ev, stream)
        time.sleep(0.1)
        assert rt.cudaEventQuery(ev)[0] == rt.cudaError_t.cudaErrorNotReady
        gate.open()
        cuda.stream_synchronize(stream)

        timed = cuda.StreamGate(limit_s=0.3)
        t0 = time.perf_counter()
        timed.close(stream)  # never opened by the host: the timer lets the stream go
        cuda.stream_synchronize(stream)
        assert time.perf_counter() - t0 >= 0.25 and timed.opened_by_timer == 1
        timed.free()
    finally:
        gate.free()
        cuda.event_destroy(ev)
        cuda.stream_destroy(stream)


@pytest.mark.gpu
def test_measure_holds_every_block_of_a_captured_plan(bundles):
    from parastream.launcher.gpu import GpuLauncher
    from parastream.pipeline.bench import measure

    _, bundle = bundles[("inception_block", "fp16")]
    with GpuLauncher(bundle) as la:
        single = GpuLauncher(bundle, single_stream=True, engines=la.engines)
        info = {}
        times = measure({"plan": la, "single": single}, runs=60, warmup=5, info=info)
        assert info["held"] == info["blocks"] == 6 and info["opened_by_timer"] == 0
        assert all(len(t) == 60 and (t > 0).all() for t in times.values())
        single.close()
