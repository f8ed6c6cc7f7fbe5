"""model.py on a GPU instance (marked gpu): a torch-engine bundle behind parastream's GPU launcher, inputs handed
over in GPU memory through DLPack as Triton does with FORCE_CPU_ONLY_INPUT_TENSORS "no", outputs leaving in GPU
memory, against ONNX Runtime on the original model."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from triton_helpers import initialize_args, load_model_py, model_config_or_skip
from graphs import ort_reference, three_branch_model

from parastream.pipeline.triton import export_triton, read_config

model_config_or_skip()
pytestmark = pytest.mark.gpu

TOL = 1e-3  # cuDNN may use TF32 for fp32 convolutions (the GPU launcher's own tests use the same bound)


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.fixture(scope="module")
def gpu_models(tmp_path_factory):
    pytest.importorskip("torch")
    from handmade_bundles import make_bundle

    root = tmp_path_factory.mktemp("triton_gpu")
    out = {}
    for name, batch in (("b1", 1), ("b4", 4)):
        m = three_branch_model(seed=2, channels=8, size=12, batch=batch)
        m.ir_version = 8
        p = root / f"{name}.onnx"
        onnx.save(m, p)
        out[name] = (make_bundle(p, root / f"{name}.bundle", backend="torch", streams=3, compile=False), m)
    return out


def _serve(bundle, tmp_path, **kwargs):
    model_dir = export_triton(bundle, tmp_path / "repo", name="m", **kwargs)
    config = read_config(model_dir / "config.pbtxt")
    assert config.instance_group[0].kind == 1  # KIND_GPU
    assert config.parameters["FORCE_CPU_ONLY_INPUT_TENSORS"].string_value == "no"
    model = load_model_py(model_dir).TritonPythonModel()
    model.initialize(initialize_args(model_dir, kind="GPU", device_id=0))
    assert model.on_gpu
    return model


def test_device_inputs_give_device_outputs(gpu_models, tmp_path, pb_utils):
    import torch

    from parastream.launcher.gpu import GpuLauncher

    bundle, original = gpu_models["b1"]
    model = _serve(bundle, tmp_path)
    assert isinstance(model.runner, GpuLauncher) and model.runner._exec is not None  # replays a captured graph
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal((1, 8, 12, 12)).astype(np.float32) for _ in range(2)]
    requests = [pb_utils.InferenceRequest([pb_utils.Tensor.on_device("input", torch.from_numpy(x).cuda())]) for x in xs]
    responses = model.execute(requests)
    outs = []
    for x, r in zip(xs, responses):
        assert not r.has_error(), r.error().message()
        (t,) = r.output_tensors()
        assert t.name() == "output" and not t.is_cpu()
        data = t.data()
        assert data.is_cuda and tuple(data.shape) == (1, 24, 12, 12)
        # its own memory, not the launcher's output buffer that the next replay overwrites
        assert data.data_ptr() != model.runner.addr["output"]
        outs.append(data)
    for x, data in zip(xs, outs):  # both still right after the second replay
        assert _rel(data.cpu().numpy(), ort_reference(original, {"input": x})["output"]) <= TOL
    model.finalize()


def test_host_inputs_give_host_outputs(gpu_models, tmp_path, pb_utils):
    bundle, original = gpu_models["b1"]
    model = _serve(bundle, tmp_path)
    x = np.random.default_rng(2).standard_normal((1, 8, 12, 12)).astype(np.float32)
    (r,) = model.execute([pb_utils.InferenceRequest([pb_utils.Tensor("input", x)])])
    assert not r.has_error(), r.error().message()
    (t,) = r.output_tensors()
    assert t.is_cpu()
    assert _rel(t.as_numpy(), ort_reference(original, {"input": x})["output"]) <= TOL
    model.finalize()


def test_dynamic_batch_on_the_device(gpu_models, tmp_path, pb_utils):
    import torch

    bundle, original = gpu_models["b4"]
    model = _serve(bundle, tmp_path, max_batch=4)
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal((n, 8, 12, 12)).astype(np.float32) for n in (1, 2, 1)]
    requests = [pb_utils.InferenceRequest([pb_utils.Tensor.on_device("input", torch.from_numpy(x).cuda())]) for x in xs]
    responses = model.execute(requests)
    batch = np.concatenate(xs)
    ref = ort_reference(original, {"input": batch})["output"]
    lo = 0
    for x, r in zip(xs, responses):
        assert not r.has_error(), r.error().message()
        (t,) = r.output_tensors()
        assert not t.is_cpu() and tuple(t.data().shape) == (len(x), 24, 12, 12)
        assert _rel(t.data().cpu().numpy(), ref[lo:lo + len(x)]) <= TOL
        lo += len(x)
    model.finalize()


def test_a_bucketed_bundle_on_the_device(tmp_path, pb_utils):
    """--batch 1:2:4 torch bundle behind a GPU instance: each group of requests runs on the smallest bucket
    that holds its rows (unpadded), device outputs of each request's own rows."""
    import torch

    from parastream.launcher.buckets import BucketedLauncher
    from parastream.pipeline import build

    original = three_branch_model(seed=2, channels=8, size=12, batch="N")
    original.ir_version = 8
    onnx.save(original, tmp_path / "dyn.onnx")
    bundle = build(tmp_path / "dyn.onnx", tmp_path / "bundle", backend="torch", batch=(1, 2, 4), streams=3,
                   search=False, measure=False, compile=False)
    model = _serve(bundle, tmp_path)
    assert isinstance(model.runner, BucketedLauncher) and model.runner.shared is not None
    rng = np.random.default_rng(4)
    xs = [rng.standard_normal((n, 8, 12, 12)).astype(np.float32) for n in (1, 2, 3)]
    requests = [pb_utils.InferenceRequest([pb_utils.Tensor.on_device("input", torch.from_numpy(x).cuda())]) for x in xs]
    responses = model.execute(requests)
    for x, r in zip(xs, responses):
        assert not r.has_error(), r.error().message()
        (t,) = r.output_tensors()
        assert not t.is_cpu() and tuple(t.data().shape) == (len(x), 24, 12, 12)
        assert _rel(t.data().cpu().numpy(), ort_reference(original, {"input": x})["output"]) <= TOL
    model.finalize()


