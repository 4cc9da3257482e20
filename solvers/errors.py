"""Errors the intra-operator solvers raise, all :class:`~fxpar.errors.FxparError` subclasses.

They live next to the solvers (``fxpar.solvers.errors``) so that the solvers stay plain-data
modules; ``except fxpar.errors.FxparError`` catches them like every other fxpar error.
"""

from __future__ import annotations

import math

from fxpar.errors import FxparError
from fxpar.solvers.problem import IntraOpProblem

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


class InfeasiblePlanError(FxparError):
    """No choice of strategies fits the per-device memory limit.

    Memory is additive over nodes, so the most memory-frugal plan takes the least-memory strategy
    of every node; when even that plan is over the limit, no plan fits. ``least_memory`` and
    ``memory_limit`` are in bytes per device.
    """

    def __init__(self, message: str, *, least_memory: float, memory_limit: float) -> None:
        super().__init__(message)
        self.least_memory = least_memory
        self.memory_limit = memory_limit

    @classmethod
    def for_problem(cls, problem: IntraOpProblem) -> InfeasiblePlanError:
        """The error for ``problem``: how much memory the most frugal plan needs, the limit,
        the nodes that need the most, and what to do about it."""
        least = problem.least_memory()
        limit = problem.memory_limit if problem.memory_limit is not None else float("inf")
        message = (
            f"no sharding plan fits in memory: the most memory-frugal plan needs "
            f"{format_bytes(least)} per device ({least:.0f} bytes) but the limit is "
            f"{format_bytes(limit)} ({limit:.0f} bytes)."
        )
        hungriest = _hungriest_nodes(problem, count=3)
        if hungriest:
            message += f" The largest needs, each at its most frugal strategy: {hungriest}."
        message += (
            " Use more devices (a larger mesh splits tensors further), raise the memory limit, "
            "keep fewer micro-batches in flight, or rematerialize activations (recompute them "
            "in the backward instead of keeping them)."
        )
        return cls(message, least_memory=least, memory_limit=limit)


class ProblemTooLargeError(FxparError):
    """A solver that enumerates plans was given more plans than it is allowed to enumerate."""


class NoPlanFoundError(FxparError):
    """A solver stopped (on its time limit) before it found any plan."""


def check_memory_feasible(problem: IntraOpProblem) -> None:
    """Raise :class:`InfeasiblePlanError` when not even the most frugal plan fits."""
    if problem.memory_limit is not None and problem.least_memory() > problem.memory_limit:
        raise InfeasiblePlanError.for_problem(problem)


def format_bytes(count: float) -> str:
    """``count`` bytes in the largest binary unit (up to TiB) that keeps the number at least 1."""
    if not math.isfinite(count):
        return f"{count} bytes"
    value, exponent = count, 0
    while abs(value) >= 1024 and exponent < len(_UNITS) - 1:
        value /= 1024
        exponent += 1
    return f"{value:.0f} B" if exponent == 0 else f"{value:.2f} {_UNITS[exponent]}"


def _hungriest_nodes(problem: IntraOpProblem, count: int) -> str:
    frugal = [(min(memory), node) for node, memory in enumerate(problem.node_memory) if memory]
    frugal.sort(key=lambda pair: (-pair[0], pair[1]))
    parts = []
    for memory, node in frugal[:count]:
        if memory <= 0:
            break
        name = problem.names[node] if node < len(problem.names) else f"node {node}"
        parts.append(f"{name} {format_bytes(memory)}")
    return ", ".join(parts)
