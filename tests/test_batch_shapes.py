"""A batch of another shape (a short last batch, another sequence length) keeps training the
same model: ParallelModel plans that shape on first sight, with every parameter and buffer kept
in its layout, and the losses and weights equal single-device training on the same batches."""

from __future__ import annotations

import logging
import re

import pytest
import torch
from conftest import train_eager

import fxpar
from fxpar.errors import FxparError
from fxpar.ir.program import Program
from fxpar.models import GPT, GPTConfig, gpt_loss
from fxpar.runtime.launch import spawn
from fxpar.testing.strategies import splitting_cluster

CONFIG = GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=16, bias=False)
SHAPES = [(4, 8), (2, 8), (4, 16), (4, 8), (2, 8)]


def _batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(0, CONFIG.vocab_size, s, generator=generator) for s in SHAPES]


def _single_device() -> dict[str, object]:
    torch.manual_seed(0)
    model = GPT(CONFIG)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    losses, _ = train_eager(model, optimizer, _batches())
    return {"losses": losses, "state": model.state_dict()}


def _train(rank: int, world_size: int, plan: str) -> dict[str, object]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    tokens = _batches()[0]
    parallel = fxpar.compile(
        GPT(CONFIG), splitting_cluster((world_size,)), (tokens,), gpt_loss,
        example_targets=(tokens,), optimizer=fxpar.optim.SGD(lr=0.2),
        manual=None if plan == "ilp" else getattr(fxpar.plans, plan),
    )  # fmt: skip
    first = parallel.plan
    losses, plans = [], []
    for batch in _batches():
        losses.append(parallel.step(batch, batch).item())
        plans.append(parallel.plan)
    # One plan per shape, made once: coming back to a shape reuses its plan.
    assert plans[0] is first and plans[3] is first and plans[4] is plans[1]
    return {"losses": losses, "state": parallel.full_state_dict()}


