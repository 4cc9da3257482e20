"""The wait for the slowest rank on ranks that share a host's cores (``Cluster.lag_share``).

A step pays ``lag_share * max(0, stretch - lag_stretch)`` at every collective that
synchronises the ranks, ``stretch`` the compute since the last one
(:func:`fxpar.planning.step_time.step_lag`); a pipeline stage at each message it waits for and
its replicas' gradient reduction (:mod:`fxpar.pipeline.stage_costs`). Expected values are
worked from the plans' priced compute and the formula, not from the functions under test.
"""

from __future__ import annotations

import functools
import math
import os
from pathlib import Path

import pytest
import torch
import torch.fx as fx
from conftest import tiny_gpt_program

import fxpar
from fxpar import plans
from fxpar.errors import FxparError
from fxpar.passes import plan_program
from fxpar.pipeline import Pipeline
from fxpar.pipeline.atoms import Atoms
from fxpar.pipeline.stage_costs import StageCostModel
from fxpar.planning.collective_schedule import CollectiveRecord, Reshard, WaitGather
from fxpar.planning.step_time import PricedSchedule, price_schedule
from fxpar.runtime import waiting
from fxpar.runtime.core_sharing import measure_lag
from fxpar.runtime.launch import spawn

LAG = {"lag_share": 0.5, "lag_stretch": 0.0}


@functools.cache
def _program() -> fxpar.Program:
    return tiny_gpt_program(batch=16)


def _planned(manual: object, cluster: fxpar.Cluster) -> fxpar.Program:
    return plan_program(_program(), cluster, manual=manual).program


# -- the cluster's fields -----------------------------------------------------------------------


def test_lag_seconds_is_the_share_of_the_stretch_beyond_the_calibrated_one() -> None:
    cluster = fxpar.Cluster((4,), lag_share=0.1, lag_stretch=0.002)
    assert cluster.lag_seconds(0.012) == pytest.approx(0.001)
    assert cluster.lag_seconds(0.001) == 0.0
    assert fxpar.Cluster((4,)).lag_seconds(10.0) == 0.0


@pytest.mark.parametrize("field", ["lag_share", "lag_stretch"])
@pytest.mark.parametrize("value", [-0.1, math.nan, math.inf])
def test_a_bad_lag_is_named(field: str, value: float) -> None:
    with pytest.raises(FxparError, match=field):
        fxpar.Cluster((2,), **{field: value})  # type: ignore[arg-type]
    with pytest.raises(FxparError, match=field):
        fxpar.Cluster.from_dict({"mesh_shape": [2], field: -1})


def test_the_lag_goes_to_a_cluster_file_only_for_as_many_ranks(tmp_path: Path) -> None:
    assert "lag_share" not in fxpar.Cluster((2,)).to_dict()
    cluster = fxpar.Cluster((4,), lag_share=0.1, lag_stretch=0.002)
    assert fxpar.Cluster.from_dict(cluster.to_dict()) == cluster
    path = cluster.save(tmp_path / "cluster.json")
    assert fxpar.Cluster.load(path, (2, 2)).lag_share == 0.1
    other = fxpar.Cluster.load(path, (2,))
    assert (other.lag_share, other.lag_stretch) == (0.0, 0.0)


# -- the step's lag -----------------------------------------------------------------------------


def test_a_plan_without_collectives_waits_for_no_peer() -> None:
    cluster = fxpar.Cluster((4,), **LAG)
    priced = price_schedule(_planned(plans.replicated, cluster), cluster)
    assert priced.records == () and priced.lag == 0.0