def test_an_instance_on_gpu_1_serves_from_gpu_1(gpu_models, tmp_path, pb_utils):
    """An instance Triton places on GPU 1 (model_instance_device_id 1, from instance_group gpus [0, 1]) loads the
    bundle there: its launcher's memory, streams and engines on GPU 1; an input in GPU 0's memory is copied to
    GPU 1 once, before the replay; outputs leave in GPU 1's memory."""
    import torch

    from parastream.launcher import cuda

    if cuda.device_count() < 2:
        pytest.skip(f"needs two CUDA GPUs; cuda-python sees {cuda.device_count()}")
    bundle, original = gpu_models["b1"]
    model_dir = export_triton(bundle, tmp_path / "repo", name="m", gpus=[0, 1])
    assert list(read_config(model_dir / "config.pbtxt").instance_group[0].gpus) == [0, 1]
    model = load_model_py(model_dir).TritonPythonModel()
    try:
        model.initialize(initialize_args(model_dir, kind="GPU", device_id=1))
        assert model.on_gpu and model.runner.device == 1
        devices = model.runner.devices()
        assert devices["arena"] == 1 and devices["origin"] == 1 and set(devices["streams"]) <= {1}
        assert all(e == [1] for e in devices["engines"] if e is not None)
        rng = np.random.default_rng(5)
        xs = [rng.standard_normal((1, 8, 12, 12)).astype(np.float32) for _ in range(2)]
        requests = [pb_utils.InferenceRequest([pb_utils.Tensor.on_device("input", torch.from_numpy(x).to(f"cuda:{g}"))])
                    for g, x in zip((0, 1), xs)]
        for x, r in zip(xs, model.execute(requests)):
            assert not r.has_error(), r.error().message()
            (t,) = r.output_tensors()
            assert t.data().device == torch.device("cuda", 1)
            assert _rel(t.data().cpu().numpy(), ort_reference(original, {"input": x})["output"]) <= TOL
    finally:
        model.finalize()
        torch.cuda.set_device(0)
