"""Small models with dynamic axes for the dynamic-shapes tests: a 1-layer BERT (random weights, exported from a
transformers config with dynamic batch and sequence on its three inputs), an attention without a mask (padding
changes every position) and a CNN with a dynamic image side."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

VOCAB = 64


def tiny_bert(path: Path, layers: int = 1) -> Path:
    """BertModel, ``layers`` layers (default 1), hidden 32, 2 heads: ``input_ids``, ``attention_mask``,
    ``token_type_ids`` [batch, seq] -> ``hidden`` [batch, seq, 32]."""
    import torch
    import transformers as tf

    cfg = tf.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=layers, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=128, attn_implementation="eager")
    torch.manual_seed(0)
    model = tf.BertModel(cfg, add_pooling_layer=False).eval()

    class Hidden(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, input_ids, attention_mask, token_type_ids):
            return self.m(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids).last_hidden_state

    ids = torch.randint(0, VOCAB, (1, 16))
    mask, types = torch.ones(1, 16, dtype=torch.int64), torch.zeros(1, 16, dtype=torch.int64)
    axes = {0: "batch", 1: "seq"}
    with torch.no_grad():
        torch.onnx.export(Hidden(), (ids, mask, types), str(path), input_names=["input_ids", "attention_mask", "token_type_ids"],
                          output_names=["hidden"], dynamic_axes={"input_ids": axes, "attention_mask": axes,
                                                                 "token_type_ids": axes, "hidden": axes},
                          opset_version=17, dynamo=False)
    return path


def tiny_gpt2(path: Path, *, mask: bool = True) -> Path:
    """GPT2Model, 1 layer, hidden 32, no KV cache, [batch, seq] inputs -> ``hidden`` [batch, seq, 32]: with
    ``mask``, ``input_ids``, ``attention_mask`` and ``position_ids``; without, ``input_ids`` alone (positions
    counted inside, every position unmasked).  Causal: padding at the end changes no real position, mask or not."""
    import torch
    import transformers as tf

    cfg = tf.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2, n_positions=128, attn_implementation="eager")
    torch.manual_seed(0)
    model = tf.GPT2Model(cfg).eval()

    class Hidden(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, input_ids, attention_mask=None, position_ids=None):
            if attention_mask is None:  # no mask input: every position real (the causal mask alone hides the future)
                attention_mask = torch.ones_like(input_ids)
            return self.m(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=False).last_hidden_state

    ids = torch.randint(0, VOCAB, (1, 16))
    names = ["input_ids", "attention_mask", "position_ids"] if mask else ["input_ids"]
    args = (ids, torch.ones(1, 16, dtype=torch.int64), torch.arange(16)[None]) if mask else (ids,)
    axes = {0: "batch", 1: "seq"}
    with torch.no_grad():
        torch.onnx.export(Hidden(), args, str(path), input_names=names, output_names=["hidden"],
                          dynamic_axes={**{n: axes for n in names}, "hidden": axes}, opset_version=17, dynamo=False)
    return path


def bert_feeds(n: int, seq: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"input_ids": rng.integers(0, VOCAB, (n, seq)).astype(np.int64),
            "attention_mask": np.ones((n, seq), np.int64),
            "token_type_ids": rng.integers(0, 2, (n, seq)).astype(np.int64)}


def _save(graph, path: Path) -> Path:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def unmasked_attention(path: Path) -> Path:
    """x [1, seq, 8] -> softmax(x x^T) x: every position attends to every other, and no mask says which are real."""
    nodes = [helper.make_node("Transpose", ["x"], ["xt"], perm=[0, 2, 1], name="t"),
             helper.make_node("MatMul", ["x", "xt"], ["scores"], name="qk"),
             helper.make_node("Softmax", ["scores"], ["p"], axis=-1, name="softmax"),
             helper.make_node("MatMul", ["p", "x"], ["y"], name="pv")]
    g = helper.make_graph(nodes, "attn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "seq", 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "seq", 8])])
    return _save(g, path)


def small_cnn(path: Path) -> Path:
    """image [N, 3, H, W] -> Conv 3x3 -> Relu -> GlobalAveragePool -> logits [N, 5]: the mean over the image
    takes in any padded pixels."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w")
    fc = numpy_helper.from_array(rng.standard_normal((4, 5)).astype(np.float32), "fc")
    nodes = [helper.make_node("Conv", ["image", "w"], ["c"], pads=[1, 1, 1, 1], name="conv"),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("GlobalAveragePool", ["r"], ["p"], name="gap"),
             helper.make_node("Flatten", ["p"], ["f"], name="flat"),
             helper.make_node("MatMul", ["f", "fc"], ["logits"], name="fc")]
    g = helper.make_graph(nodes, "cnn", [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["N", 3, "H", "W"])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 5])], [w, fc])
    return _save(g, path)


