"""The stage programs a :class:`~fxpar.pipeline.PipelineModel` runs, one per kind of call and
train/eval mode, as the driver (:mod:`fxpar.driver`) keeps a ParallelModel's.

A PipelineModel is built for the training step, captured in the mode the model was in. Asked
for the step in the other mode (``eval()`` then ``step``, ``backward`` or ``loss``), on a batch
of other shapes (a short last batch, another sequence length), or for the model's forward
alone (``pipelined(*inputs)``), it needs other programs. Each is made the first
time it is asked for, the way the training step was, and kept::

    capture at one piece's size, in the mode asked for -> Canonicalize
      -> plan on the stage mesh (with one), every parameter and buffer pinned to its spec
      -> partition at the training split's points -> split_program -> lower this rank's stage

The state never moves between programs: each rank keeps the parameters and buffers its stage
holds in the training split, in the layout the training plan gave them, and every program
reads those. Cutting at the same split points (module names, where the forward's nodes are
placed by position, see :mod:`.partition`) puts each layer in the same stage in both modes, but
that is checked before a cut is used (:func:`check_state`), not assumed:

- every parameter and buffer a unit of stage ``s`` reads or writes, and every parameter it
  returns a gradient for, is one that stage ``s`` holds in the training split. Asking for the
  very same names would refuse sound cuts: in eval mode BatchNorm reads no
  ``num_batches_tracked``, so no stage of an eval cut reads it, and a parameter only the loss
  reads is read by no forward;
- under a stage plan, every parameter and buffer keeps its spec. A :class:`PassPlanner` (what
  :func:`fxpar.compile` and the default give) pins them for the solver; another planner (a
  manual plan, say) must happen to agree.

Either failing raises a :class:`~fxpar.pipeline.PipelineError` naming the tensors and stages,
instead of running a program on state that is not there.

**The outputs of a forward.** The last stage's forward returns the model's output tensors for
each micro-batch (:mod:`.split`); :meth:`StageLayout.gather_outputs` stacks them in piece order
and broadcasts them from the last stage, so every rank returns the whole batch's outputs. That
concatenation along dim 0 is the whole batch's output only where dim 0 is the batch's, so the
forward is captured at the whole batch's size too (fake tensors: no compute), and an output
whose shape there is not its piece's with dim 0 times the number of pieces is refused.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from fxpar import ir
from fxpar.cluster import Cluster, Coordinate
from fxpar.errors import LoweringError
from fxpar.ir.capture import LossFn, batch_tensors, capture, model_in_mode, with_batch_tensors
from fxpar.ir.placement import place
from fxpar.ir.precision import MixedPrecision
from fxpar.ir.program import Program
from fxpar.lowering import value_spec
from fxpar.lowering.collective_calls import Communicator
from fxpar.passes import (
    PassManager,
    keeping_state,
    plan_program,
    plans_folded,
    replaying,
    sharing_gradients,
)
from fxpar.passes.canonicalize import Canonicalize
from fxpar.pipeline.crossings import Crossing, StageSide
from fxpar.pipeline.executor import StageWorker
from fxpar.pipeline.intra_op import GradientSync, ShardedStage, neighbour_sides, shard_stage
from fxpar.pipeline.meshes import Shape, StageMeshes, plan_each
from fxpar.pipeline.options import Pipeline, PipelineError
from fxpar.pipeline.partition import partition
from fxpar.pipeline.schedule import StageSchedule, forward_only, simulate
from fxpar.pipeline.split import SplitProgram, StageProgram, split_program
from fxpar.planning.plan import Plan
from fxpar.runtime.batches import BatchSignature
from fxpar.runtime.devices import for_collective
from fxpar.runtime.lowered import CallInputs
from fxpar.sharding import Spec

logger = logging.getLogger(__name__)

PipelineKind = Literal["train", "forward"]
"""What a stage program computes: the training step (whose forward half is the loss), or the
model's forward alone."""


