"""Stage construction: cut the layers into pipeline stages and give each stage a submesh.

This is the inter-operator pass of Alpa, on plain data. The layers ``0 .. L-1`` come from
:mod:`fxpar.solvers.layers`; the cluster is a mesh of ``D`` devices; the caller lists the submesh
shapes a stage may run on and, through a cost table, what running layers ``[i, j)`` on a submesh
of shape ``s`` costs: the stage's time per microbatch ``t`` (forward and backward), and its memory
per device, ``static + f * activation`` when ``f`` microbatches are in flight. A table entry of
``None`` (or a missing key) means the stage cannot run that way; infinite costs are refused.

**Problem.** Choose ``K`` stages ``[p_0, p_1), [p_1, p_2), ..., [p_{K-1}, p_K)`` with
``0 = p_0 < ... < p_K = L`` and a submesh shape ``s_k`` for each, to minimize the step time of a
synchronous pipeline over ``M`` microbatches,

    T = sum_k t_k + (M - 1) * max_k t_k,

subject to

- the submeshes use exactly the cluster: ``sum_k devices(s_k) = D`` (as in Alpa; exact use is
  what the tiling guarantee below needs, and a caller who wants devices left idle describes a
  smaller cluster);
- every stage fits: ``static_k + f_k * activation_k <= memory_limit``, ``f_k`` the caller's
  ``in_flight_counts(K)[k]``, read off the schedule's lists (:meth:`fxpar.pipeline.Schedule.
  in_flight`): ``M`` under GPipe, ``min(K - k, M)`` under 1F1B (``K - k - 1`` warm-up forwards),
  ``min(K, M)`` under ZB-H1 (the caller's activation holds the stash and what B keeps for W);
- ``K`` is given (``stages=k``) or free (``stages="auto"``, any ``1 <= K <= min(L, D)``).

Rematerialization is not a separate case: the caller's table then reports the smaller activation
memory of the recomputing stage.

**Algorithm.** The ``max`` couples the stages, so fix it: for a bound ``t_max``, the best plan
whose stages all take at most ``t_max`` minimizes the sum alone, which is a DP. Because ``f_k``
under 1F1B depends on how many stages come *after* stage ``k``, the DP runs from the last layer
backwards and counts the stages already placed behind. With ``G(l, d, n)`` the least sum of stage
times of ``n`` stages covering layers ``[l, L)`` on exactly ``d`` devices,

    G(L, 0, 0) = 0,    G(L, d, n) = inf otherwise,    G(l < L, d, 0) = inf,
    G(l, d, n) = min over l < j <= L and shapes s with cost c = table(l, j, s) such that
                     c.time <= t_max  and  c.static + f(n) * c.activation <= memory_limit
                 of  c.time + G(j, d - devices(s), n - 1),

where ``f(n)`` is what a stage with ``n - 1`` stages behind it (stage ``K - n``) keeps. The
value for ``t_max`` is ``G(0, D, K) + (M - 1) * t_max`` (minimized over ``K`` when it is free).
Every ``t_max`` bounds the step time of some plan, and with ``t_max`` the slowest stage time of
an optimal plan it gives the optimum: trying every distinct stage time as ``t_max`` is exact.

Where the counts depend only on the stages behind (checked on the caller's counts of every
``K``), the count saturates when ``K`` is free, at the least ``n`` from which ``f`` stays put:
GPipe needs none (one state), 1F1B ``n`` up to ``M``. ZB-H1's ``f = min(K, M)`` is the plan's
own ``K``, unknown while the DP places a stage: with ``K`` free each ``K`` is solved on its own
(:func:`solve_each_stage_count`, at most ``min(L, D)`` solves) and the least value wins.
The candidate ``t_max`` values form one numpy axis and the device count another, so a whole
batch of candidates is one pass over ``(l, n, table entry)``: ``O(L^2 S K)`` vector operations of
size ``(candidates, D + 1)`` for ``S`` shapes. Not every candidate needs trying: the least sum
``G(t)`` can only fall as ``t`` grows, so a candidate ``t`` below a tried bound ``u`` is worth at
least ``G(u) + (M - 1) * t``. The first batch samples the candidates evenly, the largest (which
constrains nothing) included; later batches take the untried candidates of least lower bound, and
those whose lower bound cannot beat the best value found are never tried.

**Submeshes.** A stage's submesh is a shape, not a device set: the DP counts devices. That is sound
when every multiset of allowed shapes with ``D`` devices in all can tile the mesh, so the shapes
are restricted (Alpa's restriction, slightly generalized): on a 1-D mesh ``(D,)``, any ``(b,)``
with ``b <= D``; on a 2-D mesh ``(R, C)``, whole-row blocks ``(r, C)`` and single-row pieces
``(1, w)`` whose widths, with ``C``, divide one another (powers of two dividing ``C``, say).
:func:`place_submeshes` then lays any such multiset out: whole rows first, then the pieces widest
first, left to right, which never leaves a gap because each width divides all wider ones.

:func:`brute_force_stages` tries every plan and is the reference for the tests;
:func:`evaluate_stages` scores a plan the caller chose by hand, under the same rules.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Literal, NamedTuple

import numpy as np
import numpy.typing as npt

from fxpar.errors import FxparError
from fxpar.solvers.errors import format_bytes

Submesh = tuple[int, ...]
Coordinate = tuple[int, ...]
InFlightCounts = Callable[[int], Sequence[int]]
"""``K ->`` the microbatches each of ``K`` stages keeps activations for; asked once per K."""
StageCount = int | Literal["auto"]
StageCostTable = (
    Callable[[int, int, Submesh], "StageCost | None"]
    | Mapping[tuple[int, int, Submesh], "StageCost | None"]
)
"""``(start, stop, submesh) -> cost``, for the layers ``[start, stop)``; ``None`` or a missing key
means infeasible. A callable is asked at most once per entry and solve."""

_Floats = npt.NDArray[np.float64]
_Table = list[list[_Floats]]
"""``table[l][n]``: ``G(l, ., n)`` for a batch of bounds, shape ``(bounds, D + 1)``."""

_CELL_BUDGET = 1 << 22
"""The most float64 cells the DP tables of one batch of bounds may hold (32 MiB)."""


class InvalidStageProblemError(FxparError, ValueError):
    """The stage problem is malformed: no layers, no microbatches, submesh shapes that do not
    tile the mesh, more stages than layers or devices, a bad manual plan, a bad cost entry."""


class NoStagePlanError(FxparError):
    """No plan covers the layers with the allowed submeshes and the cost table's entries."""


