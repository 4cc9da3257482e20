"""Ops of mixture-of-experts routing that are not ATen's own: torchtitan's deterministic
scatter-add, which puts each expert output row back on its token.

``torchtitan::deterministic_scatter_add(out, index, src)`` is ``out.scatter_add(0, index,
src)`` run with deterministic algorithms on (torchtitan's MoE combine: ``out`` the tokens'
zeros ``(T, D)``, ``index`` each routed row's token, expanded over ``D``, ``src`` the routed
rows ``(T*K, D)``). Its strategies are ``aten.scatter_add``'s along dim 0: any other dim splits
when every operand has it at full size, and since every row is added once the sum is linear in
``out`` and ``src`` jointly, so Partial rows (a grouped product whose experts are split over
the axis) give Partial tokens: the sum over the axis then moves ``T`` rows, not ``T*K``.

Under ``expert_parallel(dispatch="all_to_all")`` the op is not run as such:
:mod:`fxpar.planning.moe_blocks` reads it as an MoE block's combine back to tokens.

The op exists once torchtitan's ``torchtitan.ops.scatter_add`` is imported (building any of its
MoE models does it); :func:`register` adds its rule only if it exists then.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from fxpar.rules.registry import AxisOption, OpCall, RuleRegistry

R, P = Replicate(), Partial()


def torchtitan_scatter_add() -> object | None:
    """torchtitan's deterministic scatter-add op, or None while it is not loaded."""
    packet = getattr(torch.ops.torchtitan, "deterministic_scatter_add", None)
    return None if packet is None else packet.default


def _scatter_add_rows(call: OpCall) -> list[AxisOption]:
    # (out, index, src), scattered along dim 0; index and src may be smaller than out in the
    # other dims, which then stay whole.
    out = call.inputs[0]
    options = [
        AxisOption((Shard(d),), (Shard(d),) * len(call.inputs))
        for d in range(1, len(out.shape))
        if all(m.shape[d] == out.shape[d] for m in call.inputs[1:])
    ]
    options.append(AxisOption((P,), (P, R, P)))
    return options


def register(rules: RuleRegistry) -> None:
    op = torchtitan_scatter_add()
    if op is not None:
        rules.register(op)(_scatter_add_rows)
