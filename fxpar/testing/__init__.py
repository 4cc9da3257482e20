"""Testing kit: simulate per-rank programs in one process, check them against the Program, check
sharding rules against ground truth, and hypothesis strategies for property tests.

For a user writing a pass or a rule, :func:`assert_plan_equivalent` is the property in one call:
capture a model, pick a random valid plan, lower it, simulate every rank, and compare the loss,
gradients and buffer updates with one device.
"""

from __future__ import annotations

import torch

from fxpar.cluster import Cluster
from fxpar.ir.capture import StepKind, capture
from fxpar.lowering import SPMDProgram, lower
from fxpar.passes.manual import random_plan
from fxpar.rules import RuleRegistry
from fxpar.testing.equivalence import (
    Divergence,
    EquivalenceError,
    assert_equivalent,
    first_divergence,
)
from fxpar.testing.rules import RuleViolation, validate_rules
from fxpar.testing.simulate import SimulationError, SimulationResult, simulate
from fxpar.testing.strategies import ModelCase

__all__ = [
    "Divergence",
    "EquivalenceError",
    "ModelCase",
    "RuleViolation",
    "SimulationError",
    "SimulationResult",
    "assert_equivalent",
    "assert_plan_equivalent",
    "first_divergence",
    "simulate",
    "validate_rules",
]


def assert_plan_equivalent(
    case: ModelCase,
    cluster: Cluster,
    seed: int,
    *,
    rules: RuleRegistry | None = None,
    rtol: float = 1e-4,
    atol: float = 1e-6,
    step: StepKind = "train",
    device: torch.device | str = "cpu",
) -> SPMDProgram:
    """Capture ``case``, choose a random valid plan on ``cluster``, lower it and check that the
    simulated ranks train exactly like one device. Returns the lowered programs.

    ``step``: check a loss evaluation (``"loss"``) or the model's forward alone
    (``"forward"``, without the loss function and targets) instead of a training step.
    ``device``: where the ranks and the one-device reference run (``"cuda"`` on a GPU; the
    programs are placed there, :func:`fxpar.ir.placement.place`)."""
    forward = step == "forward"
    loss_fn, targets = (None, ()) if forward else (case.loss_fn, case.targets)
    program = capture(case.model, case.inputs, loss_fn, example_targets=targets, step=step)
    flat = [t.to(device) for t in program.flat_inputs(case.model, *case.inputs, *targets)]
    spmd = lower(random_plan(program, cluster, seed, rules), cluster)
    assert_equivalent(spmd, flat, rtol=rtol, atol=atol)
    return spmd
