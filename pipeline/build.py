"""``parastream build``: load and check, rewrite, schedule, build engines, verify, write the bundle.

Nothing reaches OUT until everything succeeded: the bundle is written into a
temporary folder beside OUT and renamed into place at the end.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import platform
import shutil
import tempfile
import time
import weakref
from collections import OrderedDict
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from parastream.launcher.bundle import Bundle, write_manifest
from parastream.launcher.engines import BuildOptions, resolve_backend
from parastream.launcher.errors import ParastreamError, VerificationError

from parastream.rewrite.search import MeasureBudgetSpent

from .isolate import in_child
from .model_io import LoadedModel, batch_profiles, graph_of, load_model
from .partition import extract_branch, make_plan
from .outdir import check_target, staging
from .schedule import Schedule, choose_streams, estimate_latency, schedule_graph
from .verify import resolve_tolerances, verify

REPORT_VERSION = 1
DEFAULT_MAX_STREAMS = 4


@dataclass
class BuildConfig:
    backend: str = "auto"
    streams: int | None = None  # None: the count choose_streams estimates fastest (1 .. max_streams)
    max_streams: int = DEFAULT_MAX_STREAMS
    shapes: dict[str, list[int]] = field(default_factory=dict)
    batch: tuple[int, int, int] | None = None  # --batch min:opt:max for inputs with a dynamic first dimension
    batch_buckets: list[int] | None = None  # --batch-buckets: the batch sizes built (None: powers of two, MIN and MAX)
    precision: str = "fp32"
    search: bool = True
    search_options: dict = field(default_factory=dict)
    measure: bool = True  # measure the search's top candidates on the GPU when the backend has GPU engines
    # budget for those measurements (each one builds and loads engines; the top-ranked first): on the H100 an
    # Inception-v4 input is timed ~15 s after the build starts (its 82 engines compiled while the search runs),
    # each candidate after it ~2 s (stop 23, "kernels" engines: 50 s measured 18 of the top 20, the build 61.5 s)
    measure_seconds: float = 45.0
    measure_runs: int = 100
    cpu_runs: int = 10  # CPU builds: timed calls of each alternative (one full-threaded session, the plan)
    verify: bool = True
    rtol: float | None = None
    atol: float | None = None
    scale_tol: float | None = None  # max|out-ref| / max|ref| (default by precision; rtol/atol ask for elementwise)
    seed: int = 0
    device: str | None = None  # device profile the cost model plans for (None: "CPU" for CPU engines, else H100-SXM)
    workspace_mb: int = 4096
    optimization_level: int = 3
    strongly_typed: bool = False
    cache_dir: str | None = None
    compile: bool = True
    force: bool = False


def _versions(backend) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in ("parastream", "onnx", "onnxruntime", "onnx-graphsurgeon", "polygraphy", "torch", "tensorrt"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out


def _device_description(backend) -> str:
    describe = getattr(backend, "describe_device", None)
    if describe is not None:
        try:
            return str(describe())
        except Exception:  # noqa: BLE001 - informational only
            pass
    return f"cpu: {platform.processor() or platform.machine()} ({platform.system()})"


def default_device_profile(backend) -> str:
    """The cost model's device when --device-profile is not given: this CPU for CPU engines, else an H100."""
    return "H100-SXM" if backend.gpu else "CPU"


def _infer(model: onnx.ModelProto) -> onnx.ModelProto:
    from parastream.rewrite.ir import infer

    return infer(model, strict=True)


def _shapes_known(model: onnx.ModelProto) -> bool:
    """Every node output has a static shape in ``model`` (value_info or a graph output): inferred already."""
    known = {v.name for v in list(model.graph.value_info) + list(model.graph.output)
             if v.type.tensor_type.HasField("shape") and all(d.HasField("dim_value") for d in v.type.tensor_type.shape.dim)}
    return all(o in known for n in model.graph.node for o in n.output if o)


def plan_streams(graph: gs.Graph, cost_model, streams: int | None, max_streams: int,
                 dag=None) -> tuple[Schedule, list[dict]]:
    """The schedule of ``graph``: on ``streams`` streams when given, else the number ``choose_streams`` estimates best.
    ``dag``: the graph's ``analysis.node_dag`` when the caller has it."""
    if streams:
        sched = schedule_graph(graph, streams, cost_model.node_cost, cost_model.is_memory_bound, dag=dag)
        est = estimate_latency(sched)
        return sched, [{"streams": sched.num_streams, "engines": len(sched.branches), "critical_path_s": sched.makespan,
                        "estimated_s": est, "chosen": True, "requested": streams}]
    return choose_streams(graph, max_streams, cost_model.node_cost, cost_model.is_memory_bound, dag=dag)


def _engine_layouts(plan, backend, builder, options: BuildOptions, internal_nhwc: bool = True):
    """``branch -> keyword arguments for builder.build``: the GPU launcher's tensor layout for builders that
    compile for it (torch: Inductor artifacts or AOTInductor packages), so the engine compiled is the engine loaded; else nothing."""
    if options.device != "cuda" or "layout" not in inspect.signature(builder.build).parameters:
        return lambda b: {}
    from parastream.launcher.gpu import engine_layouts

    lay = engine_layouts(plan, backend, internal_nhwc=internal_nhwc)
    # an in-place Concat runs no engine in the launcher; it keeps its ONNX for launchers that do not elide it
    return lambda b: {} if b.id in lay.elided else {"layout": lay.branch(b)}


def check_runnable(loaded: LoadedModel, backend, reference: bool) -> None:
    """The backend's own check of the model and, when the build verifies, that ONNX Runtime can load the
    original (the reference); in a child process, since ONNX Runtime may crash on a malformed model."""
    from parastream.launcher.engines import onnxruntime as ort_engines

    checks = [(getattr(backend, "check_model", None), loaded.model)]
    if reference and backend is not ort_engines:
        checks.append((ort_engines.check_model, loaded.original))

    def run_checks():
        for check, model in checks:
            if check is not None:
                check(model)

    try:
        in_child(run_checks, what="loading the model into onnxruntime")
    except ParastreamError as e:
        raise ParastreamError(f"{loaded.path}: {e}") from None


@contextlib.contextmanager
def running_errors(path, model: onnx.ModelProto, what: str):
    """An error of ONNX Runtime (or of a bundle's engine) while the model runs on random inputs, as one line
    naming the node: a model that loads can still fail to run (a Conv group that does not divide its channels
    or is 0, a Transpose perm of the wrong rank, shapes that contradict the weights)."""
    from parastream.launcher.engines.onnxruntime import describe_error

    try:
        yield
    except ParastreamError:
        raise
    except Exception as e:  # noqa: BLE001 - onnxruntime and polygraphy raise their own types
        raise ParastreamError(f"{path}: running the model on random inputs {what} failed: {describe_error(e, model)}") from None


def run_verification(path, original: onnx.ModelProto, runner, inputs, **kwargs):
    """``verify``, with errors of the model's run as one line (``running_errors``)."""
    with running_errors(path, original, "for verification"):
        return verify(original, runner, inputs, **kwargs)


#: id(plan) -> (weak reference to the plan, its model, its branches extracted, their bytes): ``branches_of``
_EXTRACTED: "OrderedDict[int, tuple]" = OrderedDict()
EXTRACTED_BYTES = 1 << 30  # at most this much of extracted branches kept (an Inception-v4 plan is ~170 MB)


