"""Plan files: save a plan as JSON a person can read and edit, and load it back without solving.

The file (format ``fxpar-plan``, version 1)::

    {
      "format": "fxpar-plan", "version": 1,
      "cluster": {"mesh_shape": [2, 2], "axis_names": ["axis0", "axis1"], ...},
      "options": {"optimizer_states": 2, "memory_limit": null},
      "solution": {"solver": "ilp", "status": "optimal", "objective": 0.00102, "gap": 0.0},
      "placements": {"wte.weight": "RR", "blocks.0.attn.qkv.weight": "S(0)S(0)", ...},
      "strategies": {"addmm": {"op": "aten.addmm.default",
                               "inputs": ["S(0)S(0)", "S(0)R", "S(1)R"], "outputs": ["S(0)P"]}},
      "report": {...}
    }

``placements`` gives every input of the step (parameters, buffers, batch) by its name;
``strategies`` gives every op node of the captured Program by node name. Specs are written one
token per mesh axis: ``S(d)`` shard on dim d, ``R`` replicate, ``P`` partial sum (``(S(0), R)``
is read too). ``report`` is the plan report of the saved plan, for reading; loading ignores it.

Editing a placement changes where that tensor lives and nothing else: the ops reading it keep
their strategies, so the lowering reshards the tensor into the layout each of them reads (and the
gradient back into the new placement), and the loaded plan is scored with that resharding.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import re
import time
from collections.abc import Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from fxpar import ir
from fxpar.cluster import Cluster
from fxpar.errors import FxparError
from fxpar.ir.program import Program
from fxpar.planning.problem import Layout, PlanOptions, assignment_of, build_problem, candidates
from fxpar.planning.report import compact_spec, report_data
from fxpar.sharding import Sharding, Spec, Strategies, Strategy
from fxpar.solvers.problem import IntraOpProblem, IntraOpSolution

if TYPE_CHECKING:
    from fxpar.planning.plan import Plan

logger = logging.getLogger(__name__)

FORMAT = "fxpar-plan"
VERSION = 1


class PlanFileError(FxparError):
    """A plan file cannot be applied to this Program: wrong format or version, another mesh, a
    node or input the Program does not have, or a strategy the node cannot take."""


# -- specs --------------------------------------------------------------------------------------

_TOKEN = re.compile(r"S\((\d+)\)|R|P")
_SPEC = re.compile(r"\(?\s*(?:(?:S\(\d+\)|R|P)\s*,?\s*)+\)?")


def parse_spec(text: str, mesh_ndim: int, where: str = "spec") -> Spec:
    """A spec from ``S(0)R`` or ``(S(0), R)``: one placement per mesh axis."""
    if not isinstance(text, str) or not _SPEC.fullmatch(text.strip()):
        raise PlanFileError(
            f"{where}: cannot read spec {text!r}; write one token per mesh axis, S(d) to shard "
            "dim d, R to replicate, P for a partial sum, e.g. 'S(0)R'"
        )
    placements: list[Placement] = []
    for match in _TOKEN.finditer(text):
        token = match.group(0)
        if token == "R":
            placements.append(Replicate())
        elif token == "P":
            placements.append(Partial())
        else:
            try:
                placements.append(Shard(int(match.group(1))))
            except (TypeError, OverflowError, ValueError):  # beyond a C int: no tensor's dim
                raise PlanFileError(
                    f"{where}: spec {text!r} shards dim {match.group(1)}, which no tensor has"
                ) from None
    if len(placements) != mesh_ndim:
        raise PlanFileError(
            f"{where}: spec {text!r} has {len(placements)} placements but the mesh has "
            f"{mesh_ndim} axes"
        )
    return tuple(placements)


# -- saving -------------------------------------------------------------------------------------


def cluster_to_dict(cluster: Cluster) -> dict[str, Any]:
    return cluster.to_dict()


def cluster_from_dict(data: Mapping[str, Any]) -> Cluster:
    try:
        return Cluster.from_dict(data)
    except FxparError as error:
        raise PlanFileError(f"the plan file's cluster is not readable: {error}") from error


def plan_document(plan: Plan) -> dict[str, Any]:
    """The JSON document of ``plan`` (what :func:`save_plan` writes)."""
    program = plan.program
    placements = {}
    for name, node in program.placeholders().items():
        placements[name] = compact_spec(ir.require(node, Sharding).strategy.outputs[0])
    strategies = {}
    for node in program.graph.nodes:
        if node.op == "placeholder":
            continue
        sharding = ir.get(node, Sharding)
        if sharding is None:
            continue
        strategies[node.name] = {
            "op": str(node.target),
            "inputs": [compact_spec(s) for s in sharding.strategy.inputs],
            "outputs": [None if s is None else compact_spec(s) for s in sharding.strategy.outputs],
        }
    solution = plan.solution
    return {
        "format": FORMAT,
        "version": VERSION,
        "cluster": cluster_to_dict(plan.cluster),
        "options": {
            "optimizer_states": plan.options.optimizer_states,
            "memory_limit": plan.options.memory_limit,
        },
        "solution": {
            "solver": solution.solver,
            "status": solution.status,
            "objective": solution.objective,
            "gap": None if math.isnan(solution.gap) else solution.gap,
        },
        "placements": placements,
        "strategies": strategies,
        "report": report_data(plan),
    }


def save_plan(plan: Plan, path: str | Path) -> Path:
    """Write ``plan`` as JSON to ``path``; returns the path."""
    target = Path(path)
    target.write_text(json.dumps(plan_document(plan), indent=1) + "\n")
    return target


# -- loading ------------------------------------------------------------------------------------


def read_plan(path: str | Path) -> dict[str, Any]:
    """The plan document saved at ``path``, checked for its format and version."""
    return _read(Path(path))


@contextlib.contextmanager
def _naming(path: str | Path) -> Iterator[None]:
    """Let every :class:`PlanFileError` raised inside say which file it is about."""
    try:
        yield
    except PlanFileError as error:
        if str(path) in str(error):
            raise
        raise PlanFileError(f"the plan file {path}: {error}") from error


def saved_cluster(path: str | Path, cluster: Cluster | None = None) -> Cluster:
    """The cluster to load the plan at ``path`` on: ``cluster`` if given (it must have the
    saved mesh shape; the plan is then priced on it), else the one saved in the file."""
    document = _read(Path(path))
    with _naming(path):
        saved = cluster_from_dict(_section(document, "cluster", dict))
    if cluster is None:
        return saved
    if cluster.mesh_shape != saved.mesh_shape:
        raise PlanFileError(
            f"the plan in {path} is for a mesh of shape {saved.mesh_shape}, but the "
            f"cluster given has mesh {cluster.mesh_shape}; pass a cluster with mesh "
            f"{saved.mesh_shape}, or plan again for this one"
        )
    return cluster


def apply_plan(
    program: Program, cluster: Cluster, document: Mapping[str, Any], path: str | Path
) -> tuple[IntraOpProblem, IntraOpSolution, Layout, PlanOptions]:
    """Give every node of ``program`` (annotated with its candidates) its strategy from a
    plan ``document`` and score the result by the cost model, without running a solver.
    Raises :class:`PlanFileError` naming the node or input that does not fit."""
    start = time.perf_counter()
    with _naming(path):
        options = _options(_section(document, "options", dict))
        saved_solution = _section(document, "solution", dict)
        _apply(program, cluster, document)
    # Scored like a manual plan. The exact problem (no merged layers) fits any assignment but
    # is slow to build on large graphs; an unedited plan from the solver fits the problem with
    # merged layers, whose objective for the same assignment is the same.
    for coarsen, dedup_layers in ((False, True), (False, False)):
        options = replace(options, coarsen=coarsen, dedup_layers=dedup_layers)
        problem, layout = build_problem(program, cluster, options)
        choice = assignment_of(program, layout)
        if choice is not None:
            break
    if choice is None:  # every strategy was checked against the candidates above
        raise PlanFileError(f"the plan in {path} does not give every node one of its strategies")
    solution = IntraOpSolution(
        choice,
        problem.objective(choice),
        "feasible",
        math.nan,
        f"{saved_solution.get('solver', 'plan file')!s:.40} (loaded)",
        time.perf_counter() - start,
    )
    memory = problem.memory(choice)
    if problem.memory_limit is not None and memory > problem.memory_limit:
        logger.warning(
            "the plan loaded from %s needs %.1f MiB per device, over the limit of %.1f MiB",
            path, memory / 2**20, problem.memory_limit / 2**20,
        )  # fmt: skip
    return problem, solution, layout, options


def _read(path: Path) -> dict[str, Any]:
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as error:  # ValueError: not UTF-8, not JSON
        raise PlanFileError(f"cannot read the plan file {path}: {error}") from error
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise PlanFileError(
            f'{path} is not an fxpar plan file (no "format": "{FORMAT}"); write one with '
            "Plan.save(path)"
        )
    version = document.get("version")
    if version != VERSION:
        raise PlanFileError(
            f"{path} has plan format version {version!r}, but this fxpar reads version "
            f"{VERSION}; save the plan again with this fxpar version"
        )
    return document


def _section(document: Mapping[str, Any], name: str, kind: type) -> Any:
    value = document.get(name)
    if not isinstance(value, kind):
        raise PlanFileError(f"the plan file has no {name!r} {kind.__name__}")
    return value


def _options(saved: Mapping[str, Any]) -> PlanOptions:
    """The memory model's options the plan was made with, checked for their types."""
    states = saved.get("optimizer_states", 2)
    if type(states) is not int or states < 0:
        raise PlanFileError(
            f'"optimizer_states" under "options" is {states!r}, not a whole number >= 0'
        )
    limit = saved.get("memory_limit")
    if limit is not None and not (_is_number(limit) and math.isfinite(limit) and limit > 0):
        raise PlanFileError(
            f'"memory_limit" under "options" is {limit!r}, not null or a number of bytes > 0'
        )
    return PlanOptions(optimizer_states=states, memory_limit=limit)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _apply(program: Program, cluster: Cluster, document: Mapping[str, Any]) -> None:
    """Annotate every placeholder and op of ``program`` with its strategy from the file."""
    ndim = cluster.ndim
    placements = _section(document, "placements", dict)
    strategies = _section(document, "strategies", dict)
    placeholders = program.placeholders()
    unknown = sorted(set(placements) - set(placeholders))
    if unknown:
        raise PlanFileError(
            f"placement of {unknown[0]!r}: the Program has no parameter, buffer or input of that "
            f"name ({len(unknown)} unknown); its inputs look like {list(placeholders)[:3]}"
        )
    for name, node in placeholders.items():
        if name not in placements:
            raise PlanFileError(
                f'the plan file has no placement for {name!r}; add it under "placements" '
                '(e.g. "RR" to replicate it) or save the plan again from this model'
            )
        where = f"placement of {name!r}"
        spec = parse_spec(placements[name], ndim, where)
        strategy = Strategy((spec,), ())
        if strategy not in candidates(node):
            shape = ir.require(node, ir.ValueMeta).tensor.shape
            valid = sorted({compact_spec(s.outputs[0]) for s in candidates(node)})
            raise PlanFileError(
                f"{where}: {placements[name]} is not a placement of its shape {list(shape)} on "
                f"mesh {cluster.mesh_shape} (shards must split evenly); valid placements are "
                f"{valid}"
            )
        ir.annotate(node, Sharding(strategy))
    nodes = {node.name: node for node in program.graph.nodes}
    for name in strategies:
        named = nodes.get(name)
        if named is None:
            raise PlanFileError(
                f"the plan file has a strategy for node {name!r}, which the Program does not "
                "have; capture the same model with the same example shapes (node names follow "
                "the graph), or delete that entry"
            )
        if named.op == "placeholder":
            raise PlanFileError(
                f'node {name!r} is an input of the step; set its spec under "placements" by '
                'its parameter or input name, not under "strategies"'
            )
    for node in program.graph.nodes:
        if node.op == "placeholder" or ir.get(node, Strategies) is None:
            continue
        entry = strategies.get(node.name)
        if entry is None:
            raise PlanFileError(
                f"the plan file has no strategy for node {node.name!r} ({node.target}); it was "
                "saved from another capture of the model, or the entry was deleted"
            )
        ir.annotate(node, Sharding(_strategy(node, entry, ndim)))


