"""Run per-rank programs on local processes, without torchrun.

:func:`spawn` starts ``world_size`` processes (start method "spawn"), joins them into one gloo
process group on 127.0.0.1 and calls ``fn(rank, world_size, *args)`` in each; it returns what
each ``fn`` returned, by rank. Inside a process, :func:`run_rank` runs one rank of a lowered
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
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import DeviceMesh
from torch.multiprocessing.spawn import ProcessException, ProcessExitedException

from fxpar.errors import FxparError
from fxpar.lowering import SPMDProgram
from fxpar.runtime.collectives import ProcessGroupCommunicator

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


class SpawnError(FxparError):
    """A process started by :func:`spawn` failed; :attr:`rank` names it, and the message carries
    its traceback (or the signal or exit code that ended it)."""

    def __init__(self, message: str, *, rank: int) -> None:
        super().__init__(message)
        self.rank = rank


def spawn(fn: Callable[..., _T], world_size: int, *args: Any, timeout_s: float = 300.0) -> list[_T]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local gloo processes.

    Each process gets ``MASTER_ADDR``/``MASTER_PORT`` (a free port chosen here), ``RANK``,
    ``LOCAL_RANK`` and ``WORLD_SIZE``, an initialized default process group whose collectives
    time out after ``timeout_s`` seconds, and destroys that group when ``fn`` ends, even on error.

    Returns:
        ``fn``'s return value of every rank, in rank order.

    Raises:
        SpawnError: a process raised or died. It names the process that failed first, with
            its traceback, and lists the others that failed after it (typically in a
            collective, because their peer was gone). The rest are terminated.
    """
    if world_size < 1:
        raise FxparError(f"spawn needs at least one process, got world_size={world_size}")
    port = _free_port()
    logger.debug("spawning %d gloo processes on 127.0.0.1:%d", world_size, port)
    with tempfile.TemporaryDirectory(prefix="fxpar-spawn-") as result_dir:
        try:
            mp.spawn(
                _run_process,
                args=(fn, world_size, port, timeout_s, result_dir, args),
                nprocs=world_size,
                start_method="spawn",
            )
        except ProcessException as error:
            raise _spawn_error(error, result_dir, world_size) from error
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
        return tuple(program.graph_module(communicator, *local_inputs))


def _run_process(
    rank: int,
    fn: Callable[..., object],
    world_size: int,
    port: int,
    timeout_s: float,
    result_dir: str,
    args: tuple[Any, ...],
) -> None:
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
    try:
        result = fn(rank, world_size, *args)
    except Exception:
        # Timestamped, so the parent can tell the first failure from its consequences.
        _error_path(result_dir, rank).write_text(f"{time.monotonic_ns()}\n{traceback.format_exc()}")
        raise
    else:
        # No rank tears the group down while a peer still has gloo traffic in flight with it
        # (seen as rare "terminate called without an active exception" aborts at exit).
        # Only on success: after a failure the parent terminates the others anyway.
        dist.barrier()
    finally:
        dist.destroy_process_group()
    torch.save(result, _result_path(result_dir, rank))


def _spawn_error(error: ProcessException, result_dir: str, world_size: int) -> SpawnError:
    # When one rank fails, its peers fail too at their next collective ("Connection closed by
    # peer"), and torch reports whichever failure the parent noticed first: name the earliest.
    raised = []  # (when, rank, traceback) of every process that raised, earliest first
    for rank in range(world_size):
        path = _error_path(result_dir, rank)
        if path.exists():
            stamp, _, trace = path.read_text().partition("\n")
            raised.append((int(stamp), rank, trace))
    raised.sort()
    if isinstance(error, ProcessExitedException) or not raised:
        rank = error.error_index
        message = (
            f"rank {rank} of {world_size} died without a Python error ({error.msg}); "
            "look for a crash or an out-of-memory kill"
        )
        later = raised
    else:
        _, rank, trace = raised[0]
        message = f"rank {rank} of {world_size} failed:\n{trace}"
        later = raised[1:]
    if later:
        message += "\nthen " + "; ".join(
            f"rank {r} failed: {trace.strip().splitlines()[-1]}" for _, r, trace in later
        )
    return SpawnError(message, rank=rank)


def _error_path(result_dir: str, rank: int) -> Path:
    return Path(result_dir) / f"rank{rank}.error"


def _result_path(result_dir: str, rank: int) -> Path:
    return Path(result_dir) / f"rank{rank}.pt"


def _free_port() -> int:
    # The port is free now; another program could take it before rank 0 binds it, a race
    # that is harmless in tests and on a developer's machine.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
