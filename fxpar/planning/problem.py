"""From a Program with candidate strategies to the plain-data intra-op problem, and back.

:func:`build_problem` turns the annotated graph into an
:class:`~fxpar.solvers.problem.IntraOpProblem`:

1. **Units.** Every placeholder and op with candidate strategies is a node of the problem,
   except *followers* when coarsening: an op with a single tensor input (views, transposes,
   unary pointwise ops, copies) joins its producer's unit and takes, for each strategy of the
   unit, its cheapest response (its own cost plus the resharding of its input). Only units are
   decisions. A mixed-precision cast that follows its producer
   (:attr:`fxpar.ir.PrecisionCast.follows_producer`) is a follower even without coarsening,
   and takes its input as it arrives.
2. **Repeated layers.** Units under module paths that differ only by a layer index
   (``blocks.0``, ``blocks.1``, ...) are compared structurally; identical layers share one set of
   decisions, so the problem is solved once per distinct layer. Their costs and memory add up on
   the shared decisions.
3. **Costs.** A unit's cost for a strategy is the compute time of its nodes (and the
   resharding inside it); an edge's matrix is the resharding time from the producer unit's layout
   to the layout the consumer's strategy requires (:mod:`fxpar.planning.cost`). The loss must end
   replicated and each gradient in its parameter's layout: those are costs too.
4. **Memory** per device, by :mod:`fxpar.planning.cost`: every parameter with its gradient and
   optimizer state (``2 + optimizer_states`` copies of its local piece), buffers and the batch,
   and the forward activations the backward reads, each at the storage holding it (a unit
   charges the saved values it produces).

:func:`apply_solution` writes the chosen strategies back as Sharding annotations.
"""

from __future__ import annotations

import fnmatch
import operator
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import torch.fx as fx

from fxpar import ir
from fxpar.cluster import Cluster
from fxpar.errors import FxparError
from fxpar.ir.fold import Multiplicity
from fxpar.ir.program import Program
from fxpar.planning.cost import (
    Price,
    Terms,
    compute_seconds,
    local_bytes,
    numbered_layer,
    output_seconds,
    parameter_memory,
    reshard_seconds,
    reshard_terms,
    saved_bytes,
    saved_outputs,
)
from fxpar.planning.grouping import holds_parameter, reread_in_backward
from fxpar.planning.moe_blocks import ExpertLoad, dispatched_ops, exchange_seconds
from fxpar.planning.shared_reads import Read, SharedRead, merge, share_reads, shared_on
from fxpar.rules.registry import tensor_inputs
from fxpar.sharding import Sharding, Spec, Strategies, Strategy, replicated, spec_str
from fxpar.sharding.reshard import Code, spec_code
from fxpar.solvers.problem import Edge, IntraOpProblem

RematPolicy = str | tuple[str, ...]
"""Which layers recompute their activations in the backward: ``"none"``, ``"all"``, ``"auto"``
or a tuple of fnmatch patterns of numbered layer names (see :mod:`fxpar.passes.remat`)."""

_REMAT_WORDS = ("none", "all", "auto")


def check_remat_policy(policy: object) -> None:
    """Raise FxparError unless ``policy`` is a :data:`RematPolicy`."""
    if isinstance(policy, str) and policy in _REMAT_WORDS:
        return
    if isinstance(policy, tuple) and policy and all(isinstance(p, str) for p in policy):
        return
    raise FxparError(
        f"remat must be one of {list(_REMAT_WORDS)} or a non-empty tuple of layer name "
        f"patterns such as ('blocks.*',), got {policy!r}"
    )


