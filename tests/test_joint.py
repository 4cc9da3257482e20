"""``fxpar.compile(..., pipeline="auto")``: whether to pipeline is the cost model's choice.

- the rule: a pipeline runs only when estimated strictly faster than the plan alone, or when
  no plan of the whole batch fits;
- the candidates: one per micro-batch count, each the stage DP's best over schedules and
  remat, on the step captured at that count's micro-batch; a count the batch does not divide
  is kept with why; stages of data-parallel replicas, priced on the whole batch's step, are
  each count's candidate where cheaper (and run so on four gloo ranks);
- on one device the plan alone wins (a pipeline of one stage only adds micro-batches) and
  trains like eager PyTorch;
- on two gloo ranks (slow tests) the faster of the two estimates, worked out in the test from
  ``fxpar.plan`` and the stage DP, is what runs (the pipeline on fast links, the plan alone on
  slow ones), and two SGD steps equal eager PyTorch's;
- bad values are refused by name.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from typing import Any, ClassVar

import pytest
import torch
from test_pipeline_priced import LR, _eager_gpt, _gpt  # the same GPT, batch and SGD
from torch import nn

import fxpar
from fxpar import ir
from fxpar.errors import FxparError
from fxpar.joint import (
    AUTO_MICROBATCHES,
    STEP_DIFFERS,
    Candidate,
    JointChoice,
    pipeline_candidates,
    pipeline_wins,
    replica_search,
    searched_pipelines,
)
from fxpar.models import gpt_loss
from fxpar.optim import SGD
from fxpar.passes import Pass, default_passes, passes_for
from fxpar.pipeline import PassPlanner, PipelineModel, evaluate_split, search_pipelines
from fxpar.planning.problem import PlanOptions
from fxpar.runtime.launch import spawn
from fxpar.runtime.parallel import ParallelModel

# Bytes/s. On the first, a pipeline of two stages (sending activations) wins over the plan of
# the whole batch (which replicates the step rather than all-reduce its gradients there); on
# the second, where the stages' sends cost too much as well, it does not.
FAST, SLOW = 3e8, 1e6


def _joint(cluster: fxpar.Cluster) -> JointChoice:
    """The choice worked out from the public pieces: ``fxpar.plan``'s estimate of the whole
    batch, and the stage DP's candidates, stage meshes and replicas (SGD: no optimizer
    state)."""
    model, tokens, targets = _gpt()
    alone = fxpar.plan(
        copy.deepcopy(model), cluster, (tokens,), gpt_loss, example_targets=(targets,),
        options=PlanOptions(optimizer_states=0),
    )  # fmt: skip
    return JointChoice(alone.estimate, _candidates(cluster))


def _candidates(cluster: fxpar.Cluster, replicas: bool = True) -> tuple[Candidate, ...]:
    model, tokens, targets = _gpt()
    whole = fxpar.capture(copy.deepcopy(model), (tokens,), gpt_loss, example_targets=(targets,))
    return pipeline_candidates(
        model, cluster, (tokens,), gpt_loss, example_targets=(targets,),
        stage_planner=PassPlanner(passes_for(None, options=PlanOptions(optimizer_states=0))),
        optimizer_states=0, mixed_precision=None, whole=whole if replicas else None,
    )  # fmt: skip


def test_a_pipeline_runs_only_when_estimated_strictly_faster() -> None:
    assert pipeline_wins(2.0, 1.0)
    assert not pipeline_wins(1.0, 2.0)
    assert not pipeline_wins(1.0, 1.0)  # a tie: the plan alone
    assert pipeline_wins(None, 5.0)  # no plan of the whole batch fits
    assert not pipeline_wins(1.0, None)
    assert not pipeline_wins(None, None)


def test_every_count_is_priced_on_its_own_micro_batch_or_says_why_not() -> None:
    """A batch of 6 divides into 2 micro-batches, not 4 or 8: those say so; the count that
    runs is priced on a step captured at 3 rows, and the best candidate is the cheapest."""
    model, tokens, targets = _gpt(batch=6)
    candidates = pipeline_candidates(
        model, fxpar.Cluster((2,), bandwidth=(FAST,)), (tokens,), gpt_loss,
        example_targets=(targets,), stage_planner=PassPlanner(passes_for(None)),
        optimizer_states=0, mixed_precision=None,
    )  # fmt: skip
    assert [c.microbatches for c in candidates] == list(AUTO_MICROBATCHES)
    two, *others = candidates
    assert two.choice is not None and two.program is not None
    target = two.program.placeholders()[two.program.signature.step_inputs[-1]]
    assert ir.require(target, ir.ValueMeta).tensor.shape[0] == 3
    for other in others:
        assert other.choice is None and "cannot be cut into" in other.reason
        assert "no pipeline (a batch of 6 rows" in other.describe()
    joint = JointChoice(1.0, candidates)
    assert joint.best is two and joint.pipelined == (two.choice.step_time < 1.0)
    assert "chosen: " in joint.report() and "of 4 micro-batches: no pipeline" in joint.report()


def test_a_pipeline_that_would_train_another_step_is_no_candidate() -> None:
    """BatchNorm normalises each micro-batch by its own statistics: no count gets a pipeline,
    each says why, and on links where a GPT's pipeline wins the plan alone still runs."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    inputs, targets = torch.randn(16, 8), torch.randint(0, 4, (16,))
    candidates = pipeline_candidates(
        model, fxpar.Cluster((2,), bandwidth=(FAST,)), (inputs,), nn.functional.cross_entropy,
        example_targets=(targets,), stage_planner=PassPlanner(passes_for(None)),
        optimizer_states=0, mixed_precision=None,
    )  # fmt: skip
    assert [c.microbatches for c in candidates] == list(AUTO_MICROBATCHES)
    for candidate in candidates:
        assert candidate.choice is None and candidate.reason.startswith(STEP_DIFFERS)
        assert "batch" in candidate.reason.removeprefix(STEP_DIFFERS)
    assert not JointChoice(1.0, candidates).pipelined


