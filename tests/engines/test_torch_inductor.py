"""Torch engines as Inductor precompiled artifacts (``--torch-artifact inductor``, the default: ``standalone_compile`` at
build, ``CompiledArtifact.load`` at load): built once, loaded in a fresh process with empty caches without
dynamo, AOTAutograd or Inductor codegen, writing into the tensors it is given, refused where it was not compiled
for, cached by branch.  Inductor compiles for the CPU too, which is how these run in CI (tiny branches, one
compile of a few seconds each); the GPU path is test_inductor_gpu_* below."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
import types
import zipfile

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

torch = pytest.importorskip("torch")

from parastream.launcher.engines import BuildOptions  # noqa: E402
from parastream.launcher.engines import torch as tb  # noqa: E402
from parastream.launcher.errors import ParastreamError  # noqa: E402
from compiled_gpu import (assert_another_architecture_is_refused_naming_the_file,  # noqa: E402
                          assert_ships_compiled_engines_verified_as_loaded, retag as _retag, scaled_error,
                          small_net_bundle)
from test_torch_aoti import IN, LAYOUT, OUT, branch, ort  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Branches 1 and 2 compiled once into a disk cache (in this process), with a count of the compiles."""
    cache = tmp_path_factory.mktemp("engine-cache")
    calls = []
    real = tb.compile_inductor

    def counting(br, *a, **k):
        calls.append(float(numpy_helper.to_array(br.graph.initializer[0]).ravel()[0]))
        return real(br, *a, **k)

    tb.compile_inductor = counting
    old_env = os.environ.get("PARASTREAM_COMPILE_WORKERS")
    os.environ["PARASTREAM_COMPILE_WORKERS"] = "1"  # in this process, so that the count sees every compile
    tb.clear_memory_cache()
    try:
        builder = tb.Builder(BuildOptions(device="cpu", cache_dir=str(cache)))
        a, b = builder.build_all([(branch(1), "branch_000", LAYOUT), (branch(2), "branch_001", LAYOUT)])
        yield types.SimpleNamespace(a=a, b=b, report=builder.report(), cache=cache, calls=calls)
    finally:
        tb.compile_inductor = real
        if old_env is None:
            os.environ.pop("PARASTREAM_COMPILE_WORKERS", None)
        else:
            os.environ["PARASTREAM_COMPILE_WORKERS"] = old_env


def test_engine_holds_an_inductor_artifact_and_its_weights_names(built):
    meta, onnx_bytes, artifact = tb.unpack(built.a)
    assert meta["compiled"] == "inductor" and artifact is not None
    with zipfile.ZipFile(__import__("io").BytesIO(built.a)) as z:
        assert sorted(z.namelist()) == ["branch.onnx", "engine.json", "inductor.bin", "weights.bin"]
        blob = z.read("weights.bin")
    assert meta["built_for"] == tb.built_for("cpu")
    # the weights are graph inputs, named by the converted module's buffers, with what they were compiled for
    assert len(meta["params"]) == len(meta["param_specs"]) == 3 and meta["param_specs"][0] == [[4, 3, 3, 3], [27, 9, 3, 1], "float32"]
    # weights.bin holds those tensors, each at its aligned offset: the first is the branch's Conv weight
    w = numpy_helper.to_array(branch(1).graph.initializer[0])
    assert meta["param_offsets"][0] == 0 and all(o % 64 == 0 for o in meta["param_offsets"])
    np.testing.assert_array_equal(np.frombuffer(blob, np.float32, count=w.size).reshape(w.shape), w)
    rep = built.report["branch_000"]
    assert rep["compiled"] == "inductor" and rep["cache"] == "miss" and rep["package_bytes"] == len(artifact)
    assert len(built.calls) == 2


