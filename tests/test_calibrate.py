"""Calibration fits a Cluster to the processes it runs on: every rank gets the same cluster, the
fitted numbers give back the times they were fitted to under the cost model's own formulas (the
line of each collective on or above its middle size), and a cluster file carries the result to
`fxpar plan`."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import statistics
import time
from pathlib import Path

import pytest
import torch

import fxpar
from fxpar.cli import main
from fxpar.errors import DistributedError, FxparError
from fxpar.planning.cost import collective_seconds
from fxpar.runtime.calibration import (
    Calibration,
    CalibrationOptions,
    Timing,
    fit,
    measure,
    retime_lineless,
    wait_seconds,
)
from fxpar.runtime.calibration_runs import (
    ALL_GATHER,
    ALL_REDUCE,
    ALL_TO_ALL,
    COPY,
    MATMUL,
    OWN_LINKS,
    REDUCE_SCATTER,
    SEND,
    typical_seconds,
)
from fxpar.runtime.launch import spawn

GIVEN = fxpar.Cluster.preset("cpu", (2,))
ONE_BY_TWO = fxpar.Cluster.preset("cpu", (1, 2), axis_names=("outer", "inner"))


def _calibrate_rank(rank: int, world_size: int) -> dict[str, object]:
    """Two calibrations, then the errors of a cluster and a device mesh that are not the
    world's."""
    torch.set_num_threads(1)
    found: dict[str, object] = {
        "flat": measure(GIVEN),
        "flat_again": measure(GIVEN),
        "one_by_two": measure(ONE_BY_TWO, options=CalibrationOptions(overlap=False)),
    }
    for name, call in {
        "world": lambda: fxpar.calibrate(fxpar.Cluster((4,))),
        "mesh": lambda: fxpar.calibrate(GIVEN, ONE_BY_TWO.device_mesh()),
    }.items():
        try:
            call()
        except DistributedError as error:
            found[name] = str(error)
    return found


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, object]]:
    return spawn(_calibrate_rank, 2, timeout_s=120)


def _all_fitted(cluster: fxpar.Cluster) -> list[float]:
    return [*cluster.latency, *cluster.bandwidth, cluster.flops, cluster.memory_bandwidth]


@pytest.mark.slow
def test_every_rank_gets_the_same_sane_cluster_on_the_same_mesh(
    ranks: list[dict[str, object]],
) -> None:
    first, second = (r["flat"] for r in ranks)
    assert isinstance(first, Calibration) and isinstance(second, Calibration)
    assert first.cluster == second.cluster and first.timings == second.timings
    cluster = first.cluster
    assert all(math.isfinite(v) and v > 0 for v in _all_fitted(cluster))
    unchanged = ("mesh_shape", "axis_names", "device_type", "memory")
    assert {f: getattr(cluster, f) for f in unchanged} == {f: getattr(GIVEN, f) for f in unchanged}
    assert cluster != GIVEN  # measured, not the preset's numbers handed back


