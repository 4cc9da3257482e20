"""The automatic plan is the optimum of the cost model, not of a smaller stand-in problem.

Every reduction between the graph and HiGHS must keep the optimum: merged repeated layers, the
ILP's eliminations (exact coarsening), its dominance and memory pruning. Checked against
independent references: exhaustive search over every plan of the whole problem on tiny graphs,
the ILP on the whole problem (no merged layers, no eliminations) on random models and meshes,
and every hand-written plan, which the ILP may never lose to.
"""

from __future__ import annotations

import functools
import math
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fxpar
from fxpar import plans
from fxpar.cluster import Cluster
from fxpar.errors import FxparError
from fxpar.models import GPT, GPTConfig, gpt_loss
from fxpar.passes import plan_program, prepare_for_planning
from fxpar.planning.plan import score
from fxpar.planning.problem import PlanOptions, build_problem
from fxpar.solvers import ilp_model
from fxpar.solvers.exhaustive import ExhaustiveSolver
from fxpar.solvers.ilp import ILPSolver
from fxpar.solvers.problem import Edge, IntraOpProblem
from fxpar.testing import strategies as fst

EXACT = PlanOptions(dedup_layers=False, manual_starts=False)
"""The whole problem: no merged layers, no hand-written starting plans."""


def same(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-15)


def without_eliminations() -> mock._patch:  # type: ignore[type-arg]
    """The ILP with reduction 6 (elimination) turned off: nothing is ever eliminated."""
    return mock.patch.object(ilp_model, "_eliminate", lambda *args: ([], 0.0))


MANUAL = {
    "replicated": plans.replicated,
    "data_parallel": plans.data_parallel,
    "fully_sharded": plans.fully_sharded,
    "tensor_parallel": plans.tensor_parallel,
}


@st.composite
def tiny_models(draw: st.DrawFn) -> tuple[nn.Module, torch.Tensor]:
    """A linear with or without a bias and an activation: small enough that exhaustive search
    over every plan of the whole problem (11 to 14 nodes, up to 4 * 10**7 plans) is possible."""
    width = draw(st.sampled_from((4, 8)))
    activation = draw(st.sampled_from(([], [nn.Tanh()], [nn.ReLU()])))
    layers = [nn.Linear(8, width, bias=not activation and draw(st.booleans())), *activation]
    torch.manual_seed(draw(st.integers(0, 2**16)))
    batch = draw(st.sampled_from((2, 8, 64)))
    return nn.Sequential(*layers), torch.randn(batch, 8)


@settings(max_examples=10, deadline=None)
@given(tiny_models(), st.sampled_from([Cluster((2,)), Cluster.preset("h100", (2,))]))
def test_the_plan_is_the_exhaustive_optimum_of_the_whole_problem(
    case: tuple[nn.Module, torch.Tensor], cluster: Cluster
) -> None:
    model, x = case
    program = fxpar.capture(model, (x,), lambda y: y.sum())
    prepared = prepare_for_planning(program, cluster)
    whole, _ = build_problem(prepared, cluster, EXACT)
    best = ExhaustiveSolver(max_combinations=4 * 10**7).solve(whole).objective
    plan = plan_program(program, cluster)
    assert same(score(plan), best)
    assert same(plan.solution.objective, best)


def _whole_problem_optimum(program: fxpar.Program, cluster: Cluster) -> float:
    prepared = prepare_for_planning(program, cluster)
    whole, _ = build_problem(prepared, cluster, EXACT)
    with without_eliminations():
        # No 30 s wall-clock limit on the reference: on a busy machine HiGHS may need longer to
        # prove the optimum of the whole problem, and a stopped reference is no optimum.
        solution = ILPSolver(time_limit=600.0).solve(whole)
    assert solution.status == "optimal", solution
    return solution.objective


