"""The ``parastream`` command line.

Options that several commands share (model shapes, backend and precision,
tolerances) are defined once as argument groups, the way polygraphy does it, so
``build``, ``inspect`` and ``verify`` spell them the same way.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import re
import signal
import sys
from contextlib import contextmanager
from pathlib import Path

from parastream.launcher.errors import ParastreamError


# -- option types: a bad value is refused by argparse, naming the option --------------------------------
def int_in(lo: int, hi: int):
    """An argparse type: a decimal integer (ASCII digits) from ``lo`` to ``hi``."""
    def parse(text: str) -> int:
        t = text.strip()
        if not re.fullmatch(r"[+-]?[0-9]+", t) or len(t) > 40:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer")
        v = int(t)
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"{v} is out of range: give {lo} to {hi}")
        return v
    parse.__name__ = "integer"
    return parse


def tolerance(text: str) -> float:
    """An argparse type: a finite, non-negative float."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(v) or v < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a tolerance is a finite number >= 0")
    return v


def device_option(text: str) -> str:
    """An argparse type: auto, cpu, cuda, cuda:N or N (a GPU this machine has), as ``launcher.load`` takes it;
    a bad value's error names the GPUs present (launcher.cuda.parse_device)."""
    from parastream.launcher.cuda import parse_device

    try:
        kind, n = parse_device(text, option=None)
    except ParastreamError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return kind if n is None else f"cuda:{n}"


def gpu_list(text: str) -> list[int]:
    """An argparse type: GPU ordinals separated by commas ("0,1"), each once."""
    parts = [p.strip() for p in text.split(",")]
    if not parts or any(not re.fullmatch(r"[0-9]{1,4}", p) for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of GPU numbers: give e.g. 0,1")
    gpus = [int(p) for p in parts]
    if len(set(gpus)) != len(gpus):
        raise argparse.ArgumentTypeError(f"{text!r} names a GPU twice")
    return gpus


DEVICE_HELP = "auto, cpu, cuda (GPU 0) or cuda:N (GPU N); default auto: GPU 0 for a GPU bundle where one is present"

MAX_STREAMS = 64  # CUDA's concurrent kernel limit is 128; a plan this wide is already far past any measured gain


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors on one line (no usage block): ``parastream build: error: argument --seed: ...``."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


# -- shared argument groups ---------------------------------------------------------------------------
def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--shapes", default=None, metavar="NAME:1x3x224x224,...",
                   help="static shapes for inputs with unknown dimensions; a dimension name shared by several inputs "
                        "is one dimension, so sizing it on one input sizes it on all (input_ids:1x128 fixes an "
                        "attention_mask [batch, seq] too); with build's --batch, --batch gives the first dimension of a "
                        "dynamic-batch input and the value written there is replaced (write 1)")


def add_batch_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch", default=None, metavar="MIN:OPT:MAX",
                   help="dynamic batch: one static plan, engines and CUDA Graph per batch bucket; any batch MIN..MAX "
                        "runs on the smallest bucket that holds it (OPT: where the search measures); the other "
                        "unknown dimensions come from --shapes, e.g. --batch 1:8:32 --shapes input_ids:1x128")
    p.add_argument("--batch-buckets", default=None, metavar="1,2,4,...",
                   help="the buckets of --batch (default: MIN, the powers of two between, MAX)")
    p.add_argument("--min-shapes", default=None, metavar="NAME:1x1,...",
                   help="dynamic shapes on any axis (with --max-shapes, --opt-shapes): a dimension whose min and max "
                        "differ is dynamic; one static bucket per size in a grid over those axes (docs/dynamic-shapes.md)")
    p.add_argument("--opt-shapes", default=None, metavar="NAME:1x128,...",
                   help="where the rewrite search measures (default: --min-shapes)")
    p.add_argument("--max-shapes", default=None, metavar="NAME:8x512,...", help="the largest shape of each input")
    p.add_argument("--buckets", action="append", default=None, metavar="NAME:AXIS=16,32,...",
                   help="the buckets of one dynamic axis (default: MIN, the powers of two between, MAX); an axis whose "
                        "padding the build cannot prove harmless is built exactly at these sizes (repeatable)")
    p.add_argument("--pad", action="append", default=None, metavar="NAME=VALUE",
                   help="what an input's padded positions hold (a number, or 'continue' for position ids); default "
                        "by name: masks, token ids and token types 0, position ids continuing (repeatable)")


def add_schedule_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("schedule")
    g.add_argument("--streams", type=int_in(1, MAX_STREAMS), default=None, metavar="K",
                   help=f"number of streams, 1 to {MAX_STREAMS} (default: the count estimated fastest, at most 4; one unless more "
                        "pay >= 10%%)")
    g.add_argument("--device-profile", default=None, metavar="NAME",
                   help="device the cost model plans for (see `parastream devices`; default: CPU for CPU engines, "
                        "else H100-SXM)")


