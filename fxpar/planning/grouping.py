"""Which collectives of a planned graph travel together, and when they start.

- :func:`cut_buckets`: results of the step that take only reductions (data parallelism's
  gradient sums, fully sharded gradients' reduce-scatters) go in flat buckets, in the order the
  backward computes them, each started as soon as its last value exists;
- :func:`gather_groups`: the placeholders a layer needs gathered (a fully sharded layer's
  parameters) go in one all-gather per layer and phase, the next group prefetched;
- :class:`ViewChain`: a backward op that reads a forward view of a gathered parameter
  (``t(weight)``) reads it recomputed from the backward's own gather instead, so the forward's
  gathered copy is freed after the forward (ZeRO-3's memory).

A gathered "parameter" is a placeholder, or under mixed precision its cast to the compute dtype
made where the parameter is stored (:func:`gather_sources`): that cast's pieces are what
travels, in the compute dtype, grouped and re-gathered per phase as the placeholder would be.

All of it depends on the graph's global shapes and chosen specs only, so every rank makes the
same choices and runs the same collectives. :mod:`fxpar.planning.collective_schedule` puts these
choices into the one schedule that the lowering emits and the plan report and stage DP count.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx

from fxpar import ir
from fxpar.rules.registry import tensor_inputs
from fxpar.sharding import Sharding, Spec, piece_bytes
from fxpar.sharding.reshard import BucketRoute, gather_route, reshard_steps

aten = torch.ops.aten

BUCKET_BYTES = 25 * 2**20
"""How many bytes of a device's outputs one bucketed all-reduce packs at most (as DDP's
default bucket)."""


def needs_strategy(node: fx.Node) -> bool:
    """Whether ``node`` is an op that takes a strategy (a call with tensor outputs)."""
    if node.op != "call_function" or node.target is operator.getitem:
        return False
    return bool(ir.require(node, ir.ValueMeta).tensors)


@dataclass(frozen=True)
class Gathered:
    """A placeholder gathered in a group: its wanted spec, the tensor dim gathered and its
    bytes on each device before the gather."""

    source: fx.Node
    spec: Spec
    dim: int
    nbytes: int


@dataclass(frozen=True)
class GatherGroup:
    """Placeholders (a fully sharded layer's parameters) that one phase's ops of one layer
    need gathered over the same mesh axes: they are gathered with ONE all-gather per axis,
    started while the layer before computes (prefetch), as FSDP gathers a flat parameter."""

    index: int
    """Its place among the groups, in the order the program first needs them."""
    phase: ir.Phase
    axes: tuple[int, ...]
    """Gathered in this order, innermost first (so the outermost axis ends outermost)."""
    members: tuple[Gathered, ...]

    @property
    def nbytes(self) -> int:
        """Bytes each device contributes to the first all-gather."""
        return sum(member.nbytes for member in self.members)

    def sends(self, mesh: Sequence[int]) -> list[tuple[int, int]]:
        """(mesh axis, bytes each device contributes) of each of its all-gathers, in order:
        each gathers what the ones before it made."""
        sends, nbytes = [], self.nbytes
        for axis in self.axes:
            sends.append((axis, nbytes))
            nbytes *= mesh[axis]
        return sends


GatherKey = tuple[fx.Node, Spec, ir.Phase]
"""A conversion of a placeholder: to which spec, in which phase (the schedule's reuse key)."""


@dataclass(frozen=True)
class ViewChain:
    """A forward view of a placeholder (``t(weight)``, ``weight.to(bf16)``) read by a backward
    op: the placeholder, the spec the first view reads it in (all-gathers away from its own:
    :func:`fxpar.sharding.reshard.gather_route`), and the views in order."""

    source: fx.Node
    spec: Spec
    views: tuple[fx.Node, ...]


_VIEW_OPS = frozenset({
    aten.t.default, aten.transpose.int, aten.permute.default, aten.view.default,
    aten._unsafe_view.default, aten.reshape.default, aten.expand.default,
    aten.unsqueeze.default, aten.squeeze.dim, aten.alias.default, aten.detach.default,
    aten._to_copy.default,
})  # fmt: skip
"""Ops cheap to recompute from a parameter (views, and the cast of mixed precision)."""


@dataclass(frozen=True)
class Gathers:
    """What :func:`gather_groups` finds."""

    groups: list[GatherGroup]
    """In the order the program first needs them."""
    group_of: dict[GatherKey, GatherGroup]
    """The group of each placeholder conversion that is all-gathers only."""
    chains: dict[tuple[fx.Node, Spec], ViewChain]
    """Each (forward view, spec) a backward op reads that is recomputed from the backward's
    own gather of its placeholder."""
    sources: Mapping[fx.Node, Spec]
    """The values gathered like parameters, and their specs (:func:`gather_sources`)."""


def gather_sources(
    graph: fx.Graph, placeholder_specs: Mapping[fx.Node, Spec]
) -> dict[fx.Node, Spec]:
    """The values a program gathers as parameters, with their specs: its placeholders, and
    each cast of a parameter to the compute dtype (:func:`casts_parameter`) made in the
    placeholder's own layout."""
    sources = dict(placeholder_specs)
    for node in graph.nodes:
        if not casts_parameter(node):
            continue
        spec = placeholder_specs.get(tensor_inputs(node)[0])
        strategy = ir.require(node, Sharding).strategy
        if spec is not None and strategy.inputs == (spec,) and strategy.outputs == (spec,):
            sources[node] = spec
    return sources


def holds_parameter(node: fx.Node) -> bool:
    """Whether ``node``'s value is gathered as a parameter: a placeholder, or mixed
    precision's cast of one (:func:`casts_parameter`). Such a value a forward view reads for
    the backward too is gathered again there (:func:`reread_in_backward`), and it is never a
    conversion several readers share (:mod:`fxpar.planning.shared_reads`)."""
    return node.op == "placeholder" or casts_parameter(node)


def casts_parameter(node: fx.Node) -> bool:
    """Whether ``node`` is mixed precision's cast of a placeholder to the compute dtype."""
    cast = ir.get(node, ir.PrecisionCast) if node.op == "call_function" else None
    if cast is None or cast.role is not ir.CastRole.PARAMETER:
        return False
    inputs = tensor_inputs(node)
    return len(inputs) == 1 and inputs[0].op == "placeholder"


def gather_groups(
    graph: fx.Graph, placeholder_specs: Mapping[fx.Node, Spec], mesh: tuple[int, ...]
) -> Gathers:
    """The groups of placeholder gathers of ``graph``: every conversion of a placeholder that
    is all-gathers of one dim (:func:`fxpar.sharding.reshard.gather_route`) joins the group
    of its first consumer's phase, numbered layer (:func:`fxpar.ir.meta.numbered_layer`;
    modules outside layers share one group), mesh axes and dtype. A backward op reading a
    forward view of such a placeholder (see :class:`ViewChain`) counts as reading the
    placeholder: the backward gathers it again and recomputes the view, so no gathered copy
    lives from the forward to the backward."""
    sources = gather_sources(graph, placeholder_specs)
    chains = _view_chains(graph, sources, mesh)
    GroupKey = tuple[ir.Phase, str, tuple[int, ...], torch.dtype]
    found: dict[GroupKey, list[Gathered]] = {}
    member_of: dict[GatherKey, GroupKey] = {}
    for node in graph.nodes:
        if not needs_strategy(node):
            continue
        region = ir.require(node, ir.Region)
        inputs = ir.require(node, Sharding).strategy.inputs
        for source, want in zip(tensor_inputs(node), inputs, strict=False):
            chain = chains.get((source, want)) if region.phase is ir.Phase.BACKWARD else None
            if chain is not None:
                source, want = chain.source, chain.spec
            have = sources.get(source)
            if have is None or want is None:
                continue
            key = (source, want, region.phase)
            axes = gather_route(have, want, mesh) if key not in member_of else None
            if axes is None:
                continue
            dim = reshard_steps(have, want, mesh)[0].dim
            assert dim is not None
            meta = ir.require(source, ir.ValueMeta).tensor
            layer = ir.numbered_layer(region.module)
            group = (region.phase, layer.name if layer else "", axes, meta.dtype)
            nbytes = piece_bytes(meta, have, mesh)
            found.setdefault(group, []).append(Gathered(source, want, dim, nbytes))
            member_of[key] = group
    groups = {
        (phase, layer, axes, dtype): GatherGroup(index, phase, axes, tuple(members))
        for index, ((phase, layer, axes, dtype), members) in enumerate(found.items())
    }
    group_of = {key: groups[group] for key, group in member_of.items()}
    return Gathers(list(groups.values()), group_of, chains, sources)


def _view_chains(
    graph: fx.Graph, sources: Mapping[fx.Node, Spec], mesh: tuple[int, ...]
) -> dict[tuple[fx.Node, Spec], ViewChain]:
    """Each forward view of a gather source that a backward op reads in the view's own spec,
    where the source reaches the first view by all-gathers and the views need no conversion
    between them."""
    chains: dict[fx.Node, ViewChain | None] = {}

    def chain_of(node: fx.Node) -> ViewChain | None:
        if node not in chains:
            chains[node] = _extend(node, chain_of, sources, mesh)
        return chains[node]

    found: dict[tuple[fx.Node, Spec], ViewChain] = {}
    for node in graph.nodes:
        if not needs_strategy(node) or ir.require(node, ir.Region).phase is not ir.Phase.BACKWARD:
            continue
        inputs = ir.require(node, Sharding).strategy.inputs
        for source, want in zip(tensor_inputs(node), inputs, strict=False):
            chain = chain_of(source) if want is not None else None
            if chain is not None and _output_spec(source) == want:
                found[(source, want)] = chain
    return found


def _extend(
    node: fx.Node,
    chain_of: Callable[[fx.Node], ViewChain | None],
    sources: Mapping[fx.Node, Spec],
    mesh: tuple[int, ...],
) -> ViewChain | None:
    """The chain ending at ``node``, if it is a forward view of a gather source (or of such a
    view) with nothing converted on the way."""
    if node.op != "call_function" or node.target not in _VIEW_OPS:
        return None
    sharding = ir.get(node, Sharding)
    inputs = tensor_inputs(node)
    if ir.require(node, ir.Region).phase is not ir.Phase.FORWARD or sharding is None:
        return None
    if len(inputs) != 1 or len(sharding.strategy.inputs) != 1:
        return None
    (source,), (want,) = inputs, sharding.strategy.inputs
    if want is None:
        return None
    if source in sources:
        if gather_route(sources[source], want, mesh) is None:
            return None
        return ViewChain(source, want, (node,))
    before = chain_of(source)
    if before is None or _output_spec(source) != want:
        return None
    return ViewChain(before.source, before.spec, (*before.views, node))


def reread_in_backward(node: fx.Node) -> bool:
    """Whether ``node`` is a forward view (of the kinds a :class:`ViewChain` recomputes)
    whose value a backward op reads, directly or through further forward views: where it
    views a gathered parameter, the backward gathers that parameter again."""
    if node.op != "call_function" or node.target not in _VIEW_OPS:
        return False
    if ir.require(node, ir.Region).phase is not ir.Phase.FORWARD:
        return False
    for user in node.users:
        region = ir.get(user, ir.Region)
        if (region is not None and region.phase is ir.Phase.BACKWARD) or reread_in_backward(user):
            return True
    return False


def _output_spec(node: fx.Node) -> Spec | None:
    if node.op != "call_function" or node.target is operator.getitem:
        return None
    sharding = ir.get(node, Sharding)
    return sharding.strategy.outputs[0] if sharding is not None else None


@dataclass(frozen=True)
class Bucketed:
    """A result of the step that leaves in a bucket: its position among the outputs, its
    value, how it travels and its bytes on each device."""

    index: int
    source: fx.Node
    route: BucketRoute
    dtype: torch.dtype
    nbytes: int

    @staticmethod
    def of(
        index: int, source: fx.Node, current: Spec, route: BucketRoute, mesh: tuple[int, ...]
    ) -> Bucketed:
        meta = ir.require(source, ir.ValueMeta).tensor
        return Bucketed(index, source, route, meta.dtype, piece_bytes(meta, current, mesh))


FIRST_BUCKET_BYTES = 2**20
"""The first bucket of each route is small (as DDP's), so that communication starts early in
the backward instead of after 25 MiB of gradients."""


def cut_buckets(
    members: Sequence[Bucketed], order: Mapping[fx.Node, int], limit: int
) -> list[list[Bucketed]]:
    """``members`` in buckets: one route and dtype per bucket, values in the order the program
    computes them (``order``: each source node's position), at most ``limit`` bytes each
    (:data:`FIRST_BUCKET_BYTES` for a route's first; a larger value alone). Buckets come in the
    order they can start (by their last value). The cut depends on global shapes and specs
    only, so every rank makes the same buckets and runs the same collectives."""
    groups: dict[tuple[object, ...], list[Bucketed]] = {}
    for member in members:
        groups.setdefault((*member.route.key, member.dtype), []).append(member)
    cut: list[list[Bucketed]] = []
    for group in groups.values():
        ordered = sorted(group, key=lambda m: order[m.source])
        sizes = [m.nbytes for m in ordered]
        for positions in buckets(sizes, limit, first=min(limit, FIRST_BUCKET_BYTES)):
            cut.append([ordered[p] for p in positions])
    return sorted(cut, key=lambda bucket: order[bucket[-1].source])


def buckets(sizes: Sequence[int], limit: int, first: int | None = None) -> list[list[int]]:
    """The positions of values of ``sizes`` bytes per device, in order, cut into runs of at
    most ``limit`` bytes (``first`` for the first run; a larger value alone)."""
    cut: list[list[int]] = []
    total = 0
    for position, size in enumerate(sizes):
        cap = limit if len(cut) > 1 or first is None else first
        if not cut or total + size > cap:
            cut.append([])
            total = 0
        cut[-1].append(position)
        total += size
    return cut
