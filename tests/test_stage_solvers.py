"""The inter-operator solvers: the stage DP and the layer-clustering DP against brute force, the
submesh tiling, hand-worked examples and the errors."""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from collections.abc import Callable, Mapping
from typing import Any
from unittest import mock

import pytest
from hypothesis import assume, event, given, settings
from hypothesis import strategies as st

from fxpar.errors import FxparError
from fxpar.pipeline import default_schedules
from fxpar.solvers import stages as stages_module
from fxpar.solvers.layers import (
    DataEdge,
    LayerClusteringError,
    brute_force_layers,
    cluster_layers,
)
from fxpar.solvers.stages import (
    InvalidStageProblemError,
    NoStagePlanError,
    StageCost,
    StageCount,
    StageMemoryError,
    StagePlan,
    StageProblem,
    brute_force_stages,
    check_submesh_shapes,
    evaluate_stages,
    per_step_overcount,
    pipeline_step_time,
    place_submeshes,
    solve_each_stage_count,
    solve_stages,
)


def in_flight_of(schedule: str, microbatches: int) -> Callable[[int], tuple[int, ...]]:
    """What the pipeline hands the stage DP: each stage's micro-batches in flight, read off the
    named schedule's instruction lists for every stage count."""
    named = default_schedules()[schedule]
    return lambda stages: named.in_flight(stages, microbatches)


def stage_problem(*, schedule: str = "1f1b", **fields: Any) -> StageProblem:
    """A StageProblem under the named schedule (its in-flight counts included)."""
    counts = in_flight_of(schedule, fields["num_microbatches"])
    return StageProblem(schedule=schedule, in_flight_counts=counts, **fields)


# Meshes and the submesh shapes allowed on them (any subset of these tiles, given the counts).
MESHES: list[tuple[tuple[int, ...], list[tuple[int, ...]]]] = [
    ((1,), [(1,)]),
    ((2,), [(1,), (2,)]),
    ((3,), [(1,), (2,), (3,)]),
    ((4,), [(1,), (2,), (3,), (4,)]),
    ((8,), [(1,), (2,), (4,), (8,)]),
    ((1, 4), [(1, 1), (1, 2), (1, 4)]),
    ((2, 2), [(1, 1), (1, 2), (2, 2)]),
    ((2, 4), [(1, 1), (1, 2), (1, 4), (2, 4)]),
]


def random_table(
    seed: int, num_layers: int, shapes: list[tuple[int, ...]], missing: float
) -> dict[tuple[int, int, tuple[int, ...]], StageCost]:
    """Integral times and memory, so sums are exact and optima tie exactly."""
    rng = random.Random(seed)
    table = {}
    for start in range(num_layers):
        for stop in range(start + 1, num_layers + 1):
            for shape in shapes:
                if rng.random() < missing:
                    continue
                table[(start, stop, shape)] = StageCost(
                    time=float(rng.randint(1, 20)),
                    static_memory=float(rng.randint(0, 10)),
                    activation_memory=float(rng.randint(0, 5)),
                )
    return table


@st.composite
def stage_problems(draw: st.DrawFn) -> tuple[StageProblem, StageCount]:
    """1-6 layers on meshes of 1-8 devices, 1-4 shapes, M in {1, 2, 4, 8}, every schedule, no
    memory limit or one that may bind, up to half the table infeasible; a fixed or free K."""
    mesh_shape, allowed = draw(st.sampled_from(MESHES))
    shapes = draw(st.lists(st.sampled_from(allowed), min_size=1, max_size=4, unique=True))
    try:
        check_submesh_shapes(mesh_shape, shapes)
    except InvalidStageProblemError:
        assume(False)
    num_layers = draw(st.integers(1, 6))
    missing = draw(st.sampled_from([0.0, 0.2, 0.5]))
    table = random_table(draw(st.integers(0, 2**32 - 1)), num_layers, shapes, missing)
    problem = stage_problem(
        num_layers=num_layers,
        mesh_shape=mesh_shape,
        submesh_shapes=tuple(shapes),
        num_microbatches=draw(st.sampled_from([1, 2, 4, 8])),
        costs=table,
        memory_limit=draw(st.one_of(st.none(), st.integers(5, 60).map(float))),
        schedule=draw(st.sampled_from(default_schedules().searched())),
    )
    most = min(num_layers, problem.num_devices)
    stages: StageCount = draw(st.one_of(st.just("auto"), st.integers(1, most)))
    return problem, stages


