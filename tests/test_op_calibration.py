"""Per-op speeds: a cluster prices each ATen op as its overhead plus its slowdown times its
roofline, calibration times a program's real op calls and fits those numbers so that they give
back what was measured, and the numbers travel in cluster files."""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
import types
from pathlib import Path

import pytest
import torch

import fxpar
from fxpar import ir
from fxpar.errors import BatchError, DistributedError, FxparError
from fxpar.models import GPT, GPTConfig, gpt_loss
from fxpar.pipeline import Pipeline, microbatch_step
from fxpar.planning.cost import compute_seconds, roofline_seconds
from fxpar.runtime import calibration as calibration_module
from fxpar.runtime import op_timing
from fxpar.runtime.calibration import CalibrationOptions, measure, shared_op_times
from fxpar.runtime.launch import spawn
from fxpar.runtime.op_fit import MIN_SLOWDOWN, fit_ops
from fxpar.runtime.op_timing import OpTiming, time_ops
from fxpar.sharding import R, S, Strategy

CLUSTER = fxpar.Cluster((2,), flops=1e9, memory_bandwidth=1e9)


def _cost(flops: int, moved: int, op: str) -> ir.Cost:
    return ir.Cost(flops=flops, bytes_read=moved, bytes_written=0, output_bytes=0, op=op)


def test_an_op_costs_its_overhead_plus_its_slowdown_times_its_share_of_the_roofline() -> None:
    cluster = dataclasses.replace(CLUSTER, op_overhead=5e-6, op_slowdown={"aten.mm": 2.0, "*": 3.0})
    matmul = _cost(4_000_000, 1_000, "aten.mm")  # 4 ms of FLOPs, compute-bound
    assert roofline_seconds(matmul, cluster) == pytest.approx(5e-6 + 2 * 4e-3)
    assert roofline_seconds(matmul, cluster, share=2) == pytest.approx(5e-6 + 2 * 2e-3)
    gelu = _cost(1_000, 2_000_000, "aten.gelu")  # 2 ms of bytes, memory-bound; not named
    assert roofline_seconds(gelu, cluster) == pytest.approx(5e-6 + 3 * 2e-3)
    view = _cost(0, 0, "aten.view")
    assert roofline_seconds(view, cluster) == pytest.approx(5e-6)
    placeholder = _cost(0, 0, "")  # calls no op: no overhead
    assert roofline_seconds(placeholder, cluster) == 0.0
    # A strategy that splits the op over the axis halves the slowed roofline, not the overhead.
    split = Strategy(outputs=((S(0),),), inputs=((S(0),), (R,)))
    assert compute_seconds(matmul, split, cluster) == pytest.approx(5e-6 + 2 * 2e-3)
    # Without per-op numbers an op costs its roofline.
    assert roofline_seconds(matmul, CLUSTER) == pytest.approx(4e-3)


def test_fit_ops_recovers_the_overhead_and_slowdowns_that_made_the_times() -> None:
    overhead, slowdown = 4e-6, {"aten.mm": 1.25, "aten._log_softmax": 3.0}
    truth = dataclasses.replace(CLUSTER, op_overhead=overhead, op_slowdown=slowdown)
    costs = [
        _cost(2_000_000, 10, "aten.mm"),
        _cost(8_000_000, 10, "aten.mm"),
        _cost(10, 500_000, "aten._log_softmax"),
        *(_cost(0, 0, "aten.view") for _ in range(4)),
        _cost(0, 0, "aten.t"),
    ]
    timings = [OpTiming(f"n{i}", c, roofline_seconds(c, truth)) for i, c in enumerate(costs)]
    fitted = fit_ops(CLUSTER, timings)
    assert fitted.op_overhead == pytest.approx(overhead)
    found = dict(fitted.op_slowdown)
    assert found["aten.mm"] == pytest.approx(1.25)
    assert found["aten._log_softmax"] == pytest.approx(3.0)
    # '*' is every op's time beyond the overhead over every op's roofline.
    roofline = 2e-3 + 8e-3 + 0.5e-3
    assert found["*"] == pytest.approx((1.25 * 10e-3 + 3.0 * 0.5e-3) / roofline)
    # The fitted cluster gives back every measured time.
    for timing in timings:
        assert roofline_seconds(timing.cost, fitted) == pytest.approx(timing.seconds)
    # The links and rooflines are the given cluster's.
    assert dataclasses.replace(fitted, op_overhead=0.0, op_slowdown=()) == CLUSTER