@settings(max_examples=12, deadline=None)
@given(case=fst.models(), cluster=fst.clusters(((2,), (4,), (2, 2))))
def test_merged_layers_and_eliminations_keep_the_optimum(
    case: fst.ModelCase, cluster: Cluster
) -> None:
    captured = fxpar.capture(case.model, case.inputs, case.loss_fn, example_targets=case.targets)

    def capture() -> fxpar.Program:
        # Planning annotates the Program it is given: each plan starts from an untouched copy
        # of the one capture (Program.copy: a few ms, where a capture takes most of a second).
        return captured.copy()

    expected = _whole_problem_optimum(capture(), cluster)
    plan = plan_program(capture(), cluster)
    assert same(score(plan), expected)
    for name, manual in MANUAL.items():
        try:
            written = plan_program(capture(), cluster, manual=manual)
        except FxparError:
            continue  # e.g. a batch the mesh does not divide
        assert score(plan) <= score(written) * (1 + 1e-6), name


@pytest.mark.parametrize("mesh", [(2,), (2, 2)])
def test_gpt_plan_beats_coarsening_and_every_manual_plan(mesh: tuple[int, ...]) -> None:
    """The case the follower coarsening got wrong: fxpar's own GPT, where a follower shards a
    replicated value for free and leaves its consumers to gather it back. The default plan is
    the optimum of the whole problem; the coarsened one (still available) costs more."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=64, n_head=4, vocab_size=128, block_size=32))
    tokens = torch.randint(0, 128, (8, 32))
    cluster = Cluster.preset("h100", mesh)

    captured = fxpar.capture(model, (tokens,), gpt_loss, example_targets=(tokens,))

    def capture() -> fxpar.Program:
        return captured.copy()  # as above: planning annotates the Program it is given

    plan = plan_program(capture(), cluster)
    assert same(score(plan), _whole_problem_optimum(capture(), cluster))
    coarse = plan_program(capture(), cluster, options=PlanOptions(coarsen=True))
    assert score(coarse) > score(plan) * 1.01
    for name, manual in MANUAL.items():
        written = plan_program(capture(), cluster, manual=manual)
        assert score(plan) <= score(written) * (1 + 1e-6), name


def _chain(costs: list[list[float]], edges: list[list[list[float]]]) -> IntraOpProblem:
    return IntraOpProblem(
        tuple(map(tuple, costs)),
        tuple(tuple(0.0 for _ in c) for c in costs),
        tuple(Edge(i, i + 1, tuple(map(tuple, m))) for i, m in enumerate(edges)),
    )


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_eliminating_chains_and_trees_keeps_the_exhaustive_optimum(data: st.DataObject) -> None:
    """Reduction 6 on problems made of what it eliminates: chains with side branches, where
    every node meets at most two decisions at some point of the elimination."""
    count = data.draw(st.integers(2, 7))
    sizes = data.draw(st.lists(st.integers(2, 4), min_size=count, max_size=count))
    value = st.floats(0, 10, allow_nan=False).map(lambda v: round(v, 3))
    costs = [data.draw(st.lists(value, min_size=k, max_size=k)) for k in sizes]
    edges = []
    for u in range(1, count):
        parent = data.draw(st.integers(max(0, u - 2), u - 1))  # a tree: chains and branches
        rows = [data.draw(st.lists(value, min_size=sizes[u], max_size=sizes[u])) for _ in
                range(sizes[parent])]  # fmt: skip
        edges.append(Edge(parent, u, tuple(map(tuple, rows))))
    problem = IntraOpProblem(
        tuple(map(tuple, costs)), tuple(tuple(0.0 for _ in c) for c in costs), tuple(edges)
    )
    reduced = ilp_model.reduce_problem(problem)
    assert not reduced.free, "a tree is eliminated down to nothing"
    solution = ILPSolver().solve(problem)
    expected = ExhaustiveSolver().solve(problem).objective
    assert same(solution.objective, expected)
    assert solution.objective == pytest.approx(problem.objective(solution.choice))


def test_nodes_whose_memory_differs_are_kept_when_memory_binds() -> None:
    """Elimination picks the cheapest answer, which may not be the smallest: under a memory
    limit that binds it keeps those nodes as decisions, and eliminates only the others."""
    costs = [[0.0, 0.5], [1.0, 5.0], [0.0, 0.0]]
    memory = ((2.0, 1.0), (3.0, 1.0), (1.0, 1.0))
    base = _chain(costs, [[[0.0, 1.0], [1.0, 0.0]], [[0.0, 1.0], [1.0, 0.0]]])
    loose = IntraOpProblem(base.node_costs, memory, base.edges, 100.0)
    tight = IntraOpProblem(base.node_costs, memory, base.edges, 5.0)
    assert not ilp_model.reduce_problem(loose).free
    assert ilp_model.reduce_problem(tight).free == [0, 1]
    for problem in (loose, tight):
        solution = ILPSolver().solve(problem)
        assert same(solution.objective, ExhaustiveSolver().solve(problem).objective)
    assert ILPSolver().solve(tight).choice == (1, 0, 0)


def test_the_ilp_never_answers_worse_than_its_starting_plans() -> None:
    """Stopped at once by its time limit, the ILP still answers with the cheapest starting plan
    that fits, and a finite gap."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=64, n_head=4, vocab_size=128, block_size=32))
    tokens = torch.randint(0, 128, (8, 32))
    cluster = Cluster.preset("h100", (2, 2))
    program = fxpar.capture(model, (tokens,), gpt_loss, example_targets=(tokens,))
    solver = ILPSolver(time_limit=1e-9, warm_start=False)
    with without_eliminations(), mock.patch.object(ilp_model, "_prune_dominated", lambda p, c: c):
        plan = plan_program(program, cluster, solver=solver)
    problem = plan.problem
    assert problem.starts, "the planner gives the solver the hand-written plans"
    best = min(problem.objective(start) for start in problem.starts)
    assert plan.solution.objective <= best
    assert math.isfinite(plan.solution.gap)


