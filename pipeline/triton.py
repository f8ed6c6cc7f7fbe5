"""``parastream export-triton``: a bundle as a Triton Inference Server model repository.

Two layouts (``mode``):

graph (default)
    One model on Triton's Python backend::

        REPO/NAME/config.pbtxt      backend "python", inputs/outputs, instance_group
        REPO/NAME/1/model.py        pipeline/templates/model.py
        REPO/NAME/1/bundle/         the bundle, unchanged (manifest hashes still hold)

    ``model.py`` loads the bundle once per model instance with parastream's launcher (on a GPU
    instance the multi-stream plan replayed as one CUDA Graph) and exchanges tensors with Triton
    through DLPack.  A bundle of CPU engines (onnxruntime) gets ``KIND_CPU`` instances: its engines
    never touch a GPU, so ``KIND_GPU`` would only tie a CPU workload to a GPU's instance slots.
    GPU bundles (tensorrt, torch) get ``KIND_GPU`` and ``FORCE_CPU_ONLY_INPUT_TENSORS: "no"``, so
    inputs that already live on the GPU reach the launcher without a trip through host memory.

ensemble
    One ``tensorrt_plan`` model per branch engine (``REPO/NAME_branch_NNN/1/model.plan``) and an
    ``ensemble`` model ``REPO/NAME`` whose steps wire the branches together through
    ``input_map``/``output_map``, so that Triton's ensemble scheduler itself runs independent
    branches concurrently.  Only bundles built with ``--backend tensorrt``.

Batching (``max_batch``).  Triton's ``dims`` leave out the batch dimension when
``max_batch_size > 0``.  A bundle's engines have static shapes, so batching needs a bundle built
at a batch ``B`` (``--shapes input:Bx...``): every model input and output must have the leading
dimension ``B`` and ``max_batch <= B``.  ``model.py`` then concatenates the requests that Triton's
dynamic batcher hands it, pads the batch up to ``B`` and slices the outputs back per request -- which
assumes, as Triton's batching always does, that the items of a batch are independent.  A dynamic-batch
bundle (``--batch MIN:OPT:MAX``, launcher/buckets.py) is exported with ``max_batch_size`` MAX (by default) and
the buckets as the dynamic batcher's ``preferred_batch_size``; model.py then hands the launcher the rows of
the requests as they are, and the launcher runs the smallest bucket that holds them.  Ensembles of
static TensorRT engines cannot batch (Triton would need a dynamic batch dimension in every engine),
so ``mode="ensemble"`` takes ``max_batch=0`` only.  With ``max_batch=0`` dims are the full shapes;
a 0-d tensor is declared as ``dims: [1]`` (Triton needs at least one dim) and reshaped by model.py.

Every ``config.pbtxt`` is a ``ModelConfig`` message (Triton's own protobuf, from tritonclient)
printed with ``text_format``; ``validate_repository`` parses them back strictly and checks that
names, data types and dims agree with the bundle and with each other, and that every ensemble
tensor has exactly one producer.  Nothing reaches REPO until everything is written and validated:
the models are staged in a hidden folder inside REPO and renamed into place.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from parastream.launcher.bundle import Bundle, inside
from parastream.launcher.engines import get_backend
from parastream.launcher.errors import ParastreamError
from parastream.launcher.plan import TensorSpec
from parastream.launcher.tail import MANIFEST_KEY, served_outputs

from .outdir import check_target, move_into_place, staging, why_not_ours, write_marker

MODES = ("graph", "ensemble")
VERSION = "1"
TEMPLATE = Path(__file__).resolve().parent / "templates" / "model.py"
BUNDLE_DIR = "bundle"  # inside the version folder of a graph-mode model

# numpy dtype name -> Triton DataType name
TRITON_DTYPES = {
    "bool": "TYPE_BOOL",
    "uint8": "TYPE_UINT8",
    "uint16": "TYPE_UINT16",
    "uint32": "TYPE_UINT32",
    "uint64": "TYPE_UINT64",
    "int8": "TYPE_INT8",
    "int16": "TYPE_INT16",
    "int32": "TYPE_INT32",
    "int64": "TYPE_INT64",
    "float16": "TYPE_FP16",
    "float32": "TYPE_FP32",
    "float64": "TYPE_FP64",
    "bfloat16": "TYPE_BF16",
}

# parameters parastream writes into the configs (model.py and validate_repository read them)
P_BUNDLE = "parastream_bundle"  # graph mode: the bundle folder, relative to the version folder
P_BACKEND = "parastream_backend"  # the bundle's engine backend
P_BATCH = "parastream_bundle_batch"  # graph mode with max_batch > 0: the batch the bundle was built for
P_ENSEMBLE = "parastream_ensemble"  # ensemble mode: on every branch model, the ensemble it belongs to


def model_config_pb2():
    """Triton's ModelConfig protobuf module (shipped by tritonclient)."""
    try:
        from tritonclient.grpc import model_config_pb2
    except (ImportError, RuntimeError) as e:  # tritonclient raises RuntimeError when its grpc extra's modules are missing
        cause = f"; {e.__cause__}" if e.__cause__ is not None else ""
        raise ParastreamError(f"export-triton needs Triton's ModelConfig protobuf from tritonclient ({e}{cause}): "
                              "pip install 'tritonclient[grpc,http]'") from None
    return model_config_pb2


