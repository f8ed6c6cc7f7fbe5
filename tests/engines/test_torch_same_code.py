"""Branches whose traced graphs are the same compile once per process (``compile_inductor``'s ``_SAME_CODE``): the
weights are graph inputs, so a branch that differs from one compiled before only in its names and weights gets
that one's artifact with its own weights.bin, without Inductor.  A value the converter folds into the code (a
scalar Mul or Clip bound held as an initializer) makes another graph, though ``structure_key`` (which only groups
compile jobs) cannot tell them apart.  On the CPU, as CI runs Inductor."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
from onnx import numpy_helper

torch = pytest.importorskip("torch")

from parastream.launcher.engines import BuildOptions  # noqa: E402
from parastream.launcher.engines import torch as tb  # noqa: E402
from test_torch_aoti import IN, OUT, branch, ort  # noqa: E402

pytestmark = pytest.mark.slow


def renamed(seed: int):
    """``branch(seed)`` under other node and tensor names (another branch of a plan)."""
    m = branch(seed)
    for n in m.graph.node:
        n.name = "other_" + n.name
        n.input[:] = [x if x == "x" else "other_" + x for x in n.input]
        n.output[:] = [x if x == "y" else "other_" + x for x in n.output]
    for t in m.graph.initializer:
        t.name = "other_" + t.name
    return m


def clipped(seed: int, hi: float):
    """``branch(seed)`` with its Relu a Clip to [0, ``hi``], both bounds initializers: the converter folds them
    into the code (``torch.clamp(x, 0.0, hi)``), so another ``hi`` is another graph with the same structure key."""
    from onnx import helper

    m = branch(seed)
    m.graph.initializer.extend([numpy_helper.from_array(np.array(0.0, np.float32), "lo"),
                                numpy_helper.from_array(np.array(hi, np.float32), "hi")])
    m.graph.node[1].CopyFrom(helper.make_node("Clip", ["c", "lo", "hi"], ["r"], name="clip"))
    return m


@pytest.fixture
def compiles(monkeypatch):
    """Inductor's compiles in this test (``standalone_compile`` calls), on a clean per-process memory."""
    import torch._inductor

    tb.clear_memory_cache()
    calls = []
    real = torch._inductor.standalone_compile

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(torch._inductor, "standalone_compile", counting)
    yield calls
    tb.clear_memory_cache()


def _compile(model, views=None):
    nhwc = {"x", "y"} if views else set()
    return tb.compile_inductor(model, [IN], [OUT], "cpu", "float32", nhwc, views or {}, BuildOptions(device="cpu"))


def _run(data, extra, weights, x):
    run = tb._load_inductor(data, lambda: weights, dict(extra, dtype="float32", built_for=tb.built_for("cpu")), "cpu")
    y = torch.empty(OUT.shape)
    with torch.no_grad():
        run(torch.from_numpy(x), y)
    return y.numpy()


