"""``parastream build``: load and check, rewrite, schedule, build engines, verify, write the bundle.

Nothing reaches OUT until everything succeeded: the bundle is written into a
temporary folder beside OUT and renamed into place at the end.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import onnx
import onnx_graphsurgeon as gs

from parastream.core.lru import SizedLRU, lru_put
from parastream.launcher.bundle import Bundle, write_manifest
from parastream.launcher.engines import BuildOptions, resolve_backend
from parastream.launcher.engines.base import conv_kernels_used
from parastream.launcher.errors import ParastreamError, VerificationError
from parastream.launcher.words import plural

from parastream.rewrite.search import MEASURE_MARGIN, MeasureBudgetSpent  # noqa: F401 - raised by the measurer, caught by the search

from .isolate import Child, in_child
from .measure import (CARRIED_ALWAYS, ORIGINAL_ONE_SESSION, GpuMeasurer, Variant, alternative_variants, carried_rounds,
                      choices_as_built, choose_cpu_alternative, compiled_for_other_choices, cpu_choice_recordable,
                      gpu_present,
                      QueuedRivals, decided_form, gemm_round_first, kernel_tuning_round, plan_signature,
                      rounds_level, speculative_by_round, time_alternatives, TUNING_ROUND, tuned_level)
from .model_io import LoadedModel, batch_profiles, graph_of, load_model, name_nodes, read_model
from .partition import extract_branch, make_plan, side_by_side, spec_of
from .timings import (RecordedMeasurer, plan_digest, read_timings, timings_key, timings_path, write_timings)
from .timings import now as utc_now
from .outdir import check_target, check_writable_folder, staging
from parastream.core.blocks import MAX_COMPILED_SHARE, ends_in_head, split_schedule
from parastream.core.schedule import Schedule, choose_streams, estimate_latency, schedule_graph
from .host_tail import end_to_end
from .verify import ReferenceRun, resolve_tolerances, run_verification, running_errors, verify  # noqa: F401

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
    # --min-shapes/--opt-shapes/--max-shapes: dynamic axes on any input (a grid of static buckets, pipeline/buckets.py)
    min_shapes: dict[str, list[int]] = field(default_factory=dict)
    opt_shapes: dict[str, list[int]] = field(default_factory=dict)
    max_shapes: dict[str, list[int]] = field(default_factory=dict)
    shape_buckets: dict[tuple[str, int], list[int]] = field(default_factory=dict)  # --buckets INPUT:AXIS=sizes
    pads: dict[str, object] = field(default_factory=dict)  # --pad NAME=VALUE: what padded positions of an input hold
    precision: str = "fp32"
    search: bool = True
    search_options: dict = field(default_factory=dict)
    measure: bool = True  # measure the search's top candidates on the GPU when the backend has GPU engines
    # budget for those measurements (each one builds and loads engines; the top-ranked first), from the moment the
    # input is timed (its compile is the build's own: it ships it if no candidate wins): on the H100 each candidate
    # after the input takes ~2-2.5 s ("kernels" engines: Inception-v4 ~2 s, NASNet-A Large ~2.4 s), so 25 s
    # measure 10 or more of the top 20
    measure_seconds: float = 25.0
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
    # with cache_dir on a GPU: time again what an earlier build of the same model recorded (``timings``), and
    # record the new result; else the recorded decisions are taken as they are
    remeasure: bool = False
    compile: bool = True
    # torch engines: what an engine ships and how an "inductor" artifact is saved (docs/torch-engines.md), and the
    # processes that compile them side by side (0: every core but one, at most 16)
    torch_artifact: str = "inductor"
    inductor_format: str = "kernels"
    conv_kernels: str = "auto"  # torch engines: depthwise convolutions as cuDNN calls, Inductor kernels or torch's own (timed)
    cudnn_plans: bool = True  # torch engines on a GPU: depthwise convolutions through cuDNN plans each engine ships
    # a plan on one stream: one engine per repeated block ("blocks": blocks of equal code compile once; core/blocks.py)
    # or one engine for the whole model ("whole"); "auto": blocks where the backend compiles equal code once
    engine_blocks: str = "auto"
    # where a one-stream plan is cut (``engine_blocks``): its classifier head an engine of its own as well
    # (``core.blocks.head_start``), so that the GEMM-epilogue round's rivals compile the head alone
    head_engine: bool = False
    compile_workers: int = 0
    gpu_timing_lock: bool = True  # GPU builds take turns with other processes' timing on the same GPU
    force: bool = False
    keep_fp32: list[str] = field(default_factory=list)  # --keep-fp32: op types, node names, globs built in fp32
    # a model whose output shapes depend on input values: its static part built, the rest (the data-dependent
    # tail) shipped as ONNX and run by ONNX Runtime after each replay (pipeline/host_tail.py); False: an error
    host_tail: bool = True


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
    try:
        described = backend.describe_device()
    except Exception:  # noqa: BLE001 - informational only
        described = None
    if described:
        return str(described)
    from parastream.launcher.engines.base import host_cpu

    return host_cpu()


def default_device_profile(backend) -> str:
    """The cost model's device when --device-profile is not given: this CPU for CPU engines, else an H100."""
    return "H100-SXM" if backend.gpu else "CPU"


def plan_streams(graph: gs.Graph, cost_model, streams: int | None, max_streams: int, *,
                 blocks: bool = False, max_share: float = MAX_COMPILED_SHARE,
                 head: bool = False) -> tuple[Schedule, list[dict]]:
    """The schedule of ``graph``: on ``streams`` streams when given, else the number ``choose_streams`` estimates
    best; with ``blocks``, a one-stream schedule has one engine per repeated block (``core.blocks``) instead of one
    for the whole model where its blocks' distinct code is at most ``max_share`` of its nodes, and with ``head``
    its classifier head one of its own (``core.blocks.head_start``); the chosen row of the table says so."""
    if streams:
        sched = schedule_graph(graph, streams, cost_model.node_cost, cost_model.is_memory_bound)
        est = estimate_latency(sched)
        tried = [{"streams": sched.num_streams, "engines": len(sched.branches), "critical_path_s": sched.makespan,
                  "estimated_s": est, "chosen": True, "requested": streams}]
    else:
        sched, tried = choose_streams(graph, max_streams, cost_model.node_cost, cost_model.is_memory_bound)
    if blocks and sched.num_streams == 1:
        split = split_schedule(sched, graph.nodes, max_share=max_share, head=head)
        if split is not sched:
            row = next(t for t in tried if t["chosen"])
            row["engines"] = len(split.branches)
            by_name = {n.name: n for n in graph.nodes}
            headed = head and ends_in_head([[by_name[nm] for nm in b] for b in split.branches])
            row["engines_are"] = ("repeated blocks" if len(split.branches) > 1 + headed else "the body") + (
                " and the head" if headed else "")
            sched = split
    return sched, tried


def _engine_layouts(plan, backend, options: BuildOptions, internal_nhwc: bool = True):
    """``branch -> keyword arguments for builder.build``: the GPU launcher's tensor layout for builders that
    compile for it (``compiles_for_layout``: torch's Inductor artifacts or AOTInductor packages), so the engine
    compiled is the engine loaded; else nothing."""
    if options.device != "cuda" or not backend.compiles_for_layout:
        return lambda b: {}
    from parastream.launcher.gpu import engine_layouts

    lay = engine_layouts(plan, backend, internal_nhwc=internal_nhwc)
    # an in-place Concat runs no engine in the launcher; it keeps its ONNX for launchers that do not elide it
    return lambda b: {} if b.id in lay.elided else {"layout": lay.branch(b)}


def check_runnable(loaded: LoadedModel, backend, reference: bool, early: Child | None = None, *,
                   own: bool = True) -> None:
    """The backend's own check of the model (``own``) and, when ``reference``, that ONNX Runtime can load the
    original (the verification's reference); in a child process, since ONNX Runtime may crash on a malformed
    model.  ``early``: the reference's check started on the model file as the build began
    (``check_reference_early``), taken where the original is that file as read, else stopped."""
    from parastream.launcher.engines import base
    from parastream.launcher.engines import onnxruntime as ort_engines

    checks = [] if backend.check_model is base.check_model or not own else [(backend.check_model, loaded.model)]
    take_early = reference and early is not None and loaded.original_data is not None
    if reference and backend is not ort_engines and not take_early:
        checks.append((ort_engines.check_model, loaded.original))
    if early is not None and not take_early:
        early.stop()  # (its child's memory and core are not needed meanwhile)
    # ONNX Runtime's checks get the model's bytes serialized here, not in the child: a forked child writing 350 MB
    # of new memory pays a copy-on-write fault per page (2.6 s against 0.7 s for a NASNet-sized model); the
    # original's are the verification's too (``LoadedModel.original_bytes``)
    serialized = [None if check is not ort_engines.check_model else
                  loaded.original_bytes() if model is loaded.original else model.SerializeToString()
                  for check, model in checks]

    def run_checks():
        for (check, model), data in zip(checks, serialized):
            if data is None:
                check(model)
            else:
                check(model, data)

    try:
        if checks:
            in_child(run_checks, what="loading the model into onnxruntime")
        if take_early:
            early.wait()
    except ParastreamError as e:
        raise ParastreamError(f"{loaded.path}: {e}") from None
    finally:
        if early is not None:  # a failure before it was waited for: the first is the one reported (else a no-op)
            early.stop()


