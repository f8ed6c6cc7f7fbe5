"""The GEMM epilogue fusion through the build: ``BuildOptions.fuse_gemm_epilogue`` reaches the torch converter, the
manifest and the launcher, the search uses the rule for the torch backend only, and a GPU build times the fused
matmul-bias-activation against its plain ops (a "GEMM epilogue" round in report.json's measured_choices, as
fused attention and conv+ReLU are timed).

The CPU tests check the plumbing (the fused kernel exists on the CPU too, but a CPU engine never uses it: its GELU
is erf GELU there, not cuBLASLt's tanh form); the GPU tests (marked) the kernel and the timing on the device."""

from __future__ import annotations

import types
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

torch = pytest.importorskip("torch")

from parastream.core import fused_ops  # noqa: E402
from parastream.launcher.bundle import Bundle  # noqa: E402
from parastream.launcher.engines import BuildOptions, get_backend  # noqa: E402
from parastream.launcher.engines import torch as torch_backend  # noqa: E402
from parastream.launcher.plan import TensorSpec  # noqa: E402

B, S, K, N, M = 2, 4, 32, 64, 16


def mlp_model(*, fused: bool, activation: str = "Relu", approximate: str = "none") -> onnx.ModelProto:
    """x [B, S, K] -> act(x·W1 + b1) -> ·W2 -> y [B, S, M]; ``fused``: the first layer as the rule leaves it
    (parastream's node), else the plain ONNX it replaces (opset 20: ONNX's Gelu for a GELU)."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal((K, N)) * 0.3).astype(np.float32), "w1"),
             numpy_helper.from_array(rng.standard_normal(N).astype(np.float32), "b1"),
             numpy_helper.from_array((rng.standard_normal((N, M)) * 0.3).astype(np.float32), "w2")]
    if fused:
        attrs = {"activation": activation, **({"approximate": approximate} if activation == "Gelu" else {})}
        nodes = [helper.make_node(fused_ops.GEMM_ACTIVATION, ["x", "w1", "b1"], ["h"], name="fc1",
                                  domain=fused_ops.DOMAIN, **attrs)]
        imports = [helper.make_opsetid("", 20), fused_ops.opset_id()]
    else:
        act = helper.make_node(activation, ["hb"], ["h"], name="act",
                               **({"approximate": approximate} if activation == "Gelu" else {}))
        nodes = [helper.make_node("MatMul", ["x", "w1"], ["hm"], name="fc1"),
                 helper.make_node("Add", ["hm", "b1"], ["hb"], name="bias1"), act]
        imports = [helper.make_opsetid("", 20)]
    nodes.append(helper.make_node("MatMul", ["h", "w2"], ["y"], name="fc2"))
    g = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [B, S, K])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [B, S, M])], inits)
    m = helper.make_model(g, opset_imports=imports)
    m.ir_version = 9
    return onnx.shape_inference.infer_shapes(m, strict_mode=True)


def feeds() -> dict:
    return {"x": np.random.default_rng(3).standard_normal((B, S, K)).astype(np.float32)}


def ort_reference(activation: str = "Relu", approximate: str = "none") -> np.ndarray:
    import onnxruntime as ort

    m = mlp_model(fused=False, activation=activation, approximate=approximate)
    return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds())[0]


def specs():
    return [TensorSpec("x", "float32", [B, S, K])], [TensorSpec("y", "float32", [B, S, M])]


def count_addmm(monkeypatch) -> list:
    calls = []
    real = torch._addmm_activation

    def counted(*a, **kw):
        calls.append(kw.get("use_gelu"))
        return real(*a, **kw)

    monkeypatch.setattr(torch, "_addmm_activation", counted)
    return calls


# -- CPU: the option's way -----------------------------------------------------------------------------------------

def test_only_cuda_engines_run_the_fused_kernel():
    assert torch_backend._fuse_gemm_epilogue("cuda", BuildOptions())
    assert not torch_backend._fuse_gemm_epilogue("cuda", BuildOptions(fuse_gemm_epilogue=False))
    assert not torch_backend._fuse_gemm_epilogue("cpu", BuildOptions())  # the CPU's use_gelu is erf GELU


@pytest.mark.parametrize("fuse", [True, False])
def test_option_reaches_the_converter_through_build_and_load(fuse, monkeypatch):
    """An engine built and loaded with ``fuse_gemm_epilogue`` calls ``torch._addmm_activation``; without it, never.
    (The device condition is lifted so that a CPU engine shows it; a ReLU computes the same on either device.)"""
    monkeypatch.setattr(torch_backend, "_fuse_gemm_epilogue", lambda device, options: options.fuse_gemm_epilogue)
    calls = count_addmm(monkeypatch)
    options = BuildOptions(compile=False, fuse_gemm_epilogue=fuse)
    data = torch_backend.Builder(options).build(mlp_model(fused=True), "branch_000")
    ins, outs = specs()
    engine = torch_backend.load(data, ins, outs, device="cpu", options=options)
    calls.clear()
    got = engine.run(feeds())["y"]
    assert calls == ([False] if fuse else [])
    np.testing.assert_allclose(got, ort_reference(), rtol=1e-4, atol=1e-4)


def test_option_is_recorded_for_the_launcher(tmp_path):
    """manifest.json's options carry the choice, and a launcher's engine options read it back."""
    from parastream.pipeline.build import _launcher_options

    assert "fuse_gemm_epilogue" in Bundle.LOAD_OPTIONS
    recorded = _launcher_options(BuildOptions(fuse_gemm_epilogue=False))
    assert recorded["fuse_gemm_epilogue"] is False
    bundle = Bundle(path=tmp_path, manifest={"options": recorded}, plan=types.SimpleNamespace(precision="fp16"), report={})
    assert bundle.engine_options("cuda").fuse_gemm_epilogue is False
    assert Bundle(path=tmp_path, manifest={"options": {}}, plan=types.SimpleNamespace(precision="fp16"),
                  report={}).engine_options("cuda").fuse_gemm_epilogue is True  # a bundle that predates it: the default


def test_engine_cache_key_tells_the_two_apart():
    model = mlp_model(fused=True)
    on = torch_backend.cache_key(model, [], "float16", BuildOptions(), False, {})
    off = torch_backend.cache_key(model, [], "float16", BuildOptions(fuse_gemm_epilogue=False), False, {})
    assert on != off


def test_the_gemm_epilogue_round_is_planned_for_torch_engines_only(monkeypatch):
    from parastream.pipeline import measure
    from parastream.pipeline.measure import ROUNDS, Variant, alternative_variants, has_gemm_epilogue

    monkeypatch.setattr(measure, "_internal_nhwc", lambda backend, plan: False)  # a one-engine plan: no layout round

    assert ROUNDS[:2] == ("attention", "GEMM epilogue")
    plan = types.SimpleNamespace(num_streams=1, branches=[0])
    fused, plain = mlp_model(fused=True), mlp_model(fused=False)
    assert has_gemm_epilogue(fused) and not has_gemm_epilogue(plain)

    def rounds(backend, model, **opts):
        engines = types.SimpleNamespace(backend=get_backend(backend))
        v = Variant(model, None, plan, BuildOptions(**opts))
        return {what: alt for what, alt in alternative_variants(engines, v)}

    got = rounds("torch", fused)
    assert "GEMM epilogue" in got and got["GEMM epilogue"].options.fuse_gemm_epilogue is False
    assert "GEMM epilogue" not in rounds("torch", plain)
    assert "GEMM epilogue" not in rounds("torch", fused, fuse_gemm_epilogue=False)  # the user turned it off
    assert "GEMM epilogue" not in rounds("onnxruntime", fused)


def test_compiled_engines_are_rebuilt_when_the_plain_ops_win():
    from parastream.pipeline.measure import compiled_for_other_choices

    torch_engines = get_backend("torch")
    chosen = {"fuse_conv_relu": True, "internal_nhwc": True, "fuse_attention": True}
    assert not compiled_for_other_choices(torch_engines, True, dict(chosen, fuse_gemm_epilogue=True), True, True)
    assert compiled_for_other_choices(torch_engines, True, dict(chosen, fuse_gemm_epilogue=False), True, True)


@pytest.mark.parametrize("fused_ms, plain_ms, keeps", [(1.0, 0.8, False), (0.7, 0.8, True), (1.0, 0.995, True),
                                                      (1.0, 0.985, False)])
def test_the_round_keeps_the_faster(fused_ms, plain_ms, keeps, monkeypatch):
    """``time_alternatives`` races the bundle as written (fused) against engines compiled without the fusion,
    keeps the faster, and a lost fusion is what the later rounds' alternatives are made with.  The plain form is
    kept only when faster by more than 1% (a tie flipped to it would have the later rounds compiled again)."""
    from gpu_build_fakes import fake_gpu, gpu_backend

    from parastream.pipeline import measure
    from parastream.pipeline.measure import Variant, time_alternatives

    monkeypatch.setattr(measure, "_internal_nhwc", lambda backend, plan: False)
    build_mod, made = fake_gpu(monkeypatch, {("bundle", True, None): fused_ms, ("plain", False, None): plain_ms,
                                             ("one", None, None): 0.5})
    asked = []

    def launcher(v):
        asked.append(v.options)
        kind = ("one", None, None) if v.plan is one else ("plain", False, None)
        la = types.SimpleNamespace(kind=kind, closed=False)
        la.close = lambda: setattr(la, "closed", True)
        made.append(la)
        return la

    plan = types.SimpleNamespace(num_streams=2)
    one = types.SimpleNamespace(num_streams=1, branches=[0])
    engines = types.SimpleNamespace(backend=gpu_backend(), launcher=launcher, one_stream_plan=lambda graph, p: one)
    got = time_alternatives(engines, "bundle", Variant(mlp_model(fused=True), None, plan, BuildOptions(precision="fp16")),
                            runs=5)
    assert [r["choice"] for r in got["rounds"]] == ["GEMM epilogue", "streams"]
    assert got["rounds"][0]["timed_ms"] == {"cuBLASLt GEMM with fused bias and activation": fused_ms,
                                            "GEMM, bias and activation as Inductor's kernels": plain_ms}
    assert got["fuse_gemm_epilogue"] is keeps and got["fuse_attention"] is True
    assert got["rounds"][0]["current_kept_within"] == 0.01
    assert asked[0].fuse_gemm_epilogue is False  # the round's alternative
    assert asked[1].fuse_gemm_epilogue is keeps  # the one-engine plan is made with the round's choice
    assert all(la.closed for la in made)


def test_an_onnxruntime_build_leaves_the_plain_ops(tmp_path):
    """ONNX Runtime fuses the plain form itself and cannot run parastream's node: its search has no such rule."""
    from parastream.pipeline import build

    path = tmp_path / "mlp.onnx"
    onnx.save(mlp_model(fused=False), path)
    bundle = build(path, tmp_path / "out", backend="onnxruntime", streams=1)
    assert "fuse_gemm_epilogue" not in bundle.report["search"]["rules"]
    assert not any(key.startswith("fuse_gemm_epilogue:") for key in bundle.report["search"].get("rules_chosen", []))


