"""Cost models for the rewrite search and the scheduler.

A :class:`CostModel` gives the seconds one node takes (``node_cost``) and, for a
whole graph on K streams, ``graph_cost -> (critical_path, total_work)``:

* ``total_work``    = Σ node_cost(n)                 (what one stream would take)
* ``critical_path`` = the latency the shipped schedule of the graph on K streams is estimated to have:
  the build's own list scheduler (``parastream.core.schedule``: chains kept whole, units by upward rank,
  cross-stream inputs, events and one cost per engine charged), so the search minimises what the plan runs.

The search minimises ``mixed_cost = α·critical_path + (1−α)·total_work`` (α = 0.25).

Two sources of node costs:

* :class:`RooflineCostModel` — analytic, no GPU needed:
  ``t = max(flops / (peak·occupancy), bytes / bandwidth) + kernel_floor``,
  with FLOPs and bytes from the inferred shapes (:func:`node_flops_bytes`) and the
  device figures of :data:`DEVICES`.  ``occupancy`` = min(1, output tiles / SMs)
  for the GEMM-like ops, because at batch 1 a small Conv fills a fraction of the
  multiprocessors and does not reach the peak rate.
* :class:`ProfiledCostModel` — measured: every distinct op signature (op type,
  attributes, input shapes and dtypes) is run once as a one-node model through a
  ``measure(model) -> seconds`` callback that the engine side supplies; figures
  are kept in a JSON cache keyed by device, backend, precision and signature.

The roofline counts an elementwise op that an engine fuses into the preceding Conv/Gemm/MatMul
(:func:`is_fused_epilogue`) as the reading of its constants only; the profiled model as free.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol, runtime_checkable

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from parastream.core.errors import ParastreamError
from parastream.core.graph import node_edges, static_shape
from parastream.core.schedule import schedule_latency

DEFAULT_ALPHA = 0.25


# ---------------------------------------------------------------------------------------------
# Devices
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceSpec:
    """Peak rates of one GPU (dense, no structured sparsity), in FLOP/s and bytes/s."""

    name: str
    fp16_flops: float  # tensor-core FP16 (FP32 accumulate where the datasheet distinguishes)
    fp32_flops: float  # non-tensor FP32 (CUDA cores)
    bandwidth: float  # device memory bandwidth, bytes/s
    sms: int
    tf32_flops: float | None = None  # tensor-core TF32; None where the part has none (T4)

    def peak_flops(self, precision: str) -> float:
        if precision in ("fp16", "bf16", "half"):
            return self.fp16_flops
        if precision == "tf32":
            return self.tf32_flops or self.fp32_flops
        if precision in ("fp32", "float", "float32"):
            return self.fp32_flops
        raise ValueError(f"precision {precision!r}: choose fp32, tf32 or fp16")


T = 1e12
# Figures from the vendors' datasheets (NVIDIA H100, H200, A100, L40S, L4, T4 datasheets; the RTX 4090 from
# the Ada Lovelace architecture whitepaper, appendix A).  Tensor rates are the dense ones (the datasheets print
# "with sparsity" figures twice as large).  Memory bandwidth in bytes/s (1 GB/s = 1e9 B/s).
DEVICES: dict[str, DeviceSpec] = {
    d.name: d
    for d in (
        DeviceSpec("H100-SXM", fp16_flops=989.4 * T, fp32_flops=66.9 * T, bandwidth=3.35e12, sms=132, tf32_flops=494.7 * T),
        DeviceSpec("H100-PCIe", fp16_flops=756.0 * T, fp32_flops=51.2 * T, bandwidth=2.0e12, sms=114, tf32_flops=378.0 * T),
        DeviceSpec("H200", fp16_flops=989.4 * T, fp32_flops=66.9 * T, bandwidth=4.8e12, sms=132, tf32_flops=494.7 * T),
        DeviceSpec("A100-SXM", fp16_flops=312.0 * T, fp32_flops=19.5 * T, bandwidth=2.039e12, sms=108, tf32_flops=156.0 * T),
        DeviceSpec("L40S", fp16_flops=362.05 * T, fp32_flops=91.6 * T, bandwidth=0.864e12, sms=142, tf32_flops=183.0 * T),
        DeviceSpec("L4", fp16_flops=121.0 * T, fp32_flops=30.3 * T, bandwidth=0.300e12, sms=58, tf32_flops=60.0 * T),
        DeviceSpec("T4", fp16_flops=65.0 * T, fp32_flops=8.1 * T, bandwidth=0.320e12, sms=40, tf32_flops=None),
        # 4090: FP16 tensor with FP32 accumulate (165.2); with FP16 accumulate the whitepaper gives 330.3
        DeviceSpec("RTX-4090", fp16_flops=165.2 * T, fp32_flops=82.6 * T, bandwidth=1.008e12, sms=128, tf32_flops=82.6 * T),
    )
}

_ALIASES = {"h100": "H100-SXM", "h100sxm": "H100-SXM", "h100pcie": "H100-PCIe", "h200": "H200", "h200sxm": "H200",
            "a100": "A100-SXM", "a100sxm": "A100-SXM", "l40s": "L40S", "l4": "L4", "t4": "T4",
            "rtx4090": "RTX-4090", "4090": "RTX-4090"}


_CPU_SPEC: list[DeviceSpec] = []
# Nominal rates per core (fp32 FLOP/s with AVX2 FMA; with AVX-512, twice), copy bandwidth per core and its cap:
# about what numpy measures on our 2-core AVX2 development machine when it is quiet (30 GFLOP/s, 10 GB/s).
CPU_FLOPS_PER_CORE = 15e9
CPU_BANDWIDTH_PER_CORE, CPU_BANDWIDTH_MAX = 5e9, 100e9


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_device() -> DeviceSpec:
    """The "CPU" profile, for engines that run on this machine's CPU (the onnxruntime backend): nominal fp32 and
    copy rates from its core count and vector width, its cores as the parallel units.

    Nominal, not measured: a measured rate (it was, with numpy, once per process) moves with the machine's load
    by 10-50%, and with it the search's costs, so that the same command found other rewrites on a loaded and an
    idle machine.  The search compares candidates with each other, so only the ratios matter; the CPU build
    times its alternatives on the machine anyway (``choose_cpu_alternative``)."""
    if not _CPU_SPEC:
        cores = os.cpu_count() or 1
        flops = cores * CPU_FLOPS_PER_CORE * (2 if "avx512f" in _cpu_flags() else 1)
        bandwidth = min(cores * CPU_BANDWIDTH_PER_CORE, CPU_BANDWIDTH_MAX)
        _CPU_SPEC.append(DeviceSpec("CPU", fp16_flops=flops, fp32_flops=flops, bandwidth=bandwidth, sms=cores,
                                    tf32_flops=flops))
    return _CPU_SPEC[0]


def get_device(name: str | DeviceSpec) -> DeviceSpec:
    """The table entry for ``name`` (case, dashes and spaces ignored: "h100 sxm", "H100-SXM"); "CPU" is this
    machine's CPU (:func:`cpu_device`)."""
    if isinstance(name, DeviceSpec):
        return name
    if "".join(ch for ch in name.lower() if ch.isalnum()) == "cpu":
        return cpu_device()
    if name in DEVICES:
        return DEVICES[name]
    key = "".join(ch for ch in name.lower() if ch.isalnum())
    for full in DEVICES:
        if "".join(ch for ch in full.lower() if ch.isalnum()) == key:
            return DEVICES[full]
    if key in _ALIASES:
        return DEVICES[_ALIASES[key]]
    raise ParastreamError(f"--device-profile {name!r} is not in the device table; choose one of {', '.join(DEVICES)}, CPU")


