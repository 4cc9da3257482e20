"""Moving a value across a stage boundary between two meshes, or two layouts, that differ.

Every value that crosses a boundary (an activation going forward, a gradient going back, a
value relayed through a stage) is computed by the sending stage in the layout its plan gave
it, and read by the receiving stage in the layout *its* plan gives the same node. When both
stages run the same mesh under the same plan these agree, and device ``c`` simply sends its
piece, addends of a ``Partial`` value included, to device ``c`` of the neighbour. Otherwise
(Alpa's cross-mesh resharding) the value travels in a *wire layout* on each side:

- **the sender's**: its planned layout with every ``Partial`` axis reduced (a sum cannot be
  cut into pieces). The sending unit's lowering runs that all-reduce before the send.
- **the receiver's**: its planned layout with ``Partial`` axes made whole (the receiving unit's
  lowering turns a whole value into addends by keeping it on the axis's first device, which
  costs nothing), and, where that layout replicates the value over a mesh axis and the value
  is large (:data:`LOCAL_ALLGATHER_BYTES`), sharded over that axis instead: each replica
  receives ``1/n`` of the piece and the receiving unit all-gathers it over the axis. This is
  Alpa's local all-gather: the link between the stages carries one copy of the value, the
  links inside the receiving stage the rest.

:func:`transfers` then lists the messages: every receiving device gets, from one sending device
that holds it, each box (a range of indices in every dim) where its wire piece overlaps a
sender's, and nothing else. Senders holding the same box (replicas) share the receivers
round-robin. Each (sender, receiver, value) is at most one message, since two boxes meet in
one box.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch.distributed.tensor import Partial, Replicate, Shard

from fxpar.cluster import Coordinate
from fxpar.pipeline.meshes import Shape, coordinates
from fxpar.runtime.weights import Piece
from fxpar.sharding import Spec, local_shape

LOCAL_ALLGATHER_BYTES = 256 * 1024
"""A value at least this large (whole, in bytes) reaches the replicas of a receiving stage in
``1/n`` pieces that they all-gather; a smaller one reaches each replica whole (one collective's
latency costs more than the bytes saved)."""

Box = tuple[tuple[int, int], ...]
"""An index range ``[start, stop)`` in every dim of a tensor."""


@dataclass(frozen=True)
class StageSide:
    """One end of a boundary: the stage's mesh, the rank of each of its devices (row-major),
    and the layout its plan gives a value, by the value's node name."""

    mesh: Shape
    ranks: tuple[int, ...]
    spec_of: Callable[[str], Spec]


@dataclass(frozen=True)
class Transfer:
    """One message: the box ``source_box`` of the sender's wire piece (indices local to that
    piece) goes to ``target``, where it fills ``target_box`` of the receiver's wire piece."""

    source: int
    target: int
    source_box: tuple[slice, ...]
    target_box: tuple[slice, ...]


@dataclass(frozen=True)
class Crossing:
    """How one value crosses one boundary: the wire layouts on either side and the messages."""

    send_spec: Spec
    receive_spec: Spec
    transfers: tuple[Transfer, ...]

    def sends_from(self, rank: int) -> tuple[Transfer, ...]:
        return tuple(t for t in self.transfers if t.source == rank)

    def receives_at(self, rank: int) -> tuple[Transfer, ...]:
        return tuple(t for t in self.transfers if t.target == rank)


def crossing(
    shape: Sequence[int],
    itemsize: int,
    name: str,
    sender: StageSide,
    receiver: StageSide,
    *,
    gather_bytes: int | None = None,
) -> Crossing:
    """How the value ``name`` of ``shape`` crosses from ``sender`` to ``receiver``
    (``gather_bytes``: the local all-gather's threshold, :data:`LOCAL_ALLGATHER_BYTES` when
    None)."""
    if gather_bytes is None:
        gather_bytes = LOCAL_ALLGATHER_BYTES
    shape = tuple(int(size) for size in shape)
    sent, wanted = sender.spec_of(name), receiver.spec_of(name)
    if sender.mesh == receiver.mesh and sent == wanted:  # device c to device c, as computed
        pairs = zip(sender.ranks, receiver.ranks, strict=True)
        whole = tuple(slice(0, size) for size in local_shape(shape, sent, sender.mesh))
        return Crossing(sent, wanted, tuple(Transfer(s, r, whole, whole) for s, r in pairs))
    send_spec = _whole(sent)
    receive_spec = _whole(wanted)
    if math.prod(shape) * itemsize >= gather_bytes:
        receive_spec = _spread(shape, receive_spec, receiver.mesh)
    return Crossing(
        send_spec,
        receive_spec,
        transfers(shape, sender.mesh, sender.ranks, send_spec, receiver.mesh, receiver.ranks,
                  receive_spec),
    )  # fmt: skip


def transfers(
    shape: Sequence[int],
    send_mesh: Shape,
    send_ranks: Sequence[int],
    send_spec: Spec,
    receive_mesh: Shape,
    receive_ranks: Sequence[int],
    receive_spec: Spec,
) -> tuple[Transfer, ...]:
    """The messages that give every receiving device its piece of a value laid out as
    ``send_spec`` on ``send_mesh`` and wanted as ``receive_spec`` on ``receive_mesh`` (neither
    ``Partial``; see the module docstring)."""
    holders: dict[Box, list[int]] = {}
    for index, coordinate in enumerate(coordinates(send_mesh)):
        holders.setdefault(box(shape, send_spec, send_mesh, coordinate), []).append(index)
    messages = []
    for index, coordinate in enumerate(coordinates(receive_mesh)):
        wanted = box(shape, receive_spec, receive_mesh, coordinate)
        for held, senders in holders.items():
            common = _intersection(held, wanted)
            if common is None:
                continue
            sender = senders[index % len(senders)]
            messages.append(
                Transfer(
                    send_ranks[sender],
                    receive_ranks[index],
                    _relative(common, held),
                    _relative(common, wanted),
                )
            )
    return tuple(messages)


def box(shape: Sequence[int], spec: Spec, mesh: Shape, coordinate: Coordinate) -> Box:
    """The indices of the whole tensor that the device at ``coordinate`` holds."""
    slices = Piece(spec, mesh, coordinate).slices(shape)
    return tuple((s.start, s.stop) for s in slices)


def _whole(spec: Spec) -> Spec:
    return tuple(Replicate() if isinstance(p, Partial) else p for p in spec)


def _spread(shape: tuple[int, ...], spec: Spec, mesh: Shape) -> Spec:
    """``spec`` with each replicated axis of more than one device sharded over the first dim
    whose piece it divides evenly, where there is one."""
    placements = list(spec)
    for axis, size in enumerate(mesh):
        if size == 1 or not isinstance(placements[axis], Replicate):
            continue
        pieces = local_shape(shape, tuple(placements), mesh)
        dim = next((d for d, n in enumerate(pieces) if n % size == 0 and n >= size), None)
        if dim is not None:
            placements[axis] = Shard(dim)
    return tuple(placements)


def _intersection(first: Box, second: Box) -> Box | None:
    common = tuple(
        (max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(first, second, strict=True)
    )
    # A tensor without elements needs no message (a scalar has one, and an empty box).
    return None if any(start >= stop for start, stop in common) else common


def _relative(inner: Box, outer: Box) -> tuple[slice, ...]:
    return tuple(
        slice(start - base, stop - base)
        for (start, stop), (base, _) in zip(inner, outer, strict=True)
    )


__all__ = [
    "LOCAL_ALLGATHER_BYTES",
    "Crossing",
    "StageSide",
    "Transfer",
    "box",
    "crossing",
    "transfers",
]
