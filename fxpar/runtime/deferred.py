"""Build a model without its weights, and compute any piece of any weight later, exactly.

:func:`deferred_init` runs a model's constructor with every tensor it creates on the CPU
replaced by a meta tensor (shape, dtype, no storage), and writes down what was done to each one:
the op, its arguments, and for a random op the state of the default generator just before it.
Where the constructor looks at a value (``trunc_normal_`` samples until every value falls in
range), the value is computed for real from what was recorded so far.
The model comes back on the meta device, ready for :func:`fxpar.plan` or :func:`fxpar.compile`;
nothing the size of a weight was allocated beyond one random draw at a time.

Random ops still draw for real while recording, into a throw-away tensor of the target's shape
and strides, so the default generator advances exactly as it would have, and the program after
``deferred_init`` sees the same random stream as after building the model eagerly.

:meth:`Recording.materialize` then replays the ops that made one tensor (and those that made
the tensors it was computed from), with the generator restored to each random op's recorded
state. The values are bitwise those of ``Model()`` run eagerly after the same seeding, whatever
mix of ``reset_parameters``, ``_init_weights`` hooks, ``nn.Parameter(torch.randn(...))``,
in-place edits of views (``weight[padding_idx].zero_()``) or copies between tensors the
constructor used. Each rank replays every weight but keeps only its own piece, so its peak is
its pieces plus one whole weight (and what that weight was computed from).

What cannot be recorded fails at construction time with a :class:`~fxpar.errors.FxparError`:
a random op given its own ``torch.Generator``, tensors made on a device other than the CPU, an
op that writes into several tensors at once.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from fxpar.errors import FxparError
from fxpar.ir.program import named_state

aten = torch.ops.aten

ModelT = TypeVar("ModelT", bound=nn.Module)

_UNINITIALIZED = frozenset(
    {
        aten.empty.memory_format,
        aten.empty_strided.default,
        aten.empty_like.default,
        aten.new_empty.default,
        aten.new_empty_strided.default,
    }
)
"""Ops whose values do not matter: replaying them only allocates."""


@dataclass(frozen=True)
class _Ref:
    """A recorded tensor as an op read it: its storage, how many of the storage's events had
    run at that moment, and the view (size, stride, offset) the op saw."""

    storage: int
    version: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


@dataclass(frozen=True)
class _Event:
    """One recorded op on a storage: the op that created it (``output`` names which of the op's
    flattened results it is) or one that wrote into it in place (``output`` is None)."""

    op: torch._ops.OpOverload
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    rng: torch.Tensor | None
    output: int | None = None
    view: _Ref | None = None
    """For a creation: how the result sits in the storage."""


@dataclass
class _Storage:
    numel: int
    dtype: torch.dtype
    events: list[_Event] = field(default_factory=list)


class Recording:
    """How every tensor of a model built by :func:`deferred_init` was made."""

    def __init__(self, storages: list[_Storage], slots: dict[str, _Ref]) -> None:
        self._storages = storages
        self._slots = slots

    @property
    def names(self) -> tuple[str, ...]:
        """The model's parameters and buffers (tied ones under each name) it can replay."""
        return tuple(self._slots)

    def materialize(self, name: str) -> torch.Tensor:
        """The whole value of the state tensor ``name``, as eager construction made it."""
        if name not in self._slots:
            raise FxparError(f"{name!r} was not made while recording the model")
        return self.value(self._slots[name])

    def value(self, ref: _Ref) -> torch.Tensor:
        """The tensor ``ref`` names, as it was when it was read."""
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            flat = self._flat(ref.storage, ref.version, {})
        return flat.as_strided(ref.size, ref.stride, ref.offset)

    def _flat(
        self, index: int, version: int, done: dict[tuple[int, int], torch.Tensor]
    ) -> torch.Tensor:
        """Storage ``index`` after its first ``version`` events, as a flat tensor."""
        if (index, version) in done:
            return done[(index, version)]
        storage = self._storages[index]
        flat = torch.empty(storage.numel, dtype=storage.dtype)
        for event in storage.events[:version]:
            self._replay(event, flat, index, done)
        done[(index, version)] = flat
        return flat

    def _replay(
        self,
        event: _Event,
        flat: torch.Tensor,
        index: int,
        done: dict[tuple[int, int], torch.Tensor],
    ) -> None:
        def resolve(value: Any) -> Any:
            if not isinstance(value, _Ref):
                return value
            source = (
                flat if value.storage == index else self._flat(value.storage, value.version, done)
            )
            return source.as_strided(value.size, value.stride, value.offset)

        if event.output is not None and event.op in _UNINITIALIZED:
            return
        args = tree_map(resolve, event.args)
        kwargs = tree_map(resolve, event.kwargs)
        if event.rng is not None:
            torch.set_rng_state(event.rng)
        result = event.op(*args, **kwargs)
        if event.output is not None:
            assert event.view is not None
            leaves, _ = tree_flatten(result)
            view = event.view
            flat.as_strided(view.size, view.stride, view.offset).copy_(leaves[event.output])


