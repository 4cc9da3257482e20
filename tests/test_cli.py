"""The demo (README's main job) and the cost report."""

from __future__ import annotations

import re

import pytest
import torch

import fxpar
from fxpar import ir
from fxpar.cli import main
from fxpar.ir.work_report import cost_table, group_of
from fxpar.models import GPT, GPTConfig, gpt_loss
from fxpar.passes import AnnotateCost


def tiny_target() -> tuple[torch.nn.Module, tuple[torch.Tensor], object, tuple[torch.Tensor]]:
    """A ``module:attr`` target for ``fxpar plan``."""
    tokens = torch.zeros(4, 16, dtype=torch.long)
    model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=16))
    return model, (tokens,), gpt_loss, (tokens,)


def deep_target() -> tuple[torch.nn.Module, tuple[torch.Tensor], object, tuple[torch.Tensor]]:
    """A ``module:attr`` target with layers enough to stamp."""
    tokens = torch.zeros(4, 16, dtype=torch.long)
    model = GPT(GPTConfig(n_layer=8, n_embd=16, n_head=2, vocab_size=64, block_size=16))
    return model, (tokens,), gpt_loss, (tokens,)


def bare_module() -> torch.nn.Module:
    return torch.nn.Linear(3, 3)


@pytest.mark.slow
def test_demo_trains_on_gloo_processes_like_one_device(capfd: pytest.CaptureFixture[str]) -> None:
    """README's main job, shortened: the plan report (printed by rank 0's process, hence
    captured at the file-descriptor level), then both loss columns, equal."""
    assert main(["demo", "--steps", "6", "--devices", "2"]) == 0
    out = capfd.readouterr().out
    assert "plan: ilp, optimal" in out and "blocks.0" in out
    rows = re.findall(r"^\s+(\d+)\s+(\d+\.\d+)\s+(\d+\.\d+)$", out, flags=re.MULTILINE)
    assert [int(step) for step, _, _ in rows] == [1, 2, 3, 4, 5, 6]
    assert all(single == parallel for _, single, parallel in rows)
    assert float(rows[-1][1]) < float(rows[0][1])  # it learns
    assert "(the curves agree)" in out


def test_plan_command_prints_and_saves_the_report(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    plan_file, picture = tmp_path / "plan.json", tmp_path / "plan.png"
    argv = ["plan", "--model", "test_cli:tiny_target", "--mesh", "2x2", "--cluster", "cpu"]
    assert main([*argv, "--save", str(plan_file), "--plot", str(picture)]) == 0
    out = capsys.readouterr().out
    assert "for mesh of 4 devices (axis0=2, axis1=2)" in out
    assert "plan: ilp, optimal" in out and "blocks.0" in out
    assert plan_file.read_text().startswith("{") and picture.read_bytes()[:4] == b"\x89PNG"
    assert main([*argv, "--solver", "tensor_parallel", "--microbatches", "2"]) == 0
    out = capsys.readouterr().out
    assert "plan: tensor_parallel" in out
    assert "as a pipeline of 2 micro-batches on mesh of 4 devices" in out
    assert "split points:" in out and "settings tried: 1f1b, remat off: " in out
    assert "zb-h1, remat off: " in out  # the zero-bubble schedule is searched too
    # A stage mesh of one row names its axis as the cluster does (axis1).
    assert "plan on stage mesh (2,): axis1 (2): tensor parallel" in out
    assert re.search(r"intra-op plan alone: \S+ \S+ per step; best pipeline: \S+ \S+; chosen", out)
    assert "precision" not in out and "recomputed" not in out
    assert main([*argv, "--precision", "bf16", "--recompute", "all"]) == 0
    out = capsys.readouterr().out
    assert (
        "precision       bfloat16 compute, float32 master weights, gradients summed in "
        "float32" in out
    )
    assert "again in the backward: 2 layers (blocks.0, blocks.1)" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "nope", "--mesh", "8"], "unknown model 'nope'"),
        (["--model", "gpt2-small", "--mesh", "2y4"], "cannot read a mesh shape from '2y4'"),
        (["--model", "gpt2-small", "--mesh", "8", "--cluster", "tpu"], "unknown cluster preset"),
        (["--model", "no_such_module:f", "--mesh", "8"], "cannot load 'no_such_module:f'"),
        (["--model", "test_cli:bare_module", "--mesh", "8"], "cannot guess its inputs"),
        (["--model", "test_cli:tiny_target", "--mesh", "8", "--solver", "magic"], "unknown solver"),
    ],
)
def test_plan_command_errors(argv: list[str], message: str, capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["plan", *argv]) == 2
    assert message in capsys.readouterr().err