class StageMemoryError(NoStagePlanError):
    """Plans exist, but none fits the memory limit. ``least_memory`` is the per-device memory of
    the most frugal plan (its hungriest stage), ``memory_limit`` the limit, both in bytes."""

    def __init__(self, message: str, *, least_memory: float, memory_limit: float) -> None:
        super().__init__(message)
        self.least_memory = least_memory
        self.memory_limit = memory_limit


@dataclasses.dataclass(frozen=True)
class StageCost:
    """What running one stage costs, per the caller's cost model."""

    time: float
    """Seconds per microbatch, forward and backward."""
    static_memory: float
    """Bytes per device held for the whole step: parameters, gradients, optimizer state."""
    activation_memory: float
    """Bytes per device held for each microbatch in flight."""
    per_step: float = 0.0
    """Seconds spent once a step (gradient reduction, update), of which ``time`` holds
    ``1/M`` (:func:`per_step_overcount`)."""

    def memory(self, in_flight: int) -> float:
        """Bytes per device with ``in_flight`` microbatches' activations alive."""
        return self.static_memory + in_flight * self.activation_memory


@dataclasses.dataclass(frozen=True)
class StageProblem:
    """The inter-operator problem (module docstring). Validated on construction."""

    num_layers: int
    mesh_shape: tuple[int, ...]
    """The cluster's mesh; ``(D,)`` for a flat cluster of ``D`` devices."""
    submesh_shapes: tuple[Submesh, ...]
    num_microbatches: int
    costs: StageCostTable = dataclasses.field(repr=False, compare=False)
    memory_limit: float | None = None
    """Bytes per device; ``None`` for no limit."""
    schedule: str = "1f1b"
    """The schedule's name, for the plan to carry (its counts are ``in_flight_counts``)."""
    in_flight_counts: InFlightCounts = dataclasses.field(kw_only=True, repr=False, compare=False)
    _counts: dict[int, tuple[int, ...]] = dataclasses.field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        if not isinstance(self.num_layers, int) or self.num_layers < 1:
            raise InvalidStageProblemError(f"need at least one layer, got {self.num_layers}")
        if not isinstance(self.num_microbatches, int) or self.num_microbatches < 1:
            raise InvalidStageProblemError(
                f"need at least one microbatch, got num_microbatches={self.num_microbatches}"
            )
        if self.memory_limit is not None and not self.memory_limit >= 0:
            raise InvalidStageProblemError(
                f"memory_limit must be non-negative bytes or None, got {self.memory_limit}"
            )
        mesh_shape = tuple(self.mesh_shape)
        if not mesh_shape or any(not isinstance(n, int) or n < 1 for n in mesh_shape):
            raise InvalidStageProblemError(
                f"mesh_shape must be a non-empty tuple of positive ints, got {self.mesh_shape}"
            )
        shapes = tuple(dict.fromkeys(tuple(shape) for shape in self.submesh_shapes))
        check_submesh_shapes(mesh_shape, shapes)
        object.__setattr__(self, "mesh_shape", mesh_shape)
        object.__setattr__(self, "submesh_shapes", shapes)

    @property
    def num_devices(self) -> int:
        return math.prod(self.mesh_shape)

    def stage_cost(self, start: int, stop: int, submesh: Submesh) -> StageCost | None:
        """The table's entry for layers ``[start, stop)`` on ``submesh``, checked."""
        if isinstance(self.costs, Mapping):
            cost = self.costs.get((start, stop, submesh))
        else:
            cost = self.costs(start, stop, submesh)
        if cost is None:
            return None
        if not isinstance(cost, StageCost) or not all(
            math.isfinite(v) and v >= 0
            for v in (cost.time, cost.static_memory, cost.activation_memory)
        ):
            raise InvalidStageProblemError(
                f"the cost of layers {start}..{stop - 1} on submesh {submesh} must be a StageCost "
                f"with finite, non-negative time and memory (None when infeasible), got {cost!r}"
            )
        return cost

    def stage_counts(self, num_stages: int) -> tuple[int, ...]:
        """What each of ``num_stages`` stages keeps in flight: ``in_flight_counts``', checked."""
        counts = self._counts.get(num_stages)
        if counts is None:
            counts = tuple(self.in_flight_counts(num_stages))
            if len(counts) != num_stages or not all(isinstance(c, int) and c >= 0 for c in counts):
                message = f"one non-negative count per stage, got {counts!r}"
                raise InvalidStageProblemError(
                    f"in_flight_counts({num_stages}) must give {message}"
                )
            self._counts[num_stages] = counts
        return counts

    def counts_follow_stages_behind(self) -> bool:
        """Whether a stage's count depends only on the stages after it, for every ``K``."""
        most = min(self.num_layers, self.num_devices)
        longest = self.stage_counts(most)
        return all(self.stage_counts(count) == longest[most - count :] for count in range(1, most))


