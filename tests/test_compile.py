"""fxpar.compile on one device (no process group): the training loop, the optimizers, the state
and checkpoint plumbing equal plain PyTorch, and bad input gets clear errors. The multi-process
runs are in test_compile_gloo.py."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fxpar
from fxpar import plans
from fxpar.errors import BatchError, CheckpointError, DistributedError, FxparError
from fxpar.models import GPT, GPTConfig, gpt_loss

CONFIG = GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=16)


def _batches(
    count: int, batch: int = 4, length: int = 8
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (
            torch.randint(0, CONFIG.vocab_size, (batch, length), generator=generator),
            torch.randint(0, CONFIG.vocab_size, (batch, length), generator=generator),
        )
        for _ in range(count)
    ]


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(CONFIG)


def _compile(model: nn.Module, optimizer: fxpar.optim.Optimizer, **kwargs: object):  # type: ignore[no-untyped-def]
    tokens, targets = _batches(1)[0]
    return fxpar.compile(
        model,
        fxpar.Cluster((1,)),
        (tokens,),
        gpt_loss,
        example_targets=(targets,),
        optimizer=optimizer,
        **kwargs,  # type: ignore[arg-type]
    )


def _eager(model: nn.Module, optimizer: torch.optim.Optimizer, batches: list) -> list[float]:  # type: ignore[type-arg]
    losses = []
    for tokens, targets in batches:
        optimizer.zero_grad()
        loss = gpt_loss(model(tokens), targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [
        (fxpar.optim.AdamW(lr=1e-2), lambda p: torch.optim.AdamW(p, lr=1e-2)),
        (
            fxpar.optim.AdamW(lr=1e-2, betas=(0.8, 0.9), weight_decay=0.1, amsgrad=True),
            lambda p: torch.optim.AdamW(
                p, lr=1e-2, betas=(0.8, 0.9), weight_decay=0.1, amsgrad=True
            ),
        ),
        (
            fxpar.optim.SGD(lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3),
            lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3),
        ),
    ],
    ids=["adamw", "adamw-amsgrad", "sgd-nesterov"],
)
def test_step_trains_like_torch_optim(ours, theirs) -> None:  # type: ignore[no-untyped-def]
    """Ten steps through the compiled program and fxpar's optimizer give torch.optim's losses and
    weights, and the tied embedding comes back under both of its names."""
    batches = _batches(10)
    eager = _model()
    expected = _eager(eager, theirs(eager.parameters()), batches)
    parallel = _compile(_model(), ours)
    losses = [parallel.step(tokens, targets).item() for tokens, targets in batches]
    torch.testing.assert_close(losses, expected, rtol=1e-5, atol=1e-6)
    state = parallel.full_state_dict()
    assert state.keys() == eager.state_dict().keys()
    torch.testing.assert_close(state, eager.state_dict(), rtol=1e-4, atol=1e-6)
    assert parallel.steps == 10


def test_batch_norm_buffers_follow_training() -> None:
    """Buffer updates (BatchNorm running statistics) are stored after every step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    eager = copy.deepcopy(model)
    inputs, targets = torch.randn(16, 6), torch.randint(0, 3, (16,))
    loss_fn = nn.functional.cross_entropy
    parallel = fxpar.compile(
        model, fxpar.Cluster((1,)), (inputs,), loss_fn, example_targets=(targets,),
        optimizer=fxpar.optim.SGD(lr=0.1),
    )  # fmt: skip
    optimizer = torch.optim.SGD(eager.parameters(), lr=0.1)
    for _ in range(3):
        optimizer.zero_grad()
        loss_fn(eager(inputs), targets).backward()
        optimizer.step()
        parallel.step(inputs, targets)
    torch.testing.assert_close(parallel.full_state_dict(), eager.state_dict(), rtol=1e-5, atol=1e-6)


def test_loss_changes_nothing() -> None:
    parallel = _compile(_model(), fxpar.optim.SGD(lr=0.5))
    tokens, targets = _batches(1)[0]
    before = parallel.full_state_dict()
    first, second = parallel.loss(tokens, targets), parallel.loss(tokens, targets)
    assert torch.equal(first, second)
    torch.testing.assert_close(parallel.full_state_dict(), before, rtol=0, atol=0)
    assert parallel.step(tokens, targets).item() == pytest.approx(first.item())
    assert parallel.loss(tokens, targets).item() < first.item()


