"""The verifier rejects each kind of broken Program."""

from __future__ import annotations

import operator

import pytest
import torch
from torch import nn

import fxpar
from fxpar import ir
from fxpar.errors import VerificationError

aten = torch.ops.aten


def program() -> fxpar.Program:
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    return fxpar.capture(model, (torch.randn(3, 4),), lambda y: y.square().mean())


def first(p: fxpar.Program, target: object) -> torch.fx.Node:
    return next(n for n in p.graph.nodes if n.target is target)


def test_captured_program_verifies() -> None:
    fxpar.verify(program())


def test_mutating_op_is_rejected() -> None:
    p = program()
    node = first(p, aten.tanh.default)
    node.target = aten.tanh_.default
    with pytest.raises(VerificationError, match="mutates its inputs"):
        fxpar.verify(p)


def test_random_op_inside_the_graph_is_rejected() -> None:
    """Capture turns random ops into inputs; one left in the graph would draw per rank."""
    p = program()
    node = first(p, aten.tanh.default)
    node.target, node.args = aten.rand_like.default, (node.args[0],)
    with pytest.raises(VerificationError, match="draws random numbers"):
        fxpar.verify(p)


def test_non_aten_call_is_rejected() -> None:
    p = program()
    first(p, aten.tanh.default).target = torch.tanh
    with pytest.raises(VerificationError, match="not an ATen op"):
        fxpar.verify(p)


def test_missing_annotation_is_rejected() -> None:
    p = program()
    del first(p, aten.tanh.default).meta[ir.META_KEY][ir.ValueMeta]
    with pytest.raises(VerificationError, match="no ValueMeta"):
        fxpar.verify(p)


def test_annotation_disagreeing_with_traced_value_is_rejected() -> None:
    p = program()
    node = first(p, aten.tanh.default)
    ir.annotate(node, ir.ValueMeta((ir.TensorMeta((3, 9), torch.float32),)))
    with pytest.raises(VerificationError, match="traced value"):
        fxpar.verify(p)


def test_gradient_with_wrong_shape_is_rejected() -> None:
    p = program()
    output = p.graph.output_node()
    results = list(output.args[0])
    results[1], results[3] = results[3], results[1]  # swap two gradients of different shapes
    output.args = (tuple(results),)
    with pytest.raises(VerificationError, match=r"output for '0\.weight'"):
        fxpar.verify(p)


def test_getitem_out_of_range_is_rejected() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8))
    p = fxpar.capture(model, (torch.randn(3, 4),), lambda y: y.square().mean())
    getitem = first(p, operator.getitem)
    getitem.args = (getitem.args[0], 7)
    with pytest.raises(VerificationError, match="index 7 out of range"):
        fxpar.verify(p)


def test_forward_reading_backward_is_rejected() -> None:
    p = program()
    backward = next(n for n in p.graph.nodes if ir.require(n, ir.Region).phase is ir.Phase.BACKWARD)
    node = first(p, aten.tanh.default)
    ir.annotate(backward, ir.Region(ir.Phase.FORWARD, ""))
    ir.annotate(node, ir.Region(ir.Phase.BACKWARD, ""))
    # The forward nodes after `node` now read a "backward" node.
    with pytest.raises(VerificationError, match="forward node reads backward node"):
        fxpar.verify(p)


def test_placeholder_count_must_match_signature() -> None:
    p = program()
    with p.graph.inserting_before(first(p, aten.tanh.default)):
        extra = p.graph.placeholder("extra")
    ir.annotate(extra, ir.Region(ir.Phase.INPUT, ""))
    with pytest.raises(VerificationError, match="placeholders"):
        fxpar.verify(p)
