"""Manual plans: choose a strategy for every node from a few decisions about the inputs.

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

Named plans built on it:

- :func:`data_parallel`: the batch split over every mesh axis, parameters replicated;
  gradients are all-reduced.
- :func:`tensor_parallel`: Megatron-style blocks: the first linear of attention and MLP split by
  output features (columns), the second by input features (rows), on one mesh axis; the batch
  split over the others.
- :func:`fully_sharded`: data parallel compute with parameters stored ``Shard(0)``: gathered
  before use, gradients reduce-scattered (ZeRO-3 / FSDP).
- :func:`random_plan`: a random valid candidate for every node (for property tests).

Each returns the Program with a :class:`~fxpar.sharding.Sharding` on every node that needs one;
:func:`fxpar.lowering.lower` turns it into per-rank programs.
"""

from __future__ import annotations

import fnmatch
import operator
import random
from collections.abc import Callable, Mapping, Sequence

import torch.fx as fx
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from fxpar import ir
from fxpar.cluster import Cluster
from fxpar.errors import FxparError
from fxpar.ir.program import Program, require_concrete_shapes
from fxpar.passes import RulesUsed, default_pipeline
from fxpar.rules import RuleRegistry
from fxpar.rules.registry import tensor_inputs
from fxpar.sharding import (
    Sharding,
    Spec,
    Strategies,
    Strategy,
    is_valid,
    replicated,
    spec_str,
)
from fxpar.sharding.reshard import reshard_steps

SpecChooser = Callable[[str, ir.TensorMeta], Spec]


def prepare(program: Program, cluster: Cluster, rules: RuleRegistry | None = None) -> Program:
    """``program`` with every node's candidate strategies for ``cluster``: the default
    pipeline up to "annotate-strategies", unless that already ran for this cluster (and these
    rules). Inside :func:`fxpar.plan` and :func:`fxpar.compile` it did, and the manual plan
    chooses among the candidates the pipeline left, a user pass's edits included."""
    require_concrete_shapes(program, "a manual plan (fxpar.plans)")
    used = program.get(RulesUsed)
    if (
        program.cluster == cluster
        and used is not None
        and (rules is None or rules is used.rules)
        and all(ir.get(node, Strategies) is not None for node in program.placeholders().values())
    ):
        return program
    program.cluster = cluster
    return default_pipeline(rules=rules).through("annotate-strategies").run(program)


def propagate(program: Program, cluster: Cluster, placeholder_spec: SpecChooser) -> Program:
    """Fix each placeholder's spec with ``placeholder_spec(name, meta)`` and choose every op's
    strategy greedily (see the module docstring)."""
    mesh = cluster.mesh_shape
    names = {node: name for name, node in program.placeholders().items()}
    layout: dict[fx.Node, tuple[Spec | None, ...]] = {}
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
            strategy = _cheapest(node, layout, mesh)
            ir.annotate(node, Sharding(strategy))
            layout[node] = strategy.outputs
    return program


def _cheapest(
    node: fx.Node, layout: Mapping[fx.Node, tuple[Spec | None, ...]], mesh: tuple[int, ...]
) -> Strategy:
    sources = tensor_inputs(node)
    outputs = ir.require(node, ir.ValueMeta).outputs

    def key(indexed: tuple[int, Strategy]) -> tuple[int, int, int, int]:
        index, strategy = indexed
        moved = pending = collectives = 0
        for source, required in zip(sources, strategy.inputs, strict=True):
            current = layout[source][0]
            assert current is not None
            nbytes = ir.evaluate(ir.require(source, ir.ValueMeta).tensor.nbytes)
            for step in reshard_steps(current, required, mesh):
                collectives += step.is_collective
                if step.kind in ("all_gather", "all_to_all"):
                    moved += nbytes
                elif step.kind in ("all_reduce", "reduce_scatter", "to_partial"):
                    pending += nbytes
        for spec, meta in zip(strategy.outputs, outputs, strict=True):
            if spec is not None and meta is not None and any(isinstance(p, Partial) for p in spec):
                pending += ir.evaluate(meta.nbytes)
        return (moved, pending, collectives, index)

    candidates = ir.require(node, Strategies).candidates
    return min(enumerate(candidates), key=key)[1]


def _batch_spec(cluster: Cluster, axes: Sequence[int], random: Sequence[str]) -> SpecChooser:
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


def data_parallel(program: Program, cluster: Cluster, rules: RuleRegistry | None = None) -> Program:
    """Split the batch over every mesh axis; replicate parameters and buffers."""
    program = prepare(program, cluster, rules)
    state = set(program.signature.parameters + program.signature.buffers)
    batch = _batch_spec(cluster, range(cluster.ndim), program.signature.random_inputs)

    def choose(name: str, meta: ir.TensorMeta) -> Spec:
        return replicated(cluster.ndim) if name in state else batch(name, meta)

    return propagate(program, cluster, choose)


def fully_sharded(program: Program, cluster: Cluster, rules: RuleRegistry | None = None) -> Program:
    """Data-parallel compute with parameters (and their gradients) stored split on dim 0 over
    every mesh axis, where it divides evenly (other parameters stay replicated)."""
    program = data_parallel(program, cluster, rules)
    placeholders = program.placeholders()
    for name in program.signature.parameters:
        node = placeholders[name]
        meta = ir.require(node, ir.ValueMeta).tensor
        spec = (Shard(0),) * cluster.ndim
        if meta.shape and is_valid(meta.shape, spec, cluster.mesh_shape):
            ir.annotate(node, Sharding(Strategy((spec,), ())))
    return program


def tensor_parallel(
    program: Program,
    cluster: Cluster,
    *,
    axis: int | str = -1,
    column: Sequence[str] = ("*.qkv", "*.fc"),
    row: Sequence[str] = ("*.attn.proj", "*.mlp.proj"),
    rules: RuleRegistry | None = None,
) -> Program:
    """Megatron-style tensor parallelism on mesh ``axis``; data parallelism on the others.

    Parameters of modules matching ``column`` are split by output features (weight and bias on
    dim 0), those of modules matching ``row`` by input features (weight on dim 1, bias
    replicated); the defaults fit :class:`fxpar.models.GPT`.
    """
    tp = cluster.axis_index(axis if not isinstance(axis, int) or axis >= 0 else cluster.ndim + axis)
    program = prepare(program, cluster, rules)
    state = set(program.signature.parameters + program.signature.buffers)
    batch = _batch_spec(
        cluster, [a for a in range(cluster.ndim) if a != tp], program.signature.random_inputs
    )

    def choose(name: str, meta: ir.TensorMeta) -> Spec:
        if name not in state:
            return batch(name, meta)
        module, _, kind = name.rpartition(".")
        placement: Placement = Replicate()
        if any(fnmatch.fnmatch(module, p) for p in column):
            placement = Shard(0)
        elif any(fnmatch.fnmatch(module, p) for p in row) and kind == "weight":
            placement = Shard(1)
        spec = tuple(placement if a == tp else Replicate() for a in range(cluster.ndim))
        return spec if is_valid(meta.shape, spec, cluster.mesh_shape) else replicated(cluster.ndim)

    return propagate(program, cluster, choose)


def random_plan(
    program: Program, cluster: Cluster, seed: int, rules: RuleRegistry | None = None
) -> Program:
    """A uniformly random candidate strategy for every placeholder and op."""
    program = prepare(program, cluster, rules)
    generator = random.Random(seed)
    for node in program.graph.nodes:
        strategies = ir.get(node, Strategies)
        if strategies is not None:
            ir.annotate(node, Sharding(generator.choice(strategies.candidates)))
    return program
