"""TEST DOUBLE of the ``tensorrt`` Python module (TensorRT 10) -- this is NOT TensorRT.

TensorRT cannot be installed in the project's CI, so the backend (launcher/engines/tensorrt.py) is
checked against this stand-in, which the tests put into ``sys.modules["tensorrt"]`` (it is never
installed).  It has exactly the API surface the backend calls, with the names, signatures and
documented behaviour of the TensorRT 10 Python API (docs.nvidia.com/deeplearning/tensorrt/latest/
_static/python-api/ and NVIDIA/TensorRT python/src at v10.16), and it records every call in
``CALLS`` so the tests can check our side: names, order, flags, shapes, addresses.

What it does in place of TensorRT:
* ``OnnxParser.parse`` loads the ONNX and rejects ops in ``UNSUPPORTED_OPS`` (or of a custom
  domain) the way TensorRT's parser does: parse() returns False and ``get_error(i)`` gives an
  error with ``code/desc/node/node_name/node_operator``.
* ``build_serialized_network`` checks what TensorRT checks for the things we set (a profile for
  every dynamic input, min <= opt <= max; no FP16/BF16 flag on a strongly typed network) and
  returns an ``IHostMemory`` holding a header (our settings, as JSON) plus the ONNX bytes.
* the timing cache is a set of per-node keys; a build counts hits and adds misses.
* ``execute_async_v3`` runs the ONNX with ONNX Runtime, reading inputs from and writing outputs to
  the integer addresses given by ``set_tensor_address``, which must be host memory from
  ``host_memory.HostMemory`` (``read``/``write`` refuse anything else).

What it cannot show: kernels, tactics, real precision, real device memory, stream ordering and
CUDA Graph capture.  Those are only exercised by the tests marked ``trt`` on a machine with TensorRT.
"""

from __future__ import annotations

import enum
import hashlib
import itertools
import json

import numpy as np
import onnx

from . import host_memory

__version__ = "10.16.0.double"
IS_TEST_DOUBLE = True

#: every call as (class, method, details); cleared by reset()
CALLS: list[tuple[str, str, dict]] = []
#: ops the double's parser has "no importer" for
UNSUPPORTED_OPS: set[str] = set()
#: device memory every context needs: base + per-layer, as device_memory_size_v2 reports it
SCRATCH_BASE = 4096
#: set_device_memory registrations: (context id, address, size)
DEVICE_MEMORY: list[tuple[int, int, int]] = []
#: what the double's "device" is; a timing cache made on another one is a mismatch
DEVICE = "double-gpu"

_ids = itertools.count(1)
_MAGIC = b"TRTDOUBLE1\n"
_CACHE_MAGIC = b"TRTDOUBLECACHE1\n"


def reset() -> None:
    CALLS.clear()
    UNSUPPORTED_OPS.clear()
    DEVICE_MEMORY.clear()


def _record(obj: str, method: str, **details) -> None:
    CALLS.append((obj, method, details))


def calls(obj: str | None = None, method: str | None = None) -> list[tuple[str, str, dict]]:
    return [c for c in CALLS if (obj is None or c[0] == obj) and (method is None or c[1] == method)]


# -- enums ---------------------------------------------------------------------------------------------

class NetworkDefinitionCreationFlag(enum.IntEnum):
    EXPLICIT_BATCH = 0  # deprecated in 10.0, ignored
    STRONGLY_TYPED = 1


class BuilderFlag(enum.IntEnum):
    FP16 = 0
    INT8 = 1
    DEBUG = 2
    GPU_FALLBACK = 3
    REFIT = 4
    DISABLE_TIMING_CACHE = 5
    TF32 = 6
    SPARSE_WEIGHTS = 7
    OBEY_PRECISION_CONSTRAINTS = 9
    PREFER_PRECISION_CONSTRAINTS = 10
    BF16 = 17


