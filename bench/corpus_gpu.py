#!/usr/bin/env python3
"""The public-model corpus on the GPU: parastream against torch.compile and its own engines on one
stream, many models in one device call.  Run on the device machine from the repository root after
``source bench/device_env.sh``:

    python3 bench/corpus_gpu.py --models inception_v3,googlenet,... --workers 4 --seconds 540 --out $OUT

Per model and batch size of ``--batches`` (default 1) (bench/gpu.py's models: bert, or a torchvision/timm
classifier of bench/corpus.py; random weights, BatchNorm calibrated, TorchScript export at opset 17 at that batch,
static shapes, fp16) it times, side by side in one process, in alternating blocks of CUDA-event timed calls on fresh
random inputs (pipeline.bench.measure, medians):

  parastream   the bundle ``parastream build --backend torch --precision fp16`` made: the rewrite search with its
               top candidates measured on the GPU, the stream count and the one-engine alternative timed by the build
  one stream   the same loaded engines on one stream (one CUDA Graph)
  compile      ``torch.compile(mode="reduce-overhead")`` on the PyTorch model as its users run it (BERT with
               transformers' default attention, ``sdpa``: gpu.users_model) in fp16 (its forward casts the fp32
               input to fp16, as the bundle's first engine does), at the same batch, static shapes
               (``dynamic=False``: one model at several batches in this process must not turn dynamic)

Each (model, batch) is its own build and its own row: the export, the bundle, the fusions and stream count its
build timed on the device and kept (the ``kept`` column: the search's rewrites and each ``time_alternatives``
round's winner from report.json) and the timing.  ``--search-batches`` names the batches whose build runs the
measured rewrite search; the others' builds rank the search's candidates by the cost model and measure only the
input and its best candidate, which saves each of them the measured search's seconds (their fusions and streams
are still timed).  An error at one batch (a CUDA out-of-memory at batch 32, a failed verification) is that row's
error; the other rows go on.

Builds are slow and mostly CPU (export, search, Inductor compiles), so they run as ``--workers`` processes side
by side; each build's own GPU measurements take turns through parastream's GPU timing lock.  The timing of the
table is done here, one model at a time, as soon as its build is done: this process takes the timing lock and
stops (SIGSTOP) the builds still running while it measures, so that nothing else runs on the machine during a
timed block, and resumes them (SIGCONT) after.  Each build also compiles the torch.compile baseline once, so that
Inductor's cache is warm when this process compiles it again.

Each build starts with empty Inductor and Triton caches of its own (``build_caches``: a build machine that never
compiled the model), so that builds side by side, or on a machine an earlier call left warm, share no kernels.
Per model it also records the build's seconds per stage (report.json's ``stage_seconds``: load, search,
engines, measure_alternatives, verify, ...) and ``--fresh-loads`` fresh-process loads of the bundle
(bench/load_breakdown.py's loader: a new Python process with empty Inductor and Triton caches timing
``import torch`` + ``parastream.launcher.load(bundle)``, the builds still running stopped meanwhile; the median
and each, with the median's stages).  ``--rebuild``: each model is built with a --cache-dir and, once timed,
built again in a fresh process with that cache warm (``rebuild``: seconds, stages, compile jobs, what it took
from the recorded timings); ``--changed-weight`` rebuilds a copy of the model with one weight changed instead (its
largest floating-point initializer scaled by 1.01: the same code, other values).  ``--table FILE
...`` prints the table of corpus_gpu.json files written before, one table of all their rows (no GPU needed; files
without batches are batch 1; a later file's row of the same model and batch replaces an earlier one's unless it is
an error).  ``--costs`` times no torch.compile baseline (the bundle against its own engines on one stream): the
build, load and rebuild costs of many models in one call.

Writes corpus_gpu.json (one row per model and batch) and corpus_gpu.md under --out.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


class HalfInput:
    """``forward(x)`` = ``model(x.half())`` (float inputs only): the bundle takes the ONNX model's fp32 input and
    casts it in its first engine; the baseline does the same.  It returns the tensors the export has as outputs
    (``gpu.exported_tensors``: BERT's pooler output too), so that torch.compile computes what the bundle does."""

    def __new__(cls, model):
        import torch
        from gpu import exported_tensors

        class Wrap(torch.nn.Module):
            def __init__(self, m):
                super().__init__()
                self.m = m

            def forward(self, *args):
                return exported_tensors(self.m(*[a.half() if a.is_floating_point() else a for a in args]))

        return Wrap(model)


class Timed:
    """``runner`` as ``pipeline.bench.measure`` should time it: ``held`` (its block of replays queued whole behind
    the stream gate before the GPU starts: the GPU's time per call alone) or as called (each call timed as the host
    issues it: the host's own time per call shows wherever it exceeds the GPU's).  ``measure`` holds the runners
    whose ``captured`` is true; this sets it for one runner and leaves every other attribute to it."""

    def __init__(self, runner, *, held: bool):
        self._runner, self.captured = runner, held

    def __getattr__(self, name):
        return getattr(self._runner, name)


class CompiledRunner:
    """A ``torch.compile`` callable with the launcher interface ``pipeline.bench.measure`` times: static input
    tensors at ``addr``, an ``origin`` stream, ``launch`` and ``synchronize``."""

    def __init__(self, fn, plan):
        import torch

        self.fn, self.plan, self.device = fn, plan, 0
        self.stream = torch.cuda.Stream()
        self.origin = self.stream.cuda_stream
        dt = {"float32": torch.float32, "float16": torch.float16, "int64": torch.int64, "int32": torch.int32,
              "bool": torch.bool}
        self.inputs = [torch.zeros(s.shape, dtype=dt[s.dtype], device="cuda") for s in plan.inputs]
        self.addr = {s.name: t.data_ptr() for s, t in zip(plan.inputs, self.inputs)}
        self.out = None

    def set(self, feeds: dict) -> None:
        import torch

        for s, t in zip(self.plan.inputs, self.inputs):
            t.copy_(torch.from_numpy(np.ascontiguousarray(feeds[s.name])))
        torch.cuda.synchronize()

    def launch(self) -> None:
        import torch

        with torch.cuda.stream(self.stream), torch.no_grad():
            self.out = self.fn(*self.inputs)

    def synchronize(self) -> None:
        self.stream.synchronize()


# -- one build (a child process) -----------------------------------------------------------------------------

def _last_error_line(log: Path) -> str:
    """The last line of a failed child's log that names an error (the table's row says why it failed)."""
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "no log"
    named = [ln for ln in lines if "Error" in ln or "error" in ln]
    return (named or lines or ["empty log"])[-1][:400]


def job_key(model: str, batch: int) -> str:
    """The name of one (model, batch) build's files under --work and --out/logs (letters, digits and ``_`` only:
    the device tool brings back no file whose name has other characters)."""
    return f"{model}_b{batch}"


def searched(batch: int, args) -> bool:
    """Whether the build at ``batch`` runs the measured rewrite search: ``batch`` is one of --search-batches
    (every batch when it is not given)."""
    return args.search_batches is None or batch in args.search_batches


def build_settings(batch: int, args) -> tuple[float, int]:
    """(--measure-seconds, --top-k) of the build at ``batch``: the run's own where it runs the measured search,
    else (0, 1): the search ranks its candidates by the cost model and measures only the input and its best
    candidate (what a GPU build measures whatever its budget), which saves the measured search's seconds; the
    build still times its fusions and streams."""
    return (args.measure_seconds, args.top_k) if searched(batch, args) else (0.0, 1)


def prepare(name: str, batch: int, work: Path, args) -> dict:
    """Export at ``batch``, build the bundle, compute the reference, warm Inductor's cache for the baseline."""
    from gpu import build_bundle, export_with_reference

    stem = job_key(name, batch)
    row: dict = {"model": name, "batch": batch}
    model, inputs, onnx_path, feeds, ref, row["export_s"] = export_with_reference(name, work, batch)
    np.savez(work / f"{stem}.ref.npz", **{f"in.{k}": v for k, v in feeds.items()}, **{f"out.{k}": v for k, v in ref.items()})
    log: dict = {"handmade": False, "top_k": args.top_k}
    row["onnx_path"] = str(onnx_path)
    if args.rebuild:  # the first build starts with its --cache-dir empty too (a warm machine's earlier call filled it)
        import shutil

        shutil.rmtree(_cache_dir(stem, work, args), ignore_errors=True)
    with build_caches(stem, work, empty=True):
        build_bundle(onnx_path, work / f"{stem}_bundle", search=True, streams=None, log=log,
                     measure_seconds=args.measure_seconds, cache_dir=_cache_dir(stem, work, args),
                     optimization_level=args.opt_level)
    row["opt_level"] = args.opt_level
    for key in ("build_s", "schedule", "search", "verification", "timings"):
        row[key] = log.get(key)
    rep = json.loads((work / f"{stem}_bundle" / "report.json").read_text())
    row["measured_choices"] = rep.get("measured_choices")
    row["conv_shapes"] = rep.get("conv_shapes")  # the convolution shapes timed alone, and those left unfused
    row["stage_seconds"] = rep.get("stage_seconds")
    # kernels the engines' code runs on their weights alone at every call (inductor_kernels.weight_only_kernels;
    # none expected), by engine, with the weights they read
    engines = {n: e for n, e in (rep.get("engines") or {}).items() if isinstance(e, dict)}
    row["weight_only_kernels"] = {n: e["weight_only_kernels"] for n, e in engines.items() if e.get("weight_only_kernels")}
    row["weight_only_reads"] = {n: e["weight_only_reads"] for n, e in engines.items() if e.get("weight_only_reads")}
    # what the engines stage compiled itself (jobs and seconds) and what compiled in the background meanwhile
    row["precompiled"] = rep.get("precompiled")
    row["background_compiles"] = rep.get("background_compiles")
    # where the measured search's seconds went, per model measured (plan, build, load, timing, fusions off)
    row["measure_log"] = (rep.get("search") or {}).get("measure_log")
    row["nodes"] = [rep["model"]["nodes_in"], rep["model"]["nodes_out"]]
    row["peak_rss_mb"] = rep.get("peak_rss_mb")
    # what a Triton repository ships and every load hashes: the bundle's files, and of them its engines
    files = [f for f in (work / f"{stem}_bundle").rglob("*") if f.is_file()]
    row["bundle_mb"] = round(sum(f.stat().st_size for f in files) / 1e6, 1)
    row["engines_mb"] = round(sum(f.stat().st_size for f in files if "engines" in f.parts) / 1e6, 1)
    if not args.costs:  # the baseline's compile, once, to fill Inductor's cache for the timing process
        t0 = time.perf_counter()
        users_compiled(name, model, inputs)
        row["compile_cold_s"] = time.perf_counter() - t0
    return row


def users_compiled(name: str, model, inputs: dict, warm: int = 3):
    """(``torch.compile(mode="reduce-overhead")`` of the model as its users run it, fp16 on the GPU; ``inputs`` on
    the GPU), after ``warm`` calls (the compile and cudagraph trees' recording)."""
    import torch

    from gpu import users_model

    compiled = torch.compile(HalfInput(users_model(name, model).half().cuda()).eval(), mode="reduce-overhead", dynamic=False)
    dev = [v.cuda() for v in inputs.values()]
    with torch.no_grad():
        for _ in range(warm):
            compiled(*dev)
    torch.cuda.synchronize()
    return compiled, dev


@contextlib.contextmanager
def build_caches(key: str, work: Path, *, empty: bool):
    """Inductor's and Triton's caches of ``key``'s builds (``work/compiler-caches/KEY``; ``empty``: emptied first)
    for what runs inside, the compile workers it starts included (they take the environment when spawned); the
    caches before are back after.  A first build starts cold, as on a build machine that never compiled the
    model: with the machine-wide defaults, two builds of one model side by side (two trees, one call) shared
    their kernels, and a build on a machine kept warm from an earlier call found them compiled.  The rebuild
    takes its build's (the same machine, again)."""
    import shutil

    d = work / "compiler-caches" / key
    if empty:
        shutil.rmtree(d, ignore_errors=True)
    names = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
    before = {n: os.environ.get(n) for n in names}
    os.environ.update({"TORCHINDUCTOR_CACHE_DIR": str(d / "inductor"), "TRITON_CACHE_DIR": str(d / "triton")})
    try:
        yield
    finally:
        for n, v in before.items():
            if v is None:
                os.environ.pop(n, None)
            else:
                os.environ[n] = v


def _cache_dir(key: str, work: Path, args) -> str | None:
    """The build's --cache-dir with ``--rebuild`` (its first build fills it, the rebuild reads it), else None."""
    return str(work / "cache" / key) if args.rebuild else None


def rebuild(name: str, batch: int, work: Path, args) -> dict:
    """The model built again as ``prepare`` built it, in a fresh process, with the --cache-dir its first build filled:
    the build's seconds in all and per stage, its compile jobs (branches no cache held: the search's background
    compiles, the batch before the engines, the engines' own misses) and the engines whose code was reused (a job
    that found the branch's compiled code under another weight: no Inductor compile)."""
    from gpu import build_bundle

    key = job_key(name, batch)
    prep = json.loads((work / f"{key}.prep.json").read_text())
    log: dict = {"handmade": False, "top_k": args.top_k}
    out = work / f"{key}_rebuild"
    src = Path(prep["onnx_path"])
    if args.changed_weight:
        src = with_one_weight_changed(src, work / f"{key}_changed.onnx")
    with build_caches(key, work, empty=False):
        build_bundle(src, out, search=True, streams=None, log=log, measure_seconds=args.measure_seconds,
                     cache_dir=_cache_dir(key, work, args), optimization_level=args.opt_level)
    rep = json.loads((out / "report.json").read_text())
    engines = [e for e in (rep.get("engines") or {}).values() if isinstance(e, dict)]
    jobs = ((rep.get("background_compiles") or {}).get("branches") or 0) + ((rep.get("precompiled") or {}).get("jobs") or 0) \
        + sum(e.get("cache") == "miss" for e in engines)
    return {"build_s": log["build_s"], "stage_seconds": rep.get("stage_seconds"), "engines": len(engines),
            "compile_jobs": jobs, "code_reused": sum(bool(e.get("code_reused")) for e in engines),
            "search_measured": len((log.get("search") or {}).get("measured") or []),
            # what the rebuild took from the first build's recorded timings (pipeline/timings.py)
            "recorded_timings": rep.get("recorded_timings")}


def with_one_weight_changed(src: Path, dst: Path) -> Path:
    """``src`` saved as ``dst`` with its largest floating-point initializer scaled by 1.01 (a fine-tuned model's
    rebuild: the same structure and code, other values)."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(src))
    floats = [t for t in model.graph.initializer if t.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)]
    t = max(floats, key=lambda t: int(np.prod(t.dims)))
    t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t) * np.asarray(1.01, dtype=numpy_helper.to_array(t).dtype), t.name))
    onnx.save(model, str(dst))
    return dst


def error_text(e: BaseException) -> str:
    """``Type: first line of the message`` (a CUDA out-of-memory reads ``OutOfMemoryError: CUDA out of memory. ...``)."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


# -- the timing (this process) -------------------------------------------------------------------------------

@contextlib.contextmanager
def quiet_gpu(children: list[subprocess.Popen]):
    """Hold parastream's GPU timing lock (no build is in the middle of its own measurement) and stop every
    running build while the block runs."""
    from parastream.pipeline.bench import gpu_timing_lock

    stopped = []
    with gpu_timing_lock(0):
        try:
            for p in children:
                if p.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p.pid, signal.SIGSTOP)
                        stopped.append(p)
            time.sleep(0.2)
            yield
        finally:
            for p in stopped:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGCONT)


