"""A model's data-dependent tail: the nodes whose output shapes depend on input values, run on the host.

Detection models end in post-processing whose output shapes depend on the data: a ``NonZero`` over scores above
a threshold, a ``TopK`` whose k is computed from how many there are, ``NonMaxSuppression``.  parastream plans
static shapes (every engine, every arena buffer), so those nodes and every node that depends on them cannot be
planned.  What a user deploying such a model wants is the rest of it accelerated and the tail still run: the
build cuts the model in two where the data-dependent part starts (``split``):

- the **static part**, every node that does not depend on a data-dependent node: built, searched, planned and
  verified like any model; its outputs are the model's outputs it computes and the *boundary* tensors the tail
  reads;
- the **tail**, the data-dependent nodes and everything downstream of them: shipped in the bundle as
  ``tail.onnx`` (the original's own nodes, cut by ``onnx.utils.Extractor``) and run after each replay
  (``parastream.launcher.tail``) on the boundary tensors the static part computed: by ONNX Runtime on the host,
  or, where the plan runs on a GPU, as torch ops there when that is faster (``place``).

The bundle's verification compares the static part, boundary tensors included, with ONNX Runtime on the
original's static part; the tail is the reference's own computation on those tensors.  The whole bundle is then
also run once against ONNX Runtime on the whole original, and report.json records how its outputs compare
(``end_to_end``): a box whose score sits within the precision's tolerance of a threshold can come and go, so
that comparison is reported, not required.

Where the tail runs is decided by measurement (``place``): on a GPU build the tail on the GPU is first compared
with the host's on the same boundary tensors (it must give the same outputs: the same computation in fp32 on the
same values), then the whole call is timed both ways, alternating, and the faster one is recorded in
manifest.json (``runs_on``) and report.json (``host_tail.placement``: what was timed and what won).

The tail's outputs have no static shape and, after a ``NonZero`` over a batch, no batch axis: a bundle with a
tail is built at one static batch, and its Triton model takes ``max_batch_size`` 0.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import onnx

from parastream.core import dataflow
from parastream.launcher.errors import ParastreamError
from parastream.launcher.tail import TAIL_FILE


@dataclass
class HostTail:
    """The tail cut off a model (``split``)."""

    model: onnx.ModelProto  # the tail: its inputs are ``boundary`` then ``feeds``
    boundary: list[str]  # tensors the static part computes and the tail reads (static outputs of the bundle)
    feeds: list[str]  # the model's own inputs the tail reads
    outputs: list[str]  # the model's outputs the tail computes
    order: list[str]  # every output of the model, in its order (the static part's and the tail's)
    seeds: list[str]  # the data-dependent nodes it starts at
    constants: list[str] = field(default_factory=list)  # boundary tensors the static part folded: the tail holds them

    def record(self) -> dict:
        """manifest.json's record (``launcher.tail.MANIFEST_KEY``): what the launcher needs to run the tail."""
        # (analysis.op_histogram counts the same, but imports the loader, which imports this module)
        ops = Counter(n.op_type for n in self.model.graph.node)
        return {"file": TAIL_FILE, "boundary": self.boundary, "feeds": self.feeds, "outputs": self.outputs,
                "order": self.order, "seeds": self.seeds, "constants": self.constants, "runs_on": "host",
                "nodes": len(self.model.graph.node), "ops": dict(ops.most_common())}


def downstream(model: onnx.ModelProto, seeds: set[str]) -> set[int]:
    """Indices of the nodes named in ``seeds`` and of every node that reads, directly or not, one of their outputs
    (an If whose branch reads one included)."""
    nodes = model.graph.node
    found = {i for i, n in enumerate(nodes) if n.name in seeds}
    return found | dataflow.downstream([dataflow.node_reads(n) for n in nodes], [list(n.output) for n in nodes], found)


_FLOATS = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE}


