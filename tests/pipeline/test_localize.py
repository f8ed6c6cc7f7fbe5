"""Localization with injected faults: each one is named at the right stage (rewrite or engine) and node; a
correct bundle localizes to "no divergence".  Plus --keep-fp32: parsed, recorded, and honoured by the torch
backend (the branch's compute dtype) and the TensorRT backend (per-layer precision, through its test double)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from graphs import three_branch_model
from onnx import TensorProto, helper, numpy_helper

from parastream.launcher.bundle import Bundle, write_manifest
from parastream.launcher.engines.base import BuildOptions, fp32_pinned
from parastream.launcher.engines.onnxruntime import branch_model
from parastream.launcher.errors import ParastreamError
from parastream.pipeline.build import BuildConfig, build
from parastream.pipeline.cli import main, parse_keep_fp32
from parastream.pipeline.localize import applied_rewrites, localize, localize_branch, replay
from parastream.pipeline.verify import scaled_error
from parastream.rewrite.rules.fold_bn_and_affine import FoldBatchNormAndAffine


def bn_branches_model(seed: int = 0, c: int = 8, size: int = 12) -> onnx.ModelProto:
    """x -> three Conv+BatchNormalization+Relu branches (1x1, 3x3, 5x5) -> Concat -> Conv 1x1: the search folds
    each BatchNormalization into its Conv and merges the Convs."""
    rng = np.random.default_rng(seed)
    nodes, inits = [], []
    for i, k in enumerate([1, 3, 5]):
        inits += [numpy_helper.from_array((rng.standard_normal((c, c, k, k)) * 0.3).astype(np.float32), f"w{i}"),
                  numpy_helper.from_array(rng.standard_normal(c).astype(np.float32), f"b{i}"),
                  numpy_helper.from_array((rng.random(c) + 0.5).astype(np.float32), f"g{i}"),
                  numpy_helper.from_array(rng.standard_normal(c).astype(np.float32), f"be{i}"),
                  numpy_helper.from_array(rng.standard_normal(c).astype(np.float32) * 0.1, f"m{i}"),
                  numpy_helper.from_array((rng.random(c) + 0.5).astype(np.float32), f"v{i}")]
        nodes += [helper.make_node("Conv", ["x", f"w{i}", f"b{i}"], [f"c{i}"], name=f"conv{i}", pads=[k // 2] * 4),
                  helper.make_node("BatchNormalization", [f"c{i}", f"g{i}", f"be{i}", f"m{i}", f"v{i}"], [f"n{i}"], name=f"bn{i}"),
                  helper.make_node("Relu", [f"n{i}"], [f"r{i}"], name=f"relu{i}")]
    nodes.append(helper.make_node("Concat", ["r0", "r1", "r2"], ["cat"], axis=1, name="concat"))
    inits.append(numpy_helper.from_array((rng.standard_normal((c, 3 * c, 1, 1)) * 0.3).astype(np.float32), "wo"))
    nodes.append(helper.make_node("Conv", ["cat", "wo"], ["y"], name="conv_out"))
    g = helper.make_graph(nodes, "bn_branches", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c, size, size])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, c, size, size])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.fixture(autouse=True)
def _one_cpu_profile(monkeypatch):
    """The search's CPU profile is nominal from the machine's vector width (``cost.cpu_device``): without AVX-512
    it rates the BatchNormalization folds these tests localize under the 1% a rewrite needs, and the search keeps
    the input.  The rewrites they expect are the AVX-512 profile's, on every machine."""
    from parastream.rewrite import cost

    monkeypatch.setattr(cost, "_cpu_flags", lambda: {"avx512f"})
    monkeypatch.setattr(cost, "_CPU_SPEC", [])


def _build(model, tmp_path, name="bundle", **cfg):
    path = tmp_path / f"{name}.onnx"
    onnx.save(model, path)
    out = tmp_path / name
    kw = dict(backend="onnxruntime", streams=3, force=True)
    kw.update(cfg)
    build(str(path), str(out), config=BuildConfig(**kw), progress=False)
    return out, path


