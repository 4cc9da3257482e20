"""Activation checkpointing: models that call ``torch.utils.checkpoint`` (reentrant or not, and
Hugging Face's ``gradient_checkpointing_enable()``) capture and train like eager PyTorch, the
``rematerialize`` pass recomputes layers in the backward with the same numbers (dropout
included) under one device, simulated ranks and real gloo processes, the memory the program
holds and the plan's memory estimate drop, and ``remat="auto"`` recomputes only when the
memory limit requires it."""

from __future__ import annotations

import contextlib
import itertools

import pytest
import torch
from conftest import assert_matches_eager
from torch import nn
from torch.utils.checkpoint import checkpoint

import fxpar
from fxpar import ir, plans
from fxpar.cluster import Cluster
from fxpar.errors import CaptureError, FxparError
from fxpar.ir.program import Program
from fxpar.models import GPT, GPTConfig, gpt_loss
from fxpar.passes import ChosenStrategies, Rematerialize, Rematerialized, Verify, plan_program
from fxpar.passes.choose_strategies import remat_counts
from fxpar.planning.cost import saved_for_backward
from fxpar.planning.peak_memory import peak_memory
from fxpar.planning.problem import PlanOptions
from fxpar.runtime.launch import spawn
from fxpar.solvers.errors import InfeasiblePlanError
from fxpar.testing.equivalence import assert_equivalent
from fxpar.testing.memory import peak_live_bytes
from fxpar.testing.simulate import simulate

CONFIG = GPTConfig(n_layer=3, n_embd=32, n_head=4, vocab_size=64, block_size=16, dropout=0.1)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 32)
        self.down = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class _Checkpointed(nn.Module):
    """Two blocks, each run under torch.utils.checkpoint."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 8)
        self.blocks = nn.ModuleList([_Block(), _Block()])
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.reentrant)
        return x.square().mean()


def _gpt_program(config: GPTConfig = CONFIG) -> tuple[GPT, Program, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = GPT(config)
    tokens = torch.randint(0, config.vocab_size, (4, 8))
    targets = torch.randint(0, config.vocab_size, (4, 8))
    program = fxpar.capture(model, (tokens,), gpt_loss, example_targets=(targets,))
    return model, program, [tokens, targets]


def _saved_bytes(program: Program) -> int:
    """Bytes of the forward ops' values the backward reads (placeholders left out)."""
    return sum(
        ir.evaluate(meta.nbytes)
        for node in saved_for_backward(program.graph.nodes)
        if node.op != "placeholder"
        for meta in ir.require(node, ir.ValueMeta).tensors
    )


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_checkpointed_model_captures_trains_like_eager_and_is_recomputed(reentrant: bool) -> None:
    """Both kinds of checkpoint capture with eager's loss and gradients; each call's ops are
    tagged, and the default pipeline recomputes them: the backward keeps less."""
    torch.manual_seed(0)
    model = _Checkpointed(reentrant)
    program = assert_matches_eager(model, (torch.randn(4, 8),))
    calls = {ir.require(n, ir.Checkpointed).call for n in program.graph.nodes
             if ir.get(n, ir.Checkpointed) is not None}  # fmt: skip
    assert calls == {0, 1}
    before = _saved_bytes(program)
    Rematerialize("none")(program)
    Verify()(program)
    assert program.require(Rematerialized).checkpoint_calls == (0, 1)
    assert _saved_bytes(program) < before
    x = torch.randn(4, 8)
    result = program.run(model, x)
    model.zero_grad()
    model(x).backward()
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(result.gradients[name], parameter.grad, msg=name)


