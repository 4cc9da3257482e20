"""fxpar: an auto-parallelizing compiler for PyTorch training, built on torch.fx.

The pipeline, as in DESIGN.md::

    capture -> Program -> passes (annotate cost, ...) -> plan -> per-rank programs -> runtime

What exists today: :func:`capture` (one training step as a functional ATen graph), the IR
(:mod:`fxpar.ir`, :class:`Program`), the pass infrastructure (:mod:`fxpar.passes`), cost
annotation, sharding rules (:mod:`fxpar.rules`), manual plans (:mod:`fxpar.plans`), automatic
intra-op planning (:func:`plan`, solvers in :mod:`fxpar.solvers`), lowering to per-rank programs
(:func:`lower`), running them simulated (:mod:`fxpar.testing`) or on gloo processes
(:mod:`fxpar.runtime`), and training end to end with :func:`compile` (:class:`ParallelModel`,
sharded optimizers in :mod:`fxpar.optim`, sharded checkpoints).
"""

from __future__ import annotations

from fxpar import errors, ir, optim, pipeline
from fxpar.capture import capture
from fxpar.cluster import Cluster
from fxpar.lowering import lower
from fxpar.parallel import ParallelModel, compile
from fxpar.pipeline import Pipeline, PipelineModel
from fxpar.planner import Plan, PlanOptions, plan
from fxpar.program import Program, Signature, StepResult
from fxpar.verify import verify

__all__ = [
    "Cluster",
    "ParallelModel",
    "Pipeline",
    "PipelineModel",
    "Plan",
    "PlanOptions",
    "Program",
    "Signature",
    "StepResult",
    "capture",
    "compile",
    "errors",
    "ir",
    "lower",
    "optim",
    "pipeline",
    "plan",
    "verify",
]
__version__ = "0.1.0"
