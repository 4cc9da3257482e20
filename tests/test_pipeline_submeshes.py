"""Pipeline stages on meshes of different shapes (``Pipeline(stage_meshes=...)``).

- the messages of :func:`fxpar.pipeline.crossings.transfers` give every receiving device exactly
  its piece, for random meshes, shapes and layouts on both sides (hypothesis), and each piece of
  a value crosses once per receiving replica group, not once per device;
- the property: random models cut at random points into 2-3 stages on random meshes, each
  mesh shape under its own random plan, compute the single-device step (every device in a
  thread, :func:`fxpar.testing.pipeline.simulate_stage_meshes`);
- :func:`~fxpar.pipeline.crossings.crossing` keeps a value as computed between identical sides,
  reduces ``Partial`` values before they leave, and spreads a large value over the replicas
  of the receiving stage (Alpa's local all-gather);
- on 3 gloo ranks, 2-stage pipelines on meshes ``(1,)`` and ``(2,)`` (Megatron tensor
  parallelism, data parallelism, GPipe with remat, 1F1B) train exactly like one device, tied
  embedding included; eval-mode losses and the forward's outputs equal eager PyTorch's; and a
  checkpoint written by one such pipeline resumes in one of the other shapes;
- mistakes raise clear errors.
"""

from __future__ import annotations

import math
from typing import Any
from unittest import mock

import pytest
import torch
from conftest import assert_same_step, draw_split_points, microbatch_program
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Partial, Replicate, Shard

import fxpar
from fxpar import plans
from fxpar.cluster import Cluster
from fxpar.errors import FxparError, LoweringError
from fxpar.ir.program import named_state
from fxpar.lowering import value_spec
from fxpar.models import GPT, GPTConfig, gpt_loss
from fxpar.optim import SGD, AdamW
from fxpar.pipeline import Pipeline, PipelineError, PipelineModel, partition, split_program
from fxpar.pipeline.crossings import StageSide, crossing, transfers
from fxpar.pipeline.intra_op import stage_devices
from fxpar.pipeline.meshes import coordinates, meshes_of, stage_meshes
from fxpar.runtime.launch import spawn
from fxpar.sharding import all_specs, shard_tensor
from fxpar.testing import ModelCase
from fxpar.testing import strategies as fst
from fxpar.testing.pipeline import simulate_stage_meshes

MESHES = [(1,), (2,), (3,), (4,), (2, 2), (1, 2), (2, 1)]


@st.composite
def _layouts(draw: st.DrawFn) -> tuple[tuple[int, ...], Any, Any, Any, Any]:
    """A shape whose dims divide by 12, and a layout of it on each of two random meshes."""
    rank = draw(st.integers(0, 3))
    shape = tuple(draw(st.sampled_from([12, 24])) for _ in range(rank))
    send_mesh, receive_mesh = draw(st.sampled_from(MESHES)), draw(st.sampled_from(MESHES))
    send_spec = draw(st.sampled_from(all_specs(shape, send_mesh)))
    receive_spec = draw(st.sampled_from(all_specs(shape, receive_mesh)))
    return shape, send_mesh, send_spec, receive_mesh, receive_spec


@settings(max_examples=200, deadline=None)
@given(layouts=_layouts())
def test_transfers_give_every_device_exactly_its_piece(layouts: Any) -> None:
    shape, send_mesh, send_spec, receive_mesh, receive_spec = layouts
    whole = torch.randn(shape)
    senders = coordinates(send_mesh)
    receivers = coordinates(receive_mesh)
    send_ranks = list(range(len(senders)))
    receive_ranks = [100 + index for index in range(len(receivers))]
    held = {
        r: shard_tensor(whole, send_spec, send_mesh, c)
        for r, c in zip(send_ranks, senders, strict=True)
    }
    messages = transfers(
        shape, send_mesh, send_ranks, send_spec, receive_mesh, receive_ranks, receive_spec
    )
    for rank, coordinate in zip(receive_ranks, receivers, strict=True):
        wanted = shard_tensor(whole, receive_spec, receive_mesh, coordinate)
        got = torch.full_like(wanted, float("nan"))
        filled = torch.zeros_like(wanted, dtype=torch.int32)
        for message in messages:
            if message.target == rank:
                got[message.target_box] = held[message.source][message.source_box]
                filled[message.target_box] += 1
        torch.testing.assert_close(got, wanted)
        assert bool((filled == 1).all()), "every element arrives exactly once"
    # One message per sender and receiver at most.
    pairs = [(m.source, m.target) for m in messages]
    assert len(pairs) == len(set(pairs))


