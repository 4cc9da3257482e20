"""The Program: one training step as a functional torch.fx graph, plus its signature.

A Program's graph takes, in this order, every parameter, every buffer, every batch tensor
(model inputs, then loss targets) and every random input (the draws of the step's random ops,
see :mod:`fxpar.rng`) as placeholders, and returns a flat tuple::

    (loss, *gradients, *buffer_updates)

``gradients`` has one entry per trainable parameter, in :attr:`Signature.gradients` order;
``buffer_updates`` holds the new value of each buffer the step writes (BatchNorm running
statistics, for example). The graph is functional: it mutates nothing, so running it twice on the
same inputs gives the same outputs, and the caller decides what to do with the new buffers.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn
from torch.fx._lazy_graph_module import _LazyGraphModule

from fxpar import ir
from fxpar.cluster import Cluster
from fxpar.errors import AnnotationError, FxparError, SymbolicShapeError
from fxpar.ir.placement import device_of, place
from fxpar.ir.rng import RandomDraw, draw_all


@dataclass(frozen=True)
class Signature:
    """Names of a Program's inputs and outputs, in graph order."""

    parameters: tuple[str, ...]
    buffers: tuple[str, ...]
    inputs: tuple[str, ...]
    """Batch tensors: the model's inputs, then the loss function's targets."""
    gradients: tuple[str, ...]
    """Parameters that get a gradient (the trainable ones), in output order."""
    buffer_updates: tuple[str, ...]
    """Buffers the step writes, in output order."""
    random: tuple[RandomDraw, ...] = ()
    """How to draw each random input, in graph order (``draw.name`` names its placeholder)."""
    outputs: tuple[str, ...] = ("loss",)
    """The values the graph returns before the gradients: ``("loss",)`` for a training or loss
    step, the model's output tensors (``output_0``, ...) for a forward-only one."""
    output_tree: OutputTree | None = field(default=None, compare=False)
    """For a forward-only Program, how its output tensors make the model's output."""

    @property
    def random_inputs(self) -> tuple[str, ...]:
        """Names of the random inputs, in graph order."""
        return tuple(draw.name for draw in self.random)

    @property
    def step_inputs(self) -> tuple[str, ...]:
        """Everything a step feeds besides the state: the batch, then the random inputs."""
        return self.inputs + self.random_inputs

    @property
    def placeholder_names(self) -> tuple[str, ...]:
        """Every placeholder's name, in graph order."""
        return self.parameters + self.buffers + self.step_inputs

    @property
    def num_placeholders(self) -> int:
        return len(self.placeholder_names)

    @property
    def is_forward(self) -> bool:
        """Whether the Program is the model's forward alone (no loss, no gradients)."""
        return self.output_tree is not None

    @property
    def num_outputs(self) -> int:
        return len(self.outputs) + len(self.gradients) + len(self.buffer_updates)

    def name_outputs(self, outputs: Sequence[torch.Tensor]) -> StepResult:
        """Name a flat ``(*outputs, *gradients, *buffer_updates)`` tuple."""
        first, num_grads = len(self.outputs), len(self.gradients)
        return StepResult(
            loss=None if self.is_forward else outputs[0],
            gradients=dict(zip(self.gradients, outputs[first : first + num_grads], strict=True)),
            buffers=dict(zip(self.buffer_updates, outputs[first + num_grads :], strict=True)),
            outputs=tuple(outputs[:first]),
        )


@dataclass(frozen=True)
class StepResult:
    """What one step computes, by name: a training step's loss, gradients and new buffers; a
    forward-only step's ``outputs`` (``loss`` None, no gradients)."""

    loss: torch.Tensor | None
    gradients: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    outputs: tuple[torch.Tensor, ...] = ()


@dataclass(frozen=True, eq=False)
class OutputTree:
    """How a model's output (a tensor, a tuple, a dict, a Hugging Face ``ModelOutput``: any
    pytree) is made of the tensors a forward-only Program returns. Leaves that are not tensors
    (None, flags) are kept as they were when the model was traced."""

    spec: pytree.TreeSpec
    constants: tuple[object, ...]
    """Every leaf, in flattening order, with None where a tensor goes."""
    tensor_positions: tuple[int, ...]

    @staticmethod
    def of(output: object) -> OutputTree:
        leaves, spec = pytree.tree_flatten(output)
        positions = tuple(i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor))
        if not positions:
            raise FxparError(
                f"the model returned {type(output).__name__} with no tensor in it; there is "
                "nothing to compute"
            )
        constants = tuple(None if i in positions else leaf for i, leaf in enumerate(leaves))
        return OutputTree(spec, constants, positions)

    def tensors(self, output: object) -> tuple[torch.Tensor, ...]:
        """The tensors of ``output`` (shaped like the traced one), in Program order."""
        leaves = pytree.tree_leaves(output)
        return tuple(leaves[i] for i in self.tensor_positions)

    def rebuild(self, tensors: Sequence[object]) -> Any:
        """The model's output with ``tensors`` in the places of the traced ones."""
        leaves = list(self.constants)
        for position, tensor in zip(self.tensor_positions, tensors, strict=True):
            leaves[position] = tensor
        return pytree.tree_unflatten(leaves, self.spec)


