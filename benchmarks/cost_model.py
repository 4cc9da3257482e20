"""How well fxpar's cost model predicts the steps it plans: estimate beside measurement.

    python benchmarks/cost_model.py [MODEL ...] [--worlds 2 4] [--rounds 9] [--steps 2]
                                    [--round-seconds 0.25]
    python benchmarks/cost_model.py --no-time      # the memory table alone (2 minutes)

For each world size, that many gloo processes start (one thread each; world 4 puts four
processes on the development machine's two cores, so each gets about half a core, and
``fxpar.calibrate`` measures that share). Every rank first calibrates ``fxpar.Cluster((world,))``
on the running processes, then, for each model (``benchmarks/plan_quality.py``'s zoo: fxpar's
GPT, HF Llama, Mixtral, T5 and ViT, and a BatchNorm CNN, each from seed 0 with real weights)
fits the cluster's per-op speeds to that model's own step and to the same step at a quarter of
the batch (``fxpar.calibrate_ops(..., microbatch=fxpar.pipeline.microbatch_step(...))``: each
op's fixed cost a call apart from its rate) and compiles every plan kind on it:

- ``repl``, ``dp``, ``tp``, ``fsdp``: the manual plans (replicated, data parallel, tensor
  parallel on the mesh's axis with the default module names, fully sharded);
- ``ilp``: the plan the ILP chooses;
- ``pp``: a pipeline of two stages cut at even forward FLOPs (``even_split_points``), each
  stage data parallel over half the ranks, two micro-batches, 1F1B; its estimate is the stage
  DP's price of that split (``fxpar.pipeline.evaluate_split``). The CNN's pipeline normalises
  each micro-batch by its own statistics (fxpar warns that it does): its step is not the whole
  batch's, its time still is what it costs.
- ``auto``: fxpar's own choice, ``fxpar.compile(..., pipeline="auto")``: the ILP's plan of the
  whole batch or the stage DP's best pipeline of ILP-planned stages (2, 4 or 8 micro-batches,
  every schedule, remat on or off), whichever is estimated faster (:mod:`fxpar.joint`); its
  estimate is that plan's. When it is the ILP's plan it is that row's, timed once for both.

*overlapped* is the estimate less the communication the plan's schedule runs behind compute
(``fxpar.planning.step_time.step_overlap``; the pipeline's is its estimate).
*estimate* is the plan's estimated step (``plan.estimate``: its schedule priced, every
collective the lowering runs in full, the figure ``fxpar plan`` prints as "estimated step"; the
stage DP's for the pipeline); *price* the solver's objective for the same plan, communication
priced edge by edge (``plan.solution.objective``, "solver's price"); *measured* is the median
over ``--rounds`` rounds of the slowest rank's time per step (each round ``--steps`` steps, or
as many as run ``--round-seconds`` by the model's fastest estimate), after ``--warmup`` untimed
steps (by default enough that every program runs the copy fxpar runs in training,
:mod:`fxpar.runtime.fastcall`). In each round every plan of the model
runs its steps in turn, so a slow period of the machine hits all of them; each round
starts one plan later than the one before, so that no plan always runs after the same one. *tau* is
Kendall's tau-b between the estimated and the measured order of one model's distinct plans (1:
the same order; a plan kind whose plan is an earlier kind's, strategy for strategy, such as an
ILP that chose data parallelism, is timed and shown but counted once); *ilp/fastest* is the
ILP's measured step over the fastest measured plan's, among the plans that train the
single-device step (the CNN's pipeline, whose BatchNorm normalises each micro-batch by its own
statistics, is timed and estimated but left out of it). *auto/fastest* is the same for
fxpar's own choice, the target's plan: an intra-op plan cannot take what a pipeline gains on a
machine whose ranks share cores (its idle stages give the others their cores), the choice can.

The memory table runs each model's plans on real tensors for every rank in one process
(:func:`fxpar.testing.memory.rank_peaks`: the storages alive after every node of the rank's
lowered program, its inputs throughout, each rank's pieces its own) and compares the largest
rank's peak with the plan's estimated peak (:func:`fxpar.planning.peak_memory.peak_memory`, the
figure the plan report gives), planned for the optimizer timed (SGD without momentum, which
keeps no state; the optimizer's state lives outside the step's program). *row/meas* is the
solver's memory row (every gradient and saved activation at once, what the ILP bounds) over
the measured peak.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

import fxpar
from fxpar import ir, plans
from fxpar.errors import FxparError
from fxpar.passes import plan_program
from fxpar.pipeline import Pipeline, PipelineModel, evaluate_split, microbatch_step
from fxpar.pipeline.partition import even_split_points
from fxpar.planning.peak_memory import peak_memory
from fxpar.planning.plan import ChosenStrategies
from fxpar.planning.problem import PlanOptions
from fxpar.planning.step_time import price_schedule, step_overlap
from fxpar.runtime import fastcall
from fxpar.runtime.calibration import CalibrationOptions
from fxpar.runtime.launch import spawn
from fxpar.sharding import Sharding
from fxpar.testing.memory import rank_peaks

sys.path.insert(0, str(Path(__file__).parent))
from plan_quality import MODELS  # the zoo's tiny configs, one place

DEFAULT_MODELS = ("gpt", "llama", "mixtral", "t5", "vit", "cnn")
PLANS: dict[str, Callable[..., Any] | None] = {
    "repl": plans.replicated,
    "dp": plans.data_parallel,
    "tp": functools.partial(plans.tensor_parallel, axis=0),
    "fsdp": plans.fully_sharded,
    "ilp": None,
}
PIPELINE = "pp"
AUTO = "auto"
QUARTER = 4
"""calibrate_ops also times each model's step at this part of the batch (its fixed costs)."""
KINDS = (*PLANS, PIPELINE, AUTO)
TARGET_ERROR, TARGET_TAU, TARGET_ILP = 0.20, 0.8, 1.05