@settings(max_examples=30, deadline=None)
@given(
    case=fst.models(),
    meshes=st.lists(st.sampled_from([(1,), (2,), (1, 2), (2, 2), (3,)]), min_size=2, max_size=3),
    seed=fst.plan_seeds(),
    microbatches=st.sampled_from((1, 2)),
    remat=st.booleans(),
    gather=st.booleans(),
    data=st.data(),
)
def test_random_plans_on_different_stage_meshes_train_like_one_device(
    case: ModelCase,
    meshes: list[tuple[int, ...]],
    seed: int,
    microbatches: int,
    remat: bool,
    gather: bool,
    data: st.DataObject,
) -> None:
    """The property: random models cut at random points into stages on random meshes, each
    mesh shape under its own random plan (Partial values, shards of any dim), with or without
    the local all-gather, compute the single-device step (every device of every stage in
    threads, values moved between them by the runtime's messages)."""
    points = draw_split_points(data, case.model, len(meshes) - 1, len(meshes) - 1)
    chunks, program = microbatch_program(case, microbatches)
    splits = {}
    for index, shape in enumerate(dict.fromkeys(meshes)):
        planned = plans.random_plan(program.copy(), Cluster(shape), seed + index)
        splits[shape] = split_program(planned, partition(planned, points), remat=remat)
    state = named_state(case.model)
    torch.manual_seed(seed)  # both draw the random inputs (dropout) from this state
    expected = splits[meshes[0]].run_microbatches(state, chunks)
    torch.manual_seed(seed)
    # The runtime's program copies (fxpar/runtime/fastcall.py) from the first call, boxed.
    gather_bytes = 0 if gather else 1 << 40
    with (
        mock.patch("fxpar.pipeline.crossings.LOCAL_ALLGATHER_BYTES", gather_bytes),
        mock.patch("fxpar.runtime.fastcall.COPY_AFTER_CALLS", 0),
    ):
        result = simulate_stage_meshes(
            [splits[shape] for shape in meshes], [Cluster(shape) for shape in meshes], state,
            chunks,
        )  # fmt: skip
    assert_same_step(result, expected)


def _side(mesh: tuple[int, ...], first_rank: int, spec: Any) -> StageSide:
    ranks = tuple(range(first_rank, first_rank + math.prod(mesh)))
    return StageSide(mesh, ranks, lambda name: spec)


def test_identical_sides_exchange_pieces_as_computed() -> None:
    """Same mesh, same layout: device c sends its piece, Partial addends included, to device
    c, whole."""
    spec = (Partial(), Shard(1))
    found = crossing((8, 8), 4, "x", _side((2, 2), 0, spec), _side((2, 2), 4, spec))
    assert found.send_spec == found.receive_spec == spec
    assert [(t.source, t.target) for t in found.transfers] == [(r, r + 4) for r in range(4)]
    assert all(t.source_box == (slice(0, 8), slice(0, 4)) for t in found.transfers)


def test_partial_values_are_reduced_before_they_leave() -> None:
    found = crossing((8, 8), 4, "x", _side((2,), 0, (Partial(),)), _side((1,), 2, (Partial(),)))
    assert found.send_spec == (Replicate(),)
    assert found.receive_spec == (Replicate(),)
    assert [(t.source, t.target) for t in found.transfers] == [(0, 2)]


