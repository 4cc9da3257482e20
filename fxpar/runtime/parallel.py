"""``ParallelModel``: this rank's share of a model compiled by :func:`fxpar.compile`.

Every process of the job gets a :class:`ParallelModel` that holds only its own pieces of the
parameters, buffers and optimizer state, and runs only its own program. Nothing about which
solver chose the plan reaches it: it sees per-rank programs and the specs of their inputs and
outputs.

What a step does on each rank: take this rank's piece of the global batch, run the rank's
program (forward, loss, backward, with the collectives the plan needs; gradients come out in
their parameters' layouts), hand the local gradients to a ``torch.optim`` optimizer over the
local pieces (see :mod:`fxpar.optim` for why that is exact), and store the new buffers.

Checkpoints are ``torch.distributed.checkpoint`` directories of DTensors, so a checkpoint saved
under one mesh and plan loads under any other: each rank reads just the pieces its new layout
needs.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from fxpar import checkpoint, ir
from fxpar.cluster import Coordinate
from fxpar.errors import BatchError, FxparError
from fxpar.ir.capture import StepKind
from fxpar.ir.program import named_state, state_dict_aliases
from fxpar.ir.rng import RandomState
from fxpar.optim import Optimizer
from fxpar.runtime import fastcall
from fxpar.runtime.batches import (
    BatchSignature,
    OwnRows,
    check_same_batch,
    gather_rows,
    global_rows,
)
from fxpar.runtime.communicators import OneDeviceCommunicator, ProcessGroupCommunicator
from fxpar.runtime.devices import HostStaged, broadcast_from_rank_zero, stages_through_host
from fxpar.runtime.fingerprint import check_same_model
from fxpar.runtime.lowered import LoweredStep, StepSource, call_inputs
from fxpar.runtime.trainer import Trainer
from fxpar.runtime.weights import Piece, initial_pieces
from fxpar.sharding import Spec, shard_tensor

logger = logging.getLogger(__name__)


class ParallelModel(Trainer):
    """This rank's share of a model compiled by :func:`fxpar.compile`.

    Besides the training step it runs the model's forward (``parallel(*inputs)``) and a
    forward-only loss (:meth:`loss`), in train or eval mode (:meth:`train`, :meth:`eval`), on
    batches of any shapes. Each such call is captured and planned on first sight, with every
    parameter and buffer kept in its layout, and that plan is kept for the next call of its
    kind, mode and shapes by the driver (see :mod:`fxpar.runtime.lowered`); ``plan``,
    ``spmd`` and ``program`` are those of the training step last run. The loop, the mode and
    checkpoints are :class:`~fxpar.runtime.trainer.Trainer`'s.

    Attributes:
        plan: the chosen plan (the same on every rank): strategies, costs, solver's answer.
        spmd: the per-rank programs and the specs of their inputs and outputs.
        rank, coordinate: this process's rank and its place in the mesh.
        program: this rank's GraphModule; its code is ``program.code``.
        training: whether calls run the model in train mode (as ``nn.Module.training``).
        batch: ``"global"`` (every rank passes the whole batch) or ``"local"`` (each passes
            its own rows, see :func:`fxpar.compile`).
    """

    def __init__(
        self,
        step: LoweredStep,
        model: nn.Module,
        optimizer: Optimizer,
        device_mesh: Any,
        *,
        check_batches: bool = True,
        steps: StepSource,
        batch: str = "global",
        init: str | os.PathLike[str] | None = None,
    ) -> None:
        """``step``: the lowered training step to start with; ``steps``: where the steps of
        other kinds, modes and shapes, and the programs that convert gradients kept by
        :meth:`no_sync`, come from (the driver, :class:`fxpar.driver.Driver`)."""
        if batch not in ("global", "local"):
            raise FxparError(f"batch must be 'global' or 'local', got {batch!r}")
        plan = step.plan
        self.cluster = plan.cluster
        self.optimizer_spec = optimizer
        self.check_batches = check_batches
        self.batch = batch
        self._device_mesh = device_mesh
        self._distributed = device_mesh is not None
        self._source = steps
        self.rank = dist.get_rank() if device_mesh is not None else 0
        self.coordinate: Coordinate = self.cluster.coordinate(self.rank)
        self.device = step.device
        """Where this rank's state lives and its programs run (see fxpar.runtime.devices)."""
        self._communicator: Any = OneDeviceCommunicator()
        if device_mesh is not None:
            self._communicator = ProcessGroupCommunicator(device_mesh)
            if stages_through_host(self.device):
                self._communicator = HostStaged(self._communicator, self.device)
        self._mesh_copies = device_mesh is not None and device_mesh.device_type != self.device.type
        """Whether the DTensors of checkpoints hold host copies of the pieces (GPU over gloo)."""
        self.training = model.training
        self._adopt(step)
        self.signature = plan.program.signature
        names = self.signature.parameters + self.signature.buffers
        self._state_specs = {name: step.specs[name] for name in names}
        self._state_metas = {name: step.metas[name] for name in names}

        state = named_state(model)
        self._aliases = state_dict_aliases(model, names)
        check_same_model(state, names)
        mesh_shape = self.cluster.mesh_shape
        pieces = {
            name: Piece(self._state_specs[name], mesh_shape, self.coordinate) for name in names
        }
        local = initial_pieces(model, names, pieces, init, distributed=device_mesh is not None)
        local = {name: tensor.to(self.device) for name, tensor in local.items()}
        self.parameters = {name: local[name] for name in self.signature.parameters}
        self.buffers = {name: local[name] for name in self.signature.buffers}
        self._trainable = list(self.signature.gradients)
        self.trainable = [self.parameters[name] for name in self._trainable]
        self._gradient_index = {name: i for i, name in enumerate(self.signature.gradients)}
        self._gradient_dtype = next((p.dtype for p in self.trainable), torch.float32)
        self._pieces_checked = False
        self._syncing = True
        self._unsynced: dict[tuple[str, Spec], torch.Tensor] = {}
        """Gradients summed unreduced inside no_sync, by parameter and the spec they are in."""
        self.optimizer = optimizer.build(self.trainable)
        rank_zero = broadcast_from_rank_zero(
            torch.get_rng_state(), distributed=device_mesh is not None
        )
        self.random = RandomState(rank_zero)
        """The generator the step's random ops draw from, the same on every rank."""
        self.steps = 0

    def _adopt(self, step: LoweredStep) -> None:
        """Train by ``step`` (one of them per batch shape and mode)."""
        self._step = step
        self.plan = step.plan
        self.spmd = step.spmd
        self.program: fx.GraphModule = step.program(self.rank)

    @property
    def programs(self) -> tuple[fx.GraphModule, ...]:
        """Every rank's GraphModule, by rank."""
        return tuple(rank.graph_module for rank in self.spmd.ranks)

    # -- training ---------------------------------------------------------------------------

    def step(
        self,
        *batch: torch.Tensor,
        max_grad_norm: float | None = None,
        accumulate: int = 1,
        **named_batch: torch.Tensor,
    ) -> torch.Tensor:
        """One training step (:meth:`Trainer.step <fxpar.runtime.trainer.Trainer.step>`).

        With ``batch="global"`` (the default) the batch is given whole and identically on
        every rank, and each rank takes its own piece; with ``batch="local"`` each rank gives
        its own rows (see :func:`fxpar.compile`), and with ``accumulate=k`` each rank's rows
        are cut into ``k`` equal pieces, piece ``i`` of every rank together making the
        ``i``-th accumulated batch."""
        checking = self._same_batch and accumulate != 1
        if checking:  # the whole batch once, rather than each piece
            tensors = [*batch, *named_batch.values()]
            check_same_batch([t for t in tensors if isinstance(t, torch.Tensor)], rank=self.rank)
        self._pieces_checked = checking
        try:
            return super().step(
                *batch, max_grad_norm=max_grad_norm, accumulate=accumulate, **named_batch
            )
        finally:
            self._pieces_checked = False

    def backward(
        self, *batch: torch.Tensor, scale: float = 1.0, **named_batch: torch.Tensor
    ) -> torch.Tensor:
        """Forward and backward on a batch (as :meth:`step` takes it), without an update: this
        rank's pieces of the gradients, times ``scale``, are added to the parameters' ``.grad``
        (so calls accumulate, as ``loss.backward()`` does, until :meth:`zero_grad`), and the new
        buffer values are stored. Returns the loss. With ``scale=1/k``, k calls on the pieces
        of a batch accumulate the gradient of the mean loss over the whole batch.

        Inside :meth:`no_sync` the gradients are kept where the backward made them (partial
        sums, unreduced) and ``.grad`` is left alone; the first call outside it (or
        :meth:`clip_grad_norm_` or :meth:`optimizer_step`) reduces everything kept at once."""
        step, tensors = self._prepare("train", batch, named_batch)
        self._adopt(step)
        deferring = not self._syncing or bool(self._unsynced)
        if deferring:
            step = self._deferred(step)
        outputs = self._run(step, tensors)
        gradients = outputs[1 : 1 + len(self.trainable)]
        specs = step.gradient_specs
        for name, gradient, spec in zip(self.signature.gradients, gradients, specs, strict=True):
            if scale != 1.0:
                gradient = gradient * scale
            if deferring:
                kept = self._unsynced.setdefault((name, spec), gradient)
                if kept is not gradient:
                    kept.add_(gradient)
            else:
                self._add_gradient(name, gradient)
        updates = outputs[1 + len(self.trainable) :]
        for name, value in zip(self.signature.buffer_updates, updates, strict=True):
            self.buffers[name].copy_(value)
        if self._syncing:
            self._sync_gradients()
        return outputs[0]

    def _deferred(self, step: LoweredStep) -> LoweredStep:
        """``step`` lowered with its gradients left where the backward made them."""
        return self._source.deferred(step)

    def _sync_gradients(self) -> None:
        """Convert every gradient kept unreduced to its parameter's layout (one program of
        collectives) and add it to ``.grad``. A collective: every rank holds the same keys."""
        if not self._unsynced:
            return
        keys = tuple(sorted(self._unsynced, key=lambda k: (self._gradient_index[k[0]], str(k[1]))))
        program = self._source.conversion(
            [self._state_metas[name] for name, _ in keys],
            [spec for _, spec in keys],
            [self._state_specs[name] for name, _ in keys],
            self.coordinate,
        )
        with torch.no_grad():
            converted = fastcall.run(
                program, self._communicator, *(self._unsynced[key] for key in keys)
            )
        self._unsynced.clear()
        for (name, _), gradient in zip(keys, converted, strict=True):
            self._add_gradient(name, gradient)

    def _forget_unsynced(self) -> None:
        self._unsynced.clear()

    def _norm_weight(self, name: str) -> float:
        """A piece replicated over some mesh axes counts once for all its copies."""
        return 1.0 / self._copies(name)

    def _copies(self, name: str) -> int:
        """How many ranks hold the same piece of parameter ``name``: the sizes of the mesh axes
        it is replicated over."""
        spec = self._state_specs[name]
        return math.prod(
            size
            for size, placement in zip(self.cluster.mesh_shape, spec, strict=True)
            if not isinstance(placement, Shard)
        )

    def loss(self, *batch: torch.Tensor, **named_batch: torch.Tensor) -> torch.Tensor:
        """The loss of the current weights on a batch (as :meth:`step` takes it), forward only:
        no backward runs and nothing changes. Random ops (dropout, in train mode) draw what the
        next step will draw, and the random state is left where it was; buffers the forward
        would write (BatchNorm's statistics, in train mode) are left as they were. A
        collective: call it on every rank."""
        step, tensors = self._prepare("loss", batch, named_batch)
        state = self.random.state
        try:
            return self._run(step, tensors)[0]
        finally:
            self.random.state = state

    def forward(
        self, *inputs: Any, gather: bool = True, rows: str | None = None, **named_inputs: Any
    ) -> Any:
        """Run the model's forward alone and return its output, as ``model(*inputs)`` would:
        a tensor, a tuple, a dict or a Hugging Face ``ModelOutput``, with the same structure.

        The inputs are the model's (no loss targets), positionally or by keyword, whole on
        every rank (or this rank's rows with ``batch="local"``). The forward is captured and
        planned for inference on first sight (no saved activations, no backward) with the
        state kept in its layout, and kept for the next call of those shapes. Buffers it
        writes (BatchNorm's statistics, in train mode) are stored and random ops draw from
        :attr:`random`, as in eager PyTorch.

        ``gather``: return whole tensors (the default), the same on every rank; with False,
        each output tensor is a ``DTensor`` of this rank's piece on the job's device mesh (a
        plain tensor on one device). ``rows``, with ``batch="local"``: ``"local"`` (the
        default) returns, of each output whose dim 0 is the batch's rows, this rank's rows
        only, aligned with its own inputs (as DistributedDataParallel does); ``"global"``
        returns every rank's rows, in rank order (see :class:`~fxpar.runtime.batches.OwnRows`).
        A collective: call it on every rank.
        """
        call, tensors, metas = call_inputs(
            inputs, named_inputs, check_ranks=self._same_batch, rank=self.rank
        )
        own = OwnRows.of(rows, batch=self.batch, gather=gather, inputs=tensors, rank=self.rank,
                         world=self._world)  # fmt: skip
        metas = self._global_metas(metas)
        step = self._source.forward(self.training, call, metas)
        outputs = self._run(step, self._pieces(step, tensors))
        leading = len(step.signature.outputs)
        for name, value in zip(step.signature.buffer_updates, outputs[leading:], strict=True):
            self.buffers[name].copy_(value)
        tree = step.signature.output_tree
        assert tree is not None
        results = [
            self._output(local, spec, meta, gather)
            if own is None
            else own.cut(local, spec, meta, self._output)
            for local, spec, meta in zip(
                outputs[:leading], step.leading_specs, step.plan.program.output_metas(), strict=True
            )
        ]
        return tree.rebuild(results)

    __call__ = forward

    def _run(self, step: LoweredStep, batch: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Run ``step``'s program on this rank; ``batch`` holds this rank's pieces."""
        signature = step.signature
        inputs = [self.parameters[n] for n in signature.parameters]
        inputs += [self.buffers[n] for n in signature.buffers]
        # Random inputs are drawn whole on every rank, each keeping its piece (see fxpar.rng).
        draws = self.random.draw(signature.random)
        inputs += batch
        inputs += [
            self._piece(step, draw.name, tensor).to(self.device)
            for draw, tensor in zip(signature.random, draws, strict=True)
        ]
        with torch.no_grad():
            try:
                program = step.program(self.rank)
                outputs = tuple(fastcall.run(program, self._communicator, *inputs))
            except BaseException:
                self._communicator.settle()  # a deferred batch check says why, if it fails
                raise
        self._communicator.settle()  # the step may have had no collective to run it
        return outputs

    def _prepare(
        self, kind: StepKind, batch: tuple[torch.Tensor, ...], named: Mapping[str, torch.Tensor]
    ) -> tuple[LoweredStep, list[torch.Tensor]]:
        """The step of ``kind`` for this batch (planned now if it is new) and this rank's
        pieces of the batch, after checking that it binds to the step's inputs and, with
        ``check_batches``, that every rank holds the same one (or same-shaped local rows)."""
        current = self._step.batch
        if self.batch == "local":
            current = current.with_rows(self._world, local=True)
        given = current.given(batch, named)
        if given is None:
            current.take(batch, named, check_ranks=self._same_batch, rank=self.rank)
            raise AssertionError("take refuses a batch that given refused")  # pragma: no cover
        signature = BatchSignature(current.names, given)
        # The comparison of batches across ranks travels while the step computes up to its
        # first collective, which waits for it (and every rank raises there on a mismatch).
        tensors = signature.take(
            batch, named, check_ranks=self._same_batch, rank=self.rank,
            defer=self._communicator.defer,
        )  # fmt: skip
        metas = self._global_metas(given)
        # Every rank plans a new shape only once all agree on the batch.
        step = self._source.step(
            kind, self.training, metas, before_planning=self._communicator.settle
        )
        return step, self._pieces(step, tensors)

    @property
    def _same_batch(self) -> bool:
        """Whether to compare digests of the batch across ranks (global batches only, and not
        the pieces of a batch :meth:`step` has checked whole)."""
        if self._pieces_checked:
            return False
        return self.check_batches and self._device_mesh is not None and self.batch == "global"

    @property
    def _world(self) -> int:
        return self.cluster.world_size

    def _global_metas(self, metas: tuple[ir.TensorMeta, ...]) -> tuple[ir.TensorMeta, ...]:
        """The whole batch's shapes: ``metas`` themselves, or with ``batch="local"`` every
        rank's rows together (after checking, with ``check_batches``, that every rank was
        given rows of the same shapes: a mismatch would otherwise hang a collective)."""
        if self.batch == "global":
            return metas
        if self.check_batches and self._device_mesh is not None:
            everyone: list[Any] = [None] * self._world
            dist.all_gather_object(everyone, metas)
            differing = [r for r, theirs in enumerate(everyone) if theirs != metas]
            if differing:
                raise BatchError(
                    f"with batch='local' every rank passes rows of the same shapes, but rank "
                    f"{self.rank} has {[str(m) for m in metas]} and ranks {differing} have "
                    "others: use a sampler that gives every rank as many rows "
                    "(DistributedSampler pads or drops to make them equal)"
                )
        return tuple(global_rows(meta, self._world) for meta in metas)

    def _pieces(self, step: LoweredStep, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """This rank's piece of each batch tensor in the layout ``step`` wants. With
        ``batch="local"`` a tensor split on dim 0 over every mesh axis (rank order) is this
        rank's rows already; any other layout needs the whole tensor, gathered from every
        rank's rows first."""
        names = step.signature.inputs
        pieces = []
        for name, tensor in zip(names, tensors, strict=True):
            spec = step.specs[name]
            if self.batch == "local":
                if all(isinstance(p, Shard) and p.dim == 0 for p in spec):
                    pieces.append(tensor.to(self.device))
                    continue
                tensor = gather_rows(tensor, self._world, distributed=self._device_mesh is not None)
            # Cut where the batch is; only this rank's piece moves to its device.
            pieces.append(self._piece(step, name, tensor).to(self.device))
        return pieces

    def _piece(self, step: LoweredStep, name: str, full: torch.Tensor) -> torch.Tensor:
        return shard_tensor(full, step.specs[name], self.cluster.mesh_shape, self.coordinate)

    def _output(
        self, local: torch.Tensor, spec: Spec, meta: ir.TensorMeta, gather: bool
    ) -> torch.Tensor:
        """An output of a forward, from this rank's piece: whole, or as a DTensor."""
        if self._device_mesh is None:
            return local
        if not gather:
            return checkpoint.dtensor(local, self._device_mesh, spec, meta.shape)
        if all(isinstance(p, Replicate) for p in spec):
            return local
        whole = checkpoint.dtensor(local, self._device_mesh, spec, meta.shape).full_tensor()
        return whole.to(local.device)

    # -- state --------------------------------------------------------------------------------

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer, whole, under the model's own state_dict names (tied
        weights under each of their names). A collective: call it on every rank."""
        state = {}
        for name in self.signature.parameters + self.signature.buffers:
            full = self._full(name)
            for alias in self._aliases.get(name, (name,)):
                state[alias] = full
        return state

    def _full(self, name: str) -> torch.Tensor:
        local = self.parameters.get(name, self.buffers.get(name))
        assert local is not None
        if self._device_mesh is None:
            return local.clone()
        return self._as_dtensor(name, local).full_tensor().to(local.device)

    # -- layouts ------------------------------------------------------------------------------

    def _as_dtensor(self, name: str, local: torch.Tensor) -> Any:
        if self._device_mesh is None:
            return local
        return checkpoint.dtensor(
            local, self._device_mesh, self._state_specs[name], self._state_metas[name].shape
        )

    def __repr__(self) -> str:
        return (
            f"ParallelModel(rank {self.rank} at {self.coordinate} of {self.cluster}; "
            f"{len(self.parameters)} parameters, {self.steps} steps; {self.plan.summary()})"
        )


__all__ = ["ParallelModel"]
