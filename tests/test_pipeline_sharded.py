"""Pipeline stages running an intra-op plan on a stage mesh, in one process (every device of a
stage in a thread, :func:`fxpar.testing.pipeline.simulate_pipeline`):

- the property: for random small models, random plans on 1-D and 2-D stage meshes, random
  split points, both remat settings and 1-2 micro-batches, the lowered stages compute the
  single-device step (loss, gradients, buffer updates);
- gradients of a data-parallel stage are converted once per step, not per micro-batch;
- mistakes raise clear errors.

The multi-process runtime (2 stages x 2-way tensor parallel on gloo) is in
test_pipeline_gloo.py.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import pytest
import torch
from conftest import (
    assert_same_step,
    draw_split_points,
    eager_step,
    microbatch_program,
    train_beside_sgd,
)
from hypothesis import given, settings
from hypothesis import strategies as st

import fxpar
from fxpar import ir, plans
from fxpar.cluster import Cluster
from fxpar.errors import FxparError
from fxpar.ir.program import named_state
from fxpar.models import GPT, GPTConfig, gpt_loss
from fxpar.optim import SGD, AdamW
from fxpar.pipeline import Pipeline, PipelineError, PipelineModel, partition, split_program
from fxpar.pipeline.intra_op import shard_stage, stage_devices
from fxpar.runtime.communicators import OneDeviceCommunicator
from fxpar.testing import ModelCase
from fxpar.testing import strategies as fst
from fxpar.testing.pipeline import simulate_pipeline

CONFIG = GPTConfig(n_layer=2, n_embd=16, n_head=2, vocab_size=32, block_size=8)
STAGE_MESHES = ((1,), (2,), (1, 2), (2, 2))


@settings(max_examples=40, deadline=None)
@given(
    case=fst.models(),
    cluster=st.sampled_from([Cluster(mesh) for mesh in STAGE_MESHES]),
    seed=fst.plan_seeds(),
    microbatches=st.sampled_from((1, 2)),
    remat=st.booleans(),
    data=st.data(),
)
def test_random_plans_inside_stages_train_like_one_device(
    case: ModelCase,
    cluster: Cluster,
    seed: int,
    microbatches: int,
    remat: bool,
    data: st.DataObject,
) -> None:
    points = draw_split_points(data, case.model, 1, 3)
    chunks, program = microbatch_program(case, microbatches)
    planned = plans.random_plan(program, cluster, seed)
    split = split_program(planned, partition(planned, points), remat=remat)
    state = named_state(case.model)
    torch.manual_seed(seed)  # both draw the random inputs (dropout) from this state
    expected = split.run_microbatches(state, chunks)
    torch.manual_seed(seed)
    result = simulate_pipeline(split, cluster, state, chunks)
    assert_same_step(result, expected)


@functools.cache
def _gpt() -> tuple[GPT, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = GPT(CONFIG)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, CONFIG.vocab_size, (4, 8), generator=generator)
    targets = torch.randint(0, CONFIG.vocab_size, (4, 8), generator=generator)
    return model, tokens, targets


@pytest.mark.parametrize("plan", ["tensor_parallel", "data_parallel", "fully_sharded"])
def test_manual_plans_inside_stages_equal_the_unsharded_pipeline(plan: str) -> None:
    """GPT (tied embedding: its partial gradients from the first and last stage are summed
    after each is converted) under each manual plan on 2 devices per stage."""
    model, tokens, targets = _gpt()
    program = fxpar.capture(model, (tokens[:2],), gpt_loss, example_targets=(targets[:2],))
    cluster = Cluster((2,))
    planned = getattr(plans, plan)(program, cluster)
    split = split_program(planned, partition(planned, ("blocks.1",)), remat=False)
    chunks = [[tokens[:2], targets[:2]], [tokens[2:], targets[2:]]]
    expected = split.run_microbatches(named_state(model), chunks)
    result = simulate_pipeline(split, cluster, named_state(model), chunks)
    torch.testing.assert_close(result.loss, expected.loss)
    for name, gradient in expected.gradients.items():
        torch.testing.assert_close(result.gradients[name], gradient, msg=name)


def test_data_parallel_stage_reduces_gradients_once_per_step() -> None:
    """Under a data-parallel plan the backward units leave every gradient as per-device
    addends (no collective on the way out, and none but scalars inside: the loss's token
    count arrives whole, as an input), and the stage's gradient sync all-reduces them: once
    per step however many micro-batches there are, in one bucket of all their bytes."""
    model, tokens, targets = _gpt()
    program = fxpar.capture(model, (tokens[:2],), gpt_loss, example_targets=(targets[:2],))
    cluster = Cluster((2,))
    planned = plans.data_parallel(program, cluster)
    split = split_program(planned, partition(planned, ("blocks.1",)), remat=False)
    for stage in range(2):
        sharded = shard_stage(split, stage, cluster, (0,), OneDeviceCommunicator())
        leaving = [r for r in sharded.backward_collectives if r.phase is ir.Phase.OUTPUT]
        assert leaving == []
        assert all(r.bytes <= 8 for r in sharded.backward_collectives)
        (bucket,) = sharded.sync.records
        assert bucket.kind == "all_reduce"
        placeholders = split.program.placeholders()
        assert bucket.bytes == sum(
            ir.evaluate(ir.require(placeholders[name], ir.ValueMeta).tensor.nbytes)
            for name in sharded.backward.gradients
        )
        assert set(sharded.sync.gradients) == set(sharded.backward.gradients)


def test_boundary_values_have_local_shapes() -> None:
    """What crosses a stage boundary is allocated at this device's size: under a
    data-parallel plan, half the micro-batch's rows."""
    model, tokens, targets = _gpt()
    program = fxpar.capture(model, (tokens[:2],), gpt_loss, example_targets=(targets[:2],))
    planned = plans.data_parallel(program, Cluster((2,)))
    split = split_program(planned, partition(planned, ("blocks.1",)), remat=False)
    sharded = shard_stage(split, 1, Cluster((2,)), (1,), OneDeviceCommunicator())
    whole = {v.name: v.meta.shape for v in split.forward[1].received}
    for value in sharded.forward.received:
        assert value.meta.shape[0] * 2 == whole[value.name][0]


