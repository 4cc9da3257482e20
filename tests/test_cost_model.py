"""One cost and memory model (fxpar.planning.cost) serves the ILP problem, the plan report and
the stage DP: the report states the memory and step time the solver's problem charges for the
chosen strategies, on ILP and manual plans alike; the stage DP's compute is the same roofline and
its activations the same saved values; and the definitions of saved activations and numbered
layers behave as documented on hand-made cases."""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.fx as fx
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard
from zoo import MLP

import fxpar
from fxpar import ir, plans
from fxpar.cluster import Cluster
from fxpar.ir import NumberedLayer, numbered_layer
from fxpar.models import GPT, GPTConfig, gpt_loss
from fxpar.passes import default_passes
from fxpar.pipeline import Pipeline, evaluate_split
from fxpar.pipeline.atoms import output_bytes
from fxpar.planning.cost import (
    collective_seconds,
    node_seconds,
    output_seconds,
    repeated_layers,
    reshard_seconds,
    saved_for_backward,
    saved_outputs,
)
from fxpar.planning.plan import Plan
from fxpar.planning.report import report_data
from fxpar.testing.strategies import splitting_cluster

aten = torch.ops.aten

# -- the report states what the solver's problem charges ----------------------------------------


def gpt() -> tuple[nn.Module, dict[str, Any]]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=16))
    tokens = torch.randint(0, 64, (8, 16))
    return model, {"example_inputs": (tokens,), "loss_fn": gpt_loss, "example_targets": (tokens,)}


def mlp() -> tuple[nn.Module, dict[str, Any]]:
    torch.manual_seed(0)
    inputs = (torch.randn(8, 16),)
    return MLP(), {"example_inputs": inputs, "loss_fn": lambda y: y.square().mean()}


def hf_gpt2() -> tuple[nn.Module, dict[str, Any]]:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    tokens = torch.randint(0, 64, (4, 8))
    model = transformers.GPT2LMHeadModel(config)
    return model, {"example_inputs": {"input_ids": tokens, "labels": tokens}}


MODELS: dict[str, Callable[[], tuple[nn.Module, dict[str, Any]]]] = {
    "gpt": gpt,
    "mlp": mlp,
    "hf_gpt2": hf_gpt2,
}
TENSOR_PARALLEL = {
    "gpt": plans.tensor_parallel,
    "mlp": lambda program, cluster: plans.tensor_parallel(
        program, cluster, column=("net.0",), row=("net.3",)
    ),
}
CASES = [
    *[(model, mesh, "ilp") for model in MODELS for mesh in ((2,), (2, 2))],
    *[(model, (2,), "data_parallel") for model in MODELS],
    *[(model, (2, 2), "fully_sharded") for model in MODELS],
    *[(model, (2, 2), "tensor_parallel") for model in TENSOR_PARALLEL],
]


def make_plan(model_name: str, mesh: tuple[int, ...], how: str) -> Plan:
    model, capture = MODELS[model_name]()
    cluster = splitting_cluster(mesh)
    if how == "ilp":
        return fxpar.plan(model, cluster, **capture)
    manual = TENSOR_PARALLEL[model_name] if how == "tensor_parallel" else getattr(plans, how)
    return fxpar.plan(model, cluster, **capture, manual=manual)


@pytest.mark.parametrize(("model_name", "mesh", "how"), CASES)
def test_report_memory_and_step_time_are_the_solvers_objective_terms(
    model_name: str, mesh: tuple[int, ...], how: str
) -> None:
    """The report's memory per device is the problem's memory of the chosen strategies, and its
    compute plus priced communication is the problem's objective of them (which is what the
    solver reports, or what a manual plan is scored at)."""
    plan = make_plan(model_name, mesh, how)
    choice = plan.solution.choice
    memory = plan.problem.memory(choice)
    objective = plan.problem.objective(choice)
    data = report_data(plan)
    header = data["header"]

    assert header["memory_bytes"] == pytest.approx(memory, rel=1e-12)
    assert len(data["devices"]) == Cluster(mesh).world_size
    for device in data["devices"]:
        assert sum(device["memory"].values()) == pytest.approx(memory, rel=1e-12)
    assert sum(sum(row["memory"].values()) for row in data["layers"]) == pytest.approx(memory)
    # Saved activations are part of both sides: the saved-value rule is exercised.
    assert header["memory"]["activations"] > 0

    step = header["compute_seconds"] + header["communication_seconds"]
    assert step == pytest.approx(objective, rel=1e-9)
    assert plan.solution.objective == pytest.approx(objective, rel=1e-6)
    assert sum(row["compute_seconds"] for row in data["layers"]) == pytest.approx(
        header["compute_seconds"], rel=1e-12
    )


