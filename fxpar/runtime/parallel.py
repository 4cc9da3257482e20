"""``fxpar.compile``: a model, a cluster and an optimizer in; a model that trains in parallel out.

It reads like the diagram in DESIGN.md::

    capture(model) -> plan (passes + solver, solved once on rank 0) -> lower -> ParallelModel

Every process of the job calls :func:`compile` with the same arguments (SPMD, as under
``torchrun``) and gets a :class:`ParallelModel` that holds only its own pieces of the
parameters, buffers and optimizer state, and runs only its own program. Nothing about which
solver chose the plan reaches the runtime: it sees per-rank programs and the specs of their
inputs and outputs.

What a step does on each rank: take this rank's piece of the global batch, run the rank's
program (forward, loss, backward, with the collectives the plan needs; gradients come out in
their parameters' layouts), hand the local gradients to a ``torch.optim`` optimizer over the
local pieces (see :mod:`fxpar.optim` for why that is exact), and store the new buffers.

Checkpoints are ``torch.distributed.checkpoint`` directories of DTensors, so a checkpoint saved
under one mesh and plan loads under any other: each rank reads just the pieces its new layout
needs.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, cast, overload

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

from fxpar import checkpoint, ir
from fxpar.cluster import Cluster, Coordinate
from fxpar.errors import CheckpointError, DistributedError, FxparError
from fxpar.ir.capture import LossFn, capture
from fxpar.ir.program import Program, named_state, state_dict_aliases
from fxpar.ir.rng import RandomState
from fxpar.lowering import SPMDProgram
from fxpar.optim import AdamW, Optimizer, check_optimizer
from fxpar.pipeline import Pipeline, PipelineModel
from fxpar.pipeline.sharded import stage_devices
from fxpar.planning.plan import ManualPlan, Plan, PlanOptions, SolvedOnRankZero, plan_program
from fxpar.rules import RuleRegistry
from fxpar.runtime.batches import BatchSignature
from fxpar.runtime.collectives import OneDeviceCommunicator, ProcessGroupCommunicator
from fxpar.runtime.fingerprint import check_same_model
from fxpar.sharding import Spec, shard_tensor
from fxpar.solvers.problem import IntraOpSolver

logger = logging.getLogger(__name__)


@overload
def compile(
    model: nn.Module,
    cluster: Cluster,
    example_inputs: Sequence[Any] | Mapping[str, Any],
    loss_fn: LossFn | None = None,
    *,
    example_targets: Sequence[torch.Tensor] = (),
    optimizer: Optimizer | None = None,
    solver: IntraOpSolver | ManualPlan | None = None,
    pins: Mapping[str, Spec] | None = None,
    options: PlanOptions | None = None,
    rules: RuleRegistry | None = None,
    check_batches: bool = True,
    pipeline: None = None,
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
    solver: IntraOpSolver | ManualPlan | None = None,
    pins: Mapping[str, Spec] | None = None,
    options: PlanOptions | None = None,
    rules: RuleRegistry | None = None,
    check_batches: bool = True,
    pipeline: Pipeline,
) -> PipelineModel: ...


def compile(
    model: nn.Module,
    cluster: Cluster,
    example_inputs: Sequence[Any] | Mapping[str, Any],
    loss_fn: LossFn | None = None,
    *,
    example_targets: Sequence[torch.Tensor] = (),
    optimizer: Optimizer | None = None,
    solver: IntraOpSolver | ManualPlan | None = None,
    pins: Mapping[str, Spec] | None = None,
    options: PlanOptions | None = None,
    rules: RuleRegistry | None = None,
    check_batches: bool = True,
    pipeline: Pipeline | None = None,
) -> ParallelModel | PipelineModel:
    """Plan ``model``'s training step for ``cluster`` and build this process's share of it.

    Call it on every rank with the same arguments, after ``torch.distributed`` is initialized
    (``torchrun`` plus ``init_process_group``, or :func:`fxpar.runtime.launch.spawn`); a
    single-device cluster needs no process group. The weights of rank 0's ``model`` are the
    ones trained: they are broadcast, as DistributedDataParallel does, so every rank starts
    from the same state even if the models were initialized differently.

    Args:
        model: the module to train, with real weights. Its parameters are copied; the model
            itself is left as it is.
        cluster: the device mesh and what its devices can do; its size must equal the world
            size.
        example_inputs, loss_fn, example_targets: as for :func:`fxpar.capture`. Batches given
            to :meth:`ParallelModel.step` must have the same shapes.
        optimizer: :class:`fxpar.optim.AdamW` (the default) or :class:`fxpar.optim.SGD`.
        solver: how to choose the plan (see :func:`fxpar.plan`); it runs on rank 0 only and
            its answer is broadcast, so every rank lowers the same plan.
        pins, options, rules: as for :func:`fxpar.plan`.
        check_batches: compare a digest of every batch across ranks before each step (one
            small all-gather), so a rank fed a different batch fails loudly instead of
            training on a mixture; pipelines too.
        pipeline: run the step as a synchronous pipeline instead (see
            :class:`fxpar.pipeline.Pipeline` and docs/pipelines.md): returns a
            :class:`~fxpar.pipeline.PipelineModel`. On a cluster of mesh ``(K, *stage_mesh)``
            (``K`` stages first) each stage runs its share of an intra-op plan on its stage
            mesh, chosen by ``solver`` (the ILP by default; ``pins``, ``options`` and
            ``rules`` apply); otherwise each stage runs data-parallel on
            ``pipeline.data_parallel`` devices.
    """
    optimizer = check_optimizer(optimizer if optimizer is not None else AdamW())
    intra_op = any(option is not None for option in (solver, pins, options, rules))
    if pipeline is None:
        device_mesh = _device_mesh(cluster)
    _check_materialized(model)
    options = replace(options or PlanOptions(), optimizer_states=optimizer.state_copies)
    if pins:
        options = replace(options, pins=dict(pins))
    if solver is None or hasattr(solver, "solve"):  # manual plans are deterministic as they are
        solver = SolvedOnRankZero(cast("IntraOpSolver | None", solver))
    planner = functools.partial(plan_program, solver=solver, options=options, rules=rules)
    if pipeline is not None:
        return _compile_pipeline(
            model, cluster, example_inputs, loss_fn, example_targets, optimizer, pipeline,
            planner=planner, intra_op=intra_op, check_batches=check_batches,
        )  # fmt: skip
    program = capture(model, example_inputs, loss_fn, example_targets=example_targets)
    plan = planner(program, cluster)
    return ParallelModel(plan, model, optimizer, device_mesh, check_batches=check_batches)


def _compile_pipeline(
    model: nn.Module,
    cluster: Cluster,
    example_inputs: Sequence[Any] | Mapping[str, Any],
    loss_fn: LossFn | None,
    example_targets: Sequence[torch.Tensor],
    optimizer: Optimizer,
    pipeline: Pipeline,
    *,
    planner: Callable[[Program, Cluster], Plan],
    intra_op: bool,
    check_batches: bool,
) -> PipelineModel:
    """A pipeline whose stages run an intra-op plan on the cluster's mesh without its first
    axis (when that axis is the stages, or a solver, pins, options or rules ask for a plan),
    or data-parallel replicas."""
    stages_first = (
        pipeline.stages != "auto"
        and pipeline.data_parallel == 1
        and cluster.ndim >= 2
        and cluster.mesh_shape[0] == pipeline.num_stages
    )
    if intra_op or stages_first:
        choice = None
        if pipeline.stages == "auto":
            from fxpar.pipeline import plan_stages

            program = capture(model, example_inputs, loss_fn, example_targets=example_targets)
            choice = plan_stages(
                program, cluster, pipeline, optimizer_states=optimizer.state_copies,
                stage_planner=planner,
            )  # fmt: skip
            logger.info("stages chosen by the stage DP:\n%s", choice.report())
            pipeline, stage_cluster = choice.pipeline, choice.stage_cluster
            assert stage_cluster is not None
        else:
            stage_cluster = stage_devices(cluster, pipeline.num_stages)
        pipelined = PipelineModel(
            model, pipeline, example_inputs, loss_fn, example_targets=example_targets,
            optimizer=optimizer, stage_cluster=stage_cluster, planner=planner,
            check_batches=check_batches,
        )  # fmt: skip
        pipelined.stage_choice = choice
        return pipelined
    choice = None
    if pipeline.stages == "auto":
        from fxpar.pipeline import plan_stages

        program = capture(model, example_inputs, loss_fn, example_targets=example_targets)
        choice = plan_stages(program, cluster, pipeline, optimizer_states=optimizer.state_copies)
        pipeline = choice.pipeline
        logger.info("stages chosen by the stage DP:\n%s", choice.report())
    if cluster.world_size != pipeline.world_size:
        raise DistributedError(
            f"{pipeline} runs on {pipeline.world_size} devices ({pipeline.num_stages} stages x "
            f"{pipeline.data_parallel} per stage) but the cluster has {cluster.world_size}: "
            "make stages x data_parallel equal the number of processes, or give a cluster "
            "mesh of (stages, *stage_mesh) to run an intra-op plan inside each stage"
        )
    pipelined = PipelineModel(
        model, pipeline, example_inputs, loss_fn, example_targets=example_targets,
        optimizer=optimizer, check_batches=check_batches,
    )  # fmt: skip
    pipelined.stage_choice = choice
    return pipelined


class ParallelModel:
    """This rank's share of a model compiled by :func:`compile`.

    Attributes:
        plan: the chosen plan (the same on every rank): strategies, costs, solver's answer.
        spmd: the per-rank programs and the specs of their inputs and outputs.
        rank, coordinate: this process's rank and its place in the mesh.
        program: this rank's GraphModule; its code is ``program.code``.
    """

    def __init__(
        self,
        plan: Plan,
        model: nn.Module,
        optimizer: Optimizer,
        device_mesh: Any,
        *,
        check_batches: bool = True,
    ) -> None:
        self.plan = plan
        self.cluster = plan.cluster
        self.spmd: SPMDProgram = plan.lower()
        self.signature = plan.program.signature
        self.optimizer_spec = optimizer
        self.check_batches = check_batches
        self._device_mesh = device_mesh
        self.rank = dist.get_rank() if device_mesh is not None else 0
        self.coordinate: Coordinate = self.cluster.coordinate(self.rank)
        self.program: fx.GraphModule = self.spmd.ranks[self.rank].graph_module
        self._communicator = (
            ProcessGroupCommunicator(device_mesh)
            if device_mesh is not None
            else OneDeviceCommunicator()
        )
        placeholders = plan.program.placeholders()
        self._specs = dict(zip(placeholders, self.spmd.input_specs, strict=True))
        self._metas = {name: ir.require(n, ir.ValueMeta).tensor for name, n in placeholders.items()}

        state = named_state(model)
        names = self.signature.parameters + self.signature.buffers
        self._aliases = state_dict_aliases(model, names)
        check_same_model(state, names)
        self.parameters: dict[str, torch.Tensor] = {}
        self.buffers: dict[str, torch.Tensor] = {}
        for name in names:
            full = self._broadcast(state[name].detach().clone())
            piece = self._local(name, full).clone()
            target = self.parameters if name in self.signature.parameters else self.buffers
            target[name] = piece
        self.trainable = [self.parameters[name] for name in self.signature.gradients]
        self.optimizer = optimizer.build(self.trainable)
        self.random = RandomState.from_rank_zero(distributed=device_mesh is not None)
        """The generator the step's random ops draw from, the same on every rank."""
        self.steps = 0

    @property
    def programs(self) -> tuple[fx.GraphModule, ...]:
        """Every rank's GraphModule, by rank."""
        return tuple(rank.graph_module for rank in self.spmd.ranks)

    # -- training ---------------------------------------------------------------------------

    def step(self, *batch: torch.Tensor, **named_batch: torch.Tensor) -> torch.Tensor:
        """One training step on the global batch: forward, backward, optimizer update.

        The batch is given whole and identically on every rank (model inputs, then loss
        targets, positionally or by name), shaped like the example it was compiled with; each
        rank takes its own piece. Returns the loss, a scalar, the same on every rank.
        """
        outputs = self._run(self._batch(batch, named_batch))
        gradients = outputs[1 : 1 + len(self.trainable)]
        for parameter, gradient in zip(self.trainable, gradients, strict=True):
            parameter.grad = gradient
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        updates = outputs[1 + len(self.trainable) :]
        for name, value in zip(self.signature.buffer_updates, updates, strict=True):
            self.buffers[name].copy_(value)
        self.steps += 1
        return outputs[0]

    def loss(self, *batch: torch.Tensor, **named_batch: torch.Tensor) -> torch.Tensor:
        """The loss of the current weights on a batch, changing nothing: random ops (dropout)
        draw what the next step will draw, and the random state is left where it was."""
        state = self.random.state
        try:
            return self._run(self._batch(batch, named_batch))[0]
        finally:
            self.random.state = state

    def _run(self, batch: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        inputs = [self.parameters[n] for n in self.signature.parameters]
        inputs += [self.buffers[n] for n in self.signature.buffers]
        # Random inputs are drawn whole on every rank, each keeping its piece (see fxpar.rng).
        step_inputs = [*batch, *self.random.draw(self.signature.random)]
        inputs += [
            self._local(name, tensor)
            for name, tensor in zip(self.signature.step_inputs, step_inputs, strict=True)
        ]
        with torch.no_grad():
            return tuple(self.program(self._communicator, *inputs))

    def _batch(
        self, batch: tuple[torch.Tensor, ...], named: Mapping[str, torch.Tensor]
    ) -> list[torch.Tensor]:
        names = self.signature.inputs
        expected = BatchSignature(names, tuple(self._metas[name] for name in names))
        check_ranks = self.check_batches and self._device_mesh is not None
        return expected.take(batch, named, check_ranks=check_ranks, rank=self.rank)

    # -- state --------------------------------------------------------------------------------

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer, whole, under the model's own state_dict names (tied
        weights under each of their names). A collective: call it on every rank."""
        state = {}
        for name in self.signature.parameters + self.signature.buffers:
            full = self._full(name)
            for alias in self._aliases.get(name, (name,)):
                state[alias] = full
        return state

    def _full(self, name: str) -> torch.Tensor:
        local = self.parameters.get(name, self.buffers.get(name))
        assert local is not None
        if self._device_mesh is None:
            return local.clone()
        return self._dtensor(name, local).full_tensor()

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write a sharded checkpoint (see :mod:`fxpar.checkpoint`): the parameters, buffers,
        optimizer state, step count and random state, each rank writing its own pieces. The
        save is atomic: the previous checkpoint at ``path`` stays until every rank has written
        the new one. A collective: call it on every rank."""
        distributed = self._device_mesh is not None
        checkpoint.save(
            self._checkpoint_state(include_missing=False), path, distributed=distributed
        )

    def load(self, path: str | os.PathLike[str], *, strict: bool = True) -> None:
        """Read a checkpoint written by :meth:`save` (or by a :class:`PipelineModel` of the
        same model), under this model's mesh and plan, which may differ from those it was
        saved with. With ``strict`` (the default) the checkpoint must hold exactly this
        model's entries; ``strict=False`` loads those both have. A collective: call it on
        every rank.

        Raises:
            CheckpointError: no committed checkpoint at ``path``, a damaged one, another
                model's (with ``strict``), or an entry of another shape.
        """
        distributed = self._device_mesh is not None
        state = self._checkpoint_state(include_missing=True)
        expected = checkpoint.Entries(self.signature, self.optimizer_spec)
        wanted = checkpoint.load(
            state, path, distributed=distributed, expected=expected, strict=strict
        )
        self.steps = checkpoint.restore_progress(wanted, self.steps, self.random)
        # Loads land in place in the local pieces (DTensors share their storage), except for
        # the plain tensors, which are copied back here.
        if not distributed:
            for key, value in wanted.items():
                if key.startswith(("model/", "optimizer/")):
                    self._checkpoint_tensor(key).copy_(value)

    def _checkpoint_state(self, *, include_missing: bool) -> dict[str, Any]:
        state: dict[str, Any] = checkpoint.progress_entries(self.steps, self.random)
        for name in self.signature.parameters + self.signature.buffers:
            state[f"model/{name}"] = self._dtensor(name, self._checkpoint_tensor(f"model/{name}"))
        trainable = dict(zip(self.signature.gradients, self.trainable, strict=True))
        state.update(
            checkpoint.optimizer_entries(
                trainable, self.optimizer, self.optimizer_spec, self._dtensor,
                include_missing=include_missing,
            )
        )  # fmt: skip
        if self._device_mesh is None:
            state = {
                key: v.clone() if isinstance(v, torch.Tensor) else v for key, v in state.items()
            }
        return state

    def _checkpoint_tensor(self, key: str) -> torch.Tensor:
        kind, _, rest = key.partition("/")
        if kind == "model":
            return self.parameters.get(rest, self.buffers.get(rest))  # type: ignore[return-value]
        if kind == "optimizer":
            name, _, slot = rest.rpartition("/")
            parameter = self.trainable[self.signature.gradients.index(name)]
            return self.optimizer.state[parameter][slot]
        raise CheckpointError(f"unexpected checkpoint entry {key!r}")

    # -- layouts ------------------------------------------------------------------------------

    def _local(self, name: str, full: torch.Tensor) -> torch.Tensor:
        return shard_tensor(full, self._specs[name], self.cluster.mesh_shape, self.coordinate)

    def _dtensor(self, name: str, local: torch.Tensor) -> Any:
        if self._device_mesh is None:
            return local
        return checkpoint.dtensor(
            local, self._device_mesh, self._specs[name], self._metas[name].shape
        )

    def _broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._device_mesh is not None:
            dist.broadcast(tensor, src=0)
        return tensor

    def __repr__(self) -> str:
        return (
            f"ParallelModel(rank {self.rank} at {self.coordinate} of {self.cluster}; "
            f"{len(self.parameters)} parameters, {self.steps} steps; {self.plan.summary()})"
        )


def _device_mesh(cluster: Cluster) -> Any:
    if cluster.world_size == 1 and not dist.is_initialized():
        return None
    cluster.check_process_group()
    if cluster.device_type != "cpu":
        raise DistributedError(
            f"fxpar.compile runs per-rank programs on CPU processes (gloo) in this release; the "
            f"cluster says {cluster.device_type!r}. Plan for GPUs with fxpar.plan, or pass "
            "device_type='cpu' to run"
        )
    return cluster.device_mesh()


def _check_materialized(model: nn.Module) -> None:
    on_meta = [n for n, p in model.named_parameters() if p.is_meta]
    if on_meta:
        raise FxparError(
            f"{type(model).__name__} has parameters on the meta device ({on_meta[0]!r}, ...): "
            "fxpar.compile trains real weights. Plan without weights with fxpar.plan, or "
            "materialize the model (model.to_empty(device='cpu') and initialize, or load a "
            "checkpoint) first"
        )


__all__ = ["ParallelModel", "compile"]
