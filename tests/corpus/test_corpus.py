"""The public-model corpus (bench/corpus.py) as tests.

CI runs the subset that needs no torchvision (transformers models at small configs, random weights, both
exporters): each export must build on the CPU path (``parastream build --json``, as a build step runs it) and
verify against ONNX Runtime, its stdout must be exactly one JSON line whose summary describes the bundle that
shipped (engines, streams, nodes and rewrites as in its plan.json, model.onnx and report.json), and the torch
backend's converter must convert it and match ONNX Runtime.  The rest of the corpus (torchvision, timm)
is the ``corpus`` tier, run on demand with ``PARASTREAM_CORPUS=1`` where those packages import; there an
export must build and verify with the same summary checks, or stop with a one-line error (exit 2) that names a node.
"""

from __future__ import annotations

import json

import sys
from pathlib import Path

import pytest
from summary_check import check_summary, one_json_line, summary_lines

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import corpus  # noqa: E402

CI = [(m, e) for m, s in corpus.MODELS.items() if s.ci for e in corpus.EXPORTERS]
REST = [(m, e) for m, s in corpus.MODELS.items() if not s.ci for e in corpus.EXPORTERS]


def _needs(source: str) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("onnxscript")
    if source == "timm":
        pytest.importorskip("timm")
    elif source == "torchvision":
        try:
            import torchvision  # noqa: F401
        except Exception as e:  # noqa: BLE001 - a torchvision wheel that does not match torch fails at import
            pytest.skip(f"torchvision does not import: {e}")
    else:
        pytest.importorskip("transformers")


def _check_summary(row: dict) -> None:
    """The build's stdout is one JSON line, and its summary and printed lines describe the shipped bundle."""
    check_summary(Path(row["bundle"]), one_json_line(row["build_stdout"]), summary_lines(Path(row["bundle"])))


def test_corpus_has_the_issue_s_coverage():
    fams = {}
    for s in corpus.MODELS.values():
        fams.setdefault(s.family, []).append(s.name)
    assert len(corpus.MODELS) >= 30
    assert len(fams["branchy"]) >= 5 and len(fams["transformer"]) >= 5
    assert {"detection", "segmentation", "chain"} <= set(fams)
    assert {"torchvision", "timm", "transformers"} == {s.source for s in corpus.MODELS.values()}


@pytest.mark.slow
@pytest.mark.parametrize("name,exporter", CI, ids=[f"{m}-{e}" for m, e in CI])
def test_ci_subset_builds_verifies_and_converts(name, exporter, tmp_path):
    _needs("transformers")
    row = corpus.run_one(name, exporter, tmp_path)
    assert row["export_ok"], row.get("export_error")
    assert row["build_ok"], row.get("build_error")
    assert row["verification"]["passed"], row["verification"]
    assert row["nodes_out"] >= 1 and row["streams"] >= 1
    assert row["load_s"] is not None and row["load_s"] > 0, row.get("load_error")  # a fresh process loaded it
    assert row["bundle_mb"] > 0
    _check_summary(row)
    t = row["torch"]
    assert t["missing_ops"] == [], t
    assert t["converts"], t.get("convert_error")
    assert t["torch_scaled_err"] <= 1e-4, t


@pytest.mark.slow
def test_a_row_with_rebuild_builds_again_from_the_first_builds_cache_dir(tmp_path):
    """``--rebuild``: the export is built with a ``--cache-dir`` and again from it; the row says what the rebuild
    took, which is what the first build recorded (its CPU choice where it timed one on a quiet machine, its
    search's decision where that kept the input), and the table gives the rebuild's seconds."""
    from parastream.launcher.bundle import Bundle

    _needs("transformers")
    row = corpus.run_one("bert", "torchscript", tmp_path, rebuild=True)
    assert row["build_ok"] and row["verification"]["passed"], row.get("build_error")
    rb = row["rebuild"]
    assert rb["exit"] == 0 and rb["build_s"] > 0 and "load" in rb["stage_seconds"], rb
    from parastream.pipeline.timings import read_timings

    first = Bundle.open(row["bundle"]).report
    written = (first["recorded_timings"] or {}).get("written")
    record = read_timings(Path(written)) if written else {}
    assert (rb["taken"].get("cpu_choice") == first["cpu_choice"]["chosen"]) == bool(record.get("cpu_choice")), (rb, record)
    assert (rb["taken"].get("search") == "decision to keep the input") == bool(record.get("search_kept_input"))
    assert "written" not in rb["taken"] or not written
    (tmp_path / "out" / "rows").mkdir(parents=True)
    (tmp_path / "out" / "rows" / "bert__torchscript.json").write_text(json.dumps(row, default=str))
    corpus.write_table(tmp_path / "out")
    line = next(x for x in (tmp_path / "out" / "corpus.md").read_text().splitlines() if x.startswith("| bert | ") and " ok |" in x)
    assert f"| {rb['build_s']:.1f} (" in line


