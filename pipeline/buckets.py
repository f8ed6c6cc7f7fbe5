"""Dynamic-batch builds (``--batch MIN:OPT:MAX`` with MIN < MAX): the build's stages once per batch bucket;
and dynamic shapes on any named axis (``--min-shapes/--opt-shapes/--max-shapes``, ``build_grid``): the same per
bucket of a grid over the axes, after the padding check proves on ONNX Runtime that padding each axis to its
bucket leaves the real positions' outputs unchanged (docs/dynamic-shapes.md).

Why one static sub-bundle per bucket rather than one plan with a dynamic first dimension: a CUDA Graph
replays fixed shapes and fixed addresses, so a graph per bucket is what serving systems that replay
graphs do (vLLM, TensorRT-LLM); the front end folds shapes per batch (a Reshape constant with the batch
baked in is right for its bucket only); the stream choice may differ per bucket (a batch-32 graph fills
the GPU with fewer streams); and every backend builds a static engine exactly (TensorRT: an engine per
branch per bucket has no dynamic input, and for such a network TensorRT generates the default optimization
profile itself (IOptimizationProfile's documentation: "possible but not required"); torch: one static
Inductor compile per bucket; ONNX Runtime: a session per bucket).  The cost is weights held once
per bucket (engines are per bucket); boundary tensors share one arena (launcher/buckets.py).

Each bucket runs its own rewrite search within the search's work bound (rewrites are matched on shapes,
so a site found at OPT is not proven sound at another batch); on a GPU only the bucket that serves OPT
measures the search's candidates on the device, the others decide by the cost model.  report.json's
``buckets.per_bucket[N].timings`` says what each bucket cost.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx

from parastream.launcher.bundle import Bundle, write_manifest
from parastream.launcher.errors import ParastreamError, VerificationError
from parastream.launcher.plan import TensorSpec

from parastream.launcher.buckets import axis_between, grid_between

from .model_io import batch_buckets, batch_profiles, original_at_batch, shapes_at_batch
from .verify import resolve_tolerances, run_verification, running_errors

BUCKETS_DIR = "buckets"


def bucket_folder(size: int, max_size: int) -> str:
    """Where bucket ``size`` lives in the bundle: MAX is the bundle's own files, the others ``buckets/b<N>``."""
    return "." if size == max_size else f"{BUCKETS_DIR}/b{size}"


def between_buckets(sizes: list[int]) -> int | None:
    """A batch that is not a bucket (the one past the smallest bucket with a gap after it), to verify padding."""
    for a, b in zip(sizes, sizes[1:]):
        if b - a > 1:
            return a + 1
    return None


def batched_outputs(bundles: dict[int, Bundle]) -> list[str]:
    """Outputs whose first dimension is the bucket's batch in every bucket (their rows follow the input's)."""
    names = [t.name for t in bundles[max(bundles)].plan.outputs]
    return [name for name in names
            if all(next(t for t in bd.plan.outputs if t.name == name).shape[:1] == [size] for size, bd in bundles.items())]


def buffer_bytes(bundle: Bundle) -> int:
    """Bytes of the boundary tensors a launcher of ``bundle`` holds (what a GPU launcher's arena is sized by)."""
    from parastream.launcher.cuda import nbytes_of

    return sum(nbytes_of(t.shape, t.dtype) for t in bundle.plan.tensors.values())


def bucket_summary(bundle: Bundle) -> dict:
    """One bucket's row of report.json: its streams, branches, engines, verification and what it cost."""
    rep = bundle.report
    sched = rep.get("schedule", {})
    engine_bytes = sum(bundle.engine_path(b).stat().st_size for b in bundle.plan.branches)
    ver = rep.get("verification") or {}
    return {"streams": sched.get("streams"), "branches": len(bundle.plan.branches), "engine_bytes": engine_bytes,
            "engines": [b.engine for b in bundle.plan.branches], "buffer_bytes": buffer_bytes(bundle),
            "rules_chosen": (rep.get("search") or {}).get("rules_chosen"), "verified": ver.get("passed"),
            "timings": rep.get("timings", {})}


