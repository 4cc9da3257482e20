"""Gradient clipping by the global norm over gradients sharded and replicated across ranks.

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

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from fxpar.optim import check_clip_arguments


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
        dist.all_reduce(total, op=dist.ReduceOp.MAX if infinite else dist.ReduceOp.SUM)
    norm = (total if infinite else total.pow(1.0 / norm_type)).to(dtype)
    coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for piece, _ in pieces:
        piece.mul_(coefficient.to(piece.dtype))
    return norm


__all__ = ["clip_grad_norm_"]