@dataclass(frozen=True)
class PlanOptions:
    """Options of the planner.

    ``pins`` maps a name pattern (fnmatch) to the spec its tensor must have: parameter, buffer
    and input names (``"blocks.*.mlp.fc.weight"``) or node names of the Program (``"addmm_3"``).

    ``coarsen`` merges every follower into its producer's decision, taking its cheapest response
    to the layout that arrives: a smaller problem, but not an exact one (a follower that shards a
    replicated input for free leaves its consumers to gather it back), so it is off by default.

    ``manual_starts`` gives the solver the hand-written plans (replicated, data, tensor and fully
    sharded parallelism) as :attr:`~fxpar.solvers.problem.IntraOpProblem.starts`: the ILP never
    answers with a plan the cost model prices above the cheapest of them that fits.

    ``remat`` chooses the numbered layers whose activations the backward recomputes instead of
    keeping (:mod:`fxpar.passes.remat`): ``"none"``, ``"all"``, a tuple of layer name patterns,
    or ``"auto"``: chosen with the sharding by price, by solving the problem for a few counts
    of layers (most activation bytes first), from the fewest with which some plan fits to all
    (:class:`fxpar.passes.SolveStrategies`); none where the fastest plan fits without remat.
    Calls of ``torch.utils.checkpoint`` in the model are recomputed under every policy.

    ``gradient_share`` is the part of each gradient's synchronisation (its conversion into its
    parameter's layout: a data-parallel all-reduce, a fully sharded reduce-scatter) that one run
    of the program pays: 1 for a training step, ``1/M`` for one of ``M`` micro-batches whose
    gradients are summed and synchronised once a step, as a pipeline's stages do. Without it a
    stage plan would price data parallelism's gradient sums ``M`` times over.

    ``expert_load`` is how unevenly a mixture-of-experts model routes its tokens, as the model
    states it: the rows the busiest device of a dispatched block receives over an even share
    (1: balanced routing, the default; ``n``: every token on one device of an ``n``-device
    expert axis). A block whose tokens are dispatched by all-to-all is priced at the busiest
    device, its exchanges and its region's ops that many times their balanced price
    (:class:`fxpar.planning.moe_blocks.ExpertLoad`); the step waits for that device.

    ``moe_dispatch`` lets the solver's planner weigh dispatching each mixture-of-experts
    block's tokens by all-to-all (:mod:`fxpar.planning.dispatch_variants`). Pipeline stages
    turn it off: a dispatched block does not yet run cut into a stage's forward and backward.
    """

    optimizer_states: int = 2
    coarsen: bool = False
    manual_starts: bool = True
    dedup_layers: bool = True
    memory_limit: float | None = None
    pins: Mapping[str, Spec] = field(default_factory=dict)
    remat: RematPolicy = "none"
    gradient_share: float = 1.0
    expert_load: float = 1.0
    moe_dispatch: bool = True

    def __post_init__(self) -> None:
        check_remat_policy(self.remat)
        share = self.gradient_share
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
            raise FxparError(f"gradient_share must be a number in (0, 1], got {share!r}")
        load = self.expert_load
        if isinstance(load, bool) or not isinstance(load, (int, float)) or not load >= 1:
            raise FxparError(
                f"expert_load must be a number >= 1 (the busiest device's routed rows over an "
                f"even share; 1 is balanced routing), got {load!r}"
            )


@dataclass
class _Unit:
    root: fx.Node
    allowed: list[int]
    """Candidate indices of the root this unit may take (all, unless pinned)."""
    members: list[fx.Node] = field(default_factory=list)
    follow: dict[fx.Node, list[int]] = field(default_factory=dict)
    """For each member, its candidate index for each allowed root choice."""


@dataclass
class Layout:
    """How problem nodes map back to graph nodes (the inverse of :func:`build_problem`)."""

    units: list[_Unit]
    unit_of: dict[fx.Node, int]
    representative: list[int]
    """For each unit, the problem node it shares decisions with."""
    stats: dict[str, int]
    shared_reads: tuple[SharedRead, ...] = ()
    """The problem's auxiliary decisions, after the units' (:mod:`~fxpar.planning.shared_reads`)."""
    shares: bool = False
    """Whether the problem prices a conversion its readers share once
    (:func:`~fxpar.planning.shared_reads.shared_on`)."""

    def problem_node(self, node: fx.Node) -> int:
        return self.representative[self.unit_of[node]]

    def completed(self, choice: tuple[int, ...]) -> tuple[int, ...]:
        """A choice of the units' decisions with the auxiliary ones they imply appended."""
        return (*choice, *(read.converted(choice) for read in self.shared_reads))


def candidates(node: fx.Node) -> tuple[Strategy, ...]:
    return ir.require(node, Strategies).candidates


def build_problem(
    program: Program, cluster: Cluster, options: PlanOptions = PlanOptions()
) -> tuple[IntraOpProblem, Layout]:
    """The intra-op problem of ``program`` (annotated with Strategies and Cost) on ``cluster``."""
    builder = _Builder(program, cluster, options)
    return builder.build()


def build_layout(
    program: Program,
    cluster: Cluster,
    problem: IntraOpProblem,
    choice: tuple[int, ...],
    options: PlanOptions = PlanOptions(),
) -> Layout:
    """How the nodes of :func:`build_problem`'s problem of ``program`` map back to graph nodes,
    without pricing anything, for a program known to have ``problem`` (the step a folded step
    was folded from, :mod:`fxpar.ir.fold`) and to take ``choice`` of it: its decision nodes
    are checked against ``problem``'s by name, number of candidates and chosen strategy
    (:class:`~fxpar.errors.FxparError` where they differ)."""
    return _Builder(program, cluster, options).layout(problem, choice)


