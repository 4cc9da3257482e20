"""Branch and bound on memory levels: the exact search :class:`~fxpar.solvers.ilp.ILPSolver` runs
where the memory row binds (internal to :mod:`fxpar.solvers.ilp`; the model is
:mod:`fxpar.solvers.ilp_model`'s).

**The root.** The LP relaxation without the memory row is solved first (presolve off: faster
cold, and re-solves need none); on the transformer problems it is integral, and its plan is
returned as optimal when it fits. Otherwise the row is added, the model passed whole with the last
basis and the row's slack basic (HiGHS re-solves a model passed whole faster than one grown by
``addRow``), and re-solved warm.

**Branching.** A node is split on the node v whose relaxation spreads over memory levels (its
distinct memory figures) with the most memory at stake, largest excess × weight off its main
level: one child keeps the levels up to the cut that balances the weight, the other the levels
above it, so neither keeps the parent's point. With every node on one level, a fractional node
is split among its candidates the same way. Children forbid x columns (upper bound 0), and
inherit every column their ancestors forbade.

**Bounding.** The search is best-first on the nodes' bounds (each node is solved when it is
created, see below). Each node's rounded plan (every node
taking its largest x) that fits is an incumbent. Reduced-cost fixing: a column whose reduced cost
exceeds the gap between the incumbent and an LP's optimum is 0 in every plan that beats the
incumbent within that LP's feasible set. Each new incumbent fixes columns by the root's reduced
costs, for the whole search; each node, before it splits, fixes columns by its own reduced costs
for its subtree, which fixes far more as the bounds close in on the incumbent (most of the edge
columns, below the first few levels of the search). A node closes when its bound is
within ``mip_gap`` of the incumbent, or its relaxation is integral. This is exact as HiGHS's MIP
is, up to the LP tolerances both trust.

**Subtree LPs and workers.** Fixed columns still cost HiGHS time in every iteration (and in
copying each solution out), so when fewer than half of a node's LP columns are alive in its
subtree (neither fixed nor forbidden), its children are solved in a new, smaller LP over the alive
columns: a *view* of the model. A node's basic columns are always alive (their reduced costs are
0), so its basis restricted to the view starts the view's LP. Children are solved when they are
created, both at once with ``workers=2``: child i on worker i, each worker with its own HiGHS
instance of the view (HiGHS releases the GIL while it solves), which it re-solves warm from
whatever it solved last there. The results are then taken in a fixed order, so for a given number
of workers the search, and the plan it returns, are the same on every run (another number of
workers may break ties between equally cheap plans otherwise).

Where the search cannot decide (HiGHS stops on an LP with time left, or an integral relaxation
is over the limit within HiGHS's tolerance) it returns None and the MIP solves the problem
instead; on its time limit it returns its incumbent with status ``"time_limit"``.
"""

from __future__ import annotations

import contextlib
import functools
import heapq
import logging
import math
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import NamedTuple, TypeVar

import highspy
import numpy as np
import numpy.typing as npt

from fxpar.solvers.ilp_model import (
    Reduced,
    Vector,
    assemble,
    check,
    edge_consistency,
    memory_limit,
    memory_over,
    new_highs,
    one_strategy_per_node,
    relative_gap,
)
from fxpar.solvers.problem import IntraOpProblem, Status

logger = logging.getLogger(__name__)

_INTEGRAL = 1e-6
"""How close to 0 or 1 a relaxation's value must be to count as decided."""
_NARROWING = 0.5
"""A node's children get a smaller LP when fewer than this share of its LP's columns are alive."""

_T = TypeVar("_T")
_Columns = npt.NDArray[np.intp]
_Mask = npt.NDArray[np.bool_]
Decision = tuple[Status, tuple[int, ...], float]
"""What the search decides: status, plan and the proven relative gap."""


class _Model:
    """The relaxation with the memory row over all columns, and its rows as arrays, from which
    the LP of any subset of the columns is cut."""

    def __init__(self, lp: highspy.HighsLp) -> None:
        self.lp = lp
        matrix = lp.a_matrix_
        self.start = np.asarray(matrix.start_, dtype=np.int64)
        self.index = np.asarray(matrix.index_, dtype=np.int64)
        self.value = np.asarray(matrix.value_, dtype=np.float64)
        self.row_of = np.repeat(np.arange(lp.num_row_), np.diff(self.start))
        self.costs = np.asarray(lp.col_cost_, dtype=np.float64)
        self.num_columns = lp.num_col_

    def restricted(self, columns: _Columns) -> highspy.HighsLp:
        """The LP over ``columns`` only (sorted global indices), with every row kept."""
        inside = np.zeros(self.num_columns, dtype=bool)
        inside[columns] = True
        position = np.full(self.num_columns, -1, dtype=np.int64)
        position[columns] = np.arange(len(columns))
        entries = inside[self.index]
        lp = highspy.HighsLp()
        lp.num_col_ = len(columns)
        lp.num_row_ = self.lp.num_row_
        lp.col_cost_ = self.costs[columns]
        lp.offset_ = self.lp.offset_
        lp.col_lower_ = np.zeros(len(columns))
        lp.col_upper_ = np.ones(len(columns))
        lp.row_lower_ = self.lp.row_lower_
        lp.row_upper_ = self.lp.row_upper_
        matrix = lp.a_matrix_
        matrix.format_ = highspy.MatrixFormat.kRowwise
        matrix.num_col_ = len(columns)
        matrix.num_row_ = self.lp.num_row_
        counts = np.bincount(self.row_of[entries], minlength=self.lp.num_row_)
        matrix.start_ = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        matrix.index_ = position[self.index[entries]].astype(np.int32)
        matrix.value_ = self.value[entries]
        return lp


