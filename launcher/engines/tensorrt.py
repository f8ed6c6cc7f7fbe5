"""TensorRT engines: one serialized TensorRT 10 engine per branch, built from the branch's ONNX.

Build (``Builder``, one per ``parastream build``):
  ``trt.Builder`` -> ``create_network`` (strongly typed on request) -> ``trt.OnnxParser.parse`` (every
  parser error names a node) -> a ``BuilderConfig`` (workspace pool limit, precision flags,
  ``builder_optimization_level``, ``profiling_verbosity`` DETAILED, ``max_aux_streams`` 0, an
  optimization profile for every dynamic input) with ONE timing cache shared by every branch of the
  build and kept in a cache folder across builds -> ``build_serialized_network``.  The engine
  inspector's layer information of each branch goes into report.json.

Run (``load`` -> ``TrtEngine``):
  ``trt.Runtime.deserialize_cuda_engine`` -> one execution context per branch with its OWN device
  scratch memory (``ExecutionContextAllocationStrategy.USER_MANAGED`` + ``set_device_memory``),
  so branches that run side by side never share scratch.  ``enqueue(stream, addresses)`` sets
  every input shape and every IO tensor address to the launcher's buffers and calls
  ``execute_async_v3`` on the branch's stream: the launcher enqueues once before capture (what
  trtexec does too, so initialisation work stays out of the graph) and then captures.

Device memory that the engine owns itself (the context's scratch, and the buffers of the host
path ``run(feeds)``) goes through ``Memory`` (``CudaMemory``: cuda-python).  The tests swap it
for host memory and ``tensorrt`` for a documented test double (tests/trt_double/): TensorRT is
not installable in the project's CI (its wheels come from NVIDIA's own index).

References (TensorRT 10 Python API, docs.nvidia.com/deeplearning/tensorrt/latest/_static/python-api/):
  [Builder]  infer/Core/Builder.html (Builder, NetworkDefinitionCreationFlag)
  [Config]   infer/Core/BuilderConfig.html (BuilderFlag, MemoryPoolType, ProfilingVerbosity,
             create_timing_cache, set_timing_cache, builder_optimization_level, max_aux_streams)
  [Profile]  infer/Core/OptimizationProfile.html (set_shape)
  [Parser]   parsers/Onnx/pyOnnx.html (OnnxParser, ParserError: desc, node, node_name, node_operator)
  [Engine]   infer/Core/Engine.html (ICudaEngine: IO tensors, device_memory_size_v2,
             create_execution_context(strategy), create_engine_inspector)
  [Context]  infer/Core/ExecutionContext.html (set_device_memory, set_input_shape,
             set_tensor_address, execute_async_v3)
  [Inspect]  infer/Core/EngineInspector.html (get_engine_information, LayerInformationFormat)
  [Timing]   infer/Core/TimingCache.html (ITimingCache.serialize)
  [Logger]   infer/Core/Logger.html (subclassing trt.ILogger)
  [Samples]  NVIDIA/TensorRT samples/python/common.py (timing cache set-up),
             samples/python/common_runtime.py (execute_async_v3 with cuda-python),
             samples/common/sampleInference.cpp (one enqueue before CUDA graph capture)
"""

from __future__ import annotations

import json
import os
import re
import time
import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx

from parastream.core.files import write_atomic

from .. import cuda
from ..cuda import handle, nbytes_of
from ..errors import BackendUnavailable, ParastreamError
from ..plan import TensorSpec
from .base import (PRECISIONS, BuilderBase, BuildOptions, background_summary, cancel_precompile,  # noqa: F401
                   check_model, compiling, drop, hasten, fp32_pinned, memory_scope, own_workspaces, precompile, prepare_load,
                   slim_engine, start_workers, stop_workers)

name = "tensorrt"
suffix = ".plan"
gpu = True
# capabilities (base.Backend): a TensorRT engine per branch with its own tactics, layouts and fusions, built one
# at a time (one shared timing cache), its bindings NCHW in the model's dtypes
compiles_for_layout = False
builds_side_by_side = False
background_compiles = False
fuses_conv_relu = False
lowers_convolutions = False
supports_internal_nhwc = False
supports_channel_views = False
warms_after_load = False
compiles_repeats_once = False
tunes_kernels_from = None  # builder_optimization_level is the builder's: its tactics are timed within the build

