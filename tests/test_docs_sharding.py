"""The code in docs/sharding.md, docs/custom_rules.md and docs/property_testing.md runs as
written, and the output the docs show is what that code prints.

Each doc's ```python blocks run in order in one namespace. A ```text block right after a python
block is an excerpt of what that block prints: each of its lines, except ``...``, must appear in
the printed output. A python block whose first line is ``# name.py`` is a script (it needs its
own importable module, e.g. for torch.multiprocessing): it runs as a separate process.
"""

from __future__ import annotations

import contextlib
import io
import re
import subprocess
import sys
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", flags=re.DOTALL | re.MULTILINE)
SCRIPT = re.compile(r"# (\w+\.py)\n")


def fenced_blocks(path: Path) -> list[tuple[str, str]]:
    """(language, code) of every fenced block of ``path``, in order."""
    return FENCE.findall(path.read_text())


def missing_lines(excerpt: str, printed: str) -> list[str]:
    """The lines of ``excerpt`` (but ``...``) that do not occur in ``printed``."""
    lines = [line.strip() for line in excerpt.splitlines()]
    return [line for line in lines if line and line != "..." and line not in printed]


def run_doc(name: str) -> int:
    """Execute the python blocks of docs/``name`` in order in one namespace, checking the
    output of each block against the text block after it. Returns how many outputs were
    checked."""
    path = DOCS / name
    blocks = fenced_blocks(path)
    namespace: dict[str, object] = {"__name__": f"docs.{path.stem}"}
    checked = 0
    for index, (language, code) in enumerate(blocks):
        if language != "python" or SCRIPT.match(code):
            continue
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(compile(code, f"{path}, block {index}", "exec"), namespace)
        if index + 1 < len(blocks) and blocks[index + 1][0] == "text":
            missing = missing_lines(blocks[index + 1][1], printed.getvalue())
            assert not missing, f"{name}, block {index} did not print {missing}"
            checked += 1
    return checked


# How many output excerpts each doc shows: a text block moved away from its python block would
# otherwise silently go unchecked.
@pytest.mark.parametrize(
    ("name", "outputs"),
    [("sharding.md", 4), ("custom_rules.md", 3), ("property_testing.md", 1)],
)
def test_doc_runs_and_shows_what_its_code_prints(name: str, outputs: int) -> None:
    assert run_doc(name) == outputs


def test_excerpt_check_catches_a_line_the_code_does_not_print() -> None:
    """The output check can fail: a line absent from the output is reported."""
    assert missing_lines("a\n...\nb c\n", "x a y\nb c\n") == []
    assert missing_lines("a\nall_gather\n", "a\nall_reduce\n") == ["all_gather"]


@pytest.mark.slow
def test_gloo_script_in_sharding_doc_runs_on_two_processes(tmp_path: Path) -> None:
    """The spawn + run_rank script trains like one device on real gloo processes."""
    blocks = fenced_blocks(DOCS / "sharding.md")
    scripts = [code for language, code in blocks if language == "python" and SCRIPT.match(code)]
    assert len(scripts) == 1
    script = tmp_path / SCRIPT.match(scripts[0]).group(1)  # type: ignore[union-attr]
    script.write_text(scripts[0])
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 gloo processes: loss" in done.stdout