def _check(result: dict[str, object], reference: dict[str, object]) -> None:
    assert result["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    for name, value in reference["state"].items():  # type: ignore[attr-defined]
        torch.testing.assert_close(result["state"][name], value, rtol=1e-4, atol=1e-6)  # type: ignore[index]


def test_new_batch_shapes_train_like_one_device_in_one_process() -> None:
    _check(_train(0, 1, "ilp"), _single_device())


def _shape_dependent(program: Program, cluster: fxpar.Cluster) -> Program:
    """A manual plan that splits the weights only for small batches: its layouts differ by
    shape, which a trained model cannot follow."""
    batch = program.placeholders()[program.signature.inputs[0]]
    small = fxpar.ir.require(batch, fxpar.ir.ValueMeta).tensor.shape[0] < 4
    return (fxpar.plans.tensor_parallel if small else fxpar.plans.data_parallel)(program, cluster)


def _refused(rank: int, world_size: int) -> str:
    torch.set_num_threads(1)
    tokens = _batches()[0]
    parallel = fxpar.compile(
        GPT(CONFIG), splitting_cluster((world_size,)), (tokens,), gpt_loss,
        example_targets=(tokens,), manual=_shape_dependent,
    )  # fmt: skip
    parallel.step(tokens, tokens)
    short = _batches()[1]
    with pytest.raises(FxparError, match=r"lays out .* differently from the plan being trained"):
        parallel.step(short, short)
    return "refused"


PLANS = ("ilp", "tensor_parallel", "data_parallel")


def _on_gloo(rank: int, world_size: int) -> dict[str, object]:
    """Every gloo case of this file in one run of 2 processes (a spawn and each process's
    first capture cost seconds): :func:`_train` under each of :data:`PLANS`, then
    :func:`_refused`, each on a model and a ParallelModel of its own."""
    trained: dict[str, object] = {plan: _train(rank, world_size, plan) for plan in PLANS}
    return {"trained": trained, "refused": _refused(rank, world_size)}


@pytest.fixture(scope="module")
def on_gloo() -> list[dict[str, object]]:
    return spawn(_on_gloo, 2, timeout_s=400)


@pytest.mark.slow
@pytest.mark.parametrize("plan", PLANS)
def test_new_batch_shapes_train_like_one_device_on_gloo(
    plan: str, on_gloo: list[dict[str, object]]
) -> None:
    reference = _single_device()
    for result in on_gloo:
        _check(result["trained"][plan], reference)  # type: ignore[index]


@pytest.mark.slow
def test_a_plan_that_would_move_the_state_is_refused(on_gloo: list[dict[str, object]]) -> None:
    assert [result["refused"] for result in on_gloo] == ["refused", "refused"]


def test_planning_a_new_shape_or_mode_says_so_once_with_its_time(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The driver logs one INFO line per step it plans after the first (kind, mode, shapes and
    seconds), and none when a kept step runs again."""
    torch.manual_seed(0)
    tokens = _batches()[0]
    parallel = fxpar.compile(
        GPT(CONFIG), splitting_cluster((1,)), (tokens,), gpt_loss, example_targets=(tokens,)
    )
    short = tokens[:2]
    with caplog.at_level(logging.INFO, logger="fxpar.driver"):
        parallel.step(tokens, tokens)
        parallel.step(short, short)
        parallel.step(short, short)
        parallel.eval().loss(tokens, tokens)
    lines = [r.getMessage() for r in caplog.records if r.name == "fxpar.driver"]
    assert len(lines) == 2, lines
    assert re.fullmatch(
        r"planned a train step \(train mode\) for .*\(2, 8\).* in \d+\.\d\d s", lines[0]
    )
    assert re.fullmatch(r"planned a loss step \(eval mode\) for .* in \d+\.\d\d s", lines[1])


def test_the_steps_kept_are_bounded_and_a_dropped_one_is_planned_again() -> None:
    """With ``max_kept_steps=1`` the driver holds the compiled step and one other: a third
    shape drops the one used least recently, which is planned again when it comes back, and
    training still equals one device's."""
    torch.manual_seed(0)
    tokens = _batches()[0]
    parallel = fxpar.compile(
        GPT(CONFIG), splitting_cluster((1,)), (tokens,), gpt_loss, example_targets=(tokens,),
        optimizer=fxpar.optim.SGD(lr=0.2), max_kept_steps=1,
    )  # fmt: skip
    driver = parallel._source
    losses, plans = [], []
    for batch in _batches():  # shapes (4, 8), (2, 8), (4, 16), (4, 8), (2, 8)
        losses.append(parallel.step(batch, batch).item())
        plans.append(parallel.plan)
        assert driver.kept <= 2  # type: ignore[attr-defined]
    assert plans[3] is plans[0]  # the compiled step is never dropped
    assert plans[4] is not plans[1]  # (2, 8) was dropped for (4, 16), and planned again
    assert losses == pytest.approx(_single_device()["losses"], rel=1e-5)


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_max_kept_steps_must_be_a_whole_number(bad: object) -> None:
    tokens = _batches()[0]
    with pytest.raises(FxparError, match="max_kept_steps must be a whole number"):
        fxpar.compile(
            GPT(CONFIG), fxpar.Cluster((1,)), (tokens,), gpt_loss, example_targets=(tokens,),
            max_kept_steps=bad,  # type: ignore[arg-type]
        )  # fmt: skip


def test_dropped_steps_are_freed() -> None:
    """Steps the driver drops leave nothing behind: re-planning shapes over and over holds no
    more graph nodes after than before (a placed-program cache once kept every one alive)."""
    import gc

    import torch.fx as fx

    torch.manual_seed(0)
    tokens = _batches()[0]
    parallel = fxpar.compile(
        GPT(CONFIG), fxpar.Cluster((1,)), (tokens,), gpt_loss, example_targets=(tokens,),
        optimizer=fxpar.optim.SGD(lr=0.1), max_kept_steps=1,
    )  # fmt: skip
    shapes = [(4, 4), (4, 6), (4, 12)]

    def replan(count: int) -> int:
        for index in range(count):
            batch = tokens.new_zeros(shapes[index % len(shapes)])
            parallel.step(batch, batch)
        gc.collect()
        return sum(isinstance(o, fx.Node) for o in gc.get_objects())

    before = replan(3)
    assert replan(9) <= before
