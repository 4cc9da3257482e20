"""A stage's backward cut into B (input gradients) and W (weight gradients) on its graph
(fxpar/pipeline/backward_split.py): over random small models, split points and remat, B then W
returns the whole backward's values bit for bit, computing each of its ops once (a divided
fused op twice, each call for its own outputs), and the values kept from B for W have the bytes
the real tensors have; a first stage's B and a weightless stage's W are empty; a linear layer's
weight-gradient product is W's, and so are a convolution's weight gradients, its fused
backward called by B for the input gradient alone and by W for the rest (a layer norm's stays
one call, in B); the stage DP prices the convolution's division."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
import torch.nn.functional as F
from conftest import draw_split_points, microbatch_program
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fxpar
from fxpar import plans
from fxpar.cluster import Cluster, Coordinate
from fxpar.ir.program import named_state
from fxpar.lowering import collective_calls as collective_calls_module
from fxpar.models import GPT, GPTConfig, gpt_loss
from fxpar.pipeline import Pipeline, PipelineError, SplitProgram, partition, split_program
from fxpar.pipeline.atoms import Atoms
from fxpar.pipeline.backward_split import (
    BackwardSplit,
    StageBackward,
    collective_calls,
    held_for_weights,
    saved_bytes,
    split_backward,
    split_stage_backward,
)
from fxpar.pipeline.intra_op import local_batch, shard_stage
from fxpar.pipeline.split import StageOutputs
from fxpar.pipeline.stage_costs import StageCostModel
from fxpar.testing import ModelCase
from fxpar.testing import strategies as fst
from fxpar.testing.simulate import SimulatedMesh


def _module_order(model: nn.Module) -> list[str]:
    """The model's top-level modules, with the children of its Sequential containers, in the
    order the test models run them."""
    names = []
    for name, child in model.named_children():
        if isinstance(child, nn.Sequential):
            names += [f"{name}.{inner}" for inner, _ in child.named_children()]
        else:
            names.append(name)
    return names


def _backward_inputs(split: SplitProgram, state: dict[str, torch.Tensor], piece: dict) -> list:
    """Each backward unit's inputs, by stage, as one micro-batch of the step gives them (in
    the order StageProgram.run passes them)."""
    (batch,) = split.unit_inputs([piece])
    buffers = {name: state[name] for name in split.program.signature.buffers}
    stashes, message = [], ()
    with torch.no_grad():
        for unit in split.forward:
            out = unit.run(state, buffers, batch, list(message))
            message = out.sent
            stashes.append(out.stashed)
            buffers.update(out.buffer_updates)
        inputs: list = [None] * split.num_stages
        message = ()
        for unit in reversed(split.backward):
            stage = unit.unit.stage
            inputs[stage] = [
                *(state[name] for name in unit.parameters),
                *(buffers[name] for name in unit.buffers),
                *(batch[name] for name in unit.batch),
                *message,
                *stashes[stage],
            ]
            message = tuple(unit.graph_module(*inputs[stage])[: len(unit.sent)])
    return inputs


def _compute_ops(module: torch.fx.GraphModule) -> int:
    return sum(node.op == "call_function" for node in module.graph.nodes)


def _check(split: BackwardSplit, whole: torch.fx.GraphModule, inputs: Sequence) -> None:
    """B then W equals the whole backward bit for bit, each op in one part but the divided
    fused ops, in both; kept values and W's inputs are described as the tensors they are."""
    with torch.no_grad():
        expected = whole(*inputs)
        got = split.run(inputs)
        first = split.input_backward(*(inputs[i] for i in split.input_reads))
    assert len(got) == len(expected)
    for value, reference in zip(got, expected, strict=True):
        assert torch.equal(value, reference)
    count = _compute_ops(split.input_backward) + _compute_ops(split.weight_backward)
    assert count == _compute_ops(whole) + len(split.divided)
    kept = first[len(split.input_results) :]
    assert len(kept) == len(split.kept)
    for value, tensor in zip(split.kept, kept, strict=True):
        assert (value.meta.shape, value.meta.dtype) == (tuple(tensor.shape), tensor.dtype)
        assert value.nbytes == tensor.numel() * tensor.element_size()
    for value, position in zip(split.weight_inputs, split.weight_reads, strict=True):
        assert value.meta.shape == tuple(inputs[position].shape)


