"""The atoms of the stage DP: the ops between two consecutive cut candidates.

A stage may begin at a *cut candidate*: a repeated layer (``blocks.3``; the numbered children of
the container with the most, :func:`fxpar.planning.cost.repeated_layers`) or another module at the
depth of that container (``wte``, ``ln_f``, ``head``, ``<loss>``; ``transformer.wte`` when the
layers are ``transformer.h.i``), in data-flow order
(:func:`~fxpar.pipeline.partition.forward_order`: ops computed from the model's state alone,
such as mixed precision's parameter casts, run where they are first read, never in the order
the modules registered their parameters). The model's first such module is not a candidate
(stage 0 starts with the model), and neither is a module computed from the state alone and
first read inside another one (a rotary embedding, read in the first layer's attention): its
ops go with that consumer. :func:`~fxpar.pipeline.partition.partition` with every
candidate as a split point checks them and assigns each node, backward nodes included (they follow
their forward op), to an *atom*: the ops between two consecutive candidates.

:class:`Atoms` also keeps what the stage costs need of the whole step: the placeholders by kind
(trainable parameters, buffers and frozen parameters, the batch), the bytes crossing every atom
boundary forwards and backwards, and one edge per value for layer clustering.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch.fx as fx

from fxpar import ir
from fxpar.ir.program import Program
from fxpar.passes import default_passes
from fxpar.pipeline.options import PipelineError
from fxpar.pipeline.partition import (
    ForwardOrder,
    first_position,
    forward_order,
    partition,
    within_module,
)
from fxpar.planning.cost import repeated_layers
from fxpar.solvers.layers import DataEdge


@dataclass(frozen=True)
class Atoms:
    """A captured step cut at its cut candidates (module docstring)."""

    names: tuple[str, ...]
    """The candidate each atom begins at (atom 0: the model's first module)."""
    modules: tuple[tuple[str, ...], ...]
    nodes: tuple[tuple[fx.Node, ...], ...]
    atom_of: dict[fx.Node, int]
    trainable: dict[fx.Node, int]
    """Trainable parameter placeholders and their bytes."""
    frozen: dict[fx.Node, int]
    """Buffers and frozen parameters."""
    batch: dict[fx.Node, int]
    """Batch tensors (inputs and targets)."""
    batch_size: int | None
    forward_crossing: tuple[int, ...]
    """Bytes crossing the boundary before atom ``c`` from an earlier to a later atom."""
    backward_crossing: tuple[int, ...]
    """Bytes crossing the boundary before atom ``c`` from a later to an earlier atom."""
    edges: tuple[DataEdge, ...]
    """Atom-level edges for layer clustering, one per value, spanning all atoms it reaches."""
    program: Program

    @property
    def count(self) -> int:
        return len(self.names)

    def index_of(self, name: str) -> int:
        return self.names.index(name)

    @staticmethod
    def build(program: Program, extra_points: Sequence[str]) -> Atoms:
        program = _with_costs(program)
        order = forward_order(program)
        forward = order.nodes
        units, riders = cut_candidates(order)
        first = {name: first_position(forward, name) for name in extra_points}
        # A user's split point may begin where a candidate does (``blocks.1.ln_1``): keep the
        # user's name there, so the choice reports the stages as the user named them.
        by_position = {position: name for name, position in units[1:]}
        by_position.update({position: name for name, position in first.items()})
        early = [name for name, position in first.items() if position <= units[0][1]]
        if early:
            raise PipelineError(
                f"split point {early[0]!r} begins at or before the model's first module "
                f"{units[0][0]!r}, so stage 0 would hold no module; name a later module"
            )
        points = [by_position[p] for p in sorted(by_position)]
        parts = partition(program, points)
        names = (units[0][0], *points)
        count = len(names)
        atom_of = {node: unit.stage for node, unit in parts.units.items()}
        modules: list[list[str]] = [[] for _ in range(count)]
        for name, position in sorted([*units, *riders], key=lambda unit: unit[1]):
            atom = atom_of[forward[position]]
            if name not in modules[atom]:
                modules[atom].append(name)
        for atom, name in enumerate(names):
            if name not in modules[atom]:
                modules[atom].insert(0, name)
        nodes: list[list[fx.Node]] = [[] for _ in range(count)]
        for node in program.graph.nodes:
            if node in atom_of:
                nodes[atom_of[node]].append(node)
        trainable, frozen, batch = _placeholders(program)
        forward_crossing, backward_crossing, edges = crossings(program, atom_of, count)
        return Atoms(
            names=names,
            modules=tuple(tuple(m) for m in modules),
            nodes=tuple(tuple(n) for n in nodes),
            atom_of=atom_of,
            trainable=trainable,
            frozen=frozen,
            batch=batch,
            batch_size=_batch_size(batch),
            forward_crossing=forward_crossing,
            backward_crossing=backward_crossing,
            edges=edges,
            program=program,
        )


def _with_costs(program: Program) -> Program:
    """``program`` after the pipeline's steps up to the costs (a new Program): means become
    sums (as every stage plan and every split program has them) before the atoms take the
    graph's nodes, and every node is priced. Both steps leave a Program they already ran on
    as it was."""
    return default_passes().through("annotate-cost").run(program)


def region(node: fx.Node) -> ir.Region:
    return ir.require(node, ir.Region)


def cut_candidates(order: ForwardOrder) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """Cut candidates ``(module name, first position in order)`` in data-flow order, the
    model's first module included: the repeated layers, and other modules cut to the depth of
    their container. Modules above that depth (the root, the container's parents, the parent
    of other candidates such as a decoder beside the encoder's layers) run between candidates
    and go with the one before them.

    Second, the *riders*: modules at a candidate's depth that compute from the model's state
    alone and are first read by another module (a rotary embedding, read in the first layer's
    attention; a shared embedding whose mixed precision cast is first read by the encoder's
    embedding). Their ops go with that reader; a stage beginning at one would hold nothing
    that depends on the batch before its reader, or begin inside it."""
    forward = order.nodes
    repeated = repeated_layers(region(node).module for node in forward)
    container = None if repeated is None else repeated[0]
    depth = len(container.split(".")) if container else 1
    units: dict[str, int] = {}
    for position, node in enumerate(forward):
        module = region(node).module
        if not module:
            continue
        parts = module.split(".")
        if container is not None and module.startswith(container + "."):
            name = ".".join(parts[: depth + 1])
        else:
            name = ".".join(parts[:depth])
            if container is not None and (container + ".").startswith(name + "."):
                continue  # an ancestor of the layers: naming it would cut before all of them
            if name == container:
                continue
        units.setdefault(name, position)
    if not units:
        raise PipelineError(
            "the captured step's forward ops belong to no named module, so there is nowhere to "
            "cut it into stages"
        )
    # A parent's own code (model.decoder's, between its children): where the parent begins is
    # where its first child does, so naming it would cut twice at one place.
    parents = {name for name in units if any(other.startswith(name + ".") for other in units)}
    ordered = sorted(
        ((name, first_position(forward, name)) for name in units if name not in parents),
        key=lambda unit: unit[1],
    )
    riders = [unit for unit in ordered if _rides(order, *unit)]
    candidates = [unit for unit in ordered if unit not in riders]
    if not candidates:
        candidates, riders = ordered[:1], ordered[1:]
    return candidates, riders


def _rides(order: ForwardOrder, name: str, position: int) -> bool:
    """``name`` begins with ops computed from the state alone, moved before a reader in
    another module than itself or its parent (the parent's code between children, GPT's
    ``wte(x) + wpe(positions)``, does not count: a stage may begin at ``wpe``)."""
    node = order.nodes[position]
    if not order.is_moved(node):
        return False
    reader = region(order.anchor[node]).module
    return not (within_module(reader, name) or within_module(name, reader))


def _placeholders(
    program: Program,
) -> tuple[dict[fx.Node, int], dict[fx.Node, int], dict[fx.Node, int]]:
    signature = program.signature
    placeholders = program.placeholders()
    trainable_names = set(signature.gradients)
    trainable: dict[fx.Node, int] = {}
    frozen: dict[fx.Node, int] = {}
    batch: dict[fx.Node, int] = {}
    for name, node in placeholders.items():
        size = output_bytes(node)
        if name in signature.step_inputs:  # the batch and the random draws
            batch[node] = size
        elif name in trainable_names:
            trainable[node] = size
        else:
            frozen[node] = size
    return trainable, frozen, batch


def _batch_size(batch: dict[fx.Node, int]) -> int | None:
    sizes = set()
    for node in batch:
        for meta in ir.require(node, ir.ValueMeta).tensors:
            if meta.shape:
                sizes.add(ir.evaluate(meta.shape[0]))
    return min(sizes) if sizes else None


def output_bytes(node: fx.Node) -> int:
    """Bytes of everything ``node`` produces, on one device holding all of it."""
    cost = ir.get(node, ir.Cost)
    if cost is not None:
        return ir.evaluate(cost.output_bytes)
    return sum(ir.evaluate(t.nbytes) for t in ir.require(node, ir.ValueMeta).tensors)


def crossings(
    program: Program,
    atom_of: dict[fx.Node, int],
    count: int,
    nbytes_of: Callable[[fx.Node], int] | None = None,
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[DataEdge, ...]]:
    """The bytes crossing the boundary before each atom forwards and backwards, and one
    layer-clustering edge per value, each value priced by ``nbytes_of`` (its global bytes by
    default)."""
    nbytes_of = nbytes_of or output_bytes
    forward = [0] * (count + 1)
    backward = [0] * (count + 1)
    edges: list[DataEdge] = []
    for node in program.graph.nodes:
        home = atom_of.get(node)
        if home is None:
            continue  # parameters and batch tensors never travel: every stage reads its own
        readers = {atom_of[user] for user in node.users if user in atom_of}
        later, earlier = max(readers, default=home), min(readers, default=home)
        nbytes = nbytes_of(node)
        if nbytes == 0 or later == earlier == home:
            continue
        # Relayed through every stage in between, so it crosses each boundary once.
        for boundary in range(home + 1, later + 1):
            forward[boundary] += nbytes
        for boundary in range(earlier + 1, home + 1):
            backward[boundary] += nbytes
        edges.append(DataEdge(min(earlier, home), max(later, home), nbytes))
    return tuple(forward), tuple(backward), tuple(edges)
