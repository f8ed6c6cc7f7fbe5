"""Verification criteria: scaled error max|out-ref|/max|ref| for every precision, elementwise rtol/atol when asked;
meaningless references flagged; integer inputs drawn over their real range."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from graphs import ort_reference, three_branch_model, two_output_model

from parastream.launcher.errors import ParastreamError
from parastream.launcher.plan import TensorSpec
from parastream.pipeline.verify import (DEFAULT_SCALE_TOLERANCES, DEFAULT_TOLERANCES, resolve_tolerances, scaled_error,
                                        verify)

INPUTS = [TensorSpec("input", "float32", [1, 4, 8, 8])]


class NoisyLauncher:
    """ONNX Runtime on the model itself, plus ±``fraction`` of each output's scale on every element.

    Every element moves by exactly fraction·max|ref|, so the scaled error is ``fraction`` and small
    elements miss an elementwise 2e-2 tolerance by a wide margin.
    """

    def __init__(self, model: onnx.ModelProto, fraction: float, seed: int = 0):
        self.model, self.fraction = model, fraction
        self.rng = np.random.default_rng(seed)

    def __call__(self, feeds):
        outs = ort_reference(self.model, feeds)
        noisy = {}
        for name, ref in outs.items():
            sign = self.rng.choice([-1.0, 1.0], size=ref.shape)
            noisy[name] = (ref + sign * self.fraction * np.abs(ref).max()).astype(ref.dtype)
        return noisy


def _verify(model, launcher, precision, inputs=INPUTS, **given):
    rtol, atol, scale_tol = resolve_tolerances(precision, given.get("rtol"), given.get("atol"), given.get("scale_tol"))
    return verify(model, launcher, inputs, rtol=rtol, atol=atol, scale_tol=scale_tol, seed=3, iterations=2)


def test_three_percent_noise_passes_fp16_by_scaled_error():
    model = three_branch_model()
    result = _verify(model, NoisyLauncher(model, 0.03), "fp16")
    out = result.outputs["output"]
    assert result.passed and result.criterion == "scaled" and result.scale_tol == DEFAULT_SCALE_TOLERANCES["fp16"]
    assert out["max_scaled"] == pytest.approx(0.03, rel=1e-3)
    # the same outputs miss the elementwise fp16 tolerance: the scaled criterion is what lets them through
    assert out["elementwise_passed"] is False and out["max_abs"] > DEFAULT_TOLERANCES["fp16"][1]


def test_scaled_pass_prints_no_elementwise_failure(capfd):
    """polygraphy must not print "FAILED" for a build that the scaled criterion passes; the elementwise one still reports failures."""
    model = three_branch_model()
    assert _verify(model, NoisyLauncher(model, 0.03), "fp16").passed
    fd = capfd.readouterr()
    assert "FAILED" not in fd.out + fd.err
    assert not _verify(model, NoisyLauncher(model, 0.03), "fp32", rtol=1e-4, atol=1e-5).passed
    fd = capfd.readouterr()
    assert "FAILED" in fd.out + fd.err


def test_three_percent_noise_fails_fp32():
    model = three_branch_model()
    result = _verify(model, NoisyLauncher(model, 0.03), "fp32")
    assert result.criterion == "scaled" and result.scale_tol == DEFAULT_SCALE_TOLERANCES["fp32"]
    assert not result.passed and result.status == "failed" and not result.outputs["output"]["passed"]
    assert result.outputs["output"]["max_scaled"] == pytest.approx(0.03, rel=1e-3)


def test_fp32_error_far_below_the_output_scale_passes_though_elementwise_fails():
    """Inception-v3's case: an error far below the output's scale (5e-5 of it here; 2.7e-7 there) on small elements is a correct fp32
    build; rtol 1e-4 / atol 1e-5 per element rejected it, the scaled criterion passes it."""
    model, inputs = two_output_model(), [TensorSpec("x", "float32", [2, 16])]  # matmul outputs: some elements near 0
    result = _verify(model, NoisyLauncher(model, 5e-5), "fp32", inputs=inputs)
    assert result.passed and result.status == "passed"
    elementwise = _verify(model, NoisyLauncher(model, 5e-5), "fp32", inputs=inputs, rtol=1e-4, atol=1e-5)
    assert not elementwise.passed  # the old default criterion: a false failure


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_fifty_percent_noise_fails_reduced_precision(precision):
    model = three_branch_model()
    result = _verify(model, NoisyLauncher(model, 0.5), precision)
    assert result.criterion == "scaled"
    assert not result.passed
    assert result.outputs["output"]["max_scaled"] == pytest.approx(0.5, rel=1e-3)


def test_explicit_rtol_atol_judges_fp16_elementwise():
    model = three_branch_model()
    result = _verify(model, NoisyLauncher(model, 0.03), "fp16", rtol=2e-2, atol=2e-2)
    assert result.criterion == "elementwise" and not result.passed


def test_exact_launcher_passes_every_criterion():
    model = three_branch_model()
    for precision in ("fp32", "fp16", "bf16"):
        result = _verify(model, NoisyLauncher(model, 0.0), precision)
        assert result.passed, precision
        assert result.outputs["output"]["max_scaled"] == 0.0


def test_to_dict_records_criterion_and_scaled_error_per_output():
    model = two_output_model()
    launcher = NoisyLauncher(model, 0.05)
    d = _verify(model, launcher, "fp16", inputs=[TensorSpec("x", "float32", [2, 16])]).to_dict()
    json.dumps(d)
    assert d["criterion"] == "scaled" and d["scale_tol"] == 0.1 and d["passed"] is True
    assert set(d["outputs"]) == {"y", "aux"}
    for out in d["outputs"].values():
        assert out["max_scaled"] == pytest.approx(0.05, rel=1e-3)
        assert {"max_abs", "max_rel", "max_ref", "elementwise_passed", "passed"} <= set(out)


def test_missing_output_fails_under_both_criteria():
    model = two_output_model()
    inputs = [TensorSpec("x", "float32", [2, 16])]

    def drops_aux(feeds):
        return {"y": ort_reference(model, feeds)["y"]}

    for precision in ("fp32", "fp16"):
        result = _verify(model, drops_aux, precision, inputs=inputs)
        assert not result.passed and not result.outputs["aux"]["passed"] and result.outputs["y"]["passed"]


def test_wrong_shape_fails_instead_of_crashing():
    model = three_branch_model()

    def flat(feeds):
        return {k: v.reshape(-1) for k, v in ort_reference(model, feeds).items()}

    for precision in ("fp32", "fp16"):
        result = _verify(model, flat, precision)
        assert not result.passed and result.outputs["output"]["max_scaled"] == float("inf")


def test_scaled_error_definition():
    ref = np.array([0.0, -4.0, 2.0, np.inf], np.float32)
    assert scaled_error(ref + np.array([0, 0.4, 0, 0], np.float32), ref) == pytest.approx(0.1)  # 0.4 / max finite |ref| 4
    assert scaled_error(ref, ref) == 0.0  # matching infinities are no error
    assert scaled_error(np.array([0, -4, 2, 1], np.float32), ref) == float("inf")
    assert scaled_error(np.array([np.nan, -4, 2, np.inf], np.float32), ref) == float("inf")
    assert scaled_error(np.ones(3, np.float16), np.zeros(3, np.float32)) == float("inf")
    assert scaled_error(np.zeros(3), np.zeros(3)) == 0.0
    assert scaled_error(np.zeros((2, 3)), np.zeros(6)) == float("inf")


def _zero_model():
    from onnx import TensorProto, helper

    # Relu(-|x|) is zero everywhere, whatever the inputs drawn
    graph = helper.make_graph([helper.make_node("Abs", ["x"], ["a"], name="abs"), helper.make_node("Neg", ["a"], ["n"], name="neg"),
                               helper.make_node("Relu", ["n"], ["y"], name="relu")],
                              "zero", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_all_zero_output_is_inconclusive_not_passed():
    """A reference that is zero everywhere cannot judge a build: a match is 'inconclusive', a mismatch still fails."""
    inputs = [TensorSpec("x", "float32", [8])]

    def offset(by):
        return lambda feeds: {"y": np.full(8, by, np.float32)}

    close = _verify(_zero_model(), offset(1e-3), "fp16", inputs=inputs)
    assert not close.passed and close.status == "inconclusive"
    assert close.outputs["y"]["passed"] and not close.outputs["y"]["meaningful"]
    assert "near zero" in close.outputs["y"]["not_meaningful"] and "inconclusive" in close.failure()
    assert _verify(_zero_model(), offset(0.5), "fp16", inputs=inputs).status == "failed"


def test_inputs_drawn_zero_mean_so_negative_halves_count():
    """Float inputs are drawn from [-1, 1): a model that reads only the negative part of its input (Relu(-x), as
    random-weight DPN-68 in effect did) is judged, where inputs from [0, 1) would make it constant (inconclusive)."""
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Neg", ["x"], ["n"], name="neg"), helper.make_node("Relu", ["n"], ["y"], name="relu")],
                              "negative_part", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    inputs = [TensorSpec("x", "float32", [8])]
    right = _verify(model, lambda feeds: {"y": np.maximum(-feeds["x"], 0)}, "fp32", inputs=inputs)
    assert right.passed and right.status == "passed" and right.outputs["y"]["meaningful"]
    wrong = _verify(model, lambda feeds: {"y": np.maximum(feeds["x"], 0)}, "fp32", inputs=inputs)
    assert wrong.status == "failed"


def test_not_meaningful_reasons():
    from parastream.pipeline.verify import not_meaningful

    rng = np.random.default_rng(0)
    a, b = rng.standard_normal(5), rng.standard_normal(5)
    assert not_meaningful([a, b]) is None
    assert "NaN" in not_meaningful([np.full(5, np.nan), np.full(5, np.inf)])
    assert "near zero" in not_meaningful([a * 1e-9, b * 1e-9])
    assert "constant" in not_meaningful([a, a.copy(), a.copy()])
    assert not_meaningful([a]) is None  # one input: nothing to say about constancy
    assert not_meaningful([np.full(5, np.nan), a]) is None  # NaN on one input only: still informative


def test_output_constant_over_inputs_is_flagged_but_others_decide():
    """A model with one input-independent output (a constant) and one real one: passes, the constant flagged."""
    from onnx import TensorProto, helper, numpy_helper

    c = numpy_helper.from_array(np.arange(4, dtype=np.float32), "c")
    graph = helper.make_graph(
        [helper.make_node("Sigmoid", ["x"], ["y"], name="sig"), helper.make_node("Identity", ["c"], ["k"], name="const")],
        "mixed", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4]), helper.make_tensor_value_info("k", TensorProto.FLOAT, [4])], [c])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    result = _verify(model, lambda feeds: ort_reference(model, feeds), "fp32", inputs=[TensorSpec("x", "float32", [4])])
    assert result.passed
    assert result.outputs["y"]["meaningful"] and "constant" in result.outputs["k"]["not_meaningful"]


def _embedding_model(vocab: int = 1000, types: int = 2):
    """ids -> Gather(table[vocab, 8]) + Gather(type_table[types, 8]) via a Cast; mask -> Cast -> Mul."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((vocab, 8)).astype(np.float32), "table"),
             numpy_helper.from_array(rng.standard_normal((types, 8)).astype(np.float32), "type_table")]
    nodes = [helper.make_node("Gather", ["table", "ids"], ["e"], name="embed"),
             helper.make_node("Cast", ["type_ids"], ["t32"], to=TensorProto.INT32, name="cast_types"),
             helper.make_node("Gather", ["type_table", "t32"], ["te"], name="type_embed"),
             helper.make_node("Add", ["e", "te"], ["s"], name="add"),
             helper.make_node("Cast", ["mask"], ["mf"], to=TensorProto.FLOAT, name="cast_mask"),
             helper.make_node("Unsqueeze", ["mf", "axes"], ["mu"], name="unsq"),
             helper.make_node("Mul", ["s", "mu"], ["y"], name="mul")]
    inits.append(numpy_helper.from_array(np.array([-1], np.int64), "axes"))
    graph = helper.make_graph(nodes, "embed", [helper.make_tensor_value_info(n, TensorProto.INT64, [1, 64]) for n in ("ids", "type_ids", "mask")],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64, 8])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_token_ids_are_drawn_over_the_vocabulary():
    from parastream.pipeline.verify import input_value_ranges

    model = _embedding_model(vocab=1000)
    inputs = [TensorSpec(n, "int64", [1, 64]) for n in ("ids", "type_ids", "mask")]
    ranges = input_value_ranges(model, inputs)
    assert ranges == {"ids": (0, 999), "type_ids": (0, 1), "mask": (0, 1)}
    seen = []

    def spy(feeds):
        seen.append({k: v.copy() for k, v in feeds.items()})
        return ort_reference(model, feeds)

    result = _verify(model, spy, "fp32", inputs=inputs)
    assert result.passed and result.to_dict()["input_ranges"]["ids"] == [0, 999]
    ids = np.concatenate([f["ids"].ravel() for f in seen])
    assert ids.min() >= 0 and ids.max() <= 999 and ids.max() > 100  # not just 0 and 1
    assert set(np.concatenate([f["mask"].ravel() for f in seen])) <= {0, 1}