@dataclass(frozen=True)
class PassPlanner:
    """A stage planner that runs a pass list (:func:`~fxpar.passes.plan_program`):
    what :func:`fxpar.compile` gives a pipeline, and the default. Unlike any callable, it can
    plan a later program with every parameter and buffer pinned to its spec."""

    passes: PassManager

    def __call__(self, program: Program, cluster: Cluster) -> Plan:
        return plan_program(program, cluster, passes=self.passes)

    def keeping(self, state: Mapping[str, Spec], *, solve: bool) -> PassPlanner:
        """This planner with ``state``'s specs pinned (see
        :func:`~fxpar.passes.keeping_state`; ``solve``: the solver in place of a manual
        choice)."""
        return PassPlanner(keeping_state(self.passes, state, solve=solve))

    def plans_folded(self) -> bool:
        """Whether this planner plans a stamped step and its folded twin alike
        (:func:`~fxpar.passes.plans_folded`)."""
        return plans_folded(self.passes)

    def replaying(self, plan: Plan) -> PassPlanner:
        """This planner answering with ``plan``'s choice (:func:`~fxpar.passes.replaying`): to
        plan a stamped step as its folded twin was planned."""
        return PassPlanner(replaying(self.passes, plan))

    def per_microbatch(self, microbatches: int) -> PassPlanner:
        """This planner for one of ``microbatches`` micro-batches of a step: its solver
        prices each gradient's synchronisation at ``1/microbatches``, since a pipeline's stage
        sums its micro-batches' gradients and synchronises them once a step
        (:func:`~fxpar.passes.sharing_gradients`)."""
        return PassPlanner(sharing_gradients(self.passes, 1 / microbatches))


@dataclass(frozen=True)
class StageStep:
    """One program cut into stages, and this rank's share of it."""

    kind: PipelineKind
    training: bool
    split: SplitProgram
    """The stages' programs, the same on every rank."""
    sharded: ShardedStage | None
    """This stage lowered to this device of the stage mesh (with one). Under ZB-V, whose
    stage runs two chunks: the first chunk's, with the gradient sync of both
    (:class:`ChunkSyncs`)."""
    worker: StageWorker
    """Runs the schedule's instruction list (a forward program has empty backwards)."""
    forward_worker: StageWorker
    """Runs its forward half only (:func:`.schedule.forward_only`)."""
    batch: BatchSignature
    """The whole batch it takes."""
    splits: Mapping[Shape, SplitProgram] = dataclasses.field(default_factory=dict)
    """The program cut under the plan of each stage mesh shape (with stage meshes)."""


