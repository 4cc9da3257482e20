"""What the checkpoint digests cost: save and load of a 1 GiB checkpoint, with the digest time
beside the whole.

One process, no process group: a model of ``--mib`` MiB of float32 weights (a stack of
square linear layers, no optimizer state yet: the checkpoint holds the weights, the step count
and the random state) is saved and loaded ``--repeats`` times into a temporary directory
(``--directory``, on the disk being measured); the table gives the median save and load and
the time of hashing every file of the checkpoint once with SHA-256, as each of them does (a
save digests what it wrote, a load what it is about to read).

    python benchmarks/checkpoint.py                # 1 GiB
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

import fxpar
from fxpar import checkpoint


def model_of(mib: int) -> nn.Module:
    width = 2048
    layers = max(1, mib * 2**20 // (width * width * 4))
    return nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(layers)))


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
    saves, loads, digests = [], [], []
    with tempfile.TemporaryDirectory(dir=args.directory) as root:
        path = Path(root) / "ckpt"
        for _ in range(args.repeats):
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
    save, load, digest = (statistics.median(times) for times in (saves, loads, digests))
    print(f"checkpoint of {size / 2**30:.2f} GiB, medians of {args.repeats}:")
    print("| save | load | SHA-256 of every file | digest share of save | of load |")
    print("|---|---|---|---|---|")
    print(
        f"| {save:.2f} s | {load:.2f} s | {digest:.2f} s ({size / digest / 2**30:.2f} GiB/s) "
        f"| {digest / save:.0%} | {digest / load:.0%} |"
    )


if __name__ == "__main__":
    main()