def check_reference_early(model_path, cfg, backend, shapes) -> Child | None:
    """The check that ONNX Runtime loads the original model (the verification's reference), started in a child on
    the model file as the build begins, so that it runs while the model loads rather than after: NASNet-A Large's
    355 MB session was ~1.2 s of its front end.  ``check_runnable`` takes its result where the original is the
    file as read (no node renamed, no input shape fixed, no external data); else it checks the original as
    before.  None where the build checks no reference (no verification, ONNX Runtime's own engines, ``shapes``)."""
    from parastream.launcher.engines import onnxruntime as ort_engines

    if not cfg.verify or backend is ort_engines or shapes or not hasattr(os, "fork"):
        return None
    path = Path(model_path)

    def check() -> None:
        data = path.read_bytes()
        model = onnx.ModelProto()
        model.ParseFromString(data)  # (only its node names are read, for an error)
        ort_engines.check_model(model, data)

    return Child(check, what="loading the model into onnxruntime")


EXTRACTED_BYTES = 1 << 30  # at most this much of extracted branches kept (an Inception-v4 plan is ~170 MB)


def _tensor_bytes(t: onnx.TensorProto) -> int:
    """The bytes of an initializer's values, from its header (reading ``raw_data`` copies them)."""
    count = 1
    for d in t.dims:
        count *= int(d)
    try:
        return count * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
    except (KeyError, TypeError, ValueError):  # a type numpy has no dtype for: a byte each is enough for a bound
        return count


class BranchCache:
    """The branches extracted of the plans a build holds, newest last, at most ``max_bytes`` of them: a GPU
    build compiles a plan's engines in a batch before it writes them, the search prepares a candidate before it
    loads it, and the timed alternatives rebuild the same plan with other options.  An entry is found by its
    model (the same object) and its plan's signature (``measure.plan_signature``: the same branches).

    Each branch is also kept by what its extraction reads (``branch_fingerprint``): a candidate's branch whose
    nodes, tensors and weights (by identity) are those of a branch extracted before is that branch, the same
    object, so that its bytes and cache key (``launcher.engines.torch._serialized``, by object) are not made
    again.  The search's candidates share the weight arrays no rewrite changed (``ir.adopt_model(...,
    keep_arrays=True)``) and most branches where a rewrite changed a few pieces (bench/CPU_NOTES.md)."""

    def __init__(self, max_bytes: int | None = None):
        self.max_bytes = EXTRACTED_BYTES if max_bytes is None else max_bytes
        self.entries: list[tuple[onnx.ModelProto, tuple, list[onnx.ModelProto], int]] = []
        # fingerprint -> (the branch, the weight objects the fingerprint names by identity, kept alive, its bytes)
        self.by_fingerprint: SizedLRU = SizedLRU(size=lambda e: e[2])

    def branch(self, model: onnx.ModelProto, graph: gs.Graph, branch, index: dict | None) -> onnx.ModelProto:
        """``extract_branch(model, graph, branch)``, or the branch of the same fingerprint extracted before
        (``index``: ``graph_index(graph)``)."""
        members = branch_members(branch, index)
        key = branch_fingerprint(model, graph, branch, members)
        if key is not None:
            hit = self.by_fingerprint.get(key)
            if hit is not None:
                self.by_fingerprint.move_to_end(key)
                return hit[0]
        out = extract_branch(model, graph, branch)
        if key is not None and out is not model:
            weights = [t._values for n in members for t in n.inputs if isinstance(t, gs.Constant)]
            size = sum(_tensor_bytes(t) for t in out.graph.initializer)
            if size <= self.max_bytes:
                lru_put(self.by_fingerprint, key, (out, weights, size), self.max_bytes)
        return out

    def get(self, model: onnx.ModelProto, plan) -> list[onnx.ModelProto] | None:
        sig = plan_signature(plan)
        for i, (m, s, branches, size) in enumerate(self.entries):
            if m is model and s == sig:
                self.entries.append(self.entries.pop(i))
                return branches
        return None

    def put(self, model: onnx.ModelProto, plan, branches: list[onnx.ModelProto]) -> None:
        # the weights' bytes from their headers, not ``ByteSize()``: protobuf sizes a message by walking all of it
        # (BERT-base: 0.9 s per candidate on a 2-core machine, for a number that only bounds this cache)
        size = sum(_tensor_bytes(t) for b in branches for t in b.graph.initializer)
        if size > self.max_bytes:
            return
        self.entries.append((model, plan_signature(plan), branches, size))
        while sum(e[3] for e in self.entries) > self.max_bytes:
            self.entries.pop(0)


class _NoFingerprint(Exception):
    pass


def _attr_key(value):
    """An attribute as its fingerprint holds it: plain values only (a tensor or graph attribute: none)."""
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return (type(value).__name__, value)
    if isinstance(value, (list, tuple)) and all(isinstance(v, (bool, int, float, str, bytes)) for v in value):
        return ("list", tuple((type(v).__name__, v) for v in value))
    raise _NoFingerprint


def _tensor_key(t: gs.Tensor) -> tuple:
    """A tensor as ``gs.export_onnx`` writes it: a weight by its values object (identity: the search's candidates
    share the arrays of the weights no rewrite changed, and a rewrite makes new ones), a variable by its type."""
    shape = None if t.shape is None else tuple(t.shape)
    if isinstance(t, gs.Constant):
        return ("C", t.name, id(t._values), str(t.dtype), shape, str(t.data_location), str(t.export_dtype))
    if type(t) is not gs.Variable:
        raise _NoFingerprint
    return ("V", t.name, str(t.dtype), shape, t.type)


def graph_index(graph: gs.Graph) -> dict[str, tuple[int, gs.Node]] | None:
    """``graph``'s nodes by name with their positions, or None where two nodes share a name (no fingerprints)."""
    index = {n.name: (i, n) for i, n in enumerate(graph.nodes)}
    return index if len(index) == len(graph.nodes) else None


def branch_members(branch, index: dict | None) -> list[gs.Node] | None:
    """The branch's nodes in the graph's order (as ``extract_branch`` takes them), or None (a name not there)."""
    if index is None or any(name not in index for name in branch.nodes):
        return None
    return [index[name][1] for name in sorted(set(branch.nodes), key=lambda name: index[name][0])]


def branch_fingerprint(model: onnx.ModelProto, graph: gs.Graph, branch, members: list[gs.Node] | None) -> tuple | None:
    """What ``extract_branch(model, graph, branch)`` reads, as a key: the model's IR version and opsets, the
    graph's name and opset, the branch's name and boundary, and its nodes (``members``: in the graph's order)
    with their types, attributes and tensors (weights by identity); None where that cannot be said (no
    members, a tensor or subgraph attribute, local functions).  Not ``ir.GraphHasher``'s hash: that one leaves
    the names out (the branch's bytes hold them) and reads every weight's values, which is what this avoids."""
    if members is None or graph.functions:
        return None
    try:
        body = tuple((n.op, n.domain, n.name, tuple((k, _attr_key(v)) for k, v in n.attrs.items()),
                      tuple(_tensor_key(t) for t in n.inputs), tuple(_tensor_key(t) for t in n.outputs))
                     for n in members)
    except _NoFingerprint:
        return None
    return (model.ir_version, tuple((o.domain, o.version) for o in model.opset_import), graph.name, graph.opset,
            branch.name, tuple(branch.inputs), tuple(branch.outputs), body)


def branches_of(model: onnx.ModelProto, graph: gs.Graph, plan, cache: BranchCache | None = None) -> list[onnx.ModelProto]:
    """Each branch of ``plan`` extracted from ``model`` (``extract_branch``), once per ``cache`` (the build's:
    also a branch whose fingerprint it has seen, ``BranchCache.branch``).  Callers never change the protos
    they get."""
    hit = cache.get(model, plan) if cache is not None else None
    if hit is not None:
        return hit
    if cache is None:
        return [extract_branch(model, graph, b) for b in plan.branches]
    index = graph_index(graph)
    out = [cache.branch(model, graph, b, index) for b in plan.branches]
    cache.put(model, plan, out)
    return out


