"""Train a Hugging Face causal LM with fxpar the way LLM training scripts do, under torchrun:

    torchrun --nproc-per-node 2 examples/train_lm.py --steps 40 --checkpoint /tmp/lm-ckpt

Every process runs this script (SPMD). What it shows, each piece a line or two:

- a ``DataLoader`` with a ``DistributedSampler``: each rank loads only its own rows, and
  ``fxpar.compile(..., batch="local")`` takes them as they come (the batch trained on is every
  rank's rows together);
- gradient accumulation (``step(..., accumulate=k)``: k micro-batches, one update, and one
  gradient reduction per update) and clipping by the global norm (``max_grad_norm``);
- a warmup-then-cosine learning-rate schedule, a plain ``torch.optim.lr_scheduler`` attached to
  ``parallel.optimizer``;
- periodic evaluation on held-out windows, forward only, in eval mode (``parallel.eval()``,
  ``parallel.loss(...)``), and a greedy next-token prediction from ``parallel(...)``'s logits;
- periodic checkpoints with the scheduler's state and the data position (``save(extra=...)``),
  and resuming from the newest one, under any mesh, to the loss of an uninterrupted run.

``--steps`` counts optimizer updates, in total over stopped and resumed runs (the schedule is
laid out over them); ``--stop-after N`` stops a run early, as an interruption would.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.distributed as dist
import transformers
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import fxpar
from fxpar.models.corpus import corpus_tokens

LENGTH = 32  # tokens per window


def windows(tokens: torch.Tensor, stride: int) -> torch.Tensor:
    """Every window of LENGTH tokens starting at a multiple of ``stride``."""
    starts = range(0, tokens.numel() - LENGTH, stride)
    return torch.stack([tokens[s : s + LENGTH] for s in starts])


def warmup_cosine(warmup: int, total: int) -> torch.optim.lr_scheduler.LambdaLR:
    """The factor of the learning rate at each update: linear warmup, then a cosine to 10%."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor  # type: ignore[return-value]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="optimizer updates in total")
    parser.add_argument("--rows", type=int, default=4, help="rows per rank per micro-batch")
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per update")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--mesh", default=None, help="e.g. 1x2; default: from torchrun")
    parser.add_argument("--checkpoint", default=None, help="directory of step checkpoints")
    parser.add_argument("--save-every", type=int, default=0, help="0: only at the end")
    parser.add_argument("--stop-after", type=int, default=None,
                        help="stop (saved) after this many updates, as if interrupted")  # fmt: skip
    args = parser.parse_args()

    dist.init_process_group("gloo")
    torch.set_num_threads(1)  # several processes share this machine's cores
    overrides = {} if args.mesh is None else {"mesh_shape": fxpar.Cluster.parse_mesh(args.mesh)}
    cluster = fxpar.Cluster.from_env("cpu", **overrides)
    rank, world = dist.get_rank(), dist.get_world_size()

    tokens = corpus_tokens()
    cut = tokens.numel() * 9 // 10
    train_set = TensorDataset(windows(tokens[:cut], stride=4))
    held_out = windows(tokens[cut:], stride=8)
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, seed=0,
                                 drop_last=True)  # fmt: skip
    loader = DataLoader(train_set, batch_size=args.rows * args.accumulate, sampler=sampler,
                        drop_last=True)  # fmt: skip

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=LENGTH,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    example = train_set.tensors[0][: args.rows]  # the shape of one rank's micro-batch
    parallel = fxpar.compile(
        model, cluster, {"input_ids": example, "labels": example}, batch="local",
        optimizer=fxpar.optim.AdamW(lr=3e-3, weight_decay=0.1),
    )  # fmt: skip
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        parallel.optimizer, warmup_cosine(warmup=max(1, args.steps // 10), total=args.steps)
    )
    if rank == 0:
        print(parallel.plan.summary(), flush=True)

    epoch, skip = 0, 0
    resume = fxpar.checkpoint.latest(args.checkpoint) if args.checkpoint else None
    if resume is not None:
        extra = parallel.load(resume)
        scheduler.load_state_dict(extra["scheduler"])
        epoch, skip = extra["epoch"], extra["batches"]
        if rank == 0:
            print(f"resumed from {resume} at step {parallel.steps}", flush=True)

    last = args.steps if args.stop_after is None else min(args.steps, args.stop_after)
    loss = None
    while parallel.steps < last:
        sampler.set_epoch(epoch)  # another shuffle each epoch, the same on every rank
        for index, (rows,) in enumerate(loader):
            if index < skip:  # trained on before the checkpoint
                continue
            loss = parallel.step(input_ids=rows, labels=rows, accumulate=args.accumulate,
                                 max_grad_norm=1.0)  # fmt: skip
            scheduler.step()
            if rank == 0 and (parallel.steps % 5 == 0 or parallel.steps == 1):
                lr = scheduler.get_last_lr()[0]
                print(f"step {parallel.steps:4d}  loss {loss.item():.4f}  lr {lr:.2e}", flush=True)
            if args.eval_every and parallel.steps % args.eval_every == 0:
                evaluate(parallel, held_out, rank, world)
            done = parallel.steps == last
            if args.checkpoint and (
                done or (args.save_every and parallel.steps % args.save_every == 0)
            ):
                position = {"epoch": epoch, "batches": index + 1}
                parallel.save(f"{args.checkpoint}/step-{parallel.steps:06d}",
                              extra={"scheduler": scheduler.state_dict(), **position})  # fmt: skip
            if done:
                break
        epoch, skip = epoch + 1, 0
    if rank == 0 and loss is not None:
        print(f"final loss {loss.item():.8f} at step {parallel.steps}", flush=True)
    dist.destroy_process_group()


def evaluate(parallel: fxpar.ParallelModel, held_out: torch.Tensor, rank: int, world: int) -> None:
    """The held-out loss, forward only and in eval mode, and a greedy prediction. As in
    training (``batch="local"``), each rank passes its own share of the windows."""
    share = held_out[: len(held_out) // world * world].chunk(world)[rank]
    parallel.eval()
    loss = parallel.loss(input_ids=share, labels=share)  # over every rank's share
    logits = parallel(input_ids=share).logits  # a ModelOutput of this rank's rows
    parallel.train()
    if rank == 0:
        guess = bytes(logits[0].argmax(-1).tolist()[-8:]).decode("utf-8", "replace")
        print(f"eval  step {parallel.steps:4d}  held-out loss {loss.item():.4f}  "
              f"next bytes {guess!r}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
