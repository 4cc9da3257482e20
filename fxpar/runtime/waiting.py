"""Waiting for torch.distributed work on the CPU: poll and yield, rather than sleep.

``work.wait()`` on a gloo collective puts the calling thread to sleep until gloo's own thread
finishes the transfer and wakes it. Where a process has nothing else to run, its core then goes
idle, and in a virtual machine an idle virtual CPU is handed back to the host: waking it costs
far more than the transfer. On the 2-core KVM development machine, two processes that each
multiply a 1024x512 by a 512x256 matrix and then all-reduce the 1 MiB result take about 6 ms per
round when they block in ``wait()`` and 4 ms when they poll ``work.is_completed()`` and call
``os.sched_yield()`` between polls; the multiplication alone takes 2.7 ms.

So :func:`wait` polls where it can: the waiting thread keeps its core, and gives it up to any
other thread that is ready (gloo's thread of the same process, or another process on an
oversubscribed machine) at every poll. MPI libraries wait the same way by default.

Only work that reports its own completion can be polled. On gloo in torch 2.13 that is
``all_reduce``, ``all_gather_single`` and ``all_to_all_single``; ``reduce_scatter_single``,
``send`` and ``recv`` say they are complete only once ``wait()`` has run (their transfer
happens inside it), so their callers pass ``poll=False``. ``tests/test_waiting.py`` checks
each kind, so a torch that changes this fails there instead of hanging. Only CPU work is
polled: a wait on NCCL work does not block the CPU at all (it orders the CUDA streams), and
polling it would make the CPU wait for the GPU instead.

``FXPAR_WAIT=block`` in the environment (read at each call) makes every wait block, to compare
the two or to leave idle cores to other jobs.
"""

from __future__ import annotations

import os
from typing import Any

from fxpar.errors import FxparError

POLICIES = ("poll", "block")


def policy() -> str:
    """How CPU work is waited for: ``FXPAR_WAIT`` (``"poll"``, the default, or ``"block"``)."""
    chosen = os.environ.get("FXPAR_WAIT", "poll")
    if chosen not in POLICIES:
        raise FxparError(f"FXPAR_WAIT must be one of {', '.join(POLICIES)}, got {chosen!r}")
    return chosen


def wait(work: Any, *, poll: bool) -> None:
    """Wait for the torch.distributed ``work`` (``None``, for a call that ran synchronously, is
    done already). ``poll``: whether ``work`` is on CPU tensors and of a kind that reports its
    completion (see the module docstring); a poll on work that never reports it would never
    end.

    Errors and timeouts surface as ``work.wait()`` raises them: gloo marks failed work
    completed, so the polling ends and ``wait()`` raises."""
    if work is None:
        return
    if poll and policy() == "poll":
        while not work.is_completed():
            os.sched_yield()
    work.wait()


__all__ = ["POLICIES", "policy", "wait"]
