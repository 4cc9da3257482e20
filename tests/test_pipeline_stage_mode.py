"""``Pipeline(stage_mode=...)``: whether stages are meshes under an intra-op plan or data-parallel
replicas is a field of the request, never inferred from compile's other arguments.

- ``"auto"`` (the default) is decided by the request and the cluster alone: stage meshes where
  the request names them or the cluster's mesh is ``(K, *stage_mesh)``, else replicas;
- arguments that make an intra-op plan (``solver``, ``manual``, ...) with replica stages are
  refused, saying how to ask for stage meshes, instead of silently switching the mode;
- what the request leaves open is chosen (slow, on 4 gloo ranks): ``Pipeline(stages=2)`` runs
  2 replicas per stage, and ``stage_mode="meshes"`` a 2-device stage mesh each, both training
  like one device.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_pipeline_priced import LR, _eager_gpt, _gpt  # the same GPT, batch and SGD

import fxpar
from fxpar import plans
from fxpar.errors import FxparError
from fxpar.models import gpt_loss
from fxpar.optim import SGD
from fxpar.pipeline import Pipeline, PipelineError, PipelineModel
from fxpar.runtime.launch import spawn


def test_auto_is_decided_by_the_request_and_the_cluster() -> None:
    assert Pipeline(stages=2).resolved_stage_mode((2, 2)) == "meshes"  # stages first
    assert Pipeline(stages=2).resolved_stage_mode((4,)) == "replicas"
    assert Pipeline(stages=2).resolved_stage_mode((4, 1)) == "replicas"  # 4 is not 2 stages
    assert Pipeline(stages=2, data_parallel=2).resolved_stage_mode((2, 2)) == "replicas"
    meshes = Pipeline(stages=2, stage_meshes=((1,), (2,)))
    assert meshes.resolved_stage_mode((3,)) == "meshes"
    assert Pipeline(stages="auto").resolved_stage_mode((2, 2)) == "replicas"
    assert Pipeline(stage_mode="meshes").resolved_stage_mode((4,)) == "meshes"
    assert Pipeline(stage_mode="replicas").resolved_stage_mode((2, 2)) == "replicas"


def test_contradictory_requests_are_refused() -> None:
    with pytest.raises(PipelineError, match="stage_mode must be one of"):
        Pipeline(stage_mode="both")  # type: ignore[arg-type]
    with pytest.raises(PipelineError, match="stage_mode='replicas' runs no intra-op plan"):
        Pipeline(stages=2, stage_meshes=((1,), (2,)), stage_mode="replicas")
    with pytest.raises(PipelineError, match="data_parallel=2 replicas do not"):
        Pipeline(stages=2, data_parallel=2, stage_mode="meshes")


def _compile(cluster: fxpar.Cluster, pipeline: Pipeline, **arguments: Any) -> Any:
    model, tokens, targets = _gpt()
    return fxpar.compile(
        model, cluster, (tokens,), gpt_loss, example_targets=(targets,), optimizer=SGD(lr=LR),
        pipeline=pipeline, **arguments,
    )  # fmt: skip


def test_planning_arguments_on_replica_stages_are_refused_not_switched() -> None:
    """A solver or manual plan never turns replicas into stage meshes: compile says how to ask
    for them."""
    with pytest.raises(FxparError, match=r"manual make the intra-op plan .*stage_mode='meshes'"):
        _compile(fxpar.Cluster((4,)), Pipeline(stages=2), manual=plans.tensor_parallel)
    replicas = Pipeline(stages=2, stage_mode="replicas")
    with pytest.raises(FxparError, match=r"solver make the intra-op plan .* replicas"):
        _compile(fxpar.Cluster((2, 2)), replicas, solver=fxpar.solvers.GreedySolver())
    with pytest.raises(FxparError, match=r"runs its stages as data-parallel replicas"):
        _compile(fxpar.Cluster((4,)), Pipeline(stages="auto"), manual=plans.data_parallel)


def _chosen(rank: int, world: int) -> list[dict[str, Any]]:
    """``Pipeline(stages=2, microbatches=4)`` on 4 ranks, as replicas and as stage meshes: what
    ran and two SGD steps."""
    torch.set_num_threads(1)
    results = []
    for mode in ("auto", "meshes"):
        _, tokens, targets = _gpt()
        pipelined = _compile(
            fxpar.Cluster((world,)), Pipeline(stages=2, microbatches=4, stage_mode=mode)
        )
        assert isinstance(pipelined, PipelineModel)
        results.append(
            {
                "data_parallel": pipelined.pipeline.data_parallel,
                "stage mesh": pipelined.stage_cluster.mesh_shape
                if pipelined.stage_cluster is not None
                else None,
                "losses": [pipelined.step(tokens, targets).item() for _ in range(2)],
                "state": pipelined.full_state_dict(),
            }
        )
    return results


@pytest.mark.slow
def test_what_the_request_leaves_open_is_chosen_and_trains_like_one_device() -> None:
    losses, state = _eager_gpt(2)
    for replicas, meshes in spawn(_chosen, 4):
        assert (replicas["data_parallel"], replicas["stage mesh"]) == (2, None)
        assert (meshes["data_parallel"], meshes["stage mesh"]) == (1, (2,))
        for result in (replicas, meshes):
            assert result["losses"] == pytest.approx(losses, rel=1e-4)
            torch.testing.assert_close(result["state"], state, rtol=1e-4, atol=1e-5)