def test_reentrant_checkpoint_of_inputs_without_grad_gives_no_gradient_inside() -> None:
    """Eager reentrant checkpointing differentiates only through tensor arguments that require
    grad; capture keeps that: a model whose only checkpoint reads the raw batch has a loss
    that depends on no trainable parameter."""

    class OnBatch(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = _Block()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return checkpoint(self.block, x, use_reentrant=True).mean()

    with pytest.raises(CaptureError, match="does not depend"):
        fxpar.capture(OnBatch(), (torch.randn(4, 8),))


def test_selective_checkpointing_is_refused_with_advice() -> None:
    class Selective(_Checkpointed):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return checkpoint(
                self.blocks[0], self.embed(x), use_reentrant=False,
                context_fn=lambda: (torch.no_grad(), torch.no_grad()),
            ).mean()  # fmt: skip

    with pytest.raises(CaptureError, match="context_fn"):
        fxpar.capture(Selective(False), (torch.randn(4, 8),))


def test_hugging_face_gradient_checkpointing_captures_and_trains_like_eager() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.gradient_checkpointing_enable()
    model.train()
    ids = torch.randint(0, 128, (2, 12))
    program = assert_matches_eager(model, {"input_ids": ids, "labels": ids})
    plan = plan_program(program, Cluster.preset("cpu", (2,)), manual=plans.data_parallel)
    assert plan.program.require(Rematerialized).checkpoint_calls == (0, 1)
    assert_equivalent(fxpar.lower(plan), plan.program.flat_inputs(model, ids, ids))


def test_remat_all_recomputes_dropout_exactly_and_trains_like_eager() -> None:
    """remat="all" on a GPT with dropout: three SGD steps give eager PyTorch's losses and
    weights, and every step's loss and gradients are bitwise those of the program without
    remat (the recomputation reads the forward's random draws)."""
    model, program, batch = _gpt_program()
    plain = fxpar.capture(model, (batch[0],), gpt_loss, example_targets=(batch[1],))
    plan = plan_program(program, Cluster((1,)), options=PlanOptions(remat="all"))
    remat = plan.program
    assert remat.require(Rematerialized).layers == ("blocks.0", "blocks.1", "blocks.2")
    eager = GPT(CONFIG)
    eager.load_state_dict(model.state_dict())
    state = {k: v.detach().clone() for k, v in model.named_parameters()}
    for step in range(3):
        torch.manual_seed(step)
        result = remat.run(state, *batch)
        torch.manual_seed(step)
        reference = plain.run(state, *batch)
        torch.manual_seed(step)
        eager.zero_grad()
        loss = gpt_loss(eager(batch[0]), batch[1])
        loss.backward()
        assert torch.equal(result.loss, reference.loss)
        for name, grad in result.gradients.items():
            assert torch.equal(grad, reference.gradients[name]), name
        torch.testing.assert_close(result.loss, loss)
        with torch.no_grad():
            for name, parameter in eager.named_parameters():
                torch.testing.assert_close(result.gradients[name], parameter.grad, msg=name)
                parameter -= 0.1 * parameter.grad
                state[name] = state[name] - 0.1 * result.gradients[name]
    for name, parameter in eager.named_parameters():
        torch.testing.assert_close(state[name], parameter.detach(), msg=name)


def test_remat_costs_flops_and_saves_memory() -> None:
    """The recomputed ops are real nodes: the step's FLOPs grow by the recomputed forward,
    the plan's memory estimate and the measured peak of live tensors both drop."""
    model, program, batch = _gpt_program()
    cluster = Cluster((1,))
    plain = plan_program(program, cluster)
    _, again, _ = _gpt_program()
    remat = plan_program(again, cluster, options=PlanOptions(remat="all"))

    def flops(plan: fxpar.Plan) -> int:
        return sum(ir.evaluate(ir.require(n, ir.Cost).flops)
                   for n in plan.program.graph.nodes if n.op == "call_function")  # fmt: skip

    def estimate(plan: fxpar.Plan) -> float:
        chosen = plan.program.require(ChosenStrategies)
        return chosen.problem.memory(chosen.solution.choice)

    forward_ops = [n for n in plain.program.nodes(ir.Phase.FORWARD) if n.op == "call_function"]
    forward = sum(ir.evaluate(ir.require(n, ir.Cost).flops) for n in forward_ops)
    assert flops(plain) < flops(remat) < flops(plain) + forward
    assert estimate(remat) < estimate(plain)
    assert _saved_bytes(remat.program) < _saved_bytes(plain.program) / 2
    torch.manual_seed(0)
    flat = plain.program.flat_inputs(model, *batch)
    measured = [peak_live_bytes(p.program.graph_module, flat) for p in (plain, remat)]
    assert measured[1].input_bytes == measured[0].input_bytes
    assert measured[1].peak_bytes < measured[0].peak_bytes


@pytest.mark.parametrize("manual", [plans.tensor_parallel, plans.fully_sharded])
def test_remat_lowers_to_ranks_that_compute_the_program(manual: fxpar.passes.ManualPlan) -> None:
    """Tensor parallel (collectives inside the recomputed layers) and fully sharded (layer
    weights gathered again for the recomputation) on 2 simulated ranks: every rank's values
    equal the Program's, and the result equals the plan without remat."""
    model, program, batch = _gpt_program()
    cluster = Cluster.preset("cpu", (2,))
    remat = plan_program(program, cluster, manual=manual, options=PlanOptions(remat="all"))
    _, again, _ = _gpt_program()
    plain = plan_program(again, cluster, manual=manual)
    torch.manual_seed(0)
    flat = remat.program.flat_inputs(model, *batch)
    assert_equivalent(fxpar.lower(remat), flat)
    found = simulate(fxpar.lower(remat), flat).result
    expected = simulate(fxpar.lower(plain), flat).result
    torch.testing.assert_close(found.loss, expected.loss)
    for name, grad in expected.gradients.items():
        torch.testing.assert_close(found.gradients[name], grad, msg=name)


def test_auto_recomputes_only_when_memory_requires_it() -> None:
    """With memory to spare auto recomputes nothing; with a limit only a plan with remat
    meets, it recomputes some layers (not all, when fewer suffice) and the plan fits."""
    cluster = Cluster.preset("cpu", (1,))

    def planned(options: PlanOptions) -> fxpar.Plan:
        return plan_program(_gpt_program()[1], cluster, options=options)

    def estimate(plan: fxpar.Plan) -> float:
        chosen = plan.program.require(ChosenStrategies)
        return chosen.problem.memory(chosen.solution.choice)

    plain, every = planned(PlanOptions()), planned(PlanOptions(remat="all"))
    assert planned(PlanOptions(remat="auto")).program.require(Rematerialized).layers == ()
    limit = (estimate(plain) + 2 * estimate(every)) / 3  # about one layer's activations less
    fitted = planned(PlanOptions(remat="auto", memory_limit=limit))
    chosen = fitted.program.require(Rematerialized).layers
    assert 0 < len(chosen) < 3
    assert estimate(fitted) <= limit
    with pytest.raises(FxparError, match="no sharding plan fits"):
        planned(PlanOptions(remat="auto", memory_limit=estimate(every) / 2))


def test_auto_trades_recomputation_for_a_faster_sharding() -> None:
    """On two H100s whose memory (here a limit of 0.8 of the fastest plan's peak) holds a
    sharded plan but not the fastest one, the old greedy rule (recompute only while nothing
    fits) recomputed nothing and sharded the weights; remat="auto" prices recomputation with
    the sharding and recomputes a layer to keep a faster plan. Its step time is the least of
    every subset of layers that fits, planned one by one, and its ranks compute the program.
    Every limit is checked against the plan's walked peak (AdamW's state included)."""
    config = GPTConfig(n_layer=2, n_embd=32, n_head=2, vocab_size=64, block_size=64)
    cluster = Cluster.preset("h100", (2,))

    def planned(remat: fxpar.planning.problem.RematPolicy, limit: float | None) -> fxpar.Plan:
        torch.manual_seed(0)
        tokens = torch.randint(0, config.vocab_size, (8, 64))
        program = fxpar.capture(GPT(config), (tokens,), gpt_loss, example_targets=(tokens,))
        return plan_program(program, cluster, options=PlanOptions(remat=remat, memory_limit=limit))

    def peak(plan: fxpar.Plan) -> int:
        states = plan.options.optimizer_states
        return peak_memory(plan.program, cluster, optimizer_states=states).peak_bytes

    fastest = planned("none", None)
    limit = 0.8 * peak(fastest)  # the fastest plan without remat does not fit
    greedy = planned("none", limit)  # what the greedy rule did: a sharded plan fits
    joint = planned("auto", limit)
    assert joint.program.require(Rematerialized).layers
    assert peak(joint) <= limit and peak(greedy) <= limit
    assert joint.solution.objective < greedy.solution.objective / 1.5
    layers = [f"blocks.{i}" for i in range(config.n_layer)]
    every_subset = []
    for count in range(len(layers) + 1):
        for subset in itertools.combinations(layers, count):
            with contextlib.suppress(InfeasiblePlanError):
                every_subset.append(planned(tuple(subset) or "none", limit).solution.objective)
    assert joint.solution.objective == pytest.approx(min(every_subset), rel=1e-9)
    torch.manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (8, 64))
    assert_equivalent(fxpar.lower(joint), joint.program.flat_inputs(GPT(config), tokens, tokens))