@pytest.fixture
def wrong_fold(monkeypatch):
    """The BatchNormalization fold made wrong at one site: conv1's folded weight comes out 1.5 times too large."""
    right = FoldBatchNormAndAffine.rewrite

    def wrong(self, graph, site):
        right(self, graph, site)
        if site.nodes[0] == "conv1":
            w = next(n for n in graph.nodes if n.name == "conv1").inputs[1]
            w.values = (np.asarray(w.values) * 1.5).astype(np.float32)

    monkeypatch.setattr(FoldBatchNormAndAffine, "rewrite", wrong)


# -- a correct bundle ---------------------------------------------------------------------------------------
def test_a_correct_bundle_localizes_to_no_divergence(tmp_path):
    out, model = _build(bn_branches_model(), tmp_path)
    found = localize(out)
    assert found.status == "no divergence" and not found.rewrite and not found.engine and found.keep_fp32 is None
    assert "no divergence" in found.summary()


def test_the_recorded_rewrites_replay_to_the_model_in_the_bundle(tmp_path):
    out, path = _build(bn_branches_model(), tmp_path)
    report = json.loads((out / "report.json").read_text())
    keys = applied_rewrites(report)
    assert keys and keys[0].startswith("fold_bn_and_affine:")
    from parastream.pipeline.model_io import load_model

    replayed = replay(load_model(str(path), {}).model, keys)
    shipped = onnx.load(out / "model.onnx")
    assert sorted(n.op_type for n in replayed.graph.node) == sorted(n.op_type for n in shipped.graph.node)
    with pytest.raises(ParastreamError, match="matches no site"):
        replay(load_model(str(path), {}).model, ["fold_bn_and_affine:conv9+bn9"])


# -- fault 1: a rule application made wrong ------------------------------------------------------------------
def test_a_wrong_rule_application_is_named_with_its_site(tmp_path, wrong_fold):
    out, _ = _build(bn_branches_model(), tmp_path, verify=False)
    found = localize(out)
    assert found.status == "rewrite"
    r = found.rewrite
    assert (r["rule"], r["site"]) == ("fold_bn_and_affine", "conv1+bn1")
    assert r["tensor"] == "cat" and r["node"] == "concat"  # the merge renamed the branches' own tensors
    assert not found.engine  # the engines compute model.onnx faithfully


def test_a_failed_build_says_where_in_its_error(tmp_path, wrong_fold):
    with pytest.raises(ParastreamError) as e:
        _build(bn_branches_model(), tmp_path)
    msg = str(e.value)
    assert "no bundle was written" in msg and "localized:" in msg and "rule fold_bn_and_affine at conv1+bn1" in msg
    assert not (tmp_path / "bundle").exists()


def test_weights_changed_outside_any_rewrite_are_not_blamed_on_one(tmp_path):
    out, _ = _build(bn_branches_model(), tmp_path)
    model = onnx.load(out / "model.onnx")
    w = next(t for t in model.graph.initializer if t.name == "wo")
    w.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(w) * 2, "wo"))
    onnx.save(model, out / "model.onnx")
    write_manifest(out, json.loads((out / "manifest.json").read_text()))
    found = localize(out)
    assert found.status == "rewrite" and "rule" not in found.rewrite
    assert "no rewrite explains it" in found.rewrite["explanation"]
    assert found.rewrite["tensor"] == "y"


