"""Propagation: choose every op's strategy from the specs of the placeholders.

A plan fixes the spec of each placeholder (parameters, buffers, batch), and :func:`propagate`
picks every op's strategy greedily in graph order, comparing candidates by

1. the bytes their inputs must gather (all-gathers, all-to-alls) from the producers' layouts;
2. the bytes of partial sums they leave to reduce: partial outputs, and inputs they reduce or
   turn partial (a whole value made partial must be reduced again later);
3. the number of collectives they need now (so a partial sum travels on to where it must be
   reduced anyway: one all-reduce per data-parallel gradient);
4. their order among the candidates (the replicated strategy first).

These choices reproduce the textbook plans: data parallelism reduces each gradient once, and
Megatron-LM's blocks reduce each row-parallel output where the residual stream needs it whole.
The functions below choose on a Program whose nodes already carry their candidates
(:mod:`fxpar.passes.manual` prepares them for users); the planner also runs them to give the
solver hand-written plans to start from (:func:`starting_plans`).
"""

from __future__ import annotations

import fnmatch
import functools
import operator
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch.distributed.tensor import Placement, Replicate, Shard

from fxpar import ir
from fxpar.cluster import Cluster
from fxpar.errors import FxparError
from fxpar.ir.program import Program
from fxpar.planning import moe_blocks
from fxpar.rules.experts import experts_spec, is_grouped_product
from fxpar.rules.registry import op_call, tensor_inputs
from fxpar.sharding import Sharding, Spec, Strategies, Strategy, is_valid, replicated, spec_str
from fxpar.sharding.reshard import PARTIAL, Code, SpecCoder, coded_steps

SpecChooser = Callable[[str, ir.TensorMeta], Spec]
aten = torch.ops.aten

COLUMN = (
    "*.qkv", "*.fc", "*.c_attn", "*.c_fc", "*.q_proj", "*.k_proj", "*.v_proj", "*.gate_proj",
    "*.up_proj", "*.fc1", "*.query", "*.key", "*.value", "*.intermediate.dense", "*.wq", "*.wk",
    "*.wv", "*.w1", "*.w3", "*.q", "*.k", "*.v", "*.wi", "*.wi_0", "*.wi_1",
)  # fmt: skip
"""Module names of the first linear of attention and MLP blocks, split by output features: fxpar's
GPT, Hugging Face's decoder LMs, BERT/ViT, T5 and torchtitan's Llama."""
ROW = (
    "*.attn.proj", "*.mlp.proj", "*.c_proj", "*.o_proj", "*.down_proj", "*.out_proj", "*.fc2",
    "*.attention.output.dense", "*.output.dense", "*.wo", "*.w2", "*.o",
)  # fmt: skip
"""Module names of the second linear of those blocks, split by input features."""


StrategyFilter = Callable[[fx.Node, Strategy], bool]


def propagate(
    program: Program,
    cluster: Cluster,
    placeholder_spec: SpecChooser,
    *,
    allowed: StrategyFilter | None = None,
) -> Program:
    """Fix each placeholder's spec with ``placeholder_spec(name, meta)`` and choose every op's
    strategy greedily (see the module docstring). ``allowed``: where a node has candidates it
    accepts, the choice is among those only (a plan's decision that greedy steps would not
    reach, such as computing only a device's own experts' weight gradients)."""
    mesh = cluster.mesh_shape
    names = {node: name for name, node in program.placeholders().items()}
    layout: dict[fx.Node, tuple[Spec | None, ...]] = {}
    steps = functools.lru_cache(maxsize=None)(functools.partial(_steps, mesh=mesh))
    known: dict[tuple[object, ...], Strategy] = {}
    code = SpecCoder()
    for node in program.graph.nodes:
        if node.op == "placeholder":
            meta = ir.require(node, ir.ValueMeta).tensor
            spec = placeholder_spec(names[node], meta)
            if not is_valid(meta.shape, spec, mesh):
                raise FxparError(
                    f"spec {spec_str(spec)} for {names[node]!r} does not split its shape "
                    f"{meta.shape} evenly over the mesh {mesh}"
                )
            ir.annotate(node, Sharding(Strategy((spec,), ())))
            layout[node] = (spec,)
        elif node.op == "get_attr":
            # A tensor constant of the graph is whole on every rank, as lowering materializes it;
            # it is not a decision of the plan.
            layout[node] = (replicated(cluster.ndim),)
        elif node.target is operator.getitem:
            layout[node] = (layout[node.args[0]][node.args[1]],)
        elif ir.get(node, Strategies) is not None:
            strategy = _cheapest(node, layout, steps, known, code, allowed)
            ir.annotate(node, Sharding(strategy))
            layout[node] = strategy.outputs
    return program


