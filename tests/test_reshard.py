"""Resharding: every pair of specs on 1-D and 2-D meshes converts exactly, with the collective
the table in docs/sharding.md names for each single-axis move."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from fxpar.sharding import all_specs, assemble, local_shape, spec_str
from fxpar.sharding.reshard import ReshardStep, reshard_steps
from fxpar.testing.rules import distribute

R, P = Replicate(), Partial()


def apply_steps(pieces: dict, steps: list[ReshardStep], mesh: tuple[int, ...]) -> dict:  # type: ignore[type-arg]
    """Execute steps with exact collective semantics over every device's piece."""
    for step in steps:
        n = mesh[step.axis]
        updated = {}
        for coordinate, piece in pieces.items():
            group = [
                pieces[(*coordinate[: step.axis], k, *coordinate[step.axis + 1 :])]
                for k in range(n)
            ]
            index = coordinate[step.axis]
            if step.kind == "all_gather":
                updated[coordinate] = torch.cat(group, step.dim)
            elif step.kind == "all_reduce":
                updated[coordinate] = sum(group[1:], group[0])
            elif step.kind == "reduce_scatter":
                updated[coordinate] = sum(group[1:], group[0]).chunk(n, step.dim)[index]
            elif step.kind == "all_to_all":
                updated[coordinate] = torch.cat(
                    [g.chunk(n, step.to_dim)[index] for g in group], step.dim
                )
            elif step.kind == "slice":
                updated[coordinate] = piece.chunk(n, step.dim)[index]
            else:
                updated[coordinate] = piece if index == 0 else torch.zeros_like(piece)
        pieces = updated
    return pieces


@pytest.mark.parametrize("mesh", [(2,), (3,), (2, 2), (2, 3)])
def test_every_pair_of_specs_converts_exactly(mesh: tuple[int, ...]) -> None:
    shape = (12, 6, 4)
    value = torch.randn(shape)
    coordinates = list(itertools.product(*(range(n) for n in mesh)))
    generator = torch.Generator().manual_seed(0)
    specs = all_specs(shape, mesh, partial=True)
    for source in specs:
        pieces = distribute(value, source, mesh, generator)
        for target in specs:
            converted = apply_steps(pieces, reshard_steps(source, target, mesh), mesh)
            label = f"{spec_str(source)} -> {spec_str(target)}"
            for coordinate in coordinates:
                assert converted[coordinate].shape == local_shape(shape, target, mesh), label
            torch.testing.assert_close(assemble(converted, target, mesh), value, msg=label)


@pytest.mark.parametrize(
    ("source", "target", "kind"),
    [
        ((Shard(0),), (R,), "all_gather"),
        ((P,), (R,), "all_reduce"),
        ((P,), (Shard(1),), "reduce_scatter"),
        ((Shard(0),), (Shard(1),), "all_to_all"),
        ((R,), (Shard(1),), "slice"),
        ((R,), (P,), "to_partial"),
    ],
)
def test_single_axis_moves_use_the_named_collective(source, target, kind) -> None:  # type: ignore[no-untyped-def]
    assert [s.kind for s in reshard_steps(source, target, (4,))] == [kind]


def test_nested_shards_are_undone_innermost_first() -> None:
    # (S(0), S(0)) -> (R, S(0)): the inner shard must be gathered before the outer one, then
    # re-sliced, or the chunks would come back out of order.
    steps = reshard_steps((Shard(0), Shard(0)), (R, Shard(0)), (2, 2))
    assert [(s.kind, s.axis) for s in steps] == [("all_gather", 1), ("all_gather", 0), ("slice", 1)]


def test_no_steps_on_single_device_axes() -> None:
    assert reshard_steps((Shard(0), P), (R, R), (1, 1)) == []
