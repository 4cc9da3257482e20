"""``fxpar.plan`` and ``fxpar.compile``: the compiler end to end, as docs/architecture.md draws it::

    capture(model)          one training step as a functional ATen graph on fake tensors
    passes(program)         canonicalize -> annotate cost -> annotate strategies -> choose
                            strategies (THE pass list, fxpar.passes.default_passes, or yours)
    lower(plan)             one program per rank, with collectives
    ParallelModel           this rank's program, its pieces of the state, the optimizer

:class:`~fxpar.driver.Driver` runs the first three for the training step and keeps them for
the other steps the model is asked for (other shapes, modes, the forward alone).

:func:`plan` stops after the passes and returns the :class:`~fxpar.planning.plan.Plan`;
:func:`compile` goes on to lower it and build this process's share of the model (or a
:class:`~fxpar.pipeline.PipelineModel` when ``pipeline=`` asks for stages). Every process of a
job calls :func:`compile` with the same arguments (SPMD, as under ``torchrun``); the choice is
made on rank 0 and broadcast, so every rank lowers the same plan. Nothing about how the plan was
chosen reaches the runtime: it sees per-rank programs and the specs of their inputs and outputs.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, overload

import torch
import torch.distributed as dist
from torch import nn

from fxpar.cluster import Cluster
from fxpar.driver import Driver
from fxpar.errors import DistributedError, FxparError
from fxpar.ir.capture import LossFn, capture
from fxpar.ir.precision import MixedPrecision, check_policy
from fxpar.ir.program import Program, named_state
from fxpar.joint import JointChoice, pipeline_candidates
from fxpar.optim import AdamW, Optimizer, check_optimizer
from fxpar.passes import (
    ApplyPlanFile,
    ManualPlan,
    PassManager,
    for_compile,
    passes_for,
    plan_program,
)
from fxpar.pipeline import (
    Pipeline,
    PipelineError,
    PipelineModel,
    StageChoice,
    capture_microbatch,
    partition,
    plan_stages,
)
from fxpar.pipeline.auto import StagePlanner
from fxpar.pipeline.intra_op import stage_devices
from fxpar.pipeline.meshes import StageMeshes, stage_meshes, uniform_stage_mesh
from fxpar.pipeline.pipeline_plan import FORMAT as PIPELINE_PLAN_FORMAT
from fxpar.pipeline.pipeline_plan import PipelinePlan, PipelinePlanError, SavedPlan
from fxpar.pipeline.stage_programs import PassPlanner
from fxpar.planning.plan import Plan
from fxpar.planning.plan_file import FORMAT as PLAN_FORMAT
from fxpar.planning.plan_file import PlanFileError, saved_cluster
from fxpar.planning.problem import PlanOptions
from fxpar.rules import RuleRegistry
from fxpar.runtime.devices import check_device_type, rank_device
from fxpar.runtime.lowered import LoweredStep
from fxpar.runtime.parallel import ParallelModel
from fxpar.runtime.weights import check_sources
from fxpar.sharding import Spec
from fxpar.solvers.errors import InfeasiblePlanError
from fxpar.solvers.problem import IntraOpSolver

logger = logging.getLogger(__name__)


def plan(
    model: nn.Module,
    cluster: Cluster,
    example_inputs: Sequence[Any] | Mapping[str, Any],
    loss_fn: LossFn | None = None,
    *,
    example_targets: Sequence[torch.Tensor] = (),
    passes: PassManager | None = None,
    solver: IntraOpSolver | None = None,
    manual: ManualPlan | None = None,
    pins: Mapping[str, Spec] | None = None,
    options: PlanOptions | None = None,
    rules: RuleRegistry | None = None,
    mixed_precision: MixedPrecision | None = None,
) -> Plan:
    """Capture ``model``'s training step and choose how to shard it over ``cluster``.

    ``passes`` is the pass list to run (:func:`fxpar.passes.default_passes` when None),
    e.g. ``default_passes().insert_before("annotate-strategies", MyPass())``. Without it, the
    default pipeline is built from ``solver`` (the HiGHS ILP by default; ``ExhaustiveSolver()``,
    ``GreedySolver()`` or any object with ``solve(IntraOpProblem) -> IntraOpSolution``) or
    ``manual`` (a manual plan such as ``fxpar.plans.data_parallel``), ``options`` and
    ``rules``. ``pins`` maps name patterns of parameters, buffers, inputs or graph nodes to the
    spec they must have, e.g. ``{"*.mlp.fc.weight": (Shard(0),)}``. ``mixed_precision``
    (:class:`fxpar.MixedPrecision`) is applied at capture: the plan computes in its dtypes.
    """
    passes = passes_for(
        passes, solver=solver, manual=manual, options=options, rules=rules, pins=pins
    )
    program = capture(
        model, example_inputs, loss_fn, example_targets=example_targets,
        mixed_precision=mixed_precision,
    )  # fmt: skip
    return plan_program(program, cluster, passes=passes)


@overload
def compile(
    model: nn.Module,
    cluster: Cluster,
    example_inputs: Sequence[Any] | Mapping[str, Any],
    loss_fn: LossFn | None = None,
    *,
    example_targets: Sequence[torch.Tensor] = (),
    optimizer: Optimizer | None = None,
    passes: PassManager | None = None,
    solver: IntraOpSolver | None = None,
    manual: ManualPlan | None = None,
    pins: Mapping[str, Spec] | None = None,
    options: PlanOptions | None = None,
    rules: RuleRegistry | None = None,
    check_batches: bool = True,
    batch: str = "global",
    pipeline: None = None,
    init: str | os.PathLike[str] | None = None,
    mixed_precision: MixedPrecision | None = None,
    max_kept_steps: int = 32,
    plan: None = None,
) -> ParallelModel: ...


@overload
def compile(
    model: nn.Module,
    cluster: Cluster,
    example_inputs: Sequence[Any] | Mapping[str, Any],
    loss_fn: LossFn | None = None,
    *,
    example_targets: Sequence[torch.Tensor] = (),
    optimizer: Optimizer | None = None,
    passes: PassManager | None = None,
    solver: IntraOpSolver | None = None,
    manual: ManualPlan | None = None,
    pins: Mapping[str, Spec] | None = None,
    options: PlanOptions | None = None,
    rules: RuleRegistry | None = None,
    check_batches: bool = True,
    batch: str = "global",
    pipeline: Pipeline,
    init: str | os.PathLike[str] | None = None,
    mixed_precision: None = None,
    max_kept_steps: int = 32,
    plan: None = None,
) -> PipelineModel: ...


@overload
def compile(
    model: nn.Module,
    cluster: Cluster,
    example_inputs: Sequence[Any] | Mapping[str, Any],
    loss_fn: LossFn | None = None,
    *,
    example_targets: Sequence[torch.Tensor] = (),
    optimizer: Optimizer | None = None,
    passes: PassManager | None = None,
    solver: None = None,
    manual: None = None,
    pins: None = None,
    options: PlanOptions | None = None,
    rules: RuleRegistry | None = None,
    check_batches: bool = True,
    batch: str = "global",
    pipeline: None = None,
    init: str | os.PathLike[str] | None = None,
    mixed_precision: MixedPrecision | None = None,
    max_kept_steps: int = 32,
    plan: PipelinePlan,
) -> PipelineModel: ...


@overload
def compile(
    model: nn.Module,
    cluster: Cluster,
    example_inputs: Sequence[Any] | Mapping[str, Any],
    loss_fn: LossFn | None = None,
    *,
    example_targets: Sequence[torch.Tensor] = (),
    optimizer: Optimizer | None = None,
    passes: PassManager | None = None,
    solver: None = None,
    manual: None = None,
    pins: None = None,
    options: PlanOptions | None = None,
    rules: RuleRegistry | None = None,
    check_batches: bool = True,
    batch: str = "global",
    pipeline: None = None,
    init: str | os.PathLike[str] | None = None,
    mixed_precision: MixedPrecision | None = None,
    max_kept_steps: int = 32,
    plan: str | os.PathLike[str],
) -> ParallelModel | PipelineModel: ...


@overload
def compile(
    model: nn.Module,
    cluster: Cluster,
    example_inputs: Sequence[Any] | Mapping[str, Any],
    loss_fn: LossFn | None = None,
    *,
    example_targets: Sequence[torch.Tensor] = (),
    optimizer: Optimizer | None = None,
    passes: PassManager | None = None,
    solver: IntraOpSolver | None = None,
    manual: ManualPlan | None = None,
    pins: Mapping[str, Spec] | None = None,
    options: PlanOptions | None = None,
    rules: RuleRegistry | None = None,
    check_batches: bool = True,
    batch: str = "global",
    pipeline: Literal["auto"],
    init: str | os.PathLike[str] | None = None,
    mixed_precision: MixedPrecision | None = None,
    max_kept_steps: int = 32,
    plan: None = None,
) -> ParallelModel | PipelineModel: ...


def compile(
    model: nn.Module,
    cluster: Cluster,
    example_inputs: Sequence[Any] | Mapping[str, Any],
    loss_fn: LossFn | None = None,
    *,
    example_targets: Sequence[torch.Tensor] = (),
    optimizer: Optimizer | None = None,
    passes: PassManager | None = None,
    solver: IntraOpSolver | None = None,
    manual: ManualPlan | None = None,
    pins: Mapping[str, Spec] | None = None,
    options: PlanOptions | None = None,
    rules: RuleRegistry | None = None,
    check_batches: bool = True,
    batch: str = "global",
    pipeline: Pipeline | Literal["auto"] | None = None,
    init: str | os.PathLike[str] | None = None,
    mixed_precision: MixedPrecision | None = None,
    max_kept_steps: int = 32,
    plan: PipelinePlan | str | os.PathLike[str] | None = None,
) -> ParallelModel | PipelineModel:
    """Plan ``model``'s training step for ``cluster`` and build this process's share of it.

    Call it on every rank with the same arguments, after ``torch.distributed`` is initialized
    (``torchrun`` plus ``init_process_group``, or :func:`fxpar.runtime.launch.spawn`); a
    single-device cluster needs no process group. The weights of rank 0's ``model`` are the
    ones trained: they are broadcast, as DistributedDataParallel does, so every rank starts
    from the same state even if the models were initialized differently. A model too big for
    one process is never whole anywhere: build it with :func:`fxpar.deferred_init` (each rank
    computes only its own pieces of the weights its constructor makes) or on the meta device
    with ``init=`` a checkpoint (each rank reads only its own pieces).

    Args:
        model: the module to train: with real weights, built by :func:`fxpar.deferred_init`, or
            on the meta device with ``init``. Its parameters are copied; the model itself is
            left as it is.
        cluster: the device mesh and what its devices can do; its size must equal the world
            size.
        example_inputs, loss_fn, example_targets: as for :func:`fxpar.capture`. The step is
            planned for the example's shapes; a batch of other shapes (a short last batch,
            another sequence length) is planned the first time it comes, with the state kept
            in its layout (docs/training.md).
        optimizer: :class:`fxpar.optim.AdamW` or :class:`fxpar.optim.SGD`; without it,
            ``fxpar.optim.AdamW(lr=1e-3)`` (torch's AdamW defaults otherwise).
        passes, solver, manual, pins, options, rules: how to choose the plan, as for
            :func:`fxpar.plan`. A solver runs on rank 0 only and its answer is broadcast, so
            every rank lowers the same plan (:func:`fxpar.passes.for_compile`).
        check_batches: compare a digest of every batch across ranks before each step (one
            small all-gather), so a rank fed a different batch fails loudly instead of
            training on a mixture; pipelines too.
        batch: ``"global"`` (the default): every rank passes the whole batch and takes its
            own piece. ``"local"``: each rank passes only its own rows, ``1/world_size`` of
            the batch on dim 0 of every batch tensor (what a ``DistributedSampler`` with the
            default ``num_replicas`` and ``rank`` gives it); the batch trained on is every
            rank's rows concatenated in rank order. Where the plan splits a batch tensor on
            dim 0 over every mesh axis, a rank's rows are its piece and nothing moves;
            otherwise the rows are all-gathered first. A forward (``parallel(...)``) then
            returns the outputs of this rank's rows (``rows="global"``: every rank's). Not
            for pipelines.
        pipeline: run the step as a synchronous pipeline instead (see
            :class:`fxpar.pipeline.Pipeline` and docs/pipelines.md): returns a
            :class:`~fxpar.pipeline.PipelineModel`. With ``stage_mode="meshes"`` (the
            default's choice on a cluster of mesh ``(K, *stage_mesh)``, ``K`` stages first,
            or with ``stage_meshes``) each stage runs its share of an intra-op plan on its
            stage mesh, chosen by ``solver`` (the ILP by default; ``pins``, ``options`` and
            ``rules`` apply); with ``"replicas"`` (the default's choice otherwise) each stage
            runs data-parallel on ``pipeline.data_parallel`` devices (every device of the
            cluster when left at 1), and arguments that make an intra-op plan are refused.
            With ``stages="auto"`` and stage meshes, the
            step is captured once at one micro-batch's shapes, the stage DP prices every
            stage mesh under its plan of that program, and the pipeline runs those very
            plans (``pipelined.stage_choice.plans``). ``pipeline="auto"``: whether to
            pipeline at all is the cost model's choice too (:mod:`fxpar.joint`): the intra-op
            plan of the whole batch, or the stage DP's best pipeline of planned stages or of
            data-parallel replicas over :data:`~fxpar.joint.AUTO_MICROBATCHES`
            micro-batches, schedules and remat, whichever is estimated faster (logged at
            INFO); returns a ``ParallelModel`` or a ``PipelineModel``.
        init: a checkpoint of the model's weights under its own ``state_dict`` names to start
            from instead of the model's: a ``safetensors`` file, a directory holding
            ``model.safetensors`` or ``model.safetensors.index.json`` and its shards (what
            Hugging Face's ``save_pretrained`` writes), or a ``torch.distributed.checkpoint``
            directory. Tensors it lacks (non-persistent buffers) come from the model. See
            docs/training.md, "Models bigger than one process".
        mixed_precision: compute in ``param_dtype`` with float32 master weights and optimizer
            state, gradients reduced in ``reduce_dtype`` (:class:`fxpar.MixedPrecision`,
            docs/training.md), pipelines too.
        max_kept_steps: the most planned steps of other shapes and modes kept besides the
            one compiled for; past it the one used least recently is dropped, and planned
            again if it comes back, so a long run over ever new shapes stays bounded (a
            pipeline keeps each of its steps).
        plan: run this choice instead of making one: a
            :class:`~fxpar.pipeline.PipelinePlan` (returns a ``PipelineModel`` of exactly
            its stages, schedule and stage plans), or the path of a file that
            :meth:`PipelinePlan.save <fxpar.pipeline.PipelinePlan.save>` (``fxpar plan
            --microbatches M --save-pipeline``) or :meth:`fxpar.Plan.save` (``fxpar plan
            --save``) wrote, which runs that pipeline, or that intra-op plan as
            :func:`fxpar.passes.load_plan` applies it. ``passes``, ``options`` and ``rules``
            still make the programs it runs (with the plan's choice in place of the
            ``choose-strategies`` pass); ``solver``, ``manual``, ``pins`` and ``pipeline``,
            which choose what the plan fixes, must be left out. A plan that does not fit the
            model or cluster is refused (:class:`~fxpar.pipeline.PipelinePlanError`,
            :class:`~fxpar.planning.plan_file.PlanFileError`).
    """
    if (
        isinstance(max_kept_steps, bool)
        or not isinstance(max_kept_steps, int)
        or max_kept_steps < 0
    ):
        raise FxparError(f"max_kept_steps must be a whole number >= 0, got {max_kept_steps!r}")
    optimizer = check_optimizer(optimizer if optimizer is not None else AdamW())
    mixed_precision = check_policy(mixed_precision)
    chosen: PipelinePlan | None = None
    if plan is not None:
        fixed = [
            name
            for name, value in (
                ("solver", solver), ("manual", manual), ("pins", pins), ("pipeline", pipeline),
            )
            if value is not None
        ]  # fmt: skip
        if fixed:
            raise FxparError(
                f"plan= is the choice to run, so {', '.join(fixed)} would choose it again: "
                "leave them out, or leave plan= out to choose"
            )
        chosen, spmd_file = _given_plan(plan)
        if spmd_file is not None:  # an intra-op plan: its choice in the pass list
            passes = passes_for(passes, options=options, rules=rules)
            passes = passes.replace("choose-strategies", ApplyPlanFile(spmd_file))
            saved_cluster(spmd_file, cluster)  # refuses a plan of another mesh
            options = rules = None
    choosing = [
        name
        for name, value in (
            ("passes", passes), ("solver", solver), ("manual", manual), ("pins", pins),
            ("options", options), ("rules", rules),
        )
        if value is not None
    ]  # fmt: skip
    passes = passes_for(
        passes, solver=solver, manual=manual, options=options, rules=rules, pins=pins
    )
    passes = for_compile(passes, optimizer_states=optimizer.state_copies)
    if pipeline is None and chosen is None:
        device_mesh = _device_mesh(cluster)
    check_sources(model, list(named_state(model)), init)
    if batch not in ("global", "local"):
        raise FxparError(f"batch must be 'global' or 'local', got {batch!r}")
    stage_planner = PassPlanner(passes)
    if chosen is not None:
        if batch != "global":
            raise FxparError("batch='local' is for fxpar.compile without a pipeline plan")
        return _compile_pipeline_plan(
            model, cluster, example_inputs, loss_fn, example_targets, optimizer, chosen,
            passes=passes, check_batches=check_batches, init=init,
            mixed_precision=mixed_precision,
        )  # fmt: skip
    if pipeline is not None:
        if pipeline != "auto" and not isinstance(pipeline, Pipeline):
            raise FxparError(f"pipeline must be a fxpar.Pipeline, 'auto' or None, got {pipeline!r}")
        if batch != "global":
            raise FxparError(
                "batch='local' is for fxpar.compile without a pipeline; a pipeline takes the "
                "whole batch on every rank"
            )
        if pipeline == "auto":
            device_mesh = _device_mesh(cluster)
        else:
            on_meshes = pipeline.resolved_stage_mode(cluster.mesh_shape) == "meshes"
            if not on_meshes and choosing:
                raise FxparError(_replicas_plan_nothing(pipeline, choosing))
            return _compile_pipeline(
                model, cluster, example_inputs, loss_fn, example_targets, optimizer, pipeline,
                planner=stage_planner, on_meshes=on_meshes, check_batches=check_batches,
                init=init, mixed_precision=mixed_precision,
            )  # fmt: skip
    driver = Driver(
        model, example_inputs, loss_fn, cluster, passes, example_targets=example_targets,
        mixed_precision=mixed_precision, device=rank_device(cluster.device_type),
        max_steps=max_kept_steps,
    )  # fmt: skip
    if pipeline == "auto":
        step, joint = _joint_choice(
            driver, model, cluster, example_inputs, loss_fn, example_targets,
            stage_planner=stage_planner, optimizer=optimizer, mixed_precision=mixed_precision,
            replicas=not choosing,
        )  # fmt: skip
        best = joint.best
        if joint.pipelined and best is not None and best.choice is not None:
            if best.runs_replicas:  # stages of data-parallel replicas: no plan inside them
                replicated = _compile_pipeline(
                    model, cluster, example_inputs, loss_fn, example_targets, optimizer,
                    best.choice.pipeline, planner=stage_planner, on_meshes=False,
                    check_batches=check_batches, init=init, mixed_precision=mixed_precision,
                )  # fmt: skip
                replicated.stage_choice = best.choice
                replicated.pipeline_plan = PipelinePlan.from_choice(best.choice, cluster)
                return replicated
            assert best.program is not None
            return _compile_pipeline(
                model, cluster, example_inputs, loss_fn, example_targets, optimizer,
                best.choice.pipeline, planner=stage_planner, on_meshes=True,
                check_batches=check_batches, init=init, mixed_precision=mixed_precision,
                chosen=(best.program, best.choice),
            )  # fmt: skip
        if step is None:
            raise AssertionError("a choice without a pipeline has the plan alone")
    else:
        step = driver.training_step()  # capture -> passes -> lower
    return ParallelModel(
        step, model, optimizer, device_mesh, steps=driver, check_batches=check_batches,
        batch=batch, init=init,
    )  # fmt: skip


def _joint_choice(
    driver: Driver,
    model: nn.Module,
    cluster: Cluster,
    example_inputs: Sequence[Any] | Mapping[str, Any],
    loss_fn: LossFn | None,
    example_targets: Sequence[torch.Tensor],
    *,
    stage_planner: StagePlanner,
    optimizer: Optimizer,
    mixed_precision: MixedPrecision | None,
    replicas: bool,
) -> tuple[LoweredStep | None, JointChoice]:
    """``pipeline="auto"``: the whole batch's intra-op step (None when no plan of it fits) and
    what it was weighed against (:mod:`fxpar.joint`). ``replicas``: whether stages of
    data-parallel replicas are among the candidates; not where the user gave compile a pass
    list, solver, manual plan, pins, options or rules, which a replica (a stage run whole, no
    plan inside it) would never run."""
    step: LoweredStep | None = None
    # One capture of the whole batch's step: planned for the intra-op step, which leaves it
    # as it was, and then the step data-parallel replicas' stages are priced on.
    whole = driver.capture("train", model.training, driver.example_inputs, example_targets)
    try:
        step = driver.training_step(whole)
    except InfeasiblePlanError as error:
        logger.info("no intra-op plan of the whole batch fits: %s", error)
    candidates = pipeline_candidates(
        model, cluster, example_inputs, loss_fn, example_targets=example_targets,
        stage_planner=stage_planner, optimizer_states=optimizer.state_copies,
        mixed_precision=mixed_precision, whole=whole if replicas else None,
    )  # fmt: skip
    joint = JointChoice(step.plan.estimate if step is not None else None, candidates)
    if step is None and joint.best is None:
        reasons = "; ".join(c.describe() for c in candidates)
        raise InfeasiblePlanError(
            f"pipeline='auto' found neither an intra-op plan of the whole batch that fits nor "
            f"a pipeline ({reasons}): use more devices, bf16, remat or a smaller batch"
        )
    logger.info("pipeline='auto' weighed:\n%s", joint.report())
    return step, joint


def _compile_pipeline(
    model: nn.Module,
    cluster: Cluster,
    example_inputs: Sequence[Any] | Mapping[str, Any],
    loss_fn: LossFn | None,
    example_targets: Sequence[torch.Tensor],
    optimizer: Optimizer,
    pipeline: Pipeline,
    *,
    planner: StagePlanner,
    on_meshes: bool,
    check_batches: bool,
    init: str | os.PathLike[str] | None,
    mixed_precision: MixedPrecision | None,
    chosen: tuple[Program, StageChoice] | None = None,
) -> PipelineModel:
    """A pipeline whose stages run an intra-op plan on meshes of their own (``on_meshes``:
    ``Pipeline(stage_meshes=...)``, the cluster's mesh without its first axis when that axis
    is the stages, or ``D / K`` of its ``D`` devices), or data-parallel replicas (``D / K`` of
    them when the request leaves ``data_parallel`` at 1). ``chosen``: the micro-batch program
    and the stage DP's choice on it, made already (``pipeline="auto"``): run that, without
    planning again."""
    device = rank_device(cluster.device_type)  # where each rank's stage lives
    if pipeline.stage_meshes is not None and chosen is None:
        meshes = stage_meshes(pipeline, cluster)
        return PipelineModel(
            model, pipeline, example_inputs, loss_fn, example_targets=example_targets,
            optimizer=optimizer, stage_cluster=meshes, planner=planner,
            check_batches=check_batches, init=init, mixed_precision=mixed_precision,
            device=device,
        )  # fmt: skip
    if on_meshes:
        choice = None
        program: Program | None = None
        if chosen is not None:
            program, choice = chosen
        elif pipeline.stages == "auto":
            # Priced on the very program the pipeline runs, one micro-batch's step, whose
            # plans it then runs: the plan that runs is the plan that was priced.
            program = capture_microbatch(
                model, pipeline, example_inputs, loss_fn, example_targets=example_targets,
                mixed_precision=mixed_precision,
            )  # fmt: skip
            choice = plan_stages(
                program, cluster, pipeline, optimizer_states=optimizer.state_copies,
                stage_planner=planner, microbatch=True,
            )  # fmt: skip
            logger.info("stages chosen by the stage DP:\n%s", choice.report())
        if choice is not None:
            pipeline = choice.pipeline
            stage_cluster: Cluster | StageMeshes | None = choice.stage_cluster
            if pipeline.stage_meshes is not None:  # stages on submeshes of different shapes
                stage_cluster = stage_meshes(pipeline, cluster)
            assert stage_cluster is not None
        else:
            stage_cluster = _uniform_stage_cluster(cluster, pipeline)
        pipelined = PipelineModel(
            model, pipeline, example_inputs, loss_fn, example_targets=example_targets,
            optimizer=optimizer, stage_cluster=stage_cluster, planner=planner,
            check_batches=check_batches, init=init, mixed_precision=mixed_precision,
            program=program, plans=choice.plans if choice is not None else None, device=device,
        )  # fmt: skip
        _keep_choice(pipelined, choice, cluster)
        return pipelined
    choice = None
    if pipeline.stages == "auto":
        program = capture(
            model, example_inputs, loss_fn, example_targets=example_targets,
            mixed_precision=mixed_precision,
        )  # fmt: skip
        choice = plan_stages(program, cluster, pipeline, optimizer_states=optimizer.state_copies)
        pipeline = choice.pipeline
        logger.info("stages chosen by the stage DP:\n%s", choice.report())
    elif (
        pipeline.data_parallel == 1
        and cluster.world_size != pipeline.world_size
        and cluster.world_size % pipeline.num_stages == 0
    ):  # left open by the request: every device of the cluster a replica of its stage
        replicas = cluster.world_size // pipeline.num_stages
        pipeline = dataclasses.replace(pipeline, data_parallel=replicas)
    if cluster.world_size != pipeline.world_size:
        raise DistributedError(
            f"{pipeline} runs on {pipeline.world_size} devices ({pipeline.num_stages} stages x "
            f"{pipeline.data_parallel} per stage) but the cluster has {cluster.world_size}: "
            "make stages x data_parallel equal the number of processes, or give a cluster "
            "mesh of (stages, *stage_mesh) to run an intra-op plan inside each stage"
        )
    pipelined = PipelineModel(
        model, pipeline, example_inputs, loss_fn, example_targets=example_targets,
        optimizer=optimizer, check_batches=check_batches, init=init,
        mixed_precision=mixed_precision, device=device,
    )  # fmt: skip
    _keep_choice(pipelined, choice, cluster)
    return pipelined


def _keep_choice(pipelined: PipelineModel, choice: StageChoice | None, cluster: Cluster) -> None:
    """Record the stage DP's ``choice`` on the pipeline built from it, and the
    :class:`~fxpar.pipeline.PipelinePlan` it makes (to save and run again with ``plan=``)."""
    pipelined.stage_choice = choice
    if choice is not None:
        pipelined.pipeline_plan = PipelinePlan.from_choice(choice, cluster)


def _replicas_plan_nothing(pipeline: Pipeline, choosing: Sequence[str]) -> str:
    """Why ``choosing`` (compile's arguments that make an intra-op plan) cannot apply to
    ``pipeline``, whose stages run as data-parallel replicas."""
    where = (
        f"an intra-op plan inside {pipeline.num_stages} pipeline stages needs a cluster mesh "
        f"of ({pipeline.num_stages}, *stage_mesh), whose first axis is the stages, or "
        if pipeline.stages != "auto"
        else ""
    )
    return (
        f"{', '.join(choosing)} make the intra-op plan of a stage mesh, but {pipeline} runs "
        f"its stages as data-parallel replicas on this cluster, which run no such plan: "
        f"{where}Pipeline(stage_mode='meshes', ...) to plan each stage's mesh; or leave them "
        "out"
    )


def _uniform_stage_cluster(cluster: Cluster, pipeline: Pipeline) -> Cluster:
    """The mesh every one of ``pipeline``'s stages runs its plan on: the cluster's mesh
    without its first axis where that axis is the stages, else ``D / K`` of its ``D``
    devices, shaped as the stage DP would shape them."""
    stages = pipeline.num_stages
    if cluster.ndim >= 2 and cluster.mesh_shape[0] == stages:
        return stage_devices(cluster, stages)
    if cluster.world_size % stages:
        raise DistributedError(
            f"{pipeline} runs {stages} stages on meshes of one shape, which the cluster's "
            f"{cluster.world_size} devices do not divide into: choose a number of stages that "
            "divides them, or give stage_meshes"
        )
    return cluster.submesh(uniform_stage_mesh(cluster, cluster.world_size // stages))


def _given_plan(
    plan: PipelinePlan | str | os.PathLike[str],
) -> tuple[PipelinePlan | None, Path | None]:
    """``compile``'s ``plan=``: the pipeline plan it is or names, or the path of an intra-op
    plan file (told apart by the file's ``"format"``)."""
    if isinstance(plan, PipelinePlan):
        return plan, None
    if not isinstance(plan, str | os.PathLike):
        raise FxparError(
            f"plan must be a fxpar.pipeline.PipelinePlan or the path of a plan file, got "
            f"{type(plan).__name__}"
        )
    path = Path(plan)
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as error:
        raise PipelinePlanError(f"cannot read the plan file {path}: {error}") from error
    kind = document.get("format") if isinstance(document, dict) else None
    if kind == PIPELINE_PLAN_FORMAT:
        return PipelinePlan.load(path), None
    if kind == PLAN_FORMAT:
        return None, path
    raise PipelinePlanError(
        f"{path} is neither a pipeline plan file (format {PIPELINE_PLAN_FORMAT!r}) nor an "
        f"intra-op plan file (format {PLAN_FORMAT!r}); write one with fxpar plan --save or "
        "--save-pipeline"
    )


def _compile_pipeline_plan(
    model: nn.Module,
    cluster: Cluster,
    example_inputs: Sequence[Any] | Mapping[str, Any],
    loss_fn: LossFn | None,
    example_targets: Sequence[torch.Tensor],
    optimizer: Optimizer,
    chosen: PipelinePlan,
    *,
    passes: PassManager,
    check_batches: bool,
    init: str | os.PathLike[str] | None,
    mixed_precision: MixedPrecision | None,
) -> PipelineModel:
    """The pipeline ``chosen`` says, run as it says: its split, schedule and stages, each
    stage mesh under its plan (applied, not solved, when read from a file)."""
    chosen.check_cluster(cluster)
    pipeline = chosen.pipeline
    program = capture_microbatch(
        model, pipeline, example_inputs, loss_fn, example_targets=example_targets,
        mixed_precision=mixed_precision,
    )  # fmt: skip
    try:
        partition(program, chosen.split_points)
    except PipelineError as error:
        raise PipelinePlanError(f"split_points {list(chosen.split_points)}: {error}") from error
    planner = PassPlanner(passes)
    device = rank_device(cluster.device_type)
    stage_cluster: Cluster | StageMeshes | None = None
    plans: dict[tuple[int, ...], Plan] | None = None
    if chosen.stage_mode == "meshes":
        if pipeline.stage_meshes is not None:
            meshes = stage_meshes(pipeline, cluster)
            stage_cluster = meshes
            clusters = dict(zip(meshes.shapes, meshes.clusters, strict=True))
        else:
            stage_cluster = cluster.submesh(chosen.stages[0].mesh)
            clusters = {stage_cluster.mesh_shape: stage_cluster}
        plans = {
            shape: _stage_plan(program, clusters[shape], chosen.plans[shape], passes, shape)
            for shape in chosen.mesh_shapes
        }
    pipelined = PipelineModel(
        model, pipeline, example_inputs, loss_fn, example_targets=example_targets,
        optimizer=optimizer, stage_cluster=stage_cluster, planner=planner,
        check_batches=check_batches, init=init, mixed_precision=mixed_precision,
        program=program, plans=plans, device=device,
    )  # fmt: skip
    pipelined.pipeline_plan = chosen
    return pipelined


def _stage_plan(
    program: Program,
    mesh: Cluster,
    plan: Plan | SavedPlan,
    passes: PassManager,
    shape: tuple[int, ...],
) -> Plan:
    """The plan a stage mesh of ``shape`` runs: ``plan`` itself when it was made in this
    process, else the saved plan's choice applied to ``program`` (a copy) by ``passes``."""
    if isinstance(plan, Plan):
        return plan
    where = f"the pipeline plan's plan for stage mesh {list(shape)}"
    applying = passes.replace("choose-strategies", ApplyPlanFile(where, plan.document))
    try:
        return plan_program(program.copy(), mesh, passes=applying)
    except PlanFileError as error:
        raise PipelinePlanError(f"{where} does not fit this model's step: {error}") from error


def _device_mesh(cluster: Cluster) -> Any:
    check_device_type(cluster.device_type)
    if cluster.world_size == 1 and not dist.is_initialized():
        return None
    cluster.check_process_group()
    return cluster.device_mesh()


__all__ = ["compile", "plan"]
