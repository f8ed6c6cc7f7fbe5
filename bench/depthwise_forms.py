#!/usr/bin/env python3
"""What each way of writing a depthwise convolution for Inductor costs to compile and to run, on whole models.

A GPU build races a depthwise-separable network's depthwise convolutions as cuDNN calls against the same
convolutions as ops Inductor compiles into its own kernels (``onnx_torch._conv_as_kernels``), and on MixNet-S the
Inductor form wins by ~28% and its whole-model compile bounds the build (bench/NOTES.md, "Open questions").
Inductor's own Python work (tracing, lowering, fusion, code generation) grows with the ops it is given.  This
compiles the model's depthwise-as-Inductor engine once per form, each in a fresh process with the same warm start
(caches a compile of the model's cuDNN form filled, so that what differs is the depthwise kernels' compile), and
in that process times the form's engine against the cuDNN form's side by side (``pipeline.bench.measure``) and
compares their outputs.

Forms (``FORMS``):
  converter  the converter's own: one reduction over the taps of the input's windows (a view), written out as a
             sum by Inductor up to ``onnx_torch.UNROLLED_TAPS`` taps (the engines' ``_lowering_configs``), and
             beyond, a loop over ``F.unfold``'s columns
  windows_beyond  the windows for every kernel (a loop beyond ``UNROLLED_TAPS``)
  written_out the windows for every kernel, each written out as a sum whatever its taps (Inductor's
             ``unroll_reductions_threshold`` above 81, a 9x9 kernel's): whether ConvNeXt-T's 7x7 kernels, which
             cuDNN runs at 11-15 µs each whatever their size and whichever of its plans (bench/NOTES.md,
             fifty-second session), run faster as one pointwise kernel of 49 loads, and what that costs the compile
             (ConvNeXt-T, H200: 7.4-7.9 µs a shape alone, yet the engine 1.113x of the cuDNN form's, compile 58 s)
  windows    the windows for every kernel with Inductor's defaults (every reduction over 8 or more taps a loop)
  summed     the form before it: a sum of the k*k shifted slices up to 25 taps, ``unfold`` beyond
  unfold     one reduction over the taps of ``F.unfold``'s columns, for every kernel
  strided    ``windows`` with the padded input a channels-last buffer of its own (``as_strided``)
  triton     parastream's own Triton kernel (``conv_kernels`` "triton", ``conv_triton``), which Inductor
             compiles into the engine's code but does not fuse with the ops around it
``converter`` and ``windows_beyond`` compile with the engines' Inductor configuration, ``written_out`` with the
threshold above, the others with Inductor's defaults.

Run on the device after ``source bench/device_env.sh``:
    python3 bench/depthwise_forms.py --models mixnet_s,efficientnet_b0 --out $OUT
On the CPU, ``--check`` compares every form with ``F.conv2d`` on strided and asymmetrically padded shapes.
Writes depthwise_forms.json under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path


def _geometry(x_shape, w_shape, kernel, strides, dil, group, begin, end):
    """(channels, kh, kw, sh, sw, padded h, padded w, output h, output w, F.pad's argument or None) of a 2-d
    depthwise convolution, or None for any other (the converter lowers the same ones)."""
    from parastream.launcher.engines.onnx_torch import _torch_pad_arg

    c = int(x_shape[1])
    kh, kw = (int(k) for k in kernel)
    if any(int(d) != 1 for d in dil) or not (group == c == int(w_shape[0]) and int(w_shape[1]) == 1 and kh * kw > 1):
        return None
    sh, sw = (int(s) for s in strides)
    h, w = int(x_shape[2]) + int(begin[0]) + int(end[0]), int(x_shape[3]) + int(begin[1]) + int(end[1])
    pad = _torch_pad_arg(begin, end) if any(begin) or any(end) else None
    return c, kh, kw, sh, sw, h, w, (h - kh) // sh + 1, (w - kw) // sw + 1, pad


def strided_form(x_shape, w_shape, kernel, strides, dil, group, begin, end):
    """The windows over a padded input made a channels-last buffer of its own (``as_strided`` needs one): what
    produces the input then runs once per element, not once per tap."""
    import torch
    import torch.nn.functional as F

    got = _geometry(x_shape, w_shape, kernel, strides, dil, group, begin, end)
    if got is None:
        return None
    c, kh, kw, sh, sw, h, w, ho, wo, pad = got
    n = int(x_shape[0])

    def depthwise(x, weight, bias=None):
        if pad is not None:
            x = F.pad(x, pad)
        x = x.contiguous(memory_format=torch.channels_last)
        s0, s1, s2, s3 = h * w * c, 1, w * c, c  # that buffer's strides, which the view takes
        win = x.as_strided((n, c, ho, wo, kh, kw), (s0, s1, sh * s2, sw * s3, s2, s3))
        y = (win * weight.view(1, c, 1, 1, kh, kw)).sum((4, 5))
        return y if bias is None else y + bias.view(1, c, 1, 1)

    return depthwise


def summed_form(x_shape, w_shape, kernel, strides, dil, group, begin, end):
    """The sum of the k*k shifted slices up to 25 taps, ``unfold_form`` beyond."""
    import torch.nn.functional as F

    got = _geometry(x_shape, w_shape, kernel, strides, dil, group, begin, end)
    if got is None:
        return None
    c, kh, kw, sh, sw, _, _, ho, wo, pad = got
    if kh * kw > 25:
        return unfold_form(x_shape, w_shape, kernel, strides, dil, group, begin, end)

    def depthwise(x, weight, bias=None):
        if pad is not None:
            x = F.pad(x, pad)
        y = None
        for i in range(kh):
            for j in range(kw):
                t = x[:, :, i:i + (ho - 1) * sh + 1:sh, j:j + (wo - 1) * sw + 1:sw] * weight[:, :, i, j].reshape(1, c, 1, 1)
                y = t if y is None else y + t
        return y if bias is None else y + bias.reshape(1, c, 1, 1)

    return depthwise


def _converters_with(taps: int):
    """The converter's own lowering with ``onnx_torch.UNROLLED_TAPS`` at ``taps`` while it converts: 0 gives
    ``F.unfold``'s columns for every kernel, a large number the windows for every kernel (the Inductor
    configuration the engines compile with is left as it is)."""
    def form(*args):
        from parastream.launcher.engines import onnx_torch

        keep = onnx_torch.UNROLLED_TAPS
        onnx_torch.UNROLLED_TAPS = taps
        try:
            return _converters_own()(*args)
        finally:
            onnx_torch.UNROLLED_TAPS = keep

    return form


windows_form = _converters_with(1 << 30)
unfold_form = _converters_with(0)


#: form -> its lowering (None: the converter's own)
FORMS = {"converter": None, "windows_beyond": windows_form, "written_out": windows_form, "windows": windows_form,
         "summed": summed_form, "unfold": unfold_form, "strided": strided_form, "triton": None}
#: the forms compiled with the engines' own Inductor configuration (the others with Inductor's defaults, or
#: ``WRITTEN_OUT``'s)
ENGINES_CONFIG = {"converter", "windows_beyond", "triton"}
#: Inductor's ``unroll_reductions_threshold`` for ``written_out``: every reduction of a 9x9 kernel or smaller
#: written out
WRITTEN_OUT = {"unroll_reductions_threshold": 82}
_OWN: list = []


def _converters_own():
    """The converter's own lowering (``onnx_torch._conv_as_kernels`` before ``use_form`` replaced it)."""
    if not _OWN:
        from parastream.launcher.engines import onnx_torch

        _OWN.append(onnx_torch._conv_as_kernels)
    return _OWN[0]


