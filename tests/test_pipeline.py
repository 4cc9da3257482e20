"""Pipeline parallelism in one process: the per-stage programs chained over micro-batches give
the single-device step; schedules are deadlock-free and keep the promised number of
micro-batches in flight; a one-stage PipelineModel trains like plain PyTorch; mistakes raise
clear errors.

The multi-process runtime is tested in test_pipeline_gloo.py.
"""

from __future__ import annotations

import copy
import functools
import itertools

import pytest
import torch
from conftest import eager_step, train_beside_sgd
from torch import nn

import fxpar
from fxpar.errors import BatchError
from fxpar.models import GPT, GPTConfig, gpt_loss
from fxpar.optim import SGD
from fxpar.pipeline import (
    Half,
    Instruction,
    Op,
    Pipeline,
    PipelineError,
    PipelineModel,
    build_schedule,
    even_split_points,
    max_in_flight,
    partition,
    simulate,
    split_program,
)
from fxpar.pipeline.executor import receives_ahead

CONFIG = GPTConfig(n_layer=4, n_embd=32, n_head=4, vocab_size=64, block_size=16)
BATCH, MICROBATCHES = 8, 4


@functools.cache
def _gpt(tie_weights: bool) -> tuple[GPT, torch.Tensor, torch.Tensor, fxpar.Program]:
    """A GPT, a global batch, and its step captured at micro-batch size."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{**CONFIG.__dict__, "tie_weights": tie_weights}))
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, CONFIG.vocab_size, (BATCH, 16), generator=generator)
    targets = torch.randint(0, CONFIG.vocab_size, (BATCH, 16), generator=generator)
    piece = BATCH // MICROBATCHES
    program = fxpar.capture(model, (tokens[:piece],), gpt_loss, example_targets=(targets[:piece],))
    return model, tokens, targets, program


def _microbatches(*tensors: torch.Tensor, count: int = MICROBATCHES) -> list[list[torch.Tensor]]:
    return [list(pieces) for pieces in zip(*(t.chunk(count) for t in tensors), strict=True)]


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    named = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    return {name: tensor.detach() for name, tensor in named.items()}


@pytest.mark.parametrize("tie_weights", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("num_stages", [1, 2, 4])
@pytest.mark.parametrize("remat", [False, True], ids=["stash", "remat"])
def test_chained_stage_programs_give_the_full_batch_step(
    tie_weights: bool, num_stages: int, remat: bool
) -> None:
    """Forward programs 0..K-1 then backward programs K-1..0, once per micro-batch, with the
    mean over micro-batches, reproduce eager PyTorch's loss and gradients on the whole batch,
    tied embedding included."""
    model, tokens, targets, program = _gpt(tie_weights)
    split = split_program(
        program, partition(program, even_split_points(program, num_stages)), remat=remat
    )
    result = split.run_microbatches(_state(model), _microbatches(tokens, targets))
    loss, grads = eager_step(copy.deepcopy(model), (tokens,), gpt_loss, (targets,))
    torch.testing.assert_close(result.loss, loss)
    assert result.gradients.keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(result.gradients[name], grad, msg=name)


def test_stages_split_at_the_named_modules_and_exchange_one_tensor() -> None:
    """Stages begin where asked; GPT's residual stream is the only activation that crosses a
    boundary and its gradient the only one that comes back; only the tied embedding is held
    by two stages."""
    _, _, _, program = _gpt(True)
    parts = partition(program, ("blocks.1", "blocks.3"))
    stage_of_module: dict[str, set[int]] = {}
    for node, unit in parts.units.items():
        if unit.half is Half.FORWARD:
            module = fxpar.ir.require(node, fxpar.ir.Region).module
            stage_of_module.setdefault(module, set()).add(unit.stage)
    assert stage_of_module["blocks.0.attn"] == {0}
    assert stage_of_module["blocks.2.mlp.fc"] == {1}
    assert stage_of_module["blocks.3.ln_1"] == {2}
    assert stage_of_module["<loss>"] == {2}
    split = split_program(program, parts, remat=False)
    assert [len(f.sent) for f in split.forward] == [1, 1, 0]
    assert [len(b.sent) for b in split.backward] == [0, 1, 1]
    assert split.forward[0].sent[0].meta.shape == (BATCH // MICROBATCHES, 16, CONFIG.n_embd)
    assert split.shared_parameters() == {"wte.weight": (0, 2)}
    untied = _gpt(False)[3]
    untied_split = split_program(untied, partition(untied, ("blocks.2",)), remat=False)
    assert untied_split.shared_parameters() == {}
    assert "blocks.2.attn.qkv.weight" not in untied_split.stage_parameters(0)


def test_remat_stashes_only_the_stage_boundary() -> None:
    """With remat a stage keeps exactly what it received, and its backward recomputes the
    forward; without, it keeps many intermediate activations."""
    _, _, _, program = _gpt(False)
    parts = partition(program, ("blocks.1", "blocks.2", "blocks.3"))
    remat = split_program(program, parts, remat=True)
    stash = split_program(program, parts, remat=False)
    for stage in range(4):
        assert remat.forward[stage].stashed == remat.forward[stage].received
        assert len(stash.forward[stage].stashed) > 10
        recomputed = {n.target for n in remat.backward[stage].graph_module.graph.nodes}
        assert torch.ops.aten.addmm.default in recomputed


@pytest.mark.parametrize("num_stages", [2, 4])
def test_remat_recomputes_dropout_with_the_draws_its_forward_read(num_stages: int) -> None:
    """Dropout masks are random inputs (fxpar.rng): a recomputed forward reads the draws its
    forward read, so remat changes nothing, and both equal eager PyTorch looping over the
    micro-batches after the same seed (each micro-batch draws its own masks, in order)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{**CONFIG.__dict__, "dropout": 0.2}))
    tokens = torch.randint(0, CONFIG.vocab_size, (BATCH, 16))
    piece = BATCH // MICROBATCHES
    program = fxpar.capture(model, (tokens[:piece],), gpt_loss, example_targets=(tokens[:piece],))
    assert program.signature.random
    parts = partition(program, even_split_points(program, num_stages))
    results = []
    for remat in (False, True):
        torch.manual_seed(7)
        split = split_program(program, parts, remat=remat)
        results.append(split.run_microbatches(_state(model), _microbatches(tokens, tokens)))
    torch.manual_seed(7)
    losses, sums = [], {}
    for chunk in tokens.chunk(MICROBATCHES):
        loss, grads = eager_step(model, (chunk,), gpt_loss, (chunk,))
        losses.append(loss)
        sums = {n: sums[n] + g if n in sums else g for n, g in grads.items()}
    for result in results:
        torch.testing.assert_close(result.loss, torch.stack(losses).mean())
        for name, total in sums.items():
            torch.testing.assert_close(result.gradients[name], total / MICROBATCHES, msg=name)