class MemoryPoolType(enum.IntEnum):
    WORKSPACE = 0
    DLA_MANAGED_SRAM = 1
    DLA_LOCAL_DRAM = 2
    DLA_GLOBAL_DRAM = 3
    TACTIC_DRAM = 4


class ProfilingVerbosity(enum.IntEnum):
    LAYER_NAMES_ONLY = 0
    NONE = 1
    DETAILED = 2


class LayerInformationFormat(enum.IntEnum):
    ONELINE = 0
    JSON = 1


class ExecutionContextAllocationStrategy(enum.IntEnum):
    STATIC = 0
    ON_PROFILE_CHANGE = 1
    USER_MANAGED = 2


class TensorIOMode(enum.IntEnum):
    NONE = 0
    INPUT = 1
    OUTPUT = 2


class DataType(enum.IntEnum):
    FLOAT = 0
    HALF = 1
    INT8 = 2
    INT32 = 3
    BOOL = 4
    UINT8 = 5
    FP8 = 6
    BF16 = 7
    INT64 = 8
    INT4 = 9


class ErrorCode(enum.IntEnum):
    SUCCESS = 0
    INTERNAL_ERROR = 1
    MEM_ALLOC_FAILED = 2
    MODEL_DESERIALIZE_FAILED = 3
    INVALID_VALUE = 4
    INVALID_GRAPH = 5
    INVALID_NODE = 6
    UNSUPPORTED_GRAPH = 7
    UNSUPPORTED_NODE = 8


_ONNX_TO_TRT = {onnx.TensorProto.FLOAT: DataType.FLOAT, onnx.TensorProto.FLOAT16: DataType.HALF,
                onnx.TensorProto.BFLOAT16: DataType.BF16, onnx.TensorProto.INT8: DataType.INT8,
                onnx.TensorProto.UINT8: DataType.UINT8, onnx.TensorProto.INT32: DataType.INT32,
                onnx.TensorProto.INT64: DataType.INT64, onnx.TensorProto.BOOL: DataType.BOOL}
_NP = {DataType.FLOAT: np.float32, DataType.HALF: np.float16, DataType.INT8: np.int8, DataType.INT32: np.int32,
       DataType.BOOL: np.bool_, DataType.UINT8: np.uint8, DataType.INT64: np.int64}


def nptype(trt_type: DataType):
    return _NP[trt_type]


def volume(shape) -> int:
    return int(np.prod(list(shape), dtype=np.int64))


class Dims(tuple):
    """TensorRT's Dims: a sequence of ints, -1 for a dynamic dimension."""


# -- logging -------------------------------------------------------------------------------------------

class ILogger:
    class Severity(enum.IntEnum):
        INTERNAL_ERROR = 0
        ERROR = 1
        WARNING = 2
        INFO = 3
        VERBOSE = 4

    def __init__(self):
        self._initialised = True  # subclasses must call ILogger.__init__ (the docs say so); checked on use

    def log(self, severity, msg):
        raise NotImplementedError


class Logger(ILogger):
    def __init__(self, min_severity=ILogger.Severity.WARNING):
        ILogger.__init__(self)
        self.min_severity = min_severity

    def log(self, severity, msg):
        pass


def _check_logger(logger) -> None:
    if not isinstance(logger, ILogger) or not getattr(logger, "_initialised", False):
        raise TypeError("expected a tensorrt.ILogger whose __init__ called ILogger.__init__(self)")


def init_libnvinfer_plugins(logger, namespace: str) -> bool:
    _check_logger(logger)
    _record("tensorrt", "init_libnvinfer_plugins", namespace=namespace)
    return True


# -- host memory, timing cache -------------------------------------------------------------------------

class IHostMemory(bytes):
    """Serialized data; real IHostMemory exposes the buffer protocol, as bytes does."""

    @property
    def nbytes(self) -> int:
        return len(self)

    @property
    def dtype(self) -> DataType:
        return DataType.UINT8