def use_form(name: str) -> None:
    """Make the converter lower depthwise convolutions with form ``name``, and the engines compile with the
    Inductor configuration that goes with it, in this process."""
    from parastream.launcher.engines import onnx_torch
    from parastream.launcher.engines import torch as torch_backend

    own = _converters_own()  # kept before it is replaced
    onnx_torch._conv_as_kernels = FORMS[name] or own
    if name == "written_out":
        torch_backend._lowering_configs = lambda options: dict(WRITTEN_OUT)
    elif name not in ENGINES_CONFIG:
        torch_backend._lowering_configs = lambda options: {}  # Inductor's own defaults


def check(device: str = "cpu") -> list[dict]:
    """Every form against ``F.conv2d`` on depthwise shapes with strides and asymmetric pads."""
    import torch
    import torch.nn.functional as F

    from parastream.launcher.engines.onnx_torch import _torch_pad_arg

    rows = []
    g = torch.Generator().manual_seed(0)
    for (c, h, w, k, s, begin, end) in [(8, 9, 11, 3, 1, (1, 1), (1, 1)), (6, 10, 10, 5, 2, (1, 2), (2, 1)),
                                        (4, 13, 12, 7, 1, (3, 3), (3, 3)), (5, 8, 9, 3, 2, (0, 0), (1, 1)),
                                        (3, 12, 12, 9, 2, (4, 4), (4, 4)), (4, 7, 7, 3, 1, (0, 0), (0, 0))]:
        x = torch.randn(1, c, h, w, generator=g).to(device)
        wt = torch.randn(c, 1, k, k, generator=g).to(device)
        b = torch.randn(c, generator=g).to(device)
        ref = F.conv2d(F.pad(x, _torch_pad_arg(begin, end)), wt, b, s, 0, 1, c)
        for name, form in FORMS.items():
            if name == "triton":  # (not a lowering: tests/engines/test_conv_triton.py checks its kernel)
                continue
            fn = (form or _converters_own())(x.shape, wt.shape, (k, k), (s, s), (1, 1), c, list(begin), list(end))
            y = fn(x, wt, b)
            err = float((y - ref).abs().max() / ref.abs().max())
            rows.append({"form": name, "c": c, "hw": [h, w], "k": k, "stride": s, "pads": [begin, end],
                         "shape_ok": list(y.shape) == list(ref.shape), "max_err": err})
    return rows


