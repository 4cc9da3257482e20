"""Checkpoints are all-or-nothing, strict about what they hold, and complete enough to resume
exactly: a save killed on one rank leaves the previous checkpoint loadable and the torn one
refused; another model's checkpoint is refused unless strict=False; a resumed run with dropout
draws what the uninterrupted one draws."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint.filesystem as dcp_filesystem
from conftest import Planted

import fxpar
from fxpar import checkpoint_objects
from fxpar.errors import CheckpointError
from fxpar.models import GPT, GPTConfig, gpt_loss
from fxpar.runtime.launch import SpawnError, spawn


def _config(layers: int = 2, dropout: float = 0.0) -> GPTConfig:
    return GPTConfig(vocab_size=32, block_size=8, n_layer=layers, n_head=2, n_embd=16,
                     dropout=dropout)  # fmt: skip


def _batches(count: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, 32, (4, 8), generator=generator) for _ in range(count)]


def _compile(
    model: torch.nn.Module,
    optimizer: object = None,
    mesh: tuple[int, ...] = (1,),
) -> fxpar.ParallelModel:
    tokens = _batches(1)[0]
    return fxpar.compile(
        model, fxpar.Cluster(mesh), (tokens,), gpt_loss, example_targets=(tokens,),
        optimizer=optimizer or fxpar.optim.AdamW(lr=1e-2),
    )  # fmt: skip


# -- atomic saves -------------------------------------------------------------------------------


def _die_while_writing(*args: object, **kwargs: object) -> object:
    os._exit(17)  # as a kill -9 would: no Python error, no cleanup


def _save_twice_dying_in_the_second(rank: int, world_size: int, root: str) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    parallel = _compile(GPT(_config(dropout=0.1)), mesh=(world_size,))
    batches = _batches(6)
    for tokens in batches[:3]:
        parallel.step(tokens, tokens)
    parallel.save(root)
    state = parallel.full_state_dict()
    if rank == 0:
        torch.save(state, Path(root).parent / "step3.pt")
    for tokens in batches[3:]:
        parallel.step(tokens, tokens)
    if rank == 1:
        original = dcp_filesystem._write_item
        written: list[int] = []

        def write_then_die(*args: object, **kwargs: object) -> object:
            if written:  # one item is on disk: a torn write
                _die_while_writing()
            written.append(1)
            return original(*args, **kwargs)  # type: ignore[arg-type]

        dcp_filesystem._write_item = write_then_die
    parallel.save(root)


def _load(rank: int, world_size: int, root: str) -> dict[str, object]:
    torch.set_num_threads(1)
    torch.manual_seed(99)  # another initialization, overwritten by the load
    parallel = _compile(GPT(_config(dropout=0.1)), mesh=(world_size,))
    parallel.load(root)
    return {"steps": parallel.steps, "state": parallel.full_state_dict()}


@pytest.mark.slow
def test_a_save_killed_on_one_rank_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "checkpoint"
    with pytest.raises(SpawnError):
        spawn(_save_twice_dying_in_the_second, 2, str(root), timeout_s=60)
    versions = [p for p in root.iterdir() if p.is_dir()]
    assert len(versions) == 2  # the committed one and the torn one beside it
    committed = fxpar.checkpoint.committed_version(root)
    (torn,) = [p for p in versions if p != committed]
    step3 = torch.load(tmp_path / "step3.pt")
    for result in spawn(_load, 2, str(root), timeout_s=60):
        assert result["steps"] == 3
        for name, value in step3.items():
            assert torch.equal(result["state"][name], value), name  # type: ignore[index]
    with pytest.raises(CheckpointError, match="no commit record"):
        fxpar.checkpoint.committed_version(torn)


def test_a_damaged_or_uncommitted_checkpoint_is_refused(tmp_path: Path) -> None:
    parallel = _compile(GPT(_config()))
    parallel.step(*_batches(1) * 2)
    parallel.save(tmp_path / "checkpoint")
    with pytest.raises(CheckpointError, match="no commit record"):
        parallel.load(tmp_path)  # the parent directory: nothing was committed there
    (piece,) = fxpar.checkpoint.committed_version(tmp_path / "checkpoint").glob("*.distcp")
    piece.write_bytes(piece.read_bytes()[:-10])  # truncated after the commit
    with pytest.raises(CheckpointError, match=r"is damaged: __0_0.distcp has \d+ bytes"):
        parallel.load(tmp_path / "checkpoint")
    piece.unlink()
    with pytest.raises(CheckpointError, match=r"__0_0.distcp is missing"):
        parallel.load(tmp_path / "checkpoint")


def test_a_flipped_byte_inside_tensor_data_is_refused(tmp_path: Path) -> None:
    """Same sizes, other bytes: the commit record's digests catch what its sizes cannot, and
    the error is a CheckpointError naming the file (not DCP's BaseException, nor a model
    that loads with other weights)."""
    parallel = _compile(GPT(_config()))
    parallel.step(*_batches(1) * 2)
    parallel.save(tmp_path / "checkpoint")
    (piece,) = fxpar.checkpoint.committed_version(tmp_path / "checkpoint").glob("*.distcp")
    data = bytearray(piece.read_bytes())
    data[len(data) // 2] ^= 0x10  # inside some tensor's bytes
    piece.write_bytes(bytes(data))
    before = {name: tensor.clone() for name, tensor in parallel.parameters.items()}
    with pytest.raises(CheckpointError, match=r"damaged: __0_0.distcp no longer matches"):
        parallel.load(tmp_path / "checkpoint")
    assert all(torch.equal(parallel.parameters[n], t) for n, t in before.items())


def test_failures_inside_torch_distributed_checkpoint_are_checkpoint_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DCP raises CheckpointException, a BaseException that ``except Exception`` misses:
    saves and loads raise a CheckpointError saying what failed instead."""
    from torch.distributed.checkpoint.api import CheckpointException

    parallel = _compile(GPT(_config()))
    parallel.save(tmp_path / "good")

    def refuse(*args: object, **kwargs: object) -> None:
        raise CheckpointException("planning", {0: (OSError("disk quota exceeded"), None)})

    monkeypatch.setattr(torch.distributed.checkpoint, "save", refuse)
    monkeypatch.setattr(torch.distributed.checkpoint, "load", refuse)
    with pytest.raises(CheckpointError, match=r"writing the checkpoint at .* failed"):
        parallel.save(tmp_path / "bad")
    with pytest.raises(CheckpointError, match=r"reading the checkpoint at .* failed"):
        parallel.load(tmp_path / "good")
    monkeypatch.undo()
    parallel.load(tmp_path / "good")  # the failed save left the good one as it was