def add_backend_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engines")
    g.add_argument("--backend", default="auto", choices=["auto", "tensorrt", "torch", "onnxruntime"],
                   help="engine backend; auto picks tensorrt, then torch on a GPU, then onnxruntime")
    g.add_argument("--precision", default="fp32", choices=["fp32", "tf32", "fp16", "bf16"])
    g.add_argument("--workspace-mb", type=int_in(1, 1 << 24), default=4096, help="TensorRT workspace pool limit")
    g.add_argument("--opt-level", type=int_in(0, 5), default=3,
                   help="kernel search at build: TensorRT's builder_optimization_level (0..5); torch engines: 4 "
                        "tunes Inductor's kernels by coordinate descent, 5 is max-autotune: a GPU build races them against "
                        "level 3 last, on the plan its rounds chose, and ships the faster (default 3)")
    g.add_argument("--strongly-typed", action="store_true", help="TensorRT strongly typed network")
    g.add_argument("--eager", action="store_true", help="torch backend: run branches eagerly instead of compiling them")
    g.add_argument("--keep-fp32", default=None, metavar="NODE_OR_PATTERN,...",
                   help="build the branches (TensorRT: the layers) holding these op types, node names or globs in fp32")
    g.add_argument("--cache-dir", default=None, help="where TensorRT timing caches, compiled torch engines (the compiled-branch cache) and a build's timed decisions (a GPU build's, a CPU build's choice) persist across builds")
    g.add_argument("--remeasure", action="store_true",
                   help="with --cache-dir: time again (on the GPU, or the CPU alternatives) what an earlier build of the same model recorded there, and record the new result")
    g.add_argument("--torch-artifact", default="inductor", choices=["inductor", "aoti", "jit"],
                   help="torch backend: what an engine ships (docs/torch-engines.md; default inductor)")
    g.add_argument("--inductor-format", default="kernels", choices=["kernels", "bundled", "cache"],
                   help="torch backend, inductor artifacts: how they are saved (default kernels)")
    g.add_argument("--conv-kernels", default="auto", choices=["auto", "cudnn", "inductor", "native", "triton"],
                   help="torch backend: depthwise convolutions as cuDNN calls, as Inductor kernels, as torch's own "
                        "depthwise kernel or as parastream's Triton kernel (which also runs convolutions of at most 16 "
                        "channels a group); the last three start faster (default auto: a GPU build times cuDNN's "
                        "against Inductor's, the faster against torch's, then the faster against parastream's)")
    g.add_argument("--cudnn-plans", action=argparse.BooleanOptionalAction, default=True,
                   help="torch backend on a GPU: depthwise convolutions through cuDNN plans each engine ships, built "
                        "when it compiles (needs nvidia-cudnn-frontend), so that a fresh process builds none "
                        "(default on; --no-cudnn-plans: torch's convolution, whose plans every process builds)")
    g.add_argument("--engine-blocks", default="auto", choices=["auto", "blocks", "whole"],
                   help="a plan on one stream: one engine per repeated block, whose equal code compiles once, or one "
                        "engine for the whole model (default auto: blocks where the backend compiles equal code once, "
                        "the torch backend)")
    g.add_argument("--head-engine", action="store_true",
                   help="a plan on one stream cut by --engine-blocks: its classifier head (a CNN's Linear after the "
                        "global pooling) an engine of its own, so that a GPU build's GEMM-epilogue round compiles "
                        "the head alone (default off: one engine with the rest)")
    g.add_argument("--compile-workers", type=int_in(0, 1024), default=0, metavar="N",
                   help="torch backend: processes compiling engines side by side (default 0: every core but one, at most 16)")
    g.add_argument("--no-gpu-timing-lock", action="store_true",
                   help="GPU builds: time without taking turns with other builds' timing on the same GPU")


def add_tolerance_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("verification")
    g.add_argument("--rtol", type=tolerance, default=None, help="elementwise criterion: relative tolerance")
    g.add_argument("--atol", type=tolerance, default=None, help="elementwise criterion: absolute tolerance")
    g.add_argument("--scale-tol", type=tolerance, default=None, metavar="TOL",
                   help="pass an output when max|out-ref|/max|ref| <= TOL (default by precision: fp32 1e-3, tf32 1e-2, "
                        "fp16 0.1, bf16 0.15; `verify` uses the bundle's); --rtol/--atol judge each element instead")
    g.add_argument("--seed", type=int_in(0, 2**32 - 1), default=0, help="seed of the random inputs")


_STDOUT = None  # the command's own output: sys.stdout as main found it (``_library_output`` redirects sys.stdout)


def _stdout():
    return _STDOUT or sys.stdout


def parse_keep_fp32(text: str | None) -> list[str]:
    """--keep-fp32 "Softmax,conv_3,*/attn/*" -> its patterns."""
    items = [t.strip() for t in (text or "").split(",")]
    if text is not None and not all(items):
        raise ParastreamError(f"--keep-fp32 {text!r}: give comma-separated op types, node names or globs, none empty")
    return [t for t in items if t]


