"""Reductions: sums give partial results when the reduced dim is sharded; other reductions
(max, mean, var, ...) keep the reduced dims whole and shard the others."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from fxpar.rules.registry import AxisOption, OpCall, RuleRegistry

aten = torch.ops.aten
R, P = Replicate(), Partial()


def _reduced_dims(call: OpCall) -> tuple[list[int], bool]:
    rank = len(call.inputs[0].shape)
    dims = call.arg(1, "dim")
    if dims is None or (isinstance(dims, Sequence) and len(dims) == 0):
        dims = list(range(rank))
    elif isinstance(dims, int):
        dims = [dims]
    keepdim = bool(call.arg(2, "keepdim", False)) if call.target is not aten.sum.default else False
    return sorted(d + rank if d < 0 else d for d in dims), keepdim


def reduction_options(call: OpCall, additive: bool) -> list[AxisOption]:
    rank = len(call.inputs[0].shape)
    reduced, keepdim = _reduced_dims(call)
    options = []
    for d in range(rank):
        if d in reduced:
            if additive:
                options.append(AxisOption(tuple(P for _ in call.outputs), (Shard(d),)))
            continue
        out_dim = d if keepdim else d - sum(r < d for r in reduced)
        options.append(AxisOption(tuple(Shard(out_dim) for _ in call.outputs), (Shard(d),)))
    if additive:
        options.append(AxisOption(tuple(P for _ in call.outputs), (P,)))
    return options


def register(rules: RuleRegistry) -> None:
    rules.register(aten.sum.dim_IntList, aten.sum.default)(
        lambda call: reduction_options(call, additive=True)
    )
    rules.register(
        aten.mean.dim, aten.mean.default, aten.amax, aten.amin, aten.var.correction,
        aten.std.correction, aten.prod.dim_int, aten.any.dim, aten.all.dim,
        aten.max.dim, aten.min.dim, aten.argmax, aten.argmin,
    )(lambda call: reduction_options(call, additive=False))  # fmt: skip
