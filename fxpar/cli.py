"""The ``fxpar`` command line.

fxpar demo   plan a small GPT for a mesh of local CPU processes, train it there (fxpar starts
             the gloo processes itself) and beside it on one device, and compare the losses
fxpar plan   plan a model, small or large (built on the meta device, no weights allocated), for
             a mesh of a cluster preset or cluster file, and print the plan report
fxpar calibrate
             measure latency, bandwidth, FLOP/s and memory bandwidth on local gloo processes
             (and, with --model, the speed of each of that model's ops in its step) and print
             (or save as a cluster file) the Cluster fitted to them
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

import torch
from torch import nn

import fxpar
from fxpar import plans
from fxpar.errors import FxparError
from fxpar.ir.capture import batch_tensors
from fxpar.ir.repeat import StampedLayers, capture_repeated
from fxpar.joint import SEARCHED_SCHEDULES, count_candidate, pipeline_wins
from fxpar.models import GPT, GPTConfig, gpt_loss
from fxpar.models.corpus import batches, corpus_tokens
from fxpar.models.shapes import GPT2_SHAPES, GPT3_SHAPES, LLAMA_SHAPES, gpt3, llama_named
from fxpar.passes import PassManager, default_passes, plan_program
from fxpar.pipeline import (
    PassPlanner,
    Pipeline,
    PipelinePlan,
    StageChoice,
    capture_microbatch,
    microbatch_step,
)
from fxpar.pipeline.stage_choice import format_seconds
from fxpar.planning.plan import Plan
from fxpar.planning.problem import PlanOptions
from fxpar.runtime.calibration import Calibration, measure
from fxpar.runtime.launch import spawn
from fxpar.solvers import ExhaustiveSolver, GreedySolver, ILPSolver
from fxpar.solvers.errors import InfeasiblePlanError

MANUAL_PLANS: dict[str, Callable[..., fxpar.Program]] = {
    "data_parallel": plans.data_parallel,
    "tensor_parallel": plans.tensor_parallel,
    "fully_sharded": plans.fully_sharded,
}


class ProgressBar:
    """A one-line progress bar on a terminal stream (redrawn in place; plain lines otherwise)."""

    def __init__(self, total: int, label: str, stream: TextIO | None = None) -> None:
        self.total, self.label = total, label
        self.stream = stream or sys.stderr
        self.start = time.perf_counter()
        self.interactive = self.stream.isatty()

    def update(self, done: int, note: str = "") -> None:
        if not self.interactive and done not in (1, self.total) and done % max(1, self.total // 4):
            return
        width = 30
        filled = round(width * done / self.total)
        elapsed = time.perf_counter() - self.start
        line = (
            f"{self.label} [{'#' * filled}{'.' * (width - filled)}] {done}/{self.total} "
            f"{elapsed:5.1f}s {note}"
        )
        end = "" if self.interactive and done < self.total else "\n"
        self.stream.write(("\r" if self.interactive else "") + line + end)
        self.stream.flush()


# -- fxpar demo ------------------------------------------------------------------------------


@dataclass(frozen=True)
class DemoSettings:
    layers: int = 2
    width: int = 64
    heads: int = 4
    batch: int = 8
    length: int = 32
    steps: int = 300
    lr: float = 3e-3
    devices: int = 4
    seed: int = 0
    solver: str = "ilp"

    @property
    def config(self) -> GPTConfig:
        return GPTConfig(
            vocab_size=256,
            block_size=self.length,
            n_layer=self.layers,
            n_head=self.heads,
            n_embd=self.width,
            bias=False,
        )

    def model(self) -> GPT:
        # float64: over hundreds of steps, training amplifies the rounding of any two summation
        # orders (one device vs. a sum over ranks) until float32 curves drift apart visibly;
        # in float64 what remains to compare is the plan's arithmetic.
        torch.manual_seed(self.seed)
        return GPT(self.config).double()

    def data(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        stream = batches(corpus_tokens(), self.batch, self.length, seed=self.seed)
        return [next(stream) for _ in range(self.steps)]

    @property
    def optimizer(self) -> fxpar.optim.AdamW:
        return fxpar.optim.AdamW(lr=self.lr, weight_decay=0.0)


def demo(args: argparse.Namespace) -> int:
    settings = DemoSettings(
        layers=args.layers, width=args.width, batch=args.batch, length=args.length,
        steps=args.steps, lr=args.lr, devices=args.devices, seed=args.seed, solver=args.solver,
    )  # fmt: skip

    print(
        f"fxpar {fxpar.__version__} demo: a {settings.layers}-layer GPT (width {settings.width}, "
        f"batch {settings.batch}x{settings.length} bytes of fxpar's built-in corpus), planned "
        f"by the {settings.solver} solver for {settings.devices} CPU processes on gloo, trained "
        f"{settings.steps} steps of AdamW (lr {settings.lr}) in float64\n",
        flush=True,
    )
    start = time.perf_counter()
    parallel_losses, stepping = spawn(_demo_rank, settings.devices, settings)[0]
    parallel_seconds = time.perf_counter() - start

    model = settings.model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=0.0)
    bar = ProgressBar(settings.steps, "single device   ")
    single_losses = []
    start = time.perf_counter()
    for step, (tokens, targets) in enumerate(settings.data(), 1):
        optimizer.zero_grad()
        loss = gpt_loss(model(tokens), targets)
        loss.backward()
        optimizer.step()
        single_losses.append(loss.item())
        bar.update(step, f"loss {loss.item():.3f}")
    single_seconds = time.perf_counter() - start

    print(
        f"\n{'step':>6}  {'single device':>13}  {'fxpar, ' + str(settings.devices) + ' ranks':>14}"
    )
    every = max(1, settings.steps // 10)
    for step in range(settings.steps):
        if step % every == 0 or step == settings.steps - 1:
            print(f"{step + 1:>6}  {single_losses[step]:>13.4f}  {parallel_losses[step]:>14.4f}")
    worst = max(abs(a - b) / abs(b) for a, b in zip(parallel_losses, single_losses, strict=True))
    agree = worst < 1e-6
    print(
        f"\nlargest relative loss difference over {settings.steps} steps: {worst:.1e} "
        f"({'the curves agree' if agree else 'THE CURVES DIVERGE'}); loss "
        f"{single_losses[0]:.2f} -> {single_losses[-1]:.2f}. Wall time: {parallel_seconds:.1f} s "
        f"on {settings.devices} processes (start-up included; "
        f"{1000 * stepping / settings.steps:.1f} ms per step), {single_seconds:.1f} s on one "
        f"device ({1000 * single_seconds / settings.steps:.1f} ms per step); on a machine with "
        "fewer cores than processes the ranks take turns."
    )
    return 0 if agree else 1


def _demo_rank(rank: int, world_size: int, settings: DemoSettings) -> tuple[list[float], float]:
    torch.set_num_threads(1)  # the processes share the machine's cores
    data = settings.data()
    cluster = fxpar.Cluster.preset("cpu", (world_size,))
    tokens, targets = data[0]
    parallel = fxpar.compile(
        settings.model(), cluster, (tokens,), gpt_loss, example_targets=(targets,),
        optimizer=settings.optimizer, passes=_pipeline(settings.solver),
    )  # fmt: skip
    if rank == 0:
        print(parallel.plan.report(), flush=True)
        collectives = len(parallel.spmd.collectives())
        print(f"\nrank 0's program runs {collectives} collectives per step\n", flush=True)
    bar = ProgressBar(settings.steps, f"fxpar, {world_size} ranks") if rank == 0 else None
    losses = []
    start = time.perf_counter()
    for step, batch in enumerate(data, 1):
        losses.append(parallel.step(*batch).item())
        if bar is not None:
            bar.update(step, f"loss {losses[-1]:.3f}")
    return losses, time.perf_counter() - start


def _pipeline(
    name: str, time_limit: float | None = None, options: PlanOptions | None = None
) -> PassManager:
    """The default pipeline choosing with a manual plan or a solver given by name;
    ``time_limit`` for the ILP (its default if None)."""
    if name in MANUAL_PLANS:
        return default_passes(manual=MANUAL_PLANS[name], options=options)
    if name == "ilp" and time_limit is not None:
        return default_passes(solver=ILPSolver(time_limit=time_limit), options=options)
    solvers = {"ilp": ILPSolver, "greedy": GreedySolver, "exhaustive": ExhaustiveSolver}
    if name not in solvers:
        choices = sorted([*solvers, *MANUAL_PLANS])
        raise FxparError(f"unknown solver {name!r}; choose from {choices}")
    return default_passes(solver=solvers[name](), options=options)


# -- fxpar plan ------------------------------------------------------------------------------

MODEL_NAMES = (*GPT2_SHAPES, *GPT3_SHAPES, *LLAMA_SHAPES)


@dataclass(frozen=True)
class Target:
    """What to plan: a model and its example batch (and loss, when the model has none)."""

    model: nn.Module
    example_inputs: Sequence[Any] | dict[str, Any]
    loss_fn: Callable[..., torch.Tensor] | None = None
    example_targets: Sequence[torch.Tensor] = ()


def build_target(spec: str, batch: int, length: int, device: str = "meta") -> Target:
    """A named model shape, or ``module:attr`` naming a function that returns an nn.Module
    or a tuple ``(model, example_inputs[, loss_fn[, example_targets]])``, built on ``device``
    (meta: no weights allocated)."""
    tokens = torch.zeros(batch, length, dtype=torch.long)
    with torch.device(device):
        if spec in GPT2_SHAPES:
            layers, width, heads = GPT2_SHAPES[spec]
            config = GPTConfig(50257, max(1024, length), layers, heads, width)
            return Target(GPT(config), (tokens,), gpt_loss, (tokens,))
        if spec in LLAMA_SHAPES:
            return Target(llama_named(spec), {"input_ids": tokens, "labels": tokens})
        if spec in GPT3_SHAPES:
            return Target(gpt3(spec), {"input_ids": tokens, "labels": tokens})
        if ":" not in spec:
            raise FxparError(
                f"unknown model {spec!r}: name one of {list(MODEL_NAMES)}, or give module:attr "
                "for a function returning a model (or (model, example_inputs, loss_fn, "
                "example_targets))"
            )
        module_name, _, attr = spec.partition(":")
        try:
            factory = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as error:
            raise FxparError(f"cannot load {spec!r}: {error}") from error
        built = factory()
    if isinstance(built, nn.Module):
        if not hasattr(getattr(built, "config", None), "vocab_size"):
            raise FxparError(
                f"{spec} returned a {type(built).__name__} but fxpar cannot guess its inputs: "
                "return (model, example_inputs, loss_fn, example_targets) instead"
            )
        return Target(built, {"input_ids": tokens, "labels": tokens})
    if isinstance(built, tuple) and built and isinstance(built[0], nn.Module):
        return Target(*built)
    raise FxparError(f"{spec} returned {type(built).__name__}, not a model or a tuple")


def plan_cluster(args: argparse.Namespace, mesh: tuple[int, ...]) -> fxpar.Cluster:
    """The cluster ``fxpar plan`` plans for: ``--cluster-file``'s, else ``--cluster``'s preset,
    on ``mesh``, with ``--memory-gib``'s memory if given."""
    if args.cluster_file:
        cluster = fxpar.Cluster.load(args.cluster_file, mesh)
    else:
        cluster = fxpar.Cluster.preset(args.cluster, mesh)
    if args.memory_gib is not None:
        cluster = dataclasses.replace(cluster, memory=args.memory_gib * 2**30)
    return cluster


