"""The lines a collective's price follows, fitted to its measured times at a few sizes.

The cost model prices a collective of ``B`` local bytes on ``n`` devices with lines of the form
``α + share(n)·B/β`` (:func:`fxpar.planning.cost.collective_seconds`), taking the lowest of its
lines where it has several (:meth:`fxpar.cluster.Cluster.lines_of`). Calibration times each kind
at one element, a middle size and a large one
(:class:`fxpar.runtime.calibration.CalibrationOptions`), and :func:`upper_lines` chooses the
lines: those of the upper hull of the points, a price that is exact at every point on the hull
and no lower than any point under it.

Why not one line through the smallest and the largest point: on gloo processes that share
cores (more processes than cores), a collective of some hundreds of kilobytes can take many
times what one element takes, far above the chord from the one-element point to the large
one, and that line then prices it at a fraction of what it takes in a step: a plan that waits
at many of them, tensor parallelism, is estimated short. One line through the large point and
the middle one prices those right but puts every small collective over by the difference of
the two latencies (a fully sharded plan gathering many small parameters, a loss reduced as a
one-element partial sum): the two lines of the hull price both. Where the middle point lies
on or under the line of the extremes (a host with a core per rank), the hull is that one line.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from fxpar.planning.cost import collective_share

Point = tuple[int, float]
"""A collective's local bytes and the seconds it took."""

Line = tuple[float, float]
"""A line's latency (seconds) and bandwidth (bytes/s)."""


def line_through(kind: str, devices: int, small: Point, large: Point) -> Line | None:
    """The latency and bandwidth of the line of :func:`~fxpar.planning.cost.collective_seconds`
    through a small and a large collective's (bytes, seconds); None where no line of a positive
    latency and bandwidth goes through both."""
    (small_bytes, small_s), (large_bytes, large_s) = small, large
    if large_s <= small_s or large_bytes <= small_bytes:
        return None
    share = collective_share(kind, devices)  # bytes moved per local byte
    bandwidth = share * (large_bytes - small_bytes) / (large_s - small_s)
    latency = small_s - share * small_bytes / bandwidth
    return (latency, bandwidth) if latency > 0 else None


def upper_lines(kind: str, devices: int, points: Sequence[Point]) -> list[Line]:
    """The lines of the upper hull of ``points`` (bytes, seconds), from the smallest collective's
    to the largest's, of which a price takes the lowest: exact at the largest point and every
    point on the hull, no lower than any other. Smaller points slower than the largest (noise)
    are passed over, and so is a leading point whose line would need a latency of 0 or less
    (the next line, extended, lies above it). Empty where no line of a positive latency and
    bandwidth reaches the largest point."""
    slowest = dict(sorted(points))  # of points of one size, the slowest
    *smaller, largest = slowest.items()
    hull: list[Point] = []
    for point in [p for p in smaller if p[1] < largest[1]] + [largest]:
        # Drop the last vertex while it lies on or under the chord from the one before it.
        while len(hull) >= 2 and _turns_up(hull[-2], hull[-1], point):
            hull.pop()
        hull.append(point)
    lines = [line_through(kind, devices, a, b) for a, b in itertools.pairwise(hull)]
    return [line for line in lines if line is not None]


def _turns_up(a: Point, b: Point, c: Point) -> bool:
    """Whether ``b`` lies on or under the chord from ``a`` to ``c``, or above it by no more
    than rounding (the hull is not concave at ``b``: one line serves all three)."""
    chord = a[1] + (c[1] - a[1]) * (b[0] - a[0]) / (c[0] - a[0])
    return b[1] <= chord * (1 + 1e-9)
