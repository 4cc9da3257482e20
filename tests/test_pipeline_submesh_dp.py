"""Stages on meshes of their own (Alpa's submesh DP): with a stage planner, plan_stages chooses
each stage's mesh among several shapes at once. Its search equals brute force on random cost
tables and on the cost table of a real captured step; it picks meshes of different sizes when
the model makes that cheaper than every uniform pipeline (checked against every uniform split
scored independently), and keeps the uniform representation when uniform wins.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import random

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

import fxpar
from fxpar import plans
from fxpar.cluster import Cluster
from fxpar.errors import FxparError
from fxpar.models import GPT, GPTConfig, gpt_loss
from fxpar.passes import plan_program
from fxpar.pipeline import Pipeline, PipelineError, default_schedules
from fxpar.pipeline.auto import (
    StageChoice,
    evaluate_split,
    plan_stages,
    search_submeshes,
    stage_problem,
)
from fxpar.pipeline.meshes import stage_mesh, stage_meshes, submesh_shapes
from fxpar.pipeline.stage_costs import StagePlanner
from fxpar.solvers.stages import (
    NoStagePlanError,
    StageCost,
    StageMemoryError,
    StagePlan,
    StageProblem,
    brute_force_stages,
    check_submesh_shapes,
    evaluate_stages,
    per_step_overcount,
)

BATCH = 16
DATA_PARALLEL: StagePlanner = functools.partial(plan_program, manual=plans.data_parallel)
TENSOR_PARALLEL: StagePlanner = functools.partial(plan_program, manual=plans.tensor_parallel)


@functools.cache
def _program(n_layer: int, vocab_size: int = 64) -> fxpar.Program:
    torch.manual_seed(0)
    config = GPTConfig(n_layer=n_layer, n_embd=64, n_head=4, vocab_size=vocab_size, block_size=16)
    tokens = torch.randint(0, vocab_size, (BATCH, 16), generator=torch.Generator().manual_seed(1))
    return fxpar.capture(GPT(config), (tokens,), gpt_loss, example_targets=(tokens,))


# ---- the shapes offered


@pytest.mark.parametrize(
    ("mesh", "expected"),
    [
        ((3,), [(1,), (2,), (3,)]),
        ((6,), [(1,), (2,), (3,), (4,), (6,)]),
        ((8,), [(1,), (2,), (4,), (8,)]),
        ((2, 4), [(1, 1), (1, 2), (1, 4), (2, 4)]),
        ((3, 6), [(1, 1), (1, 2), (1, 6), (2, 6), (3, 6)]),
        # Rows: divisors of 12 and powers of two up to it (not 5, 7, 9, 10 or 11).
        ((12, 2), [(1, 1), *((r, 2) for r in (1, 2, 3, 4, 6, 8, 12))]),
        ((2, 2, 2), [(1,), (2,), (4,), (8,)]),
    ],
)
def test_submesh_shapes_are_alpas_and_tile_the_cluster(
    mesh: tuple[int, ...], expected: list[tuple[int, ...]]
) -> None:
    """1-D: divisors and powers of two; 2-D: single-row pieces of power-of-two width and whole
    rows; more axes: ranks in a row. Every offer passes the DP's tiling check."""
    dp_mesh, shapes = submesh_shapes(Cluster(mesh))
    assert list(shapes) == expected
    assert math.prod(dp_mesh) == math.prod(mesh)
    check_submesh_shapes(dp_mesh, shapes)


def test_stage_mesh_drops_axes_of_one() -> None:
    assert stage_mesh((1, 4)) == (4,)
    assert stage_mesh((1, 1)) == (1,)
    assert stage_mesh((2, 4)) == (2, 4)
    assert stage_mesh((3,)) == (3,)


# ---- the search against brute force, on random cost tables

CLUSTERS = [(1,), (3,), (4,), (6,), (2, 2), (1, 4), (3, 2), (2, 4)]


