"""The GPU tier (device machine): small_net as a torch bundle (fp32), exported KIND_GPU, served by tritonserver.

Over HTTP and gRPC, and over gRPC with the input in CUDA shared memory, so that Triton hands model.py a
GPU tensor, which it reads through DLPack without a host copy; every answer against onnxruntime on the
original model at the fp32 tolerances.  bench/triton_gpu.py times the same path on Inception-v3 and BERT.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from triton_clients import PROTOCOLS, client_of, expected, infer, make_inputs, random_feeds
from tritonserver_process import TritonServer

from parastream.pipeline import build
from parastream.pipeline.triton import export_triton, read_config
from parastream.pipeline.verify import DEFAULT_TOLERANCES

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "examples" / "models" / "small_net.onnx"
RTOL, ATOL = DEFAULT_TOLERANCES["fp32"]

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("tritonserver_or_skip")]


@pytest.fixture(scope="module")
def gpu_server(tmp_path_factory, tritonserver_or_skip):
    pytest.importorskip("torch")
    work = tmp_path_factory.mktemp("served_gpu")
    bundle = build(MODEL, work / "small_net.bundle", backend="torch", precision="fp32", search=False)
    repo = work / "repo"
    export_triton(bundle, repo, name="small_net")
    srv = TritonServer(repo, work / "server")
    try:
        srv.start(timeout=420)  # the stub loads torch and the engines
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def reference():
    return ort.InferenceSession(str(MODEL), providers=["CPUExecutionProvider"])


def test_config_is_kind_gpu(gpu_server):
    config = read_config(gpu_server.repo / "small_net" / "config.pbtxt")
    assert [g.kind for g in config.instance_group] == [config.instance_group[0].KIND_GPU]
    assert config.parameters["FORCE_CPU_ONLY_INPUT_TENSORS"].string_value == "no"


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_outputs_equal_onnxruntime(gpu_server, reference, protocol):
    feeds = random_feeds(reference, np.random.default_rng(11))
    want = expected(reference, feeds)
    client = client_of(gpu_server, protocol)
    try:
        assert client.is_model_ready("small_net")
        got = infer(client, protocol, "small_net", make_inputs(protocol, feeds), list(want))
    finally:
        client.close()
    for name, ref in want.items():
        np.testing.assert_allclose(got[name], ref, rtol=RTOL, atol=ATOL)


def test_gpu_input_through_cuda_shared_memory(gpu_server, reference):
    cudashm = pytest.importorskip("tritonclient.utils.cuda_shared_memory")
    feeds = random_feeds(reference, np.random.default_rng(12))
    want = expected(reference, feeds)
    x = np.ascontiguousarray(feeds["input"])
    client = client_of(gpu_server, "grpc")
    handle = cudashm.create_shared_memory_region("parastream_in", x.nbytes, 0)
    try:
        cudashm.set_shared_memory_region(handle, [x])
        client.register_cuda_shared_memory("parastream_in", cudashm.get_raw_handle(handle), 0, x.nbytes)
        for _ in range(3):  # the same region again: the replay reads it each time
            got = infer(client, "grpc", "small_net", make_inputs("grpc", feeds, shm={"input": "parastream_in"}), list(want))
            for name, ref in want.items():
                np.testing.assert_allclose(got[name], ref, rtol=RTOL, atol=ATOL)
    finally:
        client.unregister_cuda_shared_memory()
        cudashm.destroy_shared_memory_region(handle)
        client.close()
