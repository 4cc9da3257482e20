"""Run per-rank programs on local processes, without torchrun.

:func:`spawn` starts ``world_size`` processes, joins them into one gloo process group on
127.0.0.1 and calls ``fn(rank, world_size, *args)`` in each; it returns what each ``fn``
returned, by rank. Inside a process, :func:`run_rank` runs one rank of a lowered
:class:`~fxpar.lowering.SPMDProgram` with collectives on the process groups of a DeviceMesh::

    def step(rank: int, world_size: int, mesh_shape: tuple[int, ...]) -> tuple[Tensor, ...]:
        model, tokens, targets = build()  # seeded: the same weights and batch in every process
        program = capture(model, (tokens,), gpt_loss, example_targets=(targets,))
        cluster = Cluster(mesh_shape)
        spmd = lower(data_parallel(program, cluster), cluster)
        flat_inputs = [p.detach() for p in model.parameters()] + [tokens, targets]
        return run_rank(spmd, rank, flat_inputs, cluster.device_mesh())

    local_outputs = spawn(step, 4, (2, 2))  # local_outputs[r]: rank r's outputs
    # lowering is deterministic: the parent lowers too, then spmd.assemble_outputs(...)

``fn`` must be picklable (a module-level function), and so must its arguments. Its return value
travels back through a ``torch.save`` file in a temporary directory of the parent, which is
robust for tensors of any size (a queue would need every child to stay alive until the parent
has read it).

Processes start from a fork server (start method ``"forkserver"``) that has imported torch,
fxpar and the parts of torch a capture loads on first use (:data:`_CAPTURE_MODULES`) once: a
process then starts in milliseconds instead of the seconds a fresh interpreter takes to import
them (paid by every call, and by every process at once where they share few cores), and its
first capture does not import hundreds of modules of its own, a large part of a small model's
first compile and step. Each process takes the caller's working directory, environment
variables and standard output and error as they are at the call, like a freshly spawned one;
what a process reads only as it starts (glibc's ``MALLOC_*`` variables, say) is the fork
server's, from when the first call started it, and so is the import path (``sys.path``) that
``fn``'s module is found on. Pass ``start_method="spawn"`` for fresh interpreters.
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing
import os
import re
import socket
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing import reduction
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import DeviceMesh
from torch.multiprocessing.spawn import ProcessException, ProcessExitedException

from fxpar.errors import FxparError
from fxpar.lowering import SPMDProgram
from fxpar.runtime import fastcall
from fxpar.runtime.communicators import ProcessGroupCommunicator

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


class SpawnError(FxparError):
    """A process started by :func:`spawn` failed; :attr:`rank` names it, and the message carries
    its traceback (or the signal or exit code that ended it). :attr:`timed_out` lists the ranks
    whose collective timed out (waiting for peers that ran other collectives, typically)."""

    def __init__(self, message: str, *, rank: int, timed_out: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.rank = rank
        self.timed_out = timed_out


_CAPTURE_MODULES = (
    "torch._dynamo",
    "torch._functorch.aot_autograd",
    "torch.fx.experimental.proxy_tensor",
)
"""What ``make_fx`` imports the first time a process captures (fake tensors load dynamo): the
fork server imports them once for every process it starts."""


def spawn(
    fn: Callable[..., _T],
    world_size: int,
    *args: Any,
    timeout_s: float = 300.0,
    start_method: Literal["forkserver", "spawn"] = "forkserver",
) -> list[_T]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local gloo processes, started by
    ``start_method`` (module docstring: the fork server is the fast one).

    Each process gets ``MASTER_ADDR``/``MASTER_PORT`` (a free port chosen here), ``RANK``,
    ``LOCAL_RANK`` and ``WORLD_SIZE``, an initialized default process group whose collectives
    time out after ``timeout_s`` seconds, and destroys that group when ``fn`` ends, even on error.

    Returns:
        ``fn``'s return value of every rank, in rank order.

    Raises:
        SpawnError: a process raised or died. It names the process that failed first, with
            its traceback, and lists the others that failed after it (typically in a
            collective, because their peer was gone). The rest are terminated. When a
            collective timed out or lost its peer, it also says where every rank was (inside
            ``fn``, or returned and in the barrier that closes every run): ranks that ran
            different collectives fail this way.
    """
    if world_size < 1:
        raise FxparError(f"spawn needs at least one process, got world_size={world_size}")
    if start_method not in ("forkserver", "spawn"):
        raise FxparError(f"start_method must be 'forkserver' or 'spawn', got {start_method!r}")
    if start_method == "forkserver":
        # Only takes effect before the fork server starts (the first call); "__main__" keeps
        # the default, so that fn may live in the script that calls spawn.
        multiprocessing.set_forkserver_preload(["__main__", "fxpar", *_CAPTURE_MODULES])
    caller = _Caller(os.getcwd(), dict(os.environ))
    port = _free_port()
    logger.debug("spawning %d gloo processes on 127.0.0.1:%d", world_size, port)
    with tempfile.TemporaryDirectory(prefix="fxpar-spawn-") as result_dir:
        try:
            mp.start_processes(
                _run_process,
                args=(fn, world_size, port, timeout_s, result_dir, caller, args),
                nprocs=world_size,
                start_method=start_method,
            )
        except ProcessException as error:
            if not _all_saved(result_dir, world_size):
                raise _spawn_error(error, result_dir, world_size, timeout_s) from error
            # Every rank returned and saved its result: a process that then dies on its way
            # out (gloo's worker threads at teardown, rarely, abort with "terminate called
            # without an active exception") lost nothing.
            logger.warning("a process died after the run had finished on every rank: %s", error)
        # weights_only=False: these files were just written by our own children and may hold
        # any picklable return value, not only tensors.
        return [
            torch.load(_result_path(result_dir, rank), weights_only=False)
            for rank in range(world_size)
        ]


