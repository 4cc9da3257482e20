"""Conversions several readers share, priced once.

The lowering converts a value to another layout once, however many ops read it in that layout
(:mod:`fxpar.planning.collective_schedule` keys each conversion by value and layout; only a
parameter converts again in each phase). The intra-op problem prices communication on edges,
one per reader, so a value that two readers need in the same layout would be charged twice:
the loss's partial token count that both the loss and its backward divide by, an activation
that its matmul and the backward of that matmul both gather. The solver then avoids plans whose
conversions are shared and picks ones the lowering runs slower (on 4 gloo ranks, a ViT's
labels replicated and its logits gathered, where data parallelism all-reduces one count).

The problem stays pairwise. For a value made by problem node ``u`` and a layout ``X`` that at
least two of its readers may require, :func:`share_reads` takes the conversion off the readers'
edges and adds one decision with two choices, *not converted* (0) and *converted* (1):

- edge ``(u, a)``: converted costs ``r[s]``, the conversion from ``u``'s layout under its
  strategy ``s`` to ``X``; not converted costs nothing;
- edge ``(a, v)`` per reader: a strategy ``t`` of ``v`` that reads the value as ``X`` costs
  ``max(r)`` when the value is not converted, nothing when it is.

Whatever the others choose, the cheapest choice of ``a`` costs ``r[s]`` when some reader needs
``X`` (converting costs ``r[s] <= max(r)``, not converting at least ``max(r)``) and nothing
when none does: exactly the lowering's one conversion, with no large constant to upset the
solver's scaling. Every solver sees an ordinary problem; :meth:`SharedRead.converted` gives the
auxiliary decisions of a plan chosen by other means (a manual plan). Identical reads of repeated
layers become one decision whose edges count them all.

**Folded steps** (:mod:`fxpar.ir.fold`): a node standing for ``w`` layers' reads weighs ``w``.
Readers of one weight read ``w`` copies of the value, converted ``w`` times; readers of mixed
weights (the rotary table every layer reads) read one value, converted as often as the lightest
reader counts, each reader's penalty weighted by its own count, so that the folded step's
problem is the whole step's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import ClassVar

import numpy as np
import numpy.typing as npt

from fxpar.sharding import Strategy
from fxpar.solvers.problem import SHARED_READ

Matrix = npt.NDArray[np.float64]


def shared_on(
    mesh_shape: Sequence[int], hungriest: float = 0.0, limit: float | None = None
) -> bool:
    """Whether a problem prices shared conversions once: on one mesh axis, where its hungriest
    plan (``hungriest`` bytes per device) fits in ``limit`` (the device's memory). With more
    axes a value has many more layouts, one auxiliary decision each, and HiGHS no longer
    proves the optimum in its time (Llama-8B on (2, 4): 60 s and an 88% gap, against 2 s
    without them); where memory binds, the branch and bound over memory levels
    (:mod:`fxpar.solvers.ilp_search`) explores many more nodes (Llama-70B's stage meshes:
    ``benchmarks/alpa.py 70b-16`` planned in 65 s against 14). There every reader pays."""
    return len(mesh_shape) == 1 and (limit is None or hungriest <= limit)


@dataclass(frozen=True)
class Read:
    """One reader's edge from the producer: the reader's problem node, the edge's costs
    ``matrix[s][t]`` for one read, the layout (an id) strategy ``t`` of the reader requires,
    and how many reads the edge stands for (a folded layer's)."""

    reader: int
    matrix: Matrix
    required: Sequence[int]
    weight: int = 1


@dataclass(frozen=True)
class SharedRead:
    """An auxiliary decision: whether the value of ``source`` is converted to one layout, read
    so by the strategies each reader lists (a reader may appear twice), with the reader's
    weight relative to :attr:`count`."""

    source: int
    readers: tuple[tuple[int, frozenset[int], float], ...]
    conversion: tuple[float, ...]
    """Seconds to convert once, per strategy of ``source``."""
    penalty: float
    """What a reader pays per read when the value is not converted: the dearest conversion."""
    count: int = field(default=1, compare=False)
    """How many conversions the decision stands for (repeated or folded layers)."""
    name: str = field(default="", compare=False)
    """The value's graph node, for messages."""

    KIND: ClassVar[str] = SHARED_READ
    """The decision's :attr:`~fxpar.solvers.problem.IntraOpProblem.kinds` entry."""
    STRATEGIES: ClassVar[tuple[Strategy, Strategy]] = (Strategy((None,), ()), Strategy((None,), ()))
    """What its two choices stand for: no layout of a graph node's (a solver reading
    placements finds none)."""

    def converted(self, choice: Sequence[int]) -> int:
        """The choice (0 or 1) this decision takes when the others are ``choice``."""
        return int(any(choice[v] in wanted for v, wanted, _ in self.readers))

    def edges(self, node: int, sizes: Sequence[int]) -> list[tuple[int, int, Matrix]]:
        """The decision's edges as (source, target, costs), ``node`` being its index and
        ``sizes[v]`` node ``v``'s number of strategies."""
        into = np.zeros((len(self.conversion), 2))
        into[:, 1] = self.count * np.asarray(self.conversion)
        found = [(self.source, node, into)]
        for reader, wanted, weight in self.readers:
            out = np.zeros((2, sizes[reader]))
            out[0, sorted(wanted)] = self.count * weight * self.penalty
            found.append((node, reader, out))
        return found


def share_reads(
    source: int, reads: Sequence[Read], name: str = ""
) -> tuple[list[Matrix], list[SharedRead]]:
    """The readers' edges (for one read each) with every conversion two or more of them may
    share taken off, and a :class:`SharedRead` per such layout."""
    matrices = [read.matrix for read in reads]
    by_layout: dict[int, list[tuple[int, list[int]]]] = {}
    for index, read in enumerate(reads):
        columns: dict[int, list[int]] = {}
        for t, layout in enumerate(read.required):
            columns.setdefault(layout, []).append(t)
        for layout, wanted in columns.items():
            by_layout.setdefault(layout, []).append((index, wanted))
    shared = []
    for wanting in by_layout.values():
        if len(wanting) < 2:
            continue
        first, first_columns = wanting[0]
        conversion = matrices[first][:, first_columns[0]].copy()
        if not conversion.any():
            continue
        count = min(reads[index].weight for index, _ in wanting)
        readers = []
        for index, wanted in wanting:
            if matrices[index] is reads[index].matrix:
                matrices[index] = matrices[index].copy()
            matrices[index][:, wanted] = 0.0
            readers.append((reads[index].reader, frozenset(wanted), reads[index].weight / count))
        if len({reader for reader, _, _ in readers}) == 1:
            # One decision reads it (merged layers' readers): whether it is converted is that
            # decision's choice alone, and the conversion goes on the first read's edge.
            wanted = sorted(frozenset().union(*(w for _, w, _ in readers)))
            matrices[first][:, wanted] += conversion[:, None] * count / reads[first].weight
            continue
        shared.append(
            SharedRead(
                source,
                tuple(readers),
                tuple(map(float, conversion)),
                float(conversion.max()),
                count,
                name,
            )
        )
    return matrices, shared


def merge(shared: Sequence[SharedRead]) -> list[SharedRead]:
    """Identical decisions (the same reads in repeated layers) as one that counts them all."""
    merged: dict[SharedRead, SharedRead] = {}
    for read in shared:
        first = merged.get(read)
        merged[read] = read if first is None else replace(first, count=first.count + read.count)
    return list(merged.values())
