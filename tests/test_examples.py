"""The documented torchrun launches work: examples/train_gpt.py trains on 2 processes, saves
step checkpoints, and a stopped run resumes to the loss of an uninterrupted one (under the same
or another mesh), also when a machine is lost (elastic); README's torchrun snippet runs as
written. The Hugging Face examples (train_lm.py, train_bert.py) are tests/test_examples_hf.py's:
two files, so that two test workers share the launches (each file runs on one)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import torchrun

import fxpar

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_gpt.py"


def _torchrun(
    *args: str, script: Path = EXAMPLE, cwd: Path | None = None, finished: str = "final loss"
) -> str:
    """examples/train_gpt.py, or ``script``, on 2 processes (:func:`conftest.torchrun`)."""
    return torchrun(script, *args, cwd=cwd, finished=finished)


def _final_loss(output: str) -> float:
    (loss,) = re.findall(r"final loss (\d+\.\d+) at step 20", output)
    return float(loss)


@pytest.fixture(scope="module")
def uninterrupted_gpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """One uninterrupted run of 20 steps, saving every 6 steps: its output and checkpoint root.
    The stopped, resumed and elastic runs below all end with its loss (one launch for them all:
    each torchrun launch costs seconds of imports and planning)."""
    root = tmp_path_factory.mktemp("gpt") / "uninterrupted"
    return _torchrun("--steps", "20", "--save-every", "6", "--checkpoint", str(root)), root


def test_train_gpt_resumes_where_it_stopped(
    uninterrupted_gpt: tuple[str, Path], tmp_path: Path
) -> None:
    """The run saves every ``--save-every`` steps and at its last; a run stopped at step 12
    (the uninterrupted run's checkpoints up to step 12, as a run of ``--steps 12`` leaves
    them) and started again ends with the loss of the uninterrupted run: exactly under the
    same mesh, to rounding under another; an interrupted save (a step directory without a
    commit record) is passed over, and saved over."""
    uninterrupted, saved = uninterrupted_gpt
    assert "plan: ilp, optimal" in uninterrupted
    losses = [float(x) for x in re.findall(r"step +\d+  loss (\d+\.\d+)", uninterrupted)]
    assert len(losses) == 2 and losses[1] < losses[0]  # steps 1 and 20; it learns
    steps = ["step-000006", "step-000012", "step-000018", "step-000020"]  # 20: the last
    assert sorted(p.name for p in saved.iterdir()) == steps

    stopped = tmp_path / "b"
    shutil.copytree(saved, stopped)
    for later in steps[2:]:
        shutil.rmtree(stopped / later)
    torn = stopped / "step-000015"  # as a save killed before its commit leaves it
    torn.mkdir()
    (torn / "v-0").mkdir()
    (torn / "v-0" / "__0_0.distcp").write_bytes(b"partial")
    shutil.copytree(stopped, tmp_path / "c")
    resumed = _torchrun("--steps", "20", "--save-every", "5", "--checkpoint", str(stopped))
    assert f"resumed from {stopped / 'step-000012'} at step 12" in resumed
    assert _final_loss(resumed) == _final_loss(uninterrupted)
    assert fxpar.checkpoint.committed_version(stopped / "step-000015").is_dir()  # saved over

    elsewhere = _torchrun("--steps", "20", "--mesh", "1x2", "--checkpoint", str(tmp_path / "c"))
    assert "at step 12" in elsewhere
    assert _final_loss(elsewhere) == pytest.approx(_final_loss(uninterrupted), rel=1e-4)


FRESH_STORES = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
"""The agents' environment: each restarted attempt's workers meet in a store of their own.
torchrun's default, one store for every attempt (hosted by the agent of rank 0, keys not
prefixed by attempt), let a restarted worker read an address an earlier attempt's worker left
and wait on it in gloo's connection setup until the test timed out (docs/training.md)."""


def test_train_gpt_continues_on_the_machines_left(
    uninterrupted_gpt: tuple[str, Path], tmp_path: Path
) -> None:
    """Elastic resume: two torchrun agents (two "machines" of 2 processes each) start the run on
    4 processes; at step 10 the second machine is lost (its processes and agent killed). The
    first machine's processes fail, torchrun starts them again as a world of 2, and they replan,
    resume from step 10's checkpoint and end with the loss of an uninterrupted run."""
    import socket
    import time

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # The rendezvous store lives here, as it would on a machine that stays up (or in etcd).
    store = torch.distributed.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    checkpoint = tmp_path / "elastic"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=2",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=elastic",
        "--rdzv-conf=is_host=false,last_call_timeout=5,join_timeout=120", "--max-restarts=3",
        "--monitor-interval=0.5", str(EXAMPLE), "--steps", "20", "--save-every", "5",
        "--checkpoint", str(checkpoint), "--lose-node-at", "10",
    ]  # fmt: skip
    agents = []
    for _ in range(2):
        agents.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       text=True, env=FRESH_STORES))  # fmt: skip
        time.sleep(0.3)  # both join the first round
    try:
        outputs = [agent.communicate(timeout=600) for agent in agents]
    except subprocess.TimeoutExpired:
        for agent in agents:
            agent.kill()
        told = [agent.communicate() for agent in agents]
        raise AssertionError(
            "\n".join(
                f"agent {i}:\n{out[-2000:]}\n{err[-3000:]}" for i, (out, err) in enumerate(told)
            )
        ) from None
    finally:
        for agent in agents:
            agent.kill()
        # torchrun starts its workers in sessions of their own: a killed agent leaves them
        # behind, and one stuck connecting to a lost peer would outlive the test.
        _kill_processes_naming(str(checkpoint))
        del store
    (survivor,) = [out for out, _ in outputs if "final loss" in out]
    assert "on mesh of 4 devices" in survivor and "on mesh of 2 devices" in survivor
    assert f"resumed from {checkpoint / 'step-000010'} at step 10" in survivor
    uninterrupted, _ = uninterrupted_gpt
    assert _final_loss(survivor) == pytest.approx(_final_loss(uninterrupted), rel=1e-4)


def _kill_processes_naming(text: str) -> None:
    """Kill every process whose command line contains ``text`` (Linux's /proc)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if text in (entry / "cmdline").read_bytes().decode(errors="replace"):
                os.kill(int(entry.name), signal.SIGKILL)
        except OSError:
            continue


def test_readme_torchrun_snippet(tmp_path: Path) -> None:
    readme = (EXAMPLE.parents[1] / "README.md").read_text()
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", readme, re.DOTALL) if "from_env" in b]
    script = tmp_path / "snippet.py"
    script.write_text(block + "\ndist.destroy_process_group()\nprint('snippet done')\n")
    _torchrun(script=script, cwd=tmp_path, finished="snippet done")
    assert fxpar.checkpoint.committed_version(tmp_path / "checkpoint").is_dir()
