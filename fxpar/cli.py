"""The ``fxpar`` command line.

fxpar demo      capture a small GPT's training step, annotate it, report its costs, and train
                it through the captured Program beside eager PyTorch
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from collections.abc import Sequence

import torch

import fxpar
from fxpar.models import GPT, GPTConfig, gpt_loss
from fxpar.models.corpus import batches, corpus_tokens
from fxpar.passes import default_pipeline
from fxpar.report import cost_table


def demo(args: argparse.Namespace) -> int:
    torch.manual_seed(args.seed)
    config = GPTConfig(
        vocab_size=256, block_size=args.length, n_layer=args.layers, n_head=4, n_embd=args.width
    )
    model = GPT(config)
    data = batches(corpus_tokens(), args.batch, args.length, seed=args.seed)
    inputs, targets = next(data)

    start = time.perf_counter()
    program = fxpar.capture(model, (inputs,), gpt_loss, example_targets=(targets,))
    captured = time.perf_counter() - start
    program = default_pipeline(verify=True).run(program)
    print(
        f"fxpar {fxpar.__version__}: captured one training step of a {args.layers}-layer GPT "
        f"(width {args.width}, batch {args.batch}x{args.length}) in {captured:.2f} s"
    )
    print(f"{program}\n")
    print(cost_table(program))

    # Train two identical copies: one eagerly, one by running the captured Program.
    eager_model, program_model = model, copy.deepcopy(model)
    eager_opt = torch.optim.SGD(eager_model.parameters(), lr=args.lr)
    params = dict(program_model.named_parameters())
    print(f"\ntraining {args.steps} steps of SGD (lr {args.lr}) on fxpar's built-in corpus")
    print(f"{'step':>6}  {'eager loss':>10}  {'program loss':>12}")
    for step in range(1, args.steps + 1):
        eager_opt.zero_grad()
        eager_loss = gpt_loss(eager_model(inputs), targets)
        eager_loss.backward()
        eager_opt.step()
        result = program.run(program_model, inputs, targets)
        with torch.no_grad():
            for name, grad in result.gradients.items():
                params[name].sub_(args.lr * grad)
        if step == 1 or step % args.every == 0 or step == args.steps:
            print(f"{step:>6}  {eager_loss.item():>10.4f}  {result.loss.item():>12.4f}")
        inputs, targets = next(data)
    drift = max(
        (a - b).abs().max().item()
        for a, b in zip(eager_model.parameters(), program_model.parameters(), strict=True)
    )
    print(f"\nlargest parameter difference after {args.steps} steps: {drift:.2e}")
    return 0 if drift < 1e-4 else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fxpar", description="fxpar command line")
    commands = parser.add_subparsers(dest="command", required=True)
    demo_parser = commands.add_parser("demo", help="capture, annotate and train a small GPT")
    demo_parser.add_argument("--layers", type=int, default=2)
    demo_parser.add_argument("--width", type=int, default=64)
    demo_parser.add_argument("--batch", type=int, default=8)
    demo_parser.add_argument("--length", type=int, default=32)
    demo_parser.add_argument("--steps", type=int, default=200)
    demo_parser.add_argument("--every", type=int, default=25, help="print the loss every N steps")
    demo_parser.add_argument("--lr", type=float, default=0.5)
    demo_parser.add_argument("--seed", type=int, default=0)
    demo_parser.set_defaults(run=demo)
    args = parser.parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
