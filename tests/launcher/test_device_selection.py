"""Choosing the GPU a bundle runs on, on the CPU: ``--device`` and ``load(device=)`` parsing and their errors,
``export-triton --gpus``, and the launcher's own device handling (the current device set and restored around
its calls, its warm-up threads on its device, device inputs from another GPU refused, a kernels artifact's
wrapper re-targeted).  Placement on real GPUs: tests/launcher/test_gpu_launcher.py (gpu; two GPUs) and
tests/triton_server/test_tritonserver_gpu.py (two GPUs)."""

from __future__ import annotations

import enum
import threading
import types

import numpy as np
import onnx
import pytest
from graphs import three_branch_model

import parastream.launcher as launcher_api
from parastream.launcher import cuda
from parastream.launcher.errors import ParastreamError
from parastream.pipeline.cli import main


@pytest.fixture
def two_gpus(monkeypatch):
    """A machine with two (made-up) GPUs, as cuda-python would report it."""
    monkeypatch.setattr(cuda, "device_count", lambda: 2)
    monkeypatch.setattr(cuda, "device_name", lambda device=0: f"Test GPU {device}")


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(cuda, "device_count", lambda: 0)


@pytest.fixture
def model_path(tmp_path):
    p = tmp_path / "m.onnx"
    m = three_branch_model()
    m.ir_version = 8
    onnx.save(m, p)
    return p


@pytest.fixture
def cpu_bundle(model_path, tmp_path):
    from handmade_bundles import make_bundle

    return make_bundle(model_path, tmp_path / "cpu.bundle", backend="onnxruntime", streams=3)


@pytest.fixture
def torch_bundle(model_path, tmp_path):
    pytest.importorskip("torch")
    from handmade_bundles import make_bundle

    return make_bundle(model_path, tmp_path / "torch.bundle", backend="torch", streams=3, compile=False)


# -- parsing ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value,want", [("auto", ("auto", None)), ("cpu", ("cpu", None)), ("CUDA", ("cuda", None)),
                                        ("cuda:0", ("cuda", 0)), ("cuda:1", ("cuda", 1)), ("1", ("cuda", 1)),
                                        (0, ("cuda", 0)), (1, ("cuda", 1)), (" cuda:1 ", ("cuda", 1))])
def test_device_values_parse(two_gpus, value, want):
    assert cuda.parse_device(value) == want


@pytest.mark.parametrize("value", ["gpu1", "cuda:", "cuda:-1", "cuda:x", "cuda1", "", -1, True, "cuda:0,1"])
def test_a_malformed_device_is_one_line_naming_the_option_and_the_gpus(two_gpus, value):
    with pytest.raises(ParastreamError) as e:
        cuda.parse_device(value, option="device")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("device=") and "is not a device" in msg
    assert "2 GPUs: cuda:0 (Test GPU 0), cuda:1 (Test GPU 1)" in msg


@pytest.mark.parametrize("value", ["cuda:2", 2, "7"])
def test_a_gpu_the_machine_lacks_is_refused_naming_those_it_has(two_gpus, value):
    with pytest.raises(ParastreamError, match=r"no GPU cuda:\d; this machine has 2 GPUs: cuda:0 \(Test GPU 0\), "
                                              r"cuda:1 \(Test GPU 1\)$"):
        cuda.parse_device(value)


def test_without_a_gpu_an_explicit_gpu_says_there_is_none(no_gpu):
    with pytest.raises(ParastreamError, match=r"^device='cuda:0': no GPU cuda:0; this machine has no GPU"):
        cuda.parse_device("cuda:0")
    assert cuda.parse_device("cpu") == ("cpu", None)  # asks nothing of CUDA


# -- load(device=) ------------------------------------------------------------------------------------------
class _Recorder:
    """A GpuLauncher stand-in recording the device it is made for."""

    made: list = []

    def __init__(self, bundle, *, graph=True, device=0, **kw):
        self.bundle, self.device, self.graph = bundle, device, graph
        _Recorder.made.append(self)


