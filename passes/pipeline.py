"""The default pass pipeline, written out in one place.

The pipeline grows with fxpar (sharding strategies, coarsening, solving, lowering). To add your
own pass, edit the returned manager by name::

    manager = default_pipeline().insert_after("annotate-cost", MyPass(threshold=4))
    program = manager.run(fxpar.capture(model, inputs))
"""

from __future__ import annotations

from fxpar.passes.annotate_cost import AnnotateCost
from fxpar.passes.base import PassManager


def default_pipeline(*, verify: bool = False) -> PassManager:
    """fxpar's passes in order; ``verify`` checks the IR after each (debug mode)."""
    return PassManager(
        (AnnotateCost(),),
        verify=verify,
    )
