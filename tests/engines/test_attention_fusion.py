"""The attention fusion through the build: ``BuildOptions.fuse_attention`` reaches the torch converter, the manifest
and the launcher, the search uses the rule for the torch backend only, and a GPU build times the fused attention
against its decomposition (an "attention" round in report.json's measured_choices, as fused conv+ReLU is timed).

The CPU tests check the plumbing; the GPU tests (marked) the timing and the engines on the device."""

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

B, H, S, D = 1, 2, 16, 8


def sdpa_model(*, fused: bool) -> onnx.ModelProto:
    """x [B, S, H·D] -> per-head attention with an additive mask [B, 1, 1, S] -> [B, H, S, D]; ``fused``: as the
    rule leaves it (parastream's node), else the plain ONNX it replaces."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal((H * D, H * D)) * 0.3).astype(np.float32), w) for w in "qkv"]
    inits.append(numpy_helper.from_array(np.asarray([B, S, H, D], dtype=np.int64), "heads"))
    nodes = []
    for w in "qkv":
        nodes += [helper.make_node("MatMul", ["x", w], [f"{w}2"], name=f"proj_{w}"),
                  helper.make_node("Reshape", [f"{w}2", "heads"], [f"{w}4"], name=f"split_{w}"),
                  helper.make_node("Transpose", [f"{w}4"], [f"{w}h"], name=f"heads_{w}", perm=[0, 2, 1, 3])]
    if fused:
        nodes.append(helper.make_node(fused_ops.SDPA, ["qh", "kh", "vh", "m"], ["y"], name="attention",
                                      domain=fused_ops.DOMAIN, scale=float(D ** -0.5)))
        imports = [helper.make_opsetid("", 17), fused_ops.opset_id()]
    else:
        inits.append(numpy_helper.from_array(np.asarray(D ** 0.5, dtype=np.float32), "root_d"))
        nodes += [helper.make_node("Transpose", ["kh"], ["kt"], name="kt", perm=[0, 1, 3, 2]),
                  helper.make_node("MatMul", ["qh", "kt"], ["s"], name="qk"),
                  helper.make_node("Div", ["s", "root_d"], ["s2"], name="scale"),
                  helper.make_node("Add", ["s2", "m"], ["s3"], name="mask"),
                  helper.make_node("Softmax", ["s3"], ["p"], name="softmax", axis=-1),
                  helper.make_node("MatMul", ["p", "vh"], ["y"], name="pv")]
        imports = [helper.make_opsetid("", 17)]
    g = helper.make_graph(nodes, "attention", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [B, S, H * D]),
                                               helper.make_tensor_value_info("m", TensorProto.FLOAT, [B, 1, 1, S])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [B, H, S, D])], inits)
    m = helper.make_model(g, opset_imports=imports)
    m.ir_version = 8
    return onnx.shape_inference.infer_shapes(m, strict_mode=True)


def feeds() -> dict:
    rng = np.random.default_rng(3)
    mask = np.zeros((B, 1, 1, S), dtype=np.float32)
    mask[..., -4:] = -1e9
    return {"x": rng.standard_normal((B, S, H * D)).astype(np.float32), "m": mask}


def ort_reference() -> np.ndarray:
    import onnxruntime as ort

    sess = ort.InferenceSession(sdpa_model(fused=False).SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds())[0]


def specs():
    return [TensorSpec("x", "float32", [B, S, H * D]), TensorSpec("m", "float32", [B, 1, 1, S])], \
        [TensorSpec("y", "float32", [B, H, S, D])]


# -- CPU: the option's way -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("fuse", [True, False])
def test_option_reaches_the_converter_through_build_and_load(fuse, monkeypatch):
    """An engine built and loaded with ``fuse_attention`` calls SDPA; without it, never (the decomposition)."""
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention

    def counted(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted)
    options = BuildOptions(compile=False, fuse_attention=fuse)
    data = torch_backend.Builder(options).build(sdpa_model(fused=True), "branch_000")
    ins, outs = specs()
    engine = torch_backend.load(data, ins, outs, device="cpu", options=options)
    got = engine.run(feeds())["y"]
    assert bool(calls) is fuse
    np.testing.assert_allclose(got, ort_reference(), rtol=1e-4, atol=1e-5)


def test_option_is_recorded_for_the_launcher(tmp_path):
    """manifest.json's options carry the choice, and a launcher's engine options read it back."""
    from parastream.pipeline.build import _launcher_options

    assert "fuse_attention" in Bundle.LOAD_OPTIONS
    recorded = _launcher_options(BuildOptions(fuse_attention=False))
    assert recorded["fuse_attention"] is False
    bundle = Bundle(path=tmp_path, manifest={"options": recorded}, plan=types.SimpleNamespace(precision="fp16"), report={})
    assert bundle.engine_options("cuda").fuse_attention is False
    assert Bundle(path=tmp_path, manifest={"options": {}}, plan=types.SimpleNamespace(precision="fp16"),
                  report={}).engine_options("cuda").fuse_attention is True  # a bundle that predates it: the default


def test_engine_cache_key_tells_the_two_apart():
    model = sdpa_model(fused=True)
    on = torch_backend.cache_key(model, [], "float16", BuildOptions(), False, {})
    off = torch_backend.cache_key(model, [], "float16", BuildOptions(fuse_attention=False), False, {})
    assert on != off


def test_the_attention_round_is_planned_for_torch_engines_only(monkeypatch):
    from parastream.pipeline import measure
    from parastream.pipeline.measure import ROUNDS, Variant, alternative_variants, has_fused_attention

    monkeypatch.setattr(measure, "_internal_nhwc", lambda backend, plan: False)  # a one-engine plan: no layout round

    assert ROUNDS[0] == "attention"
    plan = types.SimpleNamespace(num_streams=1, branches=[0])
    fused, plain = sdpa_model(fused=True), sdpa_model(fused=False)
    assert has_fused_attention(fused) and not has_fused_attention(plain)

    def rounds(backend, model, **opts):
        engines = types.SimpleNamespace(backend=get_backend(backend))
        v = Variant(model, None, plan, BuildOptions(**opts))
        return {what: alt for what, alt in alternative_variants(engines, v)}

    got = rounds("torch", fused)
    assert "attention" in got and got["attention"].options.fuse_attention is False
    assert "attention" not in rounds("torch", plain)
    assert "attention" not in rounds("torch", fused, fuse_attention=False)  # the user turned it off
    assert "attention" not in rounds("onnxruntime", fused)


def test_compiled_engines_are_rebuilt_when_the_decomposition_wins():
    from parastream.pipeline.measure import compiled_for_other_choices

    torch_engines = get_backend("torch")
    chosen = {"fuse_conv_relu": True, "internal_nhwc": True}
    assert not compiled_for_other_choices(torch_engines, True, dict(chosen, fuse_attention=True), True)
    assert compiled_for_other_choices(torch_engines, True, dict(chosen, fuse_attention=False), True)


def test_an_onnxruntime_build_leaves_attention_as_it_is(tmp_path):
    """ONNX Runtime fuses the plain form itself and cannot run parastream's node: its search has no such rule."""
    from parastream.pipeline import build

    path = tmp_path / "attention.onnx"
    onnx.save(sdpa_model(fused=False), path)
    bundle = build(path, tmp_path / "out", backend="onnxruntime", streams=1)
    assert "fuse_attention" not in bundle.report["search"]["rules"]
    assert not any(key.startswith("fuse_attention:") for key in bundle.report["search"].get("rules_chosen", []))