def build_buckets(model_path, tmp: Path, cfg, backend, bar, build_static) -> Bundle:
    """Build every bucket of ``cfg.batch`` into ``tmp`` (``build_static``, the build's stages for static shapes,
    per bucket, MAX last at the top level), then the bucket record, the between-buckets verification and the
    memory figures; return the bundle opened.  The static build is given by the build that calls this one, which
    sits above it."""
    lo, opt, hi = cfg.batch
    batched_inputs = list(batch_profiles(model_path, dict(cfg.shapes), tuple(cfg.batch))[1])  # checks --shapes
    sizes = batch_buckets(tuple(cfg.batch), cfg.batch_buckets)
    measured = next(b for b in sizes if b >= opt)  # the bucket that serves OPT measures the search on a GPU
    t0 = time.perf_counter()
    stage_seconds: dict[str, float] = {}
    for size in sizes[:-1] + [hi]:  # MAX last: its manifest hashes the other buckets' files too
        dest = tmp / bucket_folder(size, hi)
        bar.step(f"bucket {size} of {sizes}").advance()
        bcfg = replace(cfg, batch=None, batch_buckets=None, shapes=shapes_at_batch(model_path, cfg.shapes, size))
        got = build_static(model_path, bcfg, backend, bar, bcfg.shapes, lambda d=dest: _folder(d),
                           measure_search=size == measured, final=size != hi)
        for stage, seconds in got.report["stage_seconds"].items():
            stage_seconds[stage] = round(stage_seconds.get(stage, 0.0) + seconds, 3)
    top = got  # MAX's build, verified: its report and manifest are written once, below, with the buckets'
    record = {"min": lo, "opt": opt, "max": hi, "sizes": sizes,
              "folders": {str(s): bucket_folder(s, hi) for s in sizes}, "inputs": batched_inputs}
    manifest = {k: v for k, v in top.manifest.items() if k not in ("files", "version")}
    manifest["buckets"] = dict(record, outputs=[])
    write_manifest(tmp, manifest, hashed=False)  # the buckets' folders, for the bundle opened below (unchecked)
    opened = Bundle.open(tmp, check_hashes=False)
    opened.report = top.report  # what the staging report.json does not hold yet (verification, totals)
    bundles = opened.bucket_bundles()
    manifest["buckets"]["outputs"] = batched_outputs(bundles)
    report = top.report
    report["buckets"] = {**record, "per_bucket": {str(s): bucket_summary(bd) for s, bd in bundles.items()},
                         "memory": memory_figures(bundles),
                         "search": "per bucket (work-bounded); measured on the GPU only at the bucket serving OPT "
                                   f"({measured})" if cfg.search else "off"}
    if cfg.verify:
        write_manifest(tmp, manifest, hashed=False)  # the batched outputs, which the between-buckets load reads
        t1 = time.perf_counter()
        report["buckets"]["between"] = verify_between(model_path, tmp, cfg, sizes, batched_inputs, bar)
        stage_seconds["verify_between"] = round(time.perf_counter() - t1, 3)
    report["buckets"].update(build_s=time.perf_counter() - t0, stage_seconds=stage_seconds)
    (tmp / "report.json").write_text(json.dumps(report, indent=2, default=str))
    write_manifest(tmp, manifest)  # hashed once, every bucket's files with the top level's
    return Bundle.open(tmp)


class _folder:
    """A bucket's folder inside the staging folder (the staging folder is what is removed on an error)."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self) -> Path:
        self.path.mkdir(parents=True, exist_ok=True)
        return self.path

    def __exit__(self, *exc):
        return False


def memory_figures(bundles: dict[int, Bundle]) -> dict:
    """Buffer bytes of the bucketed bundle (one arena shared by the buckets, sized for the largest) against one
    graph at MAX, and the engines' bytes on disk (weights are held once per bucket)."""
    per = {s: buffer_bytes(bd) for s, bd in bundles.items()}
    engines = {s: sum(bd.engine_path(b).stat().st_size for b in bd.plan.branches) for s, bd in bundles.items()}
    top = max(bundles)
    return {"shared_buffer_bytes": max(per.values()), "buffer_bytes_at_max": per[top],
            "buffer_bytes_if_not_shared": sum(per.values()), "engine_bytes": sum(engines.values()),
            "engine_bytes_at_max": engines[top],
            "note": "buffers: boundary tensors (the GPU arena); device memory measured by bench/batch_buckets.py"}