def run_rank(
    spmd: SPMDProgram,
    rank: int,
    flat_global_inputs: Sequence[torch.Tensor],
    device_mesh: DeviceMesh,
) -> tuple[torch.Tensor, ...]:
    """Run rank ``rank``'s program of ``spmd`` on its pieces of ``flat_global_inputs``
    (parameters, buffers, batch, as for :meth:`fxpar.Program.__call__`), with collectives on the
    process groups of ``device_mesh``; returns its local outputs."""
    program = spmd.ranks[rank]
    mesh_coordinate = device_mesh.get_coordinate()
    here = tuple(mesh_coordinate) if mesh_coordinate is not None else None
    if tuple(device_mesh.shape) != spmd.cluster.mesh_shape or here != program.coordinate:
        # A mismatch would not fail by itself: the ranks would exchange the wrong pieces or
        # wait forever at a collective.
        raise FxparError(
            f"run_rank was asked for rank {rank} at {program.coordinate} of mesh "
            f"{spmd.cluster.mesh_shape}, but this process sits at {here} of a device mesh of "
            f"shape {tuple(device_mesh.shape)}; pass torch.distributed.get_rank() and the "
            "cluster's own device_mesh()"
        )
    local_inputs = spmd.local_inputs(flat_global_inputs, program.coordinate)
    communicator = ProcessGroupCommunicator(device_mesh)
    with torch.no_grad():
        return tuple(fastcall.run(program.graph_module, communicator, *local_inputs))


@dataclass(frozen=True)
class _Caller:
    """What a process takes from the process that called :func:`spawn`, where a forked one
    would otherwise have the fork server's: the working directory, the environment, and
    standard output and error (the file descriptors, so that what a process prints goes
    where the caller's own output goes now, a capture by pytest's ``capfd`` included)."""

    cwd: str
    environ: dict[str, str]

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled as the process starts: DupFd hands the descriptors over with it.
        outputs = tuple(reduction.DupFd(fd) for fd in (1, 2))
        return _Caller._adopt, (self.cwd, self.environ, outputs)

    @staticmethod
    def _adopt(cwd: str, environ: dict[str, str], outputs: tuple[Any, ...]) -> _Caller:
        for fd, duplicate in zip((1, 2), outputs, strict=True):
            os.dup2(duplicate.detach(), fd)
        return _Caller(cwd, environ)


