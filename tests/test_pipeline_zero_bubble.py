"""The zero-bubble schedules run by the pipeline runtime: each backward as its B (input
gradients, sent back at once) and its W (weight gradients, deferred), with what W reads kept
from B to W (fxpar/pipeline/backward_split.py's StageBackward); ZB-V's two chunks per stage in a
V, the last stage's chunk 0 handing its activations to its own chunk 1 without a message.

In one process, every stage's worker runs in a thread over an in-memory transport: the
runtime's own instruction loop, messages and gradient sums, with no process group. There ZB-H1
gives every stage the very gradient sums 1F1B gives, bit for bit (W computes each weight
gradient from the same values, and the sums add the micro-batches in the same order), ZB-V
those of 1F1B over its chunks, and both the loss and gradients of single-device PyTorch; a
one-stage ZB-V pipeline trains and evaluates like eager PyTorch with no process group at all.
On gloo processes (slow): fxpar's GPT with its tied embedding under ZB-H1 on 2 stages, on 4
stages with remat and on 2 stages x 2 data-parallel replicas, a Hugging Face Llama under ZB-H1,
a Hugging Face T5 (encoder-decoder, its embedding shared by encoder, decoder and head, so held
by both stages) under ZB-H1 and ZB-V, and the GPT under ZB-V on 2 stages, alone and with 2
replicas, each trains two SGD steps like eager PyTorch, and a replica's gradient all-reduce
starts after its last W. On 2 stages x 2 devices (slow), the GPT and the Llama under ZB-H1 and
ZB-V and a T5 under ZB-H1 with a tensor parallel or fully sharded plan inside every stage (so B
and W call collectives) train two steps like eager PyTorch, and each stage's gradient sync
starts after its last W.

The stage DP prices ZB-H1 on data-parallel stages and on stage meshes under tensor parallel
plans: it picks ZB-H1 over 1F1B where its step is shorter and its memory fits, and the GPT
pipeline it picks on stage meshes, compiled by fxpar.compile, trains like eager on gloo.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import threading
import time
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import eager_step

import fxpar
from fxpar import plans
from fxpar.models import GPT, GPTConfig, gpt_loss
from fxpar.optim import SGD
from fxpar.passes import plan_program
from fxpar.pipeline import (
    Pipeline,
    PipelineError,
    PipelineModel,
    SplitProgram,
    build_schedule,
    capture_microbatch,
    default_schedules,
    even_split_points,
    partition,
    split_program,
)
from fxpar.pipeline import executor as executor_module
from fxpar.pipeline.auto import evaluate_split, search_pipelines
from fxpar.pipeline.executor import StageResult, StageWorker
from fxpar.pipeline.intra_op import GradientSync
from fxpar.pipeline.schedule import virtual_stage
from fxpar.runtime.launch import spawn
from fxpar.solvers.stages import StagePlan, per_step_overcount

CONFIG = GPTConfig(n_layer=4, n_embd=32, n_head=4, vocab_size=64, block_size=16)
BATCH, LR = 8, 0.5


def _paid_once(plan: StagePlan) -> float:
    """1F1B's step of ``plan``'s stages: its objective with each stage's once-a-step seconds
    paid once (solvers.per_step_overcount), before the tied weights' sums."""
    times = [stage.time for stage in plan.stages]
    once = [stage.per_step for stage in plan.stages]
    return plan.objective - per_step_overcount(times, once, plan.num_microbatches)


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
        self.sent: list[tuple[int, int]] = []
        """(source, destination) of every message."""

    def isend(self, tensor: torch.Tensor, dst: int, tag: int) -> Any:
        with self.changed:
            key = (self.local.rank, dst, tag)
            assert key not in self.messages, f"message {key} sent twice"
            self.messages[key] = tensor.clone()
            self.sent.append((self.local.rank, dst))
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
    the first ``microbatches`` pieces of the GPT batch (ZB-V: two of the split's chunks per
    stage, in a V)."""
    model, tokens, targets = _gpt()
    state = {n: t.detach() for n, t in (*model.named_parameters(), *model.named_buffers())}
    names = split.program.signature.inputs
    pieces = [
        dict(zip(names, piece, strict=True))
        for piece in zip(tokens.chunk(microbatches), targets.chunk(microbatches), strict=True)
    ]
    inputs = split.unit_inputs(pieces)
    chunks = 2 if schedule == "zb-v" else 1
    stages = split.num_stages // chunks
    lists = build_schedule(schedule, stages, microbatches, chunks)  # type: ignore[arg-type]
    placement = default_schedules()[schedule].placement
    wire = _Wire()
    monkeypatch.setattr(executor_module, "dist", wire)
    workers = []
    for s in range(stages):
        virtual = [virtual_stage(s, c, stages, placement) for c in range(chunks)]
        workers.append(
            StageWorker(
                [split.forward[v] for v in virtual],
                [split.backward[v] for v in virtual],
                lists[s],
                rank=s,
                previous_rank=s - 1 if s else None,
                next_rank=s + 1 if s < stages - 1 else None,
                num_stages=stages,
                placement=placement,
            )
        )
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
    assert all(source != destination for source, destination in wire.sent)
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
    model, split = _split(stages, microbatches, remat)
    _, tokens, targets = _gpt()
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
    _assert_eager(model, tokens, targets, zero_bubble)


def _split(stages: int, microbatches: int, remat: bool) -> tuple[GPT, SplitProgram]:
    """The GPT and its step at one micro-batch's size, cut into ``stages`` pieces."""
    model, tokens, targets = _gpt()
    piece = BATCH // microbatches
    program = fxpar.capture(model, (tokens[:piece],), gpt_loss, example_targets=(targets[:piece],))
    # Six pieces: the four blocks, then the final norm and the head on their own.
    points: tuple[str, ...] = ("blocks.1", "blocks.2", "blocks.3", "ln_f", "head")
    points = points if stages == 6 else even_split_points(program, stages)
    return model, split_program(program, partition(program, points), remat=remat)


