"""The intra-op problem is a function of the program alone.

Every rank of :func:`fxpar.compile` captures the model and builds the problem itself, and rank
0's answer is only valid for the others if they built the same problem: the same decisions, in
the same order, with the same costs and the same repeated layers merged. Nothing a process
chooses for itself may leak into it: not the string hash seed (``PYTHONHASHSEED``, random per
process), not where the allocator put an object.

One run of tests/test_cuda.py's two-process CPU case on torch 2.11 saw rank 0 build a problem
of 163 decisions and rank 1 one of 198 from one program (118 with every layer merged). Those
are exactly the sizes capture gives when its walk over the autograd graph
(``_tag_backward_nodes``) misses a node near the loss (163: no backward op lands in its layer,
so the layers' forward halves alone look alike) or one inside a layer (198: the layers differ
and nothing merges). In torch 2.11 (not in 2.13, where the node keeps it alive) the Python
object of an autograd node is made when asked for and freed when dropped; the walk remembered
visited nodes by ``id``, so a dropped node's address, reused for a node not yet visited, made
that node look visited, by the luck of each process's allocator.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import weakref
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
import transformers

import fxpar
from fxpar.errors import DistributedError
from fxpar.ir import capture as capture_module
from fxpar.models import GPT, GPTConfig, gpt_loss
from fxpar.passes.default import prepare_for_planning
from fxpar.planning.problem import build_problem
from fxpar.planning.rank_zero import SolvedOnRankZero
from fxpar.solvers.problem import IntraOpProblem, IntraOpSolution
from fxpar.testing.strategies import splitting_cluster

HASH_SEEDS = (1, 2)
"""The seeds of the other processes (this one's is its own, random unless set)."""


def _gpt() -> fxpar.Program:
    config = GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=16, bias=False)
    tokens = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1))
    return fxpar.capture(GPT(config), (tokens,), gpt_loss, example_targets=(tokens,))


def _llama() -> fxpar.Program:
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16,
    )  # fmt: skip
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    model = transformers.LlamaForCausalLM(config)
    return fxpar.capture(model, {"input_ids": tokens, "labels": tokens})


MODELS: dict[str, Callable[[], fxpar.Program]] = {"gpt": _gpt, "llama": _llama}


def problem_digests() -> dict[str, tuple[int, int, str]]:
    """For each model of :data:`MODELS` on a 2-way mesh: its decision count, how many units
    the repeated layers merged, and a digest of everything the problem and its layout hold
    (names, kinds, strategies, costs, memory, edges, which unit shares whose decisions)."""
    digests = {}
    for name, make in MODELS.items():
        torch.manual_seed(0)
        cluster = splitting_cluster((2,))
        program = prepare_for_planning(make(), cluster)
        problem, layout = build_problem(program, cluster)
        described = repr((
            problem.names, problem.kinds, problem.strategies, problem.node_costs,
            problem.node_memory, problem.edges, problem.memory_limit,
            [unit.root.name for unit in layout.units], layout.representative,
        ))  # fmt: skip
        digest = hashlib.sha256(described.encode()).hexdigest()
        digests[name] = (problem.num_nodes, layout.stats["layers_merged"], digest)
    return digests


@pytest.mark.slow  # starts two interpreters: about 15 s on two idle cores
def test_processes_with_other_hash_seeds_build_the_same_problems() -> None:
    """Processes with different string hash seeds (and so different set and dict orders of
    strings, and different allocator histories) build problems identical to this process's,
    with every layer merged."""
    script = "import json, test_problem_determinism as t; print(json.dumps(t.problem_digests()))"
    tests = str(Path(__file__).parent)
    env = {**os.environ, "PYTHONPATH": tests}
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", script],
            cwd=tests,
            env={**env, "PYTHONHASHSEED": str(seed)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in HASH_SEEDS
    ]
    here = {name: list(found) for name, found in problem_digests().items()}
    for seed, run in zip(HASH_SEEDS, runs, strict=True):
        out, err = run.communicate(timeout=300)
        assert run.returncode == 0, err
        assert json.loads(out) == here, f"PYTHONHASHSEED={seed}"
    # Both models have two alike layers: one's decisions are the other's.
    assert all(merged > 0 for _, merged, _ in here.values()), here


