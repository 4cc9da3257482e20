"""Peak memory of a GraphModule, measured on the real tensors it computes.

:func:`peak_live_bytes` runs the module node by node (an ``fx.Interpreter``, which drops each
value after its last use, as the module's generated code does) and after every node adds up the
storages of every tensor still alive, each storage once however many views of it are alive.
The inputs count throughout: their caller (the model holding its parameters, the loop holding
its batch) keeps them alive for the whole step, even where the program has read them for the
last time. The peak of that sum is the memory the step needs at its fullest, inputs included:
what a caching allocator would have to hold, before fragmentation. :func:`rank_peaks` measures
every rank of a lowered plan so, each on pieces of its own. It counts exactly the tensors the
program holds, which neither ``tracemalloc`` (blind to torch's allocator) nor the process's
resident size (noisy, never shrinking) can do on a CPU.

:func:`resident_growth` measures a whole process instead, for what happens outside one program
(building a model, compiling it): how far its resident memory rose above the level it had on
entry, from the kernel's high-water mark (Linux only).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.fx as fx
from torch.utils._pytree import tree_leaves

from fxpar.cluster import Coordinate
from fxpar.lowering import SPMDProgram
from fxpar.testing.simulate import run_ranks


@dataclass(frozen=True)
class MemoryPeak:
    """The most bytes alive at once while a module ran, and where."""

    peak_bytes: int
    """Bytes of every storage alive right after ``peak_node`` ran, inputs included."""
    input_bytes: int
    """Bytes of the module's input tensors (parameters, batch, ...)."""
    peak_node: str

    @property
    def activation_bytes(self) -> int:
        """The peak less the inputs: what the step allocates on top of its inputs."""
        return self.peak_bytes - self.input_bytes


def storage_bytes(values: Iterable[object]) -> int:
    """Bytes of the distinct storages of the tensors among ``values`` (nested in tuples and
    lists too, and in the fields of dataclasses: a per-rank program holds a collective in
    flight as one, :class:`fxpar.lowering.collective_calls.Bucket`, with its flat buffer)."""
    seen: dict[int, int] = {}
    pending = list(values)
    while pending:
        for leaf in tree_leaves(pending.pop()):
            if isinstance(leaf, torch.Tensor):
                if leaf.device.type != "meta":
                    storage = leaf.untyped_storage()
                    seen[storage.data_ptr()] = storage.nbytes()
            elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
                pending.extend(getattr(leaf, field.name) for field in dataclasses.fields(leaf))
    return sum(seen.values())


class _Measuring(fx.Interpreter):
    def __init__(self, module: fx.GraphModule, inputs: Sequence[object]) -> None:
        super().__init__(module)
        self.inputs = list(inputs)
        input_bytes = storage_bytes(self.inputs)
        self.peak = MemoryPeak(input_bytes, input_bytes, "<inputs>")

    def run_node(self, node: fx.Node) -> object:
        result = super().run_node(node)
        if node.op != "output":
            # Values the node read for the last time are still in env here; the Interpreter
            # drops them after run_node returns, so this counts the moment both exist.
            alive = storage_bytes([*self.inputs, *self.env.values(), result])
            if alive > self.peak.peak_bytes:
                self.peak = MemoryPeak(alive, self.peak.input_bytes, node.name)
        return result


def peak_live_bytes(module: fx.GraphModule, inputs: Sequence[object]) -> MemoryPeak:
    """Run ``module`` on ``inputs`` and return the most bytes of tensors alive at once."""
    measuring = _Measuring(module, inputs)
    with torch.no_grad():
        measuring.run(*inputs)
    return measuring.peak


def rank_peaks(
    spmd: SPMDProgram, flat_inputs: Sequence[torch.Tensor]
) -> dict[Coordinate, MemoryPeak]:
    """:func:`peak_live_bytes` of every rank's program of ``spmd`` on its pieces of the global
    ``flat_inputs``, by coordinate. Each piece is copied first: a rank holds its piece as a
    tensor of its own, where the slice of the global tensor would count the whole storage."""
    return run_ranks(
        spmd,
        flat_inputs,
        lambda module, comm, local: peak_live_bytes(
            module, [comm, *(piece.clone() for piece in local)]
        ),
    )


@dataclass
class ResidentGrowth:
    """Set when the ``with resident_growth()`` block ends."""

    peak_bytes: int = 0
    """The process's highest resident size during the block, above its size on entry."""


@contextlib.contextmanager
def resident_growth() -> Iterator[ResidentGrowth]:
    """Measure how far this process's resident memory rises above its level on entry.

    Resets the kernel's high-water mark (``VmHWM``) by writing ``5`` to
    ``/proc/self/clear_refs``, and reads it back on exit. Clean file pages mapped by the block
    count too. glibc keeps freed blocks under its mmap threshold on a heap it rarely gives back
    and raises that threshold as large blocks are freed: set ``MALLOC_MMAP_THRESHOLD_`` (bytes)
    in the environment of a process started afterwards to keep the figure to what was alive
    (with :func:`~fxpar.runtime.launch.spawn`, ``start_method="spawn"``: a process forked from
    its fork server keeps the server's glibc settings).
    """
    Path("/proc/self/clear_refs").write_text("5")
    before = _status_bytes("VmRSS")
    growth = ResidentGrowth()
    yield growth
    growth.peak_bytes = _status_bytes("VmHWM") - before


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")