def test_a_torch_build_fuses_attention_and_verifies(tmp_path, monkeypatch):
    """The whole build with the torch backend, its engines run on the CPU (no compile): the search fuses the
    attention, the bundle (here over several branches) verifies against ONNX Runtime on the original, and the
    manifest records the option the launcher loads with."""
    import json

    from parastream.launcher import load
    from parastream.pipeline import build

    monkeypatch.setattr(torch_backend, "available", lambda: None)  # its engines run on the CPU too
    path = tmp_path / "attention.onnx"
    onnx.save(sdpa_model(fused=False), path)
    bundle = build(path, tmp_path / "out", backend="torch", precision="fp32", streams=3, compile=False)
    assert any(key.startswith("fuse_attention:") for key in bundle.report["search"]["rules_chosen"])
    assert bundle.report["verification"]["passed"]
    shipped = onnx.load(str(bundle.path / "model.onnx"))
    assert [n.op_type for n in shipped.graph.node if n.domain == fused_ops.DOMAIN] == [fused_ops.SDPA]
    assert json.loads((bundle.path / "manifest.json").read_text())["options"]["fuse_attention"] is True
    got = load(bundle.path, device="cpu")(feeds())["y"]
    np.testing.assert_allclose(got, ort_reference(), rtol=1e-4, atol=1e-5)


# -- GPU: the engines and the timing -------------------------------------------------------------------------------