@st.composite
def submesh_problems(draw: st.DrawFn) -> StageProblem:
    """1-5 layers on a cluster of the list with every shape it offers, integral costs (so equal
    step times tie exactly) growing with the layers, some entries infeasible, M in {1, 2, 4},
    both schedules, a memory limit that may bind. One shape is often twice as fast as the
    others, so that plans on it alone win or tie as often as mixes do."""
    mesh_shape, shapes = submesh_shapes(Cluster(draw(st.sampled_from(CLUSTERS))))
    num_layers = draw(st.integers(1, 5))
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    missing = draw(st.sampled_from([0.0, 0.2]))
    cheap = draw(st.sampled_from([None, None, *shapes]))
    table: dict[tuple[int, int, tuple[int, ...]], StageCost] = {}
    for start, stop in itertools.combinations(range(num_layers + 1), 2):
        for shape in shapes:
            if rng.random() < missing:
                continue
            time = rng.randint(1, 6) * (stop - start) * (1 if shape == cheap else 2)
            table[(start, stop, shape)] = StageCost(
                float(time), float(rng.randint(0, 6)), float(rng.randint(0, 3))
            )
    microbatches = draw(st.sampled_from([1, 2, 4]))
    schedule = draw(st.sampled_from(["gpipe", "1f1b"]))
    named = default_schedules()[schedule]
    return StageProblem(
        num_layers=num_layers,
        mesh_shape=mesh_shape,
        submesh_shapes=shapes,
        num_microbatches=microbatches,
        costs=table,
        memory_limit=draw(st.sampled_from([None, 8.0, 12.0])),
        schedule=schedule,
        in_flight_counts=lambda stages: named.in_flight(stages, microbatches),
    )


def _best_uniform(problem: StageProblem) -> float:
    """Brute force over plans whose stages all have one shape (inf when there is none)."""
    best = math.inf
    for shape in problem.submesh_shapes:
        stages, left = divmod(problem.num_devices, math.prod(shape))
        if left or stages > problem.num_layers:
            continue
        alone = dataclasses.replace(problem, submesh_shapes=(shape,))
        try:
            best = min(best, brute_force_stages(alone, stages).objective)
        except NoStagePlanError:
            continue
    return best


@given(submesh_problems())
@settings(max_examples=300, deadline=None)
def test_search_equals_brute_force_and_prefers_uniform_on_ties(problem: StageProblem) -> None:
    """search_submeshes finds brute force's least step time over every stage count and mix of
    shapes, its plan scores what it claims, it returns a plan whose stages share one shape
    whenever some such plan is optimal, and when nothing fits it says how much memory the most
    frugal plan needs, as brute force does."""
    search = search_submeshes(problem)
    try:
        reference = brute_force_stages(problem)
    except StageMemoryError as error:
        event("nothing fits")
        assert search.plan is None
        assert min(e.least_memory for e in search.memory_errors) == error.least_memory
        return
    except NoStagePlanError:
        event("no plan")
        assert search.plan is None and not search.memory_errors
        return
    assert isinstance(search.plan, StagePlan)
    assert search.plan.objective == reference.objective
    assert search.plan == evaluate_stages(problem, search.plan.boundaries, search.plan.submeshes)
    uniform = len(set(search.plan.submeshes)) == 1
    event("uniform wins" if uniform else "mixed wins")
    assert uniform == (_best_uniform(problem) == reference.objective)
    best_alone = min((o.step_time for o in search.uniform if o.step_time is not None), default=None)
    if best_alone is not None:
        assert best_alone == _best_uniform(problem)


# ---- on real captured steps


@pytest.mark.parametrize(
    ("mesh", "planner"),
    [((3,), DATA_PARALLEL), ((4,), TENSOR_PARALLEL), ((2, 2), TENSOR_PARALLEL)],
    ids=["3-data-parallel", "4-tensor-parallel", "2x2-tensor-parallel"],
)
def test_choice_is_brute_force_on_the_same_problem(
    mesh: tuple[int, ...], planner: StagePlanner
) -> None:
    """On a two-block GPT, plan_stages's step time is brute force's least over every stage
    count, cut and mix of shapes of the very problem stage_problem builds; the choice's
    stages are that problem's plan, their meshes its shapes without axes of one."""
    program = _program(2)
    cluster = Cluster(mesh, bandwidth=(1e8,))
    pipeline = Pipeline(microbatches=4)
    choice = plan_stages(program, cluster, pipeline, stage_planner=planner)
    problem = stage_problem(program, cluster, pipeline, stage_planner=planner)
    assert problem.num_layers == 7  # wte + wpe, blocks.0-1, ln_f, head, <loss>
    reference = brute_force_stages(problem)
    # The step pays each stage's once-a-step seconds once, where the objective spreads them
    # over the micro-batches (solvers.per_step_overcount); the split is the same.
    assert choice.plan.objective == pytest.approx(reference.objective, rel=1e-12)
    stages = reference.stages
    overcount = per_step_overcount(
        [s.time for s in stages], [s.per_step for s in stages], pipeline.microbatches
    )
    # And the tied embedding's gradient summed between the stages holding it, once.
    holders = [i for i, modules in enumerate(choice.stage_modules) if {"wte", "head"} & {*modules}]
    assert (choice.tied_seconds > 0) == (len(holders) > 1)
    paid = reference.objective - overcount + choice.tied_seconds
    assert choice.step_time == pytest.approx(paid, rel=1e-12)
    assert choice.plan == evaluate_stages(problem, choice.plan.boundaries, choice.plan.submeshes)
    assert choice.stage_mesh_shapes == tuple(stage_mesh(s) for s in choice.plan.submeshes)
    assert sum(choice.stage_devices) == cluster.world_size


