"""The Hugging Face examples under torchrun, on 2 processes: examples/train_lm.py, a whole LLM
training loop, ends where single-device PyTorch does, also when stopped half way and resumed
under the same or another mesh; examples/train_bert.py, a bf16 BERT fine-tuning loop with eval
accuracy, follows single-device PyTorch to bf16 rounding and resumes exactly. (Split from
tests/test_examples.py, which runs train_gpt.py, so that two test workers share the launches.)"""

from __future__ import annotations

import importlib.util
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from conftest import torchrun
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from fxpar.models.corpus import corpus_tokens

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
LM_EXAMPLE = EXAMPLES / "train_lm.py"


def _lm_eager_final_loss(steps: int, rows: int = 4, accumulate: int = 2, world: int = 2) -> float:
    """examples/train_lm.py's run on one device, written out with plain PyTorch: every rank's
    rows together, two micro-batches per update, clipping, AdamW, the same schedule."""
    spec = importlib.util.spec_from_file_location("train_lm", LM_EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    tokens = corpus_tokens()
    train_set = TensorDataset(example.windows(tokens[: tokens.numel() * 9 // 10], stride=4))
    samplers = [
        DistributedSampler(
            train_set, num_replicas=world, rank=r, shuffle=True, seed=0, drop_last=True
        )
        for r in range(world)
    ]
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=example.LENGTH,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, example.warmup_cosine(warmup=max(1, steps // 10), total=steps)
    )
    done, epoch, loss = 0, 0, 0.0
    while done < steps:
        loaders = []
        for sampler in samplers:
            sampler.set_epoch(epoch)
            loaders.append(DataLoader(train_set, batch_size=rows * accumulate, sampler=sampler,
                                      drop_last=True))  # fmt: skip
        for per_rank in zip(*loaders, strict=True):
            pieces = [rows_of.chunk(accumulate) for (rows_of,) in per_rank]
            losses = []
            for micro in range(accumulate):
                batch = torch.cat([p[micro] for p in pieces])
                micro_loss = model(input_ids=batch, labels=batch).loss
                (micro_loss / accumulate).backward()
                losses.append(micro_loss.item())
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            done += 1
            loss = sum(losses) / accumulate
            if done == steps:
                break
        epoch += 1
    return loss


def test_train_lm_equals_one_device_and_resumes(tmp_path: Path) -> None:
    """The realistic loop (local batches from a DistributedSampler, accumulation, clipping, a
    warmup-cosine schedule, eval, checkpoints with the scheduler and the data position) ends
    where plain single-device PyTorch ends, and a run stopped half way and resumed, under the
    same or another mesh, ends there too."""
    common = ("--steps", "16", "--eval-every", "8", "--save-every", "4")
    expected = _lm_eager_final_loss(16)
    stopped = tmp_path / "b"
    first = torchrun(LM_EXAMPLE, *common, "--stop-after", "8", "--checkpoint", str(stopped))
    assert re.findall(r"eval  step +(\d+)  held-out loss", first) == ["8"]
    shutil.copytree(stopped, tmp_path / "c")
    # An uninterrupted run is not started: tests/test_examples.py checks that a resumed train_gpt
    # run ends bit for bit where an uninterrupted one does; here both end where eager does.
    resumed = torchrun(LM_EXAMPLE, *common, "--checkpoint", str(stopped))
    assert f"resumed from {stopped / 'step-000008'} at step 8" in resumed
    (final,) = re.findall(r"final loss (\d+\.\d+) at step 16", resumed)
    assert float(final) == pytest.approx(expected, rel=1e-5)
    assert re.findall(r"eval  step +(\d+)  held-out loss", resumed) == ["16"]
    elsewhere = torchrun(LM_EXAMPLE, *common, "--mesh", "1x2", "--checkpoint", str(tmp_path / "c"))
    (moved,) = re.findall(r"final loss (\d+\.\d+) at step 16", elsewhere)
    assert float(moved) == pytest.approx(expected, rel=1e-5)


BERT_EXAMPLE = EXAMPLES / "train_bert.py"


def _example_module(path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _bert_one_device(
    steps: int, eval_every: int, lr: float, rows: int = 8, world: int = 2
) -> dict[str, Any]:
    """examples/train_bert.py's loop on one device, in plain PyTorch with bf16 compute on
    float32 masters (fxpar.MixedPrecision's arithmetic): each update's two micro-batches are
    every rank's first half, then every rank's second half, of its rows, in rank order."""
    example = _example_module(BERT_EXAMPLE)
    train_set, held_out = example.dataset(512, seed=1), example.dataset(128, seed=2)
    samplers = [
        DistributedSampler(
            train_set, num_replicas=world, rank=r, shuffle=True, seed=0, drop_last=True
        )
        for r in range(world)
    ]
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(example.config())
    masters = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    optimizer = torch.optim.AdamW(masters.values(), lr=lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, example.warmup_then_decay(warmup=max(1, steps // 10), total=steps)
    )

    def loss_of(
        ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        computed = {name: p.to(torch.bfloat16) for name, p in masters.items()}
        inputs = {"input_ids": ids, "attention_mask": mask, "labels": labels}
        output = torch.func.functional_call(model, (computed, buffers), (), inputs)
        return output.loss.float(), output.logits

    result: dict[str, Any] = {"losses": [], "evals": []}
    done, epoch = 0, 0
    while done < steps:
        loaders = []
        for sampler in samplers:
            sampler.set_epoch(epoch)
            loaders.append(DataLoader(train_set, batch_size=rows * 2, sampler=sampler,
                                      drop_last=True))  # fmt: skip
        for per_rank in zip(*loaders, strict=True):
            losses = []
            for micro in range(2):
                batch = [
                    torch.cat([t.chunk(2)[micro] for t in ts]) for ts in zip(*per_rank, strict=True)
                ]
                loss, _ = loss_of(*batch)
                (loss / 2).backward()
                losses.append(loss.item())
            torch.nn.utils.clip_grad_norm_(masters.values(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            done += 1
            result["losses"].append(sum(losses) / 2)
            if done % eval_every == 0:
                model.eval()
                with torch.no_grad():
                    loss, logits = loss_of(*held_out.tensors)
                model.train()
                right = (logits.argmax(-1) == held_out.tensors[2]).float().mean().item()
                result["evals"].append((loss.item(), right))
            if done == steps:
                break
        epoch += 1
    return result


def _bert_run(output: str) -> dict[str, Any]:
    return {
        "losses": {
            int(s): float(x) for s, x in re.findall(r"step +(\d+)  loss (\d+\.\d+)", output)
        },
        "evals": [
            (float(loss), float(right))
            for loss, right in re.findall(r"held-out loss (\d+\.\d+)  accuracy (\d+\.\d+)", output)
        ],
        "final": re.findall(r"final loss (\d+\.\d+) at step (\d+)", output),
    }


def test_train_bert_equals_one_device_and_resumes(tmp_path: Path) -> None:
    """The BERT fine-tuning loop (local batches from a DistributedSampler, bf16 compute,
    accumulation, clipping, AdamW with warmup and decay, eval loss and accuracy from this
    rank's rows, step checkpoints) on 2 processes follows the same loop on one device, to bf16
    rounding: each rank computes its half in bf16 where one device computes the whole. A run
    killed after its step-4 checkpoint and started again ends exactly as the uninterrupted run."""
    common = ("--steps", "8", "--save-every", "4", "--log-every", "1", "--lr", "3e-3")
    output = torchrun(
        BERT_EXAMPLE, *common, "--eval-every", "4", "--checkpoint", str(tmp_path / "a")
    )
    whole = _bert_run(output)
    expected = _bert_one_device(steps=8, eval_every=4, lr=3e-3)
    assert sorted(whole["losses"]) == list(range(1, 9))
    found = [whole["losses"][step] for step in range(1, 9)]
    torch.testing.assert_close(found, expected["losses"], rtol=2e-2, atol=0.0)
    assert len(whole["evals"]) == 2
    for (loss, right), (loss_1, right_1) in zip(whole["evals"], expected["evals"], strict=True):
        assert loss == pytest.approx(loss_1, rel=2e-2)
        assert abs(right - right_1) <= 2 / 128  # a near tie may round either way

    killed = tmp_path / "b"  # as a run killed after its step-4 checkpoint leaves it
    shutil.copytree(tmp_path / "a", killed)
    shutil.rmtree(killed / "step-000008")
    # Without evaluations (they change nothing, and planning them takes time).
    output = torchrun(BERT_EXAMPLE, *common, "--eval-every", "0", "--checkpoint", str(killed))
    assert "resumed at step 4" in output
    resumed = _bert_run(output)
    assert resumed["losses"] == {step: whole["losses"][step] for step in range(5, 9)}
    assert resumed["final"] == whole["final"]
