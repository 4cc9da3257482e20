"""Pipelines on real gloo processes: 4 stages on 4 ranks, 2 stages of 2 data-parallel
devices, and 2 stages x 2-way tensor parallelism (Megatron, and the ILP's plan) on a (2, 2)
mesh, under GPipe and 1F1B, with and without remat, give single-device training's loss,
gradients and SGD update (GPT with its tied embedding, so the partial gradients of a weight
held by the first and last stage are summed too).

The four processes are spawned once for all cases; each builds the same model and batch from
fixed seeds and returns its stage's results, which the parent compares with eager PyTorch.
(docs/pipelines.md's 2 stages x 2-way tensor parallel script runs in tests/test_docs.py; the
tensor parallel cases here check each rank's loss and pieces against eager PyTorch.)
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from fxpar import compile as fxpar_compile
from fxpar import plans
from fxpar.cluster import Cluster
from fxpar.models import GPT, GPTConfig, gpt_loss
from fxpar.optim import SGD, AdamW
from fxpar.pipeline import Pipeline, PipelineModel
from fxpar.pipeline.groups import LossReduction
from fxpar.runtime.launch import spawn
from fxpar.sharding import shard_tensor
from fxpar.testing.strategies import splitting_cluster

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
LOSS_TIMING_CASE = 2  # 4 stages, 1F1B, no remat
# 2 stages x 2-way tensor parallel on a (2, 2) mesh: fxpar.compile plans the stage mesh.
TP_CASES = [
    *(
        (Pipeline(stages=2, microbatches=4, schedule=schedule, remat=remat), "megatron")
        for schedule in ("gpipe", "1f1b")
        for remat in (False, True)
    ),
    (Pipeline(stages=2, microbatches=2, schedule="1f1b"), "ilp"),
]


def _build() -> tuple[GPT, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = GPT(CONFIG)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, CONFIG.vocab_size, (8, 16), generator=generator)
    targets = torch.randint(0, CONFIG.vocab_size, (8, 16), generator=generator)
    return model, tokens, targets


def _run_cases(
    rank: int, world_size: int, cases: list[Pipeline], checkpoint_dir: str
) -> dict[str, Any]:
    """This rank's outcomes, by what they are of: each of ``cases`` (``steps``), the full state
    after FULL_STATE_CASE, each of TP_CASES (``tensor_parallel``), the checkpoint round trip
    and the loss reduction's timing in LOSS_TIMING_CASE."""
    results: dict[str, Any] = {"steps": [], "tensor_parallel": []}
    started = _record_loss_reductions()
    for index, pipeline in enumerate(cases):
        model, tokens, targets = _build()
        pipelined = PipelineModel(
            model, pipeline, (tokens,), gpt_loss, example_targets=(targets,), optimizer=SGD(lr=LR)
        )
        started.clear()
        loss = pipelined.step(tokens, targets)
        results["steps"].append((loss, dict(pipelined.gradients), dict(pipelined.parameters)))
        if index == FULL_STATE_CASE:
            results["full_state"] = pipelined.full_state_dict()
        if index == LOSS_TIMING_CASE:
            assert pipelined.trace is not None
            results["loss_timing"] = (list(started), pipelined.trace.events)
    for pipeline, solver in TP_CASES:
        model, tokens, targets = _build()
        pipelined = fxpar_compile(
            model, splitting_cluster((2, 2)), (tokens,), gpt_loss, example_targets=(targets,),
            optimizer=SGD(lr=LR), pipeline=pipeline,
            manual=plans.tensor_parallel if solver == "megatron" else None,
        )  # fmt: skip
        loss = pipelined.step(tokens, targets)
        assert pipelined.sharded is not None
        specs = {name: pipelined.sharded.specs[name] for name in pipelined.parameters}
        local = (dict(pipelined.gradients), dict(pipelined.parameters), specs)
        outcome = (loss, pipelined.coordinate, local, pipelined.full_state_dict())
        results["tensor_parallel"].append(outcome)
    results["checkpoint"] = _checkpoint_round_trip(checkpoint_dir)
    return results


def _record_loss_reductions() -> list[float]:
    """When this process starts each loss reduction from now on."""
    started: list[float] = []
    start = LossReduction.start

    def recorded(self: LossReduction, loss_sum: torch.Tensor | None) -> None:
        started.append(time.perf_counter())
        start(self, loss_sum)

    LossReduction.start = recorded  # type: ignore[method-assign]
    return started