def test_an_ops_fixed_cost_is_paid_by_every_call_that_works_whatever_its_share() -> None:
    cluster = dataclasses.replace(
        CLUSTER, op_overhead=5e-6, op_slowdown={"*": 2.0}, op_fixed={"aten.mm": 40e-6, "*": 1e-5}
    )
    matmul = _cost(4_000_000, 1_000, "aten.mm")
    assert roofline_seconds(matmul, cluster) == pytest.approx(5e-6 + 40e-6 + 2 * 4e-3)
    # Split over the axis: half the rate's part, the whole fixed cost.
    split = Strategy(outputs=((S(0),),), inputs=((S(0),), (R,)))
    assert compute_seconds(matmul, split, cluster) == pytest.approx(5e-6 + 40e-6 + 2 * 2e-3)
    gelu = _cost(1_000, 2_000_000, "aten.gelu")  # not named: '*''s fixed cost
    assert roofline_seconds(gelu, cluster) == pytest.approx(5e-6 + 1e-5 + 2 * 2e-3)
    # A call that does no work pays only the overhead.
    assert roofline_seconds(_cost(0, 0, "aten.view"), cluster) == pytest.approx(5e-6)


def _step(scale: float, truth: fxpar.Cluster) -> list[OpTiming]:
    """A step's calls at ``scale`` of the batch (weights' calls do not scale), timed as
    ``truth`` prices them."""
    costs = [
        _cost(int(400_000 * scale), 10, "aten.mm"),
        _cost(int(100_000 * scale), 10, "aten.mm"),
        _cost(50_000, 10, "aten.mm"),  # a weight's: the same at every batch
        _cost(10, int(400_000 * scale), "aten.gelu"),
        _cost(10, int(600_000 * scale), "aten.gelu"),
        *(_cost(0, 0, "aten.view") for _ in range(4)),
    ]
    return [OpTiming(f"n{i}", c, roofline_seconds(c, truth)) for i, c in enumerate(costs)]


def test_fit_ops_on_two_batch_sizes_recovers_each_ops_fixed_cost_and_rate() -> None:
    """One batch size cannot tell a call's fixed cost from its rate: the rate takes it, and a
    quarter of the batch is then priced too cheap. The same step at two sizes fits both, and
    the fitted cluster gives back each op's time at both sizes and at a third."""
    truth = dataclasses.replace(
        CLUSTER,
        op_overhead=4e-6,
        op_slowdown={"aten.mm": 1.5, "aten.gelu": 3.0},
        op_fixed={"aten.mm": 50e-6, "aten.gelu": 20e-6},
    )
    whole, quarter, eighth = _step(1.0, truth), _step(0.25, truth), _step(0.125, truth)
    alone = fit_ops(CLUSTER, whole)
    assert alone.op_fixed == ()
    assert dict(alone.op_slowdown)["aten.mm"] > 1.5  # the fixed cost taken into the rate
    fitted = fit_ops(CLUSTER, whole, quarter)
    assert fitted.op_overhead == pytest.approx(4e-6)
    fixed, slowdown = dict(fitted.op_fixed), dict(fitted.op_slowdown)
    assert fixed["aten.mm"] == pytest.approx(50e-6) and slowdown["aten.mm"] == pytest.approx(1.5)
    assert fixed["aten.gelu"] == pytest.approx(20e-6)
    assert slowdown["aten.gelu"] == pytest.approx(3.0)
    assert fixed["*"] > 0
    for step in (whole, quarter, eighth):
        for op in ("aten.mm", "aten.gelu"):
            calls = [t for t in step if t.cost.op == op]
            measured = sum(t.seconds for t in calls)
            assert sum(roofline_seconds(t.cost, fitted) for t in calls) == pytest.approx(measured)
    # The rate fitted on one size prices the eighth's products of the batch at 60% of what
    # they took.
    products = eighth[:2]
    guessed = sum(roofline_seconds(t.cost, alone) for t in products)
    assert guessed < 0.7 * sum(t.seconds for t in products)


