"""Load and check an ONNX model: everything that can be wrong with the input stops here.

Each failure is a ParastreamError (exit 2) whose one-line message names the file,
the node or the option: a file that is not ONNX or is truncated, a model that
fails onnx.checker, missing external-data files, an input with unknown dimensions
and no ``--shapes``, a ``--shapes`` entry that names no input or has the wrong rank.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnx
from onnx import helper, shape_inference

from parastream.launcher.errors import ParastreamError
from parastream.core import dataflow
from parastream.core.tensors import TensorSpec, random_feeds, value_info_spec

if TYPE_CHECKING:
    import onnx_graphsurgeon as gs

    from .host_tail import HostTail


def parse_shapes(text: str | None) -> dict[str, list[int]]:
    """Parse ``--shapes name:1x3x224x224,other:1x128`` into ``{name: [dims]}``."""
    shapes: dict[str, list[int]] = {}
    if not text:
        return shapes
    for entry in text.split(","):
        entry = entry.strip()
        if not entry:
            continue
        name, sep, dims = entry.rpartition(":")
        if not sep or not name or not dims:
            raise ParastreamError(f"--shapes entry {entry!r} is not NAME:D1xD2x...; e.g. --shapes input:1x3x224x224")
        parts = dims.lower().split("x")
        if not all(re.fullmatch(r"[0-9]{1,12}", d.strip()) for d in parts):
            raise ParastreamError(f"--shapes entry {entry!r}: dimensions must be integers (digits 0-9) separated by 'x'")
        values = [int(d) for d in parts]
        if any(v <= 0 for v in values):
            raise ParastreamError(f"--shapes entry {entry!r}: dimensions must be positive")
        if name in shapes:
            raise ParastreamError(f"--shapes names {name!r} twice; give each input once")
        shapes[name] = values
    return shapes


def _dims(vi: onnx.ValueInfoProto) -> list[int | str | None]:
    t = vi.type.tensor_type
    if not t.HasField("shape"):
        return None  # type: ignore[return-value]
    out: list[int | str | None] = []
    for d in t.shape.dim:
        if d.HasField("dim_value"):
            out.append(int(d.dim_value))
        elif d.HasField("dim_param"):
            out.append(d.dim_param)
        else:
            out.append(None)
    return out


def spec_of(vi: onnx.ValueInfoProto) -> TensorSpec:
    """``vi``'s TensorSpec, its shape static (``core.tensors.value_info_spec``; ValueError otherwise)."""
    return value_info_spec(vi)


def graph_of(model: onnx.ModelProto):
    """``model`` (shape-inferred) in onnx-graphsurgeon, toposorted: the graph the stages of a build plan on."""
    import onnx_graphsurgeon as gs

    from parastream.rewrite.ir import toposort

    return toposort(gs.import_onnx(model))  # graphsurgeon's order, without its recursive walk


@dataclass
class LoadedModel:
    path: Path
    model: onnx.ModelProto  # checked, static shapes, shape-inferred, every node named
    original: onnx.ModelProto  # as loaded (external data inlined), for the reference run
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    # ``model`` in graphsurgeon (graph_of: toposorted, the inferred shapes on its tensors), imported once here and
    # carried to the plan.  The stages only read it; one that changes a graph works on a copy (extract_branch
    # and the rewrite search copy it), so it stays the graph of ``model``.  None: not imported.
    graph: gs.Graph | None = None
    # ``original`` serialized (``original_bytes``): the file's own bytes where the original is the file as read
    original_data: bytes | None = None
    # the model's data-dependent tail, cut off by ``load_model(host_tail=True)`` (pipeline/host_tail.py): then
    # ``model``, ``original`` and ``outputs`` are the static part's, whose outputs include the tensors it reads
    tail: "HostTail | None" = None

    def original_bytes(self) -> bytes:
        """``original`` serialized, once: what ONNX Runtime loads for the early check and for the verification's
        reference.  Where the original is the file as read (no external data, every node named, no input shape
        fixed) that is the file's bytes, already read; serializing a 340 MB ViT-B/16 took 1.7-2.9 s on a 2-core
        machine, twice per build.  They are held as long as the LoadedModel (a build: the model file's size in
        memory beside its parsed form, which the two serializations also took while they lived)."""
        if self.original_data is None:
            self.original_data = self.original.SerializeToString()
        return self.original_data


def _non_text_string(message, where: str = "model") -> str | None:
    """Where a string field of ``message`` holds bytes that are not UTF-8 (protobuf hands such proto2 strings
    back as ``bytes``, which onnx and every tool after it would trip over)."""
    from google.protobuf.descriptor import FieldDescriptor

    from parastream.core.protos import is_repeated as repeated

    for field, value in message.ListFields():
        if field.type == FieldDescriptor.TYPE_STRING:
            values = value if repeated(field) else [value]
            if any(isinstance(v, bytes) for v in values):
                return f"{where}.{field.name}"
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            values = value if repeated(field) else [value]
            for i, v in enumerate(values):
                found = _non_text_string(v, f"{where}.{field.name}" + (f"[{i}]" if repeated(field) else ""))
                if found:
                    return found
    return None


def read_model(path: str | Path) -> onnx.ModelProto:
    return read_model_and_bytes(path)[0]


def read_model_and_bytes(path: str | Path) -> tuple[onnx.ModelProto, bytes | None]:
    """The model, and the file's bytes when they hold the whole model (None where tensors keep their data in
    external files, which the model returned has inlined)."""
    path = Path(path)
    try:
        if not path.exists():
            raise ParastreamError(f"{path}: no such file")
        if not path.is_file():
            raise ParastreamError(f"{path}: not a file")
        data = path.read_bytes()
    except OSError as e:
        raise ParastreamError(f"{path}: cannot read the model ({e.strerror or type(e).__name__})") from None
    if not data:
        raise ParastreamError(f"{path}: empty file, not an ONNX model")
    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except Exception as e:  # google.protobuf.message.DecodeError and friends
        raise ParastreamError(f"{path}: not an ONNX model (the protobuf does not parse: {e}); the file may be truncated") from None
    if not model.HasField("graph") or not model.opset_import:
        raise ParastreamError(f"{path}: not an ONNX model (no graph or no opset_import)")
    bad = _non_text_string(model)
    if bad:
        raise ParastreamError(f"{path}: {bad} is not UTF-8 text; names in an ONNX model must be")
    # External data: tensors whose bytes live in files beside the model.
    if not _check_external_data(model, path):
        return model, data
    try:
        onnx.load_external_data_for_model(model, str(path.parent))
    except (FileNotFoundError, OSError) as e:
        missing = getattr(e, "filename", None) or str(e)
        raise ParastreamError(f"{path}: external data file {missing} is missing; keep the .data files beside the model") from None
    except Exception as e:  # noqa: BLE001 - onnx raises ValueError for paths outside the folder
        raise ParastreamError(f"{path}: cannot load external data: {e}") from None
    return model, None


def _check_external_data(model: onnx.ModelProto, path: Path) -> bool:
    """Every external-data file is a plain file inside the model's folder; whether any tensor has one.

    onnx checks this itself from 1.16 on (and pyproject asks for it), but older onnx followed a
    symbolic link out of the folder, and none checks for a FIFO or a device, which would hang the read.
    """
    from onnx.external_data_helper import ExternalDataInfo, _get_all_tensors, uses_external_data

    folder = path.parent.resolve()
    external = False
    for t in _get_all_tensors(model):
        if not uses_external_data(t):
            continue
        external = True
        try:
            location = ExternalDataInfo(t).location
        except (ValueError, TypeError) as e:  # onnx checks offset and length here
            raise ParastreamError(f"{path}: tensor {t.name!r}: bad external data reference ({e})") from None
        where = folder / location
        try:
            real = where.resolve()
        except (OSError, RuntimeError):  # a link loop
            raise ParastreamError(f"{path}: tensor {t.name!r} keeps its data in {location!r}, a symbolic link loop") from None
        if not location or Path(location).is_absolute() or ".." in Path(location).parts or folder not in real.parents:
            raise ParastreamError(f"{path}: tensor {t.name!r} keeps its data in {location!r}, outside the model's folder; "
                                  "keep the .data files beside the model")
        if where.exists() and not real.is_file():
            raise ParastreamError(f"{path}: tensor {t.name!r} keeps its data in {location!r}, which is not a plain file")
    return external


