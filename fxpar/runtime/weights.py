"""Where a compiled model's starting weights come from, one piece per rank.

:func:`initial_pieces` gives a rank the pieces of the parameters and buffers it holds, from the
first source that has each tensor:

1. a checkpoint given as ``init=`` to :func:`fxpar.compile`: a ``safetensors`` file, a directory
   of them (``model.safetensors`` or a ``model.safetensors.index.json`` with its shards, as
   Hugging Face's ``save_pretrained`` writes), or a ``torch.distributed.checkpoint`` directory,
   all under the model's own ``state_dict`` names (a tied weight under any of its names). A
   safetensors file is read with plain file reads of the rows of a rank's pieces (parsed here,
   so fxpar needs no safetensors package and maps no file);
2. the model's recording, for a model built by :func:`fxpar.deferred_init`: the tensor's whole
   value is replayed, this rank's piece kept, the rest freed;
3. the model's real tensor on rank 0, broadcast (as DistributedDataParallel does).

A rank's peak is therefore its own pieces plus one whole tensor (none with safetensors). A
tensor on the meta device with none of these sources is an error naming it.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.tensor import Shard

from fxpar.checkpoint_reader import SafeReader
from fxpar.cluster import Coordinate
from fxpar.errors import CheckpointError, FxparError
from fxpar.ir.program import named_state
from fxpar.runtime.deferred import recording_of
from fxpar.runtime.devices import broadcast_from_rank_zero
from fxpar.sharding import Spec

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


@dataclass(frozen=True)
class Piece:
    """Which piece of a whole tensor a device holds: ``spec`` over a mesh of ``mesh_shape``,
    at ``coordinate``; no spec is the whole tensor."""

    spec: Spec | None = None
    mesh_shape: tuple[int, ...] = ()
    coordinate: Coordinate = ()

    def slices(self, shape: Sequence[int]) -> tuple[slice, ...]:
        """The index range of the piece in every dim (what ``tensor.chunk`` along each
        sharding axis in turn would give)."""
        ranges = [(0, int(size)) for size in shape]
        for placement, size, index in zip(
            self.spec or (), self.mesh_shape, self.coordinate, strict=True
        ):
            if isinstance(placement, Shard) and size > 1:
                start, stop = ranges[placement.dim]
                step = -(-(stop - start) // size)
                first = min(start + index * step, stop)
                ranges[placement.dim] = (first, min(first + step, stop))
        return tuple(slice(start, stop) for start, stop in ranges)

    def of(self, whole: torch.Tensor) -> torch.Tensor:
        """This piece of ``whole``, as a tensor of its own."""
        return whole[self.slices(whole.shape)].clone(memory_format=torch.contiguous_format)


def initial_pieces(
    model: nn.Module,
    names: Sequence[str],
    pieces: Mapping[str, Piece],
    init: str | os.PathLike[str] | None,
    *,
    distributed: bool,
) -> dict[str, torch.Tensor]:
    """This rank's piece of each tensor of ``pieces`` (of ``names``, the model's parameters and
    buffers in an order every rank shares). Every rank must call it, as a broadcast (source 3
    above) is a collective for every rank, held or not."""
    state = named_state(model)
    recording = recording_of(model)
    checkpoint = check_sources(model, names, init)
    local: dict[str, torch.Tensor] = {}
    for name in names:
        piece = pieces.get(name)
        tensor = state[name]
        if checkpoint is not None and checkpoint.has(name):
            if piece is not None:
                local[name] = checkpoint.read(name, piece, tensor)
        elif tensor.is_meta:
            if piece is not None:
                assert recording is not None
                local[name] = piece.of(_cast(recording.materialize(name), tensor))
        else:
            whole = broadcast_from_rank_zero(tensor.detach().clone(), distributed=distributed)
            if piece is not None:
                local[name] = piece.of(whole)
    return local


def check_sources(
    model: nn.Module, names: Sequence[str], init: str | os.PathLike[str] | None
) -> Checkpoint | None:
    """The checkpoint ``init`` names, after checking that every tensor of ``names`` on the meta
    device has a source; raises :class:`~fxpar.errors.FxparError` naming those that have none."""
    state = named_state(model)
    recording = recording_of(model)
    checkpoint = Checkpoint.open(init, model) if init is not None else None
    missing = [
        name
        for name in names
        if state[name].is_meta
        and not (checkpoint is not None and checkpoint.has(name))
        and not (recording is not None and name in recording.names)
    ]
    if missing:
        raise FxparError(_missing_message(model, missing, checkpoint))
    return checkpoint


class Checkpoint:
    """A checkpoint of a model's weights under its ``state_dict`` names."""

    def __init__(
        self, path: Path, stored: Collection[str], aliases: Mapping[str, tuple[str, ...]]
    ) -> None:
        self.path = path
        self._keys = {
            name: found
            for name, names in aliases.items()
            if (found := next((key for key in names if key in stored), None)) is not None
        }
        """Each readable state name's key in the files (a tied weight under any alias)."""

    @staticmethod
    def open(path: str | os.PathLike[str], model: nn.Module) -> Checkpoint:
        path = Path(path)
        aliases = _aliases(model)
        if path.is_dir() and (path / ".metadata").exists():
            return _DistributedCheckpoint(path, aliases)
        return _Safetensors(path, aliases)

    def has(self, name: str) -> bool:
        return name in self._keys

    def read(self, name: str, piece: Piece, like: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _check(self, name: str, shape: Sequence[int], like: torch.Tensor) -> None:
        if tuple(shape) != tuple(like.shape):
            raise CheckpointError(
                f"{self.path}: {self._keys[name]!r} has shape {tuple(shape)} but the model's "
                f"{name!r} is {tuple(like.shape)}"
            )


class _Safetensors(Checkpoint):
    """Safetensors files, read with plain file reads: for a piece, the rows of its dim-0 range
    in one read, cut down to the piece in memory. No file is mapped, so what a rank holds is
    what it allocated."""

    def __init__(self, path: Path, aliases: dict[str, tuple[str, ...]]) -> None:
        self._entries: dict[str, _Entry] = {}
        for file in _safetensors_files(path):
            self._entries.update(_read_header(file))
        super().__init__(path, self._entries, aliases)

    def read(self, name: str, piece: Piece, like: torch.Tensor) -> torch.Tensor:
        entry = self._entries[self._keys[name]]
        self._check(name, entry.shape, like)
        slices = piece.slices(like.shape)
        rows = slices[0] if slices else slice(0, 1)
        row_bytes = entry.dtype.itemsize * math.prod(entry.shape[1:])
        count = rows.stop - rows.start
        buffer = bytearray(count * row_bytes)
        with open(entry.file, "rb") as stream:
            stream.seek(entry.offset + rows.start * row_bytes)
            if stream.readinto(buffer) != len(buffer):
                raise CheckpointError(f"{entry.file}: {self._keys[name]!r} is cut short")
        block = torch.frombuffer(buffer, dtype=entry.dtype) if buffer else torch.empty(0)
        block = block.reshape(count, *entry.shape[1:]) if entry.shape else block.reshape(())
        local = block[(slice(None), *slices[1:])] if slices else block
        return local.to(like.dtype).clone(memory_format=torch.contiguous_format)


@dataclass(frozen=True)
class _Entry:
    """Where one tensor of a safetensors file lies."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    """Of its first byte in the file."""


_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip


def _read_header(file: Path) -> dict[str, _Entry]:
    """The tensors of a safetensors file: an 8-byte little-endian header length, a JSON header
    of each tensor's dtype, shape and byte range, then the data."""
    try:
        with open(file, "rb") as stream:
            length = int.from_bytes(stream.read(8), "little")
            header = json.loads(stream.read(length))
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{file} is not a safetensors file: {error}") from error
    entries = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        if info["dtype"] not in _SAFETENSORS_DTYPES:
            raise CheckpointError(f"{file}: {key!r} has dtype {info['dtype']}, not supported")
        entries[key] = _Entry(
            file, _SAFETENSORS_DTYPES[info["dtype"]], tuple(info["shape"]),
            8 + length + info["data_offsets"][0],
        )  # fmt: skip
    return entries


class _DistributedCheckpoint(Checkpoint):
    """A ``torch.distributed.checkpoint`` directory; each tensor is read whole by the ranks
    that hold a piece of it, one tensor at a time, without collectives."""

    def __init__(self, path: Path, aliases: dict[str, tuple[str, ...]]) -> None:
        # Read as fxpar's checkpoints are: DCP's own reader unpickles .metadata with pickle.
        metadata = SafeReader(str(path)).read_metadata()
        self._shapes = {
            key: tuple(entry.size)
            for key, entry in metadata.state_dict_metadata.items()
            if hasattr(entry, "size")
        }
        super().__init__(path, self._shapes, aliases)

    def read(self, name: str, piece: Piece, like: torch.Tensor) -> torch.Tensor:
        key = self._keys[name]
        self._check(name, self._shapes[key], like)
        whole = torch.empty(like.shape, dtype=like.dtype)
        dcp.load(
            {key: whole}, storage_reader=SafeReader(str(self.path)), no_dist=True
        )  # fmt: skip
        return piece.of(whole)


def _safetensors_files(path: Path) -> list[Path]:
    """Every safetensors file of a checkpoint."""
    if path.is_dir():
        if (path / _INDEX).exists():
            weight_map = json.loads((path / _INDEX).read_text())["weight_map"]
            return sorted({path / file for file in weight_map.values()})
        if (path / _SINGLE).exists():
            return [path / _SINGLE]
        raise CheckpointError(
            f"{path} holds neither {_SINGLE}, {_INDEX} nor a torch.distributed.checkpoint "
            "(.metadata)"
        )
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {path}")
    return [path]


def _aliases(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """Every parameter and buffer name, with every name of the same tensor (tied weights)."""
    by_tensor: dict[int, list[str]] = {}
    for name, tensor in named_state(model).items():
        by_tensor.setdefault(id(tensor), []).append(name)
    return {name: tuple(names) for names in by_tensor.values() for name in names}


def _cast(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return value.to(like.dtype) if value.dtype != like.dtype else value


def _missing_message(
    model: nn.Module, missing: Sequence[str], checkpoint: Checkpoint | None
) -> str:
    shown = ", ".join(repr(name) for name in missing[:4]) + (", ..." if len(missing) > 4 else "")
    kind = type(model).__name__
    if checkpoint is not None:
        return (
            f"{kind}: {len(missing)} tensors on the meta device are not in {checkpoint.path} "
            f"({shown}), and the model was not built by fxpar.deferred_init to make them"
        )
    return (
        f"{kind} has tensors on the meta device ({shown}) and nothing says what they hold: "
        "build the model with fxpar.deferred_init(Model, ...) to train the weights its "
        "constructor makes, or pass init=<checkpoint> (safetensors, or a "
        "torch.distributed.checkpoint directory) to load them"
    )


__all__ = ["Checkpoint", "Piece", "check_sources", "initial_pieces"]
