"""Repeated blocks: where a model that runs as one stream can be cut into engines that compile once each.

Most models people deploy repeat one block many times (a transformer's layers, a ResNet stage's bottlenecks).
As one engine, every block is lowered and compiled again (an Inductor compile of ViT-B/16 takes ~35 s); cut into
one engine per block, blocks of equal code compile once and share the artifact (the torch backend's code
reuse), and a rewrite that changes every layer alike changes one compile, not the whole model's.

:func:`repeated_blocks` finds them in the node order of a one-stream plan (a topological order):

* every node gets a *token*: its op, attributes, output shapes and types, and its inputs' kinds, shapes and
  types (a small integer constant or a scalar by value, a weight by shape: weights are the engine's inputs, not
  its code);
* a *tandem repeat* is a run of positions where the token sequence equals itself shifted by a period ``p``
  (``p`` nodes per block, at least two blocks): the longest-covering one is taken first (the shortest period on
  ties), then the same search runs on what lies before and after it;
* a repeat is cut where no fusion is lost: at the phase of the period whose boundary tensors are few and none of
  them is made by a pointwise op and read after the cut by one that could have joined its kernel (an add
  followed by the next block's LayerNorm is one Inductor kernel; cutting between them costs a kernel and a
  round trip through memory).  Convolutions, matrix products and the fused ops of :mod:`.fused_ops` run as
  library calls, which no compiler fuses into: cuts next to them are free, but between a call and the epilogue
  it runs fused (a convolution's ReLU, a product's bias).

What lies between repeats stays one engine.  A plan is cut only where the blocks save most of its compile
(``MAX_COMPILED_SHARE``).  The result is only a partition of the order into consecutive
runs, so any cut is correct; where the cuts fall decides only speed and compile time, which the build measures.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace

import numpy as np
import onnx_graphsurgeon as gs

from .dataflow import consumers, producers
from .fused_ops import GEMM_ACTIVATION, SDPA

#: ops that run as a library call (cuBLAS, cuDNN, fused attention; parastream's own fused nodes): no compiler
#: fuses a neighbour into them, but for their epilogue (``EPILOGUE_OPS``)
LIBRARY_OPS = frozenset({"Conv", "ConvTranspose", "MatMul", "Gemm", "Einsum", "Attention", SDPA, GEMM_ACTIVATION})
#: what a library call runs fused when it follows it with only constants besides: the converter's cuDNN conv +
#: bias + ReLU, a GEMM's bias in cuBLAS's epilogue
EPILOGUE_OPS = frozenset({"Relu", "Add"})
#: the fewest nodes a repeated block may have (smaller repeats save no compile worth an engine boundary)
MIN_BLOCK_NODES = 6
#: a plan is cut only where its runs of distinct code hold at most this share of its nodes: the cut is for the
#: compiles it saves, and where it saves little one engine keeps every fusion (ResNet-50 cut into 9 engines, 5 of
#: them distinct: 13.8 against 15.0 s of build and 4% slower on the H100; it holds 0.53 of its nodes in distinct
#: runs now; ViT-B/16: 0.10, 11% faster)
MAX_COMPILED_SHARE = 0.5
#: matrix products: where every one of a one-stream order's lies in its last ``HEAD_NODES`` nodes, the first of
#: them begins its head (``head_start``)
MATMUL_OPS = frozenset({"Gemm", "MatMul", "Einsum", GEMM_ACTIVATION})
#: the most nodes a classifier head may have (a Linear, its bias and activation, a Softmax)
HEAD_NODES = 8
#: an integer constant of at most this many elements is code (a Reshape's shape, a Slice's bounds, a Gather's
#: indices); of float constants only scalars are (a Clip's bound, a scale): a bias, however small, is a weight
SMALL_CONSTANT = 64


@dataclass(frozen=True)
class Blocks:
    """A partition of a one-stream order into consecutive runs (``runs``: [start, end) positions) and, per run,
    the index of its repeat (-1 for a run between repeats) and its period."""

    runs: list[tuple[int, int]]
    repeat_of: list[int]
    periods: list[int]
    compiled_nodes: int = 0  # the nodes of the runs of distinct code: what the compiles lower

    @property
    def repeated(self) -> int:
        return sum(1 for r in self.repeat_of if r >= 0)


def _attr_token(v) -> object:
    if isinstance(v, gs.Tensor):
        return ("tensor",) + _input_token(v)
    if isinstance(v, (list, tuple)):
        return tuple(_attr_token(x) for x in v)
    if isinstance(v, np.ndarray):
        return (str(v.dtype), v.shape, hashlib.sha1(v.tobytes()).hexdigest())
    return v if isinstance(v, (int, float, str, bytes, bool, type(None))) else repr(v)


def _input_token(t) -> tuple:
    if t is None or not getattr(t, "name", "x"):
        return ("none",)
    if isinstance(t, gs.Constant):
        # shape and type from the tensor's header: a weight's values are never loaded (an imported model's are
        # lazy; loading BERT-base's to token each candidate's nodes took 0.6 s per candidate)
        shape = tuple(int(d) for d in t.shape)
        size = int(np.prod(shape, dtype=np.int64))
        try:
            kind = np.dtype(t.dtype).kind
        except TypeError:  # a type numpy does not have (bfloat16, float8): not an integer
            kind = "f"
        if size <= 1 or (size <= SMALL_CONSTANT and kind in "iub"):
            vals = t.values
            return ("const", str(vals.dtype), shape, np.asarray(vals).tobytes())
        return ("weight", str(t.dtype), shape)
    return ("var", str(t.dtype), tuple(t.shape) if t.shape is not None else None)


def node_tokens(nodes: list[gs.Node]) -> np.ndarray:
    """One integer per node: equal for nodes that compile to the same code wherever they are (see module doc)."""
    ids: dict = {}
    out = np.empty(len(nodes), dtype=np.int64)
    for i, n in enumerate(nodes):
        tok = (n.op, n.domain or "", tuple(sorted((k, _attr_token(v)) for k, v in n.attrs.items())),
               tuple(_input_token(t) for t in n.inputs),
               tuple((str(t.dtype), tuple(t.shape) if t.shape is not None else None) for t in n.outputs))
        out[i] = ids.setdefault(tok, len(ids))
    return out


def _cut_quality(nodes: list[gs.Node]) -> tuple[np.ndarray, np.ndarray]:
    """Per position c (a cut before node c, 1 <= c < n): how many activations cross it, and how many of those
    are fused across it (made by a pointwise node before c and read at or after c by a pointwise node whose other
    activations were all made before c: one kernel in a whole-model compile)."""
    n = len(nodes)
    writer = producers([t.name for t in nd.outputs] for nd in nodes)
    readers = consumers([t.name for t in nd.inputs if isinstance(t, gs.Variable)] for nd in nodes)
    delta = np.zeros(n + 1, dtype=np.int64)
    fused = np.zeros(n + 1, dtype=np.int64)
    for name, p in writer.items():
        users = readers.get(name)
        if not users:
            continue
        last = users[-1]
        if last > p:
            delta[p + 1] += 1  # crosses every cut in (p, last]
            delta[last + 1] -= 1
        if nodes[p].op in LIBRARY_OPS:
            for u in users:  # its epilogue: the only activation the consumer reads is this one
                if nodes[u].op in EPILOGUE_OPS and u > p and all(
                        t.name == name or isinstance(t, gs.Constant) or not t.name for t in nodes[u].inputs):
                    fused[p + 1] += 1
                    fused[u + 1] -= 1
            continue
        for u in users:
            if u <= p or nodes[u].op in LIBRARY_OPS:
                continue
            # the latest activation ``u`` reads besides this one: a cut in (p, min(u, that)] loses the fusion
            others = [writer.get(t.name, -1) for t in nodes[u].inputs
                      if isinstance(t, gs.Variable) and t.name and t.name != name]
            lo = max([p] + [o for o in others if o < u])
            if lo == p:  # every other input made before p (or a weight): fusable with p's kernel wherever cut
                fused[p + 1] += 1
                fused[u + 1] -= 1
    return np.cumsum(delta)[: n + 1], np.cumsum(fused)[: n + 1]


def _best_repeat(tok: np.ndarray, lo: int, hi: int, min_len: int) -> tuple[int, int, int] | None:
    """(period, start, end) of the tandem repeat covering the most of tok[lo:hi], shortest period on ties: every
    position in [start + period, end) holds the token one period before it."""
    best = None  # (covered, -period, start)
    seg = tok[lo:hi]
    m = len(seg)
    for p in range(min_len, m // 2 + 1):
        eq = seg[:-p] == seg[p:]
        if not eq.any():
            continue
        # runs of True: starts and lengths
        d = np.diff(np.concatenate(([0], eq.astype(np.int8), [0])))
        starts, ends = np.flatnonzero(d == 1), np.flatnonzero(d == -1)
        lengths = ends - starts
        k = int(np.argmax(lengths))
        run = int(lengths[k])
        if run < p:
            continue
        cand = (run + p, -p, lo + int(starts[k]))
        if best is None or cand[:2] > best[:2]:
            best = cand
    if best is None:
        return None
    return -best[1], best[2], best[2] + best[0]


def repeated_blocks(nodes: list[gs.Node], *, min_block: int = MIN_BLOCK_NODES) -> Blocks:
    """The runs of ``nodes`` (a topological order) one engine each: one per block of every tandem repeat, one per
    stretch between them (see the module docstring)."""
    n = len(nodes)
    if any(isinstance(v, gs.Graph) for nd in nodes for v in nd.attrs.values()):
        # an If/Loop/Scan body reads tensors of the enclosing graph that its node does not list as inputs: a cut
        # could leave one outside the engine that reads it, so a model with control flow is not cut
        return Blocks(runs=[(0, n)], repeat_of=[-1], periods=[0], compiled_nodes=n)
    tok = node_tokens(nodes)
    crossing, fused = _cut_quality(nodes)
    repeats: list[tuple[int, int, int]] = []  # (start, period, copies) cut where it loses nothing
    todo = [(0, n)]
    while todo:
        lo, hi = todo.pop()
        if hi - lo < 2 * min_block:
            continue
        found = _best_repeat(tok, lo, hi, min_block)
        if found is None:
            continue
        p, start, end = found
        # the phase: the cut of the period with nothing fused across, fewest activations crossing, earliest
        # (judged at the cut between the first two blocks: the same in every block, and a real cut)
        phases = [(int(fused[start + f + p]), int(crossing[start + f + p]), f) for f in range(p)]
        clean = [ph for ph in phases if ph[0] == 0]
        if not clean:
            todo += [(lo, start), (end, hi)]  # no lossless cut in this repeat: leave it whole, look elsewhere
            continue
        _, _, f = min(clean)
        first = start + f
        blocks = (end - first) // p
        if blocks < 2:
            todo += [(lo, start), (end, hi)]
            continue
        last = first + blocks * p
        if last < n and fused[last] > 0:  # the repeat's end must be a lossless cut as well
            blocks -= 1
            last -= p
            if blocks < 2:
                todo += [(lo, start), (end, hi)]
                continue
        repeats.append((first, p, blocks))
        todo += [(lo, first), (last, hi)]
    repeats.sort()
    runs: list[tuple[int, int]] = []
    repeat_of: list[int] = []
    periods: list[int] = []
    at = 0
    for r, (first, p, blocks) in enumerate(repeats):
        if first > at:
            runs.append((at, first))
            repeat_of.append(-1)
            periods.append(0)
        for b in range(blocks):
            runs.append((first + b * p, first + (b + 1) * p))
            repeat_of.append(r)
            periods.append(p)
        at = first + blocks * p
    if at < n:
        runs.append((at, n))
        repeat_of.append(-1)
        periods.append(0)
    distinct = {tuple(tok[s:e]): e - s for s, e in runs}
    return Blocks(runs=runs, repeat_of=repeat_of, periods=periods, compiled_nodes=sum(distinct.values()))


def head_start(nodes: list[gs.Node]) -> int | None:
    """Where the classifier head of a one-stream order (a topological order) begins: at its first matrix product,
    where every matrix product of the order lies in its last ``HEAD_NODES`` nodes and no other library call does
    (a CNN's Linear after its global pooling), the cut before it loses no fusion and one activation crosses it;
    None otherwise (no product, or products elsewhere: a transformer's, whose GEMM epilogues are in every block).

    Why a head of its own (``--head-engine``): a GPU build races each fusion's alternative as the model's engines
    compiled with it, and a one-engine model's every alternative, and every combination of round outcomes that the
    rounds go on to race, is a compile of the whole model.  The GEMM-epilogue round changes only the head: cut off,
    its rivals compile the head alone, and the other rounds' rivals the body alone, whatever the GEMM round chose
    (each engine's compile is reused by its code).  MixNet-S's builds ran 10-12 whole-model compiles, 4 of them
    the GEMM round's (H200)."""
    n = len(nodes)
    at = [i for i, nd in enumerate(nodes) if nd.op in MATMUL_OPS]
    if not at or at[0] < max(1, n - HEAD_NODES):
        return None
    if any(nd.op in LIBRARY_OPS - MATMUL_OPS for nd in nodes[at[0]:]):
        return None  # a convolution or attention after the first product: not a classifier's head
    if any(isinstance(v, gs.Graph) for nd in nodes for v in nd.attrs.values()):
        return None  # (control flow reads tensors its node does not list: not cut, as ``repeated_blocks``)
    crossing, fused = _cut_quality(nodes)
    c = at[0]
    return c if fused[c] == 0 and crossing[c] == 1 else None


def ends_in_head(runs: list[list[gs.Node]]) -> bool:
    """Whether the last of ``runs`` (consecutive runs of a one-stream order, its engines) is the order's head
    (``head_start``): a plan that ``split_schedule`` cut with ``head``."""
    order = [nd for run in runs for nd in run]
    return len(runs) > 1 and head_start(order) == len(order) - len(runs[-1])


def compiled_share(order: list[gs.Node], *, min_block: int = MIN_BLOCK_NODES) -> float:
    """The share of ``order``'s nodes that one engine per repeated block compiles (``Blocks.compiled_nodes``: the
    runs of distinct code), 1.0 where nothing repeats."""
    found = repeated_blocks(order, min_block=min_block)
    return found.compiled_nodes / len(order) if found.repeated and order else 1.0


def split_schedule(sched, nodes: list[gs.Node], *, min_block: int = MIN_BLOCK_NODES,
                   max_share: float = MAX_COMPILED_SHARE, head: bool = False):
    """``sched`` (a :class:`~.schedule.Schedule` on one stream, one branch: ``nodes`` in its order) with one
    branch per run of :func:`repeated_blocks`, in order on that stream, unless nothing repeats or the runs of
    distinct code hold more than ``max_share`` of the nodes; with ``head``, its head (``head_start``) a branch of
    its own as well; ``sched`` itself where nothing is cut.  Each run's time is the simulated time from its first
    node's start to the next run's."""
    if sched.num_streams != 1 or len(sched.branches) != 1:
        return sched
    names = sched.branches[0]
    by_name = {n.name: n for n in nodes}
    order = [by_name[nm] for nm in names]
    found = repeated_blocks(order, min_block=min_block)
    cut = found.repeated > 0 and found.compiled_nodes <= max_share * len(order)
    runs = [names[s:e] for s, e in found.runs] if cut else [list(names)]
    c = head_start(order) if head else None
    last = len(names) - len(runs[-1])  # where the last run begins (the head lies in it, after every repeat)
    if c is not None and c > last:
        runs[-1:] = [names[last:c], names[c:]]
    if len(runs) == 1:
        return sched
    starts = [sched.node_start.get(r[0], 0.0) for r in runs] + [sched.makespan]
    branch_of = {nm: b for b, r in enumerate(runs) for nm in r}
    writer = {t.name: branch_of[n.name] for n in order for t in n.outputs}
    preds: list[list[int]] = []
    for b, r in enumerate(runs):
        mine = {writer[t.name] for nm in r for t in by_name[nm].inputs
                if isinstance(t, gs.Variable) and t.name in writer and writer[t.name] != b}
        preds.append(sorted(mine))
    return replace(sched, branches=runs, branch_stream=[0] * len(runs), launch_order=list(range(len(runs))),
                    branch_bound=[sched.branch_bound[0]] * len(runs),
                    branch_time=[max(starts[b + 1] - starts[b], 0.0) for b in range(len(runs))],
                    branch_preds=preds)