# -- configs ---------------------------------------------------------------------------------------
def triton_dtype(spec: TensorSpec) -> str:
    try:
        return TRITON_DTYPES[spec.dtype]
    except KeyError:
        raise ParastreamError(f"tensor {spec.name!r} has dtype {spec.dtype}, which Triton has no data type for") from None


def wire_dims(spec: TensorSpec, max_batch: int) -> list[int]:
    """The ``dims`` Triton declares for a bundle tensor: without the batch dim when batching; [1] for a 0-d tensor."""
    dims = list(spec.shape[1:] if max_batch > 0 else spec.shape)
    return dims or [1]


def _io(message, spec: TensorSpec, max_batch: int, dynamic: set[int] | None = None):
    """A Triton input or output; ``dynamic``: the tensor's dimensions that carry a dynamic axis (declared -1)."""
    mc = model_config_pb2()
    dims = wire_dims(spec, max_batch)
    if dynamic and spec.shape:
        first = 1 if max_batch > 0 else 0
        dims = [-1 if i + first in dynamic else d for i, d in enumerate(dims)]
    return message(name=spec.name, data_type=mc.DataType.Value(triton_dtype(spec)), dims=dims)


def grid_dynamic_dims(record: dict) -> dict[str, set[int]]:
    """A grid bundle's tensors and their dimensions that vary with a dynamic axis (inputs that carry it, outputs
    cut back along it): Triton declares them -1, model.py hands the launcher what arrives."""
    out: dict[str, set[int]] = {}
    for a in record.get("axes", []):
        for name, dim in a["inputs"].items():
            out.setdefault(name, set()).add(int(dim))
        for name, dims in (a.get("outputs") or {}).items():
            out.setdefault(name, set()).update(int(d) for d in dims)
    return out


def _params(config, **values: str) -> None:
    for k, v in values.items():
        config.parameters[k].string_value = str(v)


def _header(bundle: Bundle, mode: str) -> str:
    return (f"# Written by parastream export-triton (mode {mode}) from the bundle {bundle.path.resolve().name!r}\n"
            f"# backend {bundle.plan.backend}, precision {bundle.plan.precision}, {len(bundle.plan.branches)} branches "
            f"on {bundle.plan.num_streams} streams. Triton's ModelConfig protobuf, text format.\n")


def config_text(config, header: str = "") -> str:
    from google.protobuf import text_format

    return header + text_format.MessageToString(config)


@dataclass
class ModelFolder:
    """One model of the repository, as it will be written: its config and the files of version 1."""

    name: str
    config: object  # inference.ModelConfig
    header: str = ""
    files: dict[str, Path | bytes] = field(default_factory=dict)  # path inside the version folder -> source
    trees: dict[str, Path] = field(default_factory=dict)  # folder inside the version folder -> source folder

    def write(self, parent: Path) -> Path:
        root = parent / self.name
        version = root / VERSION
        version.mkdir(parents=True)
        (root / "config.pbtxt").write_text(config_text(self.config, self.header))
        for rel, src in self.files.items():
            dst = version / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(src, bytes):
                dst.write_bytes(src)
            else:
                shutil.copyfile(src, dst)
        for rel, src in self.trees.items():
            shutil.copytree(src, version / rel)
        write_marker(root, "parastream export-triton")
        return root


