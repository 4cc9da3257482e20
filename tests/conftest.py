"""Shared helpers: eager references to compare captured Programs against."""

from __future__ import annotations

import contextlib
import copy
import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from torch import nn

import fxpar
from fxpar.ir.capture import batch_tensors
from fxpar.models import GPT, GPTConfig, gpt_loss

settings.register_profile(
    "ci", derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


TEST_DEVICE = torch.device(os.environ.get("FXPAR_TEST_DEVICE", "cpu"))
"""Where the simulated ranks and their references run in the tests that take it:
``FXPAR_TEST_DEVICE=cuda`` runs the property tests and the zoo on a GPU."""
if TEST_DEVICE.type == "cuda":
    # The simulated ranks and their one-device reference compare in float32 to 1e-4:
    # TensorFloat-32 convolutions (cuDNN's default) round to 1e-3.
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False


if os.environ.get("PYTEST_XDIST_WORKER"):
    # pytest-xdist runs one worker per core (pyproject.toml's addopts). torch's default of one
    # intra-op thread per core would put several busy threads on each core; on the tests' small
    # tensors that costs CPU time and gains none (tests/test_pipeline.py: 47 s of CPU with the
    # default 2 threads, 27 s with 1). The processes the tests start (gloo ranks, torchrun, the
    # docs' commands) inherit OMP_NUM_THREADS.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def on_test_device(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` on :data:`TEST_DEVICE`."""
    return [tensor.to(TEST_DEVICE) for tensor in tensors]


def tiny_gpt_program(n_layer: int = 2, batch: int = 8) -> fxpar.Program:
    """fxpar's GPT of ``n_layer`` blocks (32 features, 4 heads, 64 tokens, 16 positions) with
    seed-0 weights, captured on ``batch`` rows of random tokens that are its targets too."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=n_layer, n_embd=32, n_head=4, vocab_size=64, block_size=16))
    tokens = torch.randint(0, 64, (batch, 16))
    return fxpar.capture(model, (tokens,), gpt_loss, example_targets=(tokens,))


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def eager_step(
    model: nn.Module,
    inputs: Sequence[Any] | Mapping[str, Any],
    loss_fn: Callable[..., torch.Tensor] | None = None,
    targets: Sequence[torch.Tensor] = (),
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss and gradients of one eager step (``loss.backward()``), by parameter name."""
    model.zero_grad(set_to_none=True)
    output = model(**inputs) if isinstance(inputs, Mapping) else model(*inputs)
    if loss_fn is not None:
        loss = loss_fn(output, *targets)
    else:
        loss = output if isinstance(output, torch.Tensor) else output.loss
    loss.backward()
    grads = {
        name: (p.grad if p.grad is not None else torch.zeros_like(p))
        for name, p in model.named_parameters()
        if p.requires_grad
    }
    return loss.detach(), grads


def train_beside_sgd(
    trained: Any, model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor, lr: float
) -> nn.Module:
    """Two steps of ``trained`` (``step(tokens, targets)`` returning the loss) beside plain
    SGD on a copy of ``model`` with ``gpt_loss``: the losses must match. Returns the copy, for
    comparing weights."""
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(reference.parameters(), lr=lr)
    for _ in range(2):
        loss = trained.step(tokens, targets)
        expected, _ = eager_step(reference, (tokens,), gpt_loss, (targets,))
        optimizer.step()
        torch.testing.assert_close(loss, expected)
    return reference


def batch_of(inputs: Sequence[Any] | Mapping[str, Any], targets: Sequence[torch.Tensor]) -> list:
    return [*batch_tensors(inputs), *targets]


def train_eager(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Sequence[torch.Tensor],
    *,
    max_norm: float | None = None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
) -> tuple[list[float], list[float]]:
    """Single-device training with ``gpt_loss``, each batch its own targets: the losses and,
    with ``max_norm``, the norms ``torch.nn.utils.clip_grad_norm_`` clipped from."""
    losses, norms = [], []
    for tokens in batches:
        loss, _ = eager_step(model, (tokens,), gpt_loss, (tokens,))
        if max_norm is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
    return losses, norms


def assert_matches_eager(
    model: nn.Module,
    inputs: Sequence[Any] | Mapping[str, Any],
    loss_fn: Callable[..., torch.Tensor] | None = None,
    targets: Sequence[torch.Tensor] = (),
    *,
    rtol: float = 1e-5,
    atol: float = 1e-7,
) -> fxpar.Program:
    """Capture ``model``, run the Program on its real state, and compare with eager training:
    the loss, every gradient, and every buffer the step updates."""
    program = fxpar.capture(model, inputs, loss_fn, example_targets=targets)
    fxpar.verify(program)
    result = program.run(model, *batch_of(inputs, targets))
    loss, grads = eager_step(model, inputs, loss_fn, targets)  # updates BatchNorm buffers
    torch.testing.assert_close(result.loss, loss, rtol=rtol, atol=atol)
    assert set(result.gradients) == set(grads)
    for name, grad in grads.items():
        torch.testing.assert_close(result.gradients[name], grad, rtol=rtol, atol=atol, msg=name)
    buffers = dict(model.named_buffers())
    for name, value in result.buffers.items():
        torch.testing.assert_close(value, buffers[name], rtol=rtol, atol=atol, msg=name)
    return program


class EagerReference:
    """The base of the eager stand-ins that run a script of calls (``step``, ``loss``,
    ``model(...)``, ``train``, ``eval``, ``full_state_dict``) beside a compiled model: the
    model and its SGD optimizer, the mode switches, and :meth:`unchanged`, for a ``loss`` that
    changes nothing, as fxpar's does."""

    def __init__(self, model: nn.Module, lr: float) -> None:
        self.model = model
        self.optimizer = torch.optim.SGD(model.parameters(), lr=lr)

    @contextlib.contextmanager
    def unchanged(self) -> Iterator[None]:
        """No gradients inside, and the random state and buffers as they were after."""
        rng = torch.get_rng_state()
        buffers = copy.deepcopy(dict(self.model.named_buffers()))
        try:
            with torch.no_grad():
                yield
        finally:
            torch.set_rng_state(rng)
            for name, value in buffers.items():
                self.model.get_buffer(name).copy_(value)

    def train(self, mode: bool = True) -> None:
        self.model.train(mode)

    def eval(self) -> None:
        self.model.eval()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}


