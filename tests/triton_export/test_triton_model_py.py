"""The exported model.py driven as Triton's Python backend drives it (through the pb_utils double), on the
CPU with onnxruntime bundles, against ONNX Runtime on the original model (max relative error <= 1e-5)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from triton_helpers import initialize_args, load_model_py, model_config_or_skip
from graphs import ort_reference

from parastream.pipeline.triton import export_triton

model_config_or_skip()


def _max_rel(a, b):
    return float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-6)))


def _served(bundles, tmp_path, key, **kwargs):
    bundle, original = bundles[key]
    repo = tmp_path / "repo"
    model_dir = export_triton(bundle, repo, name="m", **kwargs)
    module = load_model_py(model_dir)
    model = module.TritonPythonModel()
    model.initialize(initialize_args(model_dir))
    return model, original


def _request(pb_utils, **arrays):
    return pb_utils.InferenceRequest([pb_utils.Tensor(k, v) for k, v in arrays.items()])


def _outputs(response):
    assert not response.has_error(), response.error().message()
    return {t.name(): t.as_numpy() for t in response.output_tensors()}


def test_execute_matches_onnxruntime_on_the_original(bundles, tmp_path, pb_utils):
    model, original = _served(bundles, tmp_path, "three")
    rng = np.random.default_rng(7)
    xs = [rng.standard_normal((1, 4, 8, 8)).astype(np.float32) for _ in range(3)]
    # several requests in one execute (instance count 1, no batching: each runs alone)
    responses = model.execute([_request(pb_utils, input=x) for x in xs])
    assert len(responses) == 3
    for x, response in zip(xs, responses):
        got = _outputs(response)
        want = ort_reference(original, {"input": x})
        assert set(got) == {"output"}
        assert got["output"].shape == (1, 12, 8, 8) and got["output"].dtype == np.float32
        assert _max_rel(got["output"], want["output"]) <= 1e-5
    model.finalize()


def test_initialize_logs_how_long_the_instance_took_to_be_ready(bundles, tmp_path, pb_utils):
    pb_utils.Logger.messages.clear()
    model, _ = _served(bundles, tmp_path, "three")
    ready = [m for level, m in pb_utils.Logger.messages if level == "info" and "ready in" in m]
    assert len(ready) == 1 and 0 < model.initialize_s < 600
    assert ready[0].startswith("parastream: m ready in ") and f"{model.initialize_s:.2f} s" in ready[0]
    assert f"{len(model.plan.branches)} branches loaded" in ready[0]
    age = re.search(r"; ([\d.]+) s since the stub process started\)$", ready[0])  # this test process's age, here
    assert age and float(age.group(1)) >= model.initialize_s, ready[0]
    # the process's CPU seconds by then, every thread's (this test process's here)
    cpu = re.search(r", the process's CPU ([\d.]+) s;", ready[0])
    assert cpu and 0 < float(cpu.group(1)), ready[0]


def test_a_gpu_launchers_load_phases_are_what_the_second_line_logs(bundles, tmp_path, pb_utils, monkeypatch):
    """model.py's load-phase line takes the launcher's phases where its engines record them (torch engines on the
    GPU), with where their cuDNN plans came from where those were used, and nothing else; bench/triton_gpu.py
    reads the line back as numbers.  A CPU instance logs no such line."""
    import sys
    import types

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import triton_gpu

    pb_utils.Logger.messages.clear()
    model_dir = export_triton(bundles["three"][0], tmp_path / "repo", name="m")
    module = load_model_py(model_dir)
    module.TritonPythonModel().initialize(initialize_args(model_dir))
    assert [m for _, m in pb_utils.Logger.messages if "ready in" in m]
    assert not [m for _, m in pb_utils.Logger.messages if "load phases" in m]  # CPU: none
    engines = [types.SimpleNamespace(phases={"unpack": 0.25, "warm": 0.5}), types.SimpleNamespace(phases={"warm": 0.25})]
    runner = types.SimpleNamespace(engines=engines, load_s=1.5, warm_s=0.8, ready_s=2.0)
    monkeypatch.delitem(sys.modules, "parastream.launcher.engines.cudnn_plans", raising=False)  # no plans used
    got = module._load_phases(runner)
    assert got == {"unpack": 0.25, "warm": 0.75, "engines": 1.5, "warm_wall": 0.8, "ready": 2.0}
    plans = types.SimpleNamespace(plan_sources=lambda: {"plans_loaded": 108, "plans_built": 0, "frontend": 1})
    monkeypatch.setitem(sys.modules, "parastream.launcher.engines.cudnn_plans", plans)  # (a torch engine's load)
    assert module._load_phases(runner) == {**got, "plans_loaded": 108, "plans_built": 0, "frontend": 1}
    assert module._load_phases(types.SimpleNamespace(engines=[types.SimpleNamespace()], load_s=1.0)) == {}
    line = "parastream: m_0_0 load phases (s, summed over engines): " + ", ".join(f"{k} {v:.2f}" for k, v in got.items())
    log = f"I1130 model.py:199] parastream: m_0_0 ready in 2.00 s (...)\nI1130 model.py:202] {line}\nnext line\n"
    assert triton_gpu.logged_load_phases(log) == [got]
    # shipped plans built again at the start: a third line says why, which the benchmark keeps
    assert module._plans_refused() == {}  # (this stand-in module has no plans_refused: nothing said)
    why = {"not read back (RuntimeError: x)": 3}
    monkeypatch.setitem(sys.modules, "parastream.launcher.engines.cudnn_plans",
                        types.SimpleNamespace(plans_refused=lambda: why))
    assert module._plans_refused() == why
    line = module._refused_line("m_0_0", why)
    assert line == "parastream: m_0_0 cuDNN plans not used as shipped: 3x not read back (RuntimeError: x)"
    assert triton_gpu.logged_plans_refused(f"I1130 model.py:210] {line}\nnext line\n") == [
        "3x not read back (RuntimeError: x)"]
    assert module._refused_line("m_0_0", {}) is None

    # a cuDNN other than torch's own in the process (the library path): torch's complaint, in one line
    import torch

    assert module._cudnn_mismatch() is None

    def wrong():
        raise RuntimeError("cuDNN version incompatibility: PyTorch was compiled  against (9, 19, 0) but found runtime "
                           "version (9, 14, 0).\nmore")

    monkeypatch.setattr(torch.backends.cudnn, "version", wrong)
    assert module._cudnn_mismatch().startswith("cuDNN version incompatibility: PyTorch was compiled  against (9, 19")


def test_two_outputs(bundles, tmp_path, pb_utils):
    model, original = _served(bundles, tmp_path, "two_output")
    x = np.random.default_rng(3).standard_normal((2, 16)).astype(np.float32)
    got = _outputs(model.execute([_request(pb_utils, x=x)])[0])
    want = ort_reference(original, {"x": x})
    assert set(got) == {"y", "aux"}
    for k in want:
        assert _max_rel(got[k], want[k]) <= 1e-5
    model.finalize()


def test_dynamic_batches_are_concatenated_padded_and_split(bundles, tmp_path, pb_utils):
    # bundle built at batch 4; Triton may hand execute() several requests of batch <= max_batch_size
    model, original = _served(bundles, tmp_path, "three_b4", max_batch=4)
    rng = np.random.default_rng(11)
    sizes = [1, 2, 3, 4, 1]
    xs = [rng.standard_normal((n, 4, 8, 8)).astype(np.float32) for n in sizes]
    calls = []
    runner = model.runner
    model.runner = lambda feeds: calls.append(feeds["input"].shape) or runner(feeds)
    responses = model.execute([_request(pb_utils, input=x) for x in xs])
    # greedy groups that fit the bundle's batch: [1, 2], [3], [4], [1] -> 4 launcher runs, each at batch 4
    assert calls == [(4, 4, 8, 8)] * 4
    for x, response in zip(xs, responses):
        n = len(x)
        got = _outputs(response)["output"]
        assert got.shape == (n, 12, 8, 8)
        # the original model (batch 4) on this request's rows, zero-padded: the rows are independent
        ref = ort_reference(original, {"input": np.concatenate([x, np.zeros((4 - n, 4, 8, 8), np.float32)])})["output"][:n]
        assert _max_rel(got, ref) <= 1e-5
    model.runner = runner
    model.finalize()


def test_bad_requests_get_errors_and_the_others_still_run(bundles, tmp_path, pb_utils):
    model, original = _served(bundles, tmp_path, "three")
    x = np.random.default_rng(5).standard_normal((1, 4, 8, 8)).astype(np.float32)
    responses = model.execute([
        _request(pb_utils, wrong=x),
        _request(pb_utils, input=x[:, :2]),
        _request(pb_utils, input=x),
    ])
    assert responses[0].has_error() and "missing input 'input'" in responses[0].error().message()
    assert responses[1].has_error() and "shape [1, 2, 8, 8]" in responses[1].error().message()
    assert responses[0].output_tensors() == []
    assert _max_rel(_outputs(responses[2])["output"], ort_reference(original, {"input": x})["output"]) <= 1e-5
    model.finalize()


def test_a_failing_run_answers_every_request_of_its_group(bundles, tmp_path, pb_utils):
    model, _ = _served(bundles, tmp_path, "three_b4", max_batch=4)

    def broken(feeds):
        raise RuntimeError("engine exploded")

    model.runner = broken
    xs = [np.zeros((2, 4, 8, 8), np.float32)] * 2
    responses = model.execute([_request(pb_utils, input=x) for x in xs])
    assert [r.has_error() for r in responses] == [True, True]
    assert "engine exploded" in responses[1].error().message()


def test_batched_request_shapes_are_checked(bundles, tmp_path, pb_utils):
    model, _ = _served(bundles, tmp_path, "three_b4", max_batch=4)
    too_big = np.zeros((5, 4, 8, 8), np.float32)
    no_batch = np.zeros((4, 8, 8), np.float32)
    responses = model.execute([_request(pb_utils, input=too_big), _request(pb_utils, input=no_batch)])
    assert all(r.has_error() for r in responses)
    assert "[1..4] + [4, 8, 8]" in responses[0].error().message()
    model.finalize()


def test_gpu_instance_of_a_cpu_bundle_runs_on_the_cpu(bundles, tmp_path, pb_utils):
    # a user who edits the config to KIND_GPU still gets the CPU launcher for onnxruntime engines
    bundle, original = bundles["three"]
    model_dir = export_triton(bundle, tmp_path / "repo", name="m")
    model = load_model_py(model_dir).TritonPythonModel()
    model.initialize(initialize_args(model_dir, kind="GPU"))
    assert model.on_gpu is False
    x = np.ones((1, 4, 8, 8), np.float32)
    got = _outputs(model.execute([_request(pb_utils, input=x)])[0])
    assert _max_rel(got["output"], ort_reference(original, {"input": x})["output"]) <= 1e-5
    model.finalize()


def test_initialize_refuses_a_bundle_parameter_leaving_the_version_folder(bundles, tmp_path, pb_utils):
    import json

    from parastream.launcher.errors import ParastreamError

    model_dir = export_triton(bundles["three"][0], tmp_path / "repo", name="m")
    args = initialize_args(model_dir)
    config = json.loads(args["model_config"])
    config["parameters"]["parastream_bundle"]["string_value"] = "../../../b"
    args["model_config"] = json.dumps(config)
    with pytest.raises(ParastreamError, match="outside the bundle"):
        load_model_py(model_dir).TritonPythonModel().initialize(args)
    # the untouched parameter loads (the refusal above is specific)
    load_model_py(model_dir).TritonPythonModel().initialize(initialize_args(model_dir))


def test_a_bucketed_bundle_gets_each_group_s_own_rows_unpadded(tmp_path, pb_utils):
    """--batch 1:2:4: model.py hands the launcher the group's rows as they are (no padding to 4); the launcher
    runs each on the smallest bucket that holds it; each request gets its rows."""
    import onnx
    from graphs import three_branch_model

    from parastream.launcher.buckets import BucketedLauncher
    from parastream.pipeline import build

    original = three_branch_model(batch="N")
    original.ir_version = 8
    onnx.save(original, tmp_path / "dyn.onnx")
    bundle = build(tmp_path / "dyn.onnx", tmp_path / "bundle", backend="onnxruntime", batch=(1, 2, 4), search=False,
                   measure=False)
    model_dir = export_triton(bundle, tmp_path / "repo", name="m")
    model = load_model_py(model_dir).TritonPythonModel()
    model.initialize(initialize_args(model_dir))
    assert isinstance(model.runner, BucketedLauncher)
    rng = np.random.default_rng(12)
    sizes = [1, 2, 3, 2]
    xs = [rng.standard_normal((n, 4, 8, 8)).astype(np.float32) for n in sizes]
    calls = []
    runner = model.runner
    model.runner = lambda feeds: calls.append(feeds["input"].shape[0]) or runner(feeds)
    responses = model.execute([_request(pb_utils, input=x) for x in xs])
    assert calls == [3, 3, 2]  # greedy groups up to 4 rows: [1, 2], [3], [2]; unpadded
    assert [runner.bucket_for(n) for n in calls] == [4, 4, 2]
    for x, response in zip(xs, responses):
        got = _outputs(response)["output"]
        assert got.shape == (len(x), 12, 8, 8)
        assert _max_rel(got, ort_reference(original, {"input": x})["output"]) <= 1e-5
    model.runner = runner
    model.finalize()


def test_model_py_starts_torch_s_import_as_the_stub_imports_it_for_a_gpu_bundle(bundles, tmp_path):
    """Importing model.py (what the stub does before initialize) starts torch's import in a thread when the bundle
    beside it was built for the GPU, and does nothing for a CPU bundle (a fresh process each, without torch)."""
    import json
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    pytest.importorskip("torch")
    model_dir = export_triton(bundles["three"][0], tmp_path / "repo", name="m")
    here = Path(__file__).resolve().parent
    script = textwrap.dedent(f"""
        import sys, threading
        sys.path.insert(0, {str(here)!r})
        from triton_helpers import load_model_py
        assert "torch" not in sys.modules
        load_model_py({str(model_dir)!r})
        started = [t for t in threading.enumerate() if t.name == "parastream-model-import-torch"]
        for t in started:
            t.join(300)
        print(len(started), "torch" in sys.modules)
    """)

    def run():
        p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-2000:]
        return p.stdout.split()[-2:]

    assert run() == ["0", "False"]  # an onnxruntime bundle built for the CPU
    manifest = model_dir / "1" / "bundle" / "manifest.json"  # (manifest.json lists the hashes, it is not hashed)
    manifest.write_text(json.dumps(dict(json.loads(manifest.read_text()), device="cuda: NVIDIA H100 80GB HBM3")))
    assert run() == ["1", "True"]