A = TypeVar("A")


class Program:
    """A captured training step: a GraphModule of ATen ops and its :class:`Signature`.

    Passes read and annotate ``program.graph``; :meth:`run` executes it on real tensors.

    ``cluster`` is the target the Program is being compiled for, as a module's target triple is
    in LLVM: None after capture, set by :func:`fxpar.plan` and :func:`fxpar.compile` before the
    passes run, and read by the passes whose answer depends on the mesh (the candidate
    strategies, the solver). Facts about the whole Program (the problem a solver was given and
    its answer, say) are program-level annotations: :meth:`annotate`, :meth:`get` and
    :meth:`require` mirror :func:`fxpar.ir.annotate` for nodes.
    """

    def __init__(self, graph_module: fx.GraphModule, signature: Signature) -> None:
        self.graph_module = graph_module
        self.signature = signature
        self.cluster: Cluster | None = None
        self._annotations: dict[type, object] = {}

    def copy(self) -> Program:
        """A Program of the same graph whose graph and annotations (the node-level ones in
        ``node.meta``, and the program-level ones) change independently of this one's, as
        planning one program for several meshes needs. torch.fx copies a graph's node
        metadata shallowly, so the annotation dicts are copied here too. The copy shares the
        original's attributes (constant tensors) and writes its Python code only when it is
        run or read (torch's lazy GraphModule): a plan never runs its program, and writing the
        code of a large step takes seconds."""
        graph_module = _LazyGraphModule(self.graph_module, copy.deepcopy(self.graph_module.graph))
        for node in graph_module.graph.nodes:
            if ir.META_KEY in node.meta:
                node.meta[ir.META_KEY] = dict(node.meta[ir.META_KEY])
        twin = Program(graph_module, self.signature)
        twin.cluster = self.cluster
        twin._annotations = dict(self._annotations)
        return twin

    def annotate(self, value: object) -> None:
        """Attach a program-level fact, replacing any earlier one of the same type."""
        self._annotations[type(value)] = value

    def get(self, kind: type[A]) -> A | None:
        """The program-level annotation of type ``kind``, or None."""
        return self._annotations.get(kind)  # type: ignore[return-value]

    def annotations(self) -> Mapping[type, object]:
        """Every program-level annotation by its type, read-only (a copy)."""
        return dict(self._annotations)

    def require(self, kind: type[A]) -> A:
        """The program-level annotation of type ``kind``; raises AnnotationError if missing."""
        found = self.get(kind)
        if found is None:
            raise AnnotationError(
                f"the Program has no {kind.__name__} annotation; run the pass that produces it "
                "first (see fxpar.passes.default_passes())"
            )
        return found

    def require_cluster(self, step: str) -> Cluster:
        """The cluster the Program is compiled for; ``step`` names who asks, for the error."""
        if self.cluster is None:
            raise FxparError(
                f"{step} needs to know the cluster: set program.cluster = fxpar.Cluster(...) "
                "first, or run the passes through fxpar.plan / fxpar.compile, which set it"
            )
        return self.cluster

    @property
    def graph(self) -> fx.Graph:
        return self.graph_module.graph

    def nodes(self, phase: ir.Phase | None = None) -> Iterator[fx.Node]:
        """Nodes in graph order, optionally only those of one phase."""
        for node in self.graph.nodes:
            if phase is None or ir.require(node, ir.Region).phase is phase:
                yield node

    def output_metas(self) -> tuple[ir.TensorMeta, ...]:
        """The shape and dtype of each of :attr:`Signature.outputs`: the loss, or a forward's
        outputs."""
        results = self.graph.output_node().args[0]
        assert isinstance(results, (tuple, list))
        leading = results[: len(self.signature.outputs)]
        return tuple(ir.require(node, ir.ValueMeta).tensor for node in leading)  # type: ignore[arg-type]

    def placeholders(self) -> dict[str, fx.Node]:
        """Placeholder nodes by the parameter, buffer or input name they stand for."""
        nodes = [n for n in self.graph.nodes if n.op == "placeholder"]
        return dict(zip(self.signature.placeholder_names, nodes, strict=True))

    def recompile(self) -> None:
        """Regenerate the Python code after a pass edited the graph."""
        self.graph_module.recompile()

    def __call__(self, *flat_inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Run on tensors in placeholder order; returns the flat output tuple."""
        if len(flat_inputs) != self.signature.num_placeholders:
            raise FxparError(
                f"Program expects {self.signature.num_placeholders} tensors "
                f"({len(self.signature.parameters)} parameters, {len(self.signature.buffers)} "
                f"buffers, {len(self.signature.inputs)} batch tensors, "
                f"{len(self.signature.random)} random inputs), got {len(flat_inputs)}"
            )
        return tuple(place(self.graph_module, device_of(flat_inputs))(*flat_inputs))

    def flat_inputs(
        self,
        state: nn.Module | Mapping[str, torch.Tensor],
        *batch: torch.Tensor,
        random: Sequence[torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """The placeholders' tensors in order: parameters and buffers taken by name from
        ``state`` (the model itself, or a mapping), then ``batch`` (model inputs, then targets,
        in :attr:`Signature.inputs` order), then the random inputs: ``random`` if given, else
        drawn now from torch's default generator, exactly as the eager step would draw them."""
        if isinstance(state, nn.Module):
            state = named_state(state)
        if len(batch) != len(self.signature.inputs):
            raise FxparError(
                f"expected {len(self.signature.inputs)} batch tensors "
                f"{list(self.signature.inputs)}, got {len(batch)}"
            )
        names = self.signature.parameters + self.signature.buffers
        missing = [name for name in names if name not in state]
        if missing:
            raise FxparError(f"state has no tensor for {missing[:5]} ({len(missing)} missing)")
        if random is None:
            random = draw_all(self.signature.random)
        if len(random) != len(self.signature.random):
            raise FxparError(
                f"expected {len(self.signature.random)} random inputs, got {len(random)}"
            )
        return [state[name].detach() for name in names] + list(batch) + list(random)

    def run(
        self,
        state: nn.Module | Mapping[str, torch.Tensor],
        *batch: torch.Tensor,
        random: Sequence[torch.Tensor] | None = None,
    ) -> StepResult:
        """Run one step on real tensors (arguments as for :meth:`flat_inputs`): with
        ``torch.manual_seed(s)`` first, it computes exactly what the eager step would.

        Nothing in ``state`` is modified; new buffer values are in the result.
        """
        with torch.no_grad():
            outputs = self(*self.flat_inputs(state, *batch, random=random))
        return self.signature.name_outputs(outputs)

    def code(self) -> str:
        """The graph as readable Python."""
        return self.graph_module.code

    def __repr__(self) -> str:
        counts = {phase: 0 for phase in ir.Phase}
        for node in self.graph.nodes:
            region = ir.get(node, ir.Region)
            if region is not None:
                counts[region.phase] += 1
        return (
            f"Program({len(self.signature.parameters)} parameters, "
            f"{len(self.signature.buffers)} buffers, inputs={list(self.signature.inputs)}, "
            f"{counts[ir.Phase.FORWARD]} forward and {counts[ir.Phase.BACKWARD]} backward nodes)"
        )


def require_concrete_shapes(program: Program, step: str) -> None:
    """Raise :class:`~fxpar.errors.SymbolicShapeError` if ``program`` was captured with
    ``dynamic=True``. ``step`` names what the caller was asked to do, for the message.

    Checked up front because the sharding rules compare sizes with the mesh (does a dim split
    evenly? is a view's dim merged or split?), which a symbol cannot answer: deep inside a rule
    that surfaces as sympy's "cannot determine truth value of Relational"."""
    names = {node: name for name, node in program.placeholders().items()}
    symbolic = [
        (names.get(node, node.name), meta)
        for node in program.graph.nodes
        for meta in (ir.get(node, ir.ValueMeta) or ir.ValueMeta(())).tensors
        if meta.is_symbolic
    ]
    if symbolic:
        placeholders = set(names.values())
        inputs = [(name, meta) for name, meta in symbolic if name in placeholders]
        shown = ", ".join(f"{name!r} {meta}" for name, meta in (inputs or symbolic)[:3])
        raise SymbolicShapeError(
            f"{step} needs concrete shapes, but this Program has symbolic ones ({shown}): it "
            "was captured with dynamic=True. How a tensor is split over the mesh depends on "
            "its sizes, so capture again with dynamic=False and example inputs of the size you "
            "will train with (one capture and plan per batch shape)"
        )


def named_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``model`` by qualified name, tied ones under each of
    their names (the names a Program's placeholders use)."""
    return {
        **dict(model.named_parameters(remove_duplicate=False)),
        **dict(model.named_buffers(remove_duplicate=False)),
    }


def state_dict_aliases(model: nn.Module, names: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """For each of ``names`` (a Program's parameters and buffers), every key of
    ``model.state_dict()`` that refers to the same tensor: tied weights have several."""
    state = model.state_dict(keep_vars=True)
    first: dict[int, str] = {}
    for name in names:
        if name in state:
            first.setdefault(id(state[name]), name)
    aliases: dict[str, list[str]] = {}
    for key, tensor in state.items():
        if id(tensor) in first:
            aliases.setdefault(first[id(tensor)], []).append(key)
    return {name: tuple(keys) for name, keys in aliases.items()}
