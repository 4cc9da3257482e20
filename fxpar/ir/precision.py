"""Mixed precision as a capture-time rewrite of the training step.

:class:`MixedPrecision` says which dtypes the step computes and reduces in (the fields and
defaults of FSDP2's ``MixedPrecisionPolicy``). Capture applies it while tracing, so the Program
it returns already computes in those dtypes and nothing downstream needs to know about a policy:

- every floating-point parameter (the master copy, which the optimizer updates and which is
  stored sharded as the plan says) is read by the forward through one cast to ``param_dtype``;
  autograd differentiates that cast, so the parameter's gradient comes out in the master's
  dtype. The cast is marked :attr:`~fxpar.ir.CastRole.PARAMETER`, which makes the planner cast
  the parameter where it is stored: an all-gather moves ``param_dtype`` bytes;
- the gradient flowing back through that cast goes to ``reduce_dtype`` first
  (:attr:`~fxpar.ir.CastRole.TO_REDUCE`, which keeps a partial sum partial through it) and then
  to the master's dtype (:attr:`~fxpar.ir.CastRole.FROM_REDUCE`, which takes no partial sum):
  whichever plan the solver picks, a gradient is summed over devices in ``reduce_dtype``;
- floating-point model inputs are cast to ``param_dtype`` (``cast_forward_inputs``), floating
  outputs of the model to ``output_dtype`` when one is given, and the loss is returned as a
  float32 tensor (its value as precise as the dtype it was computed in: a loss computed in
  ``param_dtype``, such as one a Hugging Face model computes itself from its logits, is
  bf16-rounded);
- buffers keep their dtype, and so do the parameters of a module that holds floating-point
  buffers (BatchNorm's weight and bias beside its running statistics): as under
  ``torch.autocast`` on CPU, normalization with statistics runs with float32 affine
  parameters on ``param_dtype`` activations, and the statistics accumulate in float32.
"""

from __future__ import annotations

from collections.abc import Iterable, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx.traceback as fx_traceback
from torch import nn
from torch.utils import _pytree as pytree

from fxpar import ir
from fxpar.errors import FxparError

CAST_KEY = "fxpar.cast"
"""The key of the ``custom`` node metadata naming a cast's :class:`~fxpar.ir.CastRole` while
tracing; capture turns it into a :class:`~fxpar.ir.PrecisionCast` annotation."""


@dataclass(frozen=True)
class MixedPrecision:
    """Compute in ``param_dtype``, keep float32 master weights, reduce gradients in
    ``reduce_dtype``.

    Args:
        param_dtype: the dtype the forward and backward compute in.
        reduce_dtype: the dtype gradients are summed over devices in; None: ``param_dtype``
            (as FSDP2).
        output_dtype: cast the model's floating-point outputs to this dtype (float32 for
            ``loss_fn`` to compute the loss in float32; a loss the model computes inside its
            forward stays in ``param_dtype``); None leaves them in ``param_dtype``.
        cast_forward_inputs: cast floating-point model inputs to ``param_dtype`` (loss
            targets are left alone).
    """

    param_dtype: torch.dtype = torch.bfloat16
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for field_name in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(self, field_name)
            if value is None and field_name != "param_dtype":
                continue
            if not isinstance(value, torch.dtype) or not value.is_floating_point:
                raise FxparError(
                    f"MixedPrecision({field_name}={value!r}): expected a floating-point "
                    "torch.dtype such as torch.bfloat16, torch.float16 or torch.float32"
                )
        if not isinstance(self.cast_forward_inputs, bool):
            raise FxparError(
                f"MixedPrecision(cast_forward_inputs={self.cast_forward_inputs!r}): expected a bool"
            )

    @property
    def reduction_dtype(self) -> torch.dtype:
        """The dtype gradients are summed in."""
        return self.reduce_dtype if self.reduce_dtype is not None else self.param_dtype


