"""The exact intra-operator solver: the problem as an integer linear program, solved by HiGHS.

Formulation (Alpa's, with the tight linearization of the edge terms). For every node v and
strategy s of v, a binary x[v,s] = 1 when v takes s; for every edge (u,v) whose cost matrix R[uv]
survives the reductions below, a continuous e[uv,s,t] ∈ [0,1] standing for x[u,s]·x[v,t]:

    minimize    Σ_v Σ_s c[v,s]·x[v,s]  +  Σ_(u,v) Σ_s Σ_t R[uv,s,t]·e[uv,s,t]      (objective)

    subject to  Σ_s x[v,s] = 1                      for every node v        (one strategy per node)
                Σ_t e[uv,s,t] = x[u,s]              for every edge, every s    (edge consistency)
                Σ_s e[uv,s,t] = x[v,t]              for every edge, every t    (edge consistency)
                Σ_v Σ_s m[v,s]·x[v,s] ≤ M                                          (memory limit)
                x[v,s] ∈ {0,1},  e[uv,s,t] ∈ [0,1]

The two consistency families make e[uv,·,·] a joint distribution whose marginals are x[u,·] and
x[v,·]; with one-hot marginals the only such distribution is the product, so e is integral as
soon as x is, and its LP relaxation is at least as tight as the usual e ≥ x[u,s] + x[v,t] − 1.

Reductions, applied before the model is built (each keeps the optimum; the reported objective is
always recomputed with :meth:`IntraOpProblem.objective`, so it is exact):

1. **Memory pruning.** Memory is additive, so with m_min[v] = min_s m[v,s] every plan needs at
   least L = Σ_v m_min[v]. If L > M no plan fits and :class:`InfeasiblePlanError` is raised
   without calling HiGHS. A strategy with m[v,s] − m_min[v] > M − L can never fit: it gets no
   variable. The memory row is written over the excess m[v,s] − m_min[v] against the budget
   M − L, scaled to 1, and dropped when even the hungriest plan fits.
1b. **Dominance.** A strategy that another strategy of the same node matches or beats on its
   cost, its memory and every edge (against the neighbour's remaining strategies) is dropped;
   repeated until nothing changes.
2. **Fixed nodes.** A node left with one strategy is decided: it gets no variable, its cost is a
   constant of the objective.
3. **Edge merging.** Self-loops (u = v) add their diagonal to the node's costs; parallel and
   opposite edges between the same two nodes add up into one matrix, one set of e variables.
4. **Separable edges.** An edge matrix that splits as R[s,t] = a[s] + b[t] (constant and all-zero
   matrices, and every edge touching a fixed node, are such) adds a to u's costs and b to v's
   and gets no e variables.
5. **Edge classes.** On one edge, candidates of u with identical cost rows (of v, identical
   columns) are interchangeable: e gets one variable per pair of classes, and the consistency
   rows equate e's marginals with the class sums of x. On 2-D meshes this halves the edge
   variables (many strategies produce, or read, the same layout).
6. **Scaling.** Costs are divided by the largest one, so HiGHS's tolerances are relative to the
   problem's own magnitudes (costs in seconds are tiny); the optimality gap is purely relative
   (``mip_abs_gap`` = 0), measured on the whole objective, constants included.

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

Branch and bound on memory levels (``branching=True``, the default where the memory row binds;
it replaces the Lagrangian phase and, unless it cannot decide, the MIP). The LP relaxation
without the memory row is solved first (presolve off: faster cold, and re-solves need none);
its plan is returned as optimal when it fits and meets the bound. Otherwise the row is added,
the model passed whole with the last basis (HiGHS re-solves it faster than one grown by
``addRow``), and a best-first search runs over that single LP, each node re-solved by warm dual
simplex with some x columns fixed at 0. A node is split on the node v whose relaxation spreads
over memory levels (its distinct memory figures) with the most memory at stake, largest excess
× weight off its main level: one child keeps the levels up to the cut that balances the weight,
the other the levels above it, so neither keeps the parent's point; with every node on one
level, a fractional node is split among its candidates the same way. Each node's rounded plan
that fits is an incumbent; each new incumbent fixes at 0 every column whose reduced cost at
the root exceeds the gap between it and the root bound, and each node, before it splits, fixes
at 0 for its whole subtree the columns whose reduced cost at that node exceeds the gap between
the incumbent and the node's own bound (far more than the root's, as the bounds close in: 10.8
s of LPs fell to 5.9 s on Llama-8B at 80 GiB). Only the bounds that change are sent to HiGHS.
A node closes when its bound is within ``mip_gap`` of the incumbent, or its relaxation is
integral. This is exact as HiGHS's MIP is (up to the LP tolerances both trust): the merged
layers move memory in lumps of 8–34 GiB, the relaxation mixes plans on both sides of the limit,
and splitting the few heavy nodes by level removes the mixture (Llama-8B on 2x4 at 80 GiB: 39
LPs, 6.3 s against 45 s for HiGHS's MIP).
Where the search cannot decide (HiGHS stops on an LP with time left, or an integral relaxation
is over the limit within HiGHS's tolerance), the MIP below solves the problem instead; on its
time limit the search returns its incumbent with status ``"time_limit"``.

Warm start: the :class:`~fxpar.solvers.greedy.GreedySolver` plan, given to HiGHS as a MIP start.
The Lagrangian phase's best plan is often much better, but it is deliberately not the MIP start:
measured on Llama-8B at 80 GiB, HiGHS given the optimum as its start took 66 s to prove it
against 39 s from the greedy start (a near-optimal incumbent makes it fix columns by reduced
cost at once and restart over and over). When HiGHS stops on its time limit, the cheapest of its
plan, the warm start and the Lagrangian plans that fit is returned with status ``"time_limit"``
and the gap to the better of HiGHS's bound and the Lagrangian bound.
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
import math
import time
from typing import ClassVar, NamedTuple

import highspy
import numpy as np
import numpy.typing as npt

from fxpar.errors import FxparError
from fxpar.solvers.errors import (
    InfeasiblePlanError,
    NoPlanFoundError,
    check_memory_feasible,
    format_bytes,
)
from fxpar.solvers.greedy import GreedySolver
from fxpar.solvers.problem import IntraOpProblem, IntraOpSolution, Status

logger = logging.getLogger(__name__)

_Vector = npt.NDArray[np.float64]
_Matrix = npt.NDArray[np.float64]

_SEPARABLE_TOLERANCE = 1e-12
"""Relative to an edge matrix's largest entry: how far it may be from a[s] + b[t] to be folded."""
_MEMORY_SLACK = 1e-9
"""Relative to the memory limit: the rounding margin under which pruning stays conservative."""