def plan_command(args: argparse.Namespace) -> int:
    cluster = plan_cluster(args, fxpar.Cluster.parse_mesh(args.mesh))
    target = build_target(args.model, args.batch, args.length)
    params = sum(p.numel() for p in target.model.parameters())
    print(f"planning {args.model} ({params / 1e9:.2f}B parameters, on meta) for {cluster}")
    counts = _microbatch_counts(args.microbatches)
    start = time.perf_counter()
    policy = (
        fxpar.MixedPrecision(torch.bfloat16, reduce_dtype=torch.float32)
        if args.precision == "bf16"
        else None
    )
    program = _capture(args, target, policy)
    captured = time.perf_counter() - start
    passes = _pipeline(args.solver, args.time_limit, PlanOptions(remat=args.recompute))
    plan: Plan | None = None
    try:
        plan = plan_program(program, cluster, passes=passes)
    except InfeasiblePlanError as error:
        if not counts:
            raise
        # A pipeline exists for what one plan of the whole batch cannot hold: look for one.
        print(f"no intra-op plan of the whole batch fits: {error}\n")
    else:
        print(
            f"captured in {captured:.1f} s, planned in "
            f"{time.perf_counter() - start - captured:.1f} s\n"
        )
        print(plan.report())
    best: StageChoice | None = None
    # Stages of data-parallel replicas are priced on the whole batch's step: the one captured
    # above, which planning left as it was.
    whole = program if counts else None
    for count in counts:
        choice = _joint_plan(args, target, cluster, policy, passes, count, whole)
        if choice is not None and (best is None or choice.step_time < best.step_time):
            best = choice
    if counts:
        print(_verdict(plan, best))
        if plan is None and best is None:
            return 2
    if args.save_pipeline:
        if not counts:
            raise FxparError("--save-pipeline writes the best pipeline: give --microbatches M")
        if best is None:
            print("\n--save-pipeline writes the best pipeline: none fits")
        else:
            chosen = PipelinePlan.from_choice(best, cluster)
            print(f"\npipeline plan written to {chosen.save(args.save_pipeline)}")
    if plan is None:
        if args.save or args.plot:
            print("\n--save and --plot write the intra-op plan of the whole batch: none fits")
    else:
        if args.save:
            print(f"\nplan written to {plan.save(args.save)}")
        if args.plot:
            print(f"picture written to {plan.plot(args.plot)}")
    return 0


