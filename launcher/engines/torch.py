"""PyTorch engines: a branch's ONNX becomes a torch module (``onnx_torch.convert``), compiled ahead of time.

* An engine file is a zip (``engine.json``, ``branch.onnx`` and, when compiled, ``aoti.pt2``).
  At build time each branch is exported (``torch.export``) for exactly the tensors the GPU
  launcher will hand it (``launcher.gpu.engine_layouts``: dtypes, channels-last strides, channel
  views of in-place Concats) and compiled by AOTInductor into a package (``aoti.pt2``: a shared
  library with its Triton kernels and weights).  Loading opens that package (no dynamo, no
  Inductor, no Triton compile), so the build verifies, hashes and ships the code that runs.
  Why AOTInductor and not Inductor's cache artifacts (``torch.compiler.save_cache_artifacts``):
  those still re-trace every branch with dynamo at each load; bench/engine_artifacts.py measures
  both (bench/NOTES.md).
* An engine states what it was compiled for (GPU architecture, torch and CUDA versions, or the
  CPU) in ``engine.json`` and refuses, with both named, to load anywhere else.
* A load that asks for another layout than the one compiled (the launcher's ablations:
  ``internal_nhwc=False``, ``concat_in_place=False``; ``FUSE_CONV_RELU`` changed) and engines
  built with ``compile=False`` or ``AOT_COMPILE = False`` convert ``branch.onnx`` again and, on
  a GPU, compile it with TorchInductor at load, as every load did before (``compiled_at_load``).
* Compiled packages are cached by (branch graph, tensor layout, precision, options, what they
  were compiled for) in this process and, with ``cache_dir``, on disk: the search's candidates
  share every branch they have in common, and so do later builds.
* ``enqueue(stream, addresses)`` runs the engine under ``torch.cuda.ExternalStream(stream)`` on
  tensors that wrap the launcher's device pointers; outputs are written into the launcher's
  buffers by ``copy_`` inside the compiled code, so Inductor fuses that store into the last
  kernel that computes each output.
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
* ``run(feeds)`` works on the CPU too (fp32 compute there; AOTInductor compiles for the CPU as
  well), which is how CI tests the converter and the compiled engines.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import platform
import threading
import time
import zipfile
from collections import OrderedDict
from pathlib import Path

import numpy as np
import onnx

from ..errors import BackendUnavailable, ParastreamError
from ..plan import TensorSpec
from .base import BuildOptions

name = "torch"
suffix = ".zip"  # engine.json + branch.onnx (+ aoti.pt2): see the module docstring
gpu = True
#: the GPU launcher may keep 4-d internal boundary tensors channels-last for this backend
supports_internal_nhwc = True
#: engines read and write channel slices of channels-last buffers (the launcher's in-place Concat)
supports_channel_views = True
#: on the GPU, a 2-d Conv read only by a Relu runs as cuDNN's fused conv + bias + ReLU (one kernel instead of
#: a convolution and a Triton bias+ReLU kernel); set False before loading to get the unfused engines
FUSE_CONV_RELU = True
#: engines are AOTInductor packages compiled at build time; False writes the branch's ONNX alone, which every
#: load converts and compiles again (the engines before issue 12; bench/engine_artifacts.py compares the two).
#: Opt-in (PARASTREAM_AOT_COMPILE=1) until it is measured on a GPU: on the H100 with torch 2.11 the first try
#: failed on an Inductor option that torch lacks (fixed since: _known_inductor_configs), the second did not
#: finish 5 branches within 100 s; tested on the CPU only (docs/torch-engines.md).
AOT_COMPILE = os.environ.get("PARASTREAM_AOT_COMPILE", "0") == "1"
ENGINE_FORMAT = 1
#: compiled packages kept in memory by one process (the search's candidates share them), least recently used first out
CACHE_BYTES = 4 << 30


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


# -- what an engine was compiled for -------------------------------------------------------------
def built_for(device: str) -> dict:
    """This machine as an engine compiled here records it: device kind, GPU architecture, torch and CUDA versions."""
    import torch

    out = {"device": device, "torch": torch.__version__}
    if device == "cuda":
        out["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            out.update(arch=f"sm_{major}{minor}", gpu=torch.cuda.get_device_name())
    else:
        out["machine"] = platform.machine()
    return out


#: what must be equal for a compiled engine to load (the GPU's name may differ within one architecture)
_MUST_MATCH = ("device", "arch", "torch", "cuda", "machine")


def _describe(d: dict) -> str:
    if d.get("device") == "cuda":
        gpu = f"{d['gpu']} ({d['arch']})" if d.get("arch") else "no visible GPU"
        return f"{gpu}, torch {d.get('torch')}, CUDA {d.get('cuda')}"
    return f"the CPU ({d.get('machine')}), torch {d.get('torch')}"


def check_built_for(built: dict, device: str) -> None:
    """ParastreamError naming both sides unless an engine compiled for ``built`` can run on this ``device``."""
    found = built_for(device)
    if any(built.get(k) != found.get(k) for k in _MUST_MATCH):
        raise ParastreamError(f"this torch engine was compiled for {_describe(built)}; this machine has {_describe(found)}: "
                              "rebuild the bundle here (parastream build)")


# -- the engine file ------------------------------------------------------------------------------
def pack(meta: dict, branch_onnx: bytes, package: bytes | None) -> bytes:
    """The engine file: a zip of engine.json, branch.onnx and (when compiled) aoti.pt2.

    Deflated at level 1: a package's shared library shrinks about 4x for ~10 ms per MB to inflate at load.
    """
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as z:
        for name, data in (("engine.json", json.dumps(meta, indent=1).encode()), ("branch.onnx", branch_onnx),
                           ("aoti.pt2", package)):
            if data is not None:
                info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))  # the same engine gives the same bytes
                z.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=1)
    return buf.getvalue()


def unpack(data: bytes) -> tuple[dict, bytes, bytes | None]:
    """(engine.json, branch.onnx, aoti.pt2 or None).  Bare ONNX (bundles written before issue 12) reads as uncompiled."""
    if not data.startswith(b"PK"):
        return {"format": 0, "compiled": None}, data, None
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            names = set(z.namelist())
            meta = json.loads(z.read("engine.json"))
            onnx_bytes = z.read("branch.onnx")
            package = z.read("aoti.pt2") if "aoti.pt2" in names else None
    except (zipfile.BadZipFile, KeyError, ValueError) as e:
        raise ParastreamError(f"not a readable torch engine ({e}); rebuild the bundle") from None
    if meta.get("format") != ENGINE_FORMAT:
        raise ParastreamError(f"torch engine format {meta.get('format')!r}, this parastream reads {ENGINE_FORMAT}; rebuild the bundle")
    return meta, onnx_bytes, package


def _branch_model(onnx_bytes: bytes) -> onnx.ModelProto:
    """An engine's branch.onnx; refused if a tensor names an external data file (a bundle's paths stay in it)."""
    from onnx.external_data_helper import _get_all_tensors, uses_external_data

    model = onnx.load_from_string(onnx_bytes)
    if any(uses_external_data(t) for t in _get_all_tensors(model)):
        raise ParastreamError("the engine's branch keeps tensor data in an external file, which a parastream bundle "
                              "never does; the engine is refused")
    return model


def _layout(inputs: list[TensorSpec], outputs: list[TensorSpec], device: str, internal_nhwc, channel_views):
    """(channels-last names, channel views, signature): the memory an engine's tensors live in.

    The signature (name, dtype, shape, channels-last, view of every input and output) is what a
    compiled engine was compiled for; a load that asks for another one compiles at load instead.
    """
    if device != "cuda":  # run(feeds) on the CPU hands contiguous NCHW tensors
        internal_nhwc, channel_views = (), {}
    nhwc = {t.name for t in inputs + outputs if len(t.shape) == 4} & set(internal_nhwc or ())
    views = {n: tuple(v) for n, v in (channel_views or {}).items() if n in nhwc}
    sig = [[t.name, t.dtype, list(t.shape), t.name in nhwc, list(views[t.name]) if t.name in views else None]
           for t in inputs + outputs]
    return nhwc, views, sig


def _tensor(spec: TensorSpec, nhwc: bool, view: tuple[int, int] | None, device: str, fill: bool = True):
    """A tensor with the strides the launcher's buffer for ``spec`` has (random floats when ``fill``)."""
    import torch

    dt = getattr(torch, spec.dtype)
    if view is not None:  # the same strides as the launcher's slice of a wider buffer
        total, c0 = view
        n, c, h, w = spec.shape
        full = torch.randn((n, h, w, total), device=device).to(dt)
        return full[..., c0:c0 + c].permute(0, 3, 1, 2)
    if dt.is_floating_point and fill:
        t = torch.randn(spec.shape, device=device).to(dt)
    else:
        t = torch.zeros(spec.shape, dtype=dt, device=device)
    if nhwc:
        t = t.contiguous(memory_format=torch.channels_last)
    return t


