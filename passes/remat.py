"""Rematerialization: forward values the backward reads are recomputed there instead of kept.

A *remat region* is a set of forward ops: one numbered layer (``blocks.3``, see
:func:`fxpar.ir.numbered_layer`) chosen by the policy, or one call of
``torch.utils.checkpoint`` in the model (:class:`fxpar.ir.Checkpointed`, always honoured). For
each region:

- its *outputs* (values a forward op outside the region, or the step's result, reads) are kept
  as they are: the next layer holds them anyway;
- every other value of the region that a backward op reads is recomputed by a copy of the ops
  that produce it from the region's inputs (parameters, random inputs, the previous layer's
  output), placed just before the first backward op that reads any of them, and the backward
  reads the copy. The originals are then read by the forward only, so they die as soon as the
  forward is done with them.

The copies are ordinary backward nodes of the region's module (:class:`fxpar.ir.Region`), with
the annotations of the op they repeat, so costs, strategies, the memory model
(:func:`fxpar.planning.cost.saved_for_backward`), pipeline partitions and the lowering treat them
like any other op: the cost model sees the extra FLOPs, the memory model no longer counts the
recomputed values as saved. Random draws are inputs of the Program (:mod:`fxpar.ir.rng`), so a
copy reads the very numbers its original read and recomputation is exact.

Policies (:attr:`fxpar.planning.problem.PlanOptions.remat`): ``"none"`` (only the model's own
checkpoints), ``"all"`` (every numbered layer), a tuple of fnmatch patterns of layer names
(``("blocks.*",)``, ``("transformer.h.0",)``), or ``"auto"``, which this pass treats as
``"none"``: the ``choose-strategies`` pass chooses the layers with the sharding, by pricing a
few counts of recomputed layers each with its own solved plan
(:class:`fxpar.passes.choose_strategies.SolveStrategies`).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import torch.fx as fx

from fxpar import ir
from fxpar.errors import FxparError
from fxpar.ir.meta import Rematerialized
from fxpar.ir.program import Program
from fxpar.passes.base import Pass
from fxpar.planning.cost import saved_outputs
from fxpar.planning.problem import RematPolicy, check_remat_policy


@dataclass(frozen=True)
class Rematerialize(Pass):
    """Recompute the chosen layers and the model's checkpointed calls in the backward (module
    docstring); ``layers`` is a remat policy, as :attr:`PlanOptions.remat`."""

    name = "rematerialize"
    layers: RematPolicy = field(default="none")

    def __post_init__(self) -> None:
        check_remat_policy(self.layers)

    def run(self, program: Program) -> Program:
        return recompute_in_backward(program, select_layers(program, self.layers))


def remat_layers(program: Program) -> list[str]:
    """The numbered layers with forward ops, in forward order: what a policy chooses among."""
    layers: dict[str, None] = {}
    for node in program.nodes(ir.Phase.FORWARD):
        layer = ir.numbered_layer(ir.require(node, ir.Region).module)
        if layer is not None and node.op == "call_function":
            layers.setdefault(layer.name)
    return list(layers)


def saved_bytes_by_layer(program: Program) -> dict[str, int]:
    """Bytes (whole tensors, before any sharding) of the forward values each numbered layer
    keeps for the backward: what recomputing it would free, at most."""
    totals = dict.fromkeys(remat_layers(program), 0)
    for node, indices in saved_outputs(program.graph.nodes).items():
        layer = ir.numbered_layer(ir.require(node, ir.Region).module)
        if layer is None or layer.name not in totals:
            continue
        outputs = ir.require(node, ir.ValueMeta).outputs
        totals[layer.name] += sum(
            ir.evaluate(meta.nbytes) for i in indices if (meta := outputs[i]) is not None
        )
    return totals


def select_layers(program: Program, policy: RematPolicy) -> tuple[str, ...]:
    """The layers ``policy`` recomputes (none for ``"none"`` and ``"auto"``)."""
    check_remat_policy(policy)
    if policy in ("none", "auto"):
        return ()
    layers = remat_layers(program)
    if policy == "all":
        return tuple(layers)
    chosen = tuple(name for name in layers if any(fnmatch.fnmatchcase(name, p) for p in policy))
    unmatched = [p for p in policy if not any(fnmatch.fnmatchcase(n, p) for n in layers)]
    if unmatched:
        raise FxparError(
            f"remat patterns {unmatched} match no numbered layer of the model; its layers are "
            f"{layers[:8]}{' ...' if len(layers) > 8 else ''}"
        )
    return chosen


def recompute_in_backward(program: Program, layers: Collection[str]) -> Program:
    """Recompute ``layers`` and every checkpointed call of ``program`` in its backward
    (module docstring), in place; returns ``program``. Layers or calls an earlier call
    already recomputed are not recomputed twice."""
    done = program.get(Rematerialized) or Rematerialized()
    regions = _regions(program, set(layers) - set(done.layers), set(done.checkpoint_calls))
    position = {node: index for index, node in enumerate(program.graph.nodes)}
    copied = 0
    for members in regions.values():
        copied += _recompute_region(program.graph, members, position)
    if copied:
        program.recompile()
    calls = {key for key in regions if isinstance(key, int)}
    program.annotate(
        Rematerialized(
            layers=tuple(sorted({*done.layers, *layers}, key=_layer_order)),
            checkpoint_calls=tuple(sorted({*done.checkpoint_calls, *calls})),
            recomputed_ops=done.recomputed_ops + copied,
        )
    )
    return program


def _regions(
    program: Program, layers: Collection[str], calls_done: Collection[int]
) -> dict[str | int, list[fx.Node]]:
    """The forward ops of each region, by layer name or checkpoint call number: a node of a
    chosen layer belongs to its layer, any other checkpointed node to its call."""
    regions: dict[str | int, list[fx.Node]] = {}
    for node in program.nodes(ir.Phase.FORWARD):
        if node.op != "call_function":
            continue
        layer = ir.numbered_layer(ir.require(node, ir.Region).module)
        checkpointed = ir.get(node, ir.Checkpointed)
        key: str | int | None = None
        if layer is not None and layer.name in layers:
            key = layer.name
        elif checkpointed is not None and checkpointed.call not in calls_done:
            key = checkpointed.call
        if key is not None:
            regions.setdefault(key, []).append(node)
    return regions


def _layer_order(name: str) -> tuple[str, int, str]:
    """``blocks.2`` before ``blocks.10``: by container, then by the layer's number."""
    layer = ir.numbered_layer(name)
    if layer is None:
        return (name, -1, name)
    return (layer.container, int(layer.index), name)