def branches_of(model: onnx.ModelProto, graph: gs.Graph, plan) -> list[onnx.ModelProto]:
    """Each branch of ``plan`` extracted from ``model`` (``extract_branch``), once per plan object while the plan
    lives: a GPU build compiles a plan's engines in a batch before it writes them, the search prepares a candidate
    before it loads it, and the timed alternatives rebuild the same plan with other options.  Callers never
    change the protos they get."""
    key = id(plan)
    hit = _EXTRACTED.get(key)
    if hit is not None and hit[0]() is plan and hit[1] is model:
        _EXTRACTED.move_to_end(key)
        return hit[2]
    out = [extract_branch(model, graph, b) for b in plan.branches]
    size = sum(b.ByteSize() for b in out)
    if size <= EXTRACTED_BYTES:
        _EXTRACTED[key] = (weakref.ref(plan, lambda _: _EXTRACTED.pop(key, None)), model, out, size)
        while sum(v[3] for v in _EXTRACTED.values()) > EXTRACTED_BYTES:
            _EXTRACTED.popitem(last=False)
    return out


def _write_engines(dest: Path, model: onnx.ModelProto, graph: gs.Graph, plan, backend, options: BuildOptions,
                   label: str, on_branch=None, internal_nhwc: bool = True, prebuilt: dict | None = None,
                   model_file: bool = True, sink: dict | None = None) -> dict:
    """model.onnx, plan.json and one engine per branch into ``dest``; return the builder's report.

    Engines that are compiled for the launcher's tensor layout (torch) are compiled for the layout a
    launcher of this plan uses with ``internal_nhwc`` (what manifest.json will say).  ``prebuilt``:
    {branch name: (engine file, builder report)} of this same plan, built already (the CPU alternative kept).
    ``sink``: a dict that gets each engine's bytes by file name instead of ``dest`` (a scratch bundle in memory)."""
    if prebuilt is not None and set(prebuilt) == {b.name for b in plan.branches}:
        (dest / "engines").mkdir(exist_ok=True)
        onnx.save(model, dest / "model.onnx")
        plan.save(dest / "plan.json")
        for b in plan.branches:
            shutil.copyfile(prebuilt[b.name][0], dest / b.engine)
            if on_branch:
                on_branch()
        return {name: rep for name, (_, rep) in prebuilt.items() if rep is not None}
    if sink is None:
        (dest / "engines").mkdir(exist_ok=True)
        if model_file:
            onnx.save(model, dest / "model.onnx")
        plan.save(dest / "plan.json")
    builder = backend.Builder(options)
    layouts = _engine_layouts(plan, backend, builder, options, internal_nhwc)
    try:
        build_all = getattr(builder, "build_all", None)  # torch: compiles its branches side by side
        if build_all is not None:
            with _naming_failures(label, backend, None):
                datas = build_all([(br, b.name, layouts(b).get("layout"))
                                   for br, b in zip(branches_of(model, graph, plan), plan.branches)])
        for i, b in enumerate(plan.branches):
            if build_all is not None:
                data = datas[i]
            else:
                with _naming_failures(label, backend, b):
                    data = builder.build(extract_branch(model, graph, b), b.name, **layouts(b))
            if sink is not None:
                sink[b.engine] = data
            else:
                (dest / b.engine).write_bytes(data)
            if on_branch:
                on_branch()
        return builder.report()
    finally:
        builder.close()


@contextlib.contextmanager
def _naming_failures(label: str, backend, b):
    """A backend's failure to build ``b`` (or, with ``b=None``, a batch whose messages name their branch) as one line."""
    try:
        yield
    except ParastreamError as e:
        msg = str(e)
        raise ParastreamError(f"{label}: {msg}" if b is None or msg.startswith(b.name) else f"{label}: {b.name} failed to build: {msg}") from None
    except Exception as e:  # noqa: BLE001 - backend errors name the node
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        where = f"{b.name} (nodes {b.nodes[0]}..{b.nodes[-1]})" if b is not None else "an engine"
        raise ParastreamError(f"{label}: {where} failed to build with {backend.name}: {first}") from None


def _engines_loaded(runner) -> dict:
    """How verification loaded the engines (``parastream run``'s way): how many ran as the written compiled
    artifacts and how many had to be compiled at load (none, for a bundle whose engines were compiled at build)."""
    engines = [e for e in getattr(runner, "engines", []) if e is not None and hasattr(e, "compiled_at_load")]
    if not engines:
        return {}
    return {"engines_loaded": len(engines), "engines_compiled_at_load": sum(bool(e.compiled_at_load) for e in engines)}


def _launcher_options(options: BuildOptions) -> dict:
    """The builder options a launcher reads back from manifest.json."""
    return {"compile": options.compile, "optimization_level": options.optimization_level,
            "fuse_conv_relu": options.fuse_conv_relu}


def _scratch_launcher(model: onnx.ModelProto, graph: gs.Graph, plan, backend, options: BuildOptions,
                      internal_nhwc: bool = True):
    """A GpuLauncher of ``plan`` built like a real bundle in a scratch folder (gone once the engines are loaded)."""
    import tempfile

    from parastream.launcher.gpu import GpuLauncher

    with tempfile.TemporaryDirectory(prefix="parastream-measure-") as tmp:
        bundle = _scratch_bundle(Path(tmp), model, graph, plan, backend, options, internal_nhwc)
        t_built = time.perf_counter()
        la = GpuLauncher(bundle)
        la.t_built = t_built  # when its engines were built (the search's measurement log)
        return la


def _compiles_for_layout(backend) -> bool:
    """Whether the backend's engines are compiled for the launcher's tensor layout and fusion (torch packages)."""
    build_fn = getattr(getattr(backend, "Builder", None), "build", None)
    return build_fn is not None and "layout" in inspect.signature(build_fn).parameters


def _alternative_launcher(bundle: Bundle, model, graph, plan, backend, options: BuildOptions, *, fuse_conv_relu: bool,
                          internal_nhwc: bool | None = None):
    """The bundle loaded with another fusion or boundary layout: engines compiled for a layout (torch packages)
    are compiled for it in a scratch bundle (side by side, cached: if it wins, the bundle's rewrite hits the
    cache); other engines load as they are."""
    from parastream.launcher.gpu import GpuLauncher

    if _compiles_for_layout(backend):
        return _scratch_launcher(model, graph, plan, backend, replace(options, fuse_conv_relu=fuse_conv_relu),
                                 internal_nhwc is not False)
    return GpuLauncher(bundle, fuse_conv_relu=fuse_conv_relu, internal_nhwc=internal_nhwc)


def _record_measured_streams(streams_tried: list[dict], sched: Schedule) -> None:
    """Timing chose ``sched``: the table of stream counts says so (the row chosen, marked measured)."""
    chosen = [t for t in streams_tried if t.get("chosen")]
    if len(chosen) == 1 and chosen[0]["streams"] == sched.num_streams and chosen[0].get("engines") == len(sched.branches):
        return
    for t in streams_tried:
        t["chosen"] = False
    streams_tried.append({"streams": sched.num_streams, "engines": len(sched.branches), "chosen": True, "measured": True})


def _alternative_plans(model: onnx.ModelProto, graph: gs.Graph, plan, backend, options: BuildOptions, cost_model,
                       *, named: bool = False) -> list[tuple]:
    """The engines ``time_alternatives`` will load besides the plan's own, as (model, graph, plan, options,
    internal_nhwc), guessed before it runs: the first round's choice is unknown, so the later rounds are
    taken with the fusion as it is (a choice that goes the other way compiles its engines then).  ``named``:
    (round, that tuple) each, the round as ``time_alternatives`` names it."""
    torch_engines = backend.name == "torch"
    fused = bool(options.fuse_conv_relu and torch_engines)
    out = []
    if fused and _has_conv_relu(model):
        out.append(("conv+ReLU", (model, graph, plan, replace(options, fuse_conv_relu=False), True)))
    out.append(("boundary layout", (model, graph, plan, options, False)))
    if plan.num_streams > 1:
        out.append(("streams", (model, graph, _one_engine_plan(graph, plan, backend, cost_model), options, True)))
    return out if named else [alt for _, alt in out]


