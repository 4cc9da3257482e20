"""A pipeline's training loop on gloo ranks equals single-device PyTorch, as ParallelModel's does
(tests/test_training_loop.py): gradient clipping by the global norm
(torch.nn.utils.clip_grad_norm_, 2-norm and inf-norm), gradient accumulation (``accumulate=2``,
and ``backward`` twice with ``scale=1/2``), and ``loss()``, which runs only the forwards of the
schedule and changes nothing.

The norm counts every piece of every gradient once, which each layout below tests a part of:
GPT ties its embedding to its head, so ``wte.weight`` is held by the first and the last stage
in every case; 2 stages x 2 data-parallel replicas hold identical gradients; the ILP's plan on
a (2, 2) cluster (a stage mesh of 2 devices) splits some parameters and replicates others.

Two spawns (2 ranks, 4 ranks) run every check and return their results; the parent compares
them with eager PyTorch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from conftest import eager_step, train_eager

import fxpar
from fxpar.errors import BatchError, FxparError
from fxpar.models import GPT, GPTConfig, gpt_loss
from fxpar.pipeline import Op, Pipeline, PipelineModel, build_schedule, simulate
from fxpar.pipeline.schedule import forward_only
from fxpar.runtime.launch import spawn

pytestmark = pytest.mark.slow

CONFIG = GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=16, bias=False)
LR = 0.5
MAX_NORM = 0.3  # below the gradients' norm, so clipping changes every update
TINY_NORM = 1e-3
STEPS = 3
SPLIT = ("blocks.1",)  # stage 0: embeddings and blocks.0; stage 1: blocks.1, the tied head
LAYOUTS = ("2 stages", "2 stages x 2 replicas", "2 stages x stage mesh (2,)")


def _batches(size: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return [
        torch.randint(0, CONFIG.vocab_size, (size, 8), generator=generator) for _ in range(STEPS)
    ]


def _probe() -> torch.Tensor:
    generator = torch.Generator().manual_seed(4)
    return torch.randint(0, CONFIG.vocab_size, (4, 8), generator=generator)


def _pipelined(layout: str, config: GPTConfig = CONFIG) -> PipelineModel:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    tokens = _batches(4)[0]
    common: dict[str, Any] = {
        "example_targets": (tokens,),
        "optimizer": fxpar.optim.SGD(lr=LR),
    }
    if layout == "2 stages x stage mesh (2,)":
        pipelined = fxpar.compile(
            GPT(config), fxpar.Cluster((2, 2)), (tokens,), gpt_loss, **common,
            pipeline=Pipeline(stages=2, microbatches=2),
        )  # fmt: skip
        assert isinstance(pipelined, PipelineModel)
        return pipelined
    replicas = 2 if layout == "2 stages x 2 replicas" else 1
    pipeline = Pipeline(stages=SPLIT, microbatches=2, data_parallel=replicas)
    return PipelineModel(GPT(config), pipeline, (tokens,), gpt_loss, **common)


def _train_clipped(layout: str) -> dict[str, Any]:
    """Three steps of backward / clip_grad_norm_ / optimizer_step / zero_grad, then the loss of
    the trained weights on a probe batch and the inf-norm of its gradient."""
    pipelined = _pipelined(layout)
    losses, norms = [], []
    for tokens in _batches(4):
        losses.append(pipelined.backward(tokens, tokens).item())
        norms.append(pipelined.clip_grad_norm_(MAX_NORM).item())
        pipelined.optimizer_step()
        pipelined.zero_grad()
    state = pipelined.full_state_dict()
    probe = _probe()
    probe_loss = pipelined.loss(probe, probe).item()
    pipelined.backward(probe, probe)
    inf_norm = pipelined.clip_grad_norm_(TINY_NORM, norm_type=math.inf).item()
    return {
        "losses": losses,
        "norms": norms,
        "state": state,
        "probe_loss": probe_loss,
        "inf_norm": inf_norm,
        "shared": pipelined.split.shared_parameters(),
        "sharded": pipelined.sharded is not None,
    }


def _one_call_with_loss_calls() -> dict[str, Any]:
    """step(..., max_grad_norm=) with a loss() of the same batch before every step, and what
    loss() left unchanged."""
    pipelined = _pipelined("2 stages")
    evaluated, losses, unchanged = [], [], []
    for tokens in _batches(4):
        before = (pipelined.full_state_dict(), pipelined.random.state.clone(), pipelined.steps)
        evaluated.append(pipelined.loss(tokens, tokens).item())
        after = (pipelined.full_state_dict(), pipelined.random.state.clone(), pipelined.steps)
        grads = [p.grad for p in pipelined.parameters.values()]
        unchanged.append(
            all(torch.equal(before[0][n], after[0][n]) for n in before[0])
            and torch.equal(before[1], after[1])
            and before[2] == after[2]
            and all(grad is None for grad in grads)
        )
        losses.append(pipelined.step(tokens, tokens, max_grad_norm=MAX_NORM).item())
    return {
        "evaluated": evaluated,
        "losses": losses,
        "unchanged": unchanged,
        "state": pipelined.full_state_dict(),
        "steps": pipelined.steps,
    }


def _accumulated(layout: str = "2 stages") -> dict[str, Any]:
    """step(batch of 8, accumulate=2) for every batch; and, on another model, one update from
    backward twice with scale 1/2 (each reducing its gradients), counting the all-reduces of
    both: accumulating reduces the gradients once, so it runs fewer."""
    pipelined = _pipelined(layout)
    with _counting_all_reduces() as accumulating:
        losses = [pipelined.step(t, t, accumulate=2).item() for t in _batches(8)[:1]]
    losses += [pipelined.step(t, t, accumulate=2).item() for t in _batches(8)[1:]]
    by_hand = _pipelined(layout)
    whole = _batches(8)[0]
    with _counting_all_reduces() as reducing_each:
        pieces = [by_hand.backward(piece, piece, scale=0.5) for piece in whole.chunk(2)]
        by_hand.optimizer_step()
    by_hand.zero_grad()
    return {
        "losses": losses,
        "state": pipelined.full_state_dict(),
        "by_hand_loss": torch.stack(pieces).mean().item(),
        "by_hand_state": by_hand.full_state_dict(),
        "all-reduces": (accumulating[0], reducing_each[0]),
    }


@contextlib.contextmanager
def _counting_all_reduces() -> Iterator[list[int]]:
    """Count the calls of torch.distributed.all_reduce in the block (fxpar's collectives and
    the pipeline's gradient reductions call it through the module)."""
    count = [0]
    original = dist.all_reduce

    def counted(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return original(*args, **kwargs)

    dist.all_reduce = counted
    try:
        yield count
    finally:
        dist.all_reduce = original


def _with_dropout() -> dict[str, Any]:
    """With dropout, loss() draws the masks the next step draws, and leaves the random state."""
    pipelined = _pipelined("2 stages", dataclasses.replace(CONFIG, dropout=0.2))
    tokens = _batches(4)[0]
    state = pipelined.random.state.clone()
    evaluated = pipelined.loss(tokens, tokens)
    restored = torch.equal(pipelined.random.state, state)
    trained = pipelined.step(tokens, tokens)
    return {
        "evaluated": evaluated.item(),
        "trained": trained.item(),
        "restored": restored,
        "advanced": not torch.equal(pipelined.random.state, state),
    }


def _on_two_ranks(rank: int, world_size: int) -> dict[str, Any]:
    return {
        "clipped": _train_clipped("2 stages"),
        "one_call": _one_call_with_loss_calls(),
        "accumulated": _accumulated(),
        "dropout": _with_dropout(),
    }


def _on_four_ranks(rank: int, world_size: int) -> dict[str, Any]:
    results = {layout: _train_clipped(layout) for layout in LAYOUTS[1:]}
    results.update({f"accumulated, {layout}": _accumulated(layout) for layout in LAYOUTS[1:]})
    return results


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return spawn(_on_two_ranks, 2, timeout_s=240)


@pytest.fixture(scope="module")
def four_ranks() -> list[dict[str, Any]]:
    return spawn(_on_four_ranks, 4, timeout_s=240)


def _eager(size: int, max_norm: float | None) -> dict[str, Any]:
    """Single-device SGD on the same batches, then the probe batch's loss and inf-norm."""
    torch.manual_seed(0)
    model = GPT(CONFIG)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses, norms = train_eager(model, optimizer, _batches(size), max_norm=max_norm)
    state = {name: value.clone() for name, value in model.state_dict().items()}
    probe = _probe()
    probe_loss, _ = eager_step(model, (probe,), gpt_loss, (probe,))
    inf_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), TINY_NORM, norm_type=math.inf)
    return {
        "losses": losses,
        "norms": norms,
        "state": state,
        "probe_loss": probe_loss.item(),
        "inf_norm": inf_norm.item(),
    }


