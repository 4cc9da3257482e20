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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from fxpar.cluster import Cluster, Coordinate
from fxpar.ir.program import Program
from fxpar.pipeline.options import Pipeline, PipelineError
from fxpar.pipeline.stage_costs import link

Shape = tuple[int, ...]
T = TypeVar("T")


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

    def by_shape(self) -> dict[Shape, Cluster]:
        """The first stage's cluster of each mesh shape, in stage order: one plan each."""
        found: dict[Shape, Cluster] = {}
        for cluster in self.clusters:
            found.setdefault(cluster.mesh_shape, cluster)
        return found

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


def meshes_of(
    pipeline: Pipeline, stage_cluster: Cluster | Sequence[Cluster] | None
) -> StageMeshes | None:
    """The stage meshes of a :class:`~fxpar.pipeline.PipelineModel` given ``stage_cluster``:
    None (data-parallel replicas per stage, or with ``pipeline.stage_meshes`` default clusters
    of those shapes), one Cluster (every stage on that mesh) or one Cluster per stage (their
    shapes those of ``pipeline.stage_meshes``).

    Raises:
        PipelineError: the clusters do not match the pipeline, or a stage mesh is asked for
            with replicas or several chunks per stage.
    """
    shapes = pipeline.stage_meshes
    if isinstance(stage_cluster, Cluster):
        if shapes is not None:
            raise PipelineError(
                f"{pipeline} names a mesh per stage: give one Cluster per stage as "
                "stage_cluster (fxpar.pipeline.meshes.stage_meshes(pipeline, cluster) makes "
                "them from the whole pipeline's cluster), or none"
            )
        if pipeline.data_parallel * pipeline.virtual_stages > 1:
            raise PipelineError(
                f"{pipeline} asks for data_parallel={pipeline.data_parallel} replicas or "
                f"virtual_stages={pipeline.virtual_stages} chunks per stage, and a stage mesh "
                f"{stage_cluster.mesh_shape}: choose one (a plan on the stage mesh can itself "
                "be data-parallel; stage meshes run one chunk per stage)"
            )
        return uniform_meshes(stage_cluster, pipeline.num_stages)
    if stage_cluster is None:
        if shapes is None:
            return None
        whole = Cluster((pipeline.world_size,))
        return StageMeshes(tuple(submesh_cluster(whole, shape, len(shapes)) for shape in shapes))
    clusters = tuple(stage_cluster)
    given = tuple(cluster.mesh_shape for cluster in clusters)
    if shapes is None or given != shapes:
        raise PipelineError(
            f"stage_cluster gives stage meshes {given}, but {pipeline} names "
            + ("none: name them in Pipeline(stage_meshes=...)" if shapes is None else f"{shapes}")
        )
    return StageMeshes(clusters)


def plan_each(
    program: Program, meshes: StageMeshes, plan: Callable[[Program, Cluster], T]
) -> dict[Shape, T]:
    """``plan(program, cluster)`` for each stage mesh shape (a copy of ``program`` each, where
    there are several: planning annotates the graph in place)."""
    by_shape = meshes.by_shape()
    several = len(by_shape) > 1
    return {
        shape: plan(program.copy() if several else program, cluster)
        for shape, cluster in by_shape.items()
    }


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
    "meshes_of",
    "plan_each",
    "stage_meshes",
    "submesh_cluster",
    "uniform_meshes",
]