def verify_between(model_path, tmp: Path, cfg, sizes: list[int], batched_inputs: list[str], bar) -> dict | None:
    """Verify the bundle as served at a batch between buckets (padded to the next bucket, rows cut back) against
    ONNX Runtime on the original model at that batch.  None when every batch in range is a bucket."""
    from parastream.launcher import load

    n = between_buckets(sizes)
    if n is None:
        return None
    bar.step(f"verify at batch {n}, between buckets").advance()
    rtol, atol, scale_tol = resolve_tolerances(cfg.precision, cfg.rtol, cfg.atol, cfg.scale_tol)
    runner = load(tmp, check_hashes=False)
    try:
        result = verify_at_batches(model_path, runner, [n], rtol=rtol, atol=atol, scale_tol=scale_tol, seed=cfg.seed + 1)[n]
    finally:
        runner.close()
    if not result.passed:
        raise VerificationError(f"{model_path}: the bundle served at batch {n} (bucket {runner.bucket_for(n)}) does not "
                                f"match onnxruntime on the original model ({result.failure()}); no bundle was written")
    return dict(result.to_dict(), batch=n)


def verify_at_batches(model_path, runner, batches: list[int], *, rtol: float, atol: float, scale_tol: float | None,
                      seed: int, iterations: int = 2) -> dict:
    """``runner`` (a BucketedLauncher) at each batch n of ``batches`` against ONNX Runtime on the original model
    with its batched inputs fixed at n: batch -> Verification."""
    out = {}
    for n in batches:
        specs = [TensorSpec(t.name, t.dtype, [n, *t.shape[1:]] if t.name in runner.batched_inputs else list(t.shape))
                 for t in runner.input_specs]
        original = original_at_batch(model_path, {t.name: t.shape for t in specs})
        out[n] = run_verification(model_path, original, runner, specs, rtol=rtol, atol=atol, scale_tol=scale_tol,
                                  seed=seed, iterations=iterations)
    return out


def verification_batches(sizes: list[int]) -> list[int]:
    """What ``parastream verify`` checks on a dynamic-batch bundle: every bucket, and a batch between buckets."""
    n = between_buckets(sizes)
    return sorted(set(sizes) | ({n} if n else set()))


# -- a grid over named axes (--min-shapes/--opt-shapes/--max-shapes) -------------------------------------------------

def grid_points(axes) -> list[tuple[int, ...]]:
    """Every bucket of the grid: one size per axis, every combination (a dim_param shared by several inputs is
    one axis), in ascending order."""
    import itertools

    return sorted(itertools.product(*[a.sizes for a in axes]))


def grid_folder(key: tuple[int, ...], top: tuple[int, ...]) -> str:
    """Where grid bucket ``key`` lives: every axis at MAX is the bundle's own files, the others ``buckets/b<1x16>``."""
    from parastream.launcher.buckets import key_text

    return "." if key == top else f"{BUCKETS_DIR}/b{key_text(key)}"


def check_ranges(cfg) -> None:
    """--min/--opt/--max-shapes name the same inputs (an input in --opt-shapes alone is its OPT, min = max = opt
    where --min-shapes or --max-shapes leave it out would be a static shape: refused as confusing)."""
    named = {"--min-shapes": set(cfg.min_shapes), "--max-shapes": set(cfg.max_shapes)}
    if cfg.opt_shapes:
        named["--opt-shapes"] = set(cfg.opt_shapes)
    every = set().union(*named.values())
    for option, names in named.items():
        missing = sorted(every - names)
        if missing:
            raise ParastreamError(f"{option} does not give input {missing[0]!r}, which another of --min-shapes/"
                                  "--opt-shapes/--max-shapes does; give each ranged input in all of them")


def profile_ranges(cfg) -> dict[str, tuple[list[int], list[int], list[int]]]:
    """input -> (min, opt, max) dimensions from the build's --min/--opt/--max-shapes (OPT: min where not given)."""
    check_ranges(cfg)
    return {name: (list(lo), list((cfg.opt_shapes or {}).get(name, lo)), list(cfg.max_shapes[name]))
            for name, lo in cfg.min_shapes.items()}


