"""A bundle with a data-dependent tail (a detector's post-processing, pipeline/host_tail.py) exported in graph mode:
its config declares the tail's outputs -1 where their size comes from the data and takes max_batch_size 0 only;
model.py answers each request with the outputs onnxruntime gives on the original, their shapes this run's."""

from __future__ import annotations


import numpy as np
import onnxruntime as ort
import pytest
from dynamic_models import small_detector
from google.protobuf import text_format
from triton_helpers import as_tensorrt_bundle, exported_model_py, model_config_or_skip

from parastream.launcher.bundle import write_manifest
from parastream.launcher.errors import ParastreamError
from parastream.pipeline import build
from parastream.pipeline.triton import export_triton, model_config_pb2, validate_repository

model_config_or_skip()


@pytest.fixture(scope="module")
def detector(tmp_path_factory):
    root = tmp_path_factory.mktemp("detector")
    path = small_detector(root / "det.onnx")
    return build(path, root / "out", backend="onnxruntime", search=False), path


def test_config_declares_the_tails_outputs_minus_one(detector, tmp_path):
    bundle, _ = detector
    model_dir = export_triton(bundle, tmp_path / "repo", name="det")
    config = text_format.Parse((model_dir / "config.pbtxt").read_text(), model_config_pb2().ModelConfig())
    assert config.max_batch_size == 0
    assert {io.name: list(io.dims) for io in config.input} == {"x": [1, 3, 16, 16]}
    assert [(io.name, list(io.dims)) for io in config.output] == [("logits", [1, 10]), ("scores", [-1]), ("boxes", [-1, 4])]
    assert validate_repository(tmp_path / "repo") == []


def test_max_batch_is_refused(detector, tmp_path):
    bundle, _ = detector
    with pytest.raises(ParastreamError, match="data-dependent tail.*--max-batch 0"):
        export_triton(bundle, tmp_path / "repo", name="det", max_batch=1)


def test_validation_catches_a_config_that_batches_it(detector, tmp_path):
    bundle, _ = detector
    model_dir = export_triton(bundle, tmp_path / "repo", name="det")
    config = (model_dir / "config.pbtxt").read_text().replace('name: "det"', 'name: "det"\nmax_batch_size: 1')
    (model_dir / "config.pbtxt").write_text(config)
    assert any("data-dependent tail" in p for p in validate_repository(tmp_path / "repo"))


def test_model_py_answers_each_request_with_its_own_shapes(detector, tmp_path, pb_utils):
    bundle, path = detector
    model = exported_model_py(bundle, tmp_path / "repo", "det")
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    inputs = [(rng.standard_normal((1, 3, 16, 16)) * s).astype(np.float32) for s in (1.0, 3.0, 0.0)]
    responses = model.execute([pb_utils.InferenceRequest([pb_utils.Tensor("x", x)]) for x in inputs])
    counts = set()
    for x, response in zip(inputs, responses):
        assert not response.has_error(), response.error().message()
        got = {t.name(): t.as_numpy() for t in response.output_tensors()}
        want = dict(zip(["logits", "scores", "boxes"], sess.run(None, {"x": x})))
        for name in want:
            assert got[name].shape == want[name].shape, name
            np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6)
        counts.add(len(got["scores"]))
    assert 0 in counts and len(counts) > 1
    model.finalize()


def test_ensemble_mode_is_refused(detector, tmp_path):
    """Must not serve the static part alone: an ensemble of TensorRT engines has no step for the tail."""
    import shutil

    bundle, _ = detector
    trt = as_tensorrt_bundle(bundle, tmp_path / "trt")  # (its manifest keeps the tail's record; the file is copied)
    shutil.copy(bundle.path / "tail.onnx", trt.path / "tail.onnx")
    write_manifest(trt.path, {k: v for k, v in trt.manifest.items() if k not in ("files", "version")})
    with pytest.raises(ParastreamError, match="--mode ensemble: .*data-dependent tail.*--mode graph"):
        export_triton(trt.path, tmp_path / "repo", name="det", mode="ensemble")
