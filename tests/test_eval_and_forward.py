"""Eval and inference on a compiled model equal eager PyTorch: ``parallel(*inputs)`` returns the
model's outputs, ``parallel.loss`` is forward-only, ``parallel.eval()`` / ``parallel.train()``
switch dropout and BatchNorm as ``nn.Module`` does, and training goes on across them.

One script of calls runs twice: on an eager model (the reference) and on a ParallelModel over
gloo ranks under several plans (data, tensor and fully sharded parallelism, the ILP's, on one
and two mesh axes). Both start from the same seed, so dropout draws the same numbers.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import transformers
from conftest import EagerReference, assert_same_results, eager_step
from torch import nn
from torch.distributed.tensor import Shard
from zoo import CNN

import fxpar
from fxpar.errors import FxparError
from fxpar.models import GPT, GPTConfig, gpt_loss
from fxpar.planning.propagate import COLUMN
from fxpar.runtime.launch import spawn
from fxpar.testing.strategies import splitting_cluster

GPT_CONFIG = GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=16, dropout=0.2)
LR = 0.3


class Eager(EagerReference):
    """The reference: the calls a ParallelModel takes, on the eager model, with what
    ParallelModel promises (``loss`` changes nothing: the random state and buffers are kept)."""

    def __init__(self, model: nn.Module, loss_fn: Callable[..., torch.Tensor] | None) -> None:
        super().__init__(model, LR)
        self.loss_fn = loss_fn

    def _split(self, batch: Sequence[Any]) -> tuple[Any, Sequence[torch.Tensor]]:
        if self.loss_fn is None:
            return batch[0], ()
        return tuple(batch[:1]), batch[1:]

    def step(self, *batch: Any, **named: Any) -> torch.Tensor:
        inputs, targets = (named, ()) if named else self._split(batch)
        loss, _ = eager_step(self.model, inputs, self.loss_fn, targets)
        self.optimizer.step()
        return loss

    def loss(self, *batch: Any, **named: Any) -> torch.Tensor:
        with self.unchanged():
            if named:
                return self.model(**named).loss
            inputs, targets = self._split(batch)
            return self.loss_fn(self.model(*inputs), *targets)  # type: ignore[misc]

    def __call__(self, *inputs: Any, **named: Any) -> Any:
        with torch.no_grad():
            return self.model(*inputs, **named)


def _tokens(*shape: int, seed: int) -> torch.Tensor:
    return torch.randint(
        0, GPT_CONFIG.vocab_size, shape, generator=torch.Generator().manual_seed(seed)
    )


def _gpt_script(model: Any) -> dict[str, Any]:
    a, b, c = _tokens(4, 8, seed=1), _tokens(4, 8, seed=2), _tokens(2, 12, seed=3)
    found: dict[str, Any] = {"step 0": model.step(a, a)}
    found["forward (train)"] = model(b)  # dropout draws, as eager's
    found["loss (train)"] = model.loss(b, b)  # draws what the next call draws, then forgets
    found["step 1"] = model.step(b, b)
    model.eval()
    found["forward (eval)"] = model(b)
    found["loss (eval)"] = model.loss(b, b)
    found["forward (eval, other shape)"] = model(c)
    found["step 2 (eval mode)"] = model.step(c, c)
    model.train()
    found["step 3"] = model.step(a, a)
    found["forward (train, other shape)"] = model(c)
    found["state"] = model.full_state_dict()
    return found


def _cnn_script(model: Any) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(5)
    images = torch.randn(8, 3, 8, 8, generator=generator)
    labels = torch.randint(0, 10, (8,), generator=generator)
    found: dict[str, Any] = {"step 0": model.step(images, labels)}
    found["forward (train)"] = model(images[:4])  # BatchNorm updates its statistics
    found["loss (train)"] = model.loss(images, labels)  # and here it does not
    model.eval()
    found["forward (eval)"] = model(images)  # BatchNorm normalizes by its statistics
    found["loss (eval)"] = model.loss(images, labels)
    model.train()
    found["step 1"] = model.step(images, labels)
    found["state"] = model.full_state_dict()
    return found


def _hf_script(model: Any) -> dict[str, Any]:
    ids = _tokens(4, 8, seed=4)
    found: dict[str, Any] = {"step 0": model.step(input_ids=ids, labels=ids)}
    model.eval()
    output = model(input_ids=ids)
    found["logits (eval)"] = output.logits
    found["output type"] = type(output).__name__
    found["loss (eval)"] = model.loss(input_ids=ids, labels=ids)
    model.train()
    found["step 1"] = model.step(input_ids=ids, labels=ids)
    found["state"] = model.full_state_dict()
    return found


def _gpt() -> tuple[
    nn.Module, tuple[Any, ...], Callable[..., torch.Tensor] | None, tuple[Any, ...]
]:
    tokens = _tokens(4, 8, seed=1)
    return GPT(GPT_CONFIG), (tokens,), gpt_loss, (tokens,)


def _cnn() -> tuple[
    nn.Module, tuple[Any, ...], Callable[..., torch.Tensor] | None, tuple[Any, ...]
]:
    return CNN(), (torch.randn(8, 3, 8, 8),), F.cross_entropy, (torch.randint(0, 10, (8,)),)


def _hf() -> tuple[nn.Module, Mapping[str, Any], None, tuple[Any, ...]]:
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    ids = _tokens(4, 8, seed=4)
    return transformers.GPT2LMHeadModel(config), {"input_ids": ids, "labels": ids}, None, ()


MODELS = {
    "gpt": (_gpt, _gpt_script),
    "cnn": (_cnn, _cnn_script),
    "hf-gpt2": (_hf, _hf_script),
}


def _eager(name: str) -> dict[str, Any]:
    build, script = MODELS[name]
    torch.manual_seed(0)
    model, _, loss_fn, _ = build()
    return script(Eager(model, loss_fn))


def _parallel(rank: int, world_size: int, name: str, plan: str, mesh: tuple[int, ...]) -> Any:
    torch.set_num_threads(1)
    build, script = MODELS[name]
    torch.manual_seed(0)
    model, inputs, loss_fn, targets = build()
    parallel = fxpar.compile(
        model, splitting_cluster(mesh), inputs, loss_fn, example_targets=targets,
        optimizer=fxpar.optim.SGD(lr=LR),
        manual=None if plan == "ilp" else getattr(fxpar.plans, plan),
    )  # fmt: skip
    return script(parallel)


def test_one_device_runs_the_script_like_eager() -> None:
    """No process group: the same programs, run whole."""
    assert_same_results(_parallel(0, 1, "gpt", "ilp", (1,)), _eager("gpt"))


Case = tuple[str, str, tuple[int, ...]]

CASES: list[Case] = [
    ("gpt", "data_parallel", (2,)),
    ("gpt", "tensor_parallel", (2,)),
    ("gpt", "fully_sharded", (2,)),
    ("gpt", "ilp", (2,)),
    ("gpt", "ilp", (2, 2)),
    ("cnn", "ilp", (2,)),
    ("cnn", "data_parallel", (2,)),
    ("hf-gpt2", "ilp", (2,)),
]


def _parallel_cases(rank: int, world_size: int, cases: list[Case]) -> list[Any]:
    """:func:`_parallel` for each of ``cases`` in turn, in one run of processes."""
    return [_parallel(rank, world_size, name, plan, mesh) for name, plan, mesh in cases]


@pytest.fixture(scope="module")
def parallel_results() -> dict[Case, list[Any]]:
    """Every rank's :func:`_parallel` results of each case of :data:`CASES`: the cases of a
    world size share one spawn (a spawn and each process's first capture cost seconds)."""
    results: dict[Case, list[Any]] = {}
    for world_size in sorted({math.prod(mesh) for _, _, mesh in CASES}):
        cases = [case for case in CASES if math.prod(case[2]) == world_size]
        per_rank = spawn(_parallel_cases, world_size, cases)
        for index, case in enumerate(cases):
            results[case] = [rank_results[index] for rank_results in per_rank]
    return results


@pytest.mark.slow
@pytest.mark.parametrize(("name", "plan", "mesh"), CASES)
def test_eval_forward_and_loss_equal_eager(
    name: str, plan: str, mesh: tuple[int, ...], parallel_results: dict[Case, list[Any]]
) -> None:
    expected = _eager(name)
    for found in parallel_results[name, plan, mesh]:
        assert_same_results(found, expected)


def _sharded_outputs(rank: int, world_size: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, inputs, loss_fn, targets = _gpt()
    parallel = fxpar.compile(
        model, splitting_cluster((world_size,)), inputs, loss_fn, example_targets=targets,
        manual=functools.partial(fxpar.plans.tensor_parallel, column=(*COLUMN, "wte")),
    )  # fmt: skip
    parallel.eval()
    whole = parallel(inputs[0])
    pieces = parallel(inputs[0], gather=False)
    return {
        "is dtensor": isinstance(pieces, torch.distributed.tensor.DTensor),
        "placements": tuple(pieces.placements),
        "local shape": tuple(pieces.to_local().shape),
        "same": torch.equal(pieces.full_tensor(), whole),
    }


@pytest.mark.slow
def test_outputs_stay_sharded_on_request() -> None:
    """With ``gather=False`` each rank gets its piece of the logits as a DTensor in the layout
    the forward's plan left them, which gathers to the whole."""
    for found in spawn(_sharded_outputs, 2):
        assert found["is dtensor"] and found["same"]
        (placement,) = found["placements"]
        assert isinstance(placement, Shard)  # the tied head is split: so are the logits
        whole = [4, 8, GPT_CONFIG.vocab_size]
        whole[placement.dim] //= 2
        assert found["local shape"] == tuple(whole)


def test_forward_refuses_mixed_and_missing_inputs() -> None:
    torch.manual_seed(0)
    model, inputs, loss_fn, targets = _gpt()
    parallel = fxpar.compile(model, fxpar.Cluster((1,)), inputs, loss_fn, example_targets=targets)
    with pytest.raises(FxparError, match="either positionally or by keyword"):
        parallel(inputs[0], idx=inputs[0])
    with pytest.raises(FxparError, match="needs the model's inputs"):
        parallel()


def test_eval_and_train_return_the_model_and_set_the_mode() -> None:
    torch.manual_seed(0)
    model, inputs, loss_fn, targets = _gpt()
    parallel = fxpar.compile(model, fxpar.Cluster((1,)), inputs, loss_fn, example_targets=targets)
    assert parallel.training
    assert parallel.eval() is parallel and not parallel.training
    assert parallel.train() is parallel and parallel.training
    assert model.training  # the user's model is left in its own mode
