"""ONNX ⇄ graphsurgeon for the rules and the search: the invariants rules rely on, and back to a checked model.

``import_graph`` (or ``working_copy`` of a graph the loader imported already) gives a graph whose tensors carry
inferred shapes and dtypes, whose Constant nodes are initializers, whose weights are plain numpy arrays (loaded
once), and whose nodes have unique names (the search identifies sites by node names).  ``export_model`` returns
a model that passes ``onnx.checker`` and strict shape inference, with the original's opsets, IR version and
metadata, and ``adopt_model`` makes the graph so exported the graph of that model without importing it again.
"""

from __future__ import annotations

import copy
import hashlib
import weakref
from collections import OrderedDict
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import shape_inference
from onnx_graphsurgeon.util.misc import SynchronizedList

from parastream.core.graph import conv_attrs, static_shape


WEIGHTS_ASIDE_BYTES = 1 << 16  # initializers above this size are set aside during shape inference


ASIDE_LOCATION = "parastream-weights-set-aside"  # the external-data location given to set-aside initializers


def infer(model: onnx.ModelProto, strict: bool = False, restore: bool = True, check: bool = False,
          held: dict[str, np.ndarray] | None = None) -> onnx.ModelProto:
    """ONNX shape inference (data propagation on) with the data of large initializers set aside.

    onnx's infer_shapes serializes the model into C++ and the result back: for a 350 MB model, 1.4 GB more at
    its peak, for a step that reads only their types and dimensions.  Initializers above
    ``WEIGHTS_ASIDE_BYTES`` are handed to it as external data (dimensions and type, no bytes; shape inference
    does not read external data), and their bytes are put back into the result (and into ``model``).
    Small ones (shapes, axes, pads: what data propagation reads) stay.  ``restore=False``: ``model`` is the
    caller's to drop, and is left without them (putting 170 MB back into a proto nobody reads was a quarter
    of a second per exported candidate).  ``check``: the result also passes ``onnx.checker`` (``_check_aside``).
    ``held``: initializers the model holds set aside already (``export_model``), name -> their values.
    """
    aside = _set_aside(model, held)
    try:
        out = shape_inference.infer_shapes(model, strict_mode=strict, data_prop=True)
        if check:
            _check_aside(out, bool(aside))
    finally:
        if restore:
            _put_back(model, aside)
    _put_back(out, aside)
    return out


def _set_aside(model: onnx.ModelProto, held: dict | None) -> dict[str, bytes | np.ndarray]:
    """The data of ``model``'s initializers above ``WEIGHTS_ASIDE_BYTES`` taken out (each left as external data at
    ``ASIDE_LOCATION``: type and dimensions, no bytes), by name, with ``held`` (set aside already)."""
    aside: dict[str, bytes | np.ndarray | onnx.TensorProto] = dict(held or {})
    for t in model.graph.initializer:
        if not t.HasField("data_location") and len(t.raw_data) > WEIGHTS_ASIDE_BYTES and t.name not in aside:
            aside[t.name] = t.raw_data
            t.ClearField("raw_data")
            t.data_location = onnx.TensorProto.EXTERNAL
            t.external_data.add(key="location", value=ASIDE_LOCATION)
    return aside


def infer_aside(model: onnx.ModelProto, strict: bool = False, held: dict | None = None
                ) -> tuple[onnx.ModelProto, dict[str, bytes | np.ndarray]]:
    """``infer`` for a caller that goes on in graphsurgeon: neither ``model`` nor the result gets its large weights
    back; the result holds them as placeholders and they are returned by name (``held`` among them), for
    ``graph_with_aside`` to import.  Putting them back costs a copy of every weight's bytes into a fresh proto
    (0.4 s per 280 MB), once per inference of a folding loop that imports the result at once."""
    aside = _set_aside(model, held)
    return shape_inference.infer_shapes(model, strict_mode=strict, data_prop=True), aside


