"""--min-shapes/--opt-shapes/--max-shapes: a grid of static buckets over any named axis.  A tiny BERT built with
sequence 1..64 serves every length in range (padded to its bucket, cut back) equal to ONNX Runtime on the
unpadded input; an axis whose padding is not harmless (a CNN's image side, attention without a mask) is refused
in one line, and built exactly with --buckets; a size out of range is refused naming the input, axis and range."""

from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort
import pytest
from dynamic_models import VOCAB, bert_feeds, small_cnn, tiny_bert, tiny_gpt2, unmasked_attention

from parastream.core.accuracy import scaled_error
from parastream.launcher import load
from parastream.launcher.buckets import cut_axis, pad_axis
from parastream.launcher.errors import ParastreamError
from parastream.pipeline import build
from parastream.pipeline.cli import main
from parastream.pipeline.model_io import parse_axis_buckets, parse_pads, shape_axes

SEQ_SIZES = [1, 2, 4, 8, 16, 32, 64]


def _ort(path, feeds):
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    pytest.importorskip("transformers")
    return tiny_bert(tmp_path_factory.mktemp("bert") / "bert.onnx")


@pytest.fixture(scope="module")
def seq_bundle(bert, tmp_path_factory):
    """The BERT at batch 1, sequence 1..64 (buckets 1, 2, 4, ..., 64), onnxruntime engines."""
    out = tmp_path_factory.mktemp("seq") / "out"
    return build(bert, out, backend="onnxruntime", search=False, min_shapes={"input_ids": [1, 1]},
                 opt_shapes={"input_ids": [1, 16]}, max_shapes={"input_ids": [1, 64]})


def test_the_sequence_axis_is_one_axis_over_every_input_that_names_it(bert, seq_bundle):
    rec = seq_bundle.manifest["buckets"]
    (axis,) = rec["axes"]
    assert axis["name"] == "seq" and axis["sizes"] == SEQ_SIZES
    assert axis["inputs"] == {"input_ids": 1, "attention_mask": 1, "token_type_ids": 1}
    assert axis["pad"] == {"input_ids": 0, "attention_mask": 0, "token_type_ids": 0}
    assert set(axis["pad_source"].values()) == {"detected"}
    assert axis["outputs"] == {"hidden": [1]} and not axis["exact"]
    assert sorted(rec["grid"], key=int) == [str(s) for s in SEQ_SIZES]
    assert rec["grid"]["64"] == "." and rec["grid"]["16"] == "buckets/b16"
    report = json.loads((seq_bundle.path / "report.json").read_text())["buckets"]
    assert report["between"]["passed"] and report["between"]["point"] == [3] and report["between"]["bucket"] == [4]
    assert all(r["verified"] for r in report["per_bucket"].values())
    assert report["memory"]["engine_bytes"] > report["memory"]["engine_bytes_at_max"]


@pytest.mark.parametrize("seq", SEQ_SIZES + [3, 17, 33, 50])
def test_every_length_equals_onnxruntime_on_the_unpadded_input(bert, seq_bundle, seq):
    la = load(seq_bundle.path)
    try:
        feeds = bert_feeds(1, seq, seed=seq)
        got = la(feeds)
        bucket = la.bucket_for(la.point_of(feeds))
    finally:
        la.close()
    want = _ort(bert, feeds)
    assert bucket == (min(s for s in SEQ_SIZES if s >= seq),)
    assert got["hidden"].shape == (1, seq, 32)
    assert scaled_error(got["hidden"], want["hidden"]) <= 1e-5


def test_a_length_out_of_range_names_the_input_the_axis_and_the_range(seq_bundle):
    la = load(seq_bundle.path)
    try:
        with pytest.raises(ParastreamError, match=r"input 'input_ids' dimension 1 \(axis 'seq'\) has size 65, outside "
                                                  r"this bundle's range 1\.\.64"):
            la(bert_feeds(1, 65))
        with pytest.raises(ParastreamError, match="disagree on axis 'seq'"):
            la({**bert_feeds(1, 8), "attention_mask": np.ones((1, 9), np.int64)})
    finally:
        la.close()


def test_a_changed_byte_in_any_bucket_refuses_the_bundle(seq_bundle, tmp_path):
    import shutil

    from parastream.launcher.bundle import Bundle

    copy = tmp_path / "copy"
    shutil.copytree(seq_bundle.path, copy)
    plan = copy / "buckets" / "b16" / "plan.json"
    plan.write_text(plan.read_text() + " ")
    with pytest.raises(ParastreamError, match=r"b16/plan.json: sha256 differs from manifest.json"):
        Bundle.open(copy)


