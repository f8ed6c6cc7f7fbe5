"""A 2-d depthwise convolution as one Triton kernel that reads and writes channels-last tensors
(``BuildOptions.conv_kernels="triton"``).

Why a kernel of our own: the other three ways a torch engine can run a depthwise convolution each cost something
this one does not (docs/torch-engines.md, "Depthwise convolutions").

- cuDNN builds an execution plan per distinct shape at the first call in every process (NASNet-A Large: 23
  shapes, ~4 s of a 7.5-9 s fresh load);
- torch's own kernel (``aten._conv_depthwise2d``) needs no plan, but takes NCHW only, so a channels-last engine
  pays a copy in and out around each call (NASNet-A Large +69% per pass);
- the converter's Inductor lowering (sums of shifted slices) needs no plan either, but ran slower than cuDNN on
  most of NASNet-A Large's shapes.

A depthwise convolution is memory-bound: each output reads kh*kw inputs of its own channel.  Channels-last, the
channels of one pixel are adjacent, so a tile of (output pixels x channels) loads each tap as rows of contiguous
channels.  The kernel is written with ``torch.library.triton_op``, which Inductor inlines into the engine it
compiles: it is autotuned there, compiled to a cubin with the engine's other kernels and shipped in its
``kernels`` artifact, so a fresh process neither builds a plan nor compiles anything for it.

Off the GPU the op is torch's convolution (Triton kernels run on GPUs), except under Triton's interpreter
(``TRITON_INTERPRET=1``), where the kernel itself runs on CPU tensors: that is how CI checks its indexing against
ONNX Runtime (tests/engines/test_conv_kernels.py).
"""

from __future__ import annotations

import os
from typing import Optional

OP = "parastream::depthwise_conv2d"

#: (BLOCK_P output pixels, BLOCK_C channels, warps) per program; Inductor times them per shape at build and the
#: engine ships the winner (a fresh process runs no autotuning: inductor_kernels keeps one launch per kernel)
CONFIGS = ((32, 64, 4), (16, 64, 2), (64, 32, 4), (32, 32, 2), (8, 128, 4), (64, 64, 8))

_REGISTERED: dict = {}


