"""Input shapes from ``--shapes`` and ``--batch``: a dimension name shared by several inputs is one dimension,
the hint for unknown dimensions names every unknown input with a value that builds, ``--batch`` gives the batch
axis while ``--shapes`` gives the others, and a shape computed from input values is located, not guessed at.
"""

from __future__ import annotations

import re
import shlex

import numpy as np
import onnx
import pytest
from graphs import ort_reference
from onnx import TensorProto, helper, numpy_helper

from parastream.launcher.errors import ParastreamError
from parastream.pipeline.cli import main
from parastream.pipeline.model_io import batch_profiles, load_model, shapes_at_batch

N = helper.make_node
VOCAB, HIDDEN = 50, 8


def encoder_model(path, batch="batch", seq="seq", mask_seq="seq"):
    """A transformer-like model: token embeddings masked by ``attention_mask`` and pooled over the sequence.
    ``Mul(emb, mask)`` broadcasts a 1-long mask over any sequence, so a mask fixed at 1x1 runs, wrongly."""
    rng = np.random.default_rng(0)
    emb = numpy_helper.from_array(rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32), "emb")
    axes = numpy_helper.from_array(np.array([-1], dtype=np.int64), "axes")
    seq_axis = numpy_helper.from_array(np.array([1], dtype=np.int64), "seq_axis")
    nodes = [N("Gather", ["emb", "input_ids"], ["tok"], name="embed"),
             N("Cast", ["attention_mask"], ["maskf"], to=TensorProto.FLOAT, name="mask_cast"),
             N("Unsqueeze", ["maskf", "axes"], ["mask3"], name="mask_unsqueeze"),
             N("Mul", ["tok", "mask3"], ["masked"], name="apply_mask"),
             N("ReduceSum", ["masked", "seq_axis"], ["pooled"], keepdims=0, name="pool")]
    g = helper.make_graph(nodes, "enc", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [batch, seq]),
                                         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, [batch, mask_seq])],
                          [helper.make_tensor_value_info("pooled", TensorProto.FLOAT, [batch, HIDDEN])], [emb, axes, seq_axis])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return str(path)


