"""Rewrite means into sums so that sharded reductions stay exact.

A mean over a sharded dim is not a sum of per-device means, but a sum is a sum of per-device
sums (a Partial value). So before sharding:

- ``mean(x, dims)`` becomes ``sum(x, dims) / count``, with the global ``count``;
- ``nll_loss_forward(..., reduction=mean)`` becomes the ``sum`` reduction divided by the total
  weight of the valid targets, which the same op returns;
- ``nll_loss_backward(g, ..., reduction=mean, total_weight)`` becomes the ``sum`` backward of
  ``g / total_weight``.

And one rewrite for speed: an attention mask that depends on no input and is exactly the
causal mask (what Hugging Face models build under tracing, from ``arange`` and ``le``) becomes
the attention kernel's own ``is_causal=True``, so no mask of ``batch x length x length`` is
built or read each step, and on a GPU the attention runs the flash kernel, which takes no mask
(:mod:`fxpar.ir.placement`). The mask is evaluated once, on the CPU, to check it; masked
scores (``-inf`` or the dtype's lowest value) weigh exactly 0 either way.

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
        masks: dict[fx.Node, bool] = {}  # each mask node checked once
        changed = False
        for node in list(graph.nodes):
            if node.target in _CPU_ATTENTION and node.kwargs.get("attn_mask") is not None:
                changed |= _fold_causal_mask(node, masks)
            elif node.target in (aten.mean.dim, aten.mean.default):
                changed |= _mean_to_sum(graph, node)
            elif node.target is aten.nll_loss_forward.default and _reduction(node, 3) == _MEAN:
                _nll_forward_to_sum(graph, node)
                changed = True
            elif node.target is aten.nll_loss_backward.default and _reduction(node, 4) == _MEAN:
                _nll_backward_to_sum(graph, node)
                changed = True
        changed |= graph.eliminate_dead_code()
        # A canonical program (planned again for another mesh) keeps its code: writing a
        # large step's code takes seconds.
        if changed:
            program.recompile()
        return program


_CPU_ATTENTION: dict[Any, int] = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: 4,  # where is_causal sits
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: 7,
}
_LARGEST_MASK = 2**27
"""Masks of more elements are not evaluated to check (the one-off cost of folding)."""


def _fold_causal_mask(node: fx.Node, masks: dict[fx.Node, bool]) -> bool:
    """Drop ``node``'s attention mask for ``is_causal=True`` where the mask is a constant
    that equals the causal mask (module docstring); whether it did."""
    mask = node.kwargs["attn_mask"]
    causal_at = _CPU_ATTENTION[node.target]
    query, key = node.args[causal_at - 4 : causal_at - 2]
    assert isinstance(mask, fx.Node) and isinstance(query, fx.Node) and isinstance(key, fx.Node)
    length = query.meta["val"].shape[-2]
    if key.meta["val"].shape[-2] != length:
        return False
    if mask not in masks:
        masks[mask] = _is_causal_mask(mask, length)
    if not masks[mask]:
        return False
    args = list(node.args)
    if len(args) <= causal_at:  # the forward's dropout_p and is_causal have defaults
        args += [0.0] * (causal_at - len(args)) + [False]
    args[causal_at] = True
    node.args = tuple(args)
    node.kwargs = {name: value for name, value in node.kwargs.items() if name != "attn_mask"}
    return True


def _is_causal_mask(mask: fx.Node, length: int) -> bool:
    """Whether ``mask`` depends on no input and equals the causal mask of ``length`` queries
    and keys, broadcast (``True``/0 on and below the diagonal, ``False``/``-inf`` above)."""
    value = _constant_value(mask)
    if value is None or value.shape[-2:] != (length, length):
        return False
    allowed = torch.ones(length, length, dtype=torch.bool).tril()
    if value.dtype == torch.bool:
        return bool((value == allowed).all())
    lowest = torch.finfo(value.dtype).min
    hidden = value.masked_select(~allowed.expand(value.shape))
    kept = value.masked_select(allowed.expand(value.shape))
    return bool((kept == 0).all()) and bool(((hidden == -math.inf) | (hidden == lowest)).all())


def _constant_value(node: fx.Node) -> torch.Tensor | None:
    """The value of ``node`` computed on the CPU, if it and everything it reads are calls
    that depend on no input of the graph (and it is small enough to check); else None."""
    meta = node.meta.get("val")
    if not isinstance(meta, torch.Tensor) or meta.numel() > _LARGEST_MASK:
        return None
    needed: list[fx.Node] = []
    stack, seen = [node], set()
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        if current.op != "call_function" or not isinstance(current.target, torch._ops.OpOverload):
            return None
        if torch.Tag.nondeterministic_seeded in current.target.tags:
            return None
        needed.append(current)
        stack.extend(current.all_input_nodes)
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    values: dict[fx.Node, Any] = {}
    for current in sorted(needed, key=order.__getitem__):
        args, kwargs = fx.node.map_arg((current.args, current.kwargs), values.__getitem__)
        target: Any = current.target
        values[current] = target(*args, **kwargs)
    value = values[node]
    return value if isinstance(value, torch.Tensor) else None


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


def _mean_to_sum(graph: fx.Graph, node: fx.Node) -> bool:
    """Replace a mean by a sum divided by its count; whether it did (not for a symbolic
    count)."""
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
        return False  # a symbolic count: keep the mean
    count = math.prod(shape[d] for d in dims)
    dtype = node.kwargs.get("dtype")
    total = insert_node(graph, aten.sum.dim_IntList, (source, dims, keepdim), node,
                        {"dtype": dtype} if dtype is not None else None)  # fmt: skip
    mean = insert_node(graph, aten.div.Tensor, (total, count), node)
    node.replace_all_uses_with(mean)
    graph.erase_node(node)
    return True


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
