"""torchtitan's DeepSeek-V3, in a tiny config (a dense first layer, then a mixture-of-experts
layer with a shared expert; multi-head latent attention), trains like one device under data
parallelism, fully sharded, the ILP's plan and expert parallelism, on (2,) and (2, 2) meshes
in the simulator; so it does when every token is routed to one expert; every strategy of its
routing's scatter-add (fxpar/rules/routing.py) computes the op; its MoE block is found
(fxpar/planning/moe_blocks.py) and its tokens dispatched by all-to-all train like one device
too; and on gloo processes expert parallelism trains like eager PyTorch.

torchtitan 0.3.0 declares heavy dependencies it does not import for its models (wandb,
tensorboard, datasets, torchdata): README's test command installs it with ``--no-deps``, beside
the few it does import (tests/requirements-no-deps.txt). In an environment without them this
file skips, except under CI (``CI`` set), where a skip would hide a gap in that install.

What the tiny model avoids, on purpose:

- torchtitan's language-model attention backends are flex attention (a higher-order op with
  mask functions, which capture does not take), flex-flash and varlen (CUDA kernels). MLA's
  inner attention here is torchtitan's own ``ScaledDotProductAttention`` (causal), the one its
  Flux model builds: everything else in MLA (low-rank KV, the split rope/no-rope heads, complex
  rotary embeddings) is DeepSeek-V3's.
- torchtitan's MoE module imports MinimalAsyncEP (a CUDA token dispatcher written in triton)
  when it loads; the single-device dispatcher used here never calls it. Where triton is not
  installed (1 GB, with no use on a CPU), a module whose functions refuse to run stands in for
  MinimalAsyncEP's.

The experts are torchtitan's: bf16 ``aten._grouped_mm`` products (its CPU kernel) with fp32
master weights. The plans here keep each row's product whole on one device, which so computes
the same bf16 products as a single device: the ranks' step is compared with the captured step
on one device to float32's reassociation, and the captured step with eager PyTorch.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
import types
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard

import fxpar
from fxpar import ir, plans
from fxpar.cluster import Cluster
from fxpar.lowering.expert_dispatch import DISPATCH_CALLS
from fxpar.passes import plan_program
from fxpar.planning.moe_blocks import find_blocks
from fxpar.planning.propagate import expert_weights
from fxpar.rules import RuleRegistry, coverage, experts, routing
from fxpar.runtime.launch import spawn
from fxpar.sharding import Sharding
from fxpar.testing import assert_equivalent, validate_rules
from fxpar.testing.simulate import record_values

if os.environ.get("CI"):  # README's install has them: a skip would hide a broken install
    importlib.import_module("torchtitan")
    importlib.import_module("spmd_types")
pytest.importorskip("torchtitan")
pytest.importorskip("spmd_types")

ASYNC_EP = "torchtitan.distributed.minimal_async_ep"
ASYNC_EP_FUNCTIONS = (
    "combine_op", "dispatch_op", "init_buffer", "maybe_update_minimal_async_ep_config",
)  # fmt: skip


def _stand_in_for_async_ep() -> None:
    """Without triton, a module for MinimalAsyncEP whose functions refuse to run."""
    if importlib.util.find_spec("triton") is not None or ASYNC_EP in sys.modules:
        return

    def needs_triton(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("torchtitan's MinimalAsyncEP needs triton and CUDA")

    module = types.ModuleType(ASYNC_EP)
    for name in ASYNC_EP_FUNCTIONS:
        setattr(module, name, needs_triton)
    metadata = "MinimalAsyncEPDispatchMetadata"  # a type the dispatchers name in annotations
    setattr(module, metadata, type(metadata, (), {}))
    sys.modules[ASYNC_EP] = module


_stand_in_for_async_ep()
deepseek_v3 = pytest.importorskip("torchtitan.models.deepseek_v3")
common = pytest.importorskip("torchtitan.models.common")
attention = pytest.importorskip("torchtitan.models.common.attention")

VOCAB = 64
DIM = 32
EXPERTS = 4
MESHES = [(2,), (2, 2)]

pytestmark = pytest.mark.filterwarnings("ignore:In CPU autocast:UserWarning")  # torchtitan's router


def deepseek(top_k: int = 2) -> nn.Module:
    """DeepSeek-V3's layers at toy sizes: one dense layer, one MoE layer of four routed experts
    (top-``top_k``, softmax scores) and one shared expert, MLA without the query's low rank."""
    rope = common.ComplexRoPE.Config(dim=8, max_seq_len=64, theta=10000.0)
    layers = deepseek_v3._build_dsv3_layers(
        n_layers=2, n_dense_layers=1, dim=DIM, n_heads=2, q_lora_rank=0, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, mscale=1.0, dense_hidden_dim=64,
        moe_hidden_dim=16, num_experts=EXPERTS, num_shared_experts=1, router_top_k=top_k,
        router_score_func="softmax", attn_backend="flex", moe_comm_backend="standard",
        non_blocking_capacity_factor=None, rope=rope,
    )  # fmt: skip
    for layer in layers:
        layer.attention.inner_attention = attention.ScaledDotProductAttention.Config()
    config = deepseek_v3.DeepSeekV3Model.Config(
        vocab_size=VOCAB, dim=DIM,
        tok_embeddings=common.Embedding.Config(
            num_embeddings=VOCAB, embedding_dim=DIM, param_init=deepseek_v3._EMBEDDING_INIT
        ),
        norm=common.RMSNorm.Config(normalized_shape=DIM, param_init=deepseek_v3._NORM_INIT),
        lm_head=common.Linear.Config(
            in_features=DIM, out_features=VOCAB, param_init=deepseek_v3._output_linear_init(DIM)
        ),
        layers=layers,
    )  # fmt: skip
    model = config.build()
    model.init_states()
    return model


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, 8), generator=torch.Generator().manual_seed(3))