@dataclasses.dataclass(frozen=True)
class ILPSolver:
    """Solve the intra-op problem exactly with HiGHS (formulation in the module docstring).

    ``time_limit`` in seconds; ``mip_gap`` the relative optimality gap at which HiGHS may stop
    and call the plan optimal; ``warm_start`` gives HiGHS the greedy plan to start from;
    ``lagrangian`` first solves the LP relaxation with the memory row moved into the objective
    (module docstring), which alone proves many plans optimal and otherwise gives a fallback
    plan and a lower bound for when HiGHS runs out of time;
    ``branching`` replaces the Lagrangian phase and HiGHS's MIP by the memory-level branch and
    bound when the memory row binds (module docstring), falling back to them only where the
    branch and bound cannot decide;
    ``threads`` the size of HiGHS's thread pool (None: HiGHS's default). HiGHS's pool is global
    to the process, so choosing ``threads`` restarts it: do not run other HiGHS solves in other
    threads at the same time.
    """

    name: ClassVar[str] = "ilp"
    time_limit: float = 30.0
    mip_gap: float = 1e-6
    warm_start: bool = True
    lagrangian: bool = True
    branching: bool = True
    threads: int | None = None

    def solve(self, problem: IntraOpProblem) -> IntraOpSolution:
        start = time.perf_counter()
        check_memory_feasible(problem)
        reduced = _reduce(problem)
        if not reduced.free:
            choice = reduced.plan(np.zeros(0))
            return self._solution(problem, choice, "optimal", 0.0, start)
        warm = GreedySolver().solve(problem).choice if self.warm_start else None
        found = _Relaxed([], -math.inf)
        if self.branching and _memory_limit(reduced, tightening=0.0):
            remaining = self.time_limit - (time.perf_counter() - start)
            decided = _branch_and_bound(
                problem, reduced, warm, remaining, self.mip_gap, self.threads
            )
            if decided is not None:
                status, choice, gap = decided
                return self._solution(problem, choice, status, gap, start)
        elif self.lagrangian:
            remaining = self.time_limit - (time.perf_counter() - start)
            found = _lagrangian(problem, reduced, remaining, self.mip_gap, self.threads)
        fitting = [plan for plan in found.plans if _memory_over(problem, plan) <= 0]
        if fitting:
            best = min(fitting, key=problem.objective)
            gap = _relative_gap(problem.objective(best), found.lower_bound)
            if gap <= self.mip_gap:
                return self._solution(problem, best, "optimal", gap, start)
        tightening = 0.0
        while True:
            model = _build_model(reduced, tightening)
            remaining = self.time_limit - (time.perf_counter() - start)
            status, choice, gap = self._run(problem, reduced, model, warm, remaining, found)
            excess = _memory_over(problem, choice)
            if excess <= 0:
                return self._solution(problem, choice, status, gap, start)
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
        reduced: _Reduced,
        model: highspy.HighsLp,
        warm: tuple[int, ...] | None,
        seconds: float,
        relaxed: _Relaxed,
    ) -> tuple[Status, tuple[int, ...], float]:
        highs = _highs(self.threads)
        highs.setOptionValue("time_limit", max(seconds, 1e-3))
        highs.setOptionValue("mip_rel_gap", self.mip_gap)
        highs.setOptionValue("mip_abs_gap", 0.0)
        highs.setOptionValue("mip_feasibility_tolerance", _MIP_FEASIBILITY_TOLERANCE)
        _check(highs.passModel(model), "passing the model to HiGHS")
        start_values = reduced.start_values(warm) if warm is not None else None
        if start_values is not None:
            start = highspy.HighsSolution()
            start.col_value = start_values
            _check(highs.setSolution(start), "setting the warm start")
        _check(highs.run(), "solving")
        model_status = highs.getModelStatus()
        info = highs.getInfo()
        has_plan = info.primal_solution_status == highspy.kSolutionStatusFeasible
        if model_status == highspy.HighsModelStatus.kOptimal:
            values = np.asarray(highs.getSolution().col_value, dtype=np.float64)
            return "optimal", reduced.plan(values), _clean_gap(info.mip_gap)
        if model_status == highspy.HighsModelStatus.kTimeLimit:
            # HiGHS may stop before it has read the warm start: the start is a plan too, and
            # so are the Lagrangian phase's plans that fit.
            plans = [] if warm is None else [warm]
            plans += [plan for plan in relaxed.plans if _memory_over(problem, plan) <= 0]
            if has_plan:
                plans.insert(0, reduced.plan(np.asarray(highs.getSolution().col_value)))
            if not plans:
                raise NoPlanFoundError(
                    f"HiGHS found no plan within time_limit={self.time_limit}s; raise the time "
                    f"limit, or keep warm_start=True (the greedy plan is always a valid start)"
                )
            best = min(plans, key=problem.objective)
            bound = max(info.mip_dual_bound * reduced.cost_scale, relaxed.lower_bound)
            return "time_limit", best, _relative_gap(problem.objective(best), bound)
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
    ) -> IntraOpSolution:
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
    reduced: _Reduced,
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
    model = _build_model(dataclasses.replace(reduced, memory_row=False), tightening=0.0)
    model.integrality_ = [highspy.HighsVarType.kContinuous] * model.num_col_
    base_costs = np.asarray(model.col_cost_, dtype=np.float64)
    memory = np.zeros(model.num_col_)
    if reduced.excess is not None:
        for v, column in reduced.node_columns().items():
            memory[column : column + len(reduced.candidates[v])] = reduced.excess[v]
    columns = np.arange(model.num_col_, dtype=np.int32)
    highs = _highs(threads)
    _check(highs.passModel(model), "passing the relaxation to HiGHS")
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
            _check(highs.changeColsCost(len(columns), columns, costs), "changing the costs")
        _check(highs.run(), "solving the relaxation")
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
        fitting = [plan for plan in found.plans if _memory_over(problem, plan) <= 0]
        best = min(map(problem.objective, fitting), default=math.inf)
        return _relative_gap(best, found.lower_bound) <= mip_gap

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