@pytest.mark.parametrize("solver", [functools.partial(ILPSolver), ExhaustiveSolver])
def test_starts_are_plain_data_that_solvers_may_ignore(solver: type) -> None:
    problem = _chain([[1.0, 0.0], [0.0, 1.0]], [[[0.0, 3.0], [3.0, 0.0]]])
    with_start = IntraOpProblem(
        problem.node_costs, problem.node_memory, problem.edges, starts=((1, 1),)
    )
    assert with_start == problem  # starts are not part of the problem's identity
    assert same(solver().solve(with_start).objective, 1.0)


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_elimination_under_a_binding_memory_limit_keeps_the_exhaustive_optimum(
    data: st.DataObject,
) -> None:
    """Trees whose nodes either keep the same memory whatever they choose (eliminated) or not
    (kept), under a limit between the least and the most memory: the branch and bound over the
    kept nodes, with the eliminated ones read back, finds the exhaustive optimum."""
    count = data.draw(st.integers(3, 7))
    sizes = data.draw(st.lists(st.integers(2, 3), min_size=count, max_size=count))
    value = st.integers(0, 20).map(float)
    costs = [data.draw(st.lists(value, min_size=k, max_size=k)) for k in sizes]
    memory = []
    for k in sizes:
        if data.draw(st.booleans()):
            memory.append(tuple([float(data.draw(st.integers(1, 5)))] * k))
        else:
            memory.append(tuple(data.draw(st.lists(st.integers(1, 9).map(float), min_size=k,
                                                   max_size=k))))  # fmt: skip
    edges = []
    for u in range(1, count):
        parent = data.draw(st.integers(0, u - 1))
        rows = [data.draw(st.lists(value, min_size=sizes[u], max_size=sizes[u])) for _ in
                range(sizes[parent])]  # fmt: skip
        edges.append(Edge(parent, u, tuple(map(tuple, rows))))
    least = sum(min(m) for m in memory)
    most = sum(max(m) for m in memory)
    limit = least + data.draw(st.floats(0.0, 1.0)) * (most - least)
    problem = IntraOpProblem(tuple(map(tuple, costs)), tuple(memory), tuple(edges), limit)
    solution = ILPSolver().solve(problem)
    expected = ExhaustiveSolver().solve(problem)
    assert problem.memory(solution.choice) <= limit
    assert same(solution.objective, expected.objective)
