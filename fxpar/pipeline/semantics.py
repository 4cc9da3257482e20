"""What a pipelined step computes, compared with the step on the whole batch.

A pipeline runs the step captured at micro-batch size once per *piece* (each micro-batch, and
each replica's share of it) and combines the pieces' losses and gradients. How to combine them
depends on the loss, read from the captured graph after
:class:`~fxpar.passes.canonicalize.Canonicalize`:

- a **sum** over the batch (``reduction="sum"``): the whole batch's loss and gradients are the
  sums of the pieces'.
- a **sum divided by a count the batch decides**, ``S / D``: cross-entropy's mean over the
  targets that are not ``ignore_index`` (``D`` is the total weight ``nll_loss_forward``
  returns), or a masked mean ``(l * mask).sum() / mask.sum()``. The whole batch's loss is
  ``ΣS_m / ΣD_m``, not the mean of the ``S_m / D_m``: a micro-batch with more valid targets
  weighs more. So before the step the runtime computes ``D`` of the whole batch from the batch
  tensors (every rank holds the whole batch, so this needs no communication), every unit reads
  it as an input standing for ``D``'s node, in the forward and the backward alike, and the
  pieces' losses and gradients, each already divided by the whole batch's ``D``, are summed.
  A piece with no valid target contributes zero instead of ``0/0``.
- a **sum divided by a constant** (``.mean()``): the mean of the pieces' losses and gradients,
  which is the whole batch's mean because every piece has the same count. So is a sum of
  means over the batch (``x.mean(0).sum()``): whether a sum reaches the batch through a mean
  over dimension 0 is traced from the batch inputs to the loss.

``D`` qualifies when it reads batch tensors only (no parameter, buffer or random draw), the
forward uses it only to divide the loss, and it is a function of *totals*, full sums over the
piece (``aten.sum``, ``count_nonzero``, cross-entropy's total weight), combined by scalar ops.
``D`` of the whole batch is that function of the totals summed over the pieces, so
``mask.sum().clamp(min=1)`` is exact too. The numerator must be a total as well; a sum that
mixes samples (a cumulative sum, say) cannot be told from one that does not, so it is
assumed not to.

Any other loss is combined as a mean over the pieces, and a note says so. Notes also name what a
pipeline computes differently by design: BatchNorm normalises each piece by its own statistics,
as GPipe does. :class:`~fxpar.pipeline.PipelineModel` logs every note as a warning when it is
built and keeps them in ``semantics``.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx

from fxpar import ir
from fxpar.ir.program import Program

aten = torch.ops.aten
_MEAN, _SUM = 1, 2  # torch's reduction enum
_NLL = (aten.nll_loss_forward.default, aten.nll_loss2d_forward.default)
_FULL_REDUCTIONS = (
    aten.sum.default,
    aten.sum.dim_IntList,
    aten.count_nonzero.default,
    aten.count_nonzero.dim_IntList,
)
DENOMINATOR_INPUT = "loss_denominator"


@dataclass(frozen=True)
class LossDenominator:
    """``D`` of a loss ``S / D``, computed for the whole batch before a pipelined step.

    ``totals`` takes one piece's batch tensors (``batch``, by position) and returns its totals;
    ``finish`` takes the totals summed over every piece and returns ``D``. Units read the
    result under the batch name :attr:`name` in place of the Program node :attr:`node`.
    """

    node: str
    name: str
    batch: tuple[str, ...]
    totals: fx.GraphModule
    total_dtypes: tuple[torch.dtype, ...]
    finish: fx.GraphModule
    dtype: torch.dtype

    def compute(self, pieces: Sequence[Mapping[str, torch.Tensor]]) -> torch.Tensor:
        """``D`` of the batch made of ``pieces`` (each a mapping from batch names to one
        piece's tensors)."""
        sums: list[torch.Tensor] = []
        with torch.no_grad():
            for piece in pieces:
                values = self.totals(*(piece[name] for name in self.batch))
                # Summed wide, then brought back: as exact as one sum over the whole batch.
                wide = [_widened(value) for value in values]
                sums = wide if not sums else [a + b for a, b in zip(sums, wide, strict=True)]
            exact = [s.to(dtype) for s, dtype in zip(sums, self.total_dtypes, strict=True)]
            return self.finish(*exact).to(self.dtype)


@dataclass(frozen=True)
class PipelineSemantics:
    """How a pipeline's step relates to the step on the whole batch (see the module
    docstring)."""

    loss: str
    """How the pieces' losses make the step's loss, in words."""
    summed: bool
    """The step's loss and gradients are the sums of the pieces' (else their means)."""
    denominator: LossDenominator | None
    notes: tuple[str, ...]
    """Where the step may differ from training on the whole batch at once; empty when it
    computes the whole batch's loss and gradients up to rounding."""

    def divisor(self, pieces: int) -> int:
        """What the sums over ``pieces`` pieces are divided by to make the step's loss and
        gradients."""
        return 1 if self.summed else pieces

    def __str__(self) -> str:
        lines = [f"loss: {self.loss}"]
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)


