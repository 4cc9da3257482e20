"""Mixture-of-experts blocks of a captured step, found by their routing sort, and the specs
that dispatch their tokens to their experts' devices by all-to-all.

A captured MoE layer (Hugging Face transformers' grouped MoE: Mixtral, Qwen2-MoE, fp32 or
bf16; torchtitan's DeepSeek-V3) has:

- the routing: a ``sort`` (transformers) or stable ``argsort`` (torchtitan) of the flattened
  top-k expert ids (one per *slot*, ``k`` slots per token), its ``perm``, ``perm // k``
  (each sorted row's token), maybe the inverse permutation
  (``index_put(empty_like(perm), [perm], arange)``), and the grouped products' offsets, a
  ``cumsum`` of counts per expert (transformers: ``histc`` of the sorted ids, part of the
  routing; torchtitan: the top-k ids counted, which also feed a buffer and stay as planned);
- *dispatch boundaries*, which take slot-ordered values into expert order: ``x[perm // k]``
  (the tokens' rows), ``v[perm]`` (the routing weights), and in the backward
  ``zeros.index_put([inverse], g, accumulate)`` or ``g.gather(0, idx)`` with ``idx`` the
  tokens expanded over the features (``(perm // k).view(-1, 1).expand(-1, D)``);
- the *region*: grouped products on those rows with those offsets, and the row-wise ops
  between them (activation, routing-weight product) and of their backward;
- *combine boundaries*, back to slot order: ``y[inverse]``, ``zeros.index_put([perm], g,
  accumulate)`` (routing weights' gradient), and back to tokens, summed per token:
  ``zeros.index_put([perm // k], g, accumulate)`` or a scatter-add along ``idx``
  (``aten.scatter_add``, torchtitan's deterministic scatter-add).

:func:`find_blocks` returns each block so described, or the reason a sort is not one.
With the tokens split on the batch over the expert axis, a device's dispatched rows are the
rows of its own experts from every device's tokens: :func:`dispatch_strategies` gives every
node of a block a strategy saying so (row values ``Shard`` on their row dim over every axis
the tokens are split on, per-expert values ``Shard(0)`` on the expert axis, counts made
outside the block ``Partial`` over those axes: each device counts its own tokens). A block so
planned is known by its sort's input split on the expert axis, which no rule offers
(:func:`dispatch_axis`); its all-to-alls (:func:`block_exchanges`: the count exchange at its
sort, the rows' exchange at each boundary) are entries of the collective schedule
(:mod:`fxpar.planning.collective_schedule`), which the lowering (:mod:`fxpar.lowering.spmd`)
emits around the local calls of :mod:`fxpar.lowering.expert_dispatch` for the block's routing
and boundaries; the region's ops run on the rows each device received (a view's row size
inferred, ``-1``). Values inside a block are never converted (the specs of its nodes agree by
construction): the pieces are as large as routing makes them, and a spec prices them as even
pieces, which is the balanced routing.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.fx as fx
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from fxpar import ir
from fxpar.cluster import Cluster
from fxpar.planning.cost import link_seconds
from fxpar.rules.experts import experts_spec, is_grouped_product
from fxpar.rules.registry import op_call
from fxpar.rules.routing import torchtitan_scatter_add
from fxpar.sharding import Sharding, Spec, Strategies, Strategy, piece_bytes

aten = torch.ops.aten

SORTS = (aten.sort.default, aten.sort.stable)
"""The routing sorts: transformers' ``sort``, torchtitan's stable ``argsort``."""

Boundary = Literal["dispatch", "dispatch_tokens", "combine", "combine_tokens"]
RowDims = tuple[int | None, ...]


@dataclass(frozen=True)
class MoEBlock:
    sort: fx.Node
    expert_ids: fx.Node
    """The sort's input: each slot's expert (1-D, slot order)."""
    num_experts: int
    top_k: int
    offsets: fx.Node
    """The grouped products' ``offs``."""
    routing: tuple[fx.Node, ...]
    """The sort and what it feeds up to the boundaries (permutations, counts, offsets, the
    boundaries' zero buffers): replaced by the exchange's own route."""
    boundaries: dict[fx.Node, tuple[Boundary, fx.Node]]
    """Each boundary and (its kind, the value it moves)."""
    region: tuple[fx.Node, ...]
    """The ops between the boundaries, in graph order."""
    rows: dict[fx.Node, RowDims]
    """Each value the block makes or reads, by its producer: per output, the dim holding its
    rows (slots or tokens, split as the tokens are), or None (a per-expert value: weights,
    their gradients, counts, offsets). Followed through the region's ops from the routing and
    the boundaries, never guessed from sizes."""

    def nodes(self) -> set[fx.Node]:
        return {*self.routing, *self.boundaries, *self.region}