@dataclasses.dataclass(frozen=True)
class Stage:
    start: int
    """The first layer."""
    stop: int
    """One past the last layer."""
    submesh: Submesh
    time: float
    """Seconds per microbatch."""
    memory: float
    """Bytes per device, with ``in_flight`` microbatches' activations."""
    in_flight: int
    per_step: float = 0.0  # its cost's

    @property
    def devices(self) -> int:
        return math.prod(self.submesh)


@dataclasses.dataclass(frozen=True)
class StagePlan:
    stages: tuple[Stage, ...]
    objective: float
    """Pipeline step time: ``sum(t) + (M - 1) * max(t)``."""
    t_max: float
    """The slowest stage's time."""
    num_microbatches: int
    schedule: str

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def boundaries(self) -> tuple[int, ...]:
        """The first layer of every stage but the first (what :func:`evaluate_stages` takes)."""
        return tuple(stage.start for stage in self.stages[1:])

    @property
    def submeshes(self) -> tuple[Submesh, ...]:
        return tuple(stage.submesh for stage in self.stages)

    @property
    def peak_memory(self) -> float:
        return max(stage.memory for stage in self.stages)


def per_step_overcount(
    times: Sequence[float], per_step: Sequence[float], microbatches: int
) -> float:
    """What ``sum t + (M - 1) max t`` counts of the stages' once-a-step seconds ``per_step``
    (each stage's ``times`` hold ``1/M`` of its own) beyond the most any stage spends, which
    is what a step pays after the stages' last backwards: every stage's ``1/M`` and the
    slowest stage's ``(M - 1)/M`` more. Negative where another stage spends the most."""
    slowest = max(range(len(times)), key=times.__getitem__)
    counted = math.fsum(per_step) / microbatches
    counted += (microbatches - 1) * per_step[slowest] / microbatches
    return counted - max(per_step)


def pipeline_step_time(stage_times: Sequence[float], num_microbatches: int) -> float:
    """``sum(t) + (M - 1) * max(t)``: the first microbatch goes through every stage, the other
    ``M - 1`` follow at the pace of the slowest one."""
    if not stage_times:
        raise InvalidStageProblemError("a pipeline needs at least one stage")
    return sum(stage_times) + (num_microbatches - 1) * max(stage_times)