def graph_with_aside(model: onnx.ModelProto,
                     aside: dict[str, bytes | np.ndarray | onnx.TensorProto]) -> gs.Graph | None:
    """``model`` (an ``infer_aside`` result) in graphsurgeon with its set-aside weights as arrays (views of their
    bytes, not copies), as importing the model with its weights would give; None when one cannot be (a dtype numpy
    has no buffer type for, a byte count that does not match): the caller puts them back and imports."""
    graph = gs.import_onnx(model)
    for t in graph.tensors().values():
        data = aside.get(t.name) if isinstance(t, gs.Constant) else None
        if data is None:
            continue
        t.data_location = None  # the placeholder's external location goes with it: the bytes are the array's
        if isinstance(data, np.ndarray):
            t.values = data
            continue
        if isinstance(data, onnx.TensorProto):
            data = data.raw_data
        try:
            dtype = np.dtype(t.dtype)
            shape = tuple(int(d) for d in t.shape)
        except (TypeError, ValueError):
            return None
        if dtype.hasobject or dtype.itemsize * int(np.prod(shape, dtype=np.int64)) != len(data):
            return None
        t.values = np.frombuffer(data, dtype=dtype).reshape(shape)
    return graph


def put_back(model: onnx.ModelProto, aside: dict[str, bytes | np.ndarray | onnx.TensorProto]) -> onnx.ModelProto:
    """``model``'s set-aside weights given their bytes again (``infer_aside``); returned."""
    _put_back(model, aside)
    return model


def _check_aside(model: onnx.ModelProto, aside: bool) -> None:
    """``onnx.checker.check_model`` of a model whose large initializers are set aside (``infer``).

    The checker serializes a ModelProto it is handed whole (1.1 s of every exported candidate of Inception-v4,
    170 MB: most of the time between two measured candidates of a GPU build), and it checks
    an external-data tensor's location as a file beside the model.  So the model without those bytes is written
    to a temporary folder beside an empty file at that location and checked from there (14 ms): everything the
    checker checks but the set-aside tensors' byte counts, which ``gs.export_onnx`` wrote from arrays of
    exactly their shapes."""
    if not aside:
        onnx.checker.check_model(model)
        return
    import tempfile

    with tempfile.TemporaryDirectory(prefix="parastream-check-") as d:
        Path(d, ASIDE_LOCATION).touch()
        path = Path(d, "model.onnx")
        path.write_bytes(model.SerializeToString())
        onnx.checker.check_model(str(path))


def _put_back(model: onnx.ModelProto, aside: dict[str, bytes | np.ndarray | onnx.TensorProto]) -> None:
    if not aside:
        return
    for t in model.graph.initializer:
        data = aside.get(t.name)
        if data is not None and t.data_location == onnx.TensorProto.EXTERNAL:
            if isinstance(data, onnx.TensorProto):  # an imported weight's own proto: its bytes copied once, in C
                name = t.name
                t.CopyFrom(data)
                t.name = name
                continue
            del t.external_data[:]
            t.ClearField("data_location")
            t.raw_data = data.tobytes() if isinstance(data, np.ndarray) else data


def hold_large_weights(graph: gs.Graph) -> dict[str, np.ndarray | onnx.TensorProto]:
    """Before ``gs.export_onnx``: each large weight of ``graph`` becomes a placeholder that exports as set-aside
    external data (type and dimensions, no bytes), its array (or, for a weight still in its imported
    TensorProto, that proto itself) returned by name.  ``graph`` is a copy, or a graph that ``adopt_model``
    later gives the exported model's weights (the loader's): its tensors keep placeholders.

    Exporting copies every weight's bytes into a TensorProto and ``make_graph`` copies them again into the
    model, which ``infer`` then sets aside and puts back (0.6 s of every exported Inception-v4 candidate,
    170 MB each time); held here, they are written once, into the result.  An imported weight graphsurgeon has
    not loaded (``LazyValues``) is exported as its proto, which ``make_graph`` and ``make_model`` copied twice
    all the same (1.65 s of a BERT-base load's 4.6 s on the 2-core CPU, the export after folding), so it is held
    too, as that proto: put back with one copy of its bytes (``CopyFrom``), where reading ``raw_data`` into Python
    and writing it into the result were two (extracting 21 BERT-base candidates' branches on the 2-core CPU:
    13.4 s held as bytes, 11.1 s as protos).  Only weights of the top-level graph whose type the model keeps (no
    ``export_dtype`` conversion), and none where a node holds a subgraph (whose initializers the result's
    top-level list would not reach)."""
    from onnx_graphsurgeon.ir.tensor import LazyValues

    if any(isinstance(v, gs.Graph) for n in graph.nodes for v in n.attrs.values()):
        return {}
    held: dict[str, np.ndarray | onnx.TensorProto] = {}
    for t in graph.tensors().values():
        if (not isinstance(t, gs.Constant) or t.data_location is not None
                or getattr(t, "export_dtype", t.dtype) != t.dtype):
            continue
        values = getattr(t, "_values", None)
        if isinstance(values, np.ndarray) and values.nbytes > WEIGHTS_ASIDE_BYTES:
            try:
                dtype = onnx.helper.np_dtype_to_tensor_dtype(values.dtype)
            except (KeyError, TypeError, ValueError):
                continue
            data, dims = np.ascontiguousarray(values), values.shape
        elif (isinstance(values, LazyValues) and values.nbytes > WEIGHTS_ASIDE_BYTES
              and isinstance(values.tensor, onnx.TensorProto) and values.tensor.HasField("raw_data")
              and values.tensor.data_location != onnx.TensorProto.EXTERNAL):
            dtype, dims, data = values.tensor.data_type, list(values.tensor.dims), values.tensor
        else:
            continue
        proto = onnx.TensorProto(name=t.name, data_type=dtype, dims=dims, data_location=onnx.TensorProto.EXTERNAL)
        proto.external_data.add(key="location", value=ASIDE_LOCATION)
        held[t.name] = data
        t._values = LazyValues(proto)  # gs exports a LazyValues' proto as it is
    return held


