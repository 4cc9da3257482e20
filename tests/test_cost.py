"""The cost annotation pass: exact FLOPs for products, convolutions and attention, byte counts,
and symbolic costs when shapes are symbolic."""

from __future__ import annotations

import pytest
import sympy
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import fxpar
from fxpar import ir
from fxpar.ir.flops import default_flop_registry
from fxpar.models import GPT, GPTConfig, gpt_loss
from fxpar.passes import AnnotateCost

aten = torch.ops.aten
# Ops torch.utils.flop_counter also counts (it has no formula for the CPU attention kernel).
PRODUCT_OPS = (aten.mm, aten.addmm, aten.bmm, aten.convolution, aten.convolution_backward)


def annotated(program: fxpar.Program) -> fxpar.Program:
    return AnnotateCost().run(program)


def flops_where(program: fxpar.Program, keep) -> ir.Size:  # type: ignore[no-untyped-def]
    return ir.total(
        ir.require(n, ir.Cost).flops for n in program.graph.nodes if n.op != "output" and keep(n)
    )


def test_linear_forward_and_backward_is_six_b_in_out() -> None:
    batch, width_in, width_out = 8, 24, 40
    model = nn.Sequential(nn.Linear(16, width_in), nn.Linear(width_in, width_out, bias=False))
    program = annotated(
        fxpar.capture(model, (torch.randn(batch, 16),), lambda y: y.square().mean())
    )
    second = flops_where(program, lambda n: ir.require(n, ir.Region).module == "1")
    assert second == 6 * batch * width_in * width_out
    # The first layer's input is data, so autograd skips its input gradient: 4·B·in·out.
    first_products = flops_where(
        program,
        lambda n: (
            ir.require(n, ir.Region).module == "0"
            and n.target in (aten.mm.default, aten.addmm.default)
        ),
    )
    assert first_products == 4 * batch * 16 * width_in


def conv_net() -> nn.Module:
    # No bias and no groups: torch's counter skips bias sums and miscounts grouped backward.
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.ReLU(),
        nn.Conv2d(8, 8, 3, stride=2, bias=False), nn.Flatten(), nn.Linear(8 * 9, 10),
    )  # fmt: skip


@pytest.mark.parametrize("model_name", ["conv", "gpt"])
def test_product_flops_equal_torch_flop_counter(model_name: str) -> None:
    """Independent ground truth: torch.utils.flop_counter on the eager step."""
    if model_name == "conv":
        model = conv_net()
        inputs, targets, loss_fn = (
            (torch.randn(4, 3, 8, 8),),
            (torch.randint(0, 10, (4,)),),
            F.cross_entropy,
        )
    else:
        model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=4))
        tokens = torch.randint(0, 256, (2, 16))
        inputs, targets, loss_fn = (tokens,), (tokens,), gpt_loss
    program = annotated(fxpar.capture(model, inputs, loss_fn, example_targets=targets))
    ours = flops_where(program, lambda n: getattr(n.target, "overloadpacket", None) in PRODUCT_OPS)
    counter = FlopCounterMode(display=False)
    with counter:
        loss_fn(model(*inputs), *targets).backward()
    assert ours == counter.get_total_flops()


