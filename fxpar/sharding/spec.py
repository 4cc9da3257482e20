"""Sharding specs: how one tensor is laid out over an N-D device mesh.

A :data:`Spec` is a tuple with one PyTorch placement per mesh axis:

- ``Shard(d)``: the tensor is split evenly along dim ``d`` over that axis;
- ``Replicate()``: every device along the axis holds the same values;
- ``Partial()``: devices along the axis hold addends whose sum is the value.

When several axes shard the same dim, the earlier axis splits first: on a (2, 2) mesh with
``(Shard(0), Shard(0))`` the device at coordinate ``(i, j)`` holds chunk ``2·i + j`` of 4.
A :class:`Strategy` gives, for one node, the spec of each output and the spec each tensor input
must have. This module holds the pure functions on specs: local shapes, evenness, and splitting
and reassembling real tensors (what the simulator and the runtime use).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from fxpar.cluster import Coordinate
from fxpar.errors import FxparError
from fxpar.ir.meta import TensorMeta, evaluate

Spec = tuple[Placement, ...]

R = Replicate()
P = Partial()


def S(dim: int) -> Shard:
    return Shard(dim)


def replicated(mesh_ndim: int) -> Spec:
    return (R,) * mesh_ndim


def spec_str(spec: Spec | None) -> str:
    if spec is None:
        return "-"
    return "(" + ", ".join(_placement_str(p) for p in spec) + ")"


def _placement_str(placement: Placement) -> str:
    if isinstance(placement, Shard):
        return f"S({placement.dim})"
    if isinstance(placement, Partial):
        return "P"
    return "R"


@dataclass(frozen=True)
class Strategy:
    """One way to run a node: the spec of each output (None for a non-tensor output) and the
    spec required of each tensor input, in the order of the node's flattened arguments."""

    outputs: tuple[Spec | None, ...]
    inputs: tuple[Spec, ...]

    def __str__(self) -> str:
        outs = ", ".join(spec_str(s) for s in self.outputs)
        ins = ", ".join(spec_str(s) for s in self.inputs)
        return f"[{ins}] -> [{outs}]"


def shards_per_dim(spec: Spec, mesh_shape: Sequence[int], ndim: int) -> list[int]:
    """How many pieces each tensor dim is cut into."""
    counts = [1] * ndim
    for placement, size in zip(spec, mesh_shape, strict=True):
        if isinstance(placement, Shard):
            counts[placement.dim] *= size
    return counts


def is_valid(shape: Sequence[int], spec: Spec, mesh_shape: Sequence[int]) -> bool:
    """Every sharded dim exists and splits evenly (uneven strategies are pruned, not costed)."""
    if len(spec) != len(mesh_shape):
        return False
    for placement in spec:
        if isinstance(placement, Shard) and not 0 <= placement.dim < len(shape):
            return False
    counts = shards_per_dim(spec, mesh_shape, len(shape))
    return all(size % count == 0 for size, count in zip(shape, counts, strict=True))


def local_shape(shape: Sequence[int], spec: Spec, mesh_shape: Sequence[int]) -> tuple[int, ...]:
    if not is_valid(shape, spec, mesh_shape):
        raise FxparError(f"spec {spec_str(spec)} does not split shape {tuple(shape)} evenly")
    counts = shards_per_dim(spec, mesh_shape, len(shape))
    return tuple(size // count for size, count in zip(shape, counts, strict=True))


def piece_bytes(meta: TensorMeta, spec: Spec, mesh_shape: Sequence[int]) -> int:
    """Bytes of one device's piece of a tensor of ``meta`` laid out as ``spec``."""
    shape = tuple(evaluate(size) for size in meta.shape)
    return math.prod(local_shape(shape, spec, mesh_shape)) * meta.dtype.itemsize


def has_partial(spec: Spec | None) -> bool:
    return spec is not None and any(isinstance(p, Partial) for p in spec)


def all_specs(shape: Sequence[int], mesh_shape: Sequence[int], partial: bool = False) -> list[Spec]:
    """Every valid spec of a tensor of ``shape`` (Replicate or an even Shard on each axis)."""
    options: list[Placement] = [R, *(Shard(d) for d in range(len(shape)))]
    if partial:
        options.append(P)
    return [
        spec
        for spec in itertools.product(options, repeat=len(mesh_shape))
        if is_valid(shape, spec, mesh_shape)
    ]


def shard_tensor(
    tensor: torch.Tensor, spec: Spec, mesh_shape: Sequence[int], coordinate: Coordinate
) -> torch.Tensor:
    """The local piece of a global ``tensor`` on the device at ``coordinate``.

    A Partial axis puts the whole value on coordinate 0 of that axis and zeros elsewhere, so
    summing over the axis gives the value back exactly.
    """
    local = tensor
    for placement, size, index in zip(spec, mesh_shape, coordinate, strict=True):
        if isinstance(placement, Shard):
            local = local.chunk(size, dim=placement.dim)[index] if size > 1 else local
        elif isinstance(placement, Partial) and index != 0:
            local = torch.zeros_like(local)
    return local.contiguous()


def assemble(
    pieces: Mapping[Coordinate, torch.Tensor], spec: Spec, mesh_shape: Sequence[int]
) -> torch.Tensor:
    """The global tensor from the local pieces of every device: concatenate shards, sum
    partials (in coordinate order), take any replica."""
    current = dict(pieces)
    # Undo the innermost axis first, so nested shards of one dim concatenate in order.
    for axis in reversed(range(len(mesh_shape))):
        placement = spec[axis]
        grouped: dict[Coordinate, list[torch.Tensor]] = {}
        for coordinate in sorted(current):
            outer = coordinate[:axis]
            grouped.setdefault(outer, []).append(current[coordinate])
        merged: dict[Coordinate, torch.Tensor] = {}
        for outer, group in grouped.items():
            if isinstance(placement, Shard):
                merged[outer] = torch.cat(group, dim=placement.dim)
            elif isinstance(placement, Partial):
                total = group[0].clone()
                for addend in group[1:]:
                    total = total + addend
                merged[outer] = total
            else:
                merged[outer] = group[0]
        current = merged
    return current[()]


@dataclass(frozen=True)
class Strategies:
    """Annotation: the candidate strategies of a node on a mesh (set by AnnotateStrategies)."""

    mesh_shape: tuple[int, ...]
    candidates: tuple[Strategy, ...]


@dataclass(frozen=True)
class Sharding:
    """Annotation: the strategy chosen for a node. A placeholder's strategy has one output
    spec (how that input is split) and no inputs."""

    strategy: Strategy
