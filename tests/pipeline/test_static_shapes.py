"""The loader gives every tensor a static shape where the input shapes are static.

Real exports compute sizes at run time (timm's "same" padding: Shape -> Gather -> arithmetic -> Cast ->
Concat -> Pad) and leave tensors that one folding pass and ONNX shape inference cannot resolve.  The
loader folds to a fixed point, then asks ONNX Runtime's symbolic shape inference, then runs the model
once; a shape that depends on input *values* is an error naming the node; ``--shapes`` is suggested only
for an input with a dynamic dimension.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from graphs import ort_reference
from onnx import TensorProto, helper, numpy_helper

from parastream.launcher.errors import ParastreamError
from parastream.pipeline import model_io
from parastream.pipeline.cli import main
from parastream.pipeline.model_io import load_model, unknown_tensors

N = helper.make_node


def _i64(name, vals):
    return numpy_helper.from_array(np.array(vals, dtype=np.int64), name)


def _save(model: onnx.ModelProto, path) -> str:
    onnx.save(model, str(path))
    return str(path)


def same_pad_model(size: int = 9, c: int = 4) -> onnx.ModelProto:
    """A conv net whose padding is computed from the activation's shape at run time, as timm's pad_same
    exports with the TorchScript exporter (no value_info: the exporter's own shapes dropped)."""
    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array((rng.standard_normal((c, 3, 3, 3)) * 0.3).astype(np.float32), "w1")
    w2 = numpy_helper.from_array((rng.standard_normal((c, c, 3, 3)) * 0.3).astype(np.float32), "w2")
    nodes = [
        N("Conv", ["x", "w1"], ["a"], name="conv1", strides=[2, 2]),
        N("Relu", ["a"], ["r"], name="relu1"),
        N("Shape", ["r"], ["shp"], name="shape"),
        N("Gather", ["shp", "idx_h"], ["h"], name="gather_h", axis=0),
        # pad = max((ceil(h / s) - 1) * s + k - h, 0) with s = 2, k = 3; the total split half/half
        N("Sub", ["h", "one"], ["h1"], name="sub1"),
        N("Div", ["h1", "two"], ["q"], name="div"),
        N("Mul", ["q", "two"], ["q2"], name="mul"),
        N("Add", ["q2", "three"], ["q3"], name="add"),
        N("Sub", ["q3", "h"], ["tot"], name="sub2"),
        N("Max", ["tot", "zero"], ["tot0"], name="max"),
        N("Div", ["tot0", "two"], ["half"], name="div_half"),
        N("Sub", ["tot0", "half"], ["rest"], name="sub_rest"),
        N("Cast", ["half"], ["half_i"], name="cast_half", to=TensorProto.INT64),
        N("Cast", ["rest"], ["rest_i"], name="cast_rest", to=TensorProto.INT64),
        N("Concat", ["zeros2", "half_i", "half_i", "zeros2", "rest_i", "rest_i"], ["pads"], name="pads", axis=0),
        N("Pad", ["r", "pads"], ["p"], name="pad", mode="constant"),
        N("Conv", ["p", "w2"], ["b"], name="conv2", strides=[2, 2]),
        N("Relu", ["b"], ["y"], name="relu2"),
    ]
    inits = [w1, w2, _i64("idx_h", [2]), _i64("one", [1]), _i64("two", [2]), _i64("three", [3]),
             _i64("zero", [0]), _i64("zeros2", [0, 0])]
    g = helper.make_graph(nodes, "same_pad", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, size, size])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", "c", "h", "w"])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def test_one_folding_pass_leaves_the_same_padding_unknown():
    """The case the fixed point is for: ONNX shape inference after one graphsurgeon pass stops at the Pad."""
    folded, _graph, _held = model_io._fold_constants(same_pad_model(), "same_pad.onnx")
    one_pass = onnx.shape_inference.infer_shapes(folded, strict_mode=True,
                                                 data_prop=True)
    assert any(n.op_type == "Pad" for n, _ in unknown_tensors(one_pass))


