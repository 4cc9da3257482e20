"""Sharded checkpoints shared by :class:`~fxpar.runtime.parallel.ParallelModel` and
:class:`~fxpar.pipeline.PipelineModel`.

A checkpoint stores every tensor under a name of the model, not of a rank:
``model/<parameter or buffer>``, ``optimizer/<parameter>/<slot>``, ``steps`` and ``random``
(fxpar's random state, :mod:`fxpar.ir.rng`), each rank contributing its local pieces as DTensors
with their global shape and placements (a plain tensor when there is no process group). So a
checkpoint written under one mesh, plan or pipeline loads under any other: each rank reads just
the pieces its own layout needs, and a stage reads only the entries it holds.

**Atomic.** The directory ``path`` holds versions, each a complete
``torch.distributed.checkpoint`` directory, and a commit record, ``fxpar-checkpoint.json``,
naming the current version and listing its files with their sizes and SHA-256 digests. A save
writes a new version
beside the current one; only once every rank has finished writing does rank 0 replace the
record (write to a temporary file, then ``os.replace``, which is atomic), and only then are
older versions deleted. A save that dies part way (a rank killed, a full disk) leaves the
record, and so the previous checkpoint, as it was. A load reads only the committed version, and
refuses a directory without a record (an interrupted first save, or not an fxpar checkpoint) or
whose files differ from the record's list: a file missing, of another size, or whose bytes no
longer hash to the digest committed (a flipped bit inside tensor data would otherwise load a
different model without a word). Every rank digests its share of the files, on save and on
load, so the check costs one read of the checkpoint spread over the ranks. SHA-256, because it
is the fastest of hashlib's digests where CPUs have instructions for it (x86's SHA extensions,
ARMv8's cryptography extension): there it runs about as fast as a checksum, several times
BLAKE2b's speed, and is still a cryptographic digest.

Every failure of ``torch.distributed.checkpoint`` or of the file system reaches the caller as a
:class:`~fxpar.errors.CheckpointError` naming the checkpoint (DCP's own ``CheckpointException``
derives from ``BaseException`` and would pass through ``except Exception``).

**Strict.** A load compares the checkpoint's entries with the whole model's (every parameter
and buffer, ``steps`` and ``random``): an entry the model lacks, or a model entry the checkpoint
lacks, is a :class:`~fxpar.errors.CheckpointError` naming them, unless ``strict=False``, which
loads the entries both have, as :meth:`torch.nn.Module.load_state_dict` does. Optimizer state
may be missing (a checkpoint saved before the first step has none; it starts from zero), but
state for a parameter this model lacks, or a slot its optimizer does not keep (Adam's moments
loaded into SGD), is unexpected too.

**Complete.** Besides the tensors, rank 0 writes ``optimizer_groups`` (the optimizer's
hyperparameters per parameter group: the learning rate a scheduler set, ``initial_lr``, betas,
...) and, when the caller gives one, ``extra``: any picklable object of the user's (an LR
scheduler's ``state_dict()``, the data loader's position), returned by the load.

**Safe to load.** Loading never runs code from the files. Both entries are written with
``torch.save`` and read back with ``torch.load(weights_only=True)``, whose unpickler builds
tensors, numbers, strings, lists, tuples and dicts and nothing else; an entry holding other
objects (an instance of a class of yours, a function) is refused with a
:class:`~fxpar.errors.CheckpointError` before anything in it is built, unless the load says
``trusted=True``. Checkpoints shared or downloaded are then as safe to load as their tensors.
A checkpoint without these entries loads as it is (its optimizer keeps its hyperparameters,
and ``extra`` is None); one whose entries are plain pickles rather than ``torch.save``
archives loads only with ``trusted=True``, as unpickling them can run code.

**In the background.** ``save(path, blocking=False)`` (and :func:`save_step`) returns a
:class:`PendingSave` once this rank's state is copied to host memory (a copy of its pieces:
the checkpoint holds the state at the call, whatever the steps after it change), while a
thread writes the copy and commits it exactly as a blocking save does, the commit record last.
A save that fails or dies part way commits nothing; ``wait()`` returns once the record is
written, or raises the failure as a :class:`~fxpar.errors.CheckpointError` (on every rank: each
step of the save ends in a collective that tells every rank whether it failed anywhere). The
thread's collectives run over a gloo process group of their own, made on the first such save,
so that they never interleave with the training step's. One save is written at a time: a save
or load while one is in flight waits for it first, and raises its failure if no ``wait()``
has (:class:`BackgroundSaves`).

**Resumable runs.** A run that saves periodically keeps one checkpoint per step under a root
directory, ``<root>/step-<N>``: :func:`save_step` writes them, :func:`resume` loads the newest
committed one (a save interrupted before its commit is passed over) and returns its step and
``extra``, and :func:`latest` finds it, warning of directories under the root that are not
named as step checkpoints.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import threading
import uuid
import warnings
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar, overload

import torch
import torch.distributed as dist

from fxpar import ir
from fxpar.checkpoint_objects import EXTRA, GROUPS
from fxpar.checkpoint_reader import SafeReader, parsed_record
from fxpar.errors import CheckpointError
from fxpar.ir.program import Signature
from fxpar.ir.rng import RandomState
from fxpar.optim import Optimizer
from fxpar.sharding import Spec

Wrap = Callable[[str, torch.Tensor], Any]
"""Turns the local piece of the named parameter (or of a state slot shaped like it) into what
the checkpoint stores: a DTensor, or the tensor itself without a process group."""

logger = logging.getLogger(__name__)

RECORD = "fxpar-checkpoint.json"
"""The commit record's file name, inside the checkpoint directory."""
_FORMAT = 2
"""Format 2 records each file's size and digest; format 1 (sizes only) loads too."""
_DIGEST_CHUNK = 16 * 2**20
_Agreed = TypeVar("_Agreed")