class _BatchNormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU())
        self.second = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU())
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.second(self.first(x)))


def test_batchnorm_uses_per_microbatch_statistics() -> None:
    """Like GPipe: each micro-batch is normalized by its own statistics and the running
    statistics are updated once per micro-batch, so the step equals eager training on the
    micro-batches one after the other, with gradients averaged."""
    torch.manual_seed(0)
    model = _BatchNormNet()
    inputs, labels = torch.randn(16, 6), torch.randint(0, 3, (16,))
    loss_fn = nn.functional.cross_entropy
    program = fxpar.capture(model, (inputs[:4],), loss_fn, example_targets=(labels[:4],))
    split = split_program(program, partition(program, ("second",)), remat=True)
    assert split.forward[1].buffers == (
        "second.1.running_mean",
        "second.1.running_var",
        "second.1.num_batches_tracked",
    )
    result = split.run_microbatches(_state(model), _microbatches(inputs, labels))

    reference = copy.deepcopy(model)
    losses, grads = [], {}
    for x, y in _microbatches(inputs, labels):
        loss, piece = eager_step(reference, (x,), loss_fn, (y,))
        losses.append(loss)
        grads = {n: grads.get(n, 0) + g / MICROBATCHES for n, g in piece.items()}
    torch.testing.assert_close(result.loss, torch.stack(losses).mean())
    for name, grad in grads.items():
        torch.testing.assert_close(result.gradients[name], grad, msg=name)
    for name, value in reference.named_buffers():
        torch.testing.assert_close(result.buffers[name], value, msg=name)


SCHEDULE_CASES = list(itertools.product(["gpipe", "1f1b"], range(1, 6), [1, 2, 3, 4, 8]))


@pytest.mark.parametrize(("name", "stages", "count"), SCHEDULE_CASES)
def test_schedules_are_complete_deadlock_free_and_bounded(
    name: str, stages: int, count: int
) -> None:
    """Every stage runs each micro-batch's forward, then its backward, then frees it, once;
    the lists, run against each other with blocking receives, complete with every message
    matched in order; 1F1B keeps min(K - s, M) micro-batches in flight, GPipe all M."""
    schedules = build_schedule(name, stages, count)  # type: ignore[arg-type]
    simulate(schedules)
    for stage, instructions in enumerate(schedules):
        for op in (Op.FORWARD, Op.BACKWARD, Op.FREE):
            assert sorted(i.microbatch for i in instructions if i.op is op) == list(range(count))
        for m in range(count):
            order = [
                instructions.index(Instruction(op, m)) for op in (Op.FORWARD, Op.BACKWARD, Op.FREE)
            ]
            assert order == sorted(order)
        expected = count if name == "gpipe" else min(stages - stage, count)
        assert max_in_flight(instructions) == expected


