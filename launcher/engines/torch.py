"""PyTorch engines: a branch's ONNX becomes a torch module (``onnx_torch.convert``), compiled ahead of time.

* An engine file is a zip: ``engine.json``, ``branch.onnx`` and, when compiled, the compiled code, one of
  (``BuildOptions.torch_artifact``, ``--torch-artifact``; docs/torch-engines.md compares them):
  - ``kernels.zip`` (a GPU engine's default, ``BuildOptions.inductor_format`` "kernels"): Inductor's wrapper for the branch
    and its Triton kernels' cubins, loaded and run without importing Inductor or Triton
    (``inductor_kernels``; taken from the module compiled below and checked bit for bit against it at build),
    with ``weights.bin`` as below.
  - ``inductor.bin``: Inductor's precompiled artifact (``inductor_format`` "bundled", a CPU engine's and the
    fallback of a GPU branch "kernels" cannot hold: the compiled function itself, ``standalone_compile(aot=True)``).
    At build the engine's module is traced with ``make_fx``
    (its weights as graph inputs) for exactly the tensors the GPU launcher will hand it
    (``launcher.gpu.engine_layouts``: dtypes, channels-last strides, channel views of in-place Concats) and
    compiled by ``torch._inductor.standalone_compile`` with the options a load-time torch.compile uses (a Python
    wrapper; no C++ wrapper to compile).  Loading (``CompiledArtifact.load``) runs no dynamo, no AOTAutograd
    trace and no Inductor codegen; on the GPU the Triton kernels come from the artifact (on the CPU its C++
    kernels are compiled from the sources it holds).  Its weights ship beside it in ``weights.bin``: the
    tensors the artifact was compiled with (compute dtype, strides), each one's storage bytes, copied to the
    device at load without converting ``branch.onnx`` (which stays for the loads below).
  - ``aoti.pt2``: an AOTInductor package (``torch.export`` + ``aoti_compile_and_package``: a shared library
    with its kernels and weights, its C++ wrapper compiled with g++ at build), opened without compiling.
  - neither (``jit``): the branch's ONNX alone, converted and compiled by torch.compile at every load.
  Either compiled artifact is what the build verifies, hashes and ships.  Why not Inductor's cache artifacts
  (``torch.compiler.save_cache_artifacts``): those still re-trace every branch with dynamo at each load;
  bench/engine_artifacts.py measures all of them (bench/NOTES.md).
* An engine states what it was compiled for (GPU architecture, torch and CUDA versions, or the
  CPU) in ``engine.json`` and refuses, with both named, to load anywhere else.
* A load that asks for another layout than the one compiled (the launcher's ablations:
  ``internal_nhwc=False``, ``concat_in_place=False``; ``FUSE_CONV_RELU`` changed) and engines
  built with ``compile=False`` or ``torch_artifact = "jit"`` convert ``branch.onnx`` again and, on
  a GPU, compile it with TorchInductor at load, as every load did before (``compiled_at_load``).
* Compiled artifacts are cached by (branch graph, tensor layout, precision, options, what they
  were compiled for, which artifact) in this process and, with ``cache_dir``, on disk: the search's candidates
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
  convolution and then a separate Triton kernel for bias and ReLU (``FUSE_CONV_RELU``).  The same option runs
  the epilogues no torch op fuses as one cuDNN plan each (``cudnn_plans``): a Conv whose output only its SiLU
  (Sigmoid and Mul) reads (conv + bias + SWISH_FWD), and a Conv + residual Add that no Relu follows.
* ``run(feeds)`` works on the CPU too (fp32 compute there; Inductor and AOTInductor compile for the CPU as
  well), which is how CI tests the converter and the compiled engines.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import itertools
import json
import os
import platform
import threading
import time
import warnings
import weakref
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np

from parastream.core.files import write_atomic
from parastream.core.lru import SizedLRU, lru_put
from parastream.core.protos import copy_fields as _copy_fields

from .. import cuda
from ..errors import BackendUnavailable, ParastreamError
from ..plan import TensorSpec
from .base import LOWERED_CONV_KERNELS, BuilderBase, BuildOptions, check_model, conv_kernels_used, fp32_pinned  # noqa: F401 - check_model: the builder's conversion checks
from .base import refill_initializers, slim_initializers

if TYPE_CHECKING:
    import onnx

name = "torch"
suffix = ".zip"  # engine.json + branch.onnx (+ kernels.zip or inductor.bin, and weights.bin; or aoti.pt2): module docstring
gpu = True
#: the GPU launcher may keep 4-d internal boundary tensors channels-last for this backend
supports_internal_nhwc = True
#: engines read and write channel slices of channels-last buffers (the launcher's in-place Concat)
supports_channel_views = True
# capabilities (base.Backend): engines compiled for the launcher's layout and fusion (``Builder.build(layout=)``),
# side by side in compile workers that also compile ahead in the background (``precompile``); a GPU engine's
# first call can wait until after the load (``load(warm=False)``, ``TorchEngine.warm``)
compiles_for_layout = True
builds_side_by_side = True
background_compiles = True
fuses_conv_relu = True
lowers_convolutions = True  # BuildOptions.conv_kernels: depthwise convolutions as Inductor kernels
warms_after_load = True
#: branches whose traced code is equal compile once (``_code_id``): a one-stream plan is cut into one engine per
#: repeated block (``core.blocks``) rather than compiled as one engine, whose every block is lowered again
compiles_repeats_once = True
#: --opt-level 4 and 5 tune Inductor's kernels on the device as they compile (coordinate descent; max-autotune):
#: every compile takes several times as long, so a build compiles its search and rounds at level 3 and races the
#: level asked for on the plan the rounds chose (pipeline.measure.kernel_tuning_round)
tunes_kernels_from = 4
#: on the GPU, a 2-d Conv read only by a Relu runs as cuDNN's fused conv + bias + ReLU (one kernel instead of
#: a convolution and a Triton bias+ReLU kernel); set False before loading to get the unfused engines
FUSE_CONV_RELU = True
#: what a torch engine ships (``BuildOptions.torch_artifact``; docs/torch-engines.md compares them):
#: "inductor"  Inductor's precompiled artifact (``torch._inductor.standalone_compile``), compiled at build like a
#:             load-time torch.compile (Python wrapper, no C++ wrapper), loaded with ``CompiledArtifact.load``;
#: "aoti"      an AOTInductor package (C++ wrapper compiled with g++ at build; on the H100 a 5-branch build did
#:             not finish its compiles within 100 s);
#: "jit"       the branch's ONNX alone, converted and compiled by torch.compile at every load (the format before compiled engines shipped).
#: The default is "inductor": on the H100 (bench/engine_artifacts.py, Inception-v4, 82 engines, fresh processes) it
#: loaded in a third of jit's time with the same latency, and its GPU tests pass (docs/torch-engines.md).
DEFAULT_ARTIFACT = "inductor"
#: how an "inductor" artifact is saved (``BuildOptions.inductor_format``, carried to the compile workers by the options; bench/engine_artifacts.py
#: compares them): "kernels" (on the GPU: Inductor's wrapper and its Triton kernels' cubins, loaded without
#: importing Inductor or Triton: ``inductor_kernels``; on the CPU, and for a branch whose code it cannot hold, it
#: falls back to "bundled"), "bundled" (``standalone_compile(aot=True)``: the compiled function itself, loaded
#: with Inductor but without its caches) or "cache" (Inductor's cache entries, which a load writes into Inductor's
#: cache folders and looks up).  "kernels" is the default: a fresh process's load of a 100-branch bundle no
#: longer imports Inductor (~3 s on the H100, docs/torch-engines.md).  Before it "bundled" was: on the H100
#: (Inception-v4, 82 engines, H100) its compile batch took 13.9 s against 15.0-17.1 s for "cache", its
#: artifacts 23 MB against 34 MB, and a fresh process loaded them in the same time with the same latency.
INDUCTOR_FORMATS = ("kernels", "bundled", "cache")


def inductor_format(options: BuildOptions) -> str:
    """How ``options`` save an "inductor" artifact (one of INDUCTOR_FORMATS)."""
    fmt = options.inductor_format
    if fmt not in INDUCTOR_FORMATS:
        raise ParastreamError(f"--inductor-format {fmt}: give one of {', '.join(INDUCTOR_FORMATS)}")
    return fmt


ARTIFACTS = ("inductor", "aoti", "jit")
#: engine.json's ``compiled`` and the zip member holding the compiled code, per artifact
_COMPILED = {"aoti": "aotinductor", "inductor": "inductor"}
_MEMBER = {"aotinductor": "aoti.pt2", "inductor": "inductor.bin", "kernels": "kernels.zip"}
#: the zip member holding an inductor engine's weights (``_weights_blob``)
WEIGHTS_MEMBER = "weights.bin"
#: 2: inductor engines carry weights.bin (1 converted branch.onnx at every load for them); 3: "kernels" engines
ENGINE_FORMAT = 3
#: engine formats this parastream loads (2 differs only in having no "kernels" engines)
READABLE_FORMATS = (2, 3)
#: compiled packages kept in memory by one process (the search's candidates share them), least recently used first out
CACHE_BYTES = 4 << 30


def available() -> str | None:
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return "PyTorch is not installed: pip install torch cuda-python"
    from ..cuda import cuda_device_count

    # Asked of cuda-python first (~0.1 s), which the GPU launcher needs too: a CPU machine's build with the backend
    # left to ``auto`` then does not import torch (~2 s) only to learn that torch sees no GPU either.
    if cuda_device_count() == 0:
        return "the torch backend runs engines on a CUDA GPU and cuda-python sees none (or is not installed: " \
               "pip install cuda-python; use --backend onnxruntime on the CPU)"
    import torch

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


def own_workspaces() -> None:
    """Before a launcher's warm-up launch and capture, in its memory scope: the library workspaces its graph
    will use come from its own pool.

    torch keeps one cuBLAS and one cuBLASLt workspace per handle and stream for the process's life, allocated at
    the first matrix product on that stream: for a launcher's streams, in its engines' warm-ups, which run
    outside its pool.  A captured graph holds their addresses.  ``torch.compile(mode="reduce-overhead")`` frees
    every workspace of the process before and after each CUDA Graph it records (its cudagraph trees'
    ``clear_cublas_manager``), so workspaces in torch's shared pool went back to it while the launcher's graph
    still used them.  NASNet-A Large's bundle loaded and then timed beside torch.compile of the model in one
    process failed with an illegal address or instruction (H100, torch 2.11): its classifier's warm-up had
    left 1 MiB and 32 MiB live on a launcher stream in the shared pool, gone after torch.compile ran
    (bench/replay_isolation.py ``snapshot``; bench/figures/replay_isolation_h100_nasnetalarge_cublas_workspaces.json).
    So the launcher does what cudagraph trees do: it frees the workspaces in its memory scope before its
    warm-up launch, which allocates them again from its pool; freed again later by anyone, they go back to that
    pool, which only the launcher's own captures allocate from (replays that never overlap)."""
    import torch

    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None and torch.cuda.is_available():
        clear()


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
def pack(meta: dict, branch_onnx: bytes, package: bytes | None, weights: bytes | None = None) -> bytes:
    """The engine file: a zip of engine.json, branch.onnx and (when compiled) the compiled code, named after
    ``meta["compiled"]`` (inductor.bin or aoti.pt2), and an inductor artifact's weights (weights.bin).

    The compiled code is deflated at level 1 (a package's shared library shrinks about 4x for ~10 ms per MB to
    inflate at load); branch.onnx and weights.bin are stored: weights do not shrink (random or trained floats,
    ~7%) and inflating them was 1.5 s of a 100-branch load on the H100 (Inception-v4, 170 MB of fp32 weights).
    """
    buf = io.BytesIO()
    member = _MEMBER.get(meta.get("compiled")) if package is not None else None
    if package is not None and member is None:
        raise ValueError(f"a compiled torch engine needs compiled in {sorted(_MEMBER)}, not {meta.get('compiled')!r}")
    if package is not None:  # a load finds an artifact it loaded already by this, without inflating it (_load_inductor)
        meta = dict(meta, artifact_sha256=hashlib.sha256(package).hexdigest())
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as z:
        for name, data in (("engine.json", json.dumps(meta, indent=1).encode()), ("branch.onnx", branch_onnx),
                           (member, package), (WEIGHTS_MEMBER, weights)):
            if data is not None:
                info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))  # the same engine gives the same bytes
                if name in ("branch.onnx", WEIGHTS_MEMBER):
                    z.writestr(info, data, compress_type=zipfile.ZIP_STORED)
                else:
                    z.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=1)
    return buf.getvalue()


