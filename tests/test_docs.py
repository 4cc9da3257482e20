"""The code in README.md and docs/ runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import torch

import fxpar
from fxpar import ir
from fxpar.passes import default_pipeline

ROOT = Path(__file__).resolve().parents[1]


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.DOTALL)


def test_readme_example_runs() -> None:
    namespace: dict[str, object] = {}
    (block,) = [b for b in python_blocks(ROOT / "README.md") if "fxpar.capture(" in b]
    exec(block, namespace)
    result = namespace["result"]
    assert isinstance(result, fxpar.StepResult) and torch.isfinite(result.loss)


def test_writing_a_pass_example_runs_in_the_default_pipeline() -> None:
    namespace: dict[str, object] = {}
    exec(python_blocks(ROOT / "docs" / "passes.md")[0], namespace)
    mark, heavy = namespace["MarkHeavyOps"], namespace["HeavyOps"]
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))
    program = fxpar.capture(model, (torch.randn(8, 16),), lambda y: y.square().mean())
    pipeline = default_pipeline(verify=True).insert_after("annotate-cost", mark(0.1))  # type: ignore[operator]
    program = pipeline.run(program)
    marked = [n for n in program.graph.nodes if ir.get(n, heavy)]  # type: ignore[arg-type]
    assert marked and all(n.target is not torch.ops.aten.t.default for n in marked)


def test_planning_guide_runs() -> None:
    namespace: dict[str, object] = {}
    for block in python_blocks(ROOT / "docs" / "planning.md"):
        exec(block, namespace)
    assert namespace["mine"].solution.solver == "cheapest-nodes"  # type: ignore[attr-defined]


def test_example_runs_and_matches_one_device() -> None:
    import runpy

    example = runpy.run_path(str(ROOT / "examples" / "plan_and_simulate.py"))
    assert example["main"]() < 1e-4