def import_graph(model: onnx.ModelProto) -> gs.Graph:
    """``model`` in graphsurgeon with the invariants above (its shapes inferred here)."""
    return _for_rules(gs.import_onnx(infer(model)))


def working_copy(graph: gs.Graph) -> gs.Graph:
    """A copy of ``graph`` (a model's graph with its shapes inferred: the loader's ``LoadedModel.graph``) with
    the invariants of ``import_graph``, for the rules to rewrite; ``graph`` itself is left as it is (its weights
    stay as they are held, the copy loads them into arrays of its own tensors)."""
    return _for_rules(copy_graph(graph))


def _for_rules(graph: gs.Graph) -> gs.Graph:
    _lift_constant_nodes(graph)
    for t in graph.tensors().values():
        if isinstance(t, gs.Constant):
            t.values = np.asarray(t.values)  # load lazily-held weights once, not on every access
    _name_nodes(graph)
    toposort(cleanup(graph))
    return graph


def adopt_model(graph: gs.Graph, model: onnx.ModelProto, keep_arrays: bool = False) -> gs.Graph | None:
    """``graph`` made what importing ``model`` would give, where ``model`` is ``graph`` exported and
    shape-inferred (the loader's folded model, the search's chosen candidate): the inferred types and shapes go
    onto its tensors the way graphsurgeon's importer reads them (a tensor's first declaration, a value_info
    declared again filling what the first lacks, a tensor declared nowhere without any), its weights are read
    from ``model``'s initializers as an import's are (so that the arrays or protos it held can go), its nodes
    take ``model``'s names and the graph ``model``'s name, producer, IR version and opsets; then toposorted.
    Changed in place and returned; None (``graph`` unchanged) when ``model`` has another node list: import it.

    Importing ``model`` again would give the same graph (every tensor, attribute and exported byte: the
    loader's test holds them equal) at the cost of a second import of every node and weight.

    ``keep_arrays``: a weight that ``graph`` holds as an array (the one ``model``'s initializer was written from)
    keeps it, rather than reading the initializer: the search's candidates then share the arrays of every
    weight no rewrite changed, which is how a build knows a candidate's unchanged branches without reading their
    bytes (``pipeline.build.BranchCache``)."""
    from onnx_graphsurgeon.importers.onnx_importer import (get_onnx_tensor_dtype, get_onnx_tensor_shape,
                                                           get_onnx_tensor_type)
    from onnx_graphsurgeon.ir.tensor import LazyValues

    nodes = model.graph.node
    if len(graph.nodes) != len(nodes) or any(n.op != p.op_type for n, p in zip(graph.nodes, nodes)):
        return None
    for n, p in zip(graph.nodes, nodes):
        n.name = p.name
    tensors = graph.tensors()
    inits = {t.name: t for t in model.graph.initializer}
    declared: set[str] = set()
    value_info = len(model.graph.value_info)
    ends = [*(i for i in model.graph.input if i.name not in inits), *model.graph.output]
    for k, vi in enumerate([*model.graph.value_info, *ends]):
        t = tensors.get(vi.name)
        if not isinstance(t, gs.Variable) or vi.name in declared and k >= value_info:
            continue  # a graph input or output declared before keeps that declaration
        if vi.name in declared:  # a value_info declared again only fills in what the first one lacks
            if vi.type.ByteSize() > 0:
                t.dtype, t.shape = t.dtype or get_onnx_tensor_dtype(vi), t.shape or get_onnx_tensor_shape(vi)
            continue
        declared.add(vi.name)
        if vi.type.ByteSize() > 0:
            t.dtype, t.shape, t.type = get_onnx_tensor_dtype(vi), get_onnx_tensor_shape(vi), get_onnx_tensor_type(vi)
        else:
            t.dtype, t.shape, t.type = None, None, "tensor_type"
    for name, t in tensors.items():
        if isinstance(t, gs.Variable) and name not in declared:
            t.dtype, t.shape, t.type = None, None, "tensor_type"
        elif isinstance(t, gs.Constant) and name in inits:
            if (keep_arrays and isinstance(t._values, np.ndarray) and t.data_location is None
                    and getattr(t, "export_dtype", t.dtype) == t.dtype):
                continue
            proto = inits[name]
            t.values = LazyValues(proto)
            t.data_location = int(proto.data_location) if proto.HasField("data_location") else None
    graph.name, graph.doc_string = model.graph.name, model.graph.doc_string
    graph.producer_name, graph.producer_version = model.producer_name, model.producer_version
    graph.ir_version = model.ir_version
    graph.import_domains = model.opset_import
    graph.opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), graph.opset)
    return toposort(graph)