def test_loads_in_a_fresh_process_with_empty_caches_without_compiling_and_matches_onnxruntime(built, tmp_path):
    """The artifact is self-contained: a process whose Inductor and Triton caches are empty loads it with no
    dynamo graph, no AOTAutograd or FX-graph cache miss and no Inductor codegen (which would raise here).
    Branch 1 is loaded after branch 2, whose compile was a hit in the Inductor caches branch 1 had filled (the
    same graph: the weights are inputs), so its artifact must hold everything too (where the two artifacts are
    the same bytes, the process loads them once)."""
    engine = tmp_path / "branch_000.zip"
    engine.write_bytes(built.a)
    (tmp_path / "branch_001.zip").write_bytes(built.b)
    x = np.random.default_rng(7).standard_normal(IN.shape).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    script = textwrap.dedent(f"""
        import json, numpy as np
        import torch, torch._dynamo.utils
        from torch._inductor.graph import GraphLowering

        def codegen(*a, **k):
            raise AssertionError("Inductor generated code at load")

        GraphLowering.codegen = GraphLowering.codegen_with_cpp_wrapper = codegen  # a load must never get here
        from parastream.launcher.engines import BuildOptions, torch as tb
        from parastream.launcher.plan import TensorSpec
        ins, outs = [TensorSpec("x", "float32", {IN.shape})], [TensorSpec("y", "float32", {OUT.shape})]
        x = np.load({str(tmp_path / 'x.npy')!r})
        for name in ("branch_001", "branch_000"):
            e = tb.load(open({str(tmp_path)!r} + f"/{{name}}.zip", "rb").read(), ins, outs, device="cpu", options=BuildOptions())
            assert not e.compiled_at_load
            np.save({str(tmp_path)!r} + f"/{{name}}.npy", e.run({{"x": x}})["y"])
        c = torch._dynamo.utils.counters
        print(json.dumps({{"compiled_at_load": e.compiled_at_load, "because": e.compiled_at_load_because, "dynamo_graphs": c["stats"]["unique_graphs"],
                          "inductor": dict(c["inductor"]), "aot_autograd": dict(c["aot_autograd"])}}))
    """)
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "empty-inductor"), TRITON_CACHE_DIR=str(tmp_path / "empty-triton"))
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    info = json.loads(p.stdout.strip().splitlines()[-1])
    assert info["compiled_at_load"] is False and info["dynamo_graphs"] == 0, info
    distinct = len({tb.unpack(built.a)[2], tb.unpack(built.b)[2]})  # equal bytes load once (_LOADED_ARTIFACTS)
    if tb.inductor_format(BuildOptions()) == "cache":  # its entries are written into the empty cache and found there
        assert info["inductor"].get("fxgraph_cache_hit") == distinct, info
    else:  # "bundled": the compiled function itself, no cache lookup at all
        assert not info["inductor"].get("fxgraph_cache_hit"), info
    assert not info["inductor"].get("fxgraph_cache_miss"), info
    assert not info["aot_autograd"].get("autograd_cache_miss"), info
    np.testing.assert_allclose(np.load(tmp_path / "branch_000.npy"), ort(branch(1), x), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.load(tmp_path / "branch_001.npy"), ort(branch(2), x), rtol=1e-5, atol=1e-5)


def test_an_engine_loaded_again_in_a_process_reads_no_weights_and_shares_them(built, monkeypatch):
    """The search's candidates and the build's alternatives reload unchanged branches: the second load of the same
    engine file takes the first one's weights (weights.bin not even read) and artifact, and computes the same;
    another branch's engine (same structure, same artifact bytes) has its own weights.  No load converts
    branch.onnx."""
    from parastream.launcher.engines import onnx_torch

    monkeypatch.setattr(onnx_torch, "convert", lambda *a, **k: pytest.fail("a compiled engine's load converted"))
    x = np.random.default_rng(9).standard_normal(IN.shape).astype(np.float32)
    first = tb.load(built.a, [IN], [OUT], device="cpu")
    reads = []
    real = tb.EngineFile.weights_view
    monkeypatch.setattr(tb.EngineFile, "weights_view", lambda self: reads.append(1) or real(self))
    code_reads = []
    real_code = tb.EngineFile.compiled
    monkeypatch.setattr(tb.EngineFile, "compiled", lambda self: code_reads.append(1) or real_code(self))
    again = tb.load(built.a, [IN], [OUT], device="cpu")
    assert not reads
    assert all(p is q for p, q in zip(again._runner.params, first._runner.params))
    assert again._runner.artifact is first._runner.artifact
    other = tb.load(built.b, [IN], [OUT], device="cpu")
    assert reads == [1]
    assert not code_reads  # the artifact loaded already, found by engine.json's artifact_sha256: its code not read
    assert not all(p is q for p, q in zip(other._runner.params, first._runner.params))
    np.testing.assert_array_equal(again.run({"x": x})["y"], first.run({"x": x})["y"])
    np.testing.assert_allclose(other.run({"x": x})["y"], ort(branch(2), x), rtol=1e-5, atol=1e-5)


def test_an_engine_file_without_the_artifact_s_digest_is_read_and_hashed_and_shares_the_artifact(built):
    """Must not fire: an engine file written before engine.json named its artifact's sha256 loads as before (its
    compiled code read and hashed) and finds the artifact another engine of the same code loaded."""
    f = tb.EngineFile(built.a)
    assert f.meta["artifact_sha256"] == hashlib.sha256(f.compiled()).hexdigest()  # what pack records
    first = tb.load(built.a, [IN], [OUT], device="cpu")
    older = _without_digest(built.a)
    assert "artifact_sha256" not in tb.EngineFile(older).meta
    again = tb.load(older, [IN], [OUT], device="cpu")
    assert again._runner.artifact is first._runner.artifact
    x = np.random.default_rng(7).standard_normal(IN.shape).astype(np.float32)
    np.testing.assert_array_equal(again.run({"x": x})["y"], first.run({"x": x})["y"])


def test_compiled_code_that_is_not_the_one_engine_json_names_is_one_clear_error(built):
    tb._LOADED_ARTIFACTS.clear()  # a miss: the code is read, and checked against the digest
    f = tb.EngineFile(built.a)
    damaged = _with_meta(built.a, dict(f.meta, artifact_sha256="0" * 64))
    with pytest.raises(ParastreamError, match="artifact_sha256"):
        tb.load(damaged, [IN], [OUT], device="cpu")


