"""Stage costs: the time and memory of a range of atoms on a stage's devices, for the stage DP.

Every node's seconds and every value's bytes come from the cost and memory model
(:mod:`fxpar.planning.cost`): :func:`~fxpar.planning.cost.node_seconds` is the roofline the
intra-op problem charges, and the activations a range keeps are
:func:`~fxpar.planning.cost.saved_for_backward` of its nodes, the rule the intra-op problem and
the plan report count.

**Costs of layers ``[i, j)`` on ``d`` devices** (the stage time and memory of
:class:`~fxpar.solvers.stages.StageCost`). ``program`` is the step on the *global* batch; the
runtime cuts it into ``M`` micro-batches and each of the stage's ``d`` replicas takes ``1/d`` of
each, so work and activations scale by ``1 / (M d)`` (assumed linear in the batch). A program
captured at one micro-batch's shapes (``microbatch=True``, what :func:`fxpar.compile` prices, the
very program its pipeline runs) is already ``1/M`` of the step: read ``M`` as 1 below, except in
the once-a-step gradient terms, which stay ``/ M``:

    time   = (T_fwd + T_bwd + [remat] T_fwd - O) / (M d) + O             compute
           + (allreduce(G, d) + [d > 1] pack(G) + update(G) + (M-1) add(G)) / M   once a step
           + W lag(M compute / W) / M                                     waits for slower peers
           + [i > 0] (alpha + B_back(i) / (M d) / beta)                   gradients sent back
           + [j < L] (alpha + B_fwd(j) / (M d) / beta)                    activations sent on
    static = (2 + optimizer_states) G + S   (+ [remat] A_saved / (M d), one recompute at a time)
    activation per micro-batch in flight
           = A_saved / (M d)                       without remat
           = (B_fwd(i) + A_batch) / (M d)          with remat (only what the stage received)

``T`` is the roofline time of a node on one device, ``max(flops / F, bytes moved / memory
bandwidth)`` (:func:`~fxpar.planning.cost.node_seconds`, with a calibrated cluster's op
slowdowns and per-call costs), summed over the range's forward or backward nodes; ``O`` the
part of ``T`` its calls pay whatever their size (the cluster's ``op_overhead`` a call and the
op's fixed cost, :func:`~fxpar.planning.cost.call_seconds`; the recompute's calls again under
remat), which every micro-batch on every replica pays in full; ``G`` the bytes of
trainable parameters the range reads (each holder of a tied weight counts it), ``S`` of its
buffers and frozen parameters; ``A_saved`` the bytes of the forward values (batch tensors
included, views counted once at their base, parameters not at all) the range's backward reads;
``A_batch`` the batch tensors it reads; ``B_fwd(c)`` and ``B_back(c)`` the bytes of the values
crossing the boundary before atom ``c`` forwards and backwards. ``allreduce`` is
:func:`fxpar.planning.cost.collective_seconds` (``alpha + 2 (d-1)/d G / beta``) on the innermost
mesh axis that holds ``d`` consecutive ranks (a stage's replicas are consecutive ranks); sends
(:func:`send_seconds`) the slowest axis, which some pair of neighbouring stages may cross, at
the ``send`` lines calibration fits (a point-to-point transfer, not a collective of the
axis). The gradient reduction is charged ``1/M`` of it per micro-batch, so the DP's
objective counts the slowest stage's ``(M - 1)/M`` times too often; the step of a plan pays
each stage's once (:func:`~fxpar.solvers.stages.per_step_overcount`). ``lag`` is
:meth:`fxpar.Cluster.lag_seconds` (0 but on ranks that share a host's cores) and ``W`` the
stage's waits a step: ``M`` for each neighbour it receives from, one more for its gradient
reduction; ``compute`` is the first line. Costs are cached per (atom range,
stage mesh shape); data-parallel replicas only read the shape's number of devices ``d``.
``pack`` is the copy of the gradients into the reduction's buckets and back
(:func:`~fxpar.planning.cost.copy_seconds`), ``update`` the optimizer's update of the stage's
parameters (:func:`~fxpar.planning.cost.update_seconds`, of ``optimizer_states``), ``add`` the
runtime's sum of each micro-batch's gradients (:func:`~fxpar.planning.cost.accumulate_seconds`;
``M - 1`` adds of every trainable parameter, which grows with the micro-batches while the
compute does not). A plan's step adds, once, the all-reduce that sums a tied weight's gradient
between the two stages holding it (:meth:`StageCostModel.tied_seconds`, of the bytes of a
range's trainable parameters that atoms outside it read too, such as GPT's embedding, which its
head reads).

**Zero-bubble** (``schedule="zb-h1"``). ``T_w`` is the part of ``T_bwd`` only weight
gradients need: backward nodes no gradient sent back across an atom boundary depends on, found
once on the whole step (what a stage's W runs, :mod:`fxpar.pipeline.backward_split`, wherever
the stages are cut; a tied weight's gradient terms joined across atoms count in B), plus
``DIVIDED_WEIGHT_SHARE`` (a half) of each fused backward op B and W divide (a convolution's:
W calls it again for the weight gradients). ``A_kept`` are the bytes of the other backward
values those nodes read, the range's or received from the next stage (what B keeps for W; a
divided op's inputs B computes, such as its output gradient, rather than the op). A micro-batch
in flight then holds ``(A_saved + A_kept) / (M d)`` (with remat: what it received, plus
``A_saved`` recomputed for W, plus ``A_kept``), and every stage holds up to ``min(K, M)`` of them
(:meth:`StageCostModel.in_flight`, read off ZB-H1's lists). The step of a plan is its
1F1B estimate less what ZB-H1's lists save over 1F1B's on the same stages
(:meth:`StageCostModel.step_time`). Under stage plans the same terms are read from the plan:
``T_w`` sums the planned seconds of the same nodes, and ``A_kept`` their bytes per device.

**Intra-op plans inside stages** (``stage_planner``, which :func:`fxpar.compile` passes when a
solver, pins, options or rules are given with ``stages="auto"``). Then a stage runs an intra-op plan
on its own stage mesh, and the costs come from that plan. A stage mesh is a shape: ``(d,)``, ``d``
consecutive ranks with the links of the innermost mesh axis that holds them, or on a 2-D cluster
``(r, C)``, ``r`` whole rows of ``C`` devices, each axis with the links of the cluster axis it runs
along (:meth:`Cluster.submesh <fxpar.cluster.Cluster.submesh>`). For every distinct shape, the whole
step is planned once on that mesh (``stage_planner(program, stage_mesh)``, the ILP by default), and
the plan is read the way the plan report reads it
(:func:`fxpar.planning.step_time.price_schedule`: the plan's collective schedule, priced): per
node, its roofline seconds under its strategy and the collectives the schedule runs for it, with
the bytes each device holds of every value. Layers ``[i, j)`` then cost, per micro-batch
(``1/M`` of the planned step's work, assumed linear in the batch as above):

    time   = (T_fwd + T_bwd + [remat] T_fwd + C) / M + C_grad / M + sends of local bytes
    static = (2 + optimizer_states) G_local + S_local   (+ [remat] A_saved_local / M)

where ``C`` are the seconds of the collectives the range's ops run and ``C_grad`` those that
bring its gradients into their parameters' layouts (once a step). Of a collective of ``C``
that the planned step runs beside compute (:func:`~fxpar.planning.step_time.step_overlap`), the
cluster's :attr:`~fxpar.Cluster.hidden_share` is left out (none on CPU), as
:attr:`fxpar.Plan.estimate` leaves it out; ``C_grad`` counts in full: a pipeline synchronises
its gradients after its last micro-batch's backward, with little compute left to hide them.
The plan is made for the whole step, so each range is costed under the strategies that plan
chose for it, not re-planned per range; with repeated layers that is the same plan. A stage mesh
of ``d`` of the cluster's ``D`` devices is planned with ``cluster.memory * D / d`` per device:
the plan covers every layer's weights, and a stage of ``d`` devices holds about ``d / D`` of
them. Sends are priced with the local bytes of the sending stage's plan, as if both neighbours
laid the value out alike; the resharding between stages on different meshes is not priced. A
bucket of gradients synchronised together is charged to its gradients in proportion to their
bytes.

**Stamped steps** (``folds=True``, for a planner that chooses alike on a step and on its folded
twin): every stage mesh plans and prices the step folded to its six distinct layers
(:mod:`fxpar.ir.fold`, the same problem), each node of the step is priced as the node it is a
copy of, and the gradient buckets are cut again over the step's own gradients, which gives the
prices of the step planned whole (tests/test_fold.py).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import torch.fx as fx

from fxpar import ir
from fxpar.cluster import Cluster
from fxpar.ir.fold import fold
from fxpar.ir.program import Program
from fxpar.pipeline.atoms import Atoms, crossings, output_bytes, region
from fxpar.pipeline.backward_split import DIVIDED_WEIGHT_SHARE, divisible
from fxpar.pipeline.options import Pipeline, PipelineError
from fxpar.pipeline.schedule import StageTimes, replay, replay_shared
from fxpar.pipeline.schedules import ONE_F_ONE_B, Schedule
from fxpar.planning.cost import (
    accumulate_seconds,
    call_seconds,
    collective_seconds,
    copy_seconds,
    link_seconds,
    node_seconds,
    saved_for_backward,
    update_seconds,
    value_bytes,
)
from fxpar.planning.grouping import BUCKET_BYTES, Bucketed, cut_buckets
from fxpar.planning.step_time import price_schedule, step_overlap
from fxpar.solvers.errors import InfeasiblePlanError, format_bytes
from fxpar.solvers.stages import StageCost, per_step_overcount

if TYPE_CHECKING:
    from fxpar.planning.plan import Plan

Shape = tuple[int, ...]
_V = TypeVar("_V")

logger = logging.getLogger(__name__)

FRUGAL_ROOM = 1.05
"""A stage mesh on which no plan of the whole step fits its share of memory is planned with
this multiple of the most frugal plan's memory per device."""
FRUGAL_TRIES = 3
"""How many times such a mesh is planned again with the memory the last refusal named."""

