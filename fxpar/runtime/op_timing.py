"""Time every ATen op of a Program where it runs: inside a real step, on that step's values.

:func:`time_ops` runs the program as the runtime does (its
:func:`~fxpar.runtime.fastcall.executable` copy: each ATen call straight to the dispatcher) with a
clock read after every ATen call, a few times, and gives each call the median of the time since
the clock's previous reading. Calibration fits a cluster's per-op speeds to these times
(:func:`fxpar.runtime.calibration.fit_ops`), so that the cost model prices a model's ops at what
they take on the machine, not at one roofline.

Why in place, on the real step, and not each op alone on random tensors: an op's time depends
on where its inputs are (a value made long ago comes from memory, not from a cache), on the
allocations and frees around it, and on its integer arguments (the tokens per expert of a grouped
product, the indices of a gather), which only the real step has: an op timed alone in a loop,
its inputs hot in the cache, can look faster than it runs in the step. A clock reading costs
well under a microsecond, against microseconds for the cheapest ATen call.
"""

from __future__ import annotations

import copy
import itertools
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from fxpar import ir
from fxpar.ir.flops import default_flop_registry
from fxpar.ir.placement import get_attribute
from fxpar.ir.program import Program
from fxpar.passes.annotate_cost import node_cost
from fxpar.runtime import fastcall
from fxpar.runtime.devices import synchronize


@dataclass(frozen=True)
class OpTiming:
    """One node's op and how long its call took in the step."""

    node: str
    cost: ir.Cost
    seconds: float


def read_clock(readings: list[float]) -> None:
    """Append the time now to ``readings`` (called from the instrumented program)."""
    readings.append(time.perf_counter())


def time_ops(
    program: Program,
    inputs: Sequence[object],
    *,
    passes: int = 5,
    device: torch.device | None = None,
) -> list[OpTiming]:
    """The time of every ATen call of ``program`` in a step on ``inputs`` (its flat inputs,
    :meth:`~fxpar.Program.flat_inputs`): the program runs once untimed, then ``passes``
    times with the clock read after each ATen call (every call waited for first on ``device``
    when it is a GPU, so that the clock sees the call's work and not its launch), and each
    call's time is the median over the passes of the time since the previous reading, scaled
    so that the calls add up to the median pass (the time between calls included). Each
    timing carries its node's :class:`~fxpar.ir.Cost` (counted here where no pass has
    annotated one)."""
    device = device or torch.device("cpu")
    readings: list[float] = []
    module, timed = _instrumented(program.graph_module, readings, device)
    samples: list[list[float]] = [[] for _ in timed]
    totals = []
    with torch.no_grad():
        for run in range(passes + 1):
            readings.clear()
            synchronize(device)
            readings.append(time.perf_counter())
            module(*inputs)
            if run:
                totals.append(readings[-1] - readings[0])
                for column, (start, end) in enumerate(itertools.pairwise(readings)):
                    samples[column].append(end - start)
    medians = [statistics.median(times) for times in samples]
    # Where ranks outnumber cores, a scheduler slice taken from a rank lands on one call in a
    # pass or two, which its median drops: the medians then add up to less than a pass takes
    # (by far more where ranks outnumber cores than with a core per rank). Scaled to the
    # median pass, the calls add up to what the step pays.
    scale = statistics.median(totals) / sum(medians) if sum(medians) > 0 else 1.0
    flops = default_flop_registry()
    return [
        OpTiming(node.name, ir.get(node, ir.Cost) or node_cost(node, flops), median * scale)
        for node, median in zip(timed, medians, strict=True)
    ]


def _instrumented(
    graph_module: fx.GraphModule, readings: list[float], device: torch.device
) -> tuple[fx.GraphModule, list[fx.Node]]:
    """The runtime's copy of ``graph_module`` with a clock reading after every ATen call, and
    the original's nodes of those calls, in order."""
    runnable = fastcall.executable(graph_module)
    graph = copy.deepcopy(runnable.graph)
    originals = [n for n in graph_module.graph.nodes]
    timed = []
    sync = device.type != "cpu"
    clock = None
    for original, node in zip(originals, list(graph.nodes), strict=True):
        if node.op == "placeholder":
            continue
        if clock is None:
            with graph.inserting_before(node):
                clock = graph.get_attr("readings")
        if node.op != "call_function" or not isinstance(original.target, torch._ops.OpOverload):
            continue
        with graph.inserting_after(node):
            read = graph.call_function(read_clock, (clock,))
            if sync:
                with graph.inserting_before(read):
                    graph.call_function(torch.cuda.synchronize, ())
        timed.append(original)
    # The program's own attributes (constants, submodules) and the readings list.
    attributes: dict[str, Any] = {
        str(node.target): get_attribute(runnable, str(node.target))
        for node in graph.nodes
        if node.op in ("get_attr", "call_module") and node is not clock
    }
    attributes["readings"] = readings
    return fx.GraphModule(attributes, graph), timed