def _feeds_at(model: onnx.ModelProto, shapes: dict[str, list[int]], axes, seed: int) -> dict:
    """Seeded inputs at ``shapes`` as verification draws them (polygraphy's DataLoader over the ranges
    padding_input_ranges gives), for the padding check."""
    from onnx import helper
    from polygraphy.comparator import DataLoader
    from polygraphy.common import TensorMetadata

    vis = {vi.name: vi for vi in model.graph.input}
    specs = [TensorSpec(n, np.dtype(helper.tensor_dtype_to_np_dtype(vis[n].type.tensor_type.elem_type)).name, s)
             for n, s in shapes.items()]
    meta = TensorMetadata()
    for s in specs:
        meta.add(s.name, np.dtype(s.dtype), tuple(s.shape))
    loader = DataLoader(seed=seed, iterations=1, input_metadata=meta, val_range=padding_input_ranges(model, specs, axes))
    return dict(next(iter(loader)))


def padding_input_ranges(model: onnx.ModelProto, specs, axes) -> dict[str, tuple]:
    """The ranges verification draws inputs from (input_value_ranges), with two changes where an axis is padded:
    a mask input is all ones (a row masked everywhere is no request, and softmax over it averages the padding
    too), and position ids stay low enough that counting on through the padding stays inside their table."""
    from .verify import input_value_ranges, is_padding_mask

    ranges = dict(input_value_ranges(model, specs))
    dtypes = {s.name: s.dtype for s in specs}
    for a in axes:
        if a.exact or a.batch_like:
            continue
        for name in a.inputs:
            if name not in ranges:
                continue
            if is_padding_mask(name, dtypes[name]) and a.pad.get(name) == 0:
                ranges[name] = (1, 1) if not isinstance(ranges[name][0], bool) else (True, True)
            elif a.pad.get(name) == "continue":
                lo, hi = ranges[name]
                ranges[name] = (lo, max(lo, hi - a.max))
    return ranges


def check_padding(model_path, fixed: dict[str, list[int]], axes, seed: int) -> None:
    """Prove each axis's padding harmless on the original model before anything is built: ONNX Runtime at a size
    between buckets n, padded to its bucket b, gives the outputs of the unpadded run at the real positions (the
    scaled error within fp32's bound).  The same two runs find the output dimensions that carry the axis (those
    that are b padded and n not) and set ``axis.outputs``.  An axis that fails: with --buckets given for it,
    built exactly at those sizes (``axis.exact``); else refused in one line suggesting exact sizes."""
    import onnxruntime as ort

    from parastream.core.accuracy import scale_tolerance, scaled_error
    from parastream.launcher.buckets import cut_axis, pad_axis

    from .model_io import shapes_at_point

    model = onnx.load(str(model_path), load_external_data=False)
    sess = None
    refused = []
    for k, a in enumerate(axes):
        gap = axis_between(a.sizes, a.min)
        n, b = (gap, next(s for s in a.sizes if s >= gap)) if gap else (a.sizes[0], a.sizes[1])
        base = [x.sizes[0] for x in axes]
        at_n, at_b = list(base), list(base)
        at_n[k], at_b[k] = n, b
        shapes_n = shapes_at_point(model_path, fixed, axes, tuple(at_n))
        feeds = _feeds_at(model, shapes_n, axes, seed)
        padded = dict(feeds)
        for name, dim in a.inputs.items():
            if name in padded:
                padded[name] = pad_axis(padded[name], dim, b, a.pad[name])
        if sess is None:
            sess = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
        names = [o.name for o in sess.get_outputs()]
        with running_errors(model_path, model, f"to check the padding of axis {a.name!r}"):
            real = dict(zip(names, sess.run(None, feeds)))
            got = dict(zip(names, sess.run(None, padded)))
        outputs: dict[str, list[int]] = {}
        failure = None
        for name in names:
            rs, gs = real[name].shape, got[name].shape
            dims = [i for i, (p, q) in enumerate(zip(rs, gs)) if p != q]
            if len(rs) != len(gs) or any(rs[i] != n or gs[i] != b for i in dims):
                failure = failure or (f"output {name!r} has shape {list(gs)} padded and {list(rs)} unpadded, which no "
                                      f"cut along {a.name!r} maps back")
                continue
            outputs[name] = dims
            cut = got[name]
            for i in dims:
                cut = cut_axis(cut, i, n)
            err = scaled_error(cut, real[name])
            if err > scale_tolerance("fp32"):
                failure = failure or f"output {name!r} differs at the real positions (scaled error {err:.3g})"
        a.outputs = outputs
        if failure is None or not gap:
            continue
        if a.buckets_given:
            a.exact = True  # --buckets listed the sizes: each built exactly, a request takes one of them
            continue
        refused.append((a, n, b, failure))
    if refused:
        a, n, b, failure = refused[0]
        others = "".join(f"; {_axis_named(x)} neither" for x, *_ in refused[1:])
        exact = " ".join(f"--buckets {x.option()}={','.join(map(str, x.sizes))}" for x, *_ in refused)
        raise ParastreamError(f"{model_path}: {_axis_named(a)} cannot be padded: padded from {n} to {b}, {failure}, so "
                              "the model does not ignore padded positions there (an image side, a model without a mask)"
                              f"{others}; build exact sizes instead with {exact}")


