"""Manual plans: choose a strategy for every node from a few decisions about the inputs.

Each plan fixes the spec of every placeholder (parameters, buffers, batch) and lets
:func:`propagate` choose every op's strategy greedily (:mod:`fxpar.planning.propagate` says how).

- :func:`data_parallel`: the batch split over every mesh axis, parameters replicated;
  gradients are all-reduced.
- :func:`tensor_parallel`: Megatron-style blocks: the first linear of attention and MLP split by
  output features (columns), the second by input features (rows), on one mesh axis; the batch
  split over the others.
- :func:`fully_sharded`: data parallel compute with parameters stored ``Shard(0)``: gathered
  before use, gradients reduce-scattered (ZeRO-3 / FSDP).
- :func:`expert_parallel`: mixture-of-experts layers' experts split by expert on one mesh
  axis (each device holds whole experts and computes their tokens' rows); the batch split over
  the others.
- :func:`replicated`: everything whole on every device, no communication: the baseline every
  split must beat, and the best plan for a model too small to be worth splitting.
- :func:`random_plan`: a random valid candidate for every node (for property tests).

Each returns the Program with a :class:`~fxpar.sharding.Sharding` on every node that needs one;
:func:`fxpar.lowering.lower` turns it into per-rank programs.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from fxpar import ir
from fxpar.cluster import Cluster
from fxpar.ir.program import Program, require_concrete_shapes
from fxpar.passes.default import default_passes
from fxpar.planning import propagate as chosen
from fxpar.planning.plan import RulesUsed
from fxpar.planning.propagate import COLUMN, ROW, SpecChooser, propagate
from fxpar.rules import RuleRegistry
from fxpar.sharding import Sharding, Strategies

__all__ = [
    "COLUMN",
    "ROW",
    "SpecChooser",
    "data_parallel",
    "expert_parallel",
    "fully_sharded",
    "prepare",
    "propagate",
    "random_plan",
    "replicated",
    "require_concrete_shapes",
    "tensor_parallel",
]


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
    return default_passes(rules=rules).through("annotate-strategies").run(program, cluster=cluster)


def replicated(program: Program, cluster: Cluster, rules: RuleRegistry | None = None) -> Program:
    """Every parameter, buffer and input whole on every device, so every op runs whole."""
    return chosen.replicated_plan(prepare(program, cluster, rules), cluster)


def data_parallel(program: Program, cluster: Cluster, rules: RuleRegistry | None = None) -> Program:
    """Split the batch over every mesh axis; replicate parameters and buffers."""
    return chosen.data_parallel(prepare(program, cluster, rules), cluster)


def fully_sharded(program: Program, cluster: Cluster, rules: RuleRegistry | None = None) -> Program:
    """Data-parallel compute with parameters (and their gradients) stored split on dim 0 over
    every mesh axis, where it divides evenly (other parameters stay replicated)."""
    return chosen.fully_sharded(prepare(program, cluster, rules), cluster)


def tensor_parallel(
    program: Program,
    cluster: Cluster,
    *,
    axis: int | str = -1,
    column: Sequence[str] = COLUMN,
    row: Sequence[str] = ROW,
    rules: RuleRegistry | None = None,
) -> Program:
    """Megatron-style tensor parallelism on mesh ``axis``; data parallelism on the others.

    Parameters of modules matching ``column`` are split by output features (weight and bias on
    dim 0), those of modules matching ``row`` by input features (weight on dim 1, bias
    replicated); the defaults name the attention and MLP linears of fxpar's GPT, Hugging Face
    decoder LMs, BERT/ViT, T5 and torchtitan's Llama.
    """
    prepared = prepare(program, cluster, rules)
    return chosen.tensor_parallel(prepared, cluster, axis=axis, column=column, row=row)


def expert_parallel(
    program: Program,
    cluster: Cluster,
    *,
    axis: int | str = 0,
    experts: Sequence[str] | None = None,
    dispatch: str = "all_reduce",
    rules: RuleRegistry | None = None,
) -> Program:
    """Expert parallelism on mesh ``axis``; data parallelism on the others.

    The stacked weights of every mixture-of-experts layer are split on the expert dim over
    ``axis`` (``experts``: parameter-name patterns; by default the parameters a grouped
    product reads as its experts' weights), every other parameter is replicated. Each device
    computes the rows its own experts are routed; the tokens are whole on ``axis`` and the
    experts' outputs are summed over it (see docs/expert_parallel.md). With
    ``dispatch="all_to_all"`` the tokens are split over ``axis`` too, and each MoE block
    sends its rows to their experts' devices and back by all-to-all.
    """
    prepared = prepare(program, cluster, rules)
    return chosen.expert_parallel(prepared, cluster, axis=axis, experts=experts, dispatch=dispatch)


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
