"""A stage's backward cut in two on its graph: B, the input gradients, and W, the rest.

A zero-bubble schedule (:mod:`.schedule`) runs a stage's backward as two instructions: B
computes what the previous stage waits for (the gradients of what this stage received, and
anything else it sends back), and W, run later, computes the gradients of the stage's weights.
fxpar holds the backward as a graph, so the cut is made once, here, on that graph, and nothing
is differentiated again at run time:

- **B** is every node the sent values depend on. It takes the backward's inputs it reads and
  returns the sent values, then the *kept* values: what B computed that W reads (for a linear
  layer, the gradient of its output, which both the input gradient and the weight gradient
  multiply).
- **W** is every other node the weight gradients need. It takes the backward's inputs it reads
  (for a linear layer, its stashed input) and then the kept values, and returns the weight
  gradients in the backward's order.

Every node is computed once, by one part, from the same values as in the whole backward (but
the divided fused ops below), so B then W returns exactly what the backward returns, bit for
bit. A node needed by neither is
dropped; a constant (``get_attr``) is read by each part that needs it instead of being kept.
``getitem`` of a value B computed rides with B, so that only single tensors are kept.

A convolution computes its input and weight gradients in one ATen call,
``convolution_backward`` (:data:`DIVIDED_BACKWARDS`). When B needs its input gradient and W its
weight gradients, the call is divided by its ``output_mask`` argument: B calls it for the input
gradient alone, W again for the weight (and bias) gradients alone, on the same inputs (the
output gradient kept from B). Each output comes from the kernel code that computes it in the
whole call, so the results are the same bits (``tests/test_backward_split.py`` compares them
with ``torch.equal``, on CPU kernels), and no output is computed twice: each call skips what
its mask leaves out. Other fused backward ops stay whole in B. ``native_layer_norm_backward``
divides as exactly, but its weight gradients are two reductions, little to fill a bubble with,
while deferring them keeps the layer's output gradient, input and statistics alive until W:
on the benchmark's GPT that is 27% more held from B to W (10.6 against 8.4 MiB per
micro-batch on the second of two stages). Batch and group norm compute their input gradient
from the same reductions as their weight gradients, which a second call would compute again.

From B to W a stage keeps the kept values and the backward inputs W reads besides its state
(:func:`held_for_weights`); what only B reads can go after B. Their bytes come from the shapes
recorded at capture, so the memory of a schedule can be counted before anything runs.

The first stage sends nothing back: its B computes nothing and returns nothing, and W is the
whole backward (a schedule may still name its B, which then costs nothing). A stage without
weights has an empty W.

**On a stage mesh.** A stage that runs an intra-op plan (:mod:`.intra_op`) runs its backward
lowered to one device: a graph taking the communicator first, whose collective calls
(:mod:`fxpar.lowering.collective_calls`) every device of the stage mesh must make in the same
order. That lowered graph is what is cut, by the same rule, *after* lowering rather than
before (cutting the planned graph and lowering B and W apart), because:

- B then W stays the whole backward bit for bit: every node, collectives included, runs once
  on the same values, so a bucket reduces the same tensors together and a conversion runs
  where the lowering put it. Lowered apart, B and W would be bucketed, converted and overlapped
  again, by choices of the lowering that the whole backward's equality would then rest on;
- what runs is what the collective schedule priced and recorded for the unit
  (``ShardedStage.backward_collectives``), split in two: nothing replays the lowering;
- every device's lowered graph has the same nodes in the same order but for its local slices
  and the zeros a device other than the first adds for a ``Partial`` value (each computed from
  the value it replaces, so the data flow is the same), and the cut follows the data flow
  alone. So every device's B makes the same collectives in the same order, and so does its W
  (:func:`collective_calls` lists them).

What that gives: a collective whose result the sent gradients need is B's; one only the weight
gradients need (a gradient's reduction, a gather of what a weight gradient reads) is W's; a
start and its wait go together, since only the wait reads the start's handle, and a bucket's
wait with its start (its tensors ride with it, kept for W where W reads them). A collective in
neither part, or a handle kept from B for W, is refused rather than dropped or split. The
lowered graph records no shapes, so what a lowered B keeps has no recorded size
(:attr:`SavedValue.meta` is None): the runtime measures what it holds.
"""

from __future__ import annotations

import operator
import types
from collections.abc import Iterable, Mapping, Sequence, Set
from dataclasses import dataclass
from typing import cast

