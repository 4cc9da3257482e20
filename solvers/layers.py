"""Layer clustering: cut a topologically ordered sequence of forward ops into contiguous layers.

The stage DP (:mod:`fxpar.solvers.stages`) groups *layers* into pipeline stages; this module makes
the layers. The input is ``n`` forward ops in a topological order, op ``i`` costing ``c_i >= 0``
(seconds or FLOPs), and data edges ``(i, j, b)``: op ``j > i`` reads ``b`` bytes that op ``i``
produced. A partition into ``L`` layers is a list of boundaries ``0 = p_0 < p_1 < ... < p_L = n``;
layer ``k`` holds ops ``p_k .. p_{k+1} - 1`` and costs ``C_k = sum(c_i for p_k <= i < p_{k+1})``.

**Communication.** Boundary ``k`` (``1 <= k < L``) lies between ops ``p_k - 1`` and ``p_k``; an
edge ``(i, j, b)`` crosses it when ``i < p_k <= j``. Two ways of charging crossings are offered:

- ``count="once"`` (default): an edge that crosses any boundary costs ``b`` once, charged to the
  first boundary it crosses. This models a runtime that sends a tensor straight from the stage
  that makes it to the stage that reads it, as fxpar's pipelines do.
- ``count="per_boundary"``: an edge costs ``b`` at every boundary it crosses. This models a
  linear pipeline that forwards a skip connection through every stage in between, and it is also
  the number of boundary activations rematerialization has to keep.

Either way the bytes split into a sum over layers, ``B = sum_k out(p_k, p_{k+1})``, with

    once:          out(s, e) = sum(b for (i, j, b) if s <= i < e <= j)
    per_boundary:  out(s, e) = sum(b for (i, j, b) if i < e <= j)     (0 when e = n)

**Objective.** With ``limit = (1 + delta) * sum(c) / L``, minimize lexicographically

    (B, max_k C_k)   subject to   C_k <= limit for every layer k,

that is: the fewest crossing bytes among partitions whose layers are all within ``delta`` of a
perfect balance, and among those the best-balanced one. When no partition meets the limit (a
single op costs more than ``limit``, say), the limit is relaxed to ``C* = min over partitions of
max_k C_k``, the smallest limit any partition meets, and the result says so (``relaxed``, with the
``delta`` that limit corresponds to).

**Recurrences.** ``C*`` comes from the classic linear-partition DP,

    H(0, 0) = 0,   H(k, e) = min_{s < e} max(H(k - 1, s), cost(s, e)),   C* = H(L, n),

and the partition from a DP over (layers made, ops covered) on pairs compared lexicographically,

    F(0, 0) = (0, 0),
    F(k, e) = min_{s < e, cost(s, e) <= limit} (F_B(k - 1, s) + out(s, e),
                                               max(F_C(k - 1, s), cost(s, e))),

with the answer ``F(L, n)``. Adding a non-negative number to the first component and taking a max
with the second are both monotone in the lexicographic order, so the DP is exact for the pair.
Each ``(k, e)`` step is one numpy pass over ``s``: ``O(n^2 L)`` time, ``O(n L)`` memory. Bytes are
integers, summed in float64 (exact below 2**53 bytes), so ties on ``B`` are exact ties.

:func:`brute_force_layers` enumerates every partition and is the reference for the tests.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

import numpy as np
import numpy.typing as npt

from fxpar.errors import FxparError

CrossingCount = Literal["once", "per_boundary"]

_Floats = npt.NDArray[np.float64]


class LayerClusteringError(FxparError, ValueError):
    """The layer-clustering inputs are malformed (no ops, a bad edge, too many layers, ...)."""


class DataEdge(NamedTuple):
    """Op ``target`` reads ``nbytes`` bytes that op ``source`` produced (``source < target``)."""

    source: int
    target: int
    nbytes: int


@dataclass(frozen=True)
class LayerPartition:
    """A partition of the ops into contiguous layers, and what it costs."""

    ranges: tuple[tuple[int, int], ...]
    """Half-open op ranges ``(start, stop)``, one per layer, in order."""
    layer_costs: tuple[float, ...]
    boundary_bytes: tuple[int, ...]
    """Bytes charged to each of the ``L - 1`` boundaries under the partition's ``count``."""
    crossing_bytes: int
    """The objective's first component: ``sum(boundary_bytes)``."""
    cost_limit: float
    """The largest layer cost allowed: ``(1 + delta) * total / L``, or ``C*`` when relaxed."""
    delta: float
    """The balance slack ``cost_limit`` corresponds to (the requested one unless relaxed)."""
    relaxed: bool
    """True when no partition met the requested ``delta`` and the limit was raised to ``C*``."""
    count: CrossingCount

    @property
    def num_layers(self) -> int:
        return len(self.ranges)

    @property
    def boundaries(self) -> tuple[int, ...]:
        """The first op of every layer but the first."""
        return tuple(start for start, _ in self.ranges[1:])

    @property
    def max_layer_cost(self) -> float:
        return max(self.layer_costs)

    def layer_of_ops(self) -> tuple[int, ...]:
        """The layer index of every op."""
        return tuple(
            layer for layer, (start, stop) in enumerate(self.ranges) for _ in range(start, stop)
        )


