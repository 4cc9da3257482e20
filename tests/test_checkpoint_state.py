"""Checkpoints hold everything a run needs to resume exactly: the optimizer's hyperparameters
(the learning rate a scheduler set) and the user's own state (``extra``: the scheduler's
state_dict, the data position). A run stopped and resumed with an LR scheduler gives the
uninterrupted run's losses, which equal single-device PyTorch with the same scheduler."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from conftest import train_eager

import fxpar
from fxpar.errors import CheckpointError
from fxpar.models import GPT, GPTConfig, gpt_loss
from fxpar.runtime.launch import spawn

CONFIG = GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=16, bias=False)
STEPS, STOP = 6, 3


def _schedule(step: int) -> float:
    """Warmup for 2 steps, then cosine decay: the learning rate changes every step."""
    return (step + 1) / 2 if step < 2 else 0.5 * (1 + math.cos(math.pi * (step - 2) / STEPS))


def _batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(0, CONFIG.vocab_size, (4, 8), generator=generator) for _ in range(STEPS)]


def _single_device() -> list[float]:
    torch.manual_seed(0)
    model = GPT(CONFIG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule)
    return train_eager(model, optimizer, _batches(), scheduler=scheduler)[0]


def _compile(mesh: tuple[int, ...]) -> fxpar.ParallelModel:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    tokens = _batches()[0]
    return fxpar.compile(
        GPT(CONFIG), fxpar.Cluster(mesh), (tokens,), gpt_loss, example_targets=(tokens,),
        optimizer=fxpar.optim.AdamW(lr=1e-2),
        manual=fxpar.plans.tensor_parallel if math.prod(mesh) > 1 else None,
    )  # fmt: skip


def _stop_and_resume(rank: int, world_size: int, path: str) -> dict[str, object]:
    mesh = (world_size,)
    first = _compile(mesh)
    scheduler = torch.optim.lr_scheduler.LambdaLR(first.optimizer, _schedule)
    losses = []
    for tokens in _batches()[:STOP]:
        losses.append(first.step(tokens, tokens).item())
        scheduler.step()
    first.save(path, extra={"scheduler": scheduler.state_dict(), "data": STOP})

    # A new process would build everything again from scratch: the fresh model's learning
    # rate is the initial one until the load restores the scheduled one.
    # As in PyTorch, the scheduler is made before the load: making one sets the learning rate
    # of its step 0, and the load then restores the scheduled one.
    second = _compile(mesh)
    scheduler = torch.optim.lr_scheduler.LambdaLR(second.optimizer, _schedule)
    assert second.optimizer.param_groups[0]["lr"] == 1e-2 * _schedule(0)
    extra = second.load(path)
    lr = second.optimizer.param_groups[0]["lr"]
    scheduler.load_state_dict(extra["scheduler"])
    for tokens in _batches()[extra["data"] :]:
        losses.append(second.step(tokens, tokens).item())
        scheduler.step()
    return {"losses": losses, "lr": lr, "steps": second.steps}


def test_a_run_resumed_with_its_scheduler_equals_the_uninterrupted_run(tmp_path: Path) -> None:
    expected = _single_device()
    result = _stop_and_resume(0, 1, str(tmp_path / "checkpoint"))
    assert result["lr"] == pytest.approx(1e-2 * _schedule(STOP))
    assert result["steps"] == STEPS
    assert result["losses"] == pytest.approx(expected, rel=1e-5)


@pytest.mark.slow
def test_a_tensor_parallel_run_resumes_with_its_scheduler_on_gloo(tmp_path: Path) -> None:
    expected = _single_device()
    for result in spawn(_stop_and_resume, 2, str(tmp_path / "checkpoint"), timeout_s=120):
        assert result["lr"] == pytest.approx(1e-2 * _schedule(STOP))
        assert result["losses"] == pytest.approx(expected, rel=1e-5)


def test_extra_must_be_picklable_and_is_none_when_not_saved(tmp_path: Path) -> None:
    parallel = _compile((1,))
    with pytest.raises(CheckpointError, match="extra= must be picklable"):
        parallel.save(tmp_path / "bad", extra={"generator": (x for x in range(3))})
    parallel.save(tmp_path / "plain")
    assert parallel.load(tmp_path / "plain") is None


def _pipeline_state(rank: int, world_size: int, path: str) -> tuple[object, float]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    tokens = _batches()[0]
    pipelined = fxpar.compile(
        GPT(CONFIG), fxpar.Cluster((world_size,)), (tokens,), gpt_loss,
        example_targets=(tokens,), optimizer=fxpar.optim.SGD(lr=0.1),
        pipeline=fxpar.Pipeline(stages=2, microbatches=2),
    )  # fmt: skip
    pipelined.step(tokens, tokens)
    pipelined.optimizer.param_groups[0]["lr"] = 0.05  # as a scheduler would
    pipelined.save(path, extra={"data": 1})
    pipelined.optimizer.param_groups[0]["lr"] = 0.1
    extra = pipelined.load(path)
    return extra, pipelined.optimizer.param_groups[0]["lr"]


@pytest.mark.slow
def test_pipelines_keep_hyperparameters_and_extra_state_too(tmp_path: Path) -> None:
    for extra, lr in spawn(_pipeline_state, 2, str(tmp_path / "checkpoint"), timeout_s=120):
        assert extra == {"data": 1} and lr == 0.05
