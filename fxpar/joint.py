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
trains. ``fxpar plan --microbatches`` prints the same verdict (:func:`pipeline_wins`).

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
from fxpar.pipeline import Pipeline, PipelineError, StageChoice, capture_microbatch
from fxpar.pipeline.auto import PipelineSearch, search_pipelines
from fxpar.pipeline.options import ScheduleName
from fxpar.pipeline.semantics import pipeline_semantics
from fxpar.pipeline.stage_choice import format_seconds
from fxpar.pipeline.stage_costs import StagePlanner
from fxpar.solvers.stages import NoStagePlanError

AUTO_MICROBATCHES = (2, 4, 8)
"""The micro-batch counts ``pipeline="auto"`` prices a pipeline of (those the batch divides)."""

SEARCHED_SCHEDULES: tuple[ScheduleName, ...] = ("1f1b", "gpipe", "zb-h1")
"""Every schedule the stage DP may choose; on a tie the first (1F1B keeps the fewest micro-batches
in flight)."""


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

    @property
    def choice(self) -> StageChoice | None:
        return self.search.choice if self.search is not None else None

    def describe(self) -> str:
        if self.choice is None:
            why = self.reason or (self.search.report() if self.search is not None else "")
            return f"{self.microbatches} micro-batches: no pipeline ({why.splitlines()[0]})"
        choice = self.choice
        return (
            f"{self.microbatches} micro-batches: {format_seconds(choice.step_time)} "
            f"({_stages(choice.pipeline.num_stages)}, {choice.pipeline.schedule}, "
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
) -> tuple[Candidate, ...]:
    """The stage DP's best pipeline for each of ``counts`` micro-batches (module docstring); a
    count the batch does not divide into, that no stage layout runs, or whose pipeline would
    train another step is kept with why."""
    candidates = []
    for count in counts:
        pipelines = [
            Pipeline(stages="auto", microbatches=count, schedule=schedule, remat=remat)
            for schedule in SEARCHED_SCHEDULES
            for remat in (False, True)
        ]
        try:
            program = capture_microbatch(
                model, pipelines[0], example_inputs, loss_fn, example_targets=example_targets,
                mixed_precision=mixed_precision,
            )  # fmt: skip
            notes = pipeline_semantics(program).notes
            if notes:
                candidates.append(Candidate(count, None, None, f"{STEP_DIFFERS}: {notes[0]}"))
                continue
            search = search_pipelines(
                program, cluster, pipelines, optimizer_states=optimizer_states,
                stage_planner=stage_planner, microbatch=True,
            )  # fmt: skip
            candidates.append(Candidate(count, search, program))
        except (BatchError, PipelineError, NoStagePlanError) as error:
            candidates.append(Candidate(count, None, None, str(error)))
    return tuple(candidates)


__all__ = ["AUTO_MICROBATCHES", "Candidate", "JointChoice", "pipeline_candidates", "pipeline_wins"]
