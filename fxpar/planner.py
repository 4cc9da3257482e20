"""``fxpar.plan``: capture a model and choose how to shard every tensor automatically.

The steps, as in DESIGN.md: capture → canonicalize → annotate cost → annotate strategies →
build the intra-op problem (coarsening, repeated layers) → solve → write the choice back. The
solver is pluggable: anything with ``solve(IntraOpProblem) -> IntraOpSolution`` (the HiGHS ILP
by default, or the exhaustive or greedy solvers), or a manual plan from :mod:`fxpar.plans`, which
is scored by the same cost model so plans can be compared.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from fxpar import ir
from fxpar.capture import LossFn, capture
from fxpar.cluster import Cluster
from fxpar.errors import FxparError
from fxpar.lowering import SPMDProgram, lower
from fxpar.passes.annotate_cost import AnnotateCost
from fxpar.passes.annotate_strategies import AnnotateStrategies
from fxpar.passes.base import PassManager
from fxpar.passes.canonicalize import Canonicalize
from fxpar.planning import (
    Layout,
    PlanOptions,
    apply_solution,
    assignment_of,
    build_problem,
    candidates,
)
from fxpar.program import Program
from fxpar.rules import RuleRegistry, default_rules
from fxpar.sharding import Sharding
from fxpar.solvers.problem import IntraOpProblem, IntraOpSolution, IntraOpSolver

ManualPlan = Callable[[Program, Cluster], Program]


@dataclass(frozen=True)
class Plan:
    """A Program whose every node carries its chosen strategy, with the problem it was chosen
    from and the solver's answer."""

    program: Program
    cluster: Cluster
    problem: IntraOpProblem
    solution: IntraOpSolution
    layout: Layout

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


def prepare_for_planning(
    program: Program, cluster: Cluster, rules: RuleRegistry | None = None
) -> Program:
    """Canonicalize, annotate costs and candidate strategies (idempotent)."""
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
        return _manual(program, cluster, solver, options)
    if solver is None:
        from fxpar.solvers.ilp import ILPSolver

        solver = ILPSolver()
    problem, layout = build_problem(program, cluster, options)
    solution = solver.solve(problem)  # type: ignore[union-attr]
    apply_solution(program, layout, solution.choice)
    return Plan(program, cluster, problem, solution, layout)


def _manual(program: Program, cluster: Cluster, manual: ManualPlan, options: PlanOptions) -> Plan:
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
    return Plan(program, cluster, problem, solution, layout)


def score(plan: Plan) -> float:
    """The estimated step time of ``plan``'s strategies under the exact (uncoarsened) cost
    model, comparable across solvers and manual plans."""
    exact = PlanOptions(coarsen=False, dedup_layers=False)
    problem, layout = build_problem(plan.program, plan.cluster, exact)
    choice = assignment_of(plan.program, layout)
    assert choice is not None
    return problem.objective(choice)


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


__all__ = ["Plan", "PlanOptions", "plan", "plan_program", "prepare_for_planning", "score"]
