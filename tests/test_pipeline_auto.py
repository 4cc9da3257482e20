"""Automatic pipeline stages: plan_stages is optimal on its own cost model (brute force over
every split and devices-per-stage count), spreads a balanced model evenly, respects memory or
says how much is needed, models remat, clusters atoms into layers, and its split points really
cut the step; evaluate_split scores hand-made splits and rejects bad ones.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import io
import itertools
import json
import re
from pathlib import Path

import pytest
import torch
from conftest import eager_step

import fxpar
from fxpar import ir, plans
from fxpar.cluster import Cluster
from fxpar.models import GPT, GPTConfig, gpt_loss
from fxpar.passes import plan_program
from fxpar.pipeline import Pipeline, PipelineError, partition, split_program
from fxpar.pipeline.atoms import Atoms, region
from fxpar.pipeline.auto import StageChoice, evaluate_split, plan_stages, search_pipelines
from fxpar.pipeline.stage_costs import StageCostModel
from fxpar.solvers.stages import StageMemoryError, per_step_overcount

BATCH = 16
# Slow enough links that pipelining beats pure data parallelism for these small models.
CLUSTER = Cluster((4,), bandwidth=(1e9,))


@functools.cache
def _gpt(n_layer: int, batch: int = BATCH) -> tuple[GPT, torch.Tensor, torch.Tensor, fxpar.Program]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=n_layer, n_embd=64, n_head=4, vocab_size=64, block_size=16))
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 64, (BATCH, 16), generator=generator)
    targets = torch.randint(0, 64, (BATCH, 16), generator=generator)
    program = fxpar.capture(model, (tokens[:batch],), gpt_loss, example_targets=(targets[:batch],))
    return model, tokens, targets, program


def _every_split(
    program: fxpar.Program, cluster: Cluster, pipeline: Pipeline, cut_points: tuple[str, ...]
) -> list[StageChoice]:
    """evaluate_split on every contiguous cut of the layers for every devices-per-stage count,
    skipping those that do not fit memory or the batch."""
    choices = []
    world = cluster.world_size
    for devices in (d for d in range(1, world + 1) if world % d == 0):
        stages = world // devices
        for split in itertools.combinations(cut_points, stages - 1):
            candidate = Pipeline(
                stages=split,
                data_parallel=devices,
                microbatches=pipeline.microbatches,
                schedule=pipeline.schedule,
                remat=pipeline.remat,
            )
            try:
                choices.append(evaluate_split(program, cluster, candidate))
            except (StageMemoryError, PipelineError):
                continue  # does not fit, or the batch does not divide into M x d pieces
    return choices


# Slow, medium and fast links: the optimum is 4 stages, 2 stages of 2 devices, pure data
# parallelism; each with both schedules, with and without remat.
@pytest.mark.parametrize(
    ("bandwidth", "schedule", "remat"),
    [
        (1e7, "1f1b", False),
        (1e7, "gpipe", True),
        (1e9, "1f1b", True),
        (1e9, "gpipe", False),
        (1e11, "1f1b", False),
        (1e11, "gpipe", True),
    ],
)
def test_choice_is_the_brute_force_optimum(schedule: str, remat: bool, bandwidth: float) -> None:
    """Over every split point set and devices-per-stage count, none beats the chosen plan, and
    the chosen plan scores the same when evaluated as a manual split."""
    program = _gpt(4)[3]
    cluster = Cluster((4,), bandwidth=(bandwidth,))
    pipeline = Pipeline(microbatches=4, schedule=schedule, remat=remat)
    choice = plan_stages(program, cluster, pipeline)
    assert len(choice.cut_points) == 8  # wpe, blocks.0-3, ln_f, head, <loss>
    every = _every_split(program, cluster, pipeline, choice.cut_points)
    assert len(every) == 56 + 8 + 1
    best = min(every, key=lambda c: c.step_time)
    assert choice.step_time == pytest.approx(best.step_time, rel=1e-12)
    rescored = evaluate_split(program, cluster, choice.pipeline)
    assert rescored.step_time == pytest.approx(choice.step_time, rel=1e-12)
    assert rescored.memory == pytest.approx(choice.memory, rel=1e-12)


def test_bandwidth_moves_the_choice_between_pipeline_and_data_parallel() -> None:
    """Fast links make gradient all-reduces cheap (pure data parallelism wins); slow ones make
    the pipeline, which only sends one activation per micro-batch, win. (SGD: AdamW's update,
    which every replica runs on all of the weights and a stage on its own, would favour the
    pipeline on its own for a model this small; so would the sums of each micro-batch's
    gradients, hence fast memory.)"""
    program = _gpt(4)[3]
    pipeline = Pipeline(microbatches=4)
    fast_links = Cluster((4,), bandwidth=(1e12,), latency=(1e-7,), memory_bandwidth=1e13)
    fast = plan_stages(program, fast_links, pipeline, optimizer_states=0)
    slow = plan_stages(program, Cluster((4,), bandwidth=(1e8,)), pipeline, optimizer_states=0)
    assert fast.pipeline.data_parallel == 4 and fast.pipeline.num_stages == 1
    assert slow.pipeline.data_parallel == 1 and slow.pipeline.num_stages == 4


def test_balanced_model_gets_evenly_spread_blocks() -> None:
    """Eight equal blocks on four single-device stages: two blocks per stage."""
    program = _gpt(8)[3]
    choice = plan_stages(program, CLUSTER, Pipeline(microbatches=8))
    assert choice.pipeline.num_stages == 4 and choice.pipeline.data_parallel == 1
    assert choice.split_points == ("blocks.2", "blocks.4", "blocks.6")
    blocks = [[m for m in modules if m.startswith("blocks.")] for modules in choice.stage_modules]
    assert [len(b) for b in blocks] == [2, 2, 2, 2]
    assert choice.stage_modules[0][0] == "wte" and choice.stage_modules[-1][-1] == "<loss>"


def test_memory_limit_forces_more_stages() -> None:
    """Pure data parallelism holds every parameter and its AdamW state on every device; with
    less memory than that the choice splits the model over more stages, and fits."""
    program = _gpt(4)[3]
    # Memory fast enough that AdamW's update (every replica's over all the weights) is cheap.
    fast = Cluster((4,), bandwidth=(1e12,), latency=(1e-7,), memory_bandwidth=1e13)
    pipeline = Pipeline(microbatches=4)
    unlimited = plan_stages(program, fast, pipeline)
    assert unlimited.pipeline.num_stages == 1
    limit = unlimited.memory[0] * 0.7
    squeezed = plan_stages(program, dataclasses.replace(fast, memory=limit), pipeline)
    assert squeezed.pipeline.num_stages > 1
    assert max(squeezed.memory) <= limit
    assert squeezed.step_time > unlimited.step_time


def test_no_fit_raises_with_the_memory_needed() -> None:
    """Below what the most frugal split needs, StageMemoryError says that amount, which is the
    least peak memory over every split (brute force)."""
    program = _gpt(4)[3]
    pipeline = Pipeline(microbatches=4)
    tiny = Cluster((4,), bandwidth=(1e9,), memory=1024)
    with pytest.raises(StageMemoryError, match="most frugal needs") as caught:
        plan_stages(program, tiny, pipeline)
    cut_points = plan_stages(program, CLUSTER, pipeline).cut_points
    every = _every_split(program, CLUSTER, pipeline, cut_points)
    assert caught.value.least_memory == pytest.approx(min(max(c.memory) for c in every))
    assert caught.value.memory_limit == 1024
    with pytest.raises(StageMemoryError, match="per device"):
        evaluate_split(program, tiny, Pipeline(stages=("blocks.2",), data_parallel=2))


def test_remat_lowers_the_memory_estimate_and_costs_time() -> None:
    """The same split with remat keeps less per device (boundary activations only) and takes
    longer (the forward runs twice)."""
    program = _gpt(4)[3]
    split = ("blocks.1", "blocks.2", "blocks.3")
    stash = evaluate_split(program, CLUSTER, Pipeline(stages=split, schedule="gpipe"))
    remat = evaluate_split(program, CLUSTER, Pipeline(stages=split, schedule="gpipe", remat=True))
    assert all(r < s for r, s in zip(remat.memory, stash.memory, strict=True))
    assert remat.step_time > stash.step_time


def _does_work(node: torch.fx.Node) -> bool:
    cost = ir.get(node, ir.Cost)
    assert cost is not None
    return any(ir.evaluate(size) > 0 for size in (cost.flops, cost.bytes_read, cost.bytes_written))


@pytest.mark.parametrize("remat", [False, True])
@pytest.mark.parametrize("field", ["op_overhead", "op_fixed"])
def test_every_micro_batch_pays_each_calls_overhead_in_full(remat: bool, field: str) -> None:
    """A call's dispatch does not shrink with its share of the batch: on a cluster whose
    every ATen call costs ``h`` more, a stage of 2 replicas and 4 micro-batches takes ``h``
    more per call its micro-batch makes (the forward's twice under remat), not ``h / (M d)``,
    and once a step (a quarter of it per micro-batch) per parameter it updates (SGD's one
    call), per parameter whose micro-batches' gradients it sums (M - 1 adds) and for its
    gradients' bucket. The calls are counted here from the graph, not from
    the costs. So does an op's fixed cost (``op_fixed``), on the calls that do work (not
    views)."""
    program = _gpt(2)[3]
    atoms = Atoms.build(program, ())
    pipeline = Pipeline(stages="auto", microbatches=4, data_parallel=2, remat=remat)
    h = 1e-3
    base = StageCostModel(atoms, Cluster((4,)), pipeline, optimizer_states=0)
    priced = {"op_overhead": h} if field == "op_overhead" else {"op_fixed": {"*": h}}
    slow = StageCostModel(atoms, Cluster((4,), **priced), pipeline, optimizer_states=0)  # type: ignore[arg-type]
    start, stop = 0, atoms.count // 2
    calls = [
        node
        for atom in range(start, stop)
        for node in atoms.nodes[atom]
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
        and (field == "op_overhead" or _does_work(node))
    ]  # fmt: skip
    forward = [node for node in calls if region(node).phase is not ir.Phase.BACKWARD]
    assert 0 < len(forward) < len(calls)
    nodes = [node for atom in range(start, stop) for node in atoms.nodes[atom]]
    read = {value for node in nodes for value in node.all_input_nodes}
    placeholders = atoms.program.placeholders().values()  # the atoms' nodes: planning copies
    trainable = [n for n in placeholders if n in read and n in atoms.trainable]
    # A step's calls, a quarter of each per micro-batch: SGD's update, the sums of the 4
    # micro-batches' gradients, and the gradients packed into the replicas' bucket and copied
    # back.
    once = len(trainable) + 3 * len(trainable) + 2
    expected = (len(calls) + (len(forward) if remat else 0) + once / 4) * h
    added = slow.cost(start, stop, (2,)).time - base.cost(start, stop, (2,)).time
    assert added == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("microbatches", [1, 2, 4])
def test_a_stage_sums_its_micro_batches_gradients_once_a_step(microbatches: int) -> None:
    """The runtime adds each micro-batch's gradients to the stage's sums: M - 1 adds a step of
    every trainable parameter, each reading two gradients and writing one, beside SGD's
    update (one add of the same traffic): on one device, of a range that shares no weight
    with another (the blocks), nothing else is once a step."""
    program = _gpt(2)[3]
    atoms = Atoms.build(program, ())
    pipeline = Pipeline(stages="auto", microbatches=microbatches)
    model = StageCostModel(atoms, Cluster((2,), memory_bandwidth=10e9), pipeline,
                           optimizer_states=0)  # fmt: skip
    start, stop = atoms.index_of("blocks.0"), atoms.index_of("ln_f")
    weights = model.facts(start, stop).trainable_bytes
    assert weights > 0 and model.facts(start, stop).tied_bytes == 0
    cost = model.cost(start, stop, (1,))
    assert cost.per_step == pytest.approx(microbatches * 3 * weights / 10e9)


def test_stages_holding_a_tied_weight_sum_its_gradient_once_a_step() -> None:
    """GPT's head reads the embedding's weight: a stage holding one of the two and not the
    other sums that weight's gradient with the stage holding the other once a step, an
    all-reduce of two ranks (alpha + B / beta by hand) that a plan's step pays once after its
    stages' once-a-step work; one stage holding both does not."""
    program = _gpt(2)[3]
    atoms = Atoms.build(program, ())
    latency, bandwidth, microbatches = 1e-3, 1e8, 2
    cluster = Cluster((2,), latency=(latency,), bandwidth=(bandwidth,), memory_bandwidth=10e9)
    pipeline = Pipeline(stages="auto", microbatches=microbatches)
    model = StageCostModel(atoms, cluster, pipeline, optimizer_states=0)
    head, count = atoms.index_of("head"), atoms.count
    embedding = 64 * 64 * 4  # wte: vocabulary x n_embd float32
    assert model.facts(0, head).tied_bytes == model.facts(head, count).tied_bytes == embedding
    assert model.facts(0, count).tied_bytes == 0
    assert model.facts(atoms.index_of("blocks.0"), atoms.index_of("ln_f")).tied_bytes == 0
    for stages, tied in (
        ([(0, head, (1,)), (head, count, (1,))], latency + embedding / bandwidth),
        ([(0, count, (1,))], 0.0),
    ):
        costs = [model.cost(start, stop, shape) for start, stop, shape in stages]
        times, per_step = [c.time for c in costs], [c.per_step for c in costs]
        overcount = per_step_overcount(times, per_step, microbatches)
        assert model.tied_seconds(stages) == pytest.approx(tied, rel=1e-12)
        step = model.step_time(stages, 1.0)
        assert step == pytest.approx(1.0 - overcount + tied, rel=1e-12)


