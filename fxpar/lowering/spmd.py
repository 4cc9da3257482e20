"""Lowering: a Program whose nodes carry chosen strategies becomes one program per rank.

Every placeholder and compute node of the Program must carry a :class:`~fxpar.sharding.Sharding`
annotation (``getitem`` follows its producer). What every value must become, and which
collectives do it, where they start and where they are waited for, is decided once for all ranks
by the collective schedule (:mod:`fxpar.planning.collective_schedule`). For each rank,
:func:`lower` walks the graph once and emits that schedule as code:

- each conversion the schedule lists becomes its steps: collectives become calls to
  :mod:`fxpar.lowering.collective_calls` on the ``comm`` input, local slices become ``aten.slice``;
  grouped gathers and buckets become one call per group or bucket, started and waited for where
  the schedule says;
- ops whose arguments spell out a shape (``view``, ``expand``, ...) get the local shape;
- a strategy whose pieces the op itself cannot compute (a grouped product's experts split)
  becomes the local call its op family gives (:mod:`fxpar.rules.local`);
- a mixture-of-experts block whose tokens the plan dispatches by all-to-all has its routing
  sort and boundaries lowered around the schedule's exchanges
  (:class:`~fxpar.planning.collective_schedule.Exchange`): each exchange is one call of
  :mod:`fxpar.lowering.collective_calls`, between the local calls of
  :mod:`fxpar.lowering.expert_dispatch` that order the rows for it;
- outputs leave in their required specs: the loss replicated (a forward's outputs as
  computed, partial sums reduced), each gradient in its parameter's
  spec (this is where data parallelism's gradient all-reduce appears), each buffer update in its
  buffer's spec.

Any valid assignment of strategies lowers to per-rank programs that compute, together, exactly
what the Program computes (up to floating-point reassociation): the property the tests check.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.distributed.tensor import Shard

from fxpar import ir
from fxpar.cluster import Cluster, Coordinate
from fxpar.errors import LoweringError
from fxpar.ir.program import Program, StepResult
from fxpar.lowering import collective_calls, expert_dispatch
from fxpar.planning.collective_schedule import (
    Action,
    Bucket,
    CollectiveRecord,
    CollectiveSchedule,
    ConversionKey,
    Read,
    Recompute,
    Reshard,
    StartGather,
    WaitGather,
    schedule_graph,
    schedule_program,
    value_spec,
)
from fxpar.planning.grouping import BUCKET_BYTES, GatherGroup, needs_strategy
from fxpar.planning.plan import Plan
from fxpar.rules.local import has_local_calls, local_call
from fxpar.rules.registry import op_call
from fxpar.sharding import Sharding, Spec, assemble, local_shape, shard_tensor
from fxpar.sharding.reshard import ReshardStep

aten = torch.ops.aten


@dataclass(frozen=True)
class RankProgram:
    rank: int
    coordinate: Coordinate
    graph_module: fx.GraphModule
    values: dict[str, tuple[str, tuple[Spec | None, ...]]]
    """For each node of the global Program: the local node holding its value, and its specs."""

    def code(self) -> str:
        return self.graph_module.code


@dataclass(frozen=True)
class SPMDProgram:
    """The per-rank programs of a lowered Program, with the specs of its inputs and outputs."""

    program: Program
    cluster: Cluster
    ranks: tuple[RankProgram, ...]
    input_specs: tuple[Spec, ...]
    output_specs: tuple[Spec, ...]
    records: tuple[CollectiveRecord, ...]

    def collectives(self) -> list[CollectiveRecord]:
        """Every collective the programs run, in order (the same on every rank)."""
        return list(self.records)

    def for_rank(self, rank: int) -> RankProgram:
        return self.ranks[rank]

    def local_inputs(
        self, flat_inputs: Sequence[torch.Tensor], coordinate: Coordinate
    ) -> list[torch.Tensor]:
        """This device's pieces of the global placeholders."""
        mesh = self.cluster.mesh_shape
        return [
            shard_tensor(t, spec, mesh, coordinate)
            for t, spec in zip(flat_inputs, self.input_specs, strict=True)
        ]

    def assemble_outputs(self, per_rank: Mapping[Coordinate, Sequence[torch.Tensor]]) -> StepResult:
        """The global outputs, named, from every device's local outputs."""
        mesh = self.cluster.mesh_shape
        outputs = [
            assemble({c: outs[i] for c, outs in per_rank.items()}, spec, mesh)
            for i, spec in enumerate(self.output_specs)
        ]
        return self.program.signature.name_outputs(outputs)


