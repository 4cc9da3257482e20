"""Ranks that share a host's cores: the schedule replayed with idle stages leaving their cores
to the others (replay_shared), the cluster's core demand, the pipeline step priced with it,
its measurement, and the bucketed gradient all-reduce that pipelines run."""

from __future__ import annotations

import functools
import math
import os
import random
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import tiny_gpt_program

import fxpar
from fxpar.errors import FxparError
from fxpar.pipeline import Pipeline, evaluate_split
from fxpar.pipeline.auto import plan_stages
from fxpar.pipeline.options import PipelineError
from fxpar.pipeline.partition import even_split_points
from fxpar.pipeline.schedule import Instruction, Op, StageTimes, replay, replay_shared
from fxpar.pipeline.schedules import build_schedule
from fxpar.runtime import waiting
from fxpar.runtime.core_sharing import fit_core_sharing, measure_core_sharing
from fxpar.runtime.launch import spawn


@pytest.mark.parametrize(
    ("name", "stages", "microbatches", "chunks", "placement"),
    [
        ("gpipe", 3, 4, 1, "loop"),
        ("1f1b", 4, 6, 1, "loop"),
        ("interleaved", 2, 4, 2, "loop"),
        ("zb-h1", 3, 5, 1, "loop"),
        ("zb-v", 2, 4, 2, "v"),
    ],
)
def test_at_one_speed_the_shared_replay_is_the_replay(
    name: str, stages: int, microbatches: int, chunks: int, placement: str
) -> None:
    lists = build_schedule(name, stages, microbatches, chunks)  # type: ignore[arg-type]
    generator = random.Random(0)
    for _ in range(5):
        uniform = generator.uniform
        times = [StageTimes(uniform(0.5, 2), uniform(0.5, 2), uniform(0, 1)) for _ in range(stages)]
        expected, _ = replay(lists, times, placement=placement)  # type: ignore[arg-type]
        found = replay_shared(lists, times, lambda computing: 1.0, placement=placement)  # type: ignore[arg-type]
        assert found == pytest.approx(expected, rel=1e-12)


def test_a_stage_computing_alone_runs_at_its_own_speed_as_worked_by_hand() -> None:
    """1F1B, two stages, two micro-batches, forward 1 and backward 2 (B 1, W 1); a stage
    computing alone runs twice as fast. Stage 0's F0 alone: 0.5. F1 beside stage 1's F0: 1.5.
    Stage 1's B0 alone (stage 0 waits for its gradient): 2.5. Stage 1's F1 beside stage 0's
    B0: 3.5, B0 has 1 left. Stage 1's B1 beside it: 4.5, B1 has 1 left. Stage 1 alone: 5.0.
    Stage 0's B1 alone: 6.0, where every stage at the speed of all takes 9."""
    lists = build_schedule("1f1b", 2, 2)
    times = [StageTimes(1.0, 1.0, 1.0)] * 2
    alone = replay_shared(lists, times, lambda computing: 2.0 if len(computing) == 1 else 1.0)
    assert alone == pytest.approx(6.0)
    assert replay(lists, times)[0] == pytest.approx(9.0)


def test_a_set_that_starts_computing_gets_its_speed_after_the_delay_as_worked_by_hand() -> None:
    """The same step with a delay of 0.25: each stretch of one stage alone first runs 0.25 at
    the speed of all. F0 alone: 0.25 at 1, then 0.75 at 2: 0.625. F1 beside stage 1's F0
    (speed 1, no delay to pay): 1.625. B0 alone: 0.25 at 1, 1.75 at 2: 2.75. F1 beside B0:
    3.75. B1 beside B0's last 1: 4.75. Stage 1's B1 alone (a new set): 0.25 at 1, 0.75 at 2:
    5.375. Stage 0's B1 alone (another set): 0.25 at 1, 1.75 at 2: 6.5."""
    lists = build_schedule("1f1b", 2, 2)
    times = [StageTimes(1.0, 1.0, 1.0)] * 2
    speed = lambda computing: 2.0 if len(computing) == 1 else 1.0  # noqa: E731
    assert replay_shared(lists, times, speed, delay=0.25) == pytest.approx(6.5)
    # A delay longer than every stretch leaves no speedup at all.
    assert replay_shared(lists, times, speed, delay=10.0) == pytest.approx(9.0)
    assert replay_shared(lists, times, speed, delay=0.0) == pytest.approx(6.0)


