"""A depthwise 2-d convolution over a channels-last input as one Triton kernel of parastream's own.

Why: cuDNN's depthwise kernels (``conv2d_c1_k1_nhwc``, runtime-compiled) are far from what the memory allows at
the batch sizes a server runs.  ConvNeXt-T's 7x7 depthwise convolutions took 201.9 of its engine's 470 µs of kernels
(H200, fp16, batch 1, bench/kernel_profile.py; torch.compile runs the same kernels), 11-15 µs a call for tensors of
0.6 MB, which the GPU reads in well under a microsecond; Inductor's own lowering of the same convolution
(``onnx_torch._conv_as_kernels``) is faster alone but is fused by Inductor with the LayerNorm after it, which
reduces over the channels the convolution's kernel is split on, and the engine ran slower (bench/NOTES.md).

The kernel: each program computes ``BLOCK_W`` output columns of one output row for ``BLOCK_C`` channels, looping
over the taps (unrolled: the kernel's size is a compile-time constant) and reading, for each tap, one
[``BLOCK_W``, ``BLOCK_C``] tile of the input, contiguous along the channels (NHWC), with the padding masked; the
sum is kept in fp32, the bias added, and the tile written channels-last.  The weight is taken taps-major
([kh·kw, C], ``taps_major``), so that each tap's weights for a block of channels are one contiguous read.

``register_op`` defines ``torch.ops.parastream.depthwise_conv2d`` through ``torch.library.triton_op``: Inductor
sees the Triton kernel inside and compiles it into the engine's code with its own kernels (a compiled engine
ships it like the rest), rather than calling out to an opaque function.  Without Triton or a GPU (the CPU
engines, CI) the op computes the same by torch's own convolution.

Measured (H200, fp16, batch 1): per shape, ConvNeXt-T's four 218.7 µs a forward pass with cuDNN against 99.9
(bench/depthwise_kernels.py --forms triton), EfficientNet-B0's twelve 76.6 against 44.8; ConvNeXt-T's whole
engine 0.423 against 0.544 ms for its cuDNN form (bench/depthwise_forms.py --forms triton), and its searched
bundle 0.392 ms against torch.compile's 0.575, where it was 0.521.  A build races it (the "depthwise Triton
kernel" round, ``pipeline.measure.DEPTHWISE_ROUNDS``).
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


def out_size(size: int, kernel: int, stride: int, pad_begin: int, pad_end: int, dilation: int) -> int:
    return (size + pad_begin + pad_end - dilation * (kernel - 1) - 1) // stride + 1


def taps_major(w):
    """A depthwise weight [C, 1, kh, kw] as the kernel reads it: [kh·kw, C], contiguous."""
    return w.reshape(w.shape[0], -1).t().contiguous()


def from_taps_major(wt, kernel):
    """``taps_major``'s inverse: [kh·kw, C] -> [C, 1, kh, kw]."""
    return wt.t().reshape(wt.shape[1], 1, int(kernel[0]), int(kernel[1]))


def blocks(c: int, wo: int, taps: int) -> tuple[int, int, int]:
    """(BLOCK_W, BLOCK_C, warps) for ``c`` channels, ``wo`` output columns and a kernel of ``taps`` taps.  From
    bench/depthwise_kernels.py's sweep of 24 blocks over ConvNeXt-T's and EfficientNet-B0's 16 shapes (H200, fp16,
    batch 1): the heavier 7x7 kernels ran fastest on few columns a program (4 up to 14 columns, else 8), the
    lighter ones on 32 columns from 28 up and 8 below; 32 channels on 2 warps where a program has 8 columns or
    fewer, else 64 on 4 (never more channels than the tensor's, rounded up to a power of two)."""
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

    def depthwise_nhwc(x_ptr, w_ptr, b_ptr, y_ptr, H, W, C, HO, WO,
                       KH: tl.constexpr, KW: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr,
                       PH: tl.constexpr, PW: tl.constexpr, DH: tl.constexpr, DW: tl.constexpr,
                       HAS_BIAS: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_C: tl.constexpr):
        row = tl.program_id(0)  # n * HO + ho
        n = row // HO
        ho = row % HO
        wo = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
        c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
        c_ok = c < C
        acc = tl.zeros((BLOCK_W, BLOCK_C), dtype=tl.float32)
        for kh in tl.static_range(KH):
            hi = ho * SH - PH + kh * DH
            h_ok = (hi >= 0) & (hi < H)
            base = (n * H + hi) * W
            for kw in tl.static_range(KW):
                wi = wo * SW - PW + kw * DW
                ok = h_ok & (wi >= 0) & (wi < W)
                xv = tl.load(x_ptr + (base + wi)[:, None] * C + c[None, :], mask=ok[:, None] & c_ok[None, :],
                             other=0.0)
                wv = tl.load(w_ptr + (kh * KW + kw) * C + c, mask=c_ok, other=0.0)
                acc += xv.to(tl.float32) * wv.to(tl.float32)[None, :]
        if HAS_BIAS:
            acc += tl.load(b_ptr + c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
        out = y_ptr + ((n * HO + ho) * WO + wo)[:, None] * C + c[None, :]
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=(wo < WO)[:, None] & c_ok[None, :])

    depthwise_nhwc.__qualname__ = "depthwise_nhwc"  # (found by module and name: ``__getattr__``)
    depthwise_nhwc = triton.jit(depthwise_nhwc)

    _KERNEL.append(depthwise_nhwc)
    return depthwise_nhwc