def _capture(model: nn.Module) -> fxpar.Program:
    tokens = _tokens()
    return fxpar.capture(model, (tokens,), loss_fn, example_targets=(tokens,))


@pytest.fixture(scope="module")
def captured() -> tuple[nn.Module, fxpar.Program]:
    torch.manual_seed(0)
    model = deepseek()
    return model, _capture(model)


def _flat(program: fxpar.Program, model: nn.Module) -> list[torch.Tensor]:
    return program.flat_inputs(model, _tokens(), _tokens())


def _grouped_products(program: fxpar.Program) -> list[Any]:
    return [n for n in program.graph.nodes if experts.is_grouped_product(n.target)]


def _splits_experts(program: fxpar.Program, node: Any, axis: int = 0) -> bool:
    strategy = ir.require(node, Sharding).strategy
    spec = experts.experts_spec(fxpar.rules.op_call(node, program.cluster.mesh_shape), strategy)
    return spec is not None and spec[axis] == Shard(0)


ALL_TO_ALL = functools.partial(plans.expert_parallel, dispatch="all_to_all")
LOCAL_CALLS = (experts.local_experts_grouped_mm, experts.local_experts_weight_grad)


def _dispatch_calls(spmd: Any) -> list[str]:
    """The expert-dispatch calls of rank 0's program, by name."""
    graph = spmd.ranks[0].graph_module.graph
    return sorted(n.target.__name__ for n in graph.nodes if n.target in DISPATCH_CALLS)


def test_the_captured_step_is_eager_pytorchs(captured: tuple[nn.Module, fxpar.Program]) -> None:
    """The captured step computes eager PyTorch's loss and gradients; its experts are bf16
    grouped products (three forward, six backward), and only constants (the causal mask's
    ``ones`` and ``tril``, scalars) are left without a sharding rule: the routing's scatter-add
    has one."""
    model, program = captured
    products = _grouped_products(program)
    assert {n.target for n in products} == {torch.ops.aten._grouped_mm.default}
    assert len(products) == 9
    fallback = set(coverage(program).fallback)
    assert fallback <= {"aten.ones.default", "aten.tril.default", "aten.scalar_tensor.default"}
    assert routing.torchtitan_scatter_add() is not None
    expected = program.signature.name_outputs(program(*_flat(program, model)))
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model(_tokens()), _tokens())
    loss.backward()
    torch.testing.assert_close(expected.outputs[0], loss.detach(), rtol=1e-5, atol=0.0)
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None, name
        torch.testing.assert_close(expected.gradients[name], parameter.grad, msg=name)


PLANS = {
    "data_parallel": plans.data_parallel,
    "fully_sharded": plans.fully_sharded,
    "expert_parallel": plans.expert_parallel,
    "ilp": None,
}


