"""Neural-network ops: softmax, normalization, embedding, losses, convolution, pooling and
attention, with their backward ops.

Most shard only their "batch-like" dims (those the op treats independently). Every backward op
here is linear in the incoming gradient, so a partial gradient with replicated saved tensors
gives partial results; parameter gradients summed over a sharded batch are partial.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from fxpar.ir.aten_ops import ATTENTION_BACKWARD, ATTENTION_FORWARD
from fxpar.rules.registry import AxisOption, OpCall, RuleRegistry

aten = torch.ops.aten
R, P = Replicate(), Partial()


def _linear_in_first(call: OpCall) -> AxisOption:
    """Partial incoming gradient, everything else replicated: every output partial."""
    outputs = tuple(None if o is None else P for o in call.outputs)
    return AxisOption(outputs, (P,) + (R,) * (len(call.inputs) - 1))


def _same_dims(call: OpCall, dims: range | list[int]) -> list[AxisOption]:
    """Shard dim ``d`` of every input and output that has it at the op's size."""
    reference = call.inputs[0].shape
    options = []
    for d in dims:

        def place(shape: tuple[object, ...], d: int = d) -> Placement:
            return Shard(d) if len(shape) > d and shape[d] == reference[d] else R

        inputs = tuple(place(m.shape) for m in call.inputs)
        outputs = tuple(None if o is None else place(o.shape) for o in call.outputs)
        options.append(AxisOption(outputs, inputs))
    return options


def _softmax(call: OpCall) -> list[AxisOption]:
    rank = len(call.inputs[0].shape)
    backward = len(call.inputs) == 2  # (grad_output, output, dim, dtype)
    dim = call.arg(2, "dim") if backward else call.arg(1, "dim")
    dim = dim + rank if dim < 0 else dim
    options = _same_dims(call, [d for d in range(rank) if d != dim])
    if backward:  # linear in the gradient
        options.append(_linear_in_first(call))
    return options


def _layer_norm(call: OpCall) -> list[AxisOption]:
    rank = len(call.inputs[0].shape)
    normalized = len(call.arg(1, "normalized_shape"))
    options = []
    for d in range(rank - normalized):
        # input -> (out, mean, rstd); weight and bias replicated.
        inputs = (Shard(d),) + (R,) * (len(call.inputs) - 1)
        options.append(
            AxisOption(tuple(None if o is None else Shard(d) for o in call.outputs), inputs)
        )
    return options


def _layer_norm_backward(call: OpCall) -> list[AxisOption]:
    # (grad_out, input, normalized_shape, mean, rstd, weight?, bias?, mask) -> (gi, gw?, gb?)
    rank = len(call.inputs[0].shape)
    normalized = len(call.arg(2, "normalized_shape"))
    activations = 4  # grad_out, input, mean, rstd come first among the tensor inputs
    options = []
    for d in range(rank - normalized):
        inputs = (Shard(d),) * activations + (R,) * (len(call.inputs) - activations)
        outputs = (Shard(d), *(None if o is None else P for o in call.outputs[1:]))
        options.append(AxisOption(outputs, inputs))
    options.append(_linear_in_first(call))
    return options


def _embedding(call: OpCall) -> list[AxisOption]:
    indices = call.inputs[1]
    options = [AxisOption((Shard(d),), (R, Shard(d))) for d in range(len(indices.shape))]
    options.append(AxisOption((Shard(len(indices.shape)),), (Shard(1), R)))
    return options


def _embedding_backward(call: OpCall) -> list[AxisOption]:
    grad, indices = call.inputs
    options = [AxisOption((P,), (Shard(d), Shard(d))) for d in range(len(indices.shape))]
    options.append(AxisOption((Shard(1),), (Shard(len(grad.shape) - 1), R)))
    options.append(_linear_in_first(call))
    return options


def _nll_loss(call: OpCall) -> list[AxisOption]:
    # (self [N, C], target [N], weight?, reduction, ignore_index) -> (loss, total_weight)
    if len(call.inputs[0].shape) != 2:
        return []
    reduction = call.arg(3, "reduction", 1)
    rest = (R,) * (len(call.inputs) - 2)
    if reduction == 2:  # sum: per-sample terms and valid counts add up over the batch
        return [AxisOption((P, P), (Shard(0), Shard(0), *rest))]
    if reduction == 0:  # none: per-sample losses
        return [AxisOption((Shard(0), R), (Shard(0), Shard(0), *rest))]
    return []


def _nll_loss_backward(call: OpCall) -> list[AxisOption]:
    # (grad_out, self, target, weight?, reduction, ignore_index, total_weight) -> grad_self
    if len(call.inputs[1].shape) != 2:
        return [_linear_in_first(call)]
    reduction = call.arg(4, "reduction", 1)
    options = [_linear_in_first(call)]
    if reduction in (0, 2):
        grad_placement: Placement = Shard(0) if reduction == 0 else R
        weights = (R,) * (len(call.inputs) - 3)  # weight? and total_weight
        options.append(AxisOption((Shard(0),), (grad_placement, Shard(0), Shard(0), *weights)))
    return options


