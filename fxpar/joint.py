"""Alpa's whole choice: one intra-op plan of the whole batch, or a pipeline of planned stages.

``fxpar.compile(..., pipeline="auto")`` leaves the question of whether to pipeline at all to
the cost model. It plans the whole batch on the cluster's mesh (the intra-op plan a compile
without ``pipeline`` runs, priced by its schedule: ``plan.estimate``) and, for every count of
:data:`AUTO_MICROBATCHES` the batch divides into, lets the stage DP choose stages, stage meshes
and each mesh's intra-op plan under every schedule and remat setting
(:func:`fxpar.pipeline.search_pipelines` on the step captured at one micro-batch's shapes,
with ``stage_planner``). The faster estimate runs; on a tie the plan alone does (it keeps no
micro-batches in flight and runs one program a step). A pipeline whose step is not the whole
batch's (:func:`fxpar.pipeline.pipeline_semantics` has notes, such as BatchNorm normalising each
micro-batch by its own statistics) is never a candidate: the choice does not change what
trains. ``fxpar plan --microbatches`` prints the same verdict: it makes each count's candidate
with the same function (:func:`count_candidate`, semantic check included) and weighs them by
the same rule (:func:`pipeline_wins`).

Each count also prices stages of data-parallel replicas (:func:`replica_search`: the stage DP
without ``stage_planner``, on the whole batch's step), and the cheaper of the two is that
count's candidate. A replica runs its stage's program whole on its own rows, so an op that no
sharding rule splits over the batch (a mixture-of-experts layer's grouped product, whose rows
are sorted by expert over the whole batch) is split anyway, where an intra-op plan on the
stage's mesh must replicate it and gather its operands.

Every rank makes the same choice: the solvers' answers are broadcast from rank 0 and the
pricing is deterministic, as for ``stages="auto"``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fxpar.cluster import Cluster
from fxpar.errors import BatchError
from fxpar.ir.capture import LossFn
from fxpar.ir.precision import MixedPrecision
from fxpar.ir.program import Program
from fxpar.pipeline import (
    Pipeline,
    PipelineError,
    StageChoice,
    capture_microbatch,
    default_schedules,
)
from fxpar.pipeline.auto import PipelineSearch, search_pipelines
from fxpar.pipeline.semantics import pipeline_semantics
from fxpar.pipeline.stage_choice import format_seconds
from fxpar.pipeline.stage_costs import StagePlanner
from fxpar.solvers.stages import NoStagePlanError

AUTO_MICROBATCHES = (2, 4, 8)
"""The micro-batch counts ``pipeline="auto"`` prices a pipeline of (those the batch divides)."""

SEARCHED_SCHEDULES: tuple[str, ...] = default_schedules().searched()
"""Every schedule the stage DP may choose (the registry's searched ones, in its order); on a tie
the first (1F1B keeps the fewest micro-batches in flight)."""


STEP_DIFFERS = "a pipeline would train another step than the whole batch's"
"""Why a model whose micro-batches compute something else (BatchNorm's statistics per
micro-batch, a loss that sums over the batch mixed with means) gets no pipeline candidate: the
choice never changes what is trained; ask for such a pipeline with ``pipeline=Pipeline(...)``."""


@dataclass(frozen=True)
class Candidate:
    """The stage DP's pipeline for one micro-batch count, with the program it was priced on (the
    step at one micro-batch's shapes, which the pipeline then runs), or why there is none."""

    microbatches: int
    search: PipelineSearch | None
    program: Program | None
    reason: str = ""
    replicas: PipelineSearch | None = None
    """The stage DP's best pipeline of data-parallel replicas (:func:`replica_search`), when
    it has one."""

    @property
    def choice(self) -> StageChoice | None:
        """The cheaper of the stage meshes' choice and the replicas' (the meshes' on a tie:
        they run the plans priced on this count's own step)."""
        meshes = self.search.choice if self.search is not None else None
        replicas = self.replicas.choice if self.replicas is not None else None
        if replicas is None or (meshes is not None and meshes.step_time <= replicas.step_time):
            return meshes
        return replicas

    @property
    def runs_replicas(self) -> bool:
        """Whether the choice is the replicas' (run as ``pipeline=choice.pipeline``, with no
        intra-op plan inside its stages)."""
        choice = self.choice
        return choice is not None and self.replicas is not None and choice is self.replicas.choice

    def describe(self) -> str:
        if self.choice is None:
            why = self.reason or (self.search.report() if self.search is not None else "")
            return f"{self.microbatches} micro-batches: no pipeline ({why.splitlines()[0]})"
        choice = self.choice
        layout = _stages(choice.pipeline.num_stages)
        if self.runs_replicas:
            layout += f" x {choice.pipeline.data_parallel} replicas"
        return (
            f"{self.microbatches} micro-batches: {format_seconds(choice.step_time)} "
            f"({layout}, {choice.pipeline.schedule}, "
            f"remat {'on' if choice.pipeline.remat else 'off'})"
        )


@dataclass(frozen=True)
class JointChoice:
    """What ``pipeline="auto"`` weighed: the whole batch's intra-op plan (its estimated step, or
    None when no plan fits) and the best pipeline of each micro-batch count."""

    alone: float | None
    candidates: tuple[Candidate, ...]

    @property
    def best(self) -> Candidate | None:
        """The candidate of the least estimated step (the fewest micro-batches on a tie)."""
        found = [c for c in self.candidates if c.choice is not None]
        return min(found, key=lambda c: c.choice.step_time) if found else None  # type: ignore[union-attr]

    @property
    def pipelined(self) -> bool:
        best = self.best
        piped = best.choice.step_time if best is not None and best.choice else None
        return pipeline_wins(self.alone, piped)

    def report(self) -> str:
        alone = format_seconds(self.alone) if self.alone is not None else "no plan fits"
        lines = [f"intra-op plan of the whole batch: {alone}"]
        lines += [f"pipeline of {c.describe()}" for c in self.candidates]
        lines.append(f"chosen: {'the pipeline' if self.pipelined else 'the intra-op plan'}")
        return "\n".join(lines)


def _stages(count: int) -> str:
    return f"{count} stage{'s' if count != 1 else ''}"


def pipeline_wins(alone: float | None, piped: float | None) -> bool:
    """Whether a pipeline estimated at ``piped`` seconds a step runs instead of the intra-op
    plan alone at ``alone`` (None: that one does not fit). A tie goes to the plan alone."""
    if piped is None:
        return False
    return alone is None or piped < alone


def pipeline_candidates(
    model: nn.Module,
    cluster: Cluster,
    example_inputs: Sequence[Any] | Mapping[str, Any],
    loss_fn: LossFn | None,
    *,
    example_targets: Sequence[torch.Tensor],
    stage_planner: StagePlanner,
    optimizer_states: int,
    mixed_precision: MixedPrecision | None,
    counts: Sequence[int] = AUTO_MICROBATCHES,
    whole: Program | None = None,
) -> tuple[Candidate, ...]:
    """The stage DP's best pipeline for each of ``counts`` micro-batches (module docstring); a
    count the batch does not divide into, that no stage layout runs, or whose pipeline would
    train another step is kept with why. ``whole``: the whole batch's training step, on which
    each count's stages of data-parallel replicas are priced too (without, none are)."""
    candidates = []
    for count in counts:
        pipelines = searched_pipelines(count)
        try:
            captured = capture_microbatch(
                model, pipelines[0], example_inputs, loss_fn, example_targets=example_targets,
                mixed_precision=mixed_precision,
            )  # fmt: skip
        except (BatchError, PipelineError) as error:
            replicas = None
            if whole is not None:
                replicas = replica_search(whole, cluster, pipelines, optimizer_states)
            candidates.append(Candidate(count, None, None, str(error), replicas))
            continue
        candidate = count_candidate(
            captured, cluster, pipelines, stage_planner=stage_planner,
            optimizer_states=optimizer_states, whole=whole,
        )  # fmt: skip
        candidates.append(candidate)
    return tuple(candidates)


def count_candidate(
    captured: Program,
    cluster: Cluster,
    pipelines: Sequence[Pipeline],
    *,
    stage_planner: StagePlanner,
    optimizer_states: int,
    whole: Program | None = None,
) -> Candidate:
    """The candidate of one micro-batch count (``pipelines``: its settings, one count), from
    ``captured``, the step at one micro-batch's shapes: none where the pipelined step would
    not be the whole batch's (:func:`~fxpar.pipeline.pipeline_semantics`), else the stage
    DP's pipeline of stage meshes planned by ``stage_planner`` and, with ``whole``, of
    data-parallel replicas (:func:`replica_search`). What ``pipeline="auto"`` and ``fxpar
    plan --microbatches`` weigh, so that they weigh alike."""
    count = pipelines[0].microbatches
    notes = pipeline_semantics(captured).notes
    if notes:
        return Candidate(count, None, None, f"{STEP_DIFFERS}: {notes[0]}")
    search: PipelineSearch | None = None
    program: Program | None = None
    reason = ""
    try:
        search = search_pipelines(
            captured, cluster, pipelines, optimizer_states=optimizer_states,
            stage_planner=stage_planner, microbatch=True,
        )  # fmt: skip
        program = captured
    except (BatchError, PipelineError, NoStagePlanError) as error:
        reason = str(error)
    replicas = None
    if whole is not None:
        replicas = replica_search(whole, cluster, pipelines, optimizer_states)
    return Candidate(count, search, program, reason, replicas)


def searched_pipelines(count: int) -> list[Pipeline]:
    """Every schedule and remat setting the joint search prices ``count`` micro-batches with;
    on a tie the first wins (1F1B keeps the fewest micro-batches in flight, remat off computes
    the least)."""
    return [
        Pipeline(stages="auto", microbatches=count, schedule=schedule, remat=remat)
        for schedule in SEARCHED_SCHEDULES
        for remat in (False, True)
    ]


def replica_search(
    whole: Program, cluster: Cluster, pipelines: Sequence[Pipeline], optimizer_states: int
) -> PipelineSearch | None:
    """The stage DP's best pipeline of data-parallel replicas for ``pipelines`` (one count's
    settings), priced on ``whole``, the whole batch's step, at each micro-batch's and
    replica's share of it (every call's fixed cost paid whole by each). None where no such
    pipeline runs, or where the best has one device a stage: that is a stage mesh of one
    device, which the stage meshes' search prices on the micro-batch's own step."""
    try:
        search = search_pipelines(whole, cluster, pipelines, optimizer_states=optimizer_states)
    except (PipelineError, NoStagePlanError):
        return None
    if search.choice is None or search.choice.pipeline.data_parallel == 1:
        return None
    return search


__all__ = [
    "AUTO_MICROBATCHES",
    "Candidate",
    "JointChoice",
    "count_candidate",
    "pipeline_candidates",
    "pipeline_wins",
    "replica_search",
    "searched_pipelines",
]