class ITimingCache:
    def __init__(self, entries: set[str] | None = None, device: str = DEVICE, version: str = __version__):
        self.id = next(_ids)
        self.entries: set[str] = set(entries or ())
        self.device, self.version = device, version
        self.hits = self.misses = 0

    def serialize(self) -> IHostMemory:
        _record("ITimingCache", "serialize", cache=self.id, entries=len(self.entries))
        header = json.dumps({"device": self.device, "version": self.version, "entries": sorted(self.entries)})
        return IHostMemory(_CACHE_MAGIC + header.encode())

    def combine(self, input_cache: "ITimingCache", ignore_mismatch: bool) -> bool:
        if not ignore_mismatch and (input_cache.device, input_cache.version) != (self.device, self.version):
            return False
        self.entries |= input_cache.entries
        return True

    def reset(self) -> bool:
        self.entries.clear()
        return True


# -- network and parser ---------------------------------------------------------------------------------

class ITensor:
    def __init__(self, name: str, shape, dtype: DataType):
        self.name, self.shape, self.dtype = name, Dims(shape), dtype


class ILayer:
    """One layer per ONNX node (named after it, as TensorRT's parser names a node's main layer), with the
    per-layer precision API: ``precision``, ``precision_is_set``, ``set_output_type``/``get_output_type``."""

    def __init__(self, network_id: int, node: onnx.NodeProto, out_dtypes: list[DataType]):
        self.network_id, self.name, self.type = network_id, node.name, node.op_type
        self._outputs = [ITensor(o, (), dt) for o, dt in zip(node.output, out_dtypes)]
        self._precision: DataType | None = None
        self.output_types: dict[int, DataType] = {}

    @property
    def num_outputs(self) -> int:
        return len(self._outputs)

    def get_output(self, index: int) -> ITensor:
        return self._outputs[index]

    @property
    def precision(self) -> DataType:
        return DataType.FLOAT if self._precision is None else self._precision

    @precision.setter
    def precision(self, dtype: DataType) -> None:
        _record("ILayer", "precision", network=self.network_id, layer=self.name, dtype=DataType(dtype).name)
        self._precision = DataType(dtype)

    @property
    def precision_is_set(self) -> bool:
        return self._precision is not None

    def set_output_type(self, index: int, dtype: DataType) -> None:
        _record("ILayer", "set_output_type", network=self.network_id, layer=self.name, index=index, dtype=DataType(dtype).name)
        self.output_types[index] = DataType(dtype)

    def get_output_type(self, index: int) -> DataType:
        return self.output_types.get(index, self._outputs[index].dtype)


class INetworkDefinition:
    def __init__(self, flags: int):
        self.id = next(_ids)
        self.flags = int(flags)
        self.model: onnx.ModelProto | None = None
        self._inputs: list[ITensor] = []
        self._outputs: list[ITensor] = []
        self._layers: list[ILayer] = []

    def get_layer(self, index: int) -> ILayer:
        return self._layers[index]

    def get_flag(self, flag: NetworkDefinitionCreationFlag) -> bool:
        return bool(self.flags & (1 << int(flag)))

    @property
    def num_inputs(self) -> int:
        return len(self._inputs)

    @property
    def num_outputs(self) -> int:
        return len(self._outputs)

    @property
    def num_layers(self) -> int:
        return len(self.model.graph.node) if self.model is not None else 0

    def get_input(self, index: int) -> ITensor:
        return self._inputs[index]

    def get_output(self, index: int) -> ITensor:
        return self._outputs[index]


def _value_tensor(v: onnx.ValueInfoProto) -> ITensor:
    tt = v.type.tensor_type
    dims = [d.dim_value if d.HasField("dim_value") else -1 for d in tt.shape.dim]
    return ITensor(v.name, dims, _ONNX_TO_TRT.get(tt.elem_type, DataType.FLOAT))