def _run_process(
    rank: int,
    fn: Callable[..., object],
    world_size: int,
    port: int,
    timeout_s: float,
    result_dir: str,
    caller: _Caller,
    args: tuple[Any, ...],
) -> None:
    os.chdir(caller.cwd)
    os.environ.clear()
    os.environ.update(caller.environ)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )
    dist.init_process_group(
        "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s)
    )
    # The closing barrier runs on a group of its own, so that it never pairs with a collective
    # inside fn: a rank that returned early cannot let a peer's extra collective complete.
    closing = dist.new_group(backend="gloo")
    try:
        try:
            result = fn(rank, world_size, *args)
            # Saved before the closing barrier, so that once any rank has passed it every
            # result is on disk, whichever process dies on its way out. The file also tells
            # the parent that this rank returned.
            saving = _result_path(result_dir, rank).with_suffix(".partial")
            torch.save(result, saving)
            saving.replace(_result_path(result_dir, rank))  # whole, or not there at all
        except Exception:
            _record_failure(result_dir, rank, _IN_FN)
            raise
        try:
            # No rank tears the group down while a peer still has gloo traffic in flight with
            # it (seen as rare "terminate called without an active exception" aborts at exit).
            # Only on success: after a failure the parent terminates the others anyway.
            dist.barrier(group=closing)
        except Exception:
            _record_failure(result_dir, rank, _IN_BARRIER)
            raise
        _passed_path(result_dir, rank).touch()
    finally:
        dist.destroy_process_group()


def _all_saved(result_dir: str, world_size: int) -> bool:
    return all(_result_path(result_dir, rank).exists() for rank in range(world_size))


_IN_FN = "fn"
_IN_BARRIER = "barrier"
_TIMEOUT = re.compile(r"time[sd]?[ -]?out", re.IGNORECASE)


def _record_failure(result_dir: str, rank: int, where: str) -> None:
    # Timestamped, so the parent can tell the first failure from its consequences; written
    # aside and renamed, so the parent never reads it half written.
    path = _error_path(result_dir, rank)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(f"{time.monotonic_ns()} {where}\n{traceback.format_exc()}")
    os.replace(partial, path)


@dataclass(frozen=True)
class _Failure:
    """What one rank recorded when it raised: when, where (inside fn or in the closing
    barrier), and its traceback."""

    when: int
    rank: int
    where: str
    trace: str

    @property
    def last_line(self) -> str:
        lines = self.trace.strip().splitlines()
        return lines[-1] if lines else "(no traceback)"

    @property
    def timed_out(self) -> bool:
        return bool(_TIMEOUT.search(self.last_line))

    @property
    def in_collective(self) -> bool:
        return self.where == _IN_BARRIER or "torch/distributed" in self.trace.replace("\\", "/")


