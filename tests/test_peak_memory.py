"""The peak memory of a planned step (fxpar.planning.peak_memory) against the real tensors of its
lowered per-rank programs (fxpar.testing.memory), for every plan kind on 1-D and 2-D meshes; the
measurement's own rules (inputs held throughout, a rank's pieces its own, collectives in flight
counted); and the lowering keeping an op's tuple elements beside it, so that a BatchNorm's
output is not held until a later all-reduce starts."""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from zoo import CNN, MLP

import fxpar
from fxpar import ir, plans
from fxpar.lowering import collective_calls
from fxpar.models import GPT, GPTConfig, gpt_loss
from fxpar.passes import ChosenStrategies, choose_strategies, plan_program
from fxpar.planning.collective_schedule import schedule_program
from fxpar.planning.cost import local_bytes
from fxpar.planning.peak_memory import peak_memory
from fxpar.planning.problem import PlanOptions
from fxpar.planning.report import report_data
from fxpar.solvers.errors import InfeasiblePlanError
from fxpar.testing.memory import peak_live_bytes, rank_peaks, storage_bytes

GPT_CONFIG = GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=16, bias=False)


def _gpt() -> tuple[torch.nn.Module, tuple[Any, ...], Any, tuple[Any, ...]]:
    tokens = torch.randint(0, 64, (8, 16))
    return GPT(GPT_CONFIG), (tokens,), gpt_loss, (tokens,)


def _cnn() -> tuple[torch.nn.Module, tuple[Any, ...], Any, tuple[Any, ...]]:
    return CNN(), (torch.randn(8, 3, 16, 16),), F.cross_entropy, (torch.randint(0, 10, (8,)),)


def _mlp() -> tuple[torch.nn.Module, tuple[Any, ...], Any, tuple[Any, ...]]:
    sizes = (64, 256, 256, 16)
    return MLP(sizes), (torch.randn(32, 64),), F.cross_entropy, (torch.randint(0, 16, (32,)),)


MODELS: dict[str, Callable[[], tuple[torch.nn.Module, tuple[Any, ...], Any, tuple[Any, ...]]]] = {
    "gpt": _gpt,
    "cnn": _cnn,
    "mlp": _mlp,
}
PLANS: dict[str, Any] = {
    "replicated": plans.replicated,
    "data": plans.data_parallel,
    "tensor": plans.tensor_parallel,
    "sharded": plans.fully_sharded,
    "ilp": None,
}


@dataclass(frozen=True)
class _Peaks:
    estimated: int
    measured: int
    proxy: float
    """The ILP's memory row: a sum over nodes, not a moment of the step."""


def _peaks(model_name: str, mesh: tuple[int, ...], plan_name: str) -> _Peaks:
    torch.manual_seed(0)
    model, inputs, loss_fn, targets = MODELS[model_name]()
    program = fxpar.capture(model, inputs, loss_fn, example_targets=targets)
    cluster = fxpar.Cluster(mesh)
    plan = plan_program(
        program, cluster, manual=PLANS[plan_name], options=PlanOptions(optimizer_states=0)
    )
    measured = rank_peaks(fxpar.lower(plan), plan.program.flat_inputs(model, *inputs, *targets))
    chosen = plan.program.require(ChosenStrategies)
    return _Peaks(
        peak_memory(plan.program, cluster).peak_bytes,
        max(peak.peak_bytes for peak in measured.values()),
        chosen.problem.memory(chosen.solution.choice),
    )


@pytest.mark.parametrize("mesh", [(2,), (2, 2)], ids=["2", "2x2"])
@pytest.mark.parametrize("plan_name", list(PLANS))
@pytest.mark.parametrize("model_name", list(MODELS))
def test_the_estimated_peak_is_the_measured_one(
    model_name: str, plan_name: str, mesh: tuple[int, ...]
) -> None:
    if plan_name == "tensor" and model_name != "gpt":
        pytest.skip("tensor_parallel's default module names are a transformer's")
    peaks = _peaks(model_name, mesh, plan_name)
    assert peaks.estimated == pytest.approx(peaks.measured, rel=0.05)