@pytest.mark.slow
def test_the_fitted_model_gives_back_the_fitted_times_and_lies_above_the_others(
    ranks: list[dict[str, object]],
) -> None:
    """Each kind of collective's lines go through the points of their upper hull, each plus
    the axis' wait, and lie on or above the others (but a smaller collective slower than the
    largest, noise the fit passes over); the matmul and copy rates give back their times under
    the cost model's formulas."""
    calibration = ranks[0]["flat"]
    assert isinstance(calibration, Calibration)
    kinds = [(t.operation, t.after_compute) for t in calibration.timings]
    assert kinds == [*[(ALL_REDUCE, False)] * 3, (ALL_REDUCE, True),
                     *[(kind, False) for kind in (ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL, SEND)
                       for _ in range(3)],
                     (MATMUL, False), (COPY, False)]  # fmt: skip
    cluster = calibration.cluster
    own = {(link.kind, link.axis) for link in cluster.collective_links}
    kept = {(ALL_GATHER, 0), (REDUCE_SCATTER, 0), (ALL_TO_ALL, 0), (SEND, 0)}
    # The all-reduce has links of its own only beside the axis' large line (two lines).
    assert own == kept | ({(ALL_REDUCE, 0)} if len(cluster.lines_of(ALL_REDUCE, 0)) > 1 else set())
    # How much of an all-reduce products beside it hide: measured, a share.
    overlap = calibration.cluster.overlap
    assert overlap is not None and 0 <= overlap <= 1
    assert re.search(rf"hidden share +0\.00 +{overlap:.2f}\n", calibration.table())
    # Every collective's latency carries the axis' wait for the last peer: the one-element
    # all-reduce after compute, beyond the same one after a barrier. A send's does not.
    small, wait_run = calibration.timings[0], calibration.timings[3]
    wait = wait_seconds(calibration.timings, 0)
    assert wait == max(wait_run.seconds - small.seconds, 0.0)
    assert cluster.peer_wait == (wait,)  # the part of every latency a shorter stretch waits less
    given_back: dict[str, int] = {}
    largest = {t.operation: t.seconds for t in sorted(calibration.timings, key=lambda t: t.nbytes)
               if t.axis is not None and not t.after_compute}  # fmt: skip
    for timing in calibration.timings:
        model = timing.model_seconds(calibration.cluster)
        if timing.after_compute:  # priced as the one element after a barrier, wait and all
            assert model == small.model_seconds(calibration.cluster)
            assert model >= max(timing.seconds, small.seconds + wait) - 1e-12
        elif timing.axis is None:
            assert model == pytest.approx(timing.seconds, rel=1e-9), timing
        else:  # each collective's lines lie on or above its points, through the large one
            waited = wait if timing.operation != SEND else 0.0
            # A smaller collective that took longer than its kind's largest is noise the fit
            # passes over (link_fit.upper_lines): no line of a positive bandwidth reaches it.
            if timing.seconds < largest[timing.operation]:
                assert model >= timing.seconds + waited - 1e-9 * timing.seconds, timing
            exact = model == pytest.approx(timing.seconds + waited, rel=1e-9)
            given_back[timing.operation] = given_back.get(timing.operation, 0) + exact
    # A kind of one line gives back two of its points, one of two lines all three.
    kinds = (ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL, SEND)
    assert given_back == {kind: len(cluster.lines_of(kind, 0)) + 1 for kind in kinds}
    # The axis' own line is the all-reduce's large one.
    large = calibration.timings[2]
    expected = collective_seconds("all_reduce", large.nbytes, 2, cluster.bandwidth[0],
                                  cluster.latency[0])  # fmt: skip
    assert large.model_seconds(cluster) == pytest.approx(expected, rel=1e-12)