def _steps(have: Code, want: Code, mesh: tuple[int, ...]) -> tuple[tuple[str, bool], ...]:
    """(kind, is a collective) of each step of resharding ``have`` to ``want`` (spec codes)."""
    return tuple((step.kind, step.is_collective) for step in coded_steps(have, want, mesh))


_Coded = tuple[tuple[Code, ...], list[bool]]
"""A candidate's input codes, and whether each of its outputs is partial."""


_CODED: OrderedDict[int, tuple[tuple[Strategy, ...], list[_Coded]]] = OrderedDict()
"""The last :data:`_CODED_KEPT` tuples of candidates coded, by identity (each kept, so that its
id stays its own): identical ops share one tuple, and the hand-written plans propagate over the
same candidates one after another."""
_CODED_KEPT = 4096


def _coded(candidates: tuple[Strategy, ...]) -> list[_Coded]:
    """Each candidate's input codes and whether each of its outputs is partial."""
    found = _CODED.get(id(candidates))
    if found is None:
        code = SpecCoder()  # the candidates of one op share spec objects among themselves
        coded = [
            (tuple(map(code, c.inputs)), [s is not None and PARTIAL in code(s) for s in c.outputs])
            for c in candidates
        ]
        found = _CODED[id(candidates)] = (candidates, coded)
        if len(_CODED) > _CODED_KEPT:
            _CODED.popitem(last=False)
    else:
        _CODED.move_to_end(id(candidates))
    return found[1]


def _cheapest(
    node: fx.Node,
    layout: Mapping[fx.Node, tuple[Spec | None, ...]],
    steps: Callable[[Code, Code], tuple[tuple[str, bool], ...]],
    known: dict[tuple[object, ...], Strategy],
    code: SpecCoder,
    allowed: StrategyFilter | None = None,
) -> Strategy:
    """The first candidate of ``node`` with the least (bytes gathered, partial bytes left,
    collectives) for the layouts its inputs arrive in. ``known`` remembers the answer for each
    (candidates, arriving specs, sizes): identical repeated layers are worked out once."""
    all_candidates = ir.require(node, Strategies).candidates
    sources = tensor_inputs(node)
    arriving = tuple(code(layout[source][0]) for source in sources)  # type: ignore[arg-type]
    cast = ir.get(node, ir.PrecisionCast)
    follows = cast is not None and cast.follows_producer
    sizes = tuple(ir.evaluate(ir.require(s, ir.ValueMeta).tensor.nbytes) for s in sources)
    outputs = ir.require(node, ir.ValueMeta).outputs
    produced = tuple(None if meta is None else ir.evaluate(meta.nbytes) for meta in outputs)
    indices: Sequence[int] = range(len(all_candidates))
    if allowed is not None:
        indices = [i for i, c in enumerate(all_candidates) if allowed(node, c)] or indices
    restricted = None if allowed is None else tuple(indices)
    memo = (id(all_candidates), follows, arriving, sizes, produced, restricted)
    if memo in known:
        return known[memo]
    coded = _coded(all_candidates)
    if follows:
        # A mixed-precision cast takes its input as it arrives (where it can): a parameter is
        # cast where it is stored, a partial gradient stays partial through it.
        indices = [i for i in indices if coded[i][0] == arriving] or indices

    def key(index: int) -> tuple[int, int, int, int]:
        inputs, partial = coded[index]
        moved = pending = collectives = 0
        for current, required, nbytes in zip(arriving, inputs, sizes, strict=True):
            for kind, is_collective in steps(current, required):
                collectives += is_collective
                if kind in ("all_gather", "all_to_all"):
                    moved += nbytes
                elif kind in ("all_reduce", "reduce_scatter", "to_partial"):
                    pending += nbytes
        for is_partial, output_bytes in zip(partial, produced, strict=True):
            if is_partial and output_bytes is not None:
                pending += output_bytes
        return (moved, pending, collectives, index)

    known[memo] = all_candidates[min(indices, key=key)]
    return known[memo]


