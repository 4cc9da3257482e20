"""The pass manager runs explicit pipelines, takes user passes anywhere, verifies after each
pass in debug mode, and names the failing pass and those before it."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import nn

import fxpar
from fxpar import ir
from fxpar.errors import FxparError, PassError, VerificationError
from fxpar.ir.program import Program
from fxpar.passes import AnnotateCost, Pass, PassManager, Verify, default_passes


def small_program() -> Program:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    return fxpar.capture(model, (torch.randn(3, 4),), lambda y: y.square().mean())


@dataclass(frozen=True)
class CountMatmuls(Pass):
    """A user pass: records how many products each region runs, as its own annotation."""

    name = "count-matmuls"
    ops: tuple[object, ...] = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)

    def run(self, program: Program) -> Program:
        for node in program.graph.nodes:
            if node.target in self.ops:
                # A user annotation: any frozen dataclass, stored through fxpar.ir.
                ir.annotate(node, Tagged(ir.require(node, ir.Cost).flops))
        return program


@dataclass(frozen=True)
class Tagged:
    flops: ir.Size


@dataclass(frozen=True)
class Explode(Pass):
    name = "explode"

    def run(self, program: Program) -> Program:
        raise RuntimeError("boom")


@dataclass(frozen=True)
class DropRegion(Pass):
    """A buggy pass: leaves a node without its Region annotation."""

    name = "drop-region"

    def run(self, program: Program) -> Program:
        node = next(n for n in program.graph.nodes if n.op == "call_function")
        del node.meta[ir.META_KEY][ir.Region]
        return program


def test_user_pass_inserted_after_cost_sees_costs() -> None:
    pipeline = default_passes(verify=True).insert_after("annotate-cost", CountMatmuls())
    assert pipeline.names[2:4] == ("annotate-cost", "count-matmuls")
    program = small_program()
    program.cluster = fxpar.Cluster((2,))
    program = pipeline.run(program)
    tagged = [ir.get(n, Tagged) for n in program.graph.nodes if ir.get(n, Tagged)]
    assert len(tagged) == 5  # two forward products, three backward (no input grad for layer 0)
    assert all(t.flops > 0 for t in tagged)


def test_user_pass_inserted_before_cost_fails_and_is_named() -> None:
    pipeline = default_passes().insert_before("annotate-cost", CountMatmuls())
    with pytest.raises(PassError) as raised:
        pipeline.run(small_program())
    assert "pass 'count-matmuls' failed (after canonicalize, rematerialize)" in str(raised.value)
    assert "has no Cost annotation" in str(raised.value)


def test_failing_pass_is_named_with_the_passes_before_it() -> None:
    pipeline = PassManager((AnnotateCost(), Verify(), Explode()))
    with pytest.raises(PassError) as raised:
        pipeline.run(small_program())
    error = raised.value
    assert error.pass_name == "explode" and error.completed == ("annotate-cost", "verify")
    assert "pass 'explode' failed (after annotate-cost, verify): RuntimeError: boom" in str(error)
    assert isinstance(error.__cause__, RuntimeError)


def test_debug_mode_verifies_after_every_pass() -> None:
    broken = PassManager((AnnotateCost(), DropRegion()), verify=True)
    with pytest.raises(PassError, match="pass 'drop-region' left an invalid Program"):
        broken.run(small_program())
    # Without debug mode the breakage goes unnoticed until something verifies.
    program = PassManager((AnnotateCost(), DropRegion())).run(small_program())
    with pytest.raises(VerificationError, match="has no Region annotation"):
        fxpar.verify(program)


def test_pipeline_editing() -> None:
    pipeline = PassManager((AnnotateCost(), Verify()))
    assert pipeline.replace("verify", CountMatmuls()).names == ("annotate-cost", "count-matmuls")
    assert pipeline.without("verify").names == ("annotate-cost",)
    with pytest.raises(FxparError, match="no pass named 'missing'"):
        pipeline.insert_after("missing", Verify())
    with pytest.raises(FxparError, match="must be unique"):
        PassManager((Verify(), Verify()))


def test_pass_must_return_a_program() -> None:
    @dataclass(frozen=True)
    class Forgetful(Pass):
        name = "forgetful"

        def run(self, program: Program) -> Program:
            return None  # type: ignore[return-value]

    with pytest.raises(PassError, match="returned NoneType, not a Program"):
        PassManager((Forgetful(),)).run(small_program())


def test_passes_are_frozen_dataclasses_with_options() -> None:
    with pytest.raises(Exception, match="cannot assign"):
        CountMatmuls().ops = ()  # type: ignore[misc]
    assert CountMatmuls() == CountMatmuls()


def test_the_old_name_of_the_default_pass_list_still_works_and_says_it_moved() -> None:
    """``default_pipeline`` (before "pipeline" meant pipeline parallelism only) builds the same
    pass list as ``default_passes``, with a DeprecationWarning naming the new name."""
    with pytest.warns(DeprecationWarning, match="default_passes"):
        old = fxpar.passes.default_pipeline(verify=True)
    assert old.names == fxpar.passes.default_passes(verify=True).names


class _MaskedAttention(nn.Module):
    """Attention under a mask built from the sequence length (as Hugging Face models build
    theirs under tracing), or read from the batch."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.kind = kind

    def forward(self, x: torch.Tensor, given: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, 2, 8).permute(2, 0, 3, 1, 4)
        rows, cols = torch.arange(length)[:, None], torch.arange(length)[None, :]
        allowed = cols <= rows
        if self.kind == "window":
            allowed = allowed & (rows - cols < 3)
        mask: torch.Tensor = torch.where(allowed, 0.0, float("-inf")).expand(batch, 1, -1, -1)
        if self.kind == "lowest":
            mask = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)
        elif self.kind == "bool":
            mask = allowed
        elif self.kind == "given":
            mask = given
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum()


@pytest.mark.parametrize(
    ("kind", "folded"),
    [("causal", True), ("lowest", True), ("bool", True), ("window", False), ("given", False)],
)
def test_a_constant_causal_mask_becomes_the_kernels_is_causal(kind: str, folded: bool) -> None:
    """Canonicalize drops an attention mask that depends on no input and is the causal mask
    (-inf or the lowest value above the diagonal, or False there) for ``is_causal=True``, in
    the forward and the backward, and the step computes the same; other masks stay."""
    from fxpar.passes.canonicalize import Canonicalize

    model = _MaskedAttention(kind)
    x = torch.randn(2, 6, 16)
    given = torch.ones(6, 6, dtype=torch.bool).tril()
    program = fxpar.capture(model, (x, given), lambda out: out)
    before = program.run(model, x, given)
    Canonicalize().run(program)
    attention = [n for n in program.graph.nodes if "scaled_dot_product" in str(n.target)]
    assert len(attention) == 2  # the forward and its backward
    for node in attention:
        assert ("attn_mask" not in node.kwargs) == folded
        causal_at = 7 if "backward" in str(node.target) else 4
        assert (len(node.args) > causal_at and node.args[causal_at] is True) == folded
    after = program.run(model, x, given)
    torch.testing.assert_close(after.loss, before.loss, rtol=0, atol=0)
    for name, gradient in before.gradients.items():
        torch.testing.assert_close(after.gradients[name], gradient, rtol=1e-6, atol=1e-7)