def test_runtime_padding_gets_static_shapes_and_builds(tmp_path):
    path = _save(same_pad_model(), tmp_path / "same_pad.onnx")
    loaded = load_model(path)
    assert unknown_tensors(loaded.model) == []
    assert [(o.name, o.shape) for o in loaded.outputs] == [("y", [1, 4, 2, 2])]
    assert not any(n.op_type in ("Shape", "Gather", "Cast") for n in loaded.model.graph.node)  # folded away
    # the folded model computes what the exported one does
    x = np.random.default_rng(1).standard_normal((1, 3, 9, 9)).astype(np.float32)
    np.testing.assert_allclose(ort_reference(loaded.model, {"x": x})["y"], ort_reference(same_pad_model(), {"x": x})["y"],
                               rtol=1e-5, atol=1e-6)
    out = tmp_path / "out"
    assert main(["build", path, "-o", str(out), "--backend", "onnxruntime", "--quiet"]) == 0
    assert out.is_dir()


def test_large_weights_stay_out_of_the_protos_between_folding_passes(tmp_path, monkeypatch):
    """With weights above the set-aside size (64 channels: 147 KB a weight), the fixed-point passes keep them out
    of the protos (graphsurgeon holds them as views of their bytes) and put them back once: the loaded model has
    every weight's bytes, no placeholder, and computes what the export does."""
    from parastream.rewrite import ir

    put_backs = []
    real = ir._put_back
    monkeypatch.setattr(ir, "_put_back", lambda model, aside: (put_backs.append(len(aside)), real(model, aside)))
    path = _save(same_pad_model(size=33, c=64), tmp_path / "same_pad.onnx")
    passes = []
    real_fold = model_io._fold_once_aside
    monkeypatch.setattr(model_io, "_fold_once_aside", lambda m, aside: (passes.append(len(aside)), real_fold(m, aside))[1])
    loaded = load_model(path)
    assert passes and passes[0] == 1  # the 64x64x3x3 weight (the first conv's is small) set aside in the loop
    assert len([n for n in put_backs if n]) <= 3  # once after the loop (and by the inferences before and after it)
    assert unknown_tensors(loaded.model) == []
    assert not any(t.data_location == onnx.TensorProto.EXTERNAL for t in loaded.model.graph.initializer)
    x = np.random.default_rng(2).standard_normal((1, 3, 33, 33)).astype(np.float32)
    ref = ort_reference(same_pad_model(size=33, c=64), {"x": x})["y"]
    np.testing.assert_allclose(ort_reference(loaded.model, {"x": x})["y"], ref, rtol=1e-4, atol=1e-5)


def test_weights_set_aside_come_back_as_views_of_their_bytes():
    """graph_with_aside gives a set-aside weight its array back without copying it, and refuses (None) bytes that do
    not match the declared type and shape, for the caller to put them back and import instead."""
    from parastream.rewrite.ir import graph_with_aside, infer_aside

    model = same_pad_model(size=33, c=64)
    weight = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "w2"))
    inferred, aside = infer_aside(model)
    assert set(aside) == {"w2"} and not next(t for t in inferred.graph.initializer if t.name == "w2").raw_data
    graph = graph_with_aside(inferred, aside)
    values = graph.tensors()["w2"].values
    np.testing.assert_array_equal(values, weight)
    assert np.shares_memory(values, np.frombuffer(aside["w2"], dtype=np.float32))
    assert graph_with_aside(inferred, {"w2": aside["w2"][:-4]}) is None


def test_static_model_does_not_take_the_fallbacks(tmp_path, monkeypatch):
    """Must not fire: a model whose shapes ONNX inference already knows never reaches the fallbacks."""
    from graphs import three_branch_model

    def boom(*a, **k):
        raise AssertionError("fallback ran on a model that needs none")

    for name in ("_fold_to_fixed_point", "_symbolic_infer", "_record_shapes_by_running"):
        monkeypatch.setattr(model_io, name, boom)
    loaded = load_model(_save(three_branch_model(), tmp_path / "m.onnx"))
    assert unknown_tensors(loaded.model) == []


