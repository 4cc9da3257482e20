"""What checkpoints cost a run: save and load of a 1 GiB checkpoint with the digest time beside
the whole, and how long a save blocks the training loop, written in the foreground
(``save(path)``) or in the background (``save(path, blocking=False)``).

One process, no process group: a model of ``--mib`` MiB of float32 weights (a stack of
square linear layers, no optimizer state yet: the checkpoint holds the weights, the step count
and the random state) is saved and loaded ``--repeats`` times into a temporary directory
(``--directory``, on the disk being measured). The first table gives the median save and load
and the time of hashing every file of the checkpoint once with SHA-256, as each of them does
(a save digests what it wrote, a load what it is about to read).

The second table is a training loop that saves: the time the loop is blocked by the save
call (the whole save when it blocks; copying the state to host memory when it does not), and
for a background save the time until it is committed, the steps the loop ran meanwhile and
their median time against a step's with no save running (the writer and the step share the
CPU). Medians of ``--repeats``.

    python benchmarks/checkpoint.py                # 1 GiB
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import fxpar
from fxpar import checkpoint


def model_of(mib: int) -> nn.Module:
    width = 2048
    layers = max(1, mib * 2**20 // (width * width * 4))
    return nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(layers)))


def digest_costs(parallel: Any, path: Path, repeats: int) -> tuple[float, float, float]:
    """Median save, load and SHA-256-of-every-file times."""
    saves, loads, digests = [], [], []
    for _ in range(repeats):
        start = time.perf_counter()
        parallel.save(path)
        saves.append(time.perf_counter() - start)
        start = time.perf_counter()
        parallel.load(path)
        loads.append(time.perf_counter() - start)
        version = checkpoint.committed_version(path)
        start = time.perf_counter()
        for file in sorted(version.rglob("*")):
            if file.is_file():
                checkpoint._digest(file)
        digests.append(time.perf_counter() - start)
    return statistics.median(saves), statistics.median(loads), statistics.median(digests)


def timed_step(parallel: Any, batch: torch.Tensor) -> float:
    start = time.perf_counter()
    parallel.step(batch)
    return time.perf_counter() - start


def blocking_costs(parallel: Any, path: Path, batch: torch.Tensor, repeats: int) -> list[str]:
    """The table rows of a training loop's saves: blocking, then in the background."""
    alone = statistics.median(timed_step(parallel, batch) for _ in range(5))
    blocked, blocked_async, written, overlapped, during = [], [], [], [], []
    for _ in range(repeats):
        start = time.perf_counter()
        parallel.save(path)
        blocked.append(time.perf_counter() - start)
        timed_step(parallel, batch)

        start = time.perf_counter()
        pending = parallel.save(path, blocking=False)
        blocked_async.append(time.perf_counter() - start)
        steps = []
        while not pending.done():
            steps.append(timed_step(parallel, batch))
        pending.wait()
        written.append(time.perf_counter() - start)
        overlapped.append(len(steps))
        during.extend(steps)
    median = statistics.median
    sync = median(blocked)
    step_during = f"{median(during):.2f} s" if during else "-"
    return [
        f"| `save(path)` | {sync:.2f} s ({sync / alone:.1f} steps) | {sync:.2f} s | 0 | - |",
        f"| `save(path, blocking=False)` | {median(blocked_async):.2f} s "
        f"({median(blocked_async) / alone:.1f} steps) | {median(written):.2f} s "
        f"| {median(overlapped):.0f} | {step_during} (alone {alone:.2f} s) |",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--directory", default=None)
    args = parser.parse_args()
    model = model_of(args.mib)
    batch = torch.randn(4, 2048)
    parallel = fxpar.compile(
        model, fxpar.Cluster((1,)), (batch,), lambda out: out.square().mean(),
        optimizer=fxpar.optim.SGD(lr=0.0),
    )  # fmt: skip
    size = sum(t.numel() * t.element_size() for t in parallel.parameters.values())
    with tempfile.TemporaryDirectory(dir=args.directory) as root:
        save, load, digest = digest_costs(parallel, Path(root) / "ckpt", args.repeats)
        rows = blocking_costs(parallel, Path(root) / "loop", batch, args.repeats)
    print(f"checkpoint of {size / 2**30:.2f} GiB, medians of {args.repeats}:")
    print("| save | load | SHA-256 of every file | digest share of save | of load |")
    print("|---|---|---|---|---|")
    print(
        f"| {save:.2f} s | {load:.2f} s | {digest:.2f} s ({size / digest / 2**30:.2f} GiB/s) "
        f"| {digest / save:.0%} | {digest / load:.0%} |"
    )
    print()
    print(
        "| a save in a training loop | loop blocked | committed (as the loop saw it) "
        "| steps run meanwhile | step time meanwhile |"
    )
    print("|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