class _Solved(NamedTuple):
    """An LP's answer, in global columns: ``status`` is "optimal", "infeasible" or "stopped"
    (out of time, or any other HiGHS status)."""

    status: str
    value: float
    values: Vector
    reduced_costs: Vector
    """+inf for the columns the LP does not hold (they are fixed at 0)."""
    basic: npt.NDArray[np.int64]
    """The basis: basic columns (global indices, ≥ 0) and rows r (as −1 − r)."""


_NOT_SOLVED = np.zeros(0)


class _Lp:
    """One HiGHS instance holding the relaxation over a subset of its columns."""

    def __init__(self, highs: highspy.Highs, columns: _Columns, num_columns: int) -> None:
        self.highs = highs
        self.columns = columns
        self.num_columns = num_columns
        self.upper = np.ones(len(columns))
        """The column upper bounds HiGHS holds now: only those that change are sent."""

    def solve(self, upper: Vector, seconds: float) -> _Solved:
        """Solve with the global column upper bounds ``upper``."""
        none = np.zeros(0, dtype=np.int64)
        if seconds <= 0:
            return _Solved("stopped", math.inf, _NOT_SOLVED, _NOT_SOLVED, none)
        self.highs.setOptionValue("time_limit", seconds)
        bounds = upper[self.columns]
        changed = np.flatnonzero(bounds != self.upper).astype(np.int32)
        check(
            self.highs.changeColsBounds(
                len(changed), changed, np.zeros(len(changed)), bounds[changed]
            ),
            "fixing columns",
        )
        self.upper = bounds
        check(self.highs.run(), "solving the relaxation")
        status = self.highs.getModelStatus()
        if status == highspy.HighsModelStatus.kInfeasible:
            return _Solved("infeasible", math.inf, _NOT_SOLVED, _NOT_SOLVED, none)
        if status != highspy.HighsModelStatus.kOptimal:
            return _Solved("stopped", math.inf, _NOT_SOLVED, _NOT_SOLVED, none)
        solution = self.highs.getSolution()
        values = np.zeros(self.num_columns)
        values[self.columns] = solution.col_value
        reduced_costs = np.full(self.num_columns, math.inf)
        reduced_costs[self.columns] = solution.col_dual
        # (Missing from highspy's type stubs.)
        _, basic = self.highs.getBasicVariables()  # type: ignore[attr-defined]
        basic = np.asarray(basic, dtype=np.int64)
        basic[basic >= 0] = self.columns[basic[basic >= 0]]
        value = self.highs.getInfo().objective_function_value
        return _Solved("optimal", value, values, reduced_costs, basic)


class _View:
    """A subtree's columns (sorted global indices) and the LPs over them, one per worker, each
    built when its worker first needs it, started from the basis of the node that needs it."""

    def __init__(self, model: _Model, columns: _Columns, workers: int) -> None:
        self.model = model
        self.columns = columns
        self.lps: list[_Lp | None] = [None] * workers

    def lp(self, worker: int, node: _Open) -> _Lp:
        lp = self.lps[worker]
        if lp is None:
            highs = new_highs(None)  # (HiGHS's pool is sized once, by the root's instance.)
            highs.setOptionValue("presolve", "off")
            check(highs.passModel(self.model.restricted(self.columns)), "passing an LP")
            check(highs.setBasis(self.basis(node)), "starting an LP from a node's basis")
            lp = self.lps[worker] = _Lp(highs, self.columns, self.model.num_columns)
        return lp

    def basis(self, node: _Open) -> highspy.HighsBasis:
        """``node``'s basis over this view's columns (which hold its basic columns)."""
        status = highspy.HighsBasisStatus
        codes = np.where(node.values[self.columns] > 0.5, 2, 0)
        basic_columns = node.basic[node.basic >= 0]
        codes[np.searchsorted(self.columns, basic_columns)] = 1
        lp = self.model.lp
        rows = np.where(np.asarray(lp.row_lower_) == -math.inf, 2, 0)
        rows[-1 - node.basic[node.basic < 0]] = 1
        by_code = (status.kLower, status.kBasic, status.kUpper)
        basis = highspy.HighsBasis()
        basis.valid = True
        basis.col_status = [by_code[code] for code in codes.tolist()]
        basis.row_status = [by_code[code] for code in rows.tolist()]
        return basis


