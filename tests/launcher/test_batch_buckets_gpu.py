"""Dynamic batch on the GPU (torch engines): one CUDA Graph per bucket over one shared arena and origin stream,
n rows in and out for any n in range (numpy and device tensors), every bucket against onnxruntime."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from graphs import three_branch_model

from parastream.launcher import load
from parastream.launcher.buckets import BucketedLauncher
from parastream.launcher.errors import ParastreamError

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def bucketed(tmp_path_factory):
    from parastream.pipeline import build

    tmp = tmp_path_factory.mktemp("gpu_buckets")
    model = three_branch_model(batch="N")
    model.ir_version = 8
    onnx.save(model, tmp / "dyn.onnx")
    bundle = build(tmp / "dyn.onnx", tmp / "out", backend="torch", batch=(1, 2, 8), streams=3, search=False,
                   measure=False)
    return tmp / "dyn.onnx", bundle


def _reference(path, x):
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return sess.run(None, {"input": x})[0]


def test_buckets_share_one_arena_and_origin(bucketed):
    from parastream.launcher.gpu import arena_bytes

    _path, bundle = bucketed
    with load(bundle.path) as run:
        assert isinstance(run, BucketedLauncher) and run.sizes == [1, 2, 4, 8]
        subs = bundle.bucket_bundles()
        assert run.shared.nbytes == max(arena_bytes(b) for b in subs.values()) == arena_bytes(subs[8])
        assert {la._arena for la in run.launchers.values()} == {run.shared.arena}
        assert all(la.origin is run.shared.origin for la in run.launchers.values())
        assert all(la._exec is not None for la in run.launchers.values())  # one captured graph per bucket


@pytest.mark.parametrize("n", [1, 3, 8])
def test_any_batch_gets_its_rows_numpy_and_device(bucketed, n):
    import torch

    path, bundle = bucketed
    x = np.random.default_rng(n).standard_normal((n, 4, 8, 8)).astype(np.float32)
    ref = _reference(path, x)
    with load(bundle.path) as run:
        got = run({"input": x})["output"]
        assert got.shape == ref.shape
        np.testing.assert_allclose(got, ref, rtol=1e-3, atol=1e-3)
        dev = run({"input": torch.from_numpy(x).cuda()})["output"]
        assert tuple(dev.shape) == ref.shape
        np.testing.assert_allclose(dev.torch().cpu().numpy(), ref, rtol=1e-3, atol=1e-3)
        # one bucket after another on the shared arena: the earlier answer is not disturbed by padding rows
        other = np.random.default_rng(99).standard_normal((8, 4, 8, 8)).astype(np.float32)
        np.testing.assert_allclose(run({"input": other})["output"], _reference(path, other), rtol=1e-3, atol=1e-3)
        np.testing.assert_allclose(run({"input": x})["output"], ref, rtol=1e-3, atol=1e-3)
        with pytest.raises(ParastreamError, match="outside this bundle's range 1..8"):
            run({"input": np.zeros((9, 4, 8, 8), np.float32)})


def test_every_bucket_verified_at_build(bucketed):
    _path, bundle = bucketed
    per = bundle.report["buckets"]["per_bucket"]
    assert sorted(per, key=int) == ["1", "2", "4", "8"] and all(r["verified"] for r in per.values())
    assert bundle.report["buckets"]["between"]["passed"] is True
