"""The driver: capture -> passes -> lower for one model on one cluster, and the steps it made.

:func:`fxpar.compile` builds a :class:`Driver` and asks it for the training step; the
:class:`~fxpar.runtime.parallel.ParallelModel` it returns asks the same driver for every other
step it is called for (a batch of other shapes, a loss evaluation, the forward alone, either
mode). Each is made the same way, once, and kept under its key::

    capture(model, inputs of the call's shapes, mode)      fake tensors, no weights read
      -> passes (the compile's pass list; after the first, every parameter and buffer
         pinned to the training plan's layout)
      -> lower                                               one program per rank

The runtime never plans or lowers: it receives :class:`~fxpar.runtime.lowered.LoweredStep`
values and runs them. Which solver chose a plan does not reach it.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from fxpar import ir
from fxpar.cluster import Cluster, Coordinate
from fxpar.ir.capture import (
    LossFn,
    StepKind,
    batch_tensors,
    capture,
    model_in_mode,
    with_batch_tensors,
)
from fxpar.ir.placement import as_device, place
from fxpar.ir.precision import MixedPrecision
from fxpar.ir.program import Program
from fxpar.lowering import conversion_program, lower
from fxpar.passes import PassManager, keeping_state, plan_program
from fxpar.planning.plan import Plan
from fxpar.runtime.lowered import CallInputs, LoweredStep, StepKey, forward_key, step_key
from fxpar.sharding import Spec

logger = logging.getLogger(__name__)


def lowered_step(
    plan: Plan, *, defer_gradients: bool = False, device: torch.device | str = "cpu"
) -> LoweredStep:
    """``plan`` lowered to every rank's program, to run on ``device``; with
    ``defer_gradients``, its gradients left where the backward made them when that is no
    larger (:func:`fxpar.lowering.deferred_gradient_specs`)."""
    spmd = lower(plan, defer_gradients=defer_gradients)
    placeholders = plan.program.placeholders()
    specs = dict(zip(placeholders, spmd.input_specs, strict=True))
    metas = {name: ir.require(n, ir.ValueMeta).tensor for name, n in placeholders.items()}
    return LoweredStep(plan, spmd, specs, metas, as_device(device))


@dataclass
class Driver:
    """Captures, plans and lowers the steps of one compiled model, and keeps them.

    It keeps a reference to ``model`` to capture it again at other shapes and modes (it sets
    the model's train/eval mode while tracing, and restores it; the weights are not read).
    The first step it makes is the training step :func:`fxpar.compile` was called for; every
    later plan keeps each parameter and buffer in the layout that one gave it (and is refused
    if it does not, :meth:`LoweredStep.check_state`), so the runtime's state never moves.
    """

    model: nn.Module
    example_inputs: Sequence[Any] | Mapping[str, Any]
    loss_fn: LossFn | None
    cluster: Cluster
    passes: PassManager
    example_targets: Sequence[torch.Tensor] = ()
    mixed_precision: MixedPrecision | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    """Where this process runs the programs (:func:`fxpar.runtime.devices.rank_device`)."""
    max_steps: int = 32
    """The most steps kept besides the training step compiled for: past it the one used
    least recently is dropped (with its ``no_sync`` twin), and planned again if it comes back,
    so a run over ever new shapes holds a bounded number of programs."""
    _steps: OrderedDict[StepKey, LoweredStep] = field(default_factory=OrderedDict, repr=False)
    _deferred: dict[int, tuple[LoweredStep, LoweredStep]] = field(default_factory=dict, repr=False)
    """Each kept step's ``no_sync`` lowering, by the step's id (with the step, which keeps the
    id its own while the entry lives)."""
    _compiled_key: StepKey | None = field(default=None, repr=False)
    _conversions: dict[Hashable, fx.GraphModule] = field(default_factory=dict, repr=False)
    _state: dict[str, Spec] | None = field(default=None, repr=False)
    """Every parameter's and buffer's spec in the training plan (after the first step)."""

    # -- the stages, one line each ------------------------------------------------------------

    def capture(
        self, kind: StepKind, training: bool, inputs: CallInputs, targets: Sequence[torch.Tensor]
    ) -> Program:
        """One ``kind`` of step (``"train"``, ``"loss"`` or ``"forward"``) traced on
        ``inputs`` and ``targets`` with the model in train or eval mode."""
        with model_in_mode(self.model, training):
            return capture(
                self.model, inputs, self.loss_fn if kind != "forward" else None,
                example_targets=targets, step=kind, mixed_precision=self.mixed_precision,
            )  # fmt: skip

    def plan(self, program: Program, *, kind: StepKind = "train") -> Plan:
        """Run the pass list on ``program``; after the first step, with every parameter
        and buffer pinned to its layout (and, for steps without gradients, the solver
        choosing their activations in place of a manual plan written for training)."""
        passes = self.passes
        if self._state is not None:
            passes = keeping_state(passes, self._state, solve=kind != "train")
        return plan_program(program, self.cluster, passes=passes)

    def lower(self, plan: Plan) -> LoweredStep:
        """``plan`` lowered to one program per rank."""
        return lowered_step(plan, device=self.device)

    # -- the steps a compiled model asks for --------------------------------------------------

    def training_step(self, program: Program | None = None) -> LoweredStep:
        """The training step on the example, in the model's current mode: the step
        :func:`fxpar.compile` was called for, whose plan fixes the state's layouts.
        ``program``: that step captured already (:meth:`capture`), which planning leaves as
        it was for the caller to plan again; captured here when None."""
        training = self.model.training
        if program is None:
            program = self.capture("train", training, self.example_inputs, self.example_targets)
        step = self.lower(self.plan(program))
        names = step.signature.parameters + step.signature.buffers
        self._state = {name: step.specs[name] for name in names}
        self._compiled_key = step_key("train", training, step.batch.metas)
        self._steps[self._compiled_key] = step
        return step

    def step(
        self,
        kind: StepKind,
        training: bool,
        metas: Sequence[ir.TensorMeta],
        *,
        before_planning: Callable[[], None] = lambda: None,
    ) -> LoweredStep:
        """The ``"train"`` or ``"loss"`` step on a whole batch of ``metas`` (model inputs,
        then loss targets), made on first sight."""
        key = step_key(kind, training, metas)
        if key in self._steps:
            return self._kept(key)
        before_planning()
        shaped = [_meta_tensor(meta) for meta in metas]
        count = len(batch_tensors(self.example_inputs))
        inputs = with_batch_tensors(self.example_inputs, shaped[:count])
        return self._make(
            key, lambda: self.capture(kind, training, inputs, shaped[count:]), kind=kind
        )

    def forward(
        self, training: bool, inputs: CallInputs, metas: Sequence[ir.TensorMeta]
    ) -> LoweredStep:
        """The model's forward alone on ``inputs`` (whole tensors of ``metas``; other values
        are baked into the program, so another value is another step), made on first
        sight."""
        key = forward_key(training, inputs, metas)
        if key in self._steps:
            return self._kept(key)
        shaped = with_batch_tensors(inputs, [_meta_tensor(meta) for meta in metas])

        def traced() -> Program:
            return self.capture("forward", training, shaped, ())

        return self._make(key, traced, kind="forward")

    def deferred(self, step: LoweredStep) -> LoweredStep:
        """``step`` lowered with its gradients left where the backward made them (what a
        backward under ``no_sync`` runs)."""
        kept = self._deferred.get(id(step))
        if kept is None or kept[0] is not step:
            deferred = lowered_step(step.plan, defer_gradients=True, device=self.device)
            kept = self._deferred[id(step)] = (step, deferred)
        return kept[1]

    def conversion(
        self,
        metas: Sequence[ir.TensorMeta],
        sources: Sequence[Spec],
        targets: Sequence[Spec],
        coordinate: Coordinate,
    ) -> fx.GraphModule:
        """The program converting pieces of ``metas`` from ``sources`` to ``targets`` on the
        device at ``coordinate`` (what :meth:`ParallelModel.no_sync
        <fxpar.runtime.trainer.Trainer.no_sync>`'s gradients take), lowered once per
        conversion."""
        key = (tuple(metas), tuple(sources), tuple(targets), coordinate)
        if key not in self._conversions:
            lowered = conversion_program(
                metas, sources, targets, self.cluster.mesh_shape, coordinate,
                class_name="GradientSync",
            )  # fmt: skip
            self._conversions[key] = place(lowered.graph_module, self.device)
        return self._conversions[key]

    def _make(self, key: StepKey, traced: Callable[[], Program], *, kind: StepKind) -> LoweredStep:
        """Capture, plan and lower the step ``key`` names, check that no state moves, and
        keep it. Every rank makes it together (a solver runs on rank 0)."""
        assert self._state is not None, "the training step is made first"
        started = time.perf_counter()
        step = self.lower(self.plan(traced(), kind=kind))
        mode = "train" if key[1] else "eval"
        step.check_state(self._state, f"a {key[0]} step in {mode} mode on {key[2]}")
        logger.info(
            "planned a %s step (%s mode) for %s in %.2f s",
            key[0], mode, key[2], time.perf_counter() - started,
        )  # fmt: skip
        self._steps[key] = step
        self._bound()
        return step

    @property
    def kept(self) -> int:
        """How many lowered steps the driver holds."""
        return len(self._steps)

    def _kept(self, key: StepKey) -> LoweredStep:
        self._steps.move_to_end(key)
        return self._steps[key]

    def _bound(self) -> None:
        """Drop the least recently used steps (never the one compiled for) past
        :attr:`max_steps`."""
        while len(self._steps) > self.max_steps + 1:
            key = next(k for k in self._steps if k != self._compiled_key)
            dropped = self._steps.pop(key)
            self._deferred.pop(id(dropped), None)
            logger.debug("dropped a kept %s step, the one used least recently", key[0])


def _meta_tensor(meta: ir.TensorMeta) -> torch.Tensor:
    """A tensor of ``meta``'s shape and dtype with no storage, for capturing at that shape."""
    return torch.empty(meta.shape, dtype=meta.dtype, device="meta")


__all__ = ["Driver", "lowered_step"]
