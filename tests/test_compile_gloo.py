"""fxpar.compile on real gloo processes: ten AdamW steps of a small GPT under the data-parallel,
tensor-parallel and ILP plans on 4 ranks give single-device PyTorch's losses and weights; a
checkpoint written by 4 ranks under one plan loads on 2 ranks under another and training goes on
exactly as if uninterrupted; and rank mismatches fail loudly.

The GPT has no biases: the gradient of an attention key bias is mathematically zero (softmax
ignores a constant added to every score), so both runs see only rounding noise there, which
Adam's normalisation turns into updates of order lr that differ between any two summation orders.
For the same reason weights are compared with rtol 1e-4 above an absolute floor of 1e-3 * lr:
an element whose gradient is small relative to its running scale gets its rounding amplified.
"""

from __future__ import annotations

import math

import pytest
import torch

import fxpar
from fxpar import plans
from fxpar.errors import BatchError, DistributedError, FxparError
from fxpar.models import GPT, GPTConfig, gpt_loss
from fxpar.runtime.launch import spawn
from fxpar.testing.strategies import splitting_cluster

pytestmark = pytest.mark.slow

CONFIG = GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=16, bias=False)
OPTIMIZER = fxpar.optim.AdamW(lr=1e-2)
STEPS = 10
ATOL = 1e-3 * OPTIMIZER.lr
SOLVERS = {
    "data_parallel": plans.data_parallel,
    "tensor_parallel": plans.tensor_parallel,
    "ilp": None,
}


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    shape = (4, 8)
    return [
        (
            torch.randint(0, CONFIG.vocab_size, shape, generator=generator),
            torch.randint(0, CONFIG.vocab_size, shape, generator=generator),
        )
        for _ in range(STEPS)
    ]


def _compile(
    mesh: tuple[int, ...], manual: fxpar.passes.ManualPlan | None, seed: int = 0
) -> fxpar.ParallelModel:
    torch.manual_seed(seed)
    tokens, targets = _batches()[0]
    return fxpar.compile(
        GPT(CONFIG), splitting_cluster(mesh), (tokens,), gpt_loss, example_targets=(targets,),
        optimizer=OPTIMIZER, manual=manual,
    )  # fmt: skip


def _single_device() -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = GPT(CONFIG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=OPTIMIZER.lr)
    losses = []
    for tokens, targets in _batches():
        optimizer.zero_grad()
        loss = gpt_loss(model(tokens), targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, model.state_dict()


def _four_ranks(rank: int, world_size: int, checkpoint: str) -> dict[str, object]:
    torch.set_num_threads(1)
    results: dict[str, object] = {}
    for name, solver in SOLVERS.items():
        # Each rank starts from its own random weights: rank 0's are broadcast and trained.
        parallel = _compile((world_size,), solver, seed=rank)
        losses = [parallel.step(*batch).item() for batch in _batches()]
        results[name] = (losses, parallel.full_state_dict())

    first_half = _compile((world_size,), plans.fully_sharded)
    results["before_checkpoint"] = [first_half.step(*b).item() for b in _batches()[: STEPS // 2]]
    first_half.save(checkpoint)

    tokens, targets = _batches()[0]
    try:  # every rank must see the same global batch
        first_half.step(tokens + rank % 2, targets)
    except BatchError as error:
        results["batch_error"] = str(error)
    try:
        _compile((2,), plans.data_parallel)
    except DistributedError as error:
        results["mesh_error"] = str(error)
    try:  # 3 samples cannot be split over 4 data-parallel ranks
        fxpar.compile(
            GPT(CONFIG), splitting_cluster((world_size,)), (tokens[:3],), gpt_loss,
            example_targets=(targets[:3],), manual=plans.data_parallel,
        )  # fmt: skip
    except FxparError as error:
        results["divisible_error"] = str(error)
    return results


def _two_ranks(rank: int, world_size: int, checkpoint: str) -> tuple[list[float], dict]:  # type: ignore[type-arg]
    torch.set_num_threads(1)
    # A different mesh and plan, and different starting weights, all replaced by the checkpoint.
    parallel = _compile((world_size,), plans.tensor_parallel, seed=7)
    parallel.load(checkpoint)
    assert parallel.steps == STEPS // 2
    losses = [parallel.step(*batch).item() for batch in _batches()[STEPS // 2 :]]
    return losses, parallel.full_state_dict()


def test_compile_trains_like_one_device_and_checkpoints_move_between_meshes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    expected_losses, expected_state = _single_device()
    checkpoint = str(tmp_path / "checkpoint")
    four = spawn(_four_ranks, 4, checkpoint)
    for name in SOLVERS:
        for rank, results in enumerate(four):
            losses, state = results[name]  # type: ignore[misc]
            torch.testing.assert_close(losses, expected_losses, rtol=1e-4, atol=0, msg=name)
            torch.testing.assert_close(
                state,
                expected_state,
                rtol=1e-4,
                atol=ATOL,
                msg=f"{name}, rank {rank}",
            )

    assert four[0]["before_checkpoint"] == pytest.approx(expected_losses[: STEPS // 2], rel=1e-4)
    two = spawn(_two_ranks, 2, checkpoint)
    for losses, state in two:
        assert losses == pytest.approx(expected_losses[STEPS // 2 :], rel=1e-4)
        torch.testing.assert_close(state, expected_state, rtol=1e-4, atol=ATOL)

    assert all("got a different batch" in str(r["batch_error"]) for r in four)
    assert all("has 4 ranks but the cluster's mesh (2,)" in str(r["mesh_error"]) for r in four)
    assert all(
        "divisible by the 4 data-parallel devices" in str(r["divisible_error"]) for r in four
    )
    assert math.isfinite(expected_losses[-1])
