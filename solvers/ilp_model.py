"""The intra-operator problem as an integer linear program: its formulation, the reductions
applied before it is built, and the HiGHS model (internal to :mod:`fxpar.solvers.ilp`).

Formulation (Alpa's, with the tight linearization of the edge terms). For every node v and
strategy s of v, a binary x[v,s] = 1 when v takes s; for every edge (u,v) whose cost matrix R[uv]
survives the reductions below, a continuous e[uv,s,t] ∈ [0,1] standing for x[u,s]·x[v,t]:

    minimize    Σ_v Σ_s c[v,s]·x[v,s]  +  Σ_(u,v) Σ_s Σ_t R[uv,s,t]·e[uv,s,t]      (objective)

    subject to  Σ_s x[v,s] = 1                      for every node v        (one strategy per node)
                Σ_t e[uv,s,t] = x[u,s]              for every edge, every s    (edge consistency)
                Σ_s e[uv,s,t] = x[v,t]              for every edge, every t    (edge consistency)
                Σ_v Σ_s m[v,s]·x[v,s] ≤ M                                          (memory limit)
                x[v,s] ∈ {0,1},  e[uv,s,t] ∈ [0,1]

The two consistency families make e[uv,·,·] a joint distribution whose marginals are x[u,·] and
x[v,·]; with one-hot marginals the only such distribution is the product, so e is integral as
soon as x is, and its LP relaxation is at least as tight as the usual e ≥ x[u,s] + x[v,t] − 1.

Reductions, applied before the model is built (each keeps the optimum; the reported objective is
always recomputed with :meth:`IntraOpProblem.objective`, so it is exact):

1. **Memory pruning.** Memory is additive, so with m_min[v] = min_s m[v,s] every plan needs at
   least L = Σ_v m_min[v]. If L > M no plan fits and :class:`InfeasiblePlanError` is raised
   without calling HiGHS. A strategy with m[v,s] − m_min[v] > M − L can never fit: it gets no
   variable. The memory row is written over the excess m[v,s] − m_min[v] against the budget
   M − L, scaled to 1, and dropped when even the hungriest plan fits.
1b. **Dominance.** A strategy that another strategy of the same node matches or beats on its
   cost, its memory and every edge (against the neighbour's remaining strategies) is dropped;
   repeated until nothing changes.
2. **Fixed nodes.** A node left with one strategy is decided: it gets no variable, its cost is a
   constant of the objective.
3. **Edge merging.** Self-loops (u = v) add their diagonal to the node's costs; parallel and
   opposite edges between the same two nodes add up into one matrix, one set of e variables.
4. **Separable edges.** An edge matrix that splits as R[s,t] = a[s] + b[t] (constant and all-zero
   matrices, and every edge touching a fixed node, are such) adds a to u's costs and b to v's
   and gets no e variables.
5. **Edge classes.** On one edge, candidates of u with identical cost rows (of v, identical
   columns) are interchangeable: e gets one variable per pair of classes, and the consistency
   rows equate e's marginals with the class sums of x. On 2-D meshes this halves the edge
   variables (many strategies produce, or read, the same layout).
6. **Elimination** (exact coarsening). A decision whose strategies all keep the same memory
   (or any, when even the hungriest plan fits) and that meets at most two other decisions is
   eliminated as in dynamic programming: with one neighbour w, each strategy of w gets v's
   cheapest answer to it added to its cost; with two, w1 and w2 get an edge whose entry for
   (s1, s2) is v's cheapest answer to both. Every plan of the smaller problem extends to a plan
   of the whole one with the same cost (v takes the recorded answer), and no plan of the whole
   problem costs less, so the optimum is the same. Repeated until nothing changes: chains of
   views, transposes and pointwise ops between two matmuls become one edge. Plans are read back
   through the recorded answers, last elimination first.
7. **Scaling.** Costs are divided by the largest one, so HiGHS's tolerances are relative to the
   problem's own magnitudes (costs in seconds are tiny); the optimality gap is purely relative
   (``mip_abs_gap`` = 0), measured on the whole objective, constants included.

HiGHS accepts a row violated by up to its feasibility tolerance, but a memory limit is hard: the
solvers check every plan with :func:`memory_over`, by the problem's own figures.
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
import math
from collections.abc import Sequence
from typing import NamedTuple, TypeVar

import highspy
import numpy as np
import numpy.typing as npt

from fxpar.errors import FxparError
from fxpar.solvers.problem import IntraOpProblem

Vector = npt.NDArray[np.float64]
Matrix = npt.NDArray[np.float64]

_Scalar = TypeVar("_Scalar", bound=np.generic)

_SEPARABLE_TOLERANCE = 1e-12
"""Relative to an edge matrix's largest entry: how far it may be from a[s] + b[t] to be folded."""
_MEMORY_SLACK = 1e-9
"""Relative to the memory limit: the rounding margin under which pruning stays conservative."""


