"""The process groups of a :class:`~fxpar.pipeline.PipelineModel`: each stage's replicas, each
stage's device mesh, and the holders of each tied weight, whose gradients are summed once per
step; and the reduction of a step's loss over every rank.

``new_group`` (and a DeviceMesh, which makes groups) is collective over the world: every rank
creates every group in the same order and keeps its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Shard

from fxpar.cluster import mesh_device_type
from fxpar.pipeline.meshes import StageMeshes
from fxpar.pipeline.options import Pipeline
from fxpar.pipeline.split import SplitProgram
from fxpar.runtime import waiting
from fxpar.runtime.devices import for_collective
from fxpar.runtime.weights import Piece
from fxpar.sharding import Spec


@dataclass(frozen=True)
class TiedSum:
    """Sums this rank's piece of a tied weight's gradient over the stages holding the weight.

    When every holder runs the same mesh and plan, the device at coordinate ``c`` of each
    holder has the same piece, and the pieces are all-reduced among them (``box`` None).
    Otherwise (holders on meshes of different shapes, laying the weight out differently) each
    rank places its piece in a whole-size tensor of zeros, one device per distinct piece of
    each stage counting it, and one all-reduce over every device of the holders gives each
    the whole sum, of which it keeps its piece."""

    group: Any
    box: tuple[slice, ...] | None = None
    shape: tuple[int, ...] = ()
    counted: bool = True

    def __call__(self, gradient: torch.Tensor) -> torch.Tensor:
        if self.box is None:
            waiting.all_reduce(gradient, self.group)
            return gradient
        whole = torch.zeros(self.shape, dtype=gradient.dtype, device=gradient.device)
        if self.counted:
            whole[self.box] = gradient
        waiting.all_reduce(whole, self.group)
        return whole[self.box].clone()


_CPU = torch.device("cpu")


class LossReduction:
    """A step's mean loss on every rank. The losses are computed by the last stage, replicated
    over its mesh: one device of each of its replicas counts its sum, every other rank zero,
    and one all-reduce over the world adds them. :meth:`start` posts that all-reduce as soon as
    the rank's last loss is known (the executor's ``losses_done``), so it travels while the
    rest of the step computes; :meth:`wait` ends it and divides by the step's ``divisor``."""

    def __init__(
        self,
        *,
        counted: bool,
        divisor: int,
        dtype: torch.dtype,
        distributed: bool,
        device: torch.device = _CPU,
    ) -> None:
        """``device``: where the losses are computed, and the mean is returned."""
        self.counted, self.divisor, self.dtype = counted, divisor, dtype
        self.distributed, self.device = distributed, device
        self._sum: torch.Tensor | None = None
        self._work: Any = None

    def start(self, loss_sum: torch.Tensor | None) -> None:
        mine = loss_sum if self.counted and loss_sum is not None else torch.zeros(())
        self._sum = mine.detach().to(torch.float64, copy=True)
        if self.distributed:
            self._sum = for_collective(self._sum)
            self._work = dist.all_reduce(self._sum, async_op=True)

    def wait(self) -> torch.Tensor:
        if self._sum is None:
            raise RuntimeError("LossReduction.wait before start")  # the executor starts it
        waiting.wait(self._work, poll=waiting.pollable(self._sum))
        return (self._sum / self.divisor).to(self.device, self.dtype)


def replica_group(pipeline: Pipeline, stage: int) -> Any:
    """The group of ``stage``'s data-parallel replicas (None with one per stage)."""
    if pipeline.data_parallel == 1:
        return None
    mine = None
    per_stage = pipeline.data_parallel
    for each in range(pipeline.num_stages):
        group = dist.new_group(list(range(each * per_stage, (each + 1) * per_stage)))
        if each == stage:
            mine = group
    return mine


def tied_sums(
    split: SplitProgram,
    pipeline: Pipeline,
    rank: int,
    *,
    per_stage: int,
    meshes: StageMeshes | None,
    spec_of: Any,
    shapes: dict[str, Any],
) -> dict[str, TiedSum]:
    """How this rank sums each tied weight it holds over the weight's holders.
    ``spec_of(stage, name)``: the layout ``stage``'s plan gives ``name`` (with ``meshes``)."""
    by_holders: dict[tuple[int, ...], list[str]] = {}
    for name, chunks in split.shared_parameters().items():
        holders = tuple(sorted({pipeline.stage_of(chunk) for chunk in chunks}))
        if len(holders) > 1:  # else chunks of one stage, whose worker adds the gradients
            by_holders.setdefault(holders, []).append(name)
    found: dict[str, TiedSum] = {}
    for holders, names in by_holders.items():
        if meshes is None or len({meshes.shapes[s] for s in holders}) == 1:
            size = per_stage if meshes is None else meshes.clusters[holders[0]].world_size
            for local in range(size):
                ranks = [_rank(s, local, per_stage, meshes) for s in holders]
                group = dist.new_group(ranks)
                if rank in ranks:
                    found.update({name: TiedSum(group) for name in names})
            continue
        ranks = [r for s in holders for r in meshes.ranks(s)]
        group = dist.new_group(ranks)
        if rank not in ranks:
            continue
        stage, _ = meshes.locate(rank)
        mesh, coordinate = meshes.shapes[stage], meshes.coordinate(rank)
        for name in names:
            spec: Spec = spec_of(stage, name)
            shape = tuple(int(n) for n in shapes[name])
            found[name] = TiedSum(
                group,
                box=Piece(spec, mesh, coordinate).slices(shape),
                shape=shape,
                counted=first_holder(spec, coordinate),
            )
    return found


def first_holder(spec: Spec, coordinate: Sequence[int]) -> bool:
    """Whether the device at ``coordinate`` is the first of those holding its piece of a
    tensor laid out as ``spec`` (index 0 on every axis that does not shard it)."""
    return all(
        isinstance(placement, Shard) or index == 0
        for placement, index in zip(spec, coordinate, strict=True)
    )


def _rank(stage: int, local: int, per_stage: int, meshes: StageMeshes | None) -> int:
    return stage * per_stage + local if meshes is None else meshes.ranks(stage)[local]


def stage_device_mesh(
    pipeline: Pipeline, meshes: StageMeshes | None, stage: int, device_type: str = "cpu"
) -> Any:
    """This stage's DeviceMesh (its stage mesh, or its replicas), whose groups carry the stage
    plan's collectives, and on which checkpoints place pieces. ``device_type``: where the
    ranks' tensors are (the mesh's device type is :func:`fxpar.cluster.mesh_device_type`'s)."""
    device_type = mesh_device_type(device_type)
    if meshes is not None and (not meshes.uniform or not meshes.stage_major):
        made = [
            DeviceMesh(
                device_type,
                torch.tensor(meshes.ranks(each)).reshape(cluster.mesh_shape),
                mesh_dim_names=cluster.axis_names,
            )
            for each, cluster in enumerate(meshes.clusters)
        ]
        return made[stage]
    cluster = meshes.clusters[0] if meshes is not None else None
    shape = cluster.mesh_shape if cluster else (pipeline.data_parallel,)
    names = cluster.axis_names if cluster else ("replicas",)
    stage_axis = "stage"
    while stage_axis in names:
        stage_axis += "_"
    world_mesh = init_device_mesh(
        device_type,
        (pipeline.num_stages, *shape),
        mesh_dim_names=(stage_axis, *names),
    )
    return world_mesh[names]


__all__ = ["TiedSum", "first_holder", "replica_group", "stage_device_mesh", "tied_sums"]
