"""PyTorch engines: a branch's ONNX becomes a torch module (``onnx_torch.convert``), compiled by TorchInductor.

* The engine file is the branch's ONNX itself; building checks that every node
  converts (an unsupported op fails the build, naming the node).  Loading converts
  again, moves the module to the device in the bundle's precision and, on a GPU,
  compiles it with TorchInductor *without* Inductor's own CUDA graphs (the launcher
  captures the whole plan into one graph) and runs it once, so compilation and
  autotuning happen at load and never inside a capture.
* ``enqueue(stream, addresses)`` runs the compiled function under
  ``torch.cuda.ExternalStream(stream)`` on tensors that wrap the launcher's device
  pointers; outputs are written into the launcher's buffers by ``copy_`` inside the
  compiled function, so Inductor fuses that store into the last kernel that computes
  each output.
* Internal boundary tensors of 4 dimensions may be stored channels-last (NHWC) in
  the launcher's buffers (``internal_nhwc``): convolutions then read and write the
  layout cuDNN prefers, and no branch pays a transpose at its edges.
* A boundary tensor may also be a *channel view*: channels ``[c0, c0 + C)`` of a
  larger channels-last buffer (``channel_views``, name -> (total channels, c0)).
  The launcher uses that to elide a Concat branch: its producers write straight into
  their slices of its output, so the join costs no kernel.
* On the GPU a 2-d Conv whose only reader is a Relu becomes ``torch.cudnn_convolution_relu``
  (cuDNN's fused conv + bias + ReLU, weights channels-last): Inductor would otherwise run the
  convolution and then a separate Triton kernel for bias and ReLU (``FUSE_CONV_RELU``).
* ``run(feeds)`` works on the CPU too (fp32 compute there), which is how CI tests the
  converter.
"""

from __future__ import annotations

import contextlib
import time

import numpy as np
import onnx

from ..errors import BackendUnavailable, ParastreamError
from ..plan import TensorSpec
from .base import BuildOptions

name = "torch"
suffix = ".onnx"
gpu = True
#: the GPU launcher may keep 4-d internal boundary tensors channels-last for this backend
supports_internal_nhwc = True
#: engines read and write channel slices of channels-last buffers (the launcher's in-place Concat)
supports_channel_views = True
#: on the GPU, a 2-d Conv read only by a Relu runs as cuDNN's fused conv + bias + ReLU (one kernel instead of
#: a convolution and a Triton bias+ReLU kernel); set False before loading to get the unfused engines
FUSE_CONV_RELU = True


def available() -> str | None:
    try:
        import torch
    except ImportError:
        return "PyTorch is not installed: pip install torch cuda-python"
    if not torch.cuda.is_available():
        return "the torch backend runs engines on a CUDA GPU and torch sees none (use --backend onnxruntime on the CPU)"
    return None


def describe_device() -> str:
    import torch

    return f"cuda: {torch.cuda.get_device_name(0)} (torch {torch.__version__})"


def compute_dtype(precision: str, device: str) -> str:
    if device != "cuda":
        return "float32"  # CPU kernels for half precision are slow or missing; the CPU path checks the converter
    return {"fp16": "float16", "bf16": "bfloat16"}.get(precision, "float32")


_POOLS: list = []


def memory_scope():
    """A context that sends torch's allocations (engine intermediates, workspaces) to a private pool.

    The launcher holds it around warm-up and capture: the blocks a captured graph
    uses then belong to this pool, which nothing outside the launcher allocates from,
    so no other code can be handed (and overwrite) memory that the graph reads or writes.
    """
    import torch

    pool = torch.cuda.MemPool()
    # Never let a pool die: library workspaces (cuBLAS keeps one per stream for the process's life)
    # may have been carved from it, and freeing a pool with live blocks aborts the process.
    _POOLS.append(pool)

    @contextlib.contextmanager
    def scope():
        with torch.cuda.use_mem_pool(pool):
            yield

    scope.pool = pool
    return scope