def find_blocks(program_graph: fx.Graph) -> tuple[list[MoEBlock], list[str]]:
    """The MoE blocks of a graph, and for each routing-like sort that is not one, why."""
    blocks, refused = [], []
    for node in program_graph.nodes:
        if node.target in SORTS:
            found = _block(node)
            if isinstance(found, str):
                refused.append(f"{node.name}: {found}")
            else:
                blocks.append(found)
    return blocks, refused


def _getitems(node: fx.Node) -> dict[int, fx.Node]:
    return {u.args[1]: u for u in node.users if u.target is operator.getitem}  # type: ignore[misc]


def _sorts_ids(sort: fx.Node) -> bool:
    """Whether ``sort`` sorts a 1-D tensor ascending (``aten.sort`` or its stable overload)."""
    ids = sort.args[0]
    if not isinstance(ids, fx.Node) or len(_shape(ids)) != 1:
        return False
    if sort.target is aten.sort.default:
        options = dict(zip(("dim", "descending"), sort.args[1:], strict=False)) | sort.kwargs
    else:
        options = dict(zip(("stable", "dim", "descending"), sort.args[1:], strict=False))
        options |= sort.kwargs
    return options.get("dim", -1) in (0, -1) and not options.get("descending", False)


def _block(sort: fx.Node) -> MoEBlock | str:
    outputs = _getitems(sort)
    if set(outputs) - {0, 1} or 1 not in outputs:
        return "not a sort whose permutation is read"
    perm = outputs[1]
    ids = sort.args[0]
    assert isinstance(ids, fx.Node)
    if not _sorts_ids(sort):
        return "not an ascending sort of 1-D expert ids"
    slots = _shape(ids)[0]
    routing: list[fx.Node] = [sort, perm, *([outputs[0]] if 0 in outputs else [])]
    boundaries: dict[fx.Node, tuple[Boundary, fx.Node]] = {}
    tokens: fx.Node | None = None
    inverse: fx.Node | None = None
    top_k = 0
    for user in perm.users:
        if user.target is aten.floor_divide.default and isinstance(user.args[1], int):
            tokens, top_k = user, user.args[1]
            routing.append(user)
        elif user.target is aten.empty_like.default:
            routing.append(user)
        elif user.target is aten.index_put.default and _is_arange(user.args[2], slots):
            inverse = user
            routing += [user, user.args[2]]  # type: ignore[list-item]
    if tokens is None:
        return "its permutation is not read as tokens (perm // k)"
    indices: list[tuple[fx.Node, Boundary, Boundary]] = [
        (perm, "dispatch", "combine"),
        (tokens, "dispatch_tokens", "combine_tokens"),
    ]
    if inverse is not None:
        indices.append((inverse, "combine", "dispatch"))
    for index, gather, scatter in indices:
        for user, read_by in _row_reads(index, routing):
            kind = _boundary(user, read_by, gather, scatter)
            if kind is None:
                return f"{user.name} reads the routing as neither a gather nor a scatter"
            boundaries[user] = kind
            if kind[0] == scatter:
                routing.append(user.args[0])  # type: ignore[arg-type]
    if not boundaries:
        return "nothing reads rows by its permutation"
    region = _region(boundaries, set(routing))
    products = [n for n in region if is_grouped_product(n.target)]
    if not products:
        return "no grouped product between its boundaries"
    offsets = _offsets(products, outputs.get(0), routing)
    if isinstance(offsets, str):
        return offsets
    rows = _row_dims(ids, routing, boundaries, region)
    if isinstance(rows, str):
        return rows
    problem = _closed(region, boundaries, offsets, set(routing), rows)
    if problem is not None:
        return problem
    return MoEBlock(
        sort, ids, _shape(offsets)[0], top_k, offsets, tuple(routing), boundaries, tuple(region),
        rows,
    )  # fmt: skip


