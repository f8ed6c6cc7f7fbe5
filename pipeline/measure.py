"""Measurement: what the build times on the machine to decide between what it could ship.

Three decisions are taken by timing rather than by the cost model:

* the rewrite search's candidates, on the GPU (``GpuMeasurer.measure``, the search's ``Measurer``);
* a GPU bundle's alternatives (``GpuMeasurer.time_alternatives``): fused attention and GEMM epilogues or their
  plain ops, depthwise convolutions as cuDNN's, Inductor's or torch's own kernels, cuDNN's fused conv + bias + ReLU or not,
  channels-last or contiguous internal boundaries, the plan or one engine for the whole model;
* a CPU build's alternatives (``choose_cpu_alternative``): plain onnxruntime, the rewritten model, the plan.

Each thing timed is a ``Variant`` (data: a model, its graph and plan, the engine options and boundary layout);
each decision between two or more is taken by the one comparator, ``decide_by_timing`` (medians in order,
the default kept unless another is faster by a margin).  What builds and loads a variant's engines is the
build's (``pipeline.build.Engines``, the ``EngineMaker`` below); this module decides what to time and when.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from parastream.launcher.bundle import Bundle
from parastream.launcher.engines import BuildOptions
from parastream.launcher.engines.base import conv_kernels_used
from parastream.launcher.engines.onnx_torch import (  # noqa: F401 - also used by tests
    has_conv_relu, has_fused_attention, has_fused_gemm, has_gemm_epilogue)
from parastream.core.schedule import Schedule, schedule_graph
from parastream.launcher.words import plural
from parastream.rewrite.search import CONFIRM_WITHIN, MEASURE_MARGIN, MeasureBudgetSpent, timings_stand

from .model_io import LoadedModel, graph_of

if TYPE_CHECKING:
    from parastream.launcher.plan import Plan


@dataclass
class Variant:
    """One thing a build may time: ``plan`` of ``model`` (its ``graph``) built with ``options`` and loaded with
    channels-last internal boundaries or not (``internal_nhwc``)."""

    model: onnx.ModelProto
    graph: gs.Graph
    plan: "Plan"
    options: BuildOptions
    internal_nhwc: bool = True


class EngineMaker(Protocol):
    """What measurement needs of the build's engines (``pipeline.build.Engines``)."""

    backend: object

    def plan(self, graph: gs.Graph, streams: int | None, max_streams: int) -> "Plan": ...

    def plan_of_schedule(self, graph: gs.Graph, sched: Schedule) -> "Plan": ...

    def manifest_of(self, variant: Variant) -> dict: ...

    def one_stream_plan(self, graph: gs.Graph, plan: "Plan") -> "Plan": ...

    def whole_engine_plan(self, graph: gs.Graph, plan: "Plan") -> "Plan": ...

    def branch_models(self, v: Variant) -> list[onnx.ModelProto]: ...

    def side_by_side(self, branches: list[onnx.ModelProto]) -> tuple[onnx.ModelProto, gs.Graph, "Plan"]: ...

    def window(self, v: Variant, ids: list[int]) -> tuple[onnx.ModelProto, gs.Graph, "Plan"]: ...

    def launcher(self, variant: Variant): ...

    def precompile(self, variants: list[Variant], background: bool = False, cancellable: bool = True,
                   order: str = "auto", label: str = "") -> dict | None: ...

    def write(self, dest: Path, variant: Variant, label: str, *, model_file: bool = True) -> dict: ...


def decide_by_timing(times: dict[str, np.ndarray], order: list[str], floor: float = 0.05,
                     spread: bool = True) -> tuple[str, list[dict]]:
    """The one comparator: the alternative to keep from timed calls, ``order[0]`` (the default) unless another is
    faster by a clear margin.  The alternatives are taken in order; one replaces the current choice when its
    median is below the current's by more than the margin: the larger of ``floor`` and (``spread``) the spread of
    either (interquartile range / median of its calls), so that a difference within the noise of a loaded machine
    never flips the bundle.  ``floor=0, spread=False``: the smaller median wins (a GPU's CUDA-event replays).
    Returns (chosen, one row per alternative: median, quartiles, spread, calls, margin it needed, won)."""
    stats = {}
    for name in order:
        t = np.asarray(times[name], dtype=float)
        q25, med, q75 = (float(x) for x in np.percentile(t, [25, 50, 75]))
        stats[name] = {"median_ms": med * 1e3, "p25_ms": q25 * 1e3, "p75_ms": q75 * 1e3,
                       "spread": (q75 - q25) / med if med > 0 else 0.0, "calls": int(t.size)}
    current = order[0]
    for name in order[1:]:
        margin = max(floor, stats[current]["spread"], stats[name]["spread"]) if spread else floor
        stats[name]["margin_needed"] = margin
        stats[name]["against"] = current
        if stats[name]["median_ms"] < stats[current]["median_ms"] * (1.0 - margin):
            current = name
    return current, [dict(alternative=n, **stats[n], chosen=n == current) for n in order]


# -- the GPU: the search's candidates and the bundle's alternatives ---------------------------------------------
ROUNDS = ("attention", "GEMM epilogue", "depthwise convolutions", "depthwise kernel", "Triton convolution kernel",
          "conv+ReLU", "boundary layout",
          "streams", "engine blocks")  # time_alternatives' rounds, in the order it times them
#: the round timed after them, on the plan and options they chose (``kernel_tuning_round``)
TUNING_ROUND = "kernel tuning"


def round_labels(what: str, plan) -> tuple[str, str]:
    """What a round of ``time_alternatives`` races: (the plan as it is, the alternative).  Only the "streams"
    round's labels name the plan (``plan`` None for the others)."""
    if what == "streams":
        return f"{plan.num_streams}-stream plan", "one stream"
    return {"attention": ("one SDPA kernel per attention", "attention as matmul, softmax, matmul"),
            "GEMM epilogue": ("cuBLASLt GEMM with fused bias and activation",
                              "GEMM, bias and activation as Inductor's kernels"),
            "depthwise convolutions": ("depthwise convolutions as cuDNN calls", "depthwise convolutions as Inductor kernels"),
            "depthwise kernel": ("depthwise convolutions as the round before chose",
                                 "depthwise convolutions as torch's own kernel"),
            "Triton convolution kernel": ("depthwise and narrow-group convolutions as the rounds before chose",
                                          "depthwise and narrow-group convolutions as parastream's Triton kernel"),
            "conv+ReLU": ("cuDNN fused conv+bias+ReLU", "Inductor's conv and epilogue"),
            "boundary layout": ("channels-last boundaries", "contiguous boundaries"),
            "engine blocks": ("one engine per repeated block", "one engine for the whole model"),
            TUNING_ROUND: ("kernels as compiled at the rounds' level", "kernels tuned on the device")}[what]


def runs_fused_attention(backend) -> bool:
    """Whether ``backend``'s engines run attention nodes as one kernel or decomposed (``fuse_attention``): the
    backends the rule that makes them is for."""
    from parastream.rewrite.rules.fuse_attention import FuseAttention

    return backend.name in FuseAttention.backends


#: rounds whose alternative is kept unless it is slower by more than this share: Inductor's depthwise kernels
#: ship compiled, where cuDNN's execution plans are built at every process's first call (MixNet-S: 3.0 s against
#: 8.0 s to a fresh process's first result, H100) or, shipped (``cudnn_plans``), still deserialized (~18 ms each),
#: so at equal speed they are the better bundle.
#: Torch's own depthwise kernel needs neither a plan nor a compile: at equal speed it too is the better bundle
#: (MixNet-S, H200: 2.8 s to a fresh process's first result against 8.1 s with cuDNN's, and 24% faster; NASNet-A
#: Large: 3.1 s against 7.5 s, but 69% slower, its channels-last boundaries copied to and from NCHW around each)
#: parastream's own Triton kernel ships compiled in the engine as Inductor's do.
PREFER_ALTERNATIVE_WITHIN = {"depthwise convolutions": 0.02, "depthwise kernel": 0.02, "Triton convolution kernel": 0.02}
#: rounds whose alternative is kept only when it is faster by more than this share: engines per repeated block
#: compile once per distinct block and load faster (ViT-B/16, H100: 24 s to build and 2.7 s to load against 30 s
#: and 2.9 s), so at equal speed they are the better bundle (and a rebuild of a rewritten plan compiles a few blocks).
#: The conv+ReLU and boundary-layout rounds keep the plan's form unless the alternative is faster by more than two
#: loaded plans' medians differ by at rest (~1%): a tie flipped to the alternative gains nothing and costs the
#: build the later rounds timed again on it (NASNet-A Large, H200: Inductor's conv and epilogue "won" by 0.9%, where
#: cuDNN's fused kernel had won by 1.7-2.5% in five other builds, and the build then spent 11.9 s more).  So do the
#: attention and GEMM-epilogue rounds, which time first: NASNet-A Large's GEMM-epilogue round (its head, a Linear of
#: one row) went to the alternative by 0.08% (1.5362 against 1.5374 ms, H200), and every later round was compiled
#: and timed again after the search for that form: 216 compile jobs, a build of 93 s
PREFER_CURRENT_WITHIN = {"attention": 0.01, "GEMM epilogue": 0.01, "engine blocks": 0.02, "conv+ReLU": 0.01,
                         "boundary layout": 0.01}
#: the fusion rounds whose alternative (the fusion off) changes only the engines holding nodes the fusion converts
ROUND_APPLIES = {"attention": has_fused_attention, "GEMM epilogue": has_gemm_epilogue, "conv+ReLU": has_conv_relu}


def alternative_kept_within(what: str, current_kernels: str | None = None) -> float | None:
    """The share round ``what`` keeps its alternative within (``PREFER_ALTERNATIVE_WITHIN``).  The "depthwise
    kernel" round's edge, torch's kernel needing no plan, is over cuDNN's plans only: it applies where the
    kernels it races torch's against (``current_kernels``, the ``conv_kernels`` of the form raced) are cuDNN's.
    Against Inductor's, compiled and loaded as fast, the faster median wins: a MixNet-S build (H200) whose
    Inductor-kernel plan ran one timing in a slow state (0.689 ms against 0.60-0.64 in three other builds) kept
    torch's kernel at 0.702, within the 2%, and its bundle ran 0.7067 ms beside the others' 0.63."""
    if what in ("depthwise kernel", "Triton convolution kernel") and conv_kernels_used(current_kernels or "auto") != "cudnn":
        return None
    return PREFER_ALTERNATIVE_WITHIN.get(what)


def round_changes(what: str):
    """Whether an engine (its branch's model) holds a node that round ``what``'s alternative changes: the fusion
    rounds' nodes (``ROUND_APPLIES``) or a depthwise convolution; None for the rounds that change every engine
    (boundary layout, streams, engine blocks)."""
    if what in dict(DEPTHWISE_ROUNDS):
        return lambda b, k=dict(DEPTHWISE_ROUNDS)[what]: bool(depthwise_keys(b, k))
    return ROUND_APPLIES.get(what)


#: a round that the input's plan decided by at least this share is taken as decided for a rewritten plan that
#: replaced the input (a candidate the search kept): its alternative is neither compiled nor timed again
CARRY_MARGIN = 0.10


#: rounds taken from the input's plan for a rewritten plan whatever their margin: where a one-stream model is cut
#: is a matter of its repeated structure, which a rewrite changes alike in every block, and its alternative is a
#: whole-model compile (ViT-B/16: ~20 s on the H100), which the blocks exist to save
CARRIED_ALWAYS = frozenset({"engine blocks"})


def carried_rounds(rounds: list[dict]) -> list[dict]:
    """The rounds timed on the input's plan that a candidate's plan takes as they are: those whose two times are
    ``CARRY_MARGIN`` or more apart.  A candidate differs from the input in a few pieces and keeps most of its
    branches, so a choice made by a wide margin for the whole model (Inductor's depthwise kernels or cuDNN's, the
    boundary layout, the plan against one engine) holds for it; timing it again cost a whole-model compile per
    round (NASNet-A Large, H100: 94 s of the build's engines stage, for the three rounds its input had decided by
    48%, 11% and 75%).  Narrower rounds are timed again on the candidate's plan."""
    out = []
    for r in rounds:
        if r.get("choice") == "GEMM epilogue" and "sample" in r:  # its sample held the input's Linears of one row
            continue  # only, where a rewrite adds fused matmul-bias-activation nodes the round changes too
        if r.get("decided_on_sample") and r.get("choice") == "boundary layout":  # (``layout_sample``) by its margin
            out.append(dict(r, timed="on a window of the input's plan, taken for the rewritten plan"))
            continue
        if r.get("not_raced") and r.get("choice") in CARRIED_ALWAYS:  # ``blocks_not_raced``: the input's cut
            out.append(dict(r, timed=f"not raced on the input's plan ({r['not_raced']}), taken for the rewritten plan"))
            continue
        t = sorted(float(x) for x in (r.get("timed_ms") or {}).values())
        if len(t) == 2 and t[0] > 0 and (t[1] / t[0] - 1 >= CARRY_MARGIN or r.get("choice") in CARRIED_ALWAYS):
            out.append(dict(r, timed=f"on the input's plan ({t[1] / t[0] - 1:.0%} apart), taken for the rewritten plan"))
    return out


#: the depthwise rounds, in order, with the ``conv_kernels`` each one's alternative compiles
#: (parastream's Triton kernel last: cuDNN's depthwise kernels ran 1.1-3.4x its time per shape on ConvNeXt-T and
#: EfficientNet-B0, H200, bench/depthwise_kernels.py; whether the engine is faster with it is this round's)
DEPTHWISE_ROUNDS = (("depthwise convolutions", "inductor"), ("depthwise kernel", "native"),
                    ("Triton convolution kernel", "triton"))
#: the build option each fusion or kernel round's alternative sets, and its value there (``round_alternative``)
ROUND_OPTION = {"attention": ("fuse_attention", False), "GEMM epilogue": ("fuse_gemm_epilogue", False),
                "conv+ReLU": ("fuse_conv_relu", False),
                **{what: ("conv_kernels", k) for what, k in DEPTHWISE_ROUNDS}}


def round_alternative(v: Variant, what: str) -> Variant:
    """``v`` built as fusion or kernel round ``what``'s alternative (``ROUND_OPTION``)."""
    flag, value = ROUND_OPTION[what]
    return replace(v, options=replace(v.options, **{flag: value}))

#: a plan with at least this many engines holding a depthwise convolution has its depthwise rounds timed first
#: on a sample of those engines (``depthwise_sample``): each round's alternative is a compile of every such engine
#: with other kernels, Inductor's with 25-term sums each (NASNet-A Large on the H200: 332 engines, 59.6 s of its
#: build waiting for them, for a round they lost by 42%, 2.180 against 1.533 ms)
SAMPLE_DEPTHWISE_ENGINES = 16
#: at most this many engines in the sample, chosen to hold as many of the plan's distinct depthwise
#: convolutions as they can.  The sample only decides a round by a wide margin (``SAMPLE_DECIDES_BEYOND``), and
#: its compile is work the build waits for on a compile-bound model: NASNet-A Large's 12 engines (20 of its 23
#: distinct depthwise convolutions, H200) took 177 of the build's 688-859 worker-seconds, its Inductor kernels
#: ~12 s an engine, for rounds they lost by 65-80% (0.347 ms with cuDNN against 0.571-0.623); six engines
#: hold 12 of the 23
SAMPLE_ENGINES = 6
#: a round's kernels slower on the sample than the kernels the plan has by more than this share decide the round
#: without the whole plan's compile; closer, or faster, the whole plan is compiled and raced as before.  The
#: sampled engines run one after another, with no neighbour on another stream to hide their time behind, so the
#: sample's ratio is the plan's at most: a wide margin only is taken as the plan's
SAMPLE_DECIDES_BEYOND = 0.15
#: a one-engine plan's "GEMM epilogue" round decided on its sample before the rivals of the later rounds are
#: queued (``GpuMeasurer._gemm_sample_first``) keeps the alternative where the sample with the epilogue runs slower
#: than it by more than this share.  Decided first, the round costs nothing either way: the later rounds' rivals
#: are compiled for the form it keeps only, so the plan's 1% (``PREFER_CURRENT_WITHIN``), which prices the later
#: rounds timed again after a flip, does not apply; what is left is the sample's own noise, a few percent of a
#: replay of one or two nodes (H200: cuBLAS 13.9-17.3 µs against 5.2-5.4 for Inductor's reduction on three heads)
GEMM_SAMPLE_DECIDES_BEYOND = 0.10


def depthwise_keys(branch: onnx.ModelProto, kernels: str = "triton") -> set[tuple]:
    """The distinct convolutions of an extracted branch that ``conv_kernels`` ``kernels`` lowers
    (``onnx_torch.lowered_convs``; "triton", the default, lowers the most: the depthwise convolutions the other
    values lower and those of narrow groups): each one's weight shape, strides, pads and groups, and its input's
    shape."""
    from onnx import helper

    from parastream.launcher.engines.onnx_torch import lowered_convs

    found = lowered_convs(branch, kernels)
    if not found:
        return set()
    weights = {t.name: tuple(t.dims) for t in branch.graph.initializer}
    shapes = {vi.name: tuple(d.dim_value for d in vi.type.tensor_type.shape.dim)
              for vi in [*branch.graph.input, *branch.graph.value_info]}
    out = set()
    for i in found:
        n = branch.graph.node[i]
        attrs = tuple(sorted((a.name, repr(helper.get_attribute_value(a))) for a in n.attribute
                             if a.name in ("strides", "pads", "auto_pad", "group", "dilations")))
        out.add((weights[n.input[1]], attrs, shapes.get(n.input[0])))
    return out


