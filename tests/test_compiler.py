"""The compiler's spine: fxpar.plan and fxpar.compile run exactly the pass list they are
given, so a user's pass changes the plan that is trained; solvers see what each choice stands
for, so a policy about what to shard is a solver; manual plans are their own argument."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch
from torch.distributed.tensor import Replicate

import fxpar
from fxpar import ir
from fxpar.errors import FxparError
from fxpar.ir.program import Program
from fxpar.models import GPT, GPTConfig, gpt_loss
from fxpar.passes import (
    ApplyManualPlan,
    Pass,
    SolveStrategies,
    default_passes,
    for_compile,
)
from fxpar.planning.problem import PlanOptions
from fxpar.runtime.launch import spawn
from fxpar.sharding import Sharding, Strategies
from fxpar.solvers import ExhaustiveSolver, ILPSolver, IntraOpProblem, IntraOpSolution
from fxpar.testing.strategies import splitting_cluster

CONFIG = GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=8, bias=False)
STEPS = 3


@dataclass(frozen=True)
class ReplicateParameters(Pass):
    """A user pass: leaves every parameter only its replicated candidate, so whatever chooses
    next keeps each parameter whole on every device (data parallelism, by construction)."""

    name = "replicate-parameters"

    def run(self, program: Program) -> Program:
        placeholders = program.placeholders()
        for name in program.signature.parameters:
            node = placeholders[name]
            strategies = ir.require(node, Strategies)
            kept = tuple(
                s for s in strategies.candidates if all(p == Replicate() for p in s.outputs[0])
            )
            ir.annotate(node, replace(strategies, candidates=kept))
        return program


def _batch(seed: int = 0) -> torch.Tensor:
    return torch.randint(
        0, CONFIG.vocab_size, (4, 8), generator=torch.Generator().manual_seed(seed)
    )


def _sharded_parameters(plan: fxpar.Plan) -> list[str]:
    placeholders = plan.program.placeholders()
    return [
        name
        for name in plan.program.signature.parameters
        if ir.require(placeholders[name], Sharding).strategy.outputs[0] != (Replicate(),)
    ]


def _plan(**kwargs: object) -> fxpar.Plan:
    tokens = _batch()
    return fxpar.plan(
        GPT(CONFIG), splitting_cluster((2,)), (tokens,), gpt_loss,
        example_targets=(tokens,), **kwargs,  # type: ignore[arg-type]
    )  # fmt: skip


def test_the_default_pass_list_names_every_step_in_order() -> None:
    assert default_passes().names == (
        "canonicalize",
        "rematerialize",
        "annotate-cost",
        "annotate-strategies",
        "choose-strategies",
    )
    assert isinstance(default_passes().passes[-1], SolveStrategies)
    manual = default_passes(manual=fxpar.plans.data_parallel).passes[-1]
    assert isinstance(manual, ApplyManualPlan) and manual.name == "choose-strategies"


def test_a_user_pass_given_to_plan_changes_the_plan() -> None:
    default = _plan()
    assert _sharded_parameters(default), "the ILP shards some parameter of this model"
    passes = default_passes().insert_before("choose-strategies", ReplicateParameters())
    mine = _plan(passes=passes)
    assert _sharded_parameters(mine) == []
    # The same cost model prices both: restricting the choice cannot make it cheaper.
    assert mine.solution.objective >= default.solution.objective * (1 - 1e-9)


def test_passes_and_the_arguments_that_build_a_pipeline_exclude_each_other() -> None:
    with pytest.raises(FxparError, match="solver would be ignored"):
        _plan(passes=default_passes(), solver=ILPSolver())
    with pytest.raises(FxparError, match="pins= would be ignored"):
        _plan(passes=default_passes(), pins={"wte.weight": (Replicate(),)})
    with pytest.raises(FxparError, match="not both"):
        default_passes(solver=ILPSolver(), manual=fxpar.plans.data_parallel)


def test_a_manual_plan_passed_as_a_solver_is_refused_with_the_way_out() -> None:
    with pytest.raises(FxparError, match="looks like a manual plan: pass it as manual="):
        _plan(solver=fxpar.plans.data_parallel)


def test_a_manual_plan_in_the_pipeline_equals_the_manual_argument() -> None:
    by_argument = _plan(manual=fxpar.plans.tensor_parallel)
    passes = default_passes().replace(
        "choose-strategies", ApplyManualPlan(fxpar.plans.tensor_parallel)
    )
    by_pass = _plan(passes=passes)
    assert by_pass.solution.choice == by_argument.solution.choice
    assert by_pass.solution.objective == by_argument.solution.objective


def test_a_manual_plan_sees_the_candidates_a_user_pass_left() -> None:
    """Inside the pipeline a manual plan does not annotate the candidates again, so an edit a
    user pass made before the choice holds: data parallelism fits parameters kept whole, and
    tensor parallelism, which splits them, is refused naming a parameter it split."""
    whole = default_passes().insert_before("choose-strategies", ReplicateParameters())
    data = _plan(
        passes=whole.replace("choose-strategies", ApplyManualPlan(fxpar.plans.data_parallel))
    )
    assert _sharded_parameters(data) == []
    tensor = whole.replace("choose-strategies", ApplyManualPlan(fxpar.plans.tensor_parallel))
    with pytest.raises(FxparError, match=r"tensor_parallel' gave node .* not among its candidates"):
        _plan(passes=tensor)


def test_for_compile_solves_on_rank_zero_and_counts_the_optimizer_state() -> None:
    choose = for_compile(default_passes(), optimizer_states=1).passes[-1]
    assert isinstance(choose, SolveStrategies)
    assert choose.on_rank_zero and choose.options.optimizer_states == 1
    manual = for_compile(default_passes(manual=fxpar.plans.data_parallel), optimizer_states=0)
    assert manual.passes[-1].options.optimizer_states == 0  # type: ignore[attr-defined]
    mine = default_passes().insert_after("annotate-cost", ReplicateParameters())
    assert for_compile(mine).names == mine.names


# -- solvers see what each choice stands for --------------------------------------------------


@dataclass(frozen=True)
class WholeParameters:
    """A policy solver: parameters stay whole on every device; the rest is the ILP's choice.
    It reads only the plain data of the problem (which node is a parameter, which option is
    replicated), restricts those nodes' options and maps the answer back."""

    name: str = "whole-parameters"

    def solve(self, problem: IntraOpProblem) -> IntraOpSolution:
        allowed = [
            [
                option
                for option, strategy in enumerate(problem.strategies[node])
                if kind != "parameter" or all(p == Replicate() for p in strategy.outputs[0])
            ]
            for node, kind in enumerate(problem.kinds)
        ]
        restricted = IntraOpProblem(
            node_costs=tuple(
                tuple(problem.node_costs[v][s] for s in options)
                for v, options in enumerate(allowed)
            ),
            node_memory=tuple(
                tuple(problem.node_memory[v][s] for s in options)
                for v, options in enumerate(allowed)
            ),
            edges=tuple(
                replace(
                    edge,
                    costs=tuple(
                        tuple(edge.costs[s][t] for t in allowed[edge.target])
                        for s in allowed[edge.source]
                    ),
                )
                for edge in problem.edges
            ),
            memory_limit=problem.memory_limit,
        )
        answer = ILPSolver().solve(restricted)
        choice = tuple(allowed[v][s] for v, s in enumerate(answer.choice))
        return replace(answer, choice=choice, solver=self.name)


