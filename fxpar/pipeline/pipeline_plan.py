"""A chosen pipeline as plain data: :class:`PipelinePlan`, saved as JSON and read back.

A :class:`~fxpar.pipeline.Pipeline` is what a user asks for (some of it left open); a
:class:`PipelinePlan` is the answer, with nothing left open: where every stage (or model chunk)
begins, the schedule, the micro-batches, remat, how many chunks a stage runs, whether each stage
is a mesh running an intra-op plan (``"meshes"``) or data-parallel replicas (``"replicas"``),
the ranks and mesh of every stage, the intra-op :class:`~fxpar.planning.plan.Plan` of every stage
mesh shape, and the cost model's estimate of a step when the cost model chose it.
``fxpar.compile(..., plan=pipeline_plan)`` (or ``plan="p.json"``) runs exactly it.

The file (format ``fxpar-pipeline-plan``, version 1)::

    {
      "format": "fxpar-pipeline-plan", "version": 1,
      "world_size": 4,
      "split_points": ["blocks.1"],
      "schedule": "1f1b", "microbatches": 8, "remat": false, "virtual_stages": 1,
      "stage_mode": "meshes",
      "stages": [{"ranks": [0, 1], "mesh": [2]}, {"ranks": [2, 3], "mesh": [2]}],
      "plans": [{"mesh": [2], "plan": {"format": "fxpar-plan", "version": 1, ...}}],
      "estimate": 0.0021
    }

``plans`` holds one plan file (:mod:`fxpar.planning.plan_file`) per distinct stage mesh shape:
the plan of one micro-batch's step on that mesh, of which each stage runs its share; it is empty
for replicas. ``report`` (written for reading) is ignored on loading. Every other field is
checked when the file is read (:meth:`PipelinePlan.load`), and again against the model and
cluster when it runs: a field that is missing, of the wrong type or out of range, ranks that are
not the ones the runtime gives each stage, a plan for a mesh no stage has, a split point that is
not a module of the model, or a plan whose strategies the model's step cannot take raise
:class:`PipelinePlanError` naming the field.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from fxpar.cluster import Cluster
from fxpar.pipeline.meshes import stage_meshes
from fxpar.pipeline.options import Pipeline, PipelineError
from fxpar.pipeline.schedules import default_schedules
from fxpar.pipeline.stage_choice import StageChoice, format_seconds
from fxpar.planning.plan import Plan
from fxpar.planning.plan_file import FORMAT as PLAN_FORMAT
from fxpar.planning.plan_file import VERSION as PLAN_VERSION
from fxpar.planning.plan_file import plan_document
from fxpar.solvers.errors import format_bytes

FORMAT = "fxpar-pipeline-plan"
VERSION = 1

StageMode = Literal["meshes", "replicas"]
STAGE_MODES: tuple[StageMode, ...] = ("meshes", "replicas")
"""How a stage's devices share its work: an intra-op plan on the stage's mesh, or each a whole
copy of the stage on its own rows of every micro-batch."""

Shape = tuple[int, ...]

_FIELDS = (
    "format", "version", "world_size", "split_points", "schedule", "microbatches", "remat",
    "virtual_stages", "stage_mode", "stages", "plans", "estimate",
)  # fmt: skip


class PipelinePlanError(PipelineError):
    """A pipeline plan (a file, or one built by hand) that cannot run: the message names the
    field at fault and what to change."""


@dataclass(frozen=True)
class SavedPlan:
    """A stage mesh's intra-op plan as a plan file holds it (:mod:`fxpar.planning.plan_file`),
    read from a pipeline plan file: applied to the step at one micro-batch's shapes, without
    solving, when the pipeline is built."""

    document: Mapping[str, Any] = field(compare=False)

    @property
    def mesh_shape(self) -> Shape:
        return tuple(self.document["cluster"]["mesh_shape"])


@dataclass(frozen=True)
class PipelineStage:
    """One stage: the ranks it runs on, in the order of its mesh, and the mesh (``(d,)`` for
    ``d`` data-parallel replicas)."""

    ranks: tuple[int, ...]
    mesh: Shape


@dataclass(frozen=True)
class PipelinePlan:
    """A pipeline with nothing left to choose (module docstring).

    Attributes:
        split_points: the module names where stages (with ``virtual_stages > 1``, model
            chunks) ``1 ..`` begin, in the order the model runs them.
        schedule, microbatches, remat, virtual_stages: as :class:`~fxpar.pipeline.Pipeline`
            names them.
        stage_mode: ``"meshes"``: every stage runs an intra-op plan on its mesh;
            ``"replicas"``: every stage's devices are data-parallel replicas of it.
        stages: each stage's ranks and mesh.
        plans: the intra-op plan of each stage mesh shape (``"meshes"``; empty for replicas):
            a :class:`~fxpar.planning.plan.Plan` when chosen in this process, a
            :class:`SavedPlan` when read from a file.
        estimate: the cost model's estimate of a step in seconds, when it chose the pipeline.
    """

    split_points: tuple[str, ...]
    schedule: str
    microbatches: int
    remat: bool
    virtual_stages: int
    stage_mode: StageMode
    stages: tuple[PipelineStage, ...]
    plans: Mapping[Shape, Plan | SavedPlan] = field(default_factory=dict, compare=False)
    estimate: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "split_points", tuple(self.split_points))
        object.__setattr__(self, "stages", tuple(self.stages))
        object.__setattr__(self, "plans", dict(self.plans))
        self._check()

    # -- what runs ------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return sum(len(stage.ranks) for stage in self.stages)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def mesh_shapes(self) -> tuple[Shape, ...]:
        """The distinct stage mesh shapes, in stage order."""
        return tuple(dict.fromkeys(stage.mesh for stage in self.stages))

    def plan_of(self, stage: int) -> Plan | SavedPlan | None:
        """The intra-op plan stage ``stage`` runs its share of; None for replicas."""
        if self.stage_mode == "replicas":
            return None
        return self.plans[self.stages[stage].mesh]

    @property
    def pipeline(self) -> Pipeline:
        """The :class:`~fxpar.pipeline.Pipeline` the runtime runs (every choice made)."""
        meshes = self.mesh_shapes
        replicas = self.stage_mode == "replicas"
        return Pipeline(
            stages=self.split_points,
            microbatches=self.microbatches,
            schedule=self.schedule,
            remat=self.remat,
            data_parallel=meshes[0][0] if replicas else 1,
            virtual_stages=self.virtual_stages,
            stage_meshes=None if replicas or len(meshes) == 1 else self.stages_meshes(),
            stage_mode=self.stage_mode,
        )

    def stages_meshes(self) -> tuple[Shape, ...]:
        return tuple(stage.mesh for stage in self.stages)

    # -- checks ---------------------------------------------------------------------------

    def _check(self) -> None:
        if not all(isinstance(point, str) and point for point in self.split_points):
            raise PipelinePlanError(
                f"split_points must be module names, got {list(self.split_points)!r}"
            )
        if self.schedule not in default_schedules():
            raise PipelinePlanError(
                f"schedule {self.schedule!r} is not a schedule fxpar runs: choose one of "
                f"{', '.join(default_schedules().names())}"
            )
        if not _whole(self.microbatches, 1):
            raise PipelinePlanError(
                f"microbatches must be a whole number >= 1, got {self.microbatches!r}"
            )
        if not isinstance(self.remat, bool):
            raise PipelinePlanError(f"remat must be true or false, got {self.remat!r}")
        if not _whole(self.virtual_stages, 1):
            raise PipelinePlanError(
                f"virtual_stages must be a whole number >= 1, got {self.virtual_stages!r}"
            )
        if self.stage_mode not in STAGE_MODES:
            raise PipelinePlanError(
                f"stage_mode must be 'meshes' or 'replicas', got {self.stage_mode!r}"
            )
        if not self.stages:
            raise PipelinePlanError("stages is empty: a pipeline has at least one stage")
        for index, stage in enumerate(self.stages):
            where = f"stages[{index}]"
            if not stage.mesh or not all(_whole(size, 1) for size in stage.mesh):
                raise PipelinePlanError(
                    f"{where}: mesh {list(stage.mesh)!r} is not a shape of positive sizes"
                )
            if len(stage.ranks) != math.prod(stage.mesh):
                raise PipelinePlanError(
                    f"{where}: {len(stage.ranks)} ranks {list(stage.ranks)} for a mesh "
                    f"{list(stage.mesh)} of {math.prod(stage.mesh)} devices"
                )
        ranks = sorted(rank for stage in self.stages for rank in stage.ranks)
        if ranks != list(range(len(ranks))):
            raise PipelinePlanError(
                f"the stages' ranks {[list(s.ranks) for s in self.stages]} do not take each of "
                f"ranks 0 .. {len(ranks) - 1} once"
            )
        chunks = len(self.split_points) + 1
        if chunks != self.num_stages * self.virtual_stages:
            raise PipelinePlanError(
                f"{len(self.split_points)} split_points make {chunks} model chunks, but "
                f"{self.num_stages} stages x virtual_stages={self.virtual_stages} run "
                f"{self.num_stages * self.virtual_stages}: give "
                f"{self.num_stages * self.virtual_stages - 1} split points"
            )
        self._check_mode()
        try:
            self.pipeline  # noqa: B018 - the request's own checks (schedules, chunks, meshes)
        except PipelineError as error:
            raise PipelinePlanError(f"the pipeline plan cannot run: {error}") from error

    def _check_mode(self) -> None:
        if self.stage_mode == "replicas":
            meshes = {stage.mesh for stage in self.stages}
            if len(meshes) != 1 or len(next(iter(meshes))) != 1:
                raise PipelinePlanError(
                    f"stage_mode 'replicas' gives every stage the same number of replicas, a "
                    f"mesh (d,); got meshes {[list(s.mesh) for s in self.stages]}"
                )
            if self.plans:
                raise PipelinePlanError(
                    f"stage_mode 'replicas' runs no intra-op plan, but plans are given for "
                    f"stage meshes {sorted(self.plans)}: remove them, or set stage_mode 'meshes'"
                )
            return
        shapes = set(self.mesh_shapes)
        extra = sorted(set(self.plans) - shapes)
        if extra:
            raise PipelinePlanError(
                f"plans has a plan for stage mesh {list(extra[0])}, which no stage has (the "
                f"stages' meshes are {sorted(map(list, shapes))})"
            )
        for shape in self.mesh_shapes:
            plan = self.plans.get(shape)
            if plan is None:
                raise PipelinePlanError(
                    f"no plan for stage mesh {list(shape)}: every stage mesh shape needs one "
                    "under plans (or set stage_mode 'replicas')"
                )
            found = plan.cluster.mesh_shape if isinstance(plan, Plan) else plan.mesh_shape
            if found != shape:
                raise PipelinePlanError(
                    f"the plan under stage mesh {list(shape)} was made for a mesh "
                    f"{list(found)}: plan that stage mesh again, or move the plan under its mesh"
                )

    def check_cluster(self, cluster: Cluster) -> None:
        """Refuse to run on ``cluster`` where the plan does not fit it: another number of
        devices, or stage ranks other than those the runtime gives each stage there
        (:func:`runtime_placement`)."""
        if cluster.world_size != self.world_size:
            raise PipelinePlanError(
                f"the pipeline plan's stages hold {self.world_size} ranks, but the cluster "
                f"{cluster.mesh_shape} has {cluster.world_size}: run it on "
                f"{self.world_size} processes, or choose a pipeline for this cluster"
            )
        placement = runtime_placement(self.pipeline, cluster, self.stages_meshes())
        for index, (stage, ranks) in enumerate(zip(self.stages, placement, strict=True)):
            if tuple(stage.ranks) != tuple(ranks):
                raise PipelinePlanError(
                    f"stages[{index}] runs on ranks {list(stage.ranks)}, but the runtime gives "
                    f"a stage of mesh {list(stage.mesh)} there ranks {list(ranks)}: stages take "
                    "their ranks in stage order, set them so"
                )

    # -- reading out ----------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The plan as plain data: what :meth:`save` writes."""
        return {
            "format": FORMAT,
            "version": VERSION,
            "world_size": self.world_size,
            "split_points": list(self.split_points),
            "schedule": self.schedule,
            "microbatches": self.microbatches,
            "remat": self.remat,
            "virtual_stages": self.virtual_stages,
            "stage_mode": self.stage_mode,
            "stages": [{"ranks": list(s.ranks), "mesh": list(s.mesh)} for s in self.stages],
            "plans": [
                {"mesh": list(shape), "plan": _document(self.plans[shape])}
                for shape in self.mesh_shapes
                if shape in self.plans
            ],
            "estimate": self.estimate,
            "report": self.report(),
        }

    def save(self, path: str | Path) -> Path:
        """Write the plan as JSON to ``path`` (returned); :meth:`load` reads it back."""
        target = Path(path)
        target.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return target

    @classmethod
    def load(cls, path: str | Path) -> PipelinePlan:
        """The pipeline plan saved at ``path``, every field checked (module docstring).

        Raises:
            PipelinePlanError: the file is unreadable, of another format or version, or has a
                field that is missing or invalid; the message names the file and the field.
        """
        try:
            document = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError) as error:
            raise PipelinePlanError(
                f"cannot read the pipeline plan file {path}: {error}"
            ) from error
        try:
            return cls.from_dict(document)
        except PipelinePlanError as error:
            raise PipelinePlanError(f"the pipeline plan file {path}: {error}") from error

    @classmethod
    def from_dict(cls, document: Any) -> PipelinePlan:
        """The plan of a document :meth:`to_dict` wrote (the checks of :meth:`load`)."""
        if not isinstance(document, dict) or document.get("format") != FORMAT:
            raise PipelinePlanError(
                f'not an fxpar pipeline plan (no "format": "{FORMAT}"); write one with '
                "PipelinePlan.save(path) or fxpar plan --microbatches M --save-pipeline path"
            )
        if document.get("version") != VERSION:
            raise PipelinePlanError(
                f"pipeline plan format version {document.get('version')!r}, but this fxpar "
                f"reads version {VERSION}; save the plan again with this fxpar version"
            )
        unknown = sorted(set(document) - set(_FIELDS) - {"report"})
        if unknown:
            raise PipelinePlanError(
                f"unknown field {unknown[0]!r}; the fields are {', '.join(_FIELDS)}"
            )
        missing = [name for name in _FIELDS if name not in document]
        if missing:
            raise PipelinePlanError(f"the field {missing[0]!r} is missing")
        points = document["split_points"]
        if not isinstance(points, list):
            raise PipelinePlanError(f"split_points must be a list of module names, got {points!r}")
        plan = cls(
            split_points=tuple(points),
            schedule=document["schedule"],
            microbatches=document["microbatches"],
            remat=document["remat"],
            virtual_stages=document["virtual_stages"],
            stage_mode=document["stage_mode"],
            stages=_stages(document["stages"]),
            plans=_plans(document["plans"]),
            estimate=_estimate(document["estimate"]),
        )
        world = document["world_size"]
        if not _whole(world, 1) or world != plan.world_size:
            raise PipelinePlanError(
                f"world_size is {world!r}, but the stages hold {plan.world_size} ranks"
            )
        return plan

    def report(self) -> str:
        """A text summary: the pipeline, then one row per stage, then each stage mesh's plan."""
        mode = (
            "an intra-op plan on each stage's mesh"
            if self.stage_mode == "meshes"
            else "data-parallel replicas in each stage"
        )
        chunks = f", {self.virtual_stages} chunks per stage" if self.virtual_stages > 1 else ""
        estimate = (
            f"estimated {format_seconds(self.estimate)} per step"
            if self.estimate is not None
            else "not priced (built by hand)"
        )
        lines = [
            f"pipeline plan: {self.num_stages} stage(s) on {self.world_size} device(s), "
            f"{self.microbatches} micro-batches, {self.schedule}{chunks}, remat "
            f"{'on' if self.remat else 'off'}, {mode}; {estimate}",
            f"split points: {', '.join(self.split_points) or '(none)'}",
        ]
        for index, stage in enumerate(self.stages):
            ranks = (
                f"ranks {stage.ranks[0]}-{stage.ranks[-1]}"
                if len(stage.ranks) > 1
                else (f"rank {stage.ranks[0]}")
            )
            lines.append(f"stage {index}: {ranks}, mesh {stage.mesh}")
        for shape in self.mesh_shapes:
            plan = self.plans.get(shape)
            if isinstance(plan, Plan):
                memory = plan.problem.memory(plan.solution.choice)
                lines.append(
                    f"plan on stage mesh {shape}: {plan.layout_summary()}; "
                    f"{format_bytes(memory)} per device"
                )
            elif isinstance(plan, SavedPlan):
                lines.append(f"plan on stage mesh {shape}: from a file, applied when it runs")
        return "\n".join(lines)

    # -- building -------------------------------------------------------------------------

    @classmethod
    def of(
        cls,
        pipeline: Pipeline,
        stage_mode: StageMode,
        placement: Sequence[Sequence[int]],
        meshes: Sequence[Shape],
        plans: Mapping[Shape, Plan] | None = None,
        estimate: float | None = None,
    ) -> PipelinePlan:
        """The plan of a :class:`~fxpar.pipeline.Pipeline` whose split points are named, on
        stages of ``meshes`` placed on ``placement``'s ranks."""
        if not isinstance(pipeline.stages, tuple):
            raise PipelinePlanError(
                f"a pipeline plan names its split points, got stages={pipeline.stages!r}"
            )
        return cls(
            split_points=pipeline.stages,
            schedule=pipeline.schedule,
            microbatches=pipeline.microbatches,
            remat=pipeline.remat,
            virtual_stages=pipeline.virtual_stages,
            stage_mode=stage_mode,
            stages=tuple(
                PipelineStage(tuple(ranks), tuple(mesh))
                for ranks, mesh in zip(placement, meshes, strict=True)
            ),
            plans=dict(plans or {}),
            estimate=estimate,
        )

    @classmethod
    def from_choice(cls, choice: StageChoice, cluster: Cluster) -> PipelinePlan:
        """The plan of the stage DP's ``choice`` on ``cluster``: its stages, their meshes and
        their plans (stage meshes) or replicas, and its estimate."""
        pipeline = choice.pipeline
        meshes = choice.stage_mesh_shapes
        if meshes is None:
            d = pipeline.data_parallel
            replicas = [(d,)] * pipeline.num_stages
            placement = runtime_placement(pipeline, cluster, replicas)
            return cls.of(pipeline, "replicas", placement, replicas, estimate=choice.step_time)
        return cls.of(
            pipeline, "meshes", runtime_placement(pipeline, cluster, meshes), meshes,
            plans=dict(choice.plans), estimate=choice.step_time,
        )  # fmt: skip