import torch
import torch.fx as fx

from fxpar import ir
from fxpar.lowering import collective_calls as collectives
from fxpar.pipeline.options import PipelineError
from fxpar.pipeline.partition import Half
from fxpar.pipeline.semantics import ancestors
from fxpar.pipeline.split import StageProgram
from fxpar.runtime import fastcall

aten = torch.ops.aten

DIVIDED_WEIGHT_SHARE = 0.5
"""The part of a divided convolution backward's time its W call takes, as priced: its input
and weight gradients each cost its forward's FLOPs (the bias gradient, a sum, is left out)."""

DIVIDED_BACKWARDS: Mapping[object, frozenset[int]] = types.MappingProxyType(
    {aten.convolution_backward.default: frozenset({1, 2})}
)
"""Fused backward ops that :func:`split_backward` divides between B and W, each with the
positions of its outputs that are weight gradients (the input gradient is output 0); each
takes its ``output_mask`` as its last positional argument."""


@dataclass(frozen=True)
class SavedValue:
    """A tensor alive from B to W: its node's name in the backward graph, its shape and dtype
    (None in a graph lowered to a stage mesh, which records no shapes)."""

    name: str
    meta: ir.TensorMeta | None

    @property
    def nbytes(self) -> ir.Size:
        """Its bytes.

        Raises:
            PipelineError: its graph recorded no shape for it (a lowered unit).
        """
        if self.meta is None:
            raise PipelineError(
                f"{self.name!r} comes from a graph lowered to a stage mesh, which records no "
                "shapes: count its bytes on the unlowered unit, or measure them"
            )
        return self.meta.nbytes


def saved_bytes(values: Iterable[SavedValue]) -> ir.Size:
    """The bytes of ``values`` together (symbolic where a shape is)."""
    return ir.total(value.nbytes for value in values)


@dataclass(frozen=True)
class BackwardSplit:
    """A backward GraphModule as B then W (see the module docstring).

    Positions count the backward's placeholders and the values its output tuple returns.
    """

    input_backward: fx.GraphModule
    """B: takes the inputs at :attr:`input_reads`, returns the outputs at
    :attr:`input_results`, then :attr:`kept`."""
    weight_backward: fx.GraphModule
    """W: takes the inputs at :attr:`weight_reads`, then :attr:`kept`; returns the outputs at
    :attr:`weight_results`."""
    input_reads: tuple[int, ...]
    weight_reads: tuple[int, ...]
    input_results: tuple[int, ...]
    weight_results: tuple[int, ...]
    kept: tuple[SavedValue, ...]
    """What B computes and W reads, in the backward's order."""
    weight_inputs: tuple[SavedValue, ...]
    """The backward's inputs W reads (those at :attr:`weight_reads`)."""
    divided: tuple[str, ...] = ()
    """The fused backward ops called twice, by B for their input gradient and by W for their
    weight gradients (:data:`DIVIDED_BACKWARDS`), by node name in the backward graph."""

    def run(self, inputs: Sequence[object]) -> list[object]:
        """B, then W, on the backward's inputs: the backward's outputs, in its order."""
        first = self.input_backward(*(inputs[i] for i in self.input_reads))
        results: list[object] = [None] * (len(self.input_results) + len(self.weight_results))
        for position, value in zip(self.input_results, first, strict=False):
            results[position] = value
        kept = first[len(self.input_results) :]
        second = self.weight_backward(*(inputs[i] for i in self.weight_reads), *kept)
        for position, value in zip(self.weight_results, second, strict=True):
            results[position] = value
        return results