class _AutogradNode:
    """What torch keeps of an autograd node: its sequence number, hooks and next nodes, and a
    weak reference to its Python object while one exists."""

    def __init__(self, sequence_nr: int) -> None:
        self.sequence_nr = sequence_nr
        self.next: list[_AutogradNode] = []
        self.prehooks: list[Callable[..., Any]] = []
        self.hooks: list[Callable[..., Any]] = []
        self.python: weakref.ref[_ShortLivedNode] | None = None

    def as_python(self) -> _ShortLivedNode:
        """Its Python object: the live one, or a new one if none is referenced."""
        found = self.python() if self.python is not None else None
        if found is None:
            found = _ShortLivedNode(self)
            self.python = weakref.ref(found)
        return found


class _ShortLivedNode:
    """An autograd node's Python object as torch 2.11 makes it: freed as soon as no one
    references it, so its address goes to the next object of its size. The unused slots give
    it a size few other objects have, so that next object is most likely another node's."""

    __slots__ = ("node", "__weakref__", *(f"_unused{i}" for i in range(24)))

    def __init__(self, node: _AutogradNode) -> None:
        self.node = node

    def _sequence_nr(self) -> int:
        return self.node.sequence_nr

    def register_prehook(self, hook: Callable[..., Any]) -> None:
        self.node.prehooks.append(hook)

    def register_hook(self, hook: Callable[..., Any]) -> None:
        self.node.hooks.append(hook)

    @property
    def next_functions(self) -> tuple[tuple[_ShortLivedNode, int], ...]:
        return tuple((node.as_python(), 0) for node in self.node.next)


def test_capture_hooks_every_autograd_node_whose_python_object_is_short_lived() -> None:
    """Capture hooks each node of a backward graph (a chain of layers, each also reaching a
    parameter's node and the layer after next) exactly once, although each node's Python
    object is freed when the walk drops it and its address is handed to the next one made."""
    layers = [_AutogradNode(number) for number in range(40)]
    parameters = [_AutogradNode(100 + number) for number in range(40)]
    for number, layer in enumerate(layers):
        layer.next = [*layers[number + 1 : number + 3], parameters[number]]
    loss = SimpleNamespace(grad_fn=layers[0].as_python())
    capture_module._tag_backward_nodes(loss, [])  # type: ignore[arg-type]
    hooked = [(len(node.prehooks), len(node.hooks)) for node in layers + parameters]
    assert hooked == [(1, 1)] * len(hooked)


def _on_rank_one_of_two(monkeypatch: pytest.MonkeyPatch, rank_zero_sends: object) -> None:
    """Make this process rank 1 of 2, receiving ``rank_zero_sends`` from every broadcast."""

    def receive(objects: list[object], src: int) -> None:
        objects[0] = rank_zero_sends

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    monkeypatch.setattr(dist, "broadcast_object_list", receive)


def test_a_rank_refuses_rank_zeros_answer_to_a_problem_with_other_decisions(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rank 0's answer is taken only where this rank's problem has the same decisions in the
    same order: with as many decisions, merged otherwise, the answer is refused by name."""
    problem = IntraOpProblem(
        node_costs=((1.0, 2.0), (1.0, 2.0), (3.0,)), node_memory=((0.0, 0.0),) * 2 + ((0.0,),),
        names=("mm", "mm_1", "sum_1"),
    )  # fmt: skip
    answer = IntraOpSolution((0, 0, 0), 5.0, "optimal", 0.0, "ilp", 0.0)
    same = (("mm", 2), ("mm_1", 2), ("sum_1", 1))
    _on_rank_one_of_two(monkeypatch, (same, answer))
    assert SolvedOnRankZero(None).solve(problem) == answer
    merged_otherwise = (("mm", 2), ("mm_2", 2), ("sum_1", 1))
    _on_rank_one_of_two(monkeypatch, (merged_otherwise, answer))
    with pytest.raises(DistributedError, match="decision 1 is 'mm_2' with 2 choices on rank 0"):
        SolvedOnRankZero(None).solve(problem)