# -- the compiled-branch cache ---------------------------------------------------------------------
_CACHE: OrderedDict[str, bytes] = OrderedDict()
_CACHE_LOCK = threading.Lock()


def cache_key(branch: onnx.ModelProto, signature: list, dtype: str, options: BuildOptions, fuse: bool, built: dict) -> str:
    """sha256 of the branch's graph (its name, which carries the branch's index, left out), the tensor layout,
    the compute dtype, the options that change the code, and what it is compiled for."""
    canon = onnx.ModelProto()
    canon.CopyFrom(branch)
    canon.graph.name = ""
    canon.graph.doc_string = ""
    h = hashlib.sha256(canon.SerializeToString(deterministic=True))
    h.update(json.dumps({"format": ENGINE_FORMAT, "signature": signature, "dtype": dtype, "fuse_conv_relu": fuse,
                         "optimization_level": int(options.optimization_level),
                         "built_for": {k: built.get(k) for k in _MUST_MATCH}}, sort_keys=True).encode())
    return h.hexdigest()


def _cache_file(cache_dir: str | None, key: str) -> Path | None:
    return Path(cache_dir) / "torch-engines" / f"{key}.pt2" if cache_dir else None


def cache_get(key: str, cache_dir: str | None) -> tuple[bytes | None, str]:
    """(package, "memory" | "disk") or (None, "miss")."""
    with _CACHE_LOCK:
        if key in _CACHE:
            _CACHE.move_to_end(key)
            return _CACHE[key], "memory"
    f = _cache_file(cache_dir, key)
    if f is not None and f.is_file():
        data = f.read_bytes()
        _cache_put(key, data, None)
        return data, "disk"
    return None, "miss"