def check_submesh_shapes(mesh_shape: tuple[int, ...], shapes: Sequence[Submesh]) -> None:
    """Raise :class:`InvalidStageProblemError` unless every multiset of ``shapes`` with as many
    devices as the mesh tiles it (module docstring), and some such multiset exists."""
    if not shapes:
        raise InvalidStageProblemError("need at least one submesh shape")
    if len(mesh_shape) > 2:
        raise InvalidStageProblemError(
            f"stage construction supports 1-D and 2-D meshes, got {mesh_shape}; view the cluster "
            f"as (hosts, devices per host)"
        )
    for shape in shapes:
        if len(shape) != len(mesh_shape) or any(not isinstance(n, int) or n < 1 for n in shape):
            raise InvalidStageProblemError(
                f"submesh shape {shape} must have one positive size per axis of mesh {mesh_shape}"
            )
        if len(mesh_shape) == 1 and shape[0] > mesh_shape[0]:
            raise InvalidStageProblemError(f"submesh {shape} is larger than mesh {mesh_shape}")
    if len(mesh_shape) == 2:
        _check_row_pieces(mesh_shape, shapes)
    total = math.prod(mesh_shape)
    reachable = [True] + [False] * total
    for count in range(1, total + 1):
        reachable[count] = any(
            math.prod(shape) <= count and reachable[count - math.prod(shape)] for shape in shapes
        )
    if not reachable[total]:
        raise InvalidStageProblemError(
            f"no combination of submeshes {list(shapes)} uses exactly the {total} devices of mesh "
            f"{mesh_shape}; add a smaller shape such as {(1,) * len(mesh_shape)}"
        )


def _check_row_pieces(mesh_shape: tuple[int, ...], shapes: Sequence[Submesh]) -> None:
    rows, columns = mesh_shape
    widths = {columns}
    for height, width in shapes:
        if width == columns and height <= rows:
            continue
        if height == 1 and columns % width == 0:
            widths.add(width)
            continue
        raise InvalidStageProblemError(
            f"submesh {(height, width)} cannot be used on mesh {mesh_shape}: allowed are whole "
            f"rows (r, {columns}) with r <= {rows} and single-row pieces (1, w) with w dividing "
            f"{columns}, so that any mix of them tiles the mesh"
        )
    ordered = sorted(widths)
    for narrow, wide in itertools.pairwise(ordered):
        if wide % narrow:
            raise InvalidStageProblemError(
                f"single-row submesh widths {ordered[:-1]} on mesh {mesh_shape} must divide one "
                f"another (and {columns}) so that any mix of them tiles a row; {narrow} does not "
                f"divide {wide} (use powers of two, say)"
            )


def place_submeshes(
    mesh_shape: tuple[int, ...], submeshes: Sequence[Submesh]
) -> tuple[Coordinate, ...]:
    """The origin (lowest coordinate) of each submesh in a tiling of the mesh, in input order."""
    submeshes = [tuple(shape) for shape in submeshes]
    check_submesh_shapes(mesh_shape, list(dict.fromkeys(submeshes)))
    if sum(math.prod(shape) for shape in submeshes) != math.prod(mesh_shape):
        raise InvalidStageProblemError(
            f"submeshes {list(submeshes)} do not use exactly the devices of mesh {mesh_shape}"
        )
    origins: dict[int, Coordinate] = {}
    if len(mesh_shape) == 1:
        offset = 0
        for index, (size,) in enumerate(submeshes):
            origins[index] = (offset,)
            offset += size
        return tuple(origins[i] for i in range(len(submeshes)))
    columns = mesh_shape[1]
    row, column = 0, 0
    whole_rows = [i for i, shape in enumerate(submeshes) if shape[1] == columns]
    pieces = sorted(
        (i for i, shape in enumerate(submeshes) if shape[1] != columns),
        key=lambda i: -submeshes[i][1],
    )
    for index in whole_rows:
        origins[index] = (row, 0)
        row += submeshes[index][0]
    for index in pieces:
        origins[index] = (row, column)
        column += submeshes[index][1]
        if column == columns:
            row, column = row + 1, 0
    return tuple(origins[i] for i in range(len(submeshes)))


