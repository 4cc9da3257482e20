"""Choose one strategy for every node: by a solver, or by a hand-written plan.

Both passes are called ``choose-strategies``, so either can stand in the pipeline's slot for
the choice (``default_passes().replace("choose-strategies", ApplyManualPlan(data_parallel))``).
Both leave a :class:`~fxpar.sharding.Sharding` on every node that needs one and record the
choice as a program-level :class:`ChosenStrategies`: the plain-data problem, the answer and how
problem nodes map back to graph nodes, which :class:`fxpar.Plan` reads.

- :class:`SolveStrategies` builds the intra-op problem (repeated layers merged, see
  :mod:`fxpar.planning.problem`), with the hand-written plans as its starting plans, and hands
  it to a solver: the HiGHS ILP by default, or any object with
  ``solve(IntraOpProblem) -> IntraOpSolution`` (:mod:`fxpar.solvers`).
- :class:`ApplyPlanFile` gives every node its strategy from a plan saved by
  :meth:`fxpar.Plan.save` (:mod:`fxpar.planning.plan_file`), checked against its candidates.
- :class:`ApplyManualPlan` runs a manual plan (``fxpar.plans.data_parallel`` or any function
  ``(Program, Cluster) -> Program`` that annotates every node) and scores it under the same
  cost model, on the exact problem (no coarsening, no merged layers, so that any assignment is
  one of its choices), so plans from both can be compared.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch.fx as fx

from fxpar import ir
from fxpar.cluster import Cluster
from fxpar.errors import FxparError, LoweringError
from fxpar.ir.fold import fold
from fxpar.ir.program import Program
from fxpar.passes.base import Pass
from fxpar.passes.remat import recompute_in_backward, saved_bytes_by_layer
from fxpar.planning.dispatch_variants import (
    DispatchVariant,
    block_strategies,
    dispatch_variants,
    offer,
    pinned_nodes,
    planned_variant,
    restore,
    variants_with_tokens,
)
from fxpar.planning.moe_blocks import find_blocks
from fxpar.planning.peak_memory import PeakMemory, peak_memory
from fxpar.planning.plan import ChosenStrategies, Plan
from fxpar.planning.plan_file import PlanFileError, apply_plan, parse_spec, read_plan
from fxpar.planning.problem import (
    Layout,
    PlanOptions,
    apply_solution,
    assignment_of,
    build_layout,
    build_problem,
)
from fxpar.planning.propagate import expert_parallel, starting_plans
from fxpar.planning.rank_zero import SolvedOnRankZero
from fxpar.sharding import Sharding, Strategies, Strategy, spec_str
from fxpar.solvers.errors import InfeasiblePlanError, NoPlanFoundError, format_bytes
from fxpar.solvers.ilp import ILPSolver
from fxpar.solvers.problem import IntraOpProblem, IntraOpSolution, IntraOpSolver

logger = logging.getLogger(__name__)

ManualPlan = Callable[[Program, Cluster], Program]
"""A hand-written plan: annotates every node of a Program with its strategy for a cluster."""


@dataclass(frozen=True)
class SolveStrategies(Pass):
    """Build the intra-op problem of the Program on ``program.cluster`` and let ``solver``
    choose (the HiGHS ILP when None).

    ``on_rank_zero``: solve on rank 0 only and broadcast the answer, so that every rank lowers
    the same plan (:func:`fxpar.compile` sets it; planning in one process needs nothing)."""

    name = "choose-strategies"
    solver: IntraOpSolver | None = None
    options: PlanOptions = field(default_factory=PlanOptions)
    on_rank_zero: bool = False

    def __post_init__(self) -> None:
        if self.solver is not None and not callable(getattr(self.solver, "solve", None)):
            hint = ""
            if callable(self.solver):
                hint = (
                    f"; {getattr(self.solver, '__name__', self.solver)!r} looks like a manual "
                    "plan: pass it as manual= (fxpar.plan, fxpar.compile, default_passes) or "
                    "use ApplyManualPlan"
                )
            raise FxparError(
                "a solver is an object with solve(IntraOpProblem) -> IntraOpSolution "
                f"(see fxpar.solvers), got {type(self.solver).__name__}{hint}"
            )

    def run(self, program: Program) -> Program:
        cluster = program.require_cluster(f"the {self.name!r} pass")
        if self.options.remat == "auto":
            return self._remat_and_plan(program, cluster)
        return self._plan(program, cluster, *build_problem(program, cluster, self.options))

    def _plan(
        self,
        program: Program,
        cluster: Cluster,
        problem: IntraOpProblem,
        layout: Layout,
        solved: IntraOpSolution | None = None,
    ) -> Program:
        """The cheapest plan of ``problem`` and of each way of dispatching the program's
        mixture-of-experts tokens by all-to-all (:mod:`fxpar.planning.dispatch_variants`):
        each variant is a problem of its own, the blocks' nodes offered only their dispatch
        strategies, solved like ``problem`` and priced by the same cost model; a variant with
        no plan under the memory limit is left out. The program is left annotated with the
        winner's candidates and choice. A program without MoE blocks is solved once, as
        ``problem``. ``solved``: ``problem``'s answer, already found."""
        blocks, _ = find_blocks(program.graph)
        variants = dispatch_variants(blocks, cluster) if self.options.moe_dispatch else []
        if not variants:
            problem, solution = self._solved(program, cluster, problem, layout, solved)
            return self._chosen(program, problem, layout, solution)
        best: _Solved | None = None
        failure: FxparError | None = None
        try:
            plain = self._solved(program, cluster, problem, layout, solved)
            best = _Solved(None, {}, layout, *plain)
            best.log()
        except (InfeasiblePlanError, NoPlanFoundError) as error:
            logger.info("no MoE dispatch: %s", error)
            failure = error
        for variant in variants:
            chosen = block_strategies(blocks, variant, cluster)
            assert chosen is not None  # dispatch_variants lists only variants that split evenly
            pinned = pinned_nodes(chosen, self.options.pins)
            if pinned:
                logger.info("%s: not tried, pins name its node %s", variant, pinned[0])
                continue
            replaced = offer(chosen, cluster)
            try:
                trial_problem, trial_layout = build_problem(program, cluster, self.options)
                solved_trial = self._solved(
                    program, cluster, trial_problem, trial_layout, dispatch=(variant, chosen)
                )
                trial = _Solved(variant, chosen, trial_layout, *solved_trial)
            except (InfeasiblePlanError, NoPlanFoundError) as error:
                logger.info("%s: %s", variant, error)
                failure = failure or error
                continue
            finally:
                restore(replaced)
            trial.log()
            if best is None or trial.solution.objective < best.solution.objective:
                best = trial
        if best is None:
            assert failure is not None
            raise failure
        offer(best.chosen, cluster)
        apply_solution(program, best.layout, best.solution.choice)
        return self._chosen(program, best.problem, best.layout, best.solution)

    def _solved(
        self,
        program: Program,
        cluster: Cluster,
        problem: IntraOpProblem,
        layout: Layout,
        solved: IntraOpSolution | None = None,
        dispatch: _Dispatch | None = None,
    ) -> tuple[IntraOpProblem, IntraOpSolution]:
        """``problem`` (with the starts it was given) and its answer within the memory limit
        (:meth:`_within_peak`), which the program is left annotated with. ``dispatch``: the
        variant ``problem`` was built for, and the strategies it offers."""
        if solved is None:
            problem, solved = self._solve(program, cluster, problem, layout, dispatch)
        apply_solution(program, layout, solved.choice)
        return problem, self._within_peak(program, problem, layout, solved)

    def _solve(
        self,
        program: Program,
        cluster: Cluster,
        problem: IntraOpProblem,
        layout: Layout,
        dispatch: _Dispatch | None,
    ) -> tuple[IntraOpProblem, IntraOpSolution]:
        # The hand-written plans start the solver, so that it never answers worse than they
        # do. Propagating them costs about as much as solving a problem of a few thousand
        # choices (a second per stage mesh of Llama-3-70B), which the solver proves optimal
        # on its own: such a problem gets them only if its answer is not proven optimal.
        early = self.options.manual_starts and _choices(problem) > LAZY_STARTS
        if early:
            problem = replace(problem, starts=_starts(program, cluster, layout, dispatch))
        solver = self._solver()
        retry = self.options.manual_starts and not early
        solution = _solve(solver, problem, retry=retry)
        if retry and (solution is None or solution.status != "optimal"):
            problem = replace(problem, starts=_starts(program, cluster, layout, dispatch))
            if solution is None or problem.starts:
                solution = solver.solve(problem)
        assert solution is not None
        return problem, solution

    def _chosen(
        self, program: Program, problem: IntraOpProblem, layout: Layout, solution: IntraOpSolution
    ) -> Program:
        program.annotate(ChosenStrategies(problem, solution, layout, self.options))
        return program

    def _within_peak(
        self, program: Program, problem: IntraOpProblem, layout: Layout, solution: IntraOpSolution
    ) -> IntraOpSolution:
        """``solution``, or one solved again, whose peak on a device stays under the memory
        limit (applied to ``program``).

        The solver bounds the problem's memory row, a sum over nodes that is no moment of the
        step: it holds every gradient with every saved activation at once (too much for data
        parallelism), and misses the copies the plan's collectives make (too little for a
        fully sharded layer's gathered weights). Where the row comes within a quarter of the
        limit, the chosen plan's peak is walked through its collective schedule
        (:func:`fxpar.planning.peak_memory.peak_memory`). Over the limit, the problem is
        solved again with its row bounded by the limit scaled by the row over the peak, up to
        :data:`PEAK_ROUNDS` times; a plan that still does not fit is an
        :class:`~fxpar.solvers.errors.InfeasiblePlanError`. Under it with the row at the
        bound (:data:`RELAX_SHARE`), the problem is solved once more with the bound scaled up
        the same way (the row may have kept out a faster plan that fits), and such a plan is
        taken if its walked peak fits."""
        limit = problem.memory_limit
        if limit is None or not math.isfinite(limit):
            return solution
        if problem.memory(solution.choice) < ROW_SHARE * limit:
            return solution
        cluster = program.require_cluster(f"the {self.name!r} pass")
        states = self.options.optimizer_states
        try:
            peak = peak_memory(program, cluster, optimizer_states=states)
        except LoweringError:  # symbolic shapes: no bytes to walk
            return solution
        solver = self._solver()
        for _ in range(PEAK_ROUNDS):
            if peak.peak_bytes <= limit:
                break
            bound = problem.memory(solution.choice) * limit / peak.peak_bytes
            logger.info(
                "the plan's peak, %s after %s, is over the limit %s: solving again with the "
                "memory row under %s", format_bytes(peak.peak_bytes), peak.peak_node,
                format_bytes(limit), format_bytes(bound),
            )  # fmt: skip
            try:
                solution = solver.solve(replace(problem, memory_limit=bound))
            except InfeasiblePlanError as error:
                raise _over_peak(peak, limit) from error
            apply_solution(program, layout, solution.choice)
            peak = peak_memory(program, cluster, optimizer_states=states)
        if peak.peak_bytes > limit:
            raise _over_peak(peak, limit)
        row = problem.memory(solution.choice)
        if row < RELAX_SHARE * limit or peak.peak_bytes == limit:
            return solution  # the row did not decide the plan
        try:
            relaxed = solver.solve(replace(problem, memory_limit=row * limit / peak.peak_bytes))
        except FxparError:  # no plan under the wider bound in time: keep the one found
            return solution
        if relaxed.objective < solution.objective:
            apply_solution(program, layout, relaxed.choice)
            if peak_memory(program, cluster, optimizer_states=states).peak_bytes <= limit:
                return relaxed
            apply_solution(program, layout, solution.choice)
        return solution

    def _solver(self) -> IntraOpSolver:
        solver: IntraOpSolver = self.solver if self.solver is not None else ILPSolver()
        return SolvedOnRankZero(solver) if self.on_rank_zero else solver

    def _remat_and_plan(self, program: Program, cluster: Cluster) -> Program:
        """``remat="auto"``: which layers to recompute, chosen with the sharding by price.

        Recomputing layers frees their activations and costs their forward again; the memory
        it frees may let a plan with less communication fit. Layers are taken in order of the
        activation bytes they keep (most first), so a choice is a count. The count the plan
        needs at least is found by bisection on the most frugal plan's memory; then the
        problem of each of at most :data:`REMAT_TRIALS` counts from there up to every layer
        is built and solved, and the plan of least step time wins (the fewer layers on a
        tie). Where the plan of least time without remat fits, or there is no memory limit,
        nothing is recomputed: remat would only add work."""
        problem, layout = build_problem(program, cluster, self.options)
        limit = problem.memory_limit
        by_bytes = saved_bytes_by_layer(program)
        order = sorted(by_bytes, key=lambda layer: -by_bytes[layer])
        if limit is None or not order:
            return self._plan(program, cluster, problem, layout)
        frugal_fits = problem.least_memory() <= limit
        if frugal_fits:
            fastest = self._solver().solve(replace(problem, memory_limit=None))
            if problem.memory(fastest.choice) <= limit:
                if fastest.status == "optimal":  # optimal without the limit, so with it too
                    return self._plan(program, cluster, problem, layout, solved=fastest)
                return self._plan(program, cluster, problem, layout)
        pristine = program.copy()
        built = {0: (program, problem, layout)}

        def recomputing(count: int) -> tuple[Program, IntraOpProblem, Layout]:
            if count not in built:
                trial = recompute_in_backward(pristine.copy(), order[:count])
                built[count] = (trial, *build_problem(trial, cluster, self.options))
            return built[count]

        least, high = (0, 0) if frugal_fits else (1, len(order))
        while least < high:  # the fewest layers with which the most frugal plan fits
            middle = (least + high) // 2
            if recomputing(middle)[1].least_memory() <= limit:
                high = middle
            else:
                least = middle + 1
        best: tuple[float, Program] | None = None
        for count in remat_counts(least, len(order)):
            trial, trial_problem, trial_layout = recomputing(count)
            if trial_problem.least_memory() > limit:
                continue
            try:
                planned = self._plan(trial, cluster, trial_problem, trial_layout)
            except InfeasiblePlanError:  # its row fits, its walked peak does not
                continue
            objective = planned.require(ChosenStrategies).solution.objective
            logger.info("remat of %d of %d layers: %.6g s per step", count, len(order), objective)
            if best is None or objective < best[0]:
                best = (objective, planned)
        if best is None:  # no count fits: the solver explains with every layer recomputed
            trial, trial_problem, trial_layout = recomputing(len(order))
            return self._plan(trial, cluster, trial_problem, trial_layout)
        return best[1]