def test_large_values_reach_replicas_in_pieces_they_all_gather() -> None:
    """Alpa's local all-gather: a value replicated over the 4 receiving devices crosses the
    link once, a quarter to each, when it is large; a small one reaches each device whole."""
    sender, receiver = _side((1,), 0, (Replicate(),)), _side((4,), 1, (Replicate(),))
    large = crossing((8, 64), 4, "x", sender, receiver, gather_bytes=1024)
    assert large.receive_spec == (Shard(0),)
    moved = sum(math.prod(s.stop - s.start for s in t.source_box) for t in large.transfers)
    assert moved == 8 * 64
    small = crossing((8, 64), 4, "x", sender, receiver, gather_bytes=1 << 30)
    assert small.receive_spec == (Replicate(),)
    moved = sum(math.prod(s.stop - s.start for s in t.source_box) for t in small.transfers)
    assert moved == 4 * 8 * 64


def test_stage_meshes_lay_ranks_out_stage_major() -> None:
    pipeline = Pipeline(stages=3, stage_meshes=((1,), (2, 2), (2,)))
    assert pipeline.world_size == 7
    meshes = stage_meshes(pipeline, Cluster.preset("h100", (7,)))
    assert meshes.shapes == ((1,), (2, 2), (2,))
    assert [meshes.ranks(s) for s in range(3)] == [(0,), (1, 2, 3, 4), (5, 6)]
    assert meshes.locate(4) == (1, 3) and meshes.coordinate(4) == (1, 1)
    assert meshes.rank(2, (1,)) == 6
    assert not meshes.uniform
    # The plan of each stage mesh covers every stage's weights, of which a stage of d of the
    # 7 devices holds about d/7.
    assert meshes.clusters[1].memory == Cluster.preset("h100", (7,)).memory * 7 / 4


def test_stages_tile_a_two_dimensional_cluster_as_alpa_does() -> None:
    """On rows of 4: the stage of a whole row first, then pieces of a row widest first, left
    to right; a stage never straddles two rows."""
    pipeline = Pipeline(stages=4, stage_meshes=((1,), (4,), (2,), (1,)))
    meshes = stage_meshes(pipeline, Cluster((2, 4)))
    assert [meshes.ranks(s) for s in range(4)] == [(6,), (0, 1, 2, 3), (4, 5), (7,)]
    assert meshes.locate(5) == (2, 1) and not meshes.stage_major
    # A 1-D cluster, or meshes that are not rows or pieces of a row, keep stage-major ranks.
    assert stage_meshes(pipeline, Cluster((8,))).stage_major
    odd = Pipeline(stages=2, stage_meshes=((3,), (3,)))
    assert stage_meshes(odd, Cluster((3, 2))).stage_major


def test_a_submesh_takes_the_links_of_the_ranks_it_spans() -> None:
    cluster = Cluster.preset("h100", (2, 8))  # 8 GPUs per node: NVLink inside, IB across
    inside = cluster.submesh((2, 4))
    assert inside.bandwidth == (cluster.bandwidth[1], cluster.bandwidth[1])
    across = cluster.submesh((2, 8))
    assert across.bandwidth == (cluster.bandwidth[0], cluster.bandwidth[1])


def test_mistakes_raise_clear_errors() -> None:
    with pytest.raises(PipelineError, match="one mesh per stage"):
        Pipeline(stages=3, stage_meshes=((1,), (2,)))
    with pytest.raises(PipelineError, match="positive ints"):
        Pipeline(stages=2, stage_meshes=((1,), (0,)))
    with pytest.raises(PipelineError, match="chooses the stage meshes"):
        Pipeline(stages="auto", stage_meshes=((1,), (2,)))
    with pytest.raises(PipelineError, match="data_parallel"):
        Pipeline(stages=2, data_parallel=2, stage_meshes=((1,), (2,)))
    pipeline = Pipeline(stages=2, stage_meshes=((1,), (2,)))
    with pytest.raises(PipelineError, match="one Cluster per stage"):
        meshes_of(pipeline, Cluster((2,)))
    with pytest.raises(PipelineError, match=r"names \(\(1,\), \(2,\)\)"):
        meshes_of(pipeline, (Cluster((2,)), Cluster((1,))))
    with pytest.raises(PipelineError, match="must use it exactly"):
        stage_meshes(pipeline, Cluster((4,)))
    model, tokens, targets = _build(CONFIG)
    with pytest.raises(FxparError, match="must use it exactly"):
        fxpar.compile(
            model, Cluster((2,)), (tokens,), gpt_loss, example_targets=(targets,),
            pipeline=pipeline, manual=plans.tensor_parallel,
        )  # fmt: skip
    with pytest.raises(PipelineError, match=r"needs 3 processes \(stage meshes"):
        PipelineModel(model, pipeline, (tokens,), gpt_loss, example_targets=(targets,))


