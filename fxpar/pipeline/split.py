"""Cut a captured Program into a forward and a backward program per pipeline stage.

Each of the ``2K`` programs (*units*, see :class:`~fxpar.pipeline.partition.Unit`) runs once per
micro-batch, in the order ``forward[0], ..., forward[K-1], backward[K-1], ..., backward[0]``. A
unit computes the nodes :func:`~fxpar.pipeline.partition.partition` gave it, and every other
value it reads arrives on one of three channels:

- ``forward[s-1] -> forward[s]``: activations, sent between ranks;
- ``backward[s+1] -> backward[s]``: gradients (and anything else a backward needs from a later
  stage), sent between ranks;
- ``forward[s] -> backward[s]``: the *stash*, what stage ``s`` keeps for its own backward.

Parameters and batch tensors never travel: every stage reads its own copy. Routing is demand
driven, starting from what the step returns (the loss, each gradient, each new buffer): a unit
that needs a value it does not compute asks the channel it would arrive on, and the unit at
the other end computes it or asks in turn. A value produced two stages back is therefore
relayed through the stage between, and nothing unneeded is computed or sent.

**Rematerialization.** With ``remat=True`` the backward of stage ``s`` computes the forward
nodes of stage ``s`` it needs itself, instead of reading them from the stash, so the stash
holds only what the stage's forward *received* (the stage-boundary activations) and its
buffers. The forward still runs whole, to produce what it sends and the loss.

**Tied weights.** A parameter read by two stages (GPT's embedding and head) is held by both.
Its gradient is the sum of one term per use, joined by ``add`` nodes that capture placed in
one stage; here those adds are dropped and each stage returns the sum of its own terms, a
*partial* gradient. The runtime sums the partials of the holders once per step (an
all-reduce over the holding stages), after which every copy takes the same update.

**Forward programs.** A Program captured with ``step="forward"`` (the model alone, see
:func:`fxpar.capture`) has no loss and no backward: its backward units are empty, and the
model's output tensors are requested in the last stage's forward, which returns them (a value
computed in an earlier stage is relayed like any other). Each piece's outputs are that piece's
rows; :meth:`SplitProgram.run_microbatches` concatenates them along dim 0.

**The whole batch's loss.** When the loss divides a sum by a count the batch decides (a
masked mean, cross-entropy with ignored targets), every unit reads the whole batch's count as
one more batch input instead of computing its micro-batch's own, and the micro-batches' losses
and gradients are summed, not averaged (see :mod:`.semantics`, whose
:class:`~.semantics.PipelineSemantics` the split carries).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx

from fxpar import ir
from fxpar.errors import LoweringError
from fxpar.ir.program import Program, StepResult
from fxpar.ir.rng import RandomDraw, draw_all
from fxpar.lowering import value_spec
from fxpar.lowering.collective_calls import Communicator
from fxpar.pipeline.options import PipelineError
from fxpar.pipeline.partition import Half, Partition, Unit
from fxpar.pipeline.semantics import LossDenominator, PipelineSemantics, pipeline_semantics
from fxpar.planning.moe_blocks import dispatch_axis, find_blocks
from fxpar.runtime import fastcall
from fxpar.sharding import Sharding, Spec, Strategy

aten = torch.ops.aten


@dataclass(frozen=True)
class Value:
    """A tensor that crosses from one unit to another: the node it is in the captured Program,
    and its shape and dtype (which a receiving rank allocates before the data arrives)."""

    name: str
    meta: ir.TensorMeta


@dataclass(frozen=True)
class StageOutputs:
    """What one unit returns for one micro-batch."""

    sent: tuple[torch.Tensor, ...]
    stashed: tuple[torch.Tensor, ...]
    loss: torch.Tensor | None
    buffer_updates: dict[str, torch.Tensor]
    gradients: dict[str, torch.Tensor]
    """Partial gradients: this stage's share, for one micro-batch, of the mean-loss step."""
    outputs: tuple[torch.Tensor, ...] = ()
    """The model's output tensors for this micro-batch (the last forward of a forward
    program only)."""


