"""Grouped matrix products of mixture-of-experts layers, split inside each expert.

A grouped product multiplies the rows of ``input`` (S, K), sorted by expert, by their expert's
matrix in ``weight`` (E, K, N); ``offs`` (E,) holds the cumulative row count of each expert, so
expert ``e`` owns rows ``offs[e-1]:offs[e]``. Per row it is ``input[s] @ weight[e(s)]``, an
einsum ``sk,ekn->sn`` whose ``e`` is picked by ``s``. On one mesh axis:

- the output features ``n`` split: ``weight`` Shard(2), the rest replicated, output Shard(1)
  (Megatron's column split, inside every expert at once);
- the contraction ``k`` split: ``input`` Shard(1) and ``weight`` Shard(1), output Partial
  (the row split);
- the product is linear in ``input`` and in ``weight``: either one Partial with the other
  replicated gives a Partial output.

Neither the rows nor the experts can be split: ``offs`` counts rows of the whole input and
names every expert, so a piece of either would no longer match it. ``offs`` stays replicated.

The backward (``input``, ``weight``, ``offs``, ``grad_output`` -> ``grad_input``,
``grad_weight``) matches: ``grad_input = grad_output @ weight[e]ᵀ`` contracts ``n`` and
``grad_weight[e] = input[rows of e]ᵀ @ grad_output[rows of e]`` keeps ``k`` and ``n``.

Two ops have these rules:

- ``transformers::grouped_mm_fallback`` and its ``_backward``, the custom ops Hugging Face
  transformers' MoE layers call (fp32 experts under capture). They exist once
  ``transformers.integrations.moe`` is imported (building any of its MoE models does it), and
  :func:`register` adds their rules only if they exist then: a registry built earlier has none.
- ``aten._grouped_mm``, which bf16 experts call. Its forward is the product above; its backward
  is two more grouped products: ``grad_output @ weightᵀ`` (the same shape) and
  ``inputᵀ @ grad_output`` grouped along the contraction (``ks,sn->ekn``). The CPU kernel needs
  16-byte aligned strides, so a split that leaves a product dim a size the kernel rejects is not
  offered; its other forms (a 3-D first operand, no offsets, a bias) run replicated.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from fxpar.rules.registry import AxisOption, OpCall, RuleRegistry, all_replicated, expand
from fxpar.sharding import Strategy, is_valid, local_shape

aten = torch.ops.aten
R, P = Replicate(), Partial()

GROUPED_MM_OPTIONS = [
    # (input, weight, offs) -> output
    AxisOption((Shard(1),), (R, Shard(2), R)),  # output features
    AxisOption((P,), (Shard(1), Shard(1), R)),  # contraction
    AxisOption((P,), (P, R, R)),  # linear in input
    AxisOption((P,), (R, P, R)),  # linear in weight
]
"""One-axis options of a grouped product ``(S, K) x (E, K, N) -> (S, N)``."""

GROUPED_MM_BACKWARD_OPTIONS = [
    # (input, weight, offs, grad_output) -> (grad_input, grad_weight)
    # Output features: grad_input sums over n (Partial), grad_weight keeps n.
    AxisOption((P, Shard(2)), (R, Shard(2), R, Shard(1))),
    # Contraction: grad_input and grad_weight both keep k.
    AxisOption((Shard(1), Shard(1)), (Shard(1), Shard(1), R, R)),
    # Both gradients are linear in grad_output.
    AxisOption((P, P), (R, R, R, P)),
]
"""One-axis options of the grouped product's backward. (``grad_weight`` is also linear in
``input`` and ``grad_input`` in ``weight``, but the other gradient does not read that operand
and would come out whole on every device beside a Partial one: those options are left out.)"""

GROUPED_WEIGHT_GRAD_OPTIONS = [
    # (inputᵀ (K, S), grad_output (S, N), offs) -> (E, K, N), grouped along s
    AxisOption((Shard(1),), (Shard(0), R, R)),
    AxisOption((Shard(2),), (R, Shard(1), R)),
    AxisOption((P,), (P, R, R)),
    AxisOption((P,), (R, P, R)),
]
"""One-axis options of ``aten._grouped_mm`` on two 2-D operands: ``ks,sn->ekn``, the groups
cutting the contraction ``s``, which therefore stays whole."""


def _fixed(options: list[AxisOption]) -> Callable[[OpCall], list[AxisOption]]:
    return lambda call: options


def _grouped_mm(call: OpCall) -> list[Strategy]:
    """``aten._grouped_mm(self, mat2, offs=None, bias=None, out_dtype=None)``: the forms an MoE
    layer and its backward call, with every split the CPU kernel accepts."""
    if call.arg(2, "offs") is None or call.arg(3, "bias") is not None:
        return []
    a, b = call.inputs[0], call.inputs[1]
    if len(a.shape) == 2 and len(b.shape) == 3:
        options = GROUPED_MM_OPTIONS
    elif len(a.shape) == 2 and len(b.shape) == 2:
        options = GROUPED_WEIGHT_GRAD_OPTIONS
    else:
        return []
    candidates = expand([all_replicated(call), *options], len(call.mesh_shape))
    return [s for s in candidates if _aligned(s, call)]


def _aligned(strategy: Strategy, call: OpCall) -> bool:
    """Whether every matrix keeps the strides ``aten._grouped_mm`` needs on each device: a split
    product dim (one of the last two) must stay a multiple of 16 bytes."""
    specs = [*strategy.inputs, *strategy.outputs]
    metas = [*call.inputs, *call.outputs]
    for spec, meta in zip(specs, metas, strict=True):
        if spec is None or meta is None or len(meta.shape) < 2:
            continue
        if not is_valid(meta.shape, spec, call.mesh_shape):
            return False
        alignment = max(1, 16 // meta.dtype.itemsize)
        local = local_shape(meta.shape, spec, call.mesh_shape)
        for dim in (-2, -1):
            if local[dim] != meta.shape[dim] and local[dim] % alignment:
                return False
    return True


def transformers_ops() -> tuple[object, object] | None:
    """The grouped-product custom ops of Hugging Face transformers (forward, backward), or None
    while they are not loaded."""
    namespace = torch.ops.transformers
    forward = getattr(namespace, "grouped_mm_fallback", None)
    backward = getattr(namespace, "grouped_mm_fallback_backward", None)
    if forward is None or backward is None:
        return None
    return forward.default, backward.default


def register(rules: RuleRegistry) -> None:
    rules.register(aten._grouped_mm.default)(_grouped_mm)
    ops = transformers_ops()
    if ops is not None:
        forward, backward = ops
        rules.register(forward)(_fixed(GROUPED_MM_OPTIONS))
        rules.register(backward)(_fixed(GROUPED_MM_BACKWARD_OPTIONS))