# -- on 3 gloo processes -------------------------------------------------------------------------

CONFIG = GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=16)
# Large enough that the residual stream (4 rows x 64 x 256 floats, 256 KiB) reaches the two
# tensor-parallel devices in halves that they all-gather.
WIDE = GPTConfig(n_layer=2, n_embd=256, n_head=4, vocab_size=64, block_size=64)
LR = 0.5
PLANS = {"megatron": "tensor_parallel"}
CASES = [  # (stage meshes, plan, pipeline options, config, steps)
    (((1,), (2,)), "megatron", {"schedule": "1f1b", "microbatches": 2}, CONFIG, 2),
    # Data-parallel activations leave the (2,) stage in halves that the (1,) stage joins.
    (
        ((2,), (1,)),
        "data_parallel",
        {"schedule": "gpipe", "microbatches": 4, "remat": True},
        CONFIG,
        2,
    ),
    (((1,), (2,)), "megatron", {"schedule": "1f1b", "microbatches": 2}, WIDE, 1),
]


def _build(config: GPTConfig, batch: int = 8) -> tuple[GPT, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = GPT(config)
    generator = torch.Generator().manual_seed(1)
    size = (batch, config.block_size)
    tokens = torch.randint(0, config.vocab_size, size, generator=generator)
    targets = torch.randint(0, config.vocab_size, size, generator=generator)
    return model, tokens, targets


def _compile(
    model: GPT, tokens: torch.Tensor, targets: torch.Tensor, meshes: Any, plan: str, **kw: Any
) -> PipelineModel:
    optimizer = kw.pop("optimizer", SGD(lr=LR))
    return fxpar.compile(
        model, Cluster((3,)), (tokens,), gpt_loss, example_targets=(targets,),
        optimizer=optimizer, pipeline=Pipeline(stages=2, stage_meshes=meshes, **kw),
        manual=None if plan == "ilp" else getattr(plans, PLANS.get(plan, plan)),
    )  # fmt: skip


def _run_cases(rank: int, world_size: int, directory: str) -> list[Any]:
    results: list[Any] = []
    for meshes, plan, options, config, steps in CASES:
        model, tokens, targets = _build(config)
        pipelined = _compile(model, tokens, targets, meshes, plan, **options)
        losses = [pipelined.step(tokens, targets) for _ in range(steps)]
        assert pipelined.sharded is not None
        wires = {
            key: [(c.send_spec, c.receive_spec) for c in found]
            for key, found in pipelined.sharded.crossings.items()
        }
        state = pipelined.full_state_dict()
        pipelined.eval()
        evaluated = (pipelined.loss(tokens, targets), pipelined(tokens))
        results.append((losses, state, wires, evaluated, pipelined.coordinate))
    results.append(_checkpoint_round_trip(directory))
    results.append(_auto_stages())
    return results


AUTO = GPTConfig(n_layer=2, n_embd=64, n_head=4, vocab_size=64, block_size=16)


def _auto_stages() -> tuple[Any, ...]:
    """stages="auto" under data parallelism on 3 devices of slow links: the stage DP picks a
    stage of 1 device and one of 2 (the batch does not split over 3), and fxpar.compile runs
    that choice."""
    model, tokens, targets = _build(AUTO, batch=16)
    pipelined = fxpar.compile(
        model, Cluster((3,), bandwidth=(1e8,)), (tokens,), gpt_loss,
        example_targets=(targets,), optimizer=SGD(lr=LR),
        pipeline=Pipeline(stages="auto", microbatches=4, stage_mode="meshes"),
        manual=plans.data_parallel,
    )  # fmt: skip
    losses = [pipelined.step(tokens, targets) for _ in range(2)]
    return pipelined.pipeline.stage_meshes, losses, pipelined.full_state_dict()


def _checkpoint_round_trip(directory: str) -> tuple[Any, ...]:
    """AdamW on meshes (1,) then (2,) under Megatron: a step, save, a step. The checkpoint then
    resumes on meshes (2,) then (1,) under the ILP's plan, which takes the same second step."""
    model, tokens, targets = _build(CONFIG)
    common = {"optimizer": AdamW(lr=1e-2), "microbatches": 2}
    original = _compile(model, tokens, targets, ((1,), (2,)), "megatron", **common)
    original.step(tokens, targets)
    original.save(directory)
    expected = (original.step(tokens, targets), original.full_state_dict())
    resumed = _compile(_build(CONFIG)[0], tokens, targets, ((2,), (1,)), "ilp", **common)
    resumed.load(directory)
    return expected, (resumed.step(tokens, targets), resumed.full_state_dict())


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory: pytest.TempPathFactory) -> list[list[Any]]:
    return spawn(_run_cases, 3, str(tmp_path_factory.mktemp("submesh_checkpoint")))