def test_data_parallelism_waits_once_a_step_for_the_lag_of_its_whole_compute() -> None:
    """The gradients' buckets are waited for where the step returns; nothing else waits
    before (but the small reductions of the loss, made at the forward's end). With
    ``lag_stretch`` 0 the lag is linear in the stretches: half of all the step's compute."""
    cluster = fxpar.Cluster((4,), **LAG)
    priced = price_schedule(_planned(plans.data_parallel, cluster), cluster)
    compute = sum(priced.compute.values())
    assert priced.lag == pytest.approx(0.5 * compute)
    plain = price_schedule(_planned(plans.data_parallel, fxpar.Cluster((4,))), fxpar.Cluster((4,)))
    assert priced.step - plain.step == pytest.approx(priced.lag)


def _stretches(program: fxpar.Program, cluster: fxpar.Cluster) -> list[float]:
    """The compute between the waits of ``program``'s schedule, worked here from its
    actions: a conversion by collectives waits, a gather group waits where it is waited for,
    and the results' buckets where the step returns."""
    priced = price_schedule(program, cluster)
    schedule = priced.schedule
    stretches, stretch = [], 0.0
    for node in program.graph.nodes:
        actions = schedule.inputs[node].actions if node in schedule.inputs else ()
        if any(
            (isinstance(a, Reshard) and a.records) or isinstance(a, WaitGather) for a in actions
        ):
            stretches.append(stretch)
            stretch = 0.0
        stretch += priced.compute.get(node, 0.0)
    stretches.append(stretch if schedule.leaving.buckets else 0.0)
    return stretches


@pytest.mark.parametrize("manual", [plans.fully_sharded, plans.tensor_parallel])
def test_each_wait_pays_the_lag_of_the_compute_since_the_last(manual: object) -> None:
    """Fully sharded and tensor parallel plans wait often: each stretch pays its share beyond
    ``lag_stretch``, so a ``lag_stretch`` of the median stretch leaves the longer half to
    pay, and one longer than any leaves nothing."""
    plain = fxpar.Cluster((4,))
    program = _planned(manual, plain)
    stretches = _stretches(program, plain)
    assert len([s for s in stretches if s > 0]) > 2
    middle = sorted(stretches)[len(stretches) // 2]
    for limit in (0.0, middle, 2 * max(stretches)):
        cluster = fxpar.Cluster((4,), lag_share=0.5, lag_stretch=limit)
        expected = sum(0.5 * max(0.0, stretch - limit) for stretch in stretches)
        assert price_schedule(program, cluster).lag == pytest.approx(expected)


def test_the_estimate_and_the_report_carry_the_lag() -> None:
    cluster = fxpar.Cluster((4,), **LAG)
    plan = fxpar.passes.plan_program(_program(), cluster, manual=plans.data_parallel)
    plain = fxpar.passes.plan_program(_program(), fxpar.Cluster((4,)), manual=plans.data_parallel)
    lag = price_schedule(plan.program, cluster).lag
    assert lag > 0 and plan.estimate - plain.estimate == pytest.approx(lag)
    assert "waiting for the slowest rank" in plan.report()
    assert "waiting for the slowest rank" not in plain.report()


# -- the wait the latency holds -----------------------------------------------------------------

WAIT = 0.004
"""The peer wait of the clusters below: within their latency (5 ms)."""


def _waiting(lag_stretch: float, **fields: object) -> fxpar.Cluster:
    return fxpar.Cluster((4,), latency=(0.005,), peer_wait=(WAIT,), lag_stretch=lag_stretch,
                         **fields)  # type: ignore[arg-type]  # fmt: skip


def test_the_peer_wait_grows_with_the_compute_before_up_to_its_stretch() -> None:
    cluster = _waiting(0.002)
    assert [cluster.peer_wait_seconds(0, s) for s in (0.0, 0.001, 0.002, 0.5)] == pytest.approx(
        [0.0, WAIT / 2, WAIT, WAIT]
    )
    # Measured after no known stretch: the whole wait, whatever the compute before.
    assert _waiting(0.0).peer_wait_seconds(0, 0.0) == WAIT
    assert fxpar.Cluster((4,)).peer_wait == (0.0,)


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"peer_wait": (-0.001,)}, "finite numbers >= 0"),
        ({"peer_wait": (math.nan,)}, "finite numbers >= 0"),
        ({"peer_wait": (0.001, 0.001)}, "at most 1"),
        ({"peer_wait": (0.006,)}, "more than a latency"),
        ({"peer_wait": (0.003,), "collective_links": (fxpar.CollectiveLink("all_gather", 0,
                                                      0.002, 1e9),)}, "more than a latency"),
    ],
)  # fmt: skip
def test_a_bad_peer_wait_is_named(fields: dict[str, object], words: str) -> None:
    with pytest.raises(FxparError, match=f"peer_wait.*{words}"):
        fxpar.Cluster((4,), latency=(0.005,), **fields)  # type: ignore[arg-type]
    with pytest.raises(FxparError, match="peer_wait"):
        fxpar.Cluster.from_dict({"mesh_shape": [4], "peer_wait": [-1]})


