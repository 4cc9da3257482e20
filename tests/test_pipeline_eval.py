"""A pipeline evaluates and infers like eager PyTorch: ``pipelined(*inputs)`` returns the model's
outputs, whole on every rank; ``eval()`` / ``train()`` switch dropout and BatchNorm as
``nn.Module`` does, for ``loss``, the forward and the step alike; and training goes on across
them over the same state.

One script of calls runs on eager PyTorch (the reference) and on pipelines over gloo ranks: 2
stages x 2 micro-batches, 2 stages x 2 data-parallel replicas, and 2 stages on a stage mesh of
2 devices under the ILP's plan. A pipeline runs the model once per piece (micro-batch, and
replica's share of it), so the reference does too: eager loops over the same pieces in the same
order, which draws the same dropout masks (every rank draws every piece's masks from the
generator copied from rank 0) and updates BatchNorm's running statistics once per piece, as the
pipeline does. In eval mode that loop is the whole batch's forward (no dropout, running
statistics), so the eval outputs after training equal eager eval's exactly when the running
statistics the training left match, which the script checks through the state.

Two spawns (2 ranks, 4 ranks) run every multi-process check; the parent compares.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import transformers
from conftest import EagerReference, assert_same_results
from torch import nn
from zoo import CNN

import fxpar
from fxpar import plans
from fxpar.cluster import Cluster
from fxpar.errors import BatchError, FxparError
from fxpar.ir.program import named_state
from fxpar.models import GPT, GPTConfig, gpt_loss
from fxpar.passes import plan_program
from fxpar.passes.canonicalize import Canonicalize
from fxpar.pipeline import Pipeline, PipelineError, PipelineModel, partition, split_program
from fxpar.pipeline.stage_programs import check_state
from fxpar.runtime.launch import spawn
from fxpar.testing.strategies import splitting_cluster

GPT_CONFIG = GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=16, dropout=0.2)
LR = 0.3
CNN_SPLIT = ("features.4",)  # stage 0: conv, BatchNorm, pool; stage 1: conv, BatchNorm, head
GPT_LAYOUTS = ("2 stages", "2 stages x 2 replicas", "2 stages x stage mesh (2,)")


class Eager(EagerReference):
    """The reference: the calls a PipelineModel takes, run eagerly on each of ``pieces`` pieces
    of the batch in turn (a pipeline's micro-batches and replicas' shares, in their order), with
    the losses and gradients of a mean loss averaged; ``loss`` changes nothing."""

    def __init__(self, model: nn.Module, loss_fn: Callable[..., torch.Tensor], pieces: int):
        super().__init__(model, LR)
        self.loss_fn = loss_fn
        self.pieces = pieces

    def _losses(self, inputs: torch.Tensor, targets: torch.Tensor) -> list[torch.Tensor]:
        return [
            self.loss_fn(self.model(x), y)
            for x, y in zip(inputs.chunk(self.pieces), targets.chunk(self.pieces), strict=True)
        ]

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        losses = []
        for x, y in zip(inputs.chunk(self.pieces), targets.chunk(self.pieces), strict=True):
            loss = self.loss_fn(self.model(x), y)
            (loss / self.pieces).backward()
            losses.append(loss.detach())
        self.optimizer.step()
        return torch.stack(losses).mean()

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with self.unchanged():
            return torch.stack(self._losses(inputs, targets)).mean()

    def __call__(self, inputs: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return torch.cat([self.model(x) for x in inputs.chunk(self.pieces)])


def _tokens(*shape: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, GPT_CONFIG.vocab_size, shape, generator=generator)


def _gpt_script(model: Any) -> dict[str, Any]:
    a, b, c = _tokens(4, 8, seed=1), _tokens(4, 8, seed=2), _tokens(8, 8, seed=3)
    found: dict[str, Any] = {"step 0": model.step(a, a)}
    found["forward (train)"] = model(b)  # dropout draws, as eager's
    found["loss (train)"] = model.loss(b, b)  # draws what the next call draws, then forgets
    found["step 1"] = model.step(b, b)
    model.eval()
    found["forward (eval)"] = model(b)
    found["forward (eval, 8 rows)"] = model(c)  # another batch size: captured and cut anew
    found["loss (eval)"] = model.loss(b, b)
    found["step 2 (eval mode)"] = model.step(a, a)
    model.train()
    found["step 3"] = model.step(b, b)
    found["state"] = model.full_state_dict()
    return found


def _cnn_batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    images = torch.randn(8, 3, 8, 8, generator=generator)
    return images, torch.randint(0, 10, (8,), generator=generator)


def _cnn_script(model: Any) -> dict[str, Any]:
    images, labels = _cnn_batch()
    found: dict[str, Any] = {"step 0": model.step(images, labels)}
    found["forward (train)"] = model(images)  # BatchNorm updates its statistics per piece
    found["state after forward (train)"] = model.full_state_dict()
    found["loss (train)"] = model.loss(images, labels)  # and here it does not
    model.eval()
    found["forward (eval)"] = model(images)  # BatchNorm normalizes by its statistics
    found["loss (eval)"] = model.loss(images, labels)
    found["step 1 (eval mode)"] = model.step(images, labels)
    model.train()
    found["step 2"] = model.step(images, labels)
    found["state"] = model.full_state_dict()
    return found


def _eager_gpt(pieces: int) -> dict[str, Any]:
    torch.manual_seed(0)
    return _gpt_script(Eager(GPT(GPT_CONFIG), gpt_loss, pieces))


def _eager_cnn(pieces: int) -> dict[str, Any]:
    torch.manual_seed(0)
    return _cnn_script(Eager(CNN(), F.cross_entropy, pieces))


def _gpt_pipeline(layout: str) -> PipelineModel:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(GPT_CONFIG)
    tokens = _tokens(4, 8, seed=1)
    common: dict[str, Any] = {"example_targets": (tokens,), "optimizer": fxpar.optim.SGD(lr=LR)}
    if layout == "2 stages x stage mesh (2,)":
        pipelined = fxpar.compile(
            model, splitting_cluster((2, 2)), (tokens,), gpt_loss, **common,
            pipeline=Pipeline(stages=2, microbatches=2),
        )  # fmt: skip
        assert isinstance(pipelined, PipelineModel) and pipelined.sharded is not None
        return pipelined
    replicas = 2 if layout == "2 stages x 2 replicas" else 1
    pipeline = Pipeline(stages=2, microbatches=2, data_parallel=replicas)
    return PipelineModel(model, pipeline, (tokens,), gpt_loss, **common)


def _cnn_pipeline() -> PipelineModel:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    images, labels = _cnn_batch()
    return PipelineModel(
        CNN(), Pipeline(stages=CNN_SPLIT, microbatches=2), (images,), F.cross_entropy,
        example_targets=(labels,), optimizer=fxpar.optim.SGD(lr=LR),
    )  # fmt: skip


class _Swapping(nn.Module):
    """Runs its layers in the other order in eval mode: a cut at ``second`` puts ``first`` in
    the second stage of the eval program, which the training split keeps in the first."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            return self.second(self.first(x))
        return self.first(self.second(x))


