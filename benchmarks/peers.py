"""fxpar's plans beside their PyTorch peers, on CPU gloo, in one run.

The same GPT (4 layers, width 256, 4 heads, vocab 256), the same global batch of 8 sequences of
128 tokens and SGD (lr 1e-3, no momentum) are trained, from the same seeded weights, each way:

- single process: eager PyTorch on the whole batch (world 1), timed in the parent process
  before any world starts, with nothing else of this script running;
- DDP: ``DistributedDataParallel``, each rank on its own rows;
- FSDP2: ``torch.distributed.fsdp.fully_shard`` on each transformer block, then on the root;
- DTensor TP: Megatron tensor parallelism with ``parallelize_module``: ``ColwiseParallel`` on
  ``attn.qkv`` and ``mlp.fc``, ``RowwiseParallel`` on ``attn.proj`` and ``mlp.proj`` of each
  block; embeddings, final norm and head replicated; the whole batch on every rank. Attention
  runs on its local heads (``n_head / world``, as torchtitan's attention does), since the
  model's own forward reshapes to the full width;
- fxpar with the manual plans ``data_parallel``, ``fully_sharded`` and ``tensor_parallel``, and
  with the plan the ILP chooses (no ``manual``) for fxpar's default ``Cluster`` and for that
  cluster calibrated on the running processes (``fxpar.calibrate``); every rank passes the
  whole batch (``batch="global"``, with the default batch check: one small all-gather per
  step, travelling while the forward computes).

Every process uses one thread. For each world size, each variant first takes ``--warmup``
steps (fxpar plans and lowers on its first, and runs its programs' fast copies from its 17th:
the steady state of a long training, see ``fxpar.runtime.fastcall``), then ``--rounds``
rounds follow; round r runs ``--steps`` steps of every variant in turn, so a slow period of
the machine hits all of them.
A step is forward, backward and optimizer update; a round's time per step is the slower rank's.
The table gives the min and median over rounds, the ratios fxpar dp / DDP, fxpar fsdp / FSDP2,
fxpar tp / DTensor TP and ILP / fastest fxpar manual plan (of medians), fxpar's collectives per
step (from its per-rank programs), and how far each variant's loss after all its steps is from
the single process's after as many (they must agree to about 1e-5 relative; a mismatch is
flagged and the script exits with status 1).

World 4 puts four processes on the development machine's two cores: each process then gets
about half a core, and every variant of that world pays the same contention.

    python benchmarks/peers.py [--worlds 2 4] [--rounds 9] [--steps 3] [--warmup 17] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from types import MethodType

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel

import fxpar
from fxpar.models import GPT, GPTConfig, gpt_loss
from fxpar.models.gpt import CausalSelfAttention
from fxpar.runtime import fastcall
from fxpar.runtime.launch import spawn
from fxpar.sharding import spec_str

CONFIG = GPTConfig(n_layer=4, n_embd=256, n_head=4, vocab_size=256, block_size=128)
BATCH, LENGTH = 8, 128  # the global batch: 8 sequences of 128 tokens
LR, SEED = 1e-3, 0
RELATIVE_TOLERANCE = 1e-5
MANUAL_PLANS = {
    "fxpar dp": fxpar.plans.data_parallel,
    "fxpar fsdp": fxpar.plans.fully_sharded,
    "fxpar tp": fxpar.plans.tensor_parallel,
}
PEER_OF = {"fxpar dp": "DDP", "fxpar fsdp": "FSDP2", "fxpar tp": "DTensor TP"}
ILP_PLANS = ("fxpar ILP", "fxpar ILP calibrated")


@dataclass(frozen=True)
class Schedule:
    warmup: int
    rounds: int
    steps: int

    @property
    def total_steps(self) -> int:
        """Steps each variant has taken when its loss is compared."""
        return self.warmup + self.rounds * self.steps


@dataclass(frozen=True)
class Variant:
    name: str
    step: Callable[[], torch.Tensor]
    """One training step on the global batch; returns the loss this rank computed."""
    local_loss: bool = False
    """The loss is the mean over this rank's rows only (DDP, FSDP2)."""


@dataclass
class Result:
    """One variant's measurements on one rank (or, merged, on the slowest rank)."""

    seconds: list[float] = field(default_factory=list)  # per step, one entry per round
    loss: float = float("nan")
    collectives: str = ""


def _model() -> GPT:
    torch.manual_seed(SEED)
    return GPT(CONFIG)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(0, CONFIG.vocab_size, (BATCH, LENGTH), generator=generator)
    targets = torch.randint(0, CONFIG.vocab_size, (BATCH, LENGTH), generator=generator)
    return tokens, targets


