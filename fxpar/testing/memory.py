"""Peak memory of a GraphModule, measured on the real tensors it computes.

:func:`peak_live_bytes` runs the module node by node (an ``fx.Interpreter``, which drops each
value after its last use, as the module's generated code does) and after every node adds up the
storages of every tensor still alive, each storage once however many views of it are alive.
The peak of that sum is the memory the step needs at its fullest, inputs included: what a
caching allocator would have to hold, before fragmentation. It counts exactly the tensors the
program holds, which neither ``tracemalloc`` (blind to torch's allocator) nor the process's
resident size (noisy, never shrinking) can do on a CPU.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.utils._pytree import tree_leaves


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
    lists too)."""
    seen: dict[int, int] = {}
    for value in values:
        for leaf in tree_leaves(value):
            if isinstance(leaf, torch.Tensor) and leaf.device.type != "meta":
                storage = leaf.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


class _Measuring(fx.Interpreter):
    def __init__(self, module: fx.GraphModule, input_bytes: int) -> None:
        super().__init__(module)
        self.peak = MemoryPeak(input_bytes, input_bytes, "<inputs>")

    def run_node(self, node: fx.Node) -> object:
        result = super().run_node(node)
        if node.op != "output":
            # Values the node read for the last time are still in env here; the Interpreter
            # drops them after run_node returns, so this counts the moment both exist.
            alive = storage_bytes([*self.env.values(), result])
            if alive > self.peak.peak_bytes:
                self.peak = MemoryPeak(alive, self.peak.input_bytes, node.name)
        return result


def peak_live_bytes(module: fx.GraphModule, inputs: Sequence[object]) -> MemoryPeak:
    """Run ``module`` on ``inputs`` and return the most bytes of tensors alive at once."""
    measuring = _Measuring(module, storage_bytes(inputs))
    with torch.no_grad():
        measuring.run(*inputs)
    return measuring.peak
