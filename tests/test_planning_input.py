"""Planning never edits its input: the pass list runs on its own copy of the Program, so a
capture planned (by the solver, a manual plan, with pins, stamped and solved folded, for the
stage DP) is left exactly as it was, and one capture planned for two meshes gets the plans two
fresh captures would."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import fxpar
from fxpar import ir, plans
from fxpar.cluster import Cluster
from fxpar.ir.program import Program
from fxpar.ir.repeat import StampedLayers, capture_repeated
from fxpar.models import GPT, GPTConfig, gpt_loss
from fxpar.passes import default_passes, plan_program, prepare_for_planning
from fxpar.planning.plan import Plan
from fxpar.planning.problem import PlanOptions
from fxpar.sharding import Sharding

CONFIG = GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=16)


def _tokens() -> torch.Tensor:
    return torch.randint(0, CONFIG.vocab_size, (4, 16), generator=torch.Generator().manual_seed(1))


def _captured() -> Program:
    torch.manual_seed(0)
    tokens = _tokens()
    return fxpar.capture(GPT(CONFIG), (tokens,), gpt_loss, example_targets=(tokens,))


def _stamped() -> Program:
    torch.manual_seed(0)
    config = GPTConfig(n_layer=8, n_embd=32, n_head=4, vocab_size=64, block_size=16)
    tokens = _tokens()
    program = capture_repeated(GPT(config), (tokens,), gpt_loss, example_targets=(tokens,))
    assert program.get(StampedLayers) is not None
    return program


def _snapshot(program: Program) -> dict[str, Any]:
    """Everything planning could change: the graph's code, each node's meta (every key and
    the object under it, annotations one by one), the program-level annotations and the
    cluster, by identity where equality could hide an edit."""
    return {
        "code": program.code(),
        "graph": str(program.graph),
        "meta": [
            (
                node.name,
                {key: id(value) for key, value in node.meta.items() if key != ir.META_KEY},
                {kind: id(value) for kind, value in ir.all_annotations(node).items()},
            )
            for node in program.graph.nodes
        ],
        "annotations": {kind: id(value) for kind, value in program.annotations().items()},
        "cluster": program.cluster,
    }


def _specs(plan: Plan) -> dict[str, object]:
    placeholders = plan.program.placeholders()
    return {
        name: ir.require(node, Sharding).strategy.outputs[0] for name, node in placeholders.items()
    }


PLANNERS: dict[str, Callable[[Program, Cluster], object]] = {
    "default passes": plan_program,
    "manual plan": lambda program, cluster: plan_program(
        program, cluster, manual=plans.tensor_parallel
    ),
    "pinned plan": lambda program, cluster: plan_program(
        program, cluster, pins={"blocks.*.mlp.fc.weight": (Shard(1),), "input_0": (Replicate(),)}
    ),
    "remat auto": lambda program, cluster: plan_program(
        program, cluster, options=PlanOptions(remat="auto")
    ),
    "prepare for planning": prepare_for_planning,
    "stage DP": lambda program, cluster: fxpar.pipeline.plan_stages(
        program, cluster, fxpar.Pipeline(stages=2, microbatches=2), stage_planner=plan_program
    ),
}


@pytest.mark.parametrize("planner", list(PLANNERS))
@pytest.mark.parametrize("make", [_captured, _stamped], ids=["captured", "stamped"])
def test_planning_leaves_its_input_as_it_was(planner: str, make: Callable[[], Program]) -> None:
    """Graph, node meta, program-level annotations and cluster are the same objects after
    planning as before, whichever way the plan is made (a stamped step's solver plan is made
    by SolveFolded, on the folded twin)."""
    program = make()
    before = _snapshot(program)
    PLANNERS[planner](program, Cluster((2,)))
    assert _snapshot(program) == before


def test_a_planned_program_is_left_as_it_was_when_planned_again() -> None:
    """A Program a pass list already ran on (annotated, with a cluster) keeps its annotations
    and its cluster when it is planned for another mesh."""
    planned = plan_program(_captured(), Cluster((2,))).program
    before = _snapshot(planned)
    again = plan_program(planned, Cluster((2, 2)))
    assert _snapshot(planned) == before
    assert planned.cluster == Cluster((2,)) and again.program.cluster == Cluster((2, 2))


def test_pass_manager_runs_on_a_copy_with_the_cluster_given() -> None:
    """``PassManager.run(program, cluster=...)`` returns a new Program for that cluster; the
    input's cluster stays None."""
    program = _captured()
    result = default_passes().through("annotate-strategies").run(program, cluster=Cluster((2,)))
    assert result is not program and result.graph is not program.graph
    assert result.cluster == Cluster((2,)) and program.cluster is None


@pytest.mark.parametrize("make", [_captured, _stamped], ids=["captured", "stamped"])
def test_one_capture_planned_for_two_meshes_plans_like_two_captures(
    make: Callable[[], Program],
) -> None:
    """Planning one capture on (2,) and then on (2, 2) gives the plans that two fresh
    captures give, and the first plan is not overwritten by the second."""
    shared = make()
    first, second = (plan_program(shared, Cluster(mesh)) for mesh in ((2,), (2, 2)))
    fresh_first, fresh_second = (plan_program(make(), Cluster(mesh)) for mesh in ((2,), (2, 2)))
    for plan, fresh in ((first, fresh_first), (second, fresh_second)):
        assert _specs(plan) == _specs(fresh)
        assert plan.solution.choice == fresh.solution.choice
        assert plan.estimate == pytest.approx(fresh.estimate)
    assert first.program is not second.program
    assert first.program.cluster == Cluster((2,))