def assert_same_results(found: Mapping[str, Any], expected: Mapping[str, Any]) -> None:
    """A script's results (by name: tensors, dicts of tensors such as a state, other values)
    equal the reference's, tensors to float tolerance."""
    assert found.keys() == expected.keys()
    for key, value in expected.items():
        if isinstance(value, dict):
            assert found[key].keys() == value.keys(), key
            for name, tensor in value.items():
                torch.testing.assert_close(
                    found[key][name], tensor, rtol=1e-4, atol=1e-5, msg=f"{key}: {name}"
                )
        elif isinstance(value, torch.Tensor):
            torch.testing.assert_close(found[key], value, rtol=1e-4, atol=1e-5, msg=key)
        else:
            assert found[key] == value, key


def draw_split_points(data: Any, model: nn.Module, least: int, most: int) -> tuple[str, ...]:
    """Between ``least`` and ``most`` distinct module names of ``model`` where a pipeline stage
    may begin (top-level children after the first, and the children of top-level
    Sequentials), drawn with hypothesis's ``data`` and put in forward order."""
    candidates = []
    for name, child in model.named_children():
        if isinstance(child, nn.Sequential):
            candidates += [f"{name}.{index}" for index in range(len(child))]
        else:
            candidates.append(name)
    candidates = candidates[1:]
    chosen = data.draw(
        st.lists(st.sampled_from(candidates), min_size=least, max_size=most, unique=True),
        label="split points",
    )
    return tuple(sorted(chosen, key=candidates.index))