def _console(stderr: bool = False):
    from rich.console import Console

    stream = sys.stderr if stderr else _stdout()
    # piped into a log: lines of text are not wrapped, and tables are 160 columns wide instead of 80
    tty = stream.isatty()
    return Console(file=stream, soft_wrap=not tty, width=None if tty else 160)


# -- commands ------------------------------------------------------------------------------------------
def cmd_build(args) -> int:
    from .build import BuildConfig, build
    from .model_io import parse_axis_buckets, parse_batch, parse_buckets, parse_pads, parse_shape_option, parse_shapes
    from .report import print_build_summary

    cfg = BuildConfig(backend=args.backend, streams=args.streams, shapes=parse_shapes(args.shapes), batch=parse_batch(args.batch),
                      batch_buckets=parse_buckets(args.batch_buckets),
                      min_shapes=parse_shape_option(args.min_shapes, "--min-shapes"),
                      opt_shapes=parse_shape_option(args.opt_shapes, "--opt-shapes"),
                      max_shapes=parse_shape_option(args.max_shapes, "--max-shapes"),
                      shape_buckets=parse_axis_buckets(args.buckets), pads=parse_pads(args.pad),
                      precision=args.precision,
                      search=not args.no_search, verify=not args.no_verify, rtol=args.rtol, atol=args.atol,
                      scale_tol=args.scale_tol, seed=args.seed,
                      device=args.device_profile, workspace_mb=args.workspace_mb, optimization_level=args.opt_level,
                      strongly_typed=args.strongly_typed, cache_dir=args.cache_dir, remeasure=args.remeasure, compile=not args.eager, force=args.force,
                      torch_artifact=args.torch_artifact, inductor_format=args.inductor_format,
                      conv_kernels=args.conv_kernels, cudnn_plans=args.cudnn_plans, engine_blocks=args.engine_blocks,
                      head_engine=args.head_engine, compile_workers=args.compile_workers,
                      gpu_timing_lock=not args.no_gpu_timing_lock,
                      keep_fp32=parse_keep_fp32(args.keep_fp32), host_tail=not args.no_host_tail,
                      **({} if args.measure_seconds is None else {"measure_seconds": float(args.measure_seconds)}))
    triton_name = args.triton_name or Path(args.model).stem
    if args.triton_repo:  # refuse a bad export before the build, not after it
        from .outdir import check_target
        from .triton import check_options

        check_options(triton_name, args.triton_mode, 0, 1)
        check_target(Path(args.triton_repo) / triton_name, kind="triton", force=args.force,
                     protect=(args.model, args.output), option=f"--triton-repo model {triton_name!r}")
    # progress: a live display on a terminal, one line per stage in a build log (no blank lines around an error)
    bundle = build(args.model, args.output, config=cfg, progress=not args.quiet)
    if args.json:
        from .report import build_summary

        print(json.dumps(build_summary(bundle), default=str), file=_stdout())
    elif not args.quiet:
        print_build_summary(bundle, _console(), verbose=args.verbose)
    if args.triton_repo:
        from .triton import export_triton

        try:
            path = export_triton(bundle.path, args.triton_repo, name=triton_name, mode=args.triton_mode, force=args.force)
        except ParastreamError as e:
            raise ParastreamError(f"the bundle {bundle.path} was written, but the Triton export failed: {e}") from None
        if not args.quiet and not args.json:
            _console().print(f"Triton model repository: {path}")
    return 0


def cmd_inspect(args) -> int:
    from .model_io import parse_shapes
    from .report import inspect_model

    if Path(args.model).is_dir():  # a bundle: what its build chose (a dynamic-batch bundle: per bucket too)
        from parastream.launcher.bundle import Bundle

        from .report import print_build_summary

        print_build_summary(Bundle.open(args.model), _console(), verbose=True)
        return 0
    inspect_model(args.model, shapes=parse_shapes(args.shapes), streams=args.streams, device=args.device_profile,
                  picture=args.picture, search=args.search, console=_console())
    return 0


def _parse_input_files(items: list[str]) -> dict:
    import numpy as np

    feeds = {}
    for item in items or []:
        name, sep, file = item.partition("=")
        if not sep or not name or not file:
            raise ParastreamError(f"--input {item!r} is not NAME=file.npy")
        path = Path(file)
        if not path.is_file():
            raise ParastreamError(f"--input {name}: {path}: no such file")
        try:
            feeds[name] = np.load(path, allow_pickle=False)
        except Exception as e:  # noqa: BLE001 - numpy raises several kinds
            raise ParastreamError(f"--input {name}: {path} is not a .npy file ({e})") from None
    return feeds


