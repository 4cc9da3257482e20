"""The entries of a checkpoint that are not tensors: the optimizer's hyperparameters per
parameter group and the user's ``extra``, written by rank 0 with ``torch.save`` and read back
with torch's weights-only unpickler, so that loading them runs no code from the files (see
:mod:`fxpar.checkpoint`, "Complete" and "Safe to load")."""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Mapping
from typing import Any

import torch

from fxpar.errors import CheckpointError

GROUPS = "optimizer_groups"
"""The entry holding the optimizer's hyperparameters, per parameter group."""
EXTRA = "extra"
"""The entry holding the user's own state, given to ``save(path, extra=...)``."""


def object_entries(
    optimizer: torch.optim.Optimizer, extra: object, *, rank: int, loading: bool
) -> dict[str, io.BytesIO]:
    """The pickled entries: the optimizer's hyperparameters and the user's ``extra`` (when not
    None). Rank 0 writes them (every rank holds the same); for a load every rank reads them."""
    if loading:
        return {GROUPS: io.BytesIO(), EXTRA: io.BytesIO()}
    if rank != 0:
        return {}
    groups = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    entries = {GROUPS: _serialized(groups)}
    if extra is not None:
        try:
            entries[EXTRA] = _serialized(extra)
        except Exception as error:
            raise CheckpointError(
                f"extra= must be picklable to be saved: {type(error).__name__}: {error}; pass "
                "state_dict()s and plain values (a scheduler's state_dict(), not the scheduler)"
            ) from error
    return entries


def restore_objects(
    loaded: Mapping[str, Any],
    optimizer: torch.optim.Optimizer,
    path: str | os.PathLike[str],
    *,
    trusted: bool = False,
) -> Any:
    """Set ``optimizer``'s hyperparameters from a load's entries and return the user's
    ``extra`` (None when the checkpoint has none). Without ``trusted``, entries holding
    anything but plain data are refused (module docstring)."""
    if GROUPS in loaded:
        groups = _deserialized(loaded[GROUPS], path, "optimizer hyperparameters", trusted)
        if not isinstance(groups, list) or not all(
            isinstance(group, dict)
            and all(isinstance(key, str) for key in group)
            and "params" not in group
            for group in groups
        ):
            raise CheckpointError(
                f"the optimizer hyperparameters of the checkpoint at {path} are not a list of "
                f"parameter groups (dicts of hyperparameters by name): {str(groups)[:200]}"
            )
        if len(groups) != len(optimizer.param_groups):
            raise CheckpointError(
                f"the checkpoint at {path} has {len(groups)} optimizer parameter groups, this "
                f"optimizer {len(optimizer.param_groups)}"
            )
        for group, saved in zip(optimizer.param_groups, groups, strict=True):
            group.update(saved)
    if EXTRA not in loaded:
        return None
    return _deserialized(loaded[EXTRA], path, "extra", trusted)


def _serialized(value: object) -> io.BytesIO:
    stream = io.BytesIO()
    torch.save(value, stream)
    stream.seek(0)
    return stream


def _deserialized(
    stream: io.BytesIO, path: str | os.PathLike[str], what: str, trusted: bool
) -> Any:
    """An entry written by :func:`_serialized`, built by torch's weights-only unpickler unless
    ``trusted``. An entry that is a plain pickle rather than ``torch.save``'s archive is
    refused, or, when ``trusted``, built by a general unpickler."""
    stream.seek(0)
    data = stream.read()
    if not data.startswith(b"PK"):  # not torch.save's zip archive: a plain pickle
        if not trusted:
            raise CheckpointError(
                f"the {what} of the checkpoint at {path} is a plain pickle (written by an older "
                "fxpar), which runs code when it is loaded; load it with trusted=True if you "
                "trust where it came from"
            )
        return pickle.loads(data)
    try:
        return torch.load(io.BytesIO(data), weights_only=not trusted)
    except pickle.UnpicklingError as error:
        reason = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
        raise CheckpointError(
            f"the {what} of the checkpoint at {path} holds objects other than plain data "
            f"(tensors, numbers, strings, lists, tuples, dicts), which loading would build by "
            f"running code from the file ({reason}); save state_dict()s and plain values, or "
            "load with trusted=True if you trust where it came from"
        ) from None
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as error:  # a damaged archive: torch raises RuntimeError, and others
        raise CheckpointError(
            f"the {what} of the checkpoint at {path} cannot be read: {type(error).__name__}: "
            f"{' '.join(str(error).split())[:300]}"
        ) from error


__all__ = ["EXTRA", "GROUPS", "object_entries", "restore_objects"]
