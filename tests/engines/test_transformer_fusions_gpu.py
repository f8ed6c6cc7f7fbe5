"""Decoder and encoder transformers as users export them (transformers' eager attention, the TorchScript exporter),
searched with the torch backend's rules: the rewritten model computes what ONNX Runtime computes on the original
in fp16 on the GPU with each fusion the engines may run (fused attention, cuBLASLt's GEMM epilogue) on and off,
so that a failed verification of a whole build is pinned to one fusion here."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SEQ = 32


def _export(name: str, folder) -> tuple:
    """(path, feeds): ``name`` as bench/dynamic_shapes.py makes it (12 layers, hidden 768, random weights, eager
    attention, the last hidden state out) exported at batch 1, sequence SEQ."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    try:
        from dynamic_shapes import make
    finally:
        sys.path.pop(0)
    model, vocab = make(name, tiny=False, max_seq=SEQ)
    rng = np.random.default_rng(0)
    feeds = {"input_ids": rng.integers(0, vocab, (1, SEQ)).astype(np.int64),
             "attention_mask": np.ones((1, SEQ), np.int64)}
    path = folder / f"{name}.onnx"
    with torch.no_grad():
        torch.onnx.export(model, tuple(torch.from_numpy(v) for v in feeds.values()), str(path),
                          input_names=list(feeds), output_names=["hidden"], opset_version=17, dynamo=False)
    return path, feeds


@pytest.fixture(scope="module", params=["gpt2", "bert"])
def searched(request, tmp_path_factory):
    import onnxruntime as ort

    from parastream.pipeline.model_io import load_model
    from parastream.rewrite import optimize
    from parastream.rewrite.rules import rules_for

    path, feeds = _export(request.param, tmp_path_factory.mktemp(request.param))
    ref = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    model, report = optimize(load_model(path).model, rules=rules_for("torch"), seed=0)
    return request.param, model, report, feeds, ref


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("attention,gemm", [(False, False), (True, False), (False, True), (True, True)])
def test_searched_transformer_in_fp16_matches_onnxruntime(searched, attention, gemm):
    from parastream.launcher.engines.onnx_torch import convert

    name, model, report, feeds, ref = searched
    module = convert(model, "float16", fuse_attention=attention, fuse_gemm_epilogue=gemm).cuda()
    with torch.no_grad():
        got = module(*(torch.from_numpy(v).cuda() for v in feeds.values()))
    got = (got[0] if isinstance(got, (list, tuple)) else got).float().cpu().numpy()
    err = float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))
    print(f"{name} attention={attention} gemm={gemm}: scaled error {err:.3g}, rules {report['rules_chosen_count']}")
    assert err <= 0.05, f"{name}: fused attention {attention}, GEMM epilogue {gemm}: scaled error {err:.3g}"
