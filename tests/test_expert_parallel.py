"""Expert parallelism: mixture-of-experts layers whose experts are split by expert, each device
holding whole experts and computing only the rows routed to them (fxpar/rules/experts.py, run
through the local call of fxpar/rules/local.py).

Hugging Face Mixtral (with its router's load-balancing loss) and Qwen2-MoE (with a shared
expert) train like eager PyTorch under ``plans.expert_parallel`` on (2,) and on (2, 2) with
data parallelism on the other axis, through transformers' fp32 grouped products and through
``aten._grouped_mm`` in bf16; so they do when every token is routed to one expert (one device
holds all the rows, the other none); the ILP splits the experts where that is cheaper than
anything else it may do, by the cost model's count; and on real gloo processes a few training
steps equal eager PyTorch's.

With the tokens dispatched by all-to-all (``dispatch="all_to_all"``, fxpar/planning/moe_blocks.py
and fxpar/lowering/expert_dispatch.py): the exchange sends every row to its experts' device and
back, the MoE blocks are found, and the models train like eager PyTorch in the simulator (also
every token on one expert, and under bf16 mixed precision) and on gloo processes. The exchanges
are entries of the collective schedule: ``lower(plan).collectives()`` lists them, the report
counts them, and the simulated devices run exactly them.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from conftest import assert_bf16_step_close, eager_step
from torch import nn
from torch.distributed.tensor import Replicate, Shard

import fxpar
from fxpar import ir, plans
from fxpar.cluster import Cluster
from fxpar.errors import FxparError
from fxpar.models import GPT, GPTConfig, gpt_loss
from fxpar.passes import plan_program
from fxpar.planning.propagate import expert_weights
from fxpar.rules import default_rules, experts, op_call
from fxpar.runtime.launch import spawn
from fxpar.sharding import Sharding, Spec
from fxpar.testing import assert_equivalent, simulate
from fxpar.testing.simulate import record_values

transformers = pytest.importorskip("transformers")
# transformers' grouped products exist once its MoE integration is loaded: before any registry.
pytest.importorskip("transformers.integrations.moe")

VOCAB = 64
DECODER = dict(
    vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
    num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16,
)  # fmt: skip
MESHES = [(2,), (2, 2)]


def mixtral(**overrides: Any) -> nn.Module:
    config = dict(
        DECODER, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
        router_aux_loss_coef=0.1,
    )  # fmt: skip
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(**{**config, **overrides}))


def qwen2_moe(layers: int = 1) -> nn.Module:
    config = transformers.Qwen2MoeConfig(
        **{**DECODER, "num_hidden_layers": layers}, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    return transformers.Qwen2MoeForCausalLM(config)


MODELS = {"mixtral": mixtral, "qwen2_moe": qwen2_moe}


def _inputs() -> dict[str, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (4, 8), generator=torch.Generator().manual_seed(3))
    return {"input_ids": tokens, "labels": tokens}


def _expert_parallel(model: nn.Module, mesh: tuple[int, ...]) -> tuple[fxpar.Program, Any]:
    """The model captured, planned with experts on axis 0 (data on the other), lowered."""
    program = fxpar.capture(model, _inputs())
    planned = plan_program(program, Cluster(mesh), manual=plans.expert_parallel)
    return planned.program, fxpar.lower(planned)


def _specs(program: fxpar.Program) -> dict[str, Spec]:
    return {
        name: ir.require(node, Sharding).strategy.outputs[0]  # type: ignore[misc]
        for name, node in program.placeholders().items()
    }


def _grouped_products(program: fxpar.Program) -> list[Any]:
    return [n for n in program.graph.nodes if experts.is_grouped_product(n.target)]


def _split_on_axis_0(program: fxpar.Program, node: Any) -> bool:
    strategy = ir.require(node, Sharding).strategy
    spec = experts.experts_spec(op_call(node, program.cluster.mesh_shape), strategy)
    return spec is not None and spec[0] == Shard(0)


def _assert_like_eager(model: nn.Module, program: fxpar.Program, spmd: Any) -> None:
    """The simulated ranks' loss and gradients against eager PyTorch's."""
    inputs = _inputs()
    found = simulate(spmd, program.flat_inputs(model, *inputs.values())).result
    loss, grads = eager_step(model, inputs)
    torch.testing.assert_close(found.outputs[0], loss, rtol=1e-4, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(found.gradients[name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("mesh", MESHES, ids=["2", "2x2"])
@pytest.mark.parametrize("name", list(MODELS))
def test_expert_parallel_trains_like_one_device(name: str, mesh: tuple[int, ...]) -> None:
    """Every expert weight is split by expert on axis 0 and every grouped product (forward and
    backward) computes only its own experts' rows there; the batch is split on axis 1; loss
    and gradients (the router's and its auxiliary loss's included) equal eager PyTorch's."""
    model = MODELS[name]()
    program, spmd = _expert_parallel(model, mesh)
    specs = _specs(program)
    weights = expert_weights(program)
    assert weights and all(".experts." in w for w in weights)
    for weight in weights:
        assert specs[weight] == (Shard(0), *(Replicate(),) * (len(mesh) - 1))
    if len(mesh) == 2:
        assert specs["input_ids"] == (Replicate(), Shard(0))
    products = _grouped_products(program)
    assert len(products) == 4  # two products, each with its backward
    assert all(_split_on_axis_0(program, n) for n in products)
    assert_equivalent(spmd, program.flat_inputs(model, *_inputs().values()))
    _assert_like_eager(model, program, spmd)


