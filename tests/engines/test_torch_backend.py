"""The torch backend: ONNX -> torch conversion against ONNX Runtime (CPU, unmarked) and on the GPU (marked gpu)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

torch = pytest.importorskip("torch")

from parastream.launcher.engines import BuildOptions  # noqa: E402
from parastream.launcher.engines import torch as torch_backend  # noqa: E402
from parastream.launcher.engines.onnx_torch import UnsupportedOp, convert, supported_ops, to_fx  # noqa: E402
from parastream.launcher.plan import TensorSpec  # noqa: E402

from onnx_cases import attention_layer, feeds_for, inception_block, misc_ops, sequence_ops  # noqa: E402

CASES = {"inception_block": inception_block, "attention_layer": attention_layer, "misc_ops": misc_ops,
         "sequence_ops": sequence_ops}


def ort_run(model: onnx.ModelProto, feeds: dict) -> dict:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds)))


def rel_err(out: np.ndarray, ref: np.ndarray) -> float:
    out, ref = out.astype(np.float64), ref.astype(np.float64)
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def specs(model: onnx.ModelProto):
    vals = {v.name: v for v in list(model.graph.input) + list(model.graph.output) + list(model.graph.value_info)}

    def spec(name):
        tt = vals[name].type.tensor_type
        return TensorSpec(name, np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type)).name, [d.dim_value for d in tt.shape.dim])

    return [spec(i.name) for i in model.graph.input], [spec(o.name) for o in model.graph.output]


@pytest.mark.parametrize("case", sorted(CASES))
def test_convert_matches_onnxruntime_fp32(case):
    model = CASES[case]()
    feeds = feeds_for(model)
    ref = ort_run(model, feeds)
    module = convert(model)
    with torch.no_grad():
        outs = module(*[torch.from_numpy(feeds[n]) for n in module.input_names])
    for (name, _, _), out in zip(module.output_specs, outs):
        assert out.shape == ref[name].shape
        assert rel_err(out.numpy(), ref[name]) <= 1e-5, name


@pytest.mark.parametrize("case", sorted(CASES))
def test_module_is_fx_traceable(case):
    model = CASES[case]()
    module = convert(model)
    gm = to_fx(module)
    ops = {n.op for n in gm.graph.nodes}
    assert ops <= {"placeholder", "get_attr", "call_function", "call_method", "output"}
    feeds = feeds_for(model, seed=3)
    args = [torch.from_numpy(feeds[n]) for n in module.input_names]
    with torch.no_grad():
        for a, b in zip(module(*args), gm(*args)):
            assert torch.equal(a, b)


def test_shape_arithmetic_is_folded_at_conversion():
    """Shape -> Gather -> Unsqueeze -> Concat -> Reshape chains leave no step behind: only tensor work runs."""
    module = convert(attention_layer())
    kinds = {s.node for s in module._steps}
    for folded in ("shape", "g_b", "g_s", "u_b", "u_s", "cat_shape"):
        assert folded not in kinds


def test_engine_run_on_cpu_through_the_backend_contract():
    model = inception_block(seed=5)
    ins, outs = specs(model)
    builder = torch_backend.Builder(BuildOptions(precision="fp16", compile=False))
    data = builder.build(model, "branch_000")
    assert builder.report()["branch_000"]["nodes"] == len(model.graph.node)
    engine = torch_backend.load(data, ins, outs, device="cpu", options=BuildOptions(precision="fp16"))
    feeds = feeds_for(model, seed=7)
    got = engine.run(feeds)
    ref = ort_run(model, feeds)
    for t in outs:
        assert got[t.name].dtype == np.float32
        assert rel_err(got[t.name], ref[t.name]) <= 1e-5


def test_unsupported_op_fails_at_build_naming_the_node():
    node = helper.make_node("Det", ["x"], ["y"], name="the_det_node")
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 3])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(UnsupportedOp, match="the_det_node"):
        torch_backend.Builder(BuildOptions()).build(model, "branch_000")


def test_custom_domain_fails_naming_the_node():
    node = helper.make_node("Fancy", ["x"], ["y"], name="fancy1", domain="com.example")
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1)])
    with pytest.raises(UnsupportedOp, match="fancy1"):
        convert(model)


def test_supported_ops_cover_the_zoo_and_exports():
    needed = {"Conv", "Gemm", "MatMul", "Add", "Sub", "Mul", "Div", "Relu", "Sigmoid", "Tanh", "Erf", "Gelu",
              "BatchNormalization", "MaxPool", "AveragePool", "GlobalAveragePool", "Concat", "Split", "Reshape",
              "Transpose", "Flatten", "Softmax", "LayerNormalization", "Shape", "Gather", "Unsqueeze", "Constant",
              "Where", "Cast", "Pow", "Sqrt", "ReduceMean", "Slice", "Expand", "Pad", "Identity"}
    assert needed <= set(supported_ops())


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
def test_torch_export_roundtrip_cpu(tmp_path):
    """A small conv + attention torch module, exported by torch.onnx, converts back and matches."""

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
            self.bn = torch.nn.BatchNorm2d(8)
            self.attn = torch.nn.MultiheadAttention(8, 2, batch_first=True)
            self.ln = torch.nn.LayerNorm(8)

        def forward(self, x):
            h = torch.relu(self.bn(self.conv(x)))
            seq = h.flatten(2).transpose(1, 2)
            a, _ = self.attn(seq, seq, seq, need_weights=False)
            return torch.nn.functional.gelu(self.ln(a + seq)).mean(dim=1)

    net = Net().eval()
    x = torch.randn(1, 3, 6, 6)
    path = tmp_path / "net.onnx"
    try:
        torch.onnx.export(net, (x,), str(path), opset_version=17, dynamo=False, input_names=["x"], output_names=["y"])
    except Exception as e:  # noqa: BLE001 - exporter availability differs between torch builds
        pytest.skip(f"torch.onnx.export unavailable here: {e}")
    model = onnx.shape_inference.infer_shapes(onnx.load(str(path)), data_prop=True)
    feeds = {"x": x.numpy()}
    ref = ort_run(model, feeds)["y"]
    module = convert(model)
    with torch.no_grad():
        out = module(torch.from_numpy(feeds["x"]))[0].numpy()
    assert rel_err(out, ref) <= 1e-5


# -- GPU ----------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("precision,tol", [("fp32", 1e-3), ("fp16", 1e-2)])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("compiled", [False, True])
def test_engine_enqueue_on_gpu_matches_onnxruntime(case, precision, tol, compiled):
    """enqueue() on an external stream writes the outputs into launcher-owned memory."""
    from parastream.launcher import cuda

    model = CASES[case]()
    ins, outs = specs(model)
    opts = BuildOptions(precision=precision, compile=compiled)
    data = torch_backend.Builder(opts).build(model, "b")
    engine = torch_backend.load(data, ins, outs, device="cuda", options=opts)
    feeds = feeds_for(model, seed=11)
    ref = ort_run(model, feeds)
    stream = cuda.stream_create()
    addrs, bufs = {}, {}
    for t in ins + outs:
        bufs[t.name] = torch.empty(t.shape, dtype=getattr(torch, t.dtype), device="cuda")
        addrs[t.name] = bufs[t.name].data_ptr()
    for t in ins:
        bufs[t.name].copy_(torch.from_numpy(feeds[t.name]))
    for t in outs:
        bufs[t.name].fill_(float("nan"))  # poison: every element must be written
    torch.cuda.synchronize()
    engine.enqueue(cuda.handle(stream), addrs)
    cuda.stream_synchronize(stream)
    for t in outs:
        got = bufs[t.name].cpu().numpy()
        assert not np.isnan(got).any()
        assert rel_err(got, ref[t.name]) <= tol, (t.name, rel_err(got, ref[t.name]))
    cuda.stream_destroy(stream)


@pytest.mark.gpu
@pytest.mark.parametrize("precision,tol", [("fp32", 1e-3), ("fp16", 1e-2)])
def test_recurrent_layers_replay_in_a_captured_graph(tmp_path, precision, tol):
    """sequence_ops' LSTM and GRU run as torch's own layers (cuDNN's recurrent kernels, ``recurrent_op``) in a
    bundle's engines, captured into the launcher's CUDA Graph and replayed on fresh inputs against onnxruntime."""
    from handmade_bundles import make_bundle

    from parastream.launcher.gpu import GpuLauncher

    model = sequence_ops()
    path = tmp_path / "sequence_ops.onnx"
    onnx.save(model, str(path))
    bundle = make_bundle(path, tmp_path / "bundle", backend="torch", streams=2, precision=precision)
    with GpuLauncher(bundle, graph=True) as la:
        for seed in (1, 2):
            feeds = feeds_for(model, seed=seed)
            ref = ort_run(model, feeds)
            got = la(feeds)
            for name in ref:
                assert rel_err(got[name], ref[name]) <= tol, (name, rel_err(got[name], ref[name]))
