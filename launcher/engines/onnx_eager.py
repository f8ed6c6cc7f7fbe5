"""An ONNX graph run node by node as torch ops, its shapes read at run time: a bundle's data-dependent tail on the
GPU (launcher/tail.py).

Why not ``onnx_torch`` (the engines' converter): it folds everything computable from shapes at conversion and
plans every value's shape before the first run, which is what makes an engine fast and what a tail cannot have
(a ``NonZero``'s output has as many columns as the data has scores above a threshold).  Why not onnx2torch, which
does compute shapes at run time: it has no ``If`` and no ``GatherND``, both in every torchvision detector's
post-processing.  And why not ONNX Runtime's CUDA provider: it is not what a torch deployment has.

How it runs: each node becomes, once at load, a closure over its attributes (``OPS[op_type](node)``); a call
walks the closures in the graph's order.  Values are torch tensors; a value computed from shapes (``Shape``,
``Gather`` of a shape, ``Concat`` of those) stays on the host, so that reading it as a Python number (a
``Reshape``'s shape, a ``TopK``'s k) costs no wait for the GPU; an op that reads a tensor on the GPU runs there,
the small host tensors it also reads copied over.  The waits left are the ones the data forces: ``NonZero``'s
count, an ``If``'s condition, ``NonMaxSuppression``'s selection.

An op outside ``OPS`` (a ``Loop``, a mask head's convolutions) is ``UnsupportedOp`` at load naming the node:
the tail then stays on the host.  ``NonMaxSuppression`` and ``RoiAlign`` need torchvision: RoiAlign runs as its
op, NMS as its op or, over many candidates, group by group in torch ops (``nms_in_groups``).  A node that repeats an earlier one's computation runs once (``EagerGraph``), and
a node whose inputs are all small host tensors keeps its results by their values, so that the shape arithmetic
of a call whose counts repeat an earlier call's is read rather than computed (``EagerGraph.run``).
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from parastream.core import dataflow

from .onnx_torch import UnsupportedOp, torch_dtype


def _torch():
    import torch

    return torch


class _Node:
    """A node's attributes as Python values, the inputs known at load (initializers, ``Constant`` outputs), and
    its name for errors."""

    def __init__(self, node: onnx.NodeProto, opset: int, known: dict | None = None, device=None):
        self.node, self.opset, self.op = node, opset, node.op_type
        self.device = device  # the graph's device (``EagerGraph``), None on the host
        self.name = node.name or f"{node.op_type}({', '.join(node.output)})"
        self.attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        self._known = known or {}

    def attr(self, key, default=None):
        v = self.attrs.get(key, default)
        return v.decode() if isinstance(v, bytes) else v

    def known(self, i: int):
        """Input ``i``'s value where it is known at load (a tensor on the host), else None."""
        name = self.node.input[i] if i < len(self.node.input) else ""
        return self._known.get(name) if name else None

    def ints(self, i: int) -> list[int] | None:
        """Input ``i`` as Python ints where it is known at load (a shape, axes, a k: read once, not per call)."""
        v = self.known(i)
        return None if v is None else _ints(v)

    def given(self, i: int) -> bool:
        return i < len(self.node.input) and bool(self.node.input[i])


OPS: dict[str, Callable[[_Node], Callable]] = {}
#: the most elements of an integer tensor kept on the host (a shape, axes, a few indices: read there by the
#: shape arithmetic); a larger one is data, placed on the graph's device
_HOST_MAX = 64


def _op(*names):
    def register(make):
        for n in names:
            OPS[n] = make
        return make
    return register


def _device_of(xs):
    """The first non-host device among ``xs``' tensors, or None (all on the host)."""
    for x in xs:
        if x is not None and x.device.type != "cpu":
            return x.device
    return None


def _together(*xs, scalars: bool = False):
    """``xs`` on one device: the host tensors moved to the device one of them is on.  ``scalars``: 0-d host
    tensors stay (torch's elementwise ops take them beside device tensors as numbers, with no copy)."""
    dev = _device_of(xs)
    if dev is None:
        return xs
    return tuple(x if x is None or x.device == dev or (scalars and x.dim() == 0) else x.to(dev, non_blocking=True)
                 for x in xs)


def _ints(x) -> list[int]:
    """A tensor of integers (a shape, axes, a k) as Python ints: free on the host, a wait on the GPU."""
    return [int(v) for v in x.reshape(-1).tolist()]


def _axis(a: int, rank: int) -> int:
    return a + rank if a < 0 else a


# -- elementwise ---------------------------------------------------------------------------------------------

def _elementwise(fn):
    def make(n: _Node):
        def run(*xs):
            return fn(*_together(*xs, scalars=True))
        return run
    return make


def _div(a, b):
    torch = _torch()
    if a.dtype.is_floating_point:
        return a / b
    return torch.div(a, b, rounding_mode="trunc")  # ONNX Runtime's integer Div truncates toward zero


for _name, _fn in {
    "Add": lambda a, b: a + b, "Sub": lambda a, b: a - b, "Mul": lambda a, b: a * b, "Div": _div,
    "Pow": lambda a, b: _torch().pow(a, b).to(a.dtype),
    "Equal": lambda a, b: a == b, "Greater": lambda a, b: a > b, "Less": lambda a, b: a < b,
    "GreaterOrEqual": lambda a, b: a >= b, "LessOrEqual": lambda a, b: a <= b,
    "And": lambda a, b: a & b, "Or": lambda a, b: a | b, "Xor": lambda a, b: a ^ b,
    "Where": lambda c, a, b: _torch().where(c, a, b),
    "Neg": lambda x: -x, "Abs": lambda x: x.abs(), "Exp": lambda x: x.exp(), "Log": lambda x: x.log(),
    "Sqrt": lambda x: x.sqrt(), "Sigmoid": lambda x: x.sigmoid(), "Relu": lambda x: x.relu(),
    "Tanh": lambda x: x.tanh(), "Floor": lambda x: x.floor(), "Ceil": lambda x: x.ceil(),
    "Round": lambda x: x.round(), "Reciprocal": lambda x: x.reciprocal(), "Sign": lambda x: x.sign(),
    "Not": lambda x: ~x, "IsNaN": lambda x: x.isnan(), "Erf": lambda x: x.erf(),
    "Sin": lambda x: x.sin(), "Cos": lambda x: x.cos(), "Identity": lambda x: x,
}.items():
    OPS[_name] = _elementwise(_fn)