def microbatch_program(case: Any, microbatches: int) -> tuple[list[list[torch.Tensor]], Any]:
    """A zoo case's batch (inputs, then targets) cut into ``microbatches`` pieces, and its
    step captured at one piece's size. Inputs given by name (a Hugging Face model's keyword
    arguments) are cut in the order of their names and captured by name."""
    names = list(case.inputs) if isinstance(case.inputs, dict) else None
    inputs = [case.inputs[n] for n in names] if names is not None else list(case.inputs)
    batch = [*inputs, *case.targets]
    chunks = [list(pieces) for pieces in zip(*(t.chunk(microbatches) for t in batch), strict=True)]
    first = chunks[0][: len(inputs)]
    program = fxpar.capture(
        case.model,
        dict(zip(names, first, strict=True)) if names is not None else first,
        case.loss_fn,
        example_targets=chunks[0][len(inputs) :],
    )
    return chunks, program


def assert_same_step(result: Any, expected: Any) -> None:
    """Two StepResults agree: loss, every gradient and every buffer update, to float32 noise."""
    torch.testing.assert_close(result.loss, expected.loss, rtol=1e-4, atol=1e-6)
    assert result.gradients.keys() == expected.gradients.keys()
    for name, gradient in expected.gradients.items():
        torch.testing.assert_close(result.gradients[name], gradient, rtol=1e-4, atol=1e-6, msg=name)
    for name, value in expected.buffers.items():
        torch.testing.assert_close(result.buffers[name], value, rtol=1e-4, atol=1e-6, msg=name)


def assert_bf16_step_close(spmd: Any, program: Any, flat: Sequence[Any]) -> None:
    """The ranks of ``spmd`` (simulated) compute ``program``'s bf16 step on ``flat``: the
    loss to 1%, each gradient within 5% of its own scale. bf16 sums pieces in another order
    than the whole product, and some gradients are ~1e-4, below any absolute tolerance bf16
    needs: a split that computes the wrong thing is off by tens of percent, rounding by ~1%."""
    from fxpar.testing import simulate

    expected = program.signature.name_outputs(program(*flat))
    found = simulate(spmd, flat).result
    torch.testing.assert_close(found.outputs[0], expected.outputs[0], rtol=1e-2, atol=0.0)
    for name, want in expected.gradients.items():
        error = (found.gradients[name].float() - want.float()).abs().max().item()
        scale = want.float().abs().max().item()
        assert error <= 0.05 * scale, f"gradient of {name}: off by {error:.3g} of {scale:.3g}"


def plant(path: str) -> str:
    """What a crafted file would run on loading: here, it only creates a file."""
    with open(path, "w") as marker:
        marker.write("ran")
    return path


class Planted:
    """An object whose unpickling calls :func:`plant`: a stand-in for code hidden in a file
    (tests show that loading refuses it and ``path`` is never created)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (plant, (self.path,))


# Rarely a gloo process aborts with this at exit, after its last collective and
# destroy_process_group (seen in 1 of 6 launches of one fresh-clone CI run, in none of 30
# launches of a local stress loop): a teardown race of gloo's worker threads in torch, not a
# failure of the run, whose last step and save had finished.
_TEARDOWN_ABORT = "terminate called without an active exception"


def torchrun(
    script: Path, *args: str, cwd: Path | None = None, finished: str = "final loss"
) -> str:
    """Run ``script`` with ``args`` under torchrun on 2 processes and return what it printed;
    ``finished`` is what it prints once its work is done (after the last step and save),
    after which the teardown abort above is tolerated (tests/test_examples*.py)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script)]
    done = subprocess.run([*command, *args], capture_output=True, text=True, timeout=300, cwd=cwd)
    done_work = finished in done.stdout
    if done.returncode != 0 and not (done_work and _TEARDOWN_ABORT in done.stderr):
        raise AssertionError(done.stderr[-3000:])
    return done.stdout
