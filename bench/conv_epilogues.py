#!/usr/bin/env python3
"""Per convolution shape of a model: cuDNN's fused epilogue against a convolution and a separate epilogue kernel,
timed on the device.

Why: a GPU build decides its conv+ReLU round for the whole engine at once (every Conv -> Relu, and Conv -> Add ->
Relu, as one cuDNN call, or none), and that round went for Inductor's kernels on SqueezeNet, Res2Net-50,
Inception-ResNet-v2, MixNet-S and ShuffleNet-v2 and for cuDNN's on the others (bench/corpus/NOTES.md).  Whether a
choice per convolution shape could beat both depends on whether the shapes of one model disagree, which this
measures.

For each model (bench/gpu.py's ``make_model``: random weights, BatchNorm calibrated; exported as a build receives
it, opset 17, BatchNorm folded into the convolutions), every 2-d Conv that is not depthwise and whose output only a
Relu reads (``relu``), or only an Add whose other input has its shape and whose output only a Relu reads
(``add_relu``), grouped by (kind, input shape, weight shape, strides, pads, dilations, group): the shapes a GPU build
times itself (``cudnn_fused.fused_conv_keys``; ``pipeline.measure.time_conv_shapes``, whose unfused form is eager
ops rather than Inductor's kernel, so that it favours the fused call):

  count        convolutions of that shape in the model
  fused_us     the converter's fused step (``torch.cudnn_convolution_relu`` / ``cudnn_convolution_add_relu``),
               channels-last fp16, per call in a CUDA Graph of ``--chain`` calls (median of ``--replays``)
  unfused_us   torch's convolution without its bias (cuDNN) and one elementwise kernel for bias (+ residual) +
               ReLU compiled by Inductor (one dynamic-shape compile per kind), the same way: what Inductor's form
               runs for most convolutions (it may also fold that kernel into a neighbour's, which this does not
               credit it with)
  ratio        unfused_us / fused_us (> 1: the fused call is faster)

and per model the sums over its convolutions (each shape times its count): all fused, all unfused, and each shape's
faster form.

``--epilogues silu`` asks the same of SiLU (EfficientNet's and MixNet's activation; exporters write it as a
Sigmoid of the convolution and a Mul of the two), which no torch op runs fused: every 2-d Conv whose output only
that Sigmoid and Mul read (``silu_conv_keys``), kind ``silu`` (dense) or ``dw_silu`` (depthwise), fused as one cuDNN
plan, conv + bias + SWISH_FWD (``cudnn_plans.conv2d(act="swish")``, the frontend's runtime-fused kernel, its plan
built once before timing), unfused as a GPU bundle runs it today: a dense convolution by torch with Inductor's
bias + SiLU kernel after it, a depthwise one through its cuDNN plan with the bias in the kernel and Inductor's SiLU
kernel after it.  ``planned`` says whether cuDNN planned the fused form (where it did not, the op fell back to
torch's convolution and SiLU, and the row says why).  Whether a converter fusion of conv + bias + SiLU is worth
building, and timing in the conv+ReLU round, is what this decides.

``--pad-channels N`` also times each dense shape whose channels are not a multiple of N on channels padded up to it
(``padded``: the fused call on zero-padded weights, the input copied into its padded form), and with ``--plain``
the dense convolutions no fusion takes whose channels are not (``plain_rows``: torch's convolution with its bias,
plain against padded).

Run on the device after ``source bench/device_env.sh``:
    python3 bench/conv_epilogues.py --models resnet50,squeezenet1_1 --out $OUT
Prints one JSON line per model and a summary; writes conv_epilogues.json under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from depthwise_kernels import _graph_us  # noqa: E402 - the same timing: fn captured `reps` times, replays' median


_EPILOGUES: dict = {}


def _epilogue(kind: str):
    """Inductor's kernel for bias (+ residual) + ReLU, compiled once per kind with dynamic shapes."""
    import torch

    if kind not in _EPILOGUES:
        if kind == "relu":
            def f(y, b):
                return torch.relu(y + b.view(1, -1, 1, 1))
        else:
            def f(y, b, z):
                return torch.relu(y + z + b.view(1, -1, 1, 1))
        _EPILOGUES[kind] = torch.compile(f, dynamic=True)
    return _EPILOGUES[kind]