def _lift_constant_nodes(graph: gs.Graph) -> None:
    """Constant nodes with a tensor value become initializers, so that rules see their values."""
    for node in list(graph.nodes):
        if node.op != "Constant" or len(node.outputs) != 1 or "value" not in node.attrs:
            continue
        out = node.outputs[0]
        if any(o is out for o in graph.outputs):
            continue
        value = node.attrs["value"]
        array = np.asarray(value.values) if isinstance(value, gs.Constant) else None
        if array is None:
            continue
        const = gs.Constant(out.name, array)
        for consumer in list(out.outputs):
            for i, t in enumerate(consumer.inputs):
                if t is out:
                    consumer.inputs[i] = const
        node.inputs.clear()
        node.outputs.clear()


def _name_nodes(graph: gs.Graph) -> None:
    taken: set[str] = set()
    for i, node in enumerate(graph.nodes):
        base = node.name or f"{node.op}_{i}"
        name, k = base, 0
        while name in taken:
            k += 1
            name = f"{base}_{k}"
        node.name = name
        taken.add(name)


class _SlottedList(SynchronizedList):
    """onnx-graphsurgeon's SynchronizedList (a node's or tensor's ``inputs``/``outputs``, which keeps the other
    side's list in step) with its two fields in slots.  SynchronizedList keeps them in an instance dict: one more
    object for every list, two lists for every node and tensor, a third of all the objects a search's candidates
    are made of, every one of them allocated, walked by the garbage collector and freed again.  Behaviour and
    fields are SynchronizedList's; only where the two fields are stored differs."""

    __slots__ = ("parent_obj", "field_name")


