"""Passes and the pass manager.

A pass is a frozen dataclass: a ``name`` class attribute, its options as fields, and a
:meth:`Pass.run` that takes a Program and returns a Program (the same object, edited, or a new
one). A :class:`PassManager` runs an explicit tuple of passes in order on its own copy of the
Program it is given (:meth:`~fxpar.ir.program.Program.copy`, made once per run), so that
running a pass list never edits its input: the caller keeps the captured Program as it was and
may plan it again, for another mesh or with other passes, while each pass stays free to edit
what it is handed. With ``verify=True`` it checks the IR's invariants after each pass, which is
how the tests run it. An unexpected
exception in a pass, or a broken IR invariant (a missing annotation), becomes a
:class:`~fxpar.errors.PassError` naming the pass and those before it: the pipeline is wrong.
fxpar's typed errors about the input (an infeasible plan, symbolic shapes, a bad pin) keep their
type, with a note naming the pass.
"""

from __future__ import annotations

import abc
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar

from fxpar.cluster import Cluster
from fxpar.errors import AnnotationError, FxparError, PassError, VerificationError
from fxpar.ir.program import Program
from fxpar.ir.verify import verify as verify_program

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Pass(abc.ABC):
    """One compiler pass. Subclasses set ``name`` and implement :meth:`run`.

    A pass may edit the Program it is handed and return it: inside a :class:`PassManager` that
    Program is the manager's own copy. Called alone (``Canonicalize().run(program)``), a pass
    edits ``program`` itself."""

    name: ClassVar[str]

    @abc.abstractmethod
    def run(self, program: Program) -> Program:
        """Transform or annotate ``program`` and return the result."""

    def __call__(self, program: Program) -> Program:
        return self.run(program)


@dataclass(frozen=True)
class PassManager:
    """Runs ``passes`` in order on a copy of the Program it is given, and returns the copy as
    the last pass left it: the input Program (its graph, every node's annotations, its
    program-level annotations and its cluster) is left exactly as it was.

    ``verify`` runs the IR verifier on the input and after every pass (debug mode: on in the
    tests, off by default since it walks the whole graph each time). A failure raises
    :class:`~fxpar.errors.PassError` naming the failing pass and those that completed.
    """

    passes: tuple[Pass, ...]
    verify: bool = False

    def __post_init__(self) -> None:
        names = [p.name for p in self.passes]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise FxparError(f"pass names must be unique in a pass list, repeated: {duplicates}")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.passes)

    def get(self, name: str) -> Pass | None:
        """The pass called ``name``, or None when the pipeline has none."""
        return next((p for p in self.passes if p.name == name), None)

    def run(self, program: Program, *, cluster: Cluster | None = None) -> Program:
        """A new Program: ``program`` with every pass run on it, in order, for ``cluster``
        (``program.cluster`` when None; the new Program's, the input's is left as it is)."""
        if self.verify:
            self._verify(program, after=None, completed=())
        program = program.copy()
        if cluster is not None:
            program.cluster = cluster
        completed: list[str] = []
        for current in self.passes:
            start = time.perf_counter()
            try:
                result = current(program)
            except FxparError as error:
                if isinstance(error, (AnnotationError, VerificationError)):
                    raise self._failed(current, completed, error) from error
                # About the input, typed and saying what to do (an infeasible plan, symbolic
                # shapes, a bad pin): callers catch it by its type, so it goes on with a note.
                error.add_note(f"raised by pass {current.name!r}{_after(completed)}")
                raise
            except Exception as error:
                raise self._failed(current, completed, error) from error
            if not isinstance(result, Program):
                raise PassError(
                    f"pass {current.name!r} returned {type(result).__name__}, not a Program",
                    pass_name=current.name,
                    completed=tuple(completed),
                )
            program = result
            logger.debug("pass %s took %.3f s", current.name, time.perf_counter() - start)
            if self.verify:
                self._verify(program, after=current.name, completed=tuple(completed))
            completed.append(current.name)
        return program

    @staticmethod
    def _failed(current: Pass, completed: list[str], error: Exception) -> PassError:
        return PassError(
            f"pass {current.name!r} failed{_after(completed)}: {type(error).__name__}: {error}",
            pass_name=current.name,
            completed=tuple(completed),
        )

    def _verify(self, program: Program, after: str | None, completed: tuple[str, ...]) -> None:
        try:
            verify_program(program)
        except FxparError as error:
            if after is None:
                message = f"the input Program is invalid: {error}"
            else:
                message = f"pass {after!r} left an invalid Program{_after(completed)}: {error}"
            raise PassError(message, pass_name=after or "<input>", completed=completed) from error

    # -- editing a pipeline: each returns a new PassManager ---------------------------------

    def insert_after(self, name: str, *new: Pass) -> PassManager:
        """The pipeline with ``new`` passes right after the pass called ``name``."""
        index = self._index(name) + 1
        return self._with(self.passes[:index] + new + self.passes[index:])

    def insert_before(self, name: str, *new: Pass) -> PassManager:
        """The pipeline with ``new`` passes right before the pass called ``name``."""
        index = self._index(name)
        return self._with(self.passes[:index] + new + self.passes[index:])

    def replace(self, name: str, new: Pass) -> PassManager:
        """The pipeline with the pass called ``name`` swapped for ``new``."""
        index = self._index(name)
        return self._with((*self.passes[:index], new, *self.passes[index + 1 :]))

    def through(self, name: str) -> PassManager:
        """The pipeline up to and including the pass called ``name`` (the steps that prepare
        what ``name`` produces, e.g. ``through("annotate-strategies")`` before a manual plan)."""
        return self._with(self.passes[: self._index(name) + 1])

    def without(self, *names: str) -> PassManager:
        """The pipeline without the passes called ``names``."""
        for name in names:
            self._index(name)
        return self._with(tuple(p for p in self.passes if p.name not in names))

    def _index(self, name: str) -> int:
        for index, current in enumerate(self.passes):
            if current.name == name:
                return index
        raise FxparError(f"no pass named {name!r} in the pipeline {list(self.names)}")

    def _with(self, passes: Iterable[Pass]) -> PassManager:
        return PassManager(tuple(passes), verify=self.verify)


def _after(completed: list[str] | tuple[str, ...]) -> str:
    return f" (after {', '.join(completed)})" if completed else " (no pass ran before it)"