def solve_or_error(solver, problem: StageProblem, stages: StageCount) -> StagePlan | FxparError:
    try:
        return solver(problem, stages)
    except NoStagePlanError as error:
        return error


def check_against_brute_force(problem: StageProblem, stages: StageCount) -> None:
    found = solve_or_error(solve_stages, problem, stages)
    reference = solve_or_error(brute_force_stages, problem, stages)
    event(type(found).__name__)
    assert type(found) is type(reference), (found, reference)
    if isinstance(found, StageMemoryError):
        assert isinstance(reference, StageMemoryError)
        assert found.least_memory == reference.least_memory
        assert found.least_memory > found.memory_limit
        # The least memory is enough: with that limit the DP finds a plan.
        enough = solve_stages(dataclasses.replace(problem, memory_limit=found.least_memory), stages)
        assert enough.peak_memory == found.least_memory
    if isinstance(found, StagePlan):
        assert isinstance(reference, StagePlan)
        assert found.objective == reference.objective
        assert found == evaluate_stages(problem, found.boundaries, found.submeshes)
        assert sum(stage.devices for stage in found.stages) == problem.num_devices
        if stages != "auto":
            assert found.num_stages == stages


@given(stage_problems())
@settings(max_examples=400)
def test_stage_dp_equals_brute_force(case: tuple[StageProblem, StageCount]) -> None:
    """The DP's step time is the least over all plans, its plan is valid and scores what it
    claims, and when nothing fits both agree on why and on the least memory needed."""
    check_against_brute_force(*case)


@given(stage_problems())
@settings(max_examples=100)
def test_stage_dp_in_tiny_batches_equals_brute_force(case: tuple[StageProblem, StageCount]) -> None:
    """With room for two bounds per batch, the pruning across batches still finds the optimum."""
    with mock.patch.object(stages_module, "_CELL_BUDGET", 1):
        check_against_brute_force(*case)


@st.composite
def multisets_filling(draw: st.DrawFn) -> tuple[tuple[int, ...], list[tuple[int, ...]]]:
    """An allowed mesh and shapes drawn from its family, topped up with unit shapes to fill it."""
    mesh_shape, allowed = draw(st.sampled_from(MESHES))
    total = math.prod(mesh_shape)
    shapes: list[tuple[int, ...]] = []
    for shape in draw(st.lists(st.sampled_from(allowed), max_size=8)):
        if sum(map(math.prod, shapes)) + math.prod(shape) <= total:
            shapes.append(shape)
    shapes += [(1,) * len(mesh_shape)] * (total - sum(map(math.prod, shapes)))
    return mesh_shape, draw(st.permutations(shapes))


@given(multisets_filling())
def test_allowed_submeshes_always_tile_the_mesh(
    case: tuple[tuple[int, ...], list[tuple[int, ...]]],
) -> None:
    """What makes counting devices sound: every allowed multiset filling the mesh is placed
    without overlap, inside the mesh, covering it."""
    mesh_shape, shapes = case
    covered: list[tuple[int, ...]] = []
    for origin, shape in zip(place_submeshes(mesh_shape, shapes), shapes, strict=True):
        covered += itertools.product(*(range(o, o + n) for o, n in zip(origin, shape, strict=True)))
    assert sorted(covered) == sorted(itertools.product(*(range(n) for n in mesh_shape)))


# ---- stage DP: hand-worked examples


def two_layer_problem(table: Mapping[Any, StageCost], **options: Any) -> StageProblem:
    """Two layers on two devices, stages of one device or of both."""
    return stage_problem(
        num_layers=2,
        mesh_shape=(2,),
        submesh_shapes=((1,), (2,)),
        costs=table,
        **options,
    )


@pytest.mark.parametrize(
    ("times", "once", "microbatches", "overcount"),
    [
        # The slowest stage (5) spends the most once a step (4): of its 4/4 a micro-batch the
        # objective counts 1/4 + 3/4; the other's 2/4: 0.5 more than the 4 paid.
        ((3.0, 5.0), (2.0, 4.0), 4, 0.5),
        # The slowest stage spends less than the other: (2 + 4)/4 + 3 * 2/4 = 3, one short
        # of the other's 4.
        ((5.0, 3.0), (2.0, 4.0), 4, -1.0),
        # One stage: its 1/M, M times, is what it pays.
        ((7.0,), (3.0,), 8, 0.0),
        # Nothing once a step: nothing to correct.
        ((1.0, 2.0, 3.0), (0.0, 0.0, 0.0), 4, 0.0),
    ],
)
def test_the_objective_overcounts_once_a_step_seconds_as_worked_by_hand(
    times: tuple[float, ...], once: tuple[float, ...], microbatches: int, overcount: float
) -> None:
    assert per_step_overcount(times, once, microbatches) == pytest.approx(overcount)


