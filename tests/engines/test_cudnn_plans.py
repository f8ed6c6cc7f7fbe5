"""Depthwise convolutions through cuDNN plans that an engine ships (``launcher/engines/cudnn_plans.py``).

On the CPU (no cuDNN) the op is torch's convolution, so the conversion is checked there: which convolutions it
routes to ``torch.ops.parastream.cudnn_conv2d`` (the depthwise k x k ones, and no 1x1, grouped, dilated, dense or
1-d one), that the converted model equals ONNX Runtime eager and compiled by Inductor (with the ReLU fused into the
op too), and that the compiled-branch cache key says so only where it changes the code.  On the GPU (marked): a
plan built, serialized and loaded in a fresh process runs without building one, and a bundle's engines ship the
plans their depthwise convolutions ran, so that a fresh load builds none.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

torch = pytest.importorskip("torch")

from parastream.launcher.engines.onnx_torch import convert, to_fx  # noqa: E402

from graphs import separable_as_nasnet  # noqa: E402
from test_conv_kernels import _feeds, _ort, _run, _w, conv_model, dense_only  # noqa: E402


def _planned(module) -> dict[str, bool]:
    """node name -> whether its step runs through the plans' op."""
    return {st.node: bool(getattr(st.fn, "planned", False)) for st in module._steps}


def test_depthwise_convolutions_and_no_others_run_through_the_plans_op():
    model, lowered = conv_model()
    depthwise = {name: low and name not in ("pw", "pw_stride2", "pw_groups2") for name, low in lowered.items()}
    assert _planned(convert(model, cudnn_plans=True)) == depthwise
    assert sum(depthwise.values()) == 4
    assert not any(_planned(convert(model)).values())
    # the lowerings the option names go first: their depthwise convolutions are theirs
    assert not any(_planned(convert(model, cudnn_plans=True, conv_kernels="inductor")).values())


def test_planned_convolutions_equal_onnxruntime_eager_and_compiled():
    model, _ = conv_model()
    feeds = _feeds(5)
    ref = _ort(model, feeds)
    module = convert(model, cudnn_plans=True)
    for got in (_run(module, model, feeds), _run(torch.compile(to_fx(module)), model, feeds)):
        for name, r in ref.items():
            assert got[name].shape == r.shape, name
            np.testing.assert_allclose(got[name], r, rtol=1e-4, atol=1e-5, err_msg=name)


def separable_model(c: int = 16, size: int = 20, seed: int = 6) -> onnx.ModelProto:
    """ReLU, a depthwise 5x5 with bias whose only reader is a ReLU, one with asymmetric pads, a pointwise conv."""
    rng = np.random.default_rng(seed)
    N = helper.make_node
    inits = [_w(rng, "dw", (c, 1, 5, 5)), _w(rng, "b", (c,)), _w(rng, "dw3", (c, 1, 3, 3)), _w(rng, "pw", (c, c, 1, 1))]
    nodes = [N("Relu", ["x"], ["r"], name="relu"),
             N("Conv", ["r", "dw", "b"], ["d"], name="depthwise", pads=[2, 2, 2, 2], group=c),
             N("Relu", ["d"], ["dr"], name="relu_after_depthwise"),
             N("Conv", ["dr", "dw3", "b"], ["d3"], name="depthwise_asym", pads=[1, 0, 1, 2], group=c),
             N("Relu", ["d3"], ["d3r"], name="relu_after_asym"),
             N("Conv", ["d3r", "pw"], ["y"], name="pointwise")]
    graph = helper.make_graph(nodes, "separable",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c, size, size])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return onnx.shape_inference.infer_shapes(model)


def test_a_depthwise_convolution_and_its_relu_fuse_into_one_planned_op():
    """With ``fuse_conv_relu`` a planned depthwise convolution whose only reader is a ReLU is one op (cuDNN's
    conv + bias + ReLU on a GPU), asymmetric pads included; the pointwise convolution is not planned."""
    model = separable_model()
    module = convert(model, cudnn_plans=True, fuse_conv_relu=True)
    assert module.fused_conv_relu == 2
    assert _planned(module) == {"relu": False, "depthwise+relu_after_depthwise": True,
                                "depthwise_asym+relu_after_asym": True, "pointwise": False}
    feeds = {"x": np.random.default_rng(7).standard_normal((1, 16, 20, 20)).astype(np.float32)}
    ref = _ort(model, feeds)["y"]
    for m in (module, torch.compile(to_fx(module))):
        np.testing.assert_allclose(_run(m, model, feeds)["y"], ref, rtol=1e-4, atol=1e-5)


