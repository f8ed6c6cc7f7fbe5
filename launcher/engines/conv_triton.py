"""A depthwise or narrow-group 2-d convolution over a channels-last input as one Triton kernel of parastream's own.

Why: cuDNN's kernels for these convolutions are far from what the memory allows at the batch sizes a server runs.
Depthwise: ConvNeXt-T's 7x7 depthwise convolutions (``conv2d_c1_k1_nhwc``, runtime-compiled) took 201.9 of its
engine's 470 µs of kernels (H200, fp16, batch 1, bench/kernel_profile.py; torch.compile runs the same kernels),
11-15 µs a call for tensors of 0.6 MB, which the GPU reads in well under a microsecond; Inductor's own lowering of
the same convolution (``onnx_torch._conv_as_kernels``) is faster alone but is fused by Inductor with the LayerNorm
after it, which reduces over the channels the convolution's kernel is split on, and the engine ran slower
(bench/NOTES.md).  Grouped: RegNetY-400MF's 3x3 convolutions of 8 channels a group ran as cuDNN's implicit GEMMs
(``sm80_xmma_fprop_implicit_gemm_..._g8``), 80 of its engine's 334 µs of kernels for 16 calls on tensors of
at most 0.3 MB (torch.compile's the same).

The kernel: each program computes ``BLOCK_W`` output columns of one output row for ``BLOCK_C`` output channels,
looping over the taps and, within a tap, over the ``CIG`` input channels of each output channel's group (both
unrolled: compile-time constants), reading one [``BLOCK_W``, ``BLOCK_C``] tile of the input
per step (contiguous along the channels, NHWC, for a depthwise convolution; a gather from the group's channels
otherwise), with the padding masked; the sum is kept in fp32, the bias added, and the tile written channels-last.
The weight is taken taps-major ([kh·kw·CIG, K], ``taps_major``), so that each step's weights for a block of
output channels are one contiguous read.  A depthwise convolution is the case of one input channel a group.

``register_op`` defines ``torch.ops.parastream.grouped_conv2d`` through ``torch.library.triton_op``: Inductor
sees the Triton kernel inside and compiles it into the engine's code with its own kernels (a compiled engine
ships it like the rest), rather than calling out to an opaque function.  Without Triton or a GPU (the CPU
engines, CI) the op computes the same by torch's own convolution.

Measured (H200, fp16, batch 1): per shape, ConvNeXt-T's four depthwise convolutions 218.7 µs a forward pass with
cuDNN against 99.9 (bench/depthwise_kernels.py --forms triton), EfficientNet-B0's twelve 76.6 against 44.8;
ConvNeXt-T's whole engine 0.423 against 0.544 ms for its cuDNN form (bench/depthwise_forms.py --forms triton),
and its searched bundle 0.392 ms against torch.compile's 0.575, where it was 0.521.  A build races it (the
"Triton convolution kernel" round, ``pipeline.measure.DEPTHWISE_ROUNDS``).
"""

from __future__ import annotations

import threading

_LOCK = threading.Lock()
_OP: list = []
_KERNEL: list = []
#: Triton's modules, imported by ``_kernel`` at its first use (module globals: Triton's interpreter, which the CPU
#: tests run the kernel in, swaps the ``tl`` a kernel finds among its globals)
triton = tl = None
torch = None  # (imported by ``register_op``)

#: the most input channels a group that the kernel takes (``takes``): it reads one input channel of the group per
#: step, on CUDA cores, which a wider group's reduction would be better run as a matrix product for (cuDNN's)
MAX_GROUP_WIDTH = 16


def out_size(size: int, kernel: int, stride: int, pad_begin: int, pad_end: int, dilation: int) -> int:
    return (size + pad_begin + pad_end - dilation * (kernel - 1) - 1) // stride + 1


def takes(x_channels: int, w_shape, group: int) -> bool:
    """Whether the kernel runs a 2-d convolution of ``group`` groups with weight ``w_shape`` [K, C/group, kh, kw]
    on ``x_channels`` input channels: more than one group, at most ``MAX_GROUP_WIDTH`` input channels a group,
    and more than one term a sum (a depthwise 1x1 is a scale)."""
    k, cig, kh, kw = (int(d) for d in w_shape)
    return (group > 1 and x_channels == group * cig and k % group == 0 and cig <= MAX_GROUP_WIDTH
            and kh * kw * cig > 1)


def taps_major(w):
    """A weight [K, CIG, kh, kw] as the kernel reads it: [kh·kw·CIG, K] (row tap·CIG + input channel of the
    group), contiguous; a depthwise weight [C, 1, kh, kw] becomes [kh·kw, C]."""
    k = w.shape[0]
    return w.permute(2, 3, 1, 0).reshape(-1, k).contiguous()


