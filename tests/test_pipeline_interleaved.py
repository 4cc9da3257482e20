"""The interleaved 1F1B schedule: its lists checked by the simulator over many shapes, its
options refused where they cannot work, and training on 2 gloo ranks with 2 chunks each
(GPT with its tied embedding, held by chunk 0 on stage 0 and the last chunk on stage 1)
equal to single-device PyTorch, with the stash and bubble of its trace.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
from conftest import eager_step
from hypothesis import given, settings
from hypothesis import strategies as st

import fxpar
from fxpar.models import GPT, GPTConfig, gpt_loss
from fxpar.optim import SGD
from fxpar.pipeline import (
    Instruction,
    Op,
    Pipeline,
    PipelineError,
    PipelineModel,
    bubble_fractions,
    build_schedule,
    evaluate_split,
    ideal_bubble,
    max_in_flight,
    modelled_bubble,
    simulate,
)
from fxpar.pipeline.schedule import forward_only
from fxpar.runtime.launch import spawn

CONFIG = GPTConfig(n_layer=4, n_embd=32, n_head=4, vocab_size=64, block_size=16)
LR = 0.5


@settings(max_examples=60, deadline=None)
@given(
    stages=st.integers(2, 6),
    chunks=st.integers(2, 4),
    groups=st.integers(1, 5),
)
def test_interleaved_lists_are_complete_ordered_and_deadlock_free(
    stages: int, chunks: int, groups: int
) -> None:
    """Every stage runs each (chunk, micro-batch)'s forward, backward and free once, in that
    order; the simulator completes every list with every message matched in order, the
    forward halves too; each chunk runs its micro-batches' forwards in order, and a stage
    never holds more stashes than its warm-up plus one."""
    count = groups * stages
    schedules = build_schedule("interleaved", stages, count, chunks)
    assert len(schedules) == stages
    simulate(schedules)
    simulate([forward_only(instructions) for instructions in schedules])
    every = sorted((c, m) for c in range(chunks) for m in range(count))
    for stage, instructions in enumerate(schedules):
        for op in (Op.FORWARD, Op.BACKWARD, Op.FREE):
            assert sorted((i.chunk, i.microbatch) for i in instructions if i.op is op) == every
        for chunk in range(chunks):
            forwards = [
                i.microbatch for i in instructions if i.op is Op.FORWARD and i.chunk == chunk
            ]
            assert forwards == list(range(count))
            for m in range(count):
                places = [
                    instructions.index(Instruction(op, m, chunk))
                    for op in (Op.FORWARD, Op.BACKWARD, Op.FREE)
                ]
                assert places == sorted(places)
        warmup = (chunks - 1) * stages + 2 * (stages - stage - 1)
        assert max_in_flight(instructions) == min(warmup + 1, count * chunks)
    # With equal stages and free messages the order idles exactly (K-1)/(V M+K-1).
    ideal = ideal_bubble(stages, count, chunks)
    for forward, backward in ((1.0, 2.0), (1.0, 1.0)):
        bubbles = modelled_bubble(schedules, forward, backward)
        assert bubbles == pytest.approx([ideal] * stages)


def test_the_simulator_follows_messages_around_the_wrap() -> None:
    """Stage 1's chunk 0 sends to stage 0's chunk 1: received out of order there, it is
    reported with the sending chunk; a receive moved before its message's send deadlocks."""
    first, second = build_schedule("interleaved", 2, 2, 2)
    index = first.index(Instruction(Op.RECV_ACTIVATION, 0, 1))
    later = first.index(Instruction(Op.RECV_ACTIVATION, 1, 1))
    swapped = list(first)
    swapped[index], swapped[later] = swapped[later], swapped[index]
    with pytest.raises(PipelineError, match=r"stage 1 \(chunk 0\) sent micro-batch 0"):
        simulate((tuple(swapped), second))
    # Stage 0 waiting for chunk 1's first gradient before it sends any activation: a cycle.
    gradient = Instruction(Op.RECV_GRAD, 0, 1)
    early = (gradient, *(i for i in first if i != gradient))
    with pytest.raises(PipelineError, match="deadlocks"):
        simulate((early, second))
    with pytest.raises(PipelineError, match="deadlocks"):
        modelled_bubble((early, second))


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_the_modelled_bubble_of_one_chunk_schedules_is_the_textbook_one(name: str) -> None:
    """GPipe and 1F1B idle (K-1)/(M+K-1) of a step with equal stages and free messages (the
    interleaved lists' (K-1)/(V M+K-1) is checked over many shapes above)."""
    for stages, count in [(1, 3), (2, 1), (2, 8), (4, 4), (4, 32), (5, 7)]:
        bubbles = modelled_bubble(build_schedule(name, stages, count))  # type: ignore[arg-type]
        assert bubbles == pytest.approx([ideal_bubble(stages, count)] * stages)