def _shape(node: object) -> tuple[int, ...]:
    assert isinstance(node, fx.Node)
    return tuple(int(d) for d in ir.require(node, ir.ValueMeta).tensor.shape)


def _is_arange(node: object, size: int) -> bool:
    return isinstance(node, fx.Node) and node.target is aten.arange.default and node.args == (size,)


def _row_reads(index: fx.Node, routing: list[fx.Node]) -> list[tuple[fx.Node, fx.Node]]:
    """The nodes that read rows by ``index`` (1-D), with the index as they read it: ``index``
    itself, or ``index.view(-1, 1).expand(-1, D)`` (a gather or scatter along dim 0 of whole
    rows of width ``D``), whose view and expand are added to ``routing``."""
    reads = []
    for user in index.users:
        if user in routing:
            continue
        column = user.target in (aten.view.default, aten.reshape.default) and list(
            user.args[1]  # type: ignore[arg-type]
        ) in ([-1, 1], [_shape(index)[0], 1])
        expands = [u for u in user.users if u.target is aten.expand.default] if column else []
        if not column or len(expands) != len(user.users):
            reads.append((user, index))
            continue
        routing.append(user)
        for expand in expands:
            routing.append(expand)
            reads += [(reader, expand) for reader in expand.users]
    return reads


def _boundary(
    user: fx.Node, index: fx.Node, gather: Boundary, scatter: Boundary
) -> tuple[Boundary, fx.Node] | None:
    """(kind, value moved) of a gather of whole rows by ``index`` (``v[index]``, or
    ``v.gather(0, index)`` by an expanded index) or of an accumulating scatter of whole rows
    into zeros (``zeros.index_put([index], v, True)``, ``zeros.scatter_add(0, index, v)``,
    torchtitan's deterministic scatter-add); None for any other use."""
    args = user.args
    if user.target is aten.index.Tensor and args[1] == [index] and args[0] is not index:
        return gather, args[0]  # type: ignore[return-value]
    if user.target is aten.gather.default and args[1:] == (0, index) and not user.kwargs:
        if _shape(args[0])[1:] == _shape(index)[1:]:
            return gather, args[0]  # type: ignore[return-value]
        return None
    if user.target is aten.index_put.default:
        accumulates = args[1] == [index] and len(args) > 3 and args[3] is True
        buffer, moved = args[0], args[2]
    elif user.target is aten.scatter_add.default:
        accumulates = args[1:3] == (0, index)
        buffer, moved = args[0], args[3]
    elif (titan := torchtitan_scatter_add()) is not None and user.target is titan:
        accumulates = args[1] == index
        buffer, moved = args[0], args[2]
    else:
        return None
    whole_rows = index.target is not aten.expand.default or _shape(moved) == _shape(index)
    zeros = (aten.new_zeros.default, aten.zeros.default, aten.zeros_like.default)
    into_zeros = isinstance(buffer, fx.Node) and buffer.target in zeros and len(buffer.users) == 1
    if accumulates and into_zeros and whole_rows and moved is not index:
        return scatter, moved  # type: ignore[return-value]
    return None