class ParserError:
    def __init__(self, code: ErrorCode, desc: str, node: int = -1, node_name: str = "", node_operator: str = ""):
        self._code, self._desc, self._node, self._name, self._op = code, desc, node, node_name, node_operator

    def code(self) -> ErrorCode:
        return self._code

    def desc(self) -> str:
        return self._desc

    def file(self) -> str:
        return "ModelImporter.cpp"

    def func(self) -> str:
        return "parseNode"

    def line(self) -> int:
        return 0

    def node(self) -> int:
        return self._node

    def node_name(self) -> str:
        return self._name

    def node_operator(self) -> str:
        return self._op

    def local_function_stack(self) -> list[str]:
        return []

    def local_function_stack_size(self) -> int:
        return 0

    def __str__(self) -> str:
        return f"In node {self._node} with name: {self._name} and operator: {self._op} ({self.func()}): {self._code.name}: {self._desc}"


class OnnxParser:
    def __init__(self, network: INetworkDefinition, logger: ILogger):
        _check_logger(logger)
        self.network, self.logger = network, logger
        self._errors: list[ParserError] = []
        _record("OnnxParser", "__init__", network=network.id)

    @property
    def num_errors(self) -> int:
        return len(self._errors)

    def get_error(self, index: int) -> ParserError:
        return self._errors[index]

    def clear_errors(self) -> None:
        self._errors.clear()

    def parse(self, model, path: str | None = None) -> bool:
        data = bytes(memoryview(model))
        _record("OnnxParser", "parse", network=self.network.id, nbytes=len(data), path=path)
        try:
            proto = onnx.load_from_string(data)
        except Exception:  # noqa: BLE001 - protobuf's DecodeError
            self._errors.append(ParserError(ErrorCode.MODEL_DESERIALIZE_FAILED, "Failed to parse ONNX model"))
            return False
        for i, node in enumerate(proto.graph.node):
            if node.op_type in UNSUPPORTED_OPS or node.domain not in ("", "ai.onnx"):
                # what TensorRT 10's parser says when no importer and no plugin matches an op
                self._errors.append(ParserError(
                    ErrorCode.INVALID_NODE, 'creator && "Plugin not found, are the plugin name, version, and namespace correct?"',
                    i, node.name, node.op_type))
                return False  # the real parser stops at the first node it cannot import
        initializers = {t.name for t in proto.graph.initializer}
        self.network.model = proto
        types = {v.name: _ONNX_TO_TRT.get(v.type.tensor_type.elem_type, DataType.FLOAT)
                 for v in (*proto.graph.input, *proto.graph.value_info, *proto.graph.output)}
        self.network._layers = [ILayer(self.network.id, n, [types.get(o, DataType.FLOAT) for o in n.output])
                                for n in proto.graph.node]
        self.network._inputs = [_value_tensor(v) for v in proto.graph.input if v.name not in initializers]
        self.network._outputs = [_value_tensor(v) for v in proto.graph.output]
        return True


# -- builder ---------------------------------------------------------------------------------------------

class IOptimizationProfile:
    def __init__(self):
        self.id = next(_ids)
        self.shapes: dict[str, tuple[list[int], list[int], list[int]]] = {}

    def set_shape(self, input: str, min, opt, max) -> None:  # noqa: A002 - TensorRT's parameter names
        self.shapes[input] = (list(min), list(opt), list(max))
        _record("IOptimizationProfile", "set_shape", profile=self.id, input=input, min=list(min), opt=list(opt), max=list(max))

    def get_shape(self, input: str):  # noqa: A002
        return self.shapes[input]