def _axis_named(a) -> str:
    """``axis 'seq' (input_ids:1)``, or ``axis 'x:1'`` for an unnamed dimension."""
    return f"axis {a.name!r}" + (f" ({a.option()})" if a.name != a.option() else "")


def build_grid(model_path, tmp: Path, cfg, backend, bar, build_static) -> Bundle:
    """Build every bucket of the grid the build's --min/--opt/--max-shapes (and --batch) describe into ``tmp``
    (``build_static`` per bucket, every axis at MAX last at the top level), after the padding check; then the
    record, the verification between buckets and the memory figures; return the bundle opened."""
    from parastream.launcher.buckets import key_text

    from .model_io import shape_axes, shapes_at_point

    axes, fixed = shape_axes(model_path, dict(cfg.shapes), profile_ranges(cfg), batch=cfg.batch,
                             batch_sizes=cfg.batch_buckets, buckets=cfg.shape_buckets, pads=cfg.pads)
    bar.step(f"check padding on {', '.join(a.name for a in axes)}").advance()
    check_padding(model_path, fixed, axes, cfg.seed)
    points = grid_points(axes)
    top = tuple(a.max for a in axes)
    measured = tuple(next(s for s in a.sizes if s >= a.opt) for a in axes)
    t0 = time.perf_counter()
    stage_seconds: dict[str, float] = {}
    for key in [p for p in points if p != top] + [top]:
        dest = tmp / grid_folder(key, top)
        bar.step(f"bucket {key_text(key)} of {len(points)}").advance()
        shapes = shapes_at_point(model_path, fixed, axes, key)
        bcfg = replace(cfg, batch=None, batch_buckets=None, min_shapes={}, opt_shapes={}, max_shapes={},
                       shape_buckets={}, pads={}, shapes=shapes)
        got = build_static(model_path, bcfg, backend, bar, shapes, lambda d=dest: _folder(d),
                           measure_search=key == measured, final=key != top)
        for stage, seconds in got.report["stage_seconds"].items():
            stage_seconds[stage] = round(stage_seconds.get(stage, 0.0) + seconds, 3)
    top_build = got
    record = {"axes": [a.to_dict() for a in axes], "grid": {key_text(p): grid_folder(p, top) for p in points},
              "fixed": fixed}
    manifest = {k: v for k, v in top_build.manifest.items() if k not in ("files", "version")}
    manifest["buckets"] = record
    write_manifest(tmp, manifest, hashed=False)
    opened = Bundle.open(tmp, check_hashes=False)
    opened.report = top_build.report
    bundles = opened.bucket_bundles()
    check_output_axes(model_path, axes, bundles)
    report = top_build.report
    report["buckets"] = {**record, "sizes": [key_text(p) for p in points],
                         "per_bucket": {key_text(k): bucket_summary(bd) for k, bd in bundles.items()},
                         "memory": memory_figures(bundles),
                         "search": "per bucket (work-bounded); measured on the GPU only at the bucket serving OPT "
                                   f"({key_text(measured)})" if cfg.search else "off"}
    if cfg.verify:
        t1 = time.perf_counter()
        report["buckets"]["between"] = verify_grid_between(model_path, tmp, cfg, bar)
        stage_seconds["verify_between"] = round(time.perf_counter() - t1, 3)
    report["buckets"].update(build_s=time.perf_counter() - t0, stage_seconds=stage_seconds)
    (tmp / "report.json").write_text(json.dumps(report, indent=2, default=str))
    write_manifest(tmp, manifest)
    return Bundle.open(tmp)