def _cache_put(key: str, data: bytes, cache_dir: str | None) -> None:
    with _CACHE_LOCK:
        _CACHE[key] = data
        _CACHE.move_to_end(key)
        while sum(len(v) for v in _CACHE.values()) > CACHE_BYTES and len(_CACHE) > 1:
            _CACHE.popitem(last=False)
    f = _cache_file(cache_dir, key)
    if f is not None:
        f.parent.mkdir(parents=True, exist_ok=True)
        tmp = f.with_name(f".{f.name}.{threading.get_ident()}.tmp")
        tmp.write_bytes(data)
        tmp.replace(f)  # atomic: a concurrent build never reads half a package


def clear_memory_cache() -> None:
    with _CACHE_LOCK:
        _CACHE.clear()


# -- the module an engine runs ---------------------------------------------------------------------
def _into_outputs(module, in_names: list[str], out_names: list[str], cdt):
    """A module ``f(*inputs, *outputs)`` that runs ``module`` and ``copy_``s its results into the outputs."""
    import torch

    module_inputs = list(module.input_names)
    if sorted(module_inputs) != sorted(in_names):
        raise ParastreamError(f"torch engine inputs {module_inputs} differ from the plan's {in_names}")
    produced = [n for n, _, _ in module.output_specs]

    class IntoOutputs(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner
            self.order = [in_names.index(n) for n in module_inputs]
            self.out_pos = [produced.index(n) for n in out_names]
            self.n_in = len(in_names)

        def forward(self, *args):
            xs = [args[i] for i in self.order]
            xs = [x.to(cdt) if x.is_floating_point() else x for x in xs]
            ys = self.inner(*xs)
            for o, p in zip(args[self.n_in:], self.out_pos):
                o.copy_(ys[p])
            return ()

    return IntoOutputs(module)


def _fuse(device: str, dtype: str, options: BuildOptions) -> bool:
    # the fused cuDNN kernel is measured and tested in fp16 and fp32; bf16 engines keep Inductor's two kernels;
    # a GPU build times the bundle with and without it and records its choice in options.fuse_conv_relu
    return device == "cuda" and FUSE_CONV_RELU and options.fuse_conv_relu and dtype in ("float16", "float32")


def _known_inductor_configs(configs: dict) -> dict:
    """The entries of ``configs`` that this torch's Inductor knows (torch 2.11 has no
    ``aot_inductor.enable_line_tables``, and an unknown key fails the whole compile)."""
    from torch._inductor import config as inductor_config

    known = {}
    for key, value in configs.items():
        *path, leaf = key.split(".")
        obj = inductor_config
        for part in path:
            obj = getattr(obj, part, None)
        if obj is not None and hasattr(obj, leaf):
            known[key] = value
    return known


def compile_package(branch: onnx.ModelProto, inputs: list[TensorSpec], outputs: list[TensorSpec], device: str,
                    dtype: str, nhwc: set[str], views: dict, options: BuildOptions) -> bytes:
    """The branch exported for these tensors (dtypes, shapes, strides) and compiled by AOTInductor: a .pt2 package."""
    import torch
    from torch._inductor import aoti_compile_and_package

    from .onnx_torch import convert, to_fx

    module = convert(branch, dtype, fuse_conv_relu=_fuse(device, dtype, options)).to(device)
    try:
        inner = to_fx(module)  # straight-line code rather than the interpreter loop
    except Exception:  # noqa: BLE001 - the interpreter module exports too
        inner = module
    wrapper = _into_outputs(inner, [t.name for t in inputs], [t.name for t in outputs], getattr(torch, dtype)).eval()
    args = tuple(_tensor(t, t.name in nhwc, views.get(t.name), device) for t in inputs + outputs)
    configs = _known_inductor_configs({"max_autotune": options.optimization_level >= 5,
                                       # the wrapper's C++ runs once per capture, never in a replay: compile it quickly
                                       "aot_inductor.compile_wrapper_opt_level": "O0",
                                       "aot_inductor.enable_line_tables": False})
    with torch.no_grad():
        program = torch.export.export(wrapper, args)
        buf = io.BytesIO()
        aoti_compile_and_package(program, package_path=buf, inductor_configs=configs)
    return buf.getvalue()


def compile_workers() -> int:
    """Processes that compile packages side by side (``PARASTREAM_COMPILE_WORKERS``; default: half the cores, at most 8)."""
    env = os.environ.get("PARASTREAM_COMPILE_WORKERS")
    if env:
        return max(1, int(env))
    return max(1, min(8, (os.cpu_count() or 1) // 2))


_POOL: dict = {}


def _worker_init() -> None:
    import torch._inductor.config as cfg

    cfg.compile_threads = 1  # the workers are the parallelism; no Triton compile pool per worker


def _compile_job(job: tuple) -> bytes:
    branch_bytes, inputs, outputs, device, dtype, nhwc, views, options = job
    return compile_package(onnx.load_from_string(branch_bytes), inputs, outputs, device, dtype, nhwc, views, options)


def _pool(workers: int):
    """A process pool that lives as long as this process (the search's candidates reuse it)."""
    import atexit
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    pool = _POOL.get(workers)
    if pool is None:
        pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"), initializer=_worker_init)
        _POOL[workers] = pool
        atexit.register(pool.shutdown, wait=False, cancel_futures=True)
    return pool


def _load_package(package: bytes, device_index: int):
    """The package's runner (``AOTIModelPackageLoader``), loaded without compiling anything.

    Not ``torch._inductor.aoti_load_package``: before loading, that compares the package's device
    information with this machine's, whose CPU part (``pick_vec_isa``) compiles and runs a probe
    kernel with the C++ compiler in every process with an empty Inductor cache (9.5 s on our CI
    machine, the first load of a fresh Triton instance), and on a mismatch it only warns.
    ``check_built_for`` has refused a mismatch already.
    """
    import tempfile

    import torch

    loader = getattr(getattr(torch._C, "_aoti", None), "AOTIModelPackageLoader", None)
    with tempfile.NamedTemporaryFile(suffix=".pt2") as f:  # the loader reads a file and extracts it
        f.write(package)
        f.flush()
        if loader is None:  # another torch: the public loader
            from torch._inductor import aoti_load_package

            return aoti_load_package(f.name, device_index=device_index).loader
        return loader(f.name, "model", False, 1, device_index)


class Builder:
    """Converts each branch (failing on the first unsupported node) and compiles it for the launcher's layout.

    ``build(branch, name, layout=None)``: ``layout`` is what the launcher will give the engine
    (``EngineLayouts.branch``: input and output specs, channels-last set, channel views); without
    it, or with ``compile=False`` or ``AOT_COMPILE = False``, the engine holds the branch's ONNX alone.
    ``build_all(items)`` does the same for many branches and compiles the packages that no cache
    holds in ``compile_workers()`` processes side by side.
    """

    def __init__(self, options: BuildOptions):
        if options.precision not in ("fp32", "tf32", "fp16", "bf16"):
            raise ParastreamError(f"--precision {options.precision}: the torch backend builds fp32, tf32, fp16 or bf16 engines")
        self.options = options
        self._report: dict[str, dict] = {}

    def build(self, branch: onnx.ModelProto, name: str, layout: dict | None = None) -> bytes:
        return self.build_all([(branch, name, layout)])[0]

    def build_all(self, items: list[tuple[onnx.ModelProto, str, dict | None]]) -> list[bytes]:
        from .onnx_torch import convert

        device = self.options.device
        dtype = compute_dtype(self.options.precision, device)
        fuse = _fuse(device, dtype, self.options)
        built = built_for(device)
        out: list = []
        todo: dict[str, tuple] = {}  # key -> compile job (one per distinct branch)
        for branch, name, layout in items:
            t0 = time.perf_counter()
            try:
                module = convert(branch, "float32")
            except ParastreamError as e:
                raise type(e)(f"{name}: {e}") from None  # the batch names the branch that failed
            ops: dict[str, int] = {}
            for n in branch.graph.node:
                ops[n.op_type] = ops.get(n.op_type, 0) + 1
            rep = {"nodes": len(branch.graph.node), "torch_steps": len(module._steps), "ops": ops,
                   "compile": bool(self.options.compile), "precision": self.options.precision,
                   "convert_s": round(time.perf_counter() - t0, 4), "compiled": None}
            self._report[name] = rep
            onnx_bytes = branch.SerializeToString()
            if layout is None or not self.options.compile or not AOT_COMPILE:
                out.append(pack({"format": ENGINE_FORMAT, "compiled": None}, onnx_bytes, None))
                continue
            inputs, outputs = list(layout["inputs"]), list(layout["outputs"])
            nhwc, views, sig = _layout(inputs, outputs, device, layout.get("internal_nhwc"), layout.get("channel_views"))
            key = cache_key(branch, sig, dtype, self.options, fuse, built)
            package, where = cache_get(key, self.options.cache_dir)
            if package is None and key not in todo:
                todo[key] = (onnx_bytes, inputs, outputs, device, dtype, nhwc, views, self.options)
            rep.update(compiled="aotinductor", cache=where, key=key[:16])  # miss: compiled by this build
            meta = {"format": ENGINE_FORMAT, "compiled": "aotinductor", "built_for": built, "dtype": dtype,
                    "fuse_conv_relu": fuse, "optimization_level": int(self.options.optimization_level), "signature": sig,
                    "key": key}
            out.append((key, name, meta, onnx_bytes, package))

        t0 = time.perf_counter()
        compiled, failed = self._compile(todo)
        for i, item in enumerate(out):
            if isinstance(item, bytes):
                continue
            key, name, meta, onnx_bytes, package = item
            if key in failed:  # AOTInductor could not compile it: the ONNX ships, compiled at every load (reported)
                self._report[name].update(compiled=None, aot_error=failed[key])
                out[i] = pack({"format": ENGINE_FORMAT, "compiled": None, "aot_error": failed[key]}, onnx_bytes, None)
                continue
            package = package or compiled[key]  # a hit, or compiled by this batch (once per distinct branch)
            self._report[name]["package_bytes"] = len(package)
            out[i] = pack(meta, onnx_bytes, package)
        for item in items:  # the compile time is the batch's (its packages compile side by side)
            if self._report[item[1]].get("cache") == "miss":
                self._report[item[1]]["compile_batch_s"] = round(time.perf_counter() - t0, 3)
        return out

    def _compile(self, todo: dict[str, tuple]) -> tuple[dict[str, bytes], dict[str, str]]:
        """Compile the jobs (in worker processes when there are several and workers to spare); cache each package.

        Returns (key -> package, key -> why it failed): a branch AOTInductor cannot compile does not fail
        the build, its engine stays ONNX compiled at load, and the report and verification say so."""
        if not todo:
            return {}, {}
        keys = list(todo)
        workers = min(compile_workers(), len(todo))
        if workers > 1:
            pool = _pool(compile_workers())
            futures = {k: pool.submit(_compile_job, todo[k]) for k in keys}
            results = {}
            for k, f in futures.items():
                try:
                    results[k] = f.result()
                except Exception as e:  # noqa: BLE001 - reported per branch
                    results[k] = e
        else:
            results = {}
            for k in keys:
                try:
                    results[k] = _compile_job(todo[k])
                except Exception as e:  # noqa: BLE001 - reported per branch
                    results[k] = e
        done, failed = {}, {}
        for k, r in results.items():
            if isinstance(r, BaseException):
                text = str(r).strip()
                failed[k] = f"{type(r).__name__}: {text.splitlines()[0] if text else ''}"[:500]
            else:
                done[k] = r
                _cache_put(k, r, self.options.cache_dir)
        return done, failed

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
    """One branch: the compiled package when it was compiled for this layout, else the ONNX compiled now."""

    def __init__(self, data: bytes, inputs: list[TensorSpec], outputs: list[TensorSpec], device: str,
                 options: BuildOptions, internal_nhwc: set[str] | None = None,
                 channel_views: dict[str, tuple[int, int]] | None = None):
        import torch

        self.inputs = inputs
        self.outputs = outputs
        self.device = device
        self.options = options
        self.nhwc, self.channel_views, sig = _layout(inputs, outputs, device, internal_nhwc, channel_views)
        self.dtype = compute_dtype(options.precision, device)
        self._tdtype = getattr(torch, self.dtype)
        t0 = time.perf_counter()
        meta, onnx_bytes, package = unpack(data)
        self.meta = meta
        if package is not None:
            check_built_for(meta.get("built_for", {}), device)
        fuse = _fuse(device, self.dtype, options)
        self.compiled_at_load = not (package is not None and meta.get("signature") == sig and meta.get("dtype") == self.dtype
                                     and meta.get("fuse_conv_relu") == fuse)
        self._runner = None
        self.module = None
        if not self.compiled_at_load:
            self._runner = _load_package(package, torch.cuda.current_device() if device == "cuda" else -1)
            self._fn = self._run_package
        else:
            from .onnx_torch import convert, to_device_shared

            self.module = to_device_shared(convert(_branch_model(onnx_bytes), self.dtype, fuse_conv_relu=fuse), device)
            self._fn = self._make_fn()
        self._streams: dict[int, object] = {}
        self._views: dict[tuple, list] = {}
        self.compile_s = 0.0
        if device == "cuda":
            self._warm()
        self.load_s = time.perf_counter() - t0

    def _run_package(self, *args) -> None:
        self._runner.boxed_run(list(args))  # outputs are written in place; boxed_run takes (and empties) its list

    def _make_fn(self):
        import torch

        from .onnx_torch import to_fx

        module = self.module
        if self.device == "cuda" and self.options.compile:
            try:
                module = to_fx(self.module)  # dynamo then traces straight-line code, not the interpreter loop
            except Exception:  # noqa: BLE001 - the interpreter module compiles too, only slower
                module = self.module
        run_into = _into_outputs(module, [t.name for t in self.inputs], [t.name for t in self.outputs], self._tdtype)
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

    def _args(self, fill: bool = True) -> list:
        return [_tensor(t, t.name in self.nhwc, self.channel_views.get(t.name), self.device, fill=fill)
                for t in self.inputs + self.outputs]

    def _warm(self) -> None:
        """Compile (JIT engines) and load kernels now, on tensors with the launcher's shapes, dtypes and strides."""
        import torch

        t0 = time.perf_counter()
        args = self._args()
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

        args = self._args(fill=False)
        for t, x in zip(self.inputs, args):
            x.copy_(torch.from_numpy(np.ascontiguousarray(feeds[t.name])))
        outs = args[len(self.inputs):]
        with torch.no_grad():
            if self._runner is not None or self.device == "cuda":
                self._fn(*args)
            else:  # CPU engines converted at load run eagerly, in fp32
                for o, y in zip(outs, self._eager(args[:len(self.inputs)])):
                    o.copy_(y)
        if self.device == "cuda":
            torch.cuda.synchronize()
        return {t.name: (o.float() if t.dtype == "bfloat16" else o).detach().cpu().numpy() for t, o in zip(self.outputs, outs)}

    def _eager(self, xs):
        order = [[t.name for t in self.inputs].index(n) for n in self.module.input_names]
        ys = self.module(*[xs[i].to(self._tdtype) if xs[i].is_floating_point() else xs[i] for i in order])
        produced = [n for n, _, _ in self.module.output_specs]
        return [ys[produced.index(t.name)] for t in self.outputs]

    def close(self) -> None:
        self._views.clear()
        self._runner = None


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