def test_bf16_mixtral_expert_parallel_through_aten_grouped_mm() -> None:
    """bf16 experts call ``aten._grouped_mm``, whose backward is two more grouped products: the
    input gradient (split like the forward) and the weight gradient ``inputᵀ @ grad_output``,
    which computes only the device's own experts' products (no weight gradient is summed
    across devices). bf16 sums in another order than one device: each gradient is compared to
    its own scale (a wrong split is off by tens of percent, bf16 rounding by about 1%)."""
    model = mixtral().to(torch.bfloat16)
    program, spmd = _expert_parallel(model, (2, 2))
    products = _grouped_products(program)
    assert {n.target for n in products} == {torch.ops.aten._grouped_mm.default}
    assert len(products) == 6 and all(_split_on_axis_0(program, n) for n in products)
    flat = program.flat_inputs(model, *_inputs().values())
    assert_bf16_step_close(spmd, program, flat)


@pytest.mark.parametrize("mesh", MESHES, ids=["2", "2x2"])
def test_all_tokens_routed_to_one_expert(mesh: tuple[int, ...]) -> None:
    """A router with equal scores for every expert sends every token to the same one (top-1,
    ties broken alike every time): the device holding that expert computes every row, the other
    none, and the step is still exactly one device's."""
    model = mixtral(num_experts_per_tok=1)
    with torch.no_grad():
        model.model.layers[0].mlp.gate.weight.zero_()
    program, spmd = _expert_parallel(model, mesh)
    flat = program.flat_inputs(model, *_inputs().values())
    values = record_values(program.graph_module, flat)
    offsets = values[_grouped_products(program)[0].args[2].name]
    counts = torch.diff(offsets, prepend=offsets.new_zeros(1)).tolist()
    assert sorted(counts) == [0, 0, 0, 32], counts  # 4 x 8 tokens, all on one expert
    _assert_like_eager(model, program, spmd)


# Experts whose own dims split over no mesh axis (hidden 15, intermediate 127: odd), but whose
# count does (16): the down projection can be split only by expert.
AWKWARD = dict(
    hidden_size=15, head_dim=8, intermediate_size=127, num_local_experts=16,
    output_router_logits=False,
)  # fmt: skip
SLOW_DEVICES = Cluster((2,), flops=1e8, bandwidth=(1e9,), latency=(1e-5,))


def test_the_ilp_splits_experts_where_that_is_cheaper() -> None:
    """On devices slow enough that the experts' products matter, the ILP splits the down
    projection's experts (forward and backward), and its plan costs less than the best plan
    of a registry without expert splits (which must replicate that product or sum its
    weight gradient over the devices), by the cost model's own count; the plan it chose
    trains like one device."""
    model = mixtral(**AWKWARD)
    without = default_rules()
    experts.register(without, split_experts=False)
    chosen = plan_program(fxpar.capture(model, _inputs()), SLOW_DEVICES)
    other = plan_program(fxpar.capture(model, _inputs()), SLOW_DEVICES, rules=without)
    split = [n for n in _grouped_products(chosen.program) if _split_on_axis_0(chosen.program, n)]
    assert len(split) >= 2, "the ILP split no grouped product by expert"
    assert not any(_split_on_axis_0(other.program, n) for n in _grouped_products(other.program))
    assert chosen.solution.objective < other.solution.objective
    assert fxpar.planning.plan.score(chosen) < fxpar.planning.plan.score(other)
    chosen_memory = chosen.problem.memory(chosen.solution.choice)
    assert chosen_memory < other.problem.memory(other.solution.choice)
    flat = chosen.program.flat_inputs(model, *_inputs().values())
    assert_equivalent(fxpar.lower(chosen), flat)


