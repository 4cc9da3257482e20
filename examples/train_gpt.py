"""Train a small GPT with fxpar, launched the usual way, by torchrun, and resumable:

    torchrun --nproc-per-node 4 examples/train_gpt.py --steps 200
    torchrun --nproc-per-node 4 examples/train_gpt.py --mesh 2x2 --checkpoint /tmp/gpt-ckpt \
        --save-every 50 --steps 200

Every process runs this same script (SPMD). fxpar reads the world from torchrun's environment
(``fxpar.Cluster.from_env``), plans on rank 0 and shares the plan, and each process trains its
own piece of the model.

With ``--checkpoint DIR`` the run saves every ``--save-every`` steps into ``DIR/step-<N>``
(``fxpar.checkpoint.save_step``) and, when started again, resumes from the newest complete one
(``fxpar.checkpoint.resume``; a save that was interrupted is skipped), under any mesh: the
weights, optimizer state, step count and random state come from the checkpoint, and the data
stream is fast-forwarded to the step it stopped at. So a run stopped and resumed ends with the
loss of an uninterrupted one. ``--steps`` is the total.

The same makes it elastic: under ``torchrun --nnodes=1:2 --max-restarts=3`` (docs/training.md,
"Elastic runs"), when a machine is lost the survivors' processes fail, torchrun starts them
again on the machines that are left, and each replans for the smaller world and resumes from
the newest checkpoint, with the same global batch. ``--lose-node-at STEP`` simulates that loss
for tests: at that step, after its save, node 1's processes end together with their torchrun
agent (on the first attempt only).
"""

from __future__ import annotations

import argparse
import itertools
import os
import signal

import torch
import torch.distributed as dist

import fxpar
from fxpar.models import GPT, GPTConfig, gpt_loss
from fxpar.models.corpus import batches, corpus_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="total steps of the run")
    parser.add_argument("--mesh", default=None, help="e.g. 2x2; default: from torchrun")
    parser.add_argument("--checkpoint", default=None, help="directory of step checkpoints")
    parser.add_argument("--save-every", type=int, default=0, help="0: only at the end")
    parser.add_argument(
        "--lose-node-at", type=int, default=0, help="testing: node 1 dies at this step, once"
    )
    args = parser.parse_args()

    dist.init_process_group("gloo")
    torch.set_num_threads(1)  # several processes share this machine's cores
    overrides = {} if args.mesh is None else {"mesh_shape": fxpar.Cluster.parse_mesh(args.mesh)}
    cluster = fxpar.Cluster.from_env("cpu", **overrides)
    rank = dist.get_rank()

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=64))
    data = batches(corpus_tokens(), batch_size=8, length=32, seed=0)  # same stream on every rank
    tokens, targets = next(data)
    parallel = fxpar.compile(
        model, cluster, (tokens,), gpt_loss, example_targets=(targets,),
        optimizer=fxpar.optim.AdamW(lr=3e-3, weight_decay=0.0),
    )  # fmt: skip
    if rank == 0:
        print(parallel.plan.report(), flush=True)
    resumed = fxpar.checkpoint.resume(parallel, args.checkpoint) if args.checkpoint else None
    if resumed is not None:
        step, _ = resumed
        # The stream is deterministic: skip the batches the saved run had trained on.
        data = itertools.chain([(tokens, targets)], data)
        data = itertools.islice(data, step, None)
        tokens, targets = next(data)
        if rank == 0:
            where = fxpar.checkpoint.step_directory(args.checkpoint, step)
            print(f"resumed from {where} at step {parallel.steps}", flush=True)

    loss = None
    while parallel.steps < args.steps:
        loss = parallel.step(tokens, targets)
        if rank == 0 and (parallel.steps % 20 == 0 or parallel.steps == 1):
            print(f"step {parallel.steps:5d}  loss {loss.item():.4f}", flush=True)
        if args.checkpoint and (
            parallel.steps == args.steps
            or (args.save_every and parallel.steps % args.save_every == 0)
        ):
            fxpar.checkpoint.save_step(parallel, args.checkpoint, parallel.steps)
        if parallel.steps == args.lose_node_at and _first_attempt_on_node(1):
            os.kill(os.getppid(), signal.SIGKILL)  # the node's torchrun agent
            os._exit(1)
        tokens, targets = next(data)
    if rank == 0 and loss is not None:
        print(f"final loss {loss.item():.8f} at step {parallel.steps}", flush=True)
    dist.destroy_process_group()


def _first_attempt_on_node(node: int) -> bool:
    """Whether this process runs on torchrun's node ``node`` and was not restarted."""
    restarts = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return os.environ.get("GROUP_RANK") == str(node) and restarts == "0"


if __name__ == "__main__":
    main()