def check_output_axes(model_path, axes, bundles: dict) -> None:
    """The built buckets agree with the padding check on which output dimensions carry each axis: in every
    bucket those dimensions are that axis's size (the plans' static shapes)."""
    for k, a in enumerate(axes):
        if a.exact:
            continue
        for key, bd in bundles.items():
            shapes = {t.name: t.shape for t in bd.plan.outputs}
            for name, dims in (a.outputs or {}).items():
                if name in shapes and any(shapes[name][d] != key[k] for d in dims):
                    raise ParastreamError(f"{model_path}: output {name!r} has shape {shapes[name]} in the bucket "
                                          f"{key}, but the padding check found axis {a.name!r} in its dimensions {dims}; "
                                          "no bundle was written")


def verification_points(runner) -> list[tuple[int, ...]]:
    """What ``parastream verify`` checks on a grid bundle: every bucket, and a point between buckets."""
    between = grid_between(runner)
    return sorted(set(runner.sizes) | ({between} if between else set()))


def verify_at_points(model_path, runner, points, *, rtol: float, atol: float, scale_tol: float | None, seed: int,
                     iterations: int = 2) -> dict:
    """``runner`` (a grid BucketedLauncher) at each point against ONNX Runtime on the original model with its
    inputs at that point, unpadded: point -> Verification."""
    from parastream.launcher.plan import TensorSpec as Spec

    from .model_io import ShapeAxis, shapes_at_point
    from .verify import verify

    record = runner.bundle.manifest["buckets"]
    axes = [ShapeAxis(a["name"], a["inputs"], a["min"], a["opt"], a["max"], a["sizes"], a["pad"], a.get("pad_source", {}),
                      exact=a.get("exact", False), outputs=a.get("outputs")) for a in record["axes"]]
    out = {}
    for point in points:
        shapes = shapes_at_point(model_path, record.get("fixed", {}), axes, tuple(point))
        specs = [Spec(t.name, t.dtype, shapes.get(t.name, list(t.shape))) for t in runner.input_specs]
        original = original_at_batch(model_path, {t.name: t.shape for t in specs})
        ranges = padding_input_ranges(original, specs, axes)
        with running_errors(model_path, original, "for verification"):
            out[tuple(point)] = verify(original, runner, specs, rtol=rtol, atol=atol, scale_tol=scale_tol, seed=seed,
                                       iterations=iterations, input_ranges=ranges)
    return out


def verify_grid_between(model_path, tmp: Path, cfg, bar) -> dict | None:
    """Verify a grid bundle as served at a point between buckets (padded, cut back) against ONNX Runtime on the
    original model at that point, unpadded.  None when every axis's every size is a bucket."""
    from parastream.launcher import load
    from parastream.launcher.buckets import key_text

    rtol, atol, scale_tol = resolve_tolerances(cfg.precision, cfg.rtol, cfg.atol, cfg.scale_tol)
    runner = load(tmp, check_hashes=False)
    try:
        point = grid_between(runner)
        if point is None:
            return None
        bar.step(f"verify at {key_text(point)}, between buckets").advance()
        result = verify_at_points(model_path, runner, [point], rtol=rtol, atol=atol, scale_tol=scale_tol,
                                  seed=cfg.seed + 1)[point]
        bucket = runner.bucket_for(point)
    finally:
        runner.close()
    if not result.passed:
        raise VerificationError(f"{model_path}: the bundle served at {key_text(point)} (bucket {key_text(bucket)}, padded) "
                                f"does not match onnxruntime on the original model unpadded ({result.failure()}); "
                                "no bundle was written")
    return dict(result.to_dict(), point=list(point), bucket=list(bucket))