def time_model(name: str, batch: int, work: Path, row: dict, args, children) -> dict:
    """The bundle of ``name`` at ``batch``, its engines on one stream and torch.compile at the same batch, timed
    side by side into ``row``.  Whatever it loaded is freed when it returns or raises (an out-of-memory at a large
    batch leaves the next rows their GPU memory)."""
    import torch
    from gpu import errors_by_rows, make_model, max_err, users_model

    from parastream.pipeline.bench import _measure
    from parastream.launcher.bundle import Bundle
    from parastream.launcher.gpu import GpuLauncher

    key = job_key(name, batch)
    data = np.load(work / f"{key}.ref.npz")
    feeds = {k[3:]: data[k] for k in data.files if k.startswith("in.")}
    ref = {k[4:]: data[k] for k in data.files if k.startswith("out.")}
    bundle = Bundle.open(work / f"{key}_bundle")
    la = single = None
    try:
        t0 = time.perf_counter()
        la = GpuLauncher(bundle)
        row["load_s"] = time.perf_counter() - t0
        single = GpuLauncher(bundle, single_stream=True, engines=la.engines)
        got = la(feeds)
        row["maxerr"] = {k: max_err(got[k], ref[k]) for k in ref}
        by_rows = {k: e for k in ref if (e := errors_by_rows(got[k], ref[k], feeds)) is not None}
        if by_rows:  # a padded prompt: the tokens' rows apart from the padding's
            row["maxerr_rows"] = by_rows
        row["streams"], row["engines"] = bundle.plan.num_streams, len(bundle.plan.branches)
        if args.costs:  # the bundle against its own engines on one stream; no baseline compiled
            with quiet_gpu(children):
                times = _measure({"parastream": la, "one_stream": single}, runs=args.runs, warmup=50, seed=7)
                _medians(row, times)
                _bound(row, bundle.plan, single)
            return row
        model = users_model(name, make_model(name)[0])  # as its users run it (BERT: transformers' default attention)
        t0 = time.perf_counter()
        # static shapes: this process compiles the same model at each batch, and dynamo would otherwise compile
        # the second batch with a dynamic batch dimension (a build per batch is static too)
        compiled = torch.compile(HalfInput(model.half().cuda()).eval(), mode="reduce-overhead", dynamic=False)
        runner = CompiledRunner(compiled, bundle.plan)
        runner.set(feeds)
        for _ in range(3):
            runner.launch()
        runner.synchronize()
        row["compile_warm_s"] = time.perf_counter() - t0
        first = next(iter(ref))
        outs = runner.out if isinstance(runner.out, tuple) else (runner.out,)  # the export's outputs, in its order
        compiled_out = {k: o.float().cpu().numpy() for k, o in zip(ref, outs)}
        row["maxerr_compile"] = max(max_err(compiled_out[k], ref[k]) for k in compiled_out)
        by_rows = errors_by_rows(compiled_out[first], ref[first], feeds)
        if by_rows is not None:
            row["maxerr_compile_rows"] = by_rows
        info: dict = {}
        with quiet_gpu(children):
            # Both ways, in the same alternating blocks: held (each block queued behind the stream gate: the GPU's
            # work per call) and as called (the host's time per call included where it is the longer: torch.compile's
            # guards and CUDA Graph tree bookkeeping, the launcher's Python and graph launch).  The bundle was timed
            # held and torch.compile as called in the tables before 2026-12-03; on a busy host torch.compile's
            # calls then ran two speeds within one timing (ShuffleNet-v2: 10th percentile 0.323, 90th 0.701 ms)
            times = _measure({"parastream": la, "one_stream": single, "compile_held": Timed(runner, held=True),
                              "parastream_as_called": Timed(la, held=False), "compile": runner},
                             runs=args.runs, warmup=50, seed=7, info=info)
            # a held block the gate's timer had to open (a call that waits on the host inside it) is not a GPU time:
            # the row says so (``opened_by_timer``, ``held_block``: the smaller blocks the rest were timed in)
            row["timing"] = info
            _medians(row, times)
            _bound(row, bundle.plan, single)
        return row
    finally:
        for launcher in (la, single):
            if launcher is not None:
                with contextlib.suppress(Exception):
                    launcher.close()
        # dropped here, not when a traceback that holds this frame goes: the caches are emptied next
        la = single = compiled = runner = model = None
        with contextlib.suppress(Exception):  # never in place of the error that ended the timing
            free_gpu()


