"""fxpar's compiler passes: one pass per module, the pass manager, THE default pass list
(:mod:`.default`, with :func:`plan_program`, which runs it on a Program), and the manual plans
(:mod:`.manual`, public as ``fxpar.plans``)."""

from __future__ import annotations

from fxpar.passes.annotate_cost import AnnotateCost, node_cost
from fxpar.passes.annotate_strategies import AnnotateStrategies
from fxpar.passes.base import Pass, PassManager
from fxpar.passes.canonicalize import Canonicalize
from fxpar.passes.choose_strategies import (
    ApplyManualPlan,
    ApplyPlanFile,
    ManualPlan,
    ReplayStrategies,
    SolveFolded,
    SolveStrategies,
)
from fxpar.passes.default import (
    default_passes,
    default_pipeline,
    for_compile,
    keeping_state,
    load_plan,
    passes_for,
    plan_program,
    plans_folded,
    prepare_for_planning,
    replaying,
    sharing_gradients,
)
from fxpar.passes.remat import Rematerialize, Rematerialized
from fxpar.passes.verify import Verify
from fxpar.planning.plan import ChosenStrategies, RulesUsed

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
    "ReplayStrategies",
    "RulesUsed",
    "SolveFolded",
    "SolveStrategies",
    "Verify",
    "default_passes",
    "default_pipeline",
    "for_compile",
    "keeping_state",
    "load_plan",
    "node_cost",
    "passes_for",
    "plan_program",
    "plans_folded",
    "prepare_for_planning",
    "replaying",
    "sharing_gradients",
]