@dataclass(frozen=True)
class _Solved:
    """One problem :meth:`SolveStrategies._plan` solved: the dispatch variant it was built
    for (None: the blocks as planned op by op), the block strategies that variant offers,
    the problem and its answer."""

    variant: DispatchVariant | None
    chosen: dict[fx.Node, Strategy]
    layout: Layout
    problem: IntraOpProblem
    solution: IntraOpSolution

    def log(self) -> None:
        label = "no MoE dispatch" if self.variant is None else str(self.variant)
        solution = self.solution
        logger.info(
            "%s: %.6g s per step (%s, solved in %.1f s)",
            label, solution.objective, solution.status, solution.seconds,
        )  # fmt: skip


PEAK_ROUNDS = 3
"""How many times a plan whose walked peak is over the memory limit is solved again."""
ROW_SHARE = 0.25
"""A plan whose memory row is below this share of the limit is not walked: the ILP's memory
row counts most of what the walk finds (the values alive at the peak, less the conversions'
short-lived buffers), so a row this far under the limit leaves the walked peak under it too;
benchmarks/cost_model.py compares the two."""
RELAX_SHARE = 0.95
"""A plan under the limit whose row is at least this share of it was chosen with the row
bound deciding: it is solved once more with the bound widened."""


def _over_peak(peak: PeakMemory, limit: float) -> InfeasiblePlanError:
    largest = ", ".join(f"{name} {format_bytes(nbytes)}" for name, nbytes in peak.largest)
    return InfeasiblePlanError(
        f"no sharding plan found keeps its peak under the memory limit of "
        f"{format_bytes(limit)} per device: the last one tried holds "
        f"{format_bytes(peak.peak_bytes)} at once after {peak.peak_node} (the inputs "
        f"{format_bytes(peak.input_bytes)}; the largest values besides: {largest}). Use more "
        "devices, raise the memory limit, or rematerialize activations (remat='auto').",
        least_memory=peak.peak_bytes,
        memory_limit=limit,
    )