@dataclass(frozen=True)
class StageProgram:
    """One unit: a GraphModule and the meaning of its inputs and outputs.

    Placeholders, in order: ``parameters``, ``buffers``, ``batch`` (this micro-batch's piece),
    ``received`` (from the neighbouring stage), ``restored`` (the stash, backward only).
    Outputs, flat: ``sent``, ``stashed`` (forward only), the loss (when ``loss``), the model's
    ``outputs`` (the last forward of a forward program), ``buffer_updates``, ``gradients``.
    """

    unit: Unit
    graph_module: fx.GraphModule
    parameters: tuple[str, ...]
    buffers: tuple[str, ...]
    batch: tuple[str, ...]
    received: tuple[Value, ...]
    restored: tuple[Value, ...]
    sent: tuple[Value, ...]
    stashed: tuple[Value, ...]
    loss: bool
    buffer_updates: tuple[str, ...]
    gradients: tuple[str, ...]
    outputs: tuple[Value, ...] = ()
    """The model's output tensors this unit returns, in the Program's output order (named
    after the nodes that compute them)."""
    communicator: Communicator | None = None
    """Set on a unit lowered to one device of a stage mesh (:mod:`.intra_op`): its module takes
    the communicator first, and every tensor above is this device's piece."""

    def run(
        self,
        parameters: Mapping[str, torch.Tensor],
        buffers: Mapping[str, torch.Tensor],
        batch: Mapping[str, torch.Tensor],
        received: Sequence[torch.Tensor] = (),
        restored: Sequence[torch.Tensor] = (),
    ) -> StageOutputs:
        """Run on real tensors; parameters, buffers and batch tensors are looked up by name.
        ``received`` and ``restored`` given as lists are emptied: the tensors in them are
        freed as soon as the program is done with them, unless the caller keeps others."""
        inputs = self.inputs(parameters, buffers, batch, received, restored)
        if self.communicator is not None:
            inputs.insert(0, self.communicator)
        with torch.no_grad():
            flat = list(fastcall.run_boxed(self.graph_module, inputs))
        sent = tuple(flat[: len(self.sent)])
        del flat[: len(self.sent)]
        stashed = tuple(flat[: len(self.stashed)])
        del flat[: len(self.stashed)]
        loss = flat.pop(0) if self.loss else None
        outputs = tuple(flat[: len(self.outputs)])
        del flat[: len(self.outputs)]
        updates = dict(zip(self.buffer_updates, flat[: len(self.buffer_updates)], strict=True))
        del flat[: len(self.buffer_updates)]
        gradients = dict(zip(self.gradients, flat, strict=True))
        return StageOutputs(sent, stashed, loss, updates, gradients, outputs)

    def inputs(
        self,
        parameters: Mapping[str, torch.Tensor],
        buffers: Mapping[str, torch.Tensor],
        batch: Mapping[str, torch.Tensor],
        received: Sequence[torch.Tensor] = (),
        restored: Sequence[torch.Tensor] = (),
    ) -> list[object]:
        """The module's inputs in placeholder order (the communicator of a stage mesh left
        out): as :meth:`run` reads its arguments, emptying ``received`` and ``restored``
        when they are lists."""
        if len(received) != len(self.received) or len(restored) != len(self.restored):
            raise PipelineError(
                f"{self.unit} expects {len(self.received)} received and {len(self.restored)} "
                f"stashed tensors, got {len(received)} and {len(restored)}"
            )
        inputs: list[object] = [parameters[n] for n in self.parameters]
        inputs += [buffers[n] for n in self.buffers]
        inputs += [batch[n] for n in self.batch]
        inputs += received
        inputs += restored
        for consumed in (received, restored):
            if isinstance(consumed, list):
                consumed.clear()
        return inputs

    def code(self) -> str:
        return self.graph_module.code