def test_errors_say_what_to_change() -> None:
    model, tokens, targets = _gpt()
    with pytest.raises(PipelineError, match=r"mesh of \(2, \*stage_mesh\)"):
        stage_devices(Cluster((4,)), 2)
    with pytest.raises(PipelineError, match="choose one"):
        PipelineModel(
            model, Pipeline(stages=2, data_parallel=2), (tokens,), gpt_loss,
            example_targets=(targets,), stage_cluster=Cluster((2,)),
        )  # fmt: skip
    with pytest.raises(FxparError, match=r"mesh of \(2, \*stage_mesh\)"):
        fxpar.compile(
            model, Cluster((2,)), (tokens,), gpt_loss, example_targets=(targets,),
            pipeline=Pipeline(stages=2), manual=plans.tensor_parallel,
        )  # fmt: skip
    program = fxpar.capture(model, (tokens[:2],), gpt_loss, example_targets=(targets[:2],))
    split = split_program(program, partition(program, ("blocks.1",)), remat=False)
    with pytest.raises(PipelineError, match="no plan for the stage mesh"):
        shard_stage(split, 0, Cluster((2,)), (0,), OneDeviceCommunicator())


def test_stage_mesh_keeps_the_links_of_its_axes() -> None:
    cluster = Cluster.preset("h100", (2, 8))
    stage = stage_devices(cluster, 2)
    assert stage.mesh_shape == (8,)
    assert stage.bandwidth == (cluster.bandwidth[1],)
    assert stage.axis_names == (cluster.axis_names[1],)
    assert stage.memory == 2 * cluster.memory  # the plan covers both stages' weights


def test_one_device_stage_mesh_trains_like_pytorch() -> None:
    """fxpar.compile on a (1, 1) mesh: one stage, a one-device stage mesh planned by the ILP,
    no process group; two SGD steps equal plain PyTorch's on the whole batch."""
    model, tokens, targets = _gpt()
    pipelined = fxpar.compile(
        copy.deepcopy(model), Cluster((1, 1)), (tokens,), gpt_loss,
        example_targets=(targets,), optimizer=SGD(lr=0.5),
        pipeline=Pipeline(stages=1, microbatches=2),
    )  # fmt: skip
    assert pipelined.plan is not None and pipelined.plan.solution.solver == "ilp"
    reference = train_beside_sgd(pipelined, model, tokens, targets, lr=0.5)
    state = pipelined.full_state_dict()
    torch.testing.assert_close(state, reference.state_dict())


def test_auto_stages_with_a_solver_plan_the_stage_mesh() -> None:
    """stages="auto" with a solver: the stage DP prices stages under intra-op plans and the
    chosen pipeline runs them (one device here; the choice records its stage mesh)."""
    model, tokens, targets = _gpt()
    pipelined = fxpar.compile(
        copy.deepcopy(model), Cluster((1,)), (tokens,), gpt_loss,
        example_targets=(targets,), optimizer=SGD(lr=0.5),
        pipeline=Pipeline(stages="auto", microbatches=2, stage_mode="meshes"),
        manual=plans.tensor_parallel,
    )  # fmt: skip
    choice = pipelined.stage_choice
    assert choice is not None and choice.stage_cluster is not None
    assert choice.stage_cluster.mesh_shape == (1,)
    assert "intra-op plan" in choice.report()
    reference = copy.deepcopy(model)
    expected, _ = eager_step(reference, (tokens,), gpt_loss, (targets,))
    torch.testing.assert_close(pipelined.step(tokens, targets), expected)


def test_checkpoint_moves_between_pipeline_and_parallel_model(tmp_path: Path) -> None:
    """One device, no process group: a pipeline's checkpoint (weights and AdamW state) resumes
    training in a ParallelModel, and a ParallelModel's in a pipeline, exactly where the
    uninterrupted run goes."""
    model, tokens, targets = _gpt()

    def pipeline() -> PipelineModel:
        return fxpar.compile(
            copy.deepcopy(model), Cluster((1, 1)), (tokens,), gpt_loss,
            example_targets=(targets,), optimizer=AdamW(lr=1e-2),
            pipeline=Pipeline(stages=1, microbatches=2), manual=plans.data_parallel,
        )  # fmt: skip

    def parallel() -> fxpar.ParallelModel:
        return fxpar.compile(
            copy.deepcopy(model), Cluster((1,)), (tokens,), gpt_loss,
            example_targets=(targets,), optimizer=AdamW(lr=1e-2), manual=plans.data_parallel,
        )  # fmt: skip

    for first, second in ((pipeline, parallel), (parallel, pipeline)):
        trained = first()
        trained.step(tokens, targets)
        trained.save(tmp_path / first.__name__)
        expected = trained.step(tokens, targets)
        resumed = second()
        resumed.load(tmp_path / first.__name__)
        assert resumed.steps == 1
        torch.testing.assert_close(resumed.step(tokens, targets), expected)
        torch.testing.assert_close(resumed.full_state_dict(), trained.full_state_dict())