@pytest.mark.corpus
@pytest.mark.parametrize("name,exporter", REST, ids=[f"{m}-{e}" for m, e in REST])
def test_full_corpus(name, exporter, tmp_path):
    _needs(corpus.MODELS[name].source)
    row = corpus.run_one(name, exporter, tmp_path)
    if not row["export_ok"]:
        pytest.skip(f"the exporter failed (not parastream): {row['export_error']}")
    if not row["build_ok"]:
        assert row["exit"] == 2, row.get("traceback") or row["build_error"]
        assert "node '" in row["build_error"], row["build_error"]
        return
    assert row["verification"]["passed"], row["verification"]
    _check_summary(row)
    assert row["torch"]["converts"], row["torch"].get("convert_error")


@pytest.fixture(scope="module")
def bert_bundle(tmp_path_factory):
    """A CI-subset export (BERT, TorchScript exporter) and its bundle, built by the CLI."""
    _needs("transformers")
    tmp = tmp_path_factory.mktemp("bert")
    model = tmp / "bert.onnx"
    corpus.export("bert", "torchscript", model)
    code, _, error = corpus.build_with_cli(model, tmp / "bundle")
    assert code == 0, error
    return model, tmp / "bundle"


@pytest.mark.corpus
@pytest.mark.parametrize("kind", ["build", "bench", "export-triton"])
def test_interrupts_leave_no_temporary_folder(kind, tmp_path, bert_bundle):
    """A corpus model's build, bench and Triton export, each signalled at ten random moments of its run (as the
    example models' slow test does): every temporary folder is removed and nothing is half-written."""
    from interrupting import ten_random_moments

    model, bundle = bert_bundle
    assert ten_random_moments(kind, tmp_path, bundle, None, model=model) >= 3  # the rest finished first


def test_zero_initialised_biases_are_drawn_at_random_and_others_left_alone():
    """``corpus.init_zero_biases`` (the GPU benchmarks' models): a Linear's and a MultiheadAttention's zero biases
    get random values, as a trained model's have; a bias that is not zero, a Linear without bias and a
    LayerNorm's zero bias are left as they are."""
    torch = pytest.importorskip("torch")

    torch.manual_seed(0)
    zero, kept, none = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4), torch.nn.Linear(8, 4, bias=False)
    torch.nn.init.zeros_(zero.bias)
    before = kept.bias.detach().clone()
    mha, norm = torch.nn.MultiheadAttention(8, 2), torch.nn.LayerNorm(8)
    assert not torch.any(mha.in_proj_bias) and not torch.any(mha.out_proj.bias) and not torch.any(norm.bias)
    model = torch.nn.ModuleList([zero, kept, none, mha, norm])
    corpus.init_zero_biases(model)
    assert torch.all(zero.bias != 0) and torch.equal(kept.bias, before) and none.bias is None
    assert torch.all(mha.in_proj_bias != 0) and torch.all(mha.out_proj.bias != 0)
    assert not torch.any(norm.bias) and 0 < float(zero.bias.abs().max()) < 0.2


def test_a_model_outside_the_corpus_is_named_by_its_library():
    """``timm:NAME`` and ``torchvision:NAME`` reach image classifiers the corpus does not list (a sweep over models
    nobody here tuned on); a bare unknown name, or another library, is refused with the accepted forms."""
    assert corpus.spec_of("timm:dla34") == corpus.Spec("dla34", "unlisted", "timm")
    assert corpus.spec_of("torchvision:mnasnet1_0") == corpus.Spec("mnasnet1_0", "unlisted", "torchvision")
    assert corpus.spec_of("keras:ResNet50") == corpus.Spec("ResNet50", "unlisted", "keras")
    assert corpus.spec_of("bert") is corpus.MODELS["bert"]
    assert corpus.spec_of("transformers:llama") == corpus.Spec("llama", "unlisted", "transformers")
    for bad in ("dla34", "jax:dla34", "timm:", "transformers:", "transformers:no_such_model"):
        with pytest.raises(KeyError):
            corpus.spec_of(bad)
    for argv in (["--models", "dla34"], ["--models", "timm:dla34", "--exporters", "tf2onxx"]):
        with pytest.raises(SystemExit) as e:
            corpus.main([*argv, "--out", "/nonexistent-parastream-corpus"])
        assert e.value.code == 2


