"""A model whose output shapes depend on the data (a detector's post-processing): its static part built and
verified, its data-dependent tail shipped as ``tail.onnx`` and run after each replay, by ONNX Runtime on the host
or as torch ops on the GPU, whichever the build timed faster (pipeline/host_tail.py, launcher/tail.py).  CPU
engines here, and the GPU tests at the end build it with torch engines on a GPU."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from dynamic_models import small_detector

from parastream.launcher import load
from parastream.launcher.bundle import Bundle, write_manifest
from parastream.launcher.errors import ParastreamError
from parastream.pipeline import build
from parastream.pipeline.cli import main as cli
from parastream.pipeline.host_tail import split
from parastream.pipeline.model_io import DataDependentShape, load_model, name_nodes


def _feeds(seed: int, max_det: int | None = None, scale: float = 1.0) -> dict[str, np.ndarray]:
    x = (np.random.default_rng(seed).standard_normal((1, 3, 16, 16)) * scale).astype(np.float32)
    return {"x": x, **({"max_det": np.array([max_det], np.int64)} if max_det is not None else {})}


@pytest.fixture(scope="module")
def detector(tmp_path_factory):
    root = tmp_path_factory.mktemp("detector")
    path = small_detector(root / "det.onnx")
    return path, build(path, root / "out", backend="onnxruntime", search=False)


def test_split_runs_as_the_whole_model(tmp_path):
    """The two parts, each run by onnxruntime, the static part's outputs into the tail, give the original's outputs."""
    path = small_detector(tmp_path / "det.onnx", max_det_input=True)
    original = onnx.load(str(path))
    name_nodes(original)
    static, tail = split(original, {n.name for n in original.graph.node if n.op_type == "NonZero"})
    assert "NonZero" not in {n.op_type for n in static.graph.node}
    assert {n.op_type for n in tail.model.graph.node} >= {"NonZero", "TopK", "GatherND"}
    assert tail.outputs == ["scores", "boxes"] and tail.order == ["logits", "scores", "boxes"]
    assert tail.feeds == ["max_det"]  # the input only the tail reads
    # the threshold's comparison is the tail's: it reads the scores (values), not the mask (a decision)
    assert set(tail.boundary) == {"all_scores", "all_boxes", "width"}  # (nothing folded here)
    assert "Greater" in {n.op_type for n in tail.model.graph.node}
    full = ort.InferenceSession(original.SerializeToString())
    first = ort.InferenceSession(static.SerializeToString())
    second = ort.InferenceSession(tail.model.SerializeToString())
    for seed in range(3):
        feeds = _feeds(seed, max_det=3)
        want = dict(zip(["logits", "scores", "boxes"], full.run(None, feeds)))
        got = dict(zip([o.name for o in static.graph.output], first.run(None, {"x": feeds["x"], "max_det": feeds["max_det"]})))
        tail_in = {n: got[n] for n in tail.boundary} | {"max_det": feeds["max_det"]}
        got.update(zip(tail.outputs, second.run(None, tail_in)))
        for name in tail.order:
            np.testing.assert_array_equal(got[name], want[name])


def test_a_decision_the_static_part_also_reads_stays_there(tmp_path):
    """Must not fire: the mask is also a model output, so its comparison stays in the static part (and the tail
    reads the mask)."""
    path = small_detector(tmp_path / "det.onnx")
    original = onnx.load(str(path))
    original.graph.output.append(onnx.helper.make_tensor_value_info("mask", onnx.TensorProto.BOOL, [256]))
    name_nodes(original)
    static, tail = split(original, {n.name for n in original.graph.node if n.op_type == "NonZero"})
    assert "mask" in tail.boundary and "Greater" in {n.op_type for n in static.graph.node}
    assert "Greater" not in {n.op_type for n in tail.model.graph.node}


def test_load_cuts_the_tail_and_folds_what_it_reads_from_shapes(tmp_path):
    path = small_detector(tmp_path / "det.onnx")
    with pytest.raises(DataDependentShape, match="NonZero"):
        load_model(path)
    loaded = load_model(path, host_tail=True)
    tail = loaded.tail
    assert [o.name for o in loaded.outputs] == ["logits", "all_scores", "all_boxes"]
    assert all(isinstance(d, int) for o in loaded.outputs for d in o.shape)
    # the image width comes from the input's shape: folded by the static part's load, a value the tail holds
    assert tail.constants == ["width"] and "width" not in tail.boundary
    assert "width" in {t.name for t in tail.model.graph.initializer}
    assert not any(n.op_type in ("NonZero", "TopK") for n in loaded.model.graph.node)


def test_bundle_runs_the_whole_model(detector):
    """The bundle answers the model's outputs, in its order, equal to onnxruntime on the original: with few
    detections, with the most (k capped at 5) and with none (an input scaled to 0 scores 0.5, not above)."""
    path, bundle = detector
    assert (bundle.path / "tail.onnx").is_file() and "tail.onnx" in bundle.manifest["files"]
    assert bundle.manifest["host_tail"]["outputs"] == ["scores", "boxes"]
    runner = load(bundle.path)
    assert [t.name for t in runner.plan.outputs] == ["logits", "scores", "boxes"]
    assert [t.shape for t in runner.plan.outputs] == [[1, 10], [-1], [-1, 4]]
    full = ort.InferenceSession(str(path))
    counts = set()
    for feeds in [_feeds(0), _feeds(1), _feeds(2, scale=3.0), _feeds(3, scale=0.0)]:
        got = runner(feeds)
        want = dict(zip(["logits", "scores", "boxes"], full.run(None, feeds)))
        assert list(got) == ["logits", "scores", "boxes"]
        for name in want:
            assert got[name].shape == want[name].shape
            np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6)
        counts.add(len(got["scores"]))
    assert 0 in counts and len(counts) > 1  # the shapes did depend on the data
    static = load(bundle.path, host_tail=False)  # the static part alone: what the tail reads, as outputs
    assert [t.name for t in static.plan.outputs] == ["logits", "all_scores", "all_boxes"]


def test_report_records_the_tail_and_the_end_to_end_comparison(detector):
    _, bundle = detector
    rec = bundle.report["host_tail"]
    assert rec["seeds"] == ["NonZero_15"] and rec["nodes"] == 10
    assert rec["end_to_end"]["within_tolerance"] is True
    assert all(o["same_shape"] for o in rec["end_to_end"]["outputs"].values())
    e2e = rec["end_to_end"]  # what the tail costs per call on the build's machine, beside the whole call
    assert 0 < e2e["tail_ms"] <= e2e["call_ms"]
    assert bundle.report["verification"]["passed"]
    # what was verified is the static part, the tensors the tail reads included
    assert set(bundle.report["verification"]["outputs"]) == {"logits", "all_scores", "all_boxes"}
    # a CPU plan: the tail runs on the host, nothing timed against the GPU
    assert rec["placement"] == {"runs_on": "host", "why": "the static part runs on the CPU"}
    assert rec["runs_on"] == bundle.manifest["host_tail"]["runs_on"] == "host"


def test_a_cpu_runner_asked_for_the_gpu_tail_runs_it_on_the_host(detector, tmp_path):
    from parastream.launcher.tail import TailRunner

    copy = _with_record(detector[1], tmp_path, runs_on="gpu")
    runner = load(copy)
    assert isinstance(runner, TailRunner) and not runner.on_gpu and runner.why_host == "the static part runs on the CPU"
    want = load(detector[1].path)(_feeds(2))
    for name, got in runner(_feeds(2)).items():
        np.testing.assert_array_equal(got, want[name])


def test_an_input_only_the_tail_reads(tmp_path):
    path = small_detector(tmp_path / "det.onnx", max_det_input=True)
    bundle = build(path, tmp_path / "out", backend="onnxruntime", search=False)
    assert bundle.manifest["host_tail"]["feeds"] == ["max_det"]
    runner = load(bundle.path)
    full = ort.InferenceSession(str(path))
    for max_det in (1, 3):
        feeds = _feeds(5, max_det=max_det)
        got = runner(feeds)
        for name, want in zip(["logits", "scores", "boxes"], full.run(None, feeds)):
            np.testing.assert_allclose(got[name], want, rtol=1e-5, atol=1e-6)
        assert len(got["scores"]) <= max_det


def test_cli_build_summary_run_and_verify(detector, tmp_path, capsys):
    path, bundle = detector
    assert cli(["build", str(path), "-o", str(tmp_path / "b"), "--backend", "onnxruntime", "--no-search"]) == 0
    out = capsys.readouterr().out
    assert "data-dependent tail: 10 nodes from NonZero_15 on, computing scores, boxes" in out
    np.save(tmp_path / "x.npy", _feeds(1)["x"])
    assert cli(["run", str(tmp_path / "b"), "--input", f"x={tmp_path / 'x.npy'}", "--output-dir", str(tmp_path / "o")]) == 0
    want = ort.InferenceSession(str(path)).run(["boxes"], _feeds(1))[0]
    np.testing.assert_allclose(np.load(tmp_path / "o" / "boxes.npy"), want, rtol=1e-5, atol=1e-6)
    capsys.readouterr()
    assert cli(["verify", str(tmp_path / "b"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["passed"] is True


def test_no_host_tail_keeps_the_one_line_error(detector, tmp_path, capsys):
    path, _ = detector
    assert cli(["build", str(path), "-o", str(tmp_path / "b"), "--backend", "onnxruntime", "--no-host-tail"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "'NonZero_15' (NonZero" in err and "det.onnx" in err
    assert not (tmp_path / "b").exists()


def test_a_dynamic_batch_names_the_node(tmp_path, capsys):
    """A tail's outputs have no batch axis to bucket: a dynamic-batch build keeps the one-line error."""
    path = small_detector(tmp_path / "det.onnx", batch="N")
    assert cli(["build", str(path), "-o", str(tmp_path / "b"), "--backend", "onnxruntime", "--batch", "1:1:2",
                "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "NonZero" in err and not (tmp_path / "b").exists()
    assert "or build it at one static shape (without --batch)" in err


def test_everything_downstream_of_the_data_is_refused(tmp_path):
    """A model whose every output is data-dependent and whose tail would read only the inputs: nothing to build."""
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("NonZero", ["x"], ["nz"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("nz", TensorProto.INT64, [1, "k"])])
    path = tmp_path / "nz.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    with pytest.raises(ParastreamError, match=r"nz\.onnx: node .*NonZero.*nothing is left to build"):
        build(path, tmp_path / "out", backend="onnxruntime")
    assert not (tmp_path / "out").exists()


def test_a_tampered_tail_is_refused(detector, tmp_path):
    import shutil

    _, bundle = detector
    copy = tmp_path / "b"
    shutil.copytree(bundle.path, copy)
    (copy / "tail.onnx").write_bytes((copy / "tail.onnx").read_bytes() + b"\0")
    with pytest.raises(ParastreamError, match="tail.onnx"):
        load(copy)


def _with_record(bundle, tmp_path, **changes):
    """A copy of ``bundle`` whose manifest's tail record has ``changes`` (the manifest hashed again: only the record
    is wrong)."""
    import shutil

    copy = tmp_path / "b"
    shutil.copytree(bundle.path, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["host_tail"].update(changes)
    write_manifest(copy, {k: v for k, v in manifest.items() if k not in ("files", "version")})
    return copy


@pytest.mark.parametrize("file", ["../det.onnx", "/etc/passwd", "engines"])
def test_a_tail_path_outside_the_bundle_or_not_its_file_is_refused(detector, tmp_path, file):
    copy = _with_record(detector[1], tmp_path, file=file)
    with pytest.raises(ParastreamError, match="host_tail|outside the bundle|not listed"):
        load(copy)


class _OnAGpu:
    """A CPU runner posing as a GPU launcher (its buffers on GPU 0): what TailRunner asks before it puts a tail
    on the GPU."""

    arena_device = 0

    def __init__(self, inner):
        self.inner, self.plan = inner, inner.plan


@pytest.mark.parametrize("missing", ["torch", "an op"])
def test_a_gpu_tail_that_cannot_be_made_stays_on_the_host_saying_why(detector, monkeypatch, missing):
    pytest.importorskip("torch")
    from parastream.launcher.engines import onnx_eager
    from parastream.launcher.tail import TailRunner

    bundle = detector[1]
    if missing == "torch":  # a GPU launcher without torch: TensorRT's engines need none
        def no_torch():
            raise ImportError("No module named 'torch'")
        monkeypatch.setattr(onnx_eager, "_torch", no_torch)
    else:
        monkeypatch.delitem(onnx_eager.OPS, "TopK")
    runner = TailRunner(_OnAGpu(load(bundle.path, host_tail=False)), bundle, bundle.manifest["host_tail"], on="gpu")
    assert not runner.on_gpu
    import re

    assert re.fullmatch(r"torch is not importable \(No module named 'torch'\)" if missing == "torch"
                        else r"node 'TopK_\d+' \(TopK\) does not run on the GPU tail \(launcher/engines/onnx_eager.py\)",
                        runner.why_host)


def test_a_tail_placed_nowhere_known_is_refused(detector, tmp_path):
    copy = _with_record(detector[1], tmp_path, runs_on="tpu")
    with pytest.raises(ParastreamError, match="host_tail is malformed.*runs_on"):
        load(copy)


def test_a_malformed_record_is_refused(detector, tmp_path):
    copy = _with_record(detector[1], tmp_path, boundary=["not_a_plan_output"])
    with pytest.raises(ParastreamError, match="'not_a_plan_output', which the bundle's plan does not give it"):
        load(copy)
    assert Bundle.open(copy).manifest["host_tail"]["boundary"] == ["not_a_plan_output"]  # (the open itself is fine)


@pytest.fixture(scope="module")
def gpu_detector(tmp_path_factory):
    """The detector built with torch engines in fp16 on the GPU (its search and rounds as a user's build runs them)."""
    if not _cuda():
        pytest.skip("needs a CUDA GPU")
    root = tmp_path_factory.mktemp("gpu_detector")
    path = small_detector(root / "det.onnx")
    return path, build(path, root / "out", backend="torch", precision="fp16")


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


_GPU_FEEDS = [_feeds(0), _feeds(1), _feeds(2, scale=3.0), _feeds(3, scale=0.0)]


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("on", ["host", "gpu"])
def test_gpu_bundle_runs_its_tail_after_the_replay(gpu_detector, on):
    """The static part replayed as one CUDA Graph, the tail on the host or the GPU on the tensors the replay
    gave, computing what the tail's ONNX Runtime session computes on them; the logits within fp16's tolerance
    of onnxruntime on the original."""
    from parastream.launcher.gpu import GpuLauncher
    from parastream.launcher.tail import TailRunner

    path, bundle = gpu_detector
    assert bundle.report["verification"]["passed"] and bundle.report["host_tail"]["end_to_end"]
    static = load(bundle.path, host_tail=False)
    runner = TailRunner(load(bundle.path, host_tail=False), bundle, bundle.manifest["host_tail"], on=on)
    assert isinstance(runner.inner, GpuLauncher) and runner.on_gpu == (on == "gpu")
    tail = ort.InferenceSession(str(bundle.path / "tail.onnx"))
    full = ort.InferenceSession(str(path))
    counts = set()
    try:
        for feeds in _GPU_FEEDS:
            got = runner(feeds)
            part = static(feeds)
            want = dict(zip(["scores", "boxes"], tail.run(["scores", "boxes"], {n: part[n] for n in ("all_scores", "all_boxes")})))
            for name in want:
                assert isinstance(got[name], np.ndarray)
                np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-7)
            ref = full.run(["logits"], feeds)[0]
            assert np.abs(got["logits"] - ref).max() <= 2e-2 * max(1.0, np.abs(ref).max())
            counts.add(len(got["scores"]))
        assert 0 in counts and len(counts) > 1
        assert runner.fallbacks == 0
    finally:
        runner.close()
        static.close()


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_build_times_both_places_and_ships_the_faster(gpu_detector):
    _, bundle = gpu_detector
    rec = bundle.report["host_tail"]
    placed = rec["placement"]
    assert placed["runs_on"] in ("host", "gpu") and placed["runs_on"] == bundle.manifest["host_tail"]["runs_on"]
    timed = placed["timed"]
    assert timed["gpu_ms"] > 0 and timed["host_ms"] > 0
    assert placed["runs_on"] == ("gpu" if timed["gpu_ms"] < timed["host_ms"] else "host")
    assert load(bundle.path).on_gpu == (placed["runs_on"] == "gpu")


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_tail_takes_device_feeds_and_answers_on_the_device(gpu_detector):
    import torch

    from parastream.launcher.tail import TailRunner

    _, bundle = gpu_detector
    runner = TailRunner(load(bundle.path, host_tail=False), bundle, bundle.manifest["host_tail"], on="gpu")
    host = load(bundle.path)
    try:
        for feeds in _GPU_FEEDS[:3]:
            want = {k: np.array(v) for k, v in host(feeds).items()}
            got = runner({"x": torch.from_numpy(feeds["x"]).cuda()})
            assert isinstance(got["scores"], torch.Tensor) and got["scores"].is_cuda
            for name in ("scores", "boxes"):
                np.testing.assert_allclose(got[name].cpu().numpy(), want[name], rtol=1e-6, atol=1e-7)
            np.testing.assert_array_equal(got["logits"].torch().cpu().numpy(), want["logits"])
    finally:
        runner.close()
        host.close()


@pytest.mark.gpu
@pytest.mark.slow
def test_a_call_whose_gpu_tail_fails_is_answered_by_the_host(gpu_detector, monkeypatch):
    from parastream.launcher.tail import TailRunner

    _, bundle = gpu_detector
    runner = TailRunner(load(bundle.path, host_tail=False), bundle, bundle.manifest["host_tail"], on="gpu")
    host = TailRunner(load(bundle.path, host_tail=False), bundle, bundle.manifest["host_tail"], on="host")

    def broken(values):
        raise RuntimeError("an op that failed")

    monkeypatch.setattr(runner._graph, "run", broken)
    try:
        with pytest.warns(UserWarning, match="failed on the GPU.*an op that failed"):
            got = runner(_feeds(1))
        want = host(_feeds(1))
        for name in ("scores", "boxes"):
            np.testing.assert_array_equal(got[name], want[name])
        assert runner.fallbacks == 1
    finally:
        runner.close()
        host.close()


def test_inspect_shows_the_static_part_and_names_the_tail(detector, capsys):
    path, _ = detector
    assert cli(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "data-dependent tail: 10 nodes from NonZero_15 on, computing scores, boxes" in out
    assert "NonZero" not in out.split("data-dependent tail")[0]  # the histogram above is the static part's


def test_an_output_the_tail_also_reads(tmp_path):
    """A model output that the tail reads too (the scores of every anchor, served beside the detections): one
    static output, answered once and read by the tail."""
    path = small_detector(tmp_path / "det.onnx")
    model = onnx.load(str(path))
    model.graph.output.append(onnx.helper.make_tensor_value_info("all_scores", onnx.TensorProto.FLOAT, [256]))
    onnx.save(model, path)
    bundle = build(path, tmp_path / "out", backend="onnxruntime", search=False)
    assert bundle.manifest["host_tail"]["order"] == ["logits", "scores", "boxes", "all_scores"]
    assert [t.name for t in bundle.plan.outputs].count("all_scores") == 1
    runner = load(bundle.path)
    full = ort.InferenceSession(str(path))
    feeds = _feeds(1)
    got = runner(feeds)
    assert list(got) == ["logits", "scores", "boxes", "all_scores"]
    for name, want in zip(["logits", "scores", "boxes", "all_scores"], full.run(None, feeds)):
        np.testing.assert_allclose(got[name], want, rtol=1e-5, atol=1e-6)


class _Timed:
    """A tail runner whose calls take ``ms`` (the host's: ``tail_s`` its tail's share), answering ``out``."""

    def __init__(self, ms: float, inner=None, out=None):
        self.ms, self.inner, self.out, self.tail_s, self.fallbacks, self.on_gpu = ms, inner, out, 0.0, 0, True
        self.record = {"outputs": ["y"]}

    def __call__(self, feeds):
        import time

        time.sleep(self.ms / 1e3)
        self.tail_s = self.ms / 2e3
        return {"y": self.out}


@pytest.mark.parametrize("host_ms, gpu_ms, timed", [(30.0, 1.0, 3), (2.0, 1.6, 7)])
def test_a_placement_decided_by_far_stops_timing_and_hands_on_its_host_calls(monkeypatch, host_ms, gpu_ms, timed):
    """The placement times both sides alternating, seven calls each, but stops after three where every call of the
    slower side took over twice the faster side's slowest (a tail of 0.4 s a call on the host paid seven and then
    five more for the report); the host's calls it timed are the report's tail and call figures."""
    import types
    from contextlib import nullcontext

    import parastream.launcher.tail as tail_mod
    import parastream.pipeline.bench as bench_mod
    from parastream.pipeline import host_tail

    out = np.arange(3, dtype=np.float32)
    inner = types.SimpleNamespace(arena_device=0, bundle=None)
    host = _Timed(host_ms, inner, out)
    gpu = _Timed(gpu_ms, inner, out)
    monkeypatch.setattr(tail_mod, "TailRunner", lambda *a, **k: gpu)
    monkeypatch.setattr(bench_mod, "gpu_timing_lock", lambda *a, **k: nullcontext())
    got = host_tail.place(host, [], seed=0, inputs_compared=1)
    assert got["runs_on"] == "gpu" and f"median of {timed}," in got["timed"]["how"]
    assert ("decided after" in got["timed"]["how"]) == (timed < 7)
    calls = got["host_calls"]
    assert calls["call_ms"] == got["timed"]["host_ms"] and calls["tail_ms"] == pytest.approx(host_ms / 2, rel=1e-6)


def test_the_summary_says_where_the_build_placed_the_tail(detector, tmp_path):
    """A GPU build's record (both places timed, the GPU's kept), as the summary reads it from report.json."""
    import io
    import shutil

    from rich.console import Console

    from parastream.pipeline.report import print_build_summary

    copy = tmp_path / "b"
    shutil.copytree(detector[1].path, copy)
    report = json.loads((copy / "report.json").read_text())
    report["host_tail"]["placement"] = {"runs_on": "gpu", "timed": {"host_ms": 41.15, "gpu_ms": 16.14}, "why": "faster"}
    report["host_tail"]["runs_on"] = "gpu"
    (copy / "report.json").write_text(json.dumps(report))
    manifest = json.loads((copy / "manifest.json").read_text())
    write_manifest(copy, {k: v for k, v in manifest.items() if k not in ("files", "version")})
    out = io.StringIO()
    print_build_summary(Bundle.open(copy), Console(file=out, width=400))
    assert ("computing scores, boxes, run as torch ops on the GPU after each replay (16.14 ms a call on the GPU, "
            "41.15 on the host)") in out.getvalue()
    out = io.StringIO()
    print_build_summary(detector[1], Console(file=out, width=400))  # a CPU plan's: no placement to explain
    assert "boxes, run by onnxruntime on the host after each replay (it reads" in out.getvalue()


def test_a_boundary_tensor_with_no_data_is_the_tails_constant(tmp_path):
    """A tensor the tail reads whose static shape has a 0 (mask coefficients a detection model has none of, as
    YOLOv8's export with NMS slices them): no plan output serves it; the tail holds its (empty) value."""
    path = small_detector(tmp_path / "det.onnx", empty_coeffs=True)
    bundle = build(path, tmp_path / "out", backend="onnxruntime", search=False)
    rec = bundle.manifest["host_tail"]
    assert "coeffs" in rec["constants"] and "coeffs" not in rec["boundary"]
    assert "coeffs" not in [t.name for t in bundle.plan.outputs]
    held = {t.name: t for t in onnx.load(str(bundle.path / "tail.onnx")).graph.initializer}
    assert list(held["coeffs"].dims) == [256, 0]
    runner, full = load(bundle.path), ort.InferenceSession(str(path))
    for seed in range(3):
        for name, want in zip(["logits", "scores", "boxes"], full.run(None, _feeds(seed))):
            np.testing.assert_allclose(runner(_feeds(seed))[name], want, rtol=1e-5, atol=1e-6)


def _with_if_reading_outer_tensors(path):
    """small_detector whose boxes pass an If (as torchvision's detectors branch on an empty box set) whose
    branches read tensors of the enclosing graph without listing them: one the static part computes (the
    logits' peak, read by nothing else) and one the tail computes (the boxes)."""
    from onnx import TensorProto, helper, numpy_helper

    model = onnx.load(str(path))
    g = model.graph
    div = next(n for n in g.node if n.output[0] == "boxes")
    div.output[0] = "boxes_raw"
    then_g = helper.make_graph([helper.make_node("Mul", ["boxes_raw", "peak"], ["t_out"])], "then", [],
                               [helper.make_tensor_value_info("t_out", TensorProto.FLOAT, None)])
    else_g = helper.make_graph([helper.make_node("Identity", ["boxes_raw"], ["e_out"])], "else", [],
                               [helper.make_tensor_value_info("e_out", TensorProto.FLOAT, None)])
    g.initializer.append(numpy_helper.from_array(np.array(0, np.int64), "zero_i"))
    g.node.extend([helper.make_node("ReduceMax", ["logits"], ["peak"], keepdims=0),
                   helper.make_node("Size", ["scores"], ["nsc"]),
                   helper.make_node("Greater", ["nsc", "zero_i"], ["has"]),
                   helper.make_node("If", ["has"], ["boxes"], then_branch=then_g, else_branch=else_g)])
    onnx.save(model, path)
    return path


def test_an_if_in_the_tail_gets_the_tensors_its_branches_read(tmp_path):
    path = _with_if_reading_outer_tensors(small_detector(tmp_path / "det.onnx"))
    bundle = build(path, tmp_path / "out", backend="onnxruntime", search=False)
    rec = bundle.manifest["host_tail"]
    assert "peak" in rec["boundary"]  # read only inside a branch: the static part computes it for the tail
    tail = onnx.load(str(bundle.path / "tail.onnx"))
    assert [len(n.input) for n in tail.graph.node if n.op_type == "If"] == [1]  # (as ONNX writes an If)
    runner, full = load(bundle.path), ort.InferenceSession(str(path))
    counts = set()
    for feeds in [_feeds(0), _feeds(1, scale=3.0), _feeds(2, scale=0.0)]:
        got = runner(feeds)
        for name, want in zip(["logits", "scores", "boxes"], full.run(None, feeds)):
            np.testing.assert_allclose(got[name], want, rtol=1e-5, atol=1e-6)
        counts.add(len(got["scores"]))
    assert 0 in counts and len(counts) > 1  # both branches taken


def test_a_selection_and_what_it_picks_go_with_the_tail(tmp_path):
    """A top-k of fixed k in front of the threshold (a region-proposal stage's pre-NMS top-k) and the boxes its
    indices gather: a decision, and values it chose, read only by the tail (and a Shape, which reads a static
    shape).  They move into the tail, so that the static part's outputs are the scores and boxes themselves:
    values its verification judges within a tolerance, where the top-k's choice among near-equal scores would
    differ between backends and precisions entirely."""
    from onnx import helper, numpy_helper

    path = small_detector(tmp_path / "det.onnx")
    model = onnx.load(str(path))
    g = model.graph
    g.initializer.append(numpy_helper.from_array(np.array([64], np.int64), "k64"))
    for n in g.node:  # the threshold and the boxes read the top-k's choice instead of every anchor
        n.input[:] = [{"all_scores": "top_scores", "all_boxes": "top_boxes"}.get(x, x) if n.op_type in
                      ("Greater", "GatherND") else x for x in n.input]
    first = next(i for i, n in enumerate(g.node) if n.op_type == "Greater")
    for node in reversed([helper.make_node("TopK", ["all_scores", "k64"], ["top_scores", "top_idx"]),
                          helper.make_node("Gather", ["all_boxes", "top_idx"], ["top_boxes"], axis=0),
                          helper.make_node("Shape", ["top_idx"], ["top_n"]),
                          helper.make_node("Cast", ["top_n"], ["top_n_f"], to=onnx.TensorProto.FLOAT)]):
        g.node.insert(first, node)
    g.output.append(helper.make_tensor_value_info("top_n_f", onnx.TensorProto.FLOAT, [1]))  # a Shape kept outside
    onnx.save(model, path)
    bundle = build(path, tmp_path / "out", backend="onnxruntime", search=False)
    rec = bundle.manifest["host_tail"]
    assert {"TopK", "Gather"} <= set(rec["ops"]) and rec["ops"]["TopK"] == 2
    assert set(rec["boundary"]) == {"all_scores", "all_boxes"}  # values, not what the top-k chose
    runner, full = load(bundle.path), ort.InferenceSession(str(path))
    for feeds in [_feeds(0), _feeds(1, scale=3.0), _feeds(2, scale=0.0)]:
        got = runner(feeds)
        for name, want in zip([o.name for o in full.get_outputs()], full.run(None, feeds)):
            np.testing.assert_allclose(got[name], want, rtol=1e-5, atol=1e-6)