def _batch_of(bundle: Bundle, max_batch: int) -> int:
    """The bundle's batch ``B`` when exporting with ``max_batch > 0`` (see the module docstring)."""
    plan = bundle.plan
    leading = {}
    for spec in list(plan.inputs) + list(plan.outputs):
        if not spec.shape:
            raise ParastreamError(f"--max-batch {max_batch}: {spec.name!r} is a scalar, so the bundle has no batch "
                                  "dimension; export with --max-batch 0")
        leading[spec.name] = spec.shape[0]
    sizes = set(leading.values())
    if len(sizes) != 1:
        raise ParastreamError(f"--max-batch {max_batch}: the bundle's inputs and outputs do not share a leading batch "
                              f"dimension ({', '.join(f'{k}: {v}' for k, v in leading.items())}); export with --max-batch 0")
    batch = sizes.pop()
    if max_batch > batch:
        names = ",".join(f"{t.name}:{'x'.join(str(d) for d in [max_batch, *t.shape[1:]])}" for t in plan.inputs)
        raise ParastreamError(f"--max-batch {max_batch} exceeds the batch {batch} the bundle {bundle.path} was built for; "
                              f"rebuild it with --shapes {names}, or export with --max-batch {batch} or less")
    return batch


def graph_model(bundle: Bundle, name: str, *, max_batch: int = 0, instances: int = 1,
                gpus: list[int] | None = None) -> ModelFolder:
    """The Python-backend model that replays the bundle's plan (mode "graph").  ``instances`` per GPU, on ``gpus``
    (default: every GPU of the server); each instance loads the bundle on its own GPU (model.py)."""
    mc = model_config_pb2()
    plan = bundle.plan
    gpu = bool(get_backend(plan.backend).gpu)
    record = bundle.manifest.get("buckets") or {}
    buckets = record.get("sizes")
    dynamic = grid_dynamic_dims(record) if "axes" in record else {}
    if "axes" in record:  # a grid over named axes: batching along its batch axis, if it has one
        batch_axis = next((a for a in record["axes"] if all(int(i) == 0 for i in a["inputs"].values())), None)
        buckets = sorted(int(s) for s in batch_axis["sizes"]) if batch_axis else None
        if not batch_axis and max_batch:
            raise ParastreamError(f"--max-batch {max_batch}: {bundle.path} has no dynamic batch axis (its dynamic axes: "
                                  f"{', '.join(a['name'] for a in record['axes'])}); export with --max-batch 0")
    if buckets:  # a dynamic-batch bundle batches up to MAX, each batch on its smallest bucket (no padding to B)
        max_batch = max_batch or max(buckets)
    if max_batch and MANIFEST_KEY in bundle.manifest:
        raise ParastreamError(f"--max-batch {max_batch}: {bundle.path} ends in a data-dependent tail (its outputs' "
                              "shapes depend on the data, with no batch axis to split a batch's results by); export "
                              "with --max-batch 0")
    config = mc.ModelConfig(name=name, backend="python", max_batch_size=max_batch)
    config.input.extend(_io(mc.ModelInput, t, max_batch, dynamic.get(t.name)) for t in plan.inputs)
    # (a tail's outputs: their dimensions unknown before a run declared -1, launcher/tail.py)
    config.output.extend(_io(mc.ModelOutput, t, max_batch, dynamic.get(t.name)) for t in served_outputs(bundle))
    if gpus and not gpu:
        raise ParastreamError(f"--gpus {','.join(map(str, gpus))}: {bundle.path} has {plan.backend} engines, served by KIND_CPU "
                              "instances, which take no GPUs; leave --gpus out")
    kind = mc.ModelInstanceGroup.Kind.Value("KIND_GPU" if gpu else "KIND_CPU")
    config.instance_group.add(kind=kind, count=instances, gpus=gpus or [])
    _params(config, **{P_BUNDLE: BUNDLE_DIR, P_BACKEND: plan.backend})
    if gpu:
        # inputs already on the GPU (CUDA shared memory, an upstream GPU model) stay there
        _params(config, FORCE_CPU_ONLY_INPUT_TENSORS="no")
    if max_batch > 0:
        _params(config, **{P_BATCH: str(_batch_of(bundle, max_batch))})
        config.dynamic_batching.SetInParent()
        if buckets:  # the batcher forms batches of a bucket's size where it can: those pad nothing
            config.dynamic_batching.preferred_batch_size.extend(b for b in buckets if b <= max_batch)
    return ModelFolder(name=name, config=config, header=_header(bundle, "graph"),
                       files={"model.py": TEMPLATE}, trees={BUNDLE_DIR: bundle.path})