def _assert_eager(
    model: GPT, tokens: torch.Tensor, targets: torch.Tensor, results: list[StageResult]
) -> None:
    """The stages' gradient sums, added over stages and divided by the micro-batches, are
    eager PyTorch's gradients, and their losses its loss."""
    microbatches = max(e.microbatch for e in results[0].trace.events) + 1
    loss, gradients = eager_step(copy.deepcopy(model), (tokens,), gpt_loss, (targets,))
    summed: dict[str, torch.Tensor] = {}
    for result in results:
        for name, total in result.gradient_sums.items():
            summed[name] = summed[name] + total if name in summed else total
    assert summed.keys() == gradients.keys()
    for name, gradient in gradients.items():
        torch.testing.assert_close(summed[name] / microbatches, gradient, msg=name)
    losses = [r.loss_sum for r in results if r.loss_sum is not None]
    torch.testing.assert_close(torch.stack(losses).sum() / microbatches, loss)


@pytest.mark.parametrize(("stages", "microbatches"), [(2, 4), (3, 2)])
def test_zb_v_trains_like_eager_and_like_1f1b_over_its_chunks(
    stages: int, microbatches: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ZB-V's runtime, every stage in a thread of one process, each holding chunks ``s`` and
    ``2K-1-s``: the loss and gradients are eager PyTorch's, and the sum of every weight one
    chunk holds is the one 1F1B over ``2K`` one-chunk stages makes, bit for bit (the tied
    embedding, in chunks 0 and ``2K-1``, both on stage 0, adds its two parts in another
    order). Stage 0 computes the loss; the last stage's turn from chunk 0 to chunk 1 sends no
    message to itself (the transport sees every message)."""
    model, split = _split(2 * stages, microbatches, remat=False)
    _, tokens, targets = _gpt()
    v_shaped = _in_threads(split, "zb-v", microbatches, monkeypatch)
    looped = _in_threads(split, "1f1b", microbatches, monkeypatch)
    _assert_eager(model, tokens, targets, v_shaped)
    assert [r.loss_sum is not None for r in v_shaped] == [True] + [False] * (stages - 1)
    for stage, result in enumerate(v_shaped):
        own = (looped[stage].gradient_sums, looped[2 * stages - 1 - stage].gradient_sums)
        for name, total in result.gradient_sums.items():
            if name in own[0] and name in own[1]:
                torch.testing.assert_close(total, own[0][name] + own[1][name], msg=name)
            else:
                assert torch.equal(total, (own[0] | own[1])[name]), (stage, name)


def test_a_one_stage_zb_v_pipeline_trains_and_evaluates_like_eager() -> None:
    """ZB-V on one process: its two chunks hand activations and gradients to each other with
    no process group at all. Two SGD steps give eager PyTorch's losses and weights; then the
    loss and the forward of the trained model (forward halves only) are eager's too."""
    model, tokens, targets = _gpt()
    pipeline = Pipeline(stages=1, microbatches=2, schedule="zb-v")
    assert (pipeline.virtual_stages, pipeline.chunks_of(0)) == (2, (0, 1))
    pipelined = PipelineModel(
        model, pipeline, (tokens,), gpt_loss, example_targets=(targets,), optimizer=SGD(lr=LR)
    )
    losses = [pipelined.step(tokens, targets) for _ in range(2)]
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    for step in range(2):
        loss, _ = eager_step(reference, (tokens,), gpt_loss, (targets,))
        optimizer.step()
        torch.testing.assert_close(losses[step], loss)
    for name, parameter in reference.named_parameters():
        torch.testing.assert_close(pipelined.parameters[name], parameter.detach(), msg=name)
    with torch.no_grad():
        logits = reference(tokens)
    torch.testing.assert_close(pipelined.loss(tokens, targets), gpt_loss(logits, targets))
    torch.testing.assert_close(pipelined(tokens), logits)
    assert pipelined.trace is not None
    ops = {(e.op, e.chunk) for e in pipelined.trace.events}
    assert {("backward_input", 0), ("backward_weight", 1)} <= ops


def test_zero_bubble_options_are_checked() -> None:
    """ZB-H1 runs one chunk per stage, ZB-V two (in a V: stage 1 of 2 holds chunks 1 and 2,
    and chunk 3 is stage 0's), given as 2 K - 1 split points; both run on stage meshes, ZB-V
    only where every stage has the same mesh shape; the stage DP, which prices one chunk per
    stage, refuses ZB-V."""
    assert Pipeline(stages=2, schedule="zb-h1").schedule == "zb-h1"
    v = Pipeline(stages=("blocks.1", "blocks.2", "blocks.3"), schedule="zb-v")
    assert (v.num_stages, v.virtual_stages, v.chunks_of(1), v.stage_of(3)) == (2, 2, (1, 2), 0)
    assert v.neighbour(1, 1) is None  # activations turn back on the last stage, not around
    assert Pipeline(stages=2, schedule="zb-h1", stage_meshes=((1,), (2,))).world_size == 3
    on_meshes = Pipeline(stages=v.stages, schedule="zb-v", stage_meshes=((2,), (2,)))
    assert (on_meshes.num_stages, on_meshes.virtual_stages) == (2, 2)
    with pytest.raises(PipelineError, match="ZB-V runs two model chunks per stage, which"):
        Pipeline(stages=2, schedule="zb-v", stage_meshes=((1,), (2,)))
    with pytest.raises(PipelineError, match="one mesh per stage"):
        Pipeline(stages=v.stages, schedule="zb-v", stage_meshes=((2,),) * 4)
    with pytest.raises(PipelineError, match="virtual_stages=2 needs schedule='interleaved'"):
        Pipeline(stages=2, schedule="zb-h1", virtual_stages=2)
    with pytest.raises(PipelineError, match="exactly two model chunks"):
        Pipeline(stages=2, schedule="zb-v", virtual_stages=3)
    with pytest.raises(PipelineError, match="give 2 K - 1 split points"):
        Pipeline(stages=("blocks.1", "blocks.2"), schedule="zb-v")
    with pytest.raises(PipelineError, match="cannot plan ZB-V"):
        Pipeline(stages="auto", schedule="zb-v")
    model, tokens, targets = _gpt()
    program = fxpar.capture(model, (tokens[:2],), gpt_loss, example_targets=(targets[:2],))
    with pytest.raises(PipelineError, match="not the zb-v schedule"):
        evaluate_split(program, fxpar.Cluster((2,)), dataclasses.replace(v, microbatches=4))


def test_the_stage_dp_prices_zb_h1_and_picks_it_where_faster_and_it_fits() -> None:
    """The stage DP prices ZB-H1 on data-parallel stages: on the split 1F1B would be priced
    for, its step is 1F1B's less what its W's fill (at most K - 1 stage times), with every
    stage keeping min(K, M) micro-batches, each its stash and what B keeps for W (so the last
    stage needs more memory than under 1F1B). search_pipelines picks it where it fits, and
    1F1B where the memory lies between what the two need."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=4, n_embd=64, n_head=4, vocab_size=64, block_size=16))
    tokens = torch.randint(0, 64, (16, 16), generator=torch.Generator().manual_seed(1))
    program = fxpar.capture(model, (tokens,), gpt_loss, example_targets=(tokens,))
    slow = dict(bandwidth=(1e9,))  # links slow enough that pipelining beats data parallelism
    settings = [Pipeline(stages="auto", microbatches=4, schedule=s) for s in ("1f1b", "zb-h1")]
    search = search_pipelines(program, fxpar.Cluster((4,), **slow), settings)
    one_f_one_b, zero_bubble = (outcome.choice for outcome in search.outcomes)
    assert one_f_one_b is not None and zero_bubble is not None
    assert search.choice is zero_bubble and zero_bubble.step_time < one_f_one_b.step_time
    stages = zero_bubble.pipeline.num_stages
    assert stages > 1
    same = dataclasses.replace(zero_bubble.pipeline, schedule="1f1b")
    priced = evaluate_split(program, fxpar.Cluster((4,), **slow), same)
    # GPT's head and embedding share a weight: its gradient is summed between their stages.
    assert priced.tied_seconds > 0
    assert priced.step_time == pytest.approx(_paid_once(zero_bubble.plan) + priced.tied_seconds)
    saved = priced.step_time - zero_bubble.step_time
    assert 0 < saved < (stages - 1) * max(stage.time for stage in zero_bubble.plan.stages)
    assert [stage.in_flight for stage in zero_bubble.plan.stages] == [min(stages, 4)] * stages
    assert zero_bubble.memory[-1] > priced.memory[-1]
    starved = search_pipelines(program, fxpar.Cluster((4,), memory=1.0, **slow), settings)
    need = {o.pipeline.schedule: o.least_memory for o in starved.outcomes}
    assert need["1f1b"] is not None and need["zb-h1"] is not None
    assert need["1f1b"] < need["zb-h1"]
    memory = (need["1f1b"] + need["zb-h1"]) / 2
    limited = search_pipelines(program, fxpar.Cluster((4,), memory=memory, **slow), settings)
    assert limited.choice is not None and limited.choice.pipeline.schedule == "1f1b"


# Links slow enough that the tensor parallel stage DP below puts its last stage on a mesh of
# two and the first ones on one device each, where ZB-H1's W's fill part of 1F1B's bubble.
# Memory fast enough that the sums of each micro-batch's gradients, which a one-device stage
# adds over all its weights, do not decide the stage meshes.
MESH_DP_CLUSTER = fxpar.Cluster((4,), bandwidth=(2e8,), memory_bandwidth=1e11)
MESH_DP_PIPELINES = [
    Pipeline(stages="auto", microbatches=4, schedule=schedule, stage_mode="meshes")
    for schedule in ("1f1b", "zb-h1")
]
TENSOR_PARALLEL = functools.partial(plan_program, manual=plans.tensor_parallel)


@pytest.fixture(scope="module")
def mesh_dp_search() -> tuple[fxpar.Program, Any]:
    """The GPT's step at one micro-batch's size, and search_pipelines over 1F1B and ZB-H1 on
    :data:`MESH_DP_CLUSTER` with tensor parallel stage plans: the choice the stage DP test
    checks and the stage-mesh gloo test compiles."""
    model, tokens, targets = _gpt()
    program = capture_microbatch(
        model, MESH_DP_PIPELINES[0], (tokens,), gpt_loss, example_targets=(targets,)
    )
    # SGD's state count, as the stage-mesh test compiles it.
    search = search_pipelines(
        program, MESH_DP_CLUSTER, MESH_DP_PIPELINES, stage_planner=TENSOR_PARALLEL,
        microbatch=True, optimizer_states=0,
    )  # fmt: skip
    return program, search


def test_the_stage_dp_prices_zb_h1_on_stage_meshes_and_picks_it_where_faster(
    mesh_dp_search: tuple[fxpar.Program, Any],
) -> None:
    """With stages running tensor parallel plans on meshes the DP chooses, ZB-H1 is priced as on
    data-parallel stages: the search over both schedules picks it, on stage meshes of which
    one has two devices, for a step below 1F1B's on the same stages and meshes (evaluated by
    evaluate_split) by less than K - 1 stage times; every stage keeps min(K, M) micro-batches
    and holds at least 1F1B's memory, the last stage more. The plans it carries are the
    meshes' tensor parallel plans, and fxpar.compile with schedule="zb-h1" makes the same
    choice (run on gloo ranks by the stage-mesh test below). Under a memory limit between
    what the two schedules need, the search picks 1F1B."""
    program, search = mesh_dp_search
    one_f_one_b, zero_bubble = (outcome.choice for outcome in search.outcomes)
    assert one_f_one_b is not None and zero_bubble is not None
    assert search.choice is zero_bubble and zero_bubble.step_time < one_f_one_b.step_time
    meshes = zero_bubble.stage_mesh_shapes
    stages = len(meshes)
    assert stages > 1 and max(map(math.prod, meshes)) > 1, meshes
    assert set(zero_bubble.plans) == set(meshes)
    same = dataclasses.replace(zero_bubble.pipeline, schedule="1f1b")
    priced = evaluate_split(
        program, MESH_DP_CLUSTER, same, stage_planner=TENSOR_PARALLEL, microbatch=True,
        optimizer_states=0,
    )  # fmt: skip
    # GPT's head and embedding share a weight: its gradient is summed between their stages.
    assert priced.tied_seconds > 0
    assert priced.step_time == pytest.approx(_paid_once(zero_bubble.plan) + priced.tied_seconds)
    saved = priced.step_time - zero_bubble.step_time
    assert 0 < saved < (stages - 1) * max(stage.time for stage in zero_bubble.plan.stages)
    scored = evaluate_split(
        program, MESH_DP_CLUSTER, zero_bubble.pipeline, stage_planner=TENSOR_PARALLEL,
        microbatch=True, optimizer_states=0,
    )  # fmt: skip
    assert scored.step_time == pytest.approx(zero_bubble.step_time)
    assert [stage.in_flight for stage in zero_bubble.plan.stages] == [min(stages, 4)] * stages
    assert all(z >= o for z, o in zip(zero_bubble.memory, priced.memory, strict=True))
    assert zero_bubble.memory[-1] > priced.memory[-1]
    starved = search_pipelines(
        program, dataclasses.replace(MESH_DP_CLUSTER, memory=1.0), MESH_DP_PIPELINES,
        stage_planner=TENSOR_PARALLEL, microbatch=True, optimizer_states=0,
    )  # fmt: skip
    need = {o.pipeline.schedule: o.least_memory for o in starved.outcomes}
    assert need["1f1b"] is not None and need["zb-h1"] is not None
    assert need["1f1b"] < need["zb-h1"]
    limited = dataclasses.replace(MESH_DP_CLUSTER, memory=(need["1f1b"] + need["zb-h1"]) / 2)
    search = search_pipelines(
        program, limited, MESH_DP_PIPELINES, stage_planner=TENSOR_PARALLEL, microbatch=True,
        optimizer_states=0,
    )  # fmt: skip
    assert search.choice is not None and search.choice.pipeline.schedule == "1f1b"


# -- gloo processes ---------------------------------------------------------------------------


Batch = dict[str, torch.Tensor]


def _llama() -> tuple[torch.nn.Module, Batch]:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=32,
    )  # fmt: skip
    tokens = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1))
    return transformers.LlamaForCausalLM(config), {"input_ids": tokens, "labels": tokens}


def _t5() -> tuple[torch.nn.Module, Batch]:
    """A tiny T5: an encoder and a decoder of two blocks each, its one ``shared`` embedding
    read by the encoder, the decoder and (tied, T5's default) the head."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=2,
        num_heads=2, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (4, 8), generator=generator)
    labels = torch.randint(0, 64, (4, 6), generator=generator)
    return transformers.T5ForConditionalGeneration(config), {"input_ids": ids, "labels": labels}


