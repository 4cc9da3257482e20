"""The step's critical path over compute and links (fxpar.planning.step_time.step_overlap): a
collective hides behind the compute between its start and its wait, and only there; with no
compute everything is exposed, with free links nothing is; the plan report shows both parts."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import fxpar
from fxpar import plans
from fxpar.cluster import Cluster
from fxpar.models import GPT, GPTConfig, gpt_loss
from fxpar.passes import plan_program
from fxpar.planning.plan import Plan
from fxpar.planning.report import report_data
from fxpar.planning.step_time import StepOverlap, price_schedule, step_overlap

CONFIG = GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=16)
KINDS = {
    "repl": plans.replicated,
    "dp": plans.data_parallel,
    "tp": plans.tensor_parallel,
    "fsdp": plans.fully_sharded,
}


def _plan(kind: str, cluster: Cluster) -> Plan:
    torch.manual_seed(0)
    tokens = torch.randint(0, CONFIG.vocab_size, (8, 16))
    program = fxpar.capture(GPT(CONFIG), (tokens,), gpt_loss, example_targets=(tokens,))
    return plan_program(program, cluster, manual=KINDS[kind])


def _overlap(plan: Plan, cluster: Cluster | None = None) -> StepOverlap:
    cluster = cluster or plan.cluster
    return step_overlap(price_schedule(plan.program, cluster), list(plan.program.graph.nodes))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_step_lies_between_its_compute_and_compute_plus_every_collective(kind: str) -> None:
    plan = _plan(kind, Cluster((2,), latency=(1e-4,), bandwidth=(1e8,)))
    found = _overlap(plan)
    priced = price_schedule(plan.program, plan.cluster)
    # The device's own work: its ops and the lowering's copies into its buckets.
    assert found.compute == pytest.approx(sum(priced.compute.values()) + priced.copies)
    assert found.communication == pytest.approx(sum(priced.record_seconds))
    assert 0 <= found.exposed <= found.communication * (1 + 1e-9)
    assert found.compute <= found.step <= found.compute + found.communication * (1 + 1e-9)
    assert found.hidden == pytest.approx(found.communication - found.exposed)
    if kind == "repl":
        assert found.communication == 0 and found.step == found.compute


@pytest.mark.parametrize("kind", ["dp", "tp", "fsdp"])
def test_without_compute_every_collective_is_exposed_on_a_one_axis_mesh(kind: str) -> None:
    """One link runs one collective at a time: with nothing to hide behind, the step is the
    sum of the collectives."""
    slow_links = Cluster((2,), latency=(1e-3,), bandwidth=(1e6,), flops=1e30,
                         memory_bandwidth=1e30)  # fmt: skip
    found = _overlap(_plan(kind, slow_links))
    assert found.communication > 0
    assert found.exposed == pytest.approx(found.communication, rel=1e-6)


def test_a_gradient_bucket_hides_behind_the_compute_after_its_last_gradient_only() -> None:
    """Data parallelism's gradients leave in buckets, each started when its last gradient is
    made and waited for at the return: exposed is what of its time the compute after that point
    does not cover. A small model's gradients fit one bucket, whose last gradient is the
    backward's last op: nothing hides it. (The only other collective is the loss's 4-byte
    all-reduce.)"""
    plan = _plan("dp", Cluster((2,), latency=(1e-12,), bandwidth=(1e9,)))
    priced = price_schedule(plan.program, plan.cluster)
    loss, gradients = priced.records
    assert loss.bytes == 4 and gradients.consumer == "output"
    (bucket,) = priced.schedule.leaving.buckets
    nodes = list(plan.program.graph.nodes)
    started = sum(priced.compute.get(n, 0.0) for n in nodes[: nodes.index(bucket.starts_after) + 1])
    compute = sum(priced.compute.values())
    for scale in (0.1, 1.0, 10.0):
        # The same plan priced on links `scale` times slower.
        slower = dataclasses.replace(plan.cluster, bandwidth=(1e9 / scale,))
        summed, seconds = price_schedule(plan.program, slower).record_seconds
        found = _overlap(plan, slower)
        # The loss is read right after its all-reduce is started: that one is exposed too.
        expected = summed + max(0.0, started + seconds - compute)
        assert found.exposed == pytest.approx(expected, rel=1e-9)
    assert started == pytest.approx(compute)


def test_fully_sharded_gathers_hide_behind_the_layer_before_them() -> None:
    """Each layer's all-gather starts with the layer before it: on links as fast as that
    layer's compute, most of the gathers' time hides."""
    cluster = Cluster((2,), latency=(1e-12,), bandwidth=(1e10,), flops=1e8)
    found = _overlap(_plan("fsdp", cluster))
    assert found.hidden > 0.5 * found.communication
    # The first layer's gathers have no compute before them to hide behind.
    assert found.exposed > 0


def test_free_links_leave_nothing_exposed() -> None:
    plan = _plan("fsdp", Cluster((2,), latency=(1e-12,), bandwidth=(1e18,)))
    found = _overlap(plan)
    assert found.exposed < 1e-9 and found.step == pytest.approx(found.compute)


def test_the_report_splits_the_collectives_into_hidden_and_exposed() -> None:
    plan = _plan("fsdp", Cluster((2,), latency=(1e-4,), bandwidth=(1e8,)))
    header = report_data(plan)["header"]
    found = _overlap(plan)
    assert header["exposed_seconds"] == pytest.approx(found.exposed)
    assert header["hidden_seconds"] + header["exposed_seconds"] == pytest.approx(
        header["collective_seconds"]
    )
    outside = header["update_seconds"] + header["copy_seconds"]  # the ops' compute and these
    assert outside > 0
    step = header["compute_seconds"] + outside + header["exposed_seconds"]
    assert f"exposed: step {step * 1e3:.3f} ms if overlapped" in plan.report()