def test_pipeline_step_time_and_in_flight_counts() -> None:
    assert pipeline_step_time([1.0, 2.0, 3.0], 4) == 6.0 + 3 * 3.0
    assert pipeline_step_time([1.0, 2.0, 3.0], 1) == 6.0
    assert list(in_flight_of("1f1b", 2)(4)) == [2, 2, 2, 1]
    assert list(in_flight_of("1f1b", 8)(4)) == [4, 3, 2, 1]
    assert list(in_flight_of("gpipe", 8)(4)) == [8, 8, 8, 8]
    assert list(in_flight_of("zb-h1", 8)(4)) == [4, 4, 4, 4]
    assert list(in_flight_of("zb-h1", 2)(4)) == [2, 2, 2, 2]


def test_zb_h1_with_stages_free_weighs_each_count_by_its_own_memory() -> None:
    """Under ZB-H1 every stage keeps min(K, M) microbatches, so the memory of a stage depends
    on how many stages the plan has: two stages on one device each (1.5 per microbatch, a step
    of 4.5) beat one stage on both (3, a step of 6), but then both keep 2 microbatches and the
    second needs 2 + 2 * 1 = 4 bytes, over the limit of 3; the single stage keeps one (K = 1)
    and fits. Under 1F1B the last stage keeps one microbatch, so the pipeline fits there."""
    table = {
        (0, 2, (2,)): StageCost(3.0, 1.0, 1.0),
        (0, 1, (1,)): StageCost(1.5, 1.0, 1.0),
        (1, 2, (1,)): StageCost(1.5, 2.0, 1.0),
    }
    options: dict[str, Any] = dict(num_microbatches=2, memory_limit=3.0)
    zero_bubble = two_layer_problem(table, schedule="zb-h1", **options)
    plans = solve_each_stage_count(zero_bubble)
    assert [plan.num_stages for plan in plans] == [1]
    assert solve_stages(zero_bubble) == plans[0]
    assert solve_stages(two_layer_problem(table, schedule="1f1b", **options)).num_stages == 2
    unlimited = dataclasses.replace(zero_bubble, memory_limit=None)
    assert [plan.num_stages for plan in solve_each_stage_count(unlimited)] == [1, 2]
    assert [s.in_flight for s in solve_stages(unlimited).stages] == [2, 2]
    with pytest.raises(StageMemoryError, match="no stage count gives a plan that fits"):
        solve_each_stage_count(dataclasses.replace(zero_bubble, memory_limit=1.5))


def test_microbatches_decide_between_one_stage_and_a_pipeline() -> None:
    """One stage on both devices takes 3 per microbatch, two single-device stages 2 each:
    M = 1 costs 3 against 2 + 2, M = 4 costs 3 * 4 = 12 against 4 + 3 * 2 = 10."""
    table = {
        (0, 1, (1,)): StageCost(2.0, 0.0, 0.0),
        (1, 2, (1,)): StageCost(2.0, 0.0, 0.0),
        (0, 2, (2,)): StageCost(3.0, 0.0, 0.0),
    }
    single = solve_stages(two_layer_problem(table, num_microbatches=1))
    assert (single.submeshes, single.objective) == (((2,),), 3.0)
    pipelined = solve_stages(two_layer_problem(table, num_microbatches=4))
    assert (pipelined.boundaries, pipelined.submeshes) == ((1,), ((1,), (1,)))
    assert (pipelined.objective, pipelined.t_max) == (10.0, 2.0)