@dataclasses.dataclass(frozen=True)
class HFCase:
    """A Hugging Face model under a pipeline, trained on its own batch by keyword."""

    name: str
    build: Callable[[], tuple[torch.nn.Module, Batch]]
    pipeline: Pipeline

    def __str__(self) -> str:
        return f"{self.name} under {self.pipeline.schedule}"


def _train(
    build: Callable[[], PipelineModel],
    batch: tuple[torch.Tensor, ...] = (),
    named: dict[str, Any] | None = None,
    probe: torch.Tensor | None = None,
) -> dict[str, Any]:
    """Two SGD steps of the pipeline ``build`` makes on the batch, when this rank started
    each gradient all-reduce (of the buckets over its stage's replicas, or of a tied weight's
    holders) of the second, and with a ``probe``, the trained pipeline's loss and its outputs
    for ``probe``."""
    named = named or {}
    reduced: list[float] = []
    bucketed: list[int] = []  # the tensors of each bucketed all-reduce call
    waiting = fxpar.runtime.waiting
    originals = {name: getattr(waiting, name) for name in ("all_reduce", "all_reduce_buckets")}

    def recording(original: Callable[..., Any]) -> Callable[..., Any]:
        def recorded(*args: Any, **kwargs: Any) -> Any:
            reduced.append(time.perf_counter())
            if original is originals["all_reduce_buckets"]:
                bucketed.append(len(args[0]))
            return original(*args, **kwargs)

        return recorded

    pipelined = build()
    for name, original in originals.items():
        setattr(waiting, name, recording(original))
    try:
        losses = [pipelined.step(*batch, **named)]
        reduced.clear()
        bucketed.clear()
        losses.append(pipelined.step(*batch, **named))
    finally:
        for name, original in originals.items():
            setattr(waiting, name, original)
    assert pipelined.trace is not None
    outcome = {
        "losses": losses,
        "parameters": {n: p.detach().clone() for n, p in pipelined.parameters.items()},
        "events": pipelined.trace.events,
        "reduced": reduced,
        "bucketed": bucketed,
        "trainable": len(pipelined._trainable),
    }
    if probe is not None:
        outcome["eval_loss"] = pipelined.loss(*batch, **named)
        outcome["outputs"] = pipelined(probe)
    return outcome