@pytest.mark.parametrize(
    ("name", "stages", "count", "chunks"),
    [("gpipe", 3, 4, 1), ("1f1b", 4, 8, 1), ("interleaved", 2, 4, 2), ("interleaved", 3, 6, 3)],
)
def test_each_receive_is_posted_before_the_compute_ahead_of_it(
    name: str, stages: int, count: int, chunks: int
) -> None:
    """Every receive after the first compute is posted before the compute that precedes it
    (and never before an earlier one: its buffer would wait longer than needed); only the
    receives ahead of a stage's first compute are posted where they run."""
    for instructions in build_schedule(name, stages, count, chunks):  # type: ignore[arg-type]
        ahead = receives_ahead(instructions)
        computes = [i for i, x in enumerate(instructions) if x.op in (Op.FORWARD, Op.BACKWARD)]
        receives = [
            i for i, x in enumerate(instructions) if x.op in (Op.RECV_ACTIVATION, Op.RECV_GRAD)
        ]
        posted = {receive: compute for compute, receive in enumerate(ahead) if receive is not None}
        for receive in receives:
            before = [compute for compute in computes if compute < receive]
            assert posted.get(receive) == (before[-1] if before else None), (receive, before)
        assert all(ahead[i] is None for i in range(len(instructions)) if i not in computes)


def test_simulate_catches_deadlocks_and_mismatched_messages() -> None:
    """The checker can fail: a stage receiving before its peer can ever send deadlocks, and
    micro-batches received out of order are reported."""
    first, second = build_schedule("gpipe", 2, 2)
    # Stage 0 waits for micro-batch 0's gradient before sending its activation: a cycle.
    stuck = (first[0], first[4], first[1], first[2], first[3], *first[5:])
    assert stuck[1] == Instruction(Op.RECV_GRAD, 0)
    with pytest.raises(PipelineError, match="deadlocks"):
        simulate((stuck, second))
    swapped = (second[2], second[3], second[0], second[1], *second[4:])
    with pytest.raises(PipelineError, match="expects micro-batch"):
        simulate((first, swapped))


def test_one_stage_pipeline_trains_like_pytorch() -> None:
    """A one-stage, one-device PipelineModel (no process group) takes the SGD step of plain
    PyTorch on the whole batch: accumulation over micro-batches and the update are exact."""
    model, tokens, targets, _ = _gpt(True)
    pipelined = PipelineModel(
        copy.deepcopy(model),
        Pipeline(stages=1, microbatches=4),
        (tokens,),
        gpt_loss,
        example_targets=(targets,),
        optimizer=SGD(lr=0.5),
    )
    reference = train_beside_sgd(pipelined, model, tokens, targets, lr=0.5)
    for name, parameter in reference.named_parameters():
        torch.testing.assert_close(pipelined.parameters[name], parameter.detach(), msg=name)
    assert pipelined.trace is not None and pipelined.trace.peak_stash_bytes > 0


class _UnreadBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 2)
        self.register_buffer("calibration", torch.tensor([2.0, 3.0]))  # never read

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.first(x)))


def test_full_state_dict_returns_buffers_no_stage_reads() -> None:
    """A registered buffer the forward never reads is still part of the model: the first
    stage keeps it, and full_state_dict returns its value (it raised KeyError)."""
    torch.manual_seed(0)
    model = _UnreadBuffer()
    inputs = torch.randn(4, 4)
    pipelined = PipelineModel(
        copy.deepcopy(model), Pipeline(stages=1, microbatches=2), (inputs,),
        lambda out: out.pow(2).mean(), optimizer=SGD(lr=0.1),
    )  # fmt: skip
    state = pipelined.full_state_dict()
    assert "calibration" in pipelined.buffers
    assert state.keys() == model.state_dict().keys()
    torch.testing.assert_close(state["calibration"], torch.tensor([2.0, 3.0]))
    program = fxpar.capture(model, (inputs,), lambda out: out.pow(2).mean())
    split = split_program(program, partition(program, ("second",)), remat=False)
    assert "calibration" in split.stage_buffers(0) and split.stage_buffers(1) == ()


def test_errors_say_what_to_change() -> None:
    model, tokens, targets, program = _gpt(True)
    with pytest.raises(PipelineError, match="names no module"):
        partition(program, ("blocks.9",))
    with pytest.raises(PipelineError, match="order"):
        partition(program, ("blocks.3", "blocks.1"))
    with pytest.raises(PipelineError, match="repeated layers"):
        even_split_points(program, 6)
    with pytest.raises(PipelineError, match="microbatches"):
        Pipeline(microbatches=0)
    with pytest.raises(PipelineError, match="needs 2 processes"):
        PipelineModel(model, Pipeline(stages=2), (tokens,), gpt_loss, example_targets=(targets,))
    with pytest.raises(BatchError, match="equal pieces"):
        PipelineModel(
            model,
            Pipeline(stages=1, microbatches=3),
            (tokens,),
            gpt_loss,
            example_targets=(targets,),
        )
