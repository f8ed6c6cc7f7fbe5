"""The TensorRT backend against the TensorRT test double (tests/trt_double): our side of every call.

These run everywhere.  The double records each call TensorRT would receive and executes "engines"
with ONNX Runtime on host memory, so these tests check names, order, flags, shapes, the timing
cache, errors and addresses, never TensorRT itself (that is tests/engines/test_tensorrt_real.py).
"""

from __future__ import annotations

import sys

import numpy as np
import onnx
import pytest
import trt_double
from graphs import ort_reference
from graphs import three_branch_model as _three_branch_model
from graphs import two_output_model as _two_output_model
from onnx import TensorProto, helper

from parastream.launcher.cuda import nbytes_of
from parastream.launcher.engines import BuildOptions, require_backend, resolve_backend
from parastream.launcher.engines import tensorrt as backend
from parastream.launcher.errors import BackendUnavailable, ParastreamError
from parastream.launcher.plan import TensorSpec


def three_branch_model(**kw) -> onnx.ModelProto:
    model = _three_branch_model(**kw)
    model.ir_version = 8  # an IR version every onnxruntime reads
    return model


def two_output_model(**kw) -> onnx.ModelProto:
    model = _two_output_model(**kw)
    model.ir_version = 8
    return model


@pytest.fixture
def trt(monkeypatch):
    return trt_double.install(monkeypatch)


def options(tmp_path, **kw) -> BuildOptions:
    return BuildOptions(device="cuda", cache_dir=str(tmp_path / "cache"), **kw)


def build_one(tmp_path, model=None, name="branch_000", **kw):
    builder = backend.Builder(options(tmp_path, **kw))
    try:
        data = builder.build(model if model is not None else three_branch_model(), name)
    finally:
        builder.close()
    return builder, data


def random_feeds(specs, seed=0):
    rng = np.random.default_rng(seed)
    return {t.name: rng.standard_normal(t.shape).astype(t.dtype) for t in specs}


# -- availability ---------------------------------------------------------------------------------------

def test_without_tensorrt_the_backend_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # import tensorrt raises ImportError
    why = backend.available()
    assert "pip install tensorrt" in why and "NVIDIA's index" in why and "NGC" in why
    with pytest.raises(BackendUnavailable, match=r"--backend tensorrt: TensorRT is not installed: pip install tensorrt"):
        require_backend("tensorrt")
    assert resolve_backend("auto").name != "tensorrt"


def test_tensorrt_without_a_gpu_is_unavailable(monkeypatch):
    trt_double.install(monkeypatch)
    monkeypatch.setattr(backend, "_gpu_check", lambda: "TensorRT builds and runs engines on a CUDA GPU and cuda-python sees none")
    assert "CUDA GPU" in backend.available()
    with pytest.raises(BackendUnavailable, match="CUDA GPU"):
        require_backend("tensorrt")


def test_auto_takes_tensorrt_when_it_imports_and_a_gpu_is_present(trt):
    assert backend.available() is None
    assert resolve_backend("auto") is backend


def test_gpu_check_needs_cuda_python_and_a_device(monkeypatch):
    from parastream.launcher import cuda

    monkeypatch.setattr(cuda, "runtime", lambda: (_ for _ in ()).throw(BackendUnavailable("no cuda-python")))
    assert "cuda-python" in backend._gpu_check()
    monkeypatch.setattr(cuda, "runtime", lambda: object())
    monkeypatch.setattr(cuda, "device_count", lambda: 0)
    assert "CUDA GPU" in backend._gpu_check()
    monkeypatch.setattr(cuda, "device_count", lambda: 2)
    assert backend._gpu_check() is None


# -- build: calls, order, flags ---------------------------------------------------------------------------

