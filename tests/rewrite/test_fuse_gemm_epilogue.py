"""fuse_gemm_epilogue: the fused node computes what ONNX Runtime computes on the unfused graph.

ONNX Runtime cannot run parastream's own node: it runs the fused graph with the node written back as plain ops
(``fused_ops.plain_onnx``) against the original, and the torch backend's converter runs it on the CPU against
ONNX Runtime on the original: as the matmul, add and activation it stands for (exactly), and as
``torch._addmm_activation`` (the fused kernel; on the CPU its GELU is erf GELU, within 4.7e-4 of the tanh
approximation the kernel computes on CUDA).  The graphs: hand-built ones for each form the rule knows, and a
Linear followed by each activation as the TorchScript and the dynamo exporter write it.
"""

from __future__ import annotations

import io
import math
import warnings

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from parastream.core import fused_ops
from parastream.rewrite.rules import ALL_RULES, rules_for
from parastream.rewrite.rules.fuse_gemm_epilogue import FuseGemmBias, FuseGemmEpilogue
from parastream.rewrite.rules.merge_parallel_matmul import MergeParallelMatMul

from rule_testing import apply_everywhere, assert_equivalent, model, ops, random_feeds, reasons, run, vi, weight

torch = pytest.importorskip("torch")
from parastream.launcher.engines.onnx_torch import convert  # noqa: E402 - needs torch

RULE = FuseGemmEpilogue()
BIAS_RULE = FuseGemmBias()
B, S, K, N = 2, 3, 8, 16
GELU_TANH_VS_ERF = 4.8e-4  # max |erf GELU - tanh GELU| over the reals (4.73e-4, at x = ±2.7)


def fused_nodes(m: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in m.graph.node if (n.domain, n.op_type) == (fused_ops.DOMAIN, fused_ops.GEMM_ACTIVATION)]


def attrs_of(node: onnx.NodeProto) -> dict:
    return {a.name: (v.decode() if isinstance(v := helper.get_attribute_value(a), bytes) else v) for a in node.attribute}


class AddmmSpy:
    """Counts the calls of ``torch._addmm_activation`` (the fused kernel) while it is installed."""

    def __init__(self, monkeypatch):
        self.calls = []
        real = torch._addmm_activation

        def spy(*args, **kwargs):
            self.calls.append(kwargs.get("use_gelu"))
            return real(*args, **kwargs)

        monkeypatch.setattr(torch, "_addmm_activation", spy)


def assert_torch_matches_ort(original: onnx.ModelProto, fused: onnx.ModelProto, *, fuse: bool, atol: float = 0.0,
                             rtol: float = 1e-5, trials: int = 2):
    """The fused graph in the torch converter = ONNX Runtime on the original, within ``rtol`` of the output's
    scale plus ``atol``."""
    module = convert(fused, "float32", fuse_gemm_epilogue=fuse)
    for trial in range(trials):
        feeds = random_feeds(original, 100 + trial)
        feeds = {k: v * 3 for k, v in feeds.items()}  # pre-activations over GELU's curved part and both signs
        ref = run(original, feeds)
        with torch.no_grad():
            got = module(*[torch.from_numpy(feeds[n]) for n in module.input_names])
        for (name, want), have in zip(ref.items(), got):
            have = have.numpy()
            assert have.shape == want.shape, name
            err = float(np.max(np.abs(have - want)))
            bound = atol + rtol * max(float(np.max(np.abs(want))), 1e-6)
            assert err <= bound, f"{name} (fuse_gemm_epilogue={fuse}): error {err:.3g} > {bound:.3g}"


# -- hand-built graphs ------------------------------------------------------------------------------------------

