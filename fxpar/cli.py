"""The ``fxpar`` command line.

fxpar demo      capture a small GPT's training step, annotate it, report its costs, train
                it through the captured Program beside eager PyTorch, then split the step
                over a simulated mesh with each named plan and check it against one device
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence

import torch

import fxpar
from fxpar import plans
from fxpar.cluster import Cluster
from fxpar.lowering import lower
from fxpar.models import GPT, GPTConfig, gpt_loss
from fxpar.models.corpus import batches, corpus_tokens
from fxpar.passes import default_pipeline
from fxpar.report import cost_table
from fxpar.testing import simulate

PLANS: dict[str, Callable[[fxpar.Program, Cluster], fxpar.Program]] = {
    "data parallel": plans.data_parallel,
    "tensor parallel": plans.tensor_parallel,
    "fully sharded": plans.fully_sharded,
}


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
    worst = _spmd_report(program, eager_model, inputs, targets, Cluster((args.devices,)))
    return 0 if drift < 1e-4 and worst < 1e-4 else 1


def _spmd_report(
    program: fxpar.Program,
    model: torch.nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    cluster: Cluster,
) -> float:
    """Lower the step with each named plan, run every rank in one process, and compare."""
    flat = program.flat_inputs(model, inputs, targets)
    expected = program.signature.name_outputs(program(*flat))
    print(f"\none step split over a simulated {cluster}, per plan:")
    print(f"{'plan':<16}  {'collectives':<46}  {'MB/device':>9}  {'max |grad error|':>16}")
    worst = 0.0
    for name, plan in PLANS.items():
        spmd = lower(plan(program, cluster), cluster)
        result = simulate(spmd, flat).result
        error = max(
            (result.gradients[k] - v).abs().max().item() for k, v in expected.gradients.items()
        )
        error = max(error, (result.loss - expected.loss).abs().item())
        worst = max(worst, error)
        kinds = Counter(r.kind for r in spmd.collectives())
        summary = ", ".join(f"{count} {kind}" for kind, count in sorted(kinds.items()))
        megabytes = sum(r.bytes for r in spmd.collectives()) / 1e6
        print(f"{name:<16}  {summary:<46}  {megabytes:>9.3f}  {error:>16.2e}")
    return worst


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
    demo_parser.add_argument("--devices", type=int, default=4, help="simulated mesh size")
    demo_parser.set_defaults(run=demo)
    args = parser.parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