def _write_engines(dest: Path, model: onnx.ModelProto, graph: gs.Graph, plan, backend, options: BuildOptions,
                   label: str, on_branch=None, internal_nhwc: bool = True, prebuilt: dict | None = None,
                   model_file: bool = True, sink: dict | None = None, cache: BranchCache | None = None) -> dict:
    """model.onnx, plan.json and one engine per branch into ``dest``; return the builder's report.

    Engines that are compiled for the launcher's tensor layout (torch) are compiled for the layout a
    launcher of this plan uses with ``internal_nhwc`` (what manifest.json will say).  ``prebuilt``:
    {branch name: (engine file, builder report)} of this same plan, built already (the CPU alternative kept).
    ``sink``: a dict that gets each engine's bytes by file name instead of ``dest`` (a scratch bundle in memory)."""
    # what model.onnx holds for the engines stays out of them (``slim_engine``: a torch engine's ONNX weights)
    initializers = {t.name: t for t in model.graph.initializer} if sink is None and model_file else {}
    held = initializers.get
    if prebuilt is not None and set(prebuilt) == {b.name for b in plan.branches}:
        (dest / "engines").mkdir(exist_ok=True)
        onnx.save(model, dest / "model.onnx")
        plan.save(dest / "plan.json")
        for b in plan.branches:
            (dest / b.engine).write_bytes(backend.slim_engine(Path(prebuilt[b.name][0]).read_bytes(), held))
            if on_branch:
                on_branch()
        return {name: rep for name, (_, rep) in prebuilt.items() if rep is not None}
    if sink is None:
        (dest / "engines").mkdir(exist_ok=True)
        if model_file:
            onnx.save(model, dest / "model.onnx")
        plan.save(dest / "plan.json")
    builder = backend.Builder(options)
    layouts = _engine_layouts(plan, backend, options, internal_nhwc)
    try:
        if backend.builds_side_by_side:  # torch: compiles its branches side by side
            with _naming_failures(label, backend, None):
                datas = builder.build_all([(br, b.name, layouts(b).get("layout"))
                                           for br, b in zip(branches_of(model, graph, plan, cache), plan.branches)])
        for i, b in enumerate(plan.branches):
            if backend.builds_side_by_side:
                data = datas[i]
            else:
                with _naming_failures(label, backend, b):
                    data = builder.build(extract_branch(model, graph, b), b.name, **layouts(b))
            if sink is not None:
                sink[b.engine] = data
            else:
                (dest / b.engine).write_bytes(backend.slim_engine(data, held) if model_file else data)
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
    why: dict[str, int] = {}
    for e in engines:
        reason = getattr(e, "compiled_at_load_because", "") or ("unknown" if e.compiled_at_load else "")
        if reason:
            why[reason] = why.get(reason, 0) + 1
    failed = {}  # engines whose compile at load failed too: they run uncompiled (``TorchEngine.warm``)
    for e in engines:
        if getattr(e, "compile_error", None):
            failed[e.compile_error] = failed.get(e.compile_error, 0) + 1
    return {"engines_loaded": len(engines), "engines_compiled_at_load": sum(bool(e.compiled_at_load) for e in engines),
            **({"compiled_at_load_because": why} if why else {}), **({"engines_uncompiled": failed} if failed else {})}


def engine_blocks(cfg: BuildConfig, backend) -> bool:
    """Whether a one-stream plan of this build has one engine per repeated block (``BuildConfig.engine_blocks``):
    "auto" cuts where the backend compiles blocks of equal code once (torch: Inductor's artifact reused by code);
    TensorRT and ONNX Runtime optimize a whole model best as one engine or session."""
    if cfg.engine_blocks not in ("auto", "blocks", "whole"):
        raise ParastreamError(f"engine_blocks={cfg.engine_blocks!r}: use auto, blocks or whole")
    if cfg.engine_blocks == "auto":
        return backend.compiles_repeats_once
    return cfg.engine_blocks == "blocks"


def engine_options(cfg: BuildConfig, backend) -> BuildOptions:
    """The engine options of a build of ``cfg`` with ``backend`` (manifest.json records them, ``_launcher_options``).
    A GPU build that measures compiles at ``rounds_level`` until its last round races the level asked for
    (``race_kernel_tuning``)."""
    tuned_last = cfg.measure and cfg.compile and backend.gpu
    level = rounds_level(backend, cfg.optimization_level) if tuned_last else cfg.optimization_level
    return BuildOptions(precision=cfg.precision, device="cuda" if backend.gpu else "cpu",
                        workspace_mb=cfg.workspace_mb, optimization_level=level,
                        strongly_typed=cfg.strongly_typed, cache_dir=cfg.cache_dir, compile=cfg.compile,
                        profiles={}, torch_artifact=cfg.torch_artifact, inductor_format=cfg.inductor_format,
                        conv_kernels=cfg.conv_kernels, cudnn_plans=cfg.cudnn_plans,
                        compile_workers=cfg.compile_workers, gpu_timing_lock=cfg.gpu_timing_lock,
                        keep_fp32=list(cfg.keep_fp32))


def _launcher_options(options: BuildOptions) -> dict:
    """The builder options a launcher reads back from manifest.json (``Bundle.engine_options``)."""
    return {"compile": options.compile, "optimization_level": options.optimization_level,
            "fuse_conv_relu": options.fuse_conv_relu, "conv_relu_unfused": list(options.conv_relu_unfused),
            "conv_channels_padded": list(options.conv_channels_padded),
            "fuse_attention": options.fuse_attention,
            "conv_kernels": options.conv_kernels, "cudnn_plans": options.cudnn_plans,
            "fuse_gemm_epilogue": options.fuse_gemm_epilogue,
            "torch_artifact": options.torch_artifact,
            "inductor_format": options.inductor_format}


def _record_measured_streams(streams_tried: list[dict], sched: Schedule) -> None:
    """Timing chose ``sched``: the table of stream counts says so (the row chosen, marked measured)."""
    chosen = [t for t in streams_tried if t.get("chosen")]
    if len(chosen) == 1 and chosen[0]["streams"] == sched.num_streams and chosen[0].get("engines") == len(sched.branches):
        return
    for t in streams_tried:
        t["chosen"] = False
    streams_tried.append({"streams": sched.num_streams, "engines": len(sched.branches), "chosen": True, "measured": True})


@dataclass
class _ScratchBundle(Bundle):
    """A bundle to load and time whose engines stay in memory: the search loads one per candidate, and writing
    then reading back every engine (330 MB for Inception-v4) cost more than building them from the cache."""

    engines: dict = field(default_factory=dict)

    def engine_bytes(self, branch) -> bytes:
        return self.engines[branch.engine]


class _EnginesAsCompiled:
    """A scratch bundle's engine bytes by file name, each built (packed from the compiled-branch cache, waiting for
    its compile) when the launcher asks for it: ``Engines.launcher`` where the backend builds side by side, warms
    engines after their load, and would compile none of ``v``'s branches itself but wait for some compiling in
    the background (``Builder.waits_for_background``).  ``wait_s``: the seconds spent building, waits included."""

    def __init__(self, backend, builder, items: dict):
        self.backend, self.builder, self.items = backend, builder, items
        self.wait_s = 0.0

    @classmethod
    def of(cls, maker: "Engines", v: Variant) -> "_EnginesAsCompiled | None":
        backend = maker.backend
        if not (backend.builds_side_by_side and backend.warms_after_load and backend.background_compiles):
            return None
        builder = backend.Builder(v.options)
        items = maker.build_items(v)
        try:
            waits = builder.waits_for_background(items)
        except Exception:  # noqa: BLE001 - built all at once instead, where the failure is reported by branch
            waits = False
        if not waits:
            builder.close()
            return None
        return cls(backend, builder, {b.engine: (item, b) for item, b in zip(items, v.plan.branches)})

    def __getitem__(self, engine: str) -> bytes:
        item, b = self.items[engine]
        t0 = time.perf_counter()
        try:
            with _naming_failures("candidate", self.backend, b):
                return self.builder.build_all([item])[0]
        finally:
            self.wait_s += time.perf_counter() - t0

    def close(self) -> None:
        self.builder.close()