def test_the_problem_says_what_each_choice_stands_for() -> None:
    plan = _plan()
    problem = plan.problem
    assert len(problem.kinds) == len(problem.strategies) == problem.num_nodes
    assert problem.mesh_shape == (2,)
    for node, options in enumerate(problem.strategies):
        assert len(options) == len(problem.node_costs[node])
    assert problem.kinds.count("parameter") >= 1 and "input" in problem.kinds
    assert any(kind.startswith("aten.") for kind in problem.kinds)
    # The chosen option of every decision is the strategy its graph node carries.
    layout = plan.layout
    for unit_index, unit in enumerate(layout.units):
        node = layout.representative[unit_index]
        chosen = problem.strategies[node][plan.solution.choice[node]]
        assert ir.require(unit.root, Sharding).strategy == chosen


def test_a_policy_is_a_solver_over_plain_data() -> None:
    free = _plan()
    policy = _plan(solver=WholeParameters())
    assert _sharded_parameters(free) and _sharded_parameters(policy) == []
    assert policy.solution.solver == "whole-parameters"
    assert policy.solution.objective >= free.solution.objective * (1 - 1e-9)
    # Same as the ReplicateParameters pass, which restricts the graph instead of the problem.
    passes = default_passes().insert_before("choose-strategies", ReplicateParameters())
    by_pass = _plan(passes=passes)
    assert policy.solution.objective == pytest.approx(by_pass.solution.objective, rel=1e-6)


