"""The "kernels" artifact's loader (launcher/engines/inductor_kernels.py) on the CPU: a wrapper written the way
Inductor writes one (its imports of Inductor and Triton, ``AsyncCompile``, ``extern_kernels``, kernel launches
with ``.run(..., stream=)``) runs with its Triton launches handed to a stand-in launcher, and imports neither
Inductor nor Triton.  The build's extraction and the real launches run on the GPU
(test_torch_inductor.py's GPU tests)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import textwrap
import zipfile

import pytest

torch = pytest.importorskip("torch")

from parastream.launcher.errors import ParastreamError  # noqa: E402
from parastream.launcher.engines import inductor_kernels as ik  # noqa: E402

WRAPPER = textwrap.dedent('''
    # AOT ID: ['0_inference']
    from ctypes import c_void_p, c_long, c_int
    import torch
    import math
    from math import inf, nan
    from torch._inductor.hooks import run_intermediate_hooks
    from torch._inductor.utils import maybe_profile
    from torch._inductor.codegen.memory_planning import _align as align
    from torch import device, empty_strided
    from torch._inductor.async_compile import AsyncCompile
    from torch._inductor.select_algorithm import extern_kernels
    import triton
    import triton.language as tl
    from torch._inductor.runtime.triton_heuristics import start_graph, end_graph

    aten = torch.ops.aten
    empty_strided_cpu = torch._C._dynamo.guards._empty_strided_cpu
    reinterpret_tensor = torch._C._dynamo.guards._reinterpret_tensor
    async_compile = AsyncCompile()

    triton_poi_fused_add_0 = async_compile.triton('triton_poi_fused_add_0', """
    import triton
    @triton.jit
    def triton_poi_fused_add_0(in_ptr0, out_ptr0, xnumel, XBLOCK : tl.constexpr):
        pass
    """, device_str='cuda')

    async_compile.wait(globals())
    del async_compile

    def call(args):
        arg0_1, arg1_1, arg2_1 = args
        args.clear()
        buf0 = empty_strided_cpu((4, 4), (4, 1), torch.float32)
        extern_kernels.mm(arg0_1, arg1_1, out=buf0)
        triton_poi_fused_add_0.run(buf0, arg2_1, 16, stream=0)
        return ()

    def benchmark_compiled_module(times=10, repeat=10):
        from torch._dynamo.testing import rand_strided
        return rand_strided

    if __name__ == "__main__":
        from torch._inductor.wrapper_benchmark import compiled_module_main
        compiled_module_main('None', benchmark_compiled_module)
''')

KERNEL = {"name": "triton_poi_fused_add_0", "num_warps": 4, "shared": 0, "arg_tys": "OOi", "scratch": 1,
          "def_args": ["in_ptr0", "out_ptr0", "xnumel"],
          "runner_args": ["grid_0", "grid_1", "grid_2", "stream", "in_ptr0", "out_ptr0", "xnumel"],
          "grid": {"prefix": [], "x": "-(xnumel // -8)", "y": "1", "z": "1"}, "cubin": "cubins/0.cubin"}


def package(source: str = WRAPPER, kernels: dict | None = None, extern_torch=("mm",), fmt: int = ik.FORMAT,
            aligned=()) -> bytes:
    kernels = {"triton_poi_fused_add_0": KERNEL} if kernels is None else kernels
    spec = {"format": fmt, "kernels": kernels, "extern_torch": list(extern_torch), "extern_inductor": [],
            "aligned": list(aligned)}
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("kernels.json", json.dumps(spec))
        z.writestr("wrapper.py", source)
        for k in kernels.values():
            z.writestr(k["cubin"], b"\x7fELF not a real cubin")
    return buf.getvalue()


def with_member(data: bytes, member: str, blob: bytes) -> bytes:
    """The zip ``data`` with one member more."""
    src, buf = zipfile.ZipFile(io.BytesIO(data)), io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name in src.namelist():
            z.writestr(name, src.read(name))
        z.writestr(member, blob)
    return buf.getvalue()


def without(data: bytes, member: str) -> bytes:
    """The zip ``data`` less one member."""
    src, buf = zipfile.ZipFile(io.BytesIO(data)), io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name in src.namelist():
            if name != member:
                z.writestr(name, src.read(name))
    return buf.getvalue()


def add_one_launch(log: list):
    """A stand-in for the static launcher: records each launch and does what the kernel would (out = in + 1)."""
    def launch(function, gx, gy, gz, num_warps, shared, arg_tys, args, stream):
        log.append((function, (gx, gy, gz), num_warps, shared, arg_tys, len(args), args[-1], stream))
        src, out, n = args[0], args[1], args[2]
        out.view(-1)[:n].copy_(src.reshape(-1)[:n] + 1)
    return launch


def test_a_wrapper_runs_with_torch_s_externs_and_its_kernels_launched_by_their_recorded_launcher():
    log = []
    art = ik.KernelsArtifact(package(), device=0, launch=add_one_launch(log))
    a, b, out = torch.randn(4, 4), torch.randn(4, 4), torch.zeros(4, 4)
    art(a, b, out)
    assert torch.allclose(out, a @ b + 1)
    # the grid from the recorded expression (16 elements, 8 per block), the scratch pointer appended as null
    assert log == [("triton_poi_fused_add_0", (2, 1, 1), 4, 0, "OOiO", 4, None, 0)]
    assert art.imported == []


def test_loading_and_running_a_wrapper_imports_neither_inductor_nor_triton():
    """In a fresh process: the wrapper's imports of Inductor and Triton are answered without importing them."""
    script = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(__import__('pathlib').Path(__file__).parent)!r})
        from test_inductor_kernels import package, add_one_launch
        from parastream.launcher.engines import inductor_kernels as ik
        art = ik.KernelsArtifact(package(), device=0, launch=add_one_launch([]))
        a, b, out = torch.randn(4, 4), torch.randn(4, 4), torch.zeros(4, 4)
        art(a, b, out)
        assert torch.allclose(out, a @ b + 1)
        heavy = sorted(m for m in sys.modules if m.startswith(("torch._inductor", "triton")))
        print(heavy)
    """)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip().splitlines()[-1] == "[]"


def test_a_name_the_wrapper_calls_from_inductor_is_imported_then_and_recorded():
    source = WRAPPER.replace("    return ()", "    out_size = align(5)\n    return (out_size,)")
    art = ik.KernelsArtifact(package(source), device=0, launch=add_one_launch([]))
    assert art(torch.randn(4, 4), torch.randn(4, 4), torch.zeros(4, 4)) == (64,)
    assert art.imported == ["torch._inductor.codegen.memory_planning._align"]


def test_an_extern_kernel_that_is_not_torch_s_own_is_imported_from_inductor_and_recorded():
    art = ik.KernelsArtifact(package(extern_torch=()), device=0, launch=add_one_launch([]))
    a, b, out = torch.randn(4, 4), torch.randn(4, 4), torch.zeros(4, 4)
    art(a, b, out)
    assert torch.allclose(out, a @ b + 1)
    assert art.imported == ["torch._inductor.select_algorithm.extern_kernels.mm"]


def test_launcher_source_is_inductor_s_launcher_shape_and_refuses_argument_names_that_are_code():
    assert ik.launcher_source(KERNEL).splitlines() == [
        "def launcher(in_ptr0, out_ptr0, xnumel, stream):", "    grid_0 = -(xnumel // -8)", "    grid_1 = 1",
        "    grid_2 = 1", "    runner(grid_0, grid_1, grid_2, stream, in_ptr0, out_ptr0, xnumel)"]
    bad = dict(KERNEL, def_args=["in_ptr0", "out_ptr0):\n    import os\ndef f(x"])
    with pytest.raises(ParastreamError, match="launcher's arguments are not names"):
        ik.launcher_source(bad)


@pytest.mark.parametrize("damage, says", [
    (lambda: b"not a zip", "not a readable kernels artifact"),
    (lambda: package(fmt=99), "kernels artifact format 99"),
    (lambda: package(kernels={}), "launches Triton kernel 'triton_poi_fused_add_0', which its artifact does not hold"),
    (lambda: package(WRAPPER.replace("async_compile.wait(globals())", "async_compile.cpp('x')")),
     r"asks AsyncCompile.cpp"),
    (lambda: package(WRAPPER.replace("def call(args)", "def run(args)")), "defines no call"),
    # kernels.json without a field a load reads, a cubin member it names missing, a wrapper that is not Python
    (lambda: package(kernels={"triton_poi_fused_add_0": {k: v for k, v in KERNEL.items() if k != "grid"}}),
     r"a damaged kernels artifact \(KeyError: 'grid'\); rebuild the bundle"),
    (lambda: without(package(), "cubins/0.cubin"), r"a damaged kernels artifact \(KeyError: .*cubins/0.cubin"),
    (lambda: package(WRAPPER + "\ndef broken(:\n"), r"a damaged kernels artifact \(SyntaxError"),
])
def test_a_damaged_or_unsupported_artifact_is_one_clear_error(damage, says):
    with pytest.raises(ParastreamError, match=says):
        ik.KernelsArtifact(damage(), device=0, launch=add_one_launch([]))


def test_an_argument_aligned_when_compiled_must_be_aligned_when_called():
    """Inductor's kernels may assume 16-byte alignment of a pointer that had it at compile time."""
    art = ik.KernelsArtifact(package(aligned=(0, 2)), device=0, launch=add_one_launch([]))
    base = torch.zeros(40)
    a, b, out = base[:16].view(4, 4), torch.randn(4, 4), torch.zeros(4, 4)
    art(a.copy_(torch.randn(4, 4)), b, out)
    assert torch.allclose(out, a @ b + 1)
    shifted = base[1:17].view(4, 4)  # 4 bytes past an aligned address
    with pytest.raises(ParastreamError, match="argument 0 of a compiled engine is not 16-byte aligned"):
        art(shifted, b, out)


