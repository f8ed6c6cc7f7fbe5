"""Bundles made by hand for the launcher tests and the GPU benchmark, from the pipeline's own pieces
(load_model, schedule_graph, make_plan, extract_branch) with a small roofline cost of our own, so the
launcher can be tested whatever state the rewrite search and the cost model are in."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import onnx

from parastream.launcher.bundle import Bundle, write_manifest
from parastream.launcher.engines import BuildOptions, get_backend

PEAK_FLOPS = 300e12  # H100 fp16 dense, roughly what cuDNN reaches on mid-size convolutions
PEAK_BYTES = 2.5e12
LAUNCH_S = 3e-6


def _numel(t) -> int:
    shape = getattr(t, "shape", None)
    if not shape or any(not isinstance(d, int) for d in shape):
        return 0
    return int(np.prod(shape, dtype=np.int64))


def node_flops_bytes(node) -> tuple[float, float]:
    out = node.outputs[0] if node.outputs else None
    byts = 2.0 * (sum(_numel(t) for t in node.inputs) + sum(_numel(t) for t in node.outputs))
    flops = 0.0
    if node.op == "Conv" and out is not None and len(node.inputs) > 1:
        w = node.inputs[1].shape
        k = int(np.prod(w[1:], dtype=np.int64)) if w else 0
        flops = 2.0 * _numel(out) * k
    elif node.op in ("MatMul", "Gemm") and out is not None and len(node.inputs) > 1:
        a = node.inputs[0].shape
        kdim = a[-1] if a else 0
        if node.op == "Gemm" and node.attrs.get("transA", 0):
            kdim = a[0]
        flops = 2.0 * _numel(out) * (kdim if isinstance(kdim, int) else 0)
    return flops, byts


def node_cost(node) -> float:
    flops, byts = node_flops_bytes(node)
    return max(flops / PEAK_FLOPS, byts / PEAK_BYTES) + LAUNCH_S


def memory_bound(node) -> bool:
    flops, byts = node_flops_bytes(node)
    return flops / PEAK_FLOPS < byts / PEAK_BYTES


def make_bundle(model_path, out, *, backend: str = "torch", streams: int = 2, precision: str = "fp32",
                compile: bool = True, sync_cost: float = 2e-6, layouts: bool = False,
                options: dict | None = None) -> Bundle:
    """Partition ``model_path`` onto ``streams`` streams, build one engine per branch and write a bundle.

    ``layouts``: hand the builder each branch's tensors as the CPU launcher gives them (contiguous), so that a
    torch builder compiles its engines for them (the artifact ``options.torch_artifact`` names).  ``options``:
    further build options (``BuildOptions`` fields, e.g. ``inductor_format``), recorded in the manifest."""
    import onnx_graphsurgeon as gs

    from parastream.pipeline.model_io import load_model
    from parastream.pipeline.partition import extract_branch, make_plan
    from parastream.core.schedule import schedule_graph

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "engines").mkdir(exist_ok=True)
    t0 = time.perf_counter()
    loaded = load_model(model_path)
    model = loaded.model
    graph = gs.import_onnx(model)
    graph.toposort()
    sched = schedule_graph(graph, streams, node_cost, memory_bound, sync_cost=sync_cost)
    mod = get_backend(backend)
    plan = make_plan(graph, sched, backend=mod.name, precision=precision, suffix=mod.suffix,
                     inputs=loaded.inputs, outputs=loaded.outputs, flops_bytes=node_flops_bytes)
    builder = mod.Builder(BuildOptions(precision=precision, compile=compile, **(options or {})))
    for b in plan.branches:
        layout = {"inputs": [plan.tensors[t] for t in b.inputs], "outputs": [plan.tensors[t] for t in b.outputs]}
        (out / b.engine).write_bytes(builder.build(extract_branch(model, graph, b), b.name, *([layout] if layouts else [])))
    onnx.save(model, out / "model.onnx")
    plan.save(out / "plan.json")
    (out / "report.json").write_text(json.dumps({"version": 1, "engines": builder.report(),
                                                 "schedule": {"streams": plan.num_streams, "branches": len(plan.branches),
                                                              "critical_path_s": sched.makespan, "total_work_s": sched.total_work},
                                                 "timings": {"build_s": time.perf_counter() - t0}}, indent=2))
    write_manifest(out, {"backend": mod.name, "precision": precision, "options": {"compile": compile, **(options or {})}, "handmade": True})
    return Bundle.open(out)
