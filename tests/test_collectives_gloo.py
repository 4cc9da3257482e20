"""The process-group communicator's collectives on real gloo processes give, on every rank,
exactly what the collective means on whole tensors: for every tensor dim and pair of dims, on
2 and 4 ranks, for contiguous and transposed inputs."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from fxpar.lowering.collective_calls import (
    start_all_gather_bucket,
    start_all_reduce_bucket,
    start_reduce_scatter_bucket,
    wait_bucket,
)
from fxpar.runtime.communicators import ProcessGroupCommunicator
from fxpar.runtime.launch import spawn

pytestmark = pytest.mark.slow

SHAPE = (4, 8, 12)  # every dim divisible by 4


def _addend(rank: int, transposed: bool) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 + rank)
    if transposed:  # same values and shape, other strides
        return torch.randn(SHAPE[::-1], generator=generator).permute(2, 1, 0)
    return torch.randn(SHAPE, generator=generator)


def _collectives(rank: int, world_size: int) -> list[str]:
    torch.set_num_threads(1)
    comm = ProcessGroupCommunicator(init_device_mesh("cpu", (world_size,)))
    addends = [[_addend(r, t) for r in range(world_size)] for t in (False, True)]
    wrong = []
    for transposed, everyone in zip((False, True), addends, strict=True):
        mine, total = everyone[rank], torch.stack(everyone).sum(0)
        checks = {"all_reduce": (comm.all_reduce(mine, 0), total)}
        for dim in range(len(SHAPE)):
            checks[f"all_gather dim {dim}"] = (
                comm.all_gather(mine, dim, 0),
                torch.cat(everyone, dim),
            )
            checks[f"reduce_scatter dim {dim}"] = (
                comm.reduce_scatter(mine, dim, 0),
                total.chunk(world_size, dim)[rank],
            )
        for split, concat in itertools.permutations(range(len(SHAPE)), 2):
            # Device r holds piece r (on concat) of a whole tensor; after the all-to-all it
            # holds piece ``rank`` of that whole tensor on split.
            whole = torch.cat(everyone, concat)
            got = comm.all_to_all(whole.chunk(world_size, concat)[rank], split, concat, 0)
            checks[f"all_to_all {concat}->{split}"] = (got, whole.chunk(world_size, split)[rank])
        # Buckets: several tensors (of other shapes, and strided) in one collective, in flight
        # while the program runs on.
        others = [e[:, :4].sum(2) for e in everyone]  # (4, 4), a reduction of a strided slice
        other, other_total = others[rank], torch.stack(others).sum(0)
        summed = wait_bucket(comm, start_all_reduce_bucket(comm, [mine, other], (0,)))
        checks["all_reduce bucket 0"] = (summed[0], total)
        checks["all_reduce bucket 1"] = (summed[1], other_total)
        for dims in ((0, 1), (2, 0), (1, 1)):
            bucket = start_reduce_scatter_bucket(comm, [mine, other], dims, 0, world_size)
            wanted = ((total, dims[0]), (other_total, dims[1]))
            for index, (got, (whole, dim)) in enumerate(
                zip(wait_bucket(comm, bucket), wanted, strict=True)
            ):
                expected = whole.chunk(world_size, dim)[rank]
                checks[f"reduce_scatter bucket {dims} {index}"] = (got, expected)
            bucket = start_all_gather_bucket(comm, [mine, other], dims, (0,), (world_size,))
            parts = ((everyone, dims[0]), (others, dims[1]))
            for index, (got, (pieces, dim)) in enumerate(
                zip(wait_bucket(comm, bucket), parts, strict=True)
            ):
                checks[f"all_gather bucket {dims} {index}"] = (got, torch.cat(pieces, dim))
        for name, (got, expected) in checks.items():
            if got.shape != expected.shape or not torch.allclose(got, expected, atol=1e-6):
                wrong.append(f"{name} (transposed={transposed})")
            elif not got.is_contiguous():
                wrong.append(f"{name} not contiguous (transposed={transposed})")
    return wrong


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("policy", ["poll", "block"])
def test_native_collectives_mean_what_they_say(
    monkeypatch: pytest.MonkeyPatch, world_size: int, policy: str
) -> None:
    """Under both ways of waiting (fxpar.runtime.waiting); the processes take the caller's
    environment."""
    monkeypatch.setenv("FXPAR_WAIT", policy)
    assert spawn(_collectives, world_size, timeout_s=120) == [[]] * world_size
