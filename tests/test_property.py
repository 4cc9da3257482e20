"""The central promise, as a property: for random small models, random meshes of 1-4 devices
(1-D and 2-D) and ANY random valid choice of strategies (and whatever the ILP picks), the
simulated per-rank programs give the single-device loss, gradients and buffer updates (fp32,
rtol 1e-4)."""

from __future__ import annotations

from conftest import TEST_DEVICE, on_test_device
from hypothesis import given, settings
from hypothesis.strategies import sampled_from

import fxpar
from fxpar.cluster import Cluster
from fxpar.ir.capture import StepKind, capture
from fxpar.passes import plan_program
from fxpar.solvers.ilp import ILPSolver
from fxpar.testing import ModelCase, assert_equivalent, assert_plan_equivalent
from fxpar.testing import strategies as fst


@settings(max_examples=200)
@given(case=fst.models(), cluster=fst.clusters(), seed=fst.plan_seeds())
def test_random_plans_train_like_one_device(case: ModelCase, cluster: Cluster, seed: int) -> None:
    assert_plan_equivalent(case, cluster, seed, device=TEST_DEVICE)


@settings(max_examples=30)
@given(case=fst.models(), cluster=fst.clusters())
def test_ilp_plans_train_like_one_device(case: ModelCase, cluster: Cluster) -> None:
    """Whatever the solver picks from the cost model, the plan lowers and trains exactly."""
    program = capture(case.model, case.inputs, case.loss_fn, example_targets=case.targets)
    flat = on_test_device(program.flat_inputs(case.model, *case.inputs, *case.targets))
    chosen = plan_program(program, cluster, solver=ILPSolver(time_limit=10.0))
    assert chosen.solution.status in ("optimal", "time_limit")
    assert_equivalent(fxpar.lower(chosen), flat)


@settings(max_examples=60)
@given(
    case=fst.models(),
    cluster=fst.clusters(),
    seed=fst.plan_seeds(),
    step=sampled_from(["loss", "forward"]),
)
def test_random_plans_evaluate_and_infer_like_one_device(
    case: ModelCase, cluster: Cluster, seed: int, step: StepKind
) -> None:
    """Forward-only Programs too: a loss evaluation's loss, and a forward's outputs (which
    leave in whatever layout the plan made them, partial sums reduced), reassemble to what
    one device computes."""
    assert_plan_equivalent(case, cluster, seed, step=step, device=TEST_DEVICE)