def evaluate_stages(
    problem: StageProblem, boundaries: Sequence[int], submeshes: Sequence[Submesh]
) -> StagePlan:
    """Score a plan chosen by hand: stages start at layer 0 and at each of ``boundaries``, stage
    ``k`` runs on ``submeshes[k]``. Raises like the solver does when the plan is infeasible."""
    points = (0, *boundaries, problem.num_layers)
    shapes = [tuple(shape) for shape in submeshes]
    if not all(isinstance(p, int) for p in boundaries) or any(
        a >= b for a, b in itertools.pairwise(points)
    ):
        raise InvalidStageProblemError(
            f"stage boundaries {list(boundaries)} must be increasing layer indices strictly "
            f"between 0 and {problem.num_layers}"
        )
    if len(shapes) != len(points) - 1:
        raise InvalidStageProblemError(
            f"{len(points) - 1} stages need {len(points) - 1} submeshes, got {len(shapes)}"
        )
    unknown = [shape for shape in shapes if shape not in problem.submesh_shapes]
    if unknown:
        raise InvalidStageProblemError(
            f"submeshes {unknown} are not among the problem's shapes {list(problem.submesh_shapes)}"
        )
    used = sum(math.prod(shape) for shape in shapes)
    if used != problem.num_devices:
        raise InvalidStageProblemError(
            f"the stages' submeshes use {used} devices; they must use exactly the "
            f"{problem.num_devices} of mesh {problem.mesh_shape}"
        )
    stages = []
    for index, ((start, stop), shape) in enumerate(
        zip(itertools.pairwise(points), shapes, strict=True)
    ):
        cost = problem.stage_cost(start, stop, shape)
        if cost is None:
            raise NoStagePlanError(
                f"the cost table marks layers {start}..{stop - 1} on submesh {shape} infeasible"
            )
        in_flight = problem.stage_counts(len(shapes))[index]
        memory = cost.memory(in_flight)
        stages.append(Stage(start, stop, shape, cost.time, memory, in_flight, cost.per_step))
    plan = _plan(problem, stages)
    limit = problem.memory_limit
    if limit is not None and plan.peak_memory > limit:
        raise StageMemoryError(
            f"the stage plan needs {format_bytes(plan.peak_memory)} per device "
            f"({_describe_hungriest(plan)}) but the limit is {format_bytes(limit)}. "
            + _MEMORY_ADVICE,
            least_memory=plan.peak_memory,
            memory_limit=limit,
        )
    return plan


_MEMORY_ADVICE = (
    "Use more devices or larger submeshes, the 1F1B schedule (fewer microbatches in flight), "
    "fewer microbatches, or rematerialization (recompute activations in the backward)."
)


def _plan(problem: StageProblem, stages: list[Stage]) -> StagePlan:
    times = [stage.time for stage in stages]
    return StagePlan(
        stages=tuple(stages),
        objective=pipeline_step_time(times, problem.num_microbatches),
        t_max=max(times),
        num_microbatches=problem.num_microbatches,
        schedule=problem.schedule,
    )


def _describe_hungriest(plan: StagePlan) -> str:
    stage = max(plan.stages, key=lambda s: s.memory)
    return (
        f"layers {stage.start}..{stage.stop - 1} on submesh {stage.submesh} with "
        f"{stage.in_flight} microbatches in flight"
    )


class _Entry(NamedTuple):
    stop: int
    submesh: Submesh
    devices: int
    cost: StageCost


@dataclasses.dataclass(frozen=True)
class _StageCounting:
    """How the DP counts the stages behind the one it places (module docstring)."""

    top: int
    """The largest count kept."""
    saturating: bool
    """Whether ``top`` stands for ``top`` stages or more (free ``K``) or exactly ``top``."""
    in_flight: tuple[int, ...]
    """Microbatches in flight on a stage with ``n - 1`` stages behind it, indexed by ``n``."""

    def predecessors(self, count: int) -> tuple[int, ...]:
        """The counts of the suffix that a stage with count ``count`` is placed in front of."""
        if self.saturating and count == self.top:
            return (count - 1, count)
        return (count - 1,)

    def final_counts(self) -> range:
        """The counts a whole plan may end with."""
        return range(1, self.top + 1) if self.saturating else range(self.top, self.top + 1)


def solve_stages(problem: StageProblem, stages: StageCount = "auto") -> StagePlan:
    """The plan of least pipeline step time (module docstring), with ``stages`` stages or any
    number. Raises :class:`StageMemoryError` when plans exist but none fits in memory and
    :class:`NoStagePlanError` when none exists at all."""
    if stages == "auto" and not problem.counts_follow_stages_behind():
        # Its microbatches in flight depend on the plan's own K (module docstring).
        return min(solve_each_stage_count(problem), key=lambda plan: plan.objective)
    counting = _stage_counting(problem, stages)
    entries = _entries(problem)
    # Scoring the chosen plan (and the most frugal one, on failure) reads the entries again.
    problem = dataclasses.replace(problem, costs=_entry_mapping(entries))
    limit = math.inf if problem.memory_limit is None else problem.memory_limit
    least_in_flight = min(counting.in_flight[1:])
    bounds = sorted(
        {e.cost.time for row in entries for e in row if e.cost.memory(least_in_flight) <= limit}
    )
    found = _best_bound(problem, entries, counting, bounds, limit) if bounds else None
    if found is None:
        raise _no_plan_error(problem, entries, counting, stages)
    tables, column, time_bound = found
    boundaries, submeshes = _backtrack(
        problem, entries, counting, tables, column, time_bound, limit
    )
    return evaluate_stages(problem, boundaries, submeshes)


