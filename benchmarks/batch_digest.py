"""What the cross-rank batch check costs per step: the digest each rank computes of its batch
(``fxpar.runtime.batches.batch_digest``) before the ranks compare them, before and after it
became row and column sums of the bits (issue "Trust", item 7), beside a training step.

One process, CPU (``--threads`` intra-op threads) or a GPU (``--device cuda``: the batches,
the sums and the steps on the GPU; BLAKE2b copies to the host first, as it did). For each
batch (GPT tokens 8x2048 int64; images 32x3x224x224 float32, the same as uint8; a 1 GiB
float32 batch), the median time of
``--repeats`` digests: BLAKE2b of every byte (the digest before, reproduced here) and the
row and column sums hashed with SHA-256 (the digest now). Beside them, the median step of a
small model on that batch (fxpar's GPT of 2 layers, width 64, on the tokens; two
convolutions and a linear layer, eager PyTorch, on the images): a step of a real model is
longer, so the share is an upper bound for these batch sizes on this CPU.

    python benchmarks/batch_digest.py
    python benchmarks/batch_digest.py --device cuda
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

import fxpar
from fxpar.models import GPT, GPTConfig, gpt_loss
from fxpar.runtime.batches import batch_digest
from fxpar.runtime.devices import synchronize


def blake2b_digest(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The digest before: BLAKE2b of each tensor's dtype, shape and every byte, on the host."""
    rows = [torch.zeros((0, 32), dtype=torch.uint8)]
    for tensor in tensors:
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        digest = hashlib.blake2b(digest_size=32)
        digest.update(f"{tensor.dtype}{list(tensor.shape)}".encode())
        digest.update(data.numpy().data)
        rows.append(torch.frombuffer(bytearray(digest.digest()), dtype=torch.uint8)[None])
    return torch.cat(rows)


DEVICE = torch.device("cpu")


def median_time(run: Callable[[], object], repeats: int) -> float:
    run()  # warm-up
    synchronize(DEVICE)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        synchronize(DEVICE)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def gpt_step(tokens: torch.Tensor) -> Callable[[], object]:
    config = GPTConfig(n_layer=2, n_embd=64, n_head=4, vocab_size=512, block_size=2048)
    torch.manual_seed(0)
    cluster = fxpar.Cluster((1,), device_type=DEVICE.type)
    model = fxpar.compile(
        GPT(config), cluster, (tokens,), gpt_loss, example_targets=(tokens,),
        optimizer=fxpar.optim.SGD(lr=0.0),
    )  # fmt: skip
    return lambda: model.step(tokens, tokens)


def conv_step(images: torch.Tensor) -> Callable[[], object]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 7, stride=4), nn.ReLU(), nn.Conv2d(16, 32, 3, stride=2), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10),
    ).to(DEVICE)  # fmt: skip
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    labels = torch.zeros(images.shape[0], dtype=torch.int64, device=DEVICE)

    def step() -> None:
        nn.functional.cross_entropy(model(images), labels).backward()
        optimizer.step()
        optimizer.zero_grad()

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    args = parser.parse_args()
    global DEVICE
    DEVICE = torch.device(args.device)
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 512, (8, 2048), generator=generator).to(DEVICE)
    images = torch.randn(32, 3, 224, 224, generator=generator).to(DEVICE)
    cases: list[tuple[str, torch.Tensor, Callable[[], object] | None]] = [
        ("tokens 8x2048 int64", tokens, gpt_step(tokens)),
        ("images 32x3x224x224 float32", images, conv_step(images)),
        ("images 32x3x224x224 uint8", (images * 50).to(torch.uint8), None),
        ("1 GiB float32", torch.randn(2**28, generator=generator).to(DEVICE), None),
    ]
    where = torch.cuda.get_device_name(DEVICE) if DEVICE.type == "cuda" else "CPU"
    print(f"medians of {args.repeats}, {args.threads} threads, on {where}:")
    print("| batch | size | BLAKE2b of every byte (before) | bit sums + SHA-256 (now) | speed-up "
          "| small model's step | check share of it, before / now |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for name, batch, step in cases:
        size = batch.numel() * batch.element_size()
        before = median_time(lambda b=batch: blake2b_digest([b]), args.repeats)
        now = median_time(lambda b=batch: batch_digest([b]), args.repeats)
        step_time = median_time(step, 3) if step is not None else None
        shown = f"{size / 2**20:.2f} MiB" if size < 2**30 else f"{size / 2**30:.0f} GiB"
        share = f"{before / step_time:.2%} / {now / step_time:.2%}" if step_time else "-"
        step_text = f"{step_time * 1e3:.0f} ms" if step_time else "-"
        print(
            f"| {name} | {shown} | {before * 1e3:.2f} ms ({size / before / 2**30:.2f} GiB/s) "
            f"| {now * 1e3:.2f} ms ({size / now / 2**30:.2f} GiB/s) | {before / now:.1f}x "
            f"| {step_text} | {share} |"
        )


if __name__ == "__main__":
    main()
