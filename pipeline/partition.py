"""Turn a Schedule into a Plan and cut the model into one self-contained ONNX model per branch.

A branch is exported the graphsurgeon way: a copy of the graph gets the branch's
boundary tensors as its inputs and outputs, and ``cleanup()`` drops every node
outside it (onnx-graphsurgeon's public API, rather than a hand-written extractor).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from parastream.launcher.errors import ParastreamError
from parastream.launcher.plan import Branch, Plan, TensorSpec

from parastream.rewrite.ir import copy_graph, hold_large_weights, put_back, weights_aside

from parastream.core.schedule import Schedule


def spec_of(t: gs.Variable) -> TensorSpec:
    """``t``'s TensorSpec: its name, numpy dtype and static shape."""
    if t.dtype is None or t.shape is None or any(not isinstance(d, int) for d in t.shape):
        raise ParastreamError(f"tensor {t.name!r} has no static shape or dtype after shape inference (the loader gives every tensor one; a rewrite lost it)")
    dt = t.dtype
    if isinstance(dt, int):  # graphsurgeon keeps ONNX enum values for types numpy lacks
        dt = onnx.helper.tensor_dtype_to_np_dtype(dt)
    dtype = np.dtype(dt)
    return TensorSpec(name=t.name, dtype=dtype.name, shape=[int(d) for d in t.shape])


def _concat_axis(nodes: list[gs.Node]) -> int | None:
    """The axis of a branch that is exactly one Concat of 4-d tensors (a join the GPU launcher can do in place)."""
    if len(nodes) != 1 or nodes[0].op != "Concat":
        return None
    out = nodes[0].outputs[0]
    if out.shape is None or len(out.shape) != 4:
        return None
    axis = int(nodes[0].attrs.get("axis", 0))
    return axis + 4 if axis < 0 else axis


def make_plan(graph: gs.Graph, sched: Schedule, *, backend: str, precision: str, suffix: str,
              inputs: list[TensorSpec], outputs: list[TensorSpec], flops_bytes=None) -> Plan:
    by_name = {n.name: n for n in graph.nodes}
    graph_outputs = {t.name for t in graph.outputs}
    model_inputs = {t.name for t in inputs}
    tensors: dict[str, TensorSpec] = {t.name: t for t in inputs}
    tensors.update({t.name: t for t in outputs})
    branches: list[Branch] = []
    producer_branch: dict[str, int] = {}
    for b, members in enumerate(sched.branches):
        for name in members:
            for t in by_name[name].outputs:
                producer_branch[t.name] = b
    for b, members in enumerate(sched.branches):
        member_set = set(members)
        b_inputs: list[str] = []
        b_outputs: list[str] = []
        for name in members:
            node = by_name[name]
            for t in node.inputs:
                if not isinstance(t, gs.Variable) or not t.name:
                    continue
                inside = any(p.name in member_set for p in t.inputs)
                if not inside and t.name not in b_inputs:
                    b_inputs.append(t.name)
                    tensors.setdefault(t.name, spec_of(t))
            for t in node.outputs:
                consumed_outside = any(c.name not in member_set for c in t.outputs)
                if (consumed_outside or t.name in graph_outputs) and t.name not in b_outputs:
                    b_outputs.append(t.name)
                    tensors.setdefault(t.name, spec_of(t))
        stream = sched.branch_stream[b]
        waits = sorted({producer_branch[t] for t in b_inputs
                        if t not in model_inputs and sched.branch_stream[producer_branch[t]] != stream})
        flops = byts = 0.0
        if flops_bytes is not None:
            for name in members:
                f, by = flops_bytes(by_name[name])
                flops, byts = flops + f, byts + by
        branches.append(Branch(
            id=b, name=f"branch_{b:03d}", stream=stream, nodes=list(members), inputs=b_inputs,
            outputs=b_outputs, waits=waits, engine=f"engines/branch_{b:03d}{suffix}",
            bound=sched.branch_bound[b], est_time=sched.branch_time[b], flops=flops, bytes=byts,
            concat_axis=_concat_axis([by_name[n] for n in members]),
        ))
    plan = Plan(backend=backend, precision=precision, num_streams=sched.num_streams, inputs=inputs,
                outputs=outputs, tensors=tensors, branches=branches, launch_order=list(sched.launch_order))
    plan.validate()
    return plan