def test_a_transformers_sweep_model_is_built_at_its_small_config():
    """``transformers:NAME`` builds one of HF_SWEEP's small configs with its default attention, wrapped to take
    its inputs by position: a decoder LM (grouped-query attention) and a speech encoder run as exported."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    for name, shape in (("transformers:llama", (1, 32, 128)), ("transformers:whisper_encoder", (1, 64, 128))):
        model, inputs = corpus.make_model(name)
        assert model.config._attn_implementation == "sdpa"
        with torch.no_grad():
            (out,) = corpus.wrap(model, corpus.spec_of(name), list(inputs))(*inputs.values())
        assert tuple(out.shape) == shape and torch.isfinite(out).all()


@pytest.mark.slow
@pytest.mark.parametrize("name", corpus.HF_SWEEP)
def test_every_transformers_sweep_config_builds_and_runs(name):
    """Each of HF_SWEEP's small configs is a model the installed transformers builds and runs on its inputs, to
    finite outputs: a config a newer transformers refuses fails here, not in a sweep."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    model, inputs = corpus.make_model(f"transformers:{name}")
    with torch.no_grad():
        outs = corpus.wrap(model, corpus.spec_of(f"transformers:{name}"), list(inputs))(*inputs.values())
    assert outs and all(torch.isfinite(o).all() for o in outs if o.is_floating_point())


def test_the_torch_converter_column_counts_the_attentions_a_torch_build_fuses():
    """``attention_check``: of two Softmax nodes, the attention (Q·Kᵀ, Softmax, ·V) fuses and the other (a
    softmax over another axis) does not, with the reason; the fused model in the torch converter equals ONNX
    Runtime on the original."""
    pytest.importorskip("torch")
    import numpy as np
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    vi = lambda name, shape: helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)  # noqa: E731
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["q", "kt"], ["s"]),
             helper.make_node("Softmax", ["s"], ["p"], axis=-1),
             helper.make_node("MatMul", ["p", "v"], ["y"]),
             helper.make_node("Softmax", ["y"], ["z"], axis=2)]
    graph = helper.make_graph(nodes, "g", [vi(n, [1, 2, 5, 4]) for n in "qkv"], [vi("z", [1, 2, 5, 4])])
    m = onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    rng = np.random.default_rng(0)
    feeds = {n: rng.standard_normal((1, 2, 5, 4)).astype(np.float32) for n in "qkv"}
    ref = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    got = corpus.attention_check(m, feeds, ref)
    assert (got["softmax"], got["fused"]) == (2, 1) and "is not over the last axis" in got["not_fused"], got
    assert got["fused_scaled_err"] < 1e-5
    row = corpus.torch_converter_check(m, feeds)
    assert row["converts"] and row["attention"]["fused"] == 1


def test_a_keras_model_is_taken_from_its_kept_export_only(tmp_path):
    """Keras models are exported by bench/keras_export.py under a TensorFlow interpreter: without a kept export
    the row says so (its export failed, naming the script), and a PyTorch model is not exported with tf2onnx."""
    for name, exporter in (("keras:ResNet50", "tf2onnx"), ("timm:dla34", "tf2onnx")):
        row = corpus.run_one(name, exporter, tmp_path)
        assert row["export_ok"] is False and "bench/keras_export.py" in row["export_error"], row


def test_the_torch_converter_column_checks_lowered_depthwise_convolutions_only_where_a_model_has_them():
    """``torch_converter_check`` runs a model with a depthwise convolution a second time with it lowered for
    Inductor (``--conv-kernels inductor``), against ONNX Runtime; a model without one gets no such figure."""
    pytest.importorskip("torch")
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)

    def model(group: int) -> onnx.ModelProto:
        w = numpy_helper.from_array((rng.standard_normal((4, 4 // group, 5, 5)) * 0.3).astype(np.float32), "w")
        node = helper.make_node("Conv", ["x", "w"], ["y"], pads=[2, 2, 2, 2], group=group)
        graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 9, 9])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 9, 9])], [w])
        m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        m.ir_version = 8
        return m

    feeds = {"x": rng.standard_normal((1, 4, 9, 9)).astype(np.float32)}
    depthwise = corpus.torch_converter_check(model(4), feeds)
    assert depthwise["converts"] and depthwise["depthwise_lowered"] == 1
    assert depthwise["depthwise_lowered_scaled_err"] < 1e-5
    dense = corpus.torch_converter_check(model(1), feeds)
    assert dense["converts"] and "depthwise_lowered" not in dense
