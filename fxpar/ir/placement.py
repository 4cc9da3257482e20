"""Placing a program on the device it runs on.

fxpar captures and plans on fake CPU tensors, whatever the cluster's devices: the graph, the
plan and the per-rank programs are the same for a CPU mesh and a GPU one, and a GPU plan can be
made on a machine without a GPU. What ties a graph to the CPU is small and local:

- factory calls name a device (``aten.arange(..., device=cpu)``, ``aten.ones``,
  ``aten.scalar_tensor``, ``aten._to_copy(..., device=cpu)``);
- tensors the graph holds as attributes (lifted constants) live on the CPU;
- a few kernels exist for one device only: scaled dot-product attention is traced as
  ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward.

:func:`place` gives the copy of a GraphModule that runs on another device: every device a
call names becomes that device, attributes move there, and the CPU-only attention kernels
become :func:`attention` and :func:`attention_backward`, which compute the same values with
the device's own kernels (for 16-bit inputs without a mask, cuDNN's attention where eager
PyTorch takes it and CUDA's flash attention otherwise; its memory-efficient attention for the
rest, and the plain formula where none applies) and hand
back tensors of exactly the shapes and strides the CPU kernels give, so every view the
program takes of them holds. A program already on its device is returned as it is.
"""

from __future__ import annotations

import copy
import functools
import math
import weakref
from typing import Any

import torch
import torch.fx as fx

aten = torch.ops.aten

_placed: weakref.WeakKeyDictionary[
    fx.GraphModule, dict[torch.device, tuple[str, fx.GraphModule | None]]
] = weakref.WeakKeyDictionary()
"""Each module's placed copies by device, with the code each was made from (a pass that
changes the module in place makes a new copy on the next call)."""


def as_device(device: torch.device | str) -> torch.device:
    return device if isinstance(device, torch.device) else torch.device(device)


def place(graph_module: fx.GraphModule, device: torch.device | str) -> fx.GraphModule:
    """The copy of ``graph_module`` that runs on ``device`` (module docstring), made once per
    module and device; ``graph_module`` itself where nothing in it names another device."""
    device = as_device(device)
    copies = _placed.setdefault(graph_module, {})
    made = copies.get(device)
    if made is None or made[0] is not graph_module.code:
        placed = _place(graph_module, device)
        # A program already on its device is kept as None: a value that held the module
        # itself would keep its weak key alive, and every dropped program with it.
        made = copies[device] = (graph_module.code, None if placed is graph_module else placed)
    return graph_module if made[1] is None else made[1]


def device_of(tensors: Any) -> torch.device:
    """The device of the first tensor of ``tensors`` (the CPU if none)."""
    for value in tensors:
        if isinstance(value, torch.Tensor):
            return value.device
    return torch.device("cpu")


def devices_named(graph_module: fx.GraphModule) -> set[torch.device]:
    """Every device the calls of ``graph_module`` name, and those of its tensor attributes."""
    named: set[torch.device] = set()
    for node in graph_module.graph.nodes:
        if node.op == "call_function":
            fx.node.map_aggregate(
                (node.args, node.kwargs),
                lambda v: named.add(v) if isinstance(v, torch.device) else None,
            )
            if node.target in _TRANSLATED:
                named.add(torch.device("cpu"))
    for value in _tensor_attributes(graph_module).values():
        named.add(value.device)
    return named


def _place(graph_module: fx.GraphModule, device: torch.device) -> fx.GraphModule:
    if all(_same_device(named, device) for named in devices_named(graph_module)):
        return graph_module
    graph = copy.deepcopy(graph_module.graph)
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        node.args, node.kwargs = fx.node.map_aggregate(
            (node.args, node.kwargs),
            lambda v: device if isinstance(v, torch.device) else v,
        )
        if device.type != "cpu" and node.target in _TRANSLATED:
            node.target = _TRANSLATED[node.target]
    root = torch.nn.Module()
    for name, value in _tensor_attributes(graph_module).items():
        _set_attribute(root, name, value.to(device))
    for target in {n.target for n in graph.nodes if n.op in ("call_module", "get_attr")}:
        if not _has_attribute(root, target):
            _set_attribute(root, target, get_attribute(graph_module, target))
    placed = fx.GraphModule(root, graph, class_name=type(graph_module).__name__)
    placed.meta = dict(getattr(graph_module, "meta", {}))
    return placed


def _same_device(named: torch.device, device: torch.device) -> bool:
    if named.type != device.type:
        return False
    return named.index is None or device.index is None or named.index == device.index


def _tensor_attributes(graph_module: fx.GraphModule) -> dict[str, torch.Tensor]:
    found = {}
    for node in graph_module.graph.nodes:
        if node.op == "get_attr":
            value = get_attribute(graph_module, node.target)
            if isinstance(value, torch.Tensor):
                found[node.target] = value
    return found