def _round_labels(what: str, plan) -> tuple[str, str]:
    """What a round of ``time_alternatives`` races: (the plan as it is, the alternative)."""
    return {"conv+ReLU": ("cuDNN fused conv+bias+ReLU", "Inductor's conv and epilogue"),
            "boundary layout": ("channels-last boundaries", "contiguous boundaries"),
            "streams": (f"{plan.num_streams}-stream plan", "one engine for the whole model")}[what]


def _race(rounds: list[dict], what: str, current, other, plan, runs: int, since: float) -> bool:
    """One round of ``time_alternatives``: ``current`` against ``other`` in alternating blocks of CUDA-event timed
    replays; the round goes into ``rounds`` (``load_s``: the seconds since ``since``, building and loading
    ``other``); True when ``other`` was faster."""
    from parastream.launcher.bench import measure as time_replays

    keys = _round_labels(what, plan)
    t0 = time.perf_counter()
    times = time_replays({keys[0]: current, keys[1]: other}, runs=runs, warmup=10)
    ms = {k: float(np.median(v)) for k, v in times.items()}
    won = ms[keys[1]] < ms[keys[0]]
    rounds.append({"choice": what, "timed_ms": ms, "won": keys[1] if won else keys[0],
                   "load_s": round(t0 - since, 3), "timed_s": round(time.perf_counter() - t0, 3)})
    return won


def _plan_signature(plan) -> tuple:
    """What makes two plans load the same engines in the same order on the same streams (not the cost model's
    per-branch estimates)."""
    return (plan.backend, plan.precision, plan.num_streams,
            tuple((b.name, b.stream, tuple(b.nodes), tuple(b.inputs), tuple(b.outputs), tuple(b.waits), b.concat_axis)
                  for b in plan.branches),
            tuple(sorted((n, str(t)) for n, t in plan.tensors.items())))


def _one_engine_plan(graph: gs.Graph, plan, backend, cost_model):
    """``plan``'s graph as one engine on one stream (the rival ``time_alternatives`` times a multi-stream plan against)."""
    sched1, _ = plan_streams(graph, cost_model, 1, 1)
    return make_plan(graph, sched1, backend=plan.backend, precision=plan.precision, suffix=backend.suffix,
                     inputs=plan.inputs, outputs=plan.outputs)


def precompile_plans(backend, plans: list[tuple], background: bool = False, cancellable: bool = True) -> dict | None:
    """Compile the engines of several plans ((model, graph, plan, options, internal_nhwc) each) in one batch of the
    backend's compile workers (torch: ``precompile``); the engine writes that follow are cache hits (or wait for
    the branch, when ``background`` left it compiling).  None when the backend compiles nothing for a layout."""
    precompile = getattr(backend, "precompile", None)
    if precompile is None or not _compiles_for_layout(backend):
        return None
    batches = []
    for model, graph, plan, options, nhwc in plans:
        builder = backend.Builder(options)
        layouts = _engine_layouts(plan, backend, builder, options, nhwc)
        batches.append((builder, [(br, b.name, layouts(b).get("layout"))
                                  for br, b in zip(branches_of(model, graph, plan), plan.branches)]))
    if not background:  # the plain call: all a backend's ``precompile`` must take
        return precompile(batches)
    return precompile(batches, background=True, cancellable=cancellable)


def _has_conv_relu(model: onnx.ModelProto) -> bool:
    readers: dict[str, list[str]] = {}
    for n in model.graph.node:
        for i in n.input:
            readers.setdefault(i, []).append(n.op_type)
    return any(n.op_type == "Conv" and readers.get(n.output[0]) == ["Relu"] for n in model.graph.node)


def time_alternatives(tmp: Path, model: onnx.ModelProto, graph: gs.Graph, plan, backend, options: BuildOptions,
                      cost_model, *, runs: int) -> dict | None:
    """Decide by measurement what the cost model and the converter's rules chose (GPU builds only).

    The bundle written in ``tmp`` is timed on the GPU against what the build could have shipped instead,
    one choice at a time, each round in alternating blocks of CUDA-event timed replays (launcher.bench.measure):
    (1) torch engines with and without cuDNN's fused conv + bias + ReLU, (2) channels-last against contiguous
    internal boundaries, (3) the plan against one engine for the whole model (when the plan has several
    streams).  Returns {"rounds": [...], "fuse_conv_relu", "internal_nhwc", "one_engine"} with the faster of
    each round, or None when there is no GPU or nothing to choose.
    """
    if not getattr(backend, "gpu", False):
        return None
    from parastream.launcher import cuda_device_count

    if cuda_device_count() < 1:
        return None
    from parastream.launcher.gpu import GpuLauncher

    bundle = Bundle.open(tmp, check_hashes=False)
    torch_engines = backend.name == "torch"
    chosen = {"fuse_conv_relu": bool(options.fuse_conv_relu and torch_engines), "internal_nhwc": True, "one_engine": False}
    rounds: list[dict] = []
    since = time.perf_counter()  # a round's load_s: building and loading its alternative (the first: the bundle too)

    def race(what: str, current, other) -> bool:
        nonlocal since
        won = _race(rounds, what, current, other, plan, runs, since)
        since = time.perf_counter()
        return won

    current = GpuLauncher(bundle, fuse_conv_relu=chosen["fuse_conv_relu"])
    try:
        if torch_engines and chosen["fuse_conv_relu"] and _has_conv_relu(model):
            other = _alternative_launcher(bundle, model, graph, plan, backend, options, fuse_conv_relu=False)
            if race("conv+ReLU", current, other):
                current, other, chosen["fuse_conv_relu"] = other, current, False
            other.close()
        if current.nhwc:
            other = _alternative_launcher(bundle, model, graph, plan, backend, options,
                                          fuse_conv_relu=chosen["fuse_conv_relu"], internal_nhwc=False)
            if race("boundary layout", current, other):
                current, other, chosen["internal_nhwc"] = other, current, False
            other.close()
        if plan.num_streams > 1:
            plan1 = _one_engine_plan(graph, plan, backend, cost_model)
            opts1 = BuildOptions(**{**asdict(options), "fuse_conv_relu": chosen["fuse_conv_relu"]})
            other = _scratch_launcher(model, graph, plan1, backend, opts1)
            if race("streams", current, other):
                chosen["one_engine"] = True
            other.close()
    finally:
        current.close()
    if not rounds:
        return None
    return dict(chosen, rounds=rounds, runs=runs)


def _measure_alternatives(tmp: Path, model, graph, plan, backend, options: BuildOptions, cost_model, cfg: BuildConfig,
                          loaded: LoadedModel) -> dict | None:
    """``time_alternatives`` on the engines just written to ``tmp``; the options it chose go into ``options``."""
    (tmp / "report.json").write_text("{}")
    write_manifest(tmp, {"backend": backend.name, "precision": cfg.precision, "options": _launcher_options(options)})
    measured = time_alternatives(tmp, model, graph, plan, backend, options, cost_model, runs=cfg.measure_runs)
    if measured:
        options.fuse_conv_relu = measured["fuse_conv_relu"]
    return measured