def batch_spec(cluster: Cluster, axes: Sequence[int], random: Sequence[str]) -> SpecChooser:
    """Batch tensors split on dim 0 over ``axes``; so are the ``random`` inputs (drawn whole,
    then sliced: fxpar.rng) where that divides evenly, else they stay whole."""

    def choose(name: str, meta: ir.TensorMeta) -> Spec:
        spec = tuple(Shard(0) if a in axes else Replicate() for a in range(cluster.ndim))
        valid = is_valid(meta.shape, spec, cluster.mesh_shape)
        if name in random:
            return spec if valid else replicated(cluster.ndim)
        if not valid:
            devices = 1
            for a in axes:
                devices *= cluster.mesh_shape[a]
            raise FxparError(
                f"batch input {name!r} of shape {meta.shape}: its first dim must be divisible "
                f"by the {devices} data-parallel devices; change the batch size or the mesh"
            )
        return spec

    return choose


def data_parallel(program: Program, cluster: Cluster) -> Program:
    """Split the batch over every mesh axis; replicate parameters and buffers."""
    state = set(program.signature.parameters + program.signature.buffers)
    batch = batch_spec(cluster, range(cluster.ndim), program.signature.random_inputs)

    def choose(name: str, meta: ir.TensorMeta) -> Spec:
        return replicated(cluster.ndim) if name in state else batch(name, meta)

    return propagate(program, cluster, choose)


def fully_sharded(program: Program, cluster: Cluster) -> Program:
    """Data-parallel compute with parameters (and their gradients) stored split on dim 0 over
    every mesh axis, where it divides evenly (other parameters stay replicated)."""
    program = data_parallel(program, cluster)
    placeholders = program.placeholders()
    output = next(n for n in program.graph.nodes if n.op == "output")
    # Outputs: the loss (or the model's outputs), then one gradient per trainable parameter.
    first_gradient = len(program.signature.outputs)
    gradients = dict(
        zip(program.signature.gradients, output.args[0][first_gradient:], strict=False)
    )
    for name in program.signature.parameters:
        node = placeholders[name]
        meta = ir.require(node, ir.ValueMeta).tensor
        spec = (Shard(0),) * cluster.ndim
        if meta.shape and is_valid(meta.shape, spec, cluster.mesh_shape):
            ir.annotate(node, Sharding(Strategy((spec,), ())))
            _cast_where_stored(node, gradients.get(name), spec)
    return program


def _cast_where_stored(parameter: fx.Node, gradient: fx.Node | None, spec: Spec) -> None:
    """Give the mixed-precision casts of ``parameter`` and of its ``gradient``
    (:class:`fxpar.ir.PrecisionCast`) its stored ``spec``: what is gathered is the cast to the
    compute dtype, and a gradient cast out of the reduction dtype is reduce-scattered into it
    rather than summed whole and sliced."""
    casts = [user for user in parameter.users if ir.get(user, ir.PrecisionCast) is not None]
    if gradient is not None and ir.get(gradient, ir.PrecisionCast) is not None:
        casts.append(gradient)
    for cast in casts:
        role = ir.require(cast, ir.PrecisionCast)
        if role.role is ir.CastRole.TO_REDUCE:
            continue  # partial through the cast, reduce-scattered after it
        same = [
            c
            for c in ir.require(cast, Strategies).candidates
            if c.inputs == (spec,) and c.outputs == (spec,)
        ]
        if same:
            ir.annotate(cast, Sharding(same[0]))


def tensor_parallel(
    program: Program,
    cluster: Cluster,
    *,
    axis: int | str = -1,
    column: Sequence[str] = COLUMN,
    row: Sequence[str] = ROW,
) -> Program:
    """Megatron-style tensor parallelism on mesh ``axis``; data parallelism on the others.

    Parameters of modules matching ``column`` are split by output features (the weight's
    output dim, the bias on dim 0), those of modules matching ``row`` by input features (the
    weight's input dim, bias replicated); the defaults are :data:`COLUMN` and :data:`ROW`. A
    weight's output dim is read from how the step uses it (:func:`output_feature_dim`): dim 0
    for ``nn.Linear``'s ``(out, in)`` weight, dim 1 for a weight stored ``(in, out)`` such as
    Hugging Face GPT-2's ``Conv1D``.
    """
    tp = cluster.axis_index(axis if not isinstance(axis, int) or axis >= 0 else cluster.ndim + axis)
    state = set(program.signature.parameters + program.signature.buffers)
    batch = batch_spec(
        cluster, [a for a in range(cluster.ndim) if a != tp], program.signature.random_inputs
    )

    placeholders = program.placeholders()
    position = {node: index for index, node in enumerate(program.graph.nodes)}

    def choose(name: str, meta: ir.TensorMeta) -> Spec:
        if name not in state:
            return batch(name, meta)
        module, _, kind = name.rpartition(".")
        output = output_feature_dim(placeholders[name], position) if kind == "weight" else 0
        placement: Placement = Replicate()
        if any(fnmatch.fnmatch(module, p) for p in column):
            placement = Shard(output)
        elif any(fnmatch.fnmatch(module, p) for p in row) and kind == "weight":
            placement = Shard(1 - output)
        spec = tuple(placement if a == tp else Replicate() for a in range(cluster.ndim))
        return spec if is_valid(meta.shape, spec, cluster.mesh_shape) else replicated(cluster.ndim)

    return propagate(program, cluster, choose)


