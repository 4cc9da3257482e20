"""The cost and memory model: seconds and bytes of strategies, reshardings and values on a Cluster.

The ILP problem builder (:mod:`fxpar.planning.problem`), the plan report
(:mod:`fxpar.planning.report`), manual-plan scoring and the stage DP (:mod:`fxpar.pipeline.auto`)
all price work and memory here, so that they never disagree on what a plan costs.

**Time.**

- A collective on mesh axis ``a`` of ``n`` devices moving a local tensor of ``B`` bytes costs
  the axis latency ``α`` plus its bytes over the axis bandwidth ``β``: all-reduce
  ``α + 2(n−1)/n·B/β``, all-gather ``α + (n−1)·B/β`` (it receives ``n−1`` pieces of ``B``),
  reduce-scatter and all-to-all ``α + (n−1)/n·B/β``. Local slices are free. A resharding costs
  the sum of its steps (:func:`fxpar.sharding.reshard.reshard_steps`).
- A node's compute time is a roofline, ``max(flops / F, bytes / memory_bandwidth)``
  (:func:`roofline_seconds`). Under a strategy the node's FLOPs and bytes are divided by the
  devices of every mesh axis on which the strategy splits it (an axis where any input or output
  is sharded, or an output is partial); replicated work is done in full. On a cluster with
  per-op speeds (:func:`fxpar.calibrate_ops`) an ATen op then takes its overhead plus its
  slowdown times that (:meth:`fxpar.Cluster.op_seconds`).
- Outside the graph, a step runs the optimizer's update of every trainable parameter's piece
  (:func:`update_seconds`: the elementwise passes of fxpar's SGD or AdamW, each an ATen op
  priced as above) and the lowering packs each bucket of gradients, and each gathered group of
  parameters, into one buffer (:func:`copy_seconds`).

**Memory.**

- A value costs each device the bytes of its local piece (:func:`local_bytes`).
- A parameter costs its piece, its gradient's and ``optimizer_states`` more of the same size
  (:func:`parameter_memory`); a buffer, frozen parameter or batch tensor one piece.
- Activations: the values the backward reads from the forward (:func:`saved_for_backward`), each
  counted once at the storage that holds it. A view (a transpose, a reshape) holds no memory of
  its own: a backward read of it keeps its base alive, so the base is counted, once however many
  views of it are read, and a view of a parameter adds nothing to the parameter. A ``getitem``
  owns its element of a tuple, so only the elements read are counted.

**Layers.** A module path sits in a *numbered layer* when one of its components is an index
(``blocks.3.attn`` in ``blocks.3``, ``transformer.h.0.mlp`` in ``transformer.h.0``, ``2`` in a
model that is itself a Sequential): :func:`numbered_layer`. The container with the most numbered
children holds the model's repeated layers (:func:`repeated_layers`).
"""

from __future__ import annotations

import functools
import math
import operator
from collections import defaultdict
from collections.abc import Collection, Iterable, Sequence
from dataclasses import replace
from typing import Literal

import torch.fx as fx
from torch.distributed.tensor import Shard

from fxpar import ir
from fxpar.cluster import Cluster
from fxpar.ir.meta import numbered_layer
from fxpar.sharding import Spec, Strategy, local_shape, piece_bytes
from fxpar.sharding.reshard import (
    Code,
    bucket_route_of,
    coded_steps,
    gather_route_of,
    spec_code,
)

# -- time ---------------------------------------------------------------------------------------


def collective_share(kind: str, devices: int) -> float:
    """Bytes each device moves in one collective step, per byte of its local piece."""
    if devices <= 1 or kind in ("slice", "to_partial"):
        return 0.0
    if kind == "send":  # point to point: the piece crosses once
        return 1.0
    if kind == "all_reduce":
        return 2 * (devices - 1) / devices
    if kind == "all_gather":
        return devices - 1
    return (devices - 1) / devices  # reduce_scatter, all_to_all, all_to_all_rows


