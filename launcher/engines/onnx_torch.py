"""Our own ONNX -> PyTorch mapping: a branch's ONNX graph becomes a ``torch.nn.Module``.

Why our own and not onnx2torch: onnx2torch's last release (1.5.15) is from 2024-08; it
rebuilds every node as a custom module that recomputes shapes at run time (Shape ->
Gather -> Concat -> Reshape chains stay in the graph), and it has no notion of
fp16 compute.  Branches reach us with static shapes (``parastream build`` runs
shape inference), so everything that depends only on initializers and shapes is
folded *here*, at conversion, and the module holds nothing but tensor work — the
form TorchInductor fuses best, with no guards on shape arithmetic.

How it works
------------
Nodes are visited in topological order.  Each value is a ``Value``: a constant (a
CPU tensor, folded) or a run-time tensor of known shape and dtype.  A converter
``CONVERTERS[op_type](node) -> fn`` reads attributes and the constant inputs it
needs as Python values (Reshape's shape, Slice's starts, ...) and returns ``fn``,
plain torch code over the node's inputs.  If every input is a constant, ``fn`` runs
now on CPU tensors and its result is a new constant; otherwise ``fn`` becomes one
step of the module, and its output shapes come from running it on meta tensors.
Constants that steps read become buffers, cast to the compute dtype when floating.

``OnnxModule.forward`` interprets the step list; with no data-dependent control
flow it is FX-traceable (``torch.fx.symbolic_trace``), and dynamo unrolls it.

Unsupported ops fail at conversion with ``UnsupportedOp`` naming the node.
"""

from __future__ import annotations

import hashlib
import math
import weakref
from dataclasses import dataclass
from typing import Callable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from parastream.core import fused_ops
from parastream.core.dataflow import consumers

from ..errors import ParastreamError
from .base import LOWERED_CONV_KERNELS


class UnsupportedOp(ParastreamError):
    """An ONNX node the torch backend cannot convert; the message names the node."""


def _torch():
    import torch

    return torch


ONNX_TO_TORCH_DTYPE = {
    1: "float32", 2: "uint8", 3: "int8", 5: "int16", 6: "int32", 7: "int64", 9: "bool", 10: "float16",
    11: "float64", 16: "bfloat16",
}


def torch_dtype(name_or_onnx):
    torch = _torch()
    name = ONNX_TO_TORCH_DTYPE[name_or_onnx] if isinstance(name_or_onnx, int) else str(name_or_onnx)
    return getattr(torch, name)


@dataclass
class Value:
    name: str
    shape: tuple | None
    dtype: object  # torch.dtype
    const: object = None  # torch.Tensor on the CPU when known at conversion

    @property
    def is_const(self) -> bool:
        return self.const is not None


class NodeView:
    """What a converter sees of one node: attributes, input Values, the compute dtype."""

    def __init__(self, node: onnx.NodeProto, inputs: list[Value | None], opset: int, float_dtype, inferred=None,
                 fuse_attention: bool = True, fuse_gemm_epilogue: bool = False, conv_kernels: str = "cudnn",
                 patch_gemm: bool = False, one_row_reduction: bool = False):
        self.node = node
        self.patch_gemm = patch_gemm  # patch convolutions of few channels as one matrix product (``_conv_as_patch_gemm``)
        self.one_row_reduction = one_row_reduction  # a Linear of one row as one reduction (``one_row_linears``)
        self.fuse_attention = fuse_attention  # attention nodes: one SDPA kernel, else its matmul-softmax-matmul
        self.fuse_gemm_epilogue = fuse_gemm_epilogue  # matmul-bias-activation nodes: cuBLASLt's epilogue, else three ops
        self.conv_kernels = conv_kernels  # "inductor": depthwise convolutions as ops Inductor compiles
        self.inferred = inferred or {}
        self.name = node.name or f"{node.op_type}({', '.join(node.output)})"
        self.op = node.op_type
        self.inputs = inputs
        self.opset = opset
        self.float_dtype = float_dtype
        self.attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}

    def attr(self, key, default=None):
        v = self.attrs.get(key, default)
        if isinstance(v, bytes):
            v = v.decode()
        return v

    def has_input(self, i: int) -> bool:
        return i < len(self.inputs) and self.inputs[i] is not None

    def const(self, i: int):
        v = self.inputs[i] if i < len(self.inputs) else None
        if v is None or not v.is_const:
            raise UnsupportedOp(f"node {self.name!r} ({self.op}): input {i} must be a constant (initializer or computable from shapes) for the torch backend")
        return v.const

    def out_shape(self, i: int = 0):
        """The output's static shape from ONNX shape inference (value_info), or None."""
        return self.inferred.get(self.node.output[i]) if i < len(self.node.output) else None

    def ints(self, i: int) -> list[int]:
        return [int(x) for x in self.const(i).reshape(-1).tolist()]

    def shape(self, i: int) -> tuple:
        v = self.inputs[i]
        if v.shape is None:
            raise UnsupportedOp(f"node {self.name!r} ({self.op}): input {i} has no static shape")
        return v.shape

    def rank(self, i: int) -> int:
        return len(self.shape(i))

    def fail(self, why: str):
        raise UnsupportedOp(f"node {self.name!r} ({self.op}): {why}")


CONVERTERS: dict[str, Callable[[NodeView], Callable]] = {}


def converter(*ops):
    def deco(fn):
        for op in ops:
            CONVERTERS[op] = fn
        return fn
    return deco


# -- elementwise ---------------------------------------------------------------

def _unary(name, functional: bool = False, attr: str | None = None, default: float = 0.0):
    """An op that is one torch function (``torch.NAME``, or ``torch.nn.functional.NAME``), of at most one float
    attribute passed as its second argument."""
    def conv(n: NodeView):
        torch = _torch()
        f = getattr(torch.nn.functional if functional else torch, name)
        if attr is None:
            return lambda x: f(x)
        a = float(n.attr(attr, default))
        return lambda x: f(x, a)
    return conv


for _op, _fn in {"Relu": "relu", "Sigmoid": "sigmoid", "Tanh": "tanh", "Erf": "erf", "Exp": "exp", "Log": "log",
                 "Sqrt": "sqrt", "Neg": "neg", "Abs": "abs", "Reciprocal": "reciprocal", "Floor": "floor",
                 "Ceil": "ceil", "Not": "logical_not", "Sign": "sign", "Sin": "sin", "Cos": "cos",
                 "Round": "round", "IsNaN": "isnan"}.items():
    CONVERTERS[_op] = _unary(_fn)
for _op, (_fn, _attr, _default) in {"LeakyRelu": ("leaky_relu", "alpha", 0.01), "Elu": ("elu", "alpha", 1.0),
                                     "Celu": ("celu", "alpha", 1.0), "HardSwish": ("hardswish", None, 0.0),
                                     "Softplus": ("softplus", None, 0.0), "Mish": ("mish", None, 0.0),
                                     "Softsign": ("softsign", None, 0.0)}.items():
    CONVERTERS[_op] = _unary(_fn, functional=True, attr=_attr, default=_default)


@converter("Identity")
def _identity(n):
    return lambda x, *rest: x


@converter("Dropout")
def _dropout(n: NodeView):
    """Dropout at inference: the identity, and its mask all true (ONNX Runtime's, opset 12+).  Refused where it
    drops (training_mode true or computed at run time: ONNX Runtime's output is random then), and the mask of
    opsets before 12 (ONNX Runtime gives it all false there, not what the spec's inference mode says)."""
    torch = _torch()
    if n.has_input(2):
        t = n.inputs[2]
        if not t.is_const or bool(t.const.reshape(-1)[0]):
            n.fail("training_mode true or computed at run time (a random dropout) is not mapped")
    if len(n.node.output) < 2 or not n.node.output[1]:
        return lambda x, *rest: x
    if n.opset < 12:
        n.fail(f"the mask output of opset {n.opset} is not mapped")
    return lambda x, *rest: (x, torch.ones_like(x, dtype=torch.bool))


