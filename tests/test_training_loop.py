"""The training loop's parts on gloo ranks equal single-device PyTorch: gradient clipping by the
global norm (torch.nn.utils.clip_grad_norm_), gradient accumulation (k pieces before one update
equal one step on the whole batch), and backward / clip / optimizer_step / zero_grad called one
by one equal the one-call step. Each runs under data, tensor and fully sharded parallelism and
the ILP's plan, whose parameters are split and replicated in different ways, so the norm's
count of replicated pieces is exercised."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import train_eager

import fxpar
from fxpar.errors import BatchError, FxparError
from fxpar.lowering import lower
from fxpar.models import GPT, GPTConfig, gpt_loss
from fxpar.runtime.launch import spawn
from fxpar.testing.strategies import splitting_cluster

pytestmark = pytest.mark.slow

CONFIG = GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=16, bias=False)
LR = 0.5
MAX_NORM = 0.3  # below the gradients' norm, so clipping changes every update
STEPS = 3
PLANS = ("data_parallel", "tensor_parallel", "fully_sharded", "ilp")


def _batches(size: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return [
        torch.randint(0, CONFIG.vocab_size, (size, 8), generator=generator) for _ in range(STEPS)
    ]


def _single_device(size: int, max_norm: float | None) -> dict[str, object]:
    torch.manual_seed(0)
    model = GPT(CONFIG)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses, norms = train_eager(model, optimizer, _batches(size), max_norm=max_norm)
    return {"losses": losses, "norms": norms, "state": model.state_dict()}


def _compile(
    world_size: int, plan: str, mesh: tuple[int, ...] | None = None
) -> fxpar.ParallelModel:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    tokens = _batches(4)[0]
    manual = None if plan == "ilp" else getattr(fxpar.plans, plan)
    return fxpar.compile(
        GPT(CONFIG), splitting_cluster(mesh or (world_size,)), (tokens,), gpt_loss,
        example_targets=(tokens,), optimizer=fxpar.optim.SGD(lr=LR), manual=manual,
    )  # fmt: skip


def _clip(rank: int, world_size: int, plan: str, mesh: tuple[int, ...]) -> dict[str, object]:
    parallel = _compile(world_size, plan, mesh)
    losses, norms = [], []
    for tokens in _batches(4):
        losses.append(parallel.backward(tokens, tokens).item())
        norms.append(parallel.clip_grad_norm_(MAX_NORM).item())
        parallel.optimizer_step()
        parallel.zero_grad()
    return {"losses": losses, "norms": norms, "state": parallel.full_state_dict()}


def _one_call(rank: int, world_size: int, plan: str) -> dict[str, object]:
    parallel = _compile(world_size, plan)
    losses, norms = [], []
    for tokens in _batches(4):
        losses.append(parallel.step(tokens, tokens, max_grad_norm=MAX_NORM).item())
        assert parallel.grad_norm is not None
        norms.append(parallel.grad_norm.item())
    state = {name: value.clone() for name, value in parallel.full_state_dict().items()}
    parallel.step(tokens, tokens)  # a step without clipping keeps no norm
    return {"losses": losses, "norms": norms, "unclipped": parallel.grad_norm, "state": state}


def _accumulate(rank: int, world_size: int, plan: str) -> dict[str, object]:
    parallel = _compile(world_size, plan)
    losses = [parallel.step(t, t, accumulate=2).item() for t in _batches(8)]
    return {"losses": losses, "state": parallel.full_state_dict()}


def _assert_trains_like(result: dict[str, object], reference: dict[str, object]) -> None:
    assert result["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    state = result["state"]
    assert isinstance(state, dict)
    for name, value in reference["state"].items():  # type: ignore[attr-defined]
        torch.testing.assert_close(state[name], value, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize(("plan", "mesh"), [*((p, (2,)) for p in PLANS), ("ilp", (2, 2))])
def test_clipping_by_the_global_norm_equals_torch(plan: str, mesh: tuple[int, ...]) -> None:
    reference = _single_device(4, MAX_NORM)
    assert all(norm > MAX_NORM for norm in reference["norms"])  # type: ignore[attr-defined]
    for result in spawn(_clip, math.prod(mesh), plan, mesh, timeout_s=120):
        assert result["norms"] == pytest.approx(reference["norms"], rel=1e-5)
        _assert_trains_like(result, reference)


@pytest.mark.parametrize("plan", ["tensor_parallel", "fully_sharded"])
def test_the_one_call_step_clips_like_the_calls_one_by_one(plan: str) -> None:
    """...and keeps the norm before clipping as ``grad_norm``, torch's ``clip_grad_norm_``'s."""
    reference = _single_device(4, MAX_NORM)
    for result in spawn(_one_call, 2, plan, timeout_s=120):
        assert result["norms"] == pytest.approx(reference["norms"], rel=1e-5)
        assert result["unclipped"] is None
        _assert_trains_like(result, reference)


@pytest.mark.parametrize("plan", PLANS)
def test_accumulating_two_pieces_equals_one_step_on_the_whole_batch(plan: str) -> None:
    reference = _single_device(8, None)
    for result in spawn(_accumulate, 2, plan, timeout_s=120):
        _assert_trains_like(result, reference)


def test_bad_accumulation_and_clipping_arguments_are_refused() -> None:
    parallel = _compile(1, "data_parallel")
    tokens = _batches(4)[0]
    with pytest.raises(BatchError, match="accumulate=3 splits the batch into 3 equal pieces"):
        parallel.step(tokens, tokens, accumulate=3)
    with pytest.raises(FxparError, match="accumulate must be at least 1"):
        parallel.step(tokens, tokens, accumulate=0)
    with pytest.raises(FxparError, match="max_norm >= 0"):
        parallel.clip_grad_norm_(-1.0)
    assert parallel.clip_grad_norm_(1.0).item() == 0.0  # no gradients yet: nothing to clip


def test_infinity_norm_equals_torch_on_one_device() -> None:
    parallel = _compile(1, "data_parallel")
    tokens = _batches(4)[0]
    parallel.backward(tokens, tokens)
    torch.manual_seed(0)
    model = GPT(CONFIG)
    gpt_loss(model(tokens), tokens).backward()
    expected = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3, norm_type=math.inf)
    assert parallel.clip_grad_norm_(1e-3, norm_type=math.inf).item() == pytest.approx(
        expected.item(), rel=1e-6
    )


def _no_sync(rank: int, world_size: int, plan: str, mesh: tuple[int, ...]) -> dict[str, object]:
    parallel = _compile(world_size, plan, mesh)
    losses = []
    for tokens in _batches(8):
        first, second = tokens.chunk(2)
        with parallel.no_sync():
            loss = parallel.backward(first, first, scale=0.5)
            # Unreduced pieces are kept apart: .grad waits for the reduction.
            assert all(p.grad is None for p in parallel.trainable)
        loss = (loss + parallel.backward(second, second, scale=0.5)) / 2
        assert all(p.grad is not None for p in parallel.trainable)
        parallel.optimizer_step()
        parallel.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "state": parallel.full_state_dict()}


@pytest.mark.parametrize(("plan", "mesh"), [("data_parallel", (2,)), ("ilp", (2, 2))])
def test_backward_under_no_sync_reduces_once_and_equals_one_step(
    plan: str, mesh: tuple[int, ...]
) -> None:
    reference = _single_device(8, None)
    for result in spawn(_no_sync, math.prod(mesh), plan, mesh, timeout_s=120):
        _assert_trains_like(result, reference)


@pytest.mark.parametrize(
    ("plan", "deferred"),
    [("data_parallel", True), ("fully_sharded", False)],
)
def test_accumulation_leaves_gradients_unreduced_where_it_costs_no_memory(
    plan: str, deferred: bool
) -> None:
    """Data parallelism's gradient all-reduces leave the micro-step program (they run once per
    update instead); a fully sharded plan keeps its reduce-scatters, whose pieces are
    smaller than the unreduced gradient."""
    tokens = _batches(4)[0]
    planned = fxpar.plan(
        GPT(CONFIG), splitting_cluster((2,)), (tokens,), gpt_loss, example_targets=(tokens,),
        manual=getattr(fxpar.plans, plan),
    )  # fmt: skip
    loss = planned.program.graph.output_node().args[0][0].name

    def gradient_syncs(**options: bool) -> list[object]:
        records = lower(planned.program, planned.cluster, **options).records
        return [r for r in records if r.phase.name == "OUTPUT" and r.tensor != loss]

    syncing, kept = gradient_syncs(), gradient_syncs(defer_gradients=True)
    assert syncing  # every plan here reduces some gradient
    assert (len(kept) < len(syncing)) is deferred
    if plan == "data_parallel":
        assert kept == []
