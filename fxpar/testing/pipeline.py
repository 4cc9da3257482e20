"""Run a pipeline whose stages run an intra-op plan, every device of every stage, in one
process: the reference that the multi-process runtime and the property tests compare with
single-device training."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import torch

from fxpar.cluster import Cluster, Coordinate
from fxpar.ir.program import StepResult
from fxpar.pipeline.sharded import ShardedStage, local_batch, shard_stage
from fxpar.pipeline.split import SplitProgram, StageOutputs
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
    pipeline = _SimulatedPipeline(split, cluster, state, timeout)
    names = split.program.signature.inputs
    pieces = [dict(zip(names, piece, strict=True)) for piece in microbatches]
    for batch in split.unit_inputs(pieces):
        pipeline.microbatch(batch)
    return pipeline.result(split.semantics.divisor(len(microbatches)))


Messages = dict[Coordinate, tuple[torch.Tensor, ...]]


class _SimulatedPipeline:
    def __init__(
        self,
        split: SplitProgram,
        cluster: Cluster,
        state: Mapping[str, torch.Tensor],
        timeout: float,
    ) -> None:
        self.split = split
        self.mesh = cluster.mesh_shape
        self.meshes = [SimulatedMesh(self.mesh, timeout=timeout) for _ in range(split.num_stages)]
        self.stages = [
            mesh.run(functools.partial(shard_stage, split, s, cluster))
            for s, mesh in enumerate(self.meshes)
        ]
        self.devices = list(self.stages[0])
        self.parameters = [
            {c: {n: sharded.local(n, state[n]) for n in split.stage_parameters(s)}
             for c, sharded in by_device.items()}
            for s, by_device in enumerate(self.stages)
        ]  # fmt: skip
        self.buffers = [
            {c: {n: sharded.local(n, state[n]) for n in sharded.forward.buffers}
             for c, sharded in by_device.items()}
            for by_device in self.stages
        ]  # fmt: skip
        self.sums: list[dict[Coordinate, dict[str, torch.Tensor]]] = [
            {c: {} for c in self.devices} for _ in self.stages
        ]
        self.losses: list[torch.Tensor] = []

    def on_stage(self, stage: int, body: Callable[[ShardedStage], R]) -> dict[Coordinate, R]:
        """``body`` on every device of ``stage``, given that device's share of the stage."""
        return self.meshes[stage].run(lambda c, _comm: body(self.stages[stage][c]))

    def microbatch(self, batch: dict[str, torch.Tensor]) -> None:
        messages: Messages = dict.fromkeys(self.devices, ())
        stash = []
        for s in range(self.split.num_stages):
            outputs = self.on_stage(s, functools.partial(self._forward, s, batch, messages))
            messages = {c: out.sent for c, out in outputs.items()}
            stash.append({c: out.stashed for c, out in outputs.items()})
            for c, out in outputs.items():
                self.buffers[s][c].update(out.buffer_updates)
            loss = outputs[self.devices[0]].loss  # replicated over the stage mesh
            if loss is not None:
                self.losses.append(loss)
        messages = dict.fromkeys(self.devices, ())
        for s in reversed(range(self.split.num_stages)):
            outputs = self.on_stage(
                s, functools.partial(self._backward, s, batch, messages, stash[s])
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
        """Gradients into their parameters' layouts (each stage's sync), the partial
        gradients of tied weights summed, everything reassembled, the loss and gradients
        divided by ``count``."""
        gradients: dict[str, dict[Coordinate, torch.Tensor]] = {}
        for s, sums in enumerate(self.sums):
            synced = self.on_stage(s, functools.partial(_sync, sums))
            for c, named in synced.items():
                for name, local in named.items():
                    held = gradients.setdefault(name, {})
                    held[c] = held[c] + local if c in held else local
        specs = self.stages[0][self.devices[0]].specs
        updated = {}
        for s, buffers in enumerate(self.buffers):
            for name in self.split.forward[s].buffer_updates:
                pieces = {c: b[name] for c, b in buffers.items()}
                updated[name] = assemble(pieces, specs[name], self.mesh)
        signature = self.split.program.signature
        return StepResult(
            loss=torch.stack(self.losses).sum() / count,
            gradients={
                name: assemble(gradients[name], specs[name], self.mesh) / count
                for name in signature.gradients
            },
            buffers={name: updated[name] for name in signature.buffer_updates},
        )


def _sync(
    sums: dict[Coordinate, dict[str, torch.Tensor]], sharded: ShardedStage
) -> dict[str, torch.Tensor]:
    return sharded.sync.run(sums[sharded.coordinate])
