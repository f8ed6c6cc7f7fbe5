"""A grid bundle (--min-shapes/--max-shapes over batch and sequence) exported in graph mode: the config declares
-1 on the sequence axis of every input and output that carries it, max_batch_size the batch axis's MAX; model.py
takes requests of any length in range, groups only requests of one shape and answers each with ONNX Runtime's
outputs on its unpadded input."""

from __future__ import annotations

import onnxruntime as ort
import pytest
from dynamic_models import bert_feeds, tiny_bert
from google.protobuf import text_format
from triton_helpers import exported_model_py, model_config_or_skip

from parastream.core.accuracy import scaled_error
from parastream.launcher.errors import ParastreamError
from parastream.pipeline import build
from parastream.pipeline.triton import export_triton, model_config_pb2

model_config_or_skip()


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("grid")
    path = tiny_bert(root / "bert.onnx")
    bundle = build(path, root / "out", backend="onnxruntime", search=False, min_shapes={"input_ids": [1, 1]},
                   max_shapes={"input_ids": [2, 16]}, shape_buckets={("input_ids", 1): [8, 16]})
    return bundle, path


def test_config_declares_the_dynamic_axes_minus_one(grid, tmp_path):
    bundle, _ = grid
    model_dir = export_triton(bundle, tmp_path / "repo", name="bert")
    config = text_format.Parse((model_dir / "config.pbtxt").read_text(), model_config_pb2().ModelConfig())
    assert config.max_batch_size == 2
    assert {io.name: list(io.dims) for io in config.input} == {"input_ids": [-1], "attention_mask": [-1],
                                                              "token_type_ids": [-1]}
    assert {io.name: list(io.dims) for io in config.output} == {"hidden": [-1, 32]}
    assert list(config.dynamic_batching.preferred_batch_size) == [1, 2]


def test_model_py_serves_any_length_in_range(grid, tmp_path, pb_utils):
    bundle, path = grid
    model = exported_model_py(bundle, tmp_path / "repo", "bert")
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    requests = [bert_feeds(1, 5, seed=1), bert_feeds(1, 5, seed=2), bert_feeds(1, 12, seed=3), bert_feeds(1, 17, seed=4)]
    calls = []
    runner = model.runner
    model.runner = lambda feeds: calls.append(tuple(feeds["input_ids"].shape)) or runner(feeds)
    responses = model.execute([pb_utils.InferenceRequest([pb_utils.Tensor(k, v) for k, v in f.items()]) for f in requests])
    assert calls == [(2, 5), (1, 12), (1, 17)]  # the two length-5 requests run together; the others alone
    for feeds, response in zip(requests[:3], responses[:3]):
        assert not response.has_error(), response.error().message()
        got = {t.name(): t.as_numpy() for t in response.output_tensors()}["hidden"]
        want = sess.run(None, feeds)[0]
        assert got.shape == want.shape and scaled_error(got, want) <= 1e-5
    assert responses[3].has_error() and "outside this bundle's range 1..16 on axis 'seq'" in responses[3].error().message()
    model.runner = runner
    model.finalize()


def test_max_batch_on_a_grid_without_a_batch_axis_is_refused(tmp_path):
    pytest.importorskip("transformers")
    path = tiny_bert(tmp_path / "bert.onnx")
    bundle = build(path, tmp_path / "out", backend="onnxruntime", search=False, min_shapes={"input_ids": [1, 8]},
                   max_shapes={"input_ids": [1, 16]})
    model_dir = export_triton(bundle, tmp_path / "repo", name="bert")
    config = text_format.Parse((model_dir / "config.pbtxt").read_text(), model_config_pb2().ModelConfig())
    assert config.max_batch_size == 0 and list(config.input[0].dims) == [1, -1]
    with pytest.raises(ParastreamError, match="has no dynamic batch axis"):
        export_triton(bundle, tmp_path / "repo2", name="bert", max_batch=2)
