"""``import fxpar`` gives every name the docs write as ``fxpar.x.y`` (``fxpar.plans``,
``fxpar.testing``, ``fxpar.runtime.launch.spawn`` ...) as an attribute. Checked in a fresh
interpreter: in this one, other tests have already imported the submodules, which would hide a
missing attribute (and a fresh ``import fxpar`` is where an import cycle would show)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

RESOLVE = """
import sys
import fxpar

for dotted in sys.argv[1:]:
    value = fxpar
    for part in dotted.split(".")[1:]:
        if not hasattr(value, part):
            print(f"{dotted}: import fxpar gives no {part!r} on {value.__name__}")
            break
        value = getattr(value, part)
"""


def documented_names() -> list[str]:
    """Every dotted ``fxpar.x.y`` written in README.md and docs/."""
    texts = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]
    found = set()
    for path in texts:
        found |= set(re.findall(r"\bfxpar(?:\.[A-Za-z_]\w*)+", path.read_text()))
    return sorted(found)


def test_every_fxpar_name_in_the_docs_is_an_attribute_after_import_fxpar() -> None:
    names = documented_names()
    assert {"fxpar.plans.tensor_parallel", "fxpar.testing.simulate"} <= set(names)
    run = subprocess.run(
        [sys.executable, "-c", RESOLVE, *names], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout == "", run.stdout