# ---------------------------------------------------------------------------------------------
# FLOPs and bytes of one node
# ---------------------------------------------------------------------------------------------

# No kernel of their own: metadata ops and views (a contiguous reshape never copies).
VIEW_OPS = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Shape", "Size", "Constant",
                      "Dropout", "ConstantOfShape"})
# FLOPs per output element of pointwise ops (transcendentals count a few).
_POINTWISE = {
    "Add": 1, "Sub": 1, "Mul": 1, "Div": 1, "Relu": 1, "LeakyRelu": 2, "PRelu": 2, "Max": 1, "Min": 1, "Abs": 1,
    "Neg": 1, "Clip": 2, "Sqrt": 4, "Reciprocal": 4, "Pow": 8, "Exp": 8, "Log": 8, "Sigmoid": 8, "Tanh": 8,
    "Erf": 8, "Gelu": 12, "HardSigmoid": 3, "HardSwish": 4, "Softplus": 10, "Elu": 8, "Selu": 8, "Mish": 20,
    "Where": 1, "Equal": 1, "Greater": 1, "Less": 1, "Not": 1, "And": 1, "Or": 1, "Sign": 1, "Floor": 1,
    "Ceil": 1, "Round": 1, "Cast": 0, "Sin": 8, "Cos": 8, "Silu": 9, "Swish": 9, "BiasGelu": 13,
}
_REDUCE = {"ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL2", "ReduceL1",
           "ReduceSumSquare", "ReduceLogSumExp", "ArgMax", "ArgMin", "GlobalAveragePool", "GlobalMaxPool"}
