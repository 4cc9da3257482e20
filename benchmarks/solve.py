"""Automatic intra-op planning on large transformer shapes: problem size and solve time.

    python benchmarks/solve.py                 # every model on meshes (8,) and (2, 4)
    python benchmarks/solve.py llama-8b        # one model

Each model is built from a Hugging Face config on the meta device (no weights), captured, and
planned for 8 H100s (``Cluster.preset("h100", mesh)``; on (2, 4) the first axis is taken to
span nodes). Columns: graph nodes; decision nodes after coarsening and merging repeated layers;
variables and constraints of the ILP; seconds to build the problem (cost model, coarsening);
seconds the ILP solver takes; the estimated step time; the proven optimality gap; the memory
limit per device. Targets: the Llama-8B shape on (2, 4) solves in under 5 s, and 96 layers take
at most 1.3x the time of 32.

    python benchmarks/solve.py llama-8b llama-8b-96 --memory-headroom 0.5

sets each model's limit to 1.5x the memory of its own most frugal plan: the fair depth
comparison, since a fixed limit binds for one depth and not the other, or does not fit one.

    python benchmarks/solve.py llama-8b --meshes 2x4 --length 2048 --end-to-end

times what a user waits for instead: ``fxpar.capture`` and ``plan_program`` (building the
problem, the hand-written starting plans and the solve).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

BATCH, LENGTH = 8, 1024


def build(name: str):  # type: ignore[no-untyped-def]
    from fxpar.models.shapes import GPT2_SHAPES, hf_gpt2, llama_named

    return hf_gpt2(name) if name in GPT2_SHAPES else llama_named(name)


MODELS = ("gpt2-small", "gpt2-medium", "gpt2-xl", "llama-8b", "llama-8b-96")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=list(MODELS))
    parser.add_argument("--time-limit", type=float, default=60.0)
    parser.add_argument(
        "--memory-gib",
        type=float,
        default=None,
        help="device memory instead of the preset's 80 GiB",
    )
    parser.add_argument("--memory-headroom", type=float, default=None,
                        help="limit = (1 + this) x the memory of the most frugal plan")  # fmt: skip
    parser.add_argument("--meshes", nargs="*", default=["8", "2x4"])
    parser.add_argument("--length", type=int, default=LENGTH, help="tokens per sequence")
    parser.add_argument("--end-to-end", action="store_true",
                        help="time fxpar.capture and plan_program")  # fmt: skip
    args = parser.parse_args()
    if args.end_to_end:
        end_to_end(args.models, args.meshes, args.length)
        return

    import fxpar
    from fxpar.passes import prepare_for_planning
    from fxpar.planning.problem import build_problem
    from fxpar.solvers.errors import InfeasiblePlanError
    from fxpar.solvers.ilp import ILPSolver, model_size

    header = ("model", "mesh", "graph nodes", "decisions", "ILP vars", "ILP rows", "build s",
              "solve s", "step ms", "gap", "limit GiB")  # fmt: skip
    print(" | ".join(header))
    print(" | ".join("-" * len(h) for h in header))
    for name in args.models:
        with torch.device("meta"):
            model = build(name)
        tokens = torch.zeros(BATCH, args.length, dtype=torch.long)
        program = fxpar.capture(model, {"input_ids": tokens, "labels": tokens})
        for mesh in (tuple(int(n) for n in m.split("x")) for m in args.meshes):
            overrides = {} if args.memory_gib is None else {"memory": args.memory_gib * 2**30}
            cluster = fxpar.Cluster.preset("h100", mesh, **overrides)
            start = time.perf_counter()
            prepared = prepare_for_planning(program, cluster)
            problem, layout = build_problem(prepared, cluster)
            built = time.perf_counter() - start
            if args.memory_headroom is not None:
                limit = (1 + args.memory_headroom) * problem.least_memory()
                problem = dataclasses.replace(problem, memory_limit=limit)
            try:
                solution = ILPSolver(time_limit=args.time_limit).solve(problem)
            except InfeasiblePlanError:
                needed = problem.least_memory() / 2**30
                print(f"{name} | {'x'.join(map(str, mesh))} | infeasible: the most frugal plan "
                      f"needs {needed:.1f} GiB per device", flush=True)  # fmt: skip
                continue
            variables, constraints = model_size(problem)
            print(" | ".join((
                name, "x".join(map(str, mesh)), str(layout.stats["graph_nodes"]),
                str(layout.stats["decision_nodes"]), str(variables), str(constraints),
                f"{built:.1f}", f"{solution.seconds:.2f}", f"{solution.objective * 1e3:.1f}",
                f"{solution.gap:.1e}", f"{(problem.memory_limit or 0) / 2**30:.1f}",
            )), flush=True)  # fmt: skip


def end_to_end(models: list[str], meshes: list[str], length: int) -> None:
    """What a user waits for: capture, then the whole planning pipeline."""
    import fxpar
    from fxpar.passes import plan_program

    print("model | mesh | capture s | plan s | solve s | status | step ms")
    print("----- | ---- | --------- | ------ | ------- | ------ | -------")
    for name in models:
        for mesh in (tuple(int(n) for n in m.split("x")) for m in meshes):
            with torch.device("meta"):
                model = build(name)
            tokens = torch.zeros(BATCH, length, dtype=torch.long)
            start = time.perf_counter()
            program = fxpar.capture(model, {"input_ids": tokens, "labels": tokens})
            captured = time.perf_counter()
            plan = plan_program(program, fxpar.Cluster.preset("h100", mesh))
            planned = time.perf_counter()
            print(" | ".join((
                name, "x".join(map(str, mesh)), f"{captured - start:.1f}",
                f"{planned - captured:.1f}", f"{plan.solution.seconds:.2f}", plan.solution.status,
                f"{plan.solution.objective * 1e3:.1f}",
            )), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
