"""The copy of a lowered program the runtime runs (fxpar/runtime/fastcall.py): every ATen call
bound to its C++ entry point, computing bitwise what the original computes, made once, and
leaving the original as passes and ``.code`` read it."""

from __future__ import annotations

import weakref
from unittest import mock

import torch

import fxpar
from fxpar import plans
from fxpar.cluster import Cluster
from fxpar.lowering import lower
from fxpar.models import GPT, GPTConfig, gpt_loss
from fxpar.runtime import fastcall
from fxpar.testing.simulate import run_ranks


def _program() -> tuple[fxpar.Program, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_embd=16, n_head=2, vocab_size=32, block_size=8))
    tokens = torch.randint(0, 32, (4, 8))
    program = fxpar.capture(model, (tokens,), gpt_loss, example_targets=(tokens,))
    return program, program.flat_inputs(model, tokens, tokens)


def test_the_copy_calls_entry_points_and_computes_the_same_bits() -> None:
    program, inputs = _program()
    original = program.graph_module
    before = original.code
    fast = fastcall.executable(original)
    assert fast is fastcall.executable(original)  # made once
    targets = [n.target for n in fast.graph.nodes if n.op == "call_function"]
    assert not any(isinstance(t, torch._ops.OpOverload) for t in targets)
    assert "aten_mm_default(" in fast.code and "torch.ops.aten" not in fast.code
    assert original.code == before  # the original is left as it was
    with torch.no_grad():
        expected = original(*inputs)
        got = fast(*inputs)
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)


def test_lowered_rank_programs_run_the_same_through_the_copy() -> None:
    """A tensor-parallel plan's rank programs (collectives included), run through their
    copies in the threaded simulator, give each rank bitwise the original's outputs."""
    program, inputs = _program()
    cluster = Cluster((2,))
    spmd = lower(plans.tensor_parallel(program, cluster), cluster)

    def both(module: torch.fx.GraphModule, comm: object, local: list[torch.Tensor]) -> bool:
        first = module(comm, *local)
        second = fastcall.executable(module)(comm, *local)
        return all(torch.equal(a, b) for a, b in zip(first, second, strict=True))

    assert all(run_ranks(spmd, inputs, both).values())


_seen: list[bool] = []
_watched: list[weakref.ref[torch.Tensor]] = []


@torch.fx.wrap
def _probe(x: torch.Tensor) -> torch.Tensor:
    """Records whether the watched tensor is still alive when the program gets here."""
    _seen.append(_watched[0]() is not None)
    return x


def _reads_its_first_input_early(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    c = a + 1
    return _probe(c) * b


def test_the_copy_is_made_after_a_few_calls() -> None:
    program, inputs = _program()
    module = program.graph_module
    with mock.patch("fxpar.runtime.fastcall.COPY_AFTER_CALLS", 2), torch.no_grad():
        for _ in range(2):
            fastcall.run(module, *inputs)
            assert module not in fastcall._copies
        fastcall.run(module, *inputs)
        assert module in fastcall._copies


def test_a_boxed_call_frees_each_input_after_its_last_use() -> None:
    """Called with a list, the program empties it, so an input nobody else holds is gone by
    the time the program runs past its last use; called with arguments, the caller holds it
    to the end."""
    graph_module = torch.fx.symbolic_trace(_reads_its_first_input_early)
    for boxed in (True, False):
        _seen.clear()
        first = torch.ones(3)
        _watched[:] = [weakref.ref(first)]
        args = [first, torch.full((3,), 2.0)]
        del first
        if boxed:
            with mock.patch("fxpar.runtime.fastcall.COPY_AFTER_CALLS", 0):
                result = fastcall.run_boxed(graph_module, args)
            assert args == []
        else:
            result = fastcall.run(graph_module, *args)
            del args
        assert torch.equal(result, torch.full((3,), 4.0))
        assert _seen == [not boxed]
