"""The collective schedule: every conversion a planned graph needs, decided once, as data.

A graph whose every op carries its chosen strategy (:class:`~fxpar.sharding.Sharding`) reads each
value in the spec its consumer's strategy requires, and returns its results in the specs asked
for. :func:`schedule_graph` (and :func:`schedule_program`, with a Program's own specs) walks the
graph once, in order, and writes down what that takes, the same on every rank:

- each value brought into another layout by the steps of
  :func:`fxpar.sharding.reshard.reshard_steps` (:class:`Reshard`) where its first consumer needs
  it, reused by later consumers of the same layout (a parameter, or its cast to the compute
  dtype, once per phase, so that the forward's gathered copy need not live until the backward);
- placeholders gathered in groups, one all-gather per layer, phase and mesh axis, started at the
  group's first use together with the next group (:class:`StartGather`, :class:`WaitGather`;
  :func:`fxpar.planning.grouping.gather_groups`), except a next group whose casts are not yet
  computed, which starts at its own first use;
- forward views of gathered parameters that the backward reads computed again from the
  backward's own gather (:class:`Recompute`; :class:`fxpar.planning.grouping.ViewChain`);
- results that take only reductions in buckets (:class:`Bucket`;
  :func:`fxpar.planning.grouping.cut_buckets`), each started right after its last value is made
  and waited for where the graph returns;
- the all-to-alls of mixture-of-experts blocks whose tokens are dispatched to their experts'
  devices (:class:`Exchange`; :mod:`fxpar.planning.moe_blocks`): the count exchange at a
  block's routing sort and the rows' exchange of each dispatch and combine, run by those
  nodes themselves, started and waited for where they run;
- which local value every op's tensor input and every result reads (:class:`Read`);
- every collective, in the order the per-rank programs run it (:class:`CollectiveRecord`), and
  the layout of every value.

The rank lowering (:mod:`fxpar.lowering.spmd`) emits its code from this schedule; the plan
report (:mod:`fxpar.planning.report`) and the stage DP (:mod:`fxpar.pipeline.stage_costs`)
count and price its collectives. Nothing else decides them.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch.fx as fx
from torch.distributed.tensor import Partial, Replicate

from fxpar import ir
from fxpar.errors import LoweringError
from fxpar.ir.program import Program
from fxpar.planning.grouping import (
    BUCKET_BYTES,
    Bucketed,
    GatherGroup,
    Gathers,
    ViewChain,
    cut_buckets,
    gather_groups,
    needs_strategy,
)
from fxpar.planning.moe_blocks import BlockExchange, MoEBlock, dispatched_blocks, exchanges_of
from fxpar.rules.registry import tensor_inputs
from fxpar.sharding import Sharding, Spec, local_shape, piece_bytes, replicated, spec_str
from fxpar.sharding.reshard import BucketRoute, ReshardStep, bucket_route, reshard_steps


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective in the per-rank programs: what, on which mesh axis, how many bytes each
    device contributes, and where (the consumer's phase; OUTPUT for gradient synchronisation).

    ``kind`` is a step of a resharding (``all_gather``, ``all_reduce``, ``reduce_scatter``,
    ``all_to_all``) or ``all_to_all_rows``, the variable-size all-to-all of a dispatched
    mixture-of-experts block's dispatch or combine (:class:`Exchange`; its count exchange is
    an ``all_to_all``), whose bytes are those of balanced routing."""

    kind: str
    axis: int
    bytes: int
    tensor: str
    consumer: str
    phase: ir.Phase


ConversionKey = tuple[fx.Node, Spec, ir.Phase | None]
"""A value in another layout: its source, the spec, and the phase for a gathered parameter
(converted again in each phase) or None for any other value (converted once)."""


@dataclass(frozen=True)
class Read:
    """The local value an op's tensor input (or a result) takes: ``source`` as it was made
    (``key`` None), its conversion ``key``, or, when ``recomputed``, the view ``source``
    computed again from the backward's own gather (:class:`Recompute`)."""

    source: fx.Node
    key: ConversionKey | None = None
    recomputed: bool = False


