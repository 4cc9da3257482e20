"""The ways a planner may dispatch a program's mixture-of-experts tokens by all-to-all.

Dispatching a block (:mod:`fxpar.planning.moe_blocks`) is one decision for the whole block:
every node of it takes its dispatch strategy, or none does, and nothing inside it is ever
converted. Per-node candidates cannot say that without constraints linking the block's
nodes, which the plain-data problem has no place for. So the choice is made outside the
problem: a :class:`DispatchVariant` names the mesh axis the experts are split on and the axes
the tokens are split on, every block of the program is dispatched that way in it, and the
planner (:class:`fxpar.passes.SolveStrategies`) solves the problem once per variant, the
blocks' nodes offered only their dispatch strategies (:func:`offer`), beside the problem as
it was, and keeps the cheapest plan (docs/planning.md, "Mixture-of-experts dispatch").

:func:`dispatch_variants` lists the variants a program may take on a cluster: experts on an
axis of more than one device that divides every block's expert count and on which the rules
split every grouped product by expert, the tokens split on the batch over that axis alone, or
over it and every other axis of more than one device (data parallelism beside expert
parallelism), where every spec of every block splits evenly.
:func:`planned_variant` reads the variant a planned program took back from its chosen
strategies (to give a program folded from or loaded from the same plan the same candidates).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch.fx as fx
from torch.distributed.tensor import Replicate, Shard

from fxpar import ir
from fxpar.cluster import Cluster
from fxpar.planning import moe_blocks
from fxpar.planning.moe_blocks import MoEBlock
from fxpar.rules.experts import experts_spec, is_grouped_product
from fxpar.rules.registry import op_call
from fxpar.sharding import Sharding, Spec, Strategies, Strategy, is_valid


@dataclass(frozen=True)
class DispatchVariant:
    """Every MoE block's experts split by expert over mesh axis ``axis`` and its tokens split
    on their rows over ``token_axes`` (which holds ``axis``), each block's rows sent to their
    experts' devices and back by all-to-all on ``axis``."""

    axis: int
    token_axes: tuple[int, ...]

    def token_spec(self, ndim: int) -> Spec:
        return tuple(Shard(0) if a in self.token_axes else Replicate() for a in range(ndim))

    def __str__(self) -> str:
        tokens = ", ".join(map(str, self.token_axes))
        return f"experts on axis {self.axis}, tokens on axes ({tokens})"


def dispatch_variants(blocks: list[MoEBlock], cluster: Cluster) -> list[DispatchVariant]:
    """The variants ``blocks`` may be dispatched in on ``cluster`` (module docstring), in
    order of expert axis, tokens on the expert axis alone first; none without blocks."""
    mesh = cluster.mesh_shape
    found: list[DispatchVariant] = []
    if not blocks:
        return found
    for axis, devices in enumerate(mesh):
        if devices == 1 or any(block.num_experts % devices for block in blocks):
            continue
        if not all(_rules_split_experts(block, axis, mesh) for block in blocks):
            continue
        others = tuple(a for a, n in enumerate(mesh) if a != axis and n > 1)
        for token_axes in ((axis,), tuple(sorted((axis, *others)))):
            variant = DispatchVariant(axis, token_axes)
            if variant not in found and block_strategies(blocks, variant, cluster) is not None:
                found.append(variant)
    return found


def _rules_split_experts(block: MoEBlock, axis: int, mesh: tuple[int, ...]) -> bool:
    """Whether the rules offer every grouped product of ``block`` a split by expert on
    ``axis`` (a registry built without it, ``experts.register(split_experts=False)``, gets
    no dispatch either)."""
    for node in block.region:
        if not is_grouped_product(node.target):
            continue
        call = op_call(node, mesh)
        specs = (experts_spec(call, c) for c in ir.require(node, Strategies).candidates)
        if not any(spec is not None and spec[axis] == Shard(0) for spec in specs):
            return False
    return True


def block_strategies(
    blocks: Iterable[MoEBlock], variant: DispatchVariant, cluster: Cluster
) -> dict[fx.Node, Strategy] | None:
    """Each node of ``blocks`` with its strategy under ``variant``
    (:func:`~fxpar.planning.moe_blocks.dispatch_strategies`); None where some spec would split
    a value unevenly, or a node has no candidates to stand in for (it is not a decision)."""
    mesh = cluster.mesh_shape
    token_spec = variant.token_spec(cluster.ndim)
    chosen: dict[fx.Node, Strategy] = {}
    for block in blocks:
        chosen.update(moe_blocks.dispatch_strategies(block, variant.axis, token_spec, {}))
    for node, strategy in chosen.items():
        if ir.get(node, Strategies) is None:
            return None
        arguments = [a for a in node.all_input_nodes if ir.get(a, ir.ValueMeta) is not None]
        values = [*ir.require(node, ir.ValueMeta).outputs]
        values += [ir.require(a, ir.ValueMeta).outputs[0] for a in arguments]
        specs = [*strategy.outputs, *strategy.inputs]
        for meta, spec in zip(values, specs, strict=True):
            if meta is not None and spec is not None and not is_valid(meta.shape, spec, mesh):
                return None
    return chosen


def pinned_nodes(chosen: Iterable[fx.Node], pins: Mapping[str, Spec]) -> list[str]:
    """The names of the nodes in ``chosen`` a pin pattern matches (a pinned node keeps its
    own candidates, so a variant that would replace them is not offered)."""
    return [n.name for n in chosen if any(fnmatch.fnmatchcase(n.name, p) for p in pins)]


Offered = dict[fx.Node, Strategies]
"""What :func:`offer` replaced: each node's candidates before."""


def offer(chosen: Mapping[fx.Node, Strategy], cluster: Cluster) -> Offered:
    """Give each node of ``chosen`` its strategy there as its only candidate (as
    ``plans.expert_parallel(dispatch="all_to_all")`` does); returns the candidates replaced,
    for :func:`restore`."""
    replaced: Offered = {}
    for node, strategy in chosen.items():
        replaced[node] = ir.require(node, Strategies)
        ir.annotate(node, Strategies(cluster.mesh_shape, (strategy,)))
    return replaced


def restore(replaced: Offered) -> None:
    """Give back the candidates :func:`offer` replaced."""
    for node, strategies in replaced.items():
        ir.annotate(node, strategies)


def planned_variant(blocks: Iterable[MoEBlock]) -> DispatchVariant | None:
    """The variant a planned program's ``blocks`` were dispatched in, read from their chosen
    strategies (the expert axis by :func:`~fxpar.planning.moe_blocks.dispatch_axis`, the
    token axes by the sort's input); None where its blocks are computed op by op."""
    for block in blocks:
        axis = moe_blocks.dispatch_axis(block)
        if axis is None:
            continue
        spec = ir.require(block.sort, Sharding).strategy.inputs[0]
        assert spec is not None
        return DispatchVariant(axis, tuple(a for a, p in enumerate(spec) if isinstance(p, Shard)))
    return None


def variants_with_tokens(token_spec: Spec) -> list[DispatchVariant]:
    """The variants whose tokens are split as ``token_spec`` (a plan file's sort input says
    how, not which of those axes holds the experts): one per axis it splits."""
    axes = tuple(a for a, p in enumerate(token_spec) if isinstance(p, Shard))
    return [DispatchVariant(axis, axes) for axis in axes]
