"""The exact intra-operator solver: the problem as an integer linear program, solved by HiGHS.

The formulation and the reductions applied before the model is built are in
:mod:`fxpar.solvers.ilp_model`. Where the memory row binds, :class:`ILPSolver` runs the branch
and bound of :mod:`fxpar.solvers.ilp_search` (``branching=True``, the default), which replaces
the Lagrangian phase below and, unless it cannot decide, HiGHS's MIP. Otherwise, and where the
search cannot decide, HiGHS's MIP solves the model.

HiGHS accepts a row violated by up to its feasibility tolerance, but a memory limit is hard: a
plan HiGHS returns over the limit by a rounding error is refused and the model solved once more
with the budget tightened by that tolerance.

Lagrangian phase (``lagrangian=True``), before the MIP. The memory row is moved into the
objective with a multiplier λ ≥ 0: for every λ, the LP relaxation of the other rows with costs
c + λ·m, minus λ·budget, is a lower bound on the optimum (weak duality). One HiGHS LP is kept and
only its costs change, so each re-solve restarts from the last optimal basis (a fraction of the
first solve). Each solve's plan, every node taking its largest x, is a candidate. λ = 0 comes
first: on the transformer problems this relaxation is integral, so when its plan fits in memory
(or there is no memory row) its cost meets the bound and the plan is returned as optimal without
a MIP. Otherwise λ is multiplied by 4 until the relaxation fits, then bisected on the sign of
its memory excess (the subgradient), until the best fitting plan is within ``mip_gap`` of the
best bound (returned as optimal with that gap) or the steps run out. The bound can never beat
the LP relaxation with the memory row: when memory binds, the gap left is the integrality gap of
the memory row, which only the MIP closes.

Warm start: the cheaper of the :class:`~fxpar.solvers.greedy.GreedySolver` plan and the
problem's own starting plans (:attr:`~fxpar.solvers.problem.IntraOpProblem.starts`, the
hand-written plans when the planner built the problem), given to HiGHS as a MIP start. Whatever
path answers, the answer is compared with the starting plans at the end, so it never costs more
than the cheapest of them that fits: at a time limit the solver still has a plan to return.
The Lagrangian phase's best plan is often much better, but it is deliberately not the MIP start:
a near-optimal incumbent makes HiGHS fix columns by reduced cost at once and restart over and
over, so that proving even the optimum, given as the start, takes longer than from the greedy
start. When HiGHS stops on its time limit, the cheapest of its plan, the warm start and the
Lagrangian plans that fit is returned with status ``"time_limit"`` and the gap to the better
of HiGHS's bound and the Lagrangian bound.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import ClassVar, NamedTuple

import highspy
import numpy as np

from fxpar.errors import FxparError
from fxpar.solvers.descent import AxisDescent
from fxpar.solvers.errors import (
    InfeasiblePlanError,
    NoPlanFoundError,
    check_memory_feasible,
    format_bytes,
)
from fxpar.solvers.greedy import GreedySolver
from fxpar.solvers.ilp_model import (
    Reduced,
    build_model,
    check,
    memory_limit,
    memory_over,
    model_size,
    new_highs,
    reduce_problem,
    relative_gap,
)
from fxpar.solvers.ilp_search import branch_and_bound
from fxpar.solvers.problem import SHARED_READ, IntraOpProblem, IntraOpSolution, Status

__all__ = ["ILPSolver", "model_size"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ILPSolver:
    """Solve the intra-op problem exactly with HiGHS (formulation in the module docstring).

    ``time_limit`` in seconds; ``mip_gap`` the relative optimality gap at which HiGHS may stop
    and call the plan optimal; ``warm_start`` gives HiGHS the cheaper of the greedy plan and
    the problem's starting plans to start from (the answer never costs more than a starting
    plan that fits, either way);
    ``lagrangian`` first solves the LP relaxation with the memory row moved into the objective
    (module docstring), which alone proves many plans optimal and otherwise gives a fallback
    plan and a lower bound for when HiGHS runs out of time;
    ``branching`` replaces the Lagrangian phase and HiGHS's MIP by the memory-level branch and
    bound when the memory row binds (module docstring), falling back to them only where the
    branch and bound cannot decide;
    ``threads`` the size of HiGHS's thread pool (None: HiGHS's default). HiGHS's pool is global
    to the process, so choosing ``threads`` restarts it: do not run other HiGHS solves in other
    threads at the same time;
    ``workers`` how many LPs the branch and bound solves at the same time, each on its own
    thread (1: all on the calling thread); for a given number the plan is the same on every run;
    ``descent``: on a mesh of three or more axes, first run
    :class:`~fxpar.solvers.descent.AxisDescent` (an axis or two at a time, each step by this
    solver) and start the model from its plan: where memory binds, the relaxation of a
    three-axis problem is weak, and the descent's plan is often better than what the model
    finds in its time limit;
    ``largest``: a problem on three or more axes whose edges hold more than this many pairs of
    strategies is too large for one model (a two-layer GPT's step on (2, 2, 2) holds 1.6
    million, Llama-3-8B's 5.8 million): the descent's plan is the answer, a local optimum rather
    than a proven one (None: always one model).
    """

    name: ClassVar[str] = "ilp"
    time_limit: float = 30.0
    mip_gap: float = 1e-6
    warm_start: bool = True
    lagrangian: bool = True
    branching: bool = True
    threads: int | None = None
    workers: int = 2
    descent: bool = True
    largest: int | None = 200_000

    def solve(self, problem: IntraOpProblem) -> IntraOpSolution:
        start = time.perf_counter()
        if self.descent and AxisDescent.splits(problem):
            inner = dataclasses.replace(self, descent=False)
            descended = AxisDescent(inner, time_limit=self.time_limit).solve(problem)
            pairs = sum(len(edge.costs) * len(edge.costs[0]) for edge in problem.edges)
            if self.largest is not None and pairs > self.largest:
                return descended
            problem = dataclasses.replace(problem, starts=(*problem.starts, descended.choice))
        check_memory_feasible(problem)
        reduced = reduce_problem(problem)
        known = problem.best_start()
        if not reduced.free:
            choice = reduced.plan(np.zeros(0))
            return self._solution(problem, choice, "optimal", 0.0, start, known)
        warm = None
        if self.warm_start:
            greedy = GreedySolver().solve(problem).choice
            warm = min([p for p in (greedy, known) if p is not None], key=problem.objective)
        found = _Relaxed([], -math.inf)
        if self.branching and memory_limit(reduced, tightening=0.0):
            remaining = self.time_limit - (time.perf_counter() - start)
            decided = branch_and_bound(
                problem, reduced, warm, remaining, self.mip_gap, self.threads, self.workers
            )
            if decided is not None:
                status, choice, gap = decided
                return self._solution(problem, choice, status, gap, start, known)
        elif self.lagrangian:
            remaining = self.time_limit - (time.perf_counter() - start)
            found = _lagrangian(problem, reduced, remaining, self.mip_gap, self.threads)
        fitting = [plan for plan in found.plans if memory_over(problem, plan) <= 0]
        if fitting:
            best = min(fitting, key=problem.objective)
            gap = relative_gap(problem.objective(best), found.lower_bound)
            if gap <= self.mip_gap:
                return self._solution(problem, best, "optimal", gap, start, known)
        tightening = 0.0
        while True:
            model = build_model(reduced, tightening)
            remaining = self.time_limit - (time.perf_counter() - start)
            status, choice, gap = self._run(problem, reduced, model, warm, known, remaining, found)
            excess = memory_over(problem, choice)
            if excess <= 0:
                return self._solution(problem, choice, status, gap, start, known)
            if tightening > 0:
                raise FxparError(
                    f"HiGHS returned a plan {excess:.0f} bytes over the memory limit twice; "
                    f"the memory figures may be too large for double precision"
                )
            logger.info(
                "HiGHS's plan is %.0f bytes over the memory limit (within its feasibility "
                "tolerance); solving again with the budget tightened",
                excess,
            )
            tightening = 4 * _MIP_FEASIBILITY_TOLERANCE
            reduced = dataclasses.replace(reduced, memory_row=True)

    def _run(
        self,
        problem: IntraOpProblem,
        reduced: Reduced,
        model: highspy.HighsLp,
        warm: tuple[int, ...] | None,
        known: tuple[int, ...] | None,
        seconds: float,
        relaxed: _Relaxed,
    ) -> tuple[Status, tuple[int, ...], float]:
        """Solve ``model`` with HiGHS from ``warm``; at the time limit, the cheapest of its plan,
        ``warm``, the best starting plan ``known`` and the fitting plans of ``relaxed``."""
        highs = new_highs(self.threads)
        if SHARED_READ in problem.kinds:
            # Their LP relaxation is weak (half-integral on a one-layer GPT), and after
            # HiGHS's presolve its root spends long in cuts, several times what the whole
            # solve takes without presolve. Problems without them solve as fast or faster
            # with it.
            highs.setOptionValue("presolve", "off")
        highs.setOptionValue("time_limit", max(seconds, 1e-3))
        highs.setOptionValue("mip_rel_gap", self.mip_gap)
        highs.setOptionValue("mip_abs_gap", 0.0)
        highs.setOptionValue("mip_feasibility_tolerance", _MIP_FEASIBILITY_TOLERANCE)
        check(highs.passModel(model), "passing the model to HiGHS")
        start_values = reduced.start_values(warm) if warm is not None else None
        if start_values is not None:
            start = highspy.HighsSolution()
            start.col_value = start_values
            check(highs.setSolution(start), "setting the warm start")
        check(highs.run(), "solving")
        model_status = highs.getModelStatus()
        info = highs.getInfo()
        has_plan = info.primal_solution_status == highspy.kSolutionStatusFeasible
        if model_status == highspy.HighsModelStatus.kOptimal:
            values = np.asarray(highs.getSolution().col_value, dtype=np.float64)
            return "optimal", reduced.plan(values), _clean_gap(info.mip_gap)
        if model_status == highspy.HighsModelStatus.kTimeLimit:
            # HiGHS may stop before it has read the warm start: the start is a plan too, and
            # so are the Lagrangian phase's plans that fit.
            plans = [plan for plan in (warm, known) if plan is not None]
            plans += [plan for plan in relaxed.plans if memory_over(problem, plan) <= 0]
            if has_plan:
                plans.insert(0, reduced.plan(np.asarray(highs.getSolution().col_value)))
            if not plans:
                raise NoPlanFoundError(
                    f"HiGHS found no plan within time_limit={self.time_limit}s; raise the time "
                    f"limit, or keep warm_start=True (the greedy plan is always a valid start)"
                )
            best = min(plans, key=problem.objective)
            bound = max(
                _finite(info.mip_dual_bound * reduced.cost_scale),
                relaxed.lower_bound,
                problem.floor(),
            )
            return "time_limit", best, relative_gap(problem.objective(best), bound)
        if model_status == highspy.HighsModelStatus.kInfeasible:
            # The most frugal plan fits (checked before), so only rounding can get here.
            limit = problem.memory_limit if problem.memory_limit is not None else math.inf
            raise InfeasiblePlanError(
                f"HiGHS found no plan under the memory limit of "
                f"{format_bytes(limit)}, though the most memory-frugal plan "
                f"needs {format_bytes(problem.least_memory())} by the problem's figures: the "
                f"margin is below HiGHS's feasibility tolerance. Raise the memory limit a little, "
                f"or use more devices.",
                least_memory=problem.least_memory(),
                memory_limit=limit,
            )
        raise FxparError(
            f"HiGHS stopped without a plan: model status "
            f"{highs.modelStatusToString(model_status)!r}"
        )

    def _solution(
        self,
        problem: IntraOpProblem,
        choice: tuple[int, ...],
        status: Status,
        gap: float,
        start: float,
        known: tuple[int, ...] | None,
    ) -> IntraOpSolution:
        """The solution of ``choice``, or of the best starting plan ``known`` if it costs less."""
        if known is not None and problem.objective(known) < problem.objective(choice):
            # Only where the search stopped early, or within HiGHS's tolerances.
            choice = known
        if status == "time_limit":
            logger.warning(
                "the ILP stopped at its time limit of %.0f s with a plan within %.1f%% of the "
                "optimum; raise ILPSolver(time_limit=...) for a proven optimum",
                self.time_limit,
                100 * gap,
            )
        return IntraOpSolution(
            choice=choice,
            objective=problem.objective(choice),
            status=status,
            gap=gap,
            solver=self.name,
            seconds=time.perf_counter() - start,
        )


_MIP_FEASIBILITY_TOLERANCE = 1e-6
"""HiGHS's default, set explicitly because the memory re-solve depends on it."""


# --- The Lagrangian phase ---------------------------------------------------------------------


class _Relaxed(NamedTuple):
    """What the Lagrangian phase found: rounded plans (fitting or not) and a lower bound on the
    optimum in the problem's units (−inf when it found none)."""

    plans: list[tuple[int, ...]]
    lower_bound: float


_DOUBLINGS = 40
"""The most times the multiplier is multiplied by 4 in search of a plan within the budget."""
_BISECTIONS = 24
"""The most bisection steps on the multiplier."""
_MULTIPLIER_TOLERANCE = 1e-3
"""Bisection stops once λ is pinned to this relative precision: the bound, concave and piecewise
linear in λ, then sits at its best breakpoint or next to it, and more steps re-solve that one."""


def _lagrangian(
    problem: IntraOpProblem,
    reduced: Reduced,
    time_limit: float,
    mip_gap: float,
    threads: int | None = None,
) -> _Relaxed:
    """Bisect on the multiplier λ of the memory row (module docstring, "Lagrangian phase").

    One HiGHS LP without the memory row is kept and re-solved with costs c + λ·m: only the
    objective changes, so each solve restarts from the last optimal basis and takes a fraction
    of the first. Every solve gives a lower bound, LP(λ) − λ·budget, and a plan (each node's
    largest x). λ moves up while the relaxation's memory is over the budget, down otherwise.
    """
    start = time.perf_counter()
    model = build_model(dataclasses.replace(reduced, memory_row=False), tightening=0.0)
    model.integrality_ = [highspy.HighsVarType.kContinuous] * model.num_col_
    base_costs = np.asarray(model.col_cost_, dtype=np.float64)
    memory = np.zeros(model.num_col_)
    if reduced.excess is not None:
        for v, column in reduced.node_columns().items():
            memory[column : column + len(reduced.candidates[v])] = reduced.excess[v]
    columns = np.arange(model.num_col_, dtype=np.int32)
    highs = new_highs(threads)
    check(highs.passModel(model), "passing the relaxation to HiGHS")
    found = _Relaxed([], -math.inf)

    def relax(multiplier: float) -> float | None:
        """Solve at ``multiplier``; record its plan and bound; return the relaxation's memory
        over the budget (None when the time ran out)."""
        nonlocal found
        remaining = time_limit - (time.perf_counter() - start)
        if remaining <= 0:
            return None
        highs.setOptionValue("time_limit", remaining)
        if multiplier > 0:
            costs = base_costs + multiplier * memory
            check(highs.changeColsCost(len(columns), columns, costs), "changing the costs")
        check(highs.run(), "solving the relaxation")
        if highs.getModelStatus() != highspy.HighsModelStatus.kOptimal:
            return None
        values = np.asarray(highs.getSolution().col_value, dtype=np.float64)
        value = highs.getInfo().objective_function_value
        # (Without a memory limit the budget is infinite and only λ = 0 is tried.)
        penalty = multiplier * reduced.memory_budget if multiplier > 0 else 0.0
        bound = (value - penalty) * reduced.cost_scale
        found = _Relaxed([*found.plans, reduced.plan(values)], max(found.lower_bound, bound))
        return float(memory @ values) - reduced.memory_budget

    def settled() -> bool:
        fitting = [plan for plan in found.plans if memory_over(problem, plan) <= 0]
        best = min(map(problem.objective, fitting), default=math.inf)
        return relative_gap(best, found.lower_bound) <= mip_gap

    over = relax(0.0)
    if over is None or not reduced.memory_row or over <= 0 or settled():
        return found
    low, high = 0.0, 1.0
    for _ in range(_DOUBLINGS):
        over = relax(high)
        if over is None or settled():
            return found
        if over <= 0:
            break
        low, high = high, 4 * high
    for _ in range(_BISECTIONS):
        if high - low <= _MULTIPLIER_TOLERANCE * high:
            break
        middle = (low + high) / 2
        over = relax(middle)
        if over is None or settled():
            break
        if over > 0:
            low = middle
        else:
            high = middle
    return found


def _finite(value: float) -> float:
    return value if math.isfinite(value) else -math.inf


def _clean_gap(gap: float) -> float:
    return max(gap, 0.0) if math.isfinite(gap) else math.inf
