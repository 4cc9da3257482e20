"""Random ops draw exactly what one device draws, whatever the plan and each rank's own seed.

Capture turns every random op into a random input (fxpar.rng); these tests tie each link of
the chain to an independent reference: the Program to eager PyTorch under the same seed, the
lowered per-rank programs to the Program under random plans, and ParallelModel on gloo
processes seeded differently to eager single-device training.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
import transformers
from conftest import eager_step
from torch import nn
from zoo import MLP

import fxpar
from fxpar.errors import CaptureError
from fxpar.ir.rng import RandomState
from fxpar.lowering import lower
from fxpar.models import GPT, GPTConfig, gpt_loss
from fxpar.passes import plan_program
from fxpar.runtime.launch import spawn
from fxpar.testing import ModelCase, assert_equivalent, assert_plan_equivalent
from fxpar.testing.strategies import _SequenceModel, splitting_cluster

CONFIG = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16, dropout=0.2)


def _gpt2() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    ids = torch.randint(0, 64, (2, 8))
    return transformers.GPT2LMHeadModel(config), {"input_ids": ids, "labels": ids}


def test_program_draws_what_eager_draws_under_the_same_seed() -> None:
    """Dropout (also inside SDPA attention), rand_like and randn: the captured step run after
    torch.manual_seed(s) equals the eager step after torch.manual_seed(s), bit for bit."""

    class Noisy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(6, 6)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = F.dropout(self.linear(x), 0.3, training=True)
            h = h + torch.rand_like(h).t().contiguous().t() + torch.randn(h.shape)
            return h * torch.empty_like(h).uniform_(0.5, 1.5)

    gpt = GPT(CONFIG)
    tokens = torch.randint(0, CONFIG.vocab_size, (2, 8))
    cases: list[tuple[nn.Module, object, object, tuple[torch.Tensor, ...]]] = [
        (Noisy(), (torch.randn(4, 6),), lambda out: out.square().mean(), ()),
        (MLP(dropout=0.5), (torch.randn(8, 16),), F.cross_entropy, (torch.randint(0, 10, (8,)),)),
        (gpt, (tokens,), gpt_loss, (tokens,)),
        (*_gpt2()[:2], None, ()),
    ]
    for model, inputs, loss_fn, targets in cases:
        program = fxpar.capture(model, inputs, loss_fn, example_targets=targets)  # type: ignore[arg-type]
        assert program.signature.random, type(model).__name__
        values = inputs.values() if isinstance(inputs, dict) else inputs  # type: ignore[attr-defined]
        for seed in (1, 2):
            torch.manual_seed(seed)
            result = program.run(model, *values, *targets)
            torch.manual_seed(seed)
            loss, grads = eager_step(model, inputs, loss_fn, targets)  # type: ignore[arg-type]
            assert torch.equal(result.loss, loss), type(model).__name__
            for name, grad in grads.items():
                assert torch.equal(result.gradients[name], grad), name


def test_capture_leaves_no_random_op_in_the_graph() -> None:
    model = MLP(dropout=0.5)
    program = fxpar.capture(model, (torch.randn(8, 16),), F.cross_entropy,
                            example_targets=(torch.randint(0, 10, (8,)),))  # fmt: skip
    assert program.signature.random_inputs == ("random_0", "random_1")
    for node in program.graph.nodes:
        assert torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ()), node
    placeholders = program.placeholders()
    assert list(placeholders)[-2:] == ["random_0", "random_1"]
    region = fxpar.ir.require(placeholders["random_0"], fxpar.ir.Region)
    assert region.module == "net.2"  # the dropout module that draws it


def test_capture_refuses_draws_that_depend_on_tensor_values() -> None:
    """bernoulli of a probability tensor and multinomial read values; no rank could draw them
    ahead, so capture says so instead of letting ranks disagree."""

    class Sampler(nn.Module):
        def __init__(self, how: str) -> None:
            super().__init__()
            self.linear, self.how = nn.Linear(4, 4), how

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            probs = torch.sigmoid(self.linear(x))
            if self.how == "bernoulli":
                return (self.linear(x) * torch.bernoulli(probs)).sum()
            picked = torch.multinomial(probs, 1)
            return self.linear(x).gather(1, picked).sum()

    for how, op in [("bernoulli", "bernoulli.default"), ("multinomial", "multinomial")]:
        with pytest.raises(CaptureError, match=f"{op}.*depend on tensor values"):
            fxpar.capture(Sampler(how), (torch.randn(3, 4),))


def test_random_plans_with_dropout_train_like_the_program() -> None:
    """Any valid plan slices the random inputs the way the Program reads them."""
    torch.manual_seed(0)
    model = _SequenceModel(16, 24, ["dropout", "mlp", "dropout", "attention"], 12)
    tokens, targets = torch.randint(0, 16, (4, 4)), torch.randint(0, 12, (4, 4))
    case = ModelCase("dropout", model, (tokens,), lambda o, t: F.cross_entropy(o.flatten(0, 1),
                     t.flatten()), (targets,))  # fmt: skip
    for mesh in [(2,), (4,), (2, 2)]:
        for seed in range(4):
            torch.manual_seed(seed)
            assert_plan_equivalent(case, fxpar.Cluster(mesh), seed)


def test_named_plans_and_the_ilp_with_dropout_train_like_the_program() -> None:
    model = GPT(CONFIG)
    tokens = torch.randint(0, CONFIG.vocab_size, (4, 8))
    program = fxpar.capture(model, (tokens,), gpt_loss, example_targets=(tokens,))
    flat = program.flat_inputs(model, tokens, tokens)
    for mesh in [(2,), (2, 2)]:
        cluster = fxpar.Cluster(mesh)
        for solver in (fxpar.plans.data_parallel, fxpar.plans.tensor_parallel,
                       fxpar.plans.fully_sharded, None):  # fmt: skip
            plan = plan_program(copy.deepcopy(program), cluster, manual=solver)
            assert_equivalent(lower(plan.program, cluster), flat)


def test_random_state_leaves_the_users_generator_alone() -> None:
    torch.manual_seed(3)
    state = RandomState(torch.get_rng_state())
    program = fxpar.capture(MLP(dropout=0.5), (torch.randn(8, 16),), lambda out: out.sum())
    before = torch.get_rng_state()
    first = state.draw(program.signature.random)
    assert torch.equal(torch.get_rng_state(), before)
    torch.manual_seed(3)
    eager = fxpar.ir.rng.draw_all(program.signature.random)
    assert all(torch.equal(a, b) for a, b in zip(first, eager, strict=True))
    second = state.draw(program.signature.random)
    assert not torch.equal(first[0], second[0])


# -- on gloo processes seeded differently -----------------------------------------------------

STEPS = 3


def _model_and_batches() -> tuple[GPT, list[torch.Tensor]]:
    """The model and batches every process and the reference build alike, then the seed whose
    generator state fxpar copies from rank 0 at compile."""
    torch.manual_seed(0)
    model = GPT(CONFIG)
    batches = [torch.randint(0, CONFIG.vocab_size, (4, 8)) for _ in range(STEPS)]
    torch.manual_seed(1234)
    return model, batches


def _train_parallel(rank: int, world_size: int, solver_name: str, mesh: tuple[int, ...]) -> dict:  # type: ignore[type-arg]
    torch.set_num_threads(1)
    manual = None if solver_name == "ilp" else getattr(fxpar.plans, solver_name)
    model, batches = _model_and_batches()
    parallel = fxpar.compile(
        model, splitting_cluster(mesh), (batches[0],), gpt_loss, example_targets=(batches[0],),
        optimizer=fxpar.optim.SGD(lr=0.1), manual=manual,
    )  # fmt: skip
    torch.manual_seed(100 + rank)  # every rank's own generator differs from here on
    losses = [parallel.step(tokens, tokens) for tokens in batches]
    return {"losses": torch.stack(losses), "state": parallel.full_state_dict()}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("solver", "mesh"),
    [("tensor_parallel", (2,)), ("data_parallel", (2,)), ("fully_sharded", (2,)), ("ilp", (2,))],
)
def test_dropout_trains_like_one_device_on_ranks_seeded_differently(
    solver: str, mesh: tuple[int, ...]
) -> None:
    losses, state = _eager_pieces(1)
    for result in spawn(_train_parallel, 2, solver, mesh, timeout_s=120):
        torch.testing.assert_close(result["losses"], losses)
        for name, value in state.items():
            torch.testing.assert_close(result["state"][name], value, msg=name)


def _train_pipeline(rank: int, world_size: int, pipeline: fxpar.Pipeline) -> dict:  # type: ignore[type-arg]
    torch.set_num_threads(1)
    model, batches = _model_and_batches()
    pipelined = fxpar.compile(
        model, splitting_cluster((world_size,)), (batches[0],), gpt_loss,
        example_targets=(batches[0],), optimizer=fxpar.optim.SGD(lr=0.1), pipeline=pipeline,
    )  # fmt: skip
    torch.manual_seed(100 + rank)
    losses = [pipelined.step(tokens, tokens) for tokens in batches]
    return {"losses": torch.stack(losses), "state": pipelined.full_state_dict()}


def _eager_pieces(pieces: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Single-device training, accumulating gradients over ``pieces`` equal pieces of each
    batch (1: plain training)."""
    model, batches = _model_and_batches()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for tokens in batches:
        total, sums = torch.zeros(()), {}
        for chunk in tokens.chunk(pieces):
            loss, grads = eager_step(model, (chunk,), gpt_loss, (chunk,))
            total = total + loss
            sums = {n: sums[n] + g if n in sums else g for n, g in grads.items()}
        for name, parameter in model.named_parameters():
            parameter.grad = sums[name] / pieces
        optimizer.step()
        losses.append(total / pieces)
    return torch.stack(losses), model.state_dict()


