"""Folding a stamped step to its distinct layers (fxpar.ir.fold), and planning stage meshes on it.

A step of ``N`` stamped layers folds to six, the kept copy standing for ``N - 5``. Held here:

- the folded step's intra-op problem is the step's, entry for entry (names, candidates, costs,
  memory, edges), on decoders, under bf16 MixedPrecision, on 1-D and 2-D meshes;
- a step that was not stamped, has no copies to drop, or whose copies differ is not folded;
- the stage costs priced on the folded step are the step's, bucketed gradients included;
- the stage search on a stamped step chooses what it chooses on the same step unfolded, and the
  choice carries plans of the whole step with the strategies of the plans priced, which a
  pipeline runs like eager PyTorch;
- ``plan_program`` solves a stamped step folded and gives the step that choice;
- replaying a plan on a program whose problem is another is refused by name.
"""

from __future__ import annotations

import copy
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch

import fxpar
from fxpar import ir
from fxpar.cluster import Cluster
from fxpar.errors import FxparError
from fxpar.ir.fold import Multiplicity, fold
from fxpar.ir.repeat import StampedLayers, capture_repeated
from fxpar.models.gpt import GPT, GPTConfig, gpt_loss
from fxpar.optim import SGD
from fxpar.passes import (
    choose_strategies,
    default_passes,
    plan_program,
    prepare_for_planning,
    replaying,
)
from fxpar.passes.canonicalize import Canonicalize
from fxpar.pipeline import PassPlanner, Pipeline, PipelineModel, capture_microbatch
from fxpar.pipeline import auto as pipeline_auto
from fxpar.pipeline.auto import plan_stages, search_pipelines
from fxpar.planning.problem import PlanOptions, build_problem
from fxpar.sharding import Sharding
from fxpar.solvers.errors import InfeasiblePlanError

transformers = pytest.importorskip("transformers")

BF16 = fxpar.MixedPrecision(torch.bfloat16, reduce_dtype=torch.float32)
LAYERS = 10


def _decoder(family: str, layers: int = LAYERS) -> torch.nn.Module:
    torch.manual_seed(0)
    config = getattr(transformers, f"{family}Config")(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    return getattr(transformers, f"{family}ForCausalLM")(config)


def _tokens(batch: int = 4, length: int = 8) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 64, (batch, length), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}


def _stamped(model: torch.nn.Module, **options: Any) -> fxpar.Program:
    return Canonicalize().run(capture_repeated(model, _tokens(), **options))


def _gpt_stamped() -> fxpar.Program:
    torch.manual_seed(0)
    config = GPTConfig(n_layer=LAYERS, n_embd=32, n_head=4, vocab_size=64, block_size=16)
    tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    return Canonicalize().run(capture_repeated(GPT(config), (tokens,), gpt_loss,
                                               example_targets=(tokens,)))  # fmt: skip


def _layer_of(node: torch.fx.Node, container: str) -> int | None:
    region = ir.get(node, ir.Region)
    if region is None or not region.module.startswith(container + "."):
        return None
    return int(region.module[len(container) + 1 :].split(".")[0])


def test_fold_keeps_the_distinct_layers_and_counts_the_copies() -> None:
    program = _stamped(_decoder("Llama"))
    folded = fold(program)
    assert folded is not None and folded.copies == LAYERS - 5
    layers = {_layer_of(n, "model.layers") for n in folded.program.graph.nodes} - {None}
    assert layers == {0, 1, 2, 3, LAYERS - 2, LAYERS - 1}
    assert folded.program.require(Multiplicity) == Multiplicity("model.layers", 3, LAYERS - 5)
    kept = {node.name: node for node in folded.program.graph.nodes}
    for node in program.graph.nodes:
        if node.op == "output":
            continue
        twin = kept[folded.origin[node.name]]
        assert twin.op == node.op and (node.op == "placeholder" or twin.target == node.target)
        if _layer_of(node, "model.layers") in range(4, LAYERS - 2):
            assert _layer_of(twin, "model.layers") == 3
    signature = folded.program.signature
    assert all(not name.startswith("model.layers.5.") for name in signature.parameters)
    assert len(signature.gradients) == len(signature.parameters)
    folded.program.graph.lint()