def _swapping_refused() -> str:
    torch.manual_seed(0)
    x = torch.randn(4, 4)
    pipelined = PipelineModel(
        _Swapping(), Pipeline(stages=("second",), microbatches=2), (x,), F.mse_loss,
        example_targets=(x,),
    )  # fmt: skip
    pipelined.step(x, x)
    pipelined.eval()
    try:
        pipelined.loss(x, x)
    except PipelineError as error:
        return str(error)
    return "not refused"


def _moved_layout_refused() -> str:
    """A planner that cannot pin (a manual plan) and lays out the eval program's weights
    otherwise than the training plan's is refused, not trained."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    tokens = _tokens(4, 8, seed=1)
    chosen = iter([plans.tensor_parallel, plans.data_parallel])

    def planner(program: fxpar.Program, cluster: Cluster) -> fxpar.Plan:
        return plan_program(program, cluster, manual=next(chosen))

    pipelined = PipelineModel(
        GPT(GPT_CONFIG), Pipeline(stages=1, microbatches=2), (tokens,), gpt_loss,
        example_targets=(tokens,), stage_cluster=Cluster((2,)), planner=planner,
    )  # fmt: skip
    pipelined.eval()
    try:
        pipelined(tokens)
    except PipelineError as error:
        return str(error)
    return "not refused"


class _Structured(nn.Module):
    """Returns a dict with a tuple in it, and a constant that is not a tensor; ``hidden`` is
    computed by the first stage when cut at ``layer``, and relayed to the last."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.layer = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> dict[str, Any]:
        hidden = self.first(x)
        y = self.layer(hidden.relu()) * scale
        return {"y": y, "pair": (hidden, x.argmax(-1) > 1), "note": "kept"}


