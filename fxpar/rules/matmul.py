"""Matrix products, derived from an einsum description for one mesh axis.

For ``"mk,kn->mn"`` every index letter gives one option: a letter in an operand and the output
shards both (the other operand stays replicated); a letter in both operands but not the output
(the contraction) shards both operands and leaves the output partial. A partial operand times a
replicated one is partial. :func:`expand` then takes the product over mesh axes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from fxpar.rules.registry import AxisOption, OpCall, RuleRegistry

aten = torch.ops.aten
R, P = Replicate(), Partial()


def einsum_options(equation: str) -> list[AxisOption]:
    """The one-axis options of a product described by ``equation`` (one output)."""
    inputs_part, output = equation.split("->")
    operands = inputs_part.split(",")
    options = []
    for letter in dict.fromkeys(inputs_part.replace(",", "")):
        placements: list[Placement] = [
            Shard(op.index(letter)) if letter in op else R for op in operands
        ]
        if letter in output:
            out: Placement = Shard(output.index(letter))
        elif all(letter in op for op in operands):
            out = P
        else:
            continue  # summed over in a single operand: no sharded option
        options.append(AxisOption((out,), tuple(placements)))
    for linear in range(len(operands)):
        options.append(
            AxisOption((P,), tuple(P if i == linear else R for i in range(len(operands))))
        )
    return options


def _with_bias(
    options: list[AxisOption], bias_shape: tuple[int, ...], out_shape: tuple[int, ...]
) -> list[AxisOption]:
    """addmm/baddbmm: a broadcast bias follows the output's sharding where it has that dim at
    full size, stays replicated where it broadcasts, and is partial (added once) when the
    output is partial."""
    result = []
    for option in options:
        out = option.outputs[0]
        bias: Placement = R
        if isinstance(out, Shard):
            own = out.dim - (len(out_shape) - len(bias_shape))
            if own >= 0 and bias_shape[own] == out_shape[out.dim]:
                bias = Shard(own)
        elif isinstance(out, Partial):
            bias = P
        result.append(AxisOption(option.outputs, (bias, *option.inputs)))
    return result


def _fixed(options: list[AxisOption]) -> Callable[[OpCall], list[AxisOption]]:
    return lambda call: options


def register(rules: RuleRegistry) -> None:
    for op, equation in (
        (aten.mm, "mk,kn->mn"),
        (aten.bmm, "bmk,bkn->bmn"),
        (aten.mv, "mk,k->m"),
        (aten.dot, "k,k->"),
    ):
        rules.register(op)(_fixed(einsum_options(equation)))

    def biased(equation: str) -> Callable[[OpCall], list[AxisOption]]:
        def rule(call: OpCall) -> list[AxisOption]:
            out = call.outputs[0]
            assert out is not None
            return _with_bias(einsum_options(equation), call.inputs[0].shape, out.shape)

        return rule

    rules.register(aten.addmm)(biased("mk,kn->mn"))
    rules.register(aten.baddbmm)(biased("bmk,bkn->bmn"))
