"""HiGHS writes nothing to stdout or stderr while fxpar solves, and its log reaches the
``fxpar.solvers.ilp.highs`` logger at DEBUG.

HiGHS writes its banner ("Running HiGHS 1.x ...") once per process, from the constructor of the
first ``highspy.Highs`` with output on, so the console is checked in a fresh interpreter: in this
one an earlier test may already have had the banner written."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from typing import Any

import pytest

from fxpar.solvers import Edge, ILPSolver, IntraOpProblem
from fxpar.solvers.ilp_model import new_highs

OUTPUT_OPTIONS = ("output_flag", "log_to_console")

TINY = IntraOpProblem(
    node_costs=((1.0, 2.0), (3.0, 1.0), (0.0, 0.0), (0.0, 0.0)),
    node_memory=((0.0, 0.0),) * 4,
    edges=tuple(Edge(u, v, ((0.0, 5.0), (5.0, 0.0))) for u in range(4) for v in range(u + 1, 4)),
)
"""No memory limit: the Lagrangian phase solves its LP relaxation with one HiGHS instance. Four
nodes that all meet each other, so that the ILP's elimination leaves HiGHS a model to solve."""

# Solves the tiny problem, then a chain whose memory limit binds, along every HiGHS path of
# ILPSolver (branch and bound on worker threads with a sized pool, Lagrangian phase then MIP,
# MIP alone): first with logging not configured, then again with a handler collecting the HiGHS
# logger's records at DEBUG. Prints the objectives and the records as one line of JSON.
SOLVE = """
import json, logging, random
from fxpar.solvers import Edge, ILPSolver, IntraOpProblem

tiny = IntraOpProblem(
    node_costs=((1.0, 2.0), (3.0, 1.0)),
    node_memory=((0.0, 0.0), (0.0, 0.0)),
    edges=(Edge(0, 1, ((0.0, 5.0), (5.0, 0.0))),),
)
rng = random.Random(0)
n, k = 12, 4
costs = tuple(tuple(rng.uniform(0, 1) for _ in range(k)) for _ in range(n))
memory = tuple(tuple(float(rng.randint(1, 100)) for _ in range(k)) for _ in range(n))
edges = tuple(
    Edge(v - 1, v, tuple(tuple(rng.uniform(0, 2) for _ in range(k)) for _ in range(k)))
    for v in range(1, n)
)
least, most = sum(map(min, memory)), sum(map(max, memory))
chain = IntraOpProblem(costs, memory, edges, least + 0.3 * (most - least))
solvers = (
    ILPSolver(),
    ILPSolver(threads=2, workers=2),
    ILPSolver(branching=False),
    ILPSolver(branching=False, lagrangian=False, warm_start=False),
)

def solve_all():
    return [ILPSolver().solve(tiny).objective] + [s.solve(chain).objective for s in solvers]

quiet = solve_all()

messages = []
class Collect(logging.Handler):
    def emit(self, record):
        messages.append((record.levelname, record.getMessage()))
logger = logging.getLogger("fxpar.solvers.ilp.highs")
logger.addHandler(Collect())
logger.setLevel(logging.DEBUG)
logger.propagate = False
logged = solve_all()

print(json.dumps({"quiet": quiet, "logged": logged, "messages": messages}))
"""


@pytest.fixture(scope="module")
def fresh_process_solves(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Runs SOLVE in a fresh interpreter; its stderr is kept under "stderr"."""
    run = subprocess.run(
        [sys.executable, "-c", SOLVE],
        capture_output=True,
        text=True,
        cwd=tmp_path_factory.mktemp("highs"),
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    # The script prints exactly one line: anything else on stdout was written by someone else.
    assert len(lines) == 1, f"stdout holds more than the script's one line:\n{run.stdout}"
    return {**json.loads(lines[0]), "stderr": run.stderr}


def test_a_fresh_process_writes_nothing_from_highs_to_the_console(
    fresh_process_solves: dict[str, Any],
) -> None:
    """The first HiGHS instance of a process and every solver path after it, logging off and
    then at DEBUG, leave stdout (checked by the fixture) and stderr empty, the banner included."""
    assert fresh_process_solves["stderr"] == ""
    quiet, logged = fresh_process_solves["quiet"], fresh_process_solves["logged"]
    assert quiet[0] == logged[0] == pytest.approx(3.0)
    # Every path solves the chain to the same optimum, with or without the log.
    assert quiet[1:] + logged[1:] == [pytest.approx(quiet[1], rel=1e-6)] * 8


def test_at_debug_the_banner_and_the_log_reach_the_logger(
    fresh_process_solves: dict[str, Any],
) -> None:
    """Once the logger is at DEBUG, HiGHS's log comes as DEBUG records, one per message without
    its newline, and the banner with it: the quiet solves before did not use it up."""
    messages = fresh_process_solves["messages"]
    texts = [text for _, text in messages]
    assert {level for level, _ in messages} == {"DEBUG"}
    assert sum(text.startswith("Running HiGHS") for text in texts) == 1, texts[:5]
    assert any("Model status" in text for text in texts), texts
    assert all(text.strip() and not text.endswith("\n") for text in texts)


def test_highs_log_reaches_the_logger_in_process(caplog: pytest.LogCaptureFixture) -> None:
    """In this process too (caplog at DEBUG), a solve's HiGHS log comes as DEBUG records."""
    with caplog.at_level(logging.DEBUG, logger="fxpar.solvers.ilp.highs"):
        solution = ILPSolver().solve(TINY)
    assert solution.choice == (1, 1, 1, 1)
    records = [r for r in caplog.records if r.name == "fxpar.solvers.ilp.highs"]
    assert records, "no HiGHS log record"
    assert {r.levelno for r in records} == {logging.DEBUG}
    assert any("Model status" in r.getMessage() for r in records)


def test_highs_is_asked_for_its_log_only_when_debug_is_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """HiGHS never writes to the console, and makes its log (each message a call into Python)
    only when the HiGHS logger is enabled for DEBUG as the instance is made."""
    with caplog.at_level(logging.INFO, logger="fxpar.solvers.ilp.highs"):
        quiet = new_highs(None)
    with caplog.at_level(logging.DEBUG, logger="fxpar.solvers.ilp.highs"):
        logged = new_highs(None)
    assert [quiet.getOptionValue(o)[1] for o in OUTPUT_OPTIONS] == [False, False]
    assert [logged.getOptionValue(o)[1] for o in OUTPUT_OPTIONS] == [True, False]