@pytest.mark.parametrize("device,want", [("cuda:1", 1), (1, 1), ("cuda", 0), ("cuda:0", 0), (0, 0)])
def test_load_makes_the_gpu_launcher_on_the_gpu_asked_for(two_gpus, monkeypatch, cpu_bundle, device, want):
    from parastream.launcher import gpu as gpu_module
    from parastream.launcher.bundle import Bundle

    _Recorder.made = []
    opened = []
    real_open = Bundle.open.__func__

    def open_(cls, path, **kw):
        opened.append(kw.get("device"))
        kw["device"] = None  # no CUDA context to start here
        return real_open(cls, path, **kw)

    monkeypatch.setattr(Bundle, "open", classmethod(open_))
    monkeypatch.setattr(gpu_module, "GpuLauncher", _Recorder)
    runner = launcher_api.load(cpu_bundle.path, device=device)
    assert isinstance(runner, _Recorder) and runner.device == want
    assert opened == [want]  # the bundle's open starts that GPU's context, not GPU 0's


def test_load_refuses_a_bad_device_before_opening_the_bundle(two_gpus, tmp_path):
    with pytest.raises(ParastreamError, match=r"^device='cuda:5': no GPU cuda:5; this machine has 2 GPUs"):
        launcher_api.load(tmp_path / "no-such-bundle", device="cuda:5")
    with pytest.raises(ParastreamError, match=r"^device='tpu' is not a device: give auto, cpu, cuda or cuda:N"):
        launcher_api.load(tmp_path / "no-such-bundle", device="tpu")


def test_load_on_the_cpu_is_unchanged(cpu_bundle):
    from parastream.launcher.cpu import CpuLauncher

    runner = launcher_api.load(cpu_bundle.path, device="cpu")
    assert isinstance(runner, CpuLauncher)
    feeds = {s.name: np.ones(s.shape, s.dtype) for s in cpu_bundle.plan.inputs}
    assert set(runner(feeds)) == {s.name for s in cpu_bundle.plan.outputs}


def test_a_dynamic_batch_bundle_takes_the_gpu_too(two_gpus, monkeypatch, cpu_bundle):
    from parastream.launcher import buckets

    made = []

    class Bucketed:
        def __init__(self, bundle, *, device="cpu", graph=True, gpu=0):
            made.append((device, gpu))

    monkeypatch.setattr(buckets, "BucketedLauncher", Bucketed)
    monkeypatch.setitem(cpu_bundle.manifest, "buckets", {"sizes": [1, 2]})
    launcher_api.load(cpu_bundle, device="cuda:1")
    assert made == [("cuda", 1)]


# -- the command line ---------------------------------------------------------------------------------------
def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize("command", ["run", "bench", "verify"])
def test_cli_device_errors_name_the_option_and_the_gpus(two_gpus, cpu_bundle, tmp_path, capsys, command):
    extra = ["--output-dir", str(tmp_path / "out")] if command == "run" else []
    with pytest.raises(SystemExit) as e:
        main([command, str(cpu_bundle.path), "--device", "cuda:2", *extra])
    assert e.value.code == 2
    line = _error_line(capsys)
    assert f"parastream {command}: error: argument --device: 'cuda:2': no GPU cuda:2" in line
    assert "cuda:0 (Test GPU 0), cuda:1 (Test GPU 1)" in line
    with pytest.raises(SystemExit):
        main([command, str(cpu_bundle.path), "--device", "gpu", *extra])
    assert "argument --device: 'gpu' is not a device: give auto, cpu, cuda or cuda:N" in _error_line(capsys)
    assert not (tmp_path / "out").exists()


def test_run_on_the_cpu_device_by_name(cpu_bundle, tmp_path, capsys):
    x = np.random.default_rng(0).standard_normal(cpu_bundle.plan.inputs[0].shape).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    assert main(["run", str(cpu_bundle.path), "--device", "cpu", "--input", f"{cpu_bundle.plan.inputs[0].name}={tmp_path / 'x.npy'}",
                 "--output-dir", str(tmp_path / "res")]) == 0
    assert (tmp_path / "res" / "output.npy").is_file()