def _check(model: onnx.ModelProto, path: Path, data: bytes | None = None) -> None:
    """``onnx.checker`` on the model as read from ``path``.

    The checker is given the file's bytes as read (``data``), or else the path (weights in external files, which
    only the path-based check finds): never ``model``, which it would serialize whole into C++ (for a 350 MB
    model 1.9 s of the load).  The bytes spare the checker reading the file again: 0.1-0.2 s against 0.3-0.5 s
    by path for NASNet-A Large's 355 MB.  ``model`` is what ``read_model`` read from it."""
    try:
        onnx.checker.check_model(data if data is not None else str(path), full_check=False)
    except onnx.checker.ValidationError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else "invalid model"
        raise ParastreamError(f"{path}: fails onnx.checker: {first}") from None
    except Exception as e:  # noqa: BLE001 - e.g. opset newer than this onnx knows
        raise ParastreamError(f"{path}: fails onnx.checker: {e}") from None


def name_nodes(model: onnx.ModelProto, *, assign: bool = True) -> list[str]:
    """Unique node names in graph order: a node keeps its name unless it has none (``<Op>_<index>``) or an
    earlier node already took it (``<name>_<k>``, the first free k).

    Plans, analyses and error messages refer to nodes by these names.  With ``assign`` (the loader's way)
    they are written into the model; ``assign=False`` only reports them and leaves the model as it is.
    """
    names: list[str] = []
    seen: set[str] = set()
    for i, node in enumerate(model.graph.node):
        name = node.name
        if not name or name in seen:
            base = name or f"{node.op_type}_{i}"
            name, k = base, 1
            while name in seen:
                name, k = f"{base}_{k}", k + 1
            if assign:
                node.name = name
        seen.add(name)
        names.append(name)
    return names


def _fmt(dims) -> str:
    return "x".join(str(d) for d in dims)


def _shown(dims) -> str:
    """Declared dimensions as a reader sees them: ``[batch, seq]``, ``[1, 3, ?, ?]``; ``?`` for no shape."""
    return "?" if dims is None else "[" + ", ".join("?" if d is None else str(d) for d in dims) + "]"


def _batch_dynamic(dims: list[int | str | None] | None) -> bool:
    """Whether an input so declared has a dynamic first dimension, the one ``--batch`` gives."""
    return bool(dims) and not isinstance(dims[0], int)


@dataclass
class InputBinding:
    """The static shapes of a model's inputs from ``--shapes`` (and ``--batch``), dimension names bound across inputs.

    A dim_param is one dimension wherever it appears (ONNX: the same name is the same size at run time), so a
    size given for it on one input fixes it on every input that names it.  ``shapes`` has every input that
    ends up static; ``unknown`` every input still not (its declared dims with the bound names replaced), in
    model order; ``example`` a ``--shapes`` value that makes every input static: the user's entries, and for
    each unknown input its declared static sizes, the sizes bound so far, 1 for a batch-like leading
    dimension and 128 elsewhere, one size per dimension name."""
    shapes: dict[str, list[int]]
    unknown: dict[str, list[int | str | None] | None]
    example: str


def _bind_input_shapes(model: onnx.ModelProto, shapes: dict[str, list[int]], path: Path, *, batch: int | None = None
                      ) -> InputBinding:
    """Check ``shapes`` against the model's inputs and bind every dimension name they size (see InputBinding).

    ``batch``: the first dimension of every input whose first dimension is dynamic is ``batch``, whatever
    ``--shapes`` gives it (``--batch`` owns the batch axis; --shapes the other axes)."""
    vis = {vi.name: vi for vi in model.graph.input}
    init_names = {t.name for t in model.graph.initializer}
    real = [n for n in vis if n not in init_names]
    declared = {n: _dims(vis[n]) for n in real}
    batched = {n for n in real if batch is not None and _batch_dynamic(declared[n])}
    given: dict[str, list[int]] = {}
    for name, dims in shapes.items():
        if name not in vis or name in init_names:
            raise ParastreamError(f"--shapes names {name!r}, which is not an input of {path.name}; its inputs are {real}")
        cur = declared[name]
        if cur is not None and len(cur) != len(dims):
            raise ParastreamError(f"--shapes {name}:{_fmt(dims)} has rank {len(dims)}, but input {name!r} of {path.name} "
                                  f"has rank {len(cur)}")
        given[name] = [batch, *dims[1:]] if name in batched else list(dims)
        for i, (c, d) in enumerate(zip(cur or [], given[name])):
            if isinstance(c, int) and c != d:
                raise ParastreamError(f"--shapes {name}: dimension {i} is fixed to {c} in {path.name}, not {d}")

    bound: dict[str, tuple[int, str]] = {}  # dimension name -> (size, what gave it)

    def bind(param: str, size: int, source: str) -> None:
        if param not in bound:
            bound[param] = (size, source)
            return
        was, first = bound[param]
        if was == size:
            return
        if first == source:
            raise ParastreamError(f"{source} gives dimension {param!r} two sizes, {was} and {size}; "
                                  f"input dimensions named {param!r} in {path.name} are one dimension and take one size")
        raise ParastreamError(f"{first} and {source} give dimension {param!r} the sizes {was} and {size}; inputs that "
                              f"name {param!r} in {path.name} share that dimension: give them one size")

    for name in sorted(batched, key=real.index):
        if isinstance(declared[name][0], str):
            bind(declared[name][0], batch, f"--batch (batch {batch} for {name!r})")
    for name, dims in given.items():
        source = f"--shapes {name}:{_fmt(shapes[name])}"
        for c, d in zip(declared[name] or [], dims):
            if isinstance(c, str):
                bind(c, d, source)

    static: dict[str, list[int]] = {}
    unknown: dict[str, list[int | str | None] | None] = {}
    for name in real:
        if name in given:
            static[name] = given[name]
            continue
        cur = declared[name]
        if cur is None:
            unknown[name] = None
            continue
        dims = [bound[d][0] if isinstance(d, str) and d in bound else d for d in cur]
        if name in batched:
            dims[0] = batch
        if all(isinstance(d, int) for d in dims):
            if any(not isinstance(d, int) for d in cur):
                static[name] = dims  # type: ignore[assignment]
        else:
            unknown[name] = [cur[0], *dims[1:]] if name in batched else dims  # the batch axis shown by its name
    return InputBinding(static, unknown, _example_shapes(real, shapes, unknown, bound, batched))


def _example_shapes(real: list[str], shapes: dict[str, list[int]], unknown: dict, bound: dict, batched: set[str]) -> str:
    chosen = {k: v for k, (v, _src) in bound.items()}
    entries = []
    for name in real:
        if name in shapes:
            entries.append(f"{name}:{_fmt(shapes[name])}")
        elif name in unknown:
            dims = unknown[name]
            if dims is None:
                entries.append(f"{name}:D1xD2x...")
                continue
            out = []
            for i, d in enumerate(dims):
                if isinstance(d, int):
                    out.append(d)
                    continue
                if i == 0 and name in batched:
                    out.append(1)  # --batch replaces it
                    continue
                size = chosen.get(d) if isinstance(d, str) else None
                if size is None:
                    size = 1 if i == 0 and len(dims) > 1 else 128
                    if isinstance(d, str):
                        chosen[d] = size
                out.append(size)
            entries.append(f"{name}:{_fmt(out)}")
    return ",".join(entries)


def _unknown_inputs(unknown: dict) -> str:
    """``input 'x' [N, seq] has`` or ``inputs 'a' [batch, seq] and 'b' [batch, seq] have``."""
    parts = [f"{name!r} {_shown(dims)}" for name, dims in unknown.items()]
    if len(parts) == 1:
        return f"input {parts[0]} has"
    return f"inputs {', '.join(parts[:-1])} and {parts[-1]} have"


