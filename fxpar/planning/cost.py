"""The cost model: seconds and bytes of strategies and reshardings on a Cluster.

- A collective on mesh axis ``a`` of ``n`` devices moving a local tensor of ``B`` bytes costs
  the axis latency ``α`` plus its bytes over the axis bandwidth ``β``: all-reduce
  ``α + 2(n−1)/n·B/β``, all-gather ``α + (n−1)·B/β`` (it receives ``n−1`` pieces of ``B``),
  reduce-scatter and all-to-all ``α + (n−1)/n·B/β``. Local slices are free. A resharding costs
  the sum of its steps (:func:`fxpar.sharding.reshard.reshard_steps`).
- A strategy's compute time is its share of the node's work, by a roofline:
  ``max(flops / F, bytes / memory_bandwidth)``, where the share divides the node's FLOPs and bytes
  by the devices of every mesh axis on which the strategy splits the node (an axis where any
  input or output is sharded, or an output is partial). Replicated work is done in full.
"""

from __future__ import annotations

import functools
import math

from torch.distributed.tensor import Partial, Shard

from fxpar import ir
from fxpar.cluster import Cluster
from fxpar.sharding import Spec, Strategy, local_shape
from fxpar.sharding.reshard import reshard_steps


def collective_seconds(kind: str, local_bytes: float, devices: int, bandwidth: float,
                       latency: float) -> float:  # fmt: skip
    """Alpha-beta time of one collective step (0 for local steps)."""
    if devices <= 1 or kind in ("slice", "to_partial"):
        return 0.0
    if kind == "all_reduce":
        volume = 2 * (devices - 1) / devices * local_bytes
    elif kind == "all_gather":
        volume = (devices - 1) * local_bytes
    else:  # reduce_scatter, all_to_all
        volume = (devices - 1) / devices * local_bytes
    return latency + volume / bandwidth


@functools.lru_cache(maxsize=1 << 20)
def reshard_seconds(src: Spec, dst: Spec, meta: ir.TensorMeta, cluster: Cluster) -> float:
    """Time to turn a tensor laid out as ``src`` into ``dst``."""
    if src == dst:
        return 0.0
    shape = tuple(ir.evaluate(s) for s in meta.shape)
    itemsize = meta.dtype.itemsize
    seconds = 0.0
    current = src
    for step in reshard_steps(src, dst, cluster.mesh_shape):
        local = local_shape(shape, current, cluster.mesh_shape)
        nbytes = math.prod(local) * itemsize
        seconds += collective_seconds(
            step.kind, nbytes, cluster.mesh_shape[step.axis],
            cluster.bandwidth[step.axis], cluster.latency[step.axis],
        )  # fmt: skip
        current = step.apply(current)
    return seconds


def split_factor(strategy: Strategy, mesh_shape: tuple[int, ...]) -> int:
    """How many devices share the node's work under ``strategy``."""
    factor = 1
    for axis, size in enumerate(mesh_shape):
        placements = [s[axis] for s in (*strategy.inputs, *strategy.outputs) if s is not None]
        if any(isinstance(p, Shard) for p in placements) or any(
            isinstance(s[axis], Partial) for s in strategy.outputs if s is not None
        ):
            factor *= size
    return factor


def compute_seconds(cost: ir.Cost, strategy: Strategy, cluster: Cluster) -> float:
    """The roofline time of a node's share of work under ``strategy``."""
    share = split_factor(strategy, cluster.mesh_shape)
    flops = ir.evaluate(cost.flops) / share
    moved = (ir.evaluate(cost.bytes_read) + ir.evaluate(cost.bytes_written)) / share
    return max(flops / cluster.flops, moved / cluster.memory_bandwidth)


def local_bytes(meta: ir.TensorMeta, spec: Spec, cluster: Cluster) -> int:
    """Bytes of one device's piece of a tensor."""
    shape = tuple(ir.evaluate(s) for s in meta.shape)
    return math.prod(local_shape(shape, spec, cluster.mesh_shape)) * meta.dtype.itemsize