# -- the stage DP prices with the same model ----------------------------------------------------


def test_stage_dp_compute_and_activations_are_the_shared_roofline_and_saved_values() -> None:
    """A one-stage pipeline on one device, one micro-batch: the stage's time is the roofline
    (node_seconds) summed over the step's nodes and AdamW's update (its eight passes read and
    write 20 bytes per byte of weights), and its memory the weights with gradients and
    optimizer state plus the saved values of the shared rule (the batch included)."""
    model, capture = gpt()
    captured = fxpar.capture(model, capture["example_inputs"], gpt_loss,
                             example_targets=capture["example_targets"])  # fmt: skip
    cluster = Cluster((1,))
    # Planning leaves its input as it was: the costs priced are those of the step prepared
    # (canonicalized, costed) as the stage DP prepares it.
    program = default_passes().through("annotate-cost").run(captured, cluster=cluster)
    choice = evaluate_split(program, cluster, Pipeline(stages=(), microbatches=1),
                            optimizer_states=2)  # fmt: skip
    (stage,) = choice.plan.stages

    nodes = list(program.graph.nodes)
    compute = sum(node_seconds(node, cluster) for node in nodes)
    assert compute > 0
    signature = program.signature
    placeholders = program.placeholders()
    trainable = sum(output_bytes(placeholders[name]) for name in signature.gradients)
    update = 20 * trainable / cluster.memory_bandwidth
    assert stage.time == pytest.approx(compute + update, rel=1e-12)

    batch = {placeholders[name] for name in signature.step_inputs}
    frozen = sum(
        output_bytes(node)
        for name, node in placeholders.items()
        if name not in signature.gradients and node not in batch
    )
    saved = [v for v in saved_for_backward(nodes) if v.op != "placeholder" or v in batch]
    activations = sum(output_bytes(value) for value in saved)
    assert activations > 0
    expected = (2 + 2) * trainable + frozen + stage.in_flight * activations
    assert stage.memory == pytest.approx(expected, rel=1e-12)


# -- saved activations on a hand-made graph -----------------------------------------------------


def _value(node: fx.Node, phase: ir.Phase, *shapes: tuple[int, ...], view: bool = False) -> None:
    metas = tuple(ir.TensorMeta(shape, torch.float32) for shape in shapes)
    nbytes = sum(4 * torch.Size(shape).numel() for shape in shapes)
    ir.annotate(node, ir.ValueMeta(metas, multiple=len(metas) > 1))
    ir.annotate(node, ir.Region(phase, "layer"))
    if node.op == "call_function":
        written = 0 if view else nbytes
        ir.annotate(node, ir.Cost(flops=written, bytes_read=0, bytes_written=written,
                                  output_bytes=nbytes))  # fmt: skip


def _graph() -> tuple[fx.Graph, dict[str, fx.Node]]:
    """x @ w.t() -> y, views of y (a reshape, and a transpose of the reshape), layer norm of y
    read through getitem; the backward reads the weight's transpose, y itself, both views of y
    and one of layer norm's three outputs (the mean)."""
    graph = fx.Graph()
    forward, backward = ir.Phase.FORWARD, ir.Phase.BACKWARD
    nodes: dict[str, fx.Node] = {}

    def add(name: str, target: Any, args: tuple[Any, ...], phase: ir.Phase,
            *shapes: tuple[int, ...], view: bool = False) -> fx.Node:  # fmt: skip
        node = graph.call_function(target, args)
        _value(node, phase, *shapes, view=view)
        nodes[name] = node
        return node

    x = nodes["x"] = graph.placeholder("x")
    w = nodes["w"] = graph.placeholder("w")
    _value(x, ir.Phase.INPUT, (4, 8))
    _value(w, ir.Phase.INPUT, (6, 8))
    wt = add("wt", aten.t.default, (w,), forward, (8, 6), view=True)
    y = add("y", aten.mm.default, (x, wt), forward, (4, 6))
    flat = add("flat", aten.view.default, (y, [24]), forward, (24,), view=True)
    flat_t = add("flat_t", aten.t.default, (flat,), forward, (24,), view=True)
    norm = add("norm", aten.native_layer_norm.default, (y, [6], None, None, 1e-5), forward,
               (4, 6), (4, 1), (4, 1))  # fmt: skip
    add("norm_out", operator.getitem, (norm, 0), forward, (4, 6))
    mean = add("mean", operator.getitem, (norm, 1), forward, (4, 1))
    grad = add("grad", aten.ones.default, ([4, 6],), backward, (4, 6))
    add("grad_x", aten.mm.default, (grad, wt), backward, (4, 8))
    add("uses_y", aten.mul.Tensor, (grad, y), backward, (4, 6))
    add("uses_views", aten.add.Tensor, (flat, flat_t), backward, (24,))
    add("uses_mean", aten.mul.Tensor, (grad, mean), backward, (4, 6))
    graph.output((grad,))
    return graph, nodes


