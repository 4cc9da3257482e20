"""Assign every node of a captured Program to a pipeline stage and to its forward or backward
half.

**Forward nodes go by position in data-flow order.** ``make_fx`` records forward ops in the
order the model runs them, with one exception: ops computed from the model's state alone
(parameters, buffers and constants, nothing of the batch) sit wherever the trace put them.
Mixed precision casts every parameter before the first layer runs, in the order the modules
registered them, and a rotary embedding's tables are computed once, before the layers that read
them. :func:`forward_order` moves each such *state-only* op to just before its first forward
consumer, so it runs in the stage that first reads it. In that order a stage is a contiguous
run of forward nodes: stage ``k`` begins at the first forward node of its split-point module.
Position, not the module name alone, decides, so code of the root module between two layers
(GPT's embedding sum, a residual add written in the parent's ``forward``) lands in the stage
that runs at that moment, and every forward edge points from a stage to itself or a later one.
A split point whose module computes from the state alone and is first read inside another
module (a rotary embedding, read in the first layer's attention) would begin a stage inside
that module, and is refused.

**Backward nodes follow the forward op they differentiate.** Capture tags each backward node
with autograd's sequence number of its forward op (``Region.seq_nr``); failing that, with the
module of that op when the module ran in one stage only. Nodes with neither (the loss seed,
gradient accumulations, reductions for broadcasts) take the stage of their backward inputs, or
of their forward inputs when they have none. Last, each backward node is clamped to at most the
stage of every backward node it reads, so gradients only ever flow from a stage to itself or an
earlier one. ``getitem`` nodes always sit with the tuple they read, so only tensors cross stages.

**Causality is checked.** The units run ``forward[0], ..., forward[K-1], backward[K-1], ...,
backward[0]``; :func:`check_causal` refuses an assignment in which a unit reads a value that a
later unit computes, naming the value and both stages (:class:`StageOrderError`).

A choice here never changes what is computed, only where: values a stage needs from elsewhere
are routed by :mod:`fxpar.pipeline.split`.
"""

from __future__ import annotations

import enum
import logging
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch.fx as fx

from fxpar import ir
from fxpar.ir.flops import default_flop_registry
from fxpar.ir.program import Program
from fxpar.passes.annotate_cost import node_cost
from fxpar.pipeline.options import PipelineError
from fxpar.planning.cost import repeated_layers

logger = logging.getLogger(__name__)


class Half(enum.Enum):
    """The forward or the backward program of a stage."""

    FORWARD = "forward"
    BACKWARD = "backward"


class Unit(NamedTuple):
    """One program of the pipeline: the forward or backward half of stage ``stage``."""

    half: Half
    stage: int

    def __str__(self) -> str:
        return f"{self.half.value}[{self.stage}]"


class StageOrderError(PipelineError):
    """A stage reads a value that a later stage computes.

    Attributes:
        value: the name of the node computing the value.
        producer: the unit computing it.
        reader: the unit reading it, which runs before ``producer``.
    """

    def __init__(self, message: str, *, value: str, producer: Unit, reader: Unit) -> None:
        super().__init__(message)
        self.value = value
        self.producer = producer
        self.reader = reader


@dataclass(frozen=True)
class ForwardOrder:
    """The forward nodes of a Program in data-flow order (module docstring)."""

    nodes: tuple[fx.Node, ...]
    anchor: Mapping[fx.Node, fx.Node]
    """For each node, the node reading the batch that it was moved before: its first forward
    consumer that depends on the batch, or itself (a node that depends on the batch, or a
    state-only node no forward op reads)."""

    def is_moved(self, node: fx.Node) -> bool:
        """``node`` computes from the model's state alone and was moved to its consumer."""
        return self.anchor[node] is not node


def forward_order(program: Program) -> ForwardOrder:
    """The forward nodes of ``program``, each state-only node (one that reads, directly or
    not, none of the batch or random inputs) moved to just before the first forward node that
    reads it and depends on the batch. The order stays topological: a node is never moved
    after a reader, and moved nodes keep their relative order."""
    forward = [n for n in program.graph.nodes if _phase(n) is ir.Phase.FORWARD]
    index = {node: position for position, node in enumerate(forward)}
    placeholders = program.placeholders()
    step_inputs = {placeholders[name] for name in program.signature.step_inputs}
    depends_on_batch: set[fx.Node] = set()
    for node in forward:
        if any(a in step_inputs or a in depends_on_batch for a in node.all_input_nodes):
            depends_on_batch.add(node)
    anchor: dict[fx.Node, fx.Node] = {}
    for node in reversed(forward):
        if node in depends_on_batch:
            anchor[node] = node
            continue
        readers = [anchor[user] for user in node.users if user in anchor]
        anchor[node] = min(readers, key=index.__getitem__, default=node)
    nodes = sorted(forward, key=lambda node: (index[anchor[node]], index[node]))
    return ForwardOrder(tuple(nodes), anchor)


