"""What a user asks of a pipeline: :class:`Pipeline` (and, from :mod:`fxpar.errors`, the error
pipelines raise)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from fxpar.errors import PipelineError
from fxpar.pipeline.schedule import StageSchedule
from fxpar.pipeline.schedules import Schedule, ScheduleRegistry, default_schedules

__all__ = ["Pipeline", "PipelineError"]

StageModeRequest = Literal["auto", "meshes", "replicas"]
STAGE_MODE_REQUESTS: tuple[StageModeRequest, ...] = ("auto", "meshes", "replicas")
"""What :attr:`Pipeline.stage_mode` may ask for."""


@dataclass(frozen=True)
class Pipeline:
    """How to run a training step as a synchronous pipeline.

    Attributes:
        stages: the number of stages ``K`` (the model is cut evenly between its repeated
            layers, e.g. GPT's ``blocks.0``, ``blocks.1``, ...), or the split points: module
            names, in the order the model runs them, where stages ``1 .. K-1`` begin (stage 0
            starts with the model). ``("blocks.2",)`` makes two stages. ``"auto"``: let
            :func:`fxpar.compile` choose the split points and ``data_parallel`` with the stage
            DP (:func:`fxpar.pipeline.plan_stages`).
        microbatches: ``M``; the global batch is cut along dimension 0 into ``M`` equal
            micro-batches. The bubble is ``(K-1)/(M+K-1)`` of the step: choose ``M >= 4 K``.
        schedule: ``"gpipe"`` (all forwards, then all backwards: ``M`` micro-batches of
            activations in flight) or ``"1f1b"`` (one forward, one backward: at most ``K - s``
            in flight on stage ``s``), or ``"interleaved"`` (1F1B over ``virtual_stages``
            model chunks per stage: a smaller bubble for more messages), or ``"zb-h1"``
            (zero-bubble: each backward run as its input gradients, on 1F1B's path, and its
            weight gradients, deferred into the idle time; at most ``K`` micro-batches in
            flight on every stage), or ``"zb-v"`` (zero-bubble over two model chunks per
            stage in a V, ``virtual_stages=2``: a smaller bubble still, for the same
            memory). All compute the same step. Another schedule: a name in ``schedules``.
        remat: keep only the activations that cross stage boundaries and recompute the rest of
            a stage's forward inside its backward (about a third more compute, far less memory).
        data_parallel: devices per stage; each holds a copy of the stage and takes an equal
            piece of every micro-batch, and their gradients are all-reduced once per step.
        virtual_stages: ``V``, model chunks per stage, for the interleaved schedule and ZB-V:
            the model is cut into ``K * V`` chunks (split points: ``K * V - 1`` module
            names). Interleaved, stage ``s`` runs chunks ``s, s + K, ..., s + (V-1) K``, the
            bubble shrinks to about ``(K-1)/(V M + K-1)``, and ``M`` must be a multiple of
            ``K``. ZB-V runs ``V = 2`` (set for it when left at 1): stage ``s`` runs chunks
            ``s`` and ``2K - 1 - s``.
        stage_meshes: a mesh shape per stage, e.g. ``((1,), (2,))``: stage ``s`` runs on a
            mesh of its own shape, with an intra-op plan made for that mesh, and values
            crossing a stage boundary are resharded between the two stages' layouts (see
            docs/pipelines.md, "Stages on meshes of different shapes"). Stage ``s`` takes the
            ranks after those of stages ``0 .. s-1``. None: every stage has the same devices
            (``data_parallel``, or the stage mesh a cluster of mesh ``(K, *stage_mesh)``
            gives).
        schedules: the registry ``schedule`` is looked up in (:func:`fxpar.pipeline.
            default_schedules`, or one with schedules of your own: docs/pipelines.md,
            "Adding a schedule").
        stage_mode: how a stage's devices share its work. ``"meshes"``: each stage runs an
            intra-op plan on a mesh of its own (``stage_meshes``; else the stage mesh of a
            cluster of mesh ``(K, *stage_mesh)``; else ``D / K`` of the cluster's ``D``
            devices), made by the pass list :func:`fxpar.compile` is given (``solver``,
            ``manual``, ``pins``, ``options``, ``rules``, ``passes``). ``"replicas"``: each of
            a stage's ``data_parallel`` devices runs all of it on its share of every
            micro-batch (``D / K`` of them when ``data_parallel`` is left at 1 on a cluster
            of more than ``K`` devices). ``"auto"`` (the default) is decided by the request
            and the cluster alone (:func:`resolved_stage_mode`): ``"meshes"`` where
            ``stage_meshes`` is given or the cluster's mesh is ``(K, *stage_mesh)``, else
            ``"replicas"``.
    """

    stages: int | tuple[str, ...] | Literal["auto"] = 2
    microbatches: int = 4
    schedule: str = "1f1b"
    remat: bool = False
    data_parallel: int = 1
    virtual_stages: int = 1
    stage_meshes: tuple[tuple[int, ...], ...] | None = None
    schedules: ScheduleRegistry = field(default=default_schedules(), repr=False)
    stage_mode: StageModeRequest = "auto"

    def __post_init__(self) -> None:
        if self.stages == "auto":
            pass
        elif isinstance(self.stages, Sequence) and not isinstance(self.stages, str):
            object.__setattr__(self, "stages", tuple(self.stages))
            if not all(isinstance(name, str) for name in self.stages):
                raise PipelineError(f"split points must be module names, got {self.stages!r}")
        elif not isinstance(self.stages, int) or self.stages < 1:
            raise PipelineError(
                f"stages must be a positive number of stages or a tuple of module names where "
                f"stages begin, got {self.stages!r}"
            )
        if self.microbatches < 1:
            raise PipelineError(f"microbatches must be >= 1, got {self.microbatches}")
        if not isinstance(self.schedules, ScheduleRegistry):
            raise PipelineError(
                f"schedules must be a ScheduleRegistry (fxpar.pipeline.default_schedules()), "
                f"got {type(self.schedules).__name__}"
            )
        if self.data_parallel < 1:
            raise PipelineError(f"data_parallel must be >= 1, got {self.data_parallel}")
        self._check_interleaving()
        self._check_stage_meshes()
        self._check_stage_mode()

    def _check_stage_mode(self) -> None:
        mode = self.stage_mode
        if mode not in STAGE_MODE_REQUESTS:
            raise PipelineError(f"stage_mode must be one of {STAGE_MODE_REQUESTS}, got {mode!r}")
        if mode == "replicas" and self.stage_meshes is not None:
            raise PipelineError(
                f"stage_mode='replicas' runs no intra-op plan, but stage_meshes "
                f"{self.stage_meshes} asks for one on each stage's mesh: choose one"
            )
        if mode == "meshes" and self.data_parallel != 1:
            raise PipelineError(
                f"stage_mode='meshes' runs an intra-op plan on each stage's mesh, which "
                f"data_parallel={self.data_parallel} replicas do not: leave data_parallel at 1 "
                "(the plan on a stage mesh can itself be data-parallel), or ask for "
                "stage_mode='replicas'"
            )

    def _check_stage_meshes(self) -> None:
        meshes = self.stage_meshes
        if meshes is None:
            return
        try:
            meshes = tuple(tuple(mesh) for mesh in meshes)
        except TypeError:
            meshes = ()
        if not meshes or any(
            not mesh or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in mesh)
            for mesh in meshes
        ):
            raise PipelineError(
                f"stage_meshes must be one mesh shape per stage, each a non-empty tuple of "
                f"positive ints such as ((1,), (2,)), got {self.stage_meshes!r}"
            )
        object.__setattr__(self, "stage_meshes", meshes)
        if self.stages == "auto":
            raise PipelineError(
                "stages='auto' chooses the stage meshes itself: leave stage_meshes out, or give "
                "the stages"
            )
        if self.data_parallel != 1 or (self.virtual_stages != 1 and not self.v_shaped):
            raise PipelineError(
                f"stage_meshes runs one model chunk per stage on its own mesh: data_parallel="
                f"{self.data_parallel} and virtual_stages={self.virtual_stages} must be 1 (a "
                "stage's plan can itself be data-parallel over its mesh)"
            )
        if self.v_shaped and len(set(meshes)) > 1:
            raise PipelineError(
                f"ZB-V runs two model chunks per stage, which stage meshes {meshes} of "
                "different shapes do not: give every stage the same mesh, or choose 'zb-h1'"
            )
        stages = self.num_stages
        if stages != len(meshes):
            raise PipelineError(
                f"{len(meshes)} stage meshes {meshes} for {stages} stages: give one mesh per stage"
            )

    def _check_interleaving(self) -> None:
        schedule = self.named_schedule
        if self.virtual_stages == 1 and schedule.fixed_chunks is not None:
            object.__setattr__(self, "virtual_stages", schedule.fixed_chunks)
        chunks = self.virtual_stages
        if not isinstance(chunks, int) or not schedule.accepts(chunks):
            raise PipelineError(self._chunk_advice(schedule, chunks))
        if self.stages == "auto":
            if not schedule.searched:
                raise PipelineError(
                    f"stages='auto' cannot plan {schedule.title} (the stage DP prices one chunk "
                    f"per stage, for schedules {self.schedules.searched()}): give stages=K or "
                    f"{chunks} K - 1 split points"
                )
            return
        if isinstance(self.stages, tuple) and (len(self.stages) + 1) % chunks:
            raise PipelineError(
                f"{len(self.stages)} split points make {len(self.stages) + 1} chunks, which "
                f"do not divide into {chunks} per stage: give {chunks} K - 1 split points"
            )
        schedule.check(self.num_stages, self.microbatches, chunks)

    def _chunk_advice(self, schedule: Schedule, chunks: object) -> str:
        """Why ``chunks`` per stage does not run ``schedule``, and which schedules it runs."""
        others = self.schedules.accepting(chunks) if isinstance(chunks, int) else ()
        if schedule.fixed_chunks == 1 and others:
            choices = " or ".join(f"schedule={name!r}" for name in others)
            return (
                f"virtual_stages={chunks} needs {choices} (got {self.schedule!r}, which runs "
                "one model chunk per stage)"
            )
        advice = schedule.chunk_error(chunks)
        if others:
            advice += f" (for {chunks} per stage, use schedule={others[0]!r})"
        return advice

    @property
    def named_schedule(self) -> Schedule:
        """The :class:`~fxpar.pipeline.schedules.Schedule` that ``schedule`` names."""
        return self.schedules[self.schedule]

    def instruction_lists(self) -> tuple[StageSchedule, ...]:
        """Every stage's instruction list for this pipeline's stages, micro-batches and
        chunks."""
        return self.named_schedule.build(self.num_stages, self.microbatches, self.virtual_stages)

    def resolved_stage_mode(self, cluster_mesh: tuple[int, ...]) -> Literal["meshes", "replicas"]:
        """The stage mode this request runs on a cluster of mesh ``cluster_mesh``:
        :attr:`stage_mode` when it names one; for ``"auto"``, ``"meshes"`` where
        ``stage_meshes`` is given or ``cluster_mesh`` is ``(K, *stage_mesh)`` with ``K`` the
        request's stages (and ``data_parallel`` 1), else ``"replicas"``. Only the request and
        the cluster decide, never the other arguments of :func:`fxpar.compile`."""
        if self.stage_mode != "auto":
            return self.stage_mode
        if self.stage_meshes is not None:
            return "meshes"
        stages_first = (
            self.stages != "auto"
            and self.data_parallel == 1
            and len(cluster_mesh) >= 2
            and cluster_mesh[0] == self.num_stages
        )
        return "meshes" if stages_first else "replicas"

    @property
    def v_shaped(self) -> bool:
        """Whether stage ``s`` holds chunks ``s`` and ``2K - 1 - s`` (ZB-V) rather than
        ``s, s + K, ...``."""
        return self.named_schedule.placement == "v"

    @property
    def num_stages(self) -> int:
        if self.stages == "auto":
            raise PipelineError(
                "stages='auto' has no number of stages until it is planned: fxpar.compile "
                "does that, or call fxpar.pipeline.plan_stages"
            )
        if isinstance(self.stages, int):
            return self.stages
        return (len(self.stages) + 1) // self.virtual_stages

    @property
    def num_chunks(self) -> int:
        """Pieces the model is cut into: ``num_stages * virtual_stages``."""
        return self.num_stages * self.virtual_stages

    def chunks_of(self, stage: int) -> tuple[int, ...]:
        """The pieces of the split (its stages) that stage ``stage`` runs, in chunk order:
        ``stage, stage + K, ..., stage + (V-1) K``, or with ZB-V ``stage, 2K - 1 - stage``
        (:func:`fxpar.pipeline.schedule.virtual_stage`)."""
        if self.v_shaped:
            return (stage, 2 * self.num_stages - 1 - stage)
        return tuple(range(stage, self.num_chunks, self.num_stages))

    def neighbour(self, stage: int, step: int) -> int | None:
        """The stage ``step`` (1 or -1) after ``stage`` that a stage's first chunk sends
        activations (1) or gradients (-1) to; None past the ends, around which the
        messages of several looped chunks wrap (ZB-V's turn back at the last stage instead)."""
        if not self.v_shaped and self.virtual_stages > 1:
            return (stage + step) % self.num_stages
        return stage + step if 0 <= stage + step < self.num_stages else None

    def stage_of(self, chunk: int) -> int:
        """The stage that runs piece ``chunk`` of the split."""
        if self.v_shaped and chunk >= self.num_stages:
            return 2 * self.num_stages - 1 - chunk
        return chunk % self.num_stages

    @property
    def world_size(self) -> int:
        """Processes the pipeline runs on: ``num_stages * data_parallel``, or with
        ``stage_meshes`` the devices of all of them."""
        if self.stage_meshes is not None:
            return sum(math.prod(mesh) for mesh in self.stage_meshes)
        return self.num_stages * self.data_parallel