def _fix_input_shapes(model: onnx.ModelProto, shapes: dict[str, list[int]], path: Path) -> None:
    """Write the static shape of every input into ``model`` (_bind_input_shapes), or one error naming every
    input whose dimensions are still unknown, with a ``--shapes`` value that makes them known."""
    binding = _bind_input_shapes(model, shapes, path)
    if binding.unknown:
        raise ParastreamError(f"{path}: {_unknown_inputs(binding.unknown)} unknown dimensions; give them with "
                              f"--shapes {binding.example} (a dimension name shared by several inputs takes one size)")
    vis = {vi.name: vi for vi in model.graph.input}
    for name, dims in binding.shapes.items():
        shape = vis[name].type.tensor_type.shape
        shape.ClearField("dim")
        for d in dims:
            shape.dim.add().dim_value = d


def _check_declarations(model: onnx.ModelProto, path: Path) -> None:
    """Every declared tensor type is an ONNX type, and no tensor is declared twice with different types or shapes
    (graphsurgeon would keep one declaration, onnxruntime another, and the reference would not be the model)."""
    known = set(onnx.TensorProto.DataType.values())
    seen: dict[str, onnx.ValueInfoProto] = {}
    for vi in list(model.graph.input) + list(model.graph.output) + list(model.graph.value_info):
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type not in known:
            raise ParastreamError(f"{path}: tensor {vi.name!r} is declared with element type {vi.type.tensor_type.elem_type}, "
                                  "which is not an ONNX tensor type")
        if vi.name in seen and not _compatible(seen[vi.name], vi):
            raise ParastreamError(f"{path}: tensor {vi.name!r} is declared twice (graph inputs, outputs, value_info) "
                                  "with different types or shapes")
        seen[vi.name] = vi
    for t in model.graph.initializer:
        if t.data_type not in known or t.data_type == onnx.TensorProto.UNDEFINED:
            raise ParastreamError(f"{path}: initializer {t.name!r} has data type {t.data_type}, which is not an ONNX tensor type")


def _compatible(a: onnx.ValueInfoProto, b: onnx.ValueInfoProto) -> bool:
    """Two declarations of one tensor agree: same element type, and where both give a shape, the same rank and
    no two different fixed dimensions (symbolic names may differ: exporters name them as they like)."""
    ta, tb = a.type.tensor_type, b.type.tensor_type
    if a.type.WhichOneof("value") != b.type.WhichOneof("value") or ta.elem_type != tb.elem_type:
        return False
    da, db = _dims(a), _dims(b)
    if da is None or db is None:
        return True
    return len(da) == len(db) and all(not (isinstance(x, int) and isinstance(y, int)) or x == y for x, y in zip(da, db))


def _fold_once(model: onnx.ModelProto, *, fold_shapes: bool = True) -> tuple[onnx.ModelProto, int]:
    """One pass of graphsurgeon's constant folding (Shape ops folded where shapes are known); returns the
    model and how many nodes the pass removed."""
    import onnx_graphsurgeon as gs

    graph = gs.import_onnx(model)
    before = len(graph.nodes)
    if _fold_graph(graph, fold_shapes=fold_shapes) is None:
        return model, 0
    folded = _export_like(graph, model)
    return folded, before - len(folded.graph.node)


def _fold_graph(graph, *, fold_shapes: bool = True):
    """``graph`` folded in place (see ``_fold_once``), or None when folding failed (the graph is then half-folded:
    the caller starts again from its model)."""
    _fold_sliced_shapes(graph)
    try:
        return graph.fold_constants(fold_shapes=fold_shapes, error_ok=True).cleanup()
    except Exception:  # noqa: BLE001 - folding is an optimisation; an unfoldable graph still builds
        return None


def _export_like(graph, model: onnx.ModelProto) -> onnx.ModelProto:
    """``graph`` exported with ``model``'s IR version and opsets."""
    import onnx_graphsurgeon as gs

    out = gs.export_onnx(graph, do_type_check=False)
    out.ir_version = model.ir_version
    del out.opset_import[:]
    out.opset_import.extend(model.opset_import)
    return out


def _fold_sliced_shapes(graph) -> None:
    """Shape nodes with ``start``/``end`` (opset 15) of a static input become Constants of that slice.

    graphsurgeon's shape folding (0.6.1 ``fold_shape``) returns the input's whole shape and ignores the two
    attributes, so ``Shape(x, end=1)`` of an N x 16 input folded to [N, 16], not [N]: a wrong Reshape target
    (the batch read from an input, as exports of dynamic-batch models do).  Done here before it folds."""
    import onnx_graphsurgeon as gs

    for node in graph.nodes:
        if node.op != "Shape" or not ({"start", "end"} & set(node.attrs)) or not node.inputs:
            continue
        shape = node.inputs[0].shape
        if shape is None or any(not isinstance(d, int) or d < 0 for d in shape):
            continue
        start, end = int(node.attrs.get("start", 0)), node.attrs.get("end")
        values = np.array(list(shape)[start:None if end is None else int(end)], dtype=np.int64)  # ONNX clamps as Python slices
        node.inputs.clear()  # (graphsurgeon's list: clearing it also drops the node from the input's consumers)
        node.op, node.attrs = "Constant", {"value": gs.Constant(node.outputs[0].name + "_value", values)}


def _constants_to_initializers(model: onnx.ModelProto, graph=None, *, hold: bool = False):
    """Constant nodes that survived folding become initializers, so that no branch is a lone Constant.
    ``graph``: ``model`` already in graphsurgeon (changed in place), else it is imported.  ``hold``: return
    (the export with its large weights held out as placeholders, those weights by name) for an ``_infer`` to
    put back: exporting a weight copies its bytes into a TensorProto, ``make_graph`` and ``make_model`` copy them
    again, and inference sets them aside and puts them back (3.4 s of a BERT-base load's 5.8 s on the 2-core CPU);
    held, they are copied once, into the inferred model."""
    import onnx_graphsurgeon as gs

    from parastream.rewrite.ir import hold_large_weights

    graph = gs.import_onnx(model) if graph is None else graph
    for node in list(graph.nodes):
        if node.op == "Constant" and len(node.outputs) == 1:
            out = node.outputs[0]
            attr = node.attrs.get("value")
            if isinstance(attr, gs.Constant):
                const = gs.Constant(out.name, attr.values)
                for consumer in list(out.outputs):
                    consumer.inputs[:] = [const if t is out else t for t in consumer.inputs]
                if out in graph.outputs:
                    continue
                node.outputs.clear()
    graph.cleanup().toposort()
    if not hold:
        return _export_like(graph, model)
    held = hold_large_weights(graph)  # the graph's weights become placeholders: an adopting caller reads them back
    return _export_like(graph, model), held


def _fold_constants(model: onnx.ModelProto, path: Path | str = "the model"):
    """Fold shape arithmetic and Constant nodes now that input shapes are static; return (the folded model with
    its large weights held out, its graph, those weights by name: ``_static_shapes`` infers it and puts them back).  One graphsurgeon import: the graph that proves graphsurgeon can represent the model is the one
    folded, exported, and (``rewrite.ir.adopt_model``) carried to the plan."""
    import onnx_graphsurgeon as gs

    def unrepresentable(e: Exception) -> ParastreamError:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return ParastreamError(f"{path}: onnx-graphsurgeon cannot represent this model: {first}")

    # every later stage works on graphsurgeon's graph: a model it cannot import, or export once folded, stops here
    # (the folded graph's export is the model carried on, so it is also the check: no second export of the weights)
    try:
        graph = gs.import_onnx(model)
    except Exception as e:  # noqa: BLE001 - graphsurgeon raises ValueError, KeyError, TypeError ...
        raise unrepresentable(e) from None
    if _fold_graph(graph) is None:
        graph = gs.import_onnx(model)  # folding failed half-way through: the unfolded model, as _fold_once does
    try:
        folded, held = _constants_to_initializers(model, graph, hold=True)
        return folded, graph, held
    except Exception as e:  # noqa: BLE001
        raise unrepresentable(e) from None


def _infer(model: onnx.ModelProto, path: Path, held: dict | None = None) -> onnx.ModelProto:
    """``model`` shape-inferred; every caller replaces ``model`` by the result, so its large weights are not put
    back into it (``restore=False``: 0.6 s of a 350 MB model's load, per inference).  ``held``: weights ``model``
    holds out already (``_constants_to_initializers(hold=True)``), put into the result."""
    try:
        from parastream.rewrite.ir import infer

        return infer(model, strict=True, restore=False, held=held)  # large weights aside: inference reads only their shapes
    except Exception as e:  # noqa: BLE001 - InferenceError names the node
        raise ParastreamError(f"{path}: shape inference failed: {str(e).strip().splitlines()[0]}") from None