def _strategy(node: Any, entry: Any, ndim: int) -> Strategy:
    where = f"node {node.name!r} ({node.target})"
    if not (
        isinstance(entry, dict)
        and isinstance(entry.get("inputs"), list)
        and isinstance(entry.get("outputs"), list)
    ):
        raise PlanFileError(f'{where}: its strategy needs "inputs" and "outputs" lists')
    if "op" in entry and entry["op"] != str(node.target):
        raise PlanFileError(
            f"{where}: the plan file says this node runs {entry['op']}; it was saved from "
            "another model or capture"
        )
    inputs = tuple(parse_spec(s, ndim, f"{where} input {i}") for i, s in enumerate(entry["inputs"]))
    outputs = tuple(
        None if s is None else parse_spec(s, ndim, f"{where} output {i}")
        for i, s in enumerate(entry["outputs"])
    )
    strategy = Strategy(outputs, inputs)
    options = candidates(node)
    if strategy not in options:
        shown = ", ".join(_written(s) for s in options[:6])
        more = f" and {len(options) - 6} more" if len(options) > 6 else ""
        raise PlanFileError(
            f"{where}: strategy {_written(strategy)} is not one of its {len(options)} "
            f"candidates on this mesh: {shown}{more}"
        )
    return strategy


def _written(strategy: Strategy) -> str:
    ins = ", ".join(compact_spec(s) for s in strategy.inputs)
    outs = ", ".join(compact_spec(s) for s in strategy.outputs)
    return f"[{ins}] -> [{outs}]"


__all__ = [
    "FORMAT",
    "VERSION",
    "PlanFileError",
    "apply_plan",
    "cluster_from_dict",
    "cluster_to_dict",
    "parse_spec",
    "plan_document",
    "read_plan",
    "save_plan",
    "saved_cluster",
]