@dataclass
class Engines:
    """Plans, builds and loads engines for one build: the bundle's and the variants measurement times
    (``measure.EngineMaker``); owns the build's cache of extracted branches."""

    backend: object
    cost_model: object
    loaded: LoadedModel
    precision: str
    branches: BranchCache = field(default_factory=lambda: BranchCache())
    blocks: bool = False  # a one-stream plan has one engine per repeated block (``plan_streams``)
    head: bool = False  # ... and one for its classifier head (``BuildConfig.head_engine``)
    # (the graph last scheduled, its schedules by arguments): ``schedule``
    _scheduled: tuple = field(default_factory=lambda: (None, {}), repr=False, compare=False)
    _input_cut: bool | None = field(default=None, repr=False, compare=False)  # ``input_cut_in_blocks``, once
    # rounds of ``time_alternatives`` decided before anything compiled (``measure.decided_first``): the conv+ReLU
    # round on the shapes timed alone (``time_fused_conv_shapes``), its rival never compiled
    decided_first: dict = field(default_factory=dict, repr=False, compare=False)

    def plan_of_schedule(self, graph: gs.Graph, sched: Schedule):
        return make_plan(graph, sched, backend=self.backend.name, precision=self.precision, suffix=self.backend.suffix,
                         inputs=self.loaded.inputs, outputs=self.loaded.outputs)

    def plan(self, graph: gs.Graph, streams: int | None, max_streams: int):
        """``graph`` scheduled on ``streams`` (else the count ``choose_streams`` estimates best) and planned."""
        return self.plan_of_schedule(graph, self.schedule(graph, streams, max_streams)[0])

    def schedule(self, graph: gs.Graph, streams: int | None, max_streams: int, *,
                 whole: bool = False) -> tuple[Schedule, list[dict]]:
        """``plan_streams`` of ``graph`` with this build's engines per one-stream plan (``whole``: one engine for
        the whole model, the "engine blocks" round's rival and winner).  The last graph's schedules are kept: the
        search schedules its input for the stream count it costs candidates on, and its measurement plans the same
        graph again (NASNet-A Large: 8 stream counts tried, ~0.4 s before the input's compile could start); each
        call gets its own copy of the rows tried, which the build annotates."""
        key = (streams, max_streams, whole)
        cut = self.blocks and not whole
        # a rewritten graph is cut as its input is: where the input's one-stream plan is cut into blocks, so is
        # the rewritten graph's wherever its blocks repeat, whatever share of its nodes their code is
        share = 1.0 if cut and graph is not self.loaded.graph and self.input_cut_in_blocks() else MAX_COMPILED_SHARE
        if self._scheduled[0] is not graph:
            self._scheduled = (graph, {})
        got = self._scheduled[1].get(key)
        if got is None:
            got = self._scheduled[1][key] = plan_streams(graph, self.cost_model, streams, max_streams,
                                                         blocks=cut, max_share=share, head=cut and self.head)
        return got[0], [dict(row) for row in got[1]]

    def input_cut_in_blocks(self) -> bool:
        """Whether the input's graph on one stream is cut into repeated blocks (``core.blocks.split_schedule``).

        Why a rewritten graph follows it: a rewrite changes every block of a repeat alike, but it can shrink the
        blocks more than the code that does not repeat, so that the blocks' share of the nodes crosses
        ``MAX_COMPILED_SHARE`` where the input's did not.  ConvNeXt-T's input (292 nodes) is cut into 19 engines,
        its blocks' distinct code 49% of its nodes; each of the search's candidates (GEMM epilogues fused, 166-170
        nodes) holds 52-53% and was planned as one engine, so that every candidate measured was a whole-model
        compile (9-24 s each on the H200 host, the compile workers busy) where its blocks compile once and the
        blocks no rewrite changed are the input's.  The "engine blocks" round then races the kept candidate's
        blocks against one engine for the whole model (``measure.races_whole_engine``), as it does the input's."""
        if self._input_cut is None:
            graph = self.loaded.graph
            self._input_cut = (graph is not None
                               and len(plan_streams(graph, self.cost_model, 1, 1, blocks=True)[0].branches) > 1)
        return self._input_cut

    def one_stream_plan(self, graph: gs.Graph, plan, *, whole: bool = False):
        """``plan``'s graph on one stream (the rival ``time_alternatives`` times a multi-stream plan against): one
        engine, or one per repeated block where this build cuts one-stream plans so; ``whole``: one engine."""
        return make_plan(graph, self.schedule(graph, 1, 1, whole=whole)[0], backend=plan.backend,
                         precision=plan.precision, suffix=self.backend.suffix, inputs=plan.inputs, outputs=plan.outputs)

    def whole_engine_plan(self, graph: gs.Graph, plan):
        """``plan``'s graph as one engine for the whole model (the rival of a plan cut into repeated blocks)."""
        return self.one_stream_plan(graph, plan, whole=True)

    def branch_models(self, v: Variant) -> list[onnx.ModelProto]:
        """``v``'s branches as its engines are compiled from (``branches_of``, the build's branch cache)."""
        return branches_of(v.model, v.graph, v.plan, self.branches)

    def side_by_side(self, branches: list[onnx.ModelProto]) -> tuple[onnx.ModelProto, gs.Graph, object]:
        """Extracted branches of a plan as one model (``partition.side_by_side``), planned one engine per branch on
        one stream in the order given, their boundary tensors the plan's inputs and outputs: what a round times a
        sample of a plan's engines with, in one launcher (``measure.depthwise_sample``)."""
        return self._own_plan(branches, side_by_side(branches), [0] * len(branches))

    def _own_plan(self, branches: list[onnx.ModelProto], model: onnx.ModelProto, streams: list[int],
                  bound: list[str] | None = None, times: list[float] | None = None) -> tuple[onnx.ModelProto, gs.Graph, object]:
        """``model`` (``branches`` put together, in launch order) planned one engine per branch, branch ``k`` on
        stream ``streams[k]`` (numbered from 0 in order of first use), its inputs and outputs the plan's."""
        graph = graph_of(model)
        members = [[n.name for n in b.graph.node] for b in branches]
        produced = {o: i for i, b in enumerate(branches) for n in b.graph.node for o in n.output}
        preds = [sorted({produced[t] for n in b.graph.node for t in n.input if produced.get(t, i) != i})
                 for i, b in enumerate(branches)]
        if any(p >= i for i, ps in enumerate(preds) for p in ps):
            raise ValueError("side_by_side: a branch comes before a branch whose output it reads")
        k = len(branches)
        sched = Schedule(num_streams=len(set(streams)), node_stream={n: s for m, s in zip(members, streams) for n in m},
                         branches=members, branch_stream=list(streams), launch_order=list(range(k)),
                         branch_bound=bound or ["compute"] * k, branch_time=times or [0.0] * k, makespan=0.0,
                         total_work=0.0, branch_preds=preds)
        return model, graph, make_plan(graph, sched, backend=self.backend.name, precision=self.precision,
                                       suffix=self.backend.suffix, inputs=[spec_of(t) for t in graph.inputs],
                                       outputs=[spec_of(t) for t in graph.outputs])

    def window(self, v: Variant, ids: list[int]) -> tuple[onnx.ModelProto, gs.Graph, object]:
        """Branches ``ids`` of ``v``'s plan (consecutive in its launch order) as a plan of their own: their engines
        on the plan's streams, in its launch order, a tensor one of them writes and only they read an internal
        boundary, the rest (read from before the window, or after it) the window's inputs and outputs.  What the
        "boundary layout" round times a sample with (``measure.layout_sample``): unlike ``side_by_side``'s, its
        boundaries between engines are laid out as the plan's are."""
        plan = v.plan
        at = {b: k for k, b in enumerate(plan.launch_order)}
        ids = sorted(ids, key=at.__getitem__)
        every = self.branch_models(v)
        branches = [every[i] for i in ids]
        inside = set(ids)
        read_outside = {t for b in plan.branches if b.id not in inside for t in b.inputs} | {t.name for t in plan.outputs}
        kept = {o.name for b in branches for o in b.graph.output if o.name in read_outside}
        streams = list(dict.fromkeys(plan.branches[i].stream for i in ids))  # renumbered in order of first use
        return self._own_plan(branches, side_by_side(branches, outputs=kept),
                              [streams.index(plan.branches[i].stream) for i in ids],
                              [plan.branches[i].bound for i in ids], [plan.branches[i].est_time for i in ids])

    def manifest_of(self, v: Variant) -> dict:
        """What a launcher reads of manifest.json to load ``v``'s engines."""
        return {"backend": self.backend.name, "precision": v.plan.precision,
                "options": dict(_launcher_options(v.options), internal_nhwc=v.internal_nhwc)}

    def write(self, dest: Path, v: Variant, label: str, *, model_file: bool = True, **kw) -> dict:
        """model.onnx (``model_file``), plan.json and one engine per branch of ``v`` into ``dest`` (``_write_engines``)."""
        return _write_engines(dest, v.model, v.graph, v.plan, self.backend, v.options, label,
                              internal_nhwc=v.internal_nhwc, model_file=model_file, cache=self.branches, **kw)

    def launcher(self, v: Variant):
        """A GpuLauncher of ``v`` built like a real bundle, its engines in memory (paths named under a scratch folder).

        Where some of its engines are still compiling in the background (the search's input, asked for as soon as
        the search has its candidates), each is packed as the launcher comes to load it (``_EnginesAsCompiled``),
        so the launcher loads and warms the engines compiled so far while the rest compile: a torch engine's
        warm-up is where cuDNN plans its convolutions (NASNet-A Large's input, H200: loaded in 6.4 s, 5.9 of them
        warm-up, after a 19.5 s wait for its compiles)."""
        from parastream.launcher.gpu import GpuLauncher

        dest = Path(tempfile.gettempdir()) / "parastream-measure-engines"  # named only: nothing is written there
        t0 = time.perf_counter()
        as_compiled = _EnginesAsCompiled.of(self, v)
        engines = as_compiled if as_compiled is not None else {}
        if as_compiled is None:
            self.write(dest, v, "candidate", sink=engines)
        bundle = _ScratchBundle(path=dest, manifest=self.manifest_of(v), plan=v.plan, report={}, engines=engines)
        t_built = time.perf_counter()
        try:
            la = GpuLauncher(bundle)
        finally:
            if as_compiled is not None:
                as_compiled.close()
        # when its engines were built (the search's measurement log); built as they were loaded, the seconds spent
        # building and waiting for them count as building
        la.t_built = t0 + as_compiled.wait_s if as_compiled is not None else t_built
        return la

    def precompile(self, variants: list[Variant], background: bool = False, cancellable: bool = True,
                   order: str = "auto", label: str = "") -> dict | None:
        """Compile the engines of several variants in one batch of the backend's compile workers (``precompile``);
        the engine writes that follow are cache hits (or wait for the branch, when ``background`` left it
        compiling).  None when the backend compiles nothing for a layout."""
        if not self.backend.compiles_for_layout:
            return None
        batches = [(self.backend.Builder(v.options), self.build_items(v)) for v in variants]
        return self.backend.precompile(batches, background=background, cancellable=cancellable, order=order,
                                       label=label)

    def build_items(self, v: Variant) -> list[tuple[onnx.ModelProto, str, dict | None]]:
        """``v``'s branches as a builder's ``build_all`` takes them: (branch model, name, the launcher's layout
        for it, where the backend compiles for one)."""
        layouts = _engine_layouts(v.plan, self.backend, v.options, v.internal_nhwc)
        return [(br, b.name, layouts(b).get("layout")) for br, b in zip(self.branch_models(v), v.plan.branches)]


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
    if cfg.cache_dir:
        check_writable_folder(cfg.cache_dir, "--cache-dir")
    if cfg.streams is not None and cfg.streams < 1:
        raise ParastreamError(f"--streams {cfg.streams}: must be at least 1")
    ranged = bool(cfg.min_shapes or cfg.opt_shapes or cfg.max_shapes)
    if cfg.batch_buckets and not (cfg.batch and cfg.batch[0] < cfg.batch[2]):
        raise ParastreamError("--batch-buckets needs --batch MIN:OPT:MAX with MIN < MAX")
    if (cfg.shape_buckets or cfg.pads) and not ranged:
        raise ParastreamError(f"{'--buckets' if cfg.shape_buckets else '--pad'} needs dynamic axes: give "
                              "--min-shapes and --max-shapes")
    if ranged and not (cfg.min_shapes and cfg.max_shapes):
        raise ParastreamError("--min-shapes, --opt-shapes and --max-shapes go together: give at least --min-shapes "
                              "and --max-shapes")
    backend = resolve_backend(cfg.backend)
    bucketed = ranged or bool(cfg.batch and cfg.batch[0] < cfg.batch[2])
    if bucketed:
        # buckets of one static shape each: a data-dependent tail's outputs have no batch or axis to bucket them
        # by, so such a model is the one-line error that names its node (pipeline/host_tail.py)
        cfg = replace(cfg, host_tail=False)
    with _Progress(progress) as bar, _static_batch_for_a_tail(bucketed, "--min-shapes/--max-shapes" if ranged else "--batch"):
        if ranged:  # dynamic shapes on named axes: one static bundle per bucket of the grid
            from .buckets import build_grid

            with staging(out, "bundle") as tmp:
                bundle = build_grid(model_path, tmp, cfg, backend, bar, build_static)
            return replace(bundle, path=out)
        if cfg.batch and cfg.batch[0] < cfg.batch[2]:  # a dynamic batch: one static bundle per batch bucket
            from .buckets import build_buckets

            with staging(out, "bundle") as tmp:  # renamed to OUT at the end of the block, removed on any error
                bundle = build_buckets(model_path, tmp, cfg, backend, bar, build_static)
            return replace(bundle, path=out)
        shapes = batch_profiles(model_path, dict(cfg.shapes), tuple(cfg.batch))[0] if cfg.batch else dict(cfg.shapes)
        bundle = build_static(model_path, cfg, backend, bar, shapes, lambda: staging(out, "bundle"))
    return replace(bundle, path=out)


