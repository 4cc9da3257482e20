"""Activation checkpointing and mixed precision on CPU: peak memory per rank and step time.

For a GPT (4 layers, width 128, batch 8 x 128 tokens, dropout 0.1) under each plan on a mesh of
``--world`` devices, in float32 and with ``fxpar.MixedPrecision(bf16, reduce_dtype=fp32)``,
and ``remat`` "none" and "all":

- **peak memory per rank, measured**: every rank's lowered program runs on real tensors in
  simulated ranks (:mod:`fxpar.testing.simulate`), each node by node under
  :func:`fxpar.testing.memory.rank_peaks`, which adds up the storages alive after every op
  (values freed after their last use, as the generated code frees them; inputs throughout).
  The largest rank's peak is shown, and the part of it above the rank's inputs (parameters,
  batch, random draws);
- **estimate**: the plan's memory per device from the cost model (parameters, gradients,
  optimizer state, batch and saved activations; transient values are not modelled);
- **step time**: median wall time of ``ParallelModel.step`` (SGD) over ``--steps`` steps in
  real gloo processes, one thread each.

    python benchmarks/remat.py [--world 2] [--steps 10]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import fxpar
from fxpar import plans
from fxpar.models import GPT, GPTConfig, gpt_loss
from fxpar.passes import ChosenStrategies, ManualPlan, plan_program
from fxpar.planning.problem import PlanOptions
from fxpar.runtime.launch import spawn
from fxpar.testing.memory import rank_peaks

CONFIG = GPTConfig(n_layer=4, n_embd=128, n_head=4, vocab_size=256, block_size=128, dropout=0.1)
BATCH, LENGTH = 8, 128
PLANS: dict[str, ManualPlan] = {
    "data_parallel": plans.data_parallel,
    "tensor_parallel": plans.tensor_parallel,
    "fully_sharded": plans.fully_sharded,
}
REMAT = ("none", "all")
PRECISIONS: dict[str, fxpar.MixedPrecision | None] = {
    "fp32": None,
    "bf16": fxpar.MixedPrecision(torch.bfloat16, reduce_dtype=torch.float32),
}


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return (
        torch.randint(0, CONFIG.vocab_size, (BATCH, LENGTH), generator=generator),
        torch.randint(0, CONFIG.vocab_size, (BATCH, LENGTH), generator=generator),
    )


def _memory(world: int, manual: ManualPlan, precision: str, remat: str) -> tuple[int, int, float]:
    """Largest rank's measured peak, its part above the inputs, and the plan's estimate."""
    torch.manual_seed(0)
    model = GPT(CONFIG)
    tokens, targets = _batch()
    program = fxpar.capture(
        model, (tokens,), gpt_loss, example_targets=(targets,),
        mixed_precision=PRECISIONS[precision],
    )  # fmt: skip
    plan = plan_program(
        program, fxpar.Cluster.preset("cpu", (world,)), manual=manual,
        options=PlanOptions(remat=remat),
    )  # fmt: skip
    flat = plan.program.flat_inputs(model, tokens, targets)
    peaks = rank_peaks(fxpar.lower(plan), flat)
    worst = max(peaks.values(), key=lambda peak: peak.peak_bytes)
    chosen = plan.program.require(ChosenStrategies)
    return worst.peak_bytes, worst.activation_bytes, chosen.problem.memory(chosen.solution.choice)


def _step_times(rank: int, world: int, steps: int) -> dict[tuple[str, str, str], float]:
    torch.set_num_threads(1)
    tokens, targets = _batch()
    times = {}
    for name, manual, precision, remat in _cases():
        torch.manual_seed(0)
        parallel = fxpar.compile(
            GPT(CONFIG), fxpar.Cluster.preset("cpu", (world,)), (tokens,), gpt_loss,
            example_targets=(targets,), optimizer=fxpar.optim.SGD(lr=1e-3), manual=manual,
            options=PlanOptions(remat=remat), mixed_precision=PRECISIONS[precision],
        )  # fmt: skip
        parallel.step(tokens, targets)  # warm-up
        seconds = []
        for _ in range(steps):
            dist.barrier()
            start = time.perf_counter()
            parallel.step(tokens, targets)
            seconds.append(time.perf_counter() - start)
        times[name, precision, remat] = statistics.median(seconds)
    return times


def _cases() -> list[tuple[str, ManualPlan, str, str]]:
    return [
        (name, manual, precision, remat)
        for name, manual in PLANS.items()
        for precision in PRECISIONS
        for remat in REMAT
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    times = spawn(_step_times, args.world, args.steps)[0]
    mib = 2**20
    print(
        f"GPT {CONFIG.n_layer} layers, width {CONFIG.n_embd}, batch {BATCH}x{LENGTH}, "
        f"{args.world} ranks; memory in MiB per rank (largest rank)"
    )
    header = (
        f"{'plan':<16}{'dtype':<6}{'remat':<7}{'peak':>9}{'above inputs':>14}{'estimate':>10}"
        f"{'step ms':>9}"
    )
    print(header)
    print("-" * len(header))
    for name, manual, precision, remat in _cases():
        peak, above, estimate = _memory(args.world, manual, precision, remat)
        print(
            f"{name:<16}{precision:<6}{remat:<7}{peak / mib:>9.1f}{above / mib:>14.1f}"
            f"{estimate / mib:>10.1f}{times[name, precision, remat] * 1e3:>9.1f}"
        )


if __name__ == "__main__":
    main()
