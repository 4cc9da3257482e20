"""Small reference models that ship with fxpar: used by the demo, the tests and the benchmarks."""

from __future__ import annotations

from fxpar.models.gpt import GPT, GPTConfig, gpt_loss

__all__ = ["GPT", "GPTConfig", "gpt_loss"]