@_op("Mod")
def _mod(n: _Node):
    torch = _torch()
    fn = torch.fmod if n.attr("fmod", 0) else torch.remainder  # fmod 0: the divisor's sign, as Python's %
    return lambda a, b: fn(*_together(a, b, scalars=True))


@_op("Min", "Max", "Sum", "Mean")
def _variadic(n: _Node):
    torch = _torch()
    pair = {"Min": torch.minimum, "Max": torch.maximum, "Sum": torch.add, "Mean": torch.add}[n.op]

    def run(*xs):
        xs = _together(*xs)
        out = xs[0]
        for x in xs[1:]:
            out = pair(out, x)
        return out / len(xs) if n.op == "Mean" else out
    return run


@_op("Clip")
def _clip(n: _Node):
    torch = _torch()
    if n.opset < 11:
        lo, hi = n.attr("min"), n.attr("max")
        return lambda x: torch.clamp(x, lo, hi)

    def run(x, lo=None, hi=None):
        lo = None if lo is None else lo.item()  # (0-d, a constant or a value the host holds)
        hi = None if hi is None else hi.item()
        return x if lo is None and hi is None else torch.clamp(x, lo, hi)
    return run


@_op("Cast")
def _cast(n: _Node):
    dtype = torch_dtype(n.attr("to"))
    return lambda x: x.to(dtype)


@_op("CastLike")
def _castlike(n: _Node):
    return lambda x, like: x.to(like.dtype)


# -- constants and shapes ------------------------------------------------------------------------------------

def _tensor(proto: onnx.TensorProto):
    torch = _torch()
    return torch.from_numpy(np.array(numpy_helper.to_array(proto), order="C"))


@_op("Constant")
def _constant(n: _Node):
    torch = _torch()
    key, v = next(iter(n.attrs.items()))
    if key == "value":
        t = _tensor(v)
    elif key in ("value_float", "value_int"):
        t = torch.tensor(v, dtype=torch.float32 if key == "value_float" else torch.int64)
    elif key in ("value_floats", "value_ints"):
        t = torch.tensor(list(v), dtype=torch.float32 if key == "value_floats" else torch.int64)
    else:
        raise UnsupportedOp(f"node {n.name!r} (Constant): attribute {key} is not supported on the GPU")
    return lambda: t


@_op("Shape")
def _shape(n: _Node):
    """The shape as a host tensor, one per distinct shape (no op of this table writes into its inputs): a detector's
    tail takes the shape of each class's candidates, and each new tensor was four of torch's host ops."""
    torch = _torch()
    start, end = n.attr("start", 0), n.attr("end")
    made: dict[tuple, object] = {}

    def run(x):
        dims = tuple(x.shape[start:end] if end is not None else x.shape[start:])
        t = made.get(dims)
        if t is None:
            if len(made) >= 256:
                made.clear()
            t = made[dims] = torch.tensor(dims, dtype=torch.int64)
        return t
    return run


@_op("Size")
def _size(n: _Node):
    torch = _torch()
    return lambda x: torch.tensor(x.numel(), dtype=torch.int64)


@_op("ConstantOfShape")
def _const_of_shape(n: _Node):
    """A filled tensor: on the graph's device where it has more than ``_HOST_MAX`` elements (a detector's label
    per candidate, concatenated with device tensors next: made there, not copied there), else on the host (a
    shape's worth, read by the host's shape arithmetic)."""
    torch = _torch()
    v = _tensor(n.attrs["value"]) if "value" in n.attrs else torch.zeros(1, dtype=torch.float32)
    fill, dtype, device = v.reshape(-1)[0].item(), v.dtype, n.device

    def run(shape):
        dims = _ints(shape)
        big = device is not None and math.prod(dims) > _HOST_MAX
        return torch.full(dims, fill, dtype=dtype, device=device if big else None)
    return run


@_op("Range")
def _range(n: _Node):
    torch = _torch()

    def run(start, limit, delta):
        dtype = start.dtype
        return torch.arange(start.item(), limit.item(), delta.item(), dtype=dtype)
    return run


# -- indexing ------------------------------------------------------------------------------------------------

def _wrapped(idx, size: int):
    """Negative indices counted from the end, as ONNX allows: one remainder (an index in [-size, size) lands where
    ONNX says; one outside it, which ONNX Runtime refuses, wraps)."""
    return _torch().remainder(idx, size)


def _gather_index(idx, size: int, device):
    """``idx`` flattened and wrapped, on ``device``: a few indices the host holds (a shape's position, the usual
    case) wrapped there, as numbers, with no kernel."""
    torch = _torch()
    if idx.device.type == "cpu" and idx.numel() <= _HOST_MAX:
        return torch.tensor([i + size if i < 0 else i for i in idx.reshape(-1).tolist()], dtype=torch.int64,
                            device=device)
    return _wrapped(idx.to(device).reshape(-1), size)


@_op("Gather")
def _gather(n: _Node):
    axis = n.attr("axis", 0)
    known = n.known(1)
    if known is not None and known.dim() == 0:  # one position known at load (a shape's dimension): a view
        at = int(known)

        def one(data, idx):
            a = _axis(axis, data.dim())
            return data.select(a, at + data.shape[a] if at < 0 else at)
        return one

    # a known index without negatives is the same for every size of the axis: copied to each device once (one
    # with negatives is wrapped per call, the axis's size changing with the data)
    cached: dict | None = {} if known is not None and (known.numel() == 0 or int(known.min()) >= 0) else None

    def run(data, idx):
        a = _axis(axis, data.dim())
        if known is not None:
            flat = cached.get(data.device) if cached is not None else None
            if flat is None:
                flat = _gather_index(known, data.shape[a], data.device)
                if cached is not None:
                    cached[data.device] = flat
            return data.index_select(a, flat).reshape((*data.shape[:a], *known.shape, *data.shape[a + 1:]))
        if idx.dim() == 0 and idx.device.type == "cpu":  # one position (a shape's dimension): a view
            i = int(idx)
            return data.select(a, i + data.shape[a] if i < 0 else i)
        out = data.index_select(a, _gather_index(idx, data.shape[a], data.device))
        return out.reshape((*data.shape[:a], *idx.shape, *data.shape[a + 1:]))
    return run