def _elem_types(typed: onnx.ModelProto) -> dict[str, int]:
    g = typed.graph
    return {vi.name: vi.type.tensor_type.elem_type for vi in [*g.input, *g.value_info, *g.output]}


#: ops that move or combine values elementwise: cheap on the host, so that a selection's consequences can follow
#: it into the tail (``_decisions_into_tail``); a convolution or a product never does
_PULLABLE = {
    "Gather", "GatherElements", "GatherND", "Slice", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Transpose",
    "Concat", "Split", "Expand", "Identity", "Cast", "Add", "Sub", "Mul", "Div", "Exp", "Log", "Sqrt", "Clip",
    "Min", "Max", "Sigmoid", "Neg", "Abs", "Where", "Floor", "Ceil", "Round",
}


def _decisions_into_tail(graph, reads: list[list[str]], tail: set[int], types: dict[str, int], inits: set[str]) -> set[int]:
    """``tail`` with the decisions it reads moved into it, and what they select: where nothing else reads them,
    the nodes that turn floating-point values into decisions (a ``Greater`` of scores against a threshold, a
    ``TopK``'s indices, an ``ArgMax``, a ``Cast`` to integers), and the cheap nodes (``_PULLABLE``) whose values
    a decision picked (a ``Gather`` of boxes by a ``TopK``'s indices).  The tail then reads values, and the static
    part's outputs are values its verification can judge within a tolerance.  A decision made in the static part's
    precision (fp16, or another backend's fp32) is right or wrong: scores within rounding of each other (an
    untrained region-proposal head's are, to the last bits) swap places in a top-k, and what it selected differs
    entirely, though the model is as right as the precision makes it.  In ONNX Runtime on the host, or on the GPU
    in fp32, the decision is made on the values the plan computed (report.json's ``end_to_end`` says where the
    outputs then differ).  ``reads``: each node's (``dataflow.node_reads``)."""
    producer = dataflow.producers(n.output for n in graph.node)
    consumers = dataflow.consumers(reads)
    outputs = {vi.name for vi in graph.output}

    def is_float(t: str) -> bool:
        return types.get(t, onnx.TensorProto.FLOAT) in _FLOATS

    # what decisions chose: non-float tensors computed from float values (not from shapes and constants alone)
    # or from other choices, and the values that cheap nodes picked or computed from choices (the boxes a
    # top-k's indices gathered, their coordinates' differences)
    chosen: set[str] = set()
    for i, n in enumerate(graph.node):
        if n.op_type in ("Shape", "Size"):  # (of a tensor's shape, not its values)
            continue
        values = [x for x in reads[i] if x and x not in inits]
        picked = any(x in chosen for x in values)
        if picked or any(is_float(x) for x in values):
            chosen.update(o for o in n.output if o and not is_float(o))
        if picked and n.op_type in _PULLABLE:
            chosen.update(o for o in n.output if o and is_float(o))
    tail = set(tail)
    changed = True
    while changed:
        changed = False
        for t in {t for i in tail for t in reads[i] if t}:
            i = producer.get(t)
            if i is None or i in tail:
                continue
            n = graph.node[i]
            if is_float(t):  # a value: taken along only where a decision chose it
                if t not in chosen:
                    continue
            elif n.op_type in ("Shape", "Size") or not any(is_float(x) or x in chosen for x in reads[i]
                                                           if x and x not in inits):
                continue
            # (a Shape of it left outside reads a static shape: the static part folds it)
            if any(o in outputs for o in n.output) or any(c not in tail and graph.node[c].op_type not in ("Shape", "Size")
                                                         for o in n.output if o for c in consumers.get(o, [])):
                continue
            tail.add(i)
            changed = True
    return tail


