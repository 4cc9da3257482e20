"""Sharding: how a tensor is laid out over the device mesh, and how to move between layouts.

``fxpar.sharding`` itself re-exports the specs, strategies and their annotations
(:mod:`fxpar.sharding.spec`); :mod:`fxpar.sharding.reshard` maps a change of spec to collectives,
one mesh axis at a time. The rules that list each op's strategies are in :mod:`fxpar.rules`, a
registry users extend.
"""

from __future__ import annotations

from fxpar.sharding.spec import (
    P,
    R,
    S,
    Sharding,
    Spec,
    Strategies,
    Strategy,
    all_specs,
    assemble,
    has_partial,
    is_valid,
    local_shape,
    piece_bytes,
    replicated,
    shard_tensor,
    shards_per_dim,
    spec_str,
)

__all__ = [
    "P",
    "R",
    "S",
    "Sharding",
    "Spec",
    "Strategies",
    "Strategy",
    "all_specs",
    "assemble",
    "has_partial",
    "is_valid",
    "local_shape",
    "piece_bytes",
    "replicated",
    "shard_tensor",
    "shards_per_dim",
    "spec_str",
]
