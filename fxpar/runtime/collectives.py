"""Collectives as they appear in per-rank programs.

A per-rank program takes a :class:`Communicator` as its first input and calls the functions of
this module on it, e.g. ``all_gather(comm, x, dim=0, axis=1)``: gather ``x`` along tensor dim 0
from the devices along mesh axis 1. What a communicator does is up to it:
:class:`ProcessGroupCommunicator` runs torch.distributed collectives on the process groups of a
DeviceMesh, and the simulator (:mod:`fxpar.testing.simulate`) exchanges tensors between threads.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.distributed as dist


class Communicator(Protocol):
    """Collectives over one axis of the device mesh, seen from one device."""

    def all_gather(self, tensor: torch.Tensor, dim: int, axis: int) -> torch.Tensor: ...

    def all_reduce(self, tensor: torch.Tensor, axis: int) -> torch.Tensor: ...

    def reduce_scatter(self, tensor: torch.Tensor, dim: int, axis: int) -> torch.Tensor: ...

    def all_to_all(
        self, tensor: torch.Tensor, split_dim: int, concat_dim: int, axis: int
    ) -> torch.Tensor: ...


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


def all_reduce_bucket(
    comm: Communicator, tensors: Sequence[torch.Tensor], axis: int
) -> tuple[torch.Tensor, ...]:
    """Sum each of ``tensors`` (of one dtype) over ``axis`` with ONE all-reduce: they are
    packed into a flat buffer, reduced, and unpacked (contiguous). Many small gradients then
    cost one collective's latency instead of one each."""
    flat = torch.cat([tensor.reshape(-1) for tensor in tensors])
    reduced = comm.all_reduce(flat, axis)
    pieces = reduced.split([tensor.numel() for tensor in tensors])
    return tuple(piece.view(tensor.shape) for piece, tensor in zip(pieces, tensors, strict=True))


COLLECTIVE_FUNCTIONS = (all_gather, all_reduce, reduce_scatter, all_to_all, all_reduce_bucket)


class OneDeviceCommunicator:
    """The communicator of a one-device mesh: every collective over an axis of size 1 is the
    identity."""

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
    native tensor collectives (``all_gather_into_tensor``, ``reduce_scatter_tensor``,
    ``all_to_all_single``), which gloo and NCCL both run.

    Those collectives work on dim 0 of a contiguous buffer; another dim is moved to the front
    first (one copy, where the old list-of-pieces form made one too), and results come back
    contiguous. ``all_reduce`` reduces a contiguous copy: the input may have other readers in
    the per-rank program, so it is not reduced in place.
    """

    def __init__(self, device_mesh: object) -> None:
        self.device_mesh = device_mesh
        self._groups = [device_mesh.get_group(axis) for axis in range(device_mesh.ndim)]  # type: ignore[attr-defined]

    def _size(self, axis: int) -> int:
        return dist.get_world_size(self._groups[axis])

    def all_gather(self, tensor: torch.Tensor, dim: int, axis: int) -> torch.Tensor:
        front = tensor.movedim(dim, 0).contiguous()
        output = front.new_empty((self._size(axis) * front.shape[0], *front.shape[1:]))
        dist.all_gather_into_tensor(output, front, group=self._groups[axis])
        return output.movedim(0, dim).contiguous()

    def all_reduce(self, tensor: torch.Tensor, axis: int) -> torch.Tensor:
        # One copy, contiguous whatever the input's strides (a transposed gradient).
        result = tensor.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(result, group=self._groups[axis])
        return result

    def reduce_scatter(self, tensor: torch.Tensor, dim: int, axis: int) -> torch.Tensor:
        front = tensor.movedim(dim, 0).contiguous()
        output = front.new_empty((front.shape[0] // self._size(axis), *front.shape[1:]))
        dist.reduce_scatter_tensor(output, front, group=self._groups[axis])
        return output.movedim(0, dim).contiguous()

    def all_to_all(
        self, tensor: torch.Tensor, split_dim: int, concat_dim: int, axis: int
    ) -> torch.Tensor:
        size = self._size(axis)
        # Chunk j of split_dim goes to device j: with split_dim in front, that is chunk j of
        # dim 0, as all_to_all_single sends it; what arrives is stacked on dim 0 in order.
        front = tensor.movedim(split_dim, 0).contiguous()
        received = torch.empty_like(front)
        dist.all_to_all_single(received, front, group=self._groups[axis])
        piece = (front.shape[0] // size, *front.shape[1:])
        stacked = received.view(size, *piece)
        # Where concat_dim sits among a piece's dims (split_dim first, the others in order).
        at = 1 + concat_dim if concat_dim < split_dim else concat_dim
        merged = stacked.movedim(0, at)  # the device index right before concat_dim
        shape = list(piece)
        shape[at] *= size
        return merged.reshape(shape).movedim(0, split_dim).contiguous()