def cmd_run(args) -> int:
    import numpy as np

    from parastream.launcher import load

    from .outdir import check_target, staging, write_marker

    out_dir = check_target(args.output_dir, kind="run", force=args.force, option="--output-dir",
                           protect=[args.bundle] + [item.partition("=")[2] for item in args.input or [] if "=" in item])
    runner = load(args.bundle, device=args.device)
    feeds = _parse_input_files(args.input)
    outputs = runner(feeds)
    files = output_file_names(list(outputs))
    with staging(out_dir, "run") as tmp:
        for name, value in outputs.items():
            np.save(tmp / files[name], np.asarray(value))
        write_marker(tmp, "parastream run")
    con = _console()
    from rich.markup import escape
    from rich.table import Table

    t = Table(title=escape(f"outputs written to {out_dir}"))
    for col in ("output", "file", "shape", "dtype"):
        t.add_column(col)
    for name, value in outputs.items():
        t.add_row(escape(name), files[name], "x".join(map(str, np.shape(value))), str(np.asarray(value).dtype))
    con.print(t)
    return 0


def output_file_names(names: list[str]) -> dict[str, str]:
    """A distinct ``.npy`` file name per output: the name with characters other than letters, digits and
    ``._-`` replaced by ``_``, then ``~2``, ``~3``, ... where two names would give the same file (compared
    without case, for case-insensitive file systems)."""
    files, taken = {}, set()
    for name in names:
        base = "".join(ch if (ch.isascii() and ch.isalnum()) or ch in "._-" else "_" for ch in name)[:200].lstrip(".") or "_"
        candidate, n = base, 1
        while candidate.lower() in taken:
            n += 1
            candidate = f"{base}~{n}"
        taken.add(candidate.lower())
        files[name] = f"{candidate}.npy"
    return files


def cmd_verify(args) -> int:
    """Compare a bundle with onnxruntime on the original model; print the result, never write into the bundle."""
    from parastream.launcher import load
    from parastream.launcher.bundle import Bundle
    from parastream.launcher.tail import MANIFEST_KEY

    from .model_io import load_model
    from .report import print_verification
    from .build import run_verification
    from .verify import bundle_tolerances

    bundle = Bundle.open(args.bundle, loading=True)
    original = original_model(bundle, args.model)
    if bundle.manifest.get("buckets"):
        return verify_buckets(bundle, original, args)
    shapes = {t.name: t.shape for t in bundle.plan.inputs}
    # a bundle with a data-dependent tail: its static part against the original's, what the tail reads included
    # (the tail is the original's own nodes: launcher/tail.py)
    tail = MANIFEST_KEY in bundle.manifest
    loaded = load_model(original, shapes, host_tail=tail)
    rtol, atol, scale_tol = bundle_tolerances(bundle, args.rtol, args.atol, args.scale_tol)
    runner = load(bundle.path, device=args.device, host_tail=False)
    try:
        result = run_verification(original, loaded.original, runner, bundle.plan.inputs, rtol=rtol, atol=atol,
                                  scale_tol=scale_tol, seed=args.seed, iterations=args.iterations)
    finally:
        close = getattr(runner, "close", None)
        if close:
            close()
    found = None
    if args.localize:
        from .localize import localize, print_localization

        found = localize(bundle.path, original, seed=args.seed, iterations=args.iterations, device=args.device,
                         scale_tol=scale_tol, check_hashes=False, loaded=loaded)  # (checked by the open above)
    if args.json:
        print(json.dumps(dict(result.to_dict(), bundle=str(bundle.path), model=str(original),
                              **({"localization": found.to_dict()} if found else {})), default=str), file=_stdout())
    else:
        print_verification(result, _console(), title=f"verify {bundle.path} against onnxruntime on {original}")
        if found:
            print_localization(found, _console())
    return 0 if result.passed else 1


def original_model(bundle, given: str | None) -> str:
    """The model ``bundle`` was built from: ``--model`` (``given``), else the path its report.json records; where
    that is not there, an error that says so (never another model in its place)."""
    if given:
        if not Path(given).is_file():
            raise ParastreamError(f"--model {given}: no such file")
        return given
    recorded = bundle.report.get("model", {}).get("path")
    if recorded and Path(recorded).is_file():
        return recorded
    if not recorded:
        where = "its report.json records no original model"
    elif not Path(recorded).is_absolute():  # bundles of an older parastream recorded the path as the build was given it
        where = f"the original model {recorded} (recorded relative to the folder it was built in) is not there"
    else:
        where = f"the original model {recorded} is not there"
    raise ParastreamError(f"{bundle.path}: {where}; name it with --model ORIGINAL.onnx")


