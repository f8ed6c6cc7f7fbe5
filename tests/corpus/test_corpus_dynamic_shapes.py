"""The corpus's transformers (bench/corpus.py, small configs, random weights) exported with a dynamic batch and
sequence and built with sequence 1..64 on ONNX Runtime engines: every bucket and lengths between buckets equal
ONNX Runtime on the unpadded input (the build proves the padding first; verification at a length between)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import corpus  # noqa: E402

TEXT = [m for m, s in corpus.MODELS.items() if s.source == "transformers" and s.family == "transformer"
        and m in ("bert", "distilbert", "gpt2", "t5_encoder")]


def _export_dynamic(name: str, path: Path) -> list[str]:
    import torch

    model, inputs = corpus.make_model(name)
    w = corpus.wrap(model, corpus.MODELS[name], list(inputs))
    axes = {0: "batch", 1: "seq"}
    with torch.no_grad():
        n_out = len(w(*inputs.values()))
        outs = [f"output_{i}" for i in range(n_out)] if n_out > 1 else ["output"]
        torch.onnx.export(w, tuple(inputs.values()), str(path), input_names=list(inputs), output_names=outs,
                          dynamic_axes={n: axes for n in list(inputs)}, opset_version=17, dynamo=False)
    return list(inputs)


@pytest.mark.slow
@pytest.mark.parametrize("name", TEXT)
def test_corpus_transformer_with_a_sequence_axis(name, tmp_path):
    pytest.importorskip("transformers")
    import onnxruntime as ort

    from parastream.core.accuracy import scaled_error
    from parastream.launcher import load
    from parastream.pipeline import build

    path = tmp_path / f"{name}.onnx"
    names = _export_dynamic(name, path)
    bundle = build(path, tmp_path / "out", backend="onnxruntime", search=False, min_shapes={"input_ids": [1, 1]},
                   max_shapes={"input_ids": [1, 64]})
    rec = bundle.manifest["buckets"]
    assert [a["sizes"] for a in rec["axes"]] == [[1, 2, 4, 8, 16, 32, 64]]
    assert bundle.report["buckets"]["between"]["passed"]
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    la = load(bundle.path)
    try:
        for seq in (3, 16, 33, 64):
            rng = np.random.default_rng(seq)
            feeds = {"input_ids": rng.integers(0, 1000, (1, seq)).astype(np.int64)}
            if "attention_mask" in names:
                feeds["attention_mask"] = np.ones((1, seq), np.int64)
            got = la(feeds)
            want = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
            for k, ref in want.items():
                assert got[k].shape == ref.shape and scaled_error(got[k], ref) <= 1e-4, (seq, k)
    finally:
        la.close()