# -- fault 2: one engine built from perturbed weights ------------------------------------------------------------
def test_an_engine_with_perturbed_weights_is_named_with_its_node(tmp_path, capsys):
    out, path = _build(three_branch_model(), tmp_path, search=False)
    plan = json.loads((out / "plan.json").read_text())
    branch = next(b for b in plan["branches"] if "conv1" in b["nodes"])
    # the engine whole (a written one leaves its weights to model.onnx: onnxruntime.slim_engine), w1 changed in it
    engine = branch_model((out / branch["engine"]).read_bytes(), Bundle.open(out).initializer)
    w = next(t for t in engine.graph.initializer if t.name == "w1")
    w.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(w) * 1.3, "w1"))
    onnx.save(engine, out / branch["engine"])
    write_manifest(out, json.loads((out / "manifest.json").read_text()))  # re-hashed: a bundle that opens
    found = localize(out, path)
    assert found.status == "engine" and not found.rewrite
    e = found.engine
    assert (e["branch"], e["node"], e["op"]) == (branch["name"], "conv1", "Conv")
    assert e["backend"] == "onnxruntime" and e["precision"] == "fp32" and e["growth"][-1]["error"] > found.tolerance
    assert found.keep_fp32 is None  # an fp32 bundle: pinning precision would not help

    code = main(["verify", str(out), "--localize"])
    printed = capsys.readouterr().out
    assert code == 1 and "conv1" in printed and branch["name"] in printed and "localized in" in printed
    code = main(["verify", str(out), "--localize", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 1 and data["localization"]["engine"]["node"] == "conv1"
    assert sorted(p.name for p in out.iterdir()) == ["engines", "manifest.json", "model.onnx", "plan.json", "report.json"]


def test_verify_localize_on_a_correct_bundle(tmp_path, capsys):
    out, _ = _build(three_branch_model(), tmp_path, search=False)
    assert main(["verify", str(out), "--localize", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["localization"]["status"] == "no divergence"


# -- fault 3: an fp16 overflow in one branch ------------------------------------------------------------------
def overflow_model() -> onnx.ModelProto:
    """x (in [-1, 1)) -> MatMul by a 64x64 weight of random ±30000 (|h| of the order of 1e5: past fp16's 65504)
    -> Mul 1e-5 -> + Tanh(x) -> y (of the order of 1 in fp32).  A MatMul's output is stored in fp16 whatever the
    kernels fuse around it."""
    w = (np.random.default_rng(0).choice([-1.0, 1.0], size=(64, 64)) * 30000).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["big"], name="mm_big"),
             helper.make_node("Mul", ["big", "k"], ["small"], name="scale_back"),
             helper.make_node("Tanh", ["x"], ["t"], name="tanh"),
             helper.make_node("Add", ["small", "t"], ["y"], name="add")]
    g = helper.make_graph(nodes, "overflow", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])],
                          [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.array(1e-5, np.float32), "k")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)  # any onnxruntime reads 8


def test_an_fp16_overflow_is_named_by_the_branch_run_alone_in_fp16():
    """The node-level step of a torch fp16 branch, on the CPU: the converter's graph computed in float16."""
    import onnxruntime as ort
    from polygraphy.backend.onnx.util import mark_outputs

    model = overflow_model()
    x = np.linspace(-1, 1, 64, dtype=np.float32).reshape(1, 64)
    names = ["big", "small", "t", "y"]
    exposed = mark_outputs(onnx.ModelProto.FromString(model.SerializeToString()), names)
    ref = dict(zip(names, ort.InferenceSession(exposed.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})))
    assert np.abs(ref["big"]).max() > 65504 and np.abs(ref["y"]).max() < 20
    found = localize_branch(model, "float16", {"x": x}, ref, tol=0.1)
    assert (found["node"], found["op"]) == ("mm_big", "MatMul") and found["node_error"] == float("inf")
    assert [g["node"] for g in found["growth"]] == ["mm_big"]
    fine = localize_branch(model, "float32", {"x": x}, ref, tol=0.1)
    assert "node" not in fine and [g["node"] for g in fine["growth"]] == ["mm_big", "scale_back", "tanh", "add"]


@pytest.mark.gpu
def test_an_fp16_overflow_in_a_torch_bundle_on_the_gpu(tmp_path):
    """End to end on the GPU: the fp16 bundle overflows in mm_big's branch, and --keep-fp32 mm_big cures it."""
    out, _ = _build(overflow_model(), tmp_path, backend="torch", precision="fp16", streams=2, verify=False, search=False)
    found = localize(out)
    assert found.status == "engine" and (found.engine["node"], found.engine["op"]) == ("mm_big", "MatMul")
    assert found.engine["precision"] == "fp16" and found.engine["runs_as"] == "float16"
    assert found.keep_fp32 == "--keep-fp32 mm_big"
    pinned, _ = _build(overflow_model(), tmp_path, name="pinned", backend="torch", precision="fp16", streams=2,
                       search=False, keep_fp32=["mm_big"])  # verified by the build
    assert localize(pinned).status == "no divergence"