REMAT_TRIALS = 6
"""How many remat counts ``remat="auto"`` prices with a solved plan each (the fewest layers
that fit, a few more growing geometrically, and every layer)."""


def remat_counts(least: int, layers: int, trials: int = REMAT_TRIALS) -> list[int]:
    """The remat counts ``remat="auto"`` tries, from ``least`` up to ``layers``: all of them
    when there are at most ``trials``, else ``least``, ``least`` + 1, + 2, + 4, ... and
    ``layers``."""
    if layers - least < trials:
        return list(range(least, layers + 1))
    counts = {least, layers}
    step = 1
    while len(counts) < trials and least + step < layers:
        counts.add(least + step)
        step *= 2
    return sorted(counts)


@dataclass(frozen=True)
class ReplayStrategies(Pass):
    """Give every node the strategy ``plan`` chose, on a program whose intra-op problem is
    ``plan``'s: the step that ``plan``'s program was folded from (:mod:`fxpar.ir.fold`), whose
    problem is the folded one's entry for entry. Nothing is priced or solved: the program's
    decisions are matched to the plan's by node name and candidates (a mismatch raises
    :class:`~fxpar.errors.FxparError`), and the plan's problem and answer are recorded."""

    name = "choose-strategies"
    plan: Plan
    options: PlanOptions = field(default_factory=PlanOptions)

    def run(self, program: Program) -> Program:
        cluster = program.require_cluster(f"the {self.name!r} pass")
        problem, solution = self.plan.problem, self.plan.solution
        # The plan's MoE blocks dispatched (its problem offered their nodes one strategy
        # each): so are the program's, to have the plan's decisions.
        variant = planned_variant(find_blocks(self.plan.program.graph)[0])
        if variant is not None:
            chosen = block_strategies(find_blocks(program.graph)[0], variant, cluster)
            if chosen is None:
                raise FxparError(f"cannot replay a plan with {variant} on this program")
            offer(chosen, cluster)
        layout = build_layout(program, cluster, problem, solution.choice, self.options)
        apply_solution(program, layout, solution.choice)
        program.annotate(ChosenStrategies(problem, solution, layout, self.options))
        return program