# --- Reductions -------------------------------------------------------------------------------


class Pair(NamedTuple):
    """The merged, non-separable edges between nodes ``u < v``, with candidates grouped into
    classes of identical rows (of u) and identical columns (of v): ``costs[a, b]`` is the cost
    for any candidate of row class ``a`` and any of column class ``b``; ``row_class[i]`` and
    ``column_class[j]`` give the classes of u's i-th and v's j-th candidates."""

    u: int
    v: int
    costs: Matrix
    row_class: npt.NDArray[np.intp]
    column_class: npt.NDArray[np.intp]

    @staticmethod
    def grouped(u: int, v: int, matrix: Matrix) -> Pair:
        rows, row_class = distinct_rows(matrix)
        columns, column_class = distinct_rows(rows.T)
        return Pair(u, v, np.ascontiguousarray(columns.T), row_class, column_class)


def distinct_rows(
    matrix: npt.NDArray[_Scalar],
) -> tuple[npt.NDArray[_Scalar], npt.NDArray[np.intp]]:
    """The distinct rows of ``matrix`` in lexicographic order, and the index among them of
    each row: ``np.unique(matrix, axis=0, return_inverse=True)``, several times faster on the
    small matrices of edges (numpy sorts rows as structured records, one field at a time)."""
    if matrix.shape[0] == 0 or matrix.shape[1] == 0:  # no rows, or all rows alike
        return matrix[:1], np.zeros(len(matrix), dtype=np.intp)
    order = np.lexsort(matrix.T[::-1])
    ordered = matrix[order]
    starts = np.ones(len(ordered), dtype=bool)
    starts[1:] = np.any(ordered[1:] != ordered[:-1], axis=1)
    inverse = np.empty(len(ordered), dtype=np.intp)
    inverse[order] = np.cumsum(starts) - 1
    return ordered[starts], inverse


class Elimination(NamedTuple):
    """Node ``v`` eliminated (reduction 6): its candidate position for each combination of its
    ``neighbours``' candidate positions (a 0-, 1- or 2-d table)."""

    v: int
    neighbours: tuple[int, ...]
    answer: npt.NDArray[np.intp]