def test_grouped_convolution_counts_each_gradient_as_one_forward() -> None:
    """Every multiply-add x·w of the forward appears once in the input gradient and once in the
    weight gradient; the bias gradient sums the output gradient."""
    model = nn.Sequential(nn.Conv2d(4, 8, 3), nn.Conv2d(8, 6, 3, padding=1, groups=2))
    program = annotated(fxpar.capture(model, (torch.randn(2, 4, 6, 6),), lambda y: y.sum()))
    second = {
        n.target: ir.require(n, ir.Cost).flops
        for n in program.graph.nodes
        if ir.require(n, ir.Region).module == "1"
    }
    forward = 2 * (2 * 6 * 4 * 4) * (8 // 2) * 3 * 3  # output elements × window × 2
    assert second[aten.convolution.default] == forward
    assert second[aten.convolution_backward.default] == 2 * forward + 2 * 6 * 4 * 4


def test_attention_flops_match_the_explicit_products() -> None:
    """The fused kernel counts what the textbook attention would: Q·Kᵀ and P·V forward, and the
    four products dV, dP, dQ, dK backward; the explicit form, traced as bmm, agrees."""
    batch, heads, length, head_dim = 2, 3, 10, 8

    class Attention(nn.Module):
        def __init__(self, fused: bool) -> None:
            super().__init__()
            self.fused = fused
            self.qkv = nn.Linear(head_dim, 3 * head_dim)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.qkv(x).chunk(3, dim=-1)
            if self.fused:
                return F.scaled_dot_product_attention(q, k, v).sum()
            scores = (q @ k.transpose(-1, -2)) * head_dim**-0.5
            return (scores.softmax(-1) @ v).sum()

    x = torch.randn(batch, heads, length, head_dim)
    forward = 2 * 2 * batch * heads * length * length * head_dim
    fused = annotated(fxpar.capture(Attention(True), (x,)))
    by_op = {n.target: ir.require(n, ir.Cost).flops for n in fused.graph.nodes if n.op != "output"}
    assert by_op[aten._scaled_dot_product_flash_attention_for_cpu.default] == forward
    assert by_op[aten._scaled_dot_product_flash_attention_for_cpu_backward.default] == 2 * forward
    explicit = annotated(fxpar.capture(Attention(False), (x,)))
    explicit_bmm = flops_where(explicit, lambda n: n.target is aten.bmm.default)
    assert explicit_bmm == 3 * forward


def test_gpt_flops_are_within_five_percent_of_the_standard_estimate() -> None:
    config = GPTConfig(n_layer=4, n_embd=128, n_head=4, vocab_size=512, block_size=64)
    batch, length = 4, 64
    model = GPT(config)
    tokens = torch.randint(0, config.vocab_size, (batch, length))
    program = annotated(fxpar.capture(model, (tokens,), gpt_loss, example_targets=(tokens,)))
    total = flops_where(program, lambda n: True)
    # 6·N·tokens counts the parameters used in products (the position table is a lookup), plus
    # 12·layers·tokens·length·width for the attention products, forward and backward.
    params = sum(p.numel() for p in model.parameters()) - model.wpe.weight.numel()
    tokens_count = batch * length
    estimate = (
        6 * params * tokens_count + 12 * config.n_layer * tokens_count * length * config.n_embd
    )
    assert abs(total - estimate) / estimate < 0.05, (total, estimate)


def test_views_move_no_bytes_but_report_their_size() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    program = annotated(fxpar.capture(model, (torch.randn(5, 8),), lambda y: y.sum()))
    for node in program.graph.nodes:
        if node.target is aten.t.default:
            cost = ir.require(node, ir.Cost)
            assert (cost.flops, cost.bytes_read, cost.bytes_written) == (0, 0, 0)
            assert cost.output_bytes == ir.require(node, ir.ValueMeta).tensor.nbytes
        if node.target is aten.addmm.default and ir.require(node, ir.Region).module == "0":
            cost = ir.require(node, ir.Cost)
            assert cost.flops == 2 * 5 * 8 * 16
            assert cost.bytes_read == 4 * (16 + 5 * 8 + 8 * 16)
            assert cost.bytes_written == cost.output_bytes == 4 * 5 * 16


def test_symbolic_costs_are_sympy_expressions_that_evaluate_to_static_costs() -> None:
    config = GPTConfig(n_layer=1, n_embd=32, n_head=4)
    model = GPT(config)
    tokens = torch.randint(0, 256, (2, 8))
    symbolic = annotated(
        fxpar.capture(model, (tokens,), gpt_loss, example_targets=(tokens,), dynamic=True)
    )
    placeholders = symbolic.placeholders()
    # The targets are an input of their own (the example passes one tensor twice), with
    # symbols of their own.
    batch_symbol, length_symbol = ir.require(placeholders["input_0"], ir.ValueMeta).tensor.shape
    target_batch, target_length = ir.require(placeholders["target_0"], ir.ValueMeta).tensor.shape
    assert isinstance(batch_symbol, sympy.Symbol) and isinstance(length_symbol, sympy.Symbol)
    assert {target_batch, target_length}.isdisjoint({batch_symbol, length_symbol})
    symbolic_flops = flops_where(symbolic, lambda n: True)
    assert isinstance(symbolic_flops, sympy.Expr) and symbolic_flops.free_symbols
    for batch, length in ((2, 8), (3, 20)):
        other = torch.randint(0, 256, (batch, length))
        static = annotated(fxpar.capture(model, (other,), gpt_loss, example_targets=(other,)))
        bindings = {
            batch_symbol: batch,
            length_symbol: length,
            target_batch: batch,
            target_length: length,
        }
        assert ir.evaluate(symbolic_flops, bindings) == flops_where(static, lambda n: True)
        # Symbolic tracing may add copies the static graph avoids, so bytes are compared on
        # the products, which both graphs share.
        for field in ("bytes_read", "bytes_written"):
            totals = [
                ir.total(
                    getattr(ir.require(n, ir.Cost), field)
                    for n in program.graph.nodes
                    if n.target in (aten.mm.default, aten.addmm.default)
                )
                for program in (symbolic, static)
            ]
            assert ir.evaluate(totals[0], bindings) == totals[1], field


def test_user_flop_formula_overrides_the_default() -> None:
    registry = default_flop_registry()
    registry.register(aten.gelu)(lambda out, x, *args, **kwargs: 8 * x.numel)
    model = nn.Sequential(nn.Linear(4, 6), nn.GELU())
    program = fxpar.capture(model, (torch.randn(3, 4),), lambda y: y.sum())
    AnnotateCost(flops=registry).run(program)
    gelu = next(n for n in program.graph.nodes if n.target is aten.gelu.default)
    assert ir.require(gelu, ir.Cost).flops == 8 * 3 * 6


def test_cost_requires_value_annotations() -> None:
    model = nn.Linear(2, 2)
    program = fxpar.capture(model, (torch.randn(1, 2),), lambda y: y.sum())
    node = next(n for n in program.graph.nodes if n.op == "call_function")
    del node.meta[ir.META_KEY][ir.ValueMeta]
    with pytest.raises(fxpar.errors.AnnotationError, match="has no ValueMeta annotation"):
        AnnotateCost().run(program)


def test_grouped_expert_products_count_their_multiply_adds() -> None:
    """MoE experts (transformers' grouped product and its backward): every routed row meets one
    expert's matrix, 2·S·K·N forward and twice that backward. Counted as one FLOP per element
    (as ops without a formula are), the planner priced running them whole as nearly free."""
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    tokens = torch.randint(0, 64, (2, 8))
    model = transformers.MixtralForCausalLM(config)
    program = annotated(fxpar.capture(model, {"input_ids": tokens, "labels": tokens}))
    grouped = [n for n in program.graph.nodes if "grouped_mm" in str(n.target)]
    assert len(grouped) == 4  # gate_up and down, forward and backward
    for node in grouped:
        a, b = (ir.require(arg, ir.ValueMeta).tensor.shape for arg in node.args[:2])
        forward = 2 * a[0] * a[1] * b[2]
        backward = "backward" in str(node.target)
        assert ir.require(node, ir.Cost).flops == (2 * forward if backward else forward)
