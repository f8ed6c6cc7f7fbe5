"""parastream.rewrite: the graph rewritten so that a GPU runs it faster in parallel, and provably the same function.

``optimize(model) -> (model, report)`` runs the AutoGraph-style search over the substitution rules of
:mod:`.rules` (``ALL_RULES``), priced by a :class:`~.cost.CostModel` (``RooflineCostModel`` without a GPU,
``ProfiledCostModel`` with per-op figures measured on one).  This package never imports the pipeline or the
launcher (``launcher.errors`` aside).
"""

from __future__ import annotations

from .cost import DEVICES, CostModel, ProfiledCostModel, RooflineCostModel, get_device, mixed_cost, node_flops_bytes
from .rules import ALL_RULES
from .search import format_report, optimize, optimize_graph

__all__ = ["optimize", "optimize_graph",
           "format_report", "RooflineCostModel", "ProfiledCostModel", "CostModel", "ALL_RULES", "DEVICES",
           "get_device", "mixed_cost", "node_flops_bytes"]
