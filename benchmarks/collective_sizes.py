"""What an all-reduce costs by size, beside what the calibrated cluster prices it at.

    python benchmarks/collective_sizes.py [WORLD ...]        # default: 2 4

``WORLD`` gloo processes (one thread each; 4 puts two processes on each of the development
machine's two cores) calibrate ``fxpar.Cluster((WORLD,))``, then all-reduce buffers of one
element up to 4 MiB through :func:`fxpar.runtime.waiting.all_reduce` (waited on as the
runtime waits). Each size is timed three ways: after a barrier, every rank starting together
(*barrier q25*: the lower quartile of 20 runs, what calibration fits its line to; *barrier
mean*), and in a loop of a stretch of products and an all-reduce with no barrier between, as
a tensor-parallel step runs them (*after N ms*: the all-reduce's mean time, N the stretch's
mean). *priced* is the calibrated cluster's alpha-beta price
(:func:`fxpar.planning.cost.link_seconds` on its all-reduce lines, the latency including
the calibrated wait for the last peer). Times are rank 0's, in milliseconds.

It is the measured twin of the cost model's communication term: where ``priced`` is far below
the loop's times, plans that wait at many collectives (tensor parallelism) are estimated short.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.distributed as dist

import fxpar
from fxpar.planning.cost import link_seconds
from fxpar.runtime import waiting
from fxpar.runtime.launch import spawn

SIZES = (4, 64 * 2**10, 512 * 2**10, 4 * 2**20)
"""Bytes all-reduced: one float32, and three sizes of activations and gradient buckets."""
STRETCHES = (0, 4, 12, 40)
"""Products of two 256-square matrices before each all-reduce of the loop."""
REPEATS = 20


def _rank(rank: int, world: int) -> list[tuple[int, float, list[float]]]:
    torch.set_num_threads(1)
    cluster = fxpar.calibrate(fxpar.Cluster((world,)))
    square = torch.randn(256, 256)
    product = torch.empty_like(square)

    def compute(products: int) -> None:
        for _ in range(products):
            torch.mm(square, square, out=product)

    rows = []
    for nbytes in SIZES:
        buffer = torch.zeros(nbytes // 4)
        for _ in range(3):
            waiting.all_reduce(buffer)
        alone = []
        for _ in range(REPEATS):
            dist.barrier()
            start = time.perf_counter()
            waiting.all_reduce(buffer)
            alone.append(time.perf_counter() - start)
        alone.sort()
        cells = [alone[len(alone) // 4], statistics.mean(alone)]
        for products in STRETCHES:
            dist.barrier()
            computing = reducing = 0.0
            for _ in range(REPEATS):
                start = time.perf_counter()
                compute(products)
                middle = time.perf_counter()
                waiting.all_reduce(buffer)
                computing += middle - start
                reducing += time.perf_counter() - middle
            cells += [computing / REPEATS, reducing / REPEATS]
        priced = link_seconds("all_reduce", nbytes, 0, cluster)
        rows.append((nbytes, priced, cells))
    return rows


def main() -> int:
    worlds = [int(arg) for arg in sys.argv[1:]] or [2, 4]
    print("world | bytes | priced | barrier q25 | barrier mean | "
          + " | ".join(f"after {products} products" for products in STRETCHES))  # fmt: skip
    print(" | ".join(["--"] * (5 + len(STRETCHES))))
    for world in worlds:
        for nbytes, priced, cells in spawn(_rank, world)[0]:
            q25, mean, *loop = cells
            after = [f"{loop[i + 1] * 1e3:.2f} (after {loop[i] * 1e3:.1f})"
                     for i in range(0, len(loop), 2)]  # fmt: skip
            times = (f"{seconds * 1e3:.2f}" for seconds in (priced, q25, mean))
            print(" | ".join((str(world), str(nbytes), *times, *after)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
