"""Bad input: a one-line error naming the file or node, exit status 2, and no OUT at all."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from graphs import three_branch_model
from onnx import TensorProto, helper, numpy_helper

from parastream.pipeline.cli import main


def run_build(capsys, model, out, *extra):
    code = main(["build", str(model), "-o", str(out), "--backend", "onnxruntime", "--no-search", "--quiet", *extra])
    err = capsys.readouterr().err.strip()
    return code, err


def assert_refused(code, err, out, *needles):
    assert code == 2, err
    assert len(err.splitlines()) == 1, err  # one line, no traceback
    for needle in needles:
        assert needle in err, err
    assert not out.exists()
    assert list(out.parent.glob(f".{out.name}*")) == []


def test_not_onnx(tmp_path, capsys):
    bad = tmp_path / "notes.onnx"
    bad.write_text("this is not a protobuf at all \x00\xff")
    out = tmp_path / "out"
    code, err = run_build(capsys, bad, out)
    assert_refused(code, err, out, str(bad), "not an ONNX model")


def test_truncated_protobuf(tmp_path, capsys):
    data = three_branch_model().SerializeToString()
    bad = tmp_path / "truncated.onnx"
    bad.write_bytes(data[: len(data) // 2])
    out = tmp_path / "out"
    code, err = run_build(capsys, bad, out)
    assert_refused(code, err, out, str(bad))


def test_missing_file(tmp_path, capsys):
    out = tmp_path / "out"
    code, err = run_build(capsys, tmp_path / "nope.onnx", out)
    assert_refused(code, err, out, "nope.onnx", "no such file")


def test_fails_checker(tmp_path, capsys):
    m = three_branch_model()
    # a node reading a tensor that nothing produces
    m.graph.node[1].input[0] = "ghost"
    bad = tmp_path / "broken.onnx"
    onnx.save(m, bad)
    out = tmp_path / "out"
    code, err = run_build(capsys, bad, out)
    assert_refused(code, err, out, str(bad), "onnx.checker")


def test_unsupported_op_names_the_node(tmp_path, capsys):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])
    nodes = [helper.make_node("Relu", ["x"], ["h"], name="ok_relu"),
             helper.make_node("FancyOp", ["h"], ["y"], name="the_fancy_node", domain="com.example")]
    m = helper.make_model(helper.make_graph(nodes, "g", [x], [y]),
                          opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1)])
    bad = tmp_path / "custom.onnx"
    onnx.save(m, bad)
    out = tmp_path / "out"
    code, err = run_build(capsys, bad, out)
    assert_refused(code, err, out, "the_fancy_node")


def test_unknown_dims_without_shapes(tmp_path, capsys):
    p = tmp_path / "dyn.onnx"
    onnx.save(three_branch_model(batch="N"), p)
    out = tmp_path / "out"
    code, err = run_build(capsys, p, out)
    assert_refused(code, err, out, "'input'", "--shapes")


def test_shapes_entry_naming_no_input(tmp_path, capsys):
    p = tmp_path / "dyn.onnx"
    onnx.save(three_branch_model(batch="N"), p)
    out = tmp_path / "out"
    code, err = run_build(capsys, p, out, "--shapes", "images:1x4x8x8")
    assert_refused(code, err, out, "'images'", "not an input")


def test_shapes_entry_wrong_rank(tmp_path, capsys):
    p = tmp_path / "dyn.onnx"
    onnx.save(three_branch_model(batch="N"), p)
    out = tmp_path / "out"
    code, err = run_build(capsys, p, out, "--shapes", "input:1x4x8")
    assert_refused(code, err, out, "rank 3", "rank 4")


def test_shapes_entry_malformed(tmp_path, capsys):
    p = tmp_path / "dyn.onnx"
    onnx.save(three_branch_model(batch="N"), p)
    out = tmp_path / "out"
    code, err = run_build(capsys, p, out, "--shapes", "input:1xAx8x8")
    assert_refused(code, err, out, "--shapes")


def test_missing_external_data(tmp_path, capsys):
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((64, 64)).astype(np.float32), "w")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])
    m = helper.make_model(helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g", [x], [y], [w]),
                          opset_imports=[helper.make_opsetid("", 17)])
    p = tmp_path / "ext.onnx"
    onnx.save(m, p, save_as_external_data=True, all_tensors_to_one_file=True, location="weights.data", size_threshold=0)
    (tmp_path / "weights.data").unlink()
    out = tmp_path / "out"
    code, err = run_build(capsys, p, out)
    assert_refused(code, err, out, "weights.data", "missing")


def test_existing_out_without_force(tmp_path, capsys):
    p = tmp_path / "m.onnx"
    onnx.save(three_branch_model(), p)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, err = run_build(capsys, p, out)
    assert code == 2 and "--force" in err and len(err.splitlines()) == 1
    assert (out / "keep.txt").read_text() == "mine"


def test_external_data_model_builds_when_present(tmp_path):
    """The same external-data model builds when its weights file is there (the error above is specific)."""
    from parastream.pipeline import build

    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((64, 64)).astype(np.float32), "w")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])
    m = helper.make_model(helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g", [x], [y], [w]),
                          opset_imports=[helper.make_opsetid("", 17)])
    p = tmp_path / "ext.onnx"
    onnx.save(m, p, save_as_external_data=True, all_tensors_to_one_file=True, location="weights.data", size_threshold=0)
    bundle = build(p, tmp_path / "out", backend="onnxruntime", search=False)
    assert bundle.report["verification"]["passed"]


@pytest.mark.parametrize("argv", [["run", "nowhere", "--output-dir", "o"], ["verify", "nowhere"]])
def test_commands_on_a_missing_bundle(tmp_path, capsys, argv, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2 and "nowhere" in err and len(err.splitlines()) == 1


def test_a_cache_dir_that_cannot_be_a_folder_is_refused_before_the_build(tmp_path, capsys, monkeypatch):
    """--cache-dir that is a file, or lies under one, is refused up front with a one-line error naming the option
    (before, a CPU build ran to its end and then failed writing its record); one that does not exist yet is
    made by the build."""
    import importlib

    p = tmp_path / "m.onnx"
    onnx.save(three_branch_model(), p)
    (tmp_path / "afile").write_text("x")
    build_module = importlib.import_module("parastream.pipeline.build")
    loads = []
    real = build_module.load_and_check
    monkeypatch.setattr(build_module, "load_and_check", lambda *a, **kw: loads.append(1) or real(*a, **kw))
    for cache, needle in ((tmp_path / "afile", "not a folder"), (tmp_path / "afile" / "sub", "is not a folder")):
        out = tmp_path / "out"
        code, err = run_build(capsys, p, out, "--cache-dir", str(cache))
        assert_refused(code, err, out, "--cache-dir", str(cache), needle)
    assert not loads  # refused before the model was loaded
    code, err = run_build(capsys, p, tmp_path / "built", "--cache-dir", str(tmp_path / "new" / "cache"))
    assert code == 0, err