def runtime_placement(
    pipeline: Pipeline, cluster: Cluster, meshes: Sequence[Shape]
) -> list[tuple[int, ...]]:
    """The ranks the runtime gives each stage of ``pipeline`` on ``cluster``, stage ``s``
    on a mesh of ``meshes[s]``: the ranks after the previous stage's, or, for stages on
    meshes of different shapes on a 2-D cluster, Alpa's tiling
    (:func:`~fxpar.pipeline.meshes.stage_meshes`)."""
    if pipeline.stage_meshes is not None:
        located = stage_meshes(pipeline, cluster).placement
        assert located is not None
        return list(located)
    placement, start = [], 0
    for mesh in meshes:
        size = math.prod(mesh)
        placement.append(tuple(range(start, start + size)))
        start += size
    return placement


def _whole(value: object, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _document(plan: Plan | SavedPlan) -> Mapping[str, Any]:
    return plan_document(plan) if isinstance(plan, Plan) else plan.document


def _stages(value: Any) -> tuple[PipelineStage, ...]:
    if not isinstance(value, list):
        raise PipelinePlanError(f'stages must be a list of {{"ranks", "mesh"}}, got {value!r}')
    stages = []
    for index, entry in enumerate(value):
        where = f"stages[{index}]"
        if not isinstance(entry, dict) or set(entry) != {"ranks", "mesh"}:
            raise PipelinePlanError(
                f'{where} must be {{"ranks": [...], "mesh": [...]}}, got {entry!r}'
            )
        ranks, mesh = entry["ranks"], entry["mesh"]
        if not isinstance(ranks, list) or not all(_whole(r, 0) for r in ranks):
            raise PipelinePlanError(f"{where}: ranks must be a list of ranks, got {ranks!r}")
        if not isinstance(mesh, list) or not mesh or not all(_whole(n, 1) for n in mesh):
            raise PipelinePlanError(
                f"{where}: mesh must be a list of positive sizes such as [2], got {mesh!r}"
            )
        stages.append(PipelineStage(tuple(ranks), tuple(mesh)))
    return tuple(stages)


def _plans(value: Any) -> dict[Shape, SavedPlan]:
    if not isinstance(value, list):
        raise PipelinePlanError(f'plans must be a list of {{"mesh", "plan"}}, got {value!r}')
    plans: dict[Shape, SavedPlan] = {}
    for index, entry in enumerate(value):
        where = f"plans[{index}]"
        if not isinstance(entry, dict) or set(entry) != {"mesh", "plan"}:
            raise PipelinePlanError(f'{where} must be {{"mesh": [...], "plan": {{...}}}}')
        mesh, document = entry["mesh"], entry["plan"]
        if not isinstance(mesh, list) or not mesh or not all(_whole(n, 1) for n in mesh):
            raise PipelinePlanError(f"{where}: mesh must be a list of positive sizes, got {mesh!r}")
        if (
            not isinstance(document, dict)
            or document.get("format") != PLAN_FORMAT
            or document.get("version") != PLAN_VERSION
        ):
            raise PipelinePlanError(
                f"{where}: plan must be a plan file's document (format {PLAN_FORMAT!r}, version "
                f"{PLAN_VERSION}), as Plan.save writes it"
            )
        cluster = document.get("cluster")
        if not isinstance(cluster, dict) or not isinstance(cluster.get("mesh_shape"), list):
            raise PipelinePlanError(f"{where}: the plan has no cluster with a mesh_shape")
        shape = tuple(mesh)
        if shape in plans:
            raise PipelinePlanError(f"{where}: a second plan for stage mesh {mesh}")
        plans[shape] = SavedPlan(document)
    return plans


def _estimate(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise PipelinePlanError(f"estimate must be null or seconds, got {value!r}")
    if value < 0:
        raise PipelinePlanError(f"estimate must be null or seconds >= 0, got {value!r}")
    return float(value)


__all__ = [
    "FORMAT",
    "STAGE_MODES",
    "VERSION",
    "PipelinePlan",
    "PipelinePlanError",
    "PipelineStage",
    "SavedPlan",
    "StageMode",
    "runtime_placement",
]