def _gpt_pipeline(pipeline: Pipeline) -> PipelineModel:
    model, tokens, targets = _gpt()
    return PipelineModel(
        model, pipeline, (tokens,), gpt_loss, example_targets=(targets,), optimizer=SGD(lr=LR)
    )


def _hf_pipeline(case: HFCase) -> PipelineModel:
    model, batch = case.build()
    return PipelineModel(model, case.pipeline, batch, optimizer=SGD(lr=LR))


LLAMA = HFCase("llama", _llama, Pipeline(stages=2, microbatches=2, schedule="zb-h1"))
T5_CASES = (
    # the encoder on stage 0, the decoder and head on stage 1: the tied embedding on both
    HFCase("t5", _t5, Pipeline(stages=("decoder.block.0",), microbatches=2, schedule="zb-h1")),
    # stage 0 holds chunks 0 (embedding, encoder.block.0) and 3 (decoder.block.1, head)
    HFCase(
        "t5",
        _t5,
        Pipeline(
            stages=("encoder.block.1", "decoder.block.0", "decoder.block.1"),
            microbatches=2,
            schedule="zb-v",
        ),
    ),
)
GLOO_CASES: dict[int, tuple[Pipeline | HFCase, ...]] = {
    2: (
        Pipeline(stages=2, microbatches=4, schedule="zb-h1"),
        LLAMA,
        *T5_CASES,
        Pipeline(stages=2, microbatches=4, schedule="zb-v"),
    ),
    4: (
        Pipeline(stages=2, microbatches=4, schedule="zb-h1", data_parallel=2),
        Pipeline(stages=4, microbatches=4, schedule="zb-h1", remat=True),
        Pipeline(stages=2, microbatches=2, schedule="zb-v", data_parallel=2),
    ),
}
"""By world size: the pipelines of fxpar's GPT (tied embedding), and the Hugging Face cases:
the Llama (ZB-H1) and the T5 (tied embedding; ZB-H1 and ZB-V)."""