def test_bench_passes_the_gpu_and_refuses_a_device_the_bundle_cannot_run_on(two_gpus, monkeypatch, cpu_bundle, torch_bundle,
                                                                             capsys):
    from parastream.pipeline import bench

    seen = []
    monkeypatch.setattr(bench, "bench_bundle", lambda bundle, **kw: seen.append(kw["gpu"]) or {})
    assert main(["bench", str(torch_bundle.path), "--device", "cuda:1", "--json"]) == 0
    assert main(["bench", str(torch_bundle.path), "--device", "cuda", "--json"]) == 0
    assert main(["bench", str(torch_bundle.path), "--json"]) == 0
    assert seen == [1, 0, 0]
    assert main(["bench", str(torch_bundle.path), "--device", "cpu"]) == 2
    assert "--device cpu:" in _error_line(capsys)
    assert main(["bench", str(cpu_bundle.path), "--device", "cuda:1"]) == 2
    line = _error_line(capsys)
    assert "--device cuda:1:" in line and "run on the CPU" in line


# -- export-triton --gpus --------------------------------------------------------------------------------------
def test_export_triton_places_instances_on_the_gpus_asked_for(torch_bundle, tmp_path, capsys):
    from parastream.pipeline.triton import read_config, validate_repository

    repo = tmp_path / "repo"
    assert main(["export-triton", str(torch_bundle.path), str(repo), "--name", "m", "--instances", "2", "--gpus", "0,1"]) == 0
    config = read_config(repo / "m" / "config.pbtxt")
    (group,) = config.instance_group
    assert group.kind == group.KIND_GPU and group.count == 2 and list(group.gpus) == [0, 1]
    assert validate_repository(repo) == []
    # without --gpus: Triton's default, the count on every GPU of the server
    assert main(["export-triton", str(torch_bundle.path), str(repo), "--name", "n"]) == 0
    (group,) = read_config(repo / "n" / "config.pbtxt").instance_group
    assert list(group.gpus) == [] and group.count == 1


@pytest.mark.parametrize("gpus,says", [("0,0", "names a GPU twice"), ("a,1", "is not a list of GPU numbers"),
                                       ("-1", "is not a list of GPU numbers"), ("", "is not a list of GPU numbers")])
def test_export_triton_refuses_a_bad_gpu_list(torch_bundle, tmp_path, capsys, gpus, says):
    with pytest.raises(SystemExit) as e:
        main(["export-triton", str(torch_bundle.path), str(tmp_path / "repo"), "--name", "m", "--gpus", gpus])
    assert e.value.code == 2
    line = _error_line(capsys)
    assert "argument --gpus:" in line and says in line
    assert not (tmp_path / "repo").exists()


def test_export_triton_gpus_of_a_cpu_bundle_is_an_error(cpu_bundle, tmp_path, capsys):
    assert main(["export-triton", str(cpu_bundle.path), str(tmp_path / "repo"), "--name", "m", "--gpus", "0"]) == 2
    line = _error_line(capsys)
    assert "--gpus 0:" in line and "KIND_CPU" in line
    assert not (tmp_path / "repo" / "m").exists()


def test_export_triton_api_checks_gpus(torch_bundle, tmp_path):
    from parastream.pipeline.triton import export_triton

    for gpus, says in (([1, 1], "twice"), ([-2], "GPU numbers"), ([], "GPU numbers")):
        with pytest.raises(ParastreamError, match=says):
            export_triton(torch_bundle, tmp_path / "repo", name="m", gpus=gpus)


def test_validation_flags_gpus_on_cpu_instances(cpu_bundle, tmp_path):
    from google.protobuf import text_format

    from parastream.pipeline.triton import export_triton, read_config, validate_repository

    export_triton(cpu_bundle, tmp_path / "repo", name="m")
    cfg_path = tmp_path / "repo" / "m" / "config.pbtxt"
    config = read_config(cfg_path)
    config.instance_group[0].gpus.extend([0, 0])
    cfg_path.write_text(text_format.MessageToString(config))
    problems = validate_repository(tmp_path / "repo")
    assert any("kind KIND_CPU lists gpus [0, 0]" in p for p in problems)
    assert any("each GPU once" in p for p in problems)