def _eager_step(
    model: torch.nn.Module, tokens: torch.Tensor, targets: torch.Tensor
) -> Callable[[], torch.Tensor]:
    """One step of the usual PyTorch loop on ``model`` (plain, DDP, FSDP2 or TP)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)

    def step() -> torch.Tensor:
        loss = gpt_loss(model(tokens), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    return step


def _local_head_attention(self: CausalSelfAttention, x: torch.Tensor) -> torch.Tensor:
    """``CausalSelfAttention.forward`` on this rank's heads: ``qkv`` gives ``n_head / world``
    whole heads (its output features are head-major), so reshape to the local width. (The
    model's dropout is 0, so the dropout modules are left out.)"""
    batch, length, _ = x.shape
    q, k, v = self.qkv(x).view(batch, length, self.n_head, 3, -1).unbind(3)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return self.proj(attended.transpose(1, 2).reshape(batch, length, -1))


def _tensor_parallel_model(world_size: int) -> GPT:
    mesh = init_device_mesh("cpu", (world_size,))
    model = _model()
    for block in model.blocks:
        parallelize_module(
            block,
            mesh,
            {
                "attn.qkv": ColwiseParallel(),
                "attn.proj": RowwiseParallel(),
                "mlp.fc": ColwiseParallel(),
                "mlp.proj": RowwiseParallel(),
            },
        )
        block.attn.n_head = CONFIG.n_head // world_size
        block.attn.forward = MethodType(_local_head_attention, block.attn)
    return model


def _fully_sharded_model(world_size: int) -> GPT:
    mesh = init_device_mesh("cpu", (world_size,))
    model = _model()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _collectives(parallel: fxpar.ParallelModel) -> str:
    """The collectives of one compiled step, e.g. ``2 (all_reduce 2)``."""
    kinds = Counter(record.kind for record in parallel.spmd.records)
    listed = ", ".join(f"{kind} {count}" for kind, count in sorted(kinds.items()))
    return f"{sum(kinds.values())} ({listed})"


def _closest_manual_plan(compiled: dict[str, fxpar.ParallelModel], ilp_name: str) -> str:
    """Which manual plan lays out the ILP's parameters and inputs most alike, and where not."""
    ilp = compiled[ilp_name].spmd
    names = list(ilp.program.placeholders())

    def differences(plan: str) -> list[str]:
        manual = compiled[plan].spmd.input_specs
        return [
            f"{name} {spec_str(mine)} (not {spec_str(theirs)})"
            for name, mine, theirs in zip(names, ilp.input_specs, manual, strict=True)
            if mine != theirs
        ]

    closest = min(MANUAL_PLANS, key=lambda plan: len(differences(plan)))
    different = differences(closest)
    return f"laid out as {closest}" + (f" except {', '.join(different)}" if different else "")


def _fxpar_variants(
    world_size: int, tokens: torch.Tensor, targets: torch.Tensor
) -> tuple[list[Variant], dict[str, str], str]:
    """fxpar's manual plans and the ILP's; their collectives per step, and a note on the ILP's
    plan (its summary, and the manual plan closest to it)."""
    compiled: dict[str, fxpar.ParallelModel] = {}
    default = fxpar.Cluster((world_size,))
    calibrated = fxpar.calibrate(default)  # this machine's links and cores, measured
    for name, manual, cluster in [
        *((name, manual, default) for name, manual in MANUAL_PLANS.items()),
        ("fxpar ILP", None, default),
        ("fxpar ILP calibrated", None, calibrated),
    ]:
        compiled[name] = fxpar.compile(
            _model(), cluster, (tokens,), gpt_loss,
            example_targets=(targets,), optimizer=fxpar.optim.SGD(lr=LR), manual=manual,
        )  # fmt: skip
    variants = [
        Variant(name, lambda parallel=parallel: parallel.step(tokens, targets))
        for name, parallel in compiled.items()
    ]
    note = "; ".join(
        f"{name}: {compiled[name].plan.summary()}; {_closest_manual_plan(compiled, name)}"
        for name in ILP_PLANS
    )
    return variants, {name: _collectives(p) for name, p in compiled.items()}, note


def _variants(rank: int, world_size: int) -> tuple[list[Variant], dict[str, str], str]:
    tokens, targets = _batch()
    rows = tokens.chunk(world_size)[rank], targets.chunk(world_size)[rank]
    peers = [
        ("DDP", DistributedDataParallel(_model()), rows),
        ("FSDP2", _fully_sharded_model(world_size), rows),
        ("DTensor TP", _tensor_parallel_model(world_size), (tokens, targets)),
    ]
    variants = [
        Variant(name, _eager_step(model, *batch), local_loss=batch is rows)
        for name, model, batch in peers
    ]
    fxpar_variants, collectives, note = _fxpar_variants(world_size, tokens, targets)
    return variants + fxpar_variants, collectives, note


def _time_rounds(
    variants: list[Variant], schedule: Schedule, synchronize: Callable[[], object]
) -> dict[str, Result]:
    for variant in variants:
        for _ in range(schedule.warmup):
            variant.step()
    results = {variant.name: Result() for variant in variants}
    for _ in range(schedule.rounds):
        for variant in variants:
            synchronize()
            start = time.perf_counter()
            for _ in range(schedule.steps):
                variant.step()
            results[variant.name].seconds.append((time.perf_counter() - start) / schedule.steps)
    return results


def _measure_world(rank: int, world_size: int, schedule: Schedule) -> tuple[dict[str, Result], str]:
    torch.set_num_threads(1)
    # FSDP2 itself calls c10d functions torch 2.13 deprecates: not ours to fix, so keep quiet.
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    variants, collectives, note = _variants(rank, world_size)
    results = _time_rounds(variants, schedule, dist.barrier)
    for variant in variants:  # the loss of the weights after schedule.total_steps updates
        loss = variant.step()
        if variant.local_loss:
            dist.all_reduce(loss)
            loss /= world_size
        results[variant.name].loss = loss.item()
        results[variant.name].collectives = collectives.get(variant.name, "")
    return results, note


def _measure_single(schedule: Schedule) -> Result:
    """Eager PyTorch on one process and one thread: the time per step and the reference loss."""
    torch.set_num_threads(1)
    tokens, targets = _batch()
    single = Variant("single", _eager_step(_model(), tokens, targets))
    result = _time_rounds([single], schedule, lambda: None)["single"]
    result.loss = single.step().item()
    return result


def _initial_loss() -> float:
    """The loss of the seeded weights: how far the compared losses have moved."""
    tokens, targets = _batch()
    with torch.no_grad():
        return gpt_loss(_model()(tokens), targets).item()


def _slowest(per_rank: list[dict[str, Result]]) -> dict[str, Result]:
    """Each round's time is the slowest rank's; the loss is rank 0's, or, where the ranks
    disagree (they should not), the one farthest from it."""
    merged = {}
    for name, first in per_rank[0].items():
        rounds = zip(*(ranks[name].seconds for ranks in per_rank), strict=True)
        losses = [ranks[name].loss for ranks in per_rank]
        loss = max(losses, key=lambda value: abs(value - losses[0]))  # rank 0's if all agree
        merged[name] = Result([max(times) for times in rounds], loss, first.collectives)
    return merged


def _ratio(results: dict[str, Result], name: str) -> str:
    if name in ILP_PLANS:
        manual = min(MANUAL_PLANS, key=lambda plan: statistics.median(results[plan].seconds))
        versus, label = results[manual], f" (vs {manual})"
    elif name in PEER_OF:
        versus, label = results[PEER_OF[name]], ""
    else:
        return ""
    ratio = statistics.median(results[name].seconds) / statistics.median(versus.seconds)
    return f"{ratio:.2f}{label}"


def _row(world: int, name: str, result: Result, reference: float, ratio: str) -> str:
    ms = [1e3 * seconds for seconds in result.seconds]
    difference = abs(result.loss - reference)
    flag = " MISMATCH" if difference > RELATIVE_TOLERANCE * abs(reference) else ""
    return (
        f"{world} | {name} | {min(ms):.1f} | {statistics.median(ms):.1f} | {ratio} | "
        f"{result.collectives} | {result.loss:.6f} | {difference:.1e}{flag}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=9, help="timed rounds (default 9)")
    parser.add_argument("--steps", type=int, default=3, help="steps per variant per round")
    parser.add_argument(
        "--warmup",
        type=int,
        default=fastcall.COPY_AFTER_CALLS + 1,
        help="untimed steps per variant (default: until fxpar runs its fast copies)",
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 rounds of 1 step")
    args = parser.parse_args()
    for world in args.worlds:
        if BATCH % world or CONFIG.n_head % world:
            parser.error(
                f"world {world} must divide the batch ({BATCH}) and the heads ({CONFIG.n_head})"
            )
    schedule = (
        Schedule(warmup=1, rounds=2, steps=1)
        if args.quick
        else Schedule(args.warmup, args.rounds, args.steps)
    )
    single = _measure_single(schedule)
    print(
        f"{schedule.warmup} warm-up steps, then {schedule.rounds} rounds of {schedule.steps} "
        f"steps per variant; losses after {schedule.total_steps} steps (the single process's "
        f"went from {_initial_loss():.6f} to {single.loss:.6f})\n"
    )
    print(
        "world | variant | min ms/step | median ms/step | ratio (medians) | "
        "fxpar collectives/step | loss | abs diff vs single"
    )
    print("-- | " * 7 + "--")
    print(_row(1, "single process", single, single.loss, ""), flush=True)
    notes, mismatches = [], 0
    for world in args.worlds:
        per_rank = spawn(_measure_world, world, schedule)
        results = _slowest([results for results, _ in per_rank])
        for name, result in results.items():
            row = _row(world, name, result, single.loss, _ratio(results, name))
            mismatches += row.endswith("MISMATCH")
            print(row, flush=True)
        notes.append(f"world {world}: {per_rank[0][1]}")
    print("\n" + "\n".join(notes))
    if mismatches:
        print(f"\n{mismatches} variant(s) differ from the single process by more than "
              f"{RELATIVE_TOLERANCE:g} relative")  # fmt: skip
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
