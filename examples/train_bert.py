"""Fine-tune a Hugging Face BERT for sequence classification with fxpar, under torchrun:

    torchrun --nproc-per-node 2 examples/train_bert.py --steps 60 --checkpoint /tmp/bert-ckpt

or on one device, without torchrun: ``python examples/train_bert.py``. Every process runs this
script (SPMD). The model is a tiny ``BertForSequenceClassification`` built from a config (no
download), the data synthetic: padded token sequences, labelled by the kind of a few tokens
among them ("positive" or "negative"). What it shows, each piece a line or two:

- ``fxpar.deferred_init``: the model is recorded, not built; each rank makes only its own
  pieces of the weights, bitwise those of building it eagerly after the same seeding;
- a ``DataLoader`` with a ``DistributedSampler``: each rank loads its own rows, and
  ``fxpar.compile(..., batch="local")`` takes them as they come (the batch trained on is every
  rank's rows together, in rank order);
- bf16 compute with float32 master weights (``fxpar.MixedPrecision``);
- ``step(..., accumulate=2, max_grad_norm=1.0)``: each rank's rows are two micro-batches (its
  first half, then its second half), one update, clipping by the global gradient norm;
- AdamW with a linear warmup and decay, a plain ``torch.optim.lr_scheduler`` on
  ``parallel.optimizer``;
- periodic evaluation in eval mode: ``parallel.loss(...)`` is the held-out loss over every
  rank's rows, and ``parallel(...)`` returns the logits of this rank's own rows (as
  DistributedDataParallel does), so each rank counts its correct answers and one all-reduce
  adds the counts;
- checkpoints every ``--save-every`` updates with the scheduler and the data position
  (``fxpar.checkpoint.save_step``), and resuming from the newest one
  (``fxpar.checkpoint.resume``) to the losses of an uninterrupted run.

``--steps`` counts optimizer updates, in total over stopped and resumed runs.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import transformers
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import fxpar

LENGTH = 16  # tokens per sequence, padding included
VOCAB = 64
POSITIVE, NEGATIVE = range(10, 15), range(15, 20)  # the tokens that decide a label


def dataset(rows: int, seed: int) -> TensorDataset:
    """``rows`` sequences of 6 to LENGTH tokens (the rest padding, token 0) with their attention
    masks and labels: each holds one to three positive tokens (label 1) or negative ones
    (label 0) among filler tokens."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 2, (rows,), generator=generator)
    tokens = torch.randint(20, VOCAB, (rows, LENGTH), generator=generator)
    lengths = torch.randint(6, LENGTH + 1, (rows, 1), generator=generator)
    marked = torch.rand(rows, LENGTH, generator=generator) * lengths / 6  # about 3 a row
    sure = (torch.rand(rows, 1, generator=generator) * lengths).long()  # and at least 1
    marked.scatter_(1, sure, 0.0)
    first = torch.where(labels == 1, POSITIVE.start, NEGATIVE.start)[:, None]
    deciding = first + torch.randint(0, len(POSITIVE), (rows, LENGTH), generator=generator)
    tokens = torch.where(marked < 0.5, deciding, tokens)
    mask = (torch.arange(LENGTH) < lengths).long()
    return TensorDataset(tokens * mask, mask, labels)


def config() -> transformers.BertConfig:
    return transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=LENGTH, num_labels=2,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip


