"""The reference solver: try every plan, keep the cheapest one that fits in memory.

It exists to check the other solvers on small problems, so it makes no assumption the problem
does not state: it does not use the additivity of memory to prune, it evaluates every plan.
Plans are visited in lexicographic order and only a strictly cheaper plan replaces the best so
far, so among equally cheap plans the lexicographically smallest wins.

To be fast enough for a million plans, the trailing nodes are enumerated as a block with numpy
(at most ``_BLOCK`` plans at a time) and the leading ones with :func:`itertools.product`. Costs
and memory are summed in the same order as :meth:`IntraOpProblem.objective` and
:meth:`IntraOpProblem.memory`, so the values (and the memory test) agree with them bit for bit.

One exception to trying everything: the last nodes, as long as each keeps the same memory under
every strategy and none meets another of them (the planner's auxiliary decisions, see
:mod:`fxpar.planning.shared_reads`), are not enumerated. Once the others are chosen each of them
is on its own, and takes its cheapest strategy (the first of equally cheap ones, so the
lexicographic rule still holds); their costs are added after the others'.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import numpy.typing as npt

from fxpar.solvers.errors import InfeasiblePlanError, ProblemTooLargeError
from fxpar.solvers.problem import IntraOpProblem, IntraOpSolution

_BLOCK = 1 << 16
"""The most plans evaluated at once by numpy (bounds the memory the search takes)."""

_Index = int | npt.NDArray[np.intp]


@dataclass(frozen=True)
class ExhaustiveSolver:
    """Enumerates all plans; refuses problems with more than ``max_combinations`` of them."""

    name: ClassVar[str] = "exhaustive"
    max_combinations: int = 1_000_000

    def solve(self, problem: IntraOpProblem) -> IntraOpSolution:
        start = time.perf_counter()
        counts = [len(costs) for costs in problem.node_costs]
        free = _free_tail(problem)
        combinations = math.prod(counts[:free])
        if combinations > self.max_combinations:
            raise ProblemTooLargeError(
                f"exhaustive search would try {combinations:,} plans ({problem.num_nodes} nodes "
                f"with up to {max(counts)} strategies each), more than "
                f"max_combinations={self.max_combinations:,}; solve it with ILPSolver, or raise "
                f"max_combinations if you can wait"
            )
        best = _search(problem, counts, free)
        if best is None:
            raise InfeasiblePlanError.for_problem(problem)
        return IntraOpSolution(
            choice=best,
            objective=problem.objective(best),
            status="optimal",
            gap=0.0,
            solver=self.name,
            seconds=time.perf_counter() - start,
        )


def _search(problem: IntraOpProblem, counts: list[int], free: int) -> tuple[int, ...] | None:
    """The lexicographically smallest cheapest plan that fits, or None if none fits; nodes from
    ``free`` on are chosen on their own (:func:`_free_tail`)."""
    costs = [np.asarray(c, dtype=np.float64) for c in problem.node_costs[:free]]
    memory = [np.asarray(m, dtype=np.float64) for m in problem.node_memory]
    edges = [
        (e.source, e.target, np.asarray(e.costs, dtype=np.float64))
        for e in problem.edges
        if max(e.source, e.target) < free
    ]
    split = _block_start(counts[:free])
    block_shape = tuple(counts[split:free])
    block_index: list[_Index] = list(np.indices(block_shape, dtype=np.intp))
    best: tuple[int, ...] | None = None
    best_objective = math.inf
    for prefix in itertools.product(*(range(count) for count in counts[:split])):
        index: list[_Index] = [*prefix, *block_index]
        node_total = sum((c[i] for c, i in zip(costs, index, strict=True)), np.float64(0.0))
        edge_total = sum((matrix[index[u], index[v]] for u, v, matrix in edges), np.float64(0.0))
        objective = np.broadcast_to(node_total + edge_total, block_shape).ravel()
        picked = _cheapest_free(problem, index, free, block_shape)
        for extra, _ in picked:
            objective = objective + extra
        fits = np.ones(objective.shape, dtype=bool)
        if problem.memory_limit is not None:
            used = sum((m[i] for m, i in zip(memory[:free], index, strict=True)), np.float64(0.0))
            used = used + sum(float(m[0]) for m in memory[free:])
            fits = np.broadcast_to(used <= problem.memory_limit, block_shape).ravel()
        candidates = np.flatnonzero(fits)
        if candidates.size == 0:
            continue
        position = int(candidates[np.argmin(objective[candidates])])
        if best is None or objective[position] < best_objective:
            best_objective = float(objective[position])
            suffix = np.unravel_index(position, block_shape)
            rest = (int(strategy[position]) for _, strategy in picked)
            best = (*prefix, *(int(i) for i in suffix), *rest)
    return best


def _free_tail(problem: IntraOpProblem) -> int:
    """Where the trailing nodes chosen on their own begin: each keeps the same memory under
    every strategy and meets none of the others (the module docstring)."""
    neighbours: dict[int, set[int]] = {}
    for edge in problem.edges:
        neighbours.setdefault(edge.source, set()).add(edge.target)
        neighbours.setdefault(edge.target, set()).add(edge.source)
    start = problem.num_nodes
    while start > 1:
        v = start - 1
        memory = problem.node_memory[v]
        if min(memory) != max(memory) or any(w >= v for w in neighbours.get(v, ())):
            break
        start = v
    return start


def _cheapest_free(
    problem: IntraOpProblem, index: list[_Index], free: int, block_shape: tuple[int, ...]
) -> list[tuple[npt.NDArray[np.float64], npt.NDArray[np.intp]]]:
    """Per free node, its cheapest cost and strategy (the first of equally cheap ones) for
    every plan of the block, flattened."""
    totals = {
        v: [np.full(block_shape, c) for c in problem.node_costs[v]]
        for v in range(free, problem.num_nodes)
    }
    for edge in problem.edges:
        u, v = edge.source, edge.target
        if v >= free:
            row = edge.matrix[index[u]]
            for s in range(len(totals[v])):
                totals[v][s] = totals[v][s] + row[..., s]
        elif u >= free:
            for s in range(len(totals[u])):
                totals[u][s] = totals[u][s] + edge.matrix[s][index[v]]
    picked = []
    for v in range(free, problem.num_nodes):
        stacked = np.stack([np.broadcast_to(t, block_shape).ravel() for t in totals[v]])
        strategy = np.argmin(stacked, axis=0)
        picked.append((stacked.min(axis=0), strategy))
    return picked


def _block_start(counts: list[int]) -> int:
    """The first node of the trailing block: as many nodes as fit in ``_BLOCK`` plans (one at
    least, when there is any)."""
    start, size = len(counts), 1
    while start > 0 and (start == len(counts) or size * counts[start - 1] <= _BLOCK):
        size *= counts[start - 1]
        start -= 1
    return start
