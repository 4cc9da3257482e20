"""``fxpar.plan``: capture a model and choose how to shard every tensor automatically.

The steps, as in DESIGN.md: capture → canonicalize → annotate cost → annotate strategies →
build the intra-op problem (coarsening, repeated layers) → solve → write the choice back. The
solver is pluggable: anything with ``solve(IntraOpProblem) -> IntraOpSolution`` (the HiGHS ILP
by default, or the exhaustive or greedy solvers), or a manual plan from :mod:`fxpar.plans`, which
is scored by the same cost model so plans can be compared.

A Plan reads itself out (:meth:`Plan.report`, :meth:`Plan.to_dict`, :meth:`Plan.plot`, see
:mod:`fxpar.plan_report`) and is saved as an editable JSON file and loaded back without solving
(:meth:`Plan.save`, :func:`load_plan`, see :mod:`fxpar.plan_io`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fxpar import ir
from fxpar.cluster import Cluster
from fxpar.errors import DistributedError, FxparError
from fxpar.ir.capture import LossFn, capture
from fxpar.ir.program import Program
from fxpar.lowering import SPMDProgram, lower
from fxpar.passes.annotate_cost import AnnotateCost
from fxpar.passes.annotate_strategies import AnnotateStrategies
from fxpar.passes.base import PassManager
from fxpar.passes.canonicalize import Canonicalize
from fxpar.planning.manual import require_concrete_shapes
from fxpar.planning.problem import (
    Layout,
    PlanOptions,
    apply_solution,
    assignment_of,
    build_problem,
    candidates,
)
from fxpar.planning.report import plot as plot_report
from fxpar.planning.report import render_text, report_data
from fxpar.rules import RuleRegistry, default_rules
from fxpar.sharding import Sharding
from fxpar.solvers.problem import IntraOpProblem, IntraOpSolution, IntraOpSolver

ManualPlan = Callable[[Program, Cluster], Program]


@dataclass(frozen=True)
class Plan:
    """A Program whose every node carries its chosen strategy, with the problem it was chosen
    from and the solver's answer (and the options and rules that made the problem)."""

    program: Program
    cluster: Cluster
    problem: IntraOpProblem
    solution: IntraOpSolution
    layout: Layout
    options: PlanOptions = field(default_factory=PlanOptions)
    rules: RuleRegistry | None = field(default=None, compare=False)

    def lower(self) -> SPMDProgram:
        """The per-rank programs of this plan."""
        return lower(self.program, self.cluster)

    @property
    def stats(self) -> dict[str, int]:
        """Graph nodes, decision nodes after coarsening, repeated-layer units merged, edges."""
        return dict(self.layout.stats)

    def summary(self) -> str:
        s = self.solution
        gap = "" if math.isnan(s.gap) else f", gap {s.gap:.2g}"
        return (
            f"{s.solver} plan on {self.cluster}: {s.status}{gap}, estimated step "
            f"{s.objective * 1e3:.3f} ms, {self.problem.memory(s.choice) / 2**20:.1f} MiB per "
            f"device; {self.stats['graph_nodes']} graph nodes, "
            f"{self.stats['decision_nodes']} decisions ({self.stats['layers_merged']} merged "
            f"with repeated layers), solved in {s.seconds:.2f} s"
        )

    def to_dict(self) -> dict[str, Any]:
        """The plan as plain data: what :meth:`save` writes, with the plan report under
        ``"report"`` (the data :meth:`report` and :meth:`plot` draw)."""
        from fxpar.planning.plan_file import plan_document

        return plan_document(self)

    def report(self) -> str:
        """The plan report: step time, memory and collectives, layer by layer
        (docs/plan_report.md explains the columns)."""
        return render_text(report_data(self))

    def plot(self, path: str | Path) -> Path:
        """Draw memory per device and communication per layer as a PNG at ``path``; needs
        matplotlib (``pip install "fxpar[plot]"``)."""
        return plot_report(report_data(self), path)

    def save(self, path: str | Path) -> Path:
        """Write the plan as editable JSON (see :mod:`fxpar.plan_io`); :func:`load_plan` reads
        it back onto a captured Program without solving."""
        from fxpar.planning.plan_file import save_plan

        return save_plan(self, path)

    def explain(self, node_name: str) -> str:
        """Which strategy ``node_name`` got, what it costs, and what the next-best choice for
        its decision would have cost (every other decision held fixed)."""
        node = next((n for n in self.program.graph.nodes if n.name == node_name), None)
        if node is None:
            raise FxparError(f"no node named {node_name!r} in the planned Program")
        if node not in self.layout.unit_of:
            raise FxparError(f"node {node_name!r} takes no decision (it follows its producer)")
        chosen = ir.require(node, Sharding).strategy
        index = self.layout.problem_node(node)
        unit = self.layout.units[self.layout.unit_of[node]]
        base = self.problem.objective(self.solution.choice)
        alternatives = []
        for option in range(len(self.problem.node_costs[index])):
            if option == self.solution.choice[index]:
                continue
            choice = list(self.solution.choice)
            choice[index] = option
            alternatives.append((self.problem.objective(choice) - base, option))
        lines = [
            f"{node_name} ({node.target}): {chosen}",
            f"  decided with {unit.root.name!r} as problem node {index}; its cost "
            f"{self.problem.node_costs[index][self.solution.choice[index]] * 1e6:.2f} us",
        ]
        if alternatives:
            delta, option = min(alternatives)
            strategy = _strategy_of(unit, option)
            lines.append(f"  next best: {strategy} costs {delta * 1e6:+.2f} us more in total")
        else:
            lines.append("  no alternative: the only valid strategy (or pinned)")
        return "\n".join(lines)


