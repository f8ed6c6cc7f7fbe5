"""parastream's own depthwise and narrow-group convolution kernel (``launcher/engines/conv_triton.py``).

On the CPU the kernel itself runs in Triton's interpreter (``TRITON_INTERPRET=1``) against torch's convolution,
over the geometry the models have (3x3 to 7x7, stride 1 and 2, symmetric and "same" padding, channels that are
not a multiple of the block; depthwise, a channel multiplier, 2 to 16 channels a group, a grouped 1x1); the op
falls back to torch's convolution off the GPU.  On the GPU (marked): fp16
against torch's convolution, and the op compiled by Inductor into an engine's code.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from parastream.launcher.engines import conv_triton as dt  # noqa: E402

#: (N, C, H, W, kernel, stride, padding [top, left, bottom, right], groups, output channels)
CASES = [(1, 24, 14, 14, 7, 1, [3, 3, 3, 3], 24, 24), (2, 40, 15, 13, 3, 2, [1, 1, 1, 1], 40, 40),
         (1, 20, 10, 10, 5, 2, [1, 1, 2, 2], 20, 20), (1, 72, 9, 9, 3, 1, [1, 1, 1, 1], 72, 72),
         (1, 16, 9, 9, 3, 1, [1, 1, 1, 1], 16, 32),  # a depthwise channel multiplier of 2
         (1, 48, 11, 11, 3, 2, [1, 1, 1, 1], 6, 48),  # 8 channels a group (RegNet's)
         (2, 64, 8, 8, 3, 1, [1, 1, 1, 1], 4, 64),  # 16 a group
         (1, 24, 7, 9, 3, 1, [0, 1, 2, 1], 6, 12),  # 4 in, 2 out a group, padding split
         (1, 32, 6, 6, 1, 1, [0, 0, 0, 0], 8, 32)]  # a grouped 1x1 (ShuffleNet's)


def _case(n, c, h, w, k, groups, out, seed=0, device="cpu", dtype=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c, h, w, generator=g).to(memory_format=torch.channels_last)
    wgt = torch.randn(out, c // groups, k, k, generator=g) * 0.2
    b = torch.randn(out, generator=g)
    dtype = dtype or torch.float32
    return (x.to(device, dtype).contiguous(memory_format=torch.channels_last), wgt.to(device, dtype),
            b.to(device, dtype))


def test_the_weight_taps_major_and_back():
    w = torch.arange(2 * 9, dtype=torch.float32).reshape(2, 1, 3, 3)
    wt = dt.taps_major(w)
    assert wt.shape == (9, 2) and wt.is_contiguous() and wt[4, 1] == w[1, 0, 1, 1]
    assert torch.equal(dt.from_taps_major(wt, (3, 3)), w)
    w = torch.arange(6 * 4 * 9, dtype=torch.float32).reshape(6, 4, 3, 3)  # 4 input channels a group
    wt = dt.taps_major(w)
    assert wt.shape == (36, 6) and wt[(1 * 3 + 2) * 4 + 3, 5] == w[5, 3, 1, 2]  # row: tap, then channel of the group
    assert torch.equal(dt.from_taps_major(wt, (3, 3), 4), w)


def test_what_the_kernel_takes():
    assert dt.takes(32, (32, 1, 3, 3), 32) and dt.takes(16, (32, 1, 3, 3), 16)  # depthwise, and a multiplier
    assert dt.takes(48, (48, 8, 3, 3), 6) and dt.takes(64, (64, 16, 3, 3), 4) and dt.takes(32, (32, 4, 1, 1), 8)
    # must not take: one group, groups wider than MAX_GROUP_WIDTH, a depthwise 1x1 (a scale)
    assert not dt.takes(16, (16, 16, 3, 3), 1) and not dt.takes(64, (64, 32, 3, 3), 2)
    assert not dt.takes(8, (8, 1, 1, 1), 8)


def test_the_blocks_follow_the_kernel_and_fit_the_tensor():
    assert dt.blocks(384, 14, 49) == (4, 32, 2) and dt.blocks(96, 56, 49) == (8, 32, 2)
    assert dt.blocks(144, 56, 9) == (32, 64, 4) and dt.blocks(1152, 7, 9) == (8, 32, 2)
    assert dt.blocks(32, 112, 9) == (32, 32, 4)  # (no more channels than the tensor's)


_INTERPRETED = """
import json, sys
import torch
sys.path.insert(0, {tests!r})
from test_conv_triton import CASES, _case
from parastream.launcher.engines import conv_triton as dt
errs = []
for n, c, h, w, k, s, pads, groups, out in CASES:
    x, wgt, b = _case(n, c, h, w, k, groups, out)
    wt = dt.taps_major(wgt)
    for bias in (b, None):
        got = dt.launch(x, wt, bias, (k, k), (s, s), pads, (1, 1), groups)
        want = dt.reference(x, wt, bias, (k, k), (s, s), pads, (1, 1), groups)
        assert got.shape == want.shape and got.is_contiguous(memory_format=torch.channels_last), (got.shape, want.shape)
        errs.append(float((got - want).abs().max()))