def child(onnx_path: str, form: str, device: str) -> dict:
    """In this fresh process: the model's engine with depthwise convolutions as ``form`` compiled (timed), then
    the cuDNN form's (its compile in the warm caches), both timed side by side and their outputs compared."""
    from dataclasses import replace

    import numpy as np

    from parastream.launcher.engines import get_backend, require_backend
    from parastream.pipeline.bench import measure
    from parastream.pipeline.build import BuildConfig, Engines, engine_options
    from parastream.pipeline.measure import Variant
    from parastream.pipeline.model_io import load_model
    from parastream.rewrite.cost import RooflineCostModel

    warm_up = form == "-"  # the cuDNN form alone, to fill the caches every form's process starts from
    if not warm_up:
        use_form(form)
    backend = require_backend("torch") if device == "cuda" else get_backend("torch")
    loaded = load_model(onnx_path)
    base = replace(engine_options(BuildConfig(precision="fp16" if device == "cuda" else "fp32"), backend),
                   device=device, compile_workers=1)
    row: dict = {"form": form}
    launchers = {}
    lowered = "triton" if form == "triton" else "inductor"
    for label, kernels in ([] if warm_up else [(form, lowered)]) + [("cudnn", "cudnn")]:
        options = replace(base, conv_kernels=kernels)
        engines = Engines(backend, RooflineCostModel(), loaded, options.precision, blocks=False)
        v = Variant(loaded.model, loaded.graph, engines.plan(loaded.graph, 1, 1), options)
        t0 = time.perf_counter()
        got = engines.precompile([v])
        row[f"{label}_compile_s"] = round(time.perf_counter() - t0, 2)
        row[f"{label}_jobs"] = got.get("jobs")
        if label == form:
            try:
                from torch._dynamo.utils import compile_times

                row["torch_phases"] = compile_times(repr="str", aggregate=True)
            except Exception as e:  # noqa: BLE001 - another torch: the row goes without
                row["torch_phases"] = f"{type(e).__name__}: {e}"
        launchers[label] = engines.launcher(v)
    if device != "cuda" or warm_up:
        return row
    rng = np.random.default_rng(1)
    first = launchers[form]
    feeds = {s.name: rng.standard_normal(s.shape).astype(s.dtype) for s in first.plan.inputs}
    outs = {k: la(feeds) for k, la in launchers.items()}
    errs = []
    for name, ref in outs["cudnn"].items():
        a, b = np.asarray(outs[form][name], np.float32), np.asarray(ref, np.float32)
        errs.append(float(np.abs(a - b).max() / max(float(np.abs(b).max()), 1e-6)))
    row["max_err_vs_cudnn"] = max(errs)
    reps = []
    for rep in range(3):
        times = measure(launchers, runs=200, seed=rep)
        reps.append({k: float(np.median(t)) for k, t in times.items()})
    row["median_ms"] = {k: round(float(np.median([r[k] for r in reps])), 4) for k in launchers}
    row["vs_cudnn"] = round(row["median_ms"][form] / row["median_ms"]["cudnn"], 4)
    for la in launchers.values():
        la.close()
    return row