def test_verify_checks_every_bucket_and_a_length_between(seq_bundle, capsys):
    assert main(["verify", str(seq_bundle.path), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["passed"] and got["axes"] == "seq"
    assert set(got["points"]) == {str(s) for s in SEQ_SIZES} | {"3"}
    assert got["points"]["3"]["bucket"] == "4"


def test_run_takes_any_length_and_refuses_one_out_of_range(seq_bundle, tmp_path, capsys):
    feeds = bert_feeds(1, 5, seed=3)
    args = []
    for k, v in feeds.items():
        np.save(tmp_path / f"{k}.npy", v)
        args += ["--input", f"{k}={tmp_path / k}.npy"]
    assert main(["run", str(seq_bundle.path), *args, "--output-dir", str(tmp_path / "outs")]) == 0
    assert np.load(tmp_path / "outs" / "hidden.npy").shape == (1, 5, 32)
    long = bert_feeds(1, 70)
    args = []
    for k, v in long.items():
        np.save(tmp_path / f"{k}.npy", v)
        args += ["--input", f"{k}={tmp_path / k}.npy"]
    capsys.readouterr()
    assert main(["run", str(seq_bundle.path), *args, "--output-dir", str(tmp_path / "outs2")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'input_ids'" in err[0] and "'seq'" in err[0] and "1..64" in err[0]


def test_bench_times_each_bucket_against_one_bucket_at_max(seq_bundle, capsys):
    assert main(["bench", str(seq_bundle.path), "--runs", "2", "--warmup", "1", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert [p["point"] for p in got["points"]] == [[1], [2], [3], [4], [8], [16], [32], [64]]
    assert got["points"][2]["bucket"] == [4] and got["points"][2]["padded_to_max_ms"] > 0
    assert got["memory"]["engine_bytes"] > 0


@pytest.mark.slow
def test_a_batch_by_sequence_grid_serves_every_shape(bert, tmp_path, capsys):
    out = tmp_path / "grid"
    assert main(["build", str(bert), "-o", str(out), "--backend", "onnxruntime", "--no-search",
                 "--min-shapes", "input_ids:1x1", "--max-shapes", "input_ids:4x64", "--buckets", "input_ids:1=16,64"]) == 0
    summary = capsys.readouterr().out
    assert "batch 1..4, seq 1..64 in buckets ['1x16', '1x64', '2x16', '2x64', '4x16', '4x64']" in summary
    assert "verified at 3x17 between buckets too" in summary
    rec = json.loads((out / "manifest.json").read_text())["buckets"]
    assert [(a["name"], a["sizes"]) for a in rec["axes"]] == [("batch", [1, 2, 4]), ("seq", [16, 64])]
    assert rec["axes"][0]["pad"]["attention_mask"] == "repeat" and rec["axes"][0]["outputs"] == {"hidden": [0]}
    assert len(rec["grid"]) == 6 and rec["grid"]["4x64"] == "."
    la = load(out)
    try:
        for n, seq in [(1, 3), (3, 17), (4, 64), (2, 40)]:
            feeds = bert_feeds(n, seq, seed=n * seq)
            got = la(feeds)["hidden"]
            assert got.shape == (n, seq, 32)
            assert scaled_error(got, _ort(bert, feeds)["hidden"]) <= 1e-5
        assert la.bucket_for((3, 17)) == (4, 64)
    finally:
        la.close()


def test_one_bucket_at_max_serves_every_shorter_length_padded(bert, tmp_path):
    """--buckets with MAX alone: every length below it is padded, so the check and the verification run at MIN."""
    bundle = build(bert, tmp_path / "out", backend="onnxruntime", search=False, min_shapes={"input_ids": [1, 1]},
                   max_shapes={"input_ids": [1, 16]}, shape_buckets={("input_ids", 1): [16]})
    assert bundle.report["buckets"]["between"]["point"] == [1] and bundle.report["buckets"]["between"]["bucket"] == [16]
    with load(bundle.path) as la:
        feeds = bert_feeds(1, 6, seed=6)
        assert scaled_error(la(feeds)["hidden"], _ort(bert, feeds)["hidden"]) <= 1e-5


def test_a_cnn_image_side_is_refused_in_one_line_and_nothing_is_written(tmp_path, capsys):
    path = small_cnn(tmp_path / "cnn.onnx")
    out = tmp_path / "out"
    capsys.readouterr()
    assert main(["build", str(path), "-o", str(out), "--backend", "onnxruntime", "--no-search",
                 "--min-shapes", "image:1x3x16x16", "--max-shapes", "image:1x3x32x32"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "axis 'H' (image:2) cannot be padded" in err and "does not ignore padded positions" in err
    assert "axis 'W' (image:3) neither" in err and err.endswith("--buckets image:2=16,32 --buckets image:3=16,32")
    assert not out.exists()


def test_attention_without_a_mask_is_refused(tmp_path):
    path = unmasked_attention(tmp_path / "attn.onnx")
    with pytest.raises(ParastreamError, match=r"axis 'seq' \(x:1\) cannot be padded: padded from 3 to 4, output 'y' "
                                              r"differs at the real positions"):
        build(path, tmp_path / "out", backend="onnxruntime", search=False, min_shapes={"x": [1, 1, 8]},
              max_shapes={"x": [1, 8, 8]})
    assert not (tmp_path / "out").exists()


def test_a_cnn_with_exact_sizes_builds_each_and_runs_only_those(tmp_path):
    path = small_cnn(tmp_path / "cnn.onnx")
    bundle = build(path, tmp_path / "out", backend="onnxruntime", search=False,
                   min_shapes={"image": [1, 3, 16, 16]}, max_shapes={"image": [1, 3, 32, 32]},
                   shape_buckets={("image", 2): [16, 24, 32], ("image", 3): [16, 32]})
    axes = bundle.manifest["buckets"]["axes"]
    assert [(a["name"], a["sizes"], a["exact"]) for a in axes] == [("H", [16, 24, 32], True), ("W", [16, 32], True)]
    la = load(bundle.path)
    try:
        rng = np.random.default_rng(0)
        for h, w in [(16, 16), (24, 32), (32, 16)]:
            x = rng.standard_normal((1, 3, h, w)).astype(np.float32)
            assert scaled_error(la({"image": x})["logits"], _ort(path, {"image": x})["logits"]) <= 1e-5
        with pytest.raises(ParastreamError, match=r"input 'image' dimension 2 \(axis 'H'\) has size 20; this bundle was "
                                                  r"built for exactly 16, 24, 32 on axis 'H' \(no padding there\)"):
            la({"image": np.zeros((1, 3, 20, 16), np.float32)})
    finally:
        la.close()


@pytest.mark.slow
@pytest.mark.parametrize("mask", [True, False], ids=["masked", "causal-only"])
def test_gpt2_pads_at_the_end_with_position_ids_counting_on(tmp_path, mask):
    """A causal decoder: padded at the end, its real positions are unchanged with or without a mask input;
    position ids continue through the padding."""
    pytest.importorskip("transformers")
    path = tiny_gpt2(tmp_path / "gpt2.onnx", mask=mask)
    bundle = build(path, tmp_path / "out", backend="onnxruntime", search=False, min_shapes={"input_ids": [1, 1]},
                   max_shapes={"input_ids": [1, 32]})
    (axis,) = bundle.manifest["buckets"]["axes"]
    if mask:
        assert axis["pad"]["position_ids"] == "continue" and axis["pad_source"]["position_ids"] == "detected"
    la = load(bundle.path)
    try:
        for seq in (5, 17, 32):
            rng = np.random.default_rng(seq)
            feeds = {"input_ids": rng.integers(0, VOCAB, (1, seq))}
            if mask:
                feeds.update(attention_mask=np.ones((1, seq), np.int64), position_ids=np.arange(seq)[None])
            got = la(feeds)["hidden"]
            assert got.shape == (1, seq, 32) and scaled_error(got, _ort(path, feeds)["hidden"]) <= 1e-5
    finally:
        la.close()


# -- options -------------------------------------------------------------------------------------------------------

def test_bad_options_are_one_line_errors(tmp_path, bert):
    with pytest.raises(ParastreamError, match="--buckets 'input_ids=16' is not INPUT:AXIS=SIZE"):
        parse_axis_buckets(["input_ids=16"])
    with pytest.raises(ParastreamError, match="--pad 'x' is not NAME=VALUE"):
        parse_pads(["x"])
    assert parse_pads(["input_ids=1", "position_ids=continue", "x=0.5"]) == {"input_ids": 1, "position_ids": "continue", "x": 0.5}
    with pytest.raises(ParastreamError, match="--pad names 'nope', which is not an input"):
        shape_axes(bert, {}, {"input_ids": ([1, 1], [1, 1], [1, 8])}, pads={"nope": 0})
    with pytest.raises(ParastreamError, match="share dimension 'seq' .* ranges 1:1:8 and 1:1:16"):
        shape_axes(bert, {}, {"input_ids": ([1, 1], [1, 1], [1, 8]), "attention_mask": ([1, 1], [1, 1], [1, 16])})
    with pytest.raises(ParastreamError, match=r"--buckets input_ids:1 must include the axis's MAX = 8"):
        shape_axes(bert, {}, {"input_ids": ([1, 1], [1, 1], [1, 8])}, buckets={("input_ids", 1): [2, 4]})
    with pytest.raises(ParastreamError, match=r"--buckets input_ids:0: dimension 0 of input 'input_ids' is not a dynamic axis"):
        shape_axes(bert, {}, {"input_ids": ([1, 1], [1, 1], [1, 8])}, buckets={("input_ids", 0): [1]})
    with pytest.raises(ParastreamError, match="more than 64"):
        shape_axes(bert, {}, {"input_ids": ([1, 1], [1, 1], [1 << 10, 1 << 10])})
    with pytest.raises(ParastreamError, match="--buckets needs dynamic axes"):
        build(bert, tmp_path / "o", backend="onnxruntime", shape_buckets={("input_ids", 1): [8]})


def test_padding_helpers():
    x = np.array([[5, 6, 7]])
    assert pad_axis(x, 1, 5, 0).tolist() == [[5, 6, 7, 0, 0]]
    assert pad_axis(x, 1, 5, "continue").tolist() == [[5, 6, 7, 8, 9]]
    assert pad_axis(x, 0, 3, "repeat").tolist() == [[5, 6, 7]] * 3
    assert cut_axis(pad_axis(x, 1, 5, 1), 1, 3).tolist() == [[5, 6, 7]]