def test_expert_parallel_says_when_a_model_has_no_experts() -> None:
    config = GPTConfig(n_layer=1, n_embd=16, n_head=2, vocab_size=VOCAB, block_size=8)
    tokens = torch.randint(0, VOCAB, (2, 8))
    program = fxpar.capture(GPT(config), (tokens,), gpt_loss, example_targets=(tokens,))
    with pytest.raises(FxparError, match="no expert weights"):
        plans.expert_parallel(program, Cluster((2,)))


def test_expert_weights_are_found_by_their_use() -> None:
    """The stacked weights grouped products read, and neither the router nor Qwen2-MoE's shared
    expert (an ordinary MLP)."""
    program = fxpar.capture(qwen2_moe(), _inputs())
    assert sorted(expert_weights(program)) == [
        "model.layers.0.mlp.experts.down_proj",
        "model.layers.0.mlp.experts.gate_up_proj",
    ]


# -- real processes ------------------------------------------------------------------------------

STEPS = 3
LR = 0.1


def _eager_training(make: Any) -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = make()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        loss, _ = eager_step(model, _inputs())
        optimizer.step()
        losses.append(loss.item())
    return losses, model.state_dict()


GLOO_RUNS = {
    (2,): (("mixtral", "all_reduce"), ("mixtral", "all_to_all"), ("qwen2_moe", "all_to_all")),
    (2, 2): (("mixtral", "all_reduce"), ("mixtral", "all_to_all")),
}
"""The (model, dispatch) pairs one gloo launch trains on each mesh, one after another (a
launch costs more than a compile; Qwen2-MoE only on 2 ranks, where it costs the least)."""


def _train_expert_parallel(
    rank: int, world_size: int, mesh: tuple[int, ...]
) -> dict[tuple[str, str], tuple[list[float], dict[str, torch.Tensor]]]:
    torch.set_num_threads(1)
    trained = {}
    for name, dispatch in GLOO_RUNS[mesh]:
        torch.manual_seed(0)
        parallel = fxpar.compile(
            MODELS[name](), Cluster(mesh), _inputs(), optimizer=fxpar.optim.SGD(lr=LR),
            manual=functools.partial(plans.expert_parallel, dispatch=dispatch),
        )  # fmt: skip
        losses = [parallel.step(**_inputs()).item() for _ in range(STEPS)]
        trained[name, dispatch] = losses, parallel.full_state_dict()
    return trained


@pytest.mark.slow
@pytest.mark.parametrize("mesh", MESHES, ids=["2", "2x2"])
def test_expert_parallel_trains_on_gloo_like_eager(mesh: tuple[int, ...]) -> None:
    """Three SGD steps under expert parallelism on gloo processes, experts on axis 0: Mixtral
    with the tokens whole on that axis (outputs all-reduced) and with the tokens dispatched
    by all-to-all (``dist.all_to_all_single`` with split sizes), on 2 ranks Qwen2-MoE
    dispatched too; every rank's losses and full weights equal eager PyTorch's."""
    expected = {name: _eager_training(MODELS[name]) for name, _ in GLOO_RUNS[mesh]}
    for trained in spawn(_train_expert_parallel, len(mesh) * 2, mesh):
        assert set(trained) == set(GLOO_RUNS[mesh])
        for (name, dispatch), (losses, state) in trained.items():
            expected_losses, expected_state = expected[name]
            assert losses == pytest.approx(expected_losses, rel=1e-4), (name, dispatch)
            persistent = {key: state[key] for key in expected_state}  # not rotary tables
            torch.testing.assert_close(
                persistent, expected_state, rtol=1e-4, atol=1e-5, msg=f"{name} {dispatch}"
            )


# -- tokens dispatched by all-to-all: the exchange ------------------------------------------------


