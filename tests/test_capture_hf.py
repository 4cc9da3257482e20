"""Hugging Face GPT-2, BERT and LLaMA, built from tiny configs (no downloaded weights), capture
into Programs that train exactly like eager PyTorch."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_matches_eager

import fxpar

transformers = pytest.importorskip("transformers")


def _tokens(vocab: int, batch: int = 2, length: int = 12) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length))


def test_gpt2_matches_eager() -> None:
    config = transformers.GPT2Config(
        vocab_size=128,
        n_positions=32,
        n_embd=32,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    model = transformers.GPT2LMHeadModel(config)
    ids = _tokens(128)
    assert_matches_eager(model, {"input_ids": ids, "labels": ids})


def test_bert_matches_eager() -> None:
    config = transformers.BertConfig(
        vocab_size=128,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    model = transformers.BertForMaskedLM(config)
    ids = _tokens(128)
    labels = torch.where(torch.rand(ids.shape) < 0.3, ids, torch.full_like(ids, -100))
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0
    assert_matches_eager(
        model, {"input_ids": ids, "attention_mask": mask, "labels": labels}, rtol=1e-5, atol=1e-6
    )


def test_llama_matches_eager() -> None:
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = transformers.LlamaForCausalLM(config)
    ids = _tokens(128)
    program = assert_matches_eager(model, {"input_ids": ids, "labels": ids})
    fxpar.verify(program)


def test_gpt2_with_dropout_captures_and_runs() -> None:
    config = transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=1, n_head=4)
    model = transformers.GPT2LMHeadModel(config)  # default dropout 0.1
    ids = _tokens(128)
    program = fxpar.capture(model, {"input_ids": ids, "labels": ids})
    fxpar.verify(program)
    result = program.run(model, ids, ids)
    assert torch.isfinite(result.loss)
    assert set(result.gradients) == {name for name, _ in model.named_parameters()}
