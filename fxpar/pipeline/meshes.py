"""Where the stages of a pipeline run: a mesh per stage, and the ranks of each.

Stages are laid out stage-major: stage ``s`` takes the ``devices(s)`` ranks after those of
stages ``0 .. s-1``, and rank ``offset(s) + i`` is device ``i`` (row-major) of stage ``s``'s
mesh. With every stage on the same mesh this is the layout ``s * T + t`` of a cluster of mesh
``(K, *stage_mesh)``; with ``Pipeline(stage_meshes=...)`` the stages' meshes may differ in
shape and size (Alpa's submeshes), and each runs an intra-op plan made for its own mesh.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from fxpar.cluster import Cluster, Coordinate
from fxpar.pipeline.options import Pipeline, PipelineError
from fxpar.pipeline.stage_costs import link

Shape = tuple[int, ...]


@dataclass(frozen=True)
class StageMeshes:
    """The mesh of every stage (a :class:`~fxpar.cluster.Cluster` each, for the plan's costs)
    and the ranks it takes."""

    clusters: tuple[Cluster, ...]

    @property
    def num_stages(self) -> int:
        return len(self.clusters)

    @property
    def shapes(self) -> tuple[Shape, ...]:
        return tuple(cluster.mesh_shape for cluster in self.clusters)

    @property
    def uniform(self) -> bool:
        """Whether every stage has the same mesh (then no value is resharded between stages)."""
        return len(set(self.shapes)) == 1

    @property
    def world_size(self) -> int:
        return sum(cluster.world_size for cluster in self.clusters)

    def offset(self, stage: int) -> int:
        """The first rank of ``stage``."""
        return sum(cluster.world_size for cluster in self.clusters[:stage])

    def ranks(self, stage: int) -> tuple[int, ...]:
        """The ranks of ``stage``'s devices, row-major in its mesh."""
        start = self.offset(stage)
        return tuple(range(start, start + self.clusters[stage].world_size))

    def locate(self, rank: int) -> tuple[int, int]:
        """The stage of ``rank`` and its index among that stage's devices."""
        for stage in range(self.num_stages):
            start, size = self.offset(stage), self.clusters[stage].world_size
            if start <= rank < start + size:
                return stage, rank - start
        raise PipelineError(f"rank {rank} is outside the {self.world_size} devices of the stages")

    def coordinate(self, rank: int) -> Coordinate:
        stage, index = self.locate(rank)
        return self.clusters[stage].coordinate(index)

    def rank(self, stage: int, coordinate: Coordinate) -> int:
        """The rank at ``coordinate`` of ``stage``'s mesh."""
        index = 0
        for size, position in zip(self.shapes[stage], coordinate, strict=True):
            index = index * size + position
        return self.offset(stage) + index


def uniform_meshes(cluster: Cluster, num_stages: int) -> StageMeshes:
    """``num_stages`` stages on the same stage mesh ``cluster``."""
    return StageMeshes((cluster,) * num_stages)


def submesh_cluster(cluster: Cluster, shape: Sequence[int], num_stages: int) -> Cluster:
    """A stage mesh of ``shape`` inside a pipeline on ``cluster``: each of its axes takes the
    links of the innermost axis of ``cluster`` that holds that many consecutive ranks (ranks
    are row-major, and a stage's ranks are consecutive), and the memory of one device times
    the number of stages (the plan made on it covers every stage's layers; a device holds
    about one stage's share)."""
    shape = tuple(shape)
    links = [link(cluster, math.prod(shape[axis:])) for axis in range(len(shape))]
    return dataclasses.replace(
        cluster,
        mesh_shape=shape,
        axis_names=tuple(f"stage_axis{axis}" for axis in range(len(shape))),
        bandwidth=tuple(bandwidth for bandwidth, _ in links),
        latency=tuple(latency for _, latency in links),
        memory=cluster.memory * num_stages,
    )


def stage_meshes(pipeline: Pipeline, cluster: Cluster) -> StageMeshes:
    """The stages of ``pipeline`` (which names its ``stage_meshes``) on ``cluster``, whose
    devices they must use exactly.

    Raises:
        PipelineError: the pipeline names no stage meshes, or they hold another number of
            devices than ``cluster``.
    """
    shapes = pipeline.stage_meshes
    if shapes is None:
        raise PipelineError(f"{pipeline} names no stage_meshes")
    if pipeline.world_size != cluster.world_size:
        raise PipelineError(
            f"the stage meshes {shapes} hold {pipeline.world_size} devices, but the cluster "
            f"{cluster.mesh_shape} has {cluster.world_size}: they must use it exactly"
        )
    return StageMeshes(tuple(submesh_cluster(cluster, shape, len(shapes)) for shape in shapes))


def distinct(shapes: Sequence[Shape]) -> tuple[Shape, ...]:
    """``shapes`` without repeats, in first-seen order."""
    return tuple(dict.fromkeys(shapes))


def coordinates(shape: Shape) -> list[Coordinate]:
    """Every coordinate of a mesh of ``shape``, row-major."""
    return [tuple(c) for c in itertools.product(*(range(n) for n in shape))]


__all__ = [
    "StageMeshes",
    "coordinates",
    "distinct",
    "stage_meshes",
    "submesh_cluster",
    "uniform_meshes",
]
