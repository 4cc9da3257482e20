"""Collectives as they appear in per-rank programs.

A per-rank program takes a :class:`Communicator` as its first input and calls the functions of
this module on it, e.g. ``all_gather(comm, x, dim=0, axis=1)``: gather ``x`` along tensor dim 0
from the devices along mesh axis 1. What a communicator does is up to it:
:class:`ProcessGroupCommunicator` runs torch.distributed collectives on the process groups of a
DeviceMesh, and the simulator (:mod:`fxpar.testing.simulate`) exchanges tensors between threads.
"""

from __future__ import annotations

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


COLLECTIVE_FUNCTIONS = (all_gather, all_reduce, reduce_scatter, all_to_all)


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
    """Collectives on the per-axis process groups of a DeviceMesh.

    Works on gloo and NCCL. Gloo has no reduce-scatter or all-to-all for these shapes, so
    they are built from all-reduce and all-gather there (same result, more traffic).
    """

    def __init__(self, device_mesh: object) -> None:
        self.device_mesh = device_mesh
        self._groups = [device_mesh.get_group(axis) for axis in range(device_mesh.ndim)]  # type: ignore[attr-defined]
        self._gloo = dist.get_backend() == "gloo"

    def _size(self, axis: int) -> int:
        return dist.get_world_size(self._groups[axis])

    def _index(self, axis: int) -> int:
        return dist.get_group_rank(self._groups[axis], dist.get_rank())

    def all_gather(self, tensor: torch.Tensor, dim: int, axis: int) -> torch.Tensor:
        pieces = [torch.empty_like(tensor) for _ in range(self._size(axis))]
        dist.all_gather(pieces, tensor.contiguous(), group=self._groups[axis])
        return torch.cat(pieces, dim=dim)

    def all_reduce(self, tensor: torch.Tensor, axis: int) -> torch.Tensor:
        result = tensor.clone().contiguous()
        dist.all_reduce(result, group=self._groups[axis])
        return result

    def reduce_scatter(self, tensor: torch.Tensor, dim: int, axis: int) -> torch.Tensor:
        size = self._size(axis)
        if self._gloo:
            return self.all_reduce(tensor, axis).chunk(size, dim)[self._index(axis)].contiguous()
        inputs = [c.contiguous() for c in tensor.chunk(size, dim)]
        output = torch.empty_like(inputs[0])
        dist.reduce_scatter(output, inputs, group=self._groups[axis])
        return output

    def all_to_all(
        self, tensor: torch.Tensor, split_dim: int, concat_dim: int, axis: int
    ) -> torch.Tensor:
        size = self._size(axis)
        if self._gloo:
            gathered = self.all_gather(tensor, concat_dim, axis)
            return gathered.chunk(size, split_dim)[self._index(axis)].contiguous()
        inputs = [c.contiguous() for c in tensor.chunk(size, split_dim)]
        outputs = [torch.empty_like(inputs[0]) for _ in range(size)]
        dist.all_to_all(outputs, inputs, group=self._groups[axis])
        return torch.cat(outputs, dim=concat_dim)
