"""Shape ops: views and reshapes, permutations, expand, (un)squeeze, split/unbind/slice/select,
cat/stack, gather, flip, complex views, and their backward ops.

A reshape groups dims of the input and the output into runs with equal products. Sharding a run
in ``c`` pieces is the same on both sides only through the run's first dim on each side, and only
when ``c`` divides both: so a reshape rule maps each input spec directly to its output spec, over
all mesh axes at once (nested shards of one dim multiply ``c``). The other ops move or drop dims
and compose axis by axis. Partial values pass through all of them unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from fxpar.rules.registry import AxisOption, OpCall, RuleRegistry
from fxpar.sharding import Spec, Strategy, all_specs, shards_per_dim

aten = torch.ops.aten
R, P = Replicate(), Partial()


def reshape_groups(
    source: Sequence[int], target: Sequence[int]
) -> list[tuple[list[int], list[int]]]:
    """Runs of source dims and target dims with equal products, in order."""
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(source) or j < len(target):
        src, dst = [], []
        src_size = dst_size = 1
        while True:
            if src_size <= dst_size and i < len(source):
                src.append(i)
                src_size *= source[i]
                i += 1
            elif j < len(target):
                dst.append(j)
                dst_size *= target[j]
                j += 1
            else:
                break
            if (
                src_size == dst_size
                and (i == len(source) or source[i] != 1)
                and (j == len(target) or target[j] != 1)
            ):
                break
        groups.append((src, dst))
    return groups


def reshape_spec(
    source: Sequence[int], target: Sequence[int], spec: Spec, mesh_shape: Sequence[int]
) -> Spec | None:
    """The output spec of reshaping a tensor with ``spec``, or None if shards would scatter."""
    counts = shards_per_dim(spec, mesh_shape, len(source))
    sharded_dims = {p.dim for p in spec if isinstance(p, Shard)}
    mapping: dict[int, int] = {}
    for src, dst in reshape_groups(source, target):
        sharded = [d for d in src if d in sharded_dims]
        if not sharded:
            continue
        first_src = next((d for d in src if source[d] != 1), None)
        first_dst = next((d for d in dst if target[d] != 1), None)
        if first_src is None or sharded != [first_src] or first_dst is None:
            return None
        if target[first_dst] % counts[first_src] or source[first_src] % counts[first_src]:
            return None
        mapping[first_src] = first_dst
    return tuple(Shard(mapping[p.dim]) if isinstance(p, Shard) else p for p in spec)


def _reshape(call: OpCall) -> list[Strategy]:
    source, out = call.inputs[0], call.outputs[0]
    assert out is not None
    strategies = []
    for spec in all_specs(source.shape, call.mesh_shape, partial=True):
        mapped = reshape_spec(source.shape, out.shape, spec, call.mesh_shape)
        if mapped is not None:
            strategies.append(Strategy((mapped,), (spec, *[spec] * (len(call.inputs) - 1))))
    return strategies


def _dim(dim: int, rank: int) -> int:
    return dim + rank if dim < 0 else dim


def _moved(call: OpCall, mapping: dict[int, int | None], rank_in: int) -> list[AxisOption]:
    """Options for an op that moves input dim ``d`` to output dim ``mapping[d]`` (None: the dim
    cannot be sharded), for a single tensor input and any number of outputs."""
    options = []
    for d in range(rank_in):
        target = mapping.get(d, d)
        if target is None:
            continue
        shard = tuple(None if o is None else Shard(target) for o in call.outputs)
        options.append(AxisOption(shard, (Shard(d),) * len(call.inputs)))
    partial = tuple(None if o is None else P for o in call.outputs)
    options.append(AxisOption(partial, (P,) * len(call.inputs)))
    return options


def _permute(call: OpCall) -> list[AxisOption]:
    rank = len(call.inputs[0].shape)
    dims = [_dim(d, rank) for d in call.arg(1, "dims")]
    return _moved(call, {d: dims.index(d) for d in range(rank)}, rank)


def _transpose(call: OpCall) -> list[AxisOption]:
    rank = len(call.inputs[0].shape)
    if call.target is aten.t.default:
        a, b = (0, 1) if rank == 2 else (0, 0)
    else:
        a, b = _dim(call.arg(1, "dim0"), rank), _dim(call.arg(2, "dim1"), rank)
    mapping: dict[int, int | None] = {a: b, b: a}
    return _moved(call, mapping, rank)


def _expand(call: OpCall) -> list[AxisOption]:
    source, out = call.inputs[0], call.outputs[0]
    assert out is not None
    offset = len(out.shape) - len(source.shape)
    mapping: dict[int, int | None] = {
        d: (d + offset if source.shape[d] == out.shape[d + offset] else None)
        for d in range(len(source.shape))
    }
    return _moved(call, mapping, len(source.shape))


def _unsqueeze(call: OpCall) -> list[AxisOption]:
    rank = len(call.inputs[0].shape)
    dim = _dim(call.arg(1, "dim"), rank + 1)
    return _moved(call, {d: d + (d >= dim) for d in range(rank)}, rank)


def _squeeze(call: OpCall) -> list[AxisOption]:
    source, out = call.inputs[0], call.outputs[0]
    assert out is not None
    kept = [d for d in range(len(source.shape)) if not _squeezed(call, d)]
    mapping: dict[int, int | None] = {
        d: kept.index(d) if d in kept else None for d in range(len(source.shape))
    }
    return _moved(call, mapping, len(source.shape))


def _squeezed(call: OpCall, dim: int) -> bool:
    source = call.inputs[0]
    if source.shape[dim] != 1:
        return False
    dims = call.arg(1, "dim")
    if dims is None:
        return True
    dims = [dims] if isinstance(dims, int) else dims
    return dim in [_dim(d, len(source.shape)) for d in dims]


def _along(call: OpCall, dim: int, removes: bool) -> list[AxisOption]:
    """split / unbind / select / slice along ``dim``: any other dim may be sharded."""
    rank = len(call.inputs[0].shape)
    mapping: dict[int, int | None] = {
        d: (None if d == dim else d - (removes and d > dim)) for d in range(rank)
    }
    return _moved(call, mapping, rank)


def _split(call: OpCall) -> list[AxisOption]:
    rank = len(call.inputs[0].shape)
    return _along(call, _dim(call.arg(2, "dim", 0), rank), removes=False)


def _unbind(call: OpCall) -> list[AxisOption]:
    rank = len(call.inputs[0].shape)
    return _along(call, _dim(call.arg(1, "dim", 0), rank), removes=True)


def _select(call: OpCall) -> list[AxisOption]:
    rank = len(call.inputs[0].shape)
    return _along(call, _dim(call.arg(1, "dim"), rank), removes=True)


def _slice(call: OpCall) -> list[AxisOption]:
    source = call.inputs[0]
    rank = len(source.shape)
    dim = _dim(call.arg(1, "dim", 0), rank)
    start, end, step = call.arg(2, "start"), call.arg(3, "end"), call.arg(4, "step", 1)
    whole = (start in (None, 0)) and (end is None or end >= source.shape[dim]) and step == 1
    options = _along(call, dim, removes=False)
    if whole:
        options.append(AxisOption((Shard(dim),), (Shard(dim),)))
    return options


def _backward_of_along(call: OpCall) -> list[AxisOption]:
    """select_backward / slice_backward(grad, input_sizes, dim, ...): the gradient is scattered
    into zeros of the input's shape; any dim but ``dim`` may be sharded."""
    out = call.outputs[0]
    assert out is not None
    rank = len(out.shape)
    dim = _dim(call.arg(2, "dim"), rank)
    removes = call.target is aten.select_backward.default
    options = []
    for d in range(rank):
        if d == dim:
            continue
        options.append(AxisOption((Shard(d),), (Shard(d - (removes and d > dim)),)))
    options.append(AxisOption((P,), (P,)))
    return options


