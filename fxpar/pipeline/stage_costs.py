"""Stage costs: the time and memory of a range of atoms on ``d`` devices, for the stage DP.

Every node's seconds and every value's bytes come from the cost and memory model
(:mod:`fxpar.planning.cost`): :func:`~fxpar.planning.cost.node_seconds` is the roofline the
intra-op problem charges, and the activations a range keeps are
:func:`~fxpar.planning.cost.saved_for_backward` of its nodes, the rule the intra-op problem and
the plan report count.

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
bandwidth)`` (:func:`~fxpar.planning.cost.node_seconds`), summed over the range's forward or
backward nodes; ``G`` the bytes of trainable parameters the range reads (each holder of a tied
weight counts it), ``S`` of its buffers and frozen parameters; ``A_saved`` the bytes of the forward
values (batch tensors included, views counted once at their base, parameters not at all) the range's
backward reads; ``A_batch`` the batch tensors it reads; ``B_fwd(c)`` and ``B_back(c)`` the bytes of
the values crossing the boundary before atom ``c`` forwards and backwards. ``allreduce`` is
:func:`fxpar.planning.cost.collective_seconds` (``alpha + 2 (d-1)/d G / beta``) on the innermost
mesh axis that holds ``d`` consecutive ranks (a stage's replicas are consecutive ranks); sends use
the slowest axis, which some pair of neighbouring stages may cross. The gradient reduction is
charged ``1/M`` of it per micro-batch, so it enters the step time once per step for the slowest
stage. Costs are cached per (atom range, d).

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch.fx as fx

from fxpar import ir
from fxpar.cluster import Cluster
from fxpar.ir.program import Program
from fxpar.pipeline.atoms import Atoms, crossings, output_bytes, region
from fxpar.pipeline.options import Pipeline, PipelineError
from fxpar.planning.cost import (
    collective_seconds,
    node_seconds,
    saved_for_backward,
    value_bytes,
)
from fxpar.planning.report import walk
from fxpar.solvers.stages import StageCost

if TYPE_CHECKING:
    from fxpar.planning.plan import Plan

StagePlanner = Callable[[Program, Cluster], "Plan"]
"""Plans a captured step on a stage mesh, e.g. ``fxpar.planning.plan.plan_program``."""


@dataclass(frozen=True)
class RangeFacts:
    """What a range of atoms holds, priced per node and per value: ``T_fwd``, ``T_bwd``, ``G``,
    ``S``, ``A_saved`` and ``A_batch`` of the module docstring."""

    forward_seconds: float
    backward_seconds: float
    trainable_bytes: int
    frozen_bytes: int
    saved_bytes: int
    batch_bytes: int

    @property
    def seconds(self) -> float:
        return self.forward_seconds + self.backward_seconds


class StageCostModel:
    """Stage costs of atom ranges, cached per range and per (range, devices)."""

    def __init__(
        self, atoms: Atoms, cluster: Cluster, pipeline: Pipeline, optimizer_states: int
    ) -> None:
        if optimizer_states < 0:
            raise PipelineError(f"optimizer_states must be >= 0, got {optimizer_states}")
        self.atoms = atoms
        self.cluster = cluster
        self.pipeline = pipeline
        self.optimizer_states = optimizer_states
        self.phases = {node: region(node).phase for node in atoms.atom_of}
        self._ranges: dict[tuple[int, int], RangeFacts] = {}
        self._costs: dict[tuple[int, int, int], StageCost] = {}

    def facts(self, start: int, stop: int) -> RangeFacts:
        key = (start, stop)
        if key not in self._ranges:
            self._ranges[key] = self._measure(start, stop)
        return self._ranges[key]

    def _measure(self, start: int, stop: int) -> RangeFacts:
        return self._facts(start, stop, lambda node: node_seconds(node, self.cluster), output_bytes)

    def _facts(
        self,
        start: int,
        stop: int,
        seconds: Callable[[fx.Node], float],
        nbytes: Callable[[fx.Node], int],
    ) -> RangeFacts:
        """The range's seconds and bytes, each node and value priced by ``seconds`` and
        ``nbytes`` (per device)."""
        atoms = self.atoms
        nodes = [node for atom in range(start, stop) for node in atoms.nodes[atom]]
        forward_seconds = backward_seconds = 0.0
        read: set[fx.Node] = set()
        for node in nodes:
            read.update(node.all_input_nodes)
            if self.phases[node] is ir.Phase.BACKWARD:
                backward_seconds += seconds(node)
            else:
                forward_seconds += seconds(node)
        # Parameters are static memory, not activations; the batch a stage reads is its own.
        saved = {
            value
            for value in saved_for_backward(nodes)
            if value.op != "placeholder" or value in atoms.batch
        }
        return RangeFacts(
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
        bandwidth, latency = link(self.cluster, devices)
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
        facts: RangeFacts,
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


class PlannedStageCostModel(StageCostModel):
    """Stage costs under the intra-op plan a stage mesh of ``d`` devices runs (module
    docstring), one plan per ``d``."""

    def __init__(
        self,
        atoms: Atoms,
        cluster: Cluster,
        pipeline: Pipeline,
        optimizer_states: int,
        planner: StagePlanner,
    ) -> None:
        super().__init__(atoms, cluster, pipeline, optimizer_states)
        self.planner = planner
        self._plans: dict[int, PlannedStep] = {}

    def planned(self, devices: int) -> PlannedStep:
        if devices not in self._plans:
            self._plans[devices] = self._plan(devices)
        return self._plans[devices]

    def _plan(self, devices: int) -> PlannedStep:
        mesh = stage_cluster(self.cluster, devices)
        program = self.atoms.program
        plan = self.planner(program, mesh)
        found = walk(plan.program, mesh)
        by_name = {node.name: node for node in program.graph.nodes}
        compute = {node.name: seconds for node, seconds in found.compute.items()}
        values: dict[str, int] = {}
        for node, specs in found.specs.items():
            value = ir.get(node, ir.ValueMeta)
            if value is None or node.op == "output":
                continue
            values[node.name] = value_bytes(value, specs, mesh)
        comm: dict[str, float] = {}
        sync: dict[str, float] = {}
        for record, seconds in zip(found.records, found.record_seconds, strict=True):
            if record.phase is ir.Phase.OUTPUT:
                sync[record.tensor] = sync.get(record.tensor, 0.0) + seconds
            else:
                comm[record.consumer] = comm.get(record.consumer, 0.0) + seconds
        local = {node: values.get(node.name, 0) for node in by_name.values()}
        forward, backward, _ = crossings(
            program, self.atoms.atom_of, self.atoms.count, lambda n: local[n]
        )
        return PlannedStep(compute, comm, sync, local, forward, backward)

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
class PlannedStep:
    """The step as planned on one stage mesh, per device: seconds of each op (by node name),
    of the collectives each op runs and of those that synchronise each gradient, the bytes of
    every value, and the bytes crossing each atom boundary."""

    compute: dict[str, float]
    comm: dict[str, float]
    sync: dict[str, float]
    local: dict[fx.Node, int]
    forward_crossing: tuple[int, ...]
    backward_crossing: tuple[int, ...]


def stage_cluster(cluster: Cluster, devices: int) -> Cluster:
    """The stage mesh ``(devices,)`` of a pipeline on ``cluster``: the links of the innermost
    axis holding ``devices`` consecutive ranks, and the memory of one device times the number of
    stages (the plan covers every stage's weights; a device holds about one stage's share)."""
    bandwidth, latency = link(cluster, devices)
    return dataclasses.replace(
        cluster,
        mesh_shape=(devices,),
        axis_names=("devices",),
        bandwidth=(bandwidth,),
        latency=(latency,),
        memory=cluster.memory * (cluster.world_size // devices),
    )


def link(cluster: Cluster, devices: int) -> tuple[float, float]:
    """Bandwidth and latency among ``devices`` consecutive ranks: the innermost mesh axis whose
    block of trailing axes they fit in evenly (ranks are row-major)."""
    block = 1
    for axis in reversed(range(cluster.ndim)):
        block *= cluster.mesh_shape[axis]
        if block % devices == 0:
            return cluster.bandwidth[axis], cluster.latency[axis]
    return min(cluster.bandwidth), max(cluster.latency)