def main() -> int:
    if sys.argv[1:2] == ["--child"]:
        onnx_path, form, device = sys.argv[2:5]
        print("RESULT " + json.dumps(child(onnx_path, form, device)), flush=True)
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="mixnet_s", help="bench/gpu.py make_model names, or ONNX files")
    ap.add_argument("--forms", default=",".join(FORMS))
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--timeout", type=float, default=150.0, help="seconds one form's process may take")
    ap.add_argument("--check", action="store_true", help="only compare the forms with F.conv2d (CPU)")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/depthwise_forms"))
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.check:
        rows = check()
        for r in rows:
            print(json.dumps(r))
        bad = [r for r in rows if not r["shape_ok"] or r["max_err"] > 1e-5]
        print(f"{len(rows)} cases, {len(bad)} wrong")
        return 1 if bad else 0
    forms = [f.strip() for f in a.forms.split(",") if f.strip()]
    unknown = [f for f in forms if f not in FORMS]
    if unknown:
        ap.error(f"--forms: unknown {unknown}; choose from {', '.join(FORMS)}")
    result = {"device": a.device, "models": {}}
    for model in [m.strip() for m in a.models.split(",") if m.strip()]:
        if model.endswith(".onnx"):
            onnx_path = model
        else:
            sys.path.insert(0, str(Path(__file__).parent))
            from gpu import export, make_model

            m, inputs = make_model(model, 1)
            onnx_path = str(out / f"{model}.onnx")
            export(m, inputs, onnx_path)
        # the warm start every form's process copies: the caches a compile of the cuDNN form filled
        warm = out / f"{Path(onnx_path).stem}-warm"
        rows = []
        for i, form in enumerate(["-"] + forms):
            caches = out / f"{Path(onnx_path).stem}-{i}"
            if i:
                shutil.copytree(warm, caches)
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str((warm if not i else caches) / "inductor"),
                       TRITON_CACHE_DIR=str((warm if not i else caches) / "triton"), PARASTREAM_COMPILE_WORKERS="1")
            t0 = time.perf_counter()
            try:
                p = subprocess.run([sys.executable, __file__, "--child", onnx_path, form, a.device], env=env, capture_output=True, text=True, timeout=a.timeout)
                row = next((json.loads(line[7:]) for line in p.stdout.splitlines() if line.startswith("RESULT ")),
                           None) or {"form": form, "error": (p.stderr.strip().splitlines() or ["no result"])[-1][:400]}
            except subprocess.TimeoutExpired:
                row = {"form": form, "error": f"over {a.timeout:.0f} s"}
            row.update(process_s=round(time.perf_counter() - t0, 2), warm_up=not i)
            rows.append(row)
            result["models"][model] = rows
            (out / "depthwise_forms.json").write_text(json.dumps(result, indent=1))
            print(json.dumps({"model": model, **row}), flush=True)
            if i:
                shutil.rmtree(caches, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