def _cat(call: OpCall) -> list[AxisOption]:
    out = call.outputs[0]
    assert out is not None
    rank = len(out.shape)
    dim = _dim(call.arg(1, "dim", 0), rank)
    options = []
    for d in range(rank):
        if d == dim:
            continue
        inputs = tuple(Shard(d) if len(m.shape) == rank else R for m in call.inputs)
        options.append(AxisOption((Shard(d),), inputs))
    options.append(AxisOption((P,), (P,) * len(call.inputs)))
    return options


def _stack(call: OpCall) -> list[AxisOption]:
    out = call.outputs[0]
    assert out is not None
    rank = len(out.shape)
    dim = _dim(call.arg(1, "dim", 0), rank)
    options = [
        AxisOption((Shard(d + (d >= dim)),), (Shard(d),) * len(call.inputs))
        for d in range(rank - 1)
    ]
    options.append(AxisOption((P,), (P,) * len(call.inputs)))
    return options


def _gather(call: OpCall) -> list[AxisOption]:
    source, index = call.inputs
    rank = len(source.shape)
    dim = _dim(call.arg(1, "dim"), rank)
    options = [
        AxisOption((Shard(d),), (Shard(d), Shard(d)))
        for d in range(rank)
        if d != dim and source.shape[d] == index.shape[d]
    ]
    options.append(AxisOption((P,), (P, R)))
    return options


def _view_as_complex(call: OpCall) -> list[AxisOption]:
    """view_as_complex ([..., 2] -> [...]) and view_as_real ([...] -> [..., 2]): the pair dim is
    the real and imaginary part of one number and stays whole; the others keep their index."""
    source, out = call.inputs[0], call.outputs[0]
    assert out is not None
    shared = min(len(source.shape), len(out.shape))
    return _moved(call, {d: (d if d < shared else None) for d in range(len(source.shape))},
                  len(source.shape))  # fmt: skip


def _flip(call: OpCall) -> list[AxisOption]:
    """flip(self, dims): a flipped dim's chunks change places, so only the others shard."""
    rank = len(call.inputs[0].shape)
    flipped = {_dim(d, rank) for d in call.arg(1, "dims")}
    return _moved(call, {d: None for d in flipped}, rank)


def register(rules: RuleRegistry) -> None:
    rules.register(aten.view, aten._unsafe_view, aten.reshape, aten.view_copy)(_reshape)
    rules.register(aten.permute)(_permute)
    rules.register(aten.transpose, aten.t)(_transpose)
    rules.register(aten.expand)(_expand)
    rules.register(aten.unsqueeze)(_unsqueeze)
    rules.register(aten.squeeze)(_squeeze)
    rules.register(aten.split, aten.split_with_sizes)(_split)
    rules.register(aten.unbind)(_unbind)
    rules.register(aten.select.int)(_select)
    rules.register(aten.slice.Tensor)(_slice)
    rules.register(aten.select_backward, aten.slice_backward)(_backward_of_along)
    rules.register(aten.cat)(_cat)
    rules.register(aten.stack)(_stack)
    rules.register(aten.gather)(_gather)
    rules.register(aten.view_as_complex, aten.view_as_real)(_view_as_complex)
    rules.register(aten.flip)(_flip)