class Steppable(Protocol):
    def step(self, *batch: Any, **named_batch: Any) -> torch.Tensor: ...


@dataclass(frozen=True)
class Schedule:
    warmup: int
    rounds: int
    steps: int
    round_seconds: float = 0.0
    """Each plan runs at least this long (by the model's fastest estimate) a round."""
    calibration: CalibrationOptions = field(default_factory=CalibrationOptions)


@dataclass
class Timed:
    """One (model, plan) on one rank, or merged over the ranks (the slowest rank per round)."""

    estimate: float
    overlapped: float
    """The estimate with communication behind compute taken off (:func:`step_overlap`)."""
    price: float
    """The solver's objective for the plan (the pipeline's: its estimate)."""
    same_as: str = ""
    """The plan kind listed before this one whose plan this is, strategy for strategy (the
    ILP's plan is often data parallelism's): one plan timed twice, counted once in tau."""
    exact: bool = True
    """Whether the plan trains the single-device step (a pipeline of a model with BatchNorm
    normalises each micro-batch by its own statistics: a different step)."""
    seconds: list[float] = field(default_factory=list)

    @property
    def measured(self) -> float:
        return statistics.median(self.seconds)


def build(
    name: str, factory: Callable[[], Any] | None = None
) -> tuple[torch.nn.Module, Any, Any, tuple[Any, ...]]:
    """The zoo's model ``name`` (or ``factory``'s) with seed-0 weights and a batch of random
    data of its shapes."""
    torch.manual_seed(0)
    model, inputs, loss_fn, targets = (factory or MODELS[name])()
    generator = torch.Generator().manual_seed(1)

    def filled(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        if value.is_floating_point():
            return torch.randn(value.shape, generator=generator)
        high = 10 if value.dim() == 1 else 2048  # class labels, or token ids of the vocabulary
        return torch.randint(0, high, value.shape, generator=generator)

    if isinstance(inputs, dict):
        inputs = {key: filled(value) for key, value in inputs.items()}
        if (
            "labels" in inputs
            and "input_ids" in inputs
            and inputs["labels"].shape[1:] == (inputs["input_ids"].shape[1:])
        ):
            inputs["labels"] = inputs["input_ids"].clone()
    else:
        inputs = tuple(filled(value) for value in inputs)
    return model, inputs, loss_fn, tuple(filled(value) for value in targets)


def _batch_args(inputs: Any, targets: tuple[Any, ...]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if isinstance(inputs, dict):
        return tuple(targets), dict(inputs)
    return (*inputs, *targets), {}


def _compiled(
    name: str, cluster: fxpar.Cluster
) -> tuple[dict[str, tuple[Steppable, Timed]], dict[str, str], tuple[Any, ...],
           dict[str, Any]]:  # fmt: skip
    """Every plan kind of model ``name`` that applies, compiled, with its estimated step; why
    the others do not apply. ``cluster``'s per-op speeds are first fitted to the model's own
    ops (:func:`fxpar.calibrate_ops`)."""
    model, inputs, loss_fn, targets = build(name)
    program = fxpar.capture(copy.deepcopy(model), inputs, loss_fn, example_targets=targets)
    batch = [*(inputs.values() if isinstance(inputs, dict) else inputs), *targets]
    # The step at a quarter of the batch too, so that each op's fixed cost a call is fitted
    # apart from its rate (micro-batches and split batches are priced at their sizes).
    smaller = microbatch_step(copy.deepcopy(model), Pipeline(microbatches=QUARTER), inputs,
                              loss_fn, example_targets=targets)  # fmt: skip
    cluster = fxpar.calibrate_ops(
        cluster, program, program.flat_inputs(model, *batch), microbatch=smaller
    )
    compiled: dict[str, tuple[Steppable, Timed]] = {}
    refused = {}
    optimizer = fxpar.optim.SGD(lr=1e-3)
    strategies: dict[tuple[str, ...], str] = {}
    for kind, manual in PLANS.items():
        try:
            parallel = fxpar.compile(
                copy.deepcopy(model), cluster, inputs, loss_fn, example_targets=targets,
                optimizer=optimizer, manual=manual,
            )  # fmt: skip
            plan = parallel.plan
            nodes = list(plan.program.graph.nodes)
            overlap = step_overlap(price_schedule(plan.program, cluster), nodes)
            timed = Timed(plan.estimate, overlap.step, plan.solution.objective)
            chosen = tuple(str(ir.get(node, Sharding)) for node in nodes)
            timed.same_as = strategies.get(chosen, "")
            strategies.setdefault(chosen, kind)
            compiled[kind] = (parallel, timed)
        except FxparError as error:
            refused[kind] = str(error).splitlines()[0]
    try:
        # Two stages cut at even FLOPs, each a data-parallel group of half the ranks, two
        # micro-batches, 1F1B; the estimate is the stage DP's price of that split.
        pipeline = Pipeline(
            stages=even_split_points(program, 2), microbatches=2,
            data_parallel=cluster.world_size // 2,
        )  # fmt: skip
        estimate = evaluate_split(program, cluster, pipeline, optimizer_states=0).step_time
        pipelined = fxpar.compile(
            copy.deepcopy(model), cluster, inputs, loss_fn, example_targets=targets,
            optimizer=optimizer, pipeline=pipeline,
        )  # fmt: skip
        exact = not pipelined.semantics.notes
        compiled[PIPELINE] = (pipelined, Timed(estimate, estimate, estimate, exact=exact))
    except FxparError as error:
        refused[PIPELINE] = str(error).splitlines()[0]
    try:
        # fxpar's own choice: the ILP's plan of the whole batch, or the stage DP's pipeline of
        # ILP-planned stages, whichever is estimated faster (pipeline="auto").
        picked = fxpar.compile(
            copy.deepcopy(model), cluster, inputs, loss_fn, example_targets=targets,
            optimizer=optimizer, pipeline="auto",
        )  # fmt: skip
        if isinstance(picked, PipelineModel):
            assert picked.stage_choice is not None
            estimate = picked.stage_choice.step_time
            compiled[AUTO] = (picked, Timed(estimate, estimate, estimate))
        else:
            nodes = list(picked.plan.program.graph.nodes)
            same = strategies.get(tuple(str(ir.get(node, Sharding)) for node in nodes))
            if same is None:  # cannot happen while the ILP row runs the same passes
                raise AssertionError("pipeline='auto' ran an intra-op plan of no other row")
            compiled[AUTO] = (picked, dataclasses.replace(compiled[same][1], same_as=same))
    except FxparError as error:
        refused[AUTO] = str(error).splitlines()[0]
    args, named = _batch_args(inputs, targets)
    return compiled, refused, args, named


def _measure_world(
    rank: int, world: int, models: Sequence[str], schedule: Schedule
) -> tuple[dict[tuple[str, str], Timed], dict[tuple[str, str], str], str]:
    torch.set_num_threads(1)
    cluster = fxpar.calibrate(fxpar.Cluster((world,)), options=schedule.calibration)
    results: dict[tuple[str, str], Timed] = {}
    refusals: dict[tuple[str, str], str] = {}
    for name in models:
        compiled, refused, args, named = _compiled(name, cluster)
        refusals.update({(name, kind): why for kind, why in refused.items()})
        for parallel, _ in compiled.values():
            for _ in range(schedule.warmup):
                parallel.step(*args, **named)
        timed = {kind: estimates for kind, (_, estimates) in compiled.items()}
        # fxpar's choice of an intra-op plan is the ILP row's plan: timed once, for both.
        kinds = [kind for kind in compiled if not (kind == AUTO and timed[kind].same_as)]
        steps = _steps_per_round(schedule, min(t.estimate for t in timed.values()))
        for round_ in range(schedule.rounds):
            # Each round starts one plan later, so that no plan always follows the same one: in
            # a fixed order GPT's ILP plan (data parallelism's, the batch cut on the device)
            # measured 1.06x data parallelism on world 2, alternating the two 0.93x.
            shift = round_ % len(kinds)
            for kind in kinds[shift:] + kinds[:shift]:
                parallel = compiled[kind][0]
                dist.barrier()
                start = time.perf_counter()
                for _ in range(steps):
                    parallel.step(*args, **named)
                timed[kind].seconds.append((time.perf_counter() - start) / steps)
        if AUTO in timed and timed[AUTO].same_as:
            alias = timed[AUTO].same_as
            timed[AUTO] = dataclasses.replace(timed[alias], same_as=alias)
        results.update({(name, kind): t for kind, t in timed.items()})
    demand = "-" if cluster.core_demand is None else f"{cluster.core_demand:.2f}"
    demand += f" after {cluster.core_delay * 1e3:.1f} ms"
    lag = f"{cluster.lag_share:.3f} after {cluster.lag_stretch * 1e3:.1f} ms"
    shares = f"hidden share {cluster.hidden_share:.2f}, core demand {demand}, lag share {lag}"
    return results, refusals, f"{cluster}, {shares} (calibrated)"


def _steps_per_round(schedule: Schedule, fastest: float) -> int:
    """Steps each plan of a model runs a round: ``schedule.steps``, or as many as the fastest
    plan's estimate needs to run ``round_seconds`` (a short step's median over a few rounds
    is noisier: ViT's ILP plan and data parallelism, 36 ms each, measured 9% apart); the same
    on every rank."""
    steps = max(schedule.steps, math.ceil(schedule.round_seconds / max(fastest, 1e-6)))
    count = torch.tensor([steps])
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return int(count)


def _slowest(per_rank: list[dict[tuple[str, str], Timed]]) -> dict[tuple[str, str], Timed]:
    merged = {}
    for key, first in per_rank[0].items():
        rounds = zip(*(ranks[key].seconds for ranks in per_rank), strict=True)
        merged[key] = dataclasses.replace(first, seconds=[max(times) for times in rounds])
    return merged


def kendall_tau(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Kendall's tau-b of two paired samples (ties in either count as neither concordant nor
    discordant, and shrink the denominator)."""
    concordant = discordant = ties_x = ties_y = 0
    for i in range(len(xs)):
        for j in range(i + 1, len(xs)):
            dx, dy = xs[i] - xs[j], ys[i] - ys[j]
            if dx == 0 and dy == 0:
                continue
            if dx == 0:
                ties_x += 1
            elif dy == 0:
                ties_y += 1
            elif (dx > 0) == (dy > 0):
                concordant += 1
            else:
                discordant += 1
    denominator = ((concordant + discordant + ties_x) * (concordant + discordant + ties_y)) ** 0.5
    return (concordant - discordant) / denominator if denominator else float("nan")


def plan_tau(rows: dict[str, Timed]) -> float:
    """Kendall's tau-b between one model's estimated and measured order of its distinct plans
    (a plan that is another's, strategy for strategy, left out: its pairs with the others
    would count each ordering of that plan twice, and its measured difference from its twin
    is the measurement's noise)."""
    distinct = [t for t in rows.values() if not t.same_as]
    return kendall_tau([t.estimate for t in distinct], [t.measured for t in distinct])


def _time_table(world: int, results: dict[tuple[str, str], Timed], models: Sequence[str],
                refusals: dict[tuple[str, str], str]) -> list[float]:  # fmt: skip
    """Print one world's rows; return each row's estimate / measured."""
    ratios = []
    for name in models:
        rows = {kind: results[name, kind] for kind in KINDS if (name, kind) in results}
        if not rows:
            continue
        fastest = _fastest(rows)
        tau = plan_tau(rows)
        ilp = rows["ilp"].measured / fastest if "ilp" in rows else float("nan")
        for kind in KINDS:
            if kind not in rows:
                why = refusals.get((name, kind), "not run")
                print(f"{world} | {name} | {kind} | - | - | - | - | - | refused: {why[:80]}")
                continue
            t = rows[kind]
            ratios.append(t.estimate / t.measured)
            mark = "fastest" if t.measured == fastest else ""
            if t.same_as:
                mark = " ".join(filter(None, (mark, f"{t.same_as}'s plan: one plan in tau")))
            if not t.exact:
                mark = "not the one-device step: left out of ilp/fastest"
            cells = (f"{t.estimate * 1e3:.1f}", f"{t.measured * 1e3:.1f}",
                     f"{t.estimate / t.measured:.2f}", f"{t.overlapped / t.measured:.2f}",
                     f"{t.price / t.measured:.2f}", mark)  # fmt: skip
            print(" | ".join((str(world), name, kind, *cells)))
        auto = rows[AUTO].measured / fastest if AUTO in rows else float("nan")
        summary = f"**tau {tau:.2f}, ilp/fastest {ilp:.2f}, auto/fastest {auto:.2f}**"
        print(f"{world} | {name} | {summary} | | | | | |", flush=True)
    return ratios


def _fastest(rows: dict[str, Timed]) -> float:
    """The fastest measured step of the plans that train the single-device step."""
    return min(t.measured for t in rows.values() if t.exact)


def _memory_rows(name: str, world: int) -> list[tuple[str, int, float, float]]:
    """(plan, largest rank's measured peak bytes, estimated peak, the solver's memory row) of
    each plan kind."""
    model, inputs, loss_fn, targets = build(name)
    program = fxpar.capture(model, inputs, loss_fn, example_targets=targets)
    batch = [*(inputs.values() if isinstance(inputs, dict) else inputs), *targets]
    cluster = fxpar.Cluster((world,))
    rows = []
    for kind, manual in PLANS.items():
        try:
            plan = plan_program(
                copy.deepcopy(program), cluster, manual=manual,
                options=PlanOptions(optimizer_states=0),  # SGD without momentum, as timed
            )  # fmt: skip
        except FxparError:
            continue
        flat = plan.program.flat_inputs(model, *batch)
        peaks = rank_peaks(fxpar.lower(plan), flat)
        chosen = plan.program.require(ChosenStrategies)
        row = chosen.problem.memory(chosen.solution.choice)
        estimate = peak_memory(plan.program, cluster).peak_bytes
        rows.append((kind, max(p.peak_bytes for p in peaks.values()), estimate, row))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=list(DEFAULT_MODELS))
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=2, help="steps a plan runs a round, at least")
    parser.add_argument(
        "--round-seconds", type=float, default=0.25,
        help="a plan runs at least this long a round (by the model's fastest estimate)",
    )  # fmt: skip
    # Enough untimed steps that every program of a plan runs its fast copy when timed (fxpar
    # makes it after COPY_AFTER_CALLS calls): before it, a data-parallel Llama step on world 4
    # took 5% longer, and a pipeline, whose stage programs run once per micro-batch, reached
    # its copy in half the steps, so the intra-op rows were timed slow and the pipeline's not.
    parser.add_argument("--warmup", type=int, default=fastcall.COPY_AFTER_CALLS + 1)
    parser.add_argument("--no-memory", action="store_true", help="skip the memory table")
    parser.add_argument("--no-time", action="store_true", help="skip the step time table")
    parser.add_argument(
        "--quantile",
        type=float,
        default=CalibrationOptions.quantile,
        help="which of its repeats' times calibration keeps per collective",
    )
    args = parser.parse_args()
    unknown = sorted(set(args.models) - set(MODELS))
    if unknown:
        parser.error(f"unknown models {unknown}; choose from {sorted(MODELS)}")
    calibration = CalibrationOptions(quantile=args.quantile)
    schedule = Schedule(
        args.warmup, args.rounds, args.steps, args.round_seconds, calibration=calibration
    )

    if not args.no_time:
        _time_tables(args, schedule)
    if not args.no_memory:
        _memory_table(args)
    return 0


def _time_tables(args: argparse.Namespace, schedule: Schedule) -> None:
    print(
        "world | model | plan | estimate ms | measured ms | est/meas | overlapped/meas | "
        "price/meas | "
    )
    print("-- | " * 8 + "--")
    ratios: list[float] = []
    taus, ilps, autos, clusters = [], [], [], []
    for world in args.worlds:
        per_rank = spawn(_measure_world, world, args.models, schedule, timeout_s=1800.0)
        results = _slowest([r for r, _, _ in per_rank])
        ratios += _time_table(world, results, args.models, per_rank[0][1])
        clusters.append(f"world {world}: {per_rank[0][2]}")
        for name in args.models:
            rows = {k: results[name, k] for k in KINDS if (name, k) in results}
            if len(rows) > 1:
                taus.append(plan_tau(rows))
            if "ilp" in rows:
                ilps.append(rows["ilp"].measured / _fastest(rows))
            if AUTO in rows:
                autos.append(rows[AUTO].measured / _fastest(rows))
    errors = sorted(abs(r - 1) for r in ratios)
    print("\n" + "\n".join(clusters))
    median = statistics.median(errors)
    print(f"\nmedian |est/meas - 1| {median:.0%} (target <= {TARGET_ERROR:.0%}); "
          f"worst est/meas {min(ratios):.2f}-{max(ratios):.2f} (target within 2x); "
          f"tau {min(taus):.2f}-{max(taus):.2f} (target >= {TARGET_TAU}); "
          f"ilp/fastest {min(ilps):.2f}-{max(ilps):.2f} (intra-op alone); "
          f"auto/fastest {min(autos):.2f}-{max(autos):.2f} (target <= {TARGET_ILP})")  # fmt: skip


def _memory_table(args: argparse.Namespace) -> None:
    print("\nworld | model | plan | measured peak MiB | estimate MiB | est/meas | row/meas")
    print("-- | " * 6 + "--")
    memory_errors = []
    for world in args.worlds:
        for name in args.models:
            for kind, peak, estimate, row in _memory_rows(name, world):
                memory_errors.append(abs(estimate / peak - 1))
                cells = (f"{peak / 2**20:.2f}", f"{estimate / 2**20:.2f}",
                         f"{estimate / peak:.2f}", f"{row / peak:.2f}")  # fmt: skip
                print(" | ".join((str(world), name, kind, *cells)), flush=True)
    print(f"\nmemory: worst |est/meas - 1| {max(memory_errors):.0%} (target <= 15%)")


if __name__ == "__main__":
    sys.exit(main())