def test_the_shared_replay_refuses_what_cannot_run() -> None:
    times = [StageTimes(1.0, 1.0, 1.0)] * 2
    with pytest.raises(PipelineError, match="speed"):
        replay_shared(build_schedule("1f1b", 2, 2), times, lambda computing: 0.0)
    with pytest.raises(PipelineError, match="3 stage times for 2 stages"):
        replay_shared(build_schedule("1f1b", 2, 2), [*times, *times[:1]], lambda c: 1.0)
    stuck = [[Instruction(Op.RECV_ACTIVATION, 0)], [Instruction(Op.RECV_GRAD, 0)]]
    with pytest.raises(PipelineError, match="deadlocks"):
        replay_shared(stuck, times, lambda computing: 1.0)


@pytest.mark.parametrize(
    ("demand", "computing", "speedup"),
    [(None, 0.5, 1.0), (1.0, 0.5, 1.0), (2.0, 0.5, 2.0), (2.0, 0.25, 2.0), (4.0, 0.5, 2.0),
     (4.0, 0.25, 4.0), (1.5, 0.5, 1.5), (2.0, 0.75, 4 / 3), (0.5, 0.5, 1.0), (2.0, 1.0, 1.0)],
)  # fmt: skip
def test_compute_speedup_is_the_share_of_a_core_a_thread_gets(
    demand: float | None, computing: float, speedup: float
) -> None:
    """With every rank computing a thread gets min(1, 1/d) of a core, with the share f of
    them min(1, 1/(f d))."""
    cluster = fxpar.Cluster((4,), core_demand=demand)
    assert cluster.compute_speedup(computing) == pytest.approx(speedup)


@pytest.mark.parametrize("demand", [0.0, -1.0, math.nan, math.inf, "2"])
def test_a_bad_core_demand_is_named(demand: object) -> None:
    with pytest.raises(FxparError, match="core_demand"):
        fxpar.Cluster((2,), core_demand=demand)  # type: ignore[arg-type]


@pytest.mark.parametrize("delay", [-1e-3, math.nan, math.inf, "0.1"])
def test_a_bad_core_delay_is_named(delay: object) -> None:
    with pytest.raises(FxparError, match="core_delay"):
        fxpar.Cluster((2,), core_demand=1.5, core_delay=delay)  # type: ignore[arg-type]


def test_the_core_sharing_goes_to_a_cluster_file_and_back_only_when_set() -> None:
    written = fxpar.Cluster((2,)).to_dict()
    assert "core_demand" not in written and "core_delay" not in written
    cluster = fxpar.Cluster((4,), core_demand=1.5, core_delay=0.003)
    assert fxpar.Cluster.from_dict(cluster.to_dict()) == cluster
    with pytest.raises(FxparError, match="core_demand"):
        fxpar.Cluster.from_dict({"mesh_shape": [2], "core_demand": -1})
    with pytest.raises(FxparError, match="core_delay"):
        fxpar.Cluster.from_dict({"mesh_shape": [2], "core_delay": -1})


def test_a_cluster_file_keeps_its_core_sharing_only_for_as_many_ranks(tmp_path: Path) -> None:
    path = fxpar.Cluster((4,), core_demand=1.5, core_delay=0.003).save(tmp_path / "c.json")
    assert fxpar.Cluster.load(path).core_delay == 0.003
    assert fxpar.Cluster.load(path, (2, 2)).core_demand == 1.5
    other = fxpar.Cluster.load(path, (2,))
    assert other.core_demand is None and other.core_delay == 0.0


