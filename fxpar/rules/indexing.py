"""Ops that read or write at given positions: padding, slice and select scatters, scatter,
advanced indexing, and histograms.

Positions name one dim (the padded, scattered or indexed one); the other dims are independent,
so they may be sharded when every tensor that has them has them at full size, and the positional
dim stays whole. Writes are linear in the written tensors jointly when every position is written
once (accumulating, or a slice), so partial values pass through those.

Left replicated on purpose: ``as_strided`` and ``as_strided_scatter`` (strides address the
whole tensor's storage, which no shard holds), ``index_put`` and ``index.Tensor`` with several
index tensors or boolean masks (positions span dims, or depend on the data), ``scatter`` along
the only dim, and ``histc`` without an explicit range (its bins depend on the global min and max).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from fxpar.ir import TensorMeta
from fxpar.rules.registry import AxisOption, OpCall, RuleRegistry

aten = torch.ops.aten
R, P = Replicate(), Partial()


def _dim(dim: int, rank: int) -> int:
    return dim + rank if dim < 0 else dim


def _constant_pad_nd(call: OpCall) -> list[AxisOption]:
    # (self, pad, value=0): pad holds (before, after) pairs from the last dim backwards.
    rank = len(call.inputs[0].shape)
    pad = list(call.arg(1, "pad"))
    padded = {rank - 1 - i // 2 for i, amount in enumerate(pad) if amount != 0}
    options = [AxisOption((Shard(d),), (Shard(d),)) for d in range(rank) if d not in padded]
    if call.arg(2, "value", 0) in (0, None):  # padding with zeros is linear
        options.append(AxisOption((P,), (P,)))
    return options


def _slice_scatter(call: OpCall) -> list[AxisOption]:
    # (self, src, dim=0, start, end, step) -> self with src written into a slice of dim
    rank = len(call.inputs[0].shape)
    dim = _dim(call.arg(2, "dim", 0), rank)
    options = [AxisOption((Shard(d),), (Shard(d), Shard(d))) for d in range(rank) if d != dim]
    options.append(AxisOption((P,), (P, P)))
    return options


def _select_scatter(call: OpCall) -> list[AxisOption]:
    # (self, src, dim, index): src lacks dim
    rank = len(call.inputs[0].shape)
    dim = _dim(call.arg(2, "dim"), rank)
    options = [
        AxisOption((Shard(d),), (Shard(d), Shard(d - (d > dim)))) for d in range(rank) if d != dim
    ]
    options.append(AxisOption((P,), (P, P)))
    return options


def _scatter(call: OpCall) -> list[AxisOption]:
    # scatter.src / scatter.value / scatter_add (self, dim, index, src?): index (and src) may be
    # smaller than self in other dims, so only dims where all have self's size are sharded.
    source = call.inputs[0]
    rank = len(source.shape)
    dim = _dim(call.arg(1, "dim"), rank)
    options = []
    for d in range(rank):
        if d != dim and all(m.shape[d] == source.shape[d] for m in call.inputs[1:]):
            options.append(AxisOption((Shard(d),), (Shard(d),) * len(call.inputs)))
    if call.target is aten.scatter_add.default:  # each addend lands once: linear in self, src
        options.append(AxisOption((P,), (P, R, P)))
    return options


def _single_index(call: OpCall) -> tuple[int, TensorMeta] | None:
    """(position, index tensor) of index.Tensor / index_put with one integer index tensor."""
    indices = list(call.arg(1, "indices"))
    given = [(k, m) for k, m in enumerate(indices) if m is not None]
    if len(given) != 1 or given[0][1].dtype not in (torch.int64, torch.int32):
        return None  # several index tensors broadcast together; masks select data-dependent rows
    return given[0]


def _index(call: OpCall) -> list[AxisOption]:
    # (self, indices): with index tensor idx at position k, the output is
    # self.shape[:k] + idx.shape + self.shape[k + 1:].
    found = _single_index(call)
    if found is None:
        return []
    k, index = found
    rank = len(call.inputs[0].shape)
    options = [
        AxisOption((Shard(d if d < k else d - 1 + len(index.shape)),), (Shard(d), R))
        for d in range(rank)
        if d != k
    ]
    options += [AxisOption((Shard(k + e),), (R, Shard(e))) for e in range(len(index.shape))]
    options.append(AxisOption((P,), (P, R)))  # gathering rows is linear in self
    return options


def _index_put(call: OpCall) -> list[AxisOption]:
    # (self, indices, values, accumulate=False): values as index.Tensor's output, unbroadcast.
    found = _single_index(call)
    if found is None:
        return []
    k, index = found
    source, _, values = call.inputs
    rank = len(source.shape)
    expected = (*source.shape[:k], *index.shape, *source.shape[k + 1 :])
    if tuple(values.shape) != expected:
        return []
    options = []
    for d in range(rank):
        if d == k:
            continue
        value_dim = d if d < k else d - 1 + len(index.shape)
        placements: tuple[Placement, ...] = (Shard(d), R, Shard(value_dim))
        options.append(AxisOption((Shard(d),), placements))
    if call.arg(3, "accumulate", False):  # each value is added once: linear in self, values
        options.append(AxisOption((P,), (P, R, P)))
    return options


def _histc(call: OpCall) -> list[AxisOption]:
    # (self, bins=100, min=0, max=0): with a fixed range every element's bin is known
    # locally, and the counts of the pieces add up.
    low, high = call.arg(2, "min", 0), call.arg(3, "max", 0)
    if low == high:
        return []  # the range is the data's own min and max
    return [AxisOption((P,), (Shard(d),)) for d in range(len(call.inputs[0].shape))]


def register(rules: RuleRegistry) -> None:
    rules.register(aten.constant_pad_nd.default)(_constant_pad_nd)
    rules.register(aten.slice_scatter.default)(_slice_scatter)
    rules.register(aten.select_scatter.default)(_select_scatter)
    rules.register(aten.scatter.src, aten.scatter.value, aten.scatter_add.default)(_scatter)
    rules.register(aten.index.Tensor)(_index)
    rules.register(aten.index_put.default)(_index_put)
    rules.register(aten.histc.default)(_histc)