def _silu_epilogue(bias: bool):
    """Inductor's kernel for (bias +) SiLU, compiled once per form with dynamic shapes."""
    import torch

    key = f"silu{int(bias)}"
    if key not in _EPILOGUES:
        if bias:
            def f(y, b):
                return torch.nn.functional.silu(y + b.view(1, -1, 1, 1))
        else:
            def f(y):
                return torch.nn.functional.silu(y)
        _EPILOGUES[key] = torch.compile(f, dynamic=True)
    return _EPILOGUES[key]


def silu_conv_keys(model) -> dict[str, int]:
    """{``conv_key``: count} of the 2-d convolutions of ``model`` whose output only a SiLU reads as exporters write
    it (a Sigmoid of the output and a Mul of the output by that Sigmoid, no other reader, neither a graph output):
    kind ``silu``, or ``dw_silu`` where the convolution is depthwise; symmetric padding and a constant weight."""
    import onnx
    from onnx import shape_inference

    from parastream.launcher.engines.cudnn_fused import conv_key

    g = shape_inference.infer_shapes(model).graph
    shapes = {vi.name: tuple(d.dim_value if d.HasField("dim_value") else None for d in vi.type.tensor_type.shape.dim)
              for vi in list(g.input) + list(g.value_info) + list(g.output) if vi.type.tensor_type.HasField("shape")}
    weights = {t.name: tuple(t.dims) for t in g.initializer}
    outputs = {o.name for o in g.output}
    readers: dict[str, list] = {}
    for n in g.node:
        for i in n.input:
            readers.setdefault(i, []).append(n)
    found: dict[str, int] = {}
    for n in g.node:
        if n.op_type != "Conv" or len(n.input) < 2 or n.input[1] not in weights or n.output[0] in outputs:
            continue
        y = n.output[0]
        rs = readers.get(y, [])
        sig = [r for r in rs if r.op_type == "Sigmoid"]
        mul = [r for r in rs if r.op_type == "Mul"]
        if not (len(rs) == 2 and len(sig) == 1 and len(mul) == 1 and sorted(mul[0].input) == sorted([y, sig[0].output[0]])
                and sig[0].output[0] not in outputs and len(readers.get(sig[0].output[0], [])) == 1):
            continue
        x, w = shapes.get(n.input[0]), weights[n.input[1]]
        if x is None or len(x) != 4 or None in x or len(w) != 4:
            continue
        a = {at.name: onnx.helper.get_attribute_value(at) for at in n.attribute}
        pads = [int(p) for p in a.get("pads", [0, 0, 0, 0])]
        if pads[:2] != pads[2:] or a.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
            continue
        group = int(a.get("group", 1))
        kind = "dw_silu" if group > 1 and group == x[1] == w[0] else "silu"
        key = conv_key(kind, x, w, a.get("strides", [1, 1]), pads[:2], a.get("dilations", [1, 1]), group)
        found[key] = found.get(key, 0) + 1
    return found


def _operands(key: str, batch: int) -> tuple:
    """``key``'s fields (``cudnn_fused.parse_key``, the input shape with ``batch``) and random fp16 operands for
    it on the GPU, channels-last: (kind, x shape, w shape, strides, pads, dilations, group, x, w, b)."""
    import torch

    from parastream.launcher.engines.cudnn_fused import parse_key

    kind, xs, ws, strides, pads, dil, group = parse_key(key)
    xs = [batch, *xs]
    cl = torch.channels_last
    x = torch.randn(xs, device="cuda", dtype=torch.float16).contiguous(memory_format=cl)
    w = (torch.randn(ws, device="cuda", dtype=torch.float16) / (ws[1] * ws[2] * ws[3]) ** 0.5).contiguous(memory_format=cl)
    b = torch.randn(ws[0], device="cuda", dtype=torch.float16)
    return kind, xs, ws, strides, pads, dil, group, x, w, b


