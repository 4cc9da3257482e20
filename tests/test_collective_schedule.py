"""The collective schedule is the one the programs run: for random small models, meshes and
plans (the ILP's, every manual plan, random plans), in fp32 and bf16 mixed precision, with and
without rematerialization, the plan report's collectives (kind, count and bytes per mesh axis)
are exactly those of the lowered per-rank programs, counted from their collective calls and
measured on the tensors each rank hands its communicator."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import pytest
import torch
import torch.fx as fx
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st

import fxpar
from fxpar import ir, plans
from fxpar.cluster import Cluster
from fxpar.errors import FxparError
from fxpar.lowering import SPMDProgram, collective_calls
from fxpar.models import GPT, GPTConfig, gpt_loss
from fxpar.passes import default_passes, plan_program
from fxpar.passes.manual import random_plan
from fxpar.planning.plan import Plan
from fxpar.planning.problem import PlanOptions, build_problem
from fxpar.planning.report import plan_collectives, report_data
from fxpar.solvers.ilp import ILPSolver
from fxpar.solvers.problem import IntraOpSolution
from fxpar.testing import ModelCase
from fxpar.testing import strategies as fst
from fxpar.testing.simulate import SimulatedCommunicator, run_ranks

Key = tuple[str, int]
"""(collective kind, mesh axis)."""

MANUAL: dict[str, Callable[[fxpar.Program, Cluster], fxpar.Program]] = {
    "replicated": plans.replicated,
    "data_parallel": plans.data_parallel,
    "fully_sharded": plans.fully_sharded,
    "tensor_parallel": plans.tensor_parallel,
}
KINDS = ("ilp", "random", *MANUAL)


def planned(
    case: ModelCase, cluster: Cluster, kind: str, seed: int, mixed: bool, remat: bool
) -> tuple[Plan, list[torch.Tensor]]:
    policy = fxpar.MixedPrecision(torch.bfloat16, torch.float32) if mixed else None
    program = fxpar.capture(
        case.model, case.inputs, case.loss_fn, example_targets=case.targets, mixed_precision=policy
    )
    flat = program.flat_inputs(case.model, *case.inputs, *case.targets)
    options = PlanOptions(remat="all" if remat else "none")
    if kind == "ilp":
        plan = plan_program(program, cluster, solver=ILPSolver(time_limit=10.0), options=options)
        return plan, flat
    if kind == "random":
        return random_planned(program, cluster, seed, options), flat
    try:
        return plan_program(program, cluster, manual=MANUAL[kind], options=options), flat
    except FxparError:
        reject()  # a manual plan that does not fit the model (a batch its mesh does not divide)


def random_planned(
    program: fxpar.Program, cluster: Cluster, seed: int, options: PlanOptions
) -> Plan:
    """A random plan as a Plan for the report. Not through ``plan_program``: the problem
    cannot express every random plan (under mixed precision ``ApplyManualPlan`` rejects them
    as "a choice the problem cannot represent"), and the report reads the problem and the
    solution only for its header."""
    program.cluster = cluster
    program = default_passes(options=options).through("annotate-strategies").run(program)
    program = random_plan(program, cluster, seed)
    exact = PlanOptions(coarsen=False, dedup_layers=False)
    problem, layout = build_problem(program, cluster, exact)
    solution = IntraOpSolution((), math.nan, "feasible", math.nan, "random", 0.0)
    return Plan(program, cluster, problem, solution, layout, exact)


def reported(plan: Plan) -> tuple[Counter[Key], Counter[Key]]:
    """Count and bytes of the report's collectives, by kind and mesh axis."""
    counts: Counter[Key] = Counter()
    sizes: Counter[Key] = Counter()
    for layer in report_data(plan)["layers"]:
        for entry in layer["collectives"]:
            counts[entry["kind"], entry["axis"]] += entry["count"]
            sizes[entry["kind"], entry["axis"]] += entry["bytes"]
    return counts, sizes


def called(module: fx.GraphModule) -> Counter[Key]:
    """The collectives a lowered program's calls start, by kind and mesh axis (a bucket's or
    gather group's call runs one per axis)."""
    found: Counter[Key] = Counter()
    for node in module.graph.nodes:
        target, args = node.target, node.args
        if target in (collective_calls.all_gather, collective_calls.reduce_scatter):
            found[target.__name__, args[3]] += 1
        elif target in (collective_calls.all_reduce, collective_calls.start_all_reduce):
            found["all_reduce", args[2]] += 1
        elif target is collective_calls.all_to_all:
            found["all_to_all", args[4]] += 1
        elif target is collective_calls.start_all_reduce_bucket:
            found.update(("all_reduce", axis) for axis in args[2])
        elif target is collective_calls.start_reduce_scatter_bucket:
            found["reduce_scatter", args[3]] += 1
        elif target is collective_calls.start_all_gather_bucket:
            found.update(("all_gather", axis) for axis in args[3])
    return found


