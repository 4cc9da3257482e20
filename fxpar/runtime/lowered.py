"""What the runtime receives from the driver: lowered steps, and where more of them come from.

A compiled model runs more than the training step it was compiled for: a step on a batch of
other shapes, a loss evaluation (forward and loss, no backward), the model's forward alone
(inference), each in train or eval mode. Each is its own Program, captured, planned and lowered
the first time it is asked for, by the driver (:class:`fxpar.driver.Driver`), which keeps it
under a :data:`StepKey`. Every such plan pins every parameter and buffer to the layout the
training plan gave it, so the state never moves between programs: the same local pieces feed
all of them.

The runtime never plans or lowers: it holds a :class:`LoweredStep` and asks a
:class:`StepSource` for the others.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.fx as fx

from fxpar import ir
from fxpar.cluster import Coordinate
from fxpar.errors import FxparError
from fxpar.ir.capture import StepKind, batch_tensors
from fxpar.ir.placement import place
from fxpar.ir.program import Signature
from fxpar.lowering import SPMDProgram
from fxpar.planning.plan import Plan
from fxpar.runtime.batches import BatchSignature
from fxpar.sharding import Spec

StepKey = tuple[Hashable, ...]
"""What a compiled step is kept under: its kind, the train/eval mode, and the shapes (and any
non-tensor arguments) of what it is called with."""

CallInputs = Sequence[Any] | Mapping[str, Any]
"""A call's model inputs: positional (a sequence) or by keyword (a mapping), as
:func:`fxpar.capture` takes ``example_inputs``."""


class StepSource(Protocol):
    """Where a compiled model's steps come from (the driver, :class:`fxpar.driver.Driver`):
    each lowered for this cluster with every parameter and buffer in the training plan's
    layout, and kept for the next call of its kind, mode and shapes."""

    def step(
        self,
        kind: StepKind,
        training: bool,
        metas: Sequence[ir.TensorMeta],
        *,
        before_planning: Callable[[], None],
    ) -> LoweredStep:
        """A ``"train"`` or ``"loss"`` step on a whole batch of ``metas`` (model inputs then
        loss targets, in the compiled Program's order), traced in train or eval mode. Calls
        ``before_planning`` first when the step is new (every rank plans it together)."""
        ...

    def forward(
        self, training: bool, inputs: CallInputs, metas: Sequence[ir.TensorMeta]
    ) -> LoweredStep:
        """The model's forward alone on ``inputs`` (whole tensors of ``metas``)."""
        ...

    def deferred(self, step: LoweredStep) -> LoweredStep:
        """``step`` lowered with its gradients left where the backward made them, where that
        is no larger (:func:`fxpar.lowering.deferred_gradient_specs`)."""
        ...

    def conversion(
        self,
        metas: Sequence[ir.TensorMeta],
        sources: Sequence[Spec],
        targets: Sequence[Spec],
        coordinate: Coordinate,
    ) -> fx.GraphModule:
        """The program of the device at ``coordinate`` that takes its pieces of tensors of
        ``metas`` laid out as ``sources`` (after the communicator) and returns them laid out
        as ``targets``: collectives and local slices only."""
        ...


@dataclass(frozen=True)
class LoweredStep:
    """One planned and lowered step: the plan, the per-rank programs, and the spec and shape
    of each placeholder by name (the driver makes them, :func:`fxpar.driver.lowered_step`)."""

    plan: Plan
    spmd: SPMDProgram
    specs: dict[str, Spec]
    metas: dict[str, ir.TensorMeta]
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    """Where the programs run: :meth:`program` gives each placed there
    (:func:`fxpar.ir.placement.place`)."""

    @property
    def signature(self) -> Signature:
        return self.plan.program.signature

    @property
    def batch(self) -> BatchSignature:
        """The batch tensors the step takes, whole."""
        names = self.signature.inputs
        return BatchSignature(names, tuple(self.metas[name] for name in names))

    def program(self, rank: int) -> fx.GraphModule:
        """Rank ``rank``'s program, placed on :attr:`device`."""
        return place(self.spmd.ranks[rank].graph_module, self.device)

    @property
    def leading_specs(self) -> tuple[Spec, ...]:
        """The specs the loss or the forward's outputs leave the program in."""
        return self.spmd.output_specs[: len(self.signature.outputs)]

    @property
    def gradient_specs(self) -> tuple[Spec, ...]:
        """The specs the gradients leave the program in."""
        first = len(self.signature.outputs)
        return self.spmd.output_specs[first : first + len(self.signature.gradients)]

    def check_state(self, kept: Mapping[str, Spec], what: str) -> None:
        """Refuse a plan that lays out any parameter or buffer other than ``kept`` says."""
        moved = [name for name, spec in kept.items() if self.specs.get(name) != spec]
        if moved:
            raise FxparError(
                f"the plan for {what} lays out {moved[:3]} differently from the plan being "
                "trained, and state does not move between plans: use a solver (pins keep the "
                "layout) rather than a manual plan or a fixed choose-strategies pass for "
                "varying shapes"
            )


def step_key(kind: StepKind, training: bool, metas: Sequence[ir.TensorMeta]) -> StepKey:
    return (kind, training, tuple(metas))


def call_inputs(
    args: tuple[Any, ...], kwargs: Mapping[str, Any], *, check_ranks: bool, rank: int
) -> tuple[CallInputs, list[torch.Tensor], tuple[ir.TensorMeta, ...]]:
    """The model inputs of ``forward(*args, **kwargs)``, positional or by keyword, their
    tensors and the tensors' shapes; with ``check_ranks``, after checking that every rank holds
    the same tensors (a collective, before anything is captured, so that every rank builds the
    same programs)."""
    call = _call(args, kwargs)
    tensors = batch_tensors(call)
    metas = tuple(ir.TensorMeta.of(tensor) for tensor in tensors)
    names = tuple(f"input {i}" for i in range(len(tensors)))
    BatchSignature(names, metas).take(tensors, {}, check_ranks=check_ranks, rank=rank)
    return call, tensors, metas


def _call(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> CallInputs:
    if args and kwargs:
        raise FxparError(
            "pass the model's inputs either positionally or by keyword, not both (got "
            f"{len(args)} positional and {sorted(kwargs)}): a compiled forward binds them as "
            "fxpar.capture binds example_inputs"
        )
    if not args and not kwargs:
        raise FxparError("the forward needs the model's inputs")
    return dict(kwargs) if kwargs else tuple(args)


def forward_key(training: bool, inputs: CallInputs, metas: Sequence[ir.TensorMeta]) -> StepKey:
    """The key of a forward call: its tensors by ``metas`` (their whole shapes, in order),
    other values by ``repr`` (they are baked into the traced program, so another value needs
    another program)."""
    items = inputs.items() if isinstance(inputs, Mapping) else enumerate(inputs)
    shapes = iter(metas)
    described = tuple(
        (key, next(shapes) if isinstance(value, torch.Tensor) else repr(value))
        for key, value in items
    )
    return ("forward", training, described)


__all__ = [
    "CallInputs",
    "LoweredStep",
    "StepKey",
    "StepSource",
    "call_inputs",
    "forward_key",
    "step_key",
]
