"""The verifier: the invariants every Program satisfies after capture and after every pass.

1. The graph is well formed (``fx.Graph.lint``) and its placeholders and outputs match the
   signature: one placeholder per parameter, buffer and batch tensor; outputs are
   ``(loss, *gradients, *buffer_updates)``.
2. It is functional: every call is a non-mutating ATen op that draws no random numbers (random
   ops are random inputs, see :mod:`fxpar.rng`), ``getitem`` on a multi-output op, or
   symbolic-size arithmetic.
3. It is annotated: every node has a :class:`~fxpar.ir.Region`, every non-output node a
   :class:`~fxpar.ir.ValueMeta`.
4. Shapes are consistent: annotations agree with the traced example values, ``getitem`` reads an
   existing tensor output, the loss is a scalar, and each gradient and buffer update has its
   parameter's or buffer's shape and dtype.
5. Phases are ordered: no forward node reads a backward node.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from fxpar import ir
from fxpar.errors import VerificationError
from fxpar.ir.program import Program
from fxpar.ir.rng import draws_random_numbers


def verify(program: Program) -> Program:
    """Check ``program``'s invariants; raise VerificationError naming the first broken one."""
    graph = program.graph
    try:
        graph.lint()
    except Exception as error:
        raise VerificationError(f"malformed graph: {error}") from error
    _check_signature(program)
    for node in graph.nodes:
        _check_node(node)
    return program


def _fail(node: fx.Node, message: str) -> VerificationError:
    return VerificationError(f"node {node.name!r} ({node.format_node()}): {message}")


def _check_signature(program: Program) -> None:
    signature = program.signature
    placeholders = [n for n in program.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != signature.num_placeholders:
        raise VerificationError(
            f"graph has {len(placeholders)} placeholders, signature expects "
            f"{signature.num_placeholders}"
        )
    output = program.graph.output_node()
    results = output.args[0]
    if not isinstance(results, (tuple, list)) or len(results) != signature.num_outputs:
        count = len(results) if isinstance(results, (tuple, list)) else 1
        raise VerificationError(
            f"graph returns {count} values, signature expects {signature.num_outputs}"
        )
    if not signature.is_forward:
        loss = _tensor_meta(results[0])
        if loss is None or loss.shape != ():
            raise _fail(output, f"the loss must be a scalar tensor, found {loss}")
    by_name = dict(
        zip(
            signature.parameters + signature.buffers,
            placeholders[: len(signature.parameters) + len(signature.buffers)],
            strict=True,
        )
    )
    updated = signature.gradients + signature.buffer_updates
    for name, result in zip(updated, results[len(signature.outputs) :], strict=True):
        expected, found = _tensor_meta(by_name[name]), _tensor_meta(result)
        if expected != found:
            raise _fail(output, f"output for {name!r} is {found}, but {name!r} is {expected}")


def _tensor_meta(node: object) -> ir.TensorMeta | None:
    if not isinstance(node, fx.Node):
        return None
    value = ir.get(node, ir.ValueMeta)
    if value is None or value.multiple or value.outputs[0] is None:
        return None
    return value.outputs[0]


def _check_node(node: fx.Node) -> None:
    region = ir.get(node, ir.Region)
    if region is None:
        raise _fail(node, "has no Region annotation")
    if node.op == "output":
        return
    value = ir.get(node, ir.ValueMeta)
    if value is None:
        raise _fail(node, "has no ValueMeta annotation")
    if "val" in node.meta and ir.ValueMeta.of(node.meta["val"]) != value:
        raise _fail(node, f"annotated {value} but the traced value is {node.meta['val']}")
    if node.op == "call_function":
        _check_functional(node)
    if region.phase is ir.Phase.FORWARD:
        for arg in node.all_input_nodes:
            arg_region = ir.get(arg, ir.Region)
            if arg_region is not None and arg_region.phase is ir.Phase.BACKWARD:
                raise _fail(node, f"forward node reads backward node {arg.name!r}")


def _check_functional(node: fx.Node) -> None:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        schema = target._schema
        if schema.is_mutable or any(
            ret.alias_info is not None and ret.alias_info.is_write for ret in schema.returns
        ):
            raise _fail(node, f"{target} mutates its inputs; the IR must be functional")
        if draws_random_numbers(node):
            raise _fail(
                node,
                f"{target} draws random numbers inside the graph; every rank would draw its own, "
                "so the IR takes random draws as inputs (fxpar.rng)",
            )
        return
    if target is operator.getitem:
        source = node.args[0]
        index = node.args[1]
        source_value = ir.get(source, ir.ValueMeta) if isinstance(source, fx.Node) else None
        if source_value is None or not source_value.multiple:
            raise _fail(node, "getitem reads a node that does not return a tuple")
        if not isinstance(index, int) or not 0 <= index < len(source_value.outputs):
            raise _fail(node, f"getitem index {index} out of range")
        if source_value.outputs[index] is None:
            raise _fail(node, f"getitem reads non-tensor output {index}")
        return
    if getattr(target, "__module__", None) in ("_operator", "operator", "math") or target in (
        torch.sym_int,
        torch.sym_float,
        torch.sym_max,
        torch.sym_min,
        torch.sym_not,
    ):
        value = ir.require(node, ir.ValueMeta)
        if value.tensors:
            raise _fail(node, f"{target} produces a tensor outside ATen")
        return
    raise _fail(node, f"calls {target!r}, which is not an ATen op")
