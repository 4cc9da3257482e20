"""Pipelines on real gloo processes: 4 stages on 4 ranks and 2 stages of 2 data-parallel
devices on 4 ranks, under GPipe and 1F1B, with and without remat, give single-device
training's loss, gradients and SGD update (GPT with its tied embedding, so the partial
gradients of a weight held by the first and last stage are summed too).

The four processes are spawned once for all cases; each builds the same model and batch from
fixed seeds and returns its stage's results, which the parent compares with eager PyTorch.
"""

from __future__ import annotations

import pytest
import torch

from fxpar.models import GPT, GPTConfig, gpt_loss
from fxpar.optim import SGD
from fxpar.pipeline import Pipeline, PipelineModel
from fxpar.runtime.launch import spawn

pytestmark = pytest.mark.slow

CONFIG = GPTConfig(n_layer=4, n_embd=32, n_head=4, vocab_size=64, block_size=16)
LR = 0.5
CASES = [
    *(
        Pipeline(stages=4, microbatches=4, schedule=schedule, remat=remat)
        for schedule in ("gpipe", "1f1b")
        for remat in (False, True)
    ),
    Pipeline(stages=2, microbatches=2, schedule="gpipe", remat=True, data_parallel=2),
    Pipeline(stages=2, microbatches=4, schedule="1f1b", remat=False, data_parallel=2),
]
RankResult = tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]
FULL_STATE_CASE = 5  # 2 stages x 2 replicas: full_state_dict gathers across stages


def _build() -> tuple[GPT, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = GPT(CONFIG)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, CONFIG.vocab_size, (8, 16), generator=generator)
    targets = torch.randint(0, CONFIG.vocab_size, (8, 16), generator=generator)
    return model, tokens, targets


def _run_cases(rank: int, world_size: int, cases: list[Pipeline]) -> list[RankResult]:
    results = []
    for index, pipeline in enumerate(cases):
        model, tokens, targets = _build()
        pipelined = PipelineModel(
            model, pipeline, (tokens,), gpt_loss, example_targets=(targets,), optimizer=SGD(lr=LR)
        )
        loss = pipelined.step(tokens, targets)
        results.append((loss, dict(pipelined.gradients), dict(pipelined.parameters)))
        if index == FULL_STATE_CASE:
            full_state = pipelined.full_state_dict()
    return [*results, full_state]  # type: ignore[list-item]


@pytest.fixture(scope="module")
def per_rank() -> list[list[RankResult]]:
    return spawn(_run_cases, 4, CASES)


@pytest.fixture(scope="module")
def reference() -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    model, tokens, targets = _build()
    loss = gpt_loss(model(tokens), targets)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}  # type: ignore[union-attr]
    torch.optim.SGD(model.parameters(), lr=LR).step()
    return loss.detach(), grads, {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("case", range(len(CASES)), ids=[str(c) for c in CASES])
def test_pipeline_step_equals_single_device(
    case: int,
    per_rank: list[list[RankResult]],
    reference: tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]],
) -> None:
    """Every rank reports the whole batch's loss; every parameter's gradient and updated
    value, on every rank that holds it, equal eager PyTorch's; and every parameter is held
    somewhere."""
    loss, grads, updated = reference
    held: set[str] = set()
    for rank, results in enumerate(per_rank):
        rank_loss, rank_grads, rank_params = results[case]
        torch.testing.assert_close(rank_loss, loss, msg=f"rank {rank}")
        for name, grad in rank_grads.items():
            torch.testing.assert_close(grad, grads[name], msg=f"rank {rank}: {name}")
        for name, value in rank_params.items():
            torch.testing.assert_close(value, updated[name], msg=f"rank {rank}: {name}")
        held |= rank_params.keys()
    assert held == set(grads)


def test_full_state_dict_gathers_every_stage(per_rank: list[list[RankResult]]) -> None:
    """Every rank gets the whole updated model under its own state_dict names (the tied
    embedding under both), equal to eager PyTorch's after the step."""
    model, tokens, targets = _build()
    gpt_loss(model(tokens), targets).backward()
    torch.optim.SGD(model.parameters(), lr=LR).step()
    expected = model.state_dict()
    for rank, results in enumerate(per_rank):
        state = results[-1]
        assert state.keys() == expected.keys(), rank  # type: ignore[union-attr]
        torch.testing.assert_close(state, expected, msg=f"rank {rank}")
