"""The plan report, plan files and plan pictures: the report's collectives are the lowering's
(its times and memory are the solver's: tests/test_cost_model.py); a saved plan
loads back identical and trains like one device, an edited placement is honoured, and bad files
fail naming what to fix."""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import fxpar
from fxpar import ir, plans
from fxpar.cluster import Cluster
from fxpar.errors import FxparError
from fxpar.models import GPT, GPTConfig, gpt_loss
from fxpar.passes import load_plan, plan_program
from fxpar.planning.plan import Plan
from fxpar.planning.plan_file import PlanFileError, parse_spec
from fxpar.planning.report import compact_spec, layer_namer, plan_collectives, report_data
from fxpar.rules import RuleRegistry
from fxpar.sharding import Sharding
from fxpar.solvers.greedy import GreedySolver
from fxpar.testing import assert_equivalent
from fxpar.testing.strategies import splitting_cluster

ROOT = Path(__file__).resolve().parents[1]
CONFIG = GPTConfig(n_layer=3, n_embd=32, n_head=4, vocab_size=64, block_size=16)


def captured() -> tuple[GPT, fxpar.Program, torch.Tensor]:
    torch.manual_seed(0)
    model = GPT(CONFIG)
    tokens = torch.randint(0, CONFIG.vocab_size, (8, 16))
    return model, fxpar.capture(model, (tokens,), gpt_loss, example_targets=(tokens,)), tokens


@pytest.fixture(scope="module")
def ilp_plan() -> tuple[GPT, Plan, torch.Tensor]:
    model, program, tokens = captured()
    return model, plan_program(program, splitting_cluster((2, 2))), tokens


@pytest.fixture(scope="module")
def dp_plan() -> Plan:
    return plan_program(captured()[1], Cluster((2,)), manual=plans.data_parallel)


def strategies(plan: Plan) -> dict[str, object]:
    return {
        node.name: ir.get(node, Sharding)
        for node in plan.program.graph.nodes
        if ir.get(node, Sharding)
    }


@pytest.mark.parametrize("which", ["ilp_plan", "dp_plan"])
def test_report_collectives_and_totals_agree_with_lowering_and_cost_model(
    which: str, request: pytest.FixtureRequest
) -> None:
    fixture = request.getfixturevalue(which)
    plan: Plan = fixture[1] if isinstance(fixture, tuple) else fixture
    lowered = fxpar.lower(plan).collectives()
    assert lowered, "the test needs a plan with collectives"
    # The graph walk replays the lowering: the same records, in the same order.
    assert plan_collectives(plan.program, plan.cluster) == lowered
    data = report_data(plan)
    counts: Counter[tuple[str, int]] = Counter()
    sizes: Counter[tuple[str, int]] = Counter()
    for layer in data["layers"]:
        for entry in layer["collectives"]:
            counts[entry["kind"], entry["axis"]] += entry["count"]
            sizes[entry["kind"], entry["axis"]] += entry["bytes"]
    assert counts == Counter((r.kind, r.axis) for r in lowered)
    assert sizes == Counter({k: sum(r.bytes for r in lowered if (r.kind, r.axis) == k)
                             for k in counts})  # fmt: skip
    header = data["header"]
    # tests/test_cost_model.py checks that the header's time and memory are the solver's;
    # tests/test_cost_formulas.py the lowered collectives' seconds.
    assert header["collectives"] == len(lowered)
    json.dumps(plan.to_dict())  # plain data all the way down


def test_text_report_has_header_layers_weights_and_collapsed_repeats(dp_plan: Plan) -> None:
    text = dp_plan.report()
    assert "plan: data_parallel" in text and "estimated step" in text and "memory" in text
    assert "graph           " in text and "decisions" in text
    rows = {line.split("  ")[0] for line in text.splitlines()}
    assert {"<inputs>", "wte", "wpe", "ln_f", "total"} <= rows
    # Data parallel: every weight replicated; gradients all-reduced in the layer computing them.
    assert re.search(r"^    .*attn\.qkv\.weight R\b", text, flags=re.MULTILINE)
    assert "AR(axis0)" in text
    collapsed = [line for line in text.splitlines() if "identical)" in line]
    assert collapsed and collapsed[0].startswith("blocks.")
    names = [layer["name"] for layer in report_data(dp_plan)["layers"]]
    assert names.index("wte") < names.index("blocks.0") < names.index("blocks.2")
    assert names.index("blocks.2") < names.index("ln_f") < names.index("<loss>")


def test_ops_without_a_sharding_rule_are_listed() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Tanh())
    program = fxpar.capture(model, (torch.randn(8, 8),), lambda y: y.square().sum())
    bare = plan_program(program, Cluster((2,)), solver=GreedySolver(), rules=RuleRegistry())
    assert "aten.addmm.default" in report_data(bare)["no_rule"]
    assert "run replicated (no sharding rule):" in bare.report()


def test_layer_names_follow_numbered_containers() -> None:
    hf = layer_namer(["model.layers.7.self_attn.q_proj", "model.embed_tokens", "lm_head", ""])
    assert hf("model.layers.7.self_attn.q_proj") == "model.layers.7"
    assert hf("model.embed_tokens") == "model.embed_tokens"
    assert hf("model.norm") == "model.norm"
    assert hf("lm_head") == "lm_head"
    assert hf("") == "<root>" and hf("<loss>") == "<loss>"
    gpt2 = layer_namer(["transformer.h.3.attn.c_attn", "transformer.wte"])
    assert gpt2("transformer.h.11.mlp") == "transformer.h.11"
    assert gpt2("transformer.ln_f") == "transformer.ln_f"
    assert layer_namer(["encoder.fc"])("encoder.fc") == "encoder"