def test_stages_of_replicas_are_priced_on_the_whole_batch_and_the_cheaper_runs() -> None:
    """On four devices each count also prices stages of data-parallel replicas: the stage DP
    without stage plans, on the whole batch's step, the best of more than one device a stage;
    its step is what ``evaluate_split`` gives that pipeline on the same step, and the count's
    choice is the cheaper of the two searches (without the whole step, no replicas)."""
    cluster = fxpar.Cluster((4,), bandwidth=(FAST,))
    model, tokens, targets = _gpt()
    whole = fxpar.capture(copy.deepcopy(model), (tokens,), gpt_loss, example_targets=(targets,))
    candidates = _candidates(cluster)
    assert all(c.replicas is None for c in _candidates(cluster, replicas=False))
    ran_replicas = False
    for candidate in candidates:
        assert candidate.replicas is not None and candidate.search is not None
        replicas, meshes = candidate.replicas.choice, candidate.search.choice
        assert replicas is not None and meshes is not None
        assert replicas.pipeline.data_parallel > 1 and replicas.stage_cluster is None
        scored = evaluate_split(whole, cluster, replicas.pipeline, optimizer_states=0)
        assert replicas.step_time == pytest.approx(scored.step_time, rel=1e-12)
        cheaper = replicas if replicas.step_time < meshes.step_time else meshes
        assert candidate.choice is cheaper
        assert candidate.runs_replicas is (cheaper is replicas)
        assert ("replicas" in candidate.describe()) is candidate.runs_replicas
        ran_replicas |= candidate.runs_replicas
    assert ran_replicas  # the cluster was picked so that replicas win somewhere


def test_replicas_of_one_device_a_stage_are_left_to_the_stage_meshes() -> None:
    """Where the replicas' best has one device a stage (slow links: no gradient to all-reduce
    beats any), it is a stage mesh of one device, which the meshes' search prices on the
    micro-batch's own step: no replica candidate."""
    cluster = fxpar.Cluster((4,), bandwidth=(SLOW,))
    model, tokens, targets = _gpt()
    whole = fxpar.capture(copy.deepcopy(model), (tokens,), gpt_loss, example_targets=(targets,))
    pipelines = searched_pipelines(4)
    best = search_pipelines(whole, cluster, pipelines, optimizer_states=0).choice
    assert best is not None and best.pipeline.data_parallel == 1  # as the test supposes
    assert replica_search(whole, cluster, pipelines, 0) is None