def split(original: onnx.ModelProto, seeds: set[str], constants: dict[str, onnx.TensorProto] | None = None,
          *, typed: onnx.ModelProto | None = None) -> tuple[onnx.ModelProto, HostTail]:
    """``original`` cut where the nodes named in ``seeds`` start its data-dependent part: (the static part, the
    tail).  ``constants``: boundary tensors that the static part computes from shapes and constants alone (its
    load folds them): the tail holds their values instead of reading them.  ``typed``: ``original`` with ONNX's
    shape inference run (its value_info gives the cut tensors' types; made here when not given)."""
    constants = constants or {}
    graph = original.graph
    tail_nodes = downstream(original, seeds)
    if not tail_nodes:
        raise ParastreamError(f"no node named {sorted(seeds)} to cut the model at")
    inits = {t.name for t in graph.initializer}
    typed = typed or onnx.shape_inference.infer_shapes(original)
    reads = [dataflow.node_reads(n) for n in graph.node]  # an If's branches' reads of this graph's tensors included
    tail_nodes = _decisions_into_tail(graph, reads, tail_nodes, _elem_types(typed), inits)
    real_inputs = [vi.name for vi in graph.input if vi.name not in inits]
    produced_in_tail = {t for i in tail_nodes for t in graph.node[i].output if t}
    read_by_tail = list(dict.fromkeys(t for i in sorted(tail_nodes) for t in reads[i] if t))
    feeds = [t for t in real_inputs if t in read_by_tail]
    boundary = [t for t in read_by_tail
                if t not in produced_in_tail and t not in inits and t not in feeds and t not in constants]
    order = [vi.name for vi in graph.output]
    tail_outputs = [t for t in order if t in produced_in_tail]
    static_outputs = [t for t in order if t not in produced_in_tail] + [t for t in boundary if t not in order]
    if not static_outputs:
        raise ParastreamError("every output depends on the data-dependent nodes and the tail reads only the "
                              "model's inputs: nothing is left to build")
    # the folded boundary tensors are inputs of the extraction too, so that it stops there (then they are the
    # tail's initializers, not its inputs)
    held = [t for t in read_by_tail if t in constants]
    try:
        static, tail = _extract(typed, reads, [(real_inputs, static_outputs), (boundary + feeds + held, tail_outputs)])
    except ValueError as e:  # a cut tensor whose type ONNX's inference could not give
        raise ParastreamError(f"the data-dependent part cannot be cut off: {e}") from None
    if held:
        keep = [vi for vi in tail.graph.input if vi.name not in constants]
        del tail.graph.input[:]
        tail.graph.input.extend(keep)
        tail.graph.initializer.extend(constants[n] for n in held)
    # the outputs keep the original's declarations (Extractor takes value_info's, which shape inference may
    # have narrowed); the static part's boundary outputs get what inference gave them
    declared = {vi.name: vi for vi in graph.output}
    for vi in [*static.graph.output, *tail.graph.output]:
        if vi.name in declared:
            vi.CopyFrom(declared[vi.name])
    for part in (static, tail):
        del part.graph.value_info[:]
        part.graph.name = original.graph.name
    tail.graph.name = f"{original.graph.name}_tail"
    names = [graph.node[i].name for i in sorted(tail_nodes) if graph.node[i].name in seeds]
    return static, HostTail(model=tail, boundary=boundary, feeds=feeds, outputs=tail_outputs, order=order,
                            seeds=names, constants=held)


def _extract(typed: onnx.ModelProto, reads: list[list[str]], cuts: list[tuple[list[str], list[str]]]) -> list:
    """``onnx.utils.Extractor``'s model for each (inputs, outputs) of ``cuts``, with what If/Loop/Scan bodies read
    from the enclosing graph: the Extractor follows a node's listed inputs only, so a branch's tensor computed
    outside it (and the nodes and initializers behind it) would be left out.  For the extraction those reads are
    listed as the nodes' inputs (``reads``, in ``typed``'s node order), then taken out of ``typed`` and of the
    extracted models again."""
    listed = {}
    for node, names in zip(typed.graph.node, reads):
        if len(names) > len(node.input):
            listed[node.name] = len(node.input)
            node.input.extend(names[len(node.input):])
    try:
        extractor = onnx.utils.Extractor(typed)
        parts = [extractor.extract_model(inputs, outputs) for inputs, outputs in cuts]
    finally:
        for node in typed.graph.node:
            if node.name in listed:
                del node.input[listed[node.name]:]
    for part in parts:
        for node in part.graph.node:
            if node.name in listed:
                del node.input[listed[node.name]:]
    return parts