def test_a_send_line_holds_no_peer_wait() -> None:
    """A send waits for one peer: its lines may lie below the wait of the axis' collectives."""
    send = fxpar.CollectiveLink("send", 0, 0.0001, 1e9)
    assert _waiting(0.0, collective_links=(send,)).peer_wait == (WAIT,)


def test_the_peer_wait_goes_to_cluster_files_and_stage_meshes(tmp_path: Path) -> None:
    assert "peer_wait" not in fxpar.Cluster((2,)).to_dict()
    cluster = fxpar.Cluster((2, 2), latency=(0.005, 0.003), peer_wait=(0.004, 0.002),
                            lag_stretch=0.002)  # fmt: skip
    assert fxpar.Cluster.from_dict(cluster.to_dict()) == cluster
    path = cluster.save(tmp_path / "cluster.json")
    assert fxpar.Cluster.load(path).peer_wait == (0.004, 0.002)
    # A mesh of another number of axes takes the last axis' links, its wait with them.
    assert fxpar.Cluster.load(path, (4,)).peer_wait == (0.002,)
    # A stage of two consecutive ranks runs on the inner axis' links.
    assert cluster.submesh((2,)).peer_wait == (0.002,)


def _issue_order(program: fxpar.Program, priced: PricedSchedule) -> list[tuple[int, float]]:
    """Each collective of a priced schedule (its index among the schedule's records) with the
    compute before it since the one before
    on its axis, worked here from the schedule: the collectives of each op's conversions and
    gather groups before the op, each bucket after its last member, the results' conversions
    at the end; one axis, so a single running stretch. The first collective follows the
    step before's last, and its optimizer's update after the graph (steps repeat)."""
    schedule, compute = priced.schedule, priced.compute
    index = {id(record): i for i, record in enumerate(schedule.records)}
    buckets: dict[fx.Node, list[CollectiveRecord]] = {}
    for bucket in schedule.leaving.buckets:
        buckets.setdefault(bucket.starts_after, []).extend(bucket.records)
    order: list[tuple[int, float]] = []
    stretch = 0.0
    for node in program.graph.nodes:
        for action in schedule.inputs[node].actions if node in schedule.inputs else ():
            for record in getattr(action, "records", ()):
                order.append((index[id(record)], stretch))
                stretch = 0.0
        stretch += compute.get(node, 0.0)
        for record in buckets.get(node, ()):
            order.append((index[id(record)], stretch))
            stretch = 0.0
    for action in schedule.leaving.actions:
        for record in getattr(action, "records", ()):
            order.append((index[id(record)], stretch))
            stretch = 0.0
    first, before = order[0]
    order[0] = (first, before + stretch + priced.update)
    return order


