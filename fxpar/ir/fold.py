"""Fold a stamped step back to the layers that differ, each with how many layers it stands for.

A step built by :func:`~fxpar.ir.repeat.capture_repeated` holds ``N`` layers of which all but
the first three and the last two are copies of one template layer, op for op. Planning walks
every node of the step at least once per mesh it plans for: the candidate strategies, the cost
annotation, the problem's costs, the priced collective schedule. On Llama-3-70B that is 19,601
nodes per stage mesh, where six layers' worth (1,600 nodes) say everything there is to say.

:func:`fold` keeps layers ``0 .. T`` (``T`` the template) and the last two, drops the copies
``T + 1 .. N - 3``, and reconnects what read them: the first copy's backward reads the gradient
the layer after the copies sends back, and the layer after the copies reads the first copy's
forward output, as if the copies in between were one. The folded Program carries a
:class:`Multiplicity`: every node of the kept copy stands for ``N - 5`` nodes of the step.

The problem builder (:func:`fxpar.planning.problem.build_problem`) weighs each unit's costs,
memory and incoming reshardings by its root's multiplicity. Because repeated layers share one
set of decisions there, the folded problem is the step's problem: the same decision nodes by
name, the same candidates, the same costs and memory up to the order of the sums
(tests/test_fold.py compares them entry for entry). Its solution is therefore the step's, and
:attr:`Folded.origin` maps every node of the step to the node of the folded Program it is a
copy of, to read per-node prices of one as the other's.

Folding needs the copies to be what stamping made them: each dropped copy has the template's
ops in the template's order, and nothing but its neighbours and the output reads it. Where that
does not hold (a pass rewrote one copy and not the others, say), :func:`fold` returns None and
the caller plans the whole step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule

from fxpar import ir
from fxpar.ir.program import Program
from fxpar.ir.repeat import StampedLayers, layer_of, layer_pattern


@dataclass(frozen=True)
class Multiplicity:
    """Program-level record of a folded step: every node of layer ``layer`` of ``container``
    (by its Region's module) stands for ``copies`` nodes of the step, any other node for one.
    Read by module rather than by node, so that it holds for nodes a pass adds or renames."""

    container: str
    layer: int
    copies: int

    def of(self, module: str) -> int:
        """How many nodes of the step a node of ``module`` stands for."""
        path = f"{self.container}.{self.layer}" if self.container else str(self.layer)
        inside = module == path or module.startswith(path + ".")
        return self.copies if inside else 1


@dataclass(frozen=True)
class Folded:
    """A stamped step folded to its distinct layers."""

    program: Program
    """The folded step, with its :class:`Multiplicity`."""
    origin: Mapping[str, str]
    """For every node of the step, by name: the node of :attr:`program` it is a copy of (itself
    where it was kept)."""
    copies: int
    """How many layers the kept copy stands for."""


def fold(program: Program) -> Folded | None:
    """``program`` folded to its distinct layers (module docstring), or None when it was not
    stamped, has too few copies to gain from folding, or its copies are no longer alike."""
    stamped = program.get(StampedLayers)
    if stamped is None:
        return None
    template = stamped.template
    last = stamped.count - (stamped.traced - template)  # the last copy
    if last <= template:
        return None
    pattern = layer_pattern(stamped.container)
    label = {node: layer_of(node, pattern) for node in program.graph.nodes}
    layers: dict[int, list[fx.Node]] = {}
    for node, layer in label.items():
        if layer >= 0:
            layers.setdefault(layer, []).append(node)
    kept, after = layers.get(template, []), layers.get(last + 1, [])
    if not kept or len(after) != len(kept):
        return None
    role: dict[fx.Node, int] = {}
    for layer in range(template + 1, last + 1):
        nodes = layers.get(layer, [])
        if len(nodes) != len(kept):
            return None
        for index, (node, twin) in enumerate(zip(nodes, kept, strict=True)):
            if node.op != twin.op or (node.op != "placeholder" and node.target != twin.target):
                return None
            role[node] = index

    def stand_in(arg: fx.Node, reader: fx.Node) -> fx.Node | None:
        """What ``reader`` (kept) reads in place of ``arg`` (dropped), or None if nothing."""
        if label[reader] == template and label[arg] == template + 1:
            return after[role[arg]]  # the gradient sent back into the kept copy
        if label[reader] == last + 1 and label[arg] == last:
            return kept[role[arg]]  # the forward output of the copies
        return None

    graph = fx.Graph()
    new: dict[fx.Node, fx.Node] = {}
    origin: dict[str, str] = {}
    dropped_names: set[str] = set()
    state_names = {node: name for name, node in program.placeholders().items()}
    for node in program.graph.nodes:
        if node in role:
            origin[node.name] = kept[role[node]].name
            if node.op == "placeholder":
                dropped_names.add(state_names[node])
            continue
        if node.op == "output":
            (values,) = node.args
            assert isinstance(values, (tuple, list))
            outputs = tuple(new[v] for v in values if v not in role)
            graph.output(outputs).meta = node.meta
            continue
        missing = False

        def read(arg: fx.Node, reader: fx.Node = node) -> fx.Node:
            nonlocal missing
            found = stand_in(arg, reader) if arg in role else arg
            if found is None or found not in new:
                missing = True  # read by something other than its neighbours: not foldable
                return arg
            return new[found]

        made = graph.node_copy(node, read)
        if missing or made.name != node.name:
            return None
        made.meta = dict(node.meta)
        if ir.META_KEY in node.meta:  # the folded step is annotated apart from the step
            made.meta[ir.META_KEY] = dict(node.meta[ir.META_KEY])
        new[node] = made
        origin[node.name] = node.name
    signature = program.signature
    short = dataclasses.replace(
        signature,
        parameters=tuple(n for n in signature.parameters if n not in dropped_names),
        buffers=tuple(n for n in signature.buffers if n not in dropped_names),
        gradients=tuple(n for n in signature.gradients if n not in dropped_names),
    )
    folded = Program(_LazyGraphModule(program.graph_module, graph), short)
    folded.cluster = program.cluster
    folded._annotations = dict(program._annotations)
    folded._annotations.pop(StampedLayers)  # six layers, none of them stamped
    copies = last - template + 1
    folded.annotate(Multiplicity(stamped.container, template, copies))
    return Folded(folded, origin, copies)