@dataclass
class Recording:
    """A simulated device's communicator that counts what each collective is handed."""

    inner: SimulatedCommunicator
    counts: Counter[Key] = field(default_factory=Counter)
    sizes: Counter[Key] = field(default_factory=Counter)

    def _record(self, kind: str, tensor: torch.Tensor, axis: int) -> None:
        self.counts[kind, axis] += 1
        self.sizes[kind, axis] += tensor.numel() * tensor.element_size()

    def all_gather(self, tensor: torch.Tensor, dim: int, axis: int) -> torch.Tensor:
        self._record("all_gather", tensor, axis)
        return self.inner.all_gather(tensor, dim, axis)

    def all_reduce(self, tensor: torch.Tensor, axis: int) -> torch.Tensor:
        self._record("all_reduce", tensor, axis)
        return self.inner.all_reduce(tensor, axis)

    def reduce_scatter(self, tensor: torch.Tensor, dim: int, axis: int) -> torch.Tensor:
        self._record("reduce_scatter", tensor, axis)
        return self.inner.reduce_scatter(tensor, dim, axis)

    def all_to_all(
        self, tensor: torch.Tensor, split_dim: int, concat_dim: int, axis: int
    ) -> torch.Tensor:
        self._record("all_to_all", tensor, axis)
        return self.inner.all_to_all(tensor, split_dim, concat_dim, axis)

    def start_all_reduce(self, flat: torch.Tensor, axis: int) -> collective_calls.Pending:
        self._record("all_reduce", flat, axis)
        return self.inner.start_all_reduce(flat, axis)

    def start_reduce_scatter(
        self, output: torch.Tensor, flat: torch.Tensor, axis: int
    ) -> collective_calls.Pending:
        self._record("reduce_scatter", flat, axis)
        return self.inner.start_reduce_scatter(output, flat, axis)

    def start_all_gather(
        self, output: torch.Tensor, flat: torch.Tensor, axis: int
    ) -> collective_calls.Pending:
        self._record("all_gather", flat, axis)
        return self.inner.start_all_gather(output, flat, axis)


def measured(spmd: SPMDProgram, flat: Iterable[torch.Tensor]) -> list[Recording]:
    """Every rank's program run on simulated devices, with what its collectives were handed."""

    def run(
        module: fx.GraphModule, comm: SimulatedCommunicator, local: list[torch.Tensor]
    ) -> Recording:
        recording = Recording(comm)
        module(recording, *local)
        return recording

    return list(run_ranks(spmd, list(flat), run).values())


MESHES = tuple(mesh for mesh in fst.MESHES if math.prod(mesh) > 1)


@pytest.mark.parametrize("kind", KINDS)
@settings(
    max_examples=5,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
@given(
    case=fst.models(),
    mesh=st.sampled_from(MESHES),
    seed=fst.plan_seeds(),
    mixed=st.booleans(),
    remat=st.booleans(),
)
def test_report_counts_the_collectives_the_lowered_programs_run(
    kind: str, case: ModelCase, mesh: tuple[int, ...], seed: int, mixed: bool, remat: bool
) -> None:
    # Links on which the ILP splits even these small models (manual plans ignore costs).
    cluster = fst.splitting_cluster(mesh)
    plan, flat = planned(case, cluster, kind, seed, mixed, remat)
    counts, sizes = reported(plan)
    import sys

    print(
        "EX",
        kind,
        mixed,
        remat,
        cluster.mesh_shape,
        sum(counts.values()),
        sorted(counts),
        file=sys.stderr,
    )
    spmd = fxpar.lower(plan)
    for rank in spmd.ranks:
        assert called(rank.graph_module) == counts, f"rank {rank.rank}:\n{rank.code()}"
    for recording in measured(spmd, flat):
        assert recording.counts == counts
        assert recording.sizes == sizes


def test_a_group_of_casts_is_not_prefetched_before_its_casts_exist() -> None:
    """Rematerialized under mixed precision and a fully sharded plan, a layer's bf16 casts
    are made again in the backward, right before the layer's backward reads them: the group
    before cannot prefetch their gather, which starts where they are first read. The report
    says so, as the lowering does (it once started them where the group before was waited
    for, before the casts existed)."""
    torch.manual_seed(0)
    config = GPTConfig(n_layer=2, n_embd=16, n_head=2, vocab_size=32, block_size=8)
    tokens = torch.randint(0, 32, (4, 8))
    policy = fxpar.MixedPrecision(torch.bfloat16, torch.float32)
    program = fxpar.capture(
        GPT(config), (tokens,), gpt_loss, example_targets=(tokens,), mixed_precision=policy
    )
    options = PlanOptions(remat="all")
    plan = plan_program(program, Cluster((2,)), manual=plans.fully_sharded, options=options)
    records = plan_collectives(plan.program, plan.cluster)
    assert records == fxpar.lower(plan).collectives()
    nodes = {node.name: node for node in plan.program.graph.nodes}
    order = {node: position for position, node in enumerate(plan.program.graph.nodes)}
    gathers = [r for r in records if r.kind == "all_gather"]
    recast = [
        r for r in gathers if r.phase is ir.Phase.BACKWARD and nodes[r.tensor].op != "placeholder"
    ]
    assert recast, "the test needs gathers of casts made in the backward"
    for record in gathers:
        assert order[nodes[record.consumer]] > order[nodes[record.tensor]], record
