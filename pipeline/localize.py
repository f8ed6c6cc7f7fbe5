"""Localization: when a bundle does not match the original model, say where it parts from it.

Three computations can introduce an error, and each is compared with the one before it on the seeded inputs
verification draws (``verify.seeded_inputs``), by the project's one scaled-error check (``verify.scaled_error``):

1. **rewrite**: ONNX Runtime on the original model against ONNX Runtime on the bundle's model.onnx (the
   rewritten model).  Where their outputs differ (beyond the fp32 tolerance: rewrites are exact up to
   reassociation), every tensor the two models share by name is compared in the original's topological order
   and the first one that differs names the node where they part; then the rewrites report.json records
   (``search.rules_chosen``: rule and site, in the order applied) are replayed one by one with the rules of
   rewrite/rules and bisected, to name the first rule application whose result differs from the original.
   If every replayed prefix matches the original, no rewrite explains it (the models differ otherwise, e.g.
   in their weights).
2. **engine**: ONNX Runtime on model.onnx against the bundle, tensor by tensor at every branch boundary in
   launch order (the launchers hand back their boundary buffers); inside the first branch whose output leaves
   the criterion, that branch runs alone with every node's output exposed, on the boundary inputs the bundle
   computed, against ONNX Runtime on model.onnx's values of the same tensors: the first node whose output
   leaves the criterion is the culprit, reported with its branch, engine backend, precision and the error of
   every node before it (how the error grew).  The branch runs as its engine computes: an onnxruntime engine's
   own ONNX (its weights as shipped); a torch engine's graph converted by the torch backend's converter in its
   compute dtype (fp16 and bf16 run as such on the CPU too); a TensorRT branch's ONNX in ONNX Runtime (its
   layers are not exposed: the branch is named, the node only if the graph itself diverges).

A reduced-precision culprit comes with the ``--keep-fp32`` option that pins it.  Nothing is written into the
bundle.  All intermediate tensors of one model are exposed in one ONNX Runtime session while their estimated
size fits ``MEMORY_BUDGET``, else in several sessions over consecutive groups of tensors.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from parastream.core.fused_ops import plain_onnx
from parastream.launcher.errors import ParastreamError

from .verify import DEFAULT_SCALE_TOLERANCES, scaled_error, seeded_inputs

MEMORY_BUDGET = 4 << 30  # bytes of intermediate tensors one exposed-outputs session may return at once
GROWTH_SHOWN = 6  # nodes of the error growth shown on the terminal (JSON has every node)


@dataclass
class Localization:
    """Where a bundle parts from the original model (``status``: "no divergence", "rewrite" or "engine")."""

    status: str
    bundle: str
    model: str
    precision: str
    backend: str
    tolerance: float  # scaled-error bound of the engine stage (the bundle's); the rewrite stage uses fp32's
    rewrite_tolerance: float
    seed: int
    input_index: int | None = None  # which of the seeded inputs showed the divergence
    rewrite: dict = field(default_factory=dict)
    engine: dict = field(default_factory=dict)
    keep_fp32: str | None = None  # the --keep-fp32 option that pins the culprit (reduced precision only)
    seconds: float = 0.0

    def summary(self) -> str:
        """One line: where the bundle parts from the original (or that it does not)."""
        if self.status == "no divergence":
            return "no divergence: the rewritten model and the bundle match the original within the criterion"
        if self.status == "rewrite":
            r = self.rewrite
            where = f"first differing tensor {r['tensor']!r} (node {r['node']!r}, {r['op']})" if r.get("tensor") else "the outputs"
            cause = (f"rule {r['rule']} at {r['site']}" if r.get("rule") else r.get("explanation", "no rewrite explains it"))
            return f"the rewritten model differs from the original at {where}: {cause}"
        e = self.engine
        node = f"node {e['node']!r} ({e['op']})" if e.get("node") else e.get("explanation", "the engine")
        return (f"the bundle differs from onnxruntime on model.onnx in {e['branch']} ({e['backend']}, {e['precision']}): "
                f"{node}, scaled error {e.get('node_error', e.get('branch_error', float('nan'))):.3g}")

    def to_dict(self) -> dict:
        return {"status": self.status, "summary": self.summary(), "bundle": self.bundle, "model": self.model,
                "backend": self.backend, "precision": self.precision, "criterion": "scaled",
                "tolerance": self.tolerance, "rewrite_tolerance": self.rewrite_tolerance, "seed": self.seed,
                "input_index": self.input_index, "rewrite": self.rewrite, "engine": self.engine,
                "keep_fp32": self.keep_fp32, "seconds": self.seconds}


# -- running a model with its intermediate tensors exposed ---------------------------------------------------------
def _session(model: onnx.ModelProto, outputs: list[str]):
    """An ONNX Runtime session of ``model`` answering ``outputs`` (any of its tensors): polygraphy's
    ``mark_outputs`` on the graph, serialized, and the graph's own outputs put back."""
    import onnxruntime as ort
    from polygraphy.backend.onnx.util import mark_outputs

    from parastream.launcher.engines.onnxruntime import session_options

    kept = [onnx.ValueInfoProto.FromString(o.SerializeToString()) for o in model.graph.output]
    try:
        data = mark_outputs(model, outputs).SerializeToString()
    finally:
        del model.graph.output[:]
        model.graph.output.extend(kept)
    return ort.InferenceSession(data, session_options(), providers=["CPUExecutionProvider"])


