"""Random numbers that every rank draws alike: random ops become inputs of the Program.

A sharded program cannot let each rank run ``bernoulli`` (dropout) or ``rand_like`` on its own
piece: each rank's generator would draw other numbers than one device draws for the whole
tensor, "replicated" values would differ between ranks, and a recomputed forward (remat) would
draw other numbers than the forward it repeats. So capture takes every random op out of the
graph: its result becomes a placeholder, a *random input*, described by a :class:`RandomDraw`
(the ATen op, its plain arguments, the global shape of its template). The graph left behind
is a pure function of its inputs, which the sharding rules, the planner and the lowering
already know how to handle: a random input is laid out like any batch tensor.

Before each step the runtime draws every random input whole, in graph order, with
:class:`RandomState`, a CPU generator owned by fxpar and identical on every rank (a copy of rank
0's ``torch`` generator when the model is compiled). Each rank keeps its own piece. Drawing
runs the very op the eager step runs, on a template of the same shape, strides and dtype, from
the same generator state, so the numbers are exactly those of single-device PyTorch seeded the
same way, whatever each rank's own generator holds. The price is that every rank draws the
whole of every random tensor (a few nanoseconds per element on a CPU).

Random ops whose draw depends on tensor values (``bernoulli`` of a probability tensor,
``multinomial``, ``poisson``, RNNs with dropout, fused dropout kernels) cannot be drawn ahead
of the step; capture refuses them with a :class:`~fxpar.errors.CaptureError` rather than let
ranks disagree.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

aten = torch.ops.aten

# Random ops whose result depends on the shape, strides and dtype of their tensor argument (if
# any) and on plain arguments, never on tensor values: they can be drawn before the step.
_SHAPE_ONLY = frozenset(
    {
        aten.bernoulli.p,
        aten.rand.default,
        aten.rand_like.default,
        aten.randn.default,
        aten.randn_like.default,
        aten.randint.default,
        aten.randint.low,
        aten.randint_like.default,
        aten.randint_like.low_dtype,
        aten.randperm.default,
        aten.uniform.default,
        aten.normal.float_float,
        aten.exponential.default,
        aten.cauchy.default,
        aten.geometric.default,
        aten.log_normal.default,
    }
)


def draws_random_numbers(node: fx.Node) -> bool:
    """Whether ``node`` runs a seeded random op that really draws: a dropout probability of 0
    or ``train=False`` (attention and RNN kernels take them) draws nothing."""
    target = node.target
    if torch.Tag.nondeterministic_seeded not in getattr(target, "tags", ()):
        return False
    schema = getattr(target, "_schema", None)
    for index, argument in enumerate(schema.arguments if schema is not None else ()):
        if argument.name in ("dropout_p", "dropout", "train") or (
            argument.name == "p" and target is not aten.bernoulli.p
        ):
            if index < len(node.args):
                value = node.args[index]
            else:
                value = node.kwargs.get(argument.name, argument.default_value)
            if value in (0, 0.0, False):
                return False
    return True


def can_draw_ahead(node: fx.Node) -> bool:
    """Whether a random ``node`` depends on nothing but shapes and plain arguments."""
    if node.target not in _SHAPE_ONLY:
        return False
    return len(node.all_input_nodes) <= 1 and not any(
        isinstance(value, torch.Generator) for value in (*node.args, *node.kwargs.values())
    )


@dataclass(frozen=True)
class RandomDraw:
    """How to draw one random input of a Program: ``op(*args, **kwargs)`` with the template (a
    fresh tensor of ``template_shape``, ``template_stride`` and ``template_dtype``; its values
    are never read) in argument position ``template_index``, if the op takes a tensor.

    Plain data: it pickles, so plans that carry Programs travel between ranks.
    """

    name: str
    op: str
    """The ATen overload, as ``"aten::bernoulli.p"``."""
    args: tuple[Any, ...]
    kwargs: tuple[tuple[str, Any], ...]
    template_index: int | None
    template_shape: tuple[int, ...] = ()
    template_stride: tuple[int, ...] = ()
    template_dtype: torch.dtype = torch.float32

    @staticmethod
    def of(node: fx.Node, name: str) -> RandomDraw:
        """The draw of random ``node`` (one that :func:`can_draw_ahead`), named ``name``."""
        template_index = None
        args = list(node.args)
        shape: tuple[int, ...] = ()
        stride: tuple[int, ...] = ()
        dtype = torch.float32
        for index, arg in enumerate(args):
            if isinstance(arg, fx.Node):
                value = arg.meta["val"]
                template_index, args[index] = index, None
                shape, stride = _concrete(value.shape), _concrete(value.stride())
                dtype = value.dtype
        op = node.target
        assert isinstance(op, torch._ops.OpOverload)
        return RandomDraw(
            name=name,
            op=f"{op._schema.name}.{op._overloadname}",
            args=tuple(args),
            kwargs=tuple(sorted(node.kwargs.items())),
            template_index=template_index,
            template_shape=shape,
            template_stride=stride,
            template_dtype=dtype,
        )

    def draw(self) -> torch.Tensor:
        """Run the op on a fresh template, drawing from torch's default CPU generator."""
        namespace, _, qualified = self.op.partition("::")
        packet, _, overload = qualified.partition(".")
        op = getattr(getattr(getattr(torch.ops, namespace), packet), overload or "default")
        args = list(self.args)
        if self.template_index is not None:
            args[self.template_index] = torch.empty_strided(
                self.template_shape, self.template_stride, dtype=self.template_dtype
            )
        return op(*args, **dict(self.kwargs))


def draw_all(draws: Sequence[RandomDraw]) -> list[torch.Tensor]:
    """Every draw, in order, from torch's default generator: what the eager step would draw."""
    return [draw.draw() for draw in draws]


class RandomState:
    """fxpar's random number generator state, the same on every rank (see the module docstring).

    Drawing swaps it into torch's default CPU generator for the duration and back out, so the
    user's own generator is neither read nor advanced by a step. A compiled model starts it
    from rank 0's ``torch.get_rng_state()``, broadcast to every rank
    (:func:`fxpar.runtime.devices.broadcast_from_rank_zero`): the step draws what one device
    would draw after the same ``torch.manual_seed`` and model construction.
    """

    def __init__(self, state: torch.Tensor) -> None:
        self.state = state.clone()

    def draw(self, draws: Sequence[RandomDraw]) -> list[torch.Tensor]:
        """Draw ``draws`` in order, advancing this state."""
        if not draws:
            return []
        with self.active():
            return draw_all(draws)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Torch's default CPU generator holds this state inside the block; its own is kept."""
        saved = torch.get_rng_state()
        torch.set_rng_state(self.state)
        try:
            yield
        finally:
            self.state = torch.get_rng_state()
            torch.set_rng_state(saved)


def _concrete(sizes: Sequence[Any]) -> tuple[int, ...]:
    return tuple(int(size) for size in sizes)


__all__ = ["RandomDraw", "RandomState", "can_draw_ahead", "draw_all", "draws_random_numbers"]