def _static(vi: onnx.ValueInfoProto) -> bool:
    t = vi.type.tensor_type
    return t.elem_type != 0 and t.HasField("shape") and all(d.HasField("dim_value") for d in t.shape.dim)


def unknown_tensors(model: onnx.ModelProto) -> list[tuple[onnx.NodeProto, str]]:
    """(node, output) for every node output, in graph order, that has no static shape and dtype."""
    known = {vi.name for vi in [*model.graph.value_info, *model.graph.output, *model.graph.input] if _static(vi)}
    known |= {t.name for t in model.graph.initializer}
    return [(n, o) for n in model.graph.node for o in n.output if o and o not in known]


def _fold_to_fixed_point(model: onnx.ModelProto, path: Path, aside: dict | None = None, *, inferred: bool = False,
                         max_passes: int = 12) -> onnx.ModelProto:
    """Constant folding and shape inference, alternated until a pass folds nothing.

    Exporters compute sizes at run time (timm's "same" padding, torchvision's window partitions):
    Shape -> Gather -> Div -> Cast -> Pad chains that one folding pass cannot see through, because each
    pass folds only what the previous shape inference made known.  Tried on the corpus (bench/corpus.py;
    TorchScript exports of timm nasnetalarge and torchvision swin_t, which one pass leaves with 222 and
    1405 tensors of unknown shape): polygraphy's ``fold_constants(num_passes=None)`` (the same
    graphsurgeon folding between ONNX shape inferences) left none, in 19 s and 50 s; onnxslim left none
    in 17 s and 28 s but also applies fusions of its own (swin_t 581 -> 480 nodes) that pre-empt the
    rewrite search and would be one more dependency; this loop over graphsurgeon's folding left none in
    16 s and 21 s.  So: graphsurgeon directly, no new dependency, the exported ops kept as they are.
    """
    from parastream.rewrite.ir import graph_with_aside, put_back

    # Between passes the large weights stay out of the protos (``_fold_once_aside``): each pass used to copy every
    # weight's bytes back into the inferred model only for the next import to copy them out again (6.6 s of a
    # 30-pass, 280 MB model's 15 s load); they are put back once, after the loop.
    aside = dict(aside or {})  # ``model``'s weights held out already (an ``infer_aside`` result's)
    for k in range(max_passes):
        if k or not inferred:  # ``inferred``: the caller's inference (with unknown tensors left) is the first pass's
            model, aside = _infer_aside(model, path, aside)
            if not unknown_tensors(model):
                break
        model, removed, aside = _fold_once_aside(model, aside)
        if not removed:
            break
    graph = graph_with_aside(model, aside)  # the weights as arrays (views), not put back into a proto to export
    if graph is None:
        return _infer(_constants_to_initializers(put_back(model, aside)), path)
    folded, held = _constants_to_initializers(model, graph, hold=True)
    return _infer(folded, path, held)


def _infer_aside(model: onnx.ModelProto, path: Path, held: dict) -> tuple[onnx.ModelProto, dict]:
    try:
        from parastream.rewrite.ir import infer_aside

        return infer_aside(model, strict=True, held=held)
    except Exception as e:  # noqa: BLE001 - InferenceError names the node
        raise ParastreamError(f"{path}: shape inference failed: {str(e).strip().splitlines()[0]}") from None


def _fold_once_aside(model: onnx.ModelProto, aside: dict) -> tuple[onnx.ModelProto, int, dict]:
    """``_fold_once`` of an ``infer_aside`` result whose large weights are ``aside``: imported with them as arrays,
    folded, exported with the large ones held out again; returns the model, the nodes removed and what it holds
    out.  A model whose weights cannot be viewed as arrays is folded with its bytes put back, as ``_fold_once``."""
    from parastream.rewrite.ir import graph_with_aside, hold_large_weights, put_back

    graph = graph_with_aside(model, aside)
    if graph is None:
        folded, removed = _fold_once(put_back(model, aside))
        return folded, removed, {}
    before = len(graph.nodes)
    if _fold_graph(graph) is None:
        return model, 0, aside
    held = hold_large_weights(graph)
    folded = _export_like(graph, model)
    return folded, before - len(folded.graph.node), held


# Ops whose output shape can depend on input values: which inputs (None: the values of every input).
_VALUE_SHAPED = {
    "NonZero": None, "NonMaxSuppression": None, "Unique": None, "Compress": None, "Loop": None, "If": None,
    "Scan": None, "TopK": (1,), "Reshape": (1,), "Expand": (1,), "Tile": (1,), "Slice": (1, 2, 3, 4),
    "ConstantOfShape": (0,), "Range": (0, 1, 2), "Resize": (1, 2, 3), "Upsample": (1,), "OneHot": (1,),
    "Pad": (1, 3), "Squeeze": (1,), "Unsqueeze": (1,), "Split": (1,), "ReduceSum": (1,), "ReduceMean": (1,),
    "ReduceMax": (1,), "ReduceMin": (1,), "ReduceProd": (1,), "CenterCropPad": (1,), "RoiAlign": (1,),
}
_ALWAYS_DATA_DEPENDENT = {"NonZero", "NonMaxSuppression", "Unique", "Compress", "Loop"}


def _value_sources(model: onnx.ModelProto):
    """``sources(name)``: the graph inputs whose *values* reach tensor ``name`` (through ops that pass data on,
    not through Shape/Size/Constant/ConstantOfShape, whose outputs depend on shapes only); empty for a tensor
    computed from constants and shapes."""
    producer = {o: n for n in model.graph.node for o in n.output}
    consts = {t.name for t in model.graph.initializer}
    inputs = {vi.name for vi in model.graph.input} - consts
    memo: dict[str, frozenset[str]] = {}

    def sources(name: str) -> frozenset[str]:
        if name in memo:
            return memo[name]
        memo[name] = frozenset()  # guards cycles; a DAG has none
        if name in inputs:
            res = frozenset([name])
        elif name in consts or name not in producer:
            res = frozenset()
        elif producer[name].op_type in ("Shape", "Size", "Constant", "ConstantOfShape"):
            res = frozenset()
        else:
            res = frozenset().union(*(sources(i) for i in producer[name].input if i))
        memo[name] = res
        return res

    return sources


def _shaping_inputs(node: onnx.NodeProto) -> list[str]:
    """The inputs of ``node`` whose values can set its output shape (_VALUE_SHAPED)."""
    which = _VALUE_SHAPED.get(node.op_type) or range(len(node.input))
    return [node.input[i] for i in which if i < len(node.input) and node.input[i]]


def _data_dependent_nodes(model: onnx.ModelProto, unknown: list[tuple[onnx.NodeProto, str]]) -> list[onnx.NodeProto]:
    """The nodes, in graph order, whose output shape depends on the values (not only the shapes) of the
    model's inputs: a NonZero, an NMS, or a Reshape/Slice/TopK/... whose size input is computed from the
    data.  Only nodes whose outputs are unknown are considered; constants and Shape/Size outputs do not
    carry data."""
    sources = _value_sources(model)
    seen: set[str] = set()
    found = []
    for node, _out in unknown:
        if node.name in seen:
            continue
        seen.add(node.name)
        if node.op_type not in _VALUE_SHAPED:
            continue
        if node.op_type in _ALWAYS_DATA_DEPENDENT or any(sources(i) for i in _shaping_inputs(node)):
            found.append(node)
    return found


def _quoted(names, noun: str) -> str:
    names = list(names)
    return f"{noun}{'s' if len(names) > 1 else ''} " + ", ".join(repr(n) for n in names)


def _position_in_file(path: Path, name: str) -> tuple[int, int] | None:
    """(k, N): node ``name`` is the k-th of the N nodes of the file at ``path`` as a viewer lists them (nodes
    named as the loader names them), or None where the file cannot be read or the node is not in it (folding
    made it).  The loaded graph is folded and toposorted, so its order is not the one the user can look up."""
    try:
        names = name_nodes(onnx.load(str(path), load_external_data=False), assign=False)
    except Exception:  # noqa: BLE001 - the position in the loaded graph is given instead
        return None
    return (names.index(name) + 1, len(names)) if name in names else None


