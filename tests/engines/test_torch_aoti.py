"""Compiled torch engines (AOTInductor packages): built once, loaded without compiling, refused where they were
not compiled for, cached by branch.  AOTInductor compiles for the CPU too, which is how these run in CI (tiny
branches; each compile takes seconds, so the module compiles three and shares them); the GPU path is in
test_torch_aoti_gpu below and tests/pipeline/test_build_gpu.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

torch = pytest.importorskip("torch")

from parastream.launcher.engines import BuildOptions as _BuildOptions  # noqa: E402
from parastream.launcher.engines import torch as tb  # noqa: E402
from parastream.launcher.errors import ParastreamError  # noqa: E402
from parastream.launcher.plan import TensorSpec  # noqa: E402
from compiled_gpu import (assert_another_architecture_is_refused_naming_the_file,  # noqa: E402
                          assert_ships_compiled_engines_verified_as_loaded, scaled_error, small_net_bundle)
from compiled_gpu import retag as _retag  # noqa: E402

pytestmark = pytest.mark.slow

IN = TensorSpec("x", "float32", [1, 3, 8, 8])
OUT = TensorSpec("y", "float32", [1, 4, 8, 8])


def BuildOptions(**kw) -> _BuildOptions:
    """These tests build AOTInductor packages (``--torch-artifact aoti``)."""
    return _BuildOptions(**{"torch_artifact": "aoti", **kw})


def branch(seed: int) -> onnx.ModelProto:
    """Conv 3x3 -> Relu -> Mul by a constant: one tiny branch; ``seed`` picks its weights."""
    rng = np.random.default_rng(seed)
    inits = [numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal(4).astype(np.float32), "b"),
             numpy_helper.from_array(np.array(0.5, np.float32), "half")]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1], name="conv"),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("Mul", ["r", "half"], ["y"], name="scale")]
    g = helper.make_graph(nodes, f"net_branch_{seed:03d}", [helper.make_tensor_value_info("x", TensorProto.FLOAT, IN.shape)],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, OUT.shape)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def ort(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    import onnxruntime as rt

    return rt.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


LAYOUT = {"inputs": [IN], "outputs": [OUT]}

#: the GPU tests of ``aoti`` on torch 2.11, where AOTInductor packages on the GPU are known not to work
#: (docs/torch-engines.md: a segmentation fault in the package loader, and small_net's fp16 build refused by its
#: verification; last run on the H200, 2026-11-30): not run there (their small_net build alone took ~3.5 minutes of
#: the GPU tier, to fail), run and asserted on any other torch
AOTI_ON_THE_GPU = pytest.mark.xfail(torch.__version__.startswith("2.11"), run=False, strict=True,
                                    reason="AOTInductor packages on the GPU fail on torch 2.11 (docs/torch-engines.md)")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Branches 1 and 2 compiled once into a disk cache, with a count of the compiles."""
    cache = tmp_path_factory.mktemp("engine-cache")
    calls = []
    real = tb.compile_package

    def counting(br, *a, **k):
        calls.append(br.graph.node[0].name + ":" + str(numpy_helper.to_array(br.graph.initializer[0]).ravel()[0]))
        return real(br, *a, **k)

    tb.compile_package = counting
    old_env = os.environ.get("PARASTREAM_COMPILE_WORKERS")
    os.environ["PARASTREAM_COMPILE_WORKERS"] = "1"  # in this process, so that the count sees every compile
    tb.clear_memory_cache()
    try:
        builder = tb.Builder(BuildOptions(device="cpu", cache_dir=str(cache)))
        a, b = builder.build_all([(branch(1), "branch_000", LAYOUT), (branch(2), "branch_001", LAYOUT)])
        report = builder.report()
        yield types.SimpleNamespace(a=a, b=b, report=report, cache=cache, calls=calls)
    finally:
        tb.compile_package = real
        if old_env is None:
            os.environ.pop("PARASTREAM_COMPILE_WORKERS", None)
        else:
            os.environ["PARASTREAM_COMPILE_WORKERS"] = old_env