StagePlanner = Callable[[Program, Cluster], "Plan"]
"""Plans a captured step on a stage mesh, e.g. ``fxpar.passes.plan_program``, and leaves the
step as it was (one step is planned for every mesh)."""


@dataclass(frozen=True)
class _AtomValues:
    read: frozenset[fx.Node]
    saved: frozenset[fx.Node]
    kept: frozenset[fx.Node] = frozenset()


@dataclass(frozen=True)
class RangeFacts:
    """What a range of atoms holds, priced per node and per value: ``T_fwd``, ``T_bwd``, ``G``,
    ``S``, ``A_saved`` and ``A_batch`` of the module docstring; ``T_w`` and ``A_kept`` of its
    zero-bubble paragraph."""

    forward_seconds: float
    backward_seconds: float
    trainable_bytes: int
    frozen_bytes: int
    saved_bytes: int
    batch_bytes: int
    weight_seconds: float = 0.0
    """The part of :attr:`backward_seconds` only weight gradients need (a zero-bubble W)."""
    kept_bytes: int = 0
    """Values of the input-gradient part (B), this range's or received, that the weight part
    (W) reads."""
    forward_call_seconds: float = 0.0
    backward_call_seconds: float = 0.0
    """Seconds of the range's forward and backward nodes that every call pays, however small
    its share of the batch: the cluster's ``op_overhead`` and op's fixed cost a call
    (:func:`~fxpar.planning.cost.call_seconds`), per micro-batch."""
    update_seconds: float = 0.0
    """The optimizer's update of the range's trainable parameters (their pieces on a device),
    once a step (:func:`fxpar.planning.cost.update_seconds`)."""
    accumulate_seconds: float = 0.0
    """One micro-batch's gradients of them added to the sums (``accumulate_seconds``)."""
    tied_bytes: int = 0
    """Bytes of the trainable parameters the range reads that atoms outside it read too:
    weights whose gradients the stage sums with another stage's once a step."""

    @property
    def seconds(self) -> float:
        return self.forward_seconds + self.backward_seconds


