"""A pass that runs the IR verifier, to place explicitly anywhere in a pass list."""

from __future__ import annotations

from dataclasses import dataclass

from fxpar.ir.program import Program
from fxpar.ir.verify import verify
from fxpar.passes.base import Pass


@dataclass(frozen=True)
class Verify(Pass):
    """Check the IR invariants (see :mod:`fxpar.verify`); changes nothing."""

    name = "verify"

    def run(self, program: Program) -> Program:
        return verify(program)
