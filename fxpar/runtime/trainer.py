"""``Trainer``: what every compiled model does the same way, whatever runs its step.

:class:`~fxpar.runtime.parallel.ParallelModel` (one SPMD program per rank) and
:class:`~fxpar.pipeline.PipelineModel` (a stage of a pipeline per rank) differ in how a step
runs and in which rank holds which piece of the state. Everything else is written once here:

- the loop: :meth:`Trainer.step` is :meth:`backward` on ``accumulate`` pieces (all but the
  last under :meth:`no_sync`), :meth:`clip_grad_norm_`, :meth:`optimizer_step` and
  :meth:`zero_grad` (:func:`fxpar.runtime.loop.one_step`);
- gradients kept unreduced inside :meth:`no_sync`, added to ``.grad`` once reduced;
- the train/eval mode calls run in;
- clipping by the global norm, each rank weighing its pieces (:meth:`_norm_weight`);
- sharded checkpoints (:meth:`save`, :meth:`load`), each rank writing and reading its own
  pieces as DTensors (:meth:`_as_dtensor`).

A subclass sets the attributes listed in :class:`Trainer` and implements :meth:`backward`,
:meth:`_sync_gradients`, :meth:`_norm_weight` and :meth:`_as_dtensor`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any, Literal, overload

import torch
from torch.distributed.tensor import DTensor

from fxpar import checkpoint, checkpoint_objects
from fxpar.ir.program import Signature
from fxpar.ir.rng import RandomState
from fxpar.optim import Optimizer
from fxpar.runtime.loop import clip_grad_norm_, one_step


class Trainer:
    """The training loop, mode and checkpoints a compiled model shares with every other.

    Attributes:
        parameters, buffers: this rank's pieces of the parameters and buffers it holds, by
            name.
        optimizer: the ``torch.optim`` optimizer over this rank's trainable pieces.
        optimizer_spec: the :class:`fxpar.optim.Optimizer` it was built from.
        random: the generator the step's random ops draw from, the same on every rank.
        steps: the optimizer updates taken (saved and restored by checkpoints).
        training: whether calls run the model in train mode (as ``nn.Module.training``).
        grad_norm: the global gradient norm before clipping of the last :meth:`step` given
            ``max_grad_norm`` (or of the last :meth:`clip_grad_norm_`), else None.
        signature: the training Program's signature (every parameter and buffer by name).
        rank: this process's rank.
    """

    parameters: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    optimizer: torch.optim.Optimizer
    optimizer_spec: Optimizer
    random: RandomState
    steps: int
    training: bool
    signature: Signature
    rank: int
    grad_norm: torch.Tensor | None = None
    _trainable: list[str]
    """The names of the parameters this rank updates, in the optimizer's order."""
    _gradient_dtype: torch.dtype
    _syncing: bool = True
    _distributed: bool
    _saves: checkpoint.BackgroundSaves | None = None
    """The checkpoints being written in the background (made on the first)."""
    _mesh_copies: bool = False
    """Whether the DTensors of checkpoints hold copies of the pieces, not the pieces."""
    """Whether the state is sharded over processes (DTensors in checkpoints, collectives)."""

    # -- what a subclass implements ---------------------------------------------------------

    def backward(
        self, *batch: torch.Tensor, scale: float = 1.0, **named_batch: torch.Tensor
    ) -> torch.Tensor:
        """Forward and backward on a batch, adding ``scale`` times this rank's gradients to
        ``.grad`` (kept unreduced inside :meth:`no_sync`); returns the loss."""
        raise NotImplementedError

    def _sync_gradients(self) -> None:
        """Reduce every gradient kept unreduced by :meth:`no_sync` and add it to ``.grad``."""
        raise NotImplementedError

    def _forget_unsynced(self) -> None:
        """Drop the gradients kept unreduced by :meth:`no_sync`."""
        raise NotImplementedError

    def _norm_weight(self, name: str) -> float:
        """How much this rank's piece of parameter ``name``'s gradient counts in the global
        norm: 1 for a piece it alone counts, ``1/c`` for one of ``c`` identical copies, 0 for
        one another rank counts (see :mod:`fxpar.runtime.loop`)."""
        raise NotImplementedError

    def _as_dtensor(self, name: str, local: torch.Tensor) -> Any:
        """This rank's piece ``local`` of parameter or buffer ``name`` as a checkpoint entry:
        a DTensor over the processes sharing it (the tensor itself on one process)."""
        raise NotImplementedError

    # -- the loop ---------------------------------------------------------------------------

    def step(
        self,
        *batch: torch.Tensor,
        max_grad_norm: float | None = None,
        accumulate: int = 1,
        **named_batch: torch.Tensor,
    ) -> torch.Tensor:
        """One training step: forward, backward, optimizer update. Returns the loss, a
        scalar, the same on every rank.

        The batch is the model inputs then the loss targets, positionally or by name. Its
        shapes may differ from the example's: a step of new shapes is planned on first sight
        and kept. ``max_grad_norm``: clip the gradients to this global norm first
        (:meth:`clip_grad_norm_`); the norm before clipping is then :attr:`grad_norm`.
        ``accumulate``: the batch is ``accumulate`` equal pieces stacked on dim 0; each is
        run in turn (:meth:`backward` with ``scale=1/accumulate``, all but the last under
        :meth:`no_sync`) before one update, which equals one step on the whole batch for a
        loss that is a mean over equal pieces (the returned loss is the mean of the pieces'
        losses). A collective: call it on every rank.

        Raises:
            FxparError: ``accumulate`` is not a whole number of at least 1, or
                ``max_grad_norm`` is negative.
            BatchError: the batch does not cut into ``accumulate`` equal pieces, or does not
                bind to the model's inputs.
        """
        self.grad_norm = None
        return one_step(
            self, batch, named_batch, max_grad_norm=max_grad_norm, accumulate=accumulate
        )

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Within the block, :meth:`backward` keeps each gradient where the backward made it
        instead of reducing it (as DistributedDataParallel's ``no_sync`` does); the next
        :meth:`backward` outside the block (or :meth:`clip_grad_norm_` or
        :meth:`optimizer_step`) reduces the sum of all of them at once. Gradient accumulation
        then communicates once per update, not once per micro-batch (``step(accumulate=k)``
        does this for you). Gradients that end smaller than they are made (fully sharded
        plans) are still reduced in every backward, so memory never grows."""
        previous, self._syncing = self._syncing, False
        try:
            yield
        finally:
            self._syncing = previous

    def _add_gradient(self, name: str, gradient: torch.Tensor) -> None:
        parameter = self.parameters[name]
        if parameter.grad is None:
            parameter.grad = gradient
        else:
            parameter.grad.add_(gradient)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale the accumulated gradients (``.grad``) so that their global norm is at most
        ``max_norm``, as :func:`torch.nn.utils.clip_grad_norm_` does on one device for the
        whole model; returns the norm before clipping, the same on every rank (and keeps it as
        :attr:`grad_norm`).

        The norm is exact over the whole model: every element of every gradient is counted
        once, whichever ranks hold copies of it, and one all-reduce over every rank adds the
        counted sums (takes their maximum for ``norm_type=inf``). A collective: call it on
        every rank.

        Raises:
            FxparError: ``max_norm`` is negative or ``norm_type`` not positive.
        """
        self._sync_gradients()
        pieces = [
            (grad, self._norm_weight(name))
            for name in self._trainable
            if (grad := self.parameters[name].grad) is not None
        ]
        self.grad_norm = clip_grad_norm_(
            pieces, max_norm, norm_type, dtype=self._gradient_dtype,
            distributed=self._distributed,
        )  # fmt: skip
        return self.grad_norm

    def optimizer_step(self) -> None:
        """Update this rank's parameters from their accumulated ``.grad``, reducing first any
        gradients kept unreduced by :meth:`no_sync`."""
        self._sync_gradients()
        self.optimizer.step()
        self.steps += 1

    def zero_grad(self) -> None:
        """Forget the accumulated gradients (``.grad`` becomes None, and those kept
        unreduced by :meth:`no_sync` are dropped)."""
        self._forget_unsynced()
        self.optimizer.zero_grad(set_to_none=True)

    # -- mode -------------------------------------------------------------------------------

    def train(self, mode: bool = True) -> Any:
        """Run later calls in train mode (or eval mode with False), as ``nn.Module.train``
        does: dropout on, BatchNorm normalizing by the batch and updating its statistics.
        Programs of the other mode are captured and planned on first use, over the same
        state. Returns the model."""
        self.training = bool(mode)
        return self

    def eval(self) -> Any:
        """Run later calls in eval mode: dropout off, BatchNorm using its running statistics.
        :meth:`step` still trains (the model as it behaves in eval mode), as PyTorch allows.
        Returns the model."""
        return self.train(False)

    # -- checkpoints ------------------------------------------------------------------------

    @overload
    def save(
        self, path: str | os.PathLike[str], *, extra: object = None, blocking: Literal[True] = True
    ) -> None: ...

    @overload
    def save(
        self, path: str | os.PathLike[str], *, extra: object = None, blocking: Literal[False]
    ) -> checkpoint.PendingSave: ...

    def save(
        self, path: str | os.PathLike[str], *, extra: object = None, blocking: bool = True
    ) -> checkpoint.PendingSave | None:
        """Write a sharded checkpoint (see :mod:`fxpar.checkpoint`): the parameters, buffers,
        optimizer state and hyperparameters (the learning rate a scheduler set), step count and
        random state, each rank writing its own pieces under the model's own names, and
        ``extra``, any picklable state of yours (``{"scheduler": scheduler.state_dict(),
        "data": position}``), which :meth:`load` returns. It loads into any
        :class:`~fxpar.runtime.parallel.ParallelModel` or :class:`~fxpar.pipeline.PipelineModel`
        of the same model, whatever its mesh, plan or stages. The save is atomic: the previous
        checkpoint at ``path`` stays until every rank has written the new one. A collective:
        call it on every rank.

        ``blocking=False``: copy this rank's state to host memory now and return a
        :class:`~fxpar.checkpoint.PendingSave` while a background thread writes and commits
        the copy, so training goes on meanwhile and the checkpoint holds the state as it was
        at this call. Its ``wait()`` returns once the checkpoint is committed, or raises the
        save's :class:`~fxpar.errors.CheckpointError` (a failed save commits nothing). One
        save is written at a time: a save or load while one is in flight waits for it first,
        and raises its failure if no ``wait()`` has. Wait for the last save before ending the
        process group.

        Raises:
            CheckpointError: the save failed (``blocking``), or a background save before it
                failed unreported.
        """
        self._background_saves().finish()
        state = self._checkpoint_state(include_missing=False)
        state.update(
            checkpoint_objects.object_entries(self.optimizer, extra, rank=self.rank, loading=False)
        )
        if not blocking:
            return self._background_saves().start(state, path, distributed=self._distributed)
        checkpoint.save(state, path, distributed=self._distributed)
        return None

    def _background_saves(self) -> checkpoint.BackgroundSaves:
        if self._saves is None:
            self._saves = checkpoint.BackgroundSaves()
        return self._saves

    def load(
        self, path: str | os.PathLike[str], *, strict: bool = True, trusted: bool = False
    ) -> Any:
        """Read a checkpoint written by :meth:`save` (by this kind of model or the other),
        under this model's mesh, plan and stages, which may differ from those it was saved
        with: each rank reads only the pieces it holds. With ``strict`` (the default) the
        checkpoint must hold exactly this model's entries; ``strict=False`` loads those both
        have. Returns the ``extra`` given to :meth:`save` (None if none). Loading runs no
        code from the files: ``extra`` and the hyperparameters may hold tensors, numbers,
        strings, lists, tuples and dicts, and anything else is refused unless ``trusted``
        (see :mod:`fxpar.checkpoint`). A collective: call it on every rank.

        Raises:
            CheckpointError: no committed checkpoint at ``path``, a damaged one, another
                model's (with ``strict``), an entry of another shape, or, without
                ``trusted``, an ``extra`` holding objects other than plain data.
        """
        self._background_saves().finish()
        state = self._checkpoint_state(include_missing=True)
        state.update(
            checkpoint_objects.object_entries(self.optimizer, None, rank=self.rank, loading=True)
        )
        expected = checkpoint.Entries(self.signature, self.optimizer_spec)
        wanted = checkpoint.load(
            state, path, distributed=self._distributed, expected=expected, strict=strict
        )
        self.steps = checkpoint.restore_progress(wanted, self.steps, self.random)
        extra = checkpoint_objects.restore_objects(wanted, self.optimizer, path, trusted=trusted)
        # Loads land in place in the local pieces (DTensors share their storage), except for
        # the plain tensors of one process and the host copies of a GPU's pieces (over
        # gloo), loaded into copies and copied back here.
        if not self._distributed or self._mesh_copies:
            for key, value in wanted.items():
                kind, _, rest = key.partition("/")
                if isinstance(value, DTensor):
                    value = value.to_local()
                if kind == "model":
                    self._held(rest).copy_(value)
                elif kind == "optimizer":
                    name, _, slot = rest.rpartition("/")
                    self.optimizer.state[self.parameters[name]][slot].copy_(value)
        return extra

    def _held(self, name: str) -> torch.Tensor:
        """This rank's piece of parameter or buffer ``name``."""
        held = self.parameters.get(name)
        return held if held is not None else self.buffers[name]

    def _checkpoint_state(self, *, include_missing: bool) -> dict[str, Any]:
        state: dict[str, Any] = checkpoint.progress_entries(self.steps, self.random)
        for name, tensor in {**self.parameters, **self.buffers}.items():
            state[f"model/{name}"] = self._as_dtensor(name, tensor)
        trainable = {name: self.parameters[name] for name in self._trainable}
        state.update(
            checkpoint.optimizer_entries(
                trainable, self.optimizer, self.optimizer_spec, self._as_dtensor,
                include_missing=include_missing,
            )
        )  # fmt: skip
        if not self._distributed and include_missing:
            # A load fills copies, copied back once read (see load); a save reads the pieces
            # themselves (one in the background copies them first).
            state = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
        return state


__all__ = ["Trainer"]