def _with_meta(data: bytes, meta: dict) -> bytes:
    """The engine file with engine.json replaced by ``meta``, every other member as it was (not through ``pack``,
    which names the artifact's digest itself)."""
    import io

    src = zipfile.ZipFile(io.BytesIO(data))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for info in src.infolist():
            body = json.dumps(meta, indent=1).encode() if info.filename == "engine.json" else src.read(info)
            z.writestr(info, body)
    return buf.getvalue()


def _without_digest(data: bytes) -> bytes:
    meta = tb.EngineFile(data).meta
    return _with_meta(data, {k: v for k, v in meta.items() if k != "artifact_sha256"})


def test_the_other_branch_computes_with_its_own_weights(built):
    x = np.random.default_rng(8).standard_normal(IN.shape).astype(np.float32)
    e = tb.load(built.b, [IN], [OUT], device="cpu")
    assert not e.compiled_at_load
    np.testing.assert_allclose(e.run({"x": x})["y"], ort(branch(2), x), rtol=1e-5, atol=1e-5)
    assert np.abs(ort(branch(1), x) - ort(branch(2), x)).max() > 0.1  # the two branches really differ


def test_outputs_are_written_into_a_channel_view_and_nothing_else(tmp_path):
    """The launcher's tensors: a channels-last input and an output that is channels [3, 7) of a 10-channel
    channels-last buffer (an in-place Concat's slice).  The artifact writes exactly that slice."""
    nhwc, views = {"x", "y"}, {"y": (10, 3)}
    data, extra, weights = tb.compile_inductor(branch(3), [IN], [OUT], "cpu", "float32", nhwc, views,
                                               BuildOptions(device="cpu"))
    meta = dict(extra, dtype="float32", built_for=tb.built_for("cpu"))
    run = tb._load_inductor(data, lambda: weights, meta, "cpu")
    x = tb._tensor(IN, True, None, "cpu")
    full = torch.full((1, 8, 8, 10), 7.0)
    y = full[..., 3:7].permute(0, 3, 1, 2)
    assert x.is_contiguous(memory_format=torch.channels_last) and not y.is_contiguous()
    with torch.no_grad():
        run(x, y)
    np.testing.assert_allclose(y.numpy(), ort(branch(3), x.contiguous().numpy()), rtol=1e-5, atol=1e-5)
    assert (full[..., :3] == 7).all() and (full[..., 7:] == 7).all()  # the other channels untouched
    with torch.no_grad():  # and it was compiled for these strides: contiguous ones are another engine
        sig = tb._layout([IN], [OUT], "cuda", nhwc, views)[2]
    assert sig != tb._layout([IN], [OUT], "cuda", (), {})[2]


@pytest.mark.parametrize("other, says", [
    ({"torch": "2.0.0+cu118"}, r"compiled for the CPU \(.*\), torch 2\.0\.0\+cu118; this machine has the CPU"),
    ({"device": "cuda", "arch": "sm_90", "gpu": "NVIDIA H100 80GB HBM3", "cuda": "12.8", "machine": None},
     r"compiled for NVIDIA H100 80GB HBM3 \(sm_90\), torch .*, CUDA 12\.8; this machine has the CPU"),
])
def test_an_artifact_compiled_elsewhere_is_refused_saying_for_what(built, other, says):
    with pytest.raises(ParastreamError, match=says):
        tb.load(_retag(built.a, **other), [IN], [OUT], device="cpu")


def test_engines_of_the_same_weights_share_them(built):
    """Two loads of one engine (a dynamic batch's buckets hold the same weights) hold one copy of its weights."""
    e1, e2, other = (tb.load(d, [IN], [OUT], device="cpu") for d in (built.a, built.a, built.b))
    ptrs = [{p.data_ptr() for p in e._runner.params} for e in (e1, e2, other)]
    assert ptrs[0] == ptrs[1] and len(ptrs[0]) == 3
    shared = [p for p in other._runner.params if p.data_ptr() in ptrs[0]]  # branch 2: other w and b, the same 0.5
    assert [(p.tolist(), tuple(p.shape)) for p in shared] == [(0.5, ())]  # "half": a 0-d weight, held 0-d
    x = np.random.default_rng(14).standard_normal(IN.shape).astype(np.float32)
    np.testing.assert_allclose(e2.run({"x": x})["y"], ort(branch(1), x), rtol=1e-5, atol=1e-5)


