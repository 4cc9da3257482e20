"""Lowering: a Program whose nodes carry chosen strategies becomes one program per rank.

Every placeholder and compute node of the Program must carry a :class:`~fxpar.sharding.Sharding`
annotation (``getitem`` follows its producer). For each rank, :func:`lower` walks the graph once:

- each tensor argument is resharded from its producer's spec to the spec the consumer's strategy
  requires, by the steps of :func:`fxpar.sharding.reshard.reshard_steps`: collectives become
  calls to :mod:`fxpar.lowering.collective_calls` on the ``comm`` input, local slices become
  ``aten.slice``;
- ops whose arguments spell out a shape (``view``, ``expand``, ...) get the local shape;
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
from torch.distributed.tensor import Partial, Replicate

from fxpar import ir
from fxpar.cluster import Cluster, Coordinate
from fxpar.errors import LoweringError
from fxpar.ir.program import Program, StepResult
from fxpar.lowering import collective_calls
from fxpar.lowering.grouping import (
    BUCKET_BYTES,
    Bucketed,
    GatherGroup,
    Gathers,
    ViewChain,
    cut_buckets,
    gather_groups,
    needs_strategy,
)
from fxpar.rules.registry import tensor_inputs
from fxpar.sharding import (
    Sharding,
    Spec,
    assemble,
    local_shape,
    replicated,
    shard_tensor,
    spec_str,
)
from fxpar.sharding.reshard import BucketRoute, ReshardStep, bucket_route, reshard_steps

aten = torch.ops.aten


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective in the per-rank programs: what, on which mesh axis, how many bytes each
    device contributes, and where (the consumer's phase; OUTPUT for gradient synchronisation)."""

    kind: str
    axis: int
    bytes: int
    tensor: str
    consumer: str
    phase: ir.Phase


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
    program: Program,
    cluster: Cluster,
    *,
    defer_gradients: bool = False,
    bucket_bytes: int = BUCKET_BYTES,
) -> SPMDProgram:
    """One GraphModule per rank of ``cluster`` from ``program`` and its chosen strategies.

    ``defer_gradients``: leave each gradient in the layout the backward made it in (partial
    sums, typically) wherever that takes no more memory than its parameter's layout, instead
    of converting it before the program returns (see :func:`deferred_gradient_specs`).

    ``bucket_bytes``: outputs that take only reductions (data parallelism's gradient sums,
    fully sharded gradients' reduce-scatters) are packed into buckets of at most this many
    bytes per device, one collective per bucket, route and dtype, started as soon as the
    bucket's last value is computed (:func:`cut_buckets`); the parameters a layer needs
    gathered are gathered together, the next layer's while this one computes
    (:func:`gather_groups`). 0 gives every conversion its own collectives, where it is
    needed."""
    _check_lowerable(program.graph, cluster.ndim)
    placeholders = [n for n in program.graph.nodes if n.op == "placeholder"]
    input_specs = tuple(value_spec(n) for n in placeholders)
    leaving = output_specs(program, cluster.ndim)
    if defer_gradients:
        leaving = deferred_gradient_specs(program, cluster.mesh_shape)
    ranks = []
    records: tuple[CollectiveRecord, ...] = ()
    # Which gathers travel together depends on global specs only: found once for every rank.
    by_placeholder = dict(zip(placeholders, input_specs, strict=True))
    gathers = _gathers(program.graph, by_placeholder, cluster.mesh_shape, bucket_bytes)
    for rank, coordinate in enumerate(cluster.coordinates()):
        lowered = _lower_checked(
            program.graph_module, cluster.mesh_shape, coordinate, input_specs, leaving,
            bucket_bytes=bucket_bytes, gathers=gathers,
        )  # fmt: skip
        if rank == 0:
            records = lowered.records
        ranks.append(RankProgram(rank, coordinate, lowered.graph_module, lowered.values))
    return SPMDProgram(
        program=program,
        cluster=cluster,
        ranks=tuple(ranks),
        input_specs=input_specs,
        output_specs=leaving,
        records=records,
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
    _check_lowerable(graph_module.graph, len(mesh_shape))
    return _lower_checked(
        graph_module, mesh_shape, coordinate, input_specs, output_specs, class_name,
        bucket_bytes=bucket_bytes,
    )  # fmt: skip


def _lower_checked(
    graph_module: fx.GraphModule,
    mesh_shape: tuple[int, ...],
    coordinate: Coordinate,
    input_specs: Sequence[Spec],
    output_specs: Sequence[Spec],
    class_name: str = "RankStep",
    *,
    bucket_bytes: int = BUCKET_BYTES,
    gathers: Gathers | None = None,
) -> LoweredGraph:
    """:func:`lower_graph` on a graph :func:`_check_lowerable` accepted (``gathers``: its
    :func:`_gathers`, when the caller has them)."""
    placeholders = [n for n in graph_module.graph.nodes if n.op == "placeholder"]
    if len(input_specs) != len(placeholders):
        raise LoweringError(
            f"{len(placeholders)} placeholders but {len(input_specs)} input specs were given"
        )
    lowering = _RankLowering(graph_module, mesh_shape, coordinate, bucket_bytes)
    specs = dict(zip(placeholders, input_specs, strict=True))
    if gathers is None:
        gathers = _gathers(graph_module.graph, specs, mesh_shape, bucket_bytes)
    module = lowering.run(specs, output_specs, class_name, gathers)
    values = {node.name: (local.name, specs) for node, (local, specs) in lowering.env.items()}
    return LoweredGraph(module, values, tuple(lowering.records))


def _gathers(
    graph: fx.Graph, specs: Mapping[fx.Node, Spec], mesh: tuple[int, ...], bucket_bytes: int
) -> Gathers:
    """The gather groups of ``graph`` (none when ``bucket_bytes`` turns grouping off)."""
    return gather_groups(graph, specs, mesh) if bucket_bytes else Gathers([], {}, {}, dict(specs))


def _check_lowerable(graph: fx.Graph, mesh_ndim: int) -> None:
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
    passes and converted once (:func:`conversion_program`): gradient accumulation then
    communicates once per update instead of once per micro-batch, as DDP's ``no_sync`` does.
    A gradient whose conversion makes it smaller (the reduce-scatter of a fully sharded plan)
    is converted in every pass, so accumulation never holds more than one piece of it."""
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


def _settled(result: object, mesh_ndim: int) -> Spec:
    """The spec a step's leading output leaves in: its producer's, with every partial sum
    reduced (replicated) so that each device holds final values."""
    if not isinstance(result, fx.Node) or result.op == "get_attr":
        return replicated(mesh_ndim)
    spec = value_spec(result)
    return tuple(Replicate() if isinstance(p, Partial) else p for p in spec)


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


class _RankLowering:
    def __init__(
        self,
        graph_module: fx.GraphModule,
        mesh: tuple[int, ...],
        coordinate: Coordinate,
        bucket_bytes: int = BUCKET_BYTES,
    ) -> None:
        self.bucket_bytes = bucket_bytes
        self.source = graph_module
        self.mesh = mesh
        self.coordinate = coordinate
        self.graph = fx.Graph()
        self.comm = self.graph.placeholder("comm")
        # Each original node maps to its local node and the spec of each of its outputs.
        self.env: dict[fx.Node, tuple[fx.Node, tuple[Spec | None, ...]]] = {}
        self.converted: dict[tuple[fx.Node, Spec, ir.Phase | None], fx.Node] = {}
        self.records: list[CollectiveRecord] = []

    def run(
        self,
        input_specs: Mapping[fx.Node, Spec],
        leaving: Sequence[Spec],
        class_name: str,
        gathers: Gathers,
    ) -> fx.GraphModule:
        self.gathers = gathers
        self.started: dict[int, fx.Node] = {}
        self.recomputed: dict[fx.Node, fx.Node] = {}
        for node in self.source.graph.nodes:
            if node.op == "placeholder":
                local = self.graph.placeholder(node.name)
                self.env[node] = (local, (input_specs[node],))
            elif node.op == "output":
                if len(node.args[0]) != len(leaving):
                    raise LoweringError(
                        f"the graph returns {len(node.args[0])} values but {len(leaving)} "
                        "output specs were given"
                    )
                self.graph.output(tuple(self._outputs(node, leaving)))
            elif node.op == "get_attr":
                self.env[node] = (self.graph.get_attr(node.target), (replicated(len(self.mesh)),))
            elif node.target is operator.getitem:
                source, index = node.args
                local_source, specs = self.env[source]
                local = self.graph.call_function(operator.getitem, (local_source, index))
                self.env[node] = (local, (specs[index],))
            elif needs_strategy(node):
                self._lower_op(node)
            else:
                raise LoweringError(f"cannot lower node {node.name!r} ({node.target})")
        overlap_all_reduces(self.graph)
        return fx.GraphModule(self.source, self.graph, class_name=class_name)

    def _outputs(self, output: fx.Node, leaving: Sequence[Spec]) -> list[Any]:
        """The output node's values converted to ``leaving``. Those that take only reductions
        (:func:`bucket_route`) travel in buckets: each bucket's collective starts right after
        its last value is computed and is waited on here, so it overlaps the rest of the
        backward."""
        results: list[Any] = []
        members: list[Bucketed] = []
        values = output.args[0]
        assert isinstance(values, (tuple, list))
        for index, (result, spec) in enumerate(zip(values, leaving, strict=True)):
            route = self._route(result, spec) if self.bucket_bytes else None
            if route is None:
                results.append(self._convert(result, spec, output, ir.Phase.OUTPUT))
                continue
            assert isinstance(result, fx.Node)
            current = self.env[result][1][0]
            assert current is not None
            members.append(Bucketed.of(index, result, current, route, self.mesh))
            results.append(None)
        order = {node: position for position, node in enumerate(self.source.graph.nodes)}
        previous: tuple[fx.Node, fx.Node] | None = None  # (last value, start) of the last bucket
        started = []
        for bucket in cut_buckets(members, order, self.bucket_bytes):
            last = bucket[-1].source
            anchor = previous[1] if previous and previous[0] is last else self.env[last][0]
            with self.graph.inserting_after(anchor):
                start = self._start_bucket(bucket)
            previous = (last, start)
            started.append((bucket, start))
            route = bucket[0].route
            for axis in route.axes:
                self.records.append(
                    CollectiveRecord(
                        route.kind, axis, sum(m.nbytes for m in bucket), last.name, output.name,
                        ir.Phase.OUTPUT,
                    )
                )  # fmt: skip
        for bucket, start in started:
            done = self.graph.call_function(collective_calls.wait_bucket, (self.comm, start))
            for position, member in enumerate(bucket):
                results[member.index] = self.graph.call_function(operator.getitem, (done, position))
        return results

    def _start_bucket(self, bucket: Sequence[Bucketed]) -> fx.Node:
        values = [self.env[member.source][0] for member in bucket]
        route = bucket[0].route
        if route.kind == "all_reduce":
            args: tuple[Any, ...] = (self.comm, values, route.axes)
            return self.graph.call_function(collective_calls.start_all_reduce_bucket, args)
        (axis,) = route.axes
        dims = tuple(member.route.dim for member in bucket)
        args = (self.comm, values, dims, axis, self.mesh[axis])
        return self.graph.call_function(collective_calls.start_reduce_scatter_bucket, args)

    def _route(self, result: object, spec: Spec) -> BucketRoute | None:
        """How ``result`` leaves in a bucket (a gradient summed over a data-parallel axis, or
        reduce-scattered to its fully sharded parameter), else None."""
        if not isinstance(result, fx.Node) or result not in self.env:
            return None
        current = self.env[result][1][0]
        if current is None or (result, spec, None) in self.converted:
            return None
        return bucket_route(current, spec, self.mesh)

    def _lower_op(self, node: fx.Node) -> None:
        strategy = ir.require(node, Sharding).strategy
        arguments = tensor_inputs(node)
        if len(arguments) != len(strategy.inputs):
            raise LoweringError(
                f"node {node.name!r}: strategy {strategy} has {len(strategy.inputs)} input "
                f"specs but the op has {len(arguments)} tensor inputs"
            )
        phase = ir.require(node, ir.Region).phase
        required = iter(strategy.inputs)

        def replace(arg: fx.Node) -> fx.Node:
            value = ir.require(arg, ir.ValueMeta)
            if value.multiple or value.outputs[0] is None:
                return self.env[arg][0]
            want = next(required)
            chain = self.gathers.chains.get((arg, want)) if phase is ir.Phase.BACKWARD else None
            if chain is not None:
                return self._recompute(chain, node)
            return self._convert(arg, want, consumer=node, phase=phase)

        self.env[node] = (self._emit_op(node, replace), strategy.outputs)

    def _emit_op(self, node: fx.Node, replace: Callable[[fx.Node], fx.Node]) -> fx.Node:
        """The local call of ``node`` on the local values ``replace`` gives for its inputs."""
        outputs = ir.require(node, Sharding).strategy.outputs
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), replace)
        args = localize_shape_arguments(node, tuple(args), outputs, self.mesh)
        # A local piece may be strided where the global tensor was contiguous (a slice, a
        # transposed shard): views become reshapes, which copy only when they must.
        target: Any = _VIEWS_AS_RESHAPE.get(node.target, node.target)  # type: ignore[call-overload]
        return self.graph.call_function(target, args, dict(kwargs))

    def _recompute(self, chain: ViewChain, consumer: fx.Node) -> fx.Node:
        """The last view of ``chain`` computed again from the backward's own gather of its
        placeholder (once per view), so that the forward's gathered copy dies with the
        forward."""
        last = chain.views[-1]
        if last not in self.recomputed:
            value = self._convert(chain.source, chain.spec, consumer, ir.Phase.BACKWARD)
            for view in chain.views:
                value = self._emit_op(view, _Constant(value))
            self.recomputed[last] = value
        return self.recomputed[last]

    def _convert(self, source: object, spec: Spec, consumer: fx.Node, phase: ir.Phase) -> Any:
        """The local value of ``source`` laid out as ``spec``, inserting the steps to get there
        (once per source and spec, however many consumers need it)."""
        if not isinstance(source, fx.Node):
            return source
        local, specs = self.env[source]
        current = specs[0]
        assert current is not None
        # A parameter (or its cast to the compute dtype) laid out differently from its use is
        # converted again in each phase (ZeRO-3: gathered before the forward and again before
        # the backward), so that the gathered copy need not live from one to the other. Other
        # values convert once.
        key = (source, spec, phase if source in self.gathers.sources else None)
        if current == spec:
            return local
        if key in self.converted:
            return self.converted[key]
        group = self.gathers.group_of.get(key)  # type: ignore[arg-type]
        if group is not None:
            self._gather(group, consumer)
            return self.converted[key]
        meta = ir.require(source, ir.ValueMeta).tensor
        value = local
        for step in reshard_steps(current, spec, self.mesh):
            value, current = self._emit(step, value, current, meta, consumer, phase, source)
        self.converted[key] = value
        return value

    def _gather(self, group: GatherGroup, consumer: fx.Node) -> None:
        """Wait for ``group``'s gather (starting it, and the next group's, if not yet
        started) and take its values."""
        for index in (group.index, group.index + 1):
            if index < len(self.gathers.groups) and index not in self.started:
                members = self.gathers.groups[index].members
                if index > group.index and any(m.source not in self.env for m in members):
                    break  # the next group's casts come later: it starts when first needed
                self.started[index] = self._start_gather(self.gathers.groups[index], consumer)
        done = self.graph.call_function(
            collective_calls.wait_bucket, (self.comm, self.started[group.index])
        )
        for position, member in enumerate(group.members):
            value = self.graph.call_function(operator.getitem, (done, position))
            self.converted[(member.source, member.spec, group.phase)] = value

    def _start_gather(self, group: GatherGroup, consumer: fx.Node) -> fx.Node:
        values = [self.env[member.source][0] for member in group.members]
        dims = tuple(member.dim for member in group.members)
        sizes = tuple(self.mesh[axis] for axis in group.axes)
        args = (self.comm, values, dims, group.axes, sizes)
        for axis, nbytes in group.sends(self.mesh):
            self.records.append(
                CollectiveRecord(
                    "all_gather", axis, nbytes, group.members[0].source.name, consumer.name,
                    group.phase,
                )
            )  # fmt: skip
        return self.graph.call_function(collective_calls.start_all_gather_bucket, args)

    def _emit(
        self,
        step: ReshardStep,
        value: fx.Node,
        spec: Spec,
        meta: ir.TensorMeta,
        consumer: fx.Node,
        phase: ir.Phase,
        source: fx.Node,
    ) -> tuple[fx.Node, Spec]:
        shape = local_shape(meta.shape, spec, self.mesh)
        after = step.apply(spec)
        call: Callable[..., Any]
        args: tuple[Any, ...]
        if step.kind == "slice":
            assert step.dim is not None
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
        nbytes = ir.product((*shape, meta.dtype.itemsize))
        self.records.append(
            CollectiveRecord(step.kind, step.axis, int(nbytes), source.name, consumer.name, phase)
        )
        if step.kind == "all_gather":
            call, args = collective_calls.all_gather, (self.comm, value, step.dim, step.axis)
        elif step.kind == "all_reduce":
            return self._all_reduce(value, step.axis), after
        elif step.kind == "reduce_scatter":
            call, args = collective_calls.reduce_scatter, (self.comm, value, step.dim, step.axis)
        else:
            call = collective_calls.all_to_all
            args = (self.comm, value, step.to_dim, step.dim, step.axis)
        return self.graph.call_function(call, args), after

    def _all_reduce(self, value: fx.Node, axis: int) -> fx.Node:
        """The sum of ``value`` over ``axis``, started right after ``value`` is computed and
        waited on here, where it is needed."""
        args = (self.comm, value, axis)
        if value.op == "placeholder":  # placeholders come first; nothing to overlap
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
        needed = set(start.all_input_nodes)
        node = start.prev
        while node.op == "call_function" and node.target not in _ORDERED:
            previous = node.prev
            if node in needed:
                needed.update(node.all_input_nodes)
            else:
                start.append(node)
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
