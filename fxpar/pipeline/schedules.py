"""Pipeline schedules as objects in a registry: what each one is, and the names users give.

A :class:`Schedule` is a name, the function that builds its instruction lists (one per stage,
for ``K`` stages and ``M`` micro-batches: :mod:`fxpar.pipeline.schedule`), where its model
chunks sit (:data:`~fxpar.pipeline.schedule.Placement`), how many chunks a stage may hold,
whether it splits each backward in two (B and W, :mod:`fxpar.pipeline.backward_split`) and
whether the stage DP prices it. Everything else a pipeline needs to know about a schedule is
read from its lists, never from its name: the micro-batches each stage keeps in flight
(:meth:`Schedule.in_flight`, what the stage DP's memory counts), its bubble
(:func:`~fxpar.pipeline.schedule.modelled_bubble`), and whether it can deadlock
(:func:`~fxpar.pipeline.schedule.simulate`).

A :class:`ScheduleRegistry` holds schedules by name. It is a value: :meth:`~ScheduleRegistry.
with_schedule` returns a new registry and leaves the old one as it was, so the default one
(:func:`default_schedules`: 1F1B, GPipe, ZB-H1, interleaved 1F1B and ZB-V) is shared safely by
every :class:`~fxpar.pipeline.Pipeline` that does not name another. Its order is the order of
preference where two schedules tie: 1F1B first (it keeps the fewest micro-batches in flight).
docs/pipelines.md, "Adding a schedule", writes a schedule and runs it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fxpar.errors import PipelineError
from fxpar.pipeline.schedule import (
    Instruction,
    Placement,
    StageSchedule,
    gpipe_lists,
    interleaved_lists,
    max_in_flight,
    one_f_one_b_lists,
    zb_h1_lists,
    zb_v_lists,
)

ListBuilder = Callable[[int, int, int], Sequence[Sequence[Instruction]]]
"""``(num_stages, num_microbatches, chunks) -> lists``: one instruction list per stage, each
stage running ``chunks`` model chunks."""


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule: how to build its instruction lists, and the rules they follow.

    Attributes:
        name: what ``Pipeline(schedule=...)`` calls it.
        lists: ``lists(K, M, V)``, one list per stage of ``K`` (micro-batches ``0 .. M-1``,
            ``V`` chunks per stage); :meth:`build` checks the counts first.
        placement: ``"loop"`` (chunk ``c`` of stage ``s`` is virtual stage ``c K + s``) or
            ``"v"`` (chunk 0 is ``s``, chunk 1 is ``2K - 1 - s``).
        min_chunks, max_chunks: how many model chunks a stage may run (``virtual_stages``);
            ``max_chunks=None`` for any number from ``min_chunks`` up. A schedule with one
            fixed count above 1 gets it when a pipeline leaves ``virtual_stages`` at 1.
        splits_backward: whether the lists run each backward as B and W
            (``Op.BACKWARD_INPUT``, ``Op.BACKWARD_WEIGHT``) rather than ``Op.BACKWARD``.
        searched: whether the stage DP prices it (``stages="auto"``), and so
            ``pipeline="auto"`` and ``fxpar plan --microbatches`` search it: only for one chunk
            per stage, and where the DP's objective ``sum t + (M - 1) max t`` is its step
            (whole backwards) or, splitting the backward, its step is that objective less what
            its lists save over 1F1B's when both are replayed on the stages' times.
        microbatch_groups: whether ``M`` must be a multiple of ``K`` (micro-batches run in
            groups of one per stage).
        min_stages: the fewest stages it runs on.
        title: how messages name it (``"the <name> schedule"`` when empty).
    """

    name: str
    lists: ListBuilder
    placement: Placement = "loop"
    min_chunks: int = 1
    max_chunks: int | None = 1
    splits_backward: bool = False
    searched: bool = False
    microbatch_groups: bool = False
    min_stages: int = 1
    title: str = ""

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise PipelineError(f"a schedule needs a name, got {self.name!r}")
        if self.placement not in ("loop", "v"):
            raise PipelineError(
                f"schedule {self.name!r}: placement must be 'loop' or 'v', got {self.placement!r}"
            )
        if self.min_chunks < 1 or (
            self.max_chunks is not None and self.max_chunks < self.min_chunks
        ):
            raise PipelineError(
                f"schedule {self.name!r}: chunks per stage from {self.min_chunks} to "
                f"{self.max_chunks} is no count; give 1 <= min_chunks <= max_chunks"
            )
        if self.placement == "v" and (self.min_chunks, self.max_chunks) != (2, 2):
            raise PipelineError(f"schedule {self.name!r}: a V places exactly two chunks per stage")
        if self.searched and (self.max_chunks != 1 or self.placement != "loop"):
            raise PipelineError(
                f"schedule {self.name!r}: the stage DP prices one model chunk per stage, so a "
                "schedule of several cannot be searched=True"
            )
        if not self.title:
            object.__setattr__(self, "title", f"the {self.name} schedule")

    def accepts(self, chunks: int) -> bool:
        """Whether a stage may run ``chunks`` model chunks of this schedule."""
        return self.min_chunks <= chunks and (self.max_chunks is None or chunks <= self.max_chunks)

    @property
    def fixed_chunks(self) -> int | None:
        """The one chunk count it runs, if it runs only one."""
        return self.min_chunks if self.min_chunks == self.max_chunks else None

    def check(self, num_stages: int, num_microbatches: int, chunks: int = 1) -> None:
        """Raise :class:`PipelineError` unless the lists exist for ``num_stages`` stages,
        ``num_microbatches`` micro-batches and ``chunks`` chunks per stage."""
        if num_stages < 1 or num_microbatches < 1:
            raise PipelineError(
                f"a pipeline needs at least one stage and one micro-batch, got {num_stages} "
                f"stages and {num_microbatches} micro-batches"
            )
        if not isinstance(chunks, int) or not self.accepts(chunks):
            raise PipelineError(self.chunk_error(chunks))
        if num_stages < self.min_stages:
            raise PipelineError(f"{self.title} needs at least {self.min_stages} stages")
        if self.microbatch_groups and num_microbatches % num_stages:
            raise PipelineError(
                f"{self.title} runs micro-batches in groups of one per stage: "
                f"{num_microbatches} micro-batches are not a multiple of {num_stages} stages; "
                f"make microbatches a multiple of the {num_stages} stages"
            )

    def chunk_error(self, chunks: object) -> str:
        """Why a stage cannot run ``chunks`` model chunks of this schedule."""
        fixed = self.fixed_chunks
        if fixed == 1:
            return f"{self.title} runs one chunk per stage, not {chunks!r}"
        if fixed is not None:
            return (
                f"{self.title} runs exactly {_count(fixed)} model chunks per stage: "
                f"virtual_stages must be {fixed}, not {chunks!r}"
            )
        return (
            f"{self.title} needs virtual_stages >= {self.min_chunks} model chunks per stage"
            + ("" if self.max_chunks is None else f" and <= {self.max_chunks}")
            + f", got {chunks!r}"
        )

    def build(
        self, num_stages: int, num_microbatches: int, chunks: int = 1
    ) -> tuple[StageSchedule, ...]:
        """The instruction list of every stage, by stage.

        Raises:
            PipelineError: counts it does not run (:meth:`check`), or a builder that does not
                return one list per stage.
        """
        self.check(num_stages, num_microbatches, chunks)
        built = tuple(tuple(steps) for steps in self.lists(num_stages, num_microbatches, chunks))
        if len(built) != num_stages:
            raise PipelineError(
                f"{self.title} built {len(built)} instruction lists for {num_stages} stages: "
                "its builder must return one list per stage"
            )
        return built

    def in_flight(self, num_stages: int, num_microbatches: int, chunks: int = 1) -> tuple[int, ...]:
        """Per stage, the most micro-batches whose forward has run and whose stash is not yet
        freed, read from the lists (:func:`~fxpar.pipeline.schedule.max_in_flight`)."""
        return tuple(
            max_in_flight(steps) for steps in self.build(num_stages, num_microbatches, chunks)
        )