def _late_peer_rank(rank: int, world_size: int) -> dict[str, float]:
    """Rank 0's time of a one-element all-reduce when rank 1 computes 60 more products than it
    before each run (a peer that reaches the collective late, as on a machine with more ranks
    than cores), started after a barrier ("0") and after compute ("1"); and rank 1's time of
    those 60 products (tens of ms: far above a stall of the run after a barrier). Each is the
    median of three rounds, so that one stall of the machine (a round's products held off a
    core) does not decide the comparison."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    buffer, size, extra = torch.zeros(1), 256, 60
    matrix = torch.randn(size, size)
    rounds: dict[str, list[float]] = {"0": [], "1": [], "extra": []}
    for _ in range(3):
        for after in (False, True):
            count = 1 + (extra if rank == 1 else 0)
            options = CalibrationOptions(compute_before=count, repeats=5, matmul_size=size)
            run = lambda: dist.all_reduce(buffer)  # noqa: E731
            seconds = typical_seconds(run, dist.group.WORLD, options, torch.device("cpu"), after)
            rounds[str(int(after))].append(seconds)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(extra):
            torch.mm(matrix, matrix)
        rounds["extra"].append(time.perf_counter() - start)
    return {key: statistics.median(times) for key, times in rounds.items()}


@pytest.mark.slow
def test_a_collective_timed_after_compute_counts_the_wait_for_a_late_peer() -> None:
    """With compute before each run, a collective's time includes waiting for the last peer:
    rank 0 waits out rank 1's extra products, which it does not see when the runs start
    together after a barrier."""
    rank_zero, rank_one = spawn(_late_peer_rank, 2, timeout_s=120)
    assert rank_zero["1"] > 0.5 * rank_one["extra"], (rank_zero, rank_one)
    assert rank_zero["0"] < rank_zero["1"] / 2, (rank_zero, rank_one)


@pytest.mark.slow
def test_an_axis_of_one_device_keeps_its_links(ranks: list[dict[str, object]]) -> None:
    calibration = ranks[0]["one_by_two"]
    assert isinstance(calibration, Calibration)
    cluster = calibration.cluster
    assert {t.axis for t in calibration.timings if t.axis is not None} == {1}
    assert {link.axis for link in cluster.collective_links} == {1}
    assert (cluster.latency[0], cluster.bandwidth[0]) == (ONE_BY_TWO.latency[0],
                                                          ONE_BY_TWO.bandwidth[0])  # fmt: skip
    assert cluster.latency[1] != ONE_BY_TWO.latency[1]
    assert ranks[1]["one_by_two"].cluster == cluster  # type: ignore[attr-defined]
    assert cluster.overlap is None  # not measured when told not to


@pytest.mark.slow
def test_a_cluster_or_mesh_that_is_not_the_world_is_refused(
    ranks: list[dict[str, object]],
) -> None:
    for rank in ranks:
        assert "the process group has 2 ranks but the cluster's mesh (4,)" in str(rank["world"])
        assert "the device mesh has shape (1, 2) but the cluster's mesh is (2,)" in str(
            rank["mesh"]
        )


def test_calibrating_without_a_process_group_says_how_to_start_one() -> None:
    with pytest.raises(DistributedError, match=r"torch\.distributed is not initialized"):
        fxpar.calibrate(GIVEN)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without a GPU")
def test_calibrating_gpus_without_one_is_refused() -> None:
    """A CUDA cluster calibrates on its GPUs (tests/test_cuda.py); without one it says so."""
    with pytest.raises(FxparError, match="torch sees no GPU"):
        fxpar.calibrate(fxpar.Cluster.preset("h100", (2,)))


def _timings_of(cluster: fxpar.Cluster, options: CalibrationOptions) -> list[Timing]:
    """What a machine that is exactly ``cluster`` would measure."""
    itemsize = options.dtype.itemsize
    timings = [
        Timing(ALL_REDUCE, nbytes, 0.0, axis=0)
        for nbytes in (itemsize, options.check_bytes, options.large_bytes)
    ]
    step = cluster.mesh_shape[0] * itemsize
    timings += [
        Timing(kind, nbytes, 0.0, axis=0)
        for kind in (ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL, SEND)
        for nbytes in (step, options.check_bytes // step * step, options.large_bytes // step * step)
    ]
    timings.append(Timing(MATMUL, 3 * 512 * 512 * itemsize, 0.0, flops=2 * 512**3))
    timings.append(Timing(COPY, 2 * options.copy_bytes, 0.0))
    return [dataclasses.replace(t, seconds=t.model_seconds(cluster)) for t in timings]


def test_fit_recovers_the_cluster_that_produced_the_times() -> None:
    """Each kind of collective gets back its own link, the all-reduce the axis' (a machine
    whose reduce-scatter runs at a quarter of the all-reduce's speed, as gloo's does)."""
    own = (
        fxpar.CollectiveLink(ALL_GATHER, 0, latency=5e-4, bandwidth=4e8),
        fxpar.CollectiveLink(REDUCE_SCATTER, 0, latency=6e-4, bandwidth=1.75e8),
        fxpar.CollectiveLink(ALL_TO_ALL, 0, latency=2e-4, bandwidth=9e8),
        fxpar.CollectiveLink(SEND, 0, latency=4e-5, bandwidth=2e9),
    )
    machine = fxpar.Cluster((4,), latency=(3e-4,), bandwidth=(7e8,), flops=3e10,
                            memory_bandwidth=1.2e10, collective_links=own)  # fmt: skip
    options = CalibrationOptions()
    fitted = fit(fxpar.Cluster.preset("cpu", (4,)), _timings_of(machine, options))
    assert fitted.latency[0] == pytest.approx(3e-4, rel=1e-9)
    assert fitted.bandwidth[0] == pytest.approx(7e8, rel=1e-9)
    assert [link.kind for link in fitted.collective_links] == [link.kind for link in own]
    for link, expected in zip(fitted.collective_links, own, strict=True):
        assert link.axis == 0
        assert link.latency == pytest.approx(expected.latency, rel=1e-9)
        assert link.bandwidth == pytest.approx(expected.bandwidth, rel=1e-9)
    assert fitted.flops == pytest.approx(3e10, rel=1e-9)
    assert fitted.memory_bandwidth == pytest.approx(1.2e10, rel=1e-9)
    assert fitted.memory == fxpar.Cluster.preset("cpu", (4,)).memory


def test_a_middle_size_above_the_line_of_the_extremes_gets_a_line_for_small_collectives() -> None:
    """On four devices, a machine whose collectives of the middle size take three times what a
    line would give them (gloo on processes sharing cores): each kind gets two lines, the
    small collectives' and the large ones' (the all-reduce's large line is the axis'), the
    fitted cluster gives back all three times of each kind, and fitting its own times gives
    it back."""
    machine = fxpar.Cluster((4,), latency=(3e-4,), bandwidth=(7e8,), flops=3e10,
                            memory_bandwidth=1.2e10)  # fmt: skip
    options = CalibrationOptions()
    timings = [
        dataclasses.replace(t, seconds=3 * t.seconds) if t.nbytes in middle else t
        for t in _timings_of(machine, options)
        for middle in [{options.check_bytes, options.check_bytes // 16 * 16}]
    ]
    fitted = fit(fxpar.Cluster.preset("cpu", (4,)), timings)
    kinds = (ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL, SEND)
    assert all(len(fitted.lines_of(kind, 0)) == 2 for kind in kinds)
    small, large = fitted.lines_of(ALL_REDUCE, 0)
    assert large == (fitted.bandwidth[0], fitted.latency[0])
    assert small[0] < large[0] and small[1] < large[1]  # slower per byte, less fixed time
    for timing in timings:
        assert timing.model_seconds(fitted) == pytest.approx(timing.seconds, rel=1e-9), timing
    # The table names each line of a kind, small collectives' first.
    table = Calibration(fxpar.Cluster.preset("cpu", (4,)), fitted, tuple(timings)).table()
    for kind in kinds:
        for index, _ in enumerate(fitted.lines_of(kind, 0), start=1):
            assert re.search(rf"latency {kind} axis0 \({index}/2\) +- +", table), kind
    assert "latency all_reduce axis0 (1/2)" in table and "latency axis0 " in table
    again = fit(fxpar.Cluster.preset("cpu", (4,)), _timings_of(fitted, options))
    for kind in kinds:
        for line, expected in zip(again.lines_of(kind, 0), fitted.lines_of(kind, 0), strict=True):
            assert line == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize(("late", "wait"), [(2e-3, 2e-3), (-1e-4, 0.0)])
def test_the_wait_after_compute_is_added_to_every_collective_latency_of_its_axis(
    late: float, wait: float
) -> None:
    """The one-element all-reduce timed after compute took ``late`` beyond the one after a
    barrier: every kind's latency on the axis grows by that (never by less than 0), the
    bandwidths stay; a send's, which waits for one peer, keeps its latency."""
    options = CalibrationOptions()
    timings = _timings_of(GIVEN, options)
    without = fit(GIVEN, timings)
    small = timings[0]
    after = Timing(ALL_REDUCE, small.nbytes, small.seconds + late, axis=0, after_compute=True)
    fitted = fit(GIVEN, [*timings, after])
    assert wait_seconds([*timings, after], 0) == pytest.approx(wait, abs=1e-12)
    assert fitted.latency[0] == pytest.approx(without.latency[0] + wait, rel=1e-9)
    assert fitted.bandwidth == without.bandwidth
    for link, before in zip(fitted.collective_links, without.collective_links, strict=True):
        waited = wait if link.kind != SEND else 0.0
        assert link.latency == pytest.approx(before.latency + waited, rel=1e-9)
        assert link.bandwidth == before.bandwidth
    assert fitted.peer_wait == pytest.approx((wait,), abs=1e-12)


