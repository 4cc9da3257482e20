"""A soak: does anything grow? Memory, open files, threads and kept programs over 10,000 steps.

fxpar's GPT (2 layers, width 32) trains ``--steps`` SGD steps under the ILP's plan on ``--world``
gloo processes; every ``--phase`` steps the sequence length changes, cycling through
``--lengths`` lengths, so the driver plans new steps and, with ``--keep`` below the number of
lengths, drops and re-plans old ones (``fxpar.compile(max_kept_steps=...)``). Every
``--eval-every`` steps the model computes the loss of a held-out batch in eval mode, and every
``--save-every`` steps it saves a step checkpoint (``fxpar.checkpoint.save_step``, the two
newest kept). Every ``--every`` steps rank 0 records its resident memory (``VmRSS``), open
file descriptors, threads and the steps its driver keeps; the table shows them, and the last
row's growth over the first sample taken after every length has been seen once. With
``--trim``, each sample first hands the C heap's free pages back to the system
(``malloc_trim``), so that what remains resident is memory in use rather than memory glibc
keeps for later allocations.

    python benchmarks/soak.py                     # 10,000 steps on 2 processes
    python benchmarks/soak.py --trim              # the same, free heap pages returned first
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import tempfile
import time

import torch

import fxpar
from fxpar.models import GPT, GPTConfig, gpt_loss
from fxpar.runtime.launch import spawn

CONFIG = GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=64, bias=False)


def _resident_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _run(rank: int, world: int, args: argparse.Namespace) -> list[tuple[int, ...] | tuple]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    lengths = [8 + 4 * i for i in range(args.lengths)]
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, CONFIG.vocab_size, (4, lengths[0]), generator=generator)
    parallel = fxpar.compile(
        GPT(CONFIG), fxpar.Cluster((world,)), (tokens,), gpt_loss, example_targets=(tokens,),
        optimizer=fxpar.optim.SGD(lr=0.05), max_kept_steps=args.keep,
    )  # fmt: skip
    held_out = torch.randint(0, CONFIG.vocab_size, (4, lengths[0]), generator=generator)
    samples = []
    evaluated = float("nan")
    start = time.perf_counter()
    for step in range(args.steps):
        length = lengths[(step // args.phase) % len(lengths)]
        batch = torch.randint(0, CONFIG.vocab_size, (4, length), generator=generator)
        loss = parallel.step(batch, batch)
        if args.eval_every and parallel.steps % args.eval_every == 0:
            parallel.eval()
            evaluated = parallel.loss(held_out, held_out).item()
            parallel.train()
        if args.save_every and parallel.steps % args.save_every == 0:
            fxpar.checkpoint.save_step(parallel, args.root, parallel.steps)
            if rank == 0:  # keep the two newest
                for old in sorted(os.listdir(args.root))[:-2]:
                    shutil.rmtree(os.path.join(args.root, old))
        if step % args.every == args.every - 1:
            if args.trim:  # hand glibc's free heap pages back first: what stays is in use
                ctypes.CDLL("libc.so.6").malloc_trim(0)
            samples.append((
                step + 1, round(time.perf_counter() - start, 1), round(_resident_mib(), 1),
                len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task")),
                parallel._source.kept, round(loss.item(), 3), round(evaluated, 3),
            ))  # fmt: skip
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--lengths", type=int, default=8)
    parser.add_argument("--phase", type=int, default=250)
    parser.add_argument("--keep", type=int, default=4)
    parser.add_argument("--every", type=int, default=1000)
    parser.add_argument("--eval-every", type=int, default=500, help="0: no evaluation")
    parser.add_argument("--save-every", type=int, default=1000, help="0: no checkpoints")
    parser.add_argument(
        "--trim",
        action="store_true",
        help="return the C heap's free pages to the system (malloc_trim) before each sample",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fxpar-soak-") as root:
        args.root = root
        samples = spawn(_run, args.world, args, timeout_s=3600)[0]
    print(
        f"{args.steps} steps on {args.world} gloo processes, {args.lengths} sequence lengths "
        f"changing every {args.phase} steps, max_kept_steps={args.keep}, eval every "
        f"{args.eval_every}, a checkpoint every {args.save_every} (rank 0):"
    )
    print("| step | seconds | resident MiB | open fds | threads | kept steps | loss | eval loss |")
    print("|---|---|---|---|---|---|---|---|")
    for sample in samples:
        print("| " + " | ".join(str(value) for value in sample) + " |")
    seen = args.lengths * args.phase
    settled = next((s for s in samples if s[0] >= seen), samples[0])
    last = samples[-1]
    print(
        f"from step {settled[0]} (every length seen) to {last[0]}: resident "
        f"{last[2] - settled[2]:+.1f} MiB, fds {last[3] - settled[3]:+d}, threads "
        f"{last[4] - settled[4]:+d}"
    )


if __name__ == "__main__":
    main()
