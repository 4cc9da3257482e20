"""Every code block of README.md and docs/ runs as written, and prints what the docs show.

One test case per code block, named after the block's file and the line of its opening fence
(``test_block_runs[docs/quickstart.md:98]``); tests/docs_blocks.py says how blocks are read.
The python blocks of a file run in order in one namespace (in a scratch directory, for the
files they write); a traceback points into the markdown file at the failing line. A ``text``
block right after a python block is an excerpt of what it prints: each of its lines (but
``...``) must occur in the output. Scripts (``# name.py``) run as their own process, shell
blocks' ``fxpar`` commands as ``python -m fxpar`` with the small sizes of
:data:`SMALL_ARGUMENTS`; both start processes, so they are marked slow. A block marked
``<!-- not-run: reason -->`` is not run, and its marker must give the reason.
"""

from __future__ import annotations

import contextlib
import io
import os
import runpy
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from docs_blocks import (
    LANGUAGES,
    PYTHON,
    ROOT,
    SHELL,
    Block,
    blocks,
    doc_files,
    excerpt_of,
    fxpar_arguments,
    is_setup,
    missing_lines,
    shell_commands,
)

import fxpar
from fxpar import ir
from fxpar.passes import default_passes

# Options appended to a documented ``fxpar`` command so that it runs in seconds (the last of a
# repeated option wins): the demo's defaults train 300 steps on 4 processes.
SMALL_ARGUMENTS = {
    "demo": ["--steps", "2", "--devices", "2", "--layers", "1", "--width", "16", "--batch", "4",
             "--length", "8"],
}  # fmt: skip
TIMEOUT_S = 300


def code_blocks() -> list[Block]:
    """The blocks that run: python and shell blocks without a not-run marker."""
    return [
        block
        for path in doc_files()
        for block in blocks(path)
        if (block.language == PYTHON or block.language in SHELL) and block.not_run is None
    ]


def starts_processes(block: Block) -> bool:
    return block.script is not None or block.language in SHELL


@dataclass
class DocRun:
    """The python blocks of one file that ran so far, in their shared namespace."""

    path: Path
    directory: Path
    namespace: dict[str, object] = field(default_factory=dict)
    ran: set[int] = field(default_factory=set)
    failed: Block | None = None

    def run_through(self, block: Block) -> None:
        """Run the file's namespace blocks before ``block`` that have not run yet (a test
        selection may have skipped them), then ``block``."""
        for earlier in blocks(self.path):
            if earlier.line >= block.line:
                break
            if in_namespace(earlier) and earlier.line not in self.ran:
                self.run(earlier)
        self.run(block)

    def run(self, block: Block) -> None:
        # In a shared namespace, the guarded part of a script would silently not run.
        assert '__name__ == "__main__"' not in block.code, f"{block.name}: start it # name.py"
        self.ran.add(block.line)
        # Blank lines in front make the line numbers of a traceback those of the markdown file.
        # dont_inherit: this module's `from __future__ import annotations` is not the block's.
        code = compile("\n" * block.line + block.code, str(block.path), "exec", dont_inherit=True)
        self.namespace.setdefault("__name__", f"docs.{self.path.stem}")
        printed = io.StringIO()
        try:
            with working_directory(self.directory), contextlib.redirect_stdout(printed):
                exec(code, self.namespace)
        except Exception as error:
            earlier, self.failed = self.failed, block
            if earlier is not None:
                raise AssertionError(
                    f"{block.name} failed after {earlier.name}, an earlier block of its file"
                ) from error
            raise
        finally:
            sys.stdout.write(printed.getvalue())  # pytest shows it for a failing case
        check_excerpt(block, printed.getvalue())


@contextlib.contextmanager
def working_directory(directory: Path) -> Iterator[None]:
    """``contextlib.chdir``, which Python 3.10 lacks."""
    previous = Path.cwd()
    os.chdir(directory)
    try:
        yield
    finally:
        os.chdir(previous)


def in_namespace(block: Block) -> bool:
    return block.language == PYTHON and block.script is None and block.not_run is None