@dataclass(frozen=True)
class SolveFolded(Pass):
    """``solve``'s choice for a stamped step, made on the step folded to its distinct layers
    (:mod:`fxpar.ir.fold`: the same problem on a fraction of the nodes) and given to the step
    by :class:`ReplayStrategies`; a step that does not fold is solved as it is."""

    name = "choose-strategies"
    solve: SolveStrategies

    def run(self, program: Program) -> Program:
        folded = fold(program)
        if folded is None:
            return self.solve.run(program)
        plan = Plan.of(self.solve.run(folded.program))
        return ReplayStrategies(plan, self.solve.options).run(program)


@dataclass(frozen=True)
class ApplyManualPlan(Pass):
    """Choose every node's strategy with the manual plan ``plan`` and score it by the cost
    model; ``options`` give the memory model's optimizer state count (pins do not apply)."""

    name = "choose-strategies"
    plan: ManualPlan
    options: PlanOptions = field(default_factory=PlanOptions)

    def run(self, program: Program) -> Program:
        cluster = program.require_cluster(f"the {self.name!r} pass")
        start = time.perf_counter()
        program = self.plan(program, cluster)
        exact = replace(self.options, coarsen=False, dedup_layers=False, pins={})
        problem, layout = build_problem(program, cluster, exact)
        choice = assignment_of(program, layout)
        label = getattr(self.plan, "__name__", "manual")
        if choice is None:
            raise FxparError(f"the manual plan {label!r} {_first_misfit(program)}")
        solution = IntraOpSolution(
            choice, problem.objective(choice), "feasible", math.nan, label,
            time.perf_counter() - start,
        )  # fmt: skip
        program.annotate(ChosenStrategies(problem, solution, layout, exact))
        return program