def _count(number: int) -> str:
    return {2: "two", 3: "three", 4: "four"}.get(number, str(number))


@dataclass(frozen=True)
class ScheduleRegistry:
    """Schedules by name, in the order of preference on a tie. A value: adding a schedule
    returns a new registry (:meth:`with_schedule`)."""

    schedules: tuple[Schedule, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "schedules", tuple(self.schedules))
        names = [schedule.name for schedule in self.schedules]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise PipelineError(f"schedules {repeated} are registered twice: give each a name")

    def with_schedule(self, schedule: Schedule) -> ScheduleRegistry:
        """This registry and ``schedule`` (last in preference); this one is left as it was.

        Raises:
            PipelineError: a schedule of that name is registered already.
        """
        if schedule.name in self:
            raise PipelineError(
                f"a schedule named {schedule.name!r} is registered already: choose another name"
            )
        return ScheduleRegistry((*self.schedules, schedule))

    def __contains__(self, name: object) -> bool:
        return any(schedule.name == name for schedule in self.schedules)

    def __getitem__(self, name: str) -> Schedule:
        for schedule in self.schedules:
            if schedule.name == name:
                return schedule
        raise PipelineError(
            f"schedule must be one of {self.names()}, got {name!r}; to run another, register "
            "it (docs/pipelines.md, 'Adding a schedule')"
        )

    def names(self) -> tuple[str, ...]:
        """Every schedule's name."""
        return tuple(schedule.name for schedule in self.schedules)

    def searched(self) -> tuple[str, ...]:
        """The schedules the stage DP prices (:attr:`Schedule.searched`)."""
        return tuple(schedule.name for schedule in self.schedules if schedule.searched)

    def accepting(self, chunks: int) -> tuple[str, ...]:
        """The schedules a stage may run ``chunks`` model chunks of."""
        return tuple(schedule.name for schedule in self.schedules if schedule.accepts(chunks))


