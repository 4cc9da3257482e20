"""Run every rank of a lowered plan in one process.

Each rank's GraphModule runs in its own thread with a :class:`SimulatedCommunicator`; the
collectives meet in an exchange that waits for every device of the mesh axis's group and then
computes the exact result in coordinate order, the same on every device. A rank that fails stops
the others at their next collective, and the first error is raised.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.fx as fx

from fxpar.cluster import Coordinate
from fxpar.errors import FxparError
from fxpar.ir.placement import device_of, place
from fxpar.ir.program import StepResult
from fxpar.lowering import SPMDProgram
from fxpar.lowering.collective_calls import Done, Pending

R = TypeVar("R")


class SimulationError(FxparError):
    """The simulated ranks failed or did not meet at a collective."""


class _Exchange:
    def __init__(self, mesh_shape: tuple[int, ...], timeout: float) -> None:
        self.mesh_shape = mesh_shape
        self.timeout = timeout
        self.condition = threading.Condition()
        self.slots: dict[tuple[int, Coordinate, int], dict[int, torch.Tensor]] = {}
        self.failure: BaseException | None = None

    def meet(
        self, axis: int, coordinate: Coordinate, sequence: int, tensor: torch.Tensor
    ) -> list[torch.Tensor]:
        """Every group member's tensor, in coordinate order along ``axis``."""
        group = coordinate[:axis] + coordinate[axis + 1 :]
        size = self.mesh_shape[axis]
        with self.condition:
            slot = self.slots.setdefault((axis, group, sequence), {})
            slot[coordinate[axis]] = tensor
            self.condition.notify_all()
            met = self.condition.wait_for(
                lambda: len(slot) == size or self.failure is not None, self.timeout
            )
            if self.failure is not None:
                raise SimulationError("another rank failed") from self.failure
            if not met:
                raise SimulationError(
                    f"rank at {coordinate} waited {self.timeout} s for its group on mesh axis "
                    f"{axis}: the per-rank programs do not run the same collectives"
                )
            return [slot[i] for i in range(size)]

    def fail(self, error: BaseException) -> None:
        with self.condition:
            if self.failure is None:
                self.failure = error
            self.condition.notify_all()


class SimulatedCommunicator:
    """The communicator of one simulated device."""

    def __init__(self, exchange: _Exchange, coordinate: Coordinate) -> None:
        self.exchange = exchange
        self.coordinate = coordinate
        self.calls = [0] * len(coordinate)

    def _meet(self, tensor: torch.Tensor, axis: int) -> list[torch.Tensor]:
        sequence = self.calls[axis]
        self.calls[axis] += 1
        return self.exchange.meet(axis, self.coordinate, sequence, tensor.detach())

    def all_gather(self, tensor: torch.Tensor, dim: int, axis: int) -> torch.Tensor:
        return torch.cat(self._meet(tensor, axis), dim=dim)

    def all_reduce(self, tensor: torch.Tensor, axis: int) -> torch.Tensor:
        pieces = self._meet(tensor, axis)
        total = pieces[0].clone()
        for piece in pieces[1:]:
            total = total + piece
        return total

    def reduce_scatter(self, tensor: torch.Tensor, dim: int, axis: int) -> torch.Tensor:
        total = self.all_reduce(tensor, axis)
        size = self.exchange.mesh_shape[axis]
        return total.chunk(size, dim)[self.coordinate[axis]].contiguous()

    # The simulated devices exchange at once: a collective "started" is already done. The
    # exchange holds the tensors it is given while other devices read them: an in-place
    # collective gives it a copy.

    def start_all_reduce(self, flat: torch.Tensor, axis: int) -> Pending:
        flat.copy_(self.all_reduce(flat.clone(), axis))
        return Done()

    def start_reduce_scatter(self, output: torch.Tensor, flat: torch.Tensor, axis: int) -> Pending:
        output.copy_(self.reduce_scatter(flat, 0, axis))
        return Done()

    def start_all_gather(self, output: torch.Tensor, flat: torch.Tensor, axis: int) -> Pending:
        output.copy_(self.all_gather(flat, 0, axis))
        return Done()

    def all_to_all(
        self, tensor: torch.Tensor, split_dim: int, concat_dim: int, axis: int
    ) -> torch.Tensor:
        size = self.exchange.mesh_shape[axis]
        index = self.coordinate[axis]
        pieces = self._meet(tensor, axis)
        return torch.cat(
            [p.chunk(size, split_dim)[index] for p in pieces], dim=concat_dim
        ).contiguous()

    def all_to_all_rows(
        self,
        tensor: torch.Tensor,
        send_counts: Sequence[int],
        receive_counts: Sequence[int],
        axis: int,
    ) -> torch.Tensor:
        index = self.coordinate[axis]
        # Each device hands over its rows cut by its own counts; this one takes its piece of
        # each, and checks that the counts it was told match what was sent.
        sent = self._meet_pieces(list(tensor.split(list(send_counts))), axis)
        received = [pieces[index] for pieces in sent]
        got = [piece.shape[0] for piece in received]
        if got != list(receive_counts):
            raise SimulationError(
                f"device {self.coordinate} expected rows {list(receive_counts)} on mesh axis "
                f"{axis}, the others sent {got}"
            )
        return torch.cat(received).contiguous()

    def _meet_pieces(self, pieces: list[torch.Tensor], axis: int) -> list[list[torch.Tensor]]:
        sequence = self.calls[axis]
        self.calls[axis] += 1
        detached = [piece.detach() for piece in pieces]
        return self.exchange.meet(axis, self.coordinate, sequence, detached)  # type: ignore[arg-type,return-value]


