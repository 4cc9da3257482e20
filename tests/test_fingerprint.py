"""Ranks that build different models fail at compile, on every rank, naming the first tensor
that differs, instead of hanging in (or silently mis-pairing) the broadcast of rank 0's
weights."""

from __future__ import annotations

import time

import pytest
import torch

import fxpar
from fxpar import plans
from fxpar.errors import DistributedError
from fxpar.models import GPT, GPTConfig, gpt_loss
from fxpar.pipeline import Pipeline
from fxpar.runtime.fingerprint import Entry, describe_difference
from fxpar.runtime.launch import spawn

F32 = "torch.float32"


def test_the_difference_names_the_tensor_and_both_shapes() -> None:
    rank0 = [("wte.weight", (64, 32), F32), ("ln.weight", (32,), F32)]
    rank1 = [("wte.weight", (64, 48), F32), ("ln.weight", (48,), F32)]
    message = describe_difference([rank0, rank0, rank1])
    assert message.startswith(
        "rank 2 built a different model than rank 0: 'wte.weight' is float32[64, 32] on rank 0 "
        "but float32[64, 48] on rank 2"
    )
    assert "every rank must build the same model" in message


@pytest.mark.parametrize(
    ("other", "expected"),
    [
        ([("a", (2,), F32)], "rank 0 has 'b' (float32[3]), which rank 1 lacks"),
        ([("a", (2,), F32), ("c", (3,), F32)], "rank 0 has 'b' (float32[3]), which rank 1 lacks"),
        ([("a", (2,), F32), ("b", (3,), "torch.float16")], "'b' is float32[3] on rank 0 but"),
        ([("b", (3,), F32), ("a", (2,), F32)], "another order: number 0 is 'a' on rank 0"),
        ([("a", (2,), F32), ("b", (3,), F32), ("c", (1,), F32)], "rank 1 has 'c' (float32[1])"),
    ],
    ids=["missing", "renamed", "dtype", "order", "extra"],
)
def test_the_difference_is_found_whatever_it_is(other: list[Entry], expected: str) -> None:
    rank0 = [("a", (2,), F32), ("b", (3,), F32)]
    assert expected in describe_difference([rank0, other])


CONFIG = GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=16)


def _compile_with_rank_one_wider(rank: int, world_size: int) -> dict[str, str]:
    """Each way to compile, with rank 1's model 48 wide instead of 32: what each raised."""
    torch.set_num_threads(1)
    config = CONFIG if rank == 0 else GPTConfig(**{**vars(CONFIG), "n_embd": 48})
    tokens = torch.randint(0, CONFIG.vocab_size, (4, 8), generator=torch.Generator())
    ways = {
        "data_parallel": {"manual": plans.data_parallel},
        "pipeline": {"pipeline": Pipeline(stages=2, microbatches=2)},
    }
    raised = {}
    for way, options in ways.items():
        try:
            fxpar.compile(
                GPT(config), fxpar.Cluster((world_size,)), (tokens,), gpt_loss,
                example_targets=(tokens,), **options,  # type: ignore[arg-type]
            )  # fmt: skip
            raised[way] = "nothing"
        except DistributedError as error:
            raised[way] = f"DistributedError: {error}"
    return raised


@pytest.mark.slow
def test_ranks_that_build_different_models_all_raise_at_compile() -> None:
    started = time.monotonic()
    # A short collective timeout, so that a regression fails here instead of hanging.
    by_rank = spawn(_compile_with_rank_one_wider, 2, timeout_s=30)
    for raised in by_rank:
        for way in ("data_parallel", "pipeline"):
            assert raised[way].startswith(
                "DistributedError: rank 1 built a different model than rank 0: 'wte.weight' is "
                "float32[64, 32] on rank 0 but float32[64, 48] on rank 1"
            ), way
    assert time.monotonic() - started < 60