def check_excerpt(block: Block, printed: str) -> None:
    excerpt = excerpt_of(blocks(block.path), block)
    if excerpt is not None:
        missing = missing_lines(excerpt.code, printed)
        assert not missing, f"{block.name} does not print these lines of {excerpt.name}: {missing}"


@pytest.fixture(scope="session")
def doc_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[Path, DocRun]:
    runs = {}
    for path in doc_files():
        runs[path] = DocRun(path, tmp_path_factory.mktemp(path.stem))
    return runs


@pytest.fixture(scope="session")
def passed_commands() -> set[tuple[str, ...]]:
    return set()


def run_process(command: list[str], block: Block, directory: Path) -> str:
    done = subprocess.run(command, cwd=directory, capture_output=True, text=True, timeout=TIMEOUT_S)
    sys.stdout.write(done.stdout)
    assert done.returncode == 0, f"{block.name}: {' '.join(command)} failed:\n{done.stderr[-4000:]}"
    return done.stdout


def run_script(block: Block, directory: Path) -> None:
    assert block.script is not None
    (directory / block.script).write_text(block.code)
    printed = run_process([sys.executable, block.script], block, directory)
    check_excerpt(block, printed)


def run_shell(block: Block, directory: Path, passed: set[tuple[str, ...]]) -> None:
    """Run the block's ``fxpar`` commands but those in ``passed`` (the same command in another
    block, which already ran in this session), and add them to it."""
    commands = shell_commands(block.code)
    assert commands, f"{block.name} has no command"
    for command in commands:
        arguments = fxpar_arguments(command)
        if arguments is not None:
            small = SMALL_ARGUMENTS.get(arguments[0], []) if arguments else []
            run = (sys.executable, "-m", "fxpar", *arguments, *small)
            if run not in passed:
                run_process(list(run), block, directory)
                passed.add(run)
        else:
            assert is_setup(command), (
                f"{block.name}: the docs test does not know how to run {' '.join(command)!r}; "
                "teach tests/test_docs.py, or mark the block <!-- not-run: reason -->"
            )