def _tiny_bert(folder) -> tuple:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=128, max_position_embeddings=128)
    net = transformers.BertModel._from_config(cfg, attn_implementation="eager").eval()

    class LastHidden(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = net

        def forward(self, ids, mask):
            return self.net(input_ids=ids, attention_mask=mask).last_hidden_state

    ids = torch.randint(0, 100, (1, 64))
    mask = torch.ones(1, 64, dtype=torch.int64)
    mask[:, -8:] = 0
    path = folder / "bert.onnx"
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(LastHidden().eval(), (ids, mask), str(path), input_names=["input_ids", "attention_mask"],
                          output_names=["last_hidden_state"], opset_version=17, dynamo=False)
    return path, {"input_ids": ids.numpy(), "attention_mask": mask.numpy()}


@pytest.mark.gpu
@pytest.mark.parametrize("fuse", [True, False])
def test_engines_on_the_gpu_match_onnxruntime(fuse):
    """Both forms on the device in fp16 (SDPA's flash, efficient or cuDNN kernel; the decomposition)."""
    from parastream.launcher.engines.onnx_torch import convert

    module = convert(sdpa_model(fused=True), "float16", fuse_attention=fuse).cuda()
    with torch.no_grad():
        got = module(*[torch.from_numpy(v).cuda().half() for v in feeds().values()])[0].float().cpu().numpy()
    ref = ort_reference()
    assert np.max(np.abs(got - ref)) / np.max(np.abs(ref)) < 1e-2


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_build_times_fused_attention_against_its_decomposition(tmp_path):
    """A torch build of BERT fuses its attention in the search, times the fused engines against the decomposed
    ones, keeps the faster and records it: report.json's measured_choices and manifest.json's options agree,
    and the bundle computes what ONNX Runtime computes."""
    import json

    import onnxruntime as ort

    from parastream.launcher import load
    from parastream.pipeline import build

    path, inputs = _tiny_bert(tmp_path)
    bundle = build(path, tmp_path / "out", backend="torch", precision="fp16", streams=1, measure_seconds=120)
    report = bundle.report
    assert any(key.startswith("fuse_attention:") for key in report["search"]["rules_chosen"]), \
        f"the search kept no fused attention: {report['search'].get('decision')}"
    choices = report["measured_choices"]
    (timed,) = [r for r in choices["rounds"] if r["choice"] == "attention"]
    assert set(timed["timed_ms"]) == {"one SDPA kernel per attention", "attention as matmul, softmax, matmul"}
    assert choices["fuse_attention"] is (timed["won"] == "one SDPA kernel per attention")
    manifest = json.loads((bundle.path / "manifest.json").read_text())
    assert manifest["options"]["fuse_attention"] is choices["fuse_attention"]
    assert report["verification"]["passed"]
    ref = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, inputs)[0]
    with load(bundle.path, device="cuda") as run:
        got = run(inputs)["last_hidden_state"]
    assert np.max(np.abs(got - ref)) / np.max(np.abs(ref)) < 2e-2


# -- the baseline: torch.compile runs BERT as its users run it --------------------------------------------------

def _bench_gpu():
    """bench/gpu.py as a module (bench/ on sys.path only while it is imported)."""
    import importlib
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    try:
        return importlib.import_module("gpu")
    finally:
        sys.path.pop(0)


def test_the_benchmark_compiles_the_default_attention_model():
    """bench/gpu.py exports BERT with eager attention (plain ONNX ops) and gives the PyTorch baselines transformers'
    default (sdpa) with the same weights, so torch.compile is not handicapped by an attention nobody runs."""
    transformers = pytest.importorskip("transformers")
    users_model = _bench_gpu().users_model
    cfg = transformers.BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                  intermediate_size=64, attn_implementation="eager")
    exported = transformers.BertModel(cfg).eval()
    user = users_model("bert", exported)
    assert exported.config._attn_implementation == "eager" and user.config._attn_implementation == "sdpa"
    ids, mask = torch.randint(0, 50, (1, 8)), torch.ones(1, 8, dtype=torch.int64)
    mask[:, -2:] = 0
    with torch.no_grad():
        a = exported(input_ids=ids, attention_mask=mask).last_hidden_state
        b = user(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert users_model("resnet50", exported) is exported


def test_the_benchmark_exports_a_decoder_without_a_pooler(tmp_path):
    """bench/gpu.py's export of a decoder LM (no pooler output: its one output is the last hidden state), with its
    default attention and a left-padded mask, runs in ONNX Runtime as the model runs in PyTorch."""
    import onnxruntime as ort

    transformers = pytest.importorskip("transformers")
    gpu = _bench_gpu()
    export, users_model = gpu.export, gpu.users_model
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   use_cache=False)
    model = transformers.LlamaModel(cfg).eval()
    assert users_model("llama", model) is model and model.config._attn_implementation == "sdpa"
    ids, mask = torch.randint(0, 64, (1, 8)), torch.ones(1, 8, dtype=torch.int64)
    mask[:, :2] = 0
    assert export(model, {"input_ids": ids, "attention_mask": mask}, tmp_path / "llama.onnx") == ["last_hidden_state"]
    sess = ort.InferenceSession(str(tmp_path / "llama.onnx"), providers=["CPUExecutionProvider"])
    (got,) = sess.run(None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).last_hidden_state.numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_the_baseline_returns_what_the_export_has_as_outputs(tmp_path):
    """bench/corpus_gpu.py's ``HalfInput`` returns the tensors bench/gpu.py's export writes (BERT: the last hidden
    state and the pooler's output), so that torch.compile cannot drop the pooler as dead code and time less work
    than the bundle runs; a decoder's one output stays one."""
    import importlib
    import sys
    from pathlib import Path

    transformers = pytest.importorskip("transformers")
    gpu = _bench_gpu()
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    try:
        HalfInput = importlib.import_module("corpus_gpu").HalfInput
    finally:
        sys.path.pop(0)
    cfg = transformers.BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                  intermediate_size=64)
    model = transformers.BertModel(cfg).eval()
    ids, mask = torch.randint(0, 50, (1, 8)), torch.ones(1, 8, dtype=torch.int64)
    names = gpu.export(model, {"input_ids": ids, "attention_mask": mask}, tmp_path / "bert.onnx")
    with torch.no_grad():
        got = HalfInput(model.double()).eval()(ids, mask)
        want = model(input_ids=ids, attention_mask=mask)
    assert names == ["last_hidden_state", "pooler_output"] and len(got) == 2
    torch.testing.assert_close(got[0], want.last_hidden_state)
    torch.testing.assert_close(got[1], want.pooler_output)
    llama = transformers.LlamaModel(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, use_cache=False)).eval()
    with torch.no_grad():
        assert torch.is_tensor(HalfInput(llama).eval()(ids, mask))


