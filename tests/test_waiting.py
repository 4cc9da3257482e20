"""Waiting for torch.distributed work: polling where the work reports its completion, blocking
where it does not or where ``FXPAR_WAIT=block`` says so, and the gloo facts that choice rests
on."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from fxpar.errors import FxparError
from fxpar.runtime import waiting
from fxpar.runtime.launch import spawn


class _Work:
    """Completes after ``polls`` calls of is_completed; counts what was called."""

    def __init__(self, polls: int) -> None:
        self.left, self.polled, self.waited = polls, 0, 0

    def is_completed(self) -> bool:
        self.polled += 1
        self.left -= 1
        return self.left <= 0

    def wait(self) -> bool:
        self.waited += 1
        return True


def test_a_polled_wait_asks_until_the_work_is_complete_then_waits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("FXPAR_WAIT", raising=False)
    work = _Work(polls=5)
    waiting.wait(work, poll=True)
    assert (work.polled, work.waited) == (5, 1)  # wait() still runs: it raises errors


def test_a_polled_wait_blocks_once_its_time_to_poll_is_spent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Work that never reports its completion (or a long wait on an oversubscribed machine)
    ends up in the blocking wait."""
    monkeypatch.delenv("FXPAR_WAIT", raising=False)
    monkeypatch.setattr(waiting, "POLL_SECONDS", 0.002)
    work = _Work(polls=10**9)
    began = time.perf_counter()
    waiting.wait(work, poll=True)
    assert time.perf_counter() - began >= 0.002
    assert work.polled > 0 and work.waited == 1


@pytest.mark.parametrize(("policy", "poll"), [("block", True), ("poll", False)])
def test_a_wait_blocks_when_told_to_or_when_the_work_cannot_be_polled(
    monkeypatch: pytest.MonkeyPatch, policy: str, poll: bool
) -> None:
    monkeypatch.setenv("FXPAR_WAIT", policy)
    work = _Work(polls=5)
    waiting.wait(work, poll=poll)
    assert (work.polled, work.waited) == (0, 1)


def test_only_cpu_transfers_up_to_the_bound_are_worth_polling(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(waiting, "POLL_BYTES", 64)
    assert waiting.pollable(torch.zeros(16))  # 64 bytes
    assert not waiting.pollable(torch.zeros(17))
    assert not waiting.pollable(torch.zeros(1, device="meta"))


def test_nothing_to_wait_for_is_done(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FXPAR_WAIT", raising=False)
    waiting.wait(None, poll=True)


def test_an_unknown_policy_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FXPAR_WAIT", "spin")
    with pytest.raises(FxparError, match="FXPAR_WAIT must be one of poll, block, got 'spin'"):
        waiting.wait(_Work(polls=1), poll=True)


def _gloo_kinds(rank: int) -> dict[str, Callable[[], Any]]:
    x = torch.ones(8)
    return {
        "all_reduce": lambda: dist.all_reduce(x, async_op=True),
        "all_gather_single": lambda: dist.all_gather_single(torch.empty(16), x, async_op=True),
        "all_to_all_single": lambda: dist.all_to_all_single(torch.empty(8), x, async_op=True),
        "reduce_scatter_single": lambda: dist.reduce_scatter_single(
            torch.empty(4), x, async_op=True
        ),
        "send/recv": lambda: dist.isend(x, 1) if rank == 0 else dist.irecv(x, 0),
    }


def _reports_completion(rank: int, world_size: int) -> dict[str, bool]:
    """For each kind of gloo work: whether is_completed() turns True without wait()."""
    reports = {}
    for kind, start in _gloo_kinds(rank).items():
        work = start()
        deadline = time.monotonic() + 2.0
        while not work.is_completed() and time.monotonic() < deadline:
            time.sleep(0.001)
        reports[kind] = work.is_completed()
        work.wait()
        dist.barrier()
    return reports


@pytest.mark.slow
def test_gloo_work_reports_its_completion_where_fxpar_polls_it() -> None:
    """The kinds fxpar polls (fxpar.runtime.communicators passes reports=True) report their
    completion without wait(); a kind that did not would be polled in vain. Those fxpar
    waits on without polling (reduce_scatter_single, send, recv) do not, as the module
    docstring says: if a torch release changes that, they can be polled too."""
    expected = {
        "all_reduce": True,
        "all_gather_single": True,
        "all_to_all_single": True,
        "reduce_scatter_single": False,
        "send/recv": False,
    }
    assert spawn(_reports_completion, 2, timeout_s=120) == [expected, expected]


@pytest.mark.parametrize(("local", "expected"), [(1, "poll"), (None, "block")])
def test_waits_block_where_this_host_runs_more_ranks_than_it_has_cores(
    monkeypatch: pytest.MonkeyPatch, local: int | None, expected: str
) -> None:
    """torchrun's LOCAL_WORLD_SIZE says how many ranks share this host: more than its cores
    (None here: one more than this process may use) and waits block, else they poll;
    FXPAR_WAIT overrides either way."""
    import os

    monkeypatch.delenv("FXPAR_WAIT", raising=False)
    ranks = len(os.sched_getaffinity(0)) + 1 if local is None else local
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks))
    assert waiting.policy() == expected
    work = _Work(polls=5)
    waiting.wait(work, poll=True)
    assert (work.polled > 0) == (expected == "poll") and work.waited == 1
    monkeypatch.setenv("FXPAR_WAIT", "poll")
    assert waiting.policy() == "poll"