def _every_uniform_split(
    program: fxpar.Program, cluster: Cluster, planner: StagePlanner, cut_points: tuple[str, ...]
) -> list[StageChoice]:
    """evaluate_split on every split into K stages of world / K devices each, but those on a
    mesh the planner refuses."""
    world = cluster.world_size
    scored = []
    for stages in (k for k in range(1, world + 1) if world % k == 0):
        for split in itertools.combinations(cut_points, stages - 1):
            candidate = Pipeline(stages=split, microbatches=4)
            try:
                scored.append(evaluate_split(program, cluster, candidate, stage_planner=planner))
            except FxparError as error:
                assert "divisible by the" in str(error)  # a batch of 16 on 3 devices
    return scored


@pytest.mark.parametrize(
    ("mesh", "vocab_size", "meshes"),
    [((3,), 64, ((1,), (2,))), ((4,), 1024, ((1,), (1,), (2,)))],
    ids=["3-devices", "heavy-head"],
)
def test_non_uniform_meshes_win_when_cheaper(
    mesh: tuple[int, ...], vocab_size: int, meshes: tuple[tuple[int, ...], ...]
) -> None:
    """Data parallelism inside stages on slow links. On 3 devices, whose batch of 16 does not
    split over a 3-device stage, one stage of 1 and one of 2 beat three stages of 1; with a
    1024-word head, that stage on 2 devices and the rest on 1 and 1 beat every uniform
    pipeline. Each uniform split is scored independently (evaluate_split), all are slower,
    and rescoring the chosen stage meshes gives the same step time and memory."""
    program = _program(2, vocab_size)
    cluster = Cluster(mesh, bandwidth=(1e8,))
    choice = plan_stages(program, cluster, Pipeline(microbatches=4), stage_planner=DATA_PARALLEL)
    assert choice.pipeline.stage_meshes == meshes
    assert choice.stage_cluster is None and choice.pipeline.world_size == cluster.world_size
    uniform = _every_uniform_split(program, cluster, DATA_PARALLEL, choice.cut_points)
    assert len(uniform) == {3: 15, 4: 1 + 6 + 20}[cluster.world_size]  # 6 cut points
    assert choice.step_time < min(c.step_time for c in uniform)
    assert choice.step_time < min(o.step_time for o in choice.degrees if o.step_time is not None)
    assert choice.mixed_step_time == choice.step_time
    rescored = evaluate_split(program, cluster, choice.pipeline, stage_planner=DATA_PARALLEL)
    assert rescored.step_time == pytest.approx(choice.step_time, rel=1e-12)
    assert rescored.memory == pytest.approx(choice.memory, rel=1e-12)
    assert rescored.pipeline == choice.pipeline


def test_a_mesh_the_planner_refuses_is_left_out_and_reported() -> None:
    """Data parallelism cannot split a batch of 16 over 3 devices: that mesh is reported with
    the planner's reason, and the other meshes still make a plan."""
    choice = plan_stages(
        _program(2), Cluster((3,), bandwidth=(1e8,)), Pipeline(microbatches=4),
        stage_planner=DATA_PARALLEL,
    )  # fmt: skip
    reasons = {outcome.shape: outcome.reason for outcome in choice.submeshes}
    assert reasons[(1,)] == reasons[(2,)] == ""
    assert "divisible by the 3" in reasons[(3,)]
    assert "(3,): FxparError" in choice.report()


