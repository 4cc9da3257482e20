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