def save(state: Mapping[str, Any], path: str | os.PathLike[str], *, distributed: bool) -> None:
    """Write ``state`` (names to DTensors or tensors) as a new version of the checkpoint at
    ``path`` and commit it (see the module docstring). A collective when ``distributed``."""
    version = _begin(path, distributed)
    _write_and_commit(state, path, version, distributed, group=None)


def _begin(path: str | os.PathLike[str], distributed: bool) -> str:
    """Make the directory ``path`` and return the name of the version a save writes there,
    the same on every rank."""
    failure = None
    if not distributed or dist.get_rank() == 0:
        try:
            Path(path).mkdir(parents=True, exist_ok=True)
        except OSError as error:
            failure = f"{type(error).__name__}: {error}"
    version, failure = _agree((f"v-{uuid.uuid4().hex[:16]}", failure), distributed)
    if failure is not None:
        raise CheckpointError(f"cannot make the checkpoint directory {path}: {failure}")
    return version


def _write_and_commit(
    state: Mapping[str, Any],
    path: str | os.PathLike[str],
    version: str,
    distributed: bool,
    group: Any,
) -> None:
    """Write ``state`` into ``path/version``, digest what every rank wrote and commit it: the
    body of a save, on the calling thread or a background one (with ``group``, a process
    group of its own). Every failure is a CheckpointError on every rank: each step ends in a
    collective that tells every rank whether it failed anywhere."""
    from torch.distributed import checkpoint as dcp

    root = Path(path)
    with warnings.catch_warnings(), _typed_errors(f"writing the checkpoint at {path}"):
        # A one-device model saves without a process group, which is what torch warns of.
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.save(dict(state), checkpoint_id=os.fspath(root / version), process_group=group)
    # Every rank has written its files, and synced them to disk (DCP's FileSystemWriter
    # fsyncs each by default); a rank that died made the collective above fail.
    _settle(distributed, group)
    digests = _digests(
        path, root / version, _share(root / version, distributed), distributed, group
    )
    failure = None
    if not distributed or dist.get_rank() == 0:
        try:
            _commit(root, version, digests)
        except OSError as error:
            failure = f"{type(error).__name__}: {error}"
    failure = _agree(failure, distributed, group)
    if failure is not None:
        raise CheckpointError(f"committing the checkpoint at {path} failed on rank 0: {failure}")
    _settle(distributed, group)