class EngineFile:
    """An engine file opened: ``meta`` (engine.json) and its members read when asked for (``onnx()``,
    ``compiled()``, ``weights()``), so that a load of a compiled engine never copies its branch.onnx.
    Bare ONNX (bundles written before compiled engines shipped) reads as uncompiled."""

    def __init__(self, data: bytes):
        self._zip = None
        if not data.startswith(b"PK"):
            self.meta, self._onnx = {"format": 0, "compiled": None}, data
            return
        try:
            self._data = data
            self._zip = zipfile.ZipFile(io.BytesIO(data))
            self._names = set(self._zip.namelist())
            self.meta = json.loads(self._zip.read("engine.json"))
        except (zipfile.BadZipFile, KeyError, ValueError) as e:
            raise ParastreamError(f"not a readable torch engine ({e}); rebuild the bundle") from None
        if self.meta.get("format") not in READABLE_FORMATS:
            raise ParastreamError(f"torch engine format {self.meta.get('format')!r}, this parastream reads "
                                  f"{ENGINE_FORMAT}; rebuild the bundle")

    def _read(self, name: str | None) -> bytes | None:
        if self._zip is None or name not in self._names:
            return None
        try:
            return self._zip.read(name)
        except (zipfile.BadZipFile, ValueError) as e:  # a damaged member (CRC): the manifest's hash says which file
            raise ParastreamError(f"not a readable torch engine ({name}: {e}); rebuild the bundle") from None

    def onnx(self) -> bytes:
        data = self._onnx if self._zip is None else self._read("branch.onnx")
        if data is None:
            raise ParastreamError("not a readable torch engine (no branch.onnx); rebuild the bundle")
        return data

    def branch_model(self, model_weights: Callable[[str], "onnx.TensorProto | None"] | None = None) -> "onnx.ModelProto":
        """branch.onnx as a model: the initializers engine.json lists in ``weights_in_model`` (``slim_engine``: a
        written bundle's compiled engine keeps only their names) filled in from ``model_weights`` (name -> the
        bundle's model.onnx initializer, ``Bundle.initializer``)."""
        model = _branch_model(self.onnx())
        named = self.meta.get("weights_in_model") or []
        if named:
            refill_initializers(model, named, model_weights)
        return model

    def compiled(self) -> bytes | None:
        return self._read(_MEMBER.get(self.meta.get("compiled")))

    def has_compiled(self) -> bool:
        """Whether the file holds compiled code (``compiled()`` is not None), without reading it."""
        return self._zip is not None and _MEMBER.get(self.meta.get("compiled")) in self._names

    def weights(self) -> bytes | None:
        return self._read(WEIGHTS_MEMBER)

    def weights_view(self) -> "bytes | memoryview | None":
        """weights.bin for a load: where it is stored (``pack`` stores it), a view of the engine file's bytes, not
        a copy, and without zipfile's CRC pass over it; else as ``weights``.  A load's engine file comes from a
        bundle whose files' sha256 ``Bundle.open`` checked (or from the build writing it), so the CRC would check
        the same bytes again: for NASNet-A Large's ~178 MB of weights it was a second pass over them, and a copy,
        in the loading thread that bounds the load.  zipfile reads no member without both, so the member's place is read from its local
        header here (APPNOTE 4.3.7: 30 bytes, then the name and the extra field)."""
        if self._zip is None or WEIGHTS_MEMBER not in self._names:
            return None
        info = self._zip.getinfo(WEIGHTS_MEMBER)
        if info.compress_type != zipfile.ZIP_STORED or info.flag_bits & 0x1:  # compressed or encrypted: zipfile's way
            return self.weights()
        view = memoryview(self._data)
        head = view[info.header_offset:info.header_offset + 30]
        if len(head) < 30 or bytes(head[:4]) != b"PK\x03\x04":
            raise ParastreamError(f"not a readable torch engine ({WEIGHTS_MEMBER}: no local header); rebuild the bundle")
        start = info.header_offset + 30 + int.from_bytes(head[26:28], "little") + int.from_bytes(head[28:30], "little")
        end = start + info.compress_size
        if end > len(view) or info.compress_size != info.file_size:
            raise ParastreamError(f"not a readable torch engine ({WEIGHTS_MEMBER} runs past the file); rebuild the bundle")
        return view[start:end]


def unpack(data: bytes) -> tuple[dict, bytes, bytes | None]:
    """(engine.json, branch.onnx, the compiled code or None: ``meta["compiled"]`` says which)."""
    f = EngineFile(data)
    return f.meta, f.onnx(), f.compiled()


def slim_engine(data: bytes, held: Callable[[str], "onnx.TensorProto | None"]) -> bytes:
    """A compiled engine file as a bundle ships it beside its model.onnx: branch.onnx without the data of the
    initializers that ``held`` (name -> model.onnx's initializer) holds with equal bytes, named in engine.json's
    ``weights_in_model``.  A compiled engine's load reads weights.bin and the compiled code only; branch.onnx is
    read where an engine is compiled again (another layout or fusion than built) and by ``localize``, which refill
    it from the bundle's model.onnx (``EngineFile.branch_model``).  Without it every engine carried its fp32
    weights a second time (NASNet-A Large: 355 of its 536 MB of engines, hashed and read at every load).  An engine
    without compiled code (compiled at every load) is left whole, as is anything this cannot read."""
    try:
        f = EngineFile(data)
    except ParastreamError:
        return data
    if not f.meta.get("compiled") or f.meta.get("weights_in_model"):  # (bare ONNX reads as not compiled)
        return data
    model = _branch_model(f.onnx())
    named = slim_initializers(model, held)
    if not named:
        return data
    return pack(dict(f.meta, weights_in_model=named), model.SerializeToString(), f.compiled(), f.weights())


def _branch_model(onnx_bytes: bytes) -> onnx.ModelProto:
    """An engine's branch.onnx; refused if a tensor names an external data file (a bundle's paths stay in it)."""
    import onnx
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
_CACHE: SizedLRU = SizedLRU()
_CACHE_LOCK = threading.Lock()
#: cache key -> (engine file, artifact bytes): the search's candidates and the build's alternatives pack each
#: unchanged branch's engine once (zipping 100 engines of an Inception-v4 was ~0.5 s per candidate)
_PACKED: SizedLRU = SizedLRU(size=lambda v: len(v[0]))


def cache_key(branch: onnx.ModelProto, signature: list, dtype: str, options: BuildOptions, fuse: bool, built: dict,
              artifact: str = "aoti", digest: str | None = None, choices: str | None = None) -> str:
    """sha256 of the branch's graph (its name, which carries the branch's index, left out), the tensor layout,
    the compute dtype, the options that change the code, what it is compiled for, and into which artifact
    (``code_choices``; ``choices``: those, made already for these arguments).

    A fusion option is in the key only where it can change the branch's code (``choices_that_apply``): the
    alternative a GPU build times with a fusion off then compiles the branches that fusion touches, and finds
    the others compiled (nasnet_cell's searched plan: 2 of 31 branches hold a Conv and a Relu)."""
    h = hashlib.sha256((digest or branch_digest(branch)).encode())
    h.update((choices or code_choices(branch, signature, dtype, options, fuse, built, artifact)).encode())
    return h.hexdigest()


def code_choices(branch: onnx.ModelProto, signature: list, dtype: str, options: BuildOptions, fuse: bool,
                 built: dict, artifact: str = "aoti") -> str:
    """What, besides the branch's graph, makes its compiled code (``cache_key``), as sorted JSON: the tensor
    layout, the compute dtype, the options that change the code (a fusion only where it can), what it is compiled
    for and into which artifact."""
    from .onnx_torch import CONVERTER_VERSION, conv_kernels_change, has_depthwise_conv, has_planned_epilogue

    applies = choices_that_apply(branch)
    device = built.get("device")
    return json.dumps({"format": ENGINE_FORMAT, "converter": CONVERTER_VERSION, "artifact": artifact,
                       "signature": signature, "dtype": dtype,
                       **({"fuse_conv_relu": fuse} if applies["fuse_conv_relu"] else {}),
                       **({"conv_relu_unfused": unfused} if applies["fuse_conv_relu"] and fuse
                          and (unfused := conv_relu_unfused_in(branch, options)) else {}),
                       **({"conv_channels_padded": padded} if applies["fuse_conv_relu"] and fuse
                          and (padded := conv_channels_padded_in(branch, options)) else {}),
                       **({"fuse_attention": False} if applies["fuse_attention"] and not options.fuse_attention else {}),
                       **({"conv_kernels": options.conv_kernels}  # only where it changes the code
                          if options.conv_kernels in LOWERED_CONV_KERNELS
                          and conv_kernels_change(branch, options.conv_kernels) else {}),
                       # (the code calls the plans' op: for its depthwise convolutions, or the epilogues it fuses)
                       **({"cudnn_plans": True} if (_cudnn_plans(device, options) and has_depthwise_conv(branch))
                          or (fuse and _plan_op(device, options) and has_planned_epilogue(branch)) else {}),
                       **({"fuse_gemm_epilogue": False}
                          if applies["fuse_gemm_epilogue"] and not options.fuse_gemm_epilogue else {}),
                       **({"inductor_format": inductor_format(options)} if artifact == "inductor" else {}),
                       "optimization_level": int(options.optimization_level),
                       "built_for": {k: built.get(k) for k in _MUST_MATCH}}, sort_keys=True)


def compile_group(branch: onnx.ModelProto, signature: list, choices: str) -> str:
    """The group of compile jobs one worker compiles in turn (``Builder._compile``): branches of one structure
    (``structure_key``: they differ only in names and weights) compiled with the same ``code_choices``, whose
    Inductor graphs are one graph, so that all but the first are hits in that worker's caches.  The same
    structure with other choices (a fusion off, depthwise convolutions as Inductor's kernels) is another graph:
    in a group of its own, it compiles in another worker at the same time rather than after it in the same one.
    Grouped by structure alone, a one-engine model's alternatives were one group of whole-model compiles in one
    worker while the others idled (H200: EfficientNet-B0's three 71.8 worker-seconds, DenseNet-121's two 73.9,
    the end of their builds at 76-82 s), and NASNet-A Large's depthwise sample six groups of three, each with
    Inductor's depthwise kernels (~12 s an engine), that the search's end waited for."""
    # the choices without the signature, which names the branch's tensors (every branch a group of its own:
    # NASNet-A Large's input compiled as 332 groups where 83 structures reuse their first compile's kernels);
    # ``structure_key`` holds the signature without its names
    unnamed = {k: v for k, v in json.loads(choices).items() if k != "signature"}
    return structure_key(branch, signature) + ":" + hashlib.sha256(
        json.dumps(unnamed, sort_keys=True).encode()).hexdigest()[:16]


def conv_channels_padded_in(branch: onnx.ModelProto, options: BuildOptions) -> list[str]:
    """The shapes of ``options.conv_channels_padded`` that ``branch`` has, as ``conv_relu_unfused_in``."""
    if not options.conv_channels_padded:
        return []
    from .cudnn_fused import fused_conv_keys

    return sorted(set(options.conv_channels_padded) & set(fused_conv_keys(branch)))


def conv_relu_unfused_in(branch: onnx.ModelProto, options: BuildOptions) -> list[str]:
    """The shapes of ``options.conv_relu_unfused`` that ``branch`` has (``cudnn_fused.fused_conv_keys``): what of
    that list changes the branch's code, so that a branch without them keeps its cache key."""
    if not options.conv_relu_unfused:
        return []
    from .cudnn_fused import fused_conv_keys

    return sorted(set(options.conv_relu_unfused) & set(fused_conv_keys(branch)))


def choices_that_apply(branch: onnx.ModelProto) -> dict[str, bool]:
    """Per fusion option (``fuse_conv_relu``, ``fuse_attention``, ``fuse_gemm_epilogue``), whether it can change
    the branch's engine: the nodes it converts are there.  Where one cannot, the engine is the same either way:
    one cache key, and engine.json records the option as null (either choice loads it)."""
    from .onnx_torch import has_fused_attention, has_gemm_epilogue, may_fuse_conv_relu

    return {"fuse_conv_relu": may_fuse_conv_relu(branch), "fuse_attention": has_fused_attention(branch),
            "fuse_gemm_epilogue": has_gemm_epilogue(branch)}


def branch_digest(branch: onnx.ModelProto) -> str:
    """sha256 of the branch's graph without its name and doc string (the name carries the branch's index)."""
    return hashlib.sha256(_anonymous_bytes(branch)).hexdigest()


#: id(branch) -> (the branch, its ``_anonymous_bytes``, their sha256): ``_serialized``
_SERIALIZED: SizedLRU = SizedLRU(size=lambda v: len(v[1]))
SERIALIZED_BYTES = 1 << 30


def _serialized(branch: onnx.ModelProto) -> tuple[bytes, str]:
    """(``_anonymous_bytes(branch)``, their sha256), once per branch object: a build hands the same extracted
    branches to the compile batch and then to the engine writes, and the search to a candidate's prepare and then
    its load (``pipeline.build.branches_of``); serializing and hashing 170 MB twice was ~0.5 s per plan.  Branch
    objects are never changed after extraction; the entry holds the object, so its id stays its own."""
    with _CACHE_LOCK:
        hit = _SERIALIZED.get(id(branch))
        if hit is not None and hit[0] is branch:
            _SERIALIZED.move_to_end(id(branch))
            return hit[1], hit[2]
    data = _anonymous_bytes(branch)
    digest = hashlib.sha256(data).hexdigest()
    with _CACHE_LOCK:
        lru_put(_SERIALIZED, id(branch), (branch, data, digest), SERIALIZED_BYTES)
    return data, digest


def _anonymous_bytes(branch: onnx.ModelProto) -> bytes:
    """The branch serialized without its graph's name and doc string: what an engine's branch.onnx holds and its
    digest hashes, so that the same branch under another index (the search's candidates) gives the same engine.
    Serialized in place (the two fields put back) rather than copied: a build serializes every branch of every
    measured candidate (170 MB of weights per Inception-v4 candidate)."""
    g = branch.graph
    name, doc = g.name, g.doc_string
    g.name = g.doc_string = ""
    try:
        return branch.SerializeToString(deterministic=True)
    finally:
        g.name, g.doc_string = name, doc