# -- the launcher's device handling, with a stand-in CUDA runtime ---------------------------------------------
class _FakeRuntime:
    """cudaGetDevice/cudaSetDevice per thread and pointer attributes on made-up devices."""

    class cudaError_t(enum.Enum):
        cudaSuccess = 0

    class cudaMemoryType(enum.Enum):
        cudaMemoryTypeDevice = 2
        cudaMemoryTypeManaged = 3

    def __init__(self, pointers: dict | None = None):
        self.local = threading.local()
        self.sets: list[tuple[str, int]] = []
        self.pointers = pointers or {}

    def cudaGetDevice(self):
        return self.cudaError_t.cudaSuccess, getattr(self.local, "device", 0)

    def cudaSetDevice(self, device):
        self.local.device = device
        self.sets.append((threading.current_thread().name, device))
        return (self.cudaError_t.cudaSuccess,)

    def cudaPointerGetAttributes(self, ptr):
        return self.cudaError_t.cudaSuccess, types.SimpleNamespace(type=self.cudaMemoryType.cudaMemoryTypeDevice,
                                                                   device=self.pointers[int(ptr)])


def test_on_device_sets_the_device_for_the_block_and_restores_it(monkeypatch):
    fake = _FakeRuntime()
    monkeypatch.setattr(cuda, "_rt", fake)
    with cuda.on_device(1):
        assert cuda.get_device() == 1
        with cuda.on_device(1):  # already current: nothing set
            pass
    assert cuda.get_device() == 0
    assert [d for _, d in fake.sets] == [1, 0]
    with cuda.on_device(0):
        pass
    assert len(fake.sets) == 2  # the current device costs one query, no set
    with pytest.raises(RuntimeError), cuda.on_device(1):
        raise RuntimeError("an engine failed")
    assert cuda.get_device() == 0  # restored on the way out of an error too


def test_the_warm_up_thread_runs_on_each_launchers_device(monkeypatch):
    """The process's one warm-up thread is shared by launchers on any GPU: each warm-up and each launcher's
    capture run there on that launcher's device."""
    from parastream.launcher.gpu import _Warmer

    fake = _FakeRuntime()
    monkeypatch.setattr(cuda, "_rt", fake)
    seen = []

    class Engine:
        def warm(self, stream):
            seen.append((stream, cuda.get_device()))

    for device, streams in ((1, [11, 12]), (0, [21, 22])):
        la = types.SimpleNamespace(device=device, streams=streams, origin=10, single_stream=False, _h=lambda s: s)
        warmer = _Warmer(la)
        for s in (0, 1):
            warmer.submit(types.SimpleNamespace(stream=s), Engine())
        warmer.wait()
        assert warmer.run(cuda.get_device) == device
    assert sorted(seen) == [(11, 1), (12, 1), (21, 0), (22, 0)]
    assert all(name.startswith("parastream-warm") for name, _ in fake.sets)


def _launcher_on(device: int):
    """A GpuLauncher with just what ``_device_pointer`` reads: its device, and a producer event no one records."""
    from parastream.launcher.gpu import GpuLauncher

    la = GpuLauncher.__new__(GpuLauncher)
    la.device, la._closed = device, True
    return la


class _CudaArray:
    def __init__(self, ptr: int, shape, typestr="<f4"):
        self.__cuda_array_interface__ = {"shape": tuple(shape), "typestr": typestr, "data": (ptr, False), "version": 3}


def test_a_device_input_on_another_gpu_is_refused_naming_both(monkeypatch):
    from parastream.launcher.plan import TensorSpec

    monkeypatch.setattr(cuda, "_rt", _FakeRuntime({0x1000: 0, 0x2000: 1}))
    spec = TensorSpec("x", "float32", [2, 3])
    la = _launcher_on(1)
    assert la._device_pointer(spec, _CudaArray(0x2000, (2, 3))) == 0x2000  # on its own GPU: taken as it is
    with pytest.raises(ParastreamError, match=r"^input 'x' is on cuda:0, this launcher runs on cuda:1; move it there "
                                              r"first \(x.to\('cuda:1'\)\): a replay copies nothing between GPUs$"):
        la._device_pointer(spec, _CudaArray(0x1000, (2, 3)))
    # a DeviceArray of another launcher says its device without a query
    with pytest.raises(ParastreamError, match="is on cuda:3"):
        la._device_pointer(spec, cuda.DeviceArray(0x3000, (2, 3), "float32", device=3))


