"""The ZB-H1 zero-bubble schedule run by the pipeline runtime: each backward as its B (input
gradients, sent back at once) and its W (weight gradients, deferred), with what W reads kept
from B to W (fxpar/pipeline/backward_split.py's StageBackward).

In one process, every stage's worker runs in a thread over an in-memory transport: the
runtime's own instruction loop, messages and gradient sums, with no process group. There ZB-H1
gives every stage the very gradient sums 1F1B gives, bit for bit (W computes each weight
gradient from the same values, and the sums add the micro-batches in the same order), and the
loss and gradients of single-device PyTorch. On gloo processes (slow): fxpar's GPT with its
tied embedding on 2 stages, on 4 stages with remat, and on 2 stages x 2 data-parallel
replicas, and a Hugging Face Llama, each trains two SGD steps like eager PyTorch, and a
replica's gradient all-reduce starts after its last W.
"""

from __future__ import annotations

import copy
import functools
import threading
import time
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import eager_step

import fxpar
from fxpar.models import GPT, GPTConfig, gpt_loss
from fxpar.optim import SGD
from fxpar.pipeline import (
    Pipeline,
    PipelineError,
    PipelineModel,
    SplitProgram,
    build_schedule,
    even_split_points,
    partition,
    plan_stages,
    split_program,
)
from fxpar.pipeline import executor as executor_module
from fxpar.pipeline.executor import StageResult, StageWorker
from fxpar.runtime.launch import spawn

CONFIG = GPTConfig(n_layer=4, n_embd=32, n_head=4, vocab_size=64, block_size=16)
BATCH, LR = 8, 0.5


def _gpt() -> tuple[GPT, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = GPT(CONFIG)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, CONFIG.vocab_size, (BATCH, 16), generator=generator)
    targets = torch.randint(0, CONFIG.vocab_size, (BATCH, 16), generator=generator)
    return model, tokens, targets


# -- every stage in one process ------------------------------------------------------------


class _Wire:
    """Point-to-point messages between threads, each thread one rank: what ``isend`` and
    ``irecv`` of torch.distributed do, for the executor's calls."""

    def __init__(self, timeout: float = 60.0) -> None:
        self.timeout = timeout
        self.changed = threading.Condition()
        self.messages: dict[tuple[int, int, int], torch.Tensor] = {}
        self.local = threading.local()

    def isend(self, tensor: torch.Tensor, dst: int, tag: int) -> Any:
        with self.changed:
            key = (self.local.rank, dst, tag)
            assert key not in self.messages, f"message {key} sent twice"
            self.messages[key] = tensor.clone()
            self.changed.notify_all()
        return types.SimpleNamespace(wait=lambda: None)

    def irecv(self, buffer: torch.Tensor, src: int, tag: int) -> Any:
        key = (src, self.local.rank, tag)

        def wait() -> None:
            with self.changed:
                if not self.changed.wait_for(lambda: key in self.messages, self.timeout):
                    raise TimeoutError(f"rank {key[1]} waited for message {key}")
                buffer.copy_(self.messages.pop(key))

        return types.SimpleNamespace(wait=wait)