@dataclasses.dataclass(frozen=True)
class Reduced:
    """The problem after the reductions, over each node's candidate strategies."""

    candidates: list[list[int]]
    """Per node, the strategies it may take (its variables x[v, ·])."""
    costs: list[Vector]
    """Per node and candidate: its cost plus the separable parts of its edges."""
    pairs: list[Pair]
    excess: list[Vector] | None
    """Per node and candidate: memory above the node's least, over the budget (None: no limit)."""
    memory_row: bool
    """Whether the memory row is written (False when even the hungriest plan fits)."""
    memory_budget: float
    """The row's right-hand side: the budget M − L in the units of ``excess``."""
    cost_scale: float
    eliminated: tuple[Elimination, ...] = ()
    """The eliminated nodes, in order (reduction 6)."""
    constant: float = 0.0
    """Cost of eliminated nodes that met no other decision (their cheapest strategy)."""

    @property
    def free(self) -> list[int]:
        """Nodes with more than one candidate, not eliminated: the decisions."""
        gone = {e.v for e in self.eliminated}
        return [
            v
            for v, candidates in enumerate(self.candidates)
            if len(candidates) > 1 and v not in gone
        ]

    def node_columns(self) -> dict[int, int]:
        """The first column of each free node's x variables."""
        first, column = {}, 0
        for v in self.free:
            first[v] = column
            column += len(self.candidates[v])
        return first

    @property
    def num_node_columns(self) -> int:
        return sum(len(self.candidates[v]) for v in self.free)

    def pair_columns(self) -> list[int]:
        """The first column of each pair's e variables (after all x columns)."""
        first, column = [], self.num_node_columns
        for pair in self.pairs:
            first.append(column)
            column += pair.costs.size
        return first

    @property
    def num_columns(self) -> int:
        return self.num_node_columns + sum(pair.costs.size for pair in self.pairs)

    def plan(self, values: Vector) -> tuple[int, ...]:
        """The strategy of every node from HiGHS's column values."""
        position = [0] * len(self.candidates)
        for v, column in self.node_columns().items():
            position[v] = int(np.argmax(values[column : column + len(self.candidates[v])]))
        for elimination in reversed(self.eliminated):
            at = tuple(position[n] for n in elimination.neighbours)
            position[elimination.v] = int(elimination.answer[at])
        return tuple(self.candidates[v][p] for v, p in enumerate(position))

    def start_values(self, choice: tuple[int, ...]) -> Vector | None:
        """Column values of ``choice`` (None if it uses a pruned strategy; eliminated nodes
        take their recorded answers instead)."""
        gone = {e.v for e in self.eliminated}
        if any(s not in self.candidates[v] for v, s in enumerate(choice) if v not in gone):
            return None
        position = [0 if v in gone else self.candidates[v].index(s) for v, s in enumerate(choice)]
        values = np.zeros(self.num_columns)
        for v, column in self.node_columns().items():
            values[column + position[v]] = 1.0
        for pair, column in zip(self.pairs, self.pair_columns(), strict=True):
            width = pair.costs.shape[1]
            row, col = pair.row_class[position[pair.u]], pair.column_class[position[pair.v]]
            values[column + row * width + col] = 1.0
        return values


def reduce_problem(problem: IntraOpProblem) -> Reduced:
    candidates, excess, memory_row, memory_budget = _prune_by_memory(problem)
    kept = _prune_dominated(problem, candidates)
    if excess is not None:
        excess = [
            e[[old.index(s) for s in new]]
            for e, old, new in zip(excess, candidates, kept, strict=True)
        ]
    candidates = kept
    costs = [
        np.asarray(node_costs, dtype=np.float64)[node_candidates]
        for node_costs, node_candidates in zip(problem.node_costs, candidates, strict=True)
    ]
    matrices = _merge_edges(problem, candidates, costs)
    pairs = []
    for (u, v), matrix in list(matrices.items()):
        if _is_separable(matrix):
            costs[u] += matrix[:, 0]
            costs[v] += matrix[0, :] - matrix[0, 0]
            del matrices[u, v]
    memory_neutral = [
        excess is None or not memory_row or not bool(excess[v].any())
        for v in range(len(candidates))
    ]
    eliminated, constant = _eliminate(candidates, costs, matrices, memory_neutral)
    for (u, v), matrix in sorted(matrices.items()):
        if _is_separable(matrix):
            costs[u] += matrix[:, 0]
            costs[v] += matrix[0, :] - matrix[0, 0]
        else:
            pairs.append(Pair.grouped(u, v, matrix))
    gone = {e.v for e in eliminated}
    magnitudes = [
        np.abs(costs[v]).max() for v, c in enumerate(candidates) if len(c) > 1 and v not in gone
    ]
    magnitudes += [np.abs(pair.costs).max() for pair in pairs]
    largest = float(max(magnitudes, default=0.0))
    cost_scale = largest if largest > 0 and math.isfinite(largest) else 1.0
    return Reduced(
        candidates, costs, pairs, excess, memory_row, memory_budget, cost_scale,
        tuple(eliminated), constant,
    )  # fmt: skip


_ELIMINATION_TABLE = 1 << 18
"""The most entries (candidates of v times those of its two neighbours) of one elimination."""


