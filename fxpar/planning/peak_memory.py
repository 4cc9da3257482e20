"""The peak memory of a planned step on one device, from its collective schedule.

The planner's memory row (:meth:`fxpar.solvers.IntraOpProblem.memory`) is a sum over nodes, so
that the ILP can bound it: every parameter with its gradient and optimizer state, plus every
value the backward reads from the forward, in the layout its producer makes. That sum is not a
moment of the step. It holds every gradient and every saved activation at once, where the
backward frees a layer's activations as it makes that layer's gradients; and it misses what
lives beside them: the copies the plan's collectives make (a batch gathered for BatchNorm and
kept for its backward, a fully sharded layer's gathered weights, a gradient bucket's flat
buffer) and the transient values of the op running at the peak (the logits' gradient).

:func:`peak_memory` walks the step as one device runs it instead, with the schedule the
lowering emits (:mod:`fxpar.planning.collective_schedule`), as a list of steps, each reading
and making buffers of the local bytes of their values:

- an op makes its outputs under its layout; a view makes nothing and reads its input's buffer;
  an op's tuple of outputs lives until its last element is taken out;
- each step of a conversion (:class:`~fxpar.planning.collective_schedule.Reshard`) makes a
  buffer of its own (an all-reduce's copy, a gather, a slice's contiguous copy); an all-reduce
  started early runs right after its input is made, and the ops before it that its input does
  not need run after it, as :func:`fxpar.lowering.spmd.overlap_all_reduces` moves them;
- a gather group's start makes its flat buffers (sent and gathered), its wait cuts the members
  out as copies (a lone member gathered on its first dim stays a view);
- a bucket packs its gradients into a flat buffer right after the last is made (and, for a
  reduce-scatter, a buffer of this device's chunks), read at the return.

A buffer is freed after its last reader. The step's inputs (parameters, buffers, the batch)
count throughout: the caller holds them, as the optimizer holds its state. The peak is the
largest sum after any step, counting the step's inputs read for the last time and its outputs
together, as
:func:`fxpar.testing.memory.peak_live_bytes` counts the real tensors of the lowered program;
tests/test_peak_memory.py and benchmarks/cost_model.py compare the two. Workspace an op
allocates inside its kernel and the allocator's fragmentation are outside both.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch.fx as fx

from fxpar import ir
from fxpar.cluster import Cluster
from fxpar.ir.program import Program
from fxpar.planning.collective_schedule import (
    Action,
    CollectiveSchedule,
    ConversionKey,
    Read,
    Recompute,
    Reshard,
    StartGather,
    WaitGather,
    schedule_program,
)
from fxpar.planning.cost import local_bytes, moves_no_data
from fxpar.sharding import Spec, spec_str

LARGEST = 5
"""How many of the buffers alive at the peak :class:`PeakMemory` names."""


@dataclass(frozen=True)
class PeakMemory:
    """The most bytes one device holds at once during a planned step, and where."""

    peak_bytes: int
    """Inputs plus every buffer alive right after ``peak_node`` runs."""
    input_bytes: int
    """The step's inputs on the device (its pieces of parameters, buffers and the batch) and
    the optimizer's state for its parameters."""
    peak_node: str
    """The step after which the peak is reached: an op's node name, a collective's
    (``"conversion x -> (R)"``, ``"start gather group 3"``, ``"bucket after mm_4"``), or
    ``"<inputs>"``."""
    largest: tuple[tuple[str, int], ...] = ()
    """The largest buffers alive at the peak besides the inputs, largest first: the value
    (a node's name; a conversion as ``source -> spec``; a gather group or a bucket) and its
    bytes."""

    @property
    def activation_bytes(self) -> int:
        """The peak less the inputs: what the step allocates on top of them."""
        return self.peak_bytes - self.input_bytes


@dataclass(eq=False)
class _Step:
    """One call of the per-rank program: what it reads and makes."""

    name: str
    ordered: bool = False
    """A collective's call, which keeps its place (every rank issues them in one order)."""
    early: bool = False
    """Starts an all-reduce right after its input is made (the ops before it that the input
    does not need move after it)."""
    reads: list[_Buffer] = field(default_factory=list)
    makes: list[_Buffer] = field(default_factory=list)
    needs: list[_Step] = field(default_factory=list)
    """The steps that made what it reads (a view's step, not its input's maker)."""

    def read(self, values: Iterable[_Value]) -> None:
        for buffer, step in values:
            if buffer is not None:
                self.reads.append(buffer)
            if step is not None:
                self.needs.append(step)


@dataclass(eq=False)
class _Buffer:
    name: str
    nbytes: int
    maker: _Step


_Value = tuple[_Buffer | None, _Step | None]
"""A value's buffer (None for an input's) and the step that made it (a view's own)."""
_INPUT: _Value = (None, None)


