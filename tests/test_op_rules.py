"""Sharding rules op by op: for each ATen op in the table, on small real tensors, the rule offers
more than the replicated strategy (or the op is listed as deliberately replicated, with why), and
every strategy it offers on 1-D and 2-D meshes matches the op on whole tensors. Tiny modules
that use the ops capture with no fallback, and a complex RoPE plans and lowers to per-rank
programs equal to one device. The grouped products of mixture-of-experts layers
(``aten._grouped_mm`` and, where transformers is installed, its custom ops) split inside each
expert or by expert (each device its own experts' rows, through the local call the lowering
makes), and nowhere else."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.fx as fx
from torch import nn
from torch.distributed.tensor import Replicate, Shard

import fxpar
from fxpar import ir
from fxpar.cluster import Cluster
from fxpar.ir.program import Program, Signature
from fxpar.rules import AxisOption, coverage, default_rules, op_call
from fxpar.rules.experts import experts_spec
from fxpar.rules.local import local_call
from fxpar.sharding import Sharding
from fxpar.testing import assert_equivalent, validate_rules
from fxpar.testing.rules import distribute
from fxpar.testing.strategies import splitting_cluster

try:  # loading transformers' MoE integration registers torch.ops.transformers.grouped_mm_*
    from transformers.integrations import moe as hf_moe
except ImportError:
    hf_moe = None

aten = torch.ops.aten
MESHES = [(2,), (2, 2)]


@dataclass(frozen=True)
class OpCase:
    """One call of ``op``: positional arguments, tensors included, and keyword arguments."""

    name: str
    op: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    defined_values: bool = True
    """False for ``new_empty``: its values are uninitialized, only its layout can be checked."""


def single_op_program(case: OpCase) -> tuple[Program, list[torch.Tensor]]:
    """A Program of one node calling ``case.op``, with a placeholder per tensor argument."""
    graph = fx.Graph()
    flat: list[torch.Tensor] = []

    def placeholder(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            node = graph.placeholder(f"input_{len(flat)}")
            node.meta["val"] = value
            flat.append(value)
            return node
        if isinstance(value, (list, tuple)):
            return type(value)(placeholder(v) for v in value)
        return value

    args = tuple(placeholder(a) for a in case.args)
    kwargs = {k: placeholder(v) for k, v in case.kwargs.items()}
    node = graph.call_function(case.op, args, kwargs)
    node.meta["val"] = case.op(*case.args, **case.kwargs)
    graph.output((node,))
    for n in graph.nodes:
        if n.op != "output":
            ir.annotate(n, ir.ValueMeta.of(n.meta["val"]))
    names = tuple(n.name for n in graph.nodes if n.op == "placeholder")
    signature = Signature(parameters=(), buffers=(), inputs=names, gradients=(), buffer_updates=())
    return Program(fx.GraphModule(nn.Module(), graph), signature), flat


def _g(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _pairs() -> torch.Tensor:
    return _g(2, 4, 4, 2)


def _complex() -> torch.Tensor:
    return torch.view_as_complex(_g(2, 4, 4, 2))


def _ints(high: int, *shape: int) -> torch.Tensor:
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(1))


def _distinct(*shape: int) -> torch.Tensor:
    # No ties: sort and topk indices are then unique.
    order = torch.randperm(torch.Size(shape).numel(), generator=torch.Generator().manual_seed(2))
    return order.reshape(shape).float()


# Grouped products: 8 rows sorted into 4 experts; offs ends each expert's rows (expert 1 of
# EMPTY_EXPERT has none). aten._grouped_mm wants int32 offsets and 16-byte strides.
OFFS = torch.tensor([2, 4, 6, 8], dtype=torch.int32)
EMPTY_EXPERT = torch.tensor([3, 3, 5, 8], dtype=torch.int32)


def _expert_cases() -> list[OpCase]:
    cases = [
        OpCase("_grouped_mm", aten._grouped_mm.default, (_g(8, 8), _g(4, 8, 16, seed=1), OFFS)),
        OpCase(
            "_grouped_mm (empty expert)",
            aten._grouped_mm.default,
            (_g(8, 8), _g(4, 8, 16, seed=1), EMPTY_EXPERT),
        ),
        OpCase(  # the weight gradient: (K, S) x (S, N) -> (E, K, N), grouped along S
            "_grouped_mm (2-D x 2-D)",
            aten._grouped_mm.default,
            (_g(8, 8), _g(8, 16, seed=1), EMPTY_EXPERT),
        ),
    ]
    if hf_moe is None:
        return cases
    forward = torch.ops.transformers.grouped_mm_fallback.default
    backward = torch.ops.transformers.grouped_mm_fallback_backward.default
    for name, offs in (("", OFFS), (" (empty expert)", EMPTY_EXPERT)):
        cases += [
            OpCase(f"grouped_mm_fallback{name}", forward, (_g(8, 4), _g(4, 4, 6, seed=1), offs)),
            OpCase(
                f"grouped_mm_fallback_backward{name}",
                backward,
                (_g(8, 4), _g(4, 4, 6, seed=1), offs, _g(8, 6, seed=2)),
            ),
        ]
    return cases


# Every row routed to one expert: with the experts split, one device computes every row and the
# others none (the last expert's device here, the first's below).
ONE_EXPERT = {"last": torch.tensor([0, 0, 0, 8], dtype=torch.int32), "first": torch.full((4,), 8)}


def _uneven_routing_cases() -> list[OpCase]:
    last, first = ONE_EXPERT["last"], ONE_EXPERT["first"].int()
    cases = [
        OpCase(
            "_grouped_mm (one expert)", aten._grouped_mm.default, (_g(8, 8), _g(4, 8, 16), last)
        ),
        OpCase(
            "_grouped_mm (2-D x 2-D, one expert)",
            aten._grouped_mm.default,
            (_g(8, 8), _g(8, 16, seed=1), first),
        ),
    ]
    if hf_moe is None:
        return cases
    backward = torch.ops.transformers.grouped_mm_fallback_backward.default
    args = (_g(8, 4), _g(4, 4, 6, seed=1), last, _g(8, 6, seed=2))
    return [*cases, OpCase("grouped_mm_fallback_backward (one expert)", backward, args)]


CASES = [
    OpCase("hardswish", aten.hardswish.default, (_g(4, 8),)),
    OpCase("hardsigmoid", aten.hardsigmoid.default, (_g(4, 8),)),
    OpCase("hardswish_backward", aten.hardswish_backward.default, (_g(4, 8), _g(4, 8, seed=1))),
    OpCase("hardsigmoid_backward", aten.hardsigmoid_backward.default, (_g(4, 8), _g(4, 8, seed=1))),
    OpCase(
        "softplus_backward",
        aten.softplus_backward.default,
        (_g(4, 8), _g(4, 8, seed=1), 1.0, 20.0),
    ),
    OpCase("_safe_softmax", aten._safe_softmax.default, (_g(4, 4, 8), -1)),
    OpCase("floor_divide", aten.floor_divide.default, (_g(4, 8) * 10, _g(8, seed=1).abs() + 1)),
    OpCase("_conj", aten._conj.default, (_complex(),)),
    OpCase(
        "mul (complex)", aten.mul.Tensor, (_complex(), torch.view_as_complex(_g(4, 4, 2, seed=1)))
    ),
    OpCase("cumsum", aten.cumsum.default, (_g(4, 8), 1)),
    OpCase("cumsum (dim 0)", aten.cumsum.default, (_g(4, 8), 0)),
    OpCase("sort", aten.sort.default, (_distinct(4, 8), -1)),
    OpCase("sort.stable", aten.sort.stable, (_distinct(4, 8),), {"stable": True, "dim": 0}),
    OpCase("topk", aten.topk.default, (_distinct(4, 8), 2, -1)),
    OpCase("new_zeros", aten.new_zeros.default, (_g(4, 8), [4, 8])),
    OpCase("new_ones", aten.new_ones.default, (_g(4, 8), [8, 4])),
    OpCase("new_full", aten.new_full.default, (_g(4, 8), [4, 8], 3.0)),
    OpCase("new_empty", aten.new_empty.default, (_g(4, 8), [4, 8]), defined_values=False),
    OpCase("constant_pad_nd", aten.constant_pad_nd.default, (_g(4, 8, 6), [1, 1])),
    OpCase("constant_pad_nd (value)", aten.constant_pad_nd.default, (_g(4, 6), [0, 0, 1, 1], 2.0)),
    OpCase("slice_scatter", aten.slice_scatter.default, (_g(4, 8), _g(4, 4, seed=1), 1, 2, 6)),
    OpCase("select_scatter", aten.select_scatter.default, (_g(4, 8), _g(8, seed=1), 0, 1)),
    OpCase("flip", aten.flip.default, (_g(4, 8, 2), [0, 2])),
    OpCase("view_as_complex", aten.view_as_complex.default, (_pairs(),)),
    OpCase("view_as_real", aten.view_as_real.default, (_complex(),)),
    OpCase("index.Tensor", aten.index.Tensor, (_g(8, 4), [_ints(8, 4, 2)])),
    OpCase("index.Tensor (dim 1)", aten.index.Tensor, (_g(4, 8, 2), [None, _ints(8, 4)])),
    OpCase(
        "index_put (accumulate)",
        aten.index_put.default,
        (_g(8, 4), [_ints(8, 4)], _g(4, 4, seed=1), True),
    ),
    OpCase(
        "index_put", aten.index_put.default, (_g(8, 4), [torch.arange(4) * 2], _g(4, 4, seed=1))
    ),
    OpCase("scatter.src", aten.scatter.src, (_g(4, 8), 1, _distinct(4, 8).long() % 8, _g(4, 8))),
    OpCase("scatter.value", aten.scatter.value, (_g(4, 8), 1, _ints(8, 4, 2), 1.5)),
    OpCase("scatter_add", aten.scatter_add.default, (_g(4, 8), 1, _ints(8, 4, 8), _g(4, 8))),
    OpCase("gather", aten.gather.default, (_g(4, 8), 1, _ints(8, 4, 8))),
    OpCase("histc", aten.histc.default, (_g(4, 8), 10, -2.0, 2.0)),
    *_expert_cases(),
    *_uneven_routing_cases(),
]

DELIBERATELY_REPLICATED: dict[str, str] = {
    "histc (data range)": "min == max: the bins span the global min and max, which no shard knows",
    "index.Tensor (two indices)": "several index tensors broadcast together across dims",
    "as_strided": "strides address the whole tensor's storage, which no shard holds",
    "as_strided_scatter": "strides address the whole tensor's storage, which no shard holds",
}
REPLICATED_CASES = [
    OpCase("histc (data range)", aten.histc.default, (_g(4, 8), 10)),
    OpCase("index.Tensor (two indices)", aten.index.Tensor, (_g(8, 4), [_ints(8, 4), _ints(4, 4)])),
    OpCase("as_strided", aten.as_strided.default, (_g(4, 8), [4, 4], [8, 1])),
    OpCase(
        "as_strided_scatter",
        aten.as_strided_scatter.default,
        (_g(4, 8), _g(4, 4), [4, 4], [8, 1]),
    ),
]


def _ids(cases: list[OpCase]) -> list[str]:
    return [case.name for case in cases]


def _strategies(case: OpCase, mesh: tuple[int, ...]) -> list[Any]:
    program, _ = single_op_program(case)
    node = next(n for n in program.graph.nodes if n.op == "call_function")
    return default_rules().strategies(op_call(node, mesh))


def test_the_table_lists_every_replicated_case_with_a_reason() -> None:
    assert {case.name for case in REPLICATED_CASES} == set(DELIBERATELY_REPLICATED)
    assert not {case.name for case in CASES} & set(DELIBERATELY_REPLICATED)


@pytest.mark.parametrize("mesh", MESHES, ids=["1d", "2d"])
@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
def test_the_rule_offers_more_than_replication(case: OpCase, mesh: tuple[int, ...]) -> None:
    assert len(_strategies(case, mesh)) > 1


@pytest.mark.parametrize("mesh", MESHES, ids=["1d", "2d"])
@pytest.mark.parametrize("case", REPLICATED_CASES, ids=_ids(REPLICATED_CASES))
def test_deliberately_replicated_ops_get_only_replication(
    case: OpCase, mesh: tuple[int, ...]
) -> None:
    assert len(_strategies(case, mesh)) == 1, DELIBERATELY_REPLICATED[case.name]


@pytest.mark.parametrize("mesh", MESHES, ids=["1d", "2d"])
@pytest.mark.parametrize("case", CASES + REPLICATED_CASES, ids=_ids(CASES + REPLICATED_CASES))
def test_every_strategy_matches_the_op_on_whole_tensors(
    case: OpCase, mesh: tuple[int, ...]
) -> None:
    program, flat = single_op_program(case)
    violations = validate_rules(program, flat, Cluster(mesh), default_rules())
    if not case.defined_values:
        violations = [v for v in violations if "differs by" not in v.problem]
    assert not violations, "\n".join(map(str, violations[:10]))


def test_a_wrong_rule_is_caught_op_by_op() -> None:
    """Sharding the scanned dim of cumsum is wrong: the validator says so."""
    rules = default_rules()
    scanned = Shard(1)
    rules.register(aten.cumsum.default)(lambda call: [AxisOption((scanned,), (scanned,))])
    program, flat = single_op_program(CASES[_ids(CASES).index("cumsum")])
    violations = validate_rules(program, flat, Cluster((2,)), rules)
    assert violations and "differs" in violations[0].problem


def _case(name: str) -> OpCase:
    return CASES[_ids(CASES).index(name)]


# The strategies of each grouped product on one mesh axis.
GROUPED_STRATEGIES = {
    "_grouped_mm": {  # (input, weight, offs) -> output
        "[(R), (R), (R)] -> [(R)]",
        "[(R), (S(2)), (R)] -> [(S(1))]",  # output features of every expert
        "[(S(1)), (S(1)), (R)] -> [(P)]",  # the contraction
        "[(P), (R), (R)] -> [(P)]",  # linear in input
        "[(R), (P), (R)] -> [(P)]",  # linear in weight
        "[(R), (S(0)), (R)] -> [(P)]",  # experts: each device its own experts' rows
    },
    "_grouped_mm (2-D x 2-D)": {  # (inputᵀ, grad_output, offs) -> grad_weight
        "[(R), (R), (R)] -> [(R)]",
        "[(S(0)), (R), (R)] -> [(S(1))]",
        "[(R), (S(1)), (R)] -> [(S(2))]",
        "[(P), (R), (R)] -> [(P)]",
        "[(R), (P), (R)] -> [(P)]",
        "[(R), (R), (R)] -> [(S(0))]",  # experts: each device its own experts' products
    },
    "grouped_mm_fallback": {
        "[(R), (R), (R)] -> [(R)]",
        "[(R), (S(2)), (R)] -> [(S(1))]",
        "[(S(1)), (S(1)), (R)] -> [(P)]",
        "[(P), (R), (R)] -> [(P)]",
        "[(R), (P), (R)] -> [(P)]",
        "[(R), (S(0)), (R)] -> [(P)]",
    },
    "grouped_mm_fallback_backward": {  # (input, weight, offs, grad_output) -> (dinput, dweight)
        "[(R), (R), (R), (R)] -> [(R), (R)]",
        "[(R), (S(2)), (R), (S(1))] -> [(P), (S(2))]",
        "[(S(1)), (S(1)), (R), (R)] -> [(S(1)), (S(1))]",
        "[(R), (R), (R), (P)] -> [(P), (P)]",
        "[(R), (S(0)), (R), (R)] -> [(P), (S(0))]",  # experts
    },
}


@pytest.mark.parametrize("name", list(GROUPED_STRATEGIES))
def test_grouped_products_split_inside_each_expert_or_by_expert(name: str) -> None:
    """Exactly the Megatron-style splits and the experts' split: never the rows, which
    ``offs`` counts whole, and never ``offs`` itself."""
    if name.startswith("grouped_mm_fallback"):
        pytest.importorskip("transformers.integrations.moe")
    assert {str(s) for s in _strategies(_case(name), (2,))} == GROUPED_STRATEGIES[name]


def test_grouped_mm_splits_only_what_the_cpu_kernel_accepts() -> None:
    """``aten._grouped_mm`` rejects strides that are not multiples of 16 bytes: K = 8 float32s
    splits in two (16 bytes a row) but not in four, N = 16 in both."""
    case = _case("_grouped_mm")
    k_split = "[(S(1), S(1)), (S(1), S(1)), (R, R)] -> [(P, P)]"
    n_split = "[(R, R), (S(2), S(2)), (R, R)] -> [(S(1), S(1))]"
    found = {str(s) for s in _strategies(case, (2, 2))}
    assert n_split in found and k_split not in found
    x, w, offs = case.args
    with pytest.raises(RuntimeError, match="16 bytes"):
        aten._grouped_mm.default(x.chunk(4, 1)[0].contiguous(), w.chunk(4, 1)[0].contiguous(), offs)


def test_a_wrong_grouped_product_rule_is_caught() -> None:
    """Splitting the rows would hand each device offsets that count the whole input's rows."""
    rules = default_rules()
    rows = AxisOption((Shard(0),), (Shard(0), Replicate(), Replicate()))
    rules.register(aten._grouped_mm.default)(lambda call: [rows])
    program, flat = single_op_program(_case("_grouped_mm"))
    violations = validate_rules(program, flat, Cluster((2,)), rules)
    assert violations and violations[0].strategy == "[(S(0)), (R), (R)] -> [(S(0))]"