def _gelu_nodes(form: str, x: str, y: str) -> tuple[list, list]:
    """The nodes (and constants) of ``y = GELU(x)`` as ``form`` writes it."""
    c = lambda name, v: numpy_helper.from_array(np.asarray(v, dtype=np.float32), name)  # noqa: E731
    if form == "gelu_op":
        return [helper.make_node("Gelu", [x], [y], name="gelu")], []
    if form == "gelu_op_tanh":
        return [helper.make_node("Gelu", [x], [y], name="gelu", approximate="tanh")], []
    if form.startswith("erf"):
        scale = (helper.make_node("Mul", [x, "inv_sqrt2"], ["g_s"], name="g_scale") if form == "erf_mul"
                 else helper.make_node("Div", [x, "sqrt2"], ["g_s"], name="g_scale"))
        inits = [c("sqrt2", math.sqrt(2)), c("inv_sqrt2", 1 / math.sqrt(2)), c("one", 1.0), c("half", 0.5)]
        nodes = [scale, helper.make_node("Erf", ["g_s"], ["g_e"], name="g_erf"),
                 helper.make_node("Add", ["g_e", "one"], ["g_a"], name="g_add")]
        if form in ("erf", "erf_mul"):  # TorchScript: (x · (1 + erf)) · 0.5
            nodes += [helper.make_node("Mul", [x, "g_a"], ["g_m"], name="g_mul"),
                      helper.make_node("Mul", ["g_m", "half"], [y], name="g_half")]
        elif form == "erf_dynamo":  # the dynamo exporter at opset 18: x · (0.5 · (1 + erf))
            nodes += [helper.make_node("Mul", ["half", "g_a"], ["g_m"], name="g_half"),
                      helper.make_node("Mul", [x, "g_m"], [y], name="g_mul")]
        elif form == "erf_transformers":  # transformers' gelu: (x · 0.5) · (1 + erf)
            nodes += [helper.make_node("Mul", [x, "half"], ["g_h"], name="g_half"),
                      helper.make_node("Mul", ["g_h", "g_a"], [y], name="g_mul")]
        return nodes, inits
    # the tanh form: 0.5 · x · (1 + tanh(√(2/π) · (x + 0.044715 · x³)))
    inits = [c("k", 0.044715), c("root", math.sqrt(2 / math.pi)), c("one", 1.0), c("half", 0.5), c("three", 3.0)]
    if form == "tanh_gpt2":  # GPT-2's gelu_new as TorchScript writes it: (0.5 · x) · (1 + tanh(...)), Pow(x, 3)
        return [helper.make_node("Mul", [x, "half"], ["g_h"], name="g_half"),
                helper.make_node("Pow", [x, "three"], ["g_c"], name="g_cube"),
                helper.make_node("Mul", ["g_c", "k"], ["g_kc"], name="g_k"),
                helper.make_node("Add", [x, "g_kc"], ["g_in"], name="g_inner"),
                helper.make_node("Mul", ["g_in", "root"], ["g_arg"], name="g_root"),
                helper.make_node("Tanh", ["g_arg"], ["g_t"], name="g_tanh"),
                helper.make_node("Add", ["g_t", "one"], ["g_a"], name="g_add"),
                helper.make_node("Mul", ["g_h", "g_a"], [y], name="g_mul")], inits
    if form == "tanh_pow":
        cube = [helper.make_node("Pow", [x, "three"], ["g_c"], name="g_cube")]
    else:  # TorchScript: x · (x · x)
        cube = [helper.make_node("Mul", [x, x], ["g_sq"], name="g_sq"), helper.make_node("Mul", [x, "g_sq"], ["g_c"], name="g_cube")]
    nodes = cube + [helper.make_node("Mul", ["k", "g_c"], ["g_kc"], name="g_k"),
                    helper.make_node("Add", [x, "g_kc"], ["g_in"], name="g_inner"),
                    helper.make_node("Mul", ["root", "g_in"], ["g_arg"], name="g_root"),
                    helper.make_node("Tanh", ["g_arg"], ["g_t"], name="g_tanh"),
                    helper.make_node("Add", ["one", "g_t"], ["g_a"], name="g_add"),
                    helper.make_node("Mul", [x, "g_a"], ["g_m"], name="g_mul"),
                    helper.make_node("Mul", ["half", "g_m"], [y], name="g_half")]
    return nodes, inits