def test_an_artifact_is_loaded_once_per_process_for_every_engine_that_ships_it(built, monkeypatch):
    """The weights are the artifact's inputs, so engines whose artifacts have the same bytes (the search's
    candidates reload every unchanged branch) call one loaded artifact, each with its own weights."""
    tb._LOADED_ARTIFACTS.clear()
    calls = []
    real = tb._load_artifact
    monkeypatch.setattr(tb, "_load_artifact", lambda *a: calls.append(1) or real(*a))
    e1, e2 = (tb.load(built.a, [IN], [OUT], device="cpu") for _ in range(2))
    assert len(calls) == 1 and e1._runner.artifact is e2._runner.artifact
    e3 = tb.load(built.b, [IN], [OUT], device="cpu")
    same_bytes = tb.unpack(built.a)[2] == tb.unpack(built.b)[2]
    assert len(calls) == (1 if same_bytes else 2)
    x = np.random.default_rng(15).standard_normal(IN.shape).astype(np.float32)
    for e, b in ((e1, 1), (e2, 1), (e3, 2)):
        np.testing.assert_allclose(e.run({"x": x})["y"], ort(branch(b), x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("damage, says", [
    (lambda meta, w: (meta, None), "weights.bin does not hold weight 0"),  # no weights.bin
    (lambda meta, w: (meta, w[:100]), "weights.bin does not hold weight 0"),  # cut short
    (lambda meta, w: (dict(meta, param_offsets=[8] + meta["param_offsets"][1:]), w), "does not hold weight 0"),
    # strides under which elements would overlap (or read the next weight's bytes)
    (lambda meta, w: (dict(meta, param_specs=[[[4, 3, 3, 3], [1, 1, 1, 1], "float32"]] + meta["param_specs"][1:]), w),
     "gives weight 0 a layout weights.bin cannot hold"),
    (lambda meta, w: (dict(meta, param_digests=meta["param_digests"][:1]), w), "does not describe its weights"),
])
def test_weights_that_engine_json_does_not_describe_are_one_clear_error(built, damage, says):
    tb._SHARED_PARAMS.clear()  # an earlier test's load of these weights would answer without reading
    f = tb.EngineFile(built.a)
    meta, weights = damage(json.loads(json.dumps(f.meta)), f.weights())
    with pytest.raises(ParastreamError, match=says):
        tb.load(tb.pack(meta, f.onnx(), f.compiled(), weights), [IN], [OUT], device="cpu")


def test_an_artifact_of_another_torch_build_is_one_clear_error(built):
    """Same torch version, another build of it (``torch_key``, the hash of torch's sources the artifact carries)."""
    from torch.utils._appending_byte_serializer import BytesReader, BytesWriter

    f = tb.EngineFile(built.a)
    meta, onnx_bytes, artifact = f.meta, f.onnx(), f.compiled()
    r = BytesReader(artifact)
    header, _key = r.read_bytes(), r.read_bytes()
    w = BytesWriter()
    w.write_bytes(header)
    w.write_bytes(b"another torch build")
    if header == b"AOTCompiledArtifact":  # "bundled": the compiled function follows
        w.write_bytes(r.read_bytes())
    else:  # "cache": the cache key, then Inductor's cache entries
        w.write_str(r.read_str())
        w.write_bytes(r.read_bytes())
    with pytest.raises(ParastreamError, match="compiled by another build of torch"):
        tb.load(tb.pack(meta, onnx_bytes, w.to_bytes(), f.weights()), [IN], [OUT], device="cpu")


def test_cache_hit_across_builds_with_a_cache_dir_and_one_changed_branch_compiles_alone(built, monkeypatch):
    monkeypatch.setenv("PARASTREAM_COMPILE_WORKERS", "1")
    n = len(built.calls)  # the fixture counts every compile_inductor while this module runs
    renamed = branch(1)
    renamed.graph.name = "net_branch_042"  # the same branch under another candidate's index
    builder = tb.Builder(BuildOptions(device="cpu", cache_dir=str(built.cache)))
    a2, b3 = builder.build_all([(renamed, "branch_042", LAYOUT), (branch(3), "branch_043", LAYOUT)])
    assert builder.report()["branch_042"]["cache"] == "memory" and tb.unpack(a2)[2] == tb.unpack(built.a)[2]
    assert builder.report()["branch_043"]["cache"] == "miss" and len(built.calls) == n + 1
    tb.clear_memory_cache()  # a later build: every artifact from --cache-dir, nothing compiled
    again = tb.Builder(BuildOptions(device="cpu", cache_dir=str(built.cache)))
    assert again.build_all([(branch(1), "b0", LAYOUT), (branch(3), "b1", LAYOUT)]) == [built.a, b3]
    assert {r["cache"] for r in again.report().values()} == {"disk"} and len(built.calls) == n + 1
    x = np.random.default_rng(9).standard_normal(IN.shape).astype(np.float32)
    np.testing.assert_allclose(tb.load(b3, [IN], [OUT]).run({"x": x})["y"], ort(branch(3), x), rtol=1e-5, atol=1e-5)


def test_the_artifact_kind_is_part_of_the_cache_key():
    sig = tb._layout([IN], [OUT], "cpu", (), {})[2]
    keys = {tb.cache_key(branch(1), sig, "float32", BuildOptions(device="cpu"), False, tb.built_for("cpu"), a)
            for a in ("aoti", "inductor")}
    assert len(keys) == 2


def test_an_unknown_artifact_is_one_clear_error(monkeypatch):
    with pytest.raises(ParastreamError, match="--torch-artifact tensorrt: the torch backend ships inductor, aoti, jit"):
        tb.Builder(BuildOptions(device="cpu", torch_artifact="tensorrt"))


def other(seed: int) -> onnx.ModelProto:
    """A branch of another structure than ``branch``: its last node adds the constant instead of multiplying."""
    m = branch(seed)
    m.graph.node[2].op_type = "Add"
    return m


def test_structure_key_groups_branches_that_differ_only_in_their_weights():
    sig = tb._layout([IN], [OUT], "cpu", (), {})[2]
    assert tb.structure_key(branch(4), sig) == tb.structure_key(branch(5), sig)  # other weights, one graph
    renamed = branch(5)
    for n in renamed.graph.node:  # other node and tensor names (another branch of the plan), the same graph
        n.name = "other_" + n.name
        n.input[:] = [x if x == "x" else "other_" + x for x in n.input]
        n.output[:] = [x if x == "y" else "other_" + x for x in n.output]
    for t in renamed.graph.initializer:
        t.name = "other_" + t.name
    assert tb.structure_key(renamed, sig) == tb.structure_key(branch(4), sig)
    assert tb.structure_key(renamed, [["z", *s[1:]] for s in sig]) == tb.structure_key(branch(4), sig)
    assert tb.cache_key(branch(4), sig, "float32", BuildOptions(), False, {}) != tb.cache_key(branch(5), sig, "float32", BuildOptions(), False, {})
    assert tb.structure_key(other(4), sig) != tb.structure_key(branch(4), sig)  # another op
    assert tb.structure_key(branch(4), [[*s[:3], True, None] for s in sig]) != tb.structure_key(branch(4), sig)  # layout
    shaped = branch(4)
    shaped.graph.initializer[2].dims[:] = [1]  # another shape of a weight is another graph
    assert tb.structure_key(shaped, sig) != tb.structure_key(branch(4), sig)
    floats = [t for t in branch(4).graph.initializer if t.data_type == onnx.TensorProto.FLOAT]
    assert floats
    emptied = branch(4)  # the weights' values are not part of the structure, and the branch keeps them
    for t in emptied.graph.initializer:
        if t.data_type == onnx.TensorProto.FLOAT:
            t.ClearField("raw_data")
            t.ClearField("float_data")
    kept = branch(4)
    before = kept.SerializeToString()
    assert tb.structure_key(emptied, sig) == tb.structure_key(kept, sig) and kept.SerializeToString() == before


def test_spawned_workers_compile_self_contained_artifacts(monkeypatch, tmp_path):
    """Branches no cache holds compile in spawned workers, as a GPU build does: a branch that appears twice in one
    batch compiles once, and branches of one structure (4 and 5: other weights) compile in turn in one worker,
    the second a hit in that worker's Inductor caches.  Every artifact computes with its own weights."""
    monkeypatch.setenv("PARASTREAM_COMPILE_WORKERS", "2")
    builder = tb.Builder(BuildOptions(device="cpu"))
    models = [branch(4), other(6), branch(5), branch(4)]
    engines = builder.build_all([(m, f"b{i}", LAYOUT) for i, m in enumerate(models)])
    assert [r["cache"] for r in builder.report().values()] == ["miss"] * 4
    assert engines[0] == engines[3]
    x = np.random.default_rng(11).standard_normal(IN.shape).astype(np.float32)
    outs = []
    for data, m in zip(engines[:3], models):
        e = tb.load(data, [IN], [OUT], device="cpu")
        assert not e.compiled_at_load and e.meta["compiled"] == "inductor"
        outs.append(e.run({"x": x})["y"])
        np.testing.assert_allclose(outs[-1], ort(m, x), rtol=1e-5, atol=1e-5)
    assert np.abs(outs[0] - outs[2]).max() > 0.1


# -- a bundle of inductor engines, run by the CPU launcher -----------------------------------------------------
@pytest.fixture(scope="module")
def cpu_bundle(tmp_path_factory):
    from handmade_bundles import make_bundle

    folder = tmp_path_factory.mktemp("inductor-bundle")
    onnx.save(branch(1), folder / "net.onnx")
    bundle = make_bundle(folder / "net.onnx", folder / "out", backend="torch", streams=1, layouts=True)
    return folder, bundle


def test_bundle_engines_load_for_the_plans_tensors_and_match_onnxruntime(cpu_bundle):
    """(The torch backend's launcher is the GPU one; on the CPU each engine is loaded for the plan's tensors.)"""
    _, bundle = cpu_bundle
    plan = bundle.plan
    assert len(plan.branches) == 1 and tb.unpack(bundle.engine_bytes(plan.branches[0]))[0]["compiled"] == "inductor"
    b = plan.branches[0]
    e = tb.load(bundle.engine_bytes(b), [plan.tensors[t] for t in b.inputs], [plan.tensors[t] for t in b.outputs])
    x = np.random.default_rng(13).standard_normal(IN.shape).astype(np.float32)
    assert not e.compiled_at_load
    np.testing.assert_allclose(e.run({"x": x})["y"], ort(branch(1), x), rtol=1e-5, atol=1e-5)


def test_a_tampered_inductor_bin_is_refused_by_the_manifest_hash(cpu_bundle, tmp_path):
    from parastream.launcher.bundle import Bundle

    _, bundle = cpu_bundle
    copy = tmp_path / "copy"
    shutil.copytree(bundle.path, copy)
    b = bundle.plan.branches[0]
    meta, onnx_bytes, artifact = tb.unpack((copy / b.engine).read_bytes())
    flipped = artifact[:-1] + bytes([artifact[-1] ^ 1])
    (copy / b.engine).write_bytes(tb.pack(meta, onnx_bytes, flipped))
    with pytest.raises(ParastreamError, match=rf"{b.engine}: sha256 differs from manifest.json"):
        Bundle.open(copy)


# -- a written bundle's engines leave their ONNX weights to model.onnx (``slim_engine``) -------------------------
def _slimmed_copy(bundle, dest, *, signature=None):
    """``bundle`` copied to ``dest`` with each engine slimmed against its model.onnx as a build writes it (and,
    with ``signature``, the engines claiming another signature, so that a load compiles them again)."""
    from parastream.launcher.bundle import Bundle, write_manifest

    shutil.copytree(bundle.path, dest)
    held = {t.name: t for t in onnx.load(str(dest / "model.onnx")).graph.initializer}
    for b in bundle.plan.branches:
        data = tb.slim_engine((dest / b.engine).read_bytes(), held.get)
        if signature is not None:
            f = tb.EngineFile(data)
            data = tb.pack(dict(f.meta, signature=signature), f.onnx(), f.compiled(), f.weights())
        (dest / b.engine).write_bytes(data)
    write_manifest(dest, {k: v for k, v in bundle.manifest.items() if k not in ("files", "version")})
    return Bundle.open(dest)


def test_a_bundle_s_compiled_engines_leave_their_onnx_weights_to_model_onnx(cpu_bundle, tmp_path):
    """An engine slimmed for its bundle keeps branch.onnx's graph and the names of the weights model.onnx holds
    with equal bytes (engine.json's ``weights_in_model``), not their data; its compiled code and weights.bin are
    unchanged, and the bundle loads and runs as before without reading model.onnx."""
    _, bundle = cpu_bundle
    slim = _slimmed_copy(bundle, tmp_path / "slim")
    b = bundle.plan.branches[0]
    whole, thin = tb.EngineFile(bundle.engine_bytes(b)), tb.EngineFile(slim.engine_bytes(b))
    assert sorted(thin.meta["weights_in_model"]) == ["b", "half", "w"]
    assert len(slim.engine_bytes(b)) < len(bundle.engine_bytes(b))
    assert all(not t.raw_data and not t.float_data for t in onnx.load_from_string(thin.onnx()).graph.initializer)
    assert (thin.compiled(), thin.weights()) == (whole.compiled(), whole.weights())
    x = np.random.default_rng(21).standard_normal(IN.shape).astype(np.float32)
    plan = slim.plan  # (the torch backend's launcher is the GPU one: each engine loaded as it loads them)
    e = tb.load(slim.engine_bytes(b), [plan.tensors[t] for t in b.inputs], [plan.tensors[t] for t in b.outputs],
                device="cpu", model_weights=slim.initializer)
    assert not e.compiled_at_load
    np.testing.assert_allclose(e.run({"x": x})["y"], ort(branch(1), x), rtol=1e-5, atol=1e-5)
    assert slim._initializers is None  # (model.onnx never read: a compiled engine's load needs none of it)
    # slimmed again: the same file (nothing left to take out)
    assert tb.slim_engine(slim.engine_bytes(b), lambda name: None) == slim.engine_bytes(b)


def test_an_engine_compiled_again_at_load_takes_its_weights_from_the_bundle_s_model(cpu_bundle, tmp_path):
    """A slimmed engine that a load compiles again (here: compiled for another signature) gets its weights from
    the bundle's hash-checked model.onnx and computes as before; handed no model, it is one clear error."""
    _, bundle = cpu_bundle
    b = bundle.plan.branches[0]
    slim = _slimmed_copy(bundle, tmp_path / "slim", signature=[["x", "float32", [1, 3, 9, 9], False, None]])
    x = np.random.default_rng(22).standard_normal(IN.shape).astype(np.float32)
    plan = slim.plan
    ins, outs = [plan.tensors[t] for t in b.inputs], [plan.tensors[t] for t in b.outputs]
    e = tb.load(slim.engine_bytes(b), ins, outs, device="cpu", model_weights=slim.initializer)
    assert e.compiled_at_load and slim._initializers is not None
    np.testing.assert_allclose(e.run({"x": x})["y"], ort(branch(1), x), rtol=1e-5, atol=1e-5)
    with pytest.raises(ParastreamError, match="keeps its weights in its bundle's model.onnx"):
        tb.load(slim.engine_bytes(b), ins, outs, device="cpu")
    wrong = onnx.helper.make_tensor("w", onnx.TensorProto.FLOAT, [4, 3, 1, 1], np.zeros(12, np.float32))
    with pytest.raises(ParastreamError, match="weight 'w' is not in its bundle's model.onnx as built"):
        tb.load(slim.engine_bytes(b), ins, outs, device="cpu",
                model_weights=lambda n: wrong if n == "w" else slim.initializer(n))


def test_localize_runs_a_slimmed_engine_s_branch_with_the_model_s_weights(cpu_bundle, tmp_path):
    """``localize`` runs each engine's branch alone: from a slimmed engine, with the weights refilled from the
    bundle's model.onnx, the same graph and values as the branch it was built from."""
    from parastream.pipeline.localize import _branch_graph

    _, bundle = cpu_bundle
    slim = _slimmed_copy(bundle, tmp_path / "slim")
    b = slim.plan.branches[0]
    graph, how = _branch_graph(slim, b, None)
    assert how == "float32"
    got = {t.name: numpy_helper.to_array(t) for t in graph.graph.initializer}
    want = {t.name: numpy_helper.to_array(t) for t in branch(1).graph.initializer}
    assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)


def test_only_weights_model_onnx_holds_with_equal_bytes_leave_an_engine(built):
    """A weight whose name model.onnx holds with other values or another shape stays in the engine; an engine
    without compiled code (compiled at every load) is left whole."""
    held = {t.name: t for t in branch(1).graph.initializer}
    other = {t.name: t for t in branch(2).graph.initializer}  # the same names, other values
    mixed = {"w": held["w"], "b": other["b"], "half": held["half"]}
    meta = tb.EngineFile(tb.slim_engine(built.a, mixed.get)).meta
    assert sorted(meta["weights_in_model"]) == ["half", "w"]
    assert tb.slim_engine(built.a, other.get) == built.a or \
        tb.EngineFile(tb.slim_engine(built.a, other.get)).meta["weights_in_model"] == ["half"]  # (0.5 in both)
    plain = tb.Builder(BuildOptions(device="cpu", compile=False)).build(branch(1), "b")
    assert tb.slim_engine(plain, held.get) == plain


# -- GPU: the whole bundle -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gpu_bundle(tmp_path_factory):
    return small_net_bundle(tmp_path_factory.mktemp("gpu-inductor"))


@pytest.mark.gpu
def test_inductor_gpu_bundle_ships_artifacts_verified_as_loaded(gpu_bundle):
    assert_ships_compiled_engines_verified_as_loaded(gpu_bundle[1], "kernels")


@pytest.mark.gpu
def test_kernels_bundle_loads_and_runs_in_a_fresh_process_without_importing_inductor_or_triton(gpu_bundle, tmp_path):
    """The "kernels" artifacts (Inductor's wrapper and cubins) load, capture and replay in a fresh process with
    empty caches that never imports torch._inductor or triton, and match onnxruntime.  (The build ran each one
    against Inductor's own compiled function on the same tensors and required equal bits.)"""
    folder, bundle = gpu_bundle
    x = np.random.default_rng(6).standard_normal(bundle.plan.inputs[0].shape).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    script = textwrap.dedent(f"""
        import json, sys, numpy as np
        from parastream.launcher.bundle import Bundle
        from parastream.launcher.gpu import GpuLauncher
        la = GpuLauncher(Bundle.open({str(bundle.path)!r}, loading=True))
        y = la({{{bundle.plan.inputs[0].name!r}: np.load({str(tmp_path / 'x.npy')!r})}})[{bundle.plan.outputs[0].name!r}]
        np.save({str(tmp_path / 'y.npy')!r}, y)
        heavy = sorted(m for m in sys.modules if m.startswith(("torch._inductor", "triton")))
        engines = [e for e in la.engines if e is not None]
        print(json.dumps({{"heavy": heavy[:5], "graph": la._exec is not None,
                          "kinds": sorted({{e.meta.get("compiled") for e in engines}}),
                          "imported": sorted({{m for e in engines for m in getattr(e._runner.artifact, "imported", [])}})}}))
    """)
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "empty"), TRITON_CACHE_DIR=str(tmp_path / "empty-triton"))
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    info = json.loads(p.stdout.strip().splitlines()[-1])
    assert info == {"heavy": [], "graph": True, "kinds": ["kernels"], "imported": []}, info
    assert scaled_error(folder, bundle, x, np.load(tmp_path / "y.npy")) < 2e-2