def _nbytes(model: onnx.ModelProto) -> dict[str, int]:
    """Estimated bytes of each tensor with a static shape in ``model``'s value_info (unknown: 0)."""
    sizes = {}
    for vi in (*model.graph.value_info, *model.graph.output):
        tt = vi.type.tensor_type
        if tt.HasField("shape") and all(d.HasField("dim_value") for d in tt.shape.dim):
            n = int(np.prod([d.dim_value for d in tt.shape.dim], dtype=np.int64))
            sizes[vi.name] = n * onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type).itemsize if tt.elem_type else 0
    return sizes


def _groups(names: list[str], sizes: dict[str, int], budget: int) -> list[list[str]]:
    """``names`` cut, in order, into consecutive groups whose estimated bytes stay under ``budget``."""
    groups, cur, used = [], [], 0
    for n in names:
        b = sizes.get(n, 0)
        if cur and used + b > budget:
            groups.append(cur)
            cur, used = [], 0
        cur.append(n)
        used += b
    return groups + ([cur] if cur else [])


class Values:
    """``model``'s tensors on one feed, by name: one session per group of tensors asked for (at most ``budget``
    bytes each), made on first use and kept for the next feed."""

    def __init__(self, model: onnx.ModelProto, budget: int = MEMORY_BUDGET):
        self.model, self.budget = plain_onnx(model), budget  # ONNX Runtime runs parastream's GEMM epilogues as plain ops
        self._sizes: dict[str, int] | None = None
        self._sessions: dict[tuple, object] = {}

    def run(self, names: list[str], feeds: dict) -> dict[str, np.ndarray]:
        """All of ``names`` at once (the caller keeps them: keep the list short)."""
        key = tuple(names)
        sess = self._sessions.get(key)
        if sess is None:
            sess = self._sessions[key] = _session(self.model, list(names))
        want = {i.name for i in sess.get_inputs()}
        return dict(zip(names, sess.run(list(names), {k: v for k, v in feeds.items() if k in want})))

    def groups(self, names: list[str], feeds: dict):
        """(group of names, their values) for consecutive groups within the memory budget."""
        if self._sizes is None:
            self._sizes = _nbytes(self.model)
        for group in _groups(names, self._sizes, self.budget):
            yield group, self.run(group, feeds)


def _producers(model: onnx.ModelProto) -> dict[str, onnx.NodeProto]:
    return {o: n for n in model.graph.node for o in n.output if o}