# -- a kernels artifact re-targeted to the launcher's GPU --------------------------------------------------------
WRAPPER = """
def call(args):
    with torch.cuda._DeviceGuard(0):
        torch.cuda.set_device(0)
        buf0 = empty_strided_cuda((4, 4), (4, 1), torch.float32)
        stream0 = get_raw_stream(0)
        triton_poi_fused_0.run(arg0_1, buf0, 16, stream=stream0)
    return (buf0, 'index=0', "get_raw_stream_x(0)")
"""


def test_a_wrapper_names_the_gpu_it_is_loaded_on():
    from parastream.launcher.engines.inductor_kernels import on_device

    moved = on_device(WRAPPER, 1)
    assert "torch.cuda._DeviceGuard(1)" in moved and "torch.cuda.set_device(1)" in moved and "get_raw_stream(1)" in moved
    assert "(0)" not in moved.replace("get_raw_stream_x(0)", "")  # every device call re-targeted
    assert "'index=0'" in moved and "get_raw_stream_x(0)" in moved  # nothing else touched
    assert on_device(WRAPPER, 0) == WRAPPER


def test_a_kernels_artifact_records_its_device():
    pytest.importorskip("torch")
    import io
    import json
    import zipfile

    from parastream.launcher.engines import inductor_kernels as ik

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("kernels.json", json.dumps({"format": ik.FORMAT, "kernels": {}, "extern_torch": [], "aligned": []}))
        z.writestr("wrapper.py", "def call(args):\n    return get_raw_stream(0)\n")
    art = ik.KernelsArtifact(buf.getvalue(), device=1, launch=lambda *a: None)
    assert art.device == 1
    art._call.__globals__["get_raw_stream"] = lambda d: d
    assert art() == 1  # the wrapper asks for GPU 1's stream


class _FakeDriver:
    """cuda-python's driver API as the device queries use it: contexts on made-up devices, a context stack."""

    class CUresult(enum.Enum):
        CUDA_SUCCESS = 0
        CUDA_ERROR_INVALID_VALUE = 1

    def __init__(self, stream_ctx: dict, ctx_device: dict, kernel_ctx: dict):
        self.stream_ctx, self.ctx_device, self.kernel_ctx, self.stack = stream_ctx, ctx_device, kernel_ctx, []

    def cuStreamGetCtx(self, stream):
        return self.CUresult.CUDA_SUCCESS, self.stream_ctx[int(stream)]

    def cuCtxPushCurrent(self, ctx):
        self.stack.append(ctx)
        return (self.CUresult.CUDA_SUCCESS,)

    def cuCtxGetDevice(self):
        return self.CUresult.CUDA_SUCCESS, self.ctx_device[self.stack[-1]]

    def cuCtxPopCurrent(self):
        return self.CUresult.CUDA_SUCCESS, self.stack.pop()

    def cuGraphKernelNodeGetParams(self, node):
        return self.CUresult.CUDA_SUCCESS, types.SimpleNamespace(ctx=self.kernel_ctx[node])


class _FakeGraphRuntime(_FakeRuntime):
    class cudaGraphNodeType(enum.Enum):
        cudaGraphNodeTypeKernel = 0
        cudaGraphNodeTypeMemcpy = 1
        cudaGraphNodeTypeMemset = 2
        cudaGraphNodeTypeEventRecord = 3

    def __init__(self, nodes: dict, pointers: dict):
        super().__init__(pointers)
        self.nodes = nodes  # node -> (type name, params)

    def cudaGraphGetNodes(self, graph, n):
        return (self.cudaError_t.cudaSuccess, list(self.nodes)[:n] if n else None, len(self.nodes))

    def cudaGraphNodeGetType(self, node):
        return self.cudaError_t.cudaSuccess, getattr(self.cudaGraphNodeType, self.nodes[node][0])

    def cudaGraphMemsetNodeGetParams(self, node):
        return self.cudaError_t.cudaSuccess, self.nodes[node][1]

    def cudaGraphMemcpyNodeGetParams(self, node):
        return self.cudaError_t.cudaSuccess, self.nodes[node][1]

    def cudaPointerGetAttributes(self, ptr):
        if int(ptr) not in self.pointers:  # host memory
            return self.cudaError_t.cudaSuccess, types.SimpleNamespace(type=types.SimpleNamespace(name="cudaMemoryTypeHost"),
                                                                       device=-1)
        return super().cudaPointerGetAttributes(ptr)