def test_one_device_runs_the_plan_alone_and_trains_like_eager(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """On one device every pipeline is one stage over micro-batches, estimated slower than the
    plan alone: that runs, its step is eager PyTorch's, and the log says what was weighed."""
    model, tokens, targets = _gpt()
    with caplog.at_level(logging.INFO, logger="fxpar.compiler"):
        parallel = fxpar.compile(
            model, fxpar.Cluster((1,)), (tokens,), gpt_loss, example_targets=(targets,),
            optimizer=SGD(lr=LR), pipeline="auto",
        )  # fmt: skip
    assert isinstance(parallel, ParallelModel)
    assert "pipeline='auto' weighed" in caplog.text and "chosen: the intra-op plan" in caplog.text
    losses, state = _eager_gpt(2)
    assert [parallel.step(tokens, targets).item() for _ in range(2)] == pytest.approx(losses)
    torch.testing.assert_close(parallel.full_state_dict(), state)


def test_bad_pipeline_values_are_refused() -> None:
    model, tokens, targets = _gpt()
    with pytest.raises(FxparError, match=r"pipeline must be a fxpar\.Pipeline, 'auto' or None"):
        fxpar.compile(model, fxpar.Cluster((1,)), (tokens,), gpt_loss, example_targets=(targets,),
                      pipeline="pipelined")  # type: ignore[call-overload]  # fmt: skip
    with pytest.raises(FxparError, match=r"batch='local' is for fxpar\.compile without a pipeline"):
        fxpar.compile(model, fxpar.Cluster((1,)), (tokens,), gpt_loss, example_targets=(targets,),
                      pipeline="auto", batch="local")  # fmt: skip


# ---- on gloo ranks


@dataclasses.dataclass(frozen=True)
class _CountRuns(Pass):
    """Counts its runs in :data:`_RUNS` (one list per process), changing nothing."""

    name: ClassVar[str] = "count-runs"

    def run(self, program: fxpar.Program) -> fxpar.Program:
        _RUNS.append(len(program.graph_module.graph.nodes))
        return program


_RUNS: list[int] = []


def _compiled(rank: int, world: int, bandwidth: float, counted: bool = False) -> dict[str, Any]:
    """Compiled with ``pipeline="auto"`` on ``world`` ranks, its estimate, two SGD steps' losses
    and the state after them. ``counted``: with a pass list holding :class:`_CountRuns`."""
    torch.set_num_threads(1)
    model, tokens, targets = _gpt()
    passes = None
    if counted:
        passes = default_passes(options=PlanOptions(optimizer_states=0))
        passes = passes.insert_before("choose-strategies", _CountRuns())
    trained = fxpar.compile(
        model, fxpar.Cluster((world,), bandwidth=(bandwidth,)), (tokens,), gpt_loss,
        example_targets=(targets,), optimizer=SGD(lr=LR), pipeline="auto", passes=passes,
    )  # fmt: skip
    estimate = (
        trained.stage_choice.step_time
        if isinstance(trained, PipelineModel) and trained.stage_choice is not None
        else trained.plan.estimate  # type: ignore[union-attr]
    )
    return {
        "pipelined": isinstance(trained, PipelineModel),
        "pipeline": trained.pipeline if isinstance(trained, PipelineModel) else None,
        "estimate": estimate,
        "losses": [trained.step(tokens, targets).item() for _ in range(2)],
        "state": trained.full_state_dict(),
        "runs_replicas": isinstance(trained, PipelineModel)
        and trained.pipeline_plan is not None
        and trained.pipeline_plan.stage_mode == "replicas",
        "pass_runs": len(_RUNS),
    }


@pytest.mark.slow
@pytest.mark.parametrize(("bandwidth", "pipelined"), [(FAST, True), (SLOW, False)])
def test_gloo_runs_the_faster_estimate_and_trains_like_one_device(
    bandwidth: float, pipelined: bool
) -> None:
    cluster = fxpar.Cluster((2,), bandwidth=(bandwidth,))
    joint = _joint(cluster)
    assert joint.pipelined is pipelined  # the clusters were picked to fall either way
    best = joint.best
    assert best is not None and best.choice is not None
    expected = best.choice.step_time if pipelined else joint.alone
    ranks = spawn(_compiled, 2, bandwidth)
    losses, state = _eager_gpt(2)
    for result in ranks:
        assert result["pipelined"] is pipelined
        assert result["estimate"] == pytest.approx(expected)
        assert result["losses"] == pytest.approx(losses, rel=1e-4)
        torch.testing.assert_close(result["state"], state, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_stages_of_replicas_chosen_on_four_ranks_train_like_one_device() -> None:
    """Where stages of data-parallel replicas are the cheapest estimate, ``pipeline="auto"``
    runs them as priced (the replicas' pipeline, no plan inside a stage), and two SGD steps
    equal eager PyTorch's."""
    joint = _joint(fxpar.Cluster((4,), bandwidth=(FAST,)))
    best = joint.best
    assert joint.pipelined and best is not None and best.runs_replicas  # the cluster's pick
    assert best.choice is not None
    ranks = spawn(_compiled, 4, FAST)
    losses, state = _eager_gpt(2)
    for result in ranks:
        assert result["pipeline"] == best.choice.pipeline
        assert result["estimate"] == pytest.approx(best.choice.step_time)
        assert result["losses"] == pytest.approx(losses, rel=1e-4)
        torch.testing.assert_close(result["state"], state, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_a_users_passes_run_on_what_pipeline_auto_runs() -> None:
    """Where stages of data-parallel replicas are the cheapest estimate, a user's pass list
    keeps them out of ``pipeline="auto"``'s choice (a replica runs its stage whole, and the
    passes would never run on it): the choice is the cheapest of the rest, the user's pass ran
    on this rank, and the step trains like eager PyTorch."""
    cluster = fxpar.Cluster((4,), bandwidth=(FAST,))
    assert _joint(cluster).best.runs_replicas  # type: ignore[union-attr]  # without passes=
    rest = JointChoice(_joint(cluster).alone, _candidates(cluster, replicas=False))
    ranks = spawn(_compiled, 4, FAST, True)
    losses, state = _eager_gpt(2)
    for result in ranks:
        assert not result["runs_replicas"]
        assert result["pipelined"] is rest.pipelined
        assert result["pass_runs"] >= 1
        assert result["losses"] == pytest.approx(losses, rel=1e-4)
        torch.testing.assert_close(result["state"], state, rtol=1e-4, atol=1e-5)
