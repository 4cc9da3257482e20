"""FLOP counts of ATen ops, computed from shapes alone.

Conventions: a multiply-add is 2 FLOPs, so a ``[m, k] @ [k, n]`` product is ``2·m·k·n``.

- Exact counts, by formula: the matmul family (``mm``, ``addmm``, ``bmm``, ``baddbmm``, ``mv``,
  ``dot``), convolution and its backward, and scaled-dot-product attention (every fused kernel
  and its backward). Attention counts the two products ``QKᵀ`` and ``PV`` in full (a causal mask
  does not halve them) and the backward as twice the forward, the algorithmic cost without the
  recomputation a flash kernel adds.
- Views, copies, creation and gathers count zero FLOPs.
- Everything else (pointwise ops, reductions, normalizations, losses) counts one FLOP per
  element of its largest tensor argument or result: an estimate, small beside the products.

Formulas receive the node's arguments with every tensor replaced by its
:class:`~fxpar.ir.TensorMeta`, and return an int or a sympy expression. A
:class:`FlopRegistry` is an explicit object: start from :func:`default_flop_registry` and register
formulas for your own ops.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from fxpar.ir import Size, TensorMeta, product, total
from fxpar.ir.aten_ops import ATTENTION_BACKWARD, ATTENTION_FORWARD
from fxpar.ir.op_table import OpTable

aten = torch.ops.aten

FlopFormula = Callable[..., Size]
"""``formula(outputs, *args, **kwargs) -> flops``: the op's results, then its arguments, with
every tensor given as a TensorMeta."""


class FlopRegistry:
    """FLOP formulas by ATen overload or overload packet (which covers all its overloads)."""

    def __init__(self) -> None:
        self._formulas: OpTable[FlopFormula] = OpTable()
        self._free: OpTable[bool] = OpTable()

    def register(self, *ops: object) -> Callable[[FlopFormula], FlopFormula]:
        """Decorator: ``formula`` counts the FLOPs of each of ``ops``."""
        return self._formulas.register(*ops)

    def register_free(self, *ops: object) -> None:
        """Declare ``ops`` to do no arithmetic (data movement, creation)."""
        self._free.register(*ops)(True)

    def formula(self, target: object) -> FlopFormula | None:
        return self._formulas.lookup(target)

    def is_free(self, target: object) -> bool:
        return bool(self._free.lookup(target))

    def copy(self) -> FlopRegistry:
        other = FlopRegistry()
        other._formulas = self._formulas.copy()
        other._free = self._free.copy()
        return other


def _matmul(m: Size, k: Size, n: Size, batch: Size = 1) -> Size:
    return product((2, batch, m, k, n))


def _mm(out: Any, a: TensorMeta, b: TensorMeta, *_: Any, **__: Any) -> Size:
    m, k = a.shape
    return _matmul(m, k, b.shape[1])


def _addmm(out: Any, bias: TensorMeta, a: TensorMeta, b: TensorMeta, *_: Any, **__: Any) -> Size:
    return _mm(out, a, b)


def _bmm(out: Any, a: TensorMeta, b: TensorMeta, *_: Any, **__: Any) -> Size:
    batch, m, k = a.shape
    return _matmul(m, k, b.shape[2], batch)


def _baddbmm(out: Any, bias: TensorMeta, a: TensorMeta, b: TensorMeta, *_: Any, **__: Any) -> Size:
    return _bmm(out, a, b)


def _mv(out: Any, a: TensorMeta, x: TensorMeta, *_: Any, **__: Any) -> Size:
    return product((2, *a.shape))


def _dot(out: Any, a: TensorMeta, b: TensorMeta, *_: Any, **__: Any) -> Size:
    return product((2, a.numel))


def _grouped_mm(out: Any, a: TensorMeta, b: TensorMeta, *_: Any, **__: Any) -> Size:
    """A grouped product: every row of ``a`` (S, K) times its group's (K, N) matrix of ``b``
    (E, K, N), or (the weight gradient's form) ``a`` (K, S) times ``b`` (S, N) with the S rows
    split into groups: 2·S·K·N either way, however the rows fall into groups."""
    rows_or_k, inner = a.shape
    return _matmul(rows_or_k, inner, b.shape[-1])


def _grouped_mm_backward(
    out: Any, a: TensorMeta, b: TensorMeta, offs: Any, grad: TensorMeta, *_: Any, **__: Any
) -> Size:
    """Both gradients of the grouped product of ``a`` (S, K) and ``b`` (E, K, N): two products
    the size of the forward."""
    return product((2, _grouped_mm(out, a, b)))


def _conv_flops(x: TensorMeta, weight: TensorMeta, out: TensorMeta, transposed: bool) -> Size:
    """One direction of a convolution: each output (input, if transposed) element reads a
    ``weight.shape[1] × kernel`` window with one multiply-add per weight."""
    window = product(weight.shape[1:])
    elements = x.numel if transposed else out.numel
    return product((2, elements, window))


def _convolution(
    out: tuple[TensorMeta],
    x: TensorMeta,
    weight: TensorMeta,
    bias: Any,
    stride: Any,
    padding: Any,
    dilation: Any,
    transposed: bool,
    *_: Any,
    **__: Any,
) -> Size:
    return _conv_flops(x, weight, out[0], transposed)


def _convolution_backward(
    out: Any,
    grad_out: TensorMeta,
    x: TensorMeta,
    weight: TensorMeta,
    bias_sizes: Any,
    stride: Any,
    padding: Any,
    dilation: Any,
    transposed: bool,
    output_padding: Any,
    groups: int,
    output_mask: Sequence[bool],
    **__: Any,
) -> Size:
    # The input gradient is a transposed convolution of the same size as the forward, and the
    # weight gradient correlates input with output gradient over the same windows: each costs
    # exactly the forward's FLOPs. The bias gradient sums the output gradient.
    forward = _conv_flops(x, weight, grad_out, transposed)
    counts = [forward if output_mask[0] else 0, forward if output_mask[1] else 0]
    counts.append(grad_out.numel if output_mask[2] else 0)
    return total(counts)


def _attention(out: Any, q: TensorMeta, k: TensorMeta, v: TensorMeta, *_: Any, **__: Any) -> Size:
    *batch, length, head_dim = q.shape
    kv_length = k.shape[-2]
    value_dim = v.shape[-1]
    batch_heads = product(batch)
    return total(
        (
            _matmul(length, head_dim, kv_length, batch_heads),  # Q Kᵀ
            _matmul(length, kv_length, value_dim, batch_heads),  # P V
        )
    )


def _attention_backward(
    out: Any, grad_out: TensorMeta, q: TensorMeta, k: TensorMeta, v: TensorMeta, *_: Any, **__: Any
) -> Size:
    # dV = Pᵀ dO and dP = dO Vᵀ mirror P V; dQ = dS K and dK = dSᵀ Q mirror Q Kᵀ.
    return product((2, _attention(out, q, k, v)))


def default_flop_registry() -> FlopRegistry:
    """A fresh registry with fxpar's formulas for ATen ops."""
    registry = FlopRegistry()
    registry.register(aten.mm)(_mm)
    registry.register(aten.addmm)(_addmm)
    registry.register(aten.bmm)(_bmm)
    registry.register(aten.baddbmm)(_baddbmm)
    registry.register(aten.mv)(_mv)
    registry.register(aten.dot)(_dot)
    registry.register(aten.convolution)(_convolution)
    registry.register(aten.convolution_backward)(_convolution_backward)
    registry.register(*ATTENTION_FORWARD)(_attention)
    registry.register(*ATTENTION_BACKWARD)(_attention_backward)
    registry.register(aten._grouped_mm)(_grouped_mm)
    # Hugging Face transformers' grouped products (MoE experts), once its MoE module is loaded.
    namespace = torch.ops.transformers
    if hasattr(namespace, "grouped_mm_fallback_backward"):
        registry.register(namespace.grouped_mm_fallback)(_grouped_mm)
        registry.register(namespace.grouped_mm_fallback_backward)(_grouped_mm_backward)
    registry.register_free(
        # copies and layout changes
        aten.clone, aten._to_copy, aten.copy, aten.contiguous, aten.cat, aten.stack,
        aten.constant_pad_nd, aten.expand_copy, aten.permute_copy, aten.view_copy,
        aten.lift_fresh_copy, aten.slice_scatter, aten.select_scatter, aten.as_strided_scatter,
        # gathers
        aten.embedding, aten.index_select, aten.gather, aten.index,
        # creation
        aten.zeros, aten.ones, aten.full, aten.empty, aten.empty_strided, aten.arange,
        aten.zeros_like, aten.ones_like, aten.full_like, aten.empty_like, aten.new_zeros,
        aten.new_ones, aten.new_full, aten.new_empty, aten.scalar_tensor,
    )  # fmt: skip
    return registry