def _capture(
    args: argparse.Namespace,
    target: Target,
    policy: fxpar.MixedPrecision | None,
) -> fxpar.Program:
    """The whole batch's step, its repeated layers stamped unless ``--no-stamp-layers``."""
    capture = capture_repeated if args.stamp_layers else fxpar.capture
    program = capture(
        target.model, target.example_inputs, target.loss_fn,
        example_targets=target.example_targets, mixed_precision=policy,
    )  # fmt: skip
    _say_stamped(program)
    return program


def _say_stamped(program: fxpar.Program) -> None:
    stamped = program.get(StampedLayers)
    if stamped is not None:
        print(f"captured {stamped.describe()}")


def _microbatch_counts(spec: str) -> tuple[int, ...]:
    """``--microbatches``: a count or counts separated by commas; ``0`` (the default) none."""
    try:
        counts = tuple(int(part) for part in spec.split(",") if part.strip())
    except ValueError:
        raise FxparError(f"--microbatches takes counts like 8 or 4,8,16, got {spec!r}") from None
    if any(count < 0 for count in counts):
        raise FxparError(f"--microbatches takes positive counts, got {spec!r}")
    return tuple(count for count in counts if count)


def _joint_plan(
    args: argparse.Namespace,
    target: Target,
    cluster: fxpar.Cluster,
    policy: fxpar.MixedPrecision | None,
    passes: PassManager,
    count: int,
    whole: fxpar.Program | None,
) -> StageChoice | None:
    """Alpa's joint plan for ``count`` micro-batches: the step captured at one micro-batch's
    shapes, every stage mesh planned by ``passes``, and the stage DP choosing the stages,
    their meshes, and (``auto``) the schedule and remat; and stages of data-parallel replicas
    priced on ``whole``: ``pipeline="auto"``'s candidate of the count
    (:func:`fxpar.joint.count_candidate`, which refuses a pipeline that would train another
    step). Prints both; returns the cheaper (the meshes' on a tie), None when neither runs."""
    # On a tie the first wins: 1F1B keeps fewer micro-batches in flight, remat off computes less.
    schedules: tuple[str, ...] = SEARCHED_SCHEDULES if args.schedule == "auto" else (args.schedule,)
    remats = (False, True) if args.remat == "auto" else (args.remat == "on",)
    pipelines = [
        Pipeline(stages="auto", microbatches=count, schedule=schedule, remat=remat)
        for schedule in schedules
        for remat in remats
    ]
    start = time.perf_counter()
    program = capture_microbatch(
        target.model, pipelines[0], target.example_inputs, target.loss_fn,
        example_targets=target.example_targets, mixed_precision=policy,
        stamp_layers=args.stamp_layers,
    )  # fmt: skip
    captured = time.perf_counter() - start
    _say_stamped(program)
    candidate = count_candidate(  # pipeline="auto"'s candidate of this count
        program, cluster, pipelines, stage_planner=PassPlanner(passes),
        optimizer_states=PlanOptions().optimizer_states,  # as the stage meshes' plans count
        whole=whole,
    )  # fmt: skip
    search = candidate.search
    found = search.report() if search is not None else f"no pipeline: {candidate.reason}"
    print(
        f"\nas a pipeline of {count} micro-batches on {cluster} (stage DP over stage meshes, "
        f"each planned by {args.solver}; captured in {captured:.1f} s, chosen in "
        f"{time.perf_counter() - start - captured:.1f} s):\n{found}"
    )
    if search is not None and search.choice is not None:
        print(_stage_plans(search.choice))
    if candidate.replicas is not None:
        print(
            "\nas stages of data-parallel replicas (no plan inside a stage):\n"
            f"{candidate.replicas.report()}"
        )
    return candidate.choice


