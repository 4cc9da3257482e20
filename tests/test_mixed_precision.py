"""Mixed precision (fxpar.MixedPrecision): training with bfloat16 compute and float32 master
weights equals a hand-written single-device reference of the same arithmetic (fp32 masters, the
forward on bf16 casts, fp32 gradients, the same optimizer), and follows torch.autocast's loss
curve to bf16 tolerance; on 2 gloo ranks, fully sharded and tensor-parallel plans give the
reference's losses, all-gathers move bf16 and gradients are summed in reduce_dtype; the planner
prices bf16 activations at half the bytes; bad policies are refused.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

import pytest
import torch
from torch import nn

import fxpar
from fxpar import plans
from fxpar.errors import FxparError
from fxpar.ir.precision import kept_in_own_dtype
from fxpar.models import GPT, GPTConfig, gpt_loss
from fxpar.passes import default_passes, plan_program
from fxpar.planning.report import report_data
from fxpar.runtime.launch import spawn
from tests.zoo import CNN

CONFIG = GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=16, bias=False)
BF16_FP32 = fxpar.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
STEPS = 6
LR = 1e-2


def _gpt_batches(steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (
            torch.randint(0, CONFIG.vocab_size, (4, 8), generator=generator),
            torch.randint(0, CONFIG.vocab_size, (4, 8), generator=generator),
        )
        for _ in range(steps)
    ]


def _cnn_batches(steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(2)
    return [
        (
            torch.randn(4, 3, 8, 8, generator=generator),
            torch.randint(0, 10, (4,), generator=generator),
        )
        for _ in range(steps)
    ]


def _reference(
    model: nn.Module,
    loss_fn: Callable[..., torch.Tensor],
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    policy: fxpar.MixedPrecision,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Mixed precision by hand on one device: fp32 masters in SGD, the forward on their bf16
    casts (parameters of modules with running statistics left fp32), the loss in fp32."""
    kept = kept_in_own_dtype(model)
    masters = {name: p.detach().clone().requires_grad_() for name, p in model.named_parameters()}
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    optimizer = torch.optim.SGD(list(masters.values()), lr=LR, foreach=False)
    losses = []
    for inputs, targets in batches:
        optimizer.zero_grad()
        computed = {
            name: p if name in kept else p.to(policy.param_dtype) for name, p in masters.items()
        }
        if inputs.is_floating_point():
            inputs = inputs.to(policy.param_dtype)
        output = torch.func.functional_call(model, (computed, buffers), (inputs,))
        loss = loss_fn(output, targets).float()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {name: p.detach() for name, p in masters.items()}


def _autocast_losses(
    model: nn.Module,
    loss_fn: Callable[..., torch.Tensor],
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    lr: float,
) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, foreach=False)
    losses = []
    for inputs, targets in batches:
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_fn(model(inputs), targets).float()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits, targets)


MODELS: dict[
    str, tuple[Callable[[], nn.Module], Callable[..., torch.Tensor], Callable[[], list]]
] = {
    "gpt": (lambda: GPT(CONFIG), gpt_loss, _gpt_batches),
    "cnn": (CNN, _cross_entropy, _cnn_batches),
}


def _fxpar_losses(
    name: str, policy: fxpar.MixedPrecision, lr: float = LR, repeat: bool = False
) -> tuple[list[float], fxpar.ParallelModel]:
    make, loss_fn, batches = MODELS[name]
    data = [batches()[0]] * STEPS if repeat else batches()
    torch.manual_seed(0)
    parallel = fxpar.compile(
        make(), fxpar.Cluster((1,)), (data[0][0],), loss_fn, example_targets=(data[0][1],),
        optimizer=fxpar.optim.SGD(lr=lr), mixed_precision=policy,
    )  # fmt: skip
    return [parallel.step(x, y).item() for x, y in data], parallel