ONE_F_ONE_B = Schedule("1f1b", one_f_one_b_lists, searched=True)
"""1F1B (PipeDream-flush); the stage DP's objective is its step."""
GPIPE = Schedule("gpipe", gpipe_lists, searched=True)
ZB_H1 = Schedule("zb-h1", zb_h1_lists, splits_backward=True, searched=True, title="ZB-H1")
INTERLEAVED = Schedule(
    "interleaved",
    interleaved_lists,
    min_chunks=2,
    max_chunks=None,
    microbatch_groups=True,
    min_stages=2,
)
ZB_V = Schedule(
    "zb-v", zb_v_lists, placement="v", min_chunks=2, max_chunks=2, splits_backward=True,
    title="ZB-V",
)  # fmt: skip

_DEFAULT = ScheduleRegistry((ONE_F_ONE_B, GPIPE, ZB_H1, INTERLEAVED, ZB_V))


def default_schedules() -> ScheduleRegistry:
    """The schedules fxpar runs: 1F1B, GPipe, ZB-H1, interleaved 1F1B and ZB-V."""
    return _DEFAULT


def build_schedule(
    name: str, num_stages: int, num_microbatches: int, virtual_stages: int = 1
) -> tuple[StageSchedule, ...]:
    """The instruction list of every stage of the default schedule ``name``, by stage
    (``virtual_stages``: chunks per stage, for ``"interleaved"``, and 2 for ``"zb-v"``). Check
    ``"zb-v"`` lists with ``simulate(lists, placement="v")``.

    Raises:
        PipelineError: an unknown schedule name, a non-positive count, an interleaved
            schedule whose micro-batches are not a multiple of its stages, or a chunk count
            the schedule does not run.
    """
    return default_schedules()[name].build(num_stages, num_microbatches, virtual_stages)