def test_a_new_save_replaces_the_old_version(tmp_path: Path) -> None:
    parallel = _compile(GPT(_config()))
    tokens = _batches(1)[0]
    for _ in range(2):
        parallel.step(tokens, tokens)
        parallel.save(tmp_path)
    assert [p.name for p in tmp_path.iterdir() if p.is_dir()] == [
        fxpar.checkpoint.committed_version(tmp_path).name
    ]


# -- strict loads -------------------------------------------------------------------------------


def test_loading_another_depth_is_refused_unless_not_strict(tmp_path: Path) -> None:
    torch.manual_seed(0)
    deep = _compile(GPT(_config(layers=2)))
    deep.save(tmp_path / "deep")
    torch.manual_seed(1)
    shallow = _compile(GPT(_config(layers=1)))
    shallow.save(tmp_path / "shallow")
    with pytest.raises(CheckpointError, match=r"entries this model lacks: model/blocks\.1\."):
        shallow.load(tmp_path / "deep")
    with pytest.raises(CheckpointError, match=r"no entry for model/blocks\.1\."):
        deep.load(tmp_path / "shallow")

    before = deep.full_state_dict()
    deep.load(tmp_path / "shallow", strict=False)
    after, saved = deep.full_state_dict(), shallow.full_state_dict()
    for name, value in after.items():
        expected = saved[name] if name in saved else before[name]  # the rest is left alone
        assert torch.equal(value, expected), name
    shallow.load(tmp_path / "deep", strict=False)
    assert torch.equal(shallow.full_state_dict()["wte.weight"], before["wte.weight"])