print(json.dumps(errs))
"""


def test_the_kernel_computes_torchs_convolution_in_tritons_interpreter():
    """Every case with and without bias, the kernel run by Triton's interpreter (in a process of its own: the
    interpreter is chosen when Triton is imported) against torch's convolution."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton")
    code = _INTERPRETED.format(tests=str(Path(__file__).parent))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=False,
                       env=dict(os.environ, TRITON_INTERPRET="1"))
    assert p.returncode == 0, p.stderr[-3000:]
    errs = json.loads(p.stdout.strip().splitlines()[-1])
    assert len(errs) == 2 * len(CASES) and max(errs) < 1e-4, errs


def test_off_the_gpu_the_op_is_torchs_convolution():
    """Must not launch: a CPU tensor goes to torch's convolution (the CPU engines' path)."""
    for n, c, h, w, k, s, pads, groups, out in (CASES[2], CASES[7]):
        x, wgt, b = _case(n, c, h, w, k, groups, out)
        assert not dt.usable(x)
        dt.register_op()
        got = torch.ops.parastream.grouped_conv2d(x, dt.taps_major(wgt), b, [k, k], [s, s], pads, [1, 1], groups)
        top, left, bottom, right = pads
        want = torch.nn.functional.conv2d(torch.nn.functional.pad(x, [left, right, top, bottom]), wgt, b, s, 0, 1,
                                          groups)
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[4]}x{c[4]}s{c[5]}g{c[1] // c[7]}k{c[8]}")
def test_on_the_gpu_fp16_and_compiled_by_inductor(case):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    n, c, h, w, k, s, pads, groups, out_channels = case
    x, wgt, b = _case(n, c, h, w, k, groups, out_channels, device="cuda", dtype=torch.float16)
    wt = dt.taps_major(wgt)
    geometry = ((k, k), (s, s), pads, (1, 1), groups)
    want = dt.reference(x.float(), wt.float(), b.float(), *geometry)
    got = dt.launch(x, wt, b, *geometry)
    scale = float(want.abs().max())
    assert float((got.float() - want).abs().max()) <= 2e-3 * scale
    dt.register_op()

    def engine(x, wt, b):  # the op between two pointwise ops, as an engine has it
        return torch.relu(torch.ops.parastream.grouped_conv2d(x * 0.5, wt, b, [k, k], [s, s], pads, [1, 1],
                                                              groups)) + 1

    torch._dynamo.reset()
    from torch._inductor.utils import run_and_get_code

    out, code = run_and_get_code(torch.compile(engine, fullgraph=True, dynamic=False), x, wt, b)
    ref = torch.relu(dt.reference((x * 0.5).float(), wt.float(), b.float(), *geometry)) + 1
    assert float((out.float() - ref).abs().max()) <= 2e-3 * float(ref.abs().max())
    assert "grouped_conv_nhwc" in "\n".join(code)  # the kernel is in the engine's code, not an opaque call


def _grouped_model(seed: int = 0):
    """A depthwise 5x5 (bias, "same" padding split 1/2 by stride 2), a dense 3x3, a grouped 3x3 of 2 channels a
    group and one of 32 channels a group (wider than ``MAX_GROUP_WIDTH``): the first and the third are the
    kernel's, the others left to torch's convolution."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)

    def w(name, shape):
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.2).astype(np.float32), name)

    N = helper.make_node
    nodes = [N("Conv", ["x", "w_dw", "b_dw"], ["d"], name="conv_dw", group=16, strides=[2, 2], pads=[1, 1, 2, 2]),
             N("Conv", ["d", "w_dense"], ["e"], name="conv_dense", pads=[1, 1, 1, 1]),
             N("Conv", ["e", "w_g", "b_g"], ["f"], name="conv_grouped", pads=[1, 1, 1, 1], group=32),
             N("Conv", ["f", "w_wide"], ["y"], name="conv_wide_groups", pads=[1, 1, 1, 1], group=2)]
    graph = helper.make_graph(nodes, "grouped",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 12, 12])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16, 6, 6])],
                              [w("w_dw", (16, 1, 5, 5)), w("b_dw", (16,)), w("w_dense", (64, 16, 3, 3)),
                               w("w_g", (64, 2, 3, 3)), w("b_g", (64,)), w("w_wide", (16, 32, 3, 3))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return onnx.shape_inference.infer_shapes(model)


@pytest.mark.parametrize("traced", [False, True])
def test_the_converter_runs_depthwise_and_narrow_group_convolutions_as_the_op_and_computes_onnxruntimes_outputs(traced):
    import onnxruntime as ort

    from parastream.launcher.engines.onnx_torch import _TritonConv, conv_kernels_change, convert, to_fx, triton_convs

    model = _grouped_model()
    x = np.random.default_rng(3).standard_normal((1, 16, 12, 12)).astype(np.float32)
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert triton_convs(model) == {0, 2}  # read from the ONNX (the engines' cache key): the same two
    assert conv_kernels_change(model, "triton") and conv_kernels_change(model, "inductor")
    module = convert(model, conv_kernels="triton")
    own = [st for st in module._steps if isinstance(st.fn, _TritonConv)]
    assert [st.node for st in own] == ["conv_dw", "conv_grouped"]
    assert module.taps_major_weights == 2 and all(st.fn.stored for st in own)
    assert [tuple(getattr(module, st.args[1][1]).shape) for st in own] == [(25, 16), (18, 64)]  # taps-major
    fn = to_fx(module) if traced else module
    with torch.no_grad():
        out = fn(torch.from_numpy(x))
    out = out[0] if isinstance(out, (tuple, list)) else out
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-4, atol=1e-4)


def test_other_kernels_choices_leave_the_grouped_convolutions_to_torch():
    """Must not fire: without ``conv_kernels`` "triton" no step is the op and no weight is rearranged; a model
    whose only grouped convolution is wider than the kernel takes is not changed by "triton"."""
    import onnx

    from parastream.launcher.engines.onnx_torch import _TritonConv, conv_kernels_change, convert, triton_convs

    for kernels in ("cudnn", "inductor", "native"):
        module = convert(_grouped_model(), conv_kernels=kernels)
        assert not any(isinstance(st.fn, _TritonConv) for st in module._steps), kernels
        assert module.taps_major_weights == 0
    wide = _grouped_model()
    nodes = list(wide.graph.node)
    del wide.graph.node[:]
    wide.graph.node.extend([nodes[1], nodes[3]])  # the dense and the wide-group convolutions alone
    wide.graph.node[0].input[0] = "x"
    wide.graph.node[1].input[0] = "e"
    wide.graph.input[0].type.tensor_type.shape.dim[2].dim_value = 6
    wide.graph.input[0].type.tensor_type.shape.dim[3].dim_value = 6
    del wide.graph.value_info[:]
    wide = onnx.shape_inference.infer_shapes(wide)
    assert not triton_convs(wide) and not conv_kernels_change(wide, "triton")
    module = convert(wide, conv_kernels="triton")
    assert not any(isinstance(st.fn, _TritonConv) for st in module._steps) and module.taps_major_weights == 0