def _stage_plans(choice: StageChoice) -> str:
    """What each stage mesh's intra-op plan does, one line per mesh."""
    return "\n".join(
        f"plan on stage mesh {shape}: {plan.layout_summary()}"
        for shape, plan in sorted(choice.plans.items())
    )


def _verdict(plan: Plan | None, best: StageChoice | None) -> str:
    """Which is faster: the whole batch on one intra-op plan, or the best pipeline."""
    # Both as their schedules run: the plan's estimate, the stages' costs from their plans'
    # schedules (fxpar.pipeline.stage_costs).
    alone = format_seconds(plan.estimate) if plan is not None else "no plan fits"
    piped = format_seconds(best.step_time) if best is not None else "no pipeline fits"
    if plan is None and best is None:
        winner = "neither fits: use more devices, bf16, remat or a smaller batch"
    elif pipeline_wins(plan.estimate if plan else None, best.step_time if best else None):
        winner = "the pipeline"
    else:
        winner = "the intra-op plan alone"
    return f"\nintra-op plan alone: {alone} per step; best pipeline: {piped}; chosen: {winner}"


# -- fxpar calibrate -------------------------------------------------------------------------


def calibrate_command(args: argparse.Namespace) -> int:
    mesh = fxpar.Cluster.parse_mesh(args.mesh) if args.mesh else (args.world,)
    if math.prod(mesh) != args.world:
        raise FxparError(
            f"mesh {args.mesh} has {math.prod(mesh)} devices but --world starts {args.world} "
            "processes; choose a mesh whose sizes multiply to the world"
        )
    given = fxpar.Cluster.preset(args.cluster, mesh)
    # The processes share the machine's cores, as `fxpar demo`'s do; each gets its share.
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.world)
    where = " on the GPU" if given.device_type == "cuda" else ""
    print(
        f"calibrating a {given} on {args.world} local gloo processes{where}, {threads} "
        f"torch thread{'s' if threads > 1 else ''} each",
        flush=True,
    )
    start = time.perf_counter()
    target = None
    pieces = 1
    if args.model:
        # Built with real weights, on this machine: its step runs once per timing pass.
        target = build_target(args.model, args.batch, args.length, device="cpu")
        # The step at a quarter (or half) of the batch too: each op's fixed cost a call.
        rows = batch_tensors(target.example_inputs)[0].shape[0]
        pieces = next((n for n in (4, 2) if rows % n == 0), 1)
        smaller = f", and at 1/{pieces} of it" if pieces > 1 else ""
        print(f"timing the ops of {args.model} (batch {rows}, length {args.length}){smaller}")
    calibration = spawn(_calibrate_rank, args.world, given, threads, target, pieces)[0]
    print(f"measured in {time.perf_counter() - start:.1f} s (start-up included)\n")
    print(calibration.table(given=f"{args.cluster} preset"))
    if args.output:
        path = calibration.cluster.save(args.output)
        print(f"\ncluster written to {path}; plan with it: fxpar plan --cluster-file {path} ...")
    return 0