def _compiled_for_other_choices(backend, fused: bool, measured: dict) -> bool:
    """Whether the engines just written were compiled (torch packages) for a fusion or boundary layout that the
    measurement did not choose: they are compiled again for the choice, so that what ships is what loads."""
    return _compiles_for_layout(backend) and (measured["fuse_conv_relu"] != fused or not measured["internal_nhwc"])


@dataclass
class _ScratchBundle(Bundle):
    """A bundle to load and time whose engines stay in memory: the search loads one per candidate, and writing
    then reading back every engine (330 MB for Inception-v4) cost more than building them from the cache."""

    engines: dict = field(default_factory=dict)

    def engine_bytes(self, branch) -> bytes:
        return self.engines[branch.engine]


def _scratch_bundle(dest: Path, model: onnx.ModelProto, graph: gs.Graph, plan, backend, options: BuildOptions,
                    internal_nhwc: bool = True) -> Bundle:
    """A bundle of ``plan`` to load and time: its plan and engines only, in memory (no model.onnx, report or
    hashes: a launcher reads none of them); ``dest`` is the folder its engine paths are named under."""
    engines: dict = {}
    _write_engines(dest, model, graph, plan, backend, options, "candidate", internal_nhwc=internal_nhwc, sink=engines)
    return _ScratchBundle(path=dest, manifest={"backend": backend.name, "precision": plan.precision,
                                               "options": dict(_launcher_options(options), internal_nhwc=internal_nhwc)},
                          plan=plan, report={}, engines=engines)


CPU_MARGIN = 0.05  # a timed CPU alternative replaces the default only when at least this much faster (and beyond the spread)
CPU_BUSY_SHARE = 0.25  # ... and only when other processes used at most this share of the cores while it was timed
CPU_LOAD_PROBE_S = 0.3  # how long the CPU build looks at the machine's load before it builds alternatives to time


@dataclass
class CpuAlternative:
    name: str
    model: onnx.ModelProto
    graph: gs.Graph
    sched: Schedule
    threads: int  # intra-op threads per session (0: onnxruntime's default, every core)


