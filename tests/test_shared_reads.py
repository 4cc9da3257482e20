"""A value converted once for all its readers is priced once (fxpar.planning.shared_reads)."""

from __future__ import annotations

import itertools
from unittest import mock

import numpy as np
import pytest
import torch
from torch import nn

import fxpar
from fxpar import plans
from fxpar.cluster import Cluster, CollectiveLink
from fxpar.planning import problem as problem_module
from fxpar.planning.plan import ChosenStrategies
from fxpar.planning.shared_reads import Read, SharedRead, merge, share_reads
from fxpar.planning.step_time import price_schedule
from fxpar.solvers.exhaustive import ExhaustiveSolver
from fxpar.solvers.ilp import ILPSolver
from fxpar.solvers.problem import SHARED_READ, Edge, IntraOpProblem


def _classifier() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 10))
    return model, torch.randn(64, 32), torch.randint(0, 10, (64,))


# Slow compute and collectives as gloo's on four processes sharing two cores: latency-bound,
# an all-gather dearer than an all-reduce (fxpar calibrate, world 4, on the development box).
SLOW = Cluster(
    (4,), flops=1e7, memory_bandwidth=1e8, latency=(5e-3,), bandwidth=(1e9,),
    collective_links=(CollectiveLink("all_gather", 0, 8e-3, 5e8),),
)  # fmt: skip


def _plans(shared: bool) -> tuple[fxpar.Plan, fxpar.Plan]:
    model, x, y = _classifier()
    with mock.patch.object(problem_module, "shared_on", lambda *_: shared):
        return tuple(  # type: ignore[return-value]
            fxpar.plan(
                model,
                SLOW,
                (x,),
                nn.functional.cross_entropy,
                example_targets=(y,),
                manual=manual,
            )
            for manual in (None, plans.data_parallel)
        )


def test_pricing_each_reader_picked_a_plan_the_lowering_runs_slower() -> None:
    """Charged per reader, the ILP prefers a plan whose conversions are not shared over data
    parallelism, although the lowering runs data parallelism faster; charged once per value
    and layout, as lowered, it picks a plan as fast as data parallelism. (Steps of the ops
    and the lowered collectives, what the objective prices: the optimizer's update and the
    buckets' copies, which it leaves out, are not about how conversions are charged.)"""

    def step(plan: fxpar.Plan) -> float:
        priced = price_schedule(plan.program, plan.cluster)
        return priced.step - priced.copies

    ilp, dp = _plans(shared=False)
    assert ilp.solution.objective < dp.solution.objective
    assert step(ilp) > step(dp) * (1 + 1e-6)
    ilp, dp = _plans(shared=True)
    assert ilp.solution.objective <= dp.solution.objective * (1 + 1e-9)
    assert step(ilp) == pytest.approx(step(dp), rel=1e-9)


def test_the_problem_charges_a_shared_conversion_once_for_every_plan() -> None:
    """For every plan the auxiliary decisions complete, the problem's objective is the
    per-reader price less the conversions the other readers of each value share."""
    ilp, _ = _plans(shared=True)
    chosen = ilp.program.require(ChosenStrategies)
    problem, layout = chosen.problem, chosen.layout
    assert layout.shared_reads and ilp.stats["shared_reads"] == len(layout.shared_reads)
    rng = np.random.default_rng(0)
    units = problem.num_nodes - len(layout.shared_reads)
    for _ in range(20):
        choice = tuple(int(rng.integers(len(problem.node_costs[v]))) for v in range(units))
        full = layout.completed(choice)
        # Turning any auxiliary decision the other way never makes the plan cheaper.
        for a in range(units, problem.num_nodes):
            flipped = list(full)
            flipped[a] = 1 - flipped[a]
            assert problem.objective(flipped) >= problem.objective(full) - 1e-15


