"""Plain-text reports of a Program: where its work and its memory traffic go."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from fxpar import ir
from fxpar.ir.program import Program

_HEADER = ("module", "params", "fwd nodes", "bwd nodes", "fwd FLOPs", "bwd FLOPs", "bytes moved")


@dataclass
class _Row:
    parameters: ir.Size = 0
    forward_nodes: int = 0
    backward_nodes: int = 0
    forward_flops: ir.Size = 0
    backward_flops: ir.Size = 0
    bytes_moved: ir.Size = 0

    def add_node(self, phase: ir.Phase, cost: ir.Cost) -> None:
        if phase is ir.Phase.FORWARD:
            self.forward_nodes += 1
            self.forward_flops = ir.total((self.forward_flops, cost.flops))
        else:
            self.backward_nodes += 1
            self.backward_flops = ir.total((self.backward_flops, cost.flops))
        self.bytes_moved = ir.total((self.bytes_moved, cost.bytes_read, cost.bytes_written))

    def merge(self, other: _Row) -> None:
        self.parameters = ir.total((self.parameters, other.parameters))
        self.forward_nodes += other.forward_nodes
        self.backward_nodes += other.backward_nodes
        self.forward_flops = ir.total((self.forward_flops, other.forward_flops))
        self.backward_flops = ir.total((self.backward_flops, other.backward_flops))
        self.bytes_moved = ir.total((self.bytes_moved, other.bytes_moved))

    def cells(self, name: str) -> tuple[str, ...]:
        return (
            name, _short(self.parameters), str(self.forward_nodes), str(self.backward_nodes),
            _short(self.forward_flops), _short(self.backward_flops), _short(self.bytes_moved),
        )  # fmt: skip


def group_of(module: str, depth: int) -> str:
    """The first ``depth`` components of a module path ("blocks.3.attn.qkv" -> "blocks.3")."""
    if not module:
        return "<root>"
    if module.startswith("<"):
        return module
    return ".".join(module.split(".")[:depth])


def cost_table(program: Program, depth: int = 2) -> str:
    """Parameters, nodes, FLOPs and bytes moved per module group, forward and backward.

    Needs the Cost annotations of :class:`fxpar.passes.AnnotateCost`.
    """
    rows: dict[str, _Row] = defaultdict(_Row)
    placeholders = program.placeholders()
    for name in program.signature.parameters:
        node = placeholders[name]
        row = rows[group_of(ir.require(node, ir.Region).module, depth)]
        row.parameters = ir.total((row.parameters, ir.require(node, ir.ValueMeta).tensor.numel))
    for node in program.graph.nodes:
        region = ir.require(node, ir.Region)
        if region.phase in (ir.Phase.FORWARD, ir.Phase.BACKWARD):
            rows[group_of(region.module, depth)].add_node(region.phase, ir.require(node, ir.Cost))
    totals = _Row()
    for row in rows.values():
        totals.merge(row)
    body = [row.cells(name) for name, row in rows.items()]
    footer = totals.cells("total")
    widths = [max(len(c) for c in column) for column in zip(_HEADER, *body, footer, strict=True)]

    def render(cells: tuple[str, ...]) -> str:
        first = cells[0].ljust(widths[0])
        rest = (cell.rjust(width) for cell, width in zip(cells[1:], widths[1:], strict=True))
        return "  ".join((first, *rest))

    rule = "  ".join("-" * width for width in widths)
    return "\n".join([render(_HEADER), rule, *map(render, body), rule, render(footer)])


def _short(value: ir.Size) -> str:
    if not isinstance(value, int):
        return str(value)
    for unit, scale in (("T", 10**12), ("G", 10**9), ("M", 10**6), ("k", 10**3)):
        if abs(value) >= scale:
            return f"{value / scale:.1f}{unit}"
    return str(value)