def solve_each_stage_count(problem: StageProblem) -> tuple[StagePlan, ...]:
    """The plan of least step time of every stage count that has one, fewest stages first:
    for a caller that ranks them by another measure than the objective (a zero-bubble
    schedule's step), and for :func:`solve_stages` with ``K`` free where the counts in flight
    depend on ``K`` (ZB-H1's). Raises like :func:`solve_stages` when no count has a plan; a
    :class:`StageMemoryError` then names the most frugal plan of any count."""
    entries = _entries(problem)
    problem = dataclasses.replace(problem, costs=_entry_mapping(entries))
    plans: list[StagePlan] = []
    memory_errors: list[StageMemoryError] = []
    for count in range(1, min(problem.num_layers, problem.num_devices) + 1):
        try:
            plans.append(solve_stages(problem, count))
        except StageMemoryError as error:
            memory_errors.append(error)
        except NoStagePlanError:
            continue
    if plans:
        return tuple(plans)
    if memory_errors:
        frugal = min(memory_errors, key=lambda error: error.least_memory)
        raise StageMemoryError(
            f"no stage count gives a plan that fits; the most frugal: {frugal}",
            least_memory=frugal.least_memory,
            memory_limit=frugal.memory_limit,
        )
    raise NoStagePlanError(
        f"no stage plan covers layers 0..{problem.num_layers - 1} in any number of stages with "
        f"submeshes {list(problem.submesh_shapes)} using exactly the {problem.num_devices} "
        f"devices of mesh {problem.mesh_shape}, among the {sum(map(len, entries))} (layer range, "
        "submesh) pairs the cost table allows; allow more pairs or shapes"
    )


def _stage_counting(problem: StageProblem, stages: StageCount) -> _StageCounting:
    most = min(problem.num_layers, problem.num_devices)
    if stages == "auto":
        # f(n) is stage most - n's of the longest plan; it saturates where it stops changing.
        counts = problem.stage_counts(most)
        top = most
        while top > 1 and counts[most - top + 1] == counts[most - top]:
            top -= 1
        saturating = True
    elif isinstance(stages, int) and not isinstance(stages, bool) and 1 <= stages <= most:
        top, saturating, counts = stages, False, problem.stage_counts(stages)
    else:
        raise InvalidStageProblemError(
            f"stages must be 'auto' or a number of stages from 1 to {most} (at most one per "
            f"layer and per device: {problem.num_layers} layers, {problem.num_devices} devices), "
            f"got {stages!r}"
        )
    # By n: a stage with n - 1 stages behind it is stage len(counts) - n (n = 0 places none).
    in_flight = (0, *(counts[len(counts) - count] for count in range(1, top + 1)))
    return _StageCounting(top=top, saturating=saturating, in_flight=in_flight)


def _entries(problem: StageProblem) -> list[list[_Entry]]:
    """The feasible table entries by first layer, each asked of the table once."""
    entries: list[list[_Entry]] = [[] for _ in range(problem.num_layers)]
    for start in range(problem.num_layers):
        for stop in range(start + 1, problem.num_layers + 1):
            for shape in problem.submesh_shapes:
                cost = problem.stage_cost(start, stop, shape)
                if cost is not None:
                    entries[start].append(_Entry(stop, shape, math.prod(shape), cost))
    return entries


def _entry_mapping(entries: list[list[_Entry]]) -> dict[tuple[int, int, Submesh], StageCost]:
    return {
        (start, entry.stop, entry.submesh): entry.cost
        for start, row in enumerate(entries)
        for entry in row
    }