def copy_graph(graph: gs.Graph) -> gs.Graph:
    """``graph.copy()``, each tensor copied once (same nodes, tensors, attributes and order).

    onnx-graphsurgeon's Graph.copy copies every tensor twice (all of them, then again those the graph itself
    produces, so that a subgraph's copy can read its outer graph's); every candidate of the search and every
    branch the partitioner extracts is a copy, and the second copy was a quarter of a CPU build.  Graphs with
    subgraph attributes (If/Loop/Scan) or local functions still go through Graph.copy.

    The objects are made the way onnx-graphsurgeon's constructors make them (``_copy_slow`` is the same copy
    through them, and tests/rewrite/test_ir_speed.py holds the two equal, attribute by attribute), without their
    per-attribute ``__setattr__`` hooks and per-element list synchronisation.  Why not the public API, measured
    as the CPU time of the rewrite search on the examples (nasnet_cell, small_net, inception_block; median of
    3): 0.64, 1.57, 0.46 s with this copy; 1.26, 2.67, 0.71 s with Graph.copy; 0.99, 2.12, 0.55 s with
    ``_copy_slow`` (the public constructors).  The search copies a graph for every rewrite it tries.
    """
    if any(isinstance(v, gs.Graph) for n in graph.nodes for v in n.attrs.values()):
        return graph.copy()
    if graph.functions:
        return _copy_slow(graph)
    copies: dict[str, gs.Tensor] = {}
    new = object.__new__

    def sync_list(parent, field_name: str) -> SynchronizedList:
        lst = list.__new__(_SlottedList)
        lst.parent_obj, lst.field_name = parent, field_name
        return lst

    def get(t: gs.Tensor) -> gs.Tensor:
        name = t.name
        c = copies.get(name) if name else None
        if c is not None:
            return c
        if not name or type(t) is gs.Variable:
            # Variable.copy(): Variable(name, dtype, shape), type "tensor_type"; Variable.empty() for unnamed ones
            c = new(gs.Variable)
            d = c.__dict__
            d["name"] = name
            d["inputs"], d["outputs"] = sync_list(c, "outputs"), sync_list(c, "inputs")
            if name:
                d["dtype"], d["shape"] = t.dtype, t.shape
            else:
                d["dtype"], d["shape"] = None, None
            d["type"] = "tensor_type"
        elif type(t) is gs.Constant:
            # Constant.copy(): Constant(name, _values, export_dtype=export_dtype), no data location
            c = new(gs.Constant)
            d = c.__dict__
            d["name"] = name
            d["inputs"], d["outputs"] = sync_list(c, "outputs"), sync_list(c, "inputs")
            d["_values"], d["data_location"], d["_export_dtype"] = t._values, None, t.export_dtype
        else:
            c = t.copy()
        if name:
            copies[name] = c
        return c

    nodes = []
    for n in graph.nodes:
        # Node(op, name, attrs, inputs, outputs, domain): each input lists the node among its consumers, each
        # output among its producers, in this order
        node = new(gs.Node)
        d = node.__dict__
        d["op"], d["name"], d["attrs"] = n.op, n.name, OrderedDict(n.attrs)
        ins, outs = sync_list(node, "outputs"), sync_list(node, "inputs")
        d["inputs"] = ins
        for t in n.inputs:
            c = get(t)
            list.append(ins, c)
            list.append(c.outputs, node)
        d["outputs"] = outs
        for t in n.outputs:
            c = get(t)
            list.append(outs, c)
            list.append(c.inputs, node)
        d["domain"] = n.domain
        nodes.append(node)
    inputs = [get(t) for t in graph.inputs]
    outputs = [get(t) for t in graph.outputs]
    g = new(gs.Graph)
    d = g.__dict__
    # Graph.__init__'s attributes, in its order (no functions, no subgraphs: nothing for it to merge)
    d["nodes"], d["inputs"], d["outputs"] = nodes, inputs, outputs
    d["name"] = copy.copy(graph.name) if graph.name is not None else "onnx_graphsurgeon_graph"
    d["__name__"] = d["name"]
    d["doc_string"] = copy.copy(graph.doc_string) if graph.doc_string is not None else ""
    d["opset"] = copy.copy(graph.opset) if graph.opset is not None else gs.Graph.DEFAULT_OPSET
    d["producer_name"], d["producer_version"] = "", ""
    d["import_domains"], d["ir_version"], d["name_idx"] = graph.import_domains, graph.ir_version, 0
    d["_functions"] = []
    return g


def _copy_slow(graph: gs.Graph) -> gs.Graph:
    """:func:`copy_graph` through onnx-graphsurgeon's constructors (the reference its fast path is tested against)."""
    copies: dict[str, gs.Tensor] = {}

    def get(t: gs.Tensor) -> gs.Tensor:
        if not t.name:
            return gs.Variable.empty()
        c = copies.get(t.name)
        if c is None:
            c = copies[t.name] = t.copy()
        return c

    nodes = []
    for n in graph.nodes:
        if any(isinstance(v, gs.Graph) for v in n.attrs.values()):
            return graph.copy()
        nodes.append(gs.Node(n.op, n.name, OrderedDict(n.attrs), inputs=[get(t) for t in n.inputs],
                             outputs=[get(t) for t in n.outputs], domain=n.domain))
    return gs.Graph(nodes=nodes, inputs=[get(t) for t in graph.inputs], outputs=[get(t) for t in graph.outputs],
                    name=copy.copy(graph.name), doc_string=copy.copy(graph.doc_string), opset=copy.copy(graph.opset),
                    import_domains=graph.import_domains, functions=copy.copy(graph.functions), ir_version=graph.ir_version)