def _problems_alike(program: fxpar.Program, mesh: tuple[int, ...]) -> None:
    folded = fold(program)
    assert folded is not None
    cluster = Cluster.preset("h100", mesh)
    whole, _ = build_problem(prepare_for_planning(program.copy(), cluster), cluster)
    short, _ = build_problem(prepare_for_planning(folded.program.copy(), cluster), cluster)
    assert short.names == whole.names and short.strategies == whole.strategies
    assert short.memory_limit == whole.memory_limit
    for mine, theirs in (
        (short.node_costs, whole.node_costs),
        (short.node_memory, whole.node_memory),
    ):
        for a, b in zip(mine, theirs, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-9, atol=0)
    assert [(e.source, e.target) for e in short.edges] == [
        (e.source, e.target) for e in whole.edges
    ]
    for a, b in zip(short.edges, whole.edges, strict=True):
        np.testing.assert_allclose(a.costs, b.costs, rtol=1e-9, atol=0)
    # The copies really count: without the multiplicity the problem is another.
    folded.program._annotations.pop(Multiplicity)
    bare, _ = build_problem(prepare_for_planning(folded.program.copy(), cluster), cluster)
    assert not np.allclose(sum(map(min, bare.node_memory)), sum(map(min, whole.node_memory)))


@pytest.mark.parametrize("mesh", [(2,), (2, 2)], ids=["1-D", "2-D"])
@pytest.mark.parametrize("family", ["Llama", "Qwen2"])
def test_the_folded_step_has_the_problem_of_the_step(family: str, mesh: tuple[int, ...]) -> None:
    _problems_alike(_stamped(_decoder(family), mixed_precision=BF16), mesh)


def test_the_folded_step_of_fxpars_gpt_has_the_problem_of_the_step() -> None:
    _problems_alike(_gpt_stamped(), (2, 2))


def test_a_step_that_was_not_stamped_or_whose_copies_differ_is_not_folded() -> None:
    model = _decoder("Llama")
    assert fold(Canonicalize().run(fxpar.capture(model, _tokens()))) is None
    six = _stamped(_decoder("Llama", layers=6))
    assert six.get(StampedLayers) is None or fold(six) is None  # no copy beyond the template
    program = _stamped(model)
    changed = next(
        node
        for node in program.graph.nodes
        if _layer_of(node, "model.layers") == 5 and node.target is torch.ops.aten.mm.default
    )
    changed.target = torch.ops.aten.matmul.default  # one copy unlike the kept one
    assert fold(program) is None


def _planned_steps(program: fxpar.Program, cluster: Cluster, pipeline: Pipeline) -> list[Any]:
    """The stage costs' view of the step planned on the whole cluster as one stage mesh:
    folded (as stamped), then whole (the record dropped, so nothing folds)."""
    whole = program.copy()
    whole._annotations.pop(StampedLayers)
    steps = []
    for step in (program, whole):
        model = pipeline_auto._cost_model(
            step, cluster, pipeline, 2, PassPlanner(default_passes()), (), True
        )
        assert (model.folded is not None) == (step is program)
        steps.append(model.planned(cluster.mesh_shape))
    return steps


def test_stage_costs_of_the_folded_step_are_the_steps() -> None:
    """Per-op seconds, collectives, the gradients' bucketed synchronisation, every value's
    bytes and the bytes crossing every boundary: as priced on the whole step."""
    pipeline = Pipeline(stages="auto", microbatches=2)
    program = capture_microbatch(
        _decoder("Llama"), pipeline, _tokens(8, 16), mixed_precision=BF16, stamp_layers=True
    )
    folded, whole = _planned_steps(program, Cluster.preset("h100", (2, 2)), pipeline)
    assert folded.compute.keys() == whole.compute.keys()
    for table in ("compute", "comm", "sync"):
        mine, theirs = getattr(folded, table), getattr(whole, table)
        assert mine.keys() == theirs.keys(), table
        assert mine == pytest.approx(theirs, rel=1e-9, abs=0), table
    assert sum(whole.sync.values()) > 0
    assert {n.name: b for n, b in folded.local.items()} == {
        n.name: b for n, b in whole.local.items()
    }
    assert folded.forward_crossing == whole.forward_crossing
    assert folded.backward_crossing == whole.backward_crossing


def _shardings(program: fxpar.Program) -> dict[str, Sharding | None]:
    return {node.name: ir.get(node, Sharding) for node in program.graph.nodes}


def test_stage_search_on_a_stamped_step_chooses_what_the_whole_step_gives() -> None:
    pipelines = [Pipeline(stages="auto", microbatches=4, remat=remat) for remat in (False, True)]
    program = capture_microbatch(
        _decoder("Llama", layers=12), pipelines[0], _tokens(16, 16), mixed_precision=BF16,
        stamp_layers=True,
    )  # fmt: skip
    whole = program.copy()
    whole._annotations.pop(StampedLayers)
    cluster = Cluster.preset("h100", (8,))
    planner = PassPlanner(default_passes())
    found = [
        search_pipelines(step, cluster, pipelines, stage_planner=planner, microbatch=True).choice
        for step in (program, whole)
    ]
    folded, unfolded = found
    assert folded is not None and unfolded is not None
    assert folded.step_time == pytest.approx(unfolded.step_time, rel=1e-9)
    assert folded.stage_mesh_shapes == unfolded.stage_mesh_shapes
    assert folded.plan.stages == unfolded.plan.stages
    assert folded.plans.keys() == unfolded.plans.keys()
    nodes = sum(1 for _ in program.graph.nodes)
    for shape, plan in folded.plans.items():
        assert sum(1 for _ in plan.program.graph.nodes) == nodes  # the whole step, to run
        assert _shardings(plan.program) == _shardings(unfolded.plans[shape].program)
        assert plan.solution.objective == pytest.approx(
            unfolded.plans[shape].solution.objective, rel=1e-9
        )