def test_float_and_unknown_integer_inputs_keep_the_defaults():
    from parastream.pipeline.verify import input_value_ranges

    model = three_branch_model()
    assert input_value_ranges(model, [TensorSpec("input", "float32", [1, 4, 8, 8])]) == {"input": (-1.0, 1.0)}
    assert input_value_ranges(model, [TensorSpec("n", "int32", [1])]) == {"n": (0, 1)}


def test_resolve_tolerances():
    for precision in ("fp32", "tf32", "fp16", "bf16"):
        assert resolve_tolerances(precision) == (*DEFAULT_TOLERANCES[precision], DEFAULT_SCALE_TOLERANCES[precision])
    assert DEFAULT_SCALE_TOLERANCES == {"fp32": 1e-3, "tf32": 1e-2, "fp16": 0.1, "bf16": 0.15}
    assert resolve_tolerances("fp16", rtol=1e-3) == (1e-3, DEFAULT_TOLERANCES["fp16"][1], None)
    assert resolve_tolerances("fp32", atol=1e-3) == (DEFAULT_TOLERANCES["fp32"][0], 1e-3, None)
    assert resolve_tolerances("fp32", scale_tol=0.2) == (*DEFAULT_TOLERANCES["fp32"], 0.2)
    with pytest.raises(ParastreamError, match="--scale-tol"):
        resolve_tolerances("fp16", atol=1e-2, scale_tol=0.2)
    with pytest.raises(ParastreamError, match="positive"):
        resolve_tolerances("fp16", scale_tol=0.0)
    with pytest.raises(ParastreamError, match="--atol"):
        resolve_tolerances("fp32", atol=-1.0)


