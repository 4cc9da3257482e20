"""``PipelinePlan``: a chosen pipeline as plain data, saved, read back, checked and run.

- a plan of stage meshes (with their intra-op plans) and a plan of replicas survive a save and
  a load field for field, the stage plans as the plan files ``Plan.save`` writes;
- a hand-edited file that cannot run is refused on loading, naming the field (format, version,
  unknown or missing fields, ranks, meshes, schedule, split points, plans for other meshes);
- ``fxpar.compile(..., plan=)`` refuses a plan that does not fit the model or cluster (another
  world size, ranks the runtime does not give, a split point that is no module, a stage plan
  whose strategies the step cannot take) and arguments that would choose again;
- (slow) ``fxpar plan --microbatches 8 --save-pipeline p.json``, then ``fxpar.compile(...,
  plan="p.json")`` on 4 gloo ranks trains like one device, and so does a saved plan of stage
  meshes chosen by the stage DP.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from test_pipeline_priced import LR, _eager_gpt, _gpt  # the same GPT, batch and SGD

import fxpar
from fxpar.cli import main
from fxpar.errors import FxparError
from fxpar.models import gpt_loss
from fxpar.optim import SGD
from fxpar.passes import for_compile, passes_for
from fxpar.pipeline import (
    PassPlanner,
    Pipeline,
    PipelineModel,
    PipelinePlan,
    PipelinePlanError,
    PipelineStage,
    SavedPlan,
    capture_microbatch,
    evaluate_split,
)
from fxpar.planning.plan import Plan
from fxpar.planning.plan_file import plan_document
from fxpar.planning.problem import PlanOptions
from fxpar.runtime.launch import spawn

MICROBATCHES = 4


def cli_target() -> tuple[torch.nn.Module, tuple[torch.Tensor], Any, tuple[torch.Tensor]]:
    """A ``module:attr`` target for ``fxpar plan``: test_pipeline_priced's GPT and batch."""
    model, tokens, targets = _gpt()
    return model, (tokens,), gpt_loss, (targets,)


def _meshes_plan(cluster: fxpar.Cluster) -> PipelinePlan:
    """Two stages on meshes of two devices for the GPT on ``cluster``, each mesh's plan made
    and priced by the stage DP's costs (:func:`~fxpar.pipeline.evaluate_split`)."""
    model, tokens, targets = _gpt()
    pipeline = Pipeline(stages=("blocks.1",), microbatches=MICROBATCHES)
    program = capture_microbatch(model, pipeline, (tokens,), gpt_loss, example_targets=(targets,))
    planner = PassPlanner(for_compile(passes_for(None, options=PlanOptions(optimizer_states=0))))
    choice = evaluate_split(
        program, cluster, pipeline, optimizer_states=0, stage_planner=planner, microbatch=True
    )
    return PipelinePlan.from_choice(choice, cluster)


def _replicas_plan() -> PipelinePlan:
    return PipelinePlan(
        split_points=("blocks.1",),
        schedule="1f1b",
        microbatches=MICROBATCHES,
        remat=False,
        virtual_stages=1,
        stage_mode="replicas",
        stages=(PipelineStage((0, 1), (2,)), PipelineStage((2, 3), (2,))),
    )


@pytest.fixture(scope="module")
def meshes_plan() -> PipelinePlan:
    return _meshes_plan(fxpar.Cluster((4,), bandwidth=(1e10,)))


def test_a_plan_of_stage_meshes_survives_save_and_load(
    meshes_plan: PipelinePlan, tmp_path: Path
) -> None:
    chosen = meshes_plan
    assert chosen.stage_mode == "meshes" and chosen.estimate is not None and chosen.estimate > 0
    assert all(isinstance(plan, Plan) for plan in chosen.plans.values())
    loaded = PipelinePlan.load(chosen.save(tmp_path / "p.json"))
    assert loaded == chosen  # every field but the plans, which compare by their documents
    assert set(loaded.plans) == set(chosen.plans)
    for shape, plan in chosen.plans.items():
        saved = loaded.plans[shape]
        assert isinstance(saved, SavedPlan) and isinstance(plan, Plan)
        assert json.loads(json.dumps(plan_document(plan))) == saved.document
    reread = {**loaded.to_dict(), "report": None}
    assert reread == {**json.loads(json.dumps(chosen.to_dict())), "report": None}
    assert [stage.mesh for stage in chosen.stages] == [(2,), (2,)]
    assert loaded.pipeline == chosen.pipeline
    assert "pipeline plan: " in chosen.report() and "plan on stage mesh" in chosen.report()


def test_a_plan_of_replicas_survives_save_and_load(tmp_path: Path) -> None:
    chosen = _replicas_plan()
    loaded = PipelinePlan.load(chosen.save(tmp_path / "p.json"))
    assert loaded == chosen and loaded.plans == {} and loaded.plan_of(1) is None
    assert loaded.pipeline == Pipeline(
        stages=("blocks.1",), microbatches=4, data_parallel=2, stage_mode="replicas"
    )
    assert "data-parallel replicas in each stage; not priced" in loaded.report()


