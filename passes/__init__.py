"""fxpar's compiler passes: one pass per module, the pass manager and THE default pipeline."""

from __future__ import annotations

from fxpar.passes.annotate_cost import AnnotateCost, node_cost
from fxpar.passes.annotate_strategies import AnnotateStrategies, RulesUsed
from fxpar.passes.base import Pass, PassManager
from fxpar.passes.canonicalize import Canonicalize
from fxpar.passes.choose_strategies import (
    ApplyManualPlan,
    ApplyPlanFile,
    ChosenStrategies,
    ManualPlan,
    SolveStrategies,
)
from fxpar.passes.pipeline import default_pipeline, for_compile
from fxpar.passes.remat import Rematerialize, Rematerialized
from fxpar.passes.verify import Verify

__all__ = [
    "AnnotateCost",
    "AnnotateStrategies",
    "ApplyManualPlan",
    "ApplyPlanFile",
    "Canonicalize",
    "ChosenStrategies",
    "ManualPlan",
    "Pass",
    "PassManager",
    "Rematerialize",
    "Rematerialized",
    "RulesUsed",
    "SolveStrategies",
    "Verify",
    "default_pipeline",
    "for_compile",
    "node_cost",
]