def test_uses_simple_compare_func_not_the_deprecated_factory():
    from polygraphy import comparator

    from parastream.pipeline.verify import _simple_compare_func

    func = _simple_compare_func(1e-3, 1e-4)
    if hasattr(comparator, "SimpleCompareFunc"):
        assert isinstance(func, comparator.SimpleCompareFunc)


def test_padding_masks_are_drawn_as_a_tokenizer_pads():
    """A mask input is drawn ones then zeros along its last axis (at least one one, the lengths varying), the
    same feeds for the same seed; other integer inputs keep their draws; the report names the masks."""
    from parastream.pipeline.verify import seeded_inputs

    model = _embedding_model(vocab=1000)
    inputs = [TensorSpec(n, "int64", [8, 64]) for n in ("ids", "type_ids", "mask")]
    loader, _ = seeded_inputs(model, inputs, seed=3, iterations=2)
    feeds = list(loader)
    assert len(feeds) == 2
    for f in feeds:
        m = f["mask"]
        lengths = m.sum(axis=-1)
        assert (lengths >= 1).all() and len(set(lengths.tolist())) > 1
        assert (m == (np.arange(64) < lengths[:, None])).all()  # ones, then zeros
        assert f["ids"].max() > 1  # token ids still over the vocabulary
    again = list(seeded_inputs(model, inputs, seed=3, iterations=2)[0])
    assert all((a["mask"] == b["mask"]).all() and (a["ids"] == b["ids"]).all() for a, b in zip(feeds, again))
    one_row = [TensorSpec(t.name, t.dtype, [1, 64]) for t in inputs]  # the model's own batch
    result = _verify(model, lambda f: ort_reference(model, f), "fp32", inputs=one_row)
    assert result.passed and result.to_dict()["padding_masks"].endswith(": mask")