# -- fault 4: a torch-converter op mis-converted ---------------------------------------------------------------
def test_a_misconverted_torch_op_is_named_with_its_node(tmp_path, monkeypatch):
    """A torch bundle on the CPU (its engines converted at load and run eagerly) whose Relu converts wrong."""
    from handmade_bundles import make_bundle

    from parastream.launcher.engines import onnx_torch
    from parastream.launcher.engines import torch as torch_backend

    monkeypatch.setattr(torch_backend, "available", lambda: None)  # its CPU path, which the launcher refuses

    def leaky_relu(n):  # Relu converted wrong: negative values leak through at half their size
        torch = onnx_torch._torch()
        return lambda x: torch.where(x > 0, x, 0.5 * x)

    monkeypatch.setitem(onnx_torch.CONVERTERS, "Relu", leaky_relu)
    path = tmp_path / "m.onnx"
    onnx.save(three_branch_model(), path)
    make_bundle(path, tmp_path / "b", backend="torch", streams=3, compile=False)
    found = localize(tmp_path / "b", path, device="cpu")
    assert found.status == "engine" and not found.rewrite
    e = found.engine
    assert e["op"] == "Relu" and e["node"].startswith("relu") and e["backend"] == "torch" and e["runs_as"] == "float32"
    assert e["growth"][0]["op"] == "Conv" and e["growth"][0]["error"] <= found.tolerance


# -- precision pins ------------------------------------------------------------------------------------------
def test_keep_fp32_patterns_cover_op_types_names_and_globs():
    model = bn_branches_model()
    assert fp32_pinned(model, ["Concat"]) == ["concat"]
    assert fp32_pinned(model, ["conv1", "bn*"]) == ["bn0", "conv1", "bn1", "bn2"]
    assert fp32_pinned(model, []) == [] and fp32_pinned(model, ["Softmax"]) == []
    assert parse_keep_fp32("Softmax, conv_1") == ["Softmax", "conv_1"] and parse_keep_fp32(None) == []
    with pytest.raises(ParastreamError, match="--keep-fp32"):
        parse_keep_fp32("Softmax,,conv")


def test_keep_fp32_is_recorded_in_the_manifest(tmp_path):
    out, _ = _build(three_branch_model(), tmp_path, search=False, keep_fp32=["Conv", "relu*"])
    assert json.loads((out / "manifest.json").read_text())["options"]["keep_fp32"] == ["Conv", "relu*"]


def test_a_torch_branch_holding_a_pinned_node_computes_in_fp32():
    """The torch builder gives a branch holding a pinned node the fp32 compute dtype (its engine casts the
    launcher's fp16 boundaries); the others keep the precision's."""
    from onnx_cases import inception_block

    from parastream.launcher.engines import torch as torch_backend
    from parastream.launcher.engines.torch import EngineFile

    model = inception_block(seed=5)
    node = model.graph.node[0].name
    pinned = torch_backend.Builder(BuildOptions(precision="fp16", compile=False, keep_fp32=[node]))
    assert EngineFile(pinned.build(model, "b")).meta.get("dtype") == "float32"
    assert pinned.report()["b"]["fp32_pinned"] == [node]
    free = torch_backend.Builder(BuildOptions(precision="fp16", compile=False, keep_fp32=["NoSuchOp"]))
    assert EngineFile(free.build(model, "b")).meta.get("dtype") is None and "fp32_pinned" not in free.report()["b"]