class PendingSave:
    """A checkpoint being written in the background, returned by ``save(..., blocking=False)``
    (and :func:`save_step`): :meth:`wait` for it to be committed, :meth:`done` to ask.

    Attributes:
        path: the checkpoint's directory.
    """

    def __init__(self, path: Path, write: Callable[[], None]) -> None:
        self.path = path
        self._failure: CheckpointError | None = None
        self._reported = False
        # Not a daemon: a script that ends without waiting still finishes (and commits) the
        # save before the interpreter exits.
        self._thread = threading.Thread(
            target=self._run, args=(write,), name=f"fxpar save to {path}", daemon=False
        )
        self._thread.start()

    def _run(self, write: Callable[[], None]) -> None:
        try:
            write()
        except CheckpointError as error:
            self._failure = error
        except BaseException as error:  # the thread's end: nothing above it would see it
            failure = CheckpointError(
                f"the background save to {self.path} failed: {type(error).__name__}: {error}"
            )
            failure.__cause__ = error
            self._failure = failure

    def done(self) -> bool:
        """Whether the save has ended, committed or failed (:meth:`wait` says which)."""
        return not self._thread.is_alive()

    def wait(self) -> Path:
        """Block until the save has ended; return :attr:`path` once it is committed on every
        rank (every rank's files written and synced, the digests in the commit record).

        Raises:
            CheckpointError: the save failed (on any rank); nothing was committed, and the
                checkpoint at :attr:`path` is the one before it, if any.
        """
        self._thread.join()
        if self._failure is not None:
            self._reported = True
            raise self._failure
        return self.path

    def _finish(self) -> None:
        """:meth:`wait`, raising a failure only if no :meth:`wait` has raised it already."""
        self._thread.join()
        if self._failure is not None and not self._reported:
            self.wait()

    def __repr__(self) -> str:
        state = "writing" if not self.done() else "failed" if self._failure else "committed"
        return f"PendingSave({os.fspath(self.path)!r}, {state})"


class BackgroundSaves:
    """The saves a model writes in the background, one at a time, over a process group of
    their own (made on the first, a collective), so that they never interleave with the
    collectives of the training steps that run meanwhile."""

    def __init__(self) -> None:
        self._pending: PendingSave | None = None
        self._group: Any = None

    def start(
        self, state: Mapping[str, Any], path: str | os.PathLike[str], *, distributed: bool
    ) -> PendingSave:
        """Stage ``state`` (copy every tensor to host memory, now) and write and commit the
        copy on a background thread, after the save in flight, if any, has ended. A
        collective when ``distributed``.

        Raises:
            CheckpointError: the previous background save failed and no ``wait()`` reported
                it, or ``path`` cannot be made.
        """
        self.finish()
        if distributed and self._group is None:
            self._group = dist.new_group(backend="gloo")
        version = _begin(path, distributed)
        with _typed_errors(f"staging the checkpoint at {path}"):
            staged = {key: _staged(value) for key, value in state.items()}
        group = self._group

        def write() -> None:
            _write_and_commit(staged, path, version, distributed, group)

        self._pending = PendingSave(Path(path), write)
        return self._pending

    def finish(self) -> None:
        """Wait for the save in flight, if any, and raise its failure if no ``wait()`` has."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending._finish()


@torch.no_grad()
def _staged(value: Any) -> Any:
    """A copy of ``value`` in host memory, if a tensor or DTensor (which stays a DTensor of
    the same mesh and layout); the value itself otherwise (the byte streams of
    :func:`~fxpar.checkpoint_objects.object_entries` are made for each save)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    return value


