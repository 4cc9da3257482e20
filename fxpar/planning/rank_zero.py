"""Solving once for every rank: rank 0 solves, every rank lowers its answer."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from fxpar.errors import DistributedError
from fxpar.solvers.ilp import ILPSolver
from fxpar.solvers.problem import IntraOpProblem, IntraOpSolution, IntraOpSolver


@dataclass(frozen=True)
class SolvedOnRankZero:
    """Solve on rank 0 and broadcast the answer. Solvers with time limits (or floating-point
    ties) could answer differently on different ranks, and ranks lowering different plans
    would exchange mismatched pieces or wait forever; one answer for all rules that out. The
    answer comes with rank 0's decisions (names and choice counts, in order): a rank whose
    problem has other decisions raises :class:`~fxpar.errors.DistributedError` instead of
    lowering choices that mean something else to it."""

    solver: IntraOpSolver | None

    @property
    def name(self) -> str:
        return getattr(self.solver, "name", "ilp")

    def solve(self, problem: IntraOpProblem) -> IntraOpSolution:
        solver = self.solver
        if solver is None:
            solver = ILPSolver()
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return solver.solve(problem)
        answer: list[object] = [None]
        if dist.get_rank() == 0:
            try:
                answer[0] = (_decisions(problem), solver.solve(problem))
            except Exception as error:  # re-raised on every rank below, rank 0 included
                answer[0] = error
        dist.broadcast_object_list(answer, src=0)
        if isinstance(answer[0], Exception):
            raise answer[0]
        planned: tuple[tuple[str, int], ...]
        solution: IntraOpSolution
        planned, solution = answer[0]  # type: ignore[misc]
        mine = _decisions(problem)
        if planned != mine:
            raise DistributedError(
                f"rank 0 planned a problem of {len(planned)} decisions, this rank "
                f"({dist.get_rank()}) one of {len(mine)}{_first_difference(planned, mine)}: "
                "the ranks captured different models or example inputs (call fxpar.compile with "
                "the same arguments on every rank), or built the problem differently from the "
                "same program (a planner bug: please report it with both ranks' plan reports)"
            )
        return solution


def _decisions(problem: IntraOpProblem) -> tuple[tuple[str, int], ...]:
    """Each decision of ``problem`` in order: the node it stands for (where named) and its
    number of choices. Rank 0's answer means the same on another rank only if that rank's
    problem has the same decisions: the same count, order and merged layers."""
    names = problem.names or ("",) * problem.num_nodes
    return tuple((name, len(costs)) for name, costs in zip(names, problem.node_costs, strict=True))


def _first_difference(
    planned: tuple[tuple[str, int], ...], mine: tuple[tuple[str, int], ...]
) -> str:
    for index, (theirs, ours) in enumerate(zip(planned, mine, strict=False)):
        if theirs != ours:
            return (
                f"; decision {index} is {theirs[0]!r} with {theirs[1]} choices on rank 0 and "
                f"{ours[0]!r} with {ours[1]} here"
            )
    return ""