class _Open(NamedTuple):
    """A solved node waiting to be split: its bound (scaled costs), its view and its answer."""

    bound: float
    order: int
    forbidden: frozenset[int]
    fixed: _Mask
    """Columns at 0 by reduced-cost fixing at this node's ancestors."""
    view: _View
    values: Vector
    reduced_costs: Vector
    basic: npt.NDArray[np.int64]


def branch_and_bound(
    problem: IntraOpProblem,
    reduced: Reduced,
    warm: tuple[int, ...] | None,
    time_limit: float,
    mip_gap: float,
    threads: int | None = None,
    workers: int = 1,
) -> Decision | None:
    """The search of the module docstring; None where it cannot decide."""
    if not memory_limit(reduced, tightening=0.0):
        return None
    with _executor(workers) as executor:
        search = _Search(problem, reduced, warm, time_limit, mip_gap, threads, executor, workers)
        return search.run()


@contextlib.contextmanager
def _executor(workers: int) -> Iterator[Executor | None]:
    if workers <= 1:
        yield None
        return
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fxpar-ilp") as executor:
        yield executor


class _Search:
    def __init__(
        self,
        problem: IntraOpProblem,
        reduced: Reduced,
        warm: tuple[int, ...] | None,
        time_limit: float,
        mip_gap: float,
        threads: int | None,
        executor: Executor | None,
        workers: int,
    ) -> None:
        self.start = time.perf_counter()
        self.problem, self.reduced = problem, reduced
        self.time_limit, self.mip_gap, self.threads = time_limit, mip_gap, threads
        self.executor = executor
        self.workers = 1 if executor is None else workers
        self.scale = reduced.cost_scale
        fits = warm is not None and memory_over(problem, warm) <= 0
        self.best = warm if fits else None
        self.best_cost = problem.objective(warm) / self.scale if fits and warm else math.inf
        self.levels = _memory_levels(reduced)
        self.first_column = reduced.node_columns()
        self.lps = 0

    def remaining(self) -> float:
        return self.time_limit - (time.perf_counter() - self.start)

    def closed(self, bound: float) -> bool:
        return relative_gap(self.best_cost * self.scale, bound * self.scale) <= self.mip_gap

    def run(self) -> Decision | None:
        root = self.solve_root()
        if not isinstance(root, _Open):
            return root
        open_nodes = [root]
        proven = math.inf
        """The least bound of the nodes closed by their bound or by an integral relaxation."""
        count = 0
        while open_nodes:
            node = heapq.heappop(open_nodes)
            if self.closed(node.bound):
                proven = min(proven, node.bound)
                continue
            split = _branching(self.reduced, self.levels, self.first_column, node.values)
            if split is None:
                if memory_over(self.problem, self.reduced.plan(node.values)) > 0:
                    # An integral relaxation over the limit by no more than HiGHS's tolerance.
                    return None
                proven = min(proven, node.bound)
                continue
            fixed = node.fixed | _fixed_by_reduced_cost(
                node.reduced_costs, node.bound, self.best_cost
            )
            children = [node.forbidden | forbid for forbid in split]
            for forbidden, solved, view in self.solve_children(node, children, fixed):
                if solved.status == "infeasible":
                    continue
                if solved.status == "stopped":
                    if self.best is None or self.remaining() > 0:
                        return None
                    bound = min(node.bound, proven, *(other.bound for other in open_nodes))
                    return self.decision("time_limit", bound)
                self.offer(solved.values)
                if self.closed(solved.value):
                    proven = min(proven, solved.value)
                    continue
                count += 1
                heapq.heappush(
                    open_nodes,
                    _Open(solved.value, count, forbidden, fixed, view, *solved[2:]),
                )
        if self.best is None:
            return None
        logger.info("branch and bound: %d LPs, %.2f s", self.lps, time.perf_counter() - self.start)
        return self.decision("optimal", min(proven, self.best_cost))

    def decision(self, status: Status, bound: float) -> Decision:
        assert self.best is not None
        gap = relative_gap(self.problem.objective(self.best), bound * self.scale)
        return status, self.best, gap

    def solve_root(self) -> _Open | Decision | None:
        """The relaxation without the memory row, then with it: a decision when the first is
        optimal, else the root node."""
        rows = [*one_strategy_per_node(self.reduced), *edge_consistency(self.reduced)]
        highs = new_highs(self.threads)
        highs.setOptionValue("presolve", "off")
        check(highs.passModel(assemble(self.reduced, rows, integral=False)), "passing the LP")
        everything = np.arange(self.reduced.num_columns)
        lp = _Lp(highs, everything, len(everything))
        upper = np.ones(len(everything))
        pending = self.submit(lambda: lp.solve(upper, self.remaining()))
        # While HiGHS solves, the model with the memory row is built.
        rows += memory_limit(self.reduced, tightening=0.0)
        self.model = _Model(assemble(self.reduced, rows, integral=False))
        solved = pending()
        if solved.status != "optimal":
            return None
        plan = self.reduced.plan(solved.values)
        if memory_over(self.problem, plan) <= 0:
            gap = relative_gap(self.problem.objective(plan), solved.value * self.scale)
            if gap <= self.mip_gap:
                return "optimal", plan, gap
        basis = highs.getBasis()
        basis.row_status = [*basis.row_status, highspy.HighsBasisStatus.kBasic]
        check(highs.passModel(self.model.lp), "passing the LP with the memory row")
        check(highs.setBasis(basis), "starting from the relaxation's basis")
        lp.upper = np.ones(len(everything))
        solved = lp.solve(upper, self.remaining())
        self.lps = 2
        if solved.status != "optimal":
            return None
        self.upper = upper
        """Column upper bounds for every node: 0 where the root's reduced costs fix them."""
        self.root = solved
        self.offer(solved.values)
        view = _View(self.model, everything, self.workers)
        view.lps[0] = lp
        none = np.zeros(len(everything), dtype=bool)
        return _Open(solved.value, 0, frozenset(), none, view, *solved[2:])

    def offer(self, values: Vector) -> None:
        """Take the rounded plan of an LP's ``values`` as the incumbent if it fits and is
        cheaper; a new incumbent fixes columns by the root's reduced costs."""
        plan = self.reduced.plan(values)
        if memory_over(self.problem, plan) > 0:
            return
        cost = self.problem.objective(plan) / self.scale
        if cost < self.best_cost:
            self.best, self.best_cost = plan, cost
            fixed = _fixed_by_reduced_cost(self.root.reduced_costs, self.root.value, cost)
            self.upper[fixed] = 0.0

    def solve_children(
        self, node: _Open, children: list[frozenset[int]], fixed: _Mask
    ) -> list[tuple[frozenset[int], _Solved, _View]]:
        """Solve the children (their forbidden columns), child i on worker i (round robin), in
        the node's view, or in a smaller one when few of its columns are alive."""
        view = node.view
        gone = fixed | (self.upper == 0)
        gone[list(node.forbidden)] = True
        alive = ~gone[view.columns]
        if np.count_nonzero(alive) < _NARROWING * len(view.columns):
            basic = node.basic[node.basic >= 0]
            alive[np.searchsorted(view.columns, basic)] = True
            view = _View(self.model, view.columns[alive], self.workers)

        def solve(worker: int, upper: Vector, seconds: float) -> _Solved:
            return view.lp(worker, node).solve(upper, seconds)

        results = []
        for first in range(0, len(children), self.workers):
            pending = []
            for worker, forbidden in enumerate(children[first : first + self.workers]):
                upper = self.upper.copy()
                upper[list(forbidden)] = 0.0
                upper[fixed] = 0.0
                job = functools.partial(solve, worker, upper, self.remaining())
                pending.append(self.submit(job))
            results += [result() for result in pending]
        self.lps += len(children)
        pairs = zip(children, results, strict=True)
        return [(forbidden, solved, view) for forbidden, solved in pairs]

    def submit(self, work: Callable[[], _T]) -> Callable[[], _T]:
        """Start ``work`` on a worker thread (or run it now without workers); the returned
        function waits for its result."""
        if self.executor is None:
            result = work()
            return lambda: result
        return self.executor.submit(work).result


def _fixed_by_reduced_cost(reduced_costs: Vector, bound: float, incumbent: float) -> _Mask:
    """The columns at 0 in every plan cheaper than ``incumbent`` under an LP whose optimum is
    ``bound`` with these reduced costs (raising such a column to 1 costs more than the gap)."""
    return reduced_costs > (incumbent - bound) * (1 + 1e-9) + 1e-12


def _memory_levels(reduced: Reduced) -> dict[int, npt.NDArray[np.intp]]:
    """For each free node, the rank of each candidate's memory among the node's distinct
    memory figures."""
    assert reduced.excess is not None
    return {v: np.unique(reduced.excess[v], return_inverse=True)[1].ravel() for v in reduced.free}


def _branching(
    reduced: Reduced,
    levels: dict[int, npt.NDArray[np.intp]],
    first_column: dict[int, int],
    values: Vector,
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