@converter("Add", "Sub", "Mul", "Pow", "Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "And", "Or", "Xor", "Mod")
def _binary(n: NodeView):
    torch = _torch()
    if n.op == "Mod" and n.attr("fmod", 0):
        return lambda a, b: torch.fmod(a, b)
    f = {"Add": torch.add, "Sub": torch.sub, "Mul": torch.mul, "Pow": torch.pow, "Equal": torch.eq, "Less": torch.lt,
         "Greater": torch.gt, "LessOrEqual": torch.le, "GreaterOrEqual": torch.ge, "And": torch.logical_and,
         "Or": torch.logical_or, "Xor": torch.logical_xor, "Mod": torch.remainder}[n.op]
    if n.op == "Pow":
        b = n.inputs[1]
        if b.is_const and b.const.numel() == 1 and not n.inputs[0].dtype.is_floating_point:
            # an integer base keeps its dtype (ONNX: the output is the base's type); an integral exponent as an int,
            # so that torch computes in integers, not in float32 (which rounds past 2**24)
            e = b.const.reshape(-1)[0].item()
            e = int(e) if float(e).is_integer() else float(e)
            return lambda a, _b: torch.pow(a, e).to(a.dtype)
        if b.is_const and b.const.numel() == 1:
            e = float(b.const.reshape(-1)[0])
            if e == 2.0:
                return lambda a, _b: a * a
            if e == 0.5:
                return lambda a, _b: torch.sqrt(a)
            if e == 1.0:
                return lambda a, _b: a
            return lambda a, _b: torch.pow(a, e)
        return lambda a, b: torch.pow(a, b).to(a.dtype)
    return lambda a, b: f(a, b)


@converter("Div")
def _div(n: NodeView):
    torch = _torch()
    if not n.inputs[0].dtype.is_floating_point:
        return lambda a, b: torch.div(a, b, rounding_mode="trunc")
    return lambda a, b: torch.div(a, b)


@converter("Sum", "Max", "Min", "Mean")
def _variadic(n: NodeView):
    torch = _torch()
    f = {"Sum": torch.add, "Max": torch.maximum, "Min": torch.minimum, "Mean": torch.add}[n.op]
    k = len(n.inputs)

    def fn(*xs):
        y = xs[0]
        for x in xs[1:]:
            y = f(y, x)
        return y / k if n.op == "Mean" else y
    return fn


@converter("Gelu")
def _gelu(n: NodeView):
    F = _torch().nn.functional
    approx = n.attr("approximate", "none")
    return lambda x: F.gelu(x, approximate=approx)


@converter("HardSigmoid")
def _hsig(n):
    torch = _torch()
    a, b = float(n.attr("alpha", 0.2)), float(n.attr("beta", 0.5))
    return lambda x: torch.clamp(x * a + b, 0.0, 1.0)


@converter("Selu")
def _selu(n):
    """gamma·x above 0, gamma·alpha·(exp(x) - 1) at or below: Elu's curve scaled by gamma."""
    F = _torch().nn.functional
    a, g = float(n.attr("alpha", 1.67326319217681884765625)), float(n.attr("gamma", 1.05070102214813232421875))
    return lambda x: F.elu(x, a) * g


@converter("ThresholdedRelu")
def _thresholded_relu(n):
    """x where x > alpha, else 0 (``F.threshold``'s rule)."""
    F = _torch().nn.functional
    a = float(n.attr("alpha", 1.0))
    return lambda x: F.threshold(x, a, 0.0)


@converter("Shrink")
def _shrink(n):
    """x + bias below -lambd, x - bias above lambd, 0 between; an integer input keeps its dtype (the float bias
    computed, then cast back as ONNX Runtime does)."""
    torch = _torch()
    lambd, b = float(n.attr("lambd", 0.5)), float(n.attr("bias", 0.0))
    return lambda x: torch.where(x < -lambd, x + b, torch.where(x > lambd, x - b, torch.zeros_like(x))).to(x.dtype)


@converter("Clip")
def _clip(n: NodeView):
    torch = _torch()
    if n.opset < 11:
        lo, hi = n.attr("min", None), n.attr("max", None)
    else:
        # bounds as Python numbers of the input's kind: a float bound would promote an integer input to float
        num = float if n.inputs[0].dtype.is_floating_point else int
        lo = num(n.const(1).reshape(-1)[0].item()) if n.has_input(1) else None
        hi = num(n.const(2).reshape(-1)[0].item()) if n.has_input(2) else None
    return lambda x, *rest: torch.clamp(x, lo, hi)


@converter("Where")
def _where(n):
    torch = _torch()
    return lambda c, a, b: torch.where(c, a, b)


@converter("Cast")
def _cast(n: NodeView):
    to = int(n.attr("to"))
    if to not in ONNX_TO_TORCH_DTYPE:  # strings, float8 (and their saturate), 4-bit, complex, unsigned 16-64
        n.fail(f"Cast to {onnx.TensorProto.DataType.Name(to)} is not mapped")
    dt = torch_dtype(to)
    if dt.is_floating_point:
        dt = n.float_dtype
    return lambda x: x.to(dt)


@converter("CastLike")
def _castlike(n: NodeView):
    dt = n.inputs[1].dtype
    return lambda x, like: x.to(dt)


# -- linear algebra --------------------------------------------------------------

@converter("MatMul")
def _matmul(n):
    """X·W; with X of rank 3 or more and W 2-d, as one matrix product over X's rows (leading dimensions
    flattened by ``reshape``), which is what torch's Linear runs.  ``torch.matmul`` folds those dimensions only
    when they are contiguous in memory, and else broadcasts W and runs a batched product: a transposed X, as
    ``nn.MultiheadAttention(batch_first=True)`` exports its input projection (X [L, 1, E], a view of [1, L, E]),
    became L matrix-vector products that each read the whole weight (ViT-B/16 on the H100, fp16, batch 1: one
    "384x8" cuBLAS kernel of 70 µs per layer, half the model's time; bench/kernel_profile.py --against-compile)."""
    torch = _torch()
    if n.rank(0) >= 3 and n.rank(1) == 2:
        return _product_over_rows(n)
    return lambda a, b: torch.matmul(a, b)


def _product_over_rows(n: NodeView):
    """X·W for X [..., K] and W [K, N] as one [rows, K]·[K, N] product, reshaped back (``_matmul``)."""
    torch = _torch()
    (k, cols), rows = n.shape(1), n.shape(0)[:-1]
    return lambda a, b: torch.matmul(a.reshape(-1, k), b).reshape(*rows, cols)


@converter("Gemm")
def _gemm(n: NodeView):
    torch = _torch()
    F = torch.nn.functional
    alpha, beta = float(n.attr("alpha", 1.0)), float(n.attr("beta", 1.0))
    ta, tb = int(n.attr("transA", 0)), int(n.attr("transB", 0))
    has_c = n.has_input(2)
    if n.one_row_reduction:  # (``one_row_linears``: alpha = beta = 1, transB = 1, A [1, K], B [N, K], C [N])
        def reduced(a, b, c):
            return ((a * b).sum(-1, dtype=torch.float32) + c.reshape(-1)).to(a.dtype).reshape(1, -1)

        return reduced
    if alpha == 1.0 and beta == 1.0 and not ta and tb:
        return lambda a, b, c=None: F.linear(a, b, c)

    def fn(a, b, c=None):
        a = a.t() if ta else a
        b = b.t() if tb else b
        y = torch.matmul(a, b)
        if alpha != 1.0:
            y = y * alpha
        if has_c and c is not None:
            y = y + (c * beta if beta != 1.0 else c)
        return y
    return fn


def _pads_split(pads: list[int], nd: int):
    return pads[:nd], pads[nd:]


def _same_pads(in_spatial, kernel, strides, dilations, mode):
    begin, end = [], []
    for i, k, s, d in zip(in_spatial, kernel, strides, dilations):
        out = -(-i // s)
        total = max(0, (out - 1) * s + (k - 1) * d + 1 - i)
        small, big = total // 2, total - total // 2
        if mode == "SAME_UPPER":
            begin.append(small)
            end.append(big)
        else:
            begin.append(big)
            end.append(small)
    return begin + end


def _torch_pad_arg(begin, end):
    """F.pad takes the last dimension first."""
    out = []
    for b, e in zip(reversed(begin), reversed(end)):
        out += [b, e]
    return out


@converter("Conv")
def _conv(n: NodeView):
    torch = _torch()
    F = torch.nn.functional
    w_shape = n.shape(1)
    nd = len(w_shape) - 2
    kernel = list(n.attr("kernel_shape", w_shape[2:]))
    strides = list(n.attr("strides", [1] * nd))
    dil = list(n.attr("dilations", [1] * nd))
    group = int(n.attr("group", 1))
    auto_pad = n.attr("auto_pad", "NOTSET")
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        pads = _same_pads(n.shape(0)[2:], kernel, strides, dil, auto_pad)
    elif auto_pad == "VALID":
        pads = [0] * (2 * nd)
    else:
        pads = list(n.attr("pads", [0] * (2 * nd)))
    begin, end = _pads_split(pads, nd)
    fconv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}.get(nd)
    if fconv is None:
        n.fail(f"{nd}-d convolution")
    if n.patch_gemm:
        patches = _conv_as_patch_gemm(n.shape(0), w_shape, kernel, strides, dil, group, pads)
        if patches is not None:
            return patches
    if n.conv_kernels == "inductor" and nd == 2:
        lowered = _conv_as_kernels(n.shape(0), w_shape, kernel, strides, dil, group, begin, end)
        if lowered is not None:
            return lowered
    if n.conv_kernels == "triton" and nd == 2:
        own = _TritonConv.of(n.shape(0), w_shape, kernel, strides, dil, group, begin, end)
        if own is not None:
            return own
    if n.conv_kernels == "native" and nd == 2:
        native = _conv_native_depthwise(n.shape(0), w_shape, kernel, strides, dil, group, begin, end)
        if native is not None:
            return native
    if n.conv_kernels == "planned" and nd == 2:  # cuDNN through plans a bundle ships (``cudnn_plans``)
        if begin == end:
            return _ConvFn(fconv, strides, begin, dil, group, nd, planned=True)
        return _ConvFn(fconv, strides, [0, 0], dil, group, nd, planned=True, pre_pad=_torch_pad_arg(begin, end))
    if begin == end:
        return _ConvFn(fconv, strides, begin, dil, group, nd)
    pad = _torch_pad_arg(begin, end)
    return lambda x, w, b=None: fconv(F.pad(x, pad), w, b, strides, 0, dil, group)


#: the most input channels a convolution over non-overlapping patches is run as one matrix product for
#: (``_conv_as_patch_gemm``): an image's 3 (RGB) or 4 (RGBA) channels
PATCH_GEMM_MAX_CHANNELS = 4


def _conv_as_patch_gemm(x_shape, w_shape, kernel, strides, dil, group, pads):
    """A 2-d convolution over non-overlapping patches (kernel = strides, no padding or dilation, one group) of an
    input with at most ``PATCH_GEMM_MAX_CHANNELS`` channels, as one matrix product: the patches [N·Ho·Wo, C·kh·kw]
    (a reshape and permute of the input; rows and columns past the last whole patch dropped, as the convolution
    drops them) times the weight [O, C·kh·kw] transposed, plus the bias, viewed as [N, O, Ho, Wo].  None for any
    other convolution.

    This is the patch embedding of vision transformers and ConvNeXt-style stems (16x16 at stride 16, 4x4 at
    stride 4, on an RGB image).  cuDNN runs it on a 3-channel input as an implicit GEMM with a reduction of only
    3 channels per tap, in a kernel for unaligned channels: ViT-B/16's 16x16 patch embedding took 63.4 µs of its
    engine's 515 µs of kernels (H200, fp16, batch 1, bench/kernel_profile.py; torch.compile's cuDNN call 82.8 µs plus a
    13.2 µs layout copy), the largest single kernel of the engine.  As a product its reduction is C·kh·kw = 768
    deep, cuBLAS's shape; the patches are one copy of the input, which Inductor writes in the kernel that casts
    the engine's input.  The weight [O, C, kh, kw] is contiguous, so its [O, C·kh·kw] form is a view (torch's
    Linear layout, cuBLAS's "TN" product)."""
    torch = _torch()
    if len(kernel) != 2 or group != 1 or list(kernel) != list(strides) or any(d != 1 for d in dil) or any(pads):
        return None
    if len(x_shape) != 4 or any(int(d) < 1 for d in x_shape) or x_shape[1] > PATCH_GEMM_MAX_CHANNELS:
        return None
    n, c, h, w = (int(d) for d in x_shape)
    kh, kw = (int(k) for k in kernel)
    ho, wo, o, k = h // kh, w // kw, int(w_shape[0]), c * kh * kw
    if ho < 1 or wo < 1 or int(w_shape[1]) != c:
        return None

    def patch_gemm(x, wt, b=None):
        p = x[:, :, :ho * kh, :wo * kw].reshape(n, c, ho, kh, wo, kw).permute(0, 2, 4, 1, 3, 5).reshape(-1, k)
        wm = wt.reshape(o, k).t()
        y = p @ wm if b is None else torch.addmm(b, p, wm)
        return y.reshape(n, ho, wo, o).permute(0, 3, 1, 2)

    patch_gemm.patch_gemm = True
    return patch_gemm


#: depthwise kernels of up to this many taps run as a sum of their taps written out in one Inductor kernel: the
#: engines that lower depthwise convolutions are compiled with Inductor's ``unroll_reductions_threshold`` one
#: above it (``torch._lowering_configs``), which writes out each such convolution's reduction over its taps.
#: Larger kernels run as a loop over ``F.unfold``'s columns.  Measured on the H200 (fp16, batch 1,
#: bench/depthwise_forms.py, each form's engine timed against the cuDNN form's in one process): written out,
#: MixNet-S ran 0.716 of its cuDNN form and EfficientNet-B0 1.048, against 0.734 and 1.134 as loops over the
#: windows; beyond, ConvNeXt-T's 7x7 kernels ran 1.107 as ``F.unfold``'s loop and 1.150 as the windows'.  No more
#: taps are written out because Inductor's compile grows steeply with a sum's terms: NASNet-A Large's 7x7 kernels
#: as 49-term sums (of shifted slices, the form before) took its build from 76 s to 237 s.
UNROLLED_TAPS = 25


def _conv_as_kernels(x_shape, w_shape, kernel, strides, dil, group, begin, end):
    """A 2-d depthwise convolution written as ops that Inductor compiles into its own kernel, or None for any other
    convolution.

    Why: torch runs every convolution through cuDNN, which builds an execution plan for each convolution shape at
    its first call in every process (15-45 ms for a depthwise one, against ~4 ms for a dense 3x3:
    docs/torch-engines.md, "Fresh-process load"), so a bundle of a depthwise-separable network spends seconds of
    every instance start building plans.  Written as one reduction over its taps, a depthwise convolution is one
    Triton kernel with the bias and whatever follows as its epilogue, shipped compiled: up to ``UNROLLED_TAPS``
    taps a reduction over the padded input's windows (a view: ``Tensor.unfold`` on both spatial dimensions),
    which Inductor writes out as a sum, and beyond, over ``F.unfold``'s columns (which Inductor fuses into the
    reduction's loads).  A few ops per convolution, whatever its kernel: the sum of k*k shifted slices the
    windows replaced gave Inductor ~7 ops per tap to trace, lower, fuse and generate, and MixNet-S's engine took
    50.6 s to compile against 28.3 s this way (alone, in caches its cuDNN form's compile had filled), and ran 2%
    slower (H200, bench/depthwise_forms.py).
    1x1 convolutions stay cuDNN's: as matrix products they saved no load time and ran slower (NASNet-A Large 2.4
    against 1.5 ms).  Whether a bundle is faster this way or with cuDNN is timed on the GPU
    (``BuildOptions.conv_kernels``).
    """
    torch = _torch()
    F = torch.nn.functional
    n, c, h, w = (int(d) for d in x_shape)
    kh, kw = (int(k) for k in kernel)
    sh, sw = (int(s) for s in strides)
    if any(int(d) != 1 for d in dil) or not (group == c == int(w_shape[0]) and int(w_shape[1]) == 1 and kh * kw > 1):
        return None
    ho = (h + begin[0] + end[0] - kh) // sh + 1
    wo = (w + begin[1] + end[1] - kw) // sw + 1
    pad = _torch_pad_arg(begin, end)
    padded = any(begin) or any(end)
    symmetric = begin == end

    def depthwise_windows(x, weight, bias=None):
        if padded:
            x = F.pad(x, pad)
        windows = x.unfold(2, kh, sh).unfold(3, kw, sw)  # [n, c, ho, wo, kh, kw]
        y = (windows * weight.view(1, c, 1, 1, kh, kw)).sum((4, 5))
        return y if bias is None else y + bias.view(1, c, 1, 1)

    def depthwise_columns(x, weight, bias=None):
        if not symmetric:
            x = F.pad(x, pad)
        cols = F.unfold(x, (kh, kw), 1, tuple(begin) if symmetric else 0, (sh, sw)).view(n, c, kh * kw, ho * wo)
        y = (cols * weight.reshape(1, c, kh * kw, 1)).sum(2)
        if bias is not None:
            y = y + bias.reshape(1, c, 1)
        return y.view(n, c, ho, wo)

    return depthwise_windows if kh * kw <= UNROLLED_TAPS else depthwise_columns


class _TritonConv:
    """A 2-d depthwise or narrow-group convolution as parastream's own Triton kernel (``conv_triton``,
    ``torch.ops.parastream.grouped_conv2d``), channels-last out.  ``stored``: the step's weight is kept
    taps-major ([kh·kw·CIG, K], ``_conv_taps_major``), as the kernel reads it; otherwise it is rearranged at
    every call."""

    def __init__(self, kernel, strides, pads, dil, group: int, stored: bool = False):
        self.kernel, self.strides, self.pads, self.dil, self.group, self.stored = (kernel, strides, pads, dil,
                                                                                   group, stored)
        from . import conv_triton

        conv_triton.register_op()

    @classmethod
    def of(cls, x_shape, w_shape, kernel, strides, dil, group, begin, end):
        """The step for a convolution the kernel takes (``conv_triton.takes``: depthwise, or at most
        ``conv_triton.MAX_GROUP_WIDTH`` input channels a group), or None for any other."""
        from .conv_triton import takes

        if not takes(int(x_shape[1]), w_shape, int(group)):
            return None
        return cls([int(k) for k in kernel], [int(v) for v in strides],
                   [int(begin[0]), int(begin[1]), int(end[0]), int(end[1])], [int(v) for v in dil], int(group))

    def stored_form(self) -> "_TritonConv":
        return _TritonConv(self.kernel, self.strides, self.pads, self.dil, self.group, stored=True)

    def __call__(self, x, w, b=None):
        from .conv_triton import taps_major

        torch = _torch()
        wt = w if self.stored else taps_major(w)
        return torch.ops.parastream.grouped_conv2d(x, wt, b, self.kernel, self.strides, self.pads, self.dil,
                                                   self.group)


def constant_uses(steps: list) -> dict[str, list[tuple[int, int]]]:
    """{constant buffer: [(step index, argument index), ...]} of every step argument that is a constant."""
    uses: dict[str, list[tuple[int, int]]] = {}
    for i, st in enumerate(steps):
        for j, a in enumerate(st.args):
            if a is not None and a[0] == "c":
                uses.setdefault(a[1], []).append((i, j))
    return uses


def _conv_taps_major(steps: list, consts: dict, keep: set[str]) -> int:
    """The constant weight of each ``_TritonConv`` step stored taps-major, and the step the one that takes it so:
    otherwise every call rearranges it, a kernel on the weight alone at every replay.  Only weights no other step
    reads and no graph output is (``keep``); returns how many."""
    from .conv_triton import taps_major

    done = 0
    for key, where in constant_uses(steps).items():
        if key in keep or not all(j == 1 and isinstance(steps[i].fn, _TritonConv) for i, j in where):
            continue
        consts[key] = taps_major(consts[key])
        for i, _ in where:
            st = steps[i]
            steps[i] = Step(st.fn.stored_form(), st.args, st.outputs, st.node)
        done += 1
    return done


def _conv_native_depthwise(x_shape, w_shape, kernel, strides, dil, group, begin, end):
    """A 2-d depthwise convolution as torch's own CUDA depthwise kernel (``aten._conv_depthwise2d``, on NCHW
    tensors), or None for any other convolution.

    Why: torch's convolution sends a channels-last depthwise convolution to cuDNN, which builds an execution plan
    for each shape at its first call in every process; torch's own kernel is compiled into torch and starts at
    once.  NASNet-A Large's 23 depthwise shapes (H100, fp16, each alone in a CUDA Graph,
    bench/depthwise_kernels.py): cuDNN's first calls 7.26 s in all, torch's 8 ms; per forward pass 1156 µs with
    cuDNN's kernels and 1194 µs with torch's (faster on 12 of the 23 shapes).  Its input is made contiguous
    (Inductor writes the producer's output so, where it can); its output is NCHW, and Inductor lays out what
    reads it.  Whether a bundle is faster this way is for the timing to say (``BuildOptions.conv_kernels``)."""
    torch = _torch()
    F = torch.nn.functional
    c_in = int(x_shape[1])
    kh, kw = (int(k) for k in kernel)
    if any(int(d) != 1 for d in dil) or not (group == c_in == int(w_shape[0]) and int(w_shape[1]) == 1 and kh * kw > 1):
        return None
    stride = [int(s) for s in strides]
    symmetric = begin == end
    padding = [int(p) for p in begin] if symmetric else [0, 0]
    pad = None if symmetric else _torch_pad_arg(begin, end)
    _depthwise_shape_function()
    native = torch.ops.aten._conv_depthwise2d

    def depthwise(x, weight, bias=None):
        if pad is not None:
            x = F.pad(x, pad)
        return native(x.contiguous(), weight.contiguous(), [kh, kw], bias, stride, padding, [1, 1])

    return depthwise


_DEPTHWISE_META: list = []  # the library that holds the shape function, once registered (kept alive)


def _depthwise_shape_function() -> None:
    """Give ``aten._conv_depthwise2d`` the shape function torch lacks (it has a CUDA kernel and no Meta kernel),
    so that the converter's check and Inductor's trace, which run on tensors without data, can run it; Inductor
    then calls the op itself.  Registered once per process (the compile workers register it when they convert),
    and not where torch has one of its own."""
    if _DEPTHWISE_META:
        return
    torch = _torch()
    if torch._C._dispatch_has_kernel_for_dispatch_key("aten::_conv_depthwise2d", "Meta"):
        _DEPTHWISE_META.append(None)
        return
    lib = torch.library.Library("aten", "IMPL")

    def shape(x, weight, kernel_size, bias, stride, padding, dilation):
        n, _, h, w = x.shape
        ho = (h + 2 * padding[0] - dilation[0] * (kernel_size[0] - 1) - 1) // stride[0] + 1
        wo = (w + 2 * padding[1] - dilation[1] * (kernel_size[1] - 1) - 1) // stride[1] + 1
        return x.new_empty((n, weight.shape[0], ho, wo))

    lib.impl("_conv_depthwise2d", shape, "Meta")
    _DEPTHWISE_META.append(lib)


def depthwise_convs(model: onnx.ModelProto) -> set[int]:
    """The indices of ``model``'s nodes that ``conv_kernels`` "inductor" or "native" lowers: 2-d depthwise
    convolutions (weight an initializer [C, 1, kh, kw] with kh*kw > 1, group C, no dilation).  The converter lowers these and
    no others, so that whether an engine changes with the option is read from its ONNX alone (its cache key)."""
    weights = {t.name: list(t.dims) for t in model.graph.initializer}
    found = set()
    for i, n in enumerate(model.graph.node):
        if n.op_type != "Conv" or len(n.input) < 2 or n.input[1] not in weights:
            continue
        dims = weights[n.input[1]]
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        if (len(dims) == 4 and dims[1] == 1 and int(attrs.get("group", 1)) == dims[0] > 1 and dims[2] * dims[3] > 1
                and all(int(d) == 1 for d in attrs.get("dilations", [1, 1]))):
            found.add(i)
    return found


def has_depthwise_conv(model: onnx.ModelProto) -> bool:
    """Whether ``conv_kernels="inductor"`` changes ``model``'s engine (``depthwise_convs``)."""
    return bool(depthwise_convs(model))


def triton_convs(model: onnx.ModelProto) -> set[int]:
    """The indices of ``model``'s nodes that ``conv_kernels`` "triton" runs as parastream's Triton kernel: 2-d
    convolutions of more than one group whose weight is an initializer and that ``conv_triton.takes``
    (depthwise ones among them), their input's channels known.  Read from the ONNX alone, as ``depthwise_convs``
    is (the engines' cache key)."""
    from .conv_triton import takes

    weights = {t.name: list(t.dims) for t in model.graph.initializer}
    channels = {vi.name: vi.type.tensor_type.shape.dim[1].dim_value
                for vi in list(model.graph.input) + list(model.graph.value_info)
                if vi.type.HasField("tensor_type") and len(vi.type.tensor_type.shape.dim) == 4}
    found = set()
    for i, n in enumerate(model.graph.node):
        if n.op_type != "Conv" or len(n.input) < 2 or n.input[1] not in weights:
            continue
        dims = weights[n.input[1]]
        group = int(next((helper.get_attribute_value(a) for a in n.attribute if a.name == "group"), 1))
        if len(dims) == 4 and group > 1 and takes(channels.get(n.input[0]) or group * dims[1], dims, group):
            found.add(i)
    return found


def lowered_convs(model: onnx.ModelProto, conv_kernels: str) -> set[int]:
    """The indices of ``model``'s nodes that ``conv_kernels`` runs otherwise than as cuDNN's convolution."""
    if conv_kernels == "triton":
        return triton_convs(model)
    return depthwise_convs(model) if conv_kernels in LOWERED_CONV_KERNELS else set()


def conv_kernels_change(model: onnx.ModelProto, conv_kernels: str | None = None) -> bool:
    """Whether ``conv_kernels`` (None: any of the values that lower convolutions) changes ``model``'s engine."""
    if conv_kernels is None:
        return bool(triton_convs(model))  # (a superset of the depthwise convolutions the others lower)
    return bool(lowered_convs(model, conv_kernels))


def has_conv_relu(model: onnx.ModelProto) -> bool:
    """Whether a Conv's output is read by one Relu only, or by one Add whose sum one Relu alone reads (what cuDNN's
    fused conv + bias (+ residual) + ReLU runs: ``cudnn_fused.conv_relu_sites``)."""
    from .cudnn_fused import conv_relu_sites

    return bool(conv_relu_sites(model))


def has_planned_epilogue(model: onnx.ModelProto) -> bool:
    """Whether a Conv's output only its SiLU (a Sigmoid of it and the Mul of the two) reads, or only a residual Add
    that no Relu alone follows: the epilogues ``fuse_conv_plans`` runs in one cuDNN plan (``_fuse_conv_silu``,
    ``_fuse_conv_add``)."""
    from .cudnn_fused import PLANNED_KINDS, conv_relu_sites

    return any(kind in PLANNED_KINDS for _, kind, _ in conv_relu_sites(model))


def may_fuse_conv_relu(model: onnx.ModelProto) -> bool:
    """Whether ``fuse_conv_relu`` can change ``model``'s engine: it has a Conv and a Relu, Sigmoid or Add node, one
    of which every fusion ``convert`` makes (conv + ReLU, conv + residual Add (+ ReLU), conv + SiLU) needs.
    Broader than the fusions themselves (``has_conv_relu``, the pattern a GPU build's conv+ReLU round races) on
    purpose: a model without both converts to the same module either way, whatever its other nodes."""
    ops = {n.op_type for n in model.graph.node}
    return "Conv" in ops and bool(ops & {"Relu", "Sigmoid", "Add"})


def has_fused_attention(model: onnx.ModelProto) -> bool:
    """Whether ``model`` has an attention node (rewrite rule fuse_attention: ONNX's Attention or parastream's own):
    the nodes ``fuse_attention`` converts one way or the other."""
    return any((n.domain in ("", "ai.onnx") and n.op_type == "Attention")
               or (n.domain == fused_ops.DOMAIN and n.op_type == fused_ops.SDPA) for n in model.graph.node)


def one_row_linears(model: onnx.ModelProto) -> set[int]:
    """The indices of ``model``'s ``Gemm`` nodes that are a Linear of one row (a classifier head, a pooler at
    batch 1): alpha = beta = 1, transA = 0, transB = 1, A of static shape [1, K] in the model's value_info or
    inputs, B an initializer [N, K], C an initializer of N values.  A CUDA engine runs such a node with its bias in cuBLAS's epilogue (``F.linear``) or,
    where the GEMM epilogue is off (``fuse_gemm_epilogue``; the build's "GEMM epilogue" round times the two), as
    one Inductor reduction with the bias (``one_row_reduction``).

    Why: cuBLAS runs a matrix-vector product as a GEMM whose tile covers the one row and 64 outputs, so few
    blocks read the whole weight: ResNet-50's head ([1, 2048] x [2048, 1000], 4 MB) took 13.1 µs, where one
    Inductor reduction took 2.0 µs (H200, fp16, bench/few_rows.py).  Which is faster depends on the shape
    (ViT-B/16's [768, 1000] head: cuBLAS 6.7 µs, the reduction 9.4; NASNet-A Large's [4032, 1000]: 8.1 against
    22.0), hence timed, not assumed.  The converter reduces these nodes and no others, so that whether an engine
    changes with the option is read from its ONNX alone (its cache key)."""
    g = model.graph
    weights = {t.name: list(t.dims) for t in g.initializer}
    gemms = []
    for i, n in enumerate(g.node):
        if n.op_type != "Gemm" or n.domain not in ("", "ai.onnx") or len(n.input) < 3:
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        b, c = weights.get(n.input[1]), weights.get(n.input[2])
        if (float(attrs.get("alpha", 1.0)) == 1.0 and float(attrs.get("beta", 1.0)) == 1.0
                and not int(attrs.get("transA", 0)) and int(attrs.get("transB", 0)) and b is not None
                and len(b) == 2 and c and c[-1] == b[0] and int(np.prod(c, dtype=np.int64)) == b[0]):
            gemms.append((i, n.input[0], b[1]))
    if not gemms:
        return set()
    # A's shape as the model holds it (a build's branches carry their inferred shapes); not inferred here, which
    # would copy every weight of a large model at each call (NASNet-A Large: 1.8-4.6 s)
    known = static_shapes([*g.input, *g.value_info, *g.output])
    return {i for i, a, k in gemms if known.get(a) == (1, k)}


def static_shapes(value_infos) -> dict[str, tuple[int, ...]]:
    """Name -> shape of each of ``value_infos`` whose every dimension is a number."""
    out = {}
    for vi in value_infos:
        t = vi.type.tensor_type
        if t.HasField("shape") and all(d.HasField("dim_value") for d in t.shape.dim):
            out[vi.name] = tuple(int(d.dim_value) for d in t.shape.dim)
    return out


def has_fused_gemm(model: onnx.ModelProto) -> bool:
    """Whether ``model`` has a matmul-bias-activation node (rewrite rules fuse_gemm_epilogue, fuse_gemm_bias)."""
    return any(n.domain == fused_ops.DOMAIN and n.op_type == fused_ops.GEMM_ACTIVATION for n in model.graph.node)


def has_gemm_epilogue(model: onnx.ModelProto) -> bool:
    """Whether ``model`` has a matmul-bias-activation node (``has_fused_gemm``) or a Linear of one row
    (``one_row_linears``): the nodes ``fuse_gemm_epilogue`` converts one way or the other."""
    return has_fused_gemm(model) or bool(one_row_linears(model))


class _ConvFn:
    """A convolution with symmetric padding; ``relu_fused()`` gives cuDNN's conv + bias + ReLU in one kernel,
    ``add_relu_fused()`` cuDNN's conv + bias + residual + ReLU.  ``planned``: a 2-d convolution run through
    ``torch.ops.parastream.cudnn_conv2d`` (cuDNN's plans built once and shipped in the engine, ``cudnn_plans``),
    its bias added after it or, fused with a ReLU, in the same kernel."""

    def __init__(self, fconv, strides, padding, dilations, group, nd, planned: bool = False, pre_pad=None):
        self.fconv, self.strides, self.padding, self.dilations, self.group, self.nd = fconv, strides, padding, dilations, group, nd
        self.planned, self.pre_pad = planned, pre_pad  # (pre_pad: asymmetric pads, applied first; planned only)
        if planned:
            from .cudnn_plans import register_op

            register_op()

    def _planned(self, x, w, b, relu: bool, act: str | None = None, z=None):
        torch = _torch()
        if self.pre_pad is not None:
            x = torch.nn.functional.pad(x, self.pre_pad)
        # The op's plan reads a dense channels-last tensor; asked for here, in the graph Inductor compiles, a copy
        # (a channel slice of a mixed-kernel block's input) is written by the kernel that produces it, where the
        # op would otherwise copy it in a kernel of its own at every call. (A no-op where x is already so.)
        x = x.contiguous(memory_format=torch.channels_last)
        if act is None and z is None:  # (the call as engines compiled before ``act`` and ``z`` existed make it)
            return torch.ops.parastream.cudnn_conv2d(x, w, b, self.strides, self.padding, self.dilations, self.group,
                                                     relu)
        if z is not None:  # (channels-last as the plan reads it, written so by the kernel that produces it)
            z = z.contiguous(memory_format=torch.channels_last)
        return torch.ops.parastream.cudnn_conv2d(x, w, b, self.strides, self.padding, self.dilations, self.group,
                                                 relu, act, z)

    def __call__(self, x, w, b=None):
        if self.planned:
            y = self._planned(x, w, None, False)
            return y if b is None else y + b.reshape(1, -1, 1, 1)
        return self.fconv(x, w, b, self.strides, self.padding, self.dilations, self.group)

    def relu_fused(self):
        torch = _torch()
        strides, padding, dilations, group = self.strides, self.padding, self.dilations, self.group
        if self.planned:
            def fused(x, w, b=None):
                return self._planned(x, w, b, True)

            fused.planned = True
            return fused
        # x asked for channels-last, the layout the fused kernel reads with its channels-last weight, in the graph
        # Inductor compiles: where x is not (a graph's NCHW input, cast to the compute dtype), the producing kernel
        # writes it so, where the op would copy it in an aten kernel of its own (ResNet-50's stem: the cast 1.5 µs
        # and that copy 2.7 µs, H200).  A no-op where x already is channels-last.  The op is parastream's
        # (``cudnn_fused``), whose layout Inductor keeps: torch's own it lays out as it likes.
        _register_fused_conv_ops()
        return lambda x, w, b=None: torch.ops.parastream.conv2d_relu(
            x.contiguous(memory_format=torch.channels_last), w, b, strides, padding, dilations, group)

    def relu_fused_padded(self, channels: int, padded: int, out: int, padded_out: int):
        """``relu_fused`` with the input's ``channels`` padded with zero channels up to ``padded`` (in the graph
        Inductor compiles, so that the kernel producing the input writes it so where it can) and the output's first
        ``out`` of its ``padded_out`` channels taken (a view): the weights and bias are stored padded
        (``_fuse_conv_relu``), their new rows and columns zero, so that the new input channels add nothing and the
        new output channels are relu(0) = 0 and dropped.  ``cudnn_fused.padded_channels`` says why and when."""
        torch = _torch()
        strides, padding, dilations, group = self.strides, self.padding, self.dilations, self.group
        extra = padded - channels
        _register_fused_conv_ops()

        def fused(x, w, b=None):
            if extra:
                x = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, extra))
            y = torch.ops.parastream.conv2d_relu(x.contiguous(memory_format=torch.channels_last), w, b, strides,
                                                 padding, dilations, group)
            return y if padded_out == out else y[:, :out]

        return fused

    def swish_fused(self):
        """silu(conv(x, w) + b) as one cuDNN plan (conv + bias + SWISH_FWD, ``cudnn_plans.conv2d(act="swish")``),
        dense or depthwise: no torch op runs a convolution's SiLU in its kernel, so every such convolution goes
        through the plans' op, whose runtime-compiled kernel the engine ships."""
        from .cudnn_plans import register_op

        register_op()

        def fused(x, w, b=None):
            return self._planned(x, w, b, False, "swish")

        fused.planned = True
        return fused

    def add_fused(self):
        """conv(x, w) + b + z, z a residual of the output's shape, as one cuDNN plan (conv + bias + add,
        ``cudnn_plans.conv2d(z=...)``): the add of an inverted residual's projection, which no torch op fuses into
        the convolution (``torch.cudnn_convolution_add_relu`` always applies its ReLU)."""
        from .cudnn_plans import register_op

        register_op()

        def fused(x, w, z, b=None):
            return self._planned(x, w, b, False, None, z)

        fused.planned = True
        return fused

    def add_relu_fused(self):
        """relu(conv(x, w) + z + b) as one cuDNN call (``torch.cudnn_convolution_add_relu``, alpha 1 on z); x and
        z asked for channels-last as ``relu_fused`` asks for x."""
        torch = _torch()
        strides, padding, dilations, group = self.strides, self.padding, self.dilations, self.group
        last = torch.channels_last
        _register_fused_conv_ops()
        return lambda x, w, z, b=None: torch.ops.parastream.conv2d_add_relu(
            x.contiguous(memory_format=last), w, z.contiguous(memory_format=last), b, strides, padding, dilations,
            group)