def cpu_alternatives(loaded: LoadedModel, model: onnx.ModelProto, graph: gs.Graph, sched: Schedule, cost_model,
                     cfg: "BuildConfig", rewritten: bool, dag=None) -> list[CpuAlternative]:
    """What a CPU build can ship, the DEFAULT first: the loaded model as one onnxruntime session with every core
    (plain onnxruntime, which a bundle must never be slower than), then the rewritten model as one session, the
    multi-stream plan the cost model scheduled with the cores shared out among its streams, and with every core
    per session.  ``--streams`` given: only the plan's thread counts (the shared one the default).  ``rewritten``
    False (the search changed nothing): the rewritten model is the loaded one, not timed twice.  A rewrite or a
    plan replaces plain onnxruntime only by being timed faster (``decide_by_timing``)."""
    import os

    cores = os.cpu_count() or 1
    plans: list[CpuAlternative] = []
    if sched.num_streams > 1 or cfg.streams:
        shared = max(1, cores // sched.num_streams) if sched.num_streams > 1 else 0
        for threads in dict.fromkeys([shared, 0]):
            plans.append(CpuAlternative(f"plan: {sched.num_streams} streams, {len(sched.branches)} sessions, "
                                        f"{threads or cores} threads each", model, graph, sched, threads))
    whole: list[CpuAlternative] = []
    if not cfg.streams:
        for name, m in (("rewritten model, one session", model), ("original model, one session", loaded.model)):
            if name.startswith("rewritten") and (m is loaded.model or not rewritten):
                continue
            g = graph if m is model else loaded.graph  # the loader's graph of the loaded model
            g_dag = dag if g is graph else loaded.dag  # (``dag``: the node DAG of ``graph``, when the caller has it)
            one = schedule_graph(g, 1, cost_model.node_cost, cost_model.is_memory_bound, dag=g_dag)
            whole.append(CpuAlternative(name, m, g, one, 0))
    # plain onnxruntime (the original, one session) first when it is an alternative: it is the default
    return whole[::-1] + plans


def decide_by_timing(times: dict[str, np.ndarray], order: list[str], floor: float = CPU_MARGIN) -> tuple[str, list[dict]]:
    """The alternative to keep from timed calls: ``order[0]`` (the default) unless another is faster by a clear
    margin.  The alternatives are taken in order; one replaces the current choice when its median is below the
    current's by more than the margin: the larger of ``floor`` and the spread of either (interquartile range /
    median of its calls), so that a difference within the noise of a loaded machine never flips the bundle.
    Returns (chosen, one row per alternative: median, quartiles, spread, calls, margin it needed, won)."""
    stats = {}
    for name in order:
        t = np.asarray(times[name], dtype=float)
        q25, med, q75 = (float(x) for x in np.percentile(t, [25, 50, 75]))
        stats[name] = {"median_ms": med * 1e3, "p25_ms": q25 * 1e3, "p75_ms": q75 * 1e3,
                       "spread": (q75 - q25) / med if med > 0 else 0.0, "calls": int(t.size)}
    current = order[0]
    for name in order[1:]:
        margin = max(floor, stats[current]["spread"], stats[name]["spread"])
        stats[name]["margin_needed"] = margin
        stats[name]["against"] = current
        if stats[name]["median_ms"] < stats[current]["median_ms"] * (1.0 - margin):
            current = name
    return current, [dict(alternative=n, **stats[n], chosen=n == current) for n in order]


CPU_INTERLEAVE_BYTES = 256 << 20  # alternatives whose sessions' engines together are larger are timed one at a time


def choose_cpu_alternative(loaded: LoadedModel, model: onnx.ModelProto, graph: gs.Graph, sched: Schedule, backend,
                           options: BuildOptions, cost_model, cfg: "BuildConfig", scratch: Path, rewritten: bool = True,
                           dag=None):
    """CPU builds: time the alternatives (``cpu_alternatives``) on this machine, as the GPU build measures its
    candidates, and keep the default (plain onnxruntime) unless another is faster beyond the noise
    (``decide_by_timing``) on a machine that other processes left to the build (``OthersLoad``: at most
    ``CPU_BUSY_SHARE`` of the cores used by others while it was timed): the same command gives the same
    bundle on a loaded and on an idle machine unless an alternative wins clearly where it can be timed.

    They are loaded together and timed in alternating blocks on the same random input (``race_calls``: at most
    ``cfg.cpu_runs`` calls each; one clearly behind stops early), so that a change in the machine's load falls on
    all of them alike; when their engines together pass ``CPU_INTERLEAVE_BYTES`` (a large model: every session
    holds its own weights), one at a time instead, to bound the build's memory.  Each distinct model and schedule
    is built once, in ``scratch`` (the caller's folder; the plan's two thread counts share their engines), and the
    engines of the one kept are handed back as files there, so that the bundle copies rather than builds them.

    Returns (model, graph, schedule, threads per engine, report, engines: {branch name: (file, builder report)}).
    """
    import os

    from parastream.launcher import cpu as cpu_launcher

    cores = os.cpu_count() or 1
    alternatives = cpu_alternatives(loaded, model, graph, sched, cost_model, cfg, rewritten, dag)
    report = {"runs": cfg.cpu_runs, "cores": cores, "default": alternatives[0].name, "timed": []}
    built: dict[tuple, tuple[Bundle, dict]] = {}
    busy_before = None
    if len(alternatives) > 1:
        # a machine that others keep busy now cannot replace the default by timing (below): not built, not timed
        with cpu_launcher.OthersLoad() as probe:
            time.sleep(CPU_LOAD_PROBE_S)
        if probe.share is not None and probe.share > CPU_BUSY_SHARE:
            busy_before = probe.share
            alternatives = alternatives[:1]

    def key(alt: CpuAlternative) -> tuple:
        return (id(alt.model), alt.sched.num_streams, tuple(map(tuple, alt.sched.branches)))

    for alt in alternatives:
        if key(alt) not in built:  # checked by the builder only when no launcher loads it (to time or verify it)
            built[key(alt)] = _cpu_scratch_bundle(scratch / str(len(built)), alt, backend, options, loaded, cfg,
                                                  check=len(alternatives) == 1 and not cfg.verify)
    if busy_before is not None:
        chosen = alternatives[0].name
        report.update(chosen=chosen, others_cpu_share=busy_before,
                      decision=(f"the default, not timed: other processes used {busy_before:.0%} of the cores (more than "
                                f"{CPU_BUSY_SHARE:.0%}); a loaded machine's timings do not replace it"))
    elif len(alternatives) == 1:
        chosen = alternatives[0].name
        report.update(chosen=chosen, decision="one alternative: nothing to time")
    else:
        engine_bytes = {k: sum(f.stat().st_size for f in (b.path / "engines").iterdir()) for k, (b, _) in built.items()}
        size = sum(engine_bytes[key(a)] for a in alternatives)  # each alternative's launcher loads its own sessions
        together = size <= CPU_INTERLEAVE_BYTES
        feeds = cpu_launcher.random_feeds(loaded.inputs, seed=cfg.seed)
        groups = [alternatives] if together else [[a] for a in alternatives]
        times: dict = {}
        shares = []
        for group in groups:
            runners = {}
            try:
                for alt in group:
                    runners[alt.name] = cpu_launcher.CpuLauncher(built[key(alt)][0], threads_per_engine=alt.threads)
                with cpu_launcher.OthersLoad() as others:
                    times.update(cpu_launcher.race_calls(runners, feeds, runs=cfg.cpu_runs, behind=2 * CPU_MARGIN))
                shares.append(others.share)
            finally:
                for r in runners.values():
                    r.close()
                runners.clear()  # their sessions (and weights) go now, not with the next group's
        chosen, rows = decide_by_timing(times, [a.name for a in alternatives])
        for alt, row in zip(alternatives, rows):
            row.update(streams=alt.sched.num_streams, sessions=len(alt.sched.branches), threads=alt.threads or cores)
        share = max((x for x in shares if x is not None), default=None)
        busy = share is not None and share > CPU_BUSY_SHARE
        if chosen == alternatives[0].name:
            decision = "the default: no alternative was timed faster beyond the noise"
        elif busy:
            decision = (f"the default: {chosen} was timed faster, but other processes used {share:.0%} of the cores "
                        f"meanwhile (more than {CPU_BUSY_SHARE:.0%}): a loaded machine's timings do not replace it")
            chosen = alternatives[0].name
            for row in rows:
                row["chosen"] = row["alternative"] == chosen
        else:
            decision = f"timed faster than the default ({alternatives[0].name}) beyond the noise"
        report.update(timed=rows, chosen=chosen, margin=f"max({CPU_MARGIN:.0%}, interquartile spread of either)",
                      others_cpu_share=share, decision=decision,
                      loaded=("together, alternating blocks" if together else
                              f"one at a time (their engines {size / 2**20:.0f} MiB together, above {CPU_INTERLEAVE_BYTES >> 20} MiB)"))
    best = next(a for a in alternatives if a.name == chosen)
    kept, best_report = built[key(best)]
    engines = {b.name: (kept.engine_path(b), best_report.get(b.name)) for b in kept.plan.branches}
    return best.model, best.graph, best.sched, best.threads, report, engines


def _cpu_scratch_bundle(dest: Path, alt: CpuAlternative, backend, options: BuildOptions, loaded: LoadedModel,
                        cfg: "BuildConfig", check: bool) -> tuple[Bundle, dict]:
    """The engines of ``alt`` in ``dest``, opened as a bundle to time, with its builder's report (per branch).
    No model.onnx, report or hashed manifest: only the launcher reads it, and only its plan and engines."""
    dest.mkdir()
    plan = make_plan(alt.graph, alt.sched, backend=backend.name, precision=cfg.precision, suffix=backend.suffix,
                     inputs=loaded.inputs, outputs=loaded.outputs)
    # check False: the launcher that times it loads every engine next (its errors name the node there)
    rep = _write_engines(dest, alt.model, alt.graph, plan, backend, replace(options, check=check), "candidate",
                         model_file=False)
    return Bundle(path=dest, manifest={"backend": backend.name, "precision": plan.precision,
                                       "options": _launcher_options(options)}, plan=plan, report={}), rep


def gpu_measure(backend, options: BuildOptions, cost_model, loaded: LoadedModel, *, streams: int | None, max_streams: int,
                precision: str, budget_s: float, runs: int = 100, warmup: int = 10):
    """``measure(model) -> seconds`` for the rewrite search: schedule, build and load the candidate like a
    real bundle (in a scratch folder), replay its CUDA Graph and return the median latency.

    The first model measured (the search measures its input first) stays loaded as the reference; every
    later candidate is timed in alternating blocks with it, and its time is scaled by the reference's
    first median, so that clock changes between measurements do not decide.  ``measure.close()`` frees
    the reference.  None when the backend has no GPU engines or no GPU is present.  The first two models
    (the input and the cost model's best candidate) are always measured, so that a slow load can never
    leave the decision without a rival; after those, once ``budget_s`` is spent, further candidates raise
    MeasureBudgetSpent (the search decides among those measured).
    """
    if not getattr(backend, "gpu", False):
        return None
    from parastream.launcher import cuda_device_count

    if cuda_device_count() < 1:
        return None

    t_made = time.perf_counter()
    deadline = t_made + budget_s
    ref: dict = {}
    calls = [0]  # models asked for so far (the first two are measured whatever the budget)
    planned: dict[int, tuple] = {}  # id(model) -> (model, graph, plan): ``prepare`` plans what ``load`` loads

    def plan_of(model: onnx.ModelProto) -> tuple:
        got = planned.get(id(model))
        if got is not None and got[0] is model:
            return got[1:]
        if model is loaded.model:  # the search measures its input first: the loader's graph
            m, graph = model, loaded.graph
        else:  # the search's exports are shape-inferred and checked already
            m = model if _shapes_known(model) else _infer(model)
            graph = graph_of(m)
        sched, _ = plan_streams(graph, cost_model, streams, max_streams)
        plan = make_plan(graph, sched, backend=backend.name, precision=precision, suffix=backend.suffix,
                         inputs=loaded.inputs, outputs=loaded.outputs)
        planned[id(model)] = (model, m, graph, plan)
        return m, graph, plan

    planned_alternatives: list = []  # queued once, with the input
    log: list[dict] = []  # per model measured: when it started (s after this measurer was made) and its steps

    def load(model: onnx.ModelProto):
        from parastream.launcher.gpu import load_phases

        t_plan = time.perf_counter()
        m, graph, plan = plan_of(model)
        t0 = time.perf_counter()
        la = _scratch_launcher(m, graph, plan, backend, options)
        planned.pop(id(model), None)  # measured once: its plan (and its extracted branches) can go
        log[-1].update(build_s=round(la.t_built - t0, 3), load_s=round(time.perf_counter() - la.t_built, 3),
                       plan_s=round(t0 - t_plan, 3), load_phases_s=load_phases(la))
        return la

    prepared: set[int] = set()  # ids of the models prepared (the build prepares the input before the search runs)

    def prepare(models: list[onnx.ModelProto]) -> dict | None:
        """Start compiling the engines of the next models the search will measure (``measure.lookahead`` ahead,
        in the order it measures them), on every compile worker in the background: a candidate is measured as
        soon as its own engines are compiled while the workers go on with the next ones, and the budget's end
        cancels what has not started.  With the first call (the input first) the alternatives the build will
        time if it keeps the input are queued too, and kept."""
        models = [m for m in models if id(m) not in prepared]
        if not models:
            return None
        prepared.update(id(m) for m in models)
        plans = [(*plan_of(m), options, True) for m in models]
        got = precompile_plans(backend, plans, background=True)
        if got is not None:
            got.pop("keys", None)
        if not planned_alternatives and plans and got is not None and got.get("background") is True:
            planned_alternatives.append(True)
            named = _alternative_plans(plans[0][0], plans[0][1], plans[0][2], backend, options, cost_model, named=True)
            alt = precompile_plans(backend, [a for _, a in named], background=True, cancellable=False)
            keys = alt.pop("keys", None) if alt else None
            if keys is not None and len(keys) == len(named) and models[0] is loaded.model:
                # the input's: timed against it during the search once their engines are in (``time_ready``)
                early.update(plan=plans[0][2], rounds=[], todo=[(what, a, k) for (what, a), k in zip(named, keys)])
            got["alternatives"] = alt
        return got

    early: dict = {}  # the input's alternatives: its plan, the rounds timed, the rest (round, plan tuple, cache keys)

    def time_ready(wait: bool = False) -> None:
        """Time the input's alternatives whose engines are compiled against the input (the reference launcher),
        in ``time_alternatives``'s order, while the search goes on: the build then need not load and time them
        after the search, nor wait for their compiles at its end.  ``wait``: the rest too, waiting for their
        compiles.  A round the alternative wins changes what the later rounds race (the bundle's fusion or
        layout); the build then times them after the search, as for a rewrite chosen."""
        while early.get("todo") and "launcher" in ref and not early.get("stopped"):
            what, (m, graph, plan, opts, nhwc), keys = early["todo"][0]
            if not wait and backend.compiling(keys):
                return
            early["todo"].pop(0)
            t0 = time.perf_counter()
            try:
                other = _scratch_launcher(m, graph, plan, backend, opts, nhwc)
                try:
                    won = _race(early["rounds"], what, ref["launcher"], other, early["plan"], runs, t0)
                finally:
                    other.close()
            except Exception as e:  # noqa: BLE001 - the build times it after the search, where a failure is reported
                early["stopped"] = f"{what}: {type(e).__name__}: {e}"
                return
            early["rounds"][-1]["started_s"] = round(t0 - t_made, 3)
            if won and what != "streams":
                early["stopped"] = f"{what}: the alternative won; the rest are timed after the search"

    def alternatives_timed() -> dict | None:
        """``time_alternatives``'s result for the input's plan from the rounds timed during the search (the rest
        timed now), with that ``plan``; None when they could not all be timed against it."""
        if not early:
            return None
        time_ready(wait=True)
        if early.get("todo") or early.get("stopped") or not early.get("rounds"):
            return None
        one = any(r["choice"] == "streams" and r["won"] == _round_labels("streams", early["plan"])[1]
                  for r in early["rounds"])
        return {"fuse_conv_relu": bool(options.fuse_conv_relu and backend.name == "torch"), "internal_nhwc": True,
                "one_engine": one, "rounds": early["rounds"], "runs": runs, "timed": "during the search",
                "plan": early["plan"]}

    def measure(model: onnx.ModelProto) -> float:
        from parastream.launcher.bench import measure as time_replays

        t_called = time.perf_counter()
        time_ready()  # the input's alternatives whose engines are in, before the next candidate
        if calls[0] >= 2 and time.perf_counter() > deadline:
            raise MeasureBudgetSpent(f"measurement budget of {budget_s:.0f} s spent")
        calls[0] += 1
        log.append({"start_s": round(time.perf_counter() - t_made, 3), "called_s": round(t_called - t_made, 3)})
        la = load(model)
        t0 = time.perf_counter()
        if not ref:
            ms = float(np.median(time_replays({"candidate": la}, runs=runs, warmup=warmup)["candidate"]))
            ref.update(launcher=la, ms=ms)
            log[-1]["time_s"] = round(time.perf_counter() - t0, 3)
            return ms / 1e3
        try:
            times = time_replays({"reference": ref["launcher"], "candidate": la}, runs=runs, warmup=warmup)
        finally:
            la.close()
        log[-1]["time_s"] = round(time.perf_counter() - t0, 3)
        return float(np.median(times["candidate"]) / np.median(times["reference"]) * ref["ms"]) / 1e3

    def close() -> None:
        cancel = getattr(backend, "cancel_precompile", None)
        if cancel is not None:  # what ``prepare`` queued and no measurement needs any more
            cancel()
        if "launcher" in ref:
            ref.pop("launcher").close()

    measure.close = close
    measure.prepare = prepare
    measure.alternatives_timed = alternatives_timed
    measure.lookahead = 4  # models prepared ahead of the one measured (their compiles overlap its measurement)
    measure.log = log
    return measure


class _Progress:
    """Progress on stderr: a rich display on a terminal, one line per stage elsewhere (build logs), or nothing."""

    def __init__(self, enabled: bool, live: bool | None = None):
        import sys

        self.enabled = enabled
        self.live = sys.stderr.isatty() if live is None else live
        self._progress = None
        self._t0 = time.perf_counter()

    def __enter__(self):
        if self.enabled and self.live:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

            self._progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                      TimeElapsedColumn(), console=Console(stderr=True), transient=True)
            self._progress.__enter__()
        return self

    def __exit__(self, *exc):
        if self._progress is not None:
            self._progress.__exit__(*exc)

    def step(self, description: str, total: int = 1):
        if self.enabled and not self.live:
            import sys

            print(f"parastream build: [{time.perf_counter() - self._t0:6.1f} s] {description}", file=sys.stderr, flush=True)
        if self._progress is None:
            return _NullTask()
        return _Task(self._progress, self._progress.add_task(description, total=total))