def _bound(row: dict, plan, single) -> None:
    """A plan with streams: its critical-path bound (``pipeline.bench.measured_bound``: the longest dependent chain
    of its engines, found from their times alone, run back to back alone) and its time over it."""
    from parastream.pipeline.bench import measured_bound

    cp = measured_bound(plan, single)
    if cp is not None and "error" in cp:
        row["bound_error"] = cp["error"]
    elif cp is not None:
        row["bound_ms"], row["bound_chain"], row["alone_sum_ms"] = cp["bound_ms"], len(cp["chain"]), cp["alone_sum_ms"]
        if "chain_events_ms" in cp:  # the chain's engines timed alone with events around each, summed (the bound
            # of the tables before 2026-12-03)
            row["bound_events_ms"] = cp["chain_events_ms"]
        if "chain_error" in cp:  # the chain could not run alone: the bound is the events' sum
            row["bound_chain_error"] = cp["chain_error"]


def _medians(row: dict, times: dict) -> None:
    """Each timed runner's median and 10th-90th percentiles into ``row`` (``parastream_ms``, ...)."""
    for k, t in times.items():
        row[f"{k}_ms"] = float(np.median(t))
        row[f"{k}_p10_p90"] = [float(np.percentile(t, 10)), float(np.percentile(t, 90))]