def get_attribute(module: torch.nn.Module, target: str) -> Any:
    """``module``'s attribute at the dotted path ``target`` (a ``get_attr`` node's target:
    a constant, buffer or submodule)."""
    value: Any = module
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _has_attribute(module: torch.nn.Module, target: str) -> bool:
    try:
        get_attribute(module, target)
    except AttributeError:
        return False
    return True


def _set_attribute(module: torch.nn.Module, target: str, value: Any) -> None:
    *path, last = target.split(".")
    for part in path:
        if not hasattr(module, part):
            module.add_module(part, torch.nn.Module())
        module = getattr(module, part)
    if isinstance(value, torch.nn.Parameter):
        value = value.detach()
    if isinstance(value, torch.Tensor):
        module.register_buffer(last, value)
    else:
        setattr(module, last, value)


# -- scaled dot-product attention, off the CPU -----------------------------------------------


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``aten._scaled_dot_product_flash_attention_for_cpu`` on any device: the attention
    output and the log-sum-exp of each query's scores, of the CPU kernel's shapes and strides.
    Random dropout never reaches a program (capture draws random numbers ahead, see
    :mod:`fxpar.ir.rng`), so ``dropout_p`` is 0."""
    _check_no_dropout(dropout_p)
    expected = _cpu_layouts("forward", query, key, value, is_causal, attn_mask, scale)
    groups = query.shape[-3] // key.shape[-3]
    key, value = _repeat_heads(key, groups), _repeat_heads(value, groups)
    route = _route(query, key, attn_mask, is_causal)
    if route == "cudnn":
        output, logsumexp = _cudnn_forward(query, key, value, is_causal, scale)
    elif route == "flash":
        output, logsumexp = _flash_forward(query, key, value, is_causal, scale)
    elif route == "efficient":
        output, logsumexp, _, _ = aten._scaled_dot_product_efficient_attention.default(
            query, key, value, _bias(attn_mask, query, key), True, 0.0, is_causal, scale=scale
        )
        logsumexp = logsumexp[..., : query.shape[-2]]
    else:
        output, logsumexp = _math_attention(query, key, value, is_causal, attn_mask, scale)
    return _restride(output, expected[0]), _restride(logsumexp, expected[1])


def attention_backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    logsumexp: torch.Tensor,
    dropout_p: float,
    is_causal: bool,
    *,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``aten._scaled_dot_product_flash_attention_for_cpu_backward`` on any device: the
    gradients of the query, key and value, of the CPU kernel's shapes and strides."""
    _check_no_dropout(dropout_p)
    expected = _cpu_layouts("backward", query, key, value, is_causal, attn_mask, scale)
    groups = query.shape[-3] // key.shape[-3]
    whole_key, whole_value = _repeat_heads(key, groups), _repeat_heads(value, groups)
    route = _route(query, whole_key, attn_mask, is_causal)
    if route == "cudnn":
        grads = _cudnn_backward(
            grad_out, query, whole_key, whole_value, out, logsumexp, is_causal, scale
        )
    elif route == "flash":
        grads = _flash_backward(
            grad_out, query, whole_key, whole_value, out, logsumexp, is_causal, scale
        )
    elif route == "efficient":
        padded = -(-query.shape[-2] // 32) * 32
        logsumexp = torch.nn.functional.pad(logsumexp, (0, padded - logsumexp.shape[-1]))
        empty = torch.empty(0, dtype=torch.int64, device=query.device)
        bias = _bias(attn_mask, query, whole_key)
        grads = aten._scaled_dot_product_efficient_attention_backward.default(
            grad_out, query, whole_key, whole_value, bias, out, logsumexp.contiguous(),
            empty, empty, 0.0, [True, True, True, False], is_causal, scale=scale,
        )[:3]  # fmt: skip
    else:
        grads = _math_attention_backward(
            grad_out, query, whole_key, whole_value, out, logsumexp, is_causal, attn_mask, scale
        )
    grad_query, grad_key, grad_value = grads
    grad_key, grad_value = _sum_heads(grad_key, groups), _sum_heads(grad_value, groups)
    return (
        _restride(grad_query, expected[0]),
        _restride(grad_key, expected[1]),
        _restride(grad_value, expected[2]),
    )


def _check_no_dropout(dropout_p: float) -> None:
    if dropout_p:
        raise NotImplementedError(
            "attention with dropout inside the kernel cannot run off the CPU here: fxpar draws "
            "random numbers ahead of the step, so the capture refuses it"
        )


def _route(
    query: torch.Tensor, key: torch.Tensor, attn_mask: torch.Tensor | None, causal: bool
) -> str:
    """Which kernel computes the attention: a pure function of what both the forward and
    the backward see, so the two agree. The CUDA kernels are taken where they compute what
    the CPU kernel does: a causal mask of as many keys as queries (their alignments differ
    otherwise), an additive mask whose rows the memory-efficient kernel can read aligned."""
    if query.device.type != "cuda" or query.dtype == torch.float64:
        return "math"
    head = query.shape[-1]
    if head % 8 or (causal and query.shape[-2] != key.shape[-2]):
        return "math"
    if attn_mask is None and query.dtype in (torch.float16, torch.bfloat16) and head <= 256:
        return "cudnn" if _eager_takes_cudnn(query, key, causal) else "flash"
    if head <= 512 and (attn_mask is None or key.shape[-2] % 16 == 0):
        return "efficient"
    return "math"


def _flash_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    is_causal: bool,
    scale: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """CUDA's flash attention: the output and the log-sum-exp as (batch, heads, queries)."""
    output, logsumexp, *_ = aten._scaled_dot_product_flash_attention.default(
        query, key, value, 0.0, is_causal, False, scale=scale
    )
    return output, logsumexp


def _flash_backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    logsumexp: torch.Tensor,
    is_causal: bool,
    scale: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # Dense (not variable-length) batches pass no cumulative lengths; without dropout the
    # random seed and offset are never read.
    seed = torch.zeros(2, dtype=torch.uint64, device=query.device)
    offset = torch.zeros((), dtype=torch.uint64, device=query.device)
    grads = aten._scaled_dot_product_flash_attention_backward.default(
        grad_out, query, key, value, out, logsumexp.contiguous(), None, None,
        query.shape[-2], key.shape[-2], 0.0, is_causal, seed, offset, scale=scale,
    )  # fmt: skip
    return grads[0], grads[1], grads[2]


def _cudnn_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    is_causal: bool,
    scale: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cuDNN's attention: the output and the log-sum-exp as (batch, heads, queries)."""
    output, logsumexp, *_ = aten._scaled_dot_product_cudnn_attention.default(
        query, key, value, None, True, 0.0, is_causal, False, scale=scale
    )
    return output, logsumexp.squeeze(-1)


def _cudnn_backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    logsumexp: torch.Tensor,
    is_causal: bool,
    scale: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # Without dropout the random seed and offset are never read.
    unused = torch.zeros((), dtype=torch.int64, device=query.device)
    grads = aten._scaled_dot_product_cudnn_attention_backward.default(
        grad_out, query, key, value, out, logsumexp.unsqueeze(-1).contiguous(), unused, unused,
        None, None, None, query.shape[-2], key.shape[-2], 0.0, is_causal, scale=scale,
    )  # fmt: skip
    return grads[0], grads[1], grads[2]


def _eager_takes_cudnn(query: torch.Tensor, key: torch.Tensor, causal: bool) -> bool:
    """Whether eager PyTorch's attention would run cuDNN's kernel on these inputs (the fastest
    on recent GPUs), and cuDNN's kernels here give flash attention's values."""
    try:
        from torch.nn.attention import SDPBackend

        choice: Any = torch._fused_sdp_choice(query, key, key, None, 0.0, causal)
        cudnn: Any = SDPBackend.CUDNN_ATTENTION
        return int(choice) == int(cudnn) and _cudnn_agrees(query.device)
    except (AttributeError, RuntimeError, TypeError):
        return False


@functools.cache
def _cudnn_agrees(device: torch.device) -> bool:
    """Once per device: cuDNN's attention and its backward on a small causal case give what
    flash attention gives (any error, or another answer, and cuDNN is not used)."""
    generator = torch.Generator(device=device).manual_seed(0)
    q, k, v, grad = (
        torch.randn(1, 2, 64, 64, device=device, generator=generator, dtype=torch.bfloat16)
        for _ in range(4)
    )
    try:
        out, lse = _cudnn_forward(q, k, v, True, None)
        grads = _cudnn_backward(grad, q, k, v, out, lse, True, None)
        want, want_lse = _flash_forward(q, k, v, True, None)
        want_grads = _flash_backward(grad, q, k, v, want, want_lse, True, None)
    except RuntimeError:
        return False
    pairs = [(out, want), (lse, want_lse), *zip(grads, want_grads, strict=True)]
    return all(torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2) for a, b in pairs)