@dataclass
class DepthwiseSample:
    """A plan's depthwise rounds timed first on a sample of its engines (``depthwise_sample``): the sampled engines
    side by side as one plan of their own, as the plan compiles them and with each round's kernels, the three
    loaded once each and timed together."""

    fulls: dict[str, Variant]  # per depthwise round, its alternative: the whole plan with that round's kernels
    current: Variant  # the sampled engines as the plan compiles them
    kinds: dict[str, Variant]  # per depthwise round, the sampled engines with its kernels
    names: list[str]  # the plan's branches sampled
    of: int  # the plan's engines with a depthwise convolution
    convolutions: int  # the plan's distinct depthwise convolutions
    covered: int  # of which the sample holds

    def variants(self) -> list[Variant]:
        """What the sample compiles and loads."""
        return [self.current, *self.kinds.values()]


@dataclass
class SampledRound:
    """A depthwise round that the plan's sample (``DepthwiseSample``) decides where it can, queued without its
    alternative's compile: where the sample leaves it open, ``full`` (the whole plan's alternative) is compiled
    when the round comes to be raced (``time_ready``), not for a round that is never raced (``rounds_timed``)."""

    full: Variant


@dataclass
class GemmSample:
    """The "GEMM epilogue" round of a plan whose only nodes that round changes are Linears of one row (a CNN's
    classifier head, a pooler at batch 1: ``one_row_linears``), decided on those nodes alone: each one extracted
    as an engine of its own, side by side as one plan, compiled with the epilogue (cuBLAS's GEMM with its bias)
    and without it (one Inductor reduction), the two timed together (``GpuMeasurer._race_gemm_sample``).

    Why: the round's two forms differ in those nodes only, by a few microseconds, where one loaded plan's
    medians differ by ~1% (6-9 µs on a 0.6-0.9 ms CNN): raced on the whole plan, MixNet-S's round went either
    way (the alternative ahead by 0.6-1.4% in eight builds, the plan's form kept in five, H200), and a flip then
    took the later rounds' rivals of the other form.  On the nodes alone, with two compiles of one node, a
    head's saving is timed to a fraction of a microsecond: cuBLAS 15.0 against 5.2 µs for the reduction on
    MixNet-S's head, 13.9 against 5.3 on EfficientNet-B0's, 17.3 against 5.4 on ResNet-50's (H200, a replay of
    the one-node plan each, its launch included; bench/figures/ab_one_gpu_h200_gemm_sample_*.json)."""

    full: Variant  # the whole plan's alternative (queued with the input's others: the form a flip goes on with)
    current: Variant  # the plan's Linears of one row side by side, as the plan compiles them
    alternative: Variant  # the same with the GEMM epilogue off
    names: list[str]  # the Gemm nodes sampled
    full_keys: list[str] = field(default_factory=list)  # ``full``'s cache keys, once queued (dropped when moot)

    def variants(self) -> list[Variant]:
        """What the sample compiles and loads."""
        return [self.current, self.alternative]


def gemm_sample(engines: EngineMaker, v: Variant, full: Variant) -> GemmSample | None:
    """``v``'s "GEMM epilogue" round (against ``full``, the whole plan with the epilogue off) as a sample of its
    Linears of one row (``GemmSample``); None where the round changes other nodes too (a rewrite's fused
    matmul-bias-activation nodes, whose epilogue fusion interacts with their neighbours') or none."""
    from parastream.launcher.engines.onnx_torch import one_row_linears
    from parastream.launcher.plan import Branch

    from .partition import extract_branch

    if has_fused_gemm(v.model):
        return None
    at = sorted(one_row_linears(v.model))
    if not at:
        return None
    nodes = [v.model.graph.node[i] for i in at]
    try:
        one = [extract_branch(v.model, v.graph, Branch(id=k, name=f"linear_{k:03d}", stream=0, nodes=[n.name],
                                                       inputs=[n.input[0]], outputs=[n.output[0]]))
               for k, n in enumerate(nodes)]
        model, graph, plan = engines.side_by_side(one)
    except Exception:  # noqa: BLE001 - a sample that cannot be cut leaves the round to the whole plan's race
        return None
    current = Variant(model, graph, plan, v.options)
    return GemmSample(full, current, replace(current, options=full.options), [n.name for n in nodes])


def sample_medians(engines: EngineMaker, named: dict[str, Variant], *, runs: int, warmup: int = 10,
                   lock: bool = True, confirmed: list | None = None) -> dict[str, float]:
    """Each of ``named``'s variants (one plan: a round's sample in its forms) loaded and timed together in
    alternating blocks: label -> median ms, confirmed as a whole plan's round is (``confirmed_round``; each timing
    taken again is appended to ``confirmed`` where given).  The launchers are closed after; raises what loading
    or timing raised."""
    from .bench import measure as time_replays

    la = {}
    try:
        for label, v in named.items():
            la[label] = engines.launcher(v)

        def time_once():
            return time_replays(la, runs=runs, warmup=warmup, lock=lock)

        ms, again = confirmed_round(time_once, {k: float(np.median(t)) for k, t in time_once().items()})
    finally:
        for x in la.values():
            x.close()
    if confirmed is not None:
        confirmed.extend({k: round(v, 4) for k, v in t.items()} for t in again)
    return ms


def gemm_sample_round(engines: EngineMaker, s: GemmSample, plan, plan_ms: float | None, *, runs: int,
                      warmup: int = 10, lock: bool = True) -> dict:
    """The "GEMM epilogue" round decided on its sample (``GemmSample``): the plan's Linears of one row with the
    epilogue and without it, timed together in alternating blocks.  With ``plan_ms`` (the plan's own median: the
    round decided after other rounds raced the plan's form) the alternative is kept where it saves more than the
    round's ``PREFER_CURRENT_WITHIN`` share of it, the share a whole-plan race keeps the plan's form within, and
    the round as ``race`` writes one gives the plan's time and that time less the saving in ``timed_ms``.
    Without it (the round decided first, before any rival of a later round is compiled:
    ``GpuMeasurer._gemm_sample_first``) the sample's form with the epilogue is kept unless it runs slower than the
    alternative by more than ``GEMM_SAMPLE_DECIDES_BEYOND`` (as ``race`` keeps a plan's form), and ``timed_ms``
    gives the sample's times.  The sample's own times are in ``sample`` either way.  Raises what loading or timing the sample raised."""
    what = "GEMM epilogue"
    keys = round_labels(what, plan)
    t0 = time.perf_counter()
    again: list = []
    ms = sample_medians(engines, {keys[0]: s.current, keys[1]: s.alternative}, runs=runs, warmup=warmup, lock=lock,
                        confirmed=again)
    saved = ms[keys[0]] - ms[keys[1]]
    sample = {"nodes": s.names, "timed_ms": {k: round(t, 4) for k, t in ms.items()},
              **({"confirmed_ms": again} if again else {})}
    linears = plural(len(s.names), "Linear")
    if plan_ms is None:
        beyond = GEMM_SAMPLE_DECIDES_BEYOND
        won = keys[1] if ms[keys[0]] > ms[keys[1]] * (1 + beyond) else keys[0]
        return {"choice": what, "timed_ms": dict(ms), "won": won,
                "load_s": 0.0, "timed_s": round(time.perf_counter() - t0, 3), "current_kept_within": beyond,
                "sample": sample,
                "timed": f"on its {linears} of one row alone, before any later round's rival was compiled: the "
                         f"alternative {'saves' if saved >= 0 else 'costs'} {abs(saved) * 1e3:.1f} µs, kept beyond "
                         f"{beyond:.0%}"}
    within = PREFER_CURRENT_WITHIN[what]
    return {"choice": what, "timed_ms": {keys[0]: plan_ms, keys[1]: plan_ms - saved},
            "won": keys[1] if saved > within * plan_ms else keys[0],
            "load_s": 0.0, "timed_s": round(time.perf_counter() - t0, 3), "current_kept_within": within,
            "sample": sample,
            "timed": f"on its {linears} of one row alone: the alternative "
                     f"{'saves' if saved >= 0 else 'costs'} {abs(saved) * 1e3:.1f} µs of the plan's {plan_ms:.3f} ms, "
                     f"kept beyond {within:.0%}"}


def depthwise_sample(engines: EngineMaker, v: Variant, alternatives: dict[str, Variant]) -> DepthwiseSample | None:
    """``v``'s depthwise rounds (against ``alternatives``, the whole plan's per round) as a sample of its engines
    side by side (``EngineMaker.side_by_side``), as ``v`` compiles them and with each round's kernels; None where
    the plan has fewer than ``SAMPLE_DEPTHWISE_ENGINES`` engines with a depthwise convolution (the whole plan's
    compile is then a few jobs).  The engines are chosen greedily, each holding the most distinct depthwise
    convolutions (weight, strides, pads, input shape: a cuDNN plan or a kernel each) not held by those before it,
    at most ``SAMPLE_ENGINES``, and run in the plan's launch order."""
    branches = engines.branch_models(v)
    held = [(i, k) for i, k in ((i, depthwise_keys(b)) for i, b in enumerate(branches)) if k]
    if len(held) < SAMPLE_DEPTHWISE_ENGINES:
        return None
    every = set().union(*(k for _, k in held))
    left, chosen = set(every), []
    while left and len(chosen) < SAMPLE_ENGINES:
        i, k = max(held, key=lambda x: (len(x[1] & left), -x[0]))
        if not k & left:
            break
        chosen.append(i)
        left -= k
    launched = {b: at for at, b in enumerate(v.plan.launch_order)}
    chosen.sort(key=lambda i: launched[i])  # a sampled branch after those it reads from (the plan's order)
    model, graph, plan = engines.side_by_side([branches[i] for i in chosen])
    current = Variant(model, graph, plan, v.options)
    return DepthwiseSample(dict(alternatives), current,
                           {what: replace(current, options=a.options) for what, a in alternatives.items()},
                           [v.plan.branches[i].name for i in chosen], len(held), len(every), len(every) - len(left))


#: a plan with at least this many engines has its "boundary layout" round timed first on a window of them
#: (``layout_sample``): the round's rival is every engine compiled again for contiguous boundaries (NASNet-A Large
#: on the H200: 332 engines, ~210 of its input's 287 alternative worker-seconds, the search's end waiting for them
#: at 55-58 s), for a round channels-last won in 81 of the 90 times on record, by 3-51% (NASNet-A Large: 9-14%)
SAMPLE_LAYOUT_ENGINES = 160
#: the window: this many engines consecutive in the plan's launch order, from its middle, on the plan's streams.
#: Its own inputs and outputs stay contiguous in both forms, so the share of its boundaries that the layout
#: changes, and its ratio with them, are below the plan's: a run of 12 of NASNet-A Large's engines on one stream
#: (H200) had contiguous boundaries 2.0-3.9% slower where the whole plan had them 11.4-11.7% slower; a NASNet cell's
#: branches all read the cell's two inputs, so a window must span cells for most of its boundaries to be inside it
LAYOUT_WINDOW = 64
#: contiguous boundaries slower on the window than channels-last by more than this share decide the round for
#: channels-last without the whole plan's compile; closer, or faster, the whole plan's rival (queued as spare work
#: meanwhile) is raced as before.  The window understates the plan's ratio (above), so a margin three times the
#: round's own on the whole plan (``PREFER_CURRENT_WITHIN``) is taken as the plan's
LAYOUT_SAMPLE_DECIDES_BEYOND = 0.03


@dataclass
class LayoutSample:
    """A plan's "boundary layout" round timed first on a window of its engines (``layout_sample``): the window as
    a plan of its own (``EngineMaker.window``), loaded with channels-last internal boundaries and with contiguous
    ones, the two timed together (``GpuMeasurer._race_layout_sample``)."""

    full: Variant  # the whole plan with contiguous boundaries (compiled only where the window leaves the round open)
    current: Variant  # the window as the plan has it: channels-last internal boundaries
    alternative: Variant  # the window with contiguous ones
    names: list[str]  # the plan's branches in the window
    of: int  # the plan's engines
    boundaries: int  # the window's internal boundaries whose bytes the layout changes
    full_keys: list[str] = field(default_factory=list)  # ``full``'s cache keys, once queued as spare work

    def variants(self) -> list[Variant]:
        """What the sample compiles and loads."""
        return [self.current, self.alternative]

    def queue_rival(self, engines: EngineMaker) -> list[str]:
        """``full`` queued to compile as spare work (raced only where the window leaves the round open: hastened
        then, dropped where the window decides); its cache keys, kept in ``full_keys``."""
        got = engines.precompile([self.full], background=True, cancellable=False, order="spare",
                                 label="the boundary layout round's rival")
        self.full_keys = [k for ks in (got or {}).get("keys") or [] for k in ks]
        return self.full_keys


#: the rounds' samples: a round timed first on a few of the plan's engines, its whole plan's rival compiled only
#: where the sample leaves it open
SAMPLES = (DepthwiseSample, GemmSample, LayoutSample)


def _nhwc_boundaries(backend, plan) -> int:
    """How many of ``plan``'s internal boundaries are laid out channels-last with other bytes than contiguous
    (``_internal_nhwc``)."""
    from parastream.launcher.gpu import engine_layouts

    lay = engine_layouts(plan, backend, internal_nhwc=True)
    return sum(lay.specs[t].shape[1] > 1 and lay.specs[t].shape[2] * lay.specs[t].shape[3] > 1 for t in lay.nhwc)


def layout_sample(engines: EngineMaker, v: Variant, full: Variant) -> LayoutSample | None:
    """``v``'s "boundary layout" round (against ``full``, the whole plan with contiguous boundaries) as a window
    of its engines (``LayoutSample``): ``LAYOUT_WINDOW`` engines consecutive in the plan's launch order, from
    its middle (a deep network's repeated cells, not its stem or head), on the plan's streams.  None where the
    plan has fewer than ``SAMPLE_LAYOUT_ENGINES`` engines (the whole plan's compile is then a few jobs), or where
    the window has no internal boundary that the layout changes, or cannot be cut."""
    n = len(v.plan.branches)
    if n < SAMPLE_LAYOUT_ENGINES or not v.internal_nhwc:
        return None
    start = (n - LAYOUT_WINDOW) // 2
    ids = list(v.plan.launch_order[start:start + LAYOUT_WINDOW])
    try:
        model, graph, plan = engines.window(v, ids)
    except Exception:  # noqa: BLE001 - a window that cannot be cut leaves the round to the whole plan's race
        return None
    boundaries = _nhwc_boundaries(engines.backend, plan)
    if not boundaries:
        return None
    current = Variant(model, graph, plan, v.options)
    return LayoutSample(full, current, replace(current, internal_nhwc=False), [v.plan.branches[i].name for i in ids],
                        n, boundaries)


def layout_window_round(engines: EngineMaker, s: LayoutSample, plan, *, runs: int, warmup: int = 10,
                        lock: bool = True) -> dict:
    """The "boundary layout" round on its window (``layout_sample``): the window with channels-last internal
    boundaries and with contiguous ones, timed together in alternating blocks.  Contiguous boundaries slower by
    more than ``LAYOUT_SAMPLE_DECIDES_BEYOND`` decide the round for the plan as it is: the round as ``race``
    writes one, with the window's times, ``sample`` and ``decided_on_sample``; closer, only {"sample": the
    window's times}, the round left to the whole plan's race.  Raises what loading or timing the window raised."""
    what = "boundary layout"
    here, other = round_labels(what, plan)
    t0 = time.perf_counter()
    again: list = []
    ms = sample_medians(engines, {here: s.current, other: s.alternative}, runs=runs, warmup=warmup, lock=lock,
                        confirmed=again)
    sample = {"engines": s.names, "of": s.of, "boundaries": s.boundaries,
              "timed_ms": {k: round(t, 4) for k, t in ms.items()}, "timed_s": round(time.perf_counter() - t0, 3),
              **({"confirmed_ms": again} if again else {})}
    if ms[other] <= ms[here] * (1 + LAYOUT_SAMPLE_DECIDES_BEYOND):
        return {"sample": sample}
    return {"choice": what, "timed_ms": dict(ms), "won": here, "load_s": 0.0, "timed_s": sample["timed_s"],
            "sample": sample, "decided_on_sample": True,
            "timed": f"on a window of {len(s.names)} of the plan's {s.of} engines, consecutive in its launch order on "
                     f"its streams ({plural(s.boundaries, 'internal boundary', 'internal boundaries')}): "
                     f"contiguous boundaries slower by more than {LAYOUT_SAMPLE_DECIDES_BEYOND:.0%}"}


#: the "streams" round is decided for the plan without compiling its rival when the plan runs faster than its own
#: engines on one stream (``same_engines_on_one_stream``: nothing to compile) by more than this share.  The rival
#: the round races, the graph as one stream of its own engines (one for the whole model, or one per repeated
#: block), is a compile of the whole model: NASNet-A Large on the H200, 895 nodes in one worker for ~75 s, the
#: end of its build's search.  That one engine ran 0.87x (NASNet-A Large) to 1.7x (GoogLeNet; Inception-v3
#: 1.37x, Inception-v4 1.44x) of the plan's own engines on one stream (H100 and H200), where the plans led those
#: engines by 1.38x to 2.0x; beyond 25% the whole-model engine would have to run under 0.80x of them to win,
#: below the fastest seen (0.87x).  At 40% Inception-v4's plan, 38% ahead in one H200 build, waited for that
#: compile: 29 s started 34 s into the search, which ended at 62 s when it was raced (1.531 ms against the
#: plan's 0.753).  Closer, the rival is compiled then and raced as before
STREAMS_DECIDED_BEYOND = 0.25


@dataclass
class StreamsRival:
    """The "streams" round of a plan before its rival is compiled: timed first against the plan's own engines on
    one stream (``streams_against_own_engines``); ``full``, the graph on one stream (``one_stream_form``), is
    compiled only when that does not decide it."""

    full: Variant


#: what ``streams_against_own_engines`` times the plan against, in report.json's rounds
SERIAL_LABEL = "the same engines on one stream"