INSTALL_HINT = ("pip install tensorrt from NVIDIA's index (pip install --extra-index-url https://pypi.nvidia.com "
                "tensorrt cuda-python), or use an NGC TensorRT/PyTorch container (see the Dockerfile)")
#: the launcher hands TensorRT 256-byte aligned buffers; set_device_memory requires that alignment [Context]
SCRATCH_ALIGN = 256
#: branch engines run on the launcher's streams; TensorRT's own auxiliary streams would compete with them
BRANCH_AUX_STREAMS = 0


def _trt():
    """The ``tensorrt`` module, imported on use (never at import time: this module imports everywhere)."""
    import tensorrt

    return tensorrt


def _gpu_check() -> str | None:
    """Why engines cannot run on a GPU here (no cuda-python, no device), or None."""
    try:
        cuda.runtime()
    except BackendUnavailable:
        return "TensorRT engines run through cuda-python, which is not installed: pip install cuda-python"
    if cuda.device_count() < 1:
        return "TensorRT builds and runs engines on a CUDA GPU and cuda-python sees none (use --backend onnxruntime on the CPU)"
    return None


def available() -> str | None:
    """None when TensorRT imports and a CUDA GPU is present; otherwise why not, with what to do."""
    try:
        _trt()
    except ImportError:
        return f"TensorRT is not installed: {INSTALL_HINT}"
    except Exception as e:  # noqa: BLE001 - a wheel without its libnvinfer raises OSError and others
        return f"TensorRT does not load ({type(e).__name__}: {e}): {INSTALL_HINT}"
    return _gpu_check()


def _device_name() -> str:
    try:
        return cuda.device_name(0)
    except Exception:  # noqa: BLE001 - informational, and part of the timing cache's file name only
        return "gpu"


def describe_device() -> str:
    trt = _trt()
    return f"cuda: {_device_name()} (TensorRT {trt.__version__})"


def _logger(trt):
    """A logger that keeps TensorRT's errors, so a failed build or load can quote them [Logger]."""

    class _Logger(trt.ILogger):
        def __init__(self):
            trt.ILogger.__init__(self)  # the docs require the explicit base-class call
            self.errors: list[str] = []
            self.warnings = 0

        def log(self, severity, msg):
            if severity in (trt.ILogger.Severity.INTERNAL_ERROR, trt.ILogger.Severity.ERROR):
                self.errors.append(str(msg))
            elif severity == trt.ILogger.Severity.WARNING:
                self.warnings += 1

    return _Logger()


# -- build ---------------------------------------------------------------------------------------------

def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "parastream" / "trt"


def timing_cache_path(options: BuildOptions) -> Path:
    """One cache file per TensorRT version and GPU model: TensorRT rejects a cache from another (set_timing_cache)."""
    trt = _trt()
    folder = Path(options.cache_dir).expanduser() if options.cache_dir else default_cache_dir()
    device = re.sub(r"[^A-Za-z0-9.]+", "-", _device_name()).strip("-") or "gpu"
    return folder / f"timing-trt{trt.__version__}-{device}.cache"


def _parser_error_message(errors: list, branch: onnx.ModelProto, name: str) -> str:
    """TensorRT's first parser error as one sentence naming the branch, then the node [Parser: ParserError]."""
    first = errors[0]
    nodes = branch.graph.node
    index = first.node()
    node_name = first.node_name() if hasattr(first, "node_name") else ""
    op = first.node_operator() if hasattr(first, "node_operator") else ""
    if 0 <= index < len(nodes):
        node_name = node_name or nodes[index].name
        op = op or nodes[index].op_type
    where = f"node {node_name!r} ({op})" if node_name or op else "the graph"
    more = f" (and {len(errors) - 1} more parser errors)" if len(errors) > 1 else ""
    return f"{name}: TensorRT's ONNX parser cannot import {where}: {first.desc()}{more}"


