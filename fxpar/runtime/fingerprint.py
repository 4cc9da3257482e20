"""Check that every rank built the same model before rank 0's weights are broadcast.

``fxpar.compile`` broadcasts rank 0's parameters and buffers into every rank's copy, one tensor
at a time, in the order of the Program's signature. Were one rank's model built with another
config, the broadcasts would pair tensors of different sizes: gloo then waits for bytes that
never come until the process-group timeout, or copies part of a tensor without complaint. So
the ranks first compare a hash of the name, shape and dtype of every tensor they are about to
broadcast (one small all-gather), and only when the hashes differ exchange the lists
themselves, to name the first difference on every rank.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from fxpar.errors import DistributedError

logger = logging.getLogger(__name__)

Entry = tuple[str, tuple[int, ...], str]
"""One tensor as the ranks compare it: name, shape, dtype."""


def state_entries(state: Mapping[str, torch.Tensor], names: Sequence[str]) -> list[Entry]:
    """The name, shape and dtype of ``state[name]`` for each of ``names``, in order."""
    return [(name, tuple(state[name].shape), str(state[name].dtype)) for name in names]


def check_same_model(state: Mapping[str, torch.Tensor], names: Sequence[str]) -> None:
    """Raise :class:`~fxpar.errors.DistributedError` on every rank unless every rank's
    ``state[name]`` for ``names`` (the tensors about to be broadcast, in broadcast order) has
    the same names, shapes and dtypes as rank 0's. Does nothing without a process group of more
    than one rank; call it on every rank, as it is a collective."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    entries = state_entries(state, names)
    digest = hashlib.sha256(repr(entries).encode()).hexdigest()
    digests: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest)
    if all(d == digests[0] for d in digests):
        return
    logger.debug("model fingerprints differ across ranks: %s", digests)
    everyone: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, entries)
    raise DistributedError(describe_difference(everyone))  # type: ignore[arg-type]


def describe_difference(entries_by_rank: Sequence[Sequence[Entry]]) -> str:
    """What differs between rank 0's tensors and those of the first rank whose tensors differ
    (some rank's must): the same text on every rank, so every rank raises the same error."""
    reference = list(entries_by_rank[0])
    differing = [r for r, entries in enumerate(entries_by_rank) if list(entries) != reference]
    rank = differing[0]
    difference = _first_difference(reference, list(entries_by_rank[rank]), rank)
    message = f"rank {rank} built a different model than rank 0: {difference}"
    if len(differing) > 1:
        message += f" (ranks {', '.join(map(str, differing[1:]))} differ from rank 0 too)"
    return message + (
        ". fxpar.compile trains rank 0's weights and broadcasts them to every rank, so every "
        "rank must build the same model: the same class, config and trainable parameters"
    )


def _first_difference(reference: list[Entry], other: list[Entry], rank: int) -> str:
    mine = {name: (shape, dtype) for name, shape, dtype in reference}
    theirs = {name: (shape, dtype) for name, shape, dtype in other}
    for index, (want, got) in enumerate(zip(reference, other, strict=False)):
        if want == got:
            continue
        if want[0] == got[0]:
            return f"{want[0]!r} is {_shown(want)} on rank 0 but {_shown(got)} on rank {rank}"
        if want[0] not in theirs:
            return f"rank 0 has {want[0]!r} ({_shown(want)}), which rank {rank} lacks"
        if got[0] not in mine:
            return f"rank {rank} has {got[0]!r} ({_shown(got)}), which rank 0 lacks"
        return (
            f"the tensors come in another order: number {index} is {want[0]!r} on rank 0 but "
            f"{got[0]!r} on rank {rank}"
        )
    if len(reference) > len(other):
        extra = reference[len(other)]
        return f"rank 0 has {extra[0]!r} ({_shown(extra)}), which rank {rank} lacks"
    extra = other[len(reference)]
    return f"rank {rank} has {extra[0]!r} ({_shown(extra)}), which rank 0 lacks"


def _shown(entry: Entry) -> str:
    _, shape, dtype = entry
    return f"{dtype.removeprefix('torch.')}[{', '.join(map(str, shape))}]"


__all__ = ["Entry", "check_same_model", "describe_difference", "state_entries"]