def linear(activation: str = "relu", *, gemm: str | None = None, x_shape=(B, S, K), bias_shape=(N,),
           w_shape=(K, N), bias_first: bool = False, extra_reader: str | None = None, opset: int = 17,
           graph_output: str | None = None, bias: bool = True, reshape_to: tuple | None = None) -> onnx.ModelProto:
    """y = act(x·W + b) as ``activation`` names it ("none": y = x·W + b); ``gemm`` "T" or "N": a Gemm with transB 1 or 0 instead;
    ``bias`` False: no bias; ``reshape_to``: the biased product reshaped to it before the activation."""
    inputs = [vi("x", list(x_shape))]
    inits = [weight("b", list(bias_shape), 1)]
    h = "hr" if reshape_to else "y" if activation == "none" else "h"
    if gemm:
        inits.append(weight("w", [N, K] if gemm == "T" else [K, N], 0))
        nodes = [helper.make_node("Gemm", ["x", "w", "b"] if bias else ["x", "w"], [h], name="fc",
                                  transB=int(gemm == "T"))]
    elif bias:
        inits.append(weight("w", list(w_shape), 0))
        nodes = [helper.make_node("MatMul", ["x", "w"], ["mm"], name="fc"),
                 helper.make_node("Add", ["b", "mm"] if bias_first else ["mm", "b"], [h], name="bias")]
    else:
        inits.append(weight("w", list(w_shape), 0))
        nodes = [helper.make_node("MatMul", ["x", "w"], [h], name="fc")]
    if reshape_to:
        inits.append(numpy_helper.from_array(np.asarray(reshape_to, dtype=np.int64), "to"))
        nodes.append(helper.make_node("Reshape", ["hr", "to"], ["h"], name="unflatten"))
    if activation == "none":  # the biased product is the output
        pass
    elif activation == "relu":
        nodes.append(helper.make_node("Relu", ["h"], ["y"], name="relu"))
    elif activation == "sigmoid":
        nodes.append(helper.make_node("Sigmoid", ["h"], ["y"], name="sigmoid"))
    else:
        more, consts = _gelu_nodes(activation, "h", "y")
        nodes += more
        inits += consts
    outputs = [vi("y", None)]
    if extra_reader:  # a second reader of ``extra_reader``
        nodes.append(helper.make_node("Neg", [extra_reader], ["other"], name="other"))
        outputs.append(vi("other", None))
    if graph_output:
        outputs.append(vi(graph_output, None))
    used = {i for n in nodes for i in n.input}
    return model(nodes, inputs, outputs, [t for t in inits if t.name in used], opset=opset)


FORMS = [("relu", {}), ("erf", {}), ("erf_mul", {}), ("erf_dynamo", {}), ("erf_transformers", {}),
         ("tanh", {}), ("tanh_pow", {}), ("tanh_gpt2", {}), ("gelu_op", {"opset": 20}), ("gelu_op_tanh", {"opset": 20})]


@pytest.mark.parametrize("activation, kwargs", FORMS)
def test_fuses_each_form_and_matches_onnxruntime(activation, kwargs, monkeypatch):
    m = linear(activation, bias_first=activation == "erf", **kwargs)
    out, fired = apply_everywhere(RULE, m)
    assert len(fired) == 1
    (node,) = fused_nodes(out)
    assert ops(out) == [fused_ops.GEMM_ACTIVATION]  # the matmul, the bias and every node of the activation
    want = ("Relu", None) if activation == "relu" else \
        ("Gelu", "tanh" if "tanh" in activation else "none")
    got = attrs_of(node)
    assert (got["activation"], got.get("approximate")) == want
    assert list(node.input) == ["x", "w", "b"] and list(node.output) == ["y"]
    assert any(o.domain == fused_ops.DOMAIN for o in out.opset_import)
    onnx.checker.check_model(out, full_check=True)  # the schema (core/fused_ops.py) infers Y's type and shape
    plain = fused_ops.plain_onnx(out)
    assert not any(o.domain == fused_ops.DOMAIN for o in plain.opset_import) and fused_nodes(out)
    onnx.checker.check_model(plain, full_check=True)
    assert_equivalent(m, plain)  # ONNX Runtime on both, the node written back as plain ops
    assert_torch_matches_ort(m, out, fuse=False)  # as the three ops: exactly
    spy = AddmmSpy(monkeypatch)
    # the fused kernel (the CPU computes erf GELU for use_gelu; CUDA the tanh form) where it computes the node's
    # activation: ReLU and tanh GELU in float32; erf GELU only in half precision
    fused = want[0] == "Relu" or want[1] == "tanh"
    assert_torch_matches_ort(m, out, fuse=True, atol=GELU_TANH_VS_ERF if want[1] == "tanh" else 0.0)
    assert bool(spy.calls) == fused
    assert all(use_gelu == (want[0] == "Gelu") for use_gelu in spy.calls)