class IBuilderConfig:
    def __init__(self, logger):
        self.id = next(_ids)
        self.logger = logger
        self.flags = 1 << BuilderFlag.TF32  # TF32 is enabled by default
        self.pools: dict[MemoryPoolType, int] = {}
        self._opt_level = 3
        self._verbosity = ProfilingVerbosity.LAYER_NAMES_ONLY
        self._aux = -1  # -1: TensorRT chooses
        self.profiles: list[IOptimizationProfile] = []
        self.timing_cache: ITimingCache | None = None

    def set_memory_pool_limit(self, pool: MemoryPoolType, pool_size: int) -> None:
        self.pools[MemoryPoolType(pool)] = int(pool_size)
        _record("IBuilderConfig", "set_memory_pool_limit", config=self.id, pool=MemoryPoolType(pool).name, size=int(pool_size))

    def get_memory_pool_limit(self, pool: MemoryPoolType) -> int:
        return self.pools.get(MemoryPoolType(pool), 1 << 40)

    def set_flag(self, flag: BuilderFlag) -> None:
        self.flags |= 1 << BuilderFlag(flag)
        _record("IBuilderConfig", "set_flag", config=self.id, flag=BuilderFlag(flag).name)

    def clear_flag(self, flag: BuilderFlag) -> None:
        self.flags &= ~(1 << BuilderFlag(flag))
        _record("IBuilderConfig", "clear_flag", config=self.id, flag=BuilderFlag(flag).name)

    def get_flag(self, flag: BuilderFlag) -> bool:
        return bool(self.flags & (1 << BuilderFlag(flag)))

    @property
    def builder_optimization_level(self) -> int:
        return self._opt_level

    @builder_optimization_level.setter
    def builder_optimization_level(self, level: int) -> None:
        if not isinstance(level, int) or not 0 <= level <= 5:
            raise ValueError(f"builder_optimization_level must be 0..5, got {level!r}")
        self._opt_level = level
        _record("IBuilderConfig", "builder_optimization_level", config=self.id, value=level)

    @property
    def profiling_verbosity(self) -> ProfilingVerbosity:
        return self._verbosity

    @profiling_verbosity.setter
    def profiling_verbosity(self, value: ProfilingVerbosity) -> None:
        self._verbosity = ProfilingVerbosity(value)
        _record("IBuilderConfig", "profiling_verbosity", config=self.id, value=self._verbosity.name)

    @property
    def max_aux_streams(self) -> int:
        return self._aux

    @max_aux_streams.setter
    def max_aux_streams(self, value: int) -> None:
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"max_aux_streams must be a non-negative int, got {value!r}")
        self._aux = value
        _record("IBuilderConfig", "max_aux_streams", config=self.id, value=value)

    def add_optimization_profile(self, profile: IOptimizationProfile) -> int:
        _record("IBuilderConfig", "add_optimization_profile", config=self.id, profile=profile.id)
        for name, (lo, opt, hi) in profile.shapes.items():
            if not (len(lo) == len(opt) == len(hi)) or not all(a <= b <= c for a, b, c in zip(lo, opt, hi)):
                self.logger.log(ILogger.Severity.ERROR, f"IOptimizationProfile: invalid shapes for {name}")
                return -1
        self.profiles.append(profile)
        return len(self.profiles) - 1

    def create_timing_cache(self, serialized_timing_cache) -> ITimingCache | None:
        data = bytes(memoryview(serialized_timing_cache))
        _record("IBuilderConfig", "create_timing_cache", config=self.id, nbytes=len(data))
        if not data:
            return ITimingCache()
        if not data.startswith(_CACHE_MAGIC):
            self.logger.log(ILogger.Severity.ERROR, "ITimingCache: the serialized timing cache is corrupt")
            return None
        meta = json.loads(data[len(_CACHE_MAGIC):])
        return ITimingCache(set(meta["entries"]), meta["device"], meta["version"])

    def set_timing_cache(self, cache: ITimingCache, ignore_mismatch: bool) -> bool:
        if not isinstance(ignore_mismatch, bool):
            raise TypeError("ignore_mismatch must be a bool")
        _record("IBuilderConfig", "set_timing_cache", config=self.id, cache=cache.id, ignore_mismatch=ignore_mismatch)
        if not ignore_mismatch and (cache.device, cache.version) != (DEVICE, __version__):
            self.logger.log(ILogger.Severity.ERROR, "ITimingCache: the timing cache was created on another device or TensorRT version")
            return False
        self.timing_cache = cache
        return True

    def get_timing_cache(self) -> ITimingCache | None:
        return self.timing_cache


