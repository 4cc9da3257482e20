"""The plan that runs is the plan priced (issue 30, item 2).

With ``stages="auto"`` and a stage planner, ``fxpar.compile`` captures the step once, at one
micro-batch's shapes, prices every stage mesh under its plan of that program, and hands the
chosen meshes' plans (``StageChoice.plans``) to the ``PipelineModel``, which runs them instead
of capturing and solving again:

- the choice carries one plan per chosen stage mesh, each made on its own copy of the program
  (the plans of two meshes do not overwrite each other's strategies);
- every node of the stage programs a pipeline runs has exactly the strategy of the priced
  plan, and the pipeline does not plan again (uniform and different stage meshes; on one
  process, and on gloo ranks in the slow tests);
- the estimate the choice reports is the stage DP's: the objective of its stages' costs in
  the DP's own problem, and the score of the chosen split;
- a tiny Hugging Face Llama whose stages, stage meshes and ILP stage plans ``stages="auto"``
  chose trains on 4 gloo ranks like one device.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Mapping
from typing import Any
from unittest import mock

import pytest
import torch
from torch import nn

import fxpar
from fxpar import ir, plans
from fxpar.cluster import Cluster
from fxpar.models import GPT, GPTConfig, gpt_loss
from fxpar.optim import SGD
from fxpar.passes import plan_program
from fxpar.pipeline import Pipeline, PipelineError, PipelineModel, capture_microbatch
from fxpar.pipeline.auto import StageChoice, evaluate_split, plan_stages, stage_problem
from fxpar.pipeline.split import SplitProgram
from fxpar.pipeline.stage_choice import format_seconds
from fxpar.pipeline.stage_costs import StagePlanner
from fxpar.planning.plan import Plan
from fxpar.runtime.launch import spawn
from fxpar.sharding import Sharding
from fxpar.solvers.stages import per_step_overcount

DATA_PARALLEL: StagePlanner = functools.partial(plan_program, manual=plans.data_parallel)
TENSOR_PARALLEL: StagePlanner = functools.partial(plan_program, manual=plans.tensor_parallel)
CONFIG = GPTConfig(n_layer=2, n_embd=64, n_head=4, vocab_size=64, block_size=16)
MICROBATCHES = 4
LR = 0.1


def _gpt(batch: int = 16) -> tuple[GPT, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, CONFIG.vocab_size, (batch, 16), generator=generator)
    targets = torch.randint(0, CONFIG.vocab_size, (batch, 16), generator=generator)
    return GPT(CONFIG), tokens, targets


def _micro_program(pipeline: Pipeline) -> fxpar.Program:
    model, tokens, targets = _gpt()
    return capture_microbatch(model, pipeline, (tokens,), gpt_loss, example_targets=(targets,))


def _choose(cluster: Cluster, planner: StagePlanner) -> tuple[fxpar.Program, StageChoice]:
    pipeline = Pipeline(microbatches=MICROBATCHES)
    program = _micro_program(pipeline)
    choice = plan_stages(program, cluster, pipeline, stage_planner=planner, microbatch=True)
    return program, choice


def _shardings(program: fxpar.Program) -> dict[str, Sharding]:
    found = {}
    for node in program.graph.nodes:
        sharding = ir.get(node, Sharding)
        if sharding is not None:
            found[node.name] = sharding
    return found


def _unpriced(split: SplitProgram, priced: Plan) -> list[str]:
    """The ops of the priced plan that ``split``'s stage programs run under another strategy,
    or do not run at all. Only a sum of a tied weight's gradients (an op the output alone
    reads) may be left out: the split sums those across the stages holding the weight."""
    expected = _shardings(priced.program)
    wrong = []
    ran: set[str] = set()
    for unit in (*split.forward, *split.backward):
        for node in unit.graph_module.graph.nodes:
            if node.op != "call_function" or node.name not in expected:
                continue  # an op the split adds (a per-holder gradient sum), not planned
            ran.add(node.name)
            if ir.get(node, Sharding) != expected[node.name]:
                wrong.append(node.name)
    ops = {
        n.name
        for n in priced.program.graph.nodes
        if n.op == "call_function" and {u.op for u in n.users} != {"output"}
    }
    return wrong + sorted((ops & expected.keys()) - ran)


# ---- the choice keeps the plans it priced


def test_choice_carries_one_plan_per_chosen_mesh_each_on_its_own_program() -> None:
    """On 3 devices of slow links under data parallelism, stages on (1,) and (2,) win; the
    choice keeps a plan for each, made on that mesh and on a program of its own, which still
    says that mesh (planning one program in place for both would leave the last mesh on
    both)."""
    program, choice = _choose(Cluster((3,), bandwidth=(1e8,)), DATA_PARALLEL)
    assert choice.pipeline.stage_meshes == ((1,), (2,))
    assert set(choice.plans) == {(1,), (2,)}
    for shape, plan in choice.plans.items():
        assert plan.cluster.mesh_shape == shape
        assert plan.program is not program
        assert plan.program.require_cluster("a test").mesh_shape == shape
    assert choice.plans[(1,)].program is not choice.plans[(2,)].program


def test_uniform_choice_carries_the_plan_of_its_stage_cluster() -> None:
    """Megatron inside stages on 4 devices of 10 GB/s links: two stages on (2,), one plan,
    keyed by the stage cluster's shape."""
    _, choice = _choose(Cluster((4,), bandwidth=(1e10,)), TENSOR_PARALLEL)
    assert choice.stage_cluster is not None and choice.pipeline.stage_meshes is None
    assert list(choice.plans) == [choice.stage_cluster.mesh_shape] == [(2,)]


