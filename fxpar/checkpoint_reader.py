"""Reading a ``torch.distributed.checkpoint`` directory without running code from it.

DCP's ``FileSystemReader`` reads the directory's ``.metadata`` with ``pickle.load``, which
builds whatever the file names: a crafted ``.metadata`` runs code on every rank that loads the
checkpoint, before any tensor is read. :class:`SafeReader` reads it with an unpickler that
builds only the classes DCP's metadata is made of (and tensors' sizes, dtypes, layouts and
paths), and refuses anything else with a :class:`~fxpar.errors.CheckpointError` naming the
file (see :mod:`fxpar.checkpoint`, "Safe to load").
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from fxpar.errors import CheckpointError

_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout by its name: torch.strided
    ("pathlib", "PosixPath"),  # where the checkpoint was saved, as DCP recorded it
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}
"""What DCP's ``.metadata`` holds besides plain data: DCP's own metadata records (dataclasses
and one enum, whose unpickling sets fields and nothing else) and the few torch and pathlib
values inside them."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_CLASSES or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")


class SafeReader(FileSystemReader):
    """DCP's file system reader, reading ``.metadata`` with :class:`_MetadataUnpickler`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        try:
            with self.fs.create_stream(path, "rb") as stream:
                metadata = _MetadataUnpickler(stream).load()
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as error:
            raise CheckpointError(
                f"cannot read the checkpoint metadata {path}: {type(error).__name__}: "
                f"{' '.join(str(error).split())[:300]}"
            ) from error
        if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
            raise CheckpointError(
                f"the checkpoint metadata {path} holds a {type(metadata).__name__}, not the "
                "metadata of a torch.distributed.checkpoint"
            )
        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata


__all__ = ["SafeReader"]
