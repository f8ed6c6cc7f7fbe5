#!/usr/bin/env python3
"""The public-model corpus: models nobody here wrote, exported the two ways a user would.

Every model is built with random weights (no downloads) from torchvision, timm or transformers
(small configs), its BatchNorm statistics calibrated on random images (so that fp16 does not
overflow), and exported with BOTH the TorchScript exporter (``dynamo=False, opset_version=17``) and
the default dynamo exporter.  Each export is then given to ``parastream build`` (CPU path:
``--backend onnxruntime``, rewrite search on, verification against ONNX Runtime on the original
model) and to the torch backend's converter (launcher/engines/onnx_torch.py, run eagerly on the CPU
and compared with ONNX Runtime).  One row per model and exporter:

  export ok | build ok or its one-line error (exit status) | nodes before/after the rewrite | streams |
  verification figures | ops the torch converter does not cover | torch-converter error | build seconds

Usage (full corpus: torchvision + timm + transformers must import; a CUDA build of torch runs on a CPU):

    python3 bench/corpus.py --out bench/corpus                  # every model, both exporters
    python3 bench/corpus.py --models resnet50,bert --exporters torchscript
    python3 bench/corpus.py --ci --out /tmp/corpus               # the subset that CI runs (transformers only)
    python3 bench/corpus.py --list
    python3 bench/corpus.py --models resnet50,nasnetalarge --exporters torchscript --rebuild   # and a rebuild each
    python3 bench/corpus.py --models timm:dla34,torchvision:mnasnet1_0   # image classifiers outside the corpus
    python3 bench/corpus.py --models keras:ResNet50 --exporters tf2onnx --keep K --reuse-exports   # bench/keras_export.py's

Each (model, exporter) runs in its own process (--timeout seconds) and leaves ``OUT/rows/<model>__<exporter>.json``;
the table (``OUT/corpus.md`` and ``OUT/corpus.json``) is made from every row file in OUT/rows, so runs can be split.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
EXPORTERS = ("torchscript", "dynamo")
#: every exporter a row can name: tf2onnx's rows are Keras models that bench/keras_export.py exported under a
#: TensorFlow interpreter (this one needs none), taken from --keep with --reuse-exports
ALL_EXPORTERS = EXPORTERS + ("tf2onnx",)


@dataclass(frozen=True)
class Spec:
    name: str
    family: str  # branchy | chain | transformer | segmentation | detection
    source: str  # torchvision | timm | transformers
    ci: bool = False  # in the CPU subset that CI runs (needs no torchvision)


def _tv(name, family, **kw):
    return Spec(name, family, "torchvision", **kw)


def _timm(name, family, **kw):
    return Spec(name, family, "timm", **kw)


def _hf(name, family="transformer", **kw):
    return Spec(name, family, "transformers", **kw)


MODELS: dict[str, Spec] = {s.name: s for s in [
    # branchy CNNs: the AutoGraph / Opara workloads
    _tv("inception_v3", "branchy"), _tv("googlenet", "branchy"), _tv("squeezenet1_1", "branchy"),
    _timm("inception_v4", "branchy"), _timm("inception_resnet_v2", "branchy"), _timm("nasnetalarge", "branchy"),
    _timm("dpn68", "branchy"), _timm("res2net50_26w_4s", "branchy"), _timm("skresnet18", "branchy"),
    _timm("mixnet_s", "branchy"),
    # depthwise-separable and hybrid nets (depthwise convolutions: docs/torch-engines.md, "Fresh-process load")
    _timm("ghostnet_100", "chain"), _timm("mobilevit_xs", "transformer"),
    # chains
    _tv("resnet50", "chain"), _tv("resnext50_32x4d", "chain"), _tv("regnet_y_400mf", "chain"),
    _tv("mobilenet_v2", "chain"), _tv("mobilenet_v3_small", "chain"), _tv("efficientnet_b0", "chain"),
    _tv("densenet121", "chain"), _tv("convnext_tiny", "chain"), _tv("shufflenet_v2_x1_0", "chain"),
    _hf("hf_resnet", "chain", ci=True), _hf("hf_mobilenet_v2", "chain"), _hf("hf_convnext", "chain"),
    # transformers
    _tv("swin_t", "transformer"), _tv("vit_b_16", "transformer"),
    _hf("bert", ci=True), _hf("distilbert"), _hf("gpt2", ci=True), _hf("t5_encoder"), _hf("vit", ci=True),
    _hf("deit"), _hf("swin"),
    # dense prediction
    _tv("deeplabv3_mobilenet_v3_large", "segmentation"),
    _tv("fcos_resnet50_fpn", "detection"), _tv("retinanet_resnet50_fpn", "detection"),
    _tv("ssdlite320_mobilenet_v3_large", "detection"), _tv("fasterrcnn_mobilenet_v3_large_320_fpn", "detection"),
    _tv("maskrcnn_resnet50_fpn", "detection"),
]}


def spec_of(name: str) -> Spec:
    """The corpus's spec of ``name``, or, for a model outside the corpus named as ``timm:NAME``,
    ``torchvision:NAME`` (an image classifier of that library, at its default input size) or ``keras:NAME`` (a
    ``tf.keras.applications`` model, exported by bench/keras_export.py) or ``transformers:NAME`` (one of
    ``HF_SWEEP``'s small configs), a spec of family "unlisted": a sweep over models nobody here tuned on (the row
    keeps the name as given)."""
    if name in MODELS:
        return MODELS[name]
    source, _, bare = name.partition(":")
    if source in ("timm", "torchvision", "keras") and bare or source == "transformers" and bare in HF_SWEEP:
        return Spec(bare, "unlisted", source)
    raise KeyError(name)


# -- models -------------------------------------------------------------------------------------------------

def init_zero_linears(model) -> None:
    """Random weights for Linear layers that their library initialises to zero (torchvision's ViT head):
    with those the model's output is zero on every input, which no trained model gives and no verification
    can judge (parastream calls it inconclusive)."""
    import torch

    for m in model.modules():
        if isinstance(m, torch.nn.Linear) and not torch.any(m.weight):
            torch.nn.init.trunc_normal_(m.weight, std=0.02)


def init_zero_biases(model, std: float = 0.02) -> None:
    """Random biases for Linear layers and attention projections that their library initialises to zero
    (transformers' BERT, torch's MultiheadAttention): a trained model's are not zero, and a build folds a zero
    bias away (``fold_bn_and_affine``), so with them a GPU table would time a product that no trained model
    runs (a product without its bias, where torch.compile's ``addmm`` adds one).  Used by the GPU benchmarks
    (bench/gpu.py), where the two sides then run the same weights a trained model would have."""
    import torch

    with torch.no_grad():
        for m in model.modules():
            for name in ("bias", "in_proj_bias"):
                b = getattr(m, name, None)
                if isinstance(b, torch.Tensor) and b.is_floating_point() and b.dim() == 1 and not torch.any(b) \
                        and isinstance(m, (torch.nn.Linear, torch.nn.MultiheadAttention)):
                    b.normal_(0.0, std)


def calibrate_batchnorm(model, example, batches: int = 2, batch_size: int = 4) -> None:
    """BatchNorm running statistics from random images, as training would set them.

    With random weights and the default statistics (mean 0, var 1) activations grow layer by layer and
    overflow fp16 (Inception-v3 gave NaN); a few training-mode passes over random images fix that.
    """
    import torch

    bns = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    if not bns:
        return
    for m in bns:
        m.reset_running_stats()
        m.momentum = None  # cumulative average over the calibration batches
    model.train()
    with torch.no_grad():
        for _ in range(batches):
            model(torch.randn(batch_size, *example.shape[1:]))
    model.eval()


# transformers models outside the corpus, at small configs (``transformers:NAME``), each with the attention its
# library uses by default (``sdpa`` where it has one), as a user exports it: decoder LMs with grouped-query
# attention and rotary embeddings, encoders with factorised or shared embeddings, speech and vision encoders.
HF_SWEEP = ("llama", "qwen2", "mistral", "phi3", "gemma", "bert_sdpa", "roberta", "albert", "electra", "deberta_v2",
            "clip_vision", "clip_text", "whisper_encoder", "wav2vec2", "segformer", "dinov2", "beit", "bart_encoder",
            # decoders with other attention and block layouts: learned or ALiBi positions (OPT, BLOOM, MPT), partial
            # rotary (GPT-NeoX, GPT-J, Phi, StableLM), attention and MLP side by side (GPT-J, Falcon with one
            # key/value head, Phi), sliding windows and logit soft-capping (Starcoder2, Gemma-2), mixtures of experts
            # (Mixtral, Qwen2-MoE), a state-space model without attention (Mamba); and encoders at their defaults
            "gpt2_sdpa", "gpt_neox", "opt", "falcon", "bloom", "gptj", "phi", "stablelm", "starcoder2", "olmo",
            "gemma2", "mixtral", "qwen2_moe", "mpt", "mamba", "modernbert", "mobilebert", "mpnet", "distilbert_sdpa",
            "t5_encoder_sdpa")


def _hf_sweep(name: str, ids, mask):
    import torch
    import transformers as tf

    text = dict(vocab_size=1000, hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=256,
                max_position_embeddings=128)
    lm = dict(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, use_cache=False)
    img = {"pixel_values": torch.randn(1, 3, 64, 64)}
    vision = dict(image_size=64, patch_size=8, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                  intermediate_size=256)
    tokens = {"input_ids": ids, "attention_mask": mask}
    if name == "llama":
        return tf.LlamaModel(tf.LlamaConfig(**lm)), tokens
    if name == "qwen2":
        return tf.Qwen2Model(tf.Qwen2Config(**lm)), tokens
    if name == "mistral":
        return tf.MistralModel(tf.MistralConfig(**lm, sliding_window=16)), tokens
    if name == "phi3":
        return tf.Phi3Model(tf.Phi3Config(**lm, pad_token_id=0)), tokens
    if name == "gemma":
        return tf.GemmaModel(tf.GemmaConfig(**lm, head_dim=32)), tokens
    if name == "bert_sdpa":
        return tf.BertModel(tf.BertConfig(**text)), tokens
    if name == "roberta":
        return tf.RobertaModel(tf.RobertaConfig(**text, pad_token_id=1)), tokens
    if name == "albert":
        return tf.AlbertModel(tf.AlbertConfig(**text, embedding_size=64)), tokens
    if name == "electra":
        return tf.ElectraModel(tf.ElectraConfig(**text, embedding_size=64)), tokens
    if name == "deberta_v2":
        return tf.DebertaV2Model(tf.DebertaV2Config(**text)), tokens
    if name == "clip_vision":
        return tf.CLIPVisionModel(tf.CLIPVisionConfig(**vision)), img
    if name == "clip_text":
        cfg = tf.CLIPTextConfig(vocab_size=1000, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                                intermediate_size=256, max_position_embeddings=128)
        return tf.CLIPTextModel(cfg), tokens
    if name == "whisper_encoder":
        cfg = tf.WhisperConfig(d_model=128, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=256,
                               decoder_layers=1, decoder_attention_heads=2, decoder_ffn_dim=256,
                               num_mel_bins=80, max_source_positions=64, vocab_size=1000, pad_token_id=1,
                               bos_token_id=0, eos_token_id=2, decoder_start_token_id=0)
        return tf.WhisperModel(cfg).get_encoder(), {"input_features": torch.randn(1, 80, 128)}
    if name == "wav2vec2":
        cfg = tf.Wav2Vec2Config(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=256,
                                conv_dim=(32, 32), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
                                num_conv_pos_embedding_groups=4, vocab_size=1000)
        return tf.Wav2Vec2Model(cfg), {"input_values": torch.randn(1, 1600)}
    if name == "segformer":
        return tf.SegformerModel(tf.SegformerConfig()), img
    if name == "dinov2":
        return tf.Dinov2Model(tf.Dinov2Config(**vision)), img
    if name == "beit":
        return tf.BeitModel(tf.BeitConfig(**vision, use_relative_position_bias=True)), img
    if name == "gpt2_sdpa":
        cfg = tf.GPT2Config(vocab_size=1000, n_embd=128, n_layer=2, n_head=2, n_positions=128, use_cache=False)
        return tf.GPT2Model(cfg), tokens
    if name == "gpt_neox":
        cfg = tf.GPTNeoXConfig(vocab_size=1000, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                               intermediate_size=256, max_position_embeddings=128, rotary_pct=0.25, use_cache=False)
        return tf.GPTNeoXModel(cfg), tokens
    if name == "opt":
        cfg = tf.OPTConfig(vocab_size=1000, hidden_size=128, num_hidden_layers=2, ffn_dim=256, num_attention_heads=4,
                           max_position_embeddings=128, word_embed_proj_dim=128, use_cache=False)
        return tf.OPTModel(cfg), tokens
    if name == "falcon":
        cfg = tf.FalconConfig(vocab_size=1000, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                              new_decoder_architecture=False, multi_query=True, parallel_attn=True, use_cache=False)
        return tf.FalconModel(cfg), tokens
    if name == "bloom":
        return tf.BloomModel(tf.BloomConfig(vocab_size=1000, hidden_size=128, n_layer=2, n_head=4, use_cache=False)), tokens
    if name == "gptj":
        cfg = tf.GPTJConfig(vocab_size=1000, n_embd=128, n_layer=2, n_head=4, n_positions=128, rotary_dim=16, use_cache=False)
        return tf.GPTJModel(cfg), tokens
    if name == "phi":
        return tf.PhiModel(tf.PhiConfig(**{**lm, "num_key_value_heads": 4}, partial_rotary_factor=0.5)), tokens
    if name == "stablelm":
        return tf.StableLmModel(tf.StableLmConfig(**lm, partial_rotary_factor=0.25)), tokens
    if name == "starcoder2":
        return tf.Starcoder2Model(tf.Starcoder2Config(**lm, sliding_window=16)), tokens
    if name == "olmo":
        return tf.OlmoModel(tf.OlmoConfig(**lm)), tokens
    if name == "gemma2":
        return tf.Gemma2Model(tf.Gemma2Config(**lm, head_dim=32, sliding_window=16)), tokens
    if name == "mixtral":
        return tf.MixtralModel(tf.MixtralConfig(**lm, num_local_experts=4, num_experts_per_tok=2)), tokens
    if name == "qwen2_moe":
        cfg = tf.Qwen2MoeConfig(**lm, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                shared_expert_intermediate_size=128)
        return tf.Qwen2MoeModel(cfg), tokens
    if name == "mpt":
        return tf.MptModel(tf.MptConfig(vocab_size=1000, d_model=128, n_layers=2, n_heads=4, max_seq_len=128,
                                        use_cache=False)), tokens
    if name == "mamba":
        cfg = tf.MambaConfig(vocab_size=1000, hidden_size=64, state_size=8, num_hidden_layers=2, use_cache=False)
        return tf.MambaModel(cfg), tokens
    if name == "modernbert":
        cfg = tf.ModernBertConfig(vocab_size=1000, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=256, max_position_embeddings=128, local_attention=16,
                                  pad_token_id=0, eos_token_id=1, bos_token_id=2, cls_token_id=2, sep_token_id=1)
        return tf.ModernBertModel(cfg), tokens
    if name == "mobilebert":
        cfg = tf.MobileBertConfig(vocab_size=1000, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=128, embedding_size=64, intra_bottleneck_size=64,
                                  max_position_embeddings=128)
        return tf.MobileBertModel(cfg), tokens
    if name == "mpnet":
        return tf.MPNetModel(tf.MPNetConfig(**text)), tokens
    if name == "distilbert_sdpa":
        cfg = tf.DistilBertConfig(vocab_size=1000, dim=128, n_layers=2, n_heads=2, hidden_dim=256,
                                  max_position_embeddings=128)
        return tf.DistilBertModel(cfg), tokens
    if name == "t5_encoder_sdpa":
        cfg = tf.T5Config(vocab_size=1000, d_model=128, d_kv=64, d_ff=256, num_layers=2, num_heads=2, use_cache=False)
        return tf.T5EncoderModel(cfg), tokens
    if name == "bart_encoder":
        cfg = tf.BartConfig(vocab_size=1000, d_model=128, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                            decoder_attention_heads=2, encoder_ffn_dim=256, decoder_ffn_dim=256,
                            max_position_embeddings=128, use_cache=False)
        return tf.BartModel(cfg).get_encoder(), tokens
    raise KeyError(name)


def _hf_small(name: str):
    """A transformers model at a small config (random weights) and its example inputs."""
    import torch
    import transformers as tf

    seq = 32
    text = dict(vocab_size=1000, hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=256,
                max_position_embeddings=128)
    ids = torch.randint(0, 1000, (1, seq))
    mask = torch.ones(1, seq, dtype=torch.int64)
    mask[:, -4:] = 0
    img = torch.randn(1, 3, 64, 64)
    eager = {"attn_implementation": "eager"}
    if name in HF_SWEEP:
        return _hf_sweep(name, ids, mask)
    if name == "bert":
        return tf.BertModel(tf.BertConfig(**text, **eager)), {"input_ids": ids, "attention_mask": mask}
    if name == "distilbert":
        cfg = tf.DistilBertConfig(vocab_size=1000, dim=128, n_layers=2, n_heads=2, hidden_dim=256, max_position_embeddings=128, **eager)
        return tf.DistilBertModel(cfg), {"input_ids": ids, "attention_mask": mask}
    if name == "gpt2":
        cfg = tf.GPT2Config(vocab_size=1000, n_embd=128, n_layer=2, n_head=2, n_positions=128, use_cache=False, **eager)
        # with an attention mask: without one, transformers looks for packed sequences with torch.diff,
        # which the TorchScript exporter cannot export
        return tf.GPT2Model(cfg), {"input_ids": ids, "attention_mask": mask}
    if name == "t5_encoder":
        cfg = tf.T5Config(vocab_size=1000, d_model=128, d_kv=64, d_ff=256, num_layers=2, num_heads=2, use_cache=False, **eager)
        return tf.T5EncoderModel(cfg), {"input_ids": ids, "attention_mask": mask}
    vision = dict(image_size=64, patch_size=8, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                  intermediate_size=256)
    if name == "vit":
        return tf.ViTModel(tf.ViTConfig(**vision, **eager), add_pooling_layer=True), {"pixel_values": img}
    if name == "deit":
        return tf.DeiTModel(tf.DeiTConfig(**vision, **eager)), {"pixel_values": img}
    if name == "swin":
        cfg = tf.SwinConfig(image_size=64, patch_size=4, embed_dim=32, depths=[2, 2], num_heads=[2, 4], window_size=4, **eager)
        return tf.SwinModel(cfg), {"pixel_values": img}
    if name == "hf_resnet":
        cfg = tf.ResNetConfig(embedding_size=32, hidden_sizes=[32, 64, 128, 256], depths=[1, 1, 1, 1], layer_type="bottleneck")
        return tf.ResNetModel(cfg), {"pixel_values": torch.randn(1, 3, 96, 96)}
    if name == "hf_mobilenet_v2":
        return tf.MobileNetV2Model(tf.MobileNetV2Config(image_size=96, depth_multiplier=0.5)), {"pixel_values": torch.randn(1, 3, 96, 96)}
    if name == "hf_convnext":
        cfg = tf.ConvNextConfig(hidden_sizes=[32, 64, 128, 256], depths=[1, 1, 2, 1])
        return tf.ConvNextModel(cfg), {"pixel_values": torch.randn(1, 3, 96, 96)}
    raise KeyError(name)


def make_model(name: str):
    """(torch module in eval mode, fp32, on the CPU; ordered dict of example inputs)."""
    import torch

    torch.manual_seed(0)
    spec = spec_of(name)
    if spec.source == "transformers":
        model, inputs = _hf_small(spec.name)
    elif spec.source == "timm":
        import timm

        model = timm.create_model(spec.name, pretrained=False)
        size = model.default_cfg.get("input_size", (3, 224, 224))
        inputs = {"x": torch.randn(1, *size)}
    else:
        import torchvision.models as tvm

        kw: dict = {"weights": None}
        size = 224
        if name == "inception_v3":
            kw.update(aux_logits=False, init_weights=True)
            size = 299
        elif name == "googlenet":
            kw.update(aux_logits=False, init_weights=True)
        elif name.startswith("deeplabv3"):
            kw.update(weights_backbone=None, aux_loss=False)
            size = 256
        elif spec.family == "detection":  # (SSDlite's input is 320 by construction: it takes no sizes)
            kw.update(weights_backbone=None, **({} if name.startswith("ssd") else {"min_size": 320, "max_size": 320}))
            size = 320
        if spec.family == "detection":
            model = getattr(tvm.detection, name)(**kw)
        elif spec.family == "segmentation":
            model = getattr(tvm.segmentation, name)(**kw)
        else:
            model = getattr(tvm, spec.name)(**kw)
        inputs = {"x": torch.randn(1, 3, size, size)}
    if spec.source != "transformers":
        init_zero_linears(model)
        if spec.family == "detection":
            model.backbone.eval()
            calibrate_batchnorm(model.backbone, inputs["x"])
        else:
            calibrate_batchnorm(model, inputs["x"])
    elif "pixel_values" in inputs:  # transformers' vision models with BatchNorm (ResNet, MobileNetV2): as above;
        calibrate_batchnorm(model, inputs["pixel_values"])  # MobileNetV2's outputs were ~1e-23 without it
    return model.eval(), inputs


class _Outputs:
    """Flattens a model's output (tensor, tuple, dict, ModelOutput, list of dicts) to a tuple of tensors."""

    @staticmethod
    def flatten(out):
        import torch

        if isinstance(out, torch.Tensor):
            return (out,)
        if hasattr(out, "to_tuple"):
            out = out.to_tuple()
        if isinstance(out, dict):
            out = tuple(out.values())
        res = []
        for o in out:
            res.extend(_Outputs.flatten(o))
        return tuple(res)


def wrap(model, spec: Spec, names: list[str]):
    """The model as a module of positional tensors returning a tuple of tensors (inputs passed by name)."""
    import torch

    class Wrapped(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, *args):
            if spec.family == "detection":
                return _Outputs.flatten(self.m(list(args[0])))
            if spec.source == "transformers":
                return _Outputs.flatten(self.m(**dict(zip(names, args))))
            return _Outputs.flatten(self.m(*args))

    return Wrapped(model).eval()


def export(name: str, exporter: str, path: Path) -> dict:
    """Export ``name`` with ``exporter`` to ``path``; return the example feeds (numpy) and the output names."""
    if spec_of(name).source == "keras" or exporter == "tf2onnx":
        raise RuntimeError(f"{name} with {exporter}: Keras models are exported with tf2onnx by bench/keras_export.py "
                           "under a TensorFlow interpreter (--keep DIR), then taken from there (--keep DIR "
                           "--reuse-exports); PyTorch models with torchscript or dynamo")
    import torch

    model, inputs = make_model(name)
    w = wrap(model, spec_of(name), list(inputs))
    args = tuple(inputs.values())
    with torch.no_grad():
        n_out = len(w(*args))
    out_names = [f"output_{i}" for i in range(n_out)] if n_out > 1 else ["output"]
    with torch.no_grad():
        if exporter == "torchscript":
            with mha_fastpath_off():
                torch.onnx.export(w, args, str(path), input_names=list(inputs), output_names=out_names,
                                  opset_version=17, dynamo=False)
        else:
            torch.onnx.export(w, args, str(path), input_names=list(inputs), output_names=out_names, dynamo=True,
                              external_data=False)
    return {"feeds": {k: v.numpy() for k, v in inputs.items()}, "outputs": out_names}


@contextlib.contextmanager
def mha_fastpath_off():
    """nn.MultiheadAttention's inference fast path off for a TorchScript export, restored after: the fast path
    (torchvision ViT in eval) is one aten op (``_native_multi_head_attention``) the exporter has no symbolic for,
    and the plain path exports.  Restored so that torch.compile of the same model in the process runs it as its
    users do."""
    import torch

    mha = getattr(torch.backends, "mha", None)
    if mha is None:
        yield
        return
    was = mha.get_fastpath_enabled()
    mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        mha.set_fastpath_enabled(was)


# -- one row --------------------------------------------------------------------------------------------------

def _first_line(e: BaseException) -> str:
    import re

    s = re.sub(r"\x1b\[[0-9;]*m", "", str(e)).strip()  # exporters colour their messages
    return (s.splitlines()[0] if s else type(e).__name__)[:400]


def torch_converter_check(loaded_model, feeds: dict) -> dict:
    """The torch backend's converter on the loaded (folded, shape-inferred) model: the op types it has no
    converter for, and, when it converts, the eager CPU result against ONNX Runtime (max|out-ref|/max|ref|); for a
    model with depthwise convolutions, that result again with them lowered for Inductor (``depthwise_lowered``)."""
    from parastream.launcher.engines import onnx_torch

    ops = sorted({n.op_type for n in loaded_model.graph.node})
    missing = [op for op in ops if op not in onnx_torch.CONVERTERS]
    res: dict = {"ops": ops, "missing_ops": missing}
    try:
        module = onnx_torch.convert(loaded_model, "float32")
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.log_severity_level = 3
        sess = ort.InferenceSession(loaded_model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        ref = sess.run(None, {k: v for k, v in feeds.items() if k in module.input_names})
        res["torch_scaled_err"] = _module_error(module, feeds, ref)
        res["converts"] = True
        res["attention"] = attention_check(loaded_model, feeds, ref)
        lowered = onnx_torch.depthwise_convs(loaded_model)
        if lowered:  # and with its depthwise convolutions as Inductor's kernels write them (``--conv-kernels inductor``)
            res["depthwise_lowered"] = len(lowered)
            res["depthwise_lowered_scaled_err"] = _module_error(
                onnx_torch.convert(loaded_model, "float32", conv_kernels="inductor"), feeds, ref)
    except Exception as e:  # noqa: BLE001 - recorded in the table
        res["converts"] = False
        res["convert_error"] = _first_line(e)
    return res


def _module_error(module, feeds: dict, ref: list) -> float:
    """A converted module run on ``feeds`` (eager, CPU): its largest scaled error against ``ref`` (ONNX Runtime's
    outputs, in order)."""
    import torch

    from parastream.pipeline.verify import scaled_error

    with torch.no_grad():
        outs = module(*[torch.from_numpy(np.asarray(feeds[n])) for n in module.input_names])
    return max(scaled_error(o.float().numpy() if o.is_floating_point() else o.numpy(), r) for o, r in zip(outs, ref))


def attention_check(loaded_model, feeds: dict, ref: list) -> dict:
    """What a torch build's attention fusion (rule ``fuse_attention``) makes of the loaded model: its Softmax
    nodes, how many attentions fuse, the first reason one does not, and the fused model in the torch converter
    (each attention as ``scaled_dot_product_attention``) against ONNX Runtime on the original (``ref``)."""
    from parastream.launcher.engines import onnx_torch
    from parastream.rewrite.ir import export_model, import_graph
    from parastream.rewrite.rules.fuse_attention import FuseAttention

    rule, graph = FuseAttention(), import_graph(loaded_model)
    res: dict = {"softmax": sum(n.op_type == "Softmax" for n in loaded_model.graph.node), "fused": 0}
    while res["fused"] < res["softmax"]:
        sites = rule.sites(graph)
        safe = [site for site, reason in sites if reason is None]
        if not safe:
            res["not_fused"] = next((reason for _, reason in sites if reason), None)
            break
        graph = rule.apply(graph, safe[0])
        res["fused"] += 1
    if res["fused"]:
        res["fused_scaled_err"] = _module_error(
            onnx_torch.convert(export_model(graph, loaded_model), "float32", fuse_attention=True), feeds, ref)
    return res


def ort_self_difference(onnx_path: Path, feeds: dict) -> dict:
    """ONNX Runtime against itself on the original model: graph optimizations on vs off (max abs, and max abs
    over max |ref|): the fp32 noise that any rewrite or partition of the graph is judged against."""
    import onnxruntime as ort

    outs = []
    for level in (ort.GraphOptimizationLevel.ORT_ENABLE_ALL, ort.GraphOptimizationLevel.ORT_DISABLE_ALL):
        so = ort.SessionOptions()
        so.log_severity_level = 3
        so.graph_optimization_level = level
        sess = ort.InferenceSession(str(onnx_path), so, providers=["CPUExecutionProvider"])
        outs.append(sess.run(None, {i.name: feeds[i.name] for i in sess.get_inputs()}))
    res = {"max_abs": 0.0, "max_scaled": 0.0}
    for a, b in zip(*outs):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if a.size and a.dtype.kind == "f":
            d = float(np.max(np.abs(a - b)))
            res["max_abs"] = max(res["max_abs"], d)
            res["max_scaled"] = max(res["max_scaled"], d / max(float(np.max(np.abs(a))), 1e-30))
    return res


def build_with_cli(onnx_path: Path, out: Path, *extra: str) -> tuple[int, str, str]:
    """``parastream build ONNX -o OUT --backend onnxruntime --force --json [EXTRA]`` in this process, as a build
    step runs it: (its exit status, its stdout, its error line without the "parastream build: error: " prefix, or
    '')."""
    import contextlib
    import io

    from parastream.pipeline.cli import main as cli

    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = cli(["build", str(onnx_path), "-o", str(out), "--backend", "onnxruntime", "--force", "--json", *extra])
    if code > 128:  # interrupted: the corpus stops too
        raise KeyboardInterrupt(stderr.getvalue().strip())
    lines = [x for x in stderr.getvalue().splitlines() if x.startswith("parastream build: error: ")]
    return code, stdout.getvalue(), lines[-1].split(": error: ", 1)[1] if lines else ""


#: what a fresh process runs to time a bundle's load (``fresh_load``): the launcher's import and the load, with one
#: call, as an instance start does; it prints the seconds
_FRESH_LOAD = """
import sys, time
t0 = time.perf_counter()
from parastream.launcher import load
launcher = load(sys.argv[1])
print(round(time.perf_counter() - t0, 3))
"""


def fresh_load(bundle: Path) -> dict:
    """The bundle's size in MB (every file under it) and its load in a new Python process (``_FRESH_LOAD``:
    import and load, the interpreter's own start not counted), what an instance start pays on the CPU.  Not
    bench/load_breakdown.py's loader (corpus_gpu.py's): that one imports torch first and hooks Inductor's and the
    GPU launcher's stages, none of which a CPU bundle's load runs."""
    size = sum(f.stat().st_size for f in bundle.rglob("*") if f.is_file())
    got = subprocess.run([sys.executable, "-c", _FRESH_LOAD, str(bundle)], capture_output=True, text=True, timeout=600)
    load_s = float(got.stdout.split()[-1]) if got.returncode == 0 and got.stdout.split() else None
    return {"bundle_mb": round(size / 1e6, 1), "load_s": load_s,
            **({"load_error": _first_line(Exception(got.stderr.strip() or "no output"))} if load_s is None else {})}


def run_one(name: str, exporter: str, workdir: Path, keep: Path | None = None, reuse: bool = False,
            rebuild: bool = False) -> dict:
    """One row; with ``keep``, the export (.onnx) and its example inputs (.npz) are kept there (and with
    ``reuse``, an export kept there by an earlier run is taken instead of exporting again).  ``rebuild``: the
    build is given a ``--cache-dir`` and run again from it (the row's ``rebuild``: its seconds, per stage, and
    what it took from the record)."""
    spec = spec_of(name)
    row: dict = {"model": name, "exporter": exporter, "family": spec.family, "source": spec.source}
    onnx_path = (keep or workdir) / f"{name}__{exporter}.onnx"
    t0 = time.perf_counter()
    try:
        if reuse and onnx_path.exists() and onnx_path.with_suffix(".npz").exists():
            ex = {"feeds": dict(np.load(onnx_path.with_suffix(".npz")))}
            row["export_reused"] = True
        else:
            ex = export(name, exporter, onnx_path)
            np.savez(onnx_path.with_suffix(".npz"), **ex["feeds"])
        row["export_ok"] = True
    except Exception as e:  # noqa: BLE001
        row.update(export_ok=False, export_error=_first_line(e))
        return row
    finally:
        row["export_s"] = round(time.perf_counter() - t0, 2)

    from parastream.launcher.bundle import Bundle
    from parastream.launcher.errors import ParastreamError
    from parastream.pipeline.model_io import load_model

    t0 = time.perf_counter()
    out = workdir / f"{name}__{exporter}.bundle"
    try:
        # the command a user runs: its stdout (one JSON line) is kept for the tests to check against the bundle
        cache = ("--cache-dir", str(workdir / "cache")) if rebuild else ()
        code, stdout, error = build_with_cli(onnx_path, out, *cache)
        row.update(bundle=str(out), build_stdout=stdout)
        if code == 0:
            rep = Bundle.open(out).report
            v = rep.get("verification") or {}
            row.update(build_ok=True, exit=0, nodes_in=rep["model"]["nodes_in"], nodes_out=rep["model"]["nodes_out"],
                       streams=rep["schedule"]["streams"], branches=rep["schedule"]["branches"],
                       verification={"passed": v.get("passed"), "criterion": v.get("criterion"),
                                     "max_abs": max((o.get("max_abs", 0.0) for o in v.get("outputs", {}).values()), default=None),
                                     "max_scaled": max((o.get("max_scaled", 0.0) or 0.0 for o in v.get("outputs", {}).values()), default=None)},
                       rules=(rep.get("search") or {}).get("rules_chosen_count"),
                       # the build's peak resident memory (this process's: with a reused export nothing else ran in it yet)
                       peak_rss_mb=rep.get("peak_rss_mb"), cpu_choice=(rep.get("cpu_choice") or {}).get("chosen"))
            row.update(fresh_load(out))
        else:  # the CLI's one-line error and exit status (2: bad input, 1: verification failed)
            row.update(build_ok=False, exit=code, build_error=_first_line(Exception(error)), peak_rss_mb=_peak_rss_mb())
            if code == 1:  # verification: how far ONNX Runtime is from itself on this model
                row["ort_self_difference"] = ort_self_difference(onnx_path, ex["feeds"])
    except Exception as e:  # noqa: BLE001 - a crash is a bug of ours: the table says so
        row.update(build_ok=False, exit="crash", build_error=f"{type(e).__name__}: {_first_line(e)}",
                   traceback=traceback.format_exc()[-2000:])
    row["build_s"] = round(time.perf_counter() - t0, 2)
    if rebuild and row.get("build_ok"):
        again = build_with_cli(onnx_path, workdir / f"{name}__{exporter}.rebuild", *cache)
        summary = json.loads(again[1]) if again[0] == 0 else {}
        row["rebuild"] = {"exit": again[0], "error": again[2], "build_s": summary.get("build_s"),
                          "stage_seconds": summary.get("stage_seconds"),
                          "taken": {k: v for k, v in (summary.get("recorded_timings") or {}).items() if k != "file"}}

    try:
        loaded = load_model(onnx_path, host_tail=True)  # (a detector: its static part, as a build converts it)
        row["torch"] = torch_converter_check(loaded.model, ex["feeds"])
    except ParastreamError as e:
        row["torch"] = {"converts": False, "convert_error": f"load: {_first_line(e)}", "missing_ops": []}
    except Exception as e:  # noqa: BLE001
        row["torch"] = {"converts": False, "convert_error": f"{type(e).__name__}: {_first_line(e)}", "missing_ops": []}
    return row


# -- the table ------------------------------------------------------------------------------------------------

def _fmt(x, spec=".2g"):
    return "" if x is None else format(x, spec)


def _peak_rss_mb() -> float | None:
    """This process's peak resident memory so far (a failed build has no report to say it)."""
    from parastream.pipeline.build import _peak_rss_mb as peak

    return peak()


def _peak(r: dict) -> str:
    """The build's peak memory; '' for rows built before the corpus recorded it, '*' where the export ran in the
    same process first (its peak may be the exporter's)."""
    if r.get("peak_rss_mb") is None:
        return ""
    return f"{r['peak_rss_mb']:.0f}" + ("" if r.get("export_reused") else "*")


def _rebuild(r: dict) -> str:
    """The rebuild from ``--cache-dir`` (``--rebuild``): its seconds and what it took from the record; '' without."""
    rb = r.get("rebuild")
    if not rb:
        return ""
    if rb.get("exit") != 0:
        return f"exit {rb.get('exit')}"
    taken = ", ".join(f"{k}: {v}" for k, v in (rb.get("taken") or {}).items()) or "nothing taken"
    return f"{_fmt(rb.get('build_s'), '.1f')} ({taken})".replace("|", "/")


def summarize(rows: list[dict]) -> dict:
    total = len(rows)
    exported = [r for r in rows if r.get("export_ok")]
    ok = [r for r in exported if r.get("build_ok") and (r.get("verification") or {}).get("passed")]
    clean = [r for r in exported if not r.get("build_ok") and r.get("exit") == 2]
    return {"rows": total, "exported": len(exported), "built_and_verified": len(ok),
            "failed_with_one_line_error": len(clean),
            "other_failures": len(exported) - len(ok) - len(clean),
            "torch_converts": sum(1 for r in exported if (r.get("torch") or {}).get("converts")),
            "built_and_verified_fraction_of_exported": round(len(ok) / max(len(exported), 1), 3)}


def _status(r: dict | None) -> str:
    if r is None:
        return "not run"
    if not r.get("export_ok"):
        return "exporter failed"
    if r.get("build_ok") and (r.get("verification") or {}).get("passed"):
        t = r.get("torch") or {}
        return f"ok ({r.get('streams')} str.)" + ("" if t.get("converts") else "; torch converter: no")
    if r.get("exit") == 2:
        node = r.get("build_error", "").split("node '", 1)[-1].split("'", 1)[0] if "node '" in r.get("build_error", "") else ""
        return f"exit 2{' at ' + node if node else ''}"
    return f"exit {r.get('exit')}"


def _grid(rows: list[dict]) -> list[str]:
    """One line per model (in the rows' order: the corpus's, then the others), the outcome of each exporter that
    any row used."""
    by = {(r["model"], r["exporter"]): r for r in rows}
    exporters = [e for e in ALL_EXPORTERS if any(r["exporter"] == e for r in rows)]
    lines = ["| model | family | source | " + " | ".join(exporters) + " |", "|---|---|---|" + "---|" * len(exporters)]
    for name in dict.fromkeys(r["model"] for r in rows):
        try:
            spec = spec_of(name)
        except KeyError:  # a row of a name this corpus no longer knows
            spec = Spec(name, "?", "?")
        lines.append(f"| {name} | {spec.family} | {spec.source} | " + " | ".join(_status(by.get((name, e))) for e in exporters) + " |")
    return lines


def write_table(out: Path) -> dict:
    rows = [json.loads(p.read_text()) for p in sorted((out / "rows").glob("*.json"))]
    order = {n: i for i, n in enumerate(MODELS)}
    rows.sort(key=lambda r: (order.get(r["model"], 999), ALL_EXPORTERS.index(r["exporter"]) if r["exporter"] in ALL_EXPORTERS else 9))
    summary = summarize(rows)
    env = rows[0].get("env", {}) if rows else {}
    (out / "corpus.json").write_text(json.dumps({"summary": summary, "env": env, "rows": rows}, indent=1, default=str))
    lines = ["# parastream public-model corpus (CPU: --backend onnxruntime, rewrite search on)", "",
             f"Versions: {env}", "",
             f"{summary['built_and_verified']} of {summary['exported']} exports built and verified; "
             f"{summary['failed_with_one_line_error']} stopped with a one-line error (exit 2); "
             f"{summary['other_failures']} other; {summary['rows'] - summary['exported']} did not export. "
             f"The torch converter converts {summary['torch_converts']} of {summary['exported']}.", "",
             *_grid(rows), "",
             "| model | family | exporter | export | build (exit) | nodes in→out | streams | verification (max abs / max scaled) "
             "| torch converter (ops missing; max scaled err; attentions fused) | build s | rebuild s | peak MiB | bundle MB | fresh load s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if not r.get("export_ok"):
            err = _first_line(Exception(r.get("export_error", ""))).replace("|", "/")
            lines.append(f"| {r['model']} | {r['family']} | {r['exporter']} | failed: {err[:160]} | | | | | | | | | | |")
            continue
        if r.get("build_ok"):
            v = r.get("verification") or {}
            build = "ok" if v.get("passed") else "verification failed"
            ver = f"{'pass' if v.get('passed') else 'FAIL'} {_fmt(v.get('max_abs'))} / {_fmt(v.get('max_scaled'))}"
            nodes = f"{r['nodes_in']}→{r['nodes_out']}"
            streams = str(r.get("streams"))
        else:
            build = f"({r.get('exit')}) {r.get('build_error', '')[:200]}".replace("|", "/")
            if r.get("ort_self_difference"):
                d = r["ort_self_difference"]
                build += f" [ONNX Runtime vs itself, optimizations on/off: max abs {d['max_abs']:.2g}, {d['max_scaled']:.2g} of scale]"
            ver = nodes = streams = ""
        t = r.get("torch") or {}
        if t.get("converts"):
            tcell = f"all ops; {_fmt(t.get('torch_scaled_err'))}"
            a = t.get("attention") or {}
            if a.get("softmax"):  # how many attentions the torch build fuses, and the first reason one does not
                tcell += f"; attention {a['fused']}/{a['softmax']} fused"
                tcell += f" ({_fmt(a['fused_scaled_err'])})" if a.get("fused_scaled_err") is not None else ""
                tcell += f": {a['not_fused'][:80]}".replace("|", "/") if a.get("not_fused") else ""
        else:
            missing = ", ".join(t.get("missing_ops") or [])
            tcell = f"missing: {missing}; " if missing else ""
            tcell += (t.get("convert_error") or "")[:160].replace("|", "/")
        lines.append(f"| {r['model']} | {r['family']} | {r['exporter']} | ok | {build} | {nodes} | {streams} | {ver} | {tcell} "
                     f"| {_fmt(r.get('build_s'), '.1f')} | {_rebuild(r)} | {_peak(r)} | {_fmt(r.get('bundle_mb'), '.1f')} "
                     f"| {_fmt(r.get('load_s'), '.2f') or (r.get('load_error') or '')[:80].replace('|', '/')} |")
    (out / "corpus.md").write_text("\n".join(lines) + "\n")
    return summary


def _env() -> dict:
    import onnx
    import onnxruntime
    import torch

    env = {"torch": torch.__version__, "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__}
    for mod in ("torchvision", "timm", "transformers", "onnxscript"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001
            pass
    return env


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", help="comma-separated names (default: all; see --list)")
    ap.add_argument("--exporters", default=",".join(EXPORTERS))
    ap.add_argument("--ci", action="store_true", help="only the CI subset (transformers, small configs)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "corpus"))
    ap.add_argument("--timeout", type=float, default=1200.0, help="seconds per model and exporter")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--table-only", action="store_true", help="only remake the table from OUT/rows")
    ap.add_argument("--keep", help="keep the exports (.onnx + .npz inputs) in this folder")
    ap.add_argument("--reuse-exports", action="store_true", help="take the exports kept in --keep instead of exporting again")
    ap.add_argument("--rebuild", action="store_true", help="build each export again from the first build's --cache-dir")
    ap.add_argument("--recheck-torch", action="store_true", help="redo only the torch-converter column from --keep (rows that did not convert, or "
                         "without the attention figure)")
    ap.add_argument("--one", nargs=2, metavar=("MODEL", "EXPORTER"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    out = Path(args.out)
    if args.list:
        for s in MODELS.values():
            print(f"{s.name:32s} {s.family:13s} {s.source:13s} {'ci' if s.ci else ''}")
        return 0
    keep = Path(args.keep) if args.keep else None
    if keep:
        keep.mkdir(parents=True, exist_ok=True)
    if args.recheck_torch:
        # after a converter change: the torch-converter column again, for the rows that did not convert or have
        # no attention figure (rows from before that column), from the kept exports; and ONNX Runtime's own
        # difference for rows whose verification failed
        from parastream.pipeline.model_io import load_model

        for row_file in sorted((out / "rows").glob("*.json")):
            row = json.loads(row_file.read_text())
            onnx_path = keep / f"{row['model']}__{row['exporter']}.onnx" if keep else None
            if not row.get("export_ok") or onnx_path is None or not onnx_path.exists():
                continue
            feeds = dict(np.load(onnx_path.with_suffix(".npz")))
            if row.get("exit") == 1:
                row["ort_self_difference"] = ort_self_difference(onnx_path, feeds)
            torch_col = row.get("torch") or {}
            if (not torch_col.get("converts") or "attention" not in torch_col) and row.get("exit") != "crash":
                try:
                    row["torch"] = torch_converter_check(load_model(onnx_path, host_tail=True).model, feeds)
                except Exception as e:  # noqa: BLE001
                    row["torch"] = {"converts": False, "convert_error": f"load: {_first_line(e)}", "missing_ops": []}
            row_file.write_text(json.dumps(row, indent=1, default=str))
            print(row["model"], row["exporter"], (row.get("torch") or {}).get("converts"), row.get("ort_self_difference", ""), flush=True)
        print(json.dumps(write_table(out)))
        return 0
    if args.one:
        name, exporter = args.one
        with tempfile.TemporaryDirectory(prefix="parastream-corpus-") as tmp:
            row = run_one(name, exporter, Path(tmp), keep, reuse=args.reuse_exports, rebuild=args.rebuild)
        row["env"] = _env()
        (out / "rows").mkdir(parents=True, exist_ok=True)
        (out / "rows" / f"{name}__{exporter}.json").write_text(json.dumps(row, indent=1, default=str))
        return 0
    if not args.table_only:
        names = args.models.split(",") if args.models else [n for n, s in MODELS.items() if s.ci or not args.ci]
        unknown = []
        for n in names:
            try:
                spec_of(n)
            except KeyError:
                unknown.append(n)
        if unknown:
            ap.error(f"unknown models {unknown}; see --list, or name one outside the corpus as timm:NAME, "
                     "torchvision:NAME or keras:NAME")
        exporters = args.exporters.split(",")
        if set(exporters) - set(ALL_EXPORTERS):
            ap.error(f"--exporters {args.exporters}: each of {', '.join(ALL_EXPORTERS)}")
        (out / "rows").mkdir(parents=True, exist_ok=True)
        for name in names:
            for exporter in exporters:
                t0 = time.perf_counter()
                cmd = [sys.executable, __file__, "--one", name, exporter, "--out", str(out)] + (["--keep", str(keep)] if keep else [])
                cmd += ["--reuse-exports"] if args.reuse_exports else []
                cmd += ["--rebuild"] if args.rebuild else []
                try:
                    p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
                    status = "ok" if p.returncode == 0 else f"process exit {p.returncode}: {p.stderr.strip().splitlines()[-1:] }"
                except subprocess.TimeoutExpired:
                    status = f"timed out after {args.timeout:.0f} s"
                row_file = out / "rows" / f"{name}__{exporter}.json"
                if status != "ok" or not row_file.exists():
                    spec = spec_of(name)
                    row_file.write_text(json.dumps({"model": name, "exporter": exporter, "family": spec.family,
                                                    "source": spec.source, "export_ok": False,
                                                    "export_error": f"corpus runner: {status}"}))
                r = json.loads(row_file.read_text())
                print(f"{name:30s} {exporter:11s} {time.perf_counter() - t0:6.1f}s export={r.get('export_ok')} "
                      f"build={r.get('build_ok')} {r.get('build_error') or r.get('export_error') or ''}"[:300], flush=True)
    summary = write_table(out)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