def _eager(config: GPTConfig, steps: int, batch: int = 8) -> tuple[list[torch.Tensor], GPT, Any]:
    model, tokens, targets = _build(config, batch)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = gpt_loss(model(tokens), targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    model.eval()
    with torch.no_grad():
        outputs = model(tokens)
        evaluated = (gpt_loss(outputs, targets), outputs)
    return losses, model, evaluated


@pytest.mark.slow
@pytest.mark.parametrize(
    "case", range(len(CASES)), ids=[f"{m} {p} {o} n_embd={c.n_embd}" for m, p, o, c, _ in CASES]
)
def test_stages_on_different_meshes_train_like_one_device(
    case: int, per_rank: list[list[Any]]
) -> None:
    """Every rank reports the whole batch's loss at every step, the gathered model after the
    steps equals eager SGD's (the tied embedding too, summed across stages that lay it out
    differently), and in eval mode the loss and the forward's outputs equal eager PyTorch's."""
    config, steps = CASES[case][3], CASES[case][4]
    losses, model, (eval_loss, outputs) = _eager(config, steps)
    expected = model.state_dict()
    for rank, results in enumerate(per_rank):
        got_losses, state, _, (got_eval_loss, got_outputs), _ = results[case]
        torch.testing.assert_close(torch.stack(got_losses), torch.stack(losses), msg=f"{rank}")
        torch.testing.assert_close(state, expected, msg=f"rank {rank}")
        torch.testing.assert_close(got_eval_loss, eval_loss, msg=f"rank {rank}")
        torch.testing.assert_close(got_outputs, outputs, atol=1e-5, rtol=1e-4)


@pytest.mark.slow
def test_values_really_change_layout_between_the_meshes(per_rank: list[list[Any]]) -> None:
    """The stage on one device sends whole values; Megatron's two devices receive them
    replicated, and the wide model's residual stream in halves that they all-gather; a
    data-parallel stage sends halves of the batch, which the one-device stage joins."""
    narrow = per_rank[1][0][2]["forward_received"]  # rank 1: device 0 of the (2,) stage
    assert narrow and all(receive == (Replicate(),) for _, receive in narrow)
    joined = per_rank[0][1][2]["forward_sent"]  # rank 0: device 0 of the data-parallel stage
    assert any(send == (Shard(0),) for send, _ in joined)
    wide = per_rank[1][2][2]["forward_received"]
    assert any(isinstance(receive[0], Shard) for _, receive in wide)
    sent = per_rank[0][2][2]["forward_sent"]  # rank 0: the (1,) stage
    assert all(send == (Replicate(),) for send, _ in sent)


@pytest.mark.slow
def test_a_checkpoint_moves_between_stage_mesh_layouts(per_rank: list[list[Any]]) -> None:
    for rank, results in enumerate(per_rank):
        (loss, state), (resumed_loss, resumed_state) = results[len(CASES)]
        torch.testing.assert_close(resumed_loss, loss, msg=f"rank {rank}")
        torch.testing.assert_close(resumed_state, state, msg=f"rank {rank}")


@pytest.mark.slow
def test_auto_stages_run_on_the_submeshes_they_choose(per_rank: list[list[Any]]) -> None:
    losses, model, _ = _eager(AUTO, 2, batch=16)
    for rank, results in enumerate(per_rank):
        meshes, got_losses, state = results[len(CASES) + 1]
        assert meshes == ((1,), (2,))
        torch.testing.assert_close(torch.stack(got_losses), torch.stack(losses), msg=f"{rank}")
        torch.testing.assert_close(state, model.state_dict(), msg=f"rank {rank}")


def _tiled(rank: int, world_size: int) -> tuple[Any, ...]:
    """Meshes (1,), (2,), (1,) on a 2x2 cluster: the middle stage takes a row of its own."""
    model, tokens, targets = _build(CONFIG)
    pipelined = fxpar.compile(
        model, Cluster((2, 2)), (tokens,), gpt_loss, example_targets=(targets,),
        optimizer=SGD(lr=LR), manual=plans.tensor_parallel,
        pipeline=Pipeline(stages=("blocks.1", "ln_f"), microbatches=2,
                          stage_meshes=((1,), (2,), (1,))),
    )  # fmt: skip
    losses = [pipelined.step(tokens, targets) for _ in range(2)]
    return pipelined.stage, losses, pipelined.full_state_dict()


@pytest.mark.slow
def test_stages_tiled_on_a_two_dimensional_cluster_train_like_one_device() -> None:
    """Placed as Alpa tiles the cluster, the stage of two devices runs on ranks 0 and 1 (one
    row), the others on ranks 2 and 3; the pipeline trains like one device."""
    results = spawn(_tiled, 4)
    assert [stage for stage, _, _ in results] == [1, 1, 0, 2]
    losses, model, _ = _eager(CONFIG, 2)
    for rank, (_, got_losses, state) in enumerate(results):
        torch.testing.assert_close(torch.stack(got_losses), torch.stack(losses), msg=f"{rank}")
        torch.testing.assert_close(state, model.state_dict(), msg=f"rank {rank}")


def test_plans_of_copies_of_a_program_do_not_share_annotations() -> None:
    """Planning writes into the graph; two plans of one step for two meshes (what stages on
    different meshes need) must each keep their own layouts. torch.fx copies node metadata
    shallowly, so Program.copy copies the annotations itself."""
    model, tokens, targets = _build(CONFIG)
    program = fxpar.capture(model, (tokens,), gpt_loss, example_targets=(targets,))
    one = plans.tensor_parallel(program.copy(), Cluster((1,)))
    two = plans.tensor_parallel(program.copy(), Cluster((1, 2)))
    first, second = (p.placeholders()["wte.weight"] for p in (one, two))
    assert len(value_spec(first)) == 1 and len(value_spec(second)) == 2
    with pytest.raises(LoweringError):
        value_spec(program.placeholders()["wte.weight"])  # the original stays unplanned


def test_one_submesh_cuts_every_stage_cluster() -> None:
    """Cluster.submesh is the one cut of a stage's cluster: the stage mesh of a (stages,
    *stage_mesh) cluster keeps its axes' names and links, 1-D and other shapes take the links
    of the ranks they span, and memory grows by the number of stages of that size."""
    cluster = Cluster.preset("h100", (4, 2, 8))
    stage = stage_devices(cluster, 4)
    assert stage.mesh_shape == (2, 8) and stage.axis_names == cluster.axis_names[1:]
    assert stage.bandwidth == cluster.bandwidth[1:] and stage.latency == cluster.latency[1:]
    assert stage.memory == cluster.memory * 4
    line = cluster.submesh((16,))
    assert line.axis_names == ("devices",) and line.bandwidth == (cluster.bandwidth[1],)
    assert line.memory == cluster.memory * 4
    odd = Cluster((3,)).submesh((2,))  # stages on meshes of different sizes
    assert odd.memory == Cluster((3,)).memory * 1.5
    with pytest.raises(FxparError, match="stage mesh"):
        cluster.submesh((128,))
    with pytest.raises(FxparError, match="stage mesh"):
        cluster.submesh(())