def test_engine_is_a_compiled_package_stating_what_it_was_compiled_for(built):
    meta, onnx_bytes, package = tb.unpack(built.a)
    assert package is not None and meta["compiled"] == "aotinductor"
    assert meta["built_for"] == tb.built_for("cpu") and meta["built_for"]["torch"] == torch.__version__
    assert onnx.load_from_string(onnx_bytes).graph.node[0].name == "conv"  # the ONNX rides along for other layouts
    assert built.report["branch_000"]["cache"] == "miss" and len(built.calls) == 2


def test_loads_in_a_fresh_process_without_compiling_and_matches_onnxruntime(built, tmp_path):
    engine = tmp_path / "branch_000.zip"
    engine.write_bytes(built.a)
    x = np.random.default_rng(7).standard_normal(IN.shape).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    script = textwrap.dedent(f"""
        import json, time, numpy as np
        t0 = time.perf_counter()
        import torch, torch._dynamo.utils
        from parastream.launcher.engines import BuildOptions, torch as tb
        from parastream.launcher.plan import TensorSpec
        e = tb.load(open({str(engine)!r}, "rb").read(), [TensorSpec("x", "float32", {IN.shape})],
                    [TensorSpec("y", "float32", {OUT.shape})], device="cpu", options=BuildOptions())
        y = e.run({{"x": np.load({str(tmp_path / 'x.npy')!r})}})["y"]
        np.save({str(tmp_path / 'y.npy')!r}, y)
        print(json.dumps({{"compiled_at_load": e.compiled_at_load, "load_s": e.load_s,
                          "dynamo_graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"]}}))
    """)
    empty = tmp_path / "empty-inductor-cache"
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(empty))
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    info = json.loads(p.stdout.strip().splitlines()[-1])
    assert info["compiled_at_load"] is False and info["dynamo_graphs"] == 0
    # nothing of the engine was compiled into the (empty) Inductor cache: no kernel, no wrapper; on the CPU
    # Inductor probes the vector ISA once per cache with a one-line kernel (``__avx_chk_kernel``), and that is all
    sources = [f for f in empty.rglob("*.cpp")] + [f for f in empty.rglob("*.py")] if empty.exists() else []
    assert all("_chk_kernel" in f.read_text() for f in sources), [f.read_text()[:200] for f in sources]
    assert {f.stem for f in empty.rglob("*.so")} <= {f.stem for f in sources}
    y = np.load(tmp_path / "y.npy")
    np.testing.assert_allclose(y, ort(branch(1), x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device_index, defined", [(-1, ["rnn"]), (0, ["cudnn_conv2d", "rnn"])])
def test_a_package_loads_only_after_the_ops_its_code_calls_are_defined(monkeypatch, device_index, defined):
    """An AOTInductor package looks each operator's schema up as it loads: parastream's own (a depthwise
    convolution's cuDNN plan on the GPU, an LSTM layer anywhere) must be defined first, also in a process that
    has loaded no other engine (a GPU build's alternatives: "Could not find schema for parastream::cudnn_conv2d")."""
    from parastream.launcher.engines import cudnn_plans, recurrent_op

    order = []
    monkeypatch.setattr(cudnn_plans, "register_op", lambda: order.append("cudnn_conv2d"))
    monkeypatch.setattr(recurrent_op, "register_rnn_op", lambda: order.append("rnn"))

    class Loader:
        def __init__(self, path, name, *args):
            assert open(path, "rb").read() == b"package"
            order.append("load")

    monkeypatch.setattr(torch._C._aoti, "AOTIModelPackageLoader", Loader)
    tb._load_package(b"package", device_index)
    assert order == defined + ["load"]


def test_the_other_branch_computes_its_own_weights(built):
    x = np.random.default_rng(8).standard_normal(IN.shape).astype(np.float32)
    e = tb.load(built.b, [IN], [OUT], device="cpu")
    assert not e.compiled_at_load
    np.testing.assert_allclose(e.run({"x": x})["y"], ort(branch(2), x), rtol=1e-5, atol=1e-5)
    assert np.abs(ort(branch(1), x) - ort(branch(2), x)).max() > 0.1  # the two branches really differ


@pytest.mark.parametrize("other, says", [
    ({"torch": "2.0.0+cu118"}, r"compiled for the CPU \(.*\), torch 2\.0\.0\+cu118; this machine has the CPU \(.*\), torch " + torch.__version__.replace("+", r"\+")),
    ({"device": "cuda", "arch": "sm_90", "gpu": "NVIDIA H100 80GB HBM3", "cuda": "12.8", "machine": None},
     r"compiled for NVIDIA H100 80GB HBM3 \(sm_90\), torch .*, CUDA 12\.8; this machine has the CPU"),
    ({"machine": "aarch64" if os.uname().machine != "aarch64" else "x86_64"}, r"compiled for the CPU \((aarch64|x86_64)\)"),
])
def test_an_engine_compiled_elsewhere_is_refused_saying_for_what_and_what_was_found(built, other, says):
    with pytest.raises(ParastreamError, match=says):
        tb.load(_retag(built.a, **other), [IN], [OUT], device="cpu")


def test_the_same_machine_is_not_refused(built):
    tb.load(_retag(built.a, gpu="another name"), [IN], [OUT], device="cpu")  # only device, arch and versions decide


def test_cache_hit_on_an_identical_branch_and_one_changed_branch_recompiles_alone(built, monkeypatch):
    monkeypatch.setenv("PARASTREAM_COMPILE_WORKERS", "1")
    n = len(built.calls)
    # the same branch under another name (another candidate's index): a hit, same bytes, nothing compiled
    renamed = branch(1)
    renamed.graph.name = "net_branch_042"
    builder = tb.Builder(BuildOptions(device="cpu", cache_dir=str(built.cache)))
    a2, b3 = builder.build_all([(renamed, "branch_042", LAYOUT), (branch(3), "branch_043", LAYOUT)])
    assert builder.report()["branch_042"]["cache"] == "memory" and tb.unpack(a2)[2] == tb.unpack(built.a)[2]
    assert builder.report()["branch_043"]["cache"] == "miss" and len(built.calls) == n + 1  # only the changed one
    # a later build (memory cache gone): both from --cache-dir, nothing compiled
    tb.clear_memory_cache()
    again = tb.Builder(BuildOptions(device="cpu", cache_dir=str(built.cache)))
    assert again.build_all([(branch(1), "b0", LAYOUT), (branch(3), "b1", LAYOUT)]) == [built.a, b3]
    assert {r["cache"] for r in again.report().values()} == {"disk"} and len(built.calls) == n + 1
    x = np.random.default_rng(9).standard_normal(IN.shape).astype(np.float32)
    np.testing.assert_allclose(tb.load(b3, [IN], [OUT]).run({"x": x})["y"], ort(branch(3), x), rtol=1e-5, atol=1e-5)


def test_worker_processes_compile_the_same_engines(monkeypatch):
    """Branches no cache holds compile side by side in spawned workers (the GPU build's path); a branch that
    appears twice in one batch compiles once."""
    monkeypatch.setenv("PARASTREAM_COMPILE_WORKERS", "2")
    builder = tb.Builder(BuildOptions(device="cpu"))
    engines = builder.build_all([(branch(4), "b0", LAYOUT), (branch(5), "b1", LAYOUT), (branch(4), "b2", LAYOUT)])
    assert [r["cache"] for r in builder.report().values()] == ["miss", "miss", "miss"]
    assert tb.unpack(engines[0])[2] == tb.unpack(engines[2])[2]
    x = np.random.default_rng(11).standard_normal(IN.shape).astype(np.float32)
    for data, seed in zip(engines, (4, 5, 4)):
        e = tb.load(data, [IN], [OUT], device="cpu")
        assert not e.compiled_at_load
        np.testing.assert_allclose(e.run({"x": x})["y"], ort(branch(seed), x), rtol=1e-5, atol=1e-5)


def test_another_precision_or_layout_is_another_cache_entry(built):
    sig = tb._layout([IN], [OUT], "cpu", (), {})[2]
    base = tb.cache_key(branch(1), sig, "float32", BuildOptions(device="cpu"), False, tb.built_for("cpu"))
    assert base == tb.cache_key(branch(1), sig, "float32", BuildOptions(device="cpu", cache_dir="/x"), False, tb.built_for("cpu"))
    others = [tb.cache_key(branch(1), sig, "float16", BuildOptions(device="cpu"), False, tb.built_for("cpu")),
              tb.cache_key(branch(1), sig, "float32", BuildOptions(device="cpu", optimization_level=5), False, tb.built_for("cpu")),
              tb.cache_key(branch(1), sig, "float32", BuildOptions(device="cpu"), True, tb.built_for("cpu")),
              tb.cache_key(branch(1), [[*s[:3], True, [8, 0]] for s in sig], "float32", BuildOptions(device="cpu"), False,
                           tb.built_for("cpu")),
              tb.cache_key(branch(1), sig, "float32", BuildOptions(device="cpu"), False, dict(tb.built_for("cpu"), torch="0")),
              tb.cache_key(branch(2), sig, "float32", BuildOptions(device="cpu"), False, tb.built_for("cpu"))]
    assert len({base, *others}) == 7


def test_uncompiled_and_legacy_engines_compile_at_load(built):
    x = np.random.default_rng(10).standard_normal(IN.shape).astype(np.float32)
    plain = tb.Builder(BuildOptions(device="cpu", compile=False)).build(branch(1), "b")  # no package without compile
    assert tb.unpack(plain)[2] is None
    no_layout = tb.Builder(BuildOptions(device="cpu")).build(branch(1), "b")  # nor without the launcher's layout
    assert tb.unpack(no_layout)[2] is None
    for data in (plain, no_layout, branch(1).SerializeToString()):  # the last: a bundle written before packages
        e = tb.load(data, [IN], [OUT], device="cpu")
        assert e.compiled_at_load
        np.testing.assert_allclose(e.run({"x": x})["y"], ort(branch(1), x), rtol=1e-5, atol=1e-5)


def test_a_corrupt_engine_is_one_clear_error(built):
    with pytest.raises(ParastreamError, match="not a readable torch engine"):
        tb.load(built.a[:200], [IN], [OUT], device="cpu")


# -- the build hands the builder the launcher's layouts (CPU: a recording builder) ----------------------------
def test_build_compiles_each_branch_for_the_layout_the_gpu_launcher_gives_it(tmp_path):
    import onnx_graphsurgeon as gs

    from parastream.launcher.gpu import engine_layouts
    from parastream.pipeline import build
    from parastream.pipeline.build import _write_engines
    from parastream.pipeline.zoo import small_net

    onnx.save(small_net(), tmp_path / "small_net.onnx")
    plan = build(tmp_path / "small_net.onnx", tmp_path / "ort", backend="onnxruntime", streams=4, search=False,
                 verify=False).plan
    plan.precision, plan.backend = "fp16", "torch"
    seen: dict = {}

    class Recording:
        def __init__(self, options):
            pass

        def build(self, branch, name, layout=None):
            seen[name] = layout
            return b"engine"

        def report(self):
            return {}

        def close(self):
            pass

    backend = types.SimpleNamespace(name="torch", suffix=".zip", gpu=True, supports_internal_nhwc=True,
                                    supports_channel_views=True, compiles_for_layout=True, builds_side_by_side=False,
                                    Builder=Recording, slim_engine=lambda data, held: data)
    model = onnx.load(tmp_path / "ort" / "model.onnx")
    graph = gs.import_onnx(model)
    graph.toposort()
    (tmp_path / "b").mkdir()
    _write_engines(tmp_path / "b", model, graph, plan, backend, BuildOptions(precision="fp16", device="cuda"), "label")
    lay = engine_layouts(plan, backend)
    assert lay.elided and lay.nhwc and lay.views  # small_net has in-place Concats and channels-last boundaries
    for b in plan.branches:
        if b.id in lay.elided:
            assert seen[b.name] is None  # runs no engine in the launcher
        else:
            assert seen[b.name] == lay.branch(b)
    internal = [t for b in plan.branches if b.id not in lay.elided for t in seen[b.name]["inputs"] if t.name in lay.nhwc]
    assert internal and all(t.dtype == "float16" for t in internal)
    # a CPU build (onnxruntime, or torch on the CPU) passes no layout: nothing to compile for a GPU launcher
    seen.clear()
    _write_engines(tmp_path / "b", model, graph, plan, backend, BuildOptions(precision="fp16", device="cpu"), "label")
    assert set(seen.values()) == {None}


def depthwise_branch() -> onnx.ModelProto:
    """A NASNet separable convolution: depthwise 3x3 (group 8) -> Relu -> pointwise 1x1, on [1, 8, 16, 16]."""
    rng = np.random.default_rng(3)
    inits = [numpy_helper.from_array(rng.standard_normal((8, 1, 3, 3)).astype(np.float32), "dw"),
             numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), "db"),
             numpy_helper.from_array((rng.standard_normal((8, 8, 1, 1)) / 3).astype(np.float32), "pw")]
    nodes = [helper.make_node("Conv", ["x", "dw", "db"], ["d"], pads=[1, 1, 1, 1], group=8, name="depthwise"),
             helper.make_node("Relu", ["d"], ["r"], name="relu"),
             helper.make_node("Conv", ["r", "pw"], ["y"], name="pointwise")]
    g = helper.make_graph(nodes, "separable", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 16, 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 16, 16])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def test_an_aoti_engine_runs_depthwise_convolutions_as_torch_s_convolution():
    """Depthwise convolutions go through the cuDNN-plan operator (``cudnn_plans``) only in the Python artifacts:
    an AOTInductor package would call it through AOTInductor's proxy executor, and ships no plans."""
    from parastream.launcher.engines import onnx_torch

    def planned(artifact):  # per convolution of the converted branch, whether it runs the cuDNN-plan operator
        opts = tb.converter_options("cuda", "float16", BuildOptions(torch_artifact=artifact, device="cuda"))
        module = onnx_torch.convert(depthwise_branch(), "float32", **dict(opts, fuse_conv_relu=False))
        return [s.fn.planned for s in module._steps if isinstance(s.fn, onnx_torch._ConvFn)]

    assert planned("aoti") == [False, False]
    assert planned("inductor") == [True, False]  # the depthwise one; the pointwise is cuDNN's through torch


