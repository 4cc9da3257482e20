"""Choose pipeline stages automatically: layer clustering and Alpa's stage DP on a captured step.

:func:`plan_stages` picks the split points and the devices per stage of a :class:`Pipeline` for a
captured Program on a Cluster; :func:`evaluate_split` scores split points chosen by hand with the
same costs. Both return a :class:`StageChoice`, whose ``pipeline`` runs as is on
:class:`~fxpar.pipeline.PipelineModel`.

**Atoms** (:mod:`fxpar.pipeline.atoms`). A stage may begin at a *cut candidate*: a repeated layer
(``blocks.3``) or another module at the depth of the repeated layers' container (``wte``,
``ln_f``, ``head``, ``<loss>``), in forward order; an *atom* is the ops between two consecutive
candidates, backward nodes included.

**Layers.** With more than ``layers`` atoms (default 16, since the stage DP is cubic in the
layers), :func:`~fxpar.solvers.layers.cluster_layers` (Alpa's layer construction) merges them
into that many contiguous layers of balanced cost (forward plus backward seconds) that cut the
fewest bytes, counted at every boundary a value crosses (``count="per_boundary"``), because the
runtime relays a value through the stages in between.

**Costs** of layers ``[i, j)`` on ``d`` devices (:mod:`fxpar.pipeline.stage_costs`): compute by
the roofline of :mod:`fxpar.planning.cost`, gradient all-reduce, sends between stages, and the
memory of weights, optimizer state and the activations the backward keeps, with the schedule's
micro-batches in flight; or, with ``stage_planner``, those of the intra-op plan each stage runs.

**Search.** The runtime gives every stage the same ``d`` devices, so for every ``d`` dividing the
world size ``D`` (and ``M d`` dividing the batch) with ``K = D / d`` stages no more than the layers,
:func:`~fxpar.solvers.stages.solve_stages` solves a problem on mesh ``(D,)`` whose only submesh is
``(d,)``, minimizing ``sum_k t_k + (M - 1) max_k t_k`` under ``cluster.memory`` per device with the
schedule's micro-batches in flight; the best ``d`` wins. This is Alpa's "intra-op plan cost for each
(layer range, submesh)", restricted to the one intra-op plan the pipeline runtime runs inside a
stage: data parallelism. With ``stage_planner``, the search is the same over stage meshes ``(d,)``
(one intra-op plan per ``d``, see :mod:`fxpar.pipeline.stage_costs`).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from fxpar.cluster import Cluster
from fxpar.ir.program import Program
from fxpar.pipeline.atoms import Atoms
from fxpar.pipeline.options import Pipeline, PipelineError
from fxpar.pipeline.partition import partition
from fxpar.pipeline.stage_costs import (
    PlannedStageCostModel,
    StageCostModel,
    StagePlanner,
    stage_cluster,
)
from fxpar.planning.manual import require_concrete_shapes
from fxpar.solvers.errors import format_bytes
from fxpar.solvers.layers import cluster_layers
from fxpar.solvers.stages import (
    StageCost,
    StageMemoryError,
    StagePlan,
    StageProblem,
    evaluate_stages,
    solve_stages,
)

logger = logging.getLogger(__name__)

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
) -> StageCostModel:
    if pipeline.schedule == "interleaved":
        raise PipelineError(
            "the stage DP prices one model chunk per stage (GPipe or 1F1B), not the "
            "interleaved schedule: choose its split points yourself (K * virtual_stages - 1 "
            "module names), or plan stages for schedule='1f1b'"
        )
    atoms = Atoms.build(program, extra_points)
    if stage_planner is None:
        return StageCostModel(atoms, cluster, pipeline, optimizer_states)
    return PlannedStageCostModel(atoms, cluster, pipeline, optimizer_states, stage_planner)


def _with_stage_mesh(choice: StageChoice, cluster: Cluster, devices: int) -> StageChoice:
    return dataclasses.replace(
        choice,
        pipeline=dataclasses.replace(choice.pipeline, data_parallel=1),
        stage_cluster=stage_cluster(cluster, devices),
    )


def _cluster_atoms(model: StageCostModel, num_layers: int) -> tuple[int, ...]:
    """The first atom of every layer."""
    atoms = model.atoms
    if num_layers >= atoms.count:
        return tuple(range(atoms.count))
    costs = [model.facts(atom, atom + 1).seconds for atom in range(atoms.count)]
    layering = cluster_layers(costs, atoms.edges, num_layers, count="per_boundary")
    return tuple(start for start, _ in layering.ranges)


def _problem(
    model: StageCostModel, starts: Sequence[int], devices: int, world: int
) -> StageProblem:
    stops = (*starts[1:], model.atoms.count)
    schedule = model.pipeline.schedule
    if schedule == "interleaved":
        raise AssertionError("_cost_model refuses the interleaved schedule")

    def table(first: int, last: int, submesh: tuple[int, ...]) -> StageCost:
        return model.cost(starts[first], stops[last - 1], submesh[0])

    return StageProblem(
        num_layers=len(starts),
        mesh_shape=(world,),
        submesh_shapes=((devices,),),
        num_microbatches=model.pipeline.microbatches,
        costs=table,
        memory_limit=model.cluster.memory,
        schedule=schedule,
    )


def _divisors(count: int) -> list[int]:
    return [d for d in range(1, count + 1) if count % d == 0]


def _batch_obstacle(atoms: Atoms, pipeline: Pipeline, devices: int) -> str:
    pieces = pipeline.microbatches * devices
    if atoms.batch_size is not None and atoms.batch_size % pieces:
        return (
            f"the batch of {atoms.batch_size} does not split into {pipeline.microbatches} "
            f"micro-batches x {devices} replicas"
        )
    return ""


def _degree_obstacle(
    atoms: Atoms, pipeline: Pipeline, devices: int, stages: int, num_layers: int
) -> str:
    if stages > num_layers:
        return f"{stages} stages need {stages - 1} cut points, the model has {num_layers - 1}"
    return _batch_obstacle(atoms, pipeline, devices)


def _choice(
    atoms: Atoms,
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


__all__ = [
    "DEFAULT_MAX_LAYERS",
    "DegreeOutcome",
    "StageChoice",
    "StagePlanner",
    "evaluate_split",
    "plan_stages",
]