def test_build_calls_tensorrt_in_the_documented_order(trt, tmp_path):
    build_one(tmp_path, workspace_mb=512, optimization_level=4)
    sequence = [(o, m) for o, m, _ in trt.CALLS if o != "tensorrt"]
    expected = [
        ("Builder", "__init__"), ("Builder", "create_network"), ("OnnxParser", "__init__"), ("OnnxParser", "parse"),
        ("Builder", "create_builder_config"), ("IBuilderConfig", "set_memory_pool_limit"),
        ("IBuilderConfig", "clear_flag"),  # fp32: TF32 off
        ("IBuilderConfig", "builder_optimization_level"), ("IBuilderConfig", "profiling_verbosity"),
        ("IBuilderConfig", "max_aux_streams"), ("IBuilderConfig", "create_timing_cache"),
        ("IBuilderConfig", "set_timing_cache"), ("Builder", "build_serialized_network"),
    ]
    assert sequence[:len(expected)] == expected
    # then the engine is inspected, and close() persists the timing cache
    assert ("IEngineInspector", "get_engine_information") in sequence
    assert sequence[-1] == ("ITimingCache", "serialize")
    (_, _, net), = trt.calls("Builder", "create_network")
    assert net["flags"] == 0  # TensorRT 10: explicit batch is implicit, no EXPLICIT_BATCH bit
    (_, _, pool), = trt.calls("IBuilderConfig", "set_memory_pool_limit")
    assert pool == {"config": pool["config"], "pool": "WORKSPACE", "size": 512 << 20}
    assert trt.calls("IBuilderConfig", "builder_optimization_level")[0][2]["value"] == 4
    assert trt.calls("IBuilderConfig", "profiling_verbosity")[0][2]["value"] == "DETAILED"
    assert trt.calls("IBuilderConfig", "max_aux_streams")[0][2]["value"] == 0
    (_, _, parse), = trt.calls("OnnxParser", "parse")
    assert parse["nbytes"] == len(three_branch_model().SerializeToString())


@pytest.mark.parametrize("precision, set_flags, cleared", [
    ("fp32", [], ["TF32"]),
    ("tf32", ["TF32"], []),
    ("fp16", ["TF32", "FP16"], []),
    ("bf16", ["TF32", "BF16"], []),
])
def test_precision_flags(trt, tmp_path, precision, set_flags, cleared):
    builder, data = build_one(tmp_path, precision=precision)
    assert [c[2]["flag"] for c in trt.calls("IBuilderConfig", "set_flag")] == set_flags
    assert [c[2]["flag"] for c in trt.calls("IBuilderConfig", "clear_flag")] == cleared
    engine_flags = set(trt.Runtime(trt.Logger()).deserialize_cuda_engine(data).meta["flags"])
    assert ("TF32" in engine_flags) == (precision != "fp32")
    assert {"FP16", "BF16"} & engine_flags == {f for f in set_flags if f != "TF32"}
    assert builder.report()["branch_000"]["builder_flags"] == set_flags


def test_strongly_typed_network_flag_and_no_precision_flags(trt, tmp_path):
    build_one(tmp_path, strongly_typed=True, precision="tf32")
    (_, _, net), = trt.calls("Builder", "create_network")
    assert net["flags"] == 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    assert {c[2]["flag"] for c in trt.calls("IBuilderConfig", "set_flag")} <= {"TF32"}


def test_strongly_typed_with_a_reduced_precision_is_refused(trt, tmp_path):
    with pytest.raises(ParastreamError, match="--strongly-typed.*--precision fp16"):
        backend.Builder(options(tmp_path, strongly_typed=True, precision="fp16"))


def test_bad_optimization_level_is_refused(trt, tmp_path):
    with pytest.raises(ParastreamError, match="--opt-level 7"):
        backend.Builder(options(tmp_path, optimization_level=7))


def test_tensorrt_without_fp16_flag_names_the_way_out(trt, tmp_path, monkeypatch):
    """TensorRT 11 dropped BuilderFlag.FP16/BF16 (strong typing only): say so instead of an AttributeError."""
    import enum

    monkeypatch.setattr(trt, "BuilderFlag", enum.IntEnum("BuilderFlag", {"TF32": 6}))
    with pytest.raises(ParastreamError, match="no BuilderFlag.FP16"):
        build_one(tmp_path, precision="fp16")


# -- optimization profiles -----------------------------------------------------------------------------------

def test_dynamic_inputs_get_an_optimization_profile(trt, tmp_path):
    model = three_branch_model(batch="N")
    profiles = {"input": ([1, 4, 8, 8], [4, 4, 8, 8], [16, 4, 8, 8])}
    builder, _ = build_one(tmp_path, model, profiles=profiles)
    (_, _, shape), = trt.calls("IOptimizationProfile", "set_shape")
    assert (shape["input"], shape["min"], shape["opt"], shape["max"]) == ("input", [1, 4, 8, 8], [4, 4, 8, 8], [16, 4, 8, 8])
    assert trt.calls("IBuilderConfig", "add_optimization_profile")
    assert builder.report()["branch_000"]["profiles"] == {"input": {"min": [1, 4, 8, 8], "opt": [4, 4, 8, 8], "max": [16, 4, 8, 8]}}