def test_a_pipeline_runs_the_plan_of_a_stamped_step_like_eager() -> None:
    """One stage mesh of one device: the choice's plan of the stamped step (replayed from the
    folded plan) runs in a PipelineModel, and one SGD step equals eager PyTorch's."""
    model = _decoder("Llama", layers=8)
    reference = copy.deepcopy(model)
    batch = _tokens(4, 8)
    pipeline = Pipeline(stages=1, microbatches=2)
    program = capture_microbatch(model, pipeline, batch, stamp_layers=True)
    assert fold(program) is not None
    cluster = Cluster((1,))
    choice = plan_stages(
        program, cluster, Pipeline(stages="auto", microbatches=2),
        stage_planner=PassPlanner(default_passes()), microbatch=True,
    )  # fmt: skip
    assert set(choice.plans) == {(1,)}
    nodes = sum(1 for _ in program.graph.nodes)
    assert sum(1 for _ in choice.plans[(1,)].program.graph.nodes) == nodes  # not the folded
    pipelined = PipelineModel(
        model, pipeline, batch, optimizer=SGD(lr=0.1), stage_cluster=cluster,
        program=program, plans=choice.plans,
    )  # fmt: skip
    loss = pipelined.step(batch["input_ids"], batch["labels"])
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    expected = reference(**batch).loss
    expected.backward()
    optimizer.step()
    torch.testing.assert_close(loss, expected.detach())
    state = pipelined.full_state_dict()
    torch.testing.assert_close({name: state[name] for name in reference.state_dict()},
                               reference.state_dict())  # fmt: skip


def test_replaying_a_plan_on_a_program_of_other_nodes_is_refused() -> None:
    cluster = Cluster((2,))
    llama = _stamped(_decoder("Llama", layers=8))
    plan = plan_program(llama.copy(), cluster)
    with pytest.raises(FxparError, match="other decisions than the plan"):
        plan_program(_gpt_stamped(), cluster, passes=replaying(default_passes(), plan))


def test_plan_program_solves_a_stamped_step_folded_and_gives_the_step_that_choice() -> None:
    """The intra-op plan of a stamped step: its problem built on the folded step, and every
    node of the step with the strategy the step planned whole gets."""
    program = capture_repeated(_decoder("Llama"), _tokens(), mixed_precision=BF16)
    whole = program.copy()
    whole._annotations.pop(StampedLayers)
    cluster = Cluster.preset("h100", (2, 2))
    built: list[int] = []
    real = choose_strategies.build_problem

    def counting(step: fxpar.Program, *args: Any) -> Any:
        built.append(sum(1 for _ in step.graph.nodes))
        return real(step, *args)

    with mock.patch.object(choose_strategies, "build_problem", counting):
        folded = plan_program(program, cluster)
    assert built and max(built) < sum(1 for _ in program.graph.nodes)
    unfolded = plan_program(whole, cluster)
    # The plan is of the step, not of its folded twin: the nodes of the step planned whole,
    # on a copy of its own (planning leaves the step given as it was).
    assert folded.program is not program
    assert [n.name for n in folded.program.graph.nodes] == [
        n.name for n in unfolded.program.graph.nodes
    ]
    assert _shardings(folded.program) == _shardings(unfolded.program)
    assert folded.solution.objective == pytest.approx(unfolded.solution.objective, rel=1e-9)
    assert folded.stats == unfolded.stats


@pytest.mark.parametrize("stamped", [True, False], ids=["stamped", "captured whole"])
def test_a_refused_plan_names_the_passes_before_the_choice(stamped: bool) -> None:
    """Folding stays inside the choose-strategies pass: an infeasible plan is raised by it
    with the passes that ran before, on a stamped step as on any other."""
    model, tokens = _decoder("Llama"), _tokens()
    program = capture_repeated(model, tokens) if stamped else fxpar.capture(model, tokens)
    assert (program.get(StampedLayers) is not None) == stamped
    with pytest.raises(InfeasiblePlanError) as caught:
        plan_program(program, Cluster((2,)), options=PlanOptions(memory_limit=10))
    assert caught.value.__notes__ == [
        "raised by pass 'choose-strategies' (after canonicalize, rematerialize, annotate-cost, "
        "annotate-strategies)"
    ]