# --- Branch and bound on memory levels --------------------------------------------------------


_INTEGRAL = 1e-6
"""How close to 0 or 1 a relaxation's value must be to count as decided."""


class _Subproblem(NamedTuple):
    """An open node of the search: its parent's bound (scaled costs), the x columns it
    forbids, and the columns its ancestors fixed at 0."""

    bound: float
    order: int
    forbidden: frozenset[int]
    fixed: npt.NDArray[np.bool_]
    """Columns at 0 by reduced-cost fixing at this node's ancestors."""


def _branch_and_bound(
    problem: IntraOpProblem,
    reduced: _Reduced,
    warm: tuple[int, ...] | None,
    time_limit: float,
    mip_gap: float,
    threads: int | None = None,
) -> tuple[Status, tuple[int, ...], float] | None:
    """Best-first branch and bound over the LP relaxation with the memory row (module
    docstring, "Branch and bound"); None where it cannot decide (HiGHS stopped on an LP, or a
    plan it found fits only within HiGHS's tolerance), leaving the problem to the MIP."""
    start = time.perf_counter()
    if not _memory_limit(reduced, tightening=0.0):
        return None
    rows = [*_one_strategy_per_node(reduced), *_edge_consistency(reduced)]
    model = _assemble(reduced, rows, integral=False)
    highs = _highs(threads)
    # A cold LP of this shape solves faster without presolve, and re-solves need none.
    highs.setOptionValue("presolve", "off")
    _check(highs.passModel(model), "passing the relaxation to HiGHS")
    upper = np.ones(model.num_col_)
    """Column upper bounds for every node: 0 where reduced-cost fixing at the root says so."""
    in_highs = upper.copy()
    """The upper bounds HiGHS holds now: only those that change are sent."""
    scale = reduced.cost_scale
    best = warm if warm is not None and _memory_over(problem, warm) <= 0 else None
    best_cost = problem.objective(best) / scale if best is not None else math.inf

    def relax(
        forbidden: frozenset[int], fixed: npt.NDArray[np.bool_] | None = None
    ) -> tuple[str, float, _Vector]:
        """The relaxation with ``forbidden`` and ``fixed`` columns at 0: ``("optimal", value,
        x)``, or ``("infeasible" | "stopped", inf, [])`` (stopped: out of time, or any other
        status)."""
        nonlocal in_highs
        remaining = time_limit - (time.perf_counter() - start)
        if remaining <= 0:
            return "stopped", math.inf, np.zeros(0)
        highs.setOptionValue("time_limit", remaining)
        bounds = upper.copy()
        bounds[list(forbidden)] = 0.0
        if fixed is not None:
            bounds[fixed] = 0.0
        # Sending all 112k bounds costs 13 ms a node; a node changes a few thousand.
        changed = np.flatnonzero(bounds != in_highs).astype(np.int32)
        _check(
            highs.changeColsBounds(len(changed), changed, np.zeros(len(changed)), bounds[changed]),
            "fixing columns",
        )
        in_highs = bounds
        _check(highs.run(), "solving the relaxation")
        status = highs.getModelStatus()
        if status == highspy.HighsModelStatus.kInfeasible:
            return "infeasible", math.inf, np.zeros(0)
        if status != highspy.HighsModelStatus.kOptimal:
            return "stopped", math.inf, np.zeros(0)
        values = np.asarray(highs.getSolution().col_value, dtype=np.float64)
        return "optimal", highs.getInfo().objective_function_value, values

    def closed(bound: float) -> bool:
        return _relative_gap(best_cost * scale, bound * scale) <= mip_gap

    outcome, bound, values = relax(frozenset())
    if outcome != "optimal":
        return None
    plan = reduced.plan(values)
    gap = _relative_gap(problem.objective(plan), bound * scale)
    if _memory_over(problem, plan) <= 0 and gap <= mip_gap:
        return "optimal", plan, gap
    # The row goes into a new model started from the last basis (the row's slack basic):
    # HiGHS re-solves a model passed whole faster than one grown by addRow.
    basis = highs.getBasis()
    basis.row_status = [*basis.row_status, highspy.HighsBasisStatus.kBasic]
    with_row = _assemble(reduced, rows + _memory_limit(reduced, tightening=0.0), integral=False)
    _check(highs.passModel(with_row), "passing the relaxation with the memory row to HiGHS")
    in_highs = np.ones(model.num_col_)
    _check(highs.setBasis(basis), "starting from the relaxation's basis")
    outcome, root_bound, _ = relax(frozenset())
    if outcome != "optimal":
        return None
    # Reduced-cost fixing: a column whose reduced cost at the root exceeds the gap between the
    # incumbent and the root bound is 0 in every plan that beats the incumbent.
    root_reduced_costs = np.asarray(highs.getSolution().col_dual, dtype=np.float64)

    def fix_by_reduced_cost() -> None:
        upper[_fixed_by_reduced_cost(root_reduced_costs, root_bound, best_cost)] = 0.0

    fix_by_reduced_cost()
    levels = _memory_levels(reduced)
    first_column = reduced.node_columns()
    open_nodes = [_Subproblem(-math.inf, 0, frozenset(), np.zeros(model.num_col_, dtype=bool))]
    proven = math.inf
    """The least bound of the nodes closed by their bound or by an integral relaxation."""
    count = 0
    while open_nodes:
        node = heapq.heappop(open_nodes)
        if closed(node.bound):
            proven = min(proven, node.bound)
            continue
        outcome, bound, values = relax(node.forbidden, node.fixed)
        if outcome == "infeasible":
            continue
        if outcome == "stopped":
            if best is None or time.perf_counter() - start < time_limit:
                return None
            bound = min(node.bound, proven, *(other.bound for other in open_nodes))
            return "time_limit", best, _relative_gap(problem.objective(best), bound * scale)
        plan = reduced.plan(values)
        fitting = _memory_over(problem, plan) <= 0
        if fitting and problem.objective(plan) / scale < best_cost:
            best, best_cost = plan, problem.objective(plan) / scale
            fix_by_reduced_cost()
        split = None if closed(bound) else _branching(reduced, levels, first_column, values)
        if split is None:
            if not fitting and not closed(bound):
                # An integral relaxation over the limit by no more than HiGHS's tolerance.
                return None
            proven = min(proven, bound)
            continue
        # The same fixing with this node's own duals and bound holds in its subtree, and fixes
        # far more columns than the root's as the bounds close in on the incumbent.
        node_reduced_costs = np.asarray(highs.getSolution().col_dual, dtype=np.float64)
        fixed = node.fixed | _fixed_by_reduced_cost(node_reduced_costs, bound, best_cost)
        for forbid in split:
            count += 1
            heapq.heappush(open_nodes, _Subproblem(bound, count, node.forbidden | forbid, fixed))
    if best is None:
        return None
    gap = _relative_gap(problem.objective(best), min(proven, best_cost) * scale)
    logger.info("branch and bound: %d nodes, %.2f s", count + 1, time.perf_counter() - start)
    return "optimal", best, gap