@pytest.mark.parametrize("kwargs", [dict(bias=False), dict(bias=False, gemm="T", x_shape=(B, K)),
                                    dict(bias=False, activation="erf")])
def test_no_bias_gets_a_zero_bias(kwargs):
    """A Linear without bias (or whose zero bias the exporter folded away) is fused with a zero bias."""
    m = linear(**kwargs)
    out, fired = apply_everywhere(RULE, m)
    assert len(fired) == 1 and ops(out) == [fused_ops.GEMM_ACTIVATION]
    (node,) = fused_nodes(out)
    b = {t.name: numpy_helper.to_array(t) for t in out.graph.initializer}[node.input[2]]
    assert b.shape == (N,) and not b.any()
    assert_equivalent(m, fused_ops.plain_onnx(out))
    assert_torch_matches_ort(m, out, fuse=False)


@pytest.mark.parametrize("activation", ["tanh_gpt2", "relu"])
@pytest.mark.parametrize("gemm", [None, "N"])
def test_a_reshape_before_the_activation_follows_the_fused_node(activation, gemm):
    """GPT-2's Conv1D: the rows flattened to 2-d, a Gemm, reshaped back, then the activation (elementwise: it
    commutes with the Reshape, which follows the fused node instead)."""
    m = linear(activation, gemm=gemm, x_shape=(B * S, K), reshape_to=(B, S, N))
    out, fired = apply_everywhere(RULE, m)
    assert len(fired) == 1 and ops(out) == [fused_ops.GEMM_ACTIVATION, "Reshape"]
    (node,) = fused_nodes(out)
    assert node.output[0] == next(n for n in out.graph.node if n.op_type == "Reshape").input[0]
    onnx.checker.check_model(out, full_check=True)
    assert_equivalent(m, fused_ops.plain_onnx(out))
    assert_torch_matches_ort(m, out, fuse=False)


@pytest.mark.parametrize("trans", ["T", "N"])
def test_a_gemm_and_its_bias(trans, monkeypatch):
    m = linear("erf", gemm=trans, x_shape=(B, K))
    out, fired = apply_everywhere(RULE, m)
    assert len(fired) == 1 and ops(out) == [fused_ops.GEMM_ACTIVATION]
    (node,) = fused_nodes(out)
    w = {t.name: numpy_helper.to_array(t) for t in out.graph.initializer}[node.input[1]]
    assert w.shape == (K, N)  # a constant transB weight is transposed here, not by a node
    assert_equivalent(m, fused_ops.plain_onnx(out))
    assert_torch_matches_ort(m, out, fuse=False)
    spy = AddmmSpy(monkeypatch)
    relu = linear("relu", gemm=trans, x_shape=(B, K))
    assert_torch_matches_ort(relu, apply_everywhere(RULE, relu)[0], fuse=True)
    assert spy.calls and set(spy.calls) == {False}


def test_erf_gelu_runs_the_fused_kernel_in_half_precision(monkeypatch):
    """Half precision rounds more than tanh GELU differs from erf GELU: the kernel runs it there."""
    out, _ = apply_everywhere(RULE, linear("erf"))
    spy = AddmmSpy(monkeypatch)
    module = convert(out, "float16", fuse_gemm_epilogue=True)
    try:
        with torch.no_grad():
            module(torch.randn(B, S, K).half())
    except RuntimeError as e:  # a CPU torch without half-precision addmm
        pytest.skip(f"half-precision addmm does not run here: {e}")
    assert spy.calls and set(spy.calls) == {True}


