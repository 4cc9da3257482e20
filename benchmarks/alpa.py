"""Alpa at scale: joint pipeline stages, stage meshes and intra-op plans of large LLMs, on meta.

    python benchmarks/alpa.py                  # every case (about 15 minutes on 2 cores)
    python benchmarks/alpa.py 8b 70b-32        # some cases, by name
    python benchmarks/alpa.py --list           # the cases and their targets

Each *joint* case builds a model on the meta device (no weights), captures its training step at
one micro-batch's shapes (bf16 MixedPrecision, AdamW) and runs what ``fxpar plan --microbatches
M`` runs: :func:`fxpar.pipeline.search_pipelines` over the schedules (1F1B, GPipe) and remat
(off, on), where every stage mesh shape Alpa allows on the cluster is planned once by the
default pass pipeline (the ILP) and the stage DP chooses the stages, their meshes and the
setting. The whole batch is also captured and planned as one intra-op plan, the plan without a
pipeline; the joint plan is the faster of the two. Columns:

- ``capture s`` / ``joint s``: seconds to capture the micro-batch step / to choose the pipeline
  (planning every stage mesh included); ``target s``: the issue's bound on their sum;
- ``intra-op``: the estimated step of the whole batch's best intra-op plan (or why none fits);
- ``uniform``: the best pipeline with every stage on the same mesh; ``pipeline``: the best over
  every mix of meshes and settings; ``joint``: the faster of ``intra-op`` and ``pipeline``;
- ``chosen``: stages x stage meshes, schedule, remat; then one line per stage mesh saying what
  its plan does on each axis (:meth:`fxpar.Plan.layout_summary`).

*Depth* cases time the intra-op ILP alone on Llama-3-8B with 32 and 96 layers, memory unbound
and bound (a limit of 1.5x each model's most frugal plan): the solve of 96 layers should take at
most 1.3x that of 32. *3-D* cases time capture and planning of Llama-3-8B on 3-D meshes.

*Known-good* cases score a published configuration with fxpar's own cost model next to fxpar's
joint plan for the same cluster: Megatron-LM's GPT-3 175B on 1536 A100s (Narayanan et al., 2021:
tensor parallel 8 within a node, 16 pipeline stages, data parallel 12, activations recomputed),
as the stage split of 16 even stages each on a (12, 8) mesh planned as Megatron does (data
parallel over rows, tensor parallel 8), 1F1B with remat; and torchtitan's Llama-3-70B recipe
on 64 H100s (fully sharded across nodes, tensor parallel 8 within a node, every layer
recomputed), as the parameters' layouts pinned and the ILP choosing the rest.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.distributed.tensor import Replicate, Shard

import fxpar
from fxpar import plans
from fxpar.ir.repeat import capture_repeated
from fxpar.models.shapes import gpt3, llama_named
from fxpar.passes import default_passes, plan_program, prepare_for_planning
from fxpar.pipeline import PassPlanner, Pipeline, capture_microbatch, search_pipelines
from fxpar.pipeline.auto import evaluate_split
from fxpar.pipeline.stage_choice import StageChoice, format_seconds
from fxpar.planning.problem import PlanOptions, build_problem
from fxpar.sharding import Spec
from fxpar.solvers.errors import InfeasiblePlanError
from fxpar.solvers.ilp import ILPSolver
from fxpar.solvers.stages import StageMemoryError

BF16 = fxpar.MixedPrecision(torch.bfloat16, reduce_dtype=torch.float32)


@dataclass(frozen=True)
class Joint:
    """A joint-plan case: a model on a cluster, a batch and the micro-batch counts tried."""

    name: str
    model: str
    mesh: tuple[int, ...]
    batch: int
    length: int
    microbatches: int
    target: float
    cluster: str = "h100"


JOINT = (
    Joint("8b", "llama-8b", (2, 4), 8, 2048, 8, 30),
    Joint("70b-16", "llama-70b", (8, 8), 32, 4096, 16, 60),
    Joint("70b-32", "llama-70b", (8, 8), 32, 4096, 32, 60),
    Joint("70b-256", "llama-70b", (8, 8), 256, 4096, 32, 60),
    Joint("405b", "llama-405b", (128, 8), 512, 4096, 32, 300),
)

DEPTH = ("depth",)
THREE_D = (("3d-222", (2, 2, 2)), ("3d-248", (2, 4, 8)))
KNOWN = ("megatron-175b", "torchtitan-70b")


def build(name: str) -> torch.nn.Module:
    with torch.device("meta"):
        return gpt3(name) if name.startswith("gpt3") else llama_named(name)


def tokens(batch: int, length: int) -> dict[str, torch.Tensor]:
    ids = torch.zeros(batch, length, dtype=torch.long)
    return {"input_ids": ids, "labels": ids}


def settings(microbatches: int) -> list[Pipeline]:
    return [
        Pipeline(stages="auto", microbatches=microbatches, schedule=schedule, remat=remat)
        for schedule in ("1f1b", "gpipe")
        for remat in (False, True)
    ]


def joint(case: Joint) -> None:
    model = build(case.model)
    cluster = fxpar.Cluster.preset(case.cluster, case.mesh)
    start = time.perf_counter()
    whole = capture_repeated(model, tokens(case.batch, case.length), mixed_precision=BF16)
    try:
        alone: float | None = plan_program(whole, cluster).estimate
        alone_text = format_seconds(alone)
    except InfeasiblePlanError as error:
        alone, alone_text = None, f"needs {error.least_memory / 2**30:.1f} GiB"
    intra_seconds = time.perf_counter() - start
    del whole
    pipelines = settings(case.microbatches)
    start = time.perf_counter()
    program = capture_microbatch(
        model,
        pipelines[0],
        tokens(case.batch, case.length),
        mixed_precision=BF16,
        stamp_layers=True,
    )
    captured = time.perf_counter() - start
    search = search_pipelines(
        program, cluster, pipelines, stage_planner=PassPlanner(default_passes()), microbatch=True
    )
    chose = time.perf_counter() - start - captured
    choice = search.choice
    uniform = _best_uniform(search)
    piped = choice.step_time if choice is not None else None
    best = min((t for t in (alone, piped) if t is not None), default=None)
    row(
        case.name, "x".join(map(str, case.mesh)), f"{case.batch}x{case.length}",
        str(case.microbatches), f"{captured:.1f}", f"{chose:.1f}",
        f"{captured + chose:.1f}", f"{case.target:.0f}", alone_text,
        format_seconds(uniform) if uniform is not None else "-",
        format_seconds(piped) if piped is not None else "none fits",
        format_seconds(best) if best is not None else "none fits",
        _chosen(choice) if choice is not None and best == piped else "intra-op plan alone",
    )  # fmt: skip
    print(f"    (whole batch captured and planned in {intra_seconds:.1f} s)")
    for outcome in search.outcomes:
        print(f"    {outcome.describe()[:160]}")
    if choice is not None:
        for shape, plan in sorted(choice.plans.items()):
            print(f"    stage mesh {shape}: {plan.layout_summary()}")


def _best_uniform(search: fxpar.pipeline.PipelineSearch) -> float | None:
    times = [
        degree.step_time
        for outcome in search.outcomes
        if outcome.choice is not None
        for degree in outcome.choice.degrees
        if degree.step_time is not None
    ]
    return min(times, default=None)


def _chosen(choice: StageChoice) -> str:
    pipeline = choice.pipeline
    meshes = choice.stage_mesh_shapes or ()
    counted: dict[tuple[int, ...], int] = {}
    for mesh in meshes:
        counted[mesh] = counted.get(mesh, 0) + 1
    layout = " + ".join(f"{count}x{mesh}" for mesh, count in counted.items())
    remat = "remat" if pipeline.remat else "no remat"
    return f"{pipeline.num_stages} stages: {layout}, {pipeline.schedule}, {remat}"


def depth() -> None:
    """The ILP's solve time at 32 and 96 layers, memory unbound and bound."""
    for bound in (False, True):
        seconds = {}
        for name in ("llama-8b", "llama-8b-96"):
            program = capture_repeated(build(name), tokens(8, 2048), mixed_precision=BF16)
            cluster = fxpar.Cluster.preset("h100", (2, 4), memory=1e18)
            prepared = prepare_for_planning(program, cluster)
            problem, layout = build_problem(prepared, cluster)
            if bound:
                problem = dataclasses.replace(problem, memory_limit=1.5 * problem.least_memory())
            solution = ILPSolver(time_limit=120).solve(problem)
            seconds[name] = solution.seconds
            row(
                f"depth-{'bound' if bound else 'unbound'}", "2x4", "8x2048", "-", "-",
                f"{solution.seconds:.2f}", "-", "-", format_seconds(solution.objective), "-",
                "-", "-", f"{name}: {layout.stats['decision_nodes']} decisions, {solution.status}",
            )  # fmt: skip
        ratio = seconds["llama-8b-96"] / seconds["llama-8b"]
        print(f"    96 / 32 layers, memory {'bound' if bound else 'unbound'}: {ratio:.2f}x "
              "(target <= 1.3x)")  # fmt: skip