def __getattr__(name: str):
    """``depthwise_nhwc``, the kernel, as an attribute of this module (made at first use): Inductor's code and its
    compile workers find a user's Triton kernel by its module and name."""
    if name == "depthwise_nhwc":
        return _kernel()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _geometry(x, kernel, stride, padding, dilation):
    n, c, h, w = (int(v) for v in x.shape)
    kh, kw = (int(k) for k in kernel)
    ho = out_size(h, kh, int(stride[0]), int(padding[0]), int(padding[2]), int(dilation[0]))
    wo = out_size(w, kw, int(stride[1]), int(padding[1]), int(padding[3]), int(dilation[1]))
    return n, c, h, w, kh, kw, ho, wo


def launch(x, wt, b, kernel, stride, padding, dilation, block=None, wrap=None):
    """The convolution by the Triton kernel: ``x`` [N, C, H, W] (made channels-last), ``wt`` the weight
    taps-major, ``padding`` [top, left, bottom, right] (the kernel masks any split of it), ``block`` (BLOCK_W,
    BLOCK_C, warps) or ``blocks``'s; ``wrap`` (``torch.library.wrap_triton`` inside the op) applied to the kernel
    before its launch.  Returns the output channels-last."""
    import torch

    x = x.contiguous(memory_format=torch.channels_last)
    n, c, h, w, kh, kw, ho, wo = _geometry(x, kernel, stride, padding, dilation)
    y = torch.empty((n, c, ho, wo), dtype=x.dtype, device=x.device, memory_format=torch.channels_last)
    block_w, block_c, warps = block or blocks(c, wo, kh * kw)
    grid = (n * ho, -(-wo // block_w), -(-c // block_c))
    fn = _kernel() if wrap is None else wrap(_kernel())
    fn[grid](x, wt, b if b is not None else wt, y, h, w, c, ho, wo,
             KH=kh, KW=kw, SH=int(stride[0]), SW=int(stride[1]), PH=int(padding[0]), PW=int(padding[1]),
             DH=int(dilation[0]), DW=int(dilation[1]), HAS_BIAS=b is not None, BLOCK_W=block_w,
             BLOCK_C=block_c, num_warps=warps)
    return y


def reference(x, wt, b, kernel, stride, padding, dilation):
    """The same convolution by torch's own ops (the CPU's path, and the tests' reference)."""
    import torch

    F = torch.nn.functional
    w = from_taps_major(wt, kernel)
    top, left, bottom, right = (int(p) for p in padding)
    if top == bottom and left == right:
        y = F.conv2d(x, w, b, list(stride), [top, left], list(dilation), int(w.shape[0]))
    else:
        y = F.conv2d(F.pad(x, [left, right, top, bottom]), w, b, list(stride), 0, list(dilation), int(w.shape[0]))
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


def depthwise_conv2d(x, wt, b, kernel, stride, padding, dilation):
    """The depthwise convolution (weight taps-major, ``padding`` [top, left, bottom, right]), channels-last out:
    the Triton kernel where ``usable``, else torch's convolution."""
    if usable(x):
        return launch(x, wt, b, kernel, stride, padding, dilation)
    return reference(x, wt, b, kernel, stride, padding, dilation)


def register_op() -> None:
    """``torch.ops.parastream.depthwise_conv2d`` (``depthwise_conv2d``), once per process: a ``triton_op`` that
    Inductor compiles the kernel of into the engine's code, where Triton is there; a plain op otherwise."""
    with _LOCK:
        if _OP:
            return
        schema_args = "(Tensor x, Tensor wt, Tensor? b, int[] kernel, int[] stride, int[] padding, int[] dilation)"
        try:
            import triton  # noqa: F401

            from torch.library import triton_op, wrap_triton
        except ImportError:
            from .base import define_op

            def fake(x, wt, b, kernel, stride, padding, dilation):
                import torch

                n, c, h, w, kh, kw, ho, wo = _geometry(x, kernel, stride, padding, dilation)
                return torch.empty((n, c, ho, wo), dtype=x.dtype, device=x.device, memory_format=torch.channels_last)

            _OP.append(define_op("depthwise_conv2d" + schema_args + " -> Tensor", reference, fake))
            return

        global torch  # (the annotations below are strings, read against this module's globals: torch is one)
        import torch

        @triton_op("parastream::depthwise_conv2d", mutates_args=())
        def op(x: torch.Tensor, wt: torch.Tensor, b: torch.Tensor | None, kernel: list[int], stride: list[int],
               padding: list[int], dilation: list[int]) -> torch.Tensor:
            if not x.is_cuda:
                return reference(x, wt, b, kernel, stride, padding, dilation)
            return launch(x, wt, b, kernel, stride, padding, dilation, wrap=wrap_triton)

        _OP.append(op)