@dataclass(frozen=True)
class StageLayout:
    """Where this rank sits in the pipeline, and what it needs to run any cut program."""

    pipeline: Pipeline
    schedule: tuple[StageSchedule, ...]
    stage: int
    rank: int
    per_stage: int
    """Devices per stage: data-parallel replicas, or the first stage mesh's size."""
    previous_rank: int | None
    next_rank: int | None
    """The same replica's ranks in the stages before and after (wrapping around, from the
    last stage to the first, with the interleaved schedule's several chunks per stage; ZB-V's
    turn back at the last stage)."""
    meshes: StageMeshes | None
    """Every stage's mesh (with an intra-op plan inside the stages)."""
    coordinate: Coordinate
    communicator: Communicator
    distributed: bool
    device: torch.device = dataclasses.field(default_factory=lambda: torch.device("cpu"))
    """Where this rank's state is and its programs run (placed there by :meth:`assemble`)."""

    @property
    def stage_cluster(self) -> Cluster | None:
        """This stage's mesh."""
        return None if self.meshes is None else self.meshes.clusters[self.stage]

    def assemble(
        self,
        splits: Mapping[Shape, SplitProgram],
        kind: PipelineKind,
        training: bool,
        batch: BatchSignature,
    ) -> StageStep:
        """This rank's share of a program cut into stages: its stage lowered to this device
        (with stage meshes, under the plan of this stage's mesh shape in ``splits``; else
        ``splits[()]``), and the workers running the schedule's list and its forward half."""
        cluster = self.stage_cluster
        split = splits[cluster.mesh_shape if cluster else ()]
        chunks = self.pipeline.chunks_of(self.stage)
        forward = [split.forward[chunk] for chunk in chunks]
        backward = [split.backward[chunk] for chunk in chunks]
        sharded = None
        keys: tuple[Mapping[str, str], ...] = ()
        if cluster is not None:  # one chunk per stage, or ZB-V's two on uniform meshes
            sides = self._sides(splits)
            lowered = [
                self._placed_stage(
                    shard_stage(split, chunk, cluster, self.coordinate, self.communicator, sides)
                )
                for chunk in chunks
            ]
            sharded, keys = _joined(lowered)
            forward = [each.forward for each in lowered]
            backward = [each.backward for each in lowered]
        elif self.device.type != "cpu":
            forward = [self._placed(each) for each in forward]
            backward = [self._placed(each) for each in backward]
        crossings = sharded.crossings if sharded is not None else None
        worker = self._worker(forward, backward, self.schedule[self.stage], crossings, keys)
        # The forwards alone, which cannot deadlock either.
        forward_lists = [forward_only(instructions) for instructions in self.schedule]
        simulate(forward_lists, self.pipeline.named_schedule.placement)
        forward_worker = self._worker(forward, backward, forward_lists[self.stage], crossings)
        return StageStep(kind, training, split, sharded, worker, forward_worker, batch, splits)

    def _placed_stage(self, sharded: ShardedStage) -> ShardedStage:
        """``sharded``'s units and gradient sync running on :attr:`device`."""
        if self.device.type == "cpu":
            return sharded
        sync = sharded.sync
        return dataclasses.replace(
            sharded,
            forward=self._placed(sharded.forward),
            backward=self._placed(sharded.backward),
            sync=dataclasses.replace(sync, graph_module=place(sync.graph_module, self.device)),
        )

    def _placed(self, program: StageProgram) -> StageProgram:
        """``program`` running on :attr:`device` (:func:`fxpar.ir.placement.place`; they
        are traced on the CPU)."""
        return dataclasses.replace(program, graph_module=place(program.graph_module, self.device))

    def _sides(self, splits: Mapping[Shape, SplitProgram]) -> dict[int, StageSide] | None:
        """This stage and its neighbours, where some stage runs another mesh."""
        meshes = self.meshes
        if meshes is None or meshes.uniform:
            return None
        return neighbour_sides(meshes, self.stage, lambda stage: splits[meshes.shapes[stage]])

    def _worker(
        self,
        forward: Sequence[StageProgram],
        backward: Sequence[StageProgram],
        instructions: StageSchedule,
        crossings: Mapping[str, Sequence[Crossing]] | None,
        gradient_keys: Sequence[Mapping[str, str]] = (),
    ) -> StageWorker:
        return StageWorker(
            forward, backward, instructions,
            rank=self.rank, previous_rank=self.previous_rank, next_rank=self.next_rank,
            num_stages=self.pipeline.num_stages, crossings=crossings, device=self.device,
            placement=self.pipeline.named_schedule.placement, gradient_keys=gradient_keys,
        )  # fmt: skip

    def gather_outputs(
        self, step: StageStep, outputs: Mapping[int, tuple[torch.Tensor, ...]]
    ) -> list[torch.Tensor]:
        """The whole batch's output tensors on every rank, from the last stage's outputs by
        micro-batch (``outputs``, empty elsewhere): piece ``m * D + d`` (micro-batch ``m``,
        replica ``d``) is broadcast from replica ``d`` of the last stage, or from its stage
        mesh's first device, where every device holds it whole. A collective."""
        microbatches, replicas = self.pipeline.microbatches, self.pipeline.data_parallel
        # The stage of the model's last chunk: stage 0 in ZB-V's V.
        last = self.pipeline.stage_of(self.pipeline.num_chunks - 1) * self.per_stage
        if self.meshes is not None:
            last = self.meshes.ranks(self.pipeline.stage_of(self.pipeline.num_chunks - 1))[0]
        world = dist.get_world_size() if self.distributed else 1
        results = []
        for index, value in enumerate(step.split.forward[-1].outputs):
            shape = [int(size) for size in value.meta.shape]
            columns = []
            for replica in range(replicas):
                if self.rank == last + replica:
                    stacked = torch.stack([outputs[m][index] for m in range(microbatches)])
                else:
                    stacked = torch.empty(
                        (microbatches, *shape), dtype=value.meta.dtype, device=self.device
                    )
                if world > 1:
                    stacked = for_collective(stacked)
                    # gloo broadcasts no bool: the same bytes as uint8.
                    wire = stacked.view(torch.uint8) if stacked.dtype == torch.bool else stacked
                    dist.broadcast(wire, src=last + replica)
                columns.append(stacked.to(self.device))
            whole = torch.stack(columns, dim=1)  # (micro-batch, replica, rows of a piece, ...)
            # One piece is the whole batch, whatever its outputs' shapes (a scalar, say).
            one_piece = microbatches * replicas == 1
            results.append(whole.reshape(shape) if one_piece else whole.flatten(0, 2))
        return results