def _profile_shapes(options: BuildOptions, input_name: str, shape: list[int], name: str):
    if input_name not in options.profiles:
        raise ParastreamError(f"{name}: input {input_name!r} has dynamic shape {shape}; give its min:opt:max shapes "
                              f"(--batch) or a static shape (--shapes {input_name}:...)")
    lo, opt, hi = (list(map(int, s)) for s in options.profiles[input_name])
    for label, s in (("min", lo), ("opt", opt), ("max", hi)):
        if len(s) != len(shape):
            raise ParastreamError(f"{name}: the {label} shape {s} of input {input_name!r} has rank {len(s)}, the input has rank {len(shape)}")
        if any(d >= 0 and d != v for d, v in zip(shape, s)):
            raise ParastreamError(f"{name}: the {label} shape {s} of input {input_name!r} differs from its fixed dimensions {shape}")
    if not all(a <= b <= c for a, b, c in zip(lo, opt, hi)):
        raise ParastreamError(f"{name}: input {input_name!r} needs min <= opt <= max in every dimension, got {lo}, {opt}, {hi}")
    return lo, opt, hi


def bucket_profiles(buckets: list[dict[str, list[int]]]) -> list[dict[str, tuple[list[int], list[int], list[int]]]]:
    """One optimization profile per bucket of a shape grid (``BuildOptions.profiles`` as a list): profile k has
    min = opt = max = bucket k's shape of every input, so one engine with dynamic inputs serves each bucket at
    exactly its shape (what a static engine per bucket would run) from one copy of the weights."""
    return [{name: (list(shape), list(shape), list(shape)) for name, shape in b.items()} for b in buckets]


def _layer_information(trt, runtime, data: bytes) -> dict:
    """The engine inspector's JSON of every layer, and what an execution context needs [Inspect, Engine]."""
    engine = runtime.deserialize_cuda_engine(data)
    if engine is None:
        return {"layers": None, "inspector_error": "the engine did not deserialize for inspection"}
    info = engine.create_engine_inspector().get_engine_information(trt.LayerInformationFormat.JSON)
    try:
        parsed = json.loads(info)
    except ValueError:
        parsed = {"Layers": None, "raw": info}
    out = {"num_layers": int(engine.num_layers), "device_memory_bytes": _device_memory_size(engine),
           "layers": parsed.get("Layers") if isinstance(parsed, dict) else parsed}
    if isinstance(parsed, dict) and "Bindings" in parsed:
        out["bindings"] = parsed["Bindings"]
    if hasattr(engine, "num_aux_streams"):
        out["aux_streams"] = int(engine.num_aux_streams)
    return out