def _causal_attention_model(path, batch: int = 4, seq: int = 8, dim: int = 16):
    """Causal self-attention masked as transformers writes it: scores where (causal and mask) else float32's
    lowest, softmax; exported by torch (TorchScript)."""
    torch = pytest.importorskip("torch")

    class Causal(torch.nn.Module):
        def forward(self, x, attention_mask):
            scores = x @ x.transpose(-1, -2) / dim ** 0.5
            causal = torch.ones(seq, seq, dtype=torch.bool).tril()
            keep = causal[None] & attention_mask[:, None, :].bool()
            scores = torch.where(keep, scores, torch.tensor(torch.finfo(torch.float32).min))
            return torch.softmax(scores, -1) @ x

    args = (torch.randn(batch, seq, dim), torch.ones(batch, seq, dtype=torch.int64))
    torch.onnx.export(Causal(), args, str(path), input_names=["x", "attention_mask"], output_names=["y"],
                      opset_version=17, dynamo=False)
    return path


def test_an_fp16_causal_model_verifies_on_requests_a_tokenizer_makes(tmp_path, monkeypatch):
    """An fp16 build of a causal model: float32's lowest becomes -inf in fp16, so a query whose every earlier
    token is padding gives NaN where the fp32 original averages the padding.  No request has such a row, and
    verification draws none: the build verifies (it failed on 0/1 masks drawn at random)."""
    from parastream.launcher.engines import torch as torch_backend
    from parastream.pipeline import build

    monkeypatch.setattr(torch_backend, "available", lambda: None)  # its engines run on the CPU too
    path = _causal_attention_model(tmp_path / "causal.onnx")
    bundle = build(path, tmp_path / "out", backend="torch", precision="fp16", search=False, compile=False)
    v = bundle.report["verification"]
    assert v["passed"] and v["padding_masks"].endswith(": attention_mask")