def test_static_inputs_need_no_profile(trt, tmp_path):
    build_one(tmp_path, profiles={"input": ([1, 4, 8, 8], [1, 4, 8, 8], [1, 4, 8, 8])})
    assert not trt.calls("Builder", "create_optimization_profile")


@pytest.mark.parametrize("profiles, message", [
    ({}, r"input 'input' has dynamic shape \[-1, 4, 8, 8\]; give its min:opt:max"),
    ({"input": ([1, 4, 8], [1, 4, 8], [1, 4, 8])}, "has rank 3, the input has rank 4"),
    ({"input": ([1, 3, 8, 8], [1, 3, 8, 8], [1, 3, 8, 8])}, "differs from its fixed dimensions"),
    ({"input": ([4, 4, 8, 8], [2, 4, 8, 8], [8, 4, 8, 8])}, "min <= opt <= max"),
])
def test_bad_or_missing_profiles_name_the_input(trt, tmp_path, profiles, message):
    with pytest.raises(ParastreamError, match=message):
        build_one(tmp_path, three_branch_model(batch="N"), profiles=profiles)
    assert not trt.calls("Builder", "build_serialized_network")


# -- timing cache ------------------------------------------------------------------------------------------------

def test_one_timing_cache_is_shared_by_all_branches_of_a_build(trt, tmp_path):
    builder = backend.Builder(options(tmp_path))
    builder.build(three_branch_model(seed=1), "branch_000")
    builder.build(two_output_model(), "branch_001")
    third = builder.build(three_branch_model(seed=2), "branch_002")
    caches = {c[2]["cache"] for c in trt.calls("IBuilderConfig", "set_timing_cache")}
    configs = {c[2]["config"] for c in trt.calls("IBuilderConfig", "set_timing_cache")}
    assert len(caches) == 1 and len(configs) == 3  # three configs, one cache
    assert len(trt.calls("IBuilderConfig", "create_timing_cache")) == 1
    assert all(c[2]["ignore_mismatch"] is False for c in trt.calls("IBuilderConfig", "set_timing_cache"))
    # the third branch has the first one's layers: it found them in the shared cache
    assert trt.Runtime(trt.Logger()).deserialize_cuda_engine(third).meta["cache_hits"] == len(three_branch_model().graph.node)
    assert not builder.cache_path.exists()
    builder.close()
    assert builder.cache_path.is_file()


def test_timing_cache_persists_and_is_reloaded_by_the_next_build(trt, tmp_path):
    first, _ = build_one(tmp_path, two_output_model())
    path = first.cache_path
    assert path.parent == tmp_path / "cache" and path.name.startswith("timing-trt10.16.0.double-")
    saved = path.read_bytes()
    trt.reset()
    second, data = build_one(tmp_path, two_output_model())
    (_, _, created), = trt.calls("IBuilderConfig", "create_timing_cache")
    assert created["nbytes"] == len(saved)  # created from the file, not empty
    assert second.report()["branch_000"]["timing_cache"] == {"path": str(path), "state": "loaded"}
    meta = trt.Runtime(trt.Logger()).deserialize_cuda_engine(data).meta
    assert meta["cache_hits"] == len(two_output_model().graph.node)  # every layer came from the previous build


