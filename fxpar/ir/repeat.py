"""Capture a deep model by tracing six of its repeated layers and stamping the others.

Tracing is the dearest part of planning a large model on a small machine: ``make_fx`` sends
every op through fake tensors, functionalization and the proxy tracer, in Python, so its time
grows with the number of ops, whatever their sizes, and a model of many layers is traced for
long before any planning starts. Yet a decoder's layers are one layer repeated, and so are
their ops in the captured step. :func:`capture_repeated` traces the model with its layer
container cut to its first :data:`TRACED` layers, then builds the step of all ``N`` layers
from that graph:

- Layers 0-2 are kept as traced; layer 3, the *template*, is copied for layers 3 to ``N - 3``;
  the traced layers 4 and 5 become layers ``N - 2`` and ``N - 1``. (The first and last layers
  may differ from the others: T5's first block computes the position bias every block reads,
  the last one feeds the final norm.)
- In the traced graph each layer's ops run in *sweeps*: the parameter placeholders and their
  mixed-precision casts in layer order, the forward in layer order, the backward and the
  gradients' casts in reverse order, the gradients in the output in layer order. Every run of
  the template's ops in a sweep becomes ``N - 5`` runs, one per copy, in the sweep's direction.
- A copy's op reads what the template's op reads, shifted to the copy's layer: a value of its
  own layer comes from its own copy, a value of the layer before (the residual stream in the
  forward) from the copy before, a value of the layer after (the gradient in the backward)
  from the copy after, anything else (the rotary tables, the attention mask) as it is.

Stamping is applied only where that reading holds, and checked before any copy is made:

- every layer from the template on is built alike (module classes, parameter and buffer shapes,
  dtypes and ``requires_grad``, and plain attributes such as an attention kind; an attribute
  equal to the layer's own index, such as ``layer_idx``, is a number, not a difference);
- the traced layers 2, 3 and 4 have op for op the same ops, values, regions and annotations,
  and read their inputs alike: from the same role in their own layer, in the layer before and
  in the layer after, or from the same outside value;
- nothing outside layers 2-4 reads the template's values (the output aside), the template's
  runs sit between runs of layers 2 and 4 in every sweep, and it draws no random numbers and
  runs no checkpointed call (their numbering follows the layers).

The result is the Program a full capture gives, up to node names and autograd sequence numbers
(tests/test_repeat.py compares them op for op and runs both): it plans and runs like it.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.fx._lazy_graph_module import _LazyGraphModule

from fxpar import ir
from fxpar.errors import CaptureError
from fxpar.ir.capture import LossFn, capture, placeholder_identifier
from fxpar.ir.program import Program, Signature

logger = logging.getLogger(__name__)

TRACED = 6
"""How many layers are traced: the first three (the first ones may differ from the others; the
third is compared with the template), the template, one after it (compared too) and the last
(which may differ)."""

TEMPLATE = 3
"""The traced layer copied for every layer not traced."""

_PLAIN = (int, float, str, bool, type(None))


@dataclass(frozen=True)
class StampedLayers:
    """Program-level record of a step built by :func:`capture_repeated`: ``count`` layers of
    ``container``, of which ``traced`` were traced and the others stamped from layer
    ``template``."""

    container: str
    count: int
    traced: int = TRACED
    template: int = TEMPLATE

    def describe(self) -> str:
        return (
            f"{self.container}: {self.traced} of {self.count} layers traced, layers "
            f"{self.template}-{self.count - self.traced + self.template} stamped from layer "
            f"{self.template}"
        )


def capture_repeated(
    model: nn.Module,
    example_inputs: Sequence[Any] | Mapping[str, Any],
    loss_fn: LossFn | None = None,
    *,
    layers: str | None = None,
    check: bool = False,
    **options: Any,
) -> Program:
    """:func:`fxpar.capture`, tracing only :data:`TRACED` of the model's repeated layers (the
    module docstring). ``layers``: the module path of the container of repeated layers
    (``"model.layers"``); None finds the longest ``nn.ModuleList`` or ``nn.Sequential`` whose
    layers are built alike. ``options`` are :func:`fxpar.capture`'s.

    Where no container qualifies, or its traced layers do not repeat as stamping needs, the
    whole model is captured (and the reason logged); where ``layers`` names a container that
    does not qualify, :class:`~fxpar.errors.CaptureError` says why. The Program carries a
    :class:`StampedLayers` record when it was stamped.

    What is not checked is code outside the layers that depends on how many there are (a
    residual scaled by ``1 / len(self.layers)``, say): ``check=True`` also traces
    ``TRACED + 1`` layers and compares them op for op with the traced layers stamped to as
    many, which catches it (the capture then takes about twice as long)."""
    container = _container(model, layers)
    if isinstance(container, str):
        if layers is not None:
            raise CaptureError(f"cannot stamp the layers of {layers!r}: {container}")
        logger.info("capturing every layer: %s", container)
        return capture(model, example_inputs, loss_fn, **options)
    path, stack = container
    count = len(stack._modules)
    try:
        with _first_layers(stack, TRACED):
            traced = capture(model, example_inputs, loss_fn, **options)
        stamp = _Stamp(traced, path)
        stamped = stamp.program(model, count)
        if check:
            with _first_layers(stack, TRACED + 1):
                more = capture(model, example_inputs, loss_fn, **options)
                twin = stamp.program(model, TRACED + 1)
            if canonical(twin) != canonical(more):
                raise _NotRepeated(
                    f"stamped to {TRACED + 1} layers differ from {TRACED + 1} layers traced: "
                    "the model's code depends on how many layers it has"
                )
    except (_NotRepeated, CaptureError) as reason:
        if layers is not None:
            raise CaptureError(f"cannot stamp the layers of {layers!r}: {reason}") from None
        logger.info("capturing every layer: the layers of %r %s", path, reason)
        return capture(model, example_inputs, loss_fn, **options)
    record = StampedLayers(path, count)
    stamped.annotate(record)
    logger.info("captured %s", record.describe())
    return stamped


def canonical(program: Program) -> list[tuple[Any, ...]]:
    """Every node of ``program`` as what it computes, without names: op, target (a constant
    as its dtype, shape and values), inputs by position, region (phase and module) and other
    annotations. Equal for two Programs that compute alike in the same order."""
    nodes = list(program.graph.nodes)
    position = {node: index for index, node in enumerate(nodes)}
    found = []
    for node in nodes:
        annotations = dict(ir.all_annotations(node))
        region = annotations.pop(ir.Region, None)
        assert region is None or isinstance(region, ir.Region)
        others = sorted(((kind.__name__, repr(value)) for kind, value in annotations.items()))
        inputs = _flatten((node.args, node.kwargs))
        found.append(
            (
                node.op,
                _target(program, node),
                [f"%{position[a]}" if isinstance(a, fx.Node) else a for a in inputs],
                region and (region.phase, region.module),
                others,
            )
        )
    return found


class _NotRepeated(Exception):
    """The traced layers do not repeat as stamping needs (the message says where)."""


def _container(model: nn.Module, path: str | None) -> tuple[str, nn.Module] | str:
    """The container of repeated layers to stamp (its path and module), or why there is none."""
    if path is not None:
        try:
            found = model.get_submodule(path)
        except AttributeError:
            return "the model has no such module"
        candidates = [(path, found)]
    else:
        candidates = [
            (name, module)
            for name, module in model.named_modules()
            if isinstance(module, (nn.ModuleList, nn.Sequential))
        ]
    reasons = []
    best: tuple[str, nn.Module] | None = None
    for name, module in candidates:
        reason = _not_stampable(module)
        if reason is not None:
            reasons.append(f"{name or '<root>'}: {reason}")
        elif best is None or len(module._modules) > len(best[1]._modules):
            best = (name, module)
    if best is not None:
        return best
    return "; ".join(reasons) if reasons else "the model has no nn.ModuleList or nn.Sequential"


def _not_stampable(stack: nn.Module) -> str | None:
    if not isinstance(stack, (nn.ModuleList, nn.Sequential)):
        return f"a {type(stack).__name__}, not an nn.ModuleList or nn.Sequential"
    if len(stack._modules) <= TRACED:
        return f"{len(stack._modules)} layers: stamping needs more than the {TRACED} it traces"
    names = list(stack._modules)
    if names != [str(i) for i in range(len(names))]:
        return "its layers are not numbered 0, 1, ..."
    builds = [_build(layer) for layer in stack]
    # An attribute equal to its layer's index in every layer (``layer_idx``) is a number.
    numbers = {
        key
        for key, value in builds[0][1].items()
        if type(value) is int
        and all(type(b[1].get(key)) is int and b[1][key] == i for i, b in enumerate(builds))
    }
    shapes = [
        (tree, {key: value for key, value in plain.items() if key not in numbers})
        for tree, plain in builds
    ]
    for index in range(TEMPLATE + 1, len(shapes)):
        if shapes[index] != shapes[TEMPLATE]:
            return f"layers {TEMPLATE} and {index} are built differently"
    return None


def _build(layer: nn.Module) -> tuple[tuple[Any, ...], dict[tuple[str, str], Any]]:
    """What must agree between two layers for one to stand for the other: the module tree,
    the parameters' and buffers' shapes, dtypes and trainability; and the plain attributes,
    by (module, name)."""
    tree: list[Any] = []
    plain: dict[tuple[str, str], Any] = {}
    for name, module in layer.named_modules():
        tree.append((name, type(module)))
        for key, value in vars(module).items():
            if not key.startswith("_") and isinstance(value, _PLAIN):
                plain[name, key] = value
    for name, tensor in (*layer.named_parameters(), *layer.named_buffers()):
        tree.append((name, tuple(tensor.shape), tensor.dtype, tensor.requires_grad))
    return tuple(tree), plain


@contextmanager
def _first_layers(stack: nn.Module, count: int) -> Iterator[None]:
    """``stack`` holding only its first ``count`` layers for the block."""
    kept = stack._modules
    stack._modules = OrderedDict(list(kept.items())[:count])
    try:
        yield
    finally:
        stack._modules = kept


@dataclass(frozen=True)
class _Ref:
    """How a template-like node reads one input: ``kind`` ``same``, ``prev`` or ``next`` (a
    value of its own layer, the one before, the one after, at ``role``), or ``fixed``
    (``node`` itself)."""

    kind: str
    role: int = -1
    node: fx.Node | None = None


def layer_pattern(container: str) -> re.Pattern[str]:
    """Matches a module or state path inside a layer of ``container`` (group 1: its index)."""
    prefix = re.escape(f"{container}.") if container else ""
    return re.compile("^" + prefix + r"(\d+)(?=\.|$)")


def layer_of(node: fx.Node, pattern: re.Pattern[str]) -> int:
    """The index of the layer ``node``'s module is in, by :func:`layer_pattern`; -1 outside
    the layers (the output among them)."""
    if node.op == "output":
        return -1
    region = ir.get(node, ir.Region)
    found = pattern.match(region.module) if region is not None else None
    return int(found.group(1)) if found else -1


class _Stamp:
    """The traced step of :data:`TRACED` layers, checked, to be stamped to any number."""

    def __init__(self, traced: Program, container: str) -> None:
        self.traced = traced
        self.container = container
        self.pattern = layer_pattern(container)
        self.nodes = list(traced.graph.nodes)
        self.label = {node: layer_of(node, self.pattern) for node in self.nodes}
        self.layers: dict[int, list[fx.Node]] = {i: [] for i in range(TRACED)}
        for node in self.nodes:
            if self.label[node] >= 0:
                self.layers[self.label[node]].append(node)
        placeholders = [node for node in self.nodes if node.op == "placeholder"]
        self.state_names = dict(zip(placeholders, traced.signature.placeholder_names, strict=True))
        self.role = {node: i for nodes in self.layers.values() for i, node in enumerate(nodes)}
        self._check()

    # --- reading the traced step -------------------------------------------------------------

    def _module(self, node: fx.Node) -> str:
        """The node's module path with its layer index left out."""
        region = ir.require(node, ir.Region)
        return self.pattern.sub("#", region.module, count=1)

    def _refs(self, node: fx.Node) -> list[Any]:
        """``node``'s args and kwargs flattened, each input node read as a :class:`_Ref`."""
        layer = self.label[node]

        def read(arg: Any) -> Any:
            if not isinstance(arg, fx.Node):
                return arg
            shift = self.label[arg] - layer
            if self.label[arg] >= 0 and shift in (-1, 0, 1):
                kind = {-1: "prev", 0: "same", 1: "next"}[shift]
                return _Ref(kind, self.role[arg])
            return _Ref("fixed", node=arg)

        return [read(item) for item in _flatten((node.args, node.kwargs))]

    def _facts(self, node: fx.Node) -> tuple[Any, ...]:
        annotations = dict(ir.all_annotations(node))
        region = annotations.pop(ir.Region)
        assert isinstance(region, ir.Region)
        return (
            node.op,
            None if node.op == "placeholder" else _target(self.traced, node),
            region.phase,
            self._module(node),
            tuple(sorted(((kind.__name__, value) for kind, value in annotations.items()), key=str)),
        )

    def _check(self) -> None:
        template, before, after = (self.layers[TEMPLATE + d] for d in (0, -1, 1))
        if not len(before) == len(template) == len(after):
            raise _NotRepeated(
                f"trace to {len(before)}, {len(template)} and {len(after)} ops in layers "
                f"{TEMPLATE - 1}-{TEMPLATE + 1}"
            )
        if self.traced.signature.random:
            drawing = {draw.name for draw in self.traced.signature.random}
            if any(n.name in drawing for n in template):
                raise _NotRepeated("draw random numbers (dropout)")
        for node in template:
            if ir.get(node, ir.Checkpointed) is not None:
                raise _NotRepeated("run checkpointed calls")
        updated = set(self.traced.signature.buffer_updates)
        if any(self._is_layer_state(name) for name in updated):
            raise _NotRepeated("update buffers in the step")
        for role, node in enumerate(template):
            self._check_alike(before[role], node, compare=("same", "next"))
            self._check_alike(node, after[role], compare=("same", "prev"))
        near = {TEMPLATE - 1, TEMPLATE, TEMPLATE + 1}
        for node in self.nodes:
            if node.op == "output" or self.label[node] in near:
                continue
            for arg in node.all_input_nodes:
                if self.label[arg] == TEMPLATE:
                    raise _NotRepeated(
                        f"are read by {node.name} outside layers {TEMPLATE - 1}-{TEMPLATE + 1}"
                    )
        self.runs = self._runs(self.nodes)

    def _is_layer_state(self, name: str) -> bool:
        return self.pattern.match(name) is not None

    def _check_alike(self, first: fx.Node, second: fx.Node, compare: tuple[str, ...]) -> None:
        """``first`` and ``second`` (the same role in consecutive layers) do the same thing
        and read their inputs alike; roles are compared for the ``compare`` kinds (the others
        reach layers outside the three, whose ops need not line up)."""
        where = f"layers {self.label[first]} and {self.label[second]} differ at {second.name}"
        if self._facts(first) != self._facts(second):
            raise _NotRepeated(where)
        ones, twos = self._refs(first), self._refs(second)
        if len(ones) != len(twos):
            raise _NotRepeated(where)
        for one, two in zip(ones, twos, strict=True):
            if isinstance(one, _Ref) != isinstance(two, _Ref):
                raise _NotRepeated(where)
            if not isinstance(one, _Ref):
                if not _same_constant(one, two):
                    raise _NotRepeated(where)
                continue
            assert isinstance(two, _Ref)
            if one.kind != two.kind or (one.kind == "fixed" and one.node is not two.node):
                raise _NotRepeated(where)
            if one.kind in compare and one.role != two.role:
                raise _NotRepeated(where)

    def _runs(self, items: Sequence[fx.Node]) -> list[tuple[list[fx.Node], int]]:
        """``items`` cut into runs of one layer label, each with its direction: 1 or -1 for a
        run of the template (between runs of the layers around it), else 0."""
        runs: list[list[fx.Node]] = []
        for item in items:
            if runs and self.label[runs[-1][0]] == self.label[item]:
                runs[-1].append(item)
            else:
                runs.append([item])
        found = []
        for index, run in enumerate(runs):
            if self.label[run[0]] != TEMPLATE:
                found.append((run, 0))
                continue
            around = tuple(
                self.label[runs[i][0]] if 0 <= i < len(runs) else None
                for i in (index - 1, index + 1)
            )
            if around == (TEMPLATE - 1, TEMPLATE + 1):
                found.append((run, 1))
            elif around == (TEMPLATE + 1, TEMPLATE - 1):
                found.append((run, -1))
            else:
                raise _NotRepeated(
                    f"run ops of layer {TEMPLATE} between layers {around} (at {run[0].name}), "
                    "not in a sweep over the layers"
                )
        return found

    # --- building the stamped step -----------------------------------------------------------

    def program(self, model: nn.Module, count: int) -> Program:
        """The step of ``model``, which has ``count`` layers (``model`` as it holds them)."""
        copies = range(TEMPLATE, count - (TRACED - TEMPLATE) + 1)
        last = copies[-1]
        layer_of = {TEMPLATE + 1: last + 1, TEMPLATE + 2: last + 2}
        seq_shift = self._seq_shifts(len(copies))
        graph = fx.Graph()
        new: dict[tuple[fx.Node, int], fx.Node] = {}

        def placed(node: fx.Node) -> int:
            return layer_of.get(self.label[node], self.label[node])

        def lookup(arg: fx.Node, reader: int) -> fx.Node:
            """The new node of ``arg`` as read from (new) layer ``reader``."""
            label = self.label[arg]
            if label == TEMPLATE:
                if reader in copies:
                    return new[arg, reader]
                # Read from the traced layer before (the backward) or after (the forward).
                return new[arg, copies[0] if reader < copies[0] else last]
            if reader in copies and label in (TEMPLATE - 1, TEMPLATE + 1):
                # A neighbour's value, read by a copy: the copy before's or the copy after's
                # (as traced where the neighbour is a traced layer).
                template = self.layers[TEMPLATE][self.role[arg]]
                if label == TEMPLATE - 1 and reader != copies[0]:
                    return new[template, reader - 1]
                if label == TEMPLATE + 1 and reader != last:
                    return new[template, reader + 1]
            return new[arg, -1]

        def emit(node: fx.Node, layer: int) -> None:
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda a: lookup(a, layer))
            if node.op == "placeholder":
                made = graph.placeholder(placeholder_identifier(self._renamed_state(node, layer)))
            else:
                made = graph.create_node(node.op, node.target, args, kwargs, name=node.name)
            made.meta = _copied_meta(node)
            region = ir.get(node, ir.Region)
            if region is not None and self.label[node] >= 0:
                module = self._moved(region.module, layer)
                seq = region.seq_nr
                if seq is not None and layer in seq_shift:
                    seq += seq_shift[layer].get(seq, 0)
                ir.annotate(made, dataclasses.replace(region, module=module, seq_nr=seq))
            key = layer if self.label[node] == TEMPLATE else -1
            new[node, key] = made

        output = None
        for run, direction in self.runs:
            if direction == 0:
                for node in run:
                    if node.op == "output":
                        output = node
                        continue
                    emit(node, placed(node))
                continue
            for layer in copies if direction > 0 else reversed(copies):
                for node in run:
                    emit(node, layer)
        assert output is not None
        (values,) = output.args
        stamped: list[fx.Node] = []
        for run, direction in self._runs(list(values)):  # type: ignore[arg-type]
            if direction == 0:  # read as the output reads them: after every layer
                stamped.extend(lookup(node, last + 3) for node in run)
                continue
            order = copies if direction > 0 else reversed(copies)
            stamped.extend(new[node, layer] for layer in order for node in run)
        graph.output(tuple(stamped)).meta = _copied_meta(output)
        signature = self._signature(model)
        names = [n.target for n in graph.nodes if n.op == "placeholder"]
        if names != [placeholder_identifier(name) for name in signature.placeholder_names]:
            raise _NotRepeated("give placeholders out of the model's order")
        graph.lint()
        program = Program(_LazyGraphModule(self.traced.graph_module, graph), signature)
        program.cluster = self.traced.cluster
        return program

    def _seq_shifts(self, copies: int) -> dict[int, dict[int, int]]:
        """For every copy after the template: the shift of each autograd sequence number the
        template's forward ops made, so that each copy's backward ops point to its own."""
        first: dict[int, fx.Node] = {}
        numbers = set()
        for node in self.nodes:
            region = ir.get(node, ir.Region)
            if region is None or region.seq_nr is None:
                continue
            numbers.add(region.seq_nr)
            if region.phase is ir.Phase.FORWARD:
                first.setdefault(region.seq_nr, node)
        owned = {seq for seq, node in first.items() if self.label[node] == TEMPLATE}
        if not owned:
            return {}
        base, low = max(numbers) + 1, min(owned)
        span = max(owned) - low + 1
        return {
            TEMPLATE + 1 + k: {seq: base + k * span - low for seq in owned}
            for k in range(copies - 1)
        }

    def _renamed_state(self, placeholder: fx.Node, layer: int) -> str:
        """The state name of a parameter or buffer placeholder (its traced name otherwise),
        moved to ``layer``."""
        name = self.state_names[placeholder]
        if self.label[placeholder] < 0:
            return name
        return self._moved(name, layer)

    def _moved(self, path: str, layer: int) -> str:
        """``path`` (a module or state name in a layer) in layer ``layer`` instead."""
        return self.pattern.sub(f"{self.container}.{layer}" if self.container else str(layer),
                                path, count=1)  # fmt: skip

    def _signature(self, model: nn.Module) -> Signature:
        traced = self.traced.signature
        parameters = dict(model.named_parameters())
        trains = bool(traced.gradients)
        return dataclasses.replace(
            traced,
            parameters=tuple(parameters),
            buffers=tuple(name for name, _ in model.named_buffers()),
            gradients=tuple(n for n, p in parameters.items() if p.requires_grad and trains),
        )