def test_a_line_that_would_need_a_negative_fixed_cost_keeps_the_rate_alone() -> None:
    """Calls that got relatively faster at the smaller size (noise, a cache) would fit a
    negative fixed cost: the op gets none, and one rate over both steps."""
    whole = [OpTiming("m", _cost(8_000_000, 10, "aten.mm"), 16e-3)]  # 2x its roofline
    small = [OpTiming("m", _cost(1_000_000, 10, "aten.mm"), 1e-3)]  # 1x
    fitted = fit_ops(CLUSTER, whole, small)
    assert "aten.mm" not in dict(fitted.op_fixed)
    assert dict(fitted.op_slowdown)["aten.mm"] == pytest.approx(17e-3 / 9e-3)


def test_calls_whose_roofline_is_a_sliver_of_the_overhead_fit_no_rate() -> None:
    """A one-element ``ones_like`` taking 60 us would fit a slowdown of 10^5: it is left out,
    and the op takes ``"*"``'s slowdown."""
    views = [OpTiming(f"v{i}", _cost(0, 0, "aten.view"), 5e-6) for i in range(4)]
    product = OpTiming("m", _cost(2_000_000, 10, "aten.mm"), 3e-3)  # 2 ms roofline
    tiny = OpTiming("o", _cost(1, 4, "aten.ones_like"), 60e-6)  # 4 ns roofline
    fitted = dict(fit_ops(CLUSTER, [*views, product, tiny]).op_slowdown)
    assert "aten.ones_like" not in fitted
    assert fitted["*"] == fitted["aten.mm"] == pytest.approx((3e-3 - 5e-6) / 2e-3)


def test_an_op_faster_than_its_overhead_gets_the_least_slowdown() -> None:
    timings = [
        OpTiming("v", _cost(0, 0, "aten.view"), 5e-6),
        OpTiming("u", _cost(0, 1_000_000, "aten._unsafe_view"), 3e-6),  # a view in practice
    ]
    assert dict(fit_ops(CLUSTER, timings).op_slowdown)["aten._unsafe_view"] == MIN_SLOWDOWN


def _gpt(batch: int = 2) -> tuple[fxpar.Program, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))
    tokens = torch.randint(0, 64, (batch, 16))
    program = fxpar.capture(model, (tokens,), gpt_loss, example_targets=(tokens,))
    return program, program.flat_inputs(model, tokens, tokens)


def test_time_ops_times_every_aten_call_in_place_and_the_times_add_up_to_a_step() -> None:
    program, inputs = _gpt()
    timings = time_ops(program, inputs, passes=3)
    calls = [
        node
        for node in program.graph.nodes
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
    ]
    assert [t.node for t in timings] == [node.name for node in calls]
    assert all(t.seconds > 0 and t.cost.op for t in timings)
    assert {"aten.mm", "aten.view", "aten._log_softmax"} <= {t.cost.op for t in timings}
    # A product typically takes longer than a view.
    seconds = {t.node: t.seconds for t in timings}
    products = [seconds[n.name] for n in calls if str(n.target.overloadpacket) == "aten.mm"]
    views = [seconds[n.name] for n in calls if str(n.target.overloadpacket) == "aten.view"]
    assert statistics.median(products) > statistics.median(views)
    # The clock readings cover the whole step: the calls' times add up to about a step's,
    # against the fastest of a few steps: on a busy machine a step may wait scheduler slices
    # (milliseconds) that the calls' medians leave out (one mean of three steps was 3.5x
    # their sum).
    with torch.no_grad():
        program.graph_module(*inputs)
        steps = []
        for _ in range(7):
            start = time.perf_counter()
            program.graph_module(*inputs)
            steps.append(time.perf_counter() - start)
    assert 0.3 * min(steps) < sum(seconds.values()) < 3 * min(steps)


def test_time_ops_scales_the_calls_medians_up_to_the_median_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a clock where every call takes 1 ms and a 5 ms scheduler slice lands on one call in
    two of three passes (as where ranks outnumber cores), each call's median is 1 ms but the
    median pass takes 5 ms more than their sum: the calls are scaled up to the pass."""
    program, inputs = _gpt()
    calls = sum(
        node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
        for node in program.graph.nodes
    )
    clock = {"now": 0.0, "reads": 0}

    def perf_counter() -> float:
        run, index = divmod(clock["reads"], calls + 1)  # a pass: its start, then each call
        clock["reads"] += 1
        stall = 5e-3 if (run, index) in {(1, 3), (2, 7)} else 0.0
        clock["now"] += (1e-3 if index else 0.0) + stall
        return clock["now"]

    monkeypatch.setattr(op_timing, "time", types.SimpleNamespace(perf_counter=perf_counter))
    timings = time_ops(program, inputs, passes=3)
    assert sum(t.seconds for t in timings) == pytest.approx(calls * 1e-3 + 5e-3)
    assert {round(t.seconds, 12) for t in timings} == {round((calls * 1e-3 + 5e-3) / calls, 12)}


class _Scaled(torch.nn.Module):
    """A model whose step holds a tensor constant (an attribute of the captured program)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * torch.tensor([2.0])


