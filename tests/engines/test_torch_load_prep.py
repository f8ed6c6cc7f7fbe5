"""What a fresh process's load of compiled torch engines does before and around the engines (the compiled engines' load
target): Inductor's one-time runtime imports and Triton's hash start while the bundle's files are hashed, and a
loaded artifact's first call runs without AOTAutograd's custom-op aliasing check.  The load itself is timed on the
GPU (bench/engine_artifacts.py); here: that each piece happens, in order, and only where it applies."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from parastream.launcher.bundle import Bundle  # noqa: E402
from parastream.launcher.engines import torch as tb  # noqa: E402
from parastream.pipeline import build  # noqa: E402

SMALL_NET = Path(__file__).resolve().parents[2] / "examples" / "models" / "small_net.onnx"


def test_a_gpu_bundle_s_load_starts_the_runtime_imports_a_cpu_one_does_not(monkeypatch):
    started = []
    monkeypatch.setattr(tb, "_import_runtime_in_background", lambda: started.append(1))
    tb.prepare_load({"device": "cpu: x86_64 (Linux)"})
    tb.prepare_load({})
    assert started == []
    tb.prepare_load({"device": "cuda: NVIDIA H100 80GB HBM3 (torch 2.11.0+cu130)"})
    assert started == [1]


def test_a_gpu_bundle_of_kernels_engines_starts_no_import_one_with_inductor_s_artifacts_does(monkeypatch):
    """"kernels" engines load without Inductor: nothing to import beside the hashes.  Engines without compiled
    code (in-place Concats) do not count; one engine that ships Inductor's own artifact starts the imports."""
    started = []
    monkeypatch.setattr(tb, "_import_runtime_in_background", lambda: started.append(1))
    gpu = {"device": "cuda: NVIDIA H100 80GB HBM3 (torch 2.11.0+cu130)"}
    kernels = {"engines": {"b0": {"compiled": "kernels"}, "b1": {"compiled": None}, "b2": {"compiled": "kernels"}}}
    tb.prepare_load(gpu, kernels)
    assert started == []
    kernels["engines"]["b3"] = {"compiled": "inductor", "kernels_error": "ParastreamError: ..."}
    tb.prepare_load(gpu, kernels)
    assert started == [1]


def test_bundle_open_for_loading_prepares_the_backend_before_it_hashes_the_files(tmp_path, monkeypatch):
    """``Bundle.open(..., loading=True)`` (what ``launcher.load``, the GPU launcher, ``parastream run`` and Triton's
    model.py call) hands the manifest to the backend's ``prepare_load`` first, then checks the hashes: the imports
    run while the files are hashed.  A plain open prepares nothing."""
    from parastream.launcher.engines import get_backend

    bundle = build(SMALL_NET, tmp_path / "b", backend="onnxruntime", search=False, measure=False)
    order = []
    ort = get_backend("onnxruntime")
    monkeypatch.setattr(ort, "prepare_load", lambda manifest, report: order.append(("prepare", manifest["backend"])),
                        raising=False)
    real = Bundle.check_hashes
    monkeypatch.setattr(Bundle, "check_hashes", lambda self, **kw: order.append(("hashes",)) or real(self, **kw))
    Bundle.open(bundle.path)
    assert order == [("hashes",)]
    order.clear()
    Bundle.open(bundle.path, loading=True)
    assert order == [("prepare", "onnxruntime"), ("hashes",)]


def test_a_loaded_artifact_s_first_call_skips_the_custom_op_aliasing_check():
    from torch._functorch import config
    if not hasattr(config, "check_custom_op_aliasing"):
        pytest.skip("this torch has no custom-op aliasing check")
    before = config.check_custom_op_aliasing
    with tb._first_call_unchecked(True):
        assert config.check_custom_op_aliasing is False
    assert config.check_custom_op_aliasing == before
    with tb._first_call_unchecked(False):  # an engine compiled at load (torch.compile): untouched
        assert config.check_custom_op_aliasing == before


def test_the_runtime_imports_run_once_per_process_in_two_threads(monkeypatch):
    """Imports in one thread, Triton's hash in another (without Triton here it does nothing), once per process."""
    import sys

    monkeypatch.setattr(tb, "_RUNTIME_IMPORT", [])
    monkeypatch.setitem(sys.modules, "triton", None)  # no Triton: its thread returns without error
    tb._import_runtime_in_background()
    tb._import_runtime_in_background()
    assert len(tb._RUNTIME_IMPORT) == 2
    for t in tb._RUNTIME_IMPORT:
        t.join(120)
        assert not t.is_alive()
    assert {t.name for t in tb._RUNTIME_IMPORT} == {"parastream-hash-triton", "parastream-import-inductor"}
    assert "torch._inductor.standalone_compile" in sys.modules