def free_gpu() -> None:
    """Forget torch.compile's graphs (and their CUDA Graph pools) and hand cached GPU memory back."""
    import gc

    import torch

    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()


def fresh_loads(bundle: Path, n: int, children) -> dict:
    """``n`` loads of ``bundle``, each in a fresh process with empty Inductor and Triton caches (bench/load_breakdown.py's
    loader), the builds still running stopped meanwhile: the median of ``import torch`` + load (``total_s``), each
    rep's, and the median rep's stages."""
    import statistics
    import tempfile

    import load_breakdown

    reps, errors = [], []
    for _ in range(n):
        with tempfile.TemporaryDirectory(prefix="corpus-gpu-caches-") as d, quiet_gpu(children):
            r = load_breakdown._child(["--child", "load", "--args", str(bundle), "0"], None,
                                      {"TORCHINDUCTOR_CACHE_DIR": f"{d}/inductor", "TRITON_CACHE_DIR": f"{d}/triton"},
                                      timeout=180)
        (errors if "error" in r else reps).append(r)
    if not reps:
        return {"error": errors[0].get("error") if errors else "no load"}
    mid = sorted(reps, key=lambda r: r["total_s"])[(len(reps) - 1) // 2]
    return {"median_s": statistics.median(r["total_s"] for r in reps), "each_s": [round(r["total_s"], 3) for r in reps],
            "median_rep": {k: mid.get(k) for k in ("import_torch_s", "load_s", "open_s", "phases", "cudnn_plans",
                                                   "engines", "cache_files", "replay_ms")},
            **({"errors": [e.get("error") for e in errors]} if errors else {})}


# -- the table (no GPU) --------------------------------------------------------------------------------------

def _stages(r: dict) -> str:
    """The build's stages of at least 0.5 s, as ``stage seconds`` joined (report.json's ``stage_seconds``)."""
    st = r.get("stage_seconds") or {}
    return ", ".join(f"{k} {v:.0f}" for k, v in st.items() if isinstance(v, (int, float)) and v >= 0.5) or "-"


# the winners of the build's timed rounds (pipeline.measure.round_labels), in a word; a label not here is shown as it is
KEPT_WORDS = {"one SDPA kernel per attention": "attention fused",
              "attention as matmul, softmax, matmul": "attention unfused",
              "cuDNN fused conv+bias+ReLU": "conv+ReLU fused",
              "Inductor's conv and epilogue": "conv+ReLU unfused",
              "channels-last boundaries": "NHWC boundaries",
              "contiguous boundaries": "contiguous boundaries",
              "one stream": "one stream",
              "one engine per repeated block": "engine per block",
              "one engine for the whole model": "one engine"}


def kept(r: dict) -> str:
    """What the row's build kept: the search's rewrites (rule ×sites, report.json's ``search.rules_chosen_count``),
    then each round its build timed on the device (``measured_choices.rounds``: the fusion, boundary layout or plan
    that was faster; a fused conv+ReLU names the shapes that ``conv_shapes`` left unfused); "search by cost model" where the build's search measured only the input and its best
    candidate (``--search-batches``)."""
    parts = []
    counts = (r.get("search") or {}).get("rules_chosen_count") or {}
    if counts:
        parts.append("rewrites " + ", ".join(f"{k} ×{v}" for k, v in counts.items()))
    unfused = len((r.get("conv_shapes") or {}).get("unfused") or [])
    padded = len((r.get("conv_shapes") or {}).get("padded") or [])
    for rnd in (r.get("measured_choices") or {}).get("rounds") or []:
        won = str(rnd.get("won"))
        words = KEPT_WORDS.get(won, won)
        if won == "cuDNN fused conv+bias+ReLU" and unfused:  # the fused form, less the shapes timed slower fused
            words += f" but {unfused} shape{'s' * (unfused > 1)}"
        if won == "cuDNN fused conv+bias+ReLU" and padded:  # and the shapes run on padded channels
            words += f", {padded} shape{'s' * (padded > 1)} on padded channels"
        parts.append(words)
    if r.get("search_mode") == "cost model":
        parts.append("search by cost model")
    return "; ".join(parts) or "-"


def merged(files: list[list[dict]]) -> list[dict]:
    """The rows of several corpus_gpu.json files as one list: a row without ``batch`` is batch 1; a later file's row
    of the same model and batch replaces an earlier one's, unless it is an error and the earlier one was timed."""
    out: dict[tuple, dict] = {}
    for rows in files:
        for r in rows:
            k = (r["model"], r.get("batch", 1))
            if k in out and "parastream_ms" in out[k] and "parastream_ms" not in r:
                continue
            out[k] = r
    return list(out.values())


def _geomean(xs: list[float]) -> float:
    return float(np.exp(np.mean(np.log(xs))))


COLUMNS = ("model", "family", "batch", "nodes in → out", "streams / engines", "parastream ms", "parastream items/s",
           "one stream ms", "critical-path bound ms (over it)", "torch.compile ms", "vs compile",
           "as called: parastream / torch.compile ms (vs compile)", "vs one stream",
           "kept (rewrites; timed choices)",
           "max err (scale)", "build s", "build stages s", "load s", "fresh load s", "rebuild s",
           "bundle MB (engines)")


def _over_bound(r: dict) -> str:
    if r.get("bound_ms"):
        return f"{r['bound_ms']:.3f} ({r['parastream_ms'] / r['bound_ms']:.2f}x)"
    return "-" if "bound_error" not in r else "error"


def _sizes(r: dict) -> str:
    return f"{r['bundle_mb']:.0f} ({r['engines_mb']:.0f})" if "bundle_mb" in r else "-"


def _ms(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def _ratio(x) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _vs_compile(r: dict) -> tuple[float | None, float | None]:
    """(torch.compile's median over the bundle's, both held: the GPU's work per call; the same with both timed as
    called), None where not timed.  Rows before 2026-12-03 hold no held baseline: their ratio is torch.compile as
    called over the bundle held, as those tables gave it (the as-called ratio None)."""
    if "compile_ms" not in r:  # --costs rows time no baseline
        return None, None
    if "compile_held_ms" not in r:
        return r["compile_ms"] / r["parastream_ms"], None
    return r["compile_held_ms"] / r["parastream_ms"], r["compile_ms"] / r["parastream_as_called_ms"]


def _as_called(r: dict, ratio: float | None) -> str:
    if ratio is None:
        return "-"
    return f"{r['parastream_as_called_ms']:.3f} / {r['compile_ms']:.3f} ({ratio:.2f}x)"


def table(rows: list[dict]) -> str:
    """The markdown table of ``rows`` (each model's batches together, in the order the models first appear), then
    per batch the geometric mean of the ratios and the models slower than torch.compile.  "vs compile" is both
    timed held (``_vs_compile``); the column after it gives both as called."""
    from corpus import MODELS

    def family(n):
        return "transformer" if n in ("bert", "bert_sdpa", "llama") else MODELS[n].family if n in MODELS else "?"

    first: dict[str, int] = {}
    for r in rows:
        first.setdefault(r["model"], len(first))
    rows = sorted(rows, key=lambda r: (first[r["model"]], r.get("batch", 1)))
    out = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    by_batch: dict[int, list[tuple[str, float, float]]] = {}
    as_called: dict[int, list[float]] = {}
    for r in rows:
        batch = r.get("batch", 1)
        if "parastream_ms" not in r:
            out.append(f"| {r['model']} | {family(r['model'])} | {batch} | error: {str(r.get('error', '?'))[:120]} |"
                       + " |" * (len(COLUMNS) - 4))
            continue
        b = r["one_stream_ms"] / r["parastream_ms"]
        c, called = _vs_compile(r)
        if c is not None:
            by_batch.setdefault(batch, []).append((r["model"], c, b))
            if called is not None:
                as_called.setdefault(batch, []).append(called)
        err = max(r["maxerr"].values())
        fl = r.get("fresh_load") or {}
        fresh = (f"{fl['median_s']:.1f} ({', '.join(f'{x:.1f}' for x in fl['each_s'])})" if "median_s" in fl
                 else fl.get("error", "-")[:60])
        replay = (fl.get("median_rep") or {}).get("replay_ms")
        if replay:  # 200 graph replays back to back in that fresh process (bench/load_breakdown.py), without the
            # events and input copy around each that the table's columns time: a throughput, below a call's latency
            # (BERT-base, H200: 0.413 back to back against 0.450-0.455 per call in any process; docs/torch-engines.md)
            fresh += f"; back to back {replay:.3f} ms"
        rb = r.get("rebuild") or {}
        again = (f"{rb['build_s']:.0f} ({rb['compile_jobs']} compile jobs)" if "build_s" in rb else rb.get("error", "-")[:60])
        out.append(f"| {r['model']} | {family(r['model'])} | {batch} | {r['nodes'][0]} → {r['nodes'][1]} | "
                   f"{r['streams']} / {r['engines']} | {r['parastream_ms']:.3f} | {batch * 1e3 / r['parastream_ms']:,.0f} | "
                   f"{r['one_stream_ms']:.3f} | {_over_bound(r)} | {_ms(r.get('compile_held_ms', r.get('compile_ms')))} | "
                   f"{_ratio(c)} | {_as_called(r, called)} | {b:.2f}x | "
                   f"{kept(r)} | "
                   f"{err:.1e} | {r.get('build_s', 0):.0f} | {_stages(r)} | {r.get('load_s', 0):.1f} | {fresh} | {again} | "
                   f"{_sizes(r)} |")
    out.append("")
    for batch, got in sorted(by_batch.items()):
        slower = [f"{m} {c:.2f}x" for m, c, _ in got if c < 1]
        out.append(f"batch {batch}: geometric mean over {len(got)} models: {_geomean([c for _, c, _ in got]):.2f}x vs "
                   f"torch.compile, {_geomean([b for _, _, b in got]):.2f}x vs its engines on one stream; slower than "
                   f"torch.compile on {len(slower)} of {len(got)}" + (f" ({', '.join(slower)})" if slower else "")
                   + (f"; both as called: {_geomean(as_called[batch]):.2f}x over {len(as_called[batch])} models"
                      if as_called.get(batch) else ""))
    opened = [f"{r['model']} b{r.get('batch', 1)} ({r['timing']['opened_by_timer']})" for r in rows
              if (r.get("timing") or {}).get("opened_by_timer")]
    if opened:  # a held block that waited on the host: those held medians hold the gate timer's wait
        out.append(f"held blocks opened by the gate's timer: {', '.join(opened)}")
    errors = sum("parastream_ms" not in r for r in rows)
    if errors:
        out.append(f"{errors} of {len(rows)} rows not timed (error)")
    return "\n".join(out).rstrip("\n")


# -- the run -------------------------------------------------------------------------------------------------

def batch_sizes(text: str) -> list[int]:
    """``1,8,32`` -> [1, 8, 32] (each once, in order), ``none`` -> []; anything but positive integers is refused."""
    if text.strip().lower() == "none":
        return []
    out: list[int] = []
    for item in text.split(","):
        item = item.strip()
        if not item.isdigit() or int(item) < 1:
            raise argparse.ArgumentTypeError(f"{text!r}: batch sizes are positive integers separated by commas, e.g. 1,8,32")
        if int(item) not in out:
            out.append(int(item))
    return out


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="The public-model corpus on the GPU: parastream against torch.compile "
                                             "(reduce-overhead) and its own engines on one stream, per model and batch.")
    ap.add_argument("--models", required=False, default="")
    ap.add_argument("--batches", type=batch_sizes, default=[1], metavar="N,N,...",
                    help="batch sizes: each model is exported, built and timed at each (static shapes), torch.compile "
                         "at the same batch; one row per model and batch, each model's batches started one after "
                         "the other (default 1)")
    ap.add_argument("--search-batches", type=batch_sizes, default=None, metavar="N,...",
                    help="the batches whose build runs the measured rewrite search (--measure-seconds, --top-k); the "
                         "builds at the other batches rank the search's candidates by the cost model and measure only "
                         "the input and its best candidate (--measure-seconds 0 --top-k 1), saving the measured "
                         "search's seconds per build; every build still times its fusions and streams on the GPU "
                         "(default: every batch of --batches; none: no build runs it)")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=540, help="stop starting builds and timings after this")
    ap.add_argument("--measure-seconds", type=float, default=20)
    ap.add_argument("--opt-level", type=int, default=3, choices=range(6),
                    help="the builds' --opt-level (4, 5: the tuned engines raced last, the kernel tuning round)")
    ap.add_argument("--top-k", type=int, default=10)
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--fresh-loads", type=int, default=3,
                    help="fresh-process loads per bundle (each model and batch), empty Inductor/Triton caches (0: none)")
    ap.add_argument("--changed-weight", action="store_true",
                    help="with --rebuild: rebuild the model with its largest weight scaled by 1.01")
    ap.add_argument("--rebuild", action="store_true",
                    help="build each model with a --cache-dir and build it again in a fresh process (the warm rebuild)")
    ap.add_argument("--costs", action="store_true",
                    help="build, load and rebuild costs: the bundle timed against its own engines on one stream, no "
                         "torch.compile baseline compiled or timed (saves each model the baseline's two compiles)")
    ap.add_argument("--table", nargs="+", default=None, metavar="JSON",
                    help="print the table of corpus_gpu.json files (their rows together; rows without a batch are "
                         "batch 1) and exit")
    ap.add_argument("--rebuild-of", default=None, help=argparse.SUPPRESS)  # the child process: rebuild one model
    ap.add_argument("--work", default="/tmp/corpus_gpu")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/corpus_gpu_out"))
    ap.add_argument("--prepare", default=None, help=argparse.SUPPRESS)  # the child process: build one model
    ap.add_argument("--batch", type=int, default=1, help=argparse.SUPPRESS)  # ... at this batch
    args = ap.parse_args(argv)
    if not args.batches:
        ap.error("--batches none: give at least one batch size")
    if args.search_batches is not None and not set(args.search_batches) <= set(args.batches):
        ap.error(f"--search-batches {','.join(map(str, args.search_batches))}: not among --batches "
                 f"{','.join(map(str, args.batches))}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.table:
        files = []
        for f in args.table:
            try:
                files.append(json.loads(Path(f).read_text()))
            except (OSError, ValueError) as e:
                print(f"--table {f}: {error_text(e)}", file=sys.stderr)
                return 2
        print(table(merged(files)))
        return 0
    work, out = Path(args.work), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    if args.prepare:
        try:
            row = prepare(args.prepare, args.batch, work, args)
        except Exception as e:  # noqa: BLE001 - the row says what failed
            traceback.print_exc()
            row = {"model": args.prepare, "batch": args.batch, "error": error_text(e)}
        (work / f"{job_key(args.prepare, args.batch)}.prep.json").write_text(json.dumps(row, default=str))
        return 0
    if args.rebuild_of:
        try:
            got = rebuild(args.rebuild_of, args.batch, work, args)
        except Exception as e:  # noqa: BLE001 - the row says what failed
            traceback.print_exc()
            got = {"error": error_text(e)}
        (work / f"{job_key(args.rebuild_of, args.batch)}.rebuild.json").write_text(json.dumps(got, default=str))
        return 0

    import torch

    try:  # what the timing imports, here before any build starts: a process that cannot time is told in seconds,
        # not after its builds (a device command whose PYTHONPATH reached only the builds lost a whole call)
        for module in ("parastream.launcher.gpu", "parastream.pipeline.bench"):
            importlib.import_module(module)
    except ImportError as e:
        print(f"corpus_gpu.py: this process cannot import parastream ({e}); source bench/device_env.sh first",
              file=sys.stderr)
        return 2
    t_start = time.perf_counter()
    names = list(filter(None, args.models.split(",")))  # started in this order: long builds first pay off
    # a job: (model, batch, a rebuild of it); each model's batches one after the other
    pending: list[tuple[str, int, bool]] = [(n, b, False) for n in names for b in args.batches]
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}; {len(names)} models at batch "
          f"{','.join(map(str, args.batches))}, {args.workers} builds at a time", flush=True)
    env = dict(os.environ, TORCHINDUCTOR_COMPILE_THREADS=str(max(1, (os.cpu_count() or 4) // args.workers)))
    running: dict[tuple[str, int, bool], tuple] = {}
    rows: list[dict] = []
    logs = out / "logs"
    logs.mkdir(exist_ok=True)

    def save():
        (out / "corpus_gpu.json").write_text(json.dumps(rows, indent=1, default=str))
        (out / "corpus_gpu.md").write_text(table(rows) + "\n")

    def row_of(n: str, b: int) -> dict:
        return next(r for r in rows if r["model"] == n and r.get("batch", 1) == b)

    while pending or running:
        elapsed = time.perf_counter() - t_start
        while pending and len(running) < args.workers and elapsed < args.seconds * 0.6:
            job = pending.pop(0)
            model, batch, again = job
            key = job_key(model, batch)
            f = open(logs / f"{key}{'.rebuild' if again else ''}.log", "w")  # noqa: SIM115 - closed when the child ends
            measure_s, top_k = build_settings(batch, args)
            cmd = [sys.executable, __file__, "--rebuild-of" if again else "--prepare", model, "--batch", str(batch),
                   "--work", str(work), "--measure-seconds", str(measure_s), "--top-k", str(top_k)] \
                + (["--rebuild"] if args.rebuild else []) + (["--changed-weight"] if args.changed_weight else []) \
                + (["--costs"] if args.costs else []) + ["--opt-level", str(args.opt_level)]
            running[job] = (subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True), f, time.perf_counter())
            print(f"[{elapsed:5.0f} s] {'rebuild' if again else 'build'} {model} at batch {batch}", flush=True)
        done = [j for j, (p, _, _) in running.items() if p.poll() is not None]
        if elapsed > args.seconds:
            for (model, batch, again), (p, f, _) in running.items():
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                late = {"error": f"not finished within --seconds {args.seconds:.0f}"}
                if again:
                    row_of(model, batch)["rebuild"] = late
                else:
                    rows.append({"model": model, "batch": batch, **late})
            running.clear()
            for model, batch, again in pending:
                if again:
                    row_of(model, batch)["rebuild"] = {"error": "not started (time)"}
                else:
                    rows.append({"model": model, "batch": batch, "error": "not started (time)"})
            pending.clear()
            break
        if not done:
            time.sleep(1)
            continue
        for job in done:
            p, f, t0 = running.pop(job)
            f.close()
            model, batch, again = job
            key = job_key(model, batch)
            if again:
                got = work / f"{key}.rebuild.json"
                row_of(model, batch)["rebuild"] = (json.loads(got.read_text()) if got.exists()
                                                   else {"error": f"rebuild process exited {p.returncode}"})
                print(f"[{time.perf_counter() - t_start:5.0f} s] "
                      f"{json.dumps({'model': model, 'batch': batch, 'rebuild': row_of(model, batch)['rebuild']}, default=str)}",
                      flush=True)
                save()
                continue
            prep = work / f"{key}.prep.json"
            row = (json.loads(prep.read_text()) if prep.exists()
                   else {"model": model, "batch": batch, "error": f"build process exited {p.returncode}: "
                         + _last_error_line(logs / f"{key}.log")})
            row["prepare_wall_s"] = time.perf_counter() - t0
            row["search_mode"] = "measured" if searched(batch, args) else "cost model"
            if "error" not in row:
                try:
                    row = time_model(model, batch, work, row, args, [q for q, _, _ in running.values()])
                    if args.fresh_loads > 0:
                        row["fresh_load"] = fresh_loads(work / f"{key}_bundle", args.fresh_loads,
                                                        [q for q, _, _ in running.values()])
                except Exception as e:  # noqa: BLE001 - the row says what failed; the next rows go on
                    traceback.print_exc()
                    row["error"] = f"timing: {error_text(e)}"
                if args.rebuild:  # next: a fresh process, the model's cache filled by this build
                    pending.insert(0, (model, batch, True))
            rows.append(row)
            brief = {k: row.get(k) for k in ("model", "batch", "error", "parastream_ms", "one_stream_ms", "compile_ms", "streams",
                                             "engines", "build_s", "load_s", "maxerr", "stage_seconds")}
            brief["fresh_load_s"] = (row.get("fresh_load") or {}).get("median_s")
            print(f"[{time.perf_counter() - t_start:5.0f} s] {json.dumps(brief, default=str)}", flush=True)
            save()
    save()
    print(table(rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