def test_the_benchmark_gives_a_padded_prompt_s_errors_by_rows():
    """bench/gpu.py's ``errors_by_rows``: the tokens' rows and the padding's apart (an attention_mask's zeros), each
    on the scale of the whole reference; no split without a mask or a row per token."""
    errors_by_rows = _bench_gpu().errors_by_rows
    ref = np.ones((1, 4, 3))
    ref[0, 1, 2] = -2.0
    out = ref.copy()
    out[0, 0] += 1.0  # a padded row off by half the scale
    out[0, 3, 1] += 0.02  # a token's row off by 1% of it
    mask = np.array([[0, 1, 1, 1]])
    got = errors_by_rows(out, ref, {"attention_mask": mask, "input_ids": mask})
    assert got == pytest.approx({"tokens": 0.01, "padding": 0.5})
    assert errors_by_rows(out, ref, {"input_ids": mask}) is None
    assert errors_by_rows(out[0], ref[0], {"attention_mask": mask}) is None  # no row per token
    assert errors_by_rows(out, ref, {"attention_mask": np.ones((1, 4))})["padding"] == 0.0


# -- the plain form ONNX Runtime runs (localization) ---------------------------------------------------------------

@pytest.mark.parametrize("mask", ["float", "bool", "causal", "none"])
def test_plain_onnx_computes_what_the_fused_node_stands_for(mask):
    """``fused_ops.plain_onnx`` writes the attention node back as plain ops: ONNX Runtime on it equals the plain
    model (float mask), numpy's softmax(scale·Q·Kᵀ + M)·V (bool, causal, no mask), and no node of the domain stays."""
    import onnxruntime as ort

    if mask == "float":
        fused, want = sdpa_model(fused=True), ort_reference()
        got = ort.InferenceSession(fused_ops.plain_onnx(fused).SerializeToString(),
                                   providers=["CPUExecutionProvider"]).run(None, feeds())[0]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        return
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((2, 3, 5, 4)).astype(np.float32) for _ in range(3))
    ins = ["q", "k", "v"] + (["m"] if mask == "bool" else [])
    node = helper.make_node(fused_ops.SDPA, ins, ["y"], name="att", domain=fused_ops.DOMAIN, scale=0.5,
                            is_causal=int(mask == "causal"))
    vi = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3, 5, 4]) for n in "qkv"]
    if mask == "bool":
        vi.append(helper.make_tensor_value_info("m", TensorProto.BOOL, [2, 1, 1, 5]))
    g = helper.make_graph([node], "att", vi, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, 5, 4])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), fused_ops.opset_id()])
    model.ir_version = 8
    plain = fused_ops.plain_onnx(model)
    assert not any(n.domain == fused_ops.DOMAIN for n in plain.graph.node)
    feeds_ = {"q": q, "k": k, "v": v}
    scores = 0.5 * q @ k.swapaxes(-1, -2)
    if mask == "bool":
        m = np.ones((2, 1, 1, 5), dtype=bool)
        m[..., 3:] = False
        feeds_["m"] = m
        scores = np.where(m, scores, np.finfo(np.float32).min)
    if mask == "causal":
        scores = np.where(np.tril(np.ones((5, 5), dtype=bool)), scores, np.finfo(np.float32).min)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    want = (p / p.sum(-1, keepdims=True)) @ v
    got = ort.InferenceSession(plain.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds_)[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