def three_d(name: str, mesh: tuple[int, ...]) -> None:
    start = time.perf_counter()
    program = capture_repeated(build("llama-8b"), tokens(8, 2048), mixed_precision=BF16)
    captured = time.perf_counter() - start
    plan = plan_program(program, fxpar.Cluster.preset("h100", mesh))
    planned = time.perf_counter() - start - captured
    row(
        name, "x".join(map(str, mesh)), "8x2048", "-", f"{captured:.1f}", f"{planned:.1f}",
        f"{captured + planned:.1f}", "20", format_seconds(plan.estimate), "-",
        "-", "-", plan.layout_summary(),
    )  # fmt: skip


def megatron() -> None:
    """GPT-3 175B on (192, 8) A100s: Megatron-LM's configuration against fxpar's joint plan."""
    mesh, batch, length, microbatches = (192, 8), 1536, 2048, 128
    cluster = fxpar.Cluster.preset("a100", mesh)
    model = build("gpt3-175b")
    pipeline = Pipeline(stages="auto", microbatches=microbatches, schedule="1f1b")
    start = time.perf_counter()
    program = capture_microbatch(
        model, pipeline, tokens(batch, length), mixed_precision=BF16, stamp_layers=True
    )
    captured = time.perf_counter() - start
    layers = 96
    split = tuple(f"transformer.h.{i}" for i in range(layers // 16, layers, layers // 16))
    megatron_plan: Callable[[fxpar.Program, fxpar.Cluster], fxpar.Plan] = PassPlanner(
        default_passes(manual=plans.tensor_parallel)
    )
    try:
        given = evaluate_split(
            program, cluster,
            dataclasses.replace(
                pipeline, stages=split, stage_meshes=((12, 8),) * 16, remat=True
            ),
            stage_planner=megatron_plan, microbatch=True,
        )  # fmt: skip
        given_text = format_seconds(given.step_time) + " (Megatron)"
    except StageMemoryError as error:
        # fxpar's memory model disagrees with a configuration that ran: say by how much.
        given_text = f"Megatron's: fxpar's model says {error.least_memory / 2**30:.0f} GiB"
        print(f"    {error}")
    search = search_pipelines(
        program, cluster, settings(microbatches), stage_planner=PassPlanner(default_passes()),
        microbatch=True,
    )  # fmt: skip
    chose = time.perf_counter() - start - captured
    ours = search.choice
    row(
        "megatron-175b", "192x8", f"{batch}x{length}", str(microbatches), f"{captured:.1f}",
        f"{chose:.1f}", f"{captured + chose:.1f}", "-", "-", "-",
        given_text,
        format_seconds(ours.step_time) if ours is not None else "none fits",
        _chosen(ours) if ours is not None else "-",
    )  # fmt: skip
    if ours is not None:
        for shape, plan in sorted(ours.plans.items()):
            print(f"    stage mesh {shape}: {plan.layout_summary()}")


def torchtitan() -> None:
    """Llama-3-70B on (8, 8) H100s, batch 32x4096: torchtitan's recipe (fully sharded across
    nodes, tensor parallel 8 within a node, every layer recomputed) priced by fxpar's model,
    against fxpar's own choice among the intra-op plan (with remat as needed) and pipelines."""
    mesh, batch, length, microbatches = (8, 8), 32, 4096, 16
    cluster = fxpar.Cluster.preset("h100", mesh)
    model = build("llama-70b")
    start = time.perf_counter()
    program = capture_repeated(model, tokens(batch, length), mixed_precision=BF16)
    captured = time.perf_counter() - start
    pins = {name: _fsdp_tp(name) for name in program.signature.parameters}
    pins.update({name: (Shard(0), Replicate()) for name in program.signature.inputs})
    recipe = plan_program(program, cluster, pins=pins, options=PlanOptions(remat="all"))
    ours = plan_program(program, cluster, options=PlanOptions(remat="auto"))
    pipelines = settings(microbatches)
    micro = capture_microbatch(
        model, pipelines[0], tokens(batch, length), mixed_precision=BF16, stamp_layers=True
    )
    search = search_pipelines(
        micro, cluster, pipelines, stage_planner=PassPlanner(default_passes()), microbatch=True
    )
    chose = time.perf_counter() - start - captured
    best = min([ours.estimate] + ([search.choice.step_time] if search.choice is not None else []))
    chosen = (
        f"intra-op, remat auto: {ours.layout_summary()}"
        if best == ours.estimate or search.choice is None
        else _chosen(search.choice)
    )
    row(
        "torchtitan-70b", "8x8", f"{batch}x{length}", str(microbatches), f"{captured:.1f}",
        f"{chose:.1f}", f"{captured + chose:.1f}", "-",
        format_seconds(ours.estimate) + " (remat auto)", "-",
        format_seconds(search.choice.step_time) if search.choice is not None else "none fits",
        format_seconds(best), chosen,
    )  # fmt: skip
    print(f"    torchtitan's recipe: {format_seconds(recipe.estimate)} (solver's price "
          f"{format_seconds(recipe.solution.objective)}); "
          f"{recipe.layout_summary()}")  # fmt: skip


def _fsdp_tp(name: str) -> Spec:
    """torchtitan's layout of a Llama parameter on (nodes, GPUs): split on dim 0 across nodes
    (fully sharded), and within a node by output features for the column-parallel linears,
    input features for the row-parallel ones, replicated otherwise."""
    if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight",
                      "up_proj.weight")):  # fmt: skip
        return (Shard(0), Shard(0))
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return (Shard(0), Shard(1))
    return (Shard(0), Replicate())