def test_another_optimizers_state_is_refused(tmp_path: Path) -> None:
    adam = _compile(GPT(_config()), fxpar.optim.AdamW(lr=1e-2))
    tokens = _batches(1)[0]
    adam.step(tokens, tokens)
    adam.save(tmp_path)
    sgd = _compile(GPT(_config()), fxpar.optim.SGD(lr=0.1, momentum=0.9))
    with pytest.raises(CheckpointError, match=r"lacks: optimizer/.*/exp_avg"):
        sgd.load(tmp_path)


# -- complete state -----------------------------------------------------------------------------


def test_a_resumed_run_with_dropout_draws_what_an_uninterrupted_one_draws(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = GPT(_config(dropout=0.3))
    batches = _batches(4)
    uninterrupted = _compile(model)
    losses = [uninterrupted.step(tokens, tokens) for tokens in batches[:2]]
    uninterrupted.save(tmp_path)
    losses += [uninterrupted.step(tokens, tokens) for tokens in batches[2:]]

    torch.manual_seed(5)  # another initialization and another random state, both replaced
    resumed = _compile(GPT(_config(dropout=0.3)))
    resumed.load(tmp_path)
    assert resumed.steps == 2
    again = [resumed.step(tokens, tokens) for tokens in batches[2:]]
    assert torch.equal(torch.stack(again), torch.stack(losses[2:]))


def test_loading_runs_no_code_from_the_checkpoint(tmp_path: Path) -> None:
    """An ``extra`` that would run code when unpickled is refused with a CheckpointError,
    and nothing runs; ``trusted=True`` builds it (the refusal is what kept it from running)."""
    marker = tmp_path / "marker"
    parallel = _compile(GPT(_config()))
    parallel.save(tmp_path / "ckpt", extra={"evil": Planted(str(marker)), "step": 3})
    assert not marker.exists()
    with pytest.raises(CheckpointError, match="objects other than plain data"):
        parallel.load(tmp_path / "ckpt")
    fxpar.checkpoint.save_step(parallel, tmp_path / "run", 4, extra=Planted(str(marker)))
    with pytest.raises(CheckpointError, match="objects other than plain data"):
        fxpar.checkpoint.resume(parallel, tmp_path / "run")
    assert not marker.exists()
    extra = parallel.load(tmp_path / "ckpt", trusted=True)
    assert marker.read_text() == "ran" and extra == {"evil": str(marker), "step": 3}


def test_schedulers_and_plain_state_round_trip_without_trust(tmp_path: Path) -> None:
    parallel = _compile(GPT(_config()))
    schedulers = [
        torch.optim.lr_scheduler.StepLR(parallel.optimizer, step_size=2, gamma=0.5),
        torch.optim.lr_scheduler.CosineAnnealingLR(parallel.optimizer, T_max=10),
    ]
    for tokens in _batches(3):
        parallel.step(tokens, tokens)
        for scheduler in schedulers:
            scheduler.step()
    extra = {
        "schedulers": [s.state_dict() for s in schedulers],
        "position": (7, "shard-3"),
        "counts": torch.arange(4),
    }
    parallel.save(tmp_path / "ckpt", extra=extra)
    resumed = _compile(GPT(_config()))
    loaded = resumed.load(tmp_path / "ckpt")
    assert loaded["schedulers"] == extra["schedulers"] and loaded["position"] == (7, "shard-3")
    assert torch.equal(loaded["counts"], extra["counts"])
    assert resumed.optimizer.param_groups[0]["lr"] == parallel.optimizer.param_groups[0]["lr"]


def test_plain_pickles_of_older_checkpoints_need_trust(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Entries an older fxpar wrote with pickle.dumps load only with ``trusted=True``."""
    import io
    import pickle

    parallel = _compile(GPT(_config()))
    with monkeypatch.context() as patched:
        patched.setattr(
            checkpoint_objects, "_serialized", lambda value: io.BytesIO(pickle.dumps(value))
        )
        parallel.save(tmp_path / "old", extra={"step": 5})
    with pytest.raises(CheckpointError, match="plain pickle"):
        parallel.load(tmp_path / "old")
    assert fxpar.checkpoint.resume(parallel, tmp_path) is None  # not a step directory
    assert parallel.load(tmp_path / "old", trusted=True) == {"step": 5}