@dataclass(frozen=True)
class Reshard:
    """The value of ``key`` made from its source laid out as ``have`` by ``steps``, where its
    first consumer needs it; later reads of ``key`` reuse it."""

    key: ConversionKey
    have: Spec
    steps: tuple[ReshardStep, ...]
    started_early: tuple[bool, ...]
    """Per step: an all-reduce started right after its input is made (the source's value, or
    the step before's result) and waited for where it is needed, so that it travels behind
    the ops in between. A placeholder's first all-reduce runs where it is needed."""
    records: tuple[CollectiveRecord, ...]
    """One per collective step, in order."""

    @property
    def source(self) -> fx.Node:
        return self.key[0]


@dataclass(frozen=True)
class StartGather:
    """Start ``group``'s all-gathers (one per mesh axis, the first travelling until its wait)."""

    group: GatherGroup
    records: tuple[CollectiveRecord, ...]


@dataclass(frozen=True)
class WaitGather:
    """Wait for ``group``'s gathers: each member's key ``(source, spec, group.phase)`` is then
    converted."""

    group: GatherGroup


@dataclass(frozen=True)
class Recompute:
    """The views of ``chain`` computed again, in order, from ``read`` (the backward's gather
    of their parameter)."""

    chain: ViewChain
    read: Read


@dataclass(frozen=True)
class Exchange:
    """An all-to-all of a dispatched mixture-of-experts block, run by the node of
    ``exchange`` itself (its sort's count exchange, or a boundary's rows) after that node's
    conversions: blocking, started and waited for where the node runs."""

    exchange: BlockExchange
    record: CollectiveRecord

    @property
    def node(self) -> fx.Node:
        return self.exchange.node


Action = Reshard | StartGather | WaitGather | Recompute
"""What runs before an op (or the return), in order."""


@dataclass(frozen=True)
class OpInputs:
    """What an op needs before it runs: the actions, in order, and the value each of its
    tensor inputs (:func:`fxpar.rules.registry.tensor_inputs`) reads."""

    actions: tuple[Action, ...]
    reads: tuple[Read, ...]


@dataclass(frozen=True)
class Bucket:
    """Results that travel together: one collective per mesh axis of ``route``, started right
    after the last member's value is made, waited for where the graph returns."""

    route: BucketRoute
    members: tuple[Bucketed, ...]
    records: tuple[CollectiveRecord, ...]

    @property
    def starts_after(self) -> fx.Node:
        return self.members[-1].source


@dataclass(frozen=True)
class Leaving:
    """How the graph's results leave: in which specs, the conversions of those that do not
    travel in buckets (in order), what each result reads (None for a bucketed result and for a
    non-tensor result, returned as it is), and the buckets, in the order they start."""

    specs: tuple[Spec, ...]
    actions: tuple[Action, ...]
    reads: tuple[Read | None, ...]
    buckets: tuple[Bucket, ...]


@dataclass(frozen=True)
class CollectiveSchedule:
    """Every conversion of a planned graph on a mesh (module docstring)."""

    mesh: tuple[int, ...]
    specs: dict[fx.Node, tuple[Spec | None, ...]]
    """The layout of every value (not the output node): what each node makes."""
    inputs: dict[fx.Node, OpInputs]
    """For each op that takes a strategy, what runs before it and what it reads."""
    leaving: Leaving
    gathers: Gathers
    records: tuple[CollectiveRecord, ...]
    """Every collective, in the order the per-rank programs run them."""
    exchanges: dict[fx.Node, Exchange]
    """The all-to-alls of the dispatched MoE blocks, by the node that runs each."""
    dispatched: dict[fx.Node, tuple[MoEBlock, int]]
    """Every node of a dispatched MoE block (routing, boundaries, region), with its block and
    expert axis: the lowering emits the block's routing and boundaries around its exchanges."""


