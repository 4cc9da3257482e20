"""A collective's line is fitted through its large point and the smaller point that puts it on
or above every other (fxpar.runtime.link_fit): worked by hand on the sizes gloo on four
processes sharing two cores measured, and checked on any points."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fxpar.planning.cost import collective_seconds
from fxpar.runtime.link_fit import line_through, upper_line

KIB, MIB = 2**10, 2**20


def test_a_middle_size_above_the_line_of_the_extremes_lifts_the_line() -> None:
    """One element 0.34 ms, 256 KiB 3.0 ms, 4 MiB 7.7 ms on four devices (an all-reduce moves
    2·3/4 = 1.5 bytes per local byte): the line through 256 KiB and 4 MiB has bandwidth
    1.5·(4 MiB − 256 KiB)/4.7 ms and latency 3.0 ms less 256 KiB at that bandwidth."""
    points = [(4, 0.34e-3), (256 * KIB, 3.0e-3), (4 * MIB, 7.7e-3)]
    bandwidth = 1.5 * (4 * MIB - 256 * KIB) / 4.7e-3
    latency = 3.0e-3 - 1.5 * 256 * KIB / bandwidth
    assert bandwidth == pytest.approx(1.254945e9, rel=1e-6)
    assert latency == pytest.approx(2.686667e-3, rel=1e-6)
    assert upper_line("all_reduce", 4, points) == pytest.approx((latency, bandwidth), rel=1e-12)
    # The line through the extremes alone prices 256 KiB at under a third of what it took.
    low = line_through("all_reduce", 4, points[0], points[2])
    assert low is not None
    assert collective_seconds("all_reduce", 256 * KIB, 4, low[1], low[0]) < 1.0e-3


@pytest.mark.parametrize(
    ("middle", "why"),
    [(0.5e-3, "under the line of the extremes"), (9.0e-3, "slower than the large one")],
)
def test_otherwise_the_line_goes_through_the_extremes(middle: float, why: str) -> None:
    points = [(4, 0.34e-3), (256 * KIB, middle), (4 * MIB, 7.7e-3)]
    expected = line_through("all_reduce", 4, points[0], points[2])
    assert upper_line("all_reduce", 4, points) == expected, why


def test_no_line_where_every_smaller_point_is_slower_than_the_large_one() -> None:
    points = [(8, 3e-3), (256 * KIB, 4e-3), (4 * MIB, 2e-3)]
    assert upper_line("all_gather", 2, points) is None
    assert line_through("all_gather", 2, (8, 1e-3), (8, 2e-3)) is None  # one size: no line


@given(
    st.lists(
        st.tuples(st.integers(1, 8 * MIB), st.floats(1e-5, 1e-1)),
        min_size=2,
        max_size=5,
        unique_by=lambda point: point[0],
    ),
    st.sampled_from(["all_reduce", "all_gather", "reduce_scatter", "all_to_all"]),
    st.integers(2, 16),
)
def test_the_line_gives_back_the_large_point_and_lies_on_or_above_the_others(
    points: list[tuple[int, float]], kind: str, devices: int
) -> None:
    line = upper_line(kind, devices, points)
    *smaller, (large_bytes, large_s) = sorted(points)
    usable = [line_through(kind, devices, point, (large_bytes, large_s)) for point in smaller]
    assert (line is None) == all(found is None for found in usable)
    if line is None:
        return
    latency, bandwidth = line
    assert latency > 0 and bandwidth > 0
    price = lambda nbytes: collective_seconds(kind, nbytes, devices, bandwidth, latency)  # noqa: E731
    assert price(large_bytes) == pytest.approx(large_s, rel=1e-9)
    for point, found in zip(smaller, usable, strict=True):
        if found is not None:  # a point with a line of its own is priced at least at its time
            assert price(point[0]) >= point[1] * (1 - 1e-9)
    assert any(price(nbytes) == pytest.approx(s, rel=1e-9) for nbytes, s in smaller)
