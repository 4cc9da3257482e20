"""Capture a small GPT, let fxpar plan it for a 2x2 mesh, and check the per-rank programs.

    python examples/plan_and_simulate.py

Prints the plan's summary, the collectives it inserts, rank 0's program, and the largest
difference between the simulated ranks and one device.
"""

from __future__ import annotations

from collections import Counter

import torch

import fxpar
from fxpar.models import GPT, GPTConfig, gpt_loss
from fxpar.testing import simulate


def main() -> float:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=64, n_head=4, vocab_size=256, block_size=32))
    tokens = torch.randint(0, 256, (8, 32))
    targets = torch.roll(tokens, -1, dims=1)
    cluster = fxpar.Cluster.preset("cpu", (2, 2))

    plan = fxpar.plan(model, cluster, (tokens,), gpt_loss, example_targets=(targets,))
    print(plan.summary())
    spmd = fxpar.lower(plan)
    kinds = Counter((r.kind, r.phase.value) for r in spmd.collectives())
    print("collectives:", ", ".join(f"{n} {kind} ({phase})" for (kind, phase), n in kinds.items()))
    print(spmd.for_rank(0).code()[:1500], "...")

    flat = plan.program.flat_inputs(model, tokens, targets)
    expected = plan.program.signature.name_outputs(plan.program(*flat))
    result = simulate(spmd, flat).result
    error = max((result.gradients[k] - v).abs().max().item() for k, v in expected.gradients.items())
    print(f"loss {result.loss.item():.6f} (one device {expected.loss.item():.6f}); "
          f"largest gradient difference {error:.2e}")  # fmt: skip
    return error


if __name__ == "__main__":
    main()