def check_planned(graph: fx.Graph, mesh_ndim: int) -> None:
    """Raise :class:`~fxpar.errors.LoweringError` unless every op of ``graph`` has a chosen
    strategy with one placement per mesh axis and every shape is concrete."""
    for node in graph.nodes:
        value = ir.get(node, ir.ValueMeta)
        if value is not None and any(t.is_symbolic for t in value.tensors):
            raise LoweringError(
                f"node {node.name!r} has a symbolic shape ({', '.join(map(str, value.tensors))})"
                "; capture with dynamic=False to lower to per-rank programs"
            )
    for node in graph.nodes:
        if needs_strategy(node):
            sharding = ir.get(node, Sharding)
            if sharding is None:
                raise LoweringError(
                    f"node {node.name!r} ({node.target}) has no chosen strategy; pick a plan "
                    "(fxpar.plans) or annotate every node with fxpar.sharding.Sharding"
                )
            for spec in (*sharding.strategy.outputs, *sharding.strategy.inputs):
                if spec is not None and len(spec) != mesh_ndim:
                    raise LoweringError(
                        f"node {node.name!r}: spec {spec_str(spec)} has {len(spec)} placements "
                        f"but the mesh has {mesh_ndim} axes"
                    )


def value_spec(node: fx.Node) -> Spec:
    """The chosen spec of a single-tensor value: a placeholder's or an op's (first) output
    spec, or, for a ``getitem``, the spec of that output of its producer.

    Raises:
        LoweringError: the node (or its producer) has no chosen strategy.
    """
    index = 0
    if node.op == "call_function" and node.target is operator.getitem:
        source, position = node.args
        assert isinstance(source, fx.Node) and isinstance(position, int)
        node, index = source, position
    sharding = ir.get(node, Sharding)
    spec = sharding.strategy.outputs[index] if sharding is not None else None
    if spec is None:
        raise LoweringError(
            f"node {node.name!r} ({node.target}) has no chosen strategy for output {index}; "
            "pick a plan (fxpar.plans) or annotate every node with fxpar.sharding.Sharding"
        )
    return spec


def output_specs(program: Program, mesh_ndim: int) -> tuple[Spec, ...]:
    """The specs the step's outputs leave in: the loss (or a forward's outputs) as computed
    but with partial sums reduced, each gradient and buffer update in its parameter's or
    buffer's layout."""
    placeholders = program.placeholders()
    signature = program.signature
    results = program.graph.output_node().args[0]
    assert isinstance(results, (tuple, list))
    state = signature.gradients + signature.buffer_updates
    leading = [_settled(result, mesh_ndim) for result in results[: len(signature.outputs)]]
    return (*leading, *(value_spec(placeholders[n]) for n in state))


def deferred_gradient_specs(program: Program, mesh_shape: tuple[int, ...]) -> tuple[Spec, ...]:
    """:func:`output_specs`, but with each gradient in the spec the backward produced it in
    where that piece is no larger than the piece of the parameter's spec.

    Gradients are linear in the loss, so such pieces can be summed over several backward
    passes and converted once (:func:`fxpar.lowering.conversion_program`): gradient
    accumulation then communicates once per update instead of once per micro-batch, as DDP's
    ``no_sync`` does. A gradient whose conversion makes it smaller (the reduce-scatter of a
    fully sharded plan) is converted in every pass, so accumulation never holds more than one
    piece of it."""
    leaving = list(output_specs(program, len(mesh_shape)))
    results = program.graph.output_node().args[0]
    assert isinstance(results, (tuple, list))
    first = len(program.signature.outputs)
    for index in range(first, first + len(program.signature.gradients)):
        result = results[index]
        if not isinstance(result, fx.Node) or result.op == "get_attr":
            continue
        produced = value_spec(result)
        shape = ir.require(result, ir.ValueMeta).tensor.shape
        if ir.product(local_shape(shape, produced, mesh_shape)) <= ir.product(
            local_shape(shape, leaving[index], mesh_shape)
        ):
            leaving[index] = produced
    return tuple(leaving)