@_op("GatherElements")
def _gather_elements(n: _Node):
    torch = _torch()
    axis = n.attr("axis", 0)

    def run(data, idx):
        data, idx = _together(data, idx)
        a = _axis(axis, data.dim())
        return torch.gather(data, a, _wrapped(idx, data.shape[a]))
    return run


@_op("GatherND")
def _gather_nd(n: _Node):
    b = n.attr("batch_dims", 0)

    def run(data, idx):
        data, idx = _together(data, idx)
        k = idx.shape[-1]
        lead = idx.shape[:-1]
        if b:  # batch axes shared by data and indices: one flat batch, its offsets added to the first index
            batch = int(np.prod(data.shape[:b]))
            rows = data.reshape((batch, *data.shape[b:]))
            flat_idx = idx.reshape(batch, -1, k)
            picked = [rows[i][tuple(_wrapped(flat_idx[i][:, j], rows.shape[1 + j]) for j in range(k))]
                      for i in range(batch)]
            out = _torch().stack(picked) if picked else rows[:0]
            return out.reshape((*lead, *data.shape[b + k:]))
        if k == 1:  # rows of the first axis (a NonZero's over a flat score vector): one index_select
            out = data.index_select(0, _gather_index(idx, data.shape[0], data.device))
            return out.reshape((*lead, *data.shape[1:]))
        flat_idx = idx.reshape(-1, k)
        out = data[tuple(_wrapped(flat_idx[:, j], data.shape[j]) for j in range(k))]
        return out.reshape((*lead, *data.shape[k:]))
    return run


@_op("Slice")
def _slice(n: _Node):
    torch = _torch()
    if n.opset < 10:
        fixed = (n.attr("starts"), n.attr("ends"), n.attr("axes"), None)
    elif all(n.known(i) is not None or not n.given(i) for i in range(1, 5)):  # read once, at load
        fixed = tuple(n.ints(i) if n.given(i) else None for i in range(1, 5))
    else:
        fixed = None

    def run(x, starts=None, ends=None, axes=None, steps=None):
        if fixed is not None:
            st, en, ax, sp = fixed
        else:
            st, en = _ints(starts), _ints(ends)
            ax = _ints(axes) if axes is not None else None
            sp = _ints(steps) if steps is not None else None
        ax = list(range(len(st))) if ax is None else ax
        sp = [1] * len(st) if sp is None else sp
        for s, e, a, step in zip(st, en, ax, sp):
            a = _axis(a, x.dim())
            dim = x.shape[a]
            # ONNX's clamping (the operator's spec): negative counts from the end, then into [0, dim] going
            # forward and [-1, dim - 1] going backward
            s = s + dim if s < 0 else s
            e = e + dim if e < 0 else e
            if step > 0:
                s, e = min(max(s, 0), dim), min(max(e, 0), dim)
                x = x.narrow(a, s, max(e - s, 0)) if step == 1 else x.index_select(
                    a, torch.arange(s, e, step, device=x.device))
            else:
                s, e = min(max(s, -1), dim - 1), min(max(e, -1), dim - 1)
                x = x.index_select(a, torch.arange(s, e, step, device=x.device))
        return x
    return run


@_op("ScatterND")
def _scatter_nd(n: _Node):
    reduction = n.attr("reduction", "none")
    if reduction != "none":
        raise UnsupportedOp(f"node {n.name!r} (ScatterND): reduction {reduction!r} is not supported on the GPU")

    def run(data, idx, updates):
        data, idx, updates = _together(data, idx, updates)
        out = data.clone()
        k = idx.shape[-1]
        flat = idx.reshape(-1, k)
        out[tuple(_wrapped(flat[:, j], data.shape[j]) for j in range(k))] = updates.reshape((-1, *data.shape[k:]))
        return out
    return run


@_op("NonZero")
def _nonzero(n: _Node):
    torch = _torch()
    return lambda x: torch.nonzero(x.reshape(1) if x.dim() == 0 else x).T.contiguous()


@_op("TopK")
def _topk(n: _Node):
    """The k largest (or smallest) along ``axis``, in order, equal values lowest index first as ONNX specifies:
    a stable sort cut at k (``torch.topk`` leaves the order of ties to its kernel, and a detector's scores tie,
    as an untrained head's do)."""
    torch = _torch()
    axis, largest = n.attr("axis", -1), bool(n.attr("largest", 1))
    fixed_k = n.attr("k") if "k" in n.attrs else (n.ints(1) or [None])[0]  # an attribute before opset 10

    def run(x, k=None):
        kk = fixed_k if fixed_k is not None else _ints(k)[0]
        a = _axis(axis, x.dim())
        values, indices = torch.sort(x, dim=a, descending=largest, stable=True)
        return values.narrow(a, 0, kk), indices.narrow(a, 0, kk)
    return run


@_op("ArgMax", "ArgMin")
def _arg(n: _Node):
    torch = _torch()
    axis, keep, last = n.attr("axis", 0), bool(n.attr("keepdims", 1)), bool(n.attr("select_last_index", 0))
    pick = torch.argmax if n.op == "ArgMax" else torch.argmin

    def run(x):
        a = _axis(axis, x.dim())
        if last:  # the last of equal extremes: the first one of the flipped axis
            return x.shape[a] - 1 - pick(x.flip(a), dim=a, keepdim=keep)
        return pick(x, dim=a, keepdim=keep)
    return run


# -- layout --------------------------------------------------------------------------------------------------

