"""Mixture-of-experts blocks of a captured step, found by their routing sort, and the specs
that dispatch their tokens to their experts' devices by all-to-all.

Hugging Face transformers' grouped MoE (Mixtral, Qwen2-MoE, in fp32 or bf16) captures as:

- the routing: ``sort`` of the flattened top-k expert ids (one per *slot*, ``k`` slots per
  token), its ``perm``, ``perm // k`` (each sorted row's token), the inverse permutation
  (``index_put(empty_like(perm), [perm], arange)``), and the offsets
  ``cumsum(histc(sorted ids))``;
- *dispatch boundaries*, which take slot-ordered values into expert order: ``x[perm // k]``
  (the tokens' rows), ``v[perm]`` (the routing weights), and in the backward
  ``zeros.index_put([inverse], g, accumulate)``;
- the *region*: grouped products on those rows with those offsets, and the row-wise ops
  between them (activation, routing-weight product) and of their backward;
- *combine boundaries*, back to slot order: ``y[inverse]``, and in the backward
  ``zeros.index_put([perm], g, accumulate)`` (routing weights' gradient) and
  ``zeros.index_put([perm // k], g, accumulate)`` (the tokens' gradient, summed per token).

:func:`find_blocks` returns each block so described, or the reason a sort is not one.
With the tokens split on the batch over the expert axis, a device's dispatched rows are the
rows of its own experts from every device's tokens: :func:`dispatch_strategies` gives every
node of a block a strategy saying so (row values ``Shard`` on their row dim over every axis
the tokens are split on, per-expert values ``Shard(0)`` on the expert axis). The lowering
(:mod:`fxpar.lowering.spmd`) recognises a block so planned (its sort's input split on the
expert axis, which no rule offers) and emits the exchange of
:mod:`fxpar.lowering.expert_dispatch` for its routing and boundaries; the region's ops run
on the rows each device received. Values inside a block are never converted (the specs of
its nodes agree by construction): the pieces are as large as routing makes them, and a
spec prices them as even pieces, which is the balanced routing.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.fx as fx
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from fxpar import ir
from fxpar.cluster import Cluster
from fxpar.planning.cost import collective_seconds
from fxpar.rules.experts import experts_spec, is_grouped_product
from fxpar.rules.registry import op_call
from fxpar.sharding import Sharding, Spec, Strategies, Strategy, piece_bytes

aten = torch.ops.aten

Boundary = Literal["dispatch", "dispatch_tokens", "combine", "combine_tokens"]


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

    def nodes(self) -> set[fx.Node]:
        return {*self.routing, *self.boundaries, *self.region}


def find_blocks(program_graph: fx.Graph) -> tuple[list[MoEBlock], list[str]]:
    """The MoE blocks of a graph, and for each routing-like sort that is not one, why."""
    blocks, refused = [], []
    for node in program_graph.nodes:
        if node.target is aten.sort.default:
            found = _block(node)
            if isinstance(found, str):
                refused.append(f"{node.name}: {found}")
            else:
                blocks.append(found)
    return blocks, refused


def _getitems(node: fx.Node) -> dict[int, fx.Node]:
    return {u.args[1]: u for u in node.users if u.target is operator.getitem}  # type: ignore[misc]


def _block(sort: fx.Node) -> MoEBlock | str:
    outputs = _getitems(sort)
    if set(outputs) - {0, 1} or 1 not in outputs or 0 not in outputs:
        return "not a sort whose values and permutation are read"
    values, perm = outputs[0], outputs[1]
    ids = sort.args[0]
    assert isinstance(ids, fx.Node)
    if len(sort.args) > 1 or sort.kwargs or len(_shape(ids)) != 1:
        return "not a sort of 1-D expert ids along their only dim"
    slots = _shape(ids)[0]
    routing: list[fx.Node] = [sort, values, perm]
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
    if tokens is None or inverse is None:
        return "its permutation is not read as tokens (perm // k) and inverted"
    for index, gather, scatter in (
        (perm, "dispatch", "combine"),
        (tokens, "dispatch_tokens", "combine_tokens"),
        (inverse, "combine", "dispatch"),
    ):
        for user in index.users:
            if user in routing:
                continue
            kind = _boundary(user, index, gather, scatter)  # type: ignore[arg-type]
            if kind is None:
                return f"{user.name} reads the routing as neither a gather nor a scatter"
            boundaries[user] = kind
            if user.target is aten.index_put.default:
                routing.append(user.args[0])  # type: ignore[arg-type]
    offsets = _offsets(values, routing)
    if isinstance(offsets, str):
        return offsets
    num_experts = _shape(offsets)[0]
    region = _region(boundaries, offsets, set(routing))
    if isinstance(region, str):
        return region
    if not any(is_grouped_product(n.target) for n in region):
        return "no grouped product between its boundaries"
    return MoEBlock(
        sort, ids, num_experts, top_k, offsets, tuple(routing), boundaries, tuple(region)
    )


def _shape(node: object) -> tuple[int, ...]:
    assert isinstance(node, fx.Node)
    return tuple(int(d) for d in ir.require(node, ir.ValueMeta).tensor.shape)


def _is_arange(node: object, size: int) -> bool:
    return isinstance(node, fx.Node) and node.target is aten.arange.default and node.args == (size,)


def _boundary(
    user: fx.Node, index: fx.Node, gather: Boundary, scatter: Boundary
) -> tuple[Boundary, fx.Node] | None:
    """(kind, value moved) of a gather ``v[index]`` or an accumulating scatter
    ``zeros.index_put([index], v, True)``; None for any other use."""
    args = user.args
    if user.target is aten.index.Tensor and args[1] == [index]:
        return gather, args[0]  # type: ignore[return-value]
    if (
        user.target is aten.index_put.default
        and args[1] == [index]
        and len(args) > 3
        and args[3] is True
        and isinstance(args[0], fx.Node)
        and args[0].target in (aten.new_zeros.default, aten.zeros.default)
        and len(args[0].users) == 1
    ):
        return scatter, args[2]  # type: ignore[return-value]
    return None


def _offsets(values: fx.Node, routing: list[fx.Node]) -> fx.Node | str:
    """The offsets ``cumsum(histc(sorted ids))`` (through a cast), added to ``routing``."""
    chain, node = [], values
    while len(node.users) == 1:
        (node,) = node.users
        chain.append(node)
        if node.target is aten.cumsum.default:
            routing += chain
            return node
        if node.target not in (aten._to_copy.default, aten.histc.default):
            break
    return "its sorted ids make no offsets cumsum(histc(ids)) read by nothing else"


def _region(
    boundaries: dict[fx.Node, tuple[Boundary, fx.Node]], offsets: fx.Node, routing: set[fx.Node]
) -> list[fx.Node] | str:
    """The ops fed by the dispatches and the offsets, up to the combines, in graph order."""
    dispatches = [b for b, (kind, _) in boundaries.items() if kind.startswith("dispatch")]
    combines = {b for b, (kind, _) in boundaries.items() if kind.startswith("combine")}
    region: set[fx.Node] = set()
    frontier = [offsets, *dispatches]
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user in region or user in combines or user in routing or user.op == "output":
                continue
            region.add(user)
            frontier.append(user)
    inside = region | {offsets, *dispatches}
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
            if not _is_expert_value(node, offsets):
                return f"{node.name} is read outside the block by {user.name}"
    order = {n: i for i, n in enumerate(offsets.graph.nodes)}
    return sorted(region, key=order.__getitem__)


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
    slots = _shape(block.expert_ids)[0]
    experts = block.num_experts
    data_axes = [a for a, p in enumerate(token_spec) if isinstance(p, Shard) and a != axis]

    def spec_of(node: fx.Node, shape: tuple[int, ...], output: bool) -> Spec:
        per_expert = (len(shape) == 3 and shape[0] == experts) or node is block.offsets
        if slots in shape and not per_expert:
            return _on_dim(token_spec, shape.index(slots))
        if shape and shape[0] == slots // block.top_k and not per_expert:
            return _on_dim(token_spec, 0)  # the tokens, or their gradient
        placements: list[Placement] = [Replicate()] * len(token_spec)
        placements[axis] = Shard(0)
        for a in data_axes if output else ():
            placements[a] = Partial()
        return tuple(placements)

    chosen: dict[fx.Node, Strategy] = {}
    for node in sorted(block.nodes(), key=_position(block)):
        arguments = _tensor_args(node)
        inputs = tuple(_arriving(a, layout) or spec_of(a, _shape(a), False) for a in arguments)
        if node.target is operator.getitem:
            continue
        value = ir.require(node, ir.ValueMeta)
        outputs = tuple(
            None if meta is None else spec_of(node, tuple(int(d) for d in meta.shape), True)
            for meta in value.outputs
        )
        if node in block.boundaries and block.boundaries[node][0] == "dispatch_tokens":
            outputs = (_on_dim(token_spec, 0),)
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


def exchange_seconds(
    graph: fx.Graph, cluster: Cluster, *, chosen: bool = True
) -> dict[fx.Node, float]:
    """What the all-to-all exchanges of ``graph``'s dispatched blocks cost on ``cluster``, by
    the node that runs each: a block's sort exchanges its experts' row counts, and each
    boundary sends the rows of the value it moves to their devices (dispatch) or back
    (combine). Priced under balanced routing: a device sends its piece of the value as the
    boundary reads it, ``(n - 1) / n`` of it to the other devices of the axis
    (:func:`~fxpar.planning.cost.collective_seconds` of an all-to-all on the axis' link). A
    block computed op by op (not dispatched) exchanges nothing. ``chosen``: of the plan
    chosen (the default), or of the one candidate each node of a dispatch plan has before
    the choice (:func:`dispatch_axis`)."""
    seconds: dict[fx.Node, float] = {}
    blocks, _ = find_blocks(graph)
    for block in blocks:
        axis = dispatch_axis(block, chosen=chosen)
        if axis is None:
            continue
        seconds[block.sort] = _all_to_all(block.num_experts * COUNT_BYTES, axis, cluster)
        for node, (_, value) in block.boundaries.items():
            strategy = _planned(node, chosen)
            if strategy is None:
                continue
            spec = strategy.inputs[_tensor_args(node).index(value)]
            meta = ir.require(value, ir.ValueMeta).tensor
            seconds[node] = _all_to_all(piece_bytes(meta, spec, cluster.mesh_shape), axis, cluster)
    return seconds


def _all_to_all(local_bytes: float, axis: int, cluster: Cluster) -> float:
    bandwidth, latency = cluster.link_of("all_to_all", axis)
    return collective_seconds(
        "all_to_all", local_bytes, cluster.mesh_shape[axis], bandwidth, latency
    )
