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

**Search.** The runtime gives every data-parallel stage the same ``d`` replicas, so without
``stage_planner``, for every ``d`` dividing the world size ``D`` (and ``M d`` dividing the batch)
with ``K = D / d`` stages no more than the layers, :func:`~fxpar.solvers.stages.solve_stages`
solves a problem on mesh ``(D,)`` whose only submesh is ``(d,)``, minimizing
``sum_k t_k + (M - 1) max_k t_k`` under ``cluster.memory`` per device with the schedule's
micro-batches in flight; the best ``d`` wins. This is Alpa's "intra-op plan cost for each
(layer range, submesh)", restricted to the one intra-op plan replicas run: data parallelism.

**Zero-bubble** (``schedule="zb-h1"``, on data-parallel stages and on stage meshes alike). For
a number of stages ``K`` the DP picks the split by the same objective (ZB-H1 keeps 1F1B's steady
state, so the same stages balance it), with every stage keeping ``min(K, M)`` micro-batches,
each holding its stash and what B keeps for W (the solver's ``schedule="zb-h1"``); a plan's
step is that objective less what ZB-H1 saves over 1F1B
(:meth:`~fxpar.pipeline.stage_costs.StageCostModel.step_time`). Plans of different ``K`` are
compared by that step: the best ``d`` of data-parallel stages, and over stage meshes the best
plan of each shape alone and of each ``K`` of the mix
(:func:`~fxpar.solvers.stages.solve_each_stage_count`: the memory depends on ``K``, so the
mix is solved one ``K`` at a time). It is this step that :func:`search_pipelines` compares
with other schedules'.

**Submeshes** (``stage_planner``). Each stage runs an intra-op plan on a mesh of its own, and the
stage DP chooses the meshes too, among several shapes at once (Alpa's inter-op pass): on a 2-D
cluster ``(R, C)`` Alpa's ``(1, w)``, ``w`` a power of two dividing ``C``, and whole rows
``(r, C)``; else ``(b,)`` for ``b`` dividing ``D`` or a power of two up to ``D``
(:func:`~fxpar.pipeline.meshes.submesh_shapes` says why). A shape's axes of size 1 are
dropped from the stage mesh a stage runs on (``(1, 4)`` runs on ``(4,)``). Every distinct
shape is planned once, for the whole step
(:class:`~fxpar.pipeline.stage_costs.PlannedStageCostModel`); a shape whose plan fails is left
out, and the choice says why. The DP then solves one problem over all the shapes that planned,
with ``K`` free (:func:`stage_problem` builds it), and, for the report and to prefer a uniform
pipeline on a tie, the problem of each shape alone with ``D / devices`` stages
(:func:`search_submeshes`). When the best plan's stages have different meshes, the choice's
``pipeline`` names them (``Pipeline(stage_meshes=...)``, stage ``s`` on the ranks after stage
``s - 1``'s); when they are alike, the choice keeps the one stage mesh in ``stage_cluster``.

**The plan that runs is the plan priced.** Each shape is planned on its own copy of the
program, and the choice keeps the plans of the meshes it chose (``choice.plans``). Given a
program captured at one micro-batch's shapes (``microbatch=True``), the very program a
:class:`~fxpar.pipeline.PipelineModel` runs, costs are read per micro-batch as they are and
those plans are the ones the pipeline runs (:func:`fxpar.compile` hands them over), instead of
plans made again on a second capture.

The costs assume a stage's ranks sit inside the links its shape names; the runtime lays stages
out stage-major on consecutive ranks, which on a 2-D cluster can put a piece across two rows
(``(1, 1)`` then ``(1, 2)`` on rows of 2): the report names such stages.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fxpar.cluster import Cluster
from fxpar.errors import FxparError
from fxpar.ir.program import Program
from fxpar.passes.manual import require_concrete_shapes
from fxpar.pipeline.atoms import Atoms
from fxpar.pipeline.meshes import (
    divisors,
    stage_mesh,
    straddling,
    submesh_shapes,
    uniform_stage_mesh,
)
from fxpar.pipeline.options import Pipeline, PipelineError
from fxpar.pipeline.partition import partition
from fxpar.pipeline.stage_choice import (
    DegreeOutcome,
    StageChoice,
    SubmeshOutcome,
    flatten,
    format_seconds,
)
from fxpar.pipeline.stage_costs import PlannedStageCostModel, StageCostModel, StagePlanner
from fxpar.pipeline.stage_programs import PassPlanner
from fxpar.planning.plan import Plan
from fxpar.solvers.errors import format_bytes
from fxpar.solvers.layers import cluster_layers
from fxpar.solvers.stages import (
    InvalidStageProblemError,
    NoStagePlanError,
    StageCost,
    StageMemoryError,
    StagePlan,
    StageProblem,
    Submesh,
    evaluate_stages,
    solve_each_stage_count,
    solve_stages,
)

logger = logging.getLogger(__name__)

DEFAULT_MAX_LAYERS = 16
"""Atoms beyond this many are clustered into layers: the stage DP is cubic in the layers."""

Shape = tuple[int, ...]


@dataclass(frozen=True)
class SubmeshSearch:
    """What :func:`search_submeshes` found: the best plan (None when there is none), the best
    plan of each shape alone, and the best over every mix of shapes."""

    plan: StagePlan | None
    uniform: tuple[DegreeOutcome, ...]
    mixed: StagePlan | None
    mixed_reason: str
    memory_errors: tuple[StageMemoryError, ...]
    """What each search that found plans, none fitting memory, raised."""


def plan_stages(
    program: Program,
    cluster: Cluster,
    pipeline: Pipeline,
    *,
    optimizer_states: int = 2,
    layers: int | None = None,
    stage_planner: StagePlanner | None = None,
    microbatch: bool = False,
) -> StageChoice:
    """The split points and the devices of every stage of least estimated step time (module
    docstring).

    ``program`` is the training step captured on the global batch, or, with ``microbatch``,
    at one micro-batch's shapes (the program the pipeline runs); ``pipeline`` gives the
    micro-batches, schedule and remat (its ``stages`` and ``data_parallel`` are what this
    chooses). ``optimizer_states`` counts tensors the optimizer keeps per parameter (2 for
    AdamW, 0 for SGD without momentum); ``layers`` caps the layers the DP sees (default
    :data:`DEFAULT_MAX_LAYERS`). ``stage_planner``: stages run an intra-op plan on a mesh of
    their own, made by ``stage_planner``, instead of data-parallel replicas, and the stage DP
    chooses each stage's mesh among several shapes (module docstring, "Submeshes"), and
    ``choice.plans`` keeps the plan of each mesh chosen.

    Raises:
        StageMemoryError: no split fits ``cluster.memory``; ``least_memory`` is what the most
            frugal one needs per device.
        PipelineError: no devices-per-stage count (or mix of stage meshes) divides both the
            world and the batch with at most as many stages as cut points, or no stage mesh
            could be planned.
    """
    model, starts, layer_names = _layers(
        program, cluster, pipeline, optimizer_states, layers, stage_planner, microbatch
    )
    if isinstance(model, PlannedStageCostModel):
        return _plan_submeshes(model, starts, layer_names)
    return _plan_replicas(model, starts, layer_names)


@dataclass(frozen=True)
class PipelineOutcome:
    """What one schedule and remat setting gave :func:`search_pipelines`: its choice, or why
    no pipeline ran that way."""

    pipeline: Pipeline
    choice: StageChoice | None
    reason: str = ""
    least_memory: float | None = None
    """Bytes per device the most frugal pipeline of this setting needs, when none fits."""

    def describe(self) -> str:
        pipeline = self.pipeline
        setting = f"{pipeline.schedule}, remat {'on' if pipeline.remat else 'off'}"
        if self.choice is None:
            return f"{setting}: {self.reason}"
        return f"{setting}: {format_seconds(self.choice.step_time)}"


@dataclass(frozen=True)
class PipelineSearch:
    """The best pipeline :func:`search_pipelines` found (None when none runs) and the outcome
    of every setting it tried."""

    choice: StageChoice | None
    outcomes: tuple[PipelineOutcome, ...]

    def report(self) -> str:
        """The best choice's report, then every setting tried."""
        tried = "settings tried: " + "; ".join(o.describe() for o in self.outcomes)
        if self.choice is None:
            return f"no pipeline runs this step: {tried}"
        return f"{self.choice.report()}\n{tried}"


def search_pipelines(
    program: Program,
    cluster: Cluster,
    pipelines: Sequence[Pipeline],
    *,
    optimizer_states: int = 2,
    layers: int | None = None,
    stage_planner: StagePlanner | None = None,
    microbatch: bool = False,
) -> PipelineSearch:
    """:func:`plan_stages` for each of ``pipelines`` (the same micro-batches; other schedules
    or remat settings), the least step time winning: a schedule and remat are choices of the
    stage DP too. Each range's costs and each stage mesh's plan are made once and shared by
    every setting, which only prices them anew (its in-flight micro-batches, recomputation
    and activation memory). A setting whose pipeline does not run (memory, the batch) is
    kept with its reason; nothing raises for it."""
    if not pipelines:
        raise PipelineError("search_pipelines needs at least one pipeline setting")
    counts = {pipeline.microbatches for pipeline in pipelines}
    if len(counts) > 1:
        raise PipelineError(
            f"every setting of one search has the same micro-batches, got {sorted(counts)}: "
            "capture and search each count on its own"
        )
    for pipeline in pipelines:
        _check_schedule(pipeline)
    model, starts, layer_names = _layers(
        program, cluster, pipelines[0], optimizer_states, layers, stage_planner, microbatch
    )
    outcomes: list[PipelineOutcome] = []
    best: StageChoice | None = None
    for pipeline in pipelines:
        variant = model.with_pipeline(pipeline)
        try:
            if isinstance(variant, PlannedStageCostModel):
                choice = _plan_submeshes(variant, starts, layer_names)
            else:
                choice = _plan_replicas(variant, starts, layer_names)
        except StageMemoryError as error:
            outcomes.append(PipelineOutcome(pipeline, None, str(error), error.least_memory))
            continue
        except (PipelineError, NoStagePlanError) as error:
            outcomes.append(PipelineOutcome(pipeline, None, str(error)))
            continue
        outcomes.append(PipelineOutcome(pipeline, choice))
        if best is None or choice.step_time < best.step_time:
            best = choice
    return PipelineSearch(best, tuple(outcomes))


def stage_problem(
    program: Program,
    cluster: Cluster,
    pipeline: Pipeline,
    *,
    stage_planner: StagePlanner,
    optimizer_states: int = 2,
    layers: int | None = None,
    microbatch: bool = False,
) -> StageProblem:
    """The stage problem over every stage mesh shape that :func:`plan_stages` solves with
    ``stage_planner`` (module docstring), as plain data: to inspect its cost table or solve it
    another way. Its submesh shapes are the DP's (``(1, 4)`` on a 2-D cluster), not yet
    squeezed into stage meshes."""
    model, starts, _ = _layers(
        program, cluster, pipeline, optimizer_states, layers, stage_planner, microbatch
    )
    assert isinstance(model, PlannedStageCostModel)
    problem, _ = _submesh_problem(model, starts)
    return problem


def search_submeshes(
    problem: StageProblem, step_time: Callable[[StagePlan], float] | None = None
) -> SubmeshSearch:
    """The best plan of ``problem`` over all its submesh shapes and stage counts, preferring
    stages all on one shape on a tie: the best plan of every shape alone (``D / devices``
    stages, for shapes whose devices divide the mesh's ``D``) and the best over every mix
    (:func:`~fxpar.solvers.stages.solve_stages` with ``stages="auto"``). Plans are ranked by
    ``step_time`` (default: their objective); where the micro-batches in flight depend on the
    plan's stage count (ZB-H1's), the mix's best plan of every stage count is ranked by it
    (:func:`~fxpar.solvers.stages.solve_each_stage_count`), as is the
    choice between the plans of each shape alone and the mix."""
    step = step_time if step_time is not None else _objective
    world = problem.num_devices
    outcomes: list[DegreeOutcome] = []
    memory_errors: list[StageMemoryError] = []
    best: StagePlan | None = None
    for shape in sorted(problem.submesh_shapes, key=math.prod):
        devices = math.prod(shape)
        if world % devices:
            continue
        stages = world // devices
        if stages > problem.num_layers:
            reason = (
                f"{stages} stages need {stages - 1} cut points, the model has "
                f"{problem.num_layers - 1}"
            )
            outcomes.append(DegreeOutcome(devices, stages, None, reason, shape))
            continue
        alone = dataclasses.replace(problem, submesh_shapes=(shape,))
        try:
            plan = solve_stages(alone, stages)
        except StageMemoryError as error:
            memory_errors.append(error)
            reason = f"needs {format_bytes(error.least_memory)}"
            outcomes.append(DegreeOutcome(devices, stages, None, reason, shape))
            continue
        except NoStagePlanError as error:
            outcomes.append(DegreeOutcome(devices, stages, None, str(error), shape))
            continue
        outcomes.append(DegreeOutcome(devices, stages, step(plan), "", shape))
        if best is None or step(plan) < step(best):
            best = plan
    mixed: StagePlan | None = None
    mixed_reason = ""
    try:
        if step_time is not None and not problem.counts_follow_stages_behind():
            mixed = min(solve_each_stage_count(problem), key=step)
        else:
            mixed = solve_stages(problem, "auto")
    except StageMemoryError as error:
        memory_errors.append(error)
        mixed_reason = f"needs {format_bytes(error.least_memory)}"
    except NoStagePlanError as error:
        mixed_reason = str(error)
    if mixed is not None and (best is None or step(mixed) < step(best)):
        best = mixed
    return SubmeshSearch(best, tuple(outcomes), mixed, mixed_reason, tuple(memory_errors))


def evaluate_split(
    program: Program,
    cluster: Cluster,
    pipeline: Pipeline,
    *,
    optimizer_states: int = 2,
    stage_planner: StagePlanner | None = None,
    microbatch: bool = False,
) -> StageChoice:
    """Score ``pipeline``'s split points (module names) and ``data_parallel`` with the costs of
    :func:`plan_stages`. ``pipeline.world_size`` must equal the cluster's. With
    ``stage_planner``, each of the ``K`` stages runs an intra-op plan: on its mesh of
    ``pipeline.stage_meshes``, or on ``world / K`` devices (``data_parallel`` must be 1; on a
    2-D cluster, the stage mesh :func:`plan_stages` would give that many devices).

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
    meshes: tuple[Shape, ...] | None = None
    if pipeline.stage_meshes is not None:
        if stage_planner is None:
            raise PipelineError(
                f"stage_meshes {pipeline.stage_meshes} run an intra-op plan on each stage's "
                "mesh: pass the stage_planner that makes it"
            )
        if pipeline.world_size != world:
            raise PipelineError(
                f"the stage meshes {pipeline.stage_meshes} hold {pipeline.world_size} devices, "
                f"but the cluster has {world}"
            )
        meshes = pipeline.stage_meshes
    elif stage_planner is not None:
        if pipeline.data_parallel != 1 or world % stages:
            raise PipelineError(
                f"{stages} stages with an intra-op plan inside each need data_parallel=1 and a "
                f"world that divides into them, got data_parallel={pipeline.data_parallel} and "
                f"{world} devices"
            )
        meshes = (uniform_stage_mesh(cluster, world // stages),) * stages
    elif pipeline.world_size != world:
        raise PipelineError(
            f"{pipeline.num_stages} stages x {pipeline.data_parallel} devices per stage use "
            f"{pipeline.world_size} devices, but the cluster has {cluster.world_size}"
        )
    partition(program, pipeline.stages)  # its errors name a bad or misordered split point
    model = _cost_model(
        program, cluster, pipeline, optimizer_states, stage_planner, pipeline.stages, microbatch
    )
    atoms = model.atoms
    reason = _batch_obstacle(model, pipeline.data_parallel)
    if reason:
        raise PipelineError(f"{pipeline.data_parallel} devices per stage: {reason}")
    starts = tuple(range(atoms.count))
    boundaries = [atoms.index_of(point) for point in pipeline.stages]
    layer_names = tuple(atoms.modules)
    if meshes is None:
        d = pipeline.data_parallel
        problem = _problem(model, starts, (world,), ((d,),), _replicas)
        plan = evaluate_stages(problem, boundaries, [(d,)] * stages)
        choice = _choice(atoms, starts, layer_names, plan, pipeline, cluster, d)
        step = _step_of(model, starts, _replicas)(plan)
        tied = _tied_of(model, starts, _replicas)(plan)
        return dataclasses.replace(choice, step_time=step, tied_seconds=tied)
    # Price each stage on its own mesh; the DP's shapes only count its devices.
    ranges = itertools.pairwise((0, *boundaries, atoms.count))
    mesh_of = dict(zip(ranges, meshes, strict=True))
    shapes = tuple(dict.fromkeys((math.prod(mesh),) for mesh in meshes))

    def own_mesh(start: int, stop: int, shape: Submesh) -> Shape:
        return mesh_of[(start, stop)]

    problem = _problem(model, starts, (world,), shapes, own_mesh)
    plan = evaluate_stages(problem, boundaries, [(math.prod(mesh),) for mesh in meshes])
    choice = _with_stage_meshes(
        _choice(atoms, starts, layer_names, plan, pipeline, cluster), cluster, meshes
    )
    step, tied = _step_of(model, starts, own_mesh)(plan), _tied_of(model, starts, own_mesh)(plan)
    choice = _with_plans(choice, model, meshes)
    return dataclasses.replace(choice, step_time=step, tied_seconds=tied)


def _layers(
    program: Program,
    cluster: Cluster,
    pipeline: Pipeline,
    optimizer_states: int,
    layers: int | None,
    stage_planner: StagePlanner | None,
    microbatch: bool,
) -> tuple[StageCostModel, tuple[int, ...], tuple[tuple[str, ...], ...]]:
    """The cost model, the first atom of every layer the DP sees and the layers' modules."""
    max_layers = DEFAULT_MAX_LAYERS if layers is None else layers
    if max_layers < 1:
        raise PipelineError(f"layers must be a positive number of layers, got {layers}")
    require_concrete_shapes(program, "choosing pipeline stages")
    model = _cost_model(program, cluster, pipeline, optimizer_states, stage_planner, (), microbatch)
    atoms = model.atoms
    starts = _cluster_atoms(model, min(max_layers, atoms.count))
    layer_names = tuple(
        tuple(m for atom in range(a, b) for m in atoms.modules[atom])
        for a, b in itertools.pairwise((*starts, atoms.count))
    )
    return model, starts, layer_names


def _plan_replicas(
    model: StageCostModel, starts: tuple[int, ...], layer_names: tuple[tuple[str, ...], ...]
) -> StageChoice:
    """Every stage on ``d`` data-parallel replicas, the best ``d`` (module docstring)."""
    atoms, pipeline, cluster = model.atoms, model.pipeline, model.cluster
    world = cluster.world_size
    outcomes: list[DegreeOutcome] = []
    best: tuple[float, StagePlan] | None = None
    memory_errors: list[StageMemoryError] = []
    for d in divisors(world):
        stages = world // d
        reason = _degree_obstacle(model, d, stages, len(starts))
        if reason:
            outcomes.append(DegreeOutcome(d, stages, None, reason))
            continue
        problem = _problem(model, starts, (world,), ((d,),), _replicas)
        try:
            plan = solve_stages(problem, stages)
        except StageMemoryError as error:
            memory_errors.append(error)
            outcomes.append(
                DegreeOutcome(d, stages, None, f"needs {format_bytes(error.least_memory)}")
            )
            continue
        step = _step_of(model, starts, _replicas)(plan)
        outcomes.append(DegreeOutcome(d, stages, step))
        logger.debug("%d devices per stage: step %.3g s", d, step)
        if best is None or step < best[0]:
            best = (step, plan)
    if best is None:
        raise _no_pipeline_error(cluster, outcomes, memory_errors)
    step, plan = best
    choice = _choice(atoms, starts, layer_names, plan, pipeline, cluster, plan.stages[0].devices)
    tied = _tied_of(model, starts, _replicas)(plan)
    return dataclasses.replace(choice, degrees=tuple(outcomes), step_time=step, tied_seconds=tied)


def _plan_submeshes(
    model: PlannedStageCostModel,
    starts: tuple[int, ...],
    layer_names: tuple[tuple[str, ...], ...],
) -> StageChoice:
    """Every stage on a mesh of its own, the best mix of meshes (module docstring)."""
    atoms, pipeline, cluster = model.atoms, model.pipeline, model.cluster
    reason = _batch_obstacle(model, 1)
    if reason:
        raise PipelineError(f"no pipeline runs this step on {cluster.world_size} devices: {reason}")
    problem, tried = _submesh_problem(model, starts)
    step = _step_of(model, starts, _squeezed)
    search = search_submeshes(problem, step)
    if search.plan is None:
        mixed = DegreeOutcome(0, 0, None, f"any mix of meshes: {search.mixed_reason}")
        raise _no_pipeline_error(cluster, [*search.uniform, mixed], list(search.memory_errors))
    plan = search.plan
    meshes = tuple(stage_mesh(shape) for shape in plan.submeshes)
    choice = _choice(atoms, starts, layer_names, plan, pipeline, cluster)
    choice = _with_stage_meshes(choice, cluster, meshes)
    degrees = tuple(
        dataclasses.replace(outcome, stage_mesh=stage_mesh(outcome.stage_mesh))
        for outcome in search.uniform
        if outcome.stage_mesh is not None
    )
    return dataclasses.replace(
        _with_plans(choice, model, meshes),
        step_time=step(plan),
        tied_seconds=_tied_of(model, starts, _squeezed)(plan),
        degrees=degrees,
        submeshes=tried,
        mixed_step_time=step(search.mixed) if search.mixed is not None else None,
        mixed_reason=search.mixed_reason,
    )


def _submesh_problem(
    model: PlannedStageCostModel, starts: Sequence[int]
) -> tuple[StageProblem, tuple[SubmeshOutcome, ...]]:
    """The problem over every submesh shape whose stage mesh could be planned, and what
    planning each gave."""
    mesh_shape, shapes = submesh_shapes(model.cluster)
    tried: list[SubmeshOutcome] = []
    usable: list[Submesh] = []
    for shape in shapes:
        try:
            model.planned(stage_mesh(shape))
        except FxparError as error:
            # A planner may refuse a mesh (a batch that does not split over its devices): the
            # other shapes may still tile the cluster, and the choice reports this one's reason.
            logger.info("stage mesh %s left out: %s", stage_mesh(shape), error)
            tried.append(SubmeshOutcome(stage_mesh(shape), f"{type(error).__name__}: {error}"))
            continue
        tried.append(SubmeshOutcome(stage_mesh(shape)))
        usable.append(shape)
    try:
        problem = _problem(model, starts, mesh_shape, tuple(usable), _squeezed)
    except InvalidStageProblemError as error:
        failures = "; ".join(f"{o.shape}: {o.reason}" for o in tried if o.reason)
        raise PipelineError(
            f"the stage meshes that could be planned do not tile the {model.cluster.world_size} "
            f"devices of {model.cluster.mesh_shape} ({error}); planning the others failed: "
            f"{failures}"
        ) from error
    return problem, tuple(tried)


def _cost_model(
    program: Program,
    cluster: Cluster,
    pipeline: Pipeline,
    optimizer_states: int,
    stage_planner: StagePlanner | None,
    extra_points: Sequence[str],
    microbatch: bool,
) -> StageCostModel:
    _check_schedule(pipeline)
    atoms = Atoms.build(program, extra_points)
    if stage_planner is None:
        return StageCostModel(atoms, cluster, pipeline, optimizer_states, microbatch=microbatch)
    if microbatch and isinstance(stage_planner, PassPlanner):
        # One micro-batch's program: its gradients are synchronised once per M of them.
        stage_planner = stage_planner.per_microbatch(pipeline.microbatches)
    # A stamped step is planned folded where the plan is the same (fxpar.ir.fold); a
    # pipeline then runs the step replayed with the folded plan's choice (_KeptPlans.running).
    folds = isinstance(stage_planner, PassPlanner) and stage_planner.plans_folded()
    return PlannedStageCostModel(
        atoms, cluster, pipeline, optimizer_states, _KeptPlans(stage_planner),
        microbatch=microbatch, folds=folds,
    )  # fmt: skip


def _check_schedule(pipeline: Pipeline) -> None:
    if not pipeline.named_schedule.searched:
        raise PipelineError(
            f"the stage DP prices one model chunk per stage "
            f"({', '.join(pipeline.schedules.searched())}), not the {pipeline.schedule} "
            "schedule: choose its split points yourself (K * virtual_stages - 1 module names), "
            "or plan stages for schedule='1f1b'"
        )


class _KeptPlans:
    """A stage planner that keeps every plan it makes by its mesh's shape, for the choice to
    carry (planning leaves the program as it was, so one program is planned for every
    mesh)."""

    def __init__(self, planner: StagePlanner) -> None:
        self.planner = planner
        self.plans: dict[Shape, Plan] = {}
        self._running: dict[Shape, Plan] = {}

    def __call__(self, program: Program, mesh: Cluster) -> Plan:
        plan = self.planner(program, mesh)
        self.plans[mesh.mesh_shape] = plan
        return plan

    def running(self, shape: Shape, model: PlannedStageCostModel) -> Plan:
        """The plan of the step that a pipeline on stage meshes of ``shape`` runs: the plan
        priced, or where the step was planned folded, the step planned with its choice."""
        plan = self.plans[shape]
        if model.folded is None:
            return plan
        if shape not in self._running:  # made once for every setting that chooses the mesh
            assert isinstance(self.planner, PassPlanner)
            replay = self.planner.replaying(plan)
            mesh = plan.program.require_cluster("a stage plan")
            self._running[shape] = replay(model.atoms.program, mesh)
        return self._running[shape]


def _with_plans(choice: StageChoice, model: StageCostModel, meshes: Sequence[Shape]) -> StageChoice:
    """``choice`` carrying the plan each of its stage meshes was priced under."""
    assert isinstance(model, PlannedStageCostModel) and isinstance(model.planner, _KeptPlans)
    kept = model.planner
    return dataclasses.replace(
        choice, plans={shape: kept.running(shape, model) for shape in set(meshes)}
    )


def _with_stage_meshes(
    choice: StageChoice, cluster: Cluster, meshes: tuple[Shape, ...]
) -> StageChoice:
    """``choice`` with every stage running an intra-op plan on its mesh of ``meshes``: one
    ``stage_cluster`` when they are alike, else ``pipeline.stage_meshes``."""
    pipeline = dataclasses.replace(choice.pipeline, data_parallel=1)
    if len(set(meshes)) == 1:
        mesh = cluster.submesh(meshes[0])
        return dataclasses.replace(
            choice, pipeline=dataclasses.replace(pipeline, stage_meshes=None), stage_cluster=mesh
        )
    return dataclasses.replace(
        choice,
        pipeline=dataclasses.replace(pipeline, stage_meshes=meshes),
        stage_cluster=None,
        crossing=straddling(cluster, meshes),
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
    model: StageCostModel,
    starts: Sequence[int],
    mesh_shape: Shape,
    shapes: tuple[Submesh, ...],
    mesh_of: Callable[[int, int, Submesh], Shape],
) -> StageProblem:
    """The stage problem over the layers beginning at ``starts``: layers ``[i, j)`` on the
    DP's ``shape`` cost what atoms ``[starts[i], starts[j])`` cost on stage mesh
    ``mesh_of(starts[i], starts[j], shape)``, under the model's schedule (whose micro-batches
    in flight the solver counts)."""
    stops = (*starts[1:], model.atoms.count)
    if not model.pipeline.named_schedule.searched:
        raise AssertionError("_cost_model refuses schedules the stage DP does not price")

    def table(first: int, last: int, submesh: Submesh) -> StageCost:
        start, stop = starts[first], stops[last - 1]
        return model.cost(start, stop, mesh_of(start, stop, submesh))

    return StageProblem(
        num_layers=len(starts),
        mesh_shape=mesh_shape,
        submesh_shapes=shapes,
        num_microbatches=model.pipeline.microbatches,
        costs=table,
        memory_limit=model.cluster.memory,
        schedule=model.pipeline.schedule,
        in_flight_counts=model.in_flight,
    )


def _step_of(
    model: StageCostModel, starts: Sequence[int], mesh_of: Callable[[int, int, Submesh], Shape]
) -> Callable[[StagePlan], float]:
    """A plan's step under the model's schedule (:meth:`StageCostModel.step_time`: its
    objective, but for ZB-H1), its stages priced on the meshes ``mesh_of`` gives, as in
    :func:`_problem`."""
    return lambda plan: model.step_time(_stages_of(model, starts, mesh_of, plan), plan.objective)


def _tied_of(
    model: StageCostModel, starts: Sequence[int], mesh_of: Callable[[int, int, Submesh], Shape]
) -> Callable[[StagePlan], float]:
    """What a plan's step spends summing tied weights' gradients between its stages
    (:meth:`StageCostModel.tied_seconds`), its stages priced as by :func:`_step_of`."""
    return lambda plan: model.tied_seconds(_stages_of(model, starts, mesh_of, plan))


def _stages_of(
    model: StageCostModel,
    starts: Sequence[int],
    mesh_of: Callable[[int, int, Submesh], Shape],
    plan: StagePlan,
) -> list[tuple[int, int, Shape]]:
    """``(start, stop, mesh)`` of each of ``plan``'s stages in atoms (its layers start at
    ``starts``)."""
    stops = (*starts[1:], model.atoms.count)
    stages = []
    for stage in plan.stages:
        start, stop = starts[stage.start], stops[stage.stop - 1]
        stages.append((start, stop, mesh_of(start, stop, tuple(stage.submesh))))
    return stages


def _replicas(start: int, stop: int, submesh: Submesh) -> Shape:
    """A data-parallel stage's mesh: its replicas, the DP's shape as is."""
    return submesh


def _squeezed(start: int, stop: int, submesh: Submesh) -> Shape:
    """A stage mesh: the DP's shape with its axes of one dropped (:func:`stage_mesh`)."""
    return stage_mesh(submesh)


def _objective(plan: StagePlan) -> float:
    return plan.objective


def _no_pipeline_error(
    cluster: Cluster, outcomes: Sequence[DegreeOutcome], memory_errors: Sequence[StageMemoryError]
) -> FxparError:
    tried = "; ".join(
        f"d={o.data_parallel}: {o.reason}" if o.data_parallel else o.reason for o in outcomes
    )
    world = cluster.world_size
    if memory_errors:
        least = min(error.least_memory for error in memory_errors)
        return StageMemoryError(
            f"no pipeline of this step fits in {format_bytes(cluster.memory)} per device on "
            f"{world} devices: the most frugal needs {format_bytes(least)} per device "
            f"({least:.0f} bytes). Use more devices, remat=True, the 1f1b schedule, or an "
            f"optimizer with less state; tried: {tried}",
            least_memory=least,
            memory_limit=cluster.memory,
        )
    return PipelineError(f"no pipeline runs this step on {world} devices: {tried}")


def _batch_obstacle(model: StageCostModel, devices: int) -> str:
    batch_size = model.atoms.batch_size
    if batch_size is None or batch_size % (model.pieces * devices) == 0:
        return ""
    if model.pieces == 1:
        return f"the micro-batch of {batch_size} does not split over {devices} replicas"
    return (
        f"the batch of {batch_size} does not split into {model.pieces} micro-batches x "
        f"{devices} replicas"
    )


def _degree_obstacle(model: StageCostModel, devices: int, stages: int, num_layers: int) -> str:
    if stages > num_layers:
        return f"{stages} stages need {stages - 1} cut points, the model has {num_layers - 1}"
    return _batch_obstacle(model, devices)


def _choice(
    atoms: Atoms,
    starts: Sequence[int],
    layer_names: tuple[tuple[str, ...], ...],
    plan: StagePlan,
    pipeline: Pipeline,
    cluster: Cluster,
    data_parallel: int = 1,
) -> StageChoice:
    """The choice of ``plan``: ``pipeline`` with its split points and ``data_parallel``."""
    split_points = tuple(atoms.names[starts[boundary]] for boundary in plan.boundaries)
    chosen = dataclasses.replace(pipeline, stages=split_points, data_parallel=data_parallel)
    stage_modules = tuple(
        tuple(flatten(layer_names[stage.start : stage.stop])) for stage in plan.stages
    )
    return StageChoice(
        pipeline=chosen,
        plan=plan,
        layers=layer_names,
        stage_modules=stage_modules,
        step_time=plan.objective,
        memory=tuple(stage.memory for stage in plan.stages),
        memory_limit=cluster.memory,
    )


__all__ = [
    "DEFAULT_MAX_LAYERS",
    "DegreeOutcome",
    "PipelineOutcome",
    "PipelineSearch",
    "StageChoice",
    "StagePlanner",
    "SubmeshOutcome",
    "SubmeshSearch",
    "evaluate_split",
    "plan_stages",
    "search_pipelines",
    "search_submeshes",
    "stage_problem",
]
