"""A collective's price follows the upper hull of its timed sizes (fxpar.runtime.link_fit):
worked by hand on the sizes gloo on four processes sharing two cores measured, and checked on
any points."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fxpar.planning.cost import collective_seconds
from fxpar.runtime.link_fit import line_through, upper_lines

KIB, MIB = 2**10, 2**20


def _price(kind: str, devices: int, lines: list[tuple[float, float]], nbytes: float) -> float:
    return min(collective_seconds(kind, nbytes, devices, bw, lat) for lat, bw in lines)


def test_a_middle_size_above_the_line_of_the_extremes_gives_two_lines() -> None:
    """One element 0.34 ms, 256 KiB 3.0 ms, 4 MiB 7.7 ms on four devices (an all-reduce moves
    2·3/4 = 1.5 bytes per local byte). The large line, through 256 KiB and 4 MiB, has
    bandwidth 1.5·(4 MiB − 256 KiB)/4.7 ms and latency 3.0 ms less 256 KiB at that bandwidth;
    the small one, through 4 bytes and 256 KiB, bandwidth 1.5·(256 KiB − 4)/2.66 ms."""
    points = [(4, 0.34e-3), (256 * KIB, 3.0e-3), (4 * MIB, 7.7e-3)]
    large_bw = 1.5 * (4 * MIB - 256 * KIB) / 4.7e-3
    large_lat = 3.0e-3 - 1.5 * 256 * KIB / large_bw
    small_bw = 1.5 * (256 * KIB - 4) / 2.66e-3
    small_lat = 0.34e-3 - 1.5 * 4 / small_bw
    assert large_bw == pytest.approx(1.254945e9, rel=1e-6)
    assert large_lat == pytest.approx(2.686667e-3, rel=1e-6)
    assert small_bw == pytest.approx(1.478233e8, rel=1e-6)
    lines = upper_lines("all_reduce", 4, points)
    assert lines == [
        pytest.approx((small_lat, small_bw), rel=1e-12),
        pytest.approx((large_lat, large_bw), rel=1e-12),
    ]
    # Exact at all three sizes; in between, the lower line: 64 KiB on the small one.
    for nbytes, seconds in points:
        assert _price("all_reduce", 4, lines, nbytes) == pytest.approx(seconds, rel=1e-9)
    assert _price("all_reduce", 4, lines, 64 * KIB) == pytest.approx(
        small_lat + 1.5 * 64 * KIB / small_bw, rel=1e-12
    )
    # The line through the extremes alone prices 256 KiB at under a third of what it took.
    low = line_through("all_reduce", 4, points[0], points[2])
    assert low is not None
    assert collective_seconds("all_reduce", 256 * KIB, 4, low[1], low[0]) < 1.0e-3


@pytest.mark.parametrize(
    ("middle", "why"),
    [(0.5e-3, "under the line of the extremes"), (9.0e-3, "slower than the large one")],
)
def test_otherwise_one_line_through_the_extremes(middle: float, why: str) -> None:
    points = [(4, 0.34e-3), (256 * KIB, middle), (4 * MIB, 7.7e-3)]
    expected = line_through("all_reduce", 4, points[0], points[2])
    assert upper_lines("all_reduce", 4, points) == [expected], why


def test_a_leading_line_of_no_positive_latency_is_passed_over() -> None:
    """8 KiB at 1 ms and 16 KiB at 3 ms make a line that crosses zero bytes below zero
    seconds; the line on from 16 KiB, extended, lies above the 8 KiB point."""
    points = [(8 * KIB, 1e-3), (16 * KIB, 3e-3), (4 * MIB, 4e-3)]
    (line,) = upper_lines("all_gather", 2, points)
    assert line == line_through("all_gather", 2, points[1], points[2])
    assert _price("all_gather", 2, [line], 8 * KIB) > 1e-3


def test_no_line_where_every_smaller_point_is_slower_than_the_large_one() -> None:
    points = [(8, 3e-3), (256 * KIB, 4e-3), (4 * MIB, 2e-3)]
    assert upper_lines("all_gather", 2, points) == []
    assert line_through("all_gather", 2, (8, 1e-3), (8, 2e-3)) is None  # one size: no line


@given(
    st.lists(
        st.tuples(st.integers(1, 8 * MIB), st.floats(1e-5, 1e-1)),
        min_size=2,
        max_size=6,
        unique_by=lambda point: point[0],
    ),
    st.sampled_from(["all_reduce", "all_gather", "reduce_scatter", "all_to_all"]),
    st.integers(2, 16),
)
def test_the_lowest_line_gives_back_the_large_point_and_is_no_lower_than_the_others(
    points: list[tuple[int, float]], kind: str, devices: int
) -> None:
    lines = upper_lines(kind, devices, points)
    *smaller, (large_bytes, large_s) = sorted(points)
    usable = [line_through(kind, devices, point, (large_bytes, large_s)) for point in smaller]
    # A line exists exactly where one through the large point and another does.
    assert bool(lines) == any(found is not None for found in usable)
    if not lines:
        return
    assert all(latency > 0 and bandwidth > 0 for latency, bandwidth in lines)
    # Small collectives' lines first: latencies rise and bandwidths grow.
    assert [lat for lat, _ in lines] == sorted(lat for lat, _ in lines)
    assert _price(kind, devices, lines, large_bytes) == pytest.approx(large_s, rel=1e-9)
    for (nbytes, seconds), found in zip(smaller, usable, strict=True):
        if found is not None:  # a point some line reaches is priced at least at its time
            assert _price(kind, devices, lines, nbytes) >= seconds * (1 - 1e-9)
    # No point is priced higher than the old single line through the large point put it.
    single = max(found for found in usable if found is not None)
    for nbytes, _ in smaller:
        old = collective_seconds(kind, nbytes, devices, single[1], single[0])
        assert _price(kind, devices, lines, nbytes) <= old * (1 + 1e-9)
