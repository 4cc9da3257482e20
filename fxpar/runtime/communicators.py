"""The communicators per-rank programs run on: what each collective call of
:mod:`fxpar.lowering.collective_calls` does in a process of the job.

:class:`ProcessGroupCommunicator` runs torch.distributed collectives on the process groups of a
DeviceMesh, waiting for them as :mod:`fxpar.runtime.waiting` says; :class:`OneDeviceCommunicator`
is the identity of a one-device mesh.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from fxpar.lowering.collective_calls import Done, Pending
from fxpar.runtime import waiting

# torch 2.13 names the tensor collectives ``all_gather_single`` and ``reduce_scatter_single``;
# earlier releases (2.11, say) ``all_gather_into_tensor`` and
# ``reduce_scatter_tensor``, with the same arguments.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


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

    def all_to_all_rows(
        self,
        tensor: torch.Tensor,
        send_counts: Sequence[int],
        receive_counts: Sequence[int],
        axis: int,
    ) -> torch.Tensor:
        return tensor


class ProcessGroupCommunicator:
    """Collectives on the per-axis process groups of a DeviceMesh, with torch.distributed's
    native tensor collectives (``all_gather_single``, ``reduce_scatter_single``,
    ``all_to_all_single``), which gloo and NCCL both run.

    Those collectives work on dim 0 of a contiguous buffer; another dim is moved to the front
    first (one copy, as gathering into a list of pieces and joining them would make too), and
    results come back contiguous. ``all_reduce`` reduces a contiguous copy: the input may have
    other readers in the per-rank program, so it is not reduced in place.
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
        work = all_gather_single(output, front, group=self._groups[axis], async_op=True)
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
        work = reduce_scatter_single(output, flat, group=self._groups[axis], async_op=True)
        return _handle(work, output, reports=False)

    def start_all_gather(self, output: torch.Tensor, flat: torch.Tensor, axis: int) -> Pending:
        self.settle()
        work = all_gather_single(output, flat, group=self._groups[axis], async_op=True)
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

    def all_to_all_rows(
        self,
        tensor: torch.Tensor,
        send_counts: Sequence[int],
        receive_counts: Sequence[int],
        axis: int,
    ) -> torch.Tensor:
        self.settle()
        rows = tensor.contiguous()
        received = rows.new_empty((sum(receive_counts), *rows.shape[1:]))
        work = dist.all_to_all_single(
            received,
            rows,
            output_split_sizes=list(receive_counts),
            input_split_sizes=list(send_counts),
            group=self._groups[axis],
            async_op=True,
        )
        _handle(work, received, reports=True).wait()
        return received


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
