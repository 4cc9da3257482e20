"""Models that cannot be captured fail with a CaptureError that names the module, the source
line and what to do, never with a traceback from inside torch."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.fx.traceback as fx_traceback
from torch import nn

import fxpar
from fxpar.errors import CaptureError, FxparError


class Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.linear(x)
        if hidden.sum() > 0:  # data-dependent branch
            return hidden * 2
        return hidden


class Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = Gate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(x).mean()


def test_data_dependent_control_flow_names_module_and_line() -> None:
    with pytest.raises(CaptureError) as raised:
        fxpar.capture(Gated(), (torch.randn(2, 4),))
    message = str(raised.value)
    assert "module 'gate' (Gate)" in message
    assert "test_capture_errors.py" in message and "if hidden.sum() > 0:" in message
    assert "torch.where" in message


class Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)[x[:, 0] > 0].sum()


@pytest.mark.parametrize("dynamic", [False, True])
def test_value_dependent_shapes_are_rejected(dynamic: bool) -> None:
    with pytest.raises(CaptureError, match="depends on tensor values"):
        fxpar.capture(Masked(), (torch.randn(3, 4),), dynamic=dynamic)


def test_non_scalar_loss_is_rejected() -> None:
    with pytest.raises(CaptureError, match=r"loss must be a scalar tensor, got \(2, 4\)"):
        fxpar.capture(nn.Linear(4, 4), (torch.randn(2, 4),))


def test_output_without_loss_asks_for_loss_fn() -> None:
    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return self.linear(x), x

    with pytest.raises(CaptureError, match="pass loss_fn"):
        fxpar.capture(Pair(), (torch.randn(2, 4),))


def test_in_place_write_to_an_input_is_rejected() -> None:
    class Writer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x.mul_(2)
            return self.linear(x).sum()

    with pytest.raises(CaptureError, match="writes its input 'input_0' in place"):
        fxpar.capture(Writer(), (torch.randn(2, 4),))


def test_loss_without_trainable_parameters_is_rejected() -> None:
    model = nn.Linear(4, 1)
    model.requires_grad_(False)
    with pytest.raises(CaptureError, match="does not depend on any trainable parameter"):
        fxpar.capture(model, (torch.randn(2, 4),), lambda out: out.sum())


def test_errors_raised_by_the_model_are_wrapped_with_their_location() -> None:
    class Broken(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.linear(x.view(3, 5)).sum()

    with pytest.raises(CaptureError) as raised:
        fxpar.capture(Broken(), (torch.randn(2, 4),))
    assert "RuntimeError" in str(raised.value) and "x.view(3, 5)" in str(raised.value)
    assert isinstance(raised.value.__cause__, RuntimeError)


def test_bad_arguments_are_rejected() -> None:
    with pytest.raises(CaptureError, match=r"expects an nn\.Module"):
        fxpar.capture(lambda x: x, (torch.randn(2),))  # type: ignore[arg-type]
    with pytest.raises(CaptureError, match="without a loss_fn"):
        fxpar.capture(nn.Linear(2, 2), (torch.randn(2, 2),), example_targets=(torch.randn(2),))


def test_a_failed_capture_leaves_no_annotation_behind() -> None:
    """A model that raises mid-trace leaves its module hooks' annotation blocks open; capture
    closes them, so the next capture's nodes get their own modules and phases."""

    class Raises(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x).sum() if x.shape[0] > 100 else self.fail(x)

        def fail(self, x: torch.Tensor) -> torch.Tensor:
            raise ValueError("no")

    def fails() -> bool:
        try:
            fxpar.capture(Raises(), (torch.randn(2, 4),))
        except FxparError:
            return True  # and the traceback, with the hooks' frames, is dropped
        return False

    assert fails()
    gc.collect()  # an open block left to the collector would restore its stale state now
    left = fx_traceback.current_meta.get("custom", {})
    assert not [key for key in left if key.startswith("fxpar.")], left