def test_extract_needs_the_recorder_installed_before_inductor_compiled(monkeypatch):
    monkeypatch.setattr(ik, "_RECORDER", [])
    with pytest.raises(ParastreamError, match="install_recorder"):
        ik.extract(lambda *a: None, [], 0)


@pytest.mark.slow
def test_the_wrapper_module_is_found_inside_inductor_s_compiled_artifact(tmp_path, monkeypatch):
    """``extract`` takes the wrapper from the module Inductor loaded for the artifact: found by walking the compiled
    graph's ``current_callable`` (Inductor wraps the module's ``call``).  Here on the CPU (C++ kernels), where the
    walk is the same as on the GPU."""
    import torch._inductor
    from torch.fx.experimental.proxy_tensor import make_fx

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))

    def f(x, w):
        return torch.relu(x @ w) + 1

    args = [torch.randn(4, 4), torch.randn(4, 4)]
    gm = make_fx(f)(*args)
    art = torch._inductor.standalone_compile(gm, args, dynamic_shapes="from_example_inputs", aot=True)
    out = art(*args)
    assert torch.allclose(out if isinstance(out, torch.Tensor) else out[0], f(*args))
    scope = ik._wrapper_module(art)
    assert callable(scope["call"]) and "def call" in open(scope["__file__"]).read()
    assert torch.allclose(scope["call"](list(args))[0], f(*args))


