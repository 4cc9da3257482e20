"""Run lowered programs without a Python frame per ATen call.

torch.fx writes a call to an ATen overload as ``torch.ops.aten.mm.default(a, b)``: four
attribute lookups and ``OpOverload.__call__``, a Python function whose only work is to call the
overload's C++ entry point (``OpOverload._op``). A training step of a small model runs
hundreds of such calls per micro-batch, and where each call does little work (a CPU, small
micro-batches) that frame is a noticeable share of the step.

:func:`executable` gives the copy of a GraphModule that the runtime runs: the same graph, with
every ATen overload replaced by its entry point, bound to a global named after the overload
(``aten_mm_default(a, b)``), so that the call goes straight to the dispatcher. It computes
exactly what the original does (``OpOverload.__call__`` is nothing but that call), and the
original stays what passes, tests and ``.code`` read. The copy is made once a program has run
:data:`COPY_AFTER_CALLS` times (it pays back only over many calls). Single-device references
(:meth:`fxpar.ir.program.Program.run`) keep running the original.
"""

from __future__ import annotations

import copy
import functools
import weakref
from typing import Any

import torch
import torch.fx as fx
from torch.fx.graph import _BoxedCodeGen


class _EntryPoint(functools.partial[Any]):
    """An ATen overload's C++ entry point. A ``functools.partial`` calls it without a Python
    frame; fx names it in generated code by its ``__name__``."""

    __module__ = "fxpar.runtime.fastcall"  # not torch's, so fx binds it to a global
    __name__: str


_copies: weakref.WeakKeyDictionary[fx.GraphModule, fx.GraphModule] = weakref.WeakKeyDictionary()
_boxed: weakref.WeakKeyDictionary[fx.GraphModule, fx.GraphModule] = weakref.WeakKeyDictionary()


@functools.cache
def _entry_point(op: torch._ops.OpOverload) -> _EntryPoint:
    entry = _EntryPoint(op._op)
    entry.__name__ = str(op).replace(".", "_")  # aten.mm.default -> aten_mm_default
    return entry


def executable(graph_module: fx.GraphModule, *, boxed: bool = False) -> fx.GraphModule:
    """The copy of ``graph_module`` to run (module docstring), made once per module and
    calling convention. ``boxed``: the copy takes one list of the inputs, which it empties
    before computing, so that each input is freed after its last use unless the caller keeps
    it (see :func:`run_boxed`)."""
    copies = _boxed if boxed else _copies
    found = copies.get(graph_module)
    if found is None:
        graph = copy.deepcopy(graph_module.graph)
        for node in graph.nodes:
            if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
                node.target = _entry_point(node.target)
        if boxed:
            graph.set_codegen(_BoxedCodeGen())
        found = fx.GraphModule(graph_module, graph, class_name=type(graph_module).__name__)
        copies[graph_module] = found
    return found


COPY_AFTER_CALLS = 16
"""Calls of a program that run the original before the copy is made. Making the copy costs
tens of microseconds per node (a deep copy of the graph and a recompile), and it saves about a
microsecond per ATen call, so it pays back only after some tens of calls: a program run a few
times (tests, one-off calls, the first steps) does not pay for it, one run for a whole
training does."""


def run(graph_module: fx.GraphModule, *args: Any) -> Any:
    """``graph_module(*args)``, through its :func:`executable` copy once it has run
    :data:`COPY_AFTER_CALLS` times."""
    if _early_call(graph_module):
        return graph_module(*args)
    return executable(graph_module)(*args)


def run_boxed(graph_module: fx.GraphModule, args: list[Any]) -> Any:
    """``graph_module(*args)``, emptying ``args``; once the program has run
    :data:`COPY_AFTER_CALLS` times, through its boxed copy, so that an input nobody else holds
    is freed as soon as the program has read it for the last time (a stash in the backward,
    say) instead of when the program returns."""
    if _early_call(graph_module):
        inputs = list(args)
        args.clear()
        return graph_module(*inputs)
    return executable(graph_module, boxed=True)(args)


_calls: weakref.WeakKeyDictionary[fx.GraphModule, int] = weakref.WeakKeyDictionary()


def _early_call(graph_module: fx.GraphModule) -> bool:
    count = _calls.get(graph_module, 0)
    if count >= COPY_AFTER_CALLS:
        return False
    _calls[graph_module] = count + 1
    return True


__all__ = ["COPY_AFTER_CALLS", "executable", "run", "run_boxed"]
