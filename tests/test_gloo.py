"""Real multi-process runs on gloo: the per-rank programs of each manual plan, run by 2 and 4
local processes with torch.distributed collectives, give single-device training's loss and
gradients; and launch failures surface in the parent as clear errors.

Each world size is spawned once for all its (plan, mesh) cases, to keep process start-up (an
import of torch per process) off the test time. Every process builds the same model and batch
from fixed seeds and lowers the same plan (lowering is deterministic), so the parent can lower
again to assemble the outputs the processes send back.
"""

from __future__ import annotations

import copy
import functools
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import fxpar
from fxpar import plans
from fxpar.cluster import Cluster, Coordinate
from fxpar.errors import FxparError
from fxpar.lowering import SPMDProgram, lower
from fxpar.models import GPT, GPTConfig, gpt_loss
from fxpar.runtime.launch import SpawnError, run_rank, spawn

pytestmark = pytest.mark.slow

CONFIG = GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=16)
PLANS: dict[str, Callable[[fxpar.Program, Cluster], fxpar.Program]] = {
    "data_parallel": plans.data_parallel,
    # tensor axis -1; on a 2-D mesh the batch is split over axis 0
    "tensor_parallel": plans.tensor_parallel,
    "fully_sharded": plans.fully_sharded,
}
Case = tuple[str, tuple[int, ...]]
CASES: list[Case] = [
    *((plan, (2,)) for plan in PLANS),
    *((plan, (4,)) for plan in PLANS),
    ("tensor_parallel", (2, 2)),
]
PerRankOutputs = dict[Case, tuple[torch.Tensor, ...]]


@functools.cache
def _captured() -> tuple[GPT, torch.Tensor, torch.Tensor, fxpar.Program]:
    """The same weights, batch and Program in every process, built once per process (plans
    annotate a copy of the Program)."""
    torch.manual_seed(0)
    model = GPT(CONFIG)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, CONFIG.vocab_size, (4, 8), generator=generator)
    targets = torch.randint(0, CONFIG.vocab_size, (4, 8), generator=generator)
    program = fxpar.capture(model, (tokens,), gpt_loss, example_targets=(targets,))
    return model, tokens, targets, program


def _lowered(plan: str, mesh: tuple[int, ...]) -> tuple[SPMDProgram, list[torch.Tensor]]:
    """The per-rank programs of ``plan`` on ``mesh`` and the global inputs they split."""
    model, tokens, targets, program = _captured()
    cluster = Cluster(mesh)
    spmd = lower(PLANS[plan](copy.deepcopy(program), cluster), cluster)
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    names = program.signature.parameters + program.signature.buffers
    return spmd, [state[name].detach() for name in names] + [tokens, targets]


def _run_cases(rank: int, world_size: int, cases: list[Case]) -> PerRankOutputs:
    torch.set_num_threads(1)  # the processes share the machine's few cores
    outputs = {}
    for plan, mesh in cases:
        spmd, flat_inputs = _lowered(plan, mesh)
        outputs[plan, mesh] = run_rank(spmd, rank, flat_inputs, spmd.cluster.device_mesh())
    return outputs


@pytest.fixture(scope="module")
def gloo_outputs() -> Callable[[int], list[PerRankOutputs]]:
    """Every rank's local outputs for every case of one world size, spawned on first use."""
    runs: dict[int, list[PerRankOutputs] | SpawnError] = {}

    def outputs(world_size: int) -> list[PerRankOutputs]:
        if world_size not in runs:
            cases = [case for case in CASES if math.prod(case[1]) == world_size]
            try:
                runs[world_size] = spawn(_run_cases, world_size, cases)
            except SpawnError as error:  # reported by every case of this world size
                runs[world_size] = error
        run = runs[world_size]
        if isinstance(run, SpawnError):
            raise run
        return run

    return outputs