@contextlib.contextmanager
def _static_batch_for_a_tail(bucketed: bool, option: str):
    """A bucketed build of a model with data-dependent shapes: its error says that one static shape builds it."""
    from .model_io import DataDependentShape

    try:
        yield
    except DataDependentShape as e:
        if not bucketed:
            raise
        raise DataDependentShape(f"{e}; or build it at one static shape (without {option}): its data-dependent part "
                                 "then runs after each replay", nodes=e.nodes) from None


def build_static(model_path, cfg: BuildConfig, backend, bar, shapes: dict[str, list[int]], stage, *,
                 measure_search: bool = True, final: bool = True) -> "Bundle | _Build":
    """The build's stages for static ``shapes``, written into the folder ``stage()`` yields; return it opened.

    ``measure_search`` False: the rewrite search decides by the cost model even on a GPU (the buckets of a
    dynamic-batch build other than the one at OPT).  ``final`` False: the verified build's state, its report
    and manifest complete but not written over the staging ones (a dynamic-batch build adds its buckets to them
    and writes them once, ``buckets.build_buckets``)."""
    b = load_and_check(model_path, cfg, backend, bar, shapes)
    with reference_ahead(b):
        return _build_loaded(b, stage, measure_search=measure_search, final=final)


def _build_loaded(b: "_Build", stage, *, measure_search: bool, final: bool) -> "Bundle | _Build":
    """``build_static``'s stages after the load."""
    time_fused_conv_shapes(b)
    rewrite_search(b, measure=measure_search)
    schedule_streams(b)
    with contextlib.ExitStack() as scratch:  # the CPU alternatives' engines, until the bundle has copied the kept one's
        time_cpu_alternatives(b, scratch)
        with b.timed("plan"):
            partition(b)
            take_recorded_choices(b)
        with stage() as tmp:  # build(): staging, renamed to OUT at the end of the block, removed on any error
            build_engines(b, tmp)
            scratch.close()
            time_gpu_alternatives(b, tmp)
            with b.timed("write"):
                write_report(b, tmp)
            verify_bundle(b, tmp)
            record_timings(b)
            return finish(b, tmp) if final else complete(b)


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
    conv_shapes: dict | None = None  # the fused convolutions' shapes timed alone (``time_conv_shapes``)
    timed_alternatives: dict | None = None  # the input's alternatives timed during the search (``GpuMeasurer``)
    one_engine_timed: dict | None = None  # the kept candidate ran faster as one engine in the search (its times)
    # the engines of the plan and its timed alternatives, compiled in one batch or (with background compiles) the
    # plan queued first and the alternatives after it, round by round (``rivals``: "rivals" in the report's entry)
    precompiled: dict | None = None
    rivals: QueuedRivals | None = None
    report: dict | None = None
    manifest: dict | None = None
    # with --cache-dir on a GPU (``timings``): the record's file, the record read from it (None: time everything),
    # the digest of the plan the rounds were timed on, what was taken from it
    timings_file: Path | None = None
    recorded: dict | None = None
    measured_plan: str | None = None
    taken: dict = field(default_factory=dict)
    timed_here: bool = False  # something was timed on the GPU by this build, or decided on the CPU (and is recorded)
    search_kept_input: bool = False  # a CPU build's search kept the loaded model (recorded: a rebuild need not search)
    reference: ReferenceRun | None = None  # the verification's reference, running while the build goes on
    engines: Engines | None = None  # plans, builds and loads engines (the bundle's and those measurement times)

    def __post_init__(self):
        if self.engines is None:
            self.engines = Engines(self.backend, self.cost_model, self.loaded, self.cfg.precision,
                                   blocks=engine_blocks(self.cfg, self.backend), head=self.cfg.head_engine)

    @contextlib.contextmanager
    def timed(self, stage: str):
        t0 = time.perf_counter()
        yield
        self.timings[stage] = time.perf_counter() - t0

    def stage_seconds(self) -> dict[str, float]:
        """Seconds per stage run so far, in the order they ran (``timings`` less the total)."""
        return {k: round(v, 3) for k, v in self.timings.items() if k != "total"}

    def make_plan(self) -> None:
        from parastream.rewrite.cost import node_flops_bytes

        self.plan = make_plan(self.graph, self.sched, backend=self.backend.name, precision=self.cfg.precision,
                              suffix=self.backend.suffix, inputs=self.loaded.inputs, outputs=self.loaded.outputs,
                              flops_bytes=node_flops_bytes)


def load_and_check(model_path, cfg: BuildConfig, backend, bar, shapes) -> _Build:
    """Load the model at ``shapes`` (one graph from here to the plan), check that the backend can run it, and set
    up the cost model and engine options."""
    t0 = time.perf_counter()
    options = engine_options(cfg, backend)
    if backend.background_compiles:  # torch on a GPU: its compile workers start while the model loads, is checked
        backend.start_workers(options)  # and planned (each spawns and imports torch and Inductor: seconds)
    early = check_reference_early(model_path, cfg, backend, shapes)
    try:
        loaded: LoadedModel = load_model(model_path, shapes, host_tail=cfg.host_tail)
        timings_file, recorded = open_timings(cfg, backend, loaded)
    except BaseException:
        backend.stop_workers()  # a model that does not load: its one-line error, without waiting for them
        if early is not None:
            early.stop()
        raise
    # ONNX Runtime's load of the original is checked up front, before anything is compiled, unless an earlier
    # build of this very structure with this code recorded its timings (it loaded it then; the verification
    # loads it again at the end): on a 2-core machine the check was 4.5 s of BERT-base's 9.5 s front end.  So is
    # the backend's own check (onnxruntime's engines: the loaded model in a session; NASNet-A Large's CPU
    # rebuild, 2.5 s of 11.5 s): the recording build's engines of this structure loaded, and this one's are
    # loaded by its verification
    loaded_before = cfg.verify and recorded is not None
    check_runnable(loaded, backend, cfg.verify and not loaded_before, early, own=not loaded_before)
    bar.step("load and check").advance()
    from parastream.rewrite.cost import RooflineCostModel

    from .analysis import graph_width

    device_profile = cfg.device or default_device_profile(backend)
    b = _Build(cfg=cfg, backend=backend, bar=bar, loaded=loaded, options=options,
               cost_model=RooflineCostModel(device_profile, precision=cfg.precision), device_profile=device_profile,
               width=graph_width(loaded.graph)[0], model=loaded.model, graph=loaded.graph, t_start=t0)
    b.timings["load"] = time.perf_counter() - t0
    b.timings_file, b.recorded = timings_file, recorded
    return b


def runs_reference_ahead(b: "_Build") -> bool:
    """Whether the verification's reference runs during the build (``ReferenceRun``): a build that verifies, on
    a GPU, where the build's own work is on the GPU and in compile workers.  A CPU build times its alternatives
    on the CPU's cores, which a reference running beside them would disturb."""
    return bool(b.cfg.verify) and gpu_present(b.backend)


def reference_ahead(b: "_Build") -> contextlib.AbstractContextManager:
    """``b.reference`` started where ``runs_reference_ahead``, as the block it runs during."""
    if not runs_reference_ahead(b):
        return contextlib.nullcontext()
    b.reference = ReferenceRun(b.loaded.original, b.loaded.inputs, seed=b.cfg.seed + 1,
                               original_bytes=b.loaded.original_bytes())
    return b.reference


def open_timings(cfg: BuildConfig, backend, loaded: LoadedModel) -> tuple[Path | None, dict | None]:
    """With ``--cache-dir`` on a GPU, or for CPU engines (their timed CPU choice): where this build's timings are
    recorded, and the record an earlier build of the same model left there (``timings``; none with
    ``--remeasure``)."""
    if not (cfg.cache_dir and cfg.measure and (gpu_present(backend) or not backend.gpu)):
        return None, None
    path = timings_path(cfg.cache_dir, timings_key(loaded.model, cfg, backend, _versions(backend)))
    return path, None if cfg.remeasure else read_timings(path)