def _fixed_by_reduced_cost(
    reduced_costs: _Vector, bound: float, incumbent: float
) -> npt.NDArray[np.bool_]:
    """The columns at 0 in every plan cheaper than ``incumbent`` under an LP whose optimum is
    ``bound`` with these reduced costs (raising such a column to 1 costs more than the gap)."""
    return reduced_costs > (incumbent - bound) * (1 + 1e-9) + 1e-12


def _memory_levels(reduced: _Reduced) -> dict[int, npt.NDArray[np.intp]]:
    """For each free node, the rank of each candidate's memory among the node's distinct
    memory figures."""
    assert reduced.excess is not None
    return {v: np.unique(reduced.excess[v], return_inverse=True)[1].ravel() for v in reduced.free}


def _branching(
    reduced: _Reduced,
    levels: dict[int, npt.NDArray[np.intp]],
    first_column: dict[int, int],
    values: _Vector,
) -> tuple[frozenset[int], frozenset[int]] | None:
    """Two sets of x columns to forbid, one per child, that cut ``values`` off; None when
    ``values`` is integral.

    The node to split is the one whose relaxation spreads over memory levels with the most
    memory at stake (its largest excess times the weight off its main level); the split is at
    the level that balances the weight on both sides, so neither child keeps ``values``. With
    every node on one memory level, a fractional node is split among its candidates the same
    way."""
    best: tuple[float, int, npt.NDArray[np.bool_]] | None = None
    for by_memory in (True, False):
        for v, column in first_column.items():
            x = values[column : column + len(reduced.candidates[v])]
            keys = levels[v] if by_memory else np.arange(len(x))
            weight = np.bincount(keys, weights=x)
            if weight.max() > 1 - _INTEGRAL:
                continue
            assert reduced.excess is not None
            score = float(reduced.excess[v].max() if by_memory else 1.0) * (1 - weight.max())
            if best is None or score > best[0]:
                below = np.cumsum(weight)[:-1]
                cut = int(np.argmax(np.minimum(below, 1 - below)))
                best = (score, column, keys <= cut)
        if best is not None:
            _, column, low = best
            positions = np.arange(len(low)) + column
            return frozenset(positions[~low].tolist()), frozenset(positions[low].tolist())
    return None


