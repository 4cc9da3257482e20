"""``PipelineModel``: train a model as a synchronous pipeline on ``torch.distributed`` ranks.

It reads like the runtime half of the stages in docs/pipelines.md::

    capture at micro-batch size -> partition into stages -> split into forward/backward
    programs -> schedule (GPipe, 1F1B, interleaved, ZB-H1, ZB-V) -> this rank's StageWorker
    -> reduce -> update

Ranks are laid out stage-major: stage ``s`` runs on ranks ``s*D .. s*D + D-1`` for ``D``
devices per stage (``Pipeline.data_parallel``), and replica ``d`` of every stage forms one
pipeline, exchanging activations and gradients with the same ``d`` of its neighbours.

One step, on every rank: check the global batch (its shapes, and that every rank has the same
one, see :mod:`fxpar.runtime.batches`), cut it into ``M`` micro-batches and take this
replica's piece of each, run the stage's instruction list, then once per step: all-reduce the
gradient sums within the stage's replicas, all-reduce the partial gradients of parameters
held by several stages (tied weights) among their holders, divide by ``M * D`` for a mean loss
(or by 1 when every piece's loss is already a share of the whole batch's, see
:mod:`.semantics`), so the result is the whole batch's gradient, and let each rank update its
own stage's parameters with a ``torch.optim`` optimizer. Elementwise optimizers
(:mod:`fxpar.optim`) make each stage's update exactly its share of the single-device one, and
copies of a tied weight stay identical because they take identical updates.

**Intra-op plans inside stages.** Given a ``stage_cluster`` (a stage mesh), the step captured
at micro-batch size is planned for that mesh first (tensor parallelism, an ILP plan, ...),
and each stage runs its share of the plan on ``stage_cluster.world_size`` devices: ranks
``s*T .. s*T + T-1`` for ``T`` devices per stage, rank ``s*T + t`` at coordinate ``t`` of the
stage mesh, exchanging activations with the same coordinate of the neighbouring stages (see
:mod:`.intra_op`). Gradients are summed over micro-batches in the layout the backward made them
in and converted to their parameters' layouts once per step.

**Checkpoints.** :meth:`PipelineModel.save` writes this stage's pieces under the model's own
names (:mod:`fxpar.checkpoint`), so pipelines and :class:`~fxpar.runtime.parallel.ParallelModel` of
any layout load each other's checkpoints.

**Semantics.** Masked and ``ignore_index`` losses are divided by the whole batch's count, so the
step is the whole batch's. What a pipeline cannot compute like the whole batch (BatchNorm's
statistics are per micro-batch, as in GPipe; a loss that is not a sum or a mean) is logged as a
warning when the model is built and listed in :attr:`PipelineModel.semantics`. BatchNorm's
running statistics are updated once per micro-batch, in micro-batch order; with ``D > 1`` each
replica keeps its own.

**The loop.** :meth:`PipelineModel.step` is :meth:`~PipelineModel.backward` (gradients added to
``.grad``), :meth:`~PipelineModel.clip_grad_norm_` (one all-reduce, every piece counted once),
:meth:`~PipelineModel.optimizer_step` and :meth:`~PipelineModel.zero_grad`, as for
:class:`~fxpar.runtime.parallel.ParallelModel`; :meth:`~PipelineModel.loss` runs the forward
half of every stage's list (:func:`.schedule.forward_only`) and keeps nothing.

**Evaluation and inference.** :meth:`~PipelineModel.train` and :meth:`~PipelineModel.eval`
switch the mode every call runs the model in, and ``pipelined(*inputs)`` returns the model's
outputs for a batch, whole on every rank, through the forward half of the schedule. Each
kind of program and mode is captured and cut at the training split's points on first use, over
the same state, which is checked not to move (:mod:`.stage_programs`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Replicate

from fxpar import checkpoint, ir
from fxpar.cluster import Cluster, Coordinate
from fxpar.errors import BatchError
from fxpar.ir.capture import LossFn, batch_tensors, capture, with_batch_tensors
from fxpar.ir.placement import as_device
from fxpar.ir.precision import MixedPrecision
from fxpar.ir.program import Program, named_state, state_dict_aliases
from fxpar.ir.repeat import capture_repeated
from fxpar.ir.rng import RandomState
from fxpar.lowering.collective_calls import Communicator
from fxpar.optim import AdamW, Optimizer, check_optimizer
from fxpar.passes import default_passes, for_compile
from fxpar.passes.canonicalize import Canonicalize
from fxpar.pipeline.executor import StageResult, StageTrace, StageWorker
from fxpar.pipeline.groups import (
    LossReduction,
    TiedSum,
    first_holder,
    replica_group,
    stage_device_mesh,
    tied_sums,
)
from fxpar.pipeline.intra_op import ShardedStage, local_batch, planned_specs
from fxpar.pipeline.meshes import StageMeshes, meshes_of, plan_each
from fxpar.pipeline.options import Pipeline, PipelineError
from fxpar.pipeline.partition import even_split_points, partition
from fxpar.pipeline.schedule import simulate
from fxpar.pipeline.semantics import PipelineSemantics
from fxpar.pipeline.split import SplitProgram, split_program
from fxpar.pipeline.stage_programs import (
    PassPlanner,
    StageCutter,
    StageLayout,
    StageStep,
    check_same_cut,
)
from fxpar.planning.plan import Plan
from fxpar.runtime import waiting
from fxpar.runtime.batches import BatchSignature
from fxpar.runtime.communicators import OneDeviceCommunicator, ProcessGroupCommunicator
from fxpar.runtime.devices import HostStaged, broadcast_from_rank_zero, stages_through_host
from fxpar.runtime.fingerprint import check_same_model
from fxpar.runtime.lowered import call_inputs, forward_key
from fxpar.runtime.trainer import Trainer
from fxpar.runtime.weights import Piece, initial_pieces
from fxpar.sharding import Spec, assemble

if TYPE_CHECKING:
    from fxpar.pipeline.pipeline_plan import PipelinePlan
    from fxpar.pipeline.stage_choice import StageChoice

logger = logging.getLogger(__name__)


class PipelineModel(Trainer):
    """This rank's stage of a pipelined model (see the module docstring).

    Attributes:
        split: the per-stage programs of the training step the pipeline was built for (the
            same on every rank); its stages hold the state every other program reads.
        plan: the intra-op plan the stages run (with a ``stage_cluster``), else None.
        rank, stage, replica, coordinate: where this process sits (``coordinate`` in the
            stage mesh; ``()`` without one).
        parameters, buffers: this stage's tensors, by name (tied weights in each holder).
        gradients: this stage's gradients of the last :meth:`~PipelineModel.backward` (or
            step), the whole batch's, before ``scale`` and clipping; the update reads the
            accumulated ones, the parameters' ``.grad``.
        trace: the last step's instruction timings on this rank.
        stage_choice: the stage DP's choice, when ``fxpar.compile`` planned the stages.
        pipeline_plan: the :class:`~fxpar.pipeline.PipelinePlan` it runs, when
            ``fxpar.compile`` was given one (``plan=``) or its stage DP chose it
            (``stages="auto"``, ``pipeline="auto"``): save it to run the same again.
        semantics: how the micro-batches' losses make the step's, and the notes on where the
            step differs from training on the whole batch (empty when it does not).
        check_batches: whether each step checks that every rank got the same batch.
        training: whether calls run the model in train mode (as ``nn.Module.training``; the
            model's mode when the pipeline was built).
    """

    def __init__(
        self,
        model: nn.Module,
        pipeline: Pipeline,
        example_inputs: Sequence[Any] | Mapping[str, Any],
        loss_fn: LossFn | None = None,
        *,
        example_targets: Sequence[torch.Tensor] = (),
        optimizer: Optimizer | None = None,
        stage_cluster: Cluster | Sequence[Cluster] | StageMeshes | None = None,
        planner: Callable[[Program, Cluster], Plan] | None = None,
        check_batches: bool = True,
        init: str | os.PathLike[str] | None = None,
        mixed_precision: MixedPrecision | None = None,
        program: Program | None = None,
        plans: Mapping[tuple[int, ...], Plan] | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        """``stage_cluster``: run an intra-op plan inside every stage, on a mesh of this shape
        (see the module docstring); ``planner(program, stage_cluster)`` makes the plan, the
        same on every rank (by default the ILP, solved on rank 0 and broadcast; e.g.
        ``functools.partial(fxpar.passes.plan_program, manual=fxpar.plans.tensor_parallel)``
        for Megatron). With ``Pipeline(stage_meshes=...)``, ``stage_cluster`` is one Cluster per
        stage (or None: default links), each mesh shape is planned once, and values crossing
        between stages on different meshes are resharded (:mod:`.crossings`). It plans the
        programs of eval mode and of the forward too, which must keep every parameter and
        buffer in its layout: a :class:`~.stage_programs.PassPlanner` (the default's kind) pins
        them, any other planner's plans are checked and refused if they move one.
        ``program``: the training step already captured at one micro-batch's shapes
        (:func:`capture_microbatch`); captured here when None. ``plans``: the plan to run on
        each stage mesh shape, made on ``program`` (``StageChoice.plans`` of
        :func:`~fxpar.pipeline.auto.plan_stages` with ``microbatch=True``, which
        :func:`fxpar.compile` hands over for ``stages="auto"``), run as they are instead of
        planning again, so the plan that runs is the plan that was priced; planned here with
        ``planner`` when None.
        ``check_batches``: compare a digest of every batch across ranks before each step (one
        small all-gather), so that a rank fed another batch fails loudly instead of training
        on a mixture. ``init`` (a checkpoint to start from; each rank reads
        only its stage's pieces) and ``mixed_precision``: as for :func:`fxpar.compile`.
        ``device``: where this rank's state lives and its stage programs run (``cuda:i`` on a
        GPU; :func:`fxpar.compile` gives :func:`fxpar.runtime.devices.rank_device`); batches
        may be given on the CPU or there."""
        self.pipeline = pipeline
        self.device = as_device(device)
        """Where this rank's parameters, buffers, optimizer state and programs are."""
        self.check_batches = check_batches
        self.optimizer_spec = check_optimizer(optimizer if optimizer is not None else AdamW())
        meshes = meshes_of(pipeline, stage_cluster)
        self._meshes = meshes
        per_stage = meshes.clusters[0].world_size if meshes else pipeline.data_parallel
        world_size = meshes.world_size if meshes else pipeline.num_stages * per_stage
        distributed = dist.is_available() and dist.is_initialized()
        world = dist.get_world_size() if distributed else 1
        if world != world_size:
            raise PipelineError(
                f"{pipeline} needs {world_size} processes ("
                + (
                    f"stage meshes {meshes.shapes}"
                    if meshes and not meshes.uniform
                    else f"{pipeline.num_stages} stages x {per_stage} devices per stage"
                )
                + ") but "
                + (
                    f"the process group has {world}"
                    if distributed
                    else "torch.distributed is not initialized"
                )
                + "; launch that many (torchrun, or fxpar.runtime.launch.spawn)"
            )
        self.rank = dist.get_rank() if distributed else 0
        self._distributed = distributed
        self._per_stage = per_stage
        self.stage, local = meshes.locate(self.rank) if meshes else divmod(self.rank, per_stage)
        self.stage_cluster = meshes.clusters[self.stage] if meshes else None
        self._local_index = local
        self.replica = 0 if meshes else local
        self.coordinate: Coordinate = meshes.coordinate(self.rank) if meshes else ()

        self._batch_size, micro_inputs, micro_targets = _microbatch(
            pipeline, example_inputs, example_targets
        )
        if program is None:
            program = _capture_canonical(
                model, micro_inputs, loss_fn, micro_targets, mixed_precision
            )
        planner = planner or PassPlanner(for_compile(default_passes()))
        points = pipeline.stages
        if isinstance(points, int):
            points = even_split_points(program, pipeline.num_chunks)
        self.plans: dict[tuple[int, ...], Plan] = {}
        """The intra-op plan of each stage mesh shape (with stage meshes)."""
        splits: dict[tuple[int, ...], Program] = {(): program}
        if meshes is not None:
            if plans is None:
                if isinstance(planner, PassPlanner):  # as the stage DP plans a micro-batch
                    planner = planner.per_microbatch(pipeline.microbatches)
                self.plans = plan_each(program, meshes, planner)
            else:
                self.plans = _given_plans(plans, meshes, program)
            splits = {shape: plan.program for shape, plan in self.plans.items()}
        elif plans is not None:
            raise PipelineError(
                f"plans were given for stage meshes {sorted(plans)}, but {pipeline} runs "
                "data-parallel replicas: give the stage meshes too (stage_cluster=)"
            )
        cut = {
            shape: split_program(each, partition(each, points), remat=pipeline.remat)
            for shape, each in splits.items()
        }
        check_same_cut(cut)
        self._state_specs = {shape: planned_specs(cut[shape], shape) for shape in self.plans}
        own = self.stage_cluster.mesh_shape if self.stage_cluster else ()
        self.plan: Plan | None = self.plans.get(own)
        self.split: SplitProgram = cut[own]
        program = self.split.program
        self.schedule = pipeline.instruction_lists()
        simulate(self.schedule, pipeline.named_schedule.placement)
        self.signature = program.signature
        self.semantics: PipelineSemantics = self.split.semantics
        if self.rank == 0:
            for note in self.semantics.notes:
                logger.warning("this pipeline does not train on the whole batch at once: %s", note)
        placeholders = program.placeholders()
        self._batch_signature = BatchSignature(
            self.signature.inputs,
            tuple(
                _whole_batch(ir.require(placeholders[n], ir.ValueMeta).tensor, self._batch_size)
                for n in self.signature.inputs
            ),
        )
        names = program.signature.parameters + program.signature.buffers
        self._aliases = state_dict_aliases(model, names)
        self._shapes = {n: ir.require(placeholders[n], ir.ValueMeta).tensor.shape for n in names}

        self._stage_group = replica_group(pipeline, self.stage) if distributed else None
        self._tied: dict[str, TiedSum] = {}
        if distributed:
            self._tied = tied_sums(
                self.split, pipeline, self.rank, per_stage=per_stage, meshes=meshes,
                spec_of=self._stage_spec, shapes=self._shapes,
            )  # fmt: skip
        self._device_mesh = None
        if distributed:
            self._device_mesh = stage_device_mesh(pipeline, meshes, self.stage, self.device.type)
        communicator: Communicator = OneDeviceCommunicator()
        if self._device_mesh is not None:
            communicator = ProcessGroupCommunicator(self._device_mesh)
            if stages_through_host(self.device):
                communicator = HostStaged(communicator, self.device)
            self._mesh_copies = self._device_mesh.device_type != self.device.type
        before, after = pipeline.neighbour(self.stage, -1), pipeline.neighbour(self.stage, 1)
        layout = StageLayout(
            pipeline, self.schedule, self.stage, self.rank, per_stage,
            previous_rank=None if before is None else _peer(meshes, before, per_stage, local),
            next_rank=None if after is None else _peer(meshes, after, per_stage, local),
            meshes=meshes, coordinate=self.coordinate, communicator=communicator,
            distributed=distributed, device=self.device,
        )  # fmt: skip
        self.training = model.training
        trained = layout.assemble(cut, "train", self.training, self._batch_signature)
        self._steps: dict[Hashable, StageStep] = {("train", self.training, None): trained}
        self._cutter = StageCutter(
            model, loss_fn, micro_inputs, micro_targets, tuple(points), pipeline.remat,
            planner, layout, trained, mixed_precision,
        )  # fmt: skip
        self.sharded: ShardedStage | None = trained.sharded
        state = named_state(model)
        check_same_model(state, names)
        split, own = self.split, pipeline.chunks_of(self.stage)
        held = {n for c in own for n in split.stage_parameters(c) + split.stage_buffers(c)}
        mine = initial_pieces(
            model, names, {name: self._piece(name) for name in names if name in held}, init,
            distributed=self._distributed,
        )  # fmt: skip
        mine = {name: tensor.to(self.device) for name, tensor in mine.items()}
        self.parameters = {n: mine[n] for n in self.signature.parameters if n in held}
        self.buffers = {n: mine[n] for n in self.signature.buffers if n in held}
        self._trainable = [n for n in self.signature.gradients if n in self.parameters]
        self._norm_counted = {n for n in self._trainable if self._counts_in_norm(n)}
        self._gradient_dtype = next(
            (ir.require(placeholders[n], ir.ValueMeta).tensor.dtype for n in self._trainable),
            torch.float32,
        )
        self.optimizer = self.optimizer_spec.build([self.parameters[n] for n in self._trainable])
        self.random = RandomState(
            broadcast_from_rank_zero(torch.get_rng_state(), distributed=distributed)
        )
        """The generator the step's random ops draw from, the same on every rank."""
        self.gradients: dict[str, torch.Tensor] = {}
        self._syncing = True
        self._unsynced: dict[int, tuple[StageStep, dict[str, torch.Tensor]]] = {}
        """Gradient sums kept unreduced inside no_sync, by the step (its id) that made them."""
        self.trace: StageTrace | None = None
        self.stage_choice: StageChoice | None = None
        """The stage DP's choice when the stages were planned (``stages="auto"``)."""
        self.pipeline_plan: PipelinePlan | None = None
        self.steps = 0

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer, whole, under the model's own state_dict names (tied
        weights under each of their names), gathered from the stages that hold them (replica 0
        of each; with BatchNorm and ``data_parallel > 1`` replicas keep their own running
        statistics) and, inside a stage mesh, reassembled from every device's piece. A
        collective: call it on every rank."""
        mine = {**self.parameters, **self.buffers} if self.replica == 0 else {}
        part = (
            self.stage,
            self.coordinate,
            {n: t.detach().to("cpu", copy=True) for n, t in mine.items()},
        )
        everyone: list[Any] = [part]
        if self._distributed and dist.get_world_size() > 1:
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, part)
        # Each tensor from the first stage holding it (stages may lay it out differently).
        pieces: dict[str, tuple[int, dict[Coordinate, torch.Tensor]]] = {}
        for stage, coordinate, tensors in sorted(everyone, key=lambda p: p[0]):
            for name, tensor in tensors.items():
                home, found = pieces.setdefault(name, (stage, {}))
                if home == stage:
                    found[coordinate] = tensor
        state = {}
        for name in self.signature.parameters + self.signature.buffers:
            whole = self._whole(name, *pieces[name]).to(self.device)
            for alias in self._aliases.get(name, (name,)):
                state[alias] = whole
        return state

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.pipeline.num_stages - 1

    # -- training -----------------------------------------------------------------------------

    def backward(
        self, *batch: torch.Tensor, scale: float = 1.0, **named_batch: torch.Tensor
    ) -> torch.Tensor:
        """The pipelined forward and backward on a global batch (as :meth:`step` takes it),
        without an update: this stage's gradients of the whole batch's loss, reduced over its
        replicas and the holders of tied weights, are added times ``scale`` to the held
        parameters' ``.grad`` (so calls accumulate, as ``loss.backward()`` does, until
        :meth:`zero_grad`), and the new buffer values are stored. Returns the loss, on every
        rank. With ``scale=1/k``, k calls on the pieces of a batch accumulate the gradient of
        the mean loss over the whole batch. A collective: call it on every rank.

        Inside :meth:`no_sync` each gradient is kept as this stage computed it, unreduced
        (before the all-reduces over replicas and tied weights' holders and, with a stage
        plan, the conversion to its parameter's layout), and ``.grad`` is left alone; the first
        call outside it (or :meth:`clip_grad_norm_` or :meth:`optimizer_step`) reduces the sum
        of all of them at once, and :attr:`gradients` is then that sum."""
        if self._syncing and not self._unsynced:
            mean = self.compute_gradients(*batch, **named_batch)
            for name in self._trainable:
                # A copy, so clipping in place leaves :attr:`gradients` as computed.
                self._add_gradient(name, self.gradients[name] * scale)
            return mean
        step, tensors, check = self._training_step(batch, named_batch)
        result, loss = self._run(step, step.worker, tensors, check)
        self.trace = result.trace
        for name in self.buffers:
            self.buffers[name] = result.buffers[name]
        weight = scale / self._divisor(step)
        kept = self._unsynced.setdefault(id(step), (step, {}))[1]
        for name, value in result.gradient_sums.items():
            if name in kept:
                kept[name].add_(value, alpha=weight)
            else:
                kept[name] = value * weight
        growing = step.sharded is not None and step.sharded.sync.grows
        if self._syncing or growing:
            self._sync_gradients()
        return loss.wait()

    def _sync_gradients(self) -> None:
        """Reduce every gradient kept unreduced (one conversion program, and the all-reduces
        of one set of buckets per group, whatever the number of backward passes) and add it
        to ``.grad``. A collective: every rank keeps the same steps."""
        if not self._unsynced:
            return
        total: dict[str, torch.Tensor] = {}
        for step, kept in self._unsynced.values():
            for name, gradient in self._reduce_gradients(step, kept, 1).items():
                total[name] = total[name] + gradient if name in total else gradient
        self._unsynced.clear()
        for name, gradient in total.items():
            self._add_gradient(name, gradient.clone())
        self.gradients = total

    def compute_gradients(self, *batch: torch.Tensor, **named_batch: torch.Tensor) -> torch.Tensor:
        """The step without the update, and without touching ``.grad``: fills
        :attr:`gradients` and :attr:`trace`, updates buffers, returns the loss
        (:meth:`backward` is this, adding the gradients to ``.grad``)."""
        step, tensors, check = self._training_step(batch, named_batch)
        result, loss = self._run(step, step.worker, tensors, check)
        self.trace = result.trace
        for name in self.buffers:
            self.buffers[name] = result.buffers[name]
        self.gradients = self._reduce_gradients(step, result.gradient_sums, self._divisor(step))
        return loss.wait()

    def loss(self, *batch: torch.Tensor, **named_batch: torch.Tensor) -> torch.Tensor:
        """The loss of the current weights on a global batch (as :meth:`step` takes it), on
        every rank, with the model in the current mode (:meth:`eval`: no dropout, BatchNorm's
        running statistics), changing nothing: only the forward instructions of the current
        mode's training step run (activations still pass from stage to stage, no backward, no
        gradients), buffer updates are dropped, and random ops (dropout) draw what the next
        step will draw, the random state being left where it was. It equals the loss
        :meth:`step` reports for that batch. A collective: call it on every rank."""
        step, tensors, check = self._training_step(batch, named_batch)
        state = self.random.state
        try:
            _, loss = self._run(step, step.forward_worker, tensors, check)
        finally:
            self.random.state = state
        return loss.wait()

    # -- evaluation and inference -------------------------------------------------------------

    def forward(self, *inputs: Any, **named_inputs: Any) -> Any:
        """The model's outputs for a global batch of model inputs (no loss targets), as
        ``model(*inputs)`` returns them: a tensor, a tuple, a dict or a Hugging Face
        ``ModelOutput`` of the same structure, whole and the same on every rank.

        The inputs are given whole on every rank, positionally or by keyword (as the model
        takes them), with dim 0 of every tensor the batch, divisible by ``microbatches *
        data_parallel``; other shapes than the example's are fine (each is captured and cut
        on first use, :mod:`.stage_programs`). Only the forward instructions of the schedule run,
        the last stage's outputs of the micro-batches are concatenated along dim 0 and broadcast
        to every rank. In train mode random ops draw from :attr:`random` and the buffers the
        forward writes (BatchNorm's statistics, per micro-batch) are stored, as eager PyTorch
        does; in eval mode nothing changes. A collective: call it on every rank.

        Raises:
            FxparError: inputs given both positionally and by keyword, or none.
            BatchError: tensors whose dim 0 differ or does not divide into the pieces, or (with
                ``check_batches``) ranks given different batches.
            PipelineError: an output whose dim 0 is not the batch's (say a scalar), or a model
                whose eval-mode or forward cut would need state held by another stage.
        """
        call, tensors, metas = call_inputs(
            inputs, named_inputs, check_ranks=self._check_ranks, rank=self.rank
        )
        pieces = self.pipeline.microbatches * self.pipeline.data_parallel
        _batch_size(tensors, pieces)
        key = forward_key(self.training, call, metas)
        step = self._steps.get(key)
        if step is None:
            step = self._cutter.forward_step(self.training, call, pieces)
            self._steps[key] = step
        result = step.forward_worker.run(
            self.parameters, self.buffers, self._microbatches(step, tensors)
        )
        for name in self.buffers:
            self.buffers[name] = result.buffers[name]
        outputs = self._cutter.layout.gather_outputs(step, result.outputs)
        tree = step.split.program.signature.output_tree
        assert tree is not None
        return tree.rebuild(outputs)

    __call__ = forward

    def _training_step(
        self, batch: Sequence[torch.Tensor], named: Mapping[str, torch.Tensor]
    ) -> tuple[StageStep, list[torch.Tensor], Callable[[], None] | None]:
        """The training step in the current mode for this global batch, its tensors in the
        step's order once they bind, and (``check_batches``) the comparison with every rank's
        batch, started here, to finish before the stage's first message. A batch of new
        shapes is captured and cut at the training split points once the ranks agree, over
        the same state (:mod:`.stage_programs`), and kept for the next batch of those shapes."""
        trained = self._cutter.trained.batch
        given = trained.given(batch, named)
        if given is None:  # let the example's signature say what is wrong, on every rank
            trained.take(batch, named, check_ranks=self._check_ranks, rank=self.rank)
            raise AssertionError("take refuses a batch that given refused")  # pragma: no cover
        signature = BatchSignature(trained.names, given)
        checks: list[Callable[[], None]] = []
        tensors = signature.take(
            batch, named, check_ranks=self._check_ranks, rank=self.rank, defer=checks.append
        )
        shapes = None if given == trained.metas else given
        key = ("train", self.training, shapes)
        step = self._steps.get(key)
        if step is None or step.sharded is not None:  # collectives in the forward: agree first
            while checks:
                checks.pop()()
        if step is None:
            _batch_size(tensors, self.pipeline.microbatches * self.pipeline.data_parallel)
            step = self._cutter.training_step(self.training, tensors if shapes else None)
            self._steps[key] = step
        return step, tensors, checks[0] if checks else None

    def _norm_weight(self, name: str) -> float:
        """Every piece of every gradient is counted by exactly one rank: a tied weight by the
        first stage holding it, a stage's gradients by its replica 0, a piece replicated over
        axes of a stage mesh by the device at index 0 of those axes; pieces sharded over an
        axis by each of its devices."""
        return 1.0 if name in self._norm_counted else 0.0

    def _forget_unsynced(self) -> None:
        self._unsynced.clear()

    def _run(
        self, step: StageStep, worker: StageWorker, tensors: Sequence[torch.Tensor], check: Any
    ) -> tuple[StageResult, LossReduction]:
        """Run ``worker`` (one of ``step``'s) on this replica's micro-batches, calling
        ``check`` before its first message, and start the loss's reduction over every rank as
        soon as this rank's losses are done; a refused batch leaves the random state as it
        was."""
        state = self.random.state
        loss = LossReduction(
            counted=self._local_index == self.replica,
            divisor=self._divisor(step),
            dtype=self.split.program.output_metas()[0].dtype,
            distributed=self._distributed and dist.get_world_size() > 1,
            device=self.device,
        )
        try:
            microbatches = self._microbatches(step, tensors)
            result = worker.run(
                self.parameters, self.buffers, microbatches, check=check, losses_done=loss.start
            )
            return result, loss
        except BatchError:
            self.random.state = state
            raise

    @property
    def _check_ranks(self) -> bool:
        return self.check_batches and self._distributed and dist.get_world_size() > 1

    def _reduce_gradients(
        self, step: StageStep, computed: Mapping[str, torch.Tensor], count: int
    ) -> dict[str, torch.Tensor]:
        """This stage's gradient sums reduced to the whole batch's gradients, divided by
        ``count``: converted to the parameters' layouts (a stage plan), summed over the
        stage's replicas and over the holders of tied weights."""
        if step.sharded is not None:  # into the parameters' layouts, once per step
            computed = step.sharded.sync.run(computed)
        sums = {
            name: computed.get(name, torch.zeros_like(self.parameters[name]))
            for name in self._trainable
        }
        if self._stage_group is not None:
            gradients = [sums[name] for name in self._trainable]
            waiting.all_reduce_buckets(gradients, self._stage_group)
        for name, tied in self._tied.items():
            sums[name] = tied(sums[name])
        return {name: value / count for name, value in sums.items()} if count != 1 else sums

    def _counts_in_norm(self, name: str) -> bool:
        """Whether this rank counts its piece of ``name``'s gradient in the global norm: one
        rank of those holding the same piece does."""
        if self.pipeline.stage_of(self.split.holders[name][0]) != self.stage or self.replica:
            return False
        if self.sharded is None:
            return True
        return first_holder(self.sharded.specs[name], self.coordinate)

    def _divisor(self, step: StageStep) -> int:
        pieces = self.pipeline.microbatches * self.pipeline.data_parallel
        return step.split.semantics.divisor(pieces)

    def _as_dtensor(self, name: str, local: torch.Tensor) -> Any:
        if self._device_mesh is None:
            return local
        spec = self.sharded.specs[name] if self.sharded else (Replicate(),)
        return checkpoint.dtensor(local, self._device_mesh, spec, self._shapes[name])

    # -- batches and groups -------------------------------------------------------------------

    def _microbatches(
        self, step: StageStep, batch: Sequence[torch.Tensor]
    ) -> list[dict[str, torch.Tensor]]:
        """This replica's piece of every micro-batch of the (checked) global batch of
        ``step``, with what the units read besides (the whole batch's loss denominator)."""
        names = step.split.program.signature.inputs
        count, replicas = self.pipeline.microbatches, self.pipeline.data_parallel
        size = batch[0].shape[0]
        piece = size // (count * replicas)
        every_piece = [
            {n: t[start : start + piece] for n, t in zip(names, batch, strict=True)}
            for start in range(0, size, piece)
        ]
        # Micro-batch m is pieces m*D .. m*D + D-1, one per replica.
        # Every rank draws every piece's random inputs, so the draws are those of one device.
        pieces = step.split.unit_inputs(every_piece, self.random.draw)[self.replica :: replicas]
        if step.sharded is not None:
            sharded = step.sharded
            pieces = [local_batch(sharded, microbatch) for microbatch in pieces]
        if self.device.type != "cpu":  # only this rank's pieces move to its device
            pieces = [{n: t.to(self.device) for n, t in each.items()} for each in pieces]
        return pieces

    def _stage_spec(self, stage: int, name: str) -> Spec:
        """The layout stage ``stage``'s plan gives parameter or buffer ``name``."""
        assert self._meshes is not None
        return self._state_specs[self._meshes.shapes[stage]][name]

    def _piece(self, name: str) -> Piece:
        """Which piece of a whole parameter or buffer this device holds."""
        if self.sharded is None:
            return Piece()
        sharded = self.sharded
        return Piece(sharded.specs[name], sharded.cluster.mesh_shape, sharded.coordinate)

    def _whole(self, name: str, stage: int, pieces: dict[Coordinate, torch.Tensor]) -> torch.Tensor:
        if self._meshes is None:
            return next(iter(pieces.values()))
        spec = self._stage_spec(stage, name)
        return assemble(pieces, spec, self._meshes.shapes[stage])

    def __repr__(self) -> str:
        notes = len(self.semantics.notes)
        semantics = f"{notes} semantic notes (see .semantics)" if notes else "whole-batch step"
        return (
            f"PipelineModel(rank {self.rank}: stage {self.stage} of "
            f"{self.pipeline.num_stages}, replica {self.replica}; {len(self.parameters)} "
            f"parameters; {self.pipeline}; {semantics})"
        )


def _peer(meshes: StageMeshes | None, stage: int, per_stage: int, local: int) -> int:
    """The rank of the device at this rank's place in ``stage`` (its first, where ``stage``'s
    mesh is another shape: messages then follow routes, see :mod:`.crossings`)."""
    if meshes is None:
        return stage * per_stage + local
    if meshes.uniform:
        return meshes.ranks(stage)[local]
    return meshes.ranks(stage)[0]


def _whole_batch(meta: ir.TensorMeta, batch_size: int) -> ir.TensorMeta:
    """A batch tensor's meta at the whole batch's size, from its meta at one piece's."""
    return ir.TensorMeta((batch_size, *meta.shape[1:]), meta.dtype)


def capture_microbatch(
    model: nn.Module,
    pipeline: Pipeline,
    example_inputs: Sequence[Any] | Mapping[str, Any],
    loss_fn: LossFn | None = None,
    *,
    example_targets: Sequence[torch.Tensor] = (),
    mixed_precision: MixedPrecision | None = None,
    stamp_layers: bool | str = False,
) -> Program:
    """The training step a :class:`PipelineModel` of ``pipeline`` runs: captured at one
    micro-batch's shapes (one replica's piece of it, with ``data_parallel``) of the global
    example batch, and canonicalized. Price stages on it
    (:func:`~fxpar.pipeline.auto.plan_stages` with ``microbatch=True``) and hand it and the
    choice's plans to the PipelineModel (``program=``, ``plans=``) to run what was priced.
    ``stamp_layers``: trace only a few of the model's repeated layers and stamp the others
    (:func:`fxpar.ir.repeat.capture_repeated`; a module path names the container)."""
    _, micro_inputs, micro_targets = _microbatch(pipeline, example_inputs, example_targets)
    return _capture_canonical(
        model, micro_inputs, loss_fn, micro_targets, mixed_precision, stamp_layers
    )


def microbatch_step(
    model: nn.Module,
    pipeline: Pipeline,
    example_inputs: Sequence[Any] | Mapping[str, Any],
    loss_fn: LossFn | None = None,
    *,
    example_targets: Sequence[torch.Tensor] = (),
    mixed_precision: MixedPrecision | None = None,
) -> tuple[Program, list[torch.Tensor]]:
    """:func:`capture_microbatch`'s program and its flat inputs on the first micro-batch of the
    example batch: a step to time beside the whole one (``fxpar.calibrate_ops(...,
    microbatch=...)``), so that calls are priced at a micro-batch's sizes as measured."""
    _, micro_inputs, micro_targets = _microbatch(pipeline, example_inputs, example_targets)
    program = _capture_canonical(model, micro_inputs, loss_fn, micro_targets, mixed_precision)
    return program, program.flat_inputs(model, *batch_tensors(micro_inputs), *micro_targets)


def _microbatch(
    pipeline: Pipeline,
    example_inputs: Sequence[Any] | Mapping[str, Any],
    example_targets: Sequence[torch.Tensor],
) -> tuple[int, Sequence[Any] | Mapping[str, Any], list[torch.Tensor]]:
    """The global batch size and the example cut to one piece: the first micro-batch's share
    of replica 0."""
    pieces = pipeline.microbatches * pipeline.data_parallel
    inputs = batch_tensors(example_inputs)
    batch_size = _batch_size([*inputs, *example_targets], pieces)
    piece = batch_size // pieces
    micro_inputs = with_batch_tensors(example_inputs, [t[:piece] for t in inputs])
    return batch_size, micro_inputs, [t[:piece] for t in example_targets]


def _capture_canonical(
    model: nn.Module,
    micro_inputs: Sequence[Any] | Mapping[str, Any],
    loss_fn: LossFn | None,
    micro_targets: Sequence[torch.Tensor],
    mixed_precision: MixedPrecision | None,
    stamp_layers: bool | str = False,
) -> Program:
    if stamp_layers:
        program = capture_repeated(
            model, micro_inputs, loss_fn, example_targets=micro_targets,
            mixed_precision=mixed_precision,
            layers=stamp_layers if isinstance(stamp_layers, str) else None,
        )  # fmt: skip
    else:
        program = capture(
            model, micro_inputs, loss_fn, example_targets=micro_targets,
            mixed_precision=mixed_precision,
        )  # fmt: skip
    # Means become sums over counts, so the loss's count can be the whole batch's.
    return Canonicalize().run(program)


def _given_plans(
    plans: Mapping[tuple[int, ...], Plan], meshes: StageMeshes, program: Program
) -> dict[tuple[int, ...], Plan]:
    """``plans``, one for each stage mesh shape, checked to be made for those meshes and for
    the shapes of ``program``'s inputs (the micro-batch the pipeline runs)."""
    shapes = tuple(meshes.by_shape())
    if set(plans) != set(shapes):
        raise PipelineError(
            f"plans were given for stage meshes {sorted(plans)}, but the stages run on "
            f"{sorted(shapes)}: give one plan per stage mesh shape"
        )
    expected = _input_shapes(program)
    for shape in shapes:
        plan = plans[shape]
        if plan.cluster.mesh_shape != shape:
            raise PipelineError(
                f"the plan given for stage mesh {shape} was made for a mesh "
                f"{plan.cluster.mesh_shape}"
            )
        found = _input_shapes(plan.program)
        if found != expected:
            raise PipelineError(
                f"the plan given for stage mesh {shape} was made for inputs of shapes {found}, "
                f"but this pipeline's micro-batch has {expected}: plan the program of "
                "capture_microbatch"
            )
    return {shape: plans[shape] for shape in shapes}


def _input_shapes(program: Program) -> dict[str, tuple[Any, ...]]:
    placeholders = program.placeholders()
    return {
        name: tuple(ir.require(placeholders[name], ir.ValueMeta).tensor.shape)
        for name in program.signature.inputs
    }


def _batch_size(tensors: Sequence[torch.Tensor], pieces: int) -> int:
    sizes = {t.shape[0] if t.dim() else None for t in tensors}
    if len(sizes) != 1 or None in sizes:
        raise BatchError(
            f"every batch tensor needs the same size in dimension 0 (the batch dimension) to "
            f"be cut into micro-batches, got sizes {sorted(map(str, sizes))}"
        )
    (size,) = sizes
    assert size is not None
    if size % pieces:
        raise BatchError(
            f"a batch of {size} rows cannot be cut into {pieces} equal pieces (micro-batches x "
            "devices per stage); choose a batch size divisible by it"
        )
    return size