@pytest.mark.parametrize(
    "block",
    [
        pytest.param(
            block, id=block.name, marks=[pytest.mark.slow] if starts_processes(block) else []
        )
        for block in code_blocks()
    ],
)
def test_block_runs(
    block: Block,
    doc_runs: dict[Path, DocRun],
    passed_commands: set[tuple[str, ...]],
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """The block runs (after the blocks before it in its file) and prints its excerpt."""
    if block.script is not None:
        run_script(block, tmp_path_factory.mktemp("script"))
    elif block.language in SHELL:
        run_shell(block, tmp_path_factory.mktemp("shell"), passed_commands)
    else:
        doc_runs[block.path].run_through(block)


@pytest.mark.parametrize(
    "path", [pytest.param(path, id=path.relative_to(ROOT).as_posix()) for path in doc_files()]
)
def test_fences_name_a_known_language(path: Path) -> None:
    """Every fence says what it holds, so no code hides in a block the test skips: python or a
    shell is run, text is output or a picture."""
    unknown = [
        f"{block.name} ({block.language or 'no language'})"
        for block in blocks(path)
        if block.language not in LANGUAGES
    ]
    assert not unknown, f"tag these fences python, bash or text: {unknown}"


@pytest.mark.parametrize(
    "block",
    [
        pytest.param(block, id=block.name)
        for path in doc_files()
        for block in blocks(path)
        if block.not_run is not None
    ],
)
def test_not_run_marker_gives_a_reason(block: Block) -> None:
    """A block kept out of the test says why, and is code (a text block never runs)."""
    assert block.not_run, f"{block.name}: say why it does not run: <!-- not-run: reason -->"
    assert block.language == PYTHON or block.language in SHELL, f"{block.name} is not code"


def test_collector_reads_fences_markers_and_commands(tmp_path: Path) -> None:
    """The parts of the collector that decide what runs: fence lines, languages, markers,
    scripts, shell commands, excerpt pairing and the excerpt check can each say no."""
    page = tmp_path / "page.md"
    page.write_text(
        "# Title\n\n```python\nx = 1\n```\n\n```text\n1\n```\n\n<!-- not-run: needs 8 GPUs -->\n\n"
        "```python\n# big.py\nboom()\n```\n<!-- not-run -->\n```bash\n"
        "$ pip install -e . && python -m fxpar demo  # the demo\nls\n```\n"
    )
    first, excerpt, script, shell = blocks(page)
    assert (first.line, first.language, first.code, first.not_run) == (3, "python", "x = 1\n", None)
    assert excerpt_of(blocks(page), first) == excerpt and excerpt_of(blocks(page), script) is None
    assert (script.line, script.not_run, script.script) == (13, "needs 8 GPUs", "big.py")
    assert shell.not_run == "" and first.script is None
    commands = shell_commands(shell.code)
    assert commands == [["pip", "install", "-e", "."], ["python", "-m", "fxpar", "demo"], ["ls"]]
    assert [is_setup(c) for c in commands] == [True, False, False]
    assert [fxpar_arguments(c) for c in commands] == [None, ["demo"], None]
    assert missing_lines("a\n...\nb c\n", "x a y\nb c\n") == []
    assert missing_lines("a\nall_gather\n", "a\nall_reduce\n") == ["all_gather"]
    page.write_text("```python\nnever closed\n")
    with pytest.raises(ValueError, match="never closed"):
        blocks(page)


def test_a_failing_block_is_named_by_its_file_and_line(tmp_path: Path) -> None:
    """A block that raises fails with a traceback into the markdown file at the failing line;
    a later block of the same file that fails too names the earlier failure."""
    page = tmp_path / "page.md"
    page.write_text("```python\nx = 1\n```\n\n```python\nundefined_name\ny = x\n```\n\n"
                    "```python\nz = y\n```\n")  # fmt: skip
    first, broken, after = blocks(page)
    run = DocRun(page, tmp_path)
    run.run_through(first)
    with pytest.raises(NameError) as raised:
        run.run_through(broken)
    assert (raised.traceback[-1].path, raised.traceback[-1].lineno + 1) == (page, 6)
    with pytest.raises(AssertionError, match=r"page.md:10 failed after .*page.md:5") as raised:
        run.run_through(after)
    assert isinstance(raised.value.__cause__, NameError)  # `y`, which the failed block defines


# What some blocks claim, beyond running: checked on the namespace they leave.


def doc_namespace(doc_runs: dict[Path, DocRun], name: str, *names: str) -> dict[str, object]:
    """The namespace of docs/``name`` once its python blocks, in order, defined ``names``."""
    run = doc_runs[ROOT / "docs" / name]
    for block in blocks(run.path):
        if all(defined in run.namespace for defined in names):
            break
        if in_namespace(block) and block.line not in run.ran:
            run.run_through(block)
    return run.namespace


def test_writing_a_pass_example_runs_in_the_default_pass_list(
    doc_runs: dict[Path, DocRun],
) -> None:
    """The pass of docs/passes.md marks the heavy nodes and nothing else in the default
    pipeline (a transpose does no FLOPs)."""
    namespace = doc_namespace(doc_runs, "passes.md", "MarkHeavyOps", "HeavyOps")
    mark, heavy = namespace["MarkHeavyOps"], namespace["HeavyOps"]
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))
    program = fxpar.capture(model, (torch.randn(8, 16),), lambda y: y.square().mean())
    program.cluster = fxpar.Cluster((2,))  # the default pipeline plans for it
    pipeline = default_passes(verify=True).insert_after("annotate-cost", mark(0.1))  # type: ignore[operator]
    program = pipeline.run(program)
    marked = [n for n in program.graph.nodes if ir.get(n, heavy)]  # type: ignore[arg-type]
    assert marked and all(n.target is not torch.ops.aten.t.default for n in marked)


def test_planning_guide_solver_is_named_in_its_solution(doc_runs: dict[Path, DocRun]) -> None:
    """docs/planning.md's own solver is the one its plan records."""
    namespace = doc_namespace(doc_runs, "planning.md", "mine")
    assert namespace["mine"].solution.solver == "cheapest-nodes"  # type: ignore[attr-defined]


def test_example_runs_and_matches_one_device() -> None:
    """examples/plan_and_simulate.py (README's layout names it) trains like one device."""
    example = runpy.run_path(str(ROOT / "examples" / "plan_and_simulate.py"))
    assert example["main"]() < 1e-4
