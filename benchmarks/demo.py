"""The README demo's step time, with whichever fxpar is first on the path.

Four gloo processes (one thread each) compile the demo's GPT with the demo's settings and
solver, take one step, then time the next ones; it prints each rank's ms per step, the
collectives per step and the last loss. To compare commits, run it once per checkout in
the same sitting:

    python benchmarks/demo.py [--steps 150]
    PYTHONPATH=/path/to/other/checkout python benchmarks/demo.py
"""

from __future__ import annotations

import argparse
import time

import torch

import fxpar
from fxpar.cli import DemoSettings
from fxpar.models import gpt_loss
from fxpar.runtime.launch import spawn


def _rank(rank: int, world_size: int, steps: int) -> tuple[float, int, float]:
    torch.set_num_threads(1)
    settings = DemoSettings(steps=steps)
    data = settings.data()
    tokens, targets = data[0]
    parallel = fxpar.compile(
        settings.model(), fxpar.Cluster.preset("cpu", (world_size,)), (tokens,), gpt_loss,
        example_targets=(targets,), optimizer=settings.optimizer,
    )  # fmt: skip
    parallel.step(*data[0])  # warm-up: the first call fills caches and the allocator
    start = time.perf_counter()
    for batch in data[1:]:
        loss = parallel.step(*batch).item()
    seconds = (time.perf_counter() - start) / (len(data) - 1)
    return 1e3 * seconds, len(parallel.spmd.collectives()), loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    args = parser.parse_args()
    ranks = spawn(_rank, DemoSettings().devices, args.steps)
    per_step = ", ".join(f"{ms:.1f}" for ms, _, _ in ranks)
    _, collectives, loss = ranks[0]
    print(f"{fxpar.__file__}: ms per step by rank {per_step}; {collectives} collectives per "
          f"step; loss after {args.steps} steps {loss:.12f}")  # fmt: skip


if __name__ == "__main__":
    main()