def _offsets(
    products: list[fx.Node], values: fx.Node | None, routing: list[fx.Node]
) -> fx.Node | str:
    """The offsets every grouped product reads (``offs``), a ``cumsum`` of counts per expert,
    added to ``routing``; so is the count ``histc(sorted ids)`` (through a cast) where it
    comes from the sort and feeds nothing else. Counts made otherwise (torchtitan counts the
    top-k ids) are computed as planned: a device's offsets are its route's."""
    read = {n.args[2] if len(n.args) > 2 else n.kwargs.get("offs") for n in products}
    if len(read) != 1:
        return "its grouped products read different offsets"
    (offsets,) = read
    if not isinstance(offsets, fx.Node) or offsets.target is not aten.cumsum.default:
        return "its grouped products' offsets are not a cumsum of counts"
    if any(user not in products for user in offsets.users) or len(_shape(offsets)) != 1:
        return f"its offsets {offsets.name} are read outside its grouped products"
    routing.append(offsets)
    chain: list[fx.Node] = []
    node = offsets.args[0]
    while isinstance(node, fx.Node) and len(node.users) == 1:
        if node is values:
            routing += chain
            break
        if node.target not in (aten._to_copy.default, aten.histc.default):
            break
        chain.append(node)
        node = node.args[0]
    return offsets


def _region(
    boundaries: dict[fx.Node, tuple[Boundary, fx.Node]], routing: set[fx.Node]
) -> list[fx.Node]:
    """The ops fed by the dispatches, up to the combines, in graph order."""
    dispatches = [b for b, (kind, _) in boundaries.items() if kind.startswith("dispatch")]
    combines = {b for b, (kind, _) in boundaries.items() if kind.startswith("combine")}
    region: set[fx.Node] = set()
    frontier = dispatches
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user in region or user in combines or user in routing or user.op == "output":
                continue
            region.add(user)
            frontier.append(user)
    order = {n: i for i, n in enumerate(next(iter(boundaries)).graph.nodes)}
    return sorted(region, key=order.__getitem__)


def _closed(
    region: list[fx.Node],
    boundaries: dict[fx.Node, tuple[Boundary, fx.Node]],
    offsets: fx.Node,
    routing: set[fx.Node],
    rows: dict[fx.Node, RowDims],
) -> str | None:
    """Why ``region`` reads or feeds a value outside the block other than expert weights and
    their gradients, or None."""
    dispatches = {b for b, (kind, _) in boundaries.items() if kind.startswith("dispatch")}
    combines = {b for b, (kind, _) in boundaries.items() if kind.startswith("combine")}
    inside = {*region, offsets, *dispatches}
    for node in region:
        if node.target is operator.getitem or is_grouped_product(node.target):
            continue
        if any(_shape(n) and _shape(n)[0] == _shape(offsets)[0] for n in _tensor_args(node)):
            continue  # an expert weight's or gradient's transpose or cast
        for arg in _tensor_args(node):
            if arg not in inside and not _is_expert_value(arg, offsets):
                return f"{node.name} reads {arg.name}, made outside the block"
    for node in region:
        for user in node.users:
            if user in inside or user in combines or user in routing:
                continue  # a boundary's zero buffer reads a row value for its dtype
            if any(dim is not None for dim in rows[node]):
                return f"{node.name} is read outside the block by {user.name}"
    return None