def _on_ranks(rank: int, world_size: int) -> list[dict[str, Any]]:
    """Every case of :data:`GLOO_CASES` for this world size, on this rank; ZB-V's GPT cases
    also evaluate the trained model."""
    torch.set_num_threads(1)
    _, tokens, targets = _gpt()
    outcomes = []
    for case in GLOO_CASES[world_size]:
        if isinstance(case, HFCase):
            _, batch = case.build()
            outcomes.append(_train(functools.partial(_hf_pipeline, case), named=batch))
        else:
            probe = tokens if case.schedule == "zb-v" else None
            build = functools.partial(_gpt_pipeline, case)
            outcomes.append(_train(build, (tokens, targets), probe=probe))
    return outcomes


@pytest.fixture(scope="module", params=[2, 4], ids=["2 ranks", "4 ranks"])
def gloo_runs(request: pytest.FixtureRequest) -> tuple[int, list[list[dict[str, Any]]]]:
    if request.param == 4:
        return 4, [rank["cases"] for rank in request.getfixturevalue("four_ranks")]
    return request.param, spawn(_on_ranks, request.param, timeout_s=240)


def _on_four_ranks(rank: int, world_size: int) -> dict[str, list[dict[str, Any]]]:
    """The 4-rank :data:`GLOO_CASES`, then every :data:`MESH_CASES` pipeline: one spawn for
    both gloo tests on 4 processes (each spawn costs seconds of process start-up)."""
    return {
        "cases": _on_ranks(rank, world_size),
        "meshes": _mesh_cases_on_ranks(rank, world_size),
    }