def test_uniform_winner_keeps_the_uniform_representation() -> None:
    """Tensor parallelism inside stages on 1 GB/s links: two stages of 2 devices win; the
    choice is a uniform pipeline (no stage_meshes) whose stage_cluster is the (2,) mesh, as
    before submeshes, and the search over mixes found nothing better."""
    program = _program(2)
    cluster = Cluster((4,), bandwidth=(1e9,))
    choice = plan_stages(program, cluster, Pipeline(microbatches=4), stage_planner=TENSOR_PARALLEL)
    assert choice.pipeline.stage_meshes is None and choice.pipeline.num_stages == 2
    assert choice.stage_cluster is not None and choice.stage_cluster.mesh_shape == (2,)
    assert choice.devices_per_stage == 2
    assert choice.mixed_step_time == pytest.approx(choice.step_time, rel=1e-12)
    uniform = _every_uniform_split(program, cluster, TENSOR_PARALLEL, choice.cut_points)
    assert len(uniform) == 1 + 6 + 20
    assert choice.step_time == pytest.approx(min(c.step_time for c in uniform), rel=1e-12)


def test_report_and_to_dict_show_each_stage_mesh() -> None:
    """A mixed choice's report has a mesh column and the ranks of every stage; to_dict names
    the stage meshes and round-trips JSON."""
    choice = plan_stages(
        _program(2), Cluster((3,), bandwidth=(1e8,)), Pipeline(microbatches=4),
        stage_planner=DATA_PARALLEL,
    )  # fmt: skip
    report = choice.report()
    assert "2 stages on meshes (1,), (2,) (3 devices)" in report
    rows = [line.split() for line in report.splitlines() if line[:1].isdigit()]
    assert [row[0] for row in rows] == ["0", "1"]
    assert "1 (rank 0)" in report and "2 (ranks 1-2)" in report
    assert "stages on any mix of meshes" in report and "d=1 (3 stages on (1,))" in report
    with pytest.raises(PipelineError, match="different sizes"):
        _ = choice.devices_per_stage
    data = json.loads(json.dumps(choice.to_dict()))
    assert data["pipeline"]["stage_meshes"] == [[1], [2]]
    assert data["pipeline"]["stage_mesh"] is None
    assert [stage["mesh"] for stage in data["stages"]] == [[1], [2]]
    assert data["mixed"]["step_time"] == choice.step_time


def test_stages_are_placed_so_that_none_crosses_a_row() -> None:
    """On a 2x2 cluster, meshes (1,), (2,), (1,) would put the middle stage on ranks 1 and 2,
    two rows, if stages took consecutive ranks. The runtime places it on a row of its own
    (Alpa's tiling, fxpar.pipeline.meshes.stage_meshes), so the choice names no stage crossing
    a row and the report has no warning. Meshes that do not tile the cluster as Alpa's (3
    devices on rows of 2) keep consecutive ranks: the (2,) stage after them, on ranks 3 and 4,
    crosses a row and is named."""
    program = _program(2)
    cluster = Cluster((2, 2), bandwidth=(1e9, 1e8))
    split = ("blocks.0", "ln_f")

    def scored(meshes: tuple[tuple[int, ...], ...], where: Cluster = cluster) -> StageChoice:
        pipeline = Pipeline(stages=split[: len(meshes) - 1], microbatches=4, stage_meshes=meshes)
        return evaluate_split(program, where, pipeline, stage_planner=TENSOR_PARALLEL)

    placed = scored(((1,), (2,), (1,)))
    assert placed.crossing == () and "warning" not in placed.report()
    ranks = stage_meshes(placed.pipeline, cluster)
    assert [ranks.ranks(s) for s in range(3)] == [(2,), (0, 1), (3,)]
    assert scored(((2,), (1,), (1,))).crossing == ()
    rows_of_two = Cluster((3, 2), bandwidth=(1e9, 1e8))
    crossing = scored(((3,), (2,), (1,)), rows_of_two)
    assert crossing.crossing == (1,) and "warning: stage(s) 1 cross a row" in crossing.report()


def test_stage_meshes_need_a_planner_and_the_whole_cluster() -> None:
    program = _program(2)
    cluster = Cluster((3,))
    with pytest.raises(PipelineError, match="pass the stage_planner"):
        evaluate_split(program, cluster, Pipeline(stages=("ln_f",), stage_meshes=((1,), (2,))))
    with pytest.raises(PipelineError, match="hold 4 devices, but the cluster has 3"):
        evaluate_split(
            program, cluster, Pipeline(stages=("ln_f",), stage_meshes=((2,), (2,))),
            stage_planner=DATA_PARALLEL,
        )  # fmt: skip