def test_a_link_fitted_before_caps_the_peer_wait() -> None:
    """Timed without the other kinds (``each_kind`` off), a calibrated cluster keeps its
    all-gather link; a wait longer than that link's latency is kept only up to it."""
    options = CalibrationOptions()
    gather = fxpar.CollectiveLink(ALL_GATHER, 0, latency=1e-3, bandwidth=4e8)
    given = dataclasses.replace(GIVEN, collective_links=(gather,))
    timings = [t for t in _timings_of(GIVEN, options) if t.operation not in OWN_LINKS]
    small = timings[0]
    late = Timing(ALL_REDUCE, small.nbytes, small.seconds + 3e-3, axis=0, after_compute=True)
    fitted = fit(given, [*timings, late])
    assert fitted.collective_links == (gather,)
    assert fitted.latency[0] > 3e-3 and fitted.peer_wait == (1e-3,)


def test_fit_refuses_times_no_line_of_positive_latency_and_bandwidth_passes_through() -> None:
    timings = _timings_of(GIVEN, CalibrationOptions())
    timings[2] = dataclasses.replace(timings[2], seconds=timings[0].seconds / 2)  # large < small
    with pytest.raises(FxparError, match="calibrate again with a larger"):
        fit(GIVEN, timings)


def test_a_kind_of_collective_with_no_line_through_its_points_is_timed_again() -> None:
    """A noisy stretch made the one-element and the middle all-gather as slow as the large
    one: the three all-gather points (and nothing else) are timed again, and calibration fits
    the second timing; where every attempt is noisy, fit names the points. (Only one of the
    smaller points slow is no reason: the line goes through the other.)"""
    options = CalibrationOptions()
    quiet = _timings_of(GIVEN, options)
    gathers = [i for i, t in enumerate(quiet) if t.operation == ALL_GATHER]
    largest = quiet[gathers[-1]].seconds
    one_slow = list(quiet)
    one_slow[gathers[1]] = dataclasses.replace(quiet[gathers[1]], seconds=2 * largest)
    assert retime_lineless(GIVEN, one_slow, lambda planned: pytest.fail("timed again"), 3) == (
        one_slow
    )
    (gather,) = [link for link in fit(GIVEN, one_slow).collective_links if link.kind == ALL_GATHER]
    (expected,) = [link for link in fit(GIVEN, quiet).collective_links if link.kind == ALL_GATHER]
    assert (gather.latency, gather.bandwidth) == pytest.approx(
        (expected.latency, expected.bandwidth), rel=1e-9
    )
    noisy = list(quiet)
    for i in gathers[:-1]:
        noisy[i] = dataclasses.replace(quiet[i], seconds=largest)
    asked: list[list[Timing]] = []

    def time_again(planned: list[Timing]) -> list[Timing]:
        asked.append(list(planned))
        return [quiet[noisy.index(timing)] for timing in planned]

    timings = retime_lineless(GIVEN, noisy, time_again, attempts=3)
    assert asked == [[noisy[i] for i in gathers]]
    assert timings == quiet
    assert fit(GIVEN, timings) == fit(GIVEN, quiet)

    asked.clear()
    still = retime_lineless(GIVEN, noisy, lambda planned: asked.append(planned) or planned, 3)
    assert len(asked) == 2 and still == noisy
    with pytest.raises(FxparError, match=r"all-gathers of \d+ and \d+ bytes took"):
        fit(GIVEN, still)
    assert retime_lineless(GIVEN, noisy, time_again, attempts=1) == noisy  # one timing only


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"attempts": 0}, "attempts must be >= 1"),
        ({"check_bytes": 8 * 2**20}, "must be below large_bytes"),
        ({"copy_bytes": 2}, "copy_bytes=2 holds not even one"),
        ({"repeats": 0}, "repeats >= 1"),
        ({"idle_repeats": 0}, "idle_repeats >= 1"),
        ({"quantile": 1.5}, "quantile must lie in"),
        ({"compute_before": -1}, "compute_before must be >= 0"),
        ({"op_passes": 0}, "op_passes must be >= 1"),
        ({"op_rounds": 0}, "op_rounds must be >= 1"),
    ],
)
def test_bad_options_are_named(options: dict[str, object], message: str) -> None:
    with pytest.raises(FxparError, match=message):
        CalibrationOptions(**options)  # type: ignore[arg-type]


