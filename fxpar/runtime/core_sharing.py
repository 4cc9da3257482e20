"""How much faster a rank computes while the other ranks of its host idle.

Processes that share a host's cores take turns on them when all of them compute, and a rank
whose peers idle (a pipeline's stages waiting in its warm-up and drain) gets more of them.
:attr:`fxpar.Cluster.core_demand` prices that (:meth:`~fxpar.Cluster.compute_speedup`): with
every rank computing a thread gets ``1 / d`` of a core, with the share ``f`` of them computing
``min(1, 1 / (f d))``. Counting threads over cores gives the ``d`` of long stretches; the
scheduler gives a short stretch less than that (a woken process runs for a slice before it
shares its core, so short stretches are barely slowed by peers, and barely sped up by their
idling). So a stretch that half the ranks compute runs as if its first part went at the speed
of all and the rest ``min(d, 2)`` times as fast: the speed-up approaches that factor only on
stretches many times longer than the scheduler takes to hand a rank the cores its peers left.
:attr:`fxpar.Cluster.core_delay` is that start, and :func:`measure_core_sharing` measures
both on two stretches about as long as a pipeline's forwards and backwards, so that the line
through them is right at the lengths a pipeline's price reads it at.

Sharing cores also makes the ranks drift apart: each gets its turns on a core at other times,
so after a stretch of compute that is the same work on every rank, some are done before the
others, and a collective that synchronises them waits for the last. Where ranks outnumber
cores that wait grows with the stretch (and is about as long for a pair of ranks as for all of
them); with a core per rank it stays about the same whatever the stretch. The wait calibration
adds to every collective's latency is the one after a short stretch; :func:`measure_lag`
measures how much it grows with the stretch (:attr:`fxpar.Cluster.lag_share`,
:meth:`~fxpar.Cluster.lag_seconds`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from fxpar.runtime import waiting

if TYPE_CHECKING:
    from fxpar.runtime.calibration import CalibrationOptions


def measure(options: CalibrationOptions) -> dict[str, Any]:
    """The cluster fields that describe how the world's ranks share this host's cores, as
    :func:`fxpar.calibrate` sets them on CPU: ``core_demand`` and ``core_delay``
    (:func:`measure_core_sharing`, on ``options.idle_repeats`` stretches of
    ``options.idle_seconds`` and longer ones), ``lag_share`` and
    ``lag_stretch`` (:func:`measure_lag`, from ``options.compute_before`` products to
    stretches of ``options.drift_seconds``). A collective: call it on every rank."""
    size, warmup, repeats = options.matmul_size, options.warmup, options.repeats
    share, stretch = measure_lag(size, options.compute_before, options.drift_seconds, warmup,
                                 repeats)  # fmt: skip
    demand, delay = measure_core_sharing(size, options.idle_seconds, warmup, options.idle_repeats)
    return {
        "core_demand": demand,
        "core_delay": delay,
        "lag_share": share,
        "lag_stretch": stretch,
    }


def _products(size: int) -> tuple[Callable[[int], float], float]:
    """A function that computes ``n`` products of two ``size``-square matrices and returns
    its seconds, and the seconds one product takes (with every rank computing: the ranks agree
    on the fastest's, so that a count of products for a stretch is the same on every rank)."""
    left = torch.randn(size, size)
    product = torch.empty_like(left)

    def stretch(products: int) -> float:
        start = time.perf_counter()
        for _ in range(products):
            torch.mm(left, left, out=product)
        return time.perf_counter() - start

    dist.barrier()
    one = torch.tensor([stretch(4) / 4], dtype=torch.float64)
    dist.all_reduce(one, op=dist.ReduceOp.MIN)
    return stretch, float(one)


def measure_lag(
    size: int, short: int, seconds: float, warmup: int, repeats: int
) -> tuple[float, float]:
    """``(lag_share, lag_stretch)``: how many seconds longer a one-element all-reduce of the
    world waits for its last peer per second more of compute before it, from ``short``
    products of two ``size``-square matrices (the stretch after which calibration times the
    wait that every collective's latency holds; its seconds are ``lag_stretch``) to as many as
    take ``seconds``; every rank computes the same stretch after a barrier, then waits. The
    ranks' mean wait over ``repeats`` runs after ``warmup`` (what a step waits beyond the
    mean rank's compute). ``(0, 0)`` where no rank waits for a core (the count is at most 1
    or unknown), ``seconds`` is 0, or on a world of one rank. A collective."""
    counted = waiting.core_demand()
    if counted is None or counted <= 1 or seconds <= 0 or dist.get_world_size() < 2:
        return 0.0, 0.0
    stretch, one = _products(size)
    long = max(short + 1, round(seconds / one))
    means = []
    for products in (short, long):
        computed, waited = [], []
        for run in range(warmup + repeats):
            dist.barrier()
            took = stretch(products)
            start = time.perf_counter()
            waiting.all_reduce(torch.zeros(1), None)
            if run >= warmup:
                computed.append(took)
                waited.append(time.perf_counter() - start)
        means += [statistics.mean(computed), statistics.mean(waited)]
    summed = torch.tensor(means, dtype=torch.float64)
    dist.all_reduce(summed)
    short_stretch, short_wait, long_stretch, long_wait = (summed / dist.get_world_size()).tolist()
    share = (long_wait - short_wait) / (long_stretch - short_stretch)
    return max(share, 0.0), short_stretch


LONG_STRETCH = 4
"""How many times the short stretch the long one of :func:`measure_core_sharing` takes."""


def measure_core_sharing(
    size: int, seconds: float, warmup: int, repeats: int
) -> tuple[float | None, float]:
    """``(core_demand, core_delay)`` of the world's ranks as the scheduler grants them
    (:func:`fit_core_sharing`): how much faster the first half of the ranks compute a stretch
    of products of two ``size``-square matrices while the others wait (blocked in an
    all-reduce, as a stage waits for a message) than with every rank computing, for a
    stretch that takes ``seconds`` with every rank computing and one :data:`LONG_STRETCH`
    times as long; the slowest rank's means over ``repeats`` runs of the short stretch (a
    quarter as many of the long) after ``warmup``. The count
    (:func:`fxpar.runtime.waiting.core_demand`) and no delay where the count is at most 1 (no
    rank waits for a core), is unknown, or ``seconds`` is 0, and on a world of one rank. A
    collective: call it on every rank, as :func:`fxpar.calibrate` does."""
    counted = waiting.core_demand()
    if counted is None or counted <= 1 or seconds <= 0 or dist.get_world_size() < 2:
        return counted, 0.0  # (a world of one rank has no half to leave idle)
    rank, half = dist.get_rank(), dist.get_world_size() // 2
    stretch, one = _products(size)
    means = []
    for length, runs in ((seconds, repeats), (LONG_STRETCH * seconds, max(1, repeats // 4))):
        products = max(1, round(length / one))  # as many on every rank
        together, apart = [], []
        for run in range(warmup + runs):
            dist.barrier()
            everyone = stretch(products)
            dist.barrier()
            alone = stretch(products) if rank < half else 0.0
            waiting.wait(dist.all_reduce(torch.zeros(1), async_op=True), poll=False)
            if run >= warmup:
                together.append(everyone)
                apart.append(alone)
        means += [statistics.mean(together), statistics.mean(apart)]
    slowest = torch.tensor(means, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    short, short_alone, long, long_alone = slowest.tolist()
    return fit_core_sharing((short, long), (short_alone, long_alone), counted)


def fit_core_sharing(
    together: tuple[float, float], alone: tuple[float, float], counted: float
) -> tuple[float, float]:
    """``(core_demand, core_delay)`` from two stretches of compute that took ``together``
    seconds with every rank computing and ``alone`` seconds on half of them: half the ranks
    compute at the speed of all for ``delay`` seconds, then ``demand`` times as fast (while
    the demand is at most 2, what half the ranks gain is the demand,
    :meth:`fxpar.Cluster.compute_speedup`), so ``alone = delay + (together - delay) /
    demand``: the line through the two points. The demand is kept between 1 and ``counted``
    (where it is 1 there is no delay), the delay between 0 and the long stretch."""
    (short, long), (short_alone, long_alone) = together, alone
    slope = (long_alone - short_alone) / (long - short) if long > short else 1.0
    demand = min(counted, 1 / slope) if slope > 0 else counted
    if demand <= 1:
        return 1.0, 0.0
    intercept = short_alone - short / demand
    delay = min(max(intercept / (1 - 1 / demand), 0.0), long)
    return demand, delay