def test_default_cache_folder(trt, monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    path = backend.timing_cache_path(BuildOptions(device="cuda"))
    assert path.parent == tmp_path / "xdg" / "parastream" / "trt"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert backend.timing_cache_path(BuildOptions(device="cuda")).parent == tmp_path / "home" / ".cache" / "parastream" / "trt"


@pytest.mark.parametrize("content", [b"not a timing cache", "foreign"])
def test_unusable_timing_cache_is_replaced_not_fatal(trt, tmp_path, content):
    path = backend.timing_cache_path(options(tmp_path))
    path.parent.mkdir(parents=True)
    if content == "foreign":  # made on another GPU: TensorRT refuses it with ignore_mismatch=False
        content = trt.ITimingCache({"x"}, device="other-gpu").serialize()
    path.write_bytes(content)
    builder, data = build_one(tmp_path)
    assert builder.report()["branch_000"]["timing_cache"]["state"].startswith("discarded")
    assert data and path.read_bytes() != content  # rewritten with a fresh cache


def test_unwritable_cache_folder_warns_without_failing(trt, tmp_path):
    (tmp_path / "cache").write_text("a file where the folder should be")
    with pytest.warns(UserWarning, match="timing cache not saved"):
        build_one(tmp_path)


# -- build failures ----------------------------------------------------------------------------------------------

def test_parser_error_names_the_branch_the_node_and_the_reason(trt, tmp_path):
    trt.UNSUPPORTED_OPS.add("Relu")
    with pytest.raises(ParastreamError) as e:
        build_one(tmp_path, name="branch_007")
    msg = str(e.value)
    assert "branch_007" in msg and "node 'relu0' (Relu)" in msg and "Plugin not found" in msg
    assert not trt.calls("Builder", "build_serialized_network")


def test_parser_error_without_node_name_is_found_by_index(trt, tmp_path):
    errors = [trt.ParserError(trt.ErrorCode.UNSUPPORTED_NODE, "no importer", node=2), trt.ParserError(trt.ErrorCode.UNSUPPORTED_NODE, "x")]
    msg = backend._parser_error_message(errors, three_branch_model(), "branch_001")
    assert msg == "branch_001: TensorRT's ONNX parser cannot import node 'conv1' (Conv): no importer (and 1 more parser errors)"
    graph_level = backend._parser_error_message([trt.ParserError(trt.ErrorCode.INVALID_GRAPH, "bad graph")], three_branch_model(), "b")
    assert graph_level == "b: TensorRT's ONNX parser cannot import the graph: bad graph"


def test_failed_engine_build_quotes_tensorrt(trt, tmp_path, monkeypatch):
    def refuse(self, network, config):
        self.logger.log(trt.ILogger.Severity.ERROR, "[graphOptimizer.cpp] Error Code 2: Internal Error (node conv1 has no implementation)")
        return None

    monkeypatch.setattr(trt.Builder, "build_serialized_network", refuse)
    with pytest.raises(ParastreamError, match=r"^branch_000: TensorRT could not build the engine: \[graphOptimizer.cpp\].*conv1"):
        build_one(tmp_path)


# -- report --------------------------------------------------------------------------------------------------------

def test_report_has_the_inspector_layers_and_the_build_settings(trt, tmp_path):
    builder, data = build_one(tmp_path, precision="fp16", workspace_mb=256)
    entry = builder.report()["branch_000"]
    names = [layer["Name"] for layer in entry["layers"]]
    assert names == [n.name for n in three_branch_model().graph.node]
    assert entry["layers"][0]["LayerType"] == "Conv" and "TacticName" in entry["layers"][0]  # DETAILED verbosity
    assert entry["num_layers"] == 8 and entry["bindings"] == ["input", "output"]
    assert entry["engine_bytes"] == len(data) and entry["build_s"] >= 0 and entry["nodes"] == 8
    assert entry["device_memory_bytes"] == trt.SCRATCH_BASE + 256 * 8
    assert (entry["precision"], entry["workspace_mb"], entry["optimization_level"], entry["max_aux_streams"]) == ("fp16", 256, 3, 0)
    assert entry["tensorrt"] == trt.__version__
    assert trt.calls("IEngineInspector", "get_engine_information")[0][2]["format"] == "JSON"


# -- run side ----------------------------------------------------------------------------------------------------

def specs_of(model: onnx.ModelProto):
    def spec(v):
        tt = v.type.tensor_type
        return TensorSpec(v.name, np.dtype(helper.tensor_dtype_to_np_dtype(tt.elem_type)).name, [d.dim_value for d in tt.shape.dim])

    inits = {i.name for i in model.graph.initializer}
    return [spec(v) for v in model.graph.input if v.name not in inits], [spec(v) for v in model.graph.output]


def test_load_and_run_match_onnxruntime(trt, tmp_path):
    model = two_output_model()
    _, data = build_one(tmp_path, model)
    ins, outs = specs_of(model)
    engine = backend.load(data, ins, outs, device="cuda", options=BuildOptions(device="cuda"))
    for seed in range(3):
        feeds = random_feeds(ins, seed)
        got, ref = engine.run(feeds), ort_reference(model, feeds)
        for name in ref:
            np.testing.assert_allclose(got[name], ref[name], rtol=1e-6, atol=1e-6)
    engine.close()


def test_each_engine_has_one_context_with_scratch_memory_of_its_own(trt, tmp_path):
    _, data = build_one(tmp_path)
    ins, outs = specs_of(three_branch_model())
    engines = [backend.load(data, ins, outs) for _ in range(3)]
    created = trt.calls("ICudaEngine", "create_execution_context")
    assert len(created) == 3 and {c[2]["strategy"] for c in created} == {"USER_MANAGED"}
    assert len({c[2]["context"] for c in created}) == 3
    regions = sorted((ptr, ptr + size) for _, ptr, size in trt.DEVICE_MEMORY)
    assert len(regions) == 3
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(regions, regions[1:]))  # disjoint
    need = trt.Runtime(trt.Logger()).deserialize_cuda_engine(data).device_memory_size_v2
    assert all(size >= need and ptr % 256 == 0 for _, ptr, size in trt.DEVICE_MEMORY)
    # running them all leaves each output intact: no engine's scratch overlaps another's buffers
    feeds = random_feeds(ins)
    results = [e.run(feeds) for e in engines]
    for r in results[1:]:
        np.testing.assert_array_equal(r["output"], results[0]["output"])
    for e in engines:
        e.close()
    from trt_double import host_memory

    assert not host_memory.ALLOCATIONS  # close() freed scratch, buffers