def verify_buckets(bundle, original: str, args) -> int:
    """``parastream verify`` on a dynamic-batch bundle: every bucket and a batch between buckets, each against
    onnxruntime on the original model at that batch."""
    from parastream.launcher import load

    from .buckets import verification_batches, verify_at_batches
    from .report import print_verification
    from .verify import bundle_tolerances

    rtol, atol, scale_tol = bundle_tolerances(bundle, args.rtol, args.atol, args.scale_tol)
    runner = load(bundle.path, device=args.device)
    if runner.grid:  # a grid over named axes: every bucket and a point between buckets
        return _verify_grid(bundle, original, runner, args, rtol, atol, scale_tol)
    try:
        results = verify_at_batches(original, runner, verification_batches(runner.sizes), rtol=rtol, atol=atol,
                                    scale_tol=scale_tol, seed=args.seed, iterations=args.iterations)
    finally:
        runner.close()
    passed = all(r.passed for r in results.values())
    if args.json:
        print(json.dumps({"passed": passed, "bundle": str(bundle.path), "model": str(original),
                          "batches": {str(n): r.to_dict() for n, r in results.items()}}, default=str), file=_stdout())
    else:
        for n, r in results.items():
            where = "bucket" if n in runner.sizes else f"between buckets, run on bucket {runner.bucket_for(n)}"
            print_verification(r, _console(), title=f"verify {bundle.path} at batch {n} ({where}) against onnxruntime on {original}")
    return 0 if passed else 1


def _verify_grid(bundle, original: str, runner, args, rtol, atol, scale_tol) -> int:
    from parastream.launcher.buckets import key_text

    from .buckets import verification_points, verify_at_points
    from .report import print_verification

    try:
        results = verify_at_points(original, runner, verification_points(runner), rtol=rtol, atol=atol,
                                   scale_tol=scale_tol, seed=args.seed, iterations=args.iterations)
        buckets = {p: runner.bucket_for(p) for p in results}
    finally:
        runner.close()
    passed = all(r.passed for r in results.values())
    axes = "x".join(a["name"] for a in runner.axes)
    if args.json:
        print(json.dumps({"passed": passed, "bundle": str(bundle.path), "model": str(original), "axes": axes,
                          "points": {key_text(p): dict(r.to_dict(), bucket=key_text(buckets[p])) for p, r in results.items()}},
                         default=str), file=_stdout())
    else:
        for p, r in results.items():
            where = "bucket" if p == buckets[p] else f"between buckets, run padded on bucket {key_text(buckets[p])}"
            print_verification(r, _console(), title=f"verify {bundle.path} at {axes} {key_text(p)} ({where}) against "
                                                    f"onnxruntime on {original}, unpadded")
    return 0 if passed else 1


def _is_bucketed(path) -> bool:
    """Whether ``path`` looks like a dynamic-batch bundle (its manifest lists buckets; Bundle.open checks the rest)."""
    try:
        return bool(json.loads((Path(path) / "manifest.json").read_text()).get("buckets"))
    except (OSError, ValueError, AttributeError):
        return False


def _bench_gpu(bundle, option: str) -> int:
    """The GPU ``parastream bench`` times ``bundle`` on, from ``--device`` (``option``): a GPU bundle runs on a GPU,
    a CPU bundle on the CPU."""
    from parastream.launcher.cuda import parse_device
    from parastream.launcher.engines import get_backend

    kind, n = parse_device(option, option="--device")
    gpu_bundle = bool(get_backend(bundle.plan.backend).gpu)  # (what the engines are; bench checks they can run here)
    if gpu_bundle and kind == "cpu":
        raise ParastreamError(f"--device cpu: {bundle.path} has {bundle.plan.backend} engines, which bench times on a GPU; "
                              "give auto, cuda or cuda:N")
    if not gpu_bundle and kind == "cuda":
        raise ParastreamError(f"--device {option}: {bundle.path} has {bundle.plan.backend} engines, which run on the CPU; "
                              "give auto or cpu")
    return n or 0


def cmd_bench(args) -> int:
    from parastream.launcher.bundle import Bundle

    from .bench import bench_bundle

    if _is_bucketed(args.bundle):  # a dynamic-batch bundle: each bucket, and a batch between buckets
        from .bench import bench_buckets

        bundle = Bundle.open(args.bundle, loading=True)
        result = bench_buckets(bundle, runs=args.runs, warmup=args.warmup, console=None if args.json else _console(),
                               gpu=_bench_gpu(bundle, args.device))
        if args.json:
            print(json.dumps(result, default=str), file=_stdout())
        return 0
    target, gpu = args.bundle, 0
    if args.device != "auto":  # checked against the bundle's engines, which bench_bundle then takes opened
        target = Bundle.open(args.bundle, loading=True)
        gpu = _bench_gpu(target, args.device)
    result = bench_bundle(target, runs=args.runs, warmup=args.warmup, timeline=args.timeline,
                          console=None if args.json else _console(), whole_model=args.whole_model,
                          concat_ablation=args.concat_ablation, gpu=gpu, original=args.model)
    if args.json:
        print(json.dumps(result, default=str), file=_stdout())
    return 0


def cmd_export_triton(args) -> int:
    from .triton import export_triton

    path = export_triton(args.bundle, args.repo, name=args.name, mode=args.mode, max_batch=args.max_batch,
                         instances=args.instances, gpus=args.gpus, force=args.force)
    _console().print(f"Triton model repository written: {path}")
    return 0


