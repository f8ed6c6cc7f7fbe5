"""A written onnxruntime bundle's engines leave the weights its model.onnx holds to it (``onnxruntime.slim_engine``):
the engines carry the weights' names, the load puts the data back from the hash-checked model.onnx, and the
bundle runs as the model does."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from graphs import three_branch_model

from parastream.launcher import load
from parastream.launcher.bundle import Bundle
from parastream.launcher.engines import onnxruntime as orb
from parastream.launcher.errors import ParastreamError
from parastream.pipeline import build


@pytest.fixture(params=[1, 3], ids=["one session", "three streams"])
def built(request, tmp_path):
    model = three_branch_model(seed=4, channels=16)
    onnx.save(model, tmp_path / "m.onnx")
    return model, build(tmp_path / "m.onnx", tmp_path / "b", backend="onnxruntime", search=False,
                        streams=request.param).path


def test_the_engines_hold_no_weight_of_model_onnx_and_the_bundle_runs_as_the_model(built):
    model, path = built
    opened = Bundle.open(path)
    weights = {t.name: t for t in onnx.load(str(path / "model.onnx")).graph.initializer}
    slimmed = set()
    for b in opened.plan.branches:
        engine = onnx.load_from_string(opened.engine_bytes(b))
        for t in engine.graph.initializer:
            if t.name in weights:  # its data left to model.onnx, its dtype and shape kept
                assert not t.raw_data and not t.float_data and list(t.dims) == list(weights[t.name].dims)
                slimmed.add(t.name)
        whole = orb.branch_model(opened.engine_bytes(b), opened.initializer)
        assert not any(p.key == orb.WEIGHTS_IN_MODEL for p in whole.metadata_props)
        for t in whole.graph.initializer:
            if t.name in weights:
                assert t.raw_data == weights[t.name].raw_data
    assert slimmed == set(weights) and {"w0", "w1", "w2"} <= slimmed
    assert sum(opened.engine_path(b).stat().st_size for b in opened.plan.branches) < (path / "model.onnx").stat().st_size / 10

    x = np.random.default_rng(0).standard_normal((1, 16, 8, 8)).astype(np.float32)
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"input": x})[0]
    launcher = load(path)
    assert launcher.bundle._initializers is None  # model.onnx's weights not kept beside the sessions' own
    got = launcher({"input": x})
    np.testing.assert_allclose(next(iter(got.values())), ref, rtol=1e-5, atol=1e-5)


def test_a_slim_engine_loaded_without_its_bundle_or_with_another_model_onnx_is_refused_by_name(built):
    _, path = built
    opened = Bundle.open(path)
    b = opened.plan.branches[0]
    data = opened.engine_bytes(b)
    spec = opened.plan.tensors
    ins, outs = [spec[t] for t in b.inputs], [spec[t] for t in b.outputs]
    with pytest.raises(ParastreamError, match="load it from its bundle"):
        orb.load(data, ins, outs)
    with pytest.raises(ParastreamError, match="not in its bundle's model.onnx as built"):
        orb.load(data, ins, outs, model_weights=lambda name: None)

    def other_shape(name):
        t = opened.initializer(name)
        return onnx.helper.make_tensor(name, t.data_type, [1], [0.0]) if t is not None else None

    with pytest.raises(ParastreamError, match="not in its bundle's model.onnx as built"):
        orb.load(data, ins, outs, model_weights=other_shape)
    assert orb.load(data, ins, outs, model_weights=opened.initializer).run(
        {t.name: np.zeros(t.shape, np.float32) for t in ins})


def test_an_engine_whose_weights_model_onnx_does_not_hold_keeps_them():
    """Must not fire: a weight model.onnx lacks, or holds with other values, stays in the engine, and an engine
    with none of its weights in model.onnx is written as it came."""
    model = three_branch_model(seed=1)
    data = model.SerializeToString()
    held = {t.name: t for t in model.graph.initializer}
    assert orb.slim_engine(data, lambda name: None) == data
    changed = onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(held["w1"]) * 2, "w1")
    slim = onnx.load_from_string(orb.slim_engine(data, lambda name: changed if name == "w1" else held.get(name)))
    kept = {t.name: t for t in slim.graph.initializer}
    assert kept["w1"].raw_data == held["w1"].raw_data  # other values in model.onnx: kept
    assert not kept["w0"].raw_data and not kept["w2"].raw_data
    assert orb.slim_engine(slim.SerializeToString(), held.get) == slim.SerializeToString()  # slimmed once


def test_large_weights_are_handed_to_the_session_and_small_constants_stay_in_its_onnx(tmp_path):
    """A weight of ``BESIDE_ELEMENTS`` or more is handed to the session beside its ONNX (not copied into it); a
    Reshape's shape, which onnxruntime's shape inference reads while it loads the graph, is filled into the ONNX
    (handed beside it, the session could not load: "Cannot parse data from external tensors")."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 128)).astype(np.float32)
    small = rng.standard_normal((128, 2)).astype(np.float32)
    g = helper.make_graph(
        [helper.make_node("Reshape", ["input", "shape"], ["flat"]), helper.make_node("MatMul", ["flat", "w"], ["h"]),
         helper.make_node("MatMul", ["h", "small"], ["out"])],
        "g", [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 4, 4, 4])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 2])],
        [numpy_helper.from_array(np.array([1, 64], np.int64), "shape"), numpy_helper.from_array(w, "w"),
         numpy_helper.from_array(small, "small")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, tmp_path / "m.onnx")
    path = build(tmp_path / "m.onnx", tmp_path / "b", backend="onnxruntime", search=False, streams=1).path
    opened = Bundle.open(path, loading=True)
    (b,) = opened.plan.branches
    engine = onnx.load_from_string(opened.engine_bytes(b))
    assert not any(t.raw_data for t in engine.graph.initializer)  # all three left to model.onnx
    spec = opened.plan.tensors
    session = orb.load(opened.engine_bytes(b), [spec[t] for t in b.inputs], [spec[t] for t in b.outputs],
                       model_weights=opened.initializer)
    assert session.beside == ["w"]  # small (2x128) and the shape went into the ONNX
    x = rng.standard_normal((1, 4, 4, 4)).astype(np.float32)
    np.testing.assert_allclose(session.run({"input": x})["out"], x.reshape(1, 64) @ w @ small, rtol=1e-4, atol=1e-4)


def test_a_slim_engine_with_a_mangled_list_of_weights_gets_a_one_line_error(built, tmp_path, capsys):
    """A rehashed bundle whose engine's list of weights left to model.onnx is not a list of names: ``run`` refuses
    it in one line (exit 2), naming the engine, and writes nothing."""
    from parastream.launcher.bundle import write_manifest
    from parastream.pipeline.cli import main
    import json

    _, path = built
    opened = Bundle.open(path)
    b = opened.plan.branches[0]
    engine = onnx.load_from_string(opened.engine_bytes(b))
    next(p for p in engine.metadata_props if p.key == orb.WEIGHTS_IN_MODEL).value = "{not json"
    opened.engine_path(b).write_bytes(engine.SerializeToString())
    manifest = json.loads((path / "manifest.json").read_text())
    write_manifest(path, {k: v for k, v in manifest.items() if k not in ("files", "version")})
    x = tmp_path / "x.npy"
    np.save(x, np.zeros((1, 16, 8, 8), np.float32))
    assert main(["run", str(path), "--input", f"input={x}", "--output-dir", str(tmp_path / "res")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and orb.WEIGHTS_IN_MODEL in err[0] and b.engine in err[0] and not (tmp_path / "res").exists()
