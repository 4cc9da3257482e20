"""Batches are checked the same way by ParallelModel and PipelineModel (fxpar.runtime.batches):

- in one process: a pipeline rejects a batch whose shape differs beyond dimension 0, or whose
  dtype differs, and takes batch tensors by name; a batch of a new shape says how to go on
  training, and doing what it says (save, compile for the new shape, load) continues exactly
  like single-device training (a ParallelModel plans new shapes by itself:
  tests/test_batch_shapes.py);
- the digest that compares batches across ranks is equal for equal bits, NaN included;
- on 2 gloo processes: batches holding NaN (a regression with missing targets) are the same
  batch on every rank, for ParallelModel and pipelines, and train like one device; a pipeline
  fed different batches on its ranks fails on every rank unless ``check_batches=False``
  reaches it through ``fxpar.compile``; a rank given a batch of the wrong shape fails, and so
  do its peers, instead of waiting for it.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import fxpar
from fxpar import plans
from fxpar.cluster import Cluster
from fxpar.errors import BatchError
from fxpar.models import GPT, GPTConfig, gpt_loss
from fxpar.optim import SGD, AdamW
from fxpar.pipeline import Pipeline, PipelineModel
from fxpar.runtime.batches import batch_digest
from fxpar.runtime.launch import spawn

CONFIG = GPTConfig(n_layer=2, n_embd=16, n_head=2, vocab_size=32, block_size=16)


def _tokens(shape: tuple[int, int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (
        torch.randint(0, CONFIG.vocab_size, shape, generator=generator),
        torch.randint(0, CONFIG.vocab_size, shape, generator=generator),
    )


def _gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(CONFIG)


def test_pipeline_checks_the_whole_shape_dtype_and_names() -> None:
    """Before, a pipeline checked dimension 0 only: int32 tokens trained silently and a
    shorter sequence failed deep inside a stage's program."""
    tokens, targets = _tokens((4, 8), seed=1)
    pipelined = PipelineModel(
        _gpt(), Pipeline(stages=1, microbatches=2), (tokens,), gpt_loss,
        example_targets=(targets,), optimizer=SGD(lr=0.1),
    )  # fmt: skip
    with pytest.raises(BatchError, match=r"'input_0' is int64\[4, 6\] but .* for int64\[4, 8\]"):
        pipelined.step(tokens[:, :6], targets[:, :6])
    with pytest.raises(BatchError, match=r"'input_0' is int32\[4, 8\] but .* for int64\[4, 8\]"):
        pipelined.step(tokens.int(), targets)
    with pytest.raises(BatchError, match=r"step takes 2 batch tensors \['input_0', 'target_0'\]"):
        pipelined.step(tokens)
    with pytest.raises(BatchError, match="unexpected or repeated batch tensor 'labels'"):
        pipelined.step(tokens, labels=targets)
    by_name = pipelined.step(input_0=tokens, target_0=targets)
    assert by_name.shape == () and pipelined.steps == 1


