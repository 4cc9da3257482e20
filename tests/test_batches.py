"""Batches are checked the same way by ParallelModel and PipelineModel (fxpar.runtime.batches):

- in one process: a pipeline takes batch tensors by name and refuses too few or unknown ones;
  batches of new shapes (and dtypes) go on training exactly like one device, as a
  ParallelModel's do (tests/test_batch_shapes.py);
- the digest that compares batches across ranks is equal for equal bits, NaN included;
- on 2 gloo processes: batches holding NaN (a regression with missing targets) are the same
  batch on every rank, for ParallelModel and pipelines, and train like one device; a pipeline
  fed different batches on its ranks fails on every rank unless ``check_batches=False``
  reaches it through ``fxpar.compile``, and the error advises ``batch='local'``, never a
  setting that drops rows; unchecked, a data-parallel step trains on each rank's own piece of
  the batch it was given (docs/training.md); a rank given a batch of another shape than its
  peers fails, and so do its peers, instead of planning alone and waiting for them.
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
from fxpar.runtime.batches import batch_digest, bit_sums, bit_words
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


def test_pipeline_checks_the_batch_tensors_and_their_names() -> None:
    """A batch of too few tensors or of unknown names is refused before anything runs."""
    tokens, targets = _tokens((4, 8), seed=1)
    pipelined = PipelineModel(
        _gpt(), Pipeline(stages=1, microbatches=2), (tokens,), gpt_loss,
        example_targets=(targets,), optimizer=SGD(lr=0.1),
    )  # fmt: skip
    with pytest.raises(BatchError, match=r"step takes 2 batch tensors \['input_0', 'target_0'\]"):
        pipelined.step(tokens)
    with pytest.raises(BatchError, match="unexpected or repeated batch tensor 'labels'"):
        pipelined.step(tokens, labels=targets)
    with pytest.raises(BatchError, match="cannot be cut into 2 equal pieces"):
        pipelined.step(tokens[:3], targets[:3])
    by_name = pipelined.step(input_0=tokens, target_0=targets)
    assert by_name.shape == () and pipelined.steps == 1


def _pipeline(
    model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor, stages: int = 1
) -> Any:
    return PipelineModel(
        model, Pipeline(stages=stages, microbatches=2), (tokens,), gpt_loss,
        example_targets=(targets,), optimizer=AdamW(lr=1e-2),
    )  # fmt: skip


SHAPES = [
    _tokens((4, 8), 1), _tokens((4, 6), 2), _tokens((2, 8), 3),
    (_tokens((4, 8), 4)[0].int(), _tokens((4, 8), 4)[1]), _tokens((4, 8), 5),
]  # fmt: skip


def _single_device(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    reference = _gpt()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    expected = []
    for tokens, targets in batches:
        optimizer.zero_grad()
        loss = gpt_loss(reference(tokens), targets)
        loss.backward()
        optimizer.step()
        expected.append(loss.detach())
    return torch.stack(expected)


def _two_stages_at_new_shapes(rank: int, world_size: int) -> torch.Tensor:
    torch.set_num_threads(1)
    trained = _pipeline(_gpt(), *SHAPES[0], stages=2)
    return torch.stack([trained.step(*batch) for batch in SHAPES])


@pytest.mark.slow
def test_two_stages_go_on_training_at_new_shapes() -> None:
    """On 2 gloo processes, each shape's program cut at the same split points as the
    example's: the stages keep their layers and the losses are one device's."""
    for losses in spawn(_two_stages_at_new_shapes, 2):
        torch.testing.assert_close(losses, _single_device(SHAPES), rtol=1e-5, atol=1e-6)


def test_a_pipeline_goes_on_training_at_new_shapes(tmp_path: Path) -> None:
    """AdamW steps at [4, 8], then a shorter sequence [4, 6], a short last batch [2, 8],
    another dtype, and [4, 8] again: each new shape is captured and cut at the same split
    points over the same state, and the losses are single-device training's; a checkpoint
    saved after them loads into a pipeline built for another shape."""
    trained = _pipeline(_gpt(), *SHAPES[0])
    losses = [trained.step(*batch) for batch in SHAPES]
    trained.save(tmp_path / "checkpoint")
    resumed = _pipeline(_gpt(seed=7), *_tokens((2, 16), 6))
    resumed.load(tmp_path / "checkpoint")
    last = _tokens((2, 16), 7)
    losses.append(resumed.step(*last))
    expected = _single_device([*SHAPES, last])
    torch.testing.assert_close(torch.stack(losses), expected, rtol=1e-5, atol=1e-6)


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
    unaligned = torch.arange(9, dtype=torch.uint8)[1:]  # its words start inside a word
    assert torch.equal(batch_digest([unaligned]), batch_digest([unaligned.clone()]))


DIGEST_DTYPES = [torch.int64, torch.int32, torch.uint8, torch.bool, torch.float64, torch.float32,
          torch.bfloat16, torch.float16, torch.complex64]  # fmt: skip
DIGEST_SHAPES = [(), (1,), (7,), (8, 2048), (3, 5, 7), (32, 3, 9, 9), (4099,)]


def _random(shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator) -> Any:
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, generator=generator, dtype=dtype)
    return torch.randint(0, 100, shape, generator=generator, dtype=dtype)


def _other_value(value: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Another bit pattern for one element: one bit flipped (a nearby or sign-flipped value,
    the differences a checksum is likeliest to miss)."""
    if value.dtype == torch.bool:
        return ~value  # a bool is its lowest bit
    bits = value.reshape(1).view(torch.uint8).clone()
    byte = int(torch.randint(0, bits.numel(), (1,), generator=generator))
    bit = int(torch.randint(0, 8, (1,), generator=generator))
    bits[byte] ^= 1 << bit
    return bits.view(value.dtype).reshape(())