class _Task:
    def __init__(self, progress, task_id):
        self.progress, self.task_id = progress, task_id

    def advance(self, n: int = 1):
        self.progress.advance(self.task_id, n)


class _NullTask:
    def advance(self, n: int = 1):
        pass


def build(model_path: str | Path, out_dir: str | Path, *, config: BuildConfig | None = None, progress: bool = False,
          **overrides) -> Bundle:
    """Build a deployment bundle for ``model_path`` into ``out_dir``; return it opened.

    Keyword arguments override fields of ``config`` (``build(m, out, backend="onnxruntime", streams=2)``).
    """
    cfg = config or BuildConfig()
    for k, v in overrides.items():
        if not hasattr(cfg, k):
            raise TypeError(f"build() got an unexpected option {k!r}")
        setattr(cfg, k, v)
    out = check_target(out_dir, kind="bundle", force=cfg.force, protect=(model_path,), option="-o")
    if cfg.streams is not None and cfg.streams < 1:
        raise ParastreamError(f"--streams {cfg.streams}: must be at least 1")
    if cfg.batch_buckets and not (cfg.batch and cfg.batch[0] < cfg.batch[2]):
        raise ParastreamError("--batch-buckets needs --batch MIN:OPT:MAX with MIN < MAX")
    backend = resolve_backend(cfg.backend)
    with _Progress(progress) as bar:
        if cfg.batch and cfg.batch[0] < cfg.batch[2]:  # a dynamic batch: one static bundle per batch bucket
            from .buckets import build_buckets

            with staging(out, "bundle") as tmp:  # renamed to OUT at the end of the block, removed on any error
                bundle = build_buckets(model_path, tmp, cfg, backend, bar)
            return replace(bundle, path=out)
        shapes = batch_profiles(model_path, dict(cfg.shapes), tuple(cfg.batch))[0] if cfg.batch else dict(cfg.shapes)
        bundle = build_static(model_path, cfg, backend, bar, shapes, lambda: staging(out, "bundle"))
    return replace(bundle, path=out)