def test_a_torch_build_fuses_the_epilogue_and_verifies(tmp_path, monkeypatch):
    """The whole build with the torch backend, its engines run on the CPU (no compile): the search fuses the
    matmul, bias and ReLU, the bundle verifies against ONNX Runtime on the original, and the manifest records the
    option the launcher loads with.  (The roofline model counts a GEMM's bias and ReLU as its epilogue
    already: the fused node is estimated no cheaper than the plain ops, so the search, which takes an estimated
    rewrite only when it is ``min_gain`` cheaper, is asked to take one that is not costlier; a GPU build measures
    it instead.)"""
    import json

    from parastream.launcher import load
    from parastream.pipeline import build

    monkeypatch.setattr(torch_backend, "available", lambda: None)  # its engines run on the CPU too
    path = tmp_path / "mlp.onnx"
    onnx.save(mlp_model(fused=False), path)
    bundle = build(path, tmp_path / "out", backend="torch", precision="fp32", streams=1, compile=False,
                   search_options={"min_gain": 0.0})
    assert any(key.startswith("fuse_gemm_epilogue:") for key in bundle.report["search"]["rules_chosen"])
    assert bundle.report["verification"]["passed"]
    shipped = onnx.load(str(bundle.path / "model.onnx"))
    assert [n.op_type for n in shipped.graph.node if n.domain == fused_ops.DOMAIN] == [fused_ops.GEMM_ACTIVATION]
    assert json.loads((bundle.path / "manifest.json").read_text())["options"]["fuse_gemm_epilogue"] is True
    got = load(bundle.path, device="cpu")(feeds())["y"]
    np.testing.assert_allclose(got, ort_reference(), rtol=1e-4, atol=1e-4)