def _calibrate_rank(
    rank: int,
    world_size: int,
    given: fxpar.Cluster,
    threads: int,
    target: Target | None,
    pieces: int,
) -> Calibration:
    torch.set_num_threads(threads)
    if target is None:
        return measure(given)
    program = fxpar.capture(target.model, target.example_inputs, target.loss_fn,
                            example_targets=target.example_targets)  # fmt: skip
    inputs = target.example_inputs
    batch = [*(inputs.values() if isinstance(inputs, dict) else inputs), *target.example_targets]
    smaller = None
    if pieces > 1:
        smaller = microbatch_step(
            target.model, Pipeline(microbatches=pieces), inputs, target.loss_fn,
            example_targets=target.example_targets,
        )  # fmt: skip
    return measure(given, program=program, inputs=program.flat_inputs(target.model, *batch),
                   microbatch=smaller)  # fmt: skip


# -- entry point -----------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fxpar", description="fxpar command line")
    commands = parser.add_subparsers(dest="command", required=True)

    demo_parser = commands.add_parser(
        "demo", help="plan a small GPT, train it on local gloo processes and on one device"
    )
    defaults = DemoSettings()
    demo_parser.add_argument("--layers", type=int, default=defaults.layers)
    demo_parser.add_argument("--width", type=int, default=defaults.width)
    demo_parser.add_argument("--batch", type=int, default=defaults.batch)
    demo_parser.add_argument("--length", type=int, default=defaults.length)
    demo_parser.add_argument("--steps", type=int, default=defaults.steps)
    demo_parser.add_argument("--lr", type=float, default=defaults.lr)
    demo_parser.add_argument("--seed", type=int, default=defaults.seed)
    demo_parser.add_argument("--devices", type=int, default=defaults.devices,
                             help="gloo processes to start")  # fmt: skip
    solvers = "ilp, greedy, or a manual plan: " + ", ".join(MANUAL_PLANS)
    demo_parser.add_argument("--solver", default=defaults.solver, help=solvers)
    demo_parser.set_defaults(run=demo)

    plan_parser = commands.add_parser("plan", help="plan a model for a mesh and print the report")
    plan_parser.add_argument("--model", required=True,
                             help=f"one of {', '.join(MODEL_NAMES)}, or module:attr")  # fmt: skip
    plan_parser.add_argument("--mesh", required=True, help="mesh shape, e.g. 8 or 2x4")
    plan_parser.add_argument("--cluster", default="h100", help="preset: cpu, a100, h100")
    plan_parser.add_argument("--cluster-file", help="fxpar calibrate --output's, not a preset")
    plan_parser.add_argument("--batch", type=int, default=8)
    plan_parser.add_argument("--length", type=int, default=1024)
    plan_parser.add_argument("--memory-gib", type=float, default=None,
                             help="device memory instead of the preset's")  # fmt: skip
    plan_parser.add_argument("--solver", default="ilp")
    plan_parser.add_argument("--time-limit", type=float, default=60.0)
    plan_parser.add_argument("--microbatches", default="0",
                             help="also plan a pipeline (stages, their meshes and plans) for M "
                                  "micro-batches; counts separated by commas try each")  # fmt: skip
    plan_parser.add_argument("--schedule", default="auto",
                             choices=("auto", *SEARCHED_SCHEDULES),
                             help="pipeline schedule; auto: the faster that fits")  # fmt: skip
    plan_parser.add_argument("--remat", default="auto", choices=("auto", "off", "on"),
                             help="pipeline remat; auto: whichever is faster and fits")  # fmt: skip
    plan_parser.add_argument("--stamp-layers", action=argparse.BooleanOptionalAction,
                             default=True,
                             help="trace 6 of the model's repeated layers and stamp the "
                                  "others (the same step, in a fraction of the time)")  # fmt: skip
    plan_parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16"),
                             help="bf16: MixedPrecision(bf16, reduce_dtype=fp32)")  # fmt: skip
    plan_parser.add_argument("--recompute", default="none", choices=("none", "all", "auto"),
                             help="activation checkpointing: PlanOptions(remat=...)")  # fmt: skip
    plan_parser.add_argument("--save", help="write the plan as JSON here")
    plan_parser.add_argument("--save-pipeline",
                             help="with --microbatches: write the best pipeline as JSON "
                                  "here (fxpar.compile(..., plan=path) runs it)")  # fmt: skip
    plan_parser.add_argument("--plot", help="write a PNG of memory and communication here")
    plan_parser.set_defaults(run=plan_command)

    calibrate_parser = commands.add_parser(
        "calibrate", help="fit a cluster's links and devices to local gloo processes"
    )
    calibrate_parser.add_argument("--world", type=int, required=True, help="processes to start")
    calibrate_parser.add_argument("--mesh", help="mesh shape of the world, e.g. 2x2 (default: N)")
    calibrate_parser.add_argument("--cluster", default="cpu", help="preset whose memory it keeps")
    calibrate_parser.add_argument("--threads", type=int, default=0,
                                  help="torch threads a process (default: cores/N)")  # fmt: skip
    calibrate_parser.add_argument("--output", help="write the fitted cluster here (JSON)")
    calibrate_parser.add_argument(
        "--model",
        help="also fit per-op speeds to this model's step "
        "(as fxpar plan --model; built with real weights)",
    )
    calibrate_parser.add_argument("--batch", type=int, default=2)
    calibrate_parser.add_argument("--length", type=int, default=64)
    calibrate_parser.set_defaults(run=calibrate_command)

    args = parser.parse_args(argv)
    try:
        return int(args.run(args))
    except FxparError as error:
        print(f"fxpar {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
