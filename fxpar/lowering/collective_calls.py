"""The collective calls per-rank programs make: the lowering's instruction set for communication.

A per-rank program takes a :class:`Communicator` as its first input and calls the functions of
this module on it, e.g. ``all_gather(comm, x, dim=0, axis=1)``: gather ``x`` along tensor dim 0
from the devices along mesh axis 1. What a communicator does is up to it: the runtime's
:class:`~fxpar.runtime.communicators.ProcessGroupCommunicator` runs torch.distributed
collectives on the process groups of a DeviceMesh, and the simulator
(:mod:`fxpar.testing.simulate`) exchanges tensors between threads.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


class Communicator(Protocol):
    """Collectives over one axis of the device mesh, seen from one device."""

    def all_gather(self, tensor: torch.Tensor, dim: int, axis: int) -> torch.Tensor: ...

    def all_reduce(self, tensor: torch.Tensor, axis: int) -> torch.Tensor: ...

    def reduce_scatter(self, tensor: torch.Tensor, dim: int, axis: int) -> torch.Tensor: ...

    def all_to_all(
        self, tensor: torch.Tensor, split_dim: int, concat_dim: int, axis: int
    ) -> torch.Tensor: ...

    def start_all_reduce(self, flat: torch.Tensor, axis: int) -> Pending:
        """Start summing the contiguous ``flat`` in place over ``axis``; nothing else reads
        or writes it until the returned handle is waited on."""
        ...

    def start_reduce_scatter(self, output: torch.Tensor, flat: torch.Tensor, axis: int) -> Pending:
        """Start writing to ``output`` (1-D) this device's chunk of the sum over ``axis`` of
        the 1-D ``flat`` (chunk ``i`` of ``flat`` goes to the device at index ``i``)."""
        ...

    def start_all_gather(self, output: torch.Tensor, flat: torch.Tensor, axis: int) -> Pending:
        """Start writing to ``output`` (1-D) the 1-D ``flat`` of every device along ``axis``,
        in order."""
        ...


class RowCommunicator(Communicator, Protocol):
    """A communicator that also exchanges rows by count (a variable-size all-to-all): what a
    rank program whose mixture-of-experts tokens are dispatched by all-to-all runs on
    (:mod:`fxpar.lowering.expert_dispatch`)."""

    def all_to_all_rows(
        self,
        tensor: torch.Tensor,
        send_counts: Sequence[int],
        receive_counts: Sequence[int],
        axis: int,
    ) -> torch.Tensor:
        """Send rows ``[sum(send_counts[:j]), sum(send_counts[:j+1]))`` of ``tensor`` (dim 0)
        to the device at index ``j`` along ``axis``, and return what arrives stacked on dim 0
        in device order, ``receive_counts[i]`` rows from device ``i``: a variable-size
        all-to-all, whose counts every device knows beforehand (:func:`exchange_counts`)."""
        ...


class Pending(Protocol):
    """A collective in flight."""

    def wait(self) -> object: ...


class Done:
    """The handle of a collective that completed when it was started."""

    def wait(self) -> None:
        return None


def all_gather(comm: Communicator, tensor: torch.Tensor, dim: int, axis: int) -> torch.Tensor:
    """Concatenate the pieces of every device along ``axis`` on tensor dim ``dim``."""
    return comm.all_gather(tensor, dim, axis)


def all_reduce(comm: Communicator, tensor: torch.Tensor, axis: int) -> torch.Tensor:
    """Sum the addends of every device along ``axis``."""
    return comm.all_reduce(tensor, axis)


def reduce_scatter(comm: Communicator, tensor: torch.Tensor, dim: int, axis: int) -> torch.Tensor:
    """Sum over ``axis`` and keep this device's chunk of tensor dim ``dim``."""
    return comm.reduce_scatter(tensor, dim, axis)


def all_to_all(
    comm: Communicator, tensor: torch.Tensor, split_dim: int, concat_dim: int, axis: int
) -> torch.Tensor:
    """From sharded on ``concat_dim`` to sharded on ``split_dim`` along ``axis``."""
    return comm.all_to_all(tensor, split_dim, concat_dim, axis)