@pytest.mark.gpu
def test_inductor_gpu_bundle_loads_in_a_fresh_process_and_captures_without_compiling(gpu_bundle, tmp_path):
    """A fresh process with empty Inductor and Triton caches: the launcher loads every engine from its artifact
    (no dynamo graph, no FX-graph cache miss, no codegen), captures the plan into its CUDA Graph on its external
    streams, and the replay matches onnxruntime."""
    folder, bundle = gpu_bundle
    x = np.random.default_rng(5).standard_normal(bundle.plan.inputs[0].shape).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    script = textwrap.dedent(f"""
        import json, time, numpy as np
        t0 = time.perf_counter()
        import torch, torch._dynamo.utils
        from torch._inductor.graph import GraphLowering

        def codegen(*a, **k):
            raise AssertionError("Inductor generated code at load")

        GraphLowering.codegen = GraphLowering.codegen_with_cpp_wrapper = codegen
        from parastream.launcher.bundle import Bundle
        from parastream.launcher.gpu import GpuLauncher
        la = GpuLauncher(Bundle.open({str(bundle.path)!r}))
        ready = time.perf_counter() - t0
        y = la({{{bundle.plan.inputs[0].name!r}: np.load({str(tmp_path / 'x.npy')!r})}})[{bundle.plan.outputs[0].name!r}]
        np.save({str(tmp_path / 'y.npy')!r}, y)
        c = torch._dynamo.utils.counters
        engines = [e for e in la.engines if e is not None]
        arts = {{id(e._runner.artifact) for e in engines}}
        warmed = sum(e.phases["warm"] > 0 for e in engines)
        print(json.dumps({{"ready_s": ready, "graph": la._exec is not None, "warmed": warmed, "artifacts": len(arts),
                          "compiled_at_load": sum(e.compiled_at_load for e in la.engines if e is not None),
                          "because": sorted({{e.compiled_at_load_because for e in la.engines if e is not None}} - {{""}}),
                          "dynamo_graphs": c["stats"]["unique_graphs"], "inductor": dict(c["inductor"])}}))
    """)
    empty = tmp_path / "empty"
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(empty), TRITON_CACHE_DIR=str(tmp_path / "empty-triton"))
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    info = json.loads(p.stdout.strip().splitlines()[-1])
    assert info["compiled_at_load"] == 0 and info["dynamo_graphs"] == 0 and info["graph"], info
    assert info["warmed"] == info["artifacts"], info  # an artifact run once is not warmed again for another engine
    assert not info["inductor"].get("fxgraph_cache_miss"), info
    assert scaled_error(folder, bundle, x, np.load(tmp_path / "y.npy")) < 2e-2