# -- GPU: the whole bundle ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gpu_bundle(tmp_path_factory):
    return small_net_bundle(tmp_path_factory.mktemp("gpu-aoti"), torch_artifact="aoti")


@pytest.mark.gpu
@AOTI_ON_THE_GPU
def test_gpu_bundle_ships_compiled_engines_verified_as_loaded(gpu_bundle):
    assert_ships_compiled_engines_verified_as_loaded(gpu_bundle[1], "aotinductor")


@pytest.mark.gpu
@AOTI_ON_THE_GPU
def test_gpu_bundle_loads_in_a_fresh_process_without_compiling(gpu_bundle, tmp_path):
    folder, bundle = gpu_bundle
    x = np.random.default_rng(5).standard_normal(bundle.plan.inputs[0].shape).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    script = textwrap.dedent(f"""
        import json, time, numpy as np
        t0 = time.perf_counter()
        import torch, torch._dynamo.utils
        from parastream.launcher import load
        run = load({str(bundle.path)!r}, device="cuda")
        ready = time.perf_counter() - t0
        y = run({{{bundle.plan.inputs[0].name!r}: np.load({str(tmp_path / 'x.npy')!r})}})[{bundle.plan.outputs[0].name!r}]
        np.save({str(tmp_path / 'y.npy')!r}, y)
        print(json.dumps({{"ready_s": ready, "compiled_at_load": sum(e.compiled_at_load for e in run.engines if e is not None),
                          "dynamo_graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"]}}))
    """)
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "empty"), TRITON_CACHE_DIR=str(tmp_path / "empty-triton"))
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    info = json.loads(p.stdout.strip().splitlines()[-1])
    assert info["compiled_at_load"] == 0 and info["dynamo_graphs"] == 0, info
    assert scaled_error(folder, bundle, x, np.load(tmp_path / "y.npy")) < 2e-2


