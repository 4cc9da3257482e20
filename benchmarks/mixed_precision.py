"""Peak memory per rank and step time, float32 against bf16 compute with float32 reduction.

``python benchmarks/mixed_precision.py`` trains a GPT (4 layers, width 256, batch 16 x 256
tokens, AdamW) on 2 gloo ranks under the data-parallel and fully sharded plans, with and without
``fxpar.MixedPrecision(torch.bfloat16, reduce_dtype=torch.float32)``.

Peak memory is measured, per rank, as the high-water mark of the process's resident set during
the timed steps: after compiling and two warm-up steps, writing ``5`` to ``/proc/self/clear_refs``
resets the kernel's ``VmHWM`` to the current resident set, and ``VmHWM`` is read after the steps.
It is the whole process (torch itself, about 0.3 GiB, included), so differences between rows
are what the plan changes. The planner's estimate (the plan report's memory per device:
parameters, gradients, optimizer state, saved activations) is printed beside it.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

import fxpar
from fxpar import plans
from fxpar.models import GPT, GPTConfig, gpt_loss
from fxpar.planning.report import report_data
from fxpar.runtime.launch import spawn

CONFIG = GPTConfig(n_layer=4, n_embd=256, n_head=8, vocab_size=512, block_size=256, bias=False)
BATCH = (16, 256)
STEPS = 5
RUNS = {
    ("data_parallel", "fp32"): (plans.data_parallel, None),
    ("data_parallel", "bf16"): (plans.data_parallel, "bf16"),
    ("fully_sharded", "fp32"): (plans.fully_sharded, None),
    ("fully_sharded", "bf16"): (plans.fully_sharded, "bf16"),
}


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _run(rank: int, world_size: int, plan: str, precision: str) -> dict[str, float]:
    torch.set_num_threads(1)
    manual, policy = RUNS[(plan, precision)]
    mixed = fxpar.MixedPrecision(torch.bfloat16, torch.float32) if policy else None
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, CONFIG.vocab_size, BATCH, generator=generator)
    torch.manual_seed(0)
    parallel = fxpar.compile(
        GPT(CONFIG), fxpar.Cluster((world_size,)), (tokens,), gpt_loss,
        example_targets=(tokens,), manual=manual, mixed_precision=mixed,
    )  # fmt: skip
    for _ in range(2):
        parallel.step(tokens, tokens)
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")
    times = []
    for _ in range(STEPS):
        start = time.perf_counter()
        loss = parallel.step(tokens, tokens)
        times.append(time.perf_counter() - start)
    return {
        "peak_mib": _status_mib("VmHWM"),
        "estimate_mib": report_data(parallel.plan)["header"]["memory_bytes"] / 2**20,
        "step_ms": statistics.median(times) * 1e3,
        "loss": loss.item(),
    }


def main() -> None:
    print(
        f"GPT {CONFIG.n_layer} layers x {CONFIG.n_embd}, batch {BATCH[0]} x {BATCH[1]}, "
        f"AdamW, 2 gloo ranks, median of {STEPS} steps"
    )
    print("plan | compute | peak RSS MiB (rank 0 / 1) | planner MiB | step ms | loss")
    print("---- | ------- | ------------------------- | ----------- | ------- | ----")
    for plan, precision in RUNS:
        # One fresh pair of processes per row, so no row inherits another's high-water mark.
        ranks = spawn(_run, 2, plan, precision)
        peaks = " / ".join(f"{r['peak_mib']:.0f}" for r in ranks)
        first = ranks[0]
        label = "bf16, fp32 reduce" if precision == "bf16" else "fp32"
        print(
            f"{plan} | {label} | {peaks} | {first['estimate_mib']:.0f} | "
            f"{first['step_ms']:.0f} | {first['loss']:.3f}"
        )
        sys.stdout.flush()


if __name__ == "__main__":
    main()