def test_the_hidden_share_is_the_overlap_given_or_the_device_types() -> None:
    """What compute hides of the communication beside it: the cluster's ``overlap`` where
    set, else all of it on GPUs (copy engines) and none on CPUs (gloo takes the cores)."""
    assert fxpar.Cluster((2,)).hidden_share == 0.0
    assert fxpar.Cluster.preset("h100", (8,)).hidden_share == 1.0
    assert fxpar.Cluster.preset("h100", (8,), overlap=0.4).hidden_share == 0.4
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(FxparError, match="overlap must be a number from 0 to 1"):
            fxpar.Cluster((2,), overlap=bad)
    with pytest.raises(FxparError, match="a cluster's overlap cannot be 2"):
        fxpar.Cluster.from_dict({"mesh_shape": [2], "overlap": 2})


def test_a_cluster_file_loads_back_on_its_mesh_or_another(tmp_path: Path) -> None:
    cluster = fxpar.Cluster((2, 4), axis_names=("node", "gpu"), bandwidth=(1e9, 8e9),
                            latency=(2e-4, 3e-5), flops=4e10)  # fmt: skip
    path = cluster.save(tmp_path / "cluster.json")
    assert json.loads(path.read_text())["format"] == "fxpar-cluster"
    assert fxpar.Cluster.load(path) == cluster
    same_axes = fxpar.Cluster.load(path, (4, 2))
    assert same_axes == dataclasses.replace(cluster, mesh_shape=(4, 2))
    flat = fxpar.Cluster.load(path, (8,))
    assert (flat.axis_names, flat.bandwidth, flat.latency) == (("axis0",), (8e9,), (3e-5,))
    assert flat.flops == 4e10
    # A kind's own link travels with the file; on a mesh of other axes, the last axis' link
    # goes to every axis, as the axis' own link does.
    gathers = fxpar.CollectiveLink("all_gather", 1, latency=1e-4, bandwidth=2e9)
    calibrated = dataclasses.replace(cluster, collective_links=(gathers,))
    path = calibrated.save(tmp_path / "calibrated.json")
    assert fxpar.Cluster.load(path) == calibrated
    assert fxpar.Cluster.load(path).lines_of("all_gather", 1) == ((2e9, 1e-4),)
    assert fxpar.Cluster.load(path).lines_of("all_gather", 0) == ((1e9, 2e-4),)
    assert fxpar.Cluster.load(path).lines_of("reduce_scatter", 1) == ((8e9, 3e-5),)
    assert fxpar.Cluster.load(path, (2, 2, 2)).collective_links == tuple(
        dataclasses.replace(gathers, axis=axis) for axis in range(3)
    )
    # So do a kind's two lines, small collectives' and large ones'.
    small = fxpar.CollectiveLink("all_gather", 1, latency=2e-5, bandwidth=1e8)
    two = dataclasses.replace(cluster, collective_links=(small, gathers))
    path = two.save(tmp_path / "two.json")
    assert fxpar.Cluster.load(path).lines_of("all_gather", 1) == ((1e8, 2e-5), (2e9, 1e-4))
    assert "collective_links" not in json.loads((tmp_path / "cluster.json").read_text())
    assert "overlap" not in json.loads((tmp_path / "cluster.json").read_text())
    overlapping = dataclasses.replace(cluster, overlap=0.25)
    path = overlapping.save(tmp_path / "overlapping.json")
    assert fxpar.Cluster.load(path, (8,)).hidden_share == 0.25
    (tmp_path / "plan.json").write_text('{"format": "fxpar-plan"}')
    with pytest.raises(FxparError, match="is not a cluster file"):
        fxpar.Cluster.load(tmp_path / "plan.json")
    with pytest.raises(FxparError, match=r"a cluster has no fields \['speed'\]"):
        fxpar.Cluster.from_dict({"mesh_shape": [2], "speed": 1})