def test_transformers_grouped_products_are_in_the_table() -> None:
    pytest.importorskip("transformers.integrations.moe")
    targets = {case.op for case in CASES}
    assert torch.ops.transformers.grouped_mm_fallback.default in targets
    assert torch.ops.transformers.grouped_mm_fallback_backward.default in targets
    assert default_rules().has_rule(torch.ops.transformers.grouped_mm_fallback.default)


class Activations(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.hardswish(self.fc(x))
        h = torch.nn.functional.hardsigmoid(h) + h.cumsum(dim=1)
        values, _ = h.sort(dim=-1)
        top, _ = h.topk(2, dim=-1)
        return values.sum() + top.sum()


class RoPE(nn.Module):
    """torchtitan's rotary embedding: pairs of features rotated by complex frequencies."""

    def __init__(self, seq: int = 4, dim: int = 8) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        angles = torch.outer(torch.arange(seq).float(), torch.arange(dim // 2).float() + 1)
        self.register_buffer("freqs", torch.polar(torch.ones_like(angles), angles))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)  # (batch, seq, dim)
        pairs = torch.view_as_complex(h.float().reshape(*h.shape[:-1], -1, 2))
        rotated = torch.view_as_real(pairs * self.freqs).flatten(2)
        return rotated.pow(2).mean()


@pytest.mark.parametrize("model", [Activations(), RoPE()], ids=["activations", "rope"])
def test_captured_modules_fall_back_on_none_of_the_covered_ops(model: nn.Module) -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 4, 8)
    program = fxpar.capture(model, (x,))
    report = coverage(program, default_rules())
    assert not report.fallback, str(report)
    for mesh in MESHES:
        violations = validate_rules(program, program.flat_inputs(model, x), Cluster(mesh))
        assert not violations, "\n".join(map(str, violations[:10]))


def test_rope_planned_by_the_ilp_matches_one_device() -> None:
    torch.manual_seed(0)
    model, x = RoPE(), torch.randn(4, 4, 8)
    plan = fxpar.plan(model, splitting_cluster((2,)), (x,), solver=fxpar.solvers.ILPSolver())
    complex_views = [
        ir.require(n, Sharding).strategy
        for n in plan.program.graph.nodes
        if n.target in (aten.view_as_complex.default, aten.view_as_real.default)
    ]
    assert complex_views and all(s.outputs[0] != (Replicate(),) for s in complex_views), (
        "the plan should shard the rotation, not run it whole"
    )
    assert_equivalent(fxpar.lower(plan), plan.program.flat_inputs(model, x))


@pytest.mark.parametrize("name", ["_grouped_mm", "_grouped_mm (2-D x 2-D)", "grouped_mm_fallback"])
def test_splitting_experts_runs_a_local_call(name: str) -> None:
    """With the experts split, each device gets a local call naming the piece of the experts
    it holds (and no other strategy gets one); the op itself on a device's pieces computes
    something else, since its ``offs`` still counts every expert's rows."""
    if name.startswith("grouped_mm_fallback"):
        pytest.importorskip("transformers.integrations.moe")
    program, flat = single_op_program(_case(name))
    node = next(n for n in program.graph.nodes if n.op == "call_function")
    call = op_call(node, (2, 2))
    experts = torch.arange(4)  # stands for any tensor with one entry per expert on dim 0
    by_expert = 0
    for strategy in default_rules().strategies(call):
        spec = experts_spec(call, strategy)
        for coordinate in Cluster((2, 2)).coordinates():
            local = local_call(call, strategy, coordinate)
            if Shard(0) not in spec:
                assert local is None
                continue
            by_expert += 1
            assert local is not None
            piece, pieces = local.static
            on_experts = tuple(p if p == Shard(0) else Replicate() for p in spec)
            held = distribute(experts, on_experts, (2, 2), torch.Generator())[coordinate]
            assert held.tolist() == experts.chunk(pieces)[piece].tolist()
    assert by_expert
    call = op_call(node, (2,))
    split = next(s for s in default_rules().strategies(call) if Shard(0) in experts_spec(call, s))
    pieces = [
        distribute(value, spec, (2,), torch.Generator())[(1,)]
        for value, spec in zip(flat, split.inputs, strict=True)
    ]
    local = local_call(call, split, (1,))
    assert local is not None
    right = local.function(*local.static, *pieces)
    with contextlib.suppress(RuntimeError, IndexError):  # two experts' weights, four offsets
        assert not torch.equal(node.target(*pieces), right)
