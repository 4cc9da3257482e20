"""Grouped matrix products of mixture-of-experts layers, split inside each expert or by expert.

A grouped product multiplies the rows of ``input`` (S, K), sorted by expert, by their expert's
matrix in ``weight`` (E, K, N); ``offs`` (E,) holds the cumulative row count of each expert, so
expert ``e`` owns rows ``offs[e-1]:offs[e]``. Per row it is ``input[s] @ weight[e(s)]``, an
einsum ``sk,ekn->sn`` whose ``e`` is picked by ``s``. On one mesh axis:

- the output features ``n`` split: ``weight`` Shard(2), the rest replicated, output Shard(1)
  (Megatron's column split, inside every expert at once);
- the contraction ``k`` split: ``input`` Shard(1) and ``weight`` Shard(1), output Partial
  (the row split);
- the product is linear in ``input`` and in ``weight``: either one Partial with the other
  replicated gives a Partial output;
- the experts split (expert parallelism): ``weight`` Shard(0), ``input`` and ``offs``
  replicated. Each device holds ``E/n`` whole experts and computes only the rows routed to
  them, ``offs[lo-1]:offs[hi-1]`` (known only at run time), into an output of zeros elsewhere:
  the devices' outputs sum to the product, so the output is Partial. The node's own op cannot
  do that on the local pieces (its ``offs`` names every expert), so a device runs the call
  :func:`local_call` gives instead: the same op on its rows, with the offsets rebased.

The rows cannot be split (``offs`` counts rows of the whole input) and ``offs`` stays
replicated. Under balanced routing each device does ``1/n`` of the work whichever way the
product is split; the cost model prices it so.

The backward (``input``, ``weight``, ``offs``, ``grad_output`` -> ``grad_input``,
``grad_weight``) matches: ``grad_input = grad_output @ weight[e]ᵀ`` contracts ``n`` and
``grad_weight[e] = input[rows of e]ᵀ @ grad_output[rows of e]`` keeps ``k`` and ``n``; with
the experts split, ``grad_input`` is Partial (each device's rows) and ``grad_weight``
Shard(0) (each device's experts).

Two ops have these rules:

- ``transformers::grouped_mm_fallback`` and its ``_backward``, the custom ops Hugging Face
  transformers' MoE layers call (fp32 experts under capture). They exist once
  ``transformers.integrations.moe`` is imported (building any of its MoE models does it), and
  :func:`register` adds their rules only if they exist then: a registry built earlier has none.
- ``aten._grouped_mm``, which bf16 experts call. Its forward is the product above; its backward
  is two more grouped products: ``grad_output @ weightᵀ`` (the same shape) and
  ``inputᵀ @ grad_output`` grouped along the contraction (``ks,sn->ekn``, whose experts split
  as its output's dim 0). The CPU kernel needs 16-byte aligned strides, so a split that leaves
  a product dim a size the kernel rejects is not offered; its other forms (a 3-D first operand,
  no offsets, a bias) run replicated.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from fxpar.cluster import Coordinate
from fxpar.rules.registry import (
    AxisOption,
    LocalCall,
    OpCall,
    RuleRegistry,
    all_replicated,
    expand,
    shard_index,
)
from fxpar.sharding import Spec, Strategy, is_valid, local_shape

aten = torch.ops.aten
R, P = Replicate(), Partial()

GROUPED_MM_OPTIONS = [
    # (input, weight, offs) -> output
    AxisOption((Shard(1),), (R, Shard(2), R)),  # output features
    AxisOption((P,), (Shard(1), Shard(1), R)),  # contraction
    AxisOption((P,), (P, R, R)),  # linear in input
    AxisOption((P,), (R, P, R)),  # linear in weight
]
"""One-axis options of a grouped product ``(S, K) x (E, K, N) -> (S, N)`` split inside each
expert."""

SPLIT_EXPERTS = AxisOption((P,), (R, Shard(0), R))
"""Experts split: each device's rows of its own experts, zeros elsewhere (a local call)."""

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

