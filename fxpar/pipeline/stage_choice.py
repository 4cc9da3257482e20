"""What the stage DP chose (:class:`StageChoice`), and what it tried, read out as a report.

:func:`fxpar.pipeline.auto.plan_stages` and :func:`~fxpar.pipeline.auto.evaluate_split` return a
:class:`StageChoice`: the split points and stage meshes of a :class:`Pipeline` that runs as is,
each stage's time and memory, the plan of each stage mesh it priced (with stage plans), and the
outcome of every data-parallel degree (:class:`DegreeOutcome`) or submesh shape
(:class:`SubmeshOutcome`) it tried.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fxpar.cluster import Cluster
from fxpar.pipeline.options import Pipeline, PipelineError
from fxpar.planning.plan import Plan
from fxpar.solvers.errors import format_bytes
from fxpar.solvers.stages import StagePlan

Shape = tuple[int, ...]


@dataclass(frozen=True)
class DegreeOutcome:
    """What one devices-per-stage count gave with every stage alike: its best step time, or
    why it was not possible."""

    data_parallel: int
    """Devices per stage (replicas, or the size of the stage mesh with ``stage_planner``)."""
    num_stages: int
    step_time: float | None
    reason: str = ""
    stage_mesh: Shape | None = None
    """The mesh every stage runs its plan on (``stage_planner``; in :class:`SubmeshSearch`,
    the problem's submesh shape), else None."""


@dataclass(frozen=True)
class SubmeshOutcome:
    """A stage mesh the stage DP could give a stage (``stage_planner``): planned, or why not."""

    shape: Shape
    """The mesh, as ``Pipeline.stage_meshes`` names it."""
    reason: str = ""
    """Why no stage runs on it (what planning the step on it raised); empty when it planned."""


@dataclass(frozen=True)
class StageChoice:
    """A pipeline chosen (or scored) on fxpar's cost model (module docstring).

    Attributes:
        pipeline: what to run: split points by module name, ``data_parallel`` devices per
            stage or ``stage_meshes`` (one mesh per stage), and the micro-batches, schedule
            and remat asked for.
        plan: the stage DP's plan over layer indices (``plan.stages[k].start`` ...).
        layers: the modules of every layer the DP saw, in forward order.
        stage_modules: the modules of every stage.
        step_time: estimated seconds per training step, ``sum t + (M - 1) max t``.
        memory: estimated bytes per device on every stage, with its micro-batches in flight.
        memory_limit: the bytes per device allowed (``cluster.memory``).
        degrees: every devices-per-stage count ``plan_stages`` considered with every stage
            alike, in increasing order, with its best step time or why it could not run
            (empty for ``evaluate_split``).
        stage_cluster: the stage mesh every stage runs its intra-op plan on (``stage_planner``
            with every stage alike); None for data-parallel replicas or stages on different
            meshes (``pipeline.stage_meshes``).
        submeshes: the stage meshes the DP chose among (``stage_planner``), each planned or
            why not.
        mixed_step_time: the best step time over every mix of ``submeshes`` (None when that
            search found no plan, ``mixed_reason`` says why; or without ``stage_planner``).
    """

    pipeline: Pipeline
    plan: StagePlan
    layers: tuple[tuple[str, ...], ...]
    stage_modules: tuple[tuple[str, ...], ...]
    step_time: float
    memory: tuple[float, ...]
    memory_limit: float
    degrees: tuple[DegreeOutcome, ...] = ()
    stage_cluster: Cluster | None = None
    submeshes: tuple[SubmeshOutcome, ...] = ()
    mixed_step_time: float | None = None
    mixed_reason: str = ""
    crossing: tuple[int, ...] = ()
    """Stages whose consecutive ranks cross a boundary of the links their mesh was priced
    with (module docstring)."""
    tied_seconds: float = 0.0
    """The part of ``step_time`` spent summing the gradients of weights two stages hold
    (:meth:`~fxpar.pipeline.stage_costs.StageCostModel.tied_seconds`), once a step."""
    plans: Mapping[Shape, Plan] = field(default_factory=dict, compare=False, repr=False)
    """The intra-op plan each stage mesh shape of the choice was priced under (its keys are
    :attr:`stage_mesh_shapes`), made on the program the choice was made for; empty for
    data-parallel replicas. With a program captured at one micro-batch's shapes
    (``microbatch=True``) these are the plans a :class:`~fxpar.pipeline.PipelineModel` runs
    when given them (``plans=``), as :func:`fxpar.compile` does."""

    @property
    def split_points(self) -> tuple[str, ...]:
        stages = self.pipeline.stages
        assert isinstance(stages, tuple)
        return stages

    @property
    def stage_devices(self) -> tuple[int, ...]:
        """The devices of every stage."""
        return tuple(stage.devices for stage in self.plan.stages)

    @property
    def devices_per_stage(self) -> int:
        """The devices of every stage, when they are alike (see :attr:`stage_devices`)."""
        if self.pipeline.stage_meshes is not None:
            raise PipelineError(
                f"the stages run on meshes {self.pipeline.stage_meshes} of different sizes: "
                "read stage_devices or stage_mesh_shapes"
            )
        if self.stage_cluster is not None:
            return self.stage_cluster.world_size
        return self.pipeline.data_parallel

    @property
    def stage_mesh_shapes(self) -> tuple[Shape, ...] | None:
        """The mesh every stage runs its intra-op plan on; None for data-parallel replicas."""
        if self.pipeline.stage_meshes is not None:
            return self.pipeline.stage_meshes
        if self.stage_cluster is not None:
            return (self.stage_cluster.mesh_shape,) * len(self.plan.stages)
        return None

    @property
    def cut_points(self) -> tuple[str, ...]:
        """Where each layer but the first begins: every split point the DP could choose."""
        return tuple(modules[0] for modules in self.layers[1:])

    def report(self) -> str:
        """A text table: one row per stage, then the stage meshes and degrees tried."""
        pipeline = self.pipeline
        meshes = self.stage_mesh_shapes
        if pipeline.stage_meshes is None:
            layout = f"{pipeline.num_stages} stage(s) x {self.devices_per_stage} device(s)"
        else:
            layout = (
                f"{pipeline.num_stages} stages on meshes "
                f"{', '.join(map(str, pipeline.stage_meshes))} ({sum(self.stage_devices)} "
                "devices)"
            )
        lines = [
            f"pipeline: {layout}, {pipeline.microbatches} micro-batches, {pipeline.schedule}, "
            f"remat {'on' if pipeline.remat else 'off'}: {format_seconds(self.step_time)} per "
            f"step (estimated), memory limit {format_bytes(self.memory_limit)} per device",
            f"split points: {', '.join(self.split_points) or '(none)'}",
        ]
        if self.tied_seconds:
            tied = format_seconds(self.tied_seconds)
            lines.append(f"of the step, {tied} summing tied weights' gradients between stages")
        if self.stage_cluster is not None:
            lines.append(f"inside each stage: an intra-op plan on {self.stage_cluster}")
        elif meshes is not None:
            lines.append("inside each stage: an intra-op plan on its own mesh (column 'mesh')")
        header = ["stage", "modules", "devices", "time/micro-batch", "memory/device", "in flight"]
        if meshes is not None:
            header.insert(3, "mesh")
        rows: list[list[str]] = []
        offset = 0
        for index, (stage, modules) in enumerate(
            zip(self.plan.stages, self.stage_modules, strict=True)
        ):
            count = stage.devices
            ranks = f"ranks {offset}-{offset + count - 1}" if count > 1 else f"rank {offset}"
            row = [str(index), _module_span(modules), f"{count} ({ranks})"]
            if meshes is not None:
                row.append(str(meshes[index]))
            row += [format_seconds(stage.time), format_bytes(stage.memory), str(stage.in_flight)]
            rows.append(row)
            offset += count
        widths = [max(len(row[c]) for row in (header, *rows)) for c in range(len(header))]
        for row in (header, *rows):
            lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)))
        if self.submeshes:
            lines.append(
                "stage meshes considered: "
                + "; ".join(
                    f"{outcome.shape}" + (f": {outcome.reason}" if outcome.reason else "")
                    for outcome in self.submeshes
                )
            )
        if self.degrees:
            tried = []
            for outcome in self.degrees:
                result = (
                    format_seconds(outcome.step_time)
                    if outcome.step_time is not None
                    else outcome.reason
                )
                stages = f"{outcome.num_stages} stage{'s' if outcome.num_stages > 1 else ''}"
                mesh = f" on {outcome.stage_mesh}" if outcome.stage_mesh is not None else ""
                tried.append(f"d={outcome.data_parallel} ({stages}{mesh}): {result}")
            lines.append("devices per stage tried: " + "; ".join(tried))
        if self.submeshes:
            mixed = (
                format_seconds(self.mixed_step_time)
                if self.mixed_step_time is not None
                else self.mixed_reason
            )
            lines.append(f"stages on any mix of meshes: {mixed}")
        if self.crossing:
            lines.append(
                f"warning: stage(s) {', '.join(map(str, self.crossing))} cross a row of the "
                "cluster on their consecutive ranks, so their links are slower than priced"
            )
        return "\n".join(line.rstrip() for line in lines)

    def to_dict(self) -> dict[str, Any]:
        """Plain data for JSON."""
        pipeline = self.pipeline
        meshes = self.stage_mesh_shapes
        return {
            "pipeline": {
                "stages": list(self.split_points),
                "microbatches": pipeline.microbatches,
                "schedule": pipeline.schedule,
                "remat": pipeline.remat,
                "data_parallel": pipeline.data_parallel,
                "stage_mesh": (list(self.stage_cluster.mesh_shape) if self.stage_cluster else None),
                "stage_meshes": (
                    [list(mesh) for mesh in pipeline.stage_meshes]
                    if pipeline.stage_meshes is not None
                    else None
                ),
            },
            "step_time": self.step_time,
            "tied_seconds": self.tied_seconds,
            "memory_limit": self.memory_limit,
            "layers": [list(modules) for modules in self.layers],
            "stages": [
                {
                    "modules": list(modules),
                    "layers": [stage.start, stage.stop],
                    "devices": stage.devices,
                    "mesh": list(meshes[index]) if meshes is not None else None,
                    "time": stage.time,
                    "memory": stage.memory,
                    "in_flight": stage.in_flight,
                }
                for index, (stage, modules) in enumerate(
                    zip(self.plan.stages, self.stage_modules, strict=True)
                )
            ],
            "degrees": [dataclasses.asdict(outcome) for outcome in self.degrees],
            "submeshes": [
                {"shape": list(outcome.shape), "reason": outcome.reason}
                for outcome in self.submeshes
            ],
            "mixed": {"step_time": self.mixed_step_time, "reason": self.mixed_reason},
            "crossing": list(self.crossing),
        }


def flatten(groups: Iterable[Sequence[str]]) -> list[str]:
    """The names of ``groups``, in order."""
    return [name for group in groups for name in group]


def _module_span(modules: Sequence[str]) -> str:
    if len(modules) <= 2:
        return ", ".join(modules)
    return f"{modules[0]} .. {modules[-1]} ({len(modules)} modules)"


def format_seconds(seconds: float) -> str:
    """``seconds`` in s, ms or us, three significant digits (the report's times)."""
    if seconds >= 1:
        return f"{seconds:.3g} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} us"


__all__ = ["DegreeOutcome", "StageChoice", "SubmeshOutcome", "flatten", "format_seconds"]
