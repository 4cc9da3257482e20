"""Sharding rules: every strategy of every rule on the ops of real models is checked against
ground truth on 1-D and 2-D meshes; a wrong rule is caught; ops without rules fall back."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard
from zoo import CNN, MLP

import fxpar
from fxpar import ir
from fxpar.cluster import Cluster
from fxpar.ir.program import Program
from fxpar.models import GPT, GPTConfig, gpt_loss
from fxpar.passes.annotate_strategies import AnnotateStrategies, _call_key
from fxpar.passes.canonicalize import Canonicalize
from fxpar.rules import AxisOption, OpCall, coverage, default_rules, op_call
from fxpar.sharding import Strategies, Strategy, spec_str
from fxpar.testing import validate_rules
from fxpar.testing.strategies import _ImageModel, _SequenceModel, _square_loss

transformers = pytest.importorskip("transformers")
aten = torch.ops.aten


def hf_inputs(name: str, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    if name == "bert":
        mask = torch.ones_like(ids)
        mask[1, -2:] = 0
        return {"input_ids": ids, "attention_mask": mask, "labels": ids}
    return {"input_ids": ids, "labels": ids}


def hf_model(name: str) -> torch.nn.Module:
    if name == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=4,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))  # fmt: skip
    if name == "bert":
        return transformers.BertForMaskedLM(transformers.BertConfig(
            vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=4,
            intermediate_size=32, max_position_embeddings=16, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0))  # fmt: skip
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16))  # fmt: skip


def case(name: str) -> tuple[Program, list[torch.Tensor]]:
    """A canonicalized Program and its real placeholder values."""
    torch.manual_seed(0)
    loss_fn: Callable[..., torch.Tensor] | None
    if name in ("gpt2", "bert", "llama"):
        model = hf_model(name)
        batch = hf_inputs(name, torch.randint(0, 64, (4, 8)))
        inputs: tuple | dict = batch  # type: ignore[type-arg]
        targets: tuple[torch.Tensor, ...] = ()
        loss_fn = None
        flat_batch = list(batch.values())
    else:
        if name == "mlp":
            model, x, loss_fn = MLP(), torch.randn(8, 16), F.cross_entropy
            targets = (torch.randint(0, 10, (8,)),)
        elif name == "cnn":
            model, x, loss_fn = CNN(), torch.randn(4, 3, 8, 8), F.cross_entropy
            targets = (torch.randint(0, 10, (4,)),)
        elif name == "sequence":
            blocks = ["attention", "rmsnorm", "mlp", "layernorm"]
            model, x, loss_fn = (
                _SequenceModel(16, 12, blocks, 12),
                torch.randint(0, 16, (4, 4)),
                _square_loss,
            )
            targets = ()
        elif name == "image-avg":
            model, x, loss_fn = (
                _ImageModel(8, "avg", True, 4),
                torch.randn(4, 4, 8, 8),
                F.cross_entropy,
            )
            targets = (torch.randint(0, 4, (4,)),)
        else:
            model = GPT(GPTConfig(n_layer=1, n_embd=16, n_head=4, vocab_size=32, block_size=8))
            x, loss_fn = torch.randint(0, 32, (4, 8)), gpt_loss
            targets = (torch.randint(0, 32, (4, 8)),)
        inputs = (x,)
        flat_batch = [x, *targets]
    program = fxpar.capture(model, inputs, loss_fn, example_targets=targets)
    program = Canonicalize().run(program)
    return program, program.flat_inputs(model, *flat_batch)


MODELS = ["mlp", "cnn", "gpt", "sequence", "image-avg", "gpt2", "bert", "llama"]


@pytest.mark.parametrize("mesh", [(2,), (2, 2)], ids=["1d", "2d"])
@pytest.mark.parametrize("name", MODELS)
def test_every_strategy_matches_the_unsharded_op(name: str, mesh: tuple[int, ...]) -> None:
    program, flat = case(name)
    violations = validate_rules(program, flat, Cluster(mesh))
    assert not violations, "\n".join(map(str, violations[:10]))


def test_a_wrong_rule_is_caught() -> None:
    rules = default_rules()
    # Claims that a column-split second operand gives a row-split product: wrong.
    rules.register(aten.mm)(lambda call: [AxisOption((Shard(0),), (Replicate(), Shard(1)))])
    program, flat = case("mlp")
    violations = validate_rules(program, flat, Cluster((2,)), rules)
    assert violations and all("aten.mm" in v.target for v in violations)
    assert "differs" in str(violations[0]) or "reassembles" in str(violations[0])


def test_uneven_splits_are_pruned_not_costed() -> None:
    model = torch.nn.Linear(6, 5)
    program = fxpar.capture(model, (torch.randn(4, 6),), lambda y: y.sum())
    node = next(n for n in program.graph.nodes if n.target is aten.addmm.default)
    strategies = default_rules().strategies(op_call(node, (2,)))
    outputs = {spec_str(s.outputs[0]) for s in strategies}
    assert "(S(0))" in outputs  # 4 rows split in 2
    assert "(S(1))" not in outputs  # 5 columns cannot be


def test_ops_without_a_rule_get_the_replicated_strategy() -> None:
    rules = default_rules()
    program, _ = case("mlp")
    node = next(n for n in program.graph.nodes if n.target is aten.addmm.default)
    empty = type(rules)()
    assert empty.strategies(op_call(node, (2, 2))) == [rules.strategies(op_call(node, (2, 2)))[0]]
    assert all(
        isinstance(p, Replicate)
        for spec in empty.strategies(op_call(node, (2, 2)))[0].inputs
        for p in spec
    )


@pytest.mark.parametrize("name", ["gpt2", "bert", "llama"])
def test_coverage_leaves_no_weight_or_large_activation_replicated(name: str) -> None:
    torch.manual_seed(0)
    model = hf_model(name)
    batch, length, hidden = 4, 8, 16
    program = fxpar.capture(model, hf_inputs(name, torch.randint(0, 64, (batch, length))))
    program = Canonicalize().run(program)
    report = coverage(program)
    parameters = {program.placeholders()[p] for p in program.signature.parameters}
    for op, (count, largest) in report.fallback.items():
        assert largest < batch * hidden, f"{op} ({count} nodes) touches {largest} elements"
    for node in program.graph.nodes:
        if node.op == "call_function" and not default_rules().has_rule(node.target):
            assert not parameters & set(node.all_input_nodes), f"{node.target} reads a weight"
    assert "run replicated" in str(report) or "have sharding rules" in str(report)


def test_annotation_asks_each_distinct_call_once_and_matches_asking_every_node() -> None:
    """Strategies are a function of the OpCall, so repeated layers share one answer: the
    annotation asks the registry once per distinct call, and every node gets what asking for it
    alone gives."""
    model = GPT(GPTConfig(n_layer=3, n_embd=16, n_head=4, vocab_size=32, block_size=8))
    x = torch.randint(0, 32, (4, 8))
    program = fxpar.capture(model, (x,), gpt_loss, example_targets=(x,))
    program = Canonicalize().run(program)
    rules, asked = default_rules(), []
    original = rules.strategies

    def counting(call: OpCall) -> list[Strategy]:
        asked.append(call)
        return original(call)

    rules.strategies = counting  # type: ignore[method-assign]
    mesh = (2, 2)
    program.cluster = Cluster(mesh)
    AnnotateStrategies(rules).run(program)
    ops = [n for n in program.graph.nodes if ir.get(n, Strategies) and n.op == "call_function"]
    assert len(asked) < len(ops) / 2  # three identical blocks
    for node in ops:
        expected = default_rules().strategies(op_call(node, mesh))
        assert list(ir.require(node, Strategies).candidates) == expected, node


def test_calls_that_differ_only_in_a_value_type_are_told_apart() -> None:
    """1, 1.0 and True are equal in Python; a rule may treat them differently."""
    meta = ir.TensorMeta((4, 6), torch.float32)

    def call(*args: object) -> OpCall:
        return OpCall(aten.sum.dim_IntList, (meta, *args), {}, (meta,), (meta,), (2,))

    keys = {_call_key(call([1], value)) for value in (1, 1.0, True)}
    assert len(keys) == 3
    assert _call_key(call([1], 1)) == _call_key(call([1], 1))
    assert _call_key(call([1], object())) is None  # not a plain value: asked on its own