def _in_threads(
    split: SplitProgram,
    schedule: str,
    microbatches: int,
    monkeypatch: pytest.MonkeyPatch,
) -> list[StageResult]:
    """One step of ``split`` under ``schedule``, stage ``s`` as rank ``s`` in a thread, on
    the first ``microbatches`` pieces of the GPT batch."""
    model, tokens, targets = _gpt()
    state = {n: t.detach() for n, t in (*model.named_parameters(), *model.named_buffers())}
    names = split.program.signature.inputs
    pieces = [
        dict(zip(names, piece, strict=True))
        for piece in zip(tokens.chunk(microbatches), targets.chunk(microbatches), strict=True)
    ]
    inputs = split.unit_inputs(pieces)
    stages = split.num_stages
    lists = build_schedule(schedule, stages, microbatches)  # type: ignore[arg-type]
    wire = _Wire()
    monkeypatch.setattr(executor_module, "dist", wire)
    workers = [
        StageWorker(
            [split.forward[s]],
            [split.backward[s]],
            lists[s],
            rank=s,
            previous_rank=s - 1 if s else None,
            next_rank=s + 1 if s < stages - 1 else None,
            num_stages=stages,
        )
        for s in range(stages)
    ]
    results: list[StageResult | BaseException | None] = [None] * stages

    def run(stage: int) -> None:
        wire.local.rank = stage
        try:
            results[stage] = workers[stage].run(state, {}, inputs)
        except BaseException as error:  # handed to the test's thread
            results[stage] = error

    threads = [threading.Thread(target=run, args=(s,)) for s in range(stages)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for result in results:
        if isinstance(result, BaseException):
            raise result
    assert not wire.messages, "messages sent but never received"
    return [result for result in results if isinstance(result, StageResult)]


@pytest.mark.parametrize(
    ("stages", "microbatches", "remat"), [(2, 4, False), (3, 4, True), (4, 2, False)]
)
def test_zb_h1_gives_1f1b_gradient_sums_bit_for_bit_and_eager_training(
    stages: int, microbatches: int, remat: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ZB-H1's runtime, every stage in a thread of one process: each stage's gradient sums
    and loss equal 1F1B's exactly; summed over stages (the tied embedding's two partial
    gradients) and divided by M, they are eager PyTorch's gradients, and the loss its loss.
    Every stage runs each micro-batch's B before its W, with the W's of stage ``s`` lagging
    ``s`` B's; the first stage's B sends nothing; what a stage keeps from B to W is counted
    in its peak stash."""
    model, tokens, targets = _gpt()
    piece = BATCH // microbatches
    program = fxpar.capture(model, (tokens[:piece],), gpt_loss, example_targets=(targets[:piece],))
    split = split_program(
        program, partition(program, even_split_points(program, stages)), remat=remat
    )
    zero_bubble = _in_threads(split, "zb-h1", microbatches, monkeypatch)
    one_f_one_b = _in_threads(split, "1f1b", microbatches, monkeypatch)
    for stage, (ours, theirs) in enumerate(zip(zero_bubble, one_f_one_b, strict=True)):
        assert ours.gradient_sums.keys() == theirs.gradient_sums.keys(), stage
        for name, total in ours.gradient_sums.items():
            assert torch.equal(total, theirs.gradient_sums[name]), (stage, name)
        assert (ours.loss_sum is None) == (theirs.loss_sum is None)
        if ours.loss_sum is not None and theirs.loss_sum is not None:
            assert torch.equal(ours.loss_sum, theirs.loss_sum)
        order = [(e.op, e.microbatch) for e in ours.trace.events if e.op.startswith("backward")]
        inputs = [m for op, m in order if op == "backward_input"]
        weights = [m for op, m in order if op == "backward_weight"]
        assert inputs == weights == list(range(microbatches))
        for m in range(microbatches):
            assert order.index(("backward_input", min(m + stage, microbatches - 1))) < order.index(
                ("backward_weight", m)
            )
        assert ours.trace.peak_stash_bytes > 0
    loss, gradients = eager_step(copy.deepcopy(model), (tokens,), gpt_loss, (targets,))
    summed: dict[str, torch.Tensor] = {}
    for result in zero_bubble:
        for name, total in result.gradient_sums.items():
            summed[name] = summed[name] + total if name in summed else total
    assert summed.keys() == gradients.keys()
    for name, gradient in gradients.items():
        torch.testing.assert_close(summed[name] / microbatches, gradient, msg=name)
    losses = [r.loss_sum for r in zero_bubble if r.loss_sum is not None]
    torch.testing.assert_close(torch.stack(losses).sum() / microbatches, loss)


def test_zero_bubble_options_are_checked() -> None:
    """ZB-H1 is a schedule pipelines run, with one chunk per stage; it does not split a
    backward lowered to a stage mesh, and the stage DP does not price it yet."""
    assert Pipeline(stages=2, schedule="zb-h1").schedule == "zb-h1"
    with pytest.raises(PipelineError, match="stage mesh"):
        Pipeline(stages=2, schedule="zb-h1", stage_meshes=((1,), (2,)))
    with pytest.raises(PipelineError, match="virtual_stages=2 needs schedule='interleaved'"):
        Pipeline(stages=2, schedule="zb-h1", virtual_stages=2)
    model, tokens, targets = _gpt()
    program = fxpar.capture(model, (tokens[:2],), gpt_loss, example_targets=(targets[:2],))
    with pytest.raises(PipelineError, match="does not price the zero-bubble"):
        plan_stages(program, fxpar.Cluster((2,)), Pipeline(stages="auto", schedule="zb-h1"))


# -- gloo processes ---------------------------------------------------------------------------


def _llama() -> tuple[torch.nn.Module, torch.Tensor]:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=32,
    )  # fmt: skip
    tokens = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1))
    return transformers.LlamaForCausalLM(config), tokens


def _train(build: Callable[[], PipelineModel], *batch: Any, **named: Any) -> dict[str, Any]:
    """Two SGD steps of the pipeline ``build`` makes on the batch, and when this rank started
    each gradient all-reduce (over its stage's replicas, or a tied weight's holders) of the
    second."""
    reduced: list[float] = []
    all_reduce = fxpar.runtime.waiting.all_reduce

    def recorded(*args: Any, **kwargs: Any) -> Any:
        reduced.append(time.perf_counter())
        return all_reduce(*args, **kwargs)

    pipelined = build()
    fxpar.runtime.waiting.all_reduce = recorded
    try:
        losses = [pipelined.step(*batch, **named)]
        reduced.clear()
        losses.append(pipelined.step(*batch, **named))
    finally:
        fxpar.runtime.waiting.all_reduce = all_reduce
    assert pipelined.trace is not None
    return {
        "losses": losses,
        "parameters": {n: p.detach().clone() for n, p in pipelined.parameters.items()},
        "events": pipelined.trace.events,
        "reduced": reduced,
    }


def _gpt_pipeline(pipeline: Pipeline) -> PipelineModel:
    model, tokens, targets = _gpt()
    return PipelineModel(
        model, pipeline, (tokens,), gpt_loss, example_targets=(targets,), optimizer=SGD(lr=LR)
    )


def _llama_pipeline() -> PipelineModel:
    model, ids = _llama()
    pipeline = Pipeline(stages=2, microbatches=2, schedule="zb-h1")
    return PipelineModel(model, pipeline, {"input_ids": ids, "labels": ids}, optimizer=SGD(lr=LR))


GLOO_CASES: dict[int, tuple[Pipeline | str, ...]] = {
    2: (Pipeline(stages=2, microbatches=4, schedule="zb-h1"), "llama"),
    4: (
        Pipeline(stages=2, microbatches=4, schedule="zb-h1", data_parallel=2),
        Pipeline(stages=4, microbatches=4, schedule="zb-h1", remat=True),
    ),
}


def _on_ranks(rank: int, world_size: int) -> list[dict[str, Any]]:
    """Every case of :data:`GLOO_CASES` for this world size, on this rank."""
    torch.set_num_threads(1)
    _, tokens, targets = _gpt()
    _, ids = _llama()
    outcomes = []
    for case in GLOO_CASES[world_size]:
        if case == "llama":
            outcomes.append(_train(_llama_pipeline, input_ids=ids, labels=ids))
        else:
            assert isinstance(case, Pipeline)
            outcomes.append(_train(functools.partial(_gpt_pipeline, case), tokens, targets))
    return outcomes


@pytest.fixture(scope="module", params=[2, 4], ids=["2 ranks", "4 ranks"])
def gloo_runs(request: pytest.FixtureRequest) -> tuple[int, list[list[dict[str, Any]]]]:
    return request.param, spawn(_on_ranks, request.param, timeout_s=240)


def _eager(case: Pipeline | str) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Two eager SGD steps of the case's model on its batch: the losses and the trained
    parameters."""
    if case == "llama":
        model, ids = _llama()

        def step(module: torch.nn.Module) -> torch.Tensor:
            return module(input_ids=ids, labels=ids).loss
    else:
        model, tokens, targets = _gpt()

        def step(module: torch.nn.Module) -> torch.Tensor:
            return gpt_loss(module(tokens), targets)

    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    losses = []
    for _ in range(2):
        optimizer.zero_grad()
        loss = step(reference)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return losses, {n: p.detach() for n, p in reference.named_parameters()}


@pytest.mark.slow
def test_zb_h1_trains_like_one_device_on_gloo(
    gloo_runs: tuple[int, list[list[dict[str, Any]]]],
) -> None:
    """Each case's two steps give every rank eager PyTorch's losses, and every parameter on
    every rank holding it (the tied embedding on the first and last stage) its eagerly
    trained value; every parameter is held somewhere. Every rank runs each micro-batch's B
    and W, and a data-parallel rank starts its gradient all-reduces after its last W."""
    world_size, ranks = gloo_runs
    for index, case in enumerate(GLOO_CASES[world_size]):
        losses, trained = _eager(case)
        microbatches = case.microbatches if isinstance(case, Pipeline) else 2
        held: set[str] = set()
        for rank, outcomes in enumerate(ranks):
            found = outcomes[index]
            what = f"{case}, rank {rank}"
            torch.testing.assert_close(found["losses"], losses, msg=what)
            for name, value in found["parameters"].items():
                torch.testing.assert_close(value, trained[name], msg=f"{what}: {name}")
            held |= found["parameters"].keys()
            events = found["events"]
            for op in ("backward_input", "backward_weight"):
                done = sorted(e.microbatch for e in events if e.op == op)
                assert done == list(range(microbatches)), what
            assert not any(e.op == "backward" for e in events), what
            if isinstance(case, Pipeline) and case.data_parallel > 1:
                last_weight = max(e.end for e in events if e.op == "backward_weight")
                assert found["reduced"] and min(found["reduced"]) >= last_weight, what
        assert held == set(trained), case