def test_a_branch_with_the_same_graph_and_other_names_and_weights_reuses_the_code_with_its_own_weights(compiles):
    first = _compile(branch(4))
    again = _compile(renamed(5))
    assert len(compiles) == 1
    assert again[0] == first[0] and again[1].get("code_reused") and not first[1].get("code_reused")
    assert again[2] != first[2]  # its own weights.bin
    assert again[1]["params"] == first[1]["params"] and again[1]["param_specs"] == first[1]["param_specs"]
    assert again[1]["param_digests"] != first[1]["param_digests"]
    x = np.random.default_rng(9).standard_normal(IN.shape).astype(np.float32)
    np.testing.assert_allclose(_run(*again, x), ort(branch(5), x), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(_run(*first, x), ort(branch(4), x), rtol=1e-5, atol=1e-5)


def test_a_constant_folded_into_the_code_is_another_graph_though_the_structure_key_is_the_same(compiles):
    sig = tb._layout([IN], [OUT], "cpu", (), {})[2]
    assert tb.structure_key(clipped(6, 0.25), sig) == tb.structure_key(clipped(4, 6.0), sig)
    _compile(clipped(4, 6.0))
    other = _compile(clipped(6, 0.25))
    assert len(compiles) == 2 and not other[1].get("code_reused")
    x = np.random.default_rng(10).standard_normal(IN.shape).astype(np.float32)
    np.testing.assert_allclose(_run(*other, x), ort(clipped(6, 0.25), x), rtol=1e-5, atol=1e-5)
    assert np.abs(ort(clipped(6, 0.25), x) - ort(clipped(6, 6.0), x)).max() > 0.1  # the bound matters here


def test_other_strides_are_another_graph(compiles):
    _compile(branch(4))
    _compile(branch(4), views={"y": (10, 3)})
    assert len(compiles) == 2


def test_the_build_reports_the_reuse_and_engine_json_does_not_carry_it(compiles):
    layout = {"inputs": [IN], "outputs": [OUT]}
    builder = tb.Builder(BuildOptions(device="cpu", torch_artifact="inductor", compile_workers=1))
    a, b = builder.build_all([(branch(7), "branch_000", layout), (renamed(8), "branch_001", layout)])
    assert len(compiles) == 1
    rep = builder.report()
    assert rep["branch_001"].get("code_reused") and not rep["branch_000"].get("code_reused")
    assert "code_reused" not in tb.EngineFile(b).meta
    x = np.random.default_rng(11).standard_normal(IN.shape).astype(np.float32)
    np.testing.assert_allclose(tb.load(b, [IN], [OUT], device="cpu").run({"x": x})["y"], ort(renamed(8), x),
                               rtol=1e-5, atol=1e-5)


def test_with_a_cache_dir_a_rebuild_whose_weights_changed_compiles_nothing(compiles, tmp_path):
    """A model rebuilt with one changed weight: its branch misses the compiled-branch cache (keyed by the branch
    with its weights), but a process with an empty memory finds the code in DIR/torch-code/ and compiles nothing."""
    options = BuildOptions(device="cpu", cache_dir=str(tmp_path))
    first = tb.compile_inductor(branch(4), [IN], [OUT], "cpu", "float32", set(), {}, options)
    assert list((tmp_path / "torch-code").glob("*.bin"))
    tb.clear_memory_cache()  # another process
    changed = branch(4)
    w = numpy_helper.to_array(changed.graph.initializer[0]).copy()
    w[0, 0, 0, 0] += 1.0
    changed.graph.initializer[0].CopyFrom(numpy_helper.from_array(w, "w"))
    again = tb.compile_inductor(changed, [IN], [OUT], "cpu", "float32", set(), {}, options)
    assert len(compiles) == 1 and again[1].get("code_reused") and again[0] == first[0] and again[2] != first[2]
    x = np.random.default_rng(12).standard_normal(IN.shape).astype(np.float32)
    np.testing.assert_allclose(_run(*again, x), ort(changed, x), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_a_compile_workers_gpu_runs_take_shared_turns_on_the_gpu(monkeypatch):
    """In a compile worker the kernels artifact's two runs (Inductor's autotuning included) each happen inside a
    shared ``cuda.gpu_turn``, which the build's timings wait for; outside a worker (a build compiling in its own
    process, which may hold the exclusive turn itself while it times) the turns are not taken."""
    from parastream.launcher import cuda

    tb.clear_memory_cache()
    turns = []
    real_turn = cuda.gpu_turn

    @contextlib.contextmanager
    def turn(device=0, enabled=True, shared=False):
        turns.append((enabled, shared))
        with real_turn(device, enabled=enabled, shared=shared):
            yield

    monkeypatch.setattr(cuda, "gpu_turn", turn)
    opts = BuildOptions(device="cuda", precision="fp32")
    for in_worker, seed in ((True, 11), (False, 12)):
        monkeypatch.setattr(tb, "_IN_WORKER", in_worker)
        tb.clear_memory_cache()  # the second branch is the first's code: it would reuse it and run nothing
        turns.clear()
        data, extra, _ = tb.compile_inductor(branch(seed), [IN], [OUT], "cuda", "float32", set(), {}, opts)
        assert extra.get("compiled") == "kernels", extra.get("kernels_error")
        assert turns == [(in_worker, True), (in_worker, True)]
    tb.clear_memory_cache()
