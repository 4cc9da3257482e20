"""Lowering: a planned Program to one program per rank, with local shapes and collectives.

:mod:`fxpar.lowering.spmd` rewrites a graph whose every node carries its chosen strategy into
per-rank GraphModules (:func:`lower`, :func:`lower_graph`).
"""

from __future__ import annotations

from fxpar.lowering.spmd import (
    BUCKET_BYTES,
    CollectiveRecord,
    LoweredGraph,
    RankProgram,
    SPMDProgram,
    buckets,
    conversion_program,
    deferred_gradient_specs,
    localize_shape_arguments,
    lower,
    lower_graph,
    needs_strategy,
    output_specs,
    value_spec,
)
from fxpar.sharding.reshard import single_all_reduce

__all__ = [
    "BUCKET_BYTES",
    "CollectiveRecord",
    "LoweredGraph",
    "RankProgram",
    "SPMDProgram",
    "buckets",
    "conversion_program",
    "deferred_gradient_specs",
    "localize_shape_arguments",
    "lower",
    "lower_graph",
    "needs_strategy",
    "output_specs",
    "single_all_reduce",
    "value_spec",
]