def cluster_layers(
    op_costs: Sequence[float],
    edges: Sequence[DataEdge | tuple[int, int, int]],
    num_layers: int,
    *,
    delta: float = 0.25,
    count: CrossingCount = "once",
) -> LayerPartition:
    """Cut ``op_costs`` into ``num_layers`` contiguous layers (module docstring): fewest crossing
    bytes among the layerings within ``delta`` of balance, then the best balanced."""
    costs, data_edges = _validated(op_costs, edges, num_layers, delta, count)
    prefix = np.concatenate(([0.0], np.cumsum(np.asarray(costs, dtype=np.float64))))
    total = float(prefix[-1])
    requested_limit = (1.0 + delta) * total / num_layers
    least_max = _least_max_layer_cost(prefix, num_layers)
    relaxed = least_max > requested_limit
    limit = least_max if relaxed else requested_limit
    starts = _fewest_crossing_bytes(prefix, data_edges, num_layers, limit, count)
    return _partition(costs, data_edges, starts, limit, delta, relaxed, count)


def brute_force_layers(
    op_costs: Sequence[float],
    edges: Sequence[DataEdge | tuple[int, int, int]],
    num_layers: int,
    *,
    delta: float = 0.25,
    count: CrossingCount = "once",
) -> LayerPartition:
    """The reference: every one of the ``C(n - 1, L - 1)`` partitions, scored from scratch. Among
    equal ``(crossing_bytes, max_layer_cost)`` the first in lexicographic boundary order wins."""
    costs, data_edges = _validated(op_costs, edges, num_layers, delta, count)
    n = len(costs)
    layerings = [(0, *cut, n) for cut in itertools.combinations(range(1, n), num_layers - 1)]
    scored = [
        (
            _charged_bytes(data_edges, points, count),
            [sum(costs[a:b]) for a, b in itertools.pairwise(points)],
            points,
        )
        for points in layerings
    ]
    least_max = min(max(layer_costs) for _, layer_costs, _ in scored)
    requested_limit = (1.0 + delta) * sum(costs) / num_layers
    relaxed = least_max > requested_limit
    limit = least_max if relaxed else requested_limit
    fitting = [item for item in scored if max(item[1]) <= limit]
    best = min(fitting, key=lambda item: (sum(item[0]), max(item[1])))
    return _partition(costs, data_edges, best[2][:-1], limit, delta, relaxed, count)


def _validated(
    op_costs: Sequence[float],
    edges: Sequence[DataEdge | tuple[int, int, int]],
    num_layers: int,
    delta: float,
    count: str,
) -> tuple[list[float], list[DataEdge]]:
    costs = [float(c) for c in op_costs]
    n = len(costs)
    if n == 0:
        raise LayerClusteringError("layer clustering needs at least one op, got none")
    if any(not math.isfinite(c) or c < 0 for c in costs):
        raise LayerClusteringError("op costs must be finite and non-negative")
    if not 1 <= num_layers <= n:
        raise LayerClusteringError(
            f"cannot cut {n} ops into {num_layers} non-empty layers; ask for 1 to {n} layers"
        )
    if not (math.isfinite(delta) and delta >= 0):
        raise LayerClusteringError(f"delta must be finite and non-negative, got {delta}")
    if count not in ("once", "per_boundary"):
        raise LayerClusteringError(f"count must be 'once' or 'per_boundary', got {count!r}")
    data_edges = [DataEdge(*edge) for edge in edges]
    for edge in data_edges:
        if not 0 <= edge.source < edge.target < n or edge.nbytes < 0:
            raise LayerClusteringError(
                f"edge {tuple(edge)} must go forward between ops 0..{n - 1} (source < target, "
                f"topological order) and carry a non-negative number of bytes"
            )
    return costs, data_edges