def _bias(mask: torch.Tensor | None, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor | None:
    """An attention mask as the additive bias of the query's dtype the efficient kernel takes,
    expanded to (batch, heads, queries, keys)."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=query.dtype, device=mask.device).masked_fill(
            ~mask, float("-inf")
        )
    shape = (*query.shape[:-1], key.shape[-2])
    return mask.to(query.dtype).expand(shape).contiguous()


def _repeat_heads(tensor: torch.Tensor, groups: int) -> torch.Tensor:
    return tensor if groups == 1 else tensor.repeat_interleave(groups, dim=-3)


def _sum_heads(grad: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return grad
    *lead, heads, length, width = grad.shape
    return grad.reshape(*lead, heads // groups, groups, length, width).sum(-3)


def _scores(
    query: torch.Tensor,
    key: torch.Tensor,
    is_causal: bool,
    mask: torch.Tensor | None,
    scale: float | None,
) -> tuple[torch.Tensor, float]:
    """The scaled scores in float32 (or float64), with the mask applied, and the scale."""
    factor = scale if scale is not None else 1.0 / math.sqrt(query.shape[-1])
    wide = torch.promote_types(query.dtype, torch.float32)
    scores = torch.matmul(query.to(wide), key.to(wide).transpose(-2, -1)) * factor
    if is_causal:
        rows, cols = scores.shape[-2:]
        allowed = torch.ones(rows, cols, dtype=torch.bool, device=scores.device).tril()
        scores = scores.masked_fill(~allowed, float("-inf"))
    if mask is not None:
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask.to(wide)
    return scores, factor


def _math_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    is_causal: bool,
    mask: torch.Tensor | None,
    scale: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    scores, _ = _scores(query, key, is_causal, mask, scale)
    logsumexp = torch.logsumexp(scores, dim=-1)
    weights = torch.exp(scores - logsumexp.unsqueeze(-1)).nan_to_num(0.0)
    output = torch.matmul(weights, value.to(weights.dtype)).to(query.dtype)
    return output, logsumexp.to(torch.promote_types(query.dtype, torch.float32))


def _math_attention_backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    logsumexp: torch.Tensor,
    is_causal: bool,
    mask: torch.Tensor | None,
    scale: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    scores, factor = _scores(query, key, is_causal, mask, scale)
    wide = scores.dtype
    weights = torch.exp(scores - logsumexp.to(wide).unsqueeze(-1)).nan_to_num(0.0)
    grad = grad_out.to(wide)
    grad_value = torch.matmul(weights.transpose(-2, -1), grad)
    grad_weights = torch.matmul(grad, value.to(wide).transpose(-2, -1))
    row = (grad * out.to(wide)).sum(-1, keepdim=True)
    grad_scores = weights * (grad_weights - row) * factor
    grad_query = torch.matmul(grad_scores, key.to(wide))
    grad_key = torch.matmul(grad_scores.transpose(-2, -1), query.to(wide))
    return grad_query.to(query.dtype), grad_key.to(key.dtype), grad_value.to(value.dtype)


def _cpu_layouts(
    which: str,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    is_causal: bool,
    mask: torch.Tensor | None,
    scale: float | None,
) -> tuple[torch.Tensor, ...]:
    """What the CPU kernel's ``which`` (``"forward"`` or ``"backward"``) outputs look like
    for these inputs: meta tensors from its meta function, kept by the inputs' layouts."""
    return _cpu_metas(which, _key(query), _key(key), _key(value), is_causal, _key(mask), scale)


def _key(tensor: torch.Tensor | None) -> tuple[Any, ...] | None:
    if tensor is None:
        return None
    return (tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)


@functools.lru_cache(maxsize=256)
def _cpu_metas(
    which: str,
    query: tuple[Any, ...],
    key: tuple[Any, ...],
    value: tuple[Any, ...],
    is_causal: bool,
    mask: tuple[Any, ...] | None,
    scale: float | None,
) -> tuple[torch.Tensor, ...]:
    def meta(described: tuple[Any, ...] | None) -> torch.Tensor | None:
        if described is None:
            return None
        shape, stride, dtype = described
        return torch.empty_strided(shape, stride, dtype=dtype, device="meta")

    q, k, v, m = meta(query), meta(key), meta(value), meta(mask)
    output, logsumexp = aten._scaled_dot_product_flash_attention_for_cpu.default(
        q, k, v, 0.0, is_causal, attn_mask=m, scale=scale
    )
    if which == "forward":
        return output, logsumexp
    return tuple(
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default(
            torch.empty_like(output),
            q,
            k,
            v,
            output,
            logsumexp,
            0.0,
            is_causal,
            attn_mask=m,
            scale=scale,
        )
    )


def _restride(tensor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``tensor`` with ``like``'s strides, copied only if they differ (its own dtype: the
    meta functions of some torch releases give another dtype than the kernel does)."""
    if tensor.stride() == like.stride():
        return tensor
    laid = torch.empty_strided(like.shape, like.stride(), dtype=tensor.dtype, device=tensor.device)
    return laid.copy_(tensor)


_TRANSLATED: dict[Any, Any] = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: attention,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: attention_backward,
}
"""The CPU-only kernels a captured program may call, and what runs them elsewhere."""


__all__ = [
    "as_device",
    "attention",
    "attention_backward",
    "device_of",
    "devices_named",
    "get_attribute",
    "place",
]