@pytest.mark.slow
@pytest.mark.parametrize(
    "pipeline",
    [
        fxpar.Pipeline(stages=2, microbatches=2, schedule="1f1b", remat=True),
        fxpar.Pipeline(stages=2, microbatches=2, schedule="gpipe", remat=False),
        fxpar.Pipeline(stages=1, microbatches=2, data_parallel=2),
    ],
    ids=["1f1b-remat", "gpipe", "replicas"],
)
def test_pipelines_with_dropout_train_like_one_device_on_ranks_seeded_differently(
    pipeline: fxpar.Pipeline,
) -> None:
    """Every rank draws every piece's masks in piece order (its replicas' too) and keeps its
    own: the same as one device accumulating gradients over the same pieces."""
    losses, state = _eager_pieces(pipeline.microbatches * pipeline.data_parallel)
    for result in spawn(_train_pipeline, 2, pipeline, timeout_s=120):
        torch.testing.assert_close(result["losses"], losses)
        for name, value in state.items():
            torch.testing.assert_close(result["state"][name], value, msg=name)


def test_manual_plans_keep_a_random_input_whole_where_its_first_dim_does_not_split() -> None:
    """DropConnect draws a mask shaped like a weight (5 rows), which no mesh of 2 splits: the
    manual plans keep it whole instead of refusing it as if it were a batch tensor."""

    class DropConnect(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            weight = F.dropout(self.linear.weight, 0.5, training=True)
            return F.linear(x, weight, self.linear.bias)

    model, x = DropConnect(), torch.randn(4, 4)
    program = fxpar.capture(model, (x,), lambda out: out.square().mean())
    flat = program.flat_inputs(model, x)
    cluster = fxpar.Cluster((2,))
    for solver in (fxpar.plans.data_parallel, fxpar.plans.fully_sharded):
        plan = plan_program(copy.deepcopy(program), cluster, manual=solver)
        assert_equivalent(lower(plan.program, cluster), flat)


def test_loss_changes_nothing_not_even_the_random_state() -> None:
    """ParallelModel.loss draws the next step's masks and leaves the random state alone, so a
    step after it is the step without it."""
    model, batches = _model_and_batches()
    tokens = batches[0]
    compiled = []
    for _ in range(2):
        torch.manual_seed(1234)  # the same random state for both
        parallel = fxpar.compile(
            model, fxpar.Cluster((1,)), (tokens,), gpt_loss, example_targets=(tokens,),
            optimizer=fxpar.optim.SGD(lr=0.1),
        )  # fmt: skip
        compiled.append(parallel)
    parallel, reference = compiled
    first, second = parallel.loss(tokens, tokens), parallel.loss(tokens, tokens)
    assert torch.equal(first, second)
    assert torch.equal(parallel.step(tokens, tokens), first)
    assert torch.equal(reference.step(tokens, tokens), first)


def _dropout_zoo() -> dict[str, tuple[nn.Module, dict[str, torch.Tensor]]]:
    """Hugging Face families with their default dropouts on, from tiny configs."""
    ids, labels = torch.randint(0, 64, (4, 8)), torch.randint(0, 64, (4, 6))
    t5 = transformers.T5Config(
        vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1,
        num_heads=2, dropout_rate=0.1, decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip
    bart = transformers.BartConfig(
        vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
        max_position_embeddings=32, dropout=0.1, attention_dropout=0.1, activation_dropout=0.1,
    )  # fmt: skip
    bert = transformers.BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=16,
    )  # fmt: skip
    masked = ids.clone()
    masked[:, ::2] = -100  # ignored positions, as masked-LM labels have
    return {
        "t5": (transformers.T5ForConditionalGeneration(t5), {"input_ids": ids, "labels": labels}),
        "bart": (
            transformers.BartForConditionalGeneration(bart),
            {"input_ids": ids, "labels": labels},
        ),
        "bert": (transformers.BertForMaskedLM(bert), {"input_ids": ids, "labels": masked}),
    }


@pytest.mark.parametrize("family", ["t5", "bart", "bert"])
def test_encoder_decoders_and_masked_lms_with_dropout_train_like_eager(family: str) -> None:
    """Beyond decoder LMs: the Program equals eager PyTorch under the same seed bit for bit,
    and data and fully sharded plans on (2, 2) equal the Program."""
    model, inputs = _dropout_zoo()[family]
    program = fxpar.capture(model, inputs)
    assert len(program.signature.random) >= 3
    torch.manual_seed(11)
    result = program.run(model, *inputs.values())
    torch.manual_seed(11)
    loss, grads = eager_step(model, inputs)
    assert torch.equal(result.loss, loss)
    for name, grad in grads.items():
        assert torch.equal(result.gradients[name], grad), name
    flat = program.flat_inputs(model, *inputs.values())
    cluster = fxpar.Cluster((2, 2))
    for solver in (fxpar.plans.data_parallel, fxpar.plans.fully_sharded):
        plan = plan_program(copy.deepcopy(program), cluster, manual=solver)
        assert_equivalent(lower(plan.program, cluster), flat)
