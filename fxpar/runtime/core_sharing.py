"""How much faster a rank computes while the other ranks of its host idle.

Processes that share a host's cores take turns on them when all of them compute, and a rank
whose peers idle (a pipeline's stages waiting in its warm-up and drain) gets more of them.
:attr:`fxpar.Cluster.core_demand` prices that (:meth:`~fxpar.Cluster.compute_speedup`): with
every rank computing a thread gets ``1 / d`` of a core, with the share ``f`` of them computing
``min(1, 1 / (f d))``. Counting threads over cores gives the ``d`` of long stretches; the
scheduler gives a stretch of a few milliseconds less than that (a woken process runs for a
slice before it shares its core, so short stretches are barely slowed by peers, and barely
sped up by their idling). On four single-threaded processes on two cores, half the ranks
computed a stretch 1.0x, 1.4x and 1.7x as fast as all of them at once for stretches of about
1, 7 and 40 ms. :func:`measure_core_demand` measures it on stretches of the length a
pipeline's forwards and backwards take.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from fxpar.runtime import waiting


def measure_core_demand(size: int, seconds: float, warmup: int, repeats: int) -> float | None:
    """The core demand of the world's ranks as the scheduler grants it: how many times
    faster the first half of the ranks compute a stretch of products of two ``size``-square
    matrices (as many as take ``seconds`` with every rank computing) while the others wait
    (blocked in an all-reduce, as a stage waits for a message) than with every rank
    computing; the slowest rank's mean over ``repeats`` runs after ``warmup``, between 1 and
    the count (:func:`fxpar.runtime.waiting.core_demand`). The count where it is at most 1
    (no rank waits for a core), is unknown, or ``seconds`` is 0, and on a world of one rank.
    A collective: call it on every rank, as :func:`fxpar.calibrate` does."""
    counted = waiting.core_demand()
    if counted is None or counted <= 1 or seconds <= 0 or dist.get_world_size() < 2:
        return counted  # (a world of one rank has no half to leave idle)
    rank, half = dist.get_rank(), dist.get_world_size() // 2
    left = torch.randn(size, size)
    product = torch.empty_like(left)

    def stretch(products: int) -> float:
        start = time.perf_counter()
        for _ in range(products):
            torch.mm(left, left, out=product)
        return time.perf_counter() - start

    dist.barrier()
    count = torch.tensor([max(1, round(seconds / (stretch(4) / 4)))])
    dist.all_reduce(count, op=dist.ReduceOp.MAX)  # every rank computes as many
    products = int(count)

    together, apart = [], []
    for run in range(warmup + repeats):
        dist.barrier()
        everyone = stretch(products)
        dist.barrier()
        alone = stretch(products) if rank < half else 0.0
        waiting.wait(dist.all_reduce(torch.zeros(1), async_op=True), poll=False)
        if run >= warmup:
            together.append(everyone)
            apart.append(alone)
    means = torch.tensor([statistics.mean(together), statistics.mean(apart)], dtype=torch.float64)
    dist.all_reduce(means, op=dist.ReduceOp.MAX)
    return min(counted, max(1.0, float(means[0] / means[1])))