# -- the reference run ahead (ReferenceRun: a GPU build starts it after its load) ------------------------------
def test_a_reference_run_ahead_gives_the_verification_it_would_have_run_itself():
    """The same figures as the reference run in place, for a passing and a failing launcher; the result says
    that the reference ran ahead."""
    from parastream.pipeline.verify import ReferenceRun

    model = three_branch_model()
    for fraction, passed in ((0.03, True), (0.5, False)):
        rtol, atol, scale_tol = resolve_tolerances("fp16")
        plain = verify(model, NoisyLauncher(model, fraction), INPUTS, rtol=rtol, atol=atol, scale_tol=scale_tol,
                       seed=3, iterations=2)
        with ReferenceRun(model, INPUTS, seed=3, iterations=2) as ahead:
            got = verify(model, NoisyLauncher(model, fraction), INPUTS, rtol=rtol, atol=atol, scale_tol=scale_tol,
                         seed=3, iterations=2, reference=ahead)
        assert plain.passed is got.passed is passed
        assert got.outputs == plain.outputs
        assert plain.reference_ahead_s is None and got.reference_ahead_s > 0
        assert "reference_ahead_s" in got.to_dict() and "reference_ahead_s" not in plain.to_dict()


def test_a_reference_run_for_other_inputs_is_not_taken():
    from parastream.pipeline.verify import ReferenceRun

    model = three_branch_model()
    rtol, atol, scale_tol = resolve_tolerances("fp16")
    with ReferenceRun(model, INPUTS, seed=4, iterations=2) as ahead:
        got = verify(model, NoisyLauncher(model, 0.03), INPUTS, rtol=rtol, atol=atol, scale_tol=scale_tol,
                     seed=3, iterations=2, reference=ahead)
    assert got.passed and got.reference_ahead_s is None


def test_a_reference_that_fails_to_run_is_one_error_at_the_verification(tmp_path):
    """ONNX Runtime's failure in the thread is raised where the verification takes the reference, as the
    one-line error the verification gives for it in place."""
    from parastream.pipeline.verify import ReferenceRun, run_verification

    model = three_branch_model()
    broken = onnx.ModelProto()
    broken.CopyFrom(model)
    broken.graph.initializer[0].dims[0] += 1  # the weights contradict the node that reads them
    rtol, atol, scale_tol = resolve_tolerances("fp16")
    with ReferenceRun(broken, INPUTS, seed=3, iterations=2) as ahead:
        with pytest.raises(ParastreamError, match="model.onnx: running the model on random inputs for verification failed"):
            run_verification("model.onnx", broken, NoisyLauncher(model, 0.0), INPUTS, rtol=rtol, atol=atol,
                             scale_tol=scale_tol, seed=3, iterations=2, reference=ahead)