@dataclass(frozen=True)
class SimulationResult:
    per_rank: dict[Coordinate, tuple[torch.Tensor, ...]]
    """Every device's local outputs."""
    result: StepResult
    """The outputs reassembled from their specs: loss, gradients and buffer updates."""


class SimulatedMesh:
    """The devices of one mesh, each with its :class:`SimulatedCommunicator`, kept across
    calls: :meth:`run` runs a function on every device at once, in threads, and the
    collectives of successive calls keep meeting in order."""

    def __init__(self, mesh_shape: tuple[int, ...], *, timeout: float = 60.0) -> None:
        self.mesh_shape = tuple(mesh_shape)
        self._exchange = _Exchange(self.mesh_shape, timeout)
        coordinates = itertools.product(*(range(n) for n in self.mesh_shape))
        self.communicators = {c: SimulatedCommunicator(self._exchange, c) for c in coordinates}

    def run(self, body: Callable[[Coordinate, SimulatedCommunicator], R]) -> dict[Coordinate, R]:
        """``body(coordinate, comm)`` on every device; the results by coordinate. The first
        device error is raised, after every thread has stopped."""
        results: dict[Coordinate, R] = {}
        errors: list[BaseException] = []

        def run(coordinate: Coordinate) -> None:
            try:
                with torch.no_grad():
                    results[coordinate] = body(coordinate, self.communicators[coordinate])
            except BaseException as error:  # reported below, after every thread has stopped
                errors.append(error)
                self._exchange.fail(error)

        threads = [threading.Thread(target=run, args=(c,)) for c in self.communicators]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            first = next((e for e in errors if not isinstance(e, SimulationError)), errors[0])
            raise SimulationError(
                f"simulated rank failed: {type(first).__name__}: {first}"
            ) from first
        return results


def run_ranks(
    spmd: SPMDProgram,
    flat_inputs: Sequence[torch.Tensor],
    body: Callable[[fx.GraphModule, SimulatedCommunicator, list[torch.Tensor]], R],
    *,
    timeout: float = 60.0,
) -> dict[Coordinate, R]:
    """Call ``body(rank_module, comm, local_inputs)`` for every rank, each in its own thread
    with simulated collectives; the results by coordinate. The first rank error is raised."""
    cluster = spmd.cluster
    device = device_of(flat_inputs)  # the programs run where their inputs are

    def run(coordinate: Coordinate, comm: SimulatedCommunicator) -> R:
        program = place(spmd.ranks[cluster.rank(coordinate)].graph_module, device)
        return body(program, comm, spmd.local_inputs(flat_inputs, coordinate))

    return SimulatedMesh(cluster.mesh_shape, timeout=timeout).run(run)


def simulate(
    spmd: SPMDProgram, flat_inputs: Sequence[torch.Tensor], *, timeout: float = 60.0
) -> SimulationResult:
    """Run all ranks of ``spmd`` on the global placeholders ``flat_inputs`` (parameters,
    buffers, batch) and reassemble the outputs."""
    outputs = run_ranks(
        spmd, flat_inputs, lambda module, comm, local: tuple(module(comm, *local)), timeout=timeout
    )
    return SimulationResult(outputs, spmd.assemble_outputs(outputs))


def record_values(module: fx.GraphModule, inputs: Sequence[object]) -> dict[str, object]:
    """Run ``module`` and keep the value of every node, by node name."""
    values: dict[str, object] = {}

    class Recorder(fx.Interpreter):
        def run_node(self, node: fx.Node) -> object:
            values[node.name] = super().run_node(node)
            return values[node.name]

    with torch.no_grad():
        Recorder(place(module, device_of(inputs))).run(*inputs)
    return values