def test_localize_runs_the_fused_node_in_onnxruntime():
    """``parastream verify --localize`` runs the rewritten model in ONNX Runtime: the node as its plain ops."""
    from parastream.pipeline.localize import Values

    for activation, approximate in (("Relu", "none"), ("Gelu", "none"), ("Gelu", "tanh")):
        fused = mlp_model(fused=True, activation=activation, approximate=approximate)
        got = Values(fused).run(["h", "y"], feeds())
        np.testing.assert_allclose(got["y"], ort_reference(activation, approximate), rtol=1e-5, atol=1e-5)
    plain = mlp_model(fused=False)
    assert Values(plain).model is plain  # nothing to write back: not copied


# -- GPU: the kernel and the timing -------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("activation, approximate, dtype, fused", [
    ("Relu", "none", "float32", True), ("Relu", "none", "float16", True),
    ("Gelu", "tanh", "float32", True), ("Gelu", "tanh", "float16", True),
    ("Gelu", "none", "float16", True),  # erf GELU through cuBLASLt's tanh GELU: within fp16's rounding
    ("Gelu", "none", "float32", False),  # ... but not float32's: the plain ops
])
def test_engines_on_the_gpu_match_onnxruntime(activation, approximate, dtype, fused, monkeypatch):
    """The fused kernel on the device (cuBLASLt's epilogue: tanh GELU) against ONNX Runtime on the plain ops."""
    from parastream.launcher.engines.onnx_torch import convert

    calls = count_addmm(monkeypatch)
    model = mlp_model(fused=True, activation=activation, approximate=approximate)
    module = convert(model, dtype, fuse_gemm_epilogue=True).cuda()
    calls.clear()
    with torch.no_grad():
        x = torch.from_numpy(feeds()["x"]).cuda().to(getattr(torch, dtype))
        got = module(x)[0].float().cpu().numpy()
    assert bool(calls) is fused
    ref = ort_reference(activation, approximate)
    assert np.max(np.abs(got - ref)) / np.max(np.abs(ref)) < (1e-2 if dtype == "float16" else 1e-4)


