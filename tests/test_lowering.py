"""Lowering: the named plans train exactly like one device on 1-D and 2-D meshes, insert the
collectives their textbook descriptions promise, print as readable code, and bad input fails
with clear errors."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.distributed.tensor import Shard

import fxpar
from fxpar import ir, plans
from fxpar.cluster import Cluster
from fxpar.errors import FxparError, LoweringError
from fxpar.lowering import CollectiveRecord, SPMDProgram, collective_calls, lower
from fxpar.models import GPT, GPTConfig, gpt_loss
from fxpar.planning.grouping import gather_groups
from fxpar.sharding import Sharding
from fxpar.testing import assert_equivalent

CONFIG = GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=16)


def gpt_case(
    batch: int = 4, mixed_precision: fxpar.MixedPrecision | None = None
) -> tuple[GPT, fxpar.Program, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = GPT(CONFIG)
    tokens = torch.randint(0, CONFIG.vocab_size, (batch, 8))
    targets = torch.randint(0, CONFIG.vocab_size, (batch, 8))
    program = fxpar.capture(
        model, (tokens,), gpt_loss, example_targets=(targets,), mixed_precision=mixed_precision
    )
    return model, program, program.flat_inputs(model, tokens, targets)


PLANS = {
    "data_parallel": plans.data_parallel,
    "tensor_parallel": plans.tensor_parallel,
    "fully_sharded": plans.fully_sharded,
}


@pytest.mark.parametrize("mesh", [(2,), (4,), (2, 2)], ids=str)
@pytest.mark.parametrize("plan", list(PLANS))
def test_named_plans_train_like_one_device(plan: str, mesh: tuple[int, ...]) -> None:
    _, program, flat = gpt_case()
    cluster = Cluster(mesh)
    spmd = lower(PLANS[plan](program, cluster), cluster)
    assert len(spmd.ranks) == cluster.world_size
    assert_equivalent(spmd, flat)


def lowered(
    plan: str, mesh: tuple[int, ...], mixed: fxpar.MixedPrecision | None = None, **options: int
) -> SPMDProgram:
    _, program, _ = gpt_case(mixed_precision=mixed)
    cluster = Cluster(mesh)
    return lower(PLANS[plan](program, cluster), cluster, **options)


def block_of(spmd: SPMDProgram, consumer: str) -> str:
    node = next(n for n in spmd.program.graph.nodes if n.name == consumer)
    return ".".join(ir.require(node, ir.Region).module.split(".")[:2])


def test_megatron_blocks_all_reduce_twice_forward_and_twice_backward() -> None:
    spmd = lowered("tensor_parallel", (2,))
    per_block: Counter[tuple[str, str, ir.Phase]] = Counter()
    for record in spmd.collectives():
        per_block[(block_of(spmd, record.consumer), record.kind, record.phase)] += 1
    for block in ("blocks.0", "blocks.1"):
        assert per_block[(block, "all_reduce", ir.Phase.FORWARD)] == 2
        assert per_block[(block, "all_reduce", ir.Phase.BACKWARD)] == 2
    # Nothing else: replicated parameters get identical gradients on every device.
    assert sum(per_block.values()) == 8
    assert {r.kind for r in spmd.collectives()} == {"all_reduce"}


def test_data_parallel_all_reduces_each_gradient_once_and_nothing_else() -> None:
    spmd = lowered("data_parallel", (4,), bucket_bytes=0)  # one all-reduce per output
    records = spmd.collectives()
    assert {r.kind for r in records} == {"all_reduce"}
    gradients = [r for r in records if r.bytes > 4]
    parameters = spmd.program.signature.parameters
    sizes = {
        name: ir.evaluate(ir.require(spmd.program.placeholders()[name], ir.ValueMeta).tensor.nbytes)
        for name in parameters
    }
    # One all-reduce per parameter, never more bytes than the gradients (the position table's
    # gradient is reduced before it is scattered into the table, on fewer bytes).
    assert len(gradients) == len(parameters)
    assert sum(r.bytes for r in gradients) <= sum(sizes.values())
    # The rest are the two scalars of an exact global mean loss: the summed loss and the
    # count of valid targets (so ignore_index and uneven masks stay exact).
    scalars = [r for r in records if r.bytes == 4]
    assert len(scalars) == 2

    # Bucketed (the default): the gradients and the loss leave by one all-reduce of as many
    # bytes, started where its last value is computed and waited on at the end; a small
    # bucket size cuts more buckets.
    bucketed = lowered("data_parallel", (4,))
    leaving = [r for r in bucketed.collectives() if r.phase is ir.Phase.OUTPUT]
    assert len(leaving) == 1
    assert leaving[0].bytes == sum(r.bytes for r in records if r.phase is ir.Phase.OUTPUT)
    for rank in bucketed.ranks:
        assert rank.code().count("start_all_reduce_bucket(") == 1
        assert rank.code().count("wait_bucket(") == 1
    assert len(lowered("data_parallel", (4,), bucket_bytes=4096).collectives()) > 2


def test_fully_sharded_gathers_parameters_and_reduce_scatters_gradients() -> None:
    spmd = lowered("fully_sharded", (2,), bucket_bytes=0)  # one collective per gradient
    kinds = Counter((r.kind, r.phase) for r in spmd.collectives())
    sharded = [
        name
        for name in spmd.program.signature.parameters
        if isinstance(
            ir.require(spmd.program.placeholders()[name], Sharding).strategy.outputs[0][0],  # type: ignore[index]
            Shard,
        )
    ]
    assert len(sharded) == len(spmd.program.signature.parameters)  # every dim 0 here is even
    assert kinds[("all_gather", ir.Phase.FORWARD)] == len(sharded)
    # Parameters the backward reads directly (the norms' weights) are gathered again there
    # rather than kept from the forward. (Without buckets, Linear weights reach the backward
    # through the forward's transposed view, which keeps the gathered copy; with them, see
    # test_fully_sharded_weights_gathered_in_the_forward_die_with_the_forward.)
    regathered = {r.tensor for r in spmd.collectives() if r.kind == "all_gather"
                  and r.phase is ir.Phase.BACKWARD}  # fmt: skip
    assert {"blocks_0_ln_1_weight", "blocks_1_ln_2_bias", "ln_f_weight"} <= regathered
    # Each gradient is reduce-scattered into its shard, or (the position table, whose gradient
    # is smaller before the scatter into the table) all-reduced and then sliced locally.
    reduced = kinds[("reduce_scatter", ir.Phase.OUTPUT)] + kinds[("all_reduce", ir.Phase.BACKWARD)]
    assert reduced == len(sharded)
    assert kinds[("reduce_scatter", ir.Phase.OUTPUT)] >= len(sharded) - 1

    # Bucketed (the default): the same bytes reduce-scattered in a few collectives (a small
    # first bucket, then the rest), each started where its last gradient is computed.
    def scattered(records: list[CollectiveRecord]) -> list[CollectiveRecord]:
        return [r for r in records if (r.kind, r.phase) == ("reduce_scatter", ir.Phase.OUTPUT)]

    bucketed = lowered("fully_sharded", (2,))
    assert 1 <= len(scattered(bucketed.collectives())) <= 2
    # The forward gathers each layer's parameters with one all-gather (the two blocks, and
    # the embeddings and final norm together), as many bytes as one per parameter.
    gathers = [r for r in bucketed.collectives() if r.kind == "all_gather"]
    forward = [r for r in gathers if r.phase is ir.Phase.FORWARD]
    assert len(forward) == 3
    assert sum(r.bytes for r in forward) == sum(
        r.bytes for r in spmd.collectives() if (r.kind, r.phase) == ("all_gather", ir.Phase.FORWARD)
    )
    assert sum(r.bytes for r in scattered(bucketed.collectives())) == sum(
        r.bytes for r in scattered(spmd.collectives())
    )
    for rank in bucketed.ranks:
        code = rank.code()
        assert code.count("start_reduce_scatter_bucket(") == len(scattered(bucketed.records))
        assert "reduce_scatter(comm" not in code


@pytest.mark.parametrize("mixed", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mesh", [(2,), (4,), (2, 2)], ids=str)
def test_fully_sharded_weights_gathered_in_the_forward_die_with_the_forward(
    mesh: tuple[int, ...], mixed: bool
) -> None:
    """ZeRO-3: a Linear's backward reads the forward's ``t(weight)``; the lowering gathers the
    weight again in the backward and recomputes the view there, so no gathered copy (nor a
    view of one) outlives the forward, and each layer's backward gathers its weights in one
    collective. Under mixed precision the same holds of the bf16 casts, which are what
    travels."""
    policy = fxpar.MixedPrecision(torch.bfloat16, torch.float32) if mixed else None
    spmd = lowered("fully_sharded", mesh, policy)
    backward_gathers = [
        r for r in spmd.collectives() if r.kind == "all_gather" and r.phase is ir.Phase.BACKWARD
    ]
    # One gather per layer and mesh axis in the backward (two blocks, and the embeddings, norm
    # and head).
    assert len(backward_gathers) == 3 * len(mesh)
    placeholders = spmd.program.placeholders()
    specs = {node: spmd.input_specs[i] for i, node in enumerate(placeholders.values())}
    gathers = gather_groups(spmd.program.graph, specs, spmd.cluster.mesh_shape)
    again = {
        member.source.name if member.source.op == "placeholder" else member.source.args[0].name
        for group in gathers.groups
        if group.phase is ir.Phase.BACKWARD
        for member in group.members
    }
    assert {"blocks_0_attn_qkv_weight", "blocks_1_mlp_proj_weight", "wte_weight"} <= again
    travelling = {ir.require(m.source, ir.ValueMeta).tensor.dtype
                  for group in gathers.groups for m in group.members}  # fmt: skip
    assert travelling == {torch.bfloat16 if mixed else torch.float32}
    # Each axis's all-gather sends what the gathers before it made (innermost axis first).
    expected = 0
    for group in gathers.groups:
        if group.phase is ir.Phase.BACKWARD:
            nbytes = group.nbytes
            for axis in group.axes:
                expected += nbytes
                nbytes *= mesh[axis]
    assert sum(r.bytes for r in backward_gathers) == expected
    for rank in spmd.ranks:
        graph = rank.graph_module.graph
        order = {node: position for position, node in enumerate(graph.nodes)}
        first_backward = min(
            order[
                graph.find_nodes(op="call_function", target=getattr(torch.ops.aten, t).default)[0]
            ]
            for t in ("nll_loss_backward",)
        )
        waits = graph.find_nodes(op="call_function", target=collective_calls.wait_bucket)
        forward_waits = [w for w in waits if order[w] < first_backward]
        assert forward_waits
        # Everything computed from a forward gather by views is used before the backward.
        alive = {user for wait in forward_waits for user in wait.users}
        frontier = list(alive)
        while frontier:
            node = frontier.pop()
            for user in node.users:
                if user.op == "call_function" and user not in alive and "view" in str(user.target):
                    alive.add(user)
                    frontier.append(user)
                if str(user.target).startswith("aten.t.") and user not in alive:
                    alive.add(user)
                    frontier.append(user)
        for value in alive:
            last_use = max(order[user] for user in value.users)
            assert last_use < first_backward, f"{value.name} is read in the backward"


def test_per_rank_programs_read_as_code() -> None:
    spmd = lowered("tensor_parallel", (2,))
    code = spmd.for_rank(1).code()
    assert "def forward(self, comm," in code
    assert "all_reduce(comm," in code
    # Local shapes: the head dim of 4 heads split in 2 is 2 per rank.
    assert "[4, 8, 2, 3, 8]" in code


def test_lowering_needs_a_strategy_for_every_node() -> None:
    _, program, _ = gpt_case()
    with pytest.raises(LoweringError, match="has no chosen strategy"):
        lower(program, Cluster((2,)))


def test_lowering_rejects_symbolic_shapes() -> None:
    model = GPT(CONFIG)
    tokens = torch.randint(0, CONFIG.vocab_size, (4, 8))
    program = fxpar.capture(model, (tokens,), gpt_loss, example_targets=(tokens,), dynamic=True)
    with pytest.raises(LoweringError, match="has a symbolic shape"):
        lower(program, Cluster((2,)))


def test_batch_not_divisible_by_data_parallel_degree_is_a_clear_error() -> None:
    _, program, _ = gpt_case(batch=6)
    with pytest.raises(FxparError, match="divisible by the 4 data-parallel devices"):
        plans.data_parallel(program, Cluster((4,)))


def test_cluster_validates_its_mesh() -> None:
    with pytest.raises(FxparError, match="positive ints"):
        Cluster((2, 0))
    with pytest.raises(FxparError, match="distinct axis names"):
        Cluster((2, 2), axis_names=("dp", "dp"))
    cluster = Cluster((2, 3), axis_names=("dp", "tp"))
    assert [cluster.rank(c) for c in cluster.coordinates()] == list(range(6))
    assert cluster.coordinate(4) == (1, 1)
    assert cluster.axis_index("tp") == 1


def test_tensor_parallel_backward_all_reduces_travel_behind_the_weight_gradients() -> None:
    """A started all-reduce is waited on only where its sum is read; the ops that do not
    need it (the weight gradients' matmuls of a Megatron block's backward) run in between,
    and a start with nothing to overlap is one blocking all-reduce. The programs still train
    like one device (test_named_plans_train_like_one_device)."""
    spmd = lowered("tensor_parallel", (2,))
    graph = spmd.for_rank(0).graph_module.graph
    order = {node: position for position, node in enumerate(graph.nodes)}
    waits = graph.find_nodes(op="call_function", target=collective_calls.wait_all_reduce)
    assert waits
    overlapped = 0
    for wait in waits:
        (start,) = wait.all_input_nodes
        between = [n for n in graph.nodes if order[start] < order[n] < order[wait]]
        assert between  # otherwise it would have been one blocking all-reduce
        assert not any(wait in n.all_input_nodes for n in between)
        overlapped += any(n.target is torch.ops.aten.mm.default for n in between)
    # The backward of each of the two blocks sums two input gradients behind matmuls.
    assert overlapped >= 4
    assert len(waits) + len(
        graph.find_nodes(op="call_function", target=collective_calls.all_reduce)
    ) == sum(r.kind == "all_reduce" for r in spmd.collectives() if r.phase is not ir.Phase.OUTPUT)