class Builder:
    def __init__(self, logger: ILogger):
        _check_logger(logger)
        self.logger = logger
        self.platform_has_fast_fp16 = True
        self.platform_has_tf32 = True
        _record("Builder", "__init__")

    def create_network(self, flags: int = 0) -> INetworkDefinition:
        net = INetworkDefinition(flags)
        _record("Builder", "create_network", flags=int(flags), network=net.id)
        return net

    def create_builder_config(self) -> IBuilderConfig:
        config = IBuilderConfig(self.logger)
        _record("Builder", "create_builder_config", config=config.id)
        return config

    def create_optimization_profile(self) -> IOptimizationProfile:
        profile = IOptimizationProfile()
        _record("Builder", "create_optimization_profile", profile=profile.id)
        return profile

    def build_serialized_network(self, network: INetworkDefinition, config: IBuilderConfig) -> IHostMemory | None:
        _record("Builder", "build_serialized_network", network=network.id, config=config.id)
        err = lambda msg: self.logger.log(ILogger.Severity.ERROR, msg)  # noqa: E731
        if network.model is None or not network.num_outputs:
            err("Network must have at least one output")
            return None
        if network.get_flag(NetworkDefinitionCreationFlag.STRONGLY_TYPED):
            for flag in (BuilderFlag.FP16, BuilderFlag.BF16, BuilderFlag.INT8):
                if config.get_flag(flag):
                    err(f"BuilderFlag::k{flag.name} is not allowed with a strongly typed network")
                    return None
        covered = {n for p in config.profiles for n in p.shapes}
        for t in network._inputs:
            if any(d < 0 for d in t.shape) and t.name not in covered:
                err(f"{t.name}: dynamic input is missing dimensions in profile 0.")
                return None
        nodes = list(network.model.graph.node)
        cache = config.timing_cache
        if cache is not None:
            for node in nodes:
                key = hashlib.sha1(onnx.helper.make_node(node.op_type, list(node.input), list(node.output),
                                                         **{a.name: onnx.helper.get_attribute_value(a) for a in node.attribute})
                                   .SerializeToString()).hexdigest()
                if key in cache.entries:
                    cache.hits += 1
                else:
                    cache.misses += 1
                    cache.entries.add(key)
        meta = {
            "flags": sorted(f.name for f in BuilderFlag if config.get_flag(f)),
            "strongly_typed": network.get_flag(NetworkDefinitionCreationFlag.STRONGLY_TYPED),
            "workspace": config.get_memory_pool_limit(MemoryPoolType.WORKSPACE),
            "optimization_level": config.builder_optimization_level,
            "verbosity": config.profiling_verbosity.name,
            "max_aux_streams": config.max_aux_streams,
            "profiles": [p.shapes for p in config.profiles],
            "inputs": [[t.name, int(t.dtype), list(t.shape)] for t in network._inputs],
            "outputs": [[t.name, int(t.dtype), list(t.shape)] for t in network._outputs],
            "layers": [[n.name, n.op_type, list(n.input), list(n.output)] for n in nodes],
            "layer_precisions": {l.name: l.precision.name for l in network._layers if l.precision_is_set},
            "cache_hits": cache.hits if cache else None,
        }
        header = json.dumps(meta).encode()
        return IHostMemory(_MAGIC + len(header).to_bytes(8, "little") + header + network.model.SerializeToString())


# -- runtime ---------------------------------------------------------------------------------------------

