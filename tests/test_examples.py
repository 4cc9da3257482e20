"""The documented torchrun launches work: examples/train_gpt.py trains on 2 processes, saves
step checkpoints, and a stopped run resumes to the loss of an uninterrupted one (under the same
or another mesh); README's torchrun snippet runs as written."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import fxpar

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_gpt.py"


# Rarely a gloo process aborts with this at exit, after its last collective and
# destroy_process_group (seen in 1 of 6 launches of one fresh-clone CI run, in none of 30
# launches of a local stress loop): a teardown race of gloo's worker threads in torch, not a
# failure of the run, whose last step and save had finished.
_TEARDOWN_ABORT = "terminate called without an active exception"


def _torchrun(*args: str, script: Path = EXAMPLE, cwd: Path | None = None) -> str:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script)]
    done = subprocess.run([*command, *args], capture_output=True, text=True, timeout=300, cwd=cwd)
    finished = "final loss" in done.stdout  # printed after the last step and save
    if done.returncode != 0 and not (finished and _TEARDOWN_ABORT in done.stderr):
        raise AssertionError(done.stderr[-3000:])
    return done.stdout


def _final_loss(output: str) -> float:
    (loss,) = re.findall(r"final loss (\d+\.\d+) at step 20", output)
    return float(loss)


def test_train_gpt_resumes_where_it_stopped(tmp_path: Path) -> None:
    """A run stopped at step 12 and started again ends with the loss of an uninterrupted run
    of 20 steps: exactly under the same mesh, to rounding under another; an interrupted save
    (a step directory without a commit record) is passed over."""
    uninterrupted = _torchrun("--steps", "20", "--save-every", "10",
                              "--checkpoint", str(tmp_path / "a"))  # fmt: skip
    assert "plan: ilp, optimal" in uninterrupted
    losses = [float(x) for x in re.findall(r"step +\d+  loss (\d+\.\d+)", uninterrupted)]
    assert len(losses) == 2 and losses[1] < losses[0]  # steps 1 and 20; it learns
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["step-000010", "step-000020"]

    stopped = tmp_path / "b"
    _torchrun("--steps", "12", "--save-every", "5", "--checkpoint", str(stopped))
    torn = stopped / "step-000015"  # as a save killed before its commit leaves it
    torn.mkdir()
    (torn / "v-0").mkdir()
    (torn / "v-0" / "__0_0.distcp").write_bytes(b"partial")
    shutil.copytree(stopped, tmp_path / "c")
    resumed = _torchrun("--steps", "20", "--save-every", "5", "--checkpoint", str(stopped))
    assert f"resumed from {stopped / 'step-000012'} at step 12" in resumed
    assert _final_loss(resumed) == _final_loss(uninterrupted)

    elsewhere = _torchrun("--steps", "20", "--mesh", "1x2", "--checkpoint", str(tmp_path / "c"))
    assert "at step 12" in elsewhere
    assert _final_loss(elsewhere) == pytest.approx(_final_loss(uninterrupted), rel=1e-4)


def test_readme_torchrun_snippet(tmp_path: Path) -> None:
    readme = (EXAMPLE.parents[1] / "README.md").read_text()
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", readme, re.DOTALL) if "from_env" in b]
    script = tmp_path / "snippet.py"
    script.write_text(block + "\ndist.destroy_process_group()\n")
    _torchrun(script=script, cwd=tmp_path)
    assert fxpar.checkpoint.committed_version(tmp_path / "checkpoint").is_dir()