def _structured_outputs(pipeline: Pipeline) -> tuple[Any, Any]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = _Structured()
    x = torch.randn(6, 4)
    pipelined = PipelineModel(
        model, pipeline, {"x": x}, lambda out, target: F.mse_loss(out["y"], target),
        example_targets=(torch.zeros(6, 3),),
    )  # fmt: skip
    with torch.no_grad():
        return pipelined(x=x, scale=2.0), model(x, scale=2.0)


def _assert_structured(found: Any, expected: Any) -> None:
    assert found.keys() == expected.keys() and found["note"] == "kept"
    torch.testing.assert_close(found["y"], expected["y"])
    torch.testing.assert_close(found["pair"][0], expected["pair"][0])
    assert found["pair"][1].dtype == torch.bool
    assert torch.equal(found["pair"][1], expected["pair"][1])


def _on_two_ranks(rank: int, world_size: int) -> dict[str, Any]:
    return {
        "gpt": _gpt_script(_gpt_pipeline(GPT_LAYOUTS[0])),
        "cnn": _cnn_script(_cnn_pipeline()),
        "structured": _structured_outputs(Pipeline(stages=("layer",), microbatches=3)),
        "swapping": _swapping_refused(),
        "moved": _moved_layout_refused(),
    }


def _on_four_ranks(rank: int, world_size: int) -> dict[str, Any]:
    return {layout: _gpt_script(_gpt_pipeline(layout)) for layout in GPT_LAYOUTS[1:]}


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return spawn(_on_two_ranks, 2, timeout_s=240)


@pytest.fixture(scope="module")
def four_ranks() -> list[dict[str, Any]]:
    return spawn(_on_four_ranks, 4, timeout_s=240)


@pytest.mark.slow
@pytest.mark.parametrize("layout", GPT_LAYOUTS)
def test_gpt_evaluates_infers_and_trains_across_modes_like_eager(
    layout: str, request: pytest.FixtureRequest
) -> None:
    """Every rank returns the eager values: the step's losses in both modes, the forward's
    outputs (dropout's draws in train mode; none in eval, at the example's batch size and
    another) and the loss, then the state after training on in train mode."""
    if layout == GPT_LAYOUTS[0]:
        results = [rank["gpt"] for rank in request.getfixturevalue("two_ranks")]
    else:
        results = [rank[layout] for rank in request.getfixturevalue("four_ranks")]
    replicas = 2 if layout == "2 stages x 2 replicas" else 1
    expected = _eager_gpt(2 * replicas)
    for found in results:
        assert_same_results(found, expected)


@pytest.mark.slow
def test_batchnorm_pipeline_keeps_running_statistics_like_eager_per_microbatch(
    two_ranks: list[dict[str, Any]],
) -> None:
    """BatchNorm in train mode normalizes each micro-batch and updates its running statistics
    once per micro-batch, in the step and in the forward (not in loss()); in eval mode it
    normalizes by them. Eager PyTorch looping over the micro-batches does the same, so every
    value, the eval outputs after training included, is eager's."""
    expected = _eager_cnn(2)
    for rank in two_ranks:
        assert_same_results(rank["cnn"], expected)
    # The forward in train mode did update the statistics (the check above is not vacuous).
    assert not torch.equal(
        expected["state after forward (train)"]["features.1.running_mean"],
        _eager_cnn_after_step()["features.1.running_mean"],
    )


