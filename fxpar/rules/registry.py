"""The sharding-rule registry: which strategies each ATen op supports.

A rule receives an :class:`OpCall` (the op, its arguments with tensors replaced by
:class:`~fxpar.ir.TensorMeta`, its outputs, and the mesh shape) and returns strategies. Most
rules describe a single mesh axis as :class:`AxisOption` s and let :func:`expand` take their
product over the axes of the mesh; rules whose options do not compose axis by axis (views that
merge dims) build N-D strategies directly. The registry then prunes strategies that would split
a dim unevenly and always offers the all-replicated strategy, which is correct for any op.

An op without a rule gets only the replicated strategy: never an error, and
:func:`fxpar.rules.coverage` reports it.

Most strategies run the node's own op on each device's pieces. A few cannot: a device holding
some of a grouped product's experts computes only the rows routed to them. A rule module that
offers such a strategy also says what a device calls instead, as a :class:`LocalCall`
(:mod:`fxpar.rules.local` finds it for the lowering and for the rule checker).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.distributed.tensor import Placement

from fxpar import ir
from fxpar.cluster import Coordinate
from fxpar.errors import SymbolicShapeError
from fxpar.ir.op_table import OpTable
from fxpar.sharding import Spec, Strategy, has_partial, is_valid, replicated

R_ = torch.distributed.tensor.Replicate()


@dataclass(frozen=True)
class OpCall:
    """What a rule sees of one node: no fx objects, only shapes and plain values."""

    target: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    inputs: tuple[ir.TensorMeta, ...]
    """The tensor arguments, flattened in argument order (lists included, None skipped)."""
    outputs: tuple[ir.TensorMeta | None, ...]
    mesh_shape: tuple[int, ...]

    def arg(self, index: int, name: str, default: Any = None) -> Any:
        """Positional argument ``index`` or keyword ``name``."""
        if index < len(self.args):
            return self.args[index]
        return self.kwargs.get(name, default)


@dataclass(frozen=True)
class AxisOption:
    """A strategy for one mesh axis: a placement per output (None for non-tensor outputs) and
    per tensor input."""

    outputs: tuple[Placement | None, ...]
    inputs: tuple[Placement, ...]


Rule = Callable[[OpCall], Sequence[AxisOption | Strategy]]


@dataclass(frozen=True)
class LocalCall:
    """What one device calls for its piece of a node whose strategy the node's own op, run on
    the local pieces, would not compute: ``function(*static, *args, **kwargs)``, where
    ``args`` and ``kwargs`` are the node's own with local values. ``static`` holds what differs
    from device to device (which experts this one holds), plain values a program can print."""

    function: Callable[..., Any]
    static: tuple[Any, ...]


def shard_index(
    spec: Spec, dim: int, mesh_shape: Sequence[int], coordinate: Coordinate
) -> tuple[int, int]:
    """(which piece, how many pieces) of dim ``dim`` the device at ``coordinate`` holds under
    ``spec``; an earlier mesh axis splits first, as in :func:`fxpar.sharding.shard_tensor`."""
    index, pieces = 0, 1
    for placement, size, position in zip(spec, mesh_shape, coordinate, strict=True):
        if isinstance(placement, torch.distributed.tensor.Shard) and placement.dim == dim:
            index, pieces = index * size + position, pieces * size
    return index, pieces


def expand(options: Sequence[AxisOption], mesh_ndim: int) -> list[Strategy]:
    """N-D strategies from 1-D options: one option per mesh axis, every combination."""
    strategies = []
    for combo in itertools.product(options, repeat=mesh_ndim):
        outputs = tuple(
            None if combo[0].outputs[i] is None else tuple(o.outputs[i] for o in combo)
            for i in range(len(combo[0].outputs))
        )
        inputs = tuple(tuple(o.inputs[i] for o in combo) for i in range(len(combo[0].inputs)))
        strategies.append(Strategy(outputs, inputs))  # type: ignore[arg-type]
    return strategies


class RuleRegistry:
    """Sharding rules by ATen overload or overload packet. An explicit object: build one with
    :func:`fxpar.rules.default_rules` and register your own rules on it."""

    def __init__(self) -> None:
        self._rules: OpTable[Rule] = OpTable()

    def register(self, *ops: object) -> Callable[[Rule], Rule]:
        """Decorator: ``rule`` lists the strategies of each of ``ops``."""
        return self._rules.register(*ops)

    def rule(self, target: object) -> Rule | None:
        return self._rules.lookup(target)

    def has_rule(self, target: object) -> bool:
        return self.rule(target) is not None

    def copy(self) -> RuleRegistry:
        other = RuleRegistry()
        other._rules = self._rules.copy()
        return other

    def strategies(self, call: OpCall) -> list[Strategy]:
        """Every valid strategy of ``call``, the replicated one first, without duplicates."""
        symbolic = [m for m in (*call.inputs, *call.outputs) if m is not None and m.is_symbolic]
        if symbolic:
            # Rules compare sizes with the mesh, which a symbol cannot answer.
            raise SymbolicShapeError(
                f"sharding rules need concrete shapes, but {call.target} has symbolic ones "
                f"({', '.join(map(str, symbolic))}): its Program was captured with "
                "dynamic=True; capture with dynamic=False to plan it"
            )
        ndim = len(call.mesh_shape)
        fallback = Strategy(
            tuple(None if o is None else replicated(ndim) for o in call.outputs),
            tuple(replicated(ndim) for _ in call.inputs),
        )
        found: dict[Strategy, None] = {fallback: None}
        rule = self.rule(call.target)
        if rule is not None:
            options = list(rule(call))
            axis_options = [o for o in options if isinstance(o, AxisOption)]
            if axis_options:
                # Replicating along an axis is always valid, so mixed strategies such as
                # (Shard(0), Replicate()) exist even when a rule does not list the option.
                axis_options.insert(0, all_replicated(call))
            candidates = expand(axis_options, ndim) if axis_options else []
            candidates += [o for o in options if isinstance(o, Strategy)]
            for strategy in candidates:
                if _fits(strategy, call):
                    found.setdefault(strategy, None)
        return list(found)


def _fits(strategy: Strategy, call: OpCall) -> bool:
    if len(strategy.inputs) != len(call.inputs) or len(strategy.outputs) != len(call.outputs):
        return False
    for spec, meta in zip(strategy.inputs, call.inputs, strict=True):
        if not is_valid(meta.shape, spec, call.mesh_shape):
            return False
        if meta.dtype == torch.bool and has_partial(spec):
            return False  # booleans have no sum
    for out_spec, out_meta in zip(strategy.outputs, call.outputs, strict=True):
        if (out_spec is None) != (out_meta is None):
            return False
        if out_spec is not None and not is_valid(out_meta.shape, out_spec, call.mesh_shape):  # type: ignore[union-attr]
            return False
        if out_meta is not None and out_meta.dtype == torch.bool and has_partial(out_spec):
            return False
    return True


def op_call(node: fx.Node, mesh_shape: tuple[int, ...]) -> OpCall:
    """Describe ``node`` for a rule."""
    inputs: list[ir.TensorMeta] = []

    def replace(arg: fx.Node) -> Any:
        value = ir.require(arg, ir.ValueMeta)
        if value.multiple or value.outputs[0] is None:
            return arg.meta.get("val")  # a symbolic size or a tuple: passed as is
        inputs.append(value.outputs[0])
        return value.outputs[0]

    args, kwargs = fx.node.map_arg((node.args, node.kwargs), replace)
    return OpCall(
        target=node.target,
        args=tuple(args),
        kwargs=dict(kwargs),
        inputs=tuple(inputs),
        outputs=ir.require(node, ir.ValueMeta).outputs,
        mesh_shape=mesh_shape,
    )


def tensor_inputs(node: fx.Node) -> list[fx.Node]:
    """The nodes whose tensors a strategy's ``inputs`` refer to, in the same order."""
    found: list[fx.Node] = []

    def visit(arg: fx.Node) -> fx.Node:
        value = ir.require(arg, ir.ValueMeta)
        if not value.multiple and value.outputs[0] is not None:
            found.append(arg)
        return arg

    fx.node.map_arg((node.args, node.kwargs), visit)
    return found


def all_replicated(call: OpCall) -> AxisOption:
    return AxisOption(
        tuple(None if o is None else R_ for o in call.outputs), (R_,) * len(call.inputs)
    )


__all__ = [
    "AxisOption",
    "LocalCall",
    "OpCall",
    "Rule",
    "RuleRegistry",
    "Spec",
    "all_replicated",
    "expand",
    "op_call",
    "shard_index",
    "tensor_inputs",
]
