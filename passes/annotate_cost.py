"""Annotate every node with its :class:`~fxpar.ir.Cost`: FLOPs and bytes moved.

Views (ops whose result aliases an input), ``getitem`` and symbolic-size arithmetic (nodes that
produce no tensor) move no data: they cost zero FLOPs and zero bytes read or written, though
their ``output_bytes`` still give the size of the value. Other ops read all their tensor
arguments and write all their results; FLOPs come from a :class:`~fxpar.ir.flops.FlopRegistry`.
Costs are ints, or sympy expressions when the Program was captured with symbolic shapes.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch
import torch.fx as fx

from fxpar import ir
from fxpar.ir.flops import FlopRegistry, default_flop_registry
from fxpar.ir.program import Program
from fxpar.passes.base import Pass


@dataclass(frozen=True)
class AnnotateCost(Pass):
    """Attach a Cost to every node but the output.

    ``flops`` holds the FLOP formulas; pass your own registry (a copy of the default with your
    ops added) to count custom ops exactly.
    """

    name = "annotate-cost"
    flops: FlopRegistry = field(default_factory=default_flop_registry, compare=False)

    def run(self, program: Program) -> Program:
        for node in program.graph.nodes:
            if node.op != "output":
                ir.annotate(node, node_cost(node, self.flops))
        return program


def node_cost(node: fx.Node, flops: FlopRegistry) -> ir.Cost:
    outputs = ir.require(node, ir.ValueMeta).tensors
    output_bytes = ir.total(t.nbytes for t in outputs)
    op = op_name(node.target) if node.op == "call_function" else ""
    if node.op != "call_function" or not outputs or _moves_no_data(node.target):
        return ir.Cost(flops=0, bytes_read=0, bytes_written=0, output_bytes=output_bytes, op=op)
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), _tensor_meta)  # type: ignore[arg-type]
    inputs = [a for a in _flatten((args, kwargs)) if isinstance(a, ir.TensorMeta)]
    formula = flops.formula(node.target)
    if formula is not None:
        count = formula(outputs, *args, **kwargs)
    elif flops.is_free(node.target):
        count = 0
    else:
        count = _largest((*inputs, *outputs))
    return ir.Cost(
        flops=ir.total((count,)),
        bytes_read=ir.total(t.nbytes for t in inputs),
        bytes_written=output_bytes,
        output_bytes=output_bytes,
        op=op,
    )


def op_name(target: object) -> str:
    """``"aten.mm"`` for ``aten.mm.default``: the name an ATen op's speed is measured and looked
    up by (:attr:`fxpar.ir.Cost.op`); empty for a target that is not an ATen op."""
    if isinstance(target, torch._ops.OpOverload):
        return str(target.overloadpacket)
    return ""


def _moves_no_data(target: Any) -> bool:
    """Views and tuple reads only give another name to existing data."""
    if target is operator.getitem:
        return True
    if isinstance(target, torch._ops.OpOverload):
        return any(ret.alias_info is not None for ret in target._schema.returns)
    return False


def _tensor_meta(node: fx.Node) -> object:
    value = ir.require(node, ir.ValueMeta)
    if value.multiple or value.outputs[0] is None:
        return None
    return value.outputs[0]


def _flatten(value: object) -> list[object]:
    if isinstance(value, (tuple, list)):
        return [item for element in value for item in _flatten(element)]
    if isinstance(value, dict):
        return [item for element in value.values() for item in _flatten(element)]
    return [value]


def _largest(tensors: tuple[ir.TensorMeta, ...]) -> ir.Size:
    if not tensors:
        return 0
    sizes = [t.numel for t in tensors]
    if all(isinstance(s, int) for s in sizes):
        return max(sizes)
    return ir.as_size(sympy.Max(*sizes))