@dataclass(frozen=True)
class SplitProgram:
    """The per-stage programs of one captured step (at micro-batch size)."""

    program: Program
    partition: Partition
    remat: bool
    forward: tuple[StageProgram, ...]
    backward: tuple[StageProgram, ...]
    holders: Mapping[str, tuple[int, ...]]
    """For each parameter, the stages that keep a copy of it (more than one: tied weights)."""
    semantics: PipelineSemantics
    """How the micro-batches' losses and gradients make the step's, and where the step differs
    from the whole batch's."""

    @property
    def num_stages(self) -> int:
        return self.partition.num_stages

    def stage_parameters(self, stage: int) -> tuple[str, ...]:
        """Parameters stage ``stage`` holds, in the Program's order."""
        return tuple(n for n in self.program.signature.parameters if stage in self.holders[n])

    def stage_buffers(self, stage: int) -> tuple[str, ...]:
        """Buffers stage ``stage`` holds: those its forward reads, and on stage 0 those that no
        stage reads, so that every buffer is saved and gathered somewhere."""
        held = self.forward[stage].buffers
        if stage == 0:
            read = {name for unit in self.forward for name in unit.buffers}
            held += tuple(n for n in self.program.signature.buffers if n not in read)
        return held

    def unit_inputs(
        self,
        pieces: Sequence[Mapping[str, torch.Tensor]],
        draw: Callable[[Sequence[RandomDraw]], list[torch.Tensor]] = draw_all,
    ) -> list[dict[str, torch.Tensor]]:
        """What the units read per piece of the whole batch (every micro-batch, every
        replica's share): its batch tensors, its random inputs (``draw`` called once per piece,
        in piece order, as a single-device loop over the pieces would draw them; by default
        from torch's generator), and, when the loss has one, the whole batch's loss
        denominator computed from all of ``pieces``."""
        signature = self.program.signature
        inputs = []
        for piece in pieces:
            drawn = draw(signature.random)
            inputs.append({**piece, **dict(zip(signature.random_inputs, drawn, strict=True))})
        denominator = self.semantics.denominator
        if denominator is not None:
            whole = denominator.compute(pieces)
            for piece in inputs:
                piece[denominator.name] = whole
        return inputs

    def shared_parameters(self) -> dict[str, tuple[int, ...]]:
        """Trainable parameters held by several stages, whose partial gradients are summed."""
        trainable = set(self.program.signature.gradients)
        return {n: s for n, s in self.holders.items() if len(s) > 1 and n in trainable}

    def run_microbatches(
        self,
        state: Mapping[str, torch.Tensor],
        microbatches: Sequence[Sequence[torch.Tensor]],
    ) -> StepResult:
        """The whole pipelined step in one process, micro-batch after micro-batch: the loss and
        gradients are the sums or means of the micro-batches' as :attr:`semantics` says, and
        buffers are updated once per micro-batch; a forward program's outputs are the
        micro-batches' concatenated along dim 0 (and it has no loss). The reference the
        distributed runtime must match."""
        signature = self.program.signature
        buffers = {name: state[name] for name in signature.buffers}
        totals: dict[str, torch.Tensor] = {}
        losses = []
        outputs: list[tuple[torch.Tensor, ...]] = []
        pieces = [dict(zip(signature.inputs, piece, strict=True)) for piece in microbatches]
        for batch in self.unit_inputs(pieces):
            stash: list[tuple[torch.Tensor, ...]] = []
            message: tuple[torch.Tensor, ...] = ()
            for stage in self.forward:
                out = stage.run(state, buffers, batch, message)
                message = out.sent
                stash.append(out.stashed)
                buffers.update(out.buffer_updates)
                if out.loss is not None:
                    losses.append(out.loss)
                if stage.outputs:
                    outputs.append(out.outputs)
            message = ()
            for stage in reversed(self.backward):
                out = stage.run(state, buffers, batch, message, stash[stage.unit.stage])
                message = out.sent
                for name, gradient in out.gradients.items():
                    totals[name] = totals[name] + gradient if name in totals else gradient
        count = self.semantics.divisor(len(microbatches))
        return StepResult(
            loss=torch.stack(losses).sum() / count if losses else None,
            gradients={name: totals[name] / count for name in signature.gradients},
            buffers={name: buffers[name] for name in signature.buffer_updates},
            outputs=tuple(torch.cat(pieces) for pieces in zip(*outputs, strict=True)),
        )