class IEngineInspector:
    def __init__(self, engine: "ICudaEngine"):
        self.engine = engine
        self.execution_context = None

    def _layer(self, index: int):
        name, op, ins, outs = self.engine.meta["layers"][index]
        if self.engine.meta["verbosity"] != "DETAILED":
            return name
        return {"Name": name, "LayerType": op, "Inputs": [{"Name": i} for i in ins], "Outputs": [{"Name": o} for o in outs],
                "TacticName": "double_tactic", "Origin": "ONNX"}

    def get_layer_information(self, layer_index: int, format: LayerInformationFormat) -> str:  # noqa: A002
        layer = self._layer(layer_index)
        return json.dumps(layer) if format == LayerInformationFormat.JSON else str(layer)

    def get_engine_information(self, format: LayerInformationFormat) -> str:  # noqa: A002
        _record("IEngineInspector", "get_engine_information", format=LayerInformationFormat(format).name)
        layers = [self._layer(i) for i in range(self.engine.num_layers)]
        if format == LayerInformationFormat.JSON:
            return json.dumps({"Layers": layers, "Bindings": [t[0] for t in self.engine.meta["inputs"] + self.engine.meta["outputs"]]})
        return "\n".join(map(str, layers))


class ICudaEngine:
    def __init__(self, meta: dict, model: bytes):
        self.id = next(_ids)
        self.meta = meta
        self._model = model
        self._io = [(n, TensorIOMode.INPUT, DataType(d), Dims(s)) for n, d, s in meta["inputs"]] + \
                   [(n, TensorIOMode.OUTPUT, DataType(d), Dims(s)) for n, d, s in meta["outputs"]]
        self._by_name = {t[0]: t for t in self._io}
        self.session = None

    @property
    def num_io_tensors(self) -> int:
        return len(self._io)

    @property
    def num_layers(self) -> int:
        return len(self.meta["layers"])

    @property
    def num_aux_streams(self) -> int:
        aux = self.meta["max_aux_streams"]
        return 0 if aux == 0 else (min(aux, 7) if aux > 0 else 1)

    @property
    def device_memory_size(self) -> int:  # deprecated in 10.1
        return self.device_memory_size_v2

    @property
    def device_memory_size_v2(self) -> int:
        return SCRATCH_BASE + 256 * self.num_layers

    @property
    def profiling_verbosity(self) -> ProfilingVerbosity:
        return ProfilingVerbosity[self.meta["verbosity"]]

    def get_tensor_name(self, index: int) -> str:
        return self._io[index][0]

    def get_tensor_mode(self, name: str) -> TensorIOMode:
        return self._by_name[name][1] if name in self._by_name else TensorIOMode.NONE

    def get_tensor_dtype(self, name: str) -> DataType:
        return self._by_name[name][2]

    def get_tensor_shape(self, name: str) -> Dims:
        return self._by_name[name][3]

    def is_shape_inference_io(self, name: str) -> bool:
        return False

    def create_engine_inspector(self) -> IEngineInspector:
        return IEngineInspector(self)

    def create_execution_context(self, strategy: ExecutionContextAllocationStrategy = ExecutionContextAllocationStrategy.STATIC):
        ctx = IExecutionContext(self, ExecutionContextAllocationStrategy(strategy))
        _record("ICudaEngine", "create_execution_context", engine=self.id, context=ctx.id, strategy=ctx.strategy.name)
        return ctx


class Runtime:
    def __init__(self, logger: ILogger):
        _check_logger(logger)
        self.logger = logger
        _record("Runtime", "__init__")

    def deserialize_cuda_engine(self, serialized_engine) -> ICudaEngine | None:
        data = bytes(memoryview(serialized_engine))
        _record("Runtime", "deserialize_cuda_engine", nbytes=len(data))
        if not data.startswith(_MAGIC):
            self.logger.log(ILogger.Severity.ERROR, "IRuntime::deserializeCudaEngine: Error Code 1: Serialization (Serialization assertion magicTagRead == kMAGIC_TAG failed.Magic tag does not match)")
            return None
        n = int.from_bytes(data[len(_MAGIC):len(_MAGIC) + 8], "little")
        start = len(_MAGIC) + 8
        return ICudaEngine(json.loads(data[start:start + n]), data[start + n:])