def _row_dims(
    ids: fx.Node,
    routing: list[fx.Node],
    boundaries: dict[fx.Node, tuple[Boundary, fx.Node]],
    region: list[fx.Node],
) -> dict[fx.Node, RowDims] | str:
    """The row dim of every value of a block (:attr:`MoEBlock.rows`), or why one cannot be
    followed. Known from the structure: the routing's values are rows on dim 0 (ids,
    permutations, index views, the scatters' zero buffers) but for the counts and offsets;
    each boundary moves rows on dim 0 and makes rows on dim 0. The region's ops carry them
    on: a grouped product's 2-D outputs are rows on dim 0, its 3-D ones per expert; views,
    transposes and sums move the dim as they move dims; other ops broadcast."""
    rows: dict[fx.Node, RowDims] = {ids: (0,)}
    for node in routing:
        counted = node.target in (aten.histc.default, aten.cumsum.default)
        rows[node] = (None if counted else 0,) * len(ir.require(node, ir.ValueMeta).outputs)
        if node.target is aten.zeros_like.default and isinstance(node.args[0], fx.Node):
            rows.setdefault(node.args[0], (0,))  # the buffer has its source's shape
    moved = {value for _, value in boundaries.values()}
    for node in boundaries:
        rows[node] = (0,)
    for value in moved - set(region):
        rows[value] = (0,)
    for node in region:
        followed = _follow_rows(node, rows)
        if isinstance(followed, str):
            return f"{node.name} ({node.target}): {followed}"
        rows[node] = followed
    for value in moved & set(region):
        if rows[value] != (0,):
            return f"{value.name} is moved by a boundary but holds its rows on dim {rows[value]}"
    return rows


_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
_SUMS = (aten.sum.dim_IntList, aten.mean.dim)
_SPLITS = (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default)


