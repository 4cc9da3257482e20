"""The programs a :class:`~fxpar.runtime.parallel.ParallelModel` runs, one per kind of call.

A compiled model runs more than the training step it was compiled for: a step on a batch of
other shapes, a loss evaluation (forward and loss, no backward), the model's forward alone
(inference), each in train or eval mode. Each is its own Program, captured and planned the
first time it is asked for and kept under a :data:`StepKey`. Every such plan pins every
parameter and buffer to the layout the training plan gave it, so the state never moves
between programs: the same local pieces feed all of them.

The runtime does not know how plans are made; it asks a :class:`StepPlanner`, which
:func:`fxpar.compile` builds from the model, the example and the pass pipeline.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.fx as fx

from fxpar import ir
from fxpar.errors import FxparError
from fxpar.ir.capture import StepKind, batch_tensors
from fxpar.ir.program import Signature
from fxpar.lowering import SPMDProgram, lower
from fxpar.planning.plan import Plan
from fxpar.runtime.batches import BatchSignature
from fxpar.sharding import Spec

StepKey = tuple[Hashable, ...]
"""What a compiled step is kept under: its kind, the train/eval mode, and the shapes (and any
non-tensor arguments) of what it is called with."""

CallInputs = Sequence[Any] | Mapping[str, Any]
"""A call's model inputs: positional (a sequence) or by keyword (a mapping), as
:func:`fxpar.capture` takes ``example_inputs``."""


class StepPlanner(Protocol):
    """Plans the steps a compiled model is asked for, keeping every parameter and buffer in
    the spec ``state`` gives it (:func:`fxpar.compile` makes one)."""

    def plan_step(
        self,
        kind: StepKind,
        training: bool,
        batch: Sequence[torch.Tensor],
        state: Mapping[str, Spec],
    ) -> Plan:
        """A ``"train"`` or ``"loss"`` step on ``batch`` (model inputs then loss targets, in
        the compiled Program's order), traced in train or eval mode."""
        ...

    def plan_forward(self, training: bool, inputs: CallInputs, state: Mapping[str, Spec]) -> Plan:
        """The model's forward alone on ``inputs``, traced in train or eval mode."""
        ...


@dataclass(frozen=True)
class CompiledStep:
    """One planned and lowered step: the plan, the per-rank programs, and the spec and shape
    of each placeholder by name."""

    plan: Plan
    spmd: SPMDProgram
    specs: dict[str, Spec]
    metas: dict[str, ir.TensorMeta]

    @staticmethod
    def of(plan: Plan, *, defer_gradients: bool = False) -> CompiledStep:
        """``plan`` lowered; with ``defer_gradients``, its gradients left where the backward
        made them when that is no larger (:func:`fxpar.lowering.deferred_gradient_specs`)."""
        spmd = lower(plan.program, plan.cluster, defer_gradients=defer_gradients)
        placeholders = plan.program.placeholders()
        specs = dict(zip(placeholders, spmd.input_specs, strict=True))
        metas = {name: ir.require(n, ir.ValueMeta).tensor for name, n in placeholders.items()}
        return CompiledStep(plan, spmd, specs, metas)

    @property
    def signature(self) -> Signature:
        return self.plan.program.signature

    @property
    def batch(self) -> BatchSignature:
        """The batch tensors the step takes, whole."""
        names = self.signature.inputs
        return BatchSignature(names, tuple(self.metas[name] for name in names))

    def program(self, rank: int) -> fx.GraphModule:
        return self.spmd.ranks[rank].graph_module

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
    "CompiledStep",
    "StepKey",
    "StepPlanner",
    "call_inputs",
    "forward_key",
    "step_key",
]