_recordings: weakref.WeakKeyDictionary[nn.Module, Recording] = weakref.WeakKeyDictionary()


def deferred_init(factory: Callable[..., ModelT], *args: Any, **kwargs: Any) -> ModelT:
    """``factory(*args, **kwargs)`` (a model class or any function building a model) with its
    parameters and buffers on the meta device, remembering how they were made.

    The model plans like any meta-device model, and :func:`fxpar.compile` gives every rank its
    own pieces of exactly the weights ``factory(*args, **kwargs)`` would have made eagerly at
    this point of the program: seed before calling, as you would before building the model::

        torch.manual_seed(0)
        model = fxpar.deferred_init(GPT, GPTConfig(n_layer=48))  # no weight memory
        parallel = fxpar.compile(model, cluster, (tokens,), gpt_loss)

    The default generator ends where eager construction would have left it. Tensors the
    constructor keeps as plain attributes (not parameters or buffers) are made for real, as
    they are constants of the model's forward.
    """
    recorder = _Recorder()
    with recorder:
        model = factory(*args, **kwargs)
    if not isinstance(model, nn.Module):
        raise FxparError(
            f"deferred_init: the factory returned {type(model).__name__}, not an nn.Module"
        )
    _recordings[model] = recorder.finish(model)
    return model


def recording_of(model: nn.Module) -> Recording | None:
    """The recording of a model built by :func:`deferred_init`, None for any other model."""
    return _recordings.get(model)


