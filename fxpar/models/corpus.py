"""A small byte-level corpus that ships with fxpar, for the demo and the examples."""

from __future__ import annotations

from collections.abc import Iterator

import torch

TEXT = """\
A compiler for training takes one step of a model and asks where every tensor should live.
Some tensors are split across devices along the batch, some along the hidden width, and some
are copied everywhere because they are small. Each split has a price: a gather here, a
reduction there, a little waiting while the slowest device finishes its share. The compiler
writes down every choice and its price, and picks the plan that finishes the step soonest
while fitting in memory. Then it rewrites the step into one program per device, each with the
messages it must send and receive, and checks that the devices together compute exactly what
one device would have computed alone.
"""


def corpus_tokens() -> torch.Tensor:
    """The corpus as int64 byte values (a vocabulary of 256)."""
    return torch.tensor(list(TEXT.encode("utf-8")), dtype=torch.long)


def batches(
    tokens: torch.Tensor, batch_size: int, length: int, *, seed: int = 0
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """An endless, seeded stream of (inputs, next-token targets) windows from ``tokens``."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, tokens.numel() - length - 1, (batch_size,), generator=generator)
        window = torch.stack([tokens[s : s + length + 1] for s in starts.tolist()])
        yield window[:, :-1], window[:, 1:]