class Builder(BuilderBase):
    """Builds one TensorRT engine per branch; all branches of a build share one timing cache."""

    def __init__(self, options: BuildOptions):
        if options.precision not in PRECISIONS:
            raise ParastreamError(f"--precision {options.precision}: TensorRT builds one of {', '.join(PRECISIONS)}")
        if options.strongly_typed and options.precision in ("fp16", "bf16"):
            raise ParastreamError(f"--strongly-typed takes every precision from the model's own types, so --precision "
                                  f"{options.precision} cannot apply; convert the model to {options.precision} first, or drop --strongly-typed")
        if not 0 <= options.optimization_level <= 5:
            raise ParastreamError(f"--opt-level {options.optimization_level}: TensorRT's builder_optimization_level is 0..5")
        trt = self.trt = _trt()
        self.options = options
        self.logger = _logger(trt)
        # plugins (InstanceNormalization and others) import through the plugin registry (samples/python/efficientdet)
        trt.init_libnvinfer_plugins(self.logger, "")
        self.builder = trt.Builder(self.logger)
        self._runtime = None
        self.cache_path = timing_cache_path(options)
        self._cache = None
        self._cache_state = "new"
        self._report: dict[str, dict] = {}

    # -- pieces --------------------------------------------------------------------------------------
    def _network(self, branch: onnx.ModelProto, name: str):
        trt = self.trt
        # TensorRT 10 networks are always explicit batch (EXPLICIT_BATCH is deprecated and ignored);
        # STRONGLY_TYPED is the one flag we pass, as a bit mask [Builder: NetworkDefinitionCreationFlag]
        flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED) if self.options.strongly_typed else 0
        network = self.builder.create_network(flags)
        parser = trt.OnnxParser(network, self.logger)
        if not parser.parse(branch.SerializeToString()):
            errors = [parser.get_error(i) for i in range(parser.num_errors)]
            if not errors:
                raise ParastreamError(f"{name}: TensorRT's ONNX parser cannot import the graph: {self._first_error('no parser error was recorded')}")
            raise ParastreamError(_parser_error_message(errors, branch, name))
        return network, parser

    def _precision_flags(self, config) -> list[str]:
        trt, precision = self.trt, self.options.precision
        flags = []
        if precision == "fp32":
            # TF32 is on by default [Config: BuilderFlag.TF32]; fp32 means full fp32 matmuls and convolutions
            config.clear_flag(trt.BuilderFlag.TF32)
            return flags
        config.set_flag(trt.BuilderFlag.TF32)
        flags.append("TF32")
        if precision in ("fp16", "bf16"):
            flag = {"fp16": "FP16", "bf16": "BF16"}[precision]
            if not hasattr(trt.BuilderFlag, flag):
                raise ParastreamError(f"--precision {precision}: TensorRT {trt.__version__} has no BuilderFlag.{flag} "
                                      "(it builds strongly typed networks only); convert the model to "
                                      f"{precision} and pass --strongly-typed, or use TensorRT 10")
            # deprecated in 10.12 in favour of strong typing, still honoured by every TensorRT 10 [Config]
            config.set_flag(getattr(trt.BuilderFlag, flag))
            flags.append(flag)
        return flags

    def _pin_fp32(self, network, branch: onnx.ModelProto, config, flags: list[str]) -> list[str]:
        """--keep-fp32: the layers of the pinned nodes (the parser names a node's layer after it) compute and
        write fp32 [Layer: ILayer.precision, set_output_type]; OBEY_PRECISION_CONSTRAINTS makes the builder
        honour that rather than treat it as a hint [Config: BuilderFlag].  A strongly typed network takes its
        types from the model: nothing to pin there, nor in an fp32 build."""
        trt = self.trt
        nodes = set(fp32_pinned(branch, self.options.keep_fp32))
        if not nodes or self.options.strongly_typed or self.options.precision == "fp32":
            return []
        floats = {trt.DataType.FLOAT, trt.DataType.HALF, trt.DataType.BF16}
        pinned = []
        for i in range(network.num_layers):
            layer = network.get_layer(i)
            outs = [j for j in range(layer.num_outputs) if layer.get_output(j).dtype in floats]
            if layer.name not in nodes or not outs:
                continue
            layer.precision = trt.DataType.FLOAT
            for j in outs:
                layer.set_output_type(j, trt.DataType.FLOAT)
            pinned.append(layer.name)
        if pinned:
            config.set_flag(trt.BuilderFlag.OBEY_PRECISION_CONSTRAINTS)
            flags.append("OBEY_PRECISION_CONSTRAINTS")
        return pinned

    def _profile(self, network, config, name: str) -> dict | list:
        """The optimization profiles of a network with dynamic inputs: one from ``options.profiles`` (a dict,
        input -> (min, opt, max)), or one per bucket where ``options.profiles`` is a list of such dicts
        (``bucket_profiles``).  TensorRT 10's rules [Profile]: every profile gives every dynamic input, with
        min <= opt <= max and the input's fixed dimensions; profile k is the k-th added (the index an execution
        context selects).  A network without dynamic inputs gets TensorRT's default profile."""
        sets = self.options.profiles if isinstance(self.options.profiles, list) else [self.options.profiles]
        found: list[dict] = []
        for k, given in enumerate(sets):
            dynamic = {}
            where = name if len(sets) == 1 else f"{name} (profile {k}, bucket {k})"
            for i in range(network.num_inputs):
                tensor = network.get_input(i)
                shape = [int(d) for d in tensor.shape]
                if any(d < 0 for d in shape):
                    dynamic[tensor.name] = _profile_shapes(replace(self.options, profiles=given), tensor.name, shape, where)
            if not dynamic:
                return {}
            profile = self.builder.create_optimization_profile()
            for input_name, (lo, opt, hi) in dynamic.items():
                profile.set_shape(input_name, lo, opt, hi)  # [Profile]
            index = config.add_optimization_profile(profile)
            if index < 0:
                raise ParastreamError(f"{where}: TensorRT rejected the optimization profile {dynamic}: "
                                      f"{self._first_error('invalid profile')}")
            if index != k:
                raise ParastreamError(f"{where}: TensorRT numbered the profile {index}, not {k}; profiles are "
                                      "selected by the order they were added")
            found.append({n: {"min": v[0], "opt": v[1], "max": v[2]} for n, v in dynamic.items()})
        return found[0] if not isinstance(self.options.profiles, list) else found

    def _timing_cache(self, config) -> None:
        """Attach the build's one timing cache; the first branch creates it from the cache file [Samples: common.py].

        An ITimingCache "doesn't belong to a specific builder config. It can be shared by multiple
        builder instances" [Config: create_timing_cache], so every branch's config gets the same object
        and what one branch measured, the next ones reuse.
        """
        if self._cache is None:
            blob = b""
            if self.cache_path.is_file():
                try:
                    blob = self.cache_path.read_bytes()
                except OSError:
                    blob = b""
            try:
                cache = config.create_timing_cache(blob) if blob else None
            except Exception:  # noqa: BLE001 - a corrupt file: TensorRT may raise rather than return None
                cache = None
            # ignore_mismatch=False: a cache from another device or TensorRT version is refused, not half-used
            if cache is not None and config.set_timing_cache(cache, False):
                self._cache, self._cache_state = cache, "loaded"
                return
            if blob:
                self._cache_state = "discarded (unreadable or from another TensorRT/GPU)"
                self.logger.errors.clear()  # TensorRT logged the refusal; it is no error of this build
            self._cache = config.create_timing_cache(b"")
        if not config.set_timing_cache(self._cache, False):
            raise ParastreamError(f"TensorRT refused the build's timing cache: {self._first_error('set_timing_cache returned False')}")

    def _first_error(self, default: str) -> str:
        return self.logger.errors[0] if self.logger.errors else default

    # -- the contract --------------------------------------------------------------------------------
    def build(self, branch: onnx.ModelProto, name: str, layout: dict | None = None, *,
              max_aux_streams: int = BRANCH_AUX_STREAMS) -> bytes:
        """One engine for ``branch`` (``layout`` does not apply: TensorRT picks its own formats inside)."""
        trt, options = self.trt, self.options
        t0 = time.perf_counter()
        self.logger.errors.clear()
        network, _parser = self._network(branch, name)  # the parser must outlive the network's use
        config = self.builder.create_builder_config()
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(options.workspace_mb) << 20)
        flags = self._precision_flags(config)
        pinned = self._pin_fp32(network, branch, config, flags)
        config.builder_optimization_level = int(options.optimization_level)
        # DETAILED: the inspector then reports every layer's tactic, formats and fused ONNX nodes [Inspect]
        config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED
        config.max_aux_streams = int(max_aux_streams)
        profiles = self._profile(network, config, name)
        self._timing_cache(config)
        serialized = self.builder.build_serialized_network(network, config)  # IHostMemory, or None on failure [Builder]
        if serialized is None:
            raise ParastreamError(f"{name}: TensorRT could not build the engine: {self._first_error('build_serialized_network returned no engine')}")
        data = memoryview(serialized).tobytes()  # IHostMemory exposes the buffer protocol
        build_s = time.perf_counter() - t0
        if self._runtime is None:
            self._runtime = trt.Runtime(self.logger)
        entry = {
            "tensorrt": trt.__version__, "build_s": round(build_s, 4), "engine_bytes": len(data),
            "nodes": len(branch.graph.node), "precision": options.precision, "builder_flags": flags,
            "strongly_typed": bool(options.strongly_typed), "workspace_mb": int(options.workspace_mb),
            **({"fp32_layers": pinned} if pinned else {}),
            "optimization_level": int(options.optimization_level), "max_aux_streams": int(max_aux_streams),
            "profiles": profiles, "timing_cache": {"path": str(self.cache_path), "state": self._cache_state},
            "inputs": {network.get_input(i).name: [int(d) for d in network.get_input(i).shape] for i in range(network.num_inputs)},
        }
        entry.update(_layer_information(trt, self._runtime, data))
        self._report[name] = entry
        return data

    def report(self) -> dict:
        return self._report

    def close(self) -> None:
        """Persist the shared timing cache (atomically: write beside it, then rename); never raises."""
        if self._cache is None:
            return
        try:
            write_atomic(self.cache_path, memoryview(self._cache.serialize()).tobytes())
        except OSError as e:
            # close() runs in the pipeline's `finally`: a read-only cache folder must not hide the build's result
            warnings.warn(f"TensorRT timing cache not saved to {self.cache_path}: {e}", stacklevel=2)


