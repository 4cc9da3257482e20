"""Capture produces a functional Program that trains exactly like eager PyTorch."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from conftest import assert_matches_eager, eager_step
from torch import nn
from zoo import CNN, MLP, Regression

import fxpar
from fxpar import ir
from fxpar.models import GPT, GPTConfig, gpt_loss


def test_mlp_matches_eager() -> None:
    model = MLP()
    x, y = torch.randn(8, 16), torch.randint(0, 10, (8,))
    assert_matches_eager(model, (x,), F.cross_entropy, (y,))


def test_gpt_tied_head_matches_eager() -> None:
    model = GPT(GPTConfig(tie_weights=True))
    tokens, targets = torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))
    program = assert_matches_eager(model, (tokens,), gpt_loss, (targets,))
    # The tied weight is one parameter with one gradient, summed over both uses.
    assert "head.weight" not in program.signature.parameters
    assert "wte.weight" in program.signature.gradients


def test_gpt_untied_head_matches_eager() -> None:
    model = GPT(GPTConfig(tie_weights=False, bias=False, n_layer=3))
    tokens, targets = torch.randint(0, 256, (3, 20)), torch.randint(0, 256, (3, 20))
    program = assert_matches_eager(model, (tokens,), gpt_loss, (targets,))
    assert "head.weight" in program.signature.gradients


def test_cnn_with_batchnorm_matches_eager_including_running_stats() -> None:
    model = CNN()
    images, labels = torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,))
    program = assert_matches_eager(model, (images,), F.cross_entropy, (labels,))
    assert set(program.signature.buffer_updates) == {
        f"features.{i}.{stat}"
        for i in (1, 5)
        for stat in ("running_mean", "running_var", "num_batches_tracked")
    }


def test_model_returning_its_loss_with_frozen_shared_and_unused_parameters() -> None:
    model = Regression()
    program = assert_matches_eager(model, (torch.randn(4, 8), torch.randn(4, 8)))
    assert "frozen.weight" in program.signature.parameters
    assert "frozen.weight" not in program.signature.gradients
    assert program.signature.inputs == ("input_0", "input_1")


def test_keyword_inputs_are_named_by_their_keys() -> None:
    model = Regression()
    inputs = {"x": torch.randn(4, 8), "y": torch.randn(4, 8)}
    program = assert_matches_eager(model, inputs)
    assert program.signature.inputs == ("x", "y")
    assert list(program.placeholders())[-2:] == ["x", "y"]


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (self.linear(x) * y).sum()


def test_an_example_that_passes_one_tensor_twice_still_gets_two_inputs() -> None:
    """Fake-tensor conversion is memoized per tensor: without care, (x, x) traced both uses
    through one placeholder and the second batch tensor was ignored at run time."""
    model, x = _Scaled(), torch.randn(2, 4)
    for inputs in [(x, x), {"x": x, "y": x}]:
        program = fxpar.capture(model, inputs)
        placeholders = program.placeholders()
        assert all(placeholders[name].users for name in program.signature.inputs)
        other_x, other_y = torch.randn(2, 4), torch.randn(2, 4)
        result = program.run(model, other_x, other_y)
        expected, grads = eager_step(model, (other_x, other_y))
        torch.testing.assert_close(result.loss, expected)
        torch.testing.assert_close(result.gradients["linear.weight"], grads["linear.weight"])


def test_a_target_aliasing_an_input_is_its_own_input() -> None:
    """README's ``compile(model, cluster, (tokens,), gpt_loss, example_targets=(tokens,))``."""
    model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=8))
    tokens = torch.randint(0, 32, (2, 8))
    program = fxpar.capture(model, (tokens,), gpt_loss, example_targets=(tokens,))
    inputs, targets = torch.randint(0, 32, (2, 8)), torch.randint(0, 32, (2, 8))
    expected, _ = eager_step(model, (inputs,), gpt_loss, (targets,))
    torch.testing.assert_close(program.run(model, inputs, targets).loss, expected)


def test_dropout_model_captures_and_runs() -> None:
    """Random ops are captured; with p=0 the step is exact, with p>0 it is a valid random step."""
    assert_matches_eager(
        MLP(dropout=0.0), (torch.randn(8, 16),), F.cross_entropy, (torch.randint(0, 10, (8,)),)
    )
    model = MLP(dropout=0.5)
    x, y = torch.randn(8, 16), torch.randint(0, 10, (8,))
    program = fxpar.capture(model, (x,), F.cross_entropy, example_targets=(y,))
    fxpar.verify(program)
    first, second = program.run(model, x, y), program.run(model, x, y)
    assert torch.isfinite(first.loss)
    assert not torch.equal(first.gradients["net.0.weight"], second.gradients["net.0.weight"])


def test_graph_is_functional_and_every_node_is_annotated() -> None:
    program = fxpar.capture(
        CNN(),
        (torch.randn(2, 3, 8, 8),),
        F.cross_entropy,
        example_targets=(torch.randint(0, 10, (2,)),),
    )
    for node in program.graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            assert not node.target._schema.is_mutable, node.format_node()
        assert ir.get(node, ir.Region) is not None
    # The running statistics were written in place by eager BatchNorm; here they are outputs.
    assert not any("_native_batch_norm_legit." in str(n.target) for n in program.graph.nodes)