def same_engines_on_one_stream(la):
    """A launcher of ``la``'s engines (shared, nothing loaded or compiled again) with every branch on one stream in
    launch order: what ``parastream bench`` compares a plan against."""
    from parastream.launcher.gpu import GpuLauncher

    return GpuLauncher(la.bundle, single_stream=True, engines=la.engines, device=la.device,
                       internal_nhwc=bool(la.nhwc))


def streams_against_own_engines(current, plan, *, runs: int, warmup: int = 10, lock: bool = True) -> dict:
    """``current`` (a launcher of ``plan``, several streams) timed against its own engines on one stream in
    alternating blocks: {"timed_ms": {the plan, "the same engines on one stream"}, "timed_s", "decided"}, where
    ``decided`` says the plan led by more than ``STREAMS_DECIDED_BEYOND`` (the round is then the plan's).  A
    timing that fails gives {"error", "decided": False}: the round then races the compiled rival instead."""
    from .bench import measure as time_replays

    t0 = time.perf_counter()
    try:
        serial = same_engines_on_one_stream(current)
        try:
            times = time_replays({"plan": current, "serial": serial}, runs=runs, warmup=warmup, lock=lock)
        finally:
            serial.close()
    except Exception as e:  # noqa: BLE001 - said in the round; the compiled rival decides it
        return {"error": f"{type(e).__name__}: {e}", "decided": False}
    plan_ms, serial_ms = float(np.median(times["plan"])), float(np.median(times["serial"]))
    return {"timed_ms": {round_labels("streams", plan)[0]: plan_ms, SERIAL_LABEL: serial_ms},
            "timed_s": round(time.perf_counter() - t0, 3),
            "decided": serial_ms > plan_ms * (1 + STREAMS_DECIDED_BEYOND)}


def streams_round_decided(serial: dict, plan) -> dict:
    """The "streams" round decided for ``plan`` by its lead over its own engines on one stream (``serial``,
    ``streams_against_own_engines``): the round as ``race`` writes one, the rival's time being those engines'."""
    keys = round_labels("streams", plan)
    t = serial["timed_ms"]
    return {"choice": "streams", "timed_ms": {keys[0]: t[keys[0]], keys[1]: t[SERIAL_LABEL]}, "won": keys[0],
            "load_s": 0.0, "timed_s": serial["timed_s"], "rival": SERIAL_LABEL,
            "timed": f"against {SERIAL_LABEL} (nothing compiled): the plan faster by "
                     f"{t[SERIAL_LABEL] / t[keys[0]] - 1:.0%}, more than {STREAMS_DECIDED_BEYOND:.0%}"}


def conv_kernel_rounds(backend, options, model: onnx.ModelProto) -> list[tuple[str, str]]:
    """The rounds of ``DEPTHWISE_ROUNDS`` that race ``model`` (what, ``conv_kernels``): ``conv_kernels`` left to
    timing ("auto"), a backend whose engines they change, and a convolution for each to change (a depthwise one
    for the first two, a depthwise or narrow-group one for the Triton kernel's).  The first races cuDNN's calls
    against Inductor's kernels, the second the winner against torch's own kernel, the third the winner against
    parastream's Triton kernel."""
    from parastream.launcher.engines.onnx_torch import conv_kernels_change

    if options.conv_kernels != "auto" or not backend.lowers_convolutions:
        return []
    return [(what, k) for what, k in DEPTHWISE_ROUNDS if conv_kernels_change(model, k)]


def runs_gemm_epilogue(backend) -> bool:
    """Whether ``backend``'s engines run matmul-bias-activation nodes as one kernel or as their plain ops
    (``fuse_gemm_epilogue``): the backends the rule that makes them is for."""
    from parastream.rewrite.rules.fuse_gemm_epilogue import FuseGemmEpilogue

    return backend.name in FuseGemmEpilogue.backends


def fusions_off_forms(backend, v: Variant, rewritten_only: bool = False) -> list[tuple[str, Variant]]:
    """``v`` with each kind of fused node it holds (attention, GEMM epilogue) run as its plain ops instead, where
    ``backend`` runs that kind fused and ``v`` does: (the kind, the variant).  ``rewritten_only``: only kinds of
    node a rewrite makes (a search's candidate timed with its fusions off, ``_with_fusions_off``), not a Linear
    of one row, which the input has as much as any candidate: the build's round decides it for either, and
    timing a candidate without it cost a compile, a load and a timing in the search for no decision."""
    kinds = (("attention", runs_fused_attention, has_fused_attention),
             ("GEMM epilogue", runs_gemm_epilogue, has_fused_gemm if rewritten_only else has_gemm_epilogue))
    return [(what, round_alternative(v, what)) for what, runs, has in kinds
            if getattr(v.options, ROUND_OPTION[what][0]) and runs(backend) and has(v.model)]


def plan_signature(plan) -> tuple:
    """What makes two plans load the same engines in the same order on the same streams (not the cost model's
    per-branch estimates)."""
    return (plan.backend, plan.precision, plan.num_streams,
            tuple((b.name, b.stream, tuple(b.nodes), tuple(b.inputs), tuple(b.outputs), tuple(b.waits), b.concat_axis)
                  for b in plan.branches),
            tuple(sorted((n, str(t)) for n, t in plan.tensors.items())))


def compiled_for_other_choices(backend, fused: bool, measured: dict, attention: bool = True,
                               gemm_epilogue: bool = True, conv_kernels: str = "cudnn") -> bool:
    """Whether the engines just written were compiled (torch packages) for a fusion or boundary layout that the
    measurement did not choose (``fused``, ``attention``, ``gemm_epilogue``: the conv+ReLU, attention and GEMM
    epilogue fusions they were compiled with): they are compiled again for the choice, so that what ships is
    what loads."""
    return backend.compiles_for_layout and (measured["fuse_conv_relu"] != fused or not measured["internal_nhwc"]
                                            or measured.get("fuse_attention", attention) != attention
                                            or measured.get("fuse_gemm_epilogue", gemm_epilogue) != gemm_epilogue
                                            or measured.get("conv_kernels", conv_kernels) != conv_kernels)


def _infer(model: onnx.ModelProto) -> onnx.ModelProto:
    from parastream.rewrite.ir import infer

    return infer(model, strict=True)


def _shapes_known(model: onnx.ModelProto) -> bool:
    """Every node output has a static shape in ``model`` (value_info or a graph output): inferred already."""
    known = {v.name for v in list(model.graph.value_info) + list(model.graph.output)
             if v.type.tensor_type.HasField("shape") and all(d.HasField("dim_value") for d in v.type.tensor_type.shape.dim)}
    return all(o in known for n in model.graph.node for o in n.output if o)


def _internal_nhwc(backend, plan) -> bool:
    """Whether ``plan`` has channels-last internal boundaries for ``backend`` whose memory differs from the
    contiguous layout's: else the boundary-layout round races engines that read and write the same bytes.  A
    one-engine plan has none; a boundary of one channel, or of 1x1 pixels, is the same bytes in either layout
    (BERT-base's only 4-d boundary is its attention mask, [1, 1, 128, 128]: the round compiled every block
    again, and its 0.04% "win" for contiguous boundaries compiled them once more for the bundle)."""
    return _nhwc_boundaries(backend, plan) > 0


def one_stream_form(engines: EngineMaker, v: Variant) -> Variant:
    """``v`` with its graph on one stream (the "streams" round's rival): one engine for the whole model, or one
    per repeated block where the build cuts one-stream plans so (``Engines.blocks``)."""
    return replace(v, plan=engines.one_stream_plan(v.graph, v.plan))


def cut_in_blocks(plan) -> bool:
    """Whether ``plan`` is one stream of several engines: a one-stream schedule is one engine unless the build
    cut it into repeated blocks (``core.blocks``)."""
    return plan.num_streams == 1 and len(plan.branches) > 1


#: a plan cut into repeated blocks whose distinct code is at most this share of its nodes ships the blocks
#: without racing one engine for the whole model: its rival is a compile of the whole model (ViT-B/16 and BERT-base
#: on the H100: 30-45 s, most of a build's search waited 14-20 s for it), and at such shares the cut lost nothing
#: (ViT-B/16, 10% compiled: blocks 0.776 against 0.799 ms whole; BERT-base: 0.601 against 0.606 ms).  ResNet-50's
#: cut (53% compiled, not cut by default) was 4% slower.
WHOLE_ENGINE_RACED_ABOVE = 0.25


def _blocks_share(v: Variant) -> float:
    """The share of ``v``'s nodes that its plan's engines per repeated block compile (``core.blocks``)."""
    from parastream.core.blocks import compiled_share

    by_name = {n.name: n for n in v.graph.nodes}
    return compiled_share([by_name[name] for b in v.plan.branches for name in b.nodes])


def cut_at_head_only(v: Variant) -> bool:
    """Whether ``v``'s plan is one stream of two engines, the body and its head (``core.blocks.head_start``,
    ``--head-engine``)."""
    from parastream.core.blocks import ends_in_head

    if v.plan.num_streams != 1 or len(v.plan.branches) != 2:
        return False
    by_name = {n.name: n for n in v.graph.nodes}
    return ends_in_head([[by_name[name] for name in b.nodes] for b in v.plan.branches])


def races_whole_engine(v: Variant) -> bool:
    """Whether the "engine blocks" round races ``v``'s plan (cut into blocks) against one engine for the whole
    model: where the blocks' distinct code is over ``WHOLE_ENGINE_RACED_ABOVE`` of the nodes, and not where the
    only cut is before the head (``--head-engine``: the cut is for the rounds' compiles, which a whole-model rival
    would add back)."""
    return cut_in_blocks(v.plan) and not cut_at_head_only(v) and _blocks_share(v) > WHOLE_ENGINE_RACED_ABOVE


def blocks_not_raced(v: Variant) -> dict | None:
    """The "engine blocks" round of ``v``'s plan where it is cut into blocks and not raced (``races_whole_engine``),
    as a round a rewritten plan carries (``carried_rounds``: ``CARRIED_ALWAYS``); None otherwise.

    Why: the input's cut is judged by its repeated structure, which a rewrite changes alike in every block; but
    a candidate's share can cross the threshold where the input's did not, because the rewrite shrank the blocks
    more than the code that does not repeat, or the search rewrote one block's piece differently from the rest
    (BERT-base, H200: the input's blocks compile 21% of its nodes, the kept candidate's ~32%, and its round
    waited 24 s for a whole-model compile that ran 0.4% faster than the blocks, within the 2% they are kept by)."""
    if not cut_in_blocks(v.plan) or races_whole_engine(v):
        return None
    if cut_at_head_only(v):
        return {"choice": "engine blocks", "won": "the body and its head, an engine each",
                "not_raced": "cut before its head only (--head-engine)"}
    return {"choice": "engine blocks", "won": round_labels("engine blocks", v.plan)[0],
            "not_raced": f"its blocks compile {_blocks_share(v):.0%} of its nodes; raced above "
                         f"{WHOLE_ENGINE_RACED_ABOVE:.0%}"}


def gemm_decided_first(plan) -> bool:
    """Whether a plan's sampled "GEMM epilogue" round is decided before its other rounds' rivals are queued
    (``GpuMeasurer._gemm_sample_first``): a plan of one engine, which the round's form changes for every later
    rival.  In a plan of several engines the head's is one engine of many, and the other rounds' rivals are the
    same compiles for either form (cache keys per engine)."""
    return len(plan.branches) == 1


def gemm_round_first(engines: EngineMaker, v: Variant, *, runs: int, warmup: int = 10,
                     lock: bool = True) -> dict | None:
    """``v``'s "GEMM epilogue" round decided first on its sample (``gemm_sample_round`` without the plan's time),
    its two one-node engines compiled now: for a build whose search timed none of the input's rounds (nothing to
    rank), before the engines stage queues the later rounds' rivals, as ``GpuMeasurer._gemm_sample_first`` does
    where the search measures (the same why).  None where the round is not decided first (``gemm_decided_first``)
    or has no sample; raises what compiling, loading or timing the sample raised."""
    backend = engines.backend
    if not (v.options.fuse_gemm_epilogue and runs_gemm_epilogue(backend) and has_gemm_epilogue(v.model)
            and gemm_decided_first(v.plan)):
        return None
    s = gemm_sample(engines, v, round_alternative(v, "GEMM epilogue"))
    return None if s is None else gemm_sample_first_round(engines, s, v.plan, runs=runs, warmup=warmup, lock=lock,
                                                          order="now")


def gemm_sample_first_round(engines: EngineMaker, s: GemmSample, plan, *, runs: int, warmup: int = 10,
                            lock: bool = True, order: str = "now") -> dict:
    """The "GEMM epilogue" round decided first on sample ``s``: its two one-node engines queued to compile
    (``order``) and timed as they come in (``gemm_sample_round`` without the plan's time), the round marked
    ``decided_first``.  Raises what compiling, loading or timing the sample raised."""
    engines.precompile(s.variants(), background=True, cancellable=False, order=order, label="the rounds' samples")
    return dict(gemm_sample_round(engines, s, plan, None, runs=runs, warmup=warmup, lock=lock), decided_first=True)


def decided_form(v: Variant, rounds: list[dict]) -> Variant:
    """``v`` with the build options ``rounds`` (decided already) chose applied where a fusion or kernel round went
    to its alternative: the form the rounds still to race race (``time_alternatives`` applies each winner as it
    goes), and so the form whose rivals the build compiles for them.  The boundary layout is left as it is: the
    rounds after it (streams, engine blocks) race rivals with channels-last boundaries whatever it chose, and the
    plan's rounds change no later round's form."""
    out = v
    for r in rounds:
        what = r.get("choice")
        if what in ROUND_OPTION and r.get("won") == round_labels(what, v.plan)[1]:
            out = round_alternative(out, what)
    return out


def whole_engine_form(engines: EngineMaker, v: Variant) -> Variant:
    """``v`` with its graph as one engine for the whole model (the "engine blocks" round's rival)."""
    return replace(v, plan=engines.whole_engine_plan(v.graph, v.plan))


def alternative_variants(engines: EngineMaker, v: Variant) -> list[tuple[str, Variant]]:
    """The engines ``time_alternatives`` will load besides ``v``'s own, by round, guessed before it runs: the
    first round's choice is unknown, so the later rounds are taken with the fusion as it is (a choice that goes
    the other way compiles its engines then)."""
    out = fusions_off_forms(engines.backend, v)
    out += [(what, round_alternative(v, what)) for what, _ in conv_kernel_rounds(engines.backend, v.options, v.model)]
    if (v.options.fuse_conv_relu and engines.backend.fuses_conv_relu and has_conv_relu(v.model)
            and "conv+ReLU" not in decided_first(engines)):
        out.append(("conv+ReLU", round_alternative(v, "conv+ReLU")))
    if _internal_nhwc(engines.backend, v.plan):  # else both layouts are the same engines (``time_alternatives``)
        out.append(("boundary layout", replace(v, internal_nhwc=False)))
    if v.plan.num_streams > 1:
        out.append(("streams", one_stream_form(engines, v)))
    if races_whole_engine(v):
        out.append(("engine blocks", whole_engine_form(engines, v)))
    return out


def speculative_variants(engines: EngineMaker, v: Variant, decided: set | frozenset = frozenset()) -> list[Variant]:
    """For a plan on one stream: each later round's alternative as it would be raced if an earlier round's
    alternative won (``time_alternatives`` races the winner), compiled in the same batch as the others.  A
    one-stream plan is one compile job per variant, or one per distinct repeated block (``core.blocks``), so the
    compile workers are otherwise idle while the build
    waits for its longest job: queued up front, the second-level alternative compiles beside the first instead
    of after it (MixNet-S, H100: Inductor's depthwise kernels won the first round, and the conv+ReLU round then
    waited 73 s for its alternative of that winner).  The rounds of ``decided`` (carried from the input) are
    not raced, so no alternative is compiled for them."""
    return [alt for _, alts in speculative_by_round(engines, v, decided) for alt in alts]


def speculative_by_round(engines: EngineMaker, v: Variant,
                         decided: set | frozenset = frozenset()) -> list[tuple[str, list[Variant]]]:
    """``speculative_variants`` by the round whose alternative winning makes them the ones raced next."""
    if v.plan.num_streams != 1:
        return []
    named = [(what, a) for what, a in alternative_variants(engines, v) if what not in decided]
    out = []
    for i, (what, first) in enumerate(named):
        if what in ("boundary layout", "streams", "engine blocks"):  # a layout or plan changes no later round's engines
            continue
        later = {w for w, _ in named[i + 1:]}
        alts = [alt for w, alt in alternative_variants(engines, first) if w in later]
        if alts:
            out.append((what, alts))
    return out


