"""Typed errors raised by fxpar.

Every error says what went wrong in terms of the user's model and what to do next. They all
derive from :class:`FxparError`, so ``except fxpar.errors.FxparError`` catches any of them.
"""

from __future__ import annotations

from typing import Any


class FxparError(Exception):
    """Base class of every error fxpar raises on purpose.

    Every subclass pickles with its message and attributes, whatever its ``__init__`` takes, so
    an error raised on one rank can be re-raised as itself on the others.
    """

    def __reduce__(self) -> tuple[Any, ...]:
        # Exception's own reduce re-calls ``cls(*self.args)``, which fails for subclasses with
        # keyword-only arguments (a TypeError on every rank but the one that raised). Rebuild
        # without __init__ instead: the message from ``args``, the rest from ``__dict__``.
        return (_rebuild, (type(self), self.args), self.__dict__ or None)


def _rebuild(cls: type[FxparError], args: tuple[Any, ...]) -> FxparError:
    error = cls.__new__(cls)
    error.args = args
    return error


class CaptureError(FxparError):
    """A model could not be captured into a Program.

    Raised for data-dependent Python control flow, operations fake tensors cannot run, models
    that mutate their inputs, or a loss that is not a scalar. The message names the module and
    the source line where tracing stopped.
    """


class VerificationError(FxparError):
    """A Program broke one of the IR's invariants (see :mod:`fxpar.verify`)."""


class AnnotationError(FxparError):
    """A node lacks an annotation that a pass or query needs."""


class SymbolicShapeError(FxparError):
    """Planning (the sharding rules, automatic and manual plans) was given a Program captured
    with ``dynamic=True``, whose batch sizes are symbols: whether a dimension splits evenly over
    the mesh depends on its size. Capture with ``dynamic=False`` to plan."""


class LoweringError(FxparError):
    """A Program and its chosen strategies cannot be lowered to per-rank programs."""


class PassError(FxparError):
    """A compiler pass failed; the message names the pass and the passes that ran before it."""

    def __init__(self, message: str, *, pass_name: str, completed: tuple[str, ...]) -> None:
        super().__init__(message)
        self.pass_name = pass_name
        self.completed = completed


class DistributedError(FxparError):
    """The processes do not match the plan: no process group, a world size or device mesh other
    than the cluster's, ranks that disagree."""


class BatchError(FxparError):
    """A batch passed to a compiled model does not match the one it was compiled for."""


class CheckpointError(FxparError):
    """A checkpoint cannot be saved or loaded into this model."""


class PipelineError(FxparError):
    """A model, a split, a schedule or a launch that the pipeline runtime cannot run; the
    message says which stage, module or schedule is at fault and what to change."""