def split_program(program: Program, partition: Partition, *, remat: bool) -> SplitProgram:
    """Build the ``2K`` unit programs of ``program`` cut as ``partition`` says. Random
    draws are inputs of the Program (:mod:`fxpar.rng`), so a forward recomputed by remat
    reads the draws its forward read.

    Raises:
        PipelineError: ``program``'s plan dispatches a mixture-of-experts block's tokens by
            all-to-all, which does not run cut into a forward and a backward yet.
    """
    dispatched = [
        b.sort.name for b in find_blocks(program.graph)[0] if dispatch_axis(b) is not None
    ]
    if dispatched:
        raise PipelineError(
            f"the plan dispatches the tokens of mixture-of-experts blocks "
            f"({', '.join(dispatched)}) by all-to-all, which pipeline stages do not run yet: "
            "plan the stages with expert_parallel(dispatch='all_reduce'), another plan, or the "
            "solver (which does not dispatch inside stages)"
        )
    semantics = pipeline_semantics(program)
    router = _Router(program, partition, remat, semantics.denominator)
    outputs = _output_roots(program, partition)
    for unit, node in outputs.roots():
        router.request(unit, node)
    stages = range(partition.num_stages)
    forward = tuple(router.build(Unit(Half.FORWARD, s), outputs) for s in stages)
    backward = tuple(router.build(Unit(Half.BACKWARD, s), outputs) for s in stages)
    holders: dict[str, set[int]] = {n: set() for n in program.signature.parameters}
    for unit_program in (*forward, *backward):
        for name in (*unit_program.parameters, *unit_program.gradients):
            if name in holders:
                holders[name].add(unit_program.unit.stage)
    return SplitProgram(
        program=program,
        partition=partition,
        remat=remat,
        forward=forward,
        backward=backward,
        # An unused parameter still has a home, so it is saved and updated somewhere.
        holders={n: tuple(sorted(s)) if s else (0,) for n, s in holders.items()},
        semantics=semantics,
    )


@dataclass(frozen=True)
class _OutputRoots:
    """What the step returns, and in which unit each piece is produced."""

    loss: tuple[Unit, fx.Node] | None
    """None for a forward program, which has none."""
    buffer_updates: dict[str, tuple[Unit, fx.Node]]
    gradient_terms: dict[str, dict[int, list[fx.Node]]]
    """Per gradient, its summands grouped by the stage whose backward computes them."""
    outputs: tuple[fx.Node, ...] = ()
    """A forward program's output tensors, all returned by the last forward unit."""
    outputs_unit: Unit | None = None

    def roots(self) -> Iterable[tuple[Unit, fx.Node]]:
        if self.loss is not None:
            yield self.loss
        if self.outputs_unit is not None:
            for node in self.outputs:
                yield self.outputs_unit, node
        yield from self.buffer_updates.values()
        for by_stage in self.gradient_terms.values():
            for stage, terms in by_stage.items():
                for term in terms:
                    yield Unit(Half.BACKWARD, stage), term


def _output_roots(program: Program, partition: Partition) -> _OutputRoots:
    signature = program.signature
    (output,) = (n for n in program.graph.nodes if n.op == "output")
    flat = list(output.args[0])
    leading = len(signature.outputs)
    loss: tuple[Unit, fx.Node] | None = None
    outputs: tuple[fx.Node, ...] = ()
    if signature.is_forward:
        outputs = tuple(node for node in flat[:leading] if isinstance(node, fx.Node))
        if len(outputs) != leading:
            raise PipelineError("a forward program's outputs must be tensors computed by it")
    else:
        node = flat[0]
        if not isinstance(node, fx.Node) or partition.units.get(node, None) is None:
            raise PipelineError("the captured loss is not computed by the model's forward pass")
        loss = (partition.units[node], node)
    gradients = flat[leading : leading + len(signature.gradients)]
    updates = flat[leading + len(signature.gradients) :]
    last_backward = Unit(Half.BACKWARD, partition.num_stages - 1)
    terms: dict[str, dict[int, list[fx.Node]]] = {}
    for name, gradient in zip(signature.gradients, gradients, strict=True):
        by_stage: dict[int, list[fx.Node]] = {}
        for term in _summands(gradient, partition):
            stage = partition.units.get(term, last_backward).stage
            by_stage.setdefault(stage, []).append(term)
        terms[name] = by_stage
    buffer_updates = {}
    for name, node in zip(signature.buffer_updates, updates, strict=True):
        unit = partition.units.get(node)
        if unit is None or unit.half is not Half.FORWARD:
            raise PipelineError(
                f"buffer {name!r} is updated outside the forward pass; the pipeline runtime "
                "updates buffers only in a stage's forward"
            )
        buffer_updates[name] = (unit, node)
    last_forward = Unit(Half.FORWARD, partition.num_stages - 1)
    return _OutputRoots(
        loss, buffer_updates, terms, outputs, last_forward if signature.is_forward else None
    )