def small_detector(path: Path, *, max_det_input: bool = False, batch: int | str = 1, empty_coeffs: bool = False) -> Path:
    """A detector in miniature: a CNN whose ``logits`` [B, 10] are static, and a post-processing tail as detection
    exports write it: scores above 0.5 (``NonZero``), their boxes (``GatherND``), the best ``min(count, 5)`` of
    them (``TopK``, its k computed from the data) and the boxes divided by the image's width (a tensor the static
    part folds to a constant, from the input's shape): ``scores`` [K], ``boxes`` [K, 4], K from the data.
    ``max_det_input``: k is ``min(count, max_det)``, ``max_det`` an int64 input [1] only the tail reads.
    ``batch``: the input's first dimension (a name makes it dynamic).  ``empty_coeffs``: each box carries its
    mask coefficients, none here (a [256, 0] slice the tail gathers and concatenates to the boxes, as YOLOv8's
    export with NMS does for a detection model): a boundary tensor with no data."""
    rng = np.random.default_rng(0)

    def init(name, shape, scale=0.3):
        return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)

    inits = [init("w1", (8, 3, 3, 3)), init("w2", (1, 8, 1, 1)), init("w3", (4, 8, 1, 1)), init("g", (10, 8)),
             numpy_helper.from_array(np.array(0.5, np.float32), "thr"),
             numpy_helper.from_array(np.array([-1], np.int64), "flat"),
             numpy_helper.from_array(np.array([-1, 4], np.int64), "by4"),
             numpy_helper.from_array(np.array([3], np.int64), "at3"),
             numpy_helper.from_array(np.array([4], np.int64), "at4"), numpy_helper.from_array(np.array([1], np.int64), "axis1")]
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("GlobalAveragePool", ["r1"], ["gap"]),
        helper.make_node("Flatten", ["gap"], ["pooled"]),
        helper.make_node("Gemm", ["pooled", "g"], ["logits"], transB=1),
        helper.make_node("Conv", ["r1", "w2"], ["c2"]),
        helper.make_node("Sigmoid", ["c2"], ["sig"]),
        helper.make_node("Reshape", ["sig", "flat"], ["all_scores"]),
        helper.make_node("Conv", ["r1", "w3"], ["c3"]),
        helper.make_node("Transpose", ["c3"], ["c3t"], perm=[0, 2, 3, 1]),
        helper.make_node("Reshape", ["c3t", "by4"], ["all_boxes"]),
        helper.make_node("Shape", ["x"], ["xshape"]),
        helper.make_node("Gather", ["xshape", "at3"], ["width_i"]),
        helper.make_node("Cast", ["width_i"], ["width"], to=TensorProto.FLOAT),
        helper.make_node("Greater", ["all_scores", "thr"], ["mask"]),
        helper.make_node("NonZero", ["mask"], ["nz"]),
        helper.make_node("Transpose", ["nz"], ["idx"], perm=[1, 0]),
        helper.make_node("GatherND", ["all_scores", "idx"], ["kept"]),
        *([helper.make_node("Slice", ["all_boxes", "at4", "at4", "axis1"], ["coeffs"]),
           helper.make_node("GatherND", ["all_boxes", "idx"], ["boxes_only"]),
           helper.make_node("GatherND", ["coeffs", "idx"], ["kept_coeffs"]),
           helper.make_node("Concat", ["boxes_only", "kept_coeffs"], ["kept_boxes"], axis=1)] if empty_coeffs else
          [helper.make_node("GatherND", ["all_boxes", "idx"], ["kept_boxes"])]),
        helper.make_node("Shape", ["kept"], ["count"]),
        helper.make_node("Min", ["count", "max_det" if max_det_input else "five"], ["k"]),
        helper.make_node("TopK", ["kept", "k"], ["scores", "best"]),
        helper.make_node("Gather", ["kept_boxes", "best"], ["best_boxes"], axis=0),
        helper.make_node("Div", ["best_boxes", "width"], ["boxes"]),
    ]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 3, 16, 16])]
    if max_det_input:
        inputs.append(helper.make_tensor_value_info("max_det", TensorProto.INT64, [1]))
    else:
        inits.append(numpy_helper.from_array(np.array([5], np.int64), "five"))
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, 10]),
               helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["k"]),
               helper.make_tensor_value_info("boxes", TensorProto.FLOAT, ["k", 4])]
    return _save(helper.make_graph(nodes, "small_detector", inputs, outputs, inits), path)