@dataclass(frozen=True)
class Partition:
    """Where every computing node of a Program runs."""

    num_stages: int
    split_points: tuple[str, ...]
    """Module names where stages ``1 .. K-1`` begin."""
    units: Mapping[fx.Node, Unit]
    """The unit of every ``call_function`` node."""


def partition(program: Program, split_points: Sequence[str]) -> Partition:
    """Assign each node of ``program`` to a stage; stage ``k`` begins at ``split_points[k-1]``.

    Raises:
        PipelineError: a split point names no module that runs in forward, or the split points
            are not in the order the model runs them.
    """
    order = forward_order(program)
    forward = order.nodes
    starts = [first_position(forward, point) for point in split_points]
    for point, start in zip(split_points, starts, strict=True):
        inside = enclosing_module(order, start, point)
        if inside is not None:
            raise PipelineError(
                f"split point {point!r} computes from the model's parameters and buffers alone "
                f"(nothing of the batch), so it runs where {inside!r} first reads it, inside "
                f"that module: a stage cannot begin there; begin it at a module that runs "
                f"before or after {inside!r}"
            )
    for (previous, before), (point, start) in zip(
        zip(split_points, starts, strict=True),
        zip(split_points[1:], starts[1:], strict=False),
        strict=False,
    ):
        if start <= before:
            raise PipelineError(
                f"split point {point!r} runs before {previous!r}: list the modules where stages "
                "begin in the order the model's forward runs them"
            )
    units: dict[fx.Node, Unit] = {}
    stage = 0
    for position, node in enumerate(forward):
        while stage < len(starts) and position >= starts[stage]:
            stage += 1
        units[node] = Unit(Half.FORWARD, stage)
    _assign_backward(program, units)
    _keep_getitems_with_their_tuple(program, units)
    result = Partition(len(split_points) + 1, tuple(split_points), units)
    check_causal(program, result)
    return result


def check_causal(program: Program, partition: Partition) -> None:
    """Refuse an assignment in which a unit reads a value computed by a unit that runs after
    it (in the order ``forward[0..K-1]``, then ``backward[K-1..0]``).

    Raises:
        StageOrderError: naming the first such value, its stage and the stage reading it.
    """
    last = partition.num_stages - 1

    def rank(unit: Unit) -> int:
        return unit.stage if unit.half is Half.FORWARD else 2 * last + 1 - unit.stage

    units = partition.units
    for node in program.graph.nodes:
        reader = units.get(node)
        if reader is None:
            continue
        for value in node.all_input_nodes:
            producer = units.get(value)
            if producer is None or rank(producer) <= rank(reader):
                continue
            module = ir.require(value, ir.Region).module or "the model's own forward"
            raise StageOrderError(
                f"{reader} ({_stage_name(partition, reader.stage)}) reads {value.name!r} "
                f"({value.target}, in {module}), which {producer} "
                f"({_stage_name(partition, producer.stage)}) computes later: no stage may read "
                "a value a later stage produces. List the split points in the order the "
                "model's forward runs them, each at a module that runs after every value its "
                "stage reads",
                value=value.name,
                producer=producer,
                reader=reader,
            )


def _stage_name(partition: Partition, stage: int) -> str:
    if stage == 0:
        return "stage 0, from the model's start"
    return f"stage {stage}, from {partition.split_points[stage - 1]!r}"


def enclosing_module(order: ForwardOrder, position: int, module: str) -> str | None:
    """The module that a stage beginning at ``module``, whose first node is at ``position``
    of ``order``, would begin inside: when that node computes from the state alone and was
    moved before a consumer in another module that already ran (a rotary embedding's tables,
    first read in the middle of the first layer's attention). None when the stage begins
    between modules."""
    node = order.nodes[position]
    if not order.is_moved(node):
        return None
    consumer = ir.require(order.anchor[node], ir.Region).module
    if within_module(consumer, module) or within_module(module, consumer):
        return None  # its own code, or its parent's code between children (GPT's wpe sum)
    ran_before = any(
        within_module(ir.require(n, ir.Region).module, consumer) for n in order.nodes[:position]
    )
    return consumer if ran_before else None


def within_module(module: str, ancestor: str) -> bool:
    """``module`` is ``ancestor`` or one of its submodules (every module is within the root,
    ``""``)."""
    return ancestor == "" or module == ancestor or module.startswith(ancestor + ".")