@pytest.mark.gpu
def test_the_launcher_warms_engines_and_captures_in_one_thread_while_it_loads(gpu_bundle, monkeypatch):
    """The GPU launcher loads its torch engines unwarmed and warms them in one thread of its own while it loads the
    next: every engine once, on its branch's stream, in load order; then that same thread launches and captures
    the plan (torch keeps cuDNN's convolution plans per thread: warmed in other threads than the capturing one,
    every plan was built twice).  The replay matches onnxruntime."""
    import threading

    from parastream.launcher.gpu import GpuLauncher

    folder, bundle = gpu_bundle
    calls, real = [], tb.TorchEngine.warm
    captured, real_capture = [], GpuLauncher._capture

    def warm(self, stream_handle=None):
        calls.append((id(self), stream_handle, threading.current_thread().name))
        return real(self, stream_handle)

    def capture(self, body, *args):
        captured.append(threading.current_thread().name)
        return real_capture(self, body, *args)

    monkeypatch.setattr(tb.TorchEngine, "warm", warm)
    monkeypatch.setattr(GpuLauncher, "_capture", capture)
    la = GpuLauncher(bundle)
    try:
        plan = la.plan
        engines = {id(la.engines[b]): b for b in plan.launch_order if la.engines[b] is not None}
        assert sorted(engines.values()) == sorted(engines[i] for i, _, _ in calls)  # each engine once
        assert all(e.warmed for e in la.engines if e is not None)
        threads = {thread for _, _, thread in calls}
        assert len(threads) == 1 and threads != {threading.current_thread().name}
        assert captured == list(threads)  # the plan captured by the thread that warmed its engines
        assert next(iter(threads)).startswith("parastream-warm")
        assert len({plan.branches[b].stream for b in engines.values()}) > 1
        for i, handle, _ in calls:
            assert handle == la._h(la.streams[plan.branches[engines[i]].stream])  # on its branch's stream
        assert [engines[i] for i, _, _ in calls] == sorted(engines[i] for i, _, _ in calls)  # in load order
        x = np.random.default_rng(8).standard_normal(plan.inputs[0].shape).astype(np.float32)
        y = la({plan.inputs[0].name: x})[plan.outputs[0].name]
        assert scaled_error(folder, bundle, x, y) < 2e-2
    finally:
        la.close()