@pytest.mark.parametrize("manual", [plans.fully_sharded, plans.data_parallel])
def test_each_collective_waits_for_the_compute_since_the_last_on_its_axis(
    manual: object,
) -> None:
    """A collective's price holds the peer wait its compute before leaves (in proportion up
    to ``lag_stretch``, then all of it; the first of a step after the last of the step
    before): collectives issued one after another (a layer's gather
    groups, the buckets of the gradients that start together) wait for nothing; the step is
    that much shorter than with every collective waiting in full."""
    full = _waiting(0.0)
    program = _planned(manual, full)
    whole = price_schedule(program, full, optimizer_states=2)
    order = _issue_order(program, whole)
    stretches = sorted(stretch for _, stretch in order)
    assert len(order) == len(whole.records) >= 2
    for limit in (stretches[len(stretches) // 2], 1e-12, 2 * stretches[-1]):
        cluster = _waiting(limit)
        priced = price_schedule(program, cluster, optimizer_states=2)
        saved = 0.0
        for record, stretch in order:
            paid = WAIT * min(1.0, stretch / limit)
            expected = whole.record_seconds[record] - WAIT + paid
            assert priced.record_seconds[record] == pytest.approx(expected)
            saved += WAIT - paid
        assert whole.step - priced.step == pytest.approx(saved)
    if manual is plans.fully_sharded:  # gather groups started together
        assert any(stretch == 0 for _, stretch in order)


# -- pipeline stages ----------------------------------------------------------------------------


@pytest.mark.parametrize(("replicas", "position"), [(1, 0), (1, 1), (2, 0), (2, 1)])
def test_a_stage_waits_for_each_message_and_its_replicas(replicas: int, position: int) -> None:
    """Two stages of 2 micro-batches: a stage waits once a micro-batch for its neighbour's
    message, and once a step for its replicas' gradient reduction when it has replicas; a
    step's compute is shared evenly among those waits, each paying half of its stretch
    beyond ``lag_stretch`` (a third of a micro-batch's compute, so that the count of waits
    matters)."""
    atoms = Atoms.build(_program(), ())
    middle = atoms.count // 2
    start, stop = (0, middle) if position == 0 else (middle, atoms.count)
    microbatches = 2
    pipeline = Pipeline(stages="auto", microbatches=microbatches, data_parallel=replicas)
    world = 2 * replicas
    plain = StageCostModel(atoms, fxpar.Cluster((world,)), pipeline, optimizer_states=0)
    compute = plain.facts(start, stop).seconds / (microbatches * replicas)  # a micro-batch's
    limit = compute / 3
    cluster = fxpar.Cluster((world,), lag_share=0.5, lag_stretch=limit)
    lagged = StageCostModel(atoms, cluster, pipeline, optimizer_states=0)
    waits = microbatches + (replicas > 1)
    step = waits * 0.5 * (compute * microbatches / waits - limit)
    added = lagged.cost(start, stop, (replicas,)).time - plain.cost(start, stop, (replicas,)).time
    assert added == pytest.approx(step / microbatches)


# -- the measurement ----------------------------------------------------------------------------


def _lags(
    rank: int, world_size: int
) -> tuple[float | None, tuple[float, float], tuple[float, float]]:
    torch.set_num_threads(1)
    return (
        waiting.core_demand(),
        measure_lag(64, 1, 0.01, warmup=1, repeats=3),
        measure_lag(64, 1, 0.0, warmup=1, repeats=3),
    )


@pytest.mark.slow
def test_the_lag_is_measured_only_where_ranks_outnumber_cores() -> None:
    """Where the world's threads outnumber this host's cores the lag share is at least 0 and
    its stretch that of one product, the same on every rank; else, and with no stretch to
    time, there is none."""
    found = spawn(_lags, 4, timeout_s=120)
    counted, (share, stretch), unmeasured = found[0]
    assert all(f == found[0] for f in found)
    assert unmeasured == (0.0, 0.0)
    assert counted == pytest.approx(4 / len(os.sched_getaffinity(0)))
    if counted is not None and counted > 1:
        assert share >= 0 and 0 < stretch < 0.01
    else:
        assert (share, stretch) == (0.0, 0.0)
