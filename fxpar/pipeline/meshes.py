"""Where the stages of a pipeline run: a mesh per stage, and the ranks of each.

By default stages are laid out stage-major: stage ``s`` takes the ``devices(s)`` ranks after
those of stages ``0 .. s-1``, and the ``i``-th of them is device ``i`` (row-major) of stage
``s``'s mesh. With every stage on the same mesh this is the layout ``s * T + t`` of a cluster of
mesh ``(K, *stage_mesh)``; with ``Pipeline(stage_meshes=...)`` the stages' meshes may differ in
shape and size (Alpa's submeshes), and each runs an intra-op plan made for its own mesh.

On a 2-D cluster ``(R, C)`` (rows of ``C`` devices on fast links, slower links between rows)
:func:`stage_meshes` places stages the way Alpa tiles the cluster instead, so that no stage
straddles two rows: stages of whole rows first, then stages of ``1/k`` of a row, widest first,
left to right (:func:`fxpar.solvers.stages.place_submeshes`). A stage's ranks are then not
necessarily after the previous stage's; :meth:`StageMeshes.ranks` says which they are.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from fxpar.cluster import Cluster, Coordinate
from fxpar.errors import FxparError
from fxpar.ir.program import Program
from fxpar.pipeline.options import Pipeline, PipelineError
from fxpar.solvers.stages import place_submeshes

Shape = tuple[int, ...]
T = TypeVar("T")


@dataclass(frozen=True)
class StageMeshes:
    """The mesh of every stage (a :class:`~fxpar.cluster.Cluster` each, for the plan's costs)
    and the ranks it takes."""

    clusters: tuple[Cluster, ...]
    placement: tuple[tuple[int, ...], ...] | None = None
    """The ranks of each stage's devices, row-major in its mesh; None: stage-major, each
    stage's ranks after the previous stage's."""

    def __post_init__(self) -> None:
        placement = self.placement
        if placement is None:
            sizes = [cluster.world_size for cluster in self.clusters]
            starts = [sum(sizes[:stage]) for stage in range(len(sizes))]
            placement = tuple(
                tuple(range(start, start + size)) for start, size in zip(starts, sizes, strict=True)
            )
        everyone = sorted(rank for ranks in placement for rank in ranks)
        if everyone != list(range(len(everyone))) or [len(r) for r in placement] != [
            cluster.world_size for cluster in self.clusters
        ]:
            raise PipelineError(
                f"stage placement {placement} does not give the stages of meshes "
                f"{self.shapes} each rank once"
            )
        object.__setattr__(self, "placement", placement)

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

    @property
    def stage_major(self) -> bool:
        """Whether each stage's ranks follow the previous stage's."""
        flat = [rank for stage in range(self.num_stages) for rank in self.ranks(stage)]
        return flat == list(range(len(flat)))

    def by_shape(self) -> dict[Shape, Cluster]:
        """The first stage's cluster of each mesh shape, in stage order: one plan each."""
        found: dict[Shape, Cluster] = {}
        for cluster in self.clusters:
            found.setdefault(cluster.mesh_shape, cluster)
        return found

    def ranks(self, stage: int) -> tuple[int, ...]:
        """The ranks of ``stage``'s devices, row-major in its mesh."""
        assert self.placement is not None
        return self.placement[stage]

    def locate(self, rank: int) -> tuple[int, int]:
        """The stage of ``rank`` and its index among that stage's devices."""
        for stage in range(self.num_stages):
            if rank in self.ranks(stage):
                return stage, self.ranks(stage).index(rank)
        raise PipelineError(f"rank {rank} is outside the {self.world_size} devices of the stages")

    def coordinate(self, rank: int) -> Coordinate:
        stage, index = self.locate(rank)
        return self.clusters[stage].coordinate(index)

    def rank(self, stage: int, coordinate: Coordinate) -> int:
        """The rank at ``coordinate`` of ``stage``'s mesh."""
        index = 0
        for size, position in zip(self.shapes[stage], coordinate, strict=True):
            index = index * size + position
        return self.ranks(stage)[index]


def meshes_of(
    pipeline: Pipeline, stage_cluster: Cluster | Sequence[Cluster] | StageMeshes | None
) -> StageMeshes | None:
    """The stage meshes of a :class:`~fxpar.pipeline.PipelineModel` given ``stage_cluster``:
    None (data-parallel replicas per stage, or with ``pipeline.stage_meshes`` default clusters
    of those shapes), one Cluster (every stage on that mesh), one Cluster per stage (their
    shapes those of ``pipeline.stage_meshes``), or :class:`StageMeshes` (which also place the
    stages on ranks: :func:`stage_meshes`).

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
        if pipeline.data_parallel > 1 or (pipeline.virtual_stages > 1 and not pipeline.v_shaped):
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
        return StageMeshes(tuple(whole.submesh(shape) for shape in shapes))
    meshes = stage_cluster if isinstance(stage_cluster, StageMeshes) else None
    clusters = meshes.clusters if meshes is not None else tuple(stage_cluster)  # type: ignore[arg-type]
    given = tuple(cluster.mesh_shape for cluster in clusters)
    if shapes is None or given != shapes:
        raise PipelineError(
            f"stage_cluster gives stage meshes {given}, but {pipeline} names "
            + ("none: name them in Pipeline(stage_meshes=...)" if shapes is None else f"{shapes}")
        )
    return meshes if meshes is not None else StageMeshes(clusters)


def plan_each(
    program: Program, meshes: StageMeshes, plan: Callable[[Program, Cluster], T]
) -> dict[Shape, T]:
    """``plan(program, cluster)`` for each stage mesh shape, all of the one ``program``: a
    planner leaves the Program it plans as it was (as :func:`fxpar.passes.plan_program`
    does)."""
    return {shape: plan(program, cluster) for shape, cluster in meshes.by_shape().items()}


def uniform_meshes(cluster: Cluster, num_stages: int) -> StageMeshes:
    """``num_stages`` stages on the same stage mesh ``cluster``."""
    return StageMeshes((cluster,) * num_stages)


def stage_meshes(pipeline: Pipeline, cluster: Cluster) -> StageMeshes:
    """The stages of ``pipeline`` (which names its ``stage_meshes``) on ``cluster``, whose
    devices they must use exactly; on a 2-D cluster placed as Alpa tiles it, where the meshes
    are whole rows or pieces of a row (module docstring).

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
    clusters = tuple(cluster.submesh(shape) for shape in shapes)
    return StageMeshes(clusters, _tiling(cluster.mesh_shape, shapes))


def _tiling(mesh: Shape, shapes: Sequence[Shape]) -> tuple[tuple[int, ...], ...] | None:
    """Each stage's ranks where stages of ``shapes`` tile the 2-D ``mesh`` as Alpa's
    submeshes (whole rows, pieces of a row); None where the mesh is not 2-D or they do not."""
    if len(mesh) != 2:
        return None
    columns = mesh[1]
    blocks = []
    for shape in shapes:
        devices = math.prod(shape)
        if devices % columns == 0:
            blocks.append((devices // columns, columns))
        elif columns % devices == 0:
            blocks.append((1, devices))
        else:
            return None
    try:
        origins = place_submeshes(mesh, blocks)
    except FxparError:
        return None
    return tuple(
        tuple((row + i) * columns + column + j for i in range(height) for j in range(width))
        for (row, column), (height, width) in zip(origins, blocks, strict=True)
    )


def straddling(cluster: Cluster, shapes: Sequence[Shape]) -> tuple[int, ...]:
    """The stages of meshes ``shapes`` whose devices, where :func:`stage_meshes` places them on
    ``cluster``, leave the block of ranks whose links priced them: none where Alpa's tiling
    places them, else those whose consecutive ranks cross a block."""
    if _tiling(cluster.mesh_shape, shapes) is not None:
        return ()
    return crossing_stages(cluster, shapes)


def coordinates(shape: Shape) -> list[Coordinate]:
    """Every coordinate of a mesh of ``shape``, row-major."""
    return [tuple(c) for c in itertools.product(*(range(n) for n in shape))]


__all__ = [
    "StageMeshes",
    "coordinates",
    "meshes_of",
    "plan_each",
    "stage_meshes",
    "straddling",
    "uniform_meshes",
]


def submesh_shapes(cluster: Cluster) -> tuple[Shape, tuple[Shape, ...]]:
    """The mesh the stage DP tiles and the submesh shapes a stage may take on it:

    - on a 1-D cluster ``(D,)`` (and on clusters of more than two axes, taken as ``D`` ranks
      in a row): ``(b,)`` for every ``b`` that divides ``D`` or is a power of two up to ``D``.
      Any ``b <= D`` would tile a line, but each shape costs a plan of the whole step, and
      sizes of neither kind rarely split a tensor evenly; divisors keep every uniform
      pipeline, powers of two add Alpa's pieces (``(1,) + (2,)`` on 3 devices);
    - on a 2-D cluster ``(R, C)``: Alpa's ``(1, w)`` for ``w`` a power of two dividing ``C``,
      and whole rows ``(r, C)`` for ``r`` that divides ``R`` or is a power of two up to ``R``
      (the 1-D rule, over rows: Alpa allows every ``r``, but each costs a plan of the whole
      step, which on ``(128, 8)`` would be 128 plans instead of 8): every mix of them with
      ``R C`` devices tiles the cluster (:func:`~fxpar.solvers.stages.check_submesh_shapes`).
    """
    if cluster.ndim == 2:
        rows, columns = cluster.mesh_shape
        pieces = [(1, w) for w in _powers_of_two(columns) if columns % w == 0 and w < columns]
        counts = sorted(set(divisors(rows)) | set(_powers_of_two(rows)))
        return cluster.mesh_shape, (*pieces, *((r, columns) for r in counts))
    world = cluster.world_size
    sizes = sorted(set(divisors(world)) | set(_powers_of_two(world)))
    return (world,), tuple((size,) for size in sizes)


def stage_mesh(submesh: Shape) -> Shape:
    """The mesh a stage on the DP's ``submesh`` runs its plan on: its axes of size 1 dropped
    (``(1, 4)`` -> ``(4,)``), keeping one."""
    return tuple(n for n in submesh if n > 1) or (1,)


def uniform_stage_mesh(cluster: Cluster, devices: int) -> Shape:
    """The stage mesh of ``devices`` devices that :func:`submesh_shapes` offers, else
    ``(devices,)``."""
    _, shapes = submesh_shapes(cluster)
    return next((stage_mesh(shape) for shape in shapes if math.prod(shape) == devices), (devices,))


def crossing_stages(cluster: Cluster, meshes: Sequence[Shape]) -> tuple[int, ...]:
    """The stages whose consecutive ranks (stage-major, as the runtime lays them out) leave
    the block of ranks whose links :meth:`Cluster.link <fxpar.cluster.Cluster.link>` priced
    them with."""
    crossing = []
    offset = 0
    for index, mesh in enumerate(meshes):
        devices = math.prod(mesh)
        _, block = cluster.link_axis(devices)
        if offset // block != (offset + devices - 1) // block:
            crossing.append(index)
        offset += devices
    return tuple(crossing)


def divisors(count: int) -> list[int]:
    return [d for d in range(1, count + 1) if count % d == 0]


def _powers_of_two(limit: int) -> list[int]:
    return [1 << k for k in range(limit.bit_length())]
