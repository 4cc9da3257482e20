"""THE pass pipeline: every step :func:`fxpar.plan` and :func:`fxpar.compile` run on a captured
Program, in order, written out in one place.

::

    canonicalize          means into sums, so that sharded reductions stay exact
    rematerialize         the layers options.remat names, and the model's checkpointed calls,
                          recomputed in the backward
    annotate-cost         FLOPs and bytes of every node
    annotate-strategies   candidate strategies of every node on program.cluster's mesh
    choose-strategies     one strategy per node: the solver on the intra-op problem (coarsened,
                          repeated layers merged), or a manual plan

Capture comes before it and lowering after it (:func:`fxpar.plan_program` and
:func:`fxpar.compile` read like that). To add a pass, edit the pipeline by name and hand it to
``fxpar.plan`` or ``fxpar.compile`` as ``passes=``::

    passes = default_pipeline().insert_before("annotate-strategies", MyPass(threshold=4))
    parallel = fxpar.compile(model, cluster, batch, loss_fn, passes=passes)
"""

from __future__ import annotations

from dataclasses import replace

from fxpar.errors import FxparError
from fxpar.passes.annotate_cost import AnnotateCost
from fxpar.passes.annotate_strategies import AnnotateStrategies
from fxpar.passes.base import PassManager
from fxpar.passes.canonicalize import Canonicalize
from fxpar.passes.choose_strategies import ApplyManualPlan, ManualPlan, SolveStrategies
from fxpar.passes.remat import Rematerialize
from fxpar.planning.problem import PlanOptions
from fxpar.rules import RuleRegistry
from fxpar.solvers.problem import IntraOpSolver


def default_pipeline(
    *,
    solver: IntraOpSolver | None = None,
    manual: ManualPlan | None = None,
    options: PlanOptions | None = None,
    rules: RuleRegistry | None = None,
    verify: bool = False,
) -> PassManager:
    """fxpar's passes in order (module docstring).

    ``solver`` chooses the strategies (the HiGHS ILP when None) under ``options``; ``manual``
    chooses them with a manual plan instead (``fxpar.plans.data_parallel``, say), not both.
    ``rules`` gives the candidate strategies (:func:`fxpar.rules.default_rules` when None).
    ``verify`` checks the IR after each pass (debug mode)."""
    options = options or PlanOptions()
    if manual is not None and solver is not None:
        raise FxparError(
            f"give a solver ({solver!r}) or a manual plan "
            f"({getattr(manual, '__name__', manual)!r}), not both: a manual plan chooses every "
            "strategy itself"
        )
    choose = (
        ApplyManualPlan(manual, options) if manual is not None else SolveStrategies(solver, options)
    )
    return PassManager(
        (
            Canonicalize(),
            Rematerialize(options.remat),
            AnnotateCost(),
            AnnotateStrategies(rules),
            choose,
        ),
        verify=verify,
    )


def for_compile(passes: PassManager, *, optimizer_states: int | None = None) -> PassManager:
    """``passes`` as :func:`fxpar.compile` runs them on every rank: a solver's choice is made
    on rank 0 and broadcast (``SolveStrategies(on_rank_zero=True)``), so that every rank lowers
    the same plan, and the memory model counts ``optimizer_states`` copies of each parameter's
    piece (the optimizer's). A ``choose-strategies`` pass of the user's own must make the same
    choice on every rank by itself."""
    choose = passes.get("choose-strategies")
    if choose is None:
        return passes
    if isinstance(choose, (SolveStrategies, ApplyManualPlan)) and optimizer_states is not None:
        choose = replace(choose, options=replace(choose.options, optimizer_states=optimizer_states))
    if isinstance(choose, SolveStrategies):
        choose = replace(choose, on_rank_zero=True)
    return passes.replace("choose-strategies", choose)