def time_fused_conv_shapes(b: _Build) -> None:
    """A GPU build that times its choices times each convolution shape the conv+ReLU fusion takes, alone, and
    leaves to Inductor's form those cuDNN's fused call runs slower (``BuildOptions.conv_relu_unfused``), and runs on
    padded channels those whose padded call is faster than both (``BuildOptions.conv_channels_padded``), before
    anything is compiled: every engine of the search and of the rounds is compiled with those lists, and the
    conv+ReLU round races the mix against Inductor's form.  A rebuild takes the lists from its record."""
    if not (b.cfg.measure and b.backend.gpu and getattr(b.backend, "fuses_conv_relu", False)
            and b.options.fuse_conv_relu):
        return
    recorded = (b.recorded or {}).get("conv_shapes")
    listed = recorded.get("unfused", []) if isinstance(recorded, dict) else None
    padded = recorded.get("padded", []) if isinstance(recorded, dict) else None
    if all(isinstance(x, list) and all(isinstance(k, str) for k in x) for x in (listed, padded)):
        # (else timed again, as a bad record is)
        b.conv_shapes = dict(recorded, timed_here=False)
        b.options.conv_relu_unfused = list(listed)
        b.options.conv_channels_padded = list(padded)
        _decide_conv_relu_on_shapes(b)
        return
    if not gpu_present(b.backend):
        return
    from .measure import time_conv_shapes

    with b.timed("conv_shapes"):
        try:
            b.conv_shapes = time_conv_shapes(b.model, b.options, lock=b.options.gpu_timing_lock)
        except Exception as e:  # noqa: BLE001 - the timing only refines the fusion: the round still decides it
            b.conv_shapes = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    if b.conv_shapes and b.conv_shapes.get("unfused"):
        b.options.conv_relu_unfused = list(b.conv_shapes["unfused"])
    if b.conv_shapes and b.conv_shapes.get("padded"):
        b.options.conv_channels_padded = list(b.conv_shapes["padded"])
    if b.conv_shapes and "error" not in b.conv_shapes:
        b.timed_here = True
    _decide_conv_relu_on_shapes(b)


def _decide_conv_relu_on_shapes(b: _Build) -> None:
    """The conv+ReLU round taken on the shapes alone where they decide it (``measure.conv_relu_decided_on_shapes``):
    no engine of the fusion's rival form is compiled, and report.json's ``conv_shapes`` says so."""
    from .measure import conv_relu_decided_on_shapes

    decided = conv_relu_decided_on_shapes(b.conv_shapes)
    if decided is not None and getattr(b, "engines", None) is not None:
        b.engines.decided_first["conv+ReLU"] = decided
        b.conv_shapes = dict(b.conv_shapes, decides_round=True)


def rewrite_search(b: _Build, *, measure: bool) -> None:
    """AutoGraph's search over the rewrite rules; on a GPU its top candidates are measured."""
    cfg = b.cfg
    if not cfg.search:
        return
    skipped = _search_not_needed(b) if cfg.measure else None
    if skipped:
        b.search_report = {"enabled": False, "skipped": skipped}
        b.search_kept_input = (b.recorded or {}).get("search_kept_input") is True  # as recorded, recorded again
        if b.search_kept_input:
            b.taken["search"] = "decision to keep the input"
        return
    with b.timed("search"):
        from parastream.rewrite import optimize_graph
        from parastream.rewrite.rules import rules_for, rules_named

        # the search costs candidates on the number of streams the input would get
        b.planned = b.graph, b.engines.schedule(b.graph, cfg.streams, cfg.max_streams)
        measurer = None
        if cfg.measure and measure and b.backend.gpu and b.recorded is not None:  # an earlier build's times, in
            # the order it took them (a CPU build's record holds its CPU choice only: its search measures nothing)
            recorded = b.recorded.get("search") or {}
            measurer = RecordedMeasurer(recorded.get("measured") or [], one_engine=recorded.get("one_engine"),
                                        replay_pieces=recorded.get("chosen_pieces"),
                                        decision=recorded.get("decision") or "", source=str(b.timings_file))
        elif cfg.measure and measure:
            measurer = GpuMeasurer.for_build(b.engines, b.options, b.loaded, streams=cfg.streams,
                                             max_streams=cfg.max_streams, budget_s=cfg.measure_seconds,
                                             runs=cfg.measure_runs,
                                             margin=cfg.search_options.get("measure_margin", MEASURE_MARGIN))
        before = None
        if measurer is not None:  # the search measures its input first: its engines compile while the search runs
            try:
                before = measurer.prepare([b.model])
            except Exception as e:  # noqa: BLE001 - as in the search: measuring compiles what preparing could not
                before = {"error": f"{type(e).__name__}: {e}"}
        task = b.bar.step("rewrite search" + (" (measuring candidates on the GPU)" if measurer else ""))
        try:
            # the search copies the carried graph and hands back the graph of the model it returns (no import);
            # it takes the rules whose fused nodes the build's engines run
            options = {"rules": rules_for(b.backend.name), **cfg.search_options}
            if any(isinstance(r, str) for r in options["rules"]):  # rules given by name (a recorded option stays JSON)
                options["rules"] = rules_named(options["rules"], b.backend.name)
            searched, graph, report = optimize_graph(b.model, b.graph, cost_model=b.cost_model,
                                                     streams=b.planned[1][0].num_streams, seed=cfg.seed,
                                                     measure=measurer, **options)
            recorded = isinstance(measurer, RecordedMeasurer)
            if measurer is not None and searched is b.model and not recorded:  # the input kept: its alternatives,
                b.timed_alternatives = measurer.alternatives_timed()  # timed meanwhile
            elif measurer is not None and not recorded:  # a candidate kept: the input's rounds timed so far
                b.timed_alternatives = measurer.rounds_timed()  # (``carried_rounds``; the engine cut's waited for)
            if measurer is not None and searched is not b.model:
                b.one_engine_timed = measurer.one_engine_timed(searched)
            if measurer is not None:
                b.timed_here = b.timed_here or (not recorded and getattr(measurer, "calls", 0) > 0)
            if recorded and str(report.get("replay", "")).startswith("replayed"):
                b.taken["search"] = report["replay"]
            elif recorded:
                b.taken["search"] = (f"{plural(len(measurer.matched), 'measurement')} of "
                                     f"{len(measurer.measured)} recorded"
                                     + (f" ({report['replay']})" if report.get("replay") else ""))
        finally:
            if measurer is not None:
                measurer.close()
            # the candidates' branches known by their weights' arrays: the graph the build goes on with reads its
            # weights from the kept model (``ir.adopt_model``), so none of them can match again; the arrays can go
            b.engines.branches.by_fingerprint.clear()
        b.search_report = dict(report, enabled=True)
        if measurer is not None:
            b.search_report["measure_log"] = measurer.log
            b.search_report["prepared_before_search"] = before
            b.search_report["alternatives_timed"] = ((b.timed_alternatives or {}).get("timed")
                                                     or "after the search")
        b.model, b.graph = searched, graph
        # a CPU build records that its search (the cost model's, which the record's key determines) kept the input
        b.search_kept_input = searched is b.loaded.model and not b.backend.gpu
        task.advance()


def schedule_streams(b: _Build) -> None:
    """Streams and a resource-aware launch order (Opara) for the graph as rewritten."""
    with b.timed("schedule"):
        if b.planned[0] is b.graph:  # the search changed nothing: the schedule planned for its stream count is this one
            b.sched, b.streams_tried = b.planned[1]
        else:
            b.sched, b.streams_tried = b.engines.schedule(b.graph, b.cfg.streams, b.cfg.max_streams)
            if b.one_engine_timed and b.sched.num_streams > 1:  # the search timed this graph on one stream: faster
                b.sched, _ = b.engines.schedule(b.graph, 1, 1)
                _record_measured_streams(b.streams_tried, b.sched)
                b.streams_tried[-1]["timed_in_search"] = b.one_engine_timed


def _search_not_needed(b: _Build) -> str | None:
    """Why a CPU rebuild need not search (``timings``), or None: the record's CPU choice ships the loaded model
    as it is, so that what the search would propose is neither timed nor shipped (NASNet-A Large: 4 s of a 22 s
    rebuild on 2 cores), or the recorded build's search kept the input (its cost model decides the same again:
    the same structure, options, CPU and code)."""
    recorded = _recorded_cpu_choice(b)
    if recorded and recorded["chosen"] == ORIGINAL_ONE_SESSION:
        return f"{recorded['recorded_by']} chose the {ORIGINAL_ONE_SESSION}"
    if not b.backend.gpu and (b.recorded or {}).get("search_kept_input") is True:
        return f"{_recorded_by(b)} searched this model and kept it as it is"
    return None


def _recorded_by(b: _Build) -> str:
    """Which build's record this build takes from (``b.recorded``), in words."""
    return f"the build of {b.recorded.get('created')} ({b.timings_file})"


def _recorded_cpu_choice(b: _Build) -> dict | None:
    """The CPU choice an earlier build of this model recorded (``timings``), with ``recorded_by`` saying which;
    None where there is none, or not one this code wrote (it is then timed again and written over)."""
    recorded = None if b.backend.gpu else (b.recorded or {}).get("cpu_choice")
    if not (isinstance(recorded, dict) and isinstance(recorded.get("chosen"), str)):
        return None
    return dict(recorded, recorded_by=_recorded_by(b))


