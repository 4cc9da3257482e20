"""Where a rank's tensors live, and how its collectives reach the other ranks.

A :class:`~fxpar.cluster.Cluster` says what its devices are (``device_type``: ``"cpu"`` or
``"cuda"``). On a CUDA cluster each process takes the GPU of its local rank,
``cuda:LOCAL_RANK`` (``LOCAL_RANK`` as ``torchrun`` sets it; the global rank without it), or,
when a node has fewer GPUs than processes, GPU ``LOCAL_RANK % count``: several processes then
share one GPU, which is how the CUDA paths are tested on a machine with a single GPU. Its
parameters, optimizer state, buffers, batches and programs all live there (programs are placed
by :func:`fxpar.ir.placement.place`).

The process group's backend decides how collectives travel (:func:`default_backend`): NCCL
between processes that each own a GPU, gloo otherwise. Gloo moves CPU tensors, so on a CUDA
cluster over gloo every collective goes through host memory: :class:`HostStaged` copies a
GPU tensor to the CPU, runs the collective there and copies the result back when it is
waited for. NCCL takes GPU tensors as they are, and its waits order CUDA streams rather than
block the CPU (:mod:`fxpar.runtime.waiting` polls CPU work only).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from fxpar.errors import DistributedError, FxparError
from fxpar.lowering.collective_calls import Pending
from fxpar.runtime.communicators import ProcessGroupCommunicator

DEVICE_TYPES = ("cpu", "cuda")
"""The kinds of device a compiled model runs on."""


def check_device_type(device_type: str) -> None:
    """Raise :class:`~fxpar.errors.FxparError` unless fxpar runs on ``device_type``, and
    :class:`~fxpar.errors.DistributedError` for CUDA where torch sees no GPU."""
    if device_type not in DEVICE_TYPES:
        raise FxparError(
            f"fxpar runs on device_type {' or '.join(map(repr, DEVICE_TYPES))}, not "
            f"{device_type!r}; fxpar.plan prices any cluster"
        )
    if device_type == "cuda" and not torch.cuda.is_available():
        raise DistributedError(
            "the cluster's device_type is 'cuda' but torch sees no GPU here "
            "(torch.cuda.is_available() is False): run on a machine with one, or give "
            "device_type='cpu' (Cluster.preset('cpu', ...)) to train on CPU processes"
        )


def local_rank() -> int:
    """This process's rank on its node: ``LOCAL_RANK`` (torchrun), else the global rank."""
    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"])
    return dist.get_rank() if dist.is_initialized() else 0


def rank_device(device_type: str) -> torch.device:
    """The device this process computes on, made the current CUDA device where it is one:
    ``cuda:LOCAL_RANK`` (modulo the GPUs there are), or the CPU."""
    check_device_type(device_type)
    if device_type == "cpu":
        return torch.device("cpu")
    index = local_rank() % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def default_backend(device_type: str, processes_per_node: int | None = None) -> str:
    """The process-group backend for ``processes_per_node`` processes of a node on
    ``device_type``: NCCL where each has a GPU of its own, gloo otherwise (CPU processes, or
    several processes sharing a GPU, which NCCL refuses)."""
    if device_type != "cuda" or not torch.cuda.is_available():
        return "gloo"
    if processes_per_node is None:
        processes_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return "nccl" if processes_per_node <= torch.cuda.device_count() else "gloo"


def stages_through_host(device: torch.device, group: Any = None) -> bool:
    """Whether collectives of ``device``'s tensors go through host memory: GPU tensors on a
    gloo process group."""
    if device.type == "cpu" or not dist.is_initialized():
        return False
    return dist.get_backend(group) == "gloo"


def for_collective(tensor: torch.Tensor, group: Any = None) -> torch.Tensor:
    """``tensor`` where the backend of ``group`` reads it: on the CPU for gloo, on the
    current GPU for NCCL (a copy where it is elsewhere)."""
    if not dist.is_initialized():
        return tensor
    if dist.get_backend(group) == "gloo":
        return tensor.cpu()
    return tensor.to(torch.device("cuda", torch.cuda.current_device()))