@_op("Reshape")
def _reshape(n: _Node):
    allowzero = bool(n.attr("allowzero", 0))
    fixed = n.ints(1)

    def run(x, shape):
        want = list(fixed) if fixed is not None else _ints(shape)
        if not allowzero:  # 0 keeps the input's dimension there
            want = [x.shape[i] if d == 0 else d for i, d in enumerate(want)]
        if x.numel() == 0:  # torch cannot infer -1 for no elements: ONNX Runtime infers 0
            want = [0 if d == -1 else d for d in want]
        return x.reshape(want)
    return run


@_op("Flatten")
def _flatten(n: _Node):
    axis = n.attr("axis", 1)

    def run(x):
        a = _axis(axis, x.dim())
        return x.reshape(int(np.prod(x.shape[:a], dtype=np.int64)), int(np.prod(x.shape[a:], dtype=np.int64)))
    return run


@_op("Transpose")
def _transpose(n: _Node):
    perm = n.attr("perm")
    return lambda x: x.permute(*(perm if perm is not None else range(x.dim() - 1, -1, -1)))


def _axes(n: _Node, i: int = 1) -> Callable:
    """A reader of a node's axes (``read(the input) -> list or None``): the attribute before the opset that made
    them an input, the input where it is known at load, else the input read at run time (None: absent)."""
    fixed = list(n.attrs["axes"]) if "axes" in n.attrs else n.ints(i)
    if fixed is not None or not n.given(i):
        return lambda given: fixed
    return lambda given: None if given is None else _ints(given)


@_op("Squeeze")
def _squeeze(n: _Node):
    read = _axes(n)

    def run(x, axes=None):
        ax = read(axes)
        if ax is None:
            return x.reshape([d for d in x.shape if d != 1])
        ax = {_axis(a, x.dim()) for a in ax}
        return x.reshape([d for i, d in enumerate(x.shape) if i not in ax])
    return run


@_op("Unsqueeze")
def _unsqueeze(n: _Node):
    read = _axes(n)

    def run(x, axes=None):
        ax = read(axes)
        if len(ax) == 1:  # (the usual case: one axis, one view)
            return x.unsqueeze(_axis(ax[0], x.dim() + 1))
        rank = x.dim() + len(ax)
        for a in sorted(_axis(a, rank) for a in ax):
            x = x.unsqueeze(a)
        return x
    return run


@_op("Concat")
def _concat(n: _Node):
    torch = _torch()
    axis = n.attr("axis")

    def run(*xs):
        xs = _together(*xs)
        return torch.cat(xs, dim=_axis(axis, xs[0].dim()))
    return run