@pytest.mark.parametrize("mesh", MESHES, ids=["2", "2x2"])
@pytest.mark.parametrize("plan", list(PLANS))
def test_deepseek_trains_like_one_device(
    captured: tuple[nn.Module, fxpar.Program], plan: str, mesh: tuple[int, ...]
) -> None:
    """Each plan lowers to ranks whose step equals one device's; under expert parallelism the
    routed experts' three weights are split by expert on axis 0 (the shared expert, the router
    and the dense layer are not), every grouped product computes only its device's experts
    there, and the batch is split on axis 1."""
    model, program = captured
    manual = PLANS[plan]
    planned = plan_program(program, Cluster(mesh), manual=manual)
    flat = _flat(planned.program, model)
    if plan == "expert_parallel":
        weights = expert_weights(planned.program)
        assert sorted(weights) == [f"layers.1.moe.routed_experts.inner_experts.{w}" for w in (
            "w1_EFD", "w2_EDF", "w3_EFD")]  # fmt: skip
        products = _grouped_products(planned.program)
        assert all(_splits_experts(planned.program, n) for n in products)
        specs = {
            name: ir.require(node, Sharding).strategy.outputs[0]
            for name, node in planned.program.placeholders().items()
        }
        for weight in weights:
            assert specs[weight] == (Shard(0), *(Replicate(),) * (len(mesh) - 1))
        if len(mesh) == 2:
            assert specs["input_0"] == (Replicate(), Shard(0))
    spmd = fxpar.lower(planned)
    assert_equivalent(spmd, flat, rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def one_expert() -> tuple[nn.Module, fxpar.Program]:
    """Top-1 routing with equal scores for every expert: ties are broken alike every time, so
    every token goes to the same expert."""
    torch.manual_seed(0)
    model = deepseek(top_k=1)
    with torch.no_grad():
        model.layers["1"].moe.router.gate.weight.zero_()
    return model, _capture(model)


@pytest.mark.parametrize("dispatch", ["all_reduce", "all_to_all"])
@pytest.mark.parametrize("mesh", MESHES, ids=["2", "2x2"])
def test_all_tokens_routed_to_one_expert(
    one_expert: tuple[nn.Module, fxpar.Program], mesh: tuple[int, ...], dispatch: str
) -> None:
    """Every token routed to one expert: under expert parallelism one device computes every
    row, the other none (with the tokens dispatched by all-to-all, it receives none), and
    the step is still one device's."""
    model, program = one_expert
    flat = _flat(program, model)
    values = record_values(program.graph_module, flat)
    offsets = values[_grouped_products(program)[0].args[2].name]
    counts = torch.diff(offsets, prepend=offsets.new_zeros(1)).tolist()
    assert sorted(counts) == [0, 0, 0, 32], counts  # 4 x 8 tokens, all on one expert
    manual = functools.partial(plans.expert_parallel, dispatch=dispatch)
    planned = plan_program(program, Cluster(mesh), manual=manual)
    assert all(_splits_experts(planned.program, n) for n in _grouped_products(planned.program))
    spmd = fxpar.lower(planned)
    assert ("route" in _dispatch_calls(spmd)) == (dispatch == "all_to_all")
    assert_equivalent(spmd, flat, rtol=1e-4, atol=1e-5)


def test_deepseeks_moe_block_is_found(captured: tuple[nn.Module, fxpar.Program]) -> None:
    """torchtitan's routing (a stable argsort of the top-k ids, no inverse permutation,
    offsets counted from the top-k ids) is one MoE block: the routing weights and tokens
    dispatched (the tokens' output gradient too, by a gather along an expanded index), the
    rows combined back to tokens by the deterministic scatter-add (and the backward's
    index_put), the routing weights' gradient combined to slots; every grouped product is
    inside, and the counts, which also feed the tokens-per-expert buffer, stay outside."""
    _, program = captured
    blocks, refused = find_blocks(program.graph)
    assert refused == [] and len(blocks) == 1
    (block,) = blocks
    assert (block.num_experts, block.top_k) == (EXPERTS, 2)
    assert block.sort.target is torch.ops.aten.sort.stable
    kinds = {node.target: kind for node, (kind, _) in block.boundaries.items()}
    assert kinds[routing.torchtitan_scatter_add()] == "combine_tokens"
    assert kinds[torch.ops.aten.gather.default] == "dispatch_tokens"
    assert sorted(kind for kind, _ in block.boundaries.values()) == [
        "combine", "combine_tokens", "combine_tokens", "dispatch", "dispatch_tokens",
        "dispatch_tokens",
    ]  # fmt: skip
    assert set(_grouped_products(program)) <= set(block.region)
    (counts,) = block.offsets.all_input_nodes
    assert counts not in block.nodes() and len(counts.users) == 2


@pytest.mark.parametrize("mesh", MESHES, ids=["2", "2x2"])
def test_deepseek_tokens_dispatched_by_all_to_all(
    captured: tuple[nn.Module, fxpar.Program], mesh: tuple[int, ...]
) -> None:
    """The batch split over every axis, each device's rows sent to their experts' devices
    and back: one route, three dispatches and three combines per rank, grouped products on
    the rows received (no local call), and the step one device's."""
    model, program = captured
    planned = plan_program(program, Cluster(mesh), manual=ALL_TO_ALL)
    tokens = planned.program.placeholders()["input_0"]
    assert ir.require(tokens, Sharding).strategy.outputs[0] == (Shard(0),) * len(mesh)
    spmd = fxpar.lower(planned)
    assert _dispatch_calls(spmd) == sorted([
        "route", "dispatch", "dispatch_tokens", "dispatch_tokens", "combine", "combine_tokens",
        "combine_tokens",
    ])  # fmt: skip
    graph = spmd.ranks[0].graph_module.graph
    assert not any(n.target in LOCAL_CALLS for n in graph.nodes)
    assert_equivalent(spmd, _flat(planned.program, model), rtol=1e-4, atol=1e-5)


class ScatterRows(nn.Module):
    """The scatter-add alone, into tokens that are not zeros (in the model they are, which
    would hide a rule that counts ``out`` once per device)."""

    def __init__(self) -> None:
        super().__init__()
        self.rows = nn.Parameter(torch.randn(6, 8))

    def forward(self, tokens: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        scatter_add = routing.torchtitan_scatter_add()
        rows = index.unsqueeze(1).expand(-1, 8)
        return scatter_add(tokens, rows, self.rows * 2.0)  # type: ignore[operator]


def test_every_strategy_of_the_routing_scatter_add_computes_it(
    captured: tuple[nn.Module, fxpar.Program],
) -> None:
    """torchtitan's deterministic scatter-add, split along the features or summed from
    partial rows (a grouped product's output with its experts split), on 1-D and 2-D meshes,
    matches the op on whole tensors, in the model and alone on tokens that are not zeros;
    the partial option is among those offered."""
    rules = RuleRegistry()
    routing.register(rules)
    model, program = captured
    (node,) = [n for n in program.graph.nodes if n.target is routing.torchtitan_scatter_add()]
    offered = rules.strategies(fxpar.rules.op_call(node, (2,)))
    assert any(s.outputs[0] == (Partial(),) for s in offered)
    assert any(s.outputs[0] == (Shard(1),) for s in offered)
    alone = ScatterRows()
    inputs = (torch.randn(4, 8), torch.tensor([0, 3, 3, 1, 0, 2]))
    program_alone = fxpar.capture(alone, inputs, lambda out: (out * out).sum())
    for mesh in MESHES:
        assert validate_rules(program, _flat(program, model), Cluster(mesh), rules) == []
        flat = program_alone.flat_inputs(alone, *inputs)
        assert validate_rules(program_alone, flat, Cluster(mesh), rules) == []


# -- real processes ------------------------------------------------------------------------------

STEPS = 3
LR = 0.1


def _eager_training() -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = deepseek()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = loss_fn(model(_tokens()), _tokens())
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, model.state_dict()


def _train_expert_parallel(
    rank: int, world_size: int, mesh: tuple[int, ...]
) -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    parallel = fxpar.compile(
        deepseek(), Cluster(mesh), (_tokens(),), loss_fn, example_targets=(_tokens(),),
        optimizer=fxpar.optim.SGD(lr=LR), manual=plans.expert_parallel,
    )  # fmt: skip
    losses = [parallel.step(_tokens(), _tokens()).item() for _ in range(STEPS)]
    return losses, parallel.full_state_dict()


@pytest.mark.slow
def test_expert_parallel_trains_on_gloo_like_eager() -> None:
    """Three SGD steps of DeepSeek-V3 with its experts split over 2 and the batch over 2 gloo
    processes: every rank's losses and full weights equal eager PyTorch's (to bf16's rounding
    of the experts)."""
    expected_losses, expected_state = _eager_training()
    for losses, state in spawn(_train_expert_parallel, 4, (2, 2)):
        assert losses == pytest.approx(expected_losses, rel=1e-4)
        persistent = {name: state[name] for name in expected_state}
        torch.testing.assert_close(persistent, expected_state, rtol=1e-4, atol=1e-5)