# --- Reductions -------------------------------------------------------------------------------


class _Pair(NamedTuple):
    """The merged, non-separable edges between nodes ``u < v``, with candidates grouped into
    classes of identical rows (of u) and identical columns (of v): ``costs[a, b]`` is the cost
    for any candidate of row class ``a`` and any of column class ``b``; ``row_class[i]`` and
    ``column_class[j]`` give the classes of u's i-th and v's j-th candidates."""

    u: int
    v: int
    costs: _Matrix
    row_class: npt.NDArray[np.intp]
    column_class: npt.NDArray[np.intp]

    @staticmethod
    def grouped(u: int, v: int, matrix: _Matrix) -> _Pair:
        rows, row_class = np.unique(matrix, axis=0, return_inverse=True)
        columns, column_class = np.unique(rows, axis=1, return_inverse=True)
        return _Pair(u, v, columns, row_class.ravel(), column_class.ravel())


@dataclasses.dataclass(frozen=True)
class _Reduced:
    """The problem after the reductions, over each node's candidate strategies."""

    candidates: list[list[int]]
    """Per node, the strategies it may take (its variables x[v, ·])."""
    costs: list[_Vector]
    """Per node and candidate: its cost plus the separable parts of its edges."""
    pairs: list[_Pair]
    excess: list[_Vector] | None
    """Per node and candidate: memory above the node's least, over the budget (None: no limit)."""
    memory_row: bool
    """Whether the memory row is written (False when even the hungriest plan fits)."""
    memory_budget: float
    """The row's right-hand side: the budget M − L in the units of ``excess``."""
    cost_scale: float

    @property
    def free(self) -> list[int]:
        """Nodes with more than one candidate: the decisions."""
        return [v for v, candidates in enumerate(self.candidates) if len(candidates) > 1]

    def node_columns(self) -> dict[int, int]:
        """The first column of each free node's x variables."""
        first, column = {}, 0
        for v in self.free:
            first[v] = column
            column += len(self.candidates[v])
        return first

    @property
    def num_node_columns(self) -> int:
        return sum(len(self.candidates[v]) for v in self.free)

    def pair_columns(self) -> list[int]:
        """The first column of each pair's e variables (after all x columns)."""
        first, column = [], self.num_node_columns
        for pair in self.pairs:
            first.append(column)
            column += pair.costs.size
        return first

    @property
    def num_columns(self) -> int:
        return self.num_node_columns + sum(pair.costs.size for pair in self.pairs)

    def plan(self, values: _Vector) -> tuple[int, ...]:
        """The strategy of every node from HiGHS's column values."""
        position = [0] * len(self.candidates)
        for v, column in self.node_columns().items():
            position[v] = int(np.argmax(values[column : column + len(self.candidates[v])]))
        return tuple(self.candidates[v][p] for v, p in enumerate(position))

    def start_values(self, choice: tuple[int, ...]) -> _Vector | None:
        """Column values of ``choice`` (None if it uses a pruned strategy)."""
        if any(s not in self.candidates[v] for v, s in enumerate(choice)):
            return None
        position = [self.candidates[v].index(s) for v, s in enumerate(choice)]
        values = np.zeros(self.num_columns)
        for v, column in self.node_columns().items():
            values[column + position[v]] = 1.0
        for pair, column in zip(self.pairs, self.pair_columns(), strict=True):
            width = pair.costs.shape[1]
            row, col = pair.row_class[position[pair.u]], pair.column_class[position[pair.v]]
            values[column + row * width + col] = 1.0
        return values