@pytest.mark.parametrize(
    ("together", "alone", "counted", "expected"),
    [
        # 8 and 32 ms with every rank computing; half of them: 2.7 ms at the speed of all,
        # then twice as fast: 5.35 and 17.35 ms.
        ((0.008, 0.032), (0.00535, 0.01735), 2.0, (2.0, 0.0027)),
        # The same speed at both lengths: no delay, the demand is the speedup.
        ((0.008, 0.032), (0.008 / 1.5, 0.032 / 1.5), 2.0, (1.5, 0.0)),
        # A line steeper than the count allows: the count, and the delay that line gives.
        ((0.01, 0.04), (0.004, 0.016), 2.0, (2.0, 0.0)),
        # No faster on half the ranks: a demand of 1, no delay.
        ((0.008, 0.032), (0.008, 0.032), 2.0, (1.0, 0.0)),
        ((0.008, 0.032), (0.009, 0.033), 2.0, (1.0, 0.0)),
    ],
)
def test_the_core_sharing_is_the_line_through_two_stretches_as_worked_by_hand(
    together: tuple[float, float],
    alone: tuple[float, float],
    counted: float,
    expected: tuple[float, float],
) -> None:
    """alone = delay + (together - delay) / demand, through both points."""
    demand, delay = fit_core_sharing(together, alone, counted)
    assert (demand, delay) == pytest.approx(expected, abs=1e-9)


def test_the_core_delay_prices_a_pipeline_slower_up_to_no_sharing_at_all() -> None:
    """The same demand, a longer delay: the idle stages' cores reach the others later; a
    delay longer than every stretch of the step leaves the step of no demand."""
    program = _gpt_program()
    pipeline = Pipeline(stages=even_split_points(program, 2), microbatches=4, data_parallel=2)

    def step(**sharing: float | None) -> float:
        cluster = fxpar.Cluster((4,), **sharing)  # type: ignore[arg-type]
        return evaluate_split(program, cluster, pipeline, optimizer_states=0).step_time

    # (The stages' forwards and backwards take tens of microseconds on the default cluster.)
    steps = [step(core_demand=2.0, core_delay=delay) for delay in (0.0, 1e-6, 1e-5, 10.0)]
    assert steps[0] < steps[1] < steps[2] < steps[3]
    assert steps[3] == pytest.approx(step(core_demand=None))


@functools.cache
def _gpt_program() -> fxpar.Program:
    return tiny_gpt_program(n_layer=4, batch=16)


def _pipeline_step(demand: float | None, schedule: str = "1f1b") -> float:
    program = _gpt_program()
    pipeline = Pipeline(
        stages=even_split_points(program, 2), microbatches=4, data_parallel=2, schedule=schedule
    )
    cluster = fxpar.Cluster((4,), core_demand=demand)
    return evaluate_split(program, cluster, pipeline, optimizer_states=0).step_time


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb-h1"])
def test_a_pipeline_on_shared_cores_is_priced_faster_by_what_its_bubble_frees(
    schedule: str,
) -> None:
    """No demand, or a demand of at most one thread a core, prices the step as before; the
    more the ranks outnumber the cores, the more the idle stages' cores are worth, up to
    every stretch of one stage alone running twice as fast (two stages: the step can at
    best halve)."""
    alone = _pipeline_step(None, schedule)
    assert _pipeline_step(1.0, schedule) == alone
    steps = [_pipeline_step(demand, schedule) for demand in (1.25, 1.5, 2.0, 4.0)]
    assert all(later < earlier for earlier, later in zip([alone, *steps], steps[:3], strict=False))
    assert steps[3] == pytest.approx(steps[2])  # at 2 a lone stage has a core per thread
    assert alone / 2 < steps[2] < alone