def _routed_rows(
    mesh: tuple[int, ...], axis: int, ids_of: Any, width: int = 3
) -> tuple[dict[Any, torch.Tensor], dict[Any, Any], dict[Any, torch.Tensor]]:
    """On every simulated device: its rows (slot order), their experts, and what dispatch then
    combine gives back, with the route each device computed."""
    from fxpar.lowering import expert_dispatch as ed
    from fxpar.lowering.collective_calls import exchange_counts, exchange_rows
    from fxpar.testing.simulate import SimulatedMesh

    experts_count = 4
    rows = {c: torch.randn(6, width, generator=torch.Generator().manual_seed(sum(c))) for c in
            _coordinates(mesh)}  # fmt: skip
    routes: dict[Any, Any] = {}
    returned: dict[Any, torch.Tensor] = {}
    dispatched: dict[Any, torch.Tensor] = {}

    def body(coordinate: Any, comm: Any) -> None:
        ids = ids_of(coordinate)
        piece, pieces = coordinate[axis], mesh[axis]
        # As a rank program runs them: the counts exchanged, then rows sent and sent back.
        counts = ed.expert_counts(ids, experts_count)
        received = exchange_counts(comm, counts, axis)
        found = ed.route(ids, counts, received, piece, pieces, torch.int32)
        routes[coordinate] = found
        sent = exchange_rows(comm, ed.dispatch(found, rows[coordinate]), found.splits, axis)
        dispatched[coordinate] = ed.grouped(found, sent)
        back = ed.ungrouped(found, dispatched[coordinate] * 2)
        returned[coordinate] = ed.combine(
            found, exchange_rows(comm, back, found.splits.back(), axis)
        )

    SimulatedMesh(mesh).run(body)
    return rows, routes, {"dispatched": dispatched, "returned": returned}  # type: ignore[dict-item]


def _coordinates(mesh: tuple[int, ...]) -> list[tuple[int, ...]]:
    import itertools

    return list(itertools.product(*(range(n) for n in mesh)))


@pytest.mark.parametrize(
    ("mesh", "axis"), [((2,), 0), ((2, 2), 0), ((2, 2), 1)], ids=["2", "2x2-axis0", "2x2-axis1"]
)
def test_dispatch_sends_rows_to_their_experts_and_back(mesh: tuple[int, ...], axis: int) -> None:
    """Random routing: each device receives, grouped by expert, exactly its experts' block of
    the rows of its group sorted stably by expert (sources in device order), its offsets
    count them, and combine brings every row back to where it came from."""

    def ids_of(c: Any) -> torch.Tensor:
        return torch.randint(0, 4, (6,), generator=torch.Generator().manual_seed(7 + sum(c)))

    rows, routes, found = _routed_rows(mesh, axis, ids_of)
    for c in _coordinates(mesh):
        group = [(*c[:axis], i, *c[axis + 1 :]) for i in range(mesh[axis])]
        all_ids = torch.cat([ids_of(g) for g in group])
        all_rows = torch.cat([rows[g] for g in group])
        order = torch.sort(all_ids, stable=True).indices
        per = 4 // mesh[axis]
        mine = (all_ids[order] >= c[axis] * per) & (all_ids[order] < (c[axis] + 1) * per)
        torch.testing.assert_close(found["dispatched"][c], all_rows[order][mine])
        counts = torch.bincount(all_ids[order][mine] - c[axis] * per, minlength=per)
        assert routes[c].offsets.tolist() == torch.cumsum(counts, 0).tolist()
        assert routes[c].offsets.dtype == torch.int32
        torch.testing.assert_close(found["returned"][c], rows[c] * 2)


def test_dispatch_with_every_row_on_one_expert() -> None:
    """Every row to expert 3 (device 1's): device 0 receives nothing, sends all; the counts
    say so and the rows still come back."""
    rows, routes, found = _routed_rows((2,), 0, lambda c: torch.full((6,), 3))
    assert found["dispatched"][(0,)].shape == (0, 3)
    assert found["dispatched"][(1,)].shape == (12, 3)
    assert routes[(0,)].send_counts.tolist() == [0, 6]
    assert routes[(1,)].receive_counts.tolist() == [6, 6]
    assert routes[(1,)].offsets.tolist() == [0, 12]
    for c in _coordinates((2,)):
        torch.testing.assert_close(found["returned"][c], rows[c] * 2)


def _exchange_on_gloo(rank: int, world_size: int) -> tuple[list[int], torch.Tensor]:
    from torch.distributed.device_mesh import init_device_mesh

    from fxpar.lowering.collective_calls import all_to_all_rows
    from fxpar.runtime.communicators import ProcessGroupCommunicator

    comm = ProcessGroupCommunicator(init_device_mesh("cpu", (world_size,)))
    # Rank r sends r + 1 rows to rank 0 and none to rank 1; each row holds (sender, row).
    send = torch.tensor([rank + 1, 0])
    rows = torch.stack([torch.tensor([float(rank), float(i)]) for i in range(rank + 1)])
    received, counts = all_to_all_rows(comm, rows, send, 0)
    return counts.tolist(), received