class IExecutionContext:
    def __init__(self, engine: ICudaEngine, strategy: ExecutionContextAllocationStrategy):
        self.id = next(_ids)
        self.engine = engine
        self.strategy = strategy
        self.scratch: tuple[int, int] | None = None
        self.shapes: dict[str, tuple] = {}
        self.addresses: dict[str, int] = {}

    def _memory(self, memory: int, size: int) -> None:
        if memory % 256:
            raise ValueError(f"set_device_memory: 0x{memory:x} is not 256-byte aligned")
        if size < self.engine.device_memory_size_v2:
            raise ValueError(f"set_device_memory: {size} bytes, the engine needs {self.engine.device_memory_size_v2}")
        self.scratch = (int(memory), int(size))
        DEVICE_MEMORY.append((self.id, int(memory), int(size)))
        _record("IExecutionContext", "set_device_memory", context=self.id, memory=int(memory), size=int(size))

    def set_device_memory(self, memory: int, size: int) -> None:
        self._memory(memory, size)

    device_memory = property(None, lambda self, memory: self._memory(memory, self.engine.device_memory_size_v2))

    def set_input_shape(self, name: str, shape) -> bool:
        shape = tuple(int(d) for d in shape)
        _record("IExecutionContext", "set_input_shape", context=self.id, name=name, shape=list(shape))
        if self.engine.get_tensor_mode(name) != TensorIOMode.INPUT:
            return False
        want = self.engine.get_tensor_shape(name)
        if len(want) != len(shape) or any(w >= 0 and w != s for w, s in zip(want, shape)):
            return False
        self.shapes[name] = shape
        return True

    def set_tensor_address(self, name: str, memory: int) -> bool:
        if not isinstance(memory, int):
            raise TypeError(f"set_tensor_address({name!r}, ...): memory must be an int, got {type(memory).__name__}")
        _record("IExecutionContext", "set_tensor_address", context=self.id, name=name, memory=memory)
        if self.engine.get_tensor_mode(name) == TensorIOMode.NONE:
            return False
        self.addresses[name] = memory
        return True

    def get_tensor_address(self, name: str) -> int:
        return self.addresses.get(name, 0)

    def execute_async_v3(self, stream_handle: int) -> bool:
        if not isinstance(stream_handle, int):
            raise TypeError(f"execute_async_v3: stream_handle must be an int, got {type(stream_handle).__name__}")
        _record("IExecutionContext", "execute_async_v3", context=self.id, stream=stream_handle, addresses=dict(self.addresses))
        if self.strategy == ExecutionContextAllocationStrategy.USER_MANAGED and self.scratch is None:
            return False  # TensorRT: a USER_MANAGED context needs set_device_memory before enqueue
        for name, mode, dtype, shape in self.engine._io:
            if name not in self.addresses or (mode == TensorIOMode.INPUT and any(d < 0 for d in shape) and name not in self.shapes):
                return False
        import onnxruntime as ort

        host_memory.stream_synchronize(stream_handle)  # on a GPU test: the inputs are written by then
        if self.engine.session is None:
            so = ort.SessionOptions()
            so.log_severity_level = 3
            self.engine.session = ort.InferenceSession(self.engine._model, so, providers=["CPUExecutionProvider"])
        feeds = {}
        for name, mode, dtype, shape in self.engine._io:
            if mode == TensorIOMode.INPUT:
                shp = self.shapes.get(name, shape)
                dt = np.dtype(nptype(dtype))
                feeds[name] = np.frombuffer(host_memory.read(self.addresses[name], volume(shp) * dt.itemsize), dtype=dt).reshape(shp)
        ptr, size = self.scratch or (0, 0)
        if ptr:
            host_memory.write(ptr, b"\xa5" * size)  # the double uses all of its scratch, as a real engine may
        outs = self.engine.session.run(None, feeds)
        names = [o.name for o in self.engine.session.get_outputs()]
        for name, value in zip(names, outs):
            dt = np.dtype(nptype(self.engine.get_tensor_dtype(name)))
            host_memory.write(self.addresses[name], np.ascontiguousarray(value, dtype=dt).tobytes())
        return True
