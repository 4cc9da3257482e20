"""Automatic intra-op planning: the problem builder, the regimes a plan must recognise, pins,
explanations, and ILP plans that lower and train like one device."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import fxpar
from fxpar import ir, plans
from fxpar.cluster import Cluster, GiB
from fxpar.errors import FxparError, SymbolicShapeError
from fxpar.lowering import lower
from fxpar.models import GPT, GPTConfig, gpt_loss
from fxpar.passes import plan_program
from fxpar.planning.plan import Plan, score
from fxpar.planning.problem import PlanOptions, build_problem
from fxpar.rules import default_rules, op_call
from fxpar.sharding import Sharding
from fxpar.solvers.errors import InfeasiblePlanError
from fxpar.solvers.exhaustive import ExhaustiveSolver
from fxpar.solvers.greedy import GreedySolver
from fxpar.solvers.ilp import ILPSolver
from fxpar.testing import assert_equivalent

CONFIG = GPTConfig(n_layer=2, n_embd=64, n_head=4, vocab_size=128, block_size=32)


def gpt_program(batch: int, length: int = 16) -> tuple[GPT, fxpar.Program, torch.Tensor]:
    torch.manual_seed(0)
    model = GPT(CONFIG)
    tokens = torch.randint(0, CONFIG.vocab_size, (batch, length))
    return model, fxpar.capture(model, (tokens,), gpt_loss, example_targets=(tokens,)), tokens


def parameter_specs(plan: Plan) -> dict[str, object]:
    placeholders = plan.program.placeholders()
    return {
        name: ir.require(placeholders[name], Sharding).strategy.outputs[0]
        for name in plan.program.signature.parameters
    }


def test_ilp_plan_lowers_and_trains_like_one_device() -> None:
    model, program, tokens = gpt_program(batch=8)
    cluster = Cluster((2, 2))
    chosen = plan_program(program, cluster)
    assert chosen.solution.status == "optimal"
    flat = chosen.program.flat_inputs(model, tokens, tokens)
    assert_equivalent(fxpar.lower(chosen), flat)


# Bandwidth- and compute-bound: on tiny models a realistic per-collective latency dominates,
# and the cheapest plan is the one with the fewest collectives, whatever their size.
THROUGHPUT_BOUND = Cluster((4,), bandwidth=(10e9,), latency=(1e-9,), flops=1e12)


def test_large_batch_with_ample_memory_is_data_parallel() -> None:
    _, program, _ = gpt_program(batch=64, length=32)
    cluster = THROUGHPUT_BOUND
    chosen = plan_program(program, cluster)
    # Every block's weights replicated, the batch split: data parallel. (The ILP may still
    # split a small table such as the position embeddings when that saves a little.)
    blocks = {k: v for k, v in parameter_specs(chosen).items() if k.startswith("blocks.")}
    assert blocks and all(spec == (Replicate(),) for spec in blocks.values())
    # The activations are split by batch (the token ids themselves may arrive in any layout).
    matmuls = [n for n in chosen.program.graph.nodes if n.target is torch.ops.aten.addmm.default]
    assert all(ir.require(n, Sharding).strategy.outputs[0] == (Shard(0),) for n in matmuls)
    activation_bytes = 64 * 32 * CONFIG.n_embd * 4 // 4
    unbucketed = lower(chosen.program, chosen.cluster, bucket_bytes=0)
    assert all(r.bytes < activation_bytes for r in unbucketed.collectives())
    dp = plan_program(gpt_program(batch=64, length=32)[1], cluster, manual=plans.data_parallel)
    assert score(chosen) <= score(dp) * (1 + 1e-9)


def test_tight_memory_gives_megatron_or_something_cheaper() -> None:
    cluster = THROUGHPUT_BOUND
    megatron = plan_program(gpt_program(batch=4)[1], cluster, manual=plans.tensor_parallel)
    replicated = plan_program(gpt_program(batch=4)[1], cluster, manual=plans.data_parallel)
    megatron_memory = megatron.problem.memory(megatron.solution.choice)
    assert replicated.problem.memory(replicated.solution.choice) > megatron_memory
    limit = megatron_memory * 1.0001
    chosen = plan_program(gpt_program(batch=4)[1], cluster, options=PlanOptions(memory_limit=limit))
    assert chosen.problem.memory(chosen.solution.choice) <= limit
    # Replicated weights do not fit: the plan shards them, and costs no more than Megatron.
    assert any(spec != (Replicate(),) for spec in parameter_specs(chosen).values())
    assert score(chosen) <= score(megatron) * (1 + 1e-6)


def test_pinned_specs_are_respected() -> None:
    _, program, _ = gpt_program(batch=8)
    pins = {"blocks.*.mlp.fc.weight": (Shard(1),), "input_0": (Replicate(),)}
    chosen = plan_program(program, Cluster((4,)), options=PlanOptions(pins=pins))
    specs = parameter_specs(chosen)
    assert specs["blocks.0.mlp.fc.weight"] == specs["blocks.1.mlp.fc.weight"] == (Shard(1),)
    assert ir.require(chosen.program.placeholders()["input_0"], Sharding).strategy.outputs[0] == (
        Replicate(),
    )
    with pytest.raises(FxparError, match="match no parameter"):
        plan_program(gpt_program(batch=8)[1], Cluster((4,)),
                     options=PlanOptions(pins={"nothing.*": (Shard(0),)}))  # fmt: skip
    with pytest.raises(FxparError, match="cannot be laid out that way"):
        plan_program(gpt_program(batch=8)[1], Cluster((4,)),
                     options=PlanOptions(pins={"wpe.weight": (Shard(3),)}))  # fmt: skip


def test_repeated_layers_are_solved_once_and_coarsening_shrinks_the_problem() -> None:
    # Three blocks: the last one differs at its boundary (no gradient arrives from above), the
    # first two are identical and share their decisions.
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=3, n_embd=64, n_head=4, vocab_size=128, block_size=32))
    tokens = torch.randint(0, 128, (8, 16))
    program = fxpar.capture(model, (tokens,), gpt_loss, example_targets=(tokens,))
    cluster = Cluster((4,))
    prepared = fxpar.passes.prepare_for_planning(program, cluster)
    full, full_layout = build_problem(
        prepared, cluster, PlanOptions(coarsen=False, dedup_layers=False)
    )
    coarse, coarse_layout = build_problem(
        prepared, cluster, PlanOptions(coarsen=True, dedup_layers=False)
    )
    deduped, layout = build_problem(prepared, cluster, PlanOptions(coarsen=True))
    assert full.num_nodes > coarse.num_nodes > deduped.num_nodes
    assert layout.stats["layers_merged"] > 0
    # The same data-parallel choice costs the same in all three problems.
    plans.data_parallel(prepared, cluster)
    from fxpar.planning.problem import assignment_of

    costs = [
        problem.objective(assignment_of(prepared, lay))  # type: ignore[arg-type]
        for problem, lay in ((full, full_layout), (coarse, coarse_layout), (deduped, layout))
    ]
    assert costs[0] == pytest.approx(costs[1]) == pytest.approx(costs[2])


def test_a_micro_batch_plan_prices_each_gradient_sum_at_its_share() -> None:
    """``gradient_share=1/M`` (one of M micro-batches, synchronised once a step) takes exactly
    (1 - 1/M) of the gradients' all-reduces off data parallelism's cost, and nothing off a
    replicated plan, which synchronises nothing; the ILP then prefers data parallelism."""
    from fxpar.lowering import value_spec
    from fxpar.planning.cost import output_seconds
    from fxpar.planning.problem import assignment_of
    from fxpar.testing.strategies import splitting_cluster

    model = GPT(GPTConfig(n_layer=2, n_embd=64, n_head=4, vocab_size=128, block_size=32))
    tokens = torch.randint(0, 128, (4, 16))
    program = fxpar.capture(model, (tokens,), gpt_loss, example_targets=(tokens,))
    cluster = splitting_cluster((4,))
    prepared = fxpar.passes.prepare_for_planning(program, cluster)
    whole, layout = build_problem(prepared, cluster, PlanOptions())
    quarter, _ = build_problem(prepared, cluster, PlanOptions(gradient_share=0.25))
    plans.data_parallel(prepared, cluster)
    # The gradients' sums as the data-parallel plan lays them out, priced on their own.
    placeholders = prepared.placeholders()
    results = list(prepared.graph.output_node().args[0])[len(prepared.signature.outputs) :]
    sums = sum(
        output_seconds(
            value_spec(result), value_spec(placeholders[name]),
            ir.require(placeholders[name], ir.ValueMeta).tensor, cluster,
        )
        for name, result in zip(prepared.signature.gradients, results, strict=False)
    )  # fmt: skip
    assert sums > 0
    data_parallel = assignment_of(prepared, layout)
    assert data_parallel is not None
    saved = whole.objective(data_parallel) - quarter.objective(data_parallel)
    assert saved == pytest.approx(0.75 * sums, rel=1e-9)
    plans.replicated(prepared, cluster)
    replicated = assignment_of(prepared, layout)
    assert replicated is not None
    assert whole.objective(replicated) == pytest.approx(quarter.objective(replicated))
    with pytest.raises(FxparError, match="gradient_share"):
        PlanOptions(gradient_share=0.0)


def test_solvers_are_interchangeable_and_agree_on_a_small_graph() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 4, bias=False), torch.nn.Tanh())
    x = torch.randn(8, 8)
    results = {}
    for solver in (ILPSolver(), ExhaustiveSolver(max_combinations=10**7), GreedySolver()):
        program = fxpar.capture(model, (x,), lambda y: y.square().mean())
        # Coarsened, so that exhaustive search can list every plan of the problem.
        options = PlanOptions(coarsen=True)
        results[solver.name] = plan_program(program, Cluster((2,)), solver=solver, options=options)
    assert results["ilp"].solution.objective == pytest.approx(
        results["exhaustive"].solution.objective
    )
    assert results["greedy"].solution.objective >= results["ilp"].solution.objective - 1e-12


def test_infeasible_memory_says_what_the_smallest_plan_needs() -> None:
    _, program, _ = gpt_program(batch=4)
    with pytest.raises(InfeasiblePlanError, match="needs"):
        plan_program(program, Cluster((2,)), options=PlanOptions(memory_limit=1024))


def test_plan_explains_its_choices() -> None:
    _, program, _ = gpt_program(batch=8)
    chosen = plan_program(program, Cluster((4,)))
    node = next(n for n in chosen.program.graph.nodes if n.target is torch.ops.aten.addmm.default)
    text = chosen.explain(node.name)
    assert node.name in text and "next best" in text and "more in total" in text
    assert "estimated step" in chosen.summary()


def test_fxpar_plan_captures_and_plans_in_one_call() -> None:
    torch.manual_seed(0)
    model = GPT(CONFIG)
    tokens = torch.randint(0, CONFIG.vocab_size, (8, 16))
    chosen = fxpar.plan(model, Cluster((2,)), (tokens,), gpt_loss, example_targets=(tokens,),
                        pins={"wte.weight": (Replicate(),)})  # fmt: skip
    assert chosen.solution.solver == "ilp"
    assert chosen.cluster.memory == 16 * GiB


def symbolic_program() -> fxpar.Program:
    model = GPT(CONFIG)
    tokens = torch.randint(0, CONFIG.vocab_size, (4, 8))
    return fxpar.capture(model, (tokens,), gpt_loss, example_targets=(tokens,), dynamic=True)


SYMBOLIC_ENTRIES = {
    "plan_program": lambda program, cluster: plan_program(program, cluster),
    "plan_program_manual": lambda program, cluster: plan_program(
        program, cluster, manual=plans.data_parallel
    ),
    "data_parallel": plans.data_parallel,
    "tensor_parallel": plans.tensor_parallel,
    "fully_sharded": plans.fully_sharded,
    "random_plan": lambda program, cluster: plans.random_plan(program, cluster, seed=0),
    "plan_stages": lambda program, cluster: fxpar.pipeline.plan_stages(
        program, cluster, fxpar.Pipeline(stages="auto", microbatches=1)
    ),
}


@pytest.mark.parametrize("entry", list(SYMBOLIC_ENTRIES))
def test_symbolic_programs_are_refused_up_front_with_what_to_do(entry: str) -> None:
    """A dynamic=True capture cannot be split (a symbol does not say whether it divides the
    mesh): every planning entry point says so, naming the symbolic input, instead of failing
    inside a view rule."""
    with pytest.raises(SymbolicShapeError, match=r"'input_0' int64\[s\d+, s\d+\].*dynamic=False"):
        SYMBOLIC_ENTRIES[entry](symbolic_program(), Cluster((2,)))


def test_sharding_rules_refuse_symbolic_shapes_by_name() -> None:
    """The rules themselves (reached by a user's own pass list) name the op and the fix."""
    program = symbolic_program()
    view = next(n for n in program.graph.nodes if n.target is torch.ops.aten.view.default)
    expected = r"aten\.view\.default has symbolic.*dynamic=False"
    with pytest.raises(SymbolicShapeError, match=expected):
        default_rules().strategies(op_call(view, (2,)))