def test_a_policy_solver_is_exact_on_a_tiny_problem() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8, bias=False), torch.nn.Tanh())
    x = torch.randn(4, 8)
    program = fxpar.capture(model, (x,), lambda y: y.square().mean())
    # Coarsened, so that every plan of the problem can be listed.
    plan = fxpar.passes.plan_program(
        program, fxpar.Cluster((2,)), solver=WholeParameters(), options=PlanOptions(coarsen=True)
    )
    problem = plan.problem
    brute = [
        c
        for c in _all_choices(problem)
        if all(
            kind != "parameter"
            or all(p == Replicate() for p in problem.strategies[v][c[v]].outputs[0])
            for v, kind in enumerate(problem.kinds)
        )
    ]
    best = min(problem.objective(c) for c in brute)
    assert plan.solution.objective == pytest.approx(best, rel=1e-6)
    assert ExhaustiveSolver().solve(problem).objective <= best + 1e-12


def _all_choices(problem: IntraOpProblem) -> list[tuple[int, ...]]:
    choices: list[tuple[int, ...]] = [()]
    for costs in problem.node_costs:
        choices = [(*c, s) for c in choices for s in range(len(costs))]
    return choices


# -- on gloo: the ranks run what the user's pipeline chose ------------------------------------


def _train(rank: int, world_size: int, with_pass: bool) -> dict[str, object]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    passes = default_passes()
    if with_pass:
        passes = passes.insert_before("choose-strategies", ReplicateParameters())
    tokens = _batch()
    parallel = fxpar.compile(
        GPT(CONFIG), splitting_cluster((world_size,)), (tokens,), gpt_loss,
        example_targets=(tokens,), optimizer=fxpar.optim.SGD(lr=0.1), passes=passes,
    )  # fmt: skip
    local = {name: tuple(p.shape) for name, p in parallel.parameters.items()}
    losses = [parallel.step(_batch(s), _batch(s)).item() for s in range(STEPS)]
    return {"local": local, "losses": losses}


def _single_device() -> tuple[dict[str, tuple[int, ...]], list[float]]:
    torch.manual_seed(0)
    model = GPT(CONFIG)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for s in range(STEPS):
        loss = gpt_loss(model(_batch(s)), _batch(s))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return shapes, losses


@pytest.mark.slow
def test_a_user_pass_given_to_compile_changes_what_the_ranks_run() -> None:
    whole, losses = _single_device()
    default = spawn(_train, 2, False, timeout_s=120)
    mine = spawn(_train, 2, True, timeout_s=120)
    # The default plan splits some parameter over the ranks; with the user's pass every rank
    # holds every parameter whole. Both train exactly like one device.
    assert any(default[0]["local"][n] != whole[n] for n in whole)  # type: ignore[index]
    for result in mine:
        assert result["local"] == whole
    for result in default + mine:
        assert result["losses"] == pytest.approx(losses, rel=1e-5)