def test_variable_all_to_all_on_gloo() -> None:
    """``dist.all_to_all_single`` with split sizes on gloo: rank 0 receives 1 row from itself
    and 2 from rank 1, rank 1 none; the counts arrive first."""
    first, second = spawn(_exchange_on_gloo, 2)
    assert first[0] == [1, 2]
    torch.testing.assert_close(first[1], torch.tensor([[0.0, 0.0], [1.0, 0.0], [1.0, 1.0]]))
    assert second[0] == [0, 0] and second[1].shape == (0, 2)


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "mixtral_bf16"])
def test_moe_block_is_found_with_its_boundaries(name: str) -> None:
    """The routing sort of each captured MoE layer is recognised as one block: its tokens'
    and routing weights' dispatches and the backward's dispatch of the output gradient, the
    combines back to slots and tokens, offsets from the sorted ids, and a region holding
    every grouped product (forward and backward) and nothing made outside the block."""
    from fxpar.planning.moe_blocks import find_blocks

    model = qwen2_moe() if name == "qwen2_moe" else mixtral()
    if name.endswith("bf16"):
        model = model.to(torch.bfloat16)
    program = fxpar.capture(model, _inputs())
    blocks, refused = find_blocks(program.graph)
    assert refused == [] and len(blocks) == 1
    (block,) = blocks
    assert (block.num_experts, block.top_k) == (4, 2)
    kinds = sorted(kind for kind, _ in block.boundaries.values())
    assert kinds == ["combine", "combine", "combine_tokens", "dispatch", "dispatch",
                     "dispatch_tokens"]  # fmt: skip
    assert set(_grouped_products(program)) <= set(block.region)
    assert block.offsets.target is torch.ops.aten.cumsum.default


def _all_to_all_plan(model: nn.Module, mesh: tuple[int, ...]) -> tuple[fxpar.Program, Any]:
    program = fxpar.capture(model, _inputs())
    manual = functools.partial(plans.expert_parallel, dispatch="all_to_all")
    planned = plan_program(program, Cluster(mesh), manual=manual)
    return planned.program, fxpar.lower(planned)


@pytest.mark.parametrize("mesh", MESHES, ids=["2", "2x2"])
@pytest.mark.parametrize("name", list(MODELS))
def test_tokens_dispatched_by_all_to_all_train_like_one_device(
    name: str, mesh: tuple[int, ...]
) -> None:
    """Tokens split over the expert axis too, each block's rows sent to their experts'
    devices and back: loss and gradients equal eager PyTorch's, and the expert activations
    travel by one route, three dispatches and three combines (forward and backward), with no
    all-reduce of an activation on the expert axis."""
    from fxpar.lowering import expert_dispatch

    model = MODELS[name]()
    program, spmd = _all_to_all_plan(model, mesh)
    assert _specs(program)["input_ids"] == (Shard(0),) * len(mesh)
    graph = spmd.ranks[0].graph_module.graph
    calls = [n.target.__name__ for n in graph.nodes if n.target in expert_dispatch.DISPATCH_CALLS]
    assert sorted(calls) == sorted(["route", "dispatch_tokens", "dispatch", "dispatch",
                                    "combine", "combine", "combine_tokens"])  # fmt: skip
    assert not any(n.target is experts.local_experts_fallback for n in graph.nodes)
    _assert_like_eager(model, program, spmd)


@pytest.mark.parametrize("name", list(MODELS))
def test_bf16_tokens_dispatched_by_all_to_all(name: str) -> None:
    """Mixed precision (bf16 compute, fp32 master weights and reductions): the experts are
    ``aten._grouped_mm`` products, the block is found through the casts, and with the tokens
    dispatched on (2, 2) the ranks compute the bf16 step of one device (the loss to 1%, each
    gradient within 5% of its own scale: bf16 rounding, not a wrong row)."""
    from fxpar.lowering import expert_dispatch

    model = MODELS[name]()
    policy = fxpar.MixedPrecision(torch.bfloat16, torch.float32)
    program = fxpar.capture(model, _inputs(), mixed_precision=policy)
    assert {n.target for n in _grouped_products(program)} == {torch.ops.aten._grouped_mm.default}
    manual = functools.partial(plans.expert_parallel, dispatch="all_to_all")
    plan = plan_program(program, Cluster((2, 2)), manual=manual)
    spmd = fxpar.lower(plan)
    graph = spmd.ranks[0].graph_module.graph
    assert any(n.target is expert_dispatch.route for n in graph.nodes)
    flat = plan.program.flat_inputs(model, *_inputs().values())
    assert_bf16_step_close(spmd, plan.program, flat)