# Ops whose argument at this index spells out the (global) shape of output 0.
_SHAPE_ARGUMENTS: dict[object, tuple[int, int]] = {
    aten.view.default: (1, 0),
    aten._unsafe_view.default: (1, 0),
    aten.reshape.default: (1, 0),
    aten.view_copy.default: (1, 0),
    aten.expand.default: (1, 0),
    aten.select_backward.default: (1, 0),
    aten.slice_backward.default: (1, 0),
    aten.new_zeros.default: (1, 0),
    aten.new_ones.default: (1, 0),
    aten.new_empty.default: (1, 0),
    aten.new_full.default: (1, 0),
    aten.convolution_backward.default: (3, 2),  # bias_sizes: the bias gradient's shape
}


_VIEWS_AS_RESHAPE = {
    aten.view.default: aten.reshape.default,
    aten._unsafe_view.default: aten.reshape.default,
}


def lower(
    program: Program | Plan,
    cluster: Cluster | None = None,
    *,
    defer_gradients: bool = False,
    bucket_bytes: int = BUCKET_BYTES,
) -> SPMDProgram:
    """One GraphModule per rank of ``cluster`` from ``program`` and its chosen strategies:
    ``lower(plan)`` for a :class:`~fxpar.planning.plan.Plan` (on the cluster it was planned
    for), or ``lower(program, cluster)`` for a Program whose nodes carry their shardings.

    ``defer_gradients``: leave each gradient in the layout the backward made it in (partial
    sums, typically) wherever that takes no more memory than its parameter's layout, instead
    of converting it before the program returns (see
    :func:`fxpar.planning.collective_schedule.deferred_gradient_specs`).

    ``bucket_bytes``: outputs that take only reductions (data parallelism's gradient sums,
    fully sharded gradients' reduce-scatters) are packed into buckets of at most this many
    bytes per device, one collective per bucket, route and dtype, started as soon as the
    bucket's last value is computed; the parameters a layer needs gathered are gathered
    together, the next layer's while this one computes
    (:mod:`fxpar.planning.collective_schedule`). 0 gives every conversion its own
    collectives, where it is needed."""
    if isinstance(program, Plan):
        program, cluster = program.program, cluster or program.cluster
    if cluster is None:
        raise LoweringError("lower(program, cluster) needs the cluster to lower a Program for")
    # Every rank runs the same collectives: the schedule is made once, for all of them.
    schedule = schedule_program(
        program, cluster.mesh_shape, defer_gradients=defer_gradients, bucket_bytes=bucket_bytes
    )
    input_specs = tuple(value_spec(node) for node in program.placeholders().values())
    ranks = []
    for rank, coordinate in enumerate(cluster.coordinates()):
        lowered = _emit(program.graph_module, schedule, coordinate)
        ranks.append(RankProgram(rank, coordinate, lowered.graph_module, lowered.values))
    return SPMDProgram(
        program=program,
        cluster=cluster,
        ranks=tuple(ranks),
        input_specs=input_specs,
        output_specs=schedule.leaving.specs,
        records=schedule.records,
    )


@dataclass(frozen=True)
class LoweredGraph:
    """One device's program lowered from an annotated graph (see :func:`lower_graph`)."""

    graph_module: fx.GraphModule
    values: dict[str, tuple[str, tuple[Spec | None, ...]]]
    """For each node of the source graph: the local node holding its value, and its specs."""
    records: tuple[CollectiveRecord, ...]