class QueuedRivals:
    """The rivals ``time_alternatives`` races, compiled in the background as it goes rather than in one batch
    that the build waits for before its first round.  Each round waits for its own rival only (a launcher of a
    variant whose engines compile in the background waits for them); once a round is decided, what it made
    moot is dropped from the queue (``drop``: the rivals of the form it did not keep), and where the alternative
    won, the later rounds' rivals of that form, queued as spare work (``speculative_by_round``), are hastened
    and the level after them queued as spare in their place: the build always compiles one round ahead.

    Why: MixNet-S's one-engine build (H200, 16 cores) waited 118 s for such a batch, then 50 s for the conv+ReLU
    round's rival of the two rounds that had flipped before it.  That batch's depthwise rivals were queued only
    when the search ended, behind the alternatives it waited for first, and the third-level rival only when the
    round before it flipped."""

    def __init__(self, engines: EngineMaker):
        self.engines = engines
        self.backend = engines.backend
        self.rivals: dict[str, list[str]] = {}  # round -> its rival's cache keys, of the form kept so far
        self.if_flipped: dict[str, list[str]] = {}  # round -> the later rounds' rivals should its alternative win
        self.queued: dict | None = None  # what the first ``queue`` call queued (the build's report)
        self.window: LayoutSample | None = None  # the "boundary layout" round's window, of the form queued last

    def _queue(self, variants: list[Variant], order: str, label: str) -> list[list[str]] | None:
        got = self.engines.precompile(variants, background=True, cancellable=False, order=order, label=label)
        if self.queued is None and got is not None:
            self.queued = {k: x for k, x in got.items() if k != "keys"}
        return (got or {}).get("keys")

    def queue(self, v: Variant, decided: set | frozenset = frozenset(), rivals: list[tuple[str, Variant]] | None = None,
              speculative: list[tuple[str, list[Variant]]] | None = None) -> None:
        """Queue the rivals of the rounds not ``decided`` yet, as ``v`` (the form kept so far) races them
        (``rivals``: given, else ``alternative_variants``), and the rivals of the rounds after each should it
        flip, as spare work (``speculative``: given, else ``speculative_by_round``); drop what was queued before
        and is neither."""
        if rivals is None:
            rivals = [(what, a) for what, a in alternative_variants(self.engines, v) if what not in decided]
        if speculative is None:
            speculative = speculative_by_round(self.engines, v, decided)
        before = {k for ks in (*self.rivals.values(), *self.if_flipped.values()) for k in ks}
        # a plan of many engines races its "boundary layout" round on a window first (``layout_sample``): the
        # window's two forms are queued with the rivals, the whole plan's rival as spare work
        self.window = next((w for what, a in rivals if what == "boundary layout"
                            for w in [layout_sample(self.engines, v, a)] if w is not None), None)
        plain = [(what, a) for what, a in rivals if self.window is None or what != "boundary layout"]
        batch = [a for _, a in plain] + (self.window.variants() if self.window is not None else [])
        keys = self._queue(batch, "auto", "the plan's alternatives") if batch else []
        self.rivals = {what: ks for (what, _), ks in zip(plain, keys or [])}
        self.backend.hasten([k for ks in self.rivals.values() for k in ks])  # queued as spare before: needed now
        if self.window is not None:  # (``decided`` drops it with the round's rival where the window decides)
            self.rivals["boundary layout"] = self.window.queue_rival(self.engines)
        self.if_flipped = {}
        for what, alts in speculative:
            got = self._queue(alts, "spare", "alternatives of alternatives")
            if got is not None:
                self.if_flipped[what] = [k for ks in got for k in ks]
        now = {k for ks in (*self.rivals.values(), *self.if_flipped.values()) for k in ks}
        self.backend.drop(sorted(before - now))

    def decided(self, what: str, flipped: bool, v: Variant, decided: set) -> None:
        """Round ``what`` is decided (``flipped``: its alternative won, and ``v`` is the form the later rounds now
        race); ``decided``: every round decided so far, this one included.  Kept, the round's own rival is
        dropped too where it has not started (a round decided on a sample never loads it: ``GemmSample``)."""
        rival = self.rivals.pop(what, None) or []
        if flipped and what not in ("streams", "engine blocks"):  # (a plan's rounds come last: nothing races after)
            self.queue(v, decided)
        else:
            self.backend.drop([*rival, *self.if_flipped.pop(what, [])])

    def close(self) -> None:
        """Every round is decided: what is still queued is dropped."""
        self.backend.drop([k for ks in (*self.rivals.values(), *self.if_flipped.values()) for k in ks])
        self.rivals, self.if_flipped = {}, {}


def gpu_present(backend) -> bool:
    """Whether ``backend`` has GPU engines and a GPU is here to time them on."""
    if not backend.gpu:
        return False
    from parastream.launcher import cuda_device_count

    return cuda_device_count() > 0


#: a fused convolution shape is left to Inductor's form where cuDNN's fused call alone runs slower than torch's
#: convolution and the eager epilogue after it by more than this (``time_conv_shapes``); at most this many shapes
#: are timed, the most frequent first, and none started after ``CONV_SHAPES_SECONDS`` (each shape's first calls
#: build cuDNN's plans for both forms: ~70 ms a shape on the H200, bench/conv_epilogues.py's ten models)
CONV_SHAPE_MARGIN = 0.05
CONV_SHAPES_AT_MOST = 64
CONV_SHAPES_SECONDS = 5.0


def time_conv_shape(key: str, batch: int, dtype, reps: int = 10, replays: int = 20,
                    planned: bool = True) -> tuple[float, ...]:
    """Microseconds per call of the fused operator for ``key`` (``cudnn_fused.conv_key``) at ``batch`` in
    ``dtype``, and of torch's convolution without its bias followed by the epilogue as eager ops (bias, residual,
    ReLU: two or three kernels where Inductor's form runs one, so that this favours the fused call), each timed
    by ``bench.captured_us`` on the current GPU with random channels-last inputs.  A depthwise key
    (``cudnn_fused.is_depthwise_key``) is timed in the forms the converter writes for it: with ``planned``
    (``BuildOptions.cudnn_plans``) its plan with the bias and ReLU in it against its plan alone and the
    epilogue.  A key whose channels the converter can pad (``cudnn_fused.padded_channels``) gets a third time:
    the fused operator on the padded weights, after a copy of the input into its padded form (a kernel of its own
    here; in an engine the kernel producing the input writes it so where Inductor compiles that one)."""
    import torch

    from parastream.launcher.engines.cudnn_fused import (is_depthwise_key, padded_channels, padded_conv_weights,
                                                         parse_key, register_ops)

    from .bench import captured_us

    kind, x_shape, w_shape, strides, padding, dilations, group = parse_key(key)
    register_ops()
    cl = torch.channels_last
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn([batch, *x_shape], device="cuda", dtype=dtype, generator=gen).contiguous(memory_format=cl)
    fan_in = max(1, w_shape[1] * w_shape[2] * w_shape[3])
    w = (torch.randn(w_shape, device="cuda", dtype=dtype, generator=gen) / fan_in ** 0.5).contiguous(memory_format=cl)
    b = torch.randn(w_shape[0], device="cuda", dtype=dtype, generator=gen)
    bias = b.view(1, -1, 1, 1)
    with torch.no_grad():
        z = torch.convolution(x, w, None, strides, padding, dilations, False, [0, 0], group)
        z = torch.randn_like(z).contiguous(memory_format=cl)

        def conv():
            return torch.convolution(x, w, None, strides, padding, dilations, False, [0, 0], group)

        if kind == "relu" and planned and is_depthwise_key(key):
            from parastream.launcher.engines import cudnn_plans

            def plan(bias_, relu):
                return cudnn_plans.conv2d(x, w, bias_, strides, padding, dilations, group, relu)

            forms = (lambda: plan(b, True), lambda: plan(None, False).add_(bias).relu_())
        elif kind == "relu":
            forms = (lambda: torch.ops.parastream.conv2d_relu(x, w, b, strides, padding, dilations, group),
                     lambda: conv().add_(bias).relu_())
        else:
            forms = (lambda: torch.ops.parastream.conv2d_add_relu(x, w, z, b, strides, padding, dilations, group),
                     lambda: conv().add_(z).add_(bias).relu_())
        wide = padded_channels(key)
        if wide is not None:
            cp, kp = wide
            c, k = w_shape[1], w_shape[0]
            xp = x.new_zeros([batch, cp, *x_shape[1:]]).contiguous(memory_format=cl)
            wp, bp = padded_conv_weights(w, b, cp, kp)

            def padded():
                xp[:, :c].copy_(x)
                return torch.ops.parastream.conv2d_relu(xp, wp, bp, strides, padding, dilations, group)[:, :k]

            forms = (*forms, padded)
        return tuple(captured_us(f, reps, replays) for f in forms)


def time_conv_shapes(model: onnx.ModelProto, options: BuildOptions, *, lock: bool = True) -> dict | None:
    """Each convolution shape the conv+ReLU fusion takes in ``model`` (``cudnn_fused.fused_conv_keys``) timed
    alone on the GPU, fused against unfused (``time_conv_shape``), and those whose fused call is slower by
    more than ``CONV_SHAPE_MARGIN`` listed for ``BuildOptions.conv_relu_unfused``, but those whose fused call on
    padded channels (``cudnn_fused.padded_channels``) is faster than both forms by that margin, which are listed
    for ``BuildOptions.conv_channels_padded`` instead ("padded").  Why per shape: the conv+ReLU
    round decides for every convolution of the plan at once, and one model's shapes can disagree (H200,
    Res2Net-50: four of its 24 shapes 0.34-0.93x fused, the rest 1.1-1.4x, so that the round kept Inductor's form
    for all of them; bench/conv_epilogues.py).  The round then races this mix against Inductor's form.  None where
    the model has no such convolution or its precision is not one the fusion runs in.  {"shapes", "timed",
    "unfused", "us": {key: [fused, unfused]}, "s"}, and "plan_shapes" where the model has convolutions whose
    epilogue the fusion runs as a cuDNN plan (``cudnn_fused.PLANNED_KINDS``: SiLU, a residual Add without ReLU):
    those are not timed here (their eager rival is not what Inductor runs, and the whole plan races them:
    ``conv_relu_decided_on_shapes``).  Timed, EfficientNet-B0's build spent this step's 5 s on 11 of its 27
    SiLU shapes, building their runtime-compiled plans one by one, and listed none (H200).  Depthwise shapes are
    left out where ``BuildOptions.conv_kernels`` asks for a form that is not cuDNN's (no fusion takes them)."""
    from parastream.launcher.engines.base import LOWERED_CONV_KERNELS
    from parastream.launcher.engines.cudnn_fused import PLANNED_KINDS, fused_conv_keys, is_depthwise_key

    dtype_name = {"fp16": "float16", "fp32": "float32"}.get(options.precision)
    if dtype_name is None:
        return None
    keys = fused_conv_keys(model)
    planned = sum(k.split("|")[0] in PLANNED_KINDS for k in keys)
    lowered = options.conv_kernels in LOWERED_CONV_KERNELS
    keys = {k: n for k, n in keys.items()
            if k.split("|")[0] not in PLANNED_KINDS and not (lowered and is_depthwise_key(k))}
    if not keys:
        return None
    import torch

    from .bench import gpu_timing_lock

    batch = next((d.dim_value for vi in model.graph.input for d in vi.type.tensor_type.shape.dim[:1]
                  if d.HasField("dim_value")), 1) or 1
    t0 = time.perf_counter()
    chosen = sorted(keys, key=lambda k: (-keys[k], k))[:CONV_SHAPES_AT_MOST]
    us: dict[str, list[float]] = {}
    device = torch.cuda.current_device()
    with gpu_timing_lock(device, enabled=lock):
        for key in chosen:
            if time.perf_counter() - t0 > CONV_SHAPES_SECONDS:
                break
            got = time_conv_shape(key, batch, getattr(torch, dtype_name), planned=options.cudnn_plans)
            us[key] = [round(float(t), 3) for t in got]
    padded = sorted(k for k, t in us.items() if len(t) > 2 and t[2] * (1 + CONV_SHAPE_MARGIN) < min(t[0], t[1]))
    return {"shapes": len(keys), "timed": len(us),
            "unfused": sorted(k for k, t in us.items() if t[0] > t[1] * (1 + CONV_SHAPE_MARGIN) and k not in padded),
            **({"padded": padded} if padded else {}),
            "us": us, "counts": {k: keys[k] for k in us}, "s": round(time.perf_counter() - t0, 3),
            **({"plan_shapes": planned} if planned else {})}


#: the conv+ReLU round is taken for the fused form on the shapes timed alone (``time_conv_shapes``), its whole
#: plan's rival never compiled, where every shape of the model was timed, none was listed slower fused, and the
#: fused calls, each shape counted as often as the model has it, take at least this share less time than the
#: convolutions and their epilogues.  Why: on a one-engine plan that rival is a whole-model compile the round
#: waits for (RegNetY-400MF, H200: 32 s of a 48 s build), and on the nine of ten corpus models whose shapes all
#: ran faster fused, by 20-32% of their time, the whole-model round kept the fused form every time, by 5.7-31%
#: (bench/NOTES.md, "Open questions"); Res2Net-50, whose shapes disagree, still races the whole plan
CONV_SHAPES_DECIDE_BEYOND = 0.15


def conv_relu_decided_on_shapes(conv_shapes: dict | None) -> dict | None:
    """The conv+ReLU round decided on ``conv_shapes`` (``time_conv_shapes``' result, or a build's record of it)
    alone, as ``time_alternatives`` takes a round timed already, or None where it is the whole plan's to decide
    (``CONV_SHAPES_DECIDE_BEYOND``; a result without counts, an older record's, decides nothing)."""
    if not isinstance(conv_shapes, dict) or "error" in conv_shapes or conv_shapes.get("unfused"):
        return None
    us, counts = conv_shapes.get("us"), conv_shapes.get("counts")
    if conv_shapes.get("plan_shapes"):  # (not timed alone: the whole plan races the plans' fusions)
        return None
    padded = conv_shapes.get("padded") or []
    if not isinstance(padded, list):  # a malformed record: the whole plan decides
        return None
    try:
        if not us or conv_shapes.get("timed") != conv_shapes.get("shapes") or set(us) != set(counts):
            return None
        # (a shape run padded counts at its padded time: the fused form the converter writes for it)
        fused = sum(int(counts[k]) * float(us[k][2] if k in padded else us[k][0]) for k in us)
        unfused = sum(int(counts[k]) * float(us[k][1]) for k in us)
    except (TypeError, ValueError, IndexError, KeyError):  # a malformed record: the whole plan decides
        return None
    if not unfused > 0 or 1.0 - fused / unfused < CONV_SHAPES_DECIDE_BEYOND:
        return None
    saves = 1.0 - fused / unfused
    convs = sum(int(counts[k]) for k in us)
    return {"choice": "conv+ReLU", "won": round_labels("conv+ReLU", None)[0],
            "decided_on_shapes": {"shapes": len(us), "convolutions": convs, "fused_us": round(fused, 3),
                                  "unfused_us": round(unfused, 3), "saves": round(saves, 4)},
            "timed": f"on its {len(us)} convolution shapes alone, before anything compiled: fused, the {convs} "
                     f"convolutions take {saves:.0%} less time; the whole plan's rival not compiled"}


def decided_first(engines) -> dict:
    """The rounds the build decided before anything compiled, by name (``Engines.decided_first``): their rivals
    are not compiled, and ``time_alternatives`` takes them as timed already."""
    return getattr(engines, "decided_first", None) or {}


#: how much slower than its usual median the reference may run in a candidate's blocks before the timing is taken
#: again (``GpuMeasurer._against_reference``), and how many times it is; two loads of one plan differ by up to
#: ~5%, one loaded plan's medians of 100 replays by ~1%
REFERENCE_DRIFT = 0.05
REFERENCE_RETRIES = 2


def timed_while_drifted(time_once, reference: str, seen: list[float] | None) -> list[dict]:
    """``time_once()`` ({runner: times}) taken again, up to ``REFERENCE_RETRIES`` times, while its ``reference``
    runner ran more than ``REFERENCE_DRIFT`` slower than the median of ``seen`` (every median that runner has run;
    each try's is added); every try's times, the last the one to go by.  ``seen`` None: timed once.  The rule of a
    candidate's timing (``GpuMeasurer._against_reference``) and of an input's round (``race``)."""
    tries = []
    for _ in range(REFERENCE_RETRIES + 1):
        usual = float(np.median(seen)) if seen else float("inf")
        tries.append(time_once())
        if seen is None:
            break
        seen.append(float(np.median(tries[-1][reference])))
        if seen[-1] <= usual * (1.0 + REFERENCE_DRIFT):
            break
    return tries


def confirmed_round(time_once, medians: dict[str, float]) -> tuple[dict[str, float], list[dict[str, float]]]:
    """A round's medians (``medians``: label -> ms, one timing of each form) confirmed as the search confirms its
    fastest candidate (``search.confirm_fastest``), except that every form is timed each time (``time_once()``:
    {label: times}, the launchers in alternating blocks): while the fastest does not lead the next by
    ``CONFIRM_WITHIN``, the timing is taken again until every form's timings stand (``search.timings_stand``:
    two that agree, or three), and each form's time is then their median, the slower of two (the faster state
    only ever makes a timing faster).  Returns (those times, each timing taken again).

    Why: a launcher runs a whole timing now and then 7-12% faster than its usual, and one timing decided
    BERT-base's attention round for the decomposed form (H200: 0.4468 against the SDPA kernels' 0.4707 ms; its
    bundle then ran 0.493 beside torch.compile).  Confirmed in the next build, the two forms ran within 1.1% of
    each other in each of three timings, both launchers fast in two (0.436 / 0.432) and slow in one
    (0.470 / 0.478)."""
    import statistics

    seen = {k: [float(v)] for k, v in medians.items()}
    taken: list[dict[str, float]] = []
    while True:
        now = {k: float(statistics.median_high(v)) for k, v in seen.items()}
        ranked = sorted(now, key=now.get)
        if (all(timings_stand(v) for v in seen.values()) or len(ranked) < 2
                or now[ranked[1]] > now[ranked[0]] * (1.0 + CONFIRM_WITHIN)):
            return now, taken
        t = {k: float(np.median(x)) for k, x in time_once().items()}
        taken.append(t)
        for k, v in t.items():
            seen[k].append(v)


