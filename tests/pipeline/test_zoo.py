"""The example model zoo: valid, runnable, small, deterministic, and the committed files are current."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from parastream.pipeline import zoo

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "models"
NAMES = sorted(zoo.MODELS)
EXPECTED_OUTPUT = {
    "inception_block": (1, 256, 35, 35),
    "nasnet_cell": (1, 192, 28, 28),
    "transformer_layer": (1, 128, 256),
    "resnet_bottleneck": (1, 256, 28, 28),
    "small_net": (1, 10),
}


@pytest.fixture(scope="module")
def models() -> dict[str, onnx.ModelProto]:
    return {name: make() for name, make in zoo.MODELS.items()}


def test_the_zoo_has_the_five_models_and_a_demo_model():
    assert set(zoo.MODELS) == set(EXPECTED_OUTPUT)
    assert zoo.DEMO_MODEL in zoo.MODELS


@pytest.mark.parametrize("name", NAMES)
def test_model_is_valid_opset17_fp32_with_static_shapes(models, name):
    m = models[name]
    onnx.checker.check_model(m, full_check=True)
    assert {(o.domain, o.version) for o in m.opset_import} == {("", 17)}
    assert [i.name for i in m.graph.input] == ["input"] and [o.name for o in m.graph.output] == ["output"]
    inferred = onnx.shape_inference.infer_shapes(m, strict_mode=True)
    for v in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]:
        assert v.type.tensor_type.elem_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.INT64), v.name
        assert all(d.HasField("dim_value") for d in v.type.tensor_type.shape.dim), f"{v.name} has an unknown dimension"
    assert all(t.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.INT64) for t in m.graph.initializer)


@pytest.mark.parametrize("name", NAMES)
def test_every_node_has_a_unique_name(models, name):
    names = [n.name for n in models[name].graph.node]
    assert all(names) and len(set(names)) == len(names)


@pytest.mark.parametrize("name", NAMES)
def test_runs_in_onnxruntime_with_finite_order_one_outputs(models, name):
    sess = ort.InferenceSession(models[name].SerializeToString(), providers=["CPUExecutionProvider"])
    shape = sess.get_inputs()[0].shape
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    (y,) = sess.run(["output"], {"input": x})
    assert y.shape == EXPECTED_OUTPUT[name]
    assert np.isfinite(y).all()
    assert 0.1 < float(y.std()) < 10.0, "activations should stay of order one"


@pytest.mark.parametrize("name", NAMES)
def test_model_is_under_5_mb(models, name):
    assert models[name].ByteSize() < 5 * 1024 * 1024


@pytest.mark.parametrize("name", NAMES)
def test_generation_is_deterministic(models, name):
    assert zoo.MODELS[name]().SerializeToString() == models[name].SerializeToString()


def test_a_different_seed_gives_different_weights():
    assert zoo.inception_block(seed=1).SerializeToString() != zoo.inception_block(seed=0).SerializeToString()


def test_structure_the_rewrite_rules_rely_on(models):
    def ops(m):
        return [n.op_type for n in m.graph.node]

    # BatchNormalization stays a separate node after each Conv of the conv blocks.
    for name in ("inception_block", "resnet_bottleneck", "small_net"):
        assert "BatchNormalization" in ops(models[name])
    # Q/K/V: three MatMuls that read the same tensor.
    readers = {}
    for n in models["transformer_layer"].graph.node:
        if n.op_type == "MatMul":
            readers.setdefault(n.input[0], []).append(n.name)
    assert max(len(v) for v in readers.values()) == 3
    # NASNet: depthwise (grouped) separable convs.
    groups = [a.i for n in models["nasnet_cell"].graph.node for a in n.attribute if a.name == "group"]
    assert max(groups) > 1
    assert 100 <= len(models["small_net"].graph.node) <= 300


def test_committed_examples_equal_fresh_generation(tmp_path):
    written = zoo.write_all(tmp_path)
    assert [p.name for p in written] == [f"{n}.onnx" for n in zoo.MODELS]
    for path in written:
        committed = EXAMPLES / path.name
        assert committed.exists(), f"{committed} is missing: run python examples/make_models.py"
        assert committed.read_bytes() == path.read_bytes(), f"{committed} is stale: run python examples/make_models.py"