def test_layer_clustering_caps_the_layers() -> None:
    """With layers=5 the DP sees five contiguous layers covering every module once, chooses
    split points among their starts, and is optimal over them."""
    program = _gpt(8)[3]
    pipeline = Pipeline(microbatches=8)
    choice = plan_stages(program, CLUSTER, pipeline, layers=5)
    assert len(choice.layers) == 5
    modules = [m for layer in choice.layers for m in layer]
    assert modules == ["wte", "wpe", *(f"blocks.{i}" for i in range(8)), "ln_f", "head", "<loss>"]
    assert set(choice.split_points) <= set(choice.cut_points)
    every = _every_split(program, CLUSTER, pipeline, choice.cut_points)
    assert choice.step_time == pytest.approx(min(c.step_time for c in every), rel=1e-12)


def test_chosen_split_runs_and_gives_the_single_device_step() -> None:
    """The returned Pipeline's split points are accepted by partition(), make as many stages as
    planned, and the stage programs chained over micro-batches give eager PyTorch's step."""
    model, tokens, targets, program = _gpt(4)
    choice = plan_stages(program, Cluster((4,), bandwidth=(1e8,)), Pipeline(microbatches=4))
    points = choice.split_points
    assert choice.pipeline.num_stages == 4
    microbatch = _gpt(4, BATCH // 4)[3]
    split = split_program(microbatch, partition(microbatch, points), remat=False)
    assert split.num_stages == choice.pipeline.num_stages
    state = {
        name: tensor.detach()
        for name, tensor in {
            **dict(model.named_parameters()),
            **dict(model.named_buffers()),
        }.items()
    }
    pieces = [list(p) for p in zip(tokens.chunk(4), targets.chunk(4), strict=True)]
    result = split.run_microbatches(state, pieces)
    loss, grads = eager_step(copy.deepcopy(model), (tokens,), gpt_loss, (targets,))
    torch.testing.assert_close(result.loss, loss)
    for name, grad in grads.items():
        torch.testing.assert_close(result.gradients[name], grad, msg=name)


def test_report_names_every_stage_and_to_dict_is_json() -> None:
    """One row per stage with its first module and its memory; to_dict round-trips JSON."""
    program = _gpt(8)[3]
    choice = plan_stages(program, CLUSTER, Pipeline(microbatches=8))
    report = choice.report()
    rows = [line for line in report.splitlines() if line[:1].isdigit()]
    assert len(rows) == choice.pipeline.num_stages
    for index, (row, modules) in enumerate(zip(rows, choice.stage_modules, strict=True)):
        assert row.startswith(str(index)) and modules[0] in row
    assert "d=2" in report and "blocks.2, blocks.4, blocks.6" in report
    data = json.loads(json.dumps(choice.to_dict()))
    assert data["pipeline"]["stages"] == list(choice.split_points)
    assert [s["modules"] for s in data["stages"]] == [list(m) for m in choice.stage_modules]
    assert data["step_time"] == choice.step_time


def test_bad_requests_raise_clear_errors() -> None:
    """A split on the wrong number of devices, out of order or naming no module, a batch that
    divides for no devices-per-stage count, and too few cut points for the stages needed."""
    program = _gpt(4)[3]
    with pytest.raises(PipelineError, match="cluster has 4"):
        evaluate_split(program, CLUSTER, Pipeline(stages=("blocks.2",)))
    with pytest.raises(PipelineError, match="runs before"):
        evaluate_split(program, CLUSTER, Pipeline(stages=("blocks.3", "blocks.1", "ln_f")))
    with pytest.raises(PipelineError, match="names no module"):
        evaluate_split(program, CLUSTER, Pipeline(stages=("decoder.1",), data_parallel=2))
    with pytest.raises(PipelineError, match="stage 0 would hold no module"):
        evaluate_split(program, CLUSTER, Pipeline(stages=("wte",), data_parallel=2))
    with pytest.raises(PipelineError, match="does not split into 3 micro-batches"):
        plan_stages(program, CLUSTER, Pipeline(microbatches=3))
    # A batch of 16 in 16 micro-batches: one device per stage, so four stages, but two layers.
    with pytest.raises(PipelineError, match="4 stages need 3 cut points, the model has 1"):
        plan_stages(program, CLUSTER, Pipeline(microbatches=16), layers=2)


def test_manual_split_inside_a_layer_is_scored() -> None:
    """A split point below the layer level (a block's MLP) is accepted and named as given."""
    program = _gpt(4)[3]
    choice = evaluate_split(
        program, CLUSTER, Pipeline(stages=("blocks.1.mlp",), data_parallel=2, microbatches=4)
    )
    assert choice.split_points == ("blocks.1.mlp",)
    assert choice.stage_modules[1][0] == "blocks.1.mlp"
    assert "blocks.1" in choice.stage_modules[0]


def test_docs_section_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The example under "Choosing stages automatically" in docs/pipelines.md runs (that
    section's blocks alone, up to the next heading of its level, in a directory of its own)."""
    text = (Path(__file__).parent.parent / "docs" / "pipelines.md").read_text()
    section = text.split("## Choosing stages automatically", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)
    assert blocks
    monkeypatch.chdir(tmp_path)
    for block in blocks:
        with contextlib.redirect_stdout(io.StringIO()):
            exec(block, {"__name__": "docs"})


def test_choice_with_intra_op_stages_is_the_brute_force_optimum() -> None:
    """With a stage planner (Megatron inside every stage), the stage DP's choice beats or ties
    every split point set and stage count scored under the same plans, and records the stage
    mesh it runs on."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=64, n_head=4, vocab_size=64, block_size=16))
    tokens = torch.randint(0, 64, (BATCH, 16))
    program = fxpar.capture(model, (tokens,), gpt_loss, example_targets=(tokens,))
    planner = functools.partial(plan_program, manual=plans.tensor_parallel)
    cluster = Cluster((4,), bandwidth=(1e9,))
    pipeline = Pipeline(microbatches=4)
    choice = plan_stages(program, cluster, pipeline, stage_planner=planner)
    assert choice.stage_cluster is not None and choice.pipeline.data_parallel == 1
    assert choice.stage_cluster.world_size * choice.pipeline.num_stages == 4
    every = []
    for stages in (1, 2, 4):
        for split in itertools.combinations(choice.cut_points, stages - 1):
            candidate = Pipeline(stages=split, microbatches=4)
            try:
                every.append(evaluate_split(program, cluster, candidate, stage_planner=planner))
            except (StageMemoryError, PipelineError):
                continue
    assert len(every) == 20 + 6 + 1  # cut points: wpe, blocks.0-1, ln_f, head, <loss>
    best = min(every, key=lambda c: c.step_time)
    assert choice.step_time == pytest.approx(best.step_time, rel=1e-12)
    # The plans are not data parallelism: Megatron splits the blocks' weights, so one stage of
    # 4 devices holds less per device than 4 data-parallel replicas do.
    one = evaluate_split(program, cluster, Pipeline(stages=(), microbatches=4, data_parallel=4))
    four = evaluate_split(program, cluster, Pipeline(stages=(), microbatches=4),
                          stage_planner=planner)  # fmt: skip
    assert four.memory[0] < one.memory[0]


def test_search_over_schedules_and_remat_plans_each_mesh_once_and_keeps_the_best() -> None:
    """search_pipelines tries every setting on plans made once per stage mesh; each setting's
    outcome is what plan_stages gives for it alone, and the best of them is the choice."""
    _, _, _, program = _gpt(4)
    calls: list[tuple[int, ...]] = []

    def planner(program: fxpar.Program, cluster: Cluster) -> fxpar.Plan:
        calls.append(cluster.mesh_shape)
        return plan_program(program, cluster, manual=plans.tensor_parallel)

    settings = [
        Pipeline(stages="auto", microbatches=4, schedule=schedule, remat=remat)
        for schedule in ("1f1b", "gpipe")
        for remat in (False, True)
    ]
    search = search_pipelines(program, CLUSTER, settings, stage_planner=planner)
    assert sorted(calls) == [(1,), (2,), (4,)]  # one plan per shape for all four settings
    assert [o.pipeline for o in search.outcomes] == settings
    for outcome in search.outcomes:
        alone = plan_stages(program, CLUSTER, outcome.pipeline, stage_planner=planner)
        assert outcome.choice is not None
        assert outcome.choice.step_time == pytest.approx(alone.step_time, rel=1e-12)
        assert outcome.choice.split_points == alone.split_points
    assert search.choice is not None
    assert search.choice.step_time == min(o.choice.step_time for o in search.outcomes if o.choice)
    assert "settings tried: 1f1b, remat off: " in search.report()
    # Between what the most frugal pipeline of each needs, only remat fits, and is chosen.
    starved = search_pipelines(program, Cluster((4,), bandwidth=(1e9,), memory=1.0), settings,
                               stage_planner=planner)  # fmt: skip
    assert starved.choice is None and "no pipeline runs this step" in starved.report()
    need = {(o.pipeline.schedule, o.pipeline.remat): o.least_memory for o in starved.outcomes}
    assert all(least is not None for least in need.values())
    assert need["1f1b", True] < need["1f1b", False] <= need["gpipe", False]
    memory = (need["1f1b", True] + need["1f1b", False]) / 2
    limited = search_pipelines(program, Cluster((4,), bandwidth=(1e9,), memory=memory), settings,
                               stage_planner=planner)  # fmt: skip
    assert limited.choice is not None and limited.choice.pipeline.remat
    assert max(limited.choice.memory) <= memory
    with pytest.raises(PipelineError, match="same micro-batches"):
        search_pipelines(program, CLUSTER, [settings[0], Pipeline(microbatches=2)])
    with pytest.raises(PipelineError, match="interleaved"):
        search_pipelines(program, CLUSTER, [Pipeline(microbatches=4, schedule="interleaved",
                                                      virtual_stages=2)])  # fmt: skip


def test_a_stage_mesh_too_small_for_the_whole_step_is_priced_at_its_most_frugal_plan() -> None:
    """A single device cannot hold the whole step within its share of memory, but a stage
    holds only its layers: the (1,) mesh is still planned (at its most frugal plan) and
    priced, and every stage the DP keeps fits the limit."""
    _, _, _, program = _gpt(4)
    roomy = plan_stages(program, CLUSTER, Pipeline(microbatches=4), stage_planner=plan_program)
    whole = plan_program(program, CLUSTER.submesh((1,))).problem.least_memory()
    # Below what the whole step needs on one device with 4 devices' memory, above a stage's.
    memory = whole / 4 * 0.9
    tight = Cluster((4,), bandwidth=(1e9,), memory=memory)
    with pytest.raises(fxpar.errors.FxparError, match="no sharding plan fits"):
        plan_program(program, tight.submesh((1,)))
    choice = plan_stages(program, tight, Pipeline(microbatches=4), stage_planner=plan_program)
    assert all(outcome.reason == "" for outcome in choice.submeshes)
    assert max(choice.memory) <= memory
    assert choice.step_time >= roomy.step_time


@pytest.mark.parametrize(
    ("manual", "mesh", "summary"),
    [
        (plans.data_parallel, (2,), "axis0 (2): data parallel"),
        (plans.fully_sharded, (2,), "axis0 (2): fully sharded"),
        (plans.tensor_parallel, (2,), "axis0 (2): tensor parallel (weights 9"),
        (plans.tensor_parallel, (2, 2), "axis0 (2): data parallel; axis1 (2): tensor parallel"),
        (plans.data_parallel, (1, 2), "axis1 (2): data parallel"),
    ],
)
def test_layout_summary_names_what_each_axis_splits(manual, mesh, summary) -> None:  # type: ignore[no-untyped-def]
    _, _, _, program = _gpt(2)
    plan = plan_program(program, Cluster(mesh), manual=manual)
    assert plan.layout_summary().startswith(summary)
    assert plan_program(program, Cluster((1,))).layout_summary() == "one device"


def test_layout_summary_reads_past_a_batch_user_with_several_outputs() -> None:
    """A CNN's images are read by the convolution's backward, which returns three tensors: with
    the images whole (a tensor-parallel plan) the summary used to raise AnnotationError there."""
    import torch.nn.functional as F
    from zoo import CNN

    images, labels = torch.randn(8, 3, 8, 8), torch.randint(0, 10, (8,))
    program = fxpar.capture(CNN(), (images,), F.cross_entropy, example_targets=(labels,))
    planned = plan_program(program.copy(), Cluster((2,)), manual=plans.tensor_parallel)
    assert planned.layout_summary() == "axis0 (2): replicated"
    planned = plan_program(program, Cluster((2,)), manual=plans.data_parallel)
    assert planned.layout_summary() == "axis0 (2): data parallel"


def test_layout_summary_counts_a_batch_read_whole_and_split_where_used() -> None:
    """Token ids read whole by every device of an axis (they are small) and split by rows at
    the embedding are still data parallelism over that axis (each device computes its rows),
    as the ILP's plans of GPT-3's stages do; with the embedding's output whole the axis splits
    nothing."""
    from torch.distributed.tensor import Replicate, Shard

    from fxpar import ir
    from fxpar.sharding import Sharding, Strategy

    _, _, _, program = _gpt(2)
    plan = plan_program(program, Cluster((2,)), manual=plans.data_parallel)
    batch = [plan.program.placeholders()[name] for name in program.signature.inputs]
    whole = (Replicate(),)
    for node in batch:  # the tokens and targets read whole
        ir.annotate(node, Sharding(Strategy(outputs=(whole,), inputs=())))
    (embedding,) = [u for u in batch[0].users if u.target is torch.ops.aten.embedding.default]
    assert ir.require(embedding, Sharding).strategy.outputs[0] == (Shard(0),)
    assert plan.layout_summary() == "axis0 (2): data parallel"
    for node in batch:  # and every first use whole too
        for user in node.users:
            chosen = ir.require(user, Sharding).strategy
            outputs = tuple(whole if spec is not None else None for spec in chosen.outputs)
            ir.annotate(user, Sharding(Strategy(outputs=outputs, inputs=chosen.inputs)))
    assert plan.layout_summary() == "axis0 (2): replicated"