def _tiny_vit_mlp(folder):
    """Two transformer-style MLP blocks (Linear, GELU, Linear, residual), exported by TorchScript at opset 17."""
    torch.manual_seed(0)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = torch.nn.Linear(256, 1024), torch.nn.Linear(1024, 256)
            self.act = torch.nn.GELU(approximate="tanh")

        def forward(self, x):
            return x + self.fc2(self.act(self.fc1(x)))

    net = torch.nn.Sequential(Block(), Block()).eval()
    x = torch.randn(8, 64, 256)
    path = folder / "mlp.onnx"
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(net, (x,), str(path), input_names=["x"], output_names=["y"], opset_version=17, dynamo=False)
    return path, {"x": x.numpy()}


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_build_times_the_gemm_epilogue_against_its_plain_ops(tmp_path):
    """A torch build proposes the MLPs' first layers fused (Linear, tanh GELU as TorchScript writes it) and measures
    that candidate on the device against the input; where the search keeps it, the build times the fused engines
    against the plain ones, keeps the faster and records it (report.json's measured_choices and manifest.json's
    options agree); where it does not, no such round is timed.  Either way the bundle computes what ONNX Runtime
    computes.  Which one wins is the device's to say, not this test's."""
    import json

    import onnxruntime as ort

    from parastream.launcher import load
    from parastream.pipeline import build

    path, inputs = _tiny_vit_mlp(tmp_path)
    bundle = build(path, tmp_path / "out", backend="torch", precision="fp16", streams=1, measure_seconds=120)
    report = bundle.report
    search = report["search"]
    assert search["decided_by"] == "measured"
    rewritten = [c for c in search["candidates"] if not c["input"] and c["measured_s"] is not None]
    assert rewritten, f"no rewritten candidate was measured: {search.get('decision')}"
    choices = report["measured_choices"]
    rounds = [r for r in choices["rounds"] if r["choice"] == "GEMM epilogue"]
    if any(key.startswith("fuse_gemm_epilogue:") for key in search["rules_chosen"]):
        (timed,) = rounds
        labels = ("cuBLASLt GEMM with fused bias and activation", "GEMM, bias and activation as Inductor's kernels")
        assert set(timed["timed_ms"]) == set(labels)
        assert choices["fuse_gemm_epilogue"] is (timed["won"] == labels[0])
        manifest = json.loads((bundle.path / "manifest.json").read_text())
        assert manifest["options"]["fuse_gemm_epilogue"] is choices["fuse_gemm_epilogue"]
    else:
        assert not rounds, "a GEMM epilogue round was timed for a plan without a fused GEMM"
    assert report["verification"]["passed"]
    ref = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, inputs)[0]
    with load(bundle.path, device="cuda") as run:
        got = run(inputs)["y"]
    assert np.max(np.abs(got - ref)) / np.max(np.abs(ref)) < 2e-2


