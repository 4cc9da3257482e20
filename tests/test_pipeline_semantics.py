"""A pipeline trains the model the user wrote, on the whole batch, or says where it does not.

- Masked losses (RoBERTa and BERT masked-LM with ``-100`` labels and padding, a hand-written
  ``(l * mask).sum() / mask.sum()``, and the same with ``.clamp(min=1)``), cut into
  micro-batches holding different numbers of valid targets (for the hand-written losses, one
  holding none), give the loss
  and gradients of eager PyTorch on the whole batch, in float64 to 1e-10: split into two
  stages with and without remat, run by a one-stage ``PipelineModel``, under a data-parallel
  and a tensor-parallel plan inside the stage, and on gloo processes (GPipe and 1F1B, remat on
  and off, data-parallel replicas, a stage mesh). The mean of per-micro-batch means, which
  pipelines computed before, is far off here (NaN with the empty micro-batch).
- A sum loss is the sum over micro-batches, not their mean; a mean stays their mean.
- What a pipeline computes differently (BatchNorm's per-micro-batch statistics, a loss that
  is not a sum or a mean) is logged as a warning and listed in ``semantics`` and the repr.
"""

from __future__ import annotations

import copy
import functools
import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import eager_step
from torch import nn

import fxpar
from fxpar import plans
from fxpar.cluster import Cluster
from fxpar.ir.program import named_state
from fxpar.optim import SGD
from fxpar.passes.canonicalize import Canonicalize
from fxpar.pipeline import Pipeline, PipelineModel, partition, split_program
from fxpar.runtime.launch import spawn
from fxpar.testing.pipeline import simulate_pipeline

transformers = pytest.importorskip("transformers")

BATCH, LENGTH, VOCAB, MICROBATCHES = 8, 6, 32, 4
TOLERANCE = {"rtol": 1e-10, "atol": 1e-12}
Batch = dict[str, torch.Tensor]


def _labels(ids: torch.Tensor, *, empty: bool) -> torch.Tensor:
    """Masked-LM labels whose micro-batches (2 rows each) hold 9, 1, 0 and 7 valid targets,
    or 9, 1, 3 and 7 without an empty one."""
    valid = torch.zeros(ids.shape, dtype=torch.bool)
    valid[0, :6], valid[1, 3:] = True, True
    valid[2, 4] = True
    valid[5, 1:4] = not empty
    valid[6, :], valid[7, 5] = True, True
    return torch.where(valid, ids, torch.full_like(ids, -100))


def _hf_case(kind: str) -> tuple[nn.Module, Batch, None, tuple[str, ...]]:
    common = {
        "vocab_size": VOCAB,
        "hidden_size": 16,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "intermediate_size": 32,
        "max_position_embeddings": 32,
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
    }
    torch.manual_seed(0)
    if kind == "roberta":
        model = transformers.RobertaForMaskedLM(transformers.RobertaConfig(**common))
    else:
        model = transformers.BertForMaskedLM(transformers.BertConfig(**common))
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (BATCH, LENGTH), generator=generator)
    attention = torch.ones_like(ids)
    attention[1, :3], attention[4, 2:] = 0, 0  # padding, never a target
    labels = _labels(ids, empty=False)
    batch = {"input_ids": ids, "attention_mask": attention, "labels": labels}
    return model.double(), batch, None, (f"{kind}.encoder.layer.1",)


class _Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.body = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.head = nn.Linear(8, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(tokens)))