@settings(max_examples=20, deadline=None)
@given(case=fst.models(), data=st.data(), remat=st.booleans())
def test_input_then_weight_gradients_give_the_whole_backward_bit_for_bit(
    case: ModelCase, data: st.DataObject, remat: bool
) -> None:
    candidates = _module_order(case.model)[1:]
    chosen = data.draw(st.sets(st.sampled_from(candidates), min_size=1, max_size=3))
    points = tuple(name for name in candidates if name in chosen)
    program = fxpar.capture(case.model, case.inputs, case.loss_fn, example_targets=case.targets)
    split = split_program(program, partition(program, points), remat=remat)
    state = {**dict(case.model.named_parameters()), **dict(case.model.named_buffers())}
    state = {name: tensor.detach() for name, tensor in state.items()}
    piece = dict(zip(program.signature.inputs, (*case.inputs, *case.targets), strict=True))
    inputs = _backward_inputs(split, state, piece)
    for unit in split.backward:
        cut = split_stage_backward(unit)
        _check(cut, unit.graph_module, inputs[unit.unit.stage])
        assert cut.input_results == tuple(range(len(unit.sent)))
    first = split_stage_backward(split.backward[0])
    assert _compute_ops(first.input_backward) == 0 and first.kept == ()


def _three_stages() -> tuple[SplitProgram, list]:
    """Linear | Tanh | Linear and the loss, each a stage."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    program = fxpar.capture(model, (x,), F.cross_entropy, example_targets=(y,))
    split = split_program(program, partition(program, ("1", "2")), remat=False)
    state = {name: tensor.detach() for name, tensor in model.named_parameters()}
    return split, _backward_inputs(split, state, {"input_0": x, "target_0": y})


def test_the_first_and_a_weightless_stage() -> None:
    """Stage 0 sends nothing back: its B computes and returns nothing, its W is the whole
    backward and holds only the gradient it received. The Tanh stage has no weights: its W
    computes and returns nothing, and nothing is kept for it."""
    split, inputs = _three_stages()
    first = split_stage_backward(split.backward[0])
    assert _compute_ops(first.input_backward) == 0 and first.input_backward() == ()
    assert _compute_ops(first.weight_backward) == _compute_ops(split.backward[0].graph_module)
    assert first.kept == ()
    held = held_for_weights(split.backward[0], first)
    assert [value.name for value in held] == ["received_tanh_backward"]
    _check(first, split.backward[0].graph_module, inputs[0])
    tanh = split_stage_backward(split.backward[1])
    assert _compute_ops(tanh.weight_backward) == 0 and tanh.weight_backward() == ()
    assert tanh.kept == () and tanh.weight_reads == () and tanh.weight_results == ()
    _check(tanh, split.backward[1].graph_module, inputs[1])


def test_a_linear_layer_keeps_its_output_gradient_for_its_weight_gradient() -> None:
    """The last stage's B computes the loss's gradient and the input gradient product; W
    reads that output gradient (kept, 4 x 4 floats) and the stashed input (4 x 8 floats) and
    computes the weight gradient product and the bias sum."""
    split, inputs = _three_stages()
    last = split.backward[2]
    cut = split_stage_backward(last)
    aten = torch.ops.aten
    targets_b = [n.target for n in cut.input_backward.graph.nodes if n.op == "call_function"]
    targets_w = [n.target for n in cut.weight_backward.graph.nodes if n.op == "call_function"]
    assert targets_b.count(aten.mm.default) == 1 and aten.nll_loss_backward.default in targets_b
    assert targets_w.count(aten.mm.default) == 1 and aten.sum.dim_IntList in targets_w
    assert [value.name for value in cut.kept] == ["_log_softmax_backward_data"]
    held = held_for_weights(last, cut)
    assert [value.name for value in held] == ["_log_softmax_backward_data", "stashed_tanh"]
    assert saved_bytes(held) == (4 * 4 + 4 * 8) * 4
    _check(cut, last.graph_module, inputs[2])


def test_only_backward_units_split() -> None:
    split, _ = _three_stages()
    with pytest.raises(PipelineError, match="forward unit"):
        split_stage_backward(split.forward[0])


# -- on a stage mesh: the lowered backward, collectives and all ------------------------------

Lowered = dict[Coordinate, list[tuple[StageOutputs, tuple, dict, StageBackward]]]


def _lowered_backwards(
    split: SplitProgram, cluster: Cluster, state: dict[str, torch.Tensor], piece: dict
) -> Lowered:
    """Every stage of ``split`` (planned for the stage mesh ``cluster``) lowered to every
    device of the mesh, one micro-batch run through the forwards, then, from the last stage
    to the first, each backward whole and as B then W on the same inputs: by device, for each
    stage, the whole backward's outputs, B's sent values, W's gradients and the split."""
    (batch,) = split.unit_inputs([piece])

    def device(coordinate: Coordinate, comm: object) -> list:
        stages = [
            shard_stage(split, s, cluster, coordinate, comm)  # type: ignore[arg-type]
            for s in range(split.num_stages)
        ]
        parameters = [
            {n: each.local(n, state[n]) for n in each.backward.parameters} for each in stages
        ]
        message: tuple = ()
        stashes = []
        for stage in stages:
            buffers = {n: stage.local(n, state[n]) for n in stage.forward.buffers}
            weights = {n: stage.local(n, state[n]) for n in stage.forward.parameters}
            out = stage.forward.run(weights, buffers, local_batch(stage, batch), list(message))
            message, stashes = out.sent, [*stashes, out.stashed]
        found: list = [None] * len(stages)
        message = ()
        for s in reversed(range(len(stages))):
            unit, pieces = stages[s].backward, local_batch(stages[s], batch)
            whole = unit.run(parameters[s], {}, pieces, list(message), list(stashes[s]))
            part = StageBackward.of(unit)
            sent, held = part.run_input(parameters[s], pieces, list(message), list(stashes[s]))
            found[s] = (whole, sent, part.run_weight(held), part)
            message = whole.sent
        return found

    return SimulatedMesh(cluster.mesh_shape).run(device)  # type: ignore[arg-type]