@dataclass(frozen=True)
class _WeightSplit:
    """The step's backward nodes as a zero-bubble schedule's W and B run them: W's alone,
    B's (``needed``), and those of B's fused ops that W calls again (``divided``)."""

    weights: frozenset[fx.Node]
    needed: frozenset[fx.Node]
    divided: frozenset[fx.Node]


@dataclass(frozen=True)
class _Priced:
    """A stage's cost, and the seconds of its time per micro-batch that its ops (and the
    collectives they run) take."""

    cost: StageCost
    compute: float


class StageCostModel:
    """Stage costs of atom ranges, cached per range and per (range, stage mesh shape); the
    stages are ``prod(shape)`` data-parallel replicas."""

    def __init__(
        self,
        atoms: Atoms,
        cluster: Cluster,
        pipeline: Pipeline,
        optimizer_states: int,
        *,
        microbatch: bool = False,
    ) -> None:
        if optimizer_states < 0:
            raise PipelineError(f"optimizer_states must be >= 0, got {optimizer_states}")
        self.atoms = atoms
        self.pieces = 1 if microbatch else pipeline.microbatches
        """How many micro-batches the program's batch holds: ``M`` for the global batch, 1
        for a program captured at one micro-batch's shapes (``microbatch``)."""
        self.cluster = cluster
        self.pipeline = pipeline
        self.optimizer_states = optimizer_states
        self.phases = {node: region(node).phase for node in atoms.atom_of}
        self._ranges: dict[tuple[int, int, Shape | None], RangeFacts] = {}
        self._costs: dict[tuple[int, int, Shape], _Priced] = {}
        self._seconds: dict[tuple[object, int], tuple[float, float, float]] = {}
        self._values: dict[int, _AtomValues] = {}
        self._call_seconds: dict[int, tuple[float, float]] = {}
        self._weights: _WeightSplit | None = None
        self._read_by: dict[fx.Node, frozenset[int]] | None = None
        self._in_flight: dict[tuple[Schedule, int], tuple[int, ...]] = {}

    def with_pipeline(self, pipeline: Pipeline) -> StageCostModel:
        """This model for another schedule or remat setting of the same micro-batches: what
        does not depend on them (each range's facts, each stage mesh's plan) is shared, the
        stage costs are priced anew."""
        if pipeline.microbatches != self.pipeline.microbatches:
            raise PipelineError(
                f"a cost model of {self.pipeline.microbatches} micro-batches cannot price "
                f"{pipeline.microbatches}: their steps differ; build another"
            )
        other = copy.copy(self)
        other.pipeline = pipeline
        other._costs = {}
        return other

    def facts(self, start: int, stop: int, shape: Shape | None = None) -> RangeFacts:
        """The facts of atoms ``[start, stop)``, priced by the roofline on one device (``shape``
        None) or, in a model of stage plans, under the plan of stage mesh ``shape``; computed
        once."""
        key = (start, stop, shape)
        found = self._ranges.get(key)
        if found is None:
            found = self._ranges[key] = self._measure(start, stop, shape)
        return found

    def _measure(self, start: int, stop: int, shape: Shape | None) -> RangeFacts:
        return self._facts(start, stop, lambda node: node_seconds(node, self.cluster), output_bytes)

    def _facts(
        self,
        start: int,
        stop: int,
        seconds: Callable[[fx.Node], float],
        nbytes: Callable[[fx.Node], int],
        key: object = None,
    ) -> RangeFacts:
        """The range's seconds and bytes, each node and value priced by ``seconds`` and
        ``nbytes`` (per device). ``key`` names the pricing: each atom's seconds are summed
        once per key, and a range unions its atoms' sets of values."""
        atoms = range(start, stop)
        forward_seconds = backward_seconds = weight_seconds = 0.0
        forward_call_seconds = backward_call_seconds = 0.0
        for atom in atoms:
            forward, backward, weight = self._atom_seconds(atom, seconds, key)
            forward_seconds += forward
            backward_seconds += backward
            weight_seconds += weight
            calls = self._per_call(atom)
            forward_call_seconds += calls[0]
            backward_call_seconds += calls[1]
        read: set[fx.Node] = set().union(*(self._sets(atom).read for atom in atoms))
        saved: set[fx.Node] = set().union(*(self._sets(atom).saved for atom in atoms))
        kept: set[fx.Node] = set().union(*(self._sets(atom).kept for atom in atoms))
        trained = [n for n in read if n in self.atoms.trainable]
        readers, inside = self._readers(), set(atoms)
        tied = [n for n in trained if not readers[n] <= inside]
        return RangeFacts(
            forward_seconds=forward_seconds,
            backward_seconds=backward_seconds,
            trainable_bytes=sum(nbytes(n) for n in trained),
            frozen_bytes=sum(nbytes(n) for n in read if n in self.atoms.frozen),
            saved_bytes=sum(nbytes(n) for n in saved),
            batch_bytes=sum(nbytes(n) for n in read if n in self.atoms.batch),
            weight_seconds=weight_seconds,
            kept_bytes=sum(nbytes(n) for n in kept),
            forward_call_seconds=forward_call_seconds,
            backward_call_seconds=backward_call_seconds,
            # fsum: the same seconds whatever order the set gives its values in.
            update_seconds=math.fsum(
                update_seconds(nbytes(n), self.optimizer_states, self.cluster) for n in trained
            ),
            accumulate_seconds=math.fsum(
                accumulate_seconds(nbytes(n), self.cluster) for n in trained
            ),
            tied_bytes=sum(nbytes(n) for n in tied),
        )

    def _readers(self) -> Mapping[fx.Node, frozenset[int]]:
        """The atoms that read each trainable parameter; computed once."""
        if self._read_by is None:
            found: dict[fx.Node, set[int]] = {}
            for atom in range(self.atoms.count):
                for value in self._sets(atom).read:
                    if value in self.atoms.trainable:
                        found.setdefault(value, set()).add(atom)
            self._read_by = {node: frozenset(atoms) for node, atoms in found.items()}
        return self._read_by

    def _per_call(self, atom: int) -> tuple[float, float]:
        """The seconds one atom's forward and backward nodes pay a call whatever their size
        (:func:`~fxpar.planning.cost.call_seconds`)."""
        found = self._call_seconds.get(atom)
        if found is None:
            seconds = [0.0, 0.0]
            for node in self.atoms.nodes[atom]:
                cost = ir.get(node, ir.Cost)
                if cost is not None and cost.op:
                    backward = self.phases[node] is ir.Phase.BACKWARD
                    seconds[backward] += call_seconds(cost, self.cluster)
            found = self._call_seconds[atom] = (seconds[0], seconds[1])
        return found

    def _atom_seconds(
        self, atom: int, seconds: Callable[[fx.Node], float], key: object
    ) -> tuple[float, float, float]:
        """The forward and backward seconds of one atom's nodes, priced by ``seconds``, and
        the part of the backward's that only weight gradients need."""
        found = self._seconds.get((key, atom))
        if found is None:
            split = self._weight_split()
            forward = backward = weight = 0.0
            for node in self.atoms.nodes[atom]:
                if self.phases[node] is ir.Phase.BACKWARD:
                    backward += seconds(node)
                    if node in split.weights:
                        weight += seconds(node)
                    elif node in split.divided:
                        weight += DIVIDED_WEIGHT_SHARE * seconds(node)
                else:
                    forward += seconds(node)
            found = self._seconds[(key, atom)] = (forward, backward, weight)
        return found

    def _weight_split(self) -> _WeightSplit:
        """The backward nodes that only weight gradients need (what a zero-bubble W runs
        wherever the stages are cut: no gradient sent back across an atom boundary depends
        on them), the other backward nodes (B's), and the fused ops of B's that W calls again
        for their weight gradients. Found once, on the whole step."""
        if self._weights is None:
            atom_of = self.atoms.atom_of
            backward = {n for n, phase in self.phases.items() if phase is ir.Phase.BACKWARD}
            sent = [
                node
                for node in backward
                if any(atom_of.get(user, atom_of[node]) < atom_of[node] for user in node.users)
            ]
            needed: set[fx.Node] = set()
            while sent:
                node = sent.pop()
                if node in backward and node not in needed:
                    needed.add(node)
                    sent.extend(node.all_input_nodes)
            divided = frozenset(node for node in needed if divisible(node, needed))
            self._weights = _WeightSplit(frozenset(backward - needed), frozenset(needed), divided)
        return self._weights

    def _sets(self, atom: int) -> _AtomValues:
        """What one atom's nodes read, and what its backward keeps of the forward; a range's
        sets are the unions of its atoms' (:func:`saved_for_backward` is a union over
        nodes)."""
        found = self._values.get(atom)
        if found is None:
            nodes = self.atoms.nodes[atom]
            read = frozenset(value for node in nodes for value in node.all_input_nodes)
            # Parameters are static memory, not activations; the batch a stage reads is its own.
            saved = frozenset(
                value
                for value in saved_for_backward(nodes)
                if value.op != "placeholder" or value in self.atoms.batch
            )
            # What its W reads of B's values, wherever computed (a received gradient too); a
            # divided op's W call reads the op's inputs, not the op.
            split = self._weight_split()
            readers = [node for node in nodes if node in split.weights or node in split.divided]
            kept = frozenset(
                value
                for node in readers
                for value in node.all_input_nodes
                if value in split.needed and value not in split.divided
            )
            found = self._values[atom] = _AtomValues(read, saved, kept)
        return found

    def in_flight(self, num_stages: int) -> tuple[int, ...]:
        """Each stage's micro-batches in flight, read off the schedule's lists, for the DP."""
        key = (self.pipeline.named_schedule, num_stages)
        if key not in self._in_flight:  # shared with other settings' models (the same M)
            self._in_flight[key] = key[0].in_flight(num_stages, self.pipeline.microbatches)
        return self._in_flight[key]

    def step_time(self, stages: Sequence[tuple[int, int, Shape]], objective: float) -> float:
        """The step of the stages ``(start, stop, shape)`` whose stage DP objective (1F1B's
        ``sum t + (M - 1) max t``) is ``objective``, under this model's schedule and machine.
        Splitting the backward (ZB-H1), the objective less what its lists save over 1F1B's,
        both replayed (:func:`~fxpar.pipeline.schedule.replay`) on stages whose time splits
        into forward, B and W as their nodes' seconds do (a remat recompute in B; collectives
        and sends shared by the three in proportion). On ranks that share
        a host's cores (:attr:`fxpar.Cluster.core_demand`), less what the schedule's idle
        stages leave the others: the lists of the stages' compute (their ops and the
        collectives those run, which on CPU share the cores) replayed at the calibrated speed,
        less replayed with each stretch at the speed its computing ranks get
        (:func:`~fxpar.pipeline.schedule.replay_shared`, after the cluster's ``core_delay``
        each time another set of stages starts computing). The replicas' gradient reduction
        and the update run on every rank at once at the end of the step: no faster. And always
        with each stage's once-a-step seconds (that reduction and update) paid once, after its
        last backward, where the objective spreads them over its micro-batches and so counts
        the slowest stage's ``M - 1`` times more (:meth:`_per_step_overcount`), and the tied
        weights' sums after that (:meth:`tied_seconds`). ``shape`` is the stage's mesh: its
        replicas, or the mesh its plan was made for."""
        schedule, cluster = self.pipeline.named_schedule, self.cluster
        shared = cluster.compute_speedup(1 / cluster.world_size) > 1
        objective -= self._per_step_overcount(stages)
        objective += self.tied_seconds(stages)
        if not schedule.splits_backward and not shared:
            return objective
        times = self._stage_times(stages)
        count, microbatches = len(times), self.pipeline.microbatches
        lists = schedule.build(count, microbatches)
        step, (own, _) = objective, replay(lists, times)
        if schedule.splits_backward:
            one_f_one_b, _ = replay(ONE_F_ONE_B.build(count, microbatches), times)
            step -= one_f_one_b - own
        if shared:
            devices = [math.prod(shape) for _, _, shape in stages]

            def speed(computing: frozenset[int]) -> float:
                ranks = sum(devices[stage] for stage in computing)
                return cluster.compute_speedup(ranks / cluster.world_size)

            # Only the stages' compute runs faster: their replicas' gradient reduction and
            # update run on every rank at once at the end, and the waits are waits.
            computed = self._stage_times(stages, compute_only=True)
            alone, _ = replay(lists, computed)
            step -= alone - replay_shared(lists, computed, speed, delay=cluster.core_delay)
        return step

    def _per_step_overcount(self, stages: Sequence[tuple[int, int, Shape]]) -> float:
        """:func:`~fxpar.solvers.stages.per_step_overcount` of ``stages``."""
        costs = [self.cost(*stage) for stage in stages]
        return per_step_overcount(
            [cost.time for cost in costs], [cost.per_step for cost in costs],
            self.pipeline.microbatches,
        )  # fmt: skip

    def _stage_times(
        self, stages: Sequence[tuple[int, int, Shape]], *, compute_only: bool = False
    ) -> list[StageTimes]:
        """Each stage's time per micro-batch, split into forward, B and W as its nodes'
        seconds split (a remat recompute in B, collectives and sends in proportion);
        ``compute_only``: only its ops' (and their collectives') seconds, without its share of
        the once-a-step reduction and update, its sends and its waits for peers."""
        times = []
        for start, stop, shape in stages:
            facts = self.facts(start, stop, shape)
            weight = facts.weight_seconds
            forward = facts.forward_seconds
            backward = facts.backward_seconds - weight
            if self.pipeline.remat:
                backward += forward
            total = forward + backward + weight
            priced = self._priced(start, stop, shape)
            seconds = priced.compute if compute_only else priced.cost.time
            scale = seconds / total if total else 0.0
            times.append(StageTimes(forward * scale, backward * scale, weight * scale))
        return times

    def tied_seconds(self, stages: Sequence[tuple[int, int, Shape]]) -> float:
        """What the stages ``(start, stop, shape)`` spend summing the gradients of the weights
        two of them hold (:func:`tied_seconds`), once at the end of a step, when the last of
        them is done: the longest such all-reduce. Not in the stage costs, so the stage DP
        does not weigh it, but every plan of two stages or more with the tied weight's readers
        in different stages pays about the same (its bytes)."""
        held = (self.facts(start, stop, shape).tied_bytes for start, stop, shape in stages)
        return max((tied_seconds(nbytes, self.cluster) for nbytes in held if nbytes), default=0.0)

    def cost(self, start: int, stop: int, shape: Shape) -> StageCost:
        """The cost of atoms ``[start, stop)`` on a stage mesh of ``shape``."""
        return self._priced(start, stop, shape).cost

    def _priced(self, start: int, stop: int, shape: Shape) -> _Priced:
        key = (start, stop, tuple(shape))
        if key not in self._costs:
            self._costs[key] = self._stage_cost(start, stop, key[2])
        return self._costs[key]

    def _stage_cost(self, start: int, stop: int, shape: Shape) -> _Priced:
        devices = math.prod(shape)
        facts = self.facts(start, stop)
        bandwidth, latency = self.cluster.link(devices)
        reduce = collective_seconds(
            "all_reduce", facts.trainable_bytes, devices, bandwidth, latency
        )
        if devices > 1:
            # Packed into buckets and copied back (waiting.all_reduce_buckets).
            reduce += 2 * copy_seconds(facts.trainable_bytes, self.cluster)
        atoms = self.atoms
        return self._price(
            start, stop, facts, atoms.forward_crossing, atoms.backward_crossing,
            share=self.pieces * devices, per_step=reduce,
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
    ) -> _Priced:
        """The stage cost of layers ``[start, stop)`` (module docstring): ``facts`` and the
        crossing bytes are for the work a micro-batch gives the stage's devices times
        ``share``; ``per_step`` seconds are spent once a step (gradient synchronisation),
        ``per_microbatch`` seconds (``share`` times over) beside the compute."""
        pipeline, cluster = self.pipeline, self.cluster
        compute = facts.forward_seconds + facts.backward_seconds + per_microbatch
        # Every call pays its dispatch and fixed cost whatever its share of the batch: that
        # part of the compute is not divided among micro-batches and replicas.
        overhead = facts.forward_call_seconds * (1 + pipeline.remat) + facts.backward_call_seconds
        compute += facts.forward_seconds if pipeline.remat else 0.0
        overhead = min(overhead, compute)
        sent = [backward_crossing[start] if start > 0 else 0]
        sent.append(forward_crossing[stop] if stop < self.atoms.count else 0)
        send = sum(send_seconds(nbytes / share, cluster) for nbytes in sent if nbytes)
        static = float((2 + self.optimizer_states) * facts.trainable_bytes + facts.frozen_bytes)
        if pipeline.remat:
            received = forward_crossing[start] if start > 0 else 0
            activation = (received + facts.batch_bytes) / share
            static += facts.saved_bytes / share
        else:
            activation = facts.saved_bytes / share
        if pipeline.named_schedule.splits_backward:
            # From B to W a micro-batch keeps what W reads: the kept values, and under remat
            # the recomputed forward values (at most what the stash would have held).
            activation += (facts.kept_bytes + (facts.saved_bytes if pipeline.remat else 0)) / share
        per_microbatch_compute = (compute - overhead) / share + overhead
        lag = self._lag(start, stop, per_microbatch_compute, synchronised=per_step > 0)
        # The optimizer's update and the sums of the micro-batches' gradients, once a step.
        per_step += facts.update_seconds + (pipeline.microbatches - 1) * facts.accumulate_seconds
        cost = StageCost(
            time=per_microbatch_compute + lag + per_step / pipeline.microbatches + send,
            static_memory=static,
            activation_memory=float(activation),
            per_step=per_step,
        )
        return _Priced(cost, per_microbatch_compute)

    def _lag(self, start: int, stop: int, compute: float, *, synchronised: bool) -> float:
        """The wait for a slower peer a micro-batch of the stage pays on ranks that share a
        host's cores (:meth:`fxpar.Cluster.lag_seconds`), ``compute`` its seconds: the stage
        waits for its neighbours' messages (before its forward unless it is the first, before
        its backward unless it is the last) and, ``synchronised``, for its replicas' gradient
        reduction once a step; a step's compute is shared evenly among those waits."""
        microbatches = self.pipeline.microbatches
        waits = microbatches * ((start > 0) + (stop < self.atoms.count)) + synchronised
        if not waits or not self.cluster.lag_share:
            return 0.0
        return waits * self.cluster.lag_seconds(compute * microbatches / waits) / microbatches