def time_cpu_alternatives(b: _Build, scratch: contextlib.ExitStack) -> None:
    """CPU engines: time the plan against one full-threaded session (of the rewritten and the original model) and
    keep the fastest, or take the choice an earlier build recorded; the timed alternatives' engines are built in a
    scratch folder that ``scratch`` removes (one alternative left is built by the engines stage)."""
    if b.backend.gpu or not b.cfg.measure:
        return
    with b.timed("cpu_choice"):
        recorded = _recorded_cpu_choice(b)
        task = b.bar.step("the CPU choice recorded by an earlier build" if recorded else "time the CPU alternatives")
        folder = Path(scratch.enter_context(tempfile.TemporaryDirectory(prefix="parastream-cpu-")))
        with running_errors(b.loaded.path, b.loaded.model, "to time the CPU alternatives"):
            b.model, b.graph, b.sched, b.cpu_threads, b.cpu_choice, b.prebuilt = choose_cpu_alternative(
                b.engines, b.loaded, b.model, b.graph, b.sched, b.options, b.cost_model, streams=b.cfg.streams,
                runs=b.cfg.cpu_runs, seed=b.cfg.seed, scratch=folder,
                rewritten=bool(b.search_report.get("rules_chosen")), recorded=recorded)
        if b.cpu_choice.get("recorded_by"):
            b.taken["cpu_choice"] = b.cpu_choice["chosen"]
        elif recorded:
            b.taken["cpu_choice"] = "timed again: " + b.cpu_choice.get("recorded_not_taken", "")
        # recorded: a choice timed here, or a search run here that kept the input (one taken is left as it was)
        b.timed_here = (b.timed_here or cpu_choice_recordable(b.cpu_choice)
                        or (b.search_kept_input and bool(b.search_report.get("enabled"))))
        if b.prebuilt is None and b.cfg.verify:  # built by the engines stage: the verification loads every engine,
            b.options = replace(b.options, check=False)  # as the timing's launchers loaded the scratch ones
        _record_measured_streams(b.streams_tried, b.sched)
        task.advance()


def partition(b: _Build) -> None:
    """The plan: one branch per partition of the schedule, with its stream, waits and boundary tensors."""
    b.make_plan()
    b.plan.cpu_threads = b.cpu_threads


def take_recorded_choices(b: _Build) -> None:
    """The rounds an earlier build of the same model timed (``timings``), taken as they are when this plan is
    the one they were timed on: the engines are then compiled once, for the choices, and no alternative is
    compiled, loaded or timed.  Another plan (the search went another way) is timed as in any build."""
    recorded = (b.recorded or {}).get("measured_choices")
    if not (recorded and b.backend.gpu and b.cfg.measure):
        return
    if b.recorded.get("plan") != plan_digest(b.plan):
        b.taken["rounds"] = "timed again: the recorded rounds were timed on another plan"
        return
    b.measured_plan = b.recorded["plan"]
    b.measured = dict(recorded, timed=f"recorded by {_recorded_by(b)}")
    _take_measured_options(b, b.measured)
    if b.measured.get("one_engine") or b.measured.get("whole_engine"):
        b.sched, _ = b.engines.schedule(b.graph, 1, 1, whole=bool(b.measured.get("whole_engine")))
        _record_measured_streams(b.streams_tried, b.sched)
        b.make_plan()
    b.taken["rounds"] = plural(len(recorded.get("rounds") or []), "round")


def _take_measured_options(b: _Build, measured: dict) -> None:
    """The engine options the rounds chose (a round that did not run leaves its option as it is)."""
    b.options.fuse_conv_relu = measured.get("fuse_conv_relu", b.options.fuse_conv_relu)
    b.options.fuse_attention = measured.get("fuse_attention", b.options.fuse_attention)
    b.options.fuse_gemm_epilogue = measured.get("fuse_gemm_epilogue", b.options.fuse_gemm_epilogue)
    b.options.conv_kernels = measured.get("conv_kernels", conv_kernels_used(b.options.conv_kernels))
    b.options.optimization_level = measured.get("optimization_level", b.options.optimization_level)


def record_timings(b: _Build) -> None:
    """Write what this build timed (``timings``) for the builds after it, once it is verified; a build that
    took everything from the record leaves it as it was."""
    if b.timings_file is None or not b.timed_here:
        return
    record = {"created": utc_now(), "model": str(b.loaded.path), "build_s": round(time.perf_counter() - b.t_start, 1)}
    if not b.backend.gpu:  # CPU engines: the CPU choice (where it was timed), and whether the search kept the input
        record.update(cpu_choice=b.cpu_choice if cpu_choice_recordable(b.cpu_choice) else None,
                      search_kept_input=b.search_kept_input)
    else:
        record.update(search={"measured": b.search_report.get("measured_in_order") or [],
                              "one_engine": b.one_engine_timed, "decision": b.search_report.get("decision"),
                              "chosen_pieces": b.search_report.get("chosen_pieces")},
                      plan=b.measured_plan, measured_choices=b.measured,
                      **({"conv_shapes": b.conv_shapes} if b.conv_shapes and "error" not in b.conv_shapes else {}))
    try:
        write_timings(b.timings_file, record)
    except OSError as e:  # the record only spares later builds their timing: the verified bundle still ships
        b.taken["not_written"] = f"{b.timings_file}: {e.strerror or type(e).__name__}"
        return
    b.taken["written"] = str(b.timings_file)


def build_engines(b: _Build, tmp: Path) -> None:
    """One engine per branch, written into the staging folder."""
    with b.timed("engines"):
        task = b.bar.step(f"build {plural(len(b.plan.branches), b.backend.name + ' engine')}", total=len(b.plan.branches))
        early = b.timed_alternatives
        if early is not None and plan_signature(early["plan"]) != plan_signature(b.plan):
            # timed for another plan (the input's, which a candidate replaced): the rounds it decided by a wide
            # margin hold for this one, the others are timed again below
            carried = carried_rounds(early.get("rounds") or [])
            b.timed_alternatives = early = ({"partial": True, "rounds": carried, "plan": b.plan,
                                             "timed": f"{plural(len(carried), 'round')} taken from the input's plan, "
                                                      "the rest after the search"} if carried else None)
        shipped = Variant(b.model, b.graph, b.plan, b.options, b.measured["internal_nhwc"] if b.measured else True)
        if b.cfg.measure and b.backend.gpu and b.prebuilt is None:  # the engines the GPU alternatives load: one batch
            if early is None and not b.measured and b.backend.background_compiles and gpu_present(b.backend):
                try:  # (the search timed none of the input's rounds: a one-engine plan's GEMM round decided first)
                    gemm_first = gemm_round_first(b.engines, shipped, runs=b.cfg.measure_runs,
                                                  lock=b.options.gpu_timing_lock)
                except Exception:  # noqa: BLE001 - the sample is not the plan: ``time_alternatives`` races the round
                    gemm_first = None
                if gemm_first is not None:
                    b.timed_alternatives = early = {"partial": True, "rounds": [gemm_first], "plan": b.plan,
                                                    "timed": "the GEMM epilogue round on its sample, before the engines"}
            decided = (early or {}).get("rounds") or []
            done = {r["choice"] for r in decided}
            # the rounds still to race race the form the decided ones chose (a one-engine plan's GEMM round,
            # decided on its sample before its rivals were queued, ``GpuMeasurer._gemm_sample_first``): their
            # rivals, and the next level's as spare, are compiled for that form.  (The engine cut decides no fusion
            # round: a plan whose only carried round is the cut still compiles the second-level alternatives up
            # front; nor does the GEMM round decided first, whose next level was queued for its form.)
            form = decided_form(shipped, decided)
            decided_first = {r["choice"] for r in decided if r.get("decided_first")}
            timed_all = (early is not None and not early.get("partial")) or b.measured
            rivals = [] if timed_all else [(what, v) for what, v in alternative_variants(b.engines, form)
                                           if what not in done]
            speculative = ([] if timed_all or done - CARRIED_ALWAYS - decided_first
                           else speculative_by_round(b.engines, form, done))
            if rivals and b.backend.background_compiles:
                # the plan first, then its rounds' rivals in the background: the rounds start as soon as their own
                # rival is in (``QueuedRivals``), not once the slowest of them is
                b.precompiled = b.engines.precompile([shipped], background=True, cancellable=False, order="now",
                                                     label="the plan")
                b.rivals = QueuedRivals(b.engines)
                b.rivals.queue(form, done, rivals, speculative)
                if b.precompiled is not None:
                    b.precompiled = {**{k: x for k, x in b.precompiled.items() if k != "keys"},
                                     "rivals": b.rivals.queued}
            else:
                b.precompiled = b.engines.precompile([shipped] + [v for _, v in rivals]
                                                     + [a for _, alts in speculative for a in alts])
        b.engines_report = b.engines.write(tmp, shipped, str(b.loaded.path), on_branch=task.advance,
                                           prebuilt=b.prebuilt)
        b.prebuilt = None