def _spawn_error(
    error: ProcessException, result_dir: str, world_size: int, timeout_s: float
) -> SpawnError:
    # When one rank fails, its peers fail too at their next collective ("Connection closed by
    # peer"), and torch reports whichever failure the parent noticed first: name the earliest.
    # A failure in spawn's closing barrier is always a consequence (of a peer that is gone or
    # busy elsewhere), so a failure inside fn comes first when there is one.
    failures = sorted(
        (
            _read_failure(path, rank)
            for rank in range(world_size)
            if (path := _error_path(result_dir, rank)).exists()
        ),
        key=lambda failure: (failure.where == _IN_BARRIER, failure.when, failure.rank),
    )
    if isinstance(error, ProcessExitedException) or not failures:
        rank = error.error_index
        if isinstance(error, ProcessExitedException):
            message = (
                f"rank {rank} of {world_size} died without a Python error ({error.msg}); "
                "look for a crash or an out-of-memory kill"
            )
        else:  # raised outside fn: joining or leaving the process group
            message = f"rank {rank} of {world_size} failed outside fn:\n{error.msg}"
        later = failures
    else:
        first = failures[0]
        rank, later = first.rank, failures[1:]
        if first.where == _IN_BARRIER:
            message = (
                f"rank {rank} of {world_size} returned from fn but failed in spawn's closing "
                f"barrier (every rank enters it after fn returns):\n{first.trace}"
            )
        else:
            message = f"rank {rank} of {world_size} failed:\n{first.trace}"
    if later:
        message += "\nthen " + "; ".join(
            f"rank {f.rank} failed{' in the closing barrier' if f.where == _IN_BARRIER else ''}: "
            f"{f.last_line}"
            for f in later
        )
    timed_out = tuple(sorted(f.rank for f in failures if f.timed_out))
    returned = [r for r in range(world_size) if _result_path(result_dir, r).exists()]
    if timed_out or (failures and failures[0].in_collective and returned):
        message += "\n" + _collectives_summary(
            failures, returned, result_dir, world_size, timeout_s
        )
    return SpawnError(message, rank=rank, timed_out=timed_out)


def _read_failure(path: Path, rank: int) -> _Failure:
    header, _, trace = path.read_text().partition("\n")
    stamp, _, where = header.partition(" ")
    return _Failure(int(stamp), rank, where or _IN_FN, trace)


def _collectives_summary(
    failures: Sequence[_Failure],
    returned: Sequence[int],
    result_dir: str,
    world_size: int,
    timeout_s: float,
) -> str:
    """Where each rank was when a collective timed out or lost its peer: the usual cause is
    ranks that do not run the same collectives."""
    groups: dict[str, list[int]] = {}
    for failure in failures:
        if failure.where == _IN_BARRIER:
            state = "returned but failed in the closing barrier"
            if failure.timed_out:
                state = f"returned and timed out after {timeout_s:g} s in the closing barrier"
        elif failure.timed_out:
            state = f"timed out after {timeout_s:g} s in a collective inside fn"
        elif failure.in_collective:
            state = "failed in a collective inside fn"
        else:
            state = "raised inside fn"
        groups.setdefault(state, []).append(failure.rank)
    failed = {failure.rank for failure in failures}
    passed = [r for r in returned if r not in failed and _passed_path(result_dir, r).exists()]
    if passed:
        groups["returned and passed the closing barrier"] = passed
    waiting = [r for r in returned if r not in failed and r not in passed]
    if waiting:
        groups["returned and waited in the closing barrier"] = waiting
    busy = [r for r in range(world_size) if r not in failed and r not in returned]
    if busy:
        groups["still inside fn when stopped"] = busy
    where = "; ".join(f"{_ranks(ranks)} {state}" for state, ranks in groups.items())
    cause = (
        "likely the ranks ran different collectives (one skipped a collective or ran an extra "
        "one, so a collective paired with the wrong partner or waited for one that never came)"
    )
    if busy and any(f.timed_out for f in failures):
        cause += (
            f", or {_ranks(busy)} spent longer than timeout_s={timeout_s:g} s before its next "
            "collective"
        )
    return f"{where}: {cause}. Make every rank call the same collectives in the same order"


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _error_path(result_dir: str, rank: int) -> Path:
    return Path(result_dir) / f"rank{rank}.error"


def _passed_path(result_dir: str, rank: int) -> Path:
    return Path(result_dir) / f"rank{rank}.passed"


def _result_path(result_dir: str, rank: int) -> Path:
    return Path(result_dir) / f"rank{rank}.pt"


def _free_port() -> int:
    # The port is free now; another program could take it before rank 0 binds it, a race
    # that is harmless in tests and on a developer's machine.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
