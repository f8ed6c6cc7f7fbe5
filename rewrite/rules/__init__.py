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
from .fuse_attention import FuseAttention
from .fuse_gemm_epilogue import FuseGemmBias, FuseGemmEpilogue
from .merge_parallel_conv import MergeParallelConv
from .merge_parallel_matmul import MergeParallelMatMul
from .merge_summed import MergeSummed
from .split_concat import ConcatSplit, HoistPointwiseConcat, HoistPointwiseSplit, SinkPointwiseConcat, SplitConcat

# Order matters only for ties: the search tries sites in this order (then by site key).
EVERY_RULE: list[Rule] = [
    FoldBatchNormAndAffine(),
    FuseAttention(),
    FuseGemmEpilogue(),
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
    FuseGemmBias(),  # last: the other rules' sites that start at a MatMul and its bias go first
]


def rules_for(backend: str | None) -> list[Rule]:
    """The rules a search for ``backend``'s engines uses: every rule that leaves plain ONNX, and those whose
    ``backends`` name it (their fused nodes only those backends run); None: the plain-ONNX rules alone."""
    return [r for r in EVERY_RULE if r.backends is None or (backend is not None and backend in r.backends)]


#: the rules whose result every backend runs (``optimize``'s default)
ALL_RULES: list[Rule] = rules_for(None)

RULES_BY_NAME: dict[str, Rule] = {r.name: r for r in EVERY_RULE}



def rules_named(names: list, backend: str | None) -> list[Rule]:
    """The rules of ``names`` (rule names, or rules) that a search for ``backend``'s engines may use; a name that
    is no rule, or a rule whose fused nodes the backend does not run, is a ParastreamError naming it."""
    from parastream.core.errors import ParastreamError

    allowed = {r.name for r in rules_for(backend)}
    out = []
    for n in names:
        name = n if isinstance(n, str) else n.name
        if name not in RULES_BY_NAME:
            raise ParastreamError(f"search option rules: {name!r} is not a rewrite rule (the rules: "
                                  f"{', '.join(sorted(RULES_BY_NAME))})")
        if name not in allowed:
            raise ParastreamError(f"search option rules: {name!r} writes nodes the {backend} backend does not run")
        out.append(RULES_BY_NAME[name])
    return out


__all__ = ["ALL_RULES", "EVERY_RULE", "RULES_BY_NAME", "Rule", "Site", "rules_for", "rules_named"]