def _eliminate(
    candidates: list[list[int]],
    costs: list[Vector],
    matrices: dict[tuple[int, int], Matrix],
    memory_neutral: list[bool],
) -> tuple[list[Elimination], float]:
    """Eliminate decisions that meet at most two others (reduction 6), updating ``costs`` and
    ``matrices`` (keyed ``u < v``, over candidate positions) in place; return the eliminations
    in order and the cost of those that met none."""
    neighbours: dict[int, set[int]] = {v: set() for v in range(len(candidates))}
    for u, v in matrices:
        neighbours[u].add(v)
        neighbours[v].add(u)

    def oriented(v: int, w: int) -> Matrix:
        """The edge between v and w with v's candidates on the rows."""
        return matrices.pop((v, w)) if v < w else matrices.pop((w, v)).T

    eliminations: list[Elimination] = []
    constant = 0.0
    gone: set[int] = set()
    queue = [v for v in range(len(candidates)) if len(candidates[v]) > 1]
    while queue:
        v = queue.pop()
        if v in gone or len(candidates[v]) < 2 or not memory_neutral[v]:
            continue
        around = sorted(neighbours[v])
        if len(around) == 0:
            best = int(np.argmin(costs[v]))
            constant += float(costs[v][best])
            eliminations.append(Elimination(v, (), np.array(best)))
        elif len(around) == 1:
            (w,) = around
            total = costs[v][:, None] + oriented(v, w)
            answer = np.argmin(total, axis=0)
            costs[w] = costs[w] + total[answer, np.arange(total.shape[1])]
            eliminations.append(Elimination(v, (w,), answer))
        elif len(around) == 2:
            w1, w2 = around
            if len(candidates[v]) * len(candidates[w1]) * len(candidates[w2]) > _ELIMINATION_TABLE:
                continue
            first, second = oriented(v, w1), oriented(v, w2)
            total = costs[v][:, None, None] + first[:, :, None] + second[:, None, :]
            answer = np.argmin(total, axis=0)
            through = np.take_along_axis(total, answer[None], axis=0)[0]
            matrices[w1, w2] = matrices[w1, w2] + through if (w1, w2) in matrices else through
            neighbours[w1].add(w2)
            neighbours[w2].add(w1)
            eliminations.append(Elimination(v, (w1, w2), answer))
        else:
            continue
        gone.add(v)
        for w in around:
            neighbours[w].discard(v)
            queue.append(w)
    return eliminations, constant


def _prune_dominated(problem: IntraOpProblem, candidates: list[list[int]]) -> list[list[int]]:
    """Drop strategies another strategy of the same node beats or ties everywhere: no more
    cost, no more memory, and no more on any edge against any remaining strategy of the
    neighbour (reduction 1b). Repeated until nothing changes; among equals the first stays."""
    node_costs = [np.asarray(c, dtype=np.float64) for c in problem.node_costs]
    for edge in problem.edges:
        if edge.source == edge.target:
            node_costs[edge.source] = node_costs[edge.source] + np.diag(edge.matrix)
    matrices = [edge.matrix for edge in problem.edges]
    incident: list[list[tuple[int, bool]]] = [[] for _ in candidates]
    for index, edge in enumerate(problem.edges):
        if edge.source != edge.target:
            incident[edge.source].append((index, True))
            incident[edge.target].append((index, False))
    neighbours = [
        {
            problem.edges[index].target if out else problem.edges[index].source
            for index, out in edges
        }
        for edges in incident
    ]
    kept = [list(c) for c in candidates]
    # Sweeps in node order until one changes nothing, visiting only the nodes a neighbour's
    # pruning may have changed since their last visit: a node behind the sweep waits for the
    # next one, one ahead of it is visited in this one (as a full sweep would).
    sweep = list(range(len(kept)))
    while sweep:
        heapq.heapify(sweep)
        waiting: set[int] = set(sweep)
        following: set[int] = set()
        while sweep:
            v = heapq.heappop(sweep)
            waiting.discard(v)
            alive = kept[v]
            if len(alive) < 2:
                continue
            parts = [node_costs[v][alive, None], np.asarray(problem.node_memory[v])[alive, None]]
            for index, outgoing in incident[v]:
                edge = problem.edges[index]
                if outgoing:
                    parts.append(matrices[index][np.ix_(alive, kept[edge.target])])
                else:
                    parts.append(matrices[index][np.ix_(kept[edge.source], alive)].T)
            profile = np.concatenate(parts, axis=1)
            # no_worse[a, b]: b is at least as good as a everywhere.
            no_worse = np.all(profile[None, :, :] <= profile[:, None, :], axis=2)
            equal = no_worse & no_worse.T
            order = np.arange(len(alive))
            earlier_equal = equal & (order[None, :] < order[:, None])
            beaten = np.any((no_worse & ~equal) | earlier_equal, axis=1)
            if not beaten.any():
                continue
            kept[v] = [s for s, gone in zip(alive, beaten, strict=True) if not gone]
            for w in neighbours[v]:
                if w < v:
                    following.add(w)
                elif w not in waiting:
                    waiting.add(w)
                    heapq.heappush(sweep, w)
        sweep = sorted(following)
    return kept