def lower_graph(
    graph_module: fx.GraphModule,
    mesh_shape: tuple[int, ...],
    coordinate: Coordinate,
    input_specs: Sequence[Spec],
    output_specs: Sequence[Spec],
    *,
    class_name: str = "RankStep",
    bucket_bytes: int = BUCKET_BYTES,
) -> LoweredGraph:
    """The program of the device at ``coordinate`` for any graph whose compute nodes carry a
    :class:`~fxpar.sharding.Sharding`: its placeholders arrive laid out as ``input_specs``
    and the tensors of its flat output tuple leave as ``output_specs``. The lowered module
    takes the communicator first, then the local pieces of the placeholders.

    :func:`lower` calls it with a Program's own specs; pipeline stages call it with the specs
    of the values crossing their boundaries.
    """
    schedule = schedule_graph(
        graph_module.graph, mesh_shape, input_specs, output_specs, bucket_bytes=bucket_bytes
    )
    return _emit(graph_module, schedule, coordinate, class_name)


def _emit(
    graph_module: fx.GraphModule,
    schedule: CollectiveSchedule,
    coordinate: Coordinate,
    class_name: str = "RankStep",
) -> LoweredGraph:
    """The program of the device at ``coordinate``: ``schedule`` (of ``graph_module``'s
    graph) emitted as code."""
    lowering = _RankLowering(graph_module, schedule, coordinate)
    module = lowering.run(class_name)
    values = {node.name: (local.name, specs) for node, (local, specs) in lowering.env.items()}
    return LoweredGraph(module, values, schedule.records)


def conversion_program(
    metas: Sequence[ir.TensorMeta],
    sources: Sequence[Spec],
    targets: Sequence[Spec],
    mesh_shape: tuple[int, ...],
    coordinate: Coordinate,
    *,
    class_name: str = "Conversion",
) -> LoweredGraph:
    """A program of collectives (and local slices) only, that takes the communicator and one
    local piece of each tensor of ``metas`` laid out as ``sources`` and returns each laid out
    as ``targets``."""
    graph = fx.Graph()
    inputs = []
    for index, meta in enumerate(metas):
        node = graph.placeholder(f"value_{index}")
        ir.annotate(node, ir.ValueMeta((meta,)))
        ir.annotate(node, ir.Region(ir.Phase.INPUT, ""))
        inputs.append(node)
    graph.output(tuple(inputs))
    module = fx.GraphModule(torch.nn.Module(), graph, class_name=class_name)
    return lower_graph(module, mesh_shape, coordinate, sources, targets, class_name=class_name)


def localize_shape_arguments(
    node: fx.Node, args: tuple[Any, ...], specs: tuple[Spec | None, ...], mesh: tuple[int, ...]
) -> tuple[Any, ...]:
    """``args`` of ``node`` with any argument that spells out an output's global shape
    replaced by that output's local shape under ``specs``."""
    entry = _SHAPE_ARGUMENTS.get(node.target)
    if entry is None:
        return args
    index, output = entry
    spec = specs[output]
    meta = ir.require(node, ir.ValueMeta).outputs[output]
    if spec is None or meta is None or index >= len(args):
        return args
    shape = local_shape(meta.shape, spec, mesh)
    return (*args[:index], list(shape), *args[index + 1 :])


_INFERRED_SIZES = (aten.view.default, aten._unsafe_view.default, aten.reshape.default,
                   aten.expand.default)  # fmt: skip
"""Ops whose shape argument may say ``-1`` for a size the input gives."""


def _rows_inferred(node: fx.Node, args: tuple[Any, ...], specs: tuple[Spec | None, ...]) -> Any:
    """``args`` of a dispatched MoE block's view or expand with its split dim (the rows, as
    many as routing sent this device) written ``-1``."""
    entry = _SHAPE_ARGUMENTS.get(node.target)
    spec = specs[0]
    if entry is None or spec is None:
        return args
    split = {p.dim for p in spec if isinstance(p, Shard)}
    if node.target not in _INFERRED_SIZES:
        raise LoweringError(f"{node.name} ({node.target}) sizes rows of a dispatched MoE block")
    shape = [-1 if d in split else size for d, size in enumerate(args[entry[0]])]
    return (*args[: entry[0]], shape, *args[entry[0] + 1 :])


