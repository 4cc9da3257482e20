"""Where a measured step's time goes, per plan: ATen ops, waits for collectives, the rest.

    python benchmarks/step_breakdown.py WORLD [MODEL ...]      # e.g. 4 cnn vit

``WORLD`` gloo processes (one thread each) calibrate ``fxpar.Cluster((WORLD,))`` and compile
every plan kind of ``benchmarks/cost_model.py`` for each model (its zoo and its plans, with the
same per-op calibration), then time each plan's step (3 untimed, 4 timed) and run two more
steps under ``torch.profiler``. Per plan it prints the estimate, the slowest rank's measured
step, and per rank on average: the seconds inside ATen ops (the profiler's self time of
``aten::`` events) and inside :func:`fxpar.runtime.waiting.wait` (every wait for a collective
of the runtime, counted by wrapping it). What is left of the step is the runtime's own
Python. Beside them, the estimate's parts (an intra-op plan's; the pipeline's estimate is the
stage DP's, not split): its compute (ops and their dispatch), every collective of its
schedule as priced, and the lag (waits for slower peers beyond the collectives). It is the
diagnosis of ``cost_model.py``'s rows whose estimate is far from the measurement: whether the
ops or the waits are mispriced. ``FXPAR_WAIT=block`` compares the
two waiting policies (:mod:`fxpar.runtime.waiting`).
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import fxpar
from fxpar.pipeline import PipelineModel
from fxpar.planning.step_time import price_schedule, step_overlap
from fxpar.runtime import waiting
from fxpar.runtime.launch import spawn

sys.path.insert(0, str(Path(__file__).parent))
import cost_model  # the zoo, the plans and their compilation, one place

WARMUP, TIMED, PROFILED = 3, 4, 2


class _WaitClock:
    """Wraps :func:`fxpar.runtime.waiting.wait` to add up the seconds spent in it."""

    def __init__(self) -> None:
        self.seconds = 0.0
        inner = waiting.wait

        def timed(work: Any, *, poll: bool) -> None:
            start = time.perf_counter()
            inner(work, poll=poll)
            self.seconds += time.perf_counter() - start

        waiting.wait = timed  # type: ignore[assignment]


def _rank(rank: int, world: int, names: list[str]) -> dict[tuple[str, str], tuple[float, ...]]:
    torch.set_num_threads(1)
    clock = _WaitClock()
    cluster = fxpar.calibrate(fxpar.Cluster((world,)))
    rows = {}
    for name in names:
        compiled, _, args, named = cost_model._compiled(name, cluster)
        for kind, (parallel, estimates) in compiled.items():
            if kind == cost_model.AUTO and estimates.same_as:
                continue  # the ILP row's plan, timed there
            estimate = estimates.estimate
            for _ in range(WARMUP):
                parallel.step(*args, **named)
            dist.barrier()
            clock.seconds, start = 0.0, time.perf_counter()
            for _ in range(TIMED):
                parallel.step(*args, **named)
            step, waited = (time.perf_counter() - start) / TIMED, clock.seconds / TIMED
            dist.barrier()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                for _ in range(PROFILED):
                    parallel.step(*args, **named)
            aten = sum(e.self_cpu_time_total for e in prof.key_averages()
                       if e.key.startswith("aten::")) / 1e6 / PROFILED  # fmt: skip
            parts = (math.nan,) * 3
            if not isinstance(parallel, PipelineModel):  # a pipeline's estimate is the DP's
                plan = parallel.plan
                priced = price_schedule(plan.program, cluster)
                overlap = step_overlap(priced, list(plan.program.graph.nodes))
                parts = (overlap.compute, overlap.communication, overlap.lag)
            rows[name, kind] = (estimate, step, aten, waited, *parts)
    return rows


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__)
        return 2
    world, names = int(sys.argv[1]), sys.argv[2:] or list(cost_model.DEFAULT_MODELS)
    ranks = spawn(_rank, world, names)
    print("world | model | plan | estimate ms | measured ms | est compute | aten ms | "
          "est comm | est lag | waits ms | rest ms")  # fmt: skip
    print("----- | ----- | ---- | ----------- | ----------- | ----------- | ------- | "
          "-------- | ------- | -------- | -------")  # fmt: skip
    for key, (estimate, *_, compute, communication, lag) in ranks[0].items():
        step = max(r[key][1] for r in ranks)
        aten = statistics.mean(r[key][2] for r in ranks)
        waited = statistics.mean(r[key][3] for r in ranks)
        cells = (estimate, step, compute, aten, communication, lag, waited,
                 step - aten - waited)  # fmt: skip
        print(" | ".join((str(world), *key, *(f"{c * 1e3:.1f}" for c in cells))), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
