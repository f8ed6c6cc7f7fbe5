"""Inductor's compiled code, run without Inductor: the ``kernels`` artifact of a GPU torch engine.

What Inductor makes of a branch on the GPU is two things: a Python wrapper (its "output code": buffer
allocations, calls into aten/cuDNN/cuBLAS, launches of its Triton kernels) and the cubins of those Triton
kernels.  Loading Inductor's own artifact (``CompiledArtifact.load``) unpickles them through Inductor's
compiler, AOTAutograd's cache and Triton: ~1,500 modules and ~3 s of import in every fresh process on the H100
(bench/engine_artifacts.py ``importtime``), more than the whole load target.  This artifact holds the same two
things in a form that needs torch and nothing of Inductor or Triton at load:

- ``wrapper.py``: the output code exactly as Inductor wrote it, executed as it is.  Its imports of Inductor and
  Triton are answered by ``_import`` instead: the two names a wrapper calls when it runs (``AsyncCompile``,
  whose ``triton(name, ...)`` hands back the kernel of that name below, and ``extern_kernels``, whose functions
  are torch's own: ``torch.convolution``, ``torch.mm``, ... as the build checked) by small stand-ins, and
  anything else by a proxy that imports the real object only if it is ever called (none is, in the wrappers we
  build; the build records any that is: ``imports_at_run``).
- ``kernels.json`` and one cubin per Triton kernel: the kernel as Inductor's static launcher launches it
  (function name, warps, shared memory, argument types) and the launcher function Inductor generated for it
  (its arguments, those it passes to the cubin, its grid expressions), which ``_Kernel`` generates again.
  Loaded and launched by the same ``torch._C._StaticCudaLauncher`` that Inductor's own artifact uses.

The build compiles the branch with Inductor as before, runs it once (autotuning leaves one launch configuration
per kernel), takes the wrapper and the kernels from the compiled module (``extract``), loads them back the way
every load does, runs them on the same tensors and requires outputs equal bit for bit to Inductor's own; only
then does this artifact ship (else Inductor's bundled artifact does, and engine.json says why).  The bundle's
verification then runs exactly these files.

Not written by hand for want of a library: Inductor has no loader for its output code that does not import
its compiler (``PyCodeCache`` lives in ``torch._inductor.codecache``), and AOTInductor, which has one, compiles
a C++ wrapper per branch with g++ at build (docs/torch-engines.md).
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import importlib
import importlib.util
import io
import json
import marshal
import os
import re
import tempfile
import threading
import types
import zipfile
from collections.abc import Sequence

from ..errors import ParastreamError

#: imports a wrapper makes that ``_import`` answers without importing them
INTERCEPTED = ("torch._inductor", "triton")
#: the two names a wrapper calls when it runs, answered by stand-ins
ASYNC_COMPILE = "torch._inductor.async_compile.AsyncCompile"
EXTERN_KERNELS = "torch._inductor.select_algorithm.extern_kernels"
#: kernels.json's format
FORMAT = 1
#: the member holding the cuDNN plans the engine's depthwise convolutions run (``cudnn_plans``), where it has any
PLANS = "cudnn_plans.npz"
#: the member holding the wrapper compiled to Python bytecode for the GPU the build ran it on (``wrapper_code``),
#: which a load on that GPU by the same Python runs instead of compiling wrapper.py again
WRAPPER_CODE = "wrapper.code"
#: the alignment Inductor's Triton kernels may assume of a pointer argument that had it when compiled
ALIGNMENT = 16


# -- load ------------------------------------------------------------------------------------------
def _resolve(path: str):
    """The real object at a dotted ``path`` (its longest importable prefix imported, the rest attributes)."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for p in parts[i:]:
            obj = getattr(obj, p)
        return obj
    raise ImportError(path)


