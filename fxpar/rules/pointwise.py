"""Pointwise ops (with broadcasting) and the ops that are linear in one argument.

A pointwise op shards any output dim by sharding the same dim of every input that has it at full
size; inputs that broadcast along that dim stay replicated. Partial values pass through ops that
are linear in them: ``add``/``sub`` of two partials, ``mul``/``div`` of a partial by a replicated
factor, ``neg``, copies, and the backward ops that are linear in the incoming gradient.
Creation ops shaped like an input (``zeros_like``, ``new_zeros``) take any output spec.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from fxpar.ir import TensorMeta
from fxpar.rules.registry import AxisOption, OpCall, RuleRegistry, all_replicated

aten = torch.ops.aten
R, P = Replicate(), Partial()

# Ops whose every output is linear in all tensor inputs jointly (sum of partials is fine).
_ADDITIVE = (aten.add.Tensor, aten.sub.Tensor, aten.neg.default, aten.clone.default,
             aten._to_copy.default, aten.alias.default)  # fmt: skip
# Ops linear in the inputs at these argument positions (jointly) when the other tensor inputs
# are replicated.
_LINEAR_IN: dict[object, tuple[frozenset[int], ...]] = {
    aten.mul.Tensor: (frozenset({0}), frozenset({1})),
    aten.div.Tensor: (frozenset({0}),),
    aten.threshold_backward.default: (frozenset({0}),),
    aten.gelu_backward.default: (frozenset({0}),),
    aten.silu_backward.default: (frozenset({0}),),
    aten.sigmoid_backward.default: (frozenset({0}),),
    aten.tanh_backward.default: (frozenset({0}),),
    aten.where.self: (frozenset({1, 2}),),
    aten.hardswish_backward.default: (frozenset({0}),),
    aten.hardsigmoid_backward.default: (frozenset({0}),),
    aten.softplus_backward.default: (frozenset({0}),),
}
# Elementwise ops that ATen does not tag pointwise.
_UNTAGGED = (aten.hardswish.default, aten.floor_divide.default, aten.floor_divide.Scalar,
             aten._conj.default)  # fmt: skip


def pointwise_options(call: OpCall) -> list[AxisOption]:
    """Shard options of an elementwise op with broadcasting (no partials)."""
    out = next(o for o in call.outputs if o is not None)
    rank = len(out.shape)
    options = []
    for dim in range(rank):
        inputs = []
        for meta in call.inputs:
            offset = rank - len(meta.shape)
            own = dim - offset
            full = own >= 0 and meta.shape[own] == out.shape[dim]
            inputs.append(Shard(own) if full else R)
        outputs = tuple(
            None if o is None else Shard(dim) if len(o.shape) == rank else R for o in call.outputs
        )
        options.append(AxisOption(outputs, tuple(inputs)))
    return options


def partial_options(call: OpCall) -> list[AxisOption]:
    """Options where partial inputs give partial outputs."""
    outputs = tuple(None if o is None else P for o in call.outputs)
    tensor_positions = [i for i, a in enumerate(call.args) if isinstance(a, TensorMeta)]
    options = []
    if call.target in _ADDITIVE:
        # A scalar operand would be added once per device: only all-tensor operands stay exact.
        binary = call.target in (aten.add.Tensor, aten.sub.Tensor)
        if ({0, 1} if binary else {0}) <= set(tensor_positions):
            options.append(AxisOption(outputs, (P,) * len(call.inputs)))
    for positions in _LINEAR_IN.get(call.target, ()):
        if not positions <= set(tensor_positions):
            continue
        inputs = tuple(P if pos in positions else R for pos in tensor_positions)
        if len(inputs) == len(call.inputs):
            options.append(AxisOption(outputs, inputs))
    return options


def register(rules: RuleRegistry) -> None:
    def pointwise(call: OpCall) -> list[AxisOption]:
        if not call.inputs or not any(o is not None for o in call.outputs):
            return []
        return [all_replicated(call), *pointwise_options(call), *partial_options(call)]

    pointwise_ops = [
        op
        for name in dir(aten)
        if isinstance(packet := getattr(aten, name, None), torch._ops.OpOverloadPacket)
        for op in (getattr(packet, overload) for overload in packet.overloads())
        if torch.Tag.pointwise in op.tags and not op._schema.is_mutable
    ]
    rules.register(*pointwise_ops, *_UNTAGGED, *_ADDITIVE, *_LINEAR_IN)(pointwise)

    def like(call: OpCall) -> list[AxisOption]:
        # zeros_like and friends read only the shape: a partial input gives a replicated output.
        return [*pointwise_options(call), AxisOption((R,), (P,))]

    rules.register(aten.zeros_like, aten.ones_like, aten.full_like, aten.empty_like)(like)
    rules.register(aten.new_zeros, aten.new_ones, aten.new_full, aten.new_empty)(_new)


def _new(call: OpCall) -> list[AxisOption]:
    """new_zeros(self, size) and friends read only ``self``'s dtype and device, and lowering
    passes each device its local size: the output takes any spec, ``self`` any placement. Offered:
    each output shard with ``self`` replicated or sharded alike, and a replicated output beside
    any placement of ``self`` (so a sharded or partial ``self`` is never gathered for nothing)."""
    (source,), out = call.inputs, call.outputs[0]
    assert out is not None
    options = []
    for d in range(len(out.shape)):
        options.append(AxisOption((Shard(d),), (R,)))
        if len(source.shape) > d:
            options.append(AxisOption((Shard(d),), (Shard(d),)))
    options += [AxisOption((R,), (Shard(d),)) for d in range(len(source.shape))]
    options.append(AxisOption((R,), (P,)))
    return options
