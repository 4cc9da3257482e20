"""How calibration runs what it times (:mod:`fxpar.runtime.calibration`): a runner for each
kind of operation, made once with its tensors, and the timing of its repeats as a step would
meet them (:func:`typical_seconds`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from fxpar.runtime import waiting
from fxpar.runtime.communicators import ProcessGroupCommunicator
from fxpar.runtime.devices import for_collective, synchronize

if TYPE_CHECKING:
    from fxpar.runtime.calibration import CalibrationOptions, Timing

ALL_REDUCE, MATMUL, COPY = "all_reduce", "matmul", "copy"
ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL = "all_gather", "reduce_scatter", "all_to_all"
SEND = "send"
OWN_LINKS = (ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL, SEND)
"""The kinds timed apart from the all-reduce, each fitted a link of its own."""


def runner(
    timing: Timing,
    communicator: ProcessGroupCommunicator,
    group: ProcessGroup | None,
    options: CalibrationOptions,
    device: torch.device,
) -> Callable[[], object]:
    """A function that runs ``timing``'s operation once on ``device``, its tensors made
    beforehand (on ``group``, the process group of its mesh axis, for communication)."""
    dtype = options.dtype
    if timing.axis is not None:
        # Zeros stay zeros however often they are summed: no overflow, no denormals.
        zeros = torch.zeros(timing.nbytes // dtype.itemsize, dtype=dtype, device=device)
        # Where the backend reads it (host memory for gloo, as the runtime stages it).
        buffer = for_collective(zeros, group)
        return _communication(timing.operation, timing.axis, buffer, communicator, group)
    if timing.operation == MATMUL:
        size = options.matmul_size
        left = torch.randn(size, size, dtype=dtype, device=device)
        right = torch.randn(size, size, dtype=dtype, device=device)
        product = torch.empty(size, size, dtype=dtype, device=device)
        return lambda: torch.mm(left, right, out=product)
    source = torch.ones(timing.nbytes // 2 // dtype.itemsize, dtype=dtype, device=device)
    target = torch.empty_like(source)
    return lambda: target.copy_(source)


def _communication(
    operation: str,
    axis: int,
    local: torch.Tensor,
    communicator: ProcessGroupCommunicator,
    group: ProcessGroup | None,
) -> Callable[[], object]:
    """A function that runs ``operation`` on ``local`` once along mesh axis ``axis``, as the
    per-rank programs run it: the all-reduce waited on as the runtime waits (polling small
    transfers, so the latency fitted is the one the programs see), the other collectives a
    call of the runtime's communicator on tensor dim 0 (output made and waited for by it)."""
    if operation == ALL_REDUCE:
        return lambda: waiting.all_reduce(local, group)
    if operation == ALL_GATHER:
        return lambda: communicator.all_gather(local, 0, axis)
    if operation == REDUCE_SCATTER:
        return lambda: communicator.reduce_scatter(local, 0, axis)
    if operation == SEND:
        return _send_runner(local, group)
    return lambda: communicator.all_to_all(local, 0, 0, axis)


def _send_runner(local: torch.Tensor, group: ProcessGroup | None) -> Callable[[], object]:
    """Every rank of the first half of the axis' group sends ``local`` to its peer in the
    second half, which receives it, all pairs at once, as a pipeline's stages pass activations
    (``isend`` and ``irecv``, waited for as :mod:`fxpar.pipeline.executor` waits); a rank
    left over in a group of an odd size idles."""
    ranks = dist.get_process_group_ranks(group) if group is not None else [dist.get_rank()]
    index, half = ranks.index(dist.get_rank()), len(ranks) // 2
    if index < half:
        peer = ranks[index + half]
        return lambda: _finish(dist.isend(local, peer))
    if index < 2 * half:
        peer = ranks[index - half]
        return lambda: _finish(dist.irecv(local, peer))
    return lambda: None


def _finish(work: dist.Work | None) -> None:
    if work is not None:  # None only for a rank outside the group, never here
        work.wait()


def typical_seconds(
    run: Callable[[], object],
    group: ProcessGroup | None,
    options: CalibrationOptions,
    device: torch.device,
    after_compute: bool = False,
) -> float:
    """This rank's time of ``run``.

    A collective (on ``group``) starts each run together with its peers, after a barrier of
    that group alone (a barrier of the world wakes every process at once, and on a machine with
    fewer cores than processes some then wait a whole scheduler slice), and its time is the
    ``quantile`` of its repeats. ``after_compute``: every rank then computes
    :attr:`CalibrationOptions.compute_before` products before the run starts, and the time is
    the mean of the repeats, waits for late peers included. Local work (``group`` None) runs
    back to back after one barrier of the world, every rank computing at once throughout, as in
    a step, and its time is the mean over its repeats (``local_seconds`` of them at least): on
    a machine with fewer cores than ranks, one run may hold a core alone for a scheduler slice,
    and a quantile of single runs then measures a whole core where the step gets a share of one
    (and prices a step's compute at a fraction of what it takes). On a GPU each run
    is waited for (it is queued, not run, when the call returns)."""
    for _ in range(options.warmup):
        run()
    synchronize(device)
    dist.barrier(group=group)
    if group is None:
        start, runs = time.perf_counter(), 0
        while runs < options.repeats or time.perf_counter() - start < options.local_seconds:
            run()
            synchronize(device)
            runs += 1
        return (time.perf_counter() - start) / runs
    compute = _compute_before(options, device) if after_compute else lambda: None
    samples = []
    for _ in range(options.repeats):
        dist.barrier(group=group)
        compute()
        start = time.perf_counter()
        run()
        synchronize(device)
        samples.append(time.perf_counter() - start)
    if after_compute:
        return sum(samples) / len(samples)
    return sorted(samples)[round(options.quantile * (len(samples) - 1))]


def _compute_before(options: CalibrationOptions, device: torch.device) -> Callable[[], None]:
    """The stretch of compute each rank runs before a run of the wait's all-reduce
    (:attr:`CalibrationOptions.compute_before`), waited for on a GPU."""
    size = options.matmul_size
    left = torch.randn(size, size, dtype=options.dtype, device=device)
    product = torch.empty_like(left)

    def compute() -> None:
        for _ in range(options.compute_before):
            torch.mm(left, left, out=product)
        synchronize(device)

    return compute
