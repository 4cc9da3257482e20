"""fxpar's compiler passes: one pass per module, the pass manager and the default pipeline."""

from __future__ import annotations

from fxpar.passes.annotate_cost import AnnotateCost, node_cost
from fxpar.passes.base import Pass, PassManager
from fxpar.passes.pipeline import default_pipeline
from fxpar.passes.verify import Verify

__all__ = ["AnnotateCost", "Pass", "PassManager", "Verify", "default_pipeline", "node_cost"]