SPLIT_EXPERTS_BACKWARD = AxisOption((P, Shard(0)), (R, Shard(0), R, R))
"""Experts split: each device's rows of ``grad_input``, its experts' ``grad_weight``."""

GROUPED_WEIGHT_GRAD_OPTIONS = [
    # (inputᵀ (K, S), grad_output (S, N), offs) -> (E, K, N), grouped along s
    AxisOption((Shard(1),), (Shard(0), R, R)),
    AxisOption((Shard(2),), (R, Shard(1), R)),
    AxisOption((P,), (P, R, R)),
    AxisOption((P,), (R, P, R)),
]
"""One-axis options of ``aten._grouped_mm`` on two 2-D operands: ``ks,sn->ekn``, the groups
cutting the contraction ``s``, which therefore stays whole."""

SPLIT_EXPERTS_WEIGHT_GRAD = AxisOption((Shard(0),), (R, R, R))
"""Experts split: each device's experts' products, from their rows only (a local call)."""


def _fixed(options: list[AxisOption]) -> Callable[[OpCall], list[AxisOption]]:
    return lambda call: options


def _grouped_mm(call: OpCall, split_experts: bool = True) -> list[Strategy]:
    """``aten._grouped_mm(self, mat2, offs=None, bias=None, out_dtype=None)``: the forms an MoE
    layer and its backward call, with every split the CPU kernel accepts."""
    if call.arg(2, "offs") is None or call.arg(3, "bias") is not None:
        return []
    a, b = call.inputs[0], call.inputs[1]
    if len(a.shape) == 2 and len(b.shape) == 3:
        options = [*GROUPED_MM_OPTIONS, *[SPLIT_EXPERTS] * split_experts]
    elif len(a.shape) == 2 and len(b.shape) == 2:
        options = [*GROUPED_WEIGHT_GRAD_OPTIONS, *[SPLIT_EXPERTS_WEIGHT_GRAD] * split_experts]
    else:
        return []
    candidates = expand([all_replicated(call), *options], len(call.mesh_shape))
    return [s for s in candidates if _aligned(s, call)]


def _aligned(strategy: Strategy, call: OpCall) -> bool:
    """Whether every matrix keeps the strides ``aten._grouped_mm`` needs on each device: a split
    product dim (one of the last two) must stay a multiple of 16 bytes. Splitting the experts
    keeps every stride: a device's rows (or columns of ``inputᵀ``) start a whole number of
    rows into the matrix, as aligned as the matrix itself."""
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


def is_grouped_product(target: object) -> bool:
    """Whether ``target`` is one of the grouped products this module has rules for."""
    return target is aten._grouped_mm.default or target in (transformers_ops() or ())


def register(rules: RuleRegistry, *, split_experts: bool = True) -> None:
    """The grouped products' rules on ``rules``; ``split_experts=False`` leaves out the
    strategies that split the experts (to compare a plan with and without them)."""
    rules.register(aten._grouped_mm.default)(
        functools.partial(_grouped_mm, split_experts=split_experts)
    )
    ops = transformers_ops()
    if ops is not None:
        forward, backward = ops
        extra = [SPLIT_EXPERTS] * split_experts
        rules.register(forward)(_fixed([*GROUPED_MM_OPTIONS, *extra]))
        extra = [SPLIT_EXPERTS_BACKWARD] * split_experts
        rules.register(backward)(_fixed([*GROUPED_MM_BACKWARD_OPTIONS, *extra]))


# -- experts split: what each device calls ------------------------------------------------------


def local_call(call: OpCall, strategy: Strategy, coordinate: Coordinate) -> LocalCall | None:
    """What the device at ``coordinate`` calls for its piece of a grouped product whose experts
    ``strategy`` splits (:func:`experts_spec` Shard(0)); None for every other strategy, which
    runs the op itself on the local pieces."""
    spec = experts_spec(call, strategy)
    if spec is None or Shard(0) not in spec:
        return None
    function: Callable[..., Any]
    if call.target is aten._grouped_mm.default:
        three_d = len(call.inputs[1].shape) == 3
        function = local_experts_grouped_mm if three_d else local_experts_weight_grad
    elif call.target is _loaded_transformers_ops()[0]:
        function = local_experts_fallback
    else:
        function = local_experts_fallback_backward
    return LocalCall(function, shard_index(spec, 0, call.mesh_shape, coordinate))