def _strategy_of(unit: Any, option: int) -> str:
    return str(candidates(unit.root)[unit.allowed[option]])


@dataclass(frozen=True)
class SolvedOnRankZero:
    """Solve on rank 0 and broadcast the answer. Solvers with time limits (or floating-point
    ties) could answer differently on different ranks, and ranks lowering different plans
    would exchange mismatched pieces or wait forever; one answer for all rules that out."""

    solver: IntraOpSolver | None

    @property
    def name(self) -> str:
        return getattr(self.solver, "name", "ilp")

    def solve(self, problem: IntraOpProblem) -> IntraOpSolution:
        solver = self.solver
        if solver is None:
            from fxpar.solvers.ilp import ILPSolver

            solver = ILPSolver()
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return solver.solve(problem)
        answer: list[object] = [None]
        if dist.get_rank() == 0:
            try:
                answer[0] = (len(problem.node_costs), solver.solve(problem))
            except Exception as error:  # re-raised on every rank below, rank 0 included
                answer[0] = error
        dist.broadcast_object_list(answer, src=0)
        if isinstance(answer[0], Exception):
            raise answer[0]
        size: int
        solution: IntraOpSolution
        size, solution = answer[0]  # type: ignore[misc]
        if size != len(problem.node_costs):
            raise DistributedError(
                f"rank 0 planned a problem of {size} decisions, this rank "
                f"({dist.get_rank()}) one of {len(problem.node_costs)}: the ranks captured "
                "different models or example inputs; call fxpar.compile with the same arguments "
                "on every rank"
            )
        return solution


def prepare_for_planning(
    program: Program, cluster: Cluster, rules: RuleRegistry | None = None
) -> Program:
    """Canonicalize, annotate costs and candidate strategies (idempotent)."""
    require_concrete_shapes(program, "planning")
    passes = (Canonicalize(), AnnotateCost(), AnnotateStrategies(cluster, rules or default_rules()))
    return PassManager(passes).run(program)