def even_split_points(program: Program, num_stages: int) -> tuple[str, ...]:
    """Split points cutting ``program`` into ``num_stages`` stages of about equal forward FLOPs,
    each beginning at a repeated layer (``blocks.3``, ``layers.1``, ``h.7``).

    Raises:
        PipelineError: the model has fewer repeated layers than stages need; pass the split
            points by name instead.
    """
    if num_stages == 1:
        return ()
    forward = forward_order(program).nodes
    repeated = repeated_layers(ir.require(node, ir.Region).module for node in forward)
    layers = [] if repeated is None else repeated[1]
    if len(layers) < num_stages:
        found = ", ".join(layers[:6]) or "none"
        raise PipelineError(
            f"cannot cut the model into {num_stages} stages at its repeated layers (found "
            f"{len(layers)}: {found}); pass Pipeline(stages=('module.name', ...)) with the "
            "modules where stages begin"
        )
    registry = default_flop_registry()
    flops = [float(ir.evaluate(node_cost(n, registry).flops)) + 1.0 for n in forward]
    prefix = [0.0]
    for value in flops:
        prefix.append(prefix[-1] + value)
    candidates = [(name, first_position(forward, name)) for name in layers[1:]]
    chosen: list[str] = []
    for k in range(1, num_stages):
        target = prefix[-1] * k / num_stages
        remaining = [c for c in candidates if c[0] not in chosen]
        # Leave enough later layers for the stages still to place.
        remaining = remaining[: len(remaining) - (num_stages - 1 - k)]
        if chosen:
            last = first_position(forward, chosen[-1])
            remaining = [c for c in remaining if c[1] > last]
        name, _ = min(remaining, key=lambda c: abs(prefix[c[1]] - target))
        chosen.append(name)
    logger.debug("even split of %d stages at %s", num_stages, chosen)
    return tuple(chosen)


def first_position(forward: Sequence[fx.Node], module: str) -> int:
    """Where ``module`` (or a submodule of it) first runs among the ``forward`` nodes."""
    for position, node in enumerate(forward):
        name = ir.require(node, ir.Region).module
        if name == module or name.startswith(module + "."):
            return position
    modules = sorted({ir.require(n, ir.Region).module for n in forward} - {""})
    raise PipelineError(
        f"split point {module!r} names no module that runs in the forward pass; modules that "
        f"do include {modules[:8]}"
    )


def _phase(node: fx.Node) -> ir.Phase:
    return ir.require(node, ir.Region).phase


def _assign_backward(program: Program, units: dict[fx.Node, Unit]) -> None:
    stage_of_seq: dict[int, int] = {}
    stages_of_module: dict[str, set[int]] = {}
    for node, unit in units.items():
        region = ir.require(node, ir.Region)
        if region.seq_nr is not None:
            stage_of_seq.setdefault(region.seq_nr, unit.stage)
        stages_of_module.setdefault(region.module, set()).add(unit.stage)
    last = max((u.stage for u in units.values()), default=0)
    for node in program.graph.nodes:
        if node.op in ("placeholder", "output") or _phase(node) is not ir.Phase.BACKWARD:
            continue
        region = ir.require(node, ir.Region)
        backward_inputs = [units[a].stage for a in node.all_input_nodes if _is_backward(a, units)]
        stage: int | None = None
        if region.seq_nr is not None:
            stage = stage_of_seq.get(region.seq_nr)
        # The root module's code runs between layers, in any stage: its name says nothing.
        if stage is None and region.module and len(stages_of_module.get(region.module, ())) == 1:
            (stage,) = stages_of_module[region.module]
        if stage is None and backward_inputs:
            stage = min(backward_inputs)
        if stage is None:
            forward_inputs = [units[a].stage for a in node.all_input_nodes if a in units]
            stage = max(forward_inputs, default=last)
        # Gradients flow towards stage 0: never read a backward value of an earlier stage.
        stage = min([stage, *backward_inputs])
        units[node] = Unit(Half.BACKWARD, stage)


def _is_backward(node: fx.Node, units: Mapping[fx.Node, Unit]) -> bool:
    unit = units.get(node)
    return unit is not None and unit.half is Half.BACKWARD


def _keep_getitems_with_their_tuple(program: Program, units: dict[fx.Node, Unit]) -> None:
    for node in program.graph.nodes:
        if node.op == "call_function" and node.target is operator.getitem:
            source = node.args[0]
            if isinstance(source, fx.Node) and source in units:
                units[node] = units[source]