def cleanup(graph: gs.Graph) -> gs.Graph:
    """``graph.cleanup(remove_unused_graph_inputs=False)`` with the same effect, for graphs without subgraphs or
    local functions (those go through graphsurgeon's).

    The same steps in the same order: graph inputs lose their producers, nodes that no graph output depends on
    (walking back from the outputs through local tensors only: node outputs, graph inputs, constants; a name
    counted once, empty tensors always) are disconnected and dropped, the kept nodes stay in their order and
    graph.inputs becomes a new list of the same tensors.  graphsurgeon's own walk re-collects every tensor of
    the graph twice and looks each node's subgraphs up for every use.  Why not the public API, measured as for
    ``copy_graph``: the search's CPU time 0.64, 1.57, 0.46 s with this cleanup, 0.78, 1.84, 0.50 s with
    Graph.cleanup (it runs after each of the search's rewrites).  tests/rewrite/test_ir_speed.py holds the two
    equal on graphs cut back to a few of their tensors.
    """
    nodes = graph.nodes
    if graph.functions or any(isinstance(v, gs.Graph) for n in nodes for v in n.attrs.values()):
        return graph.cleanup(remove_unused_graph_inputs=False)
    for inp in graph.inputs:
        inp.inputs.clear()
    local: set[str] = set()
    for n in nodes:
        for t in n.outputs:
            if t.name:
                local.add(t.name)
        for t in n.inputs:
            if type(t) is gs.Constant:
                local.add(t.name)
    for t in graph.inputs:
        local.add(t.name)
    for t in graph.outputs:
        if type(t) is gs.Constant:
            local.add(t.name)
    member = {id(n) for n in nodes}
    seen: set[str] = set()
    used: set[int] = set()

    def wanted(t: gs.Tensor) -> bool:
        name = t.name
        if not name:
            return True
        if name not in local or name in seen:
            return False
        seen.add(name)
        return True

    queue = [t for t in graph.outputs if wanted(t)]
    i = 0
    while i < len(queue):
        t = queue[i]
        i += 1
        for node in t.inputs:
            if id(node) not in member:
                raise ValueError(f"cleanup: {node.name} produces {t.name} but is not in the graph")
            used.add(id(node))
            queue.extend(x for x in list(node.inputs) if wanted(x))
    kept = []
    for n in nodes:
        if id(n) in used:
            kept.append(n)
        else:
            n.inputs.clear()
            n.outputs.clear()
    graph.inputs = list(graph.inputs)
    graph.nodes = kept
    return graph


def toposort(graph: gs.Graph) -> gs.Graph:
    """``graph.toposort()`` in the same order, for graphs without subgraphs or local functions.

    The order is onnx-graphsurgeon's: each node's level (1 + its producers' highest, 0 without producers in the
    graph), nodes first listed depth-first, producers before their consumers, then stably sorted by level.  Its
    Graph.toposort computes this with a recursive walk that re-collects every graph's subgraphs and functions
    for each node.  Why not the public API, measured as for ``copy_graph``: the search's CPU time 0.64, 1.57,
    0.46 s with this toposort, 1.02, 2.32, 0.61 s with Graph.toposort (it runs after each of the search's
    rewrites).  tests/rewrite/test_ir_speed.py holds the two orders equal.
    """
    nodes = list(graph.nodes)
    if graph.functions or any(isinstance(v, gs.Graph) for n in nodes for v in n.attrs.values()):
        return graph.toposort()
    local = {t.name for n in nodes for t in n.outputs if t.name}
    local.update(t.name for t in graph.inputs)

    made: dict[int, list[gs.Node]] = {}

    def producers(node: gs.Node) -> list[gs.Node]:
        got = made.get(id(node))
        if got is not None:
            return got
        found: dict[int, gs.Node] = {}
        for t in node.inputs:
            if t.name in local and not isinstance(t, gs.Constant):
                for p in t.inputs:
                    found.setdefault(id(p), p)
        got = made[id(node)] = list(found.values())
        return got

    level: dict[int, int] = {}
    order: list[gs.Node] = []
    for root in nodes:
        if id(root) in level:
            continue
        stack, on_path = [(root, iter(producers(root)))], {id(root)}
        while stack:
            node, pending = stack[-1]
            for p in pending:
                if id(p) not in level:
                    if id(p) in on_path:
                        raise ValueError("toposort: the graph has a cycle")
                    on_path.add(id(p))
                    stack.append((p, iter(producers(p))))
                    break
            else:
                stack.pop()
                on_path.discard(id(node))
                level[id(node)] = 1 + max((level[id(p)] for p in producers(node)), default=-1)
                order.append(node)
    graph.nodes = sorted(order, key=lambda n: level[id(n)])
    return graph


def export_model(graph: gs.Graph, like: onnx.ModelProto, check: bool = True) -> onnx.ModelProto:
    """``graph`` as a model with ``like``'s opsets, IR version and metadata, shapes inferred and checked."""
    return put_back(*export_model_aside(graph, like, check))