def _nonzero_model():
    nodes = [N("Relu", ["x"], ["r"], name="relu"), N("NonZero", ["r"], ["nz"], name="find_positive"),
             N("Transpose", ["nz"], ["y"], name="transpose")]
    g = helper.make_graph(nodes, "nz", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                          [helper.make_tensor_value_info("y", TensorProto.INT64, ["k", 2])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _reshape_by_data_model():
    """A Reshape whose target shape is computed from an input's values (not its shape)."""
    nodes = [N("Abs", ["s"], ["sa"], name="abs"), N("Reshape", ["x", "sa"], ["y"], name="reshape_by_values")]
    g = helper.make_graph(nodes, "rd", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 6]),
                                        helper.make_tensor_value_info("s", TensorProto.INT64, [2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["a", "b"])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("make, node, op", [(_nonzero_model, "find_positive", "NonZero"),
                                            (_reshape_by_data_model, "reshape_by_values", "Reshape")])
def test_data_dependent_shape_names_the_node(tmp_path, capsys, make, node, op):
    """With --no-host-tail (else the build cuts the data-dependent part off and runs it on the host,
    tests/pipeline/test_host_tail.py)."""
    path = _save(make(), tmp_path / "dd.onnx")
    out = tmp_path / "out"
    code = main(["build", path, "-o", str(out), "--backend", "onnxruntime", "--quiet", "--no-host-tail"])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1
    assert f"node {node!r} ({op}, node " in err and "depends on the values of input" in err, err
    assert "--shapes" not in err
    assert not out.exists()


def test_shapes_behind_a_nonzero_alone_skip_symbolic_inference(tmp_path, monkeypatch):
    """Every tensor left unknown lies behind a NonZero: no inference can settle them, so ONNX Runtime's symbolic
    inference is not asked (on a detector's whole model, seconds), and the error names the same node."""
    monkeypatch.setattr(model_io, "_symbolic_infer", lambda m: pytest.fail("asked symbolic inference"))
    with pytest.raises(model_io.DataDependentShape) as e:
        load_model(_save(_nonzero_model(), tmp_path / "nz.onnx"))
    assert e.value.nodes == ["find_positive"]


def test_a_shape_inference_could_settle_still_asks_symbolic_inference(tmp_path, monkeypatch):
    """Must not skip it: beside the NonZero, com.microsoft's Gelu (unknown to ONNX's inference, known to ONNX
    Runtime's symbolic one) leaves a tensor that is not behind it."""
    m = _nonzero_model()
    m.graph.node.append(N("Gelu", ["x"], ["g"], name="ms_gelu", domain="com.microsoft"))
    m.graph.output.append(helper.make_tensor_value_info("g", TensorProto.FLOAT, ["a", "b"]))
    m.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    asked = []
    real = model_io._symbolic_infer
    monkeypatch.setattr(model_io, "_symbolic_infer", lambda model: asked.append(1) or real(model))
    with pytest.raises(model_io.DataDependentShape) as e:
        load_model(_save(m, tmp_path / "nz_gelu.onnx"))
    assert asked and e.value.nodes == ["find_positive"]


def test_a_loop_s_outputs_are_left_to_symbolic_inference(tmp_path):
    """Must not skip it for a Loop: its loop-carried output has the shape it came in with, which ONNX Runtime's
    symbolic inference gives (here through com.microsoft's Gelu, which ONNX's own inference does not know); the
    model loads with every shape static rather than being refused as data-dependent."""
    body = helper.make_graph(
        [N("Gelu", ["x_in"], ["x_out"], name="body_gelu", domain="com.microsoft"),
         N("Identity", ["cond_in"], ["cond_out"], name="body_cond")], "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("x_in", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("x_out", TensorProto.FLOAT, None)])
    g = helper.make_graph([N("Loop", ["trips", "go", "x"], ["y"], name="three_times", body=body)], "loop",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["a", "b"])],
                          [_i64("trips", 3), numpy_helper.from_array(np.array(True), "go")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    loaded = load_model(_save(m, tmp_path / "loop.onnx"))
    assert [(o.name, o.shape) for o in loaded.outputs] == [("y", [2, 3])]


def test_shapes_hint_only_for_a_dynamic_input(tmp_path, capsys):
    from graphs import three_branch_model

    path = _save(three_branch_model(batch="N"), tmp_path / "dyn.onnx")
    out = tmp_path / "out"
    assert main(["build", path, "-o", str(out), "--backend", "onnxruntime", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--shapes" in err and "unknown dimensions" in err


def _custom_op_model():
    """com.microsoft's Gelu: ONNX shape inference knows nothing of the domain; ONNX Runtime runs it."""
    nodes = [N("Relu", ["x"], ["r"], name="relu"), N("Gelu", ["r"], ["g"], name="ms_gelu", domain="com.microsoft"),
             N("Add", ["g", "x"], ["y"], name="add")]
    g = helper.make_graph(nodes, "ms", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 5])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["a", "b"])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])


def test_last_resort_records_shapes_from_one_onnxruntime_run(tmp_path, monkeypatch):
    path = _save(_custom_op_model(), tmp_path / "ms.onnx")
    monkeypatch.setattr(model_io, "_symbolic_infer", lambda m: m)  # as if ORT's symbolic inference knew no more
    calls = []
    real = model_io._record_shapes_by_running
    monkeypatch.setattr(model_io, "_record_shapes_by_running", lambda m, names, p: calls.append(list(names)) or real(m, names, p))
    loaded = load_model(path)
    assert calls and "g" in calls[0]
    assert unknown_tensors(loaded.model) == []
    assert [(o.name, o.shape, o.dtype) for o in loaded.outputs] == [("y", [2, 5], "float32")]


def test_symbolic_inference_comes_before_the_run(tmp_path, monkeypatch):
    """ONNX Runtime's symbolic inference knows com.microsoft ops: no run needed."""
    path = _save(_custom_op_model(), tmp_path / "ms.onnx")
    monkeypatch.setattr(model_io, "_record_shapes_by_running", lambda *a: pytest.fail("ran the model"))
    loaded = load_model(path)
    assert unknown_tensors(loaded.model) == []


def test_a_run_that_fails_is_one_line_naming_the_file(tmp_path, monkeypatch):
    m = _custom_op_model()
    m.graph.node[1].domain = "com.example"  # no runtime knows it
    del m.opset_import[1:]
    m.opset_import.append(helper.make_opsetid("com.example", 1))
    path = _save(m, tmp_path / "unknown.onnx")
    monkeypatch.setattr(model_io, "_symbolic_infer", lambda m: m)
    with pytest.raises(ParastreamError) as e:
        load_model(path)
    assert str(path) in str(e.value) and len(str(e.value).splitlines()) == 1


def test_symbolic_inference_leaves_nothing_in_the_working_folder(tmp_path, monkeypatch):
    """ONNX Runtime's symbolic inference saves its partial model into the current folder when it gives up."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    m = _custom_op_model()
    m.graph.node[1].domain = "com.example"
    del m.opset_import[1:]
    m.opset_import.append(helper.make_opsetid("com.example", 1))
    m.graph.node[1].op_type = "Unknowable"  # symbolic inference cannot finish
    model_io._symbolic_infer(onnx.shape_inference.infer_shapes(m))
    assert list(work.iterdir()) == []
    assert __import__("os").getcwd() == str(work)


def test_data_dependent_shape_builds_with_its_tail_on_the_host(tmp_path):
    """By default the NonZero model builds: the data-dependent node and what follows it run by onnxruntime after
    the replay, the outputs those of onnxruntime on the original."""
    import onnxruntime as ort

    from parastream.launcher import load

    path = _save(_nonzero_model(), tmp_path / "dd.onnx")
    assert main(["build", path, "-o", str(tmp_path / "out"), "--backend", "onnxruntime", "--quiet"]) == 0
    run = load(tmp_path / "out")
    sess = ort.InferenceSession(str(path))
    rng = np.random.default_rng(0)
    for _ in range(3):
        feeds = {"x": rng.standard_normal([2, 3]).astype(np.float32)}
        got = run(feeds)
        for name, want in zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)):
            assert got[name].shape == want.shape
            np.testing.assert_array_equal(got[name], want)