class _RankLowering:
    """One rank's program: the source graph's ops on local pieces, with the schedule's
    conversions emitted where it puts them."""

    def __init__(
        self, graph_module: fx.GraphModule, schedule: CollectiveSchedule, coordinate: Coordinate
    ) -> None:
        self.source = graph_module
        self.schedule = schedule
        self.mesh = schedule.mesh
        self.coordinate = coordinate
        self.graph = fx.Graph()
        self.comm = self.graph.placeholder("comm")
        # Each original node maps to its local node and the spec of each of its outputs.
        self.env: dict[fx.Node, tuple[fx.Node, tuple[Spec | None, ...]]] = {}
        self.converted: dict[ConversionKey, fx.Node] = {}
        self.started: dict[int, fx.Node] = {}
        """The start of each gather group, by index."""
        self.recomputed: dict[fx.Node, fx.Node] = {}
        """The local value of each view the backward computes again."""
        self.dispatched = schedule.dispatched
        """The MoE blocks whose tokens the plan dispatches by all-to-all, by node."""
        self.routes: dict[fx.Node, tuple[fx.Node, fx.Node, fx.Node]] = {}
        """Each dispatched block's route, by its sort, with the splits of its dispatches'
        and of its combines' exchanges."""

    def run(self, class_name: str) -> fx.GraphModule:
        specs = self.schedule.specs
        for node in self.source.graph.nodes:
            if node.op == "placeholder":
                self.env[node] = (self.graph.placeholder(node.name), specs[node])
            elif node.op == "output":
                self.graph.output(tuple(self._outputs(node)))
            elif node.op == "get_attr":
                self.env[node] = (self.graph.get_attr(node.target), specs[node])
            elif node in self.dispatched and node not in self.dispatched[node][0].region:
                self._lower_dispatch(node)
            elif node.target is operator.getitem:
                source, index = node.args
                local = self.graph.call_function(operator.getitem, (self.env[source][0], index))
                self.env[node] = (local, specs[node])
            elif needs_strategy(node):
                self._lower_op(node)
            else:
                raise LoweringError(f"cannot lower node {node.name!r} ({node.target})")
        overlap_all_reduces(self.graph)
        return fx.GraphModule(self.source, self.graph, class_name=class_name)

    def _value(self, read: Read) -> fx.Node:
        """The local node holding what ``read`` reads."""
        if read.recomputed:
            return self.recomputed[read.source]
        if read.key is not None:
            return self.converted[read.key]
        return self.env[read.source][0]

    def _lower_op(self, node: fx.Node) -> None:
        inputs = self.schedule.inputs[node]
        for action in inputs.actions:
            self._act(action)
        reads = iter(inputs.reads)

        def replace(arg: fx.Node) -> fx.Node:
            value = ir.require(arg, ir.ValueMeta)
            if value.multiple or value.outputs[0] is None:
                return self.env[arg][0]
            return self._value(next(reads))

        self.env[node] = (self._emit_op(node, replace), self.schedule.specs[node])

    def _lower_dispatch(self, node: fx.Node) -> None:
        """A node of a dispatched MoE block's routing or boundaries, around the schedule's
        exchanges: the sort becomes this device's rows counted per expert, the count
        exchange and the route of its rows (:func:`expert_dispatch.route`); the offsets
        become its own experts' offsets; each boundary the rows ordered for its exchange,
        the exchange, and the rows ordered as they arrive (a dispatch's grouped by expert, a
        combine's back in slot order). The rest of the routing (permutations, zero buffers)
        has no local counterpart."""
        block, axis = self.dispatched[node]
        spec = self.schedule.specs[node]
        inputs = self.schedule.inputs.get(node)
        for action in inputs.actions if inputs is not None else ():
            self._act(action)
        reads = iter(inputs.reads if inputs is not None else ())
        exchange = self.schedule.exchanges.get(node)

        def local(arg: fx.Node) -> fx.Node:
            for read in reads:
                if read.source is arg:
                    return self._value(read)
            return self.env[arg][0]

        call = self.graph.call_function
        if node is block.sort:
            assert exchange is not None, "a dispatched block's sort exchanges its counts"
            ids = local(block.expert_ids)
            counts = call(expert_dispatch.expert_counts, (ids, block.num_experts))
            on = exchange.record.axis
            received = call(collective_calls.exchange_counts, (self.comm, counts, on))
            offsets = ir.require(block.offsets, ir.ValueMeta).tensor.dtype
            piece = (self.coordinate[axis], self.mesh[axis], offsets)
            route = call(expert_dispatch.route, (ids, counts, received, *piece))
            there = call(expert_dispatch.route_splits, (route,))
            back = call(expert_dispatch.return_splits, (route,))
            self.routes[node] = (route, there, back)
            self.env[node] = (route, spec)
            return
        if block.sort not in self.routes:
            raise LoweringError(f"{node.name} of an MoE block comes before its routing sort")
        route, there, back = self.routes[block.sort]
        if node is block.offsets:
            self.env[node] = (call(expert_dispatch.route_offsets, (route,)), spec)
        elif node.target is operator.getitem and node.args == (block.sort, 0):
            self.env[node] = (call(expert_dispatch.route_expert_ids, (route,)), spec)
        elif node in block.boundaries:
            assert exchange is not None, "each boundary of a dispatched block exchanges rows"
            kind, moved = block.boundaries[node]
            value, on = local(moved), exchange.record.axis
            if kind in expert_dispatch.DISPATCHES:
                extra = (block.top_k,) if kind == "dispatch_tokens" else ()
                sent = call(expert_dispatch.DISPATCHES[kind], (route, value, *extra))
                arrived = call(collective_calls.exchange_rows, (self.comm, sent, there, on))
                made = call(expert_dispatch.grouped, (route, arrived))
            else:
                sent = call(expert_dispatch.ungrouped, (route, value))
                arrived = call(collective_calls.exchange_rows, (self.comm, sent, back, on))
                extra = (block.top_k,) if kind == "combine_tokens" else ()
                made = call(expert_dispatch.COMBINES[kind], (route, arrived, *extra))
            self.env[node] = (made, spec)
        else:
            self.env[node] = (route, spec)  # read only by the boundaries, which use the route

    def _emit_op(self, node: fx.Node, replace: Callable[[fx.Node], fx.Node]) -> fx.Node:
        """The local call of ``node`` on the local values ``replace`` gives for its inputs:
        its own op, or the call its op family gives for this strategy
        (:mod:`fxpar.rules.local`: a device's own experts' rows)."""
        strategy = ir.require(node, Sharding).strategy
        outputs = strategy.outputs
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), replace)
        args = localize_shape_arguments(node, tuple(args), outputs, self.mesh)
        if node in self.dispatched:
            args = _rows_inferred(node, args, outputs)
        if has_local_calls(node.target) and node not in self.dispatched:
            local = local_call(op_call(node, self.mesh), strategy, self.coordinate)
            if local is not None:
                call_args = (*local.static, *args)
                return self.graph.call_function(local.function, call_args, dict(kwargs))
        # A local piece may be strided where the global tensor was contiguous (a slice, a
        # transposed shard): views become reshapes, which copy only when they must.
        target: Any = _VIEWS_AS_RESHAPE.get(node.target, node.target)  # type: ignore[call-overload]
        return self.graph.call_function(target, args, dict(kwargs))

    def _outputs(self, output: fx.Node) -> list[Any]:
        """The output node's values as the schedule makes them leave: converted one by one,
        or from buckets, each started right after its last value is computed and waited on
        here, so it overlaps the rest of the backward."""
        leaving = self.schedule.leaving
        for action in leaving.actions:
            self._act(action)
        values = output.args[0]
        assert isinstance(values, (tuple, list))
        results: list[Any] = [
            value if not isinstance(value, fx.Node) or read is None else self._value(read)
            for value, read in zip(values, leaving.reads, strict=True)
        ]
        previous: tuple[fx.Node, fx.Node] | None = None  # (last value, start) of the last bucket
        started = []
        for bucket in leaving.buckets:
            last = bucket.starts_after
            # Buckets after the same value start in the schedule's order.
            anchor = previous[1] if previous and previous[0] is last else self.env[last][0]
            with self.graph.inserting_after(anchor):
                start = self._start_bucket(bucket)
            previous = (last, start)
            started.append((bucket, start))
        for bucket, start in started:
            done = self.graph.call_function(collective_calls.wait_bucket, (self.comm, start))
            for position, member in enumerate(bucket.members):
                results[member.index] = self.graph.call_function(operator.getitem, (done, position))
        return results

    def _start_bucket(self, bucket: Bucket) -> fx.Node:
        values = [self.env[member.source][0] for member in bucket.members]
        route = bucket.route
        if route.kind == "all_reduce":
            args: tuple[Any, ...] = (self.comm, values, route.axes)
            return self.graph.call_function(collective_calls.start_all_reduce_bucket, args)
        (axis,) = route.axes
        dims = tuple(member.route.dim for member in bucket.members)
        args = (self.comm, values, dims, axis, self.mesh[axis])
        return self.graph.call_function(collective_calls.start_reduce_scatter_bucket, args)

    def _act(self, action: Action) -> None:
        """Emit one action of the schedule."""
        if isinstance(action, Reshard):
            value = self.env[action.source][0]
            spec = action.have
            meta = ir.require(action.source, ir.ValueMeta).tensor
            for step, early in zip(action.steps, action.started_early, strict=True):
                value, spec = self._step(step, value, spec, meta, early)
            self.converted[action.key] = value
        elif isinstance(action, StartGather):
            self.started[action.group.index] = self._start_gather(action.group)
        elif isinstance(action, WaitGather):
            group = action.group
            start = self.started[group.index]
            done = self.graph.call_function(collective_calls.wait_bucket, (self.comm, start))
            for position, member in enumerate(group.members):
                value = self.graph.call_function(operator.getitem, (done, position))
                self.converted[(member.source, member.spec, group.phase)] = value
        else:
            self._recompute(action)

    def _recompute(self, action: Recompute) -> None:
        """The views of a chain computed again from the backward's own gather of their
        parameter, so that the forward's gathered copy dies with the forward."""
        value = self._value(action.read)
        for view in action.chain.views:
            value = self._emit_op(view, _Constant(value))
        self.recomputed[action.chain.views[-1]] = value

    def _start_gather(self, group: GatherGroup) -> fx.Node:
        values = [self.env[member.source][0] for member in group.members]
        dims = tuple(member.dim for member in group.members)
        sizes = tuple(self.mesh[axis] for axis in group.axes)
        args = (self.comm, values, dims, group.axes, sizes)
        return self.graph.call_function(collective_calls.start_all_gather_bucket, args)

    def _step(
        self, step: ReshardStep, value: fx.Node, spec: Spec, meta: ir.TensorMeta, early: bool
    ) -> tuple[fx.Node, Spec]:
        """One step of a conversion on the local ``value`` laid out as ``spec``."""
        after = step.apply(spec)
        call: Callable[..., Any]
        args: tuple[Any, ...]
        if step.kind == "slice":
            assert step.dim is not None
            shape = local_shape(meta.shape, spec, self.mesh)
            piece = shape[step.dim] // self.mesh[step.axis]
            start = self.coordinate[step.axis] * piece
            node = self.graph.call_function(
                aten.slice.Tensor, (value, step.dim, start, start + piece)
            )
            # Some CPU kernels (native_layer_norm_backward among them) misread strided
            # inputs, and every other producer of a local piece is contiguous: copy the slice.
            node = self.graph.call_function(
                aten.clone.default, (node,), {"memory_format": torch.contiguous_format}
            )
            return node, after
        if step.kind == "to_partial":
            if self.coordinate[step.axis] == 0:
                return value, after
            return self.graph.call_function(aten.zeros_like.default, (value,)), after
        if step.kind == "all_gather":
            call, args = collective_calls.all_gather, (self.comm, value, step.dim, step.axis)
        elif step.kind == "all_reduce":
            return self._all_reduce(value, step.axis, early), after
        elif step.kind == "reduce_scatter":
            call, args = collective_calls.reduce_scatter, (self.comm, value, step.dim, step.axis)
        else:
            call = collective_calls.all_to_all
            args = (self.comm, value, step.to_dim, step.dim, step.axis)
        return self.graph.call_function(call, args), after

    def _all_reduce(self, value: fx.Node, axis: int, early: bool) -> fx.Node:
        """The sum of ``value`` over ``axis``: started right after ``value`` is computed and
        waited on here when ``early``, else one blocking call here."""
        args = (self.comm, value, axis)
        if not early:
            return self.graph.call_function(collective_calls.all_reduce, args)
        with self.graph.inserting_after(value):
            started = self.graph.call_function(collective_calls.start_all_reduce, args)
        return self.graph.call_function(collective_calls.wait_all_reduce, (started,))