def check_policy(policy: object) -> MixedPrecision | None:
    """``policy`` if it is a :class:`MixedPrecision` or None; a clear error otherwise."""
    if policy is None or isinstance(policy, MixedPrecision):
        return policy
    raise FxparError(
        f"mixed_precision must be an fxpar.MixedPrecision (or None), got "
        f"{type(policy).__name__}: write mixed_precision=fxpar.MixedPrecision("
        "param_dtype=torch.bfloat16, reduce_dtype=torch.float32)"
    )


def kept_in_own_dtype(model: nn.Module) -> frozenset[str]:
    """Names of the parameters that stay in their dtype: those of modules holding
    floating-point buffers (normalization with running statistics)."""
    kept = set()
    for prefix, module in model.named_modules():
        if any(b.is_floating_point() for b in module.buffers(recurse=False)):
            for name, _ in module.named_parameters(prefix=prefix, recurse=False):
                kept.add(name)
    return frozenset(kept)


def compute_parameter(policy: MixedPrecision, master: torch.Tensor) -> torch.Tensor:
    """``master`` as the forward reads it: cast to ``param_dtype`` if it is floating point."""
    if not master.is_floating_point() or master.dtype == policy.param_dtype:
        return master
    result: torch.Tensor = _ComputeCopy.apply(master, policy.param_dtype, policy.reduction_dtype)
    return result


def cast_inputs(policy: MixedPrecision, values: Any) -> Any:
    """``values`` (a pytree) with floating-point tensors cast to ``param_dtype``, when the
    policy casts forward inputs."""
    if not policy.cast_forward_inputs:
        return values
    return _cast_floating(values, policy.param_dtype)


def cast_outputs(policy: MixedPrecision, output: Any) -> Any:
    """The model's ``output`` with floating-point tensors cast to ``output_dtype``, if set."""
    if policy.output_dtype is None:
        return output
    if isinstance(output, torch.Tensor):
        return _cast_floating(output, policy.output_dtype)
    if isinstance(output, MutableMapping) and not _is_pytree_node(output):
        # A Hugging Face ModelOutput is a mapping that pytree may not know: cast in place.
        for key, value in list(output.items()):
            output[key] = _cast_floating(value, policy.output_dtype)
        return output
    return _cast_floating(output, policy.output_dtype)


def reported_loss(loss: torch.Tensor) -> torch.Tensor:
    """The loss in float32, whatever dtype it was computed in."""
    return loss.to(torch.float32) if loss.is_floating_point() else loss


def cast_roles(nodes: Iterable[Any]) -> None:
    """Turn the traced role tags of ``nodes`` into :class:`~fxpar.ir.PrecisionCast`."""
    for node in nodes:
        role = node.meta.get("custom", {}).get(CAST_KEY)
        if role is not None:
            ir.annotate(node, ir.PrecisionCast(ir.CastRole(role)))


def _cast_floating(values: Any, dtype: torch.dtype) -> Any:
    def cast(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.to(dtype)
        return value

    return pytree.tree_map(cast, values)


def _is_pytree_node(value: Any) -> bool:
    return type(value) in pytree.SUPPORTED_NODES


class _ComputeCopy(torch.autograd.Function):
    """``master.to(param_dtype)``, whose backward sends the gradient through ``reduce_dtype``
    on its way back to the master's dtype, each cast tagged with its role."""

    @staticmethod
    def forward(
        ctx: Any, master: torch.Tensor, param_dtype: torch.dtype, reduce_dtype: torch.dtype
    ) -> torch.Tensor:
        ctx.master_dtype, ctx.reduce_dtype = master.dtype, reduce_dtype
        with fx_traceback.annotate({CAST_KEY: ir.CastRole.PARAMETER.value}):
            return master.to(param_dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        if grad.dtype != ctx.reduce_dtype:
            with fx_traceback.annotate({CAST_KEY: ir.CastRole.TO_REDUCE.value}):
                grad = grad.to(ctx.reduce_dtype)
        if grad.dtype != ctx.master_dtype:
            with fx_traceback.annotate({CAST_KEY: ir.CastRole.FROM_REDUCE.value}):
                grad = grad.to(ctx.master_dtype)
        return grad, None, None