# -- stage 1: the rewrites ---------------------------------------------------------------------------------------
def applied_rewrites(report: dict) -> list[str]:
    """The rewrites model.onnx holds, as report.json records them ("rule:site" keys in the order applied): the
    search's chosen rewrites, unless the CPU build kept the original model."""
    search = report.get("search") or {}
    chosen = str((report.get("cpu_choice") or {}).get("chosen") or "")
    if chosen.startswith("original model"):
        return []
    return list(search.get("rules_chosen") or [])


def replay(model: onnx.ModelProto, keys: list[str]) -> onnx.ModelProto:
    """``model`` with the rewrites ``keys`` applied in order, each found again by its site key with the rules of
    rewrite/rules.  Raises ParastreamError naming the first key whose rule or site is not there."""
    from parastream.rewrite.ir import export_model, import_graph
    from parastream.rewrite.rules import RULES_BY_NAME

    graph = import_graph(model)
    for key in keys:
        rule = RULES_BY_NAME.get(key.split(":", 1)[0])
        if rule is None:
            raise ParastreamError(f"report.json: rewrite {key!r} names no rule of this parastream")
        site = next((s for s in rule.match(graph) if s.key == key), None)
        if site is None:
            raise ParastreamError(f"report.json: rewrite {key!r} matches no site of the graph as replayed")
        graph = rule.apply(graph, site)
    return export_model(graph, model, check=False)


def _outputs_differ(a: dict, b: dict) -> float:
    """The largest scaled error over the outputs ``a`` and ``b`` share (0 when none)."""
    return max((scaled_error(a[k], b[k]) for k in a if k in b), default=0.0)


def bisect_rewrites(model: onnx.ModelProto, keys: list[str], feeds: dict, ref: dict, tol: float) -> dict:
    """The first rewrite of ``keys`` after which ONNX Runtime's outputs differ from ``ref`` (the original's), by
    bisection over prefixes replayed from ``model``: {"rule", "site", "index", "error", "replayed"} or, when the
    whole sequence replayed matches, {"explanation": ...}."""
    outs = [o.name for o in model.graph.output]

    def error(k: int) -> float:
        return _outputs_differ(Values(replay(model, keys[:k])).run(outs, feeds), ref)

    try:
        full = error(len(keys))
    except ParastreamError as e:
        return {"explanation": f"the rewrites cannot be replayed: {e}", "replayed": False}
    if full <= tol:
        return {"explanation": f"no rewrite explains it: the {len(keys)} recorded rewrites, replayed, match the original "
                               "(the models differ otherwise, e.g. in their weights)", "replayed": True, "error": full}
    lo, hi, errors = 0, len(keys), {len(keys): full}  # prefix lo matches (the original itself), prefix hi does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        errors[mid] = error(mid)
        if errors[mid] <= tol:
            lo = mid
        else:
            hi = mid
    key = keys[hi - 1]
    rule, _, site = key.partition(":")
    return {"rule": rule, "site": site, "key": key, "index": hi - 1, "error": errors[hi], "replayed": True,
            "rewrites": len(keys)}


