"""The central promise, as a property: for random small models, random meshes of 1-4 devices
(1-D and 2-D) and ANY random valid choice of strategies (and whatever the ILP picks), the
simulated per-rank programs give the single-device loss, gradients and buffer updates (fp32,
rtol 1e-4).

The random plans' examples draw far fewer model structures than examples (about 55 for the 100
of the first test, 37 for the 60 of the last), and capturing a step took most of an example's
time: each structure's step is captured once per module and every example plans a copy of it
(``Program.copy``, what planning one step for several meshes uses); the ILP's 30 examples draw
28 structures and capture each. ``fxpar.testing.assert_plan_equivalent``, which captures on
every call, runs in tests/test_random.py and docs/property_testing.md."""

from __future__ import annotations

import pytest
from conftest import on_test_device
from hypothesis import given, settings
from hypothesis.strategies import sampled_from

import fxpar
from fxpar.cluster import Cluster
from fxpar.ir.capture import StepKind, capture
from fxpar.passes import plan_program
from fxpar.passes.manual import random_plan
from fxpar.solvers.ilp import ILPSolver
from fxpar.testing import ModelCase, assert_equivalent
from fxpar.testing import strategies as fst

Captures = dict[tuple[object, ...], fxpar.Program]


@pytest.fixture(scope="module")
def captures() -> Captures:
    """Captured steps by what they depend on (:func:`_captured`), for this module's tests."""
    return {}


def _captured(captures: Captures, case: ModelCase, step: StepKind = "train") -> fxpar.Program:
    """A copy of ``case``'s ``step`` (a forward: without the loss and targets), captured the
    first time a model of its structure comes. The key is what a capture depends on: the
    modules (their repr names every layer and size), the batch's shapes and dtypes, the loss
    and the kind of step; not the values of the weights, which the examples draw anew."""
    loss_fn, targets = (None, ()) if step == "forward" else (case.loss_fn, case.targets)
    batch = (*case.inputs, *targets)
    key = (repr(case.model), tuple((t.shape, t.dtype) for t in batch), loss_fn, step)
    if key not in captures:
        captures[key] = capture(case.model, case.inputs, loss_fn, example_targets=targets,
                                step=step)  # fmt: skip
    return captures[key].copy()


def _assert_plan_equivalent(
    captures: Captures, case: ModelCase, cluster: Cluster, seed: int, step: StepKind = "train"
) -> None:
    """``fxpar.testing.assert_plan_equivalent`` on a copy of the captured step: a random valid
    plan, lowered, simulated on every rank, gives the one-device step (rtol 1e-4, atol 1e-6)."""
    program = _captured(captures, case, step)
    targets = () if step == "forward" else case.targets
    flat = on_test_device(program.flat_inputs(case.model, *case.inputs, *targets))
    spmd = fxpar.lower(random_plan(program, cluster, seed), cluster)
    assert_equivalent(spmd, flat, rtol=1e-4, atol=1e-6)


# 100 examples (each plans, lowers and simulates every rank, most of a second) draw every layer
# kind of fst.models() and every mesh of fst.clusters(), each kind on most meshes; twice as many
# mostly draw structures again, under other random plans.
@settings(max_examples=100)
@given(case=fst.models(), cluster=fst.clusters(), seed=fst.plan_seeds())
def test_random_plans_train_like_one_device(
    captures: Captures, case: ModelCase, cluster: Cluster, seed: int
) -> None:
    _assert_plan_equivalent(captures, case, cluster, seed)


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
    captures: Captures, case: ModelCase, cluster: Cluster, seed: int, step: StepKind
) -> None:
    """Forward-only Programs too: a loss evaluation's loss, and a forward's outputs (which
    leave in whatever layout the plan made them, partial sums reduced), reassemble to what
    one device computes."""
    _assert_plan_equivalent(captures, case, cluster, seed, step=step)