class DataDependentShape(ParastreamError):
    """Nodes give tensors shapes that depend on input values (``_data_dependent_error`` names the first): ``nodes``
    are their names, where a build cuts the model's data-dependent tail off (pipeline/host_tail.py)."""

    def __init__(self, message: str, *, nodes: list[str]):
        super().__init__(message)
        self.nodes = nodes


def _data_dependent_error(model: onnx.ModelProto, node: onnx.NodeProto, out: str, path: Path,
                          also: list[str] = ()) -> DataDependentShape:
    """One line that says where a node whose output shape depends on input values sits: its position in the
    model file, the graph inputs whose values it is computed from, and what depends on it (how many nodes, the
    next ops, the outputs it reaches), so that the user can see which part of the export to leave out."""
    nodes = list(model.graph.node)
    k, total = _position_in_file(path, node.name) or (next(i for i, n in enumerate(nodes) if n is node) + 1, len(nodes))
    order = [vi.name for vi in model.graph.input]
    sources = _value_sources(model)
    srcs = frozenset().union(*(sources(i) for i in _shaping_inputs(node)))
    srcs = sorted(srcs, key=order.index)
    reads, writes = [dataflow.node_reads(n) for n in nodes], [list(n.output) for n in nodes]
    consumers = dataflow.consumers(reads)
    downstream = dataflow.downstream(reads, writes, [next(i for i, n in enumerate(nodes) if n is node)])
    reached = set(node.output).union(*(writes[i] for i in downstream))
    nexts = list(dict.fromkeys(nodes[i].op_type for o in node.output for i in consumers.get(o, [])))[:3]
    outputs = [vi.name for vi in model.graph.output if vi.name in reached]
    where = (f"depends on the values of {_quoted(srcs, 'input')}" if srcs
             else "depends on values computed inside the model")
    after = f"{len(downstream)} node{'s' if len(downstream) != 1 else ''} depend on it"
    if nexts:
        after += f" (next: {', '.join(nexts)})"
    if outputs:
        after += f", reaching {_quoted(outputs, 'output')}"
    fix = (f"leave the path from {_quoted(srcs, 'input')} to this node out of the export (e.g. without that input if "
           "it is optional), or end the model before this node") if srcs else "end the model before this node"
    return DataDependentShape(
        f"{path}: node {node.name!r} ({node.op_type}, node {k} of {total}) gives {out!r} a shape that {where}, "
        f"not only on the input shapes; {after}. parastream plans static shapes: {fix}", nodes=[node.name, *also])


#: ops whose output's size is a count of values (``_only_behind_data_dependent``); not Loop, whose loop-carried
#: outputs ONNX Runtime's symbolic inference can give static shapes
_COUNTED_SHAPES = _ALWAYS_DATA_DEPENDENT - {"Loop"}


def _only_behind_data_dependent(model: onnx.ModelProto, unknown: list[tuple[onnx.NodeProto, str]]) -> bool:
    """Whether every tensor still ``unknown`` is written by a node whose output's size is a count of values
    (``_COUNTED_SHAPES``: NonZero, NonMaxSuppression, ...) or by a node downstream of one. No inference settles
    such shapes, and a build cuts everything downstream of those nodes off as the model's tail anyway, so ONNX
    Runtime's symbolic inference is not run for them: on a detector's whole model it cost 4.7 s of an 11 s load
    (FCOS, 2-core CPU), 1.6 of them its package's import of torch, and then named the same nodes."""
    nodes = list(model.graph.node)
    start = [i for i, n in enumerate(nodes) if n.op_type in _COUNTED_SHAPES]
    if not start:
        return False
    writes = [list(n.output) for n in nodes]
    behind = set(start) | dataflow.downstream([dataflow.node_reads(n) for n in nodes], writes, start)
    written = {o for i in behind for o in writes[i]}
    return all(o in written for _n, o in unknown)


def _symbolic_infer(model: onnx.ModelProto) -> onnx.ModelProto:
    """ONNX Runtime's symbolic shape inference (it knows ops and shape arithmetic onnx's does not)."""
    import os
    import tempfile

    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    # When it cannot finish, it saves "sym_shape_infer_temp.onnx" (and the weights beside it) into the
    # current directory before raising: run it in a scratch folder so that nothing lands in the user's.
    cwd = os.getcwd()
    with tempfile.TemporaryDirectory(prefix="parastream-symshape-") as tmp:
        os.chdir(tmp)
        try:
            out = SymbolicShapeInference.infer_shapes(model, auto_merge=True, guess_output_rank=False)
        except Exception:  # noqa: BLE001 - it raises on anything it cannot finish; the next fallback decides
            return model
        finally:
            os.chdir(cwd)
    return out if out is not None else model


def _record_shapes_by_running(model: onnx.ModelProto, names: list[str], path: Path) -> onnx.ModelProto:
    """The last resort: one ONNX Runtime run at the static input shapes, every tensor in ``names`` marked as
    an output of a copy of the model, its shape and dtype recorded as value_info.  Only called once no node
    makes a shape depend on input values, so one run gives the shapes of every run."""
    import onnxruntime as ort

    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    have = {o.name for o in probe.graph.output}
    for name in names:
        if name not in have:
            probe.graph.output.append(onnx.ValueInfoProto(name=name))
    init = {t.name for t in model.graph.initializer}
    specs = [spec_of(vi) for vi in model.graph.input if vi.name not in init]
    try:
        so = ort.SessionOptions()
        so.log_severity_level = 3
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        sess = ort.InferenceSession(probe.SerializeToString(), so, providers=["CPUExecutionProvider"])
        wanted = list(dict.fromkeys(names))
        values = sess.run(wanted, random_feeds(specs))
    except Exception as e:  # noqa: BLE001 - report what ONNX Runtime said, on one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ParastreamError(f"{path}: shapes could not be inferred, and running the model with ONNX Runtime to find them failed: {first}") from None
    by_name = {vi.name: vi for vi in model.graph.value_info}
    for name, v in zip(wanted, values):
        v = np.asarray(v)
        vi = helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(v.dtype), list(v.shape))
        if name in by_name:
            by_name[name].CopyFrom(vi)
        else:
            model.graph.value_info.append(vi)
    return model


def _static_shapes(model: onnx.ModelProto, path: Path, graph=None, held: dict | None = None):
    """Every tensor of ``model`` (static inputs) gets a static shape and dtype, or a one-line error; return
    (the inferred model, ``graph`` when the model is still its export, else None: the fallbacks below change
    the model, whose graph must then be imported again).  ``held``: the large weights ``model`` holds out
    (``_fold_constants``), put back by its first inference.

    In order, each step only while tensors are still unknown: ONNX shape inference (strict, with data
    propagation) -> constant folding to a fixed point -> ONNX Runtime's symbolic shape inference ->
    (no node whose output shape depends on input values, else an error naming it) one ONNX Runtime run
    that records the shape of every tensor still unknown.

    Polygraphy's ``InferShapes(allow_onnxruntime=True)`` chains the first and third step, but neither the
    fixed-point folding between them nor the data-dependence check with its one-line error, and it returns a
    model either way; these steps are ours so that the common case (one inference) keeps the folded graph.
    """
    from parastream.rewrite.ir import put_back

    model, aside = _infer_aside(model, path, held or {})
    if not unknown_tensors(model):
        return put_back(model, aside), graph
    model = _fold_to_fixed_point(model, path, aside, inferred=True)  # (the weights stay aside for its passes)
    unknown = unknown_tensors(model)
    if unknown and not _only_behind_data_dependent(model, unknown):
        model = _infer(_symbolic_infer(model), path)
    unknown = unknown_tensors(model)
    if unknown:
        nodes = _data_dependent_nodes(model, unknown)
        if nodes:  # the first one named; every one of them is where a build cuts a tail off (``load_model``)
            node = nodes[0]
            out = next((o for n, o in unknown if n is node), node.output[0])
            raise _data_dependent_error(model, node, out, path, also=[n.name for n in nodes[1:]])
        model = _record_shapes_by_running(model, [o for _n, o in unknown], path)
        model = _infer(model, path)
    return model, None


