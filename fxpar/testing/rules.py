"""Check sharding rules against ground truth: run the op on shards, reassemble, compare.

For every node of a Program with a rule, every strategy the rule offers on a mesh is executed
for real: each input is split according to its spec (shards are chunks, replicas are copies, and
a partial input is split into random addends that sum to it), the op runs on every device's
pieces as the lowering runs it (shape arguments made local, and a strategy's local call where
its op family gives one: :mod:`fxpar.rules.local`), and each output is reassembled from its
spec and compared with the op's output on whole tensors. A rule that claims a wrong strategy is
caught here, whatever plan would have chosen it.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.distributed.tensor import Partial, Shard

from fxpar import ir
from fxpar.cluster import Cluster, Coordinate
from fxpar.ir.program import Program
from fxpar.lowering import localize_shape_arguments
from fxpar.rules import RuleRegistry, default_rules, op_call
from fxpar.rules.local import local_call
from fxpar.sharding import Spec, Strategy, assemble, spec_str
from fxpar.testing.simulate import record_values


@dataclass(frozen=True)
class RuleViolation:
    node: str
    target: str
    strategy: str
    problem: str

    def __str__(self) -> str:
        return f"{self.target} at {self.node!r}, strategy {self.strategy}: {self.problem}"


def distribute(
    value: torch.Tensor, spec: Spec, mesh_shape: Sequence[int], generator: torch.Generator
) -> dict[Coordinate, torch.Tensor]:
    """Every device's piece of ``value`` under ``spec``; partial axes get random addends."""
    pieces: dict[Coordinate, torch.Tensor] = {(): value}
    for placement, size in zip(spec, mesh_shape, strict=True):
        split: dict[Coordinate, torch.Tensor] = {}
        for coordinate, piece in pieces.items():
            if isinstance(placement, Shard):
                parts = list(piece.chunk(size, placement.dim))
            elif isinstance(placement, Partial):
                noise = [_noise(piece, generator) for _ in range(size - 1)]
                parts = [piece - sum(noise, torch.zeros_like(piece)), *noise]
            else:
                parts = [piece] * size
            for index, part in enumerate(parts):
                split[(*coordinate, index)] = part.contiguous()
        pieces = split
    return pieces


def _noise(like: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    if like.is_floating_point() or like.is_complex():
        # Addends of the value's own magnitude, so cancellation costs no more precision than
        # the reassociation a real reduction does.
        # Infinite entries (attention masks) cannot be split: they stay whole on device 0.
        finite = like.isfinite()
        scale = like[finite].abs().mean().item() if finite.any() else 1.0
        noise = torch.randn(like.shape, generator=generator, dtype=like.dtype) * scale
        return noise * finite
    return torch.randint(-3, 4, like.shape, generator=generator, dtype=like.dtype)


def validate_rules(
    program: Program,
    flat_inputs: Sequence[torch.Tensor],
    cluster: Cluster,
    rules: RuleRegistry | None = None,
    *,
    rtol: float = 1e-4,
    atol: float = 1e-5,
    seed: int = 0,
) -> list[RuleViolation]:
    """Every strategy of every ruled node of ``program`` on ``cluster``'s mesh, checked against
    the op on whole tensors (the real values of a run on ``flat_inputs``)."""
    rules = rules or default_rules()
    values = record_values(program.graph_module, flat_inputs)
    generator = torch.Generator().manual_seed(seed)
    mesh = cluster.mesh_shape
    violations = []
    for node in program.graph.nodes:
        if (
            node.op != "call_function"
            or node.target is operator.getitem
            or not rules.has_rule(node.target)
            or not ir.require(node, ir.ValueMeta).tensors
        ):
            continue
        for strategy in rules.strategies(op_call(node, mesh)):
            problem = _check(node, strategy, values, cluster, generator, rtol, atol)
            if problem is not None:
                violations.append(
                    RuleViolation(node.name, str(node.target), str(strategy), problem)
                )
    return violations


def _check(
    node: fx.Node,
    strategy: Strategy,
    values: dict[str, object],
    cluster: Cluster,
    generator: torch.Generator,
    rtol: float,
    atol: float,
) -> str | None:
    mesh = cluster.mesh_shape
    required = iter(strategy.inputs)
    distributed: dict[int, dict[Coordinate, torch.Tensor]] = {}
    order: list[fx.Node] = []

    def collect(arg: fx.Node) -> fx.Node:
        value = ir.require(arg, ir.ValueMeta)
        if not value.multiple and value.outputs[0] is not None:
            distributed[len(order)] = distribute(values[arg.name], next(required), mesh, generator)  # type: ignore[arg-type]
            order.append(arg)
        return arg

    fx.node.map_arg((node.args, node.kwargs), collect)
    outputs: dict[Coordinate, tuple[object, ...]] = {}
    for coordinate in cluster.coordinates():
        counter = iter(range(len(order)))

        def local(
            arg: fx.Node,
            coordinate: Coordinate = coordinate,
            counter: Iterator[int] = counter,
        ) -> object:
            value = ir.require(arg, ir.ValueMeta)
            if value.multiple or value.outputs[0] is None:
                return values[arg.name]
            return distributed[next(counter)][coordinate]

        args, kwargs = fx.node.map_arg((node.args, node.kwargs), local)  # type: ignore[arg-type]
        args = localize_shape_arguments(node, tuple(args), strategy.outputs, mesh)
        call = local_call(op_call(node, mesh), strategy, coordinate)
        function, static = (node.target, ()) if call is None else (call.function, call.static)
        try:
            result = function(*static, *args, **kwargs)  # type: ignore[operator]
        except Exception as error:
            return f"the op fails on local pieces: {type(error).__name__}: {error}"
        outputs[coordinate] = tuple(result) if isinstance(result, (tuple, list)) else (result,)
    expected = values[node.name]
    expected_outputs = tuple(expected) if isinstance(expected, (tuple, list)) else (expected,)
    for index, spec in enumerate(strategy.outputs):
        want = expected_outputs[index]
        if spec is None or not isinstance(want, torch.Tensor):
            continue
        pieces = {c: outs[index] for c, outs in outputs.items()}
        try:
            got = assemble(pieces, spec, mesh)  # type: ignore[arg-type]
        except Exception as error:
            return f"output {index} ({spec_str(spec)}) does not reassemble: {error}"
        if got.shape != want.shape:
            return f"output {index} reassembles to {tuple(got.shape)}, expected {tuple(want.shape)}"
        if want.is_floating_point() or want.is_complex():
            # Tolerance relative to the output's scale: sums of addends lose absolute precision.
            finite = want.isfinite()
            bound = atol + rtol * (want[finite].abs().max().item() if finite.any() else 0.0)
            near = (got - want).abs() <= bound + rtol * want.abs()
            ok = bool((near | (got == want) | (got.isnan() & want.isnan())).all())
        else:
            ok = torch.equal(got, want)
        if not ok:
            worst = (got.double() - want.double()).abs().max().item()
            return f"output {index} ({spec_str(spec)}) differs by up to {worst:.3g}"
    return None
