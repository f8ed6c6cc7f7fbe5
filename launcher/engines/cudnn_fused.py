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

``conv_key`` names one fusable convolution shape and ``fused_conv_keys`` lists a model's: a GPU build times each
alone and leaves those cuDNN's fused call runs slower to Inductor's form (``BuildOptions.conv_relu_unfused``,
``pipeline.measure.time_conv_shapes``).
"""

from __future__ import annotations

import threading

_LOCK = threading.Lock()
_LIBS: list = []


def _channels_last(y):
    import torch

    from .cudnn_plans import _channels_last_strides

    want = tuple(_channels_last_strides(y.shape))
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


def conv_key(kind: str, x_shape, w_shape, strides, padding, dilations, group: int) -> str:
    """What identifies a fusable convolution for ``BuildOptions.conv_relu_unfused``: the fusion's kind ("relu",
    "add_relu", "add" or "silu"), its input's shape but the batch, its weight's shape, strides, (symmetric)
    padding, dilations and
    groups.  The converter and the build's timing (``fused_conv_keys``) write it alike."""
    return "|".join([kind, ",".join(str(int(v)) for v in list(x_shape)[1:]), ",".join(str(int(v)) for v in w_shape),
                     ",".join(str(int(v)) for v in strides), ",".join(str(int(v)) for v in padding),
                     ",".join(str(int(v)) for v in dilations), str(int(group))])


#: the fusions of ``conv_relu_sites`` that run as a cuDNN plan (``cudnn_plans.conv2d``), depthwise convolutions too
PLANNED_KINDS = ("add", "silu")


def conv_relu_sites(model) -> list[tuple]:
    """Each Conv whose output one Relu alone reads ("relu"), or one Add alone whose sum one Relu alone reads
    ("add_relu", with that Add): the pattern cuDNN's fused conv + bias (+ residual) + ReLU runs, as (conv, kind,
    add or None); and, ``PLANNED_KINDS``, which cuDNN runs in the convolution's kernel through a plan
    (``cudnn_plans``): each Conv whose output one Add alone reads, no Relu alone after it ("add", with that Add),
    and each Conv whose output only a Sigmoid of it and the Mul of the two read ("silu", with that Sigmoid: SiLU as
    exporters write it).
    The converter's fusions and ``fused_conv_keys`` narrow it further (shapes, pads)."""
    readers: dict[str, list] = {}
    for n in model.graph.node:
        for i in n.input:
            readers.setdefault(i, []).append(n)

    def only(name: str, op: str):
        got = readers.get(name, [])
        return got[0] if len(got) == 1 and got[0].op_type == op else None

    constants = {t.name for t in model.graph.initializer} | {
        o for n in model.graph.node if n.op_type == "Constant" for o in n.output}
    out = []
    for n in model.graph.node:
        if n.op_type != "Conv" or not n.output:
            continue
        add = only(n.output[0], "Add")
        if only(n.output[0], "Relu") is not None:
            out.append((n, "relu", None))
        elif add is not None and only(add.output[0], "Relu") is not None:
            out.append((n, "add_relu", add))
        elif add is not None and len(set(add.input)) == 2 and not constants & set(add.input):
            out.append((n, "add", add))  # (a residual is computed: a constant added is a bias, left to Inductor)
        elif (sig := _silu_of(n.output[0], readers)) is not None:
            out.append((n, "silu", sig))
    return out


def _silu_of(y: str, readers: dict) -> object | None:
    """The Sigmoid node where ``y``'s only readers are a Sigmoid of it and a Mul of ``y`` and that Sigmoid's output,
    which nothing else reads (y * sigmoid(y)), else None."""
    got = readers.get(y, [])
    sig = next((r for r in got if r.op_type == "Sigmoid"), None)
    mul = next((r for r in got if r.op_type == "Mul"), None)
    if len(got) != 2 or sig is None or mul is None or not sig.output:
        return None
    s = sig.output[0]
    after = readers.get(s, [])
    if len(after) != 1 or after[0] != mul or sorted(mul.input) != sorted([y, s]):
        return None
    return sig