def from_taps_major(wt, kernel, group_width: int = 1):
    """``taps_major``'s inverse: [kh·kw·CIG, K] -> [K, CIG, kh, kw]."""
    kh, kw = int(kernel[0]), int(kernel[1])
    return wt.reshape(kh, kw, int(group_width), wt.shape[1]).permute(3, 2, 0, 1).contiguous()


def blocks(c: int, wo: int, taps: int) -> tuple[int, int, int]:
    """(BLOCK_W, BLOCK_C, warps) for ``c`` output channels, ``wo`` output columns and ``taps`` terms a sum (the
    kernel's taps times its input channels a group).  From bench/depthwise_kernels.py's sweep of 24 blocks over
    ConvNeXt-T's and EfficientNet-B0's 16 depthwise shapes (H200, fp16, batch 1): the heavier 7x7 kernels ran
    fastest on few columns a program (4 up to 14 columns, else 8), the lighter ones on 32 columns from 28 up and 8
    below; 32 channels on 2 warps where a program has 8 columns or fewer, else 64 on 4 (never more channels than
    the tensor's, rounded up to a power of two)."""
    if taps >= 49:
        block_w = 4 if wo <= 14 else 8
    else:
        block_w = 32 if wo >= 28 else 8
    block_c, warps = (32, 2) if block_w <= 8 else (64, 4)
    return block_w, min(block_c, max(16, 1 << (max(c, 1) - 1).bit_length())), warps