@pytest.mark.parametrize(
    ("plan", "mesh"), CASES, ids=[f"{plan}-{'x'.join(map(str, mesh))}" for plan, mesh in CASES]
)
def test_plan_on_gloo_processes_matches_single_device(
    plan: str,
    mesh: tuple[int, ...],
    gloo_outputs: Callable[[int], list[PerRankOutputs]],
) -> None:
    """Real collectives between processes compute the loss and gradients of one device."""
    model, tokens, targets, program = _captured()
    expected = program.run(model, tokens, targets)

    spmd, _ = _lowered(plan, mesh)
    per_rank = gloo_outputs(math.prod(mesh))
    local: dict[Coordinate, tuple[torch.Tensor, ...]] = {
        spmd.ranks[rank].coordinate: outputs[plan, mesh] for rank, outputs in enumerate(per_rank)
    }
    result = spmd.assemble_outputs(local)

    torch.testing.assert_close(result.loss, expected.loss, rtol=1e-4, atol=1e-6)
    assert set(result.gradients) == set(expected.gradients)
    for name, grad in expected.gradients.items():
        torch.testing.assert_close(result.gradients[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    assert set(result.buffers) == set(expected.buffers)


def _fail_on_rank_1(rank: int, world_size: int) -> None:
    if rank == 1:
        time.sleep(0.2)  # usually lets rank 0 enter the barrier first; either order must work
        raise ValueError("rank 1 fails on purpose")
    dist.barrier()  # fails with "Connection closed by peer" once rank 1 is gone, or is killed


def test_a_failing_process_is_reported_in_the_parent_with_its_rank_and_error() -> None:
    """The rank that failed first is named, not its peer left waiting in a collective."""
    with pytest.raises(SpawnError) as info:
        spawn(_fail_on_rank_1, 2)
    assert info.value.rank == 1
    message = str(info.value)
    assert message.startswith("rank 1 of 2 failed")
    assert "ValueError: rank 1 fails on purpose" in message


class _SlowToSave:
    """A return value whose saving takes a while; it loads back as ``value``."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __reduce__(self) -> tuple[type[int], tuple[int]]:
        time.sleep(0.5)
        return int, (self.value,)


def _abort_while_tearing_down(rank: int, world_size: int, when: str) -> object:
    """Rank 1 dies by SIGABRT: while the run is still going, or once it has finished (in
    destroy_process_group, where gloo's rare teardown aborts strike). Rank 0's result is slow
    to save, so a spawn that saved results after its closing barrier would lose it."""
    if rank == 1 and when == "during":
        os.abort()
    if rank == 1:
        dist.destroy_process_group = lambda *args, **kwargs: os.abort()
        return 10
    return _SlowToSave(0)


def test_an_abort_after_every_rank_finished_loses_no_result() -> None:
    assert spawn(_abort_while_tearing_down, 2, "after") == [0, 10]


def test_an_abort_during_the_run_is_reported() -> None:
    with pytest.raises(SpawnError, match="rank 1 of 2 died without a Python error"):
        spawn(_abort_while_tearing_down, 2, "during", timeout_s=30)


def _misuse_errors(rank: int, world_size: int) -> dict[str, str]:
    """The errors of two misuses inside a process group, by misuse."""
    torch.set_num_threads(1)
    errors = {}
    try:
        Cluster((2 * world_size,)).device_mesh()
    except FxparError as error:
        errors["device_mesh"] = str(error)
    spmd, flat_inputs = _lowered("data_parallel", (world_size,))
    try:
        run_rank(spmd, world_size - 1 - rank, flat_inputs, spmd.cluster.device_mesh())
    except FxparError as error:
        errors["run_rank"] = str(error)
    return errors


@pytest.fixture(scope="module")
def misuse_errors() -> list[dict[str, str]]:
    """Each of 2 processes' errors; one spawn serves the tests below."""
    return spawn(_misuse_errors, 2)


def test_device_mesh_rejects_a_process_group_of_another_size(
    misuse_errors: list[dict[str, str]],
) -> None:
    for errors in misuse_errors:
        message = errors["device_mesh"]
        assert "has 2 ranks" in message and "(4,) has 4 devices" in message


def test_run_rank_rejects_a_rank_that_is_not_this_process(
    misuse_errors: list[dict[str, str]],
) -> None:
    """A swapped rank would otherwise exchange the wrong pieces or hang at a collective. (Also
    shows that spawn returns each process's value in rank order.)"""
    for rank, errors in enumerate(misuse_errors):
        message = errors["run_rank"]
        assert f"asked for rank {1 - rank} at ({1 - rank},)" in message
        assert f"this process sits at ({rank},)" in message


def _where_and_what(rank: int, world_size: int) -> tuple[str, str | None, int]:
    print(f"rank {rank} prints", flush=True)
    print(f"rank {rank} warns", file=sys.stderr, flush=True)
    return os.getcwd(), os.environ.get("FXPAR_TEST_SPAWN"), os.getpid()


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_processes_take_the_callers_directory_environment_and_output(
    start_method: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """Changed after the fork server started (an earlier call started it), the caller's
    working directory, environment and standard output and error (captured here) still reach
    every process, as a fresh interpreter's would."""
    with capfd.disabled():
        spawn(_where_and_what, 1)  # the fork server runs from here on, with other outputs
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FXPAR_TEST_SPAWN", "here")
    results = spawn(_where_and_what, 2, start_method=start_method)  # type: ignore[arg-type]
    assert [(cwd, value) for cwd, value, _ in results] == [(str(tmp_path), "here")] * 2
    assert len({pid for *_, pid in results} | {os.getpid()}) == 3
    out, err = capfd.readouterr()
    # (the two processes' writes may interleave)
    assert "rank 0 prints" in out and "rank 1 prints" in out
    assert "rank 0 warns" in err and "rank 1 warns" in err


def test_spawn_rejects_an_unknown_start_method() -> None:
    with pytest.raises(FxparError, match="start_method must be 'forkserver' or 'spawn'"):
        spawn(_where_and_what, 2, start_method="fork")  # type: ignore[arg-type]