def _reduce(problem: IntraOpProblem) -> _Reduced:
    candidates, excess, memory_row, memory_budget = _prune_by_memory(problem)
    kept = _prune_dominated(problem, candidates)
    if excess is not None:
        excess = [
            e[[old.index(s) for s in new]]
            for e, old, new in zip(excess, candidates, kept, strict=True)
        ]
    candidates = kept
    costs = [
        np.asarray(node_costs, dtype=np.float64)[node_candidates]
        for node_costs, node_candidates in zip(problem.node_costs, candidates, strict=True)
    ]
    pairs = []
    for (u, v), matrix in _merge_edges(problem, candidates, costs).items():
        if _is_separable(matrix):
            costs[u] += matrix[:, 0]
            costs[v] += matrix[0, :] - matrix[0, 0]
        else:
            pairs.append(_Pair.grouped(u, v, matrix))
    magnitudes = [np.abs(costs[v]).max() for v, c in enumerate(candidates) if len(c) > 1]
    magnitudes += [np.abs(pair.costs).max() for pair in pairs]
    largest = float(max(magnitudes, default=0.0))
    cost_scale = largest if largest > 0 and math.isfinite(largest) else 1.0
    return _Reduced(candidates, costs, pairs, excess, memory_row, memory_budget, cost_scale)


def _prune_dominated(problem: IntraOpProblem, candidates: list[list[int]]) -> list[list[int]]:
    """Drop strategies another strategy of the same node beats or ties everywhere: no more
    cost, no more memory, and no more on any edge against any remaining strategy of the
    neighbour (reduction 1b). Repeated until nothing changes; among equals the first stays."""
    node_costs = [np.asarray(c, dtype=np.float64) for c in problem.node_costs]
    for edge in problem.edges:
        if edge.source == edge.target:
            node_costs[edge.source] = node_costs[edge.source] + np.diag(np.asarray(edge.costs))
    matrices = [np.asarray(edge.costs, dtype=np.float64) for edge in problem.edges]
    incident: list[list[tuple[int, bool]]] = [[] for _ in candidates]
    for index, edge in enumerate(problem.edges):
        if edge.source != edge.target:
            incident[edge.source].append((index, True))
            incident[edge.target].append((index, False))
    kept = [list(c) for c in candidates]
    changed = True
    while changed:
        changed = False
        for v, alive in enumerate(kept):
            if len(alive) < 2:
                continue
            parts = [node_costs[v][alive, None], np.asarray(problem.node_memory[v])[alive, None]]
            for index, outgoing in incident[v]:
                edge = problem.edges[index]
                if outgoing:
                    parts.append(matrices[index][np.ix_(alive, kept[edge.target])])
                else:
                    parts.append(matrices[index][np.ix_(kept[edge.source], alive)].T)
            profile = np.concatenate(parts, axis=1)
            # no_worse[a, b]: b is at least as good as a everywhere.
            no_worse = np.all(profile[None, :, :] <= profile[:, None, :], axis=2)
            equal = no_worse & no_worse.T
            order = np.arange(len(alive))
            earlier_equal = equal & (order[None, :] < order[:, None])
            beaten = np.any((no_worse & ~equal) | earlier_equal, axis=1)
            if beaten.any():
                kept[v] = [s for s, gone in zip(alive, beaten, strict=True) if not gone]
                changed = True
    return kept