def export_model_aside(graph: gs.Graph, like: onnx.ModelProto, check: bool = True
                       ) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """``export_model`` with the weights ``graph`` holds as arrays left out of the result: each such initializer
    above ``WEIGHTS_ASIDE_BYTES`` stays a placeholder (type and dimensions, external data at ``ASIDE_LOCATION``)
    and its array is returned by name, for ``put_back`` when the model's bytes are wanted.

    For the search's measured candidates: a GPU build plans each from its graph (``adopt_model(keep_arrays=True)``
    keeps exactly these arrays) and extracts its branches from that graph, so the candidate's own proto never
    needs the weights' bytes unless it is the one kept; writing them cost two copies of every weight per candidate
    (BERT-base on the 2-core CPU: 14.7 s of exporting 21 candidates)."""
    graph = copy_graph(graph)
    toposort(cleanup(graph))
    held = hold_large_weights(graph)
    model = gs.export_onnx(graph, do_type_check=False)
    model.ClearField("opset_import")
    model.opset_import.extend(like.opset_import)
    imported = {o.domain for o in like.opset_import}  # plus a domain a rule's fused node brought (core/fused_ops.py)
    model.opset_import.extend(d for d in graph.import_domains or [] if d.domain not in imported)
    model.ir_version = like.ir_version
    for field in ("producer_name", "producer_version", "domain", "model_version", "doc_string"):
        setattr(model, field, getattr(like, field))
    del model.metadata_props[:]
    model.metadata_props.extend(like.metadata_props)
    model.graph.name = like.graph.name
    del model.graph.value_info[:]
    out, aside = infer_aside(model, strict=check, held=held)  # ``model`` is this function's own: left without them
    if check:
        _check_aside(out, bool(aside))
    later = {name: v for name, v in aside.items() if isinstance(v, np.ndarray)}  # the graph's own arrays
    _put_back(out, {name: v for name, v in aside.items() if name not in later})
    return out, later


def weights_aside(model: onnx.ModelProto) -> set[str]:
    """The names of ``model``'s initializers that are placeholders for weights set aside
    (``export_model_aside``): their bytes are not in it."""
    return {t.name for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL
            and any(e.key == "location" and e.value == ASIDE_LOCATION for e in t.external_data)}


# ---------------------------------------------------------------------------------------------
# Canonical hash: the same computation gives the same hash whatever its node and tensor names
# ---------------------------------------------------------------------------------------------


def constant_digest(values) -> str:
    """A constant's contents, dtype and shape as a short digest (``GraphHasher``).

    sha256 over the array's own buffer: half blake2b's time where the CPU has SHA instructions (7 against 15 ms
    for a 768x2304 weight) and no copy (``tobytes`` was 0.8 ms of it); the search hashes every new weight its
    rules make (BERT-base: ~800, which took its search from 4.1 to 2.3-3.0 s on the 2-core machine)."""
    arr = np.ascontiguousarray(values)
    if arr.dtype.hasobject:  # strings: their values, not the pointers
        h = hashlib.sha256(repr(arr.tolist()).encode())
    else:
        h = hashlib.sha256(arr.view(np.uint8).reshape(-1) if arr.size else b"")
    h.update(f"{arr.dtype}{arr.shape}".encode())
    return "c" + h.hexdigest()[:24]