def experts_spec(call: OpCall, strategy: Strategy) -> Spec | None:
    """The spec ``strategy`` gives the tensor of a grouped product ``call`` that holds one
    entry per expert on dim 0: the stacked weights, or the 2-D x 2-D form's output (the
    weights' gradient). None for a call that is not a grouped product."""
    if not is_grouped_product(call.target):
        return None
    if call.target is aten._grouped_mm.default and len(call.inputs[1].shape) == 2:
        return strategy.outputs[0]
    return strategy.inputs[1]


def expert_rows(offs: torch.Tensor, piece: int, pieces: int) -> tuple[int, int, torch.Tensor]:
    """The rows ``[start, stop)`` routed to the experts of piece ``piece`` of ``pieces`` (each
    piece holds ``E / pieces`` consecutive experts), and those experts' offsets counted from
    ``start``. Reads two offsets back from the device: the counts change every step."""
    count = offs.shape[0] // pieces
    first = piece * count
    start = int(offs[first - 1]) if first else 0
    stop = int(offs[first + count - 1])
    return start, stop, offs[first : first + count] - start


def _placed(rows: torch.Tensor, total: int, start: int) -> torch.Tensor:
    """``rows`` from row ``start`` of ``total`` rows of zeros."""
    placed = rows.new_zeros((total, *rows.shape[1:]))
    placed[start : start + rows.shape[0]] = rows
    return placed


def local_experts_grouped_mm(
    piece: int,
    pieces: int,
    input: torch.Tensor,
    mat2: torch.Tensor,
    offs: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``aten._grouped_mm(input, mat2, offs)``, (S, K) x (E, K, N), on a device whose ``mat2``
    holds piece ``piece`` of ``pieces`` of the experts: their rows' products, zeros elsewhere."""
    start, stop, local = expert_rows(offs, piece, pieces)
    rows = aten._grouped_mm.default(input[start:stop], mat2, local, bias, out_dtype)
    return _placed(rows, input.shape[0], start)


def local_experts_weight_grad(
    piece: int,
    pieces: int,
    input: torch.Tensor,
    mat2: torch.Tensor,
    offs: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``aten._grouped_mm(input, mat2, offs)``, (K, S) x (S, N) -> (E, K, N), for piece ``piece``
    of ``pieces`` of the experts: their products from their columns of ``input`` and rows of
    ``mat2``."""
    start, stop, local = expert_rows(offs, piece, pieces)
    return aten._grouped_mm.default(input[:, start:stop], mat2[start:stop], local, bias, out_dtype)


def local_experts_fallback(
    piece: int, pieces: int, input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor
) -> torch.Tensor:
    """``transformers::grouped_mm_fallback`` on a device whose ``weight`` holds piece ``piece``
    of ``pieces`` of the experts: their rows' products, zeros elsewhere."""
    forward, _ = _loaded_transformers_ops()
    start, stop, local = expert_rows(offs, piece, pieces)
    rows = forward(input[start:stop], weight, local)
    return _placed(rows, input.shape[0], start)


def local_experts_fallback_backward(
    piece: int,
    pieces: int,
    input: torch.Tensor,
    weight: torch.Tensor,
    offs: torch.Tensor,
    grad_output: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``transformers::grouped_mm_fallback_backward`` for piece ``piece`` of ``pieces`` of the
    experts: ``grad_input`` on their rows (zeros elsewhere) and their ``grad_weight``."""
    _, backward = _loaded_transformers_ops()
    start, stop, local = expert_rows(offs, piece, pieces)
    grad_rows, grad_weight = backward(input[start:stop], weight, local, grad_output[start:stop])
    return _placed(grad_rows, input.shape[0], start), grad_weight


def _loaded_transformers_ops() -> tuple[Callable[..., Any], Callable[..., Any]]:
    ops = transformers_ops()
    assert ops is not None, "a program calls transformers' grouped products: they are loaded"
    return ops  # type: ignore[return-value]