def _prune_by_memory(
    problem: IntraOpProblem,
) -> tuple[list[list[int]], list[_Vector] | None, bool, float]:
    """Each node's candidates (the strategies that can fit), their excess memory, whether the
    memory row is needed, and its budget (reduction 1). Memory is scaled so that the budget is 1,
    or 0 when there is none to spare."""
    memory = [np.asarray(m, dtype=np.float64) for m in problem.node_memory]
    if problem.memory_limit is None:
        return [list(range(len(m))) for m in memory], None, False, math.inf
    budget = problem.memory_limit - problem.least_memory()
    # Rounding in the sums above must neither prune a plan that fits nor drop a row that binds.
    slack = _MEMORY_SLACK * max(abs(problem.memory_limit), 1.0)
    excess_bytes = [m - m.min() for m in memory]
    candidates = [[int(s) for s in np.flatnonzero(e <= budget + slack)] for e in excess_bytes]
    hungriest = sum(float(e[c].max()) for e, c in zip(excess_bytes, candidates, strict=True))
    scale = max(budget, slack)
    excess = [e[c] / scale for e, c in zip(excess_bytes, candidates, strict=True)]
    return candidates, excess, hungriest > budget - slack, max(budget, 0.0) / scale


def _merge_edges(
    problem: IntraOpProblem, candidates: list[list[int]], costs: list[_Vector]
) -> dict[tuple[int, int], _Matrix]:
    """One matrix per pair of nodes ``u < v`` over their candidates; self-loops go into
    ``costs`` (reduction 3)."""
    merged: dict[tuple[int, int], _Matrix] = {}
    for edge in problem.edges:
        u, v = edge.source, edge.target
        matrix = np.asarray(edge.costs, dtype=np.float64)
        if u == v:
            costs[u] += matrix[candidates[u], candidates[u]]
            continue
        if u > v:
            u, v, matrix = v, u, matrix.T
        restricted = matrix[np.ix_(candidates[u], candidates[v])]
        merged[u, v] = merged[u, v] + restricted if (u, v) in merged else restricted.copy()
    return merged


def _is_separable(matrix: _Matrix) -> bool:
    """Whether ``matrix[s, t] == a[s] + b[t]`` (reduction 4)."""
    residual = matrix - matrix[:, :1] - matrix[:1, :] + matrix[0, 0]
    return bool(np.abs(residual).max() <= _SEPARABLE_TOLERANCE * np.abs(matrix).max())


# --- The model --------------------------------------------------------------------------------


class _Row(NamedTuple):
    columns: list[int]
    values: list[float]
    lower: float
    upper: float


def _build_model(reduced: _Reduced, tightening: float) -> highspy.HighsLp:
    rows = [
        *_one_strategy_per_node(reduced),
        *_edge_consistency(reduced),
        *_memory_limit(reduced, tightening),
    ]
    return _assemble(reduced, rows, integral=True)


def _assemble(reduced: _Reduced, rows: list[_Row], integral: bool) -> highspy.HighsLp:
    """The model of ``rows`` over the reduced problem's columns and objective; the x columns
    are integers if ``integral`` (else: the LP relaxation)."""
    costs, offset = _objective(reduced)
    num_binaries = reduced.num_node_columns if integral else 0
    lp = highspy.HighsLp()
    lp.num_col_ = len(costs)
    lp.num_row_ = len(rows)
    lp.col_cost_ = costs
    lp.offset_ = offset
    lp.col_lower_ = np.zeros(len(costs))
    lp.col_upper_ = np.ones(len(costs))
    lp.row_lower_ = np.array([row.lower for row in rows], dtype=np.float64)
    lp.row_upper_ = np.array([row.upper for row in rows], dtype=np.float64)
    lp.integrality_ = [highspy.HighsVarType.kInteger] * num_binaries + [
        highspy.HighsVarType.kContinuous
    ] * (len(costs) - num_binaries)
    matrix = lp.a_matrix_
    matrix.format_ = highspy.MatrixFormat.kRowwise
    matrix.num_col_ = len(costs)
    matrix.num_row_ = len(rows)
    matrix.start_ = np.cumsum([0] + [len(row.columns) for row in rows], dtype=np.int32)
    matrix.index_ = np.array([c for row in rows for c in row.columns], dtype=np.int32)
    matrix.value_ = np.array([x for row in rows for x in row.values], dtype=np.float64)
    return lp