@_op("Split")
def _split(n: _Node):
    axis, count = n.attr("axis", 0), len(n.node.output)
    fixed = list(n.attrs["split"]) if "split" in n.attrs else n.ints(1)

    def run(x, split=None):
        a = _axis(axis, x.dim())
        sizes = fixed if fixed is not None else (_ints(split) if split is not None else None)
        if sizes is None:  # equal parts, the last one smaller where they do not divide
            each = -(-x.shape[a] // count)
            sizes = [min(each, x.shape[a] - i * each) for i in range(count)]
        return tuple(x.split(sizes, dim=a))
    return run


@_op("Expand")
def _expand(n: _Node):
    torch = _torch()

    def run(x, shape):
        return x.expand(torch.broadcast_shapes(tuple(x.shape), tuple(_ints(shape))))
    return run


@_op("Tile")
def _tile(n: _Node):
    return lambda x, reps: x.repeat(_ints(reps))


@_op("Pad")
def _pad(n: _Node):
    """Pad (``constant``, ``reflect``, ``edge``; negative pads crop) as ``F.pad``, whose pad list runs from the
    last axis back.  ``reflect`` and ``edge`` pad only the trailing axes torch pads that way (three at most);
    another pad fails at run time and the call is answered on the host (launcher/tail.py)."""
    torch = _torch()
    mode = n.attr("mode", "constant")
    if mode not in ("constant", "reflect", "edge"):
        raise UnsupportedOp(f"node {n.name!r} (Pad): mode {mode!r} is not supported on the GPU")
    fixed = list(n.attrs["pads"]) if "pads" in n.attrs else n.ints(1)
    value_attr = float(n.attr("value", 0.0))  # before opset 11, an attribute

    def run(x, pads=None, value=None, axes=None):
        got = fixed if fixed is not None else _ints(pads)
        rank = x.dim()
        ax = list(range(rank)) if axes is None else [_axis(a, rank) for a in _ints(axes)]
        k = len(ax)
        full = [0] * (2 * rank)
        for a, begin, end in zip(ax, got[:k], got[k:]):
            full[2 * (rank - 1 - a)], full[2 * (rank - 1 - a) + 1] = begin, end
        if mode == "constant":
            v = value.item() if value is not None else value_attr
            return torch.nn.functional.pad(x, full, value=v)
        used = max((i // 2 + 1 for i, q in enumerate(full) if q), default=0)  # the trailing axes padded
        return torch.nn.functional.pad(x, full[:2 * used], mode="reflect" if mode == "reflect" else "replicate")
    return run


# -- reductions ----------------------------------------------------------------------------------------------

@_op("ReduceMin", "ReduceMax", "ReduceSum", "ReduceMean", "ReduceProd")
def _reduce(n: _Node):
    torch = _torch()
    keep, noop = bool(n.attr("keepdims", 1)), bool(n.attr("noop_with_empty_axes", 0))
    kind = n.op[len("Reduce"):]
    read = _axes(n)

    def run(x, axes=None):
        ax = read(axes)
        if not ax:  # no axes: every axis, or none with noop_with_empty_axes
            if noop:
                return x
            ax = list(range(x.dim()))
        ax = sorted(_axis(a, x.dim()) for a in ax)
        if x.numel() == 0 and kind in ("Min", "Max"):  # torch refuses an empty min or max: ONNX's is the identity
            shape = [1 if i in ax else d for i, d in enumerate(x.shape)] if keep else \
                [d for i, d in enumerate(x.shape) if i not in ax]
            info = torch.finfo(x.dtype) if x.dtype.is_floating_point else torch.iinfo(x.dtype)
            inf = float("inf") if x.dtype.is_floating_point else None
            fill = (inf or info.max) if kind == "Min" else (-inf if inf else info.min)
            return torch.full(shape, fill, dtype=x.dtype, device=x.device)
        if kind == "Min":
            return torch.amin(x, dim=ax, keepdim=keep)
        if kind == "Max":
            return torch.amax(x, dim=ax, keepdim=keep)
        if kind == "Sum":
            return torch.sum(x, dim=ax, keepdim=keep, dtype=x.dtype)
        if kind == "Mean":
            return torch.mean(x, dim=ax, keepdim=keep)
        out = x
        for a in reversed(ax):
            out = torch.prod(out, dim=a, keepdim=keep, dtype=x.dtype)
        return out
    return run


@_op("Softmax", "LogSoftmax")
def _softmax(n: _Node):
    torch = _torch()
    axis = n.attr("axis", -1 if n.opset >= 13 else 1)
    fn = torch.softmax if n.op == "Softmax" else torch.log_softmax

    def run(x):
        a = _axis(axis, x.dim())
        if n.opset >= 13:
            return fn(x, dim=a)
        # before opset 13: over the input seen as 2-d, everything from ``axis`` on as one row
        return fn(x.reshape(int(np.prod(x.shape[:a], dtype=np.int64)), -1), dim=1).reshape(x.shape)
    return run


@_op("CumSum")
def _cumsum(n: _Node):
    torch = _torch()
    exclusive, reverse = bool(n.attr("exclusive", 0)), bool(n.attr("reverse", 0))

    def run(x, axis):
        a = _axis(_ints(axis)[0], x.dim())
        y = x.flip(a) if reverse else x
        out = torch.cumsum(y, dim=a, dtype=x.dtype)
        if exclusive:
            out = out - y
        return out.flip(a) if reverse else out
    return run


@_op("MatMul")
def _matmul(n: _Node):
    torch = _torch()
    return lambda a, b: torch.matmul(*_together(a, b))


@_op("Gemm")
def _gemm(n: _Node):
    """alpha·A'·B' + beta·C (a two-stage detector's box head on its RoI features)."""
    torch = _torch()
    ta, tb = bool(n.attr("transA", 0)), bool(n.attr("transB", 0))
    alpha, beta = float(n.attr("alpha", 1.0)), float(n.attr("beta", 1.0))

    def run(a, b, c=None):
        a, b, c = _together(a, b, c)
        y = torch.matmul(a.T if ta else a, b.T if tb else b)
        if alpha != 1.0:
            y = y * alpha
        if c is not None:
            y = y + (c * beta if beta != 1.0 else c)
        return y
    return run


@_op("ScatterElements")
def _scatter_elements(n: _Node):
    torch = _torch()
    axis = n.attr("axis", 0)
    reduction = n.attr("reduction", "none")
    reduce = {"add": "sum", "mul": "prod", "max": "amax", "min": "amin"}.get(reduction)
    if reduction != "none" and reduce is None:
        raise UnsupportedOp(f"node {n.name!r} (ScatterElements): reduction {reduction!r} is not supported on the GPU")

    def run(data, idx, updates):
        data, idx, updates = _together(data, idx, updates)
        a = _axis(axis, data.dim())
        idx = _wrapped(idx, data.shape[a])
        if reduce is None:
            return torch.scatter(data, a, idx, updates)
        return torch.scatter_reduce(data, a, idx, updates, reduce=reduce, include_self=True)
    return run


# -- detection -----------------------------------------------------------------------------------------------

#: candidates from which a NonMaxSuppression runs group by group (``nms_in_groups``) rather than as one
#: torchvision call over all of them.  On the H200: alone (bench/nms_groups.py) the groups form costs ~1.5 ms
#: whatever the size (its sort, the padded batch, a few rounds each read back), the one call ~0.45 ms plus a term
#: in n^2 (2,000 candidates 0.97 ms, 8,000 3.9 against the groups' 1.8, 27,000 29-38 against 2.4-3.3); in a
#: detector's tail (bench/detector_gpu.py --nms-forms) FCOS's 4,819 ran 1.8 ms slower in groups and SSDlite's
#: 27,000 30 ms faster, so the groups cost more there than alone, and the line is drawn where they won alone
GROUPED_NMS_FROM = 8000
#: the most pairs (groups x the largest group's square) ``nms_in_groups`` holds at once (a float32 and a bool per
#: pair); beyond, torchvision's one call, whose mask is one bit per pair
GROUPED_NMS_MAX_PAIRS = 1 << 25


def nms_in_groups(corners, order, cls, iou_t: float):
    """Greedy NMS's selection (ONNX Runtime's: a candidate is dropped where a kept one of its class with a higher
    score has IoU > ``iou_t`` with it), found group by group: a bool per candidate, or None where the groups are
    too large to hold or save too few pairs (the caller then runs torchvision's one call).

    ``corners`` [n, 4] as [min0, min1, max0, max1], ``order`` the candidates in descending score (ties as ONNX
    Runtime takes them), ``cls`` each one's class.  Why: torchvision's CUDA NMS compares every pair of its n boxes
    and scans the n x n/64-word mask on the host, which for a detector's 27,000 candidates (SSDlite's 300 in each
    of 90 classes, one NMS over class-offset boxes as torchvision's export writes it) was half its tail's time.
    Candidates of two classes, or whose extents along the first axis do not overlap, cannot suppress one another
    (their intersection is empty, so IoU is 0, and ``iou_t >= 0``): sorted by class then by min0, a group starts
    where a box's min0 reaches the running maximum of max0 before it.  Each group's pairs are then compared in
    one padded batch, and the greedy selection is the fixed point of "kept = not suppressed by a kept one
    before it" (unique, since suppression only looks back), reached in as many rounds as the longest chain of
    suppressions; a round costs a few kernels, a check every fourth a wait."""
    torch = _torch()
    n, dev = corners.shape[0], corners.device
    if n == 0:
        return torch.zeros(0, dtype=torch.bool, device=dev)
    lo0, lo1, hi0, hi1 = corners.unbind(1)
    cls = cls.to(torch.int64)
    by_x = torch.argsort(lo0, stable=True)
    p = by_x[torch.argsort(cls[by_x], stable=True)]  # by class, then min0
    rank_hi = torch.empty(n, dtype=torch.int64, device=dev)
    rank_hi[torch.argsort(hi0)] = torch.arange(n, device=dev)  # NaN last: its running maximum never splits
    reach = torch.cummax(cls[p] * n + rank_hi[p], 0).indices  # the box of the class's largest max0 so far
    starts = torch.ones(n, dtype=torch.bool, device=dev)
    starts[1:] = (cls[p][1:] != cls[p][:-1]) | (lo0[p][1:] >= hi0[p][reach[:-1]])
    group = torch.empty(n, dtype=torch.int64, device=dev)
    group[p] = torch.cumsum(starts, 0) - 1
    counts = torch.bincount(group)
    groups, largest = counts.numel(), int(counts.max())
    if groups * largest * largest > min(GROUPED_NMS_MAX_PAIRS, n * n // 4):
        return None  # too large to hold, or too few pairs saved to beat the one call
    r = order[torch.argsort(group[order], stable=True)]  # by group, each group's in descending score
    g = group[r]
    slot = torch.arange(n, device=dev) - (torch.cumsum(counts, 0) - counts)[g]
    pad = corners.new_zeros((groups, largest, 4))
    pad[g, slot] = corners[r]
    valid = torch.zeros((groups, largest), dtype=torch.bool, device=dev)
    valid[g, slot] = True
    a0, a1, b0, b1 = pad.unbind(2)
    area = (b0 - a0) * (b1 - a1)
    w = torch.minimum(b0[:, :, None], b0[:, None, :]) - torch.maximum(a0[:, :, None], a0[:, None, :])
    h = torch.minimum(b1[:, :, None], b1[:, None, :]) - torch.maximum(a1[:, :, None], a1[:, None, :])
    inter = w.clamp_(min=0).mul_(h.clamp_(min=0))
    del h
    # IoU as ONNX Runtime computes it: inter / (area_i + area_j - inter), an empty intersection never suppressing
    iou = inter / (area[:, :, None] + area[:, None, :] - inter)
    suppresses = (iou > iou_t) & (inter > 0)  # [group, i, j]: j would drop i
    del w, inter, iou
    suppresses &= torch.ones((largest, largest), dtype=torch.bool, device=dev).tril(-1)  # j before i only
    suppresses &= valid[:, None, :]
    kept = valid
    rounds = 0
    while True:
        now = valid & ~(suppresses & kept[:, None, :]).any(-1)
        rounds += 1
        if rounds % 4 == 0 or rounds >= largest:
            if rounds >= largest or torch.equal(now, kept):
                kept = now
                break
        kept = now
    out = torch.zeros(n, dtype=torch.bool, device=dev)
    out[r] = kept[g, slot]
    return out


def _torchvision_ops(n: _Node, op: str):
    """``torchvision.ops`` for node ``n``, or the node refused (its tail then stays on the host) where torchvision
    is missing or does not import beside this torch: a torchvision built for another torch raises a RuntimeError
    at import ("operator torchvision::nms does not exist"), not an ImportError."""
    try:
        from torchvision import ops
    except Exception as error:  # noqa: BLE001 - any import failure refuses the node, with its reason
        first = (str(error).splitlines() or [type(error).__name__])[0]
        why = ("pip install torchvision" if isinstance(error, ImportError)
               else f"the installed torchvision does not import: {first}")
        raise UnsupportedOp(f"node {n.name!r} ({op}) needs torchvision on the GPU ({why})") from None
    return ops


@_op("NonMaxSuppression")
def _nms(n: _Node):
    """ONNX's NonMaxSuppression per batch, every class at once: from ``GROUPED_NMS_FROM`` candidates group by
    group (``nms_in_groups``), below it (or where the groups are too large to hold) as torchvision's
    ``batched_nms``: the selected [batch, class, box] rows grouped by batch and class, each class's in descending
    score, at most ``max_output_boxes_per_class`` of each (0, the default, selects none), as ONNX Runtime gives
    them."""
    torch = _torch()
    batched_nms = _torchvision_ops(n, "NonMaxSuppression").batched_nms
    center = bool(n.attr("center_point_box", 0))

    def run(boxes, scores, max_per_class=None, iou=None, score_min=None):
        boxes, scores = _together(boxes, scores)
        limit = 0 if max_per_class is None else _ints(max_per_class)[0]
        iou_t = 0.0 if iou is None else float(iou.item())
        rows = []
        if limit > 0:
            for b in range(boxes.shape[0]):
                bx = boxes[b]
                if center:  # [x_center, y_center, width, height]
                    half = bx[:, 2:] / 2
                    corners = torch.cat([bx[:, :2] - half, bx[:, :2] + half], dim=1)
                else:  # any diagonal pair, in either axis order: IoU is the same for [min0, min1, max0, max1]
                    corners = torch.cat([torch.minimum(bx[:, :2], bx[:, 2:]), torch.maximum(bx[:, :2], bx[:, 2:])], 1)
                sc = scores[b]  # [classes, boxes]
                keep = sc > float(score_min.item()) if score_min is not None else torch.ones_like(sc, dtype=torch.bool)
                cls, box = keep.nonzero(as_tuple=True)  # by class, then box
                # equal scores lowest box first, as ONNX Runtime takes them: the candidates' order of a stable
                # sort handed to torchvision as distinct scores (its own sort leaves the order of ties open)
                order = torch.sort(sc[cls, box], descending=True, stable=True).indices
                ranks = torch.empty(order.numel(), dtype=torch.float32, device=order.device)
                ranks[order] = torch.arange(order.numel(), 0, -1, dtype=torch.float32, device=order.device)
                kept = None
                if box.numel() >= GROUPED_NMS_FROM and iou_t >= 0:
                    kept = nms_in_groups(corners[box].float(), order, cls, iou_t)
                if kept is None:
                    chosen = batched_nms(corners[box].float(), ranks, cls, iou_t)  # descending score
                else:
                    chosen = order[kept[order]]  # descending score, as batched_nms gives them
                cls_c, box_c = cls[chosen], box[chosen]
                order = torch.sort(cls_c, stable=True).indices  # by class, each class's in score order
                cls_c, box_c = cls_c[order], box_c[order]
                rank = torch.arange(cls_c.numel(), device=cls_c.device) - torch.searchsorted(cls_c, cls_c)
                within = rank < limit
                cls_c, box_c = cls_c[within], box_c[within]
                rows.append(torch.stack([torch.full_like(cls_c, b), cls_c, box_c], dim=1))
        if not rows:
            return torch.zeros((0, 3), dtype=torch.int64, device=boxes.device)
        return torch.cat(rows).to(torch.int64)
    return run


@_op("RoiAlign")
def _roi_align(n: _Node):
    """RoiAlign (average mode) as torchvision's ``roi_align``: ONNX's ``half_pixel`` coordinates (opset 16's
    default) are its ``aligned=True``, ``output_half_pixel`` (and opset 10's only form) ``aligned=False``; a
    sampling ratio of 0 is adaptive in both."""
    torch = _torch()
    roi_align = _torchvision_ops(n, "RoiAlign").roi_align
    mode = n.attr("mode", "avg")
    if mode != "avg":
        raise UnsupportedOp(f"node {n.name!r} (RoiAlign): mode {mode!r} is not supported on the GPU")
    size = (int(n.attr("output_height", 1)), int(n.attr("output_width", 1)))
    ratio, scale = int(n.attr("sampling_ratio", 0)), float(n.attr("spatial_scale", 1.0))
    aligned = n.attr("coordinate_transformation_mode", "half_pixel" if n.opset >= 16 else "output_half_pixel") == "half_pixel"

    def run(x, rois, batch):
        x, rois, batch = _together(x, rois, batch)
        boxes = torch.cat([batch.to(rois.dtype).reshape(-1, 1), rois], dim=1)
        return roi_align(x, boxes, size, spatial_scale=scale, sampling_ratio=ratio, aligned=aligned)
    return run


# -- the graph -----------------------------------------------------------------------------------------------

@_op("If")
def _if(n: _Node):
    then_g = EagerGraph(n.attrs["then_branch"], n.opset)
    else_g = EagerGraph(n.attrs["else_branch"], n.opset)

    def run(cond, *, scope):
        branch = then_g if bool(cond.reshape(-1)[0].item()) else else_g
        return tuple(branch.run(scope, fresh=False))
    run.reads_scope = True
    return run


#: steps a NonZero behind them is not moved across (``EagerGraph._batch_nonzeros``): the ops that wait for the device
#: themselves, and where an If's branches read names no step lists
_WALLS = frozenset({"If", "Loop", "NonMaxSuppression"})


def _nonzeros(*masks):
    """Several NonZero at once: their counts read back in one wait, then each one's indices with its count known
    (``torch.nonzero_static``, which does not wait). With masks on several devices, one by one."""
    torch = _torch()
    masks = [m.reshape(1) if m.dim() == 0 else m for m in masks]
    if any(m.device != masks[0].device for m in masks):
        return tuple(torch.nonzero(m).T.contiguous() for m in masks)
    counts = torch.stack([torch.count_nonzero(m) for m in masks]).tolist()
    return tuple(torch.nonzero_static(m, size=c).T.contiguous() for m, c in zip(masks, counts))


#: the most entries a step's memo of host results keeps (``EagerGraph.run``): a detector's tail meets a few
#: candidate counts per level, and a memo that fills up is emptied rather than grown
_MEMO_MAX = 32
#: the most elements of a host result a memo keeps
_MEMO_OUT_MAX = 1 << 12


def _host_key(args) -> tuple | None:
    """What a step's inputs are, where they are all small host tensors (a shape, an index, a count: the tail's
    shape arithmetic): their dtypes, shapes and bytes; None where any is on a device or larger, or has no bytes
    numpy can read (bfloat16)."""
    key = []
    for a in args:
        if a is None:
            key.append(None)
            continue
        if a.device.type != "cpu" or a.numel() > _HOST_MAX:
            return None
        try:
            key.append((a.dtype, tuple(a.shape), a.numpy().tobytes()))
        except (TypeError, RuntimeError):
            return None
    return tuple(key)


def _host_result(got) -> bool:
    """Whether ``got`` (a step's tensor or tuple of them) is small host tensors only, which a memo may keep."""
    outs = got if type(got) is tuple else (got,)
    return all(o is not None and o.device.type == "cpu" and o.numel() <= _MEMO_OUT_MAX for o in outs)


def _same(*values):
    """A repeated node's outputs: the earlier node's values."""
    return values if len(values) > 1 else values[0]


class EagerGraph:
    """``graph``'s nodes as closures over torch (``OPS``), run in order on a dict of values.

    ``device``: where the graph's initializers that device ops read are kept (the small integer ones, shapes
    and axes, stay on the host where they are read).  An ``If``'s branches are graphs too: they read their outer
    scope's values by name (``run``'s ``values``)."""

    def __init__(self, graph: onnx.GraphProto, opset: int, device=None):
        self.outputs = [o.name for o in graph.output]
        self.inputs = [i.name for i in graph.input]
        self._takes = set(self.inputs)
        self.steps = []
        self.ops = []  # each step's op type, in order
        # the values known at load, as the host holds them (a node's shape, axes or k read once, not per call)
        known = {t.name: _tensor(t) for t in graph.initializer}
        # A node that computes what an earlier one computed (the same op, attributes and inputs) is run once: its
        # outputs are the earlier node's, under its own names too.  Exporters repeat work in a detector's tail
        # (torchvision's writes two NonZero of each level's mask: two waits for the GPU where one will do); ONNX
        # Runtime's session removes them itself (its common-subexpression pass), and onnx_ir has the pass for a
        # model, but the shipped tail stays the original's own nodes and the launcher needs no onnx_ir.
        canon: dict[str, str] = {}
        seen: dict[tuple, list[str]] = {}
        for node in graph.node:
            make = OPS.get(node.op_type) if node.domain in ("", "ai.onnx") else None
            if make is None:
                raise UnsupportedOp(f"node {node.name or node.op_type!r} ({node.op_type}) does not run on the GPU "
                                    "tail (launcher/engines/onnx_eager.py)")
            ins = [canon.get(i, i) for i in node.input]
            while ins and not ins[-1]:  # trailing optional inputs left out: the closures' defaults
                ins.pop()
            key = None if node.op_type == "If" else (  # (an If's branches read names of the outer scope)
                node.op_type, tuple(a.SerializeToString() for a in node.attribute), tuple(ins))
            first = seen.get(key) if key is not None else None
            if first is not None and all(f or not o for f, o in zip(first, node.output)):
                canon.update((o, f) for o, f in zip(node.output, first) if o)
                self.steps.append((_same, first, list(node.output), False))
                self.ops.append(node.op_type)
                continue
            fn = make(_Node(node, opset, known, device))
            if node.op_type == "Constant":  # its value is known from here on
                known[node.output[0]] = fn()
            if key is not None:
                seen[key] = list(node.output)
            self.steps.append((fn, ins, list(node.output), getattr(fn, "reads_scope", False)))
            self.ops.append(node.op_type)
        self._batch_nonzeros()
        # per step, its results by its inputs where every input is a small host tensor (``_host_key``): the tail's
        # shape arithmetic (Shape -> Gather -> Unsqueeze -> Concat -> Reshape, per level and class) computes the
        # same values call after call wherever the candidates' counts repeat, and each of torch's host ops costs
        # several microseconds.  Every op of ``OPS`` computes its outputs from its inputs' values alone and writes
        # into none of them; an If (it reads its outer scope), an alias and a step without inputs are not kept.
        self._memo = [None if scoped or fn is _same or not ins or op == "If" else {}
                      for (fn, ins, _, scoped), op in zip(self.steps, self.ops)]
        self.memo_hits = 0
        # (after every node is known to run: a tail refused costs no copy to the device)
        self.consts = {name: v.to(device) if device is not None and (v.is_floating_point() or v.numel() > _HOST_MAX) else v
                       for name, v in ((t.name, known[t.name]) for t in graph.initializer)}
        self._held = {id(v) for v in self.consts.values()}  # what ``run`` hands out as copies

    def _batch_nonzeros(self) -> None:
        """Each NonZero waits for the device (its count sets its output's shape), and a detector's tail has one per
        class or level, each behind a few kernels of its own: run in node order, the device idles while the host
        issues the next class's kernels, and the host waits at every NonZero. Here the steps are put in an order
        that issues every NonZero's producers first and counts those NonZero together, in one wait
        (``_nonzeros``), level by level (a NonZero behind others joins the group after theirs). A NonZero behind an
        If, a NonMaxSuppression or a step that reads its outer scope stays where it was, and so does a group of
        one. Any order that keeps each step after its producers computes the same values."""
        steps, n = self.steps, len(self.steps)
        producer = dataflow.producers(outs for _, _, outs, _ in steps)
        deps = [{producer[name] for name in ins if name in producer} for _, ins, _, _ in steps]
        walls = {i for i, (op, st) in enumerate(zip(self.ops, steps)) if st[3] or op in _WALLS}
        ancestors: list[set] = []
        level: dict[int, int] = {}
        blocked: set = set()  # NonZero steps behind a wall
        for i in range(n):
            a = set()
            for d in deps[i]:
                a.add(d)
                a |= ancestors[d]
            ancestors.append(a)
            if self.ops[i] == "NonZero" and steps[i][0] is not _same:
                if a & walls or any(j in blocked for j in a if self.ops[j] == "NonZero"):
                    blocked.add(i)
                else:
                    level[i] = 1 + max((level[j] for j in a if j in level), default=-1)
        groups = [[i for i in sorted(level) if level[i] == lv] for lv in sorted(set(level.values()))]
        if not any(len(g) > 1 for g in groups):
            return
        order, done = [], set()
        for group in groups:
            if len(group) < 2:
                continue
            for j in sorted(set().union(*(ancestors[i] for i in group)) - done):
                order.append((steps[j], self.ops[j]))
                done.add(j)
            masks = [steps[i][1][0] for i in group]
            outs = [steps[i][2][0] for i in group]
            order.append(((_nonzeros, masks, outs, False), "NonZero"))
            done.update(group)
        order += [(steps[j], self.ops[j]) for j in range(n) if j not in done]
        self.steps, self.ops = [st for st, _ in order], [op for _, op in order]

    def run(self, values: dict, fresh: bool = True) -> list:
        """The graph's outputs, in order, from ``values`` (its inputs by name; a subgraph's outer scope).
        ``fresh``: an output on the host, or one of the graph's constants, is a copy, where the caller may write
        into what it is given (a Shape node's tensor serves every call of that shape, a constant every call)."""
        env = dict(values)
        # (a graph's inputs are its caller's values; its initializers shadow an outer scope's of the same name)
        env.update((k, v) for k, v in self.consts.items() if k not in self._takes)
        for (fn, ins, outs, scoped), memo in zip(self.steps, self._memo):
            args = [env[i] if i else None for i in ins]
            key = _host_key(args) if memo is not None else None
            got = memo.get(key) if key is not None else None
            if got is not None:
                self.memo_hits += 1
            else:
                got = fn(*args, scope=env) if scoped else fn(*args)
                if key is not None and _host_result(got):
                    if len(memo) >= _MEMO_MAX:
                        memo.clear()
                    memo[key] = got
            if type(got) is tuple:
                for name, v in zip(outs, got):
                    if name:
                        env[name] = v
            else:
                env[outs[0]] = got
        outs = [env[o] for o in self.outputs]
        if not fresh:
            return outs
        return [v.clone() if v.device.type == "cpu" or id(v) in self._held else v for v in outs]


def load(model: onnx.ModelProto, device) -> EagerGraph:
    """``model``'s graph ready to run on ``device`` (``UnsupportedOp`` naming a node it cannot run)."""
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 13)
    return EagerGraph(model.graph, opset, device=device)