@pytest.mark.parametrize("dtype", DIGEST_DTYPES, ids=str)
def test_one_two_or_three_changed_elements_are_always_caught(dtype: torch.dtype) -> None:
    """The guarantee of the bit sums (fxpar.runtime.batches.bit_sums): a batch that differs in
    1, 2 or 3 elements (one bit flipped in each: the smallest change), or in two swapped
    elements, has another digest, for every dtype, shape and position sampled."""
    generator = torch.Generator().manual_seed(0)
    for shape in DIGEST_SHAPES:
        batch = _random(shape, dtype, generator)
        digest = batch_digest([batch])
        count = batch.numel()
        for trial in range(20):
            changed = batch.clone().reshape(-1)
            positions = torch.randperm(count, generator=generator)[: 1 + trial % 3]
            for position in positions.tolist():
                changed[position] = _other_value(changed[position], generator)
            assert not torch.equal(batch_digest([changed.reshape(shape)]), digest), (
                shape,
                positions,
            )
            if count < 2:
                continue
            first, second = torch.randperm(count, generator=generator)[:2].tolist()
            swapped = batch.clone().reshape(-1)
            if torch.equal(swapped[first].reshape(1).view(torch.uint8),
                           swapped[second].reshape(1).view(torch.uint8)):  # fmt: skip
                continue  # the same bits: the same batch
            swapped[[first, second]] = swapped[[second, first]]
            assert not torch.equal(batch_digest([swapped.reshape(shape)]), digest), (
                shape,
                first,
                second,
            )


def test_what_the_bit_sums_do_not_catch() -> None:
    """As docs/training.md says: four words changed at the corners of a rectangle of the
    sums' matrix (+d, -d in one row, -d, +d in another, the same two columns) keep every row
    and column sum, so the digest is the same; swapping the two rows' contents instead is
    caught (the sums come in order)."""
    batch = torch.zeros(64, dtype=torch.int64)  # 64 words: a matrix 8 wide, 8 rows
    corners = batch.clone()
    corners[[1, 3, 17, 19]] = torch.tensor([5, -5, -5, 5])  # rows 0 and 2, columns 1 and 3
    assert torch.equal(batch_digest([corners]), batch_digest([batch]))
    rows = torch.arange(64)
    swapped_rows = rows.reshape(8, 8)[[1, 0, *range(2, 8)]].reshape(-1)
    assert not torch.equal(batch_digest([swapped_rows]), batch_digest([rows]))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.float16])