def _masked_mean(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    losses = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
    return (losses * mask.flatten()).sum() / mask.sum()


def _clamped_masked_mean(
    logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    losses = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
    valid = mask.flatten()
    return (losses * valid).sum() / valid.sum().clamp(min=1)


def _tagger_case(loss_fn: Callable[..., torch.Tensor], dtype: torch.dtype) -> tuple[Any, ...]:
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (BATCH, LENGTH), generator=generator)
    targets = torch.randint(0, VOCAB, (BATCH, LENGTH), generator=generator)
    mask = (_labels(tokens, empty=True) != -100).to(dtype)
    batch = {"tokens": tokens, "targets": targets, "mask": mask}
    return _Tagger().double(), batch, loss_fn, ("head",)


CASES: dict[str, Callable[[], tuple[Any, ...]]] = {
    "roberta": functools.partial(_hf_case, "roberta"),
    "bert": functools.partial(_hf_case, "bert"),
    "masked_mean": functools.partial(_tagger_case, _masked_mean, torch.float64),
    "clamped_bool_mask": functools.partial(_tagger_case, _clamped_masked_mean, torch.bool),
}


def _split(batch: Batch, count: int) -> list[Batch]:
    """``count`` equal micro-batches, each keeping the batch's order (the step's inputs)."""
    size = BATCH // count
    return [{n: t[i * size : (i + 1) * size] for n, t in batch.items()} for i in range(count)]


def _arguments(model: nn.Module, batch: Batch, loss_fn: Any) -> tuple[Any, tuple[Any, ...]]:
    """(inputs, targets) as capture and eager_step take them."""
    if loss_fn is None:
        return batch, ()
    return (batch["tokens"],), (batch["targets"], batch["mask"])


def _eager(case: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model, batch, loss_fn, _ = CASES[case]()
    inputs, targets = _arguments(model, batch, loss_fn)
    return eager_step(model, inputs, loss_fn, targets)


def _assert_whole_batch_step(
    case: str, loss: torch.Tensor, gradients: dict[str, torch.Tensor], label: str = ""
) -> None:
    expected_loss, expected = _eager(case)
    torch.testing.assert_close(loss, expected_loss, **TOLERANCE, msg=lambda m: f"{label} loss: {m}")
    assert gradients.keys() <= expected.keys()
    for name, gradient in gradients.items():
        torch.testing.assert_close(
            gradient, expected[name], **TOLERANCE, msg=lambda m, name=name: f"{label} {name}: {m}"
        )


def _program(case: str) -> tuple[nn.Module, Batch, fxpar.Program, tuple[str, ...]]:
    model, batch, loss_fn, points = CASES[case]()
    inputs, targets = _arguments(model, _split(batch, MICROBATCHES)[0], loss_fn)
    program = fxpar.capture(model, inputs, loss_fn, example_targets=targets)
    return model, batch, Canonicalize().run(program), points


@pytest.mark.parametrize("remat", [False, True], ids=["stash", "remat"])
@pytest.mark.parametrize("case", list(CASES))
def test_two_stages_of_a_masked_loss_give_the_whole_batch_step(case: str, remat: bool) -> None:
    model, batch, program, points = _program(case)
    split = split_program(program, partition(program, points), remat=remat)
    assert split.semantics.summed and split.semantics.notes == ()
    pieces = [list(piece.values()) for piece in _split(batch, MICROBATCHES)]
    result = split.run_microbatches(named_state(model), pieces)
    _assert_whole_batch_step(case, result.loss, result.gradients)
    # Every stage divides by the whole batch's count, read as an input.
    assert "loss_denominator" in split.forward[1].code()
    assert "loss_denominator" in split.backward[1].code()


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("case", ["roberta", "clamped_bool_mask"])
def test_pipeline_model_of_a_masked_loss_gives_the_whole_batch_step(
    case: str, schedule: str
) -> None:
    """The runtime path, in one process: PipelineModel canonicalizes the captured step,
    computes the whole batch's count and sums the micro-batches' shares."""
    model, batch, loss_fn, _ = CASES[case]()
    inputs, targets = _arguments(model, batch, loss_fn)
    pipelined = PipelineModel(
        copy.deepcopy(model), Pipeline(stages=1, microbatches=MICROBATCHES, schedule=schedule),  # type: ignore[arg-type]
        inputs, loss_fn, example_targets=targets, optimizer=SGD(lr=0.1),
    )  # fmt: skip
    loss = pipelined.compute_gradients(*batch.values())
    _assert_whole_batch_step(case, loss, pipelined.gradients)
    assert "whole-batch step" in repr(pipelined)


@pytest.mark.parametrize("plan", ["data_parallel", "tensor_parallel"])
def test_masked_loss_under_a_plan_inside_the_stages(plan: str) -> None:
    """Each stage runs an intra-op plan on 2 devices (simulated in threads): the count the
    plan would have all-reduced arrives whole, replicated, and the step is still exact."""
    model, batch, program, points = _program("roberta")
    cluster = Cluster((2,))
    planned = getattr(plans, plan)(program, cluster)
    split = split_program(planned, partition(planned, points), remat=False)
    pieces = [list(piece.values()) for piece in _split(batch, MICROBATCHES)]
    result = simulate_pipeline(split, cluster, named_state(model), pieces)
    _assert_whole_batch_step("roberta", result.loss, result.gradients)


def _cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")


def _squares_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return (logits - targets[..., None]).pow(2).sum()


def _batch_mean_then_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return (logits - targets[..., None]).pow(2).mean(0).sum()


def _mean(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return (logits - targets[..., None]).pow(2).mean()


@pytest.mark.parametrize(
    ("loss_fn", "summed"),
    [
        (_cross_entropy_sum, True),
        (_squares_sum, True),
        (_batch_mean_then_sum, False),
        (_mean, False),
    ],
    ids=["cross_entropy_sum", "squares_sum", "batch_mean_then_sum", "mean"],
)
def test_sums_and_means_over_the_batch_combine_exactly(
    loss_fn: Callable[..., torch.Tensor], summed: bool
) -> None:
    """A sum over the batch (reduction="sum") is the sum of the micro-batches' (their mean,
    which pipelines took, is 1/M of it); a mean over the batch, summed over features after,
    is still their mean; so is a plain mean."""
    model, batch, _, _ = CASES["masked_mean"]()
    tokens, targets = batch["tokens"], batch["targets"]
    pipelined = PipelineModel(
        copy.deepcopy(model), Pipeline(stages=1, microbatches=MICROBATCHES), (tokens,), loss_fn,
        example_targets=(targets,), optimizer=SGD(lr=0.1),
    )  # fmt: skip
    assert pipelined.semantics.summed == summed and pipelined.semantics.notes == ()
    loss = pipelined.compute_gradients(tokens, targets)
    expected_loss, expected = eager_step(model, (tokens,), loss_fn, (targets,))
    torch.testing.assert_close(loss, expected_loss, **TOLERANCE)
    for name, gradient in pipelined.gradients.items():
        torch.testing.assert_close(gradient, expected[name], **TOLERANCE, msg=name)


class _BatchNormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(6, 8)
        self.norm = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.norm(self.first(x))))


def _semantics(model: nn.Module, loss_fn: Callable[..., torch.Tensor]) -> PipelineModel:
    inputs = torch.randn(8, 6)
    return PipelineModel(model, Pipeline(stages=1, microbatches=4), (inputs,), loss_fn)


def test_what_differs_from_the_whole_batch_is_warned_and_listed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """BatchNorm's statistics per micro-batch, a loss that is neither a sum nor a sum over a
    count, a sum scaled by a number that is no count, and a sum of terms some of which are
    means over the batch: each a warning at construction, a note in ``semantics`` and the
    repr. A plain mean has none."""
    torch.manual_seed(0)
    with caplog.at_level(logging.WARNING, logger="fxpar.pipeline.model"):
        batch_norm = _semantics(_BatchNormNet(), lambda out: out.pow(2).mean())
        root_mean_square = _semantics(nn.Linear(6, 3), lambda out: out.pow(2).mean().sqrt())
        scaled = _semantics(nn.Linear(6, 3), lambda out: out.pow(2).sum() / 3.0)
        plain = _semantics(nn.Linear(6, 3), lambda out: out.pow(2).mean())
        mixed = _semantics(nn.Linear(6, 3), lambda out: (out - out.mean(0)).pow(2).sum())
    (note,) = mixed.semantics.notes
    assert "adds terms that are sums over the batch to terms that are means" in note
    (note,) = batch_norm.semantics.notes
    assert "'norm' normalises each micro-batch" in note and "GPipe" in note
    (note,) = root_mean_square.semantics.notes
    assert "not a sum over the batch, nor a sum divided by a count" in note
    (note,) = scaled.semantics.notes
    assert "divides a sum by 3.0, which is not a multiple of the micro-batch size 2" in note
    assert plain.semantics.notes == () and not plain.semantics.summed
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 4
    assert all("does not train on the whole batch at once" in message for message in warned)
    assert "1 semantic notes (see .semantics)" in repr(batch_norm)
    assert "mean of the micro-batch losses" in str(plain.semantics)


class _ClassWeighted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tagger = _Tagger()
        self.register_buffer("class_weights", torch.linspace(0.5, 1.5, VOCAB))

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.tagger(tokens).flatten(0, 1)
        return F.cross_entropy(logits, targets.flatten(), weight=self.class_weights)


def test_class_weights_from_a_buffer_are_named_in_a_note() -> None:
    """Cross-entropy's denominator is then a sum of buffer values: not computed ahead, so the
    note says which buffer and that each micro-batch divides by its own."""
    torch.manual_seed(0)
    tokens = torch.randint(0, VOCAB, (8, LENGTH))
    pipelined = PipelineModel(
        _ClassWeighted(), Pipeline(stages=1, microbatches=4), (tokens, _labels(tokens, empty=False))
    )
    (note,) = pipelined.semantics.notes
    assert "reads ['class_weights'] besides the batch" in note


def _gloo_cases(rank: int, world_size: int) -> tuple[list[Any], dict[str, torch.Tensor]]:
    """RoBERTa's masked LM on 2 processes: two stages under each schedule with and without
    remat, one stage of two data-parallel replicas, one stage on a 2-device mesh; and the
    buffers of the two-stage model's full state dict."""
    torch.set_num_threads(1)
    model, batch, _, points = CASES["roberta"]()
    pipelines = [
        Pipeline(stages=points, microbatches=MICROBATCHES, schedule=schedule, remat=remat)
        for schedule in ("gpipe", "1f1b")
        for remat in (False, True)
    ]
    pipelines.append(Pipeline(stages=1, microbatches=2, data_parallel=2))
    results = []
    for pipeline in pipelines:
        pipelined = fxpar.compile(
            copy.deepcopy(model), Cluster((world_size,)), batch, optimizer=SGD(lr=0.1),
            pipeline=pipeline,
        )  # fmt: skip
        loss = pipelined.compute_gradients(**batch)
        results.append((str(pipeline), loss, dict(pipelined.gradients)))
        if len(results) == 1:  # position_ids is read by no stage; stage 0 keeps it
            state = pipelined.full_state_dict()
            buffers = {name: state[name] for name, _ in model.named_buffers()}
    meshed = fxpar.compile(
        copy.deepcopy(model), Cluster((1, world_size)), batch, optimizer=SGD(lr=0.1),
        pipeline=Pipeline(stages=1, microbatches=2), manual=plans.data_parallel,
    )  # fmt: skip
    results.append(("stage mesh (2,)", meshed.compute_gradients(**batch), dict(meshed.gradients)))
    return results, buffers


@pytest.mark.slow
def test_masked_lm_pipelines_on_gloo_give_the_whole_batch_step() -> None:
    """Every rank's loss is the whole batch's, and so is every gradient it holds; between
    them the ranks hold every gradient. Every rank gathers every buffer, even one that no
    stage reads (RoBERTa's position_ids)."""
    per_rank = spawn(_gloo_cases, 2)
    everything = set(_eager("roberta")[1])
    for case in range(len(per_rank[0][0])):
        held: set[str] = set()
        for rank, (results, _) in enumerate(per_rank):
            label, loss, gradients = results[case]
            _assert_whole_batch_step("roberta", loss, gradients, f"rank {rank}, {label}")
            held |= gradients.keys()
        assert held == everything, per_rank[0][0][case][0]
    expected = dict(CASES["roberta"]()[0].named_buffers())
    assert "roberta.embeddings.position_ids" in expected
    for _, buffers in per_rank:
        torch.testing.assert_close(buffers, expected)