# -- a Linear of one row: cuBLAS's epilogue or one Inductor reduction -------------------------------------------
def head_model(rows: int = 1, *, trans_b: int = 1, alpha: float = 1.0, bias: str = "vector",
               shaped: bool = True) -> onnx.ModelProto:
    """x [rows, 4, 2, 2] -> GlobalAveragePool -> Flatten -> Gemm (a classifier head, 4 -> 5 classes): the form
    both exporters give a Linear at the end of a CNN.  ``bias`` "vector" ([5]), "row" ([1, 5]), "none" or "input" (C
    not an initializer); ``shaped``: the Flatten's output has its shape in value_info."""
    rng = np.random.default_rng(7)
    w = rng.standard_normal((5, 4) if trans_b else (4, 5)).astype(np.float32)
    inits = [numpy_helper.from_array(w, "w")]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, 4, 2, 2])]
    gemm_in = ["f", "w"]
    if bias in ("vector", "row"):
        inits.append(numpy_helper.from_array(rng.standard_normal((5,) if bias == "vector" else (1, 5)).astype(np.float32), "c"))
        gemm_in.append("c")
    elif bias == "input":
        inputs.append(helper.make_tensor_value_info("c", TensorProto.FLOAT, [5]))
        gemm_in.append("c")
    nodes = [helper.make_node("GlobalAveragePool", ["x"], ["p"], name="pool"),
             helper.make_node("Flatten", ["p"], ["f"], name="flatten"),
             helper.make_node("Gemm", gemm_in, ["y"], name="head", transB=trans_b, alpha=alpha)]
    g = helper.make_graph(nodes, "head", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [rows, 5])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    return onnx.shape_inference.infer_shapes(m, strict_mode=True) if shaped else m


