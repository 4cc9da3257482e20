"""Pipeline stages follow the data flow on the Hugging Face zoo (Llama, Qwen2, Mistral, Gemma,
T5, BART, Whisper, ViT), with and without bf16 mixed precision: the stage DP's atoms are the same
under both (mixed precision casts every parameter before the first layer, in registration order,
and once dragged the rotary embedding after every layer reading it), every module of its chosen
split runs in the stage that lists it, no stage reads a value a later stage computes, and every
stage computes from the batch. A split point that would begin a stage inside another module, and
an assignment in which a stage reads a later stage's value, are refused with errors naming them.
A stage with no trainable parameter trains: the optimizers build over an empty parameter list,
and a Llama pipeline under mixed precision, its last stage the loss alone, trains on gloo like
one device; the stage DP's split of that Llama trains like eager PyTorch in one process.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.fx as fx
from torch import nn

import fxpar
from fxpar import ir
from fxpar.cluster import Cluster
from fxpar.ir.program import named_state
from fxpar.optim import SGD, AdamW
from fxpar.pipeline import Half, Partition, Pipeline, PipelineError, Unit, partition, split_program
from fxpar.pipeline.auto import StageChoice, plan_stages
from fxpar.pipeline.partition import StageOrderError, check_causal
from fxpar.runtime.launch import spawn

transformers = pytest.importorskip("transformers")

VOCAB = 64
BATCH = 8
BF16 = fxpar.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
# Links slow enough that the stage DP cuts every model into several stages.
CLUSTER = Cluster((4,), bandwidth=(1e7,))
DECODER = dict(
    vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=32,
)  # fmt: skip
SEQ2SEQ = dict(
    vocab_size=VOCAB, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
    decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, dropout=0.0,
)  # fmt: skip

Case = tuple[nn.Module, dict[str, torch.Tensor]]


def _tokens(length: int = 8, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, length), generator=torch.Generator().manual_seed(seed))


def _causal_lm(model: nn.Module) -> Case:
    tokens = _tokens()
    return model, {"input_ids": tokens, "labels": tokens}


def _seq2seq(model: nn.Module) -> Case:
    return model, {"input_ids": _tokens(), "labels": _tokens(length=6, seed=2)}


def llama() -> Case:
    return _causal_lm(transformers.LlamaForCausalLM(transformers.LlamaConfig(**DECODER)))


def qwen2() -> Case:
    return _causal_lm(transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**DECODER)))


def mistral() -> Case:
    return _causal_lm(transformers.MistralForCausalLM(transformers.MistralConfig(**DECODER)))


def gemma() -> Case:
    return _causal_lm(transformers.GemmaForCausalLM(transformers.GemmaConfig(**DECODER)))


def t5() -> Case:
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=2,
        num_heads=2, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return _seq2seq(transformers.T5ForConditionalGeneration(config))


def bart() -> Case:
    config = transformers.BartConfig(
        **SEQ2SEQ, max_position_embeddings=32, attention_dropout=0.0, activation_dropout=0.0
    )
    return _seq2seq(transformers.BartForConditionalGeneration(config))


def whisper() -> Case:
    config = transformers.WhisperConfig(
        **SEQ2SEQ, num_mel_bins=8, max_source_positions=8, max_target_positions=16,
        pad_token_id=0, decoder_start_token_id=1, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    features = torch.randn(BATCH, 8, 16, generator=torch.Generator().manual_seed(3))
    model = transformers.WhisperForConditionalGeneration(config)
    return model, {"input_features": features, "labels": _tokens(length=6)}


def vit() -> Case:
    config = transformers.ViTConfig(
        image_size=8, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=3,
        num_attention_heads=2, intermediate_size=32, num_labels=3, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    generator = torch.Generator().manual_seed(4)
    images = torch.randn(BATCH, 3, 8, 8, generator=generator)
    labels = torch.randint(0, 3, (BATCH,), generator=generator)
    model = transformers.ViTForImageClassification(config)
    return model, {"pixel_values": images, "labels": labels}


ZOO: dict[str, Callable[[], Case]] = {
    "llama": llama,
    "qwen2": qwen2,
    "mistral": mistral,
    "gemma": gemma,
    "t5": t5,
    "bart": bart,
    "whisper": whisper,
    "vit": vit,
}
DECODERS = ("llama", "qwen2", "mistral", "gemma")


@functools.cache
def _case(model: str) -> Case:
    torch.manual_seed(0)
    return ZOO[model]()


@functools.cache
def _program(model: str, mixed: bool) -> fxpar.Program:
    module, inputs = _case(model)
    return fxpar.capture(module, inputs, mixed_precision=BF16 if mixed else None)


def _depends_on_batch(program: fxpar.Program) -> set[fx.Node]:
    placeholders = program.placeholders()
    found = {placeholders[name] for name in program.signature.step_inputs}
    for node in program.graph.nodes:
        if any(arg in found for arg in node.all_input_nodes):
            found.add(node)
    return found


def _assert_stages_follow_data_flow(program: fxpar.Program, choice: StageChoice) -> Partition:
    """The choice's split, cut by partition: each forward op of a module the choice lists runs
    in the stage listing it; every unit reads only values of units that run before it (the
    forwards in stage order, then the backwards in reverse); every stage's forward computes
    from the batch."""
    parts = partition(program, choice.split_points)
    listed = {m: stage for stage, modules in enumerate(choice.stage_modules) for m in modules}
    for node, unit in parts.units.items():
        if unit.half is not Half.FORWARD:
            continue
        module = ir.require(node, ir.Region).module
        owners = [name for name in listed if module == name or module.startswith(name + ".")]
        if owners:
            owner = max(owners, key=len)
            assert unit.stage == listed[owner], (
                f"{node.name} of {module} runs in stage {unit.stage}, but the choice lists "
                f"{owner} in stage {listed[owner]}: {choice.stage_modules}"
            )

    last = parts.num_stages - 1

    def turn(unit: Unit) -> int:
        return unit.stage if unit.half is Half.FORWARD else 2 * last + 1 - unit.stage

    for node, unit in parts.units.items():
        for value in node.all_input_nodes:
            producer = parts.units.get(value)
            assert producer is None or turn(producer) <= turn(unit), (
                f"{unit} reads {value.name}, computed later by {producer}"
            )
    batch = _depends_on_batch(program)
    working = {u.stage for n, u in parts.units.items() if u.half is Half.FORWARD and n in batch}
    assert working == set(range(parts.num_stages)), choice.stage_modules
    return parts


@pytest.mark.parametrize("model", list(ZOO))
def test_stage_dp_split_follows_the_data_flow_with_and_without_mixed_precision(
    model: str,
) -> None:
    """The atoms (cut points) are the same in fp32 and under bf16 mixed precision, and in both
    the stage DP's split keeps every module in the stage that lists it, before every reader."""
    choices = {
        mixed: plan_stages(_program(model, mixed), CLUSTER, Pipeline(microbatches=2))
        for mixed in (False, True)
    }
    assert choices[True].cut_points == choices[False].cut_points
    for mixed, choice in choices.items():
        assert choice.pipeline.num_stages > 1, choice.report()
        _assert_stages_follow_data_flow(_program(model, mixed), choice)
        if model in DECODERS:
            # The rotary tables ride with the first layer, which reads them first.
            stage_of = {m: s for s, modules in enumerate(choice.stage_modules) for m in modules}
            assert stage_of["model.rotary_emb"] == stage_of["model.layers.0"]
            assert "model.rotary_emb" not in choice.cut_points