def test_forward_and_backward_regions_name_the_module() -> None:
    model = GPT(GPTConfig(n_layer=2))
    tokens = torch.randint(0, 256, (2, 8))
    program = fxpar.capture(model, (tokens,), gpt_loss, example_targets=(tokens,))
    regions = {node: ir.require(node, ir.Region) for node in program.graph.nodes}
    matmuls = [
        n
        for n, r in regions.items()
        if n.target in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
    ]
    forward_fc = [
        n
        for n in matmuls
        if regions[n].phase is ir.Phase.FORWARD and regions[n].module == "blocks.1.mlp.fc"
    ]
    backward_fc = [
        n
        for n in matmuls
        if regions[n].phase is ir.Phase.BACKWARD and regions[n].module == "blocks.1.mlp.fc"
    ]
    assert len(forward_fc) == 1  # x @ Wᵀ (+ b)
    assert len(backward_fc) == 2  # input gradient and weight gradient
    # Each backward node differentiates a forward node of the same module.
    forward_seq = {r.seq_nr: r.module for r in regions.values() if r.phase is ir.Phase.FORWARD}
    for region in regions.values():
        if region.phase is ir.Phase.BACKWARD and region.seq_nr is not None:
            assert forward_seq[region.seq_nr] == region.module
    # Parameters belong to their module, loss ops to the loss region, no forward reads backward.
    placeholders = program.placeholders()
    assert regions[placeholders["blocks.0.attn.qkv.weight"]].module == "blocks.0.attn.qkv"
    assert any(r.module == ir.LOSS_REGION for r in regions.values())
    phases = [r.phase for r in regions.values() if r.phase in (ir.Phase.FORWARD, ir.Phase.BACKWARD)]
    assert phases == sorted(phases, key=lambda p: p is ir.Phase.BACKWARD)


def test_meta_model_is_captured_without_weights_and_runs_on_real_ones() -> None:
    config = GPTConfig(n_layer=2)
    with torch.device("meta"):
        meta_model = GPT(config)
    tokens = torch.randint(0, 256, (2, 8))
    program = fxpar.capture(meta_model, (tokens,), gpt_loss, example_targets=(tokens,))
    fxpar.verify(program)
    # The graph holds no tensors of its own: the weights stay inputs.
    assert not list(program.graph_module.buffers()) and not list(program.graph_module.parameters())
    real_model = GPT(config)
    result = program.run(real_model, tokens, tokens)
    torch.testing.assert_close(result.loss, gpt_loss(real_model(tokens), tokens))


def test_real_weights_are_neither_copied_nor_modified() -> None:
    model = MLP()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    pointers = {name: p.data_ptr() for name, p in model.named_parameters()}
    program = fxpar.capture(
        model, (torch.randn(4, 16),), F.cross_entropy, example_targets=(torch.randint(0, 10, (4,)),)
    )
    assert not any(t.numel() >= 16 for t in program.graph_module.buffers())
    for name, p in model.named_parameters():
        assert p.data_ptr() == pointers[name]
        assert torch.equal(p, before[name])
        assert p.grad is None


def test_dynamic_capture_has_symbolic_shapes_and_runs_at_other_sizes() -> None:
    model = GPT(GPTConfig(n_layer=1))
    tokens = torch.randint(0, 256, (2, 8))
    program = fxpar.capture(model, (tokens,), gpt_loss, example_targets=(tokens,), dynamic=True)
    fxpar.verify(program)
    token_meta = ir.require(program.placeholders()["input_0"], ir.ValueMeta).tensor
    assert token_meta.is_symbolic and len(token_meta.numel.free_symbols) == 2
    for batch, length in ((3, 5), (1, 16)):
        other = torch.randint(0, 256, (batch, length))
        result = program.run(model, other, other)
        torch.testing.assert_close(result.loss, gpt_loss(model(other), other))


def test_program_run_checks_its_arguments() -> None:
    model = MLP()
    x, y = torch.randn(4, 16), torch.randint(0, 10, (4,))
    program = fxpar.capture(model, (x,), F.cross_entropy, example_targets=(y,))
    try:
        program.run(model, x)
    except fxpar.errors.FxparError as error:
        assert "expected 2 batch tensors" in str(error)
    else:
        raise AssertionError("a missing target was accepted")
    try:
        program.run({}, x, y)
    except fxpar.errors.FxparError as error:
        assert "net.0.weight" in str(error)
    else:
        raise AssertionError("a missing parameter was accepted")


def test_buffers_written_by_forward_become_outputs() -> None:
    class Counter(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)
            self.register_buffer("steps", torch.zeros((), dtype=torch.long))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.steps += 1
            return self.linear(x).square().mean()

    model = Counter()
    program = assert_matches_eager(model, (torch.randn(3, 4),))
    assert program.signature.buffer_updates == ("steps",)