def test_checkpoint_round_trip_continues_training(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Five steps, save; a fresh model loads and trains five more: the losses and weights of an
    uninterrupted ten-step run (the optimizer state is restored, not restarted)."""
    batches = _batches(10)
    optimizer = fxpar.optim.AdamW(lr=1e-2)
    uninterrupted = _compile(_model(), optimizer)
    expected = [uninterrupted.step(*batch).item() for batch in batches]

    first = _compile(_model(), optimizer)
    losses = [first.step(*batch).item() for batch in batches[:5]]
    first.save(tmp_path / "checkpoint")
    torch.manual_seed(123)  # a different initialization, overwritten by the checkpoint
    second = _compile(GPT(CONFIG), optimizer)
    second.load(tmp_path / "checkpoint")
    assert second.steps == 5
    losses += [second.step(*batch).item() for batch in batches[5:]]
    assert losses == pytest.approx(expected, rel=1e-6)
    torch.testing.assert_close(second.full_state_dict(), uninterrupted.full_state_dict())


def test_checkpoint_errors(tmp_path) -> None:  # type: ignore[no-untyped-def]
    parallel = _compile(_model(), fxpar.optim.SGD(lr=0.1))
    with pytest.raises(CheckpointError, match="cannot read a checkpoint"):
        parallel.load(tmp_path / "nowhere")
    parallel.save(tmp_path / "gpt")
    other = nn.Sequential(nn.Embedding(64, 8), nn.Flatten(), nn.Linear(64, 64))
    tokens, targets = _batches(1)[0]
    mismatched = fxpar.compile(
        other, fxpar.Cluster((1,)), (tokens,), lambda out, t: out.sum() * 0 + t.sum() * 0.0,
        example_targets=(targets,), optimizer=fxpar.optim.SGD(lr=0.1),
    )  # fmt: skip
    with pytest.raises(CheckpointError, match="saved from a different model"):
        mismatched.load(tmp_path / "gpt")
    wider = GPT(GPTConfig(n_layer=2, n_embd=64, n_head=4, vocab_size=64, block_size=16))
    with pytest.raises(CheckpointError, match=r"wte.weight is \[64, 32\] in the checkpoint"):
        _compile(wider, fxpar.optim.SGD(lr=0.1)).load(tmp_path / "gpt")


def test_batch_errors() -> None:
    parallel = _compile(_model(), fxpar.optim.SGD(lr=0.1))
    tokens, targets = _batches(1)[0]
    with pytest.raises(BatchError, match=r"step takes 2 batch tensors \['input_0', 'target_0'\]"):
        parallel.step(tokens)
    # A batch of another shape is planned, not refused (tests/test_batch_shapes.py).
    assert torch.isfinite(parallel.step(tokens[:3], targets[:3]))
    with pytest.raises(BatchError, match="unexpected or repeated batch tensor 'labels'"):
        parallel.step(tokens, labels=targets)
    assert parallel.step(input_0=tokens, target_0=targets).shape == ()


def test_compile_errors() -> None:
    tokens, targets = _batches(1)[0]
    with torch.device("meta"):
        meta_model = GPT(CONFIG)
    with pytest.raises(FxparError, match=r"tensors on the meta device .* fxpar\.deferred_init"):
        _compile(meta_model, fxpar.optim.SGD(lr=0.1))
    model = _model()
    with pytest.raises(FxparError, match=r"not a built AdamW .* pass fxpar.optim.SGD"):
        _compile(model, torch.optim.AdamW(model.parameters()))  # type: ignore[arg-type]
    with pytest.raises(FxparError, match="is not an fxpar optimizer"):
        _compile(model, "adam")  # type: ignore[arg-type]
    with pytest.raises(DistributedError, match=r"needs 4 processes, but torch\.distributed is not"):
        fxpar.compile(model, fxpar.Cluster((2, 2)), (tokens,), gpt_loss, example_targets=(targets,))
    with pytest.raises(FxparError, match="betas must lie in"):
        fxpar.optim.AdamW(betas=(0.9, 1.5))
    with pytest.raises(FxparError, match=r"nesterov=True\) needs momentum"):
        fxpar.optim.SGD(nesterov=True)


def test_cluster_from_env(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    cluster = fxpar.Cluster.from_env("h100")
    assert cluster.mesh_shape == (2, 8)
    assert cluster.bandwidth[0] < cluster.bandwidth[1]  # between nodes slower than inside
    assert fxpar.Cluster.from_env(mesh_shape=(4, 4)).mesh_shape == (4, 4)
    with pytest.raises(FxparError, match="torchrun started WORLD_SIZE=16"):
        fxpar.Cluster.from_env(mesh_shape=(3, 4))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "6")
    with pytest.raises(FxparError, match="not a multiple of LOCAL_WORLD_SIZE=6"):
        fxpar.Cluster.from_env()
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert fxpar.Cluster.from_env().mesh_shape == (16,)
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(FxparError, match=r"WORLD_SIZE is not set.*torchrun"):
        fxpar.Cluster.from_env()


def test_parse_mesh() -> None:
    assert fxpar.Cluster.parse_mesh("2x4") == (2, 4)
    assert fxpar.Cluster.parse_mesh("8") == (8,)
    for bad in ("", "2x", "0x4", "two"):
        with pytest.raises(FxparError, match="write it like 8 or 2x4"):
            fxpar.Cluster.parse_mesh(bad)


def test_compile_with_a_pipeline() -> None:
    """pipeline= hands the step to the pipeline runtime: one stage, two micro-batches on one
    device trains like torch.optim on the whole batch (the loss is the mean over
    micro-batches)."""
    batches = _batches(3)
    eager = _model()
    expected = _eager(eager, torch.optim.SGD(eager.parameters(), lr=0.1), batches)
    tokens, targets = batches[0]
    pipelined = fxpar.compile(
        _model(), fxpar.Cluster((1,)), (tokens,), gpt_loss, example_targets=(targets,),
        optimizer=fxpar.optim.SGD(lr=0.1), pipeline=fxpar.Pipeline(stages=1, microbatches=2),
    )  # fmt: skip
    assert isinstance(pipelined, fxpar.PipelineModel)
    losses = [pipelined.step(*batch).item() for batch in batches]
    assert losses == pytest.approx(expected, rel=1e-5)


def test_compile_with_automatic_stages() -> None:
    """stages="auto": the stage DP chooses (here, on one device, the only choice: one stage)
    and its choice travels with the model."""
    tokens, targets = _batches(1)[0]
    pipelined = fxpar.compile(
        _model(), fxpar.Cluster((1,)), (tokens,), gpt_loss, example_targets=(targets,),
        pipeline=fxpar.Pipeline(stages="auto", microbatches=2),
    )  # fmt: skip
    assert pipelined.stage_choice is not None
    assert pipelined.pipeline.num_stages == 1 and pipelined.pipeline.data_parallel == 1
    assert "stage" in pipelined.stage_choice.report()
    assert torch.isfinite(pipelined.step(tokens, targets))


def test_compile_pipeline_errors() -> None:
    tokens, targets = _batches(1)[0]
    with pytest.raises(DistributedError, match=r"runs on 2 devices \(2 stages x 1 per stage\)"):
        fxpar.compile(
            _model(), fxpar.Cluster((1,)), (tokens,), gpt_loss, example_targets=(targets,),
            pipeline=fxpar.Pipeline(stages=2),
        )  # fmt: skip
    # A plan inside the stages needs a mesh whose first axis is the stages.
    with pytest.raises(FxparError, match=r"needs a cluster mesh of \(1, \*stage_mesh\)"):
        fxpar.compile(
            _model(), fxpar.Cluster((1,)), (tokens,), gpt_loss, example_targets=(targets,),
            manual=plans.data_parallel, pipeline=fxpar.Pipeline(stages=1),
        )  # fmt: skip
