"""The TensorRT backend's cuda-python side on a real GPU, with the TensorRT test double (marked gpu).

TensorRT itself cannot be installed in the project's CI (see test_tensorrt_real.py for the tests that
need it); here the double stands in for it while everything else is real: scratch memory from
cudaMalloc, cuda-python streams, the GPU launcher's device buffers and stream handles.  The double
executes synchronously (host round trips), so these use direct launches: nothing here can show
CUDA Graph capture of a TensorRT engine.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import trt_double
from graphs import ort_reference
from graphs import three_branch_model as _three_branch_model

from parastream.launcher.engines import tensorrt as backend

pytestmark = pytest.mark.gpu


class DeviceCopies:
    """Synchronous copies between host bytes and device memory at an integer address."""

    def __init__(self):
        from parastream.launcher import cuda

        self.cuda = cuda
        self.rt = cuda.runtime()

    def read(self, ptr: int, nbytes: int) -> bytes:
        buf = np.empty(nbytes, np.uint8)
        self.cuda.check(self.rt.cudaMemcpy(buf.ctypes.data, ptr, nbytes, self.rt.cudaMemcpyKind.cudaMemcpyDeviceToHost), "cudaMemcpy(D2H)")
        return buf.tobytes()

    def write(self, ptr: int, data: bytes) -> None:
        buf = np.frombuffer(data, np.uint8).copy()
        self.cuda.check(self.rt.cudaMemcpy(ptr, buf.ctypes.data, len(data), self.rt.cudaMemcpyKind.cudaMemcpyHostToDevice), "cudaMemcpy(H2D)")
        self.cuda.synchronize()  # a pageable copy may return before the DMA lands

    def synchronize(self, stream: int) -> None:
        self.cuda.stream_synchronize(stream)


def three_branch_model(**kw) -> onnx.ModelProto:
    model = _three_branch_model(**kw)
    model.ir_version = 8  # an IR version every onnxruntime reads
    return model


@pytest.fixture
def trt(monkeypatch, tmp_path):
    from trt_double import host_memory

    fake = trt_double.install(monkeypatch)
    monkeypatch.setattr(backend, "Memory", backend.CudaMemory)  # real device memory this time
    monkeypatch.setattr(host_memory, "DEVICE", DeviceCopies())
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return fake


def test_engine_run_on_cuda_memory_and_streams(trt, tmp_path):
    model = three_branch_model(seed=3)
    builder = backend.Builder(backend.BuildOptions(device="cuda"))
    data = builder.build(model, "branch_000")
    builder.close()
    engine = backend.TrtEngine(data)
    (_, ptr, size), = trt.DEVICE_MEMORY
    assert ptr == engine._scratch and ptr % 256 == 0 and size == engine.scratch_bytes
    x = np.random.default_rng(0).standard_normal((1, 4, 8, 8)).astype(np.float32)
    for _ in range(2):
        np.testing.assert_allclose(engine.run({"input": x})["output"], ort_reference(model, {"input": x})["output"], rtol=1e-6)
    stream = trt.calls("IExecutionContext", "execute_async_v3")[-1][2]["stream"]
    assert isinstance(stream, int) and stream != 0  # the engine's own cuda-python stream, as an integer handle
    engine.close()


def test_gpu_launcher_runs_tensorrt_branch_engines(trt, tmp_path):
    from handmade_bundles import make_bundle

    from parastream.launcher.gpu import GpuLauncher

    model = three_branch_model(seed=2, channels=8, size=12)
    model.ir_version = 8
    path = tmp_path / "three_branch.onnx"
    onnx.save(model, path)
    bundle = make_bundle(path, tmp_path / "bundle", backend="tensorrt", streams=3)
    assert all(b.engine.endswith(".plan") for b in bundle.plan.branches)
    x = np.random.default_rng(1).standard_normal((1, 8, 12, 12)).astype(np.float32)
    with GpuLauncher(bundle, graph=False) as run:
        contexts = trt.calls("ICudaEngine", "create_execution_context")
        assert len(contexts) == len(bundle.plan.branches)
        scratch = sorted((ptr, ptr + size) for _, ptr, size in trt.DEVICE_MEMORY)
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(scratch, scratch[1:]))  # disjoint
        trt.CALLS.clear()
        got = run({"input": x})["output"]
        # every branch was enqueued on its plan stream with the launcher's own buffers
        executes = trt.calls("IExecutionContext", "execute_async_v3")
        assert len(executes) == len(bundle.plan.branches)
        launcher_streams = {int(s) for s in run.streams}
        assert {e[2]["stream"] for e in executes} <= launcher_streams
        for e in executes:
            assert set(e[2]["addresses"].values()) <= set(run.addr.values())
    np.testing.assert_allclose(got, ort_reference(model, {"input": x})["output"], rtol=1e-5, atol=1e-6)
