"""Peak memory per rank while fxpar.compile builds a model's starting state, by where the
weights come from, on CPU gloo processes.

- eager: every rank builds the model with real weights, rank 0's are broadcast (the default);
- deferred_init: every rank records the constructor (no weight memory) and replays each
  weight, keeping its own piece;
- safetensors: every rank builds the model on the meta device and reads its own slices of a
  safetensors file (written beforehand by the parent process);
- torch.distributed.checkpoint: the same from a DCP directory (each tensor read whole by the
  ranks that hold a piece of it, one at a time).

The peak is each process's high-water RSS (``VmHWM``, reset through ``/proc/self/clear_refs``
just before building the model) minus its RSS at that moment, so it counts what building the
model and compiling it allocated, planning included, and not the interpreter or torch. Each
process first builds a small model both ways and runs its step, so one-time kernel and
thread-pool setup is not counted, and glibc's malloc gets a fixed mmap threshold of 1 MiB
(``MALLOC_MMAP_THRESHOLD_``): by default it raises the threshold as large blocks are freed and
keeps later ones on a heap it does not give back, so RSS would grow with every weight made and
freed in turn. The table gives the largest peak over the ranks beside the whole model, one
rank's pieces and the largest single tensor. Training then runs one step, and the losses of
all sources must agree.

    python benchmarks/meta_init.py [--world 4] [--layers 6] [--width 768]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

import fxpar
from fxpar.models import GPT, GPTConfig, gpt_loss
from fxpar.runtime.launch import spawn
from fxpar.testing.memory import resident_growth

MIB = 2**20


def _run(rank: int, world: int, config: GPTConfig, source: str, path: str, plan: str) -> dict:
    torch.set_num_threads(1)
    tiny = GPTConfig(n_layer=1, n_embd=32, n_head=4, vocab_size=config.vocab_size)
    fxpar.deferred_init(GPT, tiny)
    warm = GPT(tiny)
    gpt_loss(
        warm(torch.zeros(2, 8, dtype=torch.long)), torch.zeros(2, 8, dtype=torch.long)
    ).backward()
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, config.vocab_size, (world * 2, 32), generator=generator)
    targets = torch.randint(0, config.vocab_size, (world * 2, 32), generator=generator)
    with resident_growth() as growth:
        start = time.perf_counter()
        torch.manual_seed(0)
        init = None
        if source == "eager":
            model = GPT(config)
        elif source == "deferred_init":
            model = fxpar.deferred_init(GPT, config)
        else:
            with torch.device("meta"):
                model = GPT(config)
            init = path
        parallel = fxpar.compile(
            model, fxpar.Cluster.from_env(), (tokens,), gpt_loss, example_targets=(targets,),
            optimizer=fxpar.optim.SGD(lr=0.1), manual=getattr(fxpar.plans, plan), init=init,
        )  # fmt: skip
        seconds = time.perf_counter() - start
    peak = growth.peak_bytes
    held = sum(t.numel() * t.element_size() for t in [*parallel.parameters.values()])
    held += sum(t.numel() * t.element_size() for t in parallel.buffers.values())
    loss = float(parallel.step(tokens, targets))
    return {"peak": peak, "held": held, "seconds": seconds, "loss": loss}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--plans", nargs="+", default=["fully_sharded", "tensor_parallel"])
    args = parser.parse_args()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(MIB)  # read by the spawned processes' glibc
    config = GPTConfig(
        n_layer=args.layers, n_embd=args.width, n_head=12, vocab_size=256, block_size=32,
        bias=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = GPT(config)
    state = {k: v.detach().clone() for k, v in model.state_dict().items() if k != "head.weight"}
    whole = sum(t.numel() * t.element_size() for t in state.values())
    largest = max(t.numel() * t.element_size() for t in state.values())
    with tempfile.TemporaryDirectory() as directory:
        files = Path(directory) / "model.safetensors"
        save_file(state, str(files))
        dcp.save(state, checkpoint_id=str(Path(directory) / "dcp"), no_dist=True)
        del model, state
        print(
            f"GPT {args.layers}x{args.width}: {whole / MIB:.0f} MiB of weights, largest tensor "
            f"{largest / MIB:.1f} MiB; {args.world} gloo ranks, SGD\n"
        )
        print("plan | source | peak while compiling, MiB (max of ranks) | pieces, MiB | s | loss")
        print("-- | -- | -- | -- | -- | --")
        sources = {
            "eager": "",
            "deferred_init": "",
            "safetensors": str(files),
            "torch.distributed.checkpoint": str(Path(directory) / "dcp"),
        }
        for plan in args.plans:
            for source, path in sources.items():
                results = spawn(_run, args.world, config, source, path, plan)
                peak = max(r["peak"] for r in results) / MIB
                held = max(r["held"] for r in results) / MIB
                seconds = max(r["seconds"] for r in results)
                print(
                    f"{plan} | {source} | {peak:.0f} | {held:.0f} | {seconds:.1f} | "
                    f"{results[0]['loss']:.6f}"
                )


if __name__ == "__main__":
    main()