def test_the_estimate_corrects_the_solver_memory_row_where_it_was_wrong() -> None:
    """The ILP's row holds every gradient with every saved activation (too much for data
    parallelism) and misses the weights a fully sharded layer gathers (too little); the walk
    of the schedule gets both."""
    data = _peaks("gpt", (4,), "data")
    sharded = _peaks("gpt", (4,), "sharded")
    assert data.proxy > 1.1 * data.measured
    assert sharded.proxy < 0.9 * sharded.measured
    for peaks in (data, sharded):
        assert peaks.estimated == pytest.approx(peaks.measured, rel=0.05)


def test_the_peak_names_its_place_and_largest_buffers() -> None:
    torch.manual_seed(0)
    model, inputs, loss_fn, targets = _gpt()
    program = fxpar.capture(model, inputs, loss_fn, example_targets=targets)
    cluster = fxpar.Cluster((2,))
    plan = plan_program(program, cluster, manual=plans.fully_sharded)
    peak = peak_memory(plan.program, cluster)
    names = {node.name for node in plan.program.graph.nodes}
    collectives = ("start ", "wait for ", "bucket after ", "<return>")
    assert peak.peak_node in names or peak.peak_node.startswith(collectives)
    sizes = [nbytes for _, nbytes in peak.largest]
    assert sizes == sorted(sizes, reverse=True) and len(sizes) == 5
    assert peak.input_bytes < peak.peak_bytes
    assert sum(sizes) <= peak.activation_bytes