def build_whole_model_engine(model: onnx.ModelProto, options: BuildOptions, max_aux_streams: int) -> bytes:
    """The whole model as one engine that may use ``max_aux_streams`` auxiliary streams of TensorRT's own.

    This is the baseline ``parastream bench`` compares against: TensorRT's own inter-layer
    parallelism [Config: max_aux_streams] in place of parastream's branches.
    """
    builder = Builder(options)
    try:
        return builder.build(model, "whole_model", max_aux_streams=max_aux_streams)
    finally:
        builder.close()


# -- run -----------------------------------------------------------------------------------------------

class CudaMemory:
    """Device memory, a stream and copies through cuda-python (``launcher.cuda``): the real path."""

    def alloc(self, nbytes: int) -> int:
        return cuda.malloc(nbytes)  # cudaMalloc: 256-byte aligned, as set_device_memory requires

    def free(self, ptr: int) -> None:
        cuda.free(ptr)

    def stream_create(self):
        return cuda.stream_create()

    def stream_destroy(self, stream) -> None:
        cuda.stream_destroy(stream)

    def copy_in(self, dst: int, array: np.ndarray, stream) -> None:
        cuda.memcpy_htod_async(dst, array.ctypes.data, array.nbytes, stream)

    def copy_out(self, array: np.ndarray, src: int, stream) -> None:
        cuda.memcpy_dtoh_async(array.ctypes.data, src, array.nbytes, stream)

    def synchronize(self, stream) -> None:
        cuda.stream_synchronize(stream)


