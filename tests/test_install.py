"""A regular (non-editable) install exposes fxpar, fxpar.passes and fxpar.solvers, and nothing
as top-level ``passes`` or ``solvers`` modules."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_plain_install_has_the_three_parts(tmp_path: Path) -> None:
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(ROOT)],
        check=True, cwd=tmp_path,
    )  # fmt: skip
    assert {p.name for p in target.iterdir() if not p.name.endswith("-info")} >= {"fxpar"}
    assert not (target / "passes").exists() and not (target / "solvers").exists()
    check = (
        "import fxpar, fxpar.passes, fxpar.solvers, fxpar.models, fxpar.rules;"
        "import fxpar.runtime.launch, fxpar.testing, fxpar.lowering;"
        # Each part from the install, not from a checkout an editable install points at.
        f"parts = (fxpar, fxpar.passes, fxpar.solvers, fxpar.testing);"
        f"assert all(p.__file__.startswith({str(target)!r}) for p in parts), "
        "[p.__file__ for p in parts];"
        "from fxpar.passes import default_pipeline; print(default_pipeline().names)"
    )
    out = subprocess.run(
        [sys.executable, "-c", check],
        check=True, cwd=tmp_path, capture_output=True, text=True,
        env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert "annotate-cost" in out.stdout