def branch_model_name(name: str, branch_name: str) -> str:
    return f"{name}_{branch_name}"


def ensemble_models(bundle: Bundle, name: str, *, max_batch: int = 0, instances: int = 1,
                    gpus: list[int] | None = None) -> list[ModelFolder]:
    """One tensorrt_plan model per branch engine and the ensemble that wires them (mode "ensemble")."""
    mc = model_config_pb2()
    plan = bundle.plan
    if plan.backend != "tensorrt":
        raise ParastreamError(f"--mode ensemble serves each branch as a Triton tensorrt_plan model, but the bundle "
                              f"{bundle.path} was built with --backend {plan.backend}; rebuild it with --backend tensorrt, "
                              "or export with --mode graph")
    if MANIFEST_KEY in bundle.manifest:
        raise ParastreamError(f"--mode ensemble: {bundle.path} ends in a data-dependent tail that runs in onnxruntime "
                              "after the engines, which an ensemble of TensorRT engines has no step for; export with "
                              "--mode graph")
    if max_batch:
        raise ParastreamError(f"--mode ensemble with --max-batch {max_batch}: the bundle's TensorRT engines have static "
                              "shapes and Triton batches a tensorrt_plan model only along a dynamic batch dimension; "
                              "export with --max-batch 0, or use --mode graph")
    for spec in plan.tensors.values():
        if not spec.shape:
            raise ParastreamError(f"--mode ensemble: tensor {spec.name!r} is a scalar, which a Triton tensorrt_plan "
                                  "model cannot declare; use --mode graph")
    model_inputs = {t.name for t in plan.inputs}
    consumed = {t for b in plan.branches for t in b.inputs}
    for t in plan.outputs:
        if t.name in model_inputs:
            raise ParastreamError(f"--mode ensemble: output {t.name!r} is also a model input, which a Triton ensemble "
                                  "cannot pass through; use --mode graph")
    unused = sorted(model_inputs - consumed)
    if unused:
        raise ParastreamError(f"--mode ensemble: input(s) {unused} feed no branch, which a Triton ensemble refuses; "
                              "use --mode graph")

    header = _header(bundle, "ensemble")
    models = []
    ensemble = mc.ModelConfig(name=name, platform="ensemble", max_batch_size=0)
    ensemble.input.extend(_io(mc.ModelInput, t, 0) for t in plan.inputs)
    ensemble.output.extend(_io(mc.ModelOutput, t, 0) for t in plan.outputs)
    for bid in plan.launch_order:  # steps in a topological order, for the reader; Triton follows the data
        b = plan.branches[bid]
        engine = bundle.engine_path(b)
        if not engine.is_file():
            raise ParastreamError(f"{engine}: engine of {b.name} is missing; rebuild the bundle")
        step_name = branch_model_name(name, b.name)
        cfg = mc.ModelConfig(name=step_name, platform="tensorrt_plan", max_batch_size=0)
        cfg.input.extend(_io(mc.ModelInput, plan.tensors[t], 0) for t in b.inputs)
        cfg.output.extend(_io(mc.ModelOutput, plan.tensors[t], 0) for t in b.outputs)
        cfg.instance_group.add(kind=mc.ModelInstanceGroup.Kind.Value("KIND_GPU"), count=instances, gpus=gpus or [])
        _params(cfg, **{P_ENSEMBLE: name, P_BACKEND: plan.backend})
        models.append(ModelFolder(name=step_name, config=cfg, header=header, files={"model.plan": engine}))
        step = ensemble.ensemble_scheduling.step.add(model_name=step_name, model_version=-1)
        # engine tensors keep the model's tensor names, so each key maps to the ensemble tensor of that name
        for t in b.inputs:
            step.input_map[t] = t
        for t in b.outputs:
            step.output_map[t] = t
    models.append(ModelFolder(name=name, config=ensemble, header=header))
    return models


# -- export ----------------------------------------------------------------------------------------
_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")


