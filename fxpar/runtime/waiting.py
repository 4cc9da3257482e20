"""Waiting for torch.distributed work on the CPU: poll and yield, rather than sleep.

``work.wait()`` on a gloo collective puts the calling thread to sleep until gloo's own thread
finishes the transfer and wakes it. Where a process has nothing else to run, its core then goes
idle, and in a virtual machine an idle virtual CPU is handed back to the host: waking it can
take longer than a small transfer does (an all-reduce of a megabyte between two processes), so
a step that waits at many small collectives, tensor parallelism's activations say, pays a
wake-up at each of them.

So :func:`wait` polls where it can, for up to :data:`POLL_SECONDS`, then blocks: the waiting
thread keeps its core and gives it up, at every poll, to any other thread that is ready
(gloo's thread of the same process, or another process on an oversubscribed machine). MPI
libraries wait the same way by default. The bound is for oversubscribed machines: a process
that polls counts as busy, so the kernel does not move a computing process onto its core. An
unbounded poll holds that core for as long as the peer it waits for computes elsewhere; a
bound of a few times a small collective's time keeps what a poll saves and gives the core back
when the wait turns out long.

Transfers larger than :data:`POLL_BYTES` are waited on by sleeping: a wake-up is small beside
their own time, and the gloo threads moving them need the cores a poll would hold (a
data-parallel step's gradient buckets, waited on at the end of the step, are such transfers).

Only work that reports its own completion is polled. On gloo in torch 2.13 that is
``all_reduce``, ``all_gather_single`` and ``all_to_all_single``; ``reduce_scatter_single``,
``send`` and ``recv`` say they are complete only once ``wait()`` has run (their transfer
happens inside it), so their callers pass ``poll=False`` rather than poll in vain for
:data:`POLL_SECONDS`. ``tests/test_waiting.py`` checks each kind on gloo, so a torch release
that changes this shows there. Only CPU work is polled: a wait on NCCL work does not block the
CPU at all (it orders the CUDA streams), and polling it would make the CPU wait for the GPU
instead.

**Where ranks outnumber cores, waits block** (:func:`oversubscribed`). There the rank that
reaches a collective first would poll on a core that a peer it waits for needs to reach the
collective at all: the wake-up the poll saves is worth less than the compute it holds up, and
which rank gets the core becomes a matter of scheduling, so steps also vary more from one to
the next. On hosts with a core per rank nothing waits for a core, and waits poll.

``FXPAR_WAIT=block`` or ``FXPAR_WAIT=poll`` in the environment (read at each call) chooses for
every wait, to compare the two or to leave idle cores to other jobs.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from fxpar.errors import FxparError
from fxpar.planning.grouping import BUCKET_BYTES
from fxpar.planning.grouping import buckets as cut_buckets

POLICIES = ("poll", "block")
POLL_SECONDS = 0.01
"""How long a wait polls before it blocks after all: several times what a small collective
takes between ranks that reach it together (about a millisecond), short beside a step, so
that a wait for a peer still computing soon gives its core back."""
POLL_BYTES = 4 * 2**20
"""The largest transfer waited on by polling (:func:`pollable`): a few megabytes, beyond which
a transfer takes several times what a wake-up costs."""


def policy() -> str:
    """How CPU work is waited for: ``FXPAR_WAIT`` (``"poll"`` or ``"block"``) where it is set;
    otherwise ``"poll"``, or ``"block"`` on a host running more ranks than it has cores
    (:func:`oversubscribed`)."""
    chosen = os.environ.get("FXPAR_WAIT")
    if chosen is None:
        return "block" if oversubscribed() else "poll"
    if chosen not in POLICIES:
        raise FxparError(f"FXPAR_WAIT must be one of {', '.join(POLICIES)}, got {chosen!r}")
    return chosen


def pollable(tensor: torch.Tensor) -> bool:
    """Whether work writing ``tensor`` is worth polling: a CPU tensor of at most
    :data:`POLL_BYTES`. A larger transfer takes long enough that a wake-up is small beside it,
    and the gloo threads moving it need the cores a poll would take."""
    return tensor.device.type == "cpu" and tensor.nbytes <= POLL_BYTES


def oversubscribed() -> bool:
    """Whether this host runs more ranks than the cores this process may use (the ranks of
    :func:`host_ranks`). There a rank that polls holds a core a peer it waits for needs (see
    the module docstring)."""
    ranks = host_ranks()
    return ranks is not None and ranks > _cores()


def host_ranks() -> int | None:
    """The ranks this host runs: torchrun's ``LOCAL_WORLD_SIZE``, or without it the world of an
    initialized process group (:func:`fxpar.runtime.launch.spawn`'s processes, all on this
    host); ``None`` when neither is known."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local is not None and local.isdigit():
        return int(local)
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return None