def _check_lowered(found: Lowered) -> None:
    """On every device, B's sent values and W's gradients are the whole lowered backward's
    bit for bit, and every device's B (and W) make the same collective calls in order."""
    calls: dict[tuple[int, str], list] = {}
    for by_stage in found.values():
        for s, (whole, sent, gradients, part) in enumerate(by_stage):
            assert len(sent) == len(whole.sent)
            assert all(torch.equal(a, b) for a, b in zip(sent, whole.sent, strict=True))
            assert gradients.keys() == whole.gradients.keys()
            for name, gradient in gradients.items():
                assert torch.equal(gradient, whole.gradients[name]), (s, name)
            for half, module in (
                ("B", part.split.input_backward),
                ("W", part.split.weight_backward),
            ):
                listed = collective_calls(module)
                assert calls.setdefault((s, half), listed) == listed, (s, half)


STAGE_MESHES = ((2,), (1, 2), (2, 2))


@settings(max_examples=12, deadline=None)
@given(
    case=fst.models(),
    mesh=st.sampled_from(STAGE_MESHES),
    seed=fst.plan_seeds(),
    remat=st.booleans(),
    data=st.data(),
)
def test_on_a_stage_mesh_b_then_w_is_the_lowered_backward_bit_for_bit_on_every_device(
    case: ModelCase, mesh: tuple[int, ...], seed: int, remat: bool, data: st.DataObject
) -> None:
    """Random small models under random plans for 1-D and 2-D stage meshes, cut at random
    points: on every device (threads of the simulator, whose collectives sum in a fixed
    order), B then W of each lowered backward give its sent values and gradients bit for bit,
    and every device's B, and every device's W, make the same collective calls in the same
    order (so the devices of a stage meet at each of them whatever runs between B and W)."""
    points = draw_split_points(data, case.model, 1, 2)
    cluster = Cluster(mesh)
    chunks, program = microbatch_program(case, 1)
    planned = plans.random_plan(program, cluster, seed)
    split = split_program(planned, partition(planned, points), remat=remat)
    piece = dict(zip(planned.signature.inputs, chunks[0], strict=True))
    torch.manual_seed(seed)
    _check_lowered(_lowered_backwards(split, cluster, named_state(case.model), piece))


def _gpt_on_two_devices(plan: str) -> Lowered:
    """fxpar's GPT under ``plan`` on a stage mesh of 2, cut before ``blocks.1``, lowered."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=16, n_head=2, vocab_size=32, block_size=8))
    tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    program = fxpar.capture(model, (tokens,), gpt_loss, example_targets=(tokens,))
    planned = getattr(plans, plan)(program, Cluster((2,)))
    split = split_program(planned, partition(planned, ("blocks.1",)), remat=False)
    piece = {"input_0": tokens, "target_0": tokens}
    return _lowered_backwards(split, Cluster((2,)), named_state(model), piece)


def test_collectives_the_input_gradient_needs_are_b_and_a_weights_gather_is_w() -> None:
    """Tensor parallel GPT: the last stage's B all-reduces the input gradient of both
    column-parallel layers that take the residual stream (attention's and the MLP's), each a
    start and its wait, and its W (the weights' products, local pieces) calls none. Fully
    sharded: the last stage's B gathers the layer norm weights its input gradient needs;
    stage 0's W, its whole backward (it sends nothing back), gathers the first block's. What
    a lowered B keeps has no recorded shape, and asking its bytes says so."""
    found = _gpt_on_two_devices("tensor_parallel")
    _check_lowered(found)
    last = found[(0,)][1][3].split
    assert collective_calls(last.input_backward) == [("all_reduce", (0,))] * 2
    assert collective_calls(last.weight_backward) == []
    assert last.kept and all(value.meta is None for value in last.kept)
    with pytest.raises(PipelineError, match="records no shapes"):
        saved_bytes(last.kept)
    found = _gpt_on_two_devices("fully_sharded")
    _check_lowered(found)
    first, last = found[(1,)][0][3].split, found[(1,)][1][3].split
    assert {name for name, _ in collective_calls(last.input_backward)} == {"all_gather_bucket"}
    assert collective_calls(first.input_backward) == []
    assert [name for name, _ in collective_calls(first.weight_backward)] == ["all_gather_bucket"]


def test_a_collective_neither_part_needs_is_refused() -> None:
    """A lowered backward whose all-reduce feeds none of its results (every device would
    call it, neither B nor W would) does not split."""
    graph = torch.fx.Graph()
    comm, x = graph.placeholder("comm"), graph.placeholder("x")
    started = graph.call_function(collective_calls_module.start_all_reduce, (comm, x, 0))
    graph.call_function(collective_calls_module.wait_all_reduce, (started,))
    doubled = graph.call_function(torch.ops.aten.mul.Tensor, (x, 2))
    graph.output((doubled, doubled))
    module = torch.fx.GraphModule(torch.nn.Module(), graph)
    with pytest.raises(PipelineError, match="needed by none of its results"):
        split_backward(module, [0])


def _conv_norm_model() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """Conv, ReLU, Conv, LayerNorm over each channel's pixels, Linear, as atoms 0-6."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
        nn.Flatten(2), nn.LayerNorm(64), nn.Flatten(1), nn.Linear(512, 4),
    )  # fmt: skip
    return model, torch.randn(4, 3, 8, 8), torch.randint(0, 4, (4,))


