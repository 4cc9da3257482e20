"""The manual plans (data, tensor and fully sharded parallelism) plan, lower and train exactly
like one device on a zoo of real model families: Hugging Face decoder LMs (dense and
mixture-of-experts), encoder-decoders, a vision transformer, and a CNN with BatchNorm. Most of
the Hugging Face graphs hold tensor constants (``get_attr`` nodes), which the manual plans once
could not propagate through. Mixtral's experts also split inside each expert, Megatron-style,
through the sharding rules of its grouped products. And each Hugging Face model, cut into two
pipeline stages on meshes of different shapes, (1,) and (2,), trains like eager PyTorch."""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_bf16_step_close, microbatch_program, on_test_device
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from zoo import CNN

import fxpar
from fxpar import ir, plans
from fxpar.cluster import Cluster
from fxpar.ir.program import named_state
from fxpar.lowering import SPMDProgram
from fxpar.passes import plan_program
from fxpar.pipeline import partition, split_program
from fxpar.rules import coverage
from fxpar.sharding import Sharding, Spec
from fxpar.testing import assert_equivalent
from fxpar.testing.pipeline import simulate_stage_meshes

transformers = pytest.importorskip("transformers")

VOCAB = 64
BATCH = 4  # one sample per rank on the (2, 2) mesh

# One set of module-name patterns for the whole zoo: attention and MLP input projections (and
# MoE experts, split by expert) by output features, output projections by input features.
COLUMN = (
    "*.q_proj", "*.k_proj", "*.v_proj", "*.gate_proj", "*.up_proj", "*.experts", "*.fc1",
    "*.q", "*.k", "*.v", "*.wi", "*.c_attn", "*.c_fc", "features.0",
)  # fmt: skip
ROW = ("*.o_proj", "*.out_proj", "*.down_proj", "*.fc2", "*.o", "*.wo", "*.c_proj", "classifier")

ManualPlan = Callable[[fxpar.Program, Cluster], fxpar.Program]
PLANS: dict[str, ManualPlan] = {
    "data_parallel": plans.data_parallel,
    "tensor_parallel": functools.partial(plans.tensor_parallel, column=COLUMN, row=ROW),
    "fully_sharded": plans.fully_sharded,
}


class Case:
    """A model with its example batch: ``capture(model, inputs, loss_fn, targets)``."""

    def __init__(
        self,
        model: nn.Module,
        inputs: dict[str, torch.Tensor] | tuple[torch.Tensor, ...],
        loss_fn: Callable[..., torch.Tensor] | None = None,
        targets: tuple[torch.Tensor, ...] = (),
    ) -> None:
        self.model, self.inputs, self.loss_fn, self.targets = model, inputs, loss_fn, targets

    def capture(self) -> fxpar.Program:
        return fxpar.capture(self.model, self.inputs, self.loss_fn, example_targets=self.targets)

    def flat_inputs(self, program: fxpar.Program) -> list[torch.Tensor]:
        values: Any = self.inputs.values() if isinstance(self.inputs, dict) else self.inputs
        return on_test_device(program.flat_inputs(self.model, *values, *self.targets))


def _tokens(length: int = 8) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, length))


def _causal_lm(model: nn.Module) -> Case:
    tokens = _tokens()
    return Case(model, {"input_ids": tokens, "labels": tokens})


def _seq2seq(model: nn.Module) -> Case:
    return Case(model, {"input_ids": _tokens(), "labels": _tokens(length=6)})


DECODER = dict(
    vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
    num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16,
)  # fmt: skip


def llama() -> Case:
    return _causal_lm(transformers.LlamaForCausalLM(transformers.LlamaConfig(**DECODER)))


def mixtral() -> Case:
    config = transformers.MixtralConfig(**DECODER, num_local_experts=4, num_experts_per_tok=2)
    return _causal_lm(transformers.MixtralForCausalLM(config))