def split_backward(module: fx.GraphModule, input_results: Iterable[int]) -> BackwardSplit:
    """Cut ``module``, a graph returning a tuple of values, into B (the values at positions
    ``input_results`` and everything they depend on) and W (the other values).

    Raises:
        PipelineError: a position the output has not, an output that is not a node of the
            graph, or a value W needs from B that is not a single tensor.
    """
    results = _results(module.graph)
    wanted = sorted(set(input_results))
    if any(not 0 <= position < len(results) for position in wanted):
        raise PipelineError(
            f"positions {wanted} name outputs the backward has not: it returns {len(results)}"
        )
    module, divided = _divide_fused(module, wanted)
    graph = module.graph
    placeholders = [node for node in graph.nodes if node.op == "placeholder"]
    results = _results(graph)
    others = [position for position in range(len(results)) if position not in wanted]
    input_nodes = ancestors(results[position] for position in wanted)
    kept: list[fx.Node] = []  # computed by B, read by W
    kept_set: set[fx.Node] = set()
    weight_nodes: set[fx.Node] = set()
    pending = [results[position] for position in others]
    while pending:
        node = pending.pop()
        if node in weight_nodes or node in kept_set:
            continue
        if _computed_by(node, input_nodes) or _rides_with(node, input_nodes):
            input_nodes.add(node)
            kept.append(node)
            kept_set.add(node)
            continue
        weight_nodes.add(node)
        pending.extend(node.all_input_nodes)
    order = {node: index for index, node in enumerate(graph.nodes)}
    kept.sort(key=order.__getitem__)
    _check_collectives(graph, input_nodes, weight_nodes, kept)
    input_reads = [node for node in placeholders if node in input_nodes]
    weight_reads = [node for node in placeholders if node in weight_nodes]
    input_part = _build(
        module, input_reads, input_nodes, [*(results[p] for p in wanted), *kept], "InputBackward"
    )
    weight_part = _build(
        module,
        [*weight_reads, *kept],
        weight_nodes,
        [results[position] for position in others],
        "WeightBackward",
    )
    return BackwardSplit(
        input_backward=input_part,
        weight_backward=weight_part,
        input_reads=tuple(placeholders.index(node) for node in input_reads),
        weight_reads=tuple(placeholders.index(node) for node in weight_reads),
        input_results=tuple(wanted),
        weight_results=tuple(others),
        kept=tuple(_saved(node) for node in kept),
        weight_inputs=tuple(_saved(node) for node in weight_reads),
        divided=divided,
    )


def _divide_fused(
    module: fx.GraphModule, wanted: Sequence[int]
) -> tuple[fx.GraphModule, tuple[str, ...]]:
    """``module`` with each fused backward op that B needs for its input gradient and W for
    its weight gradients called twice, on a copy of its graph: once with the input gradient's
    part of the ``output_mask`` (B's), once with the weight gradients' part (W's), whose
    ``getitem`` users it takes over. The names of the divided ops; ``module`` itself when
    there are none."""
    results = _results(module.graph)
    needed = ancestors(results[position] for position in wanted)
    fused = [node for node in module.graph.nodes if node in needed and divisible(node, needed)]
    if not fused:
        return module, ()
    graph = fx.Graph()
    copies: dict[fx.Node, fx.Node] = {}
    graph.output(graph.graph_copy(module.graph, copies))
    for node in fused:
        _divide(graph, copies[node])
    graph.lint()
    return fx.GraphModule(module, graph, class_name=type(module).__name__), tuple(
        node.name for node in fused
    )


def divisible(node: fx.Node, needed: Set[fx.Node]) -> bool:
    """``node``, which B needs (one of ``needed``), is a fused backward op that B and W
    share (:data:`DIVIDED_BACKWARDS`): its users take its outputs one by one, and some of its
    weight gradients are read outside ``needed`` (by W), none inside."""
    weights = DIVIDED_BACKWARDS.get(node.target)
    if weights is None or node.kwargs or not isinstance(node.args[-1], (list, tuple)):
        return False
    taken = {user: _taken(user) for user in node.users}
    if None in taken.values():
        return False
    by_weights = [user for user, position in taken.items() if position in weights]
    return bool(by_weights) and not any(user in needed for user in by_weights)


def _taken(node: fx.Node) -> int | None:
    """The output position ``node`` takes of a tuple, or None if it is no ``getitem``."""
    if node.op == "call_function" and node.target is operator.getitem:
        position = node.args[1]
        return position if isinstance(position, int) else None
    return None


def _divide(graph: fx.Graph, node: fx.Node) -> None:
    """Call the fused ``node`` a second time right after it, for its weight gradients; hand
    the ``getitem`` users of those to the new call, and leave ``node`` the rest of its
    mask."""
    weights = DIVIDED_BACKWARDS[node.target]
    mask = [bool(flag) for flag in node.args[-1]]  # type: ignore[union-attr]
    with graph.inserting_after(node):
        second = graph.call_function(
            cast(torch._ops.OpOverload, node.target),
            (*node.args[:-1], [flag and i in weights for i, flag in enumerate(mask)]),
        )
    second.meta = dict(node.meta)
    node.args = (*node.args[:-1], [flag and i not in weights for i, flag in enumerate(mask)])
    for user in list(node.users):
        if user is not second and _taken(user) in weights:
            user.replace_input_with(node, second)


