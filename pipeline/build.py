"""``parastream build``: load and check, rewrite, schedule, build engines, verify, write the bundle.

Nothing reaches OUT until everything succeeded: the bundle is written into a
temporary folder beside OUT and renamed into place at the end.
"""

from __future__ import annotations

import json
import platform
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import onnx
import onnx_graphsurgeon as gs
from onnx import shape_inference

from parastream.launcher.bundle import Bundle, write_manifest
from parastream.launcher.engines import BuildOptions, resolve_backend
from parastream.launcher.errors import ParastreamError, VerificationError

from .model_io import LoadedModel, batch_profiles, load_model
from .partition import extract_branch, make_plan
from .report import make_temp_folder
from .schedule import schedule_graph
from .verify import DEFAULT_TOLERANCES, verify

REPORT_VERSION = 1
DEFAULT_MAX_STREAMS = 4


@dataclass
class BuildConfig:
    backend: str = "auto"
    streams: int | None = None  # None: chosen from the graph's width and the device
    max_streams: int = DEFAULT_MAX_STREAMS
    shapes: dict[str, list[int]] = field(default_factory=dict)
    batch: tuple[int, int, int] | None = None  # --batch min:opt:max for inputs with a dynamic first dimension
    precision: str = "fp32"
    search: bool = True
    search_options: dict = field(default_factory=dict)
    verify: bool = True
    rtol: float | None = None
    atol: float | None = None
    seed: int = 0
    device: str = "H100-SXM"  # device table entry the cost model plans for
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


def _infer(model: onnx.ModelProto) -> onnx.ModelProto:
    return shape_inference.infer_shapes(model, strict_mode=True, data_prop=True)


def choose_streams(model: onnx.ModelProto, max_streams: int) -> tuple[int, int]:
    """Streams from the graph's width (the most nodes that can ever run at once), capped for the device."""
    from .analysis import graph_width

    width, _ = graph_width(model)
    return max(1, min(width, max_streams)), width


