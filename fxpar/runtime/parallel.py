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
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn
from torch.distributed.tensor import Shard

from fxpar import checkpoint, ir
from fxpar.cluster import Coordinate
from fxpar.errors import BatchError, CheckpointError, FxparError
from fxpar.ir.program import named_state, state_dict_aliases
from fxpar.ir.rng import RandomState
from fxpar.lowering import SPMDProgram
from fxpar.optim import Optimizer
from fxpar.planning.plan import Plan
from fxpar.runtime.batches import BatchSignature
from fxpar.runtime.collectives import OneDeviceCommunicator, ProcessGroupCommunicator
from fxpar.runtime.fingerprint import check_same_model
from fxpar.sharding import Spec, shard_tensor

logger = logging.getLogger(__name__)

Replan = Callable[[Sequence[torch.Tensor], Mapping[str, Spec]], Plan]
"""Plans the step again for a batch of other shapes (its tensors, in the Program's order),
keeping every parameter and buffer in the spec given: :func:`fxpar.compile` makes one."""


class ParallelModel:
    """This rank's share of a model compiled by :func:`fxpar.compile`.

    A batch of other shapes than the example's (a short last batch, another sequence length)
    is planned on first sight, with every parameter and buffer kept in its layout, and that
    plan is kept for the next batch of those shapes; ``plan``, ``spmd`` and ``program`` are
    those of the shapes last run.

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
        replan: Replan | None = None,
    ) -> None:
        self.cluster = plan.cluster
        self.optimizer_spec = optimizer
        self.check_batches = check_batches
        self._device_mesh = device_mesh
        self._replan = replan
        self.rank = dist.get_rank() if device_mesh is not None else 0
        self.coordinate: Coordinate = self.cluster.coordinate(self.rank)
        self._communicator = (
            ProcessGroupCommunicator(device_mesh)
            if device_mesh is not None
            else OneDeviceCommunicator()
        )
        self._adopt(plan, plan.lower())
        self._compiled = {self._batch_signature().metas: (self.plan, self.spmd)}

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

    def _adopt(self, plan: Plan, spmd: SPMDProgram) -> None:
        """Run steps by ``plan``, lowered as ``spmd`` (one of them per batch shape)."""
        self.plan = plan
        self.spmd = spmd
        self.signature = plan.program.signature
        self.program: fx.GraphModule = spmd.ranks[self.rank].graph_module
        placeholders = plan.program.placeholders()
        self._specs = _input_specs(plan, spmd)
        self._metas = {name: ir.require(n, ir.ValueMeta).tensor for name, n in placeholders.items()}

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
        """One training step on the global batch: forward, backward, optimizer update.

        The batch is given whole and identically on every rank (model inputs, then loss
        targets, positionally or by name), shaped like the example it was compiled with; each
        rank takes its own piece. Returns the loss, a scalar, the same on every rank.

        ``max_grad_norm``: clip the gradients to this global norm first
        (:meth:`clip_grad_norm_`). ``accumulate``: the batch is ``accumulate`` compiled batches
        stacked on dim 0; each is run in turn (:meth:`backward` with ``scale=1/accumulate``)
        before one update, which equals one step on the whole batch for a loss that is a mean
        over equal pieces (the returned loss is the mean of the pieces' losses).
        """
        if accumulate < 1:
            raise FxparError(f"accumulate must be at least 1, got {accumulate}")
        losses = [
            self.backward(*piece, scale=1.0 / accumulate, **named_piece)
            for piece, named_piece in _pieces(batch, named_batch, accumulate)
        ]
        if max_grad_norm is not None:
            self.clip_grad_norm_(max_grad_norm)
        self.optimizer_step()
        self.zero_grad()
        return torch.stack(losses).mean() if accumulate > 1 else losses[0]

    def backward(
        self, *batch: torch.Tensor, scale: float = 1.0, **named_batch: torch.Tensor
    ) -> torch.Tensor:
        """Forward and backward on a batch (as :meth:`step` takes it), without an update: this
        rank's pieces of the gradients, times ``scale``, are added to the parameters' ``.grad``
        (so calls accumulate, as ``loss.backward()`` does, until :meth:`zero_grad`), and the new
        buffer values are stored. Returns the loss. The gradients are reduced inside each call;
        with ``scale=1/k``, k calls on the pieces of a batch accumulate the gradient of the
        mean loss over the whole batch."""
        outputs = self._run(self._batch(batch, named_batch))
        gradients = outputs[1 : 1 + len(self.trainable)]
        for parameter, gradient in zip(self.trainable, gradients, strict=True):
            if scale != 1.0:
                gradient = gradient * scale
            if parameter.grad is None:
                parameter.grad = gradient
            else:
                parameter.grad.add_(gradient)
        updates = outputs[1 + len(self.trainable) :]
        for name, value in zip(self.signature.buffer_updates, updates, strict=True):
            self.buffers[name].copy_(value)
        return outputs[0]

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale the accumulated gradients so that their global norm is at most ``max_norm``,
        as :func:`torch.nn.utils.clip_grad_norm_` does on one device; returns the norm before
        clipping, the same on every rank.

        The norm is exact over the whole model: each rank sums its pieces, a piece that is
        replicated over some mesh axes counts once for all its copies, and one all-reduce over
        every rank adds the sums (a maximum for ``norm_type=inf``). A collective: call it on
        every rank."""
        if max_norm < 0 or norm_type <= 0:
            raise FxparError(
                f"clip_grad_norm_ needs max_norm >= 0 and norm_type > 0, got {max_norm} and "
                f"{norm_type}"
            )
        named = [
            (name, p.grad)
            for name, p in zip(self.signature.gradients, self.trainable, strict=True)
            if p.grad is not None
        ]
        if not named:
            return torch.tensor(0.0)
        dtype = named[0][1].dtype
        infinite = math.isinf(norm_type)
        total = torch.zeros((), dtype=torch.float64)
        for name, grad in named:
            local = grad.detach().to(torch.float64).abs()
            if infinite:
                total = torch.maximum(total, local.max() if local.numel() else total)
            else:
                copies = self._copies(name)
                total = total + local.pow(norm_type).sum() / copies
        if self._device_mesh is not None:
            op = dist.ReduceOp.MAX if infinite else dist.ReduceOp.SUM
            dist.all_reduce(total, op=op)
        norm = (total if infinite else total.pow(1.0 / norm_type)).to(dtype)
        coefficient = torch.clamp(max_norm / (norm.to(torch.float64) + 1e-6), max=1.0)
        for _, grad in named:
            grad.mul_(coefficient.to(grad.dtype))
        return norm

    def optimizer_step(self) -> None:
        """Update the parameters from their accumulated gradients (this rank's pieces)."""
        self.optimizer.step()
        self.steps += 1

    def zero_grad(self) -> None:
        """Forget the accumulated gradients."""
        self.optimizer.zero_grad(set_to_none=True)

    def _copies(self, name: str) -> int:
        """How many ranks hold the same piece of parameter ``name``: the sizes of the mesh axes
        it is replicated over."""
        spec = self._specs[name]
        return math.prod(
            size
            for size, placement in zip(self.cluster.mesh_shape, spec, strict=True)
            if not isinstance(placement, Shard)
        )

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
        expected = self._batch_signature()
        check_ranks = self.check_batches and self._device_mesh is not None
        given = expected.given(batch, named)
        if self._replan is not None and given is not None and given != expected.metas:
            self._use_shapes(BatchSignature(expected.names, given), batch, named, check_ranks)
            expected = self._batch_signature()
        return expected.take(batch, named, check_ranks=check_ranks, rank=self.rank)

    def _batch_signature(self) -> BatchSignature:
        names = self.signature.inputs
        return BatchSignature(names, tuple(self._metas[name] for name in names))

    def _use_shapes(
        self,
        signature: BatchSignature,
        batch: tuple[torch.Tensor, ...],
        named: Mapping[str, torch.Tensor],
        check_ranks: bool,
    ) -> None:
        """Switch to the plan for a batch of other shapes, planned on first sight (on every
        rank together: the ranks first check that they hold the same batch) with every
        parameter and buffer pinned to the layout it has, so that no state moves."""
        if signature.metas not in self._compiled:
            assert self._replan is not None
            tensors = signature.take(batch, named, check_ranks=check_ranks, rank=self.rank)
            state = self.signature.parameters + self.signature.buffers
            kept = {name: self._specs[name] for name in state}
            plan = self._replan(tensors, kept)
            spmd = plan.lower()
            specs = _input_specs(plan, spmd)
            moved = [name for name in state if specs.get(name) != kept[name]]
            if moved:
                raise FxparError(
                    f"the plan for batch shapes {list(signature.metas)} lays out "
                    f"{moved[:3]} differently from the plan being trained, and state does not "
                    "move between plans: use a solver (pins keep the layout) rather than a "
                    "manual plan or a fixed choose-strategies pass for varying shapes"
                )
            logger.info("planned a step for batch shapes %s", list(signature.metas))
            self._compiled[signature.metas] = (plan, spmd)
        self._adopt(*self._compiled[signature.metas])

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

    def save(self, path: str | os.PathLike[str], *, extra: object = None) -> None:
        """Write a sharded checkpoint (see :mod:`fxpar.checkpoint`): the parameters, buffers,
        optimizer state and hyperparameters (the learning rate a scheduler set), step count and
        random state, each rank writing its own pieces, and ``extra``, any picklable state of
        yours (``{"scheduler": scheduler.state_dict(), "data": position}``), which :meth:`load`
        returns. The save is atomic: the previous checkpoint at ``path`` stays until every rank
        has written the new one. A collective: call it on every rank."""
        distributed = self._device_mesh is not None
        state = self._checkpoint_state(include_missing=False)
        state.update(
            checkpoint.object_entries(self.optimizer, extra, rank=self.rank, loading=False)
        )
        checkpoint.save(state, path, distributed=distributed)

    def load(self, path: str | os.PathLike[str], *, strict: bool = True) -> Any:
        """Read a checkpoint written by :meth:`save` (or by a :class:`PipelineModel` of the
        same model), under this model's mesh and plan, which may differ from those it was
        saved with. With ``strict`` (the default) the checkpoint must hold exactly this
        model's entries; ``strict=False`` loads those both have. Returns the ``extra`` given
        to :meth:`save` (None if none). A collective: call it on every rank.

        Raises:
            CheckpointError: no committed checkpoint at ``path``, a damaged one, another
                model's (with ``strict``), or an entry of another shape.
        """
        distributed = self._device_mesh is not None
        state = self._checkpoint_state(include_missing=True)
        state.update(checkpoint.object_entries(self.optimizer, None, rank=self.rank, loading=True))
        expected = checkpoint.Entries(self.signature, self.optimizer_spec)
        wanted = checkpoint.load(
            state, path, distributed=distributed, expected=expected, strict=strict
        )
        self.steps = checkpoint.restore_progress(wanted, self.steps, self.random)
        extra = checkpoint.restore_objects(wanted, self.optimizer, path)
        # Loads land in place in the local pieces (DTensors share their storage), except for
        # the plain tensors, which are copied back here.
        if not distributed:
            for key, value in wanted.items():
                if key.startswith(("model/", "optimizer/")):
                    self._checkpoint_tensor(key).copy_(value)
        return extra

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


def _input_specs(plan: Plan, spmd: SPMDProgram) -> dict[str, Spec]:
    """The spec each placeholder of ``plan`` arrives in on a rank, by name."""
    return dict(zip(plan.program.placeholders(), spmd.input_specs, strict=True))


def _pieces(
    batch: tuple[torch.Tensor, ...], named: Mapping[str, torch.Tensor], count: int
) -> list[tuple[tuple[torch.Tensor, ...], dict[str, torch.Tensor]]]:
    """``count`` equal pieces of a batch along dim 0 (the whole batch when ``count`` is 1)."""
    if count == 1:
        return [(batch, dict(named))]
    tensors = [*batch, *named.values()]
    sizes = {t.shape[0] if t.dim() else None for t in tensors}
    if len(sizes) != 1 or None in sizes or next(iter(sizes)) % count:  # type: ignore[operator]
        shapes = [tuple(t.shape) for t in tensors]
        raise BatchError(
            f"accumulate={count} splits the batch into {count} equal pieces on dim 0, but the "
            f"batch tensors have shapes {shapes}: pass {count} compiled batches stacked on dim 0"
        )
    split = [t.chunk(count) for t in batch]
    split_named = {key: t.chunk(count) for key, t in named.items()}
    return [
        (tuple(s[i] for s in split), {key: s[i] for key, s in split_named.items()})
        for i in range(count)
    ]


__all__ = ["ParallelModel"]