_NORM = {"LayerNormalization": 8, "InstanceNormalization": 8, "GroupNormalization": 8, "BatchNormalization": 2,
         "LpNormalization": 4, "SimplifiedLayerNormalization": 6, "SkipLayerNormalization": 9}


def _numel(t: gs.Tensor) -> int:
    shape = static_shape(t)
    return math.prod(shape) if shape is not None else 0


def _itemsize(t: gs.Tensor, float_bytes: int | None) -> int:
    dtype = t.values.dtype if isinstance(t, gs.Constant) else t.dtype
    try:
        dt = np.dtype(dtype)
    except TypeError:
        return 2  # onnx-only types (bfloat16, fp8) that numpy cannot name: count 2 bytes
    if float_bytes is not None and dt.kind == "f":
        return float_bytes
    return dt.itemsize


def _tensor_bytes(tensors, float_bytes: int | None) -> float:
    seen, total = set(), 0.0
    for t in tensors:
        if t is None or isinstance(t, str) or id(t) in seen or not getattr(t, "name", ""):
            continue
        seen.add(id(t))
        total += _numel(t) * _itemsize(t, float_bytes)
    return total


def _gemm_tiles(rows: int, cols: int, batch: int = 1, tile: int = 128) -> int:
    return batch * math.ceil(max(rows, 1) / tile) * math.ceil(max(cols, 1) / tile)


def node_flops_bytes(node: gs.Node, float_bytes: int | None = None) -> tuple[float, float]:
    """FLOPs and bytes moved by ``node``, from its inferred shapes and dtypes.

    ``float_bytes`` counts floating-point tensors at that width (2 for an fp16 engine)
    instead of their declared dtype.  A bias is part of the GEMM epilogue and adds bytes, not FLOPs.
    Views (Reshape, Squeeze, …) cost (0, 0); a tensor
    of unknown shape counts 0 bytes.  Unknown ops: bytes of inputs and outputs, 0 FLOPs.
    """
    return _flops_bytes_tiles(node, float_bytes)[:2]


