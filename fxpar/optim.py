"""Optimizers for :func:`fxpar.compile`, whose states are sharded like their parameters.

A per-rank program returns each gradient in its parameter's layout: where the parameter is
split, so is its gradient; where it is replicated, every device holds the full, already reduced
gradient. SGD (with momentum) and AdamW update every element from that element's parameter,
gradient and state alone, so running them on each device's local pieces gives exactly the
pieces of the single-device update, and their states come out split like the parameters with no
extra communication. fxpar therefore runs ``torch.optim``'s own implementations on the local
pieces; the classes here only describe the optimizer (frozen, comparable, picklable) and tell
the planner how many copies of each parameter its state holds.

A stage of a pipeline may hold no trainable parameter (one that only computes the loss, or
frozen layers): ``build([])`` then returns the same torch optimizer over one empty parameter
group, whose ``step`` updates nothing and whose state dict and hyperparameters (the learning
rate a scheduler sets) look like every other rank's, instead of ``torch.optim``'s "empty
parameter list" error.

Optimizers that read across elements (norm-based ones such as LAMB or Adafactor) would need
collectives and are not offered. Gradient clipping by the global norm needs one all-reduce and
is :meth:`fxpar.ParallelModel.clip_grad_norm_`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from fxpar.errors import FxparError


class Optimizer(Protocol):
    """What :func:`fxpar.compile` needs of an optimizer description."""

    @property
    def state_copies(self) -> int:
        """Tensors of a parameter's shape the optimizer keeps per parameter (for planning)."""
        ...

    @property
    def state_keys(self) -> tuple[str, ...]:
        """Keys of ``torch.optim.Optimizer.state[param]`` holding tensors of the param's shape."""
        ...

    def build(self, params: Sequence[torch.Tensor]) -> torch.optim.Optimizer:
        """A torch optimizer over ``params`` (one device's local pieces)."""
        ...


@dataclass(frozen=True)
class SGD:
    """Stochastic gradient descent, as :class:`torch.optim.SGD` (same arguments)."""

    lr: float = 1e-2
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False

    def __post_init__(self) -> None:
        _check_non_negative(self, "lr", "momentum", "dampening", "weight_decay")
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise FxparError("SGD(nesterov=True) needs momentum > 0 and dampening = 0")

    @property
    def state_copies(self) -> int:
        return 1 if self.momentum else 0

    @property
    def state_keys(self) -> tuple[str, ...]:
        return ("momentum_buffer",) if self.momentum else ()

    def build(self, params: Sequence[torch.Tensor]) -> torch.optim.Optimizer:
        return torch.optim.SGD(
            _param_groups(params),
            lr=self.lr,
            momentum=self.momentum,
            dampening=self.dampening,
            weight_decay=self.weight_decay,
            nesterov=self.nesterov,
            foreach=False,
        )


@dataclass(frozen=True)
class AdamW:
    """Adam with decoupled weight decay, as :class:`torch.optim.AdamW` (same arguments)."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 1e-2
    amsgrad: bool = False

    def __post_init__(self) -> None:
        _check_non_negative(self, "lr", "eps", "weight_decay")
        if not all(0.0 <= beta < 1.0 for beta in self.betas):
            raise FxparError(f"AdamW betas must lie in [0, 1), got {self.betas}")

    @property
    def state_copies(self) -> int:
        return 3 if self.amsgrad else 2

    @property
    def state_keys(self) -> tuple[str, ...]:
        keys = ("exp_avg", "exp_avg_sq")
        return (*keys, "max_exp_avg_sq") if self.amsgrad else keys

    def build(self, params: Sequence[torch.Tensor]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(
            _param_groups(params),
            lr=self.lr,
            betas=self.betas,
            eps=self.eps,
            weight_decay=self.weight_decay,
            amsgrad=self.amsgrad,
            foreach=False,
        )


def _param_groups(params: Sequence[torch.Tensor]) -> list[torch.Tensor] | list[dict[str, Any]]:
    """``params`` as torch.optim takes them; none at all as one empty group, which torch.optim
    accepts (it refuses an empty list) and whose step does nothing."""
    tensors = list(params)
    return tensors if tensors else [{"params": []}]


def check_optimizer(optimizer: object) -> Optimizer:
    """``optimizer`` if it describes an elementwise optimizer, else a clear error."""
    if isinstance(optimizer, torch.optim.Optimizer):
        raise FxparError(
            f"fxpar.compile takes an optimizer description, not a built "
            f"{type(optimizer).__name__} (its parameters would be the unsharded ones): pass "
            "fxpar.optim.SGD(...) or fxpar.optim.AdamW(...) with the same arguments"
        )
    if not all(hasattr(optimizer, a) for a in ("build", "state_copies", "state_keys")):
        raise FxparError(
            f"{optimizer!r} is not an fxpar optimizer: use fxpar.optim.SGD or fxpar.optim.AdamW, "
            "or an object with build(params), state_copies and state_keys"
        )
    return optimizer  # type: ignore[return-value]


def _check_non_negative(options: object, *names: str) -> None:
    for name in names:
        value = getattr(options, name)
        if value < 0:
            raise FxparError(f"{type(options).__name__}: {name} must be >= 0, got {value}")


def check_clip_arguments(max_norm: float, norm_type: float) -> None:
    """Refuse what ``clip_grad_norm_(max_norm, norm_type)`` cannot mean.

    Raises:
        FxparError: ``max_norm`` negative or NaN, or ``norm_type`` not positive.
    """
    if not max_norm >= 0 or not norm_type > 0:  # NaN fails both
        raise FxparError(
            "clip_grad_norm_ needs max_norm >= 0 and norm_type > 0, got "
            f"max_norm={max_norm} and norm_type={norm_type}"
        )


__all__ = ["SGD", "AdamW", "Optimizer", "check_clip_arguments", "check_optimizer"]