@dataclass(frozen=True)
class ApplyPlanFile(Pass):
    """Choose every node's strategy as the plan file at ``path`` says, without solving.
    ``document``: the plan file's content, already read (a stage mesh's plan inside a
    pipeline plan file, :mod:`fxpar.pipeline.pipeline_plan`); ``path`` then only names it in
    errors."""

    name = "choose-strategies"
    path: str | Path
    document: Mapping[str, Any] | None = field(default=None, compare=False)

    def run(self, program: Program) -> Program:
        cluster = program.require_cluster(f"the {self.name!r} pass")
        document = dict(self.document) if self.document is not None else read_plan(self.path)
        try:
            problem, solution, layout, options = apply_plan(program, cluster, document, self.path)
        except PlanFileError as error:
            applied = _dispatched(program, cluster, document, self.path)
            if applied is None:
                raise
            logger.debug("the plan file dispatches its MoE tokens (%s)", error)
            problem, solution, layout, options = applied
        program.annotate(ChosenStrategies(problem, solution, layout, options))
        return program


def _dispatched(
    program: Program, cluster: Cluster, document: dict[str, Any], path: str | Path
) -> tuple[IntraOpProblem, IntraOpSolution, Layout, PlanOptions] | None:
    """The plan file's strategies applied to ``program`` with its MoE blocks' tokens
    dispatched as the file's strategy for their sort says (the blocks' nodes offered their
    dispatch strategies, which no rule gives them, as the plan that was saved had them);
    None where the file dispatches nothing. Raises the last variant's PlanFileError where
    the file dispatches but fits none."""
    blocks, _ = find_blocks(program.graph)
    strategies = document.get("strategies")
    if not blocks or not isinstance(strategies, dict):
        return None
    entry = strategies.get(blocks[0].sort.name)
    if (
        not isinstance(entry, dict)
        or not isinstance(entry.get("inputs"), list)
        or not entry["inputs"]
    ):
        return None
    try:
        token_spec = parse_spec(entry["inputs"][0], cluster.ndim)
    except PlanFileError:  # the file's own error says what is wrong with it
        return None
    failure: PlanFileError | None = None
    for variant in variants_with_tokens(token_spec):
        chosen = block_strategies(blocks, variant, cluster)
        if chosen is None:
            continue
        replaced = offer(chosen, cluster)
        try:
            return apply_plan(program, cluster, document, path)
        except PlanFileError as error:  # the experts on another of its axes, or a misfit
            restore(replaced)
            failure = error
    if failure is not None:
        raise failure
    return None