def expert_parallel(
    program: Program,
    cluster: Cluster,
    *,
    axis: int | str = 0,
    experts: Sequence[str] | None = None,
    dispatch: str = "all_reduce",
) -> Program:
    """Expert parallelism on mesh ``axis``, data parallelism on the others.

    Each device of ``axis`` holds ``1/n`` of every mixture-of-experts layer's experts, whole:
    the stacked expert weights (``experts``: parameter-name patterns; by default every
    parameter a grouped product reads as its stacked weights, :func:`expert_weights`) are
    split on dim 0 over ``axis``, every other parameter is replicated, and the batch is split
    over the other axes. The tokens reach the experts whole on ``axis``: each device computes
    the rows routed to its own experts and the outputs are summed over ``axis``
    (:mod:`fxpar.rules.experts`).

    ``dispatch="all_to_all"`` splits the batch over ``axis`` too: each MoE block's rows are
    sent to their experts' devices and back by all-to-all (:mod:`fxpar.planning.moe_blocks`
    gives the block's nodes their strategies; docs/expert_parallel.md)."""
    ep = cluster.axis_index(axis)
    state = set(program.signature.parameters + program.signature.buffers)
    all_to_all = _dispatch_mode(dispatch)
    batch_axes = [a for a in range(cluster.ndim) if a != ep or all_to_all]
    batch = batch_spec(cluster, batch_axes, program.signature.random_inputs)
    split = (
        set(expert_weights(program))
        if experts is None
        else {n for n in state if any(fnmatch.fnmatch(n, p) for p in experts)}
    )
    if not split:
        raise FxparError(
            "expert_parallel found no expert weights: no parameter is read by a grouped "
            "product (aten._grouped_mm, transformers' grouped_mm_fallback) as its stacked "
            "weights; name them with experts=[...] patterns, or use another plan"
        )
    by_expert = tuple(Shard(0) if a == ep else Replicate() for a in range(cluster.ndim))

    def choose(name: str, meta: ir.TensorMeta) -> Spec:
        if name not in state:
            return batch(name, meta)
        if name in split and is_valid(meta.shape, by_expert, cluster.mesh_shape):
            return by_expert
        return replicated(cluster.ndim)

    def splits_experts(node: fx.Node, strategy: Strategy) -> bool:
        # A grouped product computes its own experts' rows and weight gradients only.
        if not is_grouped_product(node.target):
            return True
        spec = experts_spec(op_call(node, cluster.mesh_shape), strategy)
        return spec is not None and spec[ep] == Shard(0)

    if all_to_all:
        token_spec = tuple(
            Shard(0) if a in batch_axes else Replicate() for a in range(cluster.ndim)
        )
        blocks, refused = moe_blocks.find_blocks(program.graph)
        if not blocks:
            raise FxparError(
                f"expert_parallel(dispatch='all_to_all') found no MoE block to dispatch "
                f"({'; '.join(refused) or 'no routing sort'}); use dispatch='all_reduce'"
            )
        for block in blocks:
            planned = moe_blocks.dispatch_strategies(block, ep, token_spec, {})
            for node, strategy in planned.items():
                ir.annotate(node, Strategies(cluster.mesh_shape, (strategy,)))
    return propagate(program, cluster, choose, allowed=splits_experts)


def _dispatch_mode(dispatch: str) -> bool:
    if dispatch not in ("all_reduce", "all_to_all"):
        raise FxparError(
            f"expert_parallel(dispatch={dispatch!r}): say 'all_reduce' (tokens whole on the "
            f"expert axis, outputs summed) or 'all_to_all' (tokens split, sent to their experts)"
        )
    return dispatch == "all_to_all"


