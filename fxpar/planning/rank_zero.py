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
    would exchange mismatched pieces or wait forever; one answer for all rules that out."""

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
                answer[0] = (len(problem.node_costs), solver.solve(problem))
            except Exception as error:  # re-raised on every rank below, rank 0 included
                answer[0] = error
        dist.broadcast_object_list(answer, src=0)
        if isinstance(answer[0], Exception):
            raise answer[0]
        size: int
        solution: IntraOpSolution
        size, solution = answer[0]  # type: ignore[misc]
        if size != len(problem.node_costs):
            raise DistributedError(
                f"rank 0 planned a problem of {size} decisions, this rank "
                f"({dist.get_rank()}) one of {len(problem.node_costs)}: the ranks captured "
                "different models or example inputs (call fxpar.compile with the same arguments "
                "on every rank), or built the problem differently from the same program (a "
                "planner bug: please report it with both ranks' plan reports)"
            )
        return solution