def test_bit_sums_are_wrapping_sums_of_the_words(dtype: torch.dtype) -> None:
    """bit_sums computes what its docstring says, checked against Python integers modulo
    2**bits of a word: the row sums, then the column sums, of the words laid out row by row
    in rows of the smallest power-of-two width whose square holds them (sums that overflow
    included)."""
    generator = torch.Generator().manual_seed(1)
    for count in (1, 5, 64, 100, 1003):
        if dtype.is_floating_point:
            tensor = torch.randn(count, generator=generator).to(dtype)
        else:
            high = 256 if dtype == torch.uint8 else 2**31 - 1
            tensor = torch.randint(0, high, (count,), generator=generator, dtype=dtype)
        words = bit_words(tensor)
        bits = words.element_size() * 8
        values = [int(v) for v in words.tolist()]
        width = 1
        while width * width < len(values):
            width *= 2
        matrix = [values[i : i + width] for i in range(0, len(values), width)]
        columns = [sum(row[c] for row in matrix if c < len(row)) for c in range(width)]
        expected = [sum(row) for row in matrix] + columns
        wrapped = [(v + 2 ** (bits - 1)) % 2**bits - 2 ** (bits - 1) for v in expected]
        assert bit_sums(tensor).tolist() == wrapped


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
    results["loss before"] = pipelined.loss(inputs, targets)
    try:  # compared during stage 0's first forward, before any message
        pipelined.step(*other)
    except BatchError as error:
        results["different"] = str(error)
    results["loss after"] = pipelined.loss(inputs, targets)  # no stale message received
    try:  # compared while the step runs, up to its first collective, where both ranks raise
        parallel.step(*other)
    except BatchError as error:
        results["parallel different"] = str(error)
    unchecked = _regression(rank, world_size, pipeline=pipeline, check_batches=False)
    results["unchecked"] = unchecked.step(*other)
    unchecked_parallel = _regression(
        rank, world_size, manual=plans.data_parallel, check_batches=False
    )
    results["unchecked parallel"] = unchecked_parallel.step(*other)

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
    reference = _Regressor()
    expected = _masked_mse(reference(inputs), targets)
    for rank, results in enumerate(ranks):
        torch.testing.assert_close(results["parallel"], expected, msg=f"rank {rank}")
        torch.testing.assert_close(results["pipeline"], expected, msg=f"rank {rank}")
        for name in ("different", "parallel different"):
            message = results[name]
            assert f"rank {rank} got a different batch than ranks [{1 - rank}]" in message
            # The advice for per-rank data is local batches; never a setting that drops rows.
            assert "batch='local'" in message and "check_batches" not in message
        assert torch.isfinite(results["unchecked"])  # trained on a mixture, as asked
        # As docs/training.md says: unchecked, each rank keeps its own piece of the batch it
        # was given, so the step trains on rank 0's first half and rank 1's second half.
        mixed = torch.cat([inputs[:4], inputs[4:] + 1])
        torch.testing.assert_close(
            results["unchecked parallel"], _masked_mse(reference(mixed), targets)
        )
        assert torch.equal(results["loss before"], results["loss after"])
    # Both would plan rank 1's new shape, but the ranks first compare batches, and both say
    # they differ (no rank goes on to plan alone and wait for the other).
    for rank in (0, 1):
        for name in ("parallel", "pipeline"):
            message = ranks[rank][f"{name} shape"]
            assert f"rank {rank} got a different batch than ranks [{1 - rank}]" in message


def test_check_batches_reaches_the_pipeline() -> None:
    """fxpar.compile passes check_batches on to the PipelineModel it builds."""
    tokens, targets = _tokens((4, 8), seed=1)
    pipelined = fxpar.compile(
        copy.deepcopy(_gpt()), Cluster((1,)), (tokens,), gpt_loss, example_targets=(targets,),
        pipeline=Pipeline(stages=1, microbatches=2), check_batches=False,
    )  # fmt: skip
    assert isinstance(pipelined, PipelineModel) and not pipelined.check_batches