#: the wrapper with one line more in ``call``, so that which of the two ran is seen in its output
MARKED = WRAPPER.replace("    return ()", "    out_mark.append('shipped')\n    return ()").replace(
    "aten = torch.ops.aten", "aten = torch.ops.aten\nout_mark = []")


@pytest.mark.parametrize("blob, device, runs", [
    (lambda: ik.wrapper_code(MARKED, 0), 0, "shipped"),  # this Python, this GPU: the shipped code, not wrapper.py
    (lambda: ik.wrapper_code(MARKED, 0), 1, "source"),  # built on GPU 0, loaded on GPU 1: wrapper.py on GPU 1
    (lambda: b"\0\0\0\0" + ik.wrapper_code(MARKED, 0)[4:], 0, "source"),  # another Python's bytecode
    (lambda: ik.wrapper_code(MARKED, 0)[:-7], 0, "source"),  # cut short
    (lambda: ik.wrapper_code(MARKED, 0)[:8] + b"\xff garbage", 0, "source"),
])
def test_the_wrapper_s_shipped_bytecode_runs_only_where_it_was_compiled_for(blob, device, runs):
    art = ik.KernelsArtifact(with_member(package(), ik.WRAPPER_CODE, blob()), device=device, launch=add_one_launch([]))
    a, b, out = torch.randn(4, 4), torch.randn(4, 4), torch.zeros(4, 4)
    art(a, b, out)
    assert torch.allclose(out, a @ b + 1)
    marks = art._call.__globals__.get("out_mark")
    assert (marks == ["shipped"]) if runs == "shipped" else marks is None


def test_the_shipped_bytecode_is_the_wrapper_compiled_for_its_gpu_and_the_same_bytes_each_time():
    source = WRAPPER.replace("def call(args):", "def call(args):\n    torch.cuda.set_device(0)")
    code = ik.wrapper_code(source, 3)
    assert code == ik.wrapper_code(source, 3)  # one structure's branches ship one artifact
    shipped = ik._shipped_code(code, 3)
    assert shipped is not None and 3 in [c for f in shipped.co_consts if hasattr(f, "co_consts") for c in f.co_consts]
    assert ik._shipped_code(code, 0) is None
