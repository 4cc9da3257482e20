"""The ILP chooses whether to dispatch mixture-of-experts tokens by all-to-all.

``SolveStrategies`` solves the problem as it is and once per dispatch variant
(:mod:`fxpar.planning.dispatch_variants`: the experts on an axis, the tokens on it alone or
with data parallelism on the others, every block's nodes offered only their dispatch
strategies) and keeps the cheapest. Where the all-to-all link is fast, HF Mixtral's plan
dispatches its tokens, at the cost of the best variant solved on its own, and trains like one
device; where it is slow, the tokens stay whole. A model without MoE blocks is solved once,
as before. On (2, 2) the variant with data parallelism beside the expert axis is chosen where
compute dominates. The chosen plan survives a plan file, a folded stamped step (replayed on
the whole step) and re-planning the same program on another mesh.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import pytest
import torch
from conftest import eager_step
from torch import nn
from torch.distributed.tensor import Replicate, Shard

import fxpar
from fxpar import ir, plans
from fxpar.cluster import Cluster, CollectiveLink
from fxpar.ir.repeat import StampedLayers, capture_repeated
from fxpar.models import GPT, GPTConfig, gpt_loss
from fxpar.passes import passes_for, plan_program, prepare_for_planning, sharing_gradients
from fxpar.passes.default import load_plan
from fxpar.pipeline import PipelineError, partition, split_program
from fxpar.planning import moe_blocks
from fxpar.planning.dispatch_variants import DispatchVariant, dispatch_variants, planned_variant
from fxpar.planning.problem import PlanOptions, build_problem
from fxpar.rules import default_rules, experts
from fxpar.sharding import Spec, Strategies
from fxpar.solvers.errors import InfeasiblePlanError
from fxpar.solvers.ilp import ILPSolver
from fxpar.solvers.problem import IntraOpProblem, IntraOpSolution
from fxpar.testing import simulate

pytest.importorskip("transformers")
# Before any registry: transformers' grouped products exist once its MoE integration is loaded.
pytest.importorskip("transformers.integrations.moe")
from test_expert_parallel import VOCAB, mixtral, qwen2_moe


def _inputs(batch: int = 4) -> dict[str, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (batch, 8), generator=torch.Generator().manual_seed(3))
    return {"input_ids": tokens, "labels": tokens}


def _cluster(mesh: tuple[int, ...], all_to_all: float, *, flops: float = 1e9) -> Cluster:
    """Devices whose all-reduces, gathers and reduce-scatters run at 100 MB/s, 100 us each,
    and whose all-to-alls run at ``all_to_all`` bytes/s, 1 us each, on every axis."""
    links = tuple(CollectiveLink("all_to_all", a, 1e-6, all_to_all) for a in range(len(mesh)))
    return Cluster(mesh, bandwidth=(1e8,), latency=(1e-4,), flops=flops, collective_links=links)


FAST = 1e11
SLOW = 1e6


def _reference(model: nn.Module, cluster: Cluster, variant: DispatchVariant | None = None) -> float:
    """The ILP's optimum of the problem as built, or (``variant``) of the problem whose MoE
    blocks' nodes have only the strategies ``plans.expert_parallel(dispatch="all_to_all")``
    gives them, experts on ``variant.axis`` and tokens over ``variant.token_axes``."""
    program = prepare_for_planning(fxpar.capture(model, _inputs()), cluster)
    if variant is not None:
        spec: Spec = tuple(
            Shard(0) if a in variant.token_axes else Replicate() for a in range(cluster.ndim)
        )
        for block in moe_blocks.find_blocks(program.graph)[0]:
            planned = moe_blocks.dispatch_strategies(block, variant.axis, spec, {})
            for node, strategy in planned.items():
                ir.annotate(node, Strategies(cluster.mesh_shape, (strategy,)))
    problem, _ = build_problem(program, cluster)
    solution = ILPSolver().solve(problem)
    assert solution.status == "optimal"
    return solution.objective


def _dispatched(plan: fxpar.Plan) -> list[int | None]:
    return [moe_blocks.dispatch_axis(b) for b in moe_blocks.find_blocks(plan.program.graph)[0]]


def _assert_like_eager(model: nn.Module, plan: fxpar.Plan) -> None:
    """The simulated ranks' loss and gradients against eager PyTorch's."""
    inputs = _inputs()
    flat = plan.program.flat_inputs(model, *inputs.values())
    found = simulate(fxpar.lower(plan), flat).result
    loss, grads = eager_step(model, inputs)
    torch.testing.assert_close(found.outputs[0], loss, rtol=1e-4, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(found.gradients[name], grad, rtol=1e-4, atol=1e-6, msg=name)


class Counting:
    """The ILP, keeping the distinct problems it is asked to solve, in the order first asked
    (one asked again with starts, as the planner does where an answer is not proven optimal,
    is the same problem); ``refuse``: the problems (numbered from 1) answered by
    InfeasiblePlanError instead."""

    name = "ilp"

    def __init__(self, refuse: tuple[int, ...] = ()) -> None:
        self.refuse = refuse
        self.problems: list[IntraOpProblem] = []

    def solve(self, problem: IntraOpProblem) -> IntraOpSolution:
        if problem not in self.problems:
            self.problems.append(problem)
        if self.problems.index(problem) + 1 in self.refuse:
            raise InfeasiblePlanError("refused", least_memory=2.0, memory_limit=1.0)
        return ILPSolver().solve(problem)


def test_the_ilp_dispatches_where_the_all_to_all_is_fast(caplog: Any) -> None:
    """With all-to-alls a thousand times faster than the other collectives, every block's
    tokens are dispatched over axis 0; the plan costs exactly the optimum of the problem
    constrained as the manual all-to-all plan constrains it (the smaller of it and the
    unconstrained problem's), each variant's objective is logged, the plan report calls the
    axis expert parallel, and the per-rank programs train like eager PyTorch."""
    model, cluster = mixtral(), _cluster((2,), FAST)
    with caplog.at_level(logging.INFO, logger="fxpar.passes.choose_strategies"):
        plan = plan_program(fxpar.capture(model, _inputs()), cluster)
    assert _dispatched(plan) == [0]
    assert planned_variant(moe_blocks.find_blocks(plan.program.graph)[0]) == DispatchVariant(
        0, (0,)
    )
    whole = _reference(model, cluster)
    dispatched = _reference(model, cluster, DispatchVariant(0, (0,)))
    assert dispatched < whole
    assert plan.solution.objective == pytest.approx(min(whole, dispatched), rel=1e-9)
    logged = [r.getMessage() for r in caplog.records if "s per step" in r.getMessage()]
    assert len(logged) == 2 and logged[0].startswith("no MoE dispatch")
    assert plan.layout_summary().startswith("axis0 (2): expert parallel")
    _assert_like_eager(model, plan)


def test_the_ilp_keeps_the_tokens_whole_where_the_all_to_all_is_slow() -> None:
    """With all-to-alls at 1 MB/s the dispatch variant is solved but loses: no block is
    dispatched and the plan costs the unconstrained problem's optimum."""
    model, cluster = mixtral(), _cluster((2,), SLOW)
    solver = Counting()
    plan = plan_program(fxpar.capture(model, _inputs()), cluster, solver=solver)
    assert len(solver.problems) == 2
    assert _dispatched(plan) == [None]
    dispatched = _reference(model, cluster, DispatchVariant(0, (0,)))
    assert plan.solution.objective == pytest.approx(_reference(model, cluster), rel=1e-9)
    assert plan.solution.objective < dispatched


def test_a_model_without_moe_blocks_is_solved_once_as_before() -> None:
    """A GPT (no routing sort) offers no variant: one problem is solved, and the plan is that
    problem's optimum, choice for choice."""
    config = GPTConfig(n_layer=1, n_embd=16, n_head=2, vocab_size=VOCAB, block_size=8)
    model = GPT(config)
    tokens = torch.randint(0, VOCAB, (4, 8))
    cluster = _cluster((2,), FAST)

    def capture() -> fxpar.Program:
        return fxpar.capture(model, (tokens,), gpt_loss, example_targets=(tokens,))

    solver = Counting()
    plan = plan_program(capture(), cluster, solver=solver)
    assert len(solver.problems) == 1
    program = prepare_for_planning(capture(), cluster)
    assert moe_blocks.find_blocks(program.graph)[0] == []
    assert dispatch_variants([], cluster) == []
    problem, _ = build_problem(program, cluster)
    expected = ILPSolver().solve(problem)
    assert plan.solution.choice == expected.choice
    assert plan.solution.objective == expected.objective


def test_a_variant_with_no_plan_is_left_out() -> None:
    """A variant the solver finds no plan for under the memory limit is skipped: the plan is
    the unconstrained problem's even where dispatching would be cheaper; and where the
    unconstrained problem has none, the variant's plan is taken."""
    model, cluster = mixtral(), _cluster((2,), FAST)
    plan = plan_program(fxpar.capture(model, _inputs()), cluster, solver=Counting(refuse=(2,)))
    assert _dispatched(plan) == [None]
    plan = plan_program(fxpar.capture(model, _inputs()), cluster, solver=Counting(refuse=(1,)))
    assert _dispatched(plan) == [0]
    with pytest.raises(InfeasiblePlanError):
        plan_program(fxpar.capture(model, _inputs()), cluster, solver=Counting(refuse=(1, 2)))


def test_data_parallel_beside_the_expert_axis_is_a_variant_on_2x2() -> None:
    """On (2, 2) the variants are the experts on either axis, the tokens on it alone or on
    both axes; on slow devices (compute dominates) the ILP splits the tokens over both axes,
    at the optimum of that variant solved on its own, the other axis doing data parallelism,
    and the per-rank programs train like eager PyTorch."""
    model, cluster = mixtral(), _cluster((2, 2), FAST, flops=1e7)
    program = prepare_for_planning(fxpar.capture(model, _inputs()), cluster)
    blocks, _ = moe_blocks.find_blocks(program.graph)
    assert dispatch_variants(blocks, cluster) == [
        DispatchVariant(0, (0,)), DispatchVariant(0, (0, 1)),
        DispatchVariant(1, (1,)), DispatchVariant(1, (0, 1)),
    ]  # fmt: skip
    plan = plan_program(fxpar.capture(model, _inputs()), cluster)
    chosen = planned_variant(moe_blocks.find_blocks(plan.program.graph)[0])
    assert chosen is not None and chosen.token_axes == (0, 1)
    expected = _reference(model, cluster, chosen)
    assert plan.solution.objective == pytest.approx(expected, rel=1e-9)
    assert expected < _reference(model, cluster, DispatchVariant(chosen.axis, (chosen.axis,)))
    assert "data parallel" in plan.layout_summary()
    _assert_like_eager(model, plan)


@pytest.mark.parametrize("planner", ["ilp", "expert_parallel(axis=1)"])
def test_a_saved_dispatch_plan_loads_on_a_new_capture(planner: str, tmp_path: Any) -> None:
    """A plan that dispatches, saved and loaded on another capture of the model: every node
    gets its strategy back (the blocks' nodes their dispatch strategies, on the expert axis
    the file's strategies say, though its sort's names two axes), at the same cost. The
    ILP's plan on (2,), and the manual plan with experts on axis 1 of (2, 2)."""
    model = mixtral()
    if planner == "ilp":
        mesh, manual = (2,), None
    else:
        mesh = (2, 2)
        manual = functools.partial(plans.expert_parallel, axis=1, dispatch="all_to_all")
    cluster = _cluster(mesh, FAST)
    plan = plan_program(fxpar.capture(model, _inputs()), cluster, manual=manual)
    expert_axis = 0 if manual is None else 1
    assert _dispatched(plan) == [expert_axis]
    loaded = load_plan(plan.save(tmp_path / "plan.json"), fxpar.capture(model, _inputs()))
    assert _dispatched(loaded) == [expert_axis]
    assert loaded.solution.objective == pytest.approx(plan.solution.objective, rel=1e-9)


def test_a_folded_step_replays_its_dispatch_on_the_whole_step() -> None:
    """A stamped Qwen2-MoE of 7 layers is solved folded and its choice replayed on the whole
    step: every one of the step's 7 blocks is dispatched, at the cost of the step planned
    whole."""
    model, cluster = qwen2_moe(layers=7), _cluster((2,), FAST)
    stamped = capture_repeated(model, _inputs())
    assert stamped.get(StampedLayers) is not None
    plan = plan_program(stamped, cluster)
    assert _dispatched(plan) == [0] * 7
    whole = plan_program(fxpar.capture(model, _inputs()), cluster)
    assert plan.solution.objective == pytest.approx(whole.solution.objective, rel=1e-6)


def test_a_program_dispatched_on_one_mesh_is_planned_afresh_on_another() -> None:
    """Planning the same program again on another mesh starts from the rules' candidates, not
    the first plan's dispatch strategies: it costs what a fresh capture's plan costs there."""
    model = mixtral()
    program = fxpar.capture(model, _inputs())
    first = plan_program(program, _cluster((2,), FAST))
    assert _dispatched(first) == [0]
    cluster = _cluster((2, 2), SLOW)
    again = plan_program(program, cluster)
    fresh = plan_program(fxpar.capture(model, _inputs()), cluster)
    assert _dispatched(again) == _dispatched(fresh) == [None]
    assert again.solution.objective == pytest.approx(fresh.solution.objective, rel=1e-9)


def test_a_pinned_block_node_keeps_its_candidates() -> None:
    """A pin naming a node of a block leaves the variants that would replace its candidates
    untried: the plan keeps the tokens whole even where dispatching is cheaper."""
    model, cluster = mixtral(), _cluster((2,), FAST)
    program = prepare_for_planning(fxpar.capture(model, _inputs()), cluster)
    (block,) = moe_blocks.find_blocks(program.graph)[0]
    pins: dict[str, Spec] = {block.offsets.name: (Replicate(),)}
    solver = Counting()
    options = PlanOptions(pins=pins)
    plan = plan_program(fxpar.capture(model, _inputs()), cluster, solver=solver, options=options)
    assert len(solver.problems) == 1
    assert _dispatched(plan) == [None]


def test_a_registry_without_expert_splits_offers_no_dispatch() -> None:
    """Dispatching splits the experts by expert: a registry whose rules do not
    (``experts.register(split_experts=False)``) gets no variant, so its plan splits no
    expert, however fast the all-to-all."""
    without = default_rules()
    experts.register(without, split_experts=False)
    cluster = _cluster((2,), FAST)
    program = prepare_for_planning(fxpar.capture(mixtral(), _inputs()), cluster, rules=without)
    blocks, _ = moe_blocks.find_blocks(program.graph)
    assert len(blocks) == 1 and dispatch_variants(blocks, cluster) == []
    default = prepare_for_planning(fxpar.capture(mixtral(), _inputs()), cluster)
    assert dispatch_variants(moe_blocks.find_blocks(default.graph)[0], cluster) == [
        DispatchVariant(0, (0,))
    ]


def test_pipeline_stages_are_planned_without_dispatch_and_a_dispatched_stage_is_refused() -> None:
    """A pipeline stage's planner (one of M micro-batches, `sharing_gradients`) does not offer
    the dispatch even where the all-to-all is fast (one solve), and a stage plan that
    dispatches anyway, the manual one, is refused when the step is cut into stages, with what
    to do instead (a dispatched block does not run cut into forward and backward yet)."""
    model, cluster = mixtral(), _cluster((2,), FAST)
    solver = Counting()
    passes = sharing_gradients(passes_for(None, solver=solver), 0.5)
    plan = plan_program(fxpar.capture(model, _inputs()), cluster, passes=passes)
    assert len(solver.problems) == 1 and _dispatched(plan) == [None]

    def manual(program: fxpar.Program, cluster: Cluster) -> fxpar.Program:
        return plans.expert_parallel(program, cluster, axis=0, dispatch="all_to_all")

    planned = plan_program(fxpar.capture(model, _inputs()), cluster, manual=manual)
    with pytest.raises(PipelineError, match="expert_parallel\\(dispatch='all_reduce'\\)"):
        split_program(planned.program, partition(planned.program, ("model.norm",)), remat=False)