def load_model(path: str | Path, shapes: dict[str, list[int]] | None = None, *, host_tail: bool = False) -> LoadedModel:
    """Read, check, fix input shapes, fold constants, give every tensor a static shape; raise ParastreamError on bad input.

    ``host_tail``: a model with nodes whose output shapes depend on input values is cut where they start
    (pipeline/host_tail.py): the LoadedModel is its static part (its outputs: the model's outputs it computes,
    then the tensors the tail reads), and ``tail`` the rest; else such a node is a one-line error."""
    path = Path(path)
    model, data = read_model_and_bytes(path)
    _check(model, path, data)
    original = onnx.ModelProto()
    original.CopyFrom(model)
    as_read = [n.name for n in original.graph.node]
    if name_nodes(original) != as_read or shapes:  # onnxruntime refuses duplicate node names: the reference gets
        data = None                                # the same unique names (then the file's bytes are not it)
    name_nodes(model)
    _check_declarations(model, path)
    _fix_input_shapes(model, shapes or {}, path)
    if shapes:
        _fix_input_shapes(original, shapes, path)
    _check_sizes(model, path)  # before anything allocates, and as declared (folding merges declarations)
    try:
        return _load_checked(path, model, original, data)
    except DataDependentShape as e:
        if not host_tail:
            raise
        return _load_static_part(path, original, e)


def _load_checked(path: Path, model: onnx.ModelProto, original: onnx.ModelProto, data: bytes | None,
                  boundary: frozenset[str] = frozenset()) -> LoadedModel:
    """``load_model`` from the checked model with its input shapes fixed: fold, infer, check the outputs.
    ``boundary``: outputs that a tail reads (``_load_static_part``), where one that folds to a constant is
    ``ConstantBoundary`` rather than an error."""
    from parastream.rewrite.ir import adopt_model

    model, graph, held = _fold_constants(model, path)
    model, graph = _static_shapes(model, path, graph, held)
    name_nodes(model)
    init_names = {t.name for t in model.graph.initializer}
    inputs = [_spec(vi, path, "input") for vi in model.graph.input if vi.name not in init_names]
    folded = [vi.name for vi in model.graph.output if vi.name in init_names and vi.name in boundary]
    # a boundary tensor of a static shape with a 0 in it holds no data: its value is known too (YOLOv8's export
    # with NMS reads the [boxes, 0] mask coefficients a detection model has none of), and no plan serves it
    empty = {vi.name: _empty(vi) for vi in model.graph.output if vi.name in boundary and vi.name not in init_names
             and (dims := _dims(vi)) and all(isinstance(d, int) for d in dims) and 0 in dims}
    if folded or empty:
        raise ConstantBoundary({**{t.name: t for t in model.graph.initializer if t.name in folded}, **empty})
    outputs = []
    for vi in model.graph.output:
        if vi.name in init_names:
            raise ParastreamError(f"{path}: output {vi.name!r} is a constant (it depends on no input), which parastream "
                                  "does not serve; compute it outside the model")
        dims = _dims(vi)
        if dims is None or any(not isinstance(d, int) for d in dims):
            raise ParastreamError(f"{path}: output {vi.name!r} has a shape that cannot be inferred from the input shapes; parastream needs static shapes")
        outputs.append(_spec(vi, path, "output"))
    _check_sizes(model, path)
    # the folded graph, with the inferred shapes, when inference alone gave every tensor one; else imported again
    graph = (None if graph is None else adopt_model(graph, model)) or graph_of(model)
    return LoadedModel(path=path, model=model, original=original, inputs=inputs, outputs=outputs, graph=graph,
                       original_data=data)


def _empty(vi: onnx.ValueInfoProto) -> onnx.TensorProto:
    """The value of a tensor declared with no elements: an empty array of its type and shape."""
    dtype = onnx.helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type)
    return onnx.numpy_helper.from_array(np.zeros(_dims(vi), dtype=dtype), vi.name)


class ConstantBoundary(Exception):
    """Tensors a tail reads that the static part folded to constants (``_load_checked``): the tail holds them."""

    def __init__(self, tensors: dict[str, onnx.TensorProto]):
        super().__init__(", ".join(tensors))
        self.tensors = tensors


def _load_static_part(path: Path, original: onnx.ModelProto, first: DataDependentShape) -> LoadedModel:
    """The static part of ``original`` loaded, its tail cut off where ``first`` names the data-dependent node
    (``host_tail.split``), again with each further data-dependent node the static part's load finds, and with
    each tensor the tail reads that the static part folds to a constant handed to the tail as a value."""
    from .host_tail import split

    seeds, constants = set(first.nodes), {}
    try:
        typed = shape_inference.infer_shapes(original)
    except Exception:  # noqa: BLE001 - onnx's inference refuses what it cannot read: the node's error stands
        raise first from None
    for _ in range(len(original.graph.node)):
        try:
            static, tail = split(original, seeds, constants, typed=typed)
        except ParastreamError as e:
            raise ParastreamError(f"{first}; {e}") from None
        model = onnx.ModelProto()
        model.CopyFrom(static)
        try:
            loaded = _load_checked(path, model, static, None, frozenset(tail.boundary))
        except DataDependentShape as e:
            seeds.update(e.nodes)
            continue
        except ConstantBoundary as c:
            constants.update(c.tensors)
            continue
        loaded.tail = tail
        return loaded
    raise first


MAX_ELEMENTS = 2**31 - 1  # TensorRT's limit on a tensor's volume; the launchers' buffers are sized from it too


def _spec(vi: onnx.ValueInfoProto, path: Path, kind: str) -> TensorSpec:
    try:
        return spec_of(vi)
    except (KeyError, TypeError, ValueError):
        raise ParastreamError(f"{path}: {kind} {vi.name!r} has element type {vi.type.tensor_type.elem_type}, "
                              "which is not an ONNX tensor type parastream can run") from None


def _check_sizes(model: onnx.ModelProto, path: Path) -> None:
    """Refuse a tensor of more than MAX_ELEMENTS elements before anything tries to allocate it."""
    ends = {vi.name for vi in list(model.graph.input) + list(model.graph.output)}
    for vi in list(model.graph.input) + list(model.graph.value_info) + list(model.graph.output):
        dims = _dims(vi) or []
        if any(isinstance(d, int) and d < 0 for d in dims):
            raise ParastreamError(f"{path}: tensor {vi.name!r} has a negative dimension {dims}")
        if vi.name in ends and any(d == 0 for d in dims):
            raise ParastreamError(f"{path}: {'input' if vi in model.graph.input else 'output'} {vi.name!r} has shape {dims}, "
                                  "an empty tensor; parastream deploys models whose inputs and outputs hold data")
        if all(isinstance(d, int) for d in dims) and math.prod(dims) > MAX_ELEMENTS:
            raise ParastreamError(f"{path}: tensor {vi.name!r} has shape {dims}, {math.prod(dims):,} elements, more than "
                                  f"the {MAX_ELEMENTS:,} parastream supports in one tensor; give smaller --shapes")


def parse_batch(text: str | None) -> tuple[int, int, int] | None:
    """Parse ``--batch min:opt:max`` (or a single ``N``, meaning N:N:N)."""
    if not text:
        return None
    parts = text.split(":")
    if not all(re.fullmatch(r"[0-9]{1,12}", v.strip()) for v in parts):
        raise ParastreamError(f"--batch {text!r} is not MIN:OPT:MAX with integers, e.g. --batch 1:8:32")
    values = tuple(int(v) for v in parts)
    if len(values) == 1:
        values = values * 3
    if len(values) != 3 or not (1 <= values[0] <= values[1] <= values[2]):
        raise ParastreamError(f"--batch {text!r}: need 1 <= MIN <= OPT <= MAX, e.g. --batch 1:8:32")
    return values  # type: ignore[return-value]