def _cache_file(cache_dir: str | None, key: str) -> Path | None:
    return Path(cache_dir) / "torch-engines" / f"{key}.bin" if cache_dir else None


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
        lru_put(_CACHE, key, data, CACHE_BYTES)
    f = _cache_file(cache_dir, key)
    if f is not None:
        write_atomic(f, data)  # a concurrent build never reads half a package


def clear_memory_cache() -> None:
    with _CACHE_LOCK:
        _CACHE.clear()
        _PACKED.clear()
        _SERIALIZED.clear()
        _SAME_CODE.clear()
    _FAILED.clear()


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


def _cudnn_plans(device: str | None, options: BuildOptions) -> bool:
    # CUDA engines run their depthwise convolutions through cuDNN plans the engine ships (``cudnn_plans.py``)
    # where ``conv_kernels`` leaves them to cuDNN and the build asked for it (``BuildOptions.cudnn_plans``); the
    # engine's code does not depend on the frontend being installed (without it the op is torch's convolution),
    # so neither does this.  Only the Python artifacts call the op: an AOTInductor package ships no plans, so the
    # op would build them at every process's first call anyway, through a Python callback from the package's C++
    # (AOTInductor's proxy executor); torch's convolution AOTInductor calls natively.
    return (device == "cuda" and options.cudnn_plans and options.conv_kernels not in LOWERED_CONV_KERNELS
            and options.torch_artifact != "aoti")


def _plan_op(device: str | None, options: BuildOptions) -> bool:
    # whether the engine may call the plans' op at all (``_cudnn_plans`` less the depthwise lowering, which
    # concerns the depthwise convolutions only): the epilogues only a plan fuses (SiLU, a residual Add without
    # ReLU) run through it, dense convolutions' too
    return device == "cuda" and options.cudnn_plans and options.torch_artifact != "aoti"


def _fuse_gemm_epilogue(device: str, options: BuildOptions) -> bool:
    # cuBLASLt's epilogue, whose GELU is the tanh approximation on CUDA (the converter fuses a GELU only where that
    # is what it computes); a GPU build times the bundle with and without it (options.fuse_gemm_epilogue)
    return device == "cuda" and options.fuse_gemm_epilogue


def converter_options(device: str, dtype: str, options: BuildOptions) -> dict:
    """``onnx_torch.convert``'s options for an engine on ``device`` in ``dtype``: what the build option asks, where
    that device runs it (the cuDNN and cuBLASLt kernels, and the patch embedding as one product, are CUDA's).
    The one place both an engine's compile and its conversion at load take them from."""
    return {"fuse_conv_relu": _fuse(device, dtype, options), "fuse_attention": options.fuse_attention,
            "conv_kernels": options.conv_kernels, "fuse_gemm_epilogue": _fuse_gemm_epilogue(device, options),
            "cudnn_plans": _cudnn_plans(device, options), "patch_gemm": device == "cuda",
            # a convolution's weight in the layout Inductor runs it (onnx_torch._channels_last_conv_weights)
            "conv_weights_channels_last": device == "cuda",
            "fuse_conv_plans": _fuse(device, dtype, options) and _plan_op(device, options),
            "conv_relu_unfused": tuple(options.conv_relu_unfused),
            "conv_channels_padded": tuple(options.conv_channels_padded),
            # GEMM, bias and activation as Inductor's kernels: a Linear of one row as one Inductor reduction
            "one_row_reduction": device == "cuda" and not options.fuse_gemm_epilogue}


#: the fusion options engine.json records null where they cannot change the engine (``choices_that_apply``)
FUSION_CHOICES = ("fuse_conv_relu", "fuse_attention", "fuse_gemm_epilogue")


def _compile_at_load_reason(package, meta: dict, *, elsewhere: bool, signature, dtype: str, fuse_conv_relu: bool,
                            options: BuildOptions) -> str:
    """"" where an engine file's compiled artifact serves this load; else the first reason it does not."""
    if package is None:
        return "the engine file holds no compiled artifact"
    if elsewhere:
        return "Inductor's own artifact was compiled for GPU 0"
    asked = {"signature": signature, "dtype": dtype, "fuse_conv_relu": fuse_conv_relu,
             "fuse_attention": options.fuse_attention, "conv_kernels": conv_kernels_used(options.conv_kernels),
             "fuse_gemm_epilogue": options.fuse_gemm_epilogue}
    # fields an older engine file lacks were then the only choice (attention and GEMM epilogues fused), and a
    # branch without a depthwise convolution records no conv_kernels: either choice loads it
    absent = {"fuse_attention": True, "fuse_gemm_epilogue": True, "conv_kernels": asked["conv_kernels"]}
    left = set(meta.get("conv_relu_unfused") or ()) - set(options.conv_relu_unfused or ())
    if fuse_conv_relu and left:  # (the branch's own part of the list: the load's holds every branch's)
        return f"compiled with {sorted(left)[0]!r} unfused, which the load's conv_relu_unfused does not list"
    wide = set(meta.get("conv_channels_padded") or ()) - set(options.conv_channels_padded or ())
    if fuse_conv_relu and wide:
        return f"compiled with {sorted(wide)[0]!r} padded, which the load's conv_channels_padded does not list"
    for name, want in asked.items():
        got = meta.get(name, absent.get(name))
        if got is None and name in meta and name in FUSION_CHOICES:  # recorded null: the same engine either way
            continue
        if got != want and name == "signature":
            return "compiled for other tensor dtypes, shapes or layouts than the launcher gives it"
        if got != want:
            return f"compiled with {name}={got!r}, loaded with {want!r}"
    return ""


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


def _engine_module(branch: onnx.ModelProto, inputs: list[TensorSpec], outputs: list[TensorSpec], device: str,
                   dtype: str, nhwc: set[str], views: dict, options: BuildOptions):
    """(``f(*inputs, *outputs)`` writing the branch's results into its outputs, example tensors with exactly the
    launcher's dtypes, shapes and strides): what either compiled artifact is compiled from."""
    import torch

    from .onnx_torch import convert, to_fx

    module = convert(branch, dtype, **converter_options(device, dtype, options)).to(device)
    try:
        inner = to_fx(module)  # straight-line code rather than the interpreter loop
    except Exception:  # noqa: BLE001 - the interpreter module compiles too
        inner = module
    wrapper = _into_outputs(inner, [t.name for t in inputs], [t.name for t in outputs], getattr(torch, dtype)).eval()
    wrapper.const_names = getattr(module, "const_names", {})  # its buffers' ONNX values, for the build's records
    args = tuple(_tensor(t, t.name in nhwc, views.get(t.name), device) for t in inputs + outputs)
    return wrapper, args


def compile_package(branch: onnx.ModelProto, inputs: list[TensorSpec], outputs: list[TensorSpec], device: str,
                    dtype: str, nhwc: set[str], views: dict, options: BuildOptions) -> tuple[bytes, dict, bytes]:
    """The branch exported for these tensors (dtypes, shapes, strides) and compiled by AOTInductor: a .pt2 package."""
    import torch
    from torch._inductor import aoti_compile_and_package

    wrapper, args = _engine_module(branch, inputs, outputs, device, dtype, nhwc, views, options)
    configs = _known_inductor_configs({**_inductor_options(options),
                                       # the wrapper's C++ runs once per capture, never in a replay: compile it quickly
                                       "aot_inductor.compile_wrapper_opt_level": "O0",
                                       "aot_inductor.enable_line_tables": False})
    with torch.no_grad():
        program = torch.export.export(wrapper, args)
        buf = io.BytesIO()
        aoti_compile_and_package(program, package_path=buf, inductor_configs=configs)
    return buf.getvalue(), {}, b""  # the package holds its weights


def _lowering_configs(options: BuildOptions) -> dict:
    """The Inductor settings the converter's forms ask for, whichever artifact is compiled: where depthwise
    convolutions are Inductor's own kernels, their reductions over up to ``onnx_torch.UNROLLED_TAPS`` taps written
    out as sums (Inductor's default writes out reductions of fewer than 8)."""
    from .onnx_torch import UNROLLED_TAPS

    if conv_kernels_used(options.conv_kernels) == "inductor":
        return {"unroll_reductions_threshold": UNROLLED_TAPS + 1}  # Inductor writes out reductions below it
    return {}


def _inductor_options(options: BuildOptions) -> dict:
    """The Inductor configuration an engine is compiled with, at build and by torch.compile at load for a JIT
    engine: the mode's, and the converter's (``_lowering_configs``).  ``--opt-level`` spends build time on kernels
    as TensorRT's builder level does: 5 is ``max-autotune-no-cudagraphs`` (Triton GEMM and convolution templates
    timed against the libraries' kernels, and coordinate descent), 4 Inductor's default with its generated
    kernels' launch configurations tuned by coordinate descent on the device (no templates: their convolutions
    timed 25-35 µs against cuDNN's 6 on Inception-v3, bench/NOTES.md), 3 and below Inductor's default."""
    import torch._inductor

    level = options.optimization_level
    mode = "max-autotune-no-cudagraphs" if level >= 5 else "default"
    tuned = {"coordinate_descent_tuning": True} if level == 4 else {}
    return {**torch._inductor.list_mode_options(mode), **tuned, "max_pointwise_cat_inputs": POINTWISE_CAT_INPUTS,
            **_lowering_configs(options)}


#: a Concat of up to this many inputs whose readers are pointwise is read in place by their kernel (Inductor's
#: ``max_pointwise_cat_inputs``; its default, 8, writes a wider one into a buffer of its own, one copy kernel per
#: input an extern kernel such as a convolution wrote).  DenseNet's dense layers each concatenate all the block's
#: earlier outputs (up to 25 in DenseNet-121, 49 in DenseNet-201) and normalise them: DenseNet-121's engine ran
#: 145 such copy kernels a replay, and with the Concat read in place its bundle ran 0.746 against 0.887 ms (1.19x;
#: H200, fp16, batch 1, side by side; bench/NOTES.md, fifty-second session).  A Concat of 8 inputs or fewer is
#: compiled as before (the default covers it); Inductor still copies where an input has other pointwise readers.
POINTWISE_CAT_INPUTS = 64


def _param_specs(params: list) -> list:
    return [[list(p.shape), list(p.stride()), str(p.dtype).removeprefix("torch.")] for p in params]


_ALIGN = 64  # each weight's bytes start at a multiple of this in weights.bin (any dtype can view them in place)


def _weights_blob(params: list) -> tuple[bytes, dict]:
    """weights.bin for ``params`` (dense tensors: ``_dense``) and its engine.json fields: each tensor's storage
    bytes in memory order at an aligned offset (``param_offsets``) and their sha256 (``param_digests``: a
    process shares equal weights between engines without hashing them at load).

    Hand-written rather than safetensors or torch.save: safetensors stores contiguous tensors only (channels-last
    weights would need a transform at load), torch.save unpickles at load (a bundle may come from elsewhere)."""
    import torch

    out = bytearray()
    offsets, digests = [], []
    for p in params:
        out += bytes(-len(out) % _ALIGN)
        flat = torch.empty(p.numel(), dtype=p.dtype)
        flat.as_strided(p.shape, p.stride()).copy_(p.detach().cpu())  # element i at its storage position
        data = flat.view(torch.uint8).numpy().tobytes() if p.numel() else b""
        offsets.append(len(out))
        digests.append(hashlib.sha256(data).hexdigest())
        out += data
    return bytes(out), {"param_offsets": offsets, "param_digests": digests}


def _dense(t) -> bool:
    return _dense_layout(list(t.shape), list(t.stride()))