@pytest.mark.parametrize("hidden", [32, 64], ids=["hidden=tokens", "hidden=slots"])
def test_rows_are_followed_not_guessed_from_sizes(hidden: int) -> None:
    """A hidden size equal to the number of tokens (4 x 8) or of slots (x 2 experts each):
    every value of the block holds its rows on the dim data flow gives it (the combine back
    to tokens, (tokens, hidden), on dim 0, where a rule by size put slots on dim 1), and the
    dispatched step equals eager PyTorch's."""
    from fxpar.planning.moe_blocks import find_blocks

    model = mixtral(hidden_size=hidden, intermediate_size=48)
    program, spmd = _all_to_all_plan(model, (2, 2))
    (block,), _ = find_blocks(program.graph)
    tokens = [n for n, (kind, _) in block.boundaries.items() if kind == "combine_tokens"]
    assert tokens and all(block.rows[n] == (0,) for n in tokens)
    assert all(ir.require(n, ir.ValueMeta).tensor.shape[1] == hidden for n in tokens)
    products = [n for n in block.region if experts.is_grouped_product(n.target)]
    assert all(block.rows[n] in ((0,), (0, None)) for n in products)
    _assert_like_eager(model, program, spmd)


def test_all_to_all_dispatch_with_every_token_on_one_expert() -> None:
    """Every token routed to one expert: one device computes every row, the other none."""
    model = mixtral(num_experts_per_tok=1)
    with torch.no_grad():
        model.model.layers[0].mlp.gate.weight.zero_()
    program, spmd = _all_to_all_plan(model, (2, 2))
    _assert_like_eager(model, program, spmd)


def test_the_all_to_all_exchanges_are_priced_by_the_hand_formula() -> None:
    """Each dispatched block's sort exchanges its experts' row counts and each boundary sends
    its piece of the value it moves: an all-to-all of alpha + (n-1)/n * bytes / beta on the
    expert axis, under balanced routing. The plan's estimate and its report count them: the
    same plan priced without them is cheaper by exactly their sum."""
    from fxpar.planning import moe_blocks
    from fxpar.planning.step_time import price_schedule

    cluster = Cluster((2,), latency=(1e-4,), bandwidth=(1e9,))
    program = fxpar.capture(mixtral(), _inputs())
    manual = functools.partial(plans.expert_parallel, dispatch="all_to_all")
    planned = plan_program(program, cluster, manual=manual).program
    exchanges = moe_blocks.exchange_seconds(planned.graph, cluster)
    blocks, _ = moe_blocks.find_blocks(planned.graph)
    assert len(blocks) == mixtral().config.num_hidden_layers
    for block in blocks:
        assert exchanges[block.sort] == pytest.approx(1e-4 + 0.5 * block.num_experts * 8 / 1e9)
        for node, (_, value) in block.boundaries.items():
            rows = ir.require(value, ir.ValueMeta).tensor
            local = rows.nbytes / 2  # the tokens are split over the axis
            assert exchanges[node] == pytest.approx(1e-4 + 0.5 * local / 1e9)
    assert len(exchanges) == sum(1 + len(b.boundaries) for b in blocks)
    priced = price_schedule(planned, cluster)
    assert priced.exchanges == exchanges
    assert priced.edge_seconds >= sum(exchanges.values())
    # Computed op by op (tokens whole), nothing is exchanged.
    whole = plan_program(fxpar.capture(mixtral(), _inputs()), cluster,
                         manual=plans.expert_parallel).program  # fmt: skip
    assert moe_blocks.exchange_seconds(whole.graph, cluster) == {}


def test_a_gpu_rank_over_gloo_exchanges_rows_through_host_copies() -> None:
    """``HostStaged`` (a GPU rank's communicator over gloo) hands the variable-size all-to-all
    a host copy with the counts as given, and returns what arrives on its device."""
    from fxpar.runtime.devices import HostStaged

    class Inner:
        def all_to_all_rows(self, tensor: Any, send: Any, receive: Any, axis: int) -> Any:
            assert tensor.device.type == "cpu" and list(send) == [1, 2] and axis == 0
            return tensor.flip(0)[: sum(receive)]

    staged = HostStaged(Inner(), torch.device("cpu"))  # type: ignore[arg-type]
    rows = torch.arange(6.0).reshape(3, 2)
    received = staged.all_to_all_rows(rows, [1, 2], [2, 0], 0)
    assert torch.equal(received, rows.flip(0)[:2])