def _is_backward(node: fx.Node) -> bool:
    region = ir.get(node, ir.Region)
    return region is not None and region.phase is ir.Phase.BACKWARD


def _recompute_region(
    graph: fx.Graph, members: Sequence[fx.Node], position: dict[fx.Node, int]
) -> int:
    """Copy into the backward what it reads of ``members`` (module docstring); the number of
    ops copied."""
    inside = set(members)
    outputs = {
        node
        for node in members
        if any(user.op == "output" or (user not in inside and not _is_backward(user))
               for user in node.users)
    }  # fmt: skip
    recomputable = inside - outputs
    read = [n for n in members if n in recomputable and any(map(_is_backward, n.users))]
    if not read:
        return 0
    needed: set[fx.Node] = set()
    pending = list(read)
    while pending:
        node = pending.pop()
        if node in needed:
            continue
        needed.add(node)
        pending.extend(n for n in node.all_input_nodes if n in recomputable)
    readers = [user for node in read for user in node.users if _is_backward(user)]
    first_reader = min(readers, key=position.__getitem__)
    copies: dict[fx.Node, fx.Node] = {}
    with graph.inserting_before(first_reader):
        for node in sorted(needed, key=position.__getitem__):
            copy = graph.node_copy(node, lambda arg: copies.get(arg, arg))
            copy.meta[ir.META_KEY] = dict(node.meta.get(ir.META_KEY, {}))
            region = ir.require(node, ir.Region)
            ir.annotate(copy, ir.Region(ir.Phase.BACKWARD, region.module, region.seq_nr))
            copies[node] = copy
    for node in read:
        for user in [u for u in node.users if _is_backward(u)]:
            user.replace_input_with(node, copies[node])
    return len(copies)