def test_device_queries_read_contexts_pointers_and_graph_nodes(monkeypatch):
    """Streams by their context's device, a graph by its kernel nodes' contexts (unset ones not counted), its
    memsets' destinations and its copies' ends (-1 for host memory); the context stack is left as it was."""
    ptr = lambda n: types.SimpleNamespace(ptr=n)  # noqa: E731 - a cudaPitchedPtr
    rt = _FakeGraphRuntime({10: ("cudaGraphNodeTypeKernel", None), 11: ("cudaGraphNodeTypeKernel", None),
                            12: ("cudaGraphNodeTypeMemset", types.SimpleNamespace(dst=0x1000)),
                            13: ("cudaGraphNodeTypeMemcpy", types.SimpleNamespace(srcPtr=ptr(0x1000), dstPtr=ptr(0x2000))),
                            14: ("cudaGraphNodeTypeMemcpy", types.SimpleNamespace(srcPtr=ptr(0x1000), dstPtr=ptr(0x9000))),
                            15: ("cudaGraphNodeTypeEventRecord", None)},
                           {0x1000: 1, 0x2000: 1})
    ctx0, ctx1 = 0x7000, 0x7100  # context handles (a CUcontext converts to int; 0 is none)
    drv = _FakeDriver(stream_ctx={7: ctx1, 8: ctx0}, ctx_device={ctx0: 0, ctx1: 1}, kernel_ctx={10: ctx1, 11: 0})
    monkeypatch.setattr(cuda, "_rt", rt)
    monkeypatch.setattr(cuda, "_drv", drv)
    assert cuda.stream_device(7) == 1 and cuda.stream_device(8) == 0
    assert cuda.graph_devices("graph") == {"kernels": [1], "memsets": [1], "copies": [(1, 1), (1, -1)]}
    assert drv.stack == []


def test_launcher_devices_lists_every_object(monkeypatch):
    """GpuLauncher.devices() over the queries above: an event recordable on the origin is on its device, one that
    is not is -1; an in-place Concat has no engine (None)."""
    from parastream.launcher.gpu import GpuLauncher

    rt = _FakeGraphRuntime({10: ("cudaGraphNodeTypeKernel", None)}, {0x1000: 1})
    rt.cudaStreamSynchronize = lambda stream: (rt.cudaError_t.cudaSuccess,)
    rt.cudaEventRecord = lambda event, stream: ((rt.cudaError_t.cudaSuccess if event != 99 else rt.cudaError_t.cudaErrorInvalidResourceHandle),)
    rt.cudaError_t = enum.Enum("cudaError_t", {"cudaSuccess": 0, "cudaErrorInvalidResourceHandle": 400})
    drv = _FakeDriver(stream_ctx={5: 0x7100, 6: 0x7100}, ctx_device={0x7100: 1}, kernel_ctx={10: 0x7100})
    monkeypatch.setattr(cuda, "_rt", rt)
    monkeypatch.setattr(cuda, "_drv", drv)
    la = GpuLauncher.__new__(GpuLauncher)
    la.device, la._closed, la._arena, la.origin, la.streams = 1, False, 0x1000, 5, [6]
    la._fork, la._producer_event, la._joins, la._events = 20, 21, [22], {0: 99}
    la.engines = [types.SimpleNamespace(devices=lambda: {1}), None]
    la._graph = "graph"
    assert la.devices() == {"arena": 1, "origin": 1, "streams": [1], "events": [1, 1, 1, -1], "engines": [[1], None],
                            "graph": {"kernels": [1], "memsets": [], "copies": []}}
    la._closed = True  # nothing of it to release
