"""Collectives as they appear in per-rank programs.

A per-rank program takes a :class:`Communicator` as its first input and calls the functions of
this module on it, e.g. ``all_gather(comm, x, dim=0, axis=1)``: gather ``x`` along tensor dim 0
from the devices along mesh axis 1. What a communicator does is up to it:
:class:`ProcessGroupCommunicator` runs torch.distributed collectives on the process groups of a
DeviceMesh, and the simulator (:mod:`fxpar.testing.simulate`) exchanges tensors between threads.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from fxpar.runtime import waiting


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

    return Bucket(comm.start_reduce_scatter(output, flat, axis), output, unpack)


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
    return Bucket(pending, output, unpack, then_all_gather=rest)


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
    all_gather, all_reduce, reduce_scatter, all_to_all, start_all_reduce,
    start_all_reduce_bucket, start_reduce_scatter_bucket, start_all_gather_bucket,
)  # fmt: skip
"""The calls of a per-rank program that start collectives (:func:`wait_bucket` and
:func:`wait_all_reduce` only wait)."""


class OneDeviceCommunicator:
    """The communicator of a one-device mesh: every collective over an axis of size 1 is the
    identity."""

    def defer(self, finish: Callable[[], None]) -> None:
        finish()

    def settle(self) -> None:
        return None

    def start_all_reduce(self, flat: torch.Tensor, axis: int) -> Pending:
        return Done()

    def start_reduce_scatter(self, output: torch.Tensor, flat: torch.Tensor, axis: int) -> Pending:
        output.copy_(flat)
        return Done()

    def start_all_gather(self, output: torch.Tensor, flat: torch.Tensor, axis: int) -> Pending:
        output.copy_(flat)
        return Done()

    def all_gather(self, tensor: torch.Tensor, dim: int, axis: int) -> torch.Tensor:
        return tensor

    def all_reduce(self, tensor: torch.Tensor, axis: int) -> torch.Tensor:
        return tensor

    def reduce_scatter(self, tensor: torch.Tensor, dim: int, axis: int) -> torch.Tensor:
        return tensor

    def all_to_all(
        self, tensor: torch.Tensor, split_dim: int, concat_dim: int, axis: int
    ) -> torch.Tensor:
        return tensor


class ProcessGroupCommunicator:
    """Collectives on the per-axis process groups of a DeviceMesh, with torch.distributed's
    native tensor collectives (``all_gather_single``, ``reduce_scatter_single``,
    ``all_to_all_single``), which gloo and NCCL both run.

    Those collectives work on dim 0 of a contiguous buffer; another dim is moved to the front
    first (one copy, where the old list-of-pieces form made one too), and results come back
    contiguous. ``all_reduce`` reduces a contiguous copy: the input may have other readers in
    the per-rank program, so it is not reduced in place.
    """

    def __init__(self, device_mesh: object) -> None:
        self.device_mesh = device_mesh
        self._groups = [device_mesh.get_group(axis) for axis in range(device_mesh.ndim)]  # type: ignore[attr-defined]
        self._before: list[Callable[[], None]] = []

    def defer(self, finish: Callable[[], None]) -> None:
        """Run ``finish`` before this communicator's next collective (or at :meth:`settle`):
        a check whose own collective travels while the program computes up to its first."""
        self._before.append(finish)

    def settle(self) -> None:
        """Run what :meth:`defer` left (each may raise, on every rank alike)."""
        while self._before:
            self._before.pop(0)()

    def _size(self, axis: int) -> int:
        return dist.get_world_size(self._groups[axis])

    def all_gather(self, tensor: torch.Tensor, dim: int, axis: int) -> torch.Tensor:
        self.settle()
        front = tensor.movedim(dim, 0).contiguous()
        output = front.new_empty((self._size(axis) * front.shape[0], *front.shape[1:]))
        work = dist.all_gather_single(output, front, group=self._groups[axis], async_op=True)
        _handle(work, output, reports=True).wait()
        return output.movedim(0, dim).contiguous()

    def all_reduce(self, tensor: torch.Tensor, axis: int) -> torch.Tensor:
        self.settle()
        # One copy, contiguous whatever the input's strides (a transposed gradient).
        result = tensor.clone(memory_format=torch.contiguous_format)
        self.start_all_reduce(result, axis).wait()
        return result

    def start_all_reduce(self, flat: torch.Tensor, axis: int) -> Pending:
        self.settle()
        work = dist.all_reduce(flat, group=self._groups[axis], async_op=True)
        return _handle(work, flat, reports=True)

    def start_reduce_scatter(self, output: torch.Tensor, flat: torch.Tensor, axis: int) -> Pending:
        self.settle()
        work = dist.reduce_scatter_single(output, flat, group=self._groups[axis], async_op=True)
        return _handle(work, output, reports=False)

    def start_all_gather(self, output: torch.Tensor, flat: torch.Tensor, axis: int) -> Pending:
        self.settle()
        work = dist.all_gather_single(output, flat, group=self._groups[axis], async_op=True)
        return _handle(work, output, reports=True)

    def reduce_scatter(self, tensor: torch.Tensor, dim: int, axis: int) -> torch.Tensor:
        self.settle()
        front = tensor.movedim(dim, 0).contiguous()
        output = front.new_empty((front.shape[0] // self._size(axis), *front.shape[1:]))
        self.start_reduce_scatter(output, front, axis).wait()
        return output.movedim(0, dim).contiguous()

    def all_to_all(
        self, tensor: torch.Tensor, split_dim: int, concat_dim: int, axis: int
    ) -> torch.Tensor:
        self.settle()
        size = self._size(axis)
        # Chunk j of split_dim goes to device j: with split_dim in front, that is chunk j of
        # dim 0, as all_to_all_single sends it; what arrives is stacked on dim 0 in order.
        front = tensor.movedim(split_dim, 0).contiguous()
        received = torch.empty_like(front)
        work = dist.all_to_all_single(received, front, group=self._groups[axis], async_op=True)
        _handle(work, received, reports=True).wait()
        piece = (front.shape[0] // size, *front.shape[1:])
        stacked = received.view(size, *piece)
        # Where concat_dim sits among a piece's dims (split_dim first, the others in order).
        at = 1 + concat_dim if concat_dim < split_dim else concat_dim
        merged = stacked.movedim(0, at)  # the device index right before concat_dim
        shape = list(piece)
        shape[at] *= size
        return merged.reshape(shape).movedim(0, split_dim).contiguous()


def _handle(work: object, output: torch.Tensor, *, reports: bool) -> Pending:
    """The handle of the torch.distributed ``work`` that writes ``output`` (``None`` where the
    call ran synchronously). Its wait polls (:mod:`fxpar.runtime.waiting`) if the work
    ``reports`` its completion and ``output`` is :func:`~fxpar.runtime.waiting.pollable`."""
    if work is None:
        return Done()
    return _Work(work, poll=reports and waiting.pollable(output))


@dataclass(frozen=True)
class _Work:
    work: Any
    poll: bool

    def wait(self) -> None:
        waiting.wait(self.work, poll=self.poll)