def test_replicas_carry_no_plan() -> None:
    """Without a stage planner the stages are replicas: no intra-op plan to carry."""
    model, tokens, targets = _gpt()
    program = fxpar.capture(model, (tokens,), gpt_loss, example_targets=(targets,))
    choice = plan_stages(program, Cluster((2,)), Pipeline(microbatches=2))
    assert choice.plans == {}


# ---- the estimate reported is the DP's


@pytest.mark.parametrize(
    ("mesh", "planner"),
    [((3,), DATA_PARALLEL), ((4,), TENSOR_PARALLEL)],
    ids=["different meshes", "uniform"],
)
def test_reported_estimate_is_the_stage_dps(mesh: tuple[int, ...], planner: StagePlanner) -> None:
    """The choice's step time is ``sum t + (M - 1) max t`` of its stages (each stage's
    once-a-step seconds paid once, and the tied weights' sums), each stage's time
    and memory are the cost the DP's own problem gives its layers on its submesh, the
    chosen split scored again gives the same, and the report and to_dict say that number."""
    cluster = Cluster(mesh, bandwidth=(1e8,) if mesh == (3,) else (1e10,))
    pipeline = Pipeline(microbatches=MICROBATCHES)
    program, choice = _choose(cluster, planner)
    times = [stage.time for stage in choice.plan.stages]
    once = [stage.per_step for stage in choice.plan.stages]  # each stage's reduction, update
    assert all(seconds > 0 for seconds in once)
    objective = sum(times) + (MICROBATCHES - 1) * max(times)
    paid = objective - per_step_overcount(times, once, MICROBATCHES)
    assert choice.plan.objective == pytest.approx(objective)
    # Then the sum of the tied embedding's gradient between the stages holding it, once.
    holders = [i for i, modules in enumerate(choice.stage_modules) if {"wte", "head"} & {*modules}]
    assert (choice.tied_seconds > 0) == (len(holders) > 1)
    assert choice.step_time == pytest.approx(paid + choice.tied_seconds)
    problem = stage_problem(program, cluster, pipeline, stage_planner=planner, microbatch=True)
    for stage in choice.plan.stages:
        cost = problem.costs(stage.start, stage.stop, stage.submesh)
        assert stage.time == cost.time
    scored = evaluate_split(
        program, cluster, choice.pipeline, stage_planner=planner, microbatch=True
    )
    assert scored.step_time == pytest.approx(choice.step_time, rel=1e-12)
    assert scored.memory == pytest.approx(choice.memory, rel=1e-12)
    assert choice.to_dict()["step_time"] == choice.step_time
    first_line = choice.report().splitlines()[0]
    assert format_seconds(choice.step_time) in first_line and "(estimated)" in first_line