@pytest.mark.parametrize("mixed", [False, True])
def test_every_cut_point_of_llama_cuts_between_its_modules(mixed: bool) -> None:
    """Not only the DP's choice: cut at any one of Llama's cut points, every module listed
    before it runs wholly in stage 0 and every module from it on wholly in stage 1."""
    program = _program("llama", mixed)
    cut_points = plan_stages(program, CLUSTER, Pipeline(microbatches=2)).cut_points
    for index, point in enumerate(cut_points):
        parts = partition(program, (point,))
        for node, unit in parts.units.items():
            module = ir.require(node, ir.Region).module
            if unit.half is not Half.FORWARD:
                continue
            for other, position in zip(cut_points, range(len(cut_points)), strict=True):
                if module == other or module.startswith(other + "."):
                    assert unit.stage == int(position >= index), (point, node.name, module)


def test_split_point_inside_another_module_is_refused() -> None:
    """The rotary embedding computes from buffers alone and is first read inside the first
    layer's attention: a stage beginning there would begin inside that module."""
    for mixed in (False, True):
        with pytest.raises(PipelineError, match=r"'model\.rotary_emb'.*'model\.layers\.0"):
            partition(_program("llama", mixed), ("model.rotary_emb",))


def test_a_stage_reading_a_later_stage_is_refused() -> None:
    """An assignment moving a value to a later stage than a reader of it is refused, naming
    the value and both stages."""
    program = _program("llama", True)
    parts = partition(program, ("model.layers.1",))
    (embedding,) = (n for n in program.graph.nodes if n.target is torch.ops.aten.embedding.default)
    reader = Unit(Half.FORWARD, 0)
    moved = Unit(Half.FORWARD, 1)
    assert {parts.units[u] for u in embedding.users} == {reader}
    broken = Partition(parts.num_stages, parts.split_points, {**parts.units, embedding: moved})
    with pytest.raises(StageOrderError, match=r"stage 0.*'model\.layers\.1'") as caught:
        check_causal(program, broken)
    assert caught.value.value == embedding.name
    assert (caught.value.producer, caught.value.reader) == (moved, reader)
    assert embedding.name in str(caught.value)