def check_options(name: str, mode: str, max_batch: int, instances: int, gpus: list[int] | None = None) -> None:
    if not name or not _NAME_RE.match(name) or name in (".", ".."):
        raise ParastreamError(f"--name {name!r}: a Triton model name here is a folder name of letters, digits, "
                              "'_', '-' and '.', not starting with '.' or '-'")
    if mode not in MODES:
        raise ParastreamError(f"--mode {mode!r} is not one of: {', '.join(MODES)}")
    if int(max_batch) < 0:
        raise ParastreamError(f"--max-batch {max_batch}: must be 0 (no batching) or more")
    if int(instances) < 1:
        raise ParastreamError(f"--instances {instances}: must be at least 1")
    if gpus is not None:
        given = ",".join(map(str, gpus))
        if not gpus or any(isinstance(g, bool) or not isinstance(g, int) or g < 0 for g in gpus):
            raise ParastreamError(f"--gpus {given!r}: give GPU numbers (0 or more) separated by commas, e.g. 0,1")
        if len(set(gpus)) != len(gpus):
            raise ParastreamError(f"--gpus {given}: names a GPU twice")


def _stale_branch_models(repo: Path, name: str, keep: set[str]) -> list[Path]:
    """Branch models of an earlier ensemble export of ``name`` that the new export does not write."""
    from google.protobuf import text_format

    stale = []
    for d in sorted(repo.glob(f"{name}_branch_*")):
        if d.name in keep or not (d / "config.pbtxt").is_file():
            continue
        try:
            params = read_config(d / "config.pbtxt").parameters
        except (text_format.ParseError, UnicodeDecodeError, OSError):
            continue
        if P_ENSEMBLE in params and params[P_ENSEMBLE].string_value == name:
            stale.append(d)
    return stale


def export_triton(bundle: Bundle | str | Path, repo: str | Path, *, name: str, mode: str = "graph", max_batch: int = 0,
                  instances: int = 1, gpus: list[int] | None = None, force: bool = False) -> Path:
    """Write the bundle into the Triton model repository ``repo`` as model ``name``; return ``repo/name``.

    ``mode="graph"``: one Python-backend model replaying the bundle's plan; ``mode="ensemble"``: one
    tensorrt_plan model per branch plus an ensemble (TensorRT bundles only).  An existing model folder
    is replaced only with ``force`` (and then also the branch models an earlier ensemble export of
    ``name`` left behind).  ``instances``: Triton's instance_group count, instances on EACH GPU they are
    placed on; ``gpus``: the GPUs they are placed on (instance_group ``gpus``; default every GPU of the server).
    """
    check_options(name, mode, max_batch, instances, gpus)
    if not isinstance(bundle, Bundle):
        bundle = Bundle.open(bundle)
    if mode == "graph":
        models = [graph_model(bundle, name, max_batch=int(max_batch), instances=int(instances), gpus=gpus)]
    else:
        models = ensemble_models(bundle, name, max_batch=int(max_batch), instances=int(instances), gpus=gpus)

    repo = Path(repo)
    if repo.exists() and not repo.is_dir():
        raise ParastreamError(f"{repo}: not a folder; give a model repository folder")
    for m in models:
        check_target(repo / m.name, kind="triton", force=force, protect=(bundle.path,), option=f"model {m.name!r} of REPO")
    stale = _stale_branch_models(repo, name, {m.name for m in models}) if repo.is_dir() else []
    if stale and not force:
        raise ParastreamError(f"{stale[0]} belongs to an earlier ensemble export of {name!r}; pass --force to replace it")
    for d in stale:
        reason = why_not_ours(d, "triton")
        if reason:
            raise ParastreamError(f"{d} looks like a branch model of an earlier export of {name!r}, but {reason}; "
                                  "remove it yourself, or export under another --name")

    try:
        repo.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ParastreamError(f"{repo}: cannot create the model repository ({e.strerror or e})") from None
    with staging(repo / name, "triton", install=lambda tmp: _move_into_place(tmp, repo, [m.name for m in models], stale)) as tmp:
        for m in models:
            m.write(tmp)
        problems = validate_repository(tmp)
        if problems:
            raise ParastreamError(f"export-triton wrote an invalid repository (a parastream bug): {problems[0]}")
    return repo / name


def _move_into_place(staged: Path, repo: Path, names: list[str], stale: list[Path]) -> None:
    """Rename each staged model folder into REPO (replacing an earlier export of it); stale branch models go last."""
    for n in names:
        move_into_place(staged / n, repo / n, "triton")
    for d in stale:
        shutil.rmtree(d, ignore_errors=True)


# -- validation ------------------------------------------------------------------------------------
def read_config(path: Path):
    """Parse a config.pbtxt strictly (an unknown field or a bad enum value raises text_format.ParseError)."""
    from google.protobuf import text_format

    mc = model_config_pb2()
    return text_format.Parse(Path(path).read_text(), mc.ModelConfig())


