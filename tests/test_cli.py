"""The demo (README's main job) and the cost report."""

from __future__ import annotations

import re

import pytest
import torch

import fxpar
from fxpar import ir
from fxpar.cli import main
from fxpar.models import GPT, GPTConfig, gpt_loss
from fxpar.passes import AnnotateCost
from fxpar.report import cost_table, group_of


def test_demo_trains_the_program_exactly_like_eager(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--steps", "6", "--every", "2"]) == 0
    out = capsys.readouterr().out
    assert "captured one training step" in out and "blocks.1" in out
    rows = re.findall(r"^\s+(\d+)\s+(\d+\.\d+)\s+(\d+\.\d+)$", out, flags=re.MULTILINE)
    assert [int(step) for step, _, _ in rows] == [1, 2, 4, 6]
    assert all(eager == program for _, eager, program in rows)
    assert float(rows[-1][1]) < float(rows[0][1])  # it learns
    assert "largest parameter difference after 6 steps: 0.00e+00" in out
    # Then one step per named plan on a simulated 4-device mesh, checked against one device.
    row = r"^(data parallel|tensor parallel|fully sharded)\s+(.*?)\s+([\d.]+)\s+([\d.e+-]+)$"
    plans = re.findall(row, out, flags=re.MULTILINE)
    assert [p[0] for p in plans] == ["data parallel", "tensor parallel", "fully sharded"]
    assert all(float(error) < 1e-4 for *_, error in plans)
    assert "8 all_reduce" in plans[1][1]  # Megatron: 2 forward + 2 backward per block, 2 blocks


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