def test_time_ops_runs_programs_that_hold_constants() -> None:
    model, batch = _Scaled(), torch.randn(4, 8)
    program = fxpar.capture(model, (batch,), lambda out: out.sum())
    assert any(node.op == "get_attr" for node in program.graph.nodes)
    timings = time_ops(program, program.flat_inputs(model, batch), passes=1)
    assert "aten.mul" in {t.cost.op for t in timings}


def _calibrate_ops_rank(rank: int, world_size: int) -> tuple[object, ...]:
    torch.set_num_threads(1)
    program, inputs = _gpt()
    # The default repeats, as tests/test_calibrate.py: a link fitted from 3 is at the mercy of
    # a loaded machine.
    options = CalibrationOptions(op_passes=2)
    calibration = measure(fxpar.Cluster((world_size,)), options=options, program=program,
                          inputs=inputs)  # fmt: skip
    refused = ""
    try:
        # Another rank's program has fewer ops: refused on every rank, no hang.
        fxpar.calibrate_ops(calibration.cluster, *(_gpt() if rank == 0 else _short()), options)
    except DistributedError as error:
        refused = str(error)
    # The step at half the batch too: both steps' timings reach the fit (each op's fixed cost
    # apart from its rate; what the fit makes of them is the unit tests' above).
    fitted: list[tuple[OpTiming, ...]] = []

    def recorded(cluster: fxpar.Cluster, *steps: tuple[OpTiming, ...]) -> fxpar.Cluster:
        fitted.extend(steps)
        return fit_ops(cluster, *steps)

    original = calibration_module.fit_ops
    calibration_module.fit_ops = recorded
    try:
        half = _gpt(1)
        two_sizes = fxpar.calibrate_ops(calibration.cluster, program, inputs, options,
                                        microbatch=half)  # fmt: skip
    finally:
        calibration_module.fit_ops = original
    calls = [len(time_ops(p, i, passes=1)) for p, i in ((program, inputs), half)]
    two_sizes = (two_sizes, tuple(fitted), calls)
    # Rank 1 took twice as long as rank 0 for the first op and three times for the second:
    # each op takes the ranks' mean, scaled up to the slowest rank's step.
    cost = _cost(1, 1, "aten.mm")
    mine = [OpTiming("a", cost, (rank + 1) * 1e-3), OpTiming("b", cost, (2 * rank + 1) * 1e-3)]
    shared = [t.seconds for t in shared_op_times(mine)]
    return calibration, refused, shared, two_sizes


def _short() -> tuple[fxpar.Program, list[torch.Tensor]]:
    model = torch.nn.Linear(4, 4)
    batch = torch.randn(2, 4)
    program = fxpar.capture(model, (batch,), lambda out: out.sum())
    return program, program.flat_inputs(model, batch)


@pytest.mark.slow
def test_calibrated_op_speeds_are_shared_and_give_back_each_ops_measured_time() -> None:
    (first, refused, shared, two_sizes), (second, _, shared_too, two_sizes_too) = spawn(
        _calibrate_ops_rank, 2, timeout_s=120
    )
    # Means 1.5 and 2 ms (3.5 ms in all), scaled to the slower rank's 5 ms.
    assert shared == shared_too == pytest.approx([1.5e-3 * 5 / 3.5, 2e-3 * 5 / 3.5])
    assert first.cluster == second.cluster
    assert first.ops == second.ops  # the ranks' mean time of each call, scaled alike
    assert {t.cost.op for t in first.ops} >= {"aten.mm", "aten.view"}
    cluster = first.cluster
    assert 0 < cluster.op_overhead < 1e-3
    slowdown = dict(cluster.op_slowdown)
    assert {"*", "aten.mm", "aten.addmm"} <= set(slowdown)
    # Per op, the fitted model gives back its calls' summed time (unless it got the least
    # slowdown: then it is faster than the model's overhead).
    for op in {t.cost.op for t in first.ops} & set(slowdown):
        calls = [t for t in first.ops if t.cost.op == op]
        modelled = sum(roofline_seconds(t.cost, cluster) for t in calls)
        measured = sum(t.seconds for t in calls)
        if slowdown[op] > MIN_SLOWDOWN:
            assert modelled == pytest.approx(measured, rel=1e-6), op
    assert "aten.mm" in first.table()
    assert "timed between" in refused
    # One step fits no fixed costs; with the half batch's, the fit gets both steps' calls,
    # the same on both ranks, and the cluster is its answer.
    assert first.cluster.op_fixed == ()
    assert two_sizes == two_sizes_too
    cluster, steps, calls = two_sizes
    assert [len(step) for step in steps] == calls
    assert cluster == fit_ops(first.cluster, *steps)


