"""Layer stamping (fxpar.ir.repeat): a deep model's step built from six traced layers is the
step a full capture gives, op for op, on decoders, an encoder-decoder whose first block
differs, fxpar's GPT and under bf16 MixedPrecision; it computes the same loss and gradients
bit for bit; and it is refused, with the reason, where the layers do not repeat."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch

import fxpar
from fxpar.errors import CaptureError
from fxpar.ir.repeat import StampedLayers, canonical, capture_repeated
from fxpar.models.gpt import GPT, GPTConfig, gpt_loss
from fxpar.passes import plan_program

transformers = pytest.importorskip("transformers")

BF16 = fxpar.MixedPrecision(torch.bfloat16, reduce_dtype=torch.float32)
LAYERS = 8


def _tokens(batch: int = 2, length: int = 8) -> torch.Tensor:
    return torch.randint(0, 64, (batch, length))


def _decoder(family: str, **extra: Any) -> torch.nn.Module:
    """A Hugging Face decoder LM of ``family`` (``Llama``, ``Qwen2``, ...), ``LAYERS`` tiny
    layers."""
    config = getattr(transformers, f"{family}Config")(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, **extra,
    )  # fmt: skip
    return getattr(transformers, f"{family}ForCausalLM")(config)


def _llama() -> torch.nn.Module:
    return _decoder("Llama")


def _gpt2(dropout: float = 0.0) -> torch.nn.Module:
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=32, n_embd=32, n_layer=LAYERS, n_head=4,
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def _t5() -> torch.nn.Module:
    config = transformers.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=LAYERS, num_decoder_layers=4,
        num_heads=4, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return transformers.T5ForConditionalGeneration(config)


def _lm_batch() -> dict[str, torch.Tensor]:
    ids = _tokens()
    return {"input_ids": ids, "labels": ids}


Case = tuple[Callable[[], torch.nn.Module], Callable[[], Any], Any, str]

CASES: dict[str, Case] = {
    "llama-bf16": (_llama, _lm_batch, BF16, "model.layers"),
    "qwen2-bf16": (functools.partial(_decoder, "Qwen2"), _lm_batch, BF16, "model.layers"),
    "gpt2": (_gpt2, _lm_batch, None, "transformer.h"),
    "t5": (_t5, _lm_batch, None, "encoder.block"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_stamped_step_is_the_captured_step(case: str) -> None:
    build, batch, precision, container = CASES[case]
    torch.manual_seed(0)
    with torch.device("meta"):
        model = build()
    inputs = batch()
    full = fxpar.capture(model, inputs, mixed_precision=precision)
    stamped = capture_repeated(model, inputs, mixed_precision=precision)
    assert stamped.get(StampedLayers) == StampedLayers(container, LAYERS)
    assert stamped.signature == full.signature
    assert canonical(stamped) == canonical(full)


def test_fxpar_gpt_is_stamped_and_trains_bit_for_bit_like_its_full_capture() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=LAYERS, n_head=2, n_embd=16))
    tokens, targets = _tokens(length=16), _tokens(length=16)
    full = fxpar.capture(model, (tokens,), gpt_loss, example_targets=(targets,))
    stamped = capture_repeated(model, (tokens,), gpt_loss, example_targets=(targets,))
    assert stamped.get(StampedLayers) == StampedLayers("blocks", LAYERS)
    assert canonical(stamped) == canonical(full)
    expected = full.run(model, tokens, targets)
    found = stamped.run(model, tokens, targets)
    assert torch.equal(found.loss, expected.loss)
    assert found.gradients.keys() == expected.gradients.keys()
    for name, gradient in expected.gradients.items():
        assert torch.equal(found.gradients[name], gradient), name


def test_a_stamped_step_plans_as_the_full_one() -> None:
    with torch.device("meta"):
        model = _llama()
    inputs = _lm_batch()
    cluster = fxpar.Cluster.preset("h100", (4,))
    full = plan_program(fxpar.capture(model, inputs, mixed_precision=BF16), cluster)
    stamped = plan_program(capture_repeated(model, inputs, mixed_precision=BF16), cluster)
    assert stamped.solution.objective == pytest.approx(full.solution.objective, rel=1e-9)


def test_dropout_in_the_layers_is_captured_whole_or_refused_when_asked_for(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with torch.device("meta"):
        model = _gpt2(dropout=0.1)
    inputs = _lm_batch()
    with caplog.at_level(logging.INFO, logger="fxpar.ir.repeat"):
        program = capture_repeated(model, inputs)
    assert program.get(StampedLayers) is None
    assert len(program.signature.random) > LAYERS  # every layer's draws, captured whole
    assert "dropout" in caplog.text
    with pytest.raises(CaptureError, match=r"transformer\.h.*dropout"):
        capture_repeated(model, inputs, layers="transformer.h")


def test_layers_built_differently_or_too_few_are_refused() -> None:
    with torch.device("meta"):
        gemma2 = _decoder("Gemma2", head_dim=8)  # sliding and global attention alternate
    with pytest.raises(CaptureError, match="built differently"):
        capture_repeated(gemma2, _lm_batch(), layers="model.layers")
    shallow = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=16))
    with pytest.raises(CaptureError, match="4 layers: stamping needs more than the 6"):
        capture_repeated(shallow, (_tokens(),), gpt_loss, example_targets=(_tokens(),),
                         layers="blocks")  # fmt: skip
    with pytest.raises(CaptureError, match="no such module"):
        capture_repeated(shallow, (_tokens(),), gpt_loss, example_targets=(_tokens(),),
                         layers="layers")  # fmt: skip
    program = capture_repeated(shallow, (_tokens(),), gpt_loss, example_targets=(_tokens(),))
    assert program.get(StampedLayers) is None


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        return x + self.linear(x) * scale


class _Scaled(torch.nn.Module):
    """Residual blocks scaled by the number of blocks: code that depends on how many layers
    there are, which the traced layers cannot show."""

    def __init__(self, layers: int = LAYERS) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Block() for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, 1 / len(self.blocks))
        return x.square().mean()


def test_check_catches_code_that_depends_on_the_number_of_layers() -> None:
    model, x = _Scaled(), torch.randn(4, 8)
    full = fxpar.capture(model, (x,))
    assert canonical(capture_repeated(model, (x,))) != canonical(full)  # what check is for
    with pytest.raises(CaptureError, match="depends on how many layers"):
        capture_repeated(model, (x,), layers="blocks", check=True)
    fallback = capture_repeated(model, (x,), check=True)
    assert fallback.get(StampedLayers) is None and canonical(fallback) == canonical(full)
    gpt = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=LAYERS, n_head=2, n_embd=16))
    tokens = _tokens(length=16)
    checked = capture_repeated(gpt, (tokens,), gpt_loss, example_targets=(tokens,), check=True)
    assert checked.get(StampedLayers) == StampedLayers("blocks", LAYERS)
    full = fxpar.capture(gpt, (tokens,), gpt_loss, example_targets=(tokens,))
    assert canonical(checked) == canonical(full)


def test_a_model_that_is_its_layer_container_is_stamped() -> None:
    """A root ``nn.Sequential``: its layers' state names have no prefix (``3.weight``)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(LAYERS)))
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    full = fxpar.capture(model, (x,), torch.nn.functional.mse_loss, example_targets=(y,))
    stamped = capture_repeated(
        model, (x,), torch.nn.functional.mse_loss, example_targets=(y,), layers=""
    )
    assert stamped.get(StampedLayers) == StampedLayers("", LAYERS)
    assert canonical(stamped) == canonical(full)
    expected, found = full.run(model, x, y), stamped.run(model, x, y)
    assert torch.equal(found.loss, expected.loss)
    for name, gradient in expected.gradients.items():
        assert torch.equal(found.gradients[name], gradient), name
