"""Gradient accumulation on CPU gloo: fxpar beside DistributedDataParallel, in the same run.

Two processes train a GPT data-parallel with ``k`` micro-batches per update, each way:

- fxpar, ``step(accumulate=k)``: the micro-batches run under ``no_sync`` and their gradients
  are reduced once per update;
- fxpar reducing every micro-batch (``backward`` k times outside ``no_sync``), what it did
  before ``no_sync``;
- DDP with ``no_sync()`` for the first k-1 micro-batches, the usual PyTorch loop;
- DDP reducing every micro-batch.

It prints the median time per update of each and the ratios, and the number of gradient
collectives per update in fxpar's programs. Every process uses one thread.

    python benchmarks/accumulation.py [--steps 5] [--accumulate 1 4 8]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import fxpar
from fxpar.models import GPT, GPTConfig, gpt_loss
from fxpar.runtime.launch import spawn

CONFIG = GPTConfig(n_layer=4, n_embd=128, n_head=4, vocab_size=256, block_size=64)
MICRO, LENGTH = 8, 64  # the global micro-batch: 8 sequences of 64 tokens


def _median_seconds(run: Callable[[], object], steps: int) -> float:
    run()  # warm-up: plans and lowers the programs, fills allocator caches
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _measure(rank: int, world_size: int, accumulate: int, steps: int) -> dict[str, float]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    batch = torch.randint(0, CONFIG.vocab_size, (MICRO * accumulate, LENGTH))
    micro = batch[:MICRO]
    parallel = fxpar.compile(
        GPT(CONFIG), fxpar.Cluster((world_size,)), (micro,), gpt_loss, example_targets=(micro,),
        optimizer=fxpar.optim.SGD(lr=1e-3), manual=fxpar.plans.data_parallel,
    )  # fmt: skip

    def fxpar_once() -> None:
        parallel.step(batch, batch, accumulate=accumulate)

    def fxpar_every() -> None:
        for piece in batch.chunk(accumulate):
            parallel.backward(piece, piece, scale=1 / accumulate)
        parallel.optimizer_step()
        parallel.zero_grad()

    model = DistributedDataParallel(GPT(CONFIG))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    local = batch.chunk(world_size)[rank].chunk(accumulate)  # DDP takes this rank's rows

    def ddp(no_sync: bool) -> None:
        for index, piece in enumerate(local):
            last = index == accumulate - 1
            with model.no_sync() if no_sync and not last else contextlib.nullcontext():
                (gpt_loss(model(piece), piece) / accumulate).backward()
        optimizer.step()
        optimizer.zero_grad()

    deferred = parallel._deferred(parallel._step)  # the micro-step program under no_sync
    loss_name = deferred.plan.program.graph.output_node().args[0][0].name
    return {
        "fxpar once": _median_seconds(fxpar_once, steps),
        "fxpar every": _median_seconds(fxpar_every, steps),
        "ddp no_sync": _median_seconds(lambda: ddp(True), steps),
        "ddp every": _median_seconds(lambda: ddp(False), steps),
        "collectives in a micro-step": sum(
            1 for r in parallel.spmd.records if r.phase.name == "OUTPUT" and r.tensor != loss_name
        ),
        "... under no_sync": sum(
            1 for r in deferred.spmd.records if r.phase.name == "OUTPUT" and r.tensor != loss_name
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="timed updates per measurement")
    parser.add_argument("--accumulate", type=int, nargs="+", default=[1, 4, 8])
    args = parser.parse_args()
    print(
        "k | fxpar once ms | fxpar every ms | DDP no_sync ms | DDP every ms | "
        "fxpar/DDP (once vs no_sync) | once/every | grad collectives per micro-step: "
        "synced, under no_sync"
    )
    print("-- | " * 7 + "--")
    for k in args.accumulate:
        rows = spawn(_measure, 2, k, args.steps)
        worst = {key: max(row[key] for row in rows) for key in rows[0]}  # the slower rank
        ms = {key: 1e3 * value for key, value in worst.items() if "collectives" not in key}
        print(
            f"{k} | {ms['fxpar once']:.1f} | {ms['fxpar every']:.1f} | {ms['ddp no_sync']:.1f} "
            f"| {ms['ddp every']:.1f} | {ms['fxpar once'] / ms['ddp no_sync']:.2f} | "
            f"{ms['fxpar once'] / ms['fxpar every']:.2f} | "
            f"{int(worst['collectives in a micro-step'])}, {int(worst['... under no_sync'])}",
            flush=True,
        )


if __name__ == "__main__":
    main()