def test_1f1b_fits_a_pipeline_that_gpipe_cannot() -> None:
    """A byte per microbatch in flight, a limit of 2, M = 4: under 1F1B the first of two stages
    holds 2 microbatches and the second 1, so the pipeline (1 + 1 + 3 * 1 = 5) fits; under GPipe
    each holds 4, and only the single stage on both devices (half a byte each) fits, at 4 * 2.5."""
    table = {
        (0, 1, (1,)): StageCost(1.0, 0.0, 1.0),
        (1, 2, (1,)): StageCost(1.0, 0.0, 1.0),
        (0, 2, (2,)): StageCost(2.5, 0.0, 0.5),
    }
    options = {"num_microbatches": 4, "memory_limit": 2.0}
    one_f_one_b = solve_stages(two_layer_problem(table, schedule="1f1b", **options))
    assert one_f_one_b.objective == 5.0
    assert [(s.in_flight, s.memory) for s in one_f_one_b.stages] == [(2, 2.0), (1, 1.0)]
    gpipe = solve_stages(two_layer_problem(table, schedule="gpipe", **options))
    assert (gpipe.num_stages, gpipe.objective, gpipe.peak_memory) == (1, 10.0, 2.0)
    with pytest.raises(StageMemoryError) as raised:
        solve_stages(two_layer_problem(table, schedule="gpipe", **options), stages=2)
    assert (raised.value.least_memory, raised.value.memory_limit) == (4.0, 2.0)


def test_memory_error_says_how_much_the_most_frugal_plan_needs() -> None:
    table = {
        (0, 1, (1,)): StageCost(1.0, 3 * 2**30, 2**30),
        (1, 2, (1,)): StageCost(1.0, 2**30, 0.0),
        (0, 2, (2,)): StageCost(1.0, 5 * 2**30, 0.0),
    }
    problem = two_layer_problem(table, num_microbatches=2, memory_limit=float(2**30))
    with pytest.raises(FxparError) as raised:
        solve_stages(problem)
    error = raised.value
    assert isinstance(error, StageMemoryError)
    # Two stages: the first holds 3 GiB + 2 microbatches * 1 GiB; one stage: 5 GiB.
    assert (error.least_memory, error.memory_limit) == (5 * 2**30, 2**30)
    assert "5.00 GiB" in str(error) and "layers 0..1 on submesh (2,)" in str(error)


def test_no_plan_without_memory_trouble_is_not_a_memory_error() -> None:
    table = {(0, 1, (1,)): StageCost(1.0, 0.0, 0.0)}  # nothing covers layer 1
    with pytest.raises(NoStagePlanError) as raised:
        solve_stages(two_layer_problem(table, num_microbatches=2, memory_limit=1.0))
    assert not isinstance(raised.value, StageMemoryError)


def test_manual_plan_is_scored_like_the_solver_scores() -> None:
    table = {
        (0, 1, (1,)): StageCost(2.0, 1.0, 1.0),
        (1, 2, (1,)): StageCost(3.0, 0.0, 1.0),
    }
    problem = two_layer_problem(table, num_microbatches=3, memory_limit=3.0)
    plan = evaluate_stages(problem, [1], [(1,), (1,)])
    assert plan.objective == 2.0 + 3.0 + 2 * 3.0
    assert [(s.start, s.stop, s.memory) for s in plan.stages] == [(0, 1, 3.0), (1, 2, 1.0)]
    with pytest.raises(StageMemoryError):
        evaluate_stages(dataclasses.replace(problem, memory_limit=2.5), [1], [(1,), (1,)])
    with pytest.raises(NoStagePlanError):
        evaluate_stages(problem, [], [(2,)])  # the table has no entry for it
    bad_plans = [([0], [(1,), (1,)]), ([2], [(1,), (1,)]), ([1], [(2,)]), ([], [(1,)])]
    for boundaries, submeshes in bad_plans:
        with pytest.raises(InvalidStageProblemError):
            evaluate_stages(problem, boundaries, submeshes)


def test_callable_table_is_asked_once_per_entry() -> None:
    asked: list[tuple[int, int, tuple[int, ...]]] = []

    def cost(start: int, stop: int, submesh: tuple[int, ...]) -> StageCost:
        asked.append((start, stop, submesh))
        return StageCost(float(stop - start) / math.prod(submesh), 0.0, 0.0)

    problem = stage_problem(
        num_layers=3, mesh_shape=(2, 4), submesh_shapes=((1, 1), (1, 2), (1, 4), (2, 4)),
        num_microbatches=4, costs=cost,
    )  # fmt: skip
    solve_stages(problem)
    assert len(asked) == len(set(asked)) == 6 * 4


# ---- stage DP: bad inputs


