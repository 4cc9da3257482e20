"""Equivalence checks between a Program and its per-rank programs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fxpar.cluster import Coordinate
from fxpar.errors import FxparError
from fxpar.lowering import SPMDProgram
from fxpar.sharding import assemble, spec_str
from fxpar.testing.simulate import record_values, run_ranks, simulate


class EquivalenceError(FxparError, AssertionError):
    """The per-rank programs do not compute what the Program computes."""


def assert_equivalent(
    spmd: SPMDProgram,
    flat_inputs: Sequence[torch.Tensor],
    *,
    rtol: float = 1e-4,
    atol: float = 1e-6,
) -> None:
    """Simulate ``spmd`` and compare the loss (or a forward's outputs), gradients and buffer
    updates with the Program run on one device. On a mismatch the error names the first node
    whose reassembled value differs (see :func:`first_divergence`)."""
    expected = spmd.program.signature.name_outputs(spmd.program(*flat_inputs))
    found = simulate(spmd, flat_inputs).result
    names = spmd.program.signature.outputs
    pairs = list(zip(names, expected.outputs, found.outputs, strict=True))
    pairs += [(f"gradient of {k}", v, found.gradients[k]) for k, v in expected.gradients.items()]
    pairs += [(f"buffer {k}", v, found.buffers[k]) for k, v in expected.buffers.items()]
    for what, want, got in pairs:
        if not torch.allclose(got, want, rtol=rtol, atol=atol):
            divergence = first_divergence(spmd, flat_inputs, rtol=rtol, atol=atol)
            raise EquivalenceError(
                f"{what} differs (max abs error {(got - want).abs().max().item():.3g}); "
                f"{divergence or 'no intermediate value differs'}"
            )


@dataclass(frozen=True)
class Divergence:
    node: str
    target: str
    specs: str
    error: float

    def __str__(self) -> str:
        return (
            f"first divergent node {self.node!r} ({self.target}) laid out as {self.specs}: "
            f"max abs error {self.error:.3g}"
        )


def first_divergence(
    spmd: SPMDProgram,
    flat_inputs: Sequence[torch.Tensor],
    *,
    rtol: float = 1e-4,
    atol: float = 1e-6,
) -> Divergence | None:
    """Run every rank recording each local value, reassemble every node of the Program from its
    pieces, and return the first one (in graph order) that differs from one-device execution.
    A rank that fails raises :class:`SimulationError`, as in :func:`simulate`."""
    expected = record_values(spmd.program.graph_module, flat_inputs)
    local_values = run_ranks(
        spmd, flat_inputs, lambda module, comm, local: record_values(module, [comm, *local])
    )
    mesh = spmd.cluster.mesh_shape
    for node in spmd.program.graph.nodes:
        if node.op in ("placeholder", "output") or node.name not in spmd.ranks[0].values:
            continue
        specs = spmd.ranks[0].values[node.name][1]
        value = expected[node.name]
        outputs = value if isinstance(value, (tuple, list)) else (value,)
        for index, spec in enumerate(specs):
            if spec is None or not isinstance(outputs[index], torch.Tensor):
                continue
            pieces: dict[Coordinate, torch.Tensor] = {}
            for program in spmd.ranks:
                local = local_values[program.coordinate][program.values[node.name][0]]
                local = local[index] if isinstance(local, (tuple, list)) else local
                pieces[program.coordinate] = local  # type: ignore[assignment]
            got = assemble(pieces, spec, mesh)
            want = outputs[index]
            assert isinstance(want, torch.Tensor)
            if got.shape != want.shape or not torch.allclose(got, want, rtol=rtol, atol=atol):
                error = (got - want).abs().max().item() if got.shape == want.shape else float("inf")
                shown = ", ".join(spec_str(s) for s in specs)
                return Divergence(node.name, str(node.target), shown, error)
    return None