def end_to_end(full: onnx.ModelProto, loaded, bundle_dir, *, rtol: float, atol: float, scale_tol: float | None,
               seed: int, lock: bool = True) -> dict:
    """The whole bundle (its static part replayed, then its tail on the host) once against ONNX Runtime on
    ``full``, the whole original (its nodes named as the loader names them), at the verification's inputs, what
    its tail costs per call, and where it runs (``place``, under ``placement``): what report.json's
    ``host_tail.end_to_end`` records.  Not a verdict (see the module docstring): an output whose shape differs is
    recorded as such; a tail that does not run is an error.  ``lock``: ``place`` times under the GPU timing lock."""
    from parastream.launcher import load

    from .verify import run_verification

    runner = load(bundle_dir, check_hashes=False)
    try:
        result = run_verification(loaded.path, full, runner, loaded.inputs, rtol=rtol, atol=atol, scale_tol=scale_tol,
                                  seed=seed, iterations=1)
        placement = place(runner, loaded.inputs, seed, lock=lock)
        # the host's calls the placement timed are what ``tail_time`` would time again (a tail of 0.4 s a call on
        # the host, SSDlite's: 2.9 s of a build); where it timed none, the tail is timed here
        timed = placement.pop("host_calls", None) or tail_time(runner, loaded.inputs, seed)
    finally:
        close = getattr(runner, "close", None)
        if close is not None:
            close()
    outputs = {}
    for name, d in result.outputs.items():
        same = d["max_abs"] != float("inf")
        outputs[name] = {"same_shape": same, **({"max_abs": d["max_abs"], "within_tolerance": d["passed"]} if same else {}),
                         # (a detector with random weights may detect nothing: equal, and empty)
                         **({"not_meaningful": d["not_meaningful"]} if d.get("not_meaningful") else {})}
    return {"compared": "the bundle with its tail against onnxruntime on the whole original, one input",
            "within_tolerance": all(o.get("within_tolerance") for o in outputs.values()), "outputs": outputs, **timed,
            "placement": placement}


def tail_time(runner, inputs, seed: int, calls: int = 5) -> dict:
    """What the tail costs on the host per call (the median of ``calls`` after one untimed, on one seeded input
    on the build's machine), beside what the whole call costs: the tail's work grows with how many candidates
    pass the model's score threshold, which random weights do not say for a trained model."""
    import time

    from parastream.core.tensors import random_feeds

    feeds = random_feeds(inputs, seed=seed)
    tails, wholes = [], []
    for i in range(calls + 1):
        t0 = time.perf_counter()
        runner(feeds)
        if i:
            wholes.append(time.perf_counter() - t0)
            tails.append(runner.tail_s)
    return _tail_figures(tails, wholes)


def _tail_figures(tails: list[float], wholes: list[float], whose: str = "") -> dict:
    """report.json's ``tail_ms`` and ``call_ms`` (medians of the host's calls, seconds in) and how they were timed."""
    import statistics

    return {"tail_ms": round(statistics.median(tails) * 1e3, 3), "call_ms": round(statistics.median(wholes) * 1e3, 3),
            "timed": f"median of {len(wholes)} calls on one seeded input, on the build's machine{whose}"}


#: the GPU tail against the host's on the same boundary tensors: the same fp32 computation on the same values
#: (the GPU's exp and division round differently in the last bits)
SAME_RTOL, SAME_ATOL = 1e-4, 1e-5


