"""Resharding: turning a tensor's spec into another, one collective per mesh axis.

Per axis, the table of docs/sharding.md: S→R all-gather, P→R all-reduce, P→S reduce-scatter,
S(i)→S(j) all-to-all, R→S local slice, and R→P keeping the value on the axis's first device
(zeros elsewhere). :func:`reshard_steps` orders these so that nested shards stay in order:

1. un-shard, innermost axis first, every axis whose shard changes, plus any inner axis that
   shards a dim an outer changing axis touches (it is re-sliced in step 3);
2. reduce partials: reduce-scatter when the target is the only shard of its dim, else all-reduce;
3. shard, outermost axis first: local slices (and R→P).

The same steps drive the lowering (which emits them) and the cost model (which prices them).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from fxpar.sharding import Spec

StepKind = Literal[
    "all_gather", "all_reduce", "reduce_scatter", "all_to_all", "slice", "to_partial"
]
COLLECTIVES = ("all_gather", "all_reduce", "reduce_scatter", "all_to_all")


@dataclass(frozen=True)
class ReshardStep:
    """One step on one mesh axis. ``dim`` is the tensor dim gathered, scattered or sliced; for
    all-to-all, the tensor goes from sharded on ``dim`` to sharded on ``to_dim``."""

    kind: StepKind
    axis: int
    dim: int | None = None
    to_dim: int | None = None

    @property
    def is_collective(self) -> bool:
        return self.kind in COLLECTIVES

    def apply(self, spec: Spec) -> Spec:
        """The spec of the tensor after this step."""
        placements = list(spec)
        if self.kind in ("all_gather", "all_reduce"):
            placements[self.axis] = Replicate()
        elif self.kind in ("reduce_scatter", "slice"):
            placements[self.axis] = Shard(self.dim)  # type: ignore[arg-type]
        elif self.kind == "all_to_all":
            placements[self.axis] = Shard(self.to_dim)  # type: ignore[arg-type]
        else:
            placements[self.axis] = Partial()
        return tuple(placements)

    @property
    def code_after(self) -> int:
        """The code (:func:`spec_code`) of this step's axis after the step."""
        if self.kind in ("all_gather", "all_reduce"):
            return REPLICATE
        if self.kind in ("reduce_scatter", "slice"):
            return self.dim  # type: ignore[return-value]
        if self.kind == "all_to_all":
            return self.to_dim  # type: ignore[return-value]
        return PARTIAL


REPLICATE, PARTIAL = -1, -2
"""A spec's *code* is a tuple of ints, one per mesh axis: the sharded tensor dim, or
:data:`REPLICATE` or :data:`PARTIAL` (:func:`spec_code`). Codes hash and compare fast, where
torch's placements do neither: the planner prices millions of pairs of specs."""
Code = tuple[int, ...]


def spec_code(spec: Spec) -> Code:
    """The code of ``spec``: its placements as ints."""
    return tuple(map(_placement_code, spec))


class SpecCoder:
    """:func:`spec_code`, remembered by the spec's identity: the specs of a step are a few
    shared objects met many times, and the planner keys and compares codes instead of specs,
    whose torch placements hash and compare through a Python call per placement at every
    lookup (a cost that grows with the mesh's axes and the candidates propagated)."""

    def __init__(self) -> None:
        self._codes: dict[int, tuple[Spec, Code]] = {}  # the spec is kept, so its id stays its

    def __call__(self, spec: Spec) -> Code:
        found = self._codes.get(id(spec))
        if found is None:
            found = self._codes[id(spec)] = (spec, spec_code(spec))
        return found[1]


def _placement_code(placement: Placement) -> int:
    # By exact type first: isinstance on torch's placements goes through a slow metaclass
    # check, and the planner codes hundreds of thousands of specs.
    kind = type(placement)
    if kind is Replicate:
        return REPLICATE
    if kind is Shard:
        return placement.dim  # type: ignore[attr-defined]
    if kind is Partial:
        return PARTIAL
    if isinstance(placement, Shard):
        return placement.dim
    return PARTIAL if isinstance(placement, Partial) else REPLICATE


def reshard_steps(src: Spec, dst: Spec, mesh_shape: Sequence[int]) -> list[ReshardStep]:
    """The steps that turn a tensor laid out as ``src`` into ``dst``."""
    if src == dst:
        return []
    return list(coded_steps(spec_code(src), spec_code(dst), tuple(mesh_shape)))


