"""A detector in miniature served by NVIDIA's tritonserver (CPU, onnxruntime engines): its bundle's static part
replayed, its data-dependent tail (pipeline/host_tail.py) run after it in model.py's process; over HTTP and gRPC
each request gets onnxruntime's outputs on the original, the number of detections its own (none included)."""

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


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_each_request_gets_its_own_detections(served, protocol):
    server, sess = served
    client = client_of(server, protocol)
    try:
        counts = set()
        for seed, scale in [(0, 1.0), (1, 3.0), (2, 0.0)]:
            x = (np.random.default_rng(seed).standard_normal((1, 3, 16, 16)) * scale).astype(np.float32)
            got = _infer(client, protocol, "det", make_inputs(protocol, {"x": x}), ["logits", "scores", "boxes"])
            want = dict(zip(["logits", "scores", "boxes"], sess.run(None, {"x": x})))
            for name in want:
                assert got[name].shape == want[name].shape, (name, seed)
                np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6)
            counts.add(len(got["scores"]))
        assert 0 in counts and len(counts) > 1
    finally:
        client.close()