def build_static(model_path, cfg: BuildConfig, backend, bar, shapes: dict[str, list[int]], stage, *,
                 measure_search: bool = True) -> Bundle:
    """The build's stages for static ``shapes``, written into the folder ``stage()`` yields; return it opened.

    ``measure_search`` False: the rewrite search decides by the cost model even on a GPU (the buckets of a
    dynamic-batch build other than the one at OPT)."""
    b = load_and_check(model_path, cfg, backend, bar, shapes)
    rewrite_search(b, measure=measure_search)
    schedule_streams(b)
    with contextlib.ExitStack() as scratch:  # the CPU alternatives' engines, until the bundle has copied the kept one's
        time_cpu_alternatives(b, scratch)
        partition(b)
        with stage() as tmp:  # build(): staging, renamed to OUT at the end of the block, removed on any error
            build_engines(b, tmp)
            scratch.close()
            time_gpu_alternatives(b, tmp)
            write_report(b, tmp)
            verify_bundle(b, tmp)
            return finish(b, tmp)


@dataclass
class _Build:
    """What the stages of one static build hand on: the loaded model (one graph, carried from load to plan) and
    what each stage decides.  ``model``/``graph`` are read only: a stage that changes them makes new ones."""
    cfg: BuildConfig
    backend: object
    bar: object
    loaded: LoadedModel
    options: BuildOptions
    cost_model: object
    device_profile: str
    width: int
    model: onnx.ModelProto
    graph: gs.Graph
    t_start: float
    dag: object = None  # the node DAG of ``graph`` (analysis.node_dag): built once per graph, read by the schedules
    timings: dict = field(default_factory=dict)
    search_report: dict = field(default_factory=lambda: {"enabled": False})
    planned: tuple = (None, None)  # (graph, plan_streams of it) when the search planned it
    sched: Schedule | None = None
    streams_tried: list = field(default_factory=list)
    cpu_threads: object = None
    cpu_choice: dict | None = None
    prebuilt: object = None
    plan: object = None
    engines_report: dict | None = None
    measured: dict | None = None
    timed_alternatives: dict | None = None  # the input's alternatives timed during the search (``gpu_measure``)
    precompiled: dict | None = None  # the engines of the plan and its timed alternatives compiled in one batch
    report: dict | None = None
    manifest: dict | None = None

    @contextlib.contextmanager
    def timed(self, stage: str):
        t0 = time.perf_counter()
        yield
        self.timings[stage] = time.perf_counter() - t0

    def make_plan(self) -> None:
        from parastream.rewrite.cost import node_flops_bytes

        self.plan = make_plan(self.graph, self.sched, backend=self.backend.name, precision=self.cfg.precision,
                              suffix=self.backend.suffix, inputs=self.loaded.inputs, outputs=self.loaded.outputs,
                              flops_bytes=node_flops_bytes)


def load_and_check(model_path, cfg: BuildConfig, backend, bar, shapes) -> _Build:
    """Load the model at ``shapes`` (one graph from here to the plan), check that the backend can run it, and set
    up the cost model and engine options."""
    t0 = time.perf_counter()
    options = BuildOptions(precision=cfg.precision, device="cuda" if backend.gpu else "cpu",
                           workspace_mb=cfg.workspace_mb, optimization_level=cfg.optimization_level,
                           strongly_typed=cfg.strongly_typed, cache_dir=cfg.cache_dir, compile=cfg.compile,
                           profiles={})
    loaded: LoadedModel = load_model(model_path, shapes)
    start_workers = getattr(backend, "start_workers", None)
    if start_workers is not None:  # torch on a GPU: its compile workers start while the model is checked and planned
        start_workers(options)
    check_runnable(loaded, backend, cfg.verify)
    bar.step("load and check").advance()
    from parastream.rewrite.cost import RooflineCostModel

    from .analysis import graph_width

    device_profile = cfg.device or default_device_profile(backend)
    b = _Build(cfg=cfg, backend=backend, bar=bar, loaded=loaded, options=options,
               cost_model=RooflineCostModel(device_profile, precision=cfg.precision), device_profile=device_profile,
               width=graph_width(loaded.graph, loaded.dag)[0], model=loaded.model, graph=loaded.graph, dag=loaded.dag,
               t_start=t0)
    b.timings["load"] = time.perf_counter() - t0
    return b


def rewrite_search(b: _Build, *, measure: bool) -> None:
    """AutoGraph's search over the rewrite rules; on a GPU its top candidates are measured."""
    cfg = b.cfg
    if not cfg.search:
        return
    with b.timed("search"):
        from parastream.rewrite import optimize_graph

        # the search costs candidates on the number of streams the input would get
        b.planned = b.graph, plan_streams(b.graph, b.cost_model, cfg.streams, cfg.max_streams, b.dag)
        measurer = None
        if cfg.measure and measure:
            measurer = gpu_measure(b.backend, b.options, b.cost_model, b.loaded, streams=cfg.streams,
                                   max_streams=cfg.max_streams, precision=cfg.precision, budget_s=cfg.measure_seconds,
                                   runs=cfg.measure_runs)
        before = None
        if measurer is not None:  # the search measures its input first: its engines compile while the search runs
            try:
                before = measurer.prepare([b.model])
            except Exception as e:  # noqa: BLE001 - as in the search: measuring compiles what preparing could not
                before = {"error": f"{type(e).__name__}: {e}"}
        task = b.bar.step("rewrite search" + (" (measuring candidates on the GPU)" if measurer else ""))
        try:
            # the search copies the carried graph and hands back the graph of the model it returns (no import)
            searched, graph, report = optimize_graph(b.model, b.graph, cost_model=b.cost_model,
                                                     streams=b.planned[1][0].num_streams, seed=cfg.seed,
                                                     measure=measurer, **cfg.search_options)
            if measurer is not None and searched is b.model:  # the input kept: its alternatives, timed meanwhile
                b.timed_alternatives = measurer.alternatives_timed()
        finally:
            if measurer is not None:
                measurer.close()
        b.search_report = dict(report, enabled=True)
        if measurer is not None:
            b.search_report["measure_log"] = measurer.log
            b.search_report["prepared_before_search"] = before
            b.search_report["alternatives_timed"] = ((b.timed_alternatives or {}).get("timed")
                                                     or "after the search")
        if graph is not b.graph:
            from .analysis import node_dag

            b.model, b.graph, b.dag = searched, graph, node_dag(graph)
        task.advance()


def schedule_streams(b: _Build) -> None:
    """Streams and a resource-aware launch order (Opara) for the graph as rewritten."""
    with b.timed("schedule"):
        if b.planned[0] is b.graph:  # the search changed nothing: the schedule planned for its stream count is this one
            b.sched, b.streams_tried = b.planned[1]
        else:
            b.sched, b.streams_tried = plan_streams(b.graph, b.cost_model, b.cfg.streams, b.cfg.max_streams, b.dag)


