"""A detector in miniature served by NVIDIA's tritonserver (CPU, onnxruntime engines; and in the gpu tier, torch
engines with the tail on the GPU): its bundle's static part replayed, its data-dependent tail (pipeline/host_tail.py)
run after it in model.py's process; over HTTP and gRPC each request gets onnxruntime's outputs on the original,
the number of detections its own (none included)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from dynamic_models import small_detector
from triton_clients import PROTOCOLS, client_of, make_inputs
from triton_clients import infer as _infer
from tritonserver_process import built_and_served

pytestmark = [pytest.mark.usefixtures("tritonserver_or_skip"), pytest.mark.slow]


@pytest.fixture(scope="module")
def served(tmp_path_factory, tritonserver_or_skip):
    work = tmp_path_factory.mktemp("hosttail")
    path = small_detector(work / "det.onnx")
    with built_and_served(path, work, tmp_path_factory.mktemp("tritonserver"), "det") as srv:
        yield srv, ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def _each_request_gets_its_own_detections(server, sess, protocol, rtol, atol):
    client = client_of(server, protocol)
    try:
        counts = set()
        for seed, scale in [(0, 1.0), (1, 3.0), (2, 0.0)]:
            x = (np.random.default_rng(seed).standard_normal((1, 3, 16, 16)) * scale).astype(np.float32)
            got = _infer(client, protocol, "det", make_inputs(protocol, {"x": x}), ["logits", "scores", "boxes"])
            want = dict(zip(["logits", "scores", "boxes"], sess.run(None, {"x": x})))
            for name in want:
                assert got[name].shape == want[name].shape, (name, seed)
                np.testing.assert_allclose(got[name], want[name], rtol=rtol, atol=atol)
            counts.add(len(got["scores"]))
        assert 0 in counts and len(counts) > 1
    finally:
        client.close()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_each_request_gets_its_own_detections(served, protocol):
    _each_request_gets_its_own_detections(*served, protocol, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def served_gpu_tail(tmp_path_factory, tritonserver_or_skip):
    """The detector as a torch bundle (fp32) whose manifest places its tail on the GPU, exported KIND_GPU."""
    pytest.importorskip("torch")
    import json

    from tritonserver_process import serving

    from parastream.launcher.bundle import write_manifest
    from parastream.pipeline import build
    from parastream.pipeline.triton import export_triton

    work = tmp_path_factory.mktemp("gputail")
    path = small_detector(work / "det.onnx")
    bundle = build(path, work / "det.bundle", backend="torch", precision="fp32", search=False)
    # the build times the two places and may keep the host for a tail this small: the GPU's, as a build that timed
    # it faster would ship it
    manifest = json.loads((bundle.path / "manifest.json").read_text())
    manifest["host_tail"]["runs_on"] = "gpu"
    write_manifest(bundle.path, {k: v for k, v in manifest.items() if k not in ("files", "version")})
    export_triton(bundle.path, work / "repo", name="det")
    with serving(work / "repo", tmp_path_factory.mktemp("tritonserver_gpu")) as srv:
        yield srv, ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


@pytest.mark.gpu
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_tail_on_the_gpu_answers_each_request(served_gpu_tail, protocol):
    from parastream.pipeline.verify import DEFAULT_TOLERANCES

    # (torch engines in fp32 on the GPU: the verification's fp32 tolerances)
    _each_request_gets_its_own_detections(*served_gpu_tail, protocol, *DEFAULT_TOLERANCES["fp32"])