@pytest.mark.gpu
@AOTI_ON_THE_GPU
def test_gpu_ablation_layouts_compile_at_load_and_stay_right(gpu_bundle):
    from parastream.launcher.gpu import GpuLauncher

    folder, bundle = gpu_bundle
    x = np.random.default_rng(6).standard_normal(bundle.plan.inputs[0].shape).astype(np.float32)
    name = bundle.plan.inputs[0].name
    with GpuLauncher(bundle) as la:
        ref = la({name: x})[bundle.plan.outputs[0].name]
    with GpuLauncher(bundle, concat_in_place=False) as la:  # the elided Concats now need engines: from their ONNX
        assert any(e.compiled_at_load for e in la.engines)
        got = la({name: x})[bundle.plan.outputs[0].name]
    assert np.abs(got - ref).max() / np.abs(ref).max() < 2e-2


@pytest.mark.gpu
@AOTI_ON_THE_GPU
def test_gpu_engine_for_another_architecture_is_refused_naming_the_file(gpu_bundle, tmp_path):
    assert_another_architecture_is_refused_naming_the_file(gpu_bundle[1], tmp_path)


def test_engines_are_compiled_again_only_when_the_timed_choice_differs_from_what_they_were_compiled_for():
    from parastream.launcher.engines import get_backend
    from parastream.pipeline.measure import compiled_for_other_choices

    torch_backend = get_backend("torch")
    assert not compiled_for_other_choices(torch_backend, True, {"fuse_conv_relu": True, "internal_nhwc": True})
    assert compiled_for_other_choices(torch_backend, True, {"fuse_conv_relu": False, "internal_nhwc": True})
    assert compiled_for_other_choices(torch_backend, True, {"fuse_conv_relu": True, "internal_nhwc": False})
    for other in ("onnxruntime", "tensorrt"):  # their engines do not depend on the launcher's layout
        assert not compiled_for_other_choices(get_backend(other), True, {"fuse_conv_relu": False, "internal_nhwc": False})


