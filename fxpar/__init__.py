"""fxpar: an auto-parallelizing compiler for PyTorch training, built on torch.fx.

The pipeline, as in DESIGN.md::

    capture -> Program -> passes (annotate cost, ...) -> plan -> per-rank programs -> runtime

What exists today: :func:`capture` (one training step as a functional ATen graph), the IR
(:mod:`fxpar.ir`, :class:`Program`), the pass infrastructure (:mod:`fxpar.passes`) and cost
annotation.
"""

from __future__ import annotations

from fxpar import errors, ir
from fxpar.capture import capture
from fxpar.program import Program, Signature, StepResult
from fxpar.verify import verify

__all__ = ["Program", "Signature", "StepResult", "capture", "errors", "ir", "verify"]
__version__ = "0.1.0"