class _Lazy:
    """A name a wrapper imports from Inductor or Triton: attribute access stays lazy (``import triton.language as
    tl`` takes one), a call imports the real object and is recorded in ``imported``."""

    def __init__(self, path: str, known: dict, imported: list):
        self._path, self._known, self._imported = path, known, imported

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        path = f"{self._path}.{attr}"
        return self._known[path] if path in self._known else _Lazy(path, self._known, self._imported)

    def __call__(self, *args, **kwargs):
        self._imported.append(self._path)
        return _resolve(self._path)(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<not imported: {self._path}>"


class _Externs:
    """``extern_kernels`` of a wrapper: each name the build found to be torch's own function of that name is that
    function; another name is Inductor's, imported when first used (and recorded)."""

    def __init__(self, torch_names: list[str], imported: list):
        self._torch_names, self._imported = set(torch_names), imported

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        if name in self._torch_names:
            import torch

            fn = getattr(torch, name)
        else:
            self._imported.append(f"{EXTERN_KERNELS}.{name}")
            fn = getattr(_resolve(EXTERN_KERNELS), name)
        setattr(self, name, fn)
        return fn


def _async_compile(kernels: dict):
    """``AsyncCompile`` of a wrapper: ``triton(name, source, ...)`` is the loaded kernel of that name (its source
    was compiled at build); ``wait`` has nothing to wait for; anything else is a kind of kernel this artifact
    cannot hold (the build then ships Inductor's own artifact)."""

    class AsyncCompile:
        def triton(self, name: str, *args, **kwargs):
            try:
                return kernels[name]
            except KeyError:
                raise ParastreamError(f"the engine's wrapper launches Triton kernel {name!r}, which its artifact "
                                      "does not hold; rebuild the bundle") from None

        def wait(self, scope: dict) -> None:
            pass

        def __getattr__(self, attr: str):
            raise ParastreamError(f"the engine's wrapper asks AsyncCompile.{attr}, which a kernels artifact cannot "
                                  "answer; rebuild the bundle")

    return AsyncCompile


def _importer(known: dict, imported: list):
    real = builtins.__import__

    def _import(name, globals=None, locals=None, fromlist=(), level=0):
        if level == 0 and any(name == p or name.startswith(p + ".") for p in INTERCEPTED):
            # ``from a.b import c`` gets module a.b; ``import a.b`` (with or without ``as``) gets a
            return _Lazy(name if fromlist else name.split(".")[0], known, imported)
        return real(name, globals, locals, fromlist, level)

    return _import


_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

#: where a wrapper names the GPU it was compiled on: Inductor writes ``with torch.cuda._DeviceGuard(0):``,
#: ``torch.cuda.set_device(0)`` and ``stream0 = get_raw_stream(0)`` around its allocations and launches
_DEVICE_CALL = re.compile(r"\b(torch\.cuda\._DeviceGuard|torch\.cuda\.set_device|get_raw_stream)\(\s*([0-9]+)\s*\)")


def on_device(source: str, device: int) -> str:
    """The wrapper ``source`` with the device it names in its device guards, ``set_device`` and stream lookups
    replaced by ``device``: the GPU the launcher loads it on, which need not be the one it was compiled on.
    Without this a wrapper compiled on GPU 0 and loaded for GPU 1 would allocate its buffers and launch its
    kernels on GPU 0's current stream.  A regular expression over generated code, for want of an Inductor API
    that re-targets output code (AOTInductor's ``device_index`` does it for its own packages only)."""
    return _DEVICE_CALL.sub(lambda m: f"{m.group(1)}({int(device)})", source)


def _compile_wrapper(source: str):
    """wrapper.py's code object; the build (``wrapper_code``) and the load compile it by this one call, so
    that the bytecode shipped is what the load would compile."""
    return compile(source, "<parastream wrapper>", "exec")


@functools.lru_cache(maxsize=64)
def wrapper_code(source: str, device: int) -> bytes:
    """The ``WRAPPER_CODE`` member: this Python's bytecode magic, ``device``, and the marshalled code of the wrapper
    as loaded on that GPU (``on_device``).  Compiling each wrapper was the largest share of a fresh load's Python
    that holds the interpreter lock (NASNet-A Large: 83 wrappers, ~0.2 s of its load on the H200, profiled); a
    marshalled code object loads in a fraction of that.  Another Python (its magic differs) or another GPU
    compiles wrapper.py as before.  Cached by source: branches of one structure, compiled one after another in one
    worker, get the same bytes (marshal's output can depend on reference counts), so that their artifacts stay
    one artifact by sha256 (``_load_inductor`` loads it once)."""
    return (importlib.util.MAGIC_NUMBER + int(device).to_bytes(4, "little")
            + marshal.dumps(_compile_wrapper(on_device(source, device))))


def _shipped_code(blob: bytes | None, device: int):
    """The wrapper's code object from its ``WRAPPER_CODE`` member where it was compiled by this Python for
    ``device``; else None (then wrapper.py is compiled)."""
    magic = importlib.util.MAGIC_NUMBER
    if not blob or blob[:len(magic)] != magic or int.from_bytes(blob[len(magic):len(magic) + 4], "little") != device:
        return None
    try:
        code = marshal.loads(blob[len(magic) + 4:])
    except (EOFError, ValueError, TypeError):  # damaged: the bundle's hashes would have said so; compile instead
        return None
    return code if isinstance(code, types.CodeType) else None


@functools.lru_cache(maxsize=4096)
def _launcher_code(source: str):
    """A launcher's code object, by its source: kernels of one shape and grid have the same launcher, and a
    bundle's engines share many (compiled once per process rather than once per kernel)."""
    return compile(source, "<parastream launcher>", "exec")


def launcher_source(spec: dict) -> str:
    """The launcher Inductor generated for a statically launched kernel (``_gen_launcher_code``), from what
    ``record_launcher`` kept: ``launcher(*args, stream)`` computes the grid and calls ``runner``."""
    def_args, runner_args = list(spec["def_args"]), list(spec["runner_args"])
    if not all(isinstance(a, str) and _IDENT.match(a) for a in def_args + runner_args):
        raise ParastreamError(f"kernel {spec.get('name')!r}: its launcher's arguments are not names; rebuild the bundle")
    grid = spec["grid"]
    lines = [f"def launcher({', '.join(def_args + ['stream'])}):",
             *[f"    {line}" for line in grid["prefix"]],
             f"    grid_0 = {grid['x']}", f"    grid_1 = {grid['y']}", f"    grid_2 = {grid['z']}",
             f"    runner({', '.join(runner_args)})"]
    return "\n".join(lines)


class _Kernel:
    """One Triton kernel loaded from its cubin; ``run(*args, stream=)`` is how the wrapper launches it."""

    def __init__(self, spec: dict, cubin_path: str, device: int, launch=None):
        self.name = spec["name"]
        scratch = int(spec.get("scratch", 0))
        arg_tys = spec["arg_tys"] + "O" * scratch
        extra = (None,) * scratch  # Triton's scratch pointers, which an Inductor kernel never uses (null)
        num_warps, shared = int(spec["num_warps"]), int(spec["shared"])
        if launch is None:
            from torch._C import _StaticCudaLauncher as launcher

            loaded = launcher._load_kernel(cubin_path, self.name, shared, device)
            # (function, regs, spills) in torch 2.11; (module, function, regs, spills) since
            self.handles = loaded
            function = loaded[-3]
            launch = launcher._launch_kernel
        else:  # tests: a stand-in for the launcher
            function = self.name

        def runner(grid_0, grid_1, grid_2, stream, *args):
            launch(function, grid_0, grid_1, grid_2, num_warps, shared, arg_tys, (*args, *extra), stream)

        scope = {"runner": runner}
        exec(_launcher_code(launcher_source(spec)), scope)  # noqa: S102 - generated from kernels.json's names
        self.run = scope["launcher"]


class KernelsArtifact:
    """A kernels artifact loaded: ``art(*args)`` calls the wrapper's ``call`` with the engine's flat arguments
    (weights, inputs, outputs); ``imported`` lists what it has had to import from Inductor or Triton (nothing,
    for what the build ships)."""

    def __init__(self, package: bytes, device: int, launch=None):
        try:
            z = zipfile.ZipFile(io.BytesIO(package))
            spec = json.loads(z.read("kernels.json"))
            source = z.read("wrapper.py").decode()
        except (zipfile.BadZipFile, KeyError, ValueError) as e:
            raise ParastreamError(f"not a readable kernels artifact ({e}); rebuild the bundle") from None
        if spec.get("format") != FORMAT:
            raise ParastreamError(f"kernels artifact format {spec.get('format')!r}, this parastream reads {FORMAT}; "
                                  "rebuild the bundle")
        self.imported: list[str] = []
        self.device = int(device)
        try:
            scope = self._load(z, spec, source, self.device, launch)
        except ParastreamError:
            raise
        except Exception as e:  # noqa: BLE001 - a damaged kernels.json, cubin or wrapper: one line, not a traceback
            raise ParastreamError(f"a damaged kernels artifact ({type(e).__name__}: {e}); rebuild the bundle") from None
        call = scope.get("call")
        if not callable(call):
            raise ParastreamError("the engine's wrapper defines no call(); rebuild the bundle")
        self.plans = self._plans(z)
        self._call = call
        self._aligned = [int(i) for i in spec.get("aligned", [])]

    def _plans(self, z: zipfile.ZipFile) -> dict | None:
        """The cuDNN plans the engine ships (``PLANS``: those its depthwise convolutions ran when it was built),
        offered to the process's plan cache (``cudnn_plans.CACHE.load``: each deserialized at its key's first call,
        those held already skipped), so that its first call builds none.  Without cuDNN's frontend the op is
        torch's convolution: nothing to load.  None when the engine ships none."""
        if PLANS not in z.namelist():
            return None
        from . import cudnn_plans

        if cudnn_plans.frontend() is None:
            return {"skipped": "no cuDNN frontend (nvidia-cudnn-frontend): torch's convolution runs them"}
        try:
            return cudnn_plans.CACHE.load(z.read(PLANS), self.device)
        except Exception as e:  # noqa: BLE001 - a plan that cannot be read is built at its first call instead
            return {"skipped": cudnn_plans.CACHE.refuse(f"{PLANS} not read ({type(e).__name__}: {str(e)[:200]})")}

    def _load(self, z: zipfile.ZipFile, spec: dict, source: str, device: int, launch) -> dict:
        """The kernels loaded and the wrapper (``source`` as the build wrote it) executed on ``device``: the
        wrapper's globals."""
        kernels = {}
        # the static launcher loads a cubin from a file: each one is written, loaded and removed
        with tempfile.TemporaryDirectory(prefix="parastream-cubins-") as d:
            for i, (name, k) in enumerate(spec["kernels"].items()):
                path = os.path.join(d, f"{i}.cubin")
                with open(path, "wb") as f:
                    f.write(z.read(k["cubin"]))
                kernels[name] = _Kernel(k, path, device, launch)
        self.kernels = kernels
        known = {ASYNC_COMPILE: _async_compile(kernels), EXTERN_KERNELS: _Externs(spec["extern_torch"], self.imported)}
        scope = {"__name__": "parastream_wrapper", "__builtins__": dict(vars(builtins), __import__=_importer(known, self.imported))}
        code = _shipped_code(z.read(WRAPPER_CODE) if WRAPPER_CODE in z.namelist() else None, device)
        if code is None:
            code = _compile_wrapper(on_device(source, device))
        exec(code, scope)  # noqa: S102 - the bundle's own code, hashed
        return scope

    def __call__(self, *args):
        for i in self._aligned:
            if args[i].data_ptr() % ALIGNMENT:
                raise ParastreamError(f"argument {i} of a compiled engine is not {ALIGNMENT}-byte aligned as it was "
                                      "when compiled; its kernels assume it")
        return self._call(list(args))


# -- build -----------------------------------------------------------------------------------------
_RECORDER: list = []
_RECORDER_LOCK = threading.Lock()


def install_recorder() -> None:
    """Once per process, before Inductor compiles anything: every statically launched Triton kernel keeps its
    cubin's bytes (``load_kernel`` drops them), and every launcher Inductor generates keeps what generated it
    (``_parastream``: ``record_launcher``), so that ``extract`` can take them from a compiled module."""
    with _RECORDER_LOCK:
        if _RECORDER:
            return
        from torch._inductor.runtime import triton_heuristics as th

        gen_owner = next(c for c in type.mro(th.StaticTritonCompileResult) if "_gen_launcher_code" in vars(c))
        gen = gen_owner._gen_launcher_code
        kernel_cls = _static_kernel_class()
        load_owner = next(c for c in type.mro(kernel_cls) if "load_kernel" in vars(c))
        load_kernel = load_owner.load_kernel

        def keep_cubin(self, *args, **kwargs):
            if getattr(self, "_parastream_cubin", None) is None:
                path = getattr(self, "cubin_path", None)
                raw = getattr(self, "cubin_raw", None)
                if path and os.path.exists(path):
                    with open(path, "rb") as f:
                        self._parastream_cubin = f.read()
                elif raw is not None:
                    self._parastream_cubin = bytes(raw)
            return load_kernel(self, *args, **kwargs)

        def gen_recording(self, scope, def_args, runner_args):
            launcher = gen(self, scope, def_args, runner_args)
            try:
                launcher._parastream = record_launcher(self, def_args, runner_args)
            except Exception as e:  # noqa: BLE001 - this kernel cannot ship in a kernels artifact: extract says why
                launcher._parastream = f"{type(e).__name__}: {e}"
            return launcher

        load_owner.load_kernel = keep_cubin
        gen_owner._gen_launcher_code = gen_recording
        _RECORDER.append((gen_owner, gen, load_owner, load_kernel))


def _static_kernel_class():
    try:
        from torch._inductor.runtime.static_triton_launcher import StaticallyLaunchedCudaKernel
    except ImportError:  # torch 2.11
        from torch._inductor.runtime.static_cuda_launcher import StaticallyLaunchedCudaKernel
    return StaticallyLaunchedCudaKernel


def record_launcher(result, def_args, runner_args) -> dict:
    """What ``launcher_source`` needs to generate the launcher Inductor generated for ``result`` (a
    ``StaticTritonCompileResult``), and the kernel as the static launcher launches it."""
    from torch._inductor.runtime import triton_heuristics as th

    if not isinstance(result, th.StaticTritonCompileResult):
        raise ParastreamError("launched by Triton's own launcher, not Inductor's static one")
    kernel = result.kernel
    cubin = getattr(kernel, "_parastream_cubin", None)
    if cubin is None:
        raise ParastreamError("its cubin was not kept")
    grid = th.GridExpr.from_meta(result.inductor_meta, result.config)
    scratch = int(bool(getattr(kernel, "has_global_scratch", False))) + int(bool(getattr(kernel, "has_profile_scratch", False)))
    return {"name": kernel.name, "num_warps": int(kernel.num_warps), "shared": int(kernel.shared),
            "arg_tys": kernel.arg_tys, "scratch": scratch, "def_args": list(def_args),
            "runner_args": list(runner_args),
            "grid": {"prefix": list(grid.prefix), "x": str(grid.x_grid), "y": str(grid.y_grid), "z": str(grid.z_grid)},
            "cubin_bytes": cubin}


def _reachable(root, stop=lambda o: False, limit: int = 20000, attributes: bool = True):
    """Objects reachable from ``root`` through partials, bound methods, closures and ``__wrapped__`` and, with
    ``attributes``, containers, attributes, slots and a method's object (never modules, classes or tensors, nor
    past an object ``stop`` accepts), depth first, each once, at most ``limit``: how ``extract`` finds its way
    through Inductor's and AOTAutograd's wrappers, which differ between torch releases and name no field for what
    they wrap."""
    import functools
    import types

    import torch

    seen, todo = set(), [root]
    while todo and len(seen) < limit:
        o = todo.pop()
        if id(o) in seen or isinstance(o, (type, types.ModuleType, str, bytes, int, float, torch.Tensor)):
            continue
        seen.add(id(o))
        yield o
        if stop(o):
            continue
        if isinstance(o, functools.partial):
            todo.extend([o.func, *o.args, *(o.keywords.values() if attributes else ())])
        if isinstance(o, types.MethodType):
            todo.extend([o.__self__, o.__func__] if attributes else [o.__func__])
        if isinstance(o, types.FunctionType):
            todo.extend(c.cell_contents for c in (o.__closure__ or ()) if _filled(c))
            todo.append(getattr(o, "__wrapped__", None))
        if not attributes:
            continue
        for cls in type(o).__mro__:
            slots = getattr(cls, "__slots__", ())
            todo.extend(getattr(o, n, None) for n in ((slots,) if isinstance(slots, str) else slots))
        if isinstance(o, (list, tuple, set)):
            todo.extend(o)
        elif isinstance(o, dict):
            todo.extend(o.values())
        d = getattr(o, "__dict__", None)
        if isinstance(d, dict) and not isinstance(o, types.FunctionType):
            todo.extend(d.values())


def _filled(cell) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:
        return False
    return True


def _output_code(art):
    """The ``CompiledFxGraph`` inside Inductor's compiled artifact: the loaded one (its wrapper module imported;
    AOTAutograd may also keep the entry it was saved from)."""
    from torch._inductor.output_code import CompiledFxGraph

    def graph(o):
        return isinstance(o, CompiledFxGraph)

    found = [o for o in _reachable(art, stop=graph) if graph(o)]
    calls = {id(getattr(g.current_callable, "__func__", g.current_callable)): g
             for g in found if getattr(g, "current_callable", None) is not None}
    if len(calls) != 1:
        raise ParastreamError(f"{len(calls)} loaded compiled graphs in the artifact, not one")
    return next(iter(calls.values()))


def _wrapper_module(art) -> dict:
    """The globals of the wrapper module Inductor loaded for ``art``: its ``call`` is inside the compiled graph's
    ``current_callable`` (which Inductor wraps, e.g. to check its inputs' alignment)."""
    for o in _reachable(_output_code(art).current_callable, limit=1000, attributes=False):
        fn = getattr(o, "__func__", o)
        scope = getattr(fn, "__globals__", None)
        if isinstance(scope, dict) and scope.get("__file__") and getattr(fn, "__name__", None) == "call" and \
                getattr(scope.get("call"), "__func__", scope.get("call")) is fn:
            return scope
    raise ParastreamError("the compiled graph's call has no wrapper module")


def weight_only_kernels(source: str, n_weights: int) -> dict[str, int]:
    """{Triton kernel: calls a run} of the kernels in Inductor's output code (``wrapper.py``) that read only the
    compiled function's first ``n_weights`` arguments, an engine's weights: work that is the same at every call.
    DenseNet-121's engine transposed 58 convolution weights a replay this way until they were stored in the layout
    the convolutions take (``onnx_torch._channels_last_conv_weights``); a build records what is left
    (engine.json's ``kernels.weight_only_kernels``, report.json's engines; ``weight_only_reads`` names the weights
    they read).  A kernel's inputs are the arguments its definition names ``in_ptr*``, ``in_out_ptr*`` (a buffer
    it reads and writes in place: a bias added to a product's output) or, in a template's kernel (a GEMM's
    ``triton_tem_*``), ``arg_*`` (its operands, beside the epilogue's ``in_ptr*``); the rest of its pointer
    arguments it writes."""
    found: dict[str, int] = {}
    for name, _ in _weight_only_launches(source, n_weights):
        found[name] = found.get(name, 0) + 1
    return found


def weight_only_reads(source: str, n_weights: int) -> list[int]:
    """The indices, among the compiled function's first ``n_weights`` arguments, of the weights that the kernels
    of ``weight_only_kernels`` read: which weights an engine recomputes something from at every call."""
    return sorted({i for _, read in _weight_only_launches(source, n_weights) for i in read})


def _weight_only_launches(source: str, n_weights: int):
    """(kernel, the weight indices it reads) for each launch in ``source``'s ``call`` whose inputs are all weights."""
    params = {f"arg{i}_1": i for i in range(n_weights)}
    signatures: dict[str, list[str]] = {}
    for m in re.finditer(r"^def (triton_\w+)\(([^)]*)\)", source, re.M):
        signatures[m.group(1)] = [a.split(":")[0].strip() for a in m.group(2).split(",")]
    start = source.find("def call(self, args)")
    body = source[start:] if start >= 0 else source
    for m in re.finditer(r"^\s*(triton_\w+)\.run\(([^)]*)\)", body, re.M):
        name, args = m.group(1), [a.strip() for a in m.group(2).split(",")]
        names = signatures.get(name)
        if not names:
            continue
        ins = [a for a, n in zip(args, names) if n.startswith(("in_ptr", "in_out_ptr", "arg_"))]
        if ins and all(a in params for a in ins):
            yield name, [params[a] for a in ins]


def extract(art, args: list, n_outputs: int, gpu_turn=contextlib.nullcontext,
            weight_names: Sequence[str] = ()) -> tuple[bytes, dict]:
    """(kernels artifact, engine.json fields) of Inductor's compiled ``art`` for the flat ``args`` (the weights,
    named ``weight_names``, inputs, then ``n_outputs`` outputs): ``art`` is run on them, the artifact is loaded back
    as a load does and run on the same tensors with the outputs cleared, and every tensor must come out equal bit
    for bit (else ParastreamError, and the caller ships ``art`` itself).  Each of the two runs is inside ``gpu_turn()``."""
    import torch
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    if not _RECORDER:
        raise ParastreamError("install_recorder() was not called before Inductor compiled")
    # the arguments that were 16-byte aligned when Inductor compiled (its kernels may assume it): a load requires
    # them aligned again (``KernelsArtifact.__call__``); Inductor's own runtime would copy a misaligned one
    aligned = [i for i, a in enumerate(args) if a.data_ptr() % ALIGNMENT == 0]
    from . import cudnn_plans

    with torch.no_grad(), cudnn_plans.recording() as planned:
        with gpu_turn():
            art(*args)  # autotuning leaves one launcher per kernel; cuDNN's plans are built (or found)
            torch.cuda.synchronize()
        expected = [a.detach().clone() for a in args]
    scope = _wrapper_module(art)
    with open(scope["__file__"], encoding="utf-8") as f:
        source = f.read()
    kernels, cubins = {}, {}
    for name, obj in scope.items():
        if not isinstance(obj, CachingAutotuner):
            continue
        if len(obj.launchers) != 1:
            raise ParastreamError(f"kernel {name}: {len(obj.launchers)} launchers after a run, not one")
        rec = getattr(obj.launchers[0], "_parastream", None)
        if not isinstance(rec, dict):
            raise ParastreamError(f"kernel {name}: {rec or 'no launcher recorded'}")
        rec = dict(rec)
        member = f"cubins/{len(kernels)}.cubin"
        cubins[member] = rec.pop("cubin_bytes")
        kernels[name] = dict(rec, cubin=member)
    names = set(re.findall(r"\bextern_kernels\.([A-Za-z_]\w*)", source))
    from torch._inductor.select_algorithm import extern_kernels

    extern_torch = sorted(n for n in names if getattr(extern_kernels, n, None) is getattr(torch, n, object()))
    spec = {"format": FORMAT, "kernels": kernels, "extern_torch": extern_torch, "aligned": aligned,
            "extern_inductor": sorted(names - set(extern_torch))}
    device = torch.cuda.current_device()
    members = [("kernels.json", json.dumps(spec, indent=1, sort_keys=True).encode()), ("wrapper.py", source.encode()),
               (WRAPPER_CODE, wrapper_code(source, device)), *sorted(cubins.items())]
    # the plans its run used that cuDNN serializes (its runtime-compiled kernels'), shipped with it: a load
    # deserializes them rather than building them
    shipped = cudnn_plans.CACHE.serializable({k for d, k in planned if d == device}, device)
    if shipped:
        members.append((PLANS, cudnn_plans.CACHE.serialize(device, shipped)))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:  # the engine file deflates it
        for member, data in members:
            z.writestr(zipfile.ZipInfo(member, date_time=(1980, 1, 1, 0, 0, 0)), data)
    package = buf.getvalue()
    # loaded back and run as a load does, on the same tensors with every output cleared first
    loaded = KernelsArtifact(package, torch.cuda.current_device())
    with torch.no_grad():
        for a in args[len(args) - n_outputs:]:
            a.zero_()
        with gpu_turn():
            loaded(*args)
            torch.cuda.synchronize()
    for i, (a, e) in enumerate(zip(args, expected)):
        if not torch.equal(a.nan_to_num(), e.nan_to_num()):
            raise ParastreamError(f"the loaded kernels artifact differs from Inductor's own on argument {i}")
    info = {"kernels": len(kernels), "extern_inductor": spec["extern_inductor"]}
    repeated = weight_only_kernels(source, len(weight_names))
    if repeated:
        info["weight_only_kernels"] = repeated
        info["weight_only_reads"] = [weight_names[i] for i in weight_only_reads(source, len(weight_names))]
    if shipped:
        info["cudnn_plans"] = len(shipped)
    if loaded.imported:
        info["imports_at_run"] = sorted(set(loaded.imported))
    return package, info