def test_the_cost_model_prices_the_fused_node_as_its_gemm():
    """The roofline prices the fused node by its GEMM and activation (FLOPs) and the bytes of X, W, B and Y, not
    free: about what it prices a MatMul, bias Add and Relu at (it counts those two as the GEMM's epilogue
    already), and less than a decomposed GELU (whose nodes read x more than once: kernels of their own)."""
    from parastream.rewrite.cost import RooflineCostModel, node_flops_bytes
    from parastream.rewrite.ir import import_graph

    m = linear("erf")
    out, _ = apply_everywhere(RULE, m)
    (node,) = [n for n in import_graph(out).nodes if n.op == fused_ops.GEMM_ACTIVATION]
    flops, byts = node_flops_bytes(node)
    assert flops == 2.0 * B * S * N * K + 12.0 * B * S * N
    assert byts == 4.0 * (B * S * K + K * N + N + B * S * N)
    cm = RooflineCostModel()
    fused, plain = cm.graph_cost(import_graph(out), 1)[1], cm.graph_cost(import_graph(m), 1)[1]
    assert 0 < fused < 0.5 * plain
    relu = linear("relu")
    fused = cm.graph_cost(import_graph(apply_everywhere(RULE, relu)[0]), 1)[1]
    plain = cm.graph_cost(import_graph(relu), 1)[1]
    assert 0.99 * plain < fused <= plain * 1.001


# -- must not fire ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, why", [
    (dict(bias_shape=(B, S, N)), "is not a vector"),  # a residual, not a bias
    (dict(bias_shape=(S, N)), "is not a vector"),
    (dict(extra_reader="mm"), "not a ReLU or a GELU alone"),  # the product is needed unbiased too
    (dict(extra_reader="h"), "not a ReLU or a GELU alone"),  # the pre-activation is needed too
    (dict(graph_output="h"), "is a graph output"),
    (dict(activation="sigmoid"), "not a ReLU or a GELU alone"),
    (dict(w_shape=(B, K, N)), "2-d weight"),  # one weight per batch: a batched matmul
    (dict(x_shape=(K,), bias_shape=(N,)), "2-d weight"),  # a vector times a matrix
])
def test_does_not_fire(kwargs, why):
    m = linear(**kwargs)
    _, fired = apply_everywhere(RULE, m)
    assert fired == []
    assert any(why in r for r in reasons(RULE, m)), reasons(RULE, m)


def test_does_not_fire_on_a_gelu_with_other_constants():
    m = linear("erf")
    for t in m.graph.initializer:
        if t.name == "sqrt2":
            t.CopyFrom(numpy_helper.from_array(np.asarray(2.0, dtype=np.float32), "sqrt2"))
    _, fired = apply_everywhere(RULE, m)
    assert fired == []
    m = linear("tanh")
    for t in m.graph.initializer:
        if t.name == "k":
            t.CopyFrom(numpy_helper.from_array(np.asarray(0.05, dtype=np.float32), "k"))
    assert apply_everywhere(RULE, m)[1] == []


def test_does_not_fire_on_a_scaled_gemm():
    m = linear("relu", gemm="T", x_shape=(B, K))
    m.graph.node[0].attribute.append(helper.make_attribute("alpha", 2.0))
    assert apply_everywhere(RULE, m)[1] == []
    assert any("alpha" in r for r in reasons(RULE, m))


def test_only_the_torch_backend_gets_it():
    """ONNX Runtime and TensorRT fuse the plain form themselves, and cannot run parastream's node."""
    assert RULE.backends == frozenset({"torch"})
    assert "fuse_gemm_epilogue" in [r.name for r in rules_for("torch")]
    for backend in ("onnxruntime", "tensorrt", None):
        assert "fuse_gemm_epilogue" not in [r.name for r in rules_for(backend)]
    assert "fuse_gemm_epilogue" not in [r.name for r in ALL_RULES]


# -- a Linear and its activation as both exporters write them -------------------------------------------------------