def _dims_match(a, b) -> bool:
    return len(a) == len(b) and all(x == y or x == -1 or y == -1 for x, y in zip(a, b))


def _io_problems(where: str, config) -> list[str]:
    mc = model_config_pb2()
    problems = []
    seen: set[str] = set()
    for kind, ios in (("input", config.input), ("output", config.output)):
        for io in ios:
            if not io.name:
                problems.append(f"{where}: an {kind} has no name")
            if io.name in seen:
                problems.append(f"{where}: tensor {io.name!r} is declared twice")
            seen.add(io.name)
            if io.data_type == mc.DataType.Value("TYPE_INVALID"):
                problems.append(f"{where}: {kind} {io.name!r} has no data_type")
            if not io.dims:
                problems.append(f"{where}: {kind} {io.name!r} has no dims (Triton needs at least one)")
            if any(d < 1 and d != -1 for d in io.dims):
                problems.append(f"{where}: {kind} {io.name!r} has dims {list(io.dims)}; each must be >= 1 or -1")
    return problems


def _bundle_problems(where: str, config, folder: Path) -> list[str]:
    """A graph-mode model: its bundle opens (hashes hold) and the config agrees with the bundle's plan."""
    mc = model_config_pb2()
    problems = []
    params = {k: v.string_value for k, v in config.parameters.items()}
    try:
        bundle = Bundle.open(inside(folder, params[P_BUNDLE], f"config.pbtxt's {P_BUNDLE}"))
    except ParastreamError as e:
        return [f"{where}: {e}"]
    plan = bundle.plan
    mb = config.max_batch_size
    if params.get(P_BACKEND, plan.backend) != plan.backend:
        problems.append(f"{where}: {P_BACKEND} is {params[P_BACKEND]!r} but the bundle was built with {plan.backend!r}")
    record = bundle.manifest.get("buckets") or {}
    dynamic = grid_dynamic_dims(record) if "axes" in record else {}
    try:
        outputs = served_outputs(bundle)
    except ParastreamError as e:
        return [f"{where}: {e}"]
    if mb > 0 and MANIFEST_KEY in bundle.manifest:
        problems.append(f"{where}: max_batch_size {mb} but the bundle ends in a data-dependent tail; it takes 0")
    for kind, specs, ios in (("input", plan.inputs, config.input), ("output", outputs, config.output)):
        declared = {io.name: io for io in ios}
        if sorted(declared) != sorted(t.name for t in specs):
            problems.append(f"{where}: {kind}s {sorted(declared)} differ from the bundle's {sorted(t.name for t in specs)}")
            continue
        for spec in specs:
            io = declared[spec.name]
            want_type = TRITON_DTYPES.get(spec.dtype)
            if mc.DataType.Name(io.data_type) != want_type:
                problems.append(f"{where}: {kind} {spec.name!r} is {mc.DataType.Name(io.data_type)}, the bundle has {spec.dtype} ({want_type})")
            want = list(_io(mc.ModelInput, spec, mb, dynamic.get(spec.name)).dims)  # -1 on a grid's dynamic axes
            if list(io.dims) != want:
                problems.append(f"{where}: {kind} {spec.name!r} has dims {list(io.dims)}, the bundle's shape {spec.shape} "
                                f"with max_batch_size {mb} gives {want}")
            if mb > 0 and (not spec.shape or spec.shape[0] < mb):
                problems.append(f"{where}: max_batch_size {mb} but the bundle's {spec.name!r} has shape {spec.shape}")
    return problems