def test_remat_counts_run_from_the_fewest_to_every_layer() -> None:
    assert remat_counts(1, 4) == [1, 2, 3, 4]
    assert remat_counts(0, 32) == [0, 1, 2, 4, 8, 32]
    assert remat_counts(30, 32) == [30, 31, 32]
    assert remat_counts(32, 32) == [32]
    assert len(remat_counts(3, 96, trials=4)) == 4


def test_bad_remat_values_are_refused() -> None:
    with pytest.raises(FxparError, match="remat must be one of"):
        PlanOptions(remat="sometimes")
    with pytest.raises(FxparError, match="remat must be one of"):
        Rematerialize(["blocks.*"])  # type: ignore[arg-type]
    with pytest.raises(FxparError, match="match no numbered layer"):
        Rematerialize(("layers.*",))(_gpt_program()[1])
    assert Rematerialize(("blocks.1",))(_gpt_program()[1]).require(Rematerialized).layers == (
        "blocks.1",
    )


# -- real processes -------------------------------------------------------------------------

GLOO_CONFIG = GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=16, bias=False)
STEPS = 3


def _gloo_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        tuple(torch.randint(0, GLOO_CONFIG.vocab_size, (4, 8), generator=generator)
              for _ in range(2))  # type: ignore[misc]
        for _ in range(STEPS)
    ]  # fmt: skip


def _tensor_parallel_with_remat(rank: int, world_size: int) -> list[float]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    tokens, targets = _gloo_batches()[0]
    parallel = fxpar.compile(
        GPT(GLOO_CONFIG), Cluster.preset("cpu", (world_size,)), (tokens,), gpt_loss,
        example_targets=(targets,), optimizer=fxpar.optim.SGD(lr=0.1),
        manual=plans.tensor_parallel, options=PlanOptions(remat="all"),
    )  # fmt: skip
    return [parallel.step(*batch).item() for batch in _gloo_batches()]


@pytest.mark.slow
def test_compiled_tensor_parallel_remat_trains_like_one_device_on_gloo() -> None:
    torch.manual_seed(0)
    model = GPT(GLOO_CONFIG)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    expected = []
    for tokens, targets in _gloo_batches():
        optimizer.zero_grad()
        loss = gpt_loss(model(tokens), targets)
        loss.backward()
        optimizer.step()
        expected.append(loss.item())
    for losses in spawn(_tensor_parallel_with_remat, 2):
        torch.testing.assert_close(losses, expected, rtol=1e-5, atol=0)
