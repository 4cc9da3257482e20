"""The fenced code blocks of README.md and docs/*.md, read the way tests/test_docs.py runs them.

A block is the text between an opening fence (```` ```lang ````, at the start of a line) and
the next closing fence. Its language decides what it is:

- ``python``: code. A block whose first line is ``# name.py`` is a *script*: it needs a module
  of its own (``fxpar.runtime.launch.spawn`` pickles its function by reference), so it runs as
  ``python name.py`` in a fresh directory. Other python blocks of a file run in order in one
  namespace, so a block may use what an earlier one defined.
- ``bash``, ``console``, ``sh``, ``shell``: commands, one per line (``&&`` chains, a ``$ ``
  prompt and ``# comments`` allowed). See :data:`SETUP_COMMANDS` for the lines that do not run.
- ``text``: not code. Right after a python block (no other fence between them) it is an
  excerpt of what that block prints.

A block that must not run says why in an HTML comment on the last non-blank line before its
fence: ``<!-- not-run: needs 8 GPUs -->``. The reason is required.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYTHON = "python"
SHELL = frozenset({"bash", "console", "sh", "shell"})
TEXT = "text"
LANGUAGES = frozenset({PYTHON, TEXT, *SHELL})

FENCE = re.compile(r"^```(\S*)\s*$")
NOT_RUN = re.compile(r"^<!--\s*not-run\b:?(.*?)-->$")
SCRIPT = re.compile(r"# (\w+\.py)\n")

# Shell lines that set up what the docs' commands need, and that the tests therefore do not
# repeat: installing is what tests/test_install.py checks on a fresh copy, and running the
# test suite from inside the test suite would recurse.
SETUP_COMMANDS = (
    ("pip", "install"),
    ("python", "-m", "pip", "install"),
    ("python", "-m", "pytest"),
)


@dataclass(frozen=True)
class Block:
    """One fenced block of a markdown file."""

    path: Path
    line: int  # of the opening fence, counting from 1
    language: str
    code: str
    not_run: str | None  # the marker's text (stripped; "" when it gives no reason), or None

    @property
    def name(self) -> str:
        """``docs/quickstart.md:98``: where the block's opening fence is."""
        path = self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path
        return f"{path.as_posix()}:{self.line}"

    @property
    def script(self) -> str | None:
        """The file name a script block asks for (its first line is ``# name.py``), or None."""
        match = SCRIPT.match(self.code) if self.language == PYTHON else None
        return match.group(1) if match else None


def doc_files(root: Path = ROOT) -> list[Path]:
    """README.md and every markdown file under docs/, in a fixed order."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def blocks(path: Path) -> list[Block]:
    """Every fenced block of ``path``, in order. Raises ValueError for an unclosed fence."""
    lines = path.read_text().splitlines()
    found: list[Block] = []
    index = 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if opening is None:
            index += 1
            continue
        end = next((i for i in range(index + 1, len(lines)) if lines[i] == "```"), None)
        if end is None:
            raise ValueError(f"{path}:{index + 1}: a fence that is never closed")
        before = next((line.strip() for line in reversed(lines[:index]) if line.strip()), "")
        marker = NOT_RUN.match(before)
        code = "".join(line + "\n" for line in lines[index + 1 : end])
        not_run = marker.group(1).strip() if marker else None
        found.append(Block(path, index + 1, opening.group(1), code, not_run))
        index = end + 1
    return found


def excerpt_of(blocks_of_file: list[Block], block: Block) -> Block | None:
    """The text block right after python ``block``, which shows what it prints, or None."""
    following = blocks_of_file.index(block) + 1
    if following < len(blocks_of_file) and blocks_of_file[following].language == TEXT:
        return blocks_of_file[following]
    return None


def missing_lines(excerpt: str, printed: str) -> list[str]:
    """The lines of ``excerpt`` (stripped, but ``...``) that do not occur in ``printed``."""
    lines = [line.strip() for line in excerpt.splitlines()]
    return [line for line in lines if line and line != "..." and line not in printed]


def shell_commands(code: str) -> list[list[str]]:
    """The commands of a shell block as argument lists: one per line or ``&&`` link, without
    ``$ `` prompts and ``#`` comments."""
    commands = []
    for line in code.splitlines():
        words = shlex.split(line.strip().removeprefix("$ "), comments=True)
        command: list[str] = []
        for word in [*words, "&&"]:
            if word == "&&":
                if command:
                    commands.append(command)
                command = []
            else:
                command.append(word)
    return commands


def is_setup(command: list[str]) -> bool:
    """Whether ``command`` is one of the :data:`SETUP_COMMANDS`."""
    return any(tuple(command[: len(prefix)]) == prefix for prefix in SETUP_COMMANDS)


def fxpar_arguments(command: list[str]) -> list[str] | None:
    """The arguments of ``fxpar ARGS`` or ``python -m fxpar ARGS``, or None for another
    command."""
    if command[:1] == ["fxpar"]:
        return command[1:]
    if command[:3] == ["python", "-m", "fxpar"]:
        return command[3:]
    return None
