"""Annotate every placeholder and compute node with its candidate strategies on a mesh."""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

from fxpar import ir
from fxpar.cluster import Cluster
from fxpar.passes.base import Pass
from fxpar.program import Program
from fxpar.rules import RuleRegistry, default_rules, op_call
from fxpar.sharding import Strategies, Strategy, all_specs


@dataclass(frozen=True)
class AnnotateStrategies(Pass):
    """Attach :class:`~fxpar.sharding.Strategies` to every node that needs a decision:
    placeholders (any even Shard or Replicate per mesh axis) and ops with tensor outputs (from
    ``rules``; ops without a rule get the replicated strategy only)."""

    name = "annotate-strategies"
    cluster: Cluster = field(default_factory=lambda: Cluster((1,)))
    rules: RuleRegistry = field(default_factory=default_rules, compare=False)

    def run(self, program: Program) -> Program:
        mesh = self.cluster.mesh_shape
        for node in program.graph.nodes:
            if node.op == "placeholder":
                shape = ir.require(node, ir.ValueMeta).tensor.shape
                candidates = tuple(Strategy((spec,), ()) for spec in all_specs(shape, mesh))
            elif (
                node.op == "call_function"
                and node.target is not operator.getitem
                and ir.require(node, ir.ValueMeta).tensors
            ):
                candidates = tuple(self.rules.strategies(op_call(node, mesh)))
            else:
                continue
            ir.annotate(node, Strategies(mesh, candidates))
        return program
