"""Pipeline parallelism: a captured step cut into stages, run by a static schedule per rank.

- :class:`Pipeline` says how (stages, micro-batches, schedule, remat, devices per stage): the
  request, which may leave choices open; :class:`PipelinePlan` is the answer, every choice
  made, saved and loaded as JSON (:mod:`fxpar.pipeline.pipeline_plan`).
- :func:`partition` and :func:`split_program` cut a Program into per-stage forward and backward
  programs (:class:`SplitProgram`).
- :class:`Schedule` s (GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZB-V) build an instruction list
  per stage; a :class:`ScheduleRegistry` holds them by name (:func:`default_schedules`), and
  :func:`build_schedule` builds a default one's lists.
- :class:`PipelineModel` trains on ``torch.distributed`` processes, one stage replica each.
- :func:`pipeline_semantics` says how the micro-batches' losses make the step's, and where a
  pipelined step differs from one on the whole batch (:class:`PipelineSemantics`).
- :class:`PipelineModel` also evaluates and infers (``eval()``, ``pipelined(*inputs)``), with
  programs cut on first use over the same state (:mod:`fxpar.pipeline.stage_programs`;
  :class:`PassPlanner` plans them on a stage mesh with the state's layouts pinned).
- :func:`plan_stages` chooses split points and devices per stage with the stage DP
  (``Pipeline(stages="auto")`` in :func:`fxpar.compile`); :func:`search_pipelines` also
  chooses the schedule and remat among settings, on plans made once.

See docs/pipelines.md.
"""

from __future__ import annotations

from fxpar.pipeline.auto import (
    DegreeOutcome,
    PipelineSearch,
    StageChoice,
    evaluate_split,
    plan_stages,
    search_pipelines,
)
from fxpar.pipeline.executor import Event, StageTrace, StageWorker
from fxpar.pipeline.model import PipelineModel, capture_microbatch, microbatch_step
from fxpar.pipeline.options import Pipeline, PipelineError
from fxpar.pipeline.partition import (
    Half,
    Partition,
    StageOrderError,
    Unit,
    check_causal,
    even_split_points,
    partition,
)
from fxpar.pipeline.pipeline_plan import PipelinePlan, PipelinePlanError, PipelineStage, SavedPlan
from fxpar.pipeline.schedule import Instruction, Op, max_in_flight, modelled_bubble, simulate
from fxpar.pipeline.schedules import (
    Schedule,
    ScheduleRegistry,
    build_schedule,
    default_schedules,
)
from fxpar.pipeline.semantics import PipelineSemantics, pipeline_semantics
from fxpar.pipeline.split import SplitProgram, StageProgram, split_program
from fxpar.pipeline.stage_programs import PassPlanner
from fxpar.pipeline.timeline import bubble_fractions, ideal_bubble, plot_timeline

__all__ = [
    "DegreeOutcome",
    "Event",
    "Half",
    "Instruction",
    "Op",
    "Partition",
    "PassPlanner",
    "Pipeline",
    "PipelineError",
    "PipelineModel",
    "PipelinePlan",
    "PipelinePlanError",
    "PipelineSearch",
    "PipelineSemantics",
    "PipelineStage",
    "SavedPlan",
    "Schedule",
    "ScheduleRegistry",
    "SplitProgram",
    "StageChoice",
    "StageOrderError",
    "StageProgram",
    "StageTrace",
    "StageWorker",
    "Unit",
    "bubble_fractions",
    "build_schedule",
    "capture_microbatch",
    "check_causal",
    "default_schedules",
    "evaluate_split",
    "even_split_points",
    "ideal_bubble",
    "max_in_flight",
    "microbatch_step",
    "modelled_bubble",
    "partition",
    "pipeline_semantics",
    "plan_stages",
    "plot_timeline",
    "search_pipelines",
    "simulate",
    "split_program",
]