@dataclass(frozen=True)
class StageCutter:
    """How a PipelineModel makes the programs it runs besides the training step it was built
    for (see the module docstring). It keeps a reference to ``model`` to capture it again in
    either mode (its weights are not read) and the example at one piece's size."""

    model: nn.Module
    loss_fn: LossFn | None
    example_inputs: Sequence[Any] | Mapping[str, Any]
    """At one piece's size."""
    example_targets: Sequence[torch.Tensor]
    split_points: tuple[str, ...]
    remat: bool
    planner: Callable[[Program, Cluster], Plan]
    """Plans for the stage mesh (with one); a :class:`PassPlanner` can pin the state."""
    layout: StageLayout
    trained: StageStep
    """The training step the pipeline was built for: where the state is, and its layout."""
    mixed_precision: MixedPrecision | None = None

    def training_step(
        self, training: bool, batch: Sequence[torch.Tensor] | None = None
    ) -> StageStep:
        """The training step traced in train or eval mode, on the example's shapes or on those
        of ``batch`` (a whole global batch: model inputs then loss targets, dim 0 of every
        tensor cut into micro-batches x replicas equal pieces)."""
        inputs, targets, whole = self.example_inputs, self.example_targets, self.trained.batch
        if batch is not None:
            pieces = self.layout.pipeline.microbatches * self.layout.pipeline.data_parallel
            rows = [tensor[: tensor.shape[0] // pieces] for tensor in batch]
            count = len(batch_tensors(self.example_inputs))
            inputs = with_batch_tensors(self.example_inputs, rows[:count])
            targets = rows[count:]
            whole = BatchSignature(whole.names, tuple(ir.TensorMeta.of(t) for t in batch))
        program = self._capture(training, inputs, targets, step="train")
        return self._cut(program, "train", training, whole)

    def forward_step(self, training: bool, call: CallInputs, pieces: int) -> StageStep:
        """The model's forward on the whole batch ``call`` (model inputs only, dim 0 of every
        tensor cut into ``pieces`` equal pieces), traced in train or eval mode.

        Raises:
            PipelineError: an output whose dim 0 is not the batch's (see the module docstring).
        """
        tensors = batch_tensors(call)
        rows = tensors[0].shape[0] // pieces
        piece = with_batch_tensors(call, [tensor[:rows] for tensor in tensors])
        program = self._capture(training, piece, (), step="forward")
        if pieces > 1:
            whole = self._capture(training, call, (), step="forward")
            _check_batch_rows(program, whole, pieces)
        metas = tuple(ir.TensorMeta.of(tensor) for tensor in tensors)
        batch = BatchSignature(program.signature.inputs, metas)
        return self._cut(program, "forward", training, batch)

    def _capture(
        self,
        training: bool,
        inputs: Sequence[Any] | Mapping[str, Any],
        targets: Sequence[torch.Tensor],
        *,
        step: PipelineKind,
    ) -> Program:
        loss_fn = self.loss_fn if step == "train" else None
        with model_in_mode(self.model, training):
            program = capture(
                self.model, inputs, loss_fn, example_targets=targets, step=step,
                mixed_precision=self.mixed_precision,
            )  # fmt: skip
        # As the training step was: means become sums over counts.
        return Canonicalize().run(program)

    def _cut(
        self, program: Program, kind: PipelineKind, training: bool, batch: BatchSignature
    ) -> StageStep:
        what = _describe(kind, training)
        programs: dict[Shape, Program] = {(): program}
        if self.layout.meshes is not None:  # one plan per stage mesh shape
            plan = functools.partial(self._plan, kind=kind, what=what)
            programs = plan_each(program, self.layout.meshes, plan)
        splits: dict[Shape, SplitProgram] = {}
        for shape, planned in programs.items():
            try:
                cut = partition(planned, self.split_points)
            except PipelineError as error:
                raise PipelineError(
                    f"{what} cannot be cut at the training split points {self.split_points}: "
                    f"{error}"
                ) from error
            splits[shape] = split_program(planned, cut, remat=self.remat)
            check_state(splits[shape], self.trained.split, what)
        check_same_cut(splits)
        logger.debug("built %s, cut at %s", what, self.split_points)
        return self.layout.assemble(splits, kind, training, batch)

    def _plan(
        self, program: Program, cluster: Cluster, *, kind: PipelineKind, what: str
    ) -> Program:
        """``program`` planned for the stage mesh ``cluster`` with the state kept in the
        layout the training plan for that mesh gave it."""
        trained = self.trained.splits[cluster.mesh_shape].program.placeholders()
        signature = program.signature
        kept = {
            name: value_spec(trained[name]) for name in signature.parameters + signature.buffers
        }
        planner = self.planner
        if isinstance(planner, PassPlanner):
            # A manual plan is written for the training step, not for a forward.
            planner = planner.keeping(kept, solve=kind == "forward")
        planned = planner(program, cluster).program
        placeholders = planned.placeholders()
        moved = []
        for name, spec in kept.items():
            try:
                found: Spec | None = value_spec(placeholders[name])
            except LoweringError:
                found = None
            if found != spec:
                moved.append(f"{name} ({found} instead of {spec})")
        if moved:
            raise PipelineError(
                f"the plan for {what} lays out {', '.join(moved[:3])} differently from the "
                "training plan, and parameters and buffers do not move between programs: "
                "plan with a solver, which pins their layouts (fxpar.compile's solver=, or "
                "PipelineModel(planner=fxpar.pipeline.PassPlanner(passes))), rather than a "
                "planner that cannot be pinned"
            )
        return planned


@dataclass(frozen=True)
class ChunkSyncs(GradientSync):
    """The gradient syncs of a stage's chunks on one stage mesh, run as one: each converts
    the sums of its chunk (read under that chunk's keys, see :func:`_joined`) to the
    parameters' layouts, and a weight two chunks share adds its two converted sums. Its own
    ``graph_module`` is the first chunk's, for show; :meth:`run` runs every part's."""

    parts: tuple[tuple[GradientSync, Mapping[str, str]], ...] = ()
    """Each chunk's sync, and the key its sums of a shared weight's gradient are kept under."""

    def run(self, sums: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        total: dict[str, torch.Tensor] = {}
        for sync, keys in self.parts:
            converted = sync.run({name: sums[keys.get(name, name)] for name in sync.gradients})
            for name, value in converted.items():
                total[name] = total[name] + value if name in total else value
        return total


def _joined(
    lowered: Sequence[ShardedStage],
) -> tuple[ShardedStage, tuple[Mapping[str, str], ...]]:
    """A stage's chunks lowered to one device, as one :class:`ShardedStage` (the first
    chunk's, with every chunk's collectives and :class:`ChunkSyncs`), and for each chunk the
    key its gradient sum of each weight is kept under. Two chunks may each compute a gradient
    of one weight (ZB-V's first stage: a tied embedding and head) laid out each its own way,
    so the later chunk's is summed apart and converted by its own sync before they are added.
    """
    first, *others = lowered
    if not others:
        return first, ()
    seen: set[str] = set()
    keys: list[Mapping[str, str]] = []
    for each in lowered:  # ``each.stage``: the chunk's virtual stage
        gradients = each.backward.gradients
        keys.append({n: f"{n} (virtual stage {each.stage})" for n in gradients if n in seen})
        seen.update(gradients)
    syncs = [each.sync for each in lowered]
    joined = ChunkSyncs(
        gradients=tuple(dict.fromkeys(n for sync in syncs for n in sync.gradients)),
        graph_module=first.sync.graph_module,
        records=tuple(record for sync in syncs for record in sync.records),
        communicator=first.sync.communicator,
        grows=any(sync.grows for sync in syncs),
        parts=tuple(zip(syncs, keys, strict=True)),
    )
    stage = dataclasses.replace(
        first,
        sync=joined,
        forward_collectives=tuple(r for each in lowered for r in each.forward_collectives),
        backward_collectives=tuple(r for each in lowered for r in each.backward_collectives),
    )
    return stage, tuple(keys)


def check_same_cut(splits: Mapping[Shape, SplitProgram]) -> None:
    """Refuse cuts of one program, planned for different stage meshes, whose stages exchange
    different values: each side of a boundary must agree on what crosses it.

    Raises:
        PipelineError: two plans changed the graph differently.
    """

    def channels(split: SplitProgram) -> list[tuple[str, ...]]:
        units = (*split.forward, *split.backward)
        return [tuple(v.name for v in (*u.received, *u.sent)) for u in units]

    first, *others = splits.items()
    for shape, split in others:
        if channels(split) != channels(first[1]):
            raise PipelineError(
                f"the plans for stage meshes {first[0]} and {shape} cut the step into stages "
                "that exchange different values (a planning pass rewrote the graph "
                "differently for the two meshes); the stages cannot be joined"
            )


def check_state(split: SplitProgram, trained: SplitProgram, what: str) -> None:
    """Refuse a cut of another program unless each of its stages reads, writes and returns
    gradients of only parameters and buffers that stage holds in the ``trained`` split (see
    the module docstring).

    Raises:
        PipelineError: a stage would need a tensor the training split keeps elsewhere.
    """
    if split.num_stages != trained.num_stages:
        raise PipelineError(
            f"{what} has {split.num_stages} stages, the training split {trained.num_stages}"
        )
    held = [
        {*trained.stage_parameters(stage), *trained.stage_buffers(stage)}
        for stage in range(trained.num_stages)
    ]
    for stage in range(split.num_stages):
        needed: dict[str, None] = {}
        for unit in (split.forward[stage], split.backward[stage]):
            for name in (*unit.parameters, *unit.buffers, *unit.buffer_updates, *unit.gradients):
                needed[name] = None
        missing = [name for name in needed if name not in held[stage]]
        if missing:
            homes = {
                name: [s for s, names in enumerate(held) if name in names] for name in missing[:3]
            }
            raise PipelineError(
                f"{what}, cut at the training split points {trained.partition.split_points}, "
                f"needs {missing[:3]} on stage {stage}, but the training split keeps them on "
                f"stages {homes}. Parameters and buffers stay where the training split put "
                "them, so this program cannot run on this pipeline: the model runs those "
                "modules in another order in this mode. Choose split points "
                "(Pipeline(stages=(...))) at modules that run in the same order in train and "
                "eval mode"
            )


def _describe(kind: PipelineKind, training: bool) -> str:
    mode = "train" if training else "eval"
    return f"the {'training step' if kind == 'train' else 'forward'} in {mode} mode"


def _check_batch_rows(piece: Program, whole: Program, pieces: int) -> None:
    """Refuse outputs whose dim 0 does not grow with the batch as the pieces' rows add up."""
    piece_metas, whole_metas = piece.output_metas(), whole.output_metas()
    if len(piece_metas) != len(whole_metas):
        raise PipelineError(
            f"the model returns {len(whole_metas)} tensors for the whole batch but "
            f"{len(piece_metas)} for a micro-batch: a pipeline cannot make the former from "
            "the latter"
        )
    for index, (small, large) in enumerate(zip(piece_metas, whole_metas, strict=True)):
        shape = tuple(int(size) for size in small.shape)
        expected = (shape[0] * pieces, *shape[1:]) if shape else None
        if tuple(int(size) for size in large.shape) != expected:
            raise PipelineError(
                f"output {index} of the model has shape {tuple(large.shape)} for the whole "
                f"batch and {shape} for one of its {pieces} pieces: its dim 0 is not the "
                "batch's, so the pipeline cannot assemble it from the micro-batches' outputs "
                "(it concatenates them along dim 0). Return per-sample outputs with the batch "
                "first, or run the forward with fxpar.compile without a pipeline"
            )


__all__ = [
    "ChunkSyncs",
    "PassPlanner",
    "PipelineKind",
    "StageCutter",
    "StageLayout",
    "StageStep",
    "check_same_cut",
    "check_state",
]