def race(rounds: list[dict], what: str, current, other, plan, *, runs: int, since: float, lock: bool = True,
         seen: list[float] | None = None, current_kernels: str | None = None) -> bool:
    """One round of ``time_alternatives``: ``current`` against ``other`` in alternating blocks of CUDA-event timed
    replays, the faster median kept (``decide_by_timing`` without a margin; a round of ``PREFER_ALTERNATIVE_WITHIN``
    keeps ``other`` unless it is slower by more than its share, ``alternative_kept_within`` given
    ``current_kernels``, the depthwise kernels ``current`` runs); the round goes into ``rounds`` (``load_s``: the
    seconds since ``since``, building and loading ``other``); True when ``other`` was kept.

    ``seen``: every median ``current`` has run before (the search's reference, ``GpuMeasurer.reference_seen``).
    A race in which ``current`` ran more than ``REFERENCE_DRIFT`` slower than the median of those is timed again,
    up to ``REFERENCE_RETRIES`` times, as a candidate's timing is: a launcher runs, now and then, a whole timing in
    a slower state, and a round raced then goes to the alternative for it (NASNet-A Large, H200: its reference
    1.869 ms in the GEMM-epilogue round against 1.55 in every other timing of the build, so Inductor's head "won"
    by 18%, and the build timed its later rounds again after the search, 10 s).  The round keeps each try's
    medians (``tries_ms``).  Two forms within ``CONFIRM_WITHIN`` of each other are then timed again
    (``confirmed_round``: a launcher's faster state, which no drift check sees in the form that is not the
    reference) and decided on their confirmed times (``confirmed_ms``: each timing taken again)."""
    from .bench import measure as time_replays

    keys = round_labels(what, plan)
    t0 = time.perf_counter()

    def time_once():
        return time_replays({keys[0]: current, keys[1]: other}, runs=runs, warmup=10, lock=lock)

    tries = timed_while_drifted(time_once, keys[0], seen)
    ms, again = confirmed_round(time_once, {k: float(np.median(v)) for k, v in tries[-1].items()})
    chosen, _ = decide_by_timing({k: np.array([v]) for k, v in ms.items()}, list(keys), floor=0.0, spread=False)
    within = alternative_kept_within(what, current_kernels)
    if within is not None and ms[keys[1]] <= ms[keys[0]] * (1 + within):
        chosen = keys[1]
    keep = PREFER_CURRENT_WITHIN.get(what)
    if keep is not None and ms[keys[0]] <= ms[keys[1]] * (1 + keep):
        chosen = keys[0]
    rounds.append({"choice": what, "timed_ms": ms, "won": chosen,
                   "load_s": round(t0 - since, 3), "timed_s": round(time.perf_counter() - t0, 3),
                   **({"alternative_kept_within": within} if within is not None else {}),
                   **({"current_kept_within": keep} if keep is not None else {}),
                   **({"tries_ms": [{k: round(float(np.median(v)), 4) for k, v in t.items()} for t in tries]}
                      if len(tries) > 1 else {}),
                   **({"confirmed_ms": [{k: round(v, 4) for k, v in t.items()} for t in again]} if again else {})})
    return chosen == keys[1]


def choices_as_built(backend, options: BuildOptions) -> dict:
    """The choices the rounds decide (``time_alternatives``' result but its rounds) as engines built with
    ``options`` by ``backend`` have them, before any round: what each round starts from."""
    return {"fuse_conv_relu": bool(options.fuse_conv_relu and backend.fuses_conv_relu), "internal_nhwc": True,
            "one_engine": False, "whole_engine": False,
            "fuse_attention": bool(options.fuse_attention and runs_fused_attention(backend)),
            "fuse_gemm_epilogue": bool(options.fuse_gemm_epilogue and runs_gemm_epilogue(backend)),
            "conv_kernels": conv_kernels_used(options.conv_kernels)}


def tuned_level(backend, level: int) -> int | None:
    """The ``--opt-level`` a GPU build races last (``kernel_tuning_round``): ``level``, where ``backend`` tunes its
    kernels on the device at that level (``tunes_kernels_from``); None where it does not."""
    start = getattr(backend, "tunes_kernels_from", None)
    return level if start is not None and level >= start else None


def rounds_level(backend, level: int) -> int:
    """The ``--opt-level`` a GPU build compiles its search's candidates and its rounds' rivals at: below where
    ``backend`` tunes its kernels.  Why: a tuning compile takes several times as long, and a build makes ten or
    more of them (EfficientNet-B0 on the H200: a build at level 4, every compile tuned, had not ended after three
    minutes where level 3 builds it in about 30 s); the level asked for is then raced once, last."""
    return level if tuned_level(backend, level) is None else backend.tunes_kernels_from - 1


def kernel_tuning_round(engines: EngineMaker, v: Variant, level: int, *, runs: int,
                        lock: bool = True) -> tuple[dict, bool]:
    """The "kernel tuning" round: ``v`` (the plan and engine options the build's other rounds chose, compiled at
    ``rounds_level``) against the same engines compiled at ``level``, their kernels tuned on the device (torch:
    Inductor's coordinate descent at 4, max-autotune at 5), raced as any round (``race``).  Why raced rather than
    taken: a kernel is tuned alone, in a compile worker beside other workers' tuning, and need not be faster where
    it runs, in the plan's CUDA Graph; a build ships no plan slower than one it could have built.  Returns (the
    round, with the ``level`` raced; whether the tuned form won)."""
    tuned = replace(v, options=replace(v.options, optimization_level=level))
    rounds: list[dict] = []
    since = time.perf_counter()
    current = other = None
    try:
        current = engines.launcher(v)
        other = engines.launcher(tuned)
        won = race(rounds, TUNING_ROUND, current, other, v.plan, runs=runs, since=since, lock=lock)
    finally:
        for la in (other, current):
            if la is not None:
                la.close()
    return dict(rounds[0], level=level), won