def _register_fused_conv_ops() -> None:
    from .cudnn_fused import register_ops

    register_ops()


@converter("ConvTranspose")
def _convt(n: NodeView):
    F = _torch().nn.functional
    w_shape = n.shape(1)
    nd = len(w_shape) - 2
    strides = list(n.attr("strides", [1] * nd))
    dil = list(n.attr("dilations", [1] * nd))
    group = int(n.attr("group", 1))
    out_pad = list(n.attr("output_padding", [0] * nd))
    pads = list(n.attr("pads", [0] * (2 * nd)))
    if n.attr("auto_pad", "NOTSET") not in ("NOTSET", "VALID") or n.attrs.get("output_shape") is not None:
        n.fail("auto_pad SAME / output_shape")
    begin, end = _pads_split(pads, nd)
    if begin != end or nd != 2:
        n.fail("asymmetric pads or non-2-d transposed convolution")
    return lambda x, w, b=None: F.conv_transpose2d(x, w, b, strides, begin, out_pad, group, dil)


@converter("BatchNormalization")
def _bn(n: NodeView):
    F = _torch().nn.functional
    eps = float(n.attr("epsilon", 1e-5))
    if n.attr("training_mode", 0):
        n.fail("training_mode=1")
    return lambda x, s, b, m, v: F.batch_norm(x, m, v, s, b, False, 0.0, eps)


@converter("InstanceNormalization")
def _in(n: NodeView):
    F = _torch().nn.functional
    eps = float(n.attr("epsilon", 1e-5))
    return lambda x, s, b: F.instance_norm(x, weight=s, bias=b, eps=eps)


@converter("LayerNormalization")
def _ln(n: NodeView):
    F = _torch().nn.functional
    r = n.rank(0)
    axis = int(n.attr("axis", -1)) % r
    eps = float(n.attr("epsilon", 1e-5))
    norm_shape = list(n.shape(0)[axis:])
    if not any(n.node.output[1:]):
        return lambda x, s, b=None: F.layer_norm(x, norm_shape, s, b, eps)
    if int(n.attr("stash_type", 1)) != 1:
        n.fail(f"stash_type {n.attr('stash_type')} with the Mean/InvStdDev outputs is not mapped")
    torch = _torch()
    dims = tuple(range(axis, r))

    def with_stats(x, s, b=None):
        """The optional outputs too: the mean and 1/sqrt(var + epsilon) over the normalized axes, kept as axes of
        one, in float32 (stash_type 1)."""
        var, mean = torch.var_mean(x.float(), dim=dims, correction=0, keepdim=True)
        return F.layer_norm(x, norm_shape, s, b, eps), mean, torch.rsqrt(var + eps)

    return with_stats


@converter("GroupNormalization")
def _gn(n: NodeView):
    """Statistics per instance per group of channels.  Opset 18 scales and shifts per group (scale and bias of
    shape [num_groups], repeated over each group's channels; ONNX deprecated that form); opset 21 per channel,
    the normalization computed in ``stash_type`` (float32 by default; float64 too) and cast back before the
    scale and shift.  A half-precision stash_type is refused: ONNX rounds every step of its statistics there."""
    torch = _torch()
    F = torch.nn.functional
    g = int(n.attr("num_groups"))
    eps = float(n.attr("epsilon", 1e-5))
    if n.opset < 21:
        reps = n.shape(0)[1] // g
        return lambda x, s, b: F.group_norm(x, g, s.repeat_interleave(reps), b.repeat_interleave(reps), eps)
    stash = int(n.attr("stash_type", 1))
    sdt = {1: torch.float32, 11: torch.float64}.get(stash)
    if sdt is None:
        n.fail(f"stash_type {stash} is not mapped (float32 and float64 statistics are)")
    if n.inputs[0].dtype == sdt:
        return lambda x, s, b: F.group_norm(x, g, s, b, eps)
    per_channel = [-1] + [1] * (n.rank(0) - 2)
    return lambda x, s, b: (F.group_norm(x.to(sdt), g, None, None, eps).to(x.dtype) * s.reshape(per_channel)
                            + b.reshape(per_channel))


# -- pooling -------------------------------------------------------------------

def _pool_params(n: NodeView):
    nd = n.rank(0) - 2
    kernel = list(n.attr("kernel_shape"))
    strides = list(n.attr("strides", [1] * nd))
    dil = list(n.attr("dilations", [1] * nd))
    auto_pad = n.attr("auto_pad", "NOTSET")
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        pads = _same_pads(n.shape(0)[2:], kernel, strides, dil, auto_pad)
    elif auto_pad == "VALID":
        pads = [0] * (2 * nd)
    else:
        pads = list(n.attr("pads", [0] * (2 * nd)))
    begin, end = _pads_split(pads, nd)
    return nd, kernel, strides, dil, begin, end, bool(n.attr("ceil_mode", 0))


def _torch_takes_pads(begin, end, kernel) -> bool:
    """Whether torch's pooling takes these pads itself: symmetric, and at most half the kernel."""
    return begin == end and all(2 * p <= k for p, k in zip(begin, kernel))


def _cropped(pool: Callable, crop) -> Callable:
    """``pool`` whose output is cut by ``crop`` (``_ceil_crop``; None: as it is)."""
    if crop is None:
        return pool
    return lambda x: pool(x)[crop]


def _ceil_crop(n: NodeView, kernel, strides, dil, begin, end, ceil):
    """The index that cuts a pooling of an input padded by ``F.pad`` to ONNX's output size.  With ceil_mode, ONNX
    (and torch) drop a last window that would start in the end padding; torch, handed the pads as input, keeps
    it (a window of -inf, or of zeros averaged).  None where nothing is cut (no ceil_mode)."""
    if not ceil:
        return None
    out = []
    for i, k, s, d, b, e in zip(n.shape(0)[2:], kernel, strides, dil, begin, end):
        o = -(-(i + b + e - (k - 1) * d - 1) // s) + 1
        out.append(o - 1 if (o - 1) * s >= i + b else o)
    return (slice(None), slice(None), *(slice(0, o) for o in out))


@converter("MaxPool")
def _maxpool(n: NodeView):
    F = _torch().nn.functional
    nd, kernel, strides, dil, begin, end, ceil = _pool_params(n)
    fpool = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}[nd]
    own_pads = _torch_takes_pads(begin, end, kernel)
    if len(n.node.output) > 1 and n.node.output[1]:
        return _maxpool_indices(n, fpool, kernel, strides, dil, begin, ceil, own_pads)
    if own_pads:
        return lambda x: fpool(x, kernel, strides, begin, dil, ceil)
    pad = _torch_pad_arg(begin, end)
    dt = n.inputs[0].dtype  # pads that never win the max: -inf, or an integer type's least value
    low = float("-inf") if dt.is_floating_point else _torch().iinfo(dt).min
    return _cropped(lambda x: fpool(F.pad(x, pad, value=low), kernel, strides, 0, dil, ceil),
                    _ceil_crop(n, kernel, strides, dil, begin, end, ceil))