def _pipeline(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> Any:
    return PipelineModel(
        model, Pipeline(stages=1, microbatches=2), (tokens,), gpt_loss,
        example_targets=(targets,), optimizer=AdamW(lr=1e-2),
    )  # fmt: skip


@pytest.mark.parametrize("build", [_pipeline], ids=["pipeline"])
def test_a_new_shape_goes_on_from_a_checkpoint(build: Any, tmp_path: Path) -> None:
    """Two AdamW steps at [4, 8], then a batch of [2, 16]: the error says to save, compile
    for the new shape and load; doing exactly that (into a model initialized differently)
    gives single-device training's losses for the two steps at the new shape. Compiling
    again alone would have restarted from the initial weights."""
    first = [_tokens((4, 8), seed) for seed in (1, 2)]
    second = [_tokens((2, 16), seed) for seed in (3, 4)]
    trained = build(_gpt(), *first[0])
    losses = [trained.step(*batch) for batch in first]
    advice = r"save a checkpoint \(\.save\(path\) on every rank\), compile for the new shape"
    with pytest.raises(BatchError, match=advice):
        trained.step(*second[0])
    trained.save(tmp_path / "checkpoint")
    resumed = build(_gpt(seed=7), *second[0])
    resumed.load(tmp_path / "checkpoint")
    losses += [resumed.step(*batch) for batch in second]

    reference = _gpt()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    expected = []
    for tokens, targets in first + second:
        optimizer.zero_grad()
        loss = gpt_loss(reference(tokens), targets)
        loss.backward()
        optimizer.step()
        expected.append(loss.detach())
    torch.testing.assert_close(torch.stack(losses), torch.stack(expected), rtol=1e-5, atol=1e-6)


def test_digests_compare_bits_so_nan_equals_itself() -> None:
    """Equal bits give equal digests (NaN included, which a float checksum calls different
    from itself); one changed element, a changed dtype or shape, give another."""
    batch = torch.tensor([[1.0, float("nan")], [float("inf"), -2.0]])
    tokens = torch.arange(6).reshape(2, 3)
    digest = batch_digest([batch, tokens])
    assert torch.equal(digest, batch_digest([batch.clone(), tokens.clone()]))
    assert digest.shape == (2, 32) and digest.dtype == torch.uint8
    changed = batch.clone()
    changed[1, 1] = -2.0000002
    for other in ([changed, tokens], [batch, tokens.int()], [batch, tokens.reshape(3, 2)]):
        assert not torch.equal(batch_digest(other), digest)
    assert torch.equal(batch_digest([batch.t()]), batch_digest([batch.t().contiguous()]))


class _Regressor(nn.Sequential):
    def __init__(self) -> None:
        super().__init__(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _masked_mse(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error over the targets that are known (not NaN)."""
    known = ~torch.isnan(target)
    error = (prediction.squeeze(-1) - target.nan_to_num()) ** 2
    return (error * known).sum() / known.sum()


def _regression_batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(8, 4, generator=generator)
    targets = torch.randn(8, generator=generator)
    targets[[1, 2, 3, 6]] = float("nan")  # micro-batches of 2 know 1, 0, 2 and 1 targets
    return inputs, targets


def _regression(rank: int, world_size: int, **options: Any) -> Any:
    torch.manual_seed(0)
    inputs, targets = _regression_batch()
    return fxpar.compile(
        _Regressor(), Cluster((world_size,)), (inputs,), _masked_mse,
        example_targets=(targets,), optimizer=SGD(lr=0.1), **options,
    )  # fmt: skip


def _two_ranks(rank: int, world_size: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    inputs, targets = _regression_batch()
    results: dict[str, Any] = {}
    parallel = _regression(rank, world_size, manual=plans.data_parallel)
    results["parallel"] = parallel.step(inputs, targets)
    pipeline = Pipeline(stages=("2",), microbatches=4)
    pipelined = _regression(rank, world_size, pipeline=pipeline)
    results["pipeline"] = pipelined.step(inputs, targets)

    other = (inputs + rank, targets)  # rank 1 is fed another batch
    try:
        pipelined.step(*other)
    except BatchError as error:
        results["different"] = str(error)
    unchecked = _regression(rank, world_size, pipeline=pipeline, check_batches=False)
    results["unchecked"] = unchecked.step(*other)

    for name, model in (("parallel", parallel), ("pipeline", pipelined)):
        try:  # rank 1 drops a row
            model.step(inputs[: 8 - rank], targets[: 8 - rank])
        except BatchError as error:
            results[f"{name} shape"] = str(error)
    return results


@pytest.mark.slow
def test_batches_are_checked_alike_on_every_rank() -> None:
    ranks = spawn(_two_ranks, 2)
    inputs, targets = _regression_batch()
    torch.manual_seed(0)
    expected = _masked_mse(_Regressor()(inputs), targets)
    for rank, results in enumerate(ranks):
        torch.testing.assert_close(results["parallel"], expected, msg=f"rank {rank}")
        torch.testing.assert_close(results["pipeline"], expected, msg=f"rank {rank}")
        assert f"rank {rank} got a different batch than ranks [{1 - rank}]" in results["different"]
        assert torch.isfinite(results["unchecked"])  # trained on a mixture, as asked
    # A pipeline is compiled for one shape: rank 1 refuses its batch and rank 0 hears of it.
    assert (
        "'input_0' is float32[7, 4] but the model was compiled for float32[8, 4]"
        in ranks[1]["pipeline shape"]
    )
    assert "ranks [1] were given batches that do not match" in ranks[0]["pipeline shape"]
    # A ParallelModel would plan rank 1's new shape, but the ranks first compare batches,
    # and both say they differ (no rank goes on to plan alone and wait for the other).
    for rank in (0, 1):
        assert (
            f"rank {rank} got a different batch than ranks [{1 - rank}]"
            in (ranks[rank]["parallel shape"])
        )


def test_check_batches_reaches_the_pipeline() -> None:
    """fxpar.compile passes check_batches on to the PipelineModel it builds."""
    tokens, targets = _tokens((4, 8), seed=1)
    pipelined = fxpar.compile(
        copy.deepcopy(_gpt()), Cluster((1,)), (tokens,), gpt_loss, example_targets=(targets,),
        pipeline=Pipeline(stages=1, microbatches=2), check_batches=False,
    )  # fmt: skip
    assert isinstance(pipelined, PipelineModel) and not pipelined.check_batches