def cmd_validate_triton(args) -> int:
    from rich.markup import escape
    from rich.table import Table

    from .triton import validate_repository

    repo = Path(args.repo)
    if not repo.is_dir():
        raise ParastreamError(f"{repo}: {'not a folder' if repo.exists() else 'no such folder'}; "
                              "name a Triton model repository (as `parastream export-triton` writes)")
    problems = validate_repository(repo)
    con = _console()
    if not problems:
        models = sorted(d.name for d in repo.iterdir() if d.is_dir() and not d.name.startswith("."))
        con.print(f"ok: {escape(str(repo))} is a valid Triton model repository ({len(models)} models: {escape(', '.join(models))})")
        return 0
    t = Table(title=f"{escape(str(repo))}: {len(problems)} problem{'s' if len(problems) != 1 else ''}")
    t.add_column("where", overflow="fold")
    t.add_column("problem", overflow="fold")
    prefix = str(repo).rstrip("/") + "/"
    for problem in problems:
        where, sep, what = problem.partition(": ")
        if not sep:
            where, what = "", problem
        t.add_row(escape(where[len(prefix):] if where.startswith(prefix) else where), escape(what))
    con.print(t)
    return 1


def cmd_demo(args) -> int:
    from .demo import run_demo

    return run_demo(out=args.output, backend=args.backend, model_name=args.model, console=_console())