def test_tensorrt_pins_the_layers_of_pinned_nodes_to_fp32(tmp_path, monkeypatch):
    """Through the TensorRT test double: each pinned node's layer gets precision FLOAT and FLOAT outputs, and the
    builder is told to obey them; an fp32 build or an unmatched pattern pins nothing."""
    import trt_double

    trt = trt_double.install(monkeypatch)
    from parastream.launcher.engines import tensorrt as backend

    model = three_branch_model()
    model.ir_version = 8

    def build_with(**kw):
        builder = backend.Builder(BuildOptions(device="cuda", cache_dir=str(tmp_path / "cache"), **kw))
        try:
            data = builder.build(model, "branch_000")
        finally:
            builder.close()
        n = int.from_bytes(data[len(trt._MAGIC):len(trt._MAGIC) + 8], "little")
        header = json.loads(data[len(trt._MAGIC) + 8:len(trt._MAGIC) + 8 + n])
        return builder.report()["branch_000"], header

    trt.reset()
    report, header = build_with(precision="fp16", keep_fp32=["conv1", "Sigmoid"])
    assert report["fp32_layers"] == ["conv1", "sigmoid"] and "OBEY_PRECISION_CONSTRAINTS" in report["builder_flags"]
    assert header["layer_precisions"] == {"conv1": "FLOAT", "sigmoid": "FLOAT"}
    assert "OBEY_PRECISION_CONSTRAINTS" in header["flags"] and "FP16" in header["flags"]
    set_types = [(d["layer"], d["dtype"]) for _, _, d in trt.calls("ILayer", "set_output_type")]
    assert set_types == [("conv1", "FLOAT"), ("sigmoid", "FLOAT")]
    for kw in ({"precision": "fp32", "keep_fp32": ["conv1"]}, {"precision": "fp16", "keep_fp32": ["NoSuchOp"]}):
        report, header = build_with(**kw)
        assert "fp32_layers" not in report and not header["layer_precisions"]
        assert "OBEY_PRECISION_CONSTRAINTS" not in header["flags"]


@pytest.mark.gpu
def test_gpu_boundaries_read_back_channels_last_and_in_place_concats(tmp_path):
    """GpuLauncher.boundaries(): every boundary tensor of an fp16 torch bundle (channels-last; a Concat done in
    place where the build keeps it so) in the plan's layout and dtype, each within fp16's bound of ONNX Runtime
    on model.onnx."""
    from graphs import nested_concat_model

    from parastream.launcher.gpu import GpuLauncher
    from parastream.pipeline.localize import Values

    model = nested_concat_model(c=16, size=16)
    model.ir_version = 8
    out, _ = _build(model, tmp_path, backend="torch", precision="fp16", streams=3, search=False)
    launcher = GpuLauncher(str(out))
    try:
        assert launcher.nhwc  # what the read-back undoes (and the Concat slices in ``launcher.views``, if any)
        print("in-place concat views:", launcher.views)
        x = np.random.default_rng(0).uniform(-1, 1, (1, 16, 16, 16)).astype(np.float32)
        launcher({"x": x})
        got = launcher.boundaries()
    finally:
        launcher.close()
    names = sorted(set(launcher.plan.tensors) - {"x"})
    ref = Values(onnx.load(out / "model.onnx")).run(names, {"x": x})
    for name in names:
        assert got[name].dtype == np.float32 and got[name].shape == ref[name].shape
        assert scaled_error(got[name], ref[name]) <= 0.1, name


def test_a_torch_bundle_with_fused_attention_localizes(tmp_path, monkeypatch):
    """A torch bundle whose model.onnx holds parastream's attention node (ONNX Runtime has no such op): localization
    runs it in its plain form and finds nothing (it said "not a registered function/op" and gave up)."""
    import sys
    from pathlib import Path

    from parastream.core import fused_ops
    from parastream.launcher.engines import torch as torch_backend

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engines"))
    from test_attention_fusion import sdpa_model

    monkeypatch.setattr(torch_backend, "available", lambda: None)  # its engines run on the CPU too
    path = tmp_path / "attention.onnx"
    onnx.save(sdpa_model(fused=False), path)
    out = build(path, tmp_path / "out", config=BuildConfig(backend="torch", precision="fp32", streams=2, compile=False))
    assert any(n.domain == fused_ops.DOMAIN for n in onnx.load(str(out.path / "model.onnx")).graph.node)
    found = localize(out.path)
    assert found.status == "no divergence", found.summary()