@pytest.fixture(scope="module")
def clipped_reference() -> dict[str, Any]:
    reference = _eager(4, MAX_NORM)
    assert all(norm > MAX_NORM for norm in reference["norms"])  # clipping bites every step
    return reference


def _assert_state(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert state.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(state[name], value, rtol=1e-4, atol=1e-6, msg=name)


def _results(layout: str, request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    if layout == "2 stages":
        return [rank["clipped"] for rank in request.getfixturevalue("two_ranks")]
    return [rank[layout] for rank in request.getfixturevalue("four_ranks")]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_clipping_by_the_global_norm_equals_torch(
    layout: str, clipped_reference: dict[str, Any], request: pytest.FixtureRequest
) -> None:
    """Losses, the norms before clipping (the same on every rank) and the weights after three
    clipped SGD steps are single-device PyTorch's, with the tied embedding counted once."""
    for result in _results(layout, request):
        assert result["shared"] == {"wte.weight": (0, 1)}
        assert result["sharded"] == (layout == LAYOUTS[2])
        assert result["norms"] == pytest.approx(clipped_reference["norms"], rel=1e-5)
        assert result["losses"] == pytest.approx(clipped_reference["losses"], rel=1e-5)
        _assert_state(result["state"], clipped_reference["state"])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_infinity_norm_and_the_loss_of_trained_weights_equal_torch(
    layout: str, clipped_reference: dict[str, Any], request: pytest.FixtureRequest
) -> None:
    for result in _results(layout, request):
        assert result["inf_norm"] == pytest.approx(clipped_reference["inf_norm"], rel=1e-5)
        assert result["probe_loss"] == pytest.approx(clipped_reference["probe_loss"], rel=1e-5)


def test_loss_changes_nothing_and_equals_the_steps_loss(
    two_ranks: list[dict[str, Any]], clipped_reference: dict[str, Any]
) -> None:
    """loss() before every step reports the loss that step reports, leaves the weights, the
    random state, the step count and the gradients as they were, and the steps after it train
    exactly as the loop without loss() calls (single-device PyTorch's)."""
    without_loss_calls = two_ranks[0]["clipped"]["state"]
    for rank in two_ranks:
        result = rank["one_call"]
        assert all(result["unchanged"])
        assert result["evaluated"] == result["losses"]
        assert result["losses"] == pytest.approx(clipped_reference["losses"], rel=1e-5)
        assert result["steps"] == STEPS
        _assert_state(result["state"], clipped_reference["state"])
        for name, value in without_loss_calls.items():
            assert torch.equal(result["state"][name], value), name


def test_loss_draws_what_the_next_step_draws(two_ranks: list[dict[str, Any]]) -> None:
    for rank in two_ranks:
        result = rank["dropout"]
        assert result["restored"] and result["advanced"]
        assert result["evaluated"] == result["trained"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_accumulating_two_pieces_equals_one_step_on_the_whole_batch(
    layout: str, request: pytest.FixtureRequest
) -> None:
    """Tied weights across stages (2 stages), replicas and a stage plan: the gradients of the
    pieces are summed unreduced and reduced once per update, which equals one step on the
    whole batch and runs fewer all-reduces than reducing after each piece."""
    reference = _eager(8, None)
    torch.manual_seed(0)
    one_step = GPT(CONFIG)
    first_loss, _ = eager_step(one_step, (_batches(8)[0],), gpt_loss, (_batches(8)[0],))
    torch.optim.SGD(one_step.parameters(), lr=LR).step()
    ranks = request.getfixturevalue("two_ranks" if layout == LAYOUTS[0] else "four_ranks")
    for rank in ranks:
        result = rank["accumulated" if layout == LAYOUTS[0] else f"accumulated, {layout}"]
        assert result["losses"] == pytest.approx(reference["losses"], rel=1e-5)
        _assert_state(result["state"], reference["state"])
        assert result["by_hand_loss"] == pytest.approx(first_loss.item(), rel=1e-5)
        _assert_state(result["by_hand_state"], one_step.state_dict())
        accumulating, reducing_each = result["all-reduces"]
        assert accumulating < reducing_each


def test_bad_arguments_are_refused_before_anything_runs() -> None:
    """One stage in this process (no process group): each mistake raises a typed error and
    leaves the model as it was."""
    torch.manual_seed(0)
    tokens = _batches(4)[0]
    pipelined = PipelineModel(
        GPT(CONFIG), Pipeline(stages=1, microbatches=2), (tokens,), gpt_loss,
        example_targets=(tokens,), optimizer=fxpar.optim.SGD(lr=LR),
    )  # fmt: skip
    assert pipelined.clip_grad_norm_(1.0).item() == 0.0  # no gradients yet: nothing to clip
    with pytest.raises(BatchError, match="accumulate=3 splits the batch into 3 equal pieces"):
        pipelined.step(tokens, tokens, accumulate=3)
    with pytest.raises(FxparError, match="accumulate must be at least 1"):
        pipelined.step(tokens, tokens, accumulate=0)
    with pytest.raises(FxparError, match="max_norm >= 0"):
        pipelined.step(tokens, tokens, max_grad_norm=-1.0)
    with pytest.raises(FxparError, match="max_norm >= 0"):
        pipelined.clip_grad_norm_(-1.0)
    with pytest.raises(FxparError, match="norm_type > 0"):
        pipelined.clip_grad_norm_(1.0, norm_type=0.0)
    with pytest.raises(BatchError, match="cannot be cut into 2 equal pieces"):
        pipelined.loss(tokens[:3], tokens[:3])
    assert pipelined.steps == 0
    assert all(p.grad is None for p in pipelined.parameters.values())


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_the_forward_halves_of_the_schedules_run_every_forward_without_deadlock(
    schedule: str,
) -> None:
    for stages, microbatches in [(1, 1), (2, 3), (4, 2), (4, 8)]:
        lists = [forward_only(i) for i in build_schedule(schedule, stages, microbatches)]
        simulate(lists)
        for stage, instructions in enumerate(lists):
            forwards = [i.microbatch for i in instructions if i.op is Op.FORWARD]
            assert forwards == list(range(microbatches)), (stage, instructions)
            assert {i.op for i in instructions} <= {
                Op.RECV_ACTIVATION, Op.FORWARD, Op.SEND_ACTIVATION
            }  # fmt: skip
