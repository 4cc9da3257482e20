"""A model bigger than what any rank allocates trains on 4 gloo ranks: built by
fxpar.deferred_init, or on the meta device from a safetensors file written from the eager
model, under a fully sharded plan. Each rank's resident memory while building and compiling
stays under its pieces plus one layer plus a fixed allowance for planning, far below the whole
model, and training gives single-device PyTorch's losses."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import fxpar
from fxpar.models import GPT, GPTConfig, gpt_loss
from fxpar.runtime.launch import spawn
from fxpar.testing.memory import resident_growth

pytestmark = pytest.mark.slow

CONFIG = GPTConfig(n_layer=8, n_embd=512, n_head=8, vocab_size=256, block_size=16, bias=False)
SMALL = GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=16)
"""For the pipeline test, whose point is which stage makes which weights, not memory."""
MIB = 2**20
PLANNING = 40 * MIB
"""What capturing, planning and lowering a step of this model allocate, weights aside (about
25 MiB measured)."""
STEPS = 2


def _batch(config: GPTConfig = CONFIG) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return (
        torch.randint(0, config.vocab_size, (8, 16), generator=generator),
        torch.randint(0, config.vocab_size, (8, 16), generator=generator),
    )


def _eager_losses(model: GPT, config: GPTConfig) -> list[float]:
    """The reference: ``STEPS`` SGD steps of ``model`` on one device."""
    tokens, targets = _batch(config)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(STEPS):
        loss = gpt_loss(model(tokens), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _train(rank: int, world: int, source: str, path: str) -> tuple[int, int, list[float]]:
    torch.set_num_threads(1)
    tokens, targets = _batch()
    tiny = GPTConfig(n_layer=1, n_embd=32, n_head=4, vocab_size=CONFIG.vocab_size)
    fxpar.deferred_init(GPT, tiny)  # one-time setup of kernels and fake tensors, not measured
    gpt_loss(GPT(tiny)(tokens), targets).backward()
    with resident_growth() as growth:
        torch.manual_seed(0)
        if source == "deferred_init":
            model = fxpar.deferred_init(GPT, CONFIG)
        else:
            with torch.device("meta"):
                model = GPT(CONFIG)
        parallel = fxpar.compile(
            model, fxpar.Cluster.from_env(), (tokens,), gpt_loss, example_targets=(targets,),
            optimizer=fxpar.optim.SGD(lr=0.1), manual=fxpar.plans.fully_sharded,
            init=path if source == "safetensors" else None,
        )  # fmt: skip
    held = sum(t.numel() * t.element_size() for t in parallel.parameters.values())
    losses = [float(parallel.step(tokens, targets)) for _ in range(STEPS)]
    return growth.peak_bytes, held, losses


def test_meta_model_trains_on_four_ranks_within_its_pieces(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    eager = GPT(CONFIG)
    state = {k: v.detach().clone() for k, v in eager.state_dict().items() if k != "head.weight"}
    whole = sum(t.numel() * t.element_size() for t in state.values())
    layer = sum(p.numel() * p.element_size() for p in eager.blocks[0].parameters())
    save_file(state, str(tmp_path / "model.safetensors"))  # what save_pretrained writes
    expected = _eager_losses(eager, CONFIG)
    del eager, state
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(MIB))  # see resident_growth
    for source in ("deferred_init", "safetensors"):
        # A fresh interpreter, as glibc reads its MALLOC_ variables only as a process starts.
        for peak, held, losses in spawn(_train, 4, source, str(tmp_path), start_method="spawn"):
            assert held < whole / 3
            assert peak < held + layer + PLANNING < whole, (source, peak / MIB, held / MIB)
            assert losses == pytest.approx(expected, rel=1e-5)


def _pipelined(rank: int, world: int, path: str) -> list[list[float]]:
    tokens, targets = _batch(SMALL)
    runs = []
    for init in (None, path):
        torch.manual_seed(0)
        model = fxpar.deferred_init(GPT, SMALL)
        pipelined = fxpar.compile(
            model, fxpar.Cluster((2,)), (tokens,), gpt_loss, example_targets=(targets,),
            optimizer=fxpar.optim.SGD(lr=0.1), init=init,
            pipeline=fxpar.Pipeline(stages=("blocks.1",), microbatches=2),
        )  # fmt: skip
        runs.append([float(pipelined.step(tokens, targets)) for _ in range(STEPS)])
    return runs


def test_pipeline_stages_start_from_a_deferred_model_or_a_checkpoint(tmp_path: Path) -> None:
    """Each stage makes or reads only its own weights; both train like the eager model."""
    torch.manual_seed(0)
    eager = GPT(SMALL)
    save_file(
        {k: v.detach().clone() for k, v in eager.state_dict().items() if k != "head.weight"},
        str(tmp_path / "model.safetensors"),
    )
    expected = _eager_losses(eager, SMALL)
    for runs in spawn(_pipelined, 2, str(tmp_path)):
        for losses in runs:
            assert losses == pytest.approx(expected, rel=1e-5)