def cmd_devices(args) -> int:
    from rich.table import Table

    from parastream.rewrite.cost import DEVICES, cpu_device

    t = Table(title="device profiles of the roofline cost model (GPUs from datasheets; CPU: this machine's cores and "
                    "vector width at nominal per-core rates, not measured; SMs = cores)")
    for col in ("name", "fp16 TFLOP/s", "fp32 TFLOP/s", "GB/s", "SMs"):
        t.add_column(col)
    for name, d in {**DEVICES, "CPU": cpu_device()}.items():
        t.add_row(name, f"{d.fp16_flops / 1e12:.3g}", f"{d.fp32_flops / 1e12:.3g}", f"{d.bandwidth / 1e9:.0f}", str(d.sms))
    _console().print(t)
    return 0


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("parastream")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def make_parser() -> argparse.ArgumentParser:
    from .build import BuildConfig  # its defaults are the help's (imported with the package anyway)

    p = _Parser(prog="parastream", description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    p.add_argument("--version", action="version", version=f"parastream {_version()}")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="build, verify and run a bundled example model end to end")
    d.add_argument("--model", default=None, help="example model name (default: the demo model)")
    d.add_argument("-o", "--output", default=None, help="bundle folder (default: a temporary folder)")
    d.add_argument("--backend", default="auto", choices=["auto", "tensorrt", "torch", "onnxruntime"])
    d.set_defaults(func=cmd_demo)

    i = sub.add_parser("inspect", help="op histogram, width, branches and critical path of a model (of a bundle: what its build chose)")
    i.add_argument("model")
    add_model_args(i)
    add_schedule_args(i)
    i.add_argument("--picture", default=None, metavar="FILE.svg|png", help="draw the graph, each branch coloured by its stream")
    i.add_argument("--search", action="store_true", help="run the rewrite search and print its trace, without building")
    i.set_defaults(func=cmd_inspect)

    b = sub.add_parser("build", help="rewrite, schedule, build engines, verify and write a bundle")
    b.add_argument("model")
    b.add_argument("-o", "--output", required=True, metavar="OUT")
    add_model_args(b)
    add_schedule_args(b)
    add_backend_args(b)
    add_tolerance_args(b)
    add_batch_arg(b)
    b.add_argument("--no-search", action="store_true", help="skip the rewrite search")
    b.add_argument("--measure-seconds", type=int_in(0, 86_400), default=None, metavar="S",
                   help="GPU builds: seconds for timing the search's candidates on the device, the top-ranked first, "
                        "and the input's alternatives as their engines are compiled, counted from the moment the input "
                        f"is timed (default {BuildConfig.measure_seconds:g}; the input and the best candidate are always timed)")
    b.add_argument("--no-verify", action="store_true", help="skip verification against onnxruntime")
    b.add_argument("--no-host-tail", action="store_true",
                   help="refuse a model whose output shapes depend on the data (a detector's post-processing) instead "
                        "of building its static part and running the rest with onnxruntime after each replay")
    b.add_argument("--force", action="store_true", help="replace an existing OUT")
    b.add_argument("--quiet", action="store_true", help="print nothing but errors")
    b.add_argument("--verbose", action="store_true", help="print the per-branch table, estimates, timings and "
                                                          "per-output verification figures")
    b.add_argument("--json", action="store_true", help="print one JSON summary line on stdout (progress stays on stderr)")
    b.add_argument("--triton-repo", default=None, metavar="REPO", help="also export a Triton model repository")
    b.add_argument("--triton-name", default=None, help="Triton model name (default: the model file's stem)")
    b.add_argument("--triton-mode", default="graph", choices=["graph", "ensemble"])
    b.set_defaults(func=cmd_build)

    r = sub.add_parser("run", help="run a bundle on inputs from .npy files")
    r.add_argument("bundle")
    r.add_argument("--input", action="append", metavar="NAME=file.npy")
    r.add_argument("--output-dir", required=True)
    r.add_argument("--device", default="auto", type=device_option, metavar="DEVICE", help=DEVICE_HELP)
    r.add_argument("--force", action="store_true")
    r.set_defaults(func=cmd_run)

    v = sub.add_parser("verify", help="compare a bundle with onnxruntime on the original model (exit 1 on mismatch)")
    v.add_argument("bundle")
    v.add_argument("--model", default=None, help="the original model (default: the path recorded at build)")
    v.add_argument("--iterations", type=int_in(1, 10_000), default=3)
    v.add_argument("--json", action="store_true", help="print the result as one JSON object")
    v.add_argument("--device", default="auto", type=device_option, metavar="DEVICE", help=DEVICE_HELP)
    v.add_argument("--localize", action="store_true",
                   help="also say where the bundle parts from the original: which rewrite, branch, node and precision")
    add_tolerance_args(v)
    v.set_defaults(func=cmd_verify)

    be = sub.add_parser("bench", help="latency of a bundle: GPU, against the same engines on one stream; "
                                      "CPU, against plain onnxruntime on the same model")
    be.add_argument("bundle")
    be.add_argument("--runs", type=int_in(1, 10_000_000), default=None, help="timed runs of each variant (default: 200 GPU, 50 CPU)")
    be.add_argument("--warmup", type=int_in(0, 10_000_000), default=None, help="untimed runs first (default: 20 GPU, 5 CPU)")
    be.add_argument("--json", action="store_true", help="print the result as one JSON object")
    be.add_argument("--device", default="auto", type=device_option, metavar="DEVICE",
                    help="the GPU a GPU bundle is timed on: auto or cuda (GPU 0), cuda:N (GPU N); a CPU bundle: auto or cpu")
    be.add_argument("--model", default=None, help="CPU bundles: the original model, the baseline (default: the path "
                                                  "recorded at build)")
    be.add_argument("--timeline", default=None, metavar="FILE.png")
    be.add_argument("--no-whole-model", dest="whole_model", action="store_false",
                    help="TensorRT bundles: skip the whole-model engine baseline (max_aux_streams)")
    be.add_argument("--concat-ablation", action="store_true",
                    help="also time the bundle with every Concat as its own engine (the launcher does them in place)")
    be.set_defaults(func=cmd_bench)

    t = sub.add_parser("export-triton", help="export a bundle as a Triton model repository")
    t.add_argument("bundle")
    t.add_argument("repo")
    t.add_argument("--name", required=True)
    t.add_argument("--mode", default="graph", choices=["graph", "ensemble"])
    t.add_argument("--max-batch", type=int_in(0, 1 << 31), default=0)
    t.add_argument("--instances", type=int_in(1, 4096), default=1,
                   help="instances of the model on each GPU it is placed on (Triton's instance_group count)")
    t.add_argument("--gpus", type=gpu_list, default=None, metavar="0,1",
                   help="the GPUs the instances go on (instance_group gpus); default: every GPU of the server")
    t.add_argument("--force", action="store_true")
    t.set_defaults(func=cmd_export_triton)

    vt = sub.add_parser("validate-triton", help="check a Triton model repository (exit 1 when it has problems)")
    vt.add_argument("repo")
    vt.set_defaults(func=cmd_validate_triton)

    dv = sub.add_parser("devices", help="list the device profiles of the cost model")
    dv.set_defaults(func=cmd_devices)
    return p


@contextmanager
def _quiet_libraries(quiet: bool):
    """Without --debug the error line is all a failed command prints: no onnxruntime log lines, no Python
    warnings from numpy or polygraphy (each would land in a build log above the error)."""
    import warnings

    if not quiet:
        yield
        return
    try:
        from parastream.launcher.engines.onnxruntime import quiet_logs

        quiet_logs()
    except ImportError:
        pass
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@contextmanager
def _library_output(show: bool):
    """stdout holds the command's own output alone (one JSON line with --json, nothing with --quiet): the libraries'
    log lines go to stderr, and only with --debug or --verbose (``show``).

    onnx-graphsurgeon's and polygraphy's loggers print() to sys.stdout and have no option for another stream
    ("[W] colored module is not installed", "[W] It looks like this model contains foldable nodes ..."), so the
    command runs with sys.stdout redirected to stderr (contextlib.redirect_stdout: whatever a library prints lands
    there) and writes its own output to the stream saved before (``_stdout``); without ``show`` their severity is
    ERROR (their own G_LOGGER controls), so that their warnings are not printed at all."""
    import contextlib

    with contextlib.ExitStack() as stack:
        if not show:
            from onnx_graphsurgeon.logger import G_LOGGER as gs_logger
            from polygraphy.logger import G_LOGGER as pg_logger

            stack.enter_context(gs_logger.suppress(gs_logger.ERROR))
            stack.enter_context(pg_logger.verbosity(pg_logger.ERROR))
        stack.enter_context(contextlib.redirect_stdout(sys.stderr))
        yield


