"""Saves written in the background (``save(..., blocking=False)``, ``save_step(...,
blocking=False)``) let training go on and stay as trustworthy as blocking ones:

- the checkpoint holds the state at the call, though the steps after it ran while it was
  being written (its writes are held back until they have), and a run resumed from it gives
  the uninterrupted run's losses exactly, in one process and on 2 gloo ranks;
- nothing is committed until every rank's files are written: a writer that fails (on one rank
  of two) commits nothing, ``wait()`` raises a CheckpointError on every rank, ``latest()``
  passes over the torn step, and a rank killed mid-write leaves the previous checkpoint;
- one save at a time: a save while one is in flight waits for it, and a failure nobody waited
  for is raised by the next save.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint.filesystem as dcp_filesystem

import fxpar
from fxpar.checkpoint import PendingSave, committed_version, latest, resume, save_step
from fxpar.errors import CheckpointError
from fxpar.models import GPT, GPTConfig, gpt_loss
from fxpar.runtime.launch import SpawnError, spawn

CONFIG = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16, dropout=0.1)
"""With dropout, so that a resume is exact only if the random state was saved at the call."""


def _batches(count: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, 32, (4, 8), generator=generator) for _ in range(count)]


def _compile(world_size: int = 1, seed: int = 0, pipeline: Any = None) -> Any:
    torch.manual_seed(seed)
    tokens = _batches(1)[0]
    return fxpar.compile(
        GPT(CONFIG), fxpar.Cluster((world_size,)), (tokens,), gpt_loss,
        example_targets=(tokens,), optimizer=fxpar.optim.AdamW(lr=1e-2), pipeline=pipeline,
    )  # fmt: skip


@contextlib.contextmanager
def _before_each_write(action: Callable[[], None]) -> Iterator[None]:
    """Run ``action`` in the writer before it writes each item of a checkpoint."""
    original = dcp_filesystem._write_item

    def write(*args: Any, **kwargs: Any) -> Any:
        action()
        return original(*args, **kwargs)

    dcp_filesystem._write_item = write
    try:
        yield
    finally:
        dcp_filesystem._write_item = original


def _train_saving_in_the_background(
    rank: int, world_size: int, root: str, pipeline: Any = None
) -> dict[str, Any]:
    torch.set_num_threads(1)
    batches = _batches(5)
    model = _compile(world_size, pipeline=pipeline)
    losses = [model.step(tokens, tokens) for tokens in batches[:2]]
    # Copies: full_state_dict returns a replicated parameter's own tensor, not a copy.
    at_save = {name: value.clone() for name, value in model.full_state_dict().items()}
    release = threading.Event()
    with _before_each_write(lambda: release.wait(60)):  # held until training went on
        pending = save_step(model, root, model.steps, extra={"seen": 2}, blocking=False)
        losses += [model.step(tokens, tokens) for tokens in batches[2:]]
        done_while_held, committed_while_held = pending.done(), latest(root)
        release.set()
        path = pending.wait()

    resumed = _compile(world_size, seed=5, pipeline=pipeline)
    found = resume(resumed, root)
    loaded = resumed.full_state_dict()
    saved_as_at_call = all(torch.equal(loaded[k], v) for k, v in at_save.items())
    again = [resumed.step(tokens, tokens) for tokens in batches[2:]]

    def fail_on_last_rank() -> None:
        if rank == world_size - 1:
            raise OSError(f"no space left on the device of rank {rank}")

    with _before_each_write(fail_on_last_rank):
        failing = save_step(model, root, model.steps, blocking=False)
        model.step(batches[0], batches[0])  # training goes on while it fails
        with pytest.raises(CheckpointError) as failure:
            failing.wait()
    return {
        "held": (done_while_held, committed_while_held),
        "path": path,
        "found": found,
        "saved_as_at_call": saved_as_at_call,
        "losses": torch.stack(losses[2:]),
        "again": torch.stack(again),
        "failure": str(failure.value),
        "latest_after_failure": latest(root),
    }


def _check(result: dict[str, Any], root: Path, world_size: int) -> None:
    assert result["held"] == (False, None)  # nothing committed while the writes were held
    assert result["path"] == root / "step-000002" and result["found"] == (2, {"seen": 2})
    assert result["saved_as_at_call"]  # not the state after the steps run meanwhile
    assert torch.equal(result["again"], result["losses"])
    assert f"no space left on the device of rank {world_size - 1}" in result["failure"]
    assert result["latest_after_failure"] == root / "step-000002"


@pytest.mark.parametrize("pipelined", [False, True], ids=["parallel", "pipeline"])
def test_a_background_save_holds_the_state_at_the_call_and_resumes_exactly(
    tmp_path: Path, pipelined: bool
) -> None:
    pipeline = fxpar.Pipeline(stages=1, microbatches=2) if pipelined else None
    _check(_train_saving_in_the_background(0, 1, str(tmp_path), pipeline), tmp_path, 1)
    with pytest.raises(CheckpointError, match="no commit record"):
        committed_version(tmp_path / "step-000005")  # the failed save's directory


@pytest.mark.slow
def test_background_saves_on_two_ranks(tmp_path: Path) -> None:
    for result in spawn(_train_saving_in_the_background, 2, str(tmp_path), timeout_s=120):
        _check(result, tmp_path, 2)


def test_a_failure_nobody_waited_for_is_raised_by_the_next_save(tmp_path: Path) -> None:
    model = _compile()
    tokens = _batches(1)[0]

    def refuse() -> None:
        raise OSError("disk quota exceeded")

    with _before_each_write(refuse):
        unwaited = model.save(tmp_path / "a", blocking=False)
        model.step(tokens, tokens)
        while not unwaited.done():  # ended, not waited for
            time.sleep(0.01)
    with pytest.raises(CheckpointError, match="disk quota exceeded"):
        model.save(tmp_path / "b")
    assert unwaited.done() and not (tmp_path / "b").exists()  # the next save did not start
    model.save(tmp_path / "b")  # reported once: saves go on
    assert model.load(tmp_path / "b") is None
    with pytest.raises(CheckpointError, match="disk quota exceeded"):
        unwaited.wait()  # its own wait still says why


def test_a_save_while_one_is_in_flight_waits_for_it(tmp_path: Path) -> None:
    model = _compile()
    release = threading.Event()
    with _before_each_write(lambda: release.wait(60)):
        first = model.save(tmp_path / "first", blocking=False)
        timer = threading.Timer(0.5, release.set)
        timer.start()
        second = model.save(tmp_path / "second", blocking=False)  # waits for the first
        assert first.done() and release.is_set()
    assert isinstance(second, PendingSave) and second.wait() == tmp_path / "second"
    assert committed_version(tmp_path / "first").parent == tmp_path / "first"
    timer.join()


def _die_while_writing() -> None:
    os._exit(17)  # as a kill -9 would: no Python error, no cleanup


def _killed_during_a_background_save(rank: int, world_size: int, root: str) -> None:
    torch.set_num_threads(1)
    model = _compile(world_size)
    batches = _batches(6)
    for tokens in batches[:3]:
        model.step(tokens, tokens)
    save_step(model, root, model.steps, blocking=False).wait()
    if rank == 0:
        torch.save(model.full_state_dict(), Path(root) / "step3.pt")
    else:
        model.full_state_dict()  # a collective
    written: list[int] = []

    def die_after_one_item() -> None:
        if rank == 1 and written:
            _die_while_writing()
        written.append(1)

    with _before_each_write(die_after_one_item):
        pending = save_step(model, root, 6, blocking=False)
        for tokens in batches[3:]:
            model.step(tokens, tokens)
        pending.wait()


def _resume(rank: int, world_size: int, root: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    model = _compile(world_size, seed=99)
    found = resume(model, root)
    return {"found": found, "steps": model.steps, "state": model.full_state_dict()}


@pytest.mark.slow
def test_a_rank_killed_during_a_background_save_leaves_the_previous_checkpoint(
    tmp_path: Path,
) -> None:
    with pytest.raises(SpawnError):
        spawn(_killed_during_a_background_save, 2, str(tmp_path), timeout_s=90)
    assert latest(tmp_path) == tmp_path / "step-000003"
    with pytest.raises(CheckpointError, match="no commit record"):
        committed_version(tmp_path / "step-000006")
    step3 = torch.load(tmp_path / "step3.pt")
    for result in spawn(_resume, 2, str(tmp_path), timeout_s=90):
        assert result["found"] == (3, None) and result["steps"] == 3
        for name, value in step3.items():
            assert torch.equal(result["state"][name], value), name