def test_peak_live_bytes_counts_inputs_after_their_last_read() -> None:
    """The caller holds the inputs for the whole step: a value made after the program last
    reads an input sits beside it."""

    def step(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        return torch.ones(1024) + y.sum()

    module = fx.symbolic_trace(step)
    x = torch.zeros(1024)
    peak = peak_live_bytes(module, [x])
    assert peak.input_bytes == 4096
    # At the add: x (read last by the product), the ones it reads, y's sum and the result.
    assert peak.peak_bytes == 3 * 4096 + 4
    assert peak.peak_node == "add"


def test_storage_bytes_looks_inside_a_collective_in_flight() -> None:
    flat = torch.zeros(256)
    bucket = collective_calls.Bucket(collective_calls.Done(), flat, lambda t: (t,))
    assert storage_bytes([bucket]) == 1024
    assert storage_bytes([(bucket, flat[:8])]) == 1024  # one storage, counted once


def test_rank_peaks_count_a_rank_piece_not_the_whole_tensor() -> None:
    torch.manual_seed(0)
    model, inputs, loss_fn, targets = _mlp()
    program = fxpar.capture(model, inputs, loss_fn, example_targets=targets)
    plan = plan_program(program, fxpar.Cluster((4,)), manual=plans.fully_sharded)
    flat = plan.program.flat_inputs(model, *inputs, *targets)
    peaks = rank_peaks(fxpar.lower(plan), flat)
    whole = sum(t.nbytes for t in flat)
    assert all(peak.input_bytes < whole / 2 for peak in peaks.values())


def _getitems_apart(module: fx.GraphModule) -> list[str]:
    """getitems separated from their op by anything but other getitems of it."""
    apart = []
    for node in module.graph.nodes:
        if node.target is not operator.getitem:
            continue
        between = node.prev
        while between is not node.args[0]:
            if between.target is not operator.getitem or between.args[0] is not node.args[0]:
                apart.append(node.name)
                break
            between = between.prev
    return apart


def test_an_op_and_its_tuple_elements_stay_together_around_early_all_reduces() -> None:
    """Data parallelism sums a BatchNorm's statistics with an all-reduce started early, and the
    lowering moves ops the sum does not need after its start. Moving the elements of the
    BatchNorm's tuple alone held its whole output (the normalized batch) until then."""
    torch.manual_seed(0)
    model, inputs, loss_fn, targets = _cnn()
    program = fxpar.capture(model, inputs, loss_fn, example_targets=targets)
    plan = plan_program(program, fxpar.Cluster((2,)), manual=plans.data_parallel)
    spmd = fxpar.lower(plan)
    for rank in spmd.ranks:
        module = rank.graph_module
        starts = module.graph.find_nodes(
            op="call_function", target=collective_calls.start_all_reduce
        )
        assert starts, "the case needs an early all-reduce"
        assert _getitems_apart(module) == []


STATES = 0
"""Plans for plain SGD: no optimizer state beside the parameters (the walked peak adds
``optimizer_states`` copies of each trainable piece to the inputs when it checks a limit)."""


def _captured(model_name: str) -> tuple[fxpar.Program, fxpar.Cluster]:
    torch.manual_seed(0)
    model, inputs, loss_fn, targets = MODELS[model_name]()
    return fxpar.capture(model, inputs, loss_fn, example_targets=targets), fxpar.Cluster((4,))


def _planned(
    program: fxpar.Program, cluster: fxpar.Cluster, limit: float | None, monkeypatch: Any = None
) -> fxpar.Plan:
    """The ILP's plan under ``limit``; with ``monkeypatch``, bounded by the memory row alone."""
    options = PlanOptions(optimizer_states=STATES, memory_limit=limit)
    if monkeypatch is None:
        return plan_program(program.copy(), cluster, options=options)
    with monkeypatch.context() as patch:
        patch.setattr(choose_strategies, "ROW_SHARE", math.inf)
        return plan_program(program.copy(), cluster, options=options)


def _peak(plan: fxpar.Plan) -> int:
    return peak_memory(plan.program, plan.cluster, optimizer_states=STATES).peak_bytes


def test_a_plan_the_memory_row_refuses_is_chosen_where_its_peak_fits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The GPT's fastest plan on 4 devices (data parallel) has a row above its peak (every
    gradient beside every saved activation). Under a limit a tenth above its peak the row
    alone refuses it and settles for a slower plan; the walked peak takes it."""
    program, cluster = _captured("gpt")
    free = _planned(program, cluster, None)
    limit = 1.1 * _peak(free)
    chosen = free.program.require(ChosenStrategies)
    assert chosen.problem.memory(chosen.solution.choice) > limit
    row_only = _planned(program, cluster, limit, monkeypatch)
    bounded = _planned(program, cluster, limit)
    assert bounded.solution.objective == pytest.approx(free.solution.objective)
    assert row_only.solution.objective > 1.2 * bounded.solution.objective
    assert _peak(bounded) <= limit


def test_a_plan_whose_row_fits_but_whose_peak_does_not_is_never_chosen(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the plan the row allows holds more than the limit at its peak, the planner
    solves again or says no plan fits, naming the peak: never a plan that would not fit."""
    program, cluster = _captured("gpt")
    free = _peak(_planned(program, cluster, None))
    overshot = 0
    for share in (1.0, 0.9, 0.8, 0.75):
        limit = share * free
        overshot += _peak(_planned(program, cluster, limit, monkeypatch)) > limit
        try:
            plan = _planned(program, cluster, limit)
        except InfeasiblePlanError as error:
            assert "keeps its peak under the memory limit" in str(error)
            assert error.least_memory > limit
            continue
        assert _peak(plan) <= limit
    assert overshot, "no limit tested where the row alone chooses a plan that does not fit"


def test_the_plan_report_gives_the_walked_peak_with_the_optimizer_state() -> None:
    program, cluster = _captured("gpt")
    plan = plan_program(program, cluster, manual=plans.fully_sharded)
    header = report_data(plan)["header"]
    states = plan.options.optimizer_states
    assert states == 2  # AdamW's moments, by default
    walked = peak_memory(plan.program, cluster, optimizer_states=states)
    assert header["peak_bytes"] == walked.peak_bytes
    specs = schedule_program(plan.program, cluster.mesh_shape).specs
    placeholders = plan.program.placeholders()
    trainable = sum(
        local_bytes(ir.require(node, ir.ValueMeta).tensor, specs[node][0], cluster)  # type: ignore[arg-type]
        for name, node in placeholders.items()
        if name in plan.program.signature.gradients
    )
    without = peak_memory(plan.program, cluster)
    assert walked.peak_bytes - without.peak_bytes == states * trainable
    text = plan.report()
    assert f"peak            {walked.peak_bytes / 2**10:.1f} KiB per device at once" in text
    assert "largest besides: " in text