#: what engines allocate their own memory with; the tests put host memory here
Memory = CudaMemory


def _dtype_names(trt) -> dict:
    """TensorRT DataType -> numpy dtype name (bfloat16 by name: numpy has none) [Engine: get_tensor_dtype]."""
    names = {"FLOAT": "float32", "HALF": "float16", "BF16": "bfloat16", "INT8": "int8", "UINT8": "uint8",
             "INT32": "int32", "INT64": "int64", "BOOL": "bool"}
    return {getattr(trt.DataType, k): v for k, v in names.items() if hasattr(trt.DataType, k)}


def _device_memory_size(engine) -> int:
    # device_memory_size_v2 supersedes device_memory_size from TensorRT 10.1 on [Engine]
    size = getattr(engine, "device_memory_size_v2", None)
    return int(size if size is not None else engine.device_memory_size)


def _host_dtype(spec: TensorSpec) -> np.dtype:
    return np.dtype(np.uint16) if spec.dtype == "bfloat16" else np.dtype(spec.dtype)  # bfloat16: raw bits


class TrtEngine:
    """One deserialized engine with one execution context and its own scratch memory.

    ``inputs``/``outputs`` default to the engine's own IO tensors (static shapes only).
    """

    def __init__(self, data: bytes, inputs: list[TensorSpec] | None = None, outputs: list[TensorSpec] | None = None,
                 options: BuildOptions | None = None, memory=None):
        trt = self.trt = _trt()
        self.options = options or BuildOptions(device="cuda")
        self._memory = memory if memory is not None else Memory()
        self._scratch = None
        self._stream = None
        self._buffers: dict[str, int] = {}
        self.context = None
        self.logger = _logger(trt)
        trt.init_libnvinfer_plugins(self.logger, "")
        self.runtime = trt.Runtime(self.logger)
        engine = self.runtime.deserialize_cuda_engine(data)
        if engine is None:
            why = self.logger.errors[0] if self.logger.errors else "not a TensorRT engine"
            raise ParastreamError(f"TensorRT {trt.__version__} cannot load this engine ({why}); an engine loads only on the "
                                  "TensorRT version and GPU model that built it: rebuild the bundle on this machine")
        self.engine = engine
        self.inputs, self.outputs = self._check_io(inputs, outputs)
        self._io = [t.name for t in self.inputs + self.outputs]

        # One context per engine, with scratch memory of its own: USER_MANAGED means TensorRT allocates
        # none and uses exactly what set_device_memory gives it, which must not be "the same memory for a
        # parallel execution context" [Context: set_device_memory; Engine: create_execution_context].
        self.context = engine.create_execution_context(trt.ExecutionContextAllocationStrategy.USER_MANAGED)
        if self.context is None:
            raise ParastreamError(f"TensorRT could not create an execution context: {self._first_error()}")
        self.scratch_bytes = _device_memory_size(engine)
        self._scratch = self._memory.alloc(max(self.scratch_bytes, SCRATCH_ALIGN))
        if hasattr(self.context, "set_device_memory"):  # TensorRT >= 10.1
            self.context.set_device_memory(self._scratch, self.scratch_bytes)
        else:
            self.context.device_memory = self._scratch
        for spec in self.inputs:
            self._set_shape(spec)

    # -- set-up -----------------------------------------------------------------------------------------
    def _first_error(self, default: str = "see TensorRT's log") -> str:
        return self.logger.errors[-1] if self.logger.errors else default

    def _check_io(self, inputs, outputs):
        trt, engine = self.trt, self.engine
        dtypes = _dtype_names(trt)
        found: dict[str, TensorSpec] = {}
        mode: dict[str, str] = {}
        for i in range(engine.num_io_tensors):
            tname = engine.get_tensor_name(i)
            m = engine.get_tensor_mode(tname)
            mode[tname] = "input" if m == trt.TensorIOMode.INPUT else "output"
            dt = engine.get_tensor_dtype(tname)
            found[tname] = TensorSpec(tname, dtypes.get(dt, str(dt)), [int(d) for d in engine.get_tensor_shape(tname)])
            if engine.is_shape_inference_io(tname):
                raise ParastreamError(f"tensor {tname!r} is a shape tensor of this TensorRT engine, which TensorRT reads from host "
                                      "memory; fold shape computations into constants (polygraphy surgeon sanitize --fold-constants) "
                                      "so that no shape tensor crosses a branch boundary")
        if inputs is None or outputs is None:
            for spec in found.values():
                if any(d < 0 for d in spec.shape):
                    raise ParastreamError(f"engine tensor {spec.name!r} has dynamic shape {spec.shape}; pass its static shape")
            inputs = [s for n, s in found.items() if mode[n] == "input"] if inputs is None else inputs
            outputs = [s for n, s in found.items() if mode[n] == "output"] if outputs is None else outputs
        want = {t.name: ("input", t) for t in inputs} | {t.name: ("output", t) for t in outputs}
        if set(want) != set(found):
            raise ParastreamError(f"the TensorRT engine's IO tensors {sorted(found)} differ from the plan's {sorted(want)}; rebuild the bundle")
        for tname, (role, spec) in want.items():
            have = found[tname]
            if mode[tname] != role:
                raise ParastreamError(f"tensor {tname!r} is an {mode[tname]} of the TensorRT engine, the plan has it as an {role}")
            if have.dtype != spec.dtype:
                raise ParastreamError(f"tensor {tname!r} is {have.dtype} in the TensorRT engine, the plan gives it {spec.dtype} buffers")
            if len(have.shape) != len(spec.shape) or any(d >= 0 and d != s for d, s in zip(have.shape, spec.shape)):
                raise ParastreamError(f"tensor {tname!r} has shape {have.shape} in the TensorRT engine, the plan has {spec.shape}")
        return list(inputs), list(outputs)

    def _set_shape(self, spec: TensorSpec) -> None:
        if not self.context.set_input_shape(spec.name, spec.shape):
            raise ParastreamError(f"TensorRT refused shape {spec.shape} for input {spec.name!r} (outside the engine's "
                                  f"optimization profile?): {self._first_error()}")

    # -- GPU -------------------------------------------------------------------------------------------
    def enqueue(self, stream_handle: int, addresses: dict[str, int]) -> None:
        """Queue the engine on ``stream_handle`` reading and writing the launcher's buffers at ``addresses``."""
        ctx = self.context
        for spec in self.inputs:
            self._set_shape(spec)
        for tname in self._io:
            if not ctx.set_tensor_address(tname, int(addresses[tname])):
                raise ParastreamError(f"TensorRT refused the address of tensor {tname!r}: {self._first_error()}")
        if not ctx.execute_async_v3(handle(stream_handle)):
            hint = ""
            try:
                if cuda.is_capturing(handle(stream_handle)):
                    # "the enqueue call may return false if the current CUDA graph capture fails" [Samples: sampleInference.cpp]
                    hint = " while the stream was capturing a CUDA Graph: this engine has layers that cannot be captured; load the bundle with graph=False"
            except Exception:  # noqa: BLE001 - the hint is a nicety
                pass
            raise ParastreamError(f"TensorRT's execute_async_v3 failed{hint}: {self._first_error()}")

    # -- host path ------------------------------------------------------------------------------------
    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Copy ``feeds`` in, run once on the engine's own stream, copy the outputs out (buffers made on first use)."""
        mem = self._memory
        if self._stream is None:
            self._stream = mem.stream_create()
            self._buffers = {t.name: mem.alloc(nbytes_of(t.shape, t.dtype)) for t in self.inputs + self.outputs}
        for spec in self.inputs:
            arr = np.ascontiguousarray(feeds[spec.name], dtype=_host_dtype(spec))
            if list(arr.shape) != list(spec.shape):
                raise ParastreamError(f"input {spec.name!r} has shape {list(arr.shape)}, the engine takes {spec.shape}")
            mem.copy_in(self._buffers[spec.name], arr, self._stream)
        self.enqueue(self._stream, self._buffers)
        out = {t.name: np.empty(t.shape, dtype=_host_dtype(t)) for t in self.outputs}
        for spec in self.outputs:
            mem.copy_out(out[spec.name], self._buffers[spec.name], self._stream)
        mem.synchronize(self._stream)
        return out

    def devices(self) -> set[int]:
        """The GPUs of the engine's memory: its context's scratch (allocated on the device whose context was
        current when the engine loaded, the context's own) and its host-path buffers."""
        return {cuda.pointer_device(p) for p in [self._scratch, *self._buffers.values()] if p}

    def close(self) -> None:
        """Free what the engine allocated; the context goes first, since it uses the scratch memory."""
        mem = self._memory
        self.context = None
        if self._stream is not None:
            mem.synchronize(self._stream)
            for ptr in self._buffers.values():
                mem.free(ptr)
            self._buffers = {}
            mem.stream_destroy(self._stream)
            self._stream = None
        if self._scratch is not None:
            mem.free(self._scratch)
            self._scratch = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class TrtWholeModelRunner(TrtEngine):
    """The baseline of ``parastream bench``: the whole model as ONE engine with TensorRT's own aux streams.

    ``enqueue(stream, addresses)`` and ``run(feeds)`` work as for a branch engine; TensorRT forks
    its auxiliary streams from, and joins them back into, the stream given to execute_async_v3
    [Context: set_aux_streams], so a capture of that stream captures them too.
    """

    @classmethod
    def from_model(cls, model: onnx.ModelProto, options: BuildOptions, max_aux_streams: int, *,
                   inputs: list[TensorSpec] | None = None, outputs: list[TensorSpec] | None = None, memory=None):
        data = build_whole_model_engine(model, options, max_aux_streams)
        return cls(data, inputs, outputs, options, memory)

    @property
    def aux_streams(self) -> int:
        return int(self.engine.num_aux_streams)


def load(data: bytes, inputs: list[TensorSpec], outputs: list[TensorSpec], device: str = "cuda",
         options: BuildOptions | None = None, internal_nhwc: set[str] | None = None,
         channel_views: dict[str, tuple[int, int]] | None = None, warm: bool = True, model_weights=None, *,
         memory=None) -> TrtEngine:
    """A branch engine; ``device`` is always a GPU for TensorRT (``run`` is a host-in, host-out path over it; a
    plan holds its weights: ``model_weights`` does not apply)."""
    try:
        _trt()
    except ImportError:
        raise BackendUnavailable(f"this bundle has TensorRT engines and TensorRT is not installed: {INSTALL_HINT}") from None
    return TrtEngine(data, inputs, outputs, options, memory)
