"""Well-known large model shapes for planning on the meta device (no weights are allocated
when built under ``torch.device("meta")``): the CLI's ``fxpar plan`` and the benchmarks."""

from __future__ import annotations

from typing import Any

from torch import nn

from fxpar.errors import FxparError

GPT2_SHAPES = {
    "gpt2-small": (12, 768, 12),
    "gpt2-medium": (24, 1024, 16),
    "gpt2-large": (36, 1280, 20),
    "gpt2-xl": (48, 1600, 25),
}
"""Name -> (layers, width, heads)."""

GPT3_SHAPES = {"gpt3-175b": (96, 12288, 96)}
"""Name -> (layers, width, heads) of GPT-3 shapes (Brown et al., 2020), as a GPT-2 model."""

LLAMA_SHAPES = {
    "llama-8b": (32, 4096, 14336, 32, 8),
    "llama-8b-96": (96, 4096, 14336, 32, 8),
    "llama-70b": (80, 8192, 28672, 64, 8),
    "llama-405b": (126, 16384, 53248, 128, 8),
}
"""Name -> (layers, hidden, intermediate, attention heads, key/value heads) of Llama-3
shapes; ``llama-8b-96`` is Llama-3-8B with 96 layers."""


MIXTRAL_SHAPES = {
    "mixtral-64x1024": (4, 1024, 1024, 16, 8, 64, 2),
}
"""Name -> (layers, hidden, expert intermediate, attention heads, key/value heads, experts,
experts per token) of Mixtral-like shapes: ``mixtral-64x1024`` has many experts (64, two per
token) at width 1024, where the experts' weights, not the tokens, are most of the step's bytes."""


def mixtral_named(name: str) -> nn.Module:
    """The Hugging Face Mixtral of one of :data:`MIXTRAL_SHAPES`."""
    layers, hidden, intermediate, heads, kv_heads, experts, per_token = MIXTRAL_SHAPES[name]
    transformers = _transformers()
    config = transformers.MixtralConfig(
        hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, num_local_experts=experts,
        num_experts_per_tok=per_token, vocab_size=32000, max_position_embeddings=4096,
    )  # fmt: skip
    return transformers.MixtralForCausalLM(config)


def llama(layers: int) -> nn.Module:
    """A Hugging Face Llama with Llama-3-8B's shape and ``layers`` decoder layers."""
    return llama_shape(layers, *LLAMA_SHAPES["llama-8b"][1:])


def llama_named(name: str) -> nn.Module:
    """The Hugging Face Llama of one of :data:`LLAMA_SHAPES`."""
    return llama_shape(*LLAMA_SHAPES[name])


def llama_shape(
    layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int
) -> nn.Module:
    """A Hugging Face Llama of the given shape, with Llama 3's vocabulary."""
    transformers = _transformers()
    config = transformers.LlamaConfig(
        hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=128256,
        max_position_embeddings=8192,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def gpt3(name: str) -> nn.Module:
    """A Hugging Face GPT-2 model of one of :data:`GPT3_SHAPES` (GPT-3's dense shape), without
    dropout. (With attention dropout the captured attention is the unfused formula: its
    ``L x L`` probabilities and the dropout draws of every head are kept for the backward,
    where Megatron-LM's fused kernels keep neither.)"""
    layers, width, heads = GPT3_SHAPES[name]
    transformers = _transformers()
    config = transformers.GPT2Config(
        n_layer=layers, n_embd=width, n_head=heads, n_positions=2048, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def hf_gpt2(name: str) -> nn.Module:
    """A Hugging Face GPT-2 of one of :data:`GPT2_SHAPES`."""
    layers, width, heads = GPT2_SHAPES[name]
    transformers = _transformers()
    config = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=heads)
    return transformers.GPT2LMHeadModel(config)


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as error:
        raise FxparError(
            "these model shapes are built with Hugging Face transformers: pip install transformers"
        ) from error
    return transformers