def qwen2_moe() -> Case:
    config = transformers.Qwen2MoeConfig(
        **DECODER, moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4,
        num_experts_per_tok=2,
    )  # fmt: skip
    return _causal_lm(transformers.Qwen2MoeForCausalLM(config))


def gpt2() -> Case:
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return _causal_lm(transformers.GPT2LMHeadModel(config))


def t5() -> Case:
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1,
        num_heads=2, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return _seq2seq(transformers.T5ForConditionalGeneration(config))


def bart() -> Case:
    config = transformers.BartConfig(
        vocab_size=VOCAB, d_model=16, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
        decoder_ffn_dim=32, max_position_embeddings=32, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0,
    )  # fmt: skip
    return _seq2seq(transformers.BartForConditionalGeneration(config))


def vit() -> Case:
    config = transformers.ViTConfig(
        image_size=8, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=1,
        num_attention_heads=2, intermediate_size=32, num_labels=3, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    images, labels = torch.randn(BATCH, 3, 8, 8), torch.randint(0, 3, (BATCH,))
    return Case(
        transformers.ViTForImageClassification(config), {"pixel_values": images, "labels": labels}
    )


def cnn() -> Case:
    images, labels = torch.randn(BATCH, 3, 8, 8), torch.randint(0, 10, (BATCH,))
    return Case(CNN(), (images,), F.cross_entropy, (labels,))


ZOO: dict[str, Callable[[], Case]] = {
    "llama": llama,
    "mixtral": mixtral,
    "qwen2_moe": qwen2_moe,
    "gpt2": gpt2,
    "t5": t5,
    "bart": bart,
    "vit": vit,
    "cnn": cnn,
}


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("model", list(ZOO))
def test_manual_plan_trains_like_one_device(model: str, plan: str) -> None:
    case = ZOO[model]()
    program = case.capture()
    cluster = Cluster((2, 2))
    planned = plan_program(program, cluster, manual=PLANS[plan])  # scored by the cost model too
    spmd = fxpar.lower(planned)
    assert_equivalent(spmd, case.flat_inputs(program))
    if plan != "data_parallel":  # the plan really splits weights, not only the batch
        parameters = set(program.signature.parameters)
        placeholders = program.placeholders()
        split = [
            name
            for name, spec in zip(placeholders, spmd.input_specs, strict=True)
            if name in parameters and any(isinstance(p, Shard) for p in spec)
        ]
        assert split, f"{plan} split no parameter of {model}"


@pytest.mark.parametrize(
    ("model", "column", "row"),
    [
        # nn.Linear stores (out, in); GPT-2's Conv1D stores (in, out) and multiplies x @ w.
        ("llama", "model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.down_proj.weight"),
        ("gpt2", "transformer.h.0.mlp.c_fc.weight", "transformer.h.0.mlp.c_proj.weight"),
    ],
)
def test_tensor_parallel_splits_each_weight_by_its_features(
    model: str, column: str, row: str
) -> None:
    """Megatron's layout whichever way a module stores its weight: a column-parallel weight is
    split by output features, a row-parallel one by input features, so the MLP's hidden
    activation stays split between the two and only the row output is summed. (GPT-2's
    Conv1D weights were split on the wrong dims, which sharded the first product's input and
    summed its whole output.)"""
    from fxpar.planning.propagate import output_feature_dim

    case = ZOO[model]()
    program = case.capture()
    placeholders = program.placeholders()
    stored_out_first = model == "llama"
    assert output_feature_dim(placeholders[column]) == (0 if stored_out_first else 1)
    cluster = Cluster((2, 2))
    planned = plan_program(program, cluster, manual=plans.tensor_parallel).program
    placed = planned.placeholders()
    specs = {name: ir.require(node, Sharding).strategy.outputs[0] for name, node in placed.items()}
    out_dim = 0 if stored_out_first else 1
    assert specs[column] == (Replicate(), Shard(out_dim))
    assert specs[row] == (Replicate(), Shard(1 - out_dim))
    # The column product's output (the hidden activation) is split by features on the
    # tensor-parallel axis: no partial sum to reduce after it.
    node = placed[column]
    products = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
    while node.target not in products:
        node = min(node.users, key=list(planned.graph.nodes).index)
    features = len(ir.require(node, ir.ValueMeta).tensor.shape) - 1
    assert ir.require(node, Sharding).strategy.outputs[0][1] == Shard(features)


def test_the_zoo_covers_graphs_with_tensor_constants() -> None:
    """Guards the test above: the families that broke the manual plans still hold constants."""
    with_constants = [
        name
        for name in ZOO
        if any(node.op == "get_attr" for node in ZOO[name]().capture().graph.nodes)
    ]
    assert with_constants == ["llama", "mixtral", "qwen2_moe", "gpt2", "t5", "bart"]


# Mixtral's experts hold gate_up_proj (E, 2I, H) and down_proj (E, H, I), used transposed by
# grouped products: transformers' custom ops with fp32 weights, aten._grouped_mm with bf16.
GROUPED_PRODUCTS = {
    torch.float32: (
        "transformers.grouped_mm_fallback.default",
        "transformers.grouped_mm_fallback_backward.default",
    ),
    torch.bfloat16: ("aten._grouped_mm.default",),
}
EXPERT_SPLITS = {"*.experts.gate_up_proj": Shard(1), "*.experts.down_proj": Shard(2)}


def _mixtral(dtype: torch.dtype) -> tuple[Case, fxpar.Program]:
    case = mixtral()
    case.model.to(dtype)
    return case, case.capture()


def _on_last_axis(cluster: Cluster, placement: Shard | Replicate) -> Spec:
    return (*(Replicate(),) * (cluster.ndim - 1), placement)


def split_inside_experts(program: fxpar.Program, cluster: Cluster) -> fxpar.Program:
    """Megatron-style inside every expert on the last mesh axis: gate_up_proj split by output
    features, down_proj by input features; the batch split on the other axes; every other
    parameter replicated."""
    program = plans.prepare(program, cluster)
    batch = tuple(Replicate() if a == cluster.ndim - 1 else Shard(0) for a in range(cluster.ndim))

    def choose(name: str, meta: ir.TensorMeta) -> Spec:
        if name in program.signature.inputs:
            return batch
        split = [p for pattern, p in EXPERT_SPLITS.items() if fnmatch.fnmatch(name, pattern)]
        return _on_last_axis(cluster, split[0] if split else Replicate())

    return plans.propagate(program, cluster, choose)


def _expert_weights_split(program: fxpar.Program, spmd: SPMDProgram) -> list[str]:
    experts = [n for n in program.signature.parameters if ".experts." in n]
    specs = dict(zip(program.placeholders(), spmd.input_specs, strict=True))
    return [n for n in experts if any(isinstance(p, Shard) for p in specs[n])]


@pytest.mark.parametrize("dtype", list(GROUPED_PRODUCTS), ids=["fp32", "bf16"])
def test_mixtral_grouped_products_have_sharding_rules(dtype: torch.dtype) -> None:
    _, program = _mixtral(dtype)
    called = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert set(GROUPED_PRODUCTS[dtype]) <= called, "Mixtral no longer calls these products"
    report = coverage(program)
    assert not set(GROUPED_PRODUCTS[dtype]) & set(report.fallback), str(report)


@pytest.mark.parametrize("mesh", [(2,), (2, 2)], ids=["1d", "2d"])
def test_mixtral_split_inside_experts_trains_like_one_device(mesh: tuple[int, ...]) -> None:
    """The manual plan splits both expert weights, and every grouped product (forward and
    backward of both projections) runs on its pieces, none replicated."""
    case, program = _mixtral(torch.float32)
    cluster = Cluster(mesh)
    planned = plan_program(program, cluster, manual=split_inside_experts)
    spmd = fxpar.lower(planned)
    assert_equivalent(spmd, case.flat_inputs(program))
    assert len(_expert_weights_split(program, spmd)) == 2
    grouped = [
        ir.require(n, Sharding).strategy
        for n in planned.program.graph.nodes
        if str(n.target) in GROUPED_PRODUCTS[torch.float32]
    ]
    assert len(grouped) == 4
    gathered = [s for s in grouped if all(p == Replicate() for p in s.inputs[1])]
    assert gathered == [], "a grouped product gathered its expert weight"


@pytest.mark.parametrize("mesh", [(2,), (2, 2)], ids=["1d", "2d"])
def test_mixtral_with_expert_weights_pinned_split_trains_like_one_device(
    mesh: tuple[int, ...],
) -> None:
    """The solver's plan with both expert weights pinned split inside each expert."""
    case, program = _mixtral(torch.float32)
    cluster = Cluster(mesh)
    pins = {pattern: _on_last_axis(cluster, p) for pattern, p in EXPERT_SPLITS.items()}
    spmd = fxpar.lower(plan_program(program, cluster, pins=pins))
    assert_equivalent(spmd, case.flat_inputs(program))
    assert len(_expert_weights_split(program, spmd)) == 2


def test_bf16_mixtral_split_inside_experts_trains_like_one_device() -> None:
    """The same plan through aten._grouped_mm. bf16 sums the pieces in another order than the
    whole product, so each gradient is compared to its own scale (some are ~1e-4, below any
    absolute tolerance bf16 needs): a split that computes the wrong thing is off by tens of
    percent, bf16 rounding by about 1%."""
    case, program = _mixtral(torch.bfloat16)
    cluster = Cluster((2, 2))
    planned = plan_program(program, cluster, manual=split_inside_experts)
    spmd = fxpar.lower(planned)
    assert len(_expert_weights_split(program, spmd)) == 2
    assert any(
        ir.require(n, Sharding).strategy.outputs[0] != (Replicate(), Replicate())
        for n in planned.program.graph.nodes
        if n.target is torch.ops.aten._grouped_mm.default
    )
    flat = case.flat_inputs(program)
    assert_bf16_step_close(spmd, program, flat)


# Where the second stage begins, for a 2-stage pipeline of each Hugging Face model.
STAGE_SPLITS = [
    ("llama", "model.layers.0", "tensor_parallel"),
    ("mixtral", "model.layers.0", "tensor_parallel"),
    ("qwen2_moe", "model.norm", "tensor_parallel"),
    ("gpt2", "transformer.h.0", "tensor_parallel"),
    ("t5", "decoder", "tensor_parallel"),
    ("bart", "model.decoder", "tensor_parallel"),
    ("vit", "classifier", "tensor_parallel"),
    ("llama", "model.norm", "fully_sharded"),
]


@pytest.mark.parametrize(("model", "point", "plan"), STAGE_SPLITS)
def test_stages_on_meshes_of_different_shapes_train_like_eager(
    model: str, point: str, plan: str
) -> None:
    """Two stages on meshes (1,) and (2,) (each mesh shape under its own plan, the values
    crossing the boundary resharded between them), every device in a thread: the loss and
    every gradient of 2 micro-batches equal eager PyTorch's mean over them."""
    case = ZOO[model]()
    assert isinstance(case.inputs, dict) and not case.targets
    names = list(case.inputs)
    pieces, program = microbatch_program(case, 2)
    meshes = [(1,), (2,)]
    splits = []
    for shape in meshes:
        planned = PLANS[plan](program.copy(), Cluster(shape))
        splits.append(split_program(planned, partition(planned, (point,)), remat=False))
    state = named_state(case.model)
    result = simulate_stage_meshes(splits, [Cluster(shape) for shape in meshes], state, pieces)
    losses = [case.model(**dict(zip(names, piece, strict=True))).loss for piece in pieces]
    torch.stack(losses).mean().backward()
    torch.testing.assert_close(result.loss, torch.stack(losses).mean().detach())
    trained = {name: p for name, p in case.model.named_parameters() if p.grad is not None}
    assert result.gradients.keys() >= trained.keys()
    for name, parameter in trained.items():
        torch.testing.assert_close(result.gradients[name], parameter.grad, msg=name)
