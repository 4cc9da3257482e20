"""Lowering: a planned Program to one program per rank, with local shapes and collectives.

:mod:`fxpar.lowering.spmd` emits, for every rank, the code of the collective schedule
(:mod:`fxpar.planning.collective_schedule`: which conversions, buckets and gather groups a
planned graph needs, and where each starts and is waited for) around the graph's ops on local
pieces (:func:`lower`, :func:`lower_graph`).
"""

from __future__ import annotations

from fxpar.lowering.spmd import (
    LoweredGraph,
    RankProgram,
    SPMDProgram,
    conversion_program,
    localize_shape_arguments,
    lower,
    lower_graph,
)
from fxpar.planning.collective_schedule import (
    CollectiveRecord,
    deferred_gradient_specs,
    output_specs,
    value_spec,
)
from fxpar.planning.grouping import BUCKET_BYTES

__all__ = [
    "BUCKET_BYTES",
    "CollectiveRecord",
    "LoweredGraph",
    "RankProgram",
    "SPMDProgram",
    "conversion_program",
    "deferred_gradient_specs",
    "localize_shape_arguments",
    "lower",
    "lower_graph",
    "output_specs",
    "value_spec",
]