@pytest.fixture(scope="module")
def four_ranks() -> list[dict[str, list[dict[str, Any]]]]:
    return spawn(_on_four_ranks, 4, timeout_s=240)


def _eager(case: Pipeline | HFCase) -> dict[str, Any]:
    """Two eager SGD steps of the case's model on its batch: the losses and the trained
    parameters; for the GPT, the trained model's loss and logits."""
    if isinstance(case, HFCase):
        model, batch = case.build()

        def step(module: torch.nn.Module) -> torch.Tensor:
            return module(**batch).loss
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
    expected: dict[str, Any] = {
        "losses": losses,
        "parameters": {n: p.detach() for n, p in reference.named_parameters()},
    }
    if not isinstance(case, HFCase):
        with torch.no_grad():
            expected["outputs"] = reference(tokens)
            expected["eval_loss"] = gpt_loss(expected["outputs"], targets)
    return expected


@pytest.mark.slow
def test_zero_bubble_pipelines_train_like_one_device_on_gloo(
    gloo_runs: tuple[int, list[list[dict[str, Any]]]],
) -> None:
    """Each case's two steps give every rank eager PyTorch's losses, and every parameter on
    every rank holding it (the tied embedding on the first and last stage, or under ZB-V
    twice on stage 0) its eagerly trained value; every parameter is held somewhere, T5's
    shared embedding on every rank. Every rank runs each micro-batch's B and W (each chunk's,
    under ZB-V), and a data-parallel rank starts its gradient all-reduces after its last W.
    The trained ZB-V GPT pipelines' loss and outputs (from stage 0, which computes the last
    chunk) are eager's too."""
    world_size, ranks = gloo_runs
    for index, case in enumerate(GLOO_CASES[world_size]):
        expected = _eager(case)
        pipeline = case.pipeline if isinstance(case, HFCase) else case
        microbatches, chunks = pipeline.microbatches, pipeline.virtual_stages
        held: set[str] = set()
        for rank, outcomes in enumerate(ranks):
            found = outcomes[index]
            what = f"{case}, rank {rank}"
            torch.testing.assert_close(found["losses"], expected["losses"], msg=what)
            for name, value in found["parameters"].items():
                torch.testing.assert_close(
                    value, expected["parameters"][name], msg=f"{what}: {name}"
                )
            held |= found["parameters"].keys()
            events = _check_outputs_and_halves(found, expected, chunks, microbatches, what)
            assert not any(e.op == "backward" for e in events), what
            if isinstance(case, HFCase) and case.name == "t5":  # read on every stage
                assert "shared.weight" in found["parameters"], what
            if pipeline.data_parallel > 1:
                last_weight = max(e.end for e in events if e.op == "backward_weight")
                assert found["reduced"] and min(found["reduced"]) >= last_weight, what
                # The stage's gradients go to its replicas in one bucketed call, not one
                # all-reduce a parameter.
                assert found["bucketed"] == [found["trainable"]], what
        assert held == set(expected["parameters"]), case