@pytest.mark.parametrize("name", ["gpt", "cnn"])
def test_single_device_matches_hand_written_mixed_precision(name: str) -> None:
    """The compiled step is the reference's arithmetic: same losses and fp32 master weights."""
    losses, parallel = _fxpar_losses(name, BF16_FP32)
    make, loss_fn, batches = MODELS[name]
    torch.manual_seed(0)
    expected, masters = _reference(make(), loss_fn, batches(), BF16_FP32)
    torch.testing.assert_close(losses, expected, rtol=1e-6, atol=1e-6)
    state = parallel.full_state_dict()
    for key, master in masters.items():
        assert state[key].dtype == torch.float32, key
        torch.testing.assert_close(state[key], master, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["gpt", "cnn"])
def test_loss_curve_follows_autocast(name: str) -> None:
    """Against torch.autocast, fitting one batch: the curves agree to 2e-2 relative. The two
    do not round alike (autocast keeps layer norms, softmax and the loss in fp32; the policy runs
    every op of the model in bf16, the loss in fp32 with output_dtype), and bf16 keeps 8
    significant bits (2**-8 = 3.9e-3 per rounding), so a few roundings' worth of difference per
    loss is the tolerance of bf16 training itself, while the curve falls by far more."""
    policy = fxpar.MixedPrecision(torch.bfloat16, torch.float32, output_dtype=torch.float32)
    lr = 0.3
    losses, _ = _fxpar_losses(name, policy, lr=lr, repeat=True)
    make, loss_fn, batches = MODELS[name]
    torch.manual_seed(0)
    expected = _autocast_losses(make(), loss_fn, [batches()[0]] * STEPS, lr)
    torch.testing.assert_close(losses, expected, rtol=2e-2, atol=0.0)
    assert losses[-1] < 0.9 * losses[0]


def test_program_computes_in_bf16_and_returns_fp32_gradients() -> None:
    """Placeholders and gradients keep the masters' fp32; matrix products run in bf16; the
    loss is fp32; every parameter read goes through one PARAMETER cast."""
    tokens, targets = _gpt_batches(1)[0]
    program = fxpar.capture(
        GPT(CONFIG), (tokens,), gpt_loss, example_targets=(targets,), mixed_precision=BF16_FP32
    )
    metas = [fxpar.ir.require(n, fxpar.ir.ValueMeta).tensor for n in _results(program)]
    assert metas[0].dtype == torch.float32
    assert len(metas) == 1 + len(program.signature.gradients)
    assert all(meta.dtype == torch.float32 for meta in metas[1:])
    matmuls = [n for n in program.graph.nodes if n.target is torch.ops.aten.mm.default]
    assert matmuls and all(
        fxpar.ir.require(n, fxpar.ir.ValueMeta).tensor.dtype == torch.bfloat16 for n in matmuls
    )
    placeholders = program.placeholders()
    for name in program.signature.parameters:
        (user,) = placeholders[name].users
        cast = fxpar.ir.require(user, fxpar.ir.PrecisionCast)
        assert cast.role is fxpar.ir.CastRole.PARAMETER


def test_batchnorm_keeps_fp32_statistics_and_affine() -> None:
    """BatchNorm's weight, bias and running statistics stay fp32 (as under CPU autocast); the
    convolutions read bf16 weights."""
    x, y = _cnn_batches(1)[0]
    program = fxpar.capture(
        CNN(), (x,), _cross_entropy, example_targets=(y,), mixed_precision=BF16_FP32
    )
    placeholders = program.placeholders()
    for name in ("features.1.weight", "features.1.bias"):
        assert all(
            fxpar.ir.get(u, fxpar.ir.PrecisionCast) is None for u in placeholders[name].users
        )
    results = _results(program)[1 + len(program.signature.gradients) :]
    updates = [fxpar.ir.require(n, fxpar.ir.ValueMeta).tensor for n in results]
    assert len(updates) == len(program.signature.buffer_updates) > 0
    floating = [meta for meta in updates if meta.dtype.is_floating_point]
    assert len(floating) == 4 and all(meta.dtype == torch.float32 for meta in floating)
    convs = [n for n in program.graph.nodes if n.target is torch.ops.aten.convolution.default]
    assert all(
        fxpar.ir.require(n, fxpar.ir.ValueMeta).tensor.dtype == torch.bfloat16 for n in convs
    )