def load(
    state: Mapping[str, Any],
    path: str | os.PathLike[str],
    *,
    distributed: bool,
    expected: Entries,
    strict: bool = True,
) -> dict[str, Any]:
    """Read the entries of ``state`` that the committed checkpoint at ``path`` has, in place
    into its DTensors (plain tensors are filled in the returned dict: copy them back).
    ``expected`` names every entry the whole model saves (a pipeline stage's ``state`` holds
    only its own); with ``strict``, the checkpoint must hold exactly those (see the module
    docstring), with the same global shapes.

    Raises:
        CheckpointError: there is no committed checkpoint at ``path``, its files are not those
            it committed, it is another model's (``strict``), or an entry's shape differs.
    """
    from torch.distributed import checkpoint as dcp

    version, digests = _committed(path)
    _check_digests(path, version, digests, distributed)
    metadata = SafeReader(os.fspath(version)).read_metadata()
    saved = metadata.state_dict_metadata
    # The metadata's records are DCP's classes, but their fields hold whatever the file did.
    with _typed_errors(f"reading the metadata of the checkpoint at {path}"):
        if strict:
            expected.check(saved, path)
        for key, value in state.items():
            size = getattr(saved.get(key), "size", None)
            if size is not None and tuple(size) != tuple(value.shape):
                raise CheckpointError(
                    f"{key} is {list(size)} in the checkpoint at {path} but "
                    f"{list(value.shape)} in this model"
                )
        wanted = {key: value for key, value in state.items() if key in saved}
    with warnings.catch_warnings(), _typed_errors(f"reading the checkpoint at {path}"):
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(wanted, storage_reader=SafeReader(os.fspath(version)))
    _settle(distributed)
    return wanted


def committed_version(path: str | os.PathLike[str]) -> Path:
    """The directory of the version the checkpoint at ``path`` committed, after checking that
    its files are the ones the record lists.

    Raises:
        CheckpointError: no record (nothing saved there, an interrupted first save, or not an
            fxpar checkpoint), or files missing or changed since the commit.
    """
    return _committed(path)[0]


def _committed(path: str | os.PathLike[str]) -> tuple[Path, dict[str, str]]:
    """:func:`committed_version`, and the digest the record committed for each file (none
    in a format 1 record)."""
    root = Path(path)
    record_path = root / RECORD
    try:
        text = record_path.read_text(encoding="utf-8")
    except FileNotFoundError:
        found = "nothing" if not root.exists() else f"{sorted(p.name for p in root.iterdir())}"
        raise CheckpointError(
            f"cannot read a checkpoint at {path}: it has no commit record ({RECORD}; found "
            f"{found}). A save there was interrupted before every rank finished, or this is "
            "not a checkpoint written by fxpar's save"
        ) from None
    except (OSError, ValueError) as error:  # UnicodeDecodeError is a ValueError
        raise CheckpointError(f"cannot read the commit record {record_path}: {error}") from error
    version, sizes, digests = parsed_record(text, record_path, _FORMAT)
    directory = root / version
    damaged = []
    for name, size in sizes.items():
        file = directory / name
        if not file.is_file():
            damaged.append(f"{name} is missing")
        elif file.stat().st_size != size:
            damaged.append(f"{name} has {file.stat().st_size} bytes, committed {size}")
    unlisted = sorted(
        str(file.relative_to(directory))
        for file in (directory.rglob("*") if directory.is_dir() else ())
        if file.is_file() and str(file.relative_to(directory)) not in sizes
    )
    damaged += [f"{name} is not in the record" for name in unlisted]
    if damaged:
        raise CheckpointError(
            f"the checkpoint at {path} is damaged: {'; '.join(damaged[:3])} "
            f"({len(damaged)} files differ from its commit record); restore it, or load "
            "another checkpoint"
        )
    return directory, digests


STEP_PREFIX = "step-"
"""The name of a step checkpoint's directory under its run's root: ``step-<N>``."""


class Checkpointable(Protocol):
    """What :func:`save_step` and :func:`resume` need of a model: a
    :class:`~fxpar.runtime.parallel.ParallelModel` or a :class:`~fxpar.pipeline.PipelineModel`."""

    def save(
        self, path: str | os.PathLike[str], *, extra: object = None, blocking: bool = True
    ) -> PendingSave | None: ...

    def load(
        self, path: str | os.PathLike[str], *, strict: bool = True, trusted: bool = False
    ) -> Any: ...