def core_demand() -> float | None:
    """The threads the whole world computes with over the cores this process may use, where
    every rank runs on this host (each with this process's torch threads): what
    :attr:`fxpar.Cluster.core_demand` says. ``None`` where the world spans hosts or is not
    known."""
    ranks = host_ranks()
    if ranks is None or not (dist.is_available() and dist.is_initialized()):
        return None
    if ranks != dist.get_world_size():
        return None
    return ranks * torch.get_num_threads() / _cores()


@functools.cache
def _cores() -> int:
    """The cores this process may use (read once: every wait asks)."""
    return len(os.sched_getaffinity(0))


def wait(work: Any, *, poll: bool) -> None:
    """Wait for the torch.distributed ``work`` (``None``, for a call that ran synchronously, is
    done already). ``poll``: whether ``work`` is of a kind that reports its completion (see
    the module docstring) and its tensor is :func:`pollable`; work that does not report it
    would be polled in vain for :data:`POLL_SECONDS` before the blocking wait.

    Errors and timeouts surface as ``work.wait()`` raises them: gloo marks failed work
    completed, so the polling ends and ``wait()`` raises."""
    if work is None:
        return
    if poll and policy() == "poll":
        deadline = time.perf_counter() + POLL_SECONDS
        while not work.is_completed() and time.perf_counter() < deadline:
            os.sched_yield()
    work.wait()


def all_reduce(tensor: torch.Tensor, group: Any = None) -> None:
    """Sum ``tensor`` in place over ``group`` (the world by default), waited on as :func:`wait`
    waits: an all-reduce reports its completion, so it is polled if ``tensor`` is
    :func:`pollable`. A GPU's tensor over gloo is summed in a host copy, copied back."""
    if tensor.device.type != "cpu" and dist.get_backend(group) == "gloo":
        host = tensor.cpu()
        wait(dist.all_reduce(host, group=group, async_op=True), poll=pollable(host))
        tensor.copy_(host)
        return
    wait(dist.all_reduce(tensor, group=group, async_op=True), poll=pollable(tensor))


def all_reduce_buckets(
    tensors: Sequence[torch.Tensor], group: Any = None, *, bucket_bytes: int = BUCKET_BYTES
) -> None:
    """Sum each of ``tensors`` in place over ``group``, packed into buckets of at most
    ``bucket_bytes`` (one dtype and device each, in the given order; a larger tensor alone:
    :func:`fxpar.planning.grouping.buckets`): every bucket's all-reduce is started before the
    first is waited for, so a step pays a collective's latency, and a wait for the last peer,
    once a bucket instead of once a tensor. The sums are those of :func:`all_reduce`; every
    rank must pass tensors of the same shapes, dtypes and order."""
    kinds: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for tensor in tensors:
        kinds.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    buckets = [
        [kind[position] for position in positions]
        for kind in kinds.values()
        for positions in cut_buckets([tensor.nbytes for tensor in kind], bucket_bytes)
    ]
    flats = [torch.cat([member.reshape(-1) for member in bucket]) for bucket in buckets]
    if flats and flats[0].device.type != "cpu" and dist.get_backend(group) == "gloo":
        flats = [flat.cpu() for flat in flats]
    works = [dist.all_reduce(flat, group=group, async_op=True) for flat in flats]
    for bucket, flat, work in zip(buckets, flats, works, strict=True):
        wait(work, poll=pollable(flat))
        offset = 0
        for member in bucket:
            member.copy_(flat[offset : offset + member.numel()].view_as(member))
            offset += member.numel()


__all__ = [
    "POLICIES", "POLL_BYTES", "POLL_SECONDS", "all_reduce", "all_reduce_buckets", "core_demand",
    "host_ranks", "oversubscribed", "policy", "pollable", "wait",
]  # fmt: skip