def test_hugging_face_llama_trains_in_bf16() -> None:
    """A tiny Hugging Face Llama compiles and trains under the policy with the reference's
    losses (forward reads bf16 casts, loss in fp32)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(3))
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(config)
    parallel = fxpar.compile(
        model, fxpar.Cluster((1,)), {"input_ids": tokens, "labels": tokens},
        optimizer=fxpar.optim.SGD(lr=LR), mixed_precision=BF16_FP32,
    )  # fmt: skip
    losses = [parallel.step(input_ids=tokens, labels=tokens).item() for _ in range(3)]
    masters = {n: p.detach().clone().requires_grad_() for n, p in reference.named_parameters()}
    buffers = dict(reference.named_buffers())
    optimizer = torch.optim.SGD(list(masters.values()), lr=LR, foreach=False)
    expected = []
    for _ in range(3):
        optimizer.zero_grad()
        computed = {n: p.to(torch.bfloat16) for n, p in masters.items()}
        output = torch.func.functional_call(
            reference, (computed, buffers), (), {"input_ids": tokens, "labels": tokens}
        )
        loss = output.loss.float()
        loss.backward()
        optimizer.step()
        expected.append(loss.item())
    torch.testing.assert_close(losses, expected, rtol=1e-5, atol=1e-5)


def test_planner_prices_bf16_activations_at_half() -> None:
    """The plan's memory estimate of saved activations halves with bf16 compute; the weights,
    gradients and optimizer state (fp32 masters) are priced as before."""
    config = GPTConfig(n_layer=2, n_embd=64, n_head=4, vocab_size=64, block_size=64, bias=False)
    tokens = torch.randint(0, 64, (8, 64))

    def memory(policy: fxpar.MixedPrecision | None) -> dict[str, float]:
        torch.manual_seed(0)
        plan = fxpar.plan(
            GPT(config), fxpar.Cluster((2,)), (tokens,), gpt_loss, example_targets=(tokens,),
            manual=plans.data_parallel, mixed_precision=policy,
        )  # fmt: skip
        memory: dict[str, float] = report_data(plan)["header"]["memory"]
        return memory

    full, mixed = memory(None), memory(BF16_FP32)
    assert mixed["activations"] < 0.6 * full["activations"]
    for kind in ("params", "grads", "optimizer"):
        assert mixed[kind] == full[kind], kind


def _results(program: fxpar.Program) -> list[torch.fx.Node]:
    return list(program.graph.output_node().args[0])  # type: ignore[arg-type]


def _collectives(
    program: fxpar.Program, manual: fxpar.passes.ManualPlan | None
) -> list[tuple[str, torch.dtype]]:
    """(kind, dtype of the tensor it moves) of each collective the lowering put in the
    2-device per-rank programs."""
    cluster = fxpar.Cluster((2,))
    plan = plan_program(program, cluster, passes=default_passes(manual=manual))
    spmd = fxpar.lower(plan.program, cluster)
    nodes = {node.name: node for node in plan.program.graph.nodes}
    return [
        (
            record.kind,
            fxpar.ir.require(nodes[record.tensor], fxpar.ir.ValueMeta).tensor.dtype,
            record.phase,
        )
        for record in spmd.records
    ]


@pytest.mark.parametrize("reduce_dtype", [torch.float32, torch.bfloat16])
def test_fully_sharded_gathers_bf16_and_reduces_in_reduce_dtype(reduce_dtype: torch.dtype) -> None:
    """On a 2-device fully sharded plan every parameter all-gather moves the bf16 cast, one
    per layer (and one for the parameters outside the layers) in the forward and again in the
    backward, as FSDP gathers a flat parameter; the gradients are reduce-scattered in
    reduce_dtype (fp32: cast then reduced; bf16: reduced then cast)."""
    tokens, targets = _gpt_batches(1)[0]
    policy = fxpar.MixedPrecision(torch.bfloat16, reduce_dtype)
    program = fxpar.capture(
        GPT(CONFIG), (tokens,), gpt_loss, example_targets=(targets,), mixed_precision=policy
    )
    found = _collectives(program, plans.fully_sharded)
    gathers = [(dtype, phase) for kind, dtype, phase in found if kind == "all_gather"]
    scatters = [dtype for kind, dtype, _ in found if kind == "reduce_scatter"]
    groups = CONFIG.n_layer + 1
    assert Counter(gathers) == {
        (torch.bfloat16, fxpar.ir.Phase.FORWARD): groups,
        (torch.bfloat16, fxpar.ir.Phase.BACKWARD): groups,
    }
    # One record per reduce-scatter, or per bucket of them (named by its first tensor).
    assert set(scatters) == {reduce_dtype}


GLOO_PLANS = {
    "fully_sharded": (plans.fully_sharded, torch.float32),
    "fully_sharded_bf16_reduce": (plans.fully_sharded, torch.bfloat16),
    "tensor_parallel": (plans.tensor_parallel, torch.float32),
}


def _two_ranks(rank: int, world_size: int) -> dict[str, list[float]]:
    torch.set_num_threads(1)
    results = {}
    for label, (manual, reduce_dtype) in GLOO_PLANS.items():
        data = _gpt_batches()
        torch.manual_seed(0)
        parallel = fxpar.compile(
            GPT(CONFIG), fxpar.Cluster((2,)), (data[0][0],), gpt_loss,
            example_targets=(data[0][1],), optimizer=fxpar.optim.SGD(lr=LR), manual=manual,
            mixed_precision=fxpar.MixedPrecision(torch.bfloat16, reduce_dtype),
        )  # fmt: skip
        results[label] = [parallel.step(x, y).item() for x, y in data]
    data = _gpt_batches()
    torch.manual_seed(0)
    pipelined = fxpar.compile(
        GPT(CONFIG), fxpar.Cluster((2,)), (data[0][0],), gpt_loss,
        example_targets=(data[0][1],), optimizer=fxpar.optim.SGD(lr=LR),
        pipeline=fxpar.Pipeline(stages=("blocks.1",), microbatches=2),
        mixed_precision=BF16_FP32,
    )  # fmt: skip
    results["pipeline"] = [pipelined.step(x, y).item() for x, y in data]
    return results


@pytest.mark.slow
def test_two_gloo_ranks_match_single_device_reference() -> None:
    """Fully sharded (gradients reduced in fp32 or bf16) and tensor-parallel plans, and a
    2-stage pipeline of 2 micro-batches, with mixed precision on 2 gloo ranks train like the
    single-device reference. Each rank computes
    its half in bf16 and rounds where one device would not (a partial product, a partial sum),
    so they agree to bf16 precision: 1e-2 relative, about two bf16 roundings of the loss."""
    torch.manual_seed(0)
    expected, _ = _reference(GPT(CONFIG), gpt_loss, _gpt_batches(), BF16_FP32)
    ranks = spawn(_two_ranks, 2)
    for label in [*GLOO_PLANS, "pipeline"]:
        assert ranks[0][label] == ranks[1][label], label
        torch.testing.assert_close(ranks[0][label], expected, rtol=1e-2, atol=0.0, msg=label)


def test_bad_policies_are_refused() -> None:
    """Integer dtypes, non-dtypes and a non-policy are refused with FxparError."""
    with pytest.raises(FxparError, match=r"floating-point torch\.dtype"):
        fxpar.MixedPrecision(param_dtype=torch.int8)
    with pytest.raises(FxparError, match="reduce_dtype"):
        fxpar.MixedPrecision(reduce_dtype="float32")  # type: ignore[arg-type]
    with pytest.raises(FxparError, match="cast_forward_inputs"):
        fxpar.MixedPrecision(cast_forward_inputs=1)  # type: ignore[arg-type]
    tokens, targets = _gpt_batches(1)[0]
    with pytest.raises(FxparError, match=r"must be an fxpar\.MixedPrecision"):
        fxpar.capture(GPT(CONFIG), (tokens,), gpt_loss, example_targets=(targets,),
                      mixed_precision=torch.bfloat16)  # type: ignore[arg-type]  # fmt: skip