@dataclass
class GpuMeasurer:
    """Times on the GPU what a build could ship, against a reference kept loaded.

    As the search's ``Measurer``: ``measure(model)`` schedules, builds and loads the candidate like a real bundle
    (engines in memory), replays its CUDA Graph and returns the median latency.  The first model measured (the
    search measures its input first) stays loaded as the reference; every later candidate is timed in
    alternating blocks with it, and its time is scaled by the reference's first median, so that clock changes
    between measurements do not decide.  The first two models (the input and the cost model's best candidate)
    are always measured, so that a slow load can never leave the decision without a rival; after those, once
    ``budget_s`` is spent, further candidates raise MeasureBudgetSpent (the search decides among those measured),
    unless an input's round is still compiling its rival, which the search's end waits for anyway
    (``_rounds_compiling``).
    The budget starts once the reference is timed and the input's rounds ready by then have been timed
    (``_streams_first``, ``time_ready``).  Before that the build compiles and loads its input, which it ships when no candidate wins, so that cost is the build's, not the search's (NASNet-A Large on the
    H100: its input's engines were compiled, loaded and timed 39 s after the measurer was made, which spent a
    20 s budget before any candidate; each candidate after it took ~2.4 s).
    The second, slower than the input as built, is timed again as one engine where its plan has streams
    (``_as_one_engine``; not where the input's streams round was decided against its own engines on one stream,
    ``_streams_decided_on_input``), and its faster form with each kind of fused node it holds as plain ops
    (``_with_fusions_off``): its fastest form is its time, and the form ``confirm`` times again.

    ``prepare(models)`` compiles the next candidates' engines in the background; with the input it queues the
    input's alternatives too (``alternative_variants``), timed against the reference as their engines come in
    (``time_ready``) so that ``alternatives_timed`` hands the build ``time_alternatives``' result for the input's
    plan.  ``close()`` frees the reference and cancels what no measurement needs any more."""

    engines: EngineMaker
    options: BuildOptions
    loaded: LoadedModel
    streams: int | None
    max_streams: int
    budget_s: float
    runs: int = 100
    warmup: int = 10
    lookahead: int = 4  # models prepared ahead of the one measured (their compiles overlap its measurement)
    margin: float = MEASURE_MARGIN  # what a candidate must beat the input by for the search to keep it
    log: list = field(default_factory=list)  # per model measured: when it started (s after this was made), its steps

    def __post_init__(self):
        self.backend = self.engines.backend
        self.t_made = time.perf_counter()
        self.deadline = float("inf")  # set once the reference is timed (the budget is the candidates')
        self.calls = 0  # models asked for so far (the first two are measured whatever the budget)
        self.reference = None  # (launcher, median ms) of the first model measured
        self.reference_seen: list[float] = []  # every median the reference has run (``_against_reference``)
        self.planned: list[tuple[onnx.ModelProto, Variant]] = []  # what ``prepare`` planned for ``measure`` to load
        self.adopted: list[tuple[onnx.ModelProto, gs.Graph]] = []  # the search's candidates with their graphs
        self.prepared: list[onnx.ModelProto] = []
        self.early: dict = {}  # the input's alternatives: its plan, the rounds timed, the rest (round, variant, keys)
        self._apart_seen: dict = {}  # ``_apart``'s answers, by (flipped round, round)
        self.alternatives_queued = False
        self.one_engine_won: list[tuple[onnx.ModelProto, dict]] = []  # (candidate, its times): ``_as_one_engine``
        self.input_streams = 0  # the streams of the input's plan, once it is prepared
        self.input_cut: dict | None = None  # the input's engine cut where it is not raced (``blocks_not_raced``)
        self.input_plan = None  # the input's plan (``rounds_timed``'s plan where no round of it was timed)
        self.best_ms = float("inf")  # the fastest candidate measured so far (``_queue_rounds_of``)
        self.timed_forms: list[tuple[onnx.ModelProto, Variant]] = []  # per candidate, the form its time is of
        # Held by ``measure`` except while the GPU times (``_time``): the search exports and prepares the
        # candidates ahead in a thread of its own under it (rewrite/search.py), so that their ~0.9 s of host work
        # each (NASNet-A Large, H200) runs beside a timing instead of between two measurements, never beside the
        # rest of one (a load, a plan, the rounds' bookkeeping: the state ``prepare`` changes too)
        self.host = threading.Lock()
        self._host_holder: int | None = None  # the thread whose ``measure`` holds ``host``

    @classmethod
    def for_build(cls, engines: EngineMaker, options: BuildOptions, loaded: LoadedModel, **kw) -> "GpuMeasurer | None":
        """A measurer, or None when the backend has no GPU engines or no GPU is present."""
        return cls(engines, options, loaded, **kw) if gpu_present(engines.backend) else None

    # -- the variants ------------------------------------------------------------------------------------------
    def variant_of(self, model: onnx.ModelProto) -> Variant:
        """``model`` scheduled and planned as the build would ship it (planned once, until it is measured)."""
        for m, v in self.planned:
            if m is model:
                return v
        if model is self.loaded.model:  # the search measures its input first: the loader's graph
            m, graph = model, self.loaded.graph
        else:
            graph = next((g for m, g in self.adopted if m is model), None)
            if graph is not None:  # the candidate's own graph, made the graph of its export by the search
                m = model
            else:  # the search's exports are shape-inferred and checked already (inferred here where they are not)
                m = model if _shapes_known(model) else _infer(model)
                graph = graph_of(m)
        v = Variant(m, graph, self.engines.plan(graph, self.streams, self.max_streams), self.options)
        self.planned.append((model, v))
        return v

    # -- the search's Measurer ---------------------------------------------------------------------------------
    def adopt(self, model: onnx.ModelProto, graph: gs.Graph) -> None:
        """``graph`` is ``model``'s (the search exported the candidate from it): ``variant_of`` plans it."""
        self.adopted.append((model, graph))

    def prepare(self, models: list[onnx.ModelProto]) -> dict | None:
        """Start compiling the engines of the next models the search will measure, on every compile worker in the
        background: a candidate is measured as soon as its own engines are compiled while the workers go on with
        the next ones, and the budget's end cancels what has not started.  With the first call (the input
        first) the alternatives the build will time if it keeps the input are queued too, and kept; with the cost
        model's best candidate, planned on streams where the input is one engine, its one-engine form."""
        models = [m for m in models if not any(m is p for p in self.prepared)]
        if not models:
            return None
        best = not any(p is not self.loaded.model for p in self.prepared)  # the cost model's best comes next
        self.prepared.extend(models)
        variants = [self.variant_of(m) for m in models]
        for m, v in zip(models, variants):
            if m is self.loaded.model:
                self.input_streams = v.plan.num_streams
                self.input_cut, self.input_plan = blocks_not_raced(v), v.plan
        # the input's engines are never cancelled: the search measures the input first, or measures nothing and
        # keeps it; cancelled, they were compiled again only after the alternatives queued behind them.  They
        # are queued with the search's candidates, before them: the candidates the search prepares while the
        # input compiles must not go ahead of it (the reference is the first thing the search waits for)
        with_input = any(m is self.loaded.model for m in models)
        got = self.engines.precompile(variants, background=True, cancellable=not with_input,
                                      order="search" if with_input else "auto",
                                      label="the input" if with_input else "the search's candidates")
        if got is not None:
            got.pop("keys", None)
        rival = next((v for m, v in zip(models, variants) if m is not self.loaded.model), None) if best else None
        if got is not None and rival is not None and self.input_streams == 1 and rival.plan.num_streams > 1:
            # the cost model's best candidate planned on streams where the input is one engine: the streams are
            # the rewrite's (ViT-B/16's and BERT's fused attention), and as one engine it ran twice as fast
            # (``_as_one_engine``), which the build times either way (here, or in its "streams" round if the
            # candidate wins as planned), as it does that form with each fusion off (``_with_fusions_off`` here,
            # the build's rounds for the graph it keeps): compiled now, beside the plan, rather than one after
            # another once it is timed (ViT-B/16 at batch 8: ~25 s each, 60 s of its search after the plan's time)
            one = one_stream_form(self.engines, rival)
            self.engines.precompile([one] + [f for _, f in fusions_off_forms(self.backend, one, rewritten_only=True)],
                                    background=True, cancellable=True, label="the best candidate's other forms")
        if not self.alternatives_queued and got is not None and got.get("background") is True:
            self.alternatives_queued = True
            named = alternative_variants(self.engines, variants[0])
            if models[0] is self.loaded.model:  # the input's rounds are timed during the search: the depthwise ones
                # may be sampled, and the streams round is timed against the plan's own engines first (nothing
                # to compile)
                depthwise = {w: a for w, a in named if w in dict(DEPTHWISE_ROUNDS)}  # in the rounds' order
                sample = depthwise_sample(self.engines, variants[0], depthwise) if depthwise else None
                first_round = next(iter(depthwise), None)
                named = [(what, a if what not in depthwise or sample is None else sample if what == first_round
                          else SampledRound(a)) for what, a in named]
                named = [(what, StreamsRival(a) if what == "streams" else
                          gemm_sample(self.engines, variants[0], a) or a if what == "GEMM epilogue" else
                          layout_sample(self.engines, variants[0], a) or a if what == "boundary layout" else a)
                         for what, a in named]
            named, base, first_round = self._gemm_sample_first(named, variants[0])
            # a round's sample is compiled right after the input, with the search's candidates (its engines are
            # few and it decides the round, which waited for them at the search's end otherwise: NASNet-A Large,
            # H200, 22.5 s); the other alternatives after the candidates
            samples = [a for _, a in named if isinstance(a, SAMPLES)]
            sampled = [x for a in samples for x in a.variants()]
            # per round, the span of ``sampled + compiled`` whose keys its turn waits for: a sample's engines, or
            # the round's alternative (a sampled GEMM round's is compiled too, for a flip to go on with: at ``fulls``)
            spans, compiled, fulls, at = [], [], {}, 0
            for _, a in named:
                if isinstance(a, SAMPLES):
                    spans.append((at, at + len(a.variants())))
                    at += len(a.variants())
                    if isinstance(a, GemmSample):
                        fulls[id(a)] = len(sampled) + len(compiled)
                        compiled.append(a.full)
                elif isinstance(a, (StreamsRival, SampledRound)):
                    spans.append((0, 0))  # (nothing compiled for it yet)
                else:
                    spans.append((len(sampled) + len(compiled), len(sampled) + len(compiled) + 1))
                    compiled.append(a)
            first = (self.engines.precompile(sampled, background=True, cancellable=False, order="search",
                                             label="the rounds' samples") if sampled else None)
            alt = self.engines.precompile(compiled, background=True, cancellable=False,
                                          label="the input's alternatives")
            keys = alt.pop("keys", None) if alt else None
            if keys is not None and sampled:
                first_keys = first.pop("keys", None) if first else None
                keys = first_keys + keys if first_keys is not None else None
                if alt is not None:
                    alt["sampled"] = first
            for a in samples:
                if isinstance(a, GemmSample) and keys is not None:
                    a.full_keys = list(keys[fulls[id(a)]])
                if isinstance(a, LayoutSample):  # (``_race_layout_sample`` hastens or drops it)
                    a.queue_rival(self.engines)
            # spare work, each round's apart: needed only where that round of the input flips, when they are
            # hastened (``_race_in_turn``), or waited for by the build's own rounds after the search.  In the
            # rounds' order, a sampled GEMM-epilogue round's too: queued after the others', on the guess that its
            # sample keeps the plan's form, they started at 33-38 s in a MixNet-S build whose sample flipped the
            # round (9.8 µs of a 0.877 ms plan), which then took 90 s against 60-78 (H200)
            decided = {first_round["choice"]} if first_round else set()
            for what, alts in speculative_by_round(self.engines, base, decided):
                queued = self.engines.precompile(alts, background=True, cancellable=False, order="spare",
                                                 label="alternatives of alternatives")
                self.early.setdefault("spare", {})[what] = [k for ks in (queued or {}).get("keys") or [] for k in ks]
            if keys is not None and len(keys) == len(sampled) + len(compiled) and models[0] is self.loaded.model:
                self.early.update(plan=variants[0].plan, variant=variants[0],
                                  rounds=[first_round] if first_round else [],
                                  todo=[(what, a, [k for ks in keys[i:j] for k in ks])
                                        for (what, a), (i, j) in zip(named, spans)])
                if base is not variants[0]:  # the GEMM round went to the alternative: the later rounds race that
                    # form, whose rivals are compiled, not the input's plan (the build times them after the search)
                    self.early.update(todo=[], flips=["GEMM epilogue"],
                                      stopped="GEMM epilogue: the alternative won on its sample; the rest are timed "
                                              "after the search, on its form")
            got["alternatives"] = alt
        return got

    def measure(self, model: onnx.ModelProto) -> float:
        with self.host:
            self._host_holder = threading.get_ident()
            try:
                return self._measure(model)
            finally:
                self._host_holder = None

    def _measure(self, model: onnx.ModelProto) -> float:
        t_called = time.perf_counter()
        self.time_ready()  # the input's alternatives whose engines are in, before the next candidate
        past = time.perf_counter() - self.deadline if self.calls >= 2 else 0.0
        if past > 0 and not self._rounds_compiling():
            raise MeasureBudgetSpent(f"measurement budget of {self.budget_s:.0f} s spent")
        self.calls += 1
        self.log.append({"start_s": round(time.perf_counter() - self.t_made, 3),
                         "called_s": round(t_called - self.t_made, 3)})
        if past > 0:  # measured while the search's end waits for an input's round anyway
            self.log[-1]["past_budget_s"] = round(past, 3)
        la, v = self._load(model)
        t0 = time.perf_counter()
        if self.reference is None:
            ms = float(np.median(self._time({"candidate": la})["candidate"]))
            self.reference = (la, ms)
            self.reference_seen = [ms]
            self.log[-1].update(time_s=round(time.perf_counter() - t0, 3), median_ms=round(ms, 4))
            # the input's rounds that can be timed now, before the candidates' budget starts: they are timed
            # whichever plan the build keeps (for a candidate, to carry their wide margins), and each is a load
            # and a timing, not a candidate's measurement
            self._streams_first()
            self.time_ready()
            self.deadline = time.perf_counter() + self.budget_s
            return ms / 1e3
        leads = False  # its lead held in two timings: its rounds are compiled now (``_queue_rounds_of``)
        try:
            ms = self._against_reference(la)
            if self._leads(ms) and self.backend.background_compiles:
                # a lead is timed again before the build compiles the candidate's rounds: one timing's lead of a
                # few percent is often noise, and the compiles queued for it take workers from the input's rounds,
                # whose last compile the search's end waits for (NASNet-A Large, H200: 38-39 jobs, 51-89
                # worker-seconds, queued in 7 of 8 builds for a candidate 2.2-4.4% ahead in one timing, and every
                # one of those builds kept the input, no candidate 2% faster once confirmed).  Its rounds are
                # compiled if it leads in both timings; its time is their mean
                again = self._against_reference(la)
                leads = self._leads(max(ms, again))
                self.log[-1]["lead_timed_again_ms"] = [round(ms, 4), round(again, 4)]
                ms = (ms + again) / 2
        finally:
            la.close()
        self.log[-1]["time_s"] = round(time.perf_counter() - t0, 3)
        form = v
        if ms > self.reference[1] and self.calls == 2:
            one, one_ms = v, ms
            streams = self._streams_decided_on_input()
            if streams is None:
                one, one_ms = self._as_one_engine(v, ms)
            elif v.plan.num_streams > 1:
                self.log[-1]["one_engine"] = f"not timed: the input's streams round, {streams['timed']}"
            if one is not v:  # the build plans it as one engine if the search keeps it (``one_engine_timed``)
                self.one_engine_won.append((model, self.log[-1]["streams_ms"]))
            form, ms = self._with_fusions_off(one, one_ms)
        elif leads:  # one the search can keep
            self._queue_rounds_of(v)
        self.timed_forms.append((model, form))
        self.best_ms = min(self.best_ms, ms)
        return ms / 1e3

    def confirm(self, model: onnx.ModelProto) -> float:
        """``model``, measured already, timed again against the reference in the form its time was taken in (its
        plan, or the one-engine or fusions-off form ``measure`` found faster): its engines are compiled by then, so
        this is a load and a timing (~0.5-2 s).  The search's fastest is confirmed so (``confirm_fastest``), and
        the log gets an entry of its own (``again``)."""
        form = next((f for m, f in self.timed_forms if m is model), None)
        if form is None or self.reference is None:
            raise ValueError("only a candidate measured against the reference can be timed again")
        self.log.append({"start_s": round(time.perf_counter() - self.t_made, 3), "again": True})
        return self._form_against_reference(form, self.log[-1]) / 1e3

    def _form_against_reference(self, form: Variant, entry: dict | None = None) -> float:
        """``form`` loaded (its engines compiled or waited for), timed against the reference
        (``_against_reference``: milliseconds) and closed; ``entry`` gets its ``load_s`` and ``time_s``."""
        t0 = time.perf_counter()
        la = self.engines.launcher(form)
        t1 = time.perf_counter()
        try:
            return self._against_reference(la)
        finally:
            la.close()
            if entry is not None:
                entry.update(load_s=round(t1 - t0, 3), time_s=round(time.perf_counter() - t1, 3))

    def _leads(self, ms: float) -> bool:
        """Whether a candidate timed at ``ms`` is one the search can keep: faster than the input by the search's
        margin and than every candidate before it."""
        return ms < min(self.reference[1] * (1.0 - self.margin), self.best_ms)

    def _gemm_sample_first(self, named: list[tuple], v: Variant) -> tuple[list[tuple], Variant, dict | None]:
        """The input's rounds (``named``, as ``prepare`` queues them) with a one-engine plan's "GEMM epilogue"
        round decided first, on its sample (``GemmSample``) alone, before any other round's rival is queued:
        (the rounds to queue, the form the later rounds race, the GEMM round decided, or None).  Kept, the rounds
        are the others, of ``v``; gone to the alternative, they are that form (the round's own whole-plan
        alternative, first) and its rounds' rivals.  Elsewhere ``named`` and ``v`` as they are.

        Why: in one engine the GEMM round's form is every later rival's form, and decided after the plan was
        compiled, the rivals of both forms were compiled: MixNet-S (H200) compiled 14 whole-model groups, ~400
        worker-seconds, its input's rivals for a form its sample then dropped, and the rivals of the form it
        kept were queued 37 s into a 78 s build.  The sample compiles in a few seconds (two one-node engines),
        which the search waits for here: it waits for the input's compile before it measures anything.  A
        sample that fails leaves the round to the whole plan's race."""
        at = next((i for i, (_, a) in enumerate(named) if isinstance(a, GemmSample)), None)
        if at is None or not gemm_decided_first(v.plan):
            return named, v, None
        s = named[at][1]
        t0 = time.perf_counter()
        try:
            r = gemm_sample_first_round(self.engines, s, v.plan, runs=self.runs, warmup=self.warmup,
                                        lock=self.options.gpu_timing_lock, order="search")
        except Exception as e:  # noqa: BLE001 - the sample is not the plan: its round is raced on the plan instead
            self.early["sample_error"] = f"GEMM epilogue (sampled): {type(e).__name__}: {e}"
            return [(what, s.full if a is s else a) for what, a in named], v, None
        r["started_s"] = round(t0 - self.t_made, 3)
        others = [(what, a) for what, a in named if a is not s]
        if r["won"] != round_labels("GEMM epilogue", v.plan)[1]:
            return others, v, r
        return ([("GEMM epilogue", s.full)] + [(what, a) for what, a in alternative_variants(self.engines, s.full)
                                              if what != "GEMM epilogue"], s.full, r)

    def _queue_rounds_of(self, v: Variant) -> None:
        """Queue the compiles of the rounds' alternatives of ``v``, the fastest candidate so far and faster than
        the input by the search's margin in both of its timings (``measure``; ``margin``: closer, the search keeps
        the input whatever comes, and the compiles were for nothing: NASNet-A Large, H200, 71 worker-seconds for a candidate 0.9% faster, while the
        input's rounds after the budget waited for theirs): the build ships it if nothing later beats it, and then
        times its rounds, whose alternatives
        it otherwise compiled only after the search (ViT-B/16 and BERT-base on the H100: 20 s of an 84-91 s
        build, the rewrite having changed every layer's code).  Cancellable: a later candidate that beats it
        leaves what has not started to the search's end."""
        if not self.backend.background_compiles:  # compiled when timed, as they would be after the search
            return
        # not a round the input decided by the margin a rewritten plan takes it by, nor one timed on a sample of
        # the input's engines (its whole plan's compile is what the sample saves)
        decided = {r["choice"] for r in carried_rounds(self._input_rounds())}
        decided |= {what for what, a, _ in self.early.get("todo") or []
                    if isinstance(a, (*SAMPLES, SampledRound, StreamsRival))}
        decided |= {r["choice"] for r in self.early.get("rounds") or [] if "sample" in r}
        variants = [a for what, a in alternative_variants(self.engines, v) if what not in decided]
        variants += speculative_variants(self.engines, v, decided)
        if variants:
            got = self.engines.precompile(variants, background=True, cancellable=True,
                                          label="the fastest candidate's alternatives")
            self.log[-1]["rounds_queued"] = (got or {}).get("jobs")

    def _against_reference(self, la) -> float:
        """``la``'s milliseconds per replay, timed in alternating blocks with the reference and scaled by the
        reference's first median (so that candidates timed at different moments compare through the same
        reference).  A timing whose reference ran more than ``REFERENCE_DRIFT`` slower than its usual median
        (the median of every median it has run) is timed again, up to ``REFERENCE_RETRIES`` times: what else
        runs on the GPU meanwhile only slows a timing (a build's compile workers run their engines and Triton's
        autotuning on it; NASNet-A Large's reference ran 1.50 ms in most timings of one build and 1.85-2.41 in
        others, H200).  A reference faster than that is taken as it is (a first median taken while disturbed,
        2.41 ms in that build, does not make every later timing "drifted").  Not its fastest median: a launcher
        timed replay by replay also runs, now and then, a whole timing 7-12% faster than its usual (BERT-base,
        H200: its search's reference 0.572 against 0.642 ms, the shipped bundle 0.420 against 0.454; the GPU's
        clocks unchanged, the compile workers alive or shut down, and in a fresh process alike:
        bench/timing_hold.py --states), and measured from that fastest, 9 of the 10 candidates' timings in one
        BERT-base search were taken two or three times.
        The log keeps both medians of every timing (``blocks_ms``)."""
        ref, ref_ms = self.reference
        tries = timed_while_drifted(lambda: self._time({"reference": ref, "candidate": la}), "reference",
                                    self.reference_seen)
        for times in tries:
            cand, against = float(np.median(times["candidate"])), float(np.median(times["reference"]))
            if self.log:
                self.log[-1].setdefault("blocks_ms", []).append({"reference": round(against, 4),
                                                                 "candidate": round(cand, 4)})
        return cand / against * ref_ms

    def _time(self, launchers: dict) -> dict:
        """``bench.measure`` of ``launchers``; the log's last entry adds up how long the timings waited for the
        GPU's turn (``lock_wait_s``) and counts blocks whose gate a timer had to open."""
        from .bench import measure as time_replays

        info: dict = {}
        handed = self._host_holder == threading.get_ident()  # the GPU times: the search's preparation may run
        if handed:
            self.host.release()
        try:
            times = time_replays(launchers, runs=self.runs, warmup=self.warmup, lock=self.options.gpu_timing_lock,
                                 info=info)
        finally:
            if handed:
                t = time.perf_counter()
                self.host.acquire()
                waited = time.perf_counter() - t
                if self.log and waited > 1e-3:  # the preparation's step in course when the timing ended
                    self.log[-1]["host_wait_s"] = round(self.log[-1].get("host_wait_s", 0.0) + waited, 3)
        if self.log:
            entry = self.log[-1]
            entry["lock_wait_s"] = round(entry.get("lock_wait_s", 0.0) + info.get("lock_wait_s", 0.0), 3)
            if info.get("opened_by_timer"):
                entry["gates_opened_by_timer"] = entry.get("gates_opened_by_timer", 0) + info["opened_by_timer"]
            if info.get("held_block"):  # the replays a held block queues since (``bench._HELD_BLOCK``)
                entry["held_block"] = info["held_block"]
        return times

    def _as_one_engine(self, v: Variant, ms: float) -> tuple[Variant, float]:
        """The faster of ``v`` as timed (``ms``) and, when ``v``'s plan has several streams, ``v`` as one engine
        for the whole model, timed against the reference.

        Whether a plan runs on streams is the build's timed choice for the graph it keeps (``time_alternatives``'
        "streams" round), so a candidate must not lose the search for a stream plan the build would have
        replaced: ViT-B/16 at batch 8 (H100, fp16) kept its input, one engine, and ran 0.78x of torch.compile,
        after its best candidate had been timed as the cost model's 2-stream plan of 145 engines, 2.40 ms
        against the input's 1.75 ms, where the same rewrite less one reshape merge, which the cost model planned
        as one engine, ran 1.11 ms (bench/rule_ablation.py): the stream plan cost, not a rule.
        Only for the cost model's best candidate, as ``_with_fusions_off``: it costs a compile."""
        if v.plan.num_streams <= 1:
            return v, ms
        one = one_stream_form(self.engines, v)
        t = self._form_against_reference(one)
        self.log[-1]["streams_ms"] = {"plan": round(ms, 4), "one engine": round(t, 4)}
        return (one, t) if t < ms else (v, ms)

    def _streams_decided_on_input(self) -> dict | None:
        """The input's "streams" round where its plan led its own engines on one stream by more than
        ``STREAMS_DECIDED_BEYOND`` (``_streams_first``): the round's own reasoning then holds for a rewrite of it,
        whose whole model as one engine would have to run under 0.71x of its engines on one stream, and
        ``_as_one_engine`` would compile that engine (NASNet-A Large, 895 nodes, H200: the cost model's best
        candidate ran 1.5% slower than the input as planned, and its one engine, compiled in ~53 s while the 25 s
        budget ran out, ran 2.535 ms against the plan's 1.504; the input's plan had led its engines on one stream
        by 2.1x)."""
        return next((r for r in self.early.get("rounds") or []
                     if r.get("choice") == "streams" and r.get("rival") == SERIAL_LABEL), None)

    def one_engine_timed(self, model: onnx.ModelProto) -> dict | None:
        """The times when ``model`` (the candidate the search kept) ran faster as one engine than as its stream
        plan (``_as_one_engine``): the build plans it as one engine without compiling the stream plan."""
        return next((t for m, t in self.one_engine_won if m is model), None)

    def _with_fusions_off(self, v: Variant, ms: float) -> tuple[Variant, float]:
        """The fastest of ``v`` as timed (``ms``) and ``v`` with each kind of fused node it holds run as its plain
        ops instead (attention, GEMM epilogue), each timed against the reference: (that form, its time).

        Which of those a bundle runs is the build's timed choice for the graph it keeps (``time_alternatives``),
        so a candidate must not lose the search for a fusion the build would have turned off: BERT-base at batch
        32 (H100) kept its input, whose one engine has no attention node left to race, and ran 0.87x of
        torch.compile, after its best candidate, fusions on, measured 3.63 ms against the input's 2.77 ms.
        Only for the cost model's best candidate (the search's second measurement, which every measured search
        makes): it costs a compile per kind."""
        tried: dict[str, float] = {}
        best = (v, ms)
        for what, form in fusions_off_forms(self.backend, v, rewritten_only=True):
            tried[f"{what} as plain ops"] = t = self._form_against_reference(form)
            if t < best[1]:
                best = (form, t)
        if tried:
            self.log[-1]["fusions_off_ms"] = {k: round(t, 4) for k, t in tried.items()}
            self.log[-1]["fusions_on_ms"] = round(ms, 4)
        return best

    def _load(self, model: onnx.ModelProto):
        from parastream.launcher.gpu import load_phases

        t_plan = time.perf_counter()
        v = self.variant_of(model)
        t0 = time.perf_counter()
        la = self.engines.launcher(v)
        self.planned = [(m, x) for m, x in self.planned if m is not model]  # measured once: its plan can go
        self.log[-1].update(build_s=round(la.t_built - t0, 3), load_s=round(time.perf_counter() - la.t_built, 3),
                            plan_s=round(t0 - t_plan, 3), load_phases_s=load_phases(la))
        return la, v

    def close(self) -> None:
        if self.backend.background_compiles:  # what ``prepare`` queued and no measurement needs any more
            self.backend.cancel_precompile()
        if self.reference is not None:
            self.reference[0].close()
            self.reference = None
        self.adopted.clear()  # the candidates' graphs: planned already, or never measured
        self.timed_forms.clear()  # (the search confirms before it returns)

    def _rounds_compiling(self) -> bool:
        """Whether an input's round still waits for its rival's compile.  The search's end waits for it
        (``alternatives_timed``), so a candidate measured meanwhile costs the build no time: the budget does not
        end the measurements while one does (NASNet-A Large, H200: the budget ended 42 s into the search with 8
        candidates measured, and the search ended at 53 s, when the boundary-layout round's rival was compiled)."""
        early = self.early
        if not early.get("todo") or not self.backend.background_compiles:
            return False
        return any(self.backend.compiling(item[2]) for item in self._raceable())

    def _raceable(self) -> list[tuple]:
        """The input's rounds still to time that can be timed against the input's plan: all of them, or, once a
        round's alternative won (``early["flips"]``), the rounds whose alternative changes no engine holding a
        node that fusion converts (``_apart``), and the depthwise sample where that round's fusion converts no
        node of the sampled engines (``ROUND_APPLIES``): their code, and so the sample's times, are the same with
        the fusion off, and the sample decides its rounds for the plan the build goes on with.  Timed after the
        search instead, the depthwise rounds race the whole plan's alternatives (NASNet-A Large, H200: its
        GEMM-epilogue round went to the alternative, and the build compiled 216 jobs, both depthwise kernels for
        108 engines, where the sample's 18 were compiled already)."""
        early = self.early
        todo = early.get("todo") or []
        if not early.get("stopped"):
            return list(todo)
        flips = early.get("flips") or []
        if not flips:  # stopped by a round that could not be timed: the build times the rest after the search
            return []

        def raceable(what: str, a) -> bool:
            if isinstance(a, SAMPLES):
                return all(ROUND_APPLIES.get(f) is not None and not ROUND_APPLIES[f](a.current.model) for f in flips)
            return all(self._apart(f, what) for f in flips)

        return [item for item in todo if raceable(item[0], item[1])]

    def _apart(self, flipped: str, what: str) -> bool:
        """Whether round ``what``'s alternative changes only engines of the input's plan that hold no node the
        ``flipped`` round's fusion converts (``round_changes``, per engine): those engines are the same code in
        the flipped plan, so ``what`` raced against the input's plan decides it for the flipped one too, and the
        build need not load and time it again after the search (NASNet-A Large, H200: its head's GEMM-epilogue
        round flipped, and the conv+ReLU and boundary-layout rounds were timed again on the flipped plan, 10 s; the
        head holds no convolution).  Rounds that change every engine (boundary layout, streams, engine blocks)
        never are."""
        key = (flipped, what)
        if key not in self._apart_seen:
            flip, other, v = round_changes(flipped), round_changes(what), self.early.get("variant")
            self._apart_seen[key] = bool(flip and other and v is not None) and not any(
                flip(b) and other(b) for b in self.engines.branch_models(v))
        return self._apart_seen[key]

    # -- the input's alternatives, timed during the search -----------------------------------------------------
    def time_ready(self, wait: bool = False) -> None:
        """Time the input's alternatives whose engines are compiled against the input (the reference launcher),
        in ``time_alternatives``'s order, while the search goes on: the build then need not load and time them
        after the search, nor wait for their compiles at its end.  ``wait``: the rest too, waiting for their
        compiles.  A round the alternative wins changes what the later rounds race (the bundle's fusion or
        layout); the build then times them after the search, as for a rewrite chosen (but the depthwise sample,
        ``_raceable``)."""
        while self.reference is not None:
            raceable = self._raceable()
            if not raceable:
                return
            keys = raceable[0][2]
            if not wait and self.backend.compiling(keys):
                return
            if self._race_in_turn(raceable[0]) is None:
                return

    def _race_in_turn(self, item: tuple) -> bool | None:
        """``item`` (round, variant, keys) taken off the input's rounds to time and raced (``_race_early``); a
        round the alternative won stops the rest, which would race another plan (the build times them after the
        search, from the winner)."""
        what, v, _ = item
        self.early["todo"].remove(item)
        won = self._race_early(what, v)
        if won and what not in ("streams", "engine blocks"):
            self.early.setdefault("stopped", f"{what}: the alternative won; the rest are timed after the search")
            self.early.setdefault("flips", []).append(what)
            # the later rounds now race this round's alternative: their forms of it, queued as spare, are needed
            self.backend.hasten((self.early.get("spare") or {}).get(what) or [])
        return won

    def _streams_first(self) -> None:
        """The input's "streams" round, timed as soon as the reference is (``StreamsRival``): the plan against its
        own engines on one stream, which need no compile.  A lead over ``STREAMS_DECIDED_BEYOND`` decides the
        round, and the graph on one stream is never compiled; closer, that compile starts now, before what is
        queued (it is the longest the build waits for), and the round races it in its turn."""
        early = self.early
        at = next((i for i, (_, a, _) in enumerate(early.get("todo") or []) if isinstance(a, StreamsRival)), None)
        if at is None or self.reference is None:
            return
        rival = early["todo"][at][1]
        t0 = time.perf_counter()
        serial = streams_against_own_engines(self.reference[0], early["plan"], runs=self.runs,
                                             warmup=self.warmup, lock=self.options.gpu_timing_lock)
        serial["started_s"] = round(t0 - self.t_made, 3)
        if serial["decided"]:
            early["todo"].pop(at)
            early["rounds"].append(dict(streams_round_decided(serial, early["plan"]), started_s=serial["started_s"]))
            return
        early["todo"][at] = self._compiling("streams", rival.full, order="now")
        early["serial"] = {k: v for k, v in serial.items() if k != "decided"}

    def _compiling(self, what: str, full: Variant, order: str = "auto") -> tuple:
        """The round ``what`` as the rounds to time hold it, its rival ``full`` (a compile of the whole plan, kept)
        queued now: (what, full, the cache keys ``time_ready`` waits for)."""
        got = self.engines.precompile([full], background=True, cancellable=False, order=order,
                                      label=f"the {what} round's rival") or {}
        return what, full, [k for ks in got.get("keys") or [] for k in ks]

    def _race_early(self, what: str, v: Variant) -> bool | None:
        """One of the input's rounds raced against the reference (``race``; waits for ``v``'s compile): whether
        the alternative won, None when it could not be timed (``early["stopped"]`` says why)."""
        early = self.early
        if isinstance(v, DepthwiseSample):
            return self._race_sample(v)
        if isinstance(v, GemmSample):
            return self._race_gemm_sample(v)
        if isinstance(v, LayoutSample):
            return self._race_layout_sample(v)
        if isinstance(v, SampledRound):  # its sample left it open: the whole plan's alternative, compiled now and
            early["todo"].insert(0, self._compiling(what, v.full))  # raced in its turn
            return False
        if isinstance(v, StreamsRival):  # (timed with the reference, ``_streams_first``): decided now, or its
            early["todo"].insert(0, (what, v, []))  # compiled rival queued in its place
            self._streams_first()
            return False
        t0 = time.perf_counter()
        try:
            other = self.engines.launcher(v)
            try:
                won = race(early.setdefault("rounds", []), what, self.reference[0], other, early["plan"],
                           runs=self.runs, since=t0, lock=self.options.gpu_timing_lock, seen=self.reference_seen,
                           current_kernels=self.options.conv_kernels)
            finally:
                other.close()
        except Exception as e:  # noqa: BLE001 - the build times it after the search, where a failure is reported
            early["stopped"] = f"{what}: {type(e).__name__}: {e}"
            return None
        early["rounds"][-1]["started_s"] = round(t0 - self.t_made, 3)
        if early.get("flips"):
            early["rounds"][-1]["timed"] = (f"during the search, against the input's plan after its "
                                            f"{' and '.join(early['flips'])} round went to the alternative: no engine "
                                            "holds nodes of both")
        if "sample" in early and (what in dict(DEPTHWISE_ROUNDS) or what == "boundary layout"):
            early["rounds"][-1]["sample"] = early.pop("sample")
        if "sample_error" in early and what == "GEMM epilogue":  # (``_gemm_sample_first``)
            early["rounds"][-1]["sample_error"] = early.pop("sample_error")
        if "serial" in early and what == "streams":
            early["rounds"][-1]["serial"] = early.pop("serial")
        return won

    def _race_sample(self, s: DepthwiseSample) -> bool | None:
        """The depthwise rounds on the sample of the input's engines (``depthwise_sample``): the sampled engines as
        the plan has them and with each round's kernels, three launchers timed together in alternating blocks.
        A round whose kernels are slower on the sample by more than ``SAMPLE_DECIDES_BEYOND`` is decided for the
        plan as it is (report.json's round says so, with the sample's times); the first round left open is raced
        on the whole plan in its turn (``SampledRound``: its alternative compiled then), the sample kept beside it,
        and the rounds after it race in theirs.  None: the sample could not be timed (``early["stopped"]``)."""
        early = self.early
        t0 = time.perf_counter()
        first = next(iter(s.kinds))
        labels = {what: round_labels(what, early["plan"]) for what in s.kinds}
        here = labels[first][0]  # the kernels the plan has
        named = {here: s.current, **{labels[what][1]: v for what, v in s.kinds.items()}}
        again: list = []
        try:
            ms = sample_medians(self.engines, named, runs=self.runs, warmup=self.warmup,
                                lock=self.options.gpu_timing_lock, confirmed=again)
        except Exception as e:  # noqa: BLE001 - the build times the rounds after the search, where a failure is reported
            early["stopped"] = f"depthwise convolutions (sampled): {type(e).__name__}: {e}"
            return None
        sample = {"engines": s.names, "of": s.of, "convolutions": s.convolutions, "covered": s.covered,
                  "timed_ms": {k: round(t, 4) for k, t in ms.items()}, "timed_s": round(time.perf_counter() - t0, 3),
                  **({"confirmed_ms": again} if again else {})}
        for what in s.kinds:
            other = labels[what][1]
            if ms[other] <= ms[here] * (1 + SAMPLE_DECIDES_BEYOND):  # left open: raced on the whole plan in its turn
                if what == first:  # (a later round's ``SampledRound`` is in its place already)
                    early["todo"].insert(0, (what, SampledRound(s.fulls[what]), []))
                early["sample"] = sample  # kept beside the round when it is raced
                return False
            early["rounds"].append({
                "choice": what, "timed_ms": {labels[what][0]: ms[here], other: ms[other]}, "won": labels[what][0],
                "load_s": 0.0, "timed_s": sample["timed_s"], "started_s": round(t0 - self.t_made, 3), "sample": sample,
                "timed": f"on {plural(len(s.names), 'engine')} of the {s.of} with a depthwise convolution, one after "
                         f"another ({s.covered} of its {s.convolutions} distinct depthwise convolutions): the "
                         f"alternative slower by more than {SAMPLE_DECIDES_BEYOND:.0%}"})
            early["todo"] = [item for item in early["todo"] if item[0] != what]  # (a later round's ``SampledRound``)
        return False

    def _race_gemm_sample(self, s: GemmSample) -> bool | None:
        """The "GEMM epilogue" round on its sample (``gemm_sample_round``), against the reference's median as the
        plan's time.  Kept, the whole plan's alternative and the later rounds' rivals of it are dropped where
        they have not started.  None: the sample could not be timed (``early["stopped"]``)."""
        early, what = self.early, "GEMM epilogue"
        t0 = time.perf_counter()
        try:
            r = gemm_sample_round(self.engines, s, early["plan"], self.reference[1], runs=self.runs,
                                  warmup=self.warmup, lock=self.options.gpu_timing_lock)
        except Exception as e:  # noqa: BLE001 - the build times the rounds after the search, where a failure is reported
            early["stopped"] = f"{what} (sampled): {type(e).__name__}: {e}"
            return None
        early["rounds"].append(dict(r, started_s=round(t0 - self.t_made, 3)))
        won = r["won"] == round_labels(what, early["plan"])[1]
        if not won:
            self.backend.drop([*s.full_keys, *((early.get("spare") or {}).pop(what, None) or [])])
        return won

    def _race_layout_sample(self, s: LayoutSample) -> bool | None:
        """The "boundary layout" round on its window (``layout_window_round``).  Decided there, the whole plan's
        rival, queued as spare work, is dropped where it has not started; left open, that rival is hastened (or
        compiled now) and raced in its turn, the window's times kept beside it.  None: the window could not be
        timed (``early["stopped"]``)."""
        early, what = self.early, "boundary layout"
        t0 = time.perf_counter()
        try:
            r = layout_window_round(self.engines, s, early["plan"], runs=self.runs, warmup=self.warmup,
                                    lock=self.options.gpu_timing_lock)
        except Exception as e:  # noqa: BLE001 - the build times it after the search, where a failure is reported
            early["stopped"] = f"{what} (sampled): {type(e).__name__}: {e}"
            return None
        if r.get("decided_on_sample"):
            self.backend.drop(s.full_keys)
            early["rounds"].append(dict(r, started_s=round(t0 - self.t_made, 3)))
            return False
        if s.full_keys:  # the whole plan's rival, queued as spare work: needed now, raced in its turn
            self.backend.hasten(s.full_keys)
            early["todo"].insert(0, (what, s.full, list(s.full_keys)))
        else:
            early["todo"].insert(0, self._compiling(what, s.full, order="now"))
        early["sample"] = r["sample"]  # kept beside the round when it is raced
        return False

    def rounds_timed(self, wait_for: frozenset = CARRIED_ALWAYS) -> dict | None:
        """The input's rounds timed so far, as {"partial": True, "rounds", "plan"} (for a candidate that replaced
        the input: ``carried_rounds``); None when none was.  The rounds not timed yet are timed now where their
        alternatives are compiled already (or sampled), and the rounds of ``wait_for``, which a rewritten plan
        takes from the input whatever their margin, are waited for: their alternatives have compiled in the
        background since the search began, and timed on the candidate instead they would cost that compile again
        (the engine blocks' rival: a whole-model compile).  The input's alternatives compile behind the search's
        candidates, so on a large model most of them are ready only as the search ends: NASNet-A Large (H200)
        kept a rewrite with its input's rounds untimed, and its build compiled every alternative again for the
        candidate's plan (an engines stage of 81 s); timed on the input as the search ended, four of the five
        were 12-108% apart and carried (an engines stage of 2.7 s)."""
        early = self.early
        for item in list(early.get("todo") or []):
            if self.reference is None:
                break
            what, v, keys = item
            # (a sampled round whose sample left it open compiles its alternative first: not ready)
            ready = isinstance(v, (*SAMPLES, StreamsRival)) or (not isinstance(v, SampledRound)
                                                                       and not self.backend.compiling(keys))
            if what not in wait_for and (not any(item is x for x in self._raceable()) or not ready):
                continue
            if self._race_in_turn(item) is None:
                break
        rounds = self._input_rounds()
        if not rounds:
            return None
        said = ([f"{plural(len(early['rounds']), 'round')} during the search, for the input's plan"]
                if early.get("rounds") else []) + (["the input's engine cut, not raced"] if self.input_cut else [])
        return {"partial": True, "rounds": rounds, "plan": early.get("plan", self.input_plan), "timed": "; ".join(said)}

    def _input_rounds(self) -> list[dict]:
        """The input's rounds timed so far, with its engine cut where it is not raced (``blocks_not_raced``)."""
        return list(self.early.get("rounds") or []) + ([self.input_cut] if self.input_cut else [])

    def alternatives_timed(self) -> dict | None:
        """``time_alternatives``'s result for the input's plan from the rounds timed during the search (the rest
        timed now), with that ``plan``; when they could not all be timed against it (a round the alternative won
        changes what the later ones race), {"partial": True, "rounds": those timed, "plan"} for
        ``time_alternatives`` to go on from; None when none was."""
        early = self.early
        if not early:
            return None
        self.time_ready(wait=True)
        if not early.get("rounds"):
            return None
        if early.get("todo") or early.get("stopped"):
            return {"partial": True, "rounds": early["rounds"], "plan": early["plan"],
                    "timed": f"{plural(len(early['rounds']), 'round')} during the search, the rest after it",
                    **({"stopped": early["stopped"]} if early.get("stopped") else {})}
        one, whole = (any(r["choice"] == what and r["won"] == round_labels(what, early["plan"])[1]
                          for r in early["rounds"]) for what in ("streams", "engine blocks"))
        return {"fuse_conv_relu": bool(self.options.fuse_conv_relu and self.backend.fuses_conv_relu),
                "fuse_attention": bool(self.options.fuse_attention and runs_fused_attention(self.backend)),
                "fuse_gemm_epilogue": bool(self.options.fuse_gemm_epilogue and runs_gemm_epilogue(self.backend)),
                "conv_kernels": conv_kernels_used(self.options.conv_kernels),
                "internal_nhwc": True, "one_engine": one, "whole_engine": whole, "rounds": early["rounds"], "runs": self.runs,
                "timed": "during the search", "plan": early["plan"]}