@pytest.mark.gpu
def test_inductor_gpu_engine_for_another_architecture_is_refused_naming_the_file(gpu_bundle, tmp_path):
    assert_another_architecture_is_refused_naming_the_file(gpu_bundle[1], tmp_path)


def test_engines_that_share_most_weights_hold_only_the_new_ones():
    """Two engines whose weights.bin share two large weights and differ in one small one (a grid's buckets: the
    same matrices, a shape-sized constant each): the second load reuses the shared tensors and copies only its
    own weight, so its new tensor's memory is that weight's bytes, not a second copy of weights.bin."""
    import torch

    tb._SHARED_PARAMS.clear()
    rng = np.random.default_rng(0)
    big = [rng.standard_normal((256, 256)).astype(np.float32) for _ in range(2)]

    def engine(small):
        arrays = [*big, small]
        blob, offsets, at = bytearray(), [], 0
        for a in arrays:
            offsets.append(len(blob))
            blob += a.tobytes() + bytes(-a.nbytes % tb._ALIGN)
        meta = {"params": [f"p{i}" for i in range(3)], "param_offsets": offsets,
                "param_specs": [[list(a.shape), [a.shape[1], 1], "float32"] for a in arrays],
                "param_digests": [hashlib.sha256(a.tobytes()).hexdigest() for a in arrays]}
        return meta, bytes(blob)

    first_meta, first_blob = engine(np.ones((1, 16), np.float32))
    first = tb._load_params(lambda: first_blob, first_meta, "cpu")
    second_meta, second_blob = engine(np.full((1, 32), 2.0, np.float32))
    second = tb._load_params(lambda: second_blob, second_meta, "cpu")
    assert second[0] is first[0] and second[1] is first[1]
    assert second[2].untyped_storage().nbytes() == 32 * 4 * 1  # 128 bytes: the one weight, no whole blob
    assert torch.equal(second[2], torch.full((1, 32), 2.0))
    assert all(torch.equal(p, torch.from_numpy(a)) for p, a in zip(first, [*big, np.ones((1, 16), np.float32)]))