class GraphHasher:
    """Name-independent structural hashes of graphs; constant contents are hashed once per array."""

    def __init__(self):
        self._const: dict[int, tuple[weakref.ref, str]] = {}
        self._views: dict[tuple, tuple[weakref.ref, str]] = {}
        self._texts: dict[tuple, tuple[str, list]] = {}
        self._zero: dict[int, tuple[weakref.ref, bool]] = {}

    def _constant(self, t: gs.Constant) -> str:
        values = t.values
        hit = self._const.get(id(values))
        if hit is not None and hit[0]() is values:
            return hit[1]
        view = None
        if isinstance(values, np.ndarray) and isinstance(values.base, np.ndarray):
            # a slice of a weight (fission's halves): every candidate makes new view objects of the same bytes
            base = values.base
            offset = values.__array_interface__["data"][0] - base.__array_interface__["data"][0]
            view = (id(base), offset, values.shape, values.strides, values.dtype.str)
            hit = self._views.get(view)
            if hit is not None and hit[0]() is base:
                try:
                    self._const[id(values)] = (weakref.ref(values), hit[1])  # this view object, next time
                except TypeError:
                    pass
                return hit[1]
        digest = constant_digest(values)
        try:
            # a weak reference: the cache must not keep every weight the search ever made alive
            self._const[id(values)] = (weakref.ref(values), digest)
            if view is not None:
                self._views[view] = (weakref.ref(values.base), digest)
        except TypeError:
            pass
        return digest

    def _local_text(self, node: gs.Node) -> str:
        """``op|domain|canonical attributes`` of ``node``, remembered by the identity of its attribute values.

        Every candidate is a copy whose nodes share their attribute values with the graph they were copied from
        (rules set new values, they never change one in place), so the text is made once per distinct node
        and looked up by ``(op, domain, Conv weight shape, (name, id(value)) ...)``; the memo holds the values,
        so an id is never reused while it is a key."""
        attrs = node.attrs
        op = node.op
        wshape = None
        if op == "Conv" and len(node.inputs) > 1:
            wshape = static_shape(node.inputs[1])
        key = (op, node.domain, wshape, *[(k, id(v)) for k, v in attrs.items()])
        hit = self._texts.get(key)
        if hit is not None:
            return hit[0]
        parts = [op, node.domain or ""]
        canonical = _canonical_attrs(node)
        for k in sorted(canonical):
            parts.append(f"{k}={_attr_text(canonical[k])}")
        text = "|".join(parts)
        self._texts[key] = (text, list(attrs.values()))
        return text

    def __call__(self, graph: gs.Graph) -> str:
        tensor_hash: dict[int, str] = {}
        for t in graph.inputs:
            tensor_hash[id(t)] = "in:" + t.name
        node_hashes = []
        blake2b = hashlib.blake2b
        for node in graph.nodes:  # topologically sorted: rules toposort after every rewrite
            parts = [self._local_text(node)]
            for t in _canonical_inputs(node, self._is_zero):
                if t is None or not getattr(t, "name", ""):
                    parts.append("-" if not isinstance(t, str) else t)
                elif isinstance(t, gs.Constant):
                    parts.append(self._constant(t))
                else:
                    parts.append(tensor_hash.get(id(t), "ext:" + t.name))
            digest = blake2b("|".join(parts).encode(), digest_size=12).hexdigest()
            node_hashes.append(digest)
            for i, t in enumerate(node.outputs):
                tensor_hash[id(t)] = f"{digest}#{i}"
        outs = [tensor_hash.get(id(t), "ext:" + t.name) for t in graph.outputs]
        body = "|".join(sorted(node_hashes)) + "||" + "|".join(outs)
        return hashlib.blake2b(body.encode(), digest_size=16).hexdigest()

    def _is_zero(self, values) -> bool:
        """``not np.any(values)``, remembered per array (a weak reference, like the digests)."""
        hit = self._zero.get(id(values))
        if hit is not None and hit[0]() is values:
            return hit[1]
        zero = not np.any(values)
        try:
            self._zero[id(values)] = (weakref.ref(values), zero)
        except TypeError:
            pass
        return zero


_DEFAULTS = {"Gemm": {"alpha": 1.0, "beta": 1.0, "transA": 0, "transB": 0}}


def _canonical_attrs(node: gs.Node) -> dict:
    """Attributes with defaults filled in, so that a rewrite that spells a default out changes nothing."""
    if node.op == "Conv" and len(node.inputs) > 1:
        w = static_shape(node.inputs[1])
        if w is not None:
            return conv_attrs(node, len(w) - 2)
    defaults = _DEFAULTS.get(node.op)
    if defaults:
        return {**defaults, **node.attrs}
    return dict(node.attrs)


def _canonical_inputs(node: gs.Node, is_zero=lambda v: not np.any(v)) -> list:
    """Inputs, with a Conv's missing or all-zero bias spelled the same way."""
    inputs = list(node.inputs)
    if node.op == "Conv" and len(inputs) > 1 and isinstance(inputs[1], gs.Constant):
        channels = inputs[1].values.shape[0]
        bias = inputs[2] if len(inputs) > 2 else None
        if bias is None or not getattr(bias, "name", "") or (isinstance(bias, gs.Constant) and is_zero(bias.values)):
            inputs = inputs[:2] + [f"zeros({channels})"]
    return inputs


def _attr_text(v) -> str:
    if isinstance(v, gs.Constant):
        return hashlib.blake2b(np.ascontiguousarray(v.values).tobytes(), digest_size=8).hexdigest()
    if isinstance(v, np.ndarray):
        return repr(v.tolist())
    if isinstance(v, gs.Graph):
        return "graph:" + v.name
    return repr(v)