def _maxpool_indices(n: NodeView, fpool, kernel, strides, dil, pads, ceil, own_pads):
    """MaxPool with its Indices output: ONNX's index is into the whole input as one flat array (N and C offsets
    included, padding not counted), torch's into the input's (n, c) plane, so each plane's offset is added.  Only
    where torch takes the pads itself (symmetric, at most half the kernel): behind ``F.pad`` its indices would
    count the padding.  storage_order=1 (column-major indices) is refused."""
    torch = _torch()
    if int(n.attr("storage_order", 0)):
        n.fail("the Indices output with storage_order=1 (column-major) is not mapped")
    if not own_pads:
        n.fail("the Indices output with pads torch cannot take itself (asymmetric, or more than half the kernel)")
    shp = n.shape(0)
    planes, plane = shp[0] * shp[1], int(np.prod(shp[2:], dtype=np.int64))
    offset_shape = [shp[0], shp[1]] + [1] * (len(shp) - 2)

    def with_indices(x):
        y, i = fpool(x, kernel, strides, pads, dil, ceil, return_indices=True)
        return y, i + (torch.arange(planes, dtype=torch.int64, device=i.device) * plane).reshape(offset_shape)

    return with_indices


@converter("AveragePool")
def _avgpool(n: NodeView):
    F = _torch().nn.functional
    nd, kernel, strides, dil, begin, end, ceil = _pool_params(n)
    if any(d != 1 for d in dil):
        n.fail("dilations")
    cip = bool(n.attr("count_include_pad", 0))
    fpool = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}[nd]
    if _torch_takes_pads(begin, end, kernel):
        if nd == 1:
            return lambda x: fpool(x, kernel, strides, begin, ceil, cip)
        return lambda x: fpool(x, kernel, strides, begin, ceil, cip, None)
    pad = _torch_pad_arg(begin, end)
    crop = _ceil_crop(n, kernel, strides, dil, begin, end, ceil)
    if not cip:
        # pads torch cannot take (tf2onnx's "SAME"): the pooled sum of the zero-padded input over the pooled count
        # of a zero-padded ones-mask, the mean of each window's input elements; both divided by the same window
        # size (torch's, clipped at the end with ceil_mode), which cancels
        mask_shape = [1, 1, *n.shape(0)[2:]]

        def mean_of_input(x):
            return fpool(F.pad(x, pad), kernel, strides, 0, ceil, True) / fpool(F.pad(x.new_ones(mask_shape), pad),
                                                                               kernel, strides, 0, ceil, True)

        return _cropped(mean_of_input, crop)
    return _cropped(lambda x: fpool(F.pad(x, pad), kernel, strides, 0, ceil, True), crop)


@converter("GlobalAveragePool", "GlobalMaxPool")
def _gpool(n: NodeView):
    torch = _torch()
    dims = tuple(range(2, n.rank(0)))
    if n.op == "GlobalAveragePool":
        return lambda x: torch.mean(x, dim=dims, keepdim=True)
    return lambda x: torch.amax(x, dim=dims, keepdim=True)


# -- shape and data movement -----------------------------------------------------

@converter("Concat")
def _concat(n: NodeView):
    torch = _torch()
    axis = int(n.attr("axis"))
    return lambda *xs: torch.cat([x for x in xs], dim=axis)