def _checkpoint_round_trip(directory: str) -> tuple[Any, ...]:
    """2 stages x 2-way tensor parallel with AdamW: a step, save, a step. Then the checkpoint
    resumes 4 one-device stages and a fully sharded ParallelModel; each takes that second
    step."""
    model, tokens, targets = _build()
    common: dict[str, Any] = {"example_targets": (targets,), "optimizer": AdamW(lr=1e-2)}
    original = fxpar_compile(
        model, Cluster((2, 2)), (tokens,), gpt_loss, **common,
        pipeline=Pipeline(stages=2, microbatches=2), manual=plans.tensor_parallel,
    )  # fmt: skip
    original.step(tokens, targets)
    original.save(directory)
    expected = (original.step(tokens, targets), original.full_state_dict())
    resumed = [
        PipelineModel(_build()[0], Pipeline(stages=4, microbatches=2), (tokens,), gpt_loss,
                      **common),
        fxpar_compile(_build()[0], Cluster((4,)), (tokens,), gpt_loss, **common,
                      manual=plans.fully_sharded),
    ]  # fmt: skip
    outcomes = []
    for model_now in resumed:
        model_now.load(directory)
        outcomes.append((model_now.step(tokens, targets), model_now.full_state_dict()))
    return expected, outcomes


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    directory = tmp_path_factory.mktemp("pipeline_checkpoint")
    return spawn(_run_cases, 4, CASES, str(directory))


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
    per_rank: list[dict[str, Any]],
    reference: tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]],
) -> None:
    """Every rank reports the whole batch's loss; every parameter's gradient and updated
    value, on every rank that holds it, equal eager PyTorch's; and every parameter is held
    somewhere."""
    loss, grads, updated = reference
    held: set[str] = set()
    for rank, results in enumerate(per_rank):
        rank_loss, rank_grads, rank_params = results["steps"][case]
        torch.testing.assert_close(rank_loss, loss, msg=f"rank {rank}")
        for name, grad in rank_grads.items():
            torch.testing.assert_close(grad, grads[name], msg=f"rank {rank}: {name}")
        for name, value in rank_params.items():
            torch.testing.assert_close(value, updated[name], msg=f"rank {rank}: {name}")
        held |= rank_params.keys()
    assert held == set(grads)


def test_the_loss_all_reduce_travels_while_the_step_computes(
    per_rank: list[dict[str, Any]],
) -> None:
    """Each rank starts the loss's all-reduce once: the last stage as soon as its last loss
    is computed (before its last backward), the others right after their first message (the
    batch check comes first), not at the end of the step where every rank would wait for it."""
    assert CASES[LOSS_TIMING_CASE].schedule == "1f1b" and not CASES[LOSS_TIMING_CASE].remat
    for rank, results in enumerate(per_rank):
        (started,), events = results["loss_timing"]
        forwards = [e for e in events if e.op == "forward"]
        if rank == len(per_rank) - 1:
            backwards = [e for e in events if e.op == "backward"]
            assert forwards[-1].end <= started <= backwards[-1].start, rank
        else:
            assert events[0].end <= started <= forwards[1].start, rank


def test_full_state_dict_gathers_every_stage(per_rank: list[dict[str, Any]]) -> None:
    """Every rank gets the whole updated model under its own state_dict names (the tied
    embedding under both), equal to eager PyTorch's after the step."""
    model, tokens, targets = _build()
    gpt_loss(model(tokens), targets).backward()
    torch.optim.SGD(model.parameters(), lr=LR).step()
    expected = model.state_dict()
    for rank, results in enumerate(per_rank):
        state = results["full_state"]
        assert state.keys() == expected.keys(), rank
        torch.testing.assert_close(state, expected, msg=f"rank {rank}")


@pytest.mark.parametrize(
    "case", range(len(TP_CASES)), ids=[f"{p} x 2-way {s}" for p, s in TP_CASES]
)
def test_tensor_parallel_stages_equal_single_device(
    case: int,
    per_rank: list[dict[str, Any]],
    reference: tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]],
) -> None:
    """Each rank holds its piece of its stage's parameters under the stage's plan: the
    piece of every gradient and updated weight equals that piece of eager PyTorch's, the
    loss is the whole batch's, and the reassembled model equals eager PyTorch's. Megatron's
    plan really splits the weights (some piece is smaller than its parameter)."""
    loss, grads, updated = reference
    model, tokens, targets = _build()
    gpt_loss(model(tokens), targets).backward()
    torch.optim.SGD(model.parameters(), lr=LR).step()
    expected_state = model.state_dict()
    split_some = False
    for rank, results in enumerate(per_rank):
        outcome = results["tensor_parallel"][case]
        rank_loss, coordinate, (rank_grads, rank_params, specs), state = outcome
        torch.testing.assert_close(rank_loss, loss, msg=f"rank {rank}")
        for name, grad in rank_grads.items():
            piece = shard_tensor(grads[name], specs[name], (2,), coordinate)
            torch.testing.assert_close(grad, piece, msg=f"rank {rank}: {name}")
        for name, value in rank_params.items():
            piece = shard_tensor(updated[name], specs[name], (2,), coordinate)
            torch.testing.assert_close(value, piece, msg=f"rank {rank}: {name}")
            split_some |= value.numel() < updated[name].numel()
        torch.testing.assert_close(state, expected_state, msg=f"rank {rank}")
    if TP_CASES[case][1] == "megatron":
        assert split_some


def test_checkpoint_of_a_tensor_parallel_pipeline_resumes_anywhere(
    per_rank: list[dict[str, Any]],
) -> None:
    """A checkpoint saved by 2 stages x 2-way tensor parallel (weights and AdamW state, every
    rank its pieces) loads into 4 one-device stages and into a fully sharded ParallelModel,
    and the next step gives the uninterrupted run's loss and model on every rank."""
    for rank, results in enumerate(per_rank):
        (loss, state), outcomes = results["checkpoint"]
        for index, (resumed_loss, resumed_state) in enumerate(outcomes):
            torch.testing.assert_close(resumed_loss, loss, msg=f"rank {rank}, resume {index}")
            torch.testing.assert_close(
                resumed_state, state, rtol=1e-4, atol=1e-5, msg=f"rank {rank}, resume {index}"
            )