@functools.cache
def _eager_cnn_after_step() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    eager = Eager(CNN(), F.cross_entropy, 2)
    images, labels = _cnn_batch()
    eager.step(images, labels)
    return eager.full_state_dict()


@pytest.mark.slow
def test_a_cut_that_would_move_state_is_refused(two_ranks: list[dict[str, Any]]) -> None:
    """The eval program of a model whose layers run in another order in eval mode would need
    the first layer's weights on the second stage: refused, naming them; and a stage plan that
    lays a weight out otherwise than the training plan (a manual planner, which cannot be
    pinned) is refused too."""
    for rank in two_ranks:
        assert "needs ['first.weight', 'first.bias'] on stage 1" in rank["swapping"]
        assert "stages {'first.weight': [0], 'first.bias': [0]}" in rank["swapping"]
        assert "lays out" in rank["moved"] and "differently from the training plan" in rank["moved"]


@pytest.mark.slow
def test_outputs_of_the_last_stage_reach_every_rank_in_the_models_structure(
    two_ranks: list[dict[str, Any]],
) -> None:
    """A dict holding a tuple, a bool tensor (broadcast as bytes) and a constant, from inputs
    by keyword, 3 micro-batches of 2 rows: the first stage's rank gets them whole too, and an
    output the first stage computes comes through the last."""
    for rank in two_ranks:
        _assert_structured(*rank["structured"])


# -- in one process ---------------------------------------------------------------------------


def _one_stage(model: nn.Module, inputs: Any, loss_fn: Any = None, **kwargs: Any) -> PipelineModel:
    torch.manual_seed(0)
    return PipelineModel(model, Pipeline(stages=1, microbatches=2), inputs, loss_fn, **kwargs)


def test_train_and_eval_return_the_pipeline_and_set_the_mode() -> None:
    tokens = _tokens(4, 8, seed=1)
    model = GPT(GPT_CONFIG)
    pipelined = _one_stage(model, (tokens,), gpt_loss, example_targets=(tokens,))
    assert pipelined.training
    assert pipelined.eval() is pipelined and not pipelined.training
    assert pipelined.train() is pipelined and pipelined.training
    assert model.training  # the user's model is left in its own mode
    model.eval()
    assert not _one_stage(model, (tokens,), gpt_loss, example_targets=(tokens,)).training


def test_forward_returns_the_models_structure_from_keyword_inputs() -> None:
    """A dict holding a tuple, a bool tensor and a constant, from inputs by keyword with a
    flag that is not a tensor (baked into the captured forward)."""
    found, expected = _structured_outputs(Pipeline(stages=1, microbatches=2))
    _assert_structured(found, expected)


def test_forward_returns_a_hugging_face_model_output() -> None:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(config)
    ids = _tokens(4, 8, seed=4)
    pipelined = _one_stage(model, {"input_ids": ids, "labels": ids})
    pipelined.eval()
    found = pipelined(input_ids=ids, use_cache=False)
    model.eval()
    with torch.no_grad():
        expected = model(input_ids=ids, use_cache=False)
    assert type(found) is type(expected) and list(found.keys()) == ["logits"]
    torch.testing.assert_close(found.logits, expected.logits, rtol=1e-4, atol=1e-5)


def _first_sum(output: Any, target: torch.Tensor) -> torch.Tensor:
    return (output[0] if isinstance(output, tuple) else output).sum()


class _Summarizing(nn.Module):
    def __init__(self, what: str) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)
        self.what = what

    def forward(self, x: torch.Tensor) -> Any:
        y = self.layer(x)
        if self.what == "scalar":
            return y, y.mean()
        if self.what == "transposed":
            return y.t()
        return y.sum(0)  # one row, whatever the batch


@pytest.mark.parametrize(
    ("what", "message"),
    [
        ("scalar", r"output 1 of the model has shape \(\) for the whole batch"),
        (
            "transposed",
            r"output 0 of the model has shape \(4, 8\) for the whole batch and \(4, 4\)",
        ),
        ("summed", r"output 0 of the model has shape \(4,\) for the whole batch and \(4,\)"),
    ],
)
def test_outputs_whose_dim_0_is_not_the_batch_are_refused(what: str, message: str) -> None:
    """Concatenating along dim 0 would return something else than the model's output."""
    x = torch.randn(8, 4)
    pipelined = _one_stage(_Summarizing(what), (x,), _first_sum, example_targets=(x,))
    with pytest.raises(PipelineError, match=message):
        pipelined(x)