def test_interleaving_options_are_checked() -> None:
    assert (
        Pipeline(stages=2, microbatches=4, schedule="interleaved", virtual_stages=2).num_chunks == 4
    )
    split = Pipeline(
        stages=("a", "b", "c"), microbatches=2, schedule="interleaved", virtual_stages=2
    )
    assert (split.num_stages, split.chunks_of(1), split.stage_of(3)) == (2, (1, 3), 1)
    assert split.neighbour(1, 1) == 0 and Pipeline(stages=2).neighbour(1, 1) is None
    with pytest.raises(PipelineError, match="multiple of the 2 stages"):
        Pipeline(stages=2, microbatches=3, schedule="interleaved", virtual_stages=2)
    with pytest.raises(PipelineError, match="virtual_stages >= 2"):
        Pipeline(stages=2, schedule="interleaved")
    with pytest.raises(PipelineError, match="needs schedule='interleaved'"):
        Pipeline(stages=2, virtual_stages=2)
    with pytest.raises(PipelineError, match="do not divide into 2 per stage"):
        Pipeline(stages=("a", "b"), schedule="interleaved", virtual_stages=2)
    with pytest.raises(PipelineError, match="stages='auto' cannot plan the interleaved"):
        Pipeline(stages="auto", schedule="interleaved", virtual_stages=2)
    with pytest.raises(PipelineError, match="multiple of 2 stages"):
        build_schedule("interleaved", 2, 3, 2)
    model, tokens, targets = _build()
    program = fxpar.capture(model, (tokens[:2],), gpt_loss, example_targets=(targets[:2],))
    points = ("blocks.1", "blocks.2", "blocks.3")
    interleaved = Pipeline(points, microbatches=4, schedule="interleaved", virtual_stages=2)
    with pytest.raises(PipelineError, match="stage DP prices one model chunk per stage"):
        evaluate_split(program, fxpar.Cluster((2,)), interleaved)
    assert ideal_bubble(2, 4, virtual_stages=2) == pytest.approx(1 / 9)
    assert ideal_bubble(2, 4) == pytest.approx(1 / 5)


def _build() -> tuple[GPT, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = GPT(CONFIG)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, CONFIG.vocab_size, (8, 16), generator=generator)
    targets = torch.randint(0, CONFIG.vocab_size, (8, 16), generator=generator)
    return model, tokens, targets


def _train(rank: int, world_size: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    model, tokens, targets = _build()
    pipeline = Pipeline(
        stages=2,
        microbatches=4,
        schedule="interleaved",
        virtual_stages=2,
        data_parallel=world_size // 2,
    )
    pipelined = PipelineModel(
        model, pipeline, (tokens,), gpt_loss, example_targets=(targets,), optimizer=SGD(lr=LR)
    )
    losses = [pipelined.step(tokens, targets) for _ in range(2)]
    assert pipelined.trace is not None
    return {
        "losses": losses,
        "gradients": dict(pipelined.gradients),
        "parameters": {n: p.detach().clone() for n, p in pipelined.parameters.items()},
        "eval_loss": pipelined.loss(tokens, targets),
        "logits": pipelined(tokens),
        "trace": pipelined.trace,
        "chunks": [program.unit.stage for program in pipelined._cutter.trained.worker.forward],
    }


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4], ids=["2 stages", "2 stages x 2 replicas"])
def test_interleaved_training_equals_pytorch(world_size: int) -> None:
    """Two SGD steps of a 2-stage, 2-chunk interleaved pipeline (4 micro-batches), alone or
    with 2 data-parallel replicas per stage, give eager PyTorch's losses, gradients and
    weights, then the trained model's loss and outputs; the tied embedding's partial
    gradients from stage 0's chunk 0 and stage 1's chunk 1 are summed. Every rank runs every
    (chunk, micro-batch)'s forward, stashes, and idles for part of the step."""
    ranks = spawn(_train, world_size, timeout_s=240)
    model, tokens, targets = _build()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    for step in range(2):
        expected, gradients = eager_step(reference, (tokens,), gpt_loss, (targets,))
        if step == 1:
            for result in ranks:
                for name, gradient in result["gradients"].items():
                    torch.testing.assert_close(gradient, gradients[name], msg=name)
        optimizer.step()
        for result in ranks:
            torch.testing.assert_close(result["losses"][step], expected)
    weights = dict(reference.named_parameters())
    for result in ranks:
        for name, parameter in result["parameters"].items():
            torch.testing.assert_close(parameter, weights[name].detach(), msg=name)
    expected, _ = eager_step(reference, (tokens,), gpt_loss, (targets,))
    with torch.no_grad():
        logits = reference(tokens)
    for result in ranks:
        torch.testing.assert_close(result["eval_loss"], expected)
        torch.testing.assert_close(result["logits"], logits)
    stages = [rank * 2 // world_size for rank in range(world_size)]
    assert [result["chunks"] for result in ranks] == [[s, s + 2] for s in stages]
    held = [set(result["parameters"]) for result in ranks]
    assert "wte.weight" in held[0] & held[-1]  # tied: chunk 0 (stage 0), chunk 3 (stage 1)
    traces = [result["trace"] for result in ranks]
    for trace in traces:
        forwards = [(e.chunk, e.microbatch) for e in trace.events if e.op == "forward"]
        assert sorted(forwards) == [(c, m) for c in range(2) for m in range(4)]
        assert trace.peak_stash_bytes > 0
    assert all(0.0 < bubble < 1.0 for bubble in bubble_fractions(traces))
    assert math.isfinite(sum(t.compute_seconds for t in traces))
