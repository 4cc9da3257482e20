"""Choose pipeline stages automatically: layer clustering and Alpa's stage DP on a captured step.

:func:`plan_stages` picks the split points and the devices per stage of a :class:`Pipeline` for a
captured Program on a Cluster; :func:`evaluate_split` scores split points chosen by hand with the
same costs. Both return a :class:`StageChoice`, whose ``pipeline`` runs as is on
:class:`~fxpar.pipeline.PipelineModel`.

**Atoms.** A stage may begin at a *cut candidate*: a repeated layer (``blocks.3``) or another
module at the depth of the repeated layers' container (``wte``, ``ln_f``, ``head``, ``<loss>``;
``transformer.wte`` when the layers are ``transformer.h.i``), in forward order. The model's first
such module is not a candidate (stage 0 starts with the model). :func:`partition` with every
candidate as a split point checks them and assigns each node, backward nodes included (they
follow their forward op), to an *atom*: the ops between two consecutive candidates.

**Layers.** With more than ``layers`` atoms (default 16, since the stage DP is cubic in the
layers), :func:`~fxpar.solvers.layers.cluster_layers` (Alpa's layer construction) merges them
into that many contiguous layers of balanced cost (forward plus backward seconds) that cut the
fewest bytes, counted at every boundary a value crosses (``count="per_boundary"``), because the
runtime relays a value through the stages in between.

**Costs of layers ``[i, j)`` on ``d`` devices** (the stage time and memory of
:class:`~fxpar.solvers.stages.StageCost`). ``program`` is the step on the *global* batch; the
runtime cuts it into ``M`` micro-batches and each of the stage's ``d`` replicas takes ``1/d`` of
each, so work and activations scale by ``1 / (M d)`` (assumed linear in the batch):

    time   = (T_fwd + T_bwd + [remat] T_fwd) / (M d)                     compute
           + allreduce(G, d) / M                                          gradients, once a step
           + [i > 0] (alpha + B_back(i) / (M d) / beta)                   gradients sent back
           + [j < L] (alpha + B_fwd(j) / (M d) / beta)                    activations sent on
    static = (2 + optimizer_states) G + S   (+ [remat] A_saved / (M d), one recompute at a time)
    activation per micro-batch in flight
           = A_saved / (M d)                       without remat
           = (B_fwd(i) + A_batch) / (M d)          with remat (only what the stage received)

``T`` is the roofline time of a node on one device, ``max(flops / F, bytes moved / memory
bandwidth)``, summed over the range's forward or backward nodes; ``G`` the bytes of trainable
parameters the range reads (each holder of a tied weight counts it), ``S`` of its buffers and frozen
parameters; ``A_saved`` the bytes of the forward values (batch tensors included, views counted once
at their base, parameters not at all) the range's backward reads; ``A_batch`` the batch tensors it
reads; ``B_fwd(c)`` and ``B_back(c)`` the bytes of the values crossing the boundary before atom
``c`` forwards and backwards. ``allreduce`` is :func:`fxpar.planning.cost.collective_seconds`
(``alpha + 2 (d-1)/d G / beta``) on the innermost mesh axis that holds ``d`` consecutive ranks (a
stage's replicas are consecutive ranks); sends use the slowest axis, which some pair of neighbouring
stages may cross. The gradient reduction is charged ``1/M`` of it per micro-batch, so it enters the
step time once per step for the slowest stage. Costs are cached per (atom range, d).

**Search.** The runtime gives every stage the same ``d`` devices, so for every ``d`` dividing the
world size ``D`` (and ``M d`` dividing the batch) with ``K = D / d`` stages no more than the
layers, :func:`~fxpar.solvers.stages.solve_stages` solves a problem on mesh ``(D,)`` whose only
submesh is ``(d,)``, minimizing ``sum_k t_k + (M - 1) max_k t_k`` under ``cluster.memory`` per
device with the schedule's micro-batches in flight; the best ``d`` wins. This is Alpa's "intra-op
plan cost for each (layer range, submesh)", restricted to the one intra-op plan the pipeline
runtime runs inside a stage: data parallelism.

**Intra-op plans inside stages** (``stage_planner``, which :func:`fxpar.compile` passes when a
solver, pins, options or rules are given with ``stages="auto"``). Then a stage of ``d`` devices
runs an intra-op plan on a stage mesh ``(d,)`` (with the links of the innermost mesh axis that
holds ``d`` consecutive ranks), and the costs come from that plan. For every ``d``, the step is
planned once on the stage mesh (``stage_planner(program, stage_cluster)``, the ILP by default),
and the plan is read the way the plan report reads it (:func:`fxpar.planning.report.walk`): per
node, its roofline seconds under its strategy and the collectives it runs, with the bytes each
device holds of every value. Layers ``[i, j)`` then cost, per micro-batch (``1/M`` of the
planned step's work, assumed linear in the batch as above):

    time   = (T_fwd + T_bwd + [remat] T_fwd + C) / M + C_grad / M + sends of local bytes
    static = (2 + optimizer_states) G_local + S_local   (+ [remat] A_saved_local / M)

where ``C`` are the seconds of the collectives the range's ops run and ``C_grad`` those that
bring its gradients into their parameters' layouts (once a step). The plan is made for the whole
step, so each range is costed under the strategies that plan chose for it, not re-planned per
range; with repeated layers that is the same plan. Each stage mesh is planned with
``cluster.memory`` times the number of stages it implies, since a device holds about one
stage's share of the weights the plan covers. Stages share one stage-mesh shape, as the runtime
requires, and the search is over ``d`` as above.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch.fx as fx

from fxpar import ir
from fxpar.cluster import Cluster
from fxpar.ir.program import Program
from fxpar.passes.annotate_cost import AnnotateCost
from fxpar.pipeline.options import Pipeline, PipelineError
from fxpar.pipeline.partition import partition
from fxpar.planning.cost import collective_seconds
from fxpar.planning.manual import require_concrete_shapes
from fxpar.solvers.errors import format_bytes
from fxpar.solvers.layers import DataEdge, cluster_layers
from fxpar.solvers.stages import (
    StageCost,
    StageMemoryError,
    StagePlan,
    StageProblem,
    evaluate_stages,
    solve_stages,
)

if TYPE_CHECKING:
    from fxpar.planning.plan import Plan

logger = logging.getLogger(__name__)

StagePlanner = Callable[[Program, Cluster], "Plan"]
"""Plans a captured step on a stage mesh, e.g. ``fxpar.planning.plan.plan_program``."""

DEFAULT_MAX_LAYERS = 16
"""Atoms beyond this many are clustered into layers: the stage DP is cubic in the layers."""


@dataclass(frozen=True)
class DegreeOutcome:
    """What one data-parallel degree gave: its best step time, or why it was not possible."""

    data_parallel: int
    num_stages: int
    step_time: float | None
    reason: str = ""


@dataclass(frozen=True)
class StageChoice:
    """A pipeline chosen (or scored) on fxpar's cost model (module docstring).

    Attributes:
        pipeline: what to run: split points by module name, ``data_parallel`` devices per
            stage, and the micro-batches, schedule and remat asked for.
        plan: the stage DP's plan over layer indices (``plan.stages[k].start`` ...).
        layers: the modules of every layer the DP saw, in forward order.
        stage_modules: the modules of every stage.
        step_time: estimated seconds per training step, ``sum t + (M - 1) max t``.
        memory: estimated bytes per device on every stage, with its micro-batches in flight.
        memory_limit: the bytes per device allowed (``cluster.memory``).
        degrees: every devices-per-stage count ``plan_stages`` considered, in increasing
            order, with its best step time or why it could not run (empty for
            ``evaluate_split``).
    """

    pipeline: Pipeline
    plan: StagePlan
    layers: tuple[tuple[str, ...], ...]
    stage_modules: tuple[tuple[str, ...], ...]
    step_time: float
    memory: tuple[float, ...]
    memory_limit: float
    degrees: tuple[DegreeOutcome, ...] = ()
    stage_cluster: Cluster | None = None
    """The stage mesh each stage runs its intra-op plan on (``stage_planner``); None when the
    stages run data-parallel replicas."""

    @property
    def split_points(self) -> tuple[str, ...]:
        stages = self.pipeline.stages
        assert isinstance(stages, tuple)
        return stages

    @property
    def devices_per_stage(self) -> int:
        if self.stage_cluster is not None:
            return self.stage_cluster.world_size
        return self.pipeline.data_parallel

    @property
    def cut_points(self) -> tuple[str, ...]:
        """Where each layer but the first begins: every split point the DP could choose."""
        return tuple(modules[0] for modules in self.layers[1:])

    def report(self) -> str:
        """A text table: one row per stage, then the data-parallel degrees tried."""
        pipeline = self.pipeline
        d = self.devices_per_stage
        lines = [
            f"pipeline: {pipeline.num_stages} stage(s) x {d} device(s), {pipeline.microbatches} "
            f"micro-batches, {pipeline.schedule}, remat {'on' if pipeline.remat else 'off'}: "
            f"{_format_seconds(self.step_time)} per step (estimated), memory limit "
            f"{format_bytes(self.memory_limit)} per device",
            f"split points: {', '.join(self.split_points) or '(none)'}",
        ]
        if self.stage_cluster is not None:
            lines.append(f"inside each stage: an intra-op plan on {self.stage_cluster}")
        header = ("stage", "modules", "devices", "time/micro-batch", "memory/device", "in flight")
        rows = [
            (
                str(index),
                _module_span(modules),
                f"{d} (ranks {index * d}-{index * d + d - 1})" if d > 1 else f"1 (rank {index})",
                _format_seconds(stage.time),
                format_bytes(stage.memory),
                str(stage.in_flight),
            )
            for index, (stage, modules) in enumerate(
                zip(self.plan.stages, self.stage_modules, strict=True)
            )
        ]
        widths = [max(len(row[c]) for row in (header, *rows)) for c in range(len(header))]
        for row in (header, *rows):
            lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)))
        if self.degrees:
            tried = []
            for outcome in self.degrees:
                result = (
                    _format_seconds(outcome.step_time)
                    if outcome.step_time is not None
                    else outcome.reason
                )
                stages = f"{outcome.num_stages} stage{'s' if outcome.num_stages > 1 else ''}"
                tried.append(f"d={outcome.data_parallel} ({stages}): {result}")
            lines.append("devices per stage tried: " + "; ".join(tried))
        return "\n".join(line.rstrip() for line in lines)

    def to_dict(self) -> dict[str, Any]:
        """Plain data for JSON."""
        pipeline = self.pipeline
        return {
            "pipeline": {
                "stages": list(self.split_points),
                "microbatches": pipeline.microbatches,
                "schedule": pipeline.schedule,
                "remat": pipeline.remat,
                "data_parallel": pipeline.data_parallel,
                "stage_mesh": (list(self.stage_cluster.mesh_shape) if self.stage_cluster else None),
            },
            "step_time": self.step_time,
            "memory_limit": self.memory_limit,
            "layers": [list(modules) for modules in self.layers],
            "stages": [
                {
                    "modules": list(modules),
                    "layers": [stage.start, stage.stop],
                    "devices": stage.devices,
                    "time": stage.time,
                    "memory": stage.memory,
                    "in_flight": stage.in_flight,
                }
                for stage, modules in zip(self.plan.stages, self.stage_modules, strict=True)
            ],
            "degrees": [dataclasses.asdict(outcome) for outcome in self.degrees],
        }


def plan_stages(
    program: Program,
    cluster: Cluster,
    pipeline: Pipeline,
    *,
    optimizer_states: int = 2,
    layers: int | None = None,
    stage_planner: StagePlanner | None = None,
) -> StageChoice:
    """The split points and devices per stage of least estimated step time (module docstring).

    ``program`` is the training step captured on the global batch; ``pipeline`` gives the
    micro-batches, schedule and remat (its ``stages`` and ``data_parallel`` are what this
    chooses). ``optimizer_states`` counts tensors the optimizer keeps per parameter (2 for
    AdamW, 0 for SGD without momentum); ``layers`` caps the layers the DP sees (default
    :data:`DEFAULT_MAX_LAYERS`). ``stage_planner``: stages run an intra-op plan on their
    devices, made by ``stage_planner`` (module docstring), instead of data-parallel replicas.

    Raises:
        StageMemoryError: no split fits ``cluster.memory``; ``least_memory`` is what the most
            frugal one needs per device.
        PipelineError: no devices-per-stage count divides both the world and the batch with at
            most as many stages as cut points.
    """
    max_layers = DEFAULT_MAX_LAYERS if layers is None else layers
    if max_layers < 1:
        raise PipelineError(f"layers must be a positive number of layers, got {layers}")
    require_concrete_shapes(program, "choosing pipeline stages")
    model = _cost_model(program, cluster, pipeline, optimizer_states, stage_planner, ())
    atoms = model.atoms
    starts = _cluster_atoms(model, min(max_layers, atoms.count))
    layer_names = tuple(
        tuple(m for atom in range(a, b) for m in atoms.modules[atom])
        for a, b in itertools.pairwise((*starts, atoms.count))
    )
    world = cluster.world_size
    outcomes: list[DegreeOutcome] = []
    best: tuple[StagePlan, int] | None = None
    memory_errors: list[StageMemoryError] = []
    for d in _divisors(world):
        stages = world // d
        # A plan splits the batch itself; replicas each take an equal piece of it.
        replicas = d if stage_planner is None else 1
        reason = _degree_obstacle(atoms, pipeline, replicas, stages, len(starts))
        if reason:
            outcomes.append(DegreeOutcome(d, stages, None, reason))
            continue
        problem = _problem(model, starts, d, world)
        try:
            plan = solve_stages(problem, stages)
        except StageMemoryError as error:
            memory_errors.append(error)
            outcomes.append(
                DegreeOutcome(d, stages, None, f"needs {format_bytes(error.least_memory)}")
            )
            continue
        outcomes.append(DegreeOutcome(d, stages, plan.objective))
        logger.debug("%d devices per stage: step %.3g s", d, plan.objective)
        if best is None or plan.objective < best[0].objective:
            best = (plan, d)
    if best is None:
        if memory_errors:
            least = min(error.least_memory for error in memory_errors)
            raise StageMemoryError(
                f"no pipeline of this step fits in {format_bytes(cluster.memory)} per device on "
                f"{world} devices: the most frugal needs {format_bytes(least)} per device "
                f"({least:.0f} bytes). Use more devices, remat=True, the 1f1b schedule, or an "
                f"optimizer with less state; tried: "
                + "; ".join(f"d={o.data_parallel}: {o.reason}" for o in outcomes),
                least_memory=least,
                memory_limit=cluster.memory,
            )
        raise PipelineError(
            f"no pipeline runs this step on {world} devices: "
            + "; ".join(f"d={o.data_parallel}: {o.reason}" for o in outcomes)
        )
    plan, d = best
    choice = _choice(atoms, starts, layer_names, plan, d, pipeline, cluster, tuple(outcomes))
    return _with_stage_mesh(choice, cluster, d) if stage_planner else choice


def evaluate_split(
    program: Program,
    cluster: Cluster,
    pipeline: Pipeline,
    *,
    optimizer_states: int = 2,
    stage_planner: StagePlanner | None = None,
) -> StageChoice:
    """Score ``pipeline``'s split points (module names) and ``data_parallel`` with the costs of
    :func:`plan_stages`. ``pipeline.world_size`` must equal the cluster's. With
    ``stage_planner``, each of the ``K`` stages runs an intra-op plan on ``world / K`` devices
    instead (``data_parallel`` must be 1).

    Raises:
        PipelineError: the split points are not module names in forward order, or the pipeline
            does not use exactly the cluster's devices, or the batch does not divide.
        StageMemoryError: the split does not fit ``cluster.memory``.
    """
    if not isinstance(pipeline.stages, tuple):
        raise PipelineError(
            f"evaluate_split scores split points by module name, got stages={pipeline.stages!r}; "
            "use plan_stages to choose them"
        )
    world, stages = cluster.world_size, pipeline.num_stages
    if stage_planner is not None:
        if pipeline.data_parallel != 1 or world % stages:
            raise PipelineError(
                f"{stages} stages with an intra-op plan inside each need data_parallel=1 and a "
                f"world that divides into them, got data_parallel={pipeline.data_parallel} and "
                f"{world} devices"
            )
    elif pipeline.world_size != world:
        raise PipelineError(
            f"{pipeline.num_stages} stages x {pipeline.data_parallel} devices per stage use "
            f"{pipeline.world_size} devices, but the cluster has {cluster.world_size}"
        )
    partition(program, pipeline.stages)  # its errors name a bad or misordered split point
    model = _cost_model(
        program, cluster, pipeline, optimizer_states, stage_planner, pipeline.stages
    )
    atoms = model.atoms
    d = world // stages
    reason = _batch_obstacle(atoms, pipeline, pipeline.data_parallel)
    if reason:
        raise PipelineError(f"{pipeline.data_parallel} devices per stage: {reason}")
    starts = tuple(range(atoms.count))
    boundaries = [atoms.index_of(point) for point in pipeline.stages]
    problem = _problem(model, starts, d, world)
    plan = evaluate_stages(problem, boundaries, [(d,)] * stages)
    layer_names = tuple(atoms.modules)
    choice = _choice(atoms, starts, layer_names, plan, d, pipeline, cluster, ())
    return _with_stage_mesh(choice, cluster, d) if stage_planner else choice


def _cost_model(
    program: Program,
    cluster: Cluster,
    pipeline: Pipeline,
    optimizer_states: int,
    stage_planner: StagePlanner | None,
    extra_points: Sequence[str],
) -> _CostModel:
    if stage_planner is None:
        atoms = _Atoms.build(program, extra_points)
        return _CostModel(atoms, cluster, pipeline, optimizer_states)
    # Planning canonicalizes the graph; do it before the atoms take its nodes.
    from fxpar.planning.plan import prepare_for_planning

    prepare_for_planning(program, _stage_cluster(cluster, 1))
    atoms = _Atoms.build(program, extra_points)
    return _PlannedCostModel(atoms, cluster, pipeline, optimizer_states, stage_planner)


def _with_stage_mesh(choice: StageChoice, cluster: Cluster, devices: int) -> StageChoice:
    return dataclasses.replace(
        choice,
        pipeline=dataclasses.replace(choice.pipeline, data_parallel=1),
        stage_cluster=_stage_cluster(cluster, devices),
    )


# -- atoms: the ops between two cut candidates ------------------------------------------------


@dataclass(frozen=True)
class _Atoms:
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
    def build(program: Program, extra_points: Sequence[str]) -> _Atoms:
        _ensure_costs(program)
        forward = [n for n in program.graph.nodes if _region(n).phase is ir.Phase.FORWARD]
        units = _units(forward)
        first = {name: _first_position(forward, name) for name in extra_points}
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
        for name, position in units:
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
        forward_crossing, backward_crossing, edges = _crossings(program, atom_of, count)
        return _Atoms(
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


def _ensure_costs(program: Program) -> None:
    if any(n.op != "output" and ir.get(n, ir.Cost) is None for n in program.graph.nodes):
        AnnotateCost().run(program)


def _region(node: fx.Node) -> ir.Region:
    return ir.require(node, ir.Region)


def _units(forward: Sequence[fx.Node]) -> list[tuple[str, int]]:
    """Cut candidates ``(module name, first forward position)`` in forward order, the model's
    first module included: the repeated layers, and other modules cut to the depth of their
    container. Modules above that depth (the root, the container's parents) run between
    candidates and go with the one before them."""
    containers: dict[str, list[str]] = {}
    for node in forward:
        parts = _region(node).module.split(".")
        for depth, part in enumerate(parts):
            if part.isdigit():
                layers = containers.setdefault(".".join(parts[:depth]), [])
                layer = ".".join(parts[: depth + 1])
                if layer not in layers:
                    layers.append(layer)
                break
    container = max(containers, key=lambda c: len(containers[c]), default=None)
    depth = len(container.split(".")) if container else 1
    units: dict[str, int] = {}
    for position, node in enumerate(forward):
        module = _region(node).module
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
    return sorted(units.items(), key=lambda item: item[1])


def _first_position(forward: Sequence[fx.Node], module: str) -> int:
    for position, node in enumerate(forward):
        name = _region(node).module
        if name == module or name.startswith(module + "."):
            return position
    raise PipelineError(f"split point {module!r} names no module that runs in the forward pass")


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
        size = _output_bytes(node)
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


def _output_bytes(node: fx.Node) -> int:
    cost = ir.get(node, ir.Cost)
    if cost is not None:
        return ir.evaluate(cost.output_bytes)
    return sum(ir.evaluate(t.nbytes) for t in ir.require(node, ir.ValueMeta).tensors)


def _crossings(
    program: Program,
    atom_of: dict[fx.Node, int],
    count: int,
    nbytes_of: Callable[[fx.Node], int] | None = None,
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[DataEdge, ...]]:
    nbytes_of = nbytes_of or _output_bytes
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


def _node_seconds(node: fx.Node, cluster: Cluster) -> float:
    cost = ir.get(node, ir.Cost)
    if cost is None:
        return 0.0
    flops = ir.evaluate(cost.flops)
    moved = ir.evaluate(cost.bytes_read) + ir.evaluate(cost.bytes_written)
    return max(flops / cluster.flops, moved / cluster.memory_bandwidth)


def _storage(node: fx.Node) -> fx.Node:
    """The node that owns ``node``'s memory: itself, or the base of the view it is."""
    while (
        node.op == "call_function"
        and node.target is not operator.getitem
        and isinstance(node.args[0] if node.args else None, fx.Node)
        and _moves_no_data(node)
    ):
        base = node.args[0]
        assert isinstance(base, fx.Node)
        node = base
    return node


def _moves_no_data(node: fx.Node) -> bool:
    cost = ir.get(node, ir.Cost)
    return cost is not None and ir.evaluate(cost.bytes_written) == ir.evaluate(cost.flops) == 0


def _cluster_atoms(model: _CostModel, num_layers: int) -> tuple[int, ...]:
    """The first atom of every layer."""
    atoms = model.atoms
    if num_layers >= atoms.count:
        return tuple(range(atoms.count))
    costs = [model.facts(atom, atom + 1).seconds for atom in range(atoms.count)]
    layering = cluster_layers(costs, atoms.edges, num_layers, count="per_boundary")
    return tuple(start for start, _ in layering.ranges)


# -- costs of an atom range on d devices -------------------------------------------------------


@dataclass(frozen=True)
class _RangeFacts:
    forward_seconds: float
    backward_seconds: float
    trainable_bytes: int
    frozen_bytes: int
    saved_bytes: int
    batch_bytes: int

    @property
    def seconds(self) -> float:
        return self.forward_seconds + self.backward_seconds


class _CostModel:
    """Stage costs of atom ranges, cached per range and per (range, devices)."""

    def __init__(
        self, atoms: _Atoms, cluster: Cluster, pipeline: Pipeline, optimizer_states: int
    ) -> None:
        if optimizer_states < 0:
            raise PipelineError(f"optimizer_states must be >= 0, got {optimizer_states}")
        self.atoms = atoms
        self.cluster = cluster
        self.pipeline = pipeline
        self.optimizer_states = optimizer_states
        self.phases = {node: _region(node).phase for node in atoms.atom_of}
        self._ranges: dict[tuple[int, int], _RangeFacts] = {}
        self._costs: dict[tuple[int, int, int], StageCost] = {}

    def facts(self, start: int, stop: int) -> _RangeFacts:
        key = (start, stop)
        if key not in self._ranges:
            self._ranges[key] = self._measure(start, stop)
        return self._ranges[key]

    def _measure(self, start: int, stop: int) -> _RangeFacts:
        return self._facts(
            start, stop, lambda node: _node_seconds(node, self.cluster), _output_bytes
        )

    def _facts(
        self,
        start: int,
        stop: int,
        seconds: Callable[[fx.Node], float],
        nbytes: Callable[[fx.Node], int],
    ) -> _RangeFacts:
        """The range's seconds and bytes, each node and value priced by ``seconds`` and
        ``nbytes`` (per device)."""
        atoms = self.atoms
        nodes = [node for atom in range(start, stop) for node in atoms.nodes[atom]]
        forward_seconds = backward_seconds = 0.0
        read: set[fx.Node] = set()
        saved: set[fx.Node] = set()
        for node in nodes:
            read.update(node.all_input_nodes)
            if self.phases[node] is not ir.Phase.BACKWARD:
                forward_seconds += seconds(node)
                continue
            backward_seconds += seconds(node)
            for value in node.all_input_nodes:
                base = _storage(value)
                if base in atoms.batch or self.phases.get(base) is ir.Phase.FORWARD:
                    saved.add(base)
        return _RangeFacts(
            forward_seconds=forward_seconds,
            backward_seconds=backward_seconds,
            trainable_bytes=sum(nbytes(n) for n in read if n in atoms.trainable),
            frozen_bytes=sum(nbytes(n) for n in read if n in atoms.frozen),
            saved_bytes=sum(nbytes(n) for n in saved),
            batch_bytes=sum(nbytes(n) for n in read if n in atoms.batch),
        )

    def cost(self, start: int, stop: int, devices: int) -> StageCost:
        key = (start, stop, devices)
        if key not in self._costs:
            self._costs[key] = self._stage_cost(start, stop, devices)
        return self._costs[key]

    def _stage_cost(self, start: int, stop: int, devices: int) -> StageCost:
        facts = self.facts(start, stop)
        bandwidth, latency = _link(self.cluster, devices)
        reduce = collective_seconds(
            "all_reduce", facts.trainable_bytes, devices, bandwidth, latency
        )
        atoms = self.atoms
        return self._price(
            start, stop, facts, atoms.forward_crossing, atoms.backward_crossing,
            share=self.pipeline.microbatches * devices, per_step=reduce,
        )  # fmt: skip

    def _price(
        self,
        start: int,
        stop: int,
        facts: _RangeFacts,
        forward_crossing: Sequence[int],
        backward_crossing: Sequence[int],
        *,
        share: int,
        per_step: float,
        per_microbatch: float = 0.0,
    ) -> StageCost:
        """The stage cost of layers ``[start, stop)`` (module docstring): ``facts`` and the
        crossing bytes are for the work a micro-batch gives the stage's devices times
        ``share``; ``per_step`` seconds are spent once a step (gradient synchronisation),
        ``per_microbatch`` seconds (``share`` times over) beside the compute."""
        pipeline, cluster = self.pipeline, self.cluster
        compute = facts.forward_seconds + facts.backward_seconds + per_microbatch
        if pipeline.remat:
            compute += facts.forward_seconds
        send_bandwidth, send_latency = min(cluster.bandwidth), max(cluster.latency)
        sent = [backward_crossing[start] if start > 0 else 0]
        sent.append(forward_crossing[stop] if stop < self.atoms.count else 0)
        send = sum(send_latency + nbytes / share / send_bandwidth for nbytes in sent if nbytes)
        static = float((2 + self.optimizer_states) * facts.trainable_bytes + facts.frozen_bytes)
        if pipeline.remat:
            received = forward_crossing[start] if start > 0 else 0
            activation = (received + facts.batch_bytes) / share
            static += facts.saved_bytes / share
        else:
            activation = facts.saved_bytes / share
        return StageCost(
            time=compute / share + per_step / pipeline.microbatches + send,
            static_memory=static,
            activation_memory=float(activation),
        )


class _PlannedCostModel(_CostModel):
    """Stage costs under the intra-op plan a stage mesh of ``d`` devices runs (module
    docstring), one plan per ``d``."""

    def __init__(
        self,
        atoms: _Atoms,
        cluster: Cluster,
        pipeline: Pipeline,
        optimizer_states: int,
        planner: StagePlanner,
    ) -> None:
        super().__init__(atoms, cluster, pipeline, optimizer_states)
        self.planner = planner
        self._plans: dict[int, _PlannedStep] = {}

    def planned(self, devices: int) -> _PlannedStep:
        if devices not in self._plans:
            self._plans[devices] = self._plan(devices)
        return self._plans[devices]

    def _plan(self, devices: int) -> _PlannedStep:
        from fxpar.planning.cost import local_bytes
        from fxpar.planning.report import walk

        stage_cluster = _stage_cluster(self.cluster, devices)
        program = self.atoms.program
        plan = self.planner(program, stage_cluster)
        found = walk(plan.program, stage_cluster)
        by_name = {node.name: node for node in program.graph.nodes}
        compute = {node.name: seconds for node, seconds in found.compute.items()}
        values: dict[str, int] = {}
        for node, specs in found.specs.items():
            value = ir.get(node, ir.ValueMeta)
            if value is None or node.op == "output":
                continue
            values[node.name] = sum(
                local_bytes(meta, spec, stage_cluster)
                for meta, spec in zip(value.outputs, specs, strict=True)
                if meta is not None and spec is not None
            )
        comm: dict[str, float] = {}
        sync: dict[str, float] = {}
        for record, seconds in zip(found.records, found.record_seconds, strict=True):
            if record.phase is ir.Phase.OUTPUT:
                sync[record.tensor] = sync.get(record.tensor, 0.0) + seconds
            else:
                comm[record.consumer] = comm.get(record.consumer, 0.0) + seconds
        local = {node: values.get(node.name, 0) for node in by_name.values()}
        forward, backward, _ = _crossings(
            program, self.atoms.atom_of, self.atoms.count, lambda n: local[n]
        )
        return _PlannedStep(compute, comm, sync, local, forward, backward)

    def _stage_cost(self, start: int, stop: int, devices: int) -> StageCost:
        step = self.planned(devices)
        facts = self._facts(
            start, stop, lambda n: step.compute.get(n.name, 0.0), lambda n: step.local.get(n, 0)
        )
        names = [node.name for atom in range(start, stop) for node in self.atoms.nodes[atom]]
        # The plan is per device already: a micro-batch is 1/M of the planned step.
        return self._price(
            start, stop, facts, step.forward_crossing, step.backward_crossing,
            share=self.pipeline.microbatches,
            per_step=sum(step.sync.get(name, 0.0) for name in names),
            per_microbatch=sum(step.comm.get(name, 0.0) for name in names),
        )  # fmt: skip


@dataclass(frozen=True)
class _PlannedStep:
    """The step as planned on one stage mesh, per device: seconds of each op (by node name),
    of the collectives each op runs and of those that synchronise each gradient, the bytes of
    every value, and the bytes crossing each atom boundary."""

    compute: dict[str, float]
    comm: dict[str, float]
    sync: dict[str, float]
    local: dict[fx.Node, int]
    forward_crossing: tuple[int, ...]
    backward_crossing: tuple[int, ...]


def _stage_cluster(cluster: Cluster, devices: int) -> Cluster:
    """The stage mesh ``(devices,)`` of a pipeline on ``cluster``: the links of the innermost
    axis holding ``devices`` consecutive ranks, and the memory of one device times the number of
    stages (the plan covers every stage's weights; a device holds about one stage's share)."""
    bandwidth, latency = _link(cluster, devices)
    return dataclasses.replace(
        cluster,
        mesh_shape=(devices,),
        axis_names=("devices",),
        bandwidth=(bandwidth,),
        latency=(latency,),
        memory=cluster.memory * (cluster.world_size // devices),
    )


def _link(cluster: Cluster, devices: int) -> tuple[float, float]:
    """Bandwidth and latency among ``devices`` consecutive ranks: the innermost mesh axis whose
    block of trailing axes they fit in evenly (ranks are row-major)."""
    block = 1
    for axis in reversed(range(cluster.ndim)):
        block *= cluster.mesh_shape[axis]
        if block % devices == 0:
            return cluster.bandwidth[axis], cluster.latency[axis]
    return min(cluster.bandwidth), max(cluster.latency)


def _problem(model: _CostModel, starts: Sequence[int], devices: int, world: int) -> StageProblem:
    stops = (*starts[1:], model.atoms.count)

    def table(first: int, last: int, submesh: tuple[int, ...]) -> StageCost:
        return model.cost(starts[first], stops[last - 1], submesh[0])

    return StageProblem(
        num_layers=len(starts),
        mesh_shape=(world,),
        submesh_shapes=((devices,),),
        num_microbatches=model.pipeline.microbatches,
        costs=table,
        memory_limit=model.cluster.memory,
        schedule=model.pipeline.schedule,
    )


def _divisors(count: int) -> list[int]:
    return [d for d in range(1, count + 1) if count % d == 0]


def _batch_obstacle(atoms: _Atoms, pipeline: Pipeline, devices: int) -> str:
    pieces = pipeline.microbatches * devices
    if atoms.batch_size is not None and atoms.batch_size % pieces:
        return (
            f"the batch of {atoms.batch_size} does not split into {pipeline.microbatches} "
            f"micro-batches x {devices} replicas"
        )
    return ""


def _degree_obstacle(
    atoms: _Atoms, pipeline: Pipeline, devices: int, stages: int, num_layers: int
) -> str:
    if stages > num_layers:
        return f"{stages} stages need {stages - 1} cut points, the model has {num_layers - 1}"
    return _batch_obstacle(atoms, pipeline, devices)


def _choice(
    atoms: _Atoms,
    starts: Sequence[int],
    layer_names: tuple[tuple[str, ...], ...],
    plan: StagePlan,
    devices: int,
    pipeline: Pipeline,
    cluster: Cluster,
    degrees: tuple[DegreeOutcome, ...],
) -> StageChoice:
    split_points = tuple(atoms.names[starts[boundary]] for boundary in plan.boundaries)
    chosen = dataclasses.replace(pipeline, stages=split_points, data_parallel=devices)
    stage_modules = tuple(
        tuple(_flatten(layer_names[stage.start : stage.stop])) for stage in plan.stages
    )
    return StageChoice(
        pipeline=chosen,
        plan=plan,
        layers=layer_names,
        stage_modules=stage_modules,
        step_time=plan.objective,
        memory=tuple(stage.memory for stage in plan.stages),
        memory_limit=cluster.memory,
        degrees=degrees,
    )


def _flatten(groups: Iterable[Sequence[str]]) -> list[str]:
    return [name for group in groups for name in group]


def _module_span(modules: Sequence[str]) -> str:
    if len(modules) <= 2:
        return ", ".join(modules)
    return f"{modules[0]} .. {modules[-1]} ({len(modules)} modules)"


def _format_seconds(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.3g} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} us"


__all__ = ["DEFAULT_MAX_LAYERS", "DegreeOutcome", "StageChoice", "evaluate_split", "plan_stages"]
