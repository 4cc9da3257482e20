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

LLAMA_LAYERS = {"llama-8b": 32, "llama-8b-96": 96}
"""Name -> layers of a Llama-3-8B-shaped model (hidden 4096, GQA with 8 key/value heads)."""


def llama(layers: int) -> nn.Module:
    """A Hugging Face Llama with Llama-3-8B's shape and ``layers`` decoder layers."""
    transformers = _transformers()
    config = transformers.LlamaConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
        max_position_embeddings=8192,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


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