def _kernel():
    """The Triton kernel (compiled on first use; Triton imported only then)."""
    global triton, tl
    if _KERNEL:
        return _KERNEL[0]
    import triton
    import triton.language as tl

    def grouped_conv_nhwc(x_ptr, w_ptr, b_ptr, y_ptr, H, W, C, K, HO, WO,
                          KH: tl.constexpr, KW: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr,
                          PH: tl.constexpr, PW: tl.constexpr, DH: tl.constexpr, DW: tl.constexpr,
                          CIG: tl.constexpr, COG: tl.constexpr, HAS_BIAS: tl.constexpr,
                          BLOCK_W: tl.constexpr, BLOCK_C: tl.constexpr):
        row = tl.program_id(0)  # n * HO + ho
        n = row // HO
        ho = row % HO
        wo = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
        k = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)  # output channels
        k_ok = k < K
        c0 = (k // COG) * CIG  # each output channel's group's first input channel
        acc = tl.zeros((BLOCK_W, BLOCK_C), dtype=tl.float32)
        for kh in tl.static_range(KH):
            hi = ho * SH - PH + kh * DH
            h_ok = (hi >= 0) & (hi < H)
            base = (n * H + hi) * W
            for kw in tl.static_range(KW):
                wi = wo * SW - PW + kw * DW
                ok = (h_ok & (wi >= 0) & (wi < W))[:, None] & k_ok[None, :]
                pix = (base + wi)[:, None] * C
                for ci in tl.static_range(CIG):
                    xv = tl.load(x_ptr + pix + (c0 + ci)[None, :], mask=ok, other=0.0)
                    wv = tl.load(w_ptr + ((kh * KW + kw) * CIG + ci) * K + k, mask=k_ok, other=0.0)
                    acc += xv.to(tl.float32) * wv.to(tl.float32)[None, :]
        if HAS_BIAS:
            acc += tl.load(b_ptr + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        out = y_ptr + ((n * HO + ho) * WO + wo)[:, None] * K + k[None, :]
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=(wo < WO)[:, None] & k_ok[None, :])

    grouped_conv_nhwc.__qualname__ = "grouped_conv_nhwc"  # (found by module and name: ``__getattr__``)
    grouped_conv_nhwc = triton.jit(grouped_conv_nhwc)

    _KERNEL.append(grouped_conv_nhwc)
    return grouped_conv_nhwc


def __getattr__(name: str):
    """``grouped_conv_nhwc``, the kernel, as an attribute of this module (made at first use): Inductor's code and
    its compile workers find a user's Triton kernel by its module and name."""
    if name == "grouped_conv_nhwc":
        return _kernel()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _geometry(x, wt, kernel, stride, padding, dilation, groups):
    """(n, c, h, w, k, kh, kw, ho, wo, input channels a group, output channels a group)."""
    n, c, h, w = (int(v) for v in x.shape)
    kh, kw = (int(v) for v in kernel)
    k = int(wt.shape[1])
    ho = out_size(h, kh, int(stride[0]), int(padding[0]), int(padding[2]), int(dilation[0]))
    wo = out_size(w, kw, int(stride[1]), int(padding[1]), int(padding[3]), int(dilation[1]))
    return n, c, h, w, k, kh, kw, ho, wo, c // int(groups), k // int(groups)


def launch(x, wt, b, kernel, stride, padding, dilation, groups, block=None, wrap=None):
    """The convolution by the Triton kernel: ``x`` [N, C, H, W] (made channels-last), ``wt`` the weight
    taps-major, ``padding`` [top, left, bottom, right] (the kernel masks any split of it), ``groups`` the
    convolution's, ``block`` (BLOCK_W, BLOCK_C, warps) or ``blocks``'s; ``wrap`` (``torch.library.wrap_triton``
    inside the op) applied to the kernel before its launch.  Returns the output channels-last."""
    import torch

    x = x.contiguous(memory_format=torch.channels_last)
    n, c, h, w, k, kh, kw, ho, wo, cig, cog = _geometry(x, wt, kernel, stride, padding, dilation, groups)
    y = torch.empty((n, k, ho, wo), dtype=x.dtype, device=x.device, memory_format=torch.channels_last)
    block_w, block_c, warps = block or blocks(k, wo, kh * kw * cig)
    grid = (n * ho, -(-wo // block_w), -(-k // block_c))
    fn = _kernel() if wrap is None else wrap(_kernel())
    fn[grid](x, wt, b if b is not None else wt, y, h, w, c, k, ho, wo,
             KH=kh, KW=kw, SH=int(stride[0]), SW=int(stride[1]), PH=int(padding[0]), PW=int(padding[1]),
             DH=int(dilation[0]), DW=int(dilation[1]), CIG=cig, COG=cog, HAS_BIAS=b is not None,
             BLOCK_W=block_w, BLOCK_C=block_c, num_warps=warps)
    return y


def reference(x, wt, b, kernel, stride, padding, dilation, groups):
    """The same convolution by torch's own ops (the CPU's path, and the tests' reference)."""
    import torch

    F = torch.nn.functional
    w = from_taps_major(wt, kernel, int(x.shape[1]) // int(groups))
    top, left, bottom, right = (int(p) for p in padding)
    if top == bottom and left == right:
        y = F.conv2d(x, w, b, list(stride), [top, left], list(dilation), int(groups))
    else:
        y = F.conv2d(F.pad(x, [left, right, top, bottom]), w, b, list(stride), 0, list(dilation), int(groups))
    return y.contiguous(memory_format=torch.channels_last)


def usable(x) -> bool:
    """Whether ``launch`` can run on ``x``: a CUDA tensor, Triton importable, and 32-bit offsets enough."""
    if not x.is_cuda or x.numel() >= 2 ** 31:
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def grouped_conv2d(x, wt, b, kernel, stride, padding, dilation, groups):
    """The convolution (weight taps-major, ``padding`` [top, left, bottom, right]), channels-last out: the
    Triton kernel where ``usable``, else torch's convolution."""
    if usable(x):
        return launch(x, wt, b, kernel, stride, padding, dilation, groups)
    return reference(x, wt, b, kernel, stride, padding, dilation, groups)


def register_op() -> None:
    """``torch.ops.parastream.grouped_conv2d`` (``grouped_conv2d``), once per process: a ``triton_op`` that
    Inductor compiles the kernel of into the engine's code, where Triton is there; a plain op otherwise."""
    with _LOCK:
        if _OP:
            return
        schema_args = ("(Tensor x, Tensor wt, Tensor? b, int[] kernel, int[] stride, int[] padding, int[] dilation, "
                       "int groups)")
        try:
            import triton  # noqa: F401

            from torch.library import triton_op, wrap_triton
        except ImportError:
            from .base import define_op

            def fake(x, wt, b, kernel, stride, padding, dilation, groups):
                import torch

                n, _, _, _, k, _, _, ho, wo, _, _ = _geometry(x, wt, kernel, stride, padding, dilation, groups)
                return torch.empty((n, k, ho, wo), dtype=x.dtype, device=x.device, memory_format=torch.channels_last)

            _OP.append(define_op("grouped_conv2d" + schema_args + " -> Tensor", reference, fake))
            return

        global torch  # (the annotations below are strings, read against this module's globals: torch is one)
        import torch

        @triton_op("parastream::grouped_conv2d", mutates_args=())
        def op(x: torch.Tensor, wt: torch.Tensor, b: torch.Tensor | None, kernel: list[int], stride: list[int],
               padding: list[int], dilation: list[int], groups: int) -> torch.Tensor:
            if not x.is_cuda:
                return reference(x, wt, b, kernel, stride, padding, dilation, groups)
            return launch(x, wt, b, kernel, stride, padding, dilation, groups, wrap=wrap_triton)

        _OP.append(op)