class _Walk:
    """The steps of the per-rank program, in order (module docstring)."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.steps: list[_Step] = []
        self.after: defaultdict[_Step, list[_Step]] = defaultdict(list)
        """Steps that run right after another (early starts, buckets), in order."""
        self.value: dict[tuple[fx.Node, int], _Value] = {}
        """Each node output's buffer and step; the step's inputs have neither (counted
        apart)."""
        self.converted: dict[ConversionKey, _Value] = {}
        self.recomputed: dict[fx.Node, _Value] = {}
        self.gathering: dict[int, tuple[_Value, _Value]] = {}
        """The gathered and the sent flat buffer of each gather group not yet waited for."""

    def step(self, name: str, reads: Iterable[_Value] = (), ordered: bool = False) -> _Step:
        step = _Step(name, ordered)
        step.read(reads)
        self.steps.append(step)
        return step

    @staticmethod
    def make(step: _Step, name: str, nbytes: int) -> _Value:
        """A buffer ``step`` makes, as the value it is."""
        buffer = _Buffer(name, nbytes, step)
        step.makes.append(buffer)
        return buffer, step

    def of_read(self, read: Read) -> _Value:
        if read.recomputed:
            return self.recomputed[read.source]
        if read.key is not None:
            return self.converted[read.key]
        return self.value[read.source, 0]

    def key_bytes(self, source: fx.Node, spec: Spec) -> int:
        return local_bytes(ir.require(source, ir.ValueMeta).tensor, spec, self.cluster)

    def convert(self, reshard: Reshard) -> None:
        """A conversion's steps, each with a result of its own reading the step before's."""
        source, spec = reshard.source, reshard.have
        name = _key_name(reshard.key)
        current = self.value[source, 0]
        for index, step in enumerate(reshard.steps):
            spec = step.apply(spec)
            nbytes = self.key_bytes(source, spec)
            if index == 0 and reshard.started_early[0] and current[1] is not None:
                started = _Step(f"start {name}", ordered=True, early=True)
                started.read([current])
                self.after[current[1]].append(started)
                current = self.make(started, name, nbytes)
                wait = self.step(f"wait for {name}", [current], ordered=True)
                current = (current[0], wait)
                continue
            call = self.step(f"{name}, step {index + 1}", [current], step.is_collective)
            current = self.make(call, name, nbytes)
        self.converted[reshard.key] = current

    def run(self, actions: Iterable[Action]) -> None:
        for action in actions:
            if isinstance(action, Reshard):
                self.convert(action)
            elif isinstance(action, StartGather):
                group = action.group
                sources = [self.value[member.source, 0] for member in group.members]
                name = f"gather group {group.index}"
                start = self.step(f"start {name}", sources, ordered=True)
                gathered = group.nbytes * self.cluster.mesh_shape[group.axes[0]]
                self.gathering[group.index] = (
                    self.make(start, name, gathered),
                    self.make(start, f"{name}, sent", group.nbytes),
                )
            elif isinstance(action, WaitGather):
                # A lone member gathered on its first dim over one axis is a view of the
                # gathered buffer; the others are cut out of it as copies of their own.
                group = action.group
                flat, sent = self.gathering.pop(group.index)
                wait = self.step(f"wait for gather group {group.index}", [flat, sent], True)
                alone = len(group.members) == 1 and group.members[0].dim == 0
                for member in group.members:
                    key = (member.source, member.spec, group.phase)
                    if alone and len(group.axes) == 1:
                        self.converted[key] = (flat[0], wait)
                    else:
                        nbytes = self.key_bytes(member.source, member.spec)
                        self.converted[key] = self.make(wait, _key_name(key), nbytes)
            else:
                assert isinstance(action, Recompute)
                # The views computed again read the backward's gathered buffer.
                self.recomputed[action.chain.views[-1]] = self.of_read(action.read)

    def ordered_steps(self) -> list[_Step]:
        """The steps with those that run right after another in their place, and the ops
        before each early start that its input does not need moved after it."""
        steps: list[_Step] = []
        for step in self.steps:
            for placed in (step, *self.after.get(step, ())):
                if placed.early:
                    _start_early(steps, placed)
                else:
                    steps.append(placed)
        return steps

    def peak(self, input_bytes: int) -> PeakMemory:
        """The largest sum of live buffers after any step, inputs added."""
        steps = self.ordered_steps()
        position = {step: index for index, step in enumerate(steps)}
        last: dict[_Buffer, int] = {}
        for index, step in enumerate(steps):
            for buffer in (*step.makes, *step.reads):
                last[buffer] = max(last.get(buffer, index), index)
        change = [0] * (len(steps) + 1)
        for buffer, end in last.items():
            change[position[buffer.maker]] += buffer.nbytes
            change[end + 1] -= buffer.nbytes
        best, at, alive = input_bytes, -1, input_bytes
        for index in range(len(steps)):
            alive += change[index]
            if alive > best:
                best, at = alive, index
        if at < 0:
            return PeakMemory(best, input_bytes, "<inputs>")
        live = [b for b, end in last.items() if position[b.maker] <= at <= end and b.nbytes]
        live.sort(key=lambda buffer: -buffer.nbytes)
        largest = tuple((buffer.name, buffer.nbytes) for buffer in live[:LARGEST])
        return PeakMemory(best, input_bytes, steps[at].name, largest)


def _start_early(steps: list[_Step], start: _Step) -> None:
    """Append ``start`` to ``steps``, moving the ops after the last ordered step that its input
    does not need to after it, in order (each start sees the moves of the ones before it, as
    the lowering's pass runs them)."""
    needed = set(start.needs)
    first = len(steps)
    while first > 0 and not steps[first - 1].ordered:
        first -= 1
    stay: list[_Step] = []
    moved: list[_Step] = []
    for step in reversed(steps[first:]):
        if step in needed:
            needed.update(step.needs)
            stay.append(step)
        else:
            moved.append(step)
    steps[first:] = [*reversed(stay), start, *reversed(moved)]


def _key_name(key: ConversionKey) -> str:
    source, spec, _ = key
    return f"{source.name} -> {spec_str(spec)}"


def _outputs(node: fx.Node) -> tuple[ir.TensorMeta | None, ...]:
    value = ir.get(node, ir.ValueMeta)
    return value.outputs if value is not None else ()


def peak_memory(
    program: Program,
    cluster: Cluster,
    schedule: CollectiveSchedule | None = None,
    *,
    optimizer_states: int = 0,
) -> PeakMemory:
    """The peak bytes one device (the mesh's first) holds while running ``program``, planned
    (every op with its chosen strategy), on ``cluster``: see the module docstring. The
    optimizer's ``optimizer_states`` copies of each trainable parameter's piece (2 for AdamW),
    held outside the step's program through it, count with the inputs. ``schedule`` is
    ``program``'s collective schedule when the caller has it already."""
    schedule = schedule or schedule_program(program, cluster.mesh_shape)
    walk = _Walk(cluster)
    specs = schedule.specs
    trainable = {program.placeholders()[name] for name in program.signature.gradients}
    input_bytes = 0
    for node in program.graph.nodes:
        if node.op == "placeholder":
            value = ir.get(node, ir.ValueMeta)
            spec = specs[node][0]
            if value is not None and value.tensors and spec is not None:
                nbytes = local_bytes(value.tensors[0], spec, cluster)
                copies = 1 + (optimizer_states if node in trainable else 0)
                input_bytes += copies * nbytes
            walk.value[node, 0] = _INPUT
            continue
        if node.op == "output":
            break
        if node.target is operator.getitem:
            source, index = node.args
            assert isinstance(source, fx.Node) and isinstance(index, int)
            walk.value[node, 0] = walk.value.get((source, index), _INPUT)
            # The program holds an op's tuple until its last element is taken out.
            elements = [walk.value.get((source, i), _INPUT) for i in range(len(_outputs(source)))]
            walk.steps[-1].read(elements)
            continue
        needs = schedule.inputs.get(node)
        if needs is not None:
            walk.run(needs.actions)
            reads = [walk.of_read(read) for read in needs.reads]
        else:
            reads = [walk.value.get((value, 0), _INPUT) for value in node.all_input_nodes]
        op = walk.step(node.name, reads)
        outputs = _outputs(node)
        if moves_no_data(node) and reads:
            walk.value[node, 0] = (reads[0][0], op)  # a view: its input's buffer
            continue
        for index, (meta, spec) in enumerate(zip(outputs, specs.get(node, ()), strict=False)):
            nbytes = local_bytes(meta, spec, cluster) if meta is not None and spec else 0
            name = node.name if len(outputs) == 1 else f"{node.name}[{index}]"
            walk.value[node, index] = walk.make(op, name, nbytes) if nbytes else (None, op)
    leaving = schedule.leaving
    walk.run(leaving.actions)
    results = [walk.of_read(read) for read in leaving.reads if read is not None]
    for bucket in leaving.buckets:
        # The bucket packs its members into one flat buffer right after the last is made:
        # summed in place (all-reduce), or sent while a buffer of this device's chunks
        # receives (reduce-scatter); the results leave as pieces of it.
        name = f"bucket after {bucket.starts_after.name}"
        start = _Step(name, ordered=True)
        start.read(walk.value[member.source, 0] for member in bucket.members)
        made_last = walk.value[bucket.starts_after, 0][1]
        assert made_last is not None
        walk.after[made_last].append(start)
        nbytes = sum(member.nbytes for member in bucket.members)
        results.append(walk.make(start, name, nbytes))
        if bucket.route.kind == "reduce_scatter":
            devices = cluster.mesh_shape[bucket.route.axes[0]]
            results.append(walk.make(start, f"{name}, received", nbytes // devices))
    walk.step("<return>", results, ordered=True)
    return walk.peak(input_bytes)
