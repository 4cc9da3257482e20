"""Resuming a run is hard to get wrong (fxpar.checkpoint.save_step, resume, latest):

- ``latest`` picks the largest committed step (by number, not by name), passes over a save
  interrupted before its commit, and warns, through ``logging``, of every directory under the
  root that it does not take for a step checkpoint (``ckpt_20``: a restart would otherwise
  begin at step 0 without a word) and of a root that is itself a checkpoint;
- ``save_step`` writes ``<root>/step-<N>`` and ``resume`` loads the newest one and returns its
  step and ``extra``, for a ParallelModel and a PipelineModel in one process and a
  ParallelModel on 2 gloo ranks; with nothing saved yet it loads nothing and returns None.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

import fxpar
from fxpar.checkpoint import RECORD, latest, resume, save_step
from fxpar.errors import CheckpointError
from fxpar.models import GPT, GPTConfig, gpt_loss
from fxpar.runtime.launch import spawn

CONFIG = GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16)


def _committed(directory: Path) -> Path:
    """An empty but committed checkpoint, as far as the commit record goes."""
    (directory / "v-0").mkdir(parents=True)
    (directory / RECORD).write_text(json.dumps({"format": 1, "version": "v-0", "files": {}}))
    return directory


def test_latest_takes_the_largest_committed_step(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    for step in (3, 9, 10):
        _committed(tmp_path / f"step-{step}")
    (tmp_path / "step-11" / "v-1").mkdir(parents=True)  # a save killed before its commit
    (tmp_path / "notes.txt").write_text("files are not checkpoints, and not warned of")
    with caplog.at_level(logging.WARNING, logger="fxpar.checkpoint"):
        assert latest(tmp_path) == tmp_path / "step-10"  # 10 > 9, though "10" < "9"
    (warning,) = caplog.records
    assert "passing over" in warning.getMessage() and "step-11" in warning.getMessage()


def test_latest_warns_of_directories_it_does_not_recognise(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _committed(tmp_path / "ckpt_20")
    (tmp_path / "logs").mkdir()
    with caplog.at_level(logging.WARNING, logger="fxpar.checkpoint"):
        assert latest(tmp_path) is None
    (warning,) = caplog.records
    message = warning.getMessage()
    assert warning.levelno == logging.WARNING
    assert "ckpt_20 (a checkpoint), logs" in message and "step-<N>" in message

    caplog.clear()
    _committed(tmp_path / "step-000005")
    with caplog.at_level(logging.WARNING, logger="fxpar.checkpoint"):
        assert latest(tmp_path) == tmp_path / "step-000005"
    assert ["ckpt_20" in r.getMessage() for r in caplog.records] == [True]


def test_latest_warns_when_given_a_checkpoint_instead_of_its_root(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _committed(tmp_path)
    with caplog.at_level(logging.WARNING, logger="fxpar.checkpoint"):
        assert latest(tmp_path) is None
    assert any("is itself a checkpoint" in r.getMessage() for r in caplog.records)


def test_a_first_run_finds_nothing_to_resume(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="fxpar.checkpoint"):
        assert latest(tmp_path / "not yet made") is None
        assert latest(tmp_path) is None
    assert caplog.records == []


def _tokens() -> torch.Tensor:
    return torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(1))


def _parallel(world_size: int = 1, seed: int = 0, pipeline: Any = None) -> Any:
    torch.manual_seed(seed)
    tokens = _tokens()
    return fxpar.compile(
        GPT(CONFIG), fxpar.Cluster((world_size,)), (tokens,), gpt_loss,
        example_targets=(tokens,), optimizer=fxpar.optim.AdamW(lr=1e-2), pipeline=pipeline,
    )  # fmt: skip


def _save_then_resume(
    rank: int, world_size: int, root: str, pipeline: Any = None
) -> dict[str, Any]:
    torch.set_num_threads(1)
    trained = _parallel(world_size, pipeline=pipeline)
    tokens = _tokens()
    fresh = _parallel(world_size, seed=7, pipeline=pipeline)
    assert resume(fresh, root) is None  # nothing saved yet: nothing loaded
    for step in (1, 2):
        trained.step(tokens, tokens)
        path = save_step(trained, root, trained.steps, extra={"data": step * 4})
    found = resume(fresh, root)
    return {
        "path": str(path),
        "found": found,
        "steps": fresh.steps,
        "next": fresh.step(tokens, tokens),
        "expected": trained.step(tokens, tokens),
    }


@pytest.mark.parametrize("pipelined", [False, True], ids=["parallel", "pipeline"])
def test_save_step_then_resume_in_one_process(tmp_path: Path, pipelined: bool) -> None:
    pipeline = fxpar.Pipeline(stages=1, microbatches=2) if pipelined else None
    result = _save_then_resume(0, 1, str(tmp_path), pipeline)
    assert result["path"] == str(tmp_path / "step-000002")
    assert result["found"] == (2, {"data": 8}) and result["steps"] == 2
    assert torch.equal(result["next"], result["expected"])


@pytest.mark.slow
def test_save_step_then_resume_on_two_ranks(tmp_path: Path) -> None:
    for result in spawn(_save_then_resume, 2, str(tmp_path)):
        assert result["found"] == (2, {"data": 8}) and result["steps"] == 2
        assert torch.equal(result["next"], result["expected"])


def test_steps_are_whole_numbers(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="whole number"):
        save_step(_parallel(), tmp_path, -1)
