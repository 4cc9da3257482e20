"""fxpar's solvers: they take plain data (cost arrays, resharding matrices) and return plain data.

:mod:`fxpar.solvers.problem` defines the intra-operator problem and solution; the HiGHS ILP,
exhaustive and greedy solvers implement :class:`~fxpar.solvers.problem.IntraOpSolver`.
"""

from __future__ import annotations

from fxpar.solvers.errors import InfeasiblePlanError
from fxpar.solvers.exhaustive import ExhaustiveSolver
from fxpar.solvers.greedy import GreedySolver
from fxpar.solvers.ilp import ILPSolver
from fxpar.solvers.problem import Edge, IntraOpProblem, IntraOpSolution, IntraOpSolver

__all__ = [
    "Edge",
    "ExhaustiveSolver",
    "GreedySolver",
    "ILPSolver",
    "InfeasiblePlanError",
    "IntraOpProblem",
    "IntraOpSolution",
    "IntraOpSolver",
]
