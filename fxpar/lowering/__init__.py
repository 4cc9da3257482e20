"""Lowering: a planned Program to one program per rank, with local shapes and collectives.

:mod:`fxpar.lowering.spmd` rewrites a graph whose every node carries its chosen strategy into
per-rank GraphModules (:func:`lower`, :func:`lower_graph`); :mod:`fxpar.lowering.grouping`
decides which of their collectives travel together (buckets, per-layer gathers) and when.
"""

from __future__ import annotations

from fxpar.lowering.grouping import (
    BUCKET_BYTES,
    FIRST_BUCKET_BYTES,
    Bucketed,
    Gathered,
    GatherGroup,
    Gathers,
    ViewChain,
    buckets,
    casts_parameter,
    cut_buckets,
    gather_groups,
    gather_sources,
    needs_strategy,
    reread_in_backward,
)
from fxpar.lowering.spmd import (
    CollectiveRecord,
    LoweredGraph,
    RankProgram,
    SPMDProgram,
    conversion_program,
    deferred_gradient_specs,
    localize_shape_arguments,
    lower,
    lower_graph,
    output_specs,
    value_spec,
)
from fxpar.sharding.reshard import BucketRoute, bucket_route

__all__ = [
    "BUCKET_BYTES",
    "FIRST_BUCKET_BYTES",
    "BucketRoute",
    "Bucketed",
    "CollectiveRecord",
    "GatherGroup",
    "Gathered",
    "Gathers",
    "LoweredGraph",
    "RankProgram",
    "SPMDProgram",
    "ViewChain",
    "bucket_route",
    "buckets",
    "casts_parameter",
    "conversion_program",
    "cut_buckets",
    "deferred_gradient_specs",
    "gather_groups",
    "gather_sources",
    "localize_shape_arguments",
    "lower",
    "lower_graph",
    "needs_strategy",
    "output_specs",
    "reread_in_backward",
    "value_spec",
]