@pytest.mark.slow
@pytest.mark.parametrize(
    ("links", "message"),
    [
        ([{"kind": "broadcast", "axis": 0, "latency": 1e-5, "bandwidth": 1e9}], "needs a kind"),
        ([{"kind": "all_gather", "axis": 2, "latency": 1e-5, "bandwidth": 1e9}], "an axis of"),
        ([{"kind": "all_gather", "axis": 0, "latency": -1.0, "bandwidth": 1e9}], "cannot be"),
        ([{"kind": "all_gather", "axis": 0, "latency": 1e-5}], "cannot be"),
        (
            [{"kind": "all_to_all", "axis": 0, "latency": 1e-5, "bandwidth": 1e9}] * 2,
            "same link twice",
        ),
    ],
)
def test_bad_collective_links_are_named(links: list[dict[str, object]], message: str) -> None:
    with pytest.raises(FxparError, match=message):
        fxpar.Cluster.from_dict({"mesh_shape": [2], "collective_links": links})


def test_links_given_in_code_are_checked_too() -> None:
    with pytest.raises(FxparError, match="has a kind, axis, latency and bandwidth"):
        fxpar.Cluster((2,), collective_links=({"kind": "all_gather"},))  # type: ignore[arg-type]
    with pytest.raises(FxparError, match="holds CollectiveLinks"):
        fxpar.Cluster((2,), collective_links=(("all_gather", 0, 1e-5, 1e9),))  # type: ignore[arg-type]
    with pytest.raises(FxparError, match="holds CollectiveLinks"):
        fxpar.Cluster(
            (2,),
            collective_links=(fxpar.CollectiveLink("all_gather", 0, "fast", 1e9),),  # type: ignore[arg-type]
        )