def time_alternatives(engines: EngineMaker, bundle: Bundle, v: Variant, *, runs: int,
                      timed: list[dict] | tuple = (), rivals: QueuedRivals | None = None) -> dict | None:
    """Decide by measurement what the cost model and the converter's rules chose (GPU builds only).

    ``bundle`` (``v``'s engines as written) is timed on the GPU against what the build could have shipped
    instead, one choice at a time, each round in alternating blocks of CUDA-event timed replays
    (``race``): (0) attention nodes as one SDPA kernel or decomposed (``fuse_attention``; engines compiled for
    each), (0b) matmul-bias-activation nodes as one cuBLASLt GEMM with its epilogue or as their plain ops
    (``fuse_gemm_epilogue``; engines compiled for each), (0c) depthwise convolutions as cuDNN calls or as Inductor
    kernels, then the winner against torch's own depthwise kernel (``conv_kernels`` "auto" only; the alternative
    kept unless over 2% slower against cuDNN's calls, whose plans start slower: ``alternative_kept_within``),
    (1) engines with and without cuDNN's fused conv + bias
    (+ residual) + ReLU, (2) channels-last against contiguous internal boundaries (when the plan has
    channels-last internal boundaries; first on the window ``rivals`` queued for a plan of many engines,
    ``layout_window_round``), (3) the plan against the same graph on one stream (when the plan has
    several streams; first against its own engines on one stream, which decides a lead of more than
    ``STREAMS_DECIDED_BEYOND`` without compiling the graph on one stream), (4) one engine per repeated block against one engine for the whole model (when the plan
    is one stream cut into blocks; the blocks kept unless over 2% slower: they compile and load faster).  Engines compiled for a layout
    (``compiles_for_layout``) are compiled for each alternative; others load as they are with other launcher
    settings.  ``timed``: rounds timed already, against ``v``'s plan during the search
    (``GpuMeasurer.alternatives_timed``) or, decided by a wide margin, against the input's plan that ``v``'s
    rewrite replaced (``carried_rounds``): taken as they are, not timed again; what a round races is loaded only
    when it is timed here.  ``rivals``: what the build queued to compile in the background for these rounds, told
    of each decision (``QueuedRivals``).  Returns {"rounds": [...], "fuse_attention", "fuse_gemm_epilogue", "conv_kernels",
    "fuse_conv_relu", "internal_nhwc", "one_engine", "whole_engine"} with the faster of each round, or None when there
    is no GPU or nothing to choose."""
    from parastream.launcher.gpu import GpuLauncher

    backend = engines.backend
    if not gpu_present(backend):
        return None
    chosen = choices_as_built(backend, v.options)
    fused, attention, gemm, convs = (chosen[k] for k in ("fuse_conv_relu", "fuse_attention", "fuse_gemm_epilogue",
                                                          "conv_kernels"))
    done = {r["choice"]: r for r in timed}
    for what, r in decided_first(engines).items():  # decided before anything compiled: nothing to race
        done.setdefault(what, r)
    rounds: list[dict] = []
    since = [time.perf_counter()]  # a round's load_s: building and loading its alternative (the first: the bundle too)
    held: list = []  # the launcher of the choices so far, once a round timed here has loaded it

    def alternative(fuse: bool, nhwc: bool | None = None):
        if backend.compiles_for_layout:
            return engines.launcher(replace(v, options=replace(v.options, fuse_conv_relu=fuse), internal_nhwc=nhwc is not False))
        return GpuLauncher(bundle, fuse_conv_relu=fuse, internal_nhwc=nhwc)

    def current():
        if not held:
            as_written = (chosen["fuse_conv_relu"], chosen["internal_nhwc"], chosen["fuse_attention"],
                          chosen["fuse_gemm_epilogue"], chosen["conv_kernels"]) == (fused, True, attention, gemm, convs)
            held.append(GpuLauncher(bundle, fuse_conv_relu=fused) if as_written
                        else alternative(chosen["fuse_conv_relu"], None if chosen["internal_nhwc"] else False))
        return held[0]

    def round_won(what: str, make_other) -> bool:
        """Whether round ``what`` keeps its alternative: as the search timed it, else raced here."""
        if what in done:
            rounds.append({**done[what], "timed": done[what].get("timed", "during the search")})
            won = done[what]["won"] == round_labels(what, v.plan)[1]
            if won and what not in ("streams", "engine blocks"):
                while held:  # loaded for the choices before this one (none: the search's rounds come first)
                    held.pop().close()
            return won
        cur = current()
        other = make_other()
        won = race(rounds, what, cur, other, v.plan, runs=runs, since=since[0], lock=v.options.gpu_timing_lock,
                   current_kernels=v.options.conv_kernels)
        since[0] = time.perf_counter()
        if won and what not in ("streams", "engine blocks"):  # the later rounds race the winner
            held[0], other = other, cur
        other.close()
        return won

    def streams_won() -> bool:
        """The "streams" round: the plan against its own engines on one stream first (nothing to compile), then,
        unless that decided it, against the graph on one stream, compiled (``streams_against_own_engines``)."""
        serial = None
        if "streams" not in done:
            serial = streams_against_own_engines(current(), v.plan, runs=runs, lock=v.options.gpu_timing_lock)
            since[0] = time.perf_counter()
            if serial["decided"]:
                rounds.append(streams_round_decided(serial, v.plan))
                return False
        won = round_won("streams", lambda: engines.launcher(
            replace(one_stream_form(engines, v), options=replace(v.options, fuse_conv_relu=chosen["fuse_conv_relu"]),
                    internal_nhwc=True)))
        if serial is not None:
            rounds[-1]["serial"] = {k: x for k, x in serial.items() if k != "decided"}
        return won

    def layout_round_won() -> bool:
        """The "boundary layout" round: first on the window ``rivals`` queued for the form it races
        (``layout_window_round``), where there is one; decided there, or else raced on the whole plan, its rival
        (spare work until then) hastened, the window's times kept beside the round."""
        what = "boundary layout"
        window = getattr(rivals, "window", None)
        form = replace(v.options, fuse_conv_relu=chosen["fuse_conv_relu"])
        sample = None
        if what not in done and window is not None and window.current.options == form:
            try:
                r = layout_window_round(engines, window, v.plan, runs=runs, lock=v.options.gpu_timing_lock)
            except Exception as e:  # noqa: BLE001 - the window is not the plan: the round is raced on the plan
                sample = {"error": f"{type(e).__name__}: {e}"}
            else:
                if r.get("decided_on_sample"):
                    rounds.append(dict(r, load_s=round(time.perf_counter() - since[0], 3)))
                    since[0] = time.perf_counter()
                    return False
                sample = r["sample"]
            backend.hasten(window.full_keys)
        won = round_won(what, lambda: alternative(chosen["fuse_conv_relu"], False))
        if sample is not None:
            rounds[-1]["sample"] = sample
        return won

    def decided(what: str, won: bool) -> bool:
        """Tell ``rivals`` (the form the later rounds race: ``v`` with the conv+ReLU choice so far; the rounds not
        to race: those decided here so far and those taken as ``timed``); ``won``."""
        if rivals is not None:
            rivals.decided(what, won, replace(v, options=replace(v.options, fuse_conv_relu=chosen["fuse_conv_relu"])),
                           {r["choice"] for r in rounds} | set(done))
        return won

    try:
        if attention and has_fused_attention(v.model):
            won = round_won("attention", lambda: engines.launcher(replace(v, options=replace(v.options, fuse_attention=False))))
            if won:
                chosen["fuse_attention"] = False
                v = replace(v, options=replace(v.options, fuse_attention=False))  # what the later rounds' alternatives run
            decided("attention", won)
        if gemm and has_gemm_epilogue(v.model):
            off, sample_error = replace(v, options=replace(v.options, fuse_gemm_epilogue=False)), None
            sample = gemm_sample(engines, v, off) if "GEMM epilogue" not in done else None
            if sample is not None:  # decided on its Linears of one row, against the plan's own median
                from .bench import measure as time_replays

                try:
                    plan_ms = float(np.median(time_replays({"plan": current()}, runs=runs, warmup=10,
                                                           lock=v.options.gpu_timing_lock)["plan"]))
                    r = gemm_sample_round(engines, sample, v.plan, plan_ms, runs=runs, lock=v.options.gpu_timing_lock)
                except Exception as e:  # noqa: BLE001 - the sample is not the plan: the round is raced on it instead
                    sample_error = f"{type(e).__name__}: {e}"
                    sample = None
                else:
                    rounds.append(dict(r, load_s=round(time.perf_counter() - since[0], 3)))
                    since[0] = time.perf_counter()
            if sample is not None:
                won = rounds[-1]["won"] == round_labels("GEMM epilogue", v.plan)[1]
                while won and held:  # the later rounds race the alternative's whole plan: loaded in its place
                    held.pop().close()
                if won:
                    held.append(engines.launcher(off))
            else:
                won = round_won("GEMM epilogue", lambda: engines.launcher(off))
                if sample_error:
                    rounds[-1]["sample_error"] = sample_error
            if won:
                chosen["fuse_gemm_epilogue"] = False
                v = off
            decided("GEMM epilogue", won)
        # (each races the winner of those before it against its own kernels)
        for what, kernels in conv_kernel_rounds(backend, v.options, v.model):
            won = round_won(what, lambda k=kernels: engines.launcher(replace(v, options=replace(v.options, conv_kernels=k))))
            if won:
                chosen["conv_kernels"] = kernels
            v = replace(v, options=replace(v.options, conv_kernels=chosen["conv_kernels"]))
            decided(what, won)
        if fused and has_conv_relu(v.model):
            won = round_won("conv+ReLU", lambda: alternative(False))
            chosen["fuse_conv_relu"] = not won
            decided("conv+ReLU", won)
        if _internal_nhwc(backend, v.plan):
            won = layout_round_won()
            chosen["internal_nhwc"] = not won
            decided("boundary layout", won)
        if v.plan.num_streams > 1 and decided("streams", streams_won()):
            chosen["one_engine"] = True
        if races_whole_engine(v) and decided("engine blocks", round_won("engine blocks", lambda: engines.launcher(
                replace(whole_engine_form(engines, v), options=replace(v.options, fuse_conv_relu=chosen["fuse_conv_relu"]),
                        internal_nhwc=True)))):
            chosen["whole_engine"] = True
    finally:
        while held:
            held.pop().close()
        if rivals is not None:
            rivals.close()
    if not rounds:
        return None
    return dict(chosen, rounds=rounds, runs=runs)