def export(act: str, exporter: str, opset: int, x_shape) -> onnx.ModelProto:
    torch.manual_seed(0)
    layer = {"relu": torch.nn.ReLU(), "gelu": torch.nn.GELU(), "gelu_tanh": torch.nn.GELU(approximate="tanh")}[act]
    net = torch.nn.Sequential(torch.nn.Linear(K, N), layer, torch.nn.Linear(N, 4)).eval()
    args = (torch.randn(*x_shape),)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "dynamo":
            try:
                return torch.onnx.export(net, args, dynamo=True, opset_version=opset, input_names=["x"]).model_proto
            except Exception as e:  # noqa: BLE001 - the dynamo exporter needs onnxscript
                pytest.skip(f"the dynamo exporter does not run here: {type(e).__name__}: {e}")
        f = io.BytesIO()
        torch.onnx.export(net, args, f, dynamo=False, opset_version=opset, input_names=["x"])
    return onnx.load_from_string(f.getvalue())


@pytest.mark.parametrize("act", ["relu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("exporter, opset", [("torchscript", 17), ("dynamo", 18), ("dynamo", 20)])
@pytest.mark.parametrize("x_shape", [(B, S, K), (B, K)])
def test_exported_linear_and_activation(act, exporter, opset, x_shape):
    from parastream.rewrite.ir import infer

    m = infer(export(act, exporter, opset, x_shape), strict=True)
    out, fired = apply_everywhere(RULE, m)
    assert len(fired) == 1, (ops(m), reasons(RULE, m))
    (node,) = fused_nodes(out)
    assert attrs_of(node).get("approximate", "none") == ("tanh" if act == "gelu_tanh" else "none")
    assert not {"Erf", "Tanh", "Gelu", "Relu"} & set(ops(out))
    assert_equivalent(m, fused_ops.plain_onnx(out))
    assert_torch_matches_ort(m, out, fuse=False)
    assert_torch_matches_ort(m, out, fuse=True, atol=GELU_TANH_VS_ERF * 4 if act == "gelu_tanh" else 0.0)


@pytest.mark.parametrize("kind, exporter, opset", [
    ("bert", "torchscript", 17), ("bert", "dynamo", 18),  # erf GELU after MatMul + Add
    ("gpt2", "torchscript", 17), ("gpt2", "dynamo", 18),  # tanh GELU (Pow) after Gemm + Reshape; dynamo: no bias
    ("vit", "torchscript", 17), ("vit", "dynamo", 18),
])
def test_exported_transformers_mlps(kind, exporter, opset):
    """Each layer's MLP (one layer here) of transformers' models, random weights, as both exporters write them."""
    from test_fuse_attention import assert_torch_matches_ort as converter_matches_ort
    from test_fuse_attention import export, feeds_for  # the same tiny models the attention rule is tested on

    from parastream.rewrite.ir import infer

    m = infer(export(kind, exporter, opset), strict=True)
    out, fired = apply_everywhere(RULE, m)
    assert len(fired) == 1, reasons(RULE, m)
    (node,) = fused_nodes(out)
    assert attrs_of(node).get("approximate", "none") == ("tanh" if kind == "gpt2" else "none")
    assert not {"Erf", "Tanh", "Gelu"} & set(ops(out))
    feeds = feeds_for(m, 7)  # token ids and masks as the models read them
    want, got = run(m, feeds), run(fused_ops.plain_onnx(out), feeds)
    for name in want:
        assert np.max(np.abs(got[name] - want[name])) <= 1e-5 * max(float(np.max(np.abs(want[name]))), 1e-6), name
    converter_matches_ort(m, out)  # the node as its plain ops in the converter (a CPU engine's)


# -- the bias alone: fuse_gemm_bias --------------------------------------------------------------------------------

class AddmmCalls:
    """Counts the calls of ``torch.addmm`` (the product with its bias in the epilogue) while it is installed."""

    def __init__(self, monkeypatch):
        self.count = 0
        real = torch.addmm

        def spy(*args, **kwargs):
            self.count += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(torch, "addmm", spy)


def assert_bias_alone_matches(original: onnx.ModelProto, fused: onnx.ModelProto, monkeypatch):
    """ONNX Runtime on the node written back as MatMul and Add; the converter's product and add (exactly, no
    ``torch.addmm``), and its ``torch.addmm``."""
    plain = fused_ops.plain_onnx(fused)
    onnx.checker.check_model(plain, full_check=True)
    assert_equivalent(original, plain)
    spy = AddmmCalls(monkeypatch)
    assert_torch_matches_ort(original, fused, fuse=False)
    assert spy.count == 0
    assert_torch_matches_ort(original, fused, fuse=True, trials=1)
    assert spy.count > 0


@pytest.mark.parametrize("bias_first", [False, True])
def test_the_bias_alone_fuses_as_identity_and_matches_onnxruntime(bias_first, monkeypatch):
    m = linear("none", bias_first=bias_first)
    assert apply_everywhere(RULE, m)[1] == []  # no activation: not the activation rule's
    out, fired = apply_everywhere(BIAS_RULE, m)
    assert fired == ["fuse_gemm_bias:fc+bias"]
    (node,) = fused_nodes(out)
    assert ops(out) == [fused_ops.GEMM_ACTIVATION] and attrs_of(node) == {"activation": "Identity"}
    assert list(node.input) == ["x", "w", "b"] and list(node.output) == ["y"]
    onnx.checker.check_model(out, full_check=True)
    assert ops(fused_ops.plain_onnx(out)) == ["MatMul", "Add"]
    assert_bias_alone_matches(m, out, monkeypatch)


def test_the_bias_alone_is_priced_as_its_product_and_add():
    """The simplifying search keeps the fusion only where the cost model does not rate it slower: it prices the
    node as the MatMul with its Add (which it counts as the product's epilogue already)."""
    from parastream.rewrite.cost import RooflineCostModel
    from parastream.rewrite.ir import import_graph

    m = linear("none")
    out, _ = apply_everywhere(BIAS_RULE, m)
    cm = RooflineCostModel()
    fused, plain = cm.graph_cost(import_graph(out), 1)[1], cm.graph_cost(import_graph(m), 1)[1]
    assert 0.99 * plain < fused <= plain * 1.001


@pytest.mark.parametrize("kwargs, why", [
    (dict(activation="relu"), "fuse_gemm_epilogue fuses it"),  # the activation rule's chain
    (dict(activation="erf"), "fuse_gemm_epilogue fuses it"),
    (dict(activation="none", bias=False), "not read by the Add of a bias alone"),  # a product without bias
    (dict(activation="none", extra_reader="mm"), "not read by the Add of a bias alone"),  # needed unbiased too
    (dict(activation="none", graph_output="mm"), "not read by the Add of a bias alone"),
    (dict(activation="none", bias_shape=(B, S, N)), "is not a vector"),  # a residual, not a bias
    (dict(activation="none", w_shape=(B, K, N)), "2-d weight"),  # a batched matmul
])
def test_the_bias_rule_does_not_fire(kwargs, why):
    m = linear(**kwargs)
    assert apply_everywhere(BIAS_RULE, m)[1] == []
    assert any(why in r for r in reasons(BIAS_RULE, m)), reasons(BIAS_RULE, m)


def test_the_bias_rule_leaves_a_gemm_alone():
    """A Gemm's bias already runs in its product's epilogue (the converter's ``linear``): no site at all."""
    m = linear("none", gemm="T", x_shape=(B, K))
    assert BIAS_RULE.match(import_graph_of(m)) == []
    assert apply_everywhere(BIAS_RULE, m)[1] == []


def import_graph_of(m: onnx.ModelProto):
    from parastream.rewrite.ir import import_graph

    return import_graph(m)


def projections(n: int = 3) -> onnx.ModelProto:
    """``n`` products of the same x, each with its bias (attention's Q, K and V), each an output."""
    nodes, inits = [], []
    for i in range(n):
        inits += [weight(f"w{i}", [K, N], 10 + i), weight(f"b{i}", [N], 20 + i)]
        nodes += [helper.make_node("MatMul", ["x", f"w{i}"], [f"mm{i}"], name=f"mm{i}"),
                  helper.make_node("Add", [f"mm{i}", f"b{i}"], [f"y{i}"], name=f"bias{i}")]
    return model(nodes, [vi("x", [B, S, K])], [vi(f"y{i}", None) for i in range(n)], inits)


def test_parallel_projections_are_merged_first_then_their_bias_fused(monkeypatch):
    """Products of one X are left to merge_parallel_matmul; the merged product's bias is fused."""
    m = projections()
    assert apply_everywhere(BIAS_RULE, m)[1] == []
    assert all("merge_parallel_matmul" in r for r in reasons(BIAS_RULE, m))
    merged, fired = apply_everywhere(MergeParallelMatMul(), m)
    assert len(fired) == 1
    out, fired = apply_everywhere(BIAS_RULE, merged)
    assert len(fired) == 1
    (node,) = fused_nodes(out)
    w = {t.name: numpy_helper.to_array(t) for t in out.graph.initializer}[node.input[1]]
    assert w.shape == (K, 3 * N)  # the one merged product
    assert_bias_alone_matches(m, out, monkeypatch)


@pytest.mark.parametrize("exporter, opset", [("torchscript", 17), ("dynamo", 18)])
def test_an_exported_linear_without_activation(exporter, opset, monkeypatch):
    """nn.Linear on [batch, tokens, features] as both exporters write it (MatMul and Add)."""
    from parastream.rewrite.ir import infer

    torch.manual_seed(0)
    net = torch.nn.Linear(K, N).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "dynamo":
            try:
                m = torch.onnx.export(net, (torch.randn(B, S, K),), dynamo=True, opset_version=opset,
                                      input_names=["x"]).model_proto
            except Exception as e:  # noqa: BLE001 - the dynamo exporter needs onnxscript
                pytest.skip(f"the dynamo exporter does not run here: {type(e).__name__}: {e}")
        else:
            f = io.BytesIO()
            torch.onnx.export(net, (torch.randn(B, S, K),), f, dynamo=False, opset_version=opset, input_names=["x"])
            m = onnx.load_from_string(f.getvalue())
    m = infer(m, strict=True)
    out, fired = apply_everywhere(BIAS_RULE, m)
    assert len(fired) == 1, (ops(m), reasons(BIAS_RULE, m))
    assert_bias_alone_matches(m, out, monkeypatch)


def test_the_search_for_the_torch_backend_merges_bert_projections_then_fuses_their_biases(tmp_path):
    """optimize() with the torch backend's rules on BERT (one layer, its biases drawn at random: transformers
    initialises them to zero, which fold_bn_and_affine drops) as the build loads it: Q, K and V merged into one
    product, and the bias of every product without activation (the merged one, the attention's output, the
    MLP's output) fused."""
    from test_fuse_attention import _transformers_model, feeds_for

    from parastream.pipeline.model_io import load_model
    from parastream.rewrite import optimize

    net, args, names = _transformers_model("bert")
    with torch.no_grad():
        for layer in net.modules():
            if isinstance(layer, torch.nn.Linear):
                layer.bias.normal_()
    path = tmp_path / "bert.onnx"
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(net, args, str(path), dynamo=False, opset_version=17, input_names=list(names))
    m = load_model(path).model
    out, report = optimize(m, rules=rules_for("torch"))
    chosen = report["rules_chosen"]
    assert any(k.startswith("merge_parallel_matmul:") for k in chosen), chosen
    identity = [n for n in fused_nodes(out) if attrs_of(n)["activation"] == "Identity"]
    assert sum(k.startswith("fuse_gemm_bias:") for k in chosen) == len(identity) == 3, chosen
    widths = sorted(numpy_helper.to_array(next(t for t in out.graph.initializer if t.name == n.input[1])).shape[1]
                    for n in identity)
    assert widths[-1] == 3 * widths[0]  # the merged Q, K and V
    feeds = feeds_for(m, 3)
    want = run(m, feeds)
    for fuse in (False, True):
        module = convert(out, "float32", fuse_gemm_epilogue=fuse)
        with torch.no_grad():
            got = module(*[torch.from_numpy(feeds[n]) for n in module.input_names])
        for (name, ref), have in zip(want.items(), got):
            assert np.max(np.abs(have.numpy() - ref)) <= 1e-4 * max(float(np.max(np.abs(ref))), 1e-6), name
