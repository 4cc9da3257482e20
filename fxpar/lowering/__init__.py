"""Lowering: a planned Program to one program per rank, with local shapes and collectives.

:mod:`fxpar.lowering.spmd` rewrites a graph whose every node carries its chosen strategy into
per-rank GraphModules (:func:`lower`, :func:`lower_graph`).
"""

from __future__ import annotations

from fxpar.lowering.spmd import (
    BUCKET_BYTES,
    FIRST_BUCKET_BYTES,
    Bucketed,
    CollectiveRecord,
    Gathered,
    GatherGroup,
    LoweredGraph,
    RankProgram,
    SPMDProgram,
    buckets,
    conversion_program,
    cut_buckets,
    deferred_gradient_specs,
    gather_groups,
    localize_shape_arguments,
    lower,
    lower_graph,
    needs_strategy,
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
    "LoweredGraph",
    "RankProgram",
    "SPMDProgram",
    "bucket_route",
    "buckets",
    "conversion_program",
    "cut_buckets",
    "deferred_gradient_specs",
    "gather_groups",
    "localize_shape_arguments",
    "lower",
    "lower_graph",
    "needs_strategy",
    "output_specs",
    "value_spec",
]
