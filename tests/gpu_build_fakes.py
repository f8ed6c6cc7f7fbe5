"""Stand-ins for a GPU build's timing, shared by the tests of the build's timed alternatives (tests/pipeline) and
of the torch backend's compiled packages (tests/engines): a backend's flags without engines, GpuLauncher and
``pipeline.bench.measure`` faked to give each launcher a chosen time, and the plan the build makes for a model."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs


def gpu_backend(**kw):
    """A stand-in for torch's backend module: its name, suffix and capability flags (no engines are built)."""
    import types

    flags = dict(gpu=True, name="torch", suffix=".onnx", compiles_for_layout=False, builds_side_by_side=False,
                 background_compiles=False, fuses_conv_relu=True, lowers_convolutions=True, supports_internal_nhwc=True,
                 supports_channel_views=True, warms_after_load=True, compiles_repeats_once=False)
    return types.SimpleNamespace(**dict(flags, **kw))


def fake_gpu(monkeypatch, times: dict):
    """GpuLauncher and pipeline.bench.measure stand-ins: each launcher is timed at ``times[its options]``."""
    import importlib
    import types

    import parastream.launcher as launcher_pkg
    import parastream.launcher.gpu as gpu_mod
    import parastream.pipeline.bench as bench_mod

    build_mod = importlib.import_module("parastream.pipeline.build")
    made = []

    def launcher(bundle, fuse_conv_relu=None, internal_nhwc=None, single_stream=False, engines=None, device=0):
        # a scratch bundle (an alternative compiled for its own layout) is built in a parastream-measure- folder;
        # a launcher of another's engines on one stream is timed as ("serial", None, None)
        scratch = bundle == "scratch" or "parastream-measure-" in str(getattr(bundle, "path", ""))
        kind = ("serial", None, None) if single_stream else ("scratch" if scratch else "bundle", fuse_conv_relu, internal_nhwc)
        la = types.SimpleNamespace(kind=kind, bundle=bundle, engines=engines, device=device, nhwc={"t"}, closed=False)
        la.close = lambda: setattr(la, "closed", True)
        made.append(la)
        return la

    monkeypatch.setattr(launcher_pkg, "cuda_device_count", lambda: 1)
    monkeypatch.setattr(build_mod, "_write_engines", lambda *a, **k: None)
    monkeypatch.setattr(gpu_mod, "GpuLauncher", launcher)
    monkeypatch.setattr(bench_mod, "measure", lambda launchers, runs, warmup, lock=True, **kw: {
        k: np.array([times[la.kind]]) for k, la in launchers.items()})
    return build_mod, made


def plan_of(model_path, streams):
    from parastream.pipeline.build import plan_streams
    from parastream.pipeline.model_io import graph_of as _graph_of
    from parastream.pipeline.model_io import load_model
    from parastream.pipeline.partition import make_plan
    from parastream.rewrite.cost import RooflineCostModel
    from parastream.rewrite.rules.fold_bn_and_affine import FoldBatchNormAndAffine

    loaded = load_model(model_path)
    graph = _graph_of(loaded.model)
    rule = FoldBatchNormAndAffine()
    while sites := [st for st in rule.match(graph) if rule.check(graph, st) is None]:
        graph = rule.apply(graph, sites[0])  # BatchNorms folded into their Convs, as the search does
    model = gs.export_onnx(graph)
    graph = _graph_of(model)
    cm = RooflineCostModel()
    sched, _ = plan_streams(graph, cm, streams, streams)
    plan = make_plan(graph, sched, backend="torch", precision="fp16", suffix=".onnx", inputs=loaded.inputs, outputs=loaded.outputs)
    return model, graph, plan, cm