def test_bad_stage_problems_are_rejected() -> None:
    table: dict[tuple[int, int, tuple[int, ...]], StageCost] = {}
    bad = [
        dict(num_layers=0, mesh_shape=(2,), submesh_shapes=((1,),), num_microbatches=1),
        dict(num_layers=2, mesh_shape=(2,), submesh_shapes=((1,),), num_microbatches=0),
        dict(num_layers=2, mesh_shape=(2,), submesh_shapes=((3,),), num_microbatches=1),
        dict(num_layers=2, mesh_shape=(4,), submesh_shapes=((3,),), num_microbatches=1),
        dict(num_layers=2, mesh_shape=(2, 4), submesh_shapes=((1, 3),), num_microbatches=1),
        dict(num_layers=2, mesh_shape=(2, 4), submesh_shapes=((2, 2),), num_microbatches=1),
        dict(num_layers=2, mesh_shape=(1, 6), submesh_shapes=((1, 2), (1, 3)), num_microbatches=1),
        dict(num_layers=2, mesh_shape=(2, 2, 2), submesh_shapes=((1, 1, 1),), num_microbatches=1),
        dict(num_layers=2, mesh_shape=(2,), submesh_shapes=(), num_microbatches=1),
    ]  # fmt: skip
    for options in bad:
        with pytest.raises(InvalidStageProblemError):
            stage_problem(costs=table, **options)


@pytest.mark.parametrize(
    "counts", [lambda stages: (1,) * (stages + 1), lambda stages: (-1,) * stages]
)
def test_in_flight_counts_not_one_per_stage_are_rejected(
    counts: Callable[[int], tuple[int, ...]],
) -> None:
    """The caller's in-flight counts must give one non-negative count per stage."""
    table = {(0, 2, (2,)): StageCost(1.0, 0.0, 0.0)}
    problem = StageProblem(2, (2,), ((1,), (2,)), 2, table, in_flight_counts=counts)
    with pytest.raises(InvalidStageProblemError, match="in_flight_counts"):
        solve_stages(problem)


def test_counts_that_follow_the_plans_stage_count_are_solved_one_count_at_a_time() -> None:
    """1F1B's and GPipe's counts follow the stages behind a stage; ZB-H1's follow the plan's K
    (every stage keeps min(K, M)), read off the lists, so the DP solves each K apart."""
    fields: dict[str, Any] = dict(
        num_layers=3, mesh_shape=(4,), submesh_shapes=((1,), (2,)), num_microbatches=4, costs={}
    )
    follows = {name: stage_problem(schedule=name, **fields).counts_follow_stages_behind()
               for name in default_schedules().searched()}  # fmt: skip
    assert follows == {"1f1b": True, "gpipe": True, "zb-h1": False}


@pytest.mark.parametrize("stages", [0, 3, 5, "some"])
def test_stage_count_out_of_range_is_rejected(stages: object) -> None:
    """2 layers on 4 devices: 1 or 2 stages, or "auto"."""
    problem = stage_problem(
        num_layers=2, mesh_shape=(4,), submesh_shapes=((1,), (2,)), num_microbatches=2, costs={}
    )
    with pytest.raises(InvalidStageProblemError, match="stages must be"):
        solve_stages(problem, stages)


def test_infinite_cost_is_rejected_not_treated_as_pruned() -> None:
    problem = two_layer_problem({(0, 2, (2,)): StageCost(math.inf, 0.0, 0.0)}, num_microbatches=1)
    with pytest.raises(InvalidStageProblemError, match="finite"):
        solve_stages(problem)


# ---- layer clustering


def crossing_bytes(edges: list[DataEdge], ranges: tuple[tuple[int, int], ...], count: str) -> int:
    """Bytes crossing layer boundaries, from the layer of each op (independent of the solver)."""
    layer = {op: k for k, (start, stop) in enumerate(ranges) for op in range(start, stop)}
    crossed = [layer[edge.target] - layer[edge.source] for edge in edges]
    if count == "once":
        return sum(edge.nbytes for edge, gap in zip(edges, crossed, strict=True) if gap > 0)
    return sum(edge.nbytes * gap for edge, gap in zip(edges, crossed, strict=True))