def test_a_stage_submesh_keeps_the_links_of_the_axes_it_takes() -> None:
    cluster = fxpar.Cluster(
        (2, 4), bandwidth=(1e9, 8e9), latency=(2e-4, 3e-5),
        collective_links=(fxpar.CollectiveLink("reduce_scatter", 1, 1e-4, 2e9),
                          fxpar.CollectiveLink("reduce_scatter", 0, 9e-4, 1e8)),
    )  # fmt: skip
    inner = cluster.submesh((4,))  # the inner axis' four devices
    assert inner.lines_of("reduce_scatter", 0) == ((2e9, 1e-4),)
    assert inner.lines_of("all_gather", 0) == ((8e9, 3e-5),)
    whole = cluster.submesh((2, 4))
    assert whole.lines_of("reduce_scatter", 0) == ((1e8, 9e-4),)


def test_calibrate_command_prints_and_saves_a_cluster_that_plan_reads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    output = tmp_path / "cluster.json"
    argv = ["calibrate", "--world", "2", "--output", str(output), "--model", "test_cli:tiny_target"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert re.search(r"on 2 local gloo processes, \d+ torch threads? each", out)
    for row in ("latency axis0", "bandwidth axis0", "flops", "memory_bandwidth",
                "all-reduce on axis0 (fit)", "matmul", "copy", "timing the ops of",
                "aten.mm"):  # fmt: skip
        assert row in out
    assert f"cluster written to {output}" in out
    cluster = fxpar.Cluster.load(output)
    assert cluster.mesh_shape == (2,) and cluster.memory == GIVEN.memory
    assert all(math.isfinite(v) and v > 0 for v in _all_fitted(cluster))
    # The model's ops got their speeds, saved in the file.
    assert cluster.op_overhead > 0 and "aten.mm" in dict(cluster.op_slowdown)
    # Timed at a quarter of the batch (4 rows) too: its fixed costs a call.
    assert "timing the ops of test_cli:tiny_target (batch 4, length 64), and at 1/4 of it" in out
    assert set(dict(cluster.op_fixed)) <= set(dict(cluster.op_slowdown))
    argv = ["plan", "--model", "test_cli:tiny_target", "--mesh", "2", "--cluster-file", str(output)]
    assert main(argv) == 0
    assert "plan: ilp, optimal" in capsys.readouterr().out


def test_calibrate_command_refuses_a_mesh_that_is_not_the_world(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["calibrate", "--world", "2", "--mesh", "2x2"]) == 2
    assert "mesh 2x2 has 4 devices but --world starts 2 processes" in capsys.readouterr().err