def fused_conv_keys(model) -> dict[str, int]:
    """{``conv_key``: count} of the convolutions of ``model`` (ONNX, static shapes) that the converter's conv+ReLU
    fusion takes: 2-d, symmetric padding, a constant weight, the output read only by a Relu (``relu``; a
    depthwise one's ReLU runs in its ``cudnn_plans`` plan) or only by an Add of a tensor of its shape whose sum
    only a Relu reads (``add_relu``, not depthwise); or only by such an Add that no Relu alone follows (``add``)
    or only by its SiLU (``silu``), depthwise or not (``PLANNED_KINDS``: every one is a plan); none of them a
    graph output but an ``add``'s sum (the fused step writes it).  A depthwise ``relu`` key is one to time
    (``is_depthwise_key``): with its ReLU in the plan cuDNN ran MobileNetV3-Small's three such shapes at batch 32
    in a generic grouped kernel, 74 µs each, where the plan without it ran ~8 µs (H200, bench/kernel_profile.py)."""
    import onnx
    from onnx import shape_inference

    def shapes_of(g):
        out = {}
        for vi in list(g.input) + list(g.value_info) + list(g.output):
            if vi.type.tensor_type.HasField("shape"):
                out[vi.name] = tuple(d.dim_value if d.HasField("dim_value") else None
                                     for d in vi.type.tensor_type.shape.dim)
        return out

    g = model.graph
    weights = {t.name: tuple(t.dims) for t in g.initializer}
    shapes = shapes_of(g)
    if any(n.op_type == "Conv" and n.input[0] not in shapes for n in g.node):
        # (a build's model and its branches carry their shapes already: inferred here only where they do not,
        # which copies the model with its weights)
        try:
            g = shape_inference.infer_shapes(model).graph
            shapes = shapes_of(g)
        except Exception:  # noqa: BLE001 - onnx cannot infer them: the convolutions without a shape are left out
            pass
    outputs = {o.name for o in g.output}
    found: dict[str, int] = {}
    for n, kind, add in conv_relu_sites(model):
        if n.domain not in ("", "ai.onnx") or len(n.input) < 2 or n.input[1] not in weights:
            continue
        x, w = shapes.get(n.input[0]), weights[n.input[1]]
        if x is None or len(x) != 4 or None in x or len(w) != 4:
            continue
        a = {at.name: onnx.helper.get_attribute_value(at) for at in n.attribute}
        group = int(a.get("group", 1))
        pads = [int(p) for p in a.get("pads", [0, 0, 0, 0])]
        if pads[:2] != pads[2:] or a.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
            continue
        y = n.output[0]
        if y in outputs:
            continue
        if kind == "silu":  # (``add`` is the Sigmoid)
            if add.output[0] in outputs:
                continue
        elif add is not None:  # a residual of the conv's own shape, the sum no graph output where a ReLU follows
            other = [i for i in add.input if i != y]
            if not (len(add.input) == 2 and (kind == "add" or add.output[0] not in outputs) and len(other) == 1
                    and shapes.get(other[0]) == shapes.get(y)):
                continue
        key = conv_key(kind, x, w, a.get("strides", [1, 1]), pads[:2], a.get("dilations", [1, 1]), group)
        if kind == "add_relu" and is_depthwise_key(key):  # (no fused call of torch's takes it)
            continue
        found[key] = found.get(key, 0) + 1
    return found


def is_depthwise_key(key: str) -> bool:
    """Whether ``conv_key``'s convolution is depthwise (its groups its input's channels, one weight channel)."""
    _, x, w, _, _, _, g = parse_key(key)
    return g > 1 and g == x[0] == w[0] and w[1] == 1


def parse_key(key: str) -> tuple:
    """``conv_key``'s fields back: (kind, input shape without the batch, weight shape, strides, padding,
    dilations, groups)."""
    kind, x, w, s, p, d, g = key.split("|")

    def ints(t):
        return [int(v) for v in t.split(",")]

    return kind, ints(x), ints(w), ints(s), ints(p), ints(d), int(g)



#: a dense convolution whose input or output channels are not a multiple of this can run with both padded up to
#: it (``padded_channels``): fp16 tensor-core kernels read channels in 16-byte vectors, and where a count breaks
#: them cuDNN runs a far slower kernel.  H200, batch 1 (bench/conv_epilogues.py ``--pad-channels 8``): Res2Net-50's
#: 26-channel 3x3 convolution at 56x56 ran 15.5 µs fused (14.6 as torch's convolution and Inductor's epilogue)
#: and 4.7 µs padded to 32, its 52-channel ones 22.5-23.1 µs against 7.5-7.6 padded to 56; copying the input
#: into its padded form costs ~3.5 µs as a kernel of its own, less where its producer writes it so
CHANNEL_MULTIPLE = 8


def padded_channels(key: str) -> tuple[int, int] | None:
    """(input channels, output channels) that ``key``'s convolution runs with where its channels are padded (a
    ``relu`` key of a dense convolution, group 1, whose input or output channels are not a multiple of
    ``CHANNEL_MULTIPLE``: each rounded up to one), else None.  The converter pads such a convolution where the
    build lists its key (``BuildOptions.conv_channels_padded``), and the build's per-shape timing times it so."""
    kind, _, w, _, _, _, group = parse_key(key)
    if kind != "relu" or group != 1:
        return None
    c, k = w[1], w[0]
    if c % CHANNEL_MULTIPLE == 0 and k % CHANNEL_MULTIPLE == 0:
        return None
    m = CHANNEL_MULTIPLE
    return -(-c // m) * m, -(-k // m) * m


def padded_conv_weights(w, b, channels: int, outs: int):
    """A convolution's weight [k, c, kh, kw] padded to [``outs``, ``channels``, kh, kw] (channels-last, the layout the
    fused call reads) and its bias [k] to [``outs``] (None stays None), the new entries zero: new input channels
    then add nothing, and new output channels are relu(0) = 0.  The converter stores these; the build's per-shape
    timing and bench/conv_epilogues.py time them."""
    import torch

    wide = w.new_zeros((outs, channels, *w.shape[2:]))
    wide[: w.shape[0], : w.shape[1]] = w
    wide = wide.contiguous(memory_format=torch.channels_last)
    if b is None:
        return wide, None
    bias = b.new_zeros((outs,))
    bias[: b.shape[0]] = b
    return wide, bias
