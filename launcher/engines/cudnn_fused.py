"""cuDNN's fused convolution epilogues as parastream's operators, channels-last in and out, whose layout Inductor
keeps.

Why: the converter runs a Conv -> Relu as ``torch.cudnn_convolution_relu`` and a Conv -> Add -> Relu as
``torch.cudnn_convolution_add_relu`` (one cuDNN kernel each).  Inductor has no lowering for those two aten ops and
calls them as fallbacks without a layout constraint, so it lays out their inputs as it likes: in SqueezeNet's
fused engine it wrote each fire module's Concat in NCHW, and the next convolution, whose 1x1 weight is both layouts
at once, then ran in NCHW, cuDNN transposing its input and output around a generic kernel (H200: 9 such
convolutions, 27 transposes, 0.242 ms for the engine against 0.146 with Inductor's own convolutions and epilogues,
where every one of its convolutions alone ran faster fused, 96 against 137 µs in all; bench/conv_epilogues.py).
An operator of parastream's own is traced with its inputs' strides as the converter asked for them (channels-last)
and Inductor keeps them (``needs_exact_strides``): the kernel that produces an input writes it channels-last.

``conv2d_relu(x, w, b, stride, padding, dilation, groups)`` = relu(conv(x, w) + b) and ``conv2d_add_relu(x, w, z,
b, ...)`` = relu(conv(x, w) + z + b), each torch's own cuDNN call, its output channels-last (as the fake function
says: a result whose layout cuDNN left ambiguous, a 1x1 output, is given those strides; any other is copied).
"""

from __future__ import annotations

import threading

_LOCK = threading.Lock()
_LIBS: list = []


def _channels_last(y):
    import torch

    n, c, h, w = y.shape
    want = (h * w * c, 1, w * c, c)
    if tuple(y.stride()) == want:
        return y
    if y.is_contiguous(memory_format=torch.channels_last):  # the same memory, strides of size-1 dimensions differ
        return y.as_strided(y.shape, want)
    return y.contiguous(memory_format=torch.channels_last)


def conv2d_relu(x, w, b, stride, padding, dilation, groups: int):
    import torch

    return _channels_last(torch.cudnn_convolution_relu(x.contiguous(memory_format=torch.channels_last), w, b,
                                                       stride, padding, dilation, groups))


def conv2d_add_relu(x, w, z, b, stride, padding, dilation, groups: int):
    import torch

    last = torch.channels_last
    return _channels_last(torch.cudnn_convolution_add_relu(x.contiguous(memory_format=last), w,
                                                           z.contiguous(memory_format=last), 1.0, b, stride,
                                                           padding, dilation, groups))


def _fake(x, w, stride, padding, dilation):
    from .cudnn_plans import _channels_last_strides, conv_out_shape

    out = conv_out_shape(x.shape, w.shape, stride, padding, dilation)
    return x.new_empty_strided(out, _channels_last_strides(out))


def register_ops() -> None:
    """``torch.ops.parastream.conv2d_relu`` and ``conv2d_add_relu``, once per process."""
    with _LOCK:
        if _LIBS:
            return
        import torch

        from .base import define_op

        # exact strides where this torch has the tag (Inductor then passes the inputs dense channels-last, as
        # traced), else the stride order
        tag = getattr(torch.Tag, "needs_exact_strides", None) or torch.Tag.needs_fixed_stride_order
        _LIBS.append(define_op(
            "conv2d_relu(Tensor x, Tensor w, Tensor? b, int[] stride, int[] padding, int[] dilation, int groups) "
            "-> Tensor", conv2d_relu,
            lambda x, w, b, stride, padding, dilation, groups: _fake(x, w, stride, padding, dilation), tags=(tag,)))
        _LIBS.append(define_op(
            "conv2d_add_relu(Tensor x, Tensor w, Tensor z, Tensor? b, int[] stride, int[] padding, int[] dilation, "
            "int groups) -> Tensor", conv2d_add_relu,
            lambda x, w, z, b, stride, padding, dilation, groups: _fake(x, w, stride, padding, dilation),
            tags=(tag,)))