def pipeline_semantics(program: Program) -> PipelineSemantics:
    """Read how to combine ``program``'s pieces (a step captured at one piece's size), and
    what a pipeline of it computes differently from the whole batch's step. A forward program
    (the model alone) has no loss to combine: its pieces' outputs are concatenated."""
    if program.signature.is_forward:
        concatenated = "none: a forward, whose micro-batches' outputs are concatenated on dim 0"
        return PipelineSemantics(concatenated, False, None, tuple(_batch_statistics_notes(program)))
    combination = _loss_combination(program)
    notes = (*combination.notes, *_batch_statistics_notes(program))
    return dataclasses.replace(combination, notes=notes)


def _loss_combination(program: Program) -> PipelineSemantics:
    (output,) = (n for n in program.graph.nodes if n.op == "output")
    root = output.args[0][0]
    while _is_dtype_cast(root):  # a loss cast to float32 (mixed precision) is the same sum
        root = root.args[0]
    mean = "the mean of the micro-batch losses"
    paths = _batch_paths(program)
    mixed = PipelineSemantics(mean, False, None, (
        f"the loss ({root.name}) adds terms that are sums over the batch to terms that are "
        f"means over it; the pipeline takes {mean}, which is right for the means only",
    ))  # fmt: skip
    if _is_total(root):
        if paths[root] == {_MEANED}:
            return PipelineSemantics(
                f"{mean} (the loss sums means over the batch)", False, None, ()
            )
        if paths[root] != {_RAW}:
            return mixed
        return PipelineSemantics(
            "the sum of the micro-batch losses (the loss is a sum over the batch)", True, None, ()
        )
    if _is_nll(root, 0, (_MEAN,)):
        note = (
            f"the loss ({root.name}) is cross-entropy's mean over each micro-batch's own valid "
            "targets; canonicalize the Program (fxpar.passes.canonicalize.Canonicalize) before "
            "partitioning it, so that the pipeline divides by the whole batch's count"
        )
        return PipelineSemantics(mean, False, None, (note,))
    not_a_mean = PipelineSemantics(mean, False, None, (
        f"the loss ({root.name} = {_describe(root)}) is not a sum over the batch, nor a sum "
        f"divided by a count; the pipeline takes {mean}, which is the whole batch's loss only "
        "for a mean over the batch with the same count in every micro-batch",
    ))  # fmt: skip
    if root.target is not aten.div.Tensor or not isinstance(root.args[0], fx.Node):
        return not_a_mean
    numerator, divisor = root.args[0], root.args[1]
    if not _is_total(numerator):
        return not_a_mean
    if paths[numerator] == {_MEANED} and not isinstance(divisor, fx.Node):
        return PipelineSemantics(f"{mean} (the loss is a mean over the batch)", False, None, ())
    if paths[numerator] != {_RAW}:
        return mixed
    if not isinstance(divisor, fx.Node):
        return _constant_divisor(program, root, divisor, mean)
    found = _denominator(program, root, divisor)
    if isinstance(found, str):
        return PipelineSemantics(mean, False, None, (
            f"the loss divides by {divisor.name} = {_describe(divisor)}, which {found}; the "
            f"pipeline takes {mean}, each divided by its own {divisor.name}, not the whole "
            "batch's sum divided by the whole batch's count",
        ))  # fmt: skip
    description = (
        f"the sum over the micro-batches of {numerator.name} / {divisor.name}, with "
        f"{divisor.name} = {_describe(divisor)} of the whole batch, computed before the step"
    )
    return PipelineSemantics(description, True, found, ())


def _is_dtype_cast(node: fx.Node) -> bool:
    return (
        node.target is aten._to_copy.default
        and isinstance(node.args[0], fx.Node)
        and set(node.kwargs) <= {"dtype"}
    )