def _prune_by_memory(
    problem: IntraOpProblem,
) -> tuple[list[list[int]], list[Vector] | None, bool, float]:
    """Each node's candidates (the strategies that can fit), their excess memory, whether the
    memory row is needed, and its budget (reduction 1). Memory is scaled so that the budget is 1,
    or 0 when there is none to spare."""
    memory = [np.asarray(m, dtype=np.float64) for m in problem.node_memory]
    if problem.memory_limit is None:
        return [list(range(len(m))) for m in memory], None, False, math.inf
    budget = problem.memory_limit - problem.least_memory()
    # Rounding in the sums above must neither prune a plan that fits nor drop a row that binds.
    slack = _MEMORY_SLACK * max(abs(problem.memory_limit), 1.0)
    excess_bytes = [m - m.min() for m in memory]
    candidates = [[int(s) for s in np.flatnonzero(e <= budget + slack)] for e in excess_bytes]
    hungriest = sum(float(e[c].max()) for e, c in zip(excess_bytes, candidates, strict=True))
    scale = max(budget, slack)
    excess = [e[c] / scale for e, c in zip(excess_bytes, candidates, strict=True)]
    return candidates, excess, hungriest > budget - slack, max(budget, 0.0) / scale


def _merge_edges(
    problem: IntraOpProblem, candidates: list[list[int]], costs: list[Vector]
) -> dict[tuple[int, int], Matrix]:
    """One matrix per pair of nodes ``u < v`` over their candidates; self-loops go into
    ``costs`` (reduction 3)."""
    merged: dict[tuple[int, int], Matrix] = {}
    for edge in problem.edges:
        u, v = edge.source, edge.target
        matrix = edge.matrix
        if u == v:
            costs[u] += matrix[candidates[u], candidates[u]]
            continue
        if u > v:
            u, v, matrix = v, u, matrix.T
        restricted = matrix[np.ix_(candidates[u], candidates[v])]
        merged[u, v] = merged[u, v] + restricted if (u, v) in merged else restricted.copy()
    return merged


def _is_separable(matrix: Matrix) -> bool:
    """Whether ``matrix[s, t] == a[s] + b[t]`` (reduction 4)."""
    residual = matrix - matrix[:, :1] - matrix[:1, :] + matrix[0, 0]
    return bool(np.abs(residual).max() <= _SEPARABLE_TOLERANCE * np.abs(matrix).max())


# --- The model --------------------------------------------------------------------------------


class Rows(NamedTuple):
    """A block of constraints ``lower <= A x <= upper`` with ``A`` stored row by row: row ``i``
    has the coefficients ``values[starts[i]:starts[i + 1]]`` on the columns ``columns[...]``."""

    starts: npt.NDArray[np.int64]
    columns: npt.NDArray[np.int32]
    values: Vector
    lower: Vector
    upper: Vector

    @property
    def num_rows(self) -> int:
        return len(self.starts) - 1


def build_model(reduced: Reduced, tightening: float) -> highspy.HighsLp:
    rows = [
        *one_strategy_per_node(reduced),
        *edge_consistency(reduced),
        *memory_limit(reduced, tightening),
    ]
    return assemble(reduced, rows, integral=True)