def test_microbatch_step_is_the_step_on_the_first_micro_batch_with_its_inputs() -> None:
    """What calibrate_ops times beside the whole step: the program a pipeline of 4 micro-batches
    runs, its batch inputs the example's first quarter, its parameters the model's."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32))
    tokens = torch.randint(0, 64, (8, 16))
    program, inputs = microbatch_step(model, Pipeline(microbatches=4), (tokens,), gpt_loss,
                                      example_targets=(tokens,))  # fmt: skip
    whole = fxpar.capture(model, (tokens,), gpt_loss, example_targets=(tokens,))
    batch = set(program.signature.inputs)
    names = list(program.placeholders())
    assert names == list(whole.placeholders())
    flat = whole.flat_inputs(model, tokens, tokens)
    for name, mine, theirs in zip(names, inputs, flat, strict=True):
        assert torch.equal(mine, tokens[:2] if name in batch else theirs), name
    assert len(time_ops(program, inputs, passes=1)) > 0  # it runs
    with pytest.raises(BatchError, match="cannot be cut into 3"):
        microbatch_step(model, Pipeline(microbatches=3), (tokens,), gpt_loss,
                        example_targets=(tokens,))  # fmt: skip


def test_calibrate_ops_without_a_process_group_says_so() -> None:
    program, inputs = _gpt()
    with pytest.raises(DistributedError, match="every rank"):
        fxpar.calibrate_ops(CLUSTER, program, inputs)


def test_op_speeds_round_trip_through_a_cluster_file(tmp_path: Path) -> None:
    cluster = dataclasses.replace(CLUSTER, op_overhead=3e-6, op_slowdown={"aten.mm": 1.1, "*": 1.5})
    loaded = fxpar.Cluster.load(cluster.save(tmp_path / "c.json"))
    assert loaded == cluster
    assert loaded.op_seconds("aten.bmm", 1e-3) == pytest.approx(3e-6 + 1.5e-3)
    fixed = dataclasses.replace(cluster, op_fixed={"aten.mm": 2e-5})
    assert fxpar.Cluster.load(fixed.save(tmp_path / "f.json")) == fixed
    assert fixed.op_seconds("aten.mm", 1e-3) == pytest.approx(3e-6 + 2e-5 + 1.1e-3)
    # Clusters without them write no such fields.
    assert not {"op_slowdown", "op_overhead", "op_fixed"} & set(CLUSTER.to_dict())


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"op_overhead": -1.0}, "op_overhead must be"),
        ({"op_overhead": math.inf}, "op_overhead must be"),
        ({"op_slowdown": {"aten.mm": 0.0}}, "op_slowdown maps"),
        ({"op_slowdown": {"aten.mm": "fast"}}, "op_slowdown maps"),
        ({"op_slowdown": [("aten.mm", 1.0), ("aten.mm", 2.0)]}, "op_slowdown maps"),
        ({"op_fixed": {"aten.mm": -1e-6}}, "op_fixed maps"),
        ({"op_fixed": {"*": math.nan}}, "op_fixed maps"),
    ],
)
def test_bad_op_speeds_are_named(fields: dict[str, object], message: str) -> None:
    with pytest.raises(FxparError, match=message):
        fxpar.Cluster((2,), **fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("op_overhead", -1),
        ("op_slowdown", {"aten.mm": -2}),
        ("op_slowdown", [1, 2]),
        ("op_fixed", {"aten.mm": -2}),
        ("op_fixed", [1, 2]),
    ],
)
def test_bad_op_speeds_in_a_cluster_file_are_named(field: str, value: object) -> None:
    with pytest.raises(FxparError, match=f"cluster's {field} cannot be"):
        fxpar.Cluster.from_dict({"mesh_shape": [2], field: value})
