"""fxpar: an auto-parallelizing compiler for PyTorch training, built on torch.fx.

The stages, as docs/architecture.md draws them::

    capture -> Program -> passes (annotate cost, ...) -> plan -> per-rank programs -> runtime

What exists today: :func:`capture` (one training step as a functional ATen graph), the IR
(:mod:`fxpar.ir`, :class:`Program`), the pass infrastructure (:mod:`fxpar.passes`), cost
annotation, sharding rules (:mod:`fxpar.rules`), manual plans (:mod:`fxpar.plans`), automatic
intra-op planning (:func:`plan`, solvers in :mod:`fxpar.solvers`), lowering to per-rank programs
(:func:`lower`), running them simulated (:mod:`fxpar.testing`) or on gloo processes
(:mod:`fxpar.runtime`), a Cluster's numbers measured on the machine (:func:`calibrate`), and
training end to end with :func:`compile` (:class:`ParallelModel`, sharded optimizers in
:mod:`fxpar.optim`, sharded checkpoints), models bigger than one process built by
:func:`deferred_init` or loaded from a checkpoint piece by piece.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING

from fxpar import checkpoint, errors, ir, models, optim, pipeline
from fxpar.cluster import Cluster, CollectiveLink
from fxpar.compiler import compile, plan
from fxpar.ir import work_report
from fxpar.ir.capture import capture
from fxpar.ir.precision import MixedPrecision
from fxpar.ir.program import Program, Signature, StepResult
from fxpar.ir.verify import verify
from fxpar.lowering import lower
from fxpar.passes import manual as plans
from fxpar.pipeline import Pipeline, PipelineModel
from fxpar.planning import plan_file as plan_io
from fxpar.planning.plan import Plan
from fxpar.planning.problem import PlanOptions
from fxpar.runtime import launch as _launch
from fxpar.runtime.calibration import calibrate, calibrate_ops
from fxpar.runtime.deferred import deferred_init
from fxpar.runtime.parallel import ParallelModel

# Imported for its side effect: the docs call fxpar.runtime.launch.spawn after `import fxpar`,
# and fxpar/runtime/__init__.py leaves launch out.
del _launch

if TYPE_CHECKING:
    from fxpar import testing as testing

__all__ = [
    "Cluster",
    "CollectiveLink",
    "MixedPrecision",
    "ParallelModel",
    "Pipeline",
    "PipelineModel",
    "Plan",
    "PlanOptions",
    "Program",
    "Signature",
    "StepResult",
    "calibrate",
    "calibrate_ops",
    "capture",
    "checkpoint",
    "compile",
    "deferred_init",
    "errors",
    "ir",
    "lower",
    "models",
    "optim",
    "pipeline",
    "plan",
    "plan_io",
    "plans",
    "verify",
    "work_report",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> ModuleType:
    # fxpar.testing needs hypothesis (the "test" extra), so it is imported on first use rather
    # than with fxpar; fxpar.testing.pipeline too, which the docs also name.
    if name == "testing":
        importlib.import_module("fxpar.testing.pipeline")
        return importlib.import_module("fxpar.testing")
    raise AttributeError(f"module 'fxpar' has no attribute {name!r}")