def test_enqueue_binds_the_launchers_addresses_and_stream(trt, tmp_path):
    from trt_double.host_memory import HostMemory

    model = two_output_model()
    _, data = build_one(tmp_path, model)
    ins, outs = specs_of(model)
    engine = backend.load(data, ins, outs)
    mem = HostMemory()  # the launcher's buffers
    addresses = {t.name: mem.alloc(nbytes_of(t.shape, t.dtype)) for t in ins + outs}
    feeds = random_feeds(ins)
    mem.copy_in(addresses["x"], feeds["x"], 0)
    trt.CALLS.clear()
    engine.enqueue(0x7001, addresses)
    shapes = [(c[2]["name"], c[2]["shape"]) for c in trt.calls("IExecutionContext", "set_input_shape")]
    assert shapes == [("x", [2, 16])]
    bound = {c[2]["name"]: c[2]["memory"] for c in trt.calls("IExecutionContext", "set_tensor_address")}
    assert bound == addresses  # every IO tensor, at exactly the launcher's address
    (_, _, execute), = trt.calls("IExecutionContext", "execute_async_v3")
    assert execute["stream"] == 0x7001 and execute["addresses"] == addresses
    assert [m for _, m, _ in trt.CALLS][-1] == "execute_async_v3"
    ref = ort_reference(model, feeds)
    for spec in outs:
        got = np.empty(spec.shape, np.float32)
        mem.copy_out(got, addresses[spec.name], 0)
        np.testing.assert_allclose(got, ref[spec.name], rtol=1e-6)


def test_enqueue_takes_cuda_python_stream_objects(trt, tmp_path):
    class Stream:  # cuda-python's cudaStream_t converts with int()
        def __int__(self):
            return 0x7002

    _, data = build_one(tmp_path)
    ins, outs = specs_of(three_branch_model())
    engine = backend.load(data, ins, outs)
    engine._memory.stream_create = lambda: Stream()
    engine.run(random_feeds(ins))
    assert trt.calls("IExecutionContext", "execute_async_v3")[-1][2]["stream"] == 0x7002


def test_execute_failure_is_an_error(trt, tmp_path, monkeypatch):
    _, data = build_one(tmp_path)
    ins, outs = specs_of(three_branch_model())
    engine = backend.load(data, ins, outs)
    from parastream.launcher import cuda

    monkeypatch.setattr(trt.IExecutionContext, "execute_async_v3", lambda self, stream: False)
    # the double's streams are made-up integers: never hand them to the CUDA runtime, where one is present
    monkeypatch.setattr(cuda, "is_capturing", lambda stream: False)
    with pytest.raises(ParastreamError, match="execute_async_v3 failed: see TensorRT's log"):
        engine.run(random_feeds(ins))
    monkeypatch.setattr(cuda, "is_capturing", lambda stream: True)
    with pytest.raises(ParastreamError, match="while the stream was capturing a CUDA Graph.*graph=False"):
        engine.run(random_feeds(ins))