def _interrupt_in(e: BaseException):
    """The interrupt behind ``e``: ``e`` itself, or the one whose unwinding raised ``e`` (a cleanup that failed)."""
    from .interrupts import Interrupted

    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, KeyboardInterrupt):  # a plain one: an API caller's own Ctrl-C handling, or outside the main thread
            return e if isinstance(e, Interrupted) else Interrupted(signal.SIGINT)
        seen.add(id(e))
        e = e.__context__
    return None


def _report_interrupt(interrupt, e: BaseException) -> int:
    """After an interrupt has unwound every ``with`` block: remove what was made outside one (a staging folder or a
    child whose block had not begun when the signal came), and say in one line what is left, if anything."""
    from .isolate import stop_children
    from .outdir import WRITTEN, remove_staging

    stop_children()
    left = [str(p) for p in remove_staging()]
    if e is not interrupt and isinstance(e, OSError) and e.filename:  # a temporary folder's removal failed
        left.append(str(e.filename))
    written = [str(p) for p in WRITTEN if p.exists()]  # a demo's bundle in its temporary folder is gone again
    done = f"{', '.join(written)} was written before it" if written else "nothing was written"
    print(f"parastream: {interrupt.describe()}; {done}" + (f"; could not remove {', '.join(left)}" if left else ""),
          file=sys.stderr, flush=True)
    return interrupt.exit_code


def _exit_status(e: BaseException, args) -> int | None:
    """The exit status of a command that raised ``e``, its one line printed; None: let ``e`` through (--debug, or
    not one of ours)."""
    interrupt = _interrupt_in(e)
    if interrupt is not None:
        return _report_interrupt(interrupt, e)
    if args.debug or not isinstance(e, (ParastreamError, MemoryError, OSError)):
        return None
    if isinstance(e, ParastreamError):
        message, code = str(e), e.exit_code
    elif isinstance(e, MemoryError):
        message, code = "out of memory; give smaller --shapes or use a larger machine", 2
    else:  # the environment: a full disk, a read-only folder, a name too long for the file system
        message, code = f"{f'{e.filename}: ' if e.filename else ''}{e.strerror or e}", 2
    if getattr(args, "json", False) and args.command == "verify":  # a build step parses it: the error as JSON too
        print(json.dumps({"passed": False, "error": message}), file=_stdout())
    print(f"parastream {args.command}: error: {message}", file=sys.stderr)
    return code


def _end_compile_workers() -> None:
    """The program exits next: the torch backend's compile workers, idle by now, are ended here.  Left to the
    interpreter's exit, ``concurrent.futures`` joins each one (before any ``atexit`` handler runs) while it tears
    its own interpreter down, torch and Inductor imported: 1.1 s with 2 workers and 2.5 s with 4 on a 2-core
    machine, 0.2 s ended here (a GPU build runs up to 15).  A pool still compiling is left to finish
    (``stop_workers``).  Only where the command imported that backend: nothing is imported for it here."""
    backend = sys.modules.get("parastream.launcher.engines.torch")
    if backend is not None:
        backend.stop_workers()


def main(argv: list[str] | None = None) -> int:
    """The command line; ``argv`` None: this process's arguments (the ``parastream`` program)."""
    from . import interrupts, outdir

    global _STDOUT

    parser = make_parser()
    args = parser.parse_args(argv)
    outdir.WRITTEN.clear()
    _STDOUT = sys.stdout
    try:
        # SIGINT, SIGTERM, SIGHUP raise an exception in the main thread: every `with` block unwinds (interrupts.py)
        with interrupts.signals_raise(then_ignore=argv is None), _quiet_libraries(not args.debug), \
                _library_output(args.debug or getattr(args, "verbose", False)):
            code = int(args.func(args) or 0)
    except BaseException as e:  # noqa: BLE001 - each kind gets its exit status and line in _exit_status
        code = _exit_status(e, args)
        if code is None:
            raise
    finally:
        _STDOUT = None
    if argv is None and code > 128:  # the program, interrupted: a worker thread still finishing does not hold it
        interrupts.exit_when_threads_linger(code)
    if argv is None:
        _end_compile_workers()
        # the program exits next: what the command left (a model's graphs, weights, sessions) is not walked once
        # more by the collector at interpreter shutdown, only for the process's memory to be given back (0.1 s of
        # a small model's build).  Open files are closed and temporary folders removed by then: every `with`
        # block has unwound, and weakref finalizers still run at exit.
        gc.freeze()
    return code


if __name__ == "__main__":
    sys.exit(main())
