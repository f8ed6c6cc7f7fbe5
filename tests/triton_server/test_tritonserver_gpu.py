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

from graphs import separable_as_nasnet
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


def test_an_instance_start_deserializes_the_cudnn_plans_its_engines_ship(tmp_path):
    """An fp16 bundle of NASNet's separable convolution, whose depthwise convolution runs a kernel cuDNN compiles at
    run time: its engine ships that plan, and a Triton instance's start deserializes it rather than compiling it
    again (model.py's load-phase line: plans loaded as many as shipped, none of the compiled ones built; where
    not, its next line says why).  NASNet-A Large's starts built its 23 plans in the stub, 4-6 s of an 8-10 s
    initialize, where a plain process loaded them.  The answer equals onnxruntime on the fp32 model."""
    import re

    from parastream.launcher.engines import cudnn_plans

    if cudnn_plans.frontend() is None:
        pytest.skip("no cuDNN frontend (nvidia-cudnn-frontend): depthwise convolutions are torch's own")
    model_path = tmp_path / "separable.onnx"
    import onnx

    onnx.save(separable_as_nasnet(), model_path)
    bundle = build(model_path, tmp_path / "b", backend="torch", precision="fp16", search=False, measure=False,
                   cudnn_plans=True)
    shipped = sum(e.get("cudnn_plans", 0) for e in bundle.report["engines"].values() if isinstance(e, dict))
    if not shipped:
        pytest.skip("cuDNN compiled no kernel at run time for this shape on this GPU: no plan to ship")
    export_triton(bundle, tmp_path / "repo", name="separable")
    srv = TritonServer(tmp_path / "repo", tmp_path / "server")
    sess = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    feeds = random_feeds(sess, np.random.default_rng(13))
    want = expected(sess, feeds)
    try:
        srv.start(timeout=420)
        client = client_of(srv, "http")
        try:
            got = infer(client, "http", "separable", make_inputs("http", feeds), list(want))
        finally:
            client.close()
        log = srv.log()
    finally:
        srv.stop()
    rtol, atol = DEFAULT_TOLERANCES["fp16"]
    for name, ref in want.items():
        np.testing.assert_allclose(got[name], ref, rtol=rtol, atol=atol)
    lines = re.findall(r"parastream: separable\S* load phases \(s, summed over engines\): ([^\n]*)", log)
    assert lines, log[-3000:]
    phases = {k: float(v) for k, v in re.findall(r"(\w+) ([\d.]+)", lines[-1])}
    refused = re.findall(r"cuDNN plans not used as shipped: ([^\n]*)", log)
    assert phases.get("plans_loaded") == shipped and phases.get("plans_built_compiled") == 0, (phases, refused)


# -- two GPUs: one repository, an instance on each GPU -------------------------------------------------------------
CLIENTS = 16  # concurrent clients of the throughput comparison
REQUESTS = 40  # requests per client


def _gpus() -> int:
    from parastream.launcher import cuda_device_count

    return cuda_device_count()


@pytest.fixture(scope="module")
def small_net_bundle(tmp_path_factory):
    pytest.importorskip("torch")
    if _gpus() < 2:
        pytest.skip(f"needs two CUDA GPUs; cuda-python sees {_gpus()}")
    work = tmp_path_factory.mktemp("two_gpus")
    return work, build(MODEL, work / "small_net.bundle", backend="torch", precision="fp32", search=False)


def _serve_on(work: Path, bundle, gpus: list[int]) -> TritonServer:
    repo = work / f"repo_{'_'.join(map(str, gpus))}"
    export_triton(bundle, repo, name="small_net", instances=1, gpus=gpus)
    (group,) = read_config(repo / "small_net" / "config.pbtxt").instance_group
    assert group.kind == group.KIND_GPU and group.count == 1 and list(group.gpus) == gpus
    srv = TritonServer(repo, work / f"server_{'_'.join(map(str, gpus))}")
    srv.start(timeout=420)
    return srv


def _throughput(server, feeds: dict, want: dict, utilisation: dict | None = None) -> float:
    """Requests per second of CLIENTS gRPC clients sending REQUESTS each, every answer checked against
    onnxruntime; with ``utilisation`` (GPU -> samples), each GPU's utilisation sampled (NVML) meanwhile."""
    import threading
    import time

    errors: list = []
    done = threading.Event()

    def client_loop():
        client = client_of(server, "grpc")
        try:
            for _ in range(REQUESTS):
                got = infer(client, "grpc", "small_net", make_inputs("grpc", feeds), list(want))
                for name, ref in want.items():
                    np.testing.assert_allclose(got[name], ref, rtol=RTOL, atol=ATOL)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
        finally:
            client.close()

    def sample():
        import torch

        while not done.is_set():
            for gpu in utilisation:
                utilisation[gpu].append(torch.cuda.utilization(gpu))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample) if utilisation is not None else None
    threads = [threading.Thread(target=client_loop) for _ in range(CLIENTS)]
    t0 = time.perf_counter()
    if sampler is not None:
        sampler.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    done.set()
    if sampler is not None:
        sampler.join()
    assert not errors, errors[0]
    return CLIENTS * REQUESTS / wall


def test_two_gpus_serve_together(small_net_bundle, reference, record_property):
    """A repository exported with one instance on each of GPU 0 and GPU 1 (instance_group gpus [0, 1]): the model
    is ready, answers right under 16 concurrent clients, and both GPUs run its kernels meanwhile (NVML
    utilisation).  The throughput against GPU 0 alone is recorded (``two_gpu_throughput_ratio``), not asserted: this
    small model is bound by the clients and the server, not by its GPUs; bench/triton_gpu.py --gpus 0,1 measures
    the ratio on models whose GPU time dominates."""
    pytest.importorskip("pynvml", reason="the per-GPU utilisation is read through NVML (pip install nvidia-ml-py)")
    work, bundle = small_net_bundle
    feeds = random_feeds(reference, np.random.default_rng(21))
    want = expected(reference, feeds)
    rates, busy = {}, {0: [], 1: []}
    for gpus in ([0], [0, 1]):
        srv = _serve_on(work, bundle, gpus)
        try:
            client = client_of(srv, "grpc")
            assert client.is_model_ready("small_net")
            client.close()
            _throughput(srv, feeds, want)  # warm-up: every instance has replayed
            rates[len(gpus)] = _throughput(srv, feeds, want, busy if len(gpus) == 2 else None)
        finally:
            srv.stop()
    ratio = rates[2] / rates[1]
    record_property("two_gpu_throughput_ratio", round(ratio, 3))
    record_property("requests_per_s", {k: round(v, 1) for k, v in rates.items()})
    print(f"throughput at {CLIENTS} clients: one GPU {rates[1]:.1f}/s, two GPUs {rates[2]:.1f}/s, ratio {ratio:.2f}")
    assert max(busy[0]) > 0 and max(busy[1]) > 0, busy  # both GPUs ran kernels under load