def assemble(reduced: Reduced, blocks: list[Rows], integral: bool) -> highspy.HighsLp:
    """The model of the constraints in ``blocks`` over the reduced problem's columns and
    objective; the x columns are integers if ``integral`` (else: the LP relaxation)."""
    costs, offset = column_costs(reduced)
    num_binaries = reduced.num_node_columns if integral else 0
    num_rows = sum(block.num_rows for block in blocks)
    lp = highspy.HighsLp()
    lp.num_col_ = len(costs)
    lp.num_row_ = num_rows
    lp.col_cost_ = costs
    lp.offset_ = offset
    lp.col_lower_ = np.zeros(len(costs))
    lp.col_upper_ = np.ones(len(costs))
    lp.row_lower_ = _joined([block.lower for block in blocks], np.float64)
    lp.row_upper_ = _joined([block.upper for block in blocks], np.float64)
    lp.integrality_ = [highspy.HighsVarType.kInteger] * num_binaries + [
        highspy.HighsVarType.kContinuous
    ] * (len(costs) - num_binaries)
    matrix = lp.a_matrix_
    matrix.format_ = highspy.MatrixFormat.kRowwise
    matrix.num_col_ = len(costs)
    matrix.num_row_ = num_rows
    offsets = np.cumsum([0] + [len(block.columns) for block in blocks])
    matrix.start_ = _joined(
        [np.zeros(1, dtype=np.int64)]
        + [block.starts[1:] + at for block, at in zip(blocks, offsets, strict=False)],
        np.int32,
    )
    matrix.index_ = _joined([block.columns for block in blocks], np.int32)
    matrix.value_ = _joined([block.values for block in blocks], np.float64)
    return lp


def one_strategy_per_node(reduced: Reduced) -> list[Rows]:
    """Σ_s x[v,s] = 1 for every free node."""
    counts = [len(reduced.candidates[v]) for v in reduced.free]
    if not counts:
        return []
    total = sum(counts)  # the x columns: each free node's, one after another
    ones = np.ones(len(counts))
    return [Rows(_starts(counts), np.arange(total, dtype=np.int32), np.ones(total), ones, ones)]


def edge_consistency(reduced: Reduced) -> list[Rows]:
    """Σ_b e[uv,a,b] − Σ_(s∈a) x[u,s] = 0 for every row class a, and
    Σ_a e[uv,a,b] − Σ_(t∈b) x[v,t] = 0 for every column class b, for every kept edge.

    Candidates with identical cost rows (columns) are interchangeable on that edge, so e needs
    one variable per pair of classes: with one-hot x the class sums are one-hot too, and e is
    still their product.
    """
    node_column = reduced.node_columns()
    blocks = []
    for pair, first in zip(reduced.pairs, reduced.pair_columns(), strict=True):
        height, width = pair.costs.shape
        pair_columns = first + np.arange(height * width, dtype=np.int32).reshape(height, width)
        blocks.append(_class_rows(pair_columns, pair.row_class, node_column[pair.u]))
        blocks.append(_class_rows(pair_columns.T, pair.column_class, node_column[pair.v]))
    return blocks


def _class_rows(lines: npt.NDArray[np.int32], classes: npt.NDArray[np.intp], first: int) -> Rows:
    """Row ``a``: +1 on the e columns ``lines[a]``, then −1 on the x columns (``first`` plus
    the position) of the candidates in class ``a``, in order; each row sums to 0."""
    height, width = lines.shape
    counts = np.bincount(classes, minlength=height)
    starts = _starts(width + counts)
    columns = np.empty(starts[-1], dtype=np.int32)
    values = np.empty(starts[-1])
    slots = starts[:-1, None] + np.arange(width)
    columns[slots], values[slots] = lines, 1.0
    order = np.argsort(classes, kind="stable")
    ordered = classes[order]
    rank = np.arange(len(order)) - (np.cumsum(counts) - counts)[ordered]
    slots = starts[ordered] + width + rank
    columns[slots], values[slots] = first + order, -1.0
    zeros = np.zeros(height)
    return Rows(starts, columns, values, zeros, zeros)