class _Builder:
    def __init__(self, program: Program, cluster: Cluster, options: PlanOptions) -> None:
        self.program = program
        self.cluster = cluster
        self.options = options
        self.units: list[_Unit] = []
        self.unit_of: dict[fx.Node, int] = {}
        self.names = {node: name for name, node in program.placeholders().items()}
        # Identical nodes (the same op on the same shapes, in every repeated layer) share
        # their candidates, compute times and follower responses: computed once.
        self._interned: dict[tuple[Strategy, ...], int] = {}
        self._compute_times: dict[tuple[object, ...], list[float]] = {}
        self._follow: dict[tuple[object, ...], list[int]] = {}
        self._identities: dict[fx.Node, tuple[object, ...]] = {}
        # Reshard prices are kept by small ints for specs: hashing a spec (a tuple of torch
        # placements) is slow, and the matrices price many pairs of the same specs.
        self._ids: dict[Spec, int] = {}
        self._codes: list[Code] = []
        self._tables: dict[Price, npt.NDArray[np.float64]] = {}
        self._lines: dict[tuple[object, ...], tuple[npt.NDArray[np.float64], ...]] = {}
        self._used_pins: set[str] = set()
        # The all-to-all exchanges of mixture-of-experts blocks whose tokens the plan
        # dispatches (each node of such a block has one candidate): priced with their nodes.
        # Under uneven routing (PlanOptions.expert_load) the busiest device's exchanges and
        # ops on its received rows take that many times an even share's; the load is recorded
        # on the program, so that the plan's other prices (its report) use it too.
        load = options.expert_load
        program.annotate(ExpertLoad(load))
        self._exchanges = exchange_seconds(program.graph, cluster, chosen=False, load=load)
        self._loaded = dispatched_ops(program.graph, chosen=False) if load != 1 else set()

    # -- units ----------------------------------------------------------------------------------

    def _pinned(self, node: fx.Node) -> list[int] | None:
        name = self.names.get(node, node.name)
        for pattern, spec in self.options.pins.items():
            if fnmatch.fnmatchcase(name, pattern):
                self._used_pins.add(pattern)
                allowed = [i for i, s in enumerate(candidates(node)) if s.outputs[0] == spec]
                if not allowed:
                    found = sorted({spec_str(s.outputs[0]) for s in candidates(node)})
                    raise FxparError(
                        f"pin {pattern!r} -> {spec_str(spec)} matches {name!r}, which cannot be "
                        f"laid out that way on {self.cluster}; its valid specs are {found}"
                    )
                return allowed
        return None

    def _source(self, node: fx.Node) -> tuple[fx.Node, int]:
        """The node producing ``node``'s value and which of its outputs it is."""
        if node.target is operator.getitem:
            return node.args[0], node.args[1]  # type: ignore[return-value]
        return node, 0

    def out_spec(self, node: fx.Node, choice: int) -> Spec:
        """The spec of ``node``'s value when its unit takes allowed choice ``choice``."""
        source, index = self._source(node)
        unit = self.units[self.unit_of[source]]
        if source is unit.root:
            strategy = candidates(source)[unit.allowed[choice]]
        else:
            strategy = candidates(source)[unit.follow[source][choice]]
        spec = strategy.outputs[index]
        assert spec is not None
        return spec

    def _make_units(self) -> None:
        for node in self.program.graph.nodes:
            if ir.get(node, Strategies) is None:
                continue
            pinned = self._pinned(node)
            inputs = tensor_inputs(node) if node.op != "placeholder" else []
            sources = [self._source(i)[0] for i in inputs]
            cast = ir.get(node, ir.PrecisionCast)
            follows = cast is not None and cast.follows_producer
            if (
                (self.options.coarsen or follows)
                and pinned is None
                and len(inputs) == 1
                and sources[0] in self.unit_of
            ):
                unit_index = self.unit_of[sources[0]]
                unit = self.units[unit_index]
                arriving = tuple(self.out_spec(inputs[0], c) for c in range(len(unit.allowed)))
                unit.members.append(node)
                unit.follow[node] = self._responses(node, inputs[0], arriving, exact=follows)
                self.unit_of[node] = unit_index
                continue
            allowed = pinned if pinned is not None else list(range(len(candidates(node))))
            self.unit_of[node] = len(self.units)
            self.units.append(_Unit(node, allowed))

    def _identity(self, node: fx.Node) -> tuple[object, ...]:
        if node not in self._identities:
            options = candidates(node)
            interned = self._interned.setdefault(options, len(self._interned))
            self._identities[node] = (str(node.target), ir.get(node, ir.Cost), interned)
        return self._identities[node]

    def _responses(
        self, node: fx.Node, incoming: fx.Node, arriving: tuple[Spec, ...], *, exact: bool
    ) -> list[int]:
        """The follower's cheapest strategy for each spec its input may arrive in; ``exact``:
        among those that take the input as it arrives, where there are any (a mixed-precision
        cast, :class:`fxpar.ir.PrecisionCast`)."""
        meta = ir.require(incoming, ir.ValueMeta).tensor
        key = (self._identity(node), arriving, meta, exact)
        if key not in self._follow:
            options = candidates(node)
            times = self._compute_vector(node)
            best: dict[Spec, int] = {}
            for spec in arriving:
                if spec in best:
                    continue
                choices = [t for t in range(len(options)) if options[t].inputs[0] == spec]
                if not exact or not choices:
                    choices = list(range(len(options)))
                best[spec] = min(
                    choices,
                    key=lambda t: (self._moved(spec, options[t].inputs[0], meta) + times[t], t),
                )
            self._follow[key] = [best[spec] for spec in arriving]
        return list(self._follow[key])

    def _moved(self, have: Spec, want: Spec, meta: ir.TensorMeta) -> float:
        terms = self._terms(self._spec_id(have), self._spec_id(want), "")
        nbytes = ir.evaluate(meta.nbytes)
        return min(seconds + per_byte * nbytes for seconds, per_byte in terms)

    def _spec_id(self, spec: Spec) -> int:
        found = self._ids.get(spec)
        if found is None:
            found = self._ids[spec] = len(self._codes)
            self._codes.append(spec_code(spec))
        return found

    def _terms(self, have: int, want: int, price: Price) -> Terms:
        """:func:`~fxpar.planning.cost.reshard_terms` of two specs by id."""
        table = self._table(price, max(have, want) + 1)
        if np.isnan(table[have, want, 0, 0]):
            codes = self._codes
            terms = reshard_terms(codes[have], codes[want], self.cluster, price)
            table = self._table(price, len(table), len(terms))
            # A pair of fewer lines repeats its last (the lowest of them is the same).
            table[have, want] = [terms[min(k, len(terms) - 1)] for k in range(table.shape[2])]
        return tuple(map(tuple, table[have, want].tolist()))

    def _table(self, price: Price, ids: int, lines: int = 1) -> npt.NDArray[np.float64]:
        """The price lines of every pair of spec ids priced as ``price`` so far (NaN where not
        yet priced), grown to hold at least ``ids`` ids and ``lines`` lines a pair."""
        table = self._tables.get(price)
        old, width = (0, 0) if table is None else (len(table), table.shape[2])
        if table is None or old < ids or width < lines:
            size = 2 * ids if old < ids else old
            grown = np.full((size, size, max(lines, width), 2), np.nan)
            if table is not None:
                grown[:old, :old, :width] = table
                grown[:old, :old, width:] = table[:, :, -1:]  # repeat the last line
            table = self._tables[price] = grown
        return table

    def _reshard_matrix(
        self, produced: list[Spec], required: list[Spec], meta: ir.TensorMeta, price: Price
    ) -> npt.NDArray[np.float64]:
        """Seconds to reshard ``meta`` from each produced spec to each required one, priced as
        the lowering sends it (``price``). A pair of specs has the same price lines for tensors
        of every size (:func:`~fxpar.planning.cost.reshard_terms`), so each pair is priced once
        and the lines of each distinct pair of spec lists are scaled by each tensor's bytes."""
        have_ids = tuple(self._spec_id(spec) for spec in produced)
        want_ids = tuple(self._spec_id(spec) for spec in required)
        key = (have_ids, want_ids, price)
        lines = self._lines.get(key)
        if lines is None:
            table = self._table(price, len(self._codes))
            haves, wants = sorted(set(have_ids)), sorted(set(want_ids))
            block = table[np.ix_(haves, wants)]
            for i, j in zip(*np.nonzero(np.isnan(block[..., 0, 0])), strict=True):
                self._terms(haves[i], wants[j], price)
            picked = self._tables[price][np.ix_(have_ids, want_ids)]
            lines = self._lines[key] = (picked[..., 0], picked[..., 1])
        seconds, per_byte = lines
        return (seconds + per_byte * ir.evaluate(meta.nbytes)).min(axis=-1)

    def _compute_vector(self, node: fx.Node) -> list[float]:
        key = self._identity(node)
        if key not in self._compute_times:
            cost = ir.get(node, ir.Cost)
            options = candidates(node)
            if cost is None or node.op == "placeholder":
                self._compute_times[key] = [0.0] * len(options)
            else:
                self._compute_times[key] = [compute_seconds(cost, s, self.cluster) for s in options]
        times = self._compute_times[key]
        if node in self._loaded:
            times = [seconds * self.options.expert_load for seconds in times]
        exchange = self._exchanges.get(node)
        if exchange:
            return [seconds + exchange for seconds in times]
        return times

    def _compute(self, node: fx.Node, index: int) -> float:
        return self._compute_vector(node)[index]

    # -- repeated layers -----------------------------------------------------------------------

    def _representatives(self) -> list[int]:
        representative = list(range(len(self.units)))
        if not self.options.dedup_layers:
            return representative
        instances: dict[tuple[str, str], list[int]] = defaultdict(list)
        for index, unit in enumerate(self.units):
            layer = numbered_layer(ir.require(unit.root, ir.Region).module)
            if layer is not None:
                instances[layer.container, layer.index].append(index)
        by_class: dict[str, list[tuple[str, list[int]]]] = defaultdict(list)
        for (container, layer_index), members in instances.items():
            by_class[container].append((layer_index, members))
        for layers in by_class.values():
            signatures: dict[tuple[object, ...], list[int]] = {}
            for _, members in layers:
                signature = tuple(self._signature(self.units[i]) for i in members)
                first = signatures.setdefault(signature, members)
                if first is not members:
                    for mine, theirs in zip(members, first, strict=True):
                        representative[mine] = theirs
        return representative

    def _signature(self, unit: _Unit) -> tuple[object, ...]:
        def describe(node: fx.Node) -> tuple[object, ...]:
            value = ir.require(node, ir.ValueMeta)
            target = "" if node.op == "placeholder" else str(node.target)
            return (node.op, target, value, ir.require(node, ir.Region).phase)

        return (
            describe(unit.root),
            tuple(unit.allowed),
            len(candidates(unit.root)),
            tuple((*describe(m), tuple(unit.follow[m])) for m in unit.members),
        )

    # -- costs -----------------------------------------------------------------------------------

    def _decisions(self) -> tuple[list[int], list[int], list[int]]:
        """Make the units; the unit each unit shares decisions with, the problem node of
        each unit, and the unit deciding for each problem node."""
        self._make_units()
        unused = sorted(set(self.options.pins) - self._used_pins)
        if unused:
            raise FxparError(
                f"pins {unused} match no parameter, buffer, input or node name; names look like "
                f"{list(self.names.values())[:3]} or node names such as 'addmm_1'"
            )
        representative = self._representatives()
        problem_of = {rep: i for i, rep in enumerate(sorted(set(representative)))}
        node_of_unit = [problem_of[representative[u]] for u in range(len(self.units))]
        return representative, node_of_unit, sorted(problem_of)

    def _stats(self, count: int, edges: int) -> dict[str, int]:
        return {
            "graph_nodes": sum(1 for _ in self.program.graph.nodes),
            "units": len(self.units),
            "decision_nodes": count,
            "layers_merged": len(self.units) - count,
            "edges": edges,
        }

    def layout(self, problem: IntraOpProblem, choice: tuple[int, ...]) -> Layout:
        """The units and their problem nodes, without costs, for a program whose problem is
        ``problem``: checked by node names and numbers of candidates, and by the strategy
        ``choice`` takes at each node."""
        _, node_of_unit, reps = self._decisions()
        names = tuple(self.units[r].root.name for r in reps)
        aux = problem.kinds[len(reps) :]
        if (
            names != problem.names[: len(reps)]
            or any(kind != SharedRead.KIND for kind in aux)
            or any(
                len(self.units[r].allowed) != len(strategies)
                for r, strategies in zip(reps, problem.strategies, strict=False)
            )
        ):
            raise FxparError(
                "the program's problem has other decisions than the plan's: "
                f"{len(names)} nodes against {problem.num_nodes}"
            )
        for r, picked, strategies in zip(reps, choice, problem.strategies, strict=False):
            unit = self.units[r]
            if candidates(unit.root)[unit.allowed[picked]] != strategies[picked]:
                raise FxparError(
                    f"cannot replay a plan on this program: {unit.root.name} has other candidates"
                )
        stats = self._stats(len(reps), len(problem.edges)) | {"shared_reads": len(aux)}
        shares = self._shares(problem.node_memory)
        return Layout(self.units, self.unit_of, node_of_unit, stats, shares=shares)

    def _shares(self, node_memory: Sequence[Sequence[float]]) -> bool:
        """Whether the problem prices a conversion its readers share once: by the device's
        memory, not a limit of the options, so that a plan is priced the same under any limit
        the planner tries on one cluster (:func:`shared_reads.shared_on`)."""
        hungriest = sum(map(max, node_memory))
        return shared_on(self.cluster.mesh_shape, hungriest, self.cluster.memory)

    def build(self) -> tuple[IntraOpProblem, Layout]:
        representative, node_of_unit, reps = self._decisions()
        count = len(reps)
        sizes = [len(self.units[r].allowed) for r in reps]
        node_costs = [[0.0] * n for n in sizes]
        node_memory = [[0.0] * n for n in sizes]
        saved = saved_outputs(self.program.graph.nodes)
        # A folded step's node may stand for several of the step's (fxpar.ir.fold): what a
        # unit costs, keeps and reads counts that many times.
        multiplicity = self.program.get(Multiplicity)
        weight = [
            1 if multiplicity is None else multiplicity.of(ir.require(unit.root, ir.Region).module)
            for unit in self.units
        ]
        unit_cost_cache: dict[int, tuple[list[float], list[float]]] = {}
        for u in range(len(self.units)):
            rep = representative[u]
            if rep not in unit_cost_cache:
                unit_cost_cache[rep] = self._unit_costs(self.units[rep], saved)
            costs, memory = unit_cost_cache[rep]
            target = node_of_unit[u]
            for s in range(sizes[target]):
                node_costs[target][s] += weight[u] * costs[s]
                node_memory[target][s] += weight[u] * memory[s]
        edge_sums: dict[tuple[int, int], npt.NDArray[np.float64]] = {}

        def add_edge(u: int, v: int, matrix: npt.NDArray[np.float64]) -> None:
            if (u, v) in edge_sums:
                edge_sums[u, v] += matrix
            else:
                edge_sums[u, v] = matrix.copy()

        matrix_cache: dict[tuple[object, ...], npt.NDArray[np.float64]] = {}
        shares = self._shares(node_memory)
        # Reads of a value that converts once for all its readers (shared_reads), with the
        # layout each strategy of the reader requires, by the value read.
        required_cache: dict[tuple[object, ...], tuple[int, ...] | None] = {}
        reads: dict[fx.Node, tuple[int, list[Read]]] = {}
        for source, consumer_unit, spec_of_choice, meta, key in self._dependencies(representative):
            v = node_of_unit[consumer_unit]
            if self._source(source)[0] not in self.unit_of:
                # A constant of the graph (get_attr): replicated, not a decision.
                if consumer_unit == representative[consumer_unit]:
                    for t in range(sizes[v]):
                        node_costs[v][t] += weight[consumer_unit] * reshard_seconds(
                            replicated(self.cluster.ndim), spec_of_choice(t), meta, self.cluster
                        )
                continue
            u = node_of_unit[self.unit_of[self._source(source)[0]]]
            if key not in matrix_cache:
                produced = [self.out_spec(source, s) for s in range(sizes[u])]
                required = [spec_of_choice(t) for t in range(sizes[v])]
                price: Price = "output" if key[0] in ("output", "gradient") else ""
                parameter = holds_parameter(source)
                if parameter and reread_in_backward(self.units[consumer_unit].root):
                    price = "regathered"
                matrix_cache[key] = self._reshard_matrix(produced, required, meta, price)
                if key[0] == "gradient" and self.options.gradient_share != 1:
                    matrix_cache[key] = matrix_cache[key] * self.options.gradient_share
                # A parameter converts again in each phase, and the step's results once each.
                shared = shares and price == "" and not parameter
                shared = shared and key[0] not in ("output", "gradient")
                required_cache[key] = tuple(map(self._spec_id, required)) if shared else None
            wanted = required_cache[key]
            if wanted is not None and u != v:
                group = reads.setdefault(source, (u, []))[1]
                group.append(Read(v, matrix_cache[key], wanted, weight[consumer_unit]))
                continue
            matrix = matrix_cache[key]
            if weight[consumer_unit] != 1:
                matrix = weight[consumer_unit] * matrix
            if u == v:
                for s in range(sizes[u]):
                    node_costs[u][s] += float(matrix[s, s])
                continue
            add_edge(u, v, matrix)
        shared_reads: list[SharedRead] = []
        for source, (u, found) in reads.items():
            matrices, decisions = share_reads(u, found, source.name)
            for read, matrix in zip(found, matrices, strict=True):
                add_edge(u, read.reader, matrix if read.weight == 1 else read.weight * matrix)
            shared_reads += decisions
        shared_reads = merge(shared_reads)
        for index, decision in enumerate(shared_reads):
            for a, b, matrix in decision.edges(count + index, sizes):
                add_edge(a, b, matrix)
        loss = _results(self.program)[0]
        loss_unit = node_of_unit[self.unit_of[self._source(loss)[0]]]
        loss_meta = ir.require(loss, ir.ValueMeta).tensor
        for s in range(sizes[loss_unit]):
            node_costs[loss_unit][s] += output_seconds(
                self.out_spec(loss, s), replicated(self.cluster.ndim), loss_meta, self.cluster
            )
        edges = tuple(
            Edge(u, v, tuple(map(tuple, matrix.tolist())))
            for (u, v), matrix in sorted(edge_sums.items())
            if matrix.any()
        )
        memory_limit = self.options.memory_limit
        aux = len(shared_reads)
        problem = IntraOpProblem(
            node_costs=(*(tuple(c) for c in node_costs), *((0.0, 0.0),) * aux),
            node_memory=(*(tuple(m) for m in node_memory), *((0.0, 0.0),) * aux),
            edges=edges,
            memory_limit=self.cluster.memory if memory_limit is None else memory_limit,
            names=(
                *(self.units[r].root.name for r in reps),
                *(f"{read.name} converted once" for read in shared_reads),
            ),
            strategies=(
                *(
                    tuple(candidates(self.units[r].root)[c] for c in self.units[r].allowed)
                    for r in reps
                ),
                *((SharedRead.STRATEGIES,) * aux),
            ),
            kinds=(*(self._kind(self.units[r].root) for r in reps), *(SharedRead.KIND,) * aux),
            mesh_shape=self.cluster.mesh_shape,
        )
        stats = self._stats(count, len(edges)) | {"shared_reads": aux}
        layout = Layout(self.units, self.unit_of, node_of_unit, stats, tuple(shared_reads), shares)
        return problem, layout

    def _unit_costs(
        self, unit: _Unit, saved: Mapping[fx.Node, frozenset[int]]
    ) -> tuple[list[float], list[float]]:
        costs, memory = [], []
        root = unit.root
        for choice, index in enumerate(unit.allowed):
            cost = self._compute(root, index)
            bytes_kept = self._memory(root, candidates(root)[index], saved)
            for member in unit.members:
                member_index = unit.follow[member][choice]
                strategy = candidates(member)[member_index]
                incoming = tensor_inputs(member)[0]
                meta = ir.require(incoming, ir.ValueMeta).tensor
                cost += self._compute(member, member_index)
                cost += reshard_seconds(
                    self.out_spec(incoming, choice), strategy.inputs[0], meta, self.cluster
                )
                bytes_kept += self._memory(member, strategy, saved)
            costs.append(cost)
            memory.append(bytes_kept)
        return costs, memory

    def _memory(
        self, node: fx.Node, strategy: Strategy, saved: Mapping[fx.Node, frozenset[int]]
    ) -> float:
        value = ir.require(node, ir.ValueMeta)
        if node.op == "placeholder":
            spec = strategy.outputs[0]
            assert spec is not None
            trainable = self.names.get(node) in self.program.signature.gradients
            nbytes = local_bytes(value.tensor, spec, self.cluster)
            return sum(parameter_memory(nbytes, trainable, self.options.optimizer_states).values())
        if node not in saved:
            return 0.0
        return float(saved_bytes(value, strategy.outputs, saved[node], self.cluster))

    def _dependencies(
        self, representative: list[int]
    ) -> Iterator[tuple[fx.Node, int, Callable[[int], Spec], ir.TensorMeta, tuple[object, ...]]]:
        """(source node, consumer unit, spec required per consumer choice, meta, cache key) for
        every tensor a unit root reads from another unit, and every output requirement."""
        for u, unit in enumerate(self.units):
            root = unit.root
            if root.op == "placeholder":
                continue
            for position, source in enumerate(tensor_inputs(root)):
                producer, _ = self._source(source)
                meta = ir.require(source, ir.ValueMeta).tensor

                def required(t: int, unit: _Unit = unit, position: int = position) -> Spec:
                    return candidates(unit.root)[unit.allowed[t]].inputs[position]

                key: tuple[object, ...] = (
                    representative[self.unit_of[producer]] if producer in self.unit_of else None,
                    self._position(source) if producer in self.unit_of else None,
                    representative[u],
                    position,
                )
                yield source, u, required, meta, key
        placeholders = self.program.placeholders()
        signature = self.program.signature
        state = signature.gradients + signature.buffer_updates
        results = _results(self.program)[len(signature.outputs) :]
        for index, (name, result) in enumerate(zip(state, results, strict=True)):
            target_unit = self.unit_of[placeholders[name]]
            meta = ir.require(result, ir.ValueMeta).tensor

            def required_layout(t: int, unit: _Unit = self.units[target_unit]) -> Spec:
                spec = candidates(unit.root)[unit.allowed[t]].outputs[0]
                assert spec is not None
                return spec

            producer, _ = self._source(result)
            key = (
                "gradient" if index < len(signature.gradients) else "output",
                representative[self.unit_of[producer]],
                self._position(result),
                representative[target_unit],
            )
            yield result, target_unit, required_layout, meta, key

    def _kind(self, node: fx.Node) -> str:
        """What a problem node is, for :attr:`IntraOpProblem.kinds`."""
        if node.op != "placeholder":
            return str(node.target)
        name = self.names[node]
        signature = self.program.signature
        if name in signature.parameters:
            return "parameter"
        if name in signature.buffers:
            return "buffer"
        return "input" if name in signature.inputs else "random"

    def _position(self, node: fx.Node) -> tuple[int, int]:
        """Where a value sits inside its unit: (member index, output index)."""
        source, index = self._source(node)
        unit = self.units[self.unit_of[source]]
        member = -1 if source is unit.root else unit.members.index(source)
        return member, index