# ---- the pipeline runs what was priced


def test_compile_runs_the_priced_plan_without_planning_again() -> None:
    """One device, Megatron inside the stage: fxpar.compile's pipeline plans nothing itself
    (its planning helper is made to fail), runs the plan object the choice carries, and every
    node of its stage programs has the priced strategy; the step is eager PyTorch's."""
    model, tokens, targets = _gpt(batch=8)
    reference = copy.deepcopy(model)
    with mock.patch("fxpar.pipeline.model.plan_each", side_effect=AssertionError("planned")):
        pipelined = fxpar.compile(
            model, Cluster((1,)), (tokens,), gpt_loss, example_targets=(targets,),
            optimizer=SGD(lr=LR), manual=plans.tensor_parallel,
            pipeline=Pipeline(stages="auto", microbatches=2, stage_mode="meshes"),
        )  # fmt: skip
    choice = pipelined.stage_choice
    assert choice is not None and set(choice.plans) == set(pipelined.plans) == {(1,)}
    assert pipelined.plans[(1,)] is choice.plans[(1,)]
    assert _unpriced(pipelined.split, choice.plans[(1,)]) == []
    optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    loss = gpt_loss(reference(tokens), targets)
    loss.backward()
    optimizer.step()
    torch.testing.assert_close(pipelined.step(tokens, targets), loss.detach())
    torch.testing.assert_close(pipelined.full_state_dict(), reference.state_dict())


def test_given_plans_must_match_the_meshes_and_the_micro_batch() -> None:
    """Plans for other meshes, or made on another batch's program, are refused by name."""
    model, tokens, targets = _gpt(batch=8)
    pipeline = Pipeline(stages=1, microbatches=2)
    program = capture_microbatch(model, pipeline, (tokens,), gpt_loss, example_targets=(targets,))
    plan = DATA_PARALLEL(program.copy(), Cluster((1,)))
    build = functools.partial(
        PipelineModel, model, pipeline, (tokens,), gpt_loss, example_targets=(targets,),
        stage_cluster=Cluster((1,)), program=program,
    )  # fmt: skip
    with pytest.raises(PipelineError, match=r"plans were given for stage meshes \[\(2,\)\]"):
        build(plans={(2,): plan})
    whole = fxpar.capture(model, (tokens,), gpt_loss, example_targets=(targets,))
    with pytest.raises(PipelineError, match="micro-batch has"):
        build(plans={(1,): DATA_PARALLEL(whole, Cluster((1,)))})
    with pytest.raises(PipelineError, match="runs data-parallel replicas"):
        PipelineModel(
            model, pipeline, (tokens,), gpt_loss, example_targets=(targets,), plans={(1,): plan}
        )
    assert build(plans={(1,): plan}).plans[(1,)] is plan


# ---- on gloo ranks


def _priced_pipeline(
    model: nn.Module,
    cluster: Cluster,
    inputs: Any,
    loss_fn: Any,
    targets: torch.Tensor,
    steps: int,
    **options: Any,
) -> dict[str, Any]:
    """fxpar.compile with stages="auto" on this rank, what its stages run against what was
    priced, and the losses and state after ``steps`` SGD steps."""
    with mock.patch("fxpar.pipeline.model.plan_each", side_effect=AssertionError("planned")):
        pipelined = fxpar.compile(
            model, cluster, inputs, loss_fn, example_targets=(targets,), optimizer=SGD(lr=LR),
            **options,
        )  # fmt: skip
    choice = pipelined.stage_choice
    assert choice is not None and pipelined.stage_cluster is not None
    shape = pipelined.stage_cluster.mesh_shape
    batch = list(inputs.values()) if isinstance(inputs, Mapping) else list(inputs)
    losses = [pipelined.step(*batch, targets).item() for _ in range(steps)]
    return {
        "meshes": choice.stage_mesh_shapes,
        "same plans": all(pipelined.plans[s] is choice.plans[s] for s in choice.plans),
        "plan keys": (sorted(pipelined.plans), sorted(choice.plans)),
        "unpriced": _unpriced(pipelined.split, choice.plans[shape]),
        "stage": pipelined.stage,
        "losses": losses,
        "state": pipelined.full_state_dict(),
    }


