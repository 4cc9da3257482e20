"""THE default pass list: every step :func:`fxpar.plan` and :func:`fxpar.compile` run on a captured
Program, in order, written out in one place.

::

    canonicalize          means into sums, so that sharded reductions stay exact
    rematerialize         the layers options.remat names, and the model's checkpointed calls,
                          recomputed in the backward
    annotate-cost         FLOPs and bytes of every node
    annotate-strategies   candidate strategies of every node on program.cluster's mesh
    choose-strategies     one strategy per node: the solver on the intra-op problem (coarsened,
                          repeated layers merged), or a manual plan

Capture comes before it and lowering after it (:func:`plan_program` runs it on a captured
Program and reads the choice as a :class:`~fxpar.planning.plan.Plan`; :func:`fxpar.compile`'s
driver does the same for every step it makes). To add a pass, edit the pipeline by name and
hand it to ``fxpar.plan`` or ``fxpar.compile`` as ``passes=``::

    passes = default_passes().insert_before("annotate-strategies", MyPass(threshold=4))
    parallel = fxpar.compile(model, cluster, batch, loss_fn, passes=passes)
"""

from __future__ import annotations

import glob
import warnings
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from fxpar.cluster import Cluster
from fxpar.errors import FxparError
from fxpar.ir.program import Program
from fxpar.ir.repeat import StampedLayers
from fxpar.passes.annotate_cost import AnnotateCost
from fxpar.passes.annotate_strategies import AnnotateStrategies
from fxpar.passes.base import PassManager
from fxpar.passes.canonicalize import Canonicalize
from fxpar.passes.choose_strategies import (
    ApplyManualPlan,
    ApplyPlanFile,
    ManualPlan,
    ReplayStrategies,
    SolveFolded,
    SolveStrategies,
)
from fxpar.passes.remat import Rematerialize
from fxpar.planning.plan import Plan
from fxpar.planning.plan_file import saved_cluster
from fxpar.planning.problem import PlanOptions
from fxpar.rules import RuleRegistry
from fxpar.sharding import Spec
from fxpar.solvers.problem import IntraOpSolver


