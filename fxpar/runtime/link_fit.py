"""The latency and bandwidth of a collective, fitted to its measured times at a few sizes.

The cost model prices a collective of ``B`` local bytes on ``n`` devices as a line,
``α + share(n)·B/β`` (:func:`fxpar.planning.cost.collective_seconds`), and the ILP prices each
pair of layouts with one such line for tensors of every size. Calibration times each kind at
one element, a middle size and a large one (:class:`fxpar.runtime.calibration.CalibrationOptions`),
and :func:`upper_line` chooses the line: through the large point, which bandwidth dominates,
and whichever smaller point gives the line that prices every smaller point at no less than it
took.

Why not the line through the smallest and the largest alone: on gloo processes that share
cores (four on the development machine's two), all-reduces of 64-512 KiB took about what
4 MiB's fixed part takes, 2.2-3.7 ms after a barrier against 0.34 for one element, and that line
priced them at half of what they took in a step (``benchmarks/collective_sizes.py``); a plan
that waits at many of them, tensor parallelism, was estimated short. Where the middle point lies
on or under that line (a host with a core per rank), the line is the same as before. The line
chosen prices a one-element collective above what it took, by the difference: scalars are few
in a step, and the lowering sends the gradients' in buckets.
"""

from __future__ import annotations

from collections.abc import Sequence

from fxpar.planning.cost import collective_share

Point = tuple[int, float]
"""A collective's local bytes and the seconds it took."""


def line_through(kind: str, devices: int, small: Point, large: Point) -> tuple[float, float] | None:
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


def upper_line(kind: str, devices: int, points: Sequence[Point]) -> tuple[float, float] | None:
    """The line through the largest of ``points`` (by bytes) and one of the others that lies
    on or above every other (the one of the largest latency: all go through the same large
    point, so the flattest is the highest left of it), among the lines of positive latency and
    bandwidth; None where there is none. A smaller point slower than the largest (noise) gives
    no line and is passed over."""
    *smaller, largest = sorted(points)
    lines = [line_through(kind, devices, point, largest) for point in smaller]
    found = [line for line in lines if line is not None]
    return max(found) if found else None