class _Progress:
    """A rich progress display on stderr, or nothing."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._progress = None

    def __enter__(self):
        if self.enabled:
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
    out = Path(out_dir)
    if out.exists() and not cfg.force:
        raise ParastreamError(f"{out} already exists; pass --force to replace it")
    if cfg.streams is not None and cfg.streams < 1:
        raise ParastreamError(f"--streams {cfg.streams}: must be at least 1")
    backend = resolve_backend(cfg.backend)
    timings: dict[str, float] = {}
    t_all = time.perf_counter()

    with _Progress(progress) as bar:
        t0 = time.perf_counter()
        shapes, profiles = dict(cfg.shapes), {}
        if cfg.batch:
            shapes, profiles = batch_profiles(model_path, shapes, tuple(cfg.batch))
        loaded: LoadedModel = load_model(model_path, shapes)
        check = getattr(backend, "check_model", None)
        if check is not None:
            try:
                check(loaded.model)
            except ParastreamError as e:
                raise ParastreamError(f"{loaded.path}: {e}") from None
        bar.step("load and check").advance()
        timings["load"] = time.perf_counter() - t0

        from parastream.rewrite.cost import RooflineCostModel, node_flops_bytes

        cost_model = RooflineCostModel(cfg.device, precision=cfg.precision)
        streams, width = (cfg.streams, None) if cfg.streams else choose_streams(loaded.model, cfg.max_streams)
        if width is None:
            from .analysis import graph_width

            width = graph_width(loaded.model)[0]

        model = loaded.model
        search_report: dict = {"enabled": False}
        if cfg.search:
            t0 = time.perf_counter()
            from parastream.rewrite import optimize

            task = bar.step("rewrite search")
            model, search_report = optimize(model, cost_model=cost_model, streams=streams, seed=cfg.seed, **cfg.search_options)
            search_report = dict(search_report, enabled=True)
            model = _infer(model)
            task.advance()
            timings["search"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        graph = gs.import_onnx(model)
        graph.toposort()
        sched = schedule_graph(graph, streams, cost_model.node_cost, cost_model.is_memory_bound)
        plan = make_plan(graph, sched, backend=backend.name, precision=cfg.precision, suffix=backend.suffix,
                         inputs=loaded.inputs, outputs=loaded.outputs, flops_bytes=node_flops_bytes)
        timings["schedule"] = time.perf_counter() - t0

        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = make_temp_folder(out)
        try:
            (tmp / "engines").mkdir()
            onnx.save(model, tmp / "model.onnx")
            plan.save(tmp / "plan.json")

            t0 = time.perf_counter()
            options = BuildOptions(precision=cfg.precision, device="cuda" if backend.gpu else "cpu",
                                   workspace_mb=cfg.workspace_mb, optimization_level=cfg.optimization_level,
                                   strongly_typed=cfg.strongly_typed, cache_dir=cfg.cache_dir, compile=cfg.compile,
                                   profiles=profiles)
            builder = backend.Builder(options)
            task = bar.step(f"build {len(plan.branches)} {backend.name} engines", total=len(plan.branches))
            try:
                for b in plan.branches:
                    branch_model = extract_branch(model, graph, b)
                    try:
                        data = builder.build(branch_model, b.name)
                    except ParastreamError as e:
                        raise ParastreamError(f"{loaded.path}: {b.name} failed to build: {e}") from None
                    except Exception as e:  # noqa: BLE001 - backend errors name the node
                        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                        raise ParastreamError(f"{loaded.path}: {b.name} (nodes {b.nodes[0]}..{b.nodes[-1]}) failed to build with {backend.name}: {first}") from None
                    (tmp / b.engine).write_bytes(data)
                    task.advance()
                engines_report = builder.report()
            finally:
                builder.close()
            timings["engines"] = time.perf_counter() - t0

            report = {
                "version": REPORT_VERSION,
                "model": {"path": str(loaded.path), "nodes_in": len(loaded.model.graph.node), "nodes_out": len(model.graph.node),
                          "inputs": [asdict(t) for t in loaded.inputs], "outputs": [asdict(t) for t in loaded.outputs]},
                "search": search_report,
                "schedule": {"streams": sched.num_streams, "requested_streams": cfg.streams, "graph_width": width,
                             "branches": len(plan.branches), "critical_path_s": sched.makespan, "total_work_s": sched.total_work,
                             "cost_model": f"roofline {cfg.device} {cfg.precision}"},
                "engines": engines_report,
                "verification": None,
                "timings": timings,
            }
            (tmp / "report.json").write_text(json.dumps(report, indent=2, default=str))
            manifest = {"parastream": _versions(backend), "backend": backend.name, "device": _device_description(backend),
                        "precision": cfg.precision, "options": {k: v for k, v in asdict(cfg).items() if k != "force"},
                        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            write_manifest(tmp, manifest)

            if cfg.verify:
                t0 = time.perf_counter()
                task = bar.step("verify against onnxruntime")
                from parastream.launcher import load

                runner = load(tmp, check_hashes=False)
                rtol, atol = DEFAULT_TOLERANCES.get(cfg.precision, DEFAULT_TOLERANCES["fp32"])
                result = verify(loaded.original, runner, loaded.inputs, rtol=cfg.rtol if cfg.rtol is not None else rtol,
                                atol=cfg.atol if cfg.atol is not None else atol, seed=cfg.seed + 1)
                close = getattr(runner, "close", None)
                if close:
                    close()
                task.advance()
                timings["verify"] = time.perf_counter() - t0
                report["verification"] = result.to_dict()
                if not result.passed:
                    worst = max(result.outputs.items(), key=lambda kv: kv[1]["max_abs"])
                    raise VerificationError(
                        f"{loaded.path}: the built deployment does not match onnxruntime on the original model "
                        f"(output {worst[0]!r}: max abs error {worst[1]['max_abs']:.3g}, max rel error {worst[1]['max_rel']:.3g}, "
                        f"rtol {result.rtol}, atol {result.atol}); no bundle was written")
            timings["total"] = time.perf_counter() - t_all
            (tmp / "report.json").write_text(json.dumps(report, indent=2, default=str))
            write_manifest(tmp, manifest)
            _move_into_place(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return Bundle.open(out)


def _move_into_place(tmp: Path, out: Path) -> None:
    """Rename the finished bundle to OUT; an old OUT (with --force) goes only once the new one is complete."""
    if out.exists():
        old = out.with_name(f".{out.name}.old-{int(time.time() * 1000)}")
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink()
    else:
        tmp.rename(out)
