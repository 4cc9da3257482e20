"""The Plan: a Program whose every node carries its chosen strategy, and the function that
makes one from a captured Program by running the pass pipeline.

:func:`plan_program` sets the Program's target cluster and runs THE pipeline
(:func:`fxpar.passes.default_pipeline`, or the ``passes`` given): canonicalize → annotate cost →
annotate strategies → choose strategies (a solver on the intra-op problem, a manual plan, or a
plan file). :meth:`Plan.of` reads the recorded choice back.

A Plan reads itself out (:meth:`Plan.report`, :meth:`Plan.to_dict`, :meth:`Plan.plot`, see
:mod:`fxpar.planning.report`) and is saved as an editable JSON file and loaded back without
solving (:meth:`Plan.save`, :func:`load_plan`, see :mod:`fxpar.planning.plan_file`).
"""

from __future__ import annotations

import glob
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from fxpar import ir
from fxpar.cluster import Cluster
from fxpar.errors import FxparError
from fxpar.ir.program import Program
from fxpar.lowering import SPMDProgram, lower
from fxpar.passes import (
    ApplyPlanFile,
    ChosenStrategies,
    ManualPlan,
    PassManager,
    RulesUsed,
    SolveStrategies,
    default_pipeline,
)
from fxpar.planning.plan_file import plan_document, save_plan, saved_cluster
from fxpar.planning.problem import Layout, PlanOptions, assignment_of, build_problem, candidates
from fxpar.planning.report import plot as plot_report
from fxpar.planning.report import render_text, report_data
from fxpar.rules import RuleRegistry
from fxpar.sharding import Sharding, Spec
from fxpar.solvers.problem import IntraOpProblem, IntraOpSolution, IntraOpSolver


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

    @classmethod
    def of(cls, program: Program) -> Plan:
        """The plan a pipeline left on ``program``: its cluster, the recorded choice and the
        rules that gave the candidates."""
        chosen = program.require(ChosenStrategies)
        used = program.get(RulesUsed)
        return cls(
            program,
            program.require_cluster("a Plan"),
            chosen.problem,
            chosen.solution,
            chosen.layout,
            options=chosen.options,
            rules=used.rules if used is not None else None,
        )

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


def prepare_for_planning(
    program: Program, cluster: Cluster, rules: RuleRegistry | None = None
) -> Program:
    """The default pipeline's steps before the choice (canonicalize, annotate cost, annotate
    candidate strategies) on ``program`` for ``cluster``."""
    program.cluster = cluster
    return default_pipeline(rules=rules).through("annotate-strategies").run(program)


def pipeline_of(
    passes: PassManager | None,
    *,
    solver: IntraOpSolver | None = None,
    manual: ManualPlan | None = None,
    options: PlanOptions | None = None,
    rules: RuleRegistry | None = None,
    pins: Mapping[str, Spec] | None = None,
) -> PassManager:
    """``passes``, or the default pipeline built from the other arguments (which belong to
    :func:`~fxpar.passes.default_pipeline` when ``passes`` is given); ``pins`` go into the
    options (see :func:`fxpar.plan`)."""
    if pins:
        if passes is not None:
            raise FxparError(
                "passes= is the whole pipeline, so pins= would be ignored: give the pins to its "
                "choose-strategies pass, e.g. default_pipeline(options=PlanOptions(pins=...))"
            )
        options = replace(options or PlanOptions(), pins=dict(pins))
    if passes is None:
        return default_pipeline(solver=solver, manual=manual, options=options, rules=rules)
    given = [
        name
        for name, value in (
            ("solver", solver), ("manual", manual), ("options", options), ("rules", rules),
        )
        if value is not None
    ]  # fmt: skip
    if given:
        raise FxparError(
            f"passes= is the whole pipeline, so {', '.join(given)} would be ignored: build the "
            f"pipeline with them, e.g. default_pipeline({given[0]}=...).insert_before(...)"
        )
    return passes


def keeping_state(
    passes: PassManager, state: Mapping[str, Spec], *, solve: bool = False
) -> PassManager:
    """``passes`` with a solver's choice pinned to keep ``state``'s specs (names escaped, as
    pins are patterns): how a program planned after the training step's keeps every parameter
    and buffer where that plan put it. Other choose-strategies passes are left as they are,
    unless ``solve`` asks for the default solver in their place (a manual plan or a plan file
    is written for the training step, not for a forward or a loss evaluation)."""
    choose = passes.get("choose-strategies")
    if not isinstance(choose, SolveStrategies):
        if not solve:
            return passes
        options = getattr(choose, "options", PlanOptions())
        choose = SolveStrategies(options=options, on_rank_zero=True)
    pins = {**choose.options.pins, **{glob.escape(name): spec for name, spec in state.items()}}
    options = replace(choose.options, pins=pins)
    return passes.replace("choose-strategies", replace(choose, options=options))


def plan_program(
    program: Program,
    cluster: Cluster,
    *,
    passes: PassManager | None = None,
    solver: IntraOpSolver | None = None,
    manual: ManualPlan | None = None,
    options: PlanOptions | None = None,
    rules: RuleRegistry | None = None,
    pins: Mapping[str, Spec] | None = None,
) -> Plan:
    """Run ``passes`` (the default pipeline when None; see :func:`pipeline_of` for the other
    arguments) on a captured ``program`` for ``cluster`` and read the choice as a Plan."""
    passes = pipeline_of(
        passes, solver=solver, manual=manual, options=options, rules=rules, pins=pins
    )
    program.cluster = cluster
    program = passes.run(program)
    return Plan.of(program)


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
    same model with the same example shapes) and scored by the cost model, without solving.

    The default pipeline runs with :class:`~fxpar.passes.ApplyPlanFile` as its choice.
    ``cluster`` defaults to the one saved in the file; another cluster must have the same mesh
    shape (the plan is then priced on it). ``rules`` must give the nodes the candidates they had
    when the plan was made. Raises :class:`~fxpar.planning.plan_file.PlanFileError` naming the
    node or input that does not fit."""
    cluster = saved_cluster(path, cluster)
    passes = default_pipeline(rules=rules).replace("choose-strategies", ApplyPlanFile(path))
    return plan_program(program, cluster, passes=passes)


__all__ = [
    "Plan",
    "PlanOptions",
    "load_plan",
    "pipeline_of",
    "plan_program",
    "prepare_for_planning",
    "score",
]