def _convolution(call: OpCall) -> list[AxisOption]:
    # (input, weight, bias?, stride, padding, dilation, transposed, output_padding, groups)
    has_bias = len(call.inputs) == 3
    bias: tuple[Placement, ...] = (R,) if has_bias else ()
    options = [AxisOption((Shard(0),), (Shard(0), R, *bias))]
    if call.arg(8, "groups", 1) == 1 and not call.arg(6, "transposed", False):
        out_bias: tuple[Placement, ...] = (Shard(0),) if has_bias else ()
        options.append(AxisOption((Shard(1),), (R, Shard(0), *out_bias)))
        partial_bias: tuple[Placement, ...] = (P,) if has_bias else ()
        options.append(AxisOption((P,), (Shard(1), Shard(1), *partial_bias)))
    return options


def _convolution_backward(call: OpCall) -> list[AxisOption]:
    # (grad_out, input, weight, bias_sizes, ..., output_mask) -> (gi, gw, gb)
    def outs(*placements: Placement) -> tuple[Placement | None, ...]:
        return tuple(
            None if o is None else p for o, p in zip(call.outputs, placements, strict=True)
        )

    options = [AxisOption(outs(Shard(0), P, P), (Shard(0), Shard(0), R))]
    if call.arg(9, "groups", 1) == 1 and not call.arg(7, "transposed", False):
        options.append(AxisOption(outs(P, Shard(0), Shard(0)), (Shard(1), R, Shard(0))))
    options.append(_linear_in_first(call))
    return options


def _batch_norm(call: OpCall) -> list[AxisOption]:
    # Training statistics span the batch: only channels may be sharded.
    # (input, weight?, bias?, running_mean, running_var, ...) -> (out, mean, rstd, rm, rv)
    inputs = (Shard(1),) + (Shard(0),) * (len(call.inputs) - 1)
    outputs = tuple(
        None if o is None else (Shard(1) if i == 0 else Shard(0))
        for i, o in enumerate(call.outputs)
    )
    return [AxisOption(outputs, inputs)]


def _batch_norm_backward(call: OpCall) -> list[AxisOption]:
    # (grad_out, input, weight?, running_mean?, running_var?, save_mean?, save_invstd?, ...)
    inputs = (Shard(1), Shard(1)) + (Shard(0),) * (len(call.inputs) - 2)
    outputs = tuple(
        None if o is None else (Shard(1) if i == 0 else Shard(0))
        for i, o in enumerate(call.outputs)
    )
    return [AxisOption(outputs, inputs), _linear_in_first(call)]


def _pooling(call: OpCall) -> list[AxisOption]:
    # Batch and channel dims are pooled independently.
    leading = len(call.inputs[0].shape) - 2
    options = _same_dims(call, range(leading))
    if call.target in _POOL_BACKWARD:
        options.append(_linear_in_first(call))
    return options


def _attention(call: OpCall) -> list[AxisOption]:
    """(q, k, v, ..., attn_mask?) -> (out, logsumexp, ...), and the backward, whose tensor
    inputs are (grad_out, q, k, v, out, logsumexp, attn_mask?).

    Batch and heads are independent. With grouped-query attention k and v have fewer heads;
    splitting every head dim in the same number of pieces keeps each query head with its key
    and value head. A mask that broadcasts along a dim stays whole there."""
    backward = call.target in ATTENTION_BACKWARD
    query = call.inputs[1] if backward else call.inputs[0]
    per_head = 6 if backward else 3  # inputs laid out by (batch, head, ...)
    options = []
    for d in range(len(query.shape) - 2):
        inputs: list[Placement] = []
        for index, meta in enumerate(call.inputs):
            if index < per_head or meta.shape[d] == query.shape[d]:
                inputs.append(Shard(d))
            elif meta.shape[d] == 1:
                inputs.append(R)
            else:
                break
        else:
            outputs = tuple(None if o is None else Shard(d) for o in call.outputs)
            options.append(AxisOption(outputs, tuple(inputs)))
    if backward:
        options.append(_linear_in_first(call))
    return options


_POOL_BACKWARD = (
    aten.max_pool2d_with_indices_backward.default,
    aten.avg_pool2d_backward.default,
    aten._adaptive_avg_pool2d_backward.default,
)


def register(rules: RuleRegistry) -> None:
    rules.register(aten._softmax, aten._safe_softmax, aten._log_softmax,
                   aten._softmax_backward_data,
                   aten._log_softmax_backward_data)(_softmax)  # fmt: skip
    rules.register(aten.native_layer_norm)(_layer_norm)
    rules.register(aten.native_layer_norm_backward)(_layer_norm_backward)
    rules.register(aten.embedding)(_embedding)
    rules.register(aten.embedding_dense_backward)(_embedding_backward)
    rules.register(aten.nll_loss_forward)(_nll_loss)
    rules.register(aten.nll_loss_backward)(_nll_loss_backward)
    rules.register(aten.convolution)(_convolution)
    rules.register(aten.convolution_backward)(_convolution_backward)
    rules.register(aten._native_batch_norm_legit_functional)(_batch_norm)
    rules.register(aten.native_batch_norm_backward)(_batch_norm_backward)
    rules.register(aten.max_pool2d_with_indices, aten.avg_pool2d, aten._adaptive_avg_pool2d,
                   *_POOL_BACKWARD)(_pooling)  # fmt: skip
    rules.register(*ATTENTION_FORWARD, *ATTENTION_BACKWARD)(_attention)