def _starts(lengths: Sequence[int] | npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


def memory_limit(reduced: Reduced, tightening: float) -> list[Rows]:
    """Σ_v Σ_s (m[v,s] − m_min[v]) / (M − L) · x[v,s] ≤ 1 − ``tightening``, if needed (the
    budget is 0 instead of 1 when M = L)."""
    if reduced.excess is None or not reduced.memory_row:
        return []
    columns, values = [], []
    for v, column in reduced.node_columns().items():
        positive = np.flatnonzero(reduced.excess[v] > 0)
        columns.append((column + positive).astype(np.int32))
        values.append(reduced.excess[v][positive])
    joined = _joined(columns, np.int32)
    if not len(joined):
        return []
    upper = np.array([reduced.memory_budget * (1.0 - tightening)])
    return [
        Rows(_starts([len(joined)]), joined, _joined(values, np.float64), -np.inf + upper, upper)
    ]


def column_costs(reduced: Reduced) -> tuple[Vector, float]:
    """Column costs (x then e) and the constant of fixed nodes, divided by the cost scale."""
    fixed = reduced.constant + sum(
        float(reduced.costs[v][0]) for v, c in enumerate(reduced.candidates) if len(c) == 1
    )
    parts = [reduced.costs[v] for v in reduced.free] + [p.costs.ravel() for p in reduced.pairs]
    costs = np.concatenate(parts) if parts else np.zeros(0)
    return costs / reduced.cost_scale, fixed / reduced.cost_scale


# --- Helpers ----------------------------------------------------------------------------------


def _joined(parts: list[npt.NDArray[_Scalar]], dtype: type[_Scalar]) -> npt.NDArray[_Scalar]:
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype=dtype)


highs_logger = logging.getLogger("fxpar.solvers.ilp.highs")
"""HiGHS's own log, one record per message at DEBUG. HiGHS writes nothing to the console; with
this logger enabled for DEBUG when a HiGHS instance is made, that instance's log comes here (each
message is a call into Python, so it is only asked for then)."""


class QuietHighs(highspy.Highs):
    """A :class:`highspy.Highs` that never writes to the console.

    ``highspy.Highs.__init__`` installs its callback dispatcher with :meth:`enableCallbacks`, and
    installing it makes HiGHS write its banner ("Running HiGHS 1.x ...") under the default
    options, that is to stdout, before the constructor returns and any option could be set.
    Output is turned off here, just before that call. The banner, written once per process, then
    waits for the first solve with output on, whose log goes to :data:`highs_logger`.
    """

    def enableCallbacks(self) -> None:
        self.setOptionValue("output_flag", False)
        self.setOptionValue("log_to_console", False)
        super().enableCallbacks()


def _log_highs_message(event: highspy.HighsCallbackEvent) -> None:
    message = event.message.rstrip("\n")
    if message.strip():
        highs_logger.debug("%s", message)


def new_highs(threads: int | None) -> highspy.Highs:
    """A HiGHS instance that writes nothing to the console and its log to :data:`highs_logger`,
    with a pool of ``threads`` threads if given."""
    highs = QuietHighs()
    if highs_logger.isEnabledFor(logging.DEBUG):
        highs.cbLogging.subscribe(_log_highs_message)
        # With a logging callback and log_to_console off, output goes to the callback alone.
        highs.setOptionValue("output_flag", True)
    if threads is not None:
        highs.setOptionValue("threads", threads)
        # The pool is built once per process; a different size is refused until it is reset.
        highspy.Highs.resetGlobalScheduler(True)
    return highs


def check(status: highspy.HighsStatus, doing: str) -> None:
    if status == highspy.HighsStatus.kError:
        raise FxparError(f"HiGHS failed {doing}")


def memory_over(problem: IntraOpProblem, choice: tuple[int, ...]) -> float:
    if problem.memory_limit is None:
        return 0.0
    return problem.memory(choice) - problem.memory_limit


def relative_gap(objective: float, bound: float) -> float:
    """HiGHS's definition: |primal − dual| / |primal|, 0 when both are 0."""
    if not math.isfinite(bound):
        return math.inf
    if objective == 0:
        return 0.0 if bound == 0 else math.inf
    return max(objective - bound, 0.0) / abs(objective)


def model_size(problem: IntraOpProblem) -> tuple[int, int]:
    """(variables, constraints) of the ILP :class:`ILPSolver` builds for ``problem``, after its
    reductions: what the benchmarks report."""
    model = build_model(reduce_problem(problem), tightening=0.0)
    return model.num_col_, model.num_row_