def collective_seconds(kind: str, local_bytes: float, devices: int, bandwidth: float,
                       latency: float) -> float:  # fmt: skip
    """Alpha-beta time of one collective step (0 for local steps)."""
    share = collective_share(kind, devices)
    return 0.0 if share == 0.0 else latency + share * local_bytes / bandwidth


Price = Literal["", "output", "regathered"]
"""How a resharding is priced: as :func:`reshard_seconds`, :func:`output_seconds` or
:func:`regathered_seconds`."""


LINK_OF = {"all_to_all_rows": "all_to_all"}
"""Collectives priced on another kind's links: a variable-size all-to-all (a mixture-of-experts
block's dispatch or combine, :mod:`fxpar.planning.moe_blocks`) travels as an all-to-all."""


def link_seconds(kind: str, local_bytes: float, axis: int, cluster: Cluster) -> float:
    """Time of one collective step of ``kind`` on mesh axis ``axis`` of ``cluster``: the lowest
    of its lines (:meth:`~fxpar.cluster.Cluster.lines_of`, of :data:`LINK_OF`'s kind where it
    names one) at ``local_bytes``."""
    devices = cluster.mesh_shape[axis]
    return min(
        collective_seconds(kind, local_bytes, devices, bandwidth, latency)
        for bandwidth, latency in cluster.lines_of(LINK_OF.get(kind, kind), axis)
    )


Terms = tuple[tuple[float, float], ...]
"""A resharding's price lines, ``(seconds, seconds per byte)``: a tensor of ``B`` bytes pays the
lowest ``seconds + B * per_byte`` of them."""


@functools.lru_cache(maxsize=1 << 18)
def reshard_terms(src: Code, dst: Code, cluster: Cluster, price: Price = "") -> Terms:
    """The price of a resharding from ``src`` to ``dst`` (spec codes,
    :func:`fxpar.sharding.reshard.spec_code`) as lines ``(seconds, seconds per byte)``: its
    collectives' latencies, and the time per byte of the whole tensor (every step moves a
    fixed fraction of it); a tensor pays the lowest line at its bytes. Where a collective has
    several lines (:meth:`~fxpar.cluster.Cluster.lines_of`), each choice of one line per step
    gives a line of the resharding, so the lowest of them is the sum of each step's lowest.
    One pair of specs thus has one price for tensors of every size: the ILP's builder prices
    a pair once for all its tensors."""
    if src == dst:
        return ((0.0, 0.0),)
    mesh = cluster.mesh_shape
    steps = coded_steps(src, dst, mesh)
    route = bucket_route_of(steps) if price == "output" else None
    if route is not None:  # buckets are large: each axis' flattest line
        per_byte = sum(
            collective_share(route.kind, mesh[a])
            / max(bandwidth for bandwidth, _ in cluster.lines_of(route.kind, a))
            for a in route.axes
        )
        return ((0.0, per_byte / _pieces(src, mesh)),)
    lines = [(0.0, 0.0)]
    current = list(src)
    for step in steps:
        share = collective_share(step.kind, mesh[step.axis])
        if share:
            pieces = _pieces(current, mesh)
            lines = _lowest([
                (seconds + latency, per_byte + share / (pieces * bandwidth))
                for seconds, per_byte in lines
                for bandwidth, latency in cluster.lines_of(step.kind, step.axis)
            ])  # fmt: skip
        current[step.axis] = step.code_after
    if price == "regathered" and gather_route_of(steps) is not None:
        return tuple((2 * seconds, 2 * per_byte) for seconds, per_byte in lines)
    return tuple(lines)