def _target(program: Program, node: fx.Node) -> Any:
    """What ``node`` calls, or for a constant (each layer has its own), its value."""
    if node.op == "get_attr":
        return _Constant(getattr(program.graph_module, str(node.target)))
    return node.target


def _copied_meta(node: fx.Node) -> dict[str, Any]:
    """``node``'s metadata for a new node: its annotations a dict of their own."""
    return {**node.meta, ir.META_KEY: dict(node.meta.get(ir.META_KEY, {}))}


class _Constant:
    """A constant tensor of the graph, equal to another of the same dtype, shape and values."""

    def __init__(self, tensor: Any) -> None:
        self.tensor = tensor

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Constant):
            return NotImplemented
        one, two = self.tensor, other.tensor
        if not (isinstance(one, torch.Tensor) and isinstance(two, torch.Tensor)):
            return _same_constant(one, two)
        return (
            one.dtype == two.dtype
            and one.shape == two.shape
            and one.device == two.device
            and (one.device.type == "meta" or bool(torch.equal(one, two)))
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"_Constant({self.tensor!r})"


def _flatten(value: Any) -> list[Any]:
    found: list[Any] = []

    def walk(item: Any) -> None:
        if isinstance(item, (list, tuple)):
            found.append(("seq", len(item)))
            for each in item:
                walk(each)
        elif isinstance(item, dict):
            found.append(("dict", tuple(item)))
            for each in item.values():
                walk(each)
        else:
            found.append(item)

    walk(value)
    return found


def _same_constant(first: Any, second: Any) -> bool:
    if isinstance(first, torch.Tensor) or isinstance(second, torch.Tensor):
        return first is second
    try:
        return bool(first == second) and type(first) is type(second)
    except Exception:
        return False
