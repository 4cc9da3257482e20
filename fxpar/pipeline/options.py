"""What a user asks of a pipeline: :class:`Pipeline`, and the error pipelines raise."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from fxpar.errors import FxparError

ScheduleName = Literal["gpipe", "1f1b"]
SCHEDULES: tuple[ScheduleName, ...] = ("gpipe", "1f1b")


class PipelineError(FxparError):
    """A model, a split or a launch that the pipeline runtime cannot run; the message says
    which stage or module is at fault and what to change."""


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
            in flight on stage ``s``). Both compute the same step.
        remat: keep only the activations that cross stage boundaries and recompute the rest of
            a stage's forward inside its backward (about a third more compute, far less memory).
        data_parallel: devices per stage; each holds a copy of the stage and takes an equal
            piece of every micro-batch, and their gradients are all-reduced once per step.
    """

    stages: int | tuple[str, ...] | Literal["auto"] = 2
    microbatches: int = 4
    schedule: ScheduleName = "1f1b"
    remat: bool = False
    data_parallel: int = 1

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
        if self.schedule not in SCHEDULES:
            raise PipelineError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.data_parallel < 1:
            raise PipelineError(f"data_parallel must be >= 1, got {self.data_parallel}")

    @property
    def num_stages(self) -> int:
        if self.stages == "auto":
            raise PipelineError(
                "stages='auto' has no number of stages until it is planned: fxpar.compile "
                "does that, or call fxpar.pipeline.plan_stages"
            )
        return self.stages if isinstance(self.stages, int) else len(self.stages) + 1

    @property
    def world_size(self) -> int:
        """Processes the pipeline runs on: ``num_stages * data_parallel``."""
        return self.num_stages * self.data_parallel