# -- the CPU: plain onnxruntime, the rewritten model, the plan --------------------------------------------------
CPU_MARGIN = 0.05  # a timed CPU alternative replaces the default only when at least this much faster (and beyond the spread)
CPU_BUSY_SHARE = 0.25  # ... and only when other processes used at most this share of the cores while it was timed
CPU_LOAD_PROBE_S = 0.3  # how long the CPU build looks at the machine's load before it builds alternatives to time
CPU_INTERLEAVE_BYTES = 256 << 20  # alternatives whose sessions' engines together are larger are timed one at a time


#: the CPU builds' default alternative: plain onnxruntime, the loaded model as one session with every core
ORIGINAL_ONE_SESSION = "original model, one session"


@dataclass
class CpuAlternative:
    name: str
    model: onnx.ModelProto
    graph: gs.Graph
    sched: Schedule
    threads: int  # intra-op threads per session (0: onnxruntime's default, every core)


def cpu_alternatives(loaded: LoadedModel, model: onnx.ModelProto, graph: gs.Graph, sched: Schedule, cost_model,
                     streams: int | None, rewritten: bool) -> list[CpuAlternative]:
    """What a CPU build can ship, the DEFAULT first: the loaded model as one onnxruntime session with every core
    (plain onnxruntime, which a bundle must never be slower than), then the rewritten model as one session, the
    multi-stream plan the cost model scheduled with the cores shared out among its streams, and with every core
    per session.  ``streams`` given (--streams): only the plan's thread counts (the shared one the default).
    ``rewritten`` False (the search changed nothing): the rewritten model is the loaded one, not timed twice.
    A rewrite or a plan replaces plain onnxruntime only by being timed faster (``decide_by_timing``)."""
    cores = os.cpu_count() or 1
    plans: list[CpuAlternative] = []
    if sched.num_streams > 1 or streams:
        shared = max(1, cores // sched.num_streams) if sched.num_streams > 1 else 0
        for threads in dict.fromkeys([shared, 0]):
            plans.append(CpuAlternative(f"plan: {plural(sched.num_streams, 'stream')}, {plural(len(sched.branches), 'session')}, "
                                        f"{plural(threads or cores, 'thread')} each", model, graph, sched, threads))
    whole: list[CpuAlternative] = []
    if not streams:
        for name, m in (("rewritten model, one session", model), (ORIGINAL_ONE_SESSION, loaded.model)):
            if name.startswith("rewritten") and (m is loaded.model or not rewritten):
                continue
            g = graph if m is model else loaded.graph  # the loader's graph of the loaded model
            whole.append(CpuAlternative(name, m, g, schedule_graph(g, 1, cost_model.node_cost, cost_model.is_memory_bound), 0))
    # plain onnxruntime (the original, one session) first when it is an alternative: it is the default
    return whole[::-1] + plans


def cpu_choice_recordable(report: dict) -> bool:
    """Whether ``choose_cpu_alternative``'s ``report`` is a choice for later builds to take (``timings``): the
    alternatives were timed here, on a machine that other processes left to the build.  The default kept
    untimed or against a loaded machine's timings is not: the next build times them again."""
    share = report.get("others_cpu_share")
    return bool(report.get("timed")) and not report.get("recorded_by") and share is not None and share <= CPU_BUSY_SHARE


def choose_cpu_alternative(engines: EngineMaker, loaded: LoadedModel, model: onnx.ModelProto, graph: gs.Graph,
                           sched: Schedule, options: BuildOptions, cost_model, *, streams: int | None, runs: int,
                           seed: int, scratch: Path, rewritten: bool = True, recorded: dict | None = None):
    """CPU builds: time the alternatives (``cpu_alternatives``) on this machine, as the GPU build measures its
    candidates, and keep the default (plain onnxruntime) unless another is faster beyond the noise
    (``decide_by_timing``) on a machine that other processes left to the build (``OthersLoad``: at most
    ``CPU_BUSY_SHARE`` of the cores used by others while it was timed): the same command gives the same
    bundle on a loaded and on an idle machine unless an alternative wins clearly where it can be timed.

    They are loaded together and timed in alternating blocks on the same random input (``race_calls``: at most
    ``runs`` calls each; one clearly behind stops early), so that a change in the machine's load falls on
    all of them alike; when their engines together pass ``CPU_INTERLEAVE_BYTES`` (a large model: every session
    holds its own weights), one at a time instead, to bound the build's memory.  Each distinct model and schedule
    is built once, in ``scratch`` (the caller's folder; the plan's two thread counts share their engines), and the
    engines of the one kept are handed back as files there, so that the bundle copies rather than builds them.

    ``recorded``: the report of an earlier build of the same model on this machine with this code
    (``pipeline.timings``, its ``recorded_by`` saying which): the alternative it chose is built alone and kept,
    nothing timed, where it is one of this build's alternatives; else they are timed, and the report says why.

    Returns (model, graph, schedule, threads per engine, report, engines: {branch name: (file, builder report)},
    None where one alternative was left, which is then not built here).
    """
    from parastream.core.tensors import random_feeds
    from parastream.launcher.cpu import CpuLauncher

    from . import bench

    cores = os.cpu_count() or 1
    alternatives = cpu_alternatives(loaded, model, graph, sched, cost_model, streams, rewritten)
    report = {"runs": runs, "cores": cores, "default": alternatives[0].name, "timed": []}
    built: dict[tuple, tuple[Bundle, dict]] = {}
    busy_before = None
    taken = None
    if recorded:
        taken = next((a for a in alternatives if a.name == recorded.get("chosen")), None)
        if taken is None:
            report["recorded_not_taken"] = (f"the recorded choice ({recorded.get('chosen')}) is not one of this "
                                            "build's alternatives")
        else:
            report = {k: v for k, v in recorded.items() if k != "recorded_not_taken"}
            alternatives = [taken]
    if len(alternatives) > 1:
        # a machine that others keep busy now cannot replace the default by timing (below): not built, not timed
        with bench.OthersLoad() as probe:
            time.sleep(CPU_LOAD_PROBE_S)
        if probe.share is not None and probe.share > CPU_BUSY_SHARE:
            busy_before = probe.share
            alternatives = alternatives[:1]

    def key(alt: CpuAlternative) -> tuple:  # the model (by identity) and the schedule a scratch bundle was built for
        return (next(i for i, a in enumerate(alternatives) if a.model is alt.model),
                alt.sched.num_streams, tuple(map(tuple, alt.sched.branches)))

    for alt in alternatives if len(alternatives) > 1 else ():  # one alternative: nothing to time, nothing built
        if key(alt) not in built:  # (here: the bundle's engines stage builds it, once, where it is written)
            built[key(alt)] = _cpu_scratch_bundle(engines, scratch / str(len(built)), alt, options, loaded)
    if busy_before is not None:
        chosen = alternatives[0].name
        report.update(chosen=chosen, others_cpu_share=busy_before,
                      decision=(f"the default, not timed: other processes used {busy_before:.0%} of the cores (more than "
                                f"{CPU_BUSY_SHARE:.0%}); a loaded machine's timings do not replace it"))
    elif taken is not None:
        chosen = taken.name
    elif len(alternatives) == 1:
        chosen = alternatives[0].name
        report.update(chosen=chosen, decision="one alternative: nothing to time")
    else:
        engine_bytes = {k: sum(f.stat().st_size for f in (b.path / "engines").iterdir()) for k, (b, _) in built.items()}
        size = sum(engine_bytes[key(a)] for a in alternatives)  # each alternative's launcher loads its own sessions
        together = size <= CPU_INTERLEAVE_BYTES
        feeds = random_feeds(loaded.inputs, seed=seed)
        groups = [alternatives] if together else [[a] for a in alternatives]
        times: dict = {}
        shares = []
        for group in groups:
            runners = {}
            try:
                for alt in group:
                    runners[alt.name] = CpuLauncher(built[key(alt)][0], threads_per_engine=alt.threads)
                # one at a time: an alternative clearly behind those timed before it stops as it would beside them
                lead = min((float(np.median(t)) for t in times.values()), default=None)
                with bench.OthersLoad() as others:
                    times.update(bench.race_calls(runners, feeds, runs=runs, behind=2 * CPU_MARGIN, lead_s=lead))
                shares.append(others.share)
            finally:
                for r in runners.values():
                    r.close()
                runners.clear()  # their sessions (and weights) go now, not with the next group's
        chosen, rows = decide_by_timing(times, [a.name for a in alternatives], floor=CPU_MARGIN)
        for alt, row in zip(alternatives, rows):
            row.update(streams=alt.sched.num_streams, sessions=len(alt.sched.branches), threads=alt.threads or cores)
        share = max((x for x in shares if x is not None), default=None)
        busy = share is not None and share > CPU_BUSY_SHARE
        if chosen == alternatives[0].name:
            decision = "the default: no alternative was timed faster beyond the noise"
        elif busy:
            decision = (f"the default: {chosen} was timed faster, but other processes used {share:.0%} of the cores "
                        f"meanwhile (more than {CPU_BUSY_SHARE:.0%}): a loaded machine's timings do not replace it")
            chosen = alternatives[0].name
            for row in rows:
                row["chosen"] = row["alternative"] == chosen
        else:
            decision = f"timed faster than the default ({alternatives[0].name}) beyond the noise"
        report.update(timed=rows, chosen=chosen, margin=f"max({CPU_MARGIN:.0%}, interquartile spread of either)",
                      others_cpu_share=share, decision=decision,
                      loaded=("together, alternating blocks" if together else
                              f"one at a time (their engines {size / 2**20:.0f} MiB together, above {CPU_INTERLEAVE_BYTES >> 20} MiB)"))
    best = next(a for a in alternatives if a.name == chosen)
    if key(best) not in built:
        return best.model, best.graph, best.sched, best.threads, report, None
    kept, best_report = built[key(best)]
    files = {b.name: (kept.engine_path(b), best_report.get(b.name)) for b in kept.plan.branches}
    return best.model, best.graph, best.sched, best.threads, report, files


def _cpu_scratch_bundle(engines: EngineMaker, dest: Path, alt: CpuAlternative, options: BuildOptions,
                        loaded: LoadedModel) -> tuple[Bundle, dict]:
    """The engines of ``alt`` in ``dest``, opened as a bundle to time, with its builder's report (per branch).
    No model.onnx, report or hashed manifest: only the launcher reads it, and only its plan and engines."""
    dest.mkdir()
    plan = engines.plan_of_schedule(alt.graph, alt.sched)
    # unchecked: the launcher that times it loads every engine next (its errors name the node there)
    v = Variant(alt.model, alt.graph, plan, replace(options, check=False))
    rep = engines.write(dest, v, "candidate", model_file=False)
    return Bundle(path=dest, manifest=engines.manifest_of(v), plan=plan, report={}), rep