def _edited(tmp_path: Path, document: dict[str, Any], **changes: Any) -> Path:
    edited = {**copy.deepcopy(document), **changes}
    for name in [name for name, value in changes.items() if value is _DROP]:
        del edited[name]
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(edited))
    return path


_DROP = object()


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"format": "fxpar-plan"}, 'no "format": "fxpar-pipeline-plan"'),
        ({"version": 7}, "format version 7"),
        ({"colour": "blue"}, "unknown field 'colour'"),
        ({"schedule": _DROP}, "the field 'schedule' is missing"),
        ({"schedule": "zigzag"}, "schedule 'zigzag' is not a schedule fxpar runs"),
        ({"microbatches": 0}, "microbatches must be a whole number >= 1"),
        ({"remat": "yes"}, "remat must be true or false"),
        ({"stage_mode": "both"}, "stage_mode must be 'meshes' or 'replicas'"),
        ({"split_points": "blocks.1"}, "split_points must be a list of module names"),
        ({"split_points": []}, "0 split_points make 1 model chunks, but 2 stages"),
        ({"world_size": 8}, "world_size is 8, but the stages hold 4 ranks"),
        (
            {"stages": [{"ranks": [0, 1, 2], "mesh": [2]}, {"ranks": [3], "mesh": [2]}]},
            "stages[0]: 3 ranks [0, 1, 2] for a mesh [2] of 2 devices",
        ),
        (
            {"stages": [{"ranks": [0, 1], "mesh": [2]}, {"ranks": [1, 2], "mesh": [2]}]},
            "do not take each of ranks 0 .. 3 once",
        ),
        (
            {"stages": [{"ranks": [0, 1], "mesh": [2]}, {"ranks": [2, 3], "mesh": [1, 2]}]},
            "stage_mode 'replicas' gives every stage the same number of replicas",
        ),
        ({"estimate": "fast"}, "estimate must be null or seconds"),
    ],
)
def test_an_invalid_replicas_file_is_refused_naming_the_field(
    tmp_path: Path, changes: dict[str, Any], message: str
) -> None:
    document = _replicas_plan().to_dict()
    with pytest.raises(PipelinePlanError, match=r"the pipeline plan file .*edited\.json") as error:
        PipelinePlan.load(_edited(tmp_path, document, **changes))
    assert message in str(error.value)


def test_an_invalid_meshes_file_is_refused_naming_the_field(
    meshes_plan: PipelinePlan, tmp_path: Path
) -> None:
    document = meshes_plan.to_dict()
    shape = list(meshes_plan.mesh_shapes[0])
    wrong = [*shape, 1]
    entry = document["plans"][0]
    cases: list[tuple[dict[str, Any], str]] = [
        ({"plans": []}, f"no plan for stage mesh {shape}"),
        ({"plans": [{**entry, "mesh": wrong}]}, f"a plan for stage mesh {wrong}, which no stage"),
        (
            {"plans": [{**entry, "plan": {**entry["plan"], "cluster": {"mesh_shape": wrong}}}]},
            f"the plan under stage mesh {shape} was made for a mesh {wrong}",
        ),
        ({"plans": [{**entry, "plan": {"format": "x"}}]}, "plan must be a plan file's document"),
        ({"plans": [entry, entry]}, f"a second plan for stage mesh {shape}"),
        ({"stage_mode": "replicas"}, "stage_mode 'replicas' runs no intra-op plan"),
    ]
    for changes, message in cases:
        with pytest.raises(PipelinePlanError) as error:
            PipelinePlan.load(_edited(tmp_path, document, **changes))
        assert message in str(error.value), changes


def _compile(chosen: PipelinePlan | str | Path, world: int = 4, **arguments: Any) -> Any:
    model, tokens, targets = _gpt()
    return fxpar.compile(
        model, fxpar.Cluster((world,)), (tokens,), gpt_loss, example_targets=(targets,),
        optimizer=SGD(lr=LR), plan=chosen, **arguments,
    )  # fmt: skip


def test_compile_refuses_a_plan_that_does_not_fit_the_cluster_or_model(
    meshes_plan: PipelinePlan, tmp_path: Path
) -> None:
    with pytest.raises(PipelinePlanError, match=r"hold 4 ranks, but the cluster .* has 8"):
        _compile(_replicas_plan(), world=8)
    swapped = PipelinePlan(
        **{
            **_replicas_plan().__dict__,
            "stages": (PipelineStage((2, 3), (2,)), PipelineStage((0, 1), (2,))),
        }
    )
    with pytest.raises(PipelinePlanError, match=r"stages\[0\] runs on ranks \[2, 3\], but the"):
        _compile(swapped)
    elsewhere = PipelinePlan(**{**_replicas_plan().__dict__, "split_points": ("blocks.9",)})
    with pytest.raises(PipelinePlanError, match=r"split_points \['blocks.9'\]: .*blocks.9"):
        _compile(elsewhere)
    # A stage plan that lost a node's strategy: the step cannot take it.
    document = meshes_plan.to_dict()
    strategies = document["plans"][0]["plan"]["strategies"]
    del strategies[next(iter(strategies))]
    path = tmp_path / "lost.json"
    path.write_text(json.dumps(document))
    with pytest.raises(PipelinePlanError, match=r"does not fit this model's step: .*no strategy"):
        _compile(path)
    with pytest.raises(FxparError, match="plan= is the choice to run, so solver, pipeline"):
        _compile(_replicas_plan(), solver=object(), pipeline="auto")
    other = tmp_path / "other.json"
    other.write_text("{}")
    with pytest.raises(FxparError, match="neither a pipeline plan file"):
        _compile(other)