def test_the_cache_key_says_so_only_where_a_depthwise_convolution_is(monkeypatch):
    """A CUDA branch with a depthwise convolution compiles apart from one converted without the plans' op (an
    engine cached before would call torch's convolution); a branch without one keeps its key."""
    from parastream.launcher.engines import torch as tb
    from parastream.launcher.engines.base import BuildOptions

    model, _ = conv_model()
    dense = dense_only(model)
    options = BuildOptions(precision="fp16", device="cuda", cudnn_plans=True)
    cuda = {"device": "cuda"}

    def key(m, built):
        return tb.cache_key(m, [], "float16", options, False, built, "kernels")

    assert tb._cudnn_plans("cuda", BuildOptions(conv_kernels="native", cudnn_plans=True)) is False
    assert tb._cudnn_plans("cuda", BuildOptions()) is True  # (on by default)
    assert tb._cudnn_plans("cuda", BuildOptions(cudnn_plans=False)) is False
    assert tb._cudnn_plans("cpu", BuildOptions()) is False
    with_plans = {name: key(m, cuda) for name, m in (("depthwise", model), ("dense", dense))}
    cpu = key(model, {"device": "cpu"})
    monkeypatch.setattr(tb, "_cudnn_plans", lambda device, opts: False)
    without = {name: key(m, cuda) for name, m in (("depthwise", model), ("dense", dense))}
    assert with_plans["depthwise"] != without["depthwise"]
    assert with_plans["dense"] == without["dense"]
    assert key(model, {"device": "cpu"}) == cpu  # (CPU engines never route through it)


# -- on the GPU --------------------------------------------------------------------------------------------------
def _need_frontend():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from parastream.launcher.engines import cudnn_plans

    if cudnn_plans.frontend() is None:
        pytest.skip("needs cuDNN's frontend (nvidia-cudnn-frontend)")
    return cudnn_plans


_FRESH_PLAN = """
import json, sys
import numpy as np
import torch
from parastream.launcher.engines import cudnn_plans as cp
cp.CACHE.load(open(sys.argv[1], "rb").read(), 0)  # offered: deserialized at the first call
x = torch.from_numpy(np.load(sys.argv[2])).cuda().half().to(memory_format=torch.channels_last)
w = torch.from_numpy(np.load(sys.argv[3])).cuda().half()
y = cp.conv2d(x, w, None, [1, 1], [2, 2], [1, 1], x.shape[1])
ref = torch.nn.functional.conv2d(x, w, None, 1, 2, 1, x.shape[1])
print(json.dumps({"sources": sorted(p.source for p in cp.CACHE.plans.values()),
                  "err": float((y.float() - ref.float()).abs().max())}))
"""