def first_shared_divergence(original: onnx.ModelProto, rewritten: onnx.ModelProto, feeds: dict, tol: float,
                            budget: int = MEMORY_BUDGET) -> dict | None:
    """The first tensor (in ``original``'s topological order) that both models compute under the same name and
    that differs beyond ``tol``: {"tensor", "node", "op", "rewritten_node", "rewritten_op", "error", "compared"}."""
    ours = _producers(rewritten)
    names = [o for n in original.graph.node for o in n.output if o and o in ours]
    mine = _producers(original)
    a, b = Values(original, budget // 2), Values(rewritten, budget // 2)
    sizes = _nbytes(original)
    compared = 0
    for group in _groups(names, sizes, budget // 2):
        va, vb = a.run(group, feeds), b.run(group, feeds)
        for name in group:
            err = scaled_error(vb[name], va[name])
            compared += 1
            if err > tol:
                p, q = mine[name], ours[name]
                return {"tensor": name, "node": p.name, "op": p.op_type, "rewritten_node": q.name,
                        "rewritten_op": q.op_type, "error": err, "compared": compared}
    return None


# -- stage 2: the engines -------------------------------------------------------------------------------------
def _branch_graph(bundle, branch, model: onnx.ModelProto) -> tuple[onnx.ModelProto, str]:
    """The branch as its engine computes it, as ONNX, and how it runs here ("onnxruntime" or a torch dtype)."""
    backend = bundle.plan.backend
    if backend == "onnxruntime":
        from parastream.launcher.engines.onnxruntime import branch_model

        return branch_model(bundle.engine_bytes(branch), bundle.initializer), "onnxruntime"
    if backend == "torch":
        from parastream.launcher.engines.torch import EngineFile, compute_dtype

        engine = EngineFile(bundle.engine_bytes(branch))
        on = "cuda" if str(bundle.manifest.get("device", "")).startswith("cuda") else "cpu"
        dtype = "float32" if engine.meta.get("dtype") == "float32" else compute_dtype(bundle.plan.precision, on)
        return engine.branch_model(bundle.initializer), dtype
    from .model_io import graph_of
    from .partition import extract_branch

    return extract_branch(model, graph_of(model), branch), "onnxruntime"


def _run_branch_exposed(graph: onnx.ModelProto, how: str, feeds: dict) -> tuple[list[onnx.NodeProto], dict]:
    """(the branch's nodes in order, every node output's value) with the branch run alone on ``feeds``."""
    names = [o for n in graph.graph.node for o in n.output if o]
    ins = {i.name for i in graph.graph.input}
    feeds = {k: v for k, v in feeds.items() if k in ins}
    if how == "onnxruntime":
        return list(graph.graph.node), Values(graph).run(names, feeds)
    import torch

    from parastream.launcher.engines.onnx_torch import convert

    exposed = onnx.ModelProto.FromString(graph.SerializeToString())
    seen = {o.name for o in exposed.graph.output}
    exposed.graph.output.extend(onnx.helper.make_empty_tensor_value_info(n) for n in names if n not in seen)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    module = convert(exposed, how).to(device)
    dt = getattr(torch, how)
    args = [torch.from_numpy(np.ascontiguousarray(feeds[n])).to(device) for n in module.input_names]
    args = [x.to(dt) if x.is_floating_point() else x for x in args]
    with torch.no_grad():
        ys = module(*args)
    values = {}
    for (name, _, _), y in zip(module.output_specs, ys):
        y = y.detach().cpu()
        values[name] = (y.float() if y.is_floating_point() else y).numpy()
    return list(graph.graph.node), values


def localize_branch(graph: onnx.ModelProto, how: str, feeds: dict, reference: dict, tol: float) -> dict:
    """Run one branch alone with every node's output exposed (``how``: "onnxruntime" or a torch dtype) on
    ``feeds`` and compare each node output with ``reference`` (same names): {"node", "op", "tensor",
    "node_error", "growth": [{"node", "op", "tensor", "error"}, ...]} up to the first node beyond ``tol``."""
    nodes, values = _run_branch_exposed(graph, how, feeds)
    growth = []
    for node in nodes:
        errs = [(o, scaled_error(values[o], reference[o])) for o in node.output if o and o in values and o in reference]
        if not errs:
            continue
        tensor, err = max(errs, key=lambda e: e[1])
        growth.append({"node": node.name, "op": node.op_type, "tensor": tensor, "error": err})
        if err > tol:
            return {"node": node.name, "op": node.op_type, "tensor": tensor, "node_error": err, "growth": growth}
    return {"growth": growth}


def first_diverging_branch(order: list, theirs: dict, mod: dict, tol: float):
    """The first branch in launch order with an output beyond ``tol`` of ONNX Runtime's value (``mod``), as
    (branch, (worst tensor, its error), [(tensor, error) of each output]), or None."""
    for b in order:
        errs = [(t, scaled_error(theirs[t], mod[t])) for t in b.outputs if t in theirs and t in mod]
        worst = max(errs, key=lambda e: e[1], default=None)
        if worst is not None and worst[1] > tol:
            return b, worst, errs
    return None


def _rewrite_stage(start: onnx.ModelProto, model: onnx.ModelProto, report: dict, feeds: dict, ref: dict,
                   output_error: float, tol: float, budget: int) -> dict:
    """Stage 1 once the outputs differ: the first shared tensor that differs, then the rewrite that explains it."""
    found = {"output_error": output_error}
    found.update(first_shared_divergence(start, model, feeds, tol, budget) or {})
    found.update(bisect_rewrites(start, applied_rewrites(report), feeds, ref, tol))
    return found


def _engine_stage(bundle, model: onnx.ModelProto, rewritten: Values, order: list, first, theirs: dict, mod: dict,
                  feeds: dict, tol: float) -> dict:
    """Stage 2 once a branch's output differs: that branch run alone, node by node, on the bundle's inputs."""
    branch, (tensor, err), errs = first
    at = order.index(branch)
    found = {"branch": branch.name, "branch_index": at, "backend": bundle.plan.backend,
             "precision": bundle.plan.precision, "boundary_tensor": tensor, "branch_error": err,
             "boundaries_compared": sum(len(b.outputs) for b in order[:at]) + len(errs),
             "inputs_error": max((scaled_error(theirs[t], mod[t]) for t in branch.inputs if t in theirs and t in mod),
                                 default=0.0)}
    graph, how = _branch_graph(bundle, branch, model)
    found["runs_as"] = how
    found["branch_nodes"] = [n.name for n in graph.graph.node]
    produced = _producers(model)
    names = [o for n in graph.graph.node for o in n.output if o in produced]
    found.update(localize_branch(graph, how, {t: theirs[t] for t in branch.inputs}, rewritten.run(names, feeds), tol))
    if "node" not in found:
        found["explanation"] = "no node of the branch diverges when its graph runs alone: the engine itself differs from its ONNX"
    return found


# -- the whole ---------------------------------------------------------------------------------------------------
def localize(bundle_path, original_path=None, *, seed: int = 0, iterations: int = 3, device: str = "auto",
             scale_tol: float | None = None, check_hashes: bool = True, budget: int = MEMORY_BUDGET,
             loaded=None) -> Localization:
    """Where the bundle at ``bundle_path`` parts from ONNX Runtime on the original model (see the module docstring).

    ``seed``/``iterations``: the inputs verification draws (``parastream verify``'s seed; a build verifies with
    its --seed + 1); the first input on which either stage diverges is localized.  ``scale_tol``: the engine
    stage's bound (default: the bundle's, else its precision's).  ``loaded``: the original as ``load_model`` gave
    it already (else it is loaded when the rewrite stage needs it: the reference runs the model as read)."""
    from polygraphy.logger import G_LOGGER

    from parastream.launcher import load
    from parastream.launcher.bundle import Bundle
    from parastream.launcher.tail import MANIFEST_KEY

    from .model_io import load_model, name_nodes, read_model
    from .verify import bundle_tolerances

    t0 = time.perf_counter()
    bundle = Bundle.open(bundle_path, check_hashes=check_hashes, loading=True)
    if bundle.manifest.get("buckets"):
        raise ParastreamError(f"{bundle_path}: --localize takes a static bundle; localize one bucket's folder instead")
    original_path = original_path or (bundle.report.get("model") or {}).get("path")
    if not original_path or not Path(original_path).is_file():
        raise ParastreamError(f"{bundle_path}: the original model {original_path!r} is not there; name it with --model ORIGINAL.onnx")
    plan = bundle.plan
    if loaded is not None:
        original = loaded.original
    else:  # what load_model's ``original`` is, without its checks and folding (seconds on a large model)
        original = read_model(original_path)
        name_nodes(original)  # onnxruntime refuses duplicate node names
    model = onnx.load(str(bundle.model_path))
    tol = scale_tol or bundle_tolerances(bundle)[2] or DEFAULT_SCALE_TOLERANCES.get(plan.precision, 1e-3)
    tol1 = DEFAULT_SCALE_TOLERANCES["fp32"]
    result = Localization("no divergence", str(bundle.path), str(original_path), plan.precision, plan.backend, tol,
                          tol1, seed)

    out_names = [t.name for t in plan.outputs]
    order = [plan.branches[bid] for bid in plan.launch_order]
    boundary = list(dict.fromkeys([t for b in order for t in b.outputs] + out_names))
    reference = Values(original)
    rewritten = Values(model, budget)
    tail = MANIFEST_KEY in bundle.manifest  # the static part is localized: what the tail reads is its outputs
    runner = load(bundle, device=device, host_tail=False)
    G_LOGGER.module_severity = G_LOGGER.ERROR  # as verify: no polygraphy lines about the inputs it draws
    loader, _ = seeded_inputs(original, plan.inputs, seed=seed, iterations=iterations)
    try:
        for index, feeds in enumerate(loader):
            feeds = {k: np.asarray(v) for k, v in feeds.items()}
            ref = reference.run(out_names, feeds)
            mod = rewritten.run(boundary, feeds)
            theirs: dict = {}
            if hasattr(runner, "boundaries"):  # the GPU launcher: its arena after the replay
                runner(feeds)
                theirs = runner.boundaries()
            else:
                runner(feeds, boundaries=theirs)
            rewrite_err = _outputs_differ(mod, ref)
            first = first_diverging_branch(order, theirs, mod, tol)
            if rewrite_err <= tol1 and first is None:
                continue
            result.input_index = index
            if rewrite_err > tol1:
                if loaded is None:
                    loaded = load_model(original_path, {t.name: t.shape for t in plan.inputs}, host_tail=tail)
                result.status = "rewrite"
                result.rewrite = _rewrite_stage(loaded.model, model, bundle.report, feeds, ref, rewrite_err, tol1, budget)
            if first is not None:
                result.engine = _engine_stage(bundle, model, rewritten, order, first, theirs, mod, feeds, tol)
                result.status = "engine" if result.status == "no divergence" else result.status
                if plan.precision != "fp32":
                    pinned = result.engine.get("node") or ",".join(result.engine["branch_nodes"])
                    result.keep_fp32 = f"--keep-fp32 {pinned}"
            break
    finally:
        close = getattr(runner, "close", None)
        if close:
            close()
    result.seconds = time.perf_counter() - t0
    return result


def print_localization(result: Localization, console) -> None:
    """The localization as a short table (rich)."""
    from rich.table import Table

    t = Table(title=f"localize {result.bundle} against onnxruntime on {result.model}", show_lines=False)
    t.add_column("stage")
    t.add_column("verdict")
    t.add_column("where")
    t.add_column("scaled error", justify="right")
    r = result.rewrite
    if r:
        cause = f"rule {r['rule']} at {r['site']}" if r.get("rule") else r.get("explanation", "")
        node = f"{r['node']} ({r['op']}) → {r['tensor']}" if r.get("tensor") else "outputs"
        t.add_row("original vs model.onnx", "differ", f"{node}; {cause}", f"{r.get('output_error', 0):.3g}")
    else:
        t.add_row("original vs model.onnx", "match", "", f"<= {result.rewrite_tolerance:g}")
    e = result.engine
    if e:
        node = f"node {e['node']} ({e['op']})" if e.get("node") else e.get("explanation", "")
        t.add_row("model.onnx vs bundle", "differ",
                  f"{e['branch']} ({e['backend']}, {e['precision']}, run as {e['runs_as']}): {node}",
                  f"{e.get('node_error', e['branch_error']):.3g}")
        growth = e.get("growth", [])[-GROWTH_SHOWN:]
        if growth:
            t.add_row("", "error growth", " → ".join(f"{g['node']} {g['error']:.2g}" for g in growth), "")
    else:
        t.add_row("model.onnx vs bundle", "match", "every branch boundary", f"<= {result.tolerance:g}")
    console.print(t)
    console.print(result.summary())
    if result.keep_fp32:
        console.print(f"to keep it in fp32: parastream build ... {result.keep_fp32}")
    console.print(f"localized in {result.seconds:.1f} s")