@pytest.mark.parametrize("change, message", [
    (lambda i, o: ([TensorSpec("other", "float32", [1, 4, 8, 8])], o), r"IO tensors \['input', 'output'\] differ"),
    (lambda i, o: ([TensorSpec("input", "float16", [1, 4, 8, 8])], o), "is float32 in the TensorRT engine, the plan gives it float16"),
    (lambda i, o: ([TensorSpec("input", "float32", [2, 4, 8, 8])], o), r"has shape \[1, 4, 8, 8\] in the TensorRT engine"),
    (lambda i, o: (o, i), "is an (in|out)put of the TensorRT engine, the plan has it as an (out|in)put"),
])
def test_plan_and_engine_must_agree(trt, tmp_path, change, message):
    _, data = build_one(tmp_path)
    ins, outs = change(*specs_of(three_branch_model()))
    with pytest.raises(ParastreamError, match=message):
        backend.load(data, ins, outs)


def test_an_engine_tensorrt_cannot_deserialize_says_rebuild(trt):
    with pytest.raises(ParastreamError, match="cannot load this engine.*Magic tag.*rebuild the bundle"):
        backend.load(b"garbage", [], [])


def test_load_without_tensorrt_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    with pytest.raises(BackendUnavailable, match="TensorRT engines and TensorRT is not installed: pip install tensorrt"):
        backend.load(b"", [], [])


# -- the whole-model baseline ---------------------------------------------------------------------------------------

def test_whole_model_engine_uses_tensorrts_aux_streams(trt, tmp_path):
    model = three_branch_model()
    data = backend.build_whole_model_engine(model, options(tmp_path), max_aux_streams=3)
    assert trt.calls("IBuilderConfig", "max_aux_streams")[0][2]["value"] == 3
    assert (tmp_path / "cache").is_dir()  # the whole-model build persists the timing cache too
    runner = backend.TrtWholeModelRunner(data)  # IO from the engine itself
    assert [t.name for t in runner.inputs] == ["input"] and [t.name for t in runner.outputs] == ["output"]
    assert runner.aux_streams == 3
    feeds = random_feeds(runner.inputs)
    np.testing.assert_allclose(runner.run(feeds)["output"], ort_reference(model, feeds)["output"], rtol=1e-6)
    runner.close()


def test_whole_model_runner_from_model(trt, tmp_path):
    model = two_output_model()
    ins, outs = specs_of(model)
    runner = backend.TrtWholeModelRunner.from_model(model, options(tmp_path), 2, inputs=ins, outputs=outs)
    feeds = random_feeds(ins, 4)
    ref = ort_reference(model, feeds)
    got = runner.run(feeds)
    for k in ref:
        np.testing.assert_allclose(got[k], ref[k], rtol=1e-6)


def test_the_double_is_marked_as_a_double():
    assert trt_double.fake_tensorrt.IS_TEST_DOUBLE and "double" in trt_double.fake_tensorrt.__version__
    assert "TEST DOUBLE" in trt_double.fake_tensorrt.__doc__
    assert TensorProto.FLOAT in trt_double.fake_tensorrt._ONNX_TO_TRT


# -- one optimization profile per bucket (dynamic shapes) -----------------------------------------------------------

def test_one_profile_per_bucket_in_order(trt, tmp_path):
    """A list of profiles (backend.bucket_profiles): profile k is bucket k's shape exactly, added k-th."""
    profiles = backend.bucket_profiles([{"input": [n, 4, 8, 8]} for n in (1, 2, 4)])
    builder, _ = build_one(tmp_path, three_branch_model(batch="N"), profiles=profiles)
    shapes = [c[2] for c in trt.calls("IOptimizationProfile", "set_shape")]
    assert [(s["min"], s["opt"], s["max"]) for s in shapes] == [([n, 4, 8, 8],) * 3 for n in (1, 2, 4)]
    assert len(trt.calls("IBuilderConfig", "add_optimization_profile")) == 3
    assert builder.report()["branch_000"]["profiles"] == [
        {"input": {"min": [n, 4, 8, 8], "opt": [n, 4, 8, 8], "max": [n, 4, 8, 8]}} for n in (1, 2, 4)]


def test_a_bucket_profile_missing_a_dynamic_input_names_the_profile(trt, tmp_path):
    profiles = backend.bucket_profiles([{"input": [1, 4, 8, 8]}, {}])
    with pytest.raises(ParastreamError, match=r"\(profile 1, bucket 1\): input 'input' has dynamic shape"):
        build_one(tmp_path, three_branch_model(batch="N"), profiles=profiles)
    assert not trt.calls("Builder", "build_serialized_network")