class PlannedStageCostModel(StageCostModel):
    """Stage costs under the intra-op plan a stage mesh runs (module docstring): one plan of
    the whole step per distinct stage mesh shape, made the first time that shape is priced."""

    def __init__(
        self,
        atoms: Atoms,
        cluster: Cluster,
        pipeline: Pipeline,
        optimizer_states: int,
        planner: StagePlanner,
        *,
        microbatch: bool = False,
        folds: bool = False,
    ) -> None:
        super().__init__(atoms, cluster, pipeline, optimizer_states, microbatch=microbatch)
        self.planner = planner
        self.folded = fold(atoms.program) if folds else None
        self._plans: dict[Shape, PlannedStep] = {}
        self._collectives: dict[tuple[Shape, int], tuple[float, float]] = {}

    def planned(self, shape: Shape) -> PlannedStep:
        """The step as planned on the stage mesh of ``shape`` (planned once per shape); raises
        what the planner raises."""
        shape = tuple(shape)
        if shape not in self._plans:
            self._plans[shape] = self._plan(shape)
        return self._plans[shape]

    def _most_frugal(self, planned: Program, mesh: Cluster, error: InfeasiblePlanError) -> Plan:
        """``planned`` on ``mesh`` with room for its most frugal plan: the memory the refusal
        names, a little more (a plan that fits the solver's memory row may still be refused
        for its walked peak, which the next refusal names)."""
        for _ in range(FRUGAL_TRIES):
            room = dataclasses.replace(mesh, memory=error.least_memory * FRUGAL_ROOM)
            try:
                return self.planner(planned, room)
            except InfeasiblePlanError as again:
                error = again
        raise error

    def _plan(self, shape: Shape) -> PlannedStep:
        mesh = self.cluster.submesh(shape)
        program = self.atoms.program
        # A stamped step is planned folded (fxpar.ir.fold): the same problem, a fraction of
        # the nodes; each node of the step is then priced as the node it is a copy of.
        planned = program if self.folded is None else self.folded.program
        try:
            plan = self.planner(planned, mesh)
        except InfeasiblePlanError as error:
            # The whole step does not fit this mesh at its share of the cluster's memory, but
            # a stage holds only its own layers: price the mesh by its most frugal plan (with
            # a little room to trade), and let the stage DP check each stage's memory.
            logger.info(
                "stage mesh %s: the whole step needs %s per device, planned at its most frugal",
                shape, format_bytes(error.least_memory),
            )  # fmt: skip
            plan = self._most_frugal(planned, mesh, error)
        found = price_schedule(plan.program, mesh)
        # A collective the planned step runs beside compute costs the stage what the cluster
        # does not hide of it (as Plan.estimate counts it; on CPU, all of it).
        hides = mesh.hidden_share
        walked = step_overlap(found, list(plan.program.graph.nodes)) if hides else None
        compute = {node.name: seconds for node, seconds in found.compute.items()}
        values: dict[str, int] = {}
        for node, specs in found.specs.items():
            value = ir.get(node, ir.ValueMeta)
            if value is None or node.op == "output":
                continue
            values[node.name] = value_bytes(value, specs, mesh)
        comm: dict[str, float] = {}
        sync: dict[str, float] = {}
        # A bucket's collectives are shared by its gradients by their bytes, so that a stage
        # pays for the gradients it holds. A folded step's buckets are cut again as the
        # step's own gradients would be.
        leaving = found.schedule.leaving.buckets
        buckets: Sequence[Sequence[Bucketed]] = [bucket.members for bucket in leaving]
        if self.folded is not None:
            buckets = _unfolded_buckets(buckets, self.folded.origin, program)
        for members in buckets:
            seconds = _bucket_seconds(members, mesh)
            total = sum(member.nbytes for member in members)
            for member in members:
                share = member.nbytes / total if total else 1 / len(members)
                sync[member.source.name] = sync.get(member.source.name, 0.0) + seconds * share
        bucketed = {id(record) for bucket in leaving for record in bucket.records}
        for record, seconds in zip(found.records, found.record_seconds, strict=True):
            if id(record) in bucketed:
                continue
            if walked is not None:
                hidden = seconds - walked.exposed_records.get(id(record), 0.0)
                seconds -= hides * max(hidden, 0.0)
            if record.phase is ir.Phase.OUTPUT:
                sync[record.tensor] = sync.get(record.tensor, 0.0) + seconds
            else:
                comm[record.consumer] = comm.get(record.consumer, 0.0) + seconds
        if self.folded is not None:
            origin = self.folded.origin
            compute, comm = _unfolded(compute, origin), _unfolded(comm, origin)
            values = _unfolded(values, origin)
        local = {node: values.get(node.name, 0) for node in program.graph.nodes}
        forward, backward, _ = crossings(
            program, self.atoms.atom_of, self.atoms.count, lambda n: local[n]
        )
        return PlannedStep(compute, comm, sync, local, forward, backward)

    def _stage_cost(self, start: int, stop: int, shape: Shape) -> _Priced:
        step = self.planned(shape)
        facts = self.facts(start, stop, shape)
        sync = comm = 0.0
        for atom in range(start, stop):
            atom_sync, atom_comm = self._collective_seconds(shape, atom)
            sync += atom_sync
            comm += atom_comm
        # The plan is per device already: a micro-batch is 1/pieces of the planned step.
        return self._price(
            start, stop, facts, step.forward_crossing, step.backward_crossing,
            share=self.pieces, per_step=sync, per_microbatch=comm,
        )  # fmt: skip

    def _measure(self, start: int, stop: int, shape: Shape | None) -> RangeFacts:
        if shape is None:
            return super()._measure(start, stop, shape)
        step = self.planned(shape)
        return self._facts(
            start, stop, lambda n: step.compute.get(n.name, 0.0), lambda n: step.local.get(n, 0),
            key=shape,
        )  # fmt: skip

    def _collective_seconds(self, shape: Shape, atom: int) -> tuple[float, float]:
        """The seconds of the collectives that synchronise one atom's gradients and of those
        its ops run, under the plan of ``shape``."""
        key = (shape, atom)
        found = self._collectives.get(key)
        if found is None:
            step = self.planned(shape)
            names = [node.name for node in self.atoms.nodes[atom]]
            found = self._collectives[key] = (
                sum(step.sync.get(name, 0.0) for name in names),
                sum(step.comm.get(name, 0.0) for name in names),
            )
        return found