def _flops_bytes_tiles(node: gs.Node, float_bytes: int | None = None) -> tuple[float, float, int | None]:
    op = node.op
    if op in VIEW_OPS:
        return 0.0, 0.0, None
    ins = [t for t in node.inputs if t is not None and getattr(t, "name", "")]
    outs = [t for t in node.outputs if t is not None and getattr(t, "name", "")]
    out = outs[0] if outs else None
    out_n = _numel(out) if out is not None else 0
    if op == "Split" and ins:
        shape = static_shape(ins[0])
        axis = int(node.attrs.get("axis", 0))
        if shape is not None and all(d == 1 for d in shape[: axis % max(len(shape), 1)]):
            return 0.0, 0.0, None  # contiguous slices: consumers read views
    byts = _tensor_bytes(ins, float_bytes) + _tensor_bytes(outs, float_bytes)
    flops, tiles = 0.0, None

    if op in ("Conv", "ConvTranspose") and len(ins) >= 2:
        w = static_shape(ins[1])
        if w is not None and len(w) >= 3:
            per = int(np.prod(w[1:], dtype=np.int64))
            if op == "Conv":
                flops = 2.0 * out_n * per
                oshape = static_shape(out)
                if oshape is not None and len(oshape) >= 3:
                    rows = oshape[0] * int(np.prod(oshape[2:], dtype=np.int64))
                    group = int(node.attrs.get("group", 1))
                    tiles = _gemm_tiles(rows, max(oshape[1] // max(group, 1), 1), batch=max(group, 1))  # group <= 0: an invalid model, still costed
            else:
                flops = 2.0 * _numel(ins[0]) * per
                oshape = static_shape(out)
                if oshape is not None and len(oshape) >= 3:
                    tiles = _gemm_tiles(oshape[0] * int(np.prod(oshape[2:], dtype=np.int64)), oshape[1])
    elif op in ("MatMul", "Gemm", "MatMulInteger", "FusedMatMul", "MatMulBiasActivation") and len(ins) >= 2:
        a = static_shape(ins[0])
        if a is not None and out is not None and out_n:
            if op == "Gemm":
                k = a[0] if node.attrs.get("transA", 0) else a[-1]
            else:
                k = a[-1]
            flops = 2.0 * out_n * k
            oshape = static_shape(out)
            if oshape:
                rows = oshape[-2] if len(oshape) >= 2 else 1
                batch = int(np.prod(oshape[:-2], dtype=np.int64)) if len(oshape) > 2 else 1
                tiles = _gemm_tiles(rows, oshape[-1], batch)
            activation = str(node.attrs.get("activation", "Relu"))
            if op == "MatMulBiasActivation" and activation != "Identity":  # parastream's GEMM with its bias and
                flops += float(_POINTWISE.get(activation, 1) * out_n)      # activation as the epilogue
    elif op in _POINTWISE:
        flops = float(_POINTWISE[op] * out_n)
    elif op in ("MaxPool", "AveragePool", "LpPool"):
        k = node.attrs.get("kernel_shape", [1])
        flops = float(out_n * int(np.prod(k)))
    elif op in _REDUCE:
        flops = float(_numel(ins[0])) if ins else 0.0
    elif op == "Softmax" or op == "LogSoftmax":
        flops = 5.0 * out_n
    elif op in _NORM:
        flops = float(_NORM[op] * out_n)
    elif op in ("Attention", "ScaledDotProductAttention") and len(ins) >= 3:
        q, k = static_shape(ins[0]), static_shape(ins[1])
        if q is not None and k is not None and len(q) >= 2 and out is not None and out_n:
            # softmax(Q·Kᵀ)·V: two GEMMs of Sq x Sk per head (D and Dv deep) and the softmax, the scores never
            # written (4-d Attention's K may have fewer heads: its Sk is still k[-2])
            oshape = static_shape(out)
            heads, sq, sk, dv = int(np.prod(oshape[:-2], dtype=np.int64)), q[-2], k[-2], oshape[-1]
            flops = 2.0 * heads * sq * sk * (q[-1] + dv) + 5.0 * heads * sq * sk
            tiles = _gemm_tiles(sq, dv, heads)
    elif op == "Einsum":
        flops = 2.0 * max((_numel(t) for t in ins), default=0) * 8  # rough: no contraction analysis
    return flops, byts, tiles


# Ops whose epilogue can absorb a following elementwise op (TensorRT, cuDNN and Inductor all fuse these).
EPILOGUE_PRODUCERS = frozenset({"Conv", "ConvTranspose", "Gemm", "MatMul"})
_EPILOGUE_OPS = frozenset(_POINTWISE) | {"BatchNormalization"}


_COST_ATTRS = ("group", "axis", "kernel_shape", "transA")  # the attributes _flops_bytes_tiles reads


def _tensor_key(t) -> tuple | None:
    if t is None or isinstance(t, str) or not getattr(t, "name", ""):
        return None
    if isinstance(t, gs.Constant):
        # shape and type without the values: a weight imported from a model (gs's LazyValues) would otherwise be
        # converted from its proto at every read (4.8 s of planning 13 Inception-v4 candidates, profiled)
        try:
            return (tuple(int(d) for d in t.shape), np.dtype(t.dtype), True)
        except TypeError:  # a type numpy does not name (gs leaves some onnx types as they are)
            v = t.values
            return (v.shape, v.dtype, True)
    shape = t.shape
    return (tuple(shape) if shape is not None else None, t.dtype, False)


def node_key(node: gs.Node, fused_epilogues: bool = True, tensor_keys: dict | None = None) -> tuple:
    """What the roofline cost of ``node`` depends on: its op, the attributes the cost reads, the shapes and types
    of its inputs and outputs, which of them are the same tensor (counted once), and, with ``fused_epilogues``,
    whether it runs inside its producer's kernel.  Two nodes with the same key cost the same.

    ``tensor_keys``: a dict kept for one pass over one graph (``_tensor_key`` by ``id`` of the tensor: each tensor
    is read by its producer and every consumer; the search costs hundreds of candidates node by node)."""
    first: dict[int, int] = {}  # id(tensor) -> index of its first use
    ios: list = []
    for group in (node.inputs, node.outputs):
        for t in group:
            if isinstance(t, str) or not getattr(t, "name", ""):
                ios.append((_tensor_key(t), -1))
                continue
            i = id(t)
            if tensor_keys is None:
                key = _tensor_key(t)
            else:
                key = tensor_keys.get(i, _MISSING)
                if key is _MISSING:
                    key = tensor_keys[i] = _tensor_key(t)
            at = first.get(i)
            if at is None:
                at = first[i] = len(first)
            ios.append((key, at))
        ios.append(None)  # inputs | outputs
    attrs = node.attrs
    attrs = tuple([(a, repr(attrs[a])) for a in _COST_ATTRS if a in attrs]) if attrs else ()
    return (node.op, attrs, tuple(ios), fused_epilogues and is_fused_epilogue(node))


_MISSING = object()


def is_fused_epilogue(node: gs.Node, _depth: int = 0) -> bool:
    """True when ``node`` is an elementwise op (activation, or arithmetic with constants) applied to the only
    use of a Conv/Gemm/MatMul output, directly or through other such ops: an engine runs it inside that kernel,
    and it costs only the reading of its constants."""
    if node.op not in _EPILOGUE_OPS or _depth > 8 or not node.outputs:
        return False
    variables = [t for t in node.inputs if isinstance(t, gs.Variable)]
    if len(variables) != 1:
        return False
    data = variables[0]
    if len(data.inputs) != 1 or len(data.outputs) != 1:
        return False
    producer = data.inputs[0]
    return producer.op in EPILOGUE_PRODUCERS or is_fused_epilogue(producer, _depth + 1)


# ---------------------------------------------------------------------------------------------
# Cost models
# ---------------------------------------------------------------------------------------------


def mixed_cost(critical_path: float, total_work: float, alpha: float = DEFAULT_ALPHA) -> float:
    """The search's objective: α·critical_path + (1−α)·total_work."""
    return alpha * critical_path + (1.0 - alpha) * total_work


@runtime_checkable
class CostModel(Protocol):
    def node_cost(self, node: gs.Node) -> float: ...

    def is_memory_bound(self, node: gs.Node) -> bool: ...

    def graph_cost(self, graph: gs.Graph, streams: int) -> tuple[float, float]: ...


class _GraphCostMixin:
    def graph_cost(self, graph: gs.Graph, streams: int) -> tuple[float, float]:
        """(critical_path, total_work) in seconds of ``graph`` (shape-inferred) on ``streams`` streams: the
        latency the shipped schedule is estimated to have (``core.schedule.schedule_latency``: chains kept
        whole, cross-stream events and engines charged) and the sum of the node costs."""
        figures = getattr(self, "_node_figures", None)
        if figures is not None:
            costs, bound = figures(graph)
        else:
            costs = [self.node_cost(n) for n in graph.nodes]
            bound = [self.is_memory_bound(n) for n in graph.nodes]
        return schedule_latency(node_edges(graph), costs, bound, streams), float(sum(costs))


class RooflineCostModel(_GraphCostMixin):
    """Analytic cost: ``max(flops / (peak·occupancy), bytes / bandwidth) + kernel_floor``; needs no GPU."""

    def __init__(self, device: str | DeviceSpec = "H100-SXM", precision: str = "fp32", kernel_floor: float = 3e-6,
                 occupancy: bool = True, fuse_epilogues: bool = True):
        self.fuse_epilogues = fuse_epilogues
        self.device = get_device(device)
        self.precision = precision
        self.peak = self.device.peak_flops(precision)
        self.float_bytes = 2 if precision in ("fp16", "bf16", "half") else None
        self.kernel_floor = kernel_floor
        self.occupancy = occupancy
        # node costs by node_key: the search costs thousands of candidates that share most of their nodes
        self._costs: dict[tuple, float] = {}
        self._bound: dict[tuple, bool] = {}
        self._figures: dict[tuple, tuple[float, bool]] = {}  # (cost, memory-bound) by node_key, for graph_cost

    def describe(self) -> str:
        return f"roofline {self.device.name} {self.precision}"

    def node_cost(self, node: gs.Node) -> float:
        key = node_key(node, self.fuse_epilogues)
        cost = self._costs.get(key)
        if cost is None:
            cost = self._costs[key] = self._node_cost(node)
        return cost

    def _node_figures(self, graph: gs.Graph) -> tuple[list[float], list[bool]]:
        """``node_cost`` and ``is_memory_bound`` of every node of one graph, its tensors' keys computed once and
        each node's key hashed once (the same keys, the same figures)."""
        tensor_keys: dict[int, tuple | None] = {}
        figures, fused = self._figures, self.fuse_epilogues
        costs: list[float] = []
        bound: list[bool] = []
        for node in graph.nodes:
            key = node_key(node, fused, tensor_keys)
            known = figures.get(key)
            if known is None:
                known = figures[key] = (self.node_cost(node), self.is_memory_bound(node))
            costs.append(known[0])
            bound.append(known[1])
        return costs, bound

    def _node_cost(self, node: gs.Node) -> float:
        if self.fuse_epilogues and is_fused_epilogue(node):
            # no kernel and no round trip of the activation: only its own constants are read
            return _tensor_bytes([t for t in node.inputs if isinstance(t, gs.Constant)], self.float_bytes) / self.device.bandwidth
        flops, byts, tiles = _flops_bytes_tiles(node, self.float_bytes)
        if flops == 0.0 and byts == 0.0:
            return 0.0
        peak = self.peak
        if self.occupancy and tiles:  # no tiles (an empty tensor): nothing to scale the peak by
            peak *= min(1.0, tiles / self.device.sms)
        return max(flops / peak, byts / self.device.bandwidth) + self.kernel_floor

    def is_memory_bound(self, node: gs.Node) -> bool:
        """Arithmetic intensity (FLOP/byte) below the device's ridge point at this precision."""
        key = node_key(node, False)
        bound = self._bound.get(key)
        if bound is None:
            bound = self._bound[key] = self._is_memory_bound(node)
        return bound

    def _is_memory_bound(self, node: gs.Node) -> bool:
        flops, byts, _ = _flops_bytes_tiles(node, self.float_bytes)
        if byts == 0.0:
            return False
        return flops / byts < self.peak / self.device.bandwidth


# ---------------------------------------------------------------------------------------------
# Measured costs
# ---------------------------------------------------------------------------------------------

CACHE_VERSION = 1
_SMALL_CONSTANT = 64  # constant inputs up to this many elements are part of the signature (shapes, axes, pads)


def _attr_jsonable(v):
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, (list, tuple)):
        return [_attr_jsonable(x) for x in v]
    if isinstance(v, (np.integer, np.floating)):
        return v.item()
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    if isinstance(v, gs.Tensor):
        return {"tensor": list(static_shape(v) or [])}
    return repr(type(v).__name__)  # subgraphs: not profiled in detail


def node_signature(node: gs.Node) -> str | None:
    """A canonical text of what a kernel's time depends on; None when a shape is unknown."""
    ins = []
    for t in node.inputs:
        if t is None or not getattr(t, "name", ""):
            ins.append(None)
            continue
        shape = static_shape(t)
        if shape is None:
            return None
        dtype = t.values.dtype if isinstance(t, gs.Constant) else t.dtype
        entry = {"shape": list(shape), "dtype": str(np.dtype(dtype)) if dtype is not None else "?",
                 "const": isinstance(t, gs.Constant)}
        if isinstance(t, gs.Constant) and t.values.size <= _SMALL_CONSTANT:
            entry["value"] = np.asarray(t.values).tolist()
        ins.append(entry)
    for t in node.outputs:
        if static_shape(t) is None:
            return None
    sig = {"op": node.op, "domain": node.domain or "", "attrs": {k: _attr_jsonable(v) for k, v in sorted(node.attrs.items())},
           "inputs": ins}
    return json.dumps(sig, sort_keys=True, separators=(",", ":"))


def single_node_model(node: gs.Node, opset: int = 17) -> onnx.ModelProto:
    """A model of ``node`` alone: variable inputs become graph inputs, constants stay initializers."""
    inputs, new_inputs = [], []
    for i, t in enumerate(node.inputs):
        if t is None or not getattr(t, "name", ""):
            new_inputs.append(gs.Variable.empty())
            continue
        if isinstance(t, gs.Constant):
            new_inputs.append(gs.Constant(f"c{i}", np.asarray(t.values)))
        else:
            v = gs.Variable(f"in{i}", dtype=t.dtype, shape=list(static_shape(t)))
            new_inputs.append(v)
            inputs.append(v)
    outputs = [gs.Variable(f"out{i}", dtype=t.dtype, shape=list(static_shape(t) or [])) for i, t in enumerate(node.outputs)]
    clone = gs.Node(node.op, name="probe", attrs=dict(node.attrs), inputs=new_inputs, outputs=outputs, domain=node.domain)
    graph = gs.Graph(nodes=[clone], inputs=inputs, outputs=outputs, opset=opset)
    return gs.export_onnx(graph)


class ProfiledCostModel(_GraphCostMixin):
    """Node costs measured once per op signature, through ``measure(model) -> seconds``, cached in a JSON file.

    The cache key is ``device|backend|precision|sha256(signature)``, so one file can hold
    the figures of several devices; a second build on the same device measures nothing.
    Nodes that cannot be measured (unknown shapes, the measurement raised) take the
    ``fallback`` model's estimate and are listed in ``failures``.
    """

    def __init__(self, measure: Callable[[onnx.ModelProto], float], cache_file: str | os.PathLike | None = None,
                 device: str = "H100-SXM", backend: str = "torch", precision: str = "fp32",
                 fallback: CostModel | None = None, *, opset: int = 17, fuse_epilogues: bool = True):
        self.measure = measure
        self.fuse_epilogues = fuse_epilogues
        self.cache_file = Path(cache_file) if cache_file is not None else None
        self.device = device
        self.backend = backend
        self.precision = precision
        self.fallback = fallback or RooflineCostModel(device if device in DEVICES else "H100-SXM", precision=precision)
        self.opset = opset
        self.measured = 0  # measurements taken by this instance
        self.failures: dict[str, str] = {}
        self._cache: dict[str, dict] = {}
        if self.cache_file is not None and self.cache_file.exists():
            try:
                data = json.loads(self.cache_file.read_text())
                if data.get("version") == CACHE_VERSION:
                    self._cache = dict(data.get("entries", {}))
            except (OSError, ValueError):
                self._cache = {}  # an unreadable cache is rebuilt, never trusted

    def describe(self) -> str:
        return f"profiled {self.device} {self.backend} {self.precision}"

    def key(self, signature: str) -> str:
        digest = hashlib.sha256(signature.encode()).hexdigest()[:24]
        return f"{self.device}|{self.backend}|{self.precision}|{digest}"

    def node_cost(self, node: gs.Node) -> float:
        if node.op in VIEW_OPS or (self.fuse_epilogues and is_fused_epilogue(node)):
            return 0.0
        sig = node_signature(node)
        if sig is None:
            return self.fallback.node_cost(node)
        key = self.key(sig)
        hit = self._cache.get(key)
        if hit is not None:
            return float(hit["seconds"])
        try:
            seconds = float(self.measure(single_node_model(node, self.opset)))
            if not math.isfinite(seconds) or seconds < 0:
                raise ValueError(f"measure returned {seconds}")
        except Exception as e:  # noqa: BLE001 - a kernel the backend cannot build still needs a cost
            self.failures[node.name] = f"{type(e).__name__}: {e}"
            return self.fallback.node_cost(node)
        self.measured += 1
        self._cache[key] = {"seconds": seconds, "op": node.op}
        self._save()
        return seconds

    def is_memory_bound(self, node: gs.Node) -> bool:
        return self.fallback.is_memory_bound(node)

    def _save(self) -> None:
        if self.cache_file is None:
            return
        self.cache_file.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.cache_file.parent, prefix=".cost-cache-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump({"version": CACHE_VERSION, "entries": self._cache}, f, indent=0, sort_keys=True)
        os.replace(tmp, self.cache_file)


def ort_measure(repeats: int = 20) -> Callable[[onnx.ModelProto], float]:
    """A ``measure`` callback that times a one-node model with ONNX Runtime on the CPU (median of ``repeats``).

    For tests and CPU builds; GPU figures come from the engine backend's own callback.
    """

    def measure(model: onnx.ModelProto) -> float:
        import time

        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 1
        sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        rng = np.random.default_rng(0)
        feeds = {}
        for i in sess.get_inputs():
            shape = [d if isinstance(d, int) else 1 for d in i.shape]
            dt = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64,
                  "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(bool)": np.bool_}.get(i.type, np.float32)
            feeds[i.name] = rng.standard_normal(shape).astype(dt) if dt != np.bool_ else rng.random(shape) > 0.5
        sess.run(None, feeds)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            sess.run(None, feeds)
            times.append(time.perf_counter() - t0)
        return float(np.median(times))

    return measure