def _lowest(lines: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """``lines`` less those no lower than another at every size (their seconds and per-byte
    both at least another's), by seconds."""
    kept: list[tuple[float, float]] = []
    for line in sorted(set(lines)):
        if not kept or line[1] < kept[-1][1]:
            kept.append(line)
    return kept


def _pieces(code: Sequence[int], mesh_shape: Sequence[int]) -> int:
    """Into how many pieces a spec of ``code`` cuts a tensor."""
    return math.prod(size for c, size in zip(code, mesh_shape, strict=True) if c >= 0)


@functools.lru_cache(maxsize=1 << 20)
def reshard_seconds(
    src: Spec, dst: Spec, meta: ir.TensorMeta, cluster: Cluster, price: Price = ""
) -> float:
    """Time to turn a tensor laid out as ``src`` into ``dst``."""
    if src == dst:
        return 0.0
    shape = tuple(ir.evaluate(s) for s in meta.shape)
    local_shape(shape, src, cluster.mesh_shape)  # raises unless ``src`` splits it evenly
    nbytes = math.prod(shape) * meta.dtype.itemsize
    terms = reshard_terms(spec_code(src), spec_code(dst), cluster, price)
    return min(seconds + per_byte * nbytes for seconds, per_byte in terms)


def output_seconds(src: Spec, dst: Spec, meta: ir.TensorMeta, cluster: Cluster) -> float:
    """Time to turn a result of the step (loss, gradient, buffer update) laid out as ``src``
    into ``dst``, its output layout. As :func:`reshard_seconds`, except for a result that takes
    only reductions (all-reduces, or one reduce-scatter: :func:`bucket_route`): the lowering
    sends those together, in buckets of up to 25 MiB per route
    (:data:`fxpar.planning.grouping.BUCKET_BYTES`), so each pays the time of its bytes but not a
    collective's latency (the one latency per bucket is left out)."""
    return reshard_seconds(src, dst, meta, cluster, "output")


def regathered_seconds(src: Spec, dst: Spec, meta: ir.TensorMeta, cluster: Cluster) -> float:
    """Time to turn a parameter laid out as ``src`` into ``dst`` for a forward view that the
    backward reads too (``t(weight)``): as :func:`reshard_seconds`, twice when it takes
    all-gathers only (:func:`gather_route`), since the backward gathers the parameter again
    and recomputes the view rather than keep the forward's gathered copy
    (:class:`fxpar.planning.grouping.ViewChain`)."""
    return reshard_seconds(src, dst, meta, cluster, "regathered")


def split_factor(strategy: Strategy, mesh_shape: tuple[int, ...]) -> int:
    """How many devices share the node's work under ``strategy``: the size of every mesh axis
    on which some input or output is split. An axis on which values are only replicated or
    partial shares nothing: a linear op given a Partial input (and the other replicated) makes
    a Partial output from a whole-sized product on every device, not a piece of one."""
    factor = 1
    for axis, size in enumerate(mesh_shape):
        placements = [s[axis] for s in (*strategy.inputs, *strategy.outputs) if s is not None]
        if any(isinstance(p, Shard) for p in placements):
            factor *= size
    return factor


def roofline_seconds(cost: ir.Cost, cluster: Cluster, share: int = 1) -> float:
    """The time of ``1 / share`` of a node's work on one device of ``cluster``: its roofline,
    and for a node that calls an ATen op (``cost.op``) that op's measured slowdown and
    overhead (:meth:`~fxpar.Cluster.op_seconds`)."""
    flops = ir.evaluate(cost.flops) / share
    moved = (ir.evaluate(cost.bytes_read) + ir.evaluate(cost.bytes_written)) / share
    roofline = max(flops / cluster.flops, moved / cluster.memory_bandwidth)
    return cluster.op_seconds(cost.op, roofline) if cost.op else roofline


def call_seconds(cost: ir.Cost, cluster: Cluster) -> float:
    """The part of :func:`roofline_seconds` a node pays whatever its share of the work: its
    op's overhead and fixed cost a call (:meth:`~fxpar.Cluster.call_seconds`); 0 for a node
    that calls no op."""
    if not cost.op:
        return 0.0
    return cluster.call_seconds(cost.op, roofline_seconds(replace(cost, op=""), cluster))


def compute_seconds(cost: ir.Cost, strategy: Strategy, cluster: Cluster) -> float:
    """The roofline time of a node's share of work under ``strategy``."""
    return roofline_seconds(cost, cluster, split_factor(strategy, cluster.mesh_shape))


def node_seconds(node: fx.Node, cluster: Cluster) -> float:
    """The roofline time of all of ``node``'s work on one device (0 for a node without a Cost:
    a placeholder or the output)."""
    cost = ir.get(node, ir.Cost)
    return 0.0 if cost is None else roofline_seconds(cost, cluster)


# -- bytes --------------------------------------------------------------------------------------


def local_bytes(meta: ir.TensorMeta, spec: Spec, cluster: Cluster) -> int:
    """Bytes of one device's piece of a tensor."""
    return piece_bytes(meta, spec, cluster.mesh_shape)


def value_bytes(value: ir.ValueMeta, specs: Sequence[Spec | None], cluster: Cluster) -> int:
    """Bytes of one device's pieces of every tensor a node produces, laid out as ``specs``."""
    return sum(
        local_bytes(meta, spec, cluster)
        for meta, spec in zip(value.outputs, specs, strict=True)
        if meta is not None and spec is not None
    )


UPDATE_PASSES: dict[int, tuple[tuple[str, int, int], ...]] = {
    # p.add_(g, alpha=-lr)
    0: (("aten.add", 2, 1),),
    # buf.mul_(momentum).add_(g); p.add_(buf, alpha=-lr)
    1: (("aten.mul", 1, 1), ("aten.add", 2, 1), ("aten.add", 2, 1)),
    # p.mul_(1 - lr wd); m.lerp_(g); v.mul_(b2).addcmul_(g, g); d = (v.sqrt() / c).add_(eps);
    # p.addcdiv_(m, d)
    2: (
        ("aten.mul", 1, 1), ("aten.lerp", 2, 1), ("aten.mul", 1, 1), ("aten.addcmul", 2, 1),
        ("aten.sqrt", 1, 1), ("aten.div", 1, 1), ("aten.add", 1, 1), ("aten.addcdiv", 3, 1),
    ),
}  # fmt: skip
"""The elementwise passes of an optimizer update by its count of state tensors, as torch.optim
runs fxpar's optimizers one parameter at a time (:mod:`fxpar.optim`: SGD without and with
momentum, AdamW): per pass, its ATen op and how many parameter-sized tensors it reads and
writes. An optimizer of more states is priced as AdamW plus one pass per further state."""


def update_seconds(nbytes: float, optimizer_states: int, cluster: Cluster) -> float:
    """The optimizer update of a trainable parameter whose piece on a device holds ``nbytes``:
    each of its :data:`UPDATE_PASSES` an ATen call (its overhead) moving its tensors' bytes at
    the op's speed on ``cluster`` (:meth:`fxpar.Cluster.op_seconds`)."""
    passes = UPDATE_PASSES[min(optimizer_states, 2)]
    passes += (("aten.mul", 1, 1),) * max(optimizer_states - 2, 0)
    moved = nbytes / cluster.memory_bandwidth
    return sum(cluster.op_seconds(op, (reads + writes) * moved) for op, reads, writes in passes)


def accumulate_seconds(nbytes: float, cluster: Cluster) -> float:
    """Adding one micro-batch's gradient of a trainable parameter whose piece on a device holds
    ``nbytes`` to the running sum a pipeline stage keeps (the runtime's ``add_``, ``M - 1`` a
    step): one ``aten.add`` reading two gradients and writing one."""
    return cluster.op_seconds("aten.add", 3 * nbytes / cluster.memory_bandwidth)


def copy_seconds(nbytes: float, cluster: Cluster) -> float:
    """One copy that reads ``nbytes`` and writes as many (the lowering packing a bucket's
    tensors into one buffer, or cutting a gathered buffer back into its tensors), at the speed
    of ``aten.cat``, which packs them: a model's own fitted ``aten.copy`` or ``aten.clone`` is
    often its small or strided copies' (18x the roofline on HF T5)."""
    return cluster.op_seconds("aten.cat", 2 * nbytes / cluster.memory_bandwidth)


def parameter_memory(nbytes: float, trainable: bool, optimizer_states: int) -> dict[str, float]:
    """Bytes a parameter (or buffer, or batch tensor) of ``nbytes`` per device keeps: itself and,
    when trainable, its gradient and ``optimizer_states`` tensors of the optimizer's."""
    if not trainable:
        return {"params": nbytes, "grads": 0.0, "optimizer": 0.0}
    return {"params": nbytes, "grads": nbytes, "optimizer": optimizer_states * nbytes}


# -- saved activations --------------------------------------------------------------------------


def moves_no_data(node: fx.Node) -> bool:
    """True for a view: an op that computes and writes nothing (by its Cost)."""
    cost = ir.get(node, ir.Cost)
    return cost is not None and ir.evaluate(cost.bytes_written) == ir.evaluate(cost.flops) == 0


def storage(node: fx.Node) -> fx.Node:
    """The node that owns ``node``'s memory: itself, or the base of the view it is. A
    ``getitem`` owns its element of the tuple it reads."""
    while (
        node.op == "call_function"
        and node.target is not operator.getitem
        and isinstance(node.args[0] if node.args else None, fx.Node)
        and moves_no_data(node)
    ):
        base = node.args[0]
        assert isinstance(base, fx.Node)
        node = base
    return node


def saved_for_backward(nodes: Iterable[fx.Node]) -> set[fx.Node]:
    """The storage (:func:`storage`) of every value that a backward node among ``nodes`` reads
    and that the forward pass or the step's inputs produced: forward values (a ``getitem``
    standing for its element of a tuple) and placeholders. Placeholders are included (the batch
    is an activation to a pipeline stage); the memory model of a whole step counts them as
    parameters and inputs instead."""
    saved: set[fx.Node] = set()
    for node in nodes:
        region = ir.get(node, ir.Region)
        if region is None or region.phase is not ir.Phase.BACKWARD:
            continue
        for value in node.all_input_nodes:
            base = storage(value)
            if base.op == "placeholder":
                saved.add(base)
                continue
            produced = ir.get(base, ir.Region)
            if produced is not None and produced.phase is ir.Phase.FORWARD:
                saved.add(base)
    return saved


def saved_outputs(nodes: Iterable[fx.Node]) -> dict[fx.Node, frozenset[int]]:
    """:func:`saved_for_backward` as the ops producing the saved values, each with the indices
    of its saved outputs. Placeholders are left out: a whole step's memory counts them as
    parameters and inputs."""
    saved: defaultdict[fx.Node, set[int]] = defaultdict(set)
    for value in saved_for_backward(nodes):
        if value.op == "placeholder":
            continue
        if value.target is operator.getitem:
            source, index = value.args
            assert isinstance(source, fx.Node) and isinstance(index, int)
            saved[source].add(index)
        else:
            saved[value].add(0)
    return {node: frozenset(indices) for node, indices in saved.items()}


def saved_bytes(
    value: ir.ValueMeta, specs: Sequence[Spec | None], outputs: Collection[int], cluster: Cluster
) -> int:
    """Bytes per device of the ``outputs`` (indices) of a node that the backward keeps."""
    kept = [spec if index in outputs else None for index, spec in enumerate(specs)]
    return value_bytes(value, kept, cluster)


# -- layers -------------------------------------------------------------------------------------


def repeated_layers(modules: Iterable[str]) -> tuple[str, list[str]] | None:
    """The container with the most numbered layers among ``modules`` and its layers, in the
    order ``modules`` first name them (on a tie, the container named first); None without
    numbered layers."""
    containers: dict[str, list[str]] = {}
    for module in modules:
        layer = numbered_layer(module)
        if layer is not None:
            names = containers.setdefault(layer.container, [])
            if layer.name not in names:
                names.append(layer.name)
    if not containers:
        return None
    container = max(containers, key=lambda c: len(containers[c]))
    return container, containers[container]