# -- stage meshes on gloo ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MeshCase:
    """A model under a zero-bubble pipeline whose stages run a manual plan on a mesh of 2, or
    (``cluster``) on the meshes ``fxpar.compile``'s stage DP chooses on that cluster."""

    name: str
    pipeline: Pipeline
    plan: str
    """``fxpar.plans.tensor_parallel`` or ``fully_sharded``, by name."""
    cluster: fxpar.Cluster | None = None

    def __str__(self) -> str:
        return f"{self.name} under {self.pipeline.schedule}, {self.plan} stages"

    def build(self) -> PipelineModel:
        manual = getattr(plans, self.plan)
        common: dict[str, Any] = {"optimizer": SGD(lr=LR)}
        if self.name in HF_MODELS:
            model, batch = HF_MODELS[self.name]()
        else:
            model, tokens, targets = _gpt()
        if self.cluster is not None:
            return fxpar.compile(
                model, self.cluster, (tokens,), gpt_loss, example_targets=(targets,),
                pipeline=self.pipeline, manual=manual, **common,
            )  # fmt: skip
        common["planner"] = functools.partial(plan_program, manual=manual)
        if self.pipeline.stage_meshes is None:
            common["stage_cluster"] = fxpar.Cluster((2,))
        if self.name in HF_MODELS:
            return PipelineModel(model, self.pipeline, batch, **common)
        return PipelineModel(
            model, self.pipeline, (tokens,), gpt_loss, example_targets=(targets,), **common
        )


HF_MODELS = {"llama": _llama, "t5": _t5}


MESHES = ((2,), (2,))
MESH_CASES = (
    MeshCase("gpt", Pipeline(stages=2, microbatches=4, schedule="zb-h1"), "tensor_parallel"),
    MeshCase("gpt", Pipeline(stages=2, microbatches=2, schedule="zb-v"), "fully_sharded"),
    MeshCase(
        "llama",
        Pipeline(stages=2, microbatches=2, schedule="zb-h1", stage_meshes=MESHES),
        "fully_sharded",
    ),
    # chunks 0 (the embedding) and 3 (the norm, head and loss) on stage 0
    MeshCase(
        "llama",
        Pipeline(
            stages=("model.layers.0", "model.layers.1", "model.norm"),
            microbatches=2,
            schedule="zb-v",
            stage_meshes=MESHES,
        ),
        "tensor_parallel",
    ),
    # the encoder on stage 0, the decoder and head on stage 1: the tied embedding on both
    MeshCase(
        "t5",
        Pipeline(stages=("decoder.block.0",), microbatches=2, schedule="zb-h1"),
        "fully_sharded",
    ),
    MeshCase("gpt", MESH_DP_PIPELINES[1], "tensor_parallel", MESH_DP_CLUSTER),
)
"""2 stages x 2 devices: fxpar's GPT (tied embedding and head, held by stage 0's two chunks
under ZB-V) and a Hugging Face Llama, each under ZB-H1 and ZB-V, tensor parallel in one and
fully sharded in the other; a Hugging Face T5 (tied embedding on both stages) fully sharded
under ZB-H1. Last, the GPT under ZB-H1 on the stages and meshes fxpar.compile's stage DP
chooses for tensor parallel plans on 4 devices of slow links, which search_pipelines
prefers to 1F1B's (the stage DP's test above)."""