def _settled(result: object, mesh_ndim: int) -> Spec:
    """The spec a step's leading output leaves in: its producer's, with every partial sum
    reduced (replicated) so that each device holds final values."""
    if not isinstance(result, fx.Node) or result.op == "get_attr":
        return replicated(mesh_ndim)
    spec = value_spec(result)
    return tuple(Replicate() if isinstance(p, Partial) else p for p in spec)


def schedule_program(
    program: Program,
    mesh: tuple[int, ...],
    *,
    defer_gradients: bool = False,
    bucket_bytes: int = BUCKET_BYTES,
) -> CollectiveSchedule:
    """The schedule of ``program`` on ``mesh`` with its own specs: placeholders as chosen,
    results leaving as :func:`output_specs` (:func:`deferred_gradient_specs` with
    ``defer_gradients``)."""
    check_planned(program.graph, len(mesh))
    input_specs = [value_spec(node) for node in program.placeholders().values()]
    if defer_gradients:
        leaving = deferred_gradient_specs(program, mesh)
    else:
        leaving = output_specs(program, len(mesh))
    return _schedule(program.graph, mesh, input_specs, leaving, bucket_bytes)


def schedule_graph(
    graph: fx.Graph,
    mesh: tuple[int, ...],
    input_specs: Sequence[Spec],
    output_specs: Sequence[Spec],
    *,
    bucket_bytes: int = BUCKET_BYTES,
) -> CollectiveSchedule:
    """The schedule of any ``graph`` whose ops carry a chosen strategy, its placeholders laid
    out as ``input_specs`` and the tensors of its flat output tuple leaving as
    ``output_specs``. ``bucket_bytes``: at most this many bytes per device in a bucket; 0
    gives every conversion its own collectives where it is needed (no buckets, no gather
    groups)."""
    check_planned(graph, len(mesh))
    return _schedule(graph, mesh, input_specs, output_specs, bucket_bytes)


def _schedule(
    graph: fx.Graph,
    mesh: tuple[int, ...],
    input_specs: Sequence[Spec],
    output_specs: Sequence[Spec],
    bucket_bytes: int,
) -> CollectiveSchedule:
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if len(input_specs) != len(placeholders):
        raise LoweringError(
            f"{len(placeholders)} placeholders but {len(input_specs)} input specs were given"
        )
    specs = dict(zip(placeholders, input_specs, strict=True))
    # Which gathers travel together depends on global specs only: the same on every rank.
    if bucket_bytes:
        gathers = gather_groups(graph, specs, mesh)
    else:
        gathers = Gathers([], {}, {}, dict(specs))
    blocks = dispatched_blocks(graph)
    scheduler = _Scheduler(graph, mesh, bucket_bytes, gathers, exchanges_of(graph, blocks, mesh))
    inputs: dict[fx.Node, OpInputs] = {}
    leaving: Leaving | None = None
    for node in graph.nodes:
        if node.op == "placeholder":
            scheduler.specs[node] = (specs[node],)
        elif node.op == "output":
            leaving = scheduler.leave(node, output_specs)
        elif node.op == "get_attr":
            scheduler.specs[node] = (replicated(len(mesh)),)
        elif node.target is operator.getitem:
            source, index = node.args
            assert isinstance(source, fx.Node) and isinstance(index, int)
            scheduler.specs[node] = (scheduler.specs[source][index],)
        elif needs_strategy(node):
            inputs[node] = scheduler.op(node)
    assert leaving is not None, "a graph has an output node"
    dispatched = {node: (block, axis) for block, axis in blocks for node in block.nodes()}
    return CollectiveSchedule(
        mesh, scheduler.specs, inputs, leaving, gathers, tuple(scheduler.records),
        scheduler.exchanges, dispatched,
    )  # fmt: skip