def broadcast_from_rank_zero(tensor: torch.Tensor, *, distributed: bool) -> torch.Tensor:
    """Rank 0's ``tensor``, on every rank and on ``tensor``'s device (it travels where the
    backend reads it, :func:`for_collective`); ``tensor`` itself without ``distributed``."""
    if not distributed:
        return tensor
    moved = for_collective(tensor)
    dist.broadcast(moved, src=0)
    return moved.to(tensor.device)


def peak_memory(device: torch.device) -> int | None:
    """The most bytes this process has held on ``device`` since the last
    :func:`reset_peak_memory` (``torch.cuda.max_memory_allocated``); None on the CPU, where
    torch keeps no such count (see :func:`fxpar.testing.memory.resident_growth`)."""
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device)


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (a GPU runs asynchronously; timings need it)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class HostStaged:
    """A communicator whose collectives run on host copies of a device's tensors (module
    docstring): what a GPU rank runs over gloo. ``inner`` is the communicator of the CPU
    collectives; a started collective's result is copied back to the device when it is
    waited for."""

    def __init__(self, inner: ProcessGroupCommunicator, device: torch.device) -> None:
        self.inner = inner
        self.device = device

    def defer(self, finish: Callable[[], None]) -> None:
        self.inner.defer(finish)

    def settle(self) -> None:
        self.inner.settle()

    def _back(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.device, non_blocking=False)

    def all_gather(self, tensor: torch.Tensor, dim: int, axis: int) -> torch.Tensor:
        return self._back(self.inner.all_gather(tensor.cpu(), dim, axis))

    def all_reduce(self, tensor: torch.Tensor, axis: int) -> torch.Tensor:
        return self._back(self.inner.all_reduce(tensor.cpu(), axis))

    def reduce_scatter(self, tensor: torch.Tensor, dim: int, axis: int) -> torch.Tensor:
        return self._back(self.inner.reduce_scatter(tensor.cpu(), dim, axis))

    def all_to_all(
        self, tensor: torch.Tensor, split_dim: int, concat_dim: int, axis: int
    ) -> torch.Tensor:
        return self._back(self.inner.all_to_all(tensor.cpu(), split_dim, concat_dim, axis))

    def all_to_all_rows(
        self,
        tensor: torch.Tensor,
        send_counts: Sequence[int],
        receive_counts: Sequence[int],
        axis: int,
    ) -> torch.Tensor:
        return self._back(
            self.inner.all_to_all_rows(tensor.cpu(), send_counts, receive_counts, axis)
        )

    def start_all_reduce(self, flat: torch.Tensor, axis: int) -> Pending:
        host = flat.cpu()
        return _CopyBack(self.inner.start_all_reduce(host, axis), host, flat)

    def start_reduce_scatter(self, output: torch.Tensor, flat: torch.Tensor, axis: int) -> Pending:
        host = torch.empty(output.shape, dtype=output.dtype)
        return _CopyBack(self.inner.start_reduce_scatter(host, flat.cpu(), axis), host, output)

    def start_all_gather(self, output: torch.Tensor, flat: torch.Tensor, axis: int) -> Pending:
        host = torch.empty(output.shape, dtype=output.dtype)
        return _CopyBack(self.inner.start_all_gather(host, flat.cpu(), axis), host, output)


@dataclass(frozen=True)
class _CopyBack:
    """A host collective's handle whose wait also copies its result into the device tensor."""

    pending: Pending
    host: torch.Tensor
    target: torch.Tensor

    def wait(self) -> None:
        self.pending.wait()
        self.target.copy_(self.host)


__all__ = [
    "DEVICE_TYPES",
    "HostStaged",
    "broadcast_from_rank_zero",
    "check_device_type",
    "default_backend",
    "for_collective",
    "local_rank",
    "peak_memory",
    "rank_device",
    "reset_peak_memory",
    "stages_through_host",
    "synchronize",
]