class Builder:
    """Converts each branch (failing on the first unsupported node) and keeps its ONNX as the engine."""

    def __init__(self, options: BuildOptions):
        if options.precision not in ("fp32", "tf32", "fp16", "bf16"):
            raise ParastreamError(f"--precision {options.precision}: the torch backend builds fp32, tf32, fp16 or bf16 engines")
        self.options = options
        self._report: dict[str, dict] = {}

    def build(self, branch: onnx.ModelProto, name: str) -> bytes:
        from .onnx_torch import convert

        t0 = time.perf_counter()
        module = convert(branch, "float32")
        ops: dict[str, int] = {}
        for n in branch.graph.node:
            ops[n.op_type] = ops.get(n.op_type, 0) + 1
        self._report[name] = {"nodes": len(branch.graph.node), "torch_steps": len(module._steps),
                              "ops": ops, "compile": bool(self.options.compile), "precision": self.options.precision,
                              "convert_s": round(time.perf_counter() - t0, 4)}
        return branch.SerializeToString()

    def report(self) -> dict:
        return self._report

    def close(self) -> None:
        pass


def _wrap(ptr: int, spec: TensorSpec, nhwc: bool, view: tuple[int, int] | None = None):
    """A torch tensor over launcher memory at ``ptr`` (no copy), NCHW-shaped, channels-last strided if ``nhwc``.

    With ``view = (total, c0)``, ``ptr`` is a channels-last buffer of ``total`` channels and the
    tensor is its channels ``[c0, c0 + C)``.
    """
    import torch

    from ..cuda import DeviceArray

    if nhwc:
        n, c, h, w = spec.shape
        total, c0 = view if view is not None else (c, 0)
        t = torch.as_tensor(DeviceArray(ptr, (n, h, w, total), spec.dtype), device="cuda")
        return t[..., c0:c0 + c].permute(0, 3, 1, 2)
    return DeviceArray(ptr, spec.shape, spec.dtype).torch()


