"""The Plan: a Program whose every node carries its chosen strategy.

:func:`fxpar.passes.plan_program` makes one from a captured Program by running the pass
pipeline, and :meth:`Plan.of` reads the recorded choice back. A Plan reads itself out
(:meth:`Plan.report`, :meth:`Plan.to_dict`, :meth:`Plan.plot`, see
:mod:`fxpar.planning.report`) and is saved as an editable JSON file (:meth:`Plan.save`, see
:mod:`fxpar.planning.plan_file`) that :func:`fxpar.passes.load_plan` applies without solving.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.fx as fx
from torch.distributed.tensor import Shard

from fxpar import ir
from fxpar.cluster import Cluster
from fxpar.errors import FxparError
from fxpar.ir.program import Program
from fxpar.planning.plan_file import plan_document, save_plan
from fxpar.planning.problem import Layout, PlanOptions, assignment_of, build_problem, candidates
from fxpar.planning.propagate import expert_weights
from fxpar.planning.report import plot as plot_report
from fxpar.planning.report import render_text, report_data
from fxpar.planning.step_time import estimated_step, price_schedule
from fxpar.rules import RuleRegistry
from fxpar.sharding import Sharding
from fxpar.solvers.problem import IntraOpProblem, IntraOpSolution


@dataclass(frozen=True)
class RulesUsed:
    """The rule registry that gave a Program's nodes their candidate strategies."""

    rules: RuleRegistry


@dataclass(frozen=True)
class ChosenStrategies:
    """The choice a ``choose-strategies`` pass made, as plain data: the problem it was chosen
    from, the answer, the map from problem nodes to graph nodes and the options used."""

    problem: IntraOpProblem
    solution: IntraOpSolution
    layout: Layout
    options: PlanOptions


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

    @functools.cached_property
    def estimate(self) -> float:
        """The estimated step in seconds: the plan's collective schedule, the one the lowering
        emits, priced, its ops and collectives added up, less the cluster's
        :attr:`~fxpar.Cluster.hidden_share` of the communication that runs beside compute
        (:func:`~fxpar.planning.step_time.estimated_step`). The solver chose the plan by
        ``solution.objective``, which prices the same ops but each edge's conversion on its
        own (a parameter's all-gather with a latency of its own, where the lowering gathers a
        layer's parameters in one; docs/planning.md, "The solver's price and the estimate").
        The optimizer's update of the plan's ``options.optimizer_states`` is in it."""
        states = self.options.optimizer_states
        priced = price_schedule(self.program, self.cluster, optimizer_states=states)
        nodes = list(self.program.graph.nodes)
        return estimated_step(priced, nodes, self.cluster.hidden_share)

    @property
    def stats(self) -> dict[str, int]:
        """Graph nodes, decision nodes after coarsening, repeated-layer units merged, edges."""
        return dict(self.layout.stats)

    def summary(self) -> str:
        s = self.solution
        gap = "" if math.isnan(s.gap) else f", gap {s.gap:.2g}"
        return (
            f"{s.solver} plan on {self.cluster}: {s.status}{gap}, estimated step "
            f"{self.estimate * 1e3:.3f} ms, {self.problem.memory(s.choice) / 2**20:.1f} MiB per "
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

    def layout_summary(self) -> str:
        """One line saying what each mesh axis does: splits the batch, the weights, both
        (fully sharded) or neither, with the share of trainable weight bytes split over it,
        e.g. ``axis0 (2): data parallel; axis1 (4): tensor parallel (weights 97% split)``, each
        axis by its cluster's name for it. An axis whose split weights are all stacked expert
        weights split by expert (dim 0) is ``expert parallel``, whether the batch is split on it
        too (tokens dispatched by all-to-all) or not."""
        program, mesh = self.program, self.cluster.mesh_shape
        placeholders = program.placeholders()
        experts = {placeholders[name] for name in expert_weights(program)}
        weights = [placeholders[name] for name in program.signature.gradients]
        batch = [placeholders[name] for name in program.signature.inputs]
        total = sum(_nbytes(node) for node in weights)
        parts = []
        for axis, size in enumerate(mesh):
            if size == 1:
                continue
            split_batch = any(_batch_split_on(node, axis) for node in batch)
            split_bytes = sum(_nbytes(node) for node in weights if _split_on(node, axis))
            share = split_bytes / total if total else 0.0
            if share and all(
                node in experts and _split_on(node, axis, dim=0)
                for node in weights
                if _split_on(node, axis)
            ):
                kind = "expert parallel"
            elif split_batch:
                kind = "fully sharded" if share >= 0.5 else "data parallel"
            else:
                kind = "tensor parallel" if share > 0 else "replicated"
            detail = f" (weights {share:.0%} split)" if share and share < 0.995 else ""
            parts.append(f"{self.cluster.axis_names[axis]} ({size}): {kind}{detail}")
        return "; ".join(parts) or "one device"

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


def _split_on(node: fx.Node, axis: int, dim: int | None = None) -> bool:
    """Whether the value of placeholder ``node`` is split over mesh axis ``axis`` (on ``dim``,
    when given)."""
    spec = ir.require(node, Sharding).strategy.outputs[0]
    if spec is None or not isinstance(spec[axis], Shard):
        return False
    return dim is None or spec[axis] == Shard(dim)


def _batch_split_on(node: fx.Node, axis: int) -> bool:
    """Whether batch input ``node`` is split over ``axis``, or read whole by every device of
    it and split by rows where it is first used (token ids read whole by an embedding whose
    output is split by rows: each device still computes only its rows)."""
    if _split_on(node, axis):
        return True
    for user in node.users:
        sharding = ir.get(user, Sharding)
        value = ir.get(user, ir.ValueMeta)
        if sharding is None or value is None or value.multiple or len(value.outputs) != 1:
            continue  # a user with several outputs (a convolution backward) tells nothing here
        spec = sharding.strategy.outputs[0]
        if spec is not None and spec[axis] == Shard(0):
            return True
    return False


def _nbytes(node: fx.Node) -> int:
    return ir.evaluate(ir.require(node, ir.ValueMeta).tensor.nbytes)


def _strategy_of(unit: Any, option: int) -> str:
    return str(candidates(unit.root)[unit.allowed[option]])


def score(plan: Plan) -> float:
    """The estimated step time of ``plan``'s strategies under the exact (uncoarsened) cost
    model, comparable across solvers and manual plans."""
    exact = PlanOptions(coarsen=False, dedup_layers=False)
    problem, layout = build_problem(plan.program, plan.cluster, exact)
    choice = assignment_of(plan.program, layout)
    assert choice is not None
    return problem.objective(choice)


__all__ = ["ChosenStrategies", "Plan", "PlanOptions", "RulesUsed", "score"]
