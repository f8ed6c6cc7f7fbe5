"""The real tritonserver with numpy 2 in the stub's environment.

Triton 2.51's Python backend (the one nvidia-pytriton ships) was built with pybind11 2.10, which reads numpy 2
arrays as empty: ``pb_utils.Tensor(name, array)`` sent the client an empty output ("cannot reshape array of
size 0"), first seen on the H100, where the torch environment has numpy 2.  nvidia-pytriton pins numpy < 2 for
its own Python, so the main tier runs numpy 1; here the stubs run in a venv of this interpreter that has numpy
2 (pip-installed into it) and sees everything else of this environment (parastream, onnxruntime) after it.
"""

from __future__ import annotations

import os
import site
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from triton_clients import client_of, expected, infer, make_inputs, random_feeds
from tritonserver_process import built_and_served


ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "examples/models/inception_block.onnx"
NUMPY2 = "numpy>=2,<2.3"


@pytest.fixture(scope="module")
def numpy2_bin(tmp_path_factory, tritonserver_or_skip):
    """The bin folder of a venv with numpy 2 that also sees this environment's packages (after its own)."""
    venv = tmp_path_factory.mktemp("numpy2") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python3"
    own = subprocess.run([str(py), "-c", "import site; print(site.getsitepackages()[0])"], check=True,
                         capture_output=True, text=True).stdout.strip()
    # this environment's site folders, processed as site folders (their .pth files: the editable install's
    # finder) and placed after the venv's own
    dirs = [d for d in site.getsitepackages() + [site.getusersitepackages()] if os.path.isdir(d)]
    Path(own, "zz_outer_environment.pth").write_text("".join(f"import site; site.addsitedir({d!r})\n" for d in dirs))
    got = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", own, "--no-deps", NUMPY2],
                         capture_output=True, text=True)
    if got.returncode != 0:
        reason = f"cannot install {NUMPY2} into a venv: {got.stderr.strip().splitlines()[-1:]}"
        if os.environ.get("PARASTREAM_REQUIRE_TRITON_SERVER") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    version = subprocess.run([str(py), "-c", "import numpy, parastream.launcher; print(numpy.__version__)"], check=True,
                             capture_output=True, text=True).stdout.strip()
    assert version.startswith("2."), version
    return venv / "bin"


@pytest.fixture(scope="module")
def server(numpy2_bin, tmp_path_factory):
    work = tmp_path_factory.mktemp("served_numpy2")
    with built_and_served(MODEL, work, work / "server", "m", python_bin=numpy2_bin) as srv:
        yield srv


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_outputs_right_with_numpy2_in_the_stub(server, numpy2_bin, protocol):
    # the stub really runs the venv's numpy 2
    maps = "".join(Path(f"/proc/{pid}/maps").read_text() for pid in server.stub_pids())
    assert str(numpy2_bin.parent) in maps and "numpy" in maps
    sess = ort.InferenceSession(str(MODEL), providers=["CPUExecutionProvider"])
    feeds = random_feeds(sess, np.random.default_rng(0))
    ref = expected(sess, feeds)
    client = client_of(server, protocol)
    try:
        assert client.is_model_ready("m")
        got = infer(client, protocol, "m", make_inputs(protocol, feeds), list(ref))
    finally:
        client.close()
    for name, want in ref.items():
        assert got[name].shape == want.shape
        np.testing.assert_allclose(got[name], want, rtol=1e-4, atol=1e-5)
