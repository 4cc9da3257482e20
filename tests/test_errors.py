"""fxpar's errors cross process boundaries intact, and :func:`fxpar.runtime.launch.spawn` says
what went wrong when ranks disagree about their collectives.

Every subclass of :class:`fxpar.errors.FxparError` anywhere in the package (found by importing
every module, so a new error class is covered without touching this file) survives a pickle
round trip with its type, message and attributes: ``SolvedOnRankZero`` and
``torch.distributed``'s object collectives re-raise rank 0's error on the other ranks this way.
"""

from __future__ import annotations

import importlib
import inspect
import pickle
import pkgutil
import re
import time
from types import ModuleType

import pytest
import torch
import torch.distributed as dist

import fxpar
import fxpar.passes
import fxpar.solvers
from fxpar.errors import FxparError
from fxpar.runtime.launch import SpawnError, spawn


def _all_modules() -> list[ModuleType]:
    modules = []
    # passes/ and solvers/ are installed as fxpar.passes and fxpar.solvers but live beside
    # fxpar/, so walking fxpar's own path alone would miss them.
    for package in (fxpar, fxpar.passes, fxpar.solvers):
        modules.append(package)
        for info in pkgutil.walk_packages(package.__path__, prefix=f"{package.__name__}."):
            if info.name.endswith("__main__"):
                continue  # runs the CLI on import
            modules.append(importlib.import_module(info.name))
    return modules


def _subclasses(cls: type) -> set[type]:
    found = set()
    for sub in cls.__subclasses__():
        found |= {sub, *_subclasses(sub)}
    return found


def fxpar_errors() -> list[type[FxparError]]:
    _all_modules()
    found = {c for c in _subclasses(FxparError) if c.__module__.startswith("fxpar")}
    return sorted(found | {FxparError}, key=lambda c: f"{c.__module__}.{c.__qualname__}")


# Example values for keyword arguments, by annotation; anything else gets a distinct string.
_EXAMPLES: dict[str, object] = {
    "int": 3,
    "float": 1.5,
    "str": "a name",
    "bool": True,
    "tuple[str, ...]": ("first", "second"),
    "tuple[int, ...]": (1, 2),
}


def _instance(cls: type[FxparError]) -> FxparError:
    keywords: dict[str, object] = {}
    for name, parameter in list(inspect.signature(cls.__init__).parameters.items())[1:]:
        if parameter.kind is parameter.KEYWORD_ONLY and parameter.default is parameter.empty:
            keywords[name] = _EXAMPLES.get(str(parameter.annotation), f"{name} value")
    return cls("what went wrong; what to do", **keywords)


def test_the_discovery_finds_errors_from_every_part_of_the_package() -> None:
    names = {c.__qualname__ for c in fxpar_errors()}
    # one from each of fxpar/, passes' PassError, solvers/, pipeline/, runtime/, testing/
    assert {"CaptureError", "PassError", "StageMemoryError", "InfeasiblePlanError"} <= names
    assert {"PipelineError", "SpawnError", "SimulationError", "EquivalenceError"} <= names


@pytest.mark.parametrize("cls", fxpar_errors(), ids=lambda c: c.__qualname__)
def test_every_error_survives_pickling_with_its_attributes(cls: type[FxparError]) -> None:
    error = _instance(cls)
    error.__dict__.setdefault("note_added_later", [1, 2])  # state set after construction
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is cls
    assert str(copy) == str(error) and copy.args == error.args
    assert vars(copy) == vars(error)


def test_an_error_raised_on_one_rank_is_raised_alike_by_the_others() -> None:
    """What SolvedOnRankZero relies on: the other ranks get the error object itself."""
    from fxpar.solvers.stages import StageMemoryError

    sent = StageMemoryError("no stage plan fits", least_memory=2.0, memory_limit=1.0)
    received = pickle.loads(pickle.dumps(sent))
    with pytest.raises(StageMemoryError, match="no stage plan fits") as caught:
        raise received
    assert (caught.value.least_memory, caught.value.memory_limit) == (2.0, 1.0)


# -- spawn: ranks that run different collectives ---------------------------------------------


def _rank_one_runs_an_extra_barrier(rank: int, world_size: int) -> int:
    if rank == 1:
        dist.barrier()  # rank 0 skips it; spawn's closing barrier has a group of its own
    return rank


def _rank_one_skips_an_all_reduce(rank: int, world_size: int) -> int:
    if rank == 0:
        dist.all_reduce(torch.ones(4))  # rank 1 never joins: rank 0 waits until the timeout
    return rank


@pytest.mark.slow
def test_spawn_names_ranks_whose_collectives_did_not_match() -> None:
    started = time.monotonic()
    with pytest.raises(SpawnError) as caught:
        spawn(_rank_one_runs_an_extra_barrier, 2, timeout_s=5)
    message = str(caught.value)
    assert "out-of-memory" not in message and "without a Python error" not in message
    # Rank 0's closing barrier cannot stand in for the barrier rank 1 runs inside fn: rank 1
    # waits there and is named, whichever of the two 5 s timers fires first.
    assert caught.value.rank == 1 and message.startswith("rank 1 of 2 failed")
    assert re.search(r"rank 1 (timed out after 5 s|failed) in a collective inside fn", message)
    assert "rank 0 returned" in message and "ran different collectives" in message
    assert time.monotonic() - started < 60


@pytest.mark.slow
def test_spawn_reports_a_collective_timeout_and_who_was_waiting_where() -> None:
    with pytest.raises(SpawnError) as caught:
        spawn(_rank_one_skips_an_all_reduce, 2, timeout_s=5)
    message = str(caught.value)
    # Both ranks wait on a 5 s timer: rank 0 in its all_reduce, rank 1 in the closing barrier.
    # Whichever fires first ends its rank, and the other then sees its peer gone instead of
    # its own timeout, so either rank may be the one that timed out; rank 0 is named first
    # because its failure is inside fn.
    assert caught.value.timed_out and caught.value.rank == 0
    assert re.search(r"rank 0 (timed out after 5 s|failed) in a collective inside fn", message)
    assert "rank 1 returned" in message and "ran different collectives" in message