def exchange_counts(comm: RowCommunicator, send_counts: torch.Tensor, axis: int) -> torch.Tensor:
    """What each device along ``axis`` will send this one, from what each sends every other:
    ``send_counts`` (a 1-D integer tensor of ``n * c`` entries, ``n`` the devices of the
    axis) sends entries ``[j * c, (j + 1) * c)`` to device ``j``, and entries
    ``[i * c, (i + 1) * c)`` of the result came from device ``i`` (``c`` is 1 for counts per
    device, a device's expert count for counts per expert). A fixed-size all-to-all, run
    before a variable-size one (:func:`exchange_rows`) so that every device can size what it
    receives."""
    return comm.all_to_all(send_counts, 0, 0, axis)


@dataclass(frozen=True)
class RowSplits:
    """How many rows one device sends to and receives from each device of a mesh axis, in
    device order: the split sizes of a variable-size all-to-all (:func:`exchange_rows`)."""

    send: tuple[int, ...]
    receive: tuple[int, ...]

    def back(self) -> RowSplits:
        """The splits of the reverse exchange (what came is sent back)."""
        return RowSplits(self.receive, self.send)


def exchange_rows(
    comm: RowCommunicator, tensor: torch.Tensor, splits: RowSplits, axis: int
) -> torch.Tensor:
    """Rows of ``tensor`` (dim 0) sent by ``splits`` along ``axis``: ``splits.send[j]``
    consecutive rows to device ``j``, and what arrives stacked on dim 0 in device order,
    ``splits.receive[i]`` rows from device ``i``. A variable-size all-to-all whose counts
    every device knows beforehand (:func:`exchange_counts`): a mixture-of-experts block's
    dispatch and combine (:mod:`fxpar.lowering.expert_dispatch`)."""
    return comm.all_to_all_rows(tensor, splits.send, splits.receive, axis)