@pytest.mark.gpu
def test_a_serialized_plan_runs_in_a_fresh_process_without_being_built(tmp_path):
    cp = _need_frontend()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 48, 23, 23)).astype(np.float32)
    w = (rng.standard_normal((48, 1, 5, 5)) * 0.2).astype(np.float32)
    xt = torch.from_numpy(x).cuda().half().to(memory_format=torch.channels_last)
    wt = torch.from_numpy(w).cuda().half()
    with cp.recording() as keys:
        y = cp.conv2d(xt, wt, None, [1, 1], [2, 2], [1, 1], 48)
    ref = torch.nn.functional.conv2d(xt, wt, None, 1, 2, 1, 48)
    assert float((y.float() - ref.float()).abs().max()) <= 1e-2 and len(keys) == 1
    (tmp_path / "plans.npz").write_bytes(cp.CACHE.serialize(0, {k for _, k in keys}))
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "w.npy", w)
    done = subprocess.run([sys.executable, "-c", _FRESH_PLAN, str(tmp_path / "plans.npz"), str(tmp_path / "x.npy"),
                           str(tmp_path / "w.npy")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["sources"] == ["loaded"] and got["err"] <= 1e-2, got


_FRESH_BUNDLE = """
import json, sys
import numpy as np
from parastream.launcher import load
from parastream.launcher.engines import cudnn_plans as cp
run = load(sys.argv[1])
out = run({"x": np.load(sys.argv[2])})
print(json.dumps({"plans": sorted([p.source, p.serializable] for p in cp.CACHE.plans.values()),
                  "y": np.asarray(out["y"]).tolist()}))
"""


@pytest.mark.gpu
def test_a_bundle_ships_its_depthwise_plans_and_a_fresh_load_builds_none(tmp_path):
    """A torch fp16 build of separable convolutions: the engine's kernels artifact holds the plans its depthwise
    convolutions ran that cuDNN compiled at run time (the serializable ones), a fresh process loads the bundle with
    each of those deserialized, builds only the others (cheap: no kernel to compile), and its output matches ONNX
    Runtime on the fp32 model."""
    _need_frontend()
    from parastream.pipeline import build

    model = separable_as_nasnet()
    onnx.save(model, tmp_path / "sep.onnx")
    bundle = build(tmp_path / "sep.onnx", tmp_path / "b", backend="torch", precision="fp16", search=False,
                   measure=False, cudnn_plans=True)
    assert bundle.manifest["options"]["cudnn_plans"] is True
    assert bundle.report["verification"]["passed"]
    engines = [e for e in bundle.report["engines"].values() if isinstance(e, dict)]
    shipped = sum(e.get("cudnn_plans", 0) for e in engines)
    assert shipped >= 1, json.dumps(engines)[:600]
    x = np.random.default_rng(8).standard_normal((1, 40, 17, 17)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    done = subprocess.run([sys.executable, "-c", _FRESH_BUNDLE, str(tmp_path / "b"), str(tmp_path / "x.npy")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    loaded = [p for p in got["plans"] if p[0] == "loaded"]
    assert len(loaded) == shipped and all(ser for _, ser in loaded), got["plans"]
    assert all(src == "loaded" or not ser for src, ser in got["plans"]), got["plans"]  # no compiled kernel built
    ref = _ort(model, {"x": x})["y"]
    err = float(np.abs(np.asarray(got["y"]) - ref).max() / np.abs(ref).max())
    assert err < 1e-2, err


_SHARED = """
import json, sys
import torch
import torch._inductor  # noqa: F401 - a build's process (compile workers import Inductor)
from parastream.launcher.engines import cudnn_plans as cp
x = torch.randn(1, 40, 19, 19, device="cuda").half().to(memory_format=torch.channels_last)
w = torch.randn(40, 1, 7, 7, device="cuda").half()
y = cp.conv2d(x, w, None, [1, 1], [3, 3], [1, 1], 40)
ref = torch.nn.functional.conv2d(x, w, None, 1, 3, 1, 40)
print(json.dumps({"sources": [p.source for p in cp.CACHE.plans.values()],
                  "err": float((y.float() - ref.float()).abs().max() / ref.float().abs().max())}))
"""


@pytest.mark.gpu
def test_the_processes_of_a_build_share_the_plans_they_build(tmp_path):
    """A process that has imported Inductor (a build's, a compile worker) writes each plan it builds beside
    Inductor's cache, and the next such process deserializes it instead of building it."""
    _need_frontend()
    import os

    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    runs = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", _SHARED], capture_output=True, text=True, timeout=300, env=env)
        assert done.returncode == 0, done.stderr[-2000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    assert runs[0]["sources"] == ["built"] and runs[1]["sources"] == ["shared"], runs
    assert all(r["err"] < 1e-2 for r in runs), runs
    assert len(list((tmp_path / "inductor" / "parastream-cudnn-plans").glob("*.plan"))) == 1


def test_the_option_is_recorded_and_read_back_at_load():
    """``cudnn_plans`` is a build option that manifest.json records and a load reads back (a JIT engine compiled at
    load converts its depthwise convolutions as the build did)."""
    from parastream.launcher.bundle import Bundle
    from parastream.launcher.engines.base import BuildOptions
    from parastream.pipeline.build import _launcher_options

    assert _launcher_options(BuildOptions(cudnn_plans=True))["cudnn_plans"] is True
    assert _launcher_options(BuildOptions(cudnn_plans=False))["cudnn_plans"] is False
    assert _launcher_options(BuildOptions())["cudnn_plans"] is True  # (on by default)
    assert "cudnn_plans" in Bundle.LOAD_OPTIONS


def test_the_command_line_turns_the_plans_off():
    """On by default; ``--no-cudnn-plans`` builds torch's convolutions, whose plans every process builds."""
    import argparse

    from parastream.pipeline.cli import add_backend_args

    parser = argparse.ArgumentParser()
    add_backend_args(parser)
    assert parser.parse_args([]).cudnn_plans is True
    assert parser.parse_args(["--no-cudnn-plans"]).cudnn_plans is False


_NO_DYNAMO = """
import json, sys
import torch
from parastream.launcher.engines import cudnn_plans as cp
cp.register_op()
x, w = torch.randn(1, 8, 10, 10), torch.randn(8, 1, 3, 3)
with torch.no_grad():
    y = torch.ops.parastream.cudnn_conv2d(x, w, None, [1, 1], [1, 1], [1, 1], 8, True)
ref = torch.relu(torch.nn.functional.conv2d(x, w, None, 1, 1, 1, 8))
print(json.dumps({"err": float((y - ref).abs().max()),
                  "imported": sorted(m for m in sys.modules if m.split(".")[:2] in (["torch", "_dynamo"],
                                                                                   ["torch", "_inductor"]))}))
"""


def test_calling_the_op_imports_neither_dynamo_nor_inductor():
    """A bundle's load calls the op from compiled engines: it must not pull in torch._dynamo (800 modules, about a
    second of a fresh load; ``torch.library.custom_op`` implementations do at their first call)."""
    done = subprocess.run([sys.executable, "-c", _NO_DYNAMO], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["imported"] == [] and got["err"] < 1e-5, got


_CLOSED_STREAM = """
import json
import torch
from parastream.launcher.engines import cudnn_plans as cp
def run(c, k):
    x = torch.randn(1, c, 17, 17, device="cuda").half().to(memory_format=torch.channels_last)
    w = torch.randn(c, 1, k, k, device="cuda").half()
    return cp.conv2d(x, w, None, [1, 1], [k // 2, k // 2], [1, 1], c)
# a plan built for one key and run on a stream that is then destroyed (a launcher closed)
s = torch.cuda.Stream()
with torch.cuda.stream(s):
    run(24, 3)
torch.cuda.synchronize()
with cp.recording() as keys:
    run(40, 5)
blob = cp.CACHE.serialize(0, {k for _, k in keys})
del s
torch.cuda.synchronize()
s2 = torch.cuda.Stream()
with torch.cuda.stream(s2):
    run(24, 3)  # the handle's last stream: s2, destroyed below
del s2
torch.cuda.synchronize()
cp.CACHE.plans = {k: p for k, p in cp.CACHE.plans.items() if k[1] not in {k for _, k in keys}}
cp.CACHE.load(blob, 0)  # offered again: deserialized at the next call, after the stream went
y = run(40, 5)
print(json.dumps({"sources": sorted(p.source for p in cp.CACHE.plans.values()), "finite": bool(torch.isfinite(y).all())}))
"""


@pytest.mark.gpu
def test_a_plan_deserialized_after_the_stream_last_used_was_destroyed_runs():
    """cuDNN's frontend runs a deserialized plan once in a capture on the handle's stream (``Graph::warmup``): a
    stream a closed launcher destroyed must not be it (the GPU tier crashed so, a test's launcher closed before the
    next test's build deserialized a plan)."""
    _need_frontend()
    done = subprocess.run([sys.executable, "-c", _CLOSED_STREAM], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert "loaded" in got["sources"] and got["finite"], got


def test_plan_sources_count_where_the_processes_plans_came_from(monkeypatch):
    """``plan_sources`` (what a load's log and the benchmarks report): the plans by source, the seconds the built
    ones took and how many of those were runtime-compiled kernels (the costly ones a bundle ships), the keys cuDNN
    could not plan, the offered plans not yet used, and whether the frontend loaded."""
    from parastream.launcher.engines import cudnn_plans as cp

    cache = cp.PlanCache()
    plans = [("loaded", 0.02, True), ("loaded", 0.02, True), ("built", 0.4, True), ("built", 0.25, False),
             ("shared", 0.0, True)]
    for i, (source, s, compiled) in enumerate(plans):
        cache.plans[(0, f"k{i}")] = cp._Plan(None, 0, s, source, serializable=compiled)
    cache.failed[(0, "odd")] = "no engine"
    cache.pending[(0, "later")] = b"plan"
    monkeypatch.setattr(cp, "CACHE", cache)
    monkeypatch.setattr(cp, "_FRONTEND", [])
    got = cp.plan_sources()
    assert got == {"plans_loaded": 2, "plans_shared": 1, "plans_built": 2, "plans_built_s": 0.65,
                   "plans_built_compiled": 1, "plans_failed": 1, "plans_pending": 1}
    monkeypatch.setattr(cp, "_FRONTEND", [None])  # tried, not loaded: torch's convolutions build their own plans
    assert cp.plan_sources()["frontend"] == 0


def test_plans_not_used_as_shipped_are_counted_with_the_reason(monkeypatch):
    """Shipped plans a process builds again say why (``plans_refused``, the line a Triton start logs after its load
    phases): a file serialized for another GPU or cuDNN is refused whole, and an offered plan that cannot be read
    back is built at its key's first call, the reader's error named; with no reason, nothing is said."""
    import io

    from parastream.launcher.engines import cudnn_plans as cp

    cache = cp.PlanCache()
    monkeypatch.setattr(cp, "CACHE", cache)
    monkeypatch.setattr(cp, "_TAGS", {0: "NVIDIA H200|sm90|cudnn91900"})
    assert cp.plans_refused() == {}
    buf = io.BytesIO()
    np.savez(buf, __tag__=np.frombuffer(b"NVIDIA H100|sm90|cudnn91000", dtype=np.uint8),
             key0=np.frombuffer(b"k", dtype=np.uint8), plan0=np.zeros(4, dtype=np.uint8))
    got = cache.load(buf.getvalue(), 0)
    assert got["skipped"] == "plans for NVIDIA H100|sm90|cudnn91000, not NVIDIA H200|sm90|cudnn91900"
    assert cache.pending == {}

    def unreadable(handle, data, source="loaded"):
        raise RuntimeError("cudnnGraphNotSupportedError: deserialize failed")

    def built(handle, key, device_index):
        return cp._Plan(None, 0, 0.5, "built", serializable=True)

    monkeypatch.setattr(cp, "_deserialize", unreadable)
    monkeypatch.setattr(cp, "_build", built)
    monkeypatch.setattr(cache, "handle", lambda device_index: None)
    cache.pending[(0, "k")] = np.zeros(4, dtype=np.uint8)
    assert cache.get(0, "k").source == "built"
    assert cp.plans_refused() == {
        "plans for NVIDIA H100|sm90|cudnn91000, not NVIDIA H200|sm90|cudnn91900": 1,
        "not read back (RuntimeError: cudnnGraphNotSupportedError: deserialize failed)": 1}
    assert cp.plan_sources()["plans_built_compiled"] == 1


def test_a_swish_plan_has_a_key_of_its_own_and_the_plans_before_keep_theirs():
    """``plan_key``'s activation: a conv + bias + SiLU plan (cuDNN's SWISH_FWD in the kernel) is keyed apart from
    the conv + bias one, whose key, and every ReLU key, is as shipped plans have it; anything else is refused."""
    from parastream.launcher.engines import cudnn_plans as cp

    args = ("float16", [1, 8, 6, 6], [8, 1, 3, 3], [1, 1], [1, 1], [1, 1])
    plain, relu, swish = cp.plan_key(*args, True), cp.plan_key(*args, True, True), cp.plan_key(*args, True, act="swish")
    assert json.loads(plain) == ["float16", [1, 8, 6, 6], [8, 1, 3, 3], [1, 1], [1, 1], [1, 1], 1, 0]
    assert json.loads(relu)[-1] == 1 and len(json.loads(relu)) == 8
    assert json.loads(swish) == [*json.loads(plain), "swish"]
    for bad in ({"relu": True, "act": "swish"}, {"act": "gelu"}):
        with pytest.raises(ValueError, match="plan activation"):
            cp.plan_key(*args, True, **bad)


@pytest.mark.parametrize("act", ["swish", None])
def test_the_op_with_a_swish_off_the_gpu_equals_onnxruntime_s_conv_sigmoid_mul(act):
    """Off the GPU the op is torch's convolution and, for ``act="swish"``, SiLU after it: equal to ONNX Runtime's
    Conv -> Sigmoid -> Mul, the form exporters write SiLU in (without ``act``, to its Conv alone)."""
    from parastream.launcher.engines import cudnn_plans as cp

    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, 8, 9, 9)).astype(np.float32)
    w = (rng.standard_normal((8, 1, 3, 3)) / 3).astype(np.float32)
    b = rng.standard_normal(8).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], group=8, pads=[1, 1, 1, 1], strides=[2, 2])]
    if act:
        nodes += [helper.make_node("Sigmoid", ["c"], ["s"]), helper.make_node("Mul", ["c", "s"], ["y"])]
    else:
        nodes += [helper.make_node("Identity", ["c"], ["y"])]
    g = helper.make_graph(nodes, "silu", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          [onnx.numpy_helper.from_array(w, "w"), onnx.numpy_helper.from_array(b, "b")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    ref = _ort(model, {"x": x})["y"]
    got = cp.conv2d(torch.from_numpy(x), torch.from_numpy(w), torch.from_numpy(b), [2, 2], [1, 1], [1, 1], 8, act=act)
    assert got.is_contiguous(memory_format=torch.channels_last)
    np.testing.assert_allclose(got.numpy(), ref, rtol=1e-5, atol=1e-6)