def _constant_divisor(
    program: Program, root: fx.Node, divisor: object, mean: str
) -> PipelineSemantics:
    """A sum over the batch divided by a number: a mean when the number counts the
    micro-batch's elements, which it then does in every micro-batch alike."""
    description = f"{mean} (the loss is a sum divided by a constant: a mean)"
    size = _piece_size(program)
    if size is None or not isinstance(divisor, (int, float)) or float(divisor) % size == 0:
        return PipelineSemantics(description, False, None, ())
    note = (
        f"the loss ({root.name}) divides a sum by {divisor}, which is not a multiple of the "
        f"micro-batch size {size}, so it is not a mean over the micro-batch; the pipeline "
        f"takes {mean}, which for a sum scaled by a fixed factor is the whole batch's loss "
        "divided by the number of micro-batches"
    )
    return PipelineSemantics(mean, False, None, (note,))


_RAW, _MEANED = "raw", "meaned"


def _batch_paths(program: Program) -> dict[fx.Node, frozenset[str]]:
    """Per node, how the batch reaches it: along a path with no mean over the batch
    (``"raw"``), through such a mean (``"meaned"``), both, or not at all. A loss that is a
    total reached only raw is a sum over the batch; reached only through means, a mean."""
    placeholders = program.placeholders()
    batch = {placeholders[name] for name in program.signature.inputs}
    size = _piece_size(program)
    paths: dict[fx.Node, frozenset[str]] = {}
    for node in program.graph.nodes:
        if node.op == "placeholder":
            paths[node] = frozenset({_RAW}) if node in batch else frozenset()
            continue
        reached = frozenset().union(*(paths[a] for a in node.all_input_nodes))
        if reached and size is not None and _is_batch_mean(node, size):
            reached = frozenset({_MEANED})
        paths[node] = reached
    return paths


def _is_batch_mean(node: fx.Node, size: int) -> bool:
    """A mean over dimension 0 of a tensor whose dimension 0 holds whole samples (a multiple
    of the piece's batch size): ``mean``, or ``sum / count`` as canonicalization writes it."""
    if node.op != "call_function":
        return False
    count: object = None
    if node.target in (aten.mean.dim, aten.mean.default):
        source = node.args[0]
        dims = node.args[1] if node.target is aten.mean.dim and len(node.args) > 1 else None
    elif node.target is aten.div.Tensor and isinstance(node.args[0], fx.Node):
        summed, count = node.args[0], node.args[1]
        if summed.target is not aten.sum.dim_IntList or not isinstance(count, (int, float)):
            return False
        source, dims = summed.args[0], summed.args[1]
    else:
        return False
    assert isinstance(source, fx.Node)
    shape = ir.require(source, ir.ValueMeta).tensor.shape
    if not all(isinstance(n, int) for n in shape):
        return False
    given = [int(d) for d in dims] if isinstance(dims, (list, tuple)) else []
    reduced = [d % len(shape) for d in given] if given else list(range(len(shape)))
    if 0 not in reduced or int(shape[0]) % size:
        return False
    return count is None or count == math.prod(int(shape[d]) for d in reduced)


def _piece_size(program: Program) -> int | None:
    """The batch size the step was captured at, when every batch tensor agrees on it."""
    placeholders = program.placeholders()
    sizes = {
        ir.require(placeholders[name], ir.ValueMeta).tensor.shape[0]
        for name in program.signature.inputs
    }
    if len(sizes) != 1:
        return None
    (size,) = sizes
    return size if isinstance(size, int) else None