def extract_branch(model: onnx.ModelProto, graph: gs.Graph, branch: Branch) -> onnx.ModelProto:
    """The branch as a self-contained ONNX model: its boundary tensors become graph inputs/outputs.  A branch that
    is the whole model (a one-session plan) is ``model`` itself: no copy of its weights through graphsurgeon."""
    if (len(branch.nodes) == len(model.graph.node) and set(branch.nodes) == {n.name for n in model.graph.node}
            and list(branch.outputs) == [o.name for o in model.graph.output]
            and list(branch.inputs) == [i.name for i in model.graph.input if i.name not in {t.name for t in model.graph.initializer}]):
        aside = weights_aside(model)
        if not aside:
            return model
        # a search's candidate exported without its weights' bytes (``ir.export_model_aside``): a copy with them,
        # from the arrays of its graph that they were left out for
        out = onnx.ModelProto()
        out.CopyFrom(model)
        return put_back(out, {name: np.asarray(t.values) for name, t in graph.tensors().items()
                              if name in aside and isinstance(t, gs.Constant)})
    # a copy of the branch's own nodes (copying the whole graph for each of dozens of branches was most of
    # the time a CPU build spent building the plans it times)
    members = set(branch.nodes)
    part = gs.Graph(nodes=[n for n in graph.nodes if n.name in members], opset=graph.opset,
                    import_domains=graph.import_domains, functions=graph.functions, ir_version=graph.ir_version,
                    name=graph.name)
    sub = copy_graph(part)
    tmap = sub.tensors()
    sub.inputs = [tmap[t] for t in branch.inputs]
    sub.outputs = [tmap[t] for t in branch.outputs]
    sub.cleanup(remove_unused_graph_inputs=False)
    names = {n.name for n in sub.nodes}
    if names != set(branch.nodes):
        extra, missing = sorted(names - set(branch.nodes)), sorted(set(branch.nodes) - names)
        raise RuntimeError(f"{branch.name}: extracted nodes differ from the plan (extra {extra[:3]}, missing {missing[:3]})")
    sub.name = f"{graph.name or 'model'}_{branch.name}"
    # the weights held out of the export and written once into the result: exported, each one's bytes were
    # copied into a TensorProto and again by ``make_graph`` (extracting 21 BERT-base candidates' branches on the
    # 2-core CPU: 19.0 s before, 11.1 s held; a GPU build extracts every candidate it measures)
    held = hold_large_weights(sub)
    out = put_back(gs.export_onnx(sub), held)
    out.ir_version = model.ir_version
    del out.opset_import[:]
    out.opset_import.extend(model.opset_import)
    return out


def side_by_side(branches: list[onnx.ModelProto], outputs: set[str] | None = None) -> onnx.ModelProto:
    """Branches extracted from one plan (``extract_branch``) as one model: their nodes, weights and boundary
    tensors together, in the order given (a branch after those whose outputs it reads).  A tensor one branch
    writes and another reads joins them; every branch's outputs are the model's, or those of ``outputs`` only
    (the others then join branches inside the model alone: internal boundaries of its plan).  What a round times
    a sample of a plan's engines with, one launcher for all of them (``measure.depthwise_sample``,
    ``measure.layout_sample``).

    Not ``onnx.compose.merge_models``: it joins two models through an explicit output-to-input map and refuses
    names both hold, where branches of one plan share their inputs and weights by name (one tensor each)."""
    first = branches[0]
    out = onnx.ModelProto()
    out.ir_version = first.ir_version
    out.opset_import.extend(first.opset_import)
    g = out.graph
    g.name = "side_by_side"
    produced = {o for b in branches for n in b.graph.node for o in n.output}
    seen: dict[str, set[str]] = {"input": set(), "initializer": set(), "value_info": set(), "output": set()}

    def once(field: str, name: str) -> bool:
        if name in seen[field]:
            return False
        seen[field].add(name)
        return True

    for b in branches:
        g.input.extend(v for v in b.graph.input if v.name not in produced and once("input", v.name))
        g.initializer.extend(t for t in b.graph.initializer if once("initializer", t.name))
        g.node.extend(b.graph.node)
        g.value_info.extend(v for v in b.graph.value_info if once("value_info", v.name))
        g.output.extend(v for v in b.graph.output if (outputs is None or v.name in outputs) and once("output", v.name))
        # an output not kept keeps its type and shape as an inner tensor's
        g.value_info.extend(v for v in b.graph.output if outputs is not None and v.name not in outputs
                            and once("value_info", v.name))
    return out
