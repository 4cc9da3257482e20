"""Sharded checkpoints shared by :class:`~fxpar.parallel.ParallelModel` and
:class:`~fxpar.pipeline.PipelineModel`.

A checkpoint is a ``torch.distributed.checkpoint`` directory. Every tensor is stored under a
name of the model, not of a rank: ``model/<parameter or buffer>``,
``optimizer/<parameter>/<slot>`` and ``steps``, each rank contributing its local pieces as
DTensors with their global shape and placements (a plain tensor when there is no process
group). So a checkpoint written under one mesh, plan or pipeline loads under any other: each
rank reads just the pieces its own layout needs, and a stage reads only the entries it holds.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from fxpar import ir
from fxpar.errors import CheckpointError
from fxpar.optim import Optimizer
from fxpar.sharding import Spec

Wrap = Callable[[str, torch.Tensor], Any]
"""Turns the local piece of the named parameter (or of a state slot shaped like it) into what
the checkpoint stores: a DTensor, or the tensor itself without a process group."""


def save(state: Mapping[str, Any], path: str | os.PathLike[str], *, distributed: bool) -> None:
    """Write ``state`` (names to DTensors or tensors). A collective when ``distributed``."""
    from torch.distributed import checkpoint as dcp

    with warnings.catch_warnings():
        # A one-device model saves without a process group, which is what torch warns of.
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.save(dict(state), checkpoint_id=os.fspath(path))
    _settle(distributed)


def load(
    state: Mapping[str, Any], path: str | os.PathLike[str], *, distributed: bool
) -> dict[str, Any]:
    """Read the entries of ``state`` that the checkpoint at ``path`` has, in place into its
    DTensors (plain tensors are filled in the returned dict: copy them back). Every entry but
    optimizer slots must be in the checkpoint, with the same global shape.

    Raises:
        CheckpointError: there is no checkpoint at ``path``, or it is another model's.
    """
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(os.fspath(path)).read_metadata()
    except Exception as error:
        raise CheckpointError(f"cannot read a checkpoint at {path}: {error}") from error
    saved = metadata.state_dict_metadata
    missing = [k for k in state if k not in saved and not k.startswith("optimizer/")]
    if missing:
        raise CheckpointError(
            f"the checkpoint at {path} lacks {missing[:5]} ({len(missing)} entries): it was "
            "saved from a different model"
        )
    for key, value in state.items():
        size = getattr(saved.get(key), "size", None)
        if size is not None and tuple(size) != tuple(value.shape):
            raise CheckpointError(
                f"{key} is {list(size)} in the checkpoint at {path} but {list(value.shape)} "
                "in this model"
            )
    wanted = {key: value for key, value in state.items() if key in saved}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(wanted, checkpoint_id=os.fspath(path))
    _settle(distributed)
    return wanted


def optimizer_entries(
    named: Mapping[str, torch.Tensor],
    optimizer: torch.optim.Optimizer,
    spec: Optimizer,
    wrap: Wrap,
    *,
    include_missing: bool,
) -> dict[str, Any]:
    """``optimizer/<name>/<slot>`` for the state of each of the ``named`` parameters: slots
    shaped like the parameter wrapped like it, per-parameter counters as they are. With
    ``include_missing``, a parameter without state yet (no step taken) gets zero state,
    registered with the optimizer, so a checkpoint has somewhere to load into."""
    entries: dict[str, Any] = {}
    for name, parameter in named.items():
        slots = optimizer.state.get(parameter)
        if not slots and include_missing:
            slots = _fresh_state(parameter, optimizer, spec)
        for key, value in (slots or {}).items():
            if key in spec.state_keys:
                entries[f"optimizer/{name}/{key}"] = wrap(name, value)
            elif isinstance(value, torch.Tensor):  # a per-parameter step count
                entries[f"optimizer/{name}/{key}"] = value
    return entries


def _fresh_state(
    parameter: torch.Tensor, optimizer: torch.optim.Optimizer, spec: Optimizer
) -> dict[str, torch.Tensor]:
    slots = {key: torch.zeros_like(parameter) for key in spec.state_keys}
    if isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        slots["step"] = torch.tensor(0.0, dtype=torch.float32)
    optimizer.state[parameter] = slots
    return slots


def dtensor(
    local: torch.Tensor, device_mesh: Any, spec: Spec, global_shape: Sequence[ir.Size]
) -> Any:
    """``local`` as the piece of a DTensor of ``global_shape`` laid out as ``spec``."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local,
        device_mesh,
        spec,
        run_check=False,
        shape=torch.Size(int(size) for size in global_shape),
        stride=_contiguous_strides(global_shape),
    )


def _settle(distributed: bool) -> None:
    # torch.distributed.checkpoint returns while gloo work it started can still be in flight
    # on some ranks; a process that then tears down its process group (or exits) aborts with
    # "terminate called without an active exception" about a third of the time on 2 ranks. A
    # barrier lets every rank's checkpoint traffic finish first.
    if distributed:
        dist.barrier()


def _contiguous_strides(shape: Sequence[ir.Size]) -> tuple[int, ...]:
    strides, running = [], 1
    for size in reversed(shape):
        strides.append(running)
        running *= int(size)
    return tuple(reversed(strides))