def test_a_branch_aotinductor_cannot_compile_ships_its_onnx_and_says_why(monkeypatch):
    monkeypatch.setenv("PARASTREAM_COMPILE_WORKERS", "1")

    def fails(*a, **k):
        raise RuntimeError("no C shim for aten::something\nmore detail")

    monkeypatch.setattr(tb, "compile_package", fails)
    builder = tb.Builder(BuildOptions(device="cpu"))
    data = builder.build(branch(6), "branch_000", LAYOUT)
    rep = builder.report()["branch_000"]
    assert rep["compiled"] is None and rep["aot_error"] == "RuntimeError: no C shim for aten::something"
    meta, _, package = tb.unpack(data)
    assert package is None and meta["aot_error"] == rep["aot_error"]
    e = tb.load(data, [IN], [OUT], device="cpu")
    x = np.random.default_rng(12).standard_normal(IN.shape).astype(np.float32)
    assert e.compiled_at_load
    np.testing.assert_allclose(e.run({"x": x})["y"], ort(branch(6), x), rtol=1e-5, atol=1e-5)


def test_alternatives_of_compiled_engines_are_compiled_for_the_layout_they_are_timed_in(monkeypatch, tmp_path):
    """time_alternatives (GPU builds) with packages: each alternative is compiled for its own fusion and boundary
    layout (a scratch bundle; on the cache's path, so that the bundle's rewrite for a winner is all hits)."""
    from gpu_build_fakes import fake_gpu, plan_of

    from parastream.pipeline.zoo import small_net

    onnx.save(small_net(), tmp_path / "small_net.onnx")
    times = {("bundle", True, None): 1.0, ("scratch", None, None): 0.8}  # every scratch alternative at 0.8
    build_mod, made = fake_gpu(monkeypatch, times)
    writes = []
    monkeypatch.setattr(build_mod, "_write_engines",
                        lambda dest, model, graph, plan, backend, options, label, on_branch=None, internal_nhwc=True,
                        prebuilt=None, model_file=True, sink=None, cache=None:
                        writes.append((plan.num_streams, options.fuse_conv_relu, internal_nhwc)))

    class Builder:
        def build(self, branch, name, layout=None):
            raise AssertionError("faked")

    from gpu_build_fakes import gpu_backend

    from parastream.pipeline.measure import Variant, time_alternatives

    from parastream.pipeline import measure

    # the GEMM-epilogue round raced on the whole plan, as it is where a rewrite's fused nodes are in it (small_net's
    # only one is its head, which a build decides on a sample of that node: tests/pipeline/test_build_gpu.py)
    monkeypatch.setattr(measure, "gemm_sample", lambda engines, v, full: None)
    backend = gpu_backend(suffix=".zip", Builder=Builder, compiles_for_layout=True)
    model, graph, plan, cm = plan_of(tmp_path / "small_net.onnx", 2)
    got = time_alternatives(build_mod.Engines(backend, cm, None, "fp16"), "bundle",
                            Variant(model, graph, plan, BuildOptions(precision="fp16", conv_kernels="cudnn")), runs=5)
    # round 0: the GEMM epilogue off (small_net's head, a Linear of one row, as one reduction) wins (0.8 < 1.0);
    # round 1: the unfused packages tie with it (kept); round 2: contiguous packages tie (kept); round 3: one engine
    assert writes == [(2, True, True), (2, False, True), (2, True, False), (1, True, True)]
    assert (got["fuse_gemm_epilogue"], got["fuse_conv_relu"], got["internal_nhwc"]) == (False, True, True)
    assert all(la.closed for la in made)