def _dense_layout(shape: list, stride: list) -> bool:
    """Every element at its own storage position, none between them: its storage bytes are exactly its values.
    (torch's own test has moved between releases: ``_prims_common.is_non_overlapping_and_dense`` in 2.11, only an
    ``_or_false`` variant in 2.13; this is its definition.)"""
    if len(shape) != len(stride) or 0 in shape:
        return len(shape) == len(stride)
    expected = 1
    for stride, size in sorted((st, n) for n, st in zip(shape, stride) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def compile_inductor(branch: onnx.ModelProto, inputs: list[TensorSpec], outputs: list[TensorSpec], device: str,
                     dtype: str, nhwc: set[str], views: dict, options: BuildOptions) -> tuple[bytes, dict, bytes]:
    """The branch compiled by Inductor for these tensors into a precompiled artifact (``standalone_compile``,
    saved in its "binary" format): (artifact bytes, engine.json fields for its weights, weights.bin).

    The graph is ``make_fx`` of the engine's module with its weights as graph inputs, called as
    ``art(*weights, *inputs, *outputs)``: an artifact whose graph holds its weights as constants fails to run
    after ``CompiledArtifact.load`` (IndexError in the runtime wrapper, torch 2.13).  ``params`` names them
    (buffers of the converted module) with the shapes, strides and dtypes the artifact was compiled for
    (``param_specs``); weights.bin holds exactly those tensors (``_weights_blob``), so that a load copies
    them to the device instead of converting branch.onnx again (1.0 s of a 100-branch load on the H200).
    """
    import tempfile

    import torch
    import torch._inductor
    from torch.fx.experimental.proxy_tensor import make_fx

    wrapper, args = _engine_module(branch, inputs, outputs, device, dtype, nhwc, views, options)
    names = [n for n, _ in wrapper.named_buffers()] + [n for n, _ in wrapper.named_parameters()]
    tensors = dict(wrapper.named_buffers(), **dict(wrapper.named_parameters()))
    params = [tensors[n].detach() for n in names]
    params = [t if _dense(t) else t.contiguous() for t in params]  # weights.bin holds storage bytes

    def f(*a):
        return torch.func.functional_call(wrapper, dict(zip(names, a[:len(names)])), tuple(a[len(names):]))

    with torch.no_grad():
        gm = make_fx(f)(*params, *args)
        consts = [n.target for n in gm.graph.nodes if n.op == "get_attr"]
        if consts:  # see the docstring: the loaded artifact could not run these
            raise ParastreamError(f"the traced branch holds tensor constants {consts[:3]}: no Inductor artifact")
        fmt = inductor_format(options)
        same = _code_id(gm, [*params, *args], options, fmt, device)
        hit = _code_get(same, options.cache_dir)
        if hit is not None:  # another branch with this very graph was compiled in this process: its code, our weights
            package, compiled_extra = hit
            weights, fields = _weights_blob(params)
            return package, dict(compiled_extra, params=[n.removeprefix("inner.") for n in names],
                                 param_specs=_param_specs(params), code_reused=True, **fields), weights
        kernels = fmt == "kernels" and device == "cuda"
        if kernels:
            from . import inductor_kernels

            inductor_kernels.install_recorder()
        bundled = {"aot": True} if fmt in ("bundled", "kernels") else {}
        art = torch._inductor.standalone_compile(gm, [*params, *args], dynamic_shapes="from_example_inputs",
                                                 options={"config_patches": _inductor_options(options)}, **bundled)
    weights, fields = _weights_blob(params)
    extra = {"params": [n.removeprefix("inner.") for n in names], "param_specs": _param_specs(params), **fields}
    if kernels:
        try:
            # the compiled graph runs in extract, its Triton kernels autotuning (Triton times each config on the
            # GPU): a compile worker runs it in a shared turn on the GPU, beside the other workers' and never
            # during the build's timings (NASNet-A Large's search on the H200, workers compiling: its reference
            # 1.85-2.41 ms in some timings, 1.50 in most)
            turn = functools.partial(cuda.gpu_turn, torch.cuda.current_device(),
                                     enabled=_IN_WORKER and options.gpu_timing_lock, shared=True)
            package, info = inductor_kernels.extract(  # (the weights named by the ONNX values they hold)
                art, [*params, *args], len(outputs), gpu_turn=turn,
                weight_names=[wrapper.const_names.get(n, n) for n in extra["params"]])
            extra = dict(extra, compiled="kernels", kernels=info)
            _remember_code(same, package, extra, options.cache_dir)
            return package, extra, weights
        except Exception as e:  # noqa: BLE001 - Inductor's own artifact ships instead, engine.json says why
            extra["kernels_error"] = _failure(e)
    with tempfile.TemporaryDirectory(prefix="parastream-inductor-") as d:  # the API saves to a path
        path = os.path.join(d, "inductor.bin")
        art.save(path=path, format="binary")
        data = Path(path).read_bytes()
    _remember_code(same, data, extra, options.cache_dir)
    return data, extra, weights


#: a traced graph's identity (``_code_id``) -> (the artifact Inductor compiled from it, its engine.json fields but
#: the weights'): branches whose graphs are the same compile to the same code, since their weights are graph inputs.
#: A compile worker keeps it across its jobs (structure groups are compiled in one worker in turn); with
#: ``--cache-dir`` it is also kept in DIR/torch-code/, so that a rebuild of a model whose weights changed compiles
#: nothing whose code did not (the compiled-branch cache, keyed by the branch with its weights, misses there)
_SAME_CODE: SizedLRU = SizedLRU(size=lambda v: len(v[0]))
SAME_CODE_BYTES = 1 << 30
_WEIGHT_FIELDS = ("params", "param_specs", "param_offsets", "param_digests")


def _code_id(gm, tensors: list, options: BuildOptions, fmt: str, device: str) -> str:
    """sha256 of what Inductor compiles: the traced graph's code (its operators, their arguments and any Python
    constant in it: a value that the ONNX held as a weight but the converter folded into the code makes another
    graph), the dtype, shape and strides of every graph input (weights, inputs, outputs), the Inductor options,
    the artifact format and the device.  Equal ids compile to the same artifact (the weights are graph inputs).
    Not ``structure_key``, which leaves out every float initializer's values and only groups compile jobs."""
    h = hashlib.sha256(gm.code.encode())
    h.update(json.dumps({"inputs": _param_specs(tensors), "inductor": _inductor_options(options),
                         "format": fmt, "device": device}, sort_keys=True, default=str).encode())
    return h.hexdigest()


def _code_file(cache_dir: str | None, same: str) -> Path | None:
    return Path(cache_dir) / "torch-code" / f"{same}.bin" if cache_dir else None


def _code_get(same: str, cache_dir: str | None) -> tuple[bytes, dict] | None:
    """(artifact, engine.json fields but the weights') compiled from a graph with this ``_code_id``, in this process
    or in ``cache_dir``; else None."""
    with _CACHE_LOCK:
        hit = _SAME_CODE.get(same)
        if hit is not None:
            _SAME_CODE.move_to_end(same)
            return hit
    f = _code_file(cache_dir, same)
    if f is None or not f.is_file():
        return None
    package, kept, _ = _split_entry(f.read_bytes())
    with _CACHE_LOCK:
        lru_put(_SAME_CODE, same, (package, kept), SAME_CODE_BYTES)
    return package, kept


def _remember_code(same: str, package: bytes, extra: dict, cache_dir: str | None) -> None:
    kept = {k: v for k, v in extra.items() if k not in _WEIGHT_FIELDS}
    with _CACHE_LOCK:
        lru_put(_SAME_CODE, same, (package, kept), SAME_CODE_BYTES)
    f = _code_file(cache_dir, same)
    if f is not None:  # written by a compile worker too: a concurrent build never reads half an artifact
        write_atomic(f, _entry(package, kept))


def compile_workers(options: BuildOptions | None = None) -> int:
    """Processes that compile packages side by side: ``options.compile_workers`` (``--compile-workers``), else every
    core but one, at most 16; ``PARASTREAM_COMPILE_WORKERS`` overrides both (a machine's limit on a shared host,
    docs/torch-engines.md).  A worker compiles one kernel at a time (``compile_threads`` 1; ptxas is a process of
    its own), and the build waits for the batch: on the H100's 16 cores, 8 workers left half of them idle."""
    env = os.environ.get("PARASTREAM_COMPILE_WORKERS")
    if env:
        if not env.strip().isdigit() or int(env) < 1:
            raise ParastreamError(f"PARASTREAM_COMPILE_WORKERS={env!r}: give a whole number of processes, 1 or more")
        return int(env)
    if options is not None and options.compile_workers:
        if options.compile_workers < 1:
            raise ParastreamError(f"--compile-workers {options.compile_workers}: give a whole number of processes, 1 or more")
        return int(options.compile_workers)
    return max(1, min(16, (os.cpu_count() or 1) - 1))


_POOL: dict = {}
#: sha256 of a branch's ONNX -> the steps its conversion has: a build converts each branch once to check it
_CONVERTED: dict[str, int] = {}
#: cache key -> why Inductor could not compile that branch (in this process): not tried again
_FAILED: dict[str, str] = {}


#: True in a compile worker (``_worker_init``): its GPU runs take shared turns on the GPU, between the build's timings
_IN_WORKER = False


def _worker_init() -> None:
    global _IN_WORKER
    import torch._inductor.config as cfg
    import torch._inductor.standalone_compile  # noqa: F401 - what every job needs, imported before the first one

    _IN_WORKER = True

    cfg.compile_threads = 1  # the workers are the parallelism; no Triton compile pool per worker (but see below)
    # below the build's own process: while they compile the search's next candidates in the background, the
    # build loads and times the current one on the GPU, and a descheduled launch thread would skew its timing
    try:
        os.nice(10)
    except OSError:  # not permitted here: the same priority, as before
        pass


#: artifact -> the function that compiles it (looked up by name when called, so that tests can count the calls)
_COMPILERS = {"aoti": "compile_package", "inductor": "compile_inductor"}


#: a branch of at least this many nodes compiles its Triton kernels side by side (``_compile_job``)
LARGE_BRANCH_NODES = 64


def large_compile_threads() -> int:
    """Inductor's compile threads for a large branch in a worker: half the cores, at most 8 (1: none)."""
    return max(1, min(8, (os.cpu_count() or 1) // 2))


def _compile_job(job: tuple) -> bytes:
    """A cache entry (``_entry``) of the job's branch compiled into its artifact.

    A large branch (a whole model as one engine: the one-engine plan a GPU build times its plan against, or a
    one-stream model's only engine) is one job of one worker, and was the build's longest wait (Inception-v4's
    whole-model engine: most of a minute, its ~100 Triton kernels compiled one after another).  Its worker compiles
    its kernels in Inductor's own compile pool (``compile_threads``) instead; the pool stays for that worker's
    later jobs.  Small branches keep one thread: the workers are their parallelism."""
    import onnx

    artifact, branch_bytes, inputs, outputs, device, dtype, nhwc, views, options = job
    branch = onnx.load_from_string(branch_bytes)
    if device == "cuda" and len(branch.graph.node) >= LARGE_BRANCH_NODES and large_compile_threads() > 1:
        import torch._inductor.config as cfg

        cfg.compile_threads = max(int(cfg.compile_threads or 1), large_compile_threads())
    compile_fn = globals()[_COMPILERS[artifact]]
    return _entry(*compile_fn(branch, inputs, outputs, device, dtype, nhwc, views, options))


def _failure(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"[:500]


def _compile_group(jobs: list[tuple]) -> list[bytes | str]:
    """The jobs compiled in this process one after another: each one's cache entry, or why it failed."""
    out: list[bytes | str] = []
    for job in jobs:
        try:
            out.append(_compile_job(job))
        except Exception as e:  # noqa: BLE001 - reported per branch
            out.append(_failure(e))
    return out


def structure_key(branch: onnx.ModelProto, signature: list) -> str:
    """sha256 of the branch with its names replaced by their order of appearance and the values of its
    floating-point initializers left out (shapes and types kept), and of its tensor signature without names:
    branches that differ only in names and weights, which Inductor compiles to one graph (the weights are
    graph inputs).  It only groups compile jobs (which process compiles what, in which order), never decides
    what a job compiles."""
    import onnx

    # the copy is made without what is left out (a copy of the whole branch copied every weight's bytes first:
    # 4.0 s of preparing 21 BERT-base candidates on the 2-core CPU)
    canon = onnx.ModelProto()
    _copy_fields(canon, branch, skip={"graph"})
    g = canon.graph
    _copy_fields(g, branch.graph, skip={"initializer", "value_info", "name", "doc_string"})
    g.name = g.doc_string = ""
    floating = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE)
    for t in branch.graph.initializer:
        _copy_fields(g.initializer.add(), t,
                     skip={"raw_data", "float_data", "int32_data", "double_data"} if t.data_type in floating else set())
    names: dict[str, str] = {}

    def rename(n: str) -> str:
        return names.setdefault(n, f"t{len(names)}") if n else n

    for v in g.input:
        v.name = rename(v.name)
    for t in g.initializer:
        t.name = rename(t.name)
    for node in g.node:
        node.name = node.doc_string = ""
        node.input[:] = [rename(n) for n in node.input]
        node.output[:] = [rename(n) for n in node.output]
    for v in g.output:
        v.name = rename(v.name)
    h = hashlib.sha256(canon.SerializeToString(deterministic=True))
    h.update(json.dumps([s[1:] for s in signature]).encode())
    return h.hexdigest()


def _entry(package: bytes, extra: dict, weights: bytes = b"") -> bytes:
    """What the compiled-branch cache holds: the artifact, the engine.json fields that go with it (an inductor
    artifact's weight names and specs) and its weights.bin, as 4 bytes of length, that JSON (with the
    artifact's length), the artifact, the weights."""
    head = json.dumps({"extra": extra, "package_bytes": len(package)}, sort_keys=True).encode()
    return len(head).to_bytes(4, "big") + head + package + weights


def _split_entry(entry: bytes) -> tuple[bytes, dict, bytes | None]:
    n = int.from_bytes(entry[:4], "big")
    head = json.loads(entry[4:4 + n])
    end = 4 + n + head["package_bytes"]
    return entry[4 + n:end], head["extra"], entry[end:] or None


def _ready() -> float:
    """When this worker was ready (its initializer done), in seconds since the epoch: the build's clock differs."""
    return time.time()


#: the ``_ready`` futures of the workers ``start_workers`` started (``background_summary`` says when they were ready)
_READY: list = []


def start_workers(options: BuildOptions) -> None:
    """Start the compile workers now (a GPU build calls this before it loads the model): each spawns, imports
    torch and Inductor (seconds each) while the build loads, checks and plans, instead of when the first batch
    is handed to them."""
    workers = compile_workers(options)
    if options.device != "cuda" or not options.compile or options.torch_artifact == "jit" or workers < 2:
        return
    pool = _pool(workers)
    if not getattr(pool, "_parastream_started", False):
        pool._parastream_started = True
        _READY[:] = [pool.submit(_ready) for _ in range(workers)]  # the pool spawns a worker per task, up to its size


def stop_workers() -> None:
    """End the compile workers now, without waiting for them (a build that stopped before it handed them any
    work, on a model that does not load): else the process's exit waits until each has imported torch and
    Inductor.  ``ProcessPoolExecutor`` ends its processes only when they finish their task (Python 3.14's
    ``terminate_workers`` does what this does), so they are terminated here.  The next build starts a pool again.
    A pool with compiles queued or running (an earlier build's, in this process) is left alone: killed, its jobs
    would be recorded as branches that failed to compile."""
    with _QUEUE_LOCK:
        if _INFLIGHT or _QUEUED or _RUNNING[0] > 0:
            return
    for workers in list(_POOL):
        pool = _POOL.pop(workers)
        processes = list((getattr(pool, "_processes", None) or {}).values())
        pool.shutdown(wait=False, cancel_futures=True)
        for proc in processes:
            try:
                proc.terminate()
            except (OSError, AttributeError):
                pass
    _READY.clear()


def _workers_ready(since: float) -> dict | None:
    """When the workers ``start_workers`` started were ready, in seconds after ``since`` (perf_counter): the
    first and the last, and how many."""
    if not _READY or not all(f.done() and not f.cancelled() and f.exception() is None for f in _READY):
        return None
    offset = time.time() - time.perf_counter()  # this process's epoch seconds at perf_counter 0
    at = sorted(f.result() - offset - since for f in _READY)
    return {"workers": len(at), "first_s": round(at[0], 2), "last_s": round(at[-1], 2)}


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


def register_engine_ops(device: str) -> None:
    """The operators of parastream's own that compiled engines call, defined before any engine's code is loaded
    (an AOTInductor package looks each one's schema up as it loads; Inductor's and the kernels artifacts' code
    calls them by name): on the GPU the depthwise convolutions' cuDNN plans (``cudnn_plans``) and the fused
    convolution epilogues (``cudnn_fused``), everywhere the
    LSTM, GRU and RNN layers (``recurrent_op``).  Each defines itself once per process."""
    if device == "cuda":
        from .cudnn_fused import register_ops
        from .cudnn_plans import register_op

        register_op()
        register_ops()
    from .recurrent_op import register_rnn_op

    register_rnn_op()


def _load_package(package: bytes, device_index: int):
    """The package's runner (``AOTIModelPackageLoader``), loaded without compiling anything.

    Not ``torch._inductor.aoti_load_package``: before loading, that compares the package's device
    information with this machine's, whose CPU part (``pick_vec_isa``) compiles and runs a probe
    kernel with the C++ compiler in every process with an empty Inductor cache (9.5 s on a 2-core CI
    machine, the first load of a fresh Triton instance), and on a mismatch it only warns.
    ``check_built_for`` has refused a mismatch already.
    """
    import tempfile

    import torch

    register_engine_ops("cuda" if device_index >= 0 else "cpu")  # the package's calls of them resolve as it loads
    loader = getattr(getattr(torch._C, "_aoti", None), "AOTIModelPackageLoader", None)
    with tempfile.NamedTemporaryFile(suffix=".pt2") as f:  # the loader reads a file and extracts it
        f.write(package)
        f.flush()
        if loader is None:  # another torch: the public loader
            from torch._inductor import aoti_load_package

            return aoti_load_package(f.name, device_index=device_index).loader
        return loader(f.name, "model", False, 1, device_index)


def _load_inductor(artifact: "bytes | Callable[[], bytes]", weights: Callable[[], bytes | None], meta: dict,
                   device: str):
    """``run(*inputs, *outputs)``: the engine's Inductor artifact loaded (``CompiledArtifact.load``: no dynamo,
    no AOTAutograd trace, no Inductor codegen; on the GPU its Triton kernels come from the artifact) and called
    with its weights, read from weights.bin (``weights()``) unless this process holds them already.

    ``artifact``: its bytes, or a function that reads them, called only where this process has not loaded the
    artifact of engine.json's ``artifact_sha256`` already (an engine file that predates it is read and hashed)."""
    import torch

    t0 = time.perf_counter()
    dev = f"cuda:{torch.cuda.current_device()}" if device == "cuda" else device
    params = _load_params(weights, meta, dev)
    read = artifact if callable(artifact) else (lambda: artifact)
    data = None
    digest = meta.get("artifact_sha256")
    if not isinstance(digest, str):
        data = read()
        digest = hashlib.sha256(data).hexdigest()
    key = (digest, dev)
    t1 = time.perf_counter()
    with _CACHE_LOCK:
        art = _LOADED_ARTIFACTS.get(key)
        if art is not None:
            _LOADED_ARTIFACTS.move_to_end(key)
    if art is None:
        if data is None:
            data = read()
            if hashlib.sha256(data).hexdigest() != digest:
                raise ParastreamError("the engine's compiled code is not the one engine.json's artifact_sha256 names; "
                                      "rebuild the bundle")
        art = _load_artifact(data, meta, device)
        with _CACHE_LOCK:
            lru_put(_LOADED_ARTIFACTS, key, art, LOADED_ARTIFACTS)

    def run(*args):
        art(*params, *args)  # writes the outputs in place (their copy_ is in the compiled graph)

    run.params = params
    run.artifact = art
    run.phases = {"weights": t1 - t0, "artifact": time.perf_counter() - t1}
    return run


def _load_params(weights: Callable[[], bytes | None], meta: dict, dev: str) -> list:
    """The artifact's weight tensors on ``dev``, with exactly the shapes, strides and dtypes it was compiled for
    (``param_specs``).  A tensor this process holds already (``_SHARED_PARAMS``: the same engine loaded again,
    a dynamic batch's buckets, the search's candidates reloading unchanged branches) is that one; the rest come
    from weights.bin, copied to the device in one piece, each tensor a view of it."""
    import torch

    specs, offsets, digests = meta.get("param_specs"), meta.get("param_offsets"), meta.get("param_digests")
    if not (isinstance(specs, list) and isinstance(offsets, list) and isinstance(digests, list)
            and len(specs) == len(offsets) == len(digests) == len(meta.get("params") or [])):
        raise ParastreamError("the engine's engine.json does not describe its weights; rebuild the bundle")
    keys = [(dev, d, json.dumps(spec)) for d, spec in zip(digests, specs)]
    params = [_SHARED_PARAMS.get(k) for k in keys]
    if all(p is not None for p in params):
        return params
    blob = weights()
    missing = []  # (index, dtype, bytes, offset in weights.bin) of the weights this process does not hold yet
    for i, ((shape, stride, dtype), off) in enumerate(zip(specs, offsets)):
        if params[i] is not None:
            continue
        dt = getattr(torch, str(dtype), None)
        if not isinstance(dt, torch.dtype) or not _dense_layout(shape, stride):
            raise ParastreamError(f"the engine's engine.json gives weight {i} a layout weights.bin cannot hold "
                                  f"({shape}, {stride}, {dtype}); rebuild the bundle")
        n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        if blob is None or not isinstance(off, int) or off % _ALIGN or off < 0 or off + n > len(blob):
            raise ParastreamError(f"the engine's weights.bin does not hold weight {i} that engine.json names; "
                                  "rebuild the bundle")
        missing.append((i, dt, n, off))
    with warnings.catch_warnings():  # a read-only buffer: it is only copied from
        warnings.simplefilter("ignore", UserWarning)
        host = torch.frombuffer(blob, dtype=torch.uint8) if blob else torch.empty(0, dtype=torch.uint8)
    # The missing weights go to the device in one copy, and only they: the tensors are views of what was copied,
    # so a copy of the whole of weights.bin would stay alive for the one weight another engine did not share (a
    # grid's buckets share every matrix and differ in a few shape-sized constants: each bucket held a full copy).
    # Where nearly all are missing (a first load), weights.bin goes as it is, without packing it on the host.
    starts, at = [], 0
    for _, _, n, _ in missing:
        starts.append(at)
        at += -(-n // _ALIGN) * _ALIGN
    if at < 0.9 * len(host):
        packed = torch.empty(at, dtype=torch.uint8)
        for (_, _, n, off), start in zip(missing, starts):
            packed[start:start + n] = host[off:off + n]
    else:
        packed, starts = host, [off for _, _, _, off in missing]
    on_device = packed.to(dev) if dev != "cpu" else packed.clone()
    for (i, dt, n, _), start in zip(missing, starts):
        shape, stride, _ = specs[i]
        t = on_device[start:start + n].view(dt).as_strided(shape, stride)
        _SHARED_PARAMS[keys[i]] = params[i] = t
    return params


#: Weight tensors loaded in this process by (device, sha256 of their bytes, shape/strides/dtype): engines whose
#: weights are equal share one copy.  Weak values: a tensor goes with the last engine that calls it.
_SHARED_PARAMS: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()


#: Artifacts loaded in this process, by content, the most recently used ``LOADED_ARTIFACTS`` kept: the weights are
#: the call's inputs, so one loaded artifact serves every engine whose artifact has the same bytes (the search's
#: candidates reload every unchanged branch; branches of one structure can compile to the same code), and a build
#: loads the same artifacts for its measured candidates, its timed alternatives and its verification (kept while
#: no engine held them, each was loaded again: ~1.5 s per load of an Inception-v4 on the H100).
_LOADED_ARTIFACTS: SizedLRU = SizedLRU(size=lambda v: 1)
LOADED_ARTIFACTS = 512


def _load_artifact(artifact: bytes, meta: dict, device: str):
    import tempfile

    import torch

    register_engine_ops(device)
    if meta.get("compiled") == "kernels":  # Inductor's wrapper and cubins, without Inductor
        from .inductor_kernels import KernelsArtifact

        return KernelsArtifact(artifact, torch.cuda.current_device())
    import torch._inductor

    with tempfile.TemporaryDirectory(prefix="parastream-inductor-") as d:  # the API loads from a path
        path = os.path.join(d, "inductor.bin")
        Path(path).write_bytes(artifact)
        # On the GPU the artifact's Triton kernels load from their cubins (Inductor's static launcher) and nothing
        # compiles, so no compile process pool: Inductor would otherwise start one (a sidecar and up to one
        # worker per core, each importing torch) at its first kernel, for nothing.
        serial = torch._inductor.config.patch(compile_threads=1) if device == "cuda" else contextlib.nullcontext()
        try:
            with serial:
                art = torch._inductor.CompiledArtifact.load(path=path, format="binary")
        except AssertionError:  # its only check: the artifact's torch_key (a hash of torch's sources) is this torch's
            raise ParastreamError("the engine's Inductor artifact was compiled by another build of torch "
                                  f"({meta.get('built_for', {}).get('torch')}); rebuild the bundle here") from None
    return art


class Builder(BuilderBase):
    """Converts each branch (failing on the first unsupported node) and compiles it for the launcher's layout.

    ``build(branch, name, layout=None)``: ``layout`` is what the launcher will give the engine
    (``EngineLayouts.branch``: input and output specs, channels-last set, channel views); without
    it, or with ``compile=False`` or ``options.torch_artifact == "jit"``, the engine holds the branch's ONNX alone.
    ``build_all(items)`` does the same for many branches and compiles the artifacts that no cache
    holds in ``compile_workers(options)`` processes side by side.
    """

    def __init__(self, options: BuildOptions):
        if options.precision not in ("fp32", "tf32", "fp16", "bf16"):
            raise ParastreamError(f"--precision {options.precision}: the torch backend builds fp32, tf32, fp16 or bf16 engines")
        if options.torch_artifact not in ARTIFACTS:
            raise ParastreamError(f"--torch-artifact {options.torch_artifact}: the torch backend ships {', '.join(ARTIFACTS)}")
        if options.torch_artifact == "inductor":
            inductor_format(options)  # refused here, before anything compiles
        self.options = options
        self.artifact = options.torch_artifact
        self._report: dict[str, dict] = {}
        self.keys: list[str] = []  # the cache keys of the last ``_jobs`` call's items

    def build(self, branch: onnx.ModelProto, name: str, layout: dict | None = None) -> bytes:
        return self.build_all([(branch, name, layout)])[0]

    def waits_for_background(self, items: list[tuple[onnx.ModelProto, str, dict | None]]) -> bool:
        if not _INFLIGHT:  # nothing compiles in the background: no branch keyed for that (every load asks)
            return False
        _, todo, _ = self._jobs(items, wait=False)
        return not todo and any(k in _INFLIGHT for k in self.keys)

    def build_all(self, items: list[tuple[onnx.ModelProto, str, dict | None]]) -> list[bytes]:
        out, todo, groups = self._jobs(items)
        t0 = time.perf_counter()
        compiled, failed = self._compile(todo, groups)
        return self._finish(items, out, compiled, failed, t0)

    def _jobs(self, items: list[tuple[onnx.ModelProto, str, dict | None]], wait: bool = True,
              defer_checks: bool = False) -> tuple[list, dict[str, tuple], dict[str, list[str]]]:
        """(one entry per item: its engine bytes, or what to pack once compiled; key -> compile job for each
        distinct branch that no cache holds; structure -> keys that one process compiles in turn).  A branch
        that a background ``precompile`` is compiling is waited for (``wait``) or left to it.  ``self.keys``: the
        cache key of every compiled item, in order (``precompile`` hands them on).  ``defer_checks``: the
        conversion of each branch to compile (the check that the converter runs it) is left in
        ``self.deferred_checks`` for the caller to run once the jobs are handed to the workers."""
        from .onnx_torch import conv_kernels_change, convert

        self.keys = []
        self.deferred_checks = []
        device = self.options.device
        built = built_for(device)
        out: list = []
        todo: dict[str, tuple] = {}  # key -> compile job (one per distinct branch)
        groups: dict[str, list[str]] = {}  # the jobs one process compiles in turn (``_compile``)
        for branch, name, layout in items:
            t0 = time.perf_counter()
            # --keep-fp32: a branch holding a pinned node computes in fp32 (its engine casts at its boundaries)
            pinned = fp32_pinned(branch, self.options.keep_fp32)
            dtype = "float32" if pinned else compute_dtype(self.options.precision, device)
            fuse = _fuse(device, dtype, self.options)
            onnx_bytes, digest = _serialized(branch)

            def converted(branch=branch, digest=digest, name=name, t0=t0) -> None:
                """The branch converted to torch (its steps counted for the report), once per process: a branch
                the converter cannot run fails the batch here, by name.  Only a branch that is compiled or
                shipped as ONNX is converted: a cached one was when it was compiled (a rebuild from --cache-dir
                converted all of ViT-B/16's 13 engines, 0.1-0.2 s each, to count their steps)."""
                steps = _CONVERTED.get(digest)
                if steps is None:  # a branch converted before in this process (the search's candidates share most)
                    try:
                        steps = len(convert(branch, "float32")._steps)
                    except ParastreamError as e:
                        raise type(e)(f"{name}: {e}") from None  # the batch names the branch that failed
                    if len(_CONVERTED) > 4096:
                        _CONVERTED.clear()
                    _CONVERTED[digest] = steps
                self._report[name].update(torch_steps=steps, convert_s=round(time.perf_counter() - t0, 4))

            ops: dict[str, int] = {}
            for n in branch.graph.node:
                ops[n.op_type] = ops.get(n.op_type, 0) + 1
            rep = {"nodes": len(branch.graph.node), "torch_steps": _CONVERTED.get(digest), "ops": ops,
                   "compile": bool(self.options.compile), "precision": self.options.precision, "compiled": None}
            self._report[name] = rep
            if pinned:
                rep["fp32_pinned"] = pinned
            if layout is None or not self.options.compile or self.artifact == "jit":
                converted()
                out.append(pack({"format": ENGINE_FORMAT, "compiled": None, **({"dtype": dtype} if pinned else {})},
                                onnx_bytes, None))
                continue
            inputs, outputs = list(layout["inputs"]), list(layout["outputs"])
            nhwc, views, sig = _layout(inputs, outputs, device, layout.get("internal_nhwc"), layout.get("channel_views"))
            choices = code_choices(branch, sig, dtype, self.options, fuse, built, self.artifact)
            key = cache_key(branch, sig, dtype, self.options, fuse, built, self.artifact, digest=digest, choices=choices)
            self.keys.append(key)
            package, where = cache_get(key, self.options.cache_dir)
            job = _INFLIGHT.get(key)  # (read once: a worker's callback or ``drop`` may remove it meanwhile)
            if package is None and job is not None:
                if not wait:
                    continue
                job.wait()  # compiled by a worker already on it (a cancelled or dropped one leaves it to us)
                package, where = cache_get(key, self.options.cache_dir)
                where = "memory (compiled in the background)" if package is not None else where
            if package is None and key not in todo and key not in _FAILED:
                if defer_checks:
                    self.deferred_checks.append(converted)
                else:
                    converted()
                todo[key] = (self.artifact, onnx_bytes, inputs, outputs, device, dtype, nhwc, views, self.options)
                if len(_NODES) > 65536:
                    _NODES.clear()
                _NODES[key] = len(branch.graph.node)
                # an AOTInductor package embeds its weights: nothing to share, every job its own group
                group = compile_group(branch, sig, choices) if self.artifact == "inductor" else key
                groups.setdefault(group, []).append(key)
            compiled_as = _COMPILED[self.artifact]
            rep.update(compiled=compiled_as, cache=where, key=key[:16])  # miss: compiled by this build
            # a fusion the branch has no node for is recorded null, and conv_kernels left out where it has no
            # convolution it lowers: the engine is the same either way (one cache key), and either choice loads it
            applies = choices_that_apply(branch)
            meta = {"format": ENGINE_FORMAT, "compiled": compiled_as, "built_for": built, "dtype": dtype,
                    "fuse_conv_relu": fuse if applies["fuse_conv_relu"] else None,
                    **({"conv_relu_unfused": unfused} if applies["fuse_conv_relu"] and fuse
                       and (unfused := conv_relu_unfused_in(branch, self.options)) else {}),
                    **({"conv_channels_padded": padded} if applies["fuse_conv_relu"] and fuse
                       and (padded := conv_channels_padded_in(branch, self.options)) else {}),
                    "fuse_attention": bool(self.options.fuse_attention) if applies["fuse_attention"] else None,
                    **({"conv_kernels": conv_kernels_used(self.options.conv_kernels)} if conv_kernels_change(branch) else {}),
                    "fuse_gemm_epilogue": bool(self.options.fuse_gemm_epilogue) if applies["fuse_gemm_epilogue"] else None,
                    "optimization_level": int(self.options.optimization_level), "signature": sig,
                    "key": key}
            out.append((key, name, meta, onnx_bytes, package))
        return out, todo, groups

    def _finish(self, items: list, out: list, compiled: dict[str, bytes], failed: dict[str, str], t0: float) -> list[bytes]:
        for i, item in enumerate(out):
            if isinstance(item, bytes):
                continue
            key, name, meta, onnx_bytes, package = item
            if key not in failed and key in _FAILED and package is None and key not in compiled:
                failed[key] = _FAILED[key]  # failed in an earlier batch of this process (``precompile``)
            if key in failed:  # Inductor could not compile it: the ONNX ships, compiled at every load (reported)
                self._report[name].update(compiled=None, aot_error=failed[key])
                out[i] = pack({"format": ENGINE_FORMAT, "compiled": None, "aot_error": failed[key]}, onnx_bytes, None)
                continue
            # a hit, or compiled by this batch (once per distinct branch); packed once per process
            with _CACHE_LOCK:
                packed = _PACKED.get(key)
                if packed is not None:
                    _PACKED.move_to_end(key)
            if packed is None:
                package, extra, weights = _split_entry(package or compiled[key])
                reused = extra.pop("code_reused", False)  # the report's, not engine.json's: the same file either way
                full = dict(meta, **extra)
                # what shipped: "kernels", or Inductor's own artifact and why not kernels
                shipped = {"compiled": full["compiled"], **({"kernels_error": full["kernels_error"]}
                                                            if "kernels_error" in full else {}),
                           **({"code_reused": True} if reused else {}),
                           # the cuDNN plans its kernels artifact ships, where it has any; kernels its code runs
                           # on its weights alone at every call (none expected) and the weights they read
                           **{k: v for k, v in (full.get("kernels") or {}).items()
                              if k in ("cudnn_plans", "weight_only_kernels", "weight_only_reads") and v}}
                packed = (pack(full, onnx_bytes, package, weights), len(package), shipped)
                with _CACHE_LOCK:
                    lru_put(_PACKED, key, packed, CACHE_BYTES // 2)
            self._report[name].update(packed[2], package_bytes=packed[1])
            out[i] = packed[0]
        for item in items:  # the compile time is the batch's (its packages compile side by side)
            if self._report[item[1]].get("cache") == "miss":
                self._report[item[1]]["compile_batch_s"] = round(time.perf_counter() - t0, 3)
        return out

    def _compile(self, todo: dict[str, tuple], groups: dict[str, list[str]]) -> tuple[dict[str, bytes], dict[str, str]]:
        """Compile the jobs (in worker processes when there are several and workers to spare); cache each package.

        ``groups`` (group -> keys, ``compile_group``) are compiled one after another in one process: branches
        with the same structure and code choices, whose Inductor graphs are the same (the weights are graph
        inputs), so that all but the first are hits in that process's Inductor caches.  Returns (key -> cache entry, key -> why it failed):
        a branch Inductor cannot compile does not fail the build, its engine stays ONNX compiled at load, and
        the report and verification say so."""
        if not todo:
            return {}, {}
        workers = min(compile_workers(self.options), len(groups))
        results: dict[str, bytes | str] = {}
        if workers > 1:
            pool = _pool(compile_workers(self.options))
            # the longest groups first (a group's first branch compiles, the rest are mostly Inductor cache hits):
            # a large branch started last would hold the batch up while every other worker idles
            order = sorted(groups, key=lambda g: -_work(todo, groups[g]))
            futures = {g: pool.submit(_compile_group, [todo[k] for k in groups[g]]) for g in order}
            for g, f in futures.items():
                try:
                    results.update(zip(groups[g], f.result()))
                except Exception as e:  # noqa: BLE001 - a worker that died: reported per branch
                    results.update((k, _failure(e)) for k in groups[g])
        else:
            for ks in groups.values():
                results.update(zip(ks, _compile_group([todo[k] for k in ks])))
        _store_results(results, self.options.cache_dir)
        done = {k: r for k, r in results.items() if not isinstance(r, str)}
        return done, {k: r for k, r in results.items() if isinstance(r, str)}

    def report(self) -> dict:
        return self._report

    def close(self) -> None:
        pass


def precompile(batches: list[tuple["Builder", list[tuple[onnx.ModelProto, str, dict | None]]]], *,
               background: bool = False, cancellable: bool = True, order: str = "auto", label: str = "") -> dict:
    """Compile, in one batch over every worker, what ``builder.build_all(items)`` would compile for each
    (builder, items) pair, and keep it in the compiled-branch cache: the later ``build_all`` calls are hits.

    A GPU build loads several plans in turn (the input and the search's candidates, each alternative it times);
    compiled one plan at a time, each batch waits for its slowest branch while the other workers idle.
    ``background``: return at once while the workers compile, the batches' jobs queued in the order given
    (the search measures its candidates in that order: the first is compiled first, and a ``build_all`` that
    needs a branch still compiling waits for it); with one worker, nothing is compiled ahead.
    ``cancel_precompile()`` drops the ``cancellable`` ones that have not started.  ``order`` places the jobs in the
    queue (``_submit``: "auto", "search" or "now").  Returns {"jobs", "failed", "s"} (``background``: jobs
    queued, and ``keys``: each batch's cache keys, for ``compiling``)."""
    t0 = time.perf_counter()
    todo: dict[str, tuple] = {}
    groups: dict[str, list[str]] = {}
    first = None
    if background and batches and compile_workers(batches[0][0].options) <= 1:
        return {"jobs": 0, "failed": 0, "s": 0.0, "background": "one compile worker: compiled when measured"}
    batch_keys: list[list[str]] = []
    checks: list = []
    for builder, items in batches:
        if builder.artifact == "jit" or not builder.options.compile:
            batch_keys.append([])
            continue
        first = first or builder
        _, t, g = builder._jobs(items, wait=not background, defer_checks=background)
        batch_keys.append(builder.keys)
        checks += builder.deferred_checks
        for k, job in t.items():
            todo.setdefault(k, job)
        for gk, keys in g.items():  # a key's group is its structure and code choices: the same in every batch
            into = groups.setdefault(gk, [])
            into.extend(k for k in keys if k not in into)
    if first is None or not todo:
        got = {"jobs": 0, "failed": 0, "s": round(time.perf_counter() - t0, 3)}
        return dict(got, keys=batch_keys) if background else got
    if background:
        _submit(todo, groups, first.options.cache_dir, cancellable, compile_workers(first.options), order=order,
                label=label)
        if first.options.device == "cuda":
            _import_runtime_in_background(caller_converts=True)
        # each branch handed to the workers is converted here only now, the check that names a branch the
        # converter cannot run: converting NASNet-A Large's 332 (and the first conversion's imports: its meta
        # runs import dynamo) was ~2 s of the build's main thread, which the workers waited for before their
        # first job.  A branch that fails raises here, by name, as it did before its job was queued
        for check in checks:
            check()
        return {"jobs": len(todo), "groups": len(groups), "background": True, "s": round(time.perf_counter() - t0, 3),
                "keys": batch_keys}
    _, failed = first._compile(todo, groups)
    return {"jobs": len(todo), "failed": len(failed), "s": round(time.perf_counter() - t0, 3)}


_RUNTIME_IMPORT: list = []
#: when each of those threads started and ended (``time.perf_counter()``), for bench/engine_artifacts.py's timeline
RUNTIME_IMPORT_TIMES: dict[str, tuple[float, float]] = {}


def _import_runtime_in_background(caller_converts: bool = False) -> None:
    """Import what loading an Inductor artifact imports (Inductor's code cache, AOTAutograd's cache, the Triton
    kernel wrappers and templates) in one thread, and hash Triton (its sources and libtriton, the key of its
    caches and of Inductor's autotuning) in another, once per process.  Both were ~2.5 s of a fresh process's
    first load of compiled engines (H100, Inception-v4: the imports, Triton's hash and its launcher helper built
    into an empty Triton cache), all of it one-time work that need not wait: a load starts them before it hashes
    the bundle's files (``prepare_load``), a GPU build while it waits for its compile workers.  The hash reads and
    digests ~0.5 GB and waits for ptxas and the C compiler, so it runs beside the imports rather than after them;
    imports take Python's import lock, so a load that needs a module being imported waits for it rather than
    importing it twice.

    ``caller_converts``: the calling thread converts branches next (a build's checks, ``precompile``), and imports
    ``torch._dynamo`` itself first (or, where the imports here started before, waits for them).  A conversion's
    meta run imports dynamo, whose import imports Inductor's modules, while the imports here go from Inductor's
    modules to dynamo: two threads entering that cycle from
    opposite ends leave one of them with a partially initialized module (Python breaks the deadlock so), and a
    branch failed its check, "torch cannot run it as converted: ... partially initialized module" (a fresh
    process's first GPU build of a NASNet cell, twice in two on the H200; on a 2-core CPU about one fresh process
    in three).  The conversions import dynamo anyway; what runs here beside them is then the rest, and Triton's
    hash."""
    running = next((t for t in _RUNTIME_IMPORT if t.name == "parastream-import-inductor"), None)
    if caller_converts:
        if running is not None:  # started before (a load's, an earlier batch's): its imports whole, first
            running.join()
        else:
            try:
                import torch._dynamo  # noqa: F401
            except Exception:  # noqa: BLE001 - another torch: the conversion reports what it lacks itself
                pass
    if running is not None:
        return

    def imports():
        import importlib

        for name in ("torch._inductor.standalone_compile", "torch._inductor.codecache",
                     "torch._functorch._aot_autograd.autograd_cache", "torch._higher_order_ops.triton_kernel_wrap",
                     "torch._inductor.runtime.triton_heuristics", "torch._inductor.select_algorithm"):
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - another torch: the load imports what it needs itself
                pass

    def triton_hash():
        # Triton's key (cached by Triton for the process) and its CUDA driver's helper module (built into an
        # empty Triton cache with the C compiler).  Neither touches a device: a thread's current device is
        # device 0, which need not be the one this process loads onto.  Not through torch.utils._triton, whose
        # first import of torch._inductor would wait for the imports above.
        try:
            try:
                from triton.runtime.cache import triton_key
            except ImportError:
                from triton.compiler.compiler import triton_key
            triton_key()
            from triton.runtime.driver import driver

            driver.active  # noqa: B018 - creating the driver builds (or finds) its helper module
        except Exception:  # noqa: BLE001 - no Triton, or another one: Inductor hashes it when it needs to
            pass

    def timed(fn):
        def run():
            t0 = time.perf_counter()
            try:
                fn()
            finally:
                RUNTIME_IMPORT_TIMES[threading.current_thread().name] = (t0, time.perf_counter())
        return run

    hashed = threading.Thread(target=timed(triton_hash), name="parastream-hash-triton", daemon=True)
    t = threading.Thread(target=timed(imports), name="parastream-import-inductor", daemon=True)
    _RUNTIME_IMPORT.extend([hashed, t])
    hashed.start()
    t.start()


def _import_torch_in_background() -> None:
    """torch itself, in a thread, when a process opens a GPU bundle before importing it (Triton's model.py: 1.5-2 s
    of an instance's initialize on the H100): its import then runs while the bundle's files are hashed, and the
    load's own ``import torch`` waits for it rather than starting again (Python's per-module import locks)."""
    import sys

    if "torch" in sys.modules or any(t.name == "parastream-import-torch" for t in _RUNTIME_IMPORT):
        return

    def run():
        t0 = time.perf_counter()
        try:
            import torch  # noqa: F401
        except Exception:  # noqa: BLE001 - the load reports a missing or broken torch itself
            pass
        finally:
            RUNTIME_IMPORT_TIMES["parastream-import-torch"] = (t0, time.perf_counter())

    t = threading.Thread(target=run, name="parastream-import-torch", daemon=True)
    _RUNTIME_IMPORT.append(t)
    t.start()


def prepare_load(manifest: dict, report: dict | None = None) -> None:
    """Called by ``Bundle.open(..., loading=True)`` before it hashes the bundle's files: a GPU bundle that ships
    Inductor's own artifacts (report.json's ``engines``: ``compiled`` "inductor"; a report without that list is
    taken to) starts Inductor's one-time runtime imports meanwhile.  "kernels" engines need none of it: importing
    it anyway only competed with their load for the interpreter (H100, Inception-v4: 3.9 s instead of ~2.5)."""
    if not str(manifest.get("device", "")).startswith("cuda"):
        return
    _import_torch_in_background()
    engines = (report or {}).get("engines")
    if isinstance(engines, dict) and not any(isinstance(e, dict) and e.get("compiled") == "inductor"
                                             for e in engines.values()):
        return
    _import_runtime_in_background()


def _work(todo: dict[str, tuple], keys: list[str]) -> float:
    """A group's compile work, to start the longest first: its first branch's nodes (the rest of a group are mostly
    Inductor cache hits in the same worker)."""
    import onnx

    n = _NODES.get(keys[0])
    if n is None:
        n = len(onnx.load_from_string(todo[keys[0]][1]).graph.node)
    return n * (1 + 0.2 * (len(keys) - 1))


#: cache key -> nodes of its branch (``_jobs`` notes them: ``_work`` need not parse the branch again)
_NODES: dict[str, int] = {}


def _store_results(results: dict[str, bytes | str], cache_dir: str | None) -> None:
    """Compile results into the compiled-branch cache, failures (their reasons) into ``_FAILED``."""
    for k, r in results.items():
        if isinstance(r, str):
            _FAILED[k] = r
        else:
            _cache_put(k, r, cache_dir)


class _Inflight:
    """A group of compile jobs queued for or running in the workers: ``wait()`` returns once its results are in the
    cache (or it was cancelled before it started)."""

    def __init__(self, keys: list[str], jobs: list[tuple], cache_dir: str | None, cancellable: bool, seq: int,
                 label: str = ""):
        self.keys, self.jobs, self.cache_dir, self.cancellable, self.label = keys, jobs, cache_dir, cancellable, label
        # the search's candidates (cancellable) before what the build needs only after the search: a candidate
        # measured next must not wait behind the alternatives' compiles; a group someone waits for goes first
        self.priority, self.seq = (0 if cancellable else 1), seq
        self.done = threading.Event()
        self.future = None
        self.nodes = max((_NODES.get(k, 0) for k in keys), default=0)
        self.t_queued, self.t_started, self.started_spare = time.perf_counter(), None, False

    def wait(self) -> None:
        with _QUEUE_LOCK:
            self.priority = -1
        _pump()
        self.done.wait()

    def store(self, future) -> None:  # the future's callback (the pool's thread): results into the cache, then done
        try:
            results = future.result()
        except BaseException as e:  # noqa: BLE001 - cancelled or a dead worker: the waiter compiles or reports it
            results = None if future.cancelled() else [_failure(e)] * len(self.keys)
        if results is not None and self.t_started is not None:
            with _QUEUE_LOCK:
                lru_put(_DONE, self.seq, (self.nodes, len(self.keys), self.t_queued, self.t_started,
                                           time.perf_counter(), self.label, self.started_spare), 4096)
        _store_results(dict(zip(self.keys, results or [])), self.cache_dir)
        self._finish()
        with _QUEUE_LOCK:
            _RUNNING[0] -= 1
        _pump()

    def _finish(self) -> None:
        for k in self.keys:
            if _INFLIGHT.get(k) is self:
                del _INFLIGHT[k]
        self.done.set()


#: cache key -> the group compiling it in the background (``precompile(background=True)``)
_INFLIGHT: dict[str, _Inflight] = {}
#: background groups not handed to the workers yet, and how many are running: at most one group per worker is
#: in the pool at a time (``_pump``), so that the order of the rest can still change (``_Inflight.priority``)
_QUEUED: list[_Inflight] = []
_RUNNING = [0]
_QUEUE_LOCK = threading.RLock()
_SEQ = itertools.count()


#: background groups compiled, by sequence: (nodes of the largest branch, branches, queued, started, done, what for,
#: whether it started as spare work)
_DONE: SizedLRU = SizedLRU(size=lambda v: 1)
#: a build of at most this many background groups (one-engine models: each group a whole-model compile) reports
#: each one's queueing, start and end (``background_summary``'s ``timeline``): what its rounds waited for
TIMELINE_GROUPS = 40


def background_summary(since: float) -> dict:
    """The background compiles finished after ``since`` (perf_counter), for the build report: how many, the
    longest (its seconds, branches and nodes) and when the last one ended, in seconds after ``since``; and per
    what they were queued for (``precompile``'s ``label``: the input, the search's candidates, a round's
    alternatives, ...) the groups, branches, worker seconds and when the first started and the last ended, which
    say what kept the workers busy when."""
    with _QUEUE_LOCK:
        done = [v for v in _DONE.values() if v[2] >= since]
    ready = _workers_ready(since)
    if not done:
        return {"groups": 0, **({"workers_ready": ready} if ready else {})}
    longest = max(done, key=lambda v: v[4] - v[3])
    by_label: dict = {}
    for v in done:
        got = by_label.setdefault(v[5] or "other", {"groups": 0, "branches": 0, "worker_s": 0.0,
                                                   "first_started_s": v[3] - since, "last_done_s": v[4] - since})
        got["groups"] += 1
        got["branches"] += v[1]
        got["worker_s"] += v[4] - v[3]
        got["first_started_s"] = min(got["first_started_s"], v[3] - since)
        got["last_done_s"] = max(got["last_done_s"], v[4] - since)
    return {"groups": len(done), "branches": sum(v[1] for v in done), **({"workers_ready": ready} if ready else {}),
            "longest": {"s": round(longest[4] - longest[3], 2), "branches": longest[1], "nodes": longest[0],
                        "started_s": round(longest[3] - since, 2)},
            "last_done_s": round(max(v[4] for v in done) - since, 2),
            "by_label": {k: {n: round(x, 2) if isinstance(x, float) else x for n, x in g.items()}
                         for k, g in by_label.items()},
            **({"timeline": [{"label": v[5] or "other", "branches": v[1], "nodes": v[0],
                              "queued_s": round(v[2] - since, 2), "started_s": round(v[3] - since, 2),
                              "done_s": round(v[4] - since, 2), "spare": bool(v[6])}
                             for v in sorted(done, key=lambda v: v[3])]} if len(done) <= TIMELINE_GROUPS else {})}


def _submit(todo: dict[str, tuple], groups: dict[str, list[str]], cache_dir: str | None, cancellable: bool,
            workers: int | None = None, order: str = "auto", label: str = "") -> None:
    """Queue the groups (a later call's after an earlier one's, the longest of each call first).  Of what is needed
    only after the search (not ``cancellable``), the longest group starts at once: it ends the build's wait for
    its compiles (a whole-model engine compiles for most of a minute in one worker), and it takes one worker of
    many from the search.  That is ``order`` "auto"; "search": kept, but queued with the search's candidates, in
    the order queued (the input, which the search measures first, and what is timed right after it); "now":
    before everything queued (a compile the build waits for, queued late); "spare": after everything, and started
    only while at most half the workers are busy (``SPARE``: what the build may never need, such as the rounds'
    alternatives for a round that has not flipped), until someone waits for it."""
    if order not in ("auto", "search", "now", "spare"):
        raise ValueError(f"order={order!r}: auto, search, now or spare")
    groups_by_work = sorted(groups.values(), key=lambda keys: -_work(todo, keys))
    with _QUEUE_LOCK:
        for i, keys in enumerate(groups_by_work):
            job = _Inflight(keys, [todo[k] for k in keys], cache_dir, cancellable, seq=next(_SEQ), label=label)
            if order == "now" or (order == "auto" and not cancellable and i == 0 and len(groups_by_work) > 1):
                job.priority = -0.5
            elif order == "search":
                job.priority = 0
            elif order == "spare":
                job.priority = SPARE
            for k in keys:
                _INFLIGHT[k] = job
            _QUEUED.append(job)
        _WORKERS[0] = compile_workers() if workers is None else workers
    _pump()


#: the workers of the last background batch (``_submit``: its builders' options): what ``_pump`` fills
_WORKERS = [1]


#: the priority of a group queued with ``order="spare"``: after every other, and only into spare workers (``_pump``)
SPARE = 2


def _pump() -> None:
    """Hand queued groups to the workers, the most urgent first, while a worker is free; a spare group (``SPARE``)
    only while at most half the workers are busy.  Why: the workers share the host's cores, and a whole-model
    compile runs Inductor's own compile pool besides (``_compile_job``), so that every group started makes the
    others slower.  ConvNeXt-T's one-engine build (H200, 16 cores) compiled its input's second-level alternatives
    (245 worker-seconds, none of them used) beside the search's candidates, which took 22 s each against 11 s for
    the input compiled before them, and the search measured 1 of its candidates in its budget."""
    with _QUEUE_LOCK:
        workers = _WORKERS[0]
        while _QUEUED and _RUNNING[0] < workers:
            _QUEUED.sort(key=lambda j: (j.priority, j.seq))
            if _QUEUED[0].priority >= SPARE and _RUNNING[0] >= max(1, workers // 2):
                break
            job = _QUEUED.pop(0)
            job.t_started = time.perf_counter()  # handed to a free worker: it starts now
            job.started_spare = job.priority >= SPARE
            _RUNNING[0] += 1
            job.future = _pool(workers).submit(_compile_group, job.jobs)
            job.future.add_done_callback(job.store)


def hasten(keys: list[str]) -> int:
    """The spare groups (``order="spare"``) that hold any of ``keys``, queued as needed after the search instead
    (the build will race them: a round they follow went the other way); returns how many."""
    wanted, n = set(keys), 0
    with _QUEUE_LOCK:
        for job in _QUEUED:
            if job.priority >= SPARE and wanted.intersection(job.keys):
                job.priority, n = 1, n + 1
    if n:
        _pump()
    return n


def drop(keys: list[str]) -> int:
    """Drop the queued groups (not started) whose every cache key is one of ``keys``: the
    rivals of a GPU build's rounds that a decided round made moot (``pipeline.measure.QueuedRivals``), which would
    otherwise take workers from the rivals still needed.  A group that also compiles a key not given is kept (the
    same engine in a plan still raced), and a ``build_all`` waiting for a dropped one compiles it itself.  Returns
    how many were dropped; one started runs to its end."""
    unwanted, n = set(keys), 0
    with _QUEUE_LOCK:
        for job in [j for j in _QUEUED if j.priority > -1 and unwanted.issuperset(j.keys)]:
            _QUEUED.remove(job)
            job._finish()
            n += 1
    return n


def compiling(keys: list[str]) -> int:
    """How many of these cache keys a background ``precompile`` is still compiling (queued or running)."""
    with _QUEUE_LOCK:
        return sum(k in _INFLIGHT for k in keys)


def cancel_precompile() -> int:
    """Drop the background compiles that have not started (the search's budget is spent), the search's candidates
    and the spare groups no one hastened or waited for (``order="spare"``: the build queues again, with its
    engines, the alternatives its own rounds will race, rather than leave them to start when the workers idle,
    after the build has no use for them and before its process can exit); returns how many."""
    n = 0
    with _QUEUE_LOCK:
        for job in [j for j in _QUEUED if j.cancellable or j.priority >= SPARE]:
            _QUEUED.remove(job)
            job._finish()
            n += 1
        running = {id(j): j for j in _INFLIGHT.values() if j.future is not None}.values()
    for job in running:
        if job.cancellable and job.future.cancel():  # handed to the pool, not started: its callback finishes it
            n += 1
    return n


def _wrap(ptr: int, spec: TensorSpec, nhwc: bool, view: tuple[int, int] | None = None, device: int | None = None):
    """A torch tensor over launcher memory at ``ptr`` on GPU ``device`` (no copy), NCHW-shaped, channels-last
    strided if ``nhwc``.  ``device`` None: the memory's own, asked of the pointer.

    With ``view = (total, c0)``, ``ptr`` is a channels-last buffer of ``total`` channels and the
    tensor is its channels ``[c0, c0 + C)``.
    """
    from ..cuda import DeviceArray

    if nhwc:
        n, c, h, w = spec.shape
        total, c0 = view if view is not None else (c, 0)
        t = DeviceArray(ptr, (n, h, w, total), spec.dtype, device=device).torch()  # on the memory's device, never a copy
        return t[..., c0:c0 + c].permute(0, 3, 1, 2)
    return DeviceArray(ptr, spec.shape, spec.dtype, device=device).torch()


def _first_call_unchecked(loaded: bool):
    """Around a loaded artifact's first call: without AOTAutograd's custom-op aliasing check, which runs that
    call under a Python dispatch mode to see whether custom operators alias their inputs (torch 2.11+,
    ``check_custom_op_aliasing``).  An engine calls no custom operator (aten's, its Triton kernels), so the check
    has nothing to find, and it was ~0.3 s of a 100-branch load (H100, profiled)."""
    if not loaded:
        return contextlib.nullcontext()
    try:
        from torch._functorch import config  # imported already by the artifact's load
    except ImportError:
        return contextlib.nullcontext()
    if not hasattr(config, "check_custom_op_aliasing"):
        return contextlib.nullcontext()
    return config.patch(check_custom_op_aliasing=False)


class TorchEngine:
    """One branch: the compiled package when it was compiled for this layout, else the ONNX compiled now."""

    def __init__(self, data: bytes, inputs: list[TensorSpec], outputs: list[TensorSpec], device: str,
                 options: BuildOptions, internal_nhwc: set[str] | None = None,
                 channel_views: dict[str, tuple[int, int]] | None = None, warm: bool = True,
                 model_weights: Callable | None = None):
        import torch

        self.inputs = inputs
        self.outputs = outputs
        self.device = device
        self.options = options
        self.nhwc, self.channel_views, sig = _layout(inputs, outputs, device, internal_nhwc, channel_views)
        t0 = time.perf_counter()
        #: seconds of this engine's load by phase (bench/engine_artifacts.py sums them over a bundle)
        self.phases: dict[str, float] = {}
        engine = EngineFile(data)
        meta = self.meta = engine.meta
        # a branch pinned to fp32 (--keep-fp32) records its dtype; the others compute in the precision's
        self.dtype = "float32" if meta.get("dtype") == "float32" else compute_dtype(options.precision, device)
        self._tdtype = getattr(torch, self.dtype)
        # the compiled code is read (inflated) when it is loaded, and not where this process holds its artifact
        # loaded already (engines of one structure, a candidate's unchanged branches: 249 of NASNet-A Large's 332)
        package = engine.compiled if engine.has_compiled() else None
        self.phases["unpack"] = time.perf_counter() - t0
        if package is not None:
            check_built_for(meta.get("built_for", {}), device)
        fuse = _fuse(device, self.dtype, options)
        # Inductor's own artifact runs code that names the GPU it was compiled on (the build's current GPU, 0) in
        # its device guards and stream lookups, and no API re-targets it: on another GPU the engine is compiled
        # again from branch.onnx, as a jit engine is (a kernels artifact is re-targeted instead: inductor_kernels)
        elsewhere = meta.get("compiled") == "inductor" and device == "cuda" and torch.cuda.current_device() != 0
        #: why the engine compiles at load rather than loading its artifact ("" where it loads as built): the
        #: first difference between what the artifact was compiled for and what this load asks
        self.compiled_at_load_because = _compile_at_load_reason(
            package, meta, elsewhere=elsewhere, signature=sig, dtype=self.dtype, fuse_conv_relu=fuse, options=options)
        self.compiled_at_load = bool(self.compiled_at_load_because)
        self._runner = None
        self.module = None
        if not self.compiled_at_load and meta.get("compiled") in ("inductor", "kernels"):
            self._runner = _load_inductor(package, engine.weights_view, meta, device)
            self._fn = self._runner
            self.phases.update(self._runner.phases)
        elif not self.compiled_at_load:
            self._runner = _load_package(package(), torch.cuda.current_device() if device == "cuda" else -1)
            self._fn = self._run_package
        else:
            from .onnx_torch import convert, to_device_shared

            self.module = to_device_shared(convert(engine.branch_model(model_weights), self.dtype,
                                                   **converter_options(device, self.dtype, options)), device)
            self._fn = self._make_fn()
        self._streams: dict[int, object] = {}
        self._views: dict[tuple, list] = {}
        self.compile_s = 0.0
        self.compile_error: str | None = None  # torch.compile at load failed: the branch runs uncompiled (``warm``)
        self.phases["prepare"] = time.perf_counter() - t0
        self._shapes = str([t[1:] for t in sig])  # the tensors' dtypes, shapes and layouts; their names do not matter
        self._device_index = torch.cuda.current_device() if device == "cuda" else -1
        self.warmed = device != "cuda"
        art = getattr(self._runner, "artifact", None)
        if art is not None and not hasattr(art, "_parastream_warm_lock"):  # (made here, in the loading thread)
            art._parastream_warm_lock = threading.Lock()
        # warm=False (the launcher warms it on its branch's stream): only a "kernels" artifact, whose first call is
        # torch's operators and Triton launches; the others may compile or patch torch's global config on their
        # first call, so they warm here
        if device == "cuda" and (warm or self.compiled_at_load or meta.get("compiled") != "kernels"):
            self.warm()
        self.load_s = time.perf_counter() - t0

    def warm(self, stream_handle: int | None = None) -> None:
        """The engine's first call, on tensors with the launcher's shapes, dtypes and strides: JIT engines compile,
        and the libraries set up what the capture will record (cuDNN plans each convolution, kernels load).  On
        ``stream_handle`` when given (the launcher's warm-up: on the branch's stream, in the process's warm-up thread)."""
        import torch

        if self.warmed:
            return
        art = getattr(self._runner, "artifact", None)
        # engines that share an artifact, warmed by two threads (a launcher's warm-up thread, another's loading
        # thread): one runs it, the other finds it run
        with getattr(art, "_parastream_warm_lock", None) or contextlib.nullcontext():
            if art is not None and getattr(art, "_parastream_warmed", None) == self._shapes:
                # an artifact this process has run already for these tensors (branches of one structure, the
                # search's candidates reloading unchanged branches): its kernels are loaded, nothing to warm
                self.phases["warm"] = 0.0
            else:
                if torch.cuda.current_device() != self._device_index:  # a thread's device is its own
                    torch.cuda.set_device(self._device_index)
                stream = self._stream(stream_handle) if stream_handle else torch.cuda.current_stream()
                t0 = time.perf_counter()
                # a "kernels" engine has nothing left to compile or autotune: one call makes cuDNN and cuBLAS set
                # up what its capture will replay; the other kinds run twice (the first may still compile or autotune)
                calls = 1 if self.meta.get("compiled") == "kernels" else 2
                with torch.cuda.stream(stream), torch.no_grad(), _first_call_unchecked(self.meta.get("compiled") == "inductor"):
                    args = self._args()
                    try:
                        for _ in range(calls):
                            self._fn(*args)
                    except Exception as e:  # noqa: BLE001 - torch.compile raises what dynamo and Inductor raise
                        if self.module is None:  # a compiled artifact that does not run: the load's error
                            raise
                        # the branch compiled at load (its artifact could not be built) and torch.compile of it
                        # failed too: it runs as converted, uncompiled, and says so (``compile_error``)
                        self.compile_error = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
                        self._fn = _into_outputs(self.module, [t.name for t in self.inputs],
                                                 [t.name for t in self.outputs], self._tdtype)
                        try:
                            for _ in range(calls):
                                self._fn(*args)
                        except Exception as again:  # noqa: BLE001 - the converted branch itself does not run
                            raise ParastreamError(f"the torch engine of {[t.name for t in self.outputs][:3]} does not "
                                                  f"run: {type(again).__name__}: {str(again).strip()[:300]}") from None
                stream.synchronize()
                self.compile_s = time.perf_counter() - t0
                self.phases["warm"] = self.compile_s
                if art is not None:
                    art._parastream_warmed = self._shapes
        self.warmed = True

    def _stream(self, stream_handle: int):
        import torch

        stream = self._streams.get(stream_handle)
        if stream is None:  # the launcher's stream is on this engine's device, whichever device is current
            stream = self._streams[stream_handle] = torch.cuda.ExternalStream(stream_handle, device=self._device_index)
        return stream

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
        return torch.compile(run_into, fullgraph=True, dynamic=False, options=_inductor_options(self.options))

    def _args(self, fill: bool = True) -> list:
        return [_tensor(t, t.name in self.nhwc, self.channel_views.get(t.name), self.device, fill=fill)
                for t in self.inputs + self.outputs]

    # -- GPU ---------------------------------------------------------------
    def enqueue(self, stream_handle: int, addresses: dict[str, int]) -> None:
        import torch

        key = tuple(addresses[t.name] for t in self.inputs) + tuple(addresses[t.name] for t in self.outputs)
        views = self._views.get(key)
        if views is None:
            views = [_wrap(addresses[t.name], t, t.name in self.nhwc, self.channel_views.get(t.name), self._device_index)
                     for t in self.inputs + self.outputs]
            self._views[key] = views
        with torch.no_grad(), torch.cuda.stream(self._stream(stream_handle)):
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

    def devices(self) -> set[int]:
        """The GPUs of what this engine holds: its weights (the module's parameters and buffers, or the artifact's
        weight tensors), its views of the launcher's buffers, the torch streams it wraps, its loaded kernels."""
        tensors = []
        if self.module is not None and hasattr(self.module, "parameters"):
            tensors += [*self.module.parameters(), *self.module.buffers()]
        tensors += list(getattr(self._runner, "params", None) or [])
        tensors += [t for views in self._views.values() for t in views]
        found = {t.device.index for t in tensors if t.device.type == "cuda"}
        found |= {s.device.index for s in self._streams.values()}
        art_device = getattr(getattr(self._runner, "artifact", None), "device", None)
        if isinstance(art_device, int):
            found.add(art_device)
        return found

    def close(self) -> None:
        self._views.clear()
        self._runner = None


def load(data: bytes, inputs: list[TensorSpec], outputs: list[TensorSpec], device: str = "cpu",
         options: BuildOptions | None = None, internal_nhwc: set[str] | None = None,
         channel_views: dict[str, tuple[int, int]] | None = None, warm: bool = True,
         model_weights: Callable | None = None) -> TorchEngine:
    """One branch's engine.  A GPU engine is warmed (its first call, ``TorchEngine.warm``) unless ``warm=False`` and
    it ships a "kernels" artifact: the launcher then warms it itself, on its branch's stream, in the thread that
    captures (torch's cuDNN plans are per thread).  ``model_weights``: name -> its bundle's model.onnx initializer,
    for an engine compiled again at this load whose weights the bundle keeps there (``slim_engine``)."""
    try:
        import torch
    except ImportError:
        raise BackendUnavailable("PyTorch is not installed: pip install torch cuda-python") from None
    options = options or BuildOptions()
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = options.precision == "tf32"
        torch.backends.cudnn.allow_tf32 = options.precision == "tf32"
    return TorchEngine(data, inputs, outputs, device, options, internal_nhwc, channel_views, warm=warm,
                       model_weights=model_weights)
