"""The engine-backend contract.

An engine backend turns one branch (a self-contained ONNX model) into an engine
and loads it again for the launcher:

* ``available()`` says why the backend cannot run here (``None`` when it can).
* ``Builder(options).build(branch_model, name) -> bytes`` serialises one engine;
  a builder lives for one ``parastream build`` so it can share state between
  branches (TensorRT's timing cache); ``report()`` returns per-branch figures for
  report.json and ``close()`` persists caches.
* ``load(data, specs, device) -> BranchEngine``.

A ``BranchEngine`` names its inputs and outputs and has ``run(feeds)`` on the CPU
and, on a GPU, ``enqueue(stream_handle, addresses)`` with the shape of TensorRT's
``execute_async_v3``: every input and output is a device pointer owned by the
launcher, and the work is queued on the given CUDA stream.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

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
    # onnxruntime: build() loads each branch into a session to check it; off where the caller loads it next
    # anyway (the CPU build's scratch bundles, loaded to be timed: the check cost a second copy of the weights)
    check: bool = True
    # --keep-fp32: op types, node names or globs whose branches (TensorRT: layers) compute in fp32 (``fp32_pinned``)
    keep_fp32: list[str] = field(default_factory=list)


@runtime_checkable
class BranchEngine(Protocol):
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...


class Builder(Protocol):
    def build(self, branch: onnx.ModelProto, name: str) -> bytes: ...

    def report(self) -> dict: ...

    def close(self) -> None: ...


class Backend(Protocol):
    """What ``launcher.engines.get_backend(name)`` returns (a module or an object)."""

    name: str
    suffix: str  # engine file suffix: ".onnx", ".plan", ...
    gpu: bool

    def available(self) -> str | None: ...

    def Builder(self, options: BuildOptions) -> Builder: ...

    def load(self, data: bytes, inputs: list[TensorSpec], outputs: list[TensorSpec], device: str = "cpu", options: BuildOptions | None = None) -> BranchEngine: ...


def fp32_pinned(branch: "onnx.ModelProto", patterns: list[str] | tuple[str, ...]) -> list[str]:
    """The names of ``branch``'s nodes that ``--keep-fp32`` patterns cover: each pattern is an op type, a node
    name, or an fnmatch glob over either ("Softmax", "conv_12", "*/attn/*").  A branch holding one is built in
    fp32 (TensorRT: those layers alone)."""
    from fnmatch import fnmatchcase

    if not patterns:
        return []
    return [n.name for n in branch.graph.node
            if any(fnmatchcase(n.op_type, p) or fnmatchcase(n.name, p) for p in patterns)]