@converter("Split")
def _split(n: NodeView):
    axis = int(n.attr("axis", 0)) % n.rank(0)
    dim = n.shape(0)[axis]
    if n.has_input(1):
        sizes = n.ints(1)
    elif n.attr("split") is not None:
        sizes = list(n.attr("split"))
    else:
        k = int(n.attr("num_outputs", len(n.node.output)))
        chunk = -(-dim // k)
        sizes = [chunk] * (k - 1) + [dim - chunk * (k - 1)]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    return lambda x, *rest: tuple(x.narrow(axis, o, k) for o, k in zip(offsets, sizes))


@converter("Reshape")
def _reshape(n: NodeView):
    if not n.inputs[1].is_const and n.out_shape(0) is not None:
        # the target shape is computed at run time in the graph, but shape inference knows it
        out = list(n.out_shape(0))
        return lambda x, _s: x.reshape(out)
    shape = n.ints(1)
    allowzero = int(n.attr("allowzero", 0))
    in_shape = n.shape(0)
    if not allowzero:
        shape = [in_shape[i] if s == 0 else s for i, s in enumerate(shape)]
    return lambda x, _s: x.reshape(shape)


@converter("Flatten")
def _flatten(n: NodeView):
    shp = n.shape(0)
    axis = int(n.attr("axis", 1))
    axis = axis + len(shp) if axis < 0 else axis  # ONNX's axis is in [-r, r]; a negative one counts from r
    outer = int(np.prod(shp[:axis], dtype=np.int64))
    return lambda x: x.reshape(outer, -1)


@converter("Transpose")
def _transpose(n: NodeView):
    perm = n.attr("perm")
    perm = list(perm) if perm is not None else list(reversed(range(n.rank(0))))
    return lambda x: x.permute(perm)


@converter("DepthToSpace")
def _depth_to_space(n: NodeView):
    """Channels into blocks of pixels: DCR (the default, and the only mode before opset 11) reads the channel axis
    as [b, b, C/b²], CRD as [C/b², b, b] (``F.pixel_shuffle``'s order).  A reshape, permute and reshape: any dtype."""
    if n.rank(0) != 4:
        n.fail(f"a rank-{n.rank(0)} input (ONNX defines rank 4)")
    b = int(n.attr("blocksize"))
    mode = n.attr("mode", "DCR")
    N, C, H, W = n.shape(0)
    c = C // (b * b)
    if mode == "DCR":
        split, perm = [N, b, b, c, H, W], [0, 3, 4, 1, 5, 2]
    elif mode == "CRD":
        split, perm = [N, c, b, b, H, W], [0, 1, 4, 2, 5, 3]
    else:
        n.fail(f"mode {mode!r} is not mapped")
    out = [N, c, H * b, W * b]
    return lambda x: x.reshape(split).permute(perm).reshape(out)


@converter("SpaceToDepth")
def _space_to_depth(n: NodeView):
    """Blocks of pixels into channels, block offsets outermost (DepthToSpace's DCR inverse; ``F.pixel_unshuffle``
    puts the channel outermost instead)."""
    if n.rank(0) != 4:
        n.fail(f"a rank-{n.rank(0)} input (ONNX defines rank 4)")
    b = int(n.attr("blocksize"))
    N, C, H, W = n.shape(0)
    split, out = [N, C, H // b, b, W // b, b], [N, C * b * b, H // b, W // b]
    return lambda x: x.reshape(split).permute(0, 3, 5, 1, 2, 4).reshape(out)


@converter("Squeeze")
def _squeeze(n: NodeView):
    shp = n.shape(0)
    if n.opset >= 13:
        axes = n.ints(1) if n.has_input(1) else [i for i, s in enumerate(shp) if s == 1]
    else:
        axes = list(n.attr("axes", [i for i, s in enumerate(shp) if s == 1]))
    axes = {a % len(shp) for a in axes}
    out = [s for i, s in enumerate(shp) if i not in axes]
    return lambda x, *rest: x.reshape(out)


@converter("Unsqueeze")
def _unsqueeze(n: NodeView):
    shp = list(n.shape(0))
    axes = n.ints(1) if n.opset >= 13 else list(n.attr("axes"))
    r = len(shp) + len(axes)
    axes = sorted(a % r for a in axes)
    out = list(shp)
    for a in axes:
        out.insert(a, 1)
    return lambda x, *rest: x.reshape(out)


@converter("Softmax", "LogSoftmax")
def _softmax(n: NodeView):
    torch = _torch()
    r = n.rank(0)
    axis = int(n.attr("axis", -1 if n.opset >= 13 else 1)) % r
    f = torch.softmax if n.op == "Softmax" else torch.log_softmax
    if n.opset >= 13 or axis == r - 1:
        return lambda x: f(x, dim=axis)
    shp = n.shape(0)
    flat = [int(np.prod(shp[:axis], dtype=np.int64)), -1]
    return lambda x: f(x.reshape(flat), dim=1).reshape(shp)


@converter("Hardmax")
def _hardmax(n: NodeView):
    """1 at the first maximum along ``axis``, 0 elsewhere; before opset 13 over the input seen as 2-d at ``axis``
    (default 1), as ``_softmax`` does."""
    torch = _torch()
    r = n.rank(0)
    axis = int(n.attr("axis", -1 if n.opset >= 13 else 1)) % r

    def hard(x, dim):
        return torch.zeros_like(x).scatter(dim, x.argmax(dim, keepdim=True), 1)

    if n.opset >= 13 or axis == r - 1:
        return lambda x: hard(x, axis)
    shp = n.shape(0)
    flat = [int(np.prod(shp[:axis], dtype=np.int64)), -1]
    return lambda x: hard(x.reshape(flat), 1).reshape(shp)


@converter("Attention", f"{fused_ops.DOMAIN}.{fused_ops.SDPA}")
def _attention(n: NodeView):
    """softmax(scale·Q·Kᵀ + mask)·V (core/fused_ops.py; ONNX's opset-23 Attention in its 4-d form without a KV
    cache) as ``torch.nn.functional.scaled_dot_product_attention`` or, with ``fuse_attention`` off, as the
    decomposition the rule replaced (the GPU build times one against the other)."""
    torch = _torch()
    if n.op == "Attention":
        if len(n.node.output) > 1 or any(n.has_input(i) for i in range(4, len(n.inputs))):
            n.fail("only Attention without a KV cache (inputs Q, K, V, attn_mask; one output) is supported")
        if any(n.rank(i) != 4 for i in range(3)):
            n.fail("only 4-d Q, K and V are supported")
        if float(n.attr("softcap", 0.0)) != 0.0 or int(n.attr("qk_matmul_output_mode", 0)) != 0:
            n.fail("softcap and qk_matmul_output_mode are not supported")
    d = n.shape(0)[-1]
    scale = n.attr("scale")
    scale = float(scale) if scale is not None else 1.0 / math.sqrt(d) if n.op == "Attention" else 1.0
    causal = bool(int(n.attr("is_causal", 0)))
    zero_rows = n.op != "Attention" and bool(int(n.attr("zero_hidden_rows", 0)))
    # grouped- or multi-query attention: fewer K and V heads than Q's (the heads' axis, -3), each read by a group
    # of query heads (ONNX's Attention; parastream's node with one K/V head, as MatMul broadcast it)
    q_heads, kv_heads = (n.shape(0)[-3], n.shape(1)[-3]) if n.rank(0) >= 3 else (1, 1)
    groups = q_heads // kv_heads if kv_heads and q_heads != kv_heads else 1

    # what the code needs of the mask and the causal pattern is known now: the module stays FX-traceable
    bool_mask = n.has_input(3) and n.inputs[3].dtype == torch.bool
    sq, sk = n.shape(0)[-2], n.shape(1)[-2]
    dtype = n.float_dtype

    def causal_keep(device):
        return torch.ones(sq, sk, dtype=torch.bool, device=device).tril()

    if n.fuse_attention:
        def fused(q, k, v, mask=None):
            f = torch.nn.functional.scaled_dot_product_attention
            if mask is not None and not bool_mask:
                mask = mask.to(dtype)
            if causal and mask is not None:  # SDPA takes one or the other: the causal mask joins the given one
                keep = causal_keep(q.device)
                mask = mask & keep if bool_mask else mask.masked_fill(~keep, float("-inf"))
                y = f(q, k, v, attn_mask=mask, scale=scale, enable_gqa=groups > 1)
            else:
                y = f(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=groups > 1)
            if zero_rows and mask is not None:
                # the rows whose every key is hidden are 0 whatever the kernel gives there (NaN from a
                # -inf row in some, 0 in others): decided on the mask, as the decomposition's IsNaN decides
                hidden = ~mask if bool_mask else mask == float("-inf")
                y = y.masked_fill(hidden.all(dim=-1, keepdim=True), 0.0)
            return y

        return fused

    def unfused(q, k, v, mask=None):
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3)
        s = torch.matmul(q, k.transpose(-1, -2)) * scale
        if causal:
            s = s.masked_fill(~causal_keep(s.device), float("-inf"))
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf")) if bool_mask else s + mask.to(dtype)
        p = torch.softmax(s, dim=-1)
        if zero_rows:  # Where(IsNaN(P), 0, P), as the rule found it
            p = torch.where(torch.isnan(p), torch.zeros((), dtype=p.dtype, device=p.device), p)
        return torch.matmul(p, v)

    return unfused


@converter(f"{fused_ops.DOMAIN}.{fused_ops.GEMM_ACTIVATION}")
def _gemm_activation(n: NodeView):
    """act(X·W + B) (core/fused_ops.py) as ``torch._addmm_activation`` on X's rows (its leading dimensions
    flattened; ``torch.addmm`` for the identity): with ``fuse_gemm_epilogue`` (a CUDA engine's: cuBLASLt's fused
    bias + ReLU/GELU epilogue) where that kernel computes the node's activation, else as the matmul, add and
    activation the rule replaced (the GPU build times one against the other).

    On CUDA ``use_gelu`` is GELU's tanh approximation (cuBLASLt's GELU epilogue; torch's own decomposition of
    ``_addmm_activation`` says so: tanh on CUDA, erf on the CPU).  It differs from erf GELU by at most 4.7e-4
    absolute (at x = 2.7, a quarter of a float16 unit in the last place of the result there), inside the rounding
    of float16 and bfloat16 results but far above float32's: an erf GELU is fused only when the engine computes
    in float16 or bfloat16; ReLU and tanh GELU always."""
    torch = _torch()
    F = torch.nn.functional
    activation = n.attr("activation", "Relu")
    approximate = n.attr("approximate", "none")
    if activation not in fused_ops.ACTIVATIONS or approximate not in ("none", "tanh"):
        n.fail(f"activation {activation!r} (approximate {approximate!r}) is not one of {', '.join(fused_ops.ACTIVATIONS)}")
    if n.rank(1) != 2 or n.rank(0) < 2:
        n.fail("X must be [..., K] and W [K, N]")
    k, cols = n.shape(1)
    rows = n.shape(0)[:-1]
    gelu = activation == "Gelu"
    exact = not gelu or approximate == "tanh" or n.float_dtype in (torch.float16, torch.bfloat16)
    if n.fuse_gemm_epilogue and activation == "Identity":  # the bias alone in the epilogue, as a Linear runs
        return lambda x, w, b: torch.addmm(b.reshape(cols), x.reshape(-1, k), w).reshape(*rows, cols)
    if n.fuse_gemm_epilogue and exact:
        return lambda x, w, b: torch._addmm_activation(b.reshape(cols), x.reshape(-1, k), w,
                                                       use_gelu=gelu).reshape(*rows, cols)

    product = _product_over_rows(n)

    def unfused(x, w, b):
        y = product(x, w) + b
        if activation == "Identity":
            return y
        return F.gelu(y, approximate=approximate) if gelu else torch.relu(y)

    return unfused


@converter("Shape")
def _shape(n: NodeView):
    torch = _torch()
    shp = list(n.shape(0))
    start = n.attr("start", 0)
    end = n.attr("end", None)
    vals = shp[start:end] if end is not None else shp[start:]
    t = torch.tensor(vals, dtype=torch.int64)
    return _ConstFn(t)


@converter("Size")
def _size(n: NodeView):
    torch = _torch()
    return _ConstFn(torch.tensor(int(np.prod(n.shape(0), dtype=np.int64)), dtype=torch.int64))


class _ConstFn:
    """A converter result that does not depend on run-time values (folded even with run-time inputs)."""

    def __init__(self, value):
        self.value = value

    def __call__(self, *args):
        return self.value


@converter("Constant")
def _constant(n: NodeView):
    torch = _torch()
    a = n.attrs
    if "value" in a:
        arr = numpy_helper.to_array(a["value"])
    elif "value_float" in a:
        arr = np.array(a["value_float"], dtype=np.float32)
    elif "value_floats" in a:
        arr = np.array(a["value_floats"], dtype=np.float32)
    elif "value_int" in a:
        arr = np.array(a["value_int"], dtype=np.int64)
    elif "value_ints" in a:
        arr = np.array(a["value_ints"], dtype=np.int64)
    else:
        n.fail("sparse or string constants")
    return _ConstFn(torch.from_numpy(np.array(arr)))


@converter("ConstantOfShape")
def _const_of_shape(n: NodeView):
    torch = _torch()
    shape = n.ints(0) if n.inputs[0].is_const or n.out_shape(0) is None else list(n.out_shape(0))
    v = n.attrs.get("value")
    arr = numpy_helper.to_array(v).reshape(-1) if v is not None else np.zeros(1, np.float32)
    return _ConstFn(torch.full(shape, arr[0].item(), dtype=torch.from_numpy(arr).dtype))


@converter("Range")
def _range(n: NodeView):
    torch = _torch()
    s, l, d = (n.const(i).reshape(-1)[0].item() for i in range(3))
    return _ConstFn(torch.arange(s, l, d, dtype=n.inputs[0].dtype))


@converter("Gather")
def _gather(n: NodeView):
    torch = _torch()
    shp = n.shape(0)
    r = len(shp)
    axis = int(n.attr("axis", 0)) % r
    dim = shp[axis]
    idx = n.inputs[1]
    ishape = tuple(idx.shape) if idx.shape is not None else tuple(idx.const.shape)
    out_shape = tuple(shp[:axis]) + ishape + tuple(shp[axis + 1:])
    if idx.is_const and idx.const.dim() == 0:
        i = int(idx.const)
        i = i + dim if i < 0 else i
        return lambda x, _i: x.select(axis, i)
    if idx.is_const:
        flat = [int(v) + dim if int(v) < 0 else int(v) for v in idx.const.reshape(-1).tolist()]
        if flat == list(range(flat[0], flat[0] + len(flat))):
            # a contiguous run of indices: a slice, no gather kernel
            sl = [slice(None)] * r
            sl[axis] = slice(flat[0], flat[0] + len(flat))
            sl = tuple(sl)
            return lambda x, _i: x[sl].reshape(out_shape)

    def fn(x, i):
        i = torch.where(i < 0, i + dim, i)
        if axis == 0 and r == 2:
            return torch.nn.functional.embedding(i, x)
        return torch.index_select(x, axis, i.reshape(-1)).reshape(out_shape)
    return fn


@converter("GatherElements")
def _gather_el(n: NodeView):
    torch = _torch()
    axis = int(n.attr("axis", 0)) % n.rank(0)
    dim = n.shape(0)[axis]
    # ONNX's indices may be negative (counted from the end); torch.gather's may not
    return lambda x, i: torch.gather(x, axis, torch.where(i < 0, i + dim, i).to(torch.int64))


@converter("GatherND")
def _gather_nd(n: NodeView):
    """ONNX GatherND: the last axis of ``indices`` (length k) indexes the first k axes of ``data`` after
    ``batch_dims`` leading batch axes; written as advanced indexing (one gather kernel)."""
    torch = _torch()
    b = int(n.attr("batch_dims", 0))
    dshape = list(n.shape(0))
    ishape = list(n.inputs[1].shape if n.inputs[1].shape is not None else n.inputs[1].const.shape)
    k = ishape[-1]
    if b + k > len(dshape):
        n.fail(f"indices address {b + k} axes of a rank-{len(dshape)} tensor")
    batch = int(np.prod(dshape[:b], dtype=np.int64))
    out_shape = ishape[:-1] + dshape[b + k:]
    dims = dshape[b:b + k]

    def fn(x, i):
        i = i.to(torch.int64)
        xb = x.reshape([batch] + dshape[b:])
        ib = i.reshape([batch, -1, k])
        idx = [torch.arange(batch, device=x.device).reshape(batch, 1).expand(batch, ib.shape[1])]
        for a in range(k):
            ia = ib[..., a]
            idx.append(torch.where(ia < 0, ia + dims[a], ia))
        return xb[tuple(idx)].reshape(out_shape)
    return fn


@converter("ScatterND")
def _scatter_nd(n: NodeView):
    """ONNX ScatterND (reduction none/add/mul): ``data`` with the slices that ``indices`` name replaced by
    ``updates``, out of place (index_put)."""
    torch = _torch()
    red = n.attr("reduction", "none")
    if red not in ("none", "add", "mul"):
        n.fail(f"reduction {red!r}")
    dshape = list(n.shape(0))
    k = list(n.inputs[1].shape if n.inputs[1].shape is not None else n.inputs[1].const.shape)[-1]
    dims = dshape[:k]

    strides = [int(np.prod(dims[a + 1:], dtype=np.int64)) for a in range(k)]
    flat = [int(np.prod(dims, dtype=np.int64))] + dshape[k:]

    def fn(x, i, u):
        # the k index axes as one linear index, so that repeated indices reduce in order (index_add/index_reduce)
        i = i.to(torch.int64).reshape(-1, k)
        lin = sum(torch.where(i[:, a] < 0, i[:, a] + dims[a], i[:, a]) * strides[a] for a in range(k))
        xf = x.reshape(flat)
        u = u.reshape([i.shape[0]] + dshape[k:]).to(x.dtype)
        if red == "add":
            return xf.index_add(0, lin, u).reshape(dshape)
        if red == "mul":
            return xf.index_reduce(0, lin, u, "prod").reshape(dshape)
        return xf.index_copy(0, lin, u).reshape(dshape)
    return fn


@converter("TopK")
def _topk(n: NodeView):
    torch = _torch()
    k = int(n.attr("k")) if n.opset < 10 else n.ints(1)[0]  # (before opset 10, k is an attribute)
    axis = int(n.attr("axis", -1))
    largest = bool(n.attr("largest", 1))
    # ONNX orders equal values by index, the lower first; torch.topk does not say (its CPU kernel does not), a
    # stable sort does.  With sorted=0 ONNX leaves the order to the runtime: sorted is one such order.

    def topk(x, *_k):
        v, i = torch.sort(x, dim=axis, descending=largest, stable=True)
        return v.narrow(axis, 0, k), i.narrow(axis, 0, k)

    return topk


@converter("Trilu")
def _trilu(n: NodeView):
    torch = _torch()
    k = n.ints(1)[0] if n.has_input(1) else 0
    f = torch.triu if int(n.attr("upper", 1)) else torch.tril
    return lambda x, *rest: f(x, k)


@converter("CumSum")
def _cumsum(n: NodeView):
    torch = _torch()
    axis = n.ints(1)[0] % n.rank(0)
    exclusive, reverse = int(n.attr("exclusive", 0)), int(n.attr("reverse", 0))
    if not exclusive and not reverse:
        return lambda x, _a: torch.cumsum(x, dim=axis).to(x.dtype)
    length = n.shape(0)[axis]

    def cumsum(x, _a):
        """reverse: the sums of a flipped axis, flipped back; exclusive: the inclusive sums shifted one along the
        axis behind a zero (not the sums less x, which rounds)."""
        x = x.flip(axis) if reverse else x
        y = torch.cumsum(x, dim=axis).to(x.dtype)
        if exclusive and length:
            y = torch.cat([torch.zeros_like(y.narrow(axis, 0, 1)), y.narrow(axis, 0, length - 1)], dim=axis)
        return y.flip(axis) if reverse else y

    return cumsum


@converter("IsInf")
def _isinf(n: NodeView):
    torch = _torch()
    pos, neg = bool(n.attr("detect_positive", 1)), bool(n.attr("detect_negative", 1))
    if pos and neg:
        return lambda x: torch.isinf(x)
    if pos:
        return lambda x: torch.isposinf(x)
    if neg:
        return lambda x: torch.isneginf(x)
    return lambda x: torch.zeros_like(x, dtype=torch.bool)


@converter("ScatterElements")
def _scatter_elements(n: NodeView):
    torch = _torch()
    axis = int(n.attr("axis", 0)) % n.rank(0)
    red = n.attr("reduction", "none")
    if red != "none":
        n.fail(f"reduction {red!r}")
    dim = n.shape(0)[axis]
    return lambda x, i, u: torch.scatter(x, axis, torch.where(i < 0, i + dim, i).to(torch.int64), u.to(x.dtype))


@converter("Slice")
def _slice(n: NodeView):
    shp = n.shape(0)
    r = len(shp)
    if n.opset < 10:
        starts, ends = list(n.attr("starts")), list(n.attr("ends"))
        axes = list(n.attr("axes", range(len(starts))))
        steps = [1] * len(starts)
    else:
        starts, ends = n.ints(1), n.ints(2)
        axes = n.ints(3) if n.has_input(3) else list(range(len(starts)))
        steps = n.ints(4) if n.has_input(4) else [1] * len(starts)
    index: list = [slice(None)] * r
    flips = []
    for s, e, a, st in zip(starts, ends, axes, steps):
        a %= r
        d = shp[a]
        if st > 0:
            s = min(max(s + d if s < 0 else s, 0), d)
            e = min(max(e + d if e < 0 else e, 0), d)
            index[a] = slice(s, e, st)
        else:
            # negative steps: torch slicing has none; flip, then slice forward (ONNX clamps the start to
            # [0, d - 1] and the end to [-1, d - 1])
            s = min(max(s + d if s < 0 else s, 0), d - 1)
            e = min(max(e + d if e < 0 else e, -1), d - 1)
            fs, fe = d - 1 - s, d - 1 - e
            flips.append(a)
            index[a] = slice(fs, fe, -st)
    idx = tuple(index)
    torch = _torch()
    if flips:
        return lambda x, *rest: torch.flip(x, flips)[idx]
    return lambda x, *rest: x[idx]


@converter("Expand")
def _expand(n: NodeView):
    if not n.inputs[1].is_const and n.out_shape(0) is not None:
        out = list(n.out_shape(0))
        return lambda x, _s: x.expand(out)
    shape = n.ints(1)
    in_shape = list(n.shape(0))
    out = list(np.broadcast_shapes(tuple(in_shape), tuple(shape)))
    return lambda x, _s: x.expand(out)


@converter("Tile")
def _tile(n: NodeView):
    reps = n.ints(1)
    return lambda x, _r: x.repeat(reps)


@converter("Pad")
def _pad(n: NodeView):
    torch = _torch()
    F = torch.nn.functional
    r = n.rank(0)
    mode = n.attr("mode", "constant")
    if n.opset < 11:
        pads = list(n.attr("pads"))
        value = float(n.attr("value", 0.0))
        axes = list(range(r))
    else:
        pads = n.ints(1)
        value = n.const(2).reshape(-1)[0].item() if n.has_input(2) else 0.0
        axes = [a % r for a in n.ints(3)] if n.has_input(3) else list(range(r))
    k = len(axes)
    begin = [0] * r
    end = [0] * r
    for j, a in enumerate(axes):
        begin[a], end[a] = pads[j], pads[k + j]
    # trim leading all-zero dims (reflect/replicate in torch accept only trailing dims)
    first = next((i for i in range(r) if begin[i] or end[i]), r)
    arg = _torch_pad_arg(begin[first:], end[first:])
    tmode = {"constant": "constant", "reflect": "reflect", "edge": "replicate", "wrap": "circular"}.get(mode)
    if tmode is None:
        n.fail(f"mode {mode!r}")
    if tmode == "constant":
        return lambda x, *rest: F.pad(x, arg, value=value)
    return lambda x, *rest: F.pad(x, arg, mode=tmode)


def _reduce_axes(n: NodeView):
    r = n.rank(0)
    uses_input = n.opset >= 18 or (n.op == "ReduceSum" and n.opset >= 13)
    if uses_input:
        axes = n.ints(1) if n.has_input(1) else []
    else:
        axes = list(n.attr("axes", []))
    if not axes:
        if n.attr("noop_with_empty_axes", 0):
            return None
        axes = list(range(r))
    return tuple(sorted(a % r for a in axes))


@converter("ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL2", "ReduceSumSquare")
def _reduce(n: NodeView):
    torch = _torch()
    axes = _reduce_axes(n)
    keep = bool(n.attr("keepdims", 1))
    if axes is None:  # no reduction, but ONNX Runtime still applies ReduceSumSquare's square and ReduceL2's |x|
        return {"ReduceSumSquare": lambda x, *rest: x * x, "ReduceL2": lambda x, *rest: torch.abs(x)}.get(
            n.op, lambda x, *rest: x)
    f = {"ReduceMean": lambda x: torch.mean(x, dim=axes, keepdim=keep),
         "ReduceSum": lambda x: torch.sum(x, dim=axes, keepdim=keep),
         "ReduceMax": lambda x: torch.amax(x, dim=axes, keepdim=keep),
         "ReduceMin": lambda x: torch.amin(x, dim=axes, keepdim=keep),
         "ReduceSumSquare": lambda x: torch.sum(x * x, dim=axes, keepdim=keep),
         "ReduceL2": lambda x: torch.sqrt(torch.sum(x * x, dim=axes, keepdim=keep))}.get(n.op)
    if n.op == "ReduceProd":
        def f(x):
            for a in reversed(axes):
                x = torch.prod(x, dim=a, keepdim=keep)
            return x
    return lambda x, *rest: f(x)


@converter("ArgMax", "ArgMin")
def _argmax(n: NodeView):
    torch = _torch()
    axis = int(n.attr("axis", 0)) % n.rank(0)
    keep = bool(n.attr("keepdims", 1))
    f = torch.argmax if n.op == "ArgMax" else torch.argmin
    if int(n.attr("select_last_index", 0)):  # ties to the last index: torch's first of the flipped axis
        last = n.shape(0)[axis] - 1
        return lambda x: last - f(torch.flip(x, (axis,)), dim=axis, keepdim=keep)
    return lambda x: f(x, dim=axis, keepdim=keep)


@converter("Einsum")
def _einsum(n: NodeView):
    torch = _torch()
    eq = n.attr("equation").replace(" ", "")
    return lambda *xs: torch.einsum(eq, *xs)


#: ONNX Resize's (mode, coordinate_transformation_mode, nearest_mode) -> F.interpolate's mode, for nearest: the
#: pairs whose index arithmetic is torch's (floor(x / scale); round-half-up of the half-pixel coordinate)
_NEAREST = {("asymmetric", "floor"): "nearest", ("half_pixel", "round_prefer_ceil"): "nearest-exact"}
_INTERPOLATING = {("linear", 1): "linear", ("linear", 2): "bilinear", ("linear", 3): "trilinear", ("cubic", 2): "bicubic"}


@converter("Resize")
def _resize(n: NodeView):
    """Resize (opset 11+) as ``F.interpolate`` where torch computes the same samples: nearest (the two index
    rules of ``_NEAREST``), linear over 1-3 spatial axes and cubic over 2 (torch's bicubic is Keys' with
    a = -0.75, ONNX's default), with half_pixel, pytorch_half_pixel or align_corners coordinates.  Given scales
    are passed as scales (``recompute_scale_factor=False``): ONNX maps coordinates by the scale, not by the
    ratio of the sizes, which differ where in * scale is not whole.  Everything else is refused, naming the
    node: antialiasing, exclude_outside, another cubic coefficient, a resized batch or channel axis, aspect-ratio
    policies, other coordinate modes."""
    F = _torch().nn.functional
    in_shape = n.shape(0)
    rank = len(in_shape)
    if n.opset < 11:
        n.fail("Resize of opset 10 (scales as its second input) is not mapped; export with opset >= 11")
    mode = n.attr("mode", "nearest")
    ctm = n.attr("coordinate_transformation_mode", "half_pixel")
    for key, default in (("antialias", 0), ("exclude_outside", 0)):
        if int(n.attr(key, default)):
            n.fail(f"{key}=1 is not mapped")
    if n.attr("keep_aspect_ratio_policy", "stretch") != "stretch":
        n.fail(f"keep_aspect_ratio_policy {n.attr('keep_aspect_ratio_policy')!r} is not mapped")
    axes = [int(a) % rank for a in n.attr("axes", list(range(rank)))]
    out, scales = list(in_shape), None
    if n.has_input(3) and n.const(3).numel():
        for a, v in zip(axes, n.ints(3)):
            out[a] = v
    elif n.has_input(2) and n.const(2).numel():
        scales = [1.0] * rank
        for a, v in zip(axes, n.const(2).reshape(-1).tolist()):
            scales[a] = float(v)
        out = [int(math.floor(d * s)) for d, s in zip(in_shape, scales)]
    else:
        n.fail("no sizes or scales")
    if rank < 3 or out[:2] != list(in_shape[:2]) or (scales is not None and scales[:2] != [1.0, 1.0]):
        n.fail("resizes the batch or channel axis (torch resizes the axes after the first two only)")
    if mode == "nearest":
        tmode = _NEAREST.get((ctm, n.attr("nearest_mode", "round_prefer_floor")))
        if tmode is None:
            n.fail(f"nearest with coordinate_transformation_mode {ctm!r} and nearest_mode "
                   f"{n.attr('nearest_mode', 'round_prefer_floor')!r} is not mapped")
        align = None
    else:
        tmode = _INTERPOLATING.get((mode, rank - 2))
        if tmode is None or ctm not in ("half_pixel", "pytorch_half_pixel", "align_corners"):
            n.fail(f"mode {mode!r} over {rank - 2} axes with coordinate_transformation_mode {ctm!r} is not mapped")
        if mode == "cubic" and float(n.attr("cubic_coeff_a", -0.75)) != -0.75:
            n.fail(f"cubic_coeff_a {n.attr('cubic_coeff_a')} (torch's bicubic is -0.75)")
        align = ctm == "align_corners"
    # pytorch_half_pixel samples index 0 along an axis resized to length 1 (torch's half-pixel would sample
    # its middle): that axis is cut to its first element, and left alone by the interpolation
    first = [a for a in range(2, rank) if ctm == "pytorch_half_pixel" and out[a] == 1 and in_shape[a] != 1]
    if scales is not None:
        factors = [1.0 if a in first else scales[a] for a in range(2, rank)]
        kw = {"scale_factor": factors, "recompute_scale_factor": False}
    else:
        kw = {"size": out[2:]}

    def resize(x, *rest):
        for a in first:
            x = x.narrow(a, 0, 1)
        return F.interpolate(x, mode=tmode, align_corners=align, **kw)

    return resize


@converter("Col2Im")
def _col2im(n: NodeView):
    """Col2Im (opset 18) as ``F.fold``, which sums each column's block into a 2-d image as ONNX does; refused
    where fold cannot say it: other than 2-d images, or pads that differ between an axis's two ends."""
    F = _torch().nn.functional
    image, block = n.ints(1), n.ints(2)
    if len(image) != 2 or len(block) != 2:
        n.fail(f"a {len(image)}-d image (F.fold folds 2-d images)")
    pads = list(n.attr("pads", [0, 0, 0, 0]))
    if pads[:2] != pads[2:]:
        n.fail(f"pads {pads} differ between an axis's begin and end")
    kw = {"dilation": list(n.attr("dilations", [1, 1])), "padding": pads[:2], "stride": list(n.attr("strides", [1, 1]))}
    return lambda x, *rest: F.fold(x, output_size=image, kernel_size=block, **kw)


# -- recurrent layers ------------------------------------------------------------

#: ONNX's recurrent activations that torch has as one function (the spec's names; no alpha or beta)
_RNN_ACTIVATIONS = {"Sigmoid": "sigmoid", "Tanh": "tanh", "Relu": "relu"}
#: gates per layer, their order in W, R and B, and the default activations of one direction
_RNN_KINDS = {"LSTM": (4, ("Sigmoid", "Tanh", "Tanh")), "GRU": (3, ("Sigmoid", "Tanh")), "RNN": (1, ("Tanh",))}


#: per kind, where ONNX's gates (LSTM i, o, f, c; GRU z, r, h) are in torch's order (LSTM i, f, g, o; GRU r, z, n)
_TORCH_GATES = {"LSTM": (0, 2, 3, 1), "GRU": (1, 0, 2), "RNN": (0,)}


def _seq_first(x, h0, c0):
    """Layout 1's input [batch, seq, input] and states [batch, directions, hidden] in layout 0's order."""
    return x.transpose(0, 1), *(s.transpose(0, 1) if s is not None else None for s in (h0, c0))


def _batch_first(y, yh, yc):
    """Layout 0's outputs (Y [seq, directions, batch, hidden], Y_h and Y_c [directions, batch, hidden]) in layout
    1's order ([batch, seq, directions, hidden], [batch, directions, hidden])."""
    return y.permute(2, 0, 1, 3), yh.transpose(0, 1), yc.transpose(0, 1) if yc is not None else None


@converter("LSTM", "GRU", "RNN")
def _recurrent(n: NodeView):
    """LSTM, GRU and RNN.  Where torch's own layer computes what ONNX's does (the default activations, or Relu
    throughout for an RNN; no clip, no peepholes, no input_forget; a GRU's linear_before_reset, which torch's GRU
    always does), one call of ``torch.ops.parastream.rnn`` (``recurrent_op``) with the weights in torch's gate
    order (``_TORCH_GATES``; ONNX has one bias for W and one for R, as torch does); a reverse direction runs
    forward on the time-reversed sequence.  Otherwise written out as the equations, one time step after another
    (the sequence length is static), each direction's input products for every step as one matrix product first.
    Refused by name: activations outside ``_RNN_ACTIVATIONS`` or with alpha/beta, LSTM's input_forget, and
    sequence lengths that are not the full length for every sequence (padding, which this does not mask)."""
    torch = _torch()
    gates, default_acts = _RNN_KINDS[n.op]
    direction = n.attr("direction", "forward")
    if direction not in ("forward", "reverse", "bidirectional"):
        n.fail(f"direction {direction!r}")
    dirs = 2 if direction == "bidirectional" else 1
    layout = int(n.attr("layout", 0))
    w_shape = n.shape(1)
    hidden = int(n.attr("hidden_size", w_shape[1] // gates))
    x_shape = n.shape(0)
    seq = x_shape[1] if layout else x_shape[0]
    if n.attr("activation_alpha") or n.attr("activation_beta"):
        n.fail("activation_alpha/activation_beta are not mapped")
    names = [a.decode() if isinstance(a, bytes) else a for a in (n.attr("activations") or list(default_acts) * dirs)]
    if len(names) != len(default_acts) * dirs or any(a not in _RNN_ACTIVATIONS for a in names):
        n.fail(f"activations {names} (mapped: {sorted(_RNN_ACTIVATIONS)}, {len(default_acts)} per direction)")
    acts = [[getattr(torch, _RNN_ACTIVATIONS[a]) for a in names[d * len(default_acts):(d + 1) * len(default_acts)]]
            for d in range(dirs)]
    if n.op == "LSTM" and int(n.attr("input_forget", 0)):
        n.fail("input_forget=1 is not mapped")
    if n.has_input(4):
        lens = n.const(4).reshape(-1).tolist() if n.inputs[4].is_const else None
        if lens is None or any(int(v) != seq for v in lens):
            n.fail(f"sequence_lens other than the full length {seq} for every sequence (constant) are not mapped")
    clip = n.attr("clip")
    before_reset = int(n.attr("linear_before_reset", 0))
    if clip is None and not n.has_input(7) and (n.op != "GRU" or before_reset):
        per = len(default_acts)
        # torch's RNN: tanh or relu, the same in both directions
        if n.op == "RNN" and len(set(names)) == 1 and names[0] in ("Tanh", "Relu"):
            return _torch_rnn(n, f"RNN_{names[0].upper()}", gates, hidden, dirs, direction, layout, seq)
        if n.op != "RNN" and all(tuple(names[d * per:(d + 1) * per]) == default_acts for d in range(dirs)):
            return _torch_rnn(n, n.op, gates, hidden, dirs, direction, layout, seq)

    def squash(f, v):
        return f(v.clamp(-clip, clip) if clip is not None else v)

    def step(d, xw_t, h, c, rt, rb, p):
        f = acts[d]
        if n.op == "RNN":
            return squash(f[0], xw_t + h @ rt + rb), None
        if n.op == "GRU":
            z_r = xw_t[..., :2 * hidden] + h @ rt[:, :2 * hidden] + rb[:2 * hidden]
            z, r = squash(f[0], z_r[..., :hidden]), squash(f[0], z_r[..., hidden:])
            if before_reset:
                cand = xw_t[..., 2 * hidden:] + r * (h @ rt[:, 2 * hidden:] + rb[2 * hidden:])
            else:
                cand = xw_t[..., 2 * hidden:] + (r * h) @ rt[:, 2 * hidden:] + rb[2 * hidden:]
            cand = squash(f[1], cand)
            return (1 - z) * cand + z * h, None
        g = xw_t + h @ rt + rb
        i, o, fg, cc = g[..., :hidden], g[..., hidden:2 * hidden], g[..., 2 * hidden:3 * hidden], g[..., 3 * hidden:]
        if p is not None:
            i, fg = i + p[:hidden] * c, fg + p[2 * hidden:] * c
        i, fg, cc = squash(f[0], i), squash(f[0], fg), squash(f[1], cc)
        c = fg * c + i * cc
        if p is not None:
            o = o + p[hidden:2 * hidden] * c
        return squash(f[0], o) * f[2](c), c

    def run(x, w, r, b=None, _lens=None, h0=None, c0=None, p=None):
        if layout:
            x, h0, c0 = _seq_first(x, h0, c0)
        batch = x.shape[1]
        ys, hs, cs = [], [], []
        for d in range(dirs):
            xw = x @ w[d].t()
            rb = x.new_zeros(gates * hidden)
            if b is not None:
                xw, rb = xw + b[d, :gates * hidden], b[d, gates * hidden:]
            h = h0[d] if h0 is not None else x.new_zeros(batch, hidden)
            c = (c0[d] if c0 is not None else x.new_zeros(batch, hidden)) if n.op == "LSTM" else None
            rt, pd = r[d].t(), (p[d] if p is not None else None)
            out = [None] * seq
            backward = direction == "reverse" or d == 1
            for t in (range(seq - 1, -1, -1) if backward else range(seq)):
                h, c = step(d, xw[t], h, c, rt, rb, pd)
                out[t] = h
            ys.append(torch.stack(out))
            hs.append(h)
            cs.append(c)
        y, yh = torch.stack(ys, 1), torch.stack(hs)  # [seq, directions, batch, hidden], [directions, batch, hidden]
        yc = torch.stack(cs) if n.op == "LSTM" else None
        if layout:
            y, yh, yc = _batch_first(y, yh, yc)
        return (y, yh, yc) if n.op == "LSTM" else (y, yh)

    return run


def _torch_rnn(n: NodeView, kind: str, gates: int, hidden: int, dirs: int, direction: str, layout: int, seq: int):
    """``_recurrent``'s step as one ``torch.ops.parastream.rnn`` call (``kind``: LSTM, GRU, RNN_TANH or
    RNN_RELU): the inputs and states in ONNX's layout, the outputs too (Y [seq, directions, batch, hidden]).  The
    step reorders W, R and B into torch's gate order at each call; ``run.ordered`` is the same step for weights
    stored in that order already, and ``run.torch_gate_order`` stores them so (``_recurrent_weights``)."""
    from .recurrent_op import register_rnn_op

    torch = _torch()
    register_rnn_op()
    order = _TORCH_GATES[n.op]

    def torch_order(t, axis=0):  # gate blocks along ``axis``, ONNX's order to torch's
        if len(order) == 1:
            return t
        return torch.cat([t.narrow(axis, g * hidden, hidden) for g in order], dim=axis)

    def stored_in_torch_order(t, bias: bool):  # a constant W or R [dirs, G*H, ...], or B [dirs, 2*G*H]
        if not bias:
            return torch_order(t, 1).contiguous()
        return torch.cat([torch_order(t[:, :gates * hidden], 1), torch_order(t[:, gates * hidden:], 1)], 1).contiguous()

    def make(ordered: bool):
        def arrange(t):
            return t if ordered else torch_order(t)

        def run(x, w, r, b=None, _lens=None, h0=None, c0=None, p=None):
            if layout:
                x, h0, c0 = _seq_first(x, h0, c0)
            batch = x.shape[1]
            if direction == "reverse":
                x = x.flip(0)
            weights = []
            for d in range(dirs):
                bias = b[d] if b is not None else x.new_zeros(2 * gates * hidden)
                weights += [arrange(w[d]), arrange(r[d]), arrange(bias[:gates * hidden]), arrange(bias[gates * hidden:])]
            h = h0.contiguous() if h0 is not None else x.new_zeros(dirs, batch, hidden)
            c = (c0.contiguous() if c0 is not None else x.new_zeros(dirs, batch, hidden)) if n.op == "LSTM" else None
            y, yh, yc = torch.ops.parastream.rnn(kind, x.contiguous(), weights, h, c, dirs == 2)
            y = y.view(seq, batch, dirs, hidden)
            if direction == "reverse":
                y = y.flip(0)
            y = y.permute(0, 2, 1, 3)  # [seq, directions, batch, hidden]
            if layout:
                y, yh, yc = _batch_first(y, yh, yc if n.op == "LSTM" else None)
            return (y, yh, yc) if n.op == "LSTM" else (y, yh)

        return run

    run = make(False)
    run.ordered, run.torch_gate_order = make(True), stored_in_torch_order
    return run


# -- the module ------------------------------------------------------------------

@dataclass
class Step:
    fn: Callable
    args: list  # per input: ("v", name) run-time value, ("c", buffer) constant, None
    outputs: list[str]
    node: str


def _first_of(fn: Callable) -> Callable:
    def first(*args):
        return fn(*args)[0]

    return first


def _np_to_torch(arr: np.ndarray):
    torch = _torch()
    if arr.dtype == np.dtype("O"):
        raise UnsupportedOp("string tensors are not supported")
    # (not np.ascontiguousarray, which makes a 0-d array 1-d: a scalar weight then broadcast a 0-d result to [1],
    # which the engine's 0-d output could not take: FCOS's count comparisons, read by its tail)
    return torch.from_numpy(np.array(arr, order="C", copy=True))


def _cast_const(t, float_dtype):
    return t.to(float_dtype) if t.is_floating_point() else t


def _module_class():
    torch = _torch()

    class OnnxModule(torch.nn.Module):
        """The branch as torch ops; ``forward(*inputs)`` takes and returns tensors in ONNX input/output order."""

        def __init__(self, steps, input_names, output_refs, consts, float_dtype):
            super().__init__()
            self.input_names = list(input_names)
            self._steps = steps
            self._output_refs = output_refs
            self.float_dtype = float_dtype
            for key, t in consts.items():
                self.register_buffer(key, t, persistent=False)

        def forward(self, *inputs):
            env = {}
            for name, x in zip(self.input_names, inputs):
                env[name] = x
            for step in self._steps:
                args = []
                for a in step.args:
                    if a is None:
                        args.append(None)
                    elif a[0] == "v":
                        args.append(env[a[1]])
                    else:
                        args.append(getattr(self, a[1]))
                out = step.fn(*args)
                if len(step.outputs) == 1:
                    env[step.outputs[0]] = out
                else:
                    for name, o in zip(step.outputs, out):
                        env[name] = o
            results = []
            for kind, ref in self._output_refs:
                results.append(env[ref] if kind == "v" else getattr(self, ref))
            return tuple(results)

    return OnnxModule


def _unfused_here(kind: str, conv: Step, shapes: dict | None, consts: dict, unfused: frozenset) -> bool:
    """Whether ``conv``'s fusion of ``kind`` is one ``unfused`` lists (``cudnn_fused.conv_key``)."""
    if not unfused or shapes is None:
        return False
    from .cudnn_fused import conv_key

    x, fn = shapes.get(conv.args[0][1]) if conv.args[0] is not None else None, conv.fn
    if x is None or len(x) != 4:
        return False
    return conv_key(kind, x, tuple(consts[conv.args[1][1]].shape), fn.strides, fn.padding, fn.dilations,
                    fn.group) in unfused


def _fuse_conv_relu(steps: list, keep: set[str], consts: dict, op_of: dict[int, str], shapes: dict | None = None,
                    unfused: frozenset = frozenset(), padded: frozenset = frozenset(),
                    const_outputs: frozenset = frozenset()) -> tuple[list, int, int]:
    """Conv (2-d, symmetric pads) whose output only a Relu reads -> one cuDNN conv + bias + ReLU step, but where
    its shape is one ``unfused`` lists (``_unfused_here``; ``shapes``: the values' shapes); where ``padded`` lists
    it, the step runs on its channels padded (``_ConvFn.relu_fused_padded``, ``cudnn_fused.padded_channels``: a
    dense convolution with a constant bias or none), its weight and bias stored padded.

    ``keep``: names that must stay visible (graph outputs).  The weights of fused steps are stored
    channels-last, the layout cuDNN's fused kernels read without a transform.  A padded weight or bias replaces its
    constant only where that step alone reads it (``const_outputs``: constants the graph also outputs).  Returns the
    new steps, how many pairs were fused, and how many of them run padded.
    """
    torch = _torch()
    readers = consumers([a[1] for a in st.args if a is not None and a[0] == "v"] for st in steps)
    uses: dict[str, int] = dict.fromkeys(const_outputs, 1)
    for st in steps:
        for a in st.args:
            if a is not None and a[0] == "c":
                uses[a[1]] = uses.get(a[1], 0) + 1
    out: list = []
    fused = widened = 0
    skip: set[int] = set()
    for i, st in enumerate(steps):
        if i in skip:
            continue
        fn = st.fn
        if isinstance(fn, _ConvFn) and fn.nd == 2 and len(st.outputs) == 1 and st.outputs[0] not in keep:
            r = readers.get(st.outputs[0], [])
            w = st.args[1] if len(st.args) > 1 else None
            if (len(r) == 1 and op_of.get(r[0]) == "Relu" and w is not None and w[0] == "c"
                    and not _unfused_here("relu", st, shapes, consts, unfused)):
                relu = steps[r[0]]
                to = _padded_here(st, shapes, consts, padded)
                if to is not None:
                    k, c = consts[w[1]].shape[:2]  # (before the weight is padded, in place where no other step reads it)
                    args = _pad_conv_consts(st, consts, uses, *to)
                    step = Step(fn.relu_fused_padded(int(c), to[0], int(k), to[1]), args, relu.outputs,
                                f"{st.node}+{relu.node}")
                    widened += 1
                else:
                    consts[w[1]] = consts[w[1]].contiguous(memory_format=torch.channels_last)
                    step = Step(fn.relu_fused(), st.args, relu.outputs, f"{st.node}+{relu.node}")
                out.append(step)
                skip.add(r[0])
                fused += 1
                continue
        out.append(st)
    return out, fused, widened


def _padded_here(conv: Step, shapes: dict | None, consts: dict, padded: frozenset) -> tuple[int, int] | None:
    """(input, output) channels ``conv`` runs with where ``padded`` lists its ``relu`` key and it can run padded
    (not through a cuDNN plan, a constant bias or none), else None."""
    if not padded or shapes is None or conv.fn.planned:
        return None
    from .cudnn_fused import conv_key, padded_channels

    x, fn = shapes.get(conv.args[0][1]) if conv.args[0] is not None else None, conv.fn
    bias = conv.args[2] if len(conv.args) > 2 else None
    if x is None or len(x) != 4 or (bias is not None and bias[0] != "c"):
        return None
    key = conv_key("relu", x, tuple(consts[conv.args[1][1]].shape), fn.strides, fn.padding, fn.dilations, fn.group)
    return padded_channels(key) if key in padded else None


def _pad_conv_consts(conv: Step, consts: dict, uses: dict[str, int], channels: int, outs: int) -> list:
    """``conv``'s arguments with its weight padded to [``outs``, ``channels``, kh, kw] (channels-last) and its bias
    to [``outs``], the new entries zero; a constant that another step also reads is padded into a new one."""
    from .cudnn_fused import padded_conv_weights

    args = list(conv.args)
    bias = args[2] if len(args) > 2 else None
    wide = padded_conv_weights(consts[args[1][1]], consts[bias[1]] if bias is not None else None, channels, outs)
    for pos, t in zip((1, 2), wide):
        if t is None:
            continue
        name = args[pos][1] if uses.get(args[pos][1], 0) == 1 else f"{args[pos][1]}_padded"
        consts[name] = t
        args[pos] = ("c", name)
    return args


def _fuse_conv_silu(steps: list, keep: set[str], consts: dict, op_of: dict[int, str], shapes: dict | None = None,
                    unfused: frozenset = frozenset()) -> tuple[list, int, dict[int, str]]:
    """Conv (2-d, constant weight; symmetric pads, or a planned one's pads applied first) whose output only a
    Sigmoid of it and the Mul of the two read (SiLU as exporters write it: x * sigmoid(x)) -> one cuDNN conv +
    bias + SiLU step (``_ConvFn.swish_fused``) in the Conv's place, but where its shape is one ``unfused`` lists
    (kind "silu").  Neither the Conv's nor the Sigmoid's output may be a graph output (``keep``).  The fused
    weights are stored channels-last, as ``_fuse_conv_relu`` stores them.  Returns the new steps, how many were
    fused, and ``op_of`` for the new steps' indices."""
    torch = _torch()
    readers = consumers([a[1] for a in st.args if a is not None and a[0] == "v"] for st in steps)
    drop: set[int] = set()
    fused: dict[int, Step] = {}
    for i, st in enumerate(steps):
        fn = st.fn
        if not (isinstance(fn, _ConvFn) and fn.nd == 2 and len(st.outputs) == 1 and st.outputs[0] not in keep):
            continue
        y, w = st.outputs[0], st.args[1] if len(st.args) > 1 else None
        r = readers.get(y, [])
        if w is None or w[0] != "c" or len(r) != 2 or _unfused_here("silu", st, shapes, consts, unfused):
            continue
        sig = next((j for j in r if op_of.get(j) == "Sigmoid"), None)
        mul = next((j for j in r if op_of.get(j) == "Mul"), None)
        if sig is None or mul is None or len(steps[sig].outputs) != 1 or len(steps[mul].outputs) != 1:
            continue
        s_out = steps[sig].outputs[0]
        if (s_out in keep or readers.get(s_out) != [mul] or len(steps[mul].args) != 2
                or sorted(a[1] for a in steps[mul].args if a is not None and a[0] == "v") != sorted([y, s_out])):
            continue
        consts[w[1]] = consts[w[1]].contiguous(memory_format=torch.channels_last)
        fused[i] = Step(fn.swish_fused(), st.args, steps[mul].outputs,
                        f"{st.node}+{steps[sig].node}+{steps[mul].node}")
        drop.update((sig, mul))
    kept = [i for i in range(len(steps)) if i not in drop]
    return ([fused.get(i, steps[i]) for i in kept], len(fused),
            {new: ("Conv+Sigmoid+Mul" if i in fused else op_of.get(i)) for new, i in enumerate(kept)})


def _residual_conv(steps: list, i: int, producer: dict, readers: dict, keep: set[str], shapes: dict, consts: dict,
                   unfused: frozenset, drop: set[int], kind: str) -> tuple[int, str] | None:
    """(the Conv step, the residual z's name) where step ``i`` adds a Conv's output and a run-time tensor z of its
    shape (no broadcasting), the Conv 2-d with a constant weight, its output read by that Add alone and no graph
    output (``keep``), not already fused (``drop``) nor of a shape ``unfused`` lists for ``kind``; the first
    operand that is, else None.  ``kind`` "add_relu" (torch's fused call) needs symmetric pads; "add" (a cuDNN
    plan) applies a planned convolution's pads first."""
    add = steps[i]
    for j in (0, 1):
        c, z = producer.get(add.args[j][1]), add.args[1 - j][1]
        if c is None or c in drop:
            continue
        conv = steps[c]
        w = conv.args[1] if len(conv.args) > 1 else None
        same_shape = shapes.get(z) is not None and shapes.get(z) == shapes.get(conv.outputs[0]) == shapes.get(add.outputs[0])
        if (isinstance(conv.fn, _ConvFn) and conv.fn.nd == 2 and (kind == "add" or conv.fn.pre_pad is None)
                and len(conv.outputs) == 1 and same_shape and conv.outputs[0] not in keep
                and readers.get(conv.outputs[0]) == [i] and w is not None and w[0] == "c"
                and not _unfused_here(kind, conv, shapes, consts, unfused)):
            return c, z
    return None


def _fuse_conv_add(steps: list, keep: set[str], consts: dict, op_of: dict[int, str], shapes: dict[str, tuple],
                   unfused: frozenset = frozenset()) -> tuple[list, int, dict[int, str]]:
    """Conv (2-d, constant weight) + Add of a run-time tensor z of the conv's own shape (a residual, no
    broadcasting), the conv's output read by that Add alone and not a graph output (``keep``; the sum may be one:
    the fused step writes it) -> one cuDNN conv + bias + add plan (``_ConvFn.add_fused``) in the Add's place
    (where x and z are both computed), but where its shape is one ``unfused`` lists (kind "add").  A sum that a
    Relu alone reads is left to ``_fuse_conv_add_relu`` (fused there, or left unfused by the build's timing).  The
    fused weights are stored channels-last.  Returns the new steps, how many were fused, and ``op_of`` for the new
    steps' indices."""
    torch = _torch()
    readers = consumers([a[1] for a in st.args if a is not None and a[0] == "v"] for st in steps)
    producer = {name: i for i, st in enumerate(steps) for name in st.outputs if name}
    drop: set[int] = set()
    fused: dict[int, Step] = {}
    for i, add in enumerate(steps):
        if op_of.get(i) != "Add" or len(add.outputs) != 1 or len(add.args) != 2:
            continue
        if any(a is None or a[0] != "v" for a in add.args) or add.args[0][1] == add.args[1][1]:
            continue
        after = readers.get(add.outputs[0], [])
        if len(after) == 1 and op_of.get(after[0]) == "Relu":  # conv + add + ReLU's, fused or left by its timing
            continue
        found = _residual_conv(steps, i, producer, readers, keep, shapes, consts, unfused, drop, "add")
        if found is None:
            continue
        c, z = found
        conv, w = steps[c], steps[c].args[1]
        consts[w[1]] = consts[w[1]].contiguous(memory_format=torch.channels_last)
        bias = conv.args[2] if len(conv.args) > 2 else None
        fused[i] = Step(conv.fn.add_fused(), [conv.args[0], w, ("v", z), bias], add.outputs, f"{conv.node}+{add.node}")
        drop.add(c)
    kept = [i for i in range(len(steps)) if i not in drop]
    return ([fused.get(i, steps[i]) for i in kept], len(fused),
            {new: ("Conv+Add" if i in fused else op_of.get(i)) for new, i in enumerate(kept)})


#: Inductor's estimate of a convolution's time channels-last over NCHW by kind, inference (< 1: faster channels-last),
#: and its rule's node budget per convolution: ``torch._inductor.graph.GraphLowering.decide_layout_opt``, which
#: decides one layout for the whole graph inside Inductor's lowering, after the converter has stored the weights.
#: Restated here (not called) because it reads an aten graph with fake values that only the compile builds.
_INDUCTOR_CHANNELS_LAST_COST = {"grouped": 1.358, "small": 0.783, "in_out": 0.725, "default": 0.823}
_INDUCTOR_NODES_PER_CONV = 300


def inductor_runs_channels_last(convs: list[tuple[tuple, int, int]], nodes: int) -> bool:
    """Whether Inductor's layout optimisation runs a graph channels-last, for its convolutions ``convs`` (each
    (weight shape, groups, output elements); only those it sees as ``aten.convolution``: a cuDNN plan or a
    fused conv+ReLU step is another op to it) in a graph of about ``nodes`` aten nodes: none, or fewer than
    ``_INDUCTOR_NODES_PER_CONV`` nodes a convolution, is NCHW; otherwise the flop-weighted cost of each
    convolution's kind (``_INDUCTOR_CHANNELS_LAST_COST``) is at most the flops.  A convolution's flops are
    2 x output elements x its weight's elements per output channel, as torch's flop counter counts them."""
    if not convs or nodes >= _INDUCTOR_NODES_PER_CONV * len(convs):
        return False
    total = weighted = 0.0
    for w, group, out_elems in convs:
        flops = 2.0 * out_elems * math.prod(w[1:])
        if group > 1 and w[1] > 1:
            kind = "grouped"
        elif w[0] <= 64 and w[1] <= 64:
            kind = "small"
        elif w[0] * 2 <= w[1] and len(w) > 2 and w[2] > 1:
            kind = "in_out"
        else:
            kind = "default"
        total += flops
        weighted += flops * _INDUCTOR_CHANNELS_LAST_COST[kind]
    return weighted <= total


def _channels_last_conv_weights(steps: list, consts: dict, outputs: set[str],
                                shapes: dict[str, tuple]) -> tuple[int, bool | None]:
    """Store channels-last the constant weight of each 2-d convolution step left as torch's convolution (not
    fused, not through a cuDNN plan) whose kernel is wider than 1x1 and whose groups are not of one channel, in
    the layout Inductor will run it; returns how many weights it changed and the layout decision restated for the
    graph (True channels-last; None where a size it needs is not known here).

    Why: Inductor runs such a convolution channels-last (its layout optimisation, or its input's layout where a
    fused step before it wrote channels-last) and asks its weight for the same layout.  A weight that arrives NCHW
    is transposed by a Triton kernel of its own before every call: DenseNet-121's 58 3x3 convolutions (the one
    convolution of each dense layer no ReLU follows) ran 58 such kernels a replay, 57.5 µs of its 0.95 ms and a
    gap each (H200, bench/kernel_profile.py).  Stored channels-last, the weight is passed to cuDNN as it is; a 1x1
    or depthwise weight is both layouts at once and is left alone.  A dense weight is stored so always (where
    Inductor runs the graph NCHW, a channels-last weight has it make the convolution's input channels-last, which
    the kernel writing that input does, rather than transpose the weight).  A grouped one only where Inductor's
    decision (``inductor_runs_channels_last``, one for the whole graph) is channels-last: where grouped convolutions
    dominate it runs the graph NCHW, and a channels-last weight there would have cuDNN run that convolution
    channels-last anyway; left NCHW in a channels-last graph, it was transposed at every call (the GPU layout
    test's grouped 3x3).  The build records what is still transposed (``weight_only_kernels``).  Values unchanged."""
    torch = _torch()
    convs = [st for st in steps if isinstance(st.fn, _ConvFn) and not st.fn.planned and len(st.args) > 1]
    seen = []
    for st in convs:
        w = st.args[1]
        w_shape = None if w is None else tuple(consts[w[1]].shape) if w[0] == "c" else shapes.get(w[1])
        out = shapes.get(st.outputs[0]) if st.outputs else None
        if not w_shape or not out or any(not isinstance(d, int) or d < 0 for d in (*w_shape, *out)):
            seen = None  # a weight or an output size not known here: the decision is not restated
            break
        seen.append((w_shape, st.fn.group, math.prod(out)))
    # (aten nodes: about one a step and one a constant, as Inductor's graph has them)
    decided = None if seen is None else inductor_runs_channels_last(seen, len(steps) + len(consts))
    grouped_cl = bool(decided)
    changed = 0
    for st in convs:
        fn = st.fn
        if fn.nd != 2 or (fn.group > 1 and not grouped_cl):
            continue
        w = st.args[1]
        if w is None or w[0] != "c" or w[1] in outputs:
            continue
        t = consts[w[1]]
        if t.dim() != 4 or t.shape[2] * t.shape[3] < 2 or t.is_contiguous(memory_format=torch.channels_last):
            continue
        consts[w[1]] = t.contiguous(memory_format=torch.channels_last)
        changed += 1
    return changed, decided


def _fuse_conv_add_relu(steps: list, keep: set[str], consts: dict, op_of: dict[int, str],
                        shapes: dict[str, tuple], unfused: frozenset = frozenset()) -> tuple[list, int, dict[int, str]]:
    """Conv (2-d, symmetric pads, constant weight) + Add of a run-time tensor z of the conv's own shape (a residual:
    no broadcasting) + Relu, each output read only by the next and none a graph output (``keep``) -> one cuDNN
    conv + bias + residual + ReLU step, relu(conv(x, w) + z + b), in the Relu's place (where x and z are both
    computed).  The fused weights are stored channels-last, as ``_fuse_conv_relu`` stores them.  Returns the new
    steps, how many chains were fused, and ``op_of`` for the new steps' indices."""
    torch = _torch()
    readers = consumers([a[1] for a in st.args if a is not None and a[0] == "v"] for st in steps)
    producer = {name: i for i, st in enumerate(steps) for name in st.outputs if name}
    drop: set[int] = set()
    fused: dict[int, Step] = {}
    unbiased: dict[int, Step] = {}  # a shortcut convolution whose bias the fused step adds (``_fold_shortcut_bias``)
    for i, add in enumerate(steps):
        if op_of.get(i) != "Add" or len(add.outputs) != 1 or add.outputs[0] in keep or len(add.args) != 2:
            continue
        after = readers.get(add.outputs[0], [])
        if len(after) != 1 or op_of.get(after[0]) != "Relu" or after[0] in fused:
            continue
        if any(a is None or a[0] != "v" for a in add.args) or add.args[0][1] == add.args[1][1]:
            continue
        found = _residual_conv(steps, i, producer, readers, keep, shapes, consts, unfused, drop, "add_relu")
        if found is None:
            continue
        c, z = found
        conv, w, relu = steps[c], steps[c].args[1], steps[after[0]]
        consts[w[1]] = consts[w[1]].contiguous(memory_format=torch.channels_last)
        bias = conv.args[2] if len(conv.args) > 2 else None
        bias = _fold_shortcut_bias(steps, producer.get(z), i, readers, keep, consts, bias, unbiased)
        fused[after[0]] = Step(conv.fn.add_relu_fused(), [conv.args[0], w, ("v", z), bias], relu.outputs,
                               f"{conv.node}+{add.node}+{relu.node}")
        drop.update((c, i))
    kept = [i for i in range(len(steps)) if i not in drop]
    return ([fused.get(i, unbiased.get(i, steps[i])) for i in kept], len(fused),
            {new: ("Conv+Add+Relu" if i in fused else op_of.get(i)) for new, i in enumerate(kept)})


def _fold_shortcut_bias(steps: list, p: int | None, add: int, readers: dict, keep: set[str], consts: dict, bias,
                        unbiased: dict[int, Step]):
    """The fused step's bias with the residual's own bias folded in, where the residual z is a convolution's
    output with a constant bias that only the fused Add reads (a projection shortcut: relu(conv(x) + b +
    conv_s(x_s) + b_s) = relu(conv(x) + conv_s(x_s) + (b + b_s))).  That convolution is then run without its bias
    (``unbiased[p]``, its step), where Inductor adds the bias in a kernel of its own after cuDNN's (ResNet-50: 4
    such kernels of 1.1-1.6 µs, H200).  Returns the fused step's bias argument, ``bias`` where nothing folds."""
    if p is None or p in unbiased:
        return bias
    st = steps[p]
    z = st.outputs[0] if len(st.outputs) == 1 else None
    b_s = st.args[2] if len(st.args) > 2 else None
    if not (isinstance(st.fn, _ConvFn) and z is not None and z not in keep and readers.get(z) == [add]
            and b_s is not None and b_s[0] == "c"):
        return bias
    if bias is not None and consts[bias[1]].shape != consts[b_s[1]].shape:  # both Conv's 1-d bias [M], else left
        return bias
    unbiased[p] = Step(st.fn, st.args[:2], st.outputs, st.node)
    if bias is None:
        return b_s
    a, b = consts[bias[1]], consts[b_s[1]]
    key = f"c{len(consts)}"
    while key in consts:
        key += "_"
    consts[key] = (a.float() + b.float()).to(a.dtype)  # summed in fp32, rounded once
    return ("c", key)


#: what the converter writes for a given graph; part of a compiled engine's cache key (a cache entry holds the
#: converted weights' layout): 2 stores a MatMul's constant weight transposed (``_linear_weights``); 3 multiplies
#: an X of rank 3 or more by a 2-d W as one product over X's rows (``_matmul``); 4 hands a planned convolution
#: its input channels-last and dense (``_ConvFn._planned``); 5 runs a CUDA engine's patch embedding as a matrix
#: product (``_conv_as_patch_gemm``); 6 folds a projection shortcut's bias into the fused residual step
#: (``_fold_shortcut_bias``) and asks for the fused steps' inputs channels-last (``_ConvFn.relu_fused``); 7
#: computes what ONNX does where 6 did not (Resize by scales, pools with ceil_mode cropped, TopK's ties, Flatten's
#: negative axis, Slice's clamped start, ...): a cached engine of 6 may hold the old results; 8 runs LSTM, GRU and
#: RNN layers as torch's own where it computes the same (``recurrent_op``); 9 fuses a convolution's SiLU into its
#: cuDNN plan (``_fuse_conv_silu``); 10 fuses a convolution's residual Add into its plan (``_fuse_conv_add``),
#: which 9 had written but left off: a cached engine of 9 runs those Adds apart; 11 stores the weights of the
#: convolutions left to torch channels-last on CUDA (``_channels_last_conv_weights``): a cached engine of 10
#: transposes them at every call; 12 compiles with wide Concats read in place by their pointwise readers
#: (``torch.POINTWISE_CAT_INPUTS``, an Inductor setting rather than the converter's): a cached engine of 11 copies them;
#: 13 stores a grouped convolution's weight channels-last where Inductor runs the graph so
#: (``inductor_runs_channels_last``): a cached engine of 12 transposes it at every call; 14 runs convolutions of
#: narrow groups as the Triton kernel too (``conv_triton``, op ``grouped_conv2d``): a cached engine of 13 with
#: ``conv_kernels`` "triton" calls the depthwise op it replaced
CONVERTER_VERSION = 14


def _transposed_weight(fn):
    """``fn(a, w, *rest)`` called with ``w`` the transpose (a view) of the weight stored transposed."""
    def call(a, wt, *rest):
        return fn(a, wt.t(), *rest)
    return call


def _linear_weights(steps: list, consts: dict, op_of: dict[int, str], keep: set[str]) -> int:
    """MatMul X·W and the GEMM-epilogue node act(X·W + B) with a constant 2-d W [K, N]: W stored transposed,
    [N, K] contiguous, and multiplied as the transposed view of that, which is torch's Linear layout (the weight
    [out, in]; cuBLAS's "TN" GEMM).  Exporters fold Linear's transpose into the constant, so a model exported
    from PyTorch reaches here as X·W with W [in, out] ("NN"); stored this way cuBLAS gets the problem
    torch.compile of the PyTorch model gives it (every GEMM of ViT-B/16's engine runs the same "TN" kernels as
    torch.compile's, bench/kernel_profile.py --against-compile).  On its own it moved ViT-B/16 little on the H100
    (1.536 -> 1.466 ms at batch 1): its slow "384x8" kernel was the batched product ``_matmul`` now avoids.
    Only a weight that no other step reads and no graph output is (``keep``); returns how many were stored
    transposed."""
    done = 0
    for key, where in constant_uses(steps).items():
        t = consts[key]
        if key in keep or t.dim() != 2 or not t.is_floating_point():
            continue
        if not all(j == 1 and op_of.get(i) in ("MatMul", fused_ops.GEMM_ACTIVATION) and steps[i].args[0] is not None
                   and steps[i].args[0][0] == "v" for i, j in where):
            continue
        consts[key] = t.t().contiguous()
        for i, _ in where:
            st = steps[i]
            steps[i] = Step(_transposed_weight(st.fn), st.args, st.outputs, st.node)
        done += 1
    return done


def _recurrent_weights(steps: list, consts: dict, keep: set[str]) -> int:
    """The constant W, R and B of each recurrent layer run as torch's own (``_torch_rnn``) stored in torch's gate
    order, and its step the one that takes them so: otherwise every call reorders them, a copy per weight in the
    captured graph at each replay (Sequencer2D-S: 36 layers, two directions each).  Only constants that no other
    step reads and no graph output is (``keep``); returns how many layers take their weights so."""
    uses: dict[str, int] = {}
    for st in steps:
        for a in st.args:
            if a is not None and a[0] == "c":
                uses[a[1]] = uses.get(a[1], 0) + 1
    done = 0
    for i, st in enumerate(steps):
        to_torch = getattr(st.fn, "torch_gate_order", None)
        if to_torch is None:
            continue
        w, r, b = (list(st.args) + [None] * 4)[1:4]
        if not (w and w[0] == "c" and r and r[0] == "c") or (b is not None and b[0] != "c"):  # W, R (and B) constant
            continue
        refs = [w[1], r[1], b[1] if b is not None else None]
        if any(k is not None and (k in keep or uses[k] != 1) for k in refs):
            continue
        for j, k in enumerate(refs):
            if k is not None:
                consts[k] = to_torch(consts[k], bias=j == 2)
        steps[i] = Step(st.fn.ordered, st.args, st.outputs, st.node)
        done += 1
    return done


def convert(model: onnx.ModelProto, dtype: str = "float32", *, fuse_conv_relu: bool = False,
            fuse_attention: bool = True, fuse_gemm_epilogue: bool = False, conv_kernels: str = "cudnn",
            cudnn_plans: bool = False, patch_gemm: bool = False, one_row_reduction: bool = False,
            conv_relu_unfused=(), fuse_conv_plans: bool = False, conv_channels_padded=(),
            conv_weights_channels_last: bool = False):
    """The ONNX model as an ``OnnxModule`` computing in ``dtype`` ("float32", "float16", "bfloat16").

    Graph inputs are taken in any float dtype and cast to the compute dtype inside
    ``forward``'s first consumers (callers do that; see ``TorchEngine``).  Raises
    ``UnsupportedOp`` naming the first node it cannot convert.  ``fuse_conv_relu`` (CUDA
    only: cuDNN's fused kernels) turns each 2-d Conv whose only reader is a Relu into one step, and each
    2-d Conv + residual Add + Relu into one ``torch.cudnn_convolution_add_relu`` step, but those whose
    ``cudnn_fused.conv_key`` is in ``conv_relu_unfused`` (the shapes a GPU build timed slower fused), and those
    of a Conv -> Relu in ``conv_channels_padded`` on their channels padded (``cudnn_fused.padded_channels``); with
    ``fuse_conv_plans`` too (CUDA engines that may call the plans' op), the epilogues only a cuDNN plan runs fused:
    each 2-d Conv whose output only its SiLU (Sigmoid and Mul) reads into one conv + bias + SiLU plan
    (``_fuse_conv_silu``), and each Conv + residual Add that no Relu
    follows into one conv + bias + add plan (``_fuse_conv_add``), on the same terms.
    ``fuse_attention`` runs each attention node (``core/fused_ops.py``) as one SDPA kernel; off, as the
    matmul-softmax-matmul it replaced.  ``fuse_gemm_epilogue`` (CUDA engines: cuBLASLt's kernel, whose GELU is
    the tanh approximation there) runs each matmul-bias-activation node as one ``torch._addmm_activation``; off,
    as the matmul, add and activation it replaced.  ``conv_kernels`` "inductor" writes depthwise convolutions as
    ops Inductor compiles (``_conv_as_kernels``); "cudnn" runs every convolution as torch's convolution, and with
    ``cudnn_plans`` (CUDA engines) its depthwise ones (``depthwise_convs``) through cuDNN plans the engine ships
    (``cudnn_plans.py``: cuDNN's runtime-compiled depthwise kernels, built once at build instead of at every start).
    ``patch_gemm`` (CUDA engines) runs a convolution over non-overlapping patches of an image's few channels (a
    patch embedding) as one matrix product (``_conv_as_patch_gemm``).  ``one_row_reduction`` (CUDA engines without
    the GEMM epilogue) runs each Linear of one row (``one_row_linears``) as one reduction.
    ``conv_kernels`` "triton" runs depthwise convolutions and those of narrow groups (``triton_convs``) as
    parastream's own Triton kernel (``_TritonConv``), their weights stored taps-major.
    ``conv_weights_channels_last`` (CUDA engines) stores the weight of every other dense 2-d convolution with a
    kernel wider than 1x1 channels-last too (``_channels_last_conv_weights``).
    """
    torch = _torch()
    float_dtype = getattr(torch, dtype)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 17)
    g = model.graph
    init_names = {t.name for t in g.initializer}
    values: dict[str, Value] = {}
    for t in g.initializer:
        values[t.name] = Value(t.name, tuple(t.dims), None, _np_to_torch(numpy_helper.to_array(t)))
        values[t.name].dtype = values[t.name].const.dtype
    input_names = []
    for vi in g.input:
        if vi.name in init_names:
            continue
        tt = vi.type.tensor_type
        shape = tuple(int(d.dim_value) if d.HasField("dim_value") else -1 for d in tt.shape.dim)
        if any(s < 0 for s in shape):
            raise UnsupportedOp(f"input {vi.name!r}: the torch backend needs static shapes (build with --shapes)")
        dt = torch_dtype(tt.elem_type)
        values[vi.name] = Value(vi.name, shape, float_dtype if dt.is_floating_point else dt)
        input_names.append(vi.name)

    inferred = static_shapes([*g.value_info, *g.output])
    steps: list[Step] = []
    op_of: dict[int, str] = {}
    consts: dict[str, object] = {}
    const_key: dict[int, str] = {}
    const_names: dict[str, str] = {}  # buffer -> the ONNX value it holds (for what a build records of its weights)

    def buffer_for(v: Value) -> str:
        key = const_key.get(id(v.const))
        if key is None:
            key = f"c{len(consts)}"
            consts[key] = _cast_const(v.const, float_dtype)
            const_key[id(v.const)] = key
            if v.name:
                const_names[key] = v.name
        return key

    lowered = lowered_convs(model, conv_kernels) if conv_kernels in LOWERED_CONV_KERNELS else (
        depthwise_convs(model) if cudnn_plans else set())
    depthwise_kernels = conv_kernels if conv_kernels in LOWERED_CONV_KERNELS else "planned"
    one_row = one_row_linears(model) if one_row_reduction else set()
    for index, node in enumerate(g.node):
        op_key = node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}.{node.op_type}"
        if node.domain not in ("", "ai.onnx", fused_ops.DOMAIN):
            raise UnsupportedOp(f"node {node.name!r} ({node.domain}:{node.op_type}): custom domain ops are not supported by the torch backend")
        ins = [values.get(i) if i else None for i in node.input]
        for i, name in enumerate(node.input):
            if name and ins[i] is None:
                raise UnsupportedOp(f"node {node.name!r} ({node.op_type}): input {name!r} is produced by no earlier node")
        conv = CONVERTERS.get(op_key)
        nv = NodeView(node, ins, opset, float_dtype, inferred, fuse_attention, fuse_gemm_epilogue=fuse_gemm_epilogue,
                      conv_kernels=depthwise_kernels if index in lowered else "cudnn", patch_gemm=patch_gemm,
                      one_row_reduction=index in one_row)
        if conv is None:
            nv.fail("op not supported by the torch backend (launcher/engines/onnx_torch.py lists the ops it maps)")
        fn = conv(nv)
        outs = [o for o in node.output]
        all_const = isinstance(fn, _ConstFn) or all(v is None or v.is_const for v in ins)
        if all_const:
            with torch.no_grad():
                res = fn(*[v.const if v is not None else None for v in ins])
            res = res if isinstance(res, (tuple, list)) else (res,)
            for name, r in zip(outs, res):
                if name:
                    r = r.contiguous() if isinstance(r, torch.Tensor) else torch.tensor(r)
                    values[name] = Value(name, tuple(r.shape), r.dtype, r)
            continue
        # run on meta tensors for output shapes and dtypes
        meta_in = []
        for v in ins:
            if v is None:
                meta_in.append(None)
            elif v.is_const:
                meta_in.append(_cast_const(v.const, float_dtype).to("meta"))
            else:
                meta_in.append(torch.empty(v.shape, dtype=v.dtype, device="meta"))
        try:
            with torch.no_grad():
                res = fn(*meta_in)
        except UnsupportedOp:
            raise
        except Exception as e:  # noqa: BLE001 - report the node
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UnsupportedOp(f"node {nv.name!r} ({node.op_type}): torch cannot run it as converted: {first}") from None
        if isinstance(res, (tuple, list)) and len(outs) == 1:
            # a converter that returns every output the op can have, of a node that lists one: the step's value
            # is that one (the module's forward keeps a one-output step's result as it is)
            fn = _first_of(fn)
        res = res if isinstance(res, (tuple, list)) else (res,)
        args = []
        for v in ins:
            if v is None:
                args.append(None)
            elif v.is_const:
                args.append(("c", buffer_for(v)))
            else:
                args.append(("v", v.name))
        op_of[len(steps)] = node.op_type
        steps.append(Step(fn, args, outs, nv.name))
        for name, r in zip(outs, res):
            if name:
                values[name] = Value(name, tuple(r.shape), r.dtype)

    output_refs = []
    for vi in g.output:
        v = values.get(vi.name)
        if v is None:
            raise UnsupportedOp(f"graph output {vi.name!r} is produced by no node")
        output_refs.append(("c", buffer_for(v)) if v.is_const else ("v", v.name))
    fused = residual = silu = added = widened = 0
    linear = _linear_weights(steps, consts, op_of, {ref for kind, ref in output_refs if kind == "c"})
    recurrent = _recurrent_weights(steps, consts, {ref for kind, ref in output_refs if kind == "c"})
    taps_major = _conv_taps_major(steps, consts, {ref for kind, ref in output_refs if kind == "c"})
    if fuse_conv_relu:
        keep = {ref for kind, ref in output_refs if kind == "v"}
        shapes = {k: v.shape for k, v in values.items()}
        unfused = frozenset(conv_relu_unfused)
        steps, residual, op_of = _fuse_conv_add_relu(steps, keep, consts, op_of, shapes, unfused)
        if fuse_conv_plans:
            steps, silu, op_of = _fuse_conv_silu(steps, keep, consts, op_of, shapes, unfused)
            steps, added, op_of = _fuse_conv_add(steps, keep, consts, op_of, shapes, unfused)
        steps, fused, widened = _fuse_conv_relu(steps, keep, consts, op_of, shapes, unfused,
                                                frozenset(conv_channels_padded),
                                                frozenset(ref for kind, ref in output_refs if kind == "c"))
    plain_cl, layout = 0, None
    if conv_weights_channels_last:
        plain_cl, layout = _channels_last_conv_weights(
            steps, consts, {ref for kind, ref in output_refs if kind == "c"}, {k: v.shape for k, v in values.items()})
    module = _module_class()(steps, input_names, output_refs, consts, float_dtype)
    module.fused_conv_relu = fused
    module.padded_conv_relu = widened
    module.fused_conv_add_relu = residual
    module.fused_conv_silu = silu
    module.fused_conv_add = added
    module.channels_last_conv_weights = plain_cl
    module.inductor_channels_last = layout  # (the layout decision the grouped weights followed)
    module.const_names = {k: n for k, n in const_names.items() if k in consts}
    module.linear_weights = linear
    module.recurrent_weights = recurrent
    module.taps_major_weights = taps_major
    module.patch_gemm_convs = sum(bool(getattr(st.fn, "patch_gemm", False)) for st in steps)
    module.eval()
    module.output_specs = [(vi.name, values[vi.name].shape, values[vi.name].dtype) for vi in g.output]
    return module


def supported_ops() -> list[str]:
    return sorted(CONVERTERS)


#: Constants on a device, by content: engines of the same weights share one copy (the buckets of a
#: dynamic-batch bundle hold the same weights in every bucket: BERT-base kept ~220 MB per bucket on the
#: H100 before).  Weak values: a tensor goes when the last module holding it goes.
_SHARED_CONSTANTS: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()


def to_device_shared(module, device):
    """``module.to(device)``, with each constant buffer replaced by an equal one already on ``device`` for
    another module, where one is.  Equal means same dtype, shape, strides and bytes (sha256 of the host
    copy, taken before the move).  The modules never write their constants, so sharing them is safe."""
    torch = _torch()
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # "cuda" is the current GPU: keyed by its number, so that
        device = torch.device("cuda", torch.cuda.current_device())  # a module on GPU 1 never gets GPU 0's constants
    keys = {}
    for name, t in module.named_buffers():
        host = t.detach().reshape(-1).cpu()
        digest = hashlib.sha256(host.view(torch.uint8).numpy().tobytes() if host.numel() else b"").hexdigest()
        keys[name] = (str(device), str(t.dtype), tuple(t.shape), tuple(t.stride()), digest)
    module = module.to(device)
    for name, t in list(module.named_buffers()):
        shared = _SHARED_CONSTANTS.get(keys[name])
        if shared is None:
            _SHARED_CONSTANTS[keys[name]] = t
            continue
        owner, _, attr = name.rpartition(".")
        (module.get_submodule(owner) if owner else module)._buffers[attr] = shared
    return module


def to_fx(module):
    """The module as a ``torch.fx.GraphModule``: its forward run once on FX proxies (no Python loop left)."""
    import re

    torch = _torch()
    fx = torch.fx
    graph = fx.Graph()
    tracer = fx.proxy.GraphAppendingTracer(graph)
    args = []
    for i, name in enumerate(module.input_names):
        ident = re.sub(r"\W", "_", name)
        ident = ident if ident and not ident[0].isdigit() else f"in_{i}_{ident}"
        args.append(fx.Proxy(graph.placeholder(ident), tracer))

    class _Attrs:
        def __getattr__(self, key):
            return fx.Proxy(graph.get_attr(key), tracer)

    outs = type(module).forward(_ProxyModule(module, _Attrs()), *args)
    graph.output(tuple(o.node for o in outs))
    gm = fx.GraphModule(module, graph)
    gm.input_names = list(module.input_names)
    gm.output_specs = module.output_specs
    return gm


class _ProxyModule:
    """Stands in for ``self`` in ``OnnxModule.forward`` while tracing: buffers become get_attr nodes."""

    def __init__(self, module, attrs):
        self._module = module
        self._attrs = attrs
        self.input_names = module.input_names
        self._steps = module._steps
        self._output_refs = module._output_refs

    def __getattr__(self, key):
        return getattr(self._attrs, key)