def test_a_view_read_by_backward_is_counted_once_at_its_base() -> None:
    """The backward reads y, a reshape of y and a transpose of that reshape: y is saved once;
    the transpose of the weight saves the weight (a placeholder), nothing of its own; of layer
    norm's outputs only the one read (the mean) is saved."""
    graph, nodes = _graph()
    saved = saved_for_backward(graph.nodes)
    assert saved == {nodes["y"], nodes["w"], nodes["mean"]}
    # A whole step's memory charges placeholders as parameters and inputs, and an op's saved
    # outputs by index: y whole, layer norm's mean only.
    assert saved_outputs(graph.nodes) == {nodes["y"]: {0}, nodes["norm"]: {1}}
    # Forward nodes read nothing for the backward.
    forward = [n for n in graph.nodes if ir.get(n, ir.Region) and
               ir.require(n, ir.Region).phase is not ir.Phase.BACKWARD]  # fmt: skip
    assert saved_for_backward(forward) == set()


# -- numbered layers ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("module", "expected"),
    [
        ("blocks.3.attn.qkv", NumberedLayer("blocks", "3")),
        ("blocks.3", NumberedLayer("blocks", "3")),
        ("transformer.h.0.mlp", NumberedLayer("transformer.h", "0")),
        ("model.layers.1.mlp.experts.7", NumberedLayer("model.layers", "1")),
        ("2.weight", NumberedLayer("", "2")),
        ("wte", None),
        ("transformer.ln_f", None),
        ("", None),
        ("<loss>", None),
    ],
)
def test_numbered_layer_is_the_first_index_in_the_module_path(
    module: str, expected: NumberedLayer | None
) -> None:
    assert numbered_layer(module) == expected


def test_numbered_layer_names_and_patterns() -> None:
    assert (NumberedLayer("blocks", "3").name, NumberedLayer("blocks", "3").pattern) == (
        "blocks.3",
        "blocks.*",
    )
    assert (NumberedLayer("", "2").name, NumberedLayer("", "2").pattern) == ("2", "*")


def test_repeated_layers_are_the_container_with_most_numbered_children() -> None:
    modules = ["wte", "blocks.0.attn", "blocks.0.mlp", "head.0", "blocks.1", "head.1", "blocks.2"]
    assert repeated_layers(modules) == ("blocks", ["blocks.0", "blocks.1", "blocks.2"])
    # A tie goes to the container named first.
    assert repeated_layers(["head.0", "blocks.0", "blocks.1", "head.1"]) == (
        "head",
        ["head.0", "head.1"],
    )
    assert repeated_layers(["wte", "ln_f", ""]) is None


def test_results_that_leave_by_reductions_alone_are_priced_as_bucketed() -> None:
    """The lowering sends such results (data parallelism's gradients, all-reduced over one or
    more axes; fully sharded gradients, reduce-scattered) together in buckets, so the cost
    model charges their bytes but not one latency each; any other conversion of a result
    costs what the same resharding costs anywhere. Without this, the ILP preferred plans
    whose gradients could not share a bucket (the README demo: 10 collectives a step, not 2)."""
    cluster = Cluster.preset("cpu", (4,))
    meta = ir.TensorMeta((64, 32), torch.float32)
    nbytes = 64 * 32 * 4
    summed = output_seconds((Partial(),), (Replicate(),), meta, cluster)
    assert summed == pytest.approx(collective_seconds("all_reduce", nbytes, 4, 5e9, 0.0))
    assert summed < reshard_seconds((Partial(),), (Replicate(),), meta, cluster)
    scattered = output_seconds((Partial(),), (Shard(0),), meta, cluster)
    assert scattered == pytest.approx(collective_seconds("reduce_scatter", nbytes, 4, 5e9, 0.0))
    gathered = output_seconds((Shard(0),), (Replicate(),), meta, cluster)
    assert gathered == reshard_seconds((Shard(0),), (Replicate(),), meta, cluster)
    # Over both axes of a 2-D mesh: one bucket per axis, each without latency.
    square = Cluster.preset("cpu", (2, 2))
    both = output_seconds((Partial(), Partial()), (Replicate(), Replicate()), meta, square)
    one_axis = collective_seconds("all_reduce", nbytes, 2, 5e9, 0.0)
    assert both == pytest.approx(2 * one_axis)
