"""What the GPU tests of the two compiled torch-engine formats share (test_torch_aoti.py, test_torch_inductor.py):
the bundle they build, and the checks both formats must pass."""

from __future__ import annotations

import shutil

import numpy as np
import onnx
import pytest

from parastream.launcher.engines import torch as tb
from parastream.launcher.errors import ParastreamError


def retag(data: bytes, **built_for) -> bytes:
    """The engine file ``data`` claiming to be compiled for ``built_for`` (device, arch, torch, ...)."""
    f = tb.EngineFile(data)
    meta = dict(f.meta, built_for=dict(f.meta["built_for"], **built_for))
    return tb.pack(meta, f.onnx(), f.compiled(), f.weights())


def small_net_bundle(folder, torch_artifact: str = "inductor"):
    """The zoo's small_net built for the GPU (torch, fp16, 4 streams, no search, engines shipping
    ``torch_artifact``) in ``folder``: (folder, bundle)."""
    from parastream.pipeline import build
    from parastream.pipeline.zoo import small_net

    onnx.save(small_net(), folder / "small_net.onnx")
    return folder, build(folder / "small_net.onnx", folder / "out", backend="torch", precision="fp16", streams=4,
                         search=False, torch_artifact=torch_artifact)


def assert_ships_compiled_engines_verified_as_loaded(bundle, compiled: str) -> None:
    """Every branch that runs an engine (all but in-place Concats) ships one compiled as ``compiled``, and the
    build's verification loaded them all without compiling one."""
    engines = bundle.report["engines"]
    done = [e for e in engines.values() if e["compiled"] == compiled]
    assert done and len(done) >= len(engines) - sum(b.concat_axis is not None for b in bundle.plan.branches)
    v = bundle.report["verification"]
    assert v["passed"] and v["engines_loaded"] >= len(done) and v["engines_compiled_at_load"] == 0, v.get("compiled_at_load_because")


def scaled_error(folder, bundle, x, y) -> float:
    """max|y - onnxruntime| / max|onnxruntime| on small_net's first output for the input ``x``."""
    import onnxruntime as rt

    ref = rt.InferenceSession(str(folder / "small_net.onnx"), providers=["CPUExecutionProvider"]).run(
        None, {bundle.plan.inputs[0].name: x})[0]
    return float(np.abs(y - ref).max() / np.abs(ref).max())


def assert_another_architecture_is_refused_naming_the_file(bundle, tmp_path) -> None:
    """A copy of the bundle with one compiled engine retagged for an A100 fails to load, naming that engine."""
    from parastream.launcher.bundle import Bundle
    from parastream.launcher.gpu import GpuLauncher

    copy = tmp_path / "copy"
    shutil.copytree(bundle.path, copy)
    b = next(b for b in bundle.plan.branches if tb.unpack((copy / b.engine).read_bytes())[2] is not None)
    (copy / b.engine).write_bytes(retag((copy / b.engine).read_bytes(), arch="sm_80", gpu="NVIDIA A100-SXM4-80GB"))
    with pytest.raises(ParastreamError, match=rf"{b.engine}: this torch engine was compiled for NVIDIA A100-SXM4-80GB \(sm_80\).*"
                                              rf"this machine has .*\(sm_\d+\)"):
        GpuLauncher(Bundle.open(copy, check_hashes=False))