def test_cost_table_totals_match_the_annotations() -> None:
    model = GPT(GPTConfig(n_layer=2))
    tokens = torch.randint(0, 256, (2, 8))
    program = AnnotateCost().run(
        fxpar.capture(model, (tokens,), gpt_loss, example_targets=(tokens,))
    )
    table = cost_table(program, depth=1)
    total_line = table.splitlines()[-1].split()
    forward = sum(
        ir.require(n, ir.Cost).flops
        for n in program.graph.nodes
        if ir.require(n, ir.Region).phase is ir.Phase.FORWARD
    )
    assert total_line[0] == "total" and total_line[4] == f"{forward / 1e6:.1f}M"
    assert int(total_line[2]) == len(list(program.nodes(ir.Phase.FORWARD)))
    assert [line.split()[0] for line in table.splitlines()[2:-2]].count("blocks") == 1


def test_group_of() -> None:
    assert group_of("blocks.3.attn.qkv", 2) == "blocks.3"
    assert group_of("", 2) == "<root>"
    assert group_of(ir.LOSS_REGION, 1) == ir.LOSS_REGION


def test_plan_command_weighs_stages_of_replicas_too(capsys) -> None:  # type: ignore[no-untyped-def]
    """With micro-batches, each count's stages of data-parallel replicas are printed beside
    the stage meshes' pipeline, and the verdict's best pipeline is the cheaper of the two."""
    argv = ["plan", "--model", "test_cli:tiny_target", "--mesh", "4", "--cluster", "cpu"]
    assert main([*argv, "--microbatches", "2"]) == 0
    out = capsys.readouterr().out
    meshes, replicas = out.split("as stages of data-parallel replicas (no plan inside a stage):")
    assert "inside each stage: an intra-op plan" in meshes
    assert "inside each stage" not in replicas and "2 stage(s) x 2 device(s)" in replicas

    def step(text: str) -> str:
        found = re.search(r"remat \w+: (\S+ \S+) per step \(estimated\)", text)
        assert found is not None
        return found.group(1)

    def seconds(shown: str) -> float:
        number, unit = shown.split()
        return float(number) * {"s": 1.0, "ms": 1e-3, "us": 1e-6}[unit]

    best = min(step(meshes), step(replicas), key=seconds)
    assert f"best pipeline: {best};" in out


def test_plan_command_finds_a_pipeline_where_no_plan_of_the_batch_fits(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    """A memory limit below the most frugal plan of the whole batch, above what one
    micro-batch's stages need: the command says so, prints the joint plan and succeeds; below
    both, it fails with both reasons."""
    argv = ["plan", "--model", "test_cli:tiny_target", "--mesh", "2x2", "--cluster", "cpu"]
    saved = tmp_path / "plan.json"
    tight = ["--memory-gib", "0.00015", "--microbatches", "2"]
    assert main([*argv, *tight, "--save", str(saved)]) == 0
    out = capsys.readouterr().out
    assert "no intra-op plan of the whole batch fits" in out
    assert "--save and --plot write the intra-op plan of the whole batch: none fits" in out
    assert not saved.exists()
    assert "pipeline: 1 stage(s) x 4 device(s), 2 micro-batches, 1f1b" in out
    assert "gpipe, remat off: no pipeline of this step fits" in out  # 1F1B holds fewer
    assert "intra-op plan alone: no plan fits per step; best pipeline:" in out
    assert "chosen: the pipeline" in out
    assert main([*argv, "--memory-gib", "0.00005", "--microbatches", "2"]) == 2
    out = capsys.readouterr().out
    assert "no pipeline runs this step" in out and "chosen: neither fits" in out
    assert main([*argv, "--microbatches", "2,x"]) == 2
    assert "--microbatches takes counts like 8 or 4,8,16" in capsys.readouterr().err


def test_plan_command_stamps_repeated_layers_unless_told_not_to(capsys) -> None:  # type: ignore[no-untyped-def]
    """By default the plan is made on the step stamped from 6 traced layers, and it is the plan
    of the step traced whole: the same estimate."""
    argv = ["plan", "--model", "test_cli:deep_target", "--mesh", "2", "--cluster", "cpu"]
    assert main(argv) == 0
    stamped = capsys.readouterr().out
    assert "captured blocks: 6 of 8 layers traced, layers 3-5 stamped from layer 3" in stamped
    assert main([*argv, "--no-stamp-layers"]) == 0
    whole = capsys.readouterr().out
    assert "stamped" not in whole
    summary = re.compile(r"^(?:estimated step|collectives|memory|graph) .*$", re.MULTILINE)
    assert summary.findall(stamped) == summary.findall(whole)
    assert len(summary.findall(whole)) == 4
