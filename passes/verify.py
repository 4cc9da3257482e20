"""A pass that runs the IR verifier, to place explicitly anywhere in a pipeline."""

from __future__ import annotations

from dataclasses import dataclass

from fxpar.passes.base import Pass
from fxpar.program import Program
from fxpar.verify import verify


@dataclass(frozen=True)
class Verify(Pass):
    """Check the IR invariants (see :mod:`fxpar.verify`); changes nothing."""

    name = "verify"

    def run(self, program: Program) -> Program:
        return verify(program)