def test_a_program_planned_on_one_mesh_plans_the_dispatch_on_another() -> None:
    """The strategies chosen for a program on one mesh stay on its nodes until it is planned
    again: planning it on a second mesh prices that mesh's candidates, not the old choice."""
    from fxpar.planning import moe_blocks

    program = fxpar.capture(mixtral(), _inputs())
    manual = functools.partial(plans.expert_parallel, dispatch="all_to_all")
    plan_program(program, Cluster((2,)), manual=manual)
    cluster = Cluster((2, 2))
    planned = plan_program(program, cluster, manual=manual).program
    exchanges = moe_blocks.exchange_seconds(planned.graph, cluster)
    assert exchanges and all(seconds > 0 for seconds in exchanges.values())


@pytest.mark.parametrize("dispatch", ["all_reduce", "all_to_all"])
def test_the_plan_says_which_axis_splits_the_experts(dispatch: str) -> None:
    """The plan's one-line layout names the expert axis "expert parallel" (tokens whole on it
    or dispatched over it) and the other axis by what it does."""
    manual = functools.partial(plans.expert_parallel, dispatch=dispatch)
    plan = plan_program(fxpar.capture(mixtral(), _inputs()), Cluster((2, 2)), manual=manual)
    assert plan.layout_summary().startswith("axis0 (2): expert parallel")
    assert "axis1 (2): data parallel" in plan.layout_summary()


# -- tokens dispatched by all-to-all: the exchanges in the collective schedule -----------------