LAZY_STARTS = 8000
"""Problems of at most this many choices (strategies summed over the decisions) are solved
before the hand-written plans are made into starts, and again from them only if the first
answer is not proven optimal."""


def _solve(
    solver: IntraOpSolver, problem: IntraOpProblem, *, retry: bool
) -> IntraOpSolution | None:
    """The solver's answer; None where it found no plan and will be asked again with the
    hand-written plans as starts (``retry``)."""
    try:
        return solver.solve(problem)
    except NoPlanFoundError:
        if not retry:
            raise
        return None


def _choices(problem: IntraOpProblem) -> int:
    return sum(len(costs) for costs in problem.node_costs)


_Dispatch = tuple[DispatchVariant, dict[fx.Node, Strategy]]
"""A dispatch variant and the strategies it offers the nodes of the program's MoE blocks."""


def _starts(
    program: Program, cluster: Cluster, layout: Layout, dispatch: _Dispatch | None = None
) -> tuple[tuple[int, ...], ...]:
    """The hand-written plans as choices of the problem laid out by ``layout``; a plan the
    problem cannot express (one that breaks a pin, or gives repeated layers different
    strategies) is left out. A problem built for a ``dispatch`` variant also starts from
    ``plans.expert_parallel(dispatch="all_to_all")`` on its expert axis, where that plan
    splits the tokens as the variant does."""
    found = []
    for _, planned in starting_plans(program, cluster):
        choice = assignment_of(planned, layout)
        if choice is not None and choice not in found:
            found.append(choice)
    if dispatch is not None:
        variant, chosen = dispatch
        try:
            expert_parallel(program, cluster, axis=variant.axis, dispatch="all_to_all")
        except FxparError:  # a batch that does not split over every axis: no such start
            return tuple(found)
        finally:
            offer(chosen, cluster)  # the plan gave the blocks' nodes candidates of its own
        choice = assignment_of(program, layout)
        if choice is not None and choice not in found:
            found.append(choice)
    return tuple(found)


def _first_misfit(program: Program) -> str:
    """What a manual plan did wrong: the first node it left without a strategy, or gave one
    that is not among its candidates (a pass before it may have removed that candidate)."""
    for node in program.graph.nodes:
        strategies = ir.get(node, Strategies)
        if strategies is None:
            continue
        sharding = ir.get(node, Sharding)
        if sharding is None:
            return f"left node {node.name!r} ({node.target}) without a strategy"
        if sharding.strategy not in strategies.candidates:
            offered = sorted({spec_str(c.outputs[0]) for c in strategies.candidates})
            return (
                f"gave node {node.name!r} the output spec {spec_str(sharding.strategy.outputs[0])}"
                f", which is not among its candidates (outputs {offered}); a pass before the "
                "choice may have removed it"
            )
    return "gave a choice the problem cannot represent"