def split_stage_backward(stage: StageProgram) -> BackwardSplit:
    """B and W of a stage's backward unit: B returns what the unit sends to the previous stage,
    W its gradients.

    A unit lowered to a stage mesh is cut as lowered (see the module docstring): its
    placeholders, and so the positions of the split's reads, start with the communicator.

    Raises:
        PipelineError: ``stage`` is a forward unit, or as :func:`split_backward` does.
    """
    if stage.unit.half is not Half.BACKWARD:
        raise PipelineError(f"{stage.unit} is a forward unit: only a backward splits into B and W")
    return split_backward(stage.graph_module, range(len(stage.sent)))


def collective_calls(module: fx.GraphModule) -> list[tuple[str, tuple[object, ...]]]:
    """The collectives ``module`` starts, in order: each one's kind (``all_reduce``,
    ``all_gather_bucket``, ...) and its arguments that are no values (dims, mesh axes,
    sizes). A started collective counts where it starts and its wait not at all, so a
    blocking all-reduce and a started one are the same entry: the lowering makes one device's
    blocking where another's has an op to overlap (the zeros a ``Partial`` value gets on
    devices other than the first). Devices of a stage mesh that list the same collectives for
    a part meet at every one of them."""
    calls = []
    for node in module.graph.nodes:
        name = cast(types.FunctionType, node.target).__name__ if _is_collective(node) else ""
        if name and not name.startswith("wait_"):
            plain = tuple(arg for arg in node.args if not _holds_node(arg))
            calls.append((name.removeprefix("start_"), plain))
    return calls


@dataclass(frozen=True)
class StageBackward:
    """A stage's backward unit run as two calls, B (:meth:`run_input`) and later W
    (:meth:`run_weight`), as a zero-bubble schedule's runtime runs it. Between them the caller
    keeps what :meth:`run_input` returned for W, and nothing else of the micro-batch."""

    stage: StageProgram
    split: BackwardSplit

    @classmethod
    def of(cls, stage: StageProgram) -> StageBackward:
        """``stage`` cut by :func:`split_stage_backward`.

        Raises:
            PipelineError: as :func:`split_stage_backward` does.
        """
        split = split_stage_backward(stage)
        sent = len(stage.sent)
        if split.weight_results != tuple(range(sent, sent + len(stage.gradients))):
            raise PipelineError(
                f"{stage.unit} returns more than what it sends and its gradients, which "
                "B/W splitting does not expect"
            )
        return cls(stage, split)

    @property
    def resident_reads(self) -> int:
        """How many of W's inputs are the stage's parameters, buffers and batch (and, on a
        stage mesh, its communicator), which come first in what :meth:`run_input` returns for
        W; the rest stays alive only for W."""
        return sum(position < _resident(self.stage) for position in self.split.weight_reads)

    def run_input(
        self,
        parameters: Mapping[str, torch.Tensor],
        batch: Mapping[str, torch.Tensor],
        received: Sequence[torch.Tensor],
        restored: Sequence[torch.Tensor],
    ) -> tuple[tuple[torch.Tensor, ...], list[object]]:
        """B on one micro-batch: the tensors the stage sends back, and what its W reads (W's
        backward inputs, the communicator first on a stage mesh, then the kept values).
        ``received`` and ``restored`` given as lists are emptied, so that what only B reads
        is freed when B is done with it."""
        inputs = self.stage.inputs(parameters, {}, batch, received, restored)
        if self.stage.communicator is not None:
            inputs.insert(0, self.stage.communicator)
        split = self.split
        reads = [inputs[position] for position in split.input_reads]
        held = [inputs[position] for position in split.weight_reads]
        inputs.clear()
        with torch.no_grad():
            flat = list(fastcall.run_boxed(split.input_backward, reads))
        count = len(split.input_results)
        held += flat[count:]
        return tuple(flat[:count]), held

    def run_weight(self, held: list[object]) -> dict[str, torch.Tensor]:
        """W on what :meth:`run_input` returned for it (emptied): the stage's gradients of
        the micro-batch, by parameter name."""
        with torch.no_grad():
            flat = fastcall.run_boxed(self.split.weight_backward, held)
        return dict(zip(self.stage.gradients, flat, strict=True))