def _denominator(program: Program, root: fx.Node, divisor: fx.Node) -> LossDenominator | str:
    """``divisor`` as a :class:`LossDenominator`, or why it is not one."""
    others = [
        user
        for user in divisor.users
        if user is not root and ir.require(user, ir.Region).phase is not ir.Phase.BACKWARD
    ]
    if others:
        return (
            f"the forward also uses in {others[0].name} ({others[0].target}), besides dividing "
            "the loss"
        )
    reads = _batch_dependence(program)
    if reads[divisor] == "constant":
        return "reads no batch tensor"
    if reads[divisor] == "state":
        by_node = {node: name for name, node in program.placeholders().items()}
        state = sorted(by_node[n] for n in _sources(divisor) if n.op == "placeholder")
        return f"reads {[n for n in state if n not in program.signature.inputs]} besides the batch"
    totals: list[fx.Node] = []
    scalar: set[fx.Node] = set()
    pending = [divisor]
    while pending:
        node = pending.pop()
        if node in scalar or node in totals:
            continue
        if reads[node] == "constant":
            scalar |= ancestors([node])
        elif _is_total(node):
            totals.append(node)
        elif node.op == "call_function" and _is_scalar(node):
            scalar.add(node)
            pending.extend(node.all_input_nodes)
        else:
            return (
                f"is computed from {node.name} = {_describe(node)}, not a full sum over the "
                "batch, so the whole batch's value is not known from the micro-batches' sums"
            )
    order = {node: index for index, node in enumerate(program.graph.nodes)}
    totals.sort(key=order.__getitem__)
    names = program.placeholders()
    read = ancestors([source for total in totals for source in _total_sources(total)])
    batch = tuple(name for name in program.signature.inputs if names[name] in read)
    taken = set(program.signature.placeholder_names)
    name = DENOMINATOR_INPUT
    while name in taken:
        name += "_"
    return LossDenominator(
        node=divisor.name,
        name=name,
        batch=batch,
        totals=_totals_module(program, totals, [names[n] for n in batch]),
        total_dtypes=tuple(ir.require(t, ir.ValueMeta).tensor.dtype for t in totals),
        finish=_finish_module(program, totals, scalar, divisor),
        dtype=ir.require(divisor, ir.ValueMeta).tensor.dtype,
    )


def _batch_dependence(program: Program) -> dict[fx.Node, str]:
    """Per node: ``"state"`` if it reads a parameter, buffer or random draw, else ``"batch"`` if
    it reads a batch tensor, else ``"constant"``. Cross-entropy's total weight reads only its
    targets and class weights, not the scores it comes with."""
    batch = {program.placeholders()[name] for name in program.signature.inputs}
    reads: dict[fx.Node, str] = {}
    rank = {"constant": 0, "batch": 1, "state": 2}
    for node in program.graph.nodes:
        if node.op == "placeholder":
            reads[node] = "batch" if node in batch else "state"
            continue
        inputs = _total_sources(node) if _is_nll(node, 1, (_MEAN, _SUM)) else node.all_input_nodes
        reads[node] = max((reads[a] for a in inputs), key=rank.__getitem__, default="constant")
    return reads


def _totals_module(
    program: Program, totals: Sequence[fx.Node], inputs: Sequence[fx.Node]
) -> fx.GraphModule:
    """One piece's batch tensors in, its totals out."""
    graph = fx.Graph()
    env = {node: graph.placeholder(node.name) for node in inputs}
    needed = ancestors([source for total in totals for source in _total_sources(total)])
    for node in program.graph.nodes:
        if node in needed and node not in env:
            env[node] = graph.node_copy(node, env.__getitem__)
    results = []
    for total in totals:
        if _is_nll(total, 1, (_MEAN, _SUM)):
            results.append(_total_weight(graph, env, total))
        else:
            results.append(graph.node_copy(total, env.__getitem__))
    graph.output(tuple(results))
    return fx.GraphModule(program.graph_module, graph, class_name="LossTotals")


def _total_weight(graph: fx.Graph, env: Mapping[fx.Node, fx.Node], total: fx.Node) -> fx.Node:
    """Cross-entropy's total weight from its targets alone: the number of targets that are
    not ``ignore_index``, or the sum of their class weights."""
    nll = total.args[0]
    assert isinstance(nll, fx.Node)
    target, weight = nll.args[1], nll.args[2]
    ignore_index = nll.args[4] if len(nll.args) > 4 else nll.kwargs.get("ignore_index", -100)
    assert isinstance(target, fx.Node)
    valid = graph.call_function(aten.ne.Scalar, (env[target], ignore_index))
    if isinstance(weight, fx.Node):
        safe = graph.call_function(aten.mul.Tensor, (env[target], valid))
        picked = graph.call_function(aten.index.Tensor, (env[weight], [safe]))
        counted = graph.call_function(aten.mul.Tensor, (picked, valid))
    else:
        counted = valid
    summed = graph.call_function(aten.sum.default, (counted,))
    dtype = ir.require(total, ir.ValueMeta).tensor.dtype
    return graph.call_function(aten._to_copy.default, (summed,), {"dtype": dtype})