def batch_profiles(path: str | Path, shapes: dict[str, list[int]], batch: tuple[int, int, int]
                   ) -> tuple[dict[str, list[int]], dict[str, tuple[list[int], list[int], list[int]]]]:
    """Shapes at the OPT batch and (min, opt, max) profiles for every input whose first dimension is dynamic.

    The plan (and the launcher's buffers and CUDA Graph) use the OPT batch; engines that take optimization
    profiles (TensorRT) accept any batch from MIN to MAX.  ``--batch`` gives the batch axis and ``--shapes``
    the others: the first dimension a ``--shapes`` entry gives an input with a dynamic first dimension is
    replaced by the batch (write any value there, 1 by convention).  Dimension names are bound across inputs
    as without ``--batch`` (_bind_input_shapes).
    """
    path = Path(path)
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception:  # noqa: BLE001 - load_model reports a bad file with its own message
        return dict(shapes), {}
    lo, opt, hi = batch
    init_names = {t.name for t in model.graph.initializer}
    batched = [vi.name for vi in model.graph.input if vi.name not in init_names and _batch_dynamic(_dims(vi))]
    if not batched:
        raise ParastreamError(f"{path}: --batch given, but no input of the model has a dynamic first dimension")
    binding = _bind_input_shapes(model, shapes, path, batch=opt)
    if binding.unknown:
        raise ParastreamError(
            f"{path}: {_unknown_inputs(binding.unknown)} unknown dimensions besides the batch; give them with "
            f"--batch {lo}:{opt}:{hi} --shapes {binding.example} (with --batch, the first dimension of a dynamic-batch "
            "input in --shapes is replaced by the batch)")
    out = {**shapes, **binding.shapes}
    profiles = {}
    for name in batched:
        rest = out[name][1:]
        profiles[name] = ([lo, *rest], [opt, *rest], [hi, *rest])
    return out, profiles


def parse_buckets(text: str | None) -> list[int] | None:
    """Parse ``--batch-buckets 1,2,4,8`` (batch sizes, each a CUDA Graph of its own)."""
    if not text:
        return None
    parts = [p.strip() for p in text.split(",")]
    if not all(re.fullmatch(r"[0-9]{1,12}", p) and int(p) >= 1 for p in parts):
        raise ParastreamError(f"--batch-buckets {text!r} is not a list of batch sizes >= 1, e.g. --batch-buckets 1,2,4,8")
    return sorted(set(int(p) for p in parts))


def batch_buckets(batch: tuple[int, int, int], buckets: list[int] | None = None) -> list[int]:
    """The batch sizes a ``--batch MIN:OPT:MAX`` bundle is built for, ascending, ending at MAX.

    Default: MIN, the powers of two between MIN and MAX, and MAX (1:16:32 gives 1, 2, 4, 8, 16, 32).
    Given ``buckets`` (``--batch-buckets``), they must lie in [MIN, MAX] and include MAX, so every n in
    the range has a bucket >= n.  OPT is where the build measures (the rewrite search) and need not be a bucket.
    """
    lo, _opt, hi = batch
    if buckets is None:
        sizes = {lo, hi} | {1 << k for k in range(hi.bit_length()) if lo <= 1 << k <= hi}
        return sorted(sizes)
    outside = [b for b in buckets if not lo <= b <= hi]
    if outside:
        raise ParastreamError(f"--batch-buckets {outside[0]} is outside --batch {lo}:{_opt}:{hi} (MIN..MAX)")
    if hi not in buckets:
        raise ParastreamError(f"--batch-buckets must include MAX = {hi}, so that every batch up to MAX has a bucket")
    return sorted(buckets)


def shapes_at_batch(path: str | Path, shapes: dict[str, list[int]], batch: int) -> dict[str, list[int]]:
    """``shapes`` with every input whose first dimension is dynamic fixed at ``batch`` (whatever first dimension
    ``shapes`` gives it) and every dimension name bound: one bucket's static model."""
    return batch_profiles(path, shapes, (batch, batch, batch))[0]


def original_at_batch(path: str | Path, shapes: dict[str, list[int]]) -> onnx.ModelProto:
    """The original model as read (the verification reference) with its inputs fixed at ``shapes``."""
    path = Path(path)
    model = read_model(path)
    name_nodes(model)
    _fix_input_shapes(model, shapes, path)
    return model


# -- dynamic shapes on any axis (--min-shapes/--opt-shapes/--max-shapes, --buckets, --pad) ---------------------------

#: the most buckets one grid may hold: every bucket is a whole static build, so a larger grid is refused with the
#: sizes that made it (choose fewer with --buckets)
MAX_GRID = 64


@dataclass
class ShapeAxis:
    """One dynamic axis of a shape grid: a dimension name (dim_param) and every input dimension that carries it.

    ``name``: the dim_param, or ``INPUT:AXIS`` for an unnamed dimension.  ``inputs``: input -> its dimension on
    this axis.  ``sizes``: the buckets, ascending, ending at ``max``.  ``pad``: input -> how its padded positions
    are filled: ``"repeat"`` (the batch axis: rows repeated, as --batch pads), ``"continue"`` (position ids
    counting on) or a number; ``pad_source``: input -> "given" (--pad), "detected" (its name) or "default".
    ``exact``: only the listed sizes are served, each by its own bucket, without padding.  ``outputs`` (set once
    the padding check ran): output -> the dimensions that carry this axis (cut back after a padded run)."""
    name: str
    inputs: dict[str, int]
    min: int
    opt: int
    max: int
    sizes: list[int]
    pad: dict[str, object]
    pad_source: dict[str, str]
    exact: bool = False
    buckets_given: bool = False
    outputs: dict[str, list[int]] | None = None

    @property
    def batch_like(self) -> bool:
        """Every input carries this axis first: padded by repeating rows, whatever the inputs' names."""
        return all(i == 0 for i in self.inputs.values())

    def option(self) -> str:
        """How a user names this axis on the command line: ``INPUT:AXIS`` of its first input."""
        name, i = next(iter(self.inputs.items()))
        return f"{name}:{i}"

    def to_dict(self) -> dict:
        return {"name": self.name, "inputs": dict(self.inputs), "min": self.min, "opt": self.opt, "max": self.max,
                "sizes": list(self.sizes), "pad": dict(self.pad), "pad_source": dict(self.pad_source),
                "exact": self.exact, "outputs": dict(self.outputs or {})}


def parse_shape_option(text: str | None, option: str) -> dict[str, list[int]]:
    """``--min-shapes``/``--opt-shapes``/``--max-shapes NAME:D1xD2,...`` (``--shapes``'s syntax), the option named
    in its errors."""
    try:
        return parse_shapes(text)
    except ParastreamError as e:
        raise ParastreamError(str(e).replace("--shapes", option)) from None


def parse_axis_buckets(entries: list[str] | None) -> dict[tuple[str, int], list[int]]:
    """``--buckets INPUT:AXIS=16,32,64`` (repeatable) into ``{(input, axis): sizes}``."""
    out: dict[tuple[str, int], list[int]] = {}
    for entry in entries or []:
        where, sep, sizes = entry.partition("=")
        name, colon, axis = where.rpartition(":")
        parts = [p.strip() for p in sizes.split(",")]
        if (not sep or not colon or not name or not re.fullmatch(r"[0-9]{1,3}", axis.strip())
                or not all(re.fullmatch(r"[0-9]{1,12}", p) and int(p) >= 1 for p in parts)):
            raise ParastreamError(f"--buckets {entry!r} is not INPUT:AXIS=SIZE,SIZE,...; e.g. --buckets input_ids:1=16,32,64")
        key = (name, int(axis))
        if key in out:
            raise ParastreamError(f"--buckets names {name}:{axis} twice; give each axis once")
        out[key] = sorted(set(int(p) for p in parts))
    return out


def parse_pads(entries: list[str] | None) -> dict[str, object]:
    """``--pad NAME=VALUE`` (repeatable): the value an input's padded positions hold (a number, or ``continue``
    for position ids that count on)."""
    out: dict[str, object] = {}
    for entry in entries or []:
        name, sep, value = entry.partition("=")
        value = value.strip()
        if not sep or not name.strip() or not value:
            raise ParastreamError(f"--pad {entry!r} is not NAME=VALUE; e.g. --pad input_ids=1 (a pad token id)")
        if value == "continue":
            out[name.strip()] = value
            continue
        try:
            number = float(value)
        except ValueError:
            raise ParastreamError(f"--pad {entry!r}: VALUE must be a number or 'continue' (position ids)") from None
        out[name.strip()] = int(number) if number.is_integer() and "." not in value else number
    return out