def _gpt_on_three(rank: int, world_size: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    model, tokens, targets = _gpt()
    return _priced_pipeline(
        model, Cluster((3,), bandwidth=(1e8,)), (tokens,), gpt_loss, targets, 2,
        pipeline=Pipeline(stages="auto", microbatches=MICROBATCHES, stage_mode="meshes"),
        manual=plans.data_parallel,
    )  # fmt: skip


def _gpt_uniform_on_four(rank: int, world_size: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    model, tokens, targets = _gpt()
    return _priced_pipeline(
        model, Cluster((4,), bandwidth=(1e10,)), (tokens,), gpt_loss, targets, 2,
        pipeline=Pipeline(stages="auto", microbatches=MICROBATCHES, stage_mode="meshes"),
        manual=plans.tensor_parallel,
    )  # fmt: skip


def _eager_gpt(steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    model, tokens, targets = _gpt()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = gpt_loss(model(tokens), targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, model.state_dict()


def _check_ranks(ranks: list[dict[str, Any]], losses: list[float], state: Any) -> None:
    for result in ranks:
        assert result["same plans"] and result["plan keys"][0] == result["plan keys"][1]
        assert result["unpriced"] == [], f"stage {result['stage']}: {result['unpriced']}"
        assert result["losses"] == pytest.approx(losses, rel=1e-4)
        torch.testing.assert_close(result["state"], state, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("run", "world", "meshes"),
    [
        (_gpt_on_three, 3, ((1,), (2,))),
        (_gpt_uniform_on_four, 4, ((2,), (2,))),
    ],
    ids=["different meshes", "uniform"],
)
def test_gloo_stages_run_the_priced_plans_and_train_like_one_device(
    run: Any, world: int, meshes: tuple[tuple[int, ...], ...]
) -> None:
    """On gloo ranks, stages="auto" under data parallelism (meshes (1,) and (2,)) and under
    Megatron (two stages on (2,)): every rank runs the priced plan of its stage mesh, node by
    node, without planning again, and two SGD steps equal eager PyTorch's."""
    ranks = spawn(run, world)
    assert {result["meshes"] for result in ranks} == {meshes}
    _check_ranks(ranks, *_eager_gpt(2))


LLAMA = dict(
    vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=32,
)  # fmt: skip


# Too little memory per device for the whole step on 4 devices' intra-op plan without
# communication, and links too slow for one that communicates: a pipeline wins.
LLAMA_CLUSTER = Cluster((4,), bandwidth=(1e7,), memory=1e5)


def _llama() -> tuple[nn.Module, torch.Tensor]:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
    tokens = torch.randint(0, 64, (8, 8), generator=torch.Generator().manual_seed(1))
    return model, tokens


def _logits_loss(output: Any, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output.logits.flatten(0, 1).float(), labels.flatten())


def _llama_on_four(rank: int, world_size: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    model, tokens = _llama()
    return _priced_pipeline(
        model, LLAMA_CLUSTER, {"input_ids": tokens}, _logits_loss, tokens,
        2, pipeline=Pipeline(stages="auto", microbatches=2, stage_mode="meshes"),
        solver=fxpar.solvers.ILPSolver(),
    )  # fmt: skip


@pytest.mark.slow
def test_llama_chosen_by_stages_auto_with_ilp_stage_plans_trains_like_one_device() -> None:
    """A tiny HF Llama on 4 gloo ranks of slow links and little memory, its stages and stage
    meshes chosen by the stage DP under the ILP's stage plans: every rank runs its priced plan
    node by node, and two SGD steps give eager PyTorch's losses and weights."""
    ranks = spawn(_llama_on_four, 4)
    meshes = ranks[0]["meshes"]
    assert len(meshes) > 1, "memory and links should make a pipeline of several stages"
    model, tokens = _llama()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for _ in range(2):
        optimizer.zero_grad()
        loss = _logits_loss(model(input_ids=tokens), tokens)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    # Non-persistent buffers (the rotary embedding's) too: full_state_dict holds every buffer.
    _check_ranks(ranks, losses, {**model.state_dict(), **dict(model.named_buffers())})