def _results(program: Program) -> list[fx.Node]:
    """The output node's values: loss (or a forward's outputs), gradients, buffer updates."""
    return list(program.graph.output_node().args[0])  # type: ignore[arg-type]


def apply_solution(program: Program, layout: Layout, choice: tuple[int, ...]) -> Program:
    """Annotate every node of every unit with the strategy ``choice`` implies."""
    for u, unit in enumerate(layout.units):
        picked = choice[layout.representative[u]]
        ir.annotate(unit.root, Sharding(candidates(unit.root)[unit.allowed[picked]]))
        for member in unit.members:
            ir.annotate(member, Sharding(candidates(member)[unit.follow[member][picked]]))
    return program


def _holds(node: fx.Node, strategy: Strategy) -> bool:
    """Whether ``node``'s Sharding annotation is ``strategy``."""
    sharding = ir.get(node, Sharding)
    return sharding is not None and (sharding.strategy is strategy or sharding.strategy == strategy)


def assignment_of(program: Program, layout: Layout) -> tuple[int, ...] | None:
    """The problem choice matching the Sharding annotations of ``program`` (for comparing a
    manual plan under the same cost model), or None if some unit's annotations are not one of
    its choices."""
    choice: dict[int, int] = {}
    # Where each strategy sits among a node's candidates (identical nodes share the tuple),
    # by identity first: plans annotate the candidates themselves, and comparing or hashing
    # a strategy's torch placements is slow.
    where: dict[int, dict[int, list[int]]] = {}
    equal: dict[tuple[int, int], set[int]] = {}
    for u, unit in enumerate(layout.units):
        sharding = ir.get(unit.root, Sharding)
        if sharding is None:
            return None
        options_of = candidates(unit.root)
        if id(options_of) not in where:
            by_id: dict[int, list[int]] = defaultdict(list)
            for index, strategy in enumerate(options_of):
                by_id[id(strategy)].append(index)
            where[id(options_of)] = by_id
        # Every candidate equal to the annotated strategy (a rule may list one twice).
        found = where[id(options_of)].get(id(sharding.strategy))
        if found is None:  # an equal strategy, not one of the candidates themselves
            at = {i for i, c in enumerate(options_of) if c == sharding.strategy}
        else:
            key = (id(options_of), found[0])
            if key not in equal:
                equal[key] = {i for i, c in enumerate(options_of) if c == sharding.strategy}
            at = equal[key]
        if len(unit.allowed) == len(options_of):  # every candidate allowed, in order
            options = sorted(at)
        else:
            options = [i for i, c in enumerate(unit.allowed) if c in at]
        options = [
            i
            for i in options
            if all(_holds(m, candidates(m)[unit.follow[m][i]]) for m in unit.members)
        ]
        if not options:
            return None
        node = layout.representative[u]
        if choice.setdefault(node, options[0]) not in options:
            return None
    return layout.completed(tuple(choice[i] for i in range(len(choice))))
