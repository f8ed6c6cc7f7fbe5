"""The engine-backend contract: ``Backend`` names every member the build and the launchers use.

An engine backend (a module: onnxruntime, torch, tensorrt) turns one branch (a self-contained ONNX model) into
an engine and loads it again for the launcher:

* ``available()`` says why the backend cannot run here (``None`` when it can); ``check_model(model)`` fails,
  naming the node, for a model it cannot run; ``describe_device()`` names the device engines are built for.
* ``Builder(options).build(branch_model, name, layout=None) -> bytes`` serialises one engine; a builder lives for
  one ``parastream build`` so it can share state between branches (TensorRT's timing cache); ``build_all``
  builds many; ``report()`` returns per-branch figures for report.json and ``close()`` persists caches.
* ``load(data, inputs, outputs, device, options, ...) -> BranchEngine``; ``model_weights`` (name -> the bundle's
  model.onnx initializer, ``Bundle.initializer``) for an engine that keeps its weights there.
* ``slim_engine(data, held) -> bytes``: an engine file as a written bundle ships it beside its model.onnx (the
  torch backend drops the ONNX weights a compiled engine never reads, onnxruntime those its session takes from
  model.onnx at load: ``slim_initializers``, ``refill_initializers``; TensorRT keeps its plan as it is).

What differs between backends is said by capability flags, never by the backend's name: ``compiles_for_layout``
(engines are compiled for the GPU launcher's tensor layout: ``build`` takes ``layout``), ``builds_side_by_side``
(``build_all`` compiles in parallel: the build hands it every branch at once), ``background_compiles``
(``start_workers``, ``precompile(background=True)``, ``compiling``, ``hasten``, ``drop``, ``cancel_precompile`` and
``background_summary`` do something), ``fuses_conv_relu`` (``BuildOptions.fuse_conv_relu`` changes the engines),
``lowers_convolutions`` (so does ``BuildOptions.conv_kernels``), ``supports_internal_nhwc`` and ``supports_channel_views`` (what ``load`` takes of the launcher's layout),
``warms_after_load`` (``load(warm=False)`` defers the engine's first call to ``engine.warm()``),
``compiles_repeats_once`` (branches of equal code compile once: the build cuts a one-stream plan into one engine
per repeated block, ``core.blocks``), ``tunes_kernels_from`` (the ``--opt-level`` from which the backend tunes its
kernels on the device at compile time, at a cost of build time the level's compiles multiply: the build compiles
its rounds at the level below and races the level asked for last; None where the level is the builder's own
business, TensorRT's tactics).  A backend
without a capability keeps the defaults below (``BuilderBase``, ``no_precompile``, ...).

A ``BranchEngine`` names its inputs and outputs and has ``run(feeds)`` on the CPU
and, on a GPU, ``enqueue(stream_handle, addresses)`` with the shape of TensorRT's
``execute_async_v3``: every input and output is a device pointer owned by the
launcher, and the work is queued on the given CUDA stream.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:  # (a load imports no onnx: its import would hold the interpreter while torch's runs)
    import onnx

from ..plan import TensorSpec

PRECISIONS = ("fp32", "tf32", "fp16", "bf16")


@dataclass
class BuildOptions:
    precision: str = "fp32"
    device: str = "cpu"  # "cpu" or "cuda"
    workspace_mb: int = 4096
    optimization_level: int = 3  # TensorRT builder_optimization_level (0..5)
    strongly_typed: bool = False
    # dynamic inputs: name -> (min, opt, max) shapes, for TensorRT optimization profiles
    profiles: dict[str, tuple[list[int], list[int], list[int]]] = field(default_factory=dict)
    cache_dir: str | None = None  # where timing caches / compiled artefacts persist across builds
    compile: bool = True  # torch backend: TorchInductor; False = eager
    threads: int = 0  # onnxruntime intra-op threads per engine (0 = onnxruntime's default: every core)
    spin: bool = True  # onnxruntime: intra-op threads spin between runs (off where many sessions share the cores)
    # torch backend on a GPU: a 2-d Conv read only by a Relu runs as cuDNN's fused conv + bias + ReLU.
    # A GPU build times the bundle with and without it and records the faster in manifest.json.
    fuse_conv_relu: bool = True
    # with it, the fused convolutions left to Inductor's convolution and epilogue (``cudnn_fused.conv_key``s): a
    # GPU build times each shape alone and lists those cuDNN's fused kernel runs slower (``time_conv_shapes``)
    conv_relu_unfused: list[str] = field(default_factory=list)
    # and those of a Conv -> Relu run on their channels padded to a multiple of 8 (``cudnn_fused.padded_channels``):
    # the shapes whose padded call the same timing found faster than both other forms
    conv_channels_padded: list[str] = field(default_factory=list)
    # torch backend: an attention node (rewrite rule fuse_attention) runs as one scaled_dot_product_attention
    # kernel; off, as its matmul-softmax-matmul.  A GPU build times both and records the faster in manifest.json.
    fuse_attention: bool = True
    # torch backend: "inductor" writes depthwise convolutions as ops Inductor compiles into its own kernels (no
    # cuDNN execution plan to build at every process's first call: ``onnx_torch._conv_as_kernels``); "native" runs
    # them as torch's own depthwise kernel (``onnx_torch._conv_native_depthwise``: precompiled, no plan either);
    # "triton" runs them, and convolutions of at most 16 channels a group, as parastream's own Triton kernel
    # (``conv_triton``); "cudnn" runs every convolution through torch's convolution; "auto" (default) is "cudnn",
    # and a GPU build of a model with such convolutions times cuDNN's against Inductor's, then the faster against
    # torch's own, then the faster against parastream's, and records the one it keeps (pipeline/measure.py).
    conv_kernels: str = "auto"
    # torch backend on a GPU: depthwise convolutions that ``conv_kernels`` leaves to cuDNN run through cuDNN plans
    # each engine ships (built when it compiles, deserialized at load: ``cudnn_plans.py``) rather than plans torch
    # builds at every process's first call.  Without cuDNN's frontend, or on another GPU or cuDNN, the op is
    # torch's own convolution.
    cudnn_plans: bool = True
    # torch backend on a GPU: a matmul-bias-activation node (rewrite rule fuse_gemm_epilogue) runs as one
    # torch._addmm_activation (cuBLASLt's fused epilogue); off, as its matmul, add and activation.  A GPU build
    # times both and records the faster in manifest.json.
    fuse_gemm_epilogue: bool = True
    # onnxruntime: build() loads each branch into a session to check it; off where the caller loads it next
    # anyway (the CPU build's scratch bundles, loaded to be timed: the check cost a second copy of the weights)
    check: bool = True
    # torch backend: what an engine ships (docs/torch-engines.md compares them): "inductor" (Inductor's
    # precompiled artifact), "aoti" (an AOTInductor package) or "jit" (the branch's ONNX, compiled at every load)
    torch_artifact: str = "inductor"
    # torch backend, "inductor" artifacts: "kernels" (Inductor's wrapper and its kernels' cubins, loaded without
    # Inductor or Triton), "bundled" (``standalone_compile(aot=True)``) or "cache" (Inductor's cache entries)
    inductor_format: str = "kernels"
    # torch backend: processes that compile engines side by side (0: every core but one, at most 16)
    compile_workers: int = 0
    # GPU builds: take turns with other processes' timing on the same GPU (a machine-wide lock) while timing
    gpu_timing_lock: bool = True
    # --keep-fp32: op types, node names or globs whose branches (TensorRT: layers) compute in fp32 (``fp32_pinned``)
    keep_fp32: list[str] = field(default_factory=list)


CONV_KERNELS = ("auto", "cudnn", "inductor", "native", "triton")  # BuildOptions.conv_kernels
LOWERED_CONV_KERNELS = ("inductor", "native", "triton")  # the values that write depthwise (with "triton", also narrow-group) convolutions otherwise than cuDNN


def conv_kernels_used(value: str) -> str:
    """What ``BuildOptions.conv_kernels`` compiles: "auto" compiles cuDNN's until a GPU build's timing says."""
    return value if value in LOWERED_CONV_KERNELS else "cudnn"


@runtime_checkable
class BranchEngine(Protocol):
    """What ``load`` returns.  Besides these, a GPU engine has ``enqueue(stream_handle, addresses)`` and
    ``close()``; a ``warms_after_load`` backend's engine has ``warm()``; an engine that may compile at load says so
    in ``compiled_at_load`` (the build's report counts them) and its load's steps in ``phases``."""

    inputs: list[TensorSpec]
    outputs: list[TensorSpec]

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...


#: one item of ``Builder.build_all``: (branch, name, the launcher's layout for it or None)
BuildItem = tuple["onnx.ModelProto", str, "dict | None"]


class Builder(Protocol):
    options: BuildOptions

    def build(self, branch: onnx.ModelProto, name: str, layout: dict | None = None) -> bytes: ...

    def build_all(self, items: list[BuildItem]) -> list[bytes]: ...

    def report(self) -> dict: ...

    def close(self) -> None: ...


class BuilderBase:
    """What a builder without side-by-side builds or layouts inherits: ``build_all`` builds one branch at a time."""

    options: BuildOptions

    def build(self, branch: onnx.ModelProto, name: str, layout: dict | None = None) -> bytes:
        raise NotImplementedError

    def build_all(self, items: list[BuildItem]) -> list[bytes]:
        return [self.build(branch, name, layout) for branch, name, layout in items]

    def waits_for_background(self, items: list[BuildItem]) -> bool:
        """Whether ``build_all(items)`` would compile none of them itself and would wait for some that compile in the
        background: each can then be built when it is needed (``pipeline.build.Engines.launcher``)."""
        return False

    def report(self) -> dict:
        return {}

    def close(self) -> None:
        pass


class Backend(Protocol):
    """What ``launcher.engines.get_backend(name)`` returns (a module): every member the build and the launchers use.
    tests/engines/test_backend_contract.py checks that each backend has each one, with this signature."""

    name: str
    suffix: str  # engine file suffix: ".onnx", ".plan", ...
    gpu: bool
    # capability flags (the module docstring says what each allows)
    compiles_for_layout: bool
    builds_side_by_side: bool
    background_compiles: bool
    fuses_conv_relu: bool
    lowers_convolutions: bool  # BuildOptions.conv_kernels changes the engines
    supports_internal_nhwc: bool
    supports_channel_views: bool
    warms_after_load: bool
    compiles_repeats_once: bool
    tunes_kernels_from: int | None

    def available(self) -> str | None: ...

    def check_model(self, model: onnx.ModelProto) -> None: ...

    def describe_device(self) -> str | None: ...

    def Builder(self, options: BuildOptions) -> Builder: ...

    def load(self, data: bytes, inputs: list[TensorSpec], outputs: list[TensorSpec], device: str = "cpu",
             options: BuildOptions | None = None, internal_nhwc: set[str] | None = None,
             channel_views: dict[str, tuple[int, int]] | None = None, warm: bool = True,
             model_weights: Callable | None = None) -> BranchEngine: ...

    def slim_engine(self, data: bytes, held: Callable) -> bytes: ...

    def memory_scope(self) -> Callable[[], contextlib.AbstractContextManager]: ...

    def own_workspaces(self) -> None: ...

    def prepare_load(self, manifest: dict, report: dict | None = None) -> None: ...

    def start_workers(self, options: BuildOptions) -> None: ...

    def stop_workers(self) -> None: ...

    def precompile(self, batches: list[tuple[Builder, list[BuildItem]]], *, background: bool = False,
                   cancellable: bool = True, order: str = "auto", label: str = "") -> dict | None: ...

    def compiling(self, keys: list[str]) -> int: ...

    def hasten(self, keys: list[str]) -> int: ...

    def drop(self, keys: list[str]) -> int: ...

    def cancel_precompile(self) -> int: ...

    def background_summary(self, since: float) -> dict | None: ...


# -- the defaults of a backend without background compiles or a device of its own ------------------------------
def check_model(model: onnx.ModelProto) -> None:
    """Nothing checked before the build: the builder fails on the first branch it cannot build, naming it."""


def describe_device() -> str | None:
    """None: the build describes the host's CPU (``host_cpu``)."""
    return None


def host_cpu() -> str:
    """This machine's CPU as a build records it: its model and its cores, which a CPU build's timed choice
    depends on (``pipeline.timings`` keys the choice by it).  /proc/cpuinfo's "model name" on Linux, where
    ``platform.processor()`` says only "x86_64"; a library for this (py-cpuinfo) would be a dependency for
    one line of a file."""
    import os
    import platform

    name = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    name = name or platform.processor() or platform.machine() or "unknown"
    return f"cpu: {name}, {os.cpu_count() or 1} cores ({platform.system()})"


def memory_scope() -> Callable[[], contextlib.AbstractContextManager]:
    """What a GPU launcher enters around its engines' loads and runs: nothing (no private memory pool)."""
    return contextlib.nullcontext


def own_workspaces() -> None:
    """Nothing: no library workspace outlives a call (called in a launcher's memory scope before its capture)."""


def prepare_load(manifest: dict, report: dict | None = None) -> None:
    """Nothing to start before a bundle's hashes are checked."""


def slim_engine(data: bytes, held: Callable) -> bytes:
    """The engine file as it is: it holds nothing that the bundle's model.onnx holds for it."""
    return data


def slim_initializers(model: "onnx.ModelProto", held: Callable[[str], "onnx.TensorProto | None"]) -> list[str]:
    """Drop, in ``model`` (an engine's ONNX), the data of each initializer that ``held`` (name -> the bundle's
    model.onnx initializer) holds with the same dtype, shape and values, keeping its name, dtype and shape; return
    their names, for the engine to record (``refill_initializers`` puts the data back at load).  A backend's
    ``slim_engine`` does this where its engine file carries its branch's ONNX weights."""
    import onnx

    named = []
    for t in model.graph.initializer:
        src = held(t.name)
        if not same_kind(src, t) or not _same_values(src, t):
            continue
        t.CopyFrom(onnx.TensorProto(name=t.name, data_type=t.data_type, dims=t.dims))
        named.append(t.name)
    return named


def refill_initializers(model: "onnx.ModelProto", named: list[str],
                        model_weights: Callable[[str], "onnx.TensorProto | None"] | None) -> None:
    """Put back into ``model`` the data of the initializers ``named`` (``slim_initializers``) from ``model_weights``
    (name -> the bundle's model.onnx initializer, ``Bundle.initializer``, whose hash the bundle's open checked)."""
    from ..errors import ParastreamError

    if model_weights is None:
        raise ParastreamError("the engine keeps its weights in its bundle's model.onnx; load it from its bundle "
                              "(parastream.launcher.load)")
    held = {t.name: t for t in model.graph.initializer}
    for name in named:
        t, src = held.get(name), model_weights(name)
        if t is None or not same_kind(src, t):
            raise ParastreamError(f"the engine's weight {name!r} is not in its bundle's model.onnx as built; "
                                  "rebuild the bundle")
        t.CopyFrom(src)
        t.name = name


def same_kind(a: "onnx.TensorProto | None", b: "onnx.TensorProto") -> bool:
    """Whether model.onnx's initializer ``a`` (None: not there) has ``b``'s dtype and shape: it can stand in for
    it in an engine's ONNX (``slim_initializers``, ``refill_initializers``)."""
    return a is not None and a.data_type == b.data_type and list(a.dims) == list(b.dims)


def _same_values(a: "onnx.TensorProto", b: "onnx.TensorProto") -> bool:
    """Whether two initializers of one dtype and shape hold the same values (their raw bytes compared where both
    keep them so, the common case: no copy)."""
    if a.HasField("raw_data") and b.HasField("raw_data"):
        return a.raw_data == b.raw_data
    from onnx import numpy_helper

    try:
        return np.array_equal(numpy_helper.to_array(a), numpy_helper.to_array(b))
    except Exception:  # noqa: BLE001 - not comparable here (an external or odd encoding): kept in the engine
        return False


def start_workers(options: BuildOptions) -> None:
    """No compile workers."""


def stop_workers() -> None:
    """No compile workers."""


def precompile(batches: list, *, background: bool = False, cancellable: bool = True,
               order: str = "auto", label: str = "") -> dict | None:
    """Nothing compiled ahead (``compiles_for_layout`` False: the build never asks)."""
    return None


def compiling(keys: list[str]) -> int:
    return 0


def hasten(keys: list[str]) -> int:
    return 0


def drop(keys: list[str]) -> int:
    return 0


def cancel_precompile() -> int:
    return 0


def background_summary(since: float) -> dict | None:
    return None


def fp32_pinned(branch: "onnx.ModelProto", patterns: list[str] | tuple[str, ...]) -> list[str]:
    """The names of ``branch``'s nodes that ``--keep-fp32`` patterns cover: each pattern is an op type, a node
    name, or an fnmatch glob over either ("Softmax", "conv_12", "*/attn/*").  A branch holding one is built in
    fp32 (TensorRT: those layers alone)."""
    from fnmatch import fnmatchcase

    if not patterns:
        return []
    return [n.name for n in branch.graph.node
            if any(fnmatchcase(n.op_type, p) or fnmatchcase(n.name, p) for p in patterns)]


def define_op(schema: str, impl: Callable, fake: Callable, tags: tuple = ()):
    """``torch.ops.parastream.<name>`` defined from ``schema`` ("name(args) -> results") with ``impl``, the fake
    (shape) function Inductor traces and ``tags`` (``torch.Tag``: a layout constraint); returns the library, which keeps the op defined while it lives (the caller
    holds it for the process).  ``torch.library.Library`` rather than ``torch.library.custom_op``: the latter wraps
    its implementation in dynamo's "disable" decorator, whose first call imports torch._dynamo (800 modules, about a
    second of a fresh load that otherwise imports none of it); these ops need neither autograd nor dynamo."""
    import torch

    name = schema.split("(", 1)[0]
    lib = torch.library.Library("parastream", "FRAGMENT")
    lib.define(schema, tags=tuple(tags))
    lib.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"parastream::{name}", fake, lib=lib)
    return lib

