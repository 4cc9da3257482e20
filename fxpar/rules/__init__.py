"""Sharding rules: for every ATen op, the strategies it supports on a device mesh.

One module per op family registers its rules on an explicit :class:`RuleRegistry`;
:func:`default_rules` builds a registry with all of them. :func:`coverage` reports the ops of a
Program that have no rule (they run replicated).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from fxpar import ir
from fxpar.ir.program import Program
from fxpar.rules import experts, indexing, matmul, nn, pointwise, reductions, routing, scans, views
from fxpar.rules.registry import AxisOption, OpCall, Rule, RuleRegistry, expand, op_call

__all__ = [
    "AxisOption",
    "Coverage",
    "OpCall",
    "Rule",
    "RuleRegistry",
    "coverage",
    "default_rules",
    "expand",
    "op_call",
]


def default_rules() -> RuleRegistry:
    """A fresh registry holding fxpar's rules for ATen ops, and for Hugging Face transformers'
    grouped products of experts if they are loaded (see :mod:`fxpar.rules.experts`)."""
    rules = RuleRegistry()
    for family in (pointwise, matmul, reductions, views, nn, scans, indexing, experts, routing):
        family.register(rules)
    return rules


@dataclass(frozen=True)
class Coverage:
    """Ops of a Program without a sharding rule: how many nodes, and the largest tensor each
    touches (in elements)."""

    fallback: dict[str, tuple[int, ir.Size]]
    covered_nodes: int

    def __str__(self) -> str:
        if not self.fallback:
            return f"all {self.covered_nodes} compute nodes have sharding rules"
        lines = [f"{len(self.fallback)} ops run replicated (no sharding rule):"]
        for op, (count, largest) in sorted(self.fallback.items()):
            lines.append(f"  {op}: {count} nodes, largest tensor {largest} elements")
        return "\n".join(lines)


def coverage(program: Program, rules: RuleRegistry | None = None) -> Coverage:
    """Which ops of ``program`` fall back to the replicated strategy."""
    rules = rules or default_rules()
    counts: Counter[str] = Counter()
    largest: dict[str, ir.Size] = {}
    covered = 0
    for node in program.graph.nodes:
        if node.op != "call_function" or not hasattr(node.target, "_schema"):
            continue
        value = ir.require(node, ir.ValueMeta)
        if not value.tensors:
            continue
        if rules.has_rule(node.target):
            covered += 1
            continue
        name = str(node.target)
        counts[name] += 1
        sizes = [t.numel for t in value.tensors] + [
            t.numel for arg in node.all_input_nodes for t in ir.require(arg, ir.ValueMeta).tensors
        ]
        largest[name] = max([largest.get(name, 0), *sizes])
    return Coverage({op: (counts[op], largest[op]) for op in counts}, covered)
