"""A planned step's time: its collective schedule priced, and how much of that communication
the compute between a collective's start and its wait hides.

:func:`price_schedule` prices the collectives of a planned Program's schedule (the ones the
lowering emits) and every edge as the cost model does, per consumer and without reuse (the
solver's communication term); the plan report and the stage DP read it.

The lowering does not run every collective where its value is needed: an all-reduce starts
right after its input is made and is waited for where it is read, a group of parameters'
all-gathers starts one layer ahead, the gradients' buckets start as soon as their last
gradient exists and are waited for where the step returns, and a dispatched mixture-of-experts
block's all-to-alls run blocking where their nodes run (:mod:`fxpar.planning.collective_schedule`
decides all of it). :func:`step_overlap` walks that schedule as one device runs it, with two
kinds of clocks: the device's compute, which runs the ops in graph order, each taking its
priced seconds (:func:`price_schedule`), and one link per mesh axis,
which runs that axis' collectives one at a time in the order they are issued, each taking its
alpha-beta seconds. A collective starts when its input exists and its link is free; the ops
after its start run meanwhile; an op that reads its result waits for it. A collective started
where it is needed (a blocking one) stops the compute for all of its time. The step is where
the compute clock ends, after the last wait.

This is the critical path of one device over its compute and its links, not the sum of the two:
communication is *exposed* where the compute waits for it and *hidden* where it runs beside
compute. It assumes a collective in flight slows no op down, which holds where the links have
engines of their own (GPUs); on CPU processes whose collectives share the cores with the ops,
the hidden part is partly paid for in slower ops.

Three terms sit outside the walk and are added to the step: the lowering's copies into and out
of its buckets, the optimizer's update (given its count of states), and on ranks that share a
host's cores the wait for the slowest rank at each synchronising collective (:func:`step_lag`).

The ILP keeps pricing every collective in full (its objective stays linear, one term per edge):
the exposed part of a collective depends on the compute scheduled between its start and its
wait, which depends on the plan of every op in between, a product of decisions. Pricing in full
is an upper bound that is exact for blocking collectives; the plan report gives both figures,
and docs/planning.md says how they compare with measured steps.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch.fx as fx

from fxpar import ir
from fxpar.cluster import Cluster
from fxpar.ir.program import Program
from fxpar.planning import cost
from fxpar.planning.collective_schedule import (
    Action,
    CollectiveRecord,
    CollectiveSchedule,
    Reshard,
    StartGather,
    WaitGather,
    schedule_program,
)
from fxpar.planning.grouping import holds_parameter, reread_in_backward
from fxpar.planning.moe_blocks import ExpertLoad, dispatched_ops
from fxpar.rules.registry import tensor_inputs
from fxpar.sharding import Sharding, Spec

# -- the schedule, priced ----------------------------------------------------------------------


@dataclass(frozen=True)
class PricedSchedule:
    """A planned Program's collective schedule with the cost model's prices (see the module
    docstring)."""

    schedule: CollectiveSchedule
    record_seconds: tuple[float, ...]
    """Alpha-beta seconds of each of ``schedule.records``, by
    :func:`fxpar.planning.cost.link_seconds`, less what of its axis' ``peer_wait`` the compute
    since the collective before it on that axis leaves unwaited
    (:meth:`fxpar.Cluster.peer_wait_seconds`, :func:`record_stretches`)."""
    compute: dict[fx.Node, float]
    """Roofline seconds of each op under its chosen strategy."""
    edge_seconds: float
    """Resharding seconds summed per consumer, as the cost model charges them, and the
    exchanges."""
    lag: float = 0.0
    """Seconds the step waits for its slowest rank at the collectives that synchronise the
    ranks, beyond their latency (:func:`step_lag`)."""
    copies: float = 0.0
    """Seconds the lowering spends packing each bucket of results and each gathered group of
    parameters into one buffer, and cutting a gathered buffer of several back into them
    (:func:`fxpar.planning.cost.copy_seconds`)."""
    update: float = 0.0
    """Seconds of the optimizer's update of this device's pieces of the trainable parameters
    (:func:`fxpar.planning.cost.update_seconds`; 0 where the optimizer was not given)."""

    @property
    def records(self) -> tuple[CollectiveRecord, ...]:
        return self.schedule.records

    @property
    def exchanges(self) -> dict[fx.Node, float]:
        """Seconds of the all-to-alls of dispatched mixture-of-experts blocks, by the node
        that runs each: their records' (:class:`~fxpar.planning.collective_schedule.Exchange`),
        priced at the busiest device (:func:`fxpar.planning.moe_blocks.exchange_seconds`)."""
        seconds = {id(r): s for r, s in zip(self.records, self.record_seconds, strict=True)}
        return {node: seconds[id(e.record)] for node, e in self.schedule.exchanges.items()}

    @property
    def step(self) -> float:
        """The step as lowered, every collective in full: each op's seconds, every collective
        of the schedule (a gather group's one all-gather, a bucket's one reduction, a
        dispatched block's exchanges, each with its latency) added up: a plan's estimated
        step where the cluster hides nothing behind compute (:func:`estimated_step`), the
        lag, the lowering's copies and the optimizer's update."""
        return self.compute_seconds + sum(self.record_seconds) + self.lag

    @property
    def compute_seconds(self) -> float:
        """The device's own work: its ops, the lowering's copies and the optimizer's update."""
        return sum(self.compute.values()) + self.copies + self.update

    @property
    def specs(self) -> dict[fx.Node, tuple[Spec | None, ...]]:
        """The layout of every value: what each node produces under its strategy."""
        return self.schedule.specs


def price_schedule(
    program: Program, cluster: Cluster, shared: bool = False, optimizer_states: int | None = None
) -> PricedSchedule:
    """The collective schedule of ``program``'s chosen strategies on ``cluster``, priced;
    ``shared``: a conversion several consumers share is priced once in ``edge_seconds``, as the
    problem of the plan priced it (:attr:`fxpar.planning.problem.Layout.shares`);
    ``optimizer_states``: the update of an optimizer of so many states is priced too."""
    mesh = cluster.mesh_shape
    schedule = schedule_program(program, mesh)
    specs = schedule.specs
    compute: dict[fx.Node, float] = {}
    # Uneven routing, as the plan was priced (fxpar.planning.problem.PlanOptions.expert_load).
    load = (program.get(ExpertLoad) or ExpertLoad()).factor
    loaded = dispatched_ops(program.graph) if load != 1 else set()
    exchanged = {id(e.record): e.exchange for e in schedule.exchanges.values()}
    edge_seconds = sum(e.price(cluster, load) for e in exchanged.values())
    converted: set[tuple[fx.Node, Spec]] = set()
    for node in program.graph.nodes:
        if node.op == "output":
            results = node.args[0]
            assert isinstance(results, (tuple, list))
            for result, spec in zip(results, schedule.leaving.specs, strict=True):
                if not isinstance(result, fx.Node):
                    continue
                current = specs[result][0]
                assert current is not None
                meta = ir.require(result, ir.ValueMeta).tensor
                # Priced as the cost model prices a result: in a bucket if only reductions.
                edge_seconds += cost.output_seconds(current, spec, meta, cluster)
            continue
        if node not in schedule.inputs:
            continue
        strategy = ir.require(node, Sharding).strategy
        phase = ir.require(node, ir.Region).phase
        for source, want in zip(tensor_inputs(node), strategy.inputs, strict=True):
            if want is None or (
                phase is ir.Phase.BACKWARD and (source, want) in schedule.gathers.chains
            ):
                continue  # a recomputed view: its gathers are priced at the forward's view
            current = specs[source][0]
            assert current is not None
            meta = ir.require(source, ir.ValueMeta).tensor
            # As the problem prices it: a parameter a forward view reads for the backward too
            # is gathered twice (fxpar.planning.grouping.ViewChain).
            parameter = holds_parameter(source)
            regathered = parameter and reread_in_backward(node)
            price = cost.regathered_seconds if regathered else cost.reshard_seconds
            if not parameter and shared:  # converted once for all its readers
                if (source, want) in converted:
                    continue
                converted.add((source, want))
            edge_seconds += price(current, want, meta, cluster)
        work = ir.get(node, ir.Cost)
        if work is not None:
            seconds = cost.compute_seconds(work, strategy, cluster)
            compute[node] = seconds * load if node in loaded else seconds
    lag = step_lag(program, schedule, compute, cluster) if cluster.lag_share else 0.0
    update = 0.0
    if optimizer_states is not None:
        placeholders = program.placeholders()
        for name in program.signature.gradients:
            node = placeholders[name]
            held = specs[node][0]
            assert held is not None
            piece = cost.local_bytes(ir.require(node, ir.ValueMeta).tensor, held, cluster)
            update += cost.update_seconds(piece, optimizer_states, cluster)
    copies = _copy_seconds(schedule, cluster)
    # A dispatched block's exchange is priced at its busiest device (ExpertLoad).
    record_seconds = tuple(
        exchanged[id(record)].price(cluster, load)
        if id(record) in exchanged
        else cost.link_seconds(record.kind, record.bytes, record.axis, cluster)
        for record in schedule.records
    )
    if any(cluster.peer_wait):
        # The wait for the last peer each latency holds, as far as the compute before each
        # collective since the last one on its axis lets the ranks drift apart.
        stretches = record_stretches(program, schedule, compute, tail=update)
        record_seconds = tuple(
            seconds
            - cluster.peer_wait[record.axis]
            + cluster.peer_wait_seconds(record.axis, stretches[id(record)])
            for record, seconds in zip(schedule.records, record_seconds, strict=True)
        )
    return PricedSchedule(schedule, record_seconds, compute, edge_seconds, lag, copies, update)


def _copy_seconds(schedule: CollectiveSchedule, cluster: Cluster) -> float:
    """What the lowering copies to run ``schedule``'s bucketed collectives: each bucket of
    results packed into one buffer, each gathered group's pieces too, and a gathered buffer of
    several parameters cut back into them (:mod:`fxpar.lowering.collective_calls`)."""
    seconds = sum(
        cost.copy_seconds(sum(member.nbytes for member in bucket.members), cluster)
        for bucket in schedule.leaving.buckets
    )
    for group in schedule.gathers.groups:
        if not group.axes:
            continue
        seconds += cost.copy_seconds(group.nbytes, cluster)
        if len(group.members) > 1:
            gathered = group.nbytes * math.prod(schedule.mesh[axis] for axis in group.axes)
            seconds += cost.copy_seconds(gathered, cluster)
    return seconds


def record_stretches(
    program: Program, schedule: CollectiveSchedule, compute: dict[fx.Node, float], tail: float
) -> dict[int, float]:
    """The seconds of compute before each collective of ``schedule`` (by ``id`` of its
    record) since the one before it on its mesh axis, in the order a device issues them: the
    collectives before each op in graph order (an op's own exchange, a dispatched MoE
    block's, after them), each bucket after its last member's op, the results' own
    conversions where the step returns. Steps repeat: the first collective on an
    axis follows the last one of the step before, and the ``tail`` seconds after the graph
    (the optimizer's update). ``compute`` holds each op's seconds. Collectives issued one
    after another (a layer's gather groups, buckets that start together) have none between
    them: the first one's wait brought the ranks together."""
    after: defaultdict[fx.Node, list[CollectiveRecord]] = defaultdict(list)
    for bucket in schedule.leaving.buckets:
        after[bucket.starts_after].extend(bucket.records)

    def walk(since: list[float]) -> tuple[dict[int, float], list[float]]:
        stretches: dict[int, float] = {}

        def issue(records: Sequence[CollectiveRecord]) -> None:
            for record in records:
                stretches[id(record)] = since[record.axis]
                since[record.axis] = 0.0

        for node in program.graph.nodes:
            inputs = schedule.inputs.get(node)
            for action in inputs.actions if inputs is not None else ():
                issue(_records(action))
            if node in schedule.exchanges:
                issue((schedule.exchanges[node].record,))
            seconds = compute.get(node, 0.0)
            since[:] = [stretch + seconds for stretch in since]
            issue(after.get(node, ()))
        for action in schedule.leaving.actions:
            issue(_records(action))
        return stretches, since

    _, ends = walk([math.inf] * len(schedule.mesh))
    stretches, _ = walk([end + tail for end in ends])
    return stretches


def _records(action: Action) -> tuple[CollectiveRecord, ...]:
    """The collectives ``action`` issues (a gather group's at its start)."""
    return action.records if isinstance(action, Reshard | StartGather) else ()


def _exchanges(schedule: CollectiveSchedule, node: fx.Node) -> bool:
    """Whether ``node`` runs an exchange of a dispatched MoE block with other devices (a
    blocking all-to-all: the ranks meet there)."""
    exchange = schedule.exchanges.get(node)
    return exchange is not None and schedule.mesh[exchange.record.axis] > 1


def step_lag(
    program: Program,
    schedule: CollectiveSchedule,
    compute: dict[fx.Node, float],
    cluster: Cluster,
) -> float:
    """What a step waits for its slowest rank beyond its collectives' latency, on ranks that
    share a host's cores (:meth:`fxpar.Cluster.lag_seconds`): the ranks drift apart while they
    compute, and catch up where one waits for the others' collective to end. Walking the
    graph in order, each wait (a conversion by collectives, a gather group's wait, a blocking
    exchange, and the results' collectives where the step returns) pays the lag of the compute
    since the last one. A step without collectives never waits for a peer: no lag."""
    lag = stretch = 0.0
    gathered: set[int] = set()
    for node in program.graph.nodes:
        inputs = schedule.inputs.get(node)
        if inputs is not None and any([_waits(action, gathered) for action in inputs.actions]):
            lag, stretch = lag + cluster.lag_seconds(stretch), 0.0
        if _exchanges(schedule, node):
            lag, stretch = lag + cluster.lag_seconds(stretch), 0.0
        stretch += compute.get(node, 0.0)
    leaving = schedule.leaving
    if leaving.buckets or any([_waits(action, gathered) for action in leaving.actions]):
        lag += cluster.lag_seconds(stretch)
    return lag


def _waits(action: Action, gathered: set[int]) -> bool:
    """Whether ``action`` waits for a collective (noting the gather groups started with
    one in ``gathered``: every action of a list is to be seen, in order)."""
    if isinstance(action, StartGather):
        if action.records:
            gathered.add(action.group.index)
        return False
    if isinstance(action, WaitGather):
        return action.group.index in gathered
    return isinstance(action, Reshard) and bool(action.records)


def estimated_step(
    priced: PricedSchedule,
    nodes: list[fx.Node],
    share: float,
    walked: StepOverlap | None = None,
) -> float:
    """A plan's estimated step (:attr:`fxpar.Plan.estimate`): its schedule priced
    (:attr:`PricedSchedule.step`), less ``share`` of the communication that runs beside
    compute (:func:`step_overlap`'s hidden part, over ``nodes``, the planned graph's in order;
    ``walked`` where the caller has walked it already). ``share`` is the cluster's
    :attr:`~fxpar.Cluster.hidden_share`: 0 adds every collective in full, 1 gives the critical
    path."""
    if share == 0:
        return priced.step
    walked = walked or step_overlap(priced, nodes)
    return priced.step - share * walked.hidden


# -- the critical path --------------------------------------------------------------------------


@dataclass(frozen=True)
class StepOverlap:
    """One device's step: its compute, its collectives' time, and how much of that the compute
    waited for."""

    compute: float
    communication: float
    """Seconds of every collective the device runs (the schedule's, priced)."""
    exposed: float
    """Seconds the compute waited for communication."""
    exposed_records: dict[int, float] = field(default_factory=dict)
    """Of ``exposed``, the seconds spent waiting for each collective of the schedule, by
    ``id`` of its record."""
    lag: float = 0.0
    """Seconds waited for the slowest rank beyond the collectives' time
    (:attr:`PricedSchedule.lag`): never hidden."""

    @property
    def hidden(self) -> float:
        """Seconds of communication that ran beside compute."""
        return self.communication - self.exposed

    @property
    def step(self) -> float:
        """The step's time: its compute and the waits, the lag's too."""
        return self.compute + self.exposed + self.lag


class _Clocks:
    """The device's compute clock and one clock per mesh axis' link."""

    def __init__(self, seconds: dict[int, float]) -> None:
        self.seconds = seconds
        self.now = 0.0
        self.link: defaultdict[int, float] = defaultdict(float)
        self.exposed = 0.0
        self.exposed_records: defaultdict[int, float] = defaultdict(float)

    def send(self, record: CollectiveRecord, ready: float) -> float:
        """Issue ``record`` on its link once ``ready``; when it ends."""
        start = max(ready, self.link[record.axis])
        end = self.link[record.axis] = start + self.seconds[id(record)]
        return end

    def wait(self, until: float, record: CollectiveRecord | None) -> None:
        """Wait until ``until``, for ``record`` (the collective that ends then)."""
        if until > self.now:
            assert record is not None
            self.exposed += until - self.now
            self.exposed_records[id(record)] += until - self.now
            self.now = until


def step_overlap(priced: PricedSchedule, nodes: list[fx.Node]) -> StepOverlap:
    """Walk ``priced``'s schedule over ``nodes`` (the planned graph's, in order) as in the
    module docstring."""
    schedule = priced.schedule
    clocks = _Clocks(
        {id(r): s for r, s in zip(schedule.records, priced.record_seconds, strict=True)}
    )
    done: dict[fx.Node, float] = {}
    gathered: dict[int, tuple[float, CollectiveRecord | None]] = {}
    late: dict[int, tuple[CollectiveRecord, ...]] = {}

    def run(actions: tuple[Action, ...]) -> None:
        for action in actions:
            if isinstance(action, Reshard):
                _reshard(action, done.get(action.source, 0.0), clocks)
            elif isinstance(action, StartGather):
                # The first axis' gather travels until its wait; the others run at the wait.
                index = action.group.index
                first, *rest = action.records or (None,)
                end = clocks.now if first is None else clocks.send(first, clocks.now)
                gathered[index] = (end, first)
                late[index] = tuple(rest)
            elif isinstance(action, WaitGather):
                index = action.group.index
                clocks.wait(*gathered.get(index, (clocks.now, None)))
                for record in late.pop(index, ()):
                    clocks.wait(clocks.send(record, clocks.now), record)

    for node in nodes:
        inputs = schedule.inputs.get(node)
        if inputs is not None:
            run(inputs.actions)
        clocks.now += priced.compute.get(node, 0.0)
        exchange = schedule.exchanges.get(node)
        if exchange is not None:  # blocking, on its axis' link once that is free
            clocks.wait(clocks.send(exchange.record, clocks.now), exchange.record)
        done[node] = clocks.now
    leaving = schedule.leaving
    ends: list[tuple[float, CollectiveRecord | None]] = []
    for bucket in leaving.buckets:
        ready = done[bucket.starts_after]
        for record in bucket.records:  # one per mesh axis of its route, in turn
            ready = clocks.send(record, ready)
        ends.append((ready, bucket.records[-1] if bucket.records else None))
    run(leaving.actions)
    clocks.wait(*max(ends, key=lambda end: end[0], default=(0.0, None)))
    return StepOverlap(
        compute=priced.compute_seconds,
        communication=sum(priced.record_seconds),
        exposed=clocks.exposed,
        exposed_records=dict(clocks.exposed_records),
        lag=priced.lag,
    )


def _reshard(action: Reshard, ready: float, clocks: _Clocks) -> None:
    """Run ``action``'s collective steps: one started early travels from when its input
    exists, the others run where the value is needed; the value is waited for there."""
    records = iter(action.records)
    last: CollectiveRecord | None = None
    for step, early in zip(action.steps, action.started_early, strict=True):
        if not step.is_collective:
            continue
        record = next(records)
        if early:
            ready = clocks.send(record, ready)
        else:
            clocks.wait(ready, last)
            ready = clocks.send(record, clocks.now)
            clocks.wait(ready, record)
        last = record
    clocks.wait(ready, last)