def _finish_module(
    program: Program, totals: Sequence[fx.Node], scalar: set[fx.Node], divisor: fx.Node
) -> fx.GraphModule:
    """The whole batch's totals in, ``D`` out: the scalar ops between them, copied."""
    graph = fx.Graph()
    env = {total: graph.placeholder(total.name) for total in totals}
    for node in program.graph.nodes:
        if node in scalar:
            env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(env[divisor])
    return fx.GraphModule(program.graph_module, graph, class_name="LossDenominator")


def _total_sources(total: fx.Node) -> list[fx.Node]:
    """What a total reads (cross-entropy's total weight: its targets and class weights)."""
    if _is_nll(total, 1, (_MEAN, _SUM)):
        nll = total.args[0]
        assert isinstance(nll, fx.Node)
        return [a for a in nll.args[1:3] if isinstance(a, fx.Node)]
    return total.all_input_nodes


def _sources(node: fx.Node) -> set[fx.Node]:
    """The nodes ``node``'s value depends on (through cross-entropy's total weight, only on
    its targets and class weights)."""
    seen: set[fx.Node] = set()
    pending = [node]
    while pending:
        current = pending.pop()
        if current not in seen:
            seen.add(current)
            is_weight = _is_nll(current, 1, (_MEAN, _SUM))
            pending.extend(_total_sources(current) if is_weight else current.all_input_nodes)
    return seen


def ancestors(nodes: Iterable[fx.Node]) -> set[fx.Node]:
    """``nodes`` and every node they are computed from."""
    seen: set[fx.Node] = set()
    pending = list(nodes)
    while pending:
        node = pending.pop()
        if node not in seen:
            seen.add(node)
            pending.extend(node.all_input_nodes)
    return seen


def _is_total(node: fx.Node) -> bool:
    """A full sum over one piece: a sum or count reducing every dim, cross-entropy's total
    weight, or its sum-reduced loss."""
    if node.op != "call_function":
        return False
    if node.target in _FULL_REDUCTIONS:
        return _is_scalar(node)
    return _is_nll(node, 1, (_MEAN, _SUM)) or _is_nll(node, 0, (_SUM,))


def _is_nll(node: fx.Node, output: int, reductions: tuple[int, ...]) -> bool:
    """Whether ``node`` is output ``output`` of a cross-entropy (``nll_loss*_forward``) with one
    of ``reductions``."""
    if node.op != "call_function" or node.target is not operator.getitem:
        return False
    source, index = node.args
    if not isinstance(source, fx.Node) or source.target not in _NLL or index != output:
        return False
    reduction = source.args[3] if len(source.args) > 3 else source.kwargs.get("reduction", _MEAN)
    return reduction in reductions


def _widened(value: torch.Tensor) -> torch.Tensor:
    return value.to(torch.float64 if value.is_floating_point() else torch.int64)


def _is_scalar(node: fx.Node) -> bool:
    value = ir.get(node, ir.ValueMeta)
    return (
        value is not None
        and not value.multiple
        and value.outputs[0] is not None
        and value.outputs[0].shape == ()
    )


def _describe(node: fx.Node) -> str:
    target = node.target
    name = getattr(target, "__name__", str(target))
    if node.op == "call_function" and hasattr(target, "overloadpacket"):
        name = f"aten.{target.overloadpacket.__name__}"
    arguments = ", ".join(a.name for a in node.all_input_nodes)
    return f"{name}({arguments})"


def _batch_statistics_notes(program: Program) -> list[str]:
    """A note for each module whose forward normalises by statistics of the batch: they are
    taken per piece, not over the whole batch."""
    modules: dict[str, None] = {}
    for node in program.graph.nodes:
        if node.op != "call_function" or "batch_norm" not in str(node.target):
            continue
        if ir.require(node, ir.Region).phase is not ir.Phase.FORWARD:
            continue
        schema = getattr(node.target, "_schema", None)
        for index, argument in enumerate(schema.arguments if schema is not None else ()):
            if argument.name == "training":
                value = node.args[index] if index < len(node.args) else node.kwargs.get("training")
                if value is True:
                    modules[ir.require(node, ir.Region).module or "<root>"] = None
    return [
        f"{module!r} normalises each micro-batch (each replica's piece of it) by that piece's "
        "own batch statistics and updates its running statistics once per micro-batch, as "
        "GPipe does: the step equals training on the micro-batches one after another with "
        "their gradients averaged, not training on the whole batch at once"
        for module in modules
    ]