def test_with_one_piece_any_output_is_the_models() -> None:
    """One micro-batch on one replica: nothing is concatenated, so a scalar output is fine."""
    x = torch.randn(8, 4)
    torch.manual_seed(0)
    model = _Summarizing("scalar")
    pipelined = PipelineModel(
        model, Pipeline(stages=1, microbatches=1), (x,), _first_sum, example_targets=(x,)
    )
    found = pipelined(x)
    with torch.no_grad():
        expected = model(x)
    assert found[1].shape == ()
    torch.testing.assert_close(found, expected)


def test_forward_refuses_mixed_missing_and_uneven_inputs() -> None:
    tokens = _tokens(4, 8, seed=1)
    pipelined = _one_stage(GPT(GPT_CONFIG), (tokens,), gpt_loss, example_targets=(tokens,))
    with pytest.raises(FxparError, match="either positionally or by keyword"):
        pipelined(tokens, idx=tokens)
    with pytest.raises(FxparError, match="needs the model's inputs"):
        pipelined()
    with pytest.raises(BatchError, match="cannot be cut into 2 equal pieces"):
        pipelined(_tokens(3, 8, seed=2))
    assert pipelined(_tokens(6, 8, seed=2)).shape == (6, 8, GPT_CONFIG.vocab_size)


def _split(model: nn.Module, training: bool, step: str) -> Any:
    model.train(training)
    images, labels = _cnn_batch()
    if step == "forward":
        program = fxpar.capture(model, (images[:4],), step="forward")
    else:
        program = fxpar.capture(
            model, (images[:4],), F.cross_entropy, example_targets=(labels[:4],)
        )
    program = Canonicalize().run(program)
    return split_program(program, partition(program, CNN_SPLIT), remat=False)


def test_state_check_asks_for_what_a_stage_reads_not_the_same_names() -> None:
    """In eval mode BatchNorm reads no ``num_batches_tracked``: the eval cut places the second
    one with the unread buffers (on stage 0), the training split on stage 1 with its module.
    No stage of the eval cuts needs anything held elsewhere, so they run (and the eval script
    above equals eager); a cut whose stage needs another stage's weights is refused."""
    torch.manual_seed(0)
    model = CNN()
    trained = _split(model, True, "train")
    for training, step in [(False, "train"), (False, "forward"), (True, "forward")]:
        check_state(_split(model, training, step), trained, "the cut")
    evaluated = _split(model, False, "forward")
    assert "features.5.num_batches_tracked" in evaluated.stage_buffers(0)
    assert "features.5.num_batches_tracked" in trained.stage_buffers(1)

    x = torch.randn(4, 4)
    swapping = _Swapping()
    cuts = []
    for training in (True, False):
        swapping.train(training)
        program = fxpar.capture(swapping, (x,), F.mse_loss, example_targets=(x,))
        cuts.append(split_program(program, partition(program, ("second",)), remat=False))
    with pytest.raises(PipelineError, match=r"needs \['first.weight', 'first.bias'\] on stage 1"):
        check_state(cuts[1], cuts[0], "the cut")


def test_forward_split_in_one_process_equals_the_eager_forward() -> None:
    """The reference run of a forward split (SplitProgram.run_microbatches) concatenates the
    last stage's outputs, which equal eager eval's for the whole batch."""
    torch.manual_seed(0)
    model = CNN()
    split = _split(model, False, "forward")
    images, _ = _cnn_batch()
    result = split.run_microbatches(named_state(model), [[images[:4]], [images[4:]]])
    model.eval()
    with torch.no_grad():
        expected = model(images)
    assert result.loss is None and len(result.outputs) == 1
    torch.testing.assert_close(result.outputs[0], expected)
    assert split.forward[0].outputs == () and len(split.forward[1].outputs) == 1