def _mesh_cases_on_ranks(rank: int, world_size: int) -> list[dict[str, Any]]:
    """Two SGD steps of every :data:`MESH_CASES` pipeline on this rank: the losses, the
    whole trained model (gathered from every stage and device), the second step's
    instructions and when each gradient sync (into the parameters' layouts) started; the
    trained GPT's loss and outputs under ZB-V."""
    torch.set_num_threads(1)
    syncs: list[float] = []
    run = GradientSync.run

    def recorded(self: GradientSync, sums: Any) -> Any:
        syncs.append(time.perf_counter())
        return run(self, sums)

    GradientSync.run = recorded  # type: ignore[method-assign]
    outcomes = []
    _, tokens, targets = _gpt()
    for case in MESH_CASES:
        pipelined = case.build()
        batch: tuple[torch.Tensor, ...] = (tokens, targets) if case.name == "gpt" else ()
        named = HF_MODELS[case.name]()[1] if case.name in HF_MODELS else {}
        losses = [pipelined.step(*batch, **named)]
        syncs.clear()
        losses.append(pipelined.step(*batch, **named))
        assert pipelined.trace is not None
        outcome = {
            "losses": losses, "state": pipelined.full_state_dict(),
            "events": pipelined.trace.events, "synced": list(syncs),
            "pipeline": pipelined.pipeline,
        }  # fmt: skip
        if case.name == "gpt" and case.pipeline.schedule == "zb-v":
            outcome["eval_loss"] = pipelined.loss(*batch)
            outcome["outputs"] = pipelined(tokens)
        outcomes.append(outcome)
    return outcomes


@pytest.mark.slow
def test_zero_bubble_pipelines_on_stage_meshes_train_like_one_device_on_gloo(
    four_ranks: list[dict[str, list[dict[str, Any]]]],
    mesh_dp_search: tuple[fxpar.Program, Any],
) -> None:
    """ZB-H1 and ZB-V with every stage's backward lowered to a mesh of 2 devices (tensor
    parallel or fully sharded, so B and W call collectives), and ZB-H1 on the stage meshes
    the stage DP chose: on every rank both steps' losses are eager PyTorch's and the gathered
    model is the eagerly trained one (the GPT's tied weight summed from two chunks of stage 0,
    each converting its own gradient under ZB-V; T5's shared embedding from both stages);
    each micro-batch's B and W ran for every chunk, and the gradient syncs (the fully sharded
    plan's reduce-scatters) started after the last W. The trained ZB-V GPT's loss and
    outputs are eager's too, and the compiled pipeline is the one search_pipelines chooses
    over 1F1B and ZB-H1."""
    ranks = [rank["meshes"] for rank in four_ranks]
    _, search = mesh_dp_search
    assert search.choice is not None
    for index, case in enumerate(MESH_CASES):
        if case.name in HF_MODELS:
            expected = _eager(HFCase(case.name, HF_MODELS[case.name], case.pipeline))
        else:
            expected = _eager(case.pipeline)
        if case.cluster is not None:
            assert {r[index]["pipeline"] for r in ranks} == {search.choice.pipeline}, case
        microbatches, chunks = case.pipeline.microbatches, case.pipeline.virtual_stages
        for rank, outcomes in enumerate(ranks):
            found, what = outcomes[index], f"{case}, rank {rank}"
            torch.testing.assert_close(found["losses"], expected["losses"], msg=what)
            for name, value in expected["parameters"].items():
                torch.testing.assert_close(found["state"][name], value, msg=f"{what}: {name}")
            events = _check_outputs_and_halves(found, expected, chunks, microbatches, what)
            last_weight = max(e.end for e in events if e.op == "backward_weight")
            assert found["synced"] and min(found["synced"]) >= last_weight, what


def _check_outputs_and_halves(
    found: dict[str, Any], expected: dict[str, Any], chunks: int, microbatches: int, what: str
) -> list[Any]:
    """One rank's evaluation loss and outputs (where it reports them) equal eager's, and it ran
    B and W of every (chunk, micro-batch) once; its schedule's events, for further checks."""
    for key in ("eval_loss", "outputs"):
        if key in found:
            torch.testing.assert_close(found[key], expected[key], msg=f"{what}: {key}")
    events = found["events"]
    for op in ("backward_input", "backward_weight"):
        done = sorted((e.chunk, e.microbatch) for e in events if e.op == op)
        assert done == [(c, m) for c in range(chunks) for m in range(microbatches)], what
    return events
