"""Groups of ATen ops that several parts of fxpar treat alike."""

from __future__ import annotations

import torch

aten = torch.ops.aten

#: Fused scaled-dot-product attention kernels: (q, k, v, ...) -> (out, logsumexp, ...).
ATTENTION_FORWARD = (
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
)

#: Their backward kernels: (grad_out, q, k, v, out, logsumexp, ...) -> (dq, dk, dv, ...).
ATTENTION_BACKWARD = (
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    aten._scaled_dot_product_flash_attention_backward.default,
    aten._scaled_dot_product_efficient_attention_backward.default,
    aten._scaled_dot_product_cudnn_attention_backward.default,
)