def default_passes(
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


def default_pipeline(**kwargs: Any) -> PassManager:
    """Deprecated name of :func:`default_passes` ("pipeline" now means pipeline parallelism
    only)."""
    warnings.warn(
        "fxpar.passes.default_pipeline is now default_passes", DeprecationWarning, stacklevel=2
    )
    return default_passes(**kwargs)


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


def prepare_for_planning(
    program: Program, cluster: Cluster, rules: RuleRegistry | None = None
) -> Program:
    """The default pipeline's steps before the choice (canonicalize, annotate cost, annotate
    candidate strategies) on ``program`` for ``cluster``: a new Program, ``program`` is left as
    it is."""
    return default_passes(rules=rules).through("annotate-strategies").run(program, cluster=cluster)


def passes_for(
    passes: PassManager | None,
    *,
    solver: IntraOpSolver | None = None,
    manual: ManualPlan | None = None,
    options: PlanOptions | None = None,
    rules: RuleRegistry | None = None,
    pins: Mapping[str, Spec] | None = None,
) -> PassManager:
    """``passes``, or the default pipeline built from the other arguments (which belong to
    :func:`~fxpar.passes.default_passes` when ``passes`` is given); ``pins`` go into the
    options (see :func:`fxpar.plan`)."""
    if pins:
        if passes is not None:
            raise FxparError(
                "passes= is the whole pipeline, so pins= would be ignored: give the pins to its "
                "choose-strategies pass, e.g. default_passes(options=PlanOptions(pins=...))"
            )
        options = replace(options or PlanOptions(), pins=dict(pins))
    if passes is None:
        return default_passes(solver=solver, manual=manual, options=options, rules=rules)
    given = [
        name
        for name, value in (
            ("solver", solver), ("manual", manual), ("options", options), ("rules", rules),
        )
        if value is not None
    ]  # fmt: skip
    if given:
        raise FxparError(
            f"passes= is the whole pipeline, so {', '.join(given)} would be ignored: build the "
            f"pipeline with them, e.g. default_passes({given[0]}=...).insert_before(...)"
        )
    return passes


def keeping_state(
    passes: PassManager, state: Mapping[str, Spec], *, solve: bool = False
) -> PassManager:
    """``passes`` with a solver's choice pinned to keep ``state``'s specs (names escaped, as
    pins are patterns): how a program planned after the training step's keeps every parameter
    and buffer where that plan put it. Other choose-strategies passes are left as they are,
    unless ``solve`` asks for the default solver in their place (a manual plan or a plan file
    is written for the training step, not for a forward or a loss evaluation)."""
    choose = passes.get("choose-strategies")
    if not isinstance(choose, SolveStrategies):
        if not solve:
            return passes
        options = getattr(choose, "options", PlanOptions())
        choose = SolveStrategies(options=options, on_rank_zero=True)
    pins = {**choose.options.pins, **{glob.escape(name): spec for name, spec in state.items()}}
    options = replace(choose.options, pins=pins)
    return passes.replace("choose-strategies", replace(choose, options=options))


def sharing_gradients(passes: PassManager, share: float) -> PassManager:
    """``passes`` with the solver pricing each gradient's synchronisation at ``share`` of its
    cost (:attr:`~fxpar.planning.problem.PlanOptions.gradient_share`): the plan of one of
    ``M`` micro-batches whose gradients are synchronised once a step takes ``1/M``; a pipeline
    stage's, so without dispatching mixture-of-experts tokens by all-to-all
    (:attr:`~fxpar.planning.problem.PlanOptions.moe_dispatch`). A manual choice is left as
    it is."""
    choose = passes.get("choose-strategies")
    if not isinstance(choose, SolveStrategies):
        return passes
    options = replace(choose.options, gradient_share=share, moe_dispatch=False)
    return passes.replace("choose-strategies", replace(choose, options=options))


def plans_folded(passes: PassManager) -> bool:
    """Whether ``passes`` choose the same plan for a stamped step and for the step folded to
    its distinct layers (:mod:`fxpar.ir.fold`): the choice is a solver's on the problem with
    repeated layers merged, which folding keeps, with nothing that tells one layer from
    another (no pins, which may name a layer; remat of no layer or of all)."""
    choose = passes.get("choose-strategies")
    if not isinstance(choose, SolveStrategies):
        return False
    options = choose.options
    return options.dedup_layers and not options.pins and options.remat in ("none", "all")


def replaying(passes: PassManager, plan: Plan) -> PassManager:
    """``passes`` with :class:`~fxpar.passes.ReplayStrategies` choosing ``plan``'s strategies
    instead of a solver, for a program whose problem is ``plan``'s (the step that ``plan``'s
    program was folded from): its decisions are matched by name, and raise
    :class:`~fxpar.errors.FxparError` where they differ."""
    choose = passes.get("choose-strategies")
    assert isinstance(choose, SolveStrategies), "replaying needs a solver's choice"
    return passes.replace("choose-strategies", ReplayStrategies(plan, choose.options))


def plan_program(
    program: Program,
    cluster: Cluster,
    *,
    passes: PassManager | None = None,
    solver: IntraOpSolver | None = None,
    manual: ManualPlan | None = None,
    options: PlanOptions | None = None,
    rules: RuleRegistry | None = None,
    pins: Mapping[str, Spec] | None = None,
) -> Plan:
    """Run ``passes`` (the default pipeline when None; see :func:`passes_for` for the other
    arguments) on a captured ``program`` for ``cluster`` and read the choice as a Plan.

    ``program`` is left exactly as it was (the passes run on their own copy, which
    ``plan.program`` is), so one capture is planned for as many clusters or pass lists as
    asked.

    A stamped ``program`` (:func:`fxpar.ir.repeat.capture_repeated`) whose passes choose alike
    on it and on its folded twin (:func:`plans_folded`) is prepared whole and its choice made
    by :class:`~fxpar.passes.SolveFolded`: solved folded (:mod:`fxpar.ir.fold`, the same
    problem) and given to the step."""
    passes = passes_for(
        passes, solver=solver, manual=manual, options=options, rules=rules, pins=pins
    )
    if program.get(StampedLayers) is not None and plans_folded(passes):
        choose = passes.get("choose-strategies")
        assert isinstance(choose, SolveStrategies)
        passes = passes.replace("choose-strategies", SolveFolded(choose))
    return Plan.of(passes.run(program, cluster=cluster))


def load_plan(
    path: str | Path,
    program: Program,
    cluster: Cluster | None = None,
    rules: RuleRegistry | None = None,
) -> Plan:
    """The plan saved by :meth:`Plan.save` at ``path``, applied to ``program`` (a capture of the
    same model with the same example shapes) and scored by the cost model, without solving.

    The default pipeline runs with :class:`~fxpar.passes.ApplyPlanFile` as its choice.
    ``cluster`` defaults to the one saved in the file; another cluster must have the same mesh
    shape (the plan is then priced on it). ``rules`` must give the nodes the candidates they had
    when the plan was made. Raises :class:`~fxpar.planning.plan_file.PlanFileError` naming the
    node or input that does not fit."""
    cluster = saved_cluster(path, cluster)
    passes = default_passes(rules=rules).replace("choose-strategies", ApplyPlanFile(path))
    return plan_program(program, cluster, passes=passes)


__all__ = [
    "default_passes",
    "default_pipeline",
    "for_compile",
    "keeping_state",
    "load_plan",
    "passes_for",
    "plan_program",
    "plans_folded",
    "prepare_for_planning",
    "replaying",
    "sharing_gradients",
]