def _ensemble_problems(where: str, config, configs: dict) -> list[str]:
    """Triton's own ensemble checks: steps resolve, maps match the step models, one producer per tensor, data flows."""
    mc = model_config_pb2()
    problems = []
    if config.instance_group:
        problems.append(f"{where}: an ensemble takes no instance_group")
    steps = config.ensemble_scheduling.step
    if not steps:
        return problems + [f"{where}: ensemble_scheduling has no step"]
    batching = config.max_batch_size > 0
    # tensor -> (data_type, dims, batching, who declared it)
    declared: dict[str, tuple] = {}
    for io in config.input:
        declared[io.name] = (io.data_type, list(io.dims), batching, f"ensemble input {io.name!r}")
    for io in config.output:
        declared.setdefault(io.name, (io.data_type, list(io.dims), batching, f"ensemble output {io.name!r}"))
    ensemble_inputs = {io.name for io in config.input}
    producers: dict[str, list[int]] = {}
    consumers: dict[str, list[int]] = {}

    def agree(tensor: str, data_type, dims, step_batching: bool, who: str) -> None:
        if tensor not in declared:
            declared[tensor] = (data_type, dims, step_batching, who)
            return
        t0, d0, b0, who0 = declared[tensor]
        if t0 != data_type:
            problems.append(f"{where}: ensemble tensor {tensor!r} is {mc.DataType.Name(t0)} in {who0} but "
                            f"{mc.DataType.Name(data_type)} in {who}")
        full0 = ([-1] if b0 else []) + list(d0)
        full1 = ([-1] if step_batching else []) + list(dims)
        if not _dims_match(d0, dims) and not _dims_match(full0, full1):
            problems.append(f"{where}: ensemble tensor {tensor!r} has dims {list(d0)} in {who0} but {list(dims)} in {who}")

    for i, step in enumerate(steps):
        label = f"step {i} ({step.model_name})"
        sub = configs.get(step.model_name)
        if sub is None:
            problems.append(f"{where}: {label} names model {step.model_name!r}, which the repository does not have")
            continue
        if sub.name == config.name:
            problems.append(f"{where}: {label} names the ensemble itself")
            continue
        if sub.max_batch_size and sub.max_batch_size < config.max_batch_size:
            problems.append(f"{where}: max_batch_size {config.max_batch_size} exceeds {step.model_name}'s {sub.max_batch_size}")
        if not step.input_map or not step.output_map:
            problems.append(f"{where}: {label} needs both input_map and output_map")
        ins = {io.name: io for io in sub.input}
        outs = {io.name: io for io in sub.output}
        sub_batching = sub.max_batch_size > 0
        for key, tensor in step.input_map.items():
            if key not in ins:
                problems.append(f"{where}: {label} maps ensemble tensor {tensor!r} to {key!r}, which is no input of {step.model_name}")
                continue
            agree(tensor, ins[key].data_type, list(ins[key].dims), sub_batching, f"input {key!r} of {step.model_name}")
            consumers.setdefault(tensor, []).append(i)
        for key, io in ins.items():
            if key not in step.input_map and not io.optional:
                problems.append(f"{where}: {label} leaves input {key!r} of {step.model_name} unmapped")
        for key, tensor in step.output_map.items():
            if key not in outs:
                problems.append(f"{where}: {label} maps {key!r}, which is no output of {step.model_name}, to {tensor!r}")
                continue
            agree(tensor, outs[key].data_type, list(outs[key].dims), sub_batching, f"output {key!r} of {step.model_name}")
            producers.setdefault(tensor, []).append(i)

    for tensor, who in sorted(producers.items()):
        if len(who) > 1:
            problems.append(f"{where}: ensemble tensor {tensor!r} has {len(who)} producers (steps {who}); it must have exactly one")
        if tensor in ensemble_inputs:
            problems.append(f"{where}: ensemble input {tensor!r} is also produced by step {who[0]}")
    for tensor, who in sorted(consumers.items()):
        if tensor not in producers and tensor not in ensemble_inputs:
            problems.append(f"{where}: ensemble tensor {tensor!r} (read by step {who[0]}) has no producer and is no ensemble input")
    for io in config.output:
        if io.name not in producers:
            problems.append(f"{where}: ensemble output {io.name!r} is produced by no step")
    outputs = {io.name for io in config.output}
    for tensor in ensemble_inputs:
        if tensor not in consumers:
            problems.append(f"{where}: ensemble input {tensor!r} is used by no step")
    for tensor in producers:
        if tensor not in consumers and tensor not in outputs:
            problems.append(f"{where}: ensemble tensor {tensor!r} is produced but neither consumed nor an ensemble output")

    # data flow: every step must become runnable from the ensemble inputs (no cycles, nothing dangling)
    ready = set(ensemble_inputs)
    pending = list(range(len(steps)))
    progress = True
    while pending and progress:
        progress = False
        for i in list(pending):
            if all(t in ready for t in steps[i].input_map.values()):
                ready.update(steps[i].output_map.values())
                pending.remove(i)
                progress = True
    if pending:
        problems.append(f"{where}: step(s) {pending} never get all their inputs (a cycle or a missing producer)")
    return problems