def detected_pad(name: str) -> tuple[object, str]:
    """How an input named like a transformers input is padded along a sequence axis, and whether the name said so:
    masks and token types 0, token ids 0 (any id: the mask hides it; --pad gives a model's pad id), position ids
    counting on; anything else 0 by default (the padding check decides whether that is harmless)."""
    low = name.lower()
    if "position" in low:
        return "continue", "detected"
    if "mask" in low or "token_type" in low or "segment" in low or low.endswith("ids") or low.endswith("_id"):
        return 0, "detected"
    return 0, "default"


def shape_axes(path: str | Path, shapes: dict[str, list[int]], ranges: dict[str, tuple[list[int], list[int], list[int]]],
               *, batch: tuple[int, int, int] | None = None, batch_sizes: list[int] | None = None,
               buckets: dict[tuple[str, int], list[int]] | None = None, pads: dict[str, object] | None = None
               ) -> tuple[list[ShapeAxis], dict[str, list[int]]]:
    """The dynamic axes of ``--min/--opt/--max-shapes`` (``ranges``: input -> (min, opt, max) dims) and the
    fixed shapes (every input dimension whose min equals its max, with ``shapes``, ``--shapes``).

    A dimension whose min differs from its max is dynamic; dimensions that carry one dim_param are one axis
    (on every input that names it, given or not), an unnamed one is an axis of its own.  ``batch`` (``--batch``)
    is the range of the first dimension of every input whose first dimension is dynamic, ``batch_sizes``
    (``--batch-buckets``) its buckets."""
    path = Path(path)
    model = onnx.load(str(path), load_external_data=False)
    vis = {vi.name: vi for vi in model.graph.input}
    init_names = {t.name for t in model.graph.initializer}
    real = [n for n in vis if n not in init_names]
    declared = {n: _dims(vis[n]) for n in real}
    buckets = dict(buckets or {})
    pads = dict(pads or {})
    for name in pads:
        if name not in real:
            raise ParastreamError(f"--pad names {name!r}, which is not an input of {path.name}; its inputs are {real}")
    ranges = {k: tuple(list(d) for d in v) for k, v in ranges.items()}
    if batch is not None:
        for name in real:
            if _batch_dynamic(declared[name]):
                if name not in ranges:
                    rest = (shapes.get(name) or [1] + [d if isinstance(d, int) else 1 for d in declared[name][1:]])[1:]
                    if name not in shapes and any(not isinstance(d, int) for d in declared[name][1:]):
                        continue  # its other dimensions come from the dim_params other inputs bind
                    ranges[name] = ([1, *rest], [1, *rest], [1, *rest])
                for dims, value in zip(ranges[name], batch):
                    dims[0] = value
    axes: dict[str, ShapeAxis] = {}
    fixed: dict[str, list[int]] = {k: list(v) for k, v in shapes.items()}
    for name, (lo, opt, hi) in ranges.items():
        if name not in vis or name in init_names:
            raise ParastreamError(f"--min-shapes names {name!r}, which is not an input of {path.name}; its inputs are {real}")
        cur = declared[name]
        if not (len(lo) == len(opt) == len(hi)):
            raise ParastreamError(f"--min/--opt/--max-shapes give input {name!r} ranks {len(lo)}, {len(opt)} and {len(hi)}; "
                                  "give one rank")
        if cur is not None and len(cur) != len(lo):
            raise ParastreamError(f"--min-shapes {name}:{_fmt(lo)} has rank {len(lo)}, but input {name!r} of {path.name} "
                                  f"has rank {len(cur)}")
        for i, (a, o, b) in enumerate(zip(lo, opt, hi)):
            if not a <= o <= b:
                raise ParastreamError(f"input {name!r} dimension {i}: need min <= opt <= max, got {a}, {o}, {b} "
                                      "(--min-shapes, --opt-shapes, --max-shapes)")
            c = cur[i] if cur is not None else None
            if a == b:
                continue
            if isinstance(c, int):
                raise ParastreamError(f"input {name!r} dimension {i} is fixed to {c} in {path.name}; it cannot range "
                                      f"{a}..{b}")
            key = c if isinstance(c, str) else f"{name}:{i}"
            ax = axes.get(key)
            if ax is None:
                axes[key] = ShapeAxis(key, {name: i}, a, o, b, [], {}, {})
            elif (ax.min, ax.opt, ax.max) != (a, o, b):
                first = next(iter(ax.inputs))
                raise ParastreamError(f"inputs {first!r} and {name!r} share dimension {key!r} in {path.name} but are "
                                      f"given the ranges {ax.min}:{ax.opt}:{ax.max} and {a}:{o}:{b}; give them one range")
            else:
                ax.inputs[name] = i
        fixed[name] = list(opt)
    if not axes:
        raise ParastreamError(f"{path}: --min-shapes and --max-shapes give every dimension one size; give a range "
                              "(min < max) on the axes that vary, or use --shapes for static shapes")
    # a dim_param is one axis on every input that names it
    for name in real:
        for i, c in enumerate(declared[name] or []):
            if isinstance(c, str) and c in axes and name not in axes[c].inputs:
                axes[c].inputs[name] = i
                if name in ranges and ranges[name][0][i] == ranges[name][2][i]:
                    raise ParastreamError(f"input {name!r} dimension {i} ({c!r}) is given one size, {ranges[name][0][i]}, "
                                          f"but {c!r} ranges {axes[c].min}..{axes[c].max} on another input; give them one range")
    for (name, i), sizes in buckets.items():
        ax = next((a for a in axes.values() if a.inputs.get(name) == i), None)
        if ax is None:
            raise ParastreamError(f"--buckets {name}:{i}: dimension {i} of input {name!r} is not a dynamic axis of this "
                                  "build (give its range with --min-shapes/--max-shapes)")
        outside = [s for s in sizes if not ax.min <= s <= ax.max]
        if outside:
            raise ParastreamError(f"--buckets {name}:{i}={outside[0]} is outside that axis's range {ax.min}..{ax.max}")
        if ax.max not in sizes:
            raise ParastreamError(f"--buckets {name}:{i} must include the axis's MAX = {ax.max}, so that every size up to "
                                  "MAX has a bucket")
        ax.sizes, ax.buckets_given = sizes, True
    for ax in axes.values():
        if not ax.sizes:
            given = batch_sizes if ax.batch_like and batch is not None else None
            ax.sizes = batch_buckets((ax.min, ax.opt, ax.max), given)
        for name in ax.inputs:
            if ax.batch_like:
                ax.pad[name], ax.pad_source[name] = "repeat", "batch"
            elif name in pads:
                ax.pad[name], ax.pad_source[name] = pads[name], "given"
            else:
                ax.pad[name], ax.pad_source[name] = detected_pad(name)
    out = list(axes.values())
    count = math.prod(len(a.sizes) for a in out)
    if count > MAX_GRID:
        raise ParastreamError(f"{path}: the buckets {', '.join(f'{a.name} {a.sizes}' for a in out)} make {count} static "
                              f"builds, more than {MAX_GRID}; choose fewer with --buckets INPUT:AXIS=SIZE,...")
    return out, fixed


def shapes_at_point(path: str | Path, fixed: dict[str, list[int]], axes: list[ShapeAxis], point: tuple[int, ...]
                    ) -> dict[str, list[int]]:
    """Every input's static shape with each axis at its size in ``point`` (one bucket's, or a request's), the
    dimension names bound across inputs (_bind_input_shapes)."""
    path = Path(path)
    model = onnx.load(str(path), load_external_data=False)
    declared = {vi.name: _dims(vi) for vi in model.graph.input}
    shapes = {k: list(v) for k, v in fixed.items()}
    for ax, size in zip(axes, point):
        for name, i in ax.inputs.items():
            if name not in shapes:
                cur = declared.get(name)
                if cur is None or not all(isinstance(d, int) or d in {a.name for a in axes} for d in cur):
                    continue  # its other dimensions come from the names the given inputs bind
                shapes[name] = [d if isinstance(d, int) else 1 for d in cur]
            shapes[name][i] = size
    binding = _bind_input_shapes(model, shapes, path)
    if binding.unknown:
        raise ParastreamError(f"{path}: {_unknown_inputs(binding.unknown)} unknown dimensions besides the dynamic axes; "
                              f"give them in --min-shapes/--opt-shapes/--max-shapes or --shapes (e.g. --shapes "
                              f"{binding.example})")
    return {**shapes, **binding.shapes}
