"""AxisDescent: intra-op problems of meshes of three or more axes, an axis or two at a time.

It is exact where the costs separate by mesh axis (against exhaustive search); otherwise it
is never worse than its starting plans and always within memory. ILPSolver runs it first on
meshes of three or more axes and answers with its plan alone above its size bound. Its plan
of a GPT on a (2, 2, 2) mesh trains like one device."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Replicate, Shard

import fxpar
from fxpar.errors import FxparError
from fxpar.models import GPT, GPTConfig, gpt_loss
from fxpar.planning.peak_memory import peak_memory
from fxpar.sharding import Strategy
from fxpar.solvers import Edge, ExhaustiveSolver, GreedySolver, ILPSolver, IntraOpProblem
from fxpar.solvers.descent import AxisDescent
from fxpar.testing import assert_equivalent

PLACEMENTS = (Replicate(), Shard(0), Shard(1))
EXACT = ILPSolver(largest=None)


@st.composite
def axis_problems(draw: st.DrawFn, *, separable: bool) -> IntraOpProblem:
    """A problem on a (2, 2, 2) mesh whose strategies are every combination of ``options``
    placements per axis. Separable: every cost is a sum of one term per axis (and memory is
    unbounded); else each strategy and pair gets a cost of its own on top, and memory binds."""
    ndim = 3
    options = draw(st.integers(2, 3))
    nodes = draw(st.integers(2, 4 if options == 2 else 3))
    combos = list(itertools.product(range(options), repeat=ndim))
    strategies = tuple(
        tuple(Strategy((tuple(PLACEMENTS[p] for p in combo),), ()) for combo in combos)
        for _ in range(nodes)
    )
    numbers = st.integers(0, 20).map(float)

    def table(*shape: int) -> list:
        if not shape:
            return draw(numbers)
        return [table(*shape[1:]) for _ in range(shape[0])]

    node_costs, node_memory = [], []
    for _ in range(nodes):
        per_axis = table(ndim, options)
        extra = table(len(combos)) if not separable else [0.0] * len(combos)
        by_axis = [sum(per_axis[a][c[a]] for a in range(ndim)) for c in combos]
        node_costs.append(tuple(x + e for x, e in zip(by_axis, extra, strict=True)))
        node_memory.append(tuple(table(len(combos))))
    pairs = [(v - 1, v) for v in range(1, nodes)]
    if nodes > 2 and draw(st.booleans()):
        pairs.append((0, nodes - 1))
    edges = []
    for u, v in pairs:
        per_axis = table(ndim, options, options)
        costs = tuple(
            tuple(
                sum(per_axis[a][s[a]][t[a]] for a in range(ndim))
                + (0.0 if separable else draw(numbers))
                for t in combos
            )
            for s in combos
        )
        edges.append(Edge(u, v, costs))
    least = sum(min(m) for m in node_memory)
    most = sum(max(m) for m in node_memory)
    limit = None if separable else least + draw(st.floats(0.0, 1.0)) * (most - least)
    starts = tuple(
        tuple(draw(st.integers(0, len(combos) - 1)) for _ in range(nodes))
        for _ in range(draw(st.integers(0, 2)))
    )
    return IntraOpProblem(
        tuple(node_costs), tuple(node_memory), tuple(edges), limit,
        strategies=strategies, mesh_shape=(2, 2, 2), starts=starts,
    )  # fmt: skip


@settings(max_examples=15, deadline=None)
@given(axis_problems(separable=True))
def test_descent_is_exact_where_costs_separate_by_axis(problem: IntraOpProblem) -> None:
    found = AxisDescent(EXACT).solve(problem)
    best = ExhaustiveSolver().solve(problem)
    assert found.objective == pytest.approx(best.objective, abs=1e-9)
    assert found.objective == pytest.approx(problem.objective(found.choice))
    assert found.solver == "axis-descent" and found.status == "feasible"


@settings(max_examples=15, deadline=None)
@given(axis_problems(separable=False))
def test_descent_fits_and_never_loses_to_its_starting_plans(problem: IntraOpProblem) -> None:
    found = AxisDescent(EXACT).solve(problem)
    best = ExhaustiveSolver().solve(problem)
    assert problem.memory(found.choice) <= problem.memory_limit
    assert found.objective >= best.objective - 1e-9
    greedy = GreedySolver().solve(problem).choice
    for plan in (*problem.starts, greedy):
        if problem.memory(plan) <= problem.memory_limit:
            assert found.objective <= problem.objective(plan) + 1e-9
    assert 0.0 <= found.gap <= 1.0
    # ILPSolver runs the descent first on three axes, then proves its model from that plan.
    solved = ILPSolver().solve(problem)
    assert solved.solver == "ilp" and solved.status == "optimal"
    assert solved.objective == pytest.approx(best.objective, abs=1e-9)


def separable_problem(mesh: tuple[int, ...]) -> IntraOpProblem:
    """Two nodes, each on every combination of R and S(0) per axis, replicating costing 1 per
    axis and resharding 1 per axis that differs: the optimum shards everything on every axis."""
    combos = list(itertools.product((Replicate(), Shard(0)), repeat=len(mesh)))
    strategies = tuple(tuple(Strategy((c,), ()) for c in combos) for _ in range(2))
    costs = tuple(float(sum(p == Replicate() for p in c)) for c in combos)

    def differ(s: tuple, t: tuple) -> float:
        return float(sum(a != b for a, b in zip(s, t, strict=True)))

    moves = tuple(tuple(differ(s, t) for t in combos) for s in combos)
    return IntraOpProblem(
        (costs, costs), ((0.0,) * len(combos),) * 2, (Edge(0, 1, moves),), None,
        strategies=strategies, mesh_shape=mesh,
    )  # fmt: skip


def test_ilp_hands_only_large_problems_on_three_or_more_axes_to_the_descent() -> None:
    three_d = separable_problem((2, 2, 2))
    assert ILPSolver().solve(three_d).solver == "ilp"  # small: one model
    handed = ILPSolver(largest=0).solve(three_d)
    assert handed.solver == "axis-descent"
    assert handed.objective == 0.0 and handed.choice == (len(three_d.node_costs[0]) - 1,) * 2
    assert ILPSolver(largest=0).solve(separable_problem((2, 2))).solver == "ilp"


def test_descent_gives_what_it_cannot_split_to_its_inner_solver() -> None:
    two_d = separable_problem((2, 2))
    assert AxisDescent(EXACT).solve(two_d).solver == "ilp"
    bare = IntraOpProblem(two_d.node_costs, two_d.node_memory, two_d.edges, mesh_shape=(2, 2, 2))
    assert AxisDescent(EXACT).solve(bare).solver == "ilp"  # no strategies to read axes from


def test_descent_stops_at_its_time_limit_with_its_first_plan() -> None:
    problem = separable_problem((2, 2, 2))
    worst = (0,) * problem.num_nodes  # all replicated: the only start, and a poor one
    problem = dataclasses.replace(problem, starts=(worst,), node_memory=((0.0,) + (1.0,) * 7,) * 2,
                                  memory_limit=0.0)  # fmt: skip
    found = AxisDescent(EXACT, time_limit=-1.0).solve(problem)
    assert found.status == "time_limit" and found.choice == worst
    assert AxisDescent(EXACT).solve(problem).choice == worst  # the only plan that fits


def test_descent_refuses_an_inner_solver_without_solve() -> None:
    with pytest.raises(FxparError, match="inner solver"):
        AxisDescent(lambda problem: None)  # type: ignore[arg-type]


def test_a_gpt_planned_by_descent_on_a_3d_mesh_trains_like_one_device() -> None:
    torch.manual_seed(0)
    config = GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=16)
    model = GPT(config)
    tokens = torch.randint(0, config.vocab_size, (8, 8))
    targets = torch.randint(0, config.vocab_size, (8, 8))
    # 224 KiB per device: the fastest plan holds 548 KiB at its peak (AdamW's state included),
    # so memory binds and the plan splits weights on two axes of the three.
    cluster = fxpar.Cluster((2, 2, 2), memory=224 * 2**10)
    plan = fxpar.plan(
        model, cluster, (tokens,), gpt_loss, example_targets=(targets,),
        solver=ILPSolver(largest=0),
    )  # fmt: skip
    assert plan.solution.solver == "axis-descent"
    summary = plan.layout_summary()
    assert summary.count("tensor parallel") == 2 and "data parallel" in summary, summary
    states = plan.options.optimizer_states
    assert peak_memory(plan.program, cluster, optimizer_states=states).peak_bytes <= cluster.memory
    flat = plan.program.flat_inputs(model, tokens, targets)
    assert_equivalent(fxpar.lower(plan), flat)