def _bucketed(rank: int, world_size: int) -> dict[str, bool]:
    generator = torch.Generator().manual_seed(rank)
    shapes = [(3, 5), (7,), (2, 2, 2), (40,), (1,), (6, 4)]
    dtypes = [torch.float32, torch.float64, torch.float32, torch.float32, torch.bfloat16,
              torch.float32]  # fmt: skip
    tensors = [
        torch.randn(shape, generator=generator).to(dtype)
        for shape, dtype in zip(shapes, dtypes, strict=True)
    ]
    one_by_one = [t.clone() for t in tensors]
    for tensor in one_by_one:
        dist.all_reduce(tensor)
    found = {}
    for limit in (1, 64, 2**20):  # a tensor a bucket, several a bucket, one bucket a dtype
        bucketed = [t.clone() for t in tensors]
        waiting.all_reduce_buckets(bucketed, bucket_bytes=limit)
        pairs = zip(bucketed, one_by_one, strict=True)
        found[str(limit)] = all(torch.equal(a, b) and a.dtype == b.dtype for a, b in pairs)
    return found


@pytest.mark.slow
def test_gradients_reduced_in_buckets_are_the_sums_reduced_one_by_one() -> None:
    expected = {"1": True, "64": True, "1048576": True}
    assert spawn(_bucketed, 2, timeout_s=120) == [expected, expected]


def _demands(
    rank: int, world_size: int
) -> tuple[float | None, tuple[float | None, float], tuple[float | None, float]]:
    torch.set_num_threads(1)
    return (
        waiting.core_demand(),
        measure_core_sharing(64, 0.002, warmup=1, repeats=4),
        measure_core_sharing(64, 0.0, warmup=1, repeats=4),
    )


@pytest.mark.slow
def test_the_measured_core_demand_lies_between_one_and_the_count() -> None:
    """The count is the world's threads over this host's cores; where it exceeds 1 the
    measured demand is between 1 and it and the delay between 0 and the long stretch, the
    same on every rank; else (and with no stretch to time) the demand is the count, with no
    delay."""
    found = spawn(_demands, 4, timeout_s=120)
    counted, (measured, delay), uncounted = found[0]
    assert all(f == found[0] for f in found)
    assert counted == pytest.approx(4 / len(os.sched_getaffinity(0)))
    assert uncounted == (counted, 0.0)
    if counted is not None and counted > 1:
        assert measured is not None and 1 <= measured <= counted
        assert 0 <= delay <= 0.008
    else:
        assert (measured, delay) == (counted, 0.0)


@pytest.mark.parametrize(("demand", "stages"), [(None, 1), (1.0, 1), (2.0, 2), (4.0, 2)])
def test_the_stage_dp_pipelines_deeper_the_more_the_ranks_share_cores(
    demand: float | None, stages: int
) -> None:
    """On four devices of fast links, one stage of four replicas is cheapest where every rank
    has a core; the more the ranks outnumber the cores, the more a pipeline's idle stages are
    worth, and the stage DP's choice (over the devices per stage, each priced by its
    re-priced step) moves to two stages. (Fast memory: the replicas' sums of each micro-batch's
    gradients, over all of the weights, would favour the pipeline on their own.)"""
    cluster = fxpar.Cluster((4,), core_demand=demand, bandwidth=(1.5e9,), memory_bandwidth=1e11)
    pipeline = Pipeline(stages="auto", microbatches=4)
    choice = plan_stages(_gpt_program(), cluster, pipeline, optimizer_states=0)
    assert choice.pipeline.num_stages == stages
    steps = {outcome.num_stages: outcome.step_time for outcome in choice.degrees}
    assert choice.step_time == min(step for step in steps.values() if step is not None)


def _alone(rank: int, world_size: int) -> tuple[float | None, tuple[float | None, float]]:
    torch.set_num_threads(2 * len(os.sched_getaffinity(0)))  # more threads than cores
    return waiting.core_demand(), measure_core_sharing(64, 0.002, warmup=1, repeats=3)


@pytest.mark.slow
def test_a_world_of_one_rank_keeps_the_counted_core_demand() -> None:
    """One rank of more threads than cores has no peers to leave idle: the count stands."""
    ((counted, measured),) = spawn(_alone, 1, timeout_s=120)
    assert counted == pytest.approx(2.0) and measured == (counted, 0.0)