def measure_silu_shape(key: str, batch: int, chain: int, replays: int) -> dict:
    """A ``silu_conv_keys`` key at ``batch``: conv + bias + SiLU as one cuDNN plan against the bundle's form today."""
    import torch

    from parastream.launcher.engines import cudnn_plans as cp

    kind, xs, ws, strides, pads, dil, group, x, w, b = _operands(key, batch)

    def fused():
        return cp.conv2d(x, w, b, strides, pads, dil, group, act="swish")

    if kind == "dw_silu":
        epi = _silu_epilogue(False)

        def unfused():
            return epi(cp.conv2d(x, w, b, strides, pads, dil, group))
    else:
        epi = _silu_epilogue(True)

        def unfused():
            return epi(torch.convolution(x, w, None, strides, pads, dil, False, [0, 0], group), b)

    with torch.no_grad():
        a, c = fused().float(), unfused().float()  # (builds the plans, outside the timed graphs)
        plan_key = cp.plan_key("float16", x.shape, w.shape, strides, pads, dil, True, act="swish")
        failed = cp.CACHE.failed.get((torch.cuda.current_device(), plan_key))
        err = float((a - c).abs().max() / max(c.abs().max(), 1e-6))
        f_us = _graph_us(fused, chain, replays)
        u_us = _graph_us(unfused, chain, replays)
    return {"kind": kind, "x": list(xs), "w": list(ws), "strides": list(strides), "pads": list(pads),
            "dilations": list(dil), "group": group, "fused_us": round(f_us, 3), "unfused_us": round(u_us, 3),
            "ratio": round(u_us / f_us, 3), "max_err": round(err, 5), "planned": failed is None,
            **({"not_planned": failed} if failed else {})}


def measure_shape(key: str, batch: int, chain: int, replays: int) -> dict:
    """``key`` (``cudnn_fused.conv_key``) at ``batch``: both forms timed, and their outputs compared."""
    import torch

    kind, xs, ws, strides, pads, dil, group, x, w, b = _operands(key, batch)
    cl = torch.channels_last
    y0 = torch.convolution(x, w, None, strides, pads, dil, False, [0, 0], group)
    z = torch.randn_like(y0).contiguous(memory_format=cl)
    epi = _epilogue(kind)
    if kind == "relu":
        def fused():
            return torch.cudnn_convolution_relu(x, w, b, strides, pads, dil, group)

        def unfused():
            return epi(torch.convolution(x, w, None, strides, pads, dil, False, [0, 0], group), b)
    else:
        def fused():
            return torch.cudnn_convolution_add_relu(x, w, z, 1.0, b, strides, pads, dil, group)

        def unfused():
            return epi(torch.convolution(x, w, None, strides, pads, dil, False, [0, 0], group), b, z)
    with torch.no_grad():
        a, c = fused().float(), unfused().float()
        err = float((a - c).abs().max() / max(c.abs().max(), 1e-6))
        f_us = _graph_us(fused, chain, replays)  # (depthwise_kernels.py's: captured, replayed, medians)
        u_us = _graph_us(unfused, chain, replays)
    return {"kind": kind, "x": list(xs), "w": list(ws), "strides": list(strides), "pads": list(pads),
            "dilations": list(dil), "group": group, "fused_us": round(f_us, 3), "unfused_us": round(u_us, 3),
            "ratio": round(u_us / f_us, 3), "max_err": round(err, 5)}