def interpreting() -> bool:
    """Whether Triton kernels run in Triton's interpreter (on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def output_size(h: int, w: int, kh: int, kw: int, stride, begin, end) -> tuple[int, int]:
    return ((h + begin[0] + end[0] - kh) // stride[0] + 1, (w + begin[1] + end[1] - kw) // stride[1] + 1)


def _kernel():
    """The Triton kernel, defined at first use (Triton is imported only where the option is taken)."""
    if "kernel" in _REGISTERED:
        return _REGISTERED["kernel"]
    import triton
    import triton.language as tl

    @triton.jit
    def depthwise_conv2d_kernel(x, w, b, y, H, W, C, HO, WO, P,
                                sxn, sxc, sxh, sxw, swc, swh, sww, syn, syc, syh, syw,
                                SH: tl.constexpr, SW: tl.constexpr, PT: tl.constexpr, PL: tl.constexpr,
                                KH: tl.constexpr, KW: tl.constexpr, HAS_BIAS: tl.constexpr,
                                BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
        # one program: BLOCK_P output pixels (flattened over batch, rows, columns) x BLOCK_C channels
        p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        p_in = p < P
        c_in = c < C
        wo = p % WO
        ho = (p // WO) % HO
        n = p // (WO * HO)
        acc = tl.zeros((BLOCK_P, BLOCK_C), dtype=tl.float32)
        for i in tl.static_range(KH):
            hi = ho * SH - PT + i
            row_in = p_in & (hi >= 0) & (hi < H)
            for j in tl.static_range(KW):
                wi = wo * SW - PL + j
                pix = row_in & (wi >= 0) & (wi < W)  # outside the input: the zero padding
                xv = tl.load(x + (n * sxn + hi * sxh + wi * sxw)[:, None] + c[None, :] * sxc,
                             mask=pix[:, None] & c_in[None, :], other=0.0)
                wv = tl.load(w + c * swc + i * swh + j * sww, mask=c_in, other=0.0)
                acc += xv.to(tl.float32) * wv.to(tl.float32)[None, :]
        if HAS_BIAS:
            acc += tl.load(b + c, mask=c_in, other=0.0).to(tl.float32)[None, :]
        tl.store(y + (n * syn + ho * syh + wo * syw)[:, None] + c[None, :] * syc, acc.to(y.dtype.element_ty),
                 mask=p_in[:, None] & c_in[None, :])

    configs = [triton.Config({"BLOCK_P": bp, "BLOCK_C": bc}, num_warps=nw) for bp, bc, nw in CONFIGS]
    _REGISTERED["raw"] = depthwise_conv2d_kernel
    _REGISTERED["kernel"] = triton.autotune(configs, key=["P", "C"])(depthwise_conv2d_kernel)
    return _REGISTERED["kernel"]


def launch(x, weight, bias, y, stride, begin, config=None) -> None:
    """Run the kernel: ``y`` (N, C, HO, WO, any strides) = the depthwise convolution of ``x`` (N, C, H, W, any
    strides) with ``weight`` (C, 1, kh, kw), ``bias`` (C,) or None, ``stride`` and the leading pads ``begin``
    (the trailing ones are implied by ``y``'s size).  ``config`` (BLOCK_P, BLOCK_C, warps) runs the kernel
    untuned with those sizes (the interpreter's tests); else the autotuned kernel (``wrap_triton``, so that
    Inductor sees it when it traces)."""
    import triton

    n, c, h, w = x.shape
    ho, wo = y.shape[2], y.shape[3]
    p = n * ho * wo
    kh, kw = weight.shape[2], weight.shape[3]
    args = (x, weight, bias if bias is not None else weight, y, h, w, c, ho, wo, p,
            *x.stride(), weight.stride(0), weight.stride(2), weight.stride(3), *y.stride())
    meta = dict(SH=int(stride[0]), SW=int(stride[1]), PT=int(begin[0]), PL=int(begin[1]), KH=int(kh), KW=int(kw),
                HAS_BIAS=bias is not None)
    tuned = _kernel()
    if config is not None:
        bp, bc, nw = config
        _REGISTERED["raw"][(triton.cdiv(p, bp), triton.cdiv(c, bc))](*args, **meta, BLOCK_P=bp, BLOCK_C=bc,
                                                                       num_warps=nw)
        return
    from torch.library import wrap_triton

    wrap_triton(tuned)[lambda m: (triton.cdiv(p, m["BLOCK_P"]), triton.cdiv(c, m["BLOCK_C"]))](*args, **meta)


def op():
    """``torch.ops.parastream.depthwise_conv2d(x, weight, bias, stride, begin, end)``, registered at first use:
    the convolution's output, channels-last.  On the GPU (and under Triton's interpreter) it runs the kernel;
    elsewhere it is torch's convolution."""
    if "op" in _REGISTERED:
        return _REGISTERED["op"]
    import torch
    import torch.nn.functional as F
    from torch.library import triton_op

    def depthwise_conv2d(x, weight, bias, stride, begin, end):
        n, c, h, w = x.shape
        ho, wo = output_size(h, w, weight.shape[2], weight.shape[3], stride, begin, end)
        if x.device.type != "cuda" and not interpreting():
            padded = F.pad(x, [begin[1], end[1], begin[0], end[0]])
            return F.conv2d(padded, weight, bias, stride, 0, 1, c).contiguous(memory_format=torch.channels_last)
        y = torch.empty((n, c, ho, wo), device=x.device, dtype=x.dtype, memory_format=torch.channels_last)
        if x.device.type != "meta":  # a shape-only call (the converter's checks) launches nothing
            launch(x, weight, bias, y, stride, begin, config=CONFIGS[0] if x.device.type == "cpu" else None)
        return y

    # torch infers the op's schema from the annotations, which this module's ``from __future__ import annotations``
    # would make strings of names it cannot see: they are given as the types themselves
    depthwise_conv2d.__annotations__ = {"x": torch.Tensor, "weight": torch.Tensor, "bias": Optional[torch.Tensor],
                                        "stride": list[int], "begin": list[int], "end": list[int],
                                        "return": torch.Tensor}
    triton_op(OP, mutates_args=())(depthwise_conv2d)
    _REGISTERED["op"] = torch.ops.parastream.depthwise_conv2d.default
    return _REGISTERED["op"]
