"""The parts of the training loop that :class:`~fxpar.runtime.parallel.ParallelModel` and
:class:`~fxpar.pipeline.PipelineModel` share: the one-call step (:func:`one_step`) made of
their ``backward``, ``no_sync``, ``clip_grad_norm_``, ``optimizer_step`` and ``zero_grad``, and
gradient clipping by the global norm over gradients sharded and replicated across ranks.

``torch.nn.utils.clip_grad_norm_`` on one device takes the norm of every gradient together. On
ranks that each hold pieces of the gradients, some pieces whole copies of others (a parameter
replicated over a mesh axis, a pipeline stage's replicas, a tied weight held by two stages),
that norm is exact only if every element is counted once: each rank weighs its pieces (1 for a
piece it alone counts, ``1/c`` for one of ``c`` identical copies, 0 for one another rank
counts), and one all-reduce over every rank adds the weighted sums (takes the maximum, for the
infinity norm). :class:`~fxpar.runtime.parallel.ParallelModel` and
:class:`~fxpar.pipeline.PipelineModel` differ only in how they weigh their pieces.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping, Sequence
from typing import Protocol

import torch
import torch.distributed as dist

from fxpar.optim import check_clip_arguments
from fxpar.runtime.batches import split_batch
from fxpar.runtime.devices import for_collective


class Trainable(Protocol):
    """What :func:`one_step` drives: a compiled model's loop, one call at a time."""

    def backward(
        self, *batch: torch.Tensor, scale: float = 1.0, **named: torch.Tensor
    ) -> torch.Tensor: ...

    def no_sync(self) -> contextlib.AbstractContextManager[None]: ...

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor: ...

    def optimizer_step(self) -> None: ...

    def zero_grad(self) -> None: ...


def one_step(
    model: Trainable,
    batch: Sequence[torch.Tensor],
    named: Mapping[str, torch.Tensor],
    *,
    max_grad_norm: float | None,
    accumulate: object,
) -> torch.Tensor:
    """``model``'s ``step``: the batch cut into ``accumulate`` equal pieces on dim 0, each
    run by ``backward`` with ``scale=1/accumulate`` (all but the last under ``no_sync``, so
    the gradients are reduced once), then clipping to ``max_grad_norm``, the update and
    ``zero_grad``. Returns the mean of the pieces' losses.

    Raises:
        FxparError: ``accumulate`` not a whole number of at least 1, a negative
            ``max_grad_norm``.
        BatchError: the batch does not cut into ``accumulate`` equal pieces.
    """
    if max_grad_norm is not None:
        check_clip_arguments(max_grad_norm, 2.0)
    pieces = split_batch(batch, named, accumulate)
    weight = 1.0 / len(pieces)
    losses = []
    with model.no_sync():
        for piece, named_piece in pieces[:-1]:
            losses.append(model.backward(*piece, scale=weight, **named_piece))
    piece, named_piece = pieces[-1]
    losses.append(model.backward(*piece, scale=weight, **named_piece))
    if max_grad_norm is not None:
        model.clip_grad_norm_(max_grad_norm)
    model.optimizer_step()
    model.zero_grad()
    return torch.stack(losses).mean() if len(losses) > 1 else losses[0]


def clip_grad_norm_(
    pieces: Sequence[tuple[torch.Tensor, float]],
    max_norm: float,
    norm_type: float,
    *,
    dtype: torch.dtype,
    distributed: bool,
) -> torch.Tensor:
    """Scale every gradient piece of ``pieces`` (``(piece, weight)`` pairs, see the module
    docstring) so that the global norm is at most ``max_norm``, and return the norm before
    clipping, in ``dtype`` (the gradients'), the same on every rank. The clip coefficient is
    computed as torch computes it, from the norm in ``dtype``. With ``distributed`` this is a
    collective over the default process group (one all-reduce): call it on every rank, with
    or without pieces of its own.

    Raises:
        FxparError: ``max_norm`` negative or ``norm_type`` not positive.
    """
    check_clip_arguments(max_norm, norm_type)
    infinite = math.isinf(norm_type)
    total = torch.zeros((), dtype=torch.float64)
    for piece, weight in pieces:
        if weight == 0 or not piece.numel():
            continue
        local = piece.detach().to(torch.float64).abs()
        if infinite:
            total = torch.maximum(total, local.max())
        else:
            total = total + local.pow(norm_type).sum() * weight
    if distributed:
        device = total.device
        total = for_collective(total)
        dist.all_reduce(total, op=dist.ReduceOp.MAX if infinite else dist.ReduceOp.SUM)
        total = total.to(device)
    norm = (total if infinite else total.pow(1.0 / norm_type)).to(dtype)
    coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for piece, _ in pieces:
        piece.mul_(coefficient.to(piece.dtype))
    return norm


__all__ = ["Trainable", "clip_grad_norm_", "one_step"]