class _Recorder(TorchDispatchMode):
    """Makes every CPU tensor created under it a fake tensor and records how each was made."""

    def __init__(self) -> None:
        super().__init__()
        self.fake = FakeTensorMode(allow_non_fake_inputs=True)
        """The recorded tensors are fake CPU tensors of this mode rather than meta tensors, so
        code that asks ``tensor.is_meta`` (``nn.init.orthogonal_`` and ``trunc_normal_`` skip
        meta tensors) does what it does eagerly."""
        self.storages: list[_Storage] = []
        self._index: dict[int, int] = {}
        """Recorded storages by the address of their StorageImpl."""
        self._alive: list[torch.Tensor] = []
        """Every recorded tensor, kept alive so no address is reused while recording."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        leaves, _ = tree_flatten((args, kwargs))
        tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        if not tensors:
            return self._factory(func, args, kwargs)
        if not any(self._key(tensor) is not None for tensor in tensors):
            return func(*args, **kwargs)
        return self._on_recorded(func, args, kwargs)

    def _key(self, tensor: torch.Tensor) -> int | None:
        if not isinstance(tensor, FakeTensor) or tensor.fake_mode is not self.fake:
            return None
        return self._index.get(tensor.untyped_storage()._cdata)

    def _factory(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        device = kwargs.get("device")
        device = torch.device(device) if device is not None else torch.get_default_device()
        if device.type == "meta":
            return func(*args, **kwargs)
        if device.type != "cpu":
            raise FxparError(
                f"deferred_init records models built on the CPU; the constructor made a tensor "
                f"on {device} ({func})"
            )
        _check_generator(func, kwargs)
        rng = self._draw(func, args, kwargs, []) if _is_random(func) else None
        with self.fake:
            out = func(*args, **kwargs)
        if any(argument.name == "dtype" for argument in func._schema.arguments):
            # A replay must not depend on the default dtype of its moment.
            kwargs = {**kwargs, "dtype": out.dtype}
        self._created(func, args, kwargs, out, rng)
        return out

    def _on_recorded(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        _check_generator(func, kwargs)
        written = _written_arguments(func, args, kwargs)
        keys = self._written(func, written)
        rng = self._draw(func, args, kwargs, written) if _is_random(func) else None
        recorded_args, recorded_kwargs = tree_map(self._as_recorded, (args, kwargs))
        try:
            out = func(*args, **kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException):
            # The constructor reads values (trunc_normal_'s rejection loop asks mask.any()):
            # answer with the real ones, replayed from the recording so far.
            return func(*tree_map(self._real, args), **tree_map(self._real, kwargs))
        except (RuntimeError, NotImplementedError) as error:
            raise FxparError(
                f"deferred_init cannot record {func} while building the model: {error}"
            ) from error
        for key in keys:
            self.storages[key].events.append(_Event(func, recorded_args, recorded_kwargs, rng))
        self._created(func, recorded_args, recorded_kwargs, out, rng)
        return out

    def _written(self, func: Any, written: list[torch.Tensor]) -> list[int]:
        """The recorded storages of the tensors ``func`` writes into (at most one)."""
        keys = set()
        for value in written:
            key = self._key(value)
            if key is None:
                raise FxparError(
                    f"deferred_init: {func} writes a value computed from the model's "
                    "tensors into a tensor made before deferred_init"
                )
            keys.add(key)
        if len(keys) > 1:
            raise FxparError(f"deferred_init: {func} writes into more than one tensor at once")
        return sorted(keys)

    def _created(
        self, func: Any, args: Any, kwargs: dict[str, Any], out: Any, rng: torch.Tensor | None
    ) -> None:
        """Record the storages in ``out`` that are new (views of recorded ones are not)."""
        leaves, _ = tree_flatten(out)
        for position, leaf in enumerate(leaves):
            if not isinstance(leaf, FakeTensor) or self._key(leaf) is not None:
                continue
            storage = leaf.untyped_storage()
            key = len(self.storages)
            self._index[storage._cdata] = key
            self._alive.append(leaf)
            self.storages.append(_Storage(storage.nbytes() // leaf.element_size(), leaf.dtype))
            view = self._ref(leaf)
            self.storages[key].events.append(_Event(func, args, kwargs, rng, position, view))

    def _as_recorded(self, value: Any) -> Any:
        """An op's argument as the recording keeps it."""
        if not isinstance(value, torch.Tensor):
            return value
        if self._key(value) is not None:
            return self._ref(value)
        if value.is_meta or isinstance(value, FakeTensor):
            raise FxparError(
                "deferred_init: the constructor mixed its tensors with a meta or fake tensor it "
                "did not make; build the model without device='meta' inside the factory"
            )
        return value.detach().clone()

    def _draw(
        self, func: Any, args: Any, kwargs: dict[str, Any], written: list[torch.Tensor]
    ) -> torch.Tensor:
        """Advance the default generator as ``func`` would, drawing into throw-away tensors of
        the same shapes and strides as those it writes (``written``); returns the generator's
        state before the draw."""
        state = torch.get_rng_state()

        def stand_in(value: Any) -> Any:
            if isinstance(value, FakeTensor) and any(value is target for target in written):
                return torch.empty_strided(value.size(), value.stride(), dtype=value.dtype)
            return self._real(value)

        func(*tree_map(stand_in, args), **tree_map(stand_in, kwargs))
        return state

    def _real(self, value: Any) -> Any:
        """A recorded tensor's value at this point of the construction."""
        if not isinstance(value, torch.Tensor) or self._key(value) is None:
            return value
        return Recording(self.storages, {}).value(self._ref(value))

    def finish(self, model: nn.Module) -> Recording:
        """The recording of ``model``'s state; its recorded parameters and buffers become meta
        tensors (tied ones stay tied) and its recorded tensor attributes real ones."""
        slots = {
            name: self._ref(tensor)
            for name, tensor in named_state(model).items()
            if self._key(tensor) is not None
        }
        recording = Recording(self.storages, slots)
        on_meta: dict[int, torch.Tensor] = {}
        for module in model.modules():
            tables: tuple[dict[str, Any], ...] = (module._parameters, module._buffers)
            for table in tables:
                for name, tensor in table.items():
                    if tensor is not None and self._key(tensor) is not None:
                        table[name] = on_meta.setdefault(id(tensor), _meta_like(tensor))
            for name, value in vars(module).items():
                if isinstance(value, torch.Tensor) and self._key(value) is not None:
                    setattr(module, name, recording.value(self._ref(value)))
        self._alive.clear()
        self._index.clear()
        return recording

    def _ref(self, tensor: torch.Tensor) -> _Ref:
        """A recorded ``tensor`` as it is now: its storage, the events so far, its view."""
        key = self._key(tensor)
        assert key is not None
        return _Ref(
            key,
            len(self.storages[key].events),
            tuple(tensor.size()),
            tuple(tensor.stride()),
            int(tensor.storage_offset()),
        )


def _meta_like(tensor: torch.Tensor) -> torch.Tensor:
    meta = torch.empty_strided(tensor.size(), tensor.stride(), dtype=tensor.dtype, device="meta")
    if isinstance(tensor, nn.Parameter):
        return nn.Parameter(meta, requires_grad=tensor.requires_grad)
    return meta


def _check_generator(func: Any, kwargs: dict[str, Any]) -> None:
    if kwargs.get("generator") is not None:
        raise FxparError(
            f"deferred_init: {func} draws from its own torch.Generator, which cannot be "
            "replayed; use the default generator (torch.manual_seed) in the constructor"
        )


def _is_random(func: Any) -> bool:
    return torch.Tag.nondeterministic_seeded in getattr(func, "tags", ())


def _written_arguments(func: Any, args: Any, kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors ``func`` writes into, as its schema says (``self`` of an in-place op,
    ``out=``)."""
    written = []
    for position, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[position] if position < len(args) else kwargs.get(argument.name)
        if isinstance(value, torch.Tensor):
            written.append(value)
    return written


__all__ = ["Recording", "deferred_init", "recording_of"]
