"""Uneven routing, as a model states it (``PlanOptions(expert_load=f)``): a dispatched block is
priced at its busiest device, which receives ``f`` times an even share of the rows. Its
exchanges move ``f`` times the bytes of the balanced price (hand formula), its ops on the
received rows take ``f`` times as long, the plan's report prices the same, and where every
token goes to one device the planner stops dispatching that it chose under balanced routing.
"""

from __future__ import annotations

from typing import Any

import pytest
from test_expert_choice import FAST, _cluster, _dispatched, _inputs, mixtral

import fxpar
from fxpar import ir, plans
from fxpar.errors import FxparError
from fxpar.passes import plan_program
from fxpar.planning import moe_blocks
from fxpar.planning.problem import PlanOptions
from fxpar.planning.step_time import price_schedule, record_stretches, step_overlap
from fxpar.sharding import Sharding, piece_bytes


def _dispatch_plan(load: float) -> fxpar.Plan:
    model, cluster = mixtral(), _cluster((2,), 1e9)

    def manual(program: fxpar.Program, cluster: fxpar.Cluster) -> fxpar.Program:
        return plans.expert_parallel(program, cluster, axis=0, dispatch="all_to_all")

    options = PlanOptions(expert_load=load)
    return plan_program(fxpar.capture(model, _inputs()), cluster, manual=manual, options=options)


def test_an_exchange_moves_the_busiest_devices_rows() -> None:
    """Each boundary's all-to-all costs α + (n−1)/n·f·B/β with B the piece the device sends
    as the boundary reads it; the count exchange at the sort does not grow."""
    load = 1.75
    balanced, uneven = _dispatch_plan(1.0), _dispatch_plan(load)
    cluster = uneven.cluster
    ((bandwidth, latency),) = cluster.lines_of("all_to_all", 0)
    (block,) = moe_blocks.find_blocks(uneven.program.graph)[0]
    seconds = moe_blocks.exchange_seconds(uneven.program.graph, cluster, load=load)
    counts = {
        n.name: t for n, t in moe_blocks.exchange_seconds(balanced.program.graph, cluster).items()
    }
    assert seconds[block.sort] == pytest.approx(counts[block.sort.name], rel=1e-12)
    for node, (_, value) in block.boundaries.items():
        strategy = ir.require(node, Sharding).strategy
        spec = strategy.inputs[node.all_input_nodes.index(value)]
        assert spec is not None
        piece = piece_bytes(ir.require(value, ir.ValueMeta).tensor, spec, cluster.mesh_shape)
        assert seconds[node] == pytest.approx(latency + 0.5 * load * piece / bandwidth, rel=1e-12)


def test_the_ops_on_received_rows_take_the_busiest_devices_time() -> None:
    """In the plan's priced schedule (what its report and overlap walk read) the region's and
    boundaries' ops cost ``f`` times their balanced price, every other op the same; the plan's
    estimated step grows."""
    load = 2.0
    balanced, uneven = _dispatch_plan(1.0), _dispatch_plan(load)
    before = price_schedule(balanced.program, balanced.cluster)
    after = price_schedule(uneven.program, uneven.cluster)
    loaded = {n.name for n in moe_blocks.dispatched_ops(uneven.program.graph)}
    assert loaded
    times = {n.name: s for n, s in before.compute.items()}
    scaled = 0
    for node, seconds in after.compute.items():
        factor = load if node.name in loaded else 1.0
        assert seconds == pytest.approx(factor * times[node.name], rel=1e-12), node.name
        scaled += node.name in loaded and seconds > 0
    assert scaled > 0
    assert uneven.solution.objective > balanced.solution.objective


def test_the_planner_stops_dispatching_when_one_device_gets_every_token() -> None:
    """With fast all-to-alls the ILP dispatches under balanced routing; stated that every
    token goes to one of the two devices (load 2), the busiest device does all the experts'
    work and the tokens stay whole."""
    model, cluster = mixtral(), _cluster((2,), FAST)
    balanced = plan_program(fxpar.capture(model, _inputs()), cluster)
    assert _dispatched(balanced) == [0]
    options = PlanOptions(expert_load=2.0)
    uneven = plan_program(fxpar.capture(model, _inputs()), cluster, options=options)
    assert _dispatched(uneven) == [None]


@pytest.mark.parametrize("load", [0.5, 0, True, "2"])
def test_a_load_below_balanced_is_refused(load: object) -> None:
    with pytest.raises(FxparError, match="expert_load must be a number >= 1"):
        PlanOptions(expert_load=load)  # type: ignore[arg-type]


def _exchange_records(priced: Any) -> dict[str, tuple[Any, float]]:
    """The priced schedule's records of the dispatched blocks' exchanges, by the node that
    runs each, with their seconds."""
    exchanges = {e.record for e in priced.schedule.exchanges.values()}
    return {
        record.consumer: (record, seconds)
        for record, seconds in zip(priced.records, priced.record_seconds, strict=True)
        if record in exchanges
    }


def test_the_exchanges_records_are_priced_at_the_busiest_device_and_block() -> None:
    """The exchanges are records of the plan's collective schedule, priced by the step-time
    model like every other: each record costs what ``exchange_seconds`` says at the plan's
    load, the step adds the records up (nothing priced outside them), and the overlap walk
    exposes each exchange in full (it blocks: started and waited for where its node runs)."""
    load = 1.75
    plan = _dispatch_plan(load)
    priced = price_schedule(plan.program, plan.cluster)
    found = _exchange_records(priced)
    expected = moe_blocks.exchange_seconds(plan.program.graph, plan.cluster, load=load)
    assert set(found) == {node.name for node in expected}
    for node, seconds in expected.items():
        assert found[node.name][1] == pytest.approx(seconds, rel=1e-12), node.name
    step = priced.compute_seconds + sum(priced.record_seconds) + priced.lag
    assert priced.step == pytest.approx(step, rel=1e-12)
    walked = step_overlap(priced, list(plan.program.graph.nodes))
    for name, (record, seconds) in found.items():
        assert walked.exposed_records[id(record)] >= seconds * (1 - 1e-12), name


def test_an_exchange_meets_its_peers_like_any_collective() -> None:
    """On a cluster whose latencies hold a wait for the last peer, an exchange's record pays
    the part of it that the compute since the last collective on its axis leaves
    (:func:`record_stretches`), as every record of the schedule does."""
    cluster = fxpar.Cluster(
        (2,), latency=(1e-4,), bandwidth=(1e9,), peer_wait=(5e-5,), lag_stretch=1e-3
    )

    def manual(program: fxpar.Program, cluster: fxpar.Cluster) -> fxpar.Program:
        return plans.expert_parallel(program, cluster, axis=0, dispatch="all_to_all")

    plan = plan_program(fxpar.capture(mixtral(), _inputs()), cluster, manual=manual)
    priced = price_schedule(plan.program, cluster)
    stretches = record_stretches(plan.program, priced.schedule, priced.compute, tail=0.0)
    found = _exchange_records(priced)
    assert found
    plain = moe_blocks.exchange_seconds(plan.program.graph, cluster)
    nodes = {node.name: node for node in plan.program.graph.nodes}
    for name, (record, seconds) in found.items():
        waited = cluster.peer_wait_seconds(0, stretches[id(record)])
        assert seconds == pytest.approx(plain[nodes[name]] - 5e-5 + waited, rel=1e-12)
    assert any(seconds < plain[nodes[name]] for name, (_, seconds) in found.items())