def validate_repository(repo: str | Path) -> list[str]:
    """Check a Triton model repository the way parastream writes them; return the problems found (empty: valid).

    A hidden folder is a problem (Triton takes it for a model too).  Every model folder must have a
    config.pbtxt that parses strictly with Triton's ModelConfig protobuf and names the folder, well-formed inputs and outputs, and a version
    folder with what its platform loads: ``model.py`` for the Python backend (and, for a parastream
    graph model, a bundle whose hashes hold and whose plan agrees with the config), ``model.plan`` for
    tensorrt_plan.  Ensembles are checked as Triton checks them: every step names a model of the
    repository and maps exactly its inputs and outputs, data types and dims agree across steps, every
    ensemble tensor has exactly one producer, and every consumed tensor has a producer or is an input.
    """
    from google.protobuf import text_format

    repo = Path(repo)
    if not repo.is_dir():
        return [f"{repo}: no such folder"]
    problems: list[str] = []
    configs: dict[str, object] = {}
    # Triton takes every folder of a repository for a model, hidden ones too: tritonserver 2.51 on the
    # staging folder an interrupted export leaves (.NAME.XXXX.partial/NAME/...) logs "failed to load
    # model '.NAME.XXXX.partial'" and, with its default --exit-on-error, does not start at all.
    hidden = sorted(d for d in repo.iterdir() if d.is_dir() and d.name.startswith("."))
    for d in hidden:
        problems.append(f"{d}: a hidden folder, which Triton still loads as a model (and fails on); "
                        "remove it (an interrupted export-triton leaves one behind)")
    folders = sorted(d for d in repo.iterdir() if d.is_dir() and not d.name.startswith("."))
    if not folders:
        return problems + [f"{repo}: no model folders"]
    for d in folders:
        cfg_path = d / "config.pbtxt"
        if not cfg_path.is_file():
            problems.append(f"{cfg_path}: missing")
            continue
        try:
            config = read_config(cfg_path)
        except text_format.ParseError as e:
            problems.append(f"{cfg_path}: does not parse as Triton's ModelConfig: {e}")
            continue
        except UnicodeDecodeError:
            problems.append(f"{cfg_path}: not text (config.pbtxt is Triton's ModelConfig in protobuf text format)")
            continue
        except OSError as e:
            problems.append(f"{cfg_path}: cannot be read ({e.strerror or e})")
            continue
        if config.name and config.name != d.name:
            problems.append(f"{cfg_path}: name {config.name!r} differs from its folder {d.name!r}")
        configs[d.name] = config

    for folder_name, config in configs.items():
        d = repo / folder_name
        where = str(d / "config.pbtxt")
        problems += _io_problems(where, config)
        if config.max_batch_size < 0:
            problems.append(f"{where}: max_batch_size {config.max_batch_size} is negative")
        for group in config.instance_group:
            if group.gpus and group.kind in (group.KIND_CPU, group.KIND_MODEL):
                problems.append(f"{where}: an instance_group of kind {group.Kind.Name(group.kind)} lists gpus "
                                f"{list(group.gpus)}, which Triton refuses; only GPU instances are placed on GPUs")
            if len(set(group.gpus)) != len(group.gpus) or any(g < 0 for g in group.gpus):
                problems.append(f"{where}: instance_group gpus {list(group.gpus)}: each GPU once, numbered from 0")
        versions = sorted(v for v in d.iterdir() if v.is_dir() and v.name.isdigit())
        if not versions:
            problems.append(f"{d}: no version folder (such as {d / VERSION})")
            continue
        latest = max(versions, key=lambda v: int(v.name))
        params = {k: v.string_value for k, v in config.parameters.items()}
        if config.platform == "ensemble":
            problems += _ensemble_problems(where, config, configs)
        elif config.backend == "python":
            if not (latest / "model.py").is_file():
                problems.append(f"{latest / 'model.py'}: missing")
            if P_BUNDLE in params:
                problems += _bundle_problems(where, config, latest)
        elif config.platform == "tensorrt_plan" or config.backend == "tensorrt":
            if not (latest / (config.default_model_filename or "model.plan")).is_file():
                problems.append(f"{latest / (config.default_model_filename or 'model.plan')}: missing")
        if config.HasField("ensemble_scheduling") and config.platform != "ensemble":
            problems.append(f"{where}: ensemble_scheduling on a model whose platform is not \"ensemble\"")
    return problems
