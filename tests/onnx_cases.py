"""Small ONNX graphs that exercise the ops torchvision and BERT exports use (for the torch-backend tests)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def _init(rng, name, shape, scale=0.2, dtype=np.float32):
    return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(dtype), name)


def _i64(name, vals):
    return numpy_helper.from_array(np.array(vals, dtype=np.int64), name)


def _model(nodes, name, inputs, outputs, inits, opset=17):
    g = helper.make_graph(nodes, name, inputs, outputs, inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    return onnx.shape_inference.infer_shapes(m, strict_mode=True, data_prop=True)


def inception_block(seed=0, c=8, size=9):
    """Conv/BN/Relu, asymmetric-padded pools, ceil_mode, 1x1 -> 3x3 -> 3x3, Concat, GAP, Flatten, Gemm."""
    rng = np.random.default_rng(seed)
    inits = [
        _init(rng, "w1", (c, c, 1, 1)), _init(rng, "b1", (c,)),
        _init(rng, "w2a", (c, c, 1, 1)), _init(rng, "w2b", (c, c, 3, 3)),
        _init(rng, "w3a", (c, c, 1, 1)), _init(rng, "w3b", (c, c, 3, 3)), _init(rng, "w3c", (c, c, 3, 1)),
        _init(rng, "w4", (c, c, 1, 1)),
        numpy_helper.from_array(np.abs(rng.standard_normal(c)).astype(np.float32) + 0.5, "bn_s"),
        _init(rng, "bn_b", (c,)), _init(rng, "bn_m", (c,)),
        numpy_helper.from_array(np.abs(rng.standard_normal(c)).astype(np.float32) + 0.5, "bn_v"),
        _init(rng, "fc_w", (10, 4 * c)), _init(rng, "fc_b", (10,)),
    ]
    N = helper.make_node
    nodes = [
        N("Conv", ["x", "w1", "b1"], ["a1"], name="conv1"),
        N("Relu", ["a1"], ["r1"], name="relu1"),
        N("Conv", ["x", "w2a"], ["a2"], name="conv2a"),
        N("BatchNormalization", ["a2", "bn_s", "bn_b", "bn_m", "bn_v"], ["n2"], name="bn2", epsilon=1e-3),
        N("Relu", ["n2"], ["r2a"], name="relu2a"),
        N("Conv", ["r2a", "w2b"], ["r2"], name="conv2b", pads=[1, 1, 1, 1]),
        N("Conv", ["x", "w3a"], ["a3"], name="conv3a"),
        N("Conv", ["a3", "w3b"], ["b3"], name="conv3b", pads=[0, 1, 2, 1]),  # asymmetric
        N("Conv", ["b3", "w3c"], ["r3"], name="conv3c", pads=[1, 0, 1, 0], strides=[1, 1]),
        N("MaxPool", ["x"], ["p4"], name="pool4", kernel_shape=[3, 3], strides=[1, 1], pads=[1, 1, 1, 1]),
        N("Conv", ["p4", "w4"], ["r4"], name="conv4"),
        N("Concat", ["r1", "r2", "r3", "r4"], ["cat"], name="concat", axis=1),
        N("AveragePool", ["cat"], ["ap"], name="avgpool", kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], ceil_mode=1),
        N("MaxPool", ["ap"], ["mp"], name="maxpool_ceil", kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1),
        N("GlobalAveragePool", ["mp"], ["gap"], name="gap"),
        N("Flatten", ["gap"], ["flat"], name="flatten", axis=1),
        N("Gemm", ["flat", "fc_w", "fc_b"], ["y"], name="fc", transB=1),
        N("Sigmoid", ["cat"], ["y2"], name="sig"),
    ]
    return _model(nodes, "inception_block",
                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c, size, size])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
                   helper.make_tensor_value_info("y2", TensorProto.FLOAT, None)], inits)


def attention_layer(seed=0, seq=8, hidden=16, heads=2):
    """A BERT-style layer as torch.onnx exports it: Shape/Gather/Unsqueeze/Concat shape arithmetic, Reshape,
    Transpose, MatMul, Div, Where mask, Softmax, Erf GELU, LayerNormalization, Gather embedding, Cast, Slice, Expand."""
    rng = np.random.default_rng(seed)
    d = hidden // heads
    inits = [
        _init(rng, "emb", (50, hidden), 1.0),
        _init(rng, "wq", (hidden, hidden)), _init(rng, "wk", (hidden, hidden)), _init(rng, "wv", (hidden, hidden)),
        _init(rng, "bq", (hidden,)), _init(rng, "wo", (hidden, hidden)), _init(rng, "w1", (hidden, 4 * hidden)),
        _init(rng, "w2", (4 * hidden, hidden)),
        numpy_helper.from_array(np.ones(hidden, np.float32), "ln_s"), _init(rng, "ln_b", (hidden,)),
        numpy_helper.from_array(np.array(np.sqrt(d), np.float32), "scale"),
        numpy_helper.from_array(np.array(0.5, np.float32), "half"),
        numpy_helper.from_array(np.array(1.0, np.float32), "one"),
        numpy_helper.from_array(np.array(np.sqrt(2.0), np.float32), "sqrt2"),
        numpy_helper.from_array(np.array(-10000.0, np.float32), "neg"),
        _i64("zero1", [0]), _i64("one1", [1]), _i64("heads", [heads]), _i64("dh", [d]), _i64("idx0", 0), _i64("idx1", 1),
        _i64("axes0", [0]), _i64("sl_s", [0]), _i64("sl_e", [seq]), _i64("sl_ax", [1]), _i64("exp_shape", [1, 1, seq, seq]),
        _i64("ax2", [2]), _i64("mean_ax", [-1]),
    ]
    N = helper.make_node
    nodes = [
        N("Gather", ["emb", "ids"], ["h0"], name="embed", axis=0),
        N("Shape", ["h0"], ["shp"], name="shape"),
        N("Gather", ["shp", "idx0"], ["bsz"], name="g_b", axis=0),
        N("Gather", ["shp", "idx1"], ["sq"], name="g_s", axis=0),
        N("Unsqueeze", ["bsz", "axes0"], ["bsz1"], name="u_b"),
        N("Unsqueeze", ["sq", "axes0"], ["sq1"], name="u_s"),
        N("Concat", ["bsz1", "sq1", "heads", "dh"], ["split_shape"], name="cat_shape", axis=0),
        N("MatMul", ["h0", "wq"], ["q0"], name="mm_q"), N("Add", ["q0", "bq"], ["q1"], name="add_q"),
        N("MatMul", ["h0", "wk"], ["k0"], name="mm_k"), N("MatMul", ["h0", "wv"], ["v0"], name="mm_v"),
        N("Reshape", ["q1", "split_shape"], ["q2"], name="rs_q"), N("Transpose", ["q2"], ["q"], name="tr_q", perm=[0, 2, 1, 3]),
        N("Reshape", ["k0", "split_shape"], ["k2"], name="rs_k"), N("Transpose", ["k2"], ["kt"], name="tr_k", perm=[0, 2, 3, 1]),
        N("Reshape", ["v0", "split_shape"], ["v2"], name="rs_v"), N("Transpose", ["v2"], ["v"], name="tr_v", perm=[0, 2, 1, 3]),
        N("MatMul", ["q", "kt"], ["s0"], name="mm_s"), N("Div", ["s0", "scale"], ["s1"], name="div_s"),
        # mask: [B, S] int64 -> bool [B,1,1,S] -> Where
        N("Cast", ["mask"], ["maskb"], name="cast_mask", to=TensorProto.BOOL),
        N("Unsqueeze", ["maskb", "one1"], ["m1"], name="u_m1"), N("Unsqueeze", ["m1", "ax2"], ["m2"], name="u_m2"),
        N("Slice", ["m2", "sl_s", "sl_e", "sl_ax"], ["m3"], name="slice_m"),
        N("Expand", ["m3", "exp_shape"], ["m4"], name="expand_m"),
        N("Where", ["m4", "s1", "neg"], ["s2"], name="where"),
        N("Softmax", ["s2"], ["p"], name="softmax", axis=-1),
        N("MatMul", ["p", "v"], ["c0"], name="mm_c"), N("Transpose", ["c0"], ["c1"], name="tr_c", perm=[0, 2, 1, 3]),
        N("Reshape", ["c1", "back_shape"], ["c2"], name="rs_c"),
        N("MatMul", ["c2", "wo"], ["o0"], name="mm_o"), N("Add", ["o0", "h0"], ["res"], name="residual"),
        N("LayerNormalization", ["res", "ln_s", "ln_b"], ["ln"], name="ln", axis=-1, epsilon=1e-12),
        N("MatMul", ["ln", "w1"], ["f0"], name="mm_f1"),
        N("Div", ["f0", "sqrt2"], ["g0"], name="gelu_div"), N("Erf", ["g0"], ["g1"], name="gelu_erf"),
        N("Add", ["g1", "one"], ["g2"], name="gelu_add"), N("Mul", ["f0", "g2"], ["g3"], name="gelu_mul"),
        N("Mul", ["g3", "half"], ["g4"], name="gelu_half"),
        N("MatMul", ["g4", "w2"], ["f2"], name="mm_f2"),
        N("ReduceMean", ["f2", "mean_ax"], ["mu"], name="rmean", keepdims=1),
        N("Sub", ["f2", "mu"], ["dlt"], name="sub_mu"), N("Pow", ["dlt", "two"], ["sq2"], name="pow2"),
        N("ReduceMean", ["sq2", "mean_ax"], ["var"], name="rvar", keepdims=1),
        N("Add", ["var", "eps"], ["ve"], name="add_eps"), N("Sqrt", ["ve"], ["sd"], name="sqrt"),
        N("Div", ["dlt", "sd"], ["y"], name="norm"),
    ]
    inits += [_i64("back_shape", [1, seq, hidden]), numpy_helper.from_array(np.array(2.0, np.float32), "two"),
              numpy_helper.from_array(np.array(1e-5, np.float32), "eps")]
    return _model(nodes, "attention_layer",
                  [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, seq]),
                   helper.make_tensor_value_info("mask", TensorProto.INT64, [1, seq])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits, opset=18)


def misc_ops(seed=0):
    """Split, Pad (reflect and constant), Clip, LeakyRelu, ReduceSum, Squeeze, Tile, Slice with a negative step, Max."""
    rng = np.random.default_rng(seed)
    N = helper.make_node
    inits = [_i64("split", [2, 2]), _i64("pads", [0, 0, 1, 2, 0, 0, 1, 2]), _i64("pads_c", [0, 0, 1, 2, 0, 0, 1, 2]),
             numpy_helper.from_array(np.array(-0.5, np.float32), "lo"), numpy_helper.from_array(np.array(0.5, np.float32), "hi"),
             _i64("rs_ax", [1]), _i64("sq_ax", [1]), _i64("reps", [1, 2, 1]), _i64("s_st", [-1]), _i64("s_en", [-100]),
             _i64("s_ax", [2]), _i64("s_step", [-2]), _init(rng, "w", (5, 7))]
    nodes = [
        N("Split", ["x", "split"], ["a", "b"], name="split", axis=1),
        N("Pad", ["a", "pads"], ["pa"], name="pad_reflect", mode="reflect"),
        N("Pad", ["b", "pads_c"], ["pb"], name="pad_const", mode="constant"),
        N("Clip", ["pa", "lo", "hi"], ["ca"], name="clip"),
        N("LeakyRelu", ["pb"], ["lb"], name="leaky", alpha=0.1),
        N("Max", ["ca", "lb"], ["mx"], name="max"),
        N("ReduceSum", ["mx", "rs_ax"], ["rs"], name="rsum", keepdims=1),
        N("Squeeze", ["rs", "sq_ax"], ["sq"], name="squeeze"),
        N("Tile", ["sq", "reps"], ["t"], name="tile"),
        N("Slice", ["t", "s_st", "s_en", "s_ax", "s_step"], ["sl"], name="slice_neg"),
        N("MatMul", ["sl", "w"], ["y"], name="mm"),
    ]
    return _model(nodes, "misc_ops", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 3, 5])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)


def sequence_ops(seed=0):
    """Resize (cubic, downscaling), a bidirectional LSTM over the pixels, a GRU (linear_before_reset, as torch
    exports nn.GRU) and Col2Im folding its states back into an image (opset 18): the recurrent and resampling ops
    of the timm exports that needed them (Sequencer, CrossViT, VOLO)."""
    rng = np.random.default_rng(seed)
    N = helper.make_node
    inits = [_i64("sizes", [1, 4, 4, 4]), _i64("to_seq", [1, 4, 16]), _i64("to_gru", [16, 1, 10]),
             _i64("to_cols", [1, 8, 16]), _i64("image", [5, 5]), _i64("block", [2, 2]),
             _init(rng, "lw", (2, 20, 4), 0.5), _init(rng, "lr", (2, 20, 5), 0.5), _init(rng, "lb", (2, 40), 0.5),
             _init(rng, "gw", (1, 24, 10), 0.5), _init(rng, "gr", (1, 24, 8), 0.5), _init(rng, "gb", (1, 48), 0.5)]
    nodes = [
        N("Resize", ["x", "", "", "sizes"], ["r"], name="resize_cubic", mode="cubic"),
        N("Reshape", ["r", "to_seq"], ["rs"], name="to_seq"),
        N("Transpose", ["rs"], ["seq"], name="seq_first", perm=[2, 0, 1]),
        N("LSTM", ["seq", "lw", "lr", "lb"], ["ly"], name="lstm", hidden_size=5, direction="bidirectional"),
        N("Transpose", ["ly"], ["lt"], name="dirs_last", perm=[0, 2, 1, 3]),
        N("Reshape", ["lt", "to_gru"], ["gin"], name="to_gru"),
        N("GRU", ["gin", "gw", "gr", "gb"], ["gy", "gh"], name="gru", hidden_size=8, linear_before_reset=1),
        N("Transpose", ["gy"], ["gt"], name="states_first", perm=[1, 2, 3, 0]),
        N("Reshape", ["gt", "to_cols"], ["cols"], name="to_cols"),
        N("Col2Im", ["cols", "image", "block"], ["y"], name="col2im"),
    ]
    return _model(nodes, "sequence_ops", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 6, 6])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
                   helper.make_tensor_value_info("gh", TensorProto.FLOAT, None)], inits, opset=18)


def feeds_for(model: onnx.ModelProto, seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {}
    for vi in model.graph.input:
        tt = vi.type.tensor_type
        shape = [d.dim_value for d in tt.shape.dim]
        if tt.elem_type == TensorProto.INT64:
            if vi.name == "mask":
                m = np.ones(shape, np.int64)
                m[..., -2:] = 0
                feeds[vi.name] = m
            else:
                feeds[vi.name] = rng.integers(0, 50, shape).astype(np.int64)
        else:
            feeds[vi.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds
