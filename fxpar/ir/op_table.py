"""A table of values by ATen op: the shape shared by fxpar's registries (FLOP formulas, sharding
rules). An entry under an overload packet (``aten.add``) covers all its overloads; an entry under
an overload (``aten.add.Tensor``) takes precedence."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

V = TypeVar("V")


class OpTable(Generic[V]):
    def __init__(self) -> None:
        self._entries: dict[object, V] = {}

    def register(self, *ops: object) -> Callable[[V], V]:
        """Decorator: ``value`` is the entry of each of ``ops``."""

        def decorate(value: V) -> V:
            for op in ops:
                self._entries[op] = value
            return value

        return decorate

    def lookup(self, target: object) -> V | None:
        if target in self._entries:
            return self._entries[target]
        return self._entries.get(getattr(target, "overloadpacket", None))

    def copy(self) -> OpTable[V]:
        other: OpTable[V] = OpTable()
        other._entries = dict(self._entries)
        return other