def test_specs_are_written_and_read_in_one_token_per_axis() -> None:
    spec = (Shard(0), Replicate())
    assert compact_spec(spec) == "S(0)R"
    assert parse_spec("S(0)R", 2) == parse_spec("(S(0), R)", 2) == spec
    with pytest.raises(PlanFileError, match="2 axes"):
        parse_spec("S(0)", 2, "placement of 'x'")
    with pytest.raises(PlanFileError, match="cannot read spec"):
        parse_spec("Shard(0)", 1)


def test_saved_plan_loads_identical_and_trains_like_one_device(
    ilp_plan: tuple[GPT, Plan, torch.Tensor], tmp_path: Path
) -> None:
    model, plan, tokens = ilp_plan
    path = plan.save(tmp_path / "plan.json")
    loaded = load_plan(path, captured()[1])
    assert strategies(loaded) == strategies(plan)
    assert loaded.solution.objective == pytest.approx(plan.solution.objective, rel=1e-9)
    assert loaded.cluster == plan.cluster
    flat = loaded.program.flat_inputs(model, tokens, tokens)
    assert_equivalent(fxpar.lower(loaded), flat)


def test_edited_parameter_placement_is_respected(
    ilp_plan: tuple[GPT, Plan, torch.Tensor], tmp_path: Path
) -> None:
    model, plan, tokens = ilp_plan
    document = plan.to_dict()
    name = "blocks.1.mlp.fc.weight"
    edited = "RS(1)" if document["placements"][name] != "RS(1)" else "S(1)R"
    document["placements"][name] = edited
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(document))
    loaded = load_plan(path, captured()[1])
    weight = loaded.program.placeholders()[name]
    assert compact_spec(ir.require(weight, Sharding).strategy.outputs[0]) == edited
    # Its readers keep their strategies: the weight is resharded for them (and its gradient
    # back into the edited placement), which the loaded plan's score includes.
    others = {k: v for k, v in strategies(loaded).items() if k != weight.name}
    assert others == {k: v for k, v in strategies(plan).items() if k != weight.name}
    spmd = fxpar.lower(loaded)
    assert any(r.tensor == weight.name for r in spmd.collectives())
    assert loaded.solution.objective >= plan.solution.objective * (1 - 1e-9)  # ILP: optimal
    assert_equivalent(spmd, loaded.program.flat_inputs(model, tokens, tokens))


def _write(tmp_path: Path, document: dict[str, Any]) -> Path:
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(document))
    return path


def test_bad_plan_files_fail_naming_what_to_fix(
    ilp_plan: tuple[GPT, Plan, torch.Tensor], tmp_path: Path
) -> None:
    _, plan, _ = ilp_plan
    program = captured()[1]
    document = plan.to_dict()
    node = next(n for n in plan.program.graph.nodes if n.target is torch.ops.aten.addmm.default)

    with pytest.raises(PlanFileError, match="version 99"):
        load_plan(_write(tmp_path, {**document, "version": 99}), program)
    with pytest.raises(PlanFileError, match=r"mesh of shape \(2, 2\).*mesh \(4,\)"):
        load_plan(_write(tmp_path, document), program, Cluster((4,)))
    unknown = {**document, "strategies": {**document["strategies"], "no_such_node": {}}}
    with pytest.raises(PlanFileError, match="'no_such_node'"):
        load_plan(_write(tmp_path, unknown), program)
    entry = document["strategies"][node.name]
    wrong = {**entry, "outputs": ["PP"], "inputs": ["PP"] * len(entry["inputs"])}
    not_candidate = {**document, "strategies": {**document["strategies"], node.name: wrong}}
    with pytest.raises(PlanFileError, match=rf"node '{node.name}'.*not one of its"):
        load_plan(_write(tmp_path, not_candidate), program)
    missing = {k: v for k, v in document["strategies"].items() if k != node.name}
    with pytest.raises(PlanFileError, match=rf"no strategy for node '{node.name}'"):
        load_plan(_write(tmp_path, {**document, "strategies": missing}), program)
    uneven = {**document, "placements": {**document["placements"], "wpe.weight": "S(1)S(0)S(0)"}}
    with pytest.raises(PlanFileError, match=r"placement of 'wpe\.weight'"):
        load_plan(_write(tmp_path, uneven), program)
    uneven["placements"]["wpe.weight"] = "S(5)R"
    with pytest.raises(PlanFileError, match=r"placement of 'wpe\.weight'.*valid placements"):
        load_plan(_write(tmp_path, uneven), program)
    with pytest.raises(PlanFileError, match="not an fxpar plan file"):
        load_plan(_write(tmp_path, {"strategies": {}}), program)


def test_plot_writes_a_png(dp_plan: Plan, tmp_path: Path) -> None:
    path = dp_plan.plot(tmp_path / "plan.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000


def test_plot_without_matplotlib_says_how_to_install(
    dp_plan: Plan, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    with pytest.raises(FxparError, match=re.escape('pip install "fxpar[plot]"')):
        dp_plan.plot(tmp_path / "plan.png")


def test_plan_report_guide_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # tests/test_docs.py runs the other guides; this one runs here, the same way.
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {}
    text = (ROOT / "docs" / "plan_report.md").read_text()
    for block in re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL):
        exec(block, namespace)
    assert (tmp_path / "plan.png").read_bytes()[:4] == b"\x89PNG"
    assert isinstance(namespace["edited"], Plan)