def time_gpu_alternatives(b: _Build, tmp: Path) -> None:
    """GPU engines: time the bundle against its alternatives (fused attention, GEMM epilogues and conv+ReLU or
    not, depthwise convolutions as cuDNN's, Inductor's or torch's own kernels, channels-last or contiguous
    boundaries, one engine for the whole model), keep each winner and rebuild the engines for it."""
    cfg = b.cfg
    if not (cfg.measure and b.backend.gpu) or "rounds" in b.taken and b.measured is not None:
        return  # (the recorded rounds were taken before the engines were written: ``take_recorded_choices``)
    with b.timed("measure_alternatives"):
        task = b.bar.step("time the plan against its alternatives on the GPU")
        fused, attention, gemm = b.options.fuse_conv_relu, b.options.fuse_attention, b.options.fuse_gemm_epilogue
        convs = conv_kernels_used(b.options.conv_kernels)
        if b.timings_file is not None:
            b.measured_plan = plan_digest(b.plan)
        early = b.timed_alternatives or {}
        if early and not early.get("partial"):  # timed against this plan's engines during the search
            measured = {k: v for k, v in early.items() if k != "plan"}
        else:  # the bundle as written, loaded from ``tmp`` (its manifest is written after this stage), from the
            # rounds the search timed on (none, or those before an alternative won)
            shipped = Variant(b.model, b.graph, b.plan, b.options)
            bundle = Bundle(path=tmp, manifest=b.engines.manifest_of(shipped), plan=b.plan, report={})
            measured = time_alternatives(b.engines, bundle, shipped, runs=cfg.measure_runs, timed=early.get("rounds", ()),
                                         rivals=b.rivals)
            if measured and early.get("stopped"):  # why the search's rounds left the rest to this stage
                measured["stopped_in_search"] = early["stopped"]
        if measured:
            _take_measured_options(b, measured)
            b.timed_here = True
        b.measured = measured
        whole = bool(measured and measured.get("whole_engine"))
        if measured and (measured["one_engine"] or whole
                         or compiled_for_other_choices(b.backend, fused, measured, attention, gemm, convs)):
            if measured["one_engine"] or whole:
                b.sched, _ = b.engines.schedule(b.graph, 1, 1, whole=whole)
                _record_measured_streams(b.streams_tried, b.sched)
                b.make_plan()
            shutil.rmtree(tmp / "engines")
            b.engines_report = b.engines.write(tmp, Variant(b.model, b.graph, b.plan, b.options, measured["internal_nhwc"]),
                                               str(b.loaded.path))
        race_kernel_tuning(b, tmp)
        task.advance()


def race_kernel_tuning(b: _Build, tmp: Path) -> None:
    """The "kernel tuning" round where the ``--opt-level`` asked for tunes the backend's kernels
    (``measure.kernel_tuning_round``): the engines written for the other rounds' choices against the same compiled
    at that level; the tuned engines are written instead where they won.  The round and the level shipped go into
    report.json's ``measured_choices`` (``optimization_level``), which a rebuild takes as it takes the rounds."""
    level = tuned_level(b.backend, b.cfg.optimization_level)
    if level is None or b.options.optimization_level == level or not (b.options.compile and gpu_present(b.backend)):
        return
    nhwc = b.measured["internal_nhwc"] if b.measured else True
    v = Variant(b.model, b.graph, b.plan, replace(b.options), nhwc)
    try:
        r, won = kernel_tuning_round(b.engines, v, level, runs=b.cfg.measure_runs, lock=b.options.gpu_timing_lock)
    except Exception as e:  # noqa: BLE001 - a tuned form that does not compile or load is not shipped; the rest is
        r, won = {"choice": TUNING_ROUND, "level": level, "error": f"{type(e).__name__}: {e}"}, False
    if b.measured is None:  # no other round ran: the choices as the engines were written
        b.measured = dict(choices_as_built(b.backend, b.options), runs=b.cfg.measure_runs)
    b.measured["rounds"] = [*(b.measured.get("rounds") or []), r]
    if won:
        b.options.optimization_level = level
        shutil.rmtree(tmp / "engines")
        b.engines_report = b.engines.write(tmp, replace(v, options=replace(b.options)), str(b.loaded.path))
    b.measured["optimization_level"] = b.options.optimization_level
    b.timed_here = True


def _background_summary(b: _Build) -> dict | None:
    return b.backend.background_summary(b.t_start) if b.backend.background_compiles else None


def write_report(b: _Build, tmp: Path) -> None:
    """report.json (what was decided, measured and timed) and manifest.json, unhashed until ``finish``."""
    cfg, loaded, sched = b.cfg, b.loaded, b.sched
    b.report = {
        "version": REPORT_VERSION,
        # absolute (not resolved through links, so it reads as the user named it): verify and bench find the
        # original from any working directory
        "model": {"path": os.path.abspath(loaded.path), "nodes_in": len(loaded.model.graph.node), "nodes_out": len(b.model.graph.node),
                  "rewritten": b.model is not loaded.model,  # False: the search's proposal was not shipped (CPU choice)
                  "inputs": [asdict(t) for t in loaded.inputs], "outputs": [asdict(t) for t in loaded.outputs]},
        "search": b.search_report,
        "schedule": {"streams": sched.num_streams, "requested_streams": cfg.streams, "graph_width": b.width,
                     "branches": len(b.plan.branches), "critical_path_s": sched.makespan, "total_work_s": sched.total_work,
                     "estimated_s": estimate_latency(sched), "streams_tried": b.streams_tried,
                     "cost_model": f"roofline {b.device_profile} {cfg.precision}"},
        "cpu_choice": b.cpu_choice,
        "engines": b.engines_report,
        "measured_choices": b.measured,
        "conv_shapes": b.conv_shapes,
        "recorded_timings": dict(b.taken, file=str(b.timings_file)) if b.timings_file else None,
        "precompiled": b.precompiled,
        "background_compiles": _background_summary(b),
        "verification": None,
        "timings": b.timings,
        "stage_seconds": b.stage_seconds(),
    }
    if loaded.tail is not None:  # the data-dependent tail, as the original has it (pipeline/host_tail.py)
        from parastream.launcher.tail import TAIL_FILE

        (tmp / TAIL_FILE).write_bytes(loaded.tail.model.SerializeToString())
        b.report["host_tail"] = loaded.tail.record()
    (tmp / "report.json").write_text(json.dumps(b.report, indent=2, default=str))
    b.manifest = {"parastream": _versions(b.backend), "backend": b.backend.name, "device": _device_description(b.backend),
                  "precision": cfg.precision,
                  "options": {**{k: v for k, v in asdict(cfg).items() if k != "force"}, **_launcher_options(b.options),
                              "internal_nhwc": b.measured["internal_nhwc"] if b.measured else True},
                  "created": utc_now()}
    if loaded.tail is not None:
        from parastream.launcher.tail import MANIFEST_KEY

        b.manifest[MANIFEST_KEY] = loaded.tail.record()
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

        def load_bundle():  # (a tail's inputs are the static part's outputs, verified here: host_tail False)
            runner = load(tmp, check_hashes=False, host_tail=False)
            loaded_as.update(_engines_loaded(runner))
            return runner

        b.model = b.graph = None  # written; only the bundle runs from here
        rtol, atol, scale_tol = resolve_tolerances(cfg.precision, cfg.rtol, cfg.atol, cfg.scale_tol)
        result = run_verification(loaded.path, loaded.original, None, loaded.inputs, rtol=rtol, atol=atol,
                                  scale_tol=scale_tol, seed=cfg.seed + 1, load=load_bundle,
                                  original_bytes=loaded.original_bytes(), reference=b.reference)
        if result.passed and loaded.tail is not None:
            full = read_model(loaded.path)  # the whole original, named as its static part's nodes are
            name_nodes(full)
            e2e = end_to_end(full, loaded, tmp, rtol=rtol, atol=atol, scale_tol=scale_tol, seed=cfg.seed + 1,
                             lock=cfg.gpu_timing_lock)
            placement = e2e.pop("placement")  # where the tail runs: decided by timing (host_tail.place)
            b.report["host_tail"].update(end_to_end=e2e, placement=placement, runs_on=placement["runs_on"])
            from parastream.launcher.tail import MANIFEST_KEY

            b.manifest[MANIFEST_KEY]["runs_on"] = placement["runs_on"]
        task.advance()
    b.report["verification"] = dict(result.to_dict(), **loaded_as)
    if not result.passed:
        raise VerificationError(
            f"{loaded.path}: the built deployment does not match onnxruntime on the original model "
            f"({result.failure()}); no bundle was written"
            + ("; --no-verify builds without verification" if result.status == "inconclusive" else _where(b, tmp)))


def _where(b: _Build, tmp: Path) -> str:
    """Where the failed build parts from the original (``localize`` on the staged bundle), as a clause."""
    from .localize import localize

    try:
        found = localize(tmp, b.loaded.path, seed=b.cfg.seed + 1, iterations=2, check_hashes=False, loaded=b.loaded)
    except Exception as e:  # noqa: BLE001 - the verification's failure is the error; localizing it is a bonus
        return f"; it could not be localized ({type(e).__name__}: {e})"
    return f"; localized: {found.summary()}" + (f"; pin it with {found.keep_fp32}" if found.keep_fp32 else "")


def complete(b: _Build) -> _Build:
    """The report's last figures: the build's total seconds, the seconds of each stage and the peak memory."""
    b.timings["total"] = time.perf_counter() - b.t_start
    b.report["stage_seconds"] = b.stage_seconds()
    if b.timings_file is not None:
        b.report["recorded_timings"] = dict(b.taken, file=str(b.timings_file))
    b.report["peak_rss_mb"] = _peak_rss_mb()
    return b


def finish(b: _Build, tmp: Path) -> Bundle:
    """The final report and the hashed manifest; the bundle opened (checked) before it becomes OUT."""
    complete(b)
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