def test_a_gpu_bundle_s_open_imports_torch_beside_the_hashes_in_a_process_without_it():
    """Triton's model.py opens the bundle before it has imported torch: prepare_load starts that import in a
    thread (the hashes run meanwhile), and the load's own import finds the module."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import sys, threading
        from parastream.launcher.engines import torch as tb
        assert "torch" not in sys.modules
        tb.prepare_load({"device": "cuda: NVIDIA H100 80GB HBM3 (torch 2.11.0+cu130)"},
                        {"engines": {"b0": {"compiled": "kernels"}}})
        names = sorted(t.name for t in threading.enumerate() if t.name.startswith("parastream-"))
        import torch
        print(names, "parastream-import-torch" in tb.RUNTIME_IMPORT_TIMES, torch.ones(2).sum().item())
    """)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip().splitlines()[-1] == "['parastream-import-torch'] True 2.0"


def test_a_load_on_a_gpu_device_creates_its_context_beside_the_hashes(tmp_path, monkeypatch):
    """``Bundle.open(loading=True, device=N)`` of a GPU bundle starts device N's CUDA context in a thread (the
    load's import of torch runs meanwhile); a CPU bundle, a load without a device or a plain open do not."""
    import json

    from parastream.launcher import cuda

    bundle = build(SMALL_NET, tmp_path / "b", backend="onnxruntime", search=False, measure=False)
    started = []
    monkeypatch.setattr(cuda, "initialize_in_background", started.append)
    Bundle.open(bundle.path, loading=True, device=0)
    assert started == []  # an onnxruntime bundle built for the CPU
    manifest = json.loads((bundle.path / "manifest.json").read_text())
    (bundle.path / "manifest.json").write_text(json.dumps(dict(manifest, device="cuda: NVIDIA H100 80GB HBM3")))
    Bundle.open(bundle.path, loading=True)
    Bundle.open(bundle.path, device=1)
    assert started == []
    Bundle.open(bundle.path, loading=True, device=1)
    assert started == [1]


def test_the_context_thread_runs_once_per_device_and_leaves_errors_to_the_load(monkeypatch):
    """Without a GPU (or cuda-python) the thread ends quietly, once per device, and records when it ran."""
    from parastream.launcher import cuda

    monkeypatch.setattr(cuda, "CONTEXT_THREADS", {})
    monkeypatch.setattr(cuda, "CONTEXT_TIMES", {})
    cuda.initialize_in_background(3)
    cuda.initialize_in_background(3)
    assert list(cuda.CONTEXT_THREADS) == [3]
    cuda.CONTEXT_THREADS[3].join(60)
    assert not cuda.CONTEXT_THREADS[3].is_alive()
    t0, t1 = cuda.CONTEXT_TIMES[3]
    assert t1 >= t0


def test_the_gpu_load_path_imports_no_onnx():
    """What a GPU load imports (the launcher, the bundle, the torch backend and its kernels loader) leaves onnx
    out: its import would hold the interpreter while torch's runs beside the hashes (model.py, launcher.load)."""
    import subprocess
    import sys

    script = ("import sys; import parastream.launcher, parastream.launcher.gpu, parastream.launcher.engines.torch, "
              "parastream.launcher.engines.inductor_kernels; print(sorted(m for m in sys.modules if m.split('.')[0] == 'onnx'))")
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip() == "[]"


@pytest.mark.parametrize("started_before", [False, True])
def test_a_build_s_branch_checks_beside_the_runtime_imports_find_every_module_whole(started_before):
    """A GPU build's ``precompile`` starts the runtime imports in a thread and then converts the branches it
    queued in its own (the check that names a branch the converter cannot run).  A conversion imports
    ``torch._dynamo``, which imports Inductor's modules, while the thread imports Inductor's modules, which import
    dynamo: the caller imports dynamo itself first (``caller_converts``), else one of the two threads got a
    partially initialized module and a branch failed its check (on this 2-core CPU, about one fresh process in
    three; on the H200, a NASNet cell's first GPU build in a test process, twice in two).  Where the imports were
    started before (a load's, ``started_before``), the caller waits for them instead.  Fresh processes, five:
    the race is a process's first import of dynamo."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import sys
        from onnx import shape_inference
        from parastream.launcher.engines import torch as tb
        from parastream.launcher.engines.onnx_torch import convert
        from parastream.pipeline.zoo import MODELS
        assert "torch._dynamo" not in sys.modules
        model = shape_inference.infer_shapes(MODELS["nasnet_cell"]())
        if STARTED_BEFORE:
            tb._import_runtime_in_background()
        tb._import_runtime_in_background(caller_converts=True)
        print("steps", len(convert(model, "float32")._steps))
    """).replace("STARTED_BEFORE", str(started_before))
    for _ in range(5):
        r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0 and "steps" in r.stdout, r.stderr[-2000:]
