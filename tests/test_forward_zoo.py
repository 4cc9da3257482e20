"""Forward-only programs (a loss evaluation, the model's forward alone) across the zoo of real
model families: each is captured, planned by the ILP with every parameter and buffer pinned to
the layout a fully sharded training plan gave it (as a compiled model plans them, so that no
state moves), lowered, and its simulated ranks give what one device computes; the forward's
outputs rebuild the model's own output structure (a Hugging Face ``ModelOutput``, a tensor)
with eager PyTorch's values."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_manual_plans_zoo import ZOO

import fxpar
from fxpar import plans
from fxpar.passes import default_passes, keeping_state, plan_program
from fxpar.testing import assert_equivalent
from fxpar.testing.strategies import splitting_cluster

CLUSTER = splitting_cluster((2, 2))


SEQ2SEQ = ("t5", "bart")


def _forward_inputs(model: str, inputs: Any) -> Any:
    """The model's inputs without the labels (its forward then returns no loss); an
    encoder-decoder is given its decoder's inputs instead."""
    if not isinstance(inputs, dict):
        return inputs
    forward = {k: v for k, v in inputs.items() if k != "labels"}
    if model in SEQ2SEQ:
        forward["decoder_input_ids"] = inputs["labels"]
    return forward


def _state_specs(case: Any) -> dict[str, Any]:
    """Every parameter's and buffer's spec under a fully sharded training plan."""
    trained = plan_program(case.capture(), CLUSTER, manual=plans.fully_sharded)
    spmd = fxpar.lower(trained)
    signature = trained.program.signature
    names = set(signature.parameters + signature.buffers)
    return {
        name: spec
        for name, spec in zip(trained.program.placeholders(), spmd.input_specs, strict=True)
        if name in names
    }


@pytest.mark.parametrize("model", list(ZOO))
def test_forward_and_loss_programs_plan_around_the_trained_state(model: str) -> None:
    torch.manual_seed(0)
    case = ZOO[model]()
    state = _state_specs(case)
    passes = keeping_state(default_passes(), state, solve=True)

    evaluation = fxpar.capture(
        case.model, case.inputs, case.loss_fn, example_targets=case.targets, step="loss"
    )
    planned = plan_program(evaluation, CLUSTER, passes=passes)
    assert_equivalent(fxpar.lower(planned), case.flat_inputs(evaluation))

    inputs = _forward_inputs(model, case.inputs)
    forward = fxpar.capture(case.model, inputs, step="forward")
    planned = plan_program(forward, CLUSTER, passes=passes)
    spmd = fxpar.lower(planned)
    kept = dict(zip(forward.placeholders(), spmd.input_specs, strict=True))
    assert all(kept[name] == spec for name, spec in state.items() if name in kept)
    values = list(inputs.values()) if isinstance(inputs, dict) else list(inputs)
    flat = forward.flat_inputs(case.model, *values)
    assert_equivalent(spmd, flat)

    tree = forward.signature.output_tree
    assert tree is not None
    rebuilt = tree.rebuild(forward.run(case.model, *values).outputs)
    with torch.no_grad():
        eager = case.model(**inputs) if isinstance(inputs, dict) else case.model(*inputs)
    assert type(rebuilt) is type(eager)
    first = rebuilt if isinstance(rebuilt, torch.Tensor) else rebuilt[0]
    expected = eager if isinstance(eager, torch.Tensor) else eager[0]
    torch.testing.assert_close(first, expected, rtol=1e-5, atol=1e-6)