#: the fewest timed calls a side of the placement takes before it may be decided early (``place``)
DECIDED_AFTER = 3
#: ... when the slower side's fastest call took longer than this many times the faster side's slowest
DECIDED_BY = 2.0


def place(runner, inputs, seed: int, calls: int = 7, inputs_compared: int = 3, lock: bool = True) -> dict:
    """Where ``runner``'s tail runs (``runner``: its tail on the host): on the GPU when its static part replays
    there, the tail's every node runs as torch ops, gives the host's outputs on ``inputs_compared`` seeded inputs,
    and the whole call is faster (medians of ``calls``, the two alternating, after one untimed each, while this
    process holds the GPU's timing lock unless ``lock`` is False; decided after ``DECIDED_AFTER`` calls each where
    no call of the slower side came within ``DECIDED_BY`` times the faster side's slowest: more calls cannot
    change the medians' order, and a tail of 0.4 s a call on the host paid seven); else the host.  The record says
    what was compared and timed, what won, and why; ``host_calls``, where the host's calls were timed, is what
    ``tail_time`` gives for them (``end_to_end`` takes it out)."""
    import statistics
    import time

    import numpy as np

    from parastream.core.tensors import random_feeds
    from parastream.launcher.tail import TailRunner

    host = {"runs_on": "host"}
    if getattr(runner.inner, "arena_device", None) is None:
        return dict(host, why="the static part runs on the CPU")
    gpu = TailRunner(runner.inner, runner.inner.bundle, runner.record, on="gpu")
    if not gpu.on_gpu:
        return dict(host, why=gpu.why_host)
    feeds = [random_feeds(inputs, seed=seed + i) for i in range(inputs_compared)]
    for f in feeds:
        want, got = runner(f), gpu(f)
        for name in runner.record["outputs"]:
            a, b = np.asarray(want[name]), np.asarray(got[name])
            if a.shape != b.shape or a.dtype != b.dtype or not np.allclose(a, b, rtol=SAME_RTOL, atol=SAME_ATOL):
                return dict(host, why=f"on the GPU the tail's output {name!r} differs from the host's "
                                      f"({list(a.shape)} {a.dtype} against {list(b.shape)} {b.dtype})")
    if gpu.fallbacks:
        return dict(host, why="the tail failed on the GPU and ran on the host")
    from .bench import gpu_timing_lock

    times: dict[str, list[float]] = {"host": [], "gpu": []}
    tails: list[float] = []  # the host's tail, of each timed host call
    with gpu_timing_lock(runner.inner.arena_device, enabled=lock):
        for i in range(calls + 1):
            for where, r in (("host", runner), ("gpu", gpu)):
                t0 = time.perf_counter()
                r(feeds[0])
                if i:
                    times[where].append(time.perf_counter() - t0)
                    if where == "host":
                        tails.append(runner.tail_s)
            if i >= DECIDED_AFTER and _decided(times["host"], times["gpu"]):
                break
    n = len(times["host"])
    ms = {f"{k}_ms": round(statistics.median(v) * 1e3, 3) for k, v in times.items()}
    chosen = "gpu" if ms["gpu_ms"] < ms["host_ms"] else "host"
    how = f"the whole call, median of {n}, alternating, one seeded input" + (
        f" (decided after {n}: the slower's fastest call over {DECIDED_BY:g}x the faster's slowest)" if n < calls else "")
    return {"runs_on": chosen, "timed": dict(ms, how=how),
            "compared": f"the tail on the GPU against the host's, {inputs_compared} seeded inputs: the same outputs",
            "why": "faster" if chosen == "gpu" else "the host's was faster",
            "host_calls": _tail_figures(tails, times["host"], " (the placement's host calls)")}


def _decided(a: list[float], b: list[float]) -> bool:
    """Whether every call of one side took more than ``DECIDED_BY`` times the other side's slowest."""
    return min(a) > DECIDED_BY * max(b) or min(b) > DECIDED_BY * max(a)