def held_for_weights(stage: StageProgram, split: BackwardSplit) -> tuple[SavedValue, ...]:
    """What stays alive from ``stage``'s B to its W besides the parameters, buffers and batch
    the stage holds anyway: the kept values, and the received gradients and stashed
    activations W reads."""
    read = zip(split.weight_reads, split.weight_inputs, strict=True)
    return split.kept + tuple(value for position, value in read if position >= _resident(stage))


def _resident(stage: StageProgram) -> int:
    """How many placeholders of ``stage``'s module come before what it receives and restores:
    its parameters, buffers and batch, after the communicator of a lowered unit."""
    lowered = stage.communicator is not None
    return lowered + len(stage.parameters) + len(stage.buffers) + len(stage.batch)


def _is_collective(node: fx.Node) -> bool:
    """``node`` calls a collective (or waits for one) of a lowered program."""
    return node.op == "call_function" and (
        getattr(node.target, "__module__", None) == collectives.__name__
    )


def _holds_node(argument: object) -> bool:
    if isinstance(argument, (list, tuple)):
        return any(_holds_node(item) for item in argument)
    return isinstance(argument, fx.Node)


def _check_collectives(
    graph: fx.Graph, input_nodes: Set[fx.Node], weight_nodes: Set[fx.Node], kept: Sequence[fx.Node]
) -> None:
    """Refuse a split of a lowered graph that drops a collective (neither part needs it, so
    its peers would wait for it) or keeps a collective's handle from B for W (a start in B
    whose wait is W's).

    Raises:
        PipelineError: either happened.
    """
    for node in graph.nodes:
        if _is_collective(node) and node not in input_nodes and node not in weight_nodes:
            raise PipelineError(
                f"the backward's collective {node.name!r} is needed by none of its results, so "
                "neither B nor W would call it while every other device's backward does"
            )
    for node in kept:
        if _is_collective(node) and cast(types.FunctionType, node.target).__name__.startswith(
            "start_"
        ):
            raise PipelineError(
                f"B would start collective {node.name!r} and W wait for it: a start and its "
                "wait must run in one part"
            )


def _results(graph: fx.Graph) -> list[fx.Node]:
    (output,) = (node for node in graph.nodes if node.op == "output")
    values = output.args[0]
    if not isinstance(values, (tuple, list)):
        values = (values,)
    for value in values:
        if not isinstance(value, fx.Node):
            raise PipelineError(f"the backward returns {value!r}, not a value it computes")
    return list(values)


def _computed_by(node: fx.Node, part: set[fx.Node]) -> bool:
    """``node`` is a value ``part`` computes (not an input, nor a constant both may read)."""
    return node in part and node.op not in ("placeholder", "get_attr")


def _rides_with(node: fx.Node, part: set[fx.Node]) -> bool:
    """``node`` takes one element of a tuple that ``part`` computes: it goes with ``part``."""
    producer = node.args[0] if node.args else None
    return (
        node.op == "call_function"
        and node.target is operator.getitem
        and isinstance(producer, fx.Node)
        and _computed_by(producer, part)
    )


def _build(
    module: fx.GraphModule,
    inputs: Sequence[fx.Node],
    computed: set[fx.Node],
    outputs: Sequence[fx.Node],
    name: str,
) -> fx.GraphModule:
    """A GraphModule taking ``inputs``, computing the nodes of ``computed`` that are not
    inputs in ``module``'s order, and returning ``outputs``."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in inputs:
        env[node] = graph.placeholder(node.name)
        env[node].meta = dict(node.meta)
    for node in module.graph.nodes:
        if node in computed and node not in env and node.op != "placeholder":
            env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(tuple(env[node] for node in outputs))
    graph.lint()
    return fx.GraphModule(module, graph, class_name=name)


def _saved(node: fx.Node) -> SavedValue:
    """``node``'s value as a :class:`SavedValue`, from its ValueMeta (or its example value)."""
    meta = ir.get(node, ir.ValueMeta)
    if meta is not None and not meta.multiple and meta.outputs and meta.outputs[0] is not None:
        return SavedValue(node.name, meta.outputs[0])
    example = node.meta.get("val")
    if isinstance(example, torch.Tensor):
        return SavedValue(node.name, ir.TensorMeta.of(example))
    if not node.meta:  # a lowered graph's node: no shapes recorded
        return SavedValue(node.name, None)
    raise PipelineError(
        f"{node.name!r} ({node.target}) is kept from B for W but is not a single tensor"
    )
