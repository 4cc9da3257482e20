"""Pipeline stages that run an intra-op plan on a mesh of their own.

A pipeline of ``K`` stages on a cluster of mesh ``(K, *stage_mesh)`` gives each stage the
devices of one index of the first axis, a *stage mesh* on which it runs its share of an
intra-op plan (tensor parallelism, data parallelism, or whatever a solver chose). The plan is
made once, for the step captured at micro-batch size on the stage mesh, before the step is cut
into stages: :func:`~fxpar.pipeline.split.split_program` copies every node's chosen strategy
into the unit programs, and each unit is then lowered like a whole Program
(:func:`fxpar.lowering.lower_graph`) for one device's coordinate in its stage mesh.

What fixes the layout of each value at a unit's boundary:

- parameters, buffers and batch tensors: their planned specs; the whole batch's loss
  denominator (see :mod:`.semantics`): replicated;
- what a unit receives, sends, stashes or restores: the spec the plan chose for that value
  where it is computed, on both sides of the boundary. Device ``c`` of stage ``s`` exchanges
  with device ``c`` of stages ``s ± 1``, which holds the same piece, so nothing is converted on
  the way (a ``Partial`` value travels as its addends);
- unless the neighbouring stage runs another mesh (``Pipeline(stage_meshes=...)``), whose plan
  may lay the value out otherwise: then each side uses a *wire layout* derived from its own
  plan, and :mod:`.crossings` lists the messages between the two meshes (``crossings``);
- the loss and a forward program's outputs: replicated; a buffer update: its buffer's spec;
- a gradient: the spec the backward computed it in (often ``Partial`` over a data-parallel
  axis). The runtime sums it over micro-batches in that layout, and :class:`GradientSync`
  converts the sums to the parameters' layouts once per step, so a data-parallel axis
  all-reduces gradients once per step, not once per micro-batch.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.fx as fx

from fxpar import ir
from fxpar.cluster import Cluster, Coordinate
from fxpar.errors import LoweringError
from fxpar.lowering import CollectiveRecord, conversion_program, lower_graph, value_spec
from fxpar.lowering.collective_calls import Communicator
from fxpar.pipeline.crossings import Crossing, StageSide, crossing
from fxpar.pipeline.meshes import StageMeshes
from fxpar.pipeline.options import PipelineError
from fxpar.pipeline.split import SplitProgram, StageProgram, Value
from fxpar.runtime import fastcall
from fxpar.sharding import Spec, local_shape, replicated, shard_tensor


@dataclass(frozen=True)
class GradientSync:
    """Converts one stage's gradient sums from the layouts the backward produced them in to
    their parameters' layouts: a lowered program of collectives (and local slices) only."""

    gradients: tuple[str, ...]
    graph_module: fx.GraphModule
    records: tuple[CollectiveRecord, ...]
    communicator: Communicator
    grows: bool = False
    """Whether some gradient's piece is larger in the layout the backward made it in than in
    its parameter's: summing such pieces over several backward passes before converting them
    (:meth:`PipelineModel.no_sync <fxpar.pipeline.PipelineModel.no_sync>`) would take more
    memory, so they are converted in every pass."""

    def run(self, sums: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            converted = fastcall.run(
                self.graph_module, self.communicator, *(sums[n] for n in self.gradients)
            )
        return dict(zip(self.gradients, converted, strict=True))


@dataclass(frozen=True)
class ShardedStage:
    """One device's share of one stage: its lowered forward and backward, the gradient sync,
    and the layout of every tensor it is given."""

    stage: int
    cluster: Cluster
    """The stage mesh."""
    coordinate: Coordinate
    forward: StageProgram
    backward: StageProgram
    sync: GradientSync
    specs: Mapping[str, Spec]
    """The planned spec of each parameter, buffer and batch tensor, by name."""
    forward_collectives: tuple[CollectiveRecord, ...] = ()
    backward_collectives: tuple[CollectiveRecord, ...] = ()
    """What the lowered units run, per micro-batch."""
    crossings: Mapping[str, tuple[Crossing, ...]] = dataclasses.field(default_factory=dict)
    """With neighbours on other meshes: how each value of ``"forward_received"``,
    ``"forward_sent"``, ``"backward_received"`` and ``"backward_sent"`` crosses its boundary
    (in the channel's order); empty when every device exchanges with the same coordinate."""

    def local(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This device's piece of the whole parameter, buffer or batch tensor ``name``."""
        return shard_tensor(tensor, self.specs[name], self.cluster.mesh_shape, self.coordinate)


def shard_stage(
    split: SplitProgram,
    stage: int,
    cluster: Cluster,
    coordinate: Coordinate,
    communicator: Communicator,
    sides: Mapping[int, StageSide] | None = None,
) -> ShardedStage:
    """Lower stage ``stage`` of ``split`` (whose Program carries a plan for the stage mesh
    ``cluster``) for the device at ``coordinate``; its units run collectives on
    ``communicator``. ``sides``: this stage and its neighbours, by stage, when they run on
    other meshes (see :mod:`.crossings`); without it every neighbour has this stage's mesh and
    plan."""
    specs = planned_specs(split, cluster.mesh_shape)
    denominator = split.semantics.denominator
    if denominator is not None:  # the whole batch's, the same on every device
        specs[denominator.name] = replicated(len(cluster.mesh_shape))
    lower = _UnitLowering(split, cluster, coordinate, communicator, specs)
    crossings: dict[str, tuple[Crossing, ...]] = {}
    if sides is not None:
        crossings = _crossings(split, stage, sides)
        for key, unit, channel in _channels(split, stage):
            for value, item in zip(channel(unit), crossings[key], strict=True):
                wire = item.receive_spec if key.endswith("_received") else item.send_spec
                lower.wires[(key, value.name)] = wire
    forward, forward_collectives = lower.unit(split.forward[stage], "forward")
    backward, backward_collectives = lower.unit(split.backward[stage], "backward")
    return ShardedStage(
        stage=stage,
        cluster=cluster,
        coordinate=coordinate,
        forward=forward,
        backward=backward,
        sync=lower.sync(split.backward[stage], lower.gradient_specs),
        specs=specs,
        forward_collectives=forward_collectives,
        backward_collectives=backward_collectives,
        crossings=crossings,
    )


def planned_specs(split: SplitProgram, mesh: tuple[int, ...]) -> dict[str, Spec]:
    """The spec ``split``'s plan (made for a stage mesh of shape ``mesh``) gives each
    parameter, buffer and batch tensor, by name.

    Raises:
        PipelineError: the step carries no plan.
    """
    try:
        return {name: value_spec(node) for name, node in split.program.placeholders().items()}
    except LoweringError as error:
        raise PipelineError(f"the step has no plan for the stage mesh {mesh}: {error}") from error


def neighbour_sides(
    meshes: StageMeshes, stage: int, split_of: Callable[[int], SplitProgram]
) -> dict[int, StageSide]:
    """Stage ``stage`` and its neighbours as :mod:`.crossings` sees them: each one's mesh, its
    ranks, and the layout its own plan (in ``split_of(s)``) gives every value."""
    sides = {}
    for each in (stage - 1, stage, stage + 1):
        if 0 <= each < meshes.num_stages:
            nodes = {node.name: node for node in split_of(each).program.graph.nodes}
            spec_of = functools.partial(_spec_of, nodes)
            sides[each] = StageSide(meshes.shapes[each], meshes.ranks(each), spec_of)
    return sides


def _spec_of(nodes: Mapping[str, fx.Node], name: str) -> Spec:
    return value_spec(nodes[name])


def _channels(
    split: SplitProgram, stage: int
) -> list[tuple[str, StageProgram, Callable[[StageProgram], tuple[Value, ...]]]]:
    forward, backward = split.forward[stage], split.backward[stage]
    return [
        ("forward_received", forward, lambda unit: unit.received),
        ("forward_sent", forward, lambda unit: unit.sent),
        ("backward_received", backward, lambda unit: unit.received),
        ("backward_sent", backward, lambda unit: unit.sent),
    ]


def _crossings(
    split: SplitProgram, stage: int, sides: Mapping[int, StageSide]
) -> dict[str, tuple[Crossing, ...]]:
    """How every value stage ``stage`` exchanges crosses its boundary (module docstring)."""
    ends = {  # (sender, receiver) of each channel
        "forward_received": (stage - 1, stage),
        "forward_sent": (stage, stage + 1),
        "backward_received": (stage + 1, stage),
        "backward_sent": (stage, stage - 1),
    }
    found: dict[str, tuple[Crossing, ...]] = {}
    for key, unit, channel in _channels(split, stage):
        values = channel(unit)
        if not values:
            found[key] = ()
            continue
        sender, receiver = (sides[end] for end in ends[key])
        found[key] = tuple(
            crossing(v.meta.shape, v.meta.dtype.itemsize, v.name, sender, receiver) for v in values
        )
    return found


class _UnitLowering:
    def __init__(
        self,
        split: SplitProgram,
        cluster: Cluster,
        coordinate: Coordinate,
        communicator: Communicator,
        specs: Mapping[str, Spec],
    ) -> None:
        self.split = split
        self.mesh = cluster.mesh_shape
        self.coordinate = coordinate
        self.communicator = communicator
        self.specs = specs
        self.nodes = {node.name: node for node in split.program.graph.nodes}
        self.gradient_specs: dict[str, Spec] = {}
        self.wires: dict[tuple[str, str], Spec] = {}
        """The wire layout of each value exchanged with a neighbour on another mesh, by
        channel and name."""

    def unit(
        self, unit: StageProgram, half: str
    ) -> tuple[StageProgram, tuple[CollectiveRecord, ...]]:
        graph = unit.graph_module.graph
        inputs = [n for n in graph.nodes if n.op == "placeholder"]
        named = (*unit.parameters, *unit.buffers, *unit.batch)
        arriving = (*unit.received, *unit.restored)
        received, sent = f"{half}_received", f"{half}_sent"
        input_specs = [self.specs[name] for name in named]
        input_specs += [self._value_spec(value, received) for value in unit.received]
        input_specs += [self._value_spec(value) for value in unit.restored]
        assert len(inputs) == len(input_specs)

        (output,) = (n for n in graph.nodes if n.op == "output")
        results = list(output.args[0])
        output_specs = [self._value_spec(value, sent) for value in unit.sent]
        output_specs += [self._value_spec(value) for value in unit.stashed]
        if unit.loss:
            output_specs.append(replicated(len(self.mesh)))
        # The model's outputs leave whole on every device of the stage (gathered if need be).
        output_specs += [replicated(len(self.mesh)) for _ in unit.outputs]
        output_specs += [self.specs[name] for name in unit.buffer_updates]
        origins = dict(zip(inputs[len(named) :], (v.name for v in arriving), strict=True))
        for name, result in zip(unit.gradients, results[len(output_specs) :], strict=True):
            assert isinstance(result, fx.Node)
            origin = origins.get(result)
            spec = value_spec(self.nodes[origin] if origin is not None else result)
            self.gradient_specs[name] = spec
            output_specs.append(spec)

        lowered = lower_graph(
            unit.graph_module,
            self.mesh,
            self.coordinate,
            input_specs,
            output_specs,
            class_name=f"{type(unit.graph_module).__name__}Rank",
        )
        local = dataclasses.replace(
            unit,
            graph_module=lowered.graph_module,
            received=tuple(self._local(v, received) for v in unit.received),
            restored=tuple(self._local(v) for v in unit.restored),
            sent=tuple(self._local(v, sent) for v in unit.sent),
            stashed=tuple(self._local(v) for v in unit.stashed),
            communicator=self.communicator,
        )
        return local, lowered.records

    def sync(self, backward: StageProgram, natural: Mapping[str, Spec]) -> GradientSync:
        """The program taking each gradient of ``backward`` from ``natural`` to its
        parameter's spec."""
        names = backward.gradients
        placeholders = self.split.program.placeholders()
        lowered = conversion_program(
            [ir.require(placeholders[n], ir.ValueMeta).tensor for n in names],
            [natural[n] for n in names],
            [self.specs[n] for n in names],
            self.mesh,
            self.coordinate,
            class_name="GradientSync",
        )
        grows = any(
            ir.product(local_shape(shape, natural[n], self.mesh))
            > ir.product(local_shape(shape, self.specs[n], self.mesh))
            for n in names
            for shape in [ir.require(placeholders[n], ir.ValueMeta).tensor.shape]
        )
        return GradientSync(
            names, lowered.graph_module, lowered.records, self.communicator, grows=grows
        )

    def _value_spec(self, value: Value, channel: str = "") -> Spec:
        wire = self.wires.get((channel, value.name))
        return wire if wire is not None else value_spec(self.nodes[value.name])

    def _local(self, value: Value, channel: str = "") -> Value:
        spec = self._value_spec(value, channel)
        shape = local_shape([int(s) for s in value.meta.shape], spec, self.mesh)
        return Value(value.name, dataclasses.replace(value.meta, shape=shape))


def local_batch(stage: ShardedStage, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This device's pieces of one micro-batch's tensors, by name."""
    return {name: stage.local(name, tensor) for name, tensor in batch.items()}


def stage_devices(cluster: Cluster, num_stages: int) -> Cluster:
    """The stage mesh of a pipeline of ``num_stages`` stages on ``cluster``: its mesh without
    the first axis, which must have ``num_stages`` entries, with the links of the axes kept, and
    the memory of one device times ``num_stages`` (the plan made on it covers every stage's
    layers; a device holds about one stage's share)."""
    if cluster.ndim < 2 or cluster.mesh_shape[0] != num_stages:
        raise PipelineError(
            f"an intra-op plan inside {num_stages} pipeline stages needs a cluster mesh of "
            f"({num_stages}, *stage_mesh), whose first axis is the stages; got "
            f"{cluster.mesh_shape}"
        )
    return cluster.submesh(cluster.mesh_shape[1:])