HEADER = ("case", "mesh", "batch", "M", "capture s", "joint s", "total s", "target s",
          "intra-op", "uniform", "pipeline", "joint", "chosen")  # fmt: skip


def row(*cells: str) -> None:
    print(" | ".join(cells), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="*", help="case names (default: all)")
    parser.add_argument("--list", action="store_true")
    args = parser.parse_args()
    names = [case.name for case in JOINT] + list(DEPTH) + [n for n, _ in THREE_D] + list(KNOWN)
    if args.list:
        for case in JOINT:
            print(f"{case.name}: {case.model} on {case.mesh}, batch {case.batch}x{case.length}, "
                  f"M={case.microbatches}, target {case.target:.0f} s")  # fmt: skip
        print(", ".join(names[len(JOINT) :]))
        return
    chosen = args.cases or names
    unknown = sorted(set(chosen) - set(names))
    if unknown:
        parser.error(f"unknown cases {unknown}; choose from {names}")
    print(" | ".join(HEADER))
    print(" | ".join("-" * len(h) for h in HEADER))
    for case in JOINT:
        if case.name in chosen:
            joint(case)
    if "depth" in chosen:
        depth()
    for name, mesh in THREE_D:
        if name in chosen:
            three_d(name, mesh)
    if "torchtitan-70b" in chosen:
        torchtitan()
    if "megatron-175b" in chosen:
        megatron()


if __name__ == "__main__":
    main()