def time_cpu_alternatives(b: _Build, scratch: contextlib.ExitStack) -> None:
    """CPU engines: time the plan against one full-threaded session (of the rewritten and the original model) and
    keep the fastest; the kept alternative's engines are built in a scratch folder that ``scratch`` removes."""
    if b.backend.gpu or not b.cfg.measure:
        return
    with b.timed("cpu_choice"):
        task = b.bar.step("time the CPU alternatives")
        folder = Path(scratch.enter_context(tempfile.TemporaryDirectory(prefix="parastream-cpu-")))
        with running_errors(b.loaded.path, b.loaded.model, "to time the CPU alternatives"):
            b.model, b.graph, b.sched, b.cpu_threads, b.cpu_choice, b.prebuilt = choose_cpu_alternative(
                b.loaded, b.model, b.graph, b.sched, b.backend, b.options, b.cost_model, b.cfg, folder,
                rewritten=bool(b.search_report.get("rules_chosen")), dag=b.dag)
            if b.graph is b.loaded.graph:
                b.dag = b.loaded.dag
        _record_measured_streams(b.streams_tried, b.sched)
        task.advance()


def partition(b: _Build) -> None:
    """The plan: one branch per partition of the schedule, with its stream, waits and boundary tensors."""
    b.make_plan()
    b.plan.cpu_threads = b.cpu_threads


def build_engines(b: _Build, tmp: Path) -> None:
    """One engine per branch, written into the staging folder."""
    with b.timed("engines"):
        task = b.bar.step(f"build {len(b.plan.branches)} {b.backend.name} engines", total=len(b.plan.branches))
        if b.timed_alternatives is not None and _plan_signature(b.timed_alternatives["plan"]) != _plan_signature(b.plan):
            b.timed_alternatives = None  # timed for another plan than this one: timed again below
        if b.cfg.measure and b.backend.gpu and b.prebuilt is None:  # the engines the GPU alternatives load: one batch
            alternatives = [] if b.timed_alternatives is not None else _alternative_plans(
                b.model, b.graph, b.plan, b.backend, b.options, b.cost_model)
            b.precompiled = precompile_plans(b.backend, [(b.model, b.graph, b.plan, b.options, True)] + alternatives)
        b.engines_report = _write_engines(tmp, b.model, b.graph, b.plan, b.backend, b.options, str(b.loaded.path),
                                          task.advance, prebuilt=b.prebuilt)
        b.prebuilt = None


def time_gpu_alternatives(b: _Build, tmp: Path) -> None:
    """GPU engines: time the bundle against its alternatives (fused conv+ReLU or not, channels-last or contiguous
    boundaries, one engine for the whole model), keep each winner and rebuild the engines for it."""
    cfg = b.cfg
    if not (cfg.measure and b.backend.gpu):
        return
    with b.timed("measure_alternatives"):
        task = b.bar.step("time the plan against its alternatives on the GPU")
        fused = b.options.fuse_conv_relu
        if b.timed_alternatives is not None:  # timed against this plan's engines during the search
            measured = {k: v for k, v in b.timed_alternatives.items() if k != "plan"}
            b.options.fuse_conv_relu = measured["fuse_conv_relu"]
        else:
            measured = _measure_alternatives(tmp, b.model, b.graph, b.plan, b.backend, b.options, b.cost_model, cfg,
                                             b.loaded)
        b.measured = measured
        if measured and (measured["one_engine"] or _compiled_for_other_choices(b.backend, fused, measured)):
            if measured["one_engine"]:
                b.sched, _ = plan_streams(b.graph, b.cost_model, 1, 1, b.dag)
                _record_measured_streams(b.streams_tried, b.sched)
                b.make_plan()
            shutil.rmtree(tmp / "engines")
            b.engines_report = _write_engines(tmp, b.model, b.graph, b.plan, b.backend, b.options, str(b.loaded.path),
                                              internal_nhwc=measured["internal_nhwc"])
        task.advance()


def _background_summary(b: _Build) -> dict | None:
    summary = getattr(b.backend, "background_summary", None)
    return summary(b.t_start) if summary is not None else None


def write_report(b: _Build, tmp: Path) -> None:
    """report.json (what was decided, measured and timed) and manifest.json, unhashed until ``finish``."""
    cfg, loaded, sched = b.cfg, b.loaded, b.sched
    b.report = {
        "version": REPORT_VERSION,
        "model": {"path": str(loaded.path), "nodes_in": len(loaded.model.graph.node), "nodes_out": len(b.model.graph.node),
                  "inputs": [asdict(t) for t in loaded.inputs], "outputs": [asdict(t) for t in loaded.outputs]},
        "search": b.search_report,
        "schedule": {"streams": sched.num_streams, "requested_streams": cfg.streams, "graph_width": b.width,
                     "branches": len(b.plan.branches), "critical_path_s": sched.makespan, "total_work_s": sched.total_work,
                     "estimated_s": estimate_latency(sched), "streams_tried": b.streams_tried,
                     "cost_model": f"roofline {b.device_profile} {cfg.precision}"},
        "cpu_choice": b.cpu_choice,
        "engines": b.engines_report,
        "measured_choices": b.measured,
        "precompiled": b.precompiled,
        "background_compiles": _background_summary(b),
        "verification": None,
        "timings": b.timings,
    }
    (tmp / "report.json").write_text(json.dumps(b.report, indent=2, default=str))
    b.manifest = {"parastream": _versions(b.backend), "backend": b.backend.name, "device": _device_description(b.backend),
                  "precision": cfg.precision,
                  "options": {**{k: v for k, v in asdict(cfg).items() if k != "force"}, **_launcher_options(b.options),
                              "internal_nhwc": b.measured["internal_nhwc"] if b.measured else True},
                  "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    write_manifest(tmp, b.manifest, hashed=False)  # verification loads it unchecked; hashed in finish, once


def verify_bundle(b: _Build, tmp: Path) -> None:
    """The bundle as written, loaded as ``parastream run`` loads it, against onnxruntime on the original model."""
    cfg, loaded = b.cfg, b.loaded
    if not cfg.verify:
        return
    with b.timed("verify"):
        task = b.bar.step("verify against onnxruntime")
        from parastream.launcher import load

        loaded_as: dict = {}

        def load_bundle():
            runner = load(tmp, check_hashes=False)
            loaded_as.update(_engines_loaded(runner))
            return runner

        b.model = b.graph = None  # written; only the bundle runs from here
        rtol, atol, scale_tol = resolve_tolerances(cfg.precision, cfg.rtol, cfg.atol, cfg.scale_tol)
        result = run_verification(loaded.path, loaded.original, None, loaded.inputs, rtol=rtol, atol=atol,
                                  scale_tol=scale_tol, seed=cfg.seed + 1, load=load_bundle)
        task.advance()
    b.report["verification"] = dict(result.to_dict(), **loaded_as)
    if not result.passed:
        raise VerificationError(
            f"{loaded.path}: the built deployment does not match onnxruntime on the original model "
            f"({result.failure()}); no bundle was written"
            + ("; --no-verify builds without verification" if result.status == "inconclusive" else ""))


def finish(b: _Build, tmp: Path) -> Bundle:
    """The final report and the hashed manifest; the bundle opened (checked) before it becomes OUT."""
    b.timings["total"] = time.perf_counter() - b.t_start
    b.report["peak_rss_mb"] = _peak_rss_mb()
    (tmp / "report.json").write_text(json.dumps(b.report, indent=2, default=str))
    write_manifest(tmp, b.manifest)
    return Bundle.open(tmp)  # checked before it becomes OUT, which a concurrent --force build may replace


def _peak_rss_mb() -> float | None:
    """The process's peak resident memory so far, in MiB (None where the platform does not say)."""
    try:
        import resource
        import sys

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / (1 << 20) if sys.platform == "darwin" else peak / 1024  # bytes on macOS, KiB on Linux
    except (ImportError, OSError):
        return None