class _Scheduler:
    """The decisions of one walk over a graph, in order (module docstring)."""

    def __init__(
        self,
        graph: fx.Graph,
        mesh: tuple[int, ...],
        bucket_bytes: int,
        gathers: Gathers,
        block_exchanges: dict[fx.Node, BlockExchange],
    ) -> None:
        self.graph = graph
        self.mesh = mesh
        self.bucket_bytes = bucket_bytes
        self.gathers = gathers
        self.specs: dict[fx.Node, tuple[Spec | None, ...]] = {}
        """Every value seen so far, with its layout."""
        self.converted: set[ConversionKey] = set()
        self.started: set[int] = set()
        """The gather groups started so far."""
        self.recomputed: set[fx.Node] = set()
        """The last views of the chains computed again so far."""
        self.records: list[CollectiveRecord] = []
        self.block_exchanges = block_exchanges
        self.exchanges: dict[fx.Node, Exchange] = {}

    def op(self, node: fx.Node) -> OpInputs:
        strategy = ir.require(node, Sharding).strategy
        arguments = tensor_inputs(node)
        if len(arguments) != len(strategy.inputs):
            raise LoweringError(
                f"node {node.name!r}: strategy {strategy} has {len(strategy.inputs)} input "
                f"specs but the op has {len(arguments)} tensor inputs"
            )
        phase = ir.require(node, ir.Region).phase
        actions: list[Action] = []
        reads = []
        for source, want in zip(arguments, strategy.inputs, strict=True):
            chain = self.gathers.chains.get((source, want)) if phase is ir.Phase.BACKWARD else None
            if chain is not None:
                reads.append(self._recompute(chain, node, actions))
            else:
                reads.append(self._convert(source, want, node, phase, actions))
        self.specs[node] = strategy.outputs
        exchange = self.block_exchanges.get(node)
        if exchange is not None:
            names = exchange.value.name, node.name
            record = CollectiveRecord(exchange.collective, exchange.axis, exchange.bytes, *names,
                                      phase)  # fmt: skip
            self.records.append(record)
            self.exchanges[node] = Exchange(exchange, record)
        return OpInputs(tuple(actions), tuple(reads))

    def leave(self, output: fx.Node, leaving: Sequence[Spec]) -> Leaving:
        """The results of ``output`` converted to ``leaving``: those that take only reductions
        (:func:`bucket_route`) in buckets, the others one by one."""
        values = output.args[0]
        assert isinstance(values, (tuple, list))
        if len(values) != len(leaving):
            raise LoweringError(
                f"the graph returns {len(values)} values but {len(leaving)} output specs were given"
            )
        actions: list[Action] = []
        reads: list[Read | None] = []
        members: list[Bucketed] = []
        for index, (result, spec) in enumerate(zip(values, leaving, strict=True)):
            if not isinstance(result, fx.Node):
                reads.append(None)
                continue
            route = self._route(result, spec) if self.bucket_bytes else None
            if route is None:
                reads.append(self._convert(result, spec, output, ir.Phase.OUTPUT, actions))
                continue
            current = self.specs[result][0]
            assert current is not None
            members.append(Bucketed.of(index, result, current, route, self.mesh))
            reads.append(None)
        order = {node: position for position, node in enumerate(self.graph.nodes)}
        buckets = []
        for members_of_bucket in cut_buckets(members, order, self.bucket_bytes):
            route = members_of_bucket[0].route
            nbytes = sum(member.nbytes for member in members_of_bucket)
            last = members_of_bucket[-1].source
            records = tuple(
                CollectiveRecord(route.kind, axis, nbytes, last.name, output.name, ir.Phase.OUTPUT)
                for axis in route.axes
            )
            self.records.extend(records)
            buckets.append(Bucket(route, tuple(members_of_bucket), records))
        return Leaving(tuple(leaving), tuple(actions), tuple(reads), tuple(buckets))

    def _route(self, result: fx.Node, spec: Spec) -> BucketRoute | None:
        """How ``result`` leaves in a bucket (a gradient summed over a data-parallel axis, or
        reduce-scattered to its fully sharded parameter), else None."""
        current = self.specs[result][0]
        if current is None or (result, spec, None) in self.converted:
            return None
        return bucket_route(current, spec, self.mesh)

    def _convert(
        self,
        source: fx.Node,
        want: Spec | None,
        consumer: fx.Node,
        phase: ir.Phase,
        actions: list[Action],
    ) -> Read:
        """``source`` read as ``want`` by ``consumer``: converted once per source and spec,
        however many consumers need it."""
        current = self.specs[source][0]
        assert current is not None
        if want is None or current == want:
            return Read(source)
        # A parameter (or its cast to the compute dtype) laid out differently from its use is
        # converted again in each phase (ZeRO-3: gathered before the forward and again before
        # the backward), so that the gathered copy need not live from one to the other. Other
        # values convert once.
        key = (source, want, phase if source in self.gathers.sources else None)
        if key in self.converted:
            return Read(source, key)
        group = self.gathers.group_of.get(key)  # type: ignore[arg-type]
        if group is not None:
            self._gather(group, consumer, actions)
            return Read(source, key)
        steps = reshard_steps(current, want, self.mesh)
        meta = ir.require(source, ir.ValueMeta).tensor
        early, records = [], []
        spec = current
        for position, step in enumerate(steps):
            early.append(step.kind == "all_reduce" and (position > 0 or source.op != "placeholder"))
            if step.is_collective:
                nbytes = piece_bytes(meta, spec, self.mesh)
                names = source.name, consumer.name
                records.append(CollectiveRecord(step.kind, step.axis, nbytes, *names, phase))
            spec = step.apply(spec)
        self.records.extend(records)
        self.converted.add(key)
        actions.append(Reshard(key, current, tuple(steps), tuple(early), tuple(records)))
        return Read(source, key)

    def _gather(self, group: GatherGroup, consumer: fx.Node, actions: list[Action]) -> None:
        """Wait for ``group``'s gather, starting it and the next group first if not yet
        started (the next one only once its values exist: a group of casts to the compute
        dtype starts at its own first use)."""
        groups = self.gathers.groups
        for index in (group.index, group.index + 1):
            if index >= len(groups) or index in self.started:
                continue
            starting = groups[index]
            if index > group.index and any(m.source not in self.specs for m in starting.members):
                break
            self.started.add(index)
            names = starting.members[0].source.name, consumer.name
            records = tuple(
                CollectiveRecord("all_gather", axis, nbytes, *names, starting.phase)
                for axis, nbytes in starting.sends(self.mesh)
            )
            self.records.extend(records)
            actions.append(StartGather(starting, records))
        actions.append(WaitGather(group))
        self.converted.update((m.source, m.spec, group.phase) for m in group.members)

    def _recompute(self, chain: ViewChain, consumer: fx.Node, actions: list[Action]) -> Read:
        """The last view of ``chain`` computed again from the backward's own gather of its
        placeholder (once per view), so that the forward's gathered copy dies with the
        forward."""
        last = chain.views[-1]
        if last not in self.recomputed:
            read = self._convert(chain.source, chain.spec, consumer, ir.Phase.BACKWARD, actions)
            actions.append(Recompute(chain, read))
            self.recomputed.add(last)
        return Read(last, recomputed=True)


__all__ = [
    "Action",
    "Bucket",
    "CollectiveRecord",
    "CollectiveSchedule",
    "ConversionKey",
    "Exchange",
    "Leaving",
    "OpInputs",
    "Read",
    "Recompute",
    "Reshard",
    "StartGather",
    "WaitGather",
    "check_planned",
    "deferred_gradient_specs",
    "output_specs",
    "schedule_graph",
    "schedule_program",
    "value_spec",
]