@st.composite
def layer_problems(draw: st.DrawFn) -> tuple[list[float], list[DataEdge], int, float, str]:
    """1-9 ops of integral cost (zero allowed), any forward edges, 1-n layers."""
    costs = draw(st.lists(st.integers(0, 10).map(float), min_size=1, max_size=9))
    pairs = [(i, j) for j in range(len(costs)) for i in range(j)]
    chosen = draw(st.lists(st.sampled_from(pairs), max_size=12)) if pairs else []
    edges = [DataEdge(i, j, draw(st.integers(0, 100))) for i, j in chosen]
    num_layers = draw(st.integers(1, len(costs)))
    delta = draw(st.sampled_from([0.0, 0.1, 0.5, 1.0]))
    return costs, edges, num_layers, delta, draw(st.sampled_from(["once", "per_boundary"]))


@given(layer_problems())
@settings(max_examples=200)
def test_layer_dp_equals_brute_force(
    case: tuple[list[float], list[DataEdge], int, float, str],
) -> None:
    """Same crossing bytes, same worst layer, same (possibly relaxed) limit, and a valid
    partition whose reported bytes match an independent count."""
    costs, edges, num_layers, delta, count = case
    found = cluster_layers(costs, edges, num_layers, delta=delta, count=count)
    reference = brute_force_layers(costs, edges, num_layers, delta=delta, count=count)
    key = ("crossing_bytes", "max_layer_cost", "cost_limit", "relaxed", "delta")
    assert [getattr(found, k) for k in key] == [getattr(reference, k) for k in key]
    assert found.ranges[0][0] == 0 and found.ranges[-1][1] == len(costs)
    assert all(a[1] == b[0] and a[0] < a[1] for a, b in itertools.pairwise(found.ranges))
    assert len(found.ranges) == num_layers
    assert found.max_layer_cost <= found.cost_limit
    assert found.crossing_bytes == crossing_bytes(edges, found.ranges, count)


def test_balance_limit_decides_where_a_chain_is_cut() -> None:
    """Four unit ops whose middle edge is heavy: a perfect balance must cut it, 50 % slack cuts
    a light edge instead (either one; both leave a layer of 3)."""
    edges = [(0, 1, 1), (1, 2, 10), (2, 3, 1)]
    strict = cluster_layers([1.0] * 4, edges, 2, delta=0.0)
    assert (strict.ranges, strict.crossing_bytes) == (((0, 2), (2, 4)), 10)
    loose = cluster_layers([1.0] * 4, edges, 2, delta=0.5)
    assert (loose.crossing_bytes, loose.max_layer_cost, loose.relaxed) == (1, 3.0, False)


def test_skip_connection_counts_once_or_per_boundary() -> None:
    edges = [(0, 1, 1), (1, 2, 1), (0, 2, 7)]
    once = cluster_layers([1.0] * 3, edges, 3, count="once")
    assert (once.boundary_bytes, once.crossing_bytes) == ((8, 1), 9)
    per_boundary = cluster_layers([1.0] * 3, edges, 3, count="per_boundary")
    assert (per_boundary.boundary_bytes, per_boundary.crossing_bytes) == ((8, 8), 16)
    assert once.layer_of_ops() == (0, 1, 2) and once.boundaries == (1, 2)


def test_unreachable_balance_is_relaxed_to_the_best_possible() -> None:
    """An op of cost 5 out of 8 cannot sit in a layer of at most 4: the limit becomes 5."""
    result = cluster_layers([5.0, 1.0, 1.0, 1.0], [(0, 1, 1), (1, 2, 10), (2, 3, 1)], 2, delta=0.0)
    assert (result.relaxed, result.cost_limit, result.delta) == (True, 5.0, 0.25)
    assert (result.ranges, result.crossing_bytes) == (((0, 1), (1, 4)), 1)


@pytest.mark.parametrize(
    ("costs", "edges", "num_layers", "options"),
    [
        ([], [], 1, {}),
        ([1.0, 1.0], [], 0, {}),
        ([1.0, 1.0], [], 3, {}),
        ([1.0, 1.0], [(1, 0, 4)], 1, {}),
        ([1.0, 1.0], [(0, 2, 4)], 1, {}),
        ([1.0, 1.0], [(0, 1, -4)], 1, {}),
        ([1.0, -1.0], [], 1, {}),
        ([1.0, 1.0], [], 1, {"delta": -0.1}),
        ([1.0, 1.0], [], 1, {"count": "twice"}),
    ],
)
def test_bad_layer_problems_are_rejected(
    costs: list[float], edges: list[tuple[int, int, int]], num_layers: int, options: dict
) -> None:
    with pytest.raises(LayerClusteringError):
        cluster_layers(costs, edges, num_layers, **options)
