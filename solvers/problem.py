"""The intra-operator sharding problem as plain data, and what a solver returns.

Solvers never see fx graphs: a builder (``fxpar.planning``) turns a Program and a Cluster into
an :class:`IntraOpProblem`, and any solver that maps it to an :class:`IntraOpSolution` can plan.

The problem: nodes ``v = 0..n-1``, each with strategies ``s = 0..k_v-1``. Choosing strategy ``s``
for node ``v`` costs ``node_costs[v][s]`` seconds (compute and the communication inside the node)
and keeps ``node_memory[v][s]`` bytes alive on each device. An edge ``(u, v)`` costs
``edge.costs[s][t]`` seconds when ``u`` takes ``s`` and ``v`` takes ``t`` (resharding ``u``'s
output into the layout ``v`` needs). Minimize the total cost subject to the total memory being at
most ``memory_limit`` bytes per device.

What each choice stands for is plain data too, so a solver can also be a policy about *what* to
shard ("never split a parameter", "experts on their own axis"): ``strategies[v][s]`` is the
:class:`~fxpar.sharding.Strategy` (input and output specs, one torch placement per mesh axis)
that strategy ``s`` of node ``v`` gives the node deciding for it, and ``kinds[v]`` says what that
node is: ``"parameter"``, ``"buffer"``, ``"input"``, ``"random"``, its ATen op
(``"aten.mm.default"``), or :data:`SHARED_READ` for an auxiliary decision of two choices that
stands for no node. Problems written by hand may leave both empty.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Literal, Protocol

import numpy as np
import numpy.typing as npt

from fxpar.sharding import Strategy

SHARED_READ = "shared read"
"""The kind of an auxiliary decision: whether a value several readers need in one layout is
converted once for them all (:mod:`fxpar.planning.shared_reads`)."""

Status = Literal["optimal", "feasible", "time_limit", "infeasible"]


@dataclass(frozen=True)
class Edge:
    """A producer -> consumer pair and its resharding costs, ``costs[s_source][s_target]``."""

    source: int
    target: int
    costs: tuple[tuple[float, ...], ...]

    @functools.cached_property
    def matrix(self) -> npt.NDArray[np.float64]:
        """``costs`` as a read-only array, made once (solvers read it many times)."""
        matrix = np.array(self.costs, dtype=np.float64).reshape(len(self.costs), -1)
        matrix.flags.writeable = False
        return matrix

    @classmethod
    def of_matrix(cls, source: int, target: int, matrix: npt.NDArray[np.float64]) -> Edge:
        """The edge whose costs are ``matrix``'s entries (its :attr:`matrix` already made)."""
        edge = cls(source, target, tuple(map(tuple, matrix.tolist())))
        held = np.array(matrix, dtype=np.float64)
        held.flags.writeable = False
        edge.__dict__["matrix"] = held  # what the cached property would make
        return edge


@dataclass(frozen=True)
class IntraOpProblem:
    node_costs: tuple[tuple[float, ...], ...]
    node_memory: tuple[tuple[float, ...], ...]
    edges: tuple[Edge, ...] = ()
    memory_limit: float | None = None
    names: tuple[str, ...] = field(default=(), compare=False)
    """Node names, for messages only."""
    strategies: tuple[tuple[Strategy, ...], ...] = field(default=(), compare=False)
    """What each choice stands for: ``strategies[v][s]`` (module docstring)."""
    kinds: tuple[str, ...] = field(default=(), compare=False)
    """What each node is: parameter, buffer, input, random, or its ATen op."""
    mesh_shape: tuple[int, ...] = field(default=(), compare=False)
    """The mesh the strategies' placements refer to."""
    starts: tuple[tuple[int, ...], ...] = field(default=(), compare=False)
    """Plans known before solving, one strategy index per node: the planner puts the hand-written
    plans here (replicated, data, tensor and fully sharded parallelism). A solver may start from
    them; :class:`~fxpar.solvers.ILPSolver` never answers with a plan that costs more than the
    cheapest of them that fits in memory."""

    @property
    def num_nodes(self) -> int:
        return len(self.node_costs)

    def objective(self, choice: tuple[int, ...] | list[int]) -> float:
        """The total cost of a choice of one strategy per node."""
        total = sum(costs[s] for costs, s in zip(self.node_costs, choice, strict=True))
        total += sum(edge.costs[choice[edge.source]][choice[edge.target]] for edge in self.edges)
        return float(total)

    def memory(self, choice: tuple[int, ...] | list[int]) -> float:
        """Bytes per device kept alive by a choice."""
        return float(sum(m[s] for m, s in zip(self.node_memory, choice, strict=True)))

    def best_start(self) -> tuple[int, ...] | None:
        """The cheapest of :attr:`starts` that fits in memory, if any."""
        fitting = [
            start
            for start in self.starts
            if self.memory_limit is None or self.memory(start) <= self.memory_limit
        ]
        return min(fitting, key=self.objective, default=None)

    def floor(self) -> float:
        """A lower bound on every plan's cost that needs no solver: each node's cheapest
        strategy and each edge's cheapest entry, taken apart. Weak, but finite, so a plan found
        without a proof always comes with a finite gap."""
        nodes = sum(min(costs, default=0.0) for costs in self.node_costs)
        edges = sum(min((min(row) for row in edge.costs), default=0.0) for edge in self.edges)
        return float(nodes + edges)

    def least_memory(self) -> float:
        """The memory of the most memory-frugal choice (memory is additive over nodes)."""
        return float(sum(min(m) for m in self.node_memory))


@dataclass(frozen=True)
class IntraOpSolution:
    choice: tuple[int, ...]
    """One strategy index per node."""
    objective: float
    status: Status
    gap: float
    """Relative optimality gap the solver proved (0 when optimal)."""
    solver: str
    seconds: float


class IntraOpSolver(Protocol):
    """Anything that solves the problem: the HiGHS ILP, exhaustive search, a greedy pass, a
    manual plan."""

    name: str

    def solve(self, problem: IntraOpProblem) -> IntraOpSolution: ...
