"""Dynamic-batch builds (``--batch MIN:OPT:MAX`` with MIN < MAX): the build's stages once per batch bucket.

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

from parastream.launcher.bundle import Bundle, write_manifest
from parastream.launcher.errors import VerificationError
from parastream.launcher.plan import TensorSpec

from .model_io import batch_buckets, batch_profiles, original_at_batch, shapes_at_batch
from .verify import resolve_tolerances, run_verification

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