@pytest.mark.parametrize("optimizer", [SGD(lr=0.1, momentum=0.9), AdamW()])
def test_optimizers_build_over_no_parameters(optimizer: Any) -> None:
    """A stage without trainable parameters gets an optimizer that steps over nothing and has
    the one parameter group (hyperparameters, state dict) every other stage has."""
    built = optimizer.build([])
    built.step()
    built.zero_grad()
    built.load_state_dict(built.state_dict())
    assert [group["params"] for group in built.param_groups] == [[]]
    assert built.param_groups[0]["lr"] == optimizer.lr


def _mixed_precision_step(
    model: nn.Module, inputs: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One eager step under the policy: fp32 masters, the forward on their bf16 casts."""
    masters = {n: p.detach().clone().requires_grad_() for n, p in model.named_parameters()}
    computed = {n: p.to(torch.bfloat16) for n, p in masters.items()}
    output = torch.func.functional_call(model, (computed, dict(model.named_buffers())), (), inputs)
    loss = output.loss.float()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in masters.items() if p.grad is not None}


def test_stage_dp_split_of_llama_under_mixed_precision_trains_like_eager() -> None:
    """The stage DP's split of a bf16 Llama, its programs run micro-batch after micro-batch,
    gives the eager mixed precision step's loss and fp32 gradients (to bf16 precision: the
    micro-batches' products round apart from the whole batch's)."""
    model, inputs = _case("llama")
    choice = plan_stages(_program("llama", True), CLUSTER, Pipeline(microbatches=2))
    names = list(inputs)
    pieces = [list(p) for p in zip(*(inputs[n].chunk(2) for n in names), strict=True)]
    micro = fxpar.capture(model, dict(zip(names, pieces[0], strict=True)), mixed_precision=BF16)
    split = split_program(micro, partition(micro, choice.split_points), remat=False)
    assert split.num_stages == choice.pipeline.num_stages > 1
    result = split.run_microbatches(named_state(model), pieces)
    loss, gradients = _mixed_precision_step(model, inputs)
    torch.testing.assert_close(result.loss, loss, rtol=1e-2, atol=0.0)
    assert result.gradients.keys() == gradients.keys()
    for name, want in gradients.items():
        error = (result.gradients[name] - want).abs().max().item()
        scale = want.abs().max().item()
        assert error <= 0.02 * scale, f"gradient of {name}: off by {error:.3g} of {scale:.3g}"


LR = 0.1
STEPS = 2


def _llama_logits_loss(output: Any, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output.logits.flatten(0, 1).float(), labels.flatten())


def _llama_for_gloo() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**DECODER, "num_hidden_layers": 2})
    return transformers.LlamaForCausalLM(config), _tokens()[:4]


def _loss_stage_pipeline(rank: int, world_size: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    model, tokens = _llama_for_gloo()
    pipelined = fxpar.compile(
        model, Cluster((2,)), {"input_ids": tokens}, _llama_logits_loss,
        example_targets=(tokens,), optimizer=SGD(lr=LR), mixed_precision=BF16,
        pipeline=Pipeline(stages=("<loss>",), microbatches=2),
    )  # fmt: skip
    losses = [pipelined.step(tokens, tokens).item() for _ in range(STEPS)]
    state = pipelined.full_state_dict()
    return {"losses": losses, "parameters": len(pipelined.parameters), "state": state}


@pytest.mark.slow
def test_llama_pipeline_whose_last_stage_holds_no_parameter_trains_on_gloo() -> None:
    """A bf16 Llama cut before its loss on 2 gloo ranks: the last stage holds no trainable
    parameter (its optimizer steps over nothing), and the losses and fp32 weights after two
    SGD steps are the eager mixed precision reference's."""
    ranks = spawn(_loss_stage_pipeline, 2)
    model, tokens = _llama_for_gloo()
    assert ranks[0]["parameters"] > 0 and ranks[1]["parameters"] == 0
    masters = {n: p.detach().clone().requires_grad_() for n, p in model.named_parameters()}
    optimizer = torch.optim.SGD(list(masters.values()), lr=LR, foreach=False)
    expected = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        computed = {n: p.to(torch.bfloat16) for n, p in masters.items()}
        output = torch.func.functional_call(
            model, (computed, dict(model.named_buffers())), (), {"input_ids": tokens}
        )
        loss = _llama_logits_loss(output, tokens)
        loss.backward()
        optimizer.step()
        expected.append(loss.item())
    for found in ranks:
        torch.testing.assert_close(found["losses"], expected, rtol=1e-2, atol=0.0)
    for name, master in masters.items():
        torch.testing.assert_close(ranks[0]["state"][name], master.detach(), rtol=1e-2, atol=1e-3)
