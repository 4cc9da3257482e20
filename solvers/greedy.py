"""A fast heuristic for the intra-operator problem: the ILP's warm start and a baseline.

1. **Cheapest in order.** Nodes are visited in index order (a topological order of the graph);
   each takes the strategy that minimizes its own cost plus the resharding costs of its edges to
   nodes already decided (a self-loop's diagonal counts too). Ties go to the lower index.
2. **Memory repair.** While the plan is over the memory limit, make the single switch of one node
   to a strategy that needs less memory with the least cost added per byte saved (the cost
   counts the node and all its edges under the current plan; a switch that lowers the cost comes
   first). Memory strictly falls with each switch, so this ends, and it reaches a plan that fits
   whenever one exists: the most frugal plan is reachable by such switches.

The result is feasible but proves nothing about optimality: its ``gap`` is NaN.
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass
from typing import ClassVar

from fxpar.solvers.errors import InfeasiblePlanError, check_memory_feasible
from fxpar.solvers.problem import Edge, IntraOpProblem, IntraOpSolution


@dataclass(frozen=True)
class GreedySolver:
    """Cheapest strategy per node in topological order, then memory repair (module docstring)."""

    name: ClassVar[str] = "greedy"

    def solve(self, problem: IntraOpProblem) -> IntraOpSolution:
        start = time.perf_counter()
        check_memory_feasible(problem)
        incident = _incident_edges(problem)
        choice = _cheapest_in_order(problem, incident)
        if problem.memory_limit is not None:
            _repair_memory(problem, incident, choice, problem.memory_limit)
        return IntraOpSolution(
            choice=tuple(choice),
            objective=problem.objective(choice),
            status="feasible",
            gap=math.nan,
            solver=self.name,
            seconds=time.perf_counter() - start,
        )


def _incident_edges(problem: IntraOpProblem) -> list[list[Edge]]:
    incident: list[list[Edge]] = [[] for _ in range(problem.num_nodes)]
    for edge in problem.edges:
        incident[edge.source].append(edge)
        if edge.target != edge.source:
            incident[edge.target].append(edge)
    return incident


_UNDECIDED = -1


def _local_cost(
    problem: IntraOpProblem, incident: list[list[Edge]], choice: list[int], node: int, strategy: int
) -> float:
    """The cost of ``node`` taking ``strategy``: its own, plus its edges to decided nodes."""
    cost = problem.node_costs[node][strategy]
    for edge in incident[node]:
        source = strategy if edge.source == node else choice[edge.source]
        target = strategy if edge.target == node else choice[edge.target]
        if source != _UNDECIDED and target != _UNDECIDED:
            cost += edge.costs[source][target]
    return cost


def _cheapest_in_order(problem: IntraOpProblem, incident: list[list[Edge]]) -> list[int]:
    choice = [_UNDECIDED] * problem.num_nodes
    for node, costs in enumerate(problem.node_costs):
        local = [_local_cost(problem, incident, choice, node, s) for s in range(len(costs))]
        choice[node] = local.index(min(local))
    return choice


def _repair_memory(
    problem: IntraOpProblem, incident: list[list[Edge]], choice: list[int], limit: float
) -> None:
    """Switch strategies in ``choice`` until it fits in ``limit`` (module docstring, step 2).

    Each node's best switch sits in a heap; when a node or one of its neighbours switches, its
    entry is recomputed and the old one goes stale (told apart by a per-node version number).
    """
    version = [0] * problem.num_nodes
    heap: list[tuple[float, int, int, int]] = []

    def push_best_switch(node: int) -> None:
        current = choice[node]
        memory = problem.node_memory[node]
        base = _local_cost(problem, incident, choice, node, current)
        best: tuple[float, int] | None = None
        for strategy, needed in enumerate(memory):
            if needed < memory[current]:
                added = _local_cost(problem, incident, choice, node, strategy) - base
                per_byte = added / (memory[current] - needed)
                if best is None or per_byte < best[0]:
                    best = (per_byte, strategy)
        if best is not None:
            heapq.heappush(heap, (best[0], node, best[1], version[node]))

    for node in range(problem.num_nodes):
        push_best_switch(node)
    memory = problem.memory(choice)
    while memory > limit:
        if not heap:
            raise InfeasiblePlanError.for_problem(problem)
        _, node, strategy, stamp = heapq.heappop(heap)
        if stamp != version[node]:
            continue
        memory -= problem.node_memory[node][choice[node]] - problem.node_memory[node][strategy]
        choice[node] = strategy
        if memory <= limit:
            # The running total drifts by rounding: confirm with the exact sum.
            memory = problem.memory(choice)
        affected = {node} | {end for edge in incident[node] for end in (edge.source, edge.target)}
        for other in sorted(affected):
            version[other] += 1
            push_best_switch(other)