def all_to_all_rows(
    comm: RowCommunicator, tensor: torch.Tensor, send_counts: torch.Tensor, axis: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``tensor`` sent by count along ``axis`` (``send_counts[j]`` consecutive rows to
    device ``j``, the counts exchanged first): the rows received, stacked in device order,
    and the counts received from each device (the counts of the reverse exchange)."""
    receive_counts = exchange_counts(comm, send_counts, axis)
    rows = comm.all_to_all_rows(tensor, send_counts.tolist(), receive_counts.tolist(), axis)
    return rows, receive_counts


@dataclass
class InFlight:
    """A tensor being summed over a mesh axis, in place in its own buffer."""

    pending: Pending
    result: torch.Tensor


def start_all_reduce(comm: Communicator, tensor: torch.Tensor, axis: int) -> InFlight:
    """Start summing a contiguous copy of ``tensor`` over ``axis``: the lowering starts it as
    soon as ``tensor`` is computed, and :func:`wait_all_reduce` waits right before the sum
    is read, so it travels while the ops in between run (a tensor-parallel layer's input
    gradient while its weight gradient is computed)."""
    result = tensor.clone(memory_format=torch.contiguous_format)
    return InFlight(comm.start_all_reduce(result, axis), result)


def wait_all_reduce(in_flight: InFlight) -> torch.Tensor:
    """The sum :func:`start_all_reduce` started."""
    in_flight.pending.wait()
    return in_flight.result


@dataclass
class Bucket:
    """Values travelling together in one flat buffer: a collective in flight over it, how to
    cut the result back into values, and the all-reduces over further mesh axes still to run
    (a gradient summed over two axes of a 2-D mesh) or all-gathers (a parameter sharded over
    both)."""

    pending: Pending
    result: torch.Tensor
    unpack: Callable[[torch.Tensor], tuple[torch.Tensor, ...]]
    then_all_reduce: tuple[int, ...] = ()
    then_all_gather: tuple[tuple[int, int], ...] = ()
    """Further (mesh axis, devices) to gather the whole buffer over, in order."""
    sent: torch.Tensor | None = None
    """The packed buffer the collective reads when that is not ``result`` (a reduce-scatter's
    or all-gather's input): an asynchronous collective reads it until it is waited for, so
    the bucket holds it as long, where a memory count sees it."""


def start_all_reduce_bucket(
    comm: Communicator, tensors: Sequence[torch.Tensor], axes: Sequence[int]
) -> Bucket:
    """Start summing each of ``tensors`` (of one dtype) over mesh ``axes`` with ONE
    all-reduce per axis: they are packed into a fresh flat buffer, reduced in place and, at
    :func:`wait_bucket`, cut back into their shapes (contiguous). Many small gradients then
    cost one collective's latency instead of one each, and the program runs on while the
    collective travels (gradients of earlier layers are still being computed)."""
    flat = torch.cat([tensor.reshape(-1) for tensor in tensors])
    shapes = [tensor.shape for tensor in tensors]

    def unpack(result: torch.Tensor) -> tuple[torch.Tensor, ...]:
        pieces = result.split([math.prod(shape) for shape in shapes])
        return tuple(piece.view(shape) for piece, shape in zip(pieces, shapes, strict=True))

    first, *rest = axes
    return Bucket(comm.start_all_reduce(flat, first), flat, unpack, tuple(rest))


def start_reduce_scatter_bucket(
    comm: Communicator, tensors: Sequence[torch.Tensor], dims: Sequence[int], axis: int, size: int
) -> Bucket:
    """Start summing each of ``tensors`` over mesh ``axis`` (of ``size`` devices) and keeping
    this device's chunk of tensor dim ``dims[i]``, with ONE reduce-scatter: row ``j`` of the
    packed buffer holds chunk ``j`` of every tensor, so device ``j`` receives exactly its
    chunks."""
    fronts = [tensor.movedim(dim, 0) for tensor, dim in zip(tensors, dims, strict=True)]
    flat = torch.cat([front.reshape(size, -1) for front in fronts], dim=1).reshape(-1)
    chunks = [(front.shape[0] // size, *front.shape[1:]) for front in fronts]
    output = flat.new_empty(flat.numel() // size)

    def unpack(result: torch.Tensor) -> tuple[torch.Tensor, ...]:
        pieces = result.split([math.prod(chunk) for chunk in chunks])
        return tuple(
            piece.view(chunk).movedim(0, dim).contiguous()
            for piece, chunk, dim in zip(pieces, chunks, dims, strict=True)
        )

    return Bucket(comm.start_reduce_scatter(output, flat, axis), output, unpack, sent=flat)


def start_all_gather_bucket(
    comm: Communicator,
    tensors: Sequence[torch.Tensor],
    dims: Sequence[int],
    axes: Sequence[int],
    sizes: Sequence[int],
) -> Bucket:
    """Start gathering each of ``tensors`` along tensor dim ``dims[i]`` from the devices of
    mesh ``axes`` (of ``sizes`` devices; innermost axis first, each sharding that dim) with
    ONE all-gather per axis: a fully sharded layer's parameters, all at once, as FSDP gathers
    a flat parameter. The first axis's gather travels until :func:`wait_bucket`, which runs
    the others."""
    fronts = [tensor.movedim(dim, 0) for tensor, dim in zip(tensors, dims, strict=True)]
    flat = torch.cat([front.reshape(-1) for front in fronts])
    output = flat.new_empty(flat.numel() * sizes[0])
    devices = math.prod(sizes)

    def unpack(result: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # Each gather stacks the flat buffers of its axis in front, so the outermost axis
        # ends outermost: device order along the dim, as nested shards lay it out.
        rows = result.view(devices, -1).split([front.numel() for front in fronts], dim=1)
        return tuple(
            row.reshape(devices * front.shape[0], *front.shape[1:]).movedim(0, dim).contiguous()
            for row, front, dim in zip(rows, fronts, dims, strict=True)
        )

    pending = comm.start_all_gather(output, flat, axes[0])
    rest = tuple(zip(axes[1:], sizes[1:], strict=True))
    return Bucket(pending, output, unpack, then_all_gather=rest, sent=flat)


def wait_bucket(comm: Communicator, bucket: Bucket) -> tuple[torch.Tensor, ...]:
    """The values of ``bucket`` once its collectives are done."""
    bucket.pending.wait()
    result = bucket.result
    for axis in bucket.then_all_reduce:
        comm.start_all_reduce(result, axis).wait()
    for axis, size in bucket.then_all_gather:
        gathered = result.new_empty(result.numel() * size)
        comm.start_all_gather(gathered, result, axis).wait()
        result = gathered
    return bucket.unpack(result)


COLLECTIVE_FUNCTIONS = (
    all_gather, all_reduce, reduce_scatter, all_to_all, exchange_counts, exchange_rows,
    all_to_all_rows, start_all_reduce,
    start_all_reduce_bucket, start_reduce_scatter_bucket, start_all_gather_bucket,
)  # fmt: skip
"""The calls of a per-rank program that start collectives (:func:`wait_bucket` and
:func:`wait_all_reduce` only wait)."""
