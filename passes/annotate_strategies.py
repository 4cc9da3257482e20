"""Annotate every placeholder and compute node with its candidate strategies on a mesh."""

from __future__ import annotations

import operator
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import Partial

from fxpar import ir
from fxpar.ir.program import Program, require_concrete_shapes
from fxpar.passes.base import Pass
from fxpar.planning.plan import RulesUsed
from fxpar.rules import OpCall, RuleRegistry, default_rules, op_call
from fxpar.sharding import Strategies, Strategy, all_specs


@dataclass(frozen=True)
class AnnotateStrategies(Pass):
    """Attach :class:`~fxpar.sharding.Strategies` to every node that needs a decision:
    placeholders (any even Shard or Replicate per mesh axis) and ops with tensor outputs (from
    ``rules``; ops without a rule get the replicated strategy only). A mixed-precision cast out
    of the reduction dtype keeps only the candidates that read no partial sum.

    A rule sees only an :class:`~fxpar.rules.OpCall` (the op, shapes and plain values), so
    calls that are equal get the same strategies: each distinct call is asked once per run, and
    the nodes of every repeated layer share the answer (Llama-8B on (2, 4): 6589 op nodes, 118
    distinct calls).

    The mesh is ``program.cluster``'s; ``rules`` defaults to :func:`fxpar.rules.default_rules`.
    The registry used is recorded on the Program (:class:`RulesUsed`) for the plan report."""

    name = "annotate-strategies"
    rules: RuleRegistry | None = None

    def run(self, program: Program) -> Program:
        require_concrete_shapes(program, "planning")
        mesh = program.require_cluster(f"the {self.name!r} pass").mesh_shape
        rules = self.rules if self.rules is not None else default_rules()
        known: dict[Hashable, tuple[Strategy, ...]] = {}
        for node in program.graph.nodes:
            if node.op == "placeholder":
                shape = ir.require(node, ir.ValueMeta).tensor.shape
                candidates = tuple(Strategy((spec,), ()) for spec in all_specs(shape, mesh))
            elif (
                node.op == "call_function"
                and node.target is not operator.getitem
                and ir.require(node, ir.ValueMeta).tensors
            ):
                call = op_call(node, mesh)
                key = _call_key(call)
                if key is None:
                    candidates = tuple(rules.strategies(call))
                elif key in known:
                    candidates = known[key]
                else:
                    candidates = known[key] = tuple(rules.strategies(call))
                cast = ir.get(node, ir.PrecisionCast)
                if cast is not None and not cast.takes_partial:
                    candidates = _without_partial_inputs(candidates)
            else:
                continue
            ir.annotate(node, Strategies(mesh, candidates))
        program.annotate(RulesUsed(rules))
        return program


def _without_partial_inputs(candidates: tuple[Strategy, ...]) -> tuple[Strategy, ...]:
    """The candidates that read no partial sum: a gradient's cast out of the reduction dtype
    (:class:`fxpar.ir.PrecisionCast`) has its input summed before it, in that dtype."""
    return tuple(
        c
        for c in candidates
        if not any(isinstance(p, Partial) for spec in c.inputs if spec is not None for p in spec)
    )


_PLAIN = (bool, int, float, str, type(None), torch.dtype, torch.device, torch.layout,
          torch.memory_format, ir.TensorMeta)  # fmt: skip


def _call_key(call: OpCall) -> Hashable | None:
    """``call`` as a key equal only for calls a rule cannot tell apart; None when an argument
    is not a plain value (a symbolic size, say), and the call is asked on its own."""
    try:
        return (
            call.target,
            _frozen(call.args),
            _frozen(call.kwargs),
            _frozen(call.outputs),
            call.mesh_shape,
        )
    except _NotPlain:
        return None


class _NotPlain(Exception):
    pass


def _frozen(value: Any) -> Hashable:
    # The type is part of the key: 1, 1.0 and True are equal in Python but not to every rule.
    if isinstance(value, _PLAIN):
        return (type(value), value)
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(_frozen(v) for v in value))
    if isinstance(value, dict):
        return (dict, tuple((k, _frozen(v)) for k, v in value.items()))
    raise _NotPlain