@functools.lru_cache(maxsize=1 << 18)
def coded_steps(src: Code, dst: Code, mesh_shape: tuple[int, ...]) -> tuple[ReshardStep, ...]:
    """:func:`reshard_steps` on codes (:func:`spec_code`)."""
    if src == dst:
        return ()
    ndim = len(mesh_shape)
    current = list(src)
    changed = [a for a in range(ndim) if src[a] != dst[a] and mesh_shape[a] > 1]
    unshard = {a for a in changed if src[a] >= 0}
    for a in changed:
        touched = {d for d in (src[a], dst[a]) if d >= 0}
        unshard.update(b for b in range(a + 1, ndim) if src[b] in touched)
    steps: list[ReshardStep] = []
    for b in sorted(unshard, reverse=True):
        source_dim, target_dim = current[b], dst[b]
        if target_dim >= 0 and target_dim != source_dim and _alone(b, source_dim, target_dim,
                                                                    src, dst):  # fmt: skip
            steps.append(ReshardStep("all_to_all", b, source_dim, target_dim))
            current[b] = target_dim
        else:
            steps.append(ReshardStep("all_gather", b, source_dim))
            current[b] = REPLICATE
    for a in range(ndim):
        if current[a] == PARTIAL and dst[a] != PARTIAL:
            target_dim = dst[a]
            alone = all(dst[b] != target_dim for b in range(ndim) if b != a)
            if target_dim >= 0 and alone and mesh_shape[a] > 1:
                steps.append(ReshardStep("reduce_scatter", a, target_dim))
                current[a] = target_dim
            else:
                steps.append(ReshardStep("all_reduce", a))
                current[a] = REPLICATE
    for a in range(ndim):
        if current[a] == dst[a]:
            continue
        if dst[a] >= 0:
            steps.append(ReshardStep("slice", a, dst[a]))
        elif dst[a] == PARTIAL:
            steps.append(ReshardStep("to_partial", a))
        current[a] = dst[a]
    # On an axis of one device every placement is the whole tensor: nothing to do there.
    return tuple(s for s in steps if mesh_shape[s.axis] > 1)


def _alone(axis: int, source_dim: int, target_dim: int, src: Code, dst: Code) -> bool:
    """An all-to-all on ``axis`` is exact when no other axis shards either dim."""
    dims = (source_dim, target_dim)
    return source_dim >= 0 and not any(
        b != axis and (src[b] in dims or dst[b] in dims) for b in range(len(src))
    )


@dataclass(frozen=True)
class BucketRoute:
    """How a result of the step reaches its output layout when that takes only reductions: a
    sum over one or more mesh axes (``all_reduce``, data parallelism's gradients) or over one
    axis keeping this device's chunk of tensor dim ``dim`` (``reduce_scatter``, fully sharded
    gradients). Results on the same route (and of one dtype) travel together in buckets."""

    kind: Literal["all_reduce", "reduce_scatter"]
    axes: tuple[int, ...]
    dim: int | None = None

    @property
    def key(self) -> tuple[str, tuple[int, ...]]:
        """What results must share to go in one bucket (reduce-scatters may split
        different dims)."""
        return self.kind, self.axes


def bucket_route(current: Spec, want: Spec, mesh_shape: Sequence[int]) -> BucketRoute | None:
    """The route of a result going from ``current`` to ``want`` when it can travel in a bucket
    (all-reduces only, or one reduce-scatter), else None."""
    return bucket_route_of(reshard_steps(current, want, mesh_shape))


def bucket_route_of(steps: Sequence[ReshardStep]) -> BucketRoute | None:
    """:func:`bucket_route` of a resharding taking ``steps``."""
    if steps and all(step.kind == "all_reduce" for step in steps):
        return BucketRoute("all_reduce", tuple(step.axis for step in steps))
    if len(steps) == 1 and steps[0].kind == "reduce_scatter":
        return BucketRoute("reduce_scatter", (steps[0].axis,), steps[0].dim)
    return None


def gather_route(current: Spec, want: Spec, mesh_shape: Sequence[int]) -> tuple[int, ...] | None:
    """The mesh axes, in the order gathered (innermost first), when going from ``current`` to
    ``want`` takes only all-gathers of one tensor dim (a parameter sharded on dim 0 over one
    or more axes, gathered whole), else None."""
    return gather_route_of(reshard_steps(current, want, mesh_shape))


def gather_route_of(steps: Sequence[ReshardStep]) -> tuple[int, ...] | None:
    """:func:`gather_route` of a resharding taking ``steps``."""
    if not steps or any(s.kind != "all_gather" or s.dim != steps[0].dim for s in steps):
        return None
    return tuple(step.axis for step in steps)