def _unfolded_buckets(
    buckets: Sequence[Sequence[Bucketed]], origin: Mapping[str, str], program: Program
) -> list[list[Bucketed]]:
    """The gradient buckets of ``program``, from those of the step it was folded to: every
    result of ``program`` travels as its folded twin does, in buckets cut anew."""
    twins = {member.source.name: member for members in buckets for member in members}
    output = program.graph.output_node()
    results = output.args[0]
    assert isinstance(results, (tuple, list))
    members = [
        dataclasses.replace(twin, index=index, source=result)
        for index, result in enumerate(results)
        if isinstance(result, fx.Node) and (twin := twins.get(origin[result.name])) is not None
    ]
    order = {node: position for position, node in enumerate(program.graph.nodes)}
    return cut_buckets(members, order, BUCKET_BYTES)


def send_seconds(nbytes: float, cluster: Cluster) -> float:
    """Time of one stage's send of ``nbytes`` to a neighbour: a ``send`` on the slowest axis of
    ``cluster`` at those bytes (:func:`~fxpar.planning.cost.link_seconds`; its own lines where
    calibration fitted them, else the axis' latency and bandwidth), which some pair of
    neighbouring stages may cross."""
    axes = [axis for axis, devices in enumerate(cluster.mesh_shape) if devices > 1]
    return max((link_seconds("send", nbytes, axis, cluster) for axis in axes), default=0.0)


