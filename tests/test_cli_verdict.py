"""``fxpar plan --microbatches`` weighs what ``fxpar.compile(..., pipeline="auto")`` weighs:
each count's candidate is made by the same function (:func:`fxpar.joint.count_candidate`), so
the command never recommends a pipeline that compile would not run.

- a model whose micro-batches would train another step (BatchNorm) gets no pipeline from the
  command, for the reason ``pipeline="auto"`` gives;
- (slow) on four gloo ranks of the CPU preset, the command's verdict and best estimate are
  what ``pipeline="auto"`` runs.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from test_pipeline_priced import _gpt
from torch import nn

import fxpar
from fxpar.cli import main
from fxpar.joint import STEP_DIFFERS, pipeline_candidates
from fxpar.models import gpt_loss
from fxpar.passes import passes_for
from fxpar.pipeline import PassPlanner, PipelineModel
from fxpar.pipeline.stage_choice import format_seconds
from fxpar.runtime.launch import spawn


def batch_norm_target() -> tuple[nn.Module, tuple[torch.Tensor], Any, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    inputs, targets = torch.randn(16, 8), torch.randint(0, 4, (16,))
    return model, (inputs,), nn.functional.cross_entropy, (targets,)


def gpt_target() -> tuple[nn.Module, tuple[torch.Tensor], Any, tuple[torch.Tensor]]:
    model, tokens, targets = _gpt()
    return model, (tokens,), gpt_loss, (targets,)


def test_the_command_recommends_no_pipeline_that_trains_another_step(capsys: Any) -> None:
    argv = ["plan", "--model", "test_cli_verdict:batch_norm_target", "--mesh", "2"]
    assert main([*argv, "--cluster", "cpu", "--microbatches", "2"]) == 0
    out = capsys.readouterr().out
    model, inputs, loss_fn, targets = batch_norm_target()
    (candidate,) = pipeline_candidates(
        model, fxpar.Cluster.preset("cpu", (2,)), inputs, loss_fn, example_targets=targets,
        stage_planner=PassPlanner(passes_for(None)), optimizer_states=2, mixed_precision=None,
        counts=(2,),
    )  # fmt: skip
    assert candidate.choice is None and candidate.reason.startswith(STEP_DIFFERS)
    assert f"no pipeline: {candidate.reason}" in out
    assert "best pipeline: no pipeline fits; chosen: the intra-op plan alone" in out


def _auto(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    model, inputs, loss_fn, targets = gpt_target()
    trained = fxpar.compile(
        model, fxpar.Cluster.preset("cpu", (world,)), inputs, loss_fn, example_targets=targets,
        pipeline="auto",
    )  # fmt: skip
    pipelined = isinstance(trained, PipelineModel)
    choice = trained.stage_choice if isinstance(trained, PipelineModel) else None
    return {
        "pipelined": pipelined,
        "estimate": choice.step_time if choice is not None else trained.plan.estimate,  # type: ignore[union-attr]
    }


@pytest.mark.slow
def test_the_command_s_verdict_is_pipeline_auto_s(capsys: Any) -> None:
    argv = ["plan", "--model", "test_cli_verdict:gpt_target", "--mesh", "4", "--cluster", "cpu"]
    assert main([*argv, "--microbatches", "2,4,8"]) == 0
    out = capsys.readouterr().out
    verdict = re.search(
        r"intra-op plan alone: (.+) per step; best pipeline: (.+); chosen: (.+)", out
    )
    assert verdict is not None
    alone, piped, chosen = verdict.groups()
    (result, *_) = spawn(_auto, 4)
    assert result["pipelined"] is (chosen == "the pipeline")
    assert format_seconds(result["estimate"]) == (piped if result["pipelined"] else alone)
