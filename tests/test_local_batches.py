"""``fxpar.compile(..., batch="local")``: each rank passes only its own rows, as a data loader
with a ``DistributedSampler`` gives them, and training equals single-device training on every
rank's rows together (in rank order), whatever the plan: where the plan splits the batch over
every device a rank's rows are its piece; elsewhere (tensor parallelism, a plan on two mesh
axes) they are gathered first. An eval forward returns the outputs of this rank's own rows,
aligned with its inputs (as DDP does) and equal to eager PyTorch on them, whatever the plan,
or every rank's with ``rows="global"``; a scalar output (a loss) comes whole."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from conftest import train_eager
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import fxpar
from fxpar.errors import FxparError
from fxpar.models import GPT, GPTConfig, gpt_loss
from fxpar.runtime.launch import SpawnError, spawn
from fxpar.testing.strategies import splitting_cluster

CONFIG = GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=16, bias=False)
LR = 0.3
ROWS = 20  # five batches of four, the last one short under a batch size of 8 / world 2


def _dataset() -> torch.Tensor:
    generator = torch.Generator().manual_seed(11)
    return torch.randint(0, CONFIG.vocab_size, (ROWS, 8), generator=generator)


def _loader(world_size: int, rank: int, per_rank: int) -> DataLoader[Any]:
    sampler = DistributedSampler(
        TensorDataset(_dataset()), num_replicas=world_size, rank=rank, shuffle=False
    )
    return DataLoader(TensorDataset(_dataset()), batch_size=per_rank, sampler=sampler)


def _global_batches(world_size: int, per_rank: int) -> list[torch.Tensor]:
    """What the ranks' loaders give, every rank's rows together in rank order."""
    loaders = [iter(_loader(world_size, r, per_rank)) for r in range(world_size)]
    return [torch.cat([rows for (rows,) in batch]) for batch in zip(*loaders, strict=True)]


def _single_device(world_size: int, per_rank: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = GPT(CONFIG)
    batches = _global_batches(world_size, per_rank)
    losses, _ = train_eager(model, torch.optim.SGD(model.parameters(), lr=LR), batches)
    with torch.no_grad():
        logits = model.eval()(batches[0])
        loss = gpt_loss(logits, batches[0])
    return {"losses": losses, "state": model.state_dict(), "logits": logits, "loss": loss}


class _LogitsAndLoss(GPT):
    """A model whose forward returns a scalar beside its rows, as an HF model given labels."""

    def forward(self, idx: torch.Tensor) -> dict[str, torch.Tensor]:  # type: ignore[override]
        logits = super().forward(idx)
        return {"logits": logits, "loss": gpt_loss(logits, idx)}


def _logits_loss(output: dict[str, torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
    return gpt_loss(output["logits"], targets)


def _train(rank: int, world_size: int, plan: str, mesh: tuple[int, ...], per_rank: int) -> Any:
    torch.set_num_threads(1)
    first = next(iter(_loader(world_size, rank, per_rank)))[0]  # (iterating draws a seed)
    torch.manual_seed(0)
    parallel = fxpar.compile(
        _LogitsAndLoss(CONFIG), splitting_cluster(mesh), (first,), _logits_loss,
        example_targets=(first,), optimizer=fxpar.optim.SGD(lr=LR), batch="local",
        manual=None if plan == "ilp" else getattr(fxpar.plans, plan),
    )  # fmt: skip
    losses = [parallel.step(rows, rows).item() for (rows,) in _loader(world_size, rank, per_rank)]
    parallel.eval()
    mine = parallel(first)  # this rank's rows in, the outputs of this rank's rows out
    everyone = parallel(first, rows="global")
    return {
        "losses": losses, "state": parallel.full_state_dict(), "logits": mine["logits"],
        "loss": mine["loss"], "global logits": everyone["logits"],
    }  # fmt: skip


CASES = [
    ("data_parallel", (2,)),
    ("tensor_parallel", (2,)),
    ("fully_sharded", (2,)),
    ("ilp", (2,)),
    ("ilp", (2, 2)),
]


def _train_cases(
    rank: int, world_size: int, cases: list[tuple[str, tuple[int, ...]]], per_rank: int
) -> list[Any]:
    """:func:`_train` for each of ``cases`` in turn, in one run of processes."""
    return [_train(rank, world_size, plan, mesh, per_rank) for plan, mesh in cases]


@pytest.fixture(scope="module")
def trained() -> dict[tuple[str, tuple[int, ...]], list[Any]]:
    """Every rank's :func:`_train` results of each case of :data:`CASES`: the cases of a world
    size share one spawn (a spawn and each process's first capture cost seconds)."""
    results: dict[tuple[str, tuple[int, ...]], list[Any]] = {}
    for world_size in sorted({math.prod(mesh) for _, mesh in CASES}):
        cases = [case for case in CASES if math.prod(case[1]) == world_size]
        per_rank = spawn(_train_cases, world_size, cases, 8 // world_size)
        for index, case in enumerate(cases):
            results[case] = [rank_results[index] for rank_results in per_rank]
    return results


@pytest.mark.slow
@pytest.mark.parametrize(("plan", "mesh"), CASES)
def test_local_batches_train_like_one_device(
    plan: str, mesh: tuple[int, ...], trained: dict[tuple[str, tuple[int, ...]], list[Any]]
) -> None:
    world_size = math.prod(mesh)
    per_rank = 8 // world_size
    expected = _single_device(world_size, per_rank)
    for rank, found in enumerate(trained[plan, mesh]):
        assert found["losses"] == pytest.approx(expected["losses"], rel=1e-5)
        for name, value in expected["state"].items():
            torch.testing.assert_close(found["state"][name], value, rtol=1e-4, atol=1e-6)
        own_rows = expected["logits"].chunk(world_size)[rank]
        torch.testing.assert_close(found["logits"], own_rows, rtol=1e-4, atol=1e-5)
        global_logits = found["global logits"]
        torch.testing.assert_close(global_logits, expected["logits"], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(found["loss"], expected["loss"], rtol=1e-4, atol=1e-6)


def _uneven(rank: int, world_size: int) -> None:
    torch.set_num_threads(1)
    tokens = _dataset()[:4]
    parallel = fxpar.compile(
        GPT(CONFIG), splitting_cluster((world_size,)), (tokens,), gpt_loss,
        example_targets=(tokens,), batch="local",
    )  # fmt: skip
    rows = tokens[: 4 if rank == 0 else 3]
    parallel.step(rows, rows)


@pytest.mark.slow
def test_ranks_with_rows_of_other_shapes_fail_loudly() -> None:
    with pytest.raises(SpawnError, match="rows of the same shapes"):
        spawn(_uneven, 2)


def test_bad_batch_modes_are_refused() -> None:
    tokens = _dataset()[:4]
    with pytest.raises(FxparError, match="'global' or 'local'"):
        fxpar.compile(
            GPT(CONFIG), fxpar.Cluster((1,)), (tokens,), gpt_loss, example_targets=(tokens,),
            batch="mine",
        )  # fmt: skip
    with pytest.raises(FxparError, match="without a pipeline"):
        fxpar.compile(
            GPT(CONFIG), fxpar.Cluster((1,)), (tokens,), gpt_loss, example_targets=(tokens,),
            batch="local", pipeline=fxpar.Pipeline(stages=2, microbatches=2),
        )  # fmt: skip


def test_one_process_local_batch_is_the_whole_batch() -> None:
    expected = _single_device(1, 8)
    found = _train(0, 1, "ilp", (1,), 8)
    assert found["losses"] == pytest.approx(expected["losses"], rel=1e-5)
    torch.testing.assert_close(found["logits"], expected["logits"], rtol=1e-4, atol=1e-5)


def test_rows_option_is_checked() -> None:
    """rows='local' needs local batches and whole outputs; any other value is refused."""
    tokens = _dataset()[:4]
    compiled = {}
    for batch in ("global", "local"):
        compiled[batch] = fxpar.compile(
            GPT(CONFIG), fxpar.Cluster((1,)), (tokens,), gpt_loss, example_targets=(tokens,),
            batch=batch,
        )  # fmt: skip
    with pytest.raises(FxparError, match="for a model compiled with batch='local'"):
        compiled["global"](tokens, rows="local")
    with pytest.raises(FxparError, match="with gather=False"):
        compiled["local"](tokens, rows="local", gather=False)
    with pytest.raises(FxparError, match="'local' or 'global', got 'mine'"):
        compiled["local"](tokens, rows="mine")
    assert compiled["global"](tokens, rows="global").shape == (4, 8, CONFIG.vocab_size)
