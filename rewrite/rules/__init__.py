"""The substitution rules, one family per module, assembled in one plain list.

Each rule: ``name``, ``match(graph) -> list[Site]``, ``check(graph, site) -> reason | None`` and
``apply(graph, site) -> graph`` (pure); see :mod:`.base`.
"""

from __future__ import annotations

from .base import Rule, Site
from .cancel_transpose_reshape import CancelReshapePair, CancelTransposePair, DropNoOpView
from .enlarge_kernel import EnlargeKernel, ShrinkKernel
from .fission import Fission
from .fold_bn_and_affine import FoldBatchNormAndAffine
from .merge_parallel_conv import MergeParallelConv
from .merge_parallel_matmul import MergeParallelMatMul
from .merge_summed import MergeSummed
from .split_concat import ConcatSplit, HoistPointwiseConcat, HoistPointwiseSplit, SinkPointwiseConcat, SplitConcat

# Order matters only for ties: the search tries sites in this order (then by site key).
ALL_RULES: list[Rule] = [
    FoldBatchNormAndAffine(),
    CancelTransposePair(),
    CancelReshapePair(),
    DropNoOpView(),
    SplitConcat(),
    ConcatSplit(),
    MergeSummed(),
    MergeParallelConv(),
    MergeParallelMatMul(),
    EnlargeKernel(),
    ShrinkKernel(),
    HoistPointwiseSplit(),
    HoistPointwiseConcat(),
    SinkPointwiseConcat(),
    Fission(),
]

RULES_BY_NAME: dict[str, Rule] = {r.name: r for r in ALL_RULES}

__all__ = ["ALL_RULES", "RULES_BY_NAME", "Rule", "Site"]