def _padded_operands(x, w, b, multiple: int) -> tuple:
    """(c, k, padded c, padded k, a zero input of the padded channels, the weight and bias zero-padded), channels-last:
    a convolution's operands with its input and output channels rounded up to ``multiple``."""
    import torch

    from parastream.launcher.engines.cudnn_fused import padded_conv_weights

    c, k = w.shape[1], w.shape[0]
    cp, kp = -(-c // multiple) * multiple, -(-k // multiple) * multiple
    xp = x.new_zeros([x.shape[0], cp, *x.shape[2:]]).contiguous(memory_format=torch.channels_last)
    return (c, k, cp, kp, xp, *padded_conv_weights(w, b, cp, kp))


def _pad_kernel():
    """Inductor's kernel that copies a channels-last tensor into one of more channels, the new ones zero (what a
    converter's padding would ask of the kernel that writes the convolution's input, where it cannot fold it in)."""
    import torch

    if "pad" not in _EPILOGUES:
        def f(x, extra: int):
            return torch.nn.functional.pad(x, (0, 0, 0, 0, 0, extra)).contiguous(memory_format=torch.channels_last)
        _EPILOGUES["pad"] = torch.compile(f, dynamic=True)
    return _EPILOGUES["pad"]


def measure_padded(key: str, batch: int, chain: int, replays: int, multiple: int) -> dict:
    """A dense (group 1) ``key`` whose input or output channels are not a multiple of ``multiple``: the same fused
    call with both padded up to it (the weights' and bias's new rows and columns zero, the input's new channels
    zero, the output sliced back: a view), its output compared with the unpadded call's.  ``padded_us`` is the
    call on inputs already padded; ``pad_us`` what copying the input into its padded form costs as a kernel of its
    own.  Why: fp16 tensor-core kernels want channels in multiples of 8 (16 bytes), and Res2Net-50's 26- and
    52-channel, ShuffleNet-v2's 58-channel and NASNet's 42-channel convolutions are not."""
    import torch

    kind, xs, ws, strides, pads, dil, group, x, w, b = _operands(key, batch)
    c, k, cp, kp, xp, wp, bp = _padded_operands(x, w, b, multiple)
    xp[:, :c] = x
    cl = torch.channels_last
    y0 = torch.convolution(x, w, None, strides, pads, dil, False, [0, 0], group)
    z = torch.randn_like(y0).contiguous(memory_format=cl)
    zp = torch.zeros([y0.shape[0], kp, *y0.shape[2:]], device="cuda", dtype=z.dtype).contiguous(memory_format=cl)
    zp[:, :k] = z
    if kind == "relu":
        def plain():
            return torch.cudnn_convolution_relu(x, w, b, strides, pads, dil, group)

        def padded():
            return torch.cudnn_convolution_relu(xp, wp, bp, strides, pads, dil, group)[:, :k]
    else:
        def plain():
            return torch.cudnn_convolution_add_relu(x, w, z, 1.0, b, strides, pads, dil, group)

        def padded():
            return torch.cudnn_convolution_add_relu(xp, wp, zp, 1.0, bp, strides, pads, dil, group)[:, :k]
    pad = _pad_kernel()
    with torch.no_grad():
        a, p = plain().float(), padded().float()
        err = float((a - p).abs().max() / max(a.abs().max(), 1e-6))
        pad(x, cp - c)
        plain_us = _graph_us(plain, chain, replays)
        padded_us = _graph_us(padded, chain, replays)
        pad_us = _graph_us(lambda: pad(x, cp - c), chain, replays) if cp != c else 0.0
    return {"channels": [c, k], "padded_to": [cp, kp], "plain_us": round(plain_us, 3),
            "padded_us": round(padded_us, 3), "pad_us": round(pad_us, 3),
            "padded_ratio": round(plain_us / padded_us, 3), "padded_max_err": round(err, 5)}


def plain_misaligned_keys(model, multiple: int) -> dict[str, int]:
    """{``conv_key`` of kind "plain": count} of the dense (group 1) 2-d convolutions of ``model`` with a constant
    weight and symmetric pads whose input or output channels are not a multiple of ``multiple`` and which no
    conv+ReLU fusion takes (``fused_conv_keys``: their output read by a Split, an Add, a BatchNorm left unfolded,
    ...): the convolutions the converter does not pad, MixNet-S's 1x1s of 20, 60 and 100 channels among them."""
    import onnx
    from onnx import shape_inference

    from parastream.launcher.engines.cudnn_fused import conv_key, conv_relu_sites

    g = shape_inference.infer_shapes(model).graph
    shapes = {vi.name: tuple(d.dim_value if d.HasField("dim_value") else None for d in vi.type.tensor_type.shape.dim)
              for vi in list(g.input) + list(g.value_info) if vi.type.tensor_type.HasField("shape")}
    weights = {t.name: tuple(t.dims) for t in g.initializer}
    taken = {n.output[0] for n, kind, _ in conv_relu_sites(model) if kind in ("relu", "add_relu")}
    found: dict[str, int] = {}
    for n in g.node:
        if n.op_type != "Conv" or len(n.input) < 2 or n.input[1] not in weights or n.output[0] in taken:
            continue
        x, w = shapes.get(n.input[0]), weights[n.input[1]]
        a = {at.name: onnx.helper.get_attribute_value(at) for at in n.attribute}
        pads = [int(p) for p in a.get("pads", [0, 0, 0, 0])]
        if (x is None or len(x) != 4 or None in x or len(w) != 4 or int(a.get("group", 1)) != 1
                or pads[:2] != pads[2:] or not (w[0] % multiple or w[1] % multiple)):
            continue
        key = conv_key("plain", x, w, a.get("strides", [1, 1]), pads[:2], a.get("dilations", [1, 1]), 1)
        found[key] = found.get(key, 0) + 1
    return found


def measure_plain_padded(key: str, batch: int, chain: int, replays: int, multiple: int) -> dict:
    """A ``plain_misaligned_keys`` key: torch's convolution with its bias as the bundle runs it, against the same on
    channels padded to ``multiple`` (the input copied into its padded form in each call, the output's first
    channels a view), their outputs compared."""
    import torch

    _, xs, ws, strides, pads, dil, group, x, w, b = _operands(key, batch)
    c, k, cp, kp, xp, wp, bp = _padded_operands(x, w, b, multiple)

    def plain():
        return torch.convolution(x, w, b, strides, pads, dil, False, [0, 0], group)

    def padded():
        xp[:, :c].copy_(x)
        return torch.convolution(xp, wp, bp, strides, pads, dil, False, [0, 0], group)[:, :k]

    with torch.no_grad():
        a, p = plain().float(), padded().float()
        err = float((a - p).abs().max() / max(a.abs().max(), 1e-6))
        plain_us = _graph_us(plain, chain, replays)
        padded_us = _graph_us(padded, chain, replays)
    return {"channels": [c, k], "padded_to": [cp, kp], "plain_us": round(plain_us, 3),
            "padded_us": round(padded_us, 3), "padded_ratio": round(plain_us / padded_us, 3),
            "padded_max_err": round(err, 5)}


def summary(rows: list[dict]) -> dict:
    fused = sum(r["count"] * r["fused_us"] for r in rows)
    unfused = sum(r["count"] * r["unfused_us"] for r in rows)
    best = sum(r["count"] * min(r["fused_us"], r["unfused_us"]) for r in rows)
    return {"shapes": len(rows), "convs": sum(r["count"] for r in rows),
            "fused_wins": sum(r["count"] for r in rows if r["fused_us"] < r["unfused_us"]),
            "all_fused_us": round(fused, 1), "all_unfused_us": round(unfused, 1), "each_faster_us": round(best, 1),
            "gain_over_better_whole_us": round(min(fused, unfused) - best, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="resnet50,squeezenet1_1")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--chain", type=int, default=20)
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument("--shapes-only", action="store_true", help="list the shapes without timing (no GPU needed)")
    ap.add_argument("--epilogues", choices=("relu", "silu"), default="relu",
                    help="relu: the converter's conv+ReLU fusions; silu: conv + bias + SiLU as one cuDNN plan")
    ap.add_argument("--pad-channels", type=int, default=0, metavar="N",
                    help="relu: also time each dense shape whose channels are not a multiple of N padded up to it")
    ap.add_argument("--plain", action="store_true",
                    help="with --pad-channels N: also the dense convolutions no fusion takes whose channels are not a "
                         "multiple of N, plain against padded (``plain_rows`` per model)")
    ap.add_argument("--seconds", type=float, default=400.0, help="start no new model after this")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/conv_epilogues_out"))
    args = ap.parse_args(argv)
    import onnx
    import torch
    from gpu import export, make_model

    from parastream.launcher.engines.cudnn_fused import fused_conv_keys, parse_key

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    results = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
               "torch": torch.__version__, "models": {}}
    if torch.cuda.is_available():
        results["cudnn"] = torch.backends.cudnn.version()
    for name in filter(None, args.models.split(",")):
        if time.perf_counter() - t_start > args.seconds:
            results["models"][name] = {"skipped": "time"}
            continue
        model, inputs = make_model(name, args.batch)
        path = out / f"{name}.onnx"
        export(model, inputs, path)
        silu = args.epilogues == "silu"
        # relu: the shapes a build times (pipeline.measure.time_conv_shapes)
        found = (silu_conv_keys if silu else fused_conv_keys)(onnx.load(str(path)))
        rows = []
        for key, count in sorted(found.items(), key=lambda kv: (-kv[1], kv[0])):
            kind, x, w = parse_key(key)[:3]
            row = {"count": count, "key": key, "kind": kind, "x": [args.batch, *x], "w": w}
            if not args.shapes_only:
                row.update((measure_silu_shape if silu else measure_shape)(key, args.batch, args.chain, args.replays))
                n = args.pad_channels
                if n and not silu and row.get("group", 1) == 1 and (w[0] % n or w[1] % n):
                    try:
                        row["padded"] = measure_padded(key, args.batch, args.chain, args.replays, n)
                    except Exception as e:  # noqa: BLE001 - the shape's row says what failed
                        row["padded"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            rows.append(row)
        res = {"rows": rows}
        if args.plain and args.pad_channels:
            plain_rows = []
            for key, count in sorted(plain_misaligned_keys(onnx.load(str(path)), args.pad_channels).items(),
                                     key=lambda kv: (-kv[1], kv[0])):
                _, x, w = parse_key(key)[:3]
                row = {"count": count, "key": key, "x": [args.batch, *x], "w": w}
                if not args.shapes_only:
                    try:
                        row.update(measure_plain_padded(key, args.batch, args.chain, args.replays, args.pad_channels))
                    except Exception as e:  # noqa: BLE001 - the shape's row says what failed
                        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                plain_rows.append(row)
            res["plain_rows"] = plain_rows
        if not args.shapes_only:
            res["summary"] = summary(rows)
        results["models"][name] = res
        print(json.dumps({"model": name, **({"summary": res["summary"]} if "summary" in res else
                                            {"shapes": len(rows), "convs": sum(found.values())})}), flush=True)
    (out / f"conv_epilogues{'_silu' if args.epilogues == 'silu' else ''}.json").write_text(json.dumps(results, indent=1))
    for name, res in results["models"].items():
        for r in res.get("plain_rows", []):
            print(f"{name:22s} plain    x{r['count']:<3d} {str(r['x']):22s} {str(r['w']):20s} "
                  f"plain {r.get('plain_us')}  padded {r.get('padded_us')}  ratio {r.get('padded_ratio')}")
        for r in res.get("rows", []):
            if "ratio" in r:
                print(f"{name:22s} {r['kind']:8s} x{r['count']:<3d} {str(r['x']):22s} {str(r['w']):20s} "
                      f"fused {r['fused_us']:7.2f}  unfused {r['unfused_us']:7.2f}  ratio {r['ratio']:.2f}"
                      + (f"  padded {r['padded'].get('padded_us')} (+pad {r['padded'].get('pad_us')}) "
                         f"ratio {r['padded'].get('padded_ratio')}" if "padded" in r else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
