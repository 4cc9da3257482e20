"""Expert parallelism beside the best plan without it, estimated and measured in one run.

    python benchmarks/expert_parallel.py [MODEL ...] [--worlds 2 4] [--rounds 5] [--steps 2]

Models (HF Mixtral, seed-0 weights, 2 layers, width 256, expert width 512, top-2, a batch of
8 x 128 random tokens): ``mixtral`` (4 experts, ``benchmarks/plan_quality.py``'s) and
``mixtral-16`` (16 experts, whose expert weights are 89% of the parameters, the regime expert
parallelism is for). For each world size that many gloo processes start (one thread each;
world 4 puts four processes on the development machine's two cores). Every rank calibrates
``fxpar.Cluster((world,))``, fits its per-op speeds to the model's step
(``fxpar.calibrate_ops``), and compiles, on that cluster:

- without expert parallelism: ``dp``, ``fsdp``, ``tp`` (the manual plans) and ``ilp`` (the
  plan the planner chooses; where it chooses expert parallelism itself, its row is ``ilp a2a``
  (tokens dispatched) or ``ilp ep`` and counts with the EP plans);
- with it (``fxpar.plans.expert_parallel``): ``ep`` (experts split by expert, the tokens whole
  on the axis, outputs summed) and ``ep a2a`` (the batch split too, each MoE block's rows sent
  to their experts' devices and back by all-to-all).

Each plan takes ``--warmup`` untimed steps, then ``--rounds`` rounds of ``--steps`` steps of
every plan in turn (SGD, lr 1e-3): *measured* is the median over rounds of the slowest rank's
time per step, *estimate* the plan's estimated step (``plan.estimate``). Every plan
takes as many steps on the same batch from the same weights, so their final losses must agree
(to 1e-4 relative: float32 sums in other orders); a disagreement is flagged and the script
exits with status 1. The last lines give, per (world, model), the best EP plan's step over the
best non-EP plan's, measured and estimated.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import fxpar
from fxpar import plans
from fxpar.errors import FxparError
from fxpar.planning import moe_blocks
from fxpar.runtime.launch import spawn

sys.path.insert(0, str(Path(__file__).parent))
from cost_model import Schedule, Timed, _batch_args, _slowest, build, kendall_tau
from plan_quality import _decoder, _lm

WITHOUT = {"dp": plans.data_parallel, "fsdp": plans.fully_sharded,
           "tp": plans.tensor_parallel, "ilp": None}  # fmt: skip
WITH = {
    "ep": lambda program, cluster: plans.expert_parallel(program, cluster, axis=0),
    "ep a2a": lambda program, cluster: plans.expert_parallel(
        program, cluster, axis=0, dispatch="all_to_all"
    ),
}
LOSS_TOLERANCE = 1e-4


def mixtral(experts: int) -> Any:
    import transformers

    config = transformers.MixtralConfig(
        **_decoder(intermediate_size=512), num_local_experts=experts, num_experts_per_tok=2
    )
    return _lm(transformers.MixtralForCausalLM(config), 128)


MODELS = {"mixtral": lambda: mixtral(4), "mixtral-16": lambda: mixtral(16)}


def _expert_parallel(parallel: Any) -> str | None:
    """How the planner's plan splits experts by expert, if it does: "ilp a2a" where it sends
    the tokens by all-to-all, "ilp ep" where it keeps them whole on that axis."""
    plan = parallel.plan
    blocks, _ = moe_blocks.find_blocks(plan.program.graph)
    if any(moe_blocks.dispatch_axis(block) is not None for block in blocks):
        return "ilp a2a"
    return "ilp ep" if "expert parallel" in plan.layout_summary() else None


def _measure_world(
    rank: int, world: int, models: list[str], schedule: Schedule
) -> tuple[dict[tuple[str, str], Timed], dict[tuple[str, str], float], dict[str, str]]:
    torch.set_num_threads(1)
    cluster = fxpar.calibrate(fxpar.Cluster((world,)))
    results: dict[tuple[str, str], Timed] = {}
    losses: dict[tuple[str, str], float] = {}
    notes: dict[str, str] = {}
    optimizer = fxpar.optim.SGD(lr=1e-3)
    for name in models:
        model, inputs, loss_fn, targets = build(name, MODELS[name])
        program = fxpar.capture(copy.deepcopy(model), inputs, loss_fn, example_targets=targets)
        batch = [*(inputs.values() if isinstance(inputs, dict) else inputs), *targets]
        fitted = fxpar.calibrate_ops(cluster, program, program.flat_inputs(model, *batch))
        args, named = _batch_args(inputs, targets)
        compiled = {}
        for kind, manual in {**WITHOUT, **WITH}.items():
            try:
                compiled[kind] = fxpar.compile(
                    copy.deepcopy(model), fitted, inputs, loss_fn, example_targets=targets,
                    optimizer=optimizer, manual=manual,
                )  # fmt: skip
            except FxparError as error:
                notes[f"{name} {kind}"] = "refused: " + str(error).splitlines()[0][:100]
        chosen = _expert_parallel(compiled["ilp"]) if "ilp" in compiled else None
        if chosen is not None:  # the planner chose expert parallelism: an EP row
            compiled[chosen] = compiled.pop("ilp")
        last: dict[str, torch.Tensor] = {}
        for kind, parallel in compiled.items():
            for _ in range(schedule.warmup):
                last[kind] = parallel.step(*args, **named)
        timed = {
            kind: Timed(p.plan.estimate, 0.0, p.plan.solution.objective)
            for kind, p in compiled.items()
        }
        for _ in range(schedule.rounds):
            for kind, parallel in compiled.items():
                dist.barrier()
                start = time.perf_counter()
                for _ in range(schedule.steps):
                    last[kind] = parallel.step(*args, **named)
                timed[kind].seconds.append((time.perf_counter() - start) / schedule.steps)
        results.update({(name, kind): t for kind, t in timed.items()})
        losses.update({(name, kind): float(loss) for kind, loss in last.items()})
    return results, losses, notes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=list(MODELS), help=f"of {list(MODELS)}")
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    unknown = sorted(set(args.models) - set(MODELS))
    if unknown:
        parser.error(f"unknown models {unknown}; choose from {list(MODELS)}")
    schedule = Schedule(args.warmup, args.rounds, args.steps)
    print("world | model | plan | estimate ms | measured ms | est/meas | final loss")
    print("-- | " * 6 + "--")
    summary, failed = [], False
    for world in args.worlds:
        per_rank = spawn(_measure_world, world, args.models, schedule, timeout_s=1800.0)
        results = _slowest([r for r, _, _ in per_rank])
        losses, notes = per_rank[0][1], per_rank[0][2]
        for name in args.models:
            rows = {kind: t for (model, kind), t in results.items() if model == name}
            groups = {"ep": [k for k in rows if "ep" in k or "a2a" in k]}
            groups["other"] = [k for k in rows if k not in groups["ep"]]
            reference = losses.get((name, "dp"))
            for kind, t in rows.items():
                loss = losses[name, kind]
                agrees = reference is None or abs(loss - reference) <= LOSS_TOLERANCE * abs(
                    reference
                )
                failed |= not agrees
                cells = (f"{t.estimate * 1e3:.1f}", f"{t.measured * 1e3:.1f}",
                         f"{t.estimate / t.measured:.2f}",
                         f"{loss:.6f}" + ("" if agrees else " MISMATCH"))  # fmt: skip
                print(" | ".join((str(world), name, kind, *cells)), flush=True)
            tau = kendall_tau([t.estimate for t in rows.values()],
                              [t.measured for t in rows.values()])  # fmt: skip
            if groups["ep"] and groups["other"]:
                measured = {side: min(rows[k].measured for k in kinds)
                            for side, kinds in groups.items()}  # fmt: skip
                estimated = {side: min(rows[k].estimate for k in kinds)
                             for side, kinds in groups.items()}  # fmt: skip
                summary.append(
                    f"world {world}, {name}: best EP / best non-EP measured "
                    f"{measured['ep'] / measured['other']:.2f}, estimated "
                    f"{estimated['ep'] / estimated['other']:.2f}; tau {tau:.2f}"
                )
        for key, note in sorted(notes.items()):
            summary.append(f"world {world}, {key}: {note}")
    print("\n" + "\n".join(summary))
    if failed:
        print("\nfinal losses disagree (MISMATCH rows)")
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