class TorchEngine:
    def __init__(self, data: bytes, inputs: list[TensorSpec], outputs: list[TensorSpec], device: str,
                 options: BuildOptions, internal_nhwc: set[str] | None = None,
                 channel_views: dict[str, tuple[int, int]] | None = None):
        import torch

        from .onnx_torch import convert

        self.inputs = inputs
        self.outputs = outputs
        self.device = device
        self.options = options
        self.nhwc = {t.name for t in inputs + outputs if len(t.shape) == 4} & set(internal_nhwc or ())
        self.channel_views = {n: tuple(v) for n, v in (channel_views or {}).items() if n in self.nhwc}
        self.dtype = compute_dtype(options.precision, device)
        model = onnx.load_from_string(data)
        t0 = time.perf_counter()
        # the fused cuDNN kernel is measured and tested in fp16 and fp32; bf16 engines keep Inductor's two kernels
        fuse = (device == "cuda" and FUSE_CONV_RELU and options.fuse_conv_relu
                and self.dtype in ("float16", "float32"))
        self.module = convert(model, self.dtype, fuse_conv_relu=fuse).to(device)
        self._tdtype = getattr(torch, self.dtype)
        self._in_names = [t.name for t in inputs]
        module_inputs = list(self.module.input_names)
        if sorted(module_inputs) != sorted(self._in_names):
            raise ParastreamError(f"torch engine inputs {module_inputs} differ from the plan's {self._in_names}")
        self._order = [self._in_names.index(n) for n in module_inputs]
        out_names = [n for n, _, _ in self.module.output_specs]
        self._out_pos = [out_names.index(t.name) for t in outputs]
        self._fn = self._make_fn()
        self._streams: dict[int, object] = {}
        self._views: dict[tuple, list] = {}
        self.compile_s = 0.0
        if device == "cuda":
            self._warm()
        self.load_s = time.perf_counter() - t0

    def _make_fn(self):
        import torch

        from .onnx_torch import to_fx

        module = self.module
        if self.device == "cuda" and self.options.compile:
            try:
                module = to_fx(self.module)  # dynamo then traces straight-line code, not the interpreter loop
            except Exception:  # noqa: BLE001 - the interpreter module compiles too, only slower
                module = self.module
        order, out_pos, cdt = self._order, self._out_pos, self._tdtype
        n_in = len(self._in_names)

        def run_into(*args):
            xs = [args[i] for i in order]
            xs = [x.to(cdt) if x.is_floating_point() else x for x in xs]
            ys = module(*xs)
            for o, p in zip(args[n_in:], out_pos):
                o.copy_(ys[p])

        if self.device != "cuda" or not self.options.compile:
            return run_into
        # every torch.compile'd function shares dynamo's wrapper code object, and dynamo's recompile
        # limit counts per code object: one model has tens of engines, so lift the limit
        cfg = torch._dynamo.config
        for key in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
            if hasattr(cfg, key):
                setattr(cfg, key, max(getattr(cfg, key), 1 << 16))
        mode = "max-autotune-no-cudagraphs" if self.options.optimization_level >= 5 else None
        return torch.compile(run_into, fullgraph=True, dynamic=False, mode=mode)

    def _scratch(self, spec: TensorSpec):
        import torch

        dt = getattr(torch, spec.dtype)
        if spec.name in self.channel_views:  # the same strides as the launcher's slice of a wider buffer
            total, c0 = self.channel_views[spec.name]
            n, c, h, w = spec.shape
            full = torch.randn((n, h, w, total), device="cuda").to(dt)
            return full[..., c0:c0 + c].permute(0, 3, 1, 2)
        if dt.is_floating_point:
            t = torch.randn(spec.shape, device="cuda").to(dt)
        elif dt == torch.bool:
            t = torch.zeros(spec.shape, dtype=dt, device="cuda")
        else:
            t = torch.zeros(spec.shape, dtype=dt, device="cuda")
        if spec.name in self.nhwc:
            t = t.contiguous(memory_format=torch.channels_last)
        return t

    def _warm(self) -> None:
        """Compile (and autotune) now, on scratch tensors with the launcher's shapes, dtypes and strides."""
        import torch

        t0 = time.perf_counter()
        args = [self._scratch(t) for t in self.inputs] + [self._scratch(t) for t in self.outputs]
        with torch.no_grad():
            self._fn(*args)
            self._fn(*args)
        torch.cuda.synchronize()
        self.compile_s = time.perf_counter() - t0

    # -- GPU ---------------------------------------------------------------
    def enqueue(self, stream_handle: int, addresses: dict[str, int]) -> None:
        import torch

        key = tuple(addresses[t.name] for t in self.inputs) + tuple(addresses[t.name] for t in self.outputs)
        views = self._views.get(key)
        if views is None:
            views = [_wrap(addresses[t.name], t, t.name in self.nhwc, self.channel_views.get(t.name))
                     for t in self.inputs + self.outputs]
            self._views[key] = views
        stream = self._streams.get(stream_handle)
        if stream is None:
            stream = self._streams[stream_handle] = torch.cuda.ExternalStream(stream_handle)
        with torch.no_grad(), torch.cuda.stream(stream):
            self._fn(*views)

    # -- CPU (and GPU without a launcher) ------------------------------------
    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        import torch

        xs = [torch.from_numpy(np.ascontiguousarray(feeds[t.name])).to(self.device) for t in self.inputs]
        xs = [xs[i] for i in self._order]
        xs = [x.to(self._tdtype) if x.is_floating_point() else x for x in xs]
        with torch.no_grad():
            ys = self.module(*xs)
        out = {}
        for t, p in zip(self.outputs, self._out_pos):
            out[t.name] = ys[p].detach().to("cpu").numpy().astype(np.dtype(t.dtype), copy=False) if t.dtype != "bfloat16" \
                else ys[p].float().cpu().numpy()
        return out

    def close(self) -> None:
        self._views.clear()


def load(data: bytes, inputs: list[TensorSpec], outputs: list[TensorSpec], device: str = "cpu",
         options: BuildOptions | None = None, internal_nhwc: set[str] | None = None,
         channel_views: dict[str, tuple[int, int]] | None = None) -> TorchEngine:
    try:
        import torch
    except ImportError:
        raise BackendUnavailable("PyTorch is not installed: pip install torch cuda-python") from None
    options = options or BuildOptions()
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = options.precision == "tf32"
        torch.backends.cudnn.allow_tf32 = options.precision == "tf32"
    return TorchEngine(data, inputs, outputs, device, options, internal_nhwc, channel_views)
