"""fxpar's solvers: they take plain data (cost arrays, resharding matrices) and return plain data.

:mod:`fxpar.solvers.problem` defines the intra-operator problem and solution; the HiGHS ILP,
exhaustive and greedy solvers, and the descent over mesh axes for meshes of three or more axes
(:mod:`fxpar.solvers.descent`), implement :class:`~fxpar.solvers.problem.IntraOpSolver`. The
inter-operator dynamic programs: :mod:`fxpar.solvers.layers` groups ops into layers,
:mod:`fxpar.solvers.stages` groups layers into pipeline stages on submeshes.
"""

from __future__ import annotations

from fxpar.solvers.descent import AxisDescent
from fxpar.solvers.errors import InfeasiblePlanError
from fxpar.solvers.exhaustive import ExhaustiveSolver
from fxpar.solvers.greedy import GreedySolver
from fxpar.solvers.ilp import ILPSolver
from fxpar.solvers.layers import DataEdge, LayerClusteringError, LayerPartition, cluster_layers
from fxpar.solvers.problem import Edge, IntraOpProblem, IntraOpSolution, IntraOpSolver
from fxpar.solvers.stages import (
    InvalidStageProblemError,
    NoStagePlanError,
    Stage,
    StageCost,
    StageMemoryError,
    StagePlan,
    StageProblem,
    evaluate_stages,
    per_step_overcount,
    pipeline_step_time,
    place_submeshes,
    solve_stages,
)

__all__ = [
    "AxisDescent",
    "DataEdge",
    "Edge",
    "ExhaustiveSolver",
    "GreedySolver",
    "ILPSolver",
    "InfeasiblePlanError",
    "IntraOpProblem",
    "IntraOpSolution",
    "IntraOpSolver",
    "InvalidStageProblemError",
    "LayerClusteringError",
    "LayerPartition",
    "NoStagePlanError",
    "Stage",
    "StageCost",
    "StageMemoryError",
    "StagePlan",
    "StageProblem",
    "cluster_layers",
    "evaluate_stages",
    "per_step_overcount",
    "pipeline_step_time",
    "place_submeshes",
    "solve_stages",
]