def test_an_engine_whose_branch_names_an_external_file_is_refused(tmp_path):
    from onnx.external_data_helper import set_external_data

    m = branch(1)
    set_external_data(m.graph.initializer[0], location="../../etc/passwd")
    m.graph.initializer[0].data_location = TensorProto.EXTERNAL
    data = tb.pack({"format": tb.ENGINE_FORMAT, "compiled": None}, m.SerializeToString(), None)
    with pytest.raises(ParastreamError, match="external file"):
        tb.load(data, [IN], [OUT], device="cpu")


@pytest.mark.gpu
@AOTI_ON_THE_GPU
def test_gpu_aoti_engine_with_a_depthwise_convolution_matches_onnxruntime(tmp_path):
    """One branch with a separable convolution, compiled as an AOTInductor package for the GPU in fp16, loaded
    without compiling and enqueued on a stream of ours: onnxruntime's result (its depthwise convolution is torch's,
    which AOTInductor lowers natively).  In a child process: torch 2.11's package loader has crashed the process
    on the GPU (docs/torch-engines.md), which must fail this test, not end the test run."""
    x = np.random.default_rng(5).uniform(-1, 1, (1, 8, 16, 16)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    onnx.save(depthwise_branch(), tmp_path / "branch.onnx")
    script = textwrap.dedent(f"""
        import json, numpy as np, onnx, torch
        from parastream.launcher import cuda
        from parastream.launcher.engines import BuildOptions, torch as tb
        from parastream.launcher.plan import TensorSpec
        ins, outs = [TensorSpec("x", "float32", [1, 8, 16, 16])], [TensorSpec("y", "float32", [1, 8, 16, 16])]
        opts = BuildOptions(precision="fp16", device="cuda", torch_artifact="aoti")
        data = tb.Builder(opts).build(onnx.load({str(tmp_path / "branch.onnx")!r}), "separable",
                                      {{"inputs": ins, "outputs": outs}})
        engine = tb.load(data, ins, outs, device="cuda", options=opts)
        x = torch.from_numpy(np.load({str(tmp_path / "x.npy")!r})).cuda()
        y = torch.full((1, 8, 16, 16), float("nan"), device="cuda")  # poison: every element must be written
        torch.cuda.synchronize()
        stream = cuda.stream_create()
        engine.enqueue(cuda.handle(stream), {{"x": x.data_ptr(), "y": y.data_ptr()}})
        cuda.stream_synchronize(stream)
        np.save({str(tmp_path / "y.npy")!r}, y.cpu().numpy())
        print(json.dumps({{"compiled": tb.unpack(data)[0]["compiled"], "at_load": engine.compiled_at_load_because}}))
    """)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, (p.returncode, p.stderr[-2000:])
    info = json.loads(p.stdout.strip().splitlines()[-1])
    assert info == {"compiled": "aotinductor", "at_load": ""}
    got, ref = np.load(tmp_path / "y.npy"), ort(depthwise_branch(), x)
    assert not np.isnan(got).any()
    assert np.abs(got - ref).max() / np.abs(ref).max() < 1e-2