def test_share_reads_moves_each_common_conversion_to_one_decision() -> None:
    """Two readers that may both want layout 7, one that alone wants layout 9: the layout-7
    columns leave the readers' edges for one decision, the layout-9 column stays."""
    r = np.array([[0.0, 2.0], [3.0, 0.0]])  # producer strategy s -> columns: layouts 7 and 9
    reads = [Read(1, r.copy(), (7, 9)), Read(2, r[:, :1].copy(), (7,))]
    matrices, shared = share_reads(0, reads)
    assert [m.tolist() for m in matrices] == [[[0.0, 2.0], [0.0, 0.0]], [[0.0], [0.0]]]
    (decision,) = shared
    assert decision.conversion == (0.0, 3.0) and decision.penalty == 3.0
    assert decision.converted((0, 0, 1)) == 1 and decision.converted((0, 1, 1)) == 0
    # As a problem: exhaustive search over the readers' and the decision's choices agrees
    # with the per-reader matrices where at most one reader wants layout 7, and charges 3
    # once where both do.
    edges = [Edge.of_matrix(0, 1, matrices[0]), Edge.of_matrix(0, 2, matrices[1])]
    edges += [Edge.of_matrix(a, b, m) for a, b, m in decision.edges(3, (2, 2, 1))]
    problem = IntraOpProblem(((0.0, 0.0), (0.0, 0.0), (0.0,), (0.0, 0.0)),
                             ((0.0, 1.0), (0.0, 0.0), (0.0,), (0.0, 0.0)), tuple(edges),
                             memory_limit=0.5)  # fmt: skip
    best = ExhaustiveSolver().solve(problem)
    assert best.choice[0] == 0 and best.objective == 0.0  # producer takes layout 7 itself
    forced = IntraOpProblem(((5.0, 0.0), (0.0, 0.0), (0.0,), (0.0, 0.0)), problem.node_memory,
                            tuple(edges))  # fmt: skip
    for solver in (ExhaustiveSolver(), ILPSolver()):
        solution = solver.solve(forced)
        assert solution.choice[:3] == (1, 0, 0) and solution.objective == pytest.approx(3.0)


def test_merge_counts_repeated_decisions() -> None:
    one = SharedRead(0, ((1, frozenset({0}), 1.0), (2, frozenset({1}), 1.0)), (0.0, 2.0), 2.0)
    (merged,) = merge([one, one, one])
    assert merged.count == 3
    into, *_ = merged.edges(3, (2, 2, 2))
    assert into[2][1].tolist() == [0.0, 6.0]


@pytest.mark.parametrize("seed", range(12))
def test_random_shared_reads_solve_to_the_one_conversion_per_layout_optimum(seed: int) -> None:
    """A producer whose value three readers read, each strategy of a reader requiring one of
    three layouts, and an edge between two readers: over every plan, what the lowering runs
    (each layout some reader requires converted once, at the producer's strategy's price) has
    the optimum that the ILP (presolve off: the problem has shared-read decisions) and the
    exhaustive search find on the problem with the auxiliary decisions."""
    rng = np.random.default_rng(seed)
    producer, readers, layouts = 3, (3, 2, 3), 3
    conversion = rng.uniform(0, 1, (producer, layouts)) * (
        rng.uniform(0, 1, (producer, layouts)) > 0.2
    )
    required = [tuple(int(x) for x in rng.integers(0, layouts, k)) for k in readers]
    costs = [tuple(rng.uniform(0, 0.5, producer))]
    costs += [tuple(rng.uniform(0, 0.5, k)) for k in readers]
    between = rng.uniform(0, 0.5, (readers[0], readers[1]))

    def lowered(plan: tuple[int, ...]) -> float:
        s, *ts = plan
        needed = {required[r][t] for r, t in enumerate(ts)}
        total = sum(costs[v][c] for v, c in enumerate(plan)) + between[ts[0], ts[1]]
        return total + sum(conversion[s, layout] for layout in needed)

    plans_ = itertools.product(range(producer), *(range(k) for k in readers))
    best = min(lowered(plan) for plan in plans_)
    reads = [Read(1 + r, conversion[:, list(required[r])], required[r]) for r in range(3)]
    matrices, shared = share_reads(0, reads)
    sizes = (producer, *readers, *(2,) * len(shared))
    edges = [Edge.of_matrix(0, 1 + r, m) for r, m in enumerate(matrices) if m.any()]
    edges.append(Edge.of_matrix(1, 2, between))
    for index, decision in enumerate(shared):
        edges += [Edge.of_matrix(a, b, m) for a, b, m in decision.edges(4 + index, sizes)]
    problem = IntraOpProblem(
        tuple(costs) + ((0.0, 0.0),) * len(shared),
        tuple((0.0,) * k for k in sizes),
        tuple(edges),
        kinds=("aten.mm.default",) * 4 + (SHARED_READ,) * len(shared),
    )
    for solver in (ILPSolver(), ExhaustiveSolver()):
        solution = solver.solve(problem)
        assert solution.objective == pytest.approx(best, rel=1e-9, abs=1e-12)
        assert lowered(solution.choice[:4]) == pytest.approx(best, rel=1e-9, abs=1e-12)