def warmup_then_decay(warmup: int, total: int) -> torch.optim.lr_scheduler.LambdaLR:
    """The factor of the learning rate at each update: linear warmup, then linear decay to 0."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return max(0.0, (total - step) / max(1, total - warmup))

    return factor  # type: ignore[return-value]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="optimizer updates in total")
    parser.add_argument("--rows", type=int, default=8, help="rows per rank per micro-batch")
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per update")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--log-every", type=int, default=5)
    parser.add_argument("--checkpoint", default=None, help="directory of step checkpoints")
    parser.add_argument("--save-every", type=int, default=0, help="0: only at the end")
    args = parser.parse_args()

    if "WORLD_SIZE" in os.environ:  # under torchrun
        dist.init_process_group("gloo")
        torch.set_num_threads(1)  # several processes share this machine's cores
        cluster = fxpar.Cluster.from_env("cpu")
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        cluster, rank, world = fxpar.Cluster((1,)), 0, 1

    train_set, held_out = dataset(512, seed=1), dataset(128, seed=2)
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, seed=0,
                                 drop_last=True)  # fmt: skip
    loader = DataLoader(train_set, batch_size=args.rows * args.accumulate, sampler=sampler,
                        drop_last=True)  # fmt: skip

    torch.manual_seed(0)
    model = fxpar.deferred_init(transformers.BertForSequenceClassification, config())
    ids, mask, labels = train_set.tensors
    rows = slice(0, args.rows)  # the shape of one rank's micro-batch
    example = {"input_ids": ids[rows], "attention_mask": mask[rows], "labels": labels[rows]}
    parallel = fxpar.compile(
        model, cluster, example, batch="local",
        optimizer=fxpar.optim.AdamW(lr=args.lr, weight_decay=0.01),
        mixed_precision=fxpar.MixedPrecision(torch.bfloat16, reduce_dtype=torch.float32),
    )  # fmt: skip
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        parallel.optimizer, warmup_then_decay(warmup=max(1, args.steps // 10), total=args.steps)
    )
    if rank == 0:
        print(parallel.plan.summary(), flush=True)

    epoch, skip = 0, 0
    resumed = fxpar.checkpoint.resume(parallel, args.checkpoint) if args.checkpoint else None
    if resumed is not None:
        step, extra = resumed
        scheduler.load_state_dict(extra["scheduler"])
        epoch, skip = extra["epoch"], extra["batches"]
        if rank == 0:
            print(f"resumed at step {step}", flush=True)

    loss = None
    while parallel.steps < args.steps:
        sampler.set_epoch(epoch)  # another shuffle each epoch, the same on every rank
        for index, (ids, mask, labels) in enumerate(loader):
            if index < skip:  # trained on before the checkpoint
                continue
            loss = parallel.step(input_ids=ids, attention_mask=mask, labels=labels,
                                 accumulate=args.accumulate, max_grad_norm=1.0)  # fmt: skip
            scheduler.step()
            step = parallel.steps
            if rank == 0 and (step % args.log_every == 0 or step == 1):
                lr = scheduler.get_last_lr()[0]
                print(f"step {step:4d}  loss {loss.item():.6f}  lr {lr:.2e}", flush=True)
            if args.eval_every and step % args.eval_every == 0:
                evaluate(parallel, held_out, rank, world)
            done = step == args.steps
            if args.checkpoint and (done or (args.save_every and step % args.save_every == 0)):
                extra = {"scheduler": scheduler.state_dict(), "epoch": epoch, "batches": index + 1}
                fxpar.checkpoint.save_step(parallel, args.checkpoint, step, extra=extra)
            if done:
                break
        epoch, skip = epoch + 1, 0
    if rank == 0 and loss is not None:
        print(f"final loss {loss.item():.6f} at step {parallel.steps}", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


def evaluate(parallel: fxpar.ParallelModel, held_out: TensorDataset, rank: int, world: int) -> None:
    """The held-out loss and accuracy, forward only and in eval mode. As in training, each rank
    passes its own rows (those a DistributedSampler without shuffling gives it)."""
    ids, mask, labels = (t[rank::world] for t in held_out.tensors)
    parallel.eval()
    loss = parallel.loss(input_ids=ids, attention_mask=mask, labels=labels)  # every rank's rows
    logits = parallel(input_ids=ids, attention_mask=mask).logits  # this rank's rows
    parallel.train()
    counts = torch.tensor([(logits.argmax(-1) == labels).sum().item(), len(labels)])
    if dist.is_initialized():
        dist.all_reduce(counts)
    if rank == 0:
        accuracy = counts[0].item() / counts[1].item()
        print(f"eval  step {parallel.steps:4d}  held-out loss {loss.item():.6f}  "
              f"accuracy {accuracy:.4f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
