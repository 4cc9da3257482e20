"""Ops that run along one dim of their input: cumulative sums, sort and top-k.

Each slice along the scanned dim is computed independently of the others, so any other dim may be
sharded (every output alike, as each output has the input's dims); the scanned dim stays whole.
A cumulative sum is linear, so partial values pass through it; a sort is not.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Shard

from fxpar.rules.registry import AxisOption, OpCall, RuleRegistry

aten = torch.ops.aten
P = Partial()


def _scanned_dim(call: OpCall, dim: int) -> int:
    return dim + len(call.inputs[0].shape) if dim < 0 else dim


def along_dim_options(call: OpCall, dim: int) -> list[AxisOption]:
    """Shard every dim but ``dim`` of the input and of every output alike."""
    rank = len(call.inputs[0].shape)
    return [
        AxisOption(tuple(None if o is None else Shard(d) for o in call.outputs), (Shard(d),))
        for d in range(rank)
        if d != dim
    ]


def _cumsum(call: OpCall) -> list[AxisOption]:
    # (self, dim, dtype=None) -> out
    options = along_dim_options(call, _scanned_dim(call, call.arg(1, "dim")))
    options.append(AxisOption((P,), (P,)))
    return options


def _sort(call: OpCall) -> list[AxisOption]:
    # sort(self, dim=-1, descending=False) and sort.stable(self, *, stable, dim=-1, descending)
    dim = call.kwargs.get("dim", -1) if call.target is aten.sort.stable else call.arg(1, "dim", -1)
    return along_dim_options(call, _scanned_dim(call, dim))


def _topk(call: OpCall) -> list[AxisOption]:
    # (self, k, dim=-1, largest=True, sorted=True) -> (values, indices)
    return along_dim_options(call, _scanned_dim(call, call.arg(2, "dim", -1)))


def register(rules: RuleRegistry) -> None:
    rules.register(aten.cumsum.default)(_cumsum)
    rules.register(aten.sort.default, aten.sort.stable)(_sort)
    rules.register(aten.topk.default)(_topk)