def test_a_convolution_backward_is_divided_between_b_and_w_and_a_layer_norm_is_not() -> None:
    """Conv | ReLU, Conv, LayerNorm, Linear and the loss: the second stage's B calls
    ``convolution_backward`` for the input gradient alone (mask ``[True, False, False]``), W
    for the weight and bias gradients alone, on the output gradient B keeps for it; the layer
    norm's backward stays one call in B. B then W is the backward bit for bit. Stage 0's
    convolution, whose input gradient nobody needs, stays one call, in W."""
    model, x, y = _conv_norm_model()
    program = fxpar.capture(model, (x,), F.cross_entropy, example_targets=(y,))
    split = split_program(program, partition(program, ("2",)), remat=False)
    state = {name: tensor.detach() for name, tensor in model.named_parameters()}
    inputs = _backward_inputs(split, state, {"input_0": x, "target_0": y})
    aten = torch.ops.aten
    conv, norm = aten.convolution_backward.default, aten.native_layer_norm_backward.default

    def masks(module: torch.fx.GraphModule) -> dict[object, list[list[bool]]]:
        found: dict[object, list[list[bool]]] = {}
        for node in module.graph.nodes:
            if node.target in (conv, norm):
                found.setdefault(node.target, []).append(list(node.args[-1]))
        return found

    first = split_stage_backward(split.backward[0])
    assert first.divided == () and masks(first.input_backward) == {}
    assert masks(first.weight_backward) == {conv: [[False, True, True]]}
    cut = split_stage_backward(split.backward[1])
    assert cut.divided == ("convolution_backward",)
    assert masks(cut.input_backward) == {conv: [[True, False, False]], norm: [[True] * 3]}
    assert masks(cut.weight_backward) == {conv: [[False, True, True]]}
    gradient = next(n for n in cut.input_backward.graph.nodes if n.target is conv).args[0]
    assert gradient.name in [value.name for value in cut.kept]
    _check(first, split.backward[0].graph_module, inputs[0])
    _check(cut, split.backward[1].graph_module, inputs[1])


def test_the_stage_dp_prices_half_a_divided_convolution_in_w() -> None:
    """Priced for ZB-H1, the second convolution's atom (one divided backward op) puts half
    its backward seconds in W and keeps for W its output gradient (4 x 8 x 8 x 8 floats);
    the first convolution's backward, whose input gradient nothing needs, is W's whole; the
    ReLU's is B's, and so is the layer norm's, but for the picking of its weight gradients
    from the call's outputs, which cost nothing."""
    model, x, y = _conv_norm_model()
    program = fxpar.capture(model, (x,), F.cross_entropy, example_targets=(y,))
    atoms = Atoms.build(program, ())
    pipeline = Pipeline(stages="auto", microbatches=2, schedule="zb-h1")
    costs = StageCostModel(atoms, fxpar.Cluster((2,)), pipeline, optimizer_states=2)
    first, relu, second, _, norm = (costs.facts(atom, atom + 1) for atom in range(5))
    assert first.weight_seconds == first.backward_seconds > 0
    assert relu.weight_seconds == 0 < relu.backward_seconds
    assert second.weight_seconds == pytest.approx(second.backward_seconds / 2)
    assert second.kept_bytes == 4 * 8 * 8 * 8 * 4
    assert norm.weight_seconds == 0 < norm.backward_seconds
