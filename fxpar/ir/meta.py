"""Typed annotations on the nodes of a Program's graph.

Every fact fxpar records about a node lives in ``node.meta["fxpar"]``, a dict from annotation
type to one frozen dataclass instance of that type. Nothing else reads or writes that key: use
:func:`annotate`, :func:`get` and :func:`require`. There are no side tables keyed by node name, so
annotations travel with the node when a pass copies or rewrites the graph.

The built-in annotations:

- :class:`ValueMeta`: shape and dtype of each tensor the node produces (set by capture).
- :class:`Region`: forward or backward, and which module's forward the node computes or
  differentiates (set by capture).
- :class:`Cost`: FLOPs and bytes moved (set by :class:`fxpar.passes.AnnotateCost`).
- :class:`Checkpointed`: a forward node the model ran inside ``torch.utils.checkpoint`` (set by
  capture; :class:`fxpar.passes.Rematerialize` recomputes it in the backward).

User passes may attach their own frozen dataclasses the same way.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TypeAlias, TypeVar

import sympy
import torch
import torch.fx as fx

from fxpar.errors import AnnotationError

#: A size is an int, or a sympy expression when the dimension was traced symbolically.
Size: TypeAlias = int | sympy.Expr

META_KEY = "fxpar"

A = TypeVar("A")


def annotate(node: fx.Node, value: object) -> None:
    """Attach ``value`` to ``node``, replacing any earlier annotation of the same type."""
    node.meta.setdefault(META_KEY, {})[type(value)] = value


_NONE: Mapping[type, object] = MappingProxyType({})


def get(node: fx.Node, kind: type[A]) -> A | None:
    """The annotation of type ``kind`` on ``node``, or None."""
    # The planner reads annotations millions of times on a large model: one lookup each.
    return node.meta.get(META_KEY, _NONE).get(kind)


def require(node: fx.Node, kind: type[A]) -> A:
    """The annotation of type ``kind`` on ``node``; raises AnnotationError if it is missing."""
    found = node.meta.get(META_KEY, _NONE).get(kind)
    if found is None:
        raise AnnotationError(
            f"node {node.name!r} ({node.target}) has no {kind.__name__} annotation; "
            f"run the pass that produces it first (see fxpar.passes.default_passes())"
        )
    return found


def all_annotations(node: fx.Node) -> Mapping[type, object]:
    """All annotations on ``node``, read-only."""
    return dict(node.meta.get(META_KEY, {}))


def as_size(value: int | torch.SymInt | sympy.Expr) -> Size:
    """Turn a concrete or symbolic size into an int or a sympy expression."""
    if isinstance(value, torch.SymInt):
        expr = value.node.expr
        return int(expr) if expr.is_number else expr
    if isinstance(value, sympy.Expr):
        return int(value) if value.is_number else value
    return int(value)


def product(sizes: Iterable[Size]) -> Size:
    """The product of sizes, an int whenever no size is symbolic."""
    result: Size = 1
    for size in sizes:
        result = result * size
    return as_size(result) if isinstance(result, sympy.Expr) else result


@dataclass(frozen=True)
class TensorMeta:
    """Shape and dtype of one tensor value."""

    shape: tuple[Size, ...]
    dtype: torch.dtype

    @staticmethod
    def of(tensor: torch.Tensor) -> TensorMeta:
        return TensorMeta(tuple(as_size(s) for s in tensor.shape), tensor.dtype)

    @property
    def numel(self) -> Size:
        return product(self.shape)

    @property
    def nbytes(self) -> Size:
        return product((self.numel, self.dtype.itemsize))

    @property
    def is_symbolic(self) -> bool:
        return any(isinstance(s, sympy.Expr) for s in self.shape)

    def __str__(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return f"{dtype}[{', '.join(str(s) for s in self.shape)}]"


@dataclass(frozen=True)
class ValueMeta:
    """What a node produces: one entry per output, None for a non-tensor output.

    ``multiple`` is True for ops that return a tuple (read through ``getitem`` nodes).
    """

    outputs: tuple[TensorMeta | None, ...]
    multiple: bool = False

    @property
    def tensor(self) -> TensorMeta:
        """The single tensor output; raises if the node has several or none."""
        if self.multiple or len(self.outputs) != 1 or self.outputs[0] is None:
            raise AnnotationError(f"value {self} is not a single tensor")
        return self.outputs[0]

    @property
    def tensors(self) -> tuple[TensorMeta, ...]:
        return tuple(t for t in self.outputs if t is not None)

    @staticmethod
    def of(value: object) -> ValueMeta:
        """Build from the example value fx stores in ``node.meta["val"]``."""
        if isinstance(value, torch.Tensor):
            return ValueMeta((TensorMeta.of(value),))
        if isinstance(value, (tuple, list)):
            return ValueMeta(
                tuple(TensorMeta.of(v) if isinstance(v, torch.Tensor) else None for v in value),
                multiple=True,
            )
        return ValueMeta((None,))


class Phase(enum.Enum):
    """Where a node sits in the training step."""

    INPUT = "input"
    FORWARD = "forward"
    BACKWARD = "backward"
    OUTPUT = "output"


#: Region module of the ops a user-supplied ``loss_fn`` runs outside the model.
LOSS_REGION = "<loss>"


@dataclass(frozen=True)
class Region:
    """Which part of the model a node belongs to.

    ``module`` is the qualified name of the innermost ``nn.Module`` whose forward ran the op (""
    for the top-level module, :data:`LOSS_REGION` for the user's loss function). A backward node
    carries the module of the forward op it differentiates, which is what puts it in the same
    pipeline stage. ``seq_nr`` is autograd's sequence number linking the two, when known.
    """

    phase: Phase
    module: str
    seq_nr: int | None = None


@dataclass(frozen=True)
class NumberedLayer:
    """The numbered layer a module sits in: child ``index`` of ``container``."""

    container: str
    """The module path holding the layers (``blocks``, ``transformer.h``; ``""`` for the model
    itself)."""
    index: str

    @property
    def name(self) -> str:
        """``blocks.3``: the layer's module path."""
        return f"{self.container}.{self.index}" if self.container else self.index

    @property
    def pattern(self) -> str:
        """``blocks.*``: every layer of the container."""
        return f"{self.container}.*" if self.container else "*"


@dataclass(frozen=True)
class Checkpointed:
    """A forward node the model ran inside its ``call``-th ``torch.utils.checkpoint`` call
    (numbered from 0 in forward order): the model asked for it to be recomputed in the
    backward rather than kept."""

    call: int


@dataclass(frozen=True)
class Rematerialized:
    """Program-level record of what the rematerialize pass (``fxpar.passes.Rematerialize``)
    did: the layers and checkpoint calls it recomputes in the backward, and how many ops it
    copied there."""

    layers: tuple[str, ...] = ()
    checkpoint_calls: tuple[int, ...] = ()
    recomputed_ops: int = 0


def numbered_layer(module: str) -> NumberedLayer | None:
    """The layer of ``module``'s first all-digit component (``blocks.3`` for ``blocks.3.attn``);
    None for a module outside numbered layers."""
    parts = module.split(".") if module else []
    for depth, part in enumerate(parts):
        if part.isdigit():
            return NumberedLayer(".".join(parts[:depth]), part)
    return None


class CastRole(enum.Enum):
    """What a cast that mixed precision put in the graph converts (:mod:`fxpar.ir.precision`)."""

    PARAMETER = "parameter"
    """A master parameter to the compute dtype, in the forward."""
    TO_REDUCE = "to_reduce"
    """A parameter's gradient to the reduction dtype, before it is summed over devices."""
    FROM_REDUCE = "from_reduce"
    """A summed gradient back to its master parameter's dtype."""


@dataclass(frozen=True)
class PrecisionCast:
    """A cast of mixed precision, and what the planner must do around it so that parameters
    travel in the compute dtype and gradients are summed in the reduction dtype."""

    role: CastRole

    @property
    def follows_producer(self) -> bool:
        """The cast takes its input in the layout its producer leaves it: a parameter is cast
        where it is stored (so an all-gather moves the cast's bytes), and a partial gradient
        stays partial through its cast to the reduction dtype (so it is summed after it)."""
        return self.role is not CastRole.FROM_REDUCE

    @property
    def takes_partial(self) -> bool:
        """False for the cast out of the reduction dtype: a partial gradient is summed
        before it, in the reduction dtype."""
        return self.role is not CastRole.FROM_REDUCE


@dataclass(frozen=True)
class Cost:
    """Work of one node: floating-point operations and bytes moved to and from memory.

    ``output_bytes`` is the size of what the node produces even when it is a view (what it would
    cost to send); ``bytes_written`` is what the node actually writes (zero for views).
    """

    flops: Size
    bytes_read: Size
    bytes_written: Size
    output_bytes: Size
    op: str = ""
    """The ATen op the node calls, as ``"aten.mm"`` (its overload packet): the key of its
    measured speed (:meth:`fxpar.Cluster.op_seconds`); empty for a node that calls none (a
    placeholder, ``getitem``, symbolic-size arithmetic)."""


def total(values: Iterable[Size]) -> Size:
    """Sum of sizes, simplified to an int when nothing is symbolic."""
    result: Size = sum(values, start=0)
    if isinstance(result, sympy.Expr):
        return as_size(sympy.expand(result))
    return result


def evaluate(size: Size, bindings: Mapping[sympy.Symbol, int] | None = None) -> int:
    """A concrete int for ``size``, substituting symbols from ``bindings``."""
    if isinstance(size, sympy.Expr):
        value = size.subs(bindings or {})
        if not value.is_number:
            raise AnnotationError(f"size {size} still has free symbols {value.free_symbols}")
        return int(value)
    return int(size)
