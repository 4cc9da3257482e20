"""Rewrite means into sums so that sharded reductions stay exact.

A mean over a sharded dim is not a sum of per-device means, but a sum is a sum of per-device
sums (a Partial value). So before sharding:

- ``mean(x, dims)`` becomes ``sum(x, dims) / count``, with the global ``count``;
- ``nll_loss_forward(..., reduction=mean)`` becomes the ``sum`` reduction divided by the total
  weight of the valid targets, which the same op returns;
- ``nll_loss_backward(g, ..., reduction=mean, total_weight)`` becomes the ``sum`` backward of
  ``g / total_weight``.

The Program computes the same values; the new nodes carry the annotations of the ones they
replace.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from fxpar import ir
from fxpar.ir.program import Program
from fxpar.passes.base import Pass

aten = torch.ops.aten
_MEAN, _SUM = 1, 2  # torch's reduction enum


@dataclass(frozen=True)
class Canonicalize(Pass):
    name = "canonicalize"

    def run(self, program: Program) -> Program:
        graph = program.graph
        for node in list(graph.nodes):
            if node.target in (aten.mean.dim, aten.mean.default):
                _mean_to_sum(graph, node)
            elif node.target is aten.nll_loss_forward.default and _reduction(node, 3) == _MEAN:
                _nll_forward_to_sum(graph, node)
            elif node.target is aten.nll_loss_backward.default and _reduction(node, 4) == _MEAN:
                _nll_backward_to_sum(graph, node)
        graph.eliminate_dead_code()
        program.recompile()
        return program


def _reduction(node: fx.Node, index: int) -> Any:
    return node.args[index] if len(node.args) > index else node.kwargs.get("reduction", _MEAN)


def insert_node(
    graph: fx.Graph,
    target: Any,
    args: tuple[Any, ...],
    like: fx.Node,
    kwargs: dict[str, Any] | None = None,
) -> fx.Node:
    """A new node computing ``target(*args)`` before ``like``, with its traced value, a
    ValueMeta and ``like``'s Region."""
    with graph.inserting_before(like):
        node = graph.call_function(target, args, kwargs or {})
    values, kw_values = fx.node.map_arg((args, kwargs or {}), lambda n: n.meta["val"])
    node.meta["val"] = target(*values, **kw_values)
    ir.annotate(node, ir.ValueMeta.of(node.meta["val"]))
    ir.annotate(node, ir.require(like, ir.Region))
    return node


def _mean_to_sum(graph: fx.Graph, node: fx.Node) -> None:
    source = node.args[0]
    assert isinstance(source, fx.Node)
    shape = ir.require(source, ir.ValueMeta).tensor.shape
    if node.target is aten.mean.default:
        dims, keepdim = list(range(len(shape))), False
    else:
        given: Any = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        dims = list(range(len(shape))) if not given else list(given)
        keepdim = bool(node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False))
    if any(not isinstance(shape[d], int) for d in dims):
        return  # a symbolic count: keep the mean
    count = math.prod(shape[d] for d in dims)
    dtype = node.kwargs.get("dtype")
    total = insert_node(graph, aten.sum.dim_IntList, (source, dims, keepdim), node,
                        {"dtype": dtype} if dtype is not None else None)  # fmt: skip
    mean = insert_node(graph, aten.div.Tensor, (total, count), node)
    node.replace_all_uses_with(mean)
    graph.erase_node(node)


def _nll_forward_to_sum(graph: fx.Graph, node: fx.Node) -> None:
    args = list(node.args)
    args[3] = _SUM
    summed = insert_node(graph, aten.nll_loss_forward.default, tuple(args), node)
    loss_sum = insert_node(graph, operator.getitem, (summed, 0), node)
    total_weight = insert_node(graph, operator.getitem, (summed, 1), node)
    loss = insert_node(graph, aten.div.Tensor, (loss_sum, total_weight), node)
    for user in list(node.users):
        assert user.target is operator.getitem
        user.replace_all_uses_with(loss if user.args[1] == 0 else total_weight)
        graph.erase_node(user)
    graph.erase_node(node)


def _nll_backward_to_sum(graph: fx.Graph, node: fx.Node) -> None:
    args = list(node.args)
    grad = insert_node(graph, aten.div.Tensor, (args[0], args[6]), node)
    args[0], args[4] = grad, _SUM
    replacement = insert_node(graph, aten.nll_loss_backward.default, tuple(args), node)
    node.replace_all_uses_with(replacement)
    graph.erase_node(node)