def _follow_rows(node: fx.Node, rows: dict[fx.Node, RowDims]) -> RowDims | str:
    """The row dim of each output of a region op, from its inputs'."""
    value = ir.require(node, ir.ValueMeta)
    if node.target is operator.getitem:
        source, item = node.args
        return (rows[source][item],)  # type: ignore[index]
    if is_grouped_product(node.target):
        return tuple(None if m is None or len(m.shape) == 3 else 0 for m in value.outputs)
    known: list[tuple[fx.Node, int]] = []
    for arg in _tensor_args(node):
        arg_dim = rows.get(arg, (None,))[0]
        if arg_dim is not None:
            known.append((arg, arg_dim))
    if not known:
        return (None,)  # a per-expert value: a weight's cast or transpose, its gradient's
    (source, dim) = known[0]
    in_shape = _shape(source)
    if node.target in _SPLITS:
        if _dim_args(node, len(in_shape)) == [dim]:
            return "a split of the rows"
        return (dim,) * len(value.outputs)
    if value.multiple:
        return "an op of several outputs on rows"
    out_shape = _shape(node)
    if node.target in (aten.squeeze.dim, aten.squeeze.dims):
        removed = _dim_args(node, len(in_shape))
        return "a squeeze of the rows" if dim in removed else (dim - sum(d < dim for d in removed),)
    if node.target is aten.unsqueeze.default:
        (added,) = _dim_args(node, len(out_shape))
        return (dim + (added <= dim),)
    if node.target in (aten.transpose.int, aten.t.default):
        first, second = _dim_args(node, len(in_shape))
        return ({first: second, second: first}.get(dim, dim),)
    if node.target is aten.permute.default:
        return (_dim_args(node, len(in_shape)).index(dim),)
    if node.target in _VIEWS:
        before = _product(in_shape[:dim])
        for out in range(len(out_shape)):
            if _product(out_shape[:out]) == before and out_shape[out] == in_shape[dim]:
                return (out,)
        return "a view that splits or merges the rows"
    if node.target in _SUMS:
        summed = _dim_args(node, len(in_shape))
        if dim in summed:
            return "a sum over the rows"
        keepdim = bool(node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim"))
        return (dim if keepdim else dim - sum(d < dim for d in summed),)
    for arg, arg_dim in known:  # broadcasting: dims aligned from the last
        out = arg_dim + len(out_shape) - len(_shape(arg))
        if out != dim + len(out_shape) - len(in_shape) or out_shape[out] != _shape(arg)[arg_dim]:
            return "inputs whose rows do not line up"
    return (dim + len(out_shape) - len(in_shape),)


def _dim_args(node: fx.Node, rank: int) -> list[int]:
    """The dims an op of :func:`_follow_rows` names, counted from 0 in a tensor of ``rank``
    dims (a sum of every dim names them all)."""
    args: Any = node.args
    if node.target is aten.t.default:
        return [0, 1]
    if node.target is aten.transpose.int:
        named = args[1:3]
    elif node.target in _SPLITS:
        named = [args[2] if len(args) > 2 else node.kwargs.get("dim", 0)]
    else:
        named = args[1]
    if named is None:
        return list(range(rank))
    return [int(d) % rank for d in (named if isinstance(named, list | tuple) else [named])]


def _product(sizes: tuple[int, ...]) -> int:
    product = 1
    for size in sizes:
        product *= size
    return product


def _tensor_args(node: fx.Node) -> list[fx.Node]:
    return [a for a in node.all_input_nodes if ir.get(a, ir.ValueMeta) is not None]


def _is_expert_value(node: fx.Node, offsets: fx.Node) -> bool:
    """Whether ``node`` holds one entry per expert on dim 0 (weights, their gradients)."""
    value = ir.require(node, ir.ValueMeta)
    if value.multiple:
        return True  # a grouped backward's (input gradient, weight gradient)
    shape = _shape(node)
    return len(shape) == 3 and shape[0] == _shape(offsets)[0]


# -- the plan ------------------------------------------------------------------------------------


def dispatch_strategies(
    block: MoEBlock, axis: int, token_spec: Spec, layout: dict[fx.Node, tuple[Spec | None, ...]]
) -> dict[fx.Node, Strategy]:
    """A strategy for every node of ``block`` whose tokens arrive as ``token_spec`` (split on
    dim 0 over ``axis``, the expert axis, and any data axes): row values are split on their
    row dim as the tokens are, per-expert values on dim 0 over ``axis`` (gradients partial
    over the data axes). ``layout``: the specs of values made outside the block, as planned;
    it is extended with the block's own."""
    data_axes = [a for a, p in enumerate(token_spec) if isinstance(p, Shard) and a != axis]
    counts = tuple(Partial() if isinstance(p, Shard) else Replicate() for p in token_spec)

    def spec_of(node: fx.Node, index: int, output: bool) -> Spec:
        if not output and node in block.offsets.all_input_nodes and node not in block.routing:
            return counts  # counted from the device's own tokens, as planned
        dim = block.rows.get(node, (None,))[index]
        if dim is not None:
            return _on_dim(token_spec, dim)
        placements: list[Placement] = [Replicate()] * len(token_spec)
        placements[axis] = Shard(0)
        for a in data_axes if output else ():
            placements[a] = Partial()
        return tuple(placements)

    chosen: dict[fx.Node, Strategy] = {}
    for node in sorted(block.nodes(), key=_position(block)):
        arguments = _tensor_args(node)
        inputs = tuple(_arriving(a, layout) or spec_of(a, 0, False) for a in arguments)
        if node.target is operator.getitem:
            continue
        value = ir.require(node, ir.ValueMeta)
        outputs = tuple(
            None if meta is None else spec_of(node, index, True)
            for index, meta in enumerate(value.outputs)
        )
        chosen[node] = Strategy(outputs, inputs)
        layout[node] = outputs
        for item in node.users:
            if item.target is operator.getitem:
                layout[item] = (outputs[int(item.args[1])],)  # type: ignore[arg-type]
    return chosen


def _arriving(node: fx.Node, layout: dict[fx.Node, tuple[Spec | None, ...]]) -> Spec | None:
    return layout[node][0] if node in layout else None


def _on_dim(spec: Spec, dim: int) -> Spec:
    return tuple(Shard(dim) if isinstance(p, Shard) else p for p in spec)


def _position(block: MoEBlock) -> Callable[[fx.Node], int]:
    order = {n: i for i, n in enumerate(block.sort.graph.nodes)}
    return order.__getitem__


def dispatch_axis(block: MoEBlock, *, chosen: bool = True) -> int | None:
    """The mesh axis a planned ``block`` dispatches its tokens over: the axis its sort's input
    is split on (no sharding rule splits a sort along the sorted dim; only a dispatch plan
    does). None for a block computed as planned op by op. ``chosen``: read the strategies the
    plan chose; else, before the choice, a node's candidates, of which a dispatch plan offers
    each node of its blocks exactly one (a strategy chosen for the program on another mesh
    may still be there then, and is not read)."""
    strategy = _planned(block.sort, chosen)
    if strategy is None:
        return None
    spec = strategy.inputs[0]
    axes = [a for a, p in enumerate(spec) if isinstance(p, Shard)]
    weights = [n for n in block.region if is_grouped_product(n.target)]
    for axis in axes:
        if all(_experts_split(n, axis, chosen) for n in weights):
            return axis
    return None


def _planned(node: fx.Node, chosen: bool) -> Strategy | None:
    """``node``'s chosen strategy, or (not ``chosen``) its only candidate."""
    if chosen:
        sharding = ir.get(node, Sharding)
        return None if sharding is None else sharding.strategy
    candidates = ir.get(node, Strategies)
    if candidates is not None and len(candidates.candidates) == 1:
        return candidates.candidates[0]
    return None


def _experts_split(node: fx.Node, axis: int, chosen: bool) -> bool:
    strategy = _planned(node, chosen)
    if strategy is None:
        return False
    mesh = tuple(1 for _ in strategy.inputs[0])
    spec = experts_spec(op_call(node, mesh), strategy)
    return spec is not None and spec[axis] == Shard(0)


COUNT_BYTES = 8
"""Bytes of one expert's row count in the exchange of counts (int64)."""


@dataclass(frozen=True)
class ExpertLoad:
    """How unevenly a program's mixture-of-experts blocks route their tokens, as the model
    states it (:attr:`fxpar.planning.problem.PlanOptions.expert_load`, recorded on the Program
    by the problem builder so that every price of the plan, its report's included, uses it):
    the rows the busiest device of a dispatched block receives over an even share. Without
    one, routing is priced balanced (1)."""

    factor: float = 1.0


def dispatched_ops(graph: fx.Graph, *, chosen: bool = True) -> set[fx.Node]:
    """The ops of ``graph``'s dispatched blocks that work on the rows each device received
    (the region and the boundaries): under an :class:`ExpertLoad`, the busiest device's run
    of each takes ``factor`` times an even share's. ``chosen`` as in :func:`exchange_seconds`."""
    return {
        node
        for block, _ in dispatched_blocks(graph, chosen=chosen)
        for node in (*block.region, *block.boundaries)
    }


ExchangeKind = Literal["route", "dispatch", "dispatch_tokens", "combine", "combine_tokens"]
"""What an exchange of a dispatched block does: ``route`` is the count exchange at its sort,
the others are its boundaries' kinds."""


@dataclass(frozen=True)
class BlockExchange:
    """One all-to-all of a dispatched block, run where ``node`` runs: at the block's sort the
    exchange of its experts' row counts (a fixed-size ``all_to_all``), at each boundary the
    rows of the value it moves sent to their experts' devices or back (a variable-size
    ``all_to_all_rows``). Blocking: it starts and is waited for there."""

    node: fx.Node
    kind: ExchangeKind
    axis: int
    value: fx.Node
    """What it exchanges: the sort's expert ids (their counts), or the boundary's moved value."""
    bytes: int
    """Bytes one device sends under balanced routing, as its price counts them: the counts of
    every expert (:data:`COUNT_BYTES` each), or its piece of the moved value as the boundary
    reads it (so a token, which travels once per expert of its ``top_k``, counts once)."""

    @property
    def collective(self) -> str:
        """The collective's kind, as a :class:`~fxpar.planning.collective_schedule.CollectiveRecord`
        names it."""
        return "all_to_all" if self.kind == "route" else "all_to_all_rows"

    def priced_bytes(self, load: float) -> float:
        """The bytes its price counts at the busiest device, under an :class:`ExpertLoad` of
        ``load``: the rows grow with it, the counts do not."""
        return self.bytes if self.kind == "route" else load * self.bytes

    def price(self, cluster: Cluster, load: float = 1.0) -> float:
        """Its seconds on ``cluster`` at the busiest device (:meth:`priced_bytes`)."""
        return link_seconds(self.collective, self.priced_bytes(load), self.axis, cluster)


def block_exchanges(
    graph: fx.Graph, mesh: tuple[int, ...], *, chosen: bool = True
) -> dict[fx.Node, BlockExchange]:
    """Every all-to-all of ``graph``'s dispatched blocks on ``mesh``, by the node that runs it,
    in graph order: a block's sort exchanges its experts' row counts, each boundary the rows
    of the value it moves. A block computed op by op (not dispatched) exchanges nothing.
    ``chosen``: of the plan chosen (the default), or of the one candidate each node of a
    dispatch plan has before the choice (:func:`dispatch_axis`)."""
    return exchanges_of(graph, dispatched_blocks(graph, chosen=chosen), mesh, chosen=chosen)


def exchanges_of(
    graph: fx.Graph,
    blocks: list[tuple[MoEBlock, int]],
    mesh: tuple[int, ...],
    *,
    chosen: bool = True,
) -> dict[fx.Node, BlockExchange]:
    """:func:`block_exchanges` of ``graph``'s dispatched ``blocks`` (with their expert axes,
    :func:`dispatched_blocks`)."""
    found: dict[fx.Node, BlockExchange] = {}
    for block, axis in blocks:
        counts = block.num_experts * COUNT_BYTES
        found[block.sort] = BlockExchange(block.sort, "route", axis, block.expert_ids, counts)
        for node, (kind, value) in block.boundaries.items():
            strategy = _planned(node, chosen)
            if strategy is None:
                continue
            spec = strategy.inputs[_tensor_args(node).index(value)]
            meta = ir.require(value, ir.ValueMeta).tensor
            found[node] = BlockExchange(node, kind, axis, value, piece_bytes(meta, spec, mesh))
    order = {node: position for position, node in enumerate(graph.nodes)}
    return dict(sorted(found.items(), key=lambda item: order[item[0]]))


def exchange_seconds(
    graph: fx.Graph, cluster: Cluster, *, chosen: bool = True, load: float = 1.0
) -> dict[fx.Node, float]:
    """What the all-to-all exchanges of ``graph``'s dispatched blocks
    (:func:`block_exchanges`) cost on ``cluster``, by the node that runs each. Priced at the
    busiest device: a device sends its piece of the value as the boundary reads it,
    ``(n - 1) / n`` of it to the other devices of the axis
    (:func:`~fxpar.planning.cost.link_seconds` of an all-to-all on the axis), and the busiest
    receives (dispatch) or sends back (combine) ``load`` times that (1: balanced routing;
    :class:`ExpertLoad`); the count exchange is the same at any load. ``chosen`` as in
    :func:`block_exchanges`."""
    return {
        node: exchange.price(cluster, load)
        for node, exchange in block_exchanges(graph, cluster.mesh_shape, chosen=chosen).items()
    }


def dispatched_blocks(graph: fx.Graph, *, chosen: bool = True) -> list[tuple[MoEBlock, int]]:
    """Each block of ``graph`` whose tokens are dispatched, with its expert axis
    (:func:`dispatch_axis`; ``chosen`` as there)."""
    blocks, _ = find_blocks(graph)
    found = []
    for block in blocks:
        axis = dispatch_axis(block, chosen=chosen)
        if axis is not None:
            found.append((block, axis))
    return found