def expert_weights(program: Program) -> list[str]:
    """The parameters a grouped product reads as its stacked expert weights (its 3-D second
    operand, experts on dim 0), directly or through casts and transposes that keep dim 0."""
    found = []
    placeholders = program.placeholders()
    for name in program.signature.parameters:
        frontier = [placeholders[name]]
        while frontier:
            node = frontier.pop()
            users = list(node.users)
            if any(is_grouped_product(u.target) and _second_operand(u) is node for u in users):
                if len(ir.require(node, ir.ValueMeta).tensor.shape) == 3:
                    found.append(name)
                break
            frontier += [u for u in users if _keeps_dim_0(u)]
    return found


def _second_operand(node: fx.Node) -> object:
    return node.args[1] if len(node.args) > 1 else None


def _keeps_dim_0(node: fx.Node) -> bool:
    """Whether ``node`` passes its first input on with dim 0 where it was."""
    if node.target in _PASS_THROUGH:
        return True
    if node.target not in (aten.transpose.int, aten.permute.default):
        return False
    ndim = len(ir.require(node, ir.ValueMeta).tensor.shape)
    arguments: Any = node.args
    if node.target is aten.transpose.int:
        return all(int(d) % ndim != 0 for d in arguments[1:3])  # it swaps two other dims
    return int(arguments[1][0]) % ndim == 0  # the permutation puts dim 0 first


_PASS_THROUGH = frozenset({
    aten._to_copy.default, aten.detach.default, aten.alias.default, aten.clone.default,
})  # fmt: skip
"""Ops a weight may pass through on its way to its product (mixed precision's cast)."""
_TRANSPOSES = frozenset({aten.t.default, aten.transpose.int, aten.permute.default})
_PRODUCTS = {aten.mm.default: 1, aten.addmm.default: 2, aten.matmul.default: 1}
"""Products ``x @ w`` and the argument that is ``w``."""


def output_feature_dim(weight: fx.Node, position: Mapping[fx.Node, int] | None = None) -> int:
    """Which dim of a 2-D weight holds its output features, from its first use in the step: a
    weight transposed before its product (``x @ w.T``, ``nn.Linear``) has them on dim 0, one
    multiplied as it is (``x @ w``, GPT-2's ``Conv1D``) on dim 1. Dim 0 where the use says
    neither (an embedding, a convolution). ``position``: each node's place in the graph
    (computed here when not given)."""
    if position is None:
        position = {node: index for index, node in enumerate(weight.graph.nodes)}
    node = weight
    while node.users:
        user = min(node.users, key=position.__getitem__)
        target = user.target
        if target in _PASS_THROUGH:
            node = user
            continue
        if target in _TRANSPOSES:
            return 0
        argument = _PRODUCTS.get(target)  # type: ignore[call-overload]
        if argument is not None and len(user.args) > argument and user.args[argument] is node:
            return 1
        return 0
    return 0


def replicated_plan(program: Program, cluster: Cluster) -> Program:
    """Every placeholder whole on every device, so every op runs whole: no communication at all,
    the fastest plan for a model too small to be worth splitting."""
    return propagate(program, cluster, lambda name, meta: replicated(cluster.ndim))


def starting_plans(program: Program, cluster: Cluster) -> Iterator[tuple[str, Program]]:
    """The hand-written plans, applied in turn to ``program`` (each overwrites the last one's
    Sharding annotations): replicated, data parallel, tensor parallel on each mesh axis with the
    common module names (:data:`COLUMN`, :data:`ROW`) and fully sharded. A plan that does not
    apply (a batch that does not split) is left out."""
    plans: list[tuple[str, Callable[[], Program]]] = [
        ("replicated", lambda: replicated_plan(program, cluster)),
        ("data_parallel", lambda: data_parallel(program, cluster)),
        ("fully_sharded", lambda: fully_sharded(program, cluster)),
    ]
    for axis in range(cluster.ndim):
        plans.append((f"tensor_parallel(axis={axis})", _on_axis(program, cluster, axis)))
    for label, make in plans:
        try:
            yield label, make()
        except FxparError:
            continue


def _on_axis(program: Program, cluster: Cluster, axis: int) -> Callable[[], Program]:
    return lambda: tensor_parallel(program, cluster, axis=axis)