class _Counting:
    """A simulated device's communicator that notes every collective it is handed, in order:
    (kind, mesh axis, bytes sent)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: list[tuple[str, int, int]] = []

    def _note(self, kind: str, tensor: torch.Tensor, axis: int) -> None:
        self.calls.append((kind, axis, tensor.numel() * tensor.element_size()))

    def all_gather(self, tensor: torch.Tensor, dim: int, axis: int) -> torch.Tensor:
        self._note("all_gather", tensor, axis)
        return self.inner.all_gather(tensor, dim, axis)  # type: ignore[no-any-return]

    def all_reduce(self, tensor: torch.Tensor, axis: int) -> torch.Tensor:
        self._note("all_reduce", tensor, axis)
        return self.inner.all_reduce(tensor, axis)  # type: ignore[no-any-return]

    def reduce_scatter(self, tensor: torch.Tensor, dim: int, axis: int) -> torch.Tensor:
        self._note("reduce_scatter", tensor, axis)
        return self.inner.reduce_scatter(tensor, dim, axis)  # type: ignore[no-any-return]

    def all_to_all(self, tensor: torch.Tensor, split: int, concat: int, axis: int) -> Any:
        self._note("all_to_all", tensor, axis)
        return self.inner.all_to_all(tensor, split, concat, axis)

    def all_to_all_rows(self, tensor: torch.Tensor, send: Any, receive: Any, axis: int) -> Any:
        self._note("all_to_all_rows", tensor, axis)
        return self.inner.all_to_all_rows(tensor, send, receive, axis)

    def start_all_reduce(self, flat: torch.Tensor, axis: int) -> Any:
        self._note("all_reduce", flat, axis)
        return self.inner.start_all_reduce(flat, axis)

    def start_reduce_scatter(self, output: torch.Tensor, flat: torch.Tensor, axis: int) -> Any:
        self._note("reduce_scatter", flat, axis)
        return self.inner.start_reduce_scatter(output, flat, axis)

    def start_all_gather(self, output: torch.Tensor, flat: torch.Tensor, axis: int) -> Any:
        self._note("all_gather", flat, axis)
        return self.inner.start_all_gather(output, flat, axis)


EXCHANGES = ("all_to_all", "all_to_all_rows")


def test_a_dispatched_plan_lists_its_all_to_alls_in_the_collective_schedule() -> None:
    """A two-layer Qwen2-MoE dispatched on (2, 2): per MoE layer, the collective schedule
    (``lower(plan).collectives()``) lists one count exchange at its routing sort (an
    all-to-all of its experts' counts) and one variable-size all-to-all per boundary (three
    dispatches and three combines, half of them in the backward), all on the expert axis, in
    graph order; the plan report counts them in their layer; the rank programs make every
    collective through the schedule's calls (no other call is handed the communicator); and
    the simulated devices run exactly those collectives, the counts' bytes as recorded and
    the rows as many bytes over the devices as the records say (a token dispatched to
    ``top_k`` experts is sent ``top_k`` times, and recorded once)."""
    from fxpar.lowering import collective_calls
    from fxpar.planning.moe_blocks import COUNT_BYTES, find_blocks
    from fxpar.planning.report import plan_collectives, report_data
    from fxpar.testing.simulate import run_ranks

    model = qwen2_moe(layers=2)
    manual = functools.partial(plans.expert_parallel, dispatch="all_to_all")
    plan = plan_program(fxpar.capture(model, _inputs()), Cluster((2, 2)), manual=manual)
    spmd = fxpar.lower(plan)
    records = spmd.collectives()
    assert records == plan_collectives(plan.program, plan.cluster)
    blocks, _ = find_blocks(plan.program.graph)
    assert len(blocks) == 2
    nodes = {node.name: node for node in plan.program.graph.nodes}
    order = {node: position for position, node in enumerate(plan.program.graph.nodes)}
    exchanged = [r for r in records if r.kind in EXCHANGES]
    assert len(exchanged) == 2 * 7
    for block in blocks:
        mine = [r for r in exchanged if nodes[r.consumer] in block.nodes()]
        (counts,) = [r for r in mine if r.kind == "all_to_all"]
        assert (counts.consumer, counts.tensor) == (block.sort.name, block.expert_ids.name)
        assert counts.bytes == block.num_experts * COUNT_BYTES
        assert counts.phase is ir.Phase.FORWARD
        rows = [r for r in mine if r.kind == "all_to_all_rows"]
        kinds = [block.boundaries[nodes[r.consumer]][0] for r in rows]
        assert sorted(kinds) == sorted(["dispatch_tokens", "dispatch", "dispatch", "combine",
                                        "combine", "combine_tokens"])  # fmt: skip
        assert [r.phase for r in rows].count(ir.Phase.BACKWARD) == 3
        assert all(r.axis == 0 for r in mine)
        for record in rows:
            moved = block.boundaries[nodes[record.consumer]][1]
            assert record.tensor == moved.name
            assert record.bytes == ir.require(moved, ir.ValueMeta).tensor.nbytes // 4
    # In the order the programs run them: graph order.
    positions = [order[nodes[r.consumer]] for r in exchanged]
    assert positions == sorted(positions)

    data = report_data(plan)
    assert data["header"]["collectives"] == len(records)
    for index in range(2):
        (layer,) = [row for row in data["layers"] if row["name"] == f"model.layers.{index}"]
        counted = {(c["kind"], c["axis"]): c["count"] for c in layer["collectives"]}
        assert counted[("all_to_all", 0)] == 1 and counted[("all_to_all_rows", 0)] == 6
    assert "6 A2Av(axis0)" in plan.report() and "A2Av all-to-all of routed rows" in plan.report()

    for rank in spmd.ranks:
        graph = rank.graph_module.graph
        (comm,) = [n for n in graph.nodes if n.op == "placeholder" and n.name == "comm"]
        assert {user.target for user in comm.users} <= {
            *collective_calls.COLLECTIVE_FUNCTIONS,
            collective_calls.wait_bucket,
        }
        made = [n for n in graph.nodes if n.target is collective_calls.exchange_rows]
        assert len(made) == 12 and all(n.args[3] == 0 for n in made)
        made = [n for n in graph.nodes if n.target is collective_calls.exchange_counts]
        assert len(made) == 2 and all(n.args[2] == 0 for n in made)

    def run(module: Any, comm: Any, local: list[torch.Tensor]) -> list[tuple[str, int, int]]:
        counting = _Counting(comm)
        module(counting, *local)
        return counting.calls

    flat = plan.program.flat_inputs(model, *_inputs().values())
    ran = list(run_ranks(spmd, flat, run).values())
    kind_of = {n.name: kind for b in blocks for n, (kind, _) in b.boundaries.items()}
    for calls in ran:
        assert sorted(call[:2] for call in calls) == sorted((r.kind, r.axis) for r in records)
        done = [call for call in calls if call[0] in EXCHANGES]
        assert [call[:2] for call in done] == [(r.kind, r.axis) for r in exchanged]
        for (_, _, nbytes), record in zip(done, exchanged, strict=True):
            if record.kind == "all_to_all":
                assert nbytes == record.bytes
    sent = [
        sum(nbytes for _, _, nbytes in column)
        for column in zip(*([c for c in calls if c[0] in EXCHANGES] for calls in ran), strict=True)
    ]
    for nbytes, record in zip(sent, exchanged, strict=True):
        if record.kind == "all_to_all_rows":
            copies = 2 if kind_of[record.consumer] == "dispatch_tokens" else 1  # top_k
            assert nbytes == copies * 4 * record.bytes, kind_of[record.consumer]