def _summands(node: fx.Node, partition: Partition) -> list[fx.Node]:
    """The terms of a gradient accumulation ``a + b + ...`` built by autograd for a parameter
    used more than once, split where terms come from different stages."""
    if (
        node.op == "call_function"
        and node.target is aten.add.Tensor
        and not node.kwargs
        and len(node.users) == 1
        and len(node.args) == 2
        and all(isinstance(a, fx.Node) for a in node.args)
    ):
        left, right = node.args
        assert isinstance(left, fx.Node) and isinstance(right, fx.Node)
        if _same_meta(left, node) and _same_meta(right, node):
            return _summands(left, partition) + _summands(right, partition)
    return [node]


def _same_meta(a: fx.Node, b: fx.Node) -> bool:
    meta_a, meta_b = ir.get(a, ir.ValueMeta), ir.get(b, ir.ValueMeta)
    return meta_a is not None and meta_a == meta_b


class _Router:
    """Demand-driven routing of values to the units that read them (see the module docstring)."""

    def __init__(
        self,
        program: Program,
        partition: Partition,
        remat: bool,
        denominator: LossDenominator | None = None,
    ) -> None:
        self.program = program
        self.partition = partition
        self.remat = remat
        signature = program.signature
        placeholders = program.placeholders()
        self.names = {node: name for name, node in placeholders.items()}
        self.kinds = {
            **{placeholders[n]: "parameter" for n in signature.parameters},
            **{placeholders[n]: "buffer" for n in signature.buffers},
            # Random draws are per-piece inputs too, drawn before the step (fxpar.rng).
            **{placeholders[n]: "batch" for n in signature.step_inputs},
        }
        self.denominator: fx.Node | None = None
        if denominator is not None:
            # Read like a batch tensor wherever it is used, forward and backward alike.
            (node,) = (n for n in program.graph.nodes if n.name == denominator.node)
            self.names[node] = denominator.name
            self.kinds[node] = "batch"
            self.denominator = node
        self.position = {node: index for index, node in enumerate(program.graph.nodes)}
        self.computed: dict[Unit, set[fx.Node]] = {}
        self.ambient: dict[Unit, set[fx.Node]] = {}
        self.channels: dict[tuple[Unit, Unit], set[fx.Node]] = {}
        self.seen: set[tuple[Unit, fx.Node]] = set()

    def request(self, unit: Unit, node: fx.Node) -> None:
        """Make ``node``'s value available in ``unit``."""
        pending = [(unit, node)]
        while pending:
            unit, node = pending.pop()
            if (unit, node) in self.seen:
                continue
            self.seen.add((unit, node))
            kind = self.kinds.get(node)
            if kind is not None:
                if kind != "buffer" or unit.half is Half.FORWARD:
                    self.ambient.setdefault(unit, set()).add(node)
                    continue
                # A backward reads the buffer value its own forward saw.
                source = Unit(Half.FORWARD, unit.stage)
            else:
                home = self.partition.units.get(node)
                if home is None:
                    raise PipelineError(f"node {node.name!r} ({node.target}) has no stage")
                if home == unit or (
                    self.remat
                    and unit.half is Half.BACKWARD
                    and home == Unit(Half.FORWARD, unit.stage)
                ):
                    self.computed.setdefault(unit, set()).add(node)
                    pending.extend((unit, arg) for arg in node.all_input_nodes)
                    continue
                source = self._source(unit, node, home)
            self.channels.setdefault((source, unit), set()).add(node)
            pending.append((source, node))

    def _source(self, unit: Unit, node: fx.Node, home: Unit) -> Unit:
        """The unit from which ``unit`` receives ``node``'s value, produced in ``home``."""
        stage = unit.stage
        if unit.half is Half.FORWARD:
            if home.half is Half.FORWARD and home.stage < stage:
                return Unit(Half.FORWARD, stage - 1)
        elif home.half is Half.FORWARD and home.stage <= stage:
            return Unit(Half.FORWARD, stage)
        elif home.stage > stage:
            return Unit(Half.BACKWARD, stage + 1)
        raise PipelineError(
            f"{unit} reads {node.name!r} ({node.target}), computed later in {home}; the stage "
            "assignment is not causal. Check that the split points follow the forward order"
        )

    def build(self, unit: Unit, outputs: _OutputRoots) -> StageProgram:
        stage, last = unit.stage, self.partition.num_stages - 1
        forward = unit.half is Half.FORWARD
        previous = (
            (Unit(Half.FORWARD, stage - 1) if stage > 0 else None)
            if forward
            else (Unit(Half.BACKWARD, stage + 1) if stage < last else None)
        )
        following = (
            (Unit(Half.FORWARD, stage + 1) if stage < last else None)
            if forward
            else (Unit(Half.BACKWARD, stage - 1) if stage > 0 else None)
        )
        own_forward = Unit(Half.FORWARD, stage)
        own_backward = Unit(Half.BACKWARD, stage)
        received = self._ordered(self.channels.get((previous, unit), ()) if previous else ())
        restored = () if forward else self._ordered(self.channels.get((own_forward, unit), ()))
        sent = self._ordered(self.channels.get((unit, following), ()) if following else ())
        stashed = self._ordered(self.channels.get((unit, own_backward), ())) if forward else ()

        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        ambient = self._ordered(self.ambient.get(unit, ()))
        by_kind = {
            kind: tuple(n for n in ambient if self.kinds[n] == kind)
            for kind in ("parameter", "buffer", "batch")
        }
        for node in (*by_kind["parameter"], *by_kind["buffer"], *by_kind["batch"]):
            label = self.names[node] if node is self.denominator else node.name
            env[node] = _placeholder(graph, node, label)
        for node in received:
            env[node] = _placeholder(graph, node, f"received_{node.name}")
        for node in restored:
            env[node] = _placeholder(graph, node, f"stashed_{node.name}")
        computed = self.computed.get(unit, set())
        for node in self.program.graph.nodes:
            if node in computed:
                env[node] = graph.node_copy(node, env.__getitem__)

        results = [env[n] for n in (*sent, *stashed)]
        has_loss = outputs.loss is not None and outputs.loss[0] == unit
        if outputs.loss is not None and has_loss:
            results.append(env[outputs.loss[1]])
        returned = outputs.outputs if outputs.outputs_unit == unit else ()
        results += [env[node] for node in returned]
        updates = [name for name, (u, _) in outputs.buffer_updates.items() if u == unit]
        results += [env[outputs.buffer_updates[name][1]] for name in updates]
        gradients = []
        for name, by_stage in outputs.gradient_terms.items():
            terms = by_stage.get(stage) if not forward else None
            if not terms:
                continue
            total = env[terms[0]]
            layout = _planned_spec(terms[0])
            for term in terms[1:]:
                total = graph.call_function(aten.add.Tensor, (total, env[term]))
                ir.annotate(total, ir.Region(ir.Phase.BACKWARD, ""))
                ir.annotate(total, ir.require(terms[0], ir.ValueMeta))
                if layout is not None:  # planned: the sum is laid out like its first term
                    ir.annotate(total, Sharding(Strategy((layout,), (layout, layout))))
            gradients.append(name)
            results.append(total)
        graph.output(tuple(results))
        graph.lint()
        module = fx.GraphModule(self.program.graph_module, graph, class_name=f"Stage{stage}")
        return StageProgram(
            unit=unit,
            graph_module=module,
            parameters=tuple(self.names[n] for n in by_kind["parameter"]),
            buffers=tuple(self.names[n] for n in by_kind["buffer"]),
            batch=tuple(self.names[n] for n in by_kind["batch"]),
            received=tuple(_value(n) for n in received),
            restored=tuple(_value(n) for n in restored),
            sent=tuple(_value(n) for n in sent),
            stashed=tuple(_value(n) for n in stashed),
            loss=has_loss,
            buffer_updates=tuple(updates),
            gradients=tuple(gradients),
            outputs=tuple(_value(node) for node in returned),
        )

    def _ordered(self, nodes: Iterable[fx.Node]) -> tuple[fx.Node, ...]:
        return tuple(sorted(nodes, key=self.position.__getitem__))


def _planned_spec(node: fx.Node) -> Spec | None:
    try:
        return value_spec(node)
    except LoweringError:
        return None


def _placeholder(graph: fx.Graph, source: fx.Node, name: str) -> fx.Node:
    node = graph.placeholder(name)
    node.meta = dict(source.meta)
    return node


def _value(node: fx.Node) -> Value:
    meta = ir.require(node, ir.ValueMeta)
    if meta.multiple or meta.outputs[0] is None:
        raise PipelineError(
            f"{node.name!r} ({node.target}) crosses a stage boundary but is not a single tensor"
        )
    return Value(node.name, meta.tensor)
