"""Reading a checkpoint directory without running code from it, or trusting its commit record.

DCP's ``FileSystemReader`` reads the directory's ``.metadata`` with ``pickle.load``, which
builds whatever the file names: a crafted ``.metadata`` runs code on every rank that loads the
checkpoint, before any tensor is read. :class:`SafeReader` reads it with an unpickler that
builds only the classes DCP's metadata is made of (and tensors' sizes, dtypes, layouts and
paths), and refuses anything else with a :class:`~fxpar.errors.CheckpointError` naming the
file (see :mod:`fxpar.checkpoint`, "Safe to load"). :func:`parsed_record` reads the commit
record as JSON of checked types and plain file names.
"""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path
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


def parsed_record(
    text: str, record_path: Path, newest: int
) -> tuple[str, dict[str, int], dict[str, str]]:
    """The version a commit record names and the size and digest (format ``newest``) of each
    of its files, checked for their types: a record is read from disk, so anything can be in
    it."""

    def refuse(problem: str) -> CheckpointError:
        return CheckpointError(f"cannot read the commit record {record_path}: {problem}")

    try:
        record = json.loads(text)
    except (ValueError, RecursionError) as error:
        raise refuse(f"not JSON ({error})") from None
    if not isinstance(record, dict):
        raise refuse(f"a JSON {type(record).__name__}, not an object")
    form = record.get("format")
    if type(form) is not int or form not in (1, newest):
        raise refuse(f"format {form!r}, expected 1 or {newest}")
    version, files = record.get("version"), record.get("files")
    if not isinstance(version, str) or not _is_plain_name(version):
        raise refuse(f"its version {version!r} is not the name of a directory beside it")
    if not isinstance(files, dict):
        raise refuse(f'"files" is {files!r}, not an object of file names')
    sizes, digests = {}, {}
    for name, entry in files.items():
        if not all(_is_plain_name(part) for part in name.split("/")):
            raise refuse(f"{name!r} is not a file name inside the version directory")
        size, digest = [*entry, None][:2] if isinstance(entry, list) else (entry, None)
        if form == newest and not (isinstance(entry, list) and len(entry) == 2):
            raise refuse(f"the entry of {name!r} is {entry!r}, not [size, SHA-256 digest]")
        if type(size) is not int or size < 0:
            raise refuse(f"the size of {name!r} is {size!r}, not a number of bytes")
        if form == newest and not (isinstance(digest, str) and _SHA256.fullmatch(digest)):
            raise refuse(f"the digest of {name!r} is {digest!r}, not a SHA-256 in hex")
        sizes[name] = size
        if digest is not None:
            digests[name] = digest
    return version, sizes, digests


_SHA256 = re.compile(r"[0-9a-f]{64}")


def _is_plain_name(name: str) -> bool:
    """Whether ``name`` names an entry of a directory (no separator, not ``.`` or ``..``)."""
    return name not in ("", ".", "..") and "/" not in name and "\\" not in name and "\0" not in name


__all__ = ["SafeReader", "parsed_record"]