def _best_bound(
    problem: StageProblem,
    entries: list[list[_Entry]],
    counting: _StageCounting,
    bounds: list[float],
    memory_limit: float,
) -> tuple[_Table, int, float] | None:
    """Try the ``t_max`` in ``bounds`` (sorted, distinct) that could still win, a batch at a time;
    the tables of the winning batch, the winner's column in them and its bound, or None when no
    bound admits a plan.

    The least sum ``G(t)`` can only fall as the bound ``t`` grows, so once ``G`` is known at some
    bound ``u >= t``, ``G(u) + (M - 1) * t`` is a lower bound on the value of ``t``; a bound whose
    lower bound is no better than the best value found is never tried. The first batch samples
    the bounds evenly, the largest one included (so every bound has a lower bound), and later
    batches take the untried bounds of least lower bound first.
    """
    slowdown = problem.num_microbatches - 1
    batch_size = max(2, _CELL_BUDGET // _cells_per_bound(problem, counting))
    all_bounds = np.asarray(bounds)
    untried = np.ones(len(bounds), dtype=bool)
    tried_bounds = np.empty(0)
    tried_sums = np.empty(0)
    best: tuple[float, _Table, int, float] | None = None
    batch = np.unique(np.linspace(0, len(bounds) - 1, min(len(bounds), batch_size)).round())
    batch = batch.astype(np.intp)
    while batch.size:
        time_bounds = all_bounds[batch]
        memory_bounds = np.full(batch.size, memory_limit)
        tables = _suffix_tables(problem, entries, counting, time_bounds, memory_bounds)
        sums = _plan_sums(problem, counting, tables)
        values = sums + slowdown * time_bounds
        column = int(np.argmin(values))
        if math.isfinite(values[column]) and (best is None or values[column] < best[0]):
            best = (float(values[column]), tables, column, float(time_bounds[column]))
        untried[batch] = False
        order = np.argsort(np.concatenate((tried_bounds, time_bounds)))
        tried_bounds = np.concatenate((tried_bounds, time_bounds))[order]
        tried_sums = np.concatenate((tried_sums, sums))[order]
        candidates = np.flatnonzero(untried)
        next_tried = np.searchsorted(tried_bounds, all_bounds[candidates])
        lower = tried_sums[next_tried] + slowdown * all_bounds[candidates]
        promising = lower < (math.inf if best is None else best[0])
        candidates, lower = candidates[promising], lower[promising]
        batch = np.sort(candidates[np.argsort(lower, kind="stable")[:batch_size]])
    return None if best is None else best[1:]


def _cells_per_bound(problem: StageProblem, counting: _StageCounting) -> int:
    """Float64 cells the DP tables hold per bound in a batch."""
    return (problem.num_layers + 1) * (counting.top + 1) * (problem.num_devices + 1)


def _batches(values: list[float], size: int) -> Iterator[list[float]]:
    for start in range(0, len(values), size):
        yield values[start : start + size]


def _suffix_tables(
    problem: StageProblem,
    entries: list[list[_Entry]],
    counting: _StageCounting,
    time_bounds: _Floats,
    memory_bounds: _Floats,
) -> _Table:
    """``G(l, d, n)`` of the module docstring for a batch of ``(t_max, memory limit)`` pairs:
    ``tables[l][n][b, d]`` for pair ``b``."""
    width = problem.num_devices + 1
    unreachable = np.full((len(time_bounds), width), math.inf)
    tables: _Table = [[unreachable] * (counting.top + 1) for _ in range(problem.num_layers + 1)]
    done = unreachable.copy()
    done[:, 0] = 0.0
    tables[problem.num_layers][0] = done
    for start in reversed(range(problem.num_layers)):
        # A stage count above the layers left, or a suffix that is empty exactly when it has
        # stages (or the reverse), is unreachable; skipping those is only a shortcut.
        for count in range(1, min(counting.top, problem.num_layers - start) + 1):
            best = unreachable.copy()
            for entry in entries[start]:
                memory = entry.cost.memory(counting.in_flight[count])
                allowed = (entry.cost.time <= time_bounds) & (memory <= memory_bounds)
                if not allowed.any():
                    continue
                layers_left = problem.num_layers - entry.stop
                for behind in counting.predecessors(count):
                    if behind > layers_left or (behind == 0) != (layers_left == 0):
                        continue
                    candidate = unreachable.copy()
                    rest = tables[entry.stop][behind][allowed, : width - entry.devices]
                    candidate[allowed, entry.devices :] = entry.cost.time + rest
                    np.minimum(best, candidate, out=best)
            tables[start][count] = best
    return tables


def _plan_sums(problem: StageProblem, counting: _StageCounting, tables: _Table) -> _Floats:
    """The least sum of stage times of a whole plan, per bound of the batch."""
    final = [tables[0][count][:, problem.num_devices] for count in counting.final_counts()]
    return np.min(np.stack(final), axis=0)


def _backtrack(
    problem: StageProblem,
    entries: list[list[_Entry]],
    counting: _StageCounting,
    tables: _Table,
    column: int,
    time_bound: float,
    memory_limit: float,
) -> tuple[list[int], list[Submesh]]:
    """The stages of a plan achieving ``tables[0][.][column, D]``: at each step, an entry whose
    cost plus the rest's value reproduces the table value exactly (same float operations)."""
    devices = problem.num_devices
    total = min(tables[0][count][column, devices] for count in counting.final_counts())
    count = next(c for c in counting.final_counts() if tables[0][c][column, devices] == total)
    start, starts, submeshes = 0, [], []
    while start < problem.num_layers:
        target = tables[start][count][column, devices]
        step = next(
            (entry, behind)
            for entry in entries[start]
            if entry.cost.time <= time_bound
            and entry.cost.memory(counting.in_flight[count]) <= memory_limit
            and entry.devices <= devices
            for behind in counting.predecessors(count)
            if entry.cost.time + tables[entry.stop][behind][column, devices - entry.devices]
            == target
        )
        entry, count = step
        starts.append(start)
        submeshes.append(entry.submesh)
        start, devices = entry.stop, devices - entry.devices
    return starts[1:], submeshes


def _no_plan_error(
    problem: StageProblem,
    entries: list[list[_Entry]],
    counting: _StageCounting,
    stages: StageCount,
) -> NoStagePlanError:
    """Why nothing fits: no plan at all, or (a :class:`StageMemoryError`) how much memory the
    most frugal plan needs: the least per-device limit under which the DP finds a plan."""
    how_many = "" if stages == "auto" else f" in {stages} stages"
    unlimited = np.array([math.inf])
    tables = _suffix_tables(problem, entries, counting, unlimited, unlimited)
    if not math.isfinite(_plan_sums(problem, counting, tables)[0]):
        return NoStagePlanError(
            f"no stage plan covers layers 0..{problem.num_layers - 1}{how_many} with submeshes "
            f"{list(problem.submesh_shapes)} using exactly the {problem.num_devices} devices of "
            f"mesh {problem.mesh_shape}, among the {sum(map(len, entries))} (layer range, submesh) "
            f"pairs the cost table allows; allow more pairs or shapes, or another stage count"
        )
    assert problem.memory_limit is not None
    needs = sorted(
        {e.cost.memory(f) for row in entries for e in row for f in counting.in_flight[1:]}
    )
    batch_size = max(1, _CELL_BUDGET // _cells_per_bound(problem, counting))
    for batch in _batches(needs, batch_size):
        memory_bounds = np.asarray(batch)
        tables = _suffix_tables(
            problem, entries, counting, np.full(len(batch), math.inf), memory_bounds
        )
        fits = np.flatnonzero(np.isfinite(_plan_sums(problem, counting, tables)))
        if fits.size:
            least = batch[int(fits[0])]
            starts, submeshes = _backtrack(
                problem, entries, counting, tables, int(fits[0]), math.inf, least
            )
            frugal = evaluate_stages(
                dataclasses.replace(problem, memory_limit=None), starts, submeshes
            )
            return StageMemoryError(
                f"no stage plan{how_many} fits in {format_bytes(problem.memory_limit)} per "
                f"device: the most frugal plan needs {format_bytes(least)} ({least:.0f} bytes), "
                f"for {_describe_hungriest(frugal)}. " + _MEMORY_ADVICE,
                least_memory=least,
                memory_limit=problem.memory_limit,
            )
    raise AssertionError("a plan exists under no memory limit but under no finite limit either")


def brute_force_stages(problem: StageProblem, stages: StageCount = "auto") -> StagePlan:
    """The reference: every stage count, every cut of the layers into that many stages and every
    assignment of shapes, scored from scratch. Among equal step times the first found wins."""
    counts = (
        range(1, min(problem.num_layers, problem.num_devices) + 1)
        if stages == "auto"
        else [_stage_counting(problem, stages).top]
    )
    best: tuple[float, tuple[int, ...], tuple[Submesh, ...]] | None = None
    least_memory = math.inf
    limit = math.inf if problem.memory_limit is None else problem.memory_limit
    for num_stages in counts:
        for cut in itertools.combinations(range(1, problem.num_layers), num_stages - 1):
            points = (0, *cut, problem.num_layers)
            for shapes in itertools.product(problem.submesh_shapes, repeat=num_stages):
                if sum(math.prod(shape) for shape in shapes) != problem.num_devices:
                    continue
                costs = [
                    problem.stage_cost(a, b, shape)
                    for (a, b), shape in zip(itertools.pairwise(points), shapes, strict=True)
                ]
                if any(cost is None for cost in costs):
                    continue
                peak = max(
                    cost.memory(problem.stage_counts(num_stages)[k])
                    for k, cost in enumerate(costs)
                    if cost is not None
                )
                least_memory = min(least_memory, peak)
                if peak > limit:
                    continue
                step = pipeline_step_time(
                    [cost.time for cost in costs if cost is not None], problem.num_microbatches
                )
                if best is None or step < best[0]:
                    best = (step, cut, shapes)
    if best is None and math.isfinite(least_memory):
        raise StageMemoryError(
            f"no stage plan fits: the most frugal needs {format_bytes(least_memory)}",
            least_memory=least_memory,
            memory_limit=limit,
        )
    if best is None:
        raise NoStagePlanError("no stage plan covers the layers with exactly the mesh's devices")
    return evaluate_stages(problem, best[1], best[2])
