"""Convolutions over non-overlapping patches of an image's few channels as one matrix product
(``onnx_torch._conv_as_patch_gemm``, the converter's ``patch_gemm``, on for CUDA engines).

The patch embeddings it is for (ViT's 16x16 at stride 16, ConvNeXt's and Swin's 4x4 at stride 4, an input whose
size is not a multiple of the patch) against ONNX Runtime, eager and compiled by Inductor on the CPU, and the
convolutions it must leave to torch's convolution: more channels, overlapping windows, padding, dilation,
groups, 1-d; and off (the CPU engines) it changes nothing.  Which one a convolution became is read from the
converted module's steps.  On the GPU (marked) the patch embedding is compiled and compared in fp16.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

torch = pytest.importorskip("torch")

from test_conv_kernels import _ort, _w  # noqa: E402 - the same weights and reference as the other convolutions

from parastream.launcher.engines.onnx_torch import PATCH_GEMM_MAX_CHANNELS, convert, to_fx  # noqa: E402


def patch_model(seed: int = 0) -> tuple[onnx.ModelProto, dict[str, bool]]:
    """Convolutions of an image-sized input, and for each whether it must run as a matrix product."""
    rng = np.random.default_rng(seed)
    N = helper.make_node
    wide = PATCH_GEMM_MAX_CHANNELS + 1
    inits = [_w(rng, "vit", (24, 3, 16, 16)), _w(rng, "b24", (24,)), _w(rng, "stem", (16, 3, 4, 4)),
             _w(rng, "rgba", (16, 4, 4, 4)), _w(rng, "b16", (16,)), _w(rng, "wide", (16, wide, 4, 4)),
             _w(rng, "overlap", (16, 3, 3, 3)), _w(rng, "group", (6, 1, 4, 4)), _w(rng, "rect", (8, 3, 2, 4)),
             _w(rng, "w1d", (8, 3, 4))]
    nodes = [
        N("Conv", ["x", "vit", "b24"], ["vit_o"], name="vit_16x16", kernel_shape=[16, 16], strides=[16, 16]),
        N("Conv", ["x", "stem"], ["stem_o"], name="stem_4x4_nobias", strides=[4, 4]),
        N("Conv", ["x_odd", "stem", "b16"], ["odd_o"], name="stem_4x4_remainder", strides=[4, 4]),
        N("Conv", ["x4", "rgba", "b16"], ["rgba_o"], name="rgba_4x4", strides=[4, 4]),
        N("Conv", ["x", "rect"], ["rect_o"], name="rect_2x4", strides=[2, 4], auto_pad="VALID"),
        # must stay torch's convolution
        N("Conv", ["xw", "wide", "b16"], ["wide_o"], name="too_many_channels", strides=[4, 4]),
        N("Conv", ["x", "overlap"], ["overlap_o"], name="overlapping_3x3_s2", strides=[2, 2]),
        N("Conv", ["x", "stem"], ["padded_o"], name="padded", strides=[4, 4], pads=[1, 1, 1, 1]),
        N("Conv", ["x", "stem"], ["dil_o"], name="dilated", strides=[4, 4], dilations=[2, 2]),
        N("Conv", ["x", "group"], ["group_o"], name="grouped", strides=[4, 4], group=3),
        N("Conv", ["x1d", "w1d"], ["c1d_o"], name="patches_1d", strides=[4]),
    ]
    fires = {"vit_16x16": True, "stem_4x4_nobias": True, "stem_4x4_remainder": True, "rgba_4x4": True,
             "rect_2x4": True, "too_many_channels": False, "overlapping_3x3_s2": False, "padded": False,
             "dilated": False, "grouped": False, "patches_1d": False}
    inputs = {"x": [2, 3, 64, 48], "x_odd": [1, 3, 30, 27], "x4": [1, 4, 32, 32], "xw": [1, wide, 32, 32],
              "x1d": [2, 3, 22]}
    graph = helper.make_graph(nodes, "patch_gemm",
                              [helper.make_tensor_value_info(k, TensorProto.FLOAT, v) for k, v in inputs.items()],
                              [helper.make_tensor_value_info(n.output[0], TensorProto.FLOAT, None) for n in nodes], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return onnx.shape_inference.infer_shapes(model), fires


def _feeds(model, seed: int = 1):
    rng = np.random.default_rng(seed)
    return {i.name: rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim]).astype(np.float32)
            for i in model.graph.input}


def _run(module, model, feeds, device="cpu", dtype=None, channels_last=False):
    """The module's outputs on ``feeds``, given as a launcher gives an engine its inputs: on ``device``, in the
    engine's compute ``dtype`` (its caller casts them), 4-d ones channels-last where asked."""
    ins = [torch.from_numpy(feeds[i.name]).to(device, dtype) for i in model.graph.input]
    if channels_last:
        ins = [t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 else t for t in ins]
    with torch.no_grad():
        outs = module(*ins)
    return {o.name: t.float().cpu().numpy() for o, t in zip(model.graph.output, outs)}


def _fired(module) -> dict[str, bool]:
    return {st.node: bool(getattr(st.fn, "patch_gemm", False)) for st in module._steps}


def test_patch_embeddings_run_as_one_product_and_match_onnxruntime():
    model, fires = patch_model()
    module = convert(model, patch_gemm=True)
    assert _fired(module) == fires
    assert module.patch_gemm_convs == sum(fires.values())
    feeds = _feeds(model)
    want, got = _ort(model, feeds), _run(module, model, feeds)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-4, err_msg=name)


def test_off_every_convolution_stays_torchs_and_the_results_are_the_same():
    model, _ = patch_model()
    module = convert(model)  # the CPU engines' default
    assert not any(_fired(module).values()) and module.patch_gemm_convs == 0
    feeds = _feeds(model)
    on, off = _run(convert(model, patch_gemm=True), model, feeds), _run(module, model, feeds)
    for name in off:
        np.testing.assert_allclose(on[name], off[name], rtol=1e-4, atol=1e-4, err_msg=name)


def test_the_product_compiles_with_inductor_and_matches_onnxruntime():
    model, _ = patch_model()
    compiled = torch.compile(to_fx(convert(model, patch_gemm=True)))
    feeds = _feeds(model, seed=2)
    want, got = _ort(model, feeds), _run(compiled, model, feeds)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-4, err_msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("channels_last", [False, True])
def test_the_patch_embedding_in_fp16_on_the_gpu_matches_onnxruntime(channels_last):
    """Compiled by Inductor in fp16 on the GPU, fed contiguous or channels-last inputs (an engine's boundary in
    either layout), against ONNX Runtime on the fp32 model."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model, _ = patch_model()
    module = to_fx(convert(model, "float16", patch_gemm=True)).cuda()
    feeds = _feeds(model, seed=3)
    want = _ort(model, feeds)
    got = _run(torch.compile(module), model, feeds, device="cuda", dtype=torch.float16, channels_last=channels_last)
    for name in want:
        scale = float(np.max(np.abs(want[name])))
        assert float(np.max(np.abs(got[name] - want[name]))) <= 5e-3 * scale, name
