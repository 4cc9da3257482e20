"""The cluster: a logical N-D mesh of devices.

A :class:`Cluster` names the shape of the device mesh the step is split over (``(4,)``, ``(2, 2)``,
``(2, 4)``) and its axis names. Under ``torch.distributed`` it builds the matching
:class:`~torch.distributed.device_mesh.DeviceMesh`, whose per-axis process groups carry the
collectives of the per-rank programs.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass

from fxpar.errors import FxparError

Coordinate = tuple[int, ...]


@dataclass(frozen=True)
class Cluster:
    """A logical device mesh. Rank ``r`` sits at the row-major coordinate of ``r`` in the mesh."""

    mesh_shape: tuple[int, ...]
    axis_names: tuple[str, ...] = ()
    device_type: str = "cpu"

    def __post_init__(self) -> None:
        shape = tuple(self.mesh_shape)
        if not shape or any(not isinstance(n, int) or n < 1 for n in shape):
            raise FxparError(f"mesh_shape must be a non-empty tuple of positive ints, got {shape}")
        object.__setattr__(self, "mesh_shape", shape)
        names = tuple(self.axis_names) or tuple(f"axis{i}" for i in range(len(shape)))
        if len(names) != len(shape) or len(set(names)) != len(names):
            raise FxparError(f"need {len(shape)} distinct axis names for mesh {shape}, got {names}")
        object.__setattr__(self, "axis_names", names)

    @property
    def ndim(self) -> int:
        return len(self.mesh_shape)

    @property
    def world_size(self) -> int:
        return math.prod(self.mesh_shape)

    def coordinates(self) -> Iterator[Coordinate]:
        """Every device coordinate, in rank order."""
        return itertools.product(*(range(n) for n in self.mesh_shape))

    def coordinate(self, rank: int) -> Coordinate:
        if not 0 <= rank < self.world_size:
            raise FxparError(f"rank {rank} is outside a mesh of {self.world_size} devices")
        coordinate = []
        for size in reversed(self.mesh_shape):
            rank, index = divmod(rank, size)
            coordinate.append(index)
        return tuple(reversed(coordinate))

    def rank(self, coordinate: Coordinate) -> int:
        rank = 0
        for index, size in zip(coordinate, self.mesh_shape, strict=True):
            rank = rank * size + index
        return rank

    def axis_index(self, axis: int | str) -> int:
        if isinstance(axis, str):
            if axis not in self.axis_names:
                raise FxparError(f"no mesh axis {axis!r}; the axes are {self.axis_names}")
            return self.axis_names.index(axis)
        if not 0 <= axis < self.ndim:
            raise FxparError(f"mesh axis {axis} out of range for a {self.ndim}-D mesh")
        return axis

    def device_mesh(self):
        """The DeviceMesh for this cluster; needs an initialized default process group whose
        world size equals the mesh's."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if not dist.is_initialized():
            raise FxparError(
                "no torch.distributed process group: launch with torchrun or "
                "fxpar.runtime.launch.spawn, or call torch.distributed.init_process_group first"
            )
        if dist.get_world_size() != self.world_size:
            raise FxparError(
                f"the process group has {dist.get_world_size()} ranks but the cluster's mesh "
                f"{self.mesh_shape} has {self.world_size} devices; launch {self.world_size} "
                "processes or change the mesh"
            )
        return init_device_mesh(self.device_type, self.mesh_shape, mesh_dim_names=self.axis_names)

    def __str__(self) -> str:
        shape = "x".join(map(str, self.mesh_shape))
        return f"{shape} mesh of {self.world_size} devices (axes {', '.join(self.axis_names)})"