def feeds(n, seq, seed=0):
    rng = np.random.default_rng(seed)
    mask = np.ones((n, seq), dtype=np.int64)
    mask[:, seq // 2:] = 0  # a real mask: padding at the end
    return {"input_ids": rng.integers(0, VOCAB, (n, seq)).astype(np.int64), "attention_mask": mask}


def build_cli(capsys, *argv):
    code = main(["build", *argv, "--backend", "onnxruntime", "--no-search", "--quiet"])
    return code, capsys.readouterr().err.strip()


# -- a dimension name is one dimension ----------------------------------------------------------------------

def test_shapes_on_one_input_bind_its_named_dimensions_on_every_input(tmp_path):
    loaded = load_model(encoder_model(tmp_path / "m.onnx"), {"input_ids": [1, 64]})
    assert {t.name: t.shape for t in loaded.inputs} == {"input_ids": [1, 64], "attention_mask": [1, 64]}
    # the reference run takes the same shapes
    assert [d.dim_value for d in loaded.original.graph.input[1].type.tensor_type.shape.dim] == [1, 64]


def test_a_bundle_from_one_input_shape_serves_real_masks(tmp_path, capsys):
    from parastream.launcher import load

    path = encoder_model(tmp_path / "m.onnx")
    code, err = build_cli(capsys, path, "-o", str(tmp_path / "out"), "--shapes", "input_ids:1x16")
    assert code == 0, err
    run = load(tmp_path / "out", device="cpu")
    x = feeds(1, 16)
    np.testing.assert_allclose(run(x)["pooled"], ort_reference(onnx.load(path), x)["pooled"], rtol=1e-5, atol=1e-5)


def test_contradictory_sizes_for_one_named_dimension_are_one_line_naming_both_inputs(tmp_path, capsys):
    path = encoder_model(tmp_path / "m.onnx")
    out = tmp_path / "out"
    code, err = build_cli(capsys, path, "-o", str(out), "--shapes", "input_ids:1x64,attention_mask:1x1")
    assert code == 2, err
    assert len(err.splitlines()) == 1
    assert "input_ids:1x64" in err and "attention_mask:1x1" in err and "'seq'" in err and "64" in err, err
    assert not out.exists()


def test_one_input_giving_one_named_dimension_two_sizes_is_refused(tmp_path):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", "n"])
    g = helper.make_graph([N("Relu", ["x"], ["y"], name="relu")], "sq", [x],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", "n"])])
    path = tmp_path / "sq.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    with pytest.raises(ParastreamError, match=r"--shapes x:3x4 gives dimension 'n' two sizes, 3 and 4"):
        load_model(path, {"x": [3, 4]})


def _hinted_shapes(err: str) -> list[str]:
    """The options of the command the hint gives (``--batch ...`` and ``--shapes ...``)."""
    m = re.search(r"give them with ((?:--\S+ \S+ ?)+)", err)
    assert m, err
    return shlex.split(m.group(1))


def test_the_hint_names_every_unknown_input_and_its_value_builds(tmp_path, capsys):
    path = encoder_model(tmp_path / "m.onnx")
    code, err = build_cli(capsys, path, "-o", str(tmp_path / "out"))
    assert code == 2 and len(err.splitlines()) == 1
    assert "inputs 'input_ids' [batch, seq] and 'attention_mask' [batch, seq] have unknown dimensions" in err, err
    hint = _hinted_shapes(err)
    assert hint == ["--shapes", "input_ids:1x128,attention_mask:1x128"], err
    code, err = build_cli(capsys, path, "-o", str(tmp_path / "out"), *hint)
    assert code == 0, err


def test_the_hint_keeps_declared_sizes_the_users_entries_and_separate_names(tmp_path):
    """Static sizes as declared, 1 for a leading dimension, 128 for the rest, one size per name; the entries
    already given are part of the value, so it is the whole --shapes to pass."""
    inputs = [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["N", 3, "H", "W"]),
              helper.make_tensor_value_info("boxes", TensorProto.FLOAT, ["N", "K", 4]),
              helper.make_tensor_value_info("scale", TensorProto.FLOAT, ["S"])]
    nodes = [N("ReduceMean", ["image"], ["im"], keepdims=0, axes=[1, 2, 3], name="im"),
             N("ReduceMean", ["boxes"], ["bx"], keepdims=0, axes=[1, 2], name="bx"),
             N("ReduceMean", ["scale"], ["sc"], keepdims=1, axes=[0], name="sc"),
             N("Add", ["im", "bx"], ["s1"], name="add1"), N("Add", ["s1", "sc"], ["y"], name="add2")]
    g = helper.make_graph(nodes, "three", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N"])])
    path = tmp_path / "three.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)]), str(path))
    with pytest.raises(ParastreamError) as e:
        load_model(path)
    assert "--shapes image:1x3x128x128,boxes:1x128x4,scale:128 " in str(e.value), e.value
    with pytest.raises(ParastreamError) as e:
        load_model(path, {"image": [2, 3, 32, 32]})
    msg = str(e.value)
    assert "inputs 'boxes' [2, K, 4] and 'scale' [S] have unknown dimensions" in msg, msg
    assert "--shapes image:2x3x32x32,boxes:2x128x4,scale:128 " in msg, msg
    loaded = load_model(path, {"image": [2, 3, 32, 32], "boxes": [2, 5, 4], "scale": [1]})
    assert [t.shape for t in loaded.inputs] == [[2, 3, 32, 32], [2, 5, 4], [1]]


# -- --batch gives the batch axis, --shapes the others ------------------------------------------------------

def test_batch_and_shapes_compose(tmp_path):
    path = encoder_model(tmp_path / "m.onnx")
    shapes, profiles = batch_profiles(path, {"input_ids": [1, 64]}, (1, 4, 8))
    assert shapes == {"input_ids": [4, 64], "attention_mask": [4, 64]}
    assert profiles == {"input_ids": ([1, 64], [4, 64], [8, 64]), "attention_mask": ([1, 64], [4, 64], [8, 64])}
    assert shapes_at_batch(path, {"input_ids": [1, 64]}, 2) == {"input_ids": [2, 64], "attention_mask": [2, 64]}


def test_batch_alone_hints_a_command_that_builds(tmp_path, capsys):
    from parastream.launcher import load

    path = encoder_model(tmp_path / "m.onnx")
    code, err = build_cli(capsys, path, "-o", str(tmp_path / "out"), "--batch", "1:2:4")
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "'input_ids' [batch, seq] and 'attention_mask' [batch, seq]" in err and "besides the batch" in err, err
    hint = _hinted_shapes(err)
    assert hint == ["--batch", "1:2:4", "--shapes", "input_ids:1x128,attention_mask:1x128"], err
    code, err = build_cli(capsys, path, "-o", str(tmp_path / "out"), *hint)
    assert code == 0, err
    run = load(tmp_path / "out", device="cpu")
    x = feeds(3, 128)
    np.testing.assert_allclose(run(x)["pooled"], ort_reference(onnx.load(path), x)["pooled"], rtol=1e-5, atol=1e-5)


# -- a shape computed from input values: where the node is -------------------------------------------------

def nonzero_on_mask_model(path):
    """``x`` through a few ops; ``mask`` -> NonZero -> Transpose -> GatherND picks rows of ``x``: the shape
    of everything after the NonZero depends on the mask's values (as a speech model's attention-mask path)."""
    nodes = [N("Relu", ["x"], ["r"], name="relu"), N("Neg", ["r"], ["n1"], name="neg"),
             N("NonZero", ["mask"], ["nz"], name="mask_nonzero"),
             N("Transpose", ["nz"], ["idx"], perm=[1, 0], name="idx_t"),
             N("GatherND", ["n1", "idx"], ["picked"], name="pick"),
             N("Abs", ["picked"], ["y"], name="abs")]
    g = helper.make_graph(nodes, "nzm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8]),
                                         helper.make_tensor_value_info("mask", TensorProto.BOOL, [2, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["k"])])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return str(path)


def test_a_value_dependent_shape_says_where_the_node_sits(tmp_path, capsys):
    out = tmp_path / "out"
    code, err = build_cli(capsys, nonzero_on_mask_model(tmp_path / "m.onnx"), "-o", str(out), "--no-host-tail")
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "node 'mask_nonzero' (NonZero, node 3 of 6)" in err, err  # as the file lists it (the loader reorders)
    assert "values of input 'mask'" in err and "'x'" not in err, err
    assert "3 nodes depend on it (next: Transpose), reaching output 'y'" in err, err
    assert "detection" not in err and "--shapes" not in err
    assert not out.exists()


# -- a real export: RoBERTa with a dynamic batch and sequence ---------------------------------------------------

@pytest.fixture(scope="module")
def roberta(tmp_path_factory):
    """A 2-layer RoBERTa (hidden 32, random weights) exported with ``batch`` and ``seq`` dynamic on both inputs."""
    torch = pytest.importorskip("torch")
    tf = pytest.importorskip("transformers")

    cfg = tf.RobertaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                           intermediate_size=64, max_position_embeddings=160, attn_implementation="eager")
    torch.manual_seed(0)
    model = tf.RobertaModel(cfg, add_pooling_layer=False).eval()

    class Hidden(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, input_ids, attention_mask):
            return self.m(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    path = tmp_path_factory.mktemp("roberta") / "roberta.onnx"
    ids, mask = torch.randint(3, VOCAB, (1, 16)), torch.ones(1, 16, dtype=torch.int64)
    axes = {0: "batch", 1: "seq"}
    with torch.no_grad():
        torch.onnx.export(Hidden(), (ids, mask), str(path), input_names=["input_ids", "attention_mask"],
                          output_names=["hidden"], dynamic_axes={"input_ids": axes, "attention_mask": axes, "hidden": axes},
                          opset_version=17, dynamo=False)
    return str(path)


def _roberta_feeds(n, seq):
    x = feeds(n, seq, seed=n)
    x["input_ids"] = np.maximum(x["input_ids"], 3)  # RoBERTa's padding id is 1: real tokens only
    return x


@pytest.mark.slow
@pytest.mark.parametrize("argv, batches", [(["--shapes", "input_ids:1x64"], [1]),
                                           (["--batch", "1:2:4", "--shapes", "input_ids:1x64"], [1, 3, 4])])
def test_roberta_built_from_one_input_shape_serves_real_masks(roberta, tmp_path, capsys, argv, batches):
    from parastream.launcher import load

    code, err = build_cli(capsys, roberta, "-o", str(tmp_path / "out"), *argv)
    assert code == 0, err
    run = load(tmp_path / "out", device="cpu")
    for n in batches:
        x = _roberta_feeds(n, 64)
        np.testing.assert_allclose(run(x)["hidden"], ort_reference(onnx.load(roberta), x)["hidden"], rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_roberta_hint_and_contradiction(roberta, tmp_path, capsys):
    code, err = build_cli(capsys, roberta, "-o", str(tmp_path / "out"))
    assert code == 2 and "--shapes input_ids:1x128,attention_mask:1x128 " in err, err
    code, err = build_cli(capsys, roberta, "-o", str(tmp_path / "out"), "--shapes", "input_ids:1x64,attention_mask:1x1")
    assert code == 2 and "'seq'" in err and "attention_mask:1x1" in err and not (tmp_path / "out").exists(), err