def test_a_linear_of_one_row_is_found_from_its_onnx_alone():
    """``one_row_linears``: a Gemm with alpha = beta = 1, transB = 1, a constant weight and bias and a one-row A
    (its shape in the model, as a build's branches hold it); not two rows, a weight not transposed, alpha 2, no
    bias, a bias that is an input, or an A whose shape the model does not hold.  Such a node makes
    ``fuse_gemm_epilogue`` matter for the engine (its cache key)."""
    from parastream.launcher.engines.onnx_torch import has_gemm_epilogue, one_row_linears

    assert one_row_linears(head_model()) == {2} and has_gemm_epilogue(head_model())
    assert one_row_linears(head_model(bias="row")) == {2}
    for other in (head_model(rows=2), head_model(trans_b=0), head_model(alpha=2.0), head_model(bias="none"),
                  head_model(bias="input"), head_model(shaped=False)):
        assert one_row_linears(other) == set() and not has_gemm_epilogue(other)
    key = torch_backend.cache_key
    sig = [["x", [1, 4, 2, 2], "float16", False, None], ["y", [1, 5], "float16", False, None]]
    assert key(head_model(), sig, "float16", BuildOptions(fuse_gemm_epilogue=True), False, {}) != \
        key(head_model(), sig, "float16", BuildOptions(fuse_gemm_epilogue=False), False, {})


@pytest.mark.parametrize("bias", ["vector", "row"])
def test_a_linear_of_one_row_as_one_reduction_matches_onnxruntime(bias):
    """The converter's reduction (``one_row_reduction``: a CUDA engine without the GEMM epilogue) against ONNX
    Runtime on the plain model; the option reduces that node only (two rows stay ``F.linear``), and a CUDA
    engine takes it from ``fuse_gemm_epilogue`` off, a CPU engine never."""
    import onnxruntime as ort

    from parastream.launcher.engines.onnx_torch import convert

    m = head_model(bias=bias)
    x = np.random.default_rng(5).standard_normal((1, 4, 2, 2)).astype(np.float32)
    ref = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    module = convert(m, "float32", one_row_reduction=True)
    assert module._steps[-1].fn.__name__ == "reduced"
    got = module(torch.from_numpy(x))[0].detach().numpy()
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    assert convert(m, "float32")._steps[-1].fn.__name__ == "<lambda>"  # F.linear
    assert convert(head_model(rows=2), "float32", one_row_reduction=True)._steps[-1].fn.__name__ == "<lambda>"
    cuda = torch_backend.converter_options("cuda", "float16", BuildOptions(fuse_gemm_epilogue=False))
    assert cuda["one_row_reduction"] is True
    assert not torch_backend.converter_options("cuda", "float16", BuildOptions())["one_row_reduction"]
    assert not torch_backend.converter_options("cpu", "float32", BuildOptions(fuse_gemm_epilogue=False))["one_row_reduction"]


def test_a_candidate_is_not_timed_again_for_a_one_row_linear_the_input_has_too():
    """``fusions_off_forms``: the build's rounds race a Linear of one row with the GEMM epilogue off (the input's
    alternatives), but a search's candidate timed with its fusions off (``rewritten_only``) is so only for the
    fused nodes a rewrite made: the head is the input's as much as the candidate's."""
    from parastream.pipeline.measure import Variant, fusions_off_forms

    torch_engines = get_backend("torch")
    head = Variant(head_model(), None, None, BuildOptions(precision="fp16"))
    assert [what for what, _ in fusions_off_forms(torch_engines, head)] == ["GEMM epilogue"]
    assert fusions_off_forms(torch_engines, head, rewritten_only=True) == []
    fused = Variant(mlp_model(fused=True), None, None, BuildOptions(precision="fp16"))
    (what, off), = fusions_off_forms(torch_engines, fused, rewritten_only=True)
    assert what == "GEMM epilogue" and off.options.fuse_gemm_epilogue is False
