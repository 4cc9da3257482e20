"""Run a pipeline whose stages run an intra-op plan, every device of every stage, in one
process: the reference that the multi-process runtime and the property tests compare with
single-device training.

Stages may run meshes of different shapes, each under its own plan
(:func:`simulate_stage_meshes`): values then cross each boundary as the runtime sends them, by
the messages of :mod:`fxpar.pipeline.crossings`, here copied between the devices' tensors.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import torch

from fxpar.cluster import Cluster, Coordinate
from fxpar.ir.program import StepResult
from fxpar.pipeline.crossings import Crossing
from fxpar.pipeline.intra_op import ShardedStage, local_batch, neighbour_sides, shard_stage
from fxpar.pipeline.meshes import StageMeshes
from fxpar.pipeline.split import SplitProgram, StageOutputs, Value
from fxpar.sharding import assemble
from fxpar.testing.simulate import SimulatedMesh

R = TypeVar("R")


def simulate_pipeline(
    split: SplitProgram,
    cluster: Cluster,
    state: Mapping[str, torch.Tensor],
    microbatches: Sequence[Sequence[torch.Tensor]],
    *,
    timeout: float = 60.0,
) -> StepResult:
    """One pipelined step of ``split`` (its Program planned for the stage mesh ``cluster``):
    micro-batch after micro-batch, stage after stage, each unit run on every device of its
    stage mesh in threads. Returns the whole loss, gradients (summed or averaged over
    micro-batches as ``split.semantics`` says, in their parameters' layout, reassembled) and
    buffer updates, like :meth:`SplitProgram.run_microbatches`."""
    stages = split.num_stages
    return simulate_stage_meshes(
        [split] * stages, [cluster] * stages, state, microbatches, timeout=timeout
    )


def simulate_stage_meshes(
    splits: Sequence[SplitProgram],
    clusters: Sequence[Cluster],
    state: Mapping[str, torch.Tensor],
    microbatches: Sequence[Sequence[torch.Tensor]],
    *,
    timeout: float = 60.0,
) -> StepResult:
    """:func:`simulate_pipeline` with stage ``s`` on the mesh ``clusters[s]``, running the
    stage of ``splits[s]`` (the step cut at the same points under a plan for that mesh)."""
    pipeline = _SimulatedPipeline(splits, clusters, state, timeout)
    split = splits[0]
    names = split.program.signature.inputs
    pieces = [dict(zip(names, piece, strict=True)) for piece in microbatches]
    for batch in split.unit_inputs(pieces):
        pipeline.microbatch(batch)
    return pipeline.result(split.semantics.divisor(len(microbatches)))


Messages = dict[Coordinate, tuple[torch.Tensor, ...]]


class _SimulatedPipeline:
    def __init__(
        self,
        splits: Sequence[SplitProgram],
        clusters: Sequence[Cluster],
        state: Mapping[str, torch.Tensor],
        timeout: float,
    ) -> None:
        self.splits = list(splits)
        self.split = splits[0]
        self.meshes = StageMeshes(tuple(clusters))
        self.devices = [SimulatedMesh(shape, timeout=timeout) for shape in self.meshes.shapes]
        same = self.meshes.uniform and all(s is self.split for s in splits)
        sides = [
            None if same else neighbour_sides(self.meshes, s, self.splits.__getitem__)
            for s in range(len(splits))
        ]
        self.stages = [
            mesh.run(functools.partial(shard_stage, splits[s], s, clusters[s], sides=sides[s]))
            for s, mesh in enumerate(self.devices)
        ]
        self.parameters = [
            {c: {n: sharded.local(n, state[n]) for n in self.splits[s].stage_parameters(s)}
             for c, sharded in by_device.items()}
            for s, by_device in enumerate(self.stages)
        ]  # fmt: skip
        self.buffers = [
            {c: {n: sharded.local(n, state[n]) for n in sharded.forward.buffers}
             for c, sharded in by_device.items()}
            for by_device in self.stages
        ]  # fmt: skip
        self.sums: list[dict[Coordinate, dict[str, torch.Tensor]]] = [
            {c: {} for c in by_device} for by_device in self.stages
        ]
        self.losses: list[torch.Tensor] = []

    def on_stage(self, stage: int, body: Callable[[ShardedStage], R]) -> dict[Coordinate, R]:
        """``body`` on every device of ``stage``, given that device's share of the stage."""
        return self.devices[stage].run(lambda c, _comm: body(self.stages[stage][c]))

    def _deliver(self, sent: Messages, receiver: int, key: str) -> Messages:
        """What every device of stage ``receiver`` receives on channel ``key`` of the values
        the neighbouring stage's devices ``sent``."""
        stage = self.stages[receiver]
        if not sent or not any(sharded.crossings for sharded in stage.values()):
            return {c: sent.get(c, ()) for c in stage}
        unit = "forward" if key.startswith("forward") else "backward"
        delivered: Messages = {}
        for c, sharded in stage.items():
            rank = self.meshes.rank(receiver, c)
            values: tuple[Value, ...] = getattr(sharded, unit).received
            crossings: tuple[Crossing, ...] = sharded.crossings[key]
            tensors = []
            for index, (value, found) in enumerate(zip(values, crossings, strict=True)):
                # NaN where no message wrote (an integer tensor cannot show that: zeros).
                blank = float("nan") if value.meta.dtype.is_floating_point else 0
                shape = [int(n) for n in value.meta.shape]
                buffer = torch.full(shape, blank, dtype=value.meta.dtype)
                for transfer in found.receives_at(rank):
                    source = self.meshes.coordinate(transfer.source)
                    buffer[transfer.target_box] = sent[source][index][transfer.source_box]
                tensors.append(buffer)
            delivered[c] = tuple(tensors)
        return delivered

    def microbatch(self, batch: dict[str, torch.Tensor]) -> None:
        messages: Messages = {}
        stash = []
        for s in range(self.split.num_stages):
            received = self._deliver(messages, s, "forward_received")
            outputs = self.on_stage(s, functools.partial(self._forward, s, batch, received))
            messages = {c: out.sent for c, out in outputs.items()}
            stash.append({c: out.stashed for c, out in outputs.items()})
            for c, out in outputs.items():
                self.buffers[s][c].update(out.buffer_updates)
            loss = next(iter(outputs.values())).loss  # replicated over the stage mesh
            if loss is not None:
                self.losses.append(loss)
        messages = {}
        for s in reversed(range(self.split.num_stages)):
            received = self._deliver(messages, s, "backward_received")
            outputs = self.on_stage(
                s, functools.partial(self._backward, s, batch, received, stash[s])
            )
            messages = {c: out.sent for c, out in outputs.items()}
            for c, out in outputs.items():
                for name, gradient in out.gradients.items():
                    total = self.sums[s][c].get(name)
                    self.sums[s][c][name] = gradient if total is None else total + gradient

    def _forward(
        self, s: int, batch: dict[str, torch.Tensor], received: Messages, sharded: ShardedStage
    ) -> StageOutputs:
        c = sharded.coordinate
        return sharded.forward.run(
            self.parameters[s][c], self.buffers[s][c], local_batch(sharded, batch), received[c]
        )

    def _backward(
        self,
        s: int,
        batch: dict[str, torch.Tensor],
        received: Messages,
        stash: Messages,
        sharded: ShardedStage,
    ) -> StageOutputs:
        c = sharded.coordinate
        return sharded.backward.run(
            self.parameters[s][c], {}, local_batch(sharded, batch), received[c], stash[c]
        )

    def result(self, count: int) -> StepResult:
        """Gradients into their parameters' layouts (each stage's sync) and reassembled, the
        partial gradients of tied weights summed over their stages, the loss and gradients
        divided by ``count``."""
        gradients: dict[str, torch.Tensor] = {}
        for s, sums in enumerate(self.sums):
            synced = self.on_stage(s, functools.partial(_sync, sums))
            specs = next(iter(self.stages[s].values())).specs
            for name in next(iter(synced.values())):
                pieces = {c: named[name] for c, named in synced.items()}
                whole = assemble(pieces, specs[name], self.meshes.shapes[s])
                gradients[name] = gradients[name] + whole if name in gradients else whole
        updated = {}
        for s, buffers in enumerate(self.buffers):
            specs = next(iter(self.stages[s].values())).specs
            for name in self.splits[s].forward[s].buffer_updates:
                pieces = {c: b[name] for c, b in buffers.items()}
                updated[name] = assemble(pieces, specs[name], self.meshes.shapes[s])
        signature = self.split.program.signature
        return StepResult(
            loss=torch.stack(self.losses).sum() / count,
            gradients={name: gradients[name] / count for name in signature.gradients},
            buffers={name: updated[name] for name in signature.buffer_updates},
        )


def _sync(
    sums: dict[Coordinate, dict[str, torch.Tensor]], sharded: ShardedStage
) -> dict[str, torch.Tensor]:
    return sharded.sync.run(sums[sharded.coordinate])
