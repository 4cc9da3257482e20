"""The central promise, as a property: for random small models, random meshes of 1-4 devices
(1-D and 2-D) and ANY random valid choice of strategies, the simulated per-rank programs give
the single-device loss, gradients and buffer updates (fp32, rtol 1e-4)."""

from __future__ import annotations

from hypothesis import given, settings

from fxpar.cluster import Cluster
from fxpar.testing import ModelCase, assert_plan_equivalent
from fxpar.testing import strategies as fst


@settings(max_examples=200)
@given(case=fst.models(), cluster=fst.clusters(), seed=fst.plan_seeds())
def test_random_plans_train_like_one_device(case: ModelCase, cluster: Cluster, seed: int) -> None:
    assert_plan_equivalent(case, cluster, seed)