_ORDERED = frozenset({
    *collective_calls.COLLECTIVE_FUNCTIONS,
    collective_calls.wait_all_reduce,
    collective_calls.wait_bucket,
})  # fmt: skip
"""Calls that keep their place: every rank must issue its collectives in one order."""


def overlap_all_reduces(graph: fx.Graph) -> None:
    """Give each started all-reduce something to travel behind: the ops before its start that
    the summed value does not need move after the start, and the ops after its wait that do
    not need the sum move before the wait, in order, as far as the nearest collective (a
    tensor-parallel layer's weight gradient while its input gradient is summed). A start with
    nothing left between it and its wait becomes one blocking all-reduce, which skips the
    hand-off to the communication thread and back."""
    for start in list(
        graph.find_nodes(op="call_function", target=collective_calls.start_all_reduce)
    ):
        # Ops before the start that the summed value does not need go after it, in order.
        # An element taken out of an op's tuple stays with the op: moved alone, it would keep
        # the whole tuple (a BatchNorm's output beside its statistics) alive until the start.
        needed = set(start.all_input_nodes)
        moved: set[fx.Node] = set()
        node = start.prev
        while node.op == "call_function" and node.target not in _ORDERED:
            previous = node.prev
            if node in needed:
                needed.update(node.all_input_nodes)
            elif node.target is not operator.getitem:
                start.append(node)
                moved.add(node)
                anchor = node
                for user in list(node.users):
                    if user.target is operator.getitem and user not in moved:
                        anchor.append(user)
                        moved.add(user)
                        anchor = user
            node = previous
    for wait in list(graph.find_nodes(op="call_function", target=collective_calls.wait_all_reduce)):
        needs_sum = {wait}
        node = wait.next
        while node.op == "call_function" and node.target not in _ORDERED:
            following = node.next
            if any(arg in needs_sum for arg in node.all_input_nodes):
                needs_sum.add(node)
            else:
                wait.prepend(node)
            node = following
        (start,) = wait.all_input_nodes
        if start.next is wait:
            with graph.inserting_before(start):
                blocking = graph.call_function(collective_calls.all_reduce, start.args)
            wait.replace_all_uses_with(blocking)
            graph.erase_node(wait)
            graph.erase_node(start)


@dataclass(frozen=True)
class _Constant:
    """The replacement of a view's one input: always ``value``."""

    value: fx.Node

    def __call__(self, _: fx.Node) -> fx.Node:
        return self.value
