"""The documented torchrun launches work: examples/train_gpt.py trains on 2 processes, saves a
checkpoint, and a second launch under another mesh resumes from it; README's torchrun snippet
runs as written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_gpt.py"


def _torchrun(*args: str, script: Path = EXAMPLE, cwd: Path | None = None) -> str:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script)]
    done = subprocess.run([*command, *args], capture_output=True, text=True, timeout=300, cwd=cwd)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_train_gpt_under_torchrun_and_resume(tmp_path: Path) -> None:
    checkpoint = str(tmp_path / "checkpoint")
    first = _torchrun("--steps", "20", "--checkpoint", checkpoint)
    assert "plan: ilp, optimal" in first
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", first)]
    assert len(losses) == 2 and losses[1] < losses[0]  # steps 1 and 20; it learns
    second = _torchrun("--steps", "1", "--mesh", "2", "--checkpoint", checkpoint)
    assert "resumed from" in second and "at step 20" in second


def test_readme_torchrun_snippet(tmp_path: Path) -> None:
    readme = (EXAMPLE.parents[1] / "README.md").read_text()
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", readme, re.DOTALL) if "from_env" in b]
    script = tmp_path / "snippet.py"
    script.write_text(block + "\ndist.destroy_process_group()\n")
    _torchrun(script=script, cwd=tmp_path)
    assert (tmp_path / "checkpoint" / ".metadata").exists()