def tied_seconds(nbytes: float, cluster: Cluster) -> float:
    """Time of the all-reduce that sums a tied weight's gradient (``nbytes`` on a device)
    with the other stage holding it, once a step (:func:`fxpar.pipeline.groups.tied_sums`): a
    collective of two ranks at the all-reduce lines of the slowest axis, which the two stages
    may cross, as their sends do (:func:`send_seconds`)."""
    axes = [axis for axis, devices in enumerate(cluster.mesh_shape) if devices > 1]
    lines = [cluster.lines_of("all_reduce", axis) for axis in axes]
    each = [min(collective_seconds("all_reduce", nbytes, 2, *line) for line in of) for of in lines]
    return max(each, default=0.0)


def _bucket_seconds(members: Sequence[Bucketed], mesh: Cluster) -> float:
    """The seconds of the collectives of one bucket, as the collective schedule runs them
    (:mod:`fxpar.planning.collective_schedule`): one per axis of its route, of every member's
    bytes."""
    route = members[0].route
    nbytes = sum(member.nbytes for member in members)
    return sum(link_seconds(route.kind, nbytes, axis, mesh) for axis in route.axes)


def _unfolded(table: Mapping[str, _V], origin: Mapping[str, str]) -> dict[str, _V]:
    """``table``, made for a folded step, read for every node of the step it was folded from."""
    return {name: table[of] for name, of in origin.items() if of in table}


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
