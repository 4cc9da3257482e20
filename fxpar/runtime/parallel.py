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
import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

from fxpar import checkpoint, ir
from fxpar.cluster import Coordinate
from fxpar.errors import CheckpointError
from fxpar.ir.program import named_state, state_dict_aliases
from fxpar.ir.rng import RandomState
from fxpar.lowering import SPMDProgram
from fxpar.optim import Optimizer
from fxpar.planning.plan import Plan
from fxpar.runtime.batches import BatchSignature
from fxpar.runtime.collectives import OneDeviceCommunicator, ProcessGroupCommunicator
from fxpar.runtime.fingerprint import check_same_model
from fxpar.sharding import shard_tensor

logger = logging.getLogger(__name__)


class ParallelModel:
    """This rank's share of a model compiled by :func:`fxpar.compile`.

    Attributes:
        plan: the chosen plan (the same on every rank): strategies, costs, solver's answer.
        spmd: the per-rank programs and the specs of their inputs and outputs.
        rank, coordinate: this process's rank and its place in the mesh.
        program: this rank's GraphModule; its code is ``program.code``.
    """

    def __init__(
        self,
        plan: Plan,
        model: nn.Module,
        optimizer: Optimizer,
        device_mesh: Any,
        *,
        check_batches: bool = True,
    ) -> None:
        self.plan = plan
        self.cluster = plan.cluster
        self.spmd: SPMDProgram = plan.lower()
        self.signature = plan.program.signature
        self.optimizer_spec = optimizer
        self.check_batches = check_batches
        self._device_mesh = device_mesh
        self.rank = dist.get_rank() if device_mesh is not None else 0
        self.coordinate: Coordinate = self.cluster.coordinate(self.rank)
        self.program: fx.GraphModule = self.spmd.ranks[self.rank].graph_module
        self._communicator = (
            ProcessGroupCommunicator(device_mesh)
            if device_mesh is not None
            else OneDeviceCommunicator()
        )
        placeholders = plan.program.placeholders()
        self._specs = dict(zip(placeholders, self.spmd.input_specs, strict=True))
        self._metas = {name: ir.require(n, ir.ValueMeta).tensor for name, n in placeholders.items()}

        state = named_state(model)
        names = self.signature.parameters + self.signature.buffers
        self._aliases = state_dict_aliases(model, names)
        check_same_model(state, names)
        self.parameters: dict[str, torch.Tensor] = {}
        self.buffers: dict[str, torch.Tensor] = {}
        for name in names:
            full = self._broadcast(state[name].detach().clone())
            piece = self._local(name, full).clone()
            target = self.parameters if name in self.signature.parameters else self.buffers
            target[name] = piece
        self.trainable = [self.parameters[name] for name in self.signature.gradients]
        self.optimizer = optimizer.build(self.trainable)
        self.random = RandomState.from_rank_zero(distributed=device_mesh is not None)
        """The generator the step's random ops draw from, the same on every rank."""
        self.steps = 0

    @property
    def programs(self) -> tuple[fx.GraphModule, ...]:
        """Every rank's GraphModule, by rank."""
        return tuple(rank.graph_module for rank in self.spmd.ranks)

    # -- training ---------------------------------------------------------------------------

    def step(self, *batch: torch.Tensor, **named_batch: torch.Tensor) -> torch.Tensor:
        """One training step on the global batch: forward, backward, optimizer update.

        The batch is given whole and identically on every rank (model inputs, then loss
        targets, positionally or by name), shaped like the example it was compiled with; each
        rank takes its own piece. Returns the loss, a scalar, the same on every rank.
        """
        outputs = self._run(self._batch(batch, named_batch))
        gradients = outputs[1 : 1 + len(self.trainable)]
        for parameter, gradient in zip(self.trainable, gradients, strict=True):
            parameter.grad = gradient
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        updates = outputs[1 + len(self.trainable) :]
        for name, value in zip(self.signature.buffer_updates, updates, strict=True):
            self.buffers[name].copy_(value)
        self.steps += 1
        return outputs[0]

    def loss(self, *batch: torch.Tensor, **named_batch: torch.Tensor) -> torch.Tensor:
        """The loss of the current weights on a batch, changing nothing: random ops (dropout)
        draw what the next step will draw, and the random state is left where it was."""
        state = self.random.state
        try:
            return self._run(self._batch(batch, named_batch))[0]
        finally:
            self.random.state = state

    def _run(self, batch: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        inputs = [self.parameters[n] for n in self.signature.parameters]
        inputs += [self.buffers[n] for n in self.signature.buffers]
        # Random inputs are drawn whole on every rank, each keeping its piece (see fxpar.rng).
        step_inputs = [*batch, *self.random.draw(self.signature.random)]
        inputs += [
            self._local(name, tensor)
            for name, tensor in zip(self.signature.step_inputs, step_inputs, strict=True)
        ]
        with torch.no_grad():
            return tuple(self.program(self._communicator, *inputs))

    def _batch(
        self, batch: tuple[torch.Tensor, ...], named: Mapping[str, torch.Tensor]
    ) -> list[torch.Tensor]:
        names = self.signature.inputs
        expected = BatchSignature(names, tuple(self._metas[name] for name in names))
        check_ranks = self.check_batches and self._device_mesh is not None
        return expected.take(batch, named, check_ranks=check_ranks, rank=self.rank)

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
        return self._dtensor(name, local).full_tensor()

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write a sharded checkpoint (see :mod:`fxpar.checkpoint`): the parameters, buffers,
        optimizer state, step count and random state, each rank writing its own pieces. The
        save is atomic: the previous checkpoint at ``path`` stays until every rank has written
        the new one. A collective: call it on every rank."""
        distributed = self._device_mesh is not None
        checkpoint.save(
            self._checkpoint_state(include_missing=False), path, distributed=distributed
        )

    def load(self, path: str | os.PathLike[str], *, strict: bool = True) -> None:
        """Read a checkpoint written by :meth:`save` (or by a :class:`PipelineModel` of the
        same model), under this model's mesh and plan, which may differ from those it was
        saved with. With ``strict`` (the default) the checkpoint must hold exactly this
        model's entries; ``strict=False`` loads those both have. A collective: call it on
        every rank.

        Raises:
            CheckpointError: no committed checkpoint at ``path``, a damaged one, another
                model's (with ``strict``), or an entry of another shape.
        """
        distributed = self._device_mesh is not None
        state = self._checkpoint_state(include_missing=True)
        expected = checkpoint.Entries(self.signature, self.optimizer_spec)
        wanted = checkpoint.load(
            state, path, distributed=distributed, expected=expected, strict=strict
        )
        self.steps = checkpoint.restore_progress(wanted, self.steps, self.random)
        # Loads land in place in the local pieces (DTensors share their storage), except for
        # the plain tensors, which are copied back here.
        if not distributed:
            for key, value in wanted.items():
                if key.startswith(("model/", "optimizer/")):
                    self._checkpoint_tensor(key).copy_(value)

    def _checkpoint_state(self, *, include_missing: bool) -> dict[str, Any]:
        state: dict[str, Any] = checkpoint.progress_entries(self.steps, self.random)
        for name in self.signature.parameters + self.signature.buffers:
            state[f"model/{name}"] = self._dtensor(name, self._checkpoint_tensor(f"model/{name}"))
        trainable = dict(zip(self.signature.gradients, self.trainable, strict=True))
        state.update(
            checkpoint.optimizer_entries(
                trainable, self.optimizer, self.optimizer_spec, self._dtensor,
                include_missing=include_missing,
            )
        )  # fmt: skip
        if self._device_mesh is None:
            state = {
                key: v.clone() if isinstance(v, torch.Tensor) else v for key, v in state.items()
            }
        return state

    def _checkpoint_tensor(self, key: str) -> torch.Tensor:
        kind, _, rest = key.partition("/")
        if kind == "model":
            return self.parameters.get(rest, self.buffers.get(rest))  # type: ignore[return-value]
        if kind == "optimizer":
            name, _, slot = rest.rpartition("/")
            parameter = self.trainable[self.signature.gradients.index(name)]
            return self.optimizer.state[parameter][slot]
        raise CheckpointError(f"unexpected checkpoint entry {key!r}")

    # -- layouts ------------------------------------------------------------------------------

    def _local(self, name: str, full: torch.Tensor) -> torch.Tensor:
        return shard_tensor(full, self._specs[name], self.cluster.mesh_shape, self.coordinate)

    def _dtensor(self, name: str, local: torch.Tensor) -> Any:
        if self._device_mesh is None:
            return local
        return checkpoint.dtensor(
            local, self._device_mesh, self._specs[name], self._metas[name].shape
        )

    def _broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._device_mesh is not None:
            dist.broadcast(tensor, src=0)
        return tensor

    def __repr__(self) -> str:
        return (
            f"ParallelModel(rank {self.rank} at {self.coordinate} of {self.cluster}; "
            f"{len(self.parameters)} parameters, {self.steps} steps; {self.plan.summary()})"
        )


__all__ = ["ParallelModel"]