# ---- on gloo ranks


def _trained(rank: int, world: int, files: list[str]) -> list[dict[str, Any]]:
    """Each of ``files`` compiled with ``plan=`` on these ranks, two SGD steps' losses and the
    state after them."""
    torch.set_num_threads(1)
    results = []
    for path in files:
        model, tokens, targets = _gpt()
        trained = fxpar.compile(
            model, fxpar.Cluster((world,)), (tokens,), gpt_loss, example_targets=(targets,),
            optimizer=SGD(lr=LR), plan=path,
        )  # fmt: skip
        assert isinstance(trained, PipelineModel) and trained.pipeline_plan is not None
        results.append(
            {
                "pipeline": trained.pipeline,
                "plan": trained.pipeline_plan,
                "losses": [trained.step(tokens, targets).item() for _ in range(2)],
                "state": trained.full_state_dict(),
            }
        )
    return results


@pytest.mark.slow
def test_the_cli_s_saved_pipeline_and_a_saved_mesh_plan_train_like_one_device(
    meshes_plan: PipelinePlan, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = tmp_path / "p.json"
    argv = ["plan", "--model", "test_pipeline_plan:cli_target", "--mesh", "4", "--cluster", "cpu"]
    assert main([*argv, "--microbatches", "8", "--save-pipeline", str(saved)]) == 0
    assert f"pipeline plan written to {saved}" in capsys.readouterr().out
    from_cli = PipelinePlan.load(saved)
    assert from_cli.microbatches == 8 and from_cli.world_size == 4
    meshes_file = meshes_plan.save(tmp_path / "meshes.json")
    ranks = spawn(_trained, 4, [str(saved), str(meshes_file)])
    losses, state = _eager_gpt(2)
    for results in ranks:
        for result, chosen in zip(results, (from_cli, meshes_plan), strict=True):
            assert result["plan"] == chosen and result["pipeline"] == chosen.pipeline
            assert result["losses"] == pytest.approx(losses, rel=1e-4)
            torch.testing.assert_close(result["state"], state, rtol=1e-4, atol=1e-5)


def test_compile_runs_an_intra_op_plan_file_as_load_plan_applies_it(tmp_path: Path) -> None:
    """``plan=`` names an intra-op plan file too: compile runs its choice, unsolved."""
    model, tokens, targets = _gpt(4)
    cluster = fxpar.Cluster((1,))
    chosen = fxpar.plan(model, cluster, (tokens,), gpt_loss, example_targets=(targets,))
    path = chosen.save(tmp_path / "plan.json")
    trained = fxpar.compile(
        model, cluster, (tokens,), gpt_loss, example_targets=(targets,), plan=path
    )
    assert "(loaded)" in trained.plan.solution.solver
    assert plan_document(trained.plan)["strategies"] == plan_document(chosen)["strategies"]


@pytest.mark.parametrize("stage_mode", ["replicas", "meshes"])
def test_a_pipeline_the_stage_dp_chose_runs_again_from_its_saved_plan(
    stage_mode: str, tmp_path: Path
) -> None:
    """One device: compile's choice (``stages="auto"``) is kept as a PipelinePlan, and
    ``plan=`` its saved file runs that pipeline again, training alike."""
    pipeline = Pipeline(stages="auto", microbatches=2, stage_mode=stage_mode)  # type: ignore[arg-type]
    model, tokens, targets = _gpt(8)
    common: dict[str, Any] = {"example_targets": (targets,)}
    chose = fxpar.compile(
        copy.deepcopy(model), fxpar.Cluster((1,)), (tokens,), gpt_loss,
        optimizer=SGD(lr=LR), pipeline=pipeline, **common,
    )  # fmt: skip
    chosen = chose.pipeline_plan
    assert chosen is not None and chosen.stage_mode == stage_mode
    assert chosen.estimate == chose.stage_choice.step_time  # type: ignore[union-attr]
    again = fxpar.compile(
        copy.deepcopy(model), fxpar.Cluster((1,)), (tokens,), gpt_loss,
        optimizer=SGD(lr=LR), plan=chosen.save(tmp_path / "p.json"), **common,
    )  # fmt: skip
    assert again.pipeline == chosen.pipeline
    for _ in range(2):
        torch.testing.assert_close(again.step(tokens, targets), chose.step(tokens, targets))