def _least_max_layer_cost(prefix: _Floats, num_layers: int) -> float:
    """``C*``: the smallest possible cost of the most expensive layer (the ``H`` recurrence)."""
    n = len(prefix) - 1
    previous = np.full(n + 1, math.inf)
    previous[0] = 0.0
    for layers in range(1, num_layers + 1):
        current = np.full(n + 1, math.inf)
        for stop in range(layers, n + 1):
            starts = slice(layers - 1, stop)
            current[stop] = np.min(np.maximum(previous[starts], prefix[stop] - prefix[starts]))
        previous = current
    return float(previous[n])


def _fewest_crossing_bytes(
    prefix: _Floats,
    edges: list[DataEdge],
    num_layers: int,
    limit: float,
    count: CrossingCount,
) -> tuple[int, ...]:
    """The layer starts minimizing ``(B, max C_k)`` under ``limit`` (the ``F`` recurrence)."""
    n = len(prefix) - 1
    bytes_total = np.full((num_layers + 1, n + 1), math.inf)
    worst_cost = np.full((num_layers + 1, n + 1), math.inf)
    best_start = np.zeros((num_layers + 1, n + 1), dtype=np.intp)
    bytes_total[0, 0] = worst_cost[0, 0] = 0.0
    # live[i]: bytes op i produces for ops at or after the current stop.
    live = np.zeros(n)
    ending_at: list[list[DataEdge]] = [[] for _ in range(n)]
    for edge in edges:
        live[edge.source] += edge.nbytes
        ending_at[edge.target].append(edge)
    for stop in range(1, n + 1):
        for edge in ending_at[stop - 1]:
            live[edge.source] -= edge.nbytes
        # leaving[s] = bytes of edges with s <= source < stop <= target
        leaving = np.cumsum(live[:stop][::-1])[::-1]
        out = leaving if count == "once" else np.full(stop, leaving[0])
        segment_cost = prefix[stop] - prefix[:stop]
        for layers in range(1, min(num_layers, stop) + 1):
            starts = np.arange(layers - 1, stop)
            allowed = (segment_cost[starts] <= limit) & np.isfinite(bytes_total[layers - 1, starts])
            if not allowed.any():
                continue
            starts = starts[allowed]
            candidate_bytes = bytes_total[layers - 1, starts] + out[starts]
            candidate_worst = np.maximum(worst_cost[layers - 1, starts], segment_cost[starts])
            fewest = candidate_bytes == candidate_bytes.min()
            pick = int(np.flatnonzero(fewest)[np.argmin(candidate_worst[fewest])])
            bytes_total[layers, stop] = candidate_bytes[pick]
            worst_cost[layers, stop] = candidate_worst[pick]
            best_start[layers, stop] = starts[pick]
    if not math.isfinite(bytes_total[num_layers, n]):
        raise AssertionError("layer DP found no partition under a limit some partition meets")
    starts_found = [n]
    for layers in range(num_layers, 0, -1):
        starts_found.append(int(best_start[layers, starts_found[-1]]))
    return tuple(reversed(starts_found[1:]))


def _charged_bytes(edges: list[DataEdge], points: Sequence[int], count: CrossingCount) -> list[int]:
    """Bytes charged to each inner boundary of the partition ``points`` (``0, p_1, ..., n``)."""
    inner = points[1:-1]
    charged = [0] * len(inner)
    for edge in edges:
        crossed = [k for k, p in enumerate(inner) if edge.source < p <= edge.target]
        for k in crossed if count == "per_boundary" else crossed[:1]:
            charged[k] += edge.nbytes
    return charged


def _partition(
    costs: list[float],
    edges: list[DataEdge],
    starts: Sequence[int],
    limit: float,
    delta: float,
    relaxed: bool,
    count: CrossingCount,
) -> LayerPartition:
    points = (*starts, len(costs))
    charged = _charged_bytes(edges, points, count)
    total = sum(costs)
    if relaxed:
        delta = limit * len(starts) / total - 1.0
    return LayerPartition(
        ranges=tuple(itertools.pairwise(points)),
        layer_costs=tuple(sum(costs[a:b]) for a, b in itertools.pairwise(points)),
        boundary_bytes=tuple(charged),
        crossing_bytes=sum(charged),
        cost_limit=limit,
        delta=float(delta),
        relaxed=relaxed,
        count=count,
    )