def plan_program(
    program: Program,
    cluster: Cluster,
    solver: IntraOpSolver | ManualPlan | None = None,
    *,
    options: PlanOptions | None = None,
    rules: RuleRegistry | None = None,
) -> Plan:
    """Choose a strategy for every node of a captured Program."""
    options = options or PlanOptions()
    program = prepare_for_planning(program, cluster, rules)
    if solver is not None and not hasattr(solver, "solve"):
        return _manual(program, cluster, solver, options, rules)
    if solver is None:
        from fxpar.solvers.ilp import ILPSolver

        solver = ILPSolver()
    problem, layout = build_problem(program, cluster, options)
    solution = solver.solve(problem)  # type: ignore[union-attr]
    apply_solution(program, layout, solution.choice)
    return Plan(program, cluster, problem, solution, layout, options=options, rules=rules)


def _manual(
    program: Program,
    cluster: Cluster,
    manual: ManualPlan,
    options: PlanOptions,
    rules: RuleRegistry | None,
) -> Plan:
    start = time.perf_counter()
    program = manual(program, cluster)
    # Scored without coarsening or merged layers, so that any assignment is representable.
    exact = replace(options, coarsen=False, dedup_layers=False, pins={})
    problem, layout = build_problem(program, cluster, exact)
    choice = assignment_of(program, layout)
    if choice is None:
        raise FxparError(
            f"the manual plan {getattr(manual, '__name__', manual)!r} left nodes without a strategy"
        )
    name = getattr(manual, "__name__", "manual")
    solution = IntraOpSolution(
        choice, problem.objective(choice), "feasible", math.nan, name, time.perf_counter() - start
    )
    return Plan(program, cluster, problem, solution, layout, options=exact, rules=rules)


def score(plan: Plan) -> float:
    """The estimated step time of ``plan``'s strategies under the exact (uncoarsened) cost
    model, comparable across solvers and manual plans."""
    exact = PlanOptions(coarsen=False, dedup_layers=False)
    problem, layout = build_problem(plan.program, plan.cluster, exact)
    choice = assignment_of(plan.program, layout)
    assert choice is not None
    return problem.objective(choice)


def load_plan(
    path: str | Path,
    program: Program,
    cluster: Cluster | None = None,
    rules: RuleRegistry | None = None,
) -> Plan:
    """The plan saved by :meth:`Plan.save` at ``path``, applied to ``program`` (a capture of the
    same model) and scored by the cost model, without solving. ``cluster`` defaults to the saved
    one; see :func:`fxpar.planning.plan_file.load_plan` for what is checked."""
    from fxpar.planning.plan_file import load_plan as load

    return load(path, program, cluster, rules)


def plan(
    model: nn.Module,
    cluster: Cluster,
    example_inputs: Sequence[Any] | Mapping[str, Any],
    loss_fn: LossFn | None = None,
    *,
    example_targets: Sequence[torch.Tensor] = (),
    solver: IntraOpSolver | ManualPlan | None = None,
    pins: Mapping[str, Any] | None = None,
    options: PlanOptions | None = None,
    rules: RuleRegistry | None = None,
) -> Plan:
    """Capture ``model``'s training step and shard it over ``cluster``.

    ``solver`` is the HiGHS ILP by default; pass ``ExhaustiveSolver()``, ``GreedySolver()`` or a
    manual plan such as ``fxpar.plans.data_parallel`` instead. ``pins`` maps name patterns of
    parameters, buffers, inputs or graph nodes to the spec they must have, e.g.
    ``{"*.mlp.fc.weight": (Shard(0),)}``.
    """
    options = options or PlanOptions()
    if pins:
        options = replace(options, pins=dict(pins))
    program = capture(model, example_inputs, loss_fn, example_targets=example_targets)
    return plan_program(program, cluster, solver, options=options, rules=rules)


__all__ = [
    "Plan",
    "PlanOptions",
    "load_plan",
    "plan",
    "plan_program",
    "prepare_for_planning",
    "score",
]