def _one_strategy_per_node(reduced: _Reduced) -> list[_Row]:
    """Σ_s x[v,s] = 1 for every free node."""
    rows = []
    for v, column in reduced.node_columns().items():
        count = len(reduced.candidates[v])
        rows.append(_Row(list(range(column, column + count)), [1.0] * count, 1.0, 1.0))
    return rows


def _edge_consistency(reduced: _Reduced) -> list[_Row]:
    """Σ_b e[uv,a,b] − Σ_(s∈a) x[u,s] = 0 for every row class a, and
    Σ_a e[uv,a,b] − Σ_(t∈b) x[v,t] = 0 for every column class b, for every kept edge.

    Candidates with identical cost rows (columns) are interchangeable on that edge, so e needs
    one variable per pair of classes: with one-hot x the class sums are one-hot too, and e is
    still their product.
    """
    node_column = reduced.node_columns()
    rows = []
    for pair, first in zip(reduced.pairs, reduced.pair_columns(), strict=True):
        height, width = pair.costs.shape
        for a in range(height):
            members = [node_column[pair.u] + s for s in np.flatnonzero(pair.row_class == a)]
            columns = [first + a * width + b for b in range(width)] + members
            rows.append(_Row(columns, [1.0] * width + [-1.0] * len(members), 0.0, 0.0))
        for b in range(width):
            members = [node_column[pair.v] + t for t in np.flatnonzero(pair.column_class == b)]
            columns = [first + a * width + b for a in range(height)] + members
            rows.append(_Row(columns, [1.0] * height + [-1.0] * len(members), 0.0, 0.0))
    return rows


def _memory_limit(reduced: _Reduced, tightening: float) -> list[_Row]:
    """Σ_v Σ_s (m[v,s] − m_min[v]) / (M − L) · x[v,s] ≤ 1 − ``tightening``, if needed (the
    budget is 0 instead of 1 when M = L)."""
    if reduced.excess is None or not reduced.memory_row:
        return []
    columns: list[int] = []
    values: list[float] = []
    for v, column in reduced.node_columns().items():
        for position, excess in enumerate(reduced.excess[v]):
            if excess > 0:
                columns.append(column + position)
                values.append(float(excess))
    upper = reduced.memory_budget * (1.0 - tightening)
    return [_Row(columns, values, -math.inf, upper)] if columns else []


def _objective(reduced: _Reduced) -> tuple[_Vector, float]:
    """Column costs (x then e) and the constant of fixed nodes, divided by the cost scale."""
    fixed = sum(float(reduced.costs[v][0]) for v, c in enumerate(reduced.candidates) if len(c) == 1)
    parts = [reduced.costs[v] for v in reduced.free] + [p.costs.ravel() for p in reduced.pairs]
    costs = np.concatenate(parts) if parts else np.zeros(0)
    return costs / reduced.cost_scale, fixed / reduced.cost_scale


# --- Helpers ----------------------------------------------------------------------------------


def _highs(threads: int | None) -> highspy.Highs:
    """A silent HiGHS instance, with a pool of ``threads`` threads if given."""
    highs = highspy.Highs()
    highs.setOptionValue("output_flag", False)
    if threads is not None:
        highs.setOptionValue("threads", threads)
        # The pool is built once per process; a different size is refused until it is reset.
        highspy.Highs.resetGlobalScheduler(True)
    return highs


def _check(status: highspy.HighsStatus, doing: str) -> None:
    if status == highspy.HighsStatus.kError:
        raise FxparError(f"HiGHS failed {doing}")


def _memory_over(problem: IntraOpProblem, choice: tuple[int, ...]) -> float:
    if problem.memory_limit is None:
        return 0.0
    return problem.memory(choice) - problem.memory_limit


def _clean_gap(gap: float) -> float:
    return max(gap, 0.0) if math.isfinite(gap) else math.inf


def _relative_gap(objective: float, bound: float) -> float:
    """HiGHS's definition: |primal − dual| / |primal|, 0 when both are 0."""
    if not math.isfinite(bound):
        return math.inf
    if objective == 0:
        return 0.0 if bound == 0 else math.inf
    return max(objective - bound, 0.0) / abs(objective)


def model_size(problem: IntraOpProblem) -> tuple[int, int]:
    """(variables, constraints) of the ILP :class:`ILPSolver` builds for ``problem``, after its
    reductions: what the benchmarks report."""
    model = _build_model(_reduce(problem), tightening=0.0)
    return model.num_col_, model.num_row_