def step_directory(root: str | os.PathLike[str], step: int) -> Path:
    """Where :func:`save_step` writes step ``step``'s checkpoint: ``<root>/step-<N>``, ``N``
    padded to 6 digits so that listings sort by step (:func:`latest` reads any width)."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"a checkpoint's step is a whole number >= 0, got {step!r}")
    return Path(root) / f"{STEP_PREFIX}{step:06d}"


@overload
def save_step(
    model: Checkpointable,
    root: str | os.PathLike[str],
    step: int,
    *,
    extra: object = None,
    blocking: Literal[True] = True,
) -> Path: ...


@overload
def save_step(
    model: Checkpointable,
    root: str | os.PathLike[str],
    step: int,
    *,
    extra: object = None,
    blocking: Literal[False],
) -> PendingSave: ...


def save_step(
    model: Checkpointable,
    root: str | os.PathLike[str],
    step: int,
    *,
    extra: object = None,
    blocking: bool = True,
) -> Path | PendingSave:
    """Save ``model`` as the checkpoint of step ``step`` of the run kept under ``root``, in
    ``<root>/step-<N>`` (:func:`step_directory`), where :func:`resume` finds it; returns that
    directory. The save is the model's own ``save(path, extra=extra)``: atomic (a save killed
    part way leaves no committed checkpoint there, and :func:`resume` passes over it), with the
    optimizer state, step count, random state and your picklable ``extra`` (a scheduler's
    ``state_dict()``, the data position). A collective: call it on every rank.

    ``blocking=False``: return at once with a :class:`PendingSave` (its ``wait()`` returns the
    directory once committed) while the state as it is now is written in the background (see
    the model's ``save``)."""
    path = step_directory(root, step)
    if blocking:
        model.save(path, extra=extra)
        return path
    pending = model.save(path, extra=extra, blocking=False)
    if not isinstance(pending, PendingSave):
        raise CheckpointError(
            f"{type(model).__name__}.save(blocking=False) returned {pending!r}, not the "
            "PendingSave of a save written in the background"
        )
    return pending


def resume(
    model: Checkpointable, root: str | os.PathLike[str], *, trusted: bool = False
) -> tuple[int, Any] | None:
    """Load the newest committed checkpoint that :func:`save_step` wrote under ``root``
    (:func:`latest`) into ``model`` and return ``(step, extra)``: the step it was saved as and
    the ``extra`` saved with it (None if none). Returns None, loading nothing, when ``root``
    holds no committed step checkpoint (a first run; ``root`` need not exist). ``root`` must
    be the same directory on every rank (a shared file system), as for ``load``. A collective
    when it loads: call it on every rank.

    ``trusted``: as for ``load``, let ``extra`` hold objects other than plain data.

    Raises:
        CheckpointError: the checkpoint found is another model's, or its ``extra`` holds
            objects other than plain data without ``trusted`` (see ``load``).
    """
    found = latest(root)
    if found is None:
        return None
    extra = model.load(found, trusted=trusted)
    return int(found.name.removeprefix(STEP_PREFIX)), extra


def latest(root: str | os.PathLike[str], prefix: str = STEP_PREFIX) -> Path | None:
    """The newest committed checkpoint among the directories ``<root>/<prefix><N>``: the one
    with the largest ``N`` whose commit record and files check out, or None. For runs that save
    periodically into step directories and resume from the last (:func:`save_step` and
    :func:`resume` name, find and load them).

    Only ``<prefix><N>`` names are step checkpoints: a warning is logged (``logging``, logger
    ``fxpar.checkpoint``) for every other directory under ``root`` (``ckpt_20`` would otherwise
    be passed over without a word, and a run restart from step 0), for a ``root`` that is
    itself a checkpoint rather than the directory of a run's step checkpoints, and for each
    newer step directory passed over because its save was interrupted before its commit."""
    found, unknown = [], []
    base = Path(root)
    if (base / RECORD).is_file():
        logger.warning(
            "%s is itself a checkpoint, not a directory of step checkpoints %s<N>: load it "
            "with the model's load(), or save steps with fxpar.checkpoint.save_step",
            base,
            prefix,
        )
    for directory in sorted(base.iterdir()) if base.is_dir() else ():
        if not directory.is_dir():
            continue
        number = directory.name.removeprefix(prefix)
        if directory.name.startswith(prefix) and number.isdigit():
            found.append((int(number), directory))
        else:
            unknown.append(directory)
    if unknown:
        names = [f"{d.name} (a checkpoint)" if (d / RECORD).is_file() else d.name for d in unknown]
        logger.warning(
            "%s holds directories that are not step checkpoints %s<N>, passed over: %s; "
            "rename a checkpoint among them to %s<N> (its step) to resume from it",
            base,
            prefix,
            ", ".join(names),
            prefix,
        )
    for _, directory in sorted(found, reverse=True):
        try:
            committed_version(directory)
        except CheckpointError as error:
            logger.warning("passing over %s: %s", directory, error)
            continue
        return directory
    return None


class Entries:
    """The entries a whole model's checkpoint holds: the required ones (parameters and
    buffers, ``steps``, ``random``) and the optional optimizer slots."""

    def __init__(self, signature: Signature, optimizer: Optimizer) -> None:
        state_names = signature.parameters + signature.buffers
        self.required = frozenset({"steps", "random", *(f"model/{n}" for n in state_names)})
        # Per-parameter counters (Adam's "step") are kept beside the slots shaped like it.
        slots = (*optimizer.state_keys, "step")
        self.optional = frozenset(
            {
                *(f"optimizer/{name}/{slot}" for name in signature.gradients for slot in slots),
                GROUPS,
                EXTRA,
            }
        )

    def check(self, saved: Collection[str], path: str | os.PathLike[str]) -> None:
        """Raise unless ``saved`` holds every required entry and nothing unknown."""
        missing = sorted(self.required.difference(saved))
        unexpected = sorted(set(saved) - self.required - self.optional)
        if missing or unexpected:
            problems = []
            if unexpected:
                problems.append(f"entries this model lacks: {_listed(unexpected)}")
            if missing:
                problems.append(f"no entry for {_listed(missing)}")
            raise CheckpointError(
                f"the checkpoint at {path} does not match this model ({'; '.join(problems)}): "
                "it was saved from a different model or optimizer. Pass strict=False to load "
                "the entries both have"
            )


def _listed(keys: Sequence[str]) -> str:
    shown = ", ".join(keys[:5])
    return shown + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")


def _commit(root: Path, version: str, digests: Mapping[str, str]) -> None:
    """Point the record at ``version`` (atomically), with each file's size and ``digests``,
    then delete every other version."""
    directory = root / version
    files = {name: [(directory / name).stat().st_size, digests[name]] for name in digests}
    record = {"format": _FORMAT, "version": version, "files": files}
    temporary = root / f".{RECORD}.{version}.tmp"
    with open(temporary, "w") as stream:
        json.dump(record, stream, indent=1)
        stream.flush()
        os.fsync(stream.fileno())
    os.replace(temporary, root / RECORD)
    _sync_directory(root)  # the rename itself survives a power cut
    for entry in root.iterdir():
        if entry.is_dir() and entry.name.startswith("v-") and entry.name != version:
            shutil.rmtree(entry, ignore_errors=True)


_PASSING = (KeyboardInterrupt, SystemExit, GeneratorExit)
"""What a typed error lets through: the user's interrupt and the process's exit."""


@contextlib.contextmanager
def _typed_errors(doing: str) -> Iterator[None]:
    """Re-raise any failure inside the block (DCP's ``CheckpointException`` is a
    ``BaseException``) as a :class:`~fxpar.errors.CheckpointError` saying what was being
    done; interrupts and exits pass as they are."""
    try:
        yield
    except CheckpointError:
        raise
    except BaseException as error:
        if isinstance(error, _PASSING):
            raise
        raise CheckpointError(f"{doing} failed: {_described(error)[:600]}") from error


def _described(error: BaseException) -> str:
    """``error`` on one line; for DCP's ``CheckpointException``, each failed rank's own error
    (its text is mostly their tracebacks, which would push the errors out of the message)."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        return "; ".join(
            f"rank {rank}: {_described(failure[0] if isinstance(failure, tuple) else failure)}"
            for rank, failure in sorted(failures.items())
        )
    return f"{type(error).__name__}: {' '.join(str(error).split())}"


def _share(directory: Path, distributed: bool) -> list[str]:
    """The files of ``directory`` this rank digests: every ``world``-th, from its rank."""
    names = sorted(str(f.relative_to(directory)) for f in directory.rglob("*") if f.is_file())
    if not distributed:
        return names
    return names[dist.get_rank() :: dist.get_world_size()]


def _digest(file: Path) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as stream:
        while chunk := stream.read(_DIGEST_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _sync_directory(directory: Path) -> None:
    if os.name != "posix":
        return
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _digests(
    path: str | os.PathLike[str],
    directory: Path,
    names: Sequence[str],
    distributed: bool,
    group: Any = None,
) -> dict[str, str]:
    """Every file's digest, each rank hashing ``names`` (its share): on every rank. A rank
    that cannot read its share makes every rank raise (none waits for it)."""
    mine: dict[str, str] = {}
    failure = None
    try:
        mine = {name: _digest(directory / name) for name in names}
    except OSError as error:
        failure = f"{type(error).__name__}: {error}"
    everyone: list[Any] = [(mine, failure)]
    if distributed:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (mine, failure), group=group)
    failures = [f"rank {rank}: {text}" for rank, (_, text) in enumerate(everyone) if text]
    if failures:
        raise CheckpointError(
            f"digesting the checkpoint at {path} failed: {'; '.join(failures)[:600]}"
        )
    return {name: value for part, _ in everyone for name, value in part.items()}


def _check_digests(
    path: str | os.PathLike[str],
    directory: Path,
    committed: Mapping[str, str],
    distributed: bool,
) -> None:
    """Raise :class:`~fxpar.errors.CheckpointError` on every rank if a file of the committed
    version no longer hashes to its ``committed`` digest (each rank hashes its share). A
    format 1 record commits none: nothing to hash."""
    if not committed:
        return
    found = _digests(path, directory, _share(directory, distributed), distributed)
    changed = sorted(
        name for name, digest in found.items() if name in committed and committed[name] != digest
    )
    if changed:
        raise CheckpointError(
            f"the checkpoint at {path} is damaged: {', '.join(changed[:3])} no longer "
            f"match{'es' if len(changed) == 1 else ''} the digest committed with "
            f"{'it' if len(changed) == 1 else 'them'} ({len(changed)} files changed since the "
            "save, same sizes); restore it, or load another checkpoint"
        )


def _agree(proposal: _Agreed, distributed: bool, group: Any = None) -> _Agreed:
    """Rank 0's ``proposal``, on every rank (of ``group``, or the default process group)."""
    if not distributed:
        return proposal
    chosen = [proposal]
    dist.broadcast_object_list(chosen, src=0, group=group)
    return chosen[0]


def progress_entries(steps: int, random: RandomState) -> dict[str, torch.Tensor]:
    """The entries of a run's progress: the step count and fxpar's random state (the same on
    every rank), so a resumed run draws the numbers an uninterrupted one would."""
    return {"steps": torch.tensor(steps, dtype=torch.int64), "random": random.state.clone()}


def restore_progress(loaded: Mapping[str, Any], steps: int, random: RandomState) -> int:
    """Set ``random`` from a load's entries and return the loaded step count (``steps``, and
    ``random`` as it was, where a non-strict load found none)."""
    if "random" in loaded:
        random.state = loaded["random"].clone()
    return int(loaded["steps"].item()) if "steps" in loaded else steps


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


def _settle(distributed: bool, group: Any = None) -> None:
    # torch.distributed.checkpoint returns while gloo work it started can still be in flight
    # on some ranks; a process that then tears down its process group (or exits) aborts with
    # "terminate called without an active exception" about a third of the time on 2 ranks. A
    # barrier lets every rank's checkpoint traffic finish first.
    if distributed:
        dist.barrier(group=group)


def _contiguous_strides(shape: Sequence[ir.Size]) -> tuple[int, ...]:
    strides, running = [], 1
    for size in reversed(shape):
        strides.append(running)
        running *= int(size)
    return tuple(reversed(strides))
