"""Descent over mesh axes: intra-op problems too large for one solve, an axis or two at a time.

On a mesh of ``k`` axes a node's strategies are the product of its placements on each axis:
a matmul has up to 7 strategies on one axis, 49 on two and 343 on three, and an edge between
two such nodes up to 343² pairs. The ILP of a Llama-3-8B step on a (2, 2, 2) mesh has 3.4
million columns after its reductions: too many for HiGHS to solve even the root relaxation
within a planning time limit, and generating the columns as their reduced costs ask does not
save it, as the relaxation's optimum is held by hundreds of thousands of them.

:class:`AxisDescent` gives an exact solver problems no larger than a two-axis mesh's
instead. It starts from the cheapest plan that fits among the problem's starts, the greedy
plan and the most memory-frugal plan. Each step frees some mesh axes: every node keeps its
current placements on the other axes and the inner solver chooses among the strategies that
agree with them (the *restricted problem*). The current plan is one of them, so no step makes
the plan worse. Steps free one axis at a time, round the axes until a whole round improves
nothing (problems of a one-axis mesh's size, solved in a fraction of a second), then two, each
pair of axes once. The plan is then a local optimum of the one-axis steps, improved on every
pair of axes: not a proven optimum. It is returned with status
``"feasible"`` and its gap to :meth:`~fxpar.solvers.problem.IntraOpProblem.floor`.

:class:`~fxpar.solvers.ilp.ILPSolver` runs the descent first on meshes of three or more axes:
its plan is the answer for a problem too large for one model, and the starting plan of the
model otherwise (docs/planning.md, "Meshes of three or more axes").

The one-axis steps make most of the improvement, each cheaply. A two-axis step costs several
of them (most of it HiGHS solving the root relaxation of its larger problem) and is there to
make the moves that no single axis can, which are few once the one-axis steps are done: so
pairs of axes get one round.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, TypeVar

import numpy as np
import numpy.typing as npt

from fxpar.errors import FxparError
from fxpar.sharding import Spec
from fxpar.sharding.reshard import Code, SpecCoder
from fxpar.solvers.errors import check_memory_feasible
from fxpar.solvers.greedy import GreedySolver
from fxpar.solvers.ilp_model import distinct_rows, memory_over
from fxpar.solvers.problem import Edge, IntraOpProblem, IntraOpSolution, IntraOpSolver, Status

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
_MISSING = -100
"""The code, on every axis, of a missing spec (a strategy's ``None`` input)."""
_IMPROVEMENT = 1e-6
"""A step must lower the cost by more than this fraction to count as an improvement."""


@dataclass(frozen=True)
class AxisDescent:
    """Solve by descent over one, then two, mesh axes at a time (module docstring), each step
    by ``inner``.

    ``time_limit`` in seconds: no step starts after it has passed (a step itself runs under
    ``inner``'s own limit). A problem on fewer than three mesh axes, or without
    :attr:`~fxpar.solvers.problem.IntraOpProblem.strategies` to read placements from, is
    given to ``inner`` whole."""

    inner: IntraOpSolver
    time_limit: float = 60.0
    name: ClassVar[str] = "axis-descent"

    def __post_init__(self) -> None:
        if not callable(getattr(self.inner, "solve", None)):
            raise FxparError(
                f"AxisDescent's inner solver must have solve(IntraOpProblem), got {self.inner!r}"
            )

    @staticmethod
    def splits(problem: IntraOpProblem) -> bool:
        """Whether the descent has axes to split ``problem`` by: three or more, and the
        strategies' placements to read them from."""
        return len(problem.mesh_shape) >= 3 and len(problem.strategies) == problem.num_nodes

    def solve(self, problem: IntraOpProblem) -> IntraOpSolution:
        if not self.splits(problem):
            return self.inner.solve(problem)
        ndim = len(problem.mesh_shape)
        start = time.perf_counter()
        restrict = _Restrictor(problem)
        plan = _first_plan(problem)
        cost = problem.objective(plan)
        steps = 0
        status: Status = "feasible"
        for size in (1, 2):
            groups = list(itertools.combinations(range(ndim), size))
            since_better = 0
            # One axis at a time: round the axes until a whole round improves nothing. Pairs
            # of axes: one round (a pair's step costs several one-axis steps, and a second
            # round of pairs finds little the first left).
            rounds = itertools.cycle(groups) if size == 1 else iter(groups)
            for free in rounds:
                if since_better == len(groups):
                    break
                if time.perf_counter() - start > self.time_limit:
                    status = "time_limit"
                    break
                fixed = [a for a in range(ndim) if a not in free]
                allowed = restrict.agreeing(plan, fixed)
                answer = self.inner.solve(restrict.problem(allowed, plan))
                found = tuple(allowed[v][s] for v, s in enumerate(answer.choice))
                found_cost = problem.objective(found)
                steps += 1
                logger.debug("axes %s free: %.6g s (was %.6g s)", free, found_cost, cost)
                if found_cost < cost * (1 - _IMPROVEMENT) and memory_over(problem, found) <= 0:
                    plan, cost, since_better = found, found_cost, 1
                else:
                    since_better += 1
        logger.info(
            "descent over mesh axes: %d steps, %.2f s, plan at %.6g s", steps,
            time.perf_counter() - start, cost,
        )  # fmt: skip
        bound = problem.floor()
        gap = max((cost - bound) / cost, 0.0) if cost > 0 else 0.0
        return IntraOpSolution(
            choice=plan, objective=cost, status=status, gap=gap, solver=self.name,
            seconds=time.perf_counter() - start,
        )  # fmt: skip


def _first_plan(problem: IntraOpProblem) -> tuple[int, ...]:
    """The cheapest plan that fits among the starts, the greedy plan and the most frugal plan
    (which fits whenever any plan does)."""
    frugal = tuple(int(np.argmin(memory)) for memory in problem.node_memory)
    plans = [*problem.starts, GreedySolver().solve(problem).choice, frugal]
    fitting = [plan for plan in plans if memory_over(problem, plan) <= 0]
    if not fitting:
        check_memory_feasible(problem)  # raises: not even the most frugal plan fits
    return min(fitting, key=problem.objective)


class _Restrictor:
    """The problem's strategies keyed by their placements on each axis, and its edge matrices
    as arrays, from which restricted problems are cut."""

    def __init__(self, problem: IntraOpProblem) -> None:
        self.source = problem
        coder = SpecCoder()  # a node's strategies share spec objects
        ndim = len(problem.mesh_shape)
        missing = (_MISSING,) * ndim

        def code(spec: Spec | None) -> Code:
            return missing if spec is None else coder(spec)

        self.keys: list[npt.NDArray[np.intp]] = []
        """Per node, an id per strategy and axis of its placements there (inputs and outputs)."""
        for strategies in problem.strategies:
            coded = [[code(s) for s in (*c.outputs, *c.inputs)] for c in strategies]
            width = max(map(len, coded), default=0)
            rows = np.array([c + [missing] * (width - len(c)) for c in coded], dtype=np.intp)
            rows = rows.reshape(len(strategies), width, ndim)
            keys = [distinct_rows(rows[:, :, a])[1] for a in range(ndim)]
            self.keys.append(np.stack(keys, axis=1).reshape(len(strategies), ndim))
        self.edges = [edge.matrix for edge in problem.edges]

    def agreeing(self, plan: Sequence[int], fixed: Sequence[int]) -> list[list[int]]:
        """For each node, the strategies whose placements on the ``fixed`` axes are those of
        its strategy in ``plan``."""
        columns = list(fixed)
        allowed = []
        for keys, chosen in zip(self.keys, plan, strict=True):
            on_fixed = keys[:, columns]
            agree = (on_fixed == on_fixed[chosen]).all(axis=1)
            allowed.append(np.flatnonzero(agree).tolist())
        return allowed

    def problem(self, allowed: list[list[int]], plan: Sequence[int]) -> IntraOpProblem:
        """The problem over the ``allowed`` strategies of each node, ``plan`` its start."""
        source = self.source
        edges = []
        for edge, matrix in zip(source.edges, self.edges, strict=True):
            cut = matrix[np.ix_(allowed[edge.source], allowed[edge.target])]
            edges.append(Edge.of_matrix(edge.source, edge.target, cut))

        def pick(rows: Sequence[Sequence[_T]]) -> tuple[tuple[_T, ...], ...]:
            return tuple(tuple(row[s] for s in a) for row, a in zip(rows, allowed, strict=True))

        return IntraOpProblem(
            node_costs=pick(source.node_costs),
            node_memory=pick(source.node_memory),
            edges=tuple(edges),
            memory_limit=source.memory_limit,
            names=source.names,
            strategies=pick(source.strategies),
            kinds=source.kinds,
            mesh_shape=source.mesh_shape,
            starts=(tuple(a.index(s) for a, s in zip(allowed, plan, strict=True)),),
        )
