"""Dynamic shapes on the GPU (torch engines): a 1-layer BERT with sequence 1..32, one CUDA Graph per bucket over
one shared arena; any length in range in (numpy and device tensors), padded on the device and cut back, equal
to onnxruntime on the unpadded input; out of range refused."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from dynamic_models import bert_feeds, tiny_bert

from parastream.core.accuracy import scaled_error
from parastream.launcher import load
from parastream.launcher.buckets import BucketedLauncher
from parastream.launcher.errors import ParastreamError

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    from parastream.pipeline import build

    tmp = tmp_path_factory.mktemp("gpu_grid")
    path = tiny_bert(tmp / "bert.onnx")
    bundle = build(path, tmp / "out", backend="torch", search=False, measure=False,
                   min_shapes={"input_ids": [1, 1]}, max_shapes={"input_ids": [2, 32]},
                   shape_buckets={("input_ids", 1): [8, 16, 32]})
    return path, bundle


def _host(v) -> np.ndarray:
    """A launcher output on the host: numpy as is, a DeviceArray through torch, a torch tensor (an output cut
    along a non-first axis on the device) copied."""
    if isinstance(v, np.ndarray):
        return v
    t = v.torch() if hasattr(v, "torch") else v
    return t.cpu().numpy()


def _ort(path, feeds):
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def test_buckets_share_one_arena_and_every_bucket_has_a_graph(grid):
    from parastream.launcher.gpu import arena_bytes

    _path, bundle = grid
    with load(bundle.path) as run:
        assert isinstance(run, BucketedLauncher) and run.grid and len(run.sizes) == 6
        subs = bundle.bucket_bundles()
        assert run.shared.nbytes == max(arena_bytes(b) for b in subs.values())
        assert all(la._exec is not None for la in run.launchers.values())


@pytest.mark.parametrize("n, seq", [(1, 3), (2, 8), (1, 17), (2, 32)])
def test_any_shape_in_range_equals_onnxruntime_unpadded(grid, n, seq):
    path, bundle = grid
    feeds = bert_feeds(n, seq, seed=seq)
    with load(bundle.path) as run:
        got = _host(run(feeds)["hidden"])
    assert got.shape == (n, seq, 32)
    assert scaled_error(got, _ort(path, feeds)) <= 1e-3


@pytest.mark.parametrize("n", [1, 2])
def test_device_inputs_are_padded_on_the_device(grid, n):
    """Device feeds between buckets go straight into the bucket's buffers (one sequence, or a batch of them row
    by row: ``GpuLauncher.run_padded``); the outputs equal onnxruntime on the unpadded input."""
    torch = pytest.importorskip("torch")
    path, bundle = grid
    feeds = bert_feeds(n, 11, seed=11)
    with load(bundle.path) as run:
        dev = {k: torch.from_numpy(v).cuda() for k, v in feeds.items()}
        point = run.point_of(dev)
        assert run.leading_parts(dev, point, run.bucket_for(point)) is not None  # the in-place path, not tensors
        got = _host(run(dev)["hidden"])
    assert got.shape == (n, 11, 32) and scaled_error(got, _ort(path, feeds)) <= 1e-3


def test_out_of_range_is_refused(grid):
    _path, bundle = grid
    with load(bundle.path) as run, pytest.raises(ParastreamError, match="outside this bundle's range 1..32 on axis 'seq'"):
        run(bert_feeds(1, 33))
